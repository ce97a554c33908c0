/*
 * Each instruction-set path held against the others: CTRAIN_ISA caps the
 * paths ctrain and oneDNN take (src/core/cpu.c), so the same bf16 GPT trains under each cap to the loss of the widest
 * path (within bf16 rounding), `ctrain version` names the capped paths, and
 * each capped path is as deterministic across thread counts as the widest.
 */
#include "cli_util.h"

#define ISA_FLAGS "train --model gpt --layers 2 --heads 4 --dim 128 --context 64 --batch 8 --mixed bf16 " \
                  "--log-every 0 --limit-test 1"

static const char *const caps[] = {"portable", "avx2", "avx512", "avx512bf16"};

TEST(isa_capped_paths_train_like_the_widest)
{
    static char out[OUT_MAX];
    int rc = RUN(out, ISA_FLAGS " --steps 12 --threads 1");
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed (%d):\n%s", rc, out);
    double want = number_after(out, "final train loss ");
    for (size_t i = 0; i < sizeof caps / sizeof *caps; i++) {
        char env[64];
        snprintf(env, sizeof env, "CTRAIN_ISA=%s", caps[i]);
        rc = run_sh(0, env, out, "version");
        ASSERT_EQ(rc, 0);
        char named[96];
        snprintf(named, sizeof named, "(capped by CTRAIN_ISA=%s)", caps[i]);
        ASSERT_STR_CONTAINS(out, named);
        rc = run_sh(0, env, out, ISA_FLAGS " --steps 12 --threads 1");
        if (rc) ct_test_fail(__FILE__, __LINE__, "train under %s failed (%d):\n%s", env, rc, out);
        double got = number_after(out, "final train loss ");
        /* the same bf16 numbers summed in other orders: close, not equal */
        if (!(fabs(got - want) < 0.02))
            ct_test_fail(__FILE__, __LINE__, "under %s the loss is %.6f, the widest path's %.6f", env, got, want);
    }
}

TEST(isa_avx2_path_bits_match_one_thread)
{
    static char out[OUT_MAX];
    char *one = path_in("one.safetensors"), *two = path_in("two.safetensors");
    for (int t = 1; t <= 2; t++) {
        int rc = run_sh(0, "CTRAIN_ISA=avx2", out, ISA_FLAGS " --steps 3 --threads %d --save %s", t, t == 1 ? one : two);
        if (rc) ct_test_fail(__FILE__, __LINE__, "train failed (%d):\n%s", rc, out);
    }
    same_files(one, two);
}

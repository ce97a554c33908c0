/*
 * --clip-filter GLOBS through ctrain train: --clip measures and scales only
 * the matching parameters (ct_strategy_clip_grad_norm_filter).  One process
 * and 2 ranks under ddp, zero2, fsdp and offload train the same weights
 * with it; the filter changes the run (and a filter that takes every
 * parameter does not); a resume keeps it; globs that match nothing, and
 * fsdp --offload, are refused with the reason.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cli_util.h"

#define ARGS "train --model mlp --hidden 64 --batch 24 --threads 1 --log-every 0 --limit-train 2000 --limit-test 16 " \
             "--seed 5 --lr 0.01 --clip 0.05"

static void close_files(const char *a, const char *b, double tol, int *differ)
{
    ct_safetensors *x, *y;
    ASSERT_OK(ct_safetensors_load(a, &x));
    ASSERT_OK(ct_safetensors_load(b, &y));
    double worst = 0;
    for (int i = 0; i < ct_safetensors_count(x); i++) {
        ct_tensor *tx = ct_safetensors_tensor(x, i), *ty = ct_safetensors_find(y, ct_safetensors_name(x, i));
        ASSERT(ty && tx->numel == ty->numel);
        for (int64_t j = 0; j < tx->numel; j++) worst = fmax(worst, fabs(ct_f32(tx)[j] - ct_f32(ty)[j]));
    }
    ct_safetensors_destroy(x);
    ct_safetensors_destroy(y);
    if (differ) *differ = worst > tol;
    else if (!(worst <= tol)) ct_test_fail(__FILE__, __LINE__, "%s and %s differ by %g (tolerance %g)", a, b, worst, tol);
}

TEST(cli_clip_filter_every_strategy_equals_one_process)
{
    static char out[OUT_MAX];
    char ref[512], path[512], all[512], none[512];
    snprintf(ref, sizeof ref, "%s/ref.safetensors", ct_test_tmpdir());
    snprintf(all, sizeof all, "%s/all.safetensors", ct_test_tmpdir());
    snprintf(none, sizeof none, "%s/none.safetensors", ct_test_tmpdir());
    int rc = RUN(out, ARGS " --steps 6 --clip-filter '*.weight' --save %s", ref);
    if (rc) ct_test_fail(__FILE__, __LINE__, "one process failed:\n%s", out);
    static const char *const kinds[] = {"ddp", "zero2", "fsdp", "offload"};
    for (int k = 0; k < 4; k++) {
        snprintf(path, sizeof path, "%s/%s.safetensors", ct_test_tmpdir(), kinds[k]);
        rc = run_np(2, out, ARGS " --steps 6 --strategy %s%s --clip-filter '*.weight' --save %s", kinds[k],
                    k == 3 ? " --slices 2" : "", path);
        if (rc) ct_test_fail(__FILE__, __LINE__, "%s failed:\n%s", kinds[k], out);
        close_files(ref, path, 2e-5, NULL);
    }
    /* the filter is real: clipping every parameter ends elsewhere; a filter of every name does not */
    rc = RUN(out, ARGS " --steps 6 --save %s", all);
    ASSERT_EQ(rc, 0);
    int differ = 0;
    close_files(ref, all, 1e-6, &differ);
    ASSERT(differ);
    rc = RUN(out, ARGS " --steps 6 --clip-filter '*.weight,*.bias' --save %s", none);
    ASSERT_EQ(rc, 0);
    same_files(all, none);
}

TEST(cli_clip_filter_resumes_and_refuses)
{
    static char out[OUT_MAX];
    char a[512], b[512], c[512];
    snprintf(a, sizeof a, "%s/a.safetensors", ct_test_tmpdir());
    snprintf(b, sizeof b, "%s/b.safetensors", ct_test_tmpdir());
    snprintf(c, sizeof c, "%s/c.safetensors", ct_test_tmpdir());
    ASSERT_EQ(RUN(out, ARGS " --steps 3 --clip-filter '0.*' --save %s", a), 0);
    /* the checkpoint brings the filter back */
    int rc = RUN(out, "train --resume %s --steps 6 --save %s --threads 1 --log-every 0 --limit-train 2000 "
                 "--limit-test 16", a, b);
    if (rc) ct_test_fail(__FILE__, __LINE__, "resume failed:\n%s", out);
    ASSERT_EQ(RUN(out, ARGS " --steps 6 --clip-filter '0.*' --save %s", c), 0);
    same_files(b, c);
    ASSERT_EQ(RUN(out, ARGS " --steps 1 --clip-filter 'nothing.*'"), 2);
    ASSERT_STR_CONTAINS(out, "matches no trainable parameter");
    ASSERT_EQ(RUN(out, "train --model mlp --steps 1 --clip-filter '*.weight'"), 2);
    ASSERT_STR_CONTAINS(out, "--clip is not given");
    ASSERT_EQ(run_np(2, out, ARGS " --steps 1 --strategy fsdp --offload params --clip-filter '*.weight'"), 2);
    ASSERT_STR_CONTAINS(out, "per flat");
    ASSERT_EQ(RUN(out, "train --help"), 0);
    ASSERT_STR_CONTAINS(out, "--clip-filter");
}

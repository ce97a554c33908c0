/*
 * The cnn with --batchnorm through the ctrain program: with
 * --sync-batchnorm, DDP and ZeRO-2 over 2 ranks train what one process
 * trains on the same global batch (the loss of every step and the test
 * loss, which reads the running statistics), the model's metadata says
 * batchnorm so eval rebuilds it, and misuse is one clear line.
 */
#include "cli_util.h"

#define BN_FLAGS "--model cnn --batchnorm --hidden 4,8,16 --steps 4 --batch 30 --threads 1 --log-every 0 " \
                 "--limit-train 256 --limit-test 64"

TEST(cli_batchnorm_sync_over_ranks_equals_one_process)
{
    static char one[OUT_MAX], two[OUT_MAX];
    const char *data = tiny_data();
    int rc = RUN(one, "train " BN_FLAGS " --data-dir %s --save %s", data, path_in("one.safetensors"));
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", one);
    ASSERT_STR_CONTAINS(one, "cnn [4,8,16] 3x3 batchnorm");
    double l1 = number_after(one, "final train loss "), t1 = number_after(one, "test: loss ");
    const char *kinds[] = {"ddp", "zero2"};
    for (int k = 0; k < 2; k++) {
        rc = run_np(2, two, "train " BN_FLAGS " --data-dir %s --strategy %s --sync-batchnorm", data, kinds[k]);
        if (rc) ct_test_fail(__FILE__, __LINE__, "%s failed:\n%s", kinds[k], two);
        ASSERT_NEAR(number_after(two, "final train loss "), l1, 2e-5);
        ASSERT_NEAR(number_after(two, "test: loss "), t1, 2e-5);
    }
    /* eval rebuilds the batchnorm model from the metadata and agrees */
    rc = RUN(two, "eval --checkpoint %s --data-dir %s --limit-test 64", path_in("one.safetensors"), data);
    if (rc) ct_test_fail(__FILE__, __LINE__, "eval failed:\n%s", two);
    ASSERT_NEAR(number_after(two, "test: loss "), t1, 1e-4);
}

/* --strategy-opt buffer_dtype=bf16: the running statistics fsdp saves are
 * bf16 values, and the run tests as one process with the option does. */
TEST(cli_batchnorm_buffer_dtype_bf16_under_fsdp)
{
    static char one[OUT_MAX], two[OUT_MAX];
    const char *data = tiny_data();
    int rc = RUN(one, "train " BN_FLAGS " --data-dir %s --strategy-opt buffer_dtype=bf16", data);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", one);
    rc = run_np(2, two, "train " BN_FLAGS " --data-dir %s --strategy fsdp --sync-batchnorm "
                "--strategy-opt buffer_dtype=bf16,wrap_kinds=conv2d --save %s", data, path_in("bf16.safetensors"));
    if (rc) ct_test_fail(__FILE__, __LINE__, "fsdp failed:\n%s", two);
    ASSERT_NEAR(number_after(two, "test: loss "), number_after(one, "test: loss "), 1e-3);
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(path_in("bf16.safetensors"), &st));
    int stats = 0;
    for (int i = 0; i < ct_safetensors_count(st); i++) {
        const char *nm = ct_safetensors_name(st, i);
        if (!strstr(nm, "running_")) continue;
        const ct_tensor *t = ct_safetensors_find(st, nm);
        stats++;
        for (int64_t k = 0; k < t->numel; k++)
            if (ct_f32(t)[k] != ct_bf16_to_f32(ct_f32_to_bf16(ct_f32(t)[k])))
                ct_test_fail(__FILE__, __LINE__, "%s[%lld] is not a bf16 value", nm, (long long)k);
    }
    ASSERT(stats >= 4);
    ct_safetensors_destroy(st);
}

TEST(cli_batchnorm_usage_errors)
{
    static char out[OUT_MAX];
    int rc = RUN(out, "train --model mlp --batchnorm --steps 1");
    ASSERT_EQ(rc, 2);
    ASSERT_STR_CONTAINS(out, "--batchnorm applies to --model cnn only");
    rc = run_np(2, out, "train " BN_FLAGS " --data-dir %s --strategy pipe --sync-batchnorm", tiny_data());
    ASSERT_EQ(rc, 2);
    ASSERT_STR_CONTAINS(out, "sync_batchnorm=1 applies to ddp, zero1, zero2 and fsdp");
}

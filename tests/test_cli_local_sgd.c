/*
 * Post-local SGD through ctrain train (--local-sgd SUB:START:PERIOD, ddp's
 * local_sgd options): the step report's messages fall to the averaging's
 * parameter bytes; a run saved right after an averaging step and resumed
 * is the run that never stopped, bit for bit; the flag is refused where it
 * makes no sense.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_util.h"

#define ARGS "--model mlp --hidden 64 --batch 24 --threads 1 --log-every 0 --limit-train 2000 --limit-test 16 --seed 5"
#define P 50890 /* 784 x 64 + 64 + 64 x 10 + 10 */
#define SMALL 64

/* The summary's "sent" of rank r. */
static double sent_of(const char *metrics, int r)
{
    char line[1 << 14] = "", key[64];
    FILE *f = fopen(metrics, "r");
    ASSERT(f);
    while (fgets(line, sizeof line, f) && !strstr(line, "\"summary\"")) {}
    fclose(f);
    snprintf(key, sizeof key, "{\"rank\":%d,\"sent\":", r);
    const char *p = strstr(line, key);
    if (!p) ct_test_fail(__FILE__, __LINE__, "no %s in: %s", key, line);
    return strtod(p + strlen(key), NULL);
}

TEST(cli_local_sgd_traffic_is_the_averaging)
{
    static char out[OUT_MAX];
    const char *metrics = path_in("lsgd.jsonl");
    /* MPI messages only (no shared memory): 6 steps, averaged after steps 0 and 3: two allreduces of
     * the 4P parameter bytes, 2 (N-1)/N 4P each at N = 2, over 6 steps */
    int rc = run_sh(2, "CTRAIN_COMM_SHM=0 ", out, "train " ARGS " --steps 6 --local-sgd none:0:3 --metrics %s",
                    metrics);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
    double want = 2.0 * 4 * P / 6;
    for (int r = 0; r < 2; r++) {
        double s = sent_of(metrics, r);
        if (s < want || s > want + SMALL)
            ct_test_fail(__FILE__, __LINE__, "rank %d sent %.0f bytes a step; want %.0f (+ at most %d)\n%s", r, s,
                         want, SMALL, out);
    }
    /* plain DDP sends every step's gradients: three times as much */
    rc = run_sh(2, "CTRAIN_COMM_SHM=0 ", out, "train " ARGS " --steps 6 --metrics %s", metrics);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
    ASSERT(sent_of(metrics, 0) >= 4.0 * P);
}

TEST(cli_local_sgd_resume_after_averaging_is_bit_exact)
{
    static char out[OUT_MAX];
    char a[512], b[512], c[512];
    const char *tmp = ct_test_tmpdir();
    snprintf(a, sizeof a, "%s/a.safetensors", tmp);
    snprintf(b, sizeof b, "%s/b.safetensors", tmp);
    snprintf(c, sizeof c, "%s/c.safetensors", tmp);
    /* start 2, period 3: averaged after steps 2 and 5 (0-based), so the save after 6 steps holds the
     * average, and every rank resumes from it as it was */
    const char *ls = "--local-sgd none:2:3 --optim sgd --momentum 0 --lr 0.05";
    int rc = run_np(2, out, "train " ARGS " %s --steps 6 --save %s", ls, a);
    if (rc) ct_test_fail(__FILE__, __LINE__, "first half failed:\n%s", out);
    rc = run_np(2, out, "train --strategy ddp %s --resume %s --steps 12 --save %s --threads 1 --log-every 0 "
                "--limit-train 2000 --limit-test 16", ls, a, b);
    if (rc) ct_test_fail(__FILE__, __LINE__, "resume failed:\n%s", out);
    rc = run_np(2, out, "train " ARGS " %s --steps 12 --save %s", ls, c);
    if (rc) ct_test_fail(__FILE__, __LINE__, "straight run failed:\n%s", out);
    same_files(b, c);
    /* and local SGD changed the run: plain DDP ends elsewhere */
    rc = run_np(2, out, "train " ARGS " --optim sgd --momentum 0 --lr 0.05 --steps 12 --save %s", a);
    if (rc) ct_test_fail(__FILE__, __LINE__, "ddp run failed:\n%s", out);
    ct_safetensors *x, *y;
    ASSERT_OK(ct_safetensors_load(a, &x));
    ASSERT_OK(ct_safetensors_load(c, &y));
    const ct_tensor *wa = ct_safetensors_find(x, "0.weight"), *wc = ct_safetensors_find(y, "0.weight");
    ASSERT(wa && wc && memcmp(ct_tensor_data(wa), ct_tensor_data(wc), ct_tensor_bytes(wa)));
    ct_safetensors_destroy(x);
    ct_safetensors_destroy(y);
}

TEST(cli_local_sgd_refused_where_it_makes_no_sense)
{
    static char out[OUT_MAX];
    ASSERT_EQ(run_np(2, out, "train " ARGS " --steps 1 --strategy zero1 --local-sgd none"), 2);
    ASSERT_STR_CONTAINS(out, "--local-sgd applies to --strategy ddp");
    ASSERT_EQ(run_np(2, out, "train " ARGS " --steps 1 --local-sgd some:1"), 2);
    ASSERT_STR_CONTAINS(out, "--local-sgd 'some:1' is malformed");
    ASSERT_EQ(run_np(2, out, "train " ARGS " --steps 1 --local-sgd none:1:0"), 2);
    ASSERT_STR_CONTAINS(out, "is malformed");
    ASSERT_EQ(run_np(2, out, "train " ARGS " --steps 1 --local-sgd node --grad-compress bf16"), 2);
    ASSERT_STR_CONTAINS(out, "give one of them");
    ASSERT_EQ(run_np(2, out, "train " ARGS " --steps 1 --strategy-opt local_sgd=none,powersgd_rank=2"), 2);
    ASSERT_STR_CONTAINS(out, "choose one");
    /* the help names it */
    ASSERT_EQ(run_np(1, out, "train --help"), 0);
    ASSERT_STR_CONTAINS(out, "--local-sgd");
}

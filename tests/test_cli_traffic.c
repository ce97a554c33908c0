/*
 * The step report's messages per rank (ct_comm_traffic through ctrain
 * train): the bytes each rank sent and received in a training step, in the
 * text report and the metrics summary, against the volumes a step must move
 * over P f32 parameters at N ranks: DDP's allreduce 2 (N-1)/N 4P each way,
 * FSDP's all-gather and reduce-scatter of its root unit (N-1)/N 4P each
 * (padded to a multiple of N), and none through shared memory, where the
 * two-level allreduce sends over the network from one rank per node only.
 * Besides the gradients a step sends a few bytes (the non-finite check, the
 * loss): at most SMALL.  Beside them, the CPU each rank's communication
 * thread used per step, which those collectives make more than none.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_util.h"

#define ARGS "--model mlp --hidden 64 --steps 3 --batch 24 --threads 1 --log-every 0 --limit-test 16"
#define P 50890 /* 784 x 64 + 64 + 64 x 10 + 10 */
#define SMALL 64

/* The summary's "sent", "received" and "comm_cpu_ms" for rank r. */
static void traffic_of(const char *metrics, int r, double *sent, double *received, double *cpu_ms)
{
    char line[1 << 14] = "", key[64];
    FILE *f = fopen(metrics, "r");
    ASSERT(f);
    while (fgets(line, sizeof line, f) && !strstr(line, "\"summary\"")) {}
    fclose(f);
    const char *t = strstr(line, "\"traffic\":");
    if (!t) ct_test_fail(__FILE__, __LINE__, "no traffic in the summary: %s", line);
    snprintf(key, sizeof key, "{\"rank\":%d,\"sent\":", r);
    const char *p = strstr(t, key);
    if (!p) ct_test_fail(__FILE__, __LINE__, "no %s in: %s", key, t);
    *sent = strtod(p + strlen(key), NULL);
    p = strstr(p, "\"received\":");
    ASSERT(p);
    *received = strtod(p + strlen("\"received\":"), NULL);
    p = strstr(p, "\"comm_cpu_ms\":");
    if (!p) ct_test_fail(__FILE__, __LINE__, "no comm_cpu_ms for rank %d in: %s", r, t);
    *cpu_ms = strtod(p + strlen("\"comm_cpu_ms\":"), NULL);
}

/* Runs train under prefix (environment) at np ranks; want[r]: the gradient bytes rank r must send and receive. */
static void check(const char *prefix, int np, const char *strategy, const double *want)
{
    static char out[OUT_MAX];
    const char *metrics = path_in("traffic.jsonl");
    int rc = run_sh(np, prefix, out, "train " ARGS " --strategy %s --data-dir %s --metrics %s", strategy, tiny_data(),
                    metrics);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "messages per step (mean over 3 steps");
    for (int r = 0; r < np; r++) {
        double s, v, cpu;
        traffic_of(metrics, r, &s, &v, &cpu);
        /* every step drives at least the loss's and the non-finite check's collectives */
        if (!(cpu > 0 && cpu < 1e5))
            ct_test_fail(__FILE__, __LINE__, "%s%s at %d ranks: rank %d's communication thread used %g ms of CPU "
                         "a step\n%s", prefix, strategy, np, r, cpu, out);
        if (s < want[r] || s > want[r] + SMALL || v < want[r] || v > want[r] + SMALL)
            ct_test_fail(__FILE__, __LINE__, "%s%s at %d ranks: rank %d sent %.0f and received %.0f bytes a step; "
                         "want %.0f (+ at most %d)\n%s", prefix, strategy, np, r, s, v, want[r], SMALL, out);
    }
}

TEST(cli_step_report_counts_messages)
{
    /* DDP over MPI (no shared memory): an allreduce of the 4P gradient bytes */
    double ddp2[2] = {2.0 * (2 - 1) / 2 * 4 * P, 2.0 * (2 - 1) / 2 * 4 * P};
    check("CTRAIN_COMM_SHM=0 ", 2, "ddp", ddp2);
    /* FSDP at 3 ranks, one unit (the root: gathered once): all-gather and reduce-scatter */
    int64_t pad = (P + 2) / 3 * 3;
    double f = 2 * (2.0 / 3.0) * 4 * (double)pad, fsdp3[3] = {f, f, f};
    check("CTRAIN_COMM_SHM=0 ", 3, "fsdp", fsdp3);
    /* two (fake) nodes of 2: only the leaders, ranks 0 and 2, send the gradients, once */
    double two[4] = {4.0 * P, 0, 4.0 * P, 0};
    check("CTRAIN_FAKE_NODES=2 ", 4, "ddp", two);
    /* one node: the buckets are summed in shared memory, no gradient bytes in messages */
    double none[2] = {0, 0};
    check("", 2, "ddp", none);
}

/*
 * A model bigger than any rank's memory, as a user meets it: every rank of
 * an 8-rank FSDP job runs in a memory cgroup of its own (scripts/memlimit)
 * whose hard limit is 0.9x the GPT's f32 weights, and the job trains from a
 * fresh init, saves a full file, starts from it and saves a sharded
 * directory, starts from that and saves local pieces, and resumes from
 * those.  A rank that built, loaded, gathered or saved the whole model, or
 * held a unit's whole gradient again (MPI's reduce-scatter did), is killed
 * by the kernel and the job fails.  Skipped, with the reason, where the
 * cgroup v1 memory hierarchy is not writable.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_util.h"

#define NP 8
/* 17M parameters (65 MiB of f32 weights) of narrow blocks, so that a rank's
 * share (1/8 of weights and gradients, a unit or two gathered, activations
 * checkpointed) fits under 0.9x the weights beside the runtime's ~23 MiB. */
#define GPT "--model gpt --layers 28 --dim 224 --heads 4 --context 32 --batch 8 --optim sgd " \
            "--checkpoint-activation --strategy fsdp"
#define RUNOPTS "--threads 1 --log-every 0 --limit-test 16"

/* One job under the limit; fails the test naming the ranks the kernel
 * killed or that went over, then removes the cgroups. */
static void run_limited(const char *tag, int limit_mb, const char *what, const char *args)
{
    static char out[OUT_MAX];
    int code = run_shell(NP, out, "-x CTRAIN_ALLOC_CACHE_MB=4 %s/../scripts/memlimit %s %d %s/ctrain train " GPT " " RUNOPTS " %s",
                         cli_bin_dir(), tag, limit_mb, cli_bin_dir(), args);
    double peak[NP];
    int killed[NP], over = 0;
    memlimit_collect(tag, NP, peak, killed);
    char report[1024] = "";
    for (int r = 0; r < NP; r++) {
        size_t n = strlen(report);
        snprintf(report + n, sizeof report - n, " rank %d %.1f MiB%s", r, peak[r] / 1048576, killed[r] ? " (killed)" : "");
        over += killed[r];
    }
    if (code || over)
        ct_test_fail(__FILE__, __LINE__, "%s under a %d MiB limit per rank: exit %d; cgroup peaks:%s\n%s", what,
                     limit_mb, code, report, out);
}

TEST(cli_fsdp_trains_a_gpt_bigger_than_each_ranks_memory_limit)
{
    if (access("/sys/fs/cgroup/memory", W_OK)) SKIP("/sys/fs/cgroup/memory is not writable (no cgroup v1 memory hierarchy, or not root)");
    static char est[OUT_MAX];
    ASSERT_EQ(RUN(est, "estimate " GPT " --ranks %d", NP), 0);
    double params = number_after(est, "] (");
    double weights_mb = params * 4 / 1048576;
    int limit = (int)(0.9 * weights_mb);
    ASSERT(limit < weights_mb && weights_mb > 60);
    char tag[64], args[1024];
    snprintf(tag, sizeof tag, "ctrain-test-%d", (int)getpid());
    const char *full = path_in("big.safetensors"), *sh = path_in("big-sharded"), *loc = path_in("big-local");
    snprintf(args, sizeof args, "--steps 1 --save %s", full);
    run_limited(tag, limit, "a fresh init saving a full file", args);
    snprintf(args, sizeof args, "--steps 1 --init %s --save %s --state-dict sharded", full, sh);
    run_limited(tag, limit, "--init from the full file saving a sharded directory", args);
    snprintf(args, sizeof args, "--steps 1 --init %s --save %s --state-dict local", sh, loc);
    run_limited(tag, limit, "--init from the sharded directory saving local pieces", args);
    snprintf(args, sizeof args, "--steps 2 --resume %s", loc);
    run_limited(tag, limit, "--resume from local pieces", args);
}

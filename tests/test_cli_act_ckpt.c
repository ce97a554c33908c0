/*
 * `--checkpoint-activation` on the command line, for every strategy: a
 * gpt trained with it saves the same weights bit for bit as without it
 * (dropout on), its memory report's activation bytes fall, and `ctrain
 * estimate --checkpoint-activation` predicts them within the tolerance of
 * the planner's other tests (25% for activations).
 */
#include "cli_util.h"

#define GPT "--model gpt --layers 4 --heads 2 --dim 32 --context 24 --batch 8 --dropout 0.1"
#define RUN_FLAGS "--steps 3 --lr 0.01 --threads 1 --log-every 0"

/* The summary line (the memory report) of a metrics file. */
static void summary(const char *metrics, char *line, size_t n)
{
    FILE *f = fopen(metrics, "r");
    ASSERT(f);
    line[0] = 0;
    while (fgets(line, (int)n, f) && !strstr(line, "\"summary\"")) {}
    fclose(f);
    ASSERT_STR_CONTAINS(line, "\"summary\"");
}

/* strategy (extra flags) on np ranks (0: one process), without and with
 * the flag: same weights, fewer activation bytes, and the estimate's. */
static void check(int np, const char *strategy, const char *extra)
{
    static char out[OUT_MAX], est[OUT_MAX], line[2][8192];
    static const char *dir;
    if (!dir) dir = small_text(300); /* once per test (each runs in a process of its own) */
    double act[2];
    for (int ck = 0; ck < 2; ck++) {
        char *save = path_in(ck ? "ck.safetensors" : "plain.safetensors"), *metrics = path_in("m.jsonl");
        int rc = run_np(np, out, "train " GPT " " RUN_FLAGS " --data-dir %s --strategy %s %s %s --save %s --metrics %s",
                        dir, strategy, extra, ck ? "--checkpoint-activation" : "", save, metrics);
        if (rc) ct_test_fail(__FILE__, __LINE__, "%s %s (checkpointing %d) failed:\n%s", strategy, extra, ck, out);
        if (ck) ASSERT_STR_CONTAINS(out, "activation checkpointing: 4 blocks keep only their input");
        summary(metrics, line[ck], sizeof line[ck]);
        act[ck] = json_max(line[ck], "act");
    }
    same_files(path_in("plain.safetensors"), path_in("ck.safetensors"));
    if (!(act[1] < 0.8 * act[0]))
        ct_test_fail(__FILE__, __LINE__, "%s %s: activation peak %.0f bytes with --checkpoint-activation, %.0f without",
                     strategy, extra, act[1], act[0]);
    int rc = RUN(est, "estimate " GPT " --ranks %d --strategy %s %s --checkpoint-activation --json", np ? np : 1,
                 strategy, extra);
    if (rc) ct_test_fail(__FILE__, __LINE__, "estimate %s %s failed:\n%s", strategy, extra, est);
    double e = json_max(est, "act");
    if (!(fabs(e - act[1]) <= 0.25 * act[1]))
        ct_test_fail(__FILE__, __LINE__, "%s %s: estimate --checkpoint-activation says %.0f activation bytes, the run "
                     "measured %.0f", strategy, extra, e, act[1]);
}

TEST(cli_act_ckpt_replicated_and_zero)
{
    check(0, "none", "");
    check(2, "ddp", "--grad-accum 2");
    check(2, "zero1", "--mixed bf16");
    check(2, "zero2", "");
}

TEST(cli_act_ckpt_fsdp_pipe_offload)
{
    check(2, "fsdp", "");
    check(2, "fsdp", "--strategy-opt sharding=grad_op --mixed bf16");
    check(2, "pipe", "--strategy-opt checkpoint=never");
    check(2, "offload", "--strategy-opt slices=3");
}

/* The flag is refused nowhere, and the estimate of a model it cannot wrap says why. */
TEST(cli_act_ckpt_usage)
{
    static char out[OUT_MAX];
    int rc = RUN(out, "estimate --model mlp --ranks 2 --checkpoint-activation --strategy ddp");
    if (rc) ct_test_fail(__FILE__, __LINE__, "estimate of a checkpointed mlp failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "ddp");
    rc = RUN(out, "train --model mlp --hidden 16 --steps 1 --limit-train 64 --limit-test 16 --log-every 0 "
             "--checkpoint-activation --data-dir %s", tiny_data());
    if (rc) ct_test_fail(__FILE__, __LINE__, "train --checkpoint-activation of an mlp failed:\n%s", out);
    /* offload's micro-batches keep only the checkpointed layers' inputs: allowed */
    rc = RUN(out, "train --model mlp --hidden 16 --steps 1 --limit-train 64 --limit-test 16 --log-every 0 "
             "--strategy offload --slices 2 --microbatches 2 --checkpoint-activation --data-dir %s", tiny_data());
    if (rc) ct_test_fail(__FILE__, __LINE__, "offload --microbatches 2 --checkpoint-activation failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "activation checkpointing on (each layer)");
}

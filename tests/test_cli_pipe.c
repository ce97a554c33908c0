/*
 * `ctrain train --strategy pipe` as a user runs it: pipelined runs of the
 * mlp (with dropout) and the cnn at 2, 3 and 4 ranks train the weights one
 * process trains, evaluate alike, save one full checkpoint that resumes at
 * another stage count and under another strategy, report memory per stage,
 * and every bad pipeline flag is one clear line.
 */
#include <libgen.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli_util.h"

/* "ctrain ARGS" under mpirun -np np (np 0: alone), stderr joined; the exit code. */
/* Every tensor of checkpoint a equals b's within tol. */
static void same_tensors(const char *a, const char *b, double tol)
{
    ct_safetensors *x, *y;
    ASSERT_OK(ct_safetensors_load(a, &x));
    ASSERT_OK(ct_safetensors_load(b, &y));
    ASSERT_EQ(ct_safetensors_count(x), ct_safetensors_count(y));
    for (int i = 0; i < ct_safetensors_count(x); i++) {
        ct_tensor *tx = ct_safetensors_tensor(x, i), *ty = ct_safetensors_find(y, ct_safetensors_name(x, i));
        if (!ty) ct_test_fail(__FILE__, __LINE__, "%s has no %s", b, ct_safetensors_name(x, i));
        ASSERT(tx->numel == ty->numel && tx->dtype == ty->dtype);
        if (tx->dtype == CT_I64) {
            ASSERT_EQ(((int64_t *)ct_tensor_data(tx))[0], ((int64_t *)ct_tensor_data(ty))[0]);
            continue;
        }
        for (int64_t j = 0; j < tx->numel; j++) ASSERT_CLOSE(ct_f32(tx)[j], ct_f32(ty)[j], tol, tol);
    }
    ct_safetensors_destroy(x);
    ct_safetensors_destroy(y);
}

#define SMALL "--limit-train 2000 --limit-test 1000 --threads 1 --log-every 1"
#define MLP SMALL " --model mlp --dropout 0.2 --batch 48 --seed 2"

/* The mlp with dropout has 7 children: Linear ReLU Dropout Linear ReLU Dropout Linear. */
TEST(cli_pipe_matches_single_process)
{
    static char out[OUT_MAX];
    char ref[512], path[512];
    snprintf(ref, sizeof ref, "%s/one.safetensors", ct_test_tmpdir());
    int code = run_np(0, out, "train " MLP " --steps 5 --save %s", ref);
    if (code) ct_test_fail(__FILE__, __LINE__, "single process failed:\n%s", out);
    double l1 = number_after(out, "final train loss "), acc1 = number_after(out, "accuracy ");
    static const struct { int np; const char *flags, *says; } runs[] = {
        {2, "--chunks 3 --schedule gpipe", "pipeline: 2 stages (children per stage"},
        {3, "--balance 3,3,1 --pipe-schedule 1f1b --pipe-checkpoint always --chunks 5", "pipeline: 3 stages (children per stage 3:3:1) x 1 replica"},
        {4, "--stages 2 --pipe-checkpoint never --chunks 2", "pipeline: 2 stages (children per stage 1:6) x 2 replicas"},
        {4, "--stages 4 --balance 2,2,2,1 --chunks 16", "pipeline: 4 stages"},
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        snprintf(path, sizeof path, "%s/pipe%zu.safetensors", ct_test_tmpdir(), i);
        code = run_np(runs[i].np, out, "train " MLP " --steps 5 --strategy pipe %s --save %s", runs[i].flags, path);
        if (code) ct_test_fail(__FILE__, __LINE__, "pipe %s at %d ranks failed:\n%s", runs[i].flags, runs[i].np, out);
        ASSERT_STR_CONTAINS(out, runs[i].says);
        ASSERT_STR_CONTAINS(out, "(pipe)");
        ASSERT_STR_CONTAINS(out, "rank 0      rank 1");  /* memory per stage */
        ASSERT_STR_CONTAINS(out, "the pipeline's bubble");
        ASSERT_NEAR(number_after(out, "final train loss "), l1, 1e-5);
        ASSERT_NEAR(number_after(out, "accuracy "), acc1, 1e-9); /* eval through the pipeline */
        same_tensors(ref, path, 2e-5);
    }
}

/* A pipelined run saves one full state dict: it resumes at another stage
 * count and under DDP, and both continue as the straight run does. */
TEST(cli_pipe_checkpoint_resumes_anywhere)
{
    static char out[OUT_MAX];
    char straight[512], half[512], a[512], b[512], sa[600], sb[600];
    snprintf(straight, sizeof straight, "%s/straight.safetensors", ct_test_tmpdir());
    snprintf(half, sizeof half, "%s/half.safetensors", ct_test_tmpdir());
    snprintf(a, sizeof a, "%s/a.safetensors", ct_test_tmpdir());
    snprintf(b, sizeof b, "%s/b.safetensors", ct_test_tmpdir());
    int code = run_np(0, out, "train " MLP " --steps 6 --save %s", straight);
    if (code) ct_test_fail(__FILE__, __LINE__, "straight run failed:\n%s", out);
    double l = number_after(out, "final train loss ");
    code = run_np(2, out, "train " MLP " --steps 3 --strategy pipe --chunks 4 --save %s", half);
    if (code) ct_test_fail(__FILE__, __LINE__, "first half failed:\n%s", out);
    code = run_np(3, out, "train --steps 6 --strategy pipe --chunks 2 --resume %s --save %s " SMALL, half, a);
    if (code) ct_test_fail(__FILE__, __LINE__, "resume at 3 stages failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "pipeline: 3 stages");
    ASSERT_NEAR(number_after(out, "final train loss "), l, 1e-5);
    same_tensors(straight, a, 2e-5);
    code = run_np(2, out, "train --steps 6 --strategy ddp --resume %s --save %s " SMALL, half, b);
    if (code) ct_test_fail(__FILE__, __LINE__, "resume under ddp failed:\n%s", out);
    ASSERT_NEAR(number_after(out, "final train loss "), l, 1e-5);
    same_tensors(straight, b, 2e-5);
    /* the optimizer state, too, is the whole model's under its own names */
    snprintf(sa, sizeof sa, "%s/straight.optim.safetensors", ct_test_tmpdir());
    snprintf(sb, sizeof sb, "%s/a.optim.safetensors", ct_test_tmpdir());
    same_tensors(sa, sb, 2e-5);
}

TEST(cli_pipe_cnn_with_replicas_matches_ddp)
{
    static char out[OUT_MAX];
    int code = run_np(2, out, "train " SMALL " --model cnn --steps 4 --batch 32 --strategy ddp");
    if (code) ct_test_fail(__FILE__, __LINE__, "ddp failed:\n%s", out);
    double l = number_after(out, "final train loss ");
    code = run_np(4, out, "train " SMALL " --model cnn --steps 4 --batch 32 --strategy pipe --stages 2 --chunks 4 "
                  "--pipe-checkpoint always --strategy-opt dp=zero1");
    if (code) ct_test_fail(__FILE__, __LINE__, "pipe x zero1 failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "x 2 replicas");
    ASSERT_NEAR(number_after(out, "final train loss "), l, 1e-5);
}

TEST(cli_pipe_usage_errors)
{
    static char out[OUT_MAX];
    static const struct { int np; const char *flags, *says; int code; } bad[] = {
        {0, "--chunks 4", "--chunks applies to --strategy pipe only", 2},
        {0, "--strategy ddp --balance 3,4", "--balance applies to --strategy pipe only", 2},
        {0, "--strategy pipe --chunks 0", "--chunks 0 must be from 1", 2},
        {0, "--strategy pipe --pipe-schedule zigzag", "unknown --pipe-schedule 'zigzag'", 2},
        {0, "--strategy pipe --pipe-checkpoint sometimes", "unknown --pipe-checkpoint 'sometimes'", 2},
        {0, "--strategy pipe --balance 3,,4", "--balance '3,,4': give the number of layers", 2},
        {0, "--strategy pipe --schedule gpipe --pipe-schedule 1f1b", "both give the pipeline schedule", 2},
        {0, "--strategy pipe --grad-accum 2", "its micro-batches are --chunks", 2},
        {2, "--strategy pipe --balance 3,3", "module and sum of balance have different length (module: 5, sum of balance: 6)", 2},
        {2, "--strategy pipe --balance 4,0,1", "balance numbers must be positive", 2},
        {2, "--strategy pipe --stages 3", "too few ranks to hold given partitions (ranks: 2, partitions: 3)", 2},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int code = run_np(bad[i].np, out, "train " SMALL " --model mlp --steps 2 %s", bad[i].flags);
        if (code != bad[i].code || !strstr(out, bad[i].says))
            ct_test_fail(__FILE__, __LINE__, "%s: exit %d, wanted %d and '%s' in:\n%s", bad[i].flags, code,
                         bad[i].code, bad[i].says, out);
    }
    /* a rank left over warns and sits out; the others train */
    int code = run_np(3, out, "train " SMALL " --model mlp --steps 2 --strategy pipe --stages 2");
    if (code) ct_test_fail(__FILE__, __LINE__, "3 ranks, 2 stages failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "rank 2 is left over and sits out");
}

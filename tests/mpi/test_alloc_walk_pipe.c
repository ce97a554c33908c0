/*
 * The allocation walk over a pipeline's training steps (issue 24): two
 * stages (the first two ranks), 1F1B and GPipe, the first step and a later
 * one; on each stage in turn the k-th allocation of the step fails, for
 * k = 0, 1, ... until the walk passes the step's last allocation.  Every
 * fault must end the step on both stages with CT_ENOMEM and the injected
 * fault's message (or be absorbed by the comm engine's reserve, and the
 * step succeed), never a hang or an abort; the parameters must be as they
 * were; the next clean step must succeed with the loss a fresh pipeline
 * gets (no message of the failed step is left over for it); and once
 * everything is destroyed the tracked memory is back where it started.
 */
#include "train_util.h"

static size_t mem_now(void)
{
    size_t n = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) n += ct_mem_current((ct_mem_cat)c);
    return n;
}

#define ROWS 7

/* One train step (no optimizer step: a failed one must change nothing) on
 * step's global batch x, y; *loss gets this rank's loss sum (the last stage's). */
static ct_status train_on(ct_strategy *s, int step, ct_tensor *x, ct_tensor *y, double *loss)
{
    ct_batch b = {.x = x, .y = y, .global_rows = ROWS, .sample0 = 0};
    ct_fwd_ctx ctx = {.training = 1, .seed = 4, .step = (uint64_t)step};
    ct_step_out out = {0};
    ct_status st = ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out);
    *loss = out.loss_sum;
    return st;
}

static ct_status train_step(ct_strategy *s, int step, double *loss)
{
    ct_tensor *x, *y;
    global_batch(step, ROWS, &x, &y);
    ct_status st = train_on(s, step, x, y, loss);
    ct_tensor_release(x);
    ct_tensor_release(y);
    return st;
}

static ct_strategy *make(ct_group *g, const char *opts, ct_module **m)
{
    *m = mlp8(3, 20);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("pipe", *m, &oo, g, opts, &s));
    return s;
}

/* warm clean steps (train step, optimizer step, zero_grad). */
static void warm_up(ct_strategy *s, int warm)
{
    for (int w = 0; w < warm; w++) {
        double l;
        ASSERT_OK(train_step(s, w, &l));
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
    }
}

/* This stage's parameters, copied (ct_free the result). */
static float *snapshot(ct_strategy *s, int64_t *n)
{
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(ct_strategy_model(s), &ps, &np));
    *n = 0;
    for (int i = 0; i < np; i++) *n += ps[i]->data->numel;
    float *v = ct_alloc(sizeof *v * (size_t)(*n + 1), CT_MEM_OTHER), *at = v;
    ASSERT(v);
    for (int i = 0; i < np; i++) {
        memcpy(at, ct_tensor_data(ps[i]->data), ct_tensor_bytes(ps[i]->data));
        at += ps[i]->data->numel;
    }
    ct_free(ps);
    return v;
}

static void walk(ct_group *g, const char *opts, int *faults, int *absorbed)
{
    int rank = ct_group_rank(g);
    ct_module *m;
    double ref[2];
    /* A clean round first: the losses of steps 0 and 1 (after one
     * optimizer step), and the memory that stays (the comm engine's lists)
     * as the baseline. */
    ct_strategy *s = make(g, opts, &m);
    for (int w = 0; w < 2; w++) {
        ASSERT_OK(train_step(s, w, &ref[w]));
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
    }
    ct_strategy_destroy(s);
    ct_module_destroy(m);
    size_t base = mem_now();
    for (int victim = 0; victim < 2; victim++)
        for (int warm = 0; warm < 2; warm++)
            for (long k = 0;; k++) {
                s = make(g, opts, &m);
                warm_up(s, warm);
                int64_t np0, np1;
                float *before = snapshot(s, &np0);
                long taken = ct_comm_reserve_taken();
                ct_tensor *x, *y;
                global_batch(warm, ROWS, &x, &y);
                if (rank == victim) ct_mem_fail_after(k);
                double l;
                ct_status st = train_on(s, warm, x, y, &l);
                int fired = rank == victim && ct_mem_fail_pending() < 0;
                ct_mem_fail_after(-1);
                int soaked = ct_comm_reserve_taken() != taken;
                ct_tensor_release(x);
                ct_tensor_release(y);
                int32_t f[3] = {fired, st == CT_OK, st != CT_OK}, any[3];
                ASSERT_OK(ct_group_allreduce(g, f, 3, CT_I32, CT_OP_MAX, NULL));
                memcpy(any, f, sizeof any);
                if (any[1] && any[2])
                    ct_test_fail(__FILE__, __LINE__, "%s, allocation %ld of stage %d's step %d failing: the stages "
                                 "disagree (this one: %s)", opts, k, victim, warm, st ? ct_last_error() : "ok");
                if (st != CT_OK && (st != CT_ENOMEM || !strstr(ct_last_error(), "injected fault")))
                    ct_test_fail(__FILE__, __LINE__, "%s, allocation %ld of stage %d's step %d failing: status %d (%s), "
                                 "not CT_ENOMEM", opts, k, victim, warm, (int)st, ct_last_error());
                if (st == CT_OK && fired && !soaked)
                    ct_test_fail(__FILE__, __LINE__, "%s, allocation %ld of stage %d's step %d failed and the step "
                                 "passed: a failure was swallowed", opts, k, victim, warm);
                float *after = snapshot(s, &np1);
                ASSERT_EQ(np0, np1);
                if (st != CT_OK && memcmp(before, after, sizeof *before * (size_t)np0))
                    ct_test_fail(__FILE__, __LINE__, "%s, allocation %ld of stage %d's step %d failing: the failed "
                                 "step changed the parameters", opts, k, victim, warm);
                ct_free(before);
                ct_free(after);
                /* the pipeline goes on: the same step again, clean, as a fresh one does it */
                if (st != CT_OK) {
                    ct_strategy_zero_grad(s);
                    ASSERT_OK(train_step(s, warm, &l));
                    if (l != ref[warm])
                        ct_test_fail(__FILE__, __LINE__, "%s: after allocation %ld of stage %d's step %d failed, the "
                                     "step again gives loss %.9g, a fresh pipeline %.9g", opts, k, victim, warm, l,
                                     ref[warm]);
                }
                ct_strategy_destroy(s);
                ct_module_destroy(m);
                if (mem_now() != base)
                    ct_test_fail(__FILE__, __LINE__, "%s: %zu bytes leaked with allocation %ld of stage %d's step %d "
                                 "failing", opts, mem_now() - base, k, victim, warm);
                if (!any[0]) break; /* the walk passed the step's last allocation */
                *faults += st != CT_OK;
                *absorbed += st == CT_OK;
            }
}

/* The walk of opts on the first two ranks (the others look on). */
static void walk_two_stages(const char *opts)
{
    ct_group *w = ct_group_world(), *g = NULL;
    int rank = ct_group_rank(w);
    ASSERT_OK(ct_group_split(w, rank < 2 ? 0 : CT_GROUP_NONE, rank, &g));
    if (!g) return;
    int faults = 0, absorbed = 0;
    walk(g, opts, &faults, &absorbed);
    if (rank == 0)
        printf("    %s: %d injected failures, each CT_ENOMEM on both stages; %d absorbed by the comm reserve\n", opts,
               faults, absorbed);
    ASSERT(faults > 20);
    ct_group_destroy(g);
}

TEST(alloc_walk_pipe_1f1b_steps_fail_cleanly)
{
    walk_two_stages("stages=2,schedule=1f1b,chunks=3");
}

TEST(alloc_walk_pipe_gpipe_steps_fail_cleanly)
{
    walk_two_stages("stages=2,schedule=gpipe,chunks=3,checkpoint=always");
}

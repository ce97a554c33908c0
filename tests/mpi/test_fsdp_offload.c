/*
 * FSDP with its shards in the store (offload=optim|params|all): the same
 * weights and optimizer state as in-memory FSDP and as one process on the
 * whole batch, with clipping, micro-batches, dropout, bf16 compute copies
 * and every sharding mode; checkpoints out of it and into it; the store
 * leaves no file and a disk too small is refused before training.
 */
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train_util.h"

typedef struct {
    const char *opts;     /* fsdp's, without offload */
    const char *off;      /* the offload options added */
    const char *ref_opts; /* the one process's ("none") */
    ct_optim_kind ok;
    float clip;
    int steps, dropout;
    double tol;           /* against one process (in-memory FSDP: the same rounding, 1e-6) */
} off_case;

static void compare(ct_strategy *a, ct_strategy *b, int optim, double tol, const char *what, const char *opts)
{
    ct_state x, y;
    ASSERT_OK(optim ? ct_strategy_optim_state(a, &x) : ct_strategy_model_state(a, &x));
    ASSERT_OK(optim ? ct_strategy_optim_state(b, &y) : ct_strategy_model_state(b, &y));
    if (ct_group_rank(ct_group_world()) == 0) {
        double d = state_rel_l2(&x, &y);
        if (!(d < tol))
            ct_test_fail(__FILE__, __LINE__, "fsdp '%s': %s %s differs by %g", opts, what,
                         optim ? "optimizer state" : "weights", d);
    }
    ct_state_fini(&x);
    ct_state_fini(&y);
}

/* Offloaded FSDP, in-memory FSDP and one process in lock step. */
static void offload_vs(const off_case *c)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 6 * world + 2;
    char opts[512];
    snprintf(opts, sizeof opts, "%s%s%s", c->opts ? c->opts : "", c->opts ? "," : "", c->off);
    ct_module *om = fsdp_nested(21, c->dropout), *mm = fsdp_nested(21, c->dropout), *rm = fsdp_nested(21, c->dropout);
    ct_optim_opts oo = optim_for(c->ok);
    ct_strategy *os, *ms, *rs;
    ASSERT_OK(ct_strategy_create("fsdp", om, &oo, g, opts, &os));
    ASSERT_OK(ct_strategy_create("fsdp", mm, &oo, g, c->opts, &ms));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, c->ref_opts, &rs));
    for (int step = 0; step < c->steps; step++) {
        ct_step_out o;
        step_on_slice(os, step, n, rank, world, &o);
        step_on_slice(ms, step, n, rank, world, &o);
        step_on_slice(rs, step, n, 0, 1, &o);
        if (c->clip > 0) {
            float a, b, r;
            ASSERT_OK(ct_strategy_clip_grad_norm(os, c->clip, 2.0, &a));
            ASSERT_OK(ct_strategy_clip_grad_norm(ms, c->clip, 2.0, &b));
            ASSERT_OK(ct_strategy_clip_grad_norm(rs, c->clip, 2.0, &r));
            ASSERT_CLOSE(a, b, 1e-6, 1e-7);
            ASSERT_CLOSE(a, r, 1e-5, 1e-6);
        }
        ASSERT_OK(ct_strategy_step(os));
        ASSERT_OK(ct_strategy_step(ms));
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(os);
        ct_strategy_zero_grad(ms);
        ct_strategy_zero_grad(rs);
    }
    compare(os, ms, 0, 1e-6, "vs in-memory fsdp:", opts);
    compare(os, ms, 1, 1e-6, "vs in-memory fsdp:", opts);
    compare(os, rs, 0, c->tol, "vs one process:", opts);
    compare(os, rs, 1, c->tol, "vs one process:", opts);
    /* training goes on after a state read (the parts were pinned and let go again) */
    ct_step_out o;
    step_on_slice(os, c->steps, n, rank, world, &o);
    step_on_slice(ms, c->steps, n, rank, world, &o);
    ASSERT_OK(ct_strategy_step(os));
    ASSERT_OK(ct_strategy_step(ms));
    compare(os, ms, 0, 1e-6, "after a state read, vs in-memory fsdp:", opts);
    UNWRAP(os);
    UNWRAP(ms);
    ct_strategy_destroy(rs);
    ct_module_destroy(om);
    ct_module_destroy(mm);
    ct_module_destroy(rm);
}

static const char *const parts[] = {"offload=optim", "offload=params", "offload=all",
                                    "offload=all,store=memory", "offload=all,max_resident_mb=1"};

TEST(fsdp_offload_equals_in_memory_fsdp_and_one_process)
{
    for (int i = 0; i < 5; i++) {
        off_case c = {"wrap_min_params=200", parts[i], NULL, CT_OPT_ADAMW, 0, 3, 0, 1e-5};
        offload_vs(&c);
    }
    off_case one = {NULL, "offload=all", NULL, CT_OPT_ADAMW, 0, 3, 0, 1e-5}; /* the model one unit */
    offload_vs(&one);
    off_case sgd = {"wrap_kinds=linear", "offload=all", NULL, CT_OPT_SGD, 0, 3, 0, 1e-5};
    offload_vs(&sgd);
}

TEST(fsdp_offload_clip_micro_batches_and_dropout)
{
    for (int i = 0; i < 3; i++) {
        off_case clip = {"wrap_min_params=200", parts[i], NULL, CT_OPT_ADAMW, 0.05f, 3, 0, 1e-5};
        offload_vs(&clip);
    }
    off_case accum = {"wrap_min_params=200,grad_accum=3", "offload=all", "grad_accum=3", CT_OPT_SGD, 0.05f, 3, 0, 1e-5};
    offload_vs(&accum);
    off_case drop = {"wrap_min_params=200", "offload=all", NULL, CT_OPT_ADAMW, 0, 3, 1, 1e-5};
    offload_vs(&drop);
}

TEST(fsdp_offload_every_sharding_and_bf16)
{
    const char *modes[] = {"sharding=grad_op,wrap_min_params=200", "sharding=none,wrap_min_params=200",
                           "sharding=hybrid,wrap_modules=2", "wrap_min_params=200,ignored_modules=2.2"};
    for (int i = 0; i < 4; i++) {
        off_case c = {modes[i], "offload=all", NULL, CT_OPT_ADAMW, 0.05f, 3, 0, 1e-5};
        offload_vs(&c);
    }
    off_case mp = {"wrap_min_params=200,param_dtype=bf16", "offload=all", "param_dtype=bf16", CT_OPT_ADAMW, 0.05f, 3, 0,
                   1e-4};
    offload_vs(&mp);
    off_case mps = {"sharding=none,param_dtype=bf16", "offload=params", "param_dtype=bf16", CT_OPT_ADAMW, 0, 3, 0, 1e-4};
    offload_vs(&mps);
}

/* Tracked bytes now, every category. */
static int64_t tracked(void)
{
    int64_t b = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) b += (int64_t)ct_mem_current((ct_mem_cat)c);
    return b;
}

/* n evaluation forwards (no backward, no step) of the global batch. */
static void evals(ct_strategy *s, int n)
{
    ct_tensor *x, *y;
    global_batch(7, 8, &x, &y);
    ct_fwd_ctx ctx = {.training = 0, .seed = 5, .step = 0};
    for (int i = 0; i < n; i++) {
        ct_tensor *out = NULL;
        ASSERT_OK(ct_strategy_predict(s, x, &ctx, &out));
        ct_tensor_release(out);
    }
    ct_tensor_release(x);
    ct_tensor_release(y);
}

/* The largest rise of the tracked bytes over n evaluation forwards, over the ranks. */
static int64_t eval_rise(ct_strategy *s, int n)
{
    int64_t before = tracked();
    evals(s, n);
    int64_t rise = tracked() - before;
    ASSERT_OK(ct_group_allreduce(ct_group_world(), &rise, 1, CT_I64, CT_OP_MAX, NULL));
    return rise;
}

/* The order of units recorded for prefetch is one pass: forward-only loops
 * (evaluation before any step, and between steps) leave the tracked memory
 * where it was (the recording grew by a unit per gather without end: 400
 * forwards of 5 units, 6 KiB and more), and training after them still
 * equals in-memory FSDP. */
TEST(fsdp_offload_eval_loops_stay_bounded_and_training_after_them_is_exact)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 6 * world + 2;
    ct_module *om = fsdp_nested(21, 0), *mm = fsdp_nested(21, 0);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *os, *ms;
    ASSERT_OK(ct_strategy_create("fsdp", om, &oo, g, "wrap_kinds=linear,offload=all", &os));
    ASSERT_OK(ct_strategy_create("fsdp", mm, &oo, g, "wrap_kinds=linear", &ms));
    evals(os, 20);
    int64_t rise = eval_rise(os, 400);
    if (!(rise < 1024)) /* a few small blocks of the runtime come and go */
        ct_test_fail(__FILE__, __LINE__, "400 more evaluation forwards raised the tracked memory by %lld bytes",
                     (long long)rise);
    evals(ms, 20);
    for (int step = 0; step < 3; step++) {
        step_both(os, ms, step, n, rank, world);
        evals(os, 50); /* between steps: the pending update is taken by the first forward */
        evals(ms, 50);
    }
    rise = eval_rise(os, 300);
    if (!(rise < 1024))
        ct_test_fail(__FILE__, __LINE__, "300 evaluation forwards after training raised the tracked memory by %lld "
                     "bytes", (long long)rise);
    compare(os, ms, 0, 1e-6, "after evaluation loops, vs in-memory fsdp:", "offload=all");
    compare(os, ms, 1, 1e-6, "after evaluation loops, vs in-memory fsdp:", "offload=all");
    UNWRAP(os);
    UNWRAP(ms);
    ct_module_destroy(om);
    ct_module_destroy(mm);
}

/* One unit at a time (ct_strategy_unit_read / _write) under offload=all:
 * what in-memory FSDP reads after the same steps, and a write then a step
 * leave both the same (the masters rest in the store: this read a NULL
 * master before). */
TEST(fsdp_offload_unit_read_and_write)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 6 * world + 2;
    ct_module *om = fsdp_nested(21, 0), *mm = fsdp_nested(21, 0);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *os, *ms;
    ASSERT_OK(ct_strategy_create("fsdp", om, &oo, g, "wrap_kinds=linear,offload=all", &os));
    ASSERT_OK(ct_strategy_create("fsdp", mm, &oo, g, "wrap_kinds=linear", &ms));
    for (int pass = 0; pass < 2; pass++) {
        step_both(os, ms, pass, n, rank, world);
        ASSERT_EQ(ct_strategy_num_units(os), ct_strategy_num_units(ms));
        for (int i = 0; i < ct_strategy_num_units(os); i++) {
            ct_module *m;
            ct_param **ps;
            int np;
            int64_t numel;
            ASSERT_OK(ct_strategy_unit_params(os, i, &m, &ps, &np, &numel));
            ct_free(ps);
            float *a = ct_alloc(sizeof *a * (size_t)(numel + 1), CT_MEM_OTHER), *b = ct_alloc(sizeof *b * (size_t)(numel + 1), CT_MEM_OTHER);
            ASSERT_OK(ct_strategy_unit_read(os, i, a, numel));
            ASSERT_OK(ct_strategy_unit_read(ms, i, b, numel));
            ASSERT(memcmp(a, b, sizeof *a * (size_t)numel) == 0);
            for (int64_t j = 0; j < numel; j++) a[j] *= 0.5f;
            if (pass == 0) {
                ASSERT_OK(ct_strategy_unit_write(os, i, a, numel));
                ASSERT_OK(ct_strategy_unit_write(ms, i, a, numel));
            }
            ct_free(a);
            ct_free(b);
        }
    }
    compare(os, ms, 0, 1e-30, "unit writes, vs in-memory fsdp:", "offload=all");
    compare(os, ms, 1, 1e-30, "unit writes, vs in-memory fsdp:", "offload=all");
    UNWRAP(os);
    UNWRAP(ms);
    ct_module_destroy(om);
    ct_module_destroy(mm);
}

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

/*
 * fsdp keep_low_precision_grads=1 (MixedPrecision's): under param_dtype=bf16
 * the optimizer steps on the bf16 weights' gradients rounded to bf16.  It
 * equals one process that rounds those gradients itself before each step
 * (full, grad_op and hybrid sharding), and differs from
 * one that does not (the option does something); without bf16 parameters
 * it is refused.
 */
#include "train_util.h"

/* The gradients of the weights with bf16 compute copies, rounded to bf16. */
static void round_grads(ct_module *m)
{
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) {
        if (!ps[i]->compute || !ps[i]->grad) continue;
        ct_param_grad_sync(ps[i]);
        float *g = ct_f32(ps[i]->grad);
        for (int64_t k = 0; k < ps[i]->grad->numel; k++) g[k] = ct_bf16_to_f32(ct_f32_to_bf16(g[k]));
    }
    ct_free(ps);
}

/* fsdp (opts) against one process with bf16 parameters that rounds (or not)
 * its gradients: the relative L2 difference of the weights after 3 SGD steps. */
static double vs_one(const char *opts, int round)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    const int64_t n = 10;
    ct_module *dm = mlp8(41, 20), *rm = mlp8(41, 20);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("fsdp", dm, &oo, g, opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, "param_dtype=bf16", &rs));
    for (int step = 0; step < 3; step++) {
        train_on_data_rank(ds, step, n, NULL);
        train_on_data_rank(rs, step, n, NULL);
        if (round) round_grads(rm);
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
    }
    ct_state a, b;
    ASSERT_OK(ct_strategy_model_state(ds, &a));
    ASSERT_OK(ct_strategy_model_state(rs, &b));
    double d = rank == 0 ? state_rel_l2(&a, &b) : 0;
    ASSERT_OK(ct_group_broadcast(g, &d, (int64_t)sizeof d, CT_U8, 0, NULL));
    ct_state_fini(&a);
    ct_state_fini(&b);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
    return d;
}

static void check(const char *opts)
{
    double same = vs_one(opts, 1), other = vs_one(opts, 0);
    if (!(same < 2e-6) || !(other > 10 * same + 1e-6))
        ct_test_fail(__FILE__, __LINE__, "fsdp (%s): weights differ from one process rounding its gradients by %g, "
                     "from one not rounding them by %g", opts, same, other);
}

TEST(fsdp_keep_low_precision_grads_steps_on_bf16_gradients)
{
    check("param_dtype=bf16,keep_low_precision_grads=1,wrap_kinds=linear");
    check("param_dtype=bf16,keep_low_precision_grads=1,wrap_kinds=linear,sharding=grad_op");
    check("param_dtype=bf16,keep_low_precision_grads=1,wrap_kinds=linear,sharding=hybrid");
    ct_module *m = mlp8(41, 20);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_ERR(ct_strategy_create("fsdp", m, &oo, ct_group_world(), "keep_low_precision_grads=1", &s), CT_EINVAL,
               "add param_dtype=bf16");
    ct_module_destroy(m);
}

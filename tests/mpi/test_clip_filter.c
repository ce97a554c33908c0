/*
 * Clipping a selection of the parameters (fairscale OSS.clip_grad_norm's
 * filter_params_fn; ct_strategy_clip_grad_norm_filter): under ddp, zero1,
 * zero2 (whole and split ranges), fsdp (one root unit whose shards cut
 * through parameters, per-layer units, hybrid, bf16), pipe and offload
 * (its gradients in the store, the factors applied at the step), the norm
 * over the selected gradients equals one process's over the same
 * parameters on the whole batch (ct_clip_grad_norm_p over just them), only
 * they are scaled, and the weights after clipped steps equal one
 * process's; unselected gradients are untouched.
 */
#include "train_util.h"

/* The weights of every linear but the last, and the last one's bias. */
static int selected(const ct_param *p, void *ud)
{
    (void)ud;
    return (strstr(p->name, "weight") && p->name[0] != '7') || !strcmp(p->name, "7.bias");
}

/* One process: ct_clip_grad_norm_p over the selected parameters alone. */
static float clip_reference(ct_module *m, float max, double p)
{
    ct_param **ps, *sel[32];
    int np, ns = 0;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    for (int i = 0; i < np; i++)
        if (selected(ps[i], NULL)) sel[ns++] = ps[i];
    ct_free(ps);
    ASSERT(ns > 2 && ns < np);
    float norm = 0;
    ASSERT_OK(ct_clip_grad_norm_p(sel, ns, max, p, &norm));
    return norm;
}

static void filter_vs_one(const char *kind, const char *opts, const char *ref_opts, double p)
{
    ct_group *g = ct_group_world();
    const int64_t n = 11;
    ct_module *dm = mlp8(33, 20), *rm = mlp8(33, 20);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, g, opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, ref_opts, &rs));
    for (int step = 0; step < 3; step++) {
        train_on_data_rank(ds, step, n, NULL);
        train_on_data_rank(rs, step, n, NULL);
        float all = 0, a = 0, max = isinf(p) ? 0.01f : 0.05f; /* below every norm: a real clip */
        ASSERT_OK(ct_strategy_clip_grad_norm(ds, 1e9f, p, &all));
        ASSERT_OK(ct_strategy_clip_grad_norm_filter(ds, max, p, selected, NULL, &a));
        float b = clip_reference(rm, max, p);
        if (!(fabsf(a - b) <= 1e-5f * fabsf(b)) || !(b > max) || !(isinf(p) ? a <= all : a < all))
            ct_test_fail(__FILE__, __LINE__, "%s (%s), p %g, step %d: norm %.9g, one process %.9g, all %.9g", kind,
                         opts ? opts : "", p, step, (double)a, (double)b, (double)all);
        /* the selection is clipped to max_norm; the others are as they were, so the whole norm is not */
        ASSERT_OK(ct_strategy_clip_grad_norm_filter(ds, 1e9f, p, selected, NULL, &a));
        ASSERT_CLOSE(a, max, 1e-4, 1e-6);
        float after = 0;
        ASSERT_OK(ct_strategy_clip_grad_norm(ds, 1e9f, p, &after));
        if (!isinf(p)) ASSERT(after > max * 1.01f && after < all); /* inf: the largest may be selected */
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
    }
    char what[256];
    snprintf(what, sizeof what, "%s (%s), p %g: weights", kind, opts ? opts : "", p);
    states_close(ds, rs, 2e-5, what);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

static void ps_ref(const char *kind, const char *opts, const char *ref_opts)
{
    static const double ps[] = {2.0, 1.0, INFINITY};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) filter_vs_one(kind, opts, ref_opts, ps[i]);
}

TEST(clip_filter_ddp_zero_equal_one_process)
{
    ps_ref("ddp", NULL, NULL);
    ps_ref("zero1", NULL, NULL);
    ps_ref("zero2", NULL, NULL);
    ps_ref("zero2", "split_params=1", NULL);
}

TEST(clip_filter_fsdp_pipe_equal_one_process)
{
    ps_ref("fsdp", NULL, NULL); /* one root unit: the shards cut through parameters */
    ps_ref("fsdp", "wrap_kinds=linear,sharding=hybrid", NULL);
    ps_ref("fsdp", "wrap_kinds=linear,sharding=grad_op,param_dtype=bf16", "param_dtype=bf16");
    ps_ref("pipe", "schedule=1f1b,chunks=2", NULL);
}

TEST(clip_filter_offload_equals_one_process)
{
    ps_ref("offload", "slices=3", NULL);
    ps_ref("offload", "slices=2,microbatches=2,checkpoint_activation=1", NULL);
}

/* Under ddp, whose gradients are whole on every rank: the unselected ones
 * are bit for bit what backward left; the selected ones scaled by one factor. */
TEST(clip_filter_leaves_unselected_gradients_untouched)
{
    ct_group *g = ct_group_world();
    ct_module *m = mlp8(34, 20);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, &oo, g, NULL, &s));
    train_on_data_rank(s, 0, 11, NULL);
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    ct_tensor *before[32];
    for (int i = 0; i < np; i++) ASSERT((before[i] = ct_tensor_clone(ps[i]->grad, CT_MEM_OTHER)));
    float norm = 0;
    ASSERT_OK(ct_strategy_clip_grad_norm_filter(s, 0.01f, 2.0, selected, NULL, &norm));
    float coef = ct_clip_coef(norm, 0.01);
    ASSERT(coef < 0.5f);
    for (int i = 0; i < np; i++) {
        const float *x = ct_f32(before[i]), *y = ct_f32(ps[i]->grad);
        if (!selected(ps[i], NULL)) ASSERT(!memcmp(x, y, ct_tensor_bytes(before[i])));
        else
            for (int64_t j = 0; j < before[i]->numel; j++) ASSERT_EQ(y[j], x[j] * coef);
        ct_tensor_release(before[i]);
    }
    ct_free(ps);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* fsdp with its shards in a store keeps norm terms and clip factors per flat: a filter is refused, naming why. */
TEST(clip_filter_refused_under_fsdp_offload)
{
    ct_module *m = mlp8(35, 20);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("fsdp", m, &oo, ct_group_world(), "offload=params", &s));
    train_on_data_rank(s, 0, 11, NULL);
    ASSERT_ERR(ct_strategy_clip_grad_norm_filter(s, 1.0f, 2.0, selected, NULL, NULL), CT_EUNSUPPORTED, "per flat");
    ASSERT_OK(ct_strategy_clip_grad_norm_filter(s, 1.0f, 2.0, NULL, NULL, NULL)); /* no filter: every parameter */
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

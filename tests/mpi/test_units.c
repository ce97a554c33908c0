/*
 * Units one at a time in a caller's buffer (ct_strategy_unit_read/_write,
 * ct_strategy_apply_units: FSDP's summon_full_params(recurse=False) with
 * offload_to_cpu, and apply unit by unit): under fsdp (full, grad_op,
 * hybrid, bf16), zero2, ddp and offload the units cover every trainable
 * parameter once and read the values one process trained; a change
 * written unit by unit equals the same change made to one process's model
 * and training goes on from it alike; under fsdp no parameter memory is
 * gathered while fn runs (the bound: one unit, in the caller's buffer);
 * bad calls and a failure of fn on one rank are errors on every rank.
 */
#include "train_util.h"

typedef struct {
    int calls;
    size_t param_bytes; /* CT_MEM_PARAM outside any call */
    size_t most;        /* largest CT_MEM_PARAM seen inside fn */
    int fail_on;        /* rank whose fn fails (-1: none) */
} seen;

static ct_status shrink(ct_module *unit, ct_param *const *ps, int n, float *v, void *ud)
{
    (void)unit, (void)ps;
    seen *w = ud;
    w->calls++;
    size_t now = ct_mem_current(CT_MEM_PARAM);
    if (now > w->most) w->most = now;
    if (w->fail_on == ct_group_rank(ct_group_world())) return ct_error(CT_EINVAL, "fn refused unit %d", w->calls);
    int64_t k = 0;
    for (int j = 0; j < n; j++) k += ps[j]->data->numel;
    for (int64_t i = 0; i < k; i++) v[i] = v[i] * 0.5f + 0.1f;
    return CT_OK;
}

static ct_status shrink_module(ct_module *m, void *ud)
{
    (void)ud;
    for (int j = 0; j < m->nparams; j++) {
        ct_tensor *t = m->params[j]->data;
        if (!m->params[j]->requires_grad) continue;
        for (int64_t i = 0; i < t->numel; i++) ct_f32(t)[i] = ct_f32(t)[i] * 0.5f + 0.1f;
    }
    return CT_OK;
}

/* Every unit of ds read: its values equal rm's parameters of the same names,
 * and every trainable parameter of rm is in exactly one unit. */
static void units_equal(ct_strategy *ds, ct_module *rm, double tol)
{
    int nu = ct_strategy_num_units(ds), covered = 0;
    for (int i = 0; i < nu; i++) {
        ct_module *m;
        ct_param **ps;
        int n;
        int64_t k;
        ASSERT_OK(ct_strategy_unit_params(ds, i, &m, &ps, &n, &k));
        float *buf = ct_alloc(sizeof *buf * (size_t)(k + 1), CT_MEM_OTHER);
        ASSERT_OK(ct_strategy_unit_read(ds, i, buf, k));
        int64_t base = 0;
        for (int j = 0; j < n; j++) {
            ct_param *r = ct_module_find(rm, ps[j]->name);
            ASSERT(r != NULL);
            for (int64_t e = 0; e < r->data->numel; e++) {
                float a = buf[base + e], b = ct_f32(r->data)[e];
                if (!(fabsf(a - b) <= tol * (1 + fabsf(b))))
                    ct_test_fail(__FILE__, __LINE__, "%s unit %d, %s[%lld]: %.9g, one process %.9g",
                                 ct_strategy_kind(ds), i, ps[j]->name, (long long)e, (double)a, (double)b);
            }
            base += r->data->numel;
            covered++;
        }
        ASSERT_EQ(base, k);
        ct_free(buf);
        ct_free(ps);
    }
    int ntrain = 0;
    ct_param **all;
    int na;
    ASSERT_OK(ct_module_params(rm, &all, &na));
    for (int j = 0; j < na; j++) ntrain += all[j]->requires_grad;
    ct_free(all);
    ASSERT_EQ(covered, ntrain);
}

static void check(const char *kind, const char *opts, const char *ref_opts, double tol)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_module *dm = mlp8(21, 20), *rm = mlp8(21, 20);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, g, opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, ref_opts, &rs));
    steps_vs_one(ds, rs, 2, 3 * world + 1, rank, world);
    units_equal(ds, rm, tol);
    /* the change unit by unit equals the change on the whole model */
    seen w = {.param_bytes = ct_mem_current(CT_MEM_PARAM), .fail_on = -1};
    ASSERT_OK(ct_strategy_apply_units(ds, 1, shrink, &w));
    ASSERT_EQ(w.calls, ct_strategy_num_units(ds));
    ASSERT_OK(ct_strategy_apply(rs, shrink_module, NULL));
    units_equal(ds, rm, tol);
    if (!strcmp(kind, "fsdp") && !strstr(opts, "sharding=none") && w.most > w.param_bytes)
        ct_test_fail(__FILE__, __LINE__, "fsdp (%s): parameter memory rose from %zu to %zu bytes inside fn: a unit "
                     "was gathered", opts, w.param_bytes, w.most);
    /* and training goes on from the changed values alike */
    steps_vs_one(ds, rs, 2, 3 * world + 1, rank, world);
    units_equal(ds, rm, tol);
    /* without writeback the values stay */
    ASSERT_OK(ct_strategy_apply_units(ds, 0, shrink, &w));
    units_equal(ds, rm, tol);
    /* errors: a unit out of range, a buffer too small, a failure of fn on rank 1 only */
    float one;
    ASSERT_ERR(ct_strategy_unit_read(ds, ct_strategy_num_units(ds), &one, 1), CT_EINVAL, "does not exist");
    ASSERT_ERR(ct_strategy_unit_read(ds, 0, &one, 1), CT_EINVAL, "buffer holds 1");
    seen bad = {.fail_on = 1};
    ASSERT_ERR(ct_strategy_apply_units(ds, 1, shrink, &bad), CT_EINVAL, "fn refused unit 1");
    ASSERT_EQ(bad.calls, 1);
    units_equal(ds, rm, tol); /* nothing written */
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

TEST(units_fsdp_read_write_apply_as_one_process)
{
    check("fsdp", "wrap_kinds=linear", NULL, 1e-5);
    check("fsdp", "wrap_min_params=200,sharding=grad_op", NULL, 1e-5);
    check("fsdp", "wrap_kinds=linear,sharding=hybrid", NULL, 1e-5);
    check("fsdp", "wrap_kinds=linear,sharding=none", NULL, 1e-5);
    check("fsdp", "wrap_kinds=linear,param_dtype=bf16", "param_dtype=bf16", 1e-5);
}

TEST(units_other_strategies_are_one_unit)
{
    check("zero2", "", NULL, 1e-5);
    check("ddp", "param_dtype=bf16", "param_dtype=bf16", 1e-5);
    check("offload", "slices=3", NULL, 1e-5);
}

/* While the full parameters are summoned, a unit cannot be read or written. */
TEST(units_refused_while_summoned)
{
    ct_module *dm = mlp8(21, 20);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *ds;
    ASSERT_OK(ct_strategy_create("fsdp", dm, &oo, ct_group_world(), "wrap_kinds=linear", &ds));
    ASSERT(ct_strategy_num_units(ds) > 1);
    ASSERT_OK(ct_strategy_summon_full_params(ds, 0, 0));
    ct_module *m;
    ct_param **ps;
    int n;
    int64_t k;
    ASSERT_OK(ct_strategy_unit_params(ds, 1, &m, &ps, &n, &k));
    ASSERT(!strcmp(m->ops->kind, "linear"));
    ct_free(ps);
    float *buf = ct_alloc(sizeof *buf * (size_t)k, CT_MEM_OTHER);
    ASSERT_ERR(ct_strategy_unit_read(ds, 1, buf, k), CT_ESTATE, "release_full_params");
    ASSERT_OK(ct_strategy_release_full_params(ds));
    ASSERT_OK(ct_strategy_unit_read(ds, 1, buf, k));
    ct_free(buf);
    ct_strategy_destroy(ds);
    ct_module_destroy(dm);
}

/*
 * ct_strategy_apply (FSDP's apply(fn)): under fsdp (units per linear, full
 * and grad_op sharding), zero2 and ddp, fn sees every module after its
 * children with the full parameters, its changes are kept in whatever
 * pieces the strategy holds (the model equals the same change made to a
 * plain one, bit for bit), and training goes on from them as one process
 * does.  A failing fn is returned after the parameters are released.
 */
#include "train_util.h"

typedef struct {
    ct_module *order[64];
    int n;
} visits;

/* Halves every weight and adds 0.1, noting the order of the visits. */
static ct_status shrink(ct_module *m, void *ud)
{
    visits *v = ud;
    if (v->n < 64) v->order[v->n++] = m;
    for (int j = 0; j < m->nparams; j++) {
        ct_tensor *t = m->params[j]->data;
        for (int64_t i = 0; i < t->numel; i++) ct_f32(t)[i] = ct_f32(t)[i] * 0.5f + 0.1f;
    }
    return CT_OK;
}

static ct_status refuse(ct_module *m, void *ud)
{
    (void)ud;
    return m->nparams ? ct_error(CT_EINVAL, "refused %s", m->fqn) : CT_OK;
}

static void check(const char *kind, const char *opts)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_module *dm = mlp8(21, 20), *rm = mlp8(21, 20);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, g, opts, &ds));
    visits v = {.n = 0}, w = {.n = 0};
    ASSERT_OK(ct_strategy_apply(ds, shrink, &v));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    ASSERT_OK(ct_strategy_apply(rs, shrink, &w));
    /* the root last, each child before it: nn.Module.apply's order */
    ASSERT_EQ(v.n, 9);
    ASSERT(v.order[8] == dm && v.order[0] == dm->kids[0]);
    ASSERT_OK(ct_strategy_summon_full_params(ds, 0, 0));
    assert_params_close(dm, rm, 0);
    ASSERT_OK(ct_strategy_release_full_params(ds));
    steps_vs_one(ds, rs, 2, 3 * world + 1, rank, world);
    ASSERT_OK(ct_strategy_summon_full_params(ds, 0, 0));
    assert_params_close(dm, rm, 1e-5);
    ASSERT_OK(ct_strategy_release_full_params(ds));
    ASSERT_ERR(ct_strategy_apply(ds, refuse, NULL), CT_EINVAL, "refused");
    ASSERT_OK(ct_strategy_apply(ds, shrink, &v)); /* released: usable again */
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

TEST(apply_changes_full_parameters_under_every_sharding)
{
    check("fsdp", "wrap_kinds=linear");
    check("fsdp", "wrap_kinds=linear,sharding=grad_op");
    check("zero2", NULL);
    check("ddp", NULL);
}

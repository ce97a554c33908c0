/* Parameter groups: an optimizer with groups steps each parameter exactly
 * as an optimizer of that group's values alone would (bit for bit, whole
 * parameters and ranges), add_param_group moves parameters from then on,
 * the selection rules, and every bad table refused with the cause named.
 * (Against PyTorch: test_gpt_pytorch.c; under the strategies: mpi/test_groups.c.) */
#include "test.h"

static ct_param *mk(const char *name, int ndim, int64_t n, uint64_t seed)
{
    ct_param *p = ct_alloc_zeroed(sizeof *p, CT_MEM_OTHER);
    ASSERT(p);
    size_t len = strlen(name) + 1;
    p->name = ct_alloc_zeroed(len, CT_MEM_OTHER);
    memcpy(p->name, name, len);
    int64_t shape[2] = {ndim == 2 ? 2 : n, n / 2};
    p->data = ct_tensor_create(CT_F32, ndim, shape, CT_MEM_PARAM);
    p->grad = ct_tensor_create(CT_F32, ndim, shape, CT_MEM_GRAD);
    ASSERT(p->data && p->grad);
    for (int64_t i = 0; i < p->data->numel; i++) ct_f32(p->data)[i] = (float)(0.1 * (double)((i * 7 + seed) % 13) - 0.6);
    p->requires_grad = 1;
    return p;
}

static void fill_grads(ct_param **ps, int n, int t)
{
    for (int k = 0; k < n; k++)
        for (int64_t i = 0; i < ps[k]->grad->numel; i++)
            ct_f32(ps[k]->grad)[i] = (float)(((i * 5 + t * 3 + k) % 11 - 5) * 0.07 + 0.01 * t);
}

static void free_ps(ct_param **ps, int n)
{
    for (int i = 0; i < n; i++) {
        ct_tensor_release(ps[i]->data);
        ct_tensor_release(ps[i]->grad);
        ct_free(ps[i]->name);
        ct_free(ps[i]);
    }
}

/* Four parameters: w (2-D), b (1-D), v (2-D), c (1-D). */
static void four(ct_param **ps)
{
    ps[0] = mk("l.w", 2, 8, 1);
    ps[1] = mk("l.b", 1, 4, 2);
    ps[2] = mk("m.v", 2, 6, 3);
    ps[3] = mk("m.c", 1, 3, 4);
}

static void same_bits(const ct_param *a, const ct_param *b)
{
    ASSERT_EQ(a->data->numel, b->data->numel);
    if (memcmp(ct_tensor_data(a->data), ct_tensor_data(b->data), sizeof(float) * (size_t)a->data->numel))
        ct_test_fail(__FILE__, __LINE__, "%s differs from its one-group reference", a->name);
}

static void check_kind(ct_optim_kind kind)
{
    ct_param *ps[4], *ref[4];
    four(ps);
    four(ref);
    ct_optim_opts o = ct_optim_defaults(kind);
    o.lr = 0.05;
    o.weight_decay = 0.2;
    if (kind == CT_OPT_SGD) o.momentum = 0.9;
    const char **nd;
    int nnd;
    ASSERT_OK(ct_optim_select(ps, 4, "ndim<2", &nd, &nnd));
    ASSERT_EQ(nnd, 2);
    ct_optim_group g = ct_optim_group_init(&o);
    g.params = nd;
    g.nparams = nnd;
    g.weight_decay = 0;
    g.lr_scale = 0.25;
    g.beta1 = 0.8;
    g.beta2 = 0.95;
    g.eps = 1e-6;
    o.groups = &g;
    o.ngroups = 1;
    ct_optim *opt = ct_optim_create(&o, ps, 4);
    ASSERT(opt);
    /* The reference: one optimizer per group, with the group's values. */
    ct_optim_opts od = o, on;
    od.groups = NULL;
    od.ngroups = 0;
    ct_optim_param_opts(&o, "l.b", &on);
    ASSERT(on.lr == 0.05 * 0.25 && on.weight_decay == 0 && on.beta2 == 0.95 && !on.groups);
    ct_optim *rd = ct_optim_create(&od, (ct_param *[]){ref[0], ref[2]}, 2);
    ct_optim *rn = ct_optim_create(&on, (ct_param *[]){ref[1], ref[3]}, 2);
    ASSERT(rd && rn);
    ct_free(nd); /* the optimizer keeps copies of the names */
    for (int t = 0; t < 4; t++) {
        /* a schedule's lr moves both groups (the reference's by hand) */
        double lr = 0.05 * (1.0 - 0.2 * t);
        ct_optim_set_lr(opt, lr);
        ct_optim_set_lr(rd, lr);
        ct_optim_set_lr(rn, lr * 0.25);
        fill_grads(ps, 4, t);
        fill_grads(ref, 4, t);
        ASSERT_OK(ct_optim_step(opt));
        ASSERT_OK(ct_optim_step(rd));
        ASSERT_OK(ct_optim_step(rn));
    }
    for (int i = 0; i < 4; i++) same_bits(ps[i], ref[i]);
    /* and the groups really differ: without them, b would have decayed */
    ASSERT(memcmp(ct_tensor_data(ps[0]->data), ct_tensor_data(ps[1]->data), 16));
    ct_optim_destroy(opt);
    ct_optim_destroy(rd);
    ct_optim_destroy(rn);
    free_ps(ps, 4);
    free_ps(ref, 4);
}

TEST(optim_groups_adamw_equal_one_optimizer_per_group) { check_kind(CT_OPT_ADAMW); }
TEST(optim_groups_sgd_equal_one_optimizer_per_group) { check_kind(CT_OPT_SGD); }

/* Ranges (ZeRO's pieces) take their parameter's group by name, and
 * add_param_group moves a parameter from the next step on. */
TEST(optim_groups_follow_ranges_and_add_param_group)
{
    ct_param *ps[4], *ref[4];
    four(ps);
    four(ref);
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.weight_decay = 0.3;
    ct_optim_range r[] = {{ps[0], 0, 5}, {ps[0], 5, 3}, {ps[2], 2, 4}};
    ct_optim *opt = ct_optim_create_ranges(&o, r, 3);
    ct_optim *rd = ct_optim_create(&o, (ct_param *[]){ref[0], ref[2]}, 2);
    ASSERT(opt && rd);
    ASSERT_EQ(ct_optim_num_groups(opt), 0);
    fill_grads(ps, 4, 0);
    fill_grads(ref, 4, 0);
    ASSERT_OK(ct_optim_step(opt));
    ASSERT_OK(ct_optim_step(rd));
    /* from now on l.w trains without decay, at twice the lr */
    const char *names[] = {"l.w"};
    ct_optim_group g = ct_optim_group_init(ct_optim_get_opts(opt));
    g.params = names;
    g.nparams = 1;
    g.weight_decay = 0;
    g.lr_scale = 2;
    ASSERT_OK(ct_optim_add_param_group(opt, &g));
    ASSERT_EQ(ct_optim_num_groups(opt), 1);
    ASSERT_EQ(ct_optim_group_of(ct_optim_get_opts(opt), "l.w"), 0);
    ASSERT_EQ(ct_optim_group_of(ct_optim_get_opts(opt), "m.v"), -1);
    /* the same name again is refused, and nothing changes */
    ASSERT_ERR(ct_optim_add_param_group(opt, &g), CT_EINVAL, "l.w");
    ASSERT_EQ(ct_optim_num_groups(opt), 1);
    ct_optim_opts ow;
    ct_optim_param_opts(ct_optim_get_opts(opt), "l.w", &ow);
    ct_optim *rw = ct_optim_create(&ow, (ct_param *[]){ref[0]}, 1), *rv = ct_optim_create(&o, (ct_param *[]){ref[2]}, 1);
    ASSERT(rw && rv);
    /* the references carry on from rd's state and step */
    for (int k = 0; k < 2; k++) {
        ct_optim *dst = k ? rv : rw;
        float *sb[2], *db[2];
        ASSERT_EQ(ct_optim_state(rd, k, sb, NULL), 2);
        ASSERT_EQ(ct_optim_state(dst, 0, db, NULL), 2);
        for (int b = 0; b < 2; b++) memcpy(db[b], sb[b], sizeof(float) * (size_t)ref[k ? 2 : 0]->data->numel);
        ct_optim_set_step(dst, 1);
    }
    fill_grads(ps, 4, 1);
    fill_grads(ref, 4, 1);
    ASSERT_OK(ct_optim_step(opt));
    ASSERT_OK(ct_optim_step(rw));
    ASSERT_OK(ct_optim_step(rv));
    same_bits(ps[0], ref[0]);
    /* m.v's elements [2, 6) only, the rest untouched */
    ASSERT(!memcmp(ct_f32(ps[2]->data) + 2, ct_f32(ref[2]->data) + 2, 16));
    ct_optim_destroy(opt);
    ct_optim_destroy(rd);
    ct_optim_destroy(rw);
    ct_optim_destroy(rv);
    free_ps(ps, 4);
    free_ps(ref, 4);
}

TEST(optim_select_rules)
{
    ct_param *ps[4];
    four(ps);
    const char **nm;
    int n;
    ASSERT_OK(ct_optim_select(ps, 4, "*.w,m.*", &nm, &n));
    ASSERT_EQ(n, 3);
    ASSERT(!strcmp(nm[0], "l.w") && !strcmp(nm[1], "m.v") && !strcmp(nm[2], "m.c"));
    ct_free(nm);
    ASSERT_OK(ct_optim_select(ps, 4, "none", &nm, &n));
    ASSERT_EQ(n, 0);
    ct_free(nm);
    ps[3]->requires_grad = 0; /* frozen: in no group (nanoGPT filters on requires_grad too) */
    ASSERT_OK(ct_optim_select(ps, 4, "ndim<2", &nm, &n));
    ASSERT_EQ(n, 1);
    ct_free(nm);
    ASSERT_ERR(ct_optim_select(ps, 4, "ndim<x", &nm, &n), CT_EINVAL, "ndim<x");
    ASSERT_ERR(ct_optim_select(ps, 4, "*.b,,x", &nm, &n), CT_EINVAL, "empty");
    ASSERT_ERR(ct_optim_select(ps, 4, "", &nm, &n), CT_EINVAL, "ndim<2");
    free_ps(ps, 4);
}

TEST(optim_groups_refuse_bad_tables)
{
    ct_param *ps[4];
    four(ps);
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    const char *a[] = {"l.w", "l.b"}, *b[] = {"m.v", "l.b"}, *dup[] = {"m.c", "m.c"};
    ct_optim_group g[2] = {ct_optim_group_init(&o), ct_optim_group_init(&o)};
    g[0].params = a;
    g[0].nparams = 2;
    g[1].params = b;
    g[1].nparams = 2;
    o.groups = g;
    o.ngroups = 2;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "l.b is in optimizer group 0 and again in group 1");
    ASSERT(!ct_optim_create(&o, ps, 4));
    g[1].params = dup;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "m.c");
    g[1].nparams = 1;
    ASSERT_OK(ct_optim_validate(&o));
    g[1].lr_scale = -1;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "lr_scale");
    g[1].lr_scale = 1;
    g[1].beta2 = 1.5;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "group 1");
    g[1].beta2 = 0.9;
    g[1].params = (const char *[]){NULL};
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "NULL");
    o.ngroups = -1;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "groups");
    free_ps(ps, 4);
}

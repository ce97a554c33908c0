/* Module tree: names, parameter order, hooks, records, containers, checkpointing. */
#include "test.h"

static ct_module *mlp(int drop)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(6, 8, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    if (drop) ASSERT_OK(ct_module_add(m, NULL, ct_dropout_create(0.3f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(8, 4, 1)));
    ct_module_init_params(m, 7);
    return m;
}

static ct_tensor *rand_tensor(int64_t r, int64_t c, uint64_t stream)
{
    ct_tensor *t = ct_tensor_create2(r, c, CT_MEM_ACT);
    ct_rng g;
    ct_rng_init(&g, 99, stream);
    ct_rng_normal(&g, ct_f32(t), (size_t)t->numel, 0, 1);
    return t;
}

TEST(nn_names_follow_pytorch)
{
    ct_module *root = ct_sequential_create();
    ct_module *inner = ct_sequential_create();
    ASSERT_OK(ct_module_add(inner, NULL, ct_linear_create(3, 3, 1)));
    ASSERT_OK(ct_module_add(root, NULL, ct_linear_create(2, 3, 0)));
    ASSERT_OK(ct_module_add(root, "layers", inner));
    ASSERT_OK(ct_module_add(root, NULL, ct_batchnorm_create(3, 1e-5f, 0.1f)));
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(root, &ps, &n));
    ASSERT_EQ(n, 5);
    const char *want[] = {"0.weight", "layers.0.weight", "layers.0.bias", "2.weight", "2.bias"};
    for (int i = 0; i < n; i++) ASSERT_STR_CONTAINS(ps[i]->name, want[i]);
    for (int i = 0; i < n; i++) ASSERT_EQ(strlen(ps[i]->name), strlen(want[i]));
    ct_free(ps);
    ASSERT_OK(ct_module_buffers(root, &ps, &n));
    ASSERT(n >= 2);
    ASSERT(!strcmp(ps[0]->name, "2.running_mean"));
    ASSERT(!strcmp(ps[1]->name, "2.running_var"));
    ct_free(ps);
    ASSERT(ct_module_find(root, "layers.0.bias") != NULL);
    ASSERT(ct_module_find(root, "layers.1.bias") == NULL);
    ASSERT_EQ(ct_module_num_params(root), 6 + 9 + 3 + 3 + 3);
    ASSERT_ERR(ct_module_add(root, "layers", ct_relu_create()), CT_EINVAL, "already has a child named");
    ct_module_destroy(root);
}

/* Hook log: "F>name" pre-forward, "F<name" post-forward, "B>" / "B<" backward, "G:param" grad-ready. */
static char hook_log[4096];

static ct_status log_hook(ct_module *m, ct_hook_kind kind, void *ud)
{
    (void)ud;
    static const char *tag[] = {"F>", "F<", "B>", "B<"};
    strcat(hook_log, tag[kind]);
    strcat(hook_log, *m->fqn ? m->fqn : "root");
    strcat(hook_log, " ");
    return CT_OK;
}

static ct_status grad_hook(ct_param *p, void *ud)
{
    int *count = ud;
    count[0]++;
    strcat(hook_log, "G:");
    strcat(hook_log, p->name);
    strcat(hook_log, " ");
    return CT_OK;
}

TEST(nn_hooks_fire_in_documented_order)
{
    ct_module *m = mlp(0);
    ct_module **mods;
    int nm;
    ASSERT_OK(ct_module_modules(m, &mods, &nm));
    ASSERT_EQ(nm, 4);
    ct_hook *hs[32];
    int nh = 0;
    for (int i = 0; i < nm; i++)
        for (int k = CT_HOOK_PRE_FORWARD; k <= CT_HOOK_POST_BACKWARD; k++)
            hs[nh++] = ct_module_add_hook(mods[i], (ct_hook_kind)k, log_hook, NULL);
    ct_param **ps;
    int np, counts[8] = {0};
    ASSERT_OK(ct_module_params(m, &ps, &np));
    ct_hook *gh[8];
    for (int i = 0; i < np; i++) gh[i] = ct_param_add_hook(ps[i], grad_hook, &counts[i]);

    ct_tensor *x = rand_tensor(5, 6, 1), *y, *dy, *dx;
    ct_record *rec;
    ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = 0};
    hook_log[0] = 0;
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    dy = rand_tensor(5, 4, 2);
    ASSERT_OK(ct_module_backward(m, dy, &dx, rec));
    const char *want = "F>root F>0 F<0 F>1 F<1 F>2 F<2 F<root "
                       "B>root B>2 G:2.weight G:2.bias B<2 B>1 B<1 B>0 G:0.weight G:0.bias B<0 B<root ";
    if (strcmp(hook_log, want)) ct_test_fail(__FILE__, __LINE__, "order:\n got  %s\n want %s", hook_log, want);
    for (int i = 0; i < np; i++) ASSERT_EQ(counts[i], 1); /* exactly once per backward */

    /* Removal: no module hooks and one grad hook left. */
    for (int i = 0; i < nh; i++) ct_hook_remove(hs[i]);
    for (int i = 1; i < np; i++) ct_hook_remove(gh[i]);
    hook_log[0] = 0;
    ct_tensor_release(y);
    ct_tensor_release(dx);
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, NULL, rec));
    ASSERT(!strcmp(hook_log, "G:0.weight "));
    ASSERT_EQ(counts[0], 2);
    ASSERT_EQ(counts[1], 1);
    ct_free(ps);
    ct_free(mods);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_tensor_release(dy);
    ct_module_destroy(m);
}

static ct_status failing_hook(ct_module *m, ct_hook_kind kind, void *ud)
{
    (void)kind;
    (void)ud;
    return ct_error(CT_ESTATE, "hook refused module '%s'", m->fqn);
}

TEST(nn_failing_hook_aborts_forward_cleanly)
{
    ct_module *m = mlp(0);
    ct_hook *h = ct_module_add_hook(m->kids[2], CT_HOOK_PRE_FORWARD, failing_hook, NULL);
    ct_tensor *x = rand_tensor(2, 6, 1), *y = NULL;
    ct_record *rec = NULL;
    size_t act_before = ct_mem_current(CT_MEM_ACT);
    ASSERT_ERR(ct_module_forward(m, x, &y, &rec, NULL), CT_ESTATE, "hook refused module '2'");
    ASSERT(y == NULL && rec == NULL);
    ASSERT_EQ(ct_mem_current(CT_MEM_ACT), act_before); /* nothing leaked */
    ct_hook_remove(h);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(nn_backward_needs_record)
{
    ct_module *m = mlp(0);
    ct_tensor *dy = rand_tensor(2, 4, 1);
    ASSERT_ERR(ct_module_backward(m, dy, NULL, NULL), CT_ESTATE, "without an activation record");
    ct_tensor_release(dy);
    ct_module_destroy(m);
}

/* Several micro-batches in flight: records belong to calls, not layers. */
TEST(nn_records_allow_interleaved_microbatches)
{
    ct_module *a = mlp(1), *b = mlp(1);
    ct_tensor *x1 = rand_tensor(3, 6, 1), *x2 = rand_tensor(3, 6, 2), *dy1 = rand_tensor(3, 4, 3),
              *dy2 = rand_tensor(3, 4, 4), *y, *y2;
    ct_record *r1, *r2;
    ct_fwd_ctx c1 = {.training = 1, .seed = 5, .sample0 = 0}, c2 = {.training = 1, .seed = 5, .sample0 = 3};
    /* a: f1 b1 f2 b2 in sequence; b: f1 f2 b2 b1 interleaved. */
    ASSERT_OK(ct_module_forward(a, x1, &y, &r1, &c1));
    ct_tensor_release(y);
    ASSERT_OK(ct_module_backward(a, dy1, NULL, r1));
    ASSERT_OK(ct_module_forward(a, x2, &y, &r2, &c2));
    ct_tensor_release(y);
    ASSERT_OK(ct_module_backward(a, dy2, NULL, r2));
    ASSERT_OK(ct_module_forward(b, x1, &y, &r1, &c1));
    ASSERT_OK(ct_module_forward(b, x2, &y2, &r2, &c2));
    ct_tensor_release(y);
    ct_tensor_release(y2);
    ASSERT_OK(ct_module_backward(b, dy2, NULL, r2));
    ASSERT_OK(ct_module_backward(b, dy1, NULL, r1));
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    for (int i = 0; i < na; i++)
        for (int64_t j = 0; j < pa[i]->grad->numel; j++)
            ASSERT_NEAR(ct_f32(pa[i]->grad)[j], ct_f32(pb[i]->grad)[j], 1e-6);
    ct_free(pa);
    ct_free(pb);
    ct_tensor *ts[] = {x1, x2, dy1, dy2};
    for (int i = 0; i < 4; i++) ct_tensor_release(ts[i]);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* Runs forward+backward and returns the input gradient; grads accumulate in m. */
static ct_tensor *fwd_bwd(ct_module *m, ct_tensor *x, ct_tensor *dy, const ct_fwd_ctx *ctx, ct_tensor **y)
{
    ct_record *rec;
    ct_tensor *dx;
    ASSERT_OK(ct_module_forward(m, x, y, &rec, ctx));
    ASSERT_OK(ct_module_backward(m, dy, &dx, rec));
    return dx;
}

/* seq(body, linear) with body = seq(linear, relu, dropout), optionally checkpointed. */
static ct_module *ckpt_model(int ckpt)
{
    ct_module *m = ct_sequential_create(), *body = ct_sequential_create();
    ASSERT_OK(ct_module_add(body, NULL, ct_linear_create(6, 8, 1)));
    ASSERT_OK(ct_module_add(body, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(body, NULL, ct_dropout_create(0.3f)));
    ASSERT_OK(ct_module_add(m, NULL, ckpt ? ct_checkpoint_create(body) : body));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(8, 4, 1)));
    ct_module_init_params(m, 7);
    return m;
}

TEST(nn_checkpoint_bit_identical_with_dropout)
{
    ct_module *plain = ckpt_model(0), *wrapped = ckpt_model(1);
    ct_param **pp, **pw;
    int np, nw;
    ASSERT_OK(ct_module_params(plain, &pp, &np));
    ASSERT_OK(ct_module_params(wrapped, &pw, &nw));
    ASSERT_EQ(np, nw);
    /* The checkpoint wrapper is transparent in names, so init and dropout streams match. */
    for (int i = 0; i < np; i++) ASSERT(!strcmp(pp[i]->name, pw[i]->name));
    ASSERT(!strcmp(pw[0]->name, "0.0.weight"));

    ct_tensor *x = rand_tensor(16, 6, 1), *dy = rand_tensor(16, 4, 2), *y1, *y2;
    size_t act_plain, act_ckpt;
    for (int step = 0; step < 3; step++) {
        ct_fwd_ctx ctx = {.training = 1, .seed = 11, .step = (uint64_t)step};
        ct_mem_reset_peak();
        size_t base = ct_mem_current(CT_MEM_ACT);
        ct_tensor *dx1 = fwd_bwd(plain, x, dy, &ctx, &y1);
        act_plain = ct_mem_peak(CT_MEM_ACT) - base;
        ct_mem_reset_peak();
        base = ct_mem_current(CT_MEM_ACT);
        ct_tensor *dx2 = fwd_bwd(wrapped, x, dy, &ctx, &y2);
        act_ckpt = ct_mem_peak(CT_MEM_ACT) - base;
        ASSERT(act_ckpt > 0 && act_plain > 0);
        ASSERT(!memcmp(ct_tensor_data(y1), ct_tensor_data(y2), ct_tensor_bytes(y1)));
        ASSERT(!memcmp(ct_tensor_data(dx1), ct_tensor_data(dx2), ct_tensor_bytes(dx1)));
        for (int i = 0; i < np; i++)
            ASSERT(!memcmp(ct_tensor_data(pp[i]->grad), ct_tensor_data(pw[i]->grad), ct_tensor_bytes(pp[i]->grad)));
        ct_tensor_release(y1);
        ct_tensor_release(y2);
        ct_tensor_release(dx1);
        ct_tensor_release(dx2);
    }
    ct_free(pp);
    ct_free(pw);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(plain);
    ct_module_destroy(wrapped);
}

TEST(nn_residual_adds_identity_gradient)
{
    ct_module *body = ct_linear_create(4, 4, 0);
    ct_module *r = ct_residual_create(body);
    ASSERT(r && !strcmp(r->kids[0]->name, "body"));
    ASSERT(!strcmp(body->params[0]->name, "body.weight"));
    ct_tensor_fill(body->params[0]->data, 0.0f); /* body(x) = 0: residual is identity */
    ct_tensor *x = rand_tensor(3, 4, 1), *dy = rand_tensor(3, 4, 2), *y;
    ct_fwd_ctx ctx = {.training = 1, .seed = 0, .step = 0};
    ct_tensor *dx = fwd_bwd(r, x, dy, &ctx, &y);
    for (int64_t i = 0; i < x->numel; i++) {
        ASSERT_NEAR(ct_f32(y)[i], ct_f32(x)[i], 0);
        ASSERT_NEAR(ct_f32(dx)[i], ct_f32(dy)[i], 0);
    }
    /* dW = dy^T x */
    float *gw = ct_f32(body->params[0]->grad);
    for (int o = 0; o < 4; o++)
        for (int i = 0; i < 4; i++) {
            double s = 0;
            for (int n = 0; n < 3; n++) s += ct_f32(dy)[n * 4 + o] * ct_f32(x)[n * 4 + i];
            ASSERT_NEAR(gw[o * 4 + i], s, 1e-5);
        }
    ct_module *bad = ct_residual_create(ct_linear_create(4, 2, 0));
    ct_tensor *y2 = NULL;
    ASSERT_ERR(ct_module_forward(bad, x, &y2, NULL, &ctx), CT_EINVAL, "must keep the shape");
    ct_module_destroy(bad);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_tensor_release(dx);
    ct_tensor_release(dy);
    ct_module_destroy(r);
}

TEST(nn_init_is_deterministic_and_pytorch_bounded)
{
    ct_module *a = mlp(0), *b = mlp(0);
    ct_param *wa = a->kids[0]->params[0], *wb = b->kids[0]->params[0];
    ASSERT(!memcmp(ct_tensor_data(wa->data), ct_tensor_data(wb->data), ct_tensor_bytes(wa->data)));
    float bound = 1.0f / sqrtf(6.0f), mx = 0;
    for (int64_t i = 0; i < wa->data->numel; i++) mx = fmaxf(mx, fabsf(ct_f32(wa->data)[i]));
    ASSERT(mx <= bound && mx > 0.5f * bound);
    /* Weight and bias of one layer draw different numbers. */
    ASSERT(ct_f32(a->kids[0]->params[1]->data)[0] != ct_f32(wa->data)[0]);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* Lazy zero_grad: the next backward overwrites, the one after accumulates,
 * and a gradient no backward wrote reads as zero once synced. */
TEST(nn_lazy_zero_grad_overwrites_then_accumulates)
{
    ct_module *a = mlp(0), *b = mlp(0);
    ct_tensor *x = rand_tensor(5, 6, 1), *dy = rand_tensor(5, 4, 2), *y;
    ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = 0};
    ct_param **pa, **pb;
    int n;
    ASSERT_OK(ct_module_params(a, &pa, &n));
    ASSERT_OK(ct_module_params(b, &pb, &n));
    for (int i = 0; i < n; i++) ct_tensor_fill(pa[i]->grad, 123.0f); /* stale garbage */
    ct_module_zero_grad_lazy(a);
    ASSERT(pa[0]->grad_stale);
    ct_module_zero_grad(b);
    for (int rep = 1; rep <= 2; rep++) {
        ct_tensor *dx = fwd_bwd(a, x, dy, &ctx, &y);
        ct_tensor_release(y);
        ct_tensor_release(dx);
        dx = fwd_bwd(b, x, dy, &ctx, &y);
        ct_tensor_release(y);
        ct_tensor_release(dx);
        for (int i = 0; i < n; i++) {
            ASSERT(!pa[i]->grad_stale);
            ASSERT(!memcmp(ct_tensor_data(pa[i]->grad), ct_tensor_data(pb[i]->grad), ct_tensor_bytes(pa[i]->grad)));
        }
    }
    /* A frozen parameter's gradient is never written: it must still read as zero. */
    pa[0]->requires_grad = 0;
    ct_tensor_fill(pa[0]->grad, 7.0f);
    ct_module_zero_grad_lazy(a);
    ct_tensor *dx = fwd_bwd(a, x, dy, &ctx, &y);
    ASSERT(!pa[0]->grad_stale);
    for (int64_t j = 0; j < pa[0]->grad->numel; j++) ASSERT_EQ(ct_f32(pa[0]->grad)[j], 0);
    /* ct_param_grad_sync clears a gradient that is only marked. */
    ct_tensor_fill(pa[1]->grad, 5.0f);
    pa[1]->grad_stale = 1;
    ct_param_grad_sync(pa[1]);
    ASSERT_EQ(ct_f32(pa[1]->grad)[0], 0);
    ct_tensor_release(y);
    ct_tensor_release(dx);
    ct_free(pa);
    ct_free(pb);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* A custom layer that saves more tensors than any fixed table held: y = x *
 * (c_0 + ... + c_{K-1}) with K constant tensors, each saved in the record;
 * backward reads them all back by index. */
#define MANY 11

static ct_status many_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                              const ct_fwd_ctx *ctx)
{
    (void)m;
    (void)ctx;
    ct_tensor *y = ct_tensor_clone(in, CT_MEM_ACT);
    if (!y) return CT_ENOMEM;
    ct_tensor_fill(y, 0.0f);
    for (int k = 0; k < MANY; k++) {
        ct_tensor *c = ct_tensor_create1(1, CT_MEM_ACT);
        if (!c) {
            ct_tensor_release(y);
            return CT_ENOMEM;
        }
        ct_f32(c)[0] = (float)(k + 1);
        for (int64_t i = 0; i < y->numel; i++) ct_f32(y)[i] += ct_f32(in)[i] * ct_f32(c)[0];
        int idx = rec ? ct_record_save(rec, c) : k;
        ct_tensor_release(c); /* the record keeps its own reference */
        if (idx < 0) {
            ct_tensor_release(y);
            return idx;
        }
        ASSERT_EQ(idx, k); /* indices count the saves */
    }
    *out = y;
    return CT_OK;
}

static ct_status many_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    (void)m;
    ASSERT_EQ(rec->nsaved, MANY);
    float s = 0;
    for (int k = 0; k < MANY; k++) s += ct_f32(ct_record_saved(rec, k))[0];
    if (!din) return CT_OK;
    ct_tensor *dx = ct_tensor_clone(dout, CT_MEM_ACT);
    if (!dx) return CT_ENOMEM;
    for (int64_t i = 0; i < dx->numel; i++) ct_f32(dx)[i] *= s;
    *din = dx;
    return CT_OK;
}

TEST(nn_record_saves_any_number_of_tensors)
{
    static const ct_module_ops ops = {"many", many_forward, many_backward, NULL, 0, NULL, NULL, 0};
    ct_module *m = ct_module_create(&ops, NULL);
    ct_tensor *x = rand_tensor(3, 5, 1), *dy = rand_tensor(3, 5, 2), *y, *dx;
    ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = 0, .sample0 = 0};
    size_t act0 = ct_mem_current(CT_MEM_ACT);
    dx = fwd_bwd(m, x, dy, &ctx, &y);
    for (int64_t i = 0; i < x->numel; i++) {
        ASSERT_EQ(ct_f32(y)[i], ct_f32(x)[i] * 66.0f); /* 1 + 2 + ... + 11 */
        ASSERT_EQ(ct_f32(dx)[i], ct_f32(dy)[i] * 66.0f);
    }
    ct_tensor_release(y);
    ct_tensor_release(dx);
    ASSERT_EQ(ct_mem_current(CT_MEM_ACT), act0); /* the record released every saved tensor */
    /* Every allocation failing in turn: CT_ENOMEM, never a leak or a crash. */
    int ok = 0;
    for (long f = 0; f < 64 && !ok; f++) {
        ct_record *rec;
        ct_mem_fail_after(f);
        ct_status s = ct_module_forward(m, x, &y, &rec, &ctx);
        ct_mem_fail_after(-1);
        if (s == CT_OK) {
            ok = 1;
            ASSERT_EQ(rec->nsaved, MANY);
            ct_tensor_release(y);
            ct_record_destroy(rec);
        } else {
            ASSERT_EQ(s, CT_ENOMEM);
        }
        ASSERT_EQ(ct_mem_current(CT_MEM_ACT), act0);
    }
    ASSERT(ok);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(m);
}

/* Children, parameters, buffers and child records live in arrays that
 * double, so n appends copy O(n) pointers, not O(n^2). */
TEST(nn_lists_grow_geometrically)
{
    ct_module *seq = ct_sequential_create();
    for (int i = 0; i < 1000; i++) ASSERT_OK(ct_module_add(seq, NULL, ct_relu_create()));
    ASSERT_EQ(seq->nkids, 1000);
    ASSERT_EQ(seq->kids_cap, 1024);
    ASSERT(!strcmp(seq->kids[999]->fqn, "999"));
    ct_module *holder = ct_sequential_create();
    for (int i = 0; i < 100; i++) {
        char nm[16];
        snprintf(nm, sizeof nm, "p%d", i);
        ASSERT(ct_module_add_param(holder, nm, 1, (int64_t[]){1}) != NULL);
        snprintf(nm, sizeof nm, "b%d", i);
        ASSERT(ct_module_add_buffer(holder, nm, 1, (int64_t[]){1}, 0.0f) != NULL);
    }
    ASSERT_EQ(holder->params_cap, 128);
    ASSERT_EQ(holder->buffers_cap, 128);
    ASSERT(!strcmp(holder->params[99]->name, "p99"));
    ct_tensor *x = rand_tensor(2, 3, 1), *y;
    ct_record *rec;
    ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = 0, .sample0 = 0};
    ASSERT_OK(ct_module_forward(seq, x, &y, &rec, &ctx));
    ASSERT_EQ(rec->nkids, 1000);
    ASSERT_EQ(rec->kcap, 1024);
    ASSERT_OK(ct_module_backward(seq, y, NULL, rec));
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_module_destroy(seq);
    ct_module_destroy(holder);
}

/* ---- dropout across ranks and micro-batches ----------------------------- */

/* Values k/4 for small integers k: with dropout p = 0.5 (scale 2) every
 * product and sum below is exact in f32, so results cannot depend on how
 * BLAS orders a sum, and bit equality tests the masks alone. */
static void quarters(ct_tensor *t, uint64_t seed)
{
    ct_rng g;
    ct_rng_init(&g, seed, 5);
    ct_rng_uniform(&g, ct_f32(t), (size_t)t->numel);
    for (int64_t i = 0; i < t->numel; i++) ct_f32(t)[i] = floorf(ct_f32(t)[i] * 9.0f - 4.0f) / 4.0f;
}

/* seq(linear 6->8, relu, dropout 0.5, [checkpoint](seq(linear 8->8, dropout 0.5)), linear 8->4). */
static ct_module *drop_model(int ckpt)
{
    ct_module *m = ct_sequential_create(), *body = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(6, 8, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_dropout_create(0.5f)));
    ASSERT_OK(ct_module_add(body, NULL, ct_linear_create(8, 8, 1)));
    ASSERT_OK(ct_module_add(body, NULL, ct_dropout_create(0.5f)));
    ASSERT_OK(ct_module_add(m, NULL, ckpt ? ct_checkpoint_create(body) : body));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(8, 4, 1)));
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) quarters(ps[i]->data, 40 + (uint64_t)i);
    ct_free(ps);
    return m;
}

static ct_tensor *rows_of(ct_tensor *t, int64_t start, int64_t count)
{
    int64_t shape[CT_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = count;
    return ct_tensor_view(t, start * (t->numel / t->shape[0]), t->ndim, shape);
}

static void same_bits(const ct_tensor *a, const float *b, int64_t n, const char *what)
{
    ASSERT_EQ(a->numel, n);
    if (memcmp(ct_f32(a), b, (size_t)n * sizeof(float)))
        ct_test_fail(__FILE__, __LINE__, "%s differs between the whole batch and its slices", what);
}

/* One call over 12 rows equals calls over rows [0,5) and [5,12) with
 * sample0 0 and 5 -- as two ranks or two micro-batches would run them --
 * in outputs, input gradients and (summed) parameter gradients, bit for bit;
 * likewise with part of the model checkpointed (recompute draws the same
 * masks at sample0 5).  A wrong sample0 changes the result. */
TEST(nn_dropout_masks_follow_global_rows)
{
    ct_module *whole = drop_model(0), *split = drop_model(0), *ck = drop_model(1);
    ct_tensor *x = ct_tensor_create2(12, 6, CT_MEM_ACT), *dy = ct_tensor_create2(12, 4, CT_MEM_ACT);
    quarters(x, 1);
    quarters(dy, 2);
    ct_fwd_ctx ctx = {.training = 1, .seed = 77, .step = 3, .sample0 = 0};
    ct_tensor *y, *dx = fwd_bwd(whole, x, dy, &ctx, &y);
    int64_t cut[3] = {0, 5, 12};
    float ys[2][12 * 4], dxs[2][12 * 6];
    for (int v = 0; v < 2; v++) {
        ct_module *m = v ? ck : split;
        for (int s = 0; s < 2; s++) {
            ct_tensor *xs = rows_of(x, cut[s], cut[s + 1] - cut[s]);
            ct_tensor *dys = rows_of(dy, cut[s], cut[s + 1] - cut[s]), *ysl;
            ct_fwd_ctx c = ctx;
            c.sample0 = cut[s];
            ct_tensor *dxsl = fwd_bwd(m, xs, dys, &c, &ysl);
            memcpy(ys[v] + cut[s] * 4, ct_f32(ysl), (size_t)ysl->numel * sizeof(float));
            memcpy(dxs[v] + cut[s] * 6, ct_f32(dxsl), (size_t)dxsl->numel * sizeof(float));
            ct_tensor *ts[] = {xs, dys, ysl, dxsl};
            for (int i = 0; i < 4; i++) ct_tensor_release(ts[i]);
        }
        same_bits(y, ys[v], 48, v ? "checkpointed output" : "output");
        same_bits(dx, dxs[v], 72, v ? "checkpointed input gradient" : "input gradient");
        ct_param **pw, **ps;
        int n, n2;
        ASSERT_OK(ct_module_params(whole, &pw, &n));
        ASSERT_OK(ct_module_params(m, &ps, &n2));
        ASSERT_EQ(n, n2);
        for (int i = 0; i < n; i++) {
            ASSERT(!strcmp(pw[i]->name, ps[i]->name));
            same_bits(pw[i]->grad, ct_f32(ps[i]->grad), pw[i]->grad->numel, pw[i]->name);
        }
        ct_free(pw);
        ct_free(ps);
    }
    /* The second slice run as if it started at row 0 draws other masks. */
    ct_tensor *xs = rows_of(x, 5, 7), *ybad;
    ASSERT_OK(ct_module_forward(split, xs, &ybad, NULL, &ctx));
    ASSERT(memcmp(ct_f32(ybad), ct_f32(y) + 5 * 4, 7 * 4 * sizeof(float)));
    ct_tensor *ts[] = {x, dy, y, dx, xs, ybad};
    for (int i = 0; i < 6; i++) ct_tensor_release(ts[i]);
    ct_module_destroy(whole);
    ct_module_destroy(split);
    ct_module_destroy(ck);
}

/* ---- surgery ------------------------------------------------------------ */

/* A nested sequential split into stages: the stages keep its path, so names
 * and dropout streams are the unsplit tree's, and the stages in turn compute
 * what it did, dropout included. */
TEST(nn_split_keeps_names_and_dropout_of_nested_sequential)
{
    ct_module *a = ct_sequential_create(), *b = ct_sequential_create();
    for (int v = 0; v < 2; v++) {
        ct_module *root = v ? b : a;
        ASSERT_OK(ct_module_add(root, "layers", drop_model(0)));
    }
    ct_param **pa;
    int na;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT(!strcmp(pa[0]->name, "layers.0.weight"));
    ct_module *layers = ct_module_detach(b, 0), *st[2];
    ASSERT(layers && layers->parent == NULL && b->nkids == 0);
    ASSERT(!strcmp(layers->fqn, "layers"));
    ASSERT_OK(ct_module_name_tree(layers)); /* renaming a detached root keeps its names */
    ASSERT_OK(ct_sequential_split(layers, (int[]){3, 2}, 2, st));
    ct_module_destroy(layers);
    ASSERT(!strcmp(st[1]->kids[0]->fqn, "layers.3"));
    ASSERT(!strcmp(st[1]->kids[0]->kids[0]->params[0]->name, "layers.3.0.weight"));
    ASSERT(ct_module_find(st[1], "layers.4.bias") != NULL);
    ASSERT(ct_module_find(st[0], "layers.0.weight") == st[0]->kids[0]->params[0]);

    ct_tensor *x = rand_tensor(6, 6, 1), *dy = rand_tensor(6, 4, 2), *y, *y0, *y1, *g1, *g0;
    ct_fwd_ctx ctx = {.training = 1, .seed = 3, .step = 1, .sample0 = 4};
    ct_tensor *dx = fwd_bwd(a, x, dy, &ctx, &y);
    ct_record *r0, *r1;
    ASSERT_OK(ct_module_forward(st[0], x, &y0, &r0, &ctx));
    ASSERT_OK(ct_module_forward(st[1], y0, &y1, &r1, &ctx));
    ASSERT_OK(ct_module_backward(st[1], dy, &g1, r1));
    ASSERT_OK(ct_module_backward(st[0], g1, &g0, r0));
    ASSERT(!memcmp(ct_f32(y), ct_f32(y1), ct_tensor_bytes(y)));
    ASSERT(!memcmp(ct_f32(dx), ct_f32(g0), ct_tensor_bytes(dx)));
    int k = 0;
    for (int s = 0; s < 2; s++) {
        ct_param **ps;
        int np;
        ASSERT_OK(ct_module_params(st[s], &ps, &np));
        for (int i = 0; i < np; i++, k++) {
            ASSERT(!strcmp(ps[i]->name, pa[k]->name));
            ASSERT(!memcmp(ct_f32(ps[i]->grad), ct_f32(pa[k]->grad), ct_tensor_bytes(ps[i]->grad)));
        }
        ct_free(ps);
    }
    ASSERT_EQ(k, na);
    ct_free(pa);
    ct_tensor *ts[] = {x, dy, y, y0, y1, g1, g0, dx};
    for (int i = 0; i < 8; i++) ct_tensor_release(ts[i]);
    ct_module_destroy(st[0]);
    ct_module_destroy(st[1]);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

TEST(nn_detach_takes_a_child_out_with_its_names)
{
    ct_module *m = mlp(0); /* linear relu linear */
    ASSERT(ct_module_detach(m, 3) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "has 3 children, so there is no child 3");
    ASSERT(ct_module_detach(m, -1) == NULL);
    ct_module *k = ct_module_detach(m, 1);
    ASSERT(k && k->parent == NULL && !strcmp(k->fqn, "1") && !strcmp(k->ops->kind, "relu"));
    ASSERT_EQ(m->nkids, 2);
    ASSERT(!strcmp(m->kids[1]->fqn, "2") && !strcmp(m->kids[1]->params[0]->name, "2.weight"));
    /* It can join another tree, named there anew. */
    ct_module *other = ct_sequential_create();
    ASSERT_OK(ct_module_add(other, "act", k));
    ASSERT(!strcmp(k->fqn, "act"));
    ct_module_destroy(other);
    /* A residual without its body says so instead of crashing. */
    ct_module *r = ct_residual_create(ct_linear_create(6, 6, 1)), *body = ct_module_detach(r, 0);
    ct_tensor *x = rand_tensor(2, 6, 1), *y = NULL;
    ASSERT_ERR(ct_module_forward(r, x, &y, NULL, NULL), CT_ESTATE, "was it detached?");
    int on;
    int64_t os[CT_MAX_DIMS];
    ASSERT_ERR(ct_module_out_shape(r, 2, x->shape, &on, os), CT_ESTATE, "instead of its one body");
    ct_module_destroy(body);
    ct_module_destroy(r);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* A custom module without an out_shape op: shape inference says which module and how to fix it. */
TEST(nn_out_shape_of_custom_module_without_op_is_a_clear_error)
{
    static const ct_module_ops ops = {"many", many_forward, many_backward, NULL, 0, NULL, NULL, 0};
    ct_module *seq = ct_sequential_create();
    ASSERT_OK(ct_module_add(seq, NULL, ct_linear_create(6, 6, 1)));
    ASSERT_OK(ct_module_add(seq, "mine", ct_module_create(&ops, NULL)));
    int on;
    int64_t os[CT_MAX_DIMS];
    ASSERT_ERR(ct_module_out_shape(seq, 2, (int64_t[]){3, 6}, &on, os), CT_EUNSUPPORTED,
               "module 'mine' (many) cannot infer its output shape");
    ASSERT_STR_CONTAINS(ct_last_error(), "ct_module_out_shape_same");
    ct_module_destroy(seq);
}

/* See train_util.h. */
#include "train_util.h"

/* Inputs normal from (seed, step), targets (i * mul + step) % NCLS. */
static void batch_of(uint64_t seed, int mul, int step, int64_t n, ct_tensor **x, ct_tensor **y)
{
    *x = ct_tensor_create2(n, IN, CT_MEM_ACT);
    *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, seed, (uint64_t)step);
    ct_rng_normal(&r, ct_f32(*x), (size_t)(n * IN), 0, 1);
    for (int64_t i = 0; i < n; i++) ((int32_t *)ct_tensor_data(*y))[i] = (int32_t)((i * mul + step) % NCLS);
}

void global_batch(int step, int64_t n, ct_tensor **x, ct_tensor **y) { batch_of(1234, 7, step, n, x, y); }
void global_batch2(int step, int64_t n, ct_tensor **x, ct_tensor **y) { batch_of(99, 3, step, n, x, y); }

ct_tensor *rows(ct_tensor *t, int64_t start, int64_t count) { return ct_tensor_rows(t, start, count); }

ct_optim_opts optim_for(ct_optim_kind k)
{
    ct_optim_opts o = ct_optim_defaults(k);
    o.lr = k == CT_OPT_SGD ? 0.1f : 0.01f;
    if (k == CT_OPT_SGD) o.momentum = 0.9f;
    return o;
}

void assert_params_close(ct_module *a, ct_module *b, double tol)
{
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    ASSERT_EQ(na, nb);
    for (int i = 0; i < na; i++)
        for (int64_t j = 0; j < pa[i]->data->numel; j++)
            ASSERT_CLOSE(ct_f32(pa[i]->data)[j], ct_f32(pb[i]->data)[j], tol, tol);
    ct_free(pa);
    ct_free(pb);
}

void slice(int64_t n, int rank, int world, int64_t *first, int64_t *count)
{
    int64_t q = n / world, rem = n % world;
    *first = rank * q + (rank < rem ? rank : rem);
    *count = q + (rank < rem);
}

void step_on_slice(ct_strategy *s, int step, int64_t n, int rank, int world, ct_step_out *out)
{
    ct_tensor *x, *y;
    global_batch(step, n, &x, &y);
    int64_t first, count;
    slice(n, rank, world, &first, &count);
    ct_batch b = {rows(x, first, count), rows(y, first, count), n, first};
    ct_fwd_ctx ctx = {.training = 1, .seed = 5, .step = (uint64_t)step};
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, out));
    ct_tensor_release(b.x);
    ct_tensor_release(b.y);
    ct_tensor_release(x);
    ct_tensor_release(y);
}

void steps_vs_one(ct_strategy *ds, ct_strategy *rs, int steps, int64_t n, int rank, int world)
{
    for (int step = 0; step < steps; step++) {
        ct_step_out o;
        step_on_slice(ds, step, n, rank, world, &o);
        step_on_slice(rs, step, n, 0, 1, &o);
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
    }
}

void step_both(ct_strategy *a, ct_strategy *b, int step, int64_t n, int rank, int world)
{
    ct_step_out o;
    step_on_slice(a, step, n, rank, world, &o);
    step_on_slice(b, step, n, rank, world, &o);
    ASSERT_OK(ct_strategy_step(a));
    ASSERT_OK(ct_strategy_step(b));
    ct_strategy_zero_grad(a);
    ct_strategy_zero_grad(b);
}

void step_on_data_rank(ct_strategy *s, int step, int64_t n, double clip, float *norm, ct_step_out *out)
{
    train_on_data_rank(s, step, n, out);
    if (clip > 0) ASSERT_OK(ct_strategy_clip_grad_norm(s, (float)clip, 2.0, norm));
    ASSERT_OK(ct_strategy_step(s));
}

void train_on_data_rank(ct_strategy *s, int step, int64_t n, ct_step_out *out)
{
    ct_tensor *x, *y;
    global_batch2(step, n, &x, &y);
    int dr, ds;
    ct_strategy_data_rank(s, &dr, &ds);
    if (!strcmp(ct_strategy_kind(s), "none")) dr = 0, ds = 1; /* the reference: the whole batch */
    int64_t lo = n * dr / ds, hi = n * (dr + 1) / ds;
    ct_tensor *xs = rows(x, lo, hi - lo), *ys = rows(y, lo, hi - lo);
    ct_batch b = {.x = xs, .y = ys, .global_rows = n, .sample0 = lo};
    ct_fwd_ctx ctx = {.training = 1, .seed = 7, .step = (uint64_t)step};
    ct_strategy_zero_grad(s);
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, out));
    ct_tensor_release(xs);
    ct_tensor_release(ys);
    ct_tensor_release(x);
    ct_tensor_release(y);
}

ct_module *mlp8(uint64_t seed, int64_t mid)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_dropout_create(0.25f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, mid, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(mid, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, NCLS, 1)));
    ct_module_init_params(m, seed);
    return m;
}

double state_rel_l2(const ct_state *a, const ct_state *b)
{
    double num = 0, den = 0;
    ASSERT_EQ(a->n, b->n);
    for (int i = 0; i < a->n; i++) {
        const ct_tensor *y = NULL;
        for (int j = 0; j < b->n; j++)
            if (!strcmp(a->names[i], b->names[j])) y = b->tensors[j];
        if (!y) ct_test_fail(__FILE__, __LINE__, "'%s' is missing from the other state", a->names[i]);
        const ct_tensor *x = a->tensors[i];
        ASSERT_EQ(x->numel, y->numel);
        if (x->dtype == CT_I64) {
            ASSERT_EQ(((int64_t *)ct_tensor_data(x))[0], ((int64_t *)ct_tensor_data(y))[0]);
            continue;
        }
        for (int64_t k = 0; k < x->numel; k++) {
            double d = (double)ct_f32(x)[k] - ct_f32(y)[k];
            num += d * d;
            den += (double)ct_f32(y)[k] * ct_f32(y)[k];
        }
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static ct_status twice_fwd(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                           const ct_fwd_ctx *ctx)
{
    ct_tensor *mid;
    ct_record *r1 = NULL, *r2 = NULL;
    CT_TRY(ct_module_forward(m->kids[0], in, &mid, rec ? &r1 : NULL, ctx));
    if (rec) CT_TRY(ct_record_add_kid(rec, r1));
    ct_status s = ct_module_forward(m->kids[0], mid, out, rec ? &r2 : NULL, ctx);
    ct_tensor_release(mid);
    if (s == CT_OK && rec) s = ct_record_add_kid(rec, r2);
    return s;
}

static ct_status twice_bwd(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    ct_tensor *g;
    ct_record *r1 = rec->kids[0], *r2 = rec->kids[1];
    rec->kids[0] = rec->kids[1] = NULL;
    ct_status s = ct_module_backward(m->kids[0], dout, &g, r2);
    if (s != CT_OK) {
        ct_record_destroy(r1);
        return s;
    }
    s = ct_module_backward(m->kids[0], g, din, r1);
    ct_tensor_release(g);
    return s;
}

static const ct_module_ops twice_ops = {"twice", twice_fwd, twice_bwd, NULL, 0, NULL, NULL, 0};

ct_module *twice_create(ct_module *f)
{
    ct_module *tw = ct_module_create(&twice_ops, NULL);
    ASSERT(tw != NULL);
    ASSERT_OK(ct_module_add(tw, "f", f));
    return tw;
}

int branch_take;

static ct_status branch_fwd(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                            const ct_fwd_ctx *ctx)
{
    ct_record *kr = NULL;
    if (rec) rec->ival[0] = branch_take;
    CT_TRY(ct_module_forward(m->kids[branch_take], in, out, rec ? &kr : NULL, ctx));
    if (rec) CT_TRY(ct_record_add_kid(rec, kr));
    return CT_OK;
}

static ct_status branch_bwd(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    ct_record *kr = rec->kids[0];
    rec->kids[0] = NULL;
    return ct_module_backward(m->kids[rec->ival[0]], dout, din, kr);
}

static const ct_module_ops branch_ops = {"branch", branch_fwd, branch_bwd, NULL, 0, NULL, NULL, 0};

ct_module *branch_create(ct_module *used, ct_module *unused)
{
    ct_module *br = ct_module_create(&branch_ops, NULL);
    ASSERT(br && used && unused);
    ASSERT_OK(ct_module_add(br, "used", used));
    ASSERT_OK(ct_module_add(br, "unused", unused));
    return br;
}

/* ---- the tiny gpt ---- */

ct_module *gpt_tiny(uint64_t seed)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 2, 2, 8, GPT_CTX, GPT_VOCAB);
    c.dropout = 0.1f;
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, seed, &m));
    /* Larger weights than the init so a few steps move the loss visibly. */
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) {
        ct_rng r;
        ct_rng_init(&r, seed, (uint64_t)i);
        if (ps[i]->data->ndim == 2) ct_rng_normal(&r, ct_f32(ps[i]->data), (size_t)ps[i]->data->numel, 0, 0.3f);
    }
    ct_free(ps);
    return m;
}

/* The step's global batch: n sequences of GPT_CTX tokens and their next tokens. */
static void gpt_batch(int step, int64_t n, ct_tensor **x, ct_tensor **y)
{
    int64_t sh[2] = {n, GPT_CTX};
    *x = ct_tensor_create(CT_I64, 2, sh, CT_MEM_ACT);
    *y = ct_tensor_create(CT_I64, 2, sh, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 77, (uint64_t)step);
    float u[GPT_CTX + 1];
    for (int64_t i = 0; i < n; i++) {
        ct_rng_uniform(&r, u, GPT_CTX + 1);
        for (int t = 0; t < GPT_CTX; t++) {
            ((int64_t *)ct_tensor_data(*x))[i * GPT_CTX + t] = (int64_t)(u[t] * GPT_VOCAB) % GPT_VOCAB;
            ((int64_t *)ct_tensor_data(*y))[i * GPT_CTX + t] = (int64_t)(u[t + 1] * GPT_VOCAB) % GPT_VOCAB;
        }
    }
}

static ct_tensor *seq_rows(ct_tensor *t, int64_t r0, int64_t n)
{
    return ct_tensor_view(t, r0 * GPT_CTX, 2, (int64_t[]){n, GPT_CTX});
}

/* One train step on this rank's slice (ct_strategy_data_rank: a pipeline's
 * ranks share one) of the global batch, or on all of it (whole). */
void gpt_step(ct_strategy *s, int step, int64_t n, int whole, double *loss)
{
    ct_tensor *x, *y;
    gpt_batch(step, n, &x, &y);
    int rank = 0, world = 1;
    if (!whole) ct_strategy_data_rank(s, &rank, &world);
    int64_t q = n / world, rem = n % world;
    int64_t first = rank * q + (rank < rem ? rank : rem), count = q + (rank < rem);
    ct_batch b = {seq_rows(x, first, count), seq_rows(y, first, count), n, first};
    ct_fwd_ctx ctx = {.training = 1, .seed = 9, .step = (uint64_t)step};
    ct_step_out out;
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
    *loss = out.loss_sum;
    ct_tensor_release(b.x);
    ct_tensor_release(b.y);
    ct_tensor_release(x);
    ct_tensor_release(y);
}

/* 0 linear, 1 tanh, 2 (0 linear, 1 relu, 2 linear), 3 layernorm, [dropout], 4/5 linear */
ct_module *fsdp_nested(uint64_t seed, int dropout)
{
    ct_module *m = ct_sequential_create(), *inner = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(inner, NULL, ct_linear_create(16, 16, 1)));
    ASSERT_OK(ct_module_add(inner, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(inner, NULL, ct_linear_create(16, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, inner));
    ASSERT_OK(ct_module_add(m, NULL, ct_layernorm_create(16, 1e-5f)));
    if (dropout) ASSERT_OK(ct_module_add(m, NULL, ct_dropout_create(0.25f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, NCLS, 1)));
    ct_module_init_params(m, seed);
    return m;
}

void states_close(ct_strategy *a, ct_strategy *b, double tol, const char *what)
{
    ct_state sa, sb;
    ASSERT_OK(ct_strategy_model_state(a, &sa));
    ASSERT_OK(ct_strategy_model_state(b, &sb));
    if (ct_group_rank(ct_group_world()) == 0) {
        double d = state_rel_l2(&sa, &sb);
        if (!(d < tol)) ct_test_fail(__FILE__, __LINE__, "%s: states differ: rel L2 %g >= %g", what, d, tol);
    }
    ct_state_fini(&sa);
    ct_state_fini(&sb);
}

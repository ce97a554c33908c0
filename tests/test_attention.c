/* The attention core's paths against each other: bf16 (the AVX512_BF16
 * kernels, and the portable oneDNN path under CTRAIN_ATTN_PORTABLE=1) against
 * f32, and the kernels against the portable path, for sequence lengths that
 * are not multiples of the kernels' 16-row tiles or the portable path's
 * 64-row blocks, head widths 16 to 64, with and without dropout.  The f32
 * path itself is held to finite differences in test_gpt_layers.c. */
#include <stdlib.h>

#include "nn/internal.h" /* the kernels, ct__grad_bf16_* */
#include "test_layers.h"

typedef struct {
    ct_tensor *y, *dx;
    float *grads; /* every parameter's gradient, in ct_module_params order */
    int64_t ngrad;
} run_out;

static void out_free(run_out *o)
{
    ct_tensor_release(o->y);
    ct_tensor_release(o->dx);
    free(o->grads);
}

/* bf16 compute copies of the attention's two weights (on), or none. */
static void set_bf16(ct_module *m, int on)
{
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) {
        ct_tensor_release(ps[i]->compute);
        ps[i]->compute = NULL;
        if (!on || ps[i]->data->ndim != 2) continue;
        ps[i]->compute = ct_tensor_empty(CT_BF16, 2, ps[i]->data->shape, CT_MEM_PARAM);
        ASSERT(ps[i]->compute);
        ct_f32_to_bf16_n(ct_f32(ps[i]->data), ct_tensor_data(ps[i]->compute), (size_t)ps[i]->data->numel);
    }
    ct_free(ps);
}

/* Forward and backward once at x with output gradient dy. */
static run_out run(ct_module *m, ct_tensor *x, ct_tensor *dy, const ct_fwd_ctx *ctx)
{
    run_out o = {0};
    ct_record *rec;
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, x, &o.y, &rec, ctx));
    ASSERT(o.y->dtype == CT_F32);
    ASSERT_OK(ct_module_backward(m, dy, &o.dx, rec));
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) o.ngrad += ps[i]->grad->numel;
    o.grads = malloc(sizeof(float) * (size_t)o.ngrad);
    ASSERT(o.grads);
    for (int i = 0, at = 0; i < n; at += (int)ps[i]->grad->numel, i++)
        memcpy(o.grads + at, ct_f32(ps[i]->grad), sizeof(float) * (size_t)ps[i]->grad->numel);
    ct_free(ps);
    return o;
}

/* max |a - b| / max |b|: errors relative to the tensor's scale, as bf16's
 * relative rounding makes them. */
static double rel_err(const float *a, const float *b, int64_t n)
{
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        ASSERT(isfinite(a[i]));
        e = fmax(e, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs((double)b[i]));
    }
    ASSERT(s > 0);
    return e / s;
}

static void compare(const char *what, const run_out *a, const run_out *b, double tol)
{
    double ey = rel_err(ct_f32(a->y), ct_f32(b->y), a->y->numel);
    double ex = rel_err(ct_f32(a->dx), ct_f32(b->dx), a->dx->numel);
    double eg = rel_err(a->grads, b->grads, a->ngrad);
    if (getenv("CTRAIN_ATTN_VERBOSE")) fprintf(stderr, "    %s: y %.2e dx %.2e grads %.2e\n", what, ey, ex, eg);
    if (!(ey <= tol && ex <= tol && eg <= tol))
        ct_test_fail(__FILE__, __LINE__, "%s: relative errors y %.3g dx %.3g grads %.3g (tolerance %g)", what, ey,
                     ex, eg, tol);
}

/* t's values rounded to bf16, so that a bf16 copy of t loses nothing. */
static void bf16_exact(ct_tensor *t)
{
    for (int64_t i = 0; i < t->numel; i++) ct_f32(t)[i] = ct_bf16_to_f32(ct_f32_to_bf16(ct_f32(t)[i]));
}

/* One shape: f32, then bf16 on the kernels and on the portable path. */
static void check(int64_t B, int64_t T, int64_t D, int H, float p)
{
    ct_module *m = ct_attention_create(D, H, p, 0.0f);
    ASSERT(m);
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) {
        rand_fill(ps[i]->data, 40 + (uint64_t)i, -0.5f, 0.5f);
        bf16_exact(ps[i]->data);
    }
    ct_free(ps);
    ct_tensor *x = rand_tensor(3, (int64_t[]){B, T, D}, 7, -1.5f, 1.5f);
    ct_tensor *dy = rand_tensor(3, (int64_t[]){B, T, D}, 8, -1.0f, 1.0f);
    bf16_exact(x);
    bf16_exact(dy);
    ct_fwd_ctx ctx = train_ctx();
    char what[96];
    snprintf(what, sizeof what, "B=%lld T=%lld D=%lld H=%d p=%g", (long long)B, (long long)T, (long long)D, H,
             (double)p);
    unsetenv("CTRAIN_ATTN_PORTABLE");
    run_out f = run(m, x, dy, &ctx);
    set_bf16(m, 1);
    run_out k = run(m, x, dy, &ctx);
    setenv("CTRAIN_ATTN_PORTABLE", "1", 1);
    run_out o = run(m, x, dy, &ctx);
    unsetenv("CTRAIN_ATTN_PORTABLE");
    set_bf16(m, 0);
    /* bf16 operands (8 bits of mantissa) in every product, P and dS rounded
     * to bf16: a few 2^-8 of the tensor's scale. */
    char w2[128];
    snprintf(w2, sizeof w2, "%s: bf16 vs f32", what);
    compare(w2, &k, &f, 3e-2);
    snprintf(w2, sizeof w2, "%s: portable bf16 vs f32", what);
    compare(w2, &o, &f, 3e-2);
    /* The same roundings in another order (and exp, scale): a bf16 step at most here and there. */
    snprintf(w2, sizeof w2, "%s: kernels vs portable bf16", what);
    compare(w2, &k, &o, 1e-2);
    out_free(&f);
    out_free(&k);
    out_free(&o);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(m);
}

/* Without AVX512_BF16 the portable path runs both times: still held to f32,
 * but the test says the kernels went unchecked. */
static void need_kernels(void)
{
    if (!ct_cpu_has_avx512_bf16()) SKIP("the CPU has no AVX512_BF16: only the portable path ran");
}

TEST(attention_bf16_ragged_lengths)
{
    int64_t Ts[] = {1, 2, 15, 16, 17, 33, 64, 65, 100, 128};
    for (size_t i = 0; i < sizeof Ts / sizeof *Ts; i++) check(2, Ts[i], 64, 2, 0.0f);
    need_kernels();
}

TEST(attention_bf16_head_widths)
{
    check(2, 40, 64, 4, 0.0f);  /* hd 16 */
    check(2, 40, 96, 2, 0.0f);  /* hd 48 */
    check(2, 40, 128, 2, 0.0f); /* hd 64 */
    check(1, 40, 24, 2, 0.0f);  /* hd 12: no kernel, portable both times */
    need_kernels();
}

/* The input c_proj keeps (its record's first saved tensor) after one forward. */
static ct_tensor *c_proj_input(ct_module *m, ct_tensor *x)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_tensor *y;
    ct_record *rec;
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    ASSERT(rec->nkids == 3);
    ct_tensor *in = ct_tensor_clone(ct_record_saved(rec->kids[1], 0), CT_MEM_ACT);
    ct_tensor_release(y);
    ct_record_destroy(rec);
    return in;
}

/* When c_proj computes in bf16 the kernels hand it y as BF16, which must be
 * ct_f32_to_bf16 of the f32 y they give a c_proj that computes in f32. */
TEST(attention_bf16_y_rounds_as_c_proj_would)
{
    need_kernels();
    ct_module *m = ct_attention_create(64, 2, 0.0f, 0.0f);
    ASSERT(m);
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) rand_fill(ps[i]->data, 60 + (uint64_t)i, -0.5f, 0.5f);
    ct_free(ps);
    ct_tensor *x = rand_tensor(3, (int64_t[]){2, 37, 64}, 61, -1.5f, 1.5f);
    set_bf16(m, 1);
    ct_tensor *yh = c_proj_input(m, x);
    ct_param *w = m->kids[1]->params[0];
    ct_tensor_release(w->compute); /* c_proj in f32: y stays F32 */
    w->compute = NULL;
    ct_tensor *yf = c_proj_input(m, x);
    ASSERT(yh->dtype == CT_BF16 && yf->dtype == CT_F32 && yh->numel == yf->numel);
    for (int64_t i = 0; i < yf->numel; i++)
        ASSERT_EQ(((uint16_t *)ct_tensor_data(yh))[i], ct_f32_to_bf16(ct_f32(yf)[i]));
    set_bf16(m, 0);
    ct_tensor_release(yh);
    ct_tensor_release(yf);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(attention_bf16_dropout)
{
    check(2, 33, 64, 2, 0.2f);
    check(3, 70, 64, 4, 0.1f);
    need_kernels();
}

/* With a bf16 c_attn the kernels' backward hands it dqkv as bf16 with column
 * sums: every element is ct_f32_to_bf16 of the f32 dqkv they give otherwise,
 * and the sums are the f32 dqkv's columns summed row after row, as c_attn's
 * own pass would; with and without dropout, T not a multiple of 16. */
TEST(attention_bf16_hands_c_attn_a_bf16_gradient)
{
    need_kernels();
    for (int drop = 0; drop < 2; drop++) {
        int64_t B = 2, T = 37, D = 64, H = 2;
        ct__attn_dims d = {B, T, D, H, drop ? 0.25f : 0.0f};
        ct_tensor *q32 = rand_tensor(3, (int64_t[]){B, T, 3 * D}, 70, -1.5f, 1.5f);
        ct_tensor *dy = rand_tensor(3, (int64_t[]){B, T, D}, 71, -1.0f, 1.0f);
        ct_tensor *qkv = ct_tensor_empty(CT_BF16, 3, q32->shape, CT_MEM_ACT);
        ct_tensor *P = ct_tensor_empty(CT_BF16, 1, (int64_t[]){B * H * 2 * ct__attn_bf16_pwords(T)}, CT_MEM_ACT);
        ct_tensor *y = ct_tensor_empty(CT_F32, 3, dy->shape, CT_MEM_ACT);
        ct_tensor *f = ct_tensor_empty(CT_F32, 3, q32->shape, CT_MEM_ACT), *g = ct__grad_bf16_create(3, q32->shape);
        uint8_t *mask = drop ? malloc((size_t)(B * H * T * T)) : NULL;
        ASSERT(qkv && P && y && f && g && (!drop || mask));
        for (int64_t i = 0; mask && i < B * H * T * T; i++) mask[i] = (uint8_t)((i * 7 + i / 5) % 4 != 0);
        ct_f32_to_bf16_n(ct_f32(q32), ct_tensor_data(qkv), (size_t)q32->numel);
        ASSERT_OK(ct__attn_bf16_forward(&d, ct_tensor_data(qkv), mask, ct_tensor_data(P), ct_f32(y), 0));
        ASSERT_OK(ct__attn_bf16_backward(&d, ct_tensor_data(qkv), mask, ct_tensor_data(P), ct_f32(dy), ct_f32(f), NULL));
        float *sum = ct__grad_bf16_colsum(g);
        ASSERT(sum);
        ASSERT_OK(ct__attn_bf16_backward(&d, ct_tensor_data(qkv), mask, ct_tensor_data(P), ct_f32(dy),
                                         ct_tensor_data(g), sum));
        const float *fv = ct_f32(f);
        for (int64_t i = 0; i < f->numel; i++) ASSERT_EQ(((uint16_t *)ct_tensor_data(g))[i], ct_f32_to_bf16(fv[i]));
        for (int64_t j = 0; j < 3 * D; j++) {
            float want = 0.0f;
            for (int64_t r = 0; r < B * T; r++) want += fv[r * 3 * D + j];
            ASSERT(sum[j] == want);
        }
        free(mask);
        ct_tensor_release(q32);
        ct_tensor_release(dy);
        ct_tensor_release(qkv);
        ct_tensor_release(P);
        ct_tensor_release(y);
        ct_tensor_release(f);
        ct_tensor_release(g);
    }
}

/*
 * 2-D convolution (square kernel, stride, zero padding) and 2-D max pooling
 * over [N, C, H, W] f32 tensors.
 *
 * Convolution lowers to matrix products with im2col: a chunk of nb images
 * becomes col [K = Cin*k*k, nb*P] (P = Ho*Wo output pixels per image), so
 * forward is one product W [Cout, K] x col, and backward is dW += dy col^T
 * and dcol = W^T dy followed by col2im.  Batching images into one product
 * keeps BLAS efficient when Cout and P are small (LeNet-sized layers); the
 * chunk is bounded so col stays cache-sized whatever the batch.  col is
 * recomputed in backward rather than saved: it is k*k times the input.
 *
 * When the weight has a bf16 compute copy or the input is bf16 (see
 * internal.h), the products run in bf16 with f32 accumulation: x is cast to
 * bf16 once and that copy is what the record keeps, col is built in bf16,
 * dy is cast per chunk; y, dW and dx stay f32 (dcol is f32 and col2im sums
 * in f32), and the bias stays f32.
 */
#include <limits.h>
#include <string.h>

#include "internal.h"

/* Upper bound on the col scratch, in floats (512 KB): small enough to stay in
 * L2 between im2col and the product, which measured 2-3x faster on LeNet's
 * layers than one batch-sized col; large enough for wide products. */
#define COL_LIMIT (128L << 10)

typedef struct {
    int cin, cout, k, stride, pad, bias;
} conv_impl;

typedef struct {
    int k, stride;
} pool_impl;

#define nm ct__nn_name

/* Range [lo, hi) of output positions o with 0 <= o*s - pad + off < n. */
static void valid_range(int n, int s, int pad, int off, int no, int *lo, int *hi)
{
    int a = pad - off; /* need o*s >= a */
    int l = a <= 0 ? 0 : (a + s - 1) / s;
    int b = n - 1 + pad - off; /* need o*s <= b */
    int h = b < 0 ? 0 : b / s + 1;
    *lo = l < no ? l : no;
    *hi = h < no ? h : no;
    if (*hi < *lo) *hi = *lo;
}

/* One image x [C, H, W] into col rows (c, ki, kj), columns [0, Ho*Wo), row
 * stride ld; the same code for f32 and bf16 elements. */
#define DEFINE_IM2COL(name, T)                                                                  \
    static void name(const T *restrict x, int C, int H, int W, int k, int s, int pad, int Ho,   \
                     int Wo, T *restrict col, int64_t ld)                                       \
    {                                                                                           \
        for (int c = 0; c < C; c++)                                                             \
            for (int ki = 0; ki < k; ki++)                                                      \
                for (int kj = 0; kj < k; kj++) {                                                \
                    T *dst = col + ((int64_t)(c * k + ki) * k + kj) * ld;                       \
                    int wlo, whi;                                                               \
                    valid_range(W, s, pad, kj, Wo, &wlo, &whi);                                 \
                    for (int oh = 0; oh < Ho; oh++) {                                           \
                        T *d = dst + (int64_t)oh * Wo;                                          \
                        int ih = oh * s - pad + ki;                                             \
                        if (ih < 0 || ih >= H) {                                                \
                            memset(d, 0, (size_t)Wo * sizeof *d);                               \
                            continue;                                                           \
                        }                                                                       \
                        /* x[base + ow*s] is in the row for ow in [wlo, whi); base may be < 0. */ \
                        int64_t base = ((int64_t)c * H + ih) * W - pad + kj;                    \
                        for (int ow = 0; ow < wlo; ow++) d[ow] = 0;                             \
                        if (s == 1)                                                             \
                            memcpy(d + wlo, x + base + wlo, (size_t)(whi - wlo) * sizeof *d);   \
                        else                                                                    \
                            for (int ow = wlo; ow < whi; ow++) d[ow] = x[base + (int64_t)ow * s]; \
                        for (int ow = whi; ow < Wo; ow++) d[ow] = 0;                            \
                    }                                                                           \
                }                                                                               \
    }
DEFINE_IM2COL(im2col_f32, float)
DEFINE_IM2COL(im2col_bf16, uint16_t)

/* im2col of image n of x (f32 or bf16 elements) into column block col + off. */
static void im2col(const ct_tensor *x, int64_t n, const conv_impl *c, int H, int W, int Ho,
                   int Wo, void *col, int64_t off, int64_t ld)
{
    int64_t xs = (int64_t)c->cin * H * W;
    if (x->dtype == CT_BF16)
        im2col_bf16((const uint16_t *)ct_tensor_data(x) + n * xs, c->cin, H, W, c->k, c->stride,
                    c->pad, Ho, Wo, (uint16_t *)col + off, ld);
    else
        im2col_f32(ct_f32(x) + n * xs, c->cin, H, W, c->k, c->stride, c->pad, Ho, Wo,
                   (float *)col + off, ld);
}

/* C = op(A) op(B) + beta C, with A and B bf16 bits when bf16, else f32
 * (on the engine measured faster for the shape: src/core/gemm.c). */
static ct_status prod(int bf16, int ta, int tb, int m, int n, int k, const void *a, int lda,
                      const void *b, int ldb, float beta, float *c, int ldc)
{
    if (bf16) return ct_gemm_bf16(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
    return ct_gemm_f32(CT_GEMM_AUTO, ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

/* The adjoint of im2col: adds col's entries back into dx [C, H, W]. */
static void col2im(const float *restrict col, int64_t ld, int C, int H, int W, int k, int s,
                   int pad, int Ho, int Wo, float *restrict dx)
{
    for (int c = 0; c < C; c++)
        for (int ki = 0; ki < k; ki++)
            for (int kj = 0; kj < k; kj++) {
                const float *srcrow = col + ((int64_t)(c * k + ki) * k + kj) * ld;
                int wlo, whi;
                valid_range(W, s, pad, kj, Wo, &wlo, &whi);
                for (int oh = 0; oh < Ho; oh++) {
                    int ih = oh * s - pad + ki;
                    if (ih < 0 || ih >= H) continue;
                    const float *sr = srcrow + (int64_t)oh * Wo;
                    int64_t base = ((int64_t)c * H + ih) * W - pad + kj;
                    if (s == 1) { /* contiguous: let the compiler vectorise it */
                        float *restrict d = dx + base + wlo;
                        const float *restrict q = sr + wlo;
                        for (int i = 0; i < whi - wlo; i++) d[i] += q[i];
                    } else {
                        for (int ow = wlo; ow < whi; ow++) dx[base + (int64_t)ow * s] += sr[ow];
                    }
                }
            }
}

/* ---- conv2d ------------------------------------------------------------ */

typedef struct {
    int N, H, W, Ho, Wo, K, P, nb;
} conv_geom;

static ct_status conv_check(const ct_module *m, const ct_tensor *in, conv_geom *g)
{
    const conv_impl *c = m->impl;
    char sh[64];
    if ((in->dtype != CT_F32 && in->dtype != CT_BF16) || in->ndim != 4 || in->shape[1] != c->cin)
        return ct_error(CT_EINVAL, "conv2d '%s': input %s %s must be F32 or BF16 [N, %d, H, W]; check the "
                        "channel count of the previous layer", nm(m), ct_dtype_name(in->dtype),
                        ct_shape_str(in, sh, sizeof sh), c->cin);
    if (in->shape[2] + 2 * c->pad < c->k || in->shape[3] + 2 * c->pad < c->k)
        return ct_error(CT_EINVAL, "conv2d '%s': input %s is smaller than the %dx%d kernel with "
                        "padding %d", nm(m), ct_shape_str(in, sh, sizeof sh), c->k, c->k, c->pad);
    if (in->shape[0] > INT_MAX || in->shape[2] > 65535 || in->shape[3] > 65535)
        return ct_error(CT_EINVAL, "conv2d '%s': input %s is too large", nm(m),
                        ct_shape_str(in, sh, sizeof sh));
    g->N = (int)in->shape[0];
    g->H = (int)in->shape[2];
    g->W = (int)in->shape[3];
    g->Ho = (g->H + 2 * c->pad - c->k) / c->stride + 1;
    g->Wo = (g->W + 2 * c->pad - c->k) / c->stride + 1;
    g->K = c->cin * c->k * c->k;
    g->P = g->Ho * g->Wo;
    int64_t per = (int64_t)g->K * g->P;
    int64_t nb = per > 0 ? COL_LIMIT / per : g->N;
    if (nb < 1) nb = 1;
    if (nb > g->N) nb = g->N;
    g->nb = (int)nb;
    if ((int64_t)g->nb * g->P > INT_MAX || (int64_t)g->K * g->nb * g->P > ((int64_t)1 << 40))
        return ct_error(CT_EINVAL, "conv2d '%s': input %s is too large", nm(m),
                        ct_shape_str(in, sh, sizeof sh));
    return CT_OK;
}

/* x [N, Cin, H, W] (F32 or BF16) -> y [N, Cout, Ho, Wo] F32; saves x (F32
 * path) or its bf16 cast (bf16 path). */
static ct_status conv_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                              const ct_fwd_ctx *ctx)
{
    (void)ctx;
    const conv_impl *c = m->impl;
    conv_geom g;
    CT_TRY(conv_check(m, in, &g));
    ct_param *Wp = m->params[0];
    int bf16;
    CT_TRY(ct__param_compute(m, Wp, &bf16));
    bf16 |= in->dtype == CT_BF16;
    ct_tensor *y = ct_tensor_create4(g.N, c->cout, g.Ho, g.Wo, CT_MEM_ACT);
    ct_tensor *x = !y ? NULL : bf16 ? ct__tensor_bf16(in) : ct_tensor_retain(in);
    if (!x) {
        ct_tensor_release(y);
        return CT_ENOMEM;
    }
    ct_status st = CT_OK;
    void *col = NULL;
    float *tmp = NULL;
    uint16_t *wtmp = NULL;
    if (g.N == 0) goto done;
    int64_t ld = (int64_t)g.nb * g.P;
    col = ct_alloc((size_t)g.K * ld * (bf16 ? 2 : 4), CT_MEM_ACT);
    tmp = g.nb > 1 ? ct_alloc((size_t)c->cout * ld * sizeof(float), CT_MEM_ACT) : NULL;
    const void *w = ct_tensor_data(Wp->data);
    const uint16_t *wh = NULL;
    if (!col || (g.nb > 1 && !tmp)) st = CT_ENOMEM;
    else if (bf16 && (st = ct__param_bf16(Wp, &wh, &wtmp)) == CT_OK) w = wh;
    if (st != CT_OK) goto done;
    const float *b = c->bias ? ct_f32(m->params[1]->data) : NULL;
    float *yd = ct_f32(y);
    int64_t ys = (int64_t)c->cout * g.P;
    for (int n0 = 0; st == CT_OK && n0 < g.N; n0 += g.nb) {
        int nb = g.N - n0 < g.nb ? g.N - n0 : g.nb;
        for (int i = 0; i < nb; i++)
            im2col(x, n0 + i, c, g.H, g.W, g.Ho, g.Wo, col, (int64_t)i * g.P, ld);
        if (g.nb == 1) {
            /* One image: the product lands in y directly, on top of the bias. */
            float *yn = yd + n0 * ys;
            if (b)
                for (int o = 0; o < c->cout; o++)
                    for (int p = 0; p < g.P; p++) yn[(int64_t)o * g.P + p] = b[o];
            st = prod(bf16, 0, 0, c->cout, g.P, g.K, w, g.K, col, (int)ld, b ? 1.0f : 0.0f, yn, g.P);
            continue;
        }
        st = prod(bf16, 0, 0, c->cout, nb * g.P, g.K, w, g.K, col, (int)ld, 0.0f, tmp, (int)ld);
        /* tmp is [Cout][image][P]; y wants [image][Cout][P]. */
        for (int i = 0; st == CT_OK && i < nb; i++)
            for (int o = 0; o < c->cout; o++) {
                const float *t = tmp + (int64_t)o * ld + (int64_t)i * g.P;
                float *yo = yd + (n0 + i) * ys + (int64_t)o * g.P;
                float bo = b ? b[o] : 0.0f;
                for (int p = 0; p < g.P; p++) yo[p] = t[p] + bo;
            }
    }
done:
    ct_free(col);
    ct_free(tmp);
    ct_free(wtmp);
    if (st != CT_OK) {
        ct_tensor_release(x);
        ct_tensor_release(y);
        return st;
    }
    if (rec && ct_record_save(rec, x) < 0) st = CT_ENOMEM;
    ct_tensor_release(x); /* the record holds its own reference */
    if (st != CT_OK) {
        ct_tensor_release(y);
        return st;
    }
    *out = y;
    return CT_OK;
}

/* dy [N, Cout, Ho, Wo] F32: dW += dy col^T, db += sums of dy, dx = col2im(W^T dy)
 * (F32, only if din).  The bf16 path is taken when forward saved a bf16 x. */
static ct_status conv_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const conv_impl *c = m->impl;
    ct_tensor *xt = ct_record_saved(rec, 0);
    conv_geom g;
    CT_TRY(conv_check(m, xt, &g));
    if (dout->dtype != CT_F32 || dout->numel != (int64_t)g.N * c->cout * g.P) {
        char a[64];
        return ct_error(CT_EINVAL, "conv2d '%s': output gradient %s does not match the output "
                        "[%d, %d, %d, %d]", nm(m), ct_shape_str(dout, a, sizeof a), g.N, c->cout,
                        g.Ho, g.Wo);
    }
    ct_param *Wp = m->params[0], *Bp = c->bias ? m->params[1] : NULL;
    int bf16 = xt->dtype == CT_BF16;
    if (bf16) CT_TRY(ct__param_compute(m, Wp, &(int){0}));
    float *gw = Wp->requires_grad && Wp->grad ? ct_f32(Wp->grad) : NULL;
    float *gb = Bp && Bp->requires_grad && Bp->grad ? ct_f32(Bp->grad) : NULL;
    ct_tensor *dx = NULL;
    if (din && !(dx = ct_tensor_create(CT_F32, 4, xt->shape, CT_MEM_ACT))) return CT_ENOMEM;
    ct_status st = CT_OK;
    void *col = NULL;
    float *dyc = NULL, *dcol = NULL;
    uint16_t *dyh = NULL, *wtmp = NULL;
    if (g.N == 0 || (!gw && !gb && !dx)) goto done;

    int64_t ld = (int64_t)g.nb * g.P;
    /* col holds im2col(x) for dW, in x's precision; dcol = W^T dy is f32 (in
     * the f32 path it reuses col once dW is done). */
    col = ct_alloc((size_t)g.K * ld * (bf16 ? 2 : 4), CT_MEM_ACT);
    dyc = g.nb > 1 ? ct_alloc((size_t)c->cout * ld * sizeof(float), CT_MEM_ACT) : NULL;
    dcol = bf16 && dx ? ct_alloc((size_t)g.K * ld * sizeof(float), CT_MEM_ACT) : col;
    dyh = bf16 ? ct_alloc((size_t)c->cout * ld * sizeof *dyh, CT_MEM_ACT) : NULL;
    const void *w = ct_tensor_data(Wp->data);
    const uint16_t *wh = NULL;
    if (!col || (g.nb > 1 && !dyc) || !dcol || (bf16 && !dyh)) st = CT_ENOMEM;
    else if (bf16 && dx && (st = ct__param_bf16(Wp, &wh, &wtmp)) == CT_OK) w = wh;
    if (st != CT_OK) goto done;
    const float *dy = ct_f32(dout);
    int64_t xs = (int64_t)c->cin * g.H * g.W, ys = (int64_t)c->cout * g.P;
    for (int n0 = 0; st == CT_OK && n0 < g.N; n0 += g.nb) {
        int nb = g.N - n0 < g.nb ? g.N - n0 : g.nb;
        const float *d; /* this chunk's dy as [Cout][image][P], row stride ld */
        if (g.nb == 1) {
            d = dy + n0 * ys;
        } else {
            for (int i = 0; i < nb; i++)
                for (int o = 0; o < c->cout; o++)
                    memcpy(dyc + (int64_t)o * ld + (int64_t)i * g.P, dy + (n0 + i) * ys + (int64_t)o * g.P,
                           (size_t)g.P * sizeof(float));
            d = dyc;
        }
        const void *dp = d; /* the products' dy operand */
        if (bf16) {
            for (int o = 0; o < c->cout; o++)
                ct_f32_to_bf16_n(d + (int64_t)o * ld, dyh + (int64_t)o * ld, (size_t)nb * g.P);
            dp = dyh;
        }
        if (gb)
            for (int o = 0; o < c->cout; o++) {
                const float *r = d + (int64_t)o * ld;
                float s = 0.0f;
                for (int64_t p = 0; p < (int64_t)nb * g.P; p++) s += r[p];
                gb[o] += s;
            }
        if (gw) {
            for (int i = 0; i < nb; i++)
                im2col(xt, n0 + i, c, g.H, g.W, g.Ho, g.Wo, col, (int64_t)i * g.P, ld);
            st = prod(bf16, 0, 1, c->cout, g.K, nb * g.P, dp, (int)ld, col, (int)ld, 1.0f, gw, g.K);
        }
        if (st == CT_OK && dx) {
            st = prod(bf16, 1, 0, g.K, nb * g.P, c->cout, w, g.K, dp, (int)ld, 0.0f, dcol, (int)ld);
            for (int i = 0; st == CT_OK && i < nb; i++)
                col2im(dcol + (int64_t)i * g.P, ld, c->cin, g.H, g.W, c->k, c->stride, c->pad, g.Ho,
                       g.Wo, ct_f32(dx) + (n0 + i) * xs);
        }
    }
done:
    if (dcol != col) ct_free(dcol);
    ct_free(col);
    ct_free(dyc);
    ct_free(dyh);
    ct_free(wtmp);
    if (st != CT_OK) {
        ct_tensor_release(dx);
        return st;
    }
    if (din) *din = dx;
    return CT_OK;
}

static void conv_destroy(ct_module *m) { ct_free(m->impl); }

/* [N, Cin, H, W] -> [N, Cout, Ho, Wo], with conv_check's checks. */
static ct_status conv_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                int64_t *out_shape)
{
    const conv_impl *c = m->impl;
    ct_tensor t = ct__shape_header(ndim, in_shape);
    conv_geom g;
    CT_TRY(conv_check(m, &t, &g));
    out_shape[0] = g.N;
    out_shape[1] = c->cout;
    out_shape[2] = g.Ho;
    out_shape[3] = g.Wo;
    *out_ndim = 4;
    return CT_OK;
}

/* The record keeps x (or its bf16 cast); forward and backward each hold
 * the im2col of nb images at a time (conv_check's geometry: the same
 * COL_LIMIT), with an output chunk (tmp, dyc) when nb > 1, and the bf16
 * path an f32 col gradient and a bf16 dy chunk in backward. */
static ct_status conv_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    const conv_impl *ci = m->impl;
    ct_tensor t = ct__shape_header(nd, sh);
    t.dtype = CT_F32;
    conv_geom g;
    CT_TRY(conv_check(m, &t, &g));
    int bf16 = mixed && ct__act_has_copy(m);
    uint64_t ld = (uint64_t)g.nb * (uint64_t)g.P, col = (uint64_t)g.K * ld * (bf16 ? 2 : 4);
    uint64_t chunk = g.nb > 1 ? (uint64_t)ci->cout * ld * 4 : 0;
    if (bf16) c->saved = ct__act_numel(nd, sh) * 2;
    else c->keep_in = 1;
    c->fwd_tmp = col + chunk;
    c->bwd_tmp = col + chunk + (bf16 ? (need_dx ? (uint64_t)g.K * ld * 4 : 0) + (uint64_t)ci->cout * ld * 2 : 0);
    return CT_OK;
}

static const ct_module_ops conv_ops = {"conv2d", conv_forward, conv_backward, conv_destroy, 0,
                                       conv_out_shape, conv_act_cost, 0};

ct_module *ct_conv2d_create(int64_t cin, int64_t cout, int k, int stride, int pad, int bias)
{
    if (cin <= 0 || cout <= 0 || cin > 65535 || cout > 65535 || k <= 0 || k > 255 || stride <= 0 ||
        pad < 0 || pad > 255) {
        ct_error(CT_EINVAL, "conv2d needs 0 < cin, cout <= 65535, 0 < k <= 255, stride > 0 and "
                 "0 <= pad <= 255; got cin=%lld cout=%lld k=%d stride=%d pad=%d",
                 (long long)cin, (long long)cout, k, stride, pad);
        return NULL;
    }
    conv_impl *c = ct_alloc(sizeof *c, CT_MEM_OTHER);
    if (!c) return NULL;
    *c = (conv_impl){(int)cin, (int)cout, k, stride, pad, bias != 0};
    ct_module *m = ct_module_create(&conv_ops, c);
    if (!m) {
        ct_free(c);
        return NULL;
    }
    if (!ct_module_add_param(m, "weight", 4, (int64_t[]){cout, cin, k, k}) ||
        (bias && !ct_module_add_param(m, "bias", 1, (int64_t[]){cout}))) {
        ct_module_destroy(m);
        return NULL;
    }
    ct__init_fan_in(m, cin * k * k);
    return m;
}

/* ---- maxpool2d --------------------------------------------------------- */

/* x [N, C, H, W] -> y [N, C, Ho, Wo] (no padding, floor); saves the argmax
 * of each window (index within its H*W plane, i32). */
static ct_status pool_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                              const ct_fwd_ctx *ctx)
{
    (void)ctx;
    const pool_impl *pl = m->impl;
    char sh[64];
    if (in->dtype != CT_F32 || in->ndim != 4)
        return ct_error(CT_EINVAL, "maxpool2d '%s': input %s %s must be F32 [N, C, H, W]", nm(m),
                        ct_dtype_name(in->dtype), ct_shape_str(in, sh, sizeof sh));
    if (in->shape[2] < pl->k || in->shape[3] < pl->k || in->shape[2] * in->shape[3] > INT32_MAX)
        return ct_error(CT_EINVAL, "maxpool2d '%s': input %s does not fit a %dx%d window", nm(m),
                        ct_shape_str(in, sh, sizeof sh), pl->k, pl->k);
    int64_t NC = in->shape[0] * in->shape[1];
    int H = (int)in->shape[2], W = (int)in->shape[3], k = pl->k, s = pl->stride;
    int Ho = (H - k) / s + 1, Wo = (W - k) / s + 1;
    ct_tensor *y = ct_tensor_create4(in->shape[0], in->shape[1], Ho, Wo, CT_MEM_ACT);
    ct_tensor *arg = rec && y ? ct_tensor_create(CT_I32, 4, y->shape, CT_MEM_ACT) : NULL;
    if (!y || (rec && !arg)) {
        ct_tensor_release(y);
        ct_tensor_release(arg);
        return CT_ENOMEM;
    }
    const float *x = ct_f32(in);
    float *yd = ct_f32(y);
    int32_t *am = arg ? ct_tensor_data(arg) : NULL;
    for (int64_t pc = 0; pc < NC; pc++) {
        const float *plane = x + pc * H * W;
        for (int oh = 0; oh < Ho; oh++)
            for (int ow = 0; ow < Wo; ow++) {
                int best = oh * s * W + ow * s;
                float bv = plane[best];
                for (int i = 0; i < k; i++)
                    for (int j = 0; j < k; j++) {
                        int idx = (oh * s + i) * W + ow * s + j;
                        /* NaN wins, as in PyTorch, so it propagates. */
                        if (plane[idx] > bv || (plane[idx] != plane[idx] && bv == bv)) {
                            bv = plane[idx];
                            best = idx;
                        }
                    }
                int64_t o = (pc * Ho + oh) * Wo + ow;
                yd[o] = bv;
                if (am) am[o] = best;
            }
    }
    if (rec) {
        int s = ct_record_save(rec, arg);
        ct_tensor_release(arg); /* the record holds it now */
        if (s < 0) {
            ct_tensor_release(y);
            return CT_ENOMEM;
        }
        rec->ival[0] = in->shape[2];
        rec->ival[1] = in->shape[3];
    }
    *out = y;
    return CT_OK;
}

static ct_status pool_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const ct_tensor *arg = ct_record_saved(rec, 0);
    if (dout->dtype != CT_F32 || dout->numel != arg->numel) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "maxpool2d '%s': output gradient %s does not match the output %s",
                        nm(m), ct_shape_str(dout, a, sizeof a), ct_shape_str(arg, b, sizeof b));
    }
    if (!din) return CT_OK;
    int64_t H = rec->ival[0], W = rec->ival[1], Po = arg->shape[2] * arg->shape[3];
    ct_tensor *dx = ct_tensor_create4(arg->shape[0], arg->shape[1], H, W, CT_MEM_ACT);
    if (!dx) return CT_ENOMEM;
    const int32_t *am = ct_tensor_data(arg);
    const float *dy = ct_f32(dout);
    float *g = ct_f32(dx);
    for (int64_t pc = 0; pc < arg->shape[0] * arg->shape[1]; pc++)
        for (int64_t o = 0; o < Po; o++) g[pc * H * W + am[pc * Po + o]] += dy[pc * Po + o];
    *din = dx;
    return CT_OK;
}

static void pool_destroy(ct_module *m) { ct_free(m->impl); }

/* [N, C, H, W] -> [N, C, Ho, Wo], with pool_forward's checks. */
static ct_status pool_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                int64_t *out_shape)
{
    const pool_impl *pl = m->impl;
    ct_tensor t = ct__shape_header(ndim, in_shape);
    char sh[64];
    if (ndim != 4)
        return ct_error(CT_EINVAL, "maxpool2d '%s': input %s must be [N, C, H, W]", nm(m),
                        ct_shape_str(&t, sh, sizeof sh));
    if (in_shape[2] < pl->k || in_shape[3] < pl->k || in_shape[2] * in_shape[3] > INT32_MAX)
        return ct_error(CT_EINVAL, "maxpool2d '%s': input %s does not fit a %dx%d window", nm(m),
                        ct_shape_str(&t, sh, sizeof sh), pl->k, pl->k);
    out_shape[0] = in_shape[0];
    out_shape[1] = in_shape[1];
    out_shape[2] = (in_shape[2] - pl->k) / pl->stride + 1;
    out_shape[3] = (in_shape[3] - pl->k) / pl->stride + 1;
    *out_ndim = 4;
    return CT_OK;
}

/* The record keeps the i32 argmax of every output. */
static ct_status pool_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)mixed, (void)need_dx;
    c->saved = ct__act_out_numel(m, nd, sh) * 4;
    return CT_OK;
}

static const ct_module_ops pool_ops = {"maxpool2d", pool_forward, pool_backward, pool_destroy, 0,
                                       pool_out_shape, pool_act_cost, 0};

ct_module *ct_maxpool2d_create(int k, int stride)
{
    if (k <= 0 || stride < 0) {
        ct_error(CT_EINVAL, "maxpool2d needs k > 0 and stride >= 0 (0 = k), got k=%d stride=%d", k,
                 stride);
        return NULL;
    }
    pool_impl *p = ct_alloc(sizeof *p, CT_MEM_OTHER);
    if (!p) return NULL;
    *p = (pool_impl){k, stride ? stride : k};
    ct_module *m = ct_module_create(&pool_ops, p);
    if (!m) ct_free(p);
    return m;
}

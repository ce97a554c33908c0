/*
 * Layer normalisation over the last dim with an elementwise affine weight
 * and bias (PyTorch's nn.LayerNorm(dim, eps)).  The record keeps the input
 * and each row's mean and 1/std; statistics are summed in double so long
 * rows with a large mean stay accurate.  When its emit_bf16 is set the
 * output is BF16, each value rounded as ct_f32_to_bf16 rounds the f32 one
 * (the consumer casts to bf16 anyway) through an L1 chunk, so the f32
 * output never goes to memory; the record and gradients stay f32.
 *
 * Speed: a row is 128 values in the GPT, so its double sums in 8 vector
 * lanes are chains of dependent adds (latency, not bandwidth, bounded the
 * layer).  Forward and backward therefore work on RB rows side by side, each
 * row summed in exactly the order a row alone would be, and backward makes
 * dx, dweight and dbias in one pass over x and dy plus one over dx.
 */
#include <math.h>

#include "internal.h"

typedef struct {
    int64_t dim;
    float eps;
} ln_impl;

enum { RB = 4 }; /* rows processed side by side */

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

/* Eight lanes as GCC/Clang vectors: the compiler's own vectoriser did not
 * keep the RB rows' accumulators apart.  Operations are lane-wise and not
 * contracted (-std=c11), so each lane rounds as the scalar code would.
 * Loads are macros through an unaligned type (as the intrinsics headers
 * do): a function returning a vector would change the ABI where the build
 * has no AVX. */
typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));
typedef double v8d __attribute__((vector_size(64)));
#define LOAD8(p) (*(const v8f_u *)(const void *)(p))
#define LOAD8D(p) __builtin_convertvector(LOAD8(p), v8d)

/* Means and 1/std of the nr (<= RB) rows at x [nr, D]: per row, sum in 8
 * double lanes (element i in lane i % 8, the last D % 8 elements summed
 * first outside them, then the lanes in order), mean, then the sum of
 * squared deviations the same way.  nr is a constant where this is inlined,
 * so the RB rows' accumulators stay in registers. */
static inline __attribute__((always_inline)) void row_stats(const float *x, int64_t D, int nr, double eps,
                                                            float *mu, float *rs)
{
    const int64_t D8 = D & ~(int64_t)7;
    v8d a[RB];
    double m[RB];
    for (int k = 0; k < nr; k++) a[k] = (v8d){0};
    for (int64_t i = 0; i < D8; i += 8)
        for (int k = 0; k < nr; k++) a[k] += LOAD8D(x + k * D + i);
    for (int k = 0; k < nr; k++) {
        double s = 0.0;
        for (int64_t i = D8; i < D; i++) s += x[k * D + i];
        for (int j = 0; j < 8; j++) s += a[k][j];
        m[k] = s / (double)D;
        a[k] = (v8d){0};
    }
    for (int64_t i = 0; i < D8; i += 8)
        for (int k = 0; k < nr; k++) {
            v8d d = LOAD8D(x + k * D + i) - m[k];
            a[k] += d * d;
        }
    for (int k = 0; k < nr; k++) {
        double s = 0.0;
        for (int64_t i = D8; i < D; i++) s += ((double)x[k * D + i] - m[k]) * ((double)x[k * D + i] - m[k]);
        for (int j = 0; j < 8; j++) s += a[k][j];
        rs[k] = (float)(1.0 / sqrt(s / (double)D + eps));
        mu[k] = (float)m[k];
    }
}

/* y = (x - mu) rs w + b for nr rows, as F32, or as BF16 bits through an L1
 * chunk (ct_f32_to_bf16_n): the nr rows in one when they fit, else each
 * row in pieces. */
static inline __attribute__((always_inline)) void row_out(const float *restrict x, int64_t D, int nr,
                                                          const float *mu, const float *rs,
                                                          const float *restrict w, const float *restrict b,
                                                          float *restrict y, uint16_t *yh)
{
    if (!yh) {
        for (int k = 0; k < nr; k++)
            for (int64_t i = 0; i < D; i++) y[k * D + i] = (x[k * D + i] - mu[k]) * rs[k] * w[i] + b[i];
        return;
    }
    float buf[CT__EMIT_CHUNK];
    if (nr * D <= CT__EMIT_CHUNK) {
        for (int k = 0; k < nr; k++)
            for (int64_t i = 0; i < D; i++) buf[k * D + i] = (x[k * D + i] - mu[k]) * rs[k] * w[i] + b[i];
        ct_f32_to_bf16_n(buf, yh, (size_t)(nr * D));
        return;
    }
    for (int k = 0; k < nr; k++)
        for (int64_t c = 0; c < D; c += CT__EMIT_CHUNK) {
            int64_t n = D - c < CT__EMIT_CHUNK ? D - c : CT__EMIT_CHUNK;
            for (int64_t i = 0; i < n; i++) buf[i] = (x[k * D + c + i] - mu[k]) * rs[k] * w[c + i] + b[c + i];
            ct_f32_to_bf16_n(buf, yh + k * D + c, (size_t)n);
        }
}

/* Rows [lo, hi) of one forward; each row's numbers do not depend on which
 * rows share its block, so the rows are cut over the rank's threads. */
typedef struct {
    const float *x, *w, *b;
    float *yd;
    uint16_t *yh;
    float *mu, *rs;
    int64_t D;
    double eps;
} ln_fwd_job;

static void ln_fwd_rows(void *ctx, int64_t lo, int64_t hi)
{
    const ln_fwd_job *j = ctx;
    const float *x = j->x, *w = j->w, *b = j->b;
    float *yd = j->yd, *mu = j->mu, *rs = j->rs;
    uint16_t *yh = j->yh;
    int64_t D = j->D, r = lo;
    double eps = j->eps;
    for (; r + RB <= hi; r += RB) {
        float bm[RB], br[RB];
        row_stats(x + r * D, D, RB, eps, bm, br);
        row_out(x + r * D, D, RB, bm, br, w, b, yd ? yd + r * D : NULL, yh ? yh + r * D : NULL);
        for (int k = 0; mu && k < RB; k++) {
            mu[r + k] = bm[k];
            rs[r + k] = br[k];
        }
    }
    for (; r < hi; r++) {
        float bm, br;
        row_stats(x + r * D, D, 1, eps, &bm, &br);
        row_out(x + r * D, D, 1, &bm, &br, w, b, yd ? yd + r * D : NULL, yh ? yh + r * D : NULL);
        if (mu) {
            mu[r] = bm;
            rs[r] = br;
        }
    }
}

/* Rows per thread below which LayerNorm stays on one thread. */
#define ROW_GRAIN 64

/* x [rows, D] -> y [rows, D] (F32, or BF16 with emit_bf16); saves x, mean [rows], rstd [rows]. */
static ct_status ln_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                            const ct_fwd_ctx *ctx)
{
    (void)ctx;
    const ln_impl *L = m->impl;
    char sh[64];
    if (in->dtype != CT_F32 || in->ndim < 1 || in->shape[in->ndim - 1] != L->dim)
        return ct_error(CT_EINVAL, "layernorm '%s': input %s %s must be F32 with last dim %lld; "
                        "check the normalised size", nm(m), ct_dtype_name(in->dtype),
                        ct_shape_str(in, sh, sizeof sh), (long long)L->dim);
    int64_t D = L->dim, rows = in->numel / D;
    int bf16 = m->emit_bf16;
    ct_tensor *y = ct_tensor_empty(bf16 ? CT_BF16 : CT_F32, in->ndim, in->shape, CT_MEM_ACT); /* written in full */
    ct_tensor *mean = rec ? ct_tensor_empty(CT_F32, 1, &rows, CT_MEM_ACT) : NULL;
    ct_tensor *rstd = rec ? ct_tensor_empty(CT_F32, 1, &rows, CT_MEM_ACT) : NULL;
    /* The record holds its own references to mean and rstd (released below). */
    if (!y || (rec && (!mean || !rstd || ct_record_save(rec, in) < 0 ||
                       ct_record_save(rec, mean) < 0 || ct_record_save(rec, rstd) < 0))) {
        ct_tensor_release(y);
        ct_tensor_release(mean);
        ct_tensor_release(rstd);
        return CT_ENOMEM;
    }
    const float *x = ct_f32(in), *w = ct_f32(m->params[0]->data), *b = ct_f32(m->params[1]->data);
    float *yd = bf16 ? NULL : ct_f32(y);
    uint16_t *yh = bf16 ? ct_tensor_data(y) : NULL;
    float *mu = mean ? ct_f32(mean) : NULL, *rs = rstd ? ct_f32(rstd) : NULL;
    ln_fwd_job j = {x, w, b, yd, yh, mu, rs, D, (double)L->eps};
    ct_parallel_for(rows, ROW_GRAIN, ln_fwd_rows, &j);
    ct_tensor_release(mean);
    ct_tensor_release(rstd);
    *out = y;
    return CT_OK;
}

/* Backward of nr rows: gw += dy xhat, gb += dy (row after row, as a row
 * alone would add them) and, in the same pass, the row sums of g = dy w and
 * g xhat in 8 double lanes (ordered as row_stats orders them); then
 * dx = rs (g - mean(g) - xhat mean(g xhat)).  xhat is (x - mu) rs wherever
 * it is used, as the unfused loops had it. */
static inline __attribute__((always_inline)) void row_back(const float *x, const float *dy, int64_t D, int nr,
                                                           const float *mu, const float *rs, const float *w,
                                                           float *gw, float *gb, float *dx, int gwb)
{
    const int64_t D8 = D & ~(int64_t)7;
    v8d ag[RB], agx[RB];
    for (int k = 0; k < nr; k++) ag[k] = agx[k] = (v8d){0};
    for (int64_t i = 0; i < D8; i += 8) {
        v8f wv = LOAD8(w + i), gwv = {0}, gbv = {0};
        if (gwb) gwv = LOAD8(gw + i), gbv = LOAD8(gb + i);
        for (int k = 0; k < nr; k++) {
            v8f d = LOAD8(dy + k * D + i), xm = LOAD8(x + k * D + i) - mu[k], g = d * wv;
            if (gwb) {
                gwv += d * xm * rs[k];
                gbv += d;
            }
            ag[k] += __builtin_convertvector(g, v8d);
            agx[k] += __builtin_convertvector(g * xm * rs[k], v8d);
        }
        if (gwb) {
            memcpy(gw + i, &gwv, sizeof gwv);
            memcpy(gb + i, &gbv, sizeof gbv);
        }
    }
    for (int k = 0; k < nr; k++) {
        const float *xr = x + k * D, *dyr = dy + k * D;
        float m = mu[k], r = rs[k];
        double sg = 0.0, sgx = 0.0;
        for (int64_t i = D8; i < D; i++) {
            float g = dyr[i] * w[i];
            if (gwb) {
                gw[i] += dyr[i] * (xr[i] - m) * r;
                gb[i] += dyr[i];
            }
            sg += g;
            sgx += g * (xr[i] - m) * r;
        }
        for (int j = 0; j < 8; j++) {
            sg += ag[k][j];
            sgx += agx[k][j];
        }
        float mg = (float)(sg / (double)D), mgx = (float)(sgx / (double)D);
        float *dxr = dx + k * D;
        for (int64_t i = 0; i < D; i++) dxr[i] = r * (dyr[i] * w[i] - mg - (xr[i] - m) * r * mgx);
    }
}

/* One backward: rows of dx (and dw, db with them when gwb: one thread),
 * or columns of dw and db. */
typedef struct {
    const float *x, *dy, *mean, *rstd, *w;
    float *gw, *gb, *dx, *scratch;
    int64_t D, rows;
    int gwb;
} ln_bwd_job;

static void ln_bwd_rows(void *ctx, int64_t lo, int64_t hi)
{
    const ln_bwd_job *j = ctx;
    int64_t D = j->D, r = lo;
    /* without dx only one thread runs here (gwb): scratch has one dx block */
    for (; r + RB <= hi; r += RB)
        row_back(j->x + r * D, j->dy + r * D, D, RB, j->mean + r, j->rstd + r, j->w, j->gw, j->gb,
                 j->dx ? j->dx + r * D : j->scratch + 2 * D, j->gwb);
    for (; r < hi; r++)
        row_back(j->x + r * D, j->dy + r * D, D, 1, j->mean + r, j->rstd + r, j->w, j->gw, j->gb,
                 j->dx ? j->dx + r * D : j->scratch + 2 * D, j->gwb);
}

/* dw and db for columns [lo, hi), rows in order, with row_back's operations. */
static void ln_bwd_cols(void *ctx, int64_t lo, int64_t hi)
{
    const ln_bwd_job *j = ctx;
    int64_t D = j->D;
    for (int64_t r = 0; r < j->rows; r++) {
        const float *restrict xr = j->x + r * D, *restrict dyr = j->dy + r * D;
        float m = j->mean[r], rs = j->rstd[r];
        float *restrict gw = j->gw, *restrict gb = j->gb;
        for (int64_t i = lo; i < hi; i++) {
            gw[i] += dyr[i] * (xr[i] - m) * rs;
            gb[i] += dyr[i];
        }
    }
}

/* dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w;
 * dw += sum_rows dy * xhat; db += sum_rows dy. */
static ct_status ln_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const ln_impl *L = m->impl;
    const ct_tensor *xt = ct_record_saved(rec, 0);
    if (!ct_tensor_same_shape(dout, xt)) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "layernorm '%s': output gradient %s does not match the output %s",
                        nm(m), ct_shape_str(dout, a, sizeof a), ct_shape_str(xt, b, sizeof b));
    }
    int64_t D = L->dim, rows = xt->numel / D;
    ct_param *W = m->params[0], *B = m->params[1];
    float *gw = W->requires_grad && W->grad ? ct_f32(W->grad) : NULL;
    float *gb = B->requires_grad && B->grad ? ct_f32(B->grad) : NULL;
    ct_tensor *dx = NULL;
    if (din && !(dx = ct_tensor_empty(CT_F32, xt->ndim, xt->shape, CT_MEM_ACT))) return CT_ENOMEM; /* written in full */
    /* One fused loop for every case: what is not wanted goes to scratch. */
    float *scratch = NULL;
    if (!gw || !gb || !dx) {
        if (!(scratch = ct_alloc((size_t)(2 + RB) * (size_t)D * sizeof *scratch, CT_MEM_ACT))) {
            ct_tensor_release(dx);
            return CT_ENOMEM;
        }
        memset(scratch, 0, (size_t)2 * (size_t)D * sizeof *scratch);
    }
    if (!gw) gw = scratch;
    if (!gb) gb = scratch + D;
    const float *x = ct_f32(xt), *dy = ct_f32(dout), *w = ct_f32(W->data);
    const float *mean = ct_f32(ct_record_saved(rec, 1)), *rstd = ct_f32(ct_record_saved(rec, 2));
    float *dxd = dx ? ct_f32(dx) : NULL;
    ln_bwd_job j = {x, dy, mean, rstd, w, gw, gb, dxd, scratch, D, rows, 0};
    if (ct_parallel_threads(rows, ROW_GRAIN) > 1) {
        /* dx by rows, then dw and db by columns, each column adding its
         * rows in order: one thread's bits, over two passes instead of one */
        if (dxd) ct_parallel_for(rows, ROW_GRAIN, ln_bwd_rows, &j);
        ct_parallel_for(D, 64, ln_bwd_cols, &j);
    } else {
        j.gwb = 1;
        ln_bwd_rows(&j, 0, rows);
    }
    ct_free(scratch);
    if (din) *din = dx;
    return CT_OK;
}

static void ln_destroy(ct_module *m) { ct_free(m->impl); }

static ct_status ln_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                              int64_t *out_shape)
{
    const ln_impl *L = m->impl;
    if (ndim < 1 || in_shape[ndim - 1] != L->dim) {
        ct_tensor t = ct__shape_header(ndim, in_shape);
        char sh[64];
        return ct_error(CT_EINVAL, "layernorm '%s': input %s must have last dim %lld; check the "
                        "normalised size", nm(m), ct_shape_str(&t, sh, sizeof sh), (long long)L->dim);
    }
    return ct_module_out_shape_same(m, ndim, in_shape, out_ndim, out_shape);
}

/* The record keeps the input and mean and rstd per row (f32 each). */
static ct_status ln_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)mixed, (void)need_dx;
    c->keep_in = 1;
    c->saved = (nd && sh[nd - 1] ? ct__act_numel(nd, sh) / (uint64_t)sh[nd - 1] : 1) * 8;
    return CT_OK;
}

static const ct_module_ops ln_ops = {"layernorm", ln_forward, ln_backward, ln_destroy, 0, ln_out_shape,
                                     ln_act_cost, CT_MOD_KEEP_F32};

ct_module *ct_layernorm_create(int64_t dim, float eps)
{
    if (dim <= 0 || !(eps >= 0.0f)) {
        ct_error(CT_EINVAL, "layernorm needs dim > 0 and eps >= 0, got dim=%lld eps=%g",
                 (long long)dim, (double)eps);
        return NULL;
    }
    ln_impl *L = ct_alloc_zeroed(sizeof *L, CT_MEM_OTHER);
    if (!L) return NULL;
    *L = (ln_impl){dim, eps};
    ct_module *m = ct_module_create(&ln_ops, L);
    if (!m) {
        ct_free(L);
        return NULL;
    }
    /* Ones and zeros, at once: the layer is usable even before ct_module_init_params. */
    ct_param *w = ct_module_add_param(m, "weight", 1, (int64_t[]){dim}), *b = NULL;
    if (!w || !(b = ct_module_add_param(m, "bias", 1, (int64_t[]){dim}))) {
        ct_module_destroy(m);
        return NULL;
    }
    ct_param_set_init(w, ct_init_const(1.0f));
    ct_param_set_init(b, ct_init_const(0.0f));
    return m;
}

/*
 * Layer normalisation over the last dim with an elementwise affine weight
 * and bias (PyTorch's nn.LayerNorm(dim, eps)).  The record keeps the input
 * and each row's mean and 1/std; statistics are summed in double so long
 * rows with a large mean stay accurate.
 */
#include <math.h>

#include "internal.h"

typedef struct {
    int64_t dim;
    float eps;
} ln_impl;

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

/* Row statistics in double, in 8 lanes the compiler turns into vector adds
 * (one running sum was a serial chain of double adds: 7% of a GPT step). */
static double sum_f64(const float *x, int64_t n)
{
    double a[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) a[j] += x[i + j];
    double s = 0;
    for (; i < n; i++) s += x[i];
    for (int j = 0; j < 8; j++) s += a[j];
    return s;
}

static double sum_sq_dev_f64(const float *x, int64_t n, double mu)
{
    double a[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) a[j] += ((double)x[i + j] - mu) * ((double)x[i + j] - mu);
    double s = 0;
    for (; i < n; i++) s += ((double)x[i] - mu) * ((double)x[i] - mu);
    for (int j = 0; j < 8; j++) s += a[j];
    return s;
}

/* x [rows, D] -> y [rows, D]; saves x, mean [rows], rstd [rows]. */
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
    ct_tensor *y = ct_tensor_empty(CT_F32, in->ndim, in->shape, CT_MEM_ACT); /* written in full */
    ct_tensor *mean = rec ? ct_tensor_create1(rows, CT_MEM_ACT) : NULL;
    ct_tensor *rstd = rec ? ct_tensor_create1(rows, CT_MEM_ACT) : NULL;
    /* The record holds its own references to mean and rstd (released below). */
    if (!y || (rec && (!mean || !rstd || ct_record_save(rec, in) < 0 ||
                       ct_record_save(rec, mean) < 0 || ct_record_save(rec, rstd) < 0))) {
        ct_tensor_release(y);
        ct_tensor_release(mean);
        ct_tensor_release(rstd);
        return CT_ENOMEM;
    }
    const float *x = ct_f32(in), *w = ct_f32(m->params[0]->data), *b = ct_f32(m->params[1]->data);
    float *yd = ct_f32(y);
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        float *yr = yd + r * D;
        double mu = sum_f64(xr, D) / (double)D, ss = sum_sq_dev_f64(xr, D, mu);
        float rs = (float)(1.0 / sqrt(ss / (double)D + (double)L->eps));
        float muf = (float)mu;
        for (int64_t i = 0; i < D; i++) yr[i] = (xr[i] - muf) * rs * w[i] + b[i];
        if (rec) {
            ct_f32(mean)[r] = muf;
            ct_f32(rstd)[r] = rs;
        }
    }
    ct_tensor_release(mean);
    ct_tensor_release(rstd);
    *out = y;
    return CT_OK;
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
    ct_tensor *dx = NULL;
    if (din && !(dx = ct_tensor_empty(CT_F32, xt->ndim, xt->shape, CT_MEM_ACT))) return CT_ENOMEM; /* written in full */
    const float *x = ct_f32(xt), *dy = ct_f32(dout), *w = ct_f32(m->params[0]->data);
    const float *mean = ct_f32(ct_record_saved(rec, 1)), *rstd = ct_f32(ct_record_saved(rec, 2));
    ct_param *W = m->params[0], *B = m->params[1];
    float *gw = W->requires_grad && W->grad ? ct_f32(W->grad) : NULL;
    float *gb = B->requires_grad && B->grad ? ct_f32(B->grad) : NULL;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * D, *dyr = dy + r * D;
        float mu = mean[r], rs = rstd[r];
        if (gw)
            for (int64_t i = 0; i < D; i++) gw[i] += dyr[i] * (xr[i] - mu) * rs;
        if (gb)
            for (int64_t i = 0; i < D; i++) gb[i] += dyr[i];
        if (!dx) continue;
        double sg = 0.0, sgx = 0.0, ag[8] = {0}, agx[8] = {0};
        int64_t i0 = 0;
        for (; i0 + 8 <= D; i0 += 8) /* 8 lanes, as sum_f64 */
            for (int j = 0; j < 8; j++) {
                float g = dyr[i0 + j] * w[i0 + j];
                ag[j] += g;
                agx[j] += g * (xr[i0 + j] - mu) * rs;
            }
        for (int64_t i = i0; i < D; i++) {
            float g = dyr[i] * w[i];
            sg += g;
            sgx += g * (xr[i] - mu) * rs;
        }
        for (int j = 0; j < 8; j++) {
            sg += ag[j];
            sgx += agx[j];
        }
        float mg = (float)(sg / (double)D), mgx = (float)(sgx / (double)D);
        float *dxr = ct_f32(dx) + r * D;
        for (int64_t i = 0; i < D; i++)
            dxr[i] = rs * (dyr[i] * w[i] - mg - (xr[i] - mu) * rs * mgx);
    }
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

static const ct_module_ops ln_ops = {"layernorm", ln_forward, ln_backward, ln_destroy, 0, ln_out_shape};

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
    /* Ones and zeros, so the layer is usable even before ct_module_init_params. */
    ct_param *w = ct_module_add_param(m, "weight", 1, (int64_t[]){dim});
    if (!w || !ct_module_add_param(m, "bias", 1, (int64_t[]){dim})) {
        ct_module_destroy(m);
        return NULL;
    }
    ct_tensor_fill(w->data, 1.0f);
    return m;
}

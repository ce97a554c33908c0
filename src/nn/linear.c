/*
 * Linear layer: y[..., out] = x[..., in] W^T + b, W [out, in] as PyTorch
 * lays it out.  Any leading dims are flattened into rows, so the same layer
 * serves [N, in] batches and [B, T, in] sequences.  All three products are
 * single BLAS calls; the weight gradient is accumulated by the product
 * itself (beta = 1), so backward allocates nothing but the input gradient.
 */
#include <limits.h>

#include "internal.h"

typedef struct {
    int64_t in, out;
    int bias;
} linear_impl;

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

/* x [rows, in] -> y [rows, out]; saves x by reference. */
static ct_status linear_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                                const ct_fwd_ctx *ctx)
{
    (void)ctx;
    const linear_impl *L = m->impl;
    char sh[64];
    if (in->dtype != CT_F32)
        return ct_error(CT_EINVAL, "linear '%s': input is %s but the layer takes F32; convert it "
                        "(or put an embedding first for indices)", nm(m), ct_dtype_name(in->dtype));
    if (in->ndim < 1 || in->shape[in->ndim - 1] != L->in)
        return ct_error(CT_EINVAL, "linear '%s': input %s has %lld features but the layer expects "
                        "%lld; check the previous layer's output size", nm(m),
                        ct_shape_str(in, sh, sizeof sh),
                        in->ndim ? (long long)in->shape[in->ndim - 1] : 0LL, (long long)L->in);
    int64_t rows = in->numel / L->in;
    if (rows > INT_MAX)
        return ct_error(CT_EINVAL, "linear '%s': %lld rows exceed what BLAS can index; split the batch",
                        nm(m), (long long)rows);
    int64_t shape[CT_MAX_DIMS];
    for (int i = 0; i < in->ndim; i++) shape[i] = in->shape[i];
    shape[in->ndim - 1] = L->out;
    if (rec && ct_record_save(rec, in) < 0) return CT_ENOMEM;
    ct_tensor *y = ct_tensor_create(CT_F32, in->ndim, shape, CT_MEM_ACT);
    if (!y) return CT_ENOMEM;

    float *yd = ct_f32(y);
    const float *w = ct_f32(m->params[0]->data);
    float beta = 0.0f;
    if (L->bias) {
        /* Rows start as the bias and the product adds onto them: one pass less than adding after. */
        const float *b = ct_f32(m->params[1]->data);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < L->out; j++) yd[r * L->out + j] = b[j];
        beta = 1.0f;
    }
    ct_sgemm(0, 1, (int)rows, (int)L->out, (int)L->in, 1.0f, ct_f32(in), (int)L->in, w, (int)L->in,
             beta, yd, (int)L->out);
    *out = y;
    return CT_OK;
}

/* dy [rows, out]: dW += dy^T x, db += sum_rows dy, dx = dy W (only if din). */
static ct_status linear_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const linear_impl *L = m->impl;
    ct_tensor *x = ct_record_saved(rec, 0);
    int64_t rows = x->numel / L->in;
    if (dout->dtype != CT_F32 || dout->numel != rows * L->out) {
        char a[64];
        return ct_error(CT_EINVAL, "linear '%s': output gradient %s %s does not match the output "
                        "of %lld rows x %lld (F32)", nm(m), ct_dtype_name(dout->dtype),
                        ct_shape_str(dout, a, sizeof a), (long long)rows, (long long)L->out);
    }
    const float *dy = ct_f32(dout);
    ct_param *W = m->params[0];
    /* A gradient marked zero is overwritten (beta 0): no clearing pass and
     * no read of the old values. */
    if (W->requires_grad && W->grad)
        ct_sgemm(1, 0, (int)L->out, (int)L->in, (int)rows, 1.0f, dy, (int)L->out, ct_f32(x),
                 (int)L->in, ct_param_grad_beta(W), ct_f32(W->grad), (int)L->in);
    if (L->bias) {
        ct_param *B = m->params[1];
        if (B->requires_grad && B->grad) {
            ct_param_grad_sync(B); /* small: clearing it costs nothing */
            float *gb = ct_f32(B->grad);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < L->out; j++) gb[j] += dy[r * L->out + j];
        }
    }
    if (din) {
        ct_tensor *dx = ct_tensor_create(CT_F32, x->ndim, x->shape, CT_MEM_ACT);
        if (!dx) return CT_ENOMEM;
        ct_sgemm(0, 0, (int)rows, (int)L->in, (int)L->out, 1.0f, dy, (int)L->out, ct_f32(W->data),
                 (int)L->in, 0.0f, ct_f32(dx), (int)L->in);
        *din = dx;
    }
    return CT_OK;
}

static void linear_destroy(ct_module *m) { ct_free(m->impl); }

/* [..., in] -> [..., out], with the checks of linear_forward. */
static ct_status linear_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                  int64_t *out_shape)
{
    const linear_impl *L = m->impl;
    ct_tensor t = ct__shape_header(ndim, in_shape);
    char sh[64];
    if (ndim < 1 || in_shape[ndim - 1] != L->in)
        return ct_error(CT_EINVAL, "linear '%s': input %s has %lld features but the layer expects "
                        "%lld; check the previous layer's output size", nm(m),
                        ct_shape_str(&t, sh, sizeof sh), ndim ? (long long)in_shape[ndim - 1] : 0LL,
                        (long long)L->in);
    if (t.numel / L->in > INT_MAX)
        return ct_error(CT_EINVAL, "linear '%s': %lld rows exceed what BLAS can index; split the batch",
                        nm(m), (long long)(t.numel / L->in));
    memcpy(out_shape, in_shape, (size_t)ndim * sizeof *out_shape);
    out_shape[ndim - 1] = L->out;
    *out_ndim = ndim;
    return CT_OK;
}

static const ct_module_ops linear_ops = {"linear", linear_forward, linear_backward, linear_destroy, 1,
                                         linear_out_shape};

ct_module *ct_linear_create(int64_t in, int64_t out, int bias)
{
    if (in <= 0 || out <= 0 || in > INT_MAX || out > INT_MAX) {
        ct_error(CT_EINVAL, "linear layer needs positive sizes below 2^31, got in=%lld out=%lld",
                 (long long)in, (long long)out);
        return NULL;
    }
    linear_impl *L = ct_alloc_zeroed(sizeof *L, CT_MEM_OTHER);
    if (!L) return NULL;
    *L = (linear_impl){in, out, bias != 0};
    ct_module *m = ct_module_create(&linear_ops, L);
    if (!m) {
        ct_free(L);
        return NULL;
    }
    if (!ct_module_add_param(m, "weight", 2, (int64_t[]){out, in}) ||
        (bias && !ct_module_add_param(m, "bias", 1, (int64_t[]){out}))) {
        ct_module_destroy(m);
        return NULL;
    }
    return m;
}

/*
 * Linear layer: y[..., out] = x[..., in] W^T + b, W [out, in] as PyTorch
 * lays it out.  Any leading dims are flattened into rows, so the same layer
 * serves [N, in] batches and [B, T, in] sequences.  All three products are
 * single calls; the weight gradient is accumulated by the product itself
 * (beta = 1), so backward allocates nothing but the input gradient.
 *
 * Two precisions, chosen by what the layer is given (internal.h):
 * - f32: products through ct_gemm_f32's AUTO engine, which sends each shape
 *   to OpenBLAS or oneDNN f32, whichever measured faster (src/core/gemm.c):
 *   on this layer's forward and input-gradient shapes oneDNN was 1.1-1.3x
 *   faster than OpenBLAS's AVX-512 kernel and 1.6-2x faster than its AVX2
 *   kernel; the weight gradient stays on an AVX-512 OpenBLAS.
 * - bf16, when the weight has a bf16 compute copy or the input is bf16: x is
 *   cast to bf16 once and that copy is what the record keeps (half the
 *   memory of f32 x); dy is cast in backward; the products run on oneDNN
 *   with f32 accumulation.  y, dx and dW stay f32 (y is stored as bf16 when
 *   emit_bf16 says its consumer would cast it anyway), and dW accumulates
 *   into the f32 p->grad as in the f32 path.  The bias is f32 throughout;
 *   its gradient is summed in the pass that casts dy, or by the layer that
 *   made dy, when it hands dy over as bf16 (emit_bf16_grad: GELU, the
 *   attention core), and added to the bias's gradient once.
 * The forward product adds the bias itself (oneDNN's bias argument; OpenBLAS
 * gets rows preset to it), so y is written once, not preset and re-read.
 */
#include <limits.h>

#include "internal.h"

typedef struct {
    int64_t in, out;
    int bias;
} linear_impl;

#define nm ct__nn_name

/* x [rows, in] (F32 or BF16) -> y [rows, out] F32; saves x (F32 path) or
 * its bf16 cast (bf16 path). */
static ct_status linear_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                                const ct_fwd_ctx *ctx)
{
    (void)ctx;
    const linear_impl *L = m->impl;
    char sh[64];
    if (in->dtype != CT_F32 && in->dtype != CT_BF16)
        return ct_error(CT_EINVAL, "linear '%s': input is %s but the layer takes F32 or BF16; "
                        "convert it (or put an embedding first for indices)", nm(m),
                        ct_dtype_name(in->dtype));
    if (in->ndim < 1 || in->shape[in->ndim - 1] != L->in)
        return ct_error(CT_EINVAL, "linear '%s': input %s has %lld features but the layer expects "
                        "%lld; check the previous layer's output size", nm(m),
                        ct_shape_str(in, sh, sizeof sh),
                        in->ndim ? (long long)in->shape[in->ndim - 1] : 0LL, (long long)L->in);
    int64_t rows = in->numel / L->in;
    if (rows > INT_MAX)
        return ct_error(CT_EINVAL, "linear '%s': %lld rows exceed what BLAS can index; split the batch",
                        nm(m), (long long)rows);
    ct_param *W = m->params[0];
    int bf16;
    CT_TRY(ct__param_compute(m, W, &bf16));
    bf16 |= in->dtype == CT_BF16;
    int64_t shape[CT_MAX_DIMS];
    for (int i = 0; i < in->ndim; i++) shape[i] = in->shape[i];
    shape[in->ndim - 1] = L->out;
    /* A consumer that casts to bf16 anyway gets the product rounded to bf16 as it is stored. */
    int emit = bf16 && m->emit_bf16;
    ct_tensor *y = ct_tensor_empty(emit ? CT_BF16 : CT_F32, in->ndim, shape, CT_MEM_ACT);
    if (!y) return CT_ENOMEM;

    /* The bias goes into the product itself: no pass over the rows before or after. */
    const float *bias = L->bias ? ct_f32(m->params[1]->data) : NULL;
    ct_status s;
    ct_tensor *x = in;
    if (bf16) {
        const uint16_t *w = NULL;
        uint16_t *wtmp = NULL;
        x = ct__tensor_bf16(in);
        s = x ? ct__param_bf16(W, &w, &wtmp) : CT_ENOMEM;
        if (s == CT_OK)
            s = ct_gemm_bf16_bias(0, 1, (int)rows, (int)L->out, (int)L->in, ct_tensor_data(x), (int)L->in, w,
                                  (int)L->in, bias, ct_tensor_data(y), emit, (int)L->out);
        ct_free(wtmp);
    } else {
        x = ct_tensor_retain(in);
        s = ct_gemm_f32_bias(CT_GEMM_AUTO, 0, 1, (int)rows, (int)L->out, (int)L->in, ct_f32(in), (int)L->in,
                             ct_f32(W->data), (int)L->in, bias, ct_f32(y), (int)L->out);
    }
    if (s != CT_OK) {
        ct_tensor_release(x);
        ct_tensor_release(y);
        return s;
    }
    if (rec && ct_record_save(rec, x) < 0) s = CT_ENOMEM;
    ct_tensor_release(x); /* the record holds its own reference */
    if (s != CT_OK) {
        ct_tensor_release(y);
        return s;
    }
    *out = y;
    return CT_OK;
}

/* dy [rows, out] F32 (or, on the bf16 path, BF16 with its column sums:
 * ct__grad_bf16): dW += dy^T x, db += sum_rows dy, dx = dy W (F32, only if
 * din).  The bf16 path is taken when forward saved a bf16 x. */
static ct_status linear_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const linear_impl *L = m->impl;
    ct_tensor *x = ct_record_saved(rec, 0);
    int64_t rows = x->numel / L->in;
    int bf16 = x->dtype == CT_BF16;
    const float *dsum = bf16 ? ct__grad_bf16_colsum(dout) : NULL; /* dy came as bf16 and sums */
    if ((dout->dtype != CT_F32 && !dsum) || dout->numel != rows * L->out) {
        char a[64];
        return ct_error(CT_EINVAL, "linear '%s': output gradient %s %s does not match the output "
                        "of %lld rows x %lld (F32)", nm(m), ct_dtype_name(dout->dtype),
                        ct_shape_str(dout, a, sizeof a), (long long)rows, (long long)L->out);
    }
    ct_param *W = m->params[0];
    int want_dw = W->requires_grad && W->grad != NULL;
    if (bf16) CT_TRY(ct__param_compute(m, W, &(int){0}));
    ct_tensor *dx = NULL;
    if (din && !(dx = ct_tensor_empty(CT_F32, x->ndim, x->shape, CT_MEM_ACT))) return CT_ENOMEM;
    ct_status s = CT_OK;
    ct_param *B = L->bias ? m->params[1] : NULL;
    float *gb = NULL;
    if (B && B->requires_grad && B->grad) {
        ct_param_grad_sync(B); /* small: clearing it costs nothing */
        gb = ct_f32(B->grad);
    }
    if (bf16) {
        /* dy in bf16 and its column sums, made here from f32 dy in one read
         * unless the producer made them. */
        uint16_t *dyh = NULL;
        float *sum = NULL;
        const uint16_t *w = NULL, *dyb = dsum ? ct_tensor_data(dout) : NULL;
        uint16_t *wtmp = NULL;
        if (!dsum && (want_dw || dx || gb)) {
            dyh = ct_alloc((size_t)dout->numel * sizeof *dyh, CT_MEM_ACT);
            sum = gb ? ct_alloc_zeroed((size_t)L->out * sizeof *sum, CT_MEM_ACT) : NULL;
            if (!dyh || (gb && !sum)) s = CT_ENOMEM;
            else ct_f32_to_bf16_rows(ct_f32(dout), rows, L->out, dyh, sum);
            dyb = dyh;
            dsum = sum;
        }
        /* The rows' sum is added once, as PyTorch adds a bias's gradient. */
        if (s == CT_OK && gb)
            for (int64_t j = 0; j < L->out; j++) gb[j] += dsum[j];
        /* A gradient marked zero is overwritten (beta 0): no clearing pass and
         * no read of the old values. */
        if (s == CT_OK && want_dw)
            s = ct_gemm_bf16(1, 0, (int)L->out, (int)L->in, (int)rows, 1.0f, dyb, (int)L->out, ct_tensor_data(x),
                             (int)L->in, ct_param_grad_beta(W), ct_f32(W->grad), (int)L->in);
        if (s == CT_OK && dx) s = ct__param_bf16(W, &w, &wtmp);
        if (s == CT_OK && dx)
            s = ct_gemm_bf16(0, 0, (int)rows, (int)L->in, (int)L->out, 1.0f, dyb, (int)L->out, w,
                             (int)L->in, 0.0f, ct_f32(dx), (int)L->in);
        ct_free(wtmp);
        ct_free(sum);
        ct_free(dyh);
    } else {
        const float *dy = ct_f32(dout);
        if (want_dw)
            s = ct_gemm_f32(CT_GEMM_AUTO, 1, 0, (int)L->out, (int)L->in, (int)rows, 1.0f, dy,
                            (int)L->out, ct_f32(x), (int)L->in, ct_param_grad_beta(W),
                            ct_f32(W->grad), (int)L->in);
        if (s == CT_OK && dx)
            s = ct_gemm_f32(CT_GEMM_AUTO, 0, 0, (int)rows, (int)L->in, (int)L->out, 1.0f, dy,
                            (int)L->out, ct_f32(W->data), (int)L->in, 0.0f, ct_f32(dx), (int)L->in);
        if (s == CT_OK && gb)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < L->out; j++) gb[j] += dy[r * L->out + j];
    }
    if (s != CT_OK) {
        ct_tensor_release(dx);
        return s;
    }
    if (din) *din = dx;
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

/* The record keeps x, or its bf16 cast when the weight has a compute copy,
 * whose backward casts dy to bf16 too. */
static ct_status linear_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)need_dx;
    if (mixed && ct__act_has_copy(m)) {
        c->saved = ct__act_numel(nd, sh) * 2;
        c->bwd_tmp = ct__act_out_numel(m, nd, sh) * 2;
    } else {
        c->keep_in = 1;
    }
    return CT_OK;
}

static const ct_module_ops linear_ops = {"linear", linear_forward, linear_backward, linear_destroy, 1,
                                         linear_out_shape, linear_act_cost, 0};

ct_module *ct_linear_create(int64_t in, int64_t out, int bias)
{
    if (in <= 0 || out <= 0 || in > INT_MAX || out > INT_MAX) {
        ct_error(CT_EINVAL, "linear layer needs positive sizes below 2^31, got in=%lld out=%lld",
                 (long long)in, (long long)out);
        return NULL;
    }
    linear_impl *L = ct_alloc(sizeof *L, CT_MEM_OTHER);
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
    ct__init_fan_in(m, in);
    return m;
}

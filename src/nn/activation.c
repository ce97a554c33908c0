/*
 * Elementwise activations: ReLU, GELU (exact, with erf, as PyTorch's
 * default; erf and exp by the vectorisable ct__erff/ct__expf) and tanh.
 * ReLU and tanh save their output, whose derivative they can be written in;
 * the next layer usually holds that tensor anyway, so the record costs no
 * extra memory.  GELU needs its input.  Outputs are new tensors; the saved
 * ones are shared by reference, so nobody may write into a module's output
 * in place.  GELU returns BF16 when its emit_bf16 is set (its consumer casts
 * to bf16 anyway): values are made a chunk at a time in L1 and cast there,
 * so the f32 output is never written to memory nor read back; the record is
 * still the f32 input and the gradients stay f32.
 */
#include <math.h>

#include "internal.h"

typedef enum { ACT_RELU, ACT_GELU, ACT_TANH } act_kind;

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

static const ct_module_ops relu_ops, gelu_ops, tanh_ops;

static act_kind kind_of(const ct_module *m)
{
    return m->ops == &gelu_ops ? ACT_GELU : m->ops == &tanh_ops ? ACT_TANH : ACT_RELU;
}

/* x Phi(x) with the exact erf. */
static inline float gelu(float x) { return 0.5f * x * (1.0f + ct__erff(x * (float)M_SQRT1_2)); }

/* dy d/dx x Phi(x) = dy (Phi(x) + x phi(x)). */
static inline float gelu_grad(float x, float dy)
{
    const float inv_sqrt_2pi = 0.3989422804014327f;
    float cdf = 0.5f * (1.0f + ct__erff(x * (float)M_SQRT1_2));
    float pdf = inv_sqrt_2pi * ct__expf(-0.5f * x * x);
    return dy * (cdf + x * pdf);
}

/* y[i] = gelu(x[i]), i < n; 16 lanes at a time where AVX-512 is there (the
 * same operations as gelu, see ct__erff16). */
static void gelu_n(const float *restrict x, float *restrict y, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), r2 = _mm512_set1_ps((float)M_SQRT1_2);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m512 e = ct__erff16(_mm512_mul_ps(v, r2));
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(half, v), _mm512_add_ps(one, e)));
    }
#endif
    for (; i < n; i++) y[i] = gelu(x[i]);
}

/* g[i] = gelu_grad(x[i], dy[i]), i < n, likewise. */
static void gelu_grad_n(const float *restrict x, const float *restrict dy, float *restrict g, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), r2 = _mm512_set1_ps((float)M_SQRT1_2);
    const __m512 mhalf = _mm512_set1_ps(-0.5f), c = _mm512_set1_ps(0.3989422804014327f);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m512 cdf = _mm512_mul_ps(half, _mm512_add_ps(one, ct__erff16(_mm512_mul_ps(v, r2))));
        __m512 pdf = _mm512_mul_ps(c, ct__expf16(_mm512_mul_ps(_mm512_mul_ps(mhalf, v), v)));
        __m512 d = _mm512_add_ps(cdf, _mm512_mul_ps(v, pdf));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_loadu_ps(dy + i), d));
    }
#endif
    for (; i < n; i++) g[i] = gelu_grad(x[i], dy[i]);
}

static ct_status act_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                             const ct_fwd_ctx *ctx)
{
    (void)ctx;
    if (in->dtype != CT_F32)
        return ct_error(CT_EINVAL, "%s '%s': input is %s but the layer takes F32", m->ops->kind,
                        nm(m), ct_dtype_name(in->dtype));
    act_kind kind = kind_of(m);
    int bf16 = kind == ACT_GELU && m->emit_bf16;
    ct_tensor *y = ct_tensor_empty(bf16 ? CT_BF16 : CT_F32, in->ndim, in->shape, CT_MEM_ACT); /* written in full */
    if (!y) return CT_ENOMEM;
    if (rec && ct_record_save(rec, kind == ACT_GELU ? in : y) < 0) {
        ct_tensor_release(y);
        return CT_ENOMEM;
    }
    const float *restrict x = ct_f32(in);
    float *restrict yd = bf16 ? NULL : ct_f32(y);
    int64_t n = in->numel;
    switch (kind) {
    case ACT_RELU:
        for (int64_t i = 0; i < n; i++) yd[i] = x[i] > 0.0f ? x[i] : 0.0f;
        break;
    case ACT_GELU:
        if (bf16) {
            uint16_t *yh = ct_tensor_data(y);
            float buf[CT__EMIT_CHUNK];
            for (int64_t c = 0; c < n; c += CT__EMIT_CHUNK) {
                int64_t k = n - c < CT__EMIT_CHUNK ? n - c : CT__EMIT_CHUNK;
                gelu_n(x + c, buf, k);
                ct_f32_to_bf16_n(buf, yh + c, (size_t)k);
            }
        } else {
            gelu_n(x, yd, n);
        }
        break;
    case ACT_TANH:
        for (int64_t i = 0; i < n; i++) yd[i] = tanhf(x[i]);
        break;
    }
    *out = y;
    return CT_OK;
}

static ct_status act_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const ct_tensor *s = ct_record_saved(rec, 0); /* relu, tanh: output; gelu: input */
    if (!ct_tensor_same_shape(dout, s)) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "%s '%s': output gradient %s does not match the output %s",
                        m->ops->kind, nm(m), ct_shape_str(dout, a, sizeof a),
                        ct_shape_str(s, b, sizeof b));
    }
    if (!din) return CT_OK; /* no parameters: nothing else to do */
    ct_tensor *dx = ct_tensor_empty(CT_F32, s->ndim, s->shape, CT_MEM_ACT); /* written in full */
    if (!dx) return CT_ENOMEM;
    const float *restrict v = ct_f32(s), *restrict dy = ct_f32(dout);
    float *restrict g = ct_f32(dx);
    int64_t n = s->numel;
    switch (kind_of(m)) {
    case ACT_RELU:
        for (int64_t i = 0; i < n; i++) g[i] = v[i] > 0.0f ? dy[i] : 0.0f;
        break;
    case ACT_GELU:
        gelu_grad_n(v, dy, g, n);
        break;
    case ACT_TANH:
        for (int64_t i = 0; i < n; i++) g[i] = dy[i] * (1.0f - v[i] * v[i]);
        break;
    }
    *din = dx;
    return CT_OK;
}

static const ct_module_ops relu_ops = {"relu", act_forward, act_backward, NULL, 0, ct_module_out_shape_same};
static const ct_module_ops gelu_ops = {"gelu", act_forward, act_backward, NULL, 0, ct_module_out_shape_same};
static const ct_module_ops tanh_ops = {"tanh", act_forward, act_backward, NULL, 0, ct_module_out_shape_same};

/* Activations have no state: the ops table says which one a module is. */
ct_module *ct_relu_create(void) { return ct_module_create(&relu_ops, NULL); }
ct_module *ct_gelu_create(void) { return ct_module_create(&gelu_ops, NULL); }
ct_module *ct_tanh_create(void) { return ct_module_create(&tanh_ops, NULL); }

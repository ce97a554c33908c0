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
                for (int64_t i = 0; i < k; i++) buf[i] = gelu(x[c + i]);
                ct__bf16_from_f32(buf, yh + c, (size_t)k);
            }
        } else {
            for (int64_t i = 0; i < n; i++) yd[i] = gelu(x[i]);
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
    case ACT_GELU: {
        /* d/dx x*Phi(x) = Phi(x) + x*phi(x). */
        const float inv_sqrt_2pi = 0.3989422804014327f;
        for (int64_t i = 0; i < n; i++) {
            float x = v[i];
            float cdf = 0.5f * (1.0f + ct__erff(x * (float)M_SQRT1_2));
            float pdf = inv_sqrt_2pi * ct__expf(-0.5f * x * x);
            g[i] = dy[i] * (cdf + x * pdf);
        }
        break;
    }
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

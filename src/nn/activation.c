/*
 * Elementwise activations: ReLU, GELU (exact, with erf, as PyTorch's
 * default; erf and exp by the vectorisable ct__erff/ct__expf) and tanh.
 * ReLU and tanh save their output, whose derivative they can be written in;
 * the next layer usually holds that tensor anyway, so the record costs no
 * extra memory.  GELU saves its derivative gelu'(x), made in the forward
 * pass from the erf it computes anyway: backward is then one multiply, not
 * erf and exp again, and the record is as large as the input it replaces.
 * Outputs are new tensors; the saved ones are shared by reference, so
 * nobody may write into a module's output in place.
 * GELU returns BF16 when its emit_bf16 is set (its consumer casts to bf16
 * anyway), and its input gradient as BF16 with column sums when
 * emit_bf16_grad is set (a bf16 linear consumes it, ct__grad_bf16): values
 * are made a chunk at a time in L1 and cast there, so the f32 values are
 * never written to memory nor read back.
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

/* d/dx x Phi(x) = Phi(x) + x phi(x). */
static inline float gelu_deriv(float x)
{
    const float inv_sqrt_2pi = 0.3989422804014327f;
    float cdf = 0.5f * (1.0f + ct__erff(x * (float)M_SQRT1_2));
    float pdf = inv_sqrt_2pi * ct__expf(-0.5f * x * x);
    return cdf + x * pdf;
}

/* y[i] = gelu(x[i]) and, if d, d[i] = gelu'(x[i]), i < n; 16 lanes at a
 * time where AVX-512 is there (the same operations as gelu and gelu_deriv,
 * see ct__erff16). */
static void gelu_n(const float *restrict x, float *restrict y, float *restrict d, int64_t n)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f), r2 = _mm512_set1_ps((float)M_SQRT1_2);
    const __m512 mhalf = _mm512_set1_ps(-0.5f), c = _mm512_set1_ps(0.3989422804014327f);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __m512 e1 = _mm512_add_ps(one, ct__erff16(_mm512_mul_ps(v, r2)));
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(half, v), e1));
        if (d) {
            __m512 pdf = _mm512_mul_ps(c, ct__expf16(_mm512_mul_ps(_mm512_mul_ps(mhalf, v), v)));
            _mm512_storeu_ps(d + i, _mm512_add_ps(_mm512_mul_ps(half, e1), _mm512_mul_ps(v, pdf)));
        }
    }
#endif
    for (; i < n; i++) {
        y[i] = gelu(x[i]);
        if (d) d[i] = gelu_deriv(x[i]);
    }
}

/* GELU over items [lo, hi) of one call: y (F32, or BF16 when emitting) and, if d, gelu'(x). */
typedef struct {
    const float *x, *dy;
    float *d;
    ct_tensor *y;
} gelu_job;

static void gelu_fwd_part(void *ctx, int64_t lo, int64_t hi)
{
    const gelu_job *j = ctx;
    const float *x = j->x;
    float *d = j->d;
    if (j->y->dtype != CT_BF16) {
        gelu_n(x + lo, ct_f32(j->y) + lo, d ? d + lo : NULL, hi - lo);
        return;
    }
    uint16_t *yh = ct_tensor_data(j->y);
    float buf[CT__EMIT_CHUNK];
    for (int64_t c = lo; c < hi; c += CT__EMIT_CHUNK) {
        int64_t k = hi - c < CT__EMIT_CHUNK ? hi - c : CT__EMIT_CHUNK;
        gelu_n(x + c, buf, d ? d + c : NULL, k);
        ct_f32_to_bf16_n(buf, yh + c, (size_t)k);
    }
}

/* Elements per thread below which an elementwise kernel stays on one thread. */
#define ELEM_GRAIN 16384

/* GELU's forward: y (F32, or BF16 when emitting) and, if d, gelu'(x) into d;
 * each element on its own, so cut over the rank's threads. */
static void gelu_forward(const float *x, ct_tensor *y, float *d, int64_t n)
{
    gelu_job j = {x, NULL, d, y};
    ct_parallel_for(n, ELEM_GRAIN, gelu_fwd_part, &j);
}

static void gelu_bwd_part(void *ctx, int64_t lo, int64_t hi)
{
    const gelu_job *j = ctx;
    float *restrict gd = ct_f32(j->y);
    const float *restrict d = j->d, *restrict dy = j->dy;
    for (int64_t i = lo; i < hi; i++) gd[i] = dy[i] * d[i];
}

/* Columns [lo, hi) of a bf16 gradient, every row in order: each column's
 * sum adds its rows in the order one thread would. */
static void gelu_bwd_cols(void *ctx, int64_t lo, int64_t hi)
{
    const gelu_job *j = ctx;
    ct_tensor *g = j->y;
    int64_t cols = g->ndim ? g->shape[g->ndim - 1] : 1, rows = cols ? g->numel / cols : 0;
    float buf[CT__EMIT_CHUNK];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = lo; c < hi; c += CT__EMIT_CHUNK) {
            int64_t k = hi - c < CT__EMIT_CHUNK ? hi - c : CT__EMIT_CHUNK, at = r * cols + c;
            for (int64_t i = 0; i < k; i++) buf[i] = j->dy[at + i] * j->d[at + i];
            ct__grad_bf16_put(g, at, buf, k);
        }
}

/* g = dy * d, i < n: into F32 g, or through L1 into a bf16 gradient with column sums. */
static void gelu_backward(const float *restrict d, const float *restrict dy, ct_tensor *g, int64_t n)
{
    gelu_job j = {NULL, dy, (float *)d, g};
    if (g->dtype != CT_BF16) {
        ct_parallel_for(n, ELEM_GRAIN, gelu_bwd_part, &j);
        return;
    }
    int64_t cols = g->ndim ? g->shape[g->ndim - 1] : 1;
    /* split by columns only when each thread's share is a worthwhile strip */
    if (n >= 2 * ELEM_GRAIN) ct_parallel_for(cols, 64, gelu_bwd_cols, &j);
    else gelu_bwd_cols(&j, 0, cols);
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
    ct_tensor *d = NULL; /* GELU's record: gelu'(x) */
    if (y && rec && kind == ACT_GELU) d = ct_tensor_empty(CT_F32, in->ndim, in->shape, CT_MEM_ACT);
    if (!y || (rec && kind == ACT_GELU && !d) || (rec && ct_record_save(rec, kind == ACT_GELU ? d : y) < 0)) {
        ct_tensor_release(d);
        ct_tensor_release(y);
        return CT_ENOMEM;
    }
    ct_tensor_release(d); /* the record holds it */
    const float *restrict x = ct_f32(in);
    float *restrict yd = bf16 ? NULL : ct_f32(y);
    int64_t n = in->numel;
    switch (kind) {
    case ACT_RELU:
        for (int64_t i = 0; i < n; i++) yd[i] = x[i] > 0.0f ? x[i] : 0.0f;
        break;
    case ACT_GELU:
        gelu_forward(x, y, d ? ct_f32(d) : NULL, n);
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
    const ct_tensor *s = ct_record_saved(rec, 0); /* relu, tanh: output; gelu: gelu'(input) */
    if (!ct_tensor_same_shape(dout, s) || dout->dtype != CT_F32) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "%s '%s': output gradient %s %s does not match the output %s (F32)",
                        m->ops->kind, nm(m), ct_dtype_name(dout->dtype), ct_shape_str(dout, a, sizeof a),
                        ct_shape_str(s, b, sizeof b));
    }
    if (!din) return CT_OK; /* no parameters: nothing else to do */
    act_kind kind = kind_of(m);
    ct_tensor *dx = kind == ACT_GELU && m->emit_bf16_grad ? ct__grad_bf16_create(s->ndim, s->shape)
                                                          : ct_tensor_empty(CT_F32, s->ndim, s->shape, CT_MEM_ACT);
    if (!dx) return CT_ENOMEM;
    const float *restrict v = ct_f32(s), *restrict dy = ct_f32(dout);
    float *restrict g = dx->dtype == CT_F32 ? ct_f32(dx) : NULL;
    int64_t n = s->numel;
    switch (kind) {
    case ACT_RELU:
        for (int64_t i = 0; i < n; i++) g[i] = v[i] > 0.0f ? dy[i] : 0.0f;
        break;
    case ACT_GELU:
        gelu_backward(v, dy, dx, n);
        break;
    case ACT_TANH:
        for (int64_t i = 0; i < n; i++) g[i] = dy[i] * (1.0f - v[i] * v[i]);
        break;
    }
    *din = dx;
    return CT_OK;
}

/* relu and tanh keep their output (their derivative is a function of it). */
static ct_status keep_out_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)nd, (void)sh, (void)mixed, (void)need_dx;
    c->keep_out = 1;
    return CT_OK;
}

/* gelu keeps gelu'(x) in f32, the input's size. */
static ct_status gelu_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)mixed, (void)need_dx;
    c->saved = ct__act_numel(nd, sh) * 4;
    return CT_OK;
}

static const ct_module_ops relu_ops = {"relu", act_forward, act_backward, NULL, 0, ct_module_out_shape_same,
                                       keep_out_cost, 0};
static const ct_module_ops gelu_ops = {"gelu", act_forward, act_backward, NULL, 0, ct_module_out_shape_same,
                                       gelu_cost, 0};
static const ct_module_ops tanh_ops = {"tanh", act_forward, act_backward, NULL, 0, ct_module_out_shape_same,
                                       keep_out_cost, 0};

/* Activations have no state: the ops table says which one a module is. */
ct_module *ct_relu_create(void) { return ct_module_create(&relu_ops, NULL); }
ct_module *ct_gelu_create(void) { return ct_module_create(&gelu_ops, NULL); }
ct_module *ct_tanh_create(void) { return ct_module_create(&tanh_ops, NULL); }

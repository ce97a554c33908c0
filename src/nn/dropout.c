/*
 * Dropout: in training, zeroes each element with probability p and scales
 * the kept ones by 1/(1-p); otherwise the identity.
 *
 * The mask is a pure function of (run seed, step, module stream, global row,
 * element): row r of a call (index r along dim 0) is global row
 * ctx->sample0 + r, and element j of that row keeps iff uniform number j of
 * the Philox stream keyed by (seed, step, module stream) with counter
 * (global row, j) is >= p.  So any split of a step's global batch into ranks
 * and micro-batches draws, row for row, the bits one call over the whole
 * batch would; a recompute in backward (ct_checkpoint_create) or a restart
 * draws the same mask; and steps, modules and rows draw independent ones.
 * The record keeps the mask as one byte per element.
 *
 * As the identity (p = 0, or not training) the layer costs nothing: forward
 * returns another reference to its input and backward another reference to
 * the output gradient.  That is safe because no one writes into a module's
 * output or input gradient in place (see activation.c); flatten aliases its
 * input the same way.
 */
#include "internal.h"

typedef struct {
    float p;
} drop_impl;

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

static uint64_t mix64(uint64_t z) /* splitmix64 finaliser */
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* x -> y (same shape); saves the u8 keep-mask in training with p > 0, nothing otherwise. */
static ct_status drop_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                              const ct_fwd_ctx *ctx)
{
    const drop_impl *D = m->impl;
    if (in->dtype != CT_F32)
        return ct_error(CT_EINVAL, "dropout '%s': input is %s but the layer takes F32", nm(m),
                        ct_dtype_name(in->dtype));
    if (!ctx->training || D->p == 0.0f) {
        if (rec) rec->ival[0] = 0; /* no mask: backward passes the gradient through */
        *out = ct_tensor_retain(in);
        return CT_OK;
    }
    ct_tensor *y = ct_tensor_empty(CT_F32, in->ndim, in->shape, CT_MEM_ACT); /* both written in full */
    ct_tensor *mask = rec ? ct_tensor_empty(CT_U8, in->ndim, in->shape, CT_MEM_ACT) : NULL;
    int saved = mask ? ct_record_save(rec, mask) : 0;
    ct_tensor_release(mask); /* the record holds it now */
    if (!y || (rec && (!mask || saved < 0))) {
        ct_tensor_release(y);
        return CT_ENOMEM;
    }
    if (rec) rec->ival[0] = 1;
    /* A 0-dim input is one row of one element. */
    int64_t rows = in->ndim ? in->shape[0] : 1, len = rows ? in->numel / rows : 0;
    uint64_t key = mix64(ctx->seed + mix64(m->rng_stream + mix64(ctx->step)));
    const float *x = ct_f32(in);
    float *yd = ct_f32(y);
    uint8_t *mk = mask ? ct_tensor_data(mask) : NULL;
    float p = D->p, scale = 1.0f / (1.0f - p);
    float u[256];
    for (int64_t r = 0; r < rows; r++) {
        ct_rng g; /* stream = global row: element j of the row is number j of the stream */
        ct_rng_init(&g, key, (uint64_t)(ctx->sample0 + r));
        for (int64_t j0 = 0; j0 < len; j0 += 256) {
            int64_t n = len - j0 < 256 ? len - j0 : 256, i0 = r * len + j0;
            ct_rng_uniform(&g, u, (size_t)n);
            /* Two loops, so each vectorises (the test inside one did not). */
            for (int64_t j = 0; j < n; j++) yd[i0 + j] = u[j] >= p ? x[i0 + j] * scale : 0.0f;
            if (mk)
                for (int64_t j = 0; j < n; j++) mk[i0 + j] = (uint8_t)(u[j] >= p);
        }
    }
    *out = y;
    return CT_OK;
}

static ct_status drop_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const drop_impl *D = m->impl;
    const ct_tensor *mask = rec->ival[0] ? ct_record_saved(rec, 0) : NULL;
    if (dout->dtype != CT_F32 || (mask && dout->numel != mask->numel)) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "dropout '%s': output gradient %s does not match the output %s",
                        nm(m), ct_shape_str(dout, a, sizeof a),
                        mask ? ct_shape_str(mask, b, sizeof b) : "(F32)");
    }
    if (!din) return CT_OK;
    if (!mask) {
        *din = ct_tensor_retain(dout);
        return CT_OK;
    }
    ct_tensor *dx = ct_tensor_empty(CT_F32, dout->ndim, dout->shape, CT_MEM_ACT); /* written in full */
    if (!dx) return CT_ENOMEM;
    const float *dy = ct_f32(dout);
    const uint8_t *mk = ct_tensor_data(mask);
    float *g = ct_f32(dx);
    float scale = 1.0f / (1.0f - D->p);
    for (int64_t i = 0; i < dout->numel; i++) g[i] = mk[i] ? dy[i] * scale : 0.0f;
    *din = dx;
    return CT_OK;
}

static void drop_destroy(ct_module *m) { ct_free(m->impl); }

/* A u8 keep-mask of the input's size, when p > 0. */
static ct_status drop_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)mixed, (void)need_dx;
    if (ct__dropout_p(m) > 0) c->saved = ct__act_numel(nd, sh);
    return CT_OK;
}

static const ct_module_ops drop_ops = {"dropout", drop_forward, drop_backward, drop_destroy, 0,
                                       ct_module_out_shape_same, drop_act_cost, 0};

float ct__dropout_p(const ct_module *m)
{
    return m->ops == &drop_ops ? ((const drop_impl *)m->impl)->p : 0.0f;
}

ct_module *ct_dropout_create(float p)
{
    if (!(p >= 0.0f && p < 1.0f)) {
        ct_error(CT_EINVAL, "dropout probability %g must be in [0, 1)", (double)p);
        return NULL;
    }
    drop_impl *D = ct_alloc_zeroed(sizeof *D, CT_MEM_OTHER);
    if (!D) return NULL;
    D->p = p;
    ct_module *m = ct_module_create(&drop_ops, D);
    if (!m) ct_free(D);
    return m;
}

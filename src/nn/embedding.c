/*
 * Embedding lookup: i32 or i64 indices [...] -> rows of weight [num, dim],
 * output [..., dim].  Backward scatter-adds into the weight gradient
 * (repeated indices accumulate); indices have no gradient, so *din is NULL
 * and an embedding can only be the first layer of a chain.
 *
 * With a bf16 compute copy of the weight (see internal.h) the rows are
 * gathered from it and widened to the f32 output; the gradient is f32 and
 * the same as without the copy.
 */
#include <string.h>

#include "internal.h"

typedef struct {
    int64_t num, dim;
} emb_impl;

#define nm ct__nn_name

static inline int64_t index_at(const ct_tensor *t, int64_t i)
{
    return t->dtype == CT_I64 ? ((const int64_t *)ct_tensor_data(t))[i] : ((const int32_t *)ct_tensor_data(t))[i];
}

/* idx [...] -> y [..., dim]; saves idx by reference. */
static ct_status emb_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                             const ct_fwd_ctx *ctx)
{
    (void)ctx;
    const emb_impl *E = m->impl;
    if (in->dtype != CT_I32 && in->dtype != CT_I64)
        return ct_error(CT_EINVAL, "embedding '%s': input is %s but indices must be I32 or I64",
                        nm(m), ct_dtype_name(in->dtype));
    if (in->ndim >= CT_MAX_DIMS)
        return ct_error(CT_EINVAL, "embedding '%s': input has %d dims; at most %d fit with the "
                        "embedding dim added", nm(m), in->ndim, CT_MAX_DIMS - 1);
    for (int64_t i = 0; i < in->numel; i++) {
        int64_t v = index_at(in, i);
        if (v < 0 || v >= E->num)
            return ct_error(CT_EINVAL, "embedding '%s': index %lld at position %lld is outside "
                            "[0, %lld) (num_embeddings %lld); check the vocabulary size or the data",
                            nm(m), (long long)v, (long long)i, (long long)E->num, (long long)E->num);
    }
    int64_t shape[CT_MAX_DIMS];
    for (int i = 0; i < in->ndim; i++) shape[i] = in->shape[i];
    shape[in->ndim] = E->dim;
    ct_param *W = m->params[0];
    int bf16;
    CT_TRY(ct__param_compute(m, W, &bf16));
    ct_tensor *y = ct_tensor_empty(CT_F32, in->ndim + 1, shape, CT_MEM_ACT);
    if (!y) return CT_ENOMEM;
    float *yd = ct_f32(y);
    if (bf16) {
        const uint16_t *w = ct_tensor_data(W->compute);
        for (int64_t i = 0; i < in->numel; i++)
            ct_bf16_to_f32_n(w + index_at(in, i) * E->dim, yd + i * E->dim, (size_t)E->dim);
    } else {
        const float *w = ct_f32(W->data);
        size_t row = (size_t)E->dim * sizeof(float);
        for (int64_t i = 0; i < in->numel; i++) memcpy(yd + i * E->dim, w + index_at(in, i) * E->dim, row);
    }
    if (rec && ct_record_save(rec, in) < 0) {
        ct_tensor_release(y);
        return CT_ENOMEM;
    }
    *out = y;
    return CT_OK;
}

static ct_status emb_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const emb_impl *E = m->impl;
    const ct_tensor *idx = ct_record_saved(rec, 0);
    if (din) *din = NULL;
    if (dout->dtype != CT_F32 || dout->numel != idx->numel * E->dim) {
        char a[64];
        return ct_error(CT_EINVAL, "embedding '%s': output gradient %s does not match %lld "
                        "indices x dim %lld", nm(m), ct_shape_str(dout, a, sizeof a),
                        (long long)idx->numel, (long long)E->dim);
    }
    ct_param *W = m->params[0];
    if (!W->requires_grad || !W->grad) return CT_OK;
    float *gw = ct_f32(W->grad);
    const float *dy = ct_f32(dout);
    for (int64_t i = 0; i < idx->numel; i++) {
        float *g = gw + index_at(idx, i) * E->dim;
        const float *d = dy + i * E->dim;
        for (int64_t j = 0; j < E->dim; j++) g[j] += d[j];
    }
    return CT_OK;
}

static void emb_destroy(ct_module *m) { ct_free(m->impl); }

/* [...] -> [..., dim]; index values are data, so only the rank is checked. */
static ct_status emb_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                               int64_t *out_shape)
{
    const emb_impl *E = m->impl;
    if (ndim >= CT_MAX_DIMS)
        return ct_error(CT_EINVAL, "embedding '%s': input has %d dims; at most %d fit with the "
                        "embedding dim added", nm(m), ndim, CT_MAX_DIMS - 1);
    memcpy(out_shape, in_shape, (size_t)ndim * sizeof *out_shape);
    out_shape[ndim] = E->dim;
    *out_ndim = ndim + 1;
    return CT_OK;
}

/* The record keeps the indices. */
static ct_status emb_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)nd, (void)sh, (void)mixed, (void)need_dx;
    c->keep_in = 1;
    return CT_OK;
}

static const ct_module_ops emb_ops = {"embedding", emb_forward, emb_backward, emb_destroy, 0,
                                      emb_out_shape, emb_act_cost, 0};

ct_module *ct_embedding_create(int64_t num, int64_t dim)
{
    if (num <= 0 || dim <= 0) {
        ct_error(CT_EINVAL, "embedding needs num > 0 and dim > 0, got num=%lld dim=%lld",
                 (long long)num, (long long)dim);
        return NULL;
    }
    emb_impl *E = ct_alloc(sizeof *E, CT_MEM_OTHER);
    if (!E) return NULL;
    *E = (emb_impl){num, dim};
    ct_module *m = ct_module_create(&emb_ops, E);
    if (!m) {
        ct_free(E);
        return NULL;
    }
    ct_param *w = ct_module_add_param(m, "weight", 2, (int64_t[]){num, dim});
    if (!w) {
        ct_module_destroy(m);
        return NULL;
    }
    ct_param_set_init(w, ct_init_normal(0.0f, 1.0f));
    return m;
}

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
/* One lookup or one gradient: rows of the output, or columns of the table. */
typedef struct {
    const emb_impl *E;
    const ct_tensor *idx;
    const void *src; /* forward: the table (bf16 compute copy or f32); backward: dy */
    float *dst;      /* forward: y; backward: the table's gradient */
    int bf16;
} emb_job;

/* Positions per thread below which a lookup stays on one thread. */
#define ROW_GRAIN 64

static void emb_rows(void *ctx, int64_t lo, int64_t hi)
{
    const emb_job *j = ctx;
    int64_t dim = j->E->dim;
    for (int64_t i = lo; i < hi; i++) {
        int64_t at = index_at(j->idx, i) * dim;
        if (j->bf16) ct_bf16_to_f32_n((const uint16_t *)j->src + at, j->dst + i * dim, (size_t)dim);
        else memcpy(j->dst + i * dim, (const float *)j->src + at, (size_t)dim * sizeof(float));
    }
}

static void emb_grad_cols(void *ctx, int64_t lo, int64_t hi)
{
    const emb_job *j = ctx;
    int64_t dim = j->E->dim;
    const float *dy = j->src;
    for (int64_t i = 0; i < j->idx->numel; i++) {
        float *restrict g = j->dst + index_at(j->idx, i) * dim;
        const float *restrict d = dy + i * dim;
        for (int64_t c = lo; c < hi; c++) g[c] += d[c];
    }
}

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
    emb_job j = {E, in, bf16 ? ct_tensor_data(W->compute) : ct_tensor_data(W->data), ct_f32(y), bf16};
    ct_parallel_for(in->numel, ROW_GRAIN, emb_rows, &j); /* rows are independent copies */
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
    emb_job j = {E, idx, ct_f32(dout), ct_f32(W->grad), 0};
    /* A table row may take several positions: cut by columns, each adds the
     * positions in order, as one thread does. */
    if (idx->numel * E->dim >= 2 * 16384) ct_parallel_for(E->dim, 64, emb_grad_cols, &j);
    else emb_grad_cols(&j, 0, E->dim);
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

/*
 * Helpers of the bf16 compute path shared by linear, conv2d and embedding
 * (see internal.h): checking a parameter's compute copy and casting
 * operands to bf16; which layers take bf16 input (emit_bf16) or a bf16
 * output gradient (emit_bf16_grad); and such gradients with their column
 * sums.
 */
#include <string.h>

#include "internal.h"

ct_status ct__param_compute_kind(const ct_module *m, const ct_param *p, int *bf16)
{
    *bf16 = 0;
    const ct_tensor *c = p->compute;
    if (!c) return CT_OK;
    if (c->dtype != CT_BF16 || c->numel != p->data->numel || c->ndim != p->data->ndim ||
        memcmp(c->shape, p->data->shape, (size_t)c->ndim * sizeof c->shape[0])) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "%s '%s': compute copy of '%s' is %s %s but must be BF16 %s like "
                        "its data; set p->compute to a BF16 cast of p->data (or NULL for F32)",
                        m->ops->kind, ct__nn_name(m), p->local, ct_dtype_name(c->dtype),
                        ct_shape_str(c, a, sizeof a), ct_shape_str(p->data, b, sizeof b));
    }
    *bf16 = 1;
    return CT_OK;
}

ct_status ct__param_compute(const ct_module *m, const ct_param *p, int *bf16)
{
    CT_TRY(ct__param_compute_kind(m, p, bf16));
    const ct_tensor *c = p->compute;
    if (c && !ct_tensor_data(c))
        return ct_error(CT_ESTATE, "%s '%s': compute copy of '%s' has no memory (its storage was "
                        "released); bring it back before the forward", m->ops->kind,
                        ct__nn_name(m), p->local);
    return CT_OK;
}

ct_status ct__param_bf16(const ct_param *p, const uint16_t **w, uint16_t **tmp)
{
    *tmp = NULL;
    if (p->compute) {
        *w = ct_tensor_data(p->compute);
        return CT_OK;
    }
    uint16_t *h = ct_alloc((size_t)p->data->numel * sizeof *h, CT_MEM_ACT);
    if (!h) return CT_ENOMEM;
    ct_f32_to_bf16_n(ct_f32(p->data), h, (size_t)p->data->numel);
    *w = *tmp = h;
    return CT_OK;
}

ct_tensor *ct__tensor_bf16(ct_tensor *t)
{
    if (t->dtype == CT_BF16) return ct_tensor_retain(t);
    ct_tensor *h = ct_tensor_empty(CT_BF16, t->ndim, t->shape, CT_MEM_ACT);
    if (h) ct_f32_to_bf16_n(ct_f32(t), ct_tensor_data(h), (size_t)t->numel);
    return h;
}

int ct__takes_bf16(const ct_module *m)
{
    /* A kind whose forward hands its input straight to its first child. */
    static const char *const first_kid[] = {"attention", "sequential", "checkpoint"};
    for (int depth = 0; m && depth < 8; depth++) {
        if (!strcmp(m->ops->kind, "linear")) return m->nparams > 0 && m->params[0]->compute != NULL;
        int pass = 0;
        for (size_t i = 0; i < sizeof first_kid / sizeof *first_kid; i++) pass |= !strcmp(m->ops->kind, first_kid[i]);
        if (!pass || m->nkids == 0) return 0;
        m = m->kids[0];
    }
    return 0;
}

/* The head in front of a gradient's column sums; the values follow the sums
 * at a 64-byte boundary. */
typedef struct {
    uint64_t magic;
    int64_t cols, numel;
} grad_head;

#define GRAD_MAGIC 0x63746772616462ull /* "ctgradb" */

static size_t grad_values_at(int64_t cols)
{
    return (sizeof(grad_head) + (size_t)cols * sizeof(float) + 63) & ~(size_t)63;
}

ct_tensor *ct__grad_bf16_create(int ndim, const int64_t *shape)
{
    int64_t numel = 1, cols = ndim ? shape[ndim - 1] : 1;
    for (int i = 0; i < ndim; i++) numel *= shape[i];
    size_t at = grad_values_at(cols);
    ct_storage *st = ct_storage_create(at + (size_t)numel * sizeof(uint16_t), CT_MEM_ACT, 0);
    if (!st) return NULL;
    grad_head *h = ct_storage_ptr(st);
    *h = (grad_head){GRAD_MAGIC, cols, numel};
    memset(h + 1, 0, (size_t)cols * sizeof(float));
    ct_tensor *g = ct_tensor_on(st, at, CT_BF16, ndim, shape);
    ct_storage_release(st); /* the view holds it */
    return g;
}

float *ct__grad_bf16_colsum(const ct_tensor *g)
{
    if (g->dtype != CT_BF16 || !g->storage || g->storage->window) return NULL;
    int64_t cols = g->ndim ? g->shape[g->ndim - 1] : 1;
    grad_head *h = ct_storage_ptr(g->storage);
    if (!h || g->storage->bytes < sizeof *h || g->offset != grad_values_at(cols) || h->magic != GRAD_MAGIC ||
        h->cols != cols || h->numel != g->numel)
        return NULL;
    return (float *)(void *)(h + 1);
}

void ct__grad_bf16_put(ct_tensor *g, int64_t at, const float *x, int64_t n)
{
    float *sum = ct__grad_bf16_colsum(g);
    uint16_t *y = ct_tensor_data(g);
    int64_t cols = g->ndim ? g->shape[g->ndim - 1] : 1;
    ct_f32_to_bf16_n(x, y + at, (size_t)n);
    for (int64_t j = at % cols; n > 0;) { /* a row's piece at a time */
        int64_t k = cols - j < n ? cols - j : n;
        float *restrict s = sum + j;
        for (int64_t i = 0; i < k; i++) s[i] += x[i];
        x += k;
        n -= k;
        j = 0;
    }
}

int ct__takes_bf16_grad(const ct_module *m, const ct_record *r)
{
    return m && r && r->m == m && !strcmp(m->ops->kind, "linear") && r->nsaved > 0 && r->saved[0] &&
           r->saved[0]->dtype == CT_BF16;
}

/*
 * Helpers of the bf16 compute path shared by linear, conv2d and embedding
 * (see internal.h): checking a parameter's compute copy and casting
 * operands to bf16; and which layers take bf16 input (emit_bf16).
 */
#include <string.h>

#include "internal.h"

ct_status ct__param_compute(const ct_module *m, const ct_param *p, int *bf16)
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
    if (!ct_tensor_data(c))
        return ct_error(CT_ESTATE, "%s '%s': compute copy of '%s' has no memory (its storage was "
                        "released); bring it back before the forward", m->ops->kind,
                        ct__nn_name(m), p->local);
    *bf16 = 1;
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
    static const char *const first_kid[] = {"attention", "sequential"};
    for (int depth = 0; m && depth < 8; depth++) {
        if (!strcmp(m->ops->kind, "linear")) return m->nparams > 0 && m->params[0]->compute != NULL;
        int pass = 0;
        for (size_t i = 0; i < sizeof first_kid / sizeof *first_kid; i++) pass |= !strcmp(m->ops->kind, first_kid[i]);
        if (!pass || m->nkids == 0) return 0;
        m = m->kids[0];
    }
    return 0;
}

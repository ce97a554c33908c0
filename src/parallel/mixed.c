/*
 * Mixed precision, the policy part: with param_dtype=bf16 every parameter
 * that feeds a matrix product (two or more dims: linear and conv weights,
 * embeddings) gets a bf16 compute copy (ct_param.compute) that the layers
 * read, made at wrap and refreshed after every optimizer step and every
 * load.  The f32 parameter stays the master copy the optimizer updates, and
 * gradients stay f32, so the optimizer's numbers are those of f32 training
 * on bf16 products.  One-dimensional parameters (biases, norm weights) and
 * every parameter of a norm layer stay f32, as under torch.autocast.
 * Refreshing once per step (not per forward, as autocast casts) means
 * micro-batches and recomputation reuse one cast.
 */
#include <string.h>

#include "internal.h"

ct_status ct__mixed_init(ct_strategy *s)
{
    if (s->common.param_dtype == CT_F32) return CT_OK;
    for (int i = 0; i < s->nparams; i++) {
        ct_param *p = s->params[i];
        if (p->compute)
            return ct_error(CT_ESTATE, "parameter '%s' already has a compute copy: is the model wrapped by "
                            "another mixed-precision strategy?", p->name);
    }
    s->owns_compute = 1; /* from here the copies are this strategy's to free */
    for (int i = 0; i < s->nparams; i++) {
        ct_param *p = s->params[i];
        if (!ct_param_takes_bf16_copy(p)) continue;
        p->compute = ct_tensor_empty((ct_dtype)s->common.param_dtype, p->data->ndim, p->data->shape,
                                     CT_MEM_PARAM);
        if (!p->compute) {
            ct__mixed_fini(s);
            return CT_ENOMEM;
        }
    }
    return ct__mixed_refresh(s);
}

void ct__mixed_refresh_param(ct_strategy *s, ct_param *p)
{
    if (s->owns_compute && p->compute)
        ct_f32_to_bf16_n(ct_f32(p->data), ct_tensor_data(p->compute), (size_t)p->data->numel);
}

ct_status ct__mixed_refresh(ct_strategy *s)
{
    for (int i = 0; i < s->nparams; i++) ct__mixed_refresh_param(s, s->params[i]);
    return CT_OK;
}

void ct__mixed_fini(ct_strategy *s)
{
    if (!s->owns_compute) return;
    for (int i = 0; i < s->nparams; i++) {
        ct_tensor_release(s->params[i]->compute);
        s->params[i]->compute = NULL;
    }
    s->owns_compute = 0;
}

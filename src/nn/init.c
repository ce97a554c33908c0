/*
 * Initial values.  Every parameter carries a rule (ct_param.init) that gives
 * any element from (the parameter's seed, its fully qualified name, the
 * element's index): a counter-based stream (Philox, src/core/rng.c) keyed by
 * the name and read at the element's offset.  So a whole-model
 * initialisation and a rank that makes only its shard of a shape-only model
 * write the same numbers, for any world size, strategy or traversal order,
 * and no rank ever needs the whole model to get its part.
 *
 * The built-in layers set PyTorch's reset_parameters() rules when built:
 * Linear/Conv2d weights kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in),
 * 1/sqrt(fan_in)), biases the same bound; norm weights 1, biases 0;
 * embeddings N(0,1).  The ready models set their own (the gpt: nanoGPT's).
 */
#include <math.h>
#include <string.h>

#include "internal.h"

static _Thread_local int shape_only;

int ct_module_shape_only(int on)
{
    int was = shape_only;
    shape_only = on != 0;
    return was;
}

int ct__nn_shape_only(void) { return shape_only; }

ct_status ct_param_init_values(const ct_param *p, int64_t first, int64_t n, float *out)
{
    int64_t numel = p->data->numel;
    if (first < 0 || n < 0 || first > numel - n)
        return ct_error(CT_EINVAL, "initial values of '%s': elements [%lld, +%lld) are outside its %lld",
                        p->name, (long long)first, (long long)n, (long long)numel);
    ct_rng r;
    ct_rng_init(&r, p->seed, ct_hash64(p->name, strlen(p->name)));
    switch (p->init.kind) {
    case CT_INIT_CONST:
        for (int64_t i = 0; i < n; i++) out[i] = p->init.a;
        return CT_OK;
    case CT_INIT_UNIFORM:
        r.offset = (uint64_t)first;
        ct_rng_uniform(&r, out, (size_t)n);
        for (int64_t i = 0; i < n; i++) out[i] = (2.0f * out[i] - 1.0f) * p->init.a;
        return CT_OK;
    case CT_INIT_NORMAL:
        /* Element i is one half of pair i/2 (Box-Muller from the stream's
         * words 2(i/2) and 2(i/2)+1): an odd first starts inside a pair. */
        r.offset = (uint64_t)(first - (first & 1));
        if (n > 0 && (first & 1)) {
            float two[2];
            ct_rng_normal(&r, two, 2, p->init.a, p->init.b);
            out[0] = two[1];
            out++, n--;
        }
        ct_rng_normal(&r, out, (size_t)n, p->init.a, p->init.b);
        return CT_OK;
    case CT_INIT_FN:
        return p->init.fn(p, p->seed, first, n, out);
    case CT_INIT_NONE:
        break;
    }
    return ct_error(CT_EUNSUPPORTED, "parameter '%s' of module '%s' (kind %s) has no initial values: set its "
                    "rule in the layer's constructor (ct_param_set_init with ct_init_normal, ct_init_with, ...)",
                    p->name, p->owner ? ct__nn_name(p->owner) : "?", p->owner ? p->owner->ops->kind : "?");
}

void ct_param_set_init(ct_param *p, ct_init rule)
{
    p->init = rule;
    if (rule.kind == CT_INIT_CONST && ct_tensor_data(p->data)) ct_tensor_fill(p->data, rule.a);
}

void ct__init_fan_in(ct_module *m, int64_t fan_in)
{
    float bound = fan_in > 0 ? 1.0f / sqrtf((float)fan_in) : 0.0f;
    for (int i = 0; i < m->nparams; i++) ct_param_set_init(m->params[i], ct_init_uniform(bound));
}

ct_status ct_param_values(const ct_param *p, int64_t first, int64_t n, float *out)
{
    const float *d = ct_tensor_data(p->data);
    if (d && first >= 0 && n >= 0 && first <= p->data->numel - n) {
        memcpy(out, d + first, (size_t)n * sizeof *out);
        return CT_OK;
    }
    if (!d && p->shape_only) return ct_param_init_values(p, first, n, out);
    if (!d) return ct_tensor_check_data(p->data);
    return ct_param_init_values(p, first, n, out); /* the range check's message */
}

/* A walk that allocates nothing (it cannot fail); a tied parameter, listed
 * by two modules, is written twice with the same values. */
void ct_module_init_params(ct_module *m, uint64_t seed)
{
    int warned = 0;
    for (int i = 0; i < m->nparams; i++) {
        ct_param *p = m->params[i];
        p->seed = seed;
        if (p->init.kind == CT_INIT_NONE) {
            /* Silently zero weights train badly or not at all: say which module. */
            if (!warned++)
                ct_log(CT_LOG_WARN, "ct_module_init_params: module '%s' (kind %s) has parameters with no "
                       "initial rule, left as they are (zeros from ct_module_add_param); set their rule in its "
                       "constructor (ct_param_set_init)", ct__nn_name(m), m->ops->kind);
            continue;
        }
        float *d = ct_tensor_data(p->data);
        if (d) (void)ct_param_init_values(p, 0, p->data->numel, d);
    }
    for (int i = 0; i < m->nkids; i++) ct_module_init_params(m->kids[i], seed);
}

ct_status ct_module_materialize(ct_module *root)
{
    ct_param **ps;
    int n;
    CT_TRY(ct_module_params(root, &ps, &n));
    ct_status st = CT_OK;
    for (int i = 0; i < n && st == CT_OK; i++) {
        ct_param *p = ps[i];
        if (!p->shape_only) continue;
        st = ct_storage_alloc_data(p->data->storage, 0);
        if (st == CT_OK) st = ct_param_init_values(p, 0, p->data->numel, ct_f32(p->data));
        if (st == CT_OK && p->grad) st = ct_storage_alloc_data(p->grad->storage, 1);
        if (st == CT_OK) {
            p->shape_only = 0;
        } else { /* as it was: shape-only */
            ct_storage_free_data(p->data->storage);
            if (p->grad) ct_storage_free_data(p->grad->storage);
        }
    }
    ct_free(ps);
    return st;
}

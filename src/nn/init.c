/*
 * Default parameter initialisation, following PyTorch's reset_parameters():
 * Linear/Conv2d weights kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in),
 * 1/sqrt(fan_in)), biases the same bound; norm weights 1, biases 0;
 * embeddings N(0,1).  Each parameter draws from its own RNG stream keyed by
 * its fully qualified name, so the result does not depend on traversal
 * order, world size or which rank initialises.
 */
#include <math.h>
#include <string.h>

#include "ctrain/nn.h"

static void uniform(ct_param *p, uint64_t seed, float bound)
{
    ct_rng r;
    ct_rng_init(&r, seed, ct_hash64(p->name, strlen(p->name)));
    float *d = ct_f32(p->data);
    ct_rng_uniform(&r, d, (size_t)p->data->numel);
    for (int64_t i = 0; i < p->data->numel; i++) d[i] = (2.0f * d[i] - 1.0f) * bound;
}

static ct_param *param(ct_module *m, const char *local)
{
    for (int i = 0; i < m->nparams; i++)
        if (!strcmp(m->params[i]->local, local)) return m->params[i];
    return NULL;
}

static void init_module(ct_module *m, uint64_t seed)
{
    const char *k = m->ops->kind;
    ct_param *w = param(m, "weight"), *b = param(m, "bias");
    if (m->init) {
        m->init(m, seed);
    } else if ((!strcmp(k, "linear") || !strcmp(k, "conv2d")) && w) {
        int64_t fan_in = w->data->numel / w->data->shape[0];
        float bound = fan_in > 0 ? 1.0f / sqrtf((float)fan_in) : 0.0f;
        uniform(w, seed, bound);
        if (b) uniform(b, seed, bound);
    } else if (!strcmp(k, "layernorm") || !strcmp(k, "batchnorm")) {
        if (w) ct_tensor_fill(w->data, 1.0f);
        if (b) ct_tensor_fill(b->data, 0.0f);
    } else if (!strcmp(k, "embedding") && w) {
        ct_rng r;
        ct_rng_init(&r, seed, ct_hash64(w->name, strlen(w->name)));
        ct_rng_normal(&r, ct_f32(w->data), (size_t)w->data->numel, 0.0f, 1.0f);
    } else if (m->nparams > 0 && strcmp(k, "linear") && strcmp(k, "conv2d") && strcmp(k, "embedding")) {
        /* Silently zero weights train badly or not at all: say which module. */
        ct_log(CT_LOG_WARN, "ct_module_init_params: module '%s' (kind %s) has %d parameter%s it cannot "
               "initialise, left as they are (zeros from ct_module_add_param); set its init (ct_module.init)",
               m->fqn && *m->fqn ? m->fqn : "(root)", k, m->nparams, m->nparams == 1 ? "" : "s");
    }
    for (int i = 0; i < m->nkids; i++) init_module(m->kids[i], seed);
}

void ct_module_init_params(ct_module *root, uint64_t seed) { init_module(root, seed); }

/*
 * nanoGPT's GPT (bias=True) as a flat sequential whose children carry
 * nanoGPT's state_dict names (models.h draws the layout): the embeddings,
 * one child per block, the final LayerNorm and the LM head, whose weight is
 * the token embedding's (ct_module_share_param), as nanoGPT ties
 * lm_head.weight to transformer.wte.weight.  Flat, so a pipeline cuts it
 * between blocks with ct_sequential_split and FSDP wraps each block, with
 * every name unchanged.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

ct_status ct__gpt_validate(const ct_model_config *cfg)
{
    if (cfg->layers < 1 || cfg->layers > 4096)
        return ct_error(CT_EINVAL, "gpt --layers %lld must be 1 to 4096", (long long)cfg->layers);
    if (cfg->heads < 1 || cfg->dim < 1 || cfg->dim % cfg->heads)
        return ct_error(CT_EINVAL, "gpt --dim %lld must be a positive multiple of --heads %lld (each head "
                        "gets dim/heads features)", (long long)cfg->dim, (long long)cfg->heads);
    if (cfg->dim > (1 << 20) || cfg->heads > (1 << 20))
        return ct_error(CT_EINVAL, "gpt --dim %lld is too large (at most 2^20)", (long long)cfg->dim);
    if (cfg->context < 1 || cfg->context > (1 << 16))
        return ct_error(CT_EINVAL, "gpt --context %lld must be 1 to 65536 tokens", (long long)cfg->context);
    if (cfg->vocab < 1 || cfg->vocab > (1 << 24))
        return ct_error(CT_EINVAL, "gpt --vocab %lld must be 1 to 2^24 (256 for bytes)", (long long)cfg->vocab);
    if (cfg->in_ndim != 1 || cfg->in[0] != cfg->context || cfg->classes != cfg->vocab)
        return ct_error(CT_EINVAL, "gpt config: its input is [context] and its classes the vocabulary; set "
                        "it with ct_model_config_gpt");
    return CT_OK;
}

ct_status ct__gpt_build(const ct_model_config *cfg, ct_module **out)
{
    *out = NULL;
    ct_module *seq = ct_sequential_create();
    if (!seq) return CT_ENOMEM;
    float p = cfg->dropout;
    ct_status st = ct_module_add(seq, "transformer",
                                 ct_tokpos_embedding_create(cfg->vocab, cfg->context, cfg->dim, p));
    for (int64_t i = 0; i < cfg->layers && st == CT_OK; i++) {
        char name[48];
        snprintf(name, sizeof name, "transformer.h.%lld", (long long)i);
        st = ct_module_add(seq, name, ct_transformer_block_create(cfg->dim, (int)cfg->heads, p));
    }
    if (st == CT_OK) st = ct_module_add(seq, "transformer.ln_f", ct_layernorm_create(cfg->dim, 1e-5f));
    if (st == CT_OK) st = ct_module_add(seq, "lm_head", ct_linear_create(cfg->dim, cfg->vocab, 0));
    if (st == CT_OK) {
        ct_module *head = seq->kids[seq->nkids - 1];
        ct_param *wte = ct_module_find(seq, "transformer.wte.weight");
        st = wte ? ct_module_share_param(head, "weight", wte) : ct_error(CT_ESTATE, "gpt: no token embedding");
    }
    if (st != CT_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", ct_last_error());
        ct_module_destroy(seq);
        return ct_error(st, "building the gpt failed: %s", *why ? why : "out of memory");
    }
    *out = seq;
    return CT_OK;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

/* nanoGPT's _init_weights: the matrices (Linear and Embedding weights)
 * N(0, 0.02), the residual projections N(0, 0.02/sqrt(2 layers)), biases
 * zero; LayerNorms keep their own rule (ones, zeros). */
void ct__gpt_init(ct_module *m, const ct_model_config *cfg, uint64_t seed)
{
    ct_param **ps;
    int n;
    /* Only the parameter list can fail (out of memory); then the weights stay as built. */
    if (ct_module_params(m, &ps, &n) != CT_OK) return;
    float resid = 0.02f / sqrtf(2.0f * (float)cfg->layers);
    for (int i = 0; i < n; i++) {
        ct_param *p = ps[i];
        if (p->data->ndim >= 2) ct_param_set_init(p, ct_init_normal(0.0f, ends_with(p->name, "c_proj.weight") ? resid : 0.02f));
        else if (ends_with(p->name, ".bias")) ct_param_set_init(p, ct_init_const(0.0f));
    }
    ct_free(ps);
    ct_module_init_params(m, seed);
}

/*
 * Text generation from a gpt with a KV cache: each new token runs one
 * position through the blocks, reading the keys and values of the earlier
 * positions from the cache instead of recomputing them, so a token costs
 * O(layers * (dim^2 + t * dim)) instead of a forward over the whole window.
 * The weights are the model's own parameters (found by their nanoGPT
 * names), in f32, so the logits are the module forward's to rounding
 * (tests/test_gpt_sample.c holds them to it).
 *
 * Past the context the window slides as nanoGPT's generate crops idx to the
 * last `context` tokens: positions are relative to the window, so every
 * cached key is stale once the window moves; the cache is then rebuilt from
 * the window's tokens (a prefill per token, the cost of a cache-less
 * forward).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

typedef struct {
    const float *ln1w, *ln1b, *attw, *attb, *projw, *projb, *ln2w, *ln2b, *fcw, *fcb, *fc2w, *fc2b;
} layer_w;

struct ct_gpt_gen {
    ct_model_config cfg;
    const float *wte, *wpe, *lnfw, *lnfb;
    layer_w *L;
    float *kc, *vc;        /* [layers][context][dim] keys and values */
    float *x, *a, *qkv, *y, *h, *att, *logits;
    int64_t *window;       /* the tokens the cache holds, [context] */
    int64_t pos;           /* positions cached */
};

static ct_status weight(ct_module *m, const char *fmt, long long i, int64_t numel, const float **out)
{
    char name[128];
    snprintf(name, sizeof name, fmt, i);
    ct_param *p = ct_module_find(m, name);
    if (!p || p->data->numel != numel || p->data->dtype != CT_F32 || !ct_tensor_data(p->data))
        return ct_error(CT_EINVAL, "generation: the model has no f32 '%s' of %lld elements with its data here "
                        "(build it with ct_model_build from the config; a sharded strategy's model must be "
                        "gathered first)", name, (long long)numel);
    *out = ct_f32(p->data);
    return CT_OK;
}

ct_status ct_gpt_gen_create(ct_module *model, const ct_model_config *cfg, ct_gpt_gen **out)
{
    *out = NULL;
    if (cfg->kind != CT_MODEL_GPT) return ct_error(CT_EINVAL, "generation needs a gpt, not a %s", ct_model_kind_name(cfg->kind));
    CT_TRY(ct_model_config_validate(cfg));
    ct_gpt_gen *g = ct_alloc_zeroed(sizeof *g, CT_MEM_OTHER);
    if (!g) return CT_ENOMEM;
    g->cfg = *cfg;
    int64_t D = cfg->dim, T = cfg->context, V = cfg->vocab, Ln = cfg->layers;
    ct_status st = CT_OK;
    g->L = ct_alloc_zeroed(sizeof *g->L * (size_t)Ln, CT_MEM_OTHER);
    g->kc = ct_alloc(sizeof(float) * (size_t)(Ln * T * D), CT_MEM_ACT);
    g->vc = ct_alloc(sizeof(float) * (size_t)(Ln * T * D), CT_MEM_ACT);
    g->x = ct_alloc(sizeof(float) * (size_t)(D * 11 + T + V), CT_MEM_ACT);
    g->window = ct_alloc(sizeof *g->window * (size_t)T, CT_MEM_OTHER);
    if (!g->L || !g->kc || !g->vc || !g->x || !g->window) st = CT_ENOMEM;
    if (st == CT_OK) {
        g->a = g->x + D;
        g->qkv = g->a + D;      /* 3D */
        g->y = g->qkv + 3 * D;
        g->h = g->y + D;        /* 4D */
        g->att = g->h + 4 * D;  /* T */
        g->logits = g->att + T; /* V */
    }
    if (st == CT_OK) st = weight(model, "transformer.wte.weight", 0, V * D, &g->wte);
    if (st == CT_OK) st = weight(model, "transformer.wpe.weight", 0, T * D, &g->wpe);
    if (st == CT_OK) st = weight(model, "transformer.ln_f.weight", 0, D, &g->lnfw);
    if (st == CT_OK) st = weight(model, "transformer.ln_f.bias", 0, D, &g->lnfb);
    for (long long i = 0; i < Ln && st == CT_OK; i++) {
        layer_w *w = &g->L[i];
        struct {
            const char *fmt;
            int64_t n;
            const float **p;
        } want[] = {{"transformer.h.%lld.ln_1.weight", D, &w->ln1w},
                    {"transformer.h.%lld.ln_1.bias", D, &w->ln1b},
                    {"transformer.h.%lld.attn.c_attn.weight", 3 * D * D, &w->attw},
                    {"transformer.h.%lld.attn.c_attn.bias", 3 * D, &w->attb},
                    {"transformer.h.%lld.attn.c_proj.weight", D * D, &w->projw},
                    {"transformer.h.%lld.attn.c_proj.bias", D, &w->projb},
                    {"transformer.h.%lld.ln_2.weight", D, &w->ln2w},
                    {"transformer.h.%lld.ln_2.bias", D, &w->ln2b},
                    {"transformer.h.%lld.mlp.c_fc.weight", 4 * D * D, &w->fcw},
                    {"transformer.h.%lld.mlp.c_fc.bias", 4 * D, &w->fcb},
                    {"transformer.h.%lld.mlp.c_proj.weight", 4 * D * D, &w->fc2w},
                    {"transformer.h.%lld.mlp.c_proj.bias", D, &w->fc2b}};
        for (size_t k = 0; k < sizeof want / sizeof want[0] && st == CT_OK; k++)
            st = weight(model, want[k].fmt, i, want[k].n, want[k].p);
    }
    if (st != CT_OK) {
        ct_gpt_gen_destroy(g);
        return st;
    }
    *out = g;
    return CT_OK;
}

void ct_gpt_gen_destroy(ct_gpt_gen *g)
{
    if (!g) return;
    ct_free(g->L);
    ct_free(g->kc);
    ct_free(g->vc);
    ct_free(g->x);
    ct_free(g->window);
    ct_free(g);
}

/* LayerNorm of x [D] into y, eps 1e-5, statistics in double as the layer's. */
static void layernorm(const float *x, const float *w, const float *b, int64_t D, float *y)
{
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < D; i++) s += x[i];
    double mean = s / (double)D;
    for (int64_t i = 0; i < D; i++) s2 += ((double)x[i] - mean) * ((double)x[i] - mean);
    float rstd = (float)(1.0 / sqrt(s2 / (double)D + 1e-5));
    for (int64_t i = 0; i < D; i++) y[i] = ((float)(x[i] - mean)) * rstd * w[i] + b[i];
}

/* y[n] = W[n, k] x[k] + b (b may be NULL), accumulated into y when acc. */
static ct_status matvec(const float *W, const float *x, const float *b, int64_t n, int64_t k, float *y, int acc)
{
    if (!acc) {
        if (b) memcpy(y, b, sizeof *y * (size_t)n);
        else memset(y, 0, sizeof *y * (size_t)n);
    } else if (b) {
        for (int64_t i = 0; i < n; i++) y[i] += b[i];
    }
    return ct_gemm_f32(CT_GEMM_OPENBLAS, 0, 1, 1, (int)n, (int)k, 1.0f, x, (int)k, W, (int)k, 1.0f, y, (int)n);
}

/* Runs token tok at position g->pos through the model, caching its keys
 * and values; leaves the next token's logits in g->logits. */
static ct_status step(ct_gpt_gen *g, int64_t tok)
{
    const ct_model_config *c = &g->cfg;
    int64_t D = c->dim, H = c->heads, hd = D / H, T = c->context, p = g->pos;
    for (int64_t i = 0; i < D; i++) g->x[i] = g->wte[tok * D + i] + g->wpe[p * D + i];
    float scale = 1.0f / sqrtf((float)hd);
    for (int64_t l = 0; l < c->layers; l++) {
        const layer_w *w = &g->L[l];
        float *kc = g->kc + l * T * D, *vc = g->vc + l * T * D;
        layernorm(g->x, w->ln1w, w->ln1b, D, g->a);
        CT_TRY(matvec(w->attw, g->a, w->attb, 3 * D, D, g->qkv, 0));
        memcpy(kc + p * D, g->qkv + D, sizeof(float) * (size_t)D);
        memcpy(vc + p * D, g->qkv + 2 * D, sizeof(float) * (size_t)D);
        for (int64_t h = 0; h < H; h++) {
            const float *q = g->qkv + h * hd;
            float mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j <= p; j++) {
                float s = 0;
                for (int64_t e = 0; e < hd; e++) s += q[e] * kc[j * D + h * hd + e];
                g->att[j] = s * scale;
                mx = g->att[j] > mx ? g->att[j] : mx;
            }
            for (int64_t j = 0; j <= p; j++) sum += g->att[j] = expf(g->att[j] - mx);
            float *y = g->y + h * hd;
            memset(y, 0, sizeof *y * (size_t)hd);
            for (int64_t j = 0; j <= p; j++) {
                float a = g->att[j] / sum;
                for (int64_t e = 0; e < hd; e++) y[e] += a * vc[j * D + h * hd + e];
            }
        }
        CT_TRY(matvec(w->projw, g->y, w->projb, D, D, g->x, 1));
        layernorm(g->x, w->ln2w, w->ln2b, D, g->a);
        CT_TRY(matvec(w->fcw, g->a, w->fcb, 4 * D, D, g->h, 0));
        for (int64_t i = 0; i < 4 * D; i++) g->h[i] = 0.5f * g->h[i] * (1.0f + erff(g->h[i] * (float)M_SQRT1_2));
        CT_TRY(matvec(w->fc2w, g->h, w->fc2b, D, 4 * D, g->x, 1));
    }
    layernorm(g->x, g->lnfw, g->lnfb, D, g->a);
    CT_TRY(matvec(g->wte, g->a, NULL, c->vocab, D, g->logits, 0)); /* the tied head */
    g->window[p] = tok;
    g->pos = p + 1;
    return CT_OK;
}

ct_status ct_gpt_gen_feed(ct_gpt_gen *g, int64_t token, const float **logits)
{
    const ct_model_config *c = &g->cfg;
    if (token < 0 || token >= c->vocab)
        return ct_error(CT_EINVAL, "generation: token %lld is outside the vocabulary [0, %lld)", (long long)token,
                        (long long)c->vocab);
    if (g->pos == c->context) {
        /* The window slides: positions restart at 0 for its last context - 1 tokens. */
        int64_t keep = c->context - 1;
        memmove(g->window, g->window + 1, sizeof *g->window * (size_t)keep);
        g->pos = 0;
        for (int64_t i = 0; i < keep; i++) CT_TRY(step(g, g->window[i]));
    }
    CT_TRY(step(g, token));
    *logits = g->logits;
    return CT_OK;
}

void ct_gpt_gen_reset(ct_gpt_gen *g) { g->pos = 0; }

int64_t ct_gpt_sample_logits(const float *logits, int64_t vocab, float temperature, int64_t top_k, ct_rng *rng)
{
    /* Temperature 0: the most likely token. */
    int64_t best = 0;
    for (int64_t i = 1; i < vocab; i++)
        if (logits[i] > logits[best]) best = i;
    if (!(temperature > 0)) return best;
    /* The k-th largest logit is the cut (ties at the cut all stay, as torch.topk's threshold does). */
    float cut = -INFINITY;
    if (top_k > 0 && top_k < vocab) {
        float hi = logits[best];
        int64_t above;
        cut = hi;
        for (;;) { /* lower the cut to the next smaller value until k logits are >= it */
            above = 0;
            float next = -INFINITY;
            for (int64_t i = 0; i < vocab; i++) {
                if (logits[i] >= cut) above++;
                else if (logits[i] > next) next = logits[i];
            }
            if (above >= top_k || next == -INFINITY) break;
            cut = next;
        }
    }
    double sum = 0;
    for (int64_t i = 0; i < vocab; i++)
        if (logits[i] >= cut) sum += exp((double)(logits[i] - logits[best]) / temperature);
    float u;
    ct_rng_uniform(rng, &u, 1);
    double r = (double)u * sum, acc = 0;
    int64_t last = best;
    for (int64_t i = 0; i < vocab; i++) {
        if (logits[i] < cut) continue;
        acc += exp((double)(logits[i] - logits[best]) / temperature);
        last = i;
        if (r < acc) return i;
    }
    return last;
}

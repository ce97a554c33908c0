/*
 * The checkpoint metadata string map (ct_meta) and the model config's
 * place in it, so that "ctrain.*" keys alone rebuild the model.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

ct_status ct_meta_set(ct_meta *m, const char *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (!key || !*key) return ct_error(CT_EINVAL, "metadata keys must not be empty");
    if (len < 0) return ct_error(CT_EINVAL, "metadata value for '%s' cannot be formatted", key);
    char *val = ct_alloc((size_t)len + 1, CT_MEM_OTHER);
    if (!val) return CT_ENOMEM;
    va_start(ap, fmt);
    vsnprintf(val, (size_t)len + 1, fmt, ap);
    va_end(ap);
    int i = 0;
    while (i < m->n && strcmp(m->key[i], key)) i++;
    if (i == m->n) {
        size_t kl = strlen(key) + 1;
        char *k = ct_alloc(kl, CT_MEM_OTHER);
        if (m->n == m->cap && k) { /* both arrays grow together; cap changes once both did */
            int c1 = m->cap, c2 = m->cap;
            char **nk = ct_grow(m->key, m->n, &c1, sizeof *nk, CT_MEM_OTHER);
            if (nk) m->key = nk;
            char **nv = nk ? ct_grow(m->val, m->n, &c2, sizeof *nv, CT_MEM_OTHER) : NULL;
            if (nv) {
                m->val = nv;
                m->cap = c2;
            }
        }
        if (!k || m->n == m->cap) {
            ct_free(k);
            ct_free(val);
            return CT_ENOMEM;
        }
        memcpy(k, key, kl);
        m->key[m->n] = k;
        m->val[m->n++] = NULL;
    }
    ct_free(m->val[i]);
    m->val[i] = val;
    return CT_OK;
}

const char *ct_meta_get(const ct_meta *m, const char *key)
{
    for (int i = 0; i < m->n; i++)
        if (!strcmp(m->key[i], key)) return m->val[i];
    return NULL;
}

void ct_meta_arrays(const ct_meta *m, const char **keys, const char **vals)
{
    for (int i = 0; i < m->n; i++) {
        keys[i] = m->key[i];
        vals[i] = m->val[i];
    }
}

ct_status ct_meta_copy(ct_meta *dst, const ct_meta *src)
{
    if (dst == src) return CT_OK;
    ct_meta_fini(dst);
    for (int i = 0; i < src->n; i++)
        if (ct_meta_set(dst, src->key[i], "%s", src->val[i]) != CT_OK) {
            ct_meta_fini(dst);
            return CT_ENOMEM;
        }
    return CT_OK;
}

void ct_meta_fini(ct_meta *m)
{
    for (int i = 0; i < m->n; i++) {
        ct_free(m->key[i]);
        ct_free(m->val[i]);
    }
    ct_free(m->key);
    ct_free(m->val);
    memset(m, 0, sizeof *m);
}

ct_status ct_model_config_to_meta(const ct_model_config *cfg, ct_meta *m)
{
    char in[96] = "", hid[512];
    size_t off = 0;
    for (int i = 0; i < cfg->in_ndim && i < 3; i++)
        off += (size_t)snprintf(in + off, sizeof in - off, "%s%lld", i ? "," : "", (long long)cfg->in[i]);
    CT_TRY(ct_meta_set(m, "ctrain.model", "%s", ct_model_kind_name(cfg->kind)));
    if (cfg->kind == CT_MODEL_GPT) {
        CT_TRY(ct_meta_set(m, "ctrain.layers", "%lld", (long long)cfg->layers));
        CT_TRY(ct_meta_set(m, "ctrain.heads", "%lld", (long long)cfg->heads));
        CT_TRY(ct_meta_set(m, "ctrain.dim", "%lld", (long long)cfg->dim));
        CT_TRY(ct_meta_set(m, "ctrain.context", "%lld", (long long)cfg->context));
        CT_TRY(ct_meta_set(m, "ctrain.vocab", "%lld", (long long)cfg->vocab));
        if (cfg->dropout > 0) CT_TRY(ct_meta_set(m, "ctrain.dropout", "%.9g", (double)cfg->dropout));
        return CT_OK;
    }
    CT_TRY(ct_meta_set(m, "ctrain.in", "%s", in));
    CT_TRY(ct_meta_set(m, "ctrain.hidden", "%s", ct_model_config_hidden_str(cfg, hid, sizeof hid)));
    CT_TRY(ct_meta_set(m, "ctrain.classes", "%lld", (long long)cfg->classes));
    if (cfg->kind == CT_MODEL_CNN) CT_TRY(ct_meta_set(m, "ctrain.kernel", "%d", cfg->kernel));
    if (cfg->batchnorm) CT_TRY(ct_meta_set(m, "ctrain.batchnorm", "1"));
    if (cfg->dropout > 0) CT_TRY(ct_meta_set(m, "ctrain.dropout", "%.9g", (double)cfg->dropout));
    return CT_OK;
}

static ct_status need(const ct_meta *m, const char *key, const char **val)
{
    *val = ct_meta_get(m, key);
    if (!*val)
        return ct_error(CT_EFORMAT, "checkpoint metadata has no '%s', so the model cannot be rebuilt from it "
                        "(was it written by 'ctrain train'?)", key);
    return CT_OK;
}

/* The key's value as a list of positive integers, with the key in the message. */
static ct_status int_list(const ct_meta *m, const char *key, int64_t *out, int max, int *n)
{
    const char *v;
    CT_TRY(need(m, key, &v));
    char what[96];
    snprintf(what, sizeof what, "checkpoint metadata '%s'", key);
    if (ct__parse_int_list(v, out, max, n, what) != CT_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", ct_last_error());
        return ct_error(CT_EFORMAT, "%s", why);
    }
    return CT_OK;
}

ct_status ct_model_config_from_meta(const ct_meta *m, ct_model_config *out)
{
    const char *name;
    CT_TRY(need(m, "ctrain.model", &name));
    ct_model_kind kind;
    if (ct_model_parse_kind(name, &kind) != CT_OK)
        return ct_error(CT_EFORMAT, "checkpoint metadata 'ctrain.model' is '%s'; this ctrain knows: %s", name,
                        ct_model_list());
    ct_model_config c = ct_model_config_default(kind);
    int n, one;
    int64_t v[CT_MODEL_MAX_HIDDEN];
    if (kind == CT_MODEL_GPT) {
        static const char *const keys[5] = {"ctrain.layers", "ctrain.heads", "ctrain.dim", "ctrain.context",
                                            "ctrain.vocab"};
        int64_t g[5];
        for (int i = 0; i < 5; i++) {
            CT_TRY(int_list(m, keys[i], v, 1, &one));
            g[i] = v[0];
        }
        ct_model_config_gpt(&c, g[0], g[1], g[2], g[3], g[4]);
        goto dropout;
    }
    CT_TRY(int_list(m, "ctrain.in", v, 3, &n));
    if (n != c.in_ndim)
        return ct_error(CT_EFORMAT, "checkpoint metadata 'ctrain.in' is '%s'; a %s takes %s", ct_meta_get(m, "ctrain.in"),
                        name, kind == CT_MODEL_MLP ? "one size (784)" : "an image shape C,H,W (1,28,28)");
    memcpy(c.in, v, sizeof(int64_t) * (size_t)n);
    CT_TRY(int_list(m, "ctrain.hidden", c.hidden, CT_MODEL_MAX_HIDDEN, &c.nhidden));
    CT_TRY(int_list(m, "ctrain.classes", v, 1, &one));
    c.classes = v[0];
    if (kind == CT_MODEL_CNN) {
        CT_TRY(int_list(m, "ctrain.kernel", v, 1, &one));
        c.kernel = (int)v[0];
        if (ct_meta_get(m, "ctrain.batchnorm")) { /* absent: none (and from before it existed) */
            CT_TRY(int_list(m, "ctrain.batchnorm", v, 1, &one));
            c.batchnorm = v[0] != 0;
        }
    }
dropout:;
    const char *dv = ct_meta_get(m, "ctrain.dropout");
    if (dv) { /* absent: no dropout (checkpoints from before it existed) */
        char *end;
        c.dropout = strtof(dv, &end);
        if (end == dv || *end)
            return ct_error(CT_EFORMAT, "checkpoint metadata 'ctrain.dropout' is '%s', not a number", dv);
    }
    if (ct_model_config_validate(&c) != CT_OK) {
        char why[400];
        snprintf(why, sizeof why, "%s", ct_last_error());
        return ct_error(CT_EFORMAT, "checkpoint metadata describes a model that cannot be built: %s", why);
    }
    *out = c;
    return CT_OK;
}

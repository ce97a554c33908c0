/*
 * An auto-wrap policy given as a function (PyTorch's auto_wrap_policy and
 * lambda_auto_wrap_policy): the function is asked about every module,
 * children before parents, with the number of trainable parameter elements
 * under it that no unit it chose below holds (PyTorch's nonwrapped_numel),
 * and the modules it picks are written into fsdp's wrap_modules option.
 * The policy is thus evaluated once, into the one mechanism by which fsdp
 * cuts units (fsdp_units.c): the options it returns work with
 * ct_strategy_create, ct_fsdp_plan and ct_strategy_plan alike, and a run
 * wrapped from them is described by its options as every other run is.
 */
#include <string.h>

#include "fsdp.h"

/* Elements of m's own trainable parameters. */
static int64_t own_numel(const ct_module *m)
{
    int64_t n = 0;
    for (int j = 0; j < m->nparams; j++)
        if (m->params[j]->requires_grad) n += m->params[j]->data->numel;
    return n;
}

/* Appends s (len bytes) to the growing text *buf (*len used, *cap room). */
static ct_status append(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (*len + n + 1 > c) c *= 2; /* geometric: a deep model's list in a few copies */
        char *b = ct_alloc(c, CT_MEM_OTHER);
        if (!b) return CT_ENOMEM;
        if (*buf) memcpy(b, *buf, *len);
        ct_free(*buf);
        *buf = b;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return CT_OK;
}

/* 1 if opts (key=value, comma separated) sets key. */
static int has_key(const char *opts, const char *key)
{
    size_t k = strlen(key);
    for (const char *p = opts ? opts : ""; *p;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len > k && !strncmp(p, key, k) && p[k] == '=') return 1;
        p += len + (comma != NULL);
    }
    return 0;
}

ct_status ct_fsdp_auto_wrap(ct_module *model, ct_wrap_policy_fn policy, void *ud, const char *opts, char **out)
{
    *out = NULL;
    if (!model || !policy)
        return ct_error(CT_EINVAL, "ct_fsdp_auto_wrap: %s is NULL; pass the model and a policy function",
                        !model ? "the model" : "the policy");
    if (has_key(opts, "wrap_modules"))
        return ct_error(CT_EINVAL, "ct_fsdp_auto_wrap: the options already set wrap_modules, which the policy "
                        "writes; name those modules from the policy instead");
    ct_module **mods = NULL;
    int nm = 0;
    CT_TRY(ct_module_modules(model, &mods, &nm));
    int64_t *left = ct_alloc_zeroed(sizeof *left * ((size_t)nm + 1), CT_MEM_OTHER); /* nonwrapped_numel */
    char *buf = NULL;
    size_t len = 0, cap = 0;
    ct_status st = left ? CT_OK : CT_ENOMEM;
    if (st == CT_OK && opts && *opts) st = append(&buf, &len, &cap, opts, strlen(opts));
    int picked = 0;
    /* pre-order from ct_module_modules: walking it backwards visits every
     * child before its parent, so a parent's count is final when asked */
    for (int i = nm - 1; st == CT_OK && i >= 0; i--) {
        ct_module *m = mods[i];
        left[i] += own_numel(m);
        int wrap = i > 0 && policy(m, left[i], ud); /* the model is always a unit; it is not asked */
        if (wrap) {
            const char *sep = picked ? "+" : len ? ",wrap_modules=" : "wrap_modules=";
            if ((st = append(&buf, &len, &cap, sep, strlen(sep))) == CT_OK)
                st = append(&buf, &len, &cap, m->fqn, strlen(m->fqn));
            picked++;
        }
        if (i > 0 && !wrap) {
            int p = i - 1;
            while (p >= 0 && mods[p] != m->parent) p--;
            if (p >= 0) left[p] += left[i];
        }
    }
    if (st == CT_OK && !buf) st = append(&buf, &len, &cap, "", 0); /* nothing picked, no options: "" */
    ct_free(left);
    ct_free(mods);
    if (st != CT_OK) {
        ct_free(buf);
        return st;
    }
    *out = buf;
    return CT_OK;
}

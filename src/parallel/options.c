/*
 * Strategy options as "key=value" text.  Each strategy kind lists its keys
 * in a table (type, where the value goes, default, help); the keys every
 * strategy takes are in the common table here.  Parsing fills defaults
 * first, then the given pairs in order (a later pair wins), and keeps the
 * text of every value so ct_strategy_opt can answer "what did you use".
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define DT(x) (1u << (x))

static const ct__opt_def common_opts[] = {
    {"grad_accum", CT__OPT_INT, offsetof(ct__common, grad_accum), "1",
     "micro-batches per train step (gradient accumulation)", 0, NULL},
    {"param_dtype", CT__OPT_DTYPE, offsetof(ct__common, param_dtype), "f32",
     "dtype of the parameters' compute copies (bf16: mixed precision, f32 master weights)",
     DT(CT_F32) | DT(CT_BF16), NULL},
    {"reduce_dtype", CT__OPT_DTYPE, offsetof(ct__common, reduce_dtype), "f32",
     "dtype gradients are reduced in across ranks", DT(CT_F32) | DT(CT_BF16) | DT(CT_F16), NULL},
    {"buffer_dtype", CT__OPT_DTYPE, offsetof(ct__common, buffer_dtype), "f32",
     "precision buffers (batchnorm running statistics) are held at (PyTorch's MixedPrecision.buffer_dtype; "
     "none, ddp, zero1, zero2, fsdp)", DT(CT_F32) | DT(CT_BF16), NULL},
    {"sync_batchnorm", CT__OPT_BOOL, offsetof(ct__common, sync_batchnorm), "0",
     "batchnorm statistics over the whole batch of every rank (SyncBatchNorm; ddp, zero1, zero2, fsdp)", 0, NULL},
    {"alloc_cache_mb", CT__OPT_AUTO_COUNT, offsetof(ct__common, alloc_cache_mb), "auto",
     "bound in MiB of the allocator's cache of freed blocks, for the process (0: off); auto: 4 x the largest "
     "bucket, unit or slice, at least 64, and past it what fits under the process's high-water mark, unless "
     "CTRAIN_ALLOC_CACHE_MB sets one", 0, NULL},
};
#define NCOMMON ((int)(sizeof common_opts / sizeof common_opts[0]))

static int parse_dtype(const char *v, int *dt)
{
    static const struct { const char *name; ct_dtype dt; } names[] = {
        {"f32", CT_F32}, {"fp32", CT_F32}, {"float32", CT_F32}, {"bf16", CT_BF16},
        {"bfloat16", CT_BF16}, {"f16", CT_F16}, {"fp16", CT_F16}, {"float16", CT_F16}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(v, names[i].name)) {
            *dt = (int)names[i].dt;
            return 0;
        }
    return -1;
}

static ct_status set_value(const char *kind, const ct__opt_def *d, void *base, const char *v)
{
    char *end;
    void *dst = (char *)base + d->off;
    errno = 0;
    switch (d->type) {
    case CT__OPT_AUTO_INT: {
        if (!strcmp(v, "auto")) {
            *(int *)dst = 0;
            return CT_OK;
        }
        long long x = strtoll(v, &end, 10);
        if (end == v || *end || errno || x < 1 || x > 1 << 30)
            return ct_error(CT_EINVAL, "%s option %s=%s: expected auto or a whole number from 1", kind, d->key, v);
        *(int *)dst = (int)x;
        return CT_OK;
    }
    case CT__OPT_AUTO_COUNT: {
        if (!strcmp(v, "auto")) {
            *(int64_t *)dst = -1;
            return CT_OK;
        }
        long long x = strtoll(v, &end, 10);
        if (end == v || *end || errno || x < 0 || x > (long long)1 << 40)
            return ct_error(CT_EINVAL, "%s option %s=%s: expected auto or a whole number from 0", kind, d->key, v);
        *(int64_t *)dst = x;
        return CT_OK;
    }
    case CT__OPT_INT:
    case CT__OPT_COUNT: {
        long long x = strtoll(v, &end, 10), lo = d->type == CT__OPT_INT;
        if (end == v || *end || errno || x < lo || x > (long long)1 << 40)
            return ct_error(CT_EINVAL, "%s option %s=%s: expected a whole number from %lld", kind, d->key, v, lo);
        if (d->type == CT__OPT_COUNT) *(int64_t *)dst = x;
        else if (x > 1 << 30) return ct_error(CT_EINVAL, "%s option %s=%s: at most %d", kind, d->key, v, 1 << 30);
        else *(int *)dst = (int)x;
        return CT_OK;
    }
    case CT__OPT_CHOICE: {
        size_t len = strlen(v);
        int idx = 0;
        for (const char *c = d->choices; *c; idx++) {
            const char *bar = strchr(c, '|');
            size_t w = bar ? (size_t)(bar - c) : strlen(c);
            if (w == len && !strncmp(c, v, len)) {
                *(int *)dst = idx;
                return CT_OK;
            }
            c += w + (bar != NULL);
        }
        return ct_error(CT_EINVAL, "%s option %s=%s: expected one of %s", kind, d->key, v, d->choices);
    }
    case CT__OPT_TEXT:
        return CT_OK; /* kept as text (ct_strategy_opt) */
    case CT__OPT_AUTO_NUM:
    case CT__OPT_NUM: {
        int autos = d->type == CT__OPT_AUTO_NUM;
        if (autos && !strcmp(v, "auto")) {
            *(double *)dst = 0;
            return CT_OK;
        }
        double x = strtod(v, &end);
        if (end == v || *end || !isfinite(x) || x <= 0)
            return ct_error(CT_EINVAL, "%s option %s=%s: expected %sa positive number", kind, d->key, v,
                            autos ? "auto or " : "");
        *(double *)dst = x;
        return CT_OK;
    }
    case CT__OPT_BOOL:
        if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "on")) *(int *)dst = 1;
        else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "off")) *(int *)dst = 0;
        else return ct_error(CT_EINVAL, "%s option %s=%s: expected 1 or 0 (true/false, on/off)", kind, d->key, v);
        return CT_OK;
    case CT__OPT_DTYPE: {
        int dt;
        if (parse_dtype(v, &dt) || !(d->dtypes & DT(dt))) {
            char allowed[64] = "";
            for (int t = 0; t < CT_NDTYPE; t++)
                if (d->dtypes & DT(t))
                    snprintf(allowed + strlen(allowed), sizeof allowed - strlen(allowed), "%s%s",
                             allowed[0] ? ", " : "", t == CT_F32 ? "f32" : t == CT_BF16 ? "bf16" : "f16");
            return ct_error(CT_EINVAL, "%s option %s=%s: expected one of %s", kind, d->key, v, allowed);
        }
        *(int *)dst = dt;
        return CT_OK;
    }
    }
    return ct_error(CT_EINVAL, "%s option %s: unknown type", kind, d->key);
}

/* Remembers the text of key's value (replacing an earlier one). */
static ct_status keep_text(ct_strategy *s, const char *key, const char *v)
{
    int i = 0;
    while (i < s->nopt_text && strcmp(s->opt_keys[i], key)) i++;
    if (i == (int)(sizeof s->opt_keys / sizeof s->opt_keys[0]))
        return ct_error(CT_EINVAL, "too many strategy options");
    size_t len = strlen(v) + 1;
    char *copy = ct_alloc(len, CT_MEM_OTHER);
    if (!copy) return CT_ENOMEM;
    memcpy(copy, v, len);
    if (i == s->nopt_text) s->nopt_text++;
    else ct_free(s->opt_text[i]);
    s->opt_keys[i] = key;
    s->opt_text[i] = copy;
    return CT_OK;
}

/* The definition of key and (*where) whose struct its offset is in. */
enum { IN_OWN, IN_COMMON, IN_BASE };
static const ct__opt_def *find(const ct__strategy_ops *ops, const char *key, int *where)
{
    for (int i = 0; i < NCOMMON; i++)
        if (!strcmp(common_opts[i].key, key)) {
            *where = IN_COMMON;
            return &common_opts[i];
        }
    for (int i = 0; i < ops->nbase_opts; i++)
        if (!strcmp(ops->base_opts[i].key, key)) {
            *where = IN_BASE;
            return &ops->base_opts[i];
        }
    for (int i = 0; i < ops->nopts; i++)
        if (!strcmp(ops->opts[i].key, key)) {
            *where = IN_OWN;
            return &ops->opts[i];
        }
    return NULL;
}

/* Key i of ops in listing order: common, base, own. */
static const ct__opt_def *nth(const ct__strategy_ops *ops, int i)
{
    if (i < NCOMMON) return &common_opts[i];
    i -= NCOMMON;
    if (i < ops->nbase_opts) return &ops->base_opts[i];
    return &ops->opts[i - ops->nbase_opts];
}

static int nkeys(const ct__strategy_ops *ops) { return NCOMMON + ops->nbase_opts + ops->nopts; }

static void key_list(const ct__strategy_ops *ops, char *buf, size_t n)
{
    size_t off = 0;
    buf[0] = 0;
    for (int i = 0; i < nkeys(ops) && off < n; i++)
        off += (size_t)snprintf(buf + off, n - off, "%s%s", i ? ", " : "", nth(ops, i)->key);
}

static ct_status apply(ct_strategy *s, const char *key, const char *val)
{
    int where;
    const ct__opt_def *d = find(s->ops, key, &where);
    if (!d && ct__local_sgd_key(key))
        return ct_error(CT_EINVAL, "strategy %s has no option '%s': post-local SGD and model averaging are ddp's "
                        "alone (its replicas train apart between averagings, which %s's own synchronisation "
                        "cannot); use --strategy ddp", s->ops->kind, key, s->ops->kind);
    if (!d) {
        char keys[512];
        key_list(s->ops, keys, sizeof keys);
        return ct_error(CT_EINVAL, "strategy %s has no option '%s'; its options are: %s", s->ops->kind, key, keys);
    }
    void *dst = where == IN_COMMON ? (void *)&s->common
              : where == IN_BASE  ? (void *)((char *)s->kopts + s->ops->base_off) : s->kopts;
    CT_TRY(set_value(s->ops->kind, d, dst, val));
    return keep_text(s, d->key, val);
}

ct_status ct__opts_set_text(ct_strategy *s, const char *key, const char *value)
{
    int where;
    const ct__opt_def *d = find(s->ops, key, &where);
    if (!d) return ct_error(CT_EINVAL, "strategy %s has no option '%s'", s->ops->kind, key);
    return keep_text(s, d->key, value);
}

ct_status ct__opts_parse(ct_strategy *s, const char *text)
{
    if (s->ops->opts_size && !(s->kopts = ct_alloc(s->ops->opts_size, CT_MEM_OTHER))) return CT_ENOMEM;
    if (s->kopts) memset(s->kopts, 0, s->ops->opts_size);
    memset(&s->common, 0, sizeof s->common);
    for (int i = 0; i < nkeys(s->ops); i++) CT_TRY(apply(s, nth(s->ops, i)->key, nth(s->ops, i)->def));
    if (!text) return CT_OK;
    /* one pair at a time, as long as it is (a wrap_modules list of a deep
     * model, as ct_fsdp_auto_wrap writes it, runs to kilobytes) */
    char *pair = ct_alloc(strlen(text) + 1, CT_MEM_OTHER);
    if (!pair) return CT_ENOMEM;
    ct_status st = CT_OK;
    for (const char *p = text; *p && st == CT_OK;) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        memcpy(pair, p, len);
        pair[len] = 0;
        p += len + (comma != NULL);
        if (!len) continue;
        char *eq = strchr(pair, '=');
        if (!eq || eq == pair) {
            st = ct_error(CT_EINVAL, "strategy option '%s' is not key=value (e.g. bucket_cap_mb=50)", pair);
            break;
        }
        *eq = 0;
        st = apply(s, pair, eq + 1);
    }
    ct_free(pair);
    return st;
}

void ct__opts_free(ct_strategy *s)
{
    for (int i = 0; i < s->nopt_text; i++) ct_free(s->opt_text[i]);
    s->nopt_text = 0;
    ct_free(s->kopts);
    s->kopts = NULL;
}

const char *ct_strategy_opt(const ct_strategy *s, const char *key)
{
    for (int i = 0; i < s->nopt_text; i++)
        if (!strcmp(s->opt_keys[i], key)) return s->opt_text[i];
    return NULL;
}

void ct__opts_help(const ct__strategy_ops *ops, char *buf, size_t n)
{
    size_t off = 0;
    buf[0] = 0;
    for (int i = 0; i < nkeys(ops) && off < n; i++) {
        const ct__opt_def *d = nth(ops, i);
        char kv[64];
        snprintf(kv, sizeof kv, "%s=%s", d->key, d->def);
        off += (size_t)snprintf(buf + off, n - off, "  %-28s %s\n", kv, d->help);
    }
}

ct_status ct__parse_balance(const char *what, const char *text, int nkids, int **out, int *n)
{
    *out = NULL;
    *n = 0;
    int cap = 1;
    long total = 0;
    for (const char *c = text; *c; c++) cap += *c == ':' || *c == ',';
    int *b = ct_alloc(sizeof *b * (size_t)cap, CT_MEM_OTHER);
    if (!b) return CT_ENOMEM;
    for (const char *p = text; *p;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || (*end && *end != ':' && *end != ',')) {
            ct_free(b);
            return ct_error(CT_EINVAL, "%s balance '%s': '%s' is not a whole number; give children per stage "
                            "as 3:3:2", what, text, p);
        }
        if (v <= 0 || v > 1000000000) {
            ct_free(b);
            return ct_error(CT_EINVAL, "all balance numbers must be positive integers (balance: %s has %ld); every "
                            "stage holds at least one layer", text, v);
        }
        b[(*n)++] = (int)v;
        total += v;
        p = *end ? end + 1 : end;
    }
    if (nkids > 0 && *n && total != nkids) {
        ct_free(b);
        *n = 0;
        return ct_error(CT_EINVAL, "%s balance '%s' sums to %ld but the model has %d children; make the counts "
                        "add up to %d", what, text, total, nkids, nkids);
    }
    *out = b;
    return CT_OK;
}

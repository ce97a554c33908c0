/*
 * Model configurations: names, defaults, the --hidden list, validation, the
 * input shape a model takes, and ct_model_build, which dispatches to the
 * builders and initialises the weights.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static const char *const kind_names[CT_NMODELS] = {"mlp", "cnn", "gpt"};

const char *ct_model_list(void) { return "mlp, cnn, gpt"; }

const char *ct_model_kind_name(ct_model_kind kind)
{
    return kind >= 0 && kind < CT_NMODELS ? kind_names[kind] : "?";
}

ct_status ct_model_parse_kind(const char *name, ct_model_kind *kind)
{
    for (int i = 0; name && i < CT_NMODELS; i++)
        if (!strcmp(name, kind_names[i])) {
            *kind = (ct_model_kind)i;
            return CT_OK;
        }
    return ct_error(CT_EINVAL, "unknown model '%s'; choose one of: %s", name ? name : "(null)",
                    ct_model_list());
}

ct_model_config ct_model_config_default(ct_model_kind kind)
{
    ct_model_config c;
    memset(&c, 0, sizeof c);
    c.kind = kind;
    c.classes = 10;
    if (kind == CT_MODEL_GPT) {
        c.in_ndim = 1;
        ct_model_config_gpt(&c, 4, 4, 256, 128, 256);
    } else if (kind == CT_MODEL_CNN) {
        c.in_ndim = 3;
        c.in[0] = 1;
        c.in[1] = 28;
        c.in[2] = 28;
        c.nhidden = 3;
        c.hidden[0] = 16;
        c.hidden[1] = 32;
        c.hidden[2] = 128;
        c.kernel = 3;
    } else {
        c.in_ndim = 1;
        c.in[0] = 784;
        c.nhidden = 2;
        c.hidden[0] = 256;
        c.hidden[1] = 128;
    }
    return c;
}

void ct_model_config_gpt(ct_model_config *cfg, int64_t layers, int64_t heads, int64_t dim, int64_t context,
                         int64_t vocab)
{
    cfg->layers = layers;
    cfg->heads = heads;
    cfg->dim = dim;
    cfg->context = context;
    cfg->vocab = vocab;
    cfg->in[0] = context;
    cfg->classes = vocab;
}

ct_status ct__parse_int_list(const char *list, int64_t *out, int max, int *n, const char *what)
{
    int k = 0;
    const char *p = list;
    if (!list || !*list)
        return ct_error(CT_EINVAL, "%s is empty; give comma-separated positive integers such as 256,128", what);
    for (;;) {
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        int len = (int)strcspn(p, ",");
        if (end != p && (!*end || *end == ',') && ((errno == ERANGE && v > 0) || v > (1LL << 31)))
            return ct_error(CT_EINVAL, "%s '%s': '%.*s' is too large: a size is at most %lld", what, list, len, p,
                            1LL << 31);
        if (end == p || (*end && *end != ',') || errno || v <= 0)
            return ct_error(CT_EINVAL, "%s '%s': '%.*s' is not a positive integer; give comma-separated "
                            "sizes such as 256,128", what, list, len, p);
        if (k == max)
            return ct_error(CT_EINVAL, "%s '%s' has more than %d entries", what, list, max);
        out[k++] = v;
        if (!*end) break;
        p = end + 1;
    }
    *n = k;
    return CT_OK;
}

ct_status ct_model_config_parse_hidden(ct_model_config *cfg, const char *list)
{
    int64_t v[CT_MODEL_MAX_HIDDEN];
    int n = 0;
    CT_TRY(ct__parse_int_list(list, v, CT_MODEL_MAX_HIDDEN, &n, "hidden sizes"));
    cfg->nhidden = n;
    memcpy(cfg->hidden, v, sizeof(int64_t) * (size_t)n);
    return CT_OK;
}

char *ct_model_config_hidden_str(const ct_model_config *cfg, char *buf, size_t n)
{
    size_t off = 0;
    if (n) buf[0] = 0;
    for (int i = 0; i < cfg->nhidden && off < n; i++)
        off += (size_t)snprintf(buf + off, n - off, "%s%lld", i ? "," : "", (long long)cfg->hidden[i]);
    return buf;
}

ct_status ct_model_config_validate(const ct_model_config *cfg)
{
    if (cfg->kind < 0 || cfg->kind >= CT_NMODELS)
        return ct_error(CT_EINVAL, "unknown model kind %d; choose one of: %s", (int)cfg->kind, ct_model_list());
    if (cfg->classes < 1) return ct_error(CT_EINVAL, "model has %lld classes; it needs at least 1",
                                          (long long)cfg->classes);
    if (cfg->nhidden < 0 || cfg->nhidden > CT_MODEL_MAX_HIDDEN)
        return ct_error(CT_EINVAL, "model has %d hidden sizes; at most %d are allowed", cfg->nhidden,
                        CT_MODEL_MAX_HIDDEN);
    for (int i = 0; i < cfg->nhidden; i++)
        if (cfg->hidden[i] < 1)
            return ct_error(CT_EINVAL, "hidden size %d is %lld; sizes must be positive", i + 1,
                            (long long)cfg->hidden[i]);
    if (!(cfg->dropout >= 0 && cfg->dropout < 1))
        return ct_error(CT_EINVAL, "dropout %g must be in [0, 1)", (double)cfg->dropout);
    if (cfg->dropout > 0 && cfg->kind == CT_MODEL_CNN)
        return ct_error(CT_EINVAL, "dropout applies to the mlp and the gpt only (the cnn has none)");
    if (cfg->batchnorm && cfg->kind != CT_MODEL_CNN)
        return ct_error(CT_EINVAL, "batchnorm applies to the cnn only (the mlp has none; the gpt has LayerNorm)");
    if (cfg->kind == CT_MODEL_GPT) return ct__gpt_validate(cfg);
    if (cfg->kind == CT_MODEL_MLP) {
        if (cfg->in_ndim != 1 || cfg->in[0] < 1)
            return ct_error(CT_EINVAL, "mlp input must be one positive size (features per sample)");
        return CT_OK;
    }
    if (cfg->in_ndim != 3 || cfg->in[0] < 1 || cfg->in[1] < 1 || cfg->in[2] < 1)
        return ct_error(CT_EINVAL, "cnn input must be an image shape C,H,W of positive sizes");
    if (cfg->nhidden < 2)
        return ct_error(CT_EINVAL, "cnn hidden sizes are the conv channels then the fully connected width "
                        "(for example 16,32,128); %d given", cfg->nhidden);
    if (cfg->kernel < 1 || cfg->kernel % 2 == 0)
        return ct_error(CT_EINVAL, "cnn kernel size %d must be odd and positive (padding k/2 keeps the size)",
                        cfg->kernel);
    int nconv = cfg->nhidden - 1;
    if (nconv >= 62 || (cfg->in[1] >> nconv) < 1 || (cfg->in[2] >> nconv) < 1)
        return ct_error(CT_EINVAL, "cnn with %d conv layers halves a %lldx%lld image to nothing; use fewer "
                        "conv sizes in the hidden list", nconv, (long long)cfg->in[1], (long long)cfg->in[2]);
    return CT_OK;
}

int64_t ct_model_input_numel(const ct_model_config *cfg)
{
    int64_t n = 1;
    for (int i = 0; i < cfg->in_ndim; i++) n *= cfg->in[i];
    return n;
}

uint64_t ct_model_sample_bytes(const ct_model_config *cfg)
{
    if (cfg->kind == CT_MODEL_GPT) return (uint64_t)cfg->context * 16;
    return (uint64_t)ct_model_input_numel(cfg) * 4 + 4;
}

int ct_model_input_shape(const ct_model_config *cfg, int64_t n, int64_t *shape)
{
    shape[0] = n;
    for (int i = 0; i < cfg->in_ndim; i++) shape[1 + i] = cfg->in[i];
    return 1 + cfg->in_ndim;
}

ct_status ct__seq_push(ct_module *seq, ct_module *kid)
{
    if (!kid) {
        /* The constructor's own message says what was wrong. */
        char why[256];
        snprintf(why, sizeof why, "%s", ct_last_error());
        return ct_error(CT_ENOMEM, "building layer %d failed: %s", seq->nkids, *why ? why : "out of memory");
    }
    return ct_module_add(seq, NULL, kid); /* frees kid on failure */
}

ct_status ct_model_build(const ct_model_config *cfg, uint64_t seed, ct_module **out)
{
    ct_mem_phase_begin(CT_PHASE_BUILD);
    *out = NULL;
    CT_TRY(ct_model_config_validate(cfg));
    ct_module *m = NULL;
    if (cfg->kind == CT_MODEL_GPT) {
        CT_TRY(ct__gpt_build(cfg, &m));
        ct__gpt_init(m, cfg, seed);
        *out = m;
        return CT_OK;
    }
    CT_TRY(cfg->kind == CT_MODEL_MLP ? ct__mlp_build(cfg, &m) : ct__cnn_build(cfg, &m));
    ct_module_init_params(m, seed);
    *out = m;
    return CT_OK;
}

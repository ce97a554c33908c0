/*
 * Data sets the program trains and evaluates on, by name, and batches
 * shaped for a model: Fashion-MNIST images, and byte-level text for the gpt.
 */
#include <string.h>

#include "cli.h"

ct_status cli_load_data(const char *name, const char *dir, int train, int64_t limit, ct_dataset *out)
{
    memset(out, 0, sizeof *out);
    if (strcmp(name, "fashion-mnist"))
        return ct_error(CT_EINVAL, "unknown data set '%s'; this ctrain knows: fashion-mnist", name);
    CT_TRY(ct_fashion_mnist_load(dir, train, out));
    if (limit > 0 && limit < out->n) {
        /* Views of the first limit samples: the rest of the file stays loaded but unused. */
        int64_t xs[4] = {limit, out->images->shape[1], out->images->shape[2], out->images->shape[3]};
        ct_tensor *x = ct_tensor_view(out->images, 0, 4, xs);
        ct_tensor *y = ct_tensor_view(out->labels, 0, 1, &limit);
        if (!x || !y) {
            ct_tensor_release(x);
            ct_tensor_release(y);
            ct_dataset_fini(out);
            return CT_ENOMEM;
        }
        ct_tensor_release(out->images);
        ct_tensor_release(out->labels);
        out->images = x;
        out->labels = y;
        out->n = limit;
    }
    return CT_OK;
}

const char *cli_data_default(const ct_model_config *cfg)
{
    return cfg->kind == CT_MODEL_GPT ? "fortunes" : "fashion-mnist";
}

ct_status cli_check_data_kind(const ct_model_config *cfg, const char *data)
{
    if (strcmp(data, "fashion-mnist") && strcmp(data, "fortunes"))
        return ct_error(CT_EINVAL, "unknown data set '%s'; this ctrain knows: fashion-mnist, fortunes", data);
    if ((cfg->kind == CT_MODEL_GPT) != !strcmp(data, "fortunes"))
        return ct_error(CT_EINVAL, "--data %s does not suit the %s: the gpt reads text (fortunes), the mlp and cnn "
                        "images (fashion-mnist)", data, ct_model_kind_name(cfg->kind));
    return CT_OK;
}

ct_status cli_load_text(const ct_model_config *cfg, const char *dir, ct_text *out)
{
    CT_TRY(ct_text_load(dir, out));
    ct_status st = ct_text_check(out, cfg->context);
    if (st == CT_OK && cfg->vocab < 256)
        st = ct_error(CT_EINVAL, "the gpt has a vocabulary of %lld but text is read as bytes (256 tokens); use "
                      "--vocab 256", (long long)cfg->vocab);
    if (st != CT_OK) ct_text_fini(out);
    return st;
}

ct_status cli_check_input(const ct_model_config *cfg, const ct_dataset *ds)
{
    int64_t per = ds->images->numel / (ds->n ? ds->n : 1);
    if (ct_model_input_numel(cfg) != per)
        return ct_error(CT_EINVAL, "the %s takes %lld inputs per sample but the data has %lld (%lldx%lld images); "
                        "build the model for this data set",
                        ct_model_kind_name(cfg->kind), (long long)ct_model_input_numel(cfg), (long long)per,
                        (long long)ds->rows, (long long)ds->cols);
    if (cfg->classes < ds->nclasses)
        return ct_error(CT_EINVAL, "the model has %lld classes but the data has %d", (long long)cfg->classes,
                        ds->nclasses);
    return CT_OK;
}

ct_status cli_batch(const ct_dataset *ds, const ct_model_config *cfg, const int64_t *idx, int64_t n,
                    ct_tensor **x, ct_tensor **y)
{
    ct_tensor *raw;
    CT_TRY(ct_dataset_gather(ds, idx, n, &raw, y));
    int64_t shape[4];
    int nd = ct_model_input_shape(cfg, n, shape);
    *x = ct_tensor_reshape(raw, nd, shape);
    ct_tensor_release(raw);
    if (!*x) {
        ct_tensor_release(*y);
        *y = NULL;
        return CT_ENOMEM;
    }
    return CT_OK;
}

/*
 * The multi-layer perceptron: Linear and ReLU alternating, numbered as
 * torch.nn.Sequential numbers them, so Linear i sits at index 2*i (3*i with
 * a Dropout after every ReLU).
 */
#include "internal.h"

ct_status ct__mlp_build(const ct_model_config *cfg, ct_module **out)
{
    *out = NULL;
    ct_module *seq = ct_sequential_create();
    if (!seq) return CT_ENOMEM;
    int64_t width = cfg->in[0];
    ct_status st = CT_OK;
    for (int i = 0; i <= cfg->nhidden && st == CT_OK; i++) {
        int64_t next = i < cfg->nhidden ? cfg->hidden[i] : cfg->classes;
        st = ct__seq_push(seq, ct_linear_create(width, next, 1));
        if (st == CT_OK && i < cfg->nhidden) st = ct__seq_push(seq, ct_relu_create());
        if (st == CT_OK && i < cfg->nhidden && cfg->dropout > 0) st = ct__seq_push(seq, ct_dropout_create(cfg->dropout));
        width = next;
    }
    if (st != CT_OK) {
        ct_module_destroy(seq);
        return st;
    }
    *out = seq;
    return CT_OK;
}

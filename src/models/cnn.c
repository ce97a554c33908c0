/*
 * The LeNet-style convolutional network: for each conv width c_i,
 * Conv2d(k, padding k/2) + ReLU + MaxPool2d(2), then Flatten, a hidden
 * Linear + ReLU and the classifier Linear, numbered as torch.nn.Sequential
 * numbers them.  Padding k/2 keeps H and W through a conv; each pool halves
 * them (rounding down, as PyTorch does).  With batchnorm each conv is
 * Conv2d(bias=False) + BatchNorm2d, so the Sequential numbers 4 children
 * per conv layer.
 */
#include "internal.h"

ct_status ct__cnn_build(const ct_model_config *cfg, ct_module **out)
{
    *out = NULL;
    ct_module *seq = ct_sequential_create();
    if (!seq) return CT_ENOMEM;
    int nconv = cfg->nhidden - 1, k = cfg->kernel;
    int64_t c = cfg->in[0], h = cfg->in[1], w = cfg->in[2];
    ct_status st = CT_OK;
    for (int i = 0; i < nconv && st == CT_OK; i++) {
        st = ct__seq_push(seq, ct_conv2d_create(c, cfg->hidden[i], k, 1, k / 2, !cfg->batchnorm));
        if (st == CT_OK && cfg->batchnorm) st = ct__seq_push(seq, ct_batchnorm_create(cfg->hidden[i], 1e-5f, 0.1f));
        if (st == CT_OK) st = ct__seq_push(seq, ct_relu_create());
        if (st == CT_OK) st = ct__seq_push(seq, ct_maxpool2d_create(2, 2));
        c = cfg->hidden[i];
        h /= 2;
        w /= 2;
    }
    int64_t fc = cfg->hidden[nconv];
    if (st == CT_OK) st = ct__seq_push(seq, ct_flatten_create());
    if (st == CT_OK) st = ct__seq_push(seq, ct_linear_create(c * h * w, fc, 1));
    if (st == CT_OK) st = ct__seq_push(seq, ct_relu_create());
    if (st == CT_OK) st = ct__seq_push(seq, ct_linear_create(fc, cfg->classes, 1));
    if (st != CT_OK) {
        ct_module_destroy(seq);
        return st;
    }
    *out = seq;
    return CT_OK;
}

/* The cnn with --batchnorm against the same nn.Sequential in PyTorch
 * (scripts/cnn_bn_ref.py): three SGD steps in training mode, then every
 * weight and running statistic within 1e-5.  One process on the global
 * batch is what SyncBatchNorm computes over ranks (mpi/test_syncbn.c shows
 * N ranks equal it), so this pins ctrain's SyncBatchNorm to PyTorch's
 * numbers.  Skipped, and counted as skipped, when /usr/bin/python3 has no
 * torch (tests run from the repository root). */
#include <unistd.h>

#include "cli_util.h"

#define PY "/usr/bin/python3"
#define SCRIPT "scripts/cnn_bn_ref.py"
#define STEPS 3
#define N 6

TEST(cnn_batchnorm_equals_pytorch)
{
    if (access(PY, X_OK) != 0 || access(SCRIPT, R_OK) != 0) SKIP("needs %s and %s", PY, SCRIPT);
    ct_model_config c = ct_model_config_default(CT_MODEL_CNN);
    c.in[1] = c.in[2] = 8;
    c.nhidden = 3;
    c.hidden[0] = 3, c.hidden[1] = 4, c.hidden[2] = 10;
    c.classes = 5;
    c.batchnorm = 1;
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 5, &m));
    ct_param **ps, **bs;
    int np, nb;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    ASSERT_OK(ct_module_buffers(m, &bs, &nb));
    ASSERT_EQ(nb, 6); /* two batchnorms' running_mean, running_var, num_batches_tracked */
    /* the state, then the batches */
    const char *names[64];
    ct_tensor *ts[64];
    char bn[2 * STEPS][16];
    int n = 0;
    for (int i = 0; i < np; i++) names[n] = ps[i]->name, ts[n++] = ps[i]->data;
    for (int i = 0; i < nb; i++) names[n] = bs[i]->name, ts[n++] = bs[i]->data;
    ct_tensor *x[STEPS], *y[STEPS];
    for (int s = 0; s < STEPS; s++) {
        x[s] = ct_tensor_create(CT_F32, 4, (int64_t[]){N, 1, 8, 8}, CT_MEM_ACT);
        y[s] = ct_tensor_create(CT_I32, 1, (int64_t[]){N}, CT_MEM_ACT);
        ct_rng r;
        ct_rng_init(&r, 9, (uint64_t)s);
        ct_rng_normal(&r, ct_f32(x[s]), N * 64, 0.3f, 2.0f);
        for (int i = 0; i < N; i++) ((int32_t *)ct_tensor_data(y[s]))[i] = (i * 2 + s) % 5;
        snprintf(bn[2 * s], 16, "__x%d", s);
        snprintf(bn[2 * s + 1], 16, "__y%d", s);
        names[n] = bn[2 * s], ts[n++] = x[s];
        names[n] = bn[2 * s + 1], ts[n++] = y[s];
    }
    ct_meta meta = {0};
    ASSERT_OK(ct_model_config_to_meta(&c, &meta));
    ASSERT_OK(ct_meta_set(&meta, "ref.steps", "%d", STEPS));
    ASSERT_OK(ct_meta_set(&meta, "ref.lr", "0.1"));
    const char *mk[64], *mv[64];
    ASSERT(meta.n <= 64);
    ct_meta_arrays(&meta, mk, mv);
    ASSERT_OK(ct_safetensors_save(path_in("in.safetensors"), names, ts, n, mk, mv, meta.n));
    ct_meta_fini(&meta);
    static char out[OUT_MAX];
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s %s '%s' '%s' 2>&1", PY, SCRIPT, path_in("in.safetensors"), path_in("out.safetensors"));
    int rc = capture(cmd, out);
    if (rc == 3) {
        for (int s = 0; s < STEPS; s++) ct_tensor_release(x[s]), ct_tensor_release(y[s]);
        ct_free(ps);
        ct_free(bs);
        ct_module_destroy(m);
        SKIP("%s cannot import torch", PY);
    }
    if (rc) ct_test_fail(__FILE__, __LINE__, "%s failed (%d): %s", SCRIPT, rc, out);

    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    oo.lr = 0.1;
    ct_optim *opt = ct_optim_create(&oo, ps, np);
    ASSERT(opt);
    ct_fwd_ctx ctx = {.training = 1, .seed = 1};
    for (int s = 0; s < STEPS; s++) {
        ct_tensor *z, *dz;
        ct_record *rec;
        float loss;
        ct_module_zero_grad(m);
        ASSERT_OK(ct_module_forward(m, x[s], &z, &rec, &ctx));
        ASSERT_OK(ct_cross_entropy(z, y[s], -100, &loss, &dz));
        ASSERT_OK(ct_module_backward(m, dz, NULL, rec));
        ASSERT_OK(ct_optim_step(opt));
        ct_tensor_release(z);
        ct_tensor_release(dz);
    }
    ct_safetensors *ref;
    ASSERT_OK(ct_safetensors_load(path_in("out.safetensors"), &ref));
    ASSERT_EQ(ct_safetensors_count(ref), np + nb);
    for (int i = 0; i < np + nb; i++) {
        ct_param *p = i < np ? ps[i] : bs[i - np];
        ct_tensor *r = ct_safetensors_find(ref, p->name);
        if (!r) ct_test_fail(__FILE__, __LINE__, "PyTorch has no %s", p->name);
        ASSERT_EQ(r->numel, p->data->numel);
        for (int64_t k = 0; k < r->numel; k++)
            if (!(fabs((double)ct_f32(p->data)[k] - ct_f32(r)[k]) <= 1e-5 * (1 + fabs((double)ct_f32(r)[k]))))
                ct_test_fail(__FILE__, __LINE__, "%s[%lld] is %.8g, PyTorch's %.8g", p->name, (long long)k,
                             (double)ct_f32(p->data)[k], (double)ct_f32(r)[k]);
    }
    ct_safetensors_destroy(ref);
    ct_optim_destroy(opt);
    for (int s = 0; s < STEPS; s++) ct_tensor_release(x[s]), ct_tensor_release(y[s]);
    ct_free(ps);
    ct_free(bs);
    ct_module_destroy(m);
}

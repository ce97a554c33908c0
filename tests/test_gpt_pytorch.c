/* A tiny gpt against nanoGPT's GPT in PyTorch (scripts/gpt_ref.py), built
 * there from the same safetensors file: logits, loss and the gradient of
 * every parameter (the tied one included, as the sum of both uses) within
 * 1e-4.  Skipped, and counted as skipped, when /usr/bin/python3 has no torch
 * (tests run from the repository root). */
#include <sys/wait.h>
#include <unistd.h>

#include "test_layers.h"

#define PY "/usr/bin/python3"
#define SCRIPT "scripts/gpt_ref.py"

static double worst_diff(const float *a, const float *b, int64_t n, double *scale)
{
    double w = 0;
    *scale = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        w = d > w ? d : w;
        *scale = fabs(b[i]) > *scale ? fabs(b[i]) : *scale;
    }
    return w;
}

TEST(gpt_equals_nanogpt_in_pytorch)
{
    if (access(PY, X_OK) != 0 || access(SCRIPT, R_OK) != 0) SKIP("needs %s and %s (run from the repository root)", PY, SCRIPT);
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 2, 2, 16, 8, 256);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 11, &m));
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    for (int i = 0; i < np; i++) rand_fill(ps[i]->data, 60 + (uint64_t)i, -0.4f, 0.4f);
    /* The batch: 3 sequences of 8 bytes and their next bytes. */
    int64_t B = 3, T = 8;
    ct_tensor *x = ct_tensor_create(CT_I64, 2, (int64_t[]){B, T}, CT_MEM_ACT);
    ct_tensor *y = ct_tensor_create(CT_I64, 2, (int64_t[]){B, T}, CT_MEM_ACT);
    const char *text = "Fortune favours the brave ones.";
    for (int64_t i = 0; i < B * T; i++) {
        ((int64_t *)ct_tensor_data(x))[i] = (unsigned char)text[i % 30];
        ((int64_t *)ct_tensor_data(y))[i] = (unsigned char)text[(i + 1) % 30];
    }
    /* Write the model (and the batch) as ctrain saves it. */
    const char **names = ct_alloc(sizeof *names * (size_t)(np + 2), CT_MEM_OTHER);
    ct_tensor **ts = ct_alloc(sizeof *ts * (size_t)(np + 2), CT_MEM_OTHER);
    for (int i = 0; i < np; i++) {
        names[i] = ps[i]->name;
        ts[i] = ps[i]->data;
    }
    names[np] = "__x";
    ts[np] = x;
    names[np + 1] = "__y";
    ts[np + 1] = y;
    ct_meta meta = {0};
    ASSERT_OK(ct_model_config_to_meta(&c, &meta));
    const char *mk[32], *mv[32];
    ASSERT(meta.n <= 32);
    ct_meta_arrays(&meta, mk, mv);
    char in[512], out[512], cmd[1536];
    snprintf(in, sizeof in, "%s/in.safetensors", ct_test_tmpdir());
    snprintf(out, sizeof out, "%s/out.safetensors", ct_test_tmpdir());
    ASSERT_OK(ct_safetensors_save(in, names, ts, np + 2, mk, mv, meta.n));
    ct_meta_fini(&meta);
    snprintf(cmd, sizeof cmd, "%s %s '%s' '%s' 2>&1", PY, SCRIPT, in, out);
    char msg[4096];
    FILE *p = popen(cmd, "r");
    ASSERT(p);
    size_t n = fread(msg, 1, sizeof msg - 1, p);
    msg[n] = 0;
    int st = pclose(p), rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (rc == 3) {
        ct_free(names);
        ct_free(ts);
        ct_free(ps);
        ct_tensor_release(x);
        ct_tensor_release(y);
        ct_module_destroy(m);
        SKIP("%s cannot import torch", PY);
    }
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "gpt_ref.py failed (%d): %s", rc, msg);
    ct_safetensors *ref;
    ASSERT_OK(ct_safetensors_load(out, &ref));

    /* ctrain: forward, mean cross-entropy, backward. */
    ct_tensor *z, *dz;
    ct_record *rec;
    float loss;
    ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = 0}; /* dropout is 0: training changes nothing */
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, x, &z, &rec, &ctx));
    ASSERT_OK(ct_cross_entropy(z, y, -100, &loss, &dz));
    ASSERT_OK(ct_module_backward(m, dz, NULL, rec));

    double scale, d;
    ct_tensor *rl = ct_safetensors_find(ref, "logits"), *rloss = ct_safetensors_find(ref, "loss");
    ASSERT(rl && rl->numel == z->numel && rloss);
    d = worst_diff(ct_f32(z), ct_f32(rl), z->numel, &scale);
    if (!(d <= 1e-4)) ct_test_fail(__FILE__, __LINE__, "logits differ from PyTorch's by %g (largest %g)", d, scale);
    ASSERT(scale > 0.5); /* not a trivial model */
    ASSERT_NEAR(loss, ct_f32(rloss)[0], 1e-4);
    int compared = 0;
    for (int i = 0; i < np; i++) {
        char gname[160];
        snprintf(gname, sizeof gname, "grad.%s", ps[i]->name);
        ct_tensor *g = ct_safetensors_find(ref, gname);
        if (!g) ct_test_fail(__FILE__, __LINE__, "PyTorch has no gradient for %s", ps[i]->name);
        ASSERT_EQ(g->numel, ps[i]->grad->numel);
        d = worst_diff(ct_f32(ps[i]->grad), ct_f32(g), g->numel, &scale);
        if (!(d <= 1e-4))
            ct_test_fail(__FILE__, __LINE__, "gradient of %s differs from PyTorch's by %g (largest %g)", ps[i]->name, d,
                         scale);
        compared++;
    }
    ASSERT_EQ(compared, 2 + 12 * 2 + 2);
    ASSERT_EQ(ct_safetensors_count(ref), 2 + compared); /* PyTorch lists no lm_head.weight either */
    ct_safetensors_destroy(ref);
    ct_tensor_release(z);
    ct_tensor_release(dz);
    ct_free(names);
    ct_free(ts);
    ct_free(ps);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_module_destroy(m);
}

/* A tiny gpt against nanoGPT's GPT in PyTorch (scripts/gpt_ref.py), built
 * there from the same safetensors file: logits, loss and the gradient of
 * every parameter (the tied one included, as the sum of both uses) within
 * 1e-4; and its parameter groups (scripts/gpt_groups_ref.py) against
 * nanoGPT's configure_optimizers and torch.optim.AdamW.  Skipped, and
 * counted as skipped, when /usr/bin/python3 has no torch (tests run from the
 * repository root). */
#include <sys/wait.h>
#include <unistd.h>

#include "test_layers.h"

#define PY "/usr/bin/python3"
#define SCRIPT "scripts/gpt_ref.py"
#define GROUPS_SCRIPT "scripts/gpt_groups_ref.py"

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

/* A tiny gpt (2 layers, 2 heads, dim 16, context 8, vocab 256) with
 * weights from seed 60.., and a batch of 3 sequences of 8 bytes. */
typedef struct {
    ct_model_config c;
    ct_module *m;
    ct_param **ps;
    int np;
    ct_tensor *x, *y;
} tiny_gpt;

static void tiny_gpt_init(tiny_gpt *g)
{
    g->c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&g->c, 2, 2, 16, 8, 256);
    ASSERT_OK(ct_model_build(&g->c, 11, &g->m));
    ASSERT_OK(ct_module_params(g->m, &g->ps, &g->np));
    for (int i = 0; i < g->np; i++) rand_fill(g->ps[i]->data, 60 + (uint64_t)i, -0.4f, 0.4f);
    int64_t B = 3, T = 8;
    g->x = ct_tensor_create(CT_I64, 2, (int64_t[]){B, T}, CT_MEM_ACT);
    g->y = ct_tensor_create(CT_I64, 2, (int64_t[]){B, T}, CT_MEM_ACT);
    const char *text = "Fortune favours the brave ones.";
    for (int64_t i = 0; i < B * T; i++) {
        ((int64_t *)ct_tensor_data(g->x))[i] = (unsigned char)text[i % 30];
        ((int64_t *)ct_tensor_data(g->y))[i] = (unsigned char)text[(i + 1) % 30];
    }
}

static void tiny_gpt_fini(tiny_gpt *g)
{
    ct_free(g->ps);
    ct_tensor_release(g->x);
    ct_tensor_release(g->y);
    ct_module_destroy(g->m);
}

/* Writes g's model and batch as ctrain saves them, with g's config and
 * `extra` metadata, runs script on it and loads its output into *ref.
 * Skips (after freeing g) when python or torch is missing. */
static void run_ref(tiny_gpt *g, const char *script, const ct_meta *extra, ct_safetensors **ref)
{
    if (access(PY, X_OK) != 0 || access(script, R_OK) != 0) {
        tiny_gpt_fini(g);
        SKIP("needs %s and %s (run from the repository root)", PY, script);
    }
    const char **names = ct_alloc(sizeof *names * (size_t)(g->np + 2), CT_MEM_OTHER);
    ct_tensor **ts = ct_alloc(sizeof *ts * (size_t)(g->np + 2), CT_MEM_OTHER);
    for (int i = 0; i < g->np; i++) {
        names[i] = g->ps[i]->name;
        ts[i] = g->ps[i]->data;
    }
    names[g->np] = "__x";
    ts[g->np] = g->x;
    names[g->np + 1] = "__y";
    ts[g->np + 1] = g->y;
    ct_meta meta = {0};
    ASSERT_OK(ct_model_config_to_meta(&g->c, &meta));
    for (int i = 0; extra && i < extra->n; i++) ASSERT_OK(ct_meta_set(&meta, extra->key[i], "%s", extra->val[i]));
    const char *mk[64], *mv[64];
    ASSERT(meta.n <= 64);
    ct_meta_arrays(&meta, mk, mv);
    char in[512], out[512], cmd[1536];
    snprintf(in, sizeof in, "%s/in.safetensors", ct_test_tmpdir());
    snprintf(out, sizeof out, "%s/out.safetensors", ct_test_tmpdir());
    ASSERT_OK(ct_safetensors_save(in, names, ts, g->np + 2, mk, mv, meta.n));
    ct_meta_fini(&meta);
    ct_free(names);
    ct_free(ts);
    snprintf(cmd, sizeof cmd, "%s %s '%s' '%s' 2>&1", PY, script, in, out);
    char msg[4096];
    FILE *p = popen(cmd, "r");
    ASSERT(p);
    size_t n = fread(msg, 1, sizeof msg - 1, p);
    msg[n] = 0;
    int st = pclose(p), rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (rc == 3) {
        tiny_gpt_fini(g);
        SKIP("%s cannot import torch", PY);
    }
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "%s failed (%d): %s", script, rc, msg);
    ASSERT_OK(ct_safetensors_load(out, ref));
}

TEST(gpt_equals_nanogpt_in_pytorch)
{
    tiny_gpt g;
    tiny_gpt_init(&g);
    ct_module *m = g.m;
    ct_param **ps = g.ps;
    int np = g.np;
    ct_tensor *x = g.x, *y = g.y;
    ct_safetensors *ref;
    run_ref(&g, SCRIPT, NULL, &ref);

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
    tiny_gpt_fini(&g);
}

/* Parameter groups: nanoGPT's configure_optimizers (decay only parameters
 * of 2 or more dimensions, betas (0.9, 0.95)) with a learning rate of its
 * own for the no-decay group, three AdamW steps, against torch.optim.AdamW
 * with the same groups.  The decay (0.5) and the no-decay group's lr (x0.3)
 * move the parameters far beyond the tolerance, so a parameter in the
 * wrong group, or a group value not applied, fails.  eps is 1e-4: the key
 * biases' gradient is zero in exact arithmetic (softmax ignores a constant
 * per row), and AdamW with eps 1e-8 would turn each side's rounding noise
 * into a full step in a random direction. */
TEST(gpt_groups_equal_nanogpt_adamw_in_pytorch)
{
    tiny_gpt g;
    tiny_gpt_init(&g);
    const double lr = 1e-2, wd = 0.5, scale = 0.3;
    const int steps = 3;
    ct_meta extra = {0};
    ASSERT_OK(ct_meta_set(&extra, "ref.steps", "%d", steps));
    ASSERT_OK(ct_meta_set(&extra, "ref.lr", "%.17g", lr));
    ASSERT_OK(ct_meta_set(&extra, "ref.weight_decay", "%.17g", wd));
    ASSERT_OK(ct_meta_set(&extra, "ref.beta1", "0.9"));
    ASSERT_OK(ct_meta_set(&extra, "ref.beta2", "0.95"));
    ASSERT_OK(ct_meta_set(&extra, "ref.eps", "1e-4"));
    ASSERT_OK(ct_meta_set(&extra, "ref.nodecay_lr_scale", "%.17g", scale));
    ct_safetensors *ref;
    run_ref(&g, GROUPS_SCRIPT, &extra, &ref);
    ct_meta_fini(&extra);

    /* The no-decay group is nanoGPT's: the same names, in the same order. */
    const char **nd;
    int nnd;
    ASSERT_OK(ct_optim_select(g.ps, g.np, "ndim<2", &nd, &nnd));
    char joined[4096] = "";
    for (int i = 0; i < nnd; i++) {
        strcat(joined, i ? "," : "");
        strcat(joined, nd[i]);
    }
    const char *want = ct_safetensors_meta(ref, "nodecay");
    ASSERT(want);
    if (strcmp(joined, want)) ct_test_fail(__FILE__, __LINE__, "no-decay group %s, nanoGPT's %s", joined, want);
    ASSERT_EQ(nnd, 2 * 8 + 2); /* per block: 2 LayerNorms x 2, 4 Linear biases; ln_f's 2 */

    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.lr = lr;
    o.weight_decay = wd;
    o.beta2 = 0.95;
    o.eps = 1e-4;
    ct_optim_group nodecay = ct_optim_group_init(&o);
    nodecay.params = nd;
    nodecay.nparams = nnd;
    nodecay.weight_decay = 0;
    nodecay.lr_scale = scale;
    o.groups = &nodecay;
    o.ngroups = 1;
    ct_optim *opt = ct_optim_create(&o, g.ps, g.np);
    ASSERT(opt);
    ct_free(nd); /* the optimizer keeps copies of the names */
    ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = 0};
    for (int s = 0; s < steps; s++) {
        ct_tensor *z, *dz;
        ct_record *rec;
        float loss;
        ct_module_zero_grad(g.m);
        ASSERT_OK(ct_module_forward(g.m, g.x, &z, &rec, &ctx));
        ASSERT_OK(ct_cross_entropy(z, g.y, -100, &loss, &dz));
        ASSERT_OK(ct_module_backward(g.m, dz, NULL, rec));
        ASSERT_OK(ct_optim_step(opt));
        ct_tensor_release(z);
        ct_tensor_release(dz);
    }
    for (int i = 0; i < g.np; i++) {
        ct_tensor *r = ct_safetensors_find(ref, g.ps[i]->name);
        if (!r) ct_test_fail(__FILE__, __LINE__, "PyTorch has no parameter %s", g.ps[i]->name);
        ASSERT_EQ(r->numel, g.ps[i]->data->numel);
        double sc, d = worst_diff(ct_f32(g.ps[i]->data), ct_f32(r), r->numel, &sc);
        if (!(d <= 2e-5))
            ct_test_fail(__FILE__, __LINE__, "%s after %d steps differs from PyTorch's by %g", g.ps[i]->name, steps, d);
    }
    ct_optim_destroy(opt);
    ct_safetensors_destroy(ref);
    tiny_gpt_fini(&g);
}

/* The GPT's layers: finite-difference checks of attention, the block, the
 * embeddings and a whole tiny GPT; the causal mask; the tied head's gradient
 * as the sum of its two uses, with one grad-ready per backward. */
#include "nn/internal.h" /* ct__expf, ct__erff, ct__expf_libm */
#include "test_layers.h"

/* Random values for every parameter under m (zero biases would hide bugs). */
static void rand_all(ct_module *m, uint64_t seed, float scale)
{
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) rand_fill(ps[i]->data, seed + 31 * (uint64_t)i, -scale, scale);
    ct_free(ps);
}

static ct_tensor *tokens(int64_t B, int64_t T, int64_t V, uint64_t seed)
{
    ct_tensor *t = ct_tensor_create(CT_I64, 2, (int64_t[]){B, T}, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, seed, 5);
    float u[64];
    ASSERT(B * T <= 64);
    ct_rng_uniform(&r, u, (size_t)(B * T));
    for (int64_t i = 0; i < B * T; i++) ((int64_t *)ct_tensor_data(t))[i] = (int64_t)(u[i] * (float)V) % V;
    return t;
}

TEST(fd_attention)
{
    for (int drop = 0; drop <= 1; drop++) {
        ct_fwd_ctx ctx = train_ctx();
        ct_module *m = ct_attention_create(8, 2, drop ? 0.2f : 0.0f, drop ? 0.1f : 0.0f);
        ASSERT(m);
        rand_all(m, 3, 0.5f);
        ct_tensor *x = rand_tensor(3, (int64_t[]){2, 5, 8}, 4, -1.0f, 1.0f);
        ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 5));
        ct_tensor_release(x);
        ct_module_destroy(m);
    }
}

/* The f32 core goes in blocks of 64 query rows, each against the keys up to
 * its last row: one row, and a second block of 6 rows past the first. */
TEST(fd_attention_row_blocks)
{
    int64_t Ts[] = {1, 70};
    for (int i = 0; i < 2; i++)
        for (int drop = 0; drop <= 1; drop++) {
            ct_fwd_ctx ctx = train_ctx();
            ct_module *m = ct_attention_create(8, 2, drop ? 0.2f : 0.0f, 0.0f);
            ASSERT(m);
            rand_all(m, 21, 0.5f);
            ct_tensor *x = rand_tensor(3, (int64_t[]){1, Ts[i], 8}, 22, -1.0f, 1.0f);
            ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 23));
            ct_tensor_release(x);
            ct_module_destroy(m);
        }
}

TEST(fd_transformer_block)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_transformer_block_create(8, 2, 0.1f);
    ASSERT(m);
    rand_all(m, 6, 0.5f);
    ct_tensor *x = rand_tensor(3, (int64_t[]){2, 4, 8}, 7, -1.0f, 1.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 8));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_tokpos_embedding)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_tokpos_embedding_create(7, 6, 4, 0.1f);
    ASSERT(m);
    rand_all(m, 9, 1.0f);
    ct_tensor *x = tokens(3, 5, 7, 10);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 11));
    /* More positions than the context is an error naming it. */
    ct_tensor *y, *big = tokens(1, 7, 7, 12);
    ASSERT_ERR(ct_module_forward(m, big, &y, NULL, &ctx), CT_EINVAL, "context is 6");
    ct_tensor_release(big);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

static ct_model_config tiny(int64_t layers, float dropout)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, layers, 2, 8, 6, 11);
    c.dropout = dropout;
    return c;
}

TEST(fd_gpt_whole_model_with_tied_head)
{
    ct_model_config c = tiny(2, 0.1f);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 1, &m));
    rand_all(m, 13, 0.3f);
    ct_fwd_ctx ctx = train_ctx();
    ct_tensor *x = tokens(2, 4, 11, 14);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 15));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* Position t's output must not change when any later token changes. */
TEST(gpt_causal_mask)
{
    ct_model_config c = tiny(2, 0.0f);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 2, &m));
    rand_all(m, 16, 0.5f);
    int64_t T = 6, V = 11;
    ct_tensor *x = tokens(1, T, V, 17), *y0, *y1;
    ASSERT_OK(ct_module_forward(m, x, &y0, NULL, NULL));
    for (int64_t t = 0; t + 1 < T; t++) {
        ct_tensor *x2 = ct_tensor_clone(x, CT_MEM_ACT);
        for (int64_t u = t + 1; u < T; u++) ((int64_t *)ct_tensor_data(x2))[u] = (((int64_t *)ct_tensor_data(x))[u] + 3) % V;
        ASSERT_OK(ct_module_forward(m, x2, &y1, NULL, NULL));
        double changed_later = 0;
        for (int64_t p = 0; p < T; p++)
            for (int64_t v = 0; v < V; v++) {
                float a = ct_f32(y0)[p * V + v], b = ct_f32(y1)[p * V + v];
                if (p <= t) ASSERT(a == b); /* bit for bit: no leak from the future */
                else changed_later += fabs((double)a - b);
            }
        ASSERT(changed_later > 1e-4); /* the later positions did see the change */
        ct_tensor_release(y1);
        ct_tensor_release(x2);
    }
    ct_tensor_release(y0);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

static int fired;
static ct_status count_hook(ct_param *p, void *ud)
{
    (void)p;
    (void)ud;
    fired++;
    return CT_OK;
}

/* The same network with lm_head's own weight, built from the public pieces. */
static ct_module *untied_copy(ct_module *tied, const ct_model_config *c)
{
    ct_module *s = ct_sequential_create();
    ASSERT_OK(ct_module_add(s, "transformer", ct_tokpos_embedding_create(c->vocab, c->context, c->dim, c->dropout)));
    for (int64_t i = 0; i < c->layers; i++) {
        char nm[48];
        snprintf(nm, sizeof nm, "transformer.h.%lld", (long long)i);
        ASSERT_OK(ct_module_add(s, nm, ct_transformer_block_create(c->dim, (int)c->heads, c->dropout)));
    }
    ASSERT_OK(ct_module_add(s, "transformer.ln_f", ct_layernorm_create(c->dim, 1e-5f)));
    ASSERT_OK(ct_module_add(s, "lm_head", ct_linear_create(c->dim, c->vocab, 0)));
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(s, &ps, &n));
    for (int i = 0; i < n; i++) {
        const char *src = strcmp(ps[i]->name, "lm_head.weight") ? ps[i]->name : "transformer.wte.weight";
        ASSERT_OK(ct_tensor_copy(ps[i]->data, ct_module_find(tied, src)->data));
    }
    ct_free(ps);
    return s;
}

static void grads(ct_module *m, ct_tensor *x, const ct_fwd_ctx *ctx, uint64_t seed)
{
    ct_tensor *y;
    ct_record *rec;
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, ctx));
    ct_tensor *R = rand_tensor(y->ndim, y->shape, seed, -1.0f, 1.0f);
    ASSERT_OK(ct_module_backward(m, R, NULL, rec));
    ct_tensor_release(R);
    ct_tensor_release(y);
}

TEST(gpt_tied_head_gradient_is_sum_of_both_uses)
{
    ct_model_config c = tiny(1, 0.1f);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 3, &m));
    ct_module *u = untied_copy(m, &c);
    /* One parameter, listed once, under the embedding's name. */
    ct_param *wte = ct_module_find(m, "transformer.wte.weight");
    ASSERT(m->kids[m->nkids - 1]->params[0] == wte);
    ASSERT(ct_module_find(m, "lm_head.weight") == NULL);
    ASSERT_EQ(ct_module_num_params(m) + c.vocab * c.dim, ct_module_num_params(u));
    ct_hook *h = ct_param_add_hook(wte, count_hook, NULL);
    ct_fwd_ctx ctx = train_ctx();
    ct_tensor *x = tokens(2, 5, c.vocab, 18);
    for (int round = 0; round < 2; round++) { /* the second after a lazy zero_grad */
        ct_module_zero_grad_lazy(m);
        ct_module_zero_grad(u);
        fired = 0;
        grads(m, x, &ctx, 19);
        grads(u, x, &ctx, 19);
        ASSERT_EQ(fired, 1); /* once, after the embedding's (last) backward */
        const float *g = ct_f32(wte->grad), *a = ct_f32(ct_module_find(u, "transformer.wte.weight")->grad),
                    *b = ct_f32(ct_module_find(u, "lm_head.weight")->grad);
        double na = 0, nb = 0;
        for (int64_t i = 0; i < wte->grad->numel; i++) {
            ASSERT_CLOSE(g[i], (double)a[i] + b[i], 1e-5, 1e-6);
            na += fabs(a[i]);
            nb += fabs(b[i]);
        }
        ASSERT(na > 0 && nb > 0); /* both uses contribute */
    }
    /* A forward whose record is dropped gives its use back: the next backward still fires. */
    ct_tensor *y;
    ct_record *rec;
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    ct_record_destroy(rec);
    ct_tensor_release(y);
    ASSERT_EQ(wte->uses_pending, 0);
    fired = 0;
    grads(m, x, &ctx, 20);
    ASSERT_EQ(fired, 1);
    ct_hook_remove(h);
    ct_tensor_release(x);
    ct_module_destroy(u);
    ct_module_destroy(m);
}

TEST(gpt_state_dict_names_are_nanogpt)
{
    ct_model_config c = tiny(2, 0.0f);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 4, &m));
    static const char *const blk[] = {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
                                      "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                                      "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias"};
    ct_param **ps;
    int n, k = 0;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    ASSERT_EQ(n, 2 + 12 * 2 + 2);
    ASSERT(!strcmp(ps[k++]->name, "transformer.wte.weight"));
    ASSERT(!strcmp(ps[k++]->name, "transformer.wpe.weight"));
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 12; j++) {
            char want[96];
            snprintf(want, sizeof want, "transformer.h.%d.%s", i, blk[j]);
            if (strcmp(ps[k]->name, want)) ct_test_fail(__FILE__, __LINE__, "param %d is %s, want %s", k, ps[k]->name, want);
            k++;
        }
    ASSERT(!strcmp(ps[k++]->name, "transformer.ln_f.weight"));
    ASSERT(!strcmp(ps[k++]->name, "transformer.ln_f.bias"));
    /* nn.Linear layouts: c_attn [3D, D], c_fc [4D, D]. */
    ct_param *ca = ct_module_find(m, "transformer.h.1.attn.c_attn.weight");
    ASSERT(ca->data->shape[0] == 24 && ca->data->shape[1] == 8);
    ASSERT(ct_module_find(m, "transformer.h.0.mlp.c_fc.weight")->data->shape[0] == 32);
    ct_free(ps);
    /* Shapes without running: [N, T] -> [N, T, vocab]; a T beyond the context is refused. */
    int nd;
    int64_t out[CT_MAX_DIMS];
    ASSERT_OK(ct_module_out_shape(m, 2, (int64_t[]){3, 6}, &nd, out));
    ASSERT(nd == 3 && out[0] == 3 && out[1] == 6 && out[2] == 11);
    ASSERT_ERR(ct_module_out_shape(m, 2, (int64_t[]){3, 7}, &nd, out), CT_EINVAL, "context");
    ct_module_destroy(m);
}

/* nanoGPT's init: normal(0, 0.02), c_proj normal(0, 0.02/sqrt(2L)), biases 0, LayerNorm 1. */
TEST(gpt_init_is_nanogpt)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 2, 4, 64, 32, 256);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 5, &m));
    struct {
        const char *name;
        double std;
    } want[] = {{"transformer.wte.weight", 0.02}, {"transformer.wpe.weight", 0.02},
                {"transformer.h.0.attn.c_attn.weight", 0.02}, {"transformer.h.1.mlp.c_fc.weight", 0.02},
                {"transformer.h.0.attn.c_proj.weight", 0.01}, {"transformer.h.1.mlp.c_proj.weight", 0.01}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        ct_param *p = ct_module_find(m, want[i].name);
        double s = 0, s2 = 0;
        for (int64_t j = 0; j < p->data->numel; j++) {
            s += ct_f32(p->data)[j];
            s2 += (double)ct_f32(p->data)[j] * ct_f32(p->data)[j];
        }
        double mean = s / (double)p->data->numel, sd = sqrt(s2 / (double)p->data->numel - mean * mean);
        ASSERT_CLOSE(sd, want[i].std, 0.05, 0);
        ASSERT_NEAR(mean, 0, 0.1 * want[i].std);
    }
    ASSERT(ct_f32(ct_module_find(m, "transformer.h.0.ln_1.weight")->data)[3] == 1.0f);
    ASSERT(ct_f32(ct_module_find(m, "transformer.h.0.attn.c_attn.bias")->data)[3] == 0.0f);
    ct_module_destroy(m);
}

/* Cut into stages between blocks (a pipeline's cut), the parts run in turn
 * compute what the whole model does, and keep their names. */
TEST(gpt_split_between_blocks)
{
    ct_model_config c = tiny(2, 0.0f);
    ct_module *m, *parts[3];
    ASSERT_OK(ct_model_build(&c, 6, &m));
    rand_all(m, 21, 0.5f);
    ct_tensor *x = tokens(2, 6, 11, 22), *y, *h;
    ASSERT_OK(ct_module_forward(m, x, &y, NULL, NULL));
    ASSERT_OK(ct_sequential_split(m, (int[]){2, 1, 2}, 3, parts));
    ASSERT(ct_module_find(parts[1], "transformer.h.1.attn.c_attn.weight"));
    ASSERT(!strcmp(parts[2]->kids[1]->fqn, "lm_head"));
    ct_tensor *cur = ct_tensor_retain(x);
    for (int i = 0; i < 3; i++) {
        ASSERT_OK(ct_module_forward(parts[i], cur, &h, NULL, NULL));
        ct_tensor_release(cur);
        cur = h;
    }
    for (int64_t i = 0; i < y->numel; i++) ASSERT(ct_f32(y)[i] == ct_f32(cur)[i]);
    ct_tensor_release(cur);
    ct_tensor_release(y);
    ct_tensor_release(x);
    /* The tied weight is freed by whichever part goes last. */
    for (int i = 0; i < 3; i++) ct_module_destroy(parts[i]);
    ct_module_destroy(m);
}

/* Sharing and naming: the errors, and a shared parameter freed once, with whichever module goes last. */
TEST(nn_share_param_and_dotted_names)
{
    ct_module *a = ct_linear_create(4, 3, 0), *b = ct_linear_create(4, 3, 1), *c = ct_linear_create(3, 4, 0);
    ct_param *w = a->params[0];
    ASSERT_ERR(ct_module_share_param(c, "weight", w), CT_EINVAL, "needs the shape");
    ASSERT_ERR(ct_module_share_param(b, "gain", w), CT_EINVAL, "no parameter 'gain'");
    ASSERT_OK(ct_module_share_param(b, "weight", w));
    ASSERT_OK(ct_module_share_param(b, "weight", w)); /* again: nothing changes */
    ASSERT(b->params[0] == w && w->nmodules == 2 && w->owner == a);
    ct_module *root = ct_sequential_create();
    ASSERT_OK(ct_module_add(root, "x.y", a));
    ASSERT_OK(ct_module_add(root, "z", b));
    ASSERT(!strcmp(w->name, "x.y.weight")); /* named by its owner */
    ASSERT(!strcmp(b->params[1]->name, "z.bias"));
    ASSERT_EQ(ct_module_num_params(root), 12 + 3);
    ASSERT_ERR(ct_module_add(root, "a..b", ct_relu_create()), CT_EINVAL, "dot-separated");
    ASSERT_ERR(ct_module_add(root, ".a", ct_relu_create()), CT_EINVAL, "dot-separated");
    ASSERT_ERR(ct_module_add(root, "a.", ct_relu_create()), CT_EINVAL, "dot-separated");
    /* Destroy the owner first: the sharer keeps the parameter alive (ASan checks the rest). */
    ct_module *owner = ct_module_detach(root, 0);
    ct_module_destroy(owner);
    ASSERT(w->owner == NULL && w->nmodules == 1);
    ct_tensor *x = ct_tensor_create2(2, 4, CT_MEM_ACT), *y;
    ASSERT_OK(ct_module_forward(root, x, &y, NULL, NULL));
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(root);
    ct_module_destroy(c);
}

/* ---- the elementwise layers' fast paths ------------------------------------ */

/* Row sums in 8 double lanes, the last n % 8 first, then the lanes: the
 * layernorm's order, written one row at a time as the layer once was. */
static double lanes_sum(const float *x, int64_t n, double mu, int sq)
{
    double a[8] = {0}, s = 0.0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) a[j] += sq ? ((double)x[i + j] - mu) * ((double)x[i + j] - mu) : x[i + j];
    for (; i < n; i++) s += sq ? ((double)x[i] - mu) * ((double)x[i] - mu) : x[i];
    for (int j = 0; j < 8; j++) s += a[j];
    return s;
}

/* The layernorm, forward and backward, one row at a time (the layer works on
 * several rows side by side and fuses the backward's loops: the numbers
 * must not move by a bit). */
static void ln_rowwise(const float *x, const float *w, const float *b, const float *dy, int64_t R, int64_t D,
                       float eps, float *y, float *mean, float *rstd, float *dx, float *gw, float *gb)
{
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * D, *dyr = dy + r * D;
        double mu = lanes_sum(xr, D, 0, 0) / (double)D, ss = lanes_sum(xr, D, mu, 1);
        float rs = (float)(1.0 / sqrt(ss / (double)D + (double)eps)), m = (float)mu;
        mean[r] = m;
        rstd[r] = rs;
        for (int64_t i = 0; i < D; i++) y[r * D + i] = (xr[i] - m) * rs * w[i] + b[i];
        double ag[8] = {0}, agx[8] = {0}, sg = 0.0, sgx = 0.0;
        int64_t i0 = 0;
        for (; i0 + 8 <= D; i0 += 8)
            for (int j = 0; j < 8; j++) {
                float g = dyr[i0 + j] * w[i0 + j];
                ag[j] += g;
                agx[j] += g * (xr[i0 + j] - m) * rs;
            }
        for (int64_t i = i0; i < D; i++) {
            float g = dyr[i] * w[i];
            sg += g;
            sgx += g * (xr[i] - m) * rs;
        }
        for (int j = 0; j < 8; j++) {
            sg += ag[j];
            sgx += agx[j];
        }
        float mg = (float)(sg / (double)D), mgx = (float)(sgx / (double)D);
        for (int64_t i = 0; i < D; i++) {
            gw[i] += dyr[i] * (xr[i] - m) * rs;
            gb[i] += dyr[i];
            dx[r * D + i] = rs * (dyr[i] * w[i] - mg - (xr[i] - m) * rs * mgx);
        }
    }
}

static int same_floats(const float *a, const float *b, int64_t n) { return !memcmp(a, b, (size_t)n * sizeof *a); }

/* Widths around the 8 lanes and row counts around the rows done side by
 * side; the gradients accumulate onto what is there. */
TEST(layernorm_matches_the_row_at_a_time_loops)
{
    const int64_t dims[] = {1, 5, 8, 13, 128, 131}, rows[] = {1, 3, 4, 5, 11};
    for (size_t a = 0; a < sizeof dims / sizeof *dims; a++)
        for (size_t c = 0; c < sizeof rows / sizeof *rows; c++) {
            int64_t D = dims[a], R = rows[c], n = R * D;
            ct_module *m = ct_layernorm_create(D, 1e-5f);
            rand_all(m, 30 + (uint64_t)D, 1.0f);
            ct_tensor *x = rand_tensor(2, (int64_t[]){R, D}, 31 + (uint64_t)n, -2.0f, 3.0f);
            ct_tensor *dy = rand_tensor(2, (int64_t[]){R, D}, 32 + (uint64_t)n, -1.0f, 1.0f);
            for (int k = 0; k < 2; k++) rand_fill(m->params[k]->grad, 33 + (uint64_t)k, -1.0f, 1.0f);
            float *y = ct_alloc((size_t)(2 * n + 2 * R + 2 * D) * sizeof *y, CT_MEM_OTHER);
            float *dx = y + n, *mean = dx + n, *rstd = mean + R, *gw = rstd + R, *gb = gw + D;
            memcpy(gw, ct_f32(m->params[0]->grad), (size_t)D * sizeof *gw);
            memcpy(gb, ct_f32(m->params[1]->grad), (size_t)D * sizeof *gb);
            ln_rowwise(ct_f32(x), ct_f32(m->params[0]->data), ct_f32(m->params[1]->data), ct_f32(dy), R, D, 1e-5f, y,
                       mean, rstd, dx, gw, gb);
            ct_fwd_ctx ctx = train_ctx();
            ct_tensor *out, *din;
            ct_record *rec;
            ASSERT_OK(ct_module_forward(m, x, &out, &rec, &ctx));
            ASSERT(same_floats(ct_f32(out), y, n));
            ASSERT(same_floats(ct_f32(ct_record_saved(rec, 1)), mean, R));
            ASSERT(same_floats(ct_f32(ct_record_saved(rec, 2)), rstd, R));
            ASSERT_OK(ct_module_backward(m, dy, &din, rec));
            if (!same_floats(ct_f32(din), dx, n) || !same_floats(ct_f32(m->params[0]->grad), gw, D) ||
                !same_floats(ct_f32(m->params[1]->grad), gb, D))
                ct_test_fail(__FILE__, __LINE__, "%lld rows of %lld: the backward differs", (long long)R, (long long)D);
            ct_free(y);
            ct_tensor_release(din);
            ct_tensor_release(out);
            ct_tensor_release(dy);
            ct_tensor_release(x);
            ct_module_destroy(m);
        }
}

/* Rows with a mean far above their spread: the double statistics are right
 * (mean to float rounding, 1/std to 1e-6; f32 sums of 1000 values near 10^4
 * would be off by ~1e-2 in the mean), so the outputs are off only by the
 * float rounding of the mean (1/2 ulp of 10^4 = 5e-4, times 1/std). */
TEST(layernorm_large_mean_rows_stay_accurate)
{
    int64_t R = 5, D = 1000;
    ct_module *m = ct_layernorm_create(D, 1e-5f);
    ct_tensor *x = rand_tensor(2, (int64_t[]){R, D}, 34, -1.0f, 1.0f), *y;
    for (int64_t i = 0; i < R * D; i++) ct_f32(x)[i] += 1e4f;
    ct_record *rec;
    ct_fwd_ctx ctx = train_ctx();
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    for (int64_t r = 0; r < R; r++) {
        const float *xr = ct_f32(x) + r * D;
        double mu = 0, var = 0;
        for (int64_t i = 0; i < D; i++) mu += xr[i];
        mu /= (double)D;
        for (int64_t i = 0; i < D; i++) var += (xr[i] - mu) * (xr[i] - mu);
        var /= (double)D;
        double rs = 1.0 / sqrt(var + 1e-5);
        ASSERT(ct_f32(ct_record_saved(rec, 1))[r] == (float)mu);
        ASSERT_CLOSE(ct_f32(ct_record_saved(rec, 2))[r], rs, 1e-6, 0.0);
        for (int64_t i = 0; i < D; i++) ASSERT_NEAR(ct_f32(y)[r * D + i], (xr[i] - mu) * rs, 5e-4 * rs + 1e-6);
    }
    ct_record_destroy(rec);
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* Without a weight gradient, or without an input gradient, the backward
 * still gives the rest exactly as the full one does. */
TEST(layernorm_backward_with_parts_left_out)
{
    int64_t R = 6, D = 37;
    ct_module *m = ct_layernorm_create(D, 1e-5f);
    rand_all(m, 35, 1.0f);
    ct_tensor *x = rand_tensor(2, (int64_t[]){R, D}, 36, -2.0f, 2.0f), *dy = rand_tensor(2, (int64_t[]){R, D}, 37, -1.0f, 1.0f);
    ct_fwd_ctx ctx = train_ctx();
    ct_tensor *y, *dx[3] = {NULL, NULL, NULL}, *gw[3], *gb[3];
    for (int k = 0; k < 3; k++) {
        ct_record *rec;
        ct_module_zero_grad(m);
        m->params[0]->requires_grad = k != 1;
        ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
        ASSERT_OK(ct_module_backward(m, dy, k == 2 ? NULL : &dx[k], rec));
        gw[k] = ct_tensor_clone(m->params[0]->grad, CT_MEM_OTHER);
        gb[k] = ct_tensor_clone(m->params[1]->grad, CT_MEM_OTHER);
        ct_tensor_release(y);
    }
    ASSERT(same_floats(ct_f32(dx[0]), ct_f32(dx[1]), R * D));
    for (int64_t i = 0; i < D; i++) ASSERT_EQ(ct_f32(gw[1])[i], 0.0f); /* frozen: untouched */
    ASSERT(same_floats(ct_f32(gw[0]), ct_f32(gw[2]), D));
    for (int k = 1; k < 3; k++) ASSERT(same_floats(ct_f32(gb[0]), ct_f32(gb[k]), D));
    for (int k = 0; k < 3; k++) {
        ct_tensor_release(dx[k]);
        ct_tensor_release(gw[k]);
        ct_tensor_release(gb[k]);
    }
    ct_tensor_release(dy);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* Distance of got from exact in units of the last place of exact's float. */
static double ulps(float got, double exact)
{
    float r = fabsf((float)exact);
    return fabs((double)got - exact) / ((double)nextafterf(r, INFINITY) - r);
}

/* The vectorisable exp and erf of internal.h against double libm, on a
 * sweep of float bit patterns: ct__expf within 2 ulp on [-87, 88], ct__erff
 * within 4.5e-7 (GELU's accuracy rests on both). */
TEST(fast_expf_and_erff_are_accurate)
{
    double we = 0, wf = 0;
    for (uint64_t u = 0; u < (1ull << 32); u += 4093) {
        uint32_t b = (uint32_t)u;
        float x;
        memcpy(&x, &b, sizeof x);
        if (x >= -87.0f && x <= 88.0f) we = fmax(we, ulps(ct__expf(x), exp((double)x)));
        if (fabsf(x) <= 10.0f) wf = fmax(wf, fabs((double)ct__erff(x) - erf((double)x)));
    }
    if (!(we <= 2.0 && wf <= 4.5e-7)) ct_test_fail(__FILE__, __LINE__, "expf %g ulp, erff %g", we, wf);
}

/* GELU's forward and backward are x Phi(x) and dy (Phi(x) + x phi(x))
 * written with ct__erff and ct__expf, bit for bit, whatever lanes the layer
 * runs them in (AVX-512: ct__erff16 and ct__expf16, also compared with the
 * scalar forms over a sweep of float bit patterns). */
TEST(gelu_lanes_match_the_scalar_formula)
{
#if defined(__AVX512F__)
    for (uint64_t u = 0; u < (1ull << 32); u += 16 * 257) {
        float x[16], e[16], f[16];
        for (int l = 0; l < 16; l++) {
            uint32_t b = (uint32_t)(u + (uint64_t)l * 257);
            memcpy(&x[l], &b, sizeof b);
        }
        _mm512_storeu_ps(e, ct__expf16(_mm512_loadu_ps(x)));
        _mm512_storeu_ps(f, ct__erff16(_mm512_loadu_ps(x)));
        for (int l = 0; l < 16; l++) {
            float a = ct__expf(x[l]), b = ct__erff(x[l]);
            if (!(memcmp(&a, &e[l], 4) == 0 || (a != a && e[l] != e[l])) ||
                !(memcmp(&b, &f[l], 4) == 0 || (b != b && f[l] != f[l])))
                ct_test_fail(__FILE__, __LINE__, "at %a: exp %a vs %a, erf %a vs %a", (double)x[l], (double)e[l],
                             (double)a, (double)f[l], (double)b);
        }
    }
#endif
    int64_t n = 1003;
    ct_module *m = ct_gelu_create();
    ct_tensor *x = rand_tensor(1, &n, 38, -7.0f, 7.0f), *dy = rand_tensor(1, &n, 39, -2.0f, 2.0f), *y, *dx;
    const float odd[] = {0.0f, -0.0f, 1e-39f, -1e-30f, INFINITY, -INFINITY, 30.0f, -30.0f};
    for (int i = 0; i < 8; i++) ct_f32(x)[100 * i + 3] = odd[i];
    ct_record *rec;
    ct_fwd_ctx ctx = train_ctx();
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, &dx, rec));
    for (int64_t i = 0; i < n; i++) {
        float v = ct_f32(x)[i], want = 0.5f * v * (1.0f + ct__erff(v * (float)M_SQRT1_2));
        float cdf = 0.5f * (1.0f + ct__erff(v * (float)M_SQRT1_2)), pdf = 0.3989422804014327f * ct__expf(-0.5f * v * v);
        float gw = ct_f32(dy)[i] * (cdf + v * pdf), got = ct_f32(y)[i], gg = ct_f32(dx)[i];
        if (!(memcmp(&got, &want, 4) == 0 || (got != got && want != want)) ||
            !(memcmp(&gg, &gw, 4) == 0 || (gg != gg && gw != gw)))
            ct_test_fail(__FILE__, __LINE__, "gelu(%a) = %a, want %a; grad %a, want %a", (double)v, (double)got,
                         (double)want, (double)gg, (double)gw);
    }
    ct_tensor_release(dx);
    ct_tensor_release(y);
    ct_tensor_release(dy);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* The cross-entropy's exp is libm's expf bit for bit where it is used (|x|
 * below 88): glibc's algorithm for FMA CPUs, whose values every loss so far
 * was made of. */
TEST(cross_entropy_exp_is_libms_expf)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("fma")) SKIP("glibc's expf without FMA rounds its steps apart");
    for (uint64_t u = 0; u < 0x42b00000u; u += 61)
        for (int s = 0; s < 2; s++) {
            uint32_t b = (uint32_t)u | (s ? 0x80000000u : 0);
            float x, got, want;
            memcpy(&x, &b, sizeof x);
            got = ct__expf_libm(x);
            want = expf(x);
            if (memcmp(&got, &want, sizeof got))
                ct_test_fail(__FILE__, __LINE__, "exp(%a): %a, libm %a", (double)x, (double)got, (double)want);
        }
}

/* The cross-entropy as it was written before (libm's expf, one serial double
 * sum per row): the layer must agree to an ulp (its sum goes in 8 double
 * lanes, which may round the last bit of the double differently). */
static float ce_rowwise(const float *z, const int64_t *t, int64_t R, int64_t C, float *d)
{
    int64_t count = 0;
    for (int64_t r = 0; r < R; r++) count += t[r] != -100;
    double total = 0.0, inv = count ? 1.0 / (double)count : 0.0;
    for (int64_t r = 0; r < R; r++) {
        float *dr = d + r * C;
        const float *zr = z + r * C;
        memset(dr, 0, (size_t)C * sizeof *dr);
        if (t[r] == -100) continue;
        float mx = zr[0];
        for (int64_t j = 1; j < C; j++) mx = zr[j] > mx ? zr[j] : mx;
        double se = 0.0;
        for (int64_t j = 0; j < C; j++) se += dr[j] = expf(zr[j] - mx);
        total += log(se) - (double)(zr[t[r]] - mx);
        float scale = (float)(inv / se);
        for (int64_t j = 0; j < C; j++) dr[j] *= scale;
        dr[t[r]] -= (float)inv;
    }
    return (float)(total * inv);
}

/* Odd widths around the 8- and 16-value lanes, and rows whose logits are
 * far apart (+-80: libm's special cases), just under 88 apart (the
 * vectorised exp at the end of its range), all equal, or ignored. */
TEST(cross_entropy_extreme_rows_and_odd_widths)
{
    const int64_t widths[] = {1, 7, 16, 17, 256, 300};
    enum { R = 7 };
    for (size_t a = 0; a < sizeof widths / sizeof *widths; a++) {
        int64_t C = widths[a], t[R];
        ct_tensor *z = rand_tensor(2, (int64_t[]){R, C}, 40 + (uint64_t)C, -4.0f, 4.0f);
        ct_tensor *tg = ct_tensor_create(CT_I64, 1, (int64_t[]){R}, CT_MEM_ACT);
        float *zp = ct_f32(z);
        for (int64_t j = 0; j < C; j++) {
            zp[1 * C + j] = j % 2 ? 80.0f : -80.0f;
            zp[2 * C + j] = -43.9f + 87.7f * (float)j / (float)(C > 1 ? C - 1 : 1);
            zp[3 * C + j] = 2.5f;
            zp[5 * C + j] = j == 0 ? 80.0f : -80.0f;
        }
        for (int64_t r = 0; r < R; r++) t[r] = (r * 5 + 3) % C;
        t[4] = -100;
        t[5] = 0;
        memcpy(ct_tensor_data(tg), t, sizeof t);
        float loss, want_loss, *want = ct_alloc((size_t)(R * C) * sizeof *want, CT_MEM_OTHER);
        ct_tensor *d;
        ASSERT_OK(ct_cross_entropy(z, tg, -100, &loss, &d));
        want_loss = ce_rowwise(zp, t, R, C, want);
        ASSERT(ulps(loss, want_loss) <= 1.0);
        for (int64_t i = 0; i < R * C; i++)
            if (!(ct_f32(d)[i] == want[i] || ulps(ct_f32(d)[i], want[i]) <= 1.0))
                ct_test_fail(__FILE__, __LINE__, "C %lld, element %lld: %a vs %a", (long long)C, (long long)i,
                             (double)ct_f32(d)[i], (double)want[i]);
        for (int64_t j = 0; j < C; j++) ASSERT(ct_f32(d)[4 * C + j] == 0.0f); /* the ignored row */
        float loss2;
        ASSERT_OK(ct_cross_entropy(z, tg, -100, &loss2, NULL));
        ASSERT(loss2 == loss);
        ct_free(want);
        ct_tensor_release(d);
        ct_tensor_release(tg);
        ct_tensor_release(z);
    }
}

/* Layer forward values against naive references, dropout's determinism, embedding,
 * batchnorm running stats, cross-entropy, gradient accumulation and input checks. */
#include "test_layers.h"

static ct_tensor *fwd(ct_module *m, ct_tensor *x, ct_record **rec, const ct_fwd_ctx *ctx)
{
    ct_tensor *y;
    ct_status s = ct_module_forward(m, x, &y, rec, ctx);
    if (s != CT_OK) ct_test_fail(__FILE__, __LINE__, "forward failed: %s", ct_last_error());
    return y;
}

/* ---- linear ------------------------------------------------------------ */

TEST(linear_forward_matches_naive_loop)
{
    ct_module *m = ct_linear_create(7, 5, 1);
    rand_params(m, 1);
    ct_tensor *x = rand_tensor(3, (int64_t[]){2, 3, 7}, 2, -1.0f, 1.0f);
    ct_tensor *y = fwd(m, x, NULL, NULL);
    ASSERT_EQ(y->ndim, 3);
    ASSERT_EQ(y->shape[2], 5);
    const float *w = ct_f32(m->params[0]->data), *b = ct_f32(m->params[1]->data);
    for (int r = 0; r < 6; r++)
        for (int o = 0; o < 5; o++) {
            double s = b[o];
            for (int i = 0; i < 7; i++) s += (double)ct_f32(x)[r * 7 + i] * w[o * 7 + i];
            ASSERT_NEAR(ct_f32(y)[r * 5 + o], s, 1e-5);
        }
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(linear_backward_without_din_still_accumulates_params)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_linear_create(3, 2, 1);
    rand_params(m, 3);
    ct_tensor *x = rand_tensor(2, (int64_t[]){4, 3}, 4, -1.0f, 1.0f);
    ct_record *rec;
    ct_tensor *y = fwd(m, x, &rec, &ctx);
    ct_tensor *dy = rand_tensor(2, (int64_t[]){4, 2}, 5, -1.0f, 1.0f);
    ASSERT_OK(ct_module_backward(m, dy, NULL, rec));
    /* db = column sums of dy, dW = dy^T x, computed here by hand. */
    for (int o = 0; o < 2; o++) {
        double sb = 0;
        for (int r = 0; r < 4; r++) sb += ct_f32(dy)[r * 2 + o];
        ASSERT_NEAR(ct_f32(m->params[1]->grad)[o], sb, 1e-5);
        for (int i = 0; i < 3; i++) {
            double sw = 0;
            for (int r = 0; r < 4; r++) sw += (double)ct_f32(dy)[r * 2 + o] * ct_f32(x)[r * 3 + i];
            ASSERT_NEAR(ct_f32(m->params[0]->grad)[o * 3 + i], sw, 1e-5);
        }
    }
    ct_tensor_release(dy);
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(frozen_params_get_no_gradient)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_linear_create(3, 2, 1);
    rand_params(m, 6);
    m->params[0]->requires_grad = 0;
    ct_tensor *x = rand_tensor(2, (int64_t[]){4, 3}, 7, -1.0f, 1.0f);
    ct_record *rec;
    ct_tensor *y = fwd(m, x, &rec, &ctx), *dx;
    ASSERT_OK(ct_module_backward(m, y, &dx, rec));
    for (int i = 0; i < 6; i++) ASSERT_EQ(ct_f32(m->params[0]->grad)[i], 0.0f);
    ASSERT(ct_f32(m->params[1]->grad)[0] != 0.0f);
    ct_tensor_release(dx);
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* ---- conv2d ------------------------------------------------------------ */

static double conv_ref(const ct_tensor *x, const ct_module *m, int n, int o, int oh, int ow, int k,
                       int s, int pad)
{
    const float *w = ct_f32(m->params[0]->data);
    int C = (int)x->shape[1], H = (int)x->shape[2], W = (int)x->shape[3];
    double acc = m->nparams > 1 ? ct_f32(m->params[1]->data)[o] : 0.0;
    for (int c = 0; c < C; c++)
        for (int i = 0; i < k; i++)
            for (int j = 0; j < k; j++) {
                int ih = oh * s - pad + i, iw = ow * s - pad + j;
                if (ih < 0 || ih >= H || iw < 0 || iw >= W) continue;
                acc += (double)w[((o * C + c) * k + i) * k + j] *
                       ct_f32(x)[(((int64_t)n * C + c) * H + ih) * W + iw];
            }
    return acc;
}

static void check_conv_forward(int N, int C, int H, int W, int Co, int k, int s, int pad, int stepw)
{
    ct_module *m = ct_conv2d_create(C, Co, k, s, pad, 1);
    rand_params(m, 8);
    ct_tensor *x = rand_tensor(4, (int64_t[]){N, C, H, W}, 9, -1.0f, 1.0f);
    ct_tensor *y = fwd(m, x, NULL, NULL);
    int Ho = (H + 2 * pad - k) / s + 1, Wo = (W + 2 * pad - k) / s + 1;
    ASSERT_EQ(y->shape[2], Ho);
    ASSERT_EQ(y->shape[3], Wo);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < Co; o++)
            for (int oh = 0; oh < Ho; oh += stepw)
                for (int ow = 0; ow < Wo; ow += stepw)
                    ASSERT_NEAR(ct_f32(y)[(((int64_t)n * Co + o) * Ho + oh) * Wo + ow],
                                conv_ref(x, m, n, o, oh, ow, k, s, pad), 1e-4);
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(conv2d_forward_matches_direct_convolution)
{
    check_conv_forward(3, 2, 9, 8, 4, 3, 2, 1, 1);  /* batched path */
    check_conv_forward(1, 3, 6, 6, 2, 5, 1, 2, 1);  /* one image: direct path */
    /* col holds 128K floats: 36*1296 per image fits 2 of 3 (chunks of 2 and 1). */
    check_conv_forward(3, 4, 36, 36, 2, 3, 1, 1, 1);
    /* 144*1024 per image: one image per chunk. */
    check_conv_forward(2, 16, 32, 32, 2, 3, 1, 1, 1);
}

/* Backward over several chunks equals the sum of the per-image backwards. */
static void check_conv_chunks(int N, int C, int HW, uint64_t seed)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_conv2d_create(C, 2, 3, 1, 1, 1);
    rand_params(m, seed);
    ct_tensor *x = rand_tensor(4, (int64_t[]){N, C, HW, HW}, seed + 1, -1.0f, 1.0f);
    ct_tensor *dy = rand_tensor(4, (int64_t[]){N, 2, HW, HW}, seed + 2, -1.0f, 1.0f);
    ct_record *rec;
    ct_tensor *y = fwd(m, x, &rec, &ctx), *dx;
    ASSERT_OK(ct_module_backward(m, dy, &dx, rec));
    ct_tensor *gw = ct_tensor_clone(m->params[0]->grad, CT_MEM_OTHER);
    ct_tensor *gb = ct_tensor_clone(m->params[1]->grad, CT_MEM_OTHER);
    ct_module_zero_grad(m);
    int64_t xs = (int64_t)C * HW * HW, ys = 2 * HW * HW;
    for (int n = 0; n < N; n++) {
        ct_tensor *xn = ct_tensor_view(x, n * xs, 4, (int64_t[]){1, C, HW, HW});
        ct_tensor *dyn = ct_tensor_view(dy, n * ys, 4, (int64_t[]){1, 2, HW, HW});
        ct_tensor *yn = fwd(m, xn, &rec, &ctx), *dxn;
        for (int64_t i = 0; i < ys; i++) ASSERT_NEAR(ct_f32(yn)[i], ct_f32(y)[n * ys + i], 1e-5);
        ASSERT_OK(ct_module_backward(m, dyn, &dxn, rec));
        for (int64_t i = 0; i < xs; i++) ASSERT_NEAR(ct_f32(dxn)[i], ct_f32(dx)[n * xs + i], 1e-5);
        ct_tensor_release(dxn);
        ct_tensor_release(yn);
        ct_tensor_release(dyn);
        ct_tensor_release(xn);
    }
    for (int64_t i = 0; i < gw->numel; i++) ASSERT_CLOSE(ct_f32(m->params[0]->grad)[i], ct_f32(gw)[i], 1e-4, 1e-3);
    for (int i = 0; i < 2; i++) ASSERT_CLOSE(ct_f32(m->params[1]->grad)[i], ct_f32(gb)[i], 1e-4, 1e-3);
    ct_tensor *ts[] = {gw, gb, dx, y, dy, x};
    for (int i = 0; i < 6; i++) ct_tensor_release(ts[i]);
    ct_module_destroy(m);
}

TEST(conv2d_backward_chunks_match_single_images)
{
    check_conv_chunks(3, 4, 36, 10);  /* chunks of 2 and 1 */
    check_conv_chunks(2, 16, 32, 20); /* one image per chunk */
    check_conv_chunks(5, 2, 8, 30);   /* all in one chunk */
}

TEST(maxpool2d_forward_values)
{
    ct_module *m = ct_maxpool2d_create(2, 0);
    float v[16] = {1, 5, 2, 0, 3, 4, 9, 8, -1, -2, -3, -4, -5, -6, -7, -0.5f};
    ct_tensor *x = ct_tensor_create4(1, 1, 4, 4, CT_MEM_ACT);
    memcpy(ct_tensor_data(x), v, sizeof v);
    ct_tensor *y = fwd(m, x, NULL, NULL);
    ASSERT_EQ(y->shape[2], 2);
    ASSERT_NEAR(ct_f32(y)[0], 5, 0);
    ASSERT_NEAR(ct_f32(y)[1], 9, 0);
    ASSERT_NEAR(ct_f32(y)[2], -1, 0);
    ASSERT_NEAR(ct_f32(y)[3], -0.5, 0);
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* ---- activations ------------------------------------------------------- */

TEST(activation_forward_values)
{
    ct_module *g = ct_gelu_create(), *r = ct_relu_create(), *t = ct_tanh_create();
    ct_tensor *x = ct_tensor_create1(4, CT_MEM_ACT);
    float v[4] = {-2.0f, -0.5f, 0.0f, 1.5f};
    memcpy(ct_tensor_data(x), v, sizeof v);
    ct_tensor *yg = fwd(g, x, NULL, NULL), *yr = fwd(r, x, NULL, NULL), *yt = fwd(t, x, NULL, NULL);
    /* torch.nn.functional.gelu(torch.tensor([-2, -.5, 0, 1.5])) */
    double ref[4] = {-0.04550026, -0.15426877, 0.0, 1.39978920};
    for (int i = 0; i < 4; i++) {
        ASSERT_NEAR(ct_f32(yg)[i], ref[i], 1e-6);
        ASSERT_NEAR(ct_f32(yr)[i], v[i] > 0 ? v[i] : 0, 0);
        ASSERT_NEAR(ct_f32(yt)[i], tanh(v[i]), 1e-6);
    }
    ct_tensor_release(yg);
    ct_tensor_release(yr);
    ct_tensor_release(yt);
    ct_tensor_release(x);
    ct_module_destroy(g);
    ct_module_destroy(r);
    ct_module_destroy(t);
}

TEST(layernorm_forward_normalises_rows)
{
    ct_module *m = ct_layernorm_create(5, 1e-5f);
    ct_tensor *x = rand_tensor(2, (int64_t[]){3, 5}, 13, 10.0f, 14.0f);
    ct_tensor *y = fwd(m, x, NULL, NULL);
    for (int r = 0; r < 3; r++) {
        double s = 0, ss = 0;
        for (int i = 0; i < 5; i++) s += ct_f32(y)[r * 5 + i];
        for (int i = 0; i < 5; i++) ss += ct_f32(y)[r * 5 + i] * ct_f32(y)[r * 5 + i];
        ASSERT_NEAR(s / 5, 0.0, 1e-5);
        ASSERT_NEAR(ss / 5, 1.0, 1e-3); /* eps shrinks it a hair */
    }
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* ---- batchnorm running stats ------------------------------------------- */

TEST(batchnorm_running_stats_and_eval)
{
    ct_fwd_ctx tr = train_ctx(), ev = {.training = 0};
    ct_module *m = ct_batchnorm_create(2, 1e-5f, 0.1f);
    ASSERT_EQ(m->nbuffers, 3);
    ASSERT(!strcmp(m->buffers[0]->local, "running_mean"));
    ASSERT(!strcmp(m->buffers[1]->local, "running_var"));
    ASSERT(!strcmp(m->buffers[2]->local, "num_batches_tracked"));
    ct_tensor *x = rand_tensor(4, (int64_t[]){3, 2, 2, 2}, 14, -1.0f, 3.0f);
    double mean[2] = {0}, var[2] = {0};
    for (int c = 0; c < 2; c++) {
        for (int n = 0; n < 3; n++)
            for (int i = 0; i < 4; i++) mean[c] += ct_f32(x)[(n * 2 + c) * 4 + i];
        mean[c] /= 12;
        for (int n = 0; n < 3; n++)
            for (int i = 0; i < 4; i++) {
                double d = ct_f32(x)[(n * 2 + c) * 4 + i] - mean[c];
                var[c] += d * d;
            }
    }
    ct_tensor *y = fwd(m, x, NULL, &tr);
    ct_tensor_release(y);
    y = fwd(m, x, NULL, &tr);
    for (int c = 0; c < 2; c++) {
        /* Two updates from (0, 1): r <- 0.9 r + 0.1 v twice; variance unbiased (n - 1 = 11). */
        ASSERT_NEAR(ct_f32(m->buffers[0]->data)[c], 0.19 * mean[c], 1e-6);
        ASSERT_NEAR(ct_f32(m->buffers[1]->data)[c], 0.81 + 0.19 * var[c] / 11, 1e-5);
        /* Training output uses the biased batch variance. */
        double want = (ct_f32(x)[c * 4] - mean[c]) / sqrt(var[c] / 12 + 1e-5);
        ASSERT_NEAR(ct_f32(y)[c * 4], want, 1e-4);
    }
    ASSERT_NEAR(ct_f32(m->buffers[2]->data)[0], 2.0, 0);
    ct_tensor_release(y);
    /* Eval uses the running stats and leaves them alone. */
    float rm0 = ct_f32(m->buffers[0]->data)[0], rv0 = ct_f32(m->buffers[1]->data)[0];
    y = fwd(m, x, NULL, &ev);
    ASSERT_NEAR(ct_f32(y)[0], (ct_f32(x)[0] - rm0) / sqrt(rv0 + 1e-5), 1e-5);
    ASSERT_NEAR(ct_f32(m->buffers[2]->data)[0], 2.0, 0);
    ASSERT_EQ(ct_f32(m->buffers[0]->data)[0], rm0);
    ct_tensor_release(y);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* ---- dropout ----------------------------------------------------------- */

static ct_tensor *ones(int64_t n)
{
    ct_tensor *t = ct_tensor_create1(n, CT_MEM_ACT);
    ct_tensor_fill(t, 1.0f);
    return t;
}

/* The mask is a function of (seed, step, stream, global row, element): the
 * same context repeats it, another step redraws it, and sample0 only moves
 * which global rows a call covers. */
TEST(dropout_mask_is_deterministic_per_step_and_row)
{
    ct_module *m = ct_dropout_create(0.3f);
    ct_tensor *x = ct_tensor_create2(200, 100, CT_MEM_ACT);
    ct_tensor_fill(x, 1.0f);
    ct_fwd_ctx a = train_ctx(), b = a, c = a;
    b.step++;
    c.sample0 += 7;
    ct_tensor *ya = fwd(m, x, NULL, &a), *ya2 = fwd(m, x, NULL, &a);
    ct_tensor *yb = fwd(m, x, NULL, &b), *yc = fwd(m, x, NULL, &c);
    int64_t dropped = 0, diff_b = 0, diff_c = 0, n = x->numel;
    for (int64_t i = 0; i < n; i++) {
        float v = ct_f32(ya)[i];
        ASSERT(v == 0.0f || fabsf(v - 1.0f / 0.7f) < 1e-6f); /* kept values scaled by 1/(1-p) */
        ASSERT_EQ(v, ct_f32(ya2)[i]);
        dropped += v == 0.0f;
        diff_b += v != ct_f32(yb)[i];
        diff_c += v != ct_f32(yc)[i];
    }
    /* Row r of the call starting at global row 7 is row r + 7 of the one at 0. */
    ASSERT(!memcmp(ct_f32(yc), ct_f32(ya) + 7 * 100, (size_t)(193 * 100) * sizeof(float)));
    /* Fraction ~ p: 0.3 +- 4.5 sigma of a binomial over 20000 draws. */
    ASSERT_NEAR((double)dropped / n, 0.3, 0.015);
    /* Independent masks disagree on 2p(1-p) = 42% of elements. */
    ASSERT_NEAR((double)diff_b / n, 0.42, 0.03);
    ASSERT_NEAR((double)diff_c / n, 0.42, 0.03);
    ct_tensor *ys[] = {ya, ya2, yb, yc};
    for (int i = 0; i < 4; i++) ct_tensor_release(ys[i]);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(dropout_streams_differ_by_module_name)
{
    ct_module *seq = ct_sequential_create();
    ASSERT_OK(ct_module_add(seq, "a", ct_dropout_create(0.5f)));
    ASSERT_OK(ct_module_add(seq, "b", ct_dropout_create(0.5f)));
    ct_tensor *x = ones(4000);
    ct_fwd_ctx ctx = train_ctx();
    ct_tensor *ya = fwd(seq->kids[0], x, NULL, &ctx), *yb = fwd(seq->kids[1], x, NULL, &ctx);
    int64_t diff = 0;
    for (int64_t i = 0; i < x->numel; i++) diff += ct_f32(ya)[i] != ct_f32(yb)[i];
    ASSERT(diff > 1500);
    ct_tensor_release(ya);
    ct_tensor_release(yb);
    ct_tensor_release(x);
    ct_module_destroy(seq);
}

TEST(dropout_backward_uses_forward_mask)
{
    ct_module *m = ct_dropout_create(0.5f);
    ct_tensor *x = ones(1000), *g = ones(1000);
    ct_fwd_ctx ctx = train_ctx();
    ct_record *rec;
    ct_tensor *y = fwd(m, x, &rec, &ctx), *dx;
    ASSERT_OK(ct_module_backward(m, g, &dx, rec));
    for (int i = 0; i < 1000; i++) ASSERT_EQ(ct_f32(dx)[i], ct_f32(y)[i]); /* both 0 or 2 */
    ct_tensor_release(dx);
    ct_tensor_release(y);
    ct_tensor_release(g);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* The identity (eval, or p = 0 in training) costs nothing: forward returns
 * its input and backward the output gradient, each as a new reference, with
 * the values untouched and no memory allocated. */
TEST(dropout_eval_is_identity)
{
    ct_module *ms[2] = {ct_dropout_create(0.5f), ct_dropout_create(0.0f)};
    ct_fwd_ctx ctxs[2] = {{.training = 0, .seed = 1234, .step = 5}, train_ctx()};
    ct_tensor *x = rand_tensor(1, (int64_t[]){500}, 15, -1.0f, 1.0f), *g = rand_tensor(1, (int64_t[]){500}, 16, -1.0f, 1.0f);
    ct_tensor *x0 = ct_tensor_clone(x, CT_MEM_ACT), *g0 = ct_tensor_clone(g, CT_MEM_ACT);
    for (int k = 0; k < 2; k++) {
        ct_record *rec;
        size_t act = ct_mem_current(CT_MEM_ACT);
        ct_tensor *y = fwd(ms[k], x, &rec, &ctxs[k]), *dx;
        ASSERT(y == x);
        ASSERT_OK(ct_module_backward(ms[k], g, &dx, rec));
        ASSERT(dx == g);
        ASSERT_EQ(ct_mem_current(CT_MEM_ACT), act);
        ASSERT(!memcmp(ct_f32(x), ct_f32(x0), 500 * sizeof(float)));
        ASSERT(!memcmp(ct_f32(g), ct_f32(g0), 500 * sizeof(float)));
        ct_tensor_release(dx);
        ct_tensor_release(y);
        ct_module_destroy(ms[k]);
    }
    ct_tensor_release(g0);
    ct_tensor_release(x0);
    ct_tensor_release(g);
    ct_tensor_release(x);
    ASSERT(ct_dropout_create(1.0f) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "[0, 1)");
    ASSERT(ct_dropout_create(-0.1f) == NULL);
}

/* ---- embedding --------------------------------------------------------- */

TEST(embedding_lookup_and_repeated_indices_accumulate)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_embedding_create(6, 2);
    rand_params(m, 16);
    for (int dt = 0; dt < 2; dt++) {
        ct_module_zero_grad(m);
        ct_tensor *idx = ct_tensor_create(dt ? CT_I64 : CT_I32, 1, (int64_t[]){4}, CT_MEM_ACT);
        int v[4] = {3, 5, 3, 3};
        for (int i = 0; i < 4; i++) {
            if (dt) ((int64_t *)ct_tensor_data(idx))[i] = v[i];
            else ((int32_t *)ct_tensor_data(idx))[i] = v[i];
        }
        ct_record *rec;
        ct_tensor *y = fwd(m, idx, &rec, &ctx), *din = (ct_tensor *)1;
        ASSERT_EQ(y->ndim, 2);
        ASSERT_EQ(y->shape[1], 2);
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 2; j++)
                ASSERT_EQ(ct_f32(y)[i * 2 + j], ct_f32(m->params[0]->data)[v[i] * 2 + j]);
        ct_tensor *dy = rand_tensor(2, (int64_t[]){4, 2}, 17, -1.0f, 1.0f);
        ASSERT_OK(ct_module_backward(m, dy, &din, rec));
        ASSERT(din == NULL);
        const float *g = ct_f32(m->params[0]->grad), *d = ct_f32(dy);
        for (int j = 0; j < 2; j++) {
            ASSERT_NEAR(g[3 * 2 + j], (double)d[0 + j] + d[4 + j] + d[6 + j], 1e-6);
            ASSERT_NEAR(g[5 * 2 + j], d[2 + j], 0);
            ASSERT_EQ(g[0 * 2 + j], 0.0f);
        }
        ct_tensor_release(dy);
        ct_tensor_release(y);
        ct_tensor_release(idx);
    }
    ct_module_destroy(m);
}

TEST(embedding_rejects_out_of_range_index)
{
    ct_module *seq = ct_sequential_create();
    ASSERT_OK(ct_module_add(seq, "tok", ct_embedding_create(10, 4)));
    ct_tensor *idx = ct_tensor_create(CT_I32, 1, (int64_t[]){3}, CT_MEM_ACT);
    ((int32_t *)ct_tensor_data(idx))[1] = 10;
    ct_tensor *y;
    ASSERT_ERR(ct_module_forward(seq, idx, &y, NULL, NULL), CT_EINVAL, "embedding 'tok': index 10");
    ASSERT_STR_CONTAINS(ct_last_error(), "num_embeddings 10");
    ((int32_t *)ct_tensor_data(idx))[1] = -1;
    ASSERT_ERR(ct_module_forward(seq, idx, &y, NULL, NULL), CT_EINVAL, "index -1 at position 1");
    ct_tensor *f = ct_tensor_create1(3, CT_MEM_ACT);
    ASSERT_ERR(ct_module_forward(seq, f, &y, NULL, NULL), CT_EINVAL, "I32 or I64");
    ct_tensor_release(f);
    ct_tensor_release(idx);
    ct_module_destroy(seq);
}

/* ---- cross-entropy ----------------------------------------------------- */

TEST(cross_entropy_value_grad_and_ignore_index)
{
    /* Rows: [1,2,3]->2, [1,1,1]->0, [5,0,-5]->ignored, [0,10,0]->1. */
    float z[12] = {1, 2, 3, 1, 1, 1, 5, 0, -5, 0, 10, 0};
    int64_t t[4] = {2, 0, -100, 1};
    ct_tensor *logits = ct_tensor_create2(4, 3, CT_MEM_ACT);
    ct_tensor *tg = ct_tensor_create(CT_I64, 1, (int64_t[]){4}, CT_MEM_ACT);
    memcpy(ct_tensor_data(logits), z, sizeof z);
    memcpy(ct_tensor_data(tg), t, sizeof t);
    float loss;
    ct_tensor *d;
    ASSERT_OK(ct_cross_entropy(logits, tg, -100, &loss, &d));
    /* By hand: log(e+e^2+e^3)-3 = 0.40760596, log 3 = 1.09861229,
     * log(1+2e^-10) = 9.0796e-05; mean over the 3 counted rows. */
    ASSERT_NEAR(loss, (0.40760596 + 1.09861229 + 9.07957e-05) / 3.0, 1e-6);
    for (int j = 0; j < 3; j++) ASSERT_EQ(ct_f32(d)[6 + j], 0.0f); /* ignored row */
    /* Row 1: softmax = 1/3 each, minus one-hot at 0, over 3 rows. */
    ASSERT_NEAR(ct_f32(d)[3], (1.0 / 3 - 1) / 3, 1e-7);
    ASSERT_NEAR(ct_f32(d)[4], (1.0 / 3) / 3, 1e-7);
    ct_tensor_release(d);

    /* FD on the logits: the loss itself is the scalar. */
    ASSERT_OK(ct_cross_entropy(logits, tg, -100, &loss, &d));
    for (int i = 0; i < 12; i++) {
        float v = ct_f32(logits)[i], lp, lm;
        ct_f32(logits)[i] = v + 1e-2f;
        ASSERT_OK(ct_cross_entropy(logits, tg, -100, &lp, NULL));
        ct_f32(logits)[i] = v - 1e-2f;
        ASSERT_OK(ct_cross_entropy(logits, tg, -100, &lm, NULL));
        ct_f32(logits)[i] = v;
        ASSERT_NEAR(ct_f32(d)[i], ((double)lp - lm) / 2e-2, 2e-4);
    }
    ct_tensor_release(d);

    ASSERT_EQ(ct_count_correct(logits, tg, -100), 3); /* rows 0, 3, and 1 (a tie goes to class 0) */
    ct_tensor_release(tg);
    ct_tensor_release(logits);
}

TEST(cross_entropy_count_correct_ties_and_i32)
{
    float z[6] = {1, 1, 0, 0, 2, 2};
    int32_t t[2] = {1, 1};
    ct_tensor *logits = ct_tensor_create2(2, 3, CT_MEM_ACT);
    ct_tensor *tg = ct_tensor_create(CT_I32, 1, (int64_t[]){2}, CT_MEM_ACT);
    memcpy(ct_tensor_data(logits), z, sizeof z);
    memcpy(ct_tensor_data(tg), t, sizeof t);
    ASSERT_EQ(ct_count_correct(logits, tg, -100), 1); /* ties go to the first max */
    ct_tensor_release(tg);
    ct_tensor_release(logits);
}

TEST(cross_entropy_large_logits_are_stable)
{
    ct_tensor *logits = ct_tensor_create2(1, 2, CT_MEM_ACT);
    ct_tensor *tg = ct_tensor_create(CT_I32, 1, (int64_t[]){1}, CT_MEM_ACT);
    ct_f32(logits)[0] = 1000.0f;
    ct_f32(logits)[1] = 999.0f;
    ((int32_t *)ct_tensor_data(tg))[0] = 1;
    float loss;
    ct_tensor *d;
    ASSERT_OK(ct_cross_entropy(logits, tg, -1, &loss, &d));
    ASSERT_NEAR(loss, 1.31326169, 1e-5); /* log(1 + e) */
    ASSERT(isfinite(ct_f32(d)[0]) && isfinite(ct_f32(d)[1]));
    ct_tensor_release(d);
    ct_tensor_release(tg);
    ct_tensor_release(logits);
}

TEST(cross_entropy_all_ignored_and_bad_targets)
{
    ct_tensor *logits = rand_tensor(2, (int64_t[]){3, 4}, 18, -1.0f, 1.0f);
    ct_tensor *tg = ct_tensor_create(CT_I64, 1, (int64_t[]){3}, CT_MEM_ACT);
    for (int i = 0; i < 3; i++) ((int64_t *)ct_tensor_data(tg))[i] = -100;
    float loss = 123;
    ct_tensor *d;
    ASSERT_OK(ct_cross_entropy(logits, tg, -100, &loss, &d));
    ASSERT_EQ(loss, 0.0f);
    for (int i = 0; i < 12; i++) ASSERT_EQ(ct_f32(d)[i], 0.0f);
    ct_tensor_release(d);
    ((int64_t *)ct_tensor_data(tg))[2] = 4;
    ASSERT_ERR(ct_cross_entropy(logits, tg, -100, &loss, &d), CT_EINVAL, "target 4 at row 2");
    ASSERT(d == NULL);
    ((int64_t *)ct_tensor_data(tg))[2] = -3;
    ASSERT_ERR(ct_cross_entropy(logits, tg, -100, &loss, NULL), CT_EINVAL, "target -3 at row 2");
    ASSERT_EQ(ct_count_correct(logits, tg, -100), -1);
    ct_tensor *short_t = ct_tensor_create(CT_I64, 1, (int64_t[]){2}, CT_MEM_ACT);
    ASSERT_ERR(ct_cross_entropy(logits, short_t, -100, &loss, NULL), CT_EINVAL, "2 targets");
    ct_tensor_release(short_t);
    ct_tensor_release(tg);
    ct_tensor_release(logits);
}

/* ---- gradient accumulation --------------------------------------------- */

/* Two forward/backward passes without zeroing give exactly twice the gradient. */
static void check_accumulates(ct_module *m, ct_tensor *x)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    ASSERT(np > 0);
    ct_module_zero_grad(m);
    ct_tensor *once[8];
    ASSERT(np <= 8);
    for (int pass = 0; pass < 2; pass++) {
        ct_record *rec;
        ct_tensor *y = fwd(m, x, &rec, &ctx), *dx = NULL;
        ct_tensor *dy = rand_tensor(y->ndim, y->shape, 19, -1.0f, 1.0f);
        ASSERT_OK(ct_module_backward(m, dy, x->dtype == CT_F32 ? &dx : NULL, rec));
        if (pass == 0)
            for (int i = 0; i < np; i++) once[i] = ct_tensor_clone(ps[i]->grad, CT_MEM_OTHER);
        ct_tensor_release(dx);
        ct_tensor_release(dy);
        ct_tensor_release(y);
    }
    for (int i = 0; i < np; i++) {
        double mx = 0;
        for (int64_t j = 0; j < once[i]->numel; j++) {
            ASSERT_CLOSE(ct_f32(ps[i]->grad)[j], 2.0 * ct_f32(once[i])[j], 1e-6, 1e-7);
            mx = fmax(mx, fabs(ct_f32(once[i])[j]));
        }
        ASSERT(mx > 0);
        ct_tensor_release(once[i]);
    }
    ct_free(ps);
}

TEST(param_gradients_accumulate)
{
    ct_module *ms[] = {ct_linear_create(4, 3, 1), ct_conv2d_create(2, 3, 3, 2, 1, 1),
                       ct_layernorm_create(4, 1e-5f), ct_batchnorm_create(2, 1e-5f, 0.1f),
                       ct_embedding_create(5, 4)};
    ct_tensor *xs[] = {rand_tensor(2, (int64_t[]){3, 4}, 20, -1, 1),
                       rand_tensor(4, (int64_t[]){2, 2, 5, 5}, 21, -1, 1),
                       rand_tensor(2, (int64_t[]){3, 4}, 22, -1, 1),
                       rand_tensor(4, (int64_t[]){2, 2, 3, 3}, 23, -1, 1),
                       ct_tensor_create(CT_I32, 1, (int64_t[]){3}, CT_MEM_ACT)};
    ((int32_t *)ct_tensor_data(xs[4]))[0] = 4;
    for (int k = 0; k < 5; k++) {
        rand_params(ms[k], 24 + (uint64_t)k);
        check_accumulates(ms[k], xs[k]);
        ct_tensor_release(xs[k]);
        ct_module_destroy(ms[k]);
    }
}

/* ---- input checks ------------------------------------------------------ */

TEST(bad_inputs_are_rejected_naming_the_module)
{
    ct_module *net = ct_sequential_create();
    ASSERT_OK(ct_module_add(net, "fc1", ct_linear_create(512, 10, 1)));
    ct_tensor *x = ct_tensor_create2(4, 784, CT_MEM_ACT), *y = NULL;
    ASSERT_ERR(ct_module_forward(net, x, &y, NULL, NULL), CT_EINVAL,
               "linear 'fc1': input [4, 784] has 784 features but the layer expects 512");
    ASSERT(y == NULL);
    ct_tensor_release(x);
    ct_module_destroy(net);

    ct_module *m = ct_linear_create(3, 2, 0);
    ct_tensor *xi = ct_tensor_create(CT_I64, 2, (int64_t[]){2, 3}, CT_MEM_ACT);
    ASSERT_ERR(ct_module_forward(m, xi, &y, NULL, NULL), CT_EINVAL, "input is I64");
    ct_tensor_release(xi);
    ct_module_destroy(m);

    net = ct_sequential_create();
    ASSERT_OK(ct_module_add(net, "conv", ct_conv2d_create(3, 4, 3, 1, 0, 1)));
    ASSERT_OK(ct_module_add(net, "bn", ct_batchnorm_create(4, 1e-5f, 0.1f)));
    ASSERT_OK(ct_module_add(net, "pool", ct_maxpool2d_create(2, 2)));
    ct_tensor *x4 = ct_tensor_create4(2, 1, 8, 8, CT_MEM_ACT);
    ASSERT_ERR(ct_module_forward(net, x4, &y, NULL, NULL), CT_EINVAL, "conv2d 'conv'");
    ASSERT_STR_CONTAINS(ct_last_error(), "[N, 3, H, W]");
    ct_tensor_release(x4);
    x4 = ct_tensor_create4(2, 3, 2, 8, CT_MEM_ACT);
    ASSERT_ERR(ct_module_forward(net, x4, &y, NULL, NULL), CT_EINVAL, "smaller than the 3x3 kernel");
    ct_tensor_release(x4);
    ct_tensor *x3 = ct_tensor_create2(2, 5, CT_MEM_ACT);
    ASSERT_ERR(ct_module_forward(net->kids[1], x3, &y, NULL, NULL), CT_EINVAL, "batchnorm 'bn'");
    ASSERT_ERR(ct_module_forward(net->kids[2], x3, &y, NULL, NULL), CT_EINVAL, "maxpool2d 'pool'");
    ct_tensor_release(x3);
    x4 = ct_tensor_create4(1, 4, 1, 1, CT_MEM_ACT);
    ct_fwd_ctx tr = train_ctx();
    ASSERT_ERR(ct_module_forward(net->kids[1], x4, &y, NULL, &tr), CT_EINVAL,
               "more than 1 value per channel");
    ASSERT_ERR(ct_module_forward(net->kids[2], x4, &y, NULL, &tr), CT_EINVAL, "2x2 window");
    ct_tensor_release(x4);
    ct_module_destroy(net);

    m = ct_layernorm_create(8, 1e-5f);
    x3 = ct_tensor_create2(2, 5, CT_MEM_ACT);
    ASSERT_ERR(ct_module_forward(m, x3, &y, NULL, NULL), CT_EINVAL, "layernorm '(root)'");
    ct_tensor_release(x3);
    ct_module_destroy(m);

    ASSERT(ct_linear_create(0, 3, 1) == NULL);
    ASSERT(ct_conv2d_create(1, 1, 0, 1, 0, 1) == NULL);
    ASSERT(ct_batchnorm_create(3, 1e-5f, 1.5f) == NULL);
    ASSERT(ct_embedding_create(0, 3) == NULL);
}

TEST(backward_rejects_wrong_gradient_shape)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_linear_create(3, 2, 1);
    ct_tensor *x = ct_tensor_create2(4, 3, CT_MEM_ACT), *bad = ct_tensor_create2(4, 3, CT_MEM_ACT), *dx;
    ct_record *rec;
    ct_tensor *y = fwd(m, x, &rec, &ctx);
    ASSERT_ERR(ct_module_backward(m, bad, &dx, rec), CT_EINVAL, "output gradient");
    ct_tensor_release(y);
    ct_tensor_release(bad);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(layers_survive_allocation_failures)
{
    /* Every allocation a forward + backward makes fails in turn: errors, never crashes or leaks. */
    ct_fwd_ctx ctx = train_ctx();
    ct_module *ms[] = {ct_linear_create(4, 3, 1), ct_conv2d_create(2, 3, 3, 1, 1, 1),
                       ct_layernorm_create(4, 1e-5f), ct_batchnorm_create(2, 1e-5f, 0.1f),
                       ct_dropout_create(0.5f), ct_maxpool2d_create(2, 2), ct_flatten_create(), ct_gelu_create()};
    int64_t shp[][4] = {{2, 4}, {2, 2, 4, 4}, {2, 4}, {2, 2, 4, 4}, {2, 4}, {2, 2, 4, 4}, {2, 2, 4, 4}, {2, 4}};
    int nd[] = {2, 4, 2, 4, 2, 4, 4, 2};
    for (int k = 0; k < 8; k++) {
        ct_tensor *x = rand_tensor(nd[k], shp[k], 30, -1, 1);
        int ok = 0;
        for (long f = 0; f < 40 && !ok; f++) {
            ct_mem_fail_after(f);
            ct_record *rec;
            ct_tensor *y, *dx = NULL;
            ct_status s = ct_module_forward(ms[k], x, &y, &rec, &ctx);
            if (s == CT_OK) {
                s = ct_module_backward(ms[k], y, &dx, rec);
                ct_tensor_release(y);
                ct_tensor_release(dx);
            }
            ct_mem_fail_after(-1);
            if (s == CT_OK) ok = 1;
            else ASSERT_EQ(s, CT_ENOMEM);
        }
        ASSERT(ok);
        ct_tensor_release(x);
        ct_module_destroy(ms[k]);
    }
    for (int c = 0; c < CT_MEM_NCAT; c++)
        if (c != CT_MEM_PARAM && c != CT_MEM_GRAD && c != CT_MEM_OTHER) ASSERT_EQ(ct_mem_current(c), 0);
}

/* ---- output shapes ----------------------------------------------------- */

/* ct_module_out_shape of m at shape equals the shape forward returns. */
static void check_out_shape(ct_module *m, ct_dtype dt, int ndim, const int64_t *shape)
{
    int on = -1;
    int64_t os[CT_MAX_DIMS];
    ASSERT_OK(ct_module_out_shape(m, ndim, shape, &on, os));
    ct_tensor *x = ct_tensor_create(dt, ndim, shape, CT_MEM_ACT); /* zeros: valid indices too */
    ct_fwd_ctx ctx = train_ctx();
    ct_tensor *y = fwd(m, x, NULL, &ctx);
    char a[64], b[64];
    ct_tensor h = *y;
    h.ndim = on;
    memcpy(h.shape, os, sizeof os);
    if (on != y->ndim || memcmp(os, y->shape, (size_t)on * sizeof *os))
        ct_test_fail(__FILE__, __LINE__, "%s: inferred %s, forward gave %s", m->ops->kind,
                     ct_shape_str(&h, a, sizeof a), ct_shape_str(y, b, sizeof b));
    ct_tensor_release(x);
    ct_tensor_release(y);
}

TEST(layers_out_shape_matches_forward)
{
    struct {
        ct_module *m;
        ct_dtype dt;
        int ndim;
        int64_t shape[4];
    } cases[] = {
        {ct_linear_create(7, 5, 1), CT_F32, 2, {3, 7}},
        {ct_linear_create(7, 5, 0), CT_F32, 3, {2, 3, 7}},
        {ct_relu_create(), CT_F32, 3, {2, 3, 4}},
        {ct_gelu_create(), CT_F32, 1, {5}},
        {ct_tanh_create(), CT_F32, 4, {1, 2, 3, 4}},
        {ct_layernorm_create(6, 1e-5f), CT_F32, 3, {2, 4, 6}},
        {ct_embedding_create(10, 6), CT_I64, 2, {2, 5}},
        {ct_embedding_create(10, 6), CT_I32, 1, {4}},
        {ct_dropout_create(0.5f), CT_F32, 2, {4, 6}},
        {ct_conv2d_create(3, 4, 3, 1, 1, 1), CT_F32, 4, {2, 3, 8, 8}},
        {ct_conv2d_create(3, 4, 5, 2, 1, 0), CT_F32, 4, {2, 3, 9, 11}},
        {ct_maxpool2d_create(2, 0), CT_F32, 4, {2, 3, 8, 6}},
        {ct_maxpool2d_create(3, 2), CT_F32, 4, {2, 3, 7, 9}},
        {ct_batchnorm_create(3, 1e-5f, 0.1f), CT_F32, 2, {4, 3}},
        {ct_batchnorm_create(3, 1e-5f, 0.1f), CT_F32, 4, {2, 3, 4, 5}},
        {ct_flatten_create(), CT_F32, 4, {2, 3, 4, 5}},
        {ct_flatten_create(), CT_F32, 1, {7}},
        {ct_residual_create(ct_linear_create(4, 4, 1)), CT_F32, 2, {3, 4}},
        {ct_checkpoint_create(ct_conv2d_create(2, 5, 3, 2, 0, 1)), CT_F32, 4, {1, 2, 9, 9}},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) {
        ASSERT(cases[i].m);
        check_out_shape(cases[i].m, cases[i].dt, cases[i].ndim, cases[i].shape);
        ct_module_destroy(cases[i].m);
    }
    /* A sequential composes its children: a small CNN. */
    ct_module *net = ct_sequential_create();
    ASSERT_OK(ct_module_add(net, NULL, ct_conv2d_create(1, 4, 3, 1, 1, 1)));
    ASSERT_OK(ct_module_add(net, NULL, ct_batchnorm_create(4, 1e-5f, 0.1f)));
    ASSERT_OK(ct_module_add(net, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(net, NULL, ct_maxpool2d_create(2, 2)));
    ASSERT_OK(ct_module_add(net, NULL, ct_flatten_create()));
    ASSERT_OK(ct_module_add(net, NULL, ct_linear_create(4 * 5 * 5, 3, 1)));
    check_out_shape(net, CT_F32, 4, (int64_t[]){2, 1, 10, 11});
    ct_module_destroy(net);
    /* An empty sequential is the identity. */
    net = ct_sequential_create();
    check_out_shape(net, CT_F32, 2, (int64_t[]){2, 3});
    ct_module_destroy(net);
}

/* An input forward rejects is rejected by shape inference with the same cause. */
TEST(layers_out_shape_rejects_what_forward_rejects)
{
    int on;
    int64_t os[CT_MAX_DIMS];
    struct {
        ct_module *m;
        int ndim;
        int64_t shape[CT_MAX_DIMS];
        const char *why;
    } cases[] = {
        {ct_linear_create(7, 5, 1), 2, {3, 6}, "has 6 features but the layer expects 7"},
        {ct_layernorm_create(6, 1e-5f), 2, {3, 5}, "last dim 6"},
        {ct_conv2d_create(3, 4, 3, 1, 0, 1), 4, {2, 2, 8, 8}, "[N, 3, H, W]"},
        {ct_conv2d_create(3, 4, 5, 1, 0, 1), 4, {2, 3, 4, 8}, "smaller than the 5x5 kernel"},
        {ct_maxpool2d_create(3, 2), 3, {2, 7, 9}, "must be [N, C, H, W]"},
        {ct_maxpool2d_create(3, 2), 4, {2, 3, 2, 9}, "does not fit a 3x3 window"},
        {ct_batchnorm_create(3, 1e-5f, 0.1f), 2, {4, 2}, "[N, 3, ...]"},
        {ct_flatten_create(), 0, {0}, "needs a batch dim"},
        {ct_embedding_create(10, 6), CT_MAX_DIMS, {1, 1, 1, 1, 1, 1}, "dims; at most"},
        {ct_residual_create(ct_linear_create(4, 2, 1)), 2, {3, 4}, "must keep the shape"},
    };
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < n; i++) {
        ASSERT(cases[i].m);
        ASSERT_ERR(ct_module_out_shape(cases[i].m, cases[i].ndim, cases[i].shape, &on, os), CT_EINVAL,
                   cases[i].why);
        ct_module_destroy(cases[i].m);
    }
    /* A sequential names the child that fails. */
    ct_module *net = ct_sequential_create();
    ASSERT_OK(ct_module_add(net, NULL, ct_linear_create(4, 6, 1)));
    ASSERT_OK(ct_module_add(net, "head", ct_linear_create(5, 2, 1)));
    ASSERT_ERR(ct_module_out_shape(net, 2, (int64_t[]){3, 4}, &on, os), CT_EINVAL, "linear 'head'");
    ASSERT_ERR(ct_module_out_shape(net, 9, (int64_t[]){3, 4}, &on, os), CT_EINVAL, "0 to");
    ASSERT_ERR(ct_module_out_shape(net, 2, (int64_t[]){-1, 4}, &on, os), CT_EINVAL, "dim 0 is -1");
    ct_module_destroy(net);
}

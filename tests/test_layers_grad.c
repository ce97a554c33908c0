/* Finite-difference gradient checks of every layer's backward (input and parameters). */
#include "test_layers.h"

/* The checker itself must catch a wrong backward: a layer whose gradient is 3% off fails it. */
static ct_status off_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                             const ct_fwd_ctx *ctx)
{
    (void)m;
    (void)ctx;
    ct_tensor *y = ct_tensor_clone(in, CT_MEM_ACT);
    for (int64_t i = 0; i < y->numel; i++) ct_f32(y)[i] = 2.0f * ct_f32(in)[i] * ct_f32(in)[i];
    if (rec) ASSERT(ct_record_save(rec, in) == 0);
    *out = y;
    return CT_OK;
}

static ct_status off_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    (void)m;
    ct_tensor *dx = ct_tensor_clone(dout, CT_MEM_ACT);
    for (int64_t i = 0; i < dx->numel; i++)
        ct_f32(dx)[i] = 1.03f * 4.0f * ct_f32(ct_record_saved(rec, 0))[i] * ct_f32(dout)[i];
    *din = dx;
    return CT_OK;
}

TEST(fd_checker_catches_wrong_gradient)
{
    static const ct_module_ops ops = {"off", off_forward, off_backward, NULL, 0, ct_module_out_shape_same, NULL, 0};
    ct_module *m = ct_module_create(&ops, NULL);
    ct_tensor *x = rand_tensor(2, (int64_t[]){4, 5}, 1, 0.5f, 2.0f);
    ct_fwd_ctx ctx = train_ctx();
    fd_result r = fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 2);
    ASSERT(r.checked == 20);
    ASSERT(r.worst > 1.0);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_linear)
{
    ct_fwd_ctx ctx = train_ctx();
    for (int bias = 0; bias <= 1; bias++) {
        ct_module *m = ct_linear_create(6, 4, bias);
        rand_params(m, 3);
        ct_tensor *x = rand_tensor(2, (int64_t[]){5, 6}, 4, -1.0f, 1.0f);
        ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 5));
        ct_tensor_release(x);
        /* Leading dims are rows: [2, 3, 6] works the same. */
        x = rand_tensor(3, (int64_t[]){2, 3, 6}, 6, -1.0f, 1.0f);
        ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 7));
        ct_tensor_release(x);
        ct_module_destroy(m);
    }
}

/* Inputs kept at least 0.05 away from the kink at 0. */
static ct_tensor *away_from_zero(int64_t n, int64_t d, uint64_t seed)
{
    ct_tensor *x = rand_tensor(2, (int64_t[]){n, d}, seed, -2.0f, 2.0f);
    for (int64_t i = 0; i < x->numel; i++) {
        float *v = &ct_f32(x)[i];
        if (fabsf(*v) < 0.05f) *v = *v < 0 ? -0.05f - *v : 0.05f + *v;
    }
    return x;
}

TEST(fd_activations)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *ms[3] = {ct_relu_create(), ct_gelu_create(), ct_tanh_create()};
    for (int k = 0; k < 3; k++) {
        ct_tensor *x = away_from_zero(4, 9, 10 + (uint64_t)k);
        ASSERT_FD(fd_check(ms[k], x, &ctx, FD_H, FD_RTOL, FD_ATOL, 11));
        ct_tensor_release(x);
        ct_module_destroy(ms[k]);
    }
}

TEST(fd_layernorm)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_layernorm_create(7, 1e-5f);
    rand_params(m, 12);
    ct_tensor *x = rand_tensor(3, (int64_t[]){2, 3, 7}, 13, -2.0f, 3.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 14));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_conv2d_stride1_pad0)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_conv2d_create(2, 3, 3, 1, 0, 1);
    rand_params(m, 15);
    ct_tensor *x = rand_tensor(4, (int64_t[]){2, 2, 6, 5}, 16, -1.0f, 1.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 17));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_conv2d_stride2_pad1)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_conv2d_create(2, 3, 3, 2, 1, 1);
    rand_params(m, 18);
    /* Odd and even sizes: the last window hangs over the padding on one side only. */
    ct_tensor *x = rand_tensor(4, (int64_t[]){2, 2, 7, 6}, 19, -1.0f, 1.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 20));
    ct_tensor_release(x);
    /* One image takes the direct (unbatched) path. */
    x = rand_tensor(4, (int64_t[]){1, 2, 5, 5}, 21, -1.0f, 1.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 22));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_conv2d_no_bias_k1_pad2)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_conv2d_create(3, 2, 2, 3, 2, 0);
    ASSERT_EQ(m->nparams, 1);
    rand_params(m, 23);
    ct_tensor *x = rand_tensor(4, (int64_t[]){2, 3, 5, 4}, 24, -1.0f, 1.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 25));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* Distinct values spaced 0.01 apart (>> h), so no window has a near-tie. */
static ct_tensor *distinct_tensor(int ndim, const int64_t *shape, uint64_t seed)
{
    ct_tensor *x = ct_tensor_create(CT_F32, ndim, shape, CT_MEM_ACT);
    int64_t n = x->numel;
    for (int64_t i = 0; i < n; i++) ct_f32(x)[i] = (float)i * 0.01f - 0.005f * (float)n;
    ct_rng r;
    ct_rng_init(&r, seed, 5);
    for (int64_t i = n - 1; i > 0; i--) { /* Fisher-Yates */
        float u;
        ct_rng_uniform(&r, &u, 1);
        int64_t j = (int64_t)(u * (float)(i + 1));
        if (j > i) j = i;
        float t = ct_f32(x)[i];
        ct_f32(x)[i] = ct_f32(x)[j];
        ct_f32(x)[j] = t;
    }
    return x;
}

TEST(fd_maxpool2d)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_maxpool2d_create(2, 0);
    ct_tensor *x = distinct_tensor(4, (int64_t[]){2, 2, 5, 6}, 26);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 27));
    ct_tensor_release(x);
    ct_module_destroy(m);
    /* Overlapping windows: one input can win several windows and its gradient sums. */
    m = ct_maxpool2d_create(3, 1);
    x = distinct_tensor(4, (int64_t[]){1, 2, 5, 5}, 28);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 29));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_batchnorm_training_2d_and_4d)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_batchnorm_create(3, 1e-5f, 0.1f);
    rand_params(m, 30);
    ct_tensor *x = rand_tensor(2, (int64_t[]){6, 3}, 31, -1.0f, 2.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 32));
    ct_tensor_release(x);
    ct_module_destroy(m);

    m = ct_batchnorm_create(2, 1e-5f, 0.1f);
    rand_params(m, 33);
    x = rand_tensor(4, (int64_t[]){3, 2, 3, 3}, 34, -1.0f, 2.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 35));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_batchnorm_eval)
{
    ct_fwd_ctx ctx = {.training = 0, .seed = 1, .step = 0};
    ct_module *m = ct_batchnorm_create(2, 1e-5f, 0.1f);
    rand_params(m, 36);
    rand_fill(m->buffers[0]->data, 37, -0.5f, 0.5f);
    rand_fill(m->buffers[1]->data, 38, 0.5f, 2.0f);
    ct_tensor *x = rand_tensor(4, (int64_t[]){2, 2, 2, 3}, 39, -1.0f, 2.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 40));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_embedding_weight)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_embedding_create(5, 3);
    rand_params(m, 41);
    ct_tensor *idx = ct_tensor_create(CT_I64, 2, (int64_t[]){2, 3}, CT_MEM_ACT);
    int64_t v[6] = {1, 4, 1, 0, 1, 4};
    memcpy(ct_tensor_data(idx), v, sizeof v);
    fd_result r = fd_check(m, idx, &ctx, FD_H, FD_RTOL, FD_ATOL, 42);
    ASSERT_EQ(r.checked, 15); /* weight only: indices have no gradient */
    ASSERT_FD(r);
    ct_tensor_release(idx);
    ct_module_destroy(m);
}

TEST(fd_dropout_fixed_mask)
{
    ct_fwd_ctx ctx = train_ctx(); /* every FD forward draws this ctx's mask again */
    ct_module *m = ct_dropout_create(0.4f);
    ct_tensor *x = rand_tensor(2, (int64_t[]){6, 7}, 43, -1.0f, 1.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 44));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

TEST(fd_flatten)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_flatten_create();
    ct_tensor *x = rand_tensor(4, (int64_t[]){2, 3, 2, 2}, 45, -1.0f, 1.0f);
    ASSERT_FD(fd_check(m, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 46));
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* A small CNN end to end: conv -> batchnorm -> relu -> maxpool -> flatten -> linear. */
TEST(fd_small_cnn_chain)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *net = ct_sequential_create();
    ASSERT_OK(ct_module_add(net, NULL, ct_conv2d_create(1, 2, 3, 1, 1, 1)));
    ASSERT_OK(ct_module_add(net, NULL, ct_batchnorm_create(2, 1e-5f, 0.1f)));
    ASSERT_OK(ct_module_add(net, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(net, NULL, ct_maxpool2d_create(2, 2)));
    ASSERT_OK(ct_module_add(net, NULL, ct_flatten_create()));
    ASSERT_OK(ct_module_add(net, NULL, ct_linear_create(8, 3, 1)));
    for (int i = 0; i < net->nkids; i++) rand_params(net->kids[i], 47 + (uint64_t)i);
    ct_tensor *x = rand_tensor(4, (int64_t[]){2, 1, 4, 4}, 53, -1.0f, 1.0f);
    fd_result r = fd_check(net, x, &ctx, FD_H, FD_RTOL, FD_ATOL, 54);
    ASSERT_FD(r);
    ASSERT_EQ(r.checked, 32 + (18 + 2) + (2 + 2) + (24 + 3)); /* input + conv + bn + linear */
    ct_tensor_release(x);
    ct_module_destroy(net);
}

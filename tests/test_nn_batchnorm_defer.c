/*
 * Deferred batchnorm statistics: micro-batches accumulated in CT_BN_DEFER
 * and committed once move the running statistics exactly as one forward of
 * their concatenation does; CT_BN_HOLD leaves them alone; the output is the
 * batch's own normalisation in every mode.
 */
#include "test.h"

static ct_tensor *rows(ct_tensor *t, int64_t r0, int64_t n)
{
    int64_t shape[CT_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = n;
    return ct_tensor_view(t, r0 * (t->numel / t->shape[0]), t->ndim, shape);
}

static void fwd(ct_module *bn, ct_tensor *x, int64_t r0, int64_t n)
{
    ct_tensor *v = rows(x, r0, n), *y;
    ct_fwd_ctx ctx = {.training = 1};
    ASSERT_OK(ct_module_forward(bn, v, &y, NULL, &ctx));
    ct_tensor_release(y);
    ct_tensor_release(v);
}

TEST(batchnorm_deferred_commit_equals_one_batch)
{
    int64_t N = 11, C = 3, H = 2, W = 2;
    ct_tensor *x = ct_tensor_create4(N, C, H, W, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 5, 0);
    ct_rng_normal(&r, ct_f32(x), (size_t)x->numel, 2.0f, 3.0f);
    ct_module *whole = ct_batchnorm_create(C, 1e-5f, 0.3f), *split = ct_batchnorm_create(C, 1e-5f, 0.3f);
    fwd(whole, x, 0, N);
    ASSERT_OK(ct_batchnorm_set_mode(split, CT_BN_DEFER));
    fwd(split, x, 0, 4);
    fwd(split, x, 4, 4);
    fwd(split, x, 8, 3);
    ASSERT_OK(ct_batchnorm_set_mode(split, CT_BN_HOLD)); /* a recompute: not counted */
    fwd(split, x, 0, 4);
    ASSERT_OK(ct_batchnorm_set_mode(split, CT_BN_DEFER));
    /* nothing moved before the commit */
    ASSERT_NEAR(ct_f32(split->buffers[0]->data)[0], 0.0, 0);
    ASSERT_NEAR(ct_f32(split->buffers[2]->data)[0], 0.0, 0);
    ASSERT_OK(ct_batchnorm_commit(split));
    for (int b = 0; b < 3; b++)
        for (int64_t c = 0; c < split->buffers[b]->data->numel; c++)
            ASSERT_CLOSE(ct_f32(split->buffers[b]->data)[c], ct_f32(whole->buffers[b]->data)[c], 1e-5, 1e-6);
    /* a second commit with nothing new changes nothing */
    float before = ct_f32(split->buffers[0]->data)[1];
    ASSERT_OK(ct_batchnorm_commit(split));
    ASSERT_NEAR(ct_f32(split->buffers[0]->data)[1], before, 0);
    ASSERT_NEAR(ct_f32(split->buffers[2]->data)[0], 1.0, 0);
    /* errors */
    ct_module *lin = ct_linear_create(2, 2, 1);
    ASSERT_ERR(ct_batchnorm_set_mode(lin, CT_BN_DEFER), CT_EINVAL, "is not a batchnorm");
    ASSERT_ERR(ct_batchnorm_set_mode(split, 7), CT_EINVAL, "unknown statistics mode");
    ct_module_destroy(lin);
    ct_module_destroy(whole);
    ct_module_destroy(split);
    ct_tensor_release(x);
}

/* Skip connections (ct_skip_stash_create / ct_skip_pop_create): the sum
 * and its gradients, under an activation-checkpoint wrapper, and misuse. */
#include "test.h"

static ct_tensor *rand_tensor(int64_t r, int64_t c, uint64_t stream)
{
    ct_tensor *t = ct_tensor_create2(r, c, CT_MEM_ACT);
    ct_rng g;
    ct_rng_init(&g, 99, stream);
    ct_rng_normal(&g, ct_f32(t), (size_t)t->numel, 0, 1);
    return t;
}

/* x -> stash -> linear(4, 4) -> [checkpointed] pop: y = W x + b + x. */
static ct_module *res(int ckpt_pop)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_stash_create("r")));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(4, 4, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ckpt_pop ? ct_checkpoint_create(ct_skip_pop_create("r"))
                                              : ct_skip_pop_create("r")));
    ct_module_init_params(m, 3);
    return m;
}

/* Output, input gradient and weight gradient for dout = 1. */
static void run(ct_module *m, ct_tensor *x, ct_tensor **y, ct_tensor **dx, ct_tensor **dw)
{
    ct_fwd_ctx ctx = {.training = 1, .sample0 = 5};
    ct_record *rec;
    ASSERT_OK(ct_module_forward(m, x, y, &rec, &ctx));
    ct_tensor *dout = ct_tensor_create2((*y)->shape[0], (*y)->shape[1], CT_MEM_ACT);
    ct_tensor_fill(dout, 1.0f);
    ASSERT_OK(ct_module_backward(m, dout, dx, rec));
    ct_tensor_release(dout);
    *dw = ct_tensor_clone(ct_module_find(m, "1.weight")->grad, CT_MEM_ACT);
}

TEST(nn_skip_adds_the_stash_and_gives_it_its_gradient)
{
    ct_module *m = res(0), *c = res(1);
    ct_tensor *x = rand_tensor(3, 4, 1), *y, *dx, *dw, *cy, *cdx, *cdw;
    run(m, x, &y, &dx, &dw);
    const float *w = ct_f32(ct_module_find(m, "1.weight")->data), *bias = ct_f32(ct_module_find(m, "1.bias")->data);
    for (int r = 0; r < 3; r++)
        for (int o = 0; o < 4; o++) {
            double want = bias[o] + ct_f32(x)[r * 4 + o], dwant = 1.0;
            for (int i = 0; i < 4; i++) want += (double)w[o * 4 + i] * ct_f32(x)[r * 4 + i];
            for (int i = 0; i < 4; i++) dwant += w[i * 4 + o]; /* W^T 1 + 1 through the skip */
            ASSERT_CLOSE(ct_f32(y)[r * 4 + o], want, 1e-5, 1e-5);
            ASSERT_CLOSE(ct_f32(dx)[r * 4 + o], dwant, 1e-5, 1e-5);
        }
    /* the pop inside a checkpoint wrapper (recomputed in backward): the same numbers */
    run(c, x, &cy, &cdx, &cdw);
    for (int64_t i = 0; i < y->numel; i++) ASSERT_EQ(ct_f32(y)[i], ct_f32(cy)[i]);
    for (int64_t i = 0; i < dx->numel; i++) ASSERT_EQ(ct_f32(dx)[i], ct_f32(cdx)[i]);
    for (int64_t i = 0; i < dw->numel; i++) ASSERT_EQ(ct_f32(dw)[i], ct_f32(cdw)[i]);
    int nd;
    int64_t sh[CT_MAX_DIMS];
    ASSERT_OK(ct_module_out_shape(m, 2, (int64_t[]){7, 4}, &nd, sh));
    ASSERT(nd == 2 && sh[0] == 7 && sh[1] == 4);
    ct_tensor *ts[] = {x, y, dx, dw, cy, cdx, cdw};
    for (int i = 0; i < 7; i++) ct_tensor_release(ts[i]);
    ct_module_destroy(m);
    ct_module_destroy(c);
}

TEST(nn_skip_pop_without_stash_is_an_error)
{
    ct_fwd_ctx ctx = {.training = 1};
    ct_tensor *x = rand_tensor(2, 4, 2), *y = NULL;
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(4, 4, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_pop_create("r")));
    ASSERT_ERR(ct_module_forward(m, x, &y, NULL, &ctx), CT_EINVAL, "no stash named 'r'");
    ct_module_destroy(m);
    /* the stash after its pop has not run yet for these rows */
    m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_pop_create("r")));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_stash_create("r")));
    ASSERT_ERR(ct_module_forward(m, x, &y, NULL, &ctx), CT_EINVAL, "must come before the pop");
    ct_module_destroy(m);
    /* shapes must agree */
    m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_stash_create("r")));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(4, 3, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_pop_create("r")));
    ASSERT_ERR(ct_module_forward(m, x, &y, NULL, &ctx), CT_EINVAL, "of one shape");
    ct_module_destroy(m);
    ASSERT(ct_skip_stash_create("") == NULL);
    ct_tensor_release(x);
}

/* Offload runs each slice over every micro-batch before the next slice: a
 * skip from the first slice to the last keeps one entry per micro-batch
 * and the run equals one process (checkpointed layers too). */
static double offload_step(ct_strategy *s, int step)
{
    int64_t n = 12;
    ct_tensor *x = rand_tensor(n, 4, 10 + (uint64_t)step), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    for (int64_t i = 0; i < n; i++) ((int32_t *)ct_tensor_data(y))[i] = (int32_t)((i + step) % 4);
    ct_batch b = {x, y, n, 0};
    ct_fwd_ctx ctx = {.training = 1, .seed = 11, .step = (uint64_t)step};
    ct_step_out out;
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
    ASSERT_OK(ct_strategy_step(s));
    ct_strategy_zero_grad(s);
    ct_tensor_release(x);
    ct_tensor_release(y);
    return out.loss_sum;
}

TEST(nn_skip_across_offload_slices_equals_one_process)
{
    const char *opts[] = {"balance=2:2:2", "balance=2:2:2,microbatches=3,checkpoint_activation=1"};
    for (int k = 0; k < 2; k++) {
        ct_module *m[2];
        ct_strategy *s[2];
        ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
        for (int i = 0; i < 2; i++) {
            m[i] = ct_sequential_create();
            ASSERT_OK(ct_module_add(m[i], NULL, ct_skip_stash_create("r")));
            ASSERT_OK(ct_module_add(m[i], NULL, ct_linear_create(4, 4, 1)));
            ASSERT_OK(ct_module_add(m[i], NULL, ct_tanh_create()));
            ASSERT_OK(ct_module_add(m[i], NULL, ct_linear_create(4, 4, 1)));
            ASSERT_OK(ct_module_add(m[i], NULL, ct_skip_pop_create("r")));
            ASSERT_OK(ct_module_add(m[i], NULL, ct_linear_create(4, 4, 1)));
            ct_module_init_params(m[i], 9);
        }
        char full[600];
        snprintf(full, sizeof full, "%s,dir=%s", opts[k], ct_test_tmpdir());
        ASSERT_OK(ct_strategy_create("none", m[0], &oo, NULL, NULL, &s[0]));
        ASSERT_OK(ct_strategy_create("offload", m[1], &oo, NULL, full, &s[1]));
        for (int step = 0; step < 3; step++) ASSERT_CLOSE(offload_step(s[1], step), offload_step(s[0], step), 1e-5, 1e-6);
        UNWRAP(s[1]);
        UNWRAP(s[0]);
        ct_param **pa, **pb;
        int na, nb;
        ASSERT_OK(ct_module_params(m[0], &pa, &na));
        ASSERT_OK(ct_module_params(m[1], &pb, &nb));
        ASSERT_EQ(na, nb);
        for (int i = 0; i < na; i++)
            for (int64_t j = 0; j < pa[i]->data->numel; j++)
                ASSERT_CLOSE(ct_f32(pb[i]->data)[j], ct_f32(pa[i]->data)[j], 1e-5, 1e-6);
        ct_free(pa);
        ct_free(pb);
        ct_module_destroy(m[0]);
        ct_module_destroy(m[1]);
    }
}

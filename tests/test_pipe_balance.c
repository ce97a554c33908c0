/*
 * Pipeline balance helpers: contiguous stages minimising the heaviest, by
 * parameter count and by measured time (a layer that sleeps is heavy in
 * time and weightless in parameters), and their errors.
 */
#include <time.h>

#include "test.h"

TEST(pipe_balance_weights)
{
    int b[4];
    ASSERT_OK(ct_pipe_balance_weights((const double[]){1, 1, 1, 1, 1, 1}, 6, 3, b));
    ASSERT(b[0] == 2 && b[1] == 2 && b[2] == 2);
    ASSERT_OK(ct_pipe_balance_weights((const double[]){10, 1, 1, 1, 1, 1}, 6, 2, b));
    ASSERT(b[0] == 1 && b[1] == 5);
    ASSERT_OK(ct_pipe_balance_weights((const double[]){1, 2, 3, 4, 5, 6, 7, 8, 9}, 9, 3, b));
    ASSERT(b[0] == 5 && b[1] == 2 && b[2] == 2); /* 15 | 13 | 17: the heaviest is 17, the least possible */
    ASSERT_OK(ct_pipe_balance_weights((const double[]){0, 0, 0}, 3, 3, b));
    ASSERT(b[0] == 1 && b[1] == 1 && b[2] == 1); /* every stage still gets a layer */
    ASSERT_ERR(ct_pipe_balance_weights((const double[]){1, 1}, 2, 3, b), CT_EINVAL, "every stage needs a layer");
}

static ct_status sleepy_fwd(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec, const ct_fwd_ctx *ctx)
{
    (void)m, (void)rec, (void)ctx;
    nanosleep(&(struct timespec){0, 20000000}, NULL);
    *out = ct_tensor_retain(in);
    return CT_OK;
}

static ct_status sleepy_bwd(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    (void)m, (void)rec;
    if (din) *din = ct_tensor_retain(dout);
    return CT_OK;
}

static const ct_module_ops sleepy_ops = {"sleepy", sleepy_fwd, sleepy_bwd, NULL, 0, ct_module_out_shape_same, NULL, 0};

TEST(pipe_balance_by_params_and_by_time)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_module_create(&sleepy_ops, NULL)));
    for (int i = 0; i < 3; i++) ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(8, 8, 1)));
    ct_module_init_params(m, 1);
    int b[2];
    ASSERT_OK(ct_pipe_balance_by_params(m, 2, b));
    ASSERT(b[0] >= 2); /* 0 | 72 72 72 is worse than 0 72 | 72 72 */
    ASSERT_EQ(b[0] + b[1], 4);
    ct_tensor *x = ct_tensor_create2(4, 8, CT_MEM_ACT);
    ct_tensor_fill(x, 0.5f);
    /* A measurement on a busy machine can catch a tiny layer preempted for
     * longer than the 20 ms sleep; a balance that ignored time would never
     * put the sleeper alone, so one right answer in five tries is the test
     * (it was one try against a 4 ms sleeper, which a loaded machine lost). */
    int tries = 0;
    do ASSERT_OK(ct_pipe_balance_by_time(m, x, 2, b));
    while (!(b[0] == 1 && b[1] == 3) && ++tries < 5);
    ASSERT(b[0] == 1 && b[1] == 3); /* the sleeper alone */
    /* the measurement leaves no gradient behind */
    ct_param *w = ct_module_find(m, "1.weight");
    for (int64_t i = 0; i < w->grad->numel; i++) ASSERT_NEAR(ct_f32(w->grad)[i], 0, 0);
    ASSERT_ERR(ct_pipe_balance_by_params(m, 5, b), CT_EINVAL, "fewer than 5 stages");
    ASSERT_ERR(ct_pipe_balance_by_time(m, NULL, 2, b), CT_EINVAL, "needs a sample batch");
    ct_module *lin = ct_linear_create(2, 2, 1);
    ASSERT_ERR(ct_pipe_balance_by_params(lin, 1, b), CT_EINVAL, "needs a sequential model");
    ct_module_destroy(lin);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* The gpt's head counts the weight it shares with the token embedding
 * (where it is used, as each stage holding it keeps a copy): children
 * [2080, 872, 872, 16, 2048] balance 2:3 (2952 | 2936); a head counted as
 * weightless would give 1:4 (2080 | 1760). */
TEST(pipe_balance_counts_the_tied_head)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 2, 2, 8, 4, 256);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 1, &m));
    ASSERT_EQ(m->nkids, 5);
    ASSERT_EQ(ct_module_num_params(m->kids[4]), 256 * 8);
    int b[2];
    ASSERT_OK(ct_pipe_balance_by_params(m, 2, b));
    ASSERT(b[0] == 2 && b[1] == 3);
    ct_module_destroy(m);
}

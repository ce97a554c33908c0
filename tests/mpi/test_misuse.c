/*
 * Traps that gave wrong numbers or crashes without a word, at 2 to 4 ranks:
 * per-rank row counts that differ without global_rows, the stages of one
 * pipeline given different rows (ct_strategy_local_rows gives the right
 * ones), and a parameter that fsdp holds in shards read outside summon.
 * Each is an error on every rank that names the cause and the fix.
 */
#include "train_util.h"

static ct_module *model(void)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, NCLS, 1)));
    ct_module_init_params(m, 3);
    return m;
}

/* One train step on rows [first, first + count) of step 0's global batch of n rows. */
static ct_status step_rows(ct_strategy *s, int64_t n, int64_t first, int64_t count, int64_t global_rows)
{
    ct_tensor *x, *y;
    global_batch(0, n, &x, &y);
    ct_tensor *xs = rows(x, first, count), *ys = rows(y, first, count);
    ct_batch b = {.x = xs, .y = ys, .global_rows = global_rows, .sample0 = first};
    ct_fwd_ctx ctx = {.training = 1, .seed = 1};
    ct_status st = ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL);
    ct_strategy_zero_grad(s);
    ct_tensor_release(xs);
    ct_tensor_release(ys);
    ct_tensor_release(x);
    ct_tensor_release(y);
    return st;
}

TEST(misuse_uneven_rows_without_global_rows_is_an_error)
{
    ct_group *g = ct_group_world();
    int r = ct_group_rank(g), w = ct_group_size(g);
    ct_module *m = model();
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, &o, NULL, NULL, &s));
    /* 4 rows each, then rank 0 one more: each rank would divide by its own count */
    ASSERT_OK(step_rows(s, 8 * w, 4 * r, 4, 0));
    int64_t n = 4 * w + 1, first = r ? 4 * r + 1 : 0, count = r ? 4 : 5;
    ASSERT_ERR(step_rows(s, n, first, count, 0), CT_EINVAL, "set global_rows");
    ASSERT_OK(step_rows(s, n, first, count, n)); /* with it: the true mean */
    ct_strategy_destroy(s);
    ASSERT_OK(ct_module_destroy(m));
}

TEST(misuse_pipe_stages_given_different_rows_is_an_error)
{
    ct_group *g = ct_group_world();
    int r = ct_group_rank(g), w = ct_group_size(g);
    ct_module *m = model();
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("pipe", m, &o, NULL, "stages=2,chunks=2", &s));
    int64_t n = 12, first, count;
    ASSERT_OK(ct_strategy_local_rows(s, n, &first, &count));
    int dr, ds;
    ct_strategy_data_rank(s, &dr, &ds);
    ASSERT_EQ(ds, w / 2); /* one slice per pipeline of 2 stages */
    ASSERT_OK(step_rows(s, n, first, count, n));
    /* Sliced by the rank number, as the README's ddp loop does: stage 0 and the last
     * stage would train on different samples' inputs and targets. */
    ASSERT_ERR(step_rows(s, n * w, 6 * r, 6, n * w), CT_EINVAL, "must get the same slice of the batch");
    ct_strategy_destroy(s);
    ASSERT_OK(ct_module_destroy(m));
}

TEST(misuse_fsdp_parameter_outside_summon_is_an_error)
{
    ct_module *m = model();
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("fsdp", m, &o, NULL, NULL, &s));
    ct_param *wt = ct_module_find(m, "0.weight");
    ASSERT(wt != NULL);
    ASSERT_ERR(ct_tensor_check_data(wt->data), CT_ESTATE, "ct_strategy_summon_full_params");
    ASSERT_OK(ct_strategy_summon_full_params(s, 0, 0));
    ASSERT_OK(ct_tensor_check_data(wt->data));
    ct_tensor *c = ct_tensor_clone(wt->data, CT_MEM_OTHER);
    ASSERT(c != NULL);
    ct_tensor_release(c);
    ASSERT_OK(ct_strategy_release_full_params(s));
    ct_strategy_destroy(s);
    ASSERT_OK(ct_module_destroy(m));
}

/*
 * Misuse of the library is an error with a message, never a crash: a model
 * destroyed or wrapped again while a strategy holds it, communication
 * finalised under a live strategy, a record given to backward twice, a
 * tensor without memory read; and the quiet traps: a step with no backward
 * changes nothing (PyTorch skips grads that are None), a custom layer's
 * init runs, ct_strategy_local_rows cuts a batch as the sampler does, and a
 * rank-0-only collective call ends the job naming the call
 * (tests/misuse_prog.c under mpirun).
 */

#include <sys/stat.h>
#include <unistd.h>

#include "cli_util.h"

static ct_module *small(void)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(6, 8, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(8, 3, 1)));
    ct_module_init_params(m, 5);
    return m;
}

TEST(misuse_destroying_a_wrapped_model_is_an_error)
{
    ct_module *m = small();
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("none", m, &o, NULL, NULL, &s));
    ASSERT_ERR(ct_module_destroy(m), CT_ESTATE, "call ct_strategy_destroy first");
    /* nothing was freed: the strategy still trains it */
    ASSERT_EQ(ct_module_num_params(m), 6 * 8 + 8 + 8 * 3 + 3);
    ct_strategy_destroy(s);
    ASSERT_OK(ct_module_destroy(m));
}

TEST(misuse_wrapping_a_model_twice_is_an_error)
{
    ct_module *m = small();
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *a, *b = NULL;
    ASSERT_OK(ct_strategy_create("none", m, &o, NULL, NULL, &a));
    ASSERT_ERR(ct_strategy_create("offload", m, &o, NULL, NULL, &b), CT_ESTATE,
               "already wrapped by strategy none");
    ASSERT(b == NULL);
    ct_strategy_destroy(a);
    /* free again: a new strategy may take it */
    ASSERT_OK(ct_strategy_create("none", m, &o, NULL, NULL, &b));
    ct_strategy_destroy(b);
    ASSERT_OK(ct_module_destroy(m));
}

TEST(misuse_backward_twice_on_one_record_is_an_error)
{
    ct_module *m = small();
    ct_tensor *x = ct_tensor_create2(4, 6, CT_MEM_ACT), *y = NULL, *dy;
    ct_tensor_fill(x, 0.5f);
    ct_record *rec;
    ct_fwd_ctx ctx = {.training = 1};
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    dy = ct_tensor_clone(y, CT_MEM_ACT);
    ct_tensor_fill(dy, 1.0f);
    ASSERT_OK(ct_module_backward(m, dy, NULL, rec));
    ASSERT_ERR(ct_module_backward(m, dy, NULL, rec), CT_ESTATE, "already consumed");
    ct_record_destroy(rec); /* freed already: logged, nothing done */
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_tensor_release(dy);
    ASSERT_OK(ct_module_destroy(m));
}

TEST(misuse_reading_a_tensor_without_memory_is_an_error)
{
    ct_tensor *t = ct_tensor_create1(16, CT_MEM_PARAM), *d = ct_tensor_create1(16, CT_MEM_PARAM);
    ASSERT_OK(ct_tensor_check_data(t));
    ASSERT_OK(ct_storage_free_data(t->storage)); /* what fsdp does to a parameter outside summon */
    ASSERT_ERR(ct_tensor_check_data(t), CT_ESTATE, "ct_strategy_summon_full_params");
    ASSERT_ERR(ct_tensor_copy(d, t), CT_ESTATE, "storage is released");
    ct_clear_error();
    ASSERT(ct_tensor_clone(t, CT_MEM_ACT) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "sharded strategy");
    ct_tensor_release(t);
    ct_tensor_release(d);
}

TEST(misuse_comm_finalize_with_a_live_strategy_is_an_error)
{
    ASSERT_OK(ct_comm_init(NULL, NULL));
    ct_module *m = small();
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, &o, NULL, NULL, &s));
    ASSERT_ERR(ct_comm_finalize(), CT_ESTATE, "destroy it first (ct_strategy_destroy)");
    ASSERT(ct_comm_initialized()); /* refused: nothing was torn down */
    ct_strategy_destroy(s);
    ASSERT_OK(ct_comm_finalize());
    ASSERT(!ct_comm_initialized());
    ASSERT_OK(ct_module_destroy(m));
#if defined(__SANITIZE_ADDRESS__)
    /* Passed.  Open MPI's allocations left after MPI_Finalize are not ours (see
     * test_comm_single.c); this test runs in a process of its own. */
    _exit(0);
#endif
}

/* PyTorch skips parameters whose grad is None: a step before any backward
 * (or a second step after one) changes no weight, even with weight decay,
 * and does not count. */
TEST(misuse_step_without_backward_changes_nothing)
{
    ct_module *m = small();
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.weight_decay = 0.5f;
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("none", m, &o, NULL, NULL, &s));
    ct_param *w = ct_module_find(m, "0.weight");
    float before = ct_f32(w->data)[3];
    ASSERT_OK(ct_strategy_step(s));
    ASSERT_EQ(ct_optim_get_step(ct_strategy_optim(s)), 0);
    ASSERT(ct_f32(w->data)[3] == before);
    int64_t n = 4;
    ct_tensor *x = ct_tensor_create2(n, 6, CT_MEM_ACT), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    ct_tensor_fill(x, 0.25f);
    ct_batch b = {x, y, n, 0};
    ct_fwd_ctx ctx = {.training = 1};
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL));
    ASSERT_OK(ct_strategy_step(s));
    ASSERT_EQ(ct_optim_get_step(ct_strategy_optim(s)), 1);
    float after = ct_f32(w->data)[3];
    ASSERT(after != before);
    ct_strategy_zero_grad(s);
    ASSERT_OK(ct_strategy_step(s)); /* no backward since: nothing */
    ASSERT_EQ(ct_optim_get_step(ct_strategy_optim(s)), 1);
    ASSERT(ct_f32(w->data)[3] == after);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ASSERT_OK(ct_module_destroy(m));
}

/* A custom kind: y = x * scale (scale [dim]), with an init that sets 2s. */
static ct_status scale_fwd(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec, const ct_fwd_ctx *ctx)
{
    (void)m, (void)rec, (void)ctx;
    *out = ct_tensor_clone(in, CT_MEM_ACT);
    return *out ? CT_OK : CT_ENOMEM;
}
static ct_status scale_bwd(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    (void)m, (void)dout, (void)din, (void)rec;
    return CT_OK;
}
static const ct_module_ops scale_ops = {.kind = "scale", .forward = scale_fwd, .backward = scale_bwd};

TEST(misuse_custom_layer_init_runs_from_init_params)
{
    ct_module *root = ct_sequential_create(), *a = ct_module_create(&scale_ops, NULL),
              *b = ct_module_create(&scale_ops, NULL);
    int64_t d = 4;
    ASSERT(ct_module_add_param(a, "scale", 1, &d) && ct_module_add_param(b, "scale", 1, &d));
    ct_param_set_init(a->params[0], ct_init_const(2.0f)); /* b has none: left at zeros, with a warning */
    ASSERT_OK(ct_module_add(root, NULL, a));
    ASSERT_OK(ct_module_add(root, NULL, b));
    ct_module_init_params(root, 1);
    ASSERT(ct_f32(a->params[0]->data)[3] == 2.0f);
    ASSERT(ct_f32(b->params[0]->data)[3] == 0.0f);
    ASSERT_OK(ct_module_destroy(root));
}

TEST(misuse_local_rows_cover_the_batch)
{
    ct_module *m = small();
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("none", m, &o, NULL, NULL, &s));
    int64_t first, count;
    ASSERT_OK(ct_strategy_local_rows(s, 10, &first, &count));
    ASSERT_EQ(first, 0);
    ASSERT_EQ(count, 10);
    ASSERT_ERR(ct_strategy_local_rows(s, -1, &first, &count), CT_EINVAL, "global_rows is -1");
    ct_strategy_destroy(s);
    ASSERT_OK(ct_module_destroy(m));
}

/* ct_strategy_model_state under fsdp on rank 0 only: one clear message naming
 * the call, at once with CTRAIN_DEBUG=collectives, at the timeout without. */
TEST(misuse_rank0_only_collective_call_names_the_call)
{
    static char out[OUT_MAX];
    int rc = run_shell(0, out, "CTRAIN_DEBUG=collectives mpirun --oversubscribe --bind-to none -np 2 "
                             "%s/tests/misuse_prog rank0_state", cli_bin_dir());
    ASSERT(rc != 0);
    ASSERT_STR_CONTAINS(out, "in ct_strategy_model_state but rank 1 called");
    ASSERT_STR_CONTAINS(out, "the ranks are in different ctrain calls");
    rc = run_shell(0, out, "CTRAIN_COMM_TIMEOUT=3 mpirun --oversubscribe --bind-to none -np 2 "
                         "%s/tests/misuse_prog rank0_state", cli_bin_dir());
    ASSERT(rc != 0);
    ASSERT_STR_CONTAINS(out, "comm timeout");
    ASSERT_STR_CONTAINS(out, "this rank is in ct_strategy_model_state, a collective call: every rank");
    /* The same call on every rank: fine, fingerprints on or off. */
    ASSERT_EQ(run_shell(0, out, "CTRAIN_DEBUG=collectives mpirun --oversubscribe --bind-to none -np 2 "
                              "%s/tests/misuse_prog all_state", cli_bin_dir()), 0);
    ASSERT_EQ(occurrences(out, "done"), 2);
}

/* --strategy fsdp (or any strategy that communicates) without mpirun runs on
 * one rank: it works, and says that it shards nothing. */
TEST(misuse_sharding_strategy_on_one_rank_warns)
{
    static char out[OUT_MAX];
    char txt[1024], path[1100];
    snprintf(txt, sizeof txt, "%s/text", ct_test_tmpdir());
    ASSERT(mkdir(txt, 0755) == 0);
    snprintf(path, sizeof path, "%s/a.txt", txt);
    FILE *f = fopen(path, "w");
    ASSERT(f != NULL);
    for (int i = 0; i < 200; i++) fprintf(f, "line %d\n", i);
    fclose(f);
    ASSERT_EQ(RUN(out, "train --model gpt --layers 1 --heads 1 --dim 8 --context 8 --steps 1 --batch 2 "
                       "--data-dir %s --log-every 0 --strategy fsdp", txt), 0);
    ASSERT_STR_CONTAINS(out, "strategy fsdp runs on 1 rank");
    ASSERT_STR_CONTAINS(out, "mpirun -np N");
    ASSERT_EQ(RUN(out, "train --model gpt --layers 1 --heads 1 --dim 8 --context 8 --steps 1 --batch 2 "
                       "--data-dir %s --log-every 0 --strategy none", txt), 0);
    ASSERT(strstr(out, "runs on 1 rank") == NULL);
}

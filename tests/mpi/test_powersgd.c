/*
 * PowerSGD across ranks: P = sum_i M_i Q, Q = sum_i M_i^T P and the sum of
 * the ranks' errors are linear in the ranks' gradients, so DDP with
 * PowerSGD over N ranks makes the updates one process makes with PowerSGD
 * on the whole batch (the same seed, so the same random Q), with error
 * feedback and warm start, through the uncompressed start and the rebuild
 * of the buckets; and the replicas stay identical.  ZeRO-1 (DDP's buckets,
 * the optimizer sharded) alike.  A hook registered by the user replaces it.
 */
#include "train_util.h"

static void powersgd_vs_one_process(const char *kind, const char *opts)
{
    ct_group *w = ct_group_world(), *self = NULL;
    int rank = ct_group_rank(w), world = ct_group_size(w);
    ASSERT_OK(ct_group_split(w, rank, 0, &self));
    int64_t n = 6 * world + 1;
    ct_module *dm = mlp8(41, 24), *rm = mlp8(41, 24);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, w, opts, &ds));
    ASSERT_OK(ct_strategy_create(kind, rm, &oo, self, opts, &rs));
    ASSERT(!strcmp(ct_strategy_comm_hook(ds, NULL), "powersgd"));
    steps_vs_one(ds, rs, 8, n, rank, world);
    void *st;
    int64_t iter, before, after;
    ct_strategy_comm_hook(ds, &st);
    ct_powersgd_stats(st, &iter, &before, &after);
    ASSERT_EQ(iter, 8);
    ASSERT(after < before); /* it compressed */
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    assert_params_close(dm, rm, 2e-5);
    /* the replicas are the same model */
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(dm, &ps, &np));
    for (int i = 0; i < np; i++) {
        ct_tensor *c = ct_tensor_clone(ps[i]->data, CT_MEM_OTHER);
        ASSERT(c);
        ASSERT_OK(ct_group_broadcast_tensor(w, c, 0, NULL));
        ASSERT(!memcmp(ct_tensor_data(c), ct_tensor_data(ps[i]->data), ct_tensor_bytes(c)));
        ct_tensor_release(c);
    }
    ct_free(ps);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
    ct_group_destroy(self);
}

TEST(ddp_powersgd_equals_one_process)
{
    powersgd_vs_one_process("ddp", "powersgd_rank=2,powersgd_start_iter=2");
    powersgd_vs_one_process("ddp", "powersgd_rank=1,powersgd_start_iter=3,powersgd_error_feedback=0,bucket_cap_mb=0.002,"
                                   "first_bucket_mb=0.001");
}

TEST(zero1_powersgd_equals_one_process)
{
    powersgd_vs_one_process("zero1", "powersgd_rank=2,powersgd_start_iter=2,bucket_cap_mb=0.002");
}

/* A hook of the user's replaces the strategy's own: this one counts its
 * calls and hands the work to the built-in allreduce; the model trains as
 * plain DDP does, and the hook's state is freed with the strategy. */
typedef struct {
    int starts, finishes;
    const ct_comm_hook_ops *inner;
    void *inner_state;
} counting;
static int counting_freed;

static ct_status counting_start(void *st, ct_group *g, const ct_comm_bucket *b, ct_work **w)
{
    counting *c = st;
    c->starts++;
    ASSERT(b->nparams > 0 && b->offsets[0] == 0 && b->index < b->nbuckets);
    return c->inner->start(c->inner_state, g, b, w);
}
static ct_status counting_finish(void *st, ct_group *g, const ct_comm_bucket *b)
{
    counting *c = st;
    c->finishes++;
    return c->inner->finish(c->inner_state, g, b);
}
static void counting_destroy(void *st)
{
    counting *c = st;
    c->inner->destroy(c->inner_state);
    counting_freed++;
}
static const ct_comm_hook_ops counting_ops = {"counting", counting_start, counting_finish, counting_destroy};

TEST(ddp_registered_comm_hook_is_used)
{
    ct_group *w = ct_group_world();
    int rank = ct_group_rank(w), world = ct_group_size(w);
    int64_t n = 4 * world;
    ct_module *a = mlp8(43, 16), *b = mlp8(43, 16);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *sa, *sb;
    ASSERT_OK(ct_strategy_create("ddp", a, &oo, w, "bucket_cap_mb=0.002,first_bucket_mb=0.001", &sa));
    ASSERT_OK(ct_strategy_create("ddp", b, &oo, w, "bucket_cap_mb=0.002,first_bucket_mb=0.001", &sb));
    static counting c;
    memset(&c, 0, sizeof c);
    counting_freed = 0;
    ASSERT_OK(ct_comm_hook_allreduce(CT_F32, &c.inner, &c.inner_state));
    ASSERT_OK(ct_strategy_register_comm_hook(sa, &counting_ops, &c));
    ASSERT(!strcmp(ct_strategy_comm_hook(sa, NULL), "counting"));
    for (int step = 0; step < 3; step++) step_both(sa, sb, step, n, rank, world);
    int nb = ct_strategy_stats(sa).nbuckets;
    ASSERT(nb > 1);
    ASSERT_EQ(c.starts, 3 * nb);
    ASSERT_EQ(c.finishes, 3 * nb);
    ct_strategy_destroy(sa);
    ASSERT_EQ(counting_freed, 1);
    ct_strategy_destroy(sb);
    assert_params_close(a, b, 1e-6);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

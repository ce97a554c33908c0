/*
 * Post-local SGD and periodic model averaging (ddp's local_sgd options,
 * src/parallel/local_sgd.c): before the start it is DDP bit for bit; with
 * SGD and period 1 it is DDP; with a longer period it is a hand-built
 * reference (every rank steps its own model on its own rows with no
 * communication, and the parameters are averaged by an allreduce every P
 * steps); over node subgroups, DDP within each node; the gradient traffic
 * falls to the averaging's; a save after an averaging step resumes as the
 * run that never stopped; other strategies and other hooks are refused.
 */
#include "train_util.h"

/* This rank's slice of the global batch of `step`, as its own mean: what a
 * rank of local SGD trains on after the start. */
static void step_alone(ct_strategy *s, int step, int64_t n, int rank, int world)
{
    ct_tensor *x, *y;
    global_batch(step, n, &x, &y);
    int64_t first, count;
    slice(n, rank, world, &first, &count);
    ct_batch b = {rows(x, first, count), rows(y, first, count), count, first};
    ct_fwd_ctx ctx = {.training = 1, .seed = 5, .step = (uint64_t)step};
    ct_step_out o;
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &o));
    ct_tensor_release(b.x);
    ct_tensor_release(b.y);
    ct_tensor_release(x);
    ct_tensor_release(y);
}

/* One optimizer step of a strategy on its slice (step_on_slice), step, zero_grad. */
static void full_step(ct_strategy *s, int step, int64_t n, int rank, int world)
{
    ct_step_out o;
    step_on_slice(s, step, n, rank, world, &o);
    ASSERT_OK(ct_strategy_step(s));
    ct_strategy_zero_grad(s);
}

/* Every trainable parameter divided by the world's size and summed over it:
 * PyTorch's average_parameters, from the library's allreduce. */
static void average_by_hand(ct_module *m, ct_group *w)
{
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    float inv = 1.0f / (float)ct_group_size(w);
    for (int i = 0; i < np; i++) {
        float *x = ct_f32(ps[i]->data);
        for (int64_t j = 0; j < ps[i]->data->numel; j++) x[j] *= inv;
        ASSERT_OK(ct_group_allreduce(w, x, ps[i]->data->numel, CT_F32, CT_OP_SUM, NULL));
    }
    ct_free(ps);
}

/* 1 if m's parameters are bit for bit rank 0's on every rank. */
static int same_on_every_rank(ct_module *m, ct_group *w)
{
    ct_param **ps;
    int np, same = 1;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    for (int i = 0; i < np; i++) {
        ct_tensor *c = ct_tensor_clone(ps[i]->data, CT_MEM_OTHER);
        ASSERT(c);
        ASSERT_OK(ct_group_broadcast_tensor(w, c, 0, NULL));
        same &= !memcmp(ct_tensor_data(c), ct_tensor_data(ps[i]->data), ct_tensor_bytes(c));
        ct_tensor_release(c);
    }
    ct_free(ps);
    int32_t all = same;
    ASSERT_OK(ct_group_allreduce(w, &all, 1, CT_I32, CT_OP_MIN, NULL));
    return all;
}

static int params_bitwise_equal(ct_module *a, ct_module *b)
{
    ct_param **pa, **pb;
    int na, nb, eq = 1;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    ASSERT_EQ(na, nb);
    for (int i = 0; i < na; i++) eq &= !memcmp(ct_tensor_data(pa[i]->data), ct_tensor_data(pb[i]->data),
                                               ct_tensor_bytes(pa[i]->data));
    ct_free(pa);
    ct_free(pb);
    return eq;
}

TEST(ddp_local_sgd_before_start_is_ddp_bit_for_bit)
{
    ct_group *w = ct_group_world();
    int rank = ct_group_rank(w), world = ct_group_size(w);
    int64_t n = 4 * world + 1;
    ct_module *a = mlp8(51, 16), *b = mlp8(51, 16);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *sa, *sb;
    ASSERT_OK(ct_strategy_create("ddp", a, &oo, w, "local_sgd=none,local_sgd_start=3,average_period=2", &sa));
    ASSERT_OK(ct_strategy_create("ddp", b, &oo, w, NULL, &sb));
    ASSERT(!strcmp(ct_strategy_comm_hook(sa, NULL), "post_local_sgd"));
    ASSERT(!strcmp(ct_strategy_opt(sa, "average_warmup"), "auto"));
    for (int step = 0; step < 3; step++) {
        full_step(sa, step, n, rank, world);
        full_step(sb, step, n, rank, world);
        ASSERT(params_bitwise_equal(a, b));
    }
    /* from the start on each rank trains alone: the replicas part */
    full_step(sa, 3, n, rank, world);
    full_step(sb, 3, n, rank, world);
    ASSERT(!params_bitwise_equal(a, b));
    ASSERT(same_on_every_rank(a, w)); /* step 3 = warmup 3: averaged */
    full_step(sa, 4, n, rank, world);
    ASSERT(!same_on_every_rank(a, w)); /* step 4: not averaged, the ranks' rows differ */
    ct_strategy_destroy(sa);
    ct_strategy_destroy(sb);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* SGD without momentum: the mean of the ranks' steps from one point is the
 * step on the mean gradient, so averaging every step is DDP. */
static void period_one_is_ddp(const char *opts)
{
    ct_group *w = ct_group_world();
    int rank = ct_group_rank(w), world = ct_group_size(w);
    int64_t n = 4 * world;
    ct_module *a = mlp8(52, 16), *b = mlp8(52, 16);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    oo.lr = 0.1f;
    ct_strategy *sa, *sb;
    ASSERT_OK(ct_strategy_create("ddp", a, &oo, w, opts, &sa));
    ASSERT_OK(ct_strategy_create("ddp", b, &oo, w, NULL, &sb));
    for (int step = 0; step < 6; step++) {
        full_step(sa, step, n, rank, world);
        full_step(sb, step, n, rank, world);
    }
    assert_params_close(a, b, 1e-6);
    ASSERT(same_on_every_rank(a, w));
    ct_strategy_destroy(sa);
    ct_strategy_destroy(sb);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

TEST(ddp_local_sgd_period_1_equals_ddp)
{
    period_one_is_ddp("local_sgd=none,local_sgd_start=2,average_period=1");
    period_one_is_ddp("local_sgd=none,local_sgd_start=0,average_period=1,bucket_cap_mb=0.002,first_bucket_mb=0.001");
    int saved = ct_comm_get_fake_nodes();
    ct_comm_set_fake_nodes(2); /* node subgroups, split at the wrap */
    period_one_is_ddp("local_sgd=node,local_sgd_start=1,average_period=1");
    ct_comm_set_fake_nodes(saved);
}

/* Each rank alone on its rows, averaged after steps warmup, warmup + P, ...;
 * the optimizer's state (momentum, AdamW's moments) stays each rank's. */
static void period_vs_reference(ct_optim_kind kind)
{
    ct_group *w = ct_group_world(), *self = NULL;
    int rank = ct_group_rank(w), world = ct_group_size(w);
    ASSERT_OK(ct_group_split(w, rank, 0, &self));
    int64_t n = 4 * world;
    ct_module *a = mlp8(53, 16), *r = mlp8(53, 16);
    ct_optim_opts oo = optim_for(kind);
    ct_strategy *sa, *sr;
    ASSERT_OK(ct_strategy_create("ddp", a, &oo, w, "local_sgd=none,local_sgd_start=0,average_period=3,average_warmup=1",
                                 &sa));
    ASSERT_OK(ct_strategy_create("none", r, &oo, self, NULL, &sr));
    for (int step = 0; step < 9; step++) {
        full_step(sa, step, n, rank, world);
        step_alone(sr, step, n, rank, world);
        ASSERT_OK(ct_strategy_step(sr));
        ct_strategy_zero_grad(sr);
        int averaged = step >= 1 && (step - 1) % 3 == 0;
        if (averaged) average_by_hand(r, w);
        assert_params_close(a, r, 1e-6);
        ASSERT_EQ(same_on_every_rank(a, w), averaged);
    }
    ct_strategy_destroy(sa);
    ct_strategy_destroy(sr);
    ct_module_destroy(a);
    ct_module_destroy(r);
    ct_group_destroy(self);
}

TEST(ddp_local_sgd_period_equals_ranks_alone_averaged_by_hand)
{
    period_vs_reference(CT_OPT_SGD);
    period_vs_reference(CT_OPT_ADAMW);
}

/* Allreduced bytes of one optimizer step. */
static uint64_t step_allreduce_bytes(ct_strategy *s, int step, int64_t n, int rank, int world, uint64_t *sent)
{
    ct_comm_tally_reset();
    full_step(s, step, n, rank, world);
    ct_comm_tally t[CT_COLL_NKINDS];
    ct_comm_tally_get(t);
    *sent = ct_comm_traffic_get().sent;
    return t[CT_COLL_ALLREDUCE].bytes;
}

TEST(ddp_local_sgd_traffic_falls_to_the_averaging)
{
    ct_group *w = ct_group_world();
    int rank = ct_group_rank(w), world = ct_group_size(w);
    int64_t n = 4 * world;
    ct_module *a = mlp8(54, 16);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *sa;
    ASSERT_OK(ct_strategy_create("ddp", a, &oo, w, "local_sgd=none,local_sgd_start=2,average_period=4", &sa));
    int64_t numel = 0;
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(a, &ps, &np));
    for (int i = 0; i < np; i++) numel += ps[i]->data->numel;
    ct_free(ps);
    uint64_t bytes = 4 * (uint64_t)numel, sent;
    ASSERT_EQ(step_allreduce_bytes(sa, 0, n, rank, world, &sent), bytes); /* DDP: the gradients */
    ASSERT_EQ(step_allreduce_bytes(sa, 1, n, rank, world, &sent), bytes);
    ASSERT_EQ(step_allreduce_bytes(sa, 2, n, rank, world, &sent), bytes); /* local: the averaging's parameters */
    for (int step = 3; step < 6; step++) {
        ASSERT_EQ(step_allreduce_bytes(sa, step, n, rank, world, &sent), 0); /* nothing at all */
        ASSERT_EQ(sent, 0);
    }
    ASSERT_EQ(step_allreduce_bytes(sa, 6, n, rank, world, &sent), bytes);
    ct_step_stats st = ct_strategy_stats(sa);
    ASSERT(st.comm_total > 0 && st.comm_wait > 0 && st.optimizer >= 0);
    ct_strategy_destroy(sa);
    ct_module_destroy(a);
}

/* The full state saved after an averaging step is every rank's model; a
 * run resumed from it (the step count restored, so the start and the
 * averaging steps stay where they were) is the run that never stopped. */
TEST(ddp_local_sgd_save_after_averaging_resumes_exactly)
{
    ct_group *w = ct_group_world();
    int rank = ct_group_rank(w), world = ct_group_size(w);
    int64_t n = 4 * world;
    const char *opts = "local_sgd=none,local_sgd_start=1,average_period=3";
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    oo.lr = 0.1f;
    ct_module *a = mlp8(55, 16), *b = mlp8(55, 16);
    ct_strategy *sa, *sb;
    ASSERT_OK(ct_strategy_create("ddp", a, &oo, w, opts, &sa));
    for (int step = 0; step < 9; step++) full_step(sa, step, n, rank, world);
    ASSERT_OK(ct_strategy_create("ddp", b, &oo, w, opts, &sb));
    for (int step = 0; step < 5; step++) full_step(sb, step, n, rank, world); /* averaged after step 4 */
    ct_state ms = {0}, os = {0};
    ASSERT_OK(ct_strategy_model_state(sb, &ms));
    ASSERT_OK(ct_strategy_optim_state(sb, &os));
    ASSERT(same_on_every_rank(b, w));
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(b, &ps, &np));
    for (int i = 0; i < np; i++) {
        const ct_tensor *t = NULL;
        for (int k = 0; k < ms.n; k++)
            if (!strcmp(ms.names[k], ps[i]->name)) t = ms.tensors[k];
        ASSERT(t && !memcmp(ct_tensor_data(t), ct_tensor_data(ps[i]->data), ct_tensor_bytes(t)));
    }
    ct_free(ps);
    ct_strategy_destroy(sb);
    ct_module_destroy(b);
    /* rank 0's state, as a save writes it, into a fresh model on every rank */
    for (int k = 0; k < ms.n; k++) ASSERT_OK(ct_group_broadcast_tensor(w, ms.tensors[k], 0, NULL));
    ct_module *c = mlp8(99, 16);
    ct_strategy *sc;
    ASSERT_OK(ct_strategy_create("ddp", c, &oo, w, opts, &sc));
    ASSERT_OK(ct_strategy_load_state(sc, (const char *const *)ms.names, ms.tensors, ms.n, 0));
    ASSERT_OK(ct_strategy_load_state(sc, (const char *const *)os.names, os.tensors, os.n, 1));
    for (int step = 5; step < 9; step++) full_step(sc, step, n, rank, world);
    ASSERT(params_bitwise_equal(a, c));
    ct_state_fini(&ms);
    ct_state_fini(&os);
    ct_strategy_destroy(sa);
    ct_strategy_destroy(sc);
    ct_module_destroy(a);
    ct_module_destroy(c);
}

/* Mixed precision: the bf16 compute copies follow the averaged parameters. */
TEST(ddp_local_sgd_bf16_copies_follow_the_average)
{
    ct_group *w = ct_group_world();
    int rank = ct_group_rank(w), world = ct_group_size(w);
    int64_t n = 4 * world;
    ct_module *a = mlp8(56, 16), *b = mlp8(56, 16);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *sa, *sb;
    ASSERT_OK(ct_strategy_create("ddp", a, &oo, w, "param_dtype=bf16,local_sgd=none,local_sgd_start=0,average_period=2",
                                 &sa));
    ASSERT_OK(ct_strategy_create("ddp", b, &oo, w, "param_dtype=bf16", &sb));
    for (int step = 0; step < 5; step++) full_step(sa, step, n, rank, world);
    ASSERT(same_on_every_rank(a, w)); /* averaged after step 4 */
    /* the same forward on every rank, through the compute copies */
    ct_tensor *x, *y, *z = NULL;
    global_batch(7, 4, &x, &y);
    ct_fwd_ctx ctx = {.training = 0};
    ASSERT_OK(ct_strategy_predict(sa, x, &ctx, &z));
    ct_tensor *c = ct_tensor_clone(z, CT_MEM_OTHER);
    ASSERT_OK(ct_group_broadcast_tensor(w, c, 0, NULL));
    ASSERT(!memcmp(ct_tensor_data(c), ct_tensor_data(z), ct_tensor_bytes(c)));
    ct_tensor_release(c);
    ct_tensor_release(z);
    ct_tensor_release(x);
    ct_tensor_release(y);
    for (int step = 0; step < 5; step++) full_step(sb, step, n, rank, world);
    assert_params_close(a, b, 0.05); /* near DDP's after five steps, not the same run */
    ct_strategy_destroy(sa);
    ct_strategy_destroy(sb);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

static void refused(const char *kind, const char *opts, const char *words)
{
    ct_module *m = mlp8(57, 16);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s = NULL;
    ASSERT_EQ(ct_strategy_create(kind, m, &oo, ct_group_world(), opts, &s), CT_EINVAL);
    ASSERT(s == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), words);
    ct_module_destroy(m);
}

TEST(ddp_local_sgd_refuses_what_makes_no_sense)
{
    refused("zero1", "local_sgd=none", "ddp's alone");
    refused("zero2", "average_period=2", "ddp's alone");
    refused("fsdp", "local_sgd=node", "ddp's alone");
    refused("pipe", "local_sgd_start=3", "ddp's alone");
    refused("ddp", "local_sgd=none,powersgd_rank=2", "choose one");
    refused("ddp", "local_sgd=none,reduce_dtype=bf16", "reduces in f32");
    refused("ddp", "local_sgd=some", "off|none|node");
    refused("ddp", "local_sgd=none,average_period=0", "from 1");
    /* a hook of the user's on a ddp that runs post-local SGD */
    ct_module *m = mlp8(58, 16);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, &oo, ct_group_world(), "local_sgd=none", &s));
    const ct_comm_hook_ops *ops;
    void *st;
    ASSERT_OK(ct_comm_hook_allreduce(CT_F32, &ops, &st));
    ASSERT_EQ(ct_strategy_register_comm_hook(s, ops, st), CT_EINVAL);
    ASSERT_STR_CONTAINS(ct_last_error(), "post-local SGD");
    ASSERT(!strcmp(ct_strategy_comm_hook(s, NULL), "post_local_sgd"));
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/*
 * Offload under mpirun: every rank offloads its replica of the model and a
 * slice's gradients are allreduced (while the next slice computes, or at
 * once when prefetch is off); N ranks with their rows of a global batch
 * must match one process with the whole batch, with dropout, activation
 * checkpointing, micro-batches and clipping, and the state must load back.
 */
#include "train_util.h"

static ct_module *model(uint64_t seed) { return mlp8(seed, 24); }

static void assert_states_close(ct_strategy *a, ct_strategy *b, int optim, double tol)
{
    ct_state sa, sb;
    ASSERT_OK(optim ? ct_strategy_optim_state(a, &sa) : ct_strategy_model_state(a, &sa));
    ASSERT_OK(optim ? ct_strategy_optim_state(b, &sb) : ct_strategy_model_state(b, &sb));
    ASSERT_EQ(sa.n, sb.n);
    for (int i = 0; i < sa.n; i++) {
        ASSERT(!strcmp(sa.names[i], sb.names[i]));
        ASSERT_EQ(sa.tensors[i]->numel, sb.tensors[i]->numel);
        if (sa.tensors[i]->dtype != CT_F32) continue; /* step */
        for (int64_t j = 0; j < sa.tensors[i]->numel; j++)
            ASSERT_CLOSE(ct_f32(sa.tensors[i])[j], ct_f32(sb.tensors[i])[j], tol, tol);
    }
    ct_state_fini(&sa);
    ct_state_fini(&sb);
}

static void offload_vs_single(const char *opts, int64_t n, double clip)
{
    ct_module *om = model(42), *rm = model(42);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    oo.lr = 0.01;
    ct_strategy *os, *rs;
    ASSERT_OK(ct_strategy_create("offload", om, &oo, ct_group_world(), opts, &os));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    for (int step = 0; step < 4; step++) {
        float on = 0, rn = 0;
        step_on_data_rank(os, step, n, clip, &on, NULL);
        step_on_data_rank(rs, step, n, clip, &rn, NULL);
        if (clip > 0) ASSERT_CLOSE(on, rn, 1e-5, 1e-6);
    }
    assert_states_close(os, rs, 0, 2e-5);
    assert_states_close(os, rs, 1, 2e-5);
    UNWRAP(os);
    UNWRAP(rs);
    ct_module_destroy(om);
    ct_module_destroy(rm);
}

TEST(offload_ddp_matches_single_process)
{
    offload_vs_single("slices=3", 10, 0);
    offload_vs_single("slices=4,prefetch=0", 11, 0.05);
}

TEST(offload_ddp_checkpointing_microbatches_and_clipping)
{
    offload_vs_single("slices=3,checkpoint_activation=1,microbatches=2", 16, 0.05);
    offload_vs_single("balance=2:6,checkpoint_activation=1,microbatches=3", 13, 0);
}

/* Gradients kept local under no_sync are reduced slice by slice by
 * ct_strategy_reduce: the same as reducing in backward. */
TEST(offload_ddp_no_sync_then_reduce)
{
    ct_module *a = model(5), *b = model(5);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    oo.lr = 0.1;
    ct_strategy *sa, *sb;
    ASSERT_OK(ct_strategy_create("offload", a, &oo, ct_group_world(), "slices=2", &sa));
    ASSERT_OK(ct_strategy_create("none", b, &oo, NULL, NULL, &sb));
    int64_t n = 12;
    ct_tensor *x = ct_tensor_create2(n, IN, CT_MEM_ACT), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 3, 4);
    ct_rng_normal(&r, ct_f32(x), (size_t)(n * IN), 0, 1);
    int rank = ct_group_rank(ct_group_world()), size = ct_group_size(ct_group_world());
    int64_t lo = n * rank / size, hi = n * (rank + 1) / size;
    ct_tensor *xs = rows(x, lo, hi - lo), *ys = rows(y, lo, hi - lo);
    ct_batch bs = {.x = xs, .y = ys, .global_rows = n, .sample0 = lo}, ball = {.x = x, .y = y, .global_rows = n};
    ct_fwd_ctx ctx = {.training = 1, .seed = 1};
    ct_strategy_set_no_sync(sa, 1);
    ASSERT_OK(ct_strategy_train_step(sa, &bs, ct_loss_cross_entropy, NULL, &ctx, NULL));
    ct_strategy_set_no_sync(sa, 0);
    ASSERT_OK(ct_strategy_reduce(sa));
    ASSERT_OK(ct_strategy_step(sa));
    ASSERT_OK(ct_strategy_train_step(sb, &ball, ct_loss_cross_entropy, NULL, &ctx, NULL));
    ASSERT_OK(ct_strategy_step(sb));
    assert_states_close(sa, sb, 0, 2e-6);
    ct_tensor_release(xs);
    ct_tensor_release(ys);
    ct_tensor_release(x);
    ct_tensor_release(y);
    UNWRAP(sa);
    UNWRAP(sb);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* A model that differs across ranks is refused on every rank. */
TEST(offload_ddp_refuses_different_models)
{
    int rank = ct_group_rank(ct_group_world());
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, rank ? 9 : 8, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(rank ? 9 : 8, NCLS, 1)));
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ct_status st = ct_strategy_create("offload", m, &oo, ct_group_world(), "slices=2", &s);
    ASSERT(st != CT_OK);
    ct_module_destroy(m);
}

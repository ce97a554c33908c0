/*
 * Skip connections across pipeline stages (ct_skip_stash_create /
 * ct_skip_pop_create): a residual MLP whose skips span stage boundaries,
 * pipelined at 2 and 3 stages under both schedules and every checkpoint
 * mode (with replicas when the world has room), equals one process, in f32
 * and in bf16 mixed precision; its
 * state moves between a pipeline and one process and trains on alike; a
 * cut that pops before its stash or names two stashes alike is an error on
 * every rank.
 */
#include "train_util.h"

/* 11 children: skip "s" from child 2 to 8 around "t" from 5 to 7. */
static ct_module *resmlp(uint64_t seed)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_stash_create("s")));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_stash_create("t")));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_pop_create("t")));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_pop_create("s")));
    ASSERT_OK(ct_module_add(m, NULL, ct_dropout_create(0.25f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, NCLS, 1)));
    ct_module_init_params(m, seed);
    return m;
}

static ct_optim_opts adamw(void)
{
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.lr = 0.01f;
    return o;
}

static void skip_vs_single_in(const char *opts, const char *ref_opts, int stages, double tol)
{
    if (ct_group_size(ct_group_world()) < stages) return; /* the stages need their ranks */
    ct_module *pm = resmlp(42), *rm = resmlp(42);
    ct_optim_opts po = adamw(), ro = adamw();
    ct_strategy *ps, *rs;
    ASSERT_OK(ct_strategy_create("pipe", pm, &po, ct_group_world(), opts, &ps));
    ASSERT_OK(ct_strategy_create("none", rm, &ro, NULL, ref_opts, &rs));
    for (int step = 0; step < 3; step++) {
        float pn = 0, rn = 0;
        step_on_data_rank(ps, step, 10, 0.5, &pn, NULL);
        step_on_data_rank(rs, step, 10, 0.5, &rn, NULL);
        ASSERT_CLOSE(pn, rn, tol, tol / 10);
    }
    states_close(ps, rs, tol, "skips");
    /* inference: the last stage's logits are one process's */
    ct_tensor *x, *y, *pz = NULL, *rz = NULL;
    global_batch2(100, 10, &x, &y);
    ct_fwd_ctx ctx = {.training = 0};
    ASSERT_OK(ct_strategy_predict(ps, x, &ctx, &pz));
    ASSERT_OK(ct_strategy_predict(rs, x, &ctx, &rz));
    if (pz)
        for (int64_t i = 0; i < pz->numel; i++) ASSERT_CLOSE(ct_f32(pz)[i], ct_f32(rz)[i], 2 * tol, 2 * tol);
    ct_tensor_release(pz);
    ct_tensor_release(rz);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(ps);
    ct_strategy_destroy(rs);
    ct_module_destroy(pm);
    ct_module_destroy(rm);
}

static void skip_vs_single(const char *opts, int stages) { skip_vs_single_in(opts, NULL, stages, 1e-5); }

TEST(pipe_skip_two_stages_match_one_process)
{
    /* "s" crosses 0 -> 1, "t" stays in stage 1; at 4 ranks two replicas (DDP, then ZeRO-1) */
    skip_vs_single("stages=2,balance=4:7,chunks=3,schedule=gpipe,checkpoint=never", 2);
    skip_vs_single("stages=2,balance=4:7,chunks=4,schedule=1f1b,checkpoint=always", 2);
    skip_vs_single("stages=2,balance=6:5,chunks=4,schedule=gpipe,checkpoint=except_last,dp=zero1", 2);
}

TEST(pipe_skip_three_stages_match_one_process)
{
    /* "s" passes through stage 1; "t" crosses 1 -> 2 beside it: two skips in one message */
    skip_vs_single("stages=3,balance=3:4:4,chunks=4,schedule=1f1b,checkpoint=except_last", 3);
    skip_vs_single("stages=3,balance=3:4:4,chunks=3,schedule=gpipe,checkpoint=always", 3);
    skip_vs_single("stages=3,balance=3:3:5,chunks=2,schedule=gpipe,checkpoint=never", 3);
}

TEST(pipe_skip_bf16_matches_one_process_in_bf16)
{
    /* --mixed bf16: bf16 compute copies on both sides; the skips stay f32 activations */
    const char *one = "param_dtype=bf16";
    skip_vs_single_in("stages=2,balance=4:7,chunks=4,schedule=1f1b,checkpoint=except_last,param_dtype=bf16", one, 2,
                      1e-5);
    skip_vs_single_in("stages=2,balance=6:5,chunks=3,schedule=gpipe,checkpoint=always,dp=zero1,param_dtype=bf16", one,
                      2, 1e-5);
    skip_vs_single_in("stages=3,balance=3:4:4,chunks=4,schedule=1f1b,checkpoint=never,param_dtype=bf16", one, 3, 1e-5);
}

/* A checkpoint a pipeline saved (full and sharded) loads into one process,
 * ddp and a pipeline of another cut, which then train on alike. */
TEST(pipe_skip_checkpoint_moves_between_strategies)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g);
    if (world < 2) return;
    char dir[1024], path[1100];
    memset(dir, 0, sizeof dir);
    if (ct_group_rank(g) == 0) snprintf(dir, sizeof dir, "%s", ct_test_tmpdir());
    ASSERT_OK(ct_group_broadcast(g, dir, (int64_t)sizeof dir, CT_U8, 0, NULL));
    ct_module *pm = resmlp(42);
    ct_optim_opts po = adamw();
    ct_strategy *ps;
    ASSERT_OK(ct_strategy_create("pipe", pm, &po, g, "stages=2,balance=4:7,chunks=2", &ps));
    for (int step = 0; step < 2; step++) step_on_data_rank(ps, step, 8, 0, NULL, NULL);
    for (int kind = CT_CKPT_FULL; kind <= CT_CKPT_SHARDED; kind++) {
        snprintf(path, sizeof path, "%s/skip%d%s", dir, kind, kind == CT_CKPT_FULL ? ".safetensors" : "");
        ct_ckpt_opts co = {.kind = (ct_ckpt_kind)kind};
        ASSERT_OK(ct_checkpoint_save(ps, path, NULL, NULL, &co));
        const char *kinds[] = {"none", "ddp", "pipe"};
        const char *opts[] = {NULL, NULL, world >= 3 ? "stages=3,balance=3:4:4,chunks=3" : "balance=6:5,chunks=3"};
        ct_strategy *t[3];
        ct_module *tm[3];
        for (int k = 0; k < 3; k++) {
            ct_optim_opts o = adamw();
            tm[k] = resmlp(7);
            ASSERT_OK(ct_strategy_create(kinds[k], tm[k], &o, k ? g : NULL, opts[k], &t[k]));
            ASSERT_OK(ct_checkpoint_load(t[k], path, 1));
            states_close(ps, t[k], 1e-7, "skips");
        }
        for (int step = 2; step < 4; step++)
            for (int k = 0; k < 3; k++) step_on_data_rank(t[k], step, 8, 0, NULL, NULL);
        states_close(t[0], t[1], 1e-5, "skips");
        states_close(t[0], t[2], 1e-5, "skips");
        for (int k = 0; k < 3; k++) {
            ct_strategy_destroy(t[k]);
            ct_module_destroy(tm[k]);
        }
    }
    ct_strategy_destroy(ps);
    ct_module_destroy(pm);
}

static void create_fails(ct_module *m, const char *opts, ct_status code, const char *needle)
{
    ct_optim_opts o = adamw();
    ct_strategy *s = NULL;
    ASSERT_ERR(ct_strategy_create("pipe", m, &o, ct_group_world(), opts, &s), code, needle);
    ASSERT(s == NULL);
}

TEST(pipe_skip_misuse_is_an_error_on_every_rank)
{
    if (ct_group_size(ct_group_world()) < 2) return;
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_pop_create("s")));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_stash_create("s")));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, NCLS, 1)));
    create_fails(m, "stages=2,balance=2:2", CT_EINVAL, "before its stash");
    ct_module_destroy(m);
    m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_stash_create("s")));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, IN, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_stash_create("s")));
    ASSERT_OK(ct_module_add(m, NULL, ct_skip_pop_create("s")));
    create_fails(m, "stages=2,balance=2:2", CT_EINVAL, "two stashes named 's'");
    ct_module_destroy(m);
}

/*
 * The GPT, with its tied head (one parameter used by the embedding and the
 * LM head), under every strategy that exists: N ranks equal one process on
 * the whole batch (weights and consolidated optimizer state), with dropout
 * on, several steps, micro-batches, and bf16 mixed precision; FSDP with a
 * unit per block (the tied weight in the root unit); offload with the tied
 * weight resident beside the streamed slices.  Before the
 * nn counted a shared parameter's uses, DDP and ZeRO-2 failed with
 * "received its gradient twice".
 */
#include "train_util.h"

/* Every rank's copy of the tied weight (a pipeline's first and last stages
 * hold one each; other strategies, rank 0 included, one whole) is the same,
 * bit for bit: each rank that holds it sends its first and last values and
 * a checksum. */
static void assert_copies_equal(ct_module *m)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g);
    ct_param *p = ct_module_find(m, "transformer.wte.weight");
    double mine[4] = {0, 0, 0, 0}, all[4 * 8];
    ASSERT(world <= 8);
    if (p && p->data->numel) {
        const float *v = ct_f32(p->data);
        mine[0] = 1;
        mine[1] = v[0];
        mine[2] = v[p->data->numel - 1];
        for (int64_t i = 0; i < p->data->numel; i++) mine[3] += (double)v[i] * (double)(i % 7 + 1);
    }
    ASSERT_OK(ct_group_allgather(g, mine, all, (int64_t)sizeof mine, CT_U8, NULL));
    int holders = 0, ref = -1;
    for (int r = 0; r < world; r++) {
        if (all[4 * r] == 0) continue;
        holders++;
        if (ref < 0) ref = r;
        for (int k = 1; k < 4; k++)
            if (all[4 * r + k] != all[4 * ref + k])
                ct_test_fail(__FILE__, __LINE__, "rank %d's copy of the tied weight differs from rank %d's (%.9g vs %.9g)",
                             r, ref, all[4 * r + k], all[4 * ref + k]);
    }
    ASSERT(holders >= 1);
}

/* kind over the world vs "none" on the whole batch; tol on weights,
 * optimizer state and (clip > 0) the gradient norm each step, whose
 * gradients add up accum train steps (no zero_grad between them).  With
 * groups, both train with nanoGPT's groups (no decay for parameters of
 * fewer than 2 dimensions, and here half the lr), the rest decaying 0.3:
 * a strategy that ignored a group would step its pieces differently. */
static void vs_single_groups(const char *kind, const char *opts, int steps, double tol, double clip, int accum,
                             int groups)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 2 * world + 1;
    ct_module *dm = gpt_tiny(3), *rm = gpt_tiny(3);
    ct_param *before = ct_module_find(dm, "transformer.wte.weight");
    float w0 = ct_f32(before->data)[5];
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    oo.lr = 0.01;
    /* Some gradients are zero in exact arithmetic (the key bias: softmax
     * ignores a shift shared by all keys), so both runs hold rounding noise
     * there, which AdamW with eps 1e-8 would blow up to full steps. */
    oo.eps = 1e-4;
    const char **nd = NULL;
    int nnd = 0;
    ct_optim_group nodecay = ct_optim_group_init(&oo);
    if (groups) {
        ct_param **ps;
        int np;
        ASSERT_OK(ct_module_params(rm, &ps, &np)); /* names that stay while both wrap (pipe cuts dm) */
        ASSERT_OK(ct_optim_select(ps, np, "ndim<2", &nd, &nnd));
        ct_free(ps);
        ASSERT(nnd > 0);
        oo.weight_decay = 0.3;
        nodecay.params = nd;
        nodecay.nparams = nnd;
        nodecay.weight_decay = 0;
        nodecay.lr_scale = 0.5;
        oo.groups = &nodecay;
        oo.ngroups = 1;
    }
    const char *ropts = opts && strstr(opts, "param_dtype=bf16") ? "param_dtype=bf16" : NULL;
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, g, opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, ropts, &rs));
    ct_free(nd); /* the optimizers copied the names */
    double l0 = 0, l1 = 0;
    for (int step = 0; step < steps; step++) {
        float n0 = 0, n1 = 0;
        for (int a = 0; a < accum; a++) {
            gpt_step(ds, step * accum + a, n, 0, &l0);
            gpt_step(rs, step * accum + a, n, 1, &l1);
        }
        if (clip > 0) {
            ASSERT_OK(ct_strategy_clip_grad_norm(ds, (float)clip, 2.0, &n0));
            ASSERT_OK(ct_strategy_clip_grad_norm(rs, (float)clip, 2.0, &n1));
        }
        if (clip > 0 && !(fabs((double)n0 - n1) <= tol * n1))
            ct_test_fail(__FILE__, __LINE__, "%s (%s) step %d: gradient norm %.8g, one process %.8g", kind,
                         opts ? opts : "", step, (double)n0, (double)n1);
        if (clip > 0) ASSERT(n1 > clip); /* the clip bites */
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
    }
    ct_state a, b;
    ASSERT_OK(ct_strategy_model_state(ds, &a));
    ASSERT_OK(ct_strategy_model_state(rs, &b));
    /* The tied weight is saved once, under the embedding's name (the state
     * is complete on rank 0; a sharded strategy gives the others less). */
    if (rank == 0) {
        int found = 0;
        for (int i = 0; i < a.n; i++) {
            ASSERT(strcmp(a.names[i], "lm_head.weight") != 0);
            found += !strcmp(a.names[i], "transformer.wte.weight");
        }
        ASSERT_EQ(found, 1);
        double d = state_rel_l2(&a, &b);
        if (!(d < tol)) ct_test_fail(__FILE__, __LINE__, "%s (%s): weights differ from one process by %g (tol %g)",
                                     kind, opts ? opts : "", d, tol);
    }
    ct_state_fini(&a);
    ct_state_fini(&b);
    ASSERT_OK(ct_strategy_summon_full_params(ds, 0, 0)); /* fsdp: the parameters whole again for a look */
    ct_param *after = ct_module_find(dm, "transformer.wte.weight"); /* pipe: only on the stages holding it */
    if (after) ASSERT(ct_f32(after->data)[5] != w0); /* it trained */
    assert_copies_equal(dm);
    ASSERT_OK(ct_strategy_release_full_params(ds));
    ASSERT_OK(ct_strategy_optim_state(ds, &a));
    ASSERT_OK(ct_strategy_optim_state(rs, &b));
    if (rank == 0) {
        double d = state_rel_l2(&a, &b);
        if (!(d < tol)) ct_test_fail(__FILE__, __LINE__, "%s (%s): optimizer state differs by %g", kind,
                                     opts ? opts : "", d);
    }
    ct_state_fini(&a);
    ct_state_fini(&b);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

static void vs_single_clip(const char *kind, const char *opts, int steps, double tol, double clip, int accum)
{
    vs_single_groups(kind, opts, steps, tol, clip, accum, 0);
}

static void vs_single(const char *kind, const char *opts, int steps, double tol)
{
    vs_single_clip(kind, opts, steps, tol, 0, 1);
}

/* Parameter groups under every strategy: each optimizer piece (whole
 * parameters, ZeRO's ranges, FSDP's shards, offload's slices, a pipeline
 * stage's) takes its parameter's group. */
TEST(gpt_groups_every_strategy_equals_one_process)
{
    vs_single_groups("ddp", NULL, 3, 1e-5, 0, 1, 1);
    vs_single_groups("zero1", "split_params=1", 3, 1e-5, 0, 1, 1);
    vs_single_groups("zero2", NULL, 3, 1e-5, 0, 1, 1);
    vs_single_groups("fsdp", "wrap_kinds=block", 3, 1e-5, 0, 1, 1);
    vs_single_groups("pipe", NULL, 3, 1e-5, 0, 1, 1);
    vs_single_groups("pipe", "stages=2,chunks=2,dp=zero1", 3, 1e-5, 0, 1, 1);
    vs_single_groups("offload", "slices=3", 3, 1e-5, 0, 1, 1);
}

TEST(gpt_tied_ddp_equals_one_process)
{
    vs_single("ddp", NULL, 3, 1e-5);
    vs_single("ddp", "grad_accum=2,bucket_cap_mb=0.001", 3, 1e-5);
}

TEST(gpt_tied_zero1_equals_one_process)
{
    vs_single("zero1", NULL, 3, 1e-5);
    vs_single("zero1", "split_params=1,grad_accum=2", 3, 1e-5);
}

TEST(gpt_tied_zero2_equals_one_process)
{
    vs_single("zero2", NULL, 3, 1e-5);
    vs_single("zero2", "reduce_buffer_mb=0.0001", 2, 1e-5); /* one gradient in flight */
    vs_single("zero2", "split_params=1,grad_accum=2", 3, 1e-5);
}

TEST(gpt_tied_mixed_bf16_equals_one_process)
{
    vs_single("ddp", "param_dtype=bf16", 2, 1e-4);
    vs_single("zero2", "param_dtype=bf16", 2, 1e-4);
}

/* FSDP with a unit per transformer block: the tied weight (embedding and
 * head) lives in the root unit, which holds both of its uses. */
TEST(gpt_tied_fsdp_equals_one_process)
{
    vs_single("fsdp", "wrap_kinds=block", 3, 1e-5);
    vs_single("fsdp", "wrap_kinds=block,sharding=grad_op,grad_accum=2", 3, 1e-5);
    vs_single("fsdp", "wrap_kinds=block+attention,backward_prefetch=post,forward_prefetch=1", 3, 1e-5);
    vs_single("fsdp", "wrap_kinds=block,param_dtype=bf16", 2, 1e-4);
    /* c_attn a unit of its own under bf16: the attention decides its path
     * from c_attn's compute copy before c_attn's hooks gather it (it
     * failed: "compute copy of 'weight' has no memory") */
    vs_single("fsdp", "wrap_modules=transformer.h.0.attn.c_attn+transformer.h.1.attn.c_attn,param_dtype=bf16", 2,
              1e-4);
}

/* An auto-wrap policy function (lambda_auto_wrap_policy): the attention
 * and mlp of each block, and any module left with 300 elements or more. */
static int attn_mlp_or_big(const ct_module *m, int64_t nonwrapped, void *ud)
{
    (void)ud;
    size_t l = strlen(m->fqn);
    return !strcmp(m->ops->kind, "attention") || (l > 4 && !strcmp(m->fqn + l - 4, ".mlp")) || nonwrapped >= 300;
}

TEST(gpt_fsdp_auto_wrap_policy_equals_one_process)
{
    ct_module *m = gpt_tiny(3); /* the policy reads names and shapes: any copy of the model */
    char *o = NULL;
    ASSERT_OK(ct_fsdp_auto_wrap(m, attn_mlp_or_big, NULL, "param_dtype=bf16", &o));
    ct_module_destroy(m);
    ASSERT(strstr(o, "attn+") != NULL);
    vs_single("fsdp", o, 2, 1e-4);
    ct_free(o);
}

/* Offload with a slice per block or two: the tied weight stays resident on
 * every rank, its gradient (both uses) allreduced after the last slice. */
TEST(gpt_tied_offload_equals_one_process)
{
    vs_single("offload", "slices=3", 3, 1e-5);
    vs_single("offload", "slices=5,checkpoint_activation=1,microbatches=2,prefetch=0", 3, 1e-5);
    vs_single("offload", "slices=3,param_dtype=bf16", 2, 1e-4);
}

/* The pipeline holds the tied weight twice, in the first stage (the
 * embedding) and the last (the head), on different ranks: each copy gets
 * the sum of both gradients, so both train as the one parameter of one
 * process does.  Stages = the world (2, 3 or 4), both schedules, every
 * checkpoint mode, uneven micro-batches. */
TEST(gpt_tied_pipe_equals_one_process)
{
    vs_single("pipe", NULL, 3, 1e-5);
    vs_single("pipe", "schedule=gpipe,checkpoint=always,chunks=3", 3, 1e-5);
    vs_single("pipe", "schedule=1f1b,checkpoint=never,chunks=2", 3, 1e-5);
    vs_single("pipe", "schedule=gpipe,checkpoint=except_last,chunks=4", 2, 1e-5);
    vs_single("pipe", "param_dtype=bf16", 2, 1e-4);
}

/* Clipping counts the tied weight once (its two copies hold the same
 * gradient); two train steps without zero_grad between them add each
 * use's gradient once (the second adds to copies that hold sums). */
TEST(gpt_tied_pipe_clips_as_one_process)
{
    vs_single_clip("pipe", NULL, 3, 1e-5, 0.5, 1);
    vs_single_clip("pipe", "schedule=gpipe,chunks=3", 2, 1e-5, 0.5, 2);
}

/* Two stages whatever the world: 2 ranks one pipeline, 3 ranks one and a
 * rank sitting out, 4 ranks two replicas of it (pipe x DDP, pipe x ZeRO-1). */
TEST(gpt_tied_pipe_with_replicas_equals_one_process)
{
    vs_single("pipe", "stages=2,chunks=2,bucket_cap_mb=0.001", 3, 1e-5);
    vs_single_clip("pipe", "stages=2,chunks=3,schedule=gpipe", 3, 1e-5, 0.5, 1);
    vs_single("pipe", "stages=2,chunks=2,dp=zero1", 3, 1e-5);
}

/* One process's full state dict (the tied weight once) loads into a
 * pipeline: both stages' copies take it, and the pipeline goes on as the
 * process does. */
TEST(gpt_tied_pipe_loads_full_state_into_every_copy)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g);
    int64_t n = 2 * world + 1;
    ct_module *pm = gpt_tiny(8), *rm = gpt_tiny(3); /* other weights: only the load makes them equal */
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    oo.lr = 0.01;
    oo.eps = 1e-4;
    ct_strategy *ps, *rs;
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    double l;
    gpt_step(rs, 0, n, 1, &l);
    ASSERT_OK(ct_strategy_step(rs));
    ct_strategy_zero_grad(rs);
    ct_state ms, os;
    ASSERT_OK(ct_strategy_model_state(rs, &ms));
    ASSERT_OK(ct_strategy_optim_state(rs, &os));
    ASSERT_OK(ct_strategy_create("pipe", pm, &oo, g, "chunks=2", &ps));
    ASSERT_OK(ct_strategy_load_state(ps, (const char *const *)ms.names, ms.tensors, ms.n, 0));
    ASSERT_OK(ct_strategy_load_state(ps, (const char *const *)os.names, os.tensors, os.n, 1));
    ct_param *w = ct_module_find(pm, "transformer.wte.weight"), *ref = ct_module_find(rm, "transformer.wte.weight");
    if (w) ASSERT(!memcmp(ct_f32(w->data), ct_f32(ref->data), sizeof(float) * (size_t)ref->data->numel));
    assert_copies_equal(pm);
    for (int step = 1; step < 3; step++) {
        double a, b;
        gpt_step(ps, step, n, 0, &a);
        gpt_step(rs, step, n, 1, &b);
        ASSERT_OK(ct_strategy_step(ps));
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(ps);
        ct_strategy_zero_grad(rs);
    }
    assert_copies_equal(pm);
    ct_state a, b;
    ASSERT_OK(ct_strategy_model_state(ps, &a));
    ASSERT_OK(ct_strategy_model_state(rs, &b));
    if (ct_group_rank(g) == 0) ASSERT(state_rel_l2(&a, &b) < 1e-5);
    ct_state_fini(&a);
    ct_state_fini(&b);
    ct_state_fini(&ms);
    ct_state_fini(&os);
    ct_strategy_destroy(ps);
    ct_strategy_destroy(rs);
    ct_module_destroy(pm);
    ct_module_destroy(rm);
}

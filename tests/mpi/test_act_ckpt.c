/*
 * Activation checkpointing (ct_module_apply_activation_checkpointing)
 * under every strategy, over the world: a model with checkpoint wrappers
 * trains to the same weights, bit for bit, as the same model without them
 * under the same strategy and options (the recompute repeats the forward
 * exactly: dropout on, bf16 compute copies, micro-batches), while the gpt's
 * activation bytes fall; under FSDP FULL_SHARD the recompute gathers a
 * unit again and frees it after its backward, so the parameter peak does
 * not grow (a unit kept gathered would raise it).
 */
#include "train_util.h"

typedef struct {
    size_t act, param; /* this rank's peaks over the steps, above what was held before */
} peaks;

/* Three optimizer steps of a model (gpt_tiny, or mlp8 when mlp) wrapped by
 * kind under opts, checkpointed or not: *st gets the full model state (on
 * rank 0, where a sharded strategy assembles it), *pk the peaks. */
static void train(const char *kind, const char *opts, int mlp, int ckpt, ct_state *st, peaks *pk)
{
    ct_group *g = ct_group_world();
    ct_module *m = mlp ? mlp8(5, 24) : gpt_tiny(3);
    int n = 0;
    if (ckpt) {
        ASSERT_OK(ct_module_apply_activation_checkpointing(m, NULL, NULL, &n));
        ASSERT_EQ(n, mlp ? 8 : 2); /* mlp8's children; the gpt's blocks */
    }
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    oo.lr = 0.01;
    oo.eps = 1e-4; /* see test_gpt.c: zero-in-exact-arithmetic gradients */
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create(kind, m, &oo, g, opts, &s));
    size_t a0 = ct_mem_current(CT_MEM_ACT), p0 = ct_mem_current(CT_MEM_PARAM);
    ct_mem_reset_peak();
    int64_t rows = 4 * ct_group_size(g) + 1;
    for (int step = 0; step < 3; step++) {
        if (mlp) {
            step_on_data_rank(s, step, rows, 0, NULL, NULL);
        } else {
            double loss;
            ct_strategy_zero_grad(s);
            gpt_step(s, step, rows, 0, &loss);
            ASSERT_OK(ct_strategy_step(s));
        }
    }
    pk->act = ct_mem_peak(CT_MEM_ACT) - a0;
    pk->param = ct_mem_peak(CT_MEM_PARAM) - p0;
    ASSERT_OK(ct_strategy_model_state(s, st));
    /* the state's tensors are its own references: they outlive the strategy */
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* kind under opts: checkpointed equals plain bit for bit (rel L2 0) on
 * the models asked (bit 1 the gpt, 2 mlp8), with fewer activation bytes on
 * every rank that computes. */
static void same_models(const char *kind, const char *opts, int models)
{
    int rank = ct_group_rank(ct_group_world());
    for (int mlp = 0; mlp < 2; mlp++) {
        if (!(models & (1 << mlp))) continue;
        ct_state a, b;
        peaks pa, pb;
        train(kind, opts, mlp, 0, &a, &pa);
        train(kind, opts, mlp, 1, &b, &pb);
        if (rank == 0) {
            double d = state_rel_l2(&a, &b);
            if (d != 0.0)
                ct_test_fail(__FILE__, __LINE__, "%s (%s), %s: checkpointed weights differ from plain ones by %g",
                             kind, opts ? opts : "", mlp ? "mlp" : "gpt", d);
        }
        /* The gpt keeps less on every rank, and less in all (a stage may
         * peak in its head's logits either way).  mlp8's layers are single
         * linears and activations: a wrapper keeps its input where the
         * layer would keep about as much, so nothing falls there. */
        int64_t sums[2] = {(int64_t)pa.act, (int64_t)pb.act};
        ASSERT_OK(ct_group_allreduce(ct_group_world(), sums, 2, CT_I64, CT_OP_SUM, NULL));
        /* a pipeline stage or an offload slice that keeps only its input already */
        int strict = !strstr(opts ? opts : "", "checkpoint=always") && !strstr(opts ? opts : "", "checkpoint_activation=1");
        if (!mlp && (pb.act > pa.act || (strict && !(sums[1] < sums[0]))))
            ct_test_fail(__FILE__, __LINE__, "%s (%s), gpt: activation peak %zu bytes checkpointed, %zu plain (all ranks: "
                         "%lld, %lld)", kind, opts ? opts : "", pb.act, pa.act, (long long)sums[1], (long long)sums[0]);
        if (!strcmp(kind, "fsdp") && pb.param > pa.param)
            ct_test_fail(__FILE__, __LINE__, "fsdp (%s), %s: parameter peak %zu bytes checkpointed, %zu plain: a "
                         "recompute left units gathered", opts ? opts : "", mlp ? "mlp" : "gpt", pb.param, pa.param);
        ct_state_fini(&a);
        ct_state_fini(&b);
    }
}

static void same_with_and_without(const char *kind, const char *opts) { same_models(kind, opts, 3); }

TEST(act_ckpt_ddp_zero_same_weights)
{
    same_with_and_without("ddp", NULL);
    same_with_and_without("ddp", "grad_accum=2,param_dtype=bf16");
    same_with_and_without("zero1", "grad_accum=2");
    same_with_and_without("zero2", "param_dtype=bf16");
}

TEST(act_ckpt_fsdp_every_sharding_same_weights)
{
    /* the gpt's blocks as units (the command line's), then by size: units
     * inside a checkpointed block too (c_attn, c_fc, c_proj) */
    same_models("fsdp", "wrap_kinds=block", 1);
    same_with_and_without("fsdp", "wrap_min_params=200");
    same_with_and_without("fsdp", "wrap_min_params=200,sharding=grad_op,grad_accum=2");
    same_with_and_without("fsdp", "wrap_min_params=200,sharding=none");
    same_models("fsdp", "wrap_kinds=block,sharding=hybrid,param_dtype=bf16", 1);
    /* bf16 with c_attn a unit of its own (by size), checkpointed or not */
    same_with_and_without("fsdp", "wrap_min_params=200,sharding=hybrid,param_dtype=bf16");
    same_models("fsdp", "wrap_kinds=block,forward_prefetch=1,backward_prefetch=post", 1);
}

TEST(act_ckpt_pipe_offload_same_weights)
{
    same_with_and_without("pipe", "schedule=1f1b,checkpoint=never,chunks=2");
    same_with_and_without("pipe", "schedule=gpipe,checkpoint=always,chunks=3,param_dtype=bf16");
    same_with_and_without("offload", "slices=3");
    same_with_and_without("offload", "slices=2,microbatches=2,checkpoint_activation=1,param_dtype=bf16");
}

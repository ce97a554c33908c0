/*
 * ct_strategy_plan at 2, 3 and 4 ranks against the memory report of the
 * same model wrapped by each strategy over the world and trained two steps
 * on each rank's rows (ct_strategy_memory, the largest rank's figures):
 * param, grad, optim and resident within 10%, activations within 25%, the
 * tolerances `ctrain estimate` promises.  tests/test_plan.c holds one rank.
 */
#include <stdlib.h>

#include "train_util.h"
#include "ctrain/comm.h"

static void near(const char *kind, const char *opts, const char *what, uint64_t planned, size_t measured, double tol)
{
    double e = (double)planned, m = (double)measured;
    if (!(fabs(e - m) <= tol * m))
        ct_test_fail(__FILE__, __LINE__, "%s %s on %d ranks: %s planned %.0f, measured %.0f (more than %.0f%% apart)",
                     kind, opts ? opts : "", ct_group_size(ct_group_world()), what, e, m, tol * 100);
}

static void plan_matches(const ct_model_config *cfg, int64_t batch, const char *kind, const char *opts)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g);
    ct_module *m;
    ASSERT_OK(ct_model_build(cfg, 7, &m));
    ct_plan_spec spec = {.world = world, .batch = batch, .sample_bytes = ct_model_sample_bytes(cfg),
                         .optim = ct_optim_defaults(CT_OPT_ADAMW)};
    int64_t sh[CT_MAX_DIMS];
    int nd = ct_model_input_shape(cfg, 1, sh);
    spec.in_ndim = nd - 1;
    for (int d = 1; d < nd; d++) spec.in_shape[d - 1] = sh[d];
    ct_mem_plan plan;
    ASSERT_OK(ct_strategy_plan(kind, m, opts, &spec, &plan));

    ct_strategy *s;
    ASSERT_OK(ct_strategy_create(kind, m, &spec.optim, g, opts, &s));
    ct_mem_reset_peak();
    int dr, ds;
    ct_strategy_data_rank(s, &dr, &ds);
    int64_t first, count;
    slice(batch, dr, ds, &first, &count);
    for (int step = 0; step < 2; step++) {
        sh[0] = count;
        ct_tensor *x, *y;
        if (cfg->kind == CT_MODEL_GPT) { /* i64 tokens and next tokens [rows, T], as the text loader's */
            x = ct_tensor_create(CT_I64, nd, sh, CT_MEM_ACT);
            y = ct_tensor_create(CT_I64, nd, sh, CT_MEM_ACT);
            ASSERT(x && y);
            for (int64_t i = 0; i < x->numel; i++) {
                ((int64_t *)ct_tensor_data(x))[i] = (i * 7 + first) % cfg->vocab;
                ((int64_t *)ct_tensor_data(y))[i] = (i * 7 + first + 1) % cfg->vocab;
            }
        } else { /* f32 inputs and i32 labels, as the IDX loader's */
            x = ct_tensor_create(CT_F32, nd, sh, CT_MEM_ACT);
            y = ct_tensor_create(CT_I32, 1, &count, CT_MEM_ACT);
            ASSERT(x && y);
            for (int64_t i = 0; i < x->numel; i++) ct_f32(x)[i] = (float)((i * 37 + first) % 101) / 50.0f - 1.0f;
            for (int64_t i = 0; i < count; i++) ((int32_t *)ct_tensor_data(y))[i] = (int32_t)((first + i) % cfg->classes);
        }
        ct_batch b = {.x = x, .y = y, .global_rows = batch, .sample0 = first};
        ct_fwd_ctx ctx = {.training = 1, .seed = 3, .step = (uint64_t)step};
        ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL));
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    ct_mem_report *all = ct_alloc(sizeof *all * (size_t)world, CT_MEM_OTHER), mx = {0};
    ASSERT(all);
    ASSERT_OK(ct_strategy_memory(s, all));
    for (int r = 0; r < world; r++) {
        for (int c = 0; c < CT_MEM_NCAT; c++) mx.peak[c] = all[r].peak[c] > mx.peak[c] ? all[r].peak[c] : mx.peak[c];
        mx.peak_resident = all[r].peak_resident > mx.peak_resident ? all[r].peak_resident : mx.peak_resident;
    }
    ct_free(all);
    near(kind, opts, "param", plan.param, mx.peak[CT_MEM_PARAM], 0.10);
    near(kind, opts, "grad", plan.grad, mx.peak[CT_MEM_GRAD], 0.10);
    near(kind, opts, "optim", plan.optim, mx.peak[CT_MEM_OPTIM], 0.10);
    near(kind, opts, "resident", plan.resident, mx.peak_resident, 0.10);
    near(kind, opts, "act", plan.act, mx.peak[CT_MEM_ACT], 0.25);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

TEST(plan_of_each_strategy_matches_its_memory_report)
{
    ct_model_config mlp = ct_model_config_default(CT_MODEL_MLP);
    ASSERT_OK(ct_model_config_parse_hidden(&mlp, "256,256,256"));
    plan_matches(&mlp, 32, "ddp", "param_dtype=bf16");
    plan_matches(&mlp, 32, "zero1", "reduce_dtype=bf16");
    plan_matches(&mlp, 32, "zero2", "reduce_buffer_mb=1");
    plan_matches(&mlp, 32, "zero2", "split_params=1");
    plan_matches(&mlp, 32, "fsdp", "wrap_min_params=100000");
    plan_matches(&mlp, 32, "fsdp", "wrap_min_params=100000,sharding=grad_op,param_dtype=bf16");
    plan_matches(&mlp, 32, "pipe", "chunks=4");
    plan_matches(&mlp, 32, "offload", "slices=3");
    /* the gpt: fsdp's units are its blocks (as `ctrain train` wraps it), a tied embedding and head */
    ct_model_config gpt = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&gpt, 2, 2, 32, 24, 128);
    gpt.dropout = 0.1f;
    plan_matches(&gpt, 8, "fsdp", "wrap_kinds=block");
    plan_matches(&gpt, 8, "fsdp", "wrap_kinds=block,param_dtype=bf16");
    plan_matches(&gpt, 8, "zero2", NULL);
}

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

/* The plan of model m (taking cfg's inputs and classes) against its
 * memory report after two steps under kind; *plan (may be NULL) gets the
 * plan, *comm the largest rank's measured comm peak. */
static void plan_vs_run(const ct_model_config *cfg, ct_module *m, int64_t batch, const char *kind, const char *opts,
                        ct_mem_plan *plan_out, size_t *comm)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g);
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
    if (plan_out) *plan_out = plan;
    if (comm) *comm = mx.peak[CT_MEM_COMM];
    ct_strategy_destroy(s);
}

static void plan_matches(const ct_model_config *cfg, int64_t batch, const char *kind, const char *opts)
{
    ct_module *m;
    ASSERT_OK(ct_model_build(cfg, 7, &m));
    plan_vs_run(cfg, m, batch, kind, opts, NULL, NULL);
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

/* A model whose 256-wide skip "s" (children 2 to 6) crosses the boundary
 * after child 4 (5:4) or both (3:3:3), where the activation is 8 wide:
 * with skip 0 the stash and pop are flattens (aliases of their input). */
static ct_module *skip_model(const ct_model_config *cfg, int skip)
{
    int64_t sh[CT_MAX_DIMS];
    ct_model_input_shape(cfg, 1, sh);
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(sh[1], 256, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, skip ? ct_skip_stash_create("s") : ct_flatten_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(256, 8, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(8, 256, 1)));
    ASSERT_OK(ct_module_add(m, NULL, skip ? ct_skip_pop_create("s") : ct_flatten_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(256, cfg->classes, 1)));
    ct_module_init_params(m, 7);
    return m;
}

/* Skips crossing a pipeline boundary ride in its messages: the plan's comm
 * (the sends in flight and the spare, each the largest message) grows by a
 * whole number of a micro-batch's skip rows, one per message, its
 * activations by at least one micro-batch's skip rows, and the plan matches
 * a measured run as plan_vs_run checks (act within 25%). */
TEST(plan_of_pipe_counts_skips_crossing_a_boundary)
{
    ct_model_config cfg = ct_model_config_default(CT_MODEL_MLP);
    int world = ct_group_size(ct_group_world());
    const char *opts[] = {"stages=2,balance=5:4,chunks=4,schedule=gpipe,checkpoint=never",
                          "stages=2,balance=5:4,chunks=4,schedule=1f1b,checkpoint=always",
                          "stages=3,balance=3:3:3,chunks=4,schedule=1f1b,checkpoint=except_last"};
    for (int o = 0; o < 3; o++) {
        int stages = o < 2 ? 2 : 3;
        if (world < stages) continue;
        int64_t batch = 32, rows = batch / (world / stages), mrows = (rows + 3) / 4;
        uint64_t sbytes = (uint64_t)mrows * 256 * 4; /* one micro-batch's skip values */
        ct_mem_plan with, without;
        size_t cw, co;
        for (int skip = 1; skip >= 0; skip--) { /* one model at a time: the report counts every model's bytes */
            ct_module *m = skip_model(&cfg, skip);
            plan_vs_run(&cfg, m, batch, "pipe", opts[o], skip ? &with : &without, skip ? &cw : &co);
            ct_module_destroy(m);
        }
        uint64_t grew = with.comm - without.comm;
        ASSERT(with.comm > without.comm && grew % sbytes == 0);
        ASSERT(grew >= 2 * sbytes && grew <= 5 * sbytes); /* a send and the spare, up to 4 sends and the spare */
        ASSERT(with.act >= without.act + sbytes);
        /* a run holds a send until a later one reaps it; the plan is the most it can hold */
        if (cw > with.comm || co > without.comm)
            ct_test_fail(__FILE__, __LINE__, "%s: comm measured %zu / %zu against planned %llu / %llu", opts[o], cw,
                         co, (unsigned long long)with.comm, (unsigned long long)without.comm);
    }
}

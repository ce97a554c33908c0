/*
 * Memory planning through the library: ct_act_plan_run (the layers'
 * act_cost, replayed) against what a real forward and backward hold, and
 * ct_strategy_plan against the memory report of the same model wrapped by
 * each strategy and trained a step (one process; `ctrain estimate`'s tests
 * in test_cli*.c hold the multi-rank runs), within the tolerances
 * `ctrain estimate` promises: 10% for param, grad, optim and resident, 25%
 * for activations.
 */
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include "test.h"
#include "ctrain/comm.h"

#define NEAR(e, m, tol, what)                                                                          \
    do {                                                                                               \
        double e_ = (double)(e), m_ = (double)(m);                                                     \
        if (!(fabs(e_ - m_) <= (tol) * m_))                                                            \
            ct_test_fail(__FILE__, __LINE__, "%s: planned %.0f, measured %.0f (more than %.0f%% apart)", \
                         what, e_, m_, (tol) * 100);                                                   \
    } while (0)

static ct_module *build(ct_model_config *cfg)
{
    ct_module *m;
    ASSERT_OK(ct_model_config_validate(cfg));
    ASSERT_OK(ct_model_build(cfg, 7, &m));
    return m;
}

/* A batch of rows for cfg's model: f32 inputs or i64 tokens (CT_MEM_ACT, as the loaders' batches). */
static ct_tensor *inputs(const ct_model_config *cfg, int64_t rows)
{
    int64_t sh[CT_MAX_DIMS];
    int nd = ct_model_input_shape(cfg, rows, sh);
    ct_tensor *x = ct_tensor_create(cfg->kind == CT_MODEL_GPT ? CT_I64 : CT_F32, nd, sh, CT_MEM_ACT);
    ASSERT(x);
    if (cfg->kind == CT_MODEL_GPT)
        for (int64_t i = 0; i < x->numel; i++) ((int64_t *)ct_tensor_data(x))[i] = (i * 7) % cfg->vocab;
    else {
        ct_rng r;
        ct_rng_init(&r, 5, 0);
        ct_rng_normal(&r, ct_f32(x), (size_t)x->numel, 0, 1);
    }
    return x;
}

/* One forward with a record and its backward of model on rows rows: what
 * the records keep (the activation bytes alive after forward but the
 * output) and the peak of the two, both without the input, against the
 * plan of the model's children. */
static size_t act_matches_ckpt(ct_model_config *cfg, int64_t rows, int ckpt)
{
    ct_module *m = build(cfg);
    if (ckpt) ASSERT_OK(ct_module_apply_activation_checkpointing(m, NULL, NULL, NULL));
    ct_tensor *x = inputs(cfg, rows);
    ct_fwd_ctx ctx = {.training = 1, .seed = 3};
    size_t base = ct_mem_current(CT_MEM_ACT);
    ct_mem_reset_peak();
    ct_tensor *y, *dx = NULL;
    ct_record *rec;
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    size_t kept = ct_mem_current(CT_MEM_ACT) - base - ct_tensor_bytes(y);
    ct_tensor *dy = ct_tensor_create(CT_F32, y->ndim, y->shape, CT_MEM_ACT);
    ASSERT(dy);
    for (int64_t i = 0; i < dy->numel; i++) ct_f32(dy)[i] = 1e-3f * (float)(i % 13);
    ASSERT_OK(ct_module_backward(m, dy, NULL, rec));
    size_t peak = ct_mem_peak(CT_MEM_ACT) - base;
    ct_tensor_release(dy);
    ct_tensor_release(y);
    ct_tensor_release(dx);

    int64_t sh[CT_MAX_DIMS];
    int nd = ct_model_input_shape(cfg, rows, sh);
    ct_act_plan ap;
    ASSERT_OK(ct_act_plan_run(&m, 1, nd, sh, CT_ACT_WHOLE, &ap));
    char what[128];
    snprintf(what, sizeof what, "%s%s: bytes the records keep", ct_model_kind_name(cfg->kind), ckpt ? " checkpointed" : "");
    NEAR(ap.kept, kept, 0.25, what);
    snprintf(what, sizeof what, "%s%s: peak activation bytes", ct_model_kind_name(cfg->kind), ckpt ? " checkpointed" : "");
    NEAR(ap.peak, peak, 0.25, what);
    ct_tensor_release(x);
    ct_module_destroy(m);
    return peak;
}

static void act_matches(ct_model_config *cfg, int64_t rows) { act_matches_ckpt(cfg, rows, 0); }

TEST(plan_act_matches_a_recorded_step)
{
    ct_model_config mlp = ct_model_config_default(CT_MODEL_MLP);
    ASSERT_OK(ct_model_config_parse_hidden(&mlp, "512,256"));
    mlp.dropout = 0.1f;
    act_matches(&mlp, 32);
    ct_model_config cnn = ct_model_config_default(CT_MODEL_CNN);
    act_matches(&cnn, 16);
    ct_model_config gpt = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&gpt, 2, 2, 32, 24, 64);
    gpt.dropout = 0.1f;
    act_matches(&gpt, 4);
}

/* A checkpoint keeps its input only and recomputes its body's records in
 * backward: the plan of a model with one follows what a step holds. */
TEST(plan_act_of_a_checkpointed_body)
{
    ct_module *body = ct_sequential_create(), *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(body, NULL, ct_linear_create(256, 256, 1)));
    ASSERT_OK(ct_module_add(body, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(body, NULL, ct_linear_create(256, 256, 1)));
    ASSERT_OK(ct_module_add(body, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(64, 256, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_checkpoint_create(body)));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(256, 10, 1)));
    ct_module_init_params(m, 3);
    int64_t sh[2] = {32, 64};
    ct_tensor *x = ct_tensor_create(CT_F32, 2, sh, CT_MEM_OTHER);
    ASSERT(x);
    for (int64_t i = 0; i < x->numel; i++) ct_f32(x)[i] = (float)(i % 7) * 0.1f;
    ct_fwd_ctx ctx = {.training = 1, .seed = 3};
    size_t base = ct_mem_current(CT_MEM_ACT);
    ct_mem_reset_peak();
    ct_tensor *y;
    ct_record *rec;
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    size_t kept = ct_mem_current(CT_MEM_ACT) - base - ct_tensor_bytes(y);
    ct_tensor *dy = ct_tensor_create(CT_F32, y->ndim, y->shape, CT_MEM_ACT);
    ASSERT(dy);
    memset(ct_tensor_data(dy), 0, ct_tensor_bytes(dy));
    ASSERT_OK(ct_module_backward(m, dy, NULL, rec));
    size_t peak = ct_mem_peak(CT_MEM_ACT) - base;
    ct_tensor_release(dy);
    ct_tensor_release(y);
    ct_act_plan ap;
    ASSERT_OK(ct_act_plan_run(&m, 1, 2, sh, CT_ACT_WHOLE, &ap));
    NEAR(ap.kept, kept, 0.25, "checkpointed: bytes the records keep");
    NEAR(ap.peak, peak, 0.25, "checkpointed: peak activation bytes");
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* ct_module_apply_activation_checkpointing: the gpt's blocks keep their
 * inputs only; the plan follows what a step holds, which falls. */
TEST(plan_act_of_activation_checkpointing)
{
    ct_model_config gpt = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&gpt, 4, 2, 64, 64, 256);
    gpt.dropout = 0.1f;
    size_t plain = act_matches_ckpt(&gpt, 4, 0), ck = act_matches_ckpt(&gpt, 4, 1);
    if (!(ck * 2 < plain)) ct_test_fail(__FILE__, __LINE__, "checkpointed peak %zu, plain %zu", ck, plain);
    ct_model_config mlp = ct_model_config_default(CT_MODEL_MLP);
    ASSERT_OK(ct_model_config_parse_hidden(&mlp, "512,256"));
    mlp.dropout = 0.1f;
    act_matches_ckpt(&mlp, 32, 1);
}

/* Each layer's act_cost says what its forward keeps: a linear its input,
 * a relu its output, a flatten nothing new (a view), a dropout a byte mask. */
TEST(plan_act_cost_of_layers)
{
    ct_module *lin = ct_linear_create(8, 4, 1), *relu = ct_relu_create(), *drop = ct_dropout_create(0.5f);
    ct_module *flat = ct_flatten_create(), *seq = ct_sequential_create();
    ct_act_cost c;
    ASSERT_OK(ct_module_act_cost(lin, 2, (int64_t[]){3, 8}, 0, 1, &c));
    ASSERT(c.keep_in && !c.keep_out && !c.saved && !c.walk);
    ASSERT_OK(ct_module_act_cost(relu, 2, (int64_t[]){3, 8}, 0, 1, &c));
    ASSERT(!c.keep_in && c.keep_out && !c.saved);
    ASSERT_OK(ct_module_act_cost(drop, 2, (int64_t[]){3, 8}, 0, 1, &c));
    ASSERT_EQ(c.saved, 24);
    ASSERT_OK(ct_module_act_cost(flat, 3, (int64_t[]){3, 2, 4}, 0, 1, &c));
    ASSERT(c.alias && !c.saved);
    ASSERT_OK(ct_module_act_cost(seq, 2, (int64_t[]){3, 8}, 0, 1, &c));
    ASSERT(c.walk);
    /* a shape forward would refuse is the same error */
    ASSERT_ERR(ct_module_act_cost(lin, 2, (int64_t[]){3, 7}, 0, 1, &c), CT_EINVAL, "");
    ct_module_destroy(lin);
    ct_module_destroy(relu);
    ct_module_destroy(drop);
    ct_module_destroy(flat);
    ct_module_destroy(seq);
}

static size_t ctrain_bytes(void)
{
    size_t n = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) n += ct_mem_current((ct_mem_cat)c);
    return n;
}

/* ct_strategy_plan for kind under opts against ct_strategy_memory after
 * two steps of the same model wrapped by that strategy (one rank). */
static void strategy_matches(ct_model_config *cfg, int64_t batch, const char *kind, const char *opts, double act_tol)
{
    ct_module *m = build(cfg);
    ct_plan_spec spec = {.world = 1, .batch = batch, .sample_bytes = ct_model_sample_bytes(cfg),
                         .optim = ct_optim_defaults(CT_OPT_ADAMW)};
    int64_t sh[CT_MAX_DIMS];
    spec.in_ndim = ct_model_input_shape(cfg, 1, sh) - 1;
    for (int d = 0; d < spec.in_ndim; d++) spec.in_shape[d] = sh[d + 1];
    ct_mem_plan plan;
    size_t bytes0 = ctrain_bytes();
    ASSERT_OK(ct_strategy_plan(kind, m, opts, &spec, &plan));
    ASSERT_EQ(ctrain_bytes(), bytes0); /* planning holds nothing afterwards */
    ASSERT(plan.resident <= plan.param + plan.grad + plan.optim && plan.total == plan.resident + plan.act + plan.comm);

    ct_strategy *s;
    ASSERT_OK(ct_strategy_create(kind, m, &spec.optim, NULL, opts, &s));
    ct_mem_reset_peak();
    for (int step = 0; step < 2; step++) {
        ct_tensor *x = inputs(cfg, batch);
        ct_tensor *y = ct_tensor_create(CT_I32, 1, &batch, CT_MEM_ACT);
        for (int64_t i = 0; i < batch; i++) ((int32_t *)ct_tensor_data(y))[i] = (int32_t)(i % cfg->classes);
        ct_batch b = {x, y, batch, 0};
        ct_fwd_ctx ctx = {.training = 1, .seed = 3, .step = (uint64_t)step};
        ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL));
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    ct_mem_report r;
    ASSERT_OK(ct_strategy_memory(s, &r));
    char what[160];
#define CHECK(field, measured, tol)                                                                   \
    do {                                                                                              \
        snprintf(what, sizeof what, "%s %s %s", kind, opts ? opts : "", #field);                      \
        NEAR(plan.field, measured, tol, what);                                                        \
    } while (0)
    CHECK(param, r.peak[CT_MEM_PARAM], 0.10);
    CHECK(grad, r.peak[CT_MEM_GRAD], 0.10);
    CHECK(optim, r.peak[CT_MEM_OPTIM], 0.10);
    CHECK(resident, r.peak_resident, 0.10);
    CHECK(act, r.peak[CT_MEM_ACT], act_tol);
#undef CHECK
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

TEST(plan_strategies_match_their_memory_reports)
{
    ASSERT_OK(ct_comm_init(NULL, NULL));
    ct_model_config mlp = ct_model_config_default(CT_MODEL_MLP);
    ASSERT_OK(ct_model_config_parse_hidden(&mlp, "512,512,512"));
    strategy_matches(&mlp, 64, "none", NULL, 0.25);
    strategy_matches(&mlp, 64, "none", "param_dtype=bf16", 0.25);
    strategy_matches(&mlp, 64, "ddp", "grad_accum=2", 0.25);
    strategy_matches(&mlp, 64, "zero1", NULL, 0.25);
    strategy_matches(&mlp, 64, "zero2", "reduce_buffer_mb=1", 0.25);
    strategy_matches(&mlp, 64, "fsdp", "wrap_min_params=100000", 0.25);
    strategy_matches(&mlp, 64, "pipe", "chunks=4", 0.25);
    strategy_matches(&mlp, 64, "offload", "slices=3", 0.25);
    ct_model_config cnn = ct_model_config_default(CT_MODEL_CNN);
    ASSERT_OK(ct_model_config_parse_hidden(&cnn, "8,16,64"));
    strategy_matches(&cnn, 32, "ddp", NULL, 0.25);
    ct_comm_finalize();
#if defined(__SANITIZE_ADDRESS__)
    /* Open MPI leaves allocations behind after MPI_Finalize that LeakSanitizer
     * would report at exit (see test_comm_single.c); the plans' were checked. */
    _exit(0);
#endif
}

/* Bad requests are errors that name the fix, not a plan. */
TEST(plan_refuses_what_the_strategy_refuses)
{
    ct_model_config mlp = ct_model_config_default(CT_MODEL_MLP);
    ct_module *m = build(&mlp);
    ct_plan_spec spec = {.world = 2, .batch = 8, .in_ndim = 1, .in_shape = {784}, .sample_bytes = 3140,
                         .optim = ct_optim_defaults(CT_OPT_SGD)};
    ct_mem_plan p;
    ASSERT_ERR(ct_strategy_plan("none", m, NULL, &spec, &p), CT_EUNSUPPORTED, "runs every rank alone");
    ASSERT_ERR(ct_strategy_plan("fsdp9", m, NULL, &spec, &p), CT_EINVAL, "unknown strategy 'fsdp9'");
    ASSERT_ERR(ct_strategy_plan("zero2", m, "bucket=4", &spec, &p), CT_EINVAL, "bucket");
    ASSERT_ERR(ct_strategy_plan("pipe", m, "stages=3", &spec, &p), CT_EINVAL, "3 stages do not fit 2 ranks");
    /* a balance the strategy would refuse at wrap (it once read past the model's children) */
    ASSERT_ERR(ct_strategy_plan("pipe", m, "balance=4:4", &spec, &p), CT_EINVAL, "sums to 8 but the model has 5");
    ASSERT_ERR(ct_strategy_plan("offload", m, "balance=2:2", &spec, &p), CT_EINVAL, "sums to 4 but the model has 5");
    spec.world = 0;
    ASSERT_ERR(ct_strategy_plan("ddp", m, NULL, &spec, &p), CT_EINVAL, "at least 1");
    /* SGD without momentum keeps no state: the plan says so */
    spec.world = 2;
    ASSERT_OK(ct_strategy_plan("ddp", m, NULL, &spec, &p));
    ASSERT_EQ(p.optim, 0);
    ct_module_destroy(m);
}

/* The whole life's plan: the cache's bound follows the largest flat (FSDP's
 * largest unit, DDP's bucket) as the allocator's automatic bound does, or
 * alloc_cache_mb; set-up is the whole model built on every rank plus what
 * wrap copies out of it (FSDP: the shards); a full save adds on rank 0 what
 * it holds of a state streamed one tensor at a time (the largest tensor);
 * ZeRO-2's teardown adds this rank's gradient pieces to training's; the
 * peak is the cache plus the largest of them, in its phase. */
TEST(plan_whole_life_follows_the_flats)
{
    ct_model_config mlp = ct_model_config_default(CT_MODEL_MLP);
    ASSERT_OK(ct_model_config_parse_hidden(&mlp, "2048,1024"));
    ct_module *m = build(&mlp);
    ct_plan_spec spec = {.world = 4, .batch = 64, .in_ndim = 1, .in_shape = {784}, .sample_bytes = 3140,
                         .optim = ct_optim_defaults(CT_OPT_ADAMW)};
    int64_t P = ct_module_num_params(m), largest_unit = 0;
    const uint64_t floor_b = (uint64_t)CT_MEM_CACHE_MIN_MB << 20, MB = 1 << 20;
    ct_fsdp_unit u[16];
    int nu;
    ASSERT_OK(ct_fsdp_plan(m, "wrap_min_params=100000", u, 16, &nu));
    for (int i = 0; i < nu; i++) largest_unit = u[i].numel > largest_unit ? u[i].numel : largest_unit;
    ASSERT_EQ(largest_unit, (int64_t)2048 * 1024 + 1024); /* Linear(2048,1024) */
    static const char *kinds[] = {"ddp", "zero1", "zero2", "fsdp", "offload"};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        ct_mem_plan p;
        const char *opts = !strcmp(kinds[k], "fsdp") ? "wrap_min_params=100000" : "bucket_cap_mb=10";
        if (!strcmp(kinds[k], "zero2") || !strcmp(kinds[k], "offload")) opts = NULL;
        ASSERT_OK(ct_strategy_plan(kinds[k], m, opts, &spec, &p));
        uint64_t want = p.flat * CT_MEM_CACHE_UNITS > floor_b ? p.flat * CT_MEM_CACHE_UNITS : floor_b;
        ASSERT_EQ(p.cache, want);
        /* DDP's and ZeRO-1's buckets are shared windows: every other rank's are mapped into each */
        int shares = !strcmp(kinds[k], "ddp") || !strcmp(kinds[k], "zero1");
        ASSERT_EQ(p.shared, shares ? (uint64_t)(spec.world - 1) * (uint64_t)P * 4 : 0);
        uint64_t churn = p.act + p.comm + 2 * p.flat, train = p.shared + p.total + (p.cache < churn ? p.cache : churn);
        /* ZeRO-2's teardown copies this rank's reduced gradient pieces out on top of training's */
        int z2 = !strcmp(kinds[k], "zero2");
        if (z2) train += ((uint64_t)P * 4 + (uint64_t)spec.world - 1) / (uint64_t)spec.world;
        uint64_t top = train > p.setup ? train : p.setup;
        top = p.save > top ? p.save : top;
        ASSERT_EQ(p.life, top);
        ASSERT_EQ(p.life_phase, top == train ? (z2 ? CT_PHASE_TEARDOWN : CT_PHASE_TRAIN)
                                : top == p.setup ? CT_PHASE_WRAP : CT_PHASE_SAVE);
        /* the model is built shape-only: the replicated strategies make it whole, fsdp its shards, offload a
         * slice at a time */
        if (strcmp(kinds[k], "fsdp") && strcmp(kinds[k], "offload")) ASSERT(p.setup >= p.shared + (uint64_t)P * 4);
        if (!strcmp(kinds[k], "offload")) ASSERT_EQ(p.setup, p.flat);
        if (strcmp(kinds[k], "offload")) ASSERT(p.save >= p.shared + p.resident);
        else ASSERT(p.save >= (uint64_t)P * 8); /* the slices flushed, the whole state read back */
        if (!strcmp(kinds[k], "fsdp")) {
            ASSERT_EQ(p.flat, (uint64_t)largest_unit * 4);
            ASSERT_EQ(p.setup, ((uint64_t)P * 4 + 3) / 4);
            ASSERT(p.save < p.resident + (uint64_t)P * 4); /* streamed to rank 0 one tensor at a time */
        }
        if (!strcmp(kinds[k], "ddp")) {
            ASSERT_EQ(p.flat, 10 * MB); /* a full bucket (the model has more) */
            ASSERT_EQ(p.setup, p.shared + (uint64_t)P * 4);
            ASSERT_EQ(p.save, p.shared + p.resident); /* the state is the parameters and slots themselves */
        }
        if (!strcmp(kinds[k], "zero1")) ASSERT(p.save < p.shared + p.resident + (uint64_t)P * 4); /* streamed: never the whole state */
        if (!strcmp(kinds[k], "zero2")) ASSERT_EQ(p.flat, (uint64_t)2048 * 1024 * 4); /* one gradient: the largest */
    }
    ct_mem_plan p;
    ASSERT_OK(ct_strategy_plan("fsdp", m, "wrap_min_params=100000,alloc_cache_mb=7", &spec, &p));
    ASSERT_EQ(p.cache, 7 * MB);
    ASSERT_OK(ct_strategy_plan("fsdp", m, "alloc_cache_mb=0", &spec, &p));
    ASSERT_EQ(p.cache, 0);
    ASSERT_ERR(ct_strategy_plan("fsdp", m, "alloc_cache_mb=-1", &spec, &p), CT_EINVAL, "auto or a whole number from 0");
    ct_module_destroy(m);
}

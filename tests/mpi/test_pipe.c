/*
 * Pipeline parallelism under mpirun: pipelined training must equal one
 * process training the same model on the same batches (both schedules,
 * every checkpoint mode, uneven micro-batches, dropout, clipping), with
 * replicas (pipe x DDP, pipe x ZeRO-1 at 4 ranks), and every validation
 * error must be an error on every rank.  1F1B's activation peak per stage
 * stays within stages x one micro-batch while GPipe's grows with chunks.
 */
#include "train_util.h"

/* The model every test pipelines (8 children, dropout in one). */
static ct_module *model(uint64_t seed) { return mlp8(seed, 16); }

/* One step of s on this rank's slice (step_on_data_rank) of global_batch2;
 * *loss gets the loss summed over the group's ranks / rows. */
static void step_on(ct_strategy *s, int step, int64_t n, double clip, float *norm, double *loss)
{
    ct_step_out out;
    step_on_data_rank(s, step, n, clip, norm, &out);
    double v[2] = {out.loss_sum, (double)out.rows}, all[2 * 8];
    ct_group *g = ct_strategy_group(s);
    int size = ct_group_size(g);
    ASSERT(size <= 8);
    ASSERT_OK(ct_group_allgather(g, v, all, (int64_t)sizeof v, CT_U8, NULL));
    double ls = 0, rs = 0;
    for (int r = 0; r < size; r++) {
        ls += all[2 * r];
        rs += all[2 * r + 1];
    }
    if (!strcmp(ct_strategy_kind(s), "none")) ls = v[0], rs = v[1]; /* every rank trains the whole batch */
    *loss = ls / rs;
}

/* The pipelined state (gathered on rank 0) equals the reference model's. */
static void assert_state_matches(ct_strategy *ps, ct_module *ref, double tol)
{
    ct_state st;
    ASSERT_OK(ct_strategy_model_state(ps, &st));
    if (ct_group_rank(ct_strategy_group(ps)) == 0) {
        ct_param **rp;
        int nr;
        ASSERT_OK(ct_module_params(ref, &rp, &nr));
        ASSERT_EQ(st.n, nr);
        for (int i = 0; i < st.n; i++) {
            ct_param *q = ct_module_find(ref, st.names[i]);
            ASSERT(q != NULL);
            ASSERT_EQ(st.tensors[i]->numel, q->data->numel);
            for (int64_t j = 0; j < q->data->numel; j++)
                ASSERT_CLOSE(ct_f32(st.tensors[i])[j], ct_f32(q->data)[j], tol, tol);
        }
        ct_free(rp);
    }
    ct_state_fini(&st);
}

static ct_optim_opts adamw(void)
{
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.lr = 0.01f;
    return o;
}

/* Pipelined (opts) vs one process, `steps` steps of a 10-row batch. */
static void pipe_vs_single(const char *opts, int64_t n, double clip)
{
    ct_group *g = ct_group_world();
    ct_module *pm = model(42), *rm = model(42);
    ct_optim_opts po = adamw(), ro = adamw();
    ct_strategy *ps, *rs;
    ASSERT_OK(ct_strategy_create("pipe", pm, &po, g, opts, &ps));
    ASSERT_OK(ct_strategy_create("none", rm, &ro, NULL, NULL, &rs));
    for (int step = 0; step < 3; step++) {
        float pn = 0, rn = 0;
        double pl, rl;
        step_on(ps, step, n, clip, &pn, &pl);
        step_on(rs, step, n, clip, &rn, &rl);
        ASSERT_CLOSE(pl, rl, 1e-5, 1e-6);
        if (clip > 0) ASSERT_CLOSE(pn, rn, 1e-5, 1e-6);
    }
    assert_state_matches(ps, rm, 2e-5);
    /* inference through the pipeline: the last stage holds the logits */
    ct_tensor *x, *y, *pz = NULL, *rz = NULL;
    global_batch2(100, n, &x, &y);
    ct_fwd_ctx ctx = {.training = 0};
    ASSERT_OK(ct_strategy_predict(ps, x, &ctx, &pz));
    ASSERT_OK(ct_strategy_predict(rs, x, &ctx, &rz));
    int stage, nst;
    ct_strategy_pipe_stage(ps, &stage, &nst);
    ASSERT_EQ(pz != NULL, stage == nst - 1);
    if (pz) {
        ASSERT_EQ(pz->numel, rz->numel);
        for (int64_t i = 0; i < pz->numel; i++) ASSERT_CLOSE(ct_f32(pz)[i], ct_f32(rz)[i], 2e-5, 2e-5);
    }
    ct_tensor_release(pz);
    ct_tensor_release(rz);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(ps);
    ct_strategy_destroy(rs);
    ct_module_destroy(pm);
    ct_module_destroy(rm);
}

static void every_mode(const char *schedule)
{
    static const char *const modes[] = {"always", "except_last", "never"};
    for (int i = 0; i < 3; i++) {
        char opts[128];
        /* 10 rows in chunks of 3: 3, 3, 3, 1 */
        snprintf(opts, sizeof opts, "schedule=%s,checkpoint=%s,chunks=4", schedule, modes[i]);
        pipe_vs_single(opts, 10, 0);
    }
}

TEST(pipe_gpipe_matches_single_process_every_checkpoint_mode) { every_mode("gpipe"); }
TEST(pipe_1f1b_matches_single_process_every_checkpoint_mode) { every_mode("1f1b"); }

TEST(pipe_more_chunks_than_rows_and_clipping)
{
    pipe_vs_single("chunks=16,schedule=1f1b", 5, 0.05);
    pipe_vs_single("chunks=1,schedule=gpipe", 7, 0.05);
}

/* Two stages whatever the world: 2 ranks one pipeline, 3 ranks one
 * pipeline and a rank sitting out, 4 ranks two replicas (pipe x DDP). */
TEST(pipe_two_stages_with_replicas_ddp)
{
    pipe_vs_single("stages=2,balance=5:3,chunks=3,bucket_cap_mb=0.001", 12, 0.1);
}

TEST(pipe_two_stages_with_replicas_zero1)
{
    pipe_vs_single("stages=2,chunks=2,dp=zero1,schedule=gpipe", 12, 0.1);
    ct_module *m = model(1);
    ct_optim_opts o = adamw();
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("pipe", m, &o, NULL, "stages=2,dp=zero1", &s));
    int stage, n;
    ct_strategy_pipe_stage(s, &stage, &n);
    int world = ct_group_size(ct_group_world());
    ASSERT_EQ(n, 2);
    if (ct_group_rank(ct_group_world()) >= 2 * (world / 2)) ASSERT_EQ(stage, -1);
    /* with two replicas each owns part of its stage's optimizer state */
    if (world == 4) ASSERT(ct_strategy_partition(s) != NULL && ct_strategy_partition(s)->nranks == 2);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* A full state dict from one process resumes a pipeline: both go on alike. */
TEST(pipe_loads_full_state_and_resumes)
{
    ct_module *pm = model(3), *rm = model(42);
    ct_optim_opts po = adamw(), ro = adamw();
    ct_strategy *ps, *rs;
    ASSERT_OK(ct_strategy_create("none", rm, &ro, NULL, NULL, &rs));
    float nrm;
    double l;
    step_on(rs, 0, 8, 0, &nrm, &l);
    ct_state ms, os;
    ASSERT_OK(ct_strategy_model_state(rs, &ms));
    ASSERT_OK(ct_strategy_optim_state(rs, &os));
    ASSERT_OK(ct_strategy_create("pipe", pm, &po, NULL, "chunks=3", &ps));
    ASSERT_OK(ct_strategy_load_state(ps, (const char *const *)ms.names, ms.tensors, ms.n, 0));
    ASSERT_OK(ct_strategy_load_state(ps, (const char *const *)os.names, os.tensors, os.n, 1));
    for (int step = 1; step < 3; step++) {
        double a, b;
        step_on(ps, step, 8, 0, &nrm, &a);
        step_on(rs, step, 8, 0, &nrm, &b);
        ASSERT_CLOSE(a, b, 1e-5, 1e-6);
    }
    assert_state_matches(ps, rm, 2e-5);
    /* the optimizer state gathers whole, with the model's names and one step */
    ct_state po_st;
    ASSERT_OK(ct_strategy_optim_state(ps, &po_st));
    if (ct_group_rank(ct_group_world()) == 0) {
        ASSERT_EQ(po_st.n, os.n);
        int steps = 0;
        for (int i = 0; i < po_st.n; i++) steps += !strcmp(po_st.names[i], "step");
        ASSERT_EQ(steps, 1);
    }
    /* a name the model does not have is an error */
    const char *bad = "9.weight";
    ASSERT_ERR(ct_strategy_load_state(ps, &bad, ms.tensors, 1, 0), CT_EINVAL, "not a parameter or buffer");
    ct_state_fini(&po_st);
    ct_state_fini(&ms);
    ct_state_fini(&os);
    ct_strategy_destroy(ps);
    ct_strategy_destroy(rs);
    ct_module_destroy(pm);
    ct_module_destroy(rm);
}

static void create_fails(ct_module *m, const char *opts, ct_status code, const char *needle)
{
    ct_optim_opts o = adamw();
    ct_strategy *s = NULL;
    ASSERT_ERR(ct_strategy_create("pipe", m, &o, NULL, opts, &s), code, needle);
    ASSERT(s == NULL);
}

TEST(pipe_validation_errors)
{
    int world = ct_group_size(ct_group_world());
    ct_module *m = model(1);
    char opts[64];
    create_fails(m, "balance=3:3", CT_EINVAL, "module and sum of balance have different length (module: 8, sum of balance: 6)");
    create_fails(m, "balance=4:0:4", CT_EINVAL, "balance numbers must be positive");
    create_fails(m, "balance=4:-1:5", CT_EINVAL, "balance numbers must be positive");
    snprintf(opts, sizeof opts, "stages=%d", world + 1);
    create_fails(m, opts, CT_EINVAL, "too few ranks to hold given partitions");
    create_fails(m, "chunks=0", CT_EINVAL, "chunks=0: expected a whole number from 1");
    create_fails(m, "checkpoint=sometimes", CT_EINVAL, "expected one of always|except_last|never");
    create_fails(m, "schedule=zigzag", CT_EINVAL, "expected one of gpipe|1f1b");
    create_fails(m, "grad_accum=2", CT_EINVAL, "use chunks=2 instead");
    create_fails(m, "stages=2,balance=2:2:4", CT_EINVAL, "stages=2 but balance lists 3 stages");
    /* the same layer object twice (kids[5] made kids[3] by hand; put back before freeing) */
    ct_module *saved = m->kids[5];
    m->kids[5] = m->kids[3];
    create_fails(m, "stages=2", CT_EINVAL, "appears twice in the model");
    m->kids[5] = saved;
    /* not a sequential */
    ct_module *lin = ct_linear_create(4, 4, 1);
    create_fails(lin, NULL, CT_EINVAL, "needs a sequential model");
    ct_module_destroy(lin);
    /* the model survives failed wraps */
    ASSERT_EQ(m->nkids, 8);
    ct_module_destroy(m);

    /* a stage that cannot take its predecessor's output: every rank says so, before anything runs */
    ct_module *bad = ct_sequential_create();
    ASSERT_OK(ct_module_add(bad, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(bad, NULL, ct_linear_create(8, NCLS, 1)));
    ct_optim_opts o = adamw();
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("pipe", bad, &o, NULL, "stages=2", &s));
    ct_tensor *x, *y;
    global_batch2(0, 6, &x, &y);
    ct_batch b = {.x = x, .y = y, .global_rows = 6};
    ct_fwd_ctx ctx = {.training = 1};
    ct_step_out out;
    int stage, n;
    ct_strategy_pipe_stage(s, &stage, &n);
    /* a pipeline's forward spans ranks: the single-rank pieces say so */
    ct_tensor *z = NULL;
    ct_record *rec = NULL;
    ASSERT_ERR(ct_strategy_forward(s, x, &z, &rec, &ctx), CT_EUNSUPPORTED, "infer with ct_strategy_predict");
    ASSERT(z == NULL);
    ct_status st = ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out);
    if (stage >= 0) {
        ASSERT_EQ(st, CT_EINVAL);
        ASSERT_STR_CONTAINS(ct_last_error(), "stage 1 (children 1..1) cannot take the output of stage 0");
    } else {
        ASSERT_OK(st); /* sitting out */
    }
    /* a loss that fails on the last stage fails the step on every stage, nothing hangs */
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_module_destroy(bad);
}

static ct_status failing_loss(ct_tensor *out, ct_tensor *target, void *ud, float *loss, ct_tensor **dout)
{
    (void)out, (void)target, (void)ud, (void)loss, (void)dout;
    return ct_error(CT_EINVAL, "the test's loss refuses");
}

TEST(pipe_failure_mid_step_reaches_every_stage)
{
    ct_module *m = model(5);
    ct_optim_opts o = adamw();
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("pipe", m, &o, NULL, "chunks=3,schedule=1f1b", &s));
    ct_tensor *x, *y;
    global_batch2(0, 9, &x, &y);
    ct_batch b = {.x = x, .y = y, .global_rows = 9};
    ct_fwd_ctx ctx = {.training = 1};
    ct_step_out out;
    int stage, n;
    ct_strategy_pipe_stage(s, &stage, &n);
    ASSERT_ERR(ct_strategy_train_step(s, &b, failing_loss, NULL, &ctx, &out), CT_EINVAL, "the test's loss refuses");
    /* and the pipeline still works afterwards */
    ct_strategy_zero_grad(s);
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* Peak activation bytes of one train step of a wide model, per rank. */
static size_t act_peak(const char *schedule, int chunks, int64_t mb_rows)
{
    ct_module *m = ct_sequential_create();
    for (int i = 0; i < 8; i++) {
        ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(i ? 256 : IN, i == 7 ? NCLS : 256, 1)));
        if (i < 7) ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    }
    ct_module_init_params(m, 1);
    ct_optim_opts o = adamw();
    ct_strategy *s;
    char opts[128];
    snprintf(opts, sizeof opts, "schedule=%s,chunks=%d,checkpoint=never", schedule, chunks);
    ASSERT_OK(ct_strategy_create("pipe", m, &o, NULL, opts, &s));
    ct_tensor *x, *y;
    global_batch2(0, mb_rows * chunks, &x, &y);
    ct_batch b = {.x = x, .y = y, .global_rows = mb_rows * chunks};
    ct_fwd_ctx ctx = {.training = 1};
    ct_step_out out;
    ct_mem_reset_peak();
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
    ct_mem_report r;
    ct_mem_report_get(&r);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
    return r.peak[CT_MEM_ACT];
}

TEST(pipe_1f1b_activation_peak_bounded_by_stages)
{
    int P = ct_group_size(ct_group_world());
    int64_t rows = 8;
    /* the batch's own rows are activations too: measure on top of them */
    size_t one = act_peak("gpipe", 1, rows);
    size_t g8 = act_peak("gpipe", 8, rows), g16 = act_peak("gpipe", 16, rows);
    size_t f8 = act_peak("1f1b", 8, rows), f16 = act_peak("1f1b", 16, rows);
    printf("    rank %d: one micro-batch %zu B; gpipe 8: %zu, 16: %zu; 1f1b 8: %zu, 16: %zu\n",
           ct_group_rank(ct_group_world()), one, g8, g16, f8, f16);
    size_t batch_mb = (size_t)rows * (IN + 1) * 4; /* one micro-batch's x and y, allocated by the test */
    ASSERT(g16 > g8 + (g8 - one) / 2);                  /* GPipe grows with chunks */
    ASSERT(f16 <= (size_t)P * one + 16 * batch_mb);     /* 1F1B: stages x one micro-batch (+ the batch) */
    ASSERT(f16 <= f8 + 8 * batch_mb);                   /* and does not grow with chunks */
    ASSERT(2 * f16 <= g16);                     /* the bar at 16 chunks */
}

/* Linear, BatchNorm, Tanh, Linear, BatchNorm, ReLU, Linear. */
static ct_module *bn_model(void)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_batchnorm_create(16, 1e-5f, 0.1f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_batchnorm_create(16, 1e-5f, 0.1f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, NCLS, 1)));
    ct_module_init_params(m, 8);
    return m;
}

/* The running statistics of the pipelined bn_model after one step, on rank 0 (else n = 0). */
static void bn_stats(const char *opts, ct_state *st)
{
    ct_module *m = bn_model();
    ct_optim_opts o = adamw();
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("pipe", m, &o, NULL, opts, &s));
    float nrm;
    double l;
    step_on(s, 0, 12, 0, &nrm, &l);
    ct_state all;
    ASSERT_OK(ct_strategy_model_state(s, &all));
    memset(st, 0, sizeof *st);
    for (int i = 0; i < all.n; i++)
        if (strstr(all.names[i], "running_") || strstr(all.names[i], "num_batches")) ASSERT_OK(ct_state_add(st, all.names[i], all.tensors[i]));
    ct_state_fini(&all);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* Deferred batchnorm: one update per step over all micro-batches equals
 * the unsplit batch's; without it every micro-batch counts, but never a
 * checkpoint's recompute (always equals never). */
TEST(pipe_deferred_batch_norm)
{
    ct_module *rm = bn_model();
    ct_optim_opts o = adamw();
    ct_strategy *rs;
    ASSERT_OK(ct_strategy_create("none", rm, &o, NULL, NULL, &rs));
    float nrm;
    double l;
    step_on(rs, 0, 12, 0, &nrm, &l);
    ct_state d, a, n;
    bn_stats("chunks=4,deferred_batch_norm=1,checkpoint=always", &d);
    bn_stats("chunks=4,checkpoint=always", &a);
    bn_stats("chunks=4,checkpoint=never", &n);
    if (ct_group_rank(ct_group_world()) == 0) {
        ASSERT_EQ(d.n, 6);
        for (int i = 0; i < d.n; i++) {
            ct_param *q = ct_module_find(rm, d.names[i]);
            ASSERT(q != NULL);
            /* the first batchnorm sees the unsplit batch's inputs; the second's inputs were
             * normalised per micro-batch by the first, as training with micro-batches does */
            int first = !strncmp(d.names[i], "1.", 2);
            for (int64_t j = 0; j < q->data->numel; j++) {
                if (first) ASSERT_CLOSE(ct_f32(d.tensors[i])[j], ct_f32(q->data)[j], 1e-5, 1e-6);
                ASSERT_CLOSE(ct_f32(a.tensors[i])[j], ct_f32(n.tensors[i])[j], 1e-6, 1e-7);
            }
            if (strstr(d.names[i], "num_batches")) {
                ASSERT_NEAR(ct_f32(d.tensors[i])[0], 1, 0);
                ASSERT_NEAR(ct_f32(a.tensors[i])[0], 4, 0); /* 12 rows in chunks of 3 */
            }
        }
    }
    ct_state_fini(&d);
    ct_state_fini(&a);
    ct_state_fini(&n);
    ct_strategy_destroy(rs);
    ct_module_destroy(rm);
}

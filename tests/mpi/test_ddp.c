/*
 * DDP under mpirun: N ranks with per-rank batch b must match one process
 * with batch N*b (computed on every rank as the reference), for SGD and
 * AdamW over several steps, with several buckets (rebuilt after step 1),
 * no_sync accumulation, find_unused_parameters, gradient compression, and
 * the errors for a model that differs across ranks or a gradient produced
 * twice.
 */
#include "../test.h"

#define IN 12
#define NCLS 5

/* ---- small custom module kinds for the edge cases --------------------- */

/* Runs only child 0 (child 1 is the unused branch). */
static ct_status branch_fwd(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                            const ct_fwd_ctx *ctx)
{
    ct_record *kr = NULL;
    CT_TRY(ct_module_forward(m->kids[0], in, out, rec ? &kr : NULL, ctx));
    if (rec) CT_TRY(ct_record_add_kid(rec, kr));
    return CT_OK;
}

static ct_status branch_bwd(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    ct_record *kr = rec->kids[0];
    rec->kids[0] = NULL;
    return ct_module_backward(m->kids[0], dout, din, kr);
}

static const ct_module_ops branch_ops = {"branch", branch_fwd, branch_bwd, NULL, 0};

/* Calls child 0 twice: y = f(f(x)), so f's gradients arrive twice per backward. */
static ct_status twice_fwd(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                           const ct_fwd_ctx *ctx)
{
    ct_tensor *mid;
    ct_record *r1 = NULL, *r2 = NULL;
    CT_TRY(ct_module_forward(m->kids[0], in, &mid, rec ? &r1 : NULL, ctx));
    if (rec) CT_TRY(ct_record_add_kid(rec, r1));
    ct_status s = ct_module_forward(m->kids[0], mid, out, rec ? &r2 : NULL, ctx);
    ct_tensor_release(mid);
    if (s == CT_OK && rec) s = ct_record_add_kid(rec, r2);
    return s;
}

static ct_status twice_bwd(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    ct_tensor *g;
    ct_record *r1 = rec->kids[0], *r2 = rec->kids[1];
    rec->kids[0] = rec->kids[1] = NULL;
    ct_status s = ct_module_backward(m->kids[0], dout, &g, r2);
    if (s != CT_OK) {
        ct_record_destroy(r1);
        return s;
    }
    s = ct_module_backward(m->kids[0], g, din, r1);
    ct_tensor_release(g);
    return s;
}

static const ct_module_ops twice_ops = {"twice", twice_fwd, twice_bwd, NULL, 0};

/* ---- helpers ------------------------------------------------------------ */

enum { PLAIN, WITH_BN, WITH_UNUSED, WITH_TWICE, BIGGER };

static ct_module *model(int kind, uint64_t seed)
{
    ct_module *m = ct_sequential_create();
    int hidden = kind == BIGGER ? 17 : 16;
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, hidden, 1)));
    if (kind == WITH_BN) ASSERT_OK(ct_module_add(m, NULL, ct_batchnorm_create(hidden, 1e-5f, 0.1f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    if (kind == WITH_UNUSED) {
        ct_module *br = ct_module_create(&branch_ops, NULL);
        ASSERT_OK(ct_module_add(br, "used", ct_linear_create(hidden, hidden, 1)));
        ASSERT_OK(ct_module_add(br, "unused", ct_linear_create(hidden, hidden, 1)));
        ASSERT_OK(ct_module_add(m, NULL, br));
    } else if (kind == WITH_TWICE) {
        ct_module *tw = ct_module_create(&twice_ops, NULL);
        ASSERT_OK(ct_module_add(tw, "f", ct_linear_create(hidden, hidden, 1)));
        ASSERT_OK(ct_module_add(m, NULL, tw));
    } else {
        ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(hidden, hidden, 1)));
    }
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(hidden, NCLS, 1)));
    ct_module_init_params(m, seed);
    return m;
}

/* Global batch of a step: the same on every rank. */
static void global_batch(int step, int64_t n, ct_tensor **x, ct_tensor **y)
{
    *x = ct_tensor_create2(n, IN, CT_MEM_ACT);
    *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 1234, (uint64_t)step);
    ct_rng_normal(&r, ct_f32(*x), (size_t)(n * IN), 0, 1);
    for (int64_t i = 0; i < n; i++) ((int32_t *)ct_tensor_data(*y))[i] = (int32_t)((i * 7 + step) % NCLS);
}

static ct_tensor *rows(ct_tensor *t, int64_t start, int64_t count)
{
    int64_t shape[CT_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = count;
    return ct_tensor_view(t, start * (t->numel / t->shape[0]), t->ndim, shape);
}

/* forward + cross-entropy + backward of rows [start, start+count) with the
 * loss gradient scaled by scale. */
static ct_status train_micro(ct_strategy *s, ct_tensor *gx, ct_tensor *gy, int64_t start, int64_t count,
                             float scale, int step, int micro)
{
    ct_tensor *x = rows(gx, start, count), *y = rows(gy, start, count), *logits, *dl;
    ct_record *rec;
    ct_fwd_ctx ctx = {1, 5, (uint64_t)step, (uint32_t)micro};
    float loss;
    ct_status st = ct_strategy_forward(s, x, &logits, &rec, &ctx);
    if (st == CT_OK) {
        ASSERT_OK(ct_cross_entropy(logits, y, -100, &loss, &dl));
        for (int64_t i = 0; i < dl->numel; i++) ct_f32(dl)[i] *= scale;
        st = ct_strategy_backward(s, dl, rec);
        ct_tensor_release(dl);
        ct_tensor_release(logits);
    }
    ct_tensor_release(x);
    ct_tensor_release(y);
    return st;
}

static ct_optim *optim_for(ct_module *m, ct_optim_kind k)
{
    ct_optim_opts o = ct_optim_defaults(k);
    o.lr = k == CT_OPT_SGD ? 0.1f : 0.01f;
    if (k == CT_OPT_SGD) o.momentum = 0.9f;
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    ct_optim *opt = ct_optim_create(&o, ps, n);
    ct_free(ps);
    ASSERT(opt);
    return opt;
}

static void assert_params_close(ct_module *a, ct_module *b, double tol)
{
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    ASSERT_EQ(na, nb);
    for (int i = 0; i < na; i++)
        for (int64_t j = 0; j < pa[i]->data->numel; j++)
            ASSERT_CLOSE(ct_f32(pa[i]->data)[j], ct_f32(pb[i]->data)[j], tol, tol);
    ct_free(pa);
    ct_free(pb);
}

/* DDP with per-rank batch b vs one process with batch world*b, `steps` steps. */
static void ddp_vs_single(int kind, ct_optim_kind ok, const ct_strategy_opts *o, double tol, int steps)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t b = 6, n = b * world;
    ct_module *dm = model(kind, 42 + (uint64_t)rank), *rm = model(kind, 42);
    ct_optim *dopt = optim_for(dm, ok), *ropt = optim_for(rm, ok);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("ddp", dm, dopt, g, o, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, ropt, NULL, NULL, &rs));
    assert_params_close(dm, rm, 0); /* broadcast from rank 0 at wrap */
    for (int step = 0; step < steps; step++) {
        ct_tensor *x, *y;
        global_batch(step, n, &x, &y);
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
        ASSERT_OK(train_micro(ds, x, y, rank * b, b, 1.0f, step, 0));
        ASSERT_OK(train_micro(rs, x, y, 0, n, 1.0f, step, 0));
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    assert_params_close(dm, rm, tol);
    ct_step_stats st = ct_strategy_stats(ds);
    ASSERT(st.nbuckets >= 1);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_optim_destroy(dopt);
    ct_optim_destroy(ropt);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

TEST(ddp_matches_single_process_sgd)
{
    ct_strategy_opts o = ct_strategy_defaults();
    ddp_vs_single(PLAIN, CT_OPT_SGD, &o, 2e-5, 5);
}

TEST(ddp_matches_single_process_adamw)
{
    ct_strategy_opts o = ct_strategy_defaults();
    ddp_vs_single(PLAIN, CT_OPT_ADAMW, &o, 2e-5, 5);
}

TEST(ddp_many_small_buckets_rebuilt_after_first_step)
{
    ct_strategy_opts o = ct_strategy_defaults();
    o.ddp.first_bucket_mb = 100.0 / 1048576; /* 100 bytes: almost one bucket per gradient */
    o.ddp.bucket_cap_mb = 700.0 / 1048576;
    ddp_vs_single(BIGGER, CT_OPT_ADAMW, &o, 2e-5, 4);
    o.ddp.rebuild_buckets = 0;
    ddp_vs_single(BIGGER, CT_OPT_SGD, &o, 2e-5, 3);
}

TEST(ddp_bf16_and_f16_compression_close_to_f32)
{
    ct_strategy_opts o = ct_strategy_defaults();
    o.ddp.comm_dtype = CT_BF16;
    ddp_vs_single(PLAIN, CT_OPT_SGD, &o, 2e-2, 3);
    o.ddp.comm_dtype = CT_F16;
    ddp_vs_single(PLAIN, CT_OPT_SGD, &o, 2e-3, 3);
}

TEST(ddp_find_unused_parameters_with_skipped_branch)
{
    ct_strategy_opts o = ct_strategy_defaults();
    o.ddp.find_unused_parameters = 1;
    ddp_vs_single(WITH_UNUSED, CT_OPT_SGD, &o, 2e-5, 3);

    /* Without the flag: a clear error on every rank, not a hang. */
    ct_module *m = model(WITH_UNUSED, 1);
    ct_optim *opt = optim_for(m, CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, opt, NULL, NULL, &s));
    ct_tensor *x, *y;
    global_batch(0, 4, &x, &y);
    ASSERT_ERR(train_micro(s, x, y, 0, 4, 1, 0, 0), CT_ESTATE, "find_unused_parameters");
    ASSERT_STR_CONTAINS(ct_last_error(), "'2.unused.weight'");
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_optim_destroy(opt);
    ct_module_destroy(m);
}

TEST(ddp_no_sync_accumulation_equals_combined_batch)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t b = 4, n = 2 * b * world;
    ct_module *dm = model(PLAIN, 3), *rm = model(PLAIN, 3);
    ct_optim *dopt = optim_for(dm, CT_OPT_ADAMW), *ropt = optim_for(rm, CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("ddp", dm, dopt, g, NULL, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, ropt, NULL, NULL, &rs));
    for (int step = 0; step < 3; step++) {
        ct_tensor *x, *y;
        global_batch(step, n, &x, &y);
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
        /* Rank r's micro-batches are rows [2br, 2br+b) and [2br+b, 2br+2b). */
        ct_strategy_set_no_sync(ds, 1);
        ASSERT_OK(train_micro(ds, x, y, 2 * b * rank, b, 0.5f, step, 0));
        ct_strategy_set_no_sync(ds, 0);
        ASSERT_OK(train_micro(ds, x, y, 2 * b * rank + b, b, 0.5f, step, 1));
        ASSERT_OK(train_micro(rs, x, y, 0, n, 1.0f, step, 0));
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    assert_params_close(dm, rm, 2e-5);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_optim_destroy(dopt);
    ct_optim_destroy(ropt);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

/* 1 if buffer `name` holds the same values on every rank. */
static int same_everywhere(ct_group *g, ct_module *m, const char *name)
{
    ct_param *p = ct_module_find(m, name);
    ASSERT(p);
    int world = ct_group_size(g);
    int64_t n = p->data->numel;
    float *all = ct_alloc_zeroed(sizeof(float) * (size_t)(n * world), CT_MEM_OTHER);
    ASSERT_OK(ct_group_allgather(g, ct_tensor_data(p->data), all, n, CT_F32, NULL));
    int same = 1;
    for (int r = 1; r < world; r++)
        if (memcmp(all, all + r * n, sizeof(float) * (size_t)n)) same = 0;
    ct_free(all);
    return same;
}

TEST(ddp_broadcasts_buffers_from_rank0)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    for (int bcast = 0; bcast < 2; bcast++) {
        ct_strategy_opts o = ct_strategy_defaults();
        o.ddp.broadcast_buffers = bcast;
        ct_module *m = model(WITH_BN, 9);
        ct_optim *opt = optim_for(m, CT_OPT_SGD);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create("ddp", m, opt, g, &o, &s));
        ASSERT(same_everywhere(g, m, "1.running_mean"));
        ct_tensor *x, *y, *out;
        global_batch(100 + rank, 8, &x, &y); /* different data per rank: running stats diverge */
        ASSERT_OK(train_micro(s, x, y, 0, 8, 1, 0, 0));
        ASSERT_OK(ct_strategy_step(s));
        ASSERT(!same_everywhere(g, m, "1.running_mean"));
        /* An eval forward does not update the stats, so after it they are whatever the
         * forward's buffer broadcast left: rank 0's everywhere, or still diverged. */
        ct_fwd_ctx eval = {0, 5, 1, 0};
        ASSERT_OK(ct_strategy_forward(s, x, &out, NULL, &eval));
        ASSERT_EQ(same_everywhere(g, m, "1.running_mean"), bcast);
        ASSERT_EQ(same_everywhere(g, m, "1.running_var"), bcast);
        ct_tensor_release(out);
        ct_tensor_release(x);
        ct_tensor_release(y);
        ct_strategy_destroy(s);
        ct_optim_destroy(opt);
        ct_module_destroy(m);
    }
}

TEST(ddp_rejects_model_that_differs_across_ranks)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    ct_module *m = model(rank == 1 ? BIGGER : PLAIN, 1);
    ct_optim *opt = optim_for(m, CT_OPT_SGD);
    ct_strategy *s = NULL;
    ASSERT_ERR(ct_strategy_create("ddp", m, opt, g, NULL, &s), CT_EINVAL, "rank 1's model differs");
    ASSERT(s == NULL);
    ct_optim_destroy(opt);
    ct_module_destroy(m);
}

TEST(ddp_rejects_gradient_produced_twice)
{
    ct_module *m = model(WITH_TWICE, 1);
    ct_optim *opt = optim_for(m, CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, opt, NULL, NULL, &s));
    ct_tensor *x, *y;
    global_batch(0, 4, &x, &y);
    ASSERT_ERR(train_micro(s, x, y, 0, 4, 1, 0, 0), CT_ESTATE, "received its gradient twice");
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_optim_destroy(opt);
    ct_module_destroy(m);
}

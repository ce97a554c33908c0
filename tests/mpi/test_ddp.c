/*
 * DDP under mpirun: N ranks with per-rank batch b must match one process
 * with batch N*b (computed on every rank as the reference), for SGD and
 * AdamW over several steps, with several buckets (rebuilt after step 1),
 * no_sync accumulation, find_unused_parameters, gradient compression, and
 * the errors for a model that differs across ranks or a gradient produced
 * twice.
 */
#include <math.h>

#include "train_util.h"
#include "parallel/internal.h"

/* ---- small custom module kinds for the edge cases --------------------- */



/* ---- helpers ------------------------------------------------------------ */

enum { PLAIN, WITH_BN, WITH_UNUSED, WITH_TWICE, BIGGER, WITH_DROPOUT };

static ct_module *model(int kind, uint64_t seed)
{
    ct_module *m = ct_sequential_create();
    int hidden = kind == BIGGER ? 17 : 16;
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, hidden, 1)));
    if (kind == WITH_BN) ASSERT_OK(ct_module_add(m, NULL, ct_batchnorm_create(hidden, 1e-5f, 0.1f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    if (kind == WITH_DROPOUT) ASSERT_OK(ct_module_add(m, NULL, ct_dropout_create(0.2f)));
    if (kind == WITH_UNUSED) {
        ASSERT_OK(ct_module_add(m, NULL, branch_create(ct_linear_create(hidden, hidden, 1),
                                                       ct_linear_create(hidden, hidden, 1))));
    } else if (kind == WITH_TWICE) {
        ASSERT_OK(ct_module_add(m, NULL, twice_create(ct_linear_create(hidden, hidden, 1))));
    } else {
        ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(hidden, hidden, 1)));
    }
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(hidden, NCLS, 1)));
    ct_module_init_params(m, seed);
    return m;
}

/* forward + cross-entropy + backward of rows [start, start+count) with the
 * loss gradient scaled by scale. */
static ct_status train_micro(ct_strategy *s, ct_tensor *gx, ct_tensor *gy, int64_t start, int64_t count,
                             float scale, int step)
{
    ct_tensor *x = rows(gx, start, count), *y = rows(gy, start, count), *logits, *dl;
    ct_record *rec;
    ct_fwd_ctx ctx = {.training = 1, .seed = 5, .step = (uint64_t)step, .sample0 = start};
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

/* DDP with per-rank batch b vs one process with batch world*b, `steps` steps. */
static void ddp_vs_single(int kind, ct_optim_kind ok, const char *o, double tol, int steps)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t b = 6, n = b * world;
    ct_module *dm = model(kind, 42 + (uint64_t)rank), *rm = model(kind, 42);
    ct_optim_opts dopt = optim_for(ok), ropt = optim_for(ok);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("ddp", dm, &dopt, g, o, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &ropt, NULL, NULL, &rs));
    assert_params_close(dm, rm, 0); /* broadcast from rank 0 at wrap */
    for (int step = 0; step < steps; step++) {
        ct_tensor *x, *y;
        global_batch(step, n, &x, &y);
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
        ASSERT_OK(train_micro(ds, x, y, rank * b, b, 1.0f, step));
        ASSERT_OK(train_micro(rs, x, y, 0, n, 1.0f, step));
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
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

TEST(ddp_matches_single_process_sgd)
{
    ddp_vs_single(PLAIN, CT_OPT_SGD, NULL, 2e-5, 5);
}

TEST(ddp_matches_single_process_adamw)
{
    ddp_vs_single(PLAIN, CT_OPT_ADAMW, "", 2e-5, 5);
}

TEST(ddp_many_small_buckets_rebuilt_after_first_step)
{
    /* 100 bytes: almost one bucket per gradient */
    ddp_vs_single(BIGGER, CT_OPT_ADAMW, "first_bucket_mb=0.0000953674,bucket_cap_mb=0.000667572", 2e-5, 4);
    ddp_vs_single(BIGGER, CT_OPT_SGD, "first_bucket_mb=0.0000953674,bucket_cap_mb=0.000667572,rebuild_buckets=0",
                  2e-5, 3);
}

/* The rebuild is visible in the layout: with one bucket, the gradients lie
 * end to end in the order they became ready in the first backward (a hook of
 * the test's records it), which differs from the wrap's reverse model order
 * (a linear's weight is ready before its bias).  Without rebuild_buckets the
 * wrap's layout stays. */
static int ready_order[64], nready_seen;
static ct_status note_ready(ct_param *p, void *ud)
{
    (void)p;
    if (nready_seen < 64) ready_order[nready_seen++] = (int)(intptr_t)ud;
    return CT_OK;
}

static int laid_in_order(ct_param **ps, const int *order, int n)
{
    for (int k = 0; k + 1 < n; k++)
        if ((float *)ct_tensor_data(ps[order[k + 1]]->grad) !=
            (float *)ct_tensor_data(ps[order[k]]->grad) + ps[order[k]]->grad->numel)
            return 0;
    return 1;
}

TEST(ddp_buckets_rebuilt_in_gradient_ready_order)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    for (int rebuild = 0; rebuild < 2; rebuild++) {
        ct_module *m = model(BIGGER, 3);
        ct_param **ps;
        int np;
        ASSERT_OK(ct_module_params(m, &ps, &np));
        ASSERT(np <= 64);
        ct_hook *h[64];
        for (int i = 0; i < np; i++) ASSERT((h[i] = ct_param_add_hook(ps[i], note_ready, (void *)(intptr_t)i)));
        ct_optim_opts oo = optim_for(CT_OPT_SGD);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create("ddp", m, &oo, g, rebuild ? "rebuild_buckets=1" : "rebuild_buckets=0", &s));
        int reverse[64];
        for (int i = 0; i < np; i++) reverse[i] = np - 1 - i;
        ASSERT(laid_in_order(ps, reverse, np)); /* the wrap's layout */
        nready_seen = 0;
        ct_step_out o;
        step_on_slice(s, 0, 4 * world, rank, world, &o);
        ASSERT_EQ(nready_seen, np);
        ASSERT(memcmp(ready_order, reverse, sizeof(int) * (size_t)np) != 0); /* the test can tell them apart */
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s); /* the rebuild happens here */
        step_on_slice(s, 1, 4 * world, rank, world, &o);
        ASSERT_EQ(laid_in_order(ps, ready_order, np), rebuild);
        ASSERT_EQ(laid_in_order(ps, reverse, np), !rebuild);
        ct_strategy_destroy(s);
        for (int i = 0; i < np; i++) ct_hook_remove(h[i]);
        ct_free(ps);
        ct_module_destroy(m);
    }
}

/* bucket_cap_mb=auto (the default) sizes buckets from the gradients where
 * the group spans nodes: a sixteenth of them, 1 to 25 MiB, so the last
 * bucket, whose allreduce starts only when backward ends and hides behind
 * nothing on the wire, is short on any model; on one node it is PyTorch's
 * 25 MiB, as an explicit cap.  20 MiB of gradients in 4 MiB weights: auto
 * across two (fake) nodes (1.25 MiB) closes a bucket at every weight, 25 MiB
 * puts everything after the 1 MiB first bucket into one. */
TEST(ddp_auto_bucket_cap_sized_from_gradients)
{
    ASSERT_EQ(ct__ddp_auto_cap(0, 2), (size_t)1 << 20);
    ASSERT_EQ(ct__ddp_auto_cap((uint64_t)40 << 20, 2), (size_t)5 << 19);
    ASSERT_EQ(ct__ddp_auto_cap((uint64_t)1 << 30, 2), (size_t)25 << 20);
    ASSERT_EQ(ct__ddp_auto_cap((uint64_t)40 << 20, 1), (size_t)25 << 20);
    ct_group *w = ct_group_world(), *two = NULL;
    int rank = ct_group_rank(w), world = ct_group_size(w);
    if (world < 2) return;
    int saved = ct_comm_get_fake_nodes();
    ct_comm_set_fake_nodes(2);
    ct_status gs = ct_group_split(w, 0, rank, &two);
    ct_comm_set_fake_nodes(saved);
    ASSERT_OK(gs);
    ASSERT_EQ(ct_group_num_nodes(two), 2);
    /* auto across two nodes, 25 MiB, auto on one node */
    const char *opts[3] = {NULL, "bucket_cap_mb=25", NULL};
    ct_group *gs3[3] = {two, w, w};
    int nb[3];
    for (int k = 0; k < 3; k++) {
        ct_module *m = ct_sequential_create();
        ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 1024, 1)));
        for (int i = 0; i < 5; i++) {
            ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
            ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(1024, 1024, 1)));
        }
        ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(1024, NCLS, 1)));
        ct_module_init_params(m, 7);
        ct_optim_opts oo = optim_for(CT_OPT_SGD);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create("ddp", m, &oo, gs3[k], opts[k], &s));
        ASSERT_STR_CONTAINS(ct_strategy_opt(s, "bucket_cap_mb"), k == 1 ? "25" : "auto");
        ct_step_out o;
        step_on_slice(s, 0, 2 * world, rank, world, &o);
        ASSERT_OK(ct_strategy_step(s));
        nb[k] = ct_strategy_stats(s).nbuckets;
        ct_strategy_destroy(s);
        ct_module_destroy(m);
    }
    ct_group_destroy(two);
    ASSERT_EQ(nb[0], 6);
    ASSERT_EQ(nb[1], 2);
    ASSERT_EQ(nb[2], 2);
}

TEST(ddp_bf16_and_f16_compression_close_to_f32)
{
    ddp_vs_single(PLAIN, CT_OPT_SGD, "reduce_dtype=bf16", 2e-2, 3);
    ddp_vs_single(PLAIN, CT_OPT_SGD, "reduce_dtype=f16", 2e-3, 3);
}

TEST(ddp_find_unused_parameters_with_skipped_branch)
{
    ddp_vs_single(WITH_UNUSED, CT_OPT_SGD, "find_unused_parameters=1", 2e-5, 3);

    /* Without the flag: a clear error on every rank, not a hang. */
    ct_module *m = model(WITH_UNUSED, 1);
    ct_optim_opts opt = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, &opt, NULL, NULL, &s));
    ct_tensor *x, *y;
    global_batch(0, 4, &x, &y);
    ASSERT_ERR(train_micro(s, x, y, 0, 4, 1, 0), CT_ESTATE, "find_unused_parameters");
    ASSERT_STR_CONTAINS(ct_last_error(), "'2.unused.weight'");
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* static_graph: the unused branch is found in the first step only, the
 * buckets are rebuilt once, and the numbers are those of one process and
 * of the default (find_unused_parameters, which tracks every step), bit
 * for bit. */
TEST(ddp_static_graph_equals_default)
{
    ddp_vs_single(PLAIN, CT_OPT_ADAMW, "static_graph=1,bucket_cap_mb=0.0001", 2e-5, 4);
    ddp_vs_single(WITH_UNUSED, CT_OPT_SGD, "static_graph=1", 2e-5, 3);
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_module *am = model(WITH_UNUSED, 8), *bm = model(WITH_UNUSED, 8);
    ct_optim_opts opt = optim_for(CT_OPT_ADAMW);
    ct_strategy *a, *b;
    ASSERT_OK(ct_strategy_create("ddp", am, &opt, g, "find_unused_parameters=1,bucket_cap_mb=0.0001", &a));
    ASSERT_OK(ct_strategy_create("ddp", bm, &opt, g, "static_graph=1,bucket_cap_mb=0.0001", &b));
    for (int step = 0; step < 4; step++) {
        ct_tensor *x, *y;
        global_batch(step, 5 * world, &x, &y);
        ct_strategy *ss[2] = {a, b};
        for (int k = 0; k < 2; k++) {
            ct_strategy_zero_grad(ss[k]);
            ASSERT_OK(train_micro(ss[k], x, y, 5 * rank, 5, 1.0f, step));
            ASSERT_OK(ct_strategy_step(ss[k]));
        }
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    assert_params_close(am, bm, 0);
    ASSERT_EQ(ct_strategy_stats(a).nbuckets, ct_strategy_stats(b).nbuckets);
    ct_strategy_destroy(a);
    ct_strategy_destroy(b);
    ct_module_destroy(am);
    ct_module_destroy(bm);
}

/* The graph static_graph promised changes (the other branch runs): a
 * clear error on every rank naming the parameter, where
 * find_unused_parameters follows the change. */
TEST(ddp_static_graph_refuses_a_changed_graph)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    const char *opts[2] = {"find_unused_parameters=1", "static_graph=1"};
    for (int k = 0; k < 2; k++) {
        ct_module *m = model(WITH_UNUSED, 3);
        ct_optim_opts opt = optim_for(CT_OPT_SGD);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create("ddp", m, &opt, g, opts[k], &s));
        ct_tensor *x, *y;
        global_batch(0, 4 * world, &x, &y);
        branch_take = 0;
        ASSERT_OK(train_micro(s, x, y, 4 * rank, 4, 1.0f, 0));
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
        branch_take = 1;
        if (k == 0) {
            ASSERT_OK(train_micro(s, x, y, 4 * rank, 4, 1.0f, 1));
        } else {
            ASSERT_ERR(train_micro(s, x, y, 4 * rank, 4, 1.0f, 1), CT_ESTATE, "static_graph");
            ASSERT_STR_CONTAINS(ct_last_error(), "'2.unused.weight' got no gradient in the first step");
        }
        branch_take = 0;
        ct_tensor_release(x);
        ct_tensor_release(y);
        ct_strategy_destroy(s);
        ct_module_destroy(m);
    }
}

TEST(ddp_no_sync_accumulation_equals_combined_batch)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t b = 4, n = 2 * b * world;
    ct_module *dm = model(PLAIN, 3), *rm = model(PLAIN, 3);
    ct_optim_opts dopt = optim_for(CT_OPT_ADAMW), ropt = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("ddp", dm, &dopt, g, NULL, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &ropt, NULL, NULL, &rs));
    for (int step = 0; step < 3; step++) {
        ct_tensor *x, *y;
        global_batch(step, n, &x, &y);
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
        /* Rank r's micro-batches are rows [2br, 2br+b) and [2br+b, 2br+2b). */
        ct_strategy_set_no_sync(ds, 1);
        ASSERT_OK(train_micro(ds, x, y, 2 * b * rank, b, 0.5f, step));
        ct_strategy_set_no_sync(ds, 0);
        ASSERT_OK(train_micro(ds, x, y, 2 * b * rank + b, b, 0.5f, step));
        ASSERT_OK(train_micro(rs, x, y, 0, n, 1.0f, step));
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    assert_params_close(dm, rm, 2e-5);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
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

/* DDP's broadcast_buffers, and ShardedDDP's (zero2 keeps its own option). */
TEST(ddp_broadcasts_buffers_from_rank0)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    for (int run = 0; run < 4; run++) {
        int bcast = run % 2;
        const char *o = bcast ? "broadcast_buffers=1" : "broadcast_buffers=0";
        ct_module *m = model(WITH_BN, 9);
        ct_optim_opts opt = optim_for(CT_OPT_SGD);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create(run < 2 ? "ddp" : "zero2", m, &opt, g, o, &s));
        ASSERT(same_everywhere(g, m, "1.running_mean"));
        ct_tensor *x, *y, *out;
        global_batch(100 + rank, 8, &x, &y); /* different data per rank: running stats diverge */
        ASSERT_OK(train_micro(s, x, y, 0, 8, 1, 0));
        ASSERT_OK(ct_strategy_step(s));
        ASSERT(!same_everywhere(g, m, "1.running_mean"));
        /* An eval forward does not update the stats, so after it they are whatever the
         * forward's buffer broadcast left: rank 0's everywhere, or still diverged. */
        ct_fwd_ctx eval = {.training = 0, .seed = 5, .step = 1};
        ASSERT_OK(ct_strategy_forward(s, x, &out, NULL, &eval));
        ASSERT_EQ(same_everywhere(g, m, "1.running_mean"), bcast);
        ASSERT_EQ(same_everywhere(g, m, "1.running_var"), bcast);
        ct_tensor_release(out);
        ct_tensor_release(x);
        ct_tensor_release(y);
        ct_strategy_destroy(s);
        ct_module_destroy(m);
    }
}

TEST(ddp_rejects_model_that_differs_across_ranks)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    ct_module *m = model(rank == 1 ? BIGGER : PLAIN, 1);
    ct_optim_opts opt = optim_for(CT_OPT_SGD);
    ct_strategy *s = NULL;
    ASSERT_ERR(ct_strategy_create("ddp", m, &opt, g, NULL, &s), CT_EINVAL, "rank 1's model differs");
    ASSERT(s == NULL);
    ct_module_destroy(m);
}

TEST(ddp_rejects_gradient_produced_twice)
{
    ct_module *m = model(WITH_TWICE, 1);
    ct_optim_opts opt = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, &opt, NULL, NULL, &s));
    ct_tensor *x, *y;
    global_batch(0, 4, &x, &y);
    ASSERT_ERR(train_micro(s, x, y, 0, 4, 1, 0), CT_ESTATE, "received its gradient twice");
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* ---- the v2 interface: train step, clip, options, shards ----------------- */

TEST(ddp_train_step_micro_batches_equal_one_process)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 9 * world + 2; /* uneven over ranks and over 3 micro-batches */
    ct_module *dm = model(PLAIN, 7), *rm = model(PLAIN, 7);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("ddp", dm, &oo, g, "grad_accum=3", &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    ASSERT_STR_CONTAINS(ct_strategy_opt(ds, "grad_accum"), "3");
    for (int step = 0; step < 4; step++) {
        ct_step_out o1, o2;
        step_on_slice(ds, step, n, rank, world, &o1);
        step_on_slice(rs, step, n, 0, 1, &o2);
        /* The loss over the global batch is the ranks' sums added up. */
        float sums[2] = {(float)o1.loss_sum, (float)o1.rows};
        ASSERT_OK(ct_group_allreduce(g, sums, 2, CT_F32, CT_OP_SUM, NULL));
        ASSERT_EQ(o2.rows, n);
        ASSERT_EQ((int64_t)sums[1], n);
        ASSERT_CLOSE(sums[0], o2.loss_sum, 1e-5, 1e-5);
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
    }
    assert_params_close(dm, rm, 2e-5);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

/* Every strategy's norm is one accumulator combined by ct__norm_combine:
 * rank terms too close to tell apart in float stay apart (no rounding to
 * float on the way, which zero2 and fsdp once did), every rank gets the same
 * double, and a NaN on any rank reaches every rank. */
TEST(norm_combine_keeps_double_and_nan)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_norm_acc a = ct_norm_acc_init(2.0);
    ct_norm_acc_add(&a, 1.0 + 1e-12 * (rank + 1));
    ASSERT_OK(ct__norm_combine(g, &a));
    double want = 0;
    for (int r = 0; r < world; r++) want += 1.0 + 1e-12 * (r + 1);
    ASSERT_EQ(a.v, want);
    ASSERT((float)a.v == (float)world); /* the difference is below float's resolution */
    ASSERT_EQ(ct_norm_acc_norm(&a), sqrt(want));
    ct_norm_acc m = ct_norm_acc_init(INFINITY);
    ct_norm_acc_add(&m, 2.0 + 1e-12 * rank);
    ASSERT_OK(ct__norm_combine(g, &m));
    ASSERT_EQ(m.v, 2.0 + 1e-12 * (world - 1));
    ct_norm_acc nan = ct_norm_acc_init(INFINITY);
    ct_norm_acc_add(&nan, rank == world - 1 ? NAN : 1.0);
    ASSERT_OK(ct__norm_combine(g, &nan));
    ASSERT(isnan(nan.v));
}

/* The reduced gradients a strategy steps from carry the wire's precision:
 * every value bf16 (low 16 bits zero) or f16 (round-trips) exactly, where
 * f32 reduces leave values that are not.  So ignoring reduce_dtype, in any
 * strategy that reduces gradients, fails here (a closeness test cannot tell). */
static int64_t count_on_wire(const float *g, int64_t n, ct_dtype dt)
{
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, &g[i], 4);
        k += dt == CT_BF16 ? !(bits & 0xffff) : ct_f16_to_f32(ct_f32_to_f16(g[i])) == g[i];
    }
    return k;
}

TEST(reduce_dtype_reaches_ddp_zero2_and_fsdp)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    const char *kinds[] = {"ddp", "zero1", "zero2", "fsdp"};
    const char *extra[] = {"", "", "", ",wrap_kinds=linear"};
    const ct_dtype dts[] = {CT_F32, CT_BF16, CT_F16};
    for (int k = 0; k < 4; k++)
        for (int d = 0; d < 3; d++) {
            char opts[128];
            snprintf(opts, sizeof opts, "reduce_dtype=%s%s", ct_dtype_name(dts[d]), extra[k]);
            for (char *c = opts; *c; c++) *c = (char)(*c >= 'A' && *c <= 'Z' ? *c - 'A' + 'a' : *c);
            ct_module *m = model(PLAIN, 13);
            ct_optim_opts oo = optim_for(CT_OPT_SGD);
            ct_strategy *s;
            ASSERT_OK(ct_strategy_create(kinds[k], m, &oo, g, opts, &s));
            ct_step_out o;
            step_on_slice(s, 0, 6 * world + 1, rank, world, &o);
            ct_optim *opt = ct_strategy_optim(s);
            int64_t n = 0, bf = 0, h = 0;
            for (int i = 0; i < ct_optim_num_slots(opt); i++) {
                const ct_optim_slot *sl = ct_optim_slot_at(opt, i);
                if (!sl->grad) continue;
                n += sl->n;
                bf += count_on_wire(sl->grad, sl->n, CT_BF16);
                h += count_on_wire(sl->grad, sl->n, CT_F16);
            }
            int64_t tot[3] = {n, bf, h};
            ASSERT_OK(ct_group_allreduce(g, tot, 3, CT_I64, CT_OP_SUM, NULL));
            ASSERT(tot[0] > 100);
            if (dts[d] == CT_BF16) ASSERT_EQ(tot[1], tot[0]);
            if (dts[d] == CT_F16) ASSERT_EQ(tot[2], tot[0]);
            if (dts[d] == CT_F32) ASSERT(tot[1] < tot[0] / 2 && tot[2] < tot[0] / 2);
            ct_strategy_destroy(s);
            ct_module_destroy(m);
        }
}

TEST(ddp_clip_grad_norm_is_the_global_norm)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 5 * world + 1;
    for (int inf = 0; inf < 2; inf++) {
        ct_module *dm = model(PLAIN, 11), *rm = model(PLAIN, 11);
        ct_optim_opts oo = optim_for(CT_OPT_SGD);
        ct_strategy *ds, *rs;
        ASSERT_OK(ct_strategy_create("ddp", dm, &oo, g, NULL, &ds));
        ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
        ct_step_out o;
        step_on_slice(ds, 0, n, rank, world, &o);
        step_on_slice(rs, 0, n, 0, 1, &o);
        float nd, nr, nd2;
        double type = inf ? INFINITY : 2.0;
        ASSERT_OK(ct_strategy_clip_grad_norm(ds, 0.05f, type, &nd));
        ASSERT_OK(ct_strategy_clip_grad_norm(rs, 0.05f, type, &nr));
        ASSERT_CLOSE(nd, nr, 1e-5, 1e-6);
        ASSERT(nd > 0.05f); /* the test clips for real */
        ASSERT_OK(ct_strategy_clip_grad_norm(ds, 1e9f, type, &nd2));
        ASSERT_CLOSE(nd2, 0.05f, 1e-4, 1e-6); /* clipped to max_norm */
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        assert_params_close(dm, rm, 2e-5);
        ASSERT_ERR(ct_strategy_clip_grad_norm(ds, 1.0f, 0.0, NULL), CT_EINVAL, "norm_type 0");
        ASSERT_ERR(ct_strategy_clip_grad_norm(ds, -1.0f, 2.0, NULL), CT_EINVAL, "max_norm");
        ct_strategy_destroy(ds);
        ct_strategy_destroy(rs);
        ct_module_destroy(dm);
        ct_module_destroy(rm);
    }
}

TEST(strategy_options_are_checked_by_key)
{
    ct_module *m = model(PLAIN, 1);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s = NULL;
    ASSERT_ERR(ct_strategy_create("ddp", m, &oo, NULL, "bucket_cap=4", &s), CT_EINVAL,
               "strategy ddp has no option 'bucket_cap'; its options are: grad_accum");
    ASSERT_STR_CONTAINS(ct_last_error(), "bucket_cap_mb");
    ASSERT_ERR(ct_strategy_create("ddp", m, &oo, NULL, "bucket_cap_mb=-1", &s), CT_EINVAL, "positive number");
    ASSERT_ERR(ct_strategy_create("ddp", m, &oo, NULL, "reduce_dtype=i32", &s), CT_EINVAL, "f32, bf16, f16");
    ASSERT_ERR(ct_strategy_create("ddp", m, &oo, NULL, "grad_accum", &s), CT_EINVAL, "not key=value");
    ASSERT_ERR(ct_strategy_create("none", m, &oo, NULL, "bucket_cap_mb=4", &s), CT_EINVAL,
               "strategy none has no option 'bucket_cap_mb'");
    ASSERT_ERR(ct_strategy_create("zero9", m, &oo, NULL, NULL, &s), CT_EINVAL, "none, ddp");
    ct_optim_opts bad = oo;
    bad.lr = -1;
    ASSERT_ERR(ct_strategy_create("none", m, &bad, NULL, NULL, &s), CT_EINVAL, "lr");
    ASSERT(s == NULL);
    /* later keys win; values read back as given */
    ASSERT_OK(ct_strategy_create("ddp", m, &oo, NULL, "bucket_cap_mb=4,,bucket_cap_mb=8,broadcast_buffers=off", &s));
    ASSERT_STR_CONTAINS(ct_strategy_opt(s, "bucket_cap_mb"), "8");
    ASSERT_STR_CONTAINS(ct_strategy_opt(s, "broadcast_buffers"), "off");
    ASSERT(ct_strategy_opt(s, "nonsense") == NULL);
    ct_strategy_destroy(s);
    char help[2048];
    ASSERT_OK(ct_strategy_help("ddp", help, sizeof help));
    ASSERT_STR_CONTAINS(help, "find_unused_parameters=0");
    ASSERT_STR_CONTAINS(help, "param_dtype=f32");
    ct_module_destroy(m);
}

TEST(shard_state_covers_the_state_once)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_module *m = model(BIGGER, 3);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("ddp", m, &oo, g, NULL, &s));
    ct_step_out o;
    step_on_slice(s, 0, 4 * world, rank, world, &o);
    ASSERT_OK(ct_strategy_step(s));
    for (int optim = 0; optim < 2; optim++) {
        ct_state full, mine;
        ASSERT_OK(optim ? ct_strategy_optim_state(s, &full) : ct_strategy_model_state(s, &full));
        ASSERT_OK(ct_strategy_shard_state(s, optim, &mine));
        /* per full-state entry: how many ranks hold it, and their bytes */
        int64_t *have = ct_alloc(sizeof *have * (size_t)(full.n + 1), CT_MEM_OTHER);
        int64_t bytes = 0;
        for (int i = 0; i < full.n; i++) {
            have[i] = 0;
            for (int k = 0; k < mine.n; k++)
                if (!strcmp(full.names[i], mine.names[k])) {
                    have[i] = 1;
                    ASSERT(ct_tensor_same_shape(full.tensors[i], mine.tensors[k]));
                    ASSERT(!memcmp(ct_tensor_data(full.tensors[i]), ct_tensor_data(mine.tensors[k]),
                                   ct_tensor_bytes(mine.tensors[k])));
                    bytes += (int64_t)ct_tensor_bytes(mine.tensors[k]);
                }
        }
        ASSERT_OK(ct_group_allreduce(g, have, full.n, CT_I64, CT_OP_SUM, NULL));
        for (int i = 0; i < full.n; i++) ASSERT_EQ(have[i], 1);
        /* balanced: no rank holds more than its share plus the largest tensor */
        int64_t total = 0, largest = 0;
        for (int i = 0; i < full.n; i++) {
            int64_t b = (int64_t)ct_tensor_bytes(full.tensors[i]);
            total += b;
            if (b > largest) largest = b;
        }
        ASSERT(bytes <= total / world + largest);
        ct_free(have);
        ct_state_fini(&full);
        ct_state_fini(&mine);
    }
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* Dropout masks key on the global row: N ranks, in micro-batches, train
 * what one process trains on the whole batch (5 AdamW steps). */
TEST(ddp_dropout_equals_one_process)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 6 * world + 1;
    ct_module *dm = model(WITH_DROPOUT, 8), *rm = model(WITH_DROPOUT, 8);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("ddp", dm, &oo, g, "grad_accum=2", &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    steps_vs_one(ds, rs, 5, n, rank, world);
    assert_params_close(dm, rm, 2e-5);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

/* Mixed precision: bf16 compute copies of the weights (f32 master, f32
 * gradients).  DDP equals one process with the same casts; the copies are
 * refreshed after every step; norm layers and biases stay f32. */
TEST(ddp_mixed_bf16_equals_one_process_with_the_same_casts)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 6 * world;
    ct_module *dm = model(PLAIN, 4), *rm = model(PLAIN, 4), *fm = model(PLAIN, 4);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs, *fs;
    ASSERT_OK(ct_strategy_create("ddp", dm, &oo, g, "param_dtype=bf16", &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, "param_dtype=bf16", &rs));
    ASSERT_OK(ct_strategy_create("none", fm, &oo, NULL, NULL, &fs));
    ct_param *w = ct_module_find(dm, "0.weight"), *b = ct_module_find(dm, "0.bias");
    ASSERT(w->compute && w->compute->dtype == CT_BF16 && !b->compute);
    ASSERT(!ct_module_find(fm, "0.weight")->compute);
    { /* a norm layer keeps its parameters f32 */
        ct_module *bm = model(WITH_BN, 4);
        ct_strategy *bs;
        ASSERT_OK(ct_strategy_create("ddp", bm, &oo, g, "param_dtype=bf16", &bs));
        ASSERT(ct_module_find(bm, "0.weight")->compute && !ct_module_find(bm, "1.weight")->compute);
        ct_strategy_destroy(bs);
        ct_module_destroy(bm);
    }
    for (int step = 0; step < 3; step++) {
        ct_step_out o;
        step_on_slice(ds, step, n, rank, world, &o);
        step_on_slice(rs, step, n, 0, 1, &o);
        step_on_slice(fs, step, n, 0, 1, &o);
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ASSERT_OK(ct_strategy_step(fs));
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
        ct_strategy_zero_grad(fs);
        /* the copy is the master weight rounded to bf16, after every step */
        for (int64_t j = 0; j < w->data->numel; j++)
            ASSERT_EQ(((uint16_t *)ct_tensor_data(w->compute))[j], ct_f32_to_bf16(ct_f32(w->data)[j]));
    }
    /* With the same casts only the reduction order differs; against f32 the
     * bf16 products move the weights by far more. */
    assert_params_close(dm, rm, 2e-4);
    double dmix = 0;
    ct_param *a = ct_module_find(rm, "2.weight"), *f = ct_module_find(fm, "2.weight");
    for (int64_t j = 0; j < a->data->numel; j++) dmix += fabs(ct_f32(a->data)[j] - ct_f32(f->data)[j]);
    ASSERT(dmix > 0);
    ct_strategy_destroy(ds);
    ASSERT(!w->compute); /* unwrapping drops the copies */
    ct_strategy_destroy(rs);
    ct_strategy_destroy(fs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
    ct_module_destroy(fm);
}

/* ---- ZeRO ---------------------------------------------------------------- */

/* kind over N ranks equals one process on the whole batch: weights and
 * (consolidated on rank 0) optimizer state, relative L2 < 1e-5. */
static void zero_vs_single_freeze(const char *kind, const char *opts, ct_optim_kind ok, float clip, int steps,
                                  int freeze);

static void zero_vs_single(const char *kind, const char *opts, ct_optim_kind ok, float clip, int steps)
{
    zero_vs_single_freeze(kind, opts, ok, clip, steps, 0);
}

/* With freeze, the middle linear layer is frozen before step 1 and
 * unfrozen before step 3 (in both runs). */
static void zero_vs_single_freeze(const char *kind, const char *opts, ct_optim_kind ok, float clip, int steps,
                                  int freeze)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 6 * world + 2;
    ct_module *dm = model(BIGGER, 21), *rm = model(BIGGER, 21);
    ct_optim_opts oo = optim_for(ok);
    char ropts[64];
    const char *accum = opts ? strstr(opts, "grad_accum=") : NULL;
    snprintf(ropts, sizeof ropts, "%.13s", accum ? accum : "");
    if (opts && strstr(opts, "param_dtype=bf16")) snprintf(ropts, sizeof ropts, "param_dtype=bf16");
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, g, opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, ropts, &rs));
    ASSERT(ct_strategy_partition(ds) != NULL);
    for (int step = 0; step < steps; step++) {
        if (freeze && (step == 1 || step == 3))
            for (int k = 0; k < 2; k++) {
                ct_module *mm = k ? rm : dm;
                ct_module_find(mm, "2.weight")->requires_grad = step == 3;
                ct_module_find(mm, "2.bias")->requires_grad = step == 3;
            }
        ct_step_out o;
        step_on_slice(ds, step, n, rank, world, &o);
        step_on_slice(rs, step, n, 0, 1, &o);
        if (clip > 0) {
            float a, b;
            ASSERT_OK(ct_strategy_clip_grad_norm(ds, clip, 2.0, &a));
            ASSERT_OK(ct_strategy_clip_grad_norm(rs, clip, 2.0, &b));
            ASSERT_CLOSE(a, b, 1e-5, 1e-6);
        }
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
    }
    ct_state a, b;
    ASSERT_OK(ct_strategy_model_state(ds, &a));
    ASSERT_OK(ct_strategy_model_state(rs, &b));
    ASSERT(state_rel_l2(&a, &b) < 1e-5);
    ct_state_fini(&a);
    ct_state_fini(&b);
    ASSERT_OK(ct_strategy_optim_state(ds, &a)); /* collective: complete on rank 0 */
    ASSERT_OK(ct_strategy_optim_state(rs, &b));
    if (rank == 0) ASSERT(state_rel_l2(&a, &b) < 1e-5);
    ct_state_fini(&a);
    ct_state_fini(&b);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

TEST(zero1_equals_one_process)
{
    zero_vs_single("zero1", NULL, CT_OPT_ADAMW, 0, 4);
    zero_vs_single("zero1", NULL, CT_OPT_SGD, 0, 4);
    zero_vs_single("zero1", "split_params=1", CT_OPT_ADAMW, 0, 3);
    zero_vs_single("zero1", NULL, CT_OPT_ADAMW, 0.05f, 3);
    zero_vs_single("zero1", "grad_accum=2", CT_OPT_SGD, 0, 3);
    zero_vs_single_freeze("zero1", "warn_on_trainable_params_changed=0", CT_OPT_ADAMW, 0, 5, 1);
}

TEST(zero2_equals_one_process)
{
    zero_vs_single("zero2", NULL, CT_OPT_ADAMW, 0, 4);
    zero_vs_single("zero2", NULL, CT_OPT_SGD, 0, 4);
    zero_vs_single("zero2", "split_params=1", CT_OPT_ADAMW, 0, 3);
    zero_vs_single("zero2", NULL, CT_OPT_ADAMW, 0.05f, 3);
    zero_vs_single("zero2", "grad_accum=2", CT_OPT_SGD, 0, 3);
    zero_vs_single("zero2", "reduce_buffer_mb=0.0001", CT_OPT_ADAMW, 0, 2); /* one gradient in flight */
    zero_vs_single_freeze("zero2", "warn_on_trainable_params_changed=0", CT_OPT_ADAMW, 0, 5, 1);
}

/* Freezing without auto_refresh_trainable is a clear error on every rank. */
TEST(zero_freeze_without_refresh_is_an_error)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    const char *kinds[2] = {"zero1", "zero2"};
    for (int k = 0; k < 2; k++) {
        ct_module *m = model(BIGGER, 3);
        ct_optim_opts oo = optim_for(CT_OPT_SGD);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create(kinds[k], m, &oo, g, "auto_refresh_trainable=0", &s));
        ct_step_out o;
        step_on_slice(s, 0, 4 * world, rank, world, &o);
        ASSERT_OK(ct_strategy_step(s));
        ct_module_find(m, "0.weight")->requires_grad = 0;
        ct_tensor *x, *y, *out;
        global_batch(1, 4, &x, &y);
        ct_fwd_ctx ctx = {.training = 1};
        ASSERT_ERR(ct_strategy_forward(s, x, &out, NULL, &ctx), CT_ESTATE, "auto_refresh_trainable=1");
        ct_tensor_release(x);
        ct_tensor_release(y);
        ct_strategy_destroy(s);
        ct_module_destroy(m);
    }
}

/* Unwrapping gives every parameter a gradient of its own (not a view into a
 * freed bucket), with its values. */
TEST(ddp_unwrap_leaves_gradients_of_their_own)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    const char *kinds[3] = {"ddp", "zero1", "zero2"};
    for (int k = 0; k < 3; k++) {
        ct_module *m = model(PLAIN, 3);
        ct_optim_opts oo = optim_for(CT_OPT_SGD);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create(kinds[k], m, &oo, g, NULL, &s));
        ct_step_out o;
        step_on_slice(s, 0, 4 * world, rank, world, &o);
        ct_strategy_destroy(s);
        ct_param **ps;
        int np;
        ASSERT_OK(ct_module_params(m, &ps, &np));
        for (int i = 0; i < np; i++) {
            const ct_storage *gs = ps[i]->grad->storage;
            ASSERT(gs->owns && gs->refcount == 1 && ct_tensor_data(ps[i]->grad) != NULL);
            ct_tensor_fill(ps[i]->grad, 1.0f); /* ASan: no write into freed memory */
        }
        ct_free(ps);
        ct_module_destroy(m);
    }
}

/* Manual reduce (fairscale's reduce()): both micro-batches under no_sync,
 * then ct_strategy_reduce, equals one process on the combined batch. */
TEST(strategy_manual_reduce_after_no_sync)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t b = 4, n = 2 * b * world;
    const char *kinds[3] = {"ddp", "zero1", "zero2"};
    for (int k = 0; k < 3; k++) {
        ct_module *dm = model(PLAIN, 3), *rm = model(PLAIN, 3);
        ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
        ct_strategy *ds, *rs;
        ASSERT_OK(ct_strategy_create(kinds[k], dm, &oo, g, NULL, &ds));
        ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
        for (int step = 0; step < 3; step++) {
            ct_tensor *x, *y;
            global_batch(step, n, &x, &y);
            ct_strategy_set_no_sync(ds, 1);
            ASSERT_OK(train_micro(ds, x, y, 2 * b * rank, b, 0.5f, step));
            ASSERT_OK(train_micro(ds, x, y, 2 * b * rank + b, b, 0.5f, step));
            ct_strategy_set_no_sync(ds, 0);
            ASSERT_OK(ct_strategy_reduce(ds));
            ASSERT_OK(train_micro(rs, x, y, 0, n, 1.0f, step));
            ASSERT_OK(ct_strategy_step(ds));
            ASSERT_OK(ct_strategy_step(rs));
            ct_strategy_zero_grad(ds);
            ct_strategy_zero_grad(rs);
            ct_tensor_release(x);
            ct_tensor_release(y);
        }
        ct_state a, c;
        ASSERT_OK(ct_strategy_model_state(ds, &a));
        ASSERT_OK(ct_strategy_model_state(rs, &c));
        if (state_rel_l2(&a, &c) >= 1e-5) ct_test_fail(__FILE__, __LINE__, "%s differs", kinds[k]);
        ct_state_fini(&a);
        ct_state_fini(&c);
        ct_strategy_destroy(ds);
        ct_strategy_destroy(rs);
        ct_module_destroy(dm);
        ct_module_destroy(rm);
    }
}

/* Mixed precision under ZeRO: the compute copies follow the broadcast
 * parameters (refreshed as each arrives), equal to one process with the
 * same casts. */
TEST(zero_mixed_bf16_equals_one_process_with_the_same_casts)
{
    zero_vs_single("zero1", "param_dtype=bf16", CT_OPT_ADAMW, 0, 3);
    zero_vs_single("zero2", "param_dtype=bf16", CT_OPT_ADAMW, 0, 3);
}

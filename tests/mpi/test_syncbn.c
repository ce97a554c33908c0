/*
 * SyncBatchNorm (sync_batchnorm=1): the cnn with batchnorm under ddp,
 * zero1, zero2 and fsdp at 2, 3 and 4 ranks, uneven rows, trains exactly as
 * one process on the whole global batch: every weight and the running
 * statistics, tensor by tensor.  One process on the global batch is
 * PyTorch's SyncBatchNorm math (statistics over every replica's rows), and
 * its batchnorm is PyTorch's (test_layers.c).  Without the option each
 * rank's statistics are its own rows', which the test shows differ.
 */
#include "train_util.h"

#define HW 6

/* cnn [3, 4 | 8] on 1x6x6 images with batchnorm after each conv. */
static ct_module *cnn_bn(void)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_CNN);
    c.in[0] = 1, c.in[1] = HW, c.in[2] = HW;
    c.nhidden = 3;
    c.hidden[0] = 3, c.hidden[1] = 4, c.hidden[2] = 8;
    c.classes = NCLS;
    c.batchnorm = 1;
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 17, &m));
    return m;
}

/* Images of step `step` (mean 0.5, so the statistics matter) and their classes. */
static void images(int step, int64_t n, ct_tensor **x, ct_tensor **y)
{
    *x = ct_tensor_create(CT_F32, 4, (int64_t[]){n, 1, HW, HW}, CT_MEM_ACT);
    *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 77, (uint64_t)step);
    ct_rng_normal(&r, ct_f32(*x), (size_t)(n * HW * HW), 0.5f, 1.5f);
    for (int64_t i = 0; i < n; i++) ((int32_t *)ct_tensor_data(*y))[i] = (int32_t)((i * 3 + step) % NCLS);
}

static void train(ct_strategy *s, int steps, int64_t n, int rank, int world)
{
    for (int step = 0; step < steps; step++) {
        ct_tensor *x, *y;
        images(step, n, &x, &y);
        int64_t first, count;
        slice(n, rank, world, &first, &count);
        ct_batch b = {rows(x, first, count), rows(y, first, count), n, first};
        ct_fwd_ctx ctx = {.training = 1, .seed = 3, .step = (uint64_t)step};
        ct_step_out out;
        ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
        ct_tensor_release(b.x);
        ct_tensor_release(b.y);
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
}

/* The largest difference of a's tensor name from b's, relative to 1 + |b|. */
static double worst(const ct_state *a, const ct_state *b, const char *name)
{
    const ct_tensor *x = NULL, *y = NULL;
    for (int i = 0; i < a->n; i++)
        if (!strcmp(a->names[i], name)) x = a->tensors[i];
    for (int i = 0; i < b->n; i++)
        if (!strcmp(b->names[i], name)) y = b->tensors[i];
    if (!x || !y) ct_test_fail(__FILE__, __LINE__, "%s is missing from a state", name);
    ASSERT_EQ(x->numel, y->numel);
    double w = 0;
    for (int64_t k = 0; k < x->numel; k++) {
        double d = fabs((double)ct_f32(x)[k] - ct_f32(y)[k]) / (1 + fabs((double)ct_f32(y)[k]));
        w = d > w ? d : w;
    }
    return w;
}

/* kind with opts at the world's size against one process (ref_opts): the
 * worst running statistic's difference (on rank 0, which holds every
 * sharded state); tol >= 0 checks every tensor against it. */
static double vs_one_ref(const char *kind, const char *opts, const char *ref_opts, double tol)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 4 * world + 1;
    ct_module *dm = cnn_bn(), *rm = cnn_bn();
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, g, opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, ref_opts, &rs));
    train(ds, 3, n, rank, world);
    train(rs, 3, n, 0, 1);
    ct_state a, b;
    ASSERT_OK(ct_strategy_model_state(ds, &a));
    ASSERT_OK(ct_strategy_model_state(rs, &b));
    double w = 0;
    if (rank == 0) {
        ASSERT_EQ(a.n, b.n);
        for (int i = 0; i < b.n; i++) {
            const char *nm = b.names[i];
            if (b.tensors[i]->ndim == 0) { /* num_batches_tracked: one per forward, either way */
                ASSERT_EQ(worst(&a, &b, nm), 0);
                continue;
            }
            double d = worst(&a, &b, nm);
            if (tol >= 0 && !(d <= tol))
                ct_test_fail(__FILE__, __LINE__, "%s (%s) at %d ranks: %s differs from one process by %g", kind,
                             opts, world, nm, d);
            if (strstr(nm, "running_")) w = d > w ? d : w;
            const ct_tensor *t = NULL;
            for (int q = 0; q < a.n; q++)
                if (!strcmp(a.names[q], nm)) t = a.tensors[q];
            for (int64_t k = 0; t && strstr(nm, "running_") && strstr(opts, "buffer_dtype=bf16") && k < t->numel; k++)
                if (ct_f32(t)[k] != ct_bf16_to_f32(ct_f32_to_bf16(ct_f32(t)[k])))
                    ct_test_fail(__FILE__, __LINE__, "%s (%s): %s[%lld] is not a bf16 value", kind, opts, nm,
                                 (long long)k);
        }
    }
    ct_state_fini(&a);
    ct_state_fini(&b);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
    return w;
}

static double vs_one(const char *kind, const char *opts, int check_all)
{
    return vs_one_ref(kind, opts, NULL, check_all ? 2e-5 : -1);
}

TEST(syncbn_cnn_every_data_parallel_strategy_equals_one_process)
{
    vs_one("ddp", "sync_batchnorm=1", 1);
    vs_one("ddp", "sync_batchnorm=1,bucket_cap_mb=0.0001", 1);
    vs_one("zero1", "sync_batchnorm=1", 1);
    vs_one("zero2", "sync_batchnorm=1", 1);
    vs_one("fsdp", "sync_batchnorm=1,wrap_kinds=conv2d", 1);
}

/* The control: each rank's own rows give other running statistics (DDP
 * broadcasts rank 0's), so the comparison above has something to catch. */
TEST(syncbn_off_each_rank_keeps_its_own_statistics)
{
    double w = vs_one("ddp", "sync_batchnorm=0", 0); /* rank 0's figure */
    if (ct_group_rank(ct_group_world()) == 0 && !(w > 1e-3)) ct_test_fail(__FILE__, __LINE__, "running statistics without sync differ by only %g", w);
}

TEST(syncbn_refused_where_ranks_do_not_share_a_batch)
{
    ct_module *m = cnn_bn();
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_ERR(ct_strategy_create("pipe", m, &oo, ct_group_world(), "sync_batchnorm=1", &s), CT_EINVAL,
               "sync_batchnorm=1 applies to ddp, zero1, zero2 and fsdp");
    ct_module_destroy(m);
}

/* ---- buffer_dtype ------------------------------------------------------- */

/* Trains the cnn alone with opts; *st gets its model state. */
static void alone(const char *opts, ct_state *st)
{
    ct_module *m = cnn_bn();
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("none", m, &oo, NULL, opts, &s));
    train(s, 3, 9, 0, 1);
    ASSERT_OK(ct_strategy_model_state(s, st));
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* buffer_dtype=bf16 (MixedPrecision.buffer_dtype): every running statistic
 * holds a bf16 value after training, and they differ from f32 buffers'
 * (the option does something); num_batches_tracked counts as before. */
TEST(buffer_dtype_bf16_holds_statistics_at_bf16)
{
    ct_state lo, hi;
    alone("buffer_dtype=bf16", &lo);
    alone(NULL, &hi);
    double diff = 0;
    int stats = 0;
    for (int i = 0; i < lo.n; i++) {
        const ct_tensor *t = lo.tensors[i];
        if (!strstr(lo.names[i], "running_")) {
            if (strstr(lo.names[i], "num_batches_tracked")) ASSERT_EQ(ct_f32(t)[0], 3.0f);
            continue;
        }
        stats++;
        for (int64_t k = 0; k < t->numel; k++) {
            float v = ct_f32(t)[k];
            if (v != ct_bf16_to_f32(ct_f32_to_bf16(v)))
                ct_test_fail(__FILE__, __LINE__, "%s[%lld] = %.9g is not a bf16 value", lo.names[i], (long long)k,
                             (double)v);
        }
        double d = worst(&lo, &hi, lo.names[i]);
        diff = d > diff ? d : diff;
    }
    ASSERT(stats >= 4);
    if (!(diff > 1e-5)) ct_test_fail(__FILE__, __LINE__, "bf16 statistics equal f32 ones (differ by %g)", diff);
    ct_state_fini(&lo);
    ct_state_fini(&hi);
}

/* Under every strategy whose ranks run the whole model it equals one
 * process with the same option (to one bf16 step, 2^-8, where the f32
 * statistics before rounding differ in their last bits). */
TEST(buffer_dtype_bf16_every_data_parallel_strategy_equals_one_process)
{
    vs_one_ref("ddp", "sync_batchnorm=1,buffer_dtype=bf16", "buffer_dtype=bf16", 8e-3);
    vs_one_ref("zero2", "sync_batchnorm=1,buffer_dtype=bf16", "buffer_dtype=bf16", 8e-3);
    vs_one_ref("fsdp", "sync_batchnorm=1,buffer_dtype=bf16,wrap_kinds=conv2d", "buffer_dtype=bf16", 8e-3);
    vs_one_ref("fsdp", "sync_batchnorm=1,buffer_dtype=bf16,param_dtype=bf16,wrap_kinds=conv2d",
               "buffer_dtype=bf16,param_dtype=bf16", 8e-3);
    ct_module *m = cnn_bn();
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_ERR(ct_strategy_create("pipe", m, &oo, ct_group_world(), "buffer_dtype=bf16", &s), CT_EINVAL,
               "buffer_dtype=bf16 applies to none, ddp, zero1, zero2 and fsdp");
    ct_module_destroy(m);
}

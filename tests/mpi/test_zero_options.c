/*
 * ZeRO's fairscale options, counted: broadcast_fp16 sends the updated
 * ranges in bf16 (exactly half the broadcast bytes of the default, the same
 * calls) while every owner keeps its f32 values and the other ranks hold
 * them rounded to bf16; ZeRO-2's buckets (reduce_bucket_size) train what
 * one process trains with one reduce per bucket instead of one per
 * gradient range, and parameters without a gradient are tolerated;
 * ZeRO-1's auto_refresh_trainable follows a frozen parameter without
 * broadcasting anything over the owners' masters.
 */
#include "train_util.h"
#include "parallel/zero/zero.h"
#include "parallel/internal.h"

/* Broadcast calls and bytes of one optimizer step of s (its broadcasts waited for). */
static ct_comm_tally step_broadcasts(ct_strategy *s, int step, int64_t n, int rank, int world)
{
    ct_step_out o;
    step_on_slice(s, step, n, rank, world, &o);
    ct_comm_tally before[CT_COLL_NKINDS], after[CT_COLL_NKINDS];
    ct_comm_tally_get(before);
    ASSERT_OK(ct_strategy_step(s));
    ct_comm_tally_get(after);
    ASSERT_OK(ct__zero_wait_all(s));
    ct_strategy_zero_grad(s);
    return (ct_comm_tally){after[CT_COLL_BROADCAST].calls - before[CT_COLL_BROADCAST].calls,
                           after[CT_COLL_BROADCAST].bytes - before[CT_COLL_BROADCAST].bytes};
}

static void check_fp16(const char *kind)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 3 * world + 1;
    ct_module *am = mlp8(5, 24), *bm = mlp8(5, 24);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *a, *b;
    ASSERT_OK(ct_strategy_create(kind, am, &oo, g, NULL, &a));
    ASSERT_OK(ct_strategy_create(kind, bm, &oo, g, "broadcast_fp16=1", &b));
    ct_comm_tally ta = step_broadcasts(a, 0, n, rank, world), tb = step_broadcasts(b, 0, n, rank, world);
    /* every rank takes part in every range's broadcast: the same calls, half the bytes */
    ASSERT(ta.calls > 0);
    ASSERT_EQ(tb.calls, ta.calls);
    ASSERT_EQ(2 * tb.bytes, ta.bytes);
    const ct_partition *pt = ct_strategy_partition(b);
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(am, &pa, &na));
    ASSERT_OK(ct_module_params(bm, &pb, &nb));
    ASSERT_EQ(na, nb);
    int64_t mine = 0, rounded = 0;
    for (int k = 0; k < pt->n; k++) {
        const ct_part_range *x = &pt->ranges[k];
        const float *va = ct_f32(pa[x->param]->data) + x->offset, *vb = ct_f32(pb[x->param]->data) + x->offset;
        for (int64_t e = 0; e < x->count; e++) {
            /* the owner's f32 master is the default's bit for bit; the others hold it in bf16 */
            float want = va[e];
            if (x->owner != rank) {
                uint16_t h;
                ct_f32_to_bf16_n(&want, &h, 1);
                ct_bf16_to_f32_n(&h, &want, 1);
            }
            if (memcmp(&want, &vb[e], sizeof want))
                ct_test_fail(__FILE__, __LINE__, "%s %s[%lld] on rank %d (owner %d): %.9g, want %.9g", kind,
                             pa[x->param]->name, (long long)(x->offset + e), rank, x->owner, (double)vb[e],
                             (double)want);
            if (x->owner == rank) mine++;
            else rounded += va[e] != want;
        }
    }
    ASSERT(mine > 0 || world > 4);
    if (world > 1) ASSERT(rounded > 0); /* the rounding shows: the values came as bf16 */
    /* later steps train on (close to) the same numbers */
    for (int step = 1; step < 3; step++) {
        step_broadcasts(a, step, n, rank, world);
        step_broadcasts(b, step, n, rank, world);
    }
    assert_params_close(am, bm, 2e-2);
    ct_free(pa);
    ct_free(pb);
    ct_strategy_destroy(a);
    ct_strategy_destroy(b);
    ct_module_destroy(am);
    ct_module_destroy(bm);
}

TEST(zero_broadcast_fp16_halves_bytes_and_keeps_f32_masters)
{
    check_fp16("zero1");
    check_fp16("zero2");
}

/* A parameter frozen between steps: ZeRO-1 re-buckets DDP's gradient flats
 * in place and broadcasts nothing, so under broadcast_fp16 every owner's
 * f32 master survives the refresh bit for bit (re-creating DDP broadcast
 * rank 0's values, its bf16-rounded copies of the others' ranges, over
 * them), and the frozen parameter's gradient is no longer reduced. */
TEST(zero1_refresh_keeps_f32_masters_and_follows_the_frozen_set)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 3 * world + 1;
    ct_module *m = mlp8(5, 24);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("zero1", m, &oo, g, "broadcast_fp16=1,warn_on_trainable_params_changed=0", &s));
    ct_comm_tally t0[CT_COLL_NKINDS], t1[CT_COLL_NKINDS];
    ct_comm_tally_get(t0);
    step_broadcasts(s, 0, n, rank, world);
    ct_comm_tally_get(t1);
    uint64_t all_grads = t1[CT_COLL_ALLREDUCE].bytes - t0[CT_COLL_ALLREDUCE].bytes;
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    int64_t total = 0;
    for (int i = 0; i < np; i++) total += ps[i]->data->numel;
    float *before = ct_alloc(sizeof *before * (size_t)total, CT_MEM_OTHER);
    ASSERT(before != NULL);
    for (int i = 0, at = 0; i < np; at += (int)ps[i]->data->numel, i++)
        memcpy(before + at, ct_f32(ps[i]->data), sizeof *before * (size_t)ps[i]->data->numel);
    ct_param *frozen = ct_module_find(m, "0.weight");
    frozen->requires_grad = 0;
    ct_comm_tally_get(t0);
    ct_step_out o;
    step_on_slice(s, 1, n, rank, world, &o); /* the forward follows the change, then a backward */
    ct_comm_tally_get(t1);
    for (int i = 0, at = 0; i < np; at += (int)ps[i]->data->numel, i++)
        if (memcmp(before + at, ct_f32(ps[i]->data), sizeof *before * (size_t)ps[i]->data->numel))
            ct_test_fail(__FILE__, __LINE__, "zero1: '%s' changed on rank %d when the trainable set was refreshed",
                         ps[i]->name, rank);
    if (world > 1) ASSERT_EQ(t1[CT_COLL_BROADCAST].calls - t0[CT_COLL_BROADCAST].calls, 0);
    ASSERT_OK(ct_strategy_step(s));
    ASSERT_OK(ct__zero_wait_all(s));
    ct_strategy_zero_grad(s);
    /* a step after the change allreduces every gradient but the frozen one */
    ct_comm_tally_get(t0);
    step_on_slice(s, 2, n, rank, world, &o);
    ct_comm_tally_get(t1);
    if (world > 1)
        ASSERT_EQ(all_grads - (t1[CT_COLL_ALLREDUCE].bytes - t0[CT_COLL_ALLREDUCE].bytes),
                  (uint64_t)frozen->data->numel * 4);
    ASSERT_OK(ct_strategy_step(s));
    ct_strategy_zero_grad(s);
    ct_free(before);
    ct_free(ps);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* Reduce calls of one train step of s (backward's reduces to the owners). */
static uint64_t step_reduces(ct_strategy *s, int step, int64_t n, int rank, int world)
{
    ct_comm_tally before[CT_COLL_NKINDS], after[CT_COLL_NKINDS];
    ct_comm_tally_get(before);
    ct_step_out o;
    step_on_slice(s, step, n, rank, world, &o);
    ct_comm_tally_get(after);
    ASSERT_OK(ct_strategy_step(s));
    ct_strategy_zero_grad(s);
    return after[CT_COLL_REDUCE].calls - before[CT_COLL_REDUCE].calls;
}

/* zero2 with opts against one process over 3 steps; returns the reduce
 * calls of a step, which must equal the strategy's bucket count. */
static uint64_t zero2_buckets_vs_one(const char *opts, ct_module *(*build)(void))
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 3 * world + 2;
    ct_module *dm = build(), *rm = build();
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("zero2", dm, &oo, g, opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    uint64_t calls = 0;
    for (int step = 0; step < 3; step++) {
        calls = step_reduces(ds, step, n, rank, world);
        ct_step_out o;
        step_on_slice(rs, step, n, 0, 1, &o);
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(rs);
        ASSERT_EQ(calls, (uint64_t)ct_strategy_stats(ds).nbuckets);
    }
    ASSERT_OK(ct__zero_wait_all(ds));
    assert_params_close(dm, rm, 1e-5);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
    return calls;
}

static ct_module *mlp(void) { return mlp8(9, 24); }

/* Linear, Tanh, a branch whose second Linear never runs, ReLU, Linear. */
static ct_module *with_unused(void)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, branch_create(ct_linear_create(16, 16, 1), ct_linear_create(16, 16, 1))));
    ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, NCLS, 1)));
    ct_module_init_params(m, 4);
    return m;
}

TEST(zero2_buckets_equal_one_process_with_fewer_reduces)
{
    int world = ct_group_size(ct_group_world());
    /* mlp8: 8 parameters, each whole on one owner: a reduce per parameter */
    uint64_t plain = zero2_buckets_vs_one(NULL, mlp);
    ASSERT_EQ(plain, 8);
    /* every gradient fits: one bucket per owner */
    uint64_t all = zero2_buckets_vs_one("reduce_bucket_size=100000", mlp);
    ASSERT(all >= 1 && all <= (uint64_t)world);
    /* only the biases and the smallest weight (80 elements) fit in 100: the rest alone */
    uint64_t some = zero2_buckets_vs_one("reduce_bucket_size=100", mlp);
    ASSERT(some < plain && some > all);
    /* pieces of split parameters, in bf16 on the wire */
    zero2_buckets_vs_one("reduce_bucket_size=64,split_params=1", mlp);
}

/* A parameter no backward reaches (the same on every rank) trains with a
 * zero gradient, as one process steps it; fairscale tolerates them too. */
TEST(zero2_tolerates_parameters_without_a_gradient)
{
    zero2_buckets_vs_one(NULL, with_unused);
    zero2_buckets_vs_one("reduce_bucket_size=1000", with_unused);
}

/* ShardedDDP's sync_models_at_startup: ranks that built different weights
 * (seed 5 + rank) hold rank 0's after wrapping, bit for bit; with it off,
 * each keeps its own. */
TEST(zero2_sync_models_at_startup_makes_rank0s_model)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    for (int sync = 0; sync < 2; sync++) {
        ct_module *m = mlp8(5 + (uint64_t)rank, 24), *ref = mlp8(5, 24), *own = mlp8(5 + (uint64_t)rank, 24);
        ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create("zero2", m, &oo, g, sync ? NULL : "sync_models_at_startup=0", &s));
        ct_param **pm, **pr;
        int nm, nr;
        ASSERT_OK(ct_module_params(m, &pm, &nm));
        ASSERT_OK(ct_module_params(sync ? ref : own, &pr, &nr));
        ASSERT_EQ(nm, nr);
        for (int i = 0; i < nm; i++)
            ASSERT(!memcmp(ct_tensor_data(pm[i]->data), ct_tensor_data(pr[i]->data), ct_tensor_bytes(pm[i]->data)));
        ct_free(pm);
        ct_free(pr);
        ct_strategy_destroy(s);
        ct_module_destroy(m);
        ct_module_destroy(ref);
        ct_module_destroy(own);
    }
}

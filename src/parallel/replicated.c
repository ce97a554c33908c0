/*
 * The replicated defaults: what a strategy does where its table leaves an
 * entry NULL (whole, synchronised gradients and parameters on every rank),
 * filled into each strategy's own table when it is created, so no caller
 * tests an entry for NULL.  "none" is the strategy made of defaults alone;
 * DDP adds its buckets to them, and so on.  The default train step runs
 * grad_accum micro-batches, the strategy's no_sync on all but the last.
 */
#include <string.h>

#include "internal.h"

static ct_status nothing(ct_strategy *s)
{
    (void)s;
    return CT_OK;
}
static void fini_nothing(ct_strategy *s) { (void)s; }
static float scale_one(ct_strategy *s)
{
    (void)s;
    return 1.0f;
}

/* Whole-parameter optimizer over every trainable parameter: what a rank
 * that holds the whole model owns. */
static ct_status whole_optim(ct_strategy *s, const ct_optim_opts *o)
{
    s->opt = ct_optim_create(o, s->params, s->nparams);
    return s->opt ? CT_OK : ct_last_status(); /* CT_ENOMEM stays CT_ENOMEM (found by the allocation walk) */
}

static const ct_partition *no_partition(const ct_strategy *s)
{
    (void)s;
    return NULL;
}
static ct_status summon_nothing(ct_strategy *s, int writeback, int rank0_only)
{
    (void)s, (void)writeback, (void)rank0_only;
    return CT_OK;
}
static void group_data_rank(const ct_strategy *s, int *rank, int *size)
{
    *rank = s->g ? ct_group_rank(s->g) : 0; /* no group: a process of its own */
    *size = s->g ? ct_group_size(s->g) : 1;
}

/* Every rank holds the whole gradients (synchronised): no combination. */
static ct_status whole_norm(ct_strategy *s, ct_norm_acc *acc)
{
    for (int i = 0; i < s->nparams; i++) {
        ct_param *p = s->params[i];
        if (p->grad && p->requires_grad && ct__clip_selects(s, p)) ct_norm_acc_tensor(acc, p->grad);
    }
    return CT_OK;
}
static void whole_scale(ct_strategy *s, float k)
{
    for (int i = 0; i < s->nparams; i++)
        if (ct__clip_selects(s, s->params[i])) ct_scale_grads(&s->params[i], 1, k);
}

static ct_status whole_step(ct_strategy *s)
{
    CT_TRY(ct_optim_step(s->opt));
    return ct__mixed_refresh(s);
}

/* Lazy: the next backward overwrites the gradients instead of adding to
 * zeros, which saves a write and a read of all gradient memory per step. */
static void lazy_zero_grad(ct_strategy *s) { ct_module_zero_grad_lazy(s->model); }

static ct_status plain_predict(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out)
{
    CT_TRY(ct_strategy_pre_forward(s));
    return ct_module_forward(s->model, x, out, NULL, ctx);
}

static ct_status micro_step(ct_strategy *s, const ct_batch *b, int64_t r0, int64_t n, int64_t global,
                            ct_loss_fn loss, void *ud, ct_fwd_ctx ctx, ct_step_out *out)
{
    ct_tensor *x = ct_tensor_rows(b->x, r0, n), *y = ct_tensor_rows(b->y, r0, n), *z = NULL, *dz = NULL;
    ct_record *rec = NULL;
    float l = 0;
    ctx.sample0 = b->sample0 + r0;
    ct_status st = x && y ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) st = ct_strategy_forward(s, x, &z, &rec, &ctx);
    if (st == CT_OK) st = loss(z, y, ud, &l, &dz);
    if (st == CT_OK) {
        if (!s->joined) {
            out->loss_sum += (double)l * (double)n;
            out->rows += n;
        }
        /* d(global mean)/d(micro-batch mean) = n / global; the reduction sums.  A joined rank's shadow
         * rows are not in the global batch: its backward runs (the collectives in it must) with 0. */
        st = ct_strategy_backward_ex(s, dz, rec, s->joined ? 0.0f : (float)((double)n / (double)global), NULL);
        rec = NULL;
    }
    ct_record_destroy(rec);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_tensor_release(z);
    ct_tensor_release(dz);
    return st;
}

int64_t ct__global_rows(const ct_strategy *s, const ct_batch *b)
{
    return b->global_rows ? b->global_rows : b->x->shape[0] * (s->g ? ct_group_size(s->g) : 1);
}

/* grad_accum micro-batches (ct_strategy_train_step checked the rows fill them). */
static ct_status micro_batches(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                               const ct_fwd_ctx *ctx, ct_step_out *out)
{
    int k = s->common.grad_accum;
    int64_t nrows = b->x->shape[0];
    int64_t global = ct__global_rows(s, b);
    int64_t r0 = 0;
    ct_status st = CT_OK;
    for (int m = 0; m < k && st == CT_OK; m++) {
        int64_t n = nrows / k + (m < nrows % k); /* as even as rows allow */
        ct_strategy_set_no_sync(s, m + 1 < k);
        st = micro_step(s, b, r0, n, global, loss, ud, *ctx, out);
        r0 += n;
    }
    ct_strategy_set_no_sync(s, 0);
    return st;
}

int ct__strategy_owns_micro_batches(const ct_strategy *s) { return s->vt.sync.train_step != micro_batches; }

#define FILL(f, d) \
    if (!(f)) (f) = (d)

void ct__strategy_fill(ct__strategy_ops *vt)
{
    FILL(vt->place.init, nothing);
    FILL(vt->place.fini, fini_nothing);
    FILL(vt->place.build_optim, whole_optim);
    FILL(vt->place.partition, no_partition);
    FILL(vt->place.summon, summon_nothing);
    FILL(vt->place.release, nothing);
    FILL(vt->place.data_rank, group_data_rank);
    FILL(vt->place.units, ct__whole_units);
    FILL(vt->place.unit_params, ct__whole_unit_params);
    FILL(vt->place.unit_io, ct__whole_unit_io);
    FILL(vt->sync.pre_forward, nothing);
    FILL(vt->sync.pre_backward, nothing);
    FILL(vt->sync.post_backward, nothing);
    FILL(vt->sync.grad_scale, scale_one);
    FILL(vt->sync.reduce, nothing);
    FILL(vt->sync.grad_norm, whole_norm);
    FILL(vt->sync.scale_grads, whole_scale);
    FILL(vt->sync.step, whole_step);
    FILL(vt->sync.zero_grad, lazy_zero_grad);
    FILL(vt->sync.train_step, micro_batches);
    FILL(vt->sync.predict, plain_predict);
    FILL(vt->state.model, ct__replicated_model_state);
    FILL(vt->state.optim, ct__replicated_optim_state);
    FILL(vt->state.shard, ct__replicated_shard_state);
    FILL(vt->state.local, ct__replicated_local_state);
    FILL(vt->state.load, ct__replicated_load_state);
    FILL(vt->state.each, ct__replicated_each);
    FILL(vt->state.share, ct__collected_share);
}

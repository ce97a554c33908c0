/*
 * ZeRO-2 (fairscale's ShardedDataParallel), on the ZeRO core in zero.c (the
 * partition, the parameter broadcasts after the step, checkpoint state).
 * It keeps no gradient buckets: a
 * parameter's gradient is materialised when its module starts backward,
 * reduced to the owners of its ranges as soon as it is complete (the
 * grad-ready hook); when the reduce is done the owners copy their ranges
 * into this rank's gradient shard (one flat buffer of exactly the owned
 * elements, which the optimizer steps from) and every rank frees the
 * gradient.  Gradient memory is the shard plus what is in flight: before a
 * module's gradients are materialised, backward waits for the oldest
 * reduces until reduce_buffer_mb would hold them (or nothing is left in
 * flight, for a module larger than that).
 * Clipping sums each rank's owned squares and allreduces them.
 */
#include <math.h>
#include <string.h>

#include "zero.h"

typedef struct {
    int split_params;
    int auto_refresh_trainable;
    int warn_on_trainable_params_changed;
    int broadcast_buffers;
    int sync_models_at_startup;
    double reduce_buffer_mb;
    int broadcast_fp16;
    int64_t reduce_bucket_size;
} zero2_opts;

static const ct__opt_def zero2_opt_defs[] = {
    REFRESH_OPTS(zero2_opts),
    SPLIT_OPT(zero2_opts),
    BCAST16_OPT(zero2_opts),
    {"broadcast_buffers", CT__OPT_BOOL, offsetof(zero2_opts, broadcast_buffers), "1",
     "broadcast buffers (batchnorm statistics) from rank 0 before every forward", 0, NULL},
    {"sync_models_at_startup", CT__OPT_BOOL, offsetof(zero2_opts, sync_models_at_startup), "1",
     "broadcast rank 0's parameters and buffers when wrapping", 0, NULL},
    {"reduce_bucket_size", CT__OPT_COUNT, offsetof(zero2_opts, reduce_bucket_size), "0",
     "pack gradient ranges smaller than this many elements per owner into buckets of that size, one reduce "
     "each (fairscale's reduce_buffer_size; 0: a reduce per range)", 0, NULL},
    {"reduce_buffer_mb", CT__OPT_NUM, offsetof(zero2_opts, reduce_buffer_mb), "8",
     "gradient MiB in flight to their owners before backward waits for the oldest", 0, NULL},
};

static const zero2_opts *O2(const ct_strategy *s) { return s->kopts; }

/* ZeRO-2's optimizer steps the owned ranges from the gradient shard; the
 * parameters do not move under it, so the slots point straight at them. */
static ct_status zero2_build_optim(ct_strategy *s, const ct_optim_opts *oo)
{
    ct__zero *z = ct__zero_of(s);
    int n = 0;
    ct_optim_slot *sl = ct_alloc_zeroed(sizeof *sl * (size_t)(z->sh.pt.n + 1), CT_MEM_OTHER);
    if (!sl) return CT_ENOMEM;
    for (int k = 0; k < z->sh.pt.n; k++) {
        const ct_part_range *x = &z->sh.pt.ranges[k];
        z->sh.slot[k] = z->goff[k] >= 0 ? n : -1;
        if (z->goff[k] < 0) continue;
        ct_param *p = z->sh.tp[x->param];
        sl[n++] = (ct_optim_slot){(float *)ct_tensor_data(p->data) + x->offset, z->gshard + z->goff[k], x->count,
                                  p->name, x->offset};
    }
    s->opt = ct_optim_create_slots(oo, sl, n);
    ct_free(sl);
    return s->opt ? CT_OK : ct_last_status();
}

/* Waits for the oldest parameter in flight: its owners copy their ranges
 * of the sum into the shard, and every rank frees the gradient. */
static ct_status finish_oldest(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    int i = ct__inflight_take(&z->q, 0);
    ct_param *p = z->sh.tp[i];
    ct_status st = CT_OK;
    for (int k = z->sh.first[i]; k < z->sh.pt.n && z->sh.pt.ranges[k].param == i; k++) {
        if (!z->red[k]) continue;
        ct_status w = ct_work_wait(z->red[k]);
        if (st == CT_OK) st = w;
        ct_work_destroy(z->red[k]);
        z->red[k] = NULL;
        const ct_part_range *x = &z->sh.pt.ranges[k];
        if (z->goff[k] < 0) continue;
        ct_dtype dt = z->wire[i] ? (ct_dtype)s->common.reduce_dtype : CT_F32;
        const char *r = z->wire[i] ? (const char *)z->wire[i] : (const char *)ct_tensor_data(p->grad);
        ct__wire_unpack(dt, r + (size_t)x->offset * ct_dtype_size(dt), z->gshard + z->goff[k], x->count, 0);
    }
    double end = z->t_start[i];
    for (int k = z->sh.first[i]; k < z->sh.pt.n && z->sh.pt.ranges[k].param == i; k++)
        if (z->t_end[k] > end) end = z->t_end[k];
    z->t_comm += end - z->t_start[i]; /* the callbacks ran before the waits returned */
    ct_trace_event("reduce to owners", "comm", z->t_start[i], end, 1);
    ct_free(z->wire[i]);
    z->wire[i] = NULL;
    ct__flat_evict(&z->gflat[i], CT__FL_GRAD);
    p->grad_stale = 1;
    return st;
}

static void zero2_drain(ct_strategy *s)
{
    while (ct__zero_of(s)->q.n) finish_oldest(s);
}

static void on_reduced(ct_work *w, ct_status status, void *arg)
{
    (void)w;
    (void)status;
    *(double *)arg = ct_now();
}

/* The grad-ready hook: start the reduces of the parameter's ranges. */
static ct_status grad_to_owners(ct_param *p, void *ud)
{
    ct_strategy *s = ud;
    ct__zero *z = ct__zero_of(s);
    if (s->no_sync) return CT_OK;
    int i = ct__shards_index(&z->sh, p);
    if (z->ready[i])
        return ct_error(CT_ESTATE, "%s: parameter '%s' received its gradient twice in one backward (a module "
                        "called twice?); give each call its own parameter, or tie a weight used by two modules "
                        "with ct_module_share_param, which completes it once", s->ops->kind,
                        p->name);
    z->ready[i] = 1;
    z->nready++;
    int direct = 0;
    for (int k = z->sh.first[i]; k < z->sh.pt.n && z->sh.pt.ranges[k].param == i; k++) {
        if (ct__zbuckets_has(z->zb, k)) CT_TRY(ct__zbuckets_pack(s, z->zb, k, ct_tensor_data(p->grad)));
        else direct += z->sh.pt.ranges[k].count > 0;
    }
    if (!direct) { /* all of it went into buckets: the gradient's memory goes now */
        ct__flat_evict(&z->gflat[i], CT__FL_GRAD);
        p->grad_stale = 1;
        return CT_OK;
    }
    ct_dtype dt = (ct_dtype)s->common.reduce_dtype;
    void *buf = ct_tensor_data(p->grad);
    if (dt != CT_F32) {
        if (!(z->wire[i] = ct__wire_alloc(dt, p->grad->numel))) return CT_ENOMEM;
        ct__wire_pack(dt, buf, z->wire[i], p->grad->numel);
        buf = z->wire[i];
    }
    size_t es = ct_dtype_size(dt);
    z->t_start[i] = ct_now();
    for (int k = z->sh.first[i]; k < z->sh.pt.n && z->sh.pt.ranges[k].param == i; k++) {
        const ct_part_range *x = &z->sh.pt.ranges[k];
        if (!x->count || ct__zbuckets_has(z->zb, k)) continue;
        /* A sum: the loss gradient was scaled by 1/world (ct__ddp_grad_scale). */
        z->t_end[k] = 0;
        z->nreduces++;
        CT_TRY(ct_group_reduce(s->g, (char *)buf + (size_t)x->offset * es, x->count, dt, CT_OP_SUM, x->owner,
                               &z->red[k]));
        CT_TRY(ct_work_on_complete(z->red[k], on_reduced, &z->t_end[k]));
    }
    ct__inflight_push(&z->q, i, ct_tensor_bytes(p->grad));
    return CT_OK;
}

/* A module about to run backward: its gradients need memory, after the
 * oldest reduces have made room within reduce_buffer_mb. */
static ct_status grads_needed(ct_module *m, ct_hook_kind kind, void *ud)
{
    (void)kind;
    ct_strategy *s = ud;
    ct__zero *z = ct__zero_of(s);
    size_t need = 0;
    for (int j = 0; j < m->nparams; j++)
        if (m->params[j]->requires_grad && !ct_tensor_data(m->params[j]->grad))
            need += ct_tensor_bytes(m->params[j]->grad);
    double t0 = ct_now();
    while (z->q.n && z->q.total + need > z->limit) CT_TRY(finish_oldest(s));
    double t1 = ct_now();
    if (t1 - t0 > 1e-6) {
        z->t_room += t1 - t0;
        ct_trace_event("wait for room", "comm", t0, t1, 0);
    }
    for (int j = 0; j < m->nparams; j++) {
        ct_param *p = m->params[j];
        if (!p->requires_grad || ct_tensor_data(p->grad)) continue;
        CT_TRY(ct__flat_fill(&z->gflat[ct__shards_index(&z->sh, p)], CT__FL_GRAD, 0));
        p->grad_stale = 1; /* the memory is new: the layer overwrites it */
    }
    return CT_OK;
}

uint64_t ct__zero2_shard_bytes(const ct_partition *pt, int rank)
{
    uint64_t b = 64; /* slack past the last owned element */
    for (int k = 0; k < pt->n; k++)
        if (pt->ranges[k].owner == rank) b += (uint64_t)pt->ranges[k].count * sizeof(float);
    return b;
}

static ct_status zero2_init(ct_strategy *s)
{
    const zero2_opts *o = O2(s);
    CT_TRY(ct_group_check(s->g, ct__check_same_model(s)));
    if (o->sync_models_at_startup) CT_TRY(ct__broadcast_state(s, 0));
    CT_TRY(ct__zero_core_init(s, o->split_params, o->broadcast_fp16));
    ct__zero *z = ct__zero_of(s);
    size_t nt = (size_t)z->sh.ntp + 1, nr = (size_t)z->sh.pt.n + 1;
    z->grad_hooks = ct_alloc_zeroed(sizeof *z->grad_hooks * nt, CT_MEM_OTHER);
    z->goff = ct_alloc_zeroed(sizeof *z->goff * nr, CT_MEM_OTHER);
    z->ready = ct_alloc_zeroed(nt, CT_MEM_OTHER);
    z->red = ct_alloc_zeroed(sizeof *z->red * nr, CT_MEM_OTHER);
    z->wire = ct_alloc_zeroed(sizeof *z->wire * nt, CT_MEM_OTHER);
    z->t_start = ct_alloc_zeroed(sizeof *z->t_start * nt, CT_MEM_OTHER);
    z->t_end = ct_alloc_zeroed(sizeof *z->t_end * nr, CT_MEM_OTHER);
    if (!z->grad_hooks || !z->goff || !z->ready || !z->red || !z->wire || !z->t_start || !z->t_end)
        return CT_ENOMEM;
    CT_TRY(ct__inflight_init(&z->q, z->sh.ntp));
    z->limit = (size_t)(o->reduce_buffer_mb * 1048576.0);
    int rank = ct_group_rank(s->g);
    for (int k = 0; k < z->sh.pt.n; k++) {
        z->goff[k] = z->sh.pt.ranges[k].owner == rank ? z->nshard : -1;
        if (z->goff[k] >= 0) z->nshard += z->sh.pt.ranges[k].count;
    }
    if (!(z->gshard = ct_alloc_zeroed((size_t)ct__zero2_shard_bytes(&z->sh.pt, rank), CT_MEM_GRAD))) return CT_ENOMEM;
    CT_TRY(ct__zbuckets_create(z, o->reduce_bucket_size, (ct_dtype)s->common.reduce_dtype, &z->zb));
    if (!(z->gflat = ct_alloc_zeroed(sizeof *z->gflat * nt, CT_MEM_OTHER))) return CT_ENOMEM;
    for (int i = 0; i < z->sh.ntp; i++) {
        ct_param *p = z->sh.tp[i];
        const ct_storage *gs = p->grad ? p->grad->storage : NULL;
        if (!gs || !gs->owns || gs->window || gs->refcount != 1 || p->grad->offset || gs->bytes != ct_tensor_bytes(p->grad))
            return ct_error(CT_ESTATE, "zero2: the gradient of '%s' is a view into other memory (is the model "
                            "wrapped by another strategy?)", p->name);
        if (!(z->grad_hooks[i] = ct_param_add_hook(p, grad_to_owners, s))) return CT_ENOMEM;
        /* materialised by its module's backward, freed once reduced */
        ct__flat *fl = &z->gflat[i];
        CT_TRY(ct__flat_init(fl, &p, 1, 1, 0, 0));
        CT_TRY(ct__flat_storage(fl, CT__FL_GRAD, CT_MEM_GRAD, 0, 0, NULL));
        CT_TRY(ct__flat_move(fl, CT__FL_BIT(CT__FL_GRAD), 0));
    }
    ct_module **mods = NULL;
    int nmods = 0;
    CT_TRY(ct_module_modules(s->model, &mods, &nmods));
    ct_hook **h = ct_alloc_zeroed(sizeof *h * (size_t)(z->nhooks + nmods + 1), CT_MEM_OTHER);
    ct_status st = h ? CT_OK : CT_ENOMEM;
    if (h) {
        memcpy(h, z->hooks, sizeof *h * (size_t)z->nhooks);
        ct_free(z->hooks);
        z->hooks = h;
    }
    for (int i = 0; st == CT_OK && i < nmods; i++) {
        if (!mods[i]->nparams) continue;
        if (!(z->hooks[z->nhooks++] = ct_module_add_hook(mods[i], CT_HOOK_PRE_BACKWARD, grads_needed, s)))
            st = CT_ENOMEM;
    }
    ct_free(mods);
    return st;
}

static void zero2_fini(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    if (z) {
        ct__zero_wait_all(s);
        if (z->red) zero2_drain(s);
        ct__zbuckets_destroy(z->zb);
        z->zb = NULL;
        for (int i = 0; z->grad_hooks && i < z->sh.ntp; i++) {
            ct_hook_remove(z->grad_hooks[i]);
            /* every parameter leaves with a gradient of its own again */
            ct_param *p = z->sh.tp[i];
            ct__flat *fl = z->gflat ? &z->gflat[i] : NULL;
            if (!fl || !fl->pointed) continue; /* set-up stopped before it */
            /* Reduced already: unpoint gives a zeroed gradient (fresh pages, untouched)
             * and only this rank's pieces are written into it, so a teardown does not
             * touch a whole model's gradients (it did: 326 MiB more RSS than training
             * for the 12 x 768 GPT at 2 ranks). */
            int reduced = !ct_tensor_data(p->grad);
            if (reduced) p->grad_stale = 1;
            ct__flat_unpoint(fl, NULL, NULL);
            if (reduced && ct_tensor_data(p->grad)) {
                p->grad_stale = 0;
                for (int k = z->sh.first[i]; z->gshard && k < z->sh.pt.n && z->sh.pt.ranges[k].param == i; k++)
                    if (z->goff[k] >= 0) /* the reduced values this rank holds */
                        memcpy((float *)ct_tensor_data(p->grad) + z->sh.pt.ranges[k].offset, z->gshard + z->goff[k],
                               (size_t)z->sh.pt.ranges[k].count * sizeof(float));
            }
        }
        for (int i = 0; z->gflat && i < z->sh.ntp; i++) ct__flat_fini(&z->gflat[i]);
        ct_free(z->gflat);
        ct_free(z->grad_hooks);
        ct_free(z->gshard);
        ct_free(z->goff);
        ct_free(z->ready);
        ct_free(z->red);
        ct_free(z->wire);
        ct__inflight_fini(&z->q);
        ct_free(z->t_start);
        ct_free(z->t_end);
    }
    ct__zero_core_fini(s);
}

static ct_status zero2_pre_forward(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    if (z->stepped) {
        int changed;
        z->stepped = 0;
        CT_TRY(ct__zero_refresh_trainable(s, O2(s)->auto_refresh_trainable, O2(s)->warn_on_trainable_params_changed,
                                 &changed));
    }
    if (O2(s)->broadcast_buffers && s->nbuffers) return ct__broadcast_state(s, 1);
    return CT_OK;
}

static ct_status zero2_pre_backward(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    if (s->no_sync) return CT_OK;
    memset(z->ready, 0, (size_t)z->sh.ntp);
    z->nready = 0;
    z->nreduces = 0;
    ct__zbuckets_begin(z->zb, z);
    z->t_comm = 0;
    z->t_room = 0;
    return CT_OK;
}

static ct_status zero2_post_backward(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    if (s->no_sync) return CT_OK;
    ct_status st = CT_OK;
    double t0 = ct_now();
    while (z->q.n) {
        ct_status w = finish_oldest(s);
        if (st == CT_OK) st = w;
    }
    ct_status w = ct__zbuckets_finish(s, z->zb);
    if (st == CT_OK) st = w;
    /* A frozen parameter's gradient is zero, as a plain optimizer sees it, and so is that of a
     * parameter the backward did not reach (fairscale tolerates those; the same ones on every
     * rank, since no rank sent a reduce for it).  Buckets carried theirs as zeros. */
    for (int k = 0; k < z->sh.pt.n; k++) {
        int i = z->sh.pt.ranges[k].param;
        if (z->goff[k] >= 0 && (!z->trainable[i] || (!z->ready[i] && !ct__zbuckets_has(z->zb, k))))
            memset(z->gshard + z->goff[k], 0, (size_t)z->sh.pt.ranges[k].count * sizeof(float));
    }
    double t1 = ct_now();
    if (z->sh.ntp) ct_trace_event("wait for reduce", "comm", t0, t1, 0);
    /* waits inside backward for room are communication, not compute */
    s->stats.backward -= z->t_room;
    s->stats.comm_wait += t1 - t0 + z->t_room;
    s->stats.comm_total += z->t_comm;
    s->stats.nbuckets = z->nreduces; /* one per bucket, one per gradient range travelling alone */
    return st;
}

/* Gradients accumulated under no_sync go to their owners now. */
static ct_status zero2_reduce(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    int saved = s->no_sync;
    s->no_sync = 0;
    ct_status st = zero2_pre_backward(s);
    for (int i = 0; st == CT_OK && i < z->sh.ntp; i++) {
        ct_param *p = z->sh.tp[i];
        if (!z->trainable[i]) continue;
        if (!ct_tensor_data(p->grad)) { /* no backward wrote it: a zero gradient */
            st = ct__flat_fill(&z->gflat[i], CT__FL_GRAD, 0);
            p->grad_stale = 1;
        }
        ct_param_grad_sync(p);
        if (st == CT_OK) st = grad_to_owners(p, s);
    }
    if (st == CT_OK) st = zero2_post_backward(s);
    s->no_sync = saved;
    return st;
}

/* The global norm: each rank's owned ranges (the reduced gradients live
 * there only, and the optimizer's slots are exactly those), combined over
 * the group. */
static ct_status zero2_grad_norm(ct_strategy *s, ct_norm_acc *acc)
{
    ct_norm_acc mine = ct_norm_acc_init(acc->p);
    if (!s->clip_filter) {
        ct_optim_grad_norm_acc(s->opt, &mine);
    } else { /* the owned ranges of the parameters the clip takes */
        const ct__zero *z = ct__zero_of(s);
        for (int r = 0; r < z->sh.pt.n; r++)
            if (z->goff[r] >= 0 && ct__clip_selects(s, z->sh.tp[z->sh.pt.ranges[r].param]))
                ct_norm_acc_f32(&mine, z->gshard + z->goff[r], z->sh.pt.ranges[r].count);
    }
    CT_TRY(ct__norm_combine(s->g, &mine));
    ct_norm_acc_add(acc, mine.v);
    return CT_OK;
}

static void zero2_scale_grads(ct_strategy *s, float c)
{
    ct__zero *z = ct__zero_of(s);
    if (!s->clip_filter) {
        for (int64_t j = 0; j < z->nshard; j++) z->gshard[j] *= c;
        return;
    }
    for (int r = 0; r < z->sh.pt.n; r++)
        if (z->goff[r] >= 0 && ct__clip_selects(s, z->sh.tp[z->sh.pt.ranges[r].param]))
            for (int64_t j = 0; j < z->sh.pt.ranges[r].count; j++) z->gshard[z->goff[r] + j] *= c;
}

const ct__strategy_ops ct__zero2_ops = {
    .kind = "zero2",
    .replicas_share_batch = 1,
    .opts = zero2_opt_defs,
    .nopts = (int)(sizeof zero2_opt_defs / sizeof zero2_opt_defs[0]),
    .opts_size = sizeof(zero2_opts),
    .place = {
        .init = zero2_init,
        .fini = zero2_fini,
        .build_optim = zero2_build_optim,
        .partition = ct__zero_partition,
        .summon = ct__zero_summon,
    },
    .sync = {
        .pre_forward = zero2_pre_forward,
        .pre_backward = zero2_pre_backward,
        .post_backward = zero2_post_backward,
        .reduce = zero2_reduce,
        .grad_scale = ct__ddp_grad_scale,
        .grad_norm = zero2_grad_norm,
        .scale_grads = zero2_scale_grads,
        .step = ct__zero_step,
    },
    .state = CT__ZERO_STATE_OPS,
};

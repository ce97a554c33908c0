/*
 * FSDP (ZeRO-3), after PyTorch 1.13's FullyShardedDataParallel.  The model
 * is cut into units (fsdp_units.c); each unit's trainable parameters are
 * laid end to end in a flat parameter (two under mixed precision: the
 * weights gathered in bf16 for the products, the rest in f32), padded to a
 * multiple of the shard group's size, and each rank keeps one equal piece,
 * cut by the same partition ZeRO uses (partition.c, split): the f32 master,
 * its gradient and its optimizer state.  The parameters stay ct_params with
 * their names and shapes; their data, grad and compute tensors are views of
 * the unit's flat storages, which hold memory only while the unit computes:
 *
 *   pre-forward   all-gather the unit's pieces (bf16: half the bytes)
 *   post-forward  FULL_SHARD frees them again (not the root, whose backward
 *                 comes next, nor after a checkpoint's recompute, whose
 *                 backward comes next too); SHARD_GRAD_OP keeps them
 *   pre-backward  all-gather again if freed; memory for the gradients
 *   post-backward reduce-scatter the gradients into this rank's piece
 *                 (reduce_dtype on the wire), free the gradients and the
 *                 parameters
 *
 * A registered communication hook (comm_hook.h) replaces the post-backward
 * reduce-scatter of every sharded unit: it gets the unit's padded f32
 * gradient and this rank's piece to fill (gshard, or an f32 buffer added to
 * it); reduce_dtype is then the hook's business.
 *
 * HYBRID_SHARD shards inside a node and allreduces the pieces across nodes
 * (replicas); NO_SHARD keeps every parameter (a shard group of one) and
 * allreduces, as DDP does.  Gathers run ahead: backward_prefetch pre starts
 * the next unit's gather (in the order the first backward ran the units)
 * before computing this one, post after this one's reduce started;
 * forward_prefetch does the same in forward order.  limit_all_gathers
 * holds a prefetch back while two units other than the root are unsharded.
 *
 * Under no_sync the unsharded gradients stay (accumulating) until a
 * synchronised backward or ct_strategy_reduce.  The optimizer steps the
 * pieces (ZeRO's slots), so optimizer checkpoints reuse ZeRO's code.
 */
#include <math.h>
#include <string.h>

#include "fsdp.h"

static const ct__opt_def fsdp_opt_defs[] = {
    {"sharding", CT__OPT_CHOICE, offsetof(fsdp_opts, sharding), "full",
     "full: gather per unit, free after forward and backward; grad_op: keep from forward through backward; "
     "none: no sharding (allreduce, like DDP); hybrid: shard inside a node, replicate across nodes",
     0, "full|grad_op|none|hybrid"},
    {"backward_prefetch", CT__OPT_CHOICE, offsetof(fsdp_opts, backward_prefetch), "pre",
     "gather the next unit before computing this one's gradients (pre), after reducing them (post), or not",
     0, "pre|post|none"},
    {"forward_prefetch", CT__OPT_BOOL, offsetof(fsdp_opts, forward_prefetch), "0",
     "gather the next unit (in the first step's order) while this one runs forward", 0, NULL},
    {"limit_all_gathers", CT__OPT_BOOL, offsetof(fsdp_opts, limit_all_gathers), "0",
     "prefetch only while fewer than two units besides the root are unsharded", 0, NULL},
    {"sync_module_states", CT__OPT_BOOL, offsetof(fsdp_opts, sync_module_states), "1",
     "broadcast rank 0's parameters and buffers when wrapping", 0, NULL},
    {"wrap_min_params", CT__OPT_COUNT, offsetof(fsdp_opts, wrap_min_params), "0",
     "auto-wrap: a module whose parameters outside units below it reach this many elements becomes a unit "
     "(0: off)", 0, NULL},
    {"keep_low_precision_grads", CT__OPT_BOOL, offsetof(fsdp_opts, keep_low_precision_grads), "0",
     "param_dtype=bf16: keep the reduced gradients of the bf16 weights at bf16 precision (MixedPrecision's "
     "keep_low_precision_grads)", 0, NULL},
    {"wrap_modules", CT__OPT_TEXT, 0, "", "modules (names, '+' between) that become units", 0, NULL},
    {"wrap_kinds", CT__OPT_TEXT, 0, "", "module kinds (e.g. residual) whose every module becomes a unit", 0, NULL},
    {"ignored_modules", CT__OPT_TEXT, 0, "",
     "modules (names, '+' between) kept whole on every rank (replicated, gradients allreduced)", 0, NULL},
    {"offload", CT__OPT_CHOICE, offsetof(fsdp_opts, offload), "none",
     "this rank's shard parts kept in a store (fsdp_offload.c): optim: optimizer state; params: masters and "
     "gradient pieces; all: the three", 0, "none|optim|params|all"},
    {"offload_dir", CT__OPT_TEXT, 0, "",
     "with offload: directory of the store's file (empty: $TMPDIR, else /tmp); the file is unlinked at once", 0, NULL},
    {"max_resident_mb", CT__OPT_AUTO_INT, offsetof(fsdp_opts, max_resident_mb), "auto",
     "with offload: bound in MiB on resident parameter + gradient + optimizer bytes (auto: no bound)", 0, NULL},
    {"store", CT__OPT_CHOICE, offsetof(fsdp_opts, store), "file",
     "with offload: where offloaded parts live: file (on disk) or memory (a pool in RAM)", 0, "file|memory"},
    {"drop_cache", CT__OPT_BOOL, offsetof(fsdp_opts, drop_cache), "1",
     "with offload: drop the store's pages from the page cache after each transfer", 0, NULL},
};

static const fsdp_opts *O(const ct_strategy *s) { return s->kopts; }
fsdp_t *ct__fsdp_of(ct_strategy *s) { return s->priv; }

static int64_t padded(const fsdp_unit *u, const fsdp_flat *fl) { return fl->flat.shard * u->ns; }

/* ---- gather and free ------------------------------------------------------ */

static ct_status start_gather(ct_strategy *s, fsdp_unit *u)
{
    if (u->state != UNIT_SHARDED) return CT_OK;
    if (ct__fsdp_of(s)->off) CT_TRY(ct__fsdp_off_masters(s, u));
    for (int k = 0; k < u->nfl; k++) {
        fsdp_flat *fl = &u->fl[k];
        if (fl->low) {
            CT_TRY(ct_storage_alloc_data(fl->flat.st[CT__FL_LOW], 0));
            uint16_t *dst = ct_storage_ptr(fl->flat.st[CT__FL_LOW]);
            if (u->ns == 1) {
                ct_f32_to_bf16_n(fl->master, dst, (size_t)fl->flat.shard);
                continue;
            }
            if (!fl->send && !(fl->send = ct_alloc((size_t)fl->flat.shard * 2 + 64, CT_MEM_COMM))) return CT_ENOMEM;
            ct_f32_to_bf16_n(fl->master, fl->send, (size_t)fl->flat.shard);
            CT_TRY(ct_group_allgather(u->sg, fl->send, dst, fl->flat.shard, CT_BF16, &fl->ag));
        } else if (u->ns > 1) {
            CT_TRY(ct_storage_alloc_data(fl->flat.st[CT__FL_DATA], 0));
            CT_TRY(ct_group_allgather(u->sg, fl->master, ct_storage_ptr(fl->flat.st[CT__FL_DATA]), fl->flat.shard, CT_F32, &fl->ag));
        }
    }
    u->state = UNIT_GATHERING;
    u->t_ag = ct_now();
    return CT_OK;
}

static ct_status finish_gather(ct_strategy *s, fsdp_unit *u)
{
    CT_TRY(start_gather(s, u));
    if (u->state == UNIT_FULL) return CT_OK;
    double t0 = ct_now();
    ct_status st = CT_OK;
    for (int k = 0; k < u->nfl; k++) {
        fsdp_flat *fl = &u->fl[k];
        if (fl->ag) {
            ct_status w = ct_work_wait(fl->ag);
            if (st == CT_OK) st = w;
            ct_work_destroy(fl->ag);
            fl->ag = NULL;
        }
        ct_free(fl->send);
        fl->send = NULL;
    }
    double t1 = ct_now();
    s->stats.comm_wait += t1 - t0;
    s->stats.comm_total += t1 - u->t_ag;
    if (t1 - t0 > 1e-6) ct_trace_event("wait for all-gather", "comm", t0, t1, 0);
    ct_trace_event("all-gather", "comm", u->t_ag, t1, 1);
    u->state = UNIT_FULL;
    if (ct__fsdp_of(s)->off) ct__fsdp_off_gathered(s, u);
    return st;
}

static void free_params(fsdp_unit *u)
{
    if (u->state != UNIT_FULL || u->summoned) return;
    for (int k = 0; k < u->nfl; k++) {
        fsdp_flat *fl = &u->fl[k];
        if (fl->low) ct_storage_free_data(fl->flat.st[CT__FL_LOW]);
        else if (u->ns > 1) ct_storage_free_data(fl->flat.st[CT__FL_DATA]);
    }
    u->state = UNIT_SHARDED;
    if (ct__fsdp_of(u->s)->off) ct__fsdp_off_freed(u->s, u);
}

/* Units other than the root that hold their parameters now. */
static int unsharded(const fsdp_t *f)
{
    int n = 0;
    for (int i = 0; i < f->nu; i++) n += !f->u[i].is_root && f->u[i].state != UNIT_SHARDED;
    return n;
}

/* Starts the gather of the unit after u in order (the first step's). */
static ct_status prefetch(ct_strategy *s, const int *order, int n, const fsdp_unit *u)
{
    fsdp_t *f = ct__fsdp_of(s);
    if (!f->recorded) return CT_OK;
    int me = (int)(u - f->u);
    for (int i = 0; i + 1 < n; i++) {
        if (order[i] != me) continue;
        fsdp_unit *next = &f->u[order[i + 1]];
        if (next->state != UNIT_SHARDED || (O(s)->limit_all_gathers && unsharded(f) >= 2)) return CT_OK;
        return start_gather(s, next);
    }
    return CT_OK;
}

/* ---- gradients -------------------------------------------------------------- */

static ct_status alloc_grads(fsdp_unit *u)
{
    if (u->grads) return CT_OK;
    for (int k = 0; k < u->nfl; k++) {
        fsdp_flat *fl = &u->fl[k];
        CT_TRY(ct_storage_alloc_data(fl->flat.st[CT__FL_GRAD], 0));
        float *g = ct_storage_ptr(fl->flat.st[CT__FL_GRAD]);
        memset(g + fl->flat.numel, 0, (size_t)(padded(u, fl) - fl->flat.numel) * sizeof(float));
        for (int j = 0; j < fl->flat.n; j++) fl->flat.p[j]->grad_stale = 1; /* new memory: the layers overwrite it */
    }
    u->grads = 1;
    return CT_OK;
}

static void free_grads(fsdp_unit *u)
{
    for (int k = 0; k < u->nfl; k++) {
        fsdp_flat *fl = &u->fl[k];
        ct_storage_free_data(fl->flat.st[CT__FL_GRAD]);
        for (int j = 0; j < fl->flat.n; j++) fl->flat.p[j]->grad_stale = 1;
    }
    u->grads = 0;
}

/* A registered hook reduces this unit (a sharded one): its wire is f32. */
static int hooked(const ct_strategy *s, const fsdp_unit *u) { return s->hook && u->ns > 1; }

/* Flat k of u as the hook's bucket: the padded gradient, this rank's piece
 * in gshard or (something to add it to) rsbuf; index 2 u + k. */
static void hook_bucket(ct_strategy *s, fsdp_unit *u, int k, ct_comm_bucket *b)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_flat *fl = &u->fl[k];
    *b = (ct_comm_bucket){.index = 2 * (int)(u - f->u) + k, .nbuckets = 2 * f->nu,
                          .grad = ct_storage_ptr(fl->flat.st[CT__FL_GRAD]), .numel = padded(u, fl),
                          .nparams = fl->flat.n, .params = fl->flat.p, .offsets = fl->flat.off,
                          .shard = fl->rsbuf ? fl->rsbuf : fl->gshard, .shard_numel = fl->flat.shard};
}

static ct_status hook_start(ct_strategy *s, fsdp_unit *u, int k)
{
    fsdp_flat *fl = &u->fl[k];
    if (!fl->gzero && !(fl->rsbuf = ct__wire_alloc(CT_F32, fl->flat.shard))) return CT_ENOMEM;
    ct_comm_bucket b;
    hook_bucket(s, u, k, &b);
    return ct__comm_hook_start_on(s, u->sg, &b, &fl->rs);
}

/* Starts the reduce-scatter of the unit's gradients into this rank's piece. */
static ct_status start_reduce(ct_strategy *s, fsdp_unit *u)
{
    ct_dtype dt = (ct_dtype)s->common.reduce_dtype;
    if (ct__fsdp_of(s)->off) CT_TRY(ct__fsdp_off_grads(s, u));
    for (int k = 0; k < u->nfl; k++) {
        fsdp_flat *fl = &u->fl[k];
        for (int j = 0; j < fl->flat.n; j++) ct_param_grad_sync(fl->flat.p[j]); /* unused parameters: zeros */
        if (hooked(s, u)) {
            CT_TRY(hook_start(s, u, k));
            continue;
        }
        float *g = ct_storage_ptr(fl->flat.st[CT__FL_GRAD]);
        const void *src = g;
        if (dt != CT_F32) {
            if (!(fl->wire = ct__wire_alloc(dt, padded(u, fl)))) return CT_ENOMEM;
            ct__wire_pack(dt, g, fl->wire, padded(u, fl));
            src = fl->wire;
        }
        if (u->ns == 1) continue; /* the piece is the whole flat */
        void *dst;
        if (dt == CT_F32 && fl->gzero) dst = fl->gshard; /* straight in: nothing to add to */
        else if (!(dst = fl->rsbuf = ct__wire_alloc(dt, fl->flat.shard))) return CT_ENOMEM;
        /* a sum: the loss gradient was scaled by 1/world (grad_scale) */
        CT_TRY(ct_group_reduce_scatter(u->sg, src, dst, fl->flat.shard, dt, CT_OP_SUM, &fl->rs));
    }
    u->reducing = 1;
    u->t_rs = ct_now();
    fsdp_t *f = ct__fsdp_of(s);
    ct__inflight_push(&f->q, (int)(u - f->u), 0);
    return CT_OK;
}

/* keep_low_precision_grads (MixedPrecision's): the reduced gradient pieces
 * of the bf16 weights kept at bf16 precision, rounded (to nearest even)
 * after every reduce, so after each accumulation too, as a bf16 .grad would
 * be: the optimizer steps on bf16 gradients.  The words stay f32 (the
 * optimizer reads f32 slots): no bytes are saved. */
static void round_low(float *g, int64_t n)
{
    for (int64_t i = 0; i < n; i++) g[i] = ct_bf16_to_f32(ct_f32_to_bf16(g[i]));
}

/* Waits for the unit's reduce, allreduces across replicas, adds the result
 * to the gradient piece and frees the unsharded gradients. */
static ct_status finish_reduce(ct_strategy *s, fsdp_unit *u)
{
    ct_dtype dt = hooked(s, u) ? CT_F32 : (ct_dtype)s->common.reduce_dtype;
    ct_status st = CT_OK;
    double t0 = ct_now();
    for (int k = 0; k < u->nfl; k++) {
        fsdp_flat *fl = &u->fl[k];
        if (fl->rs) {
            ct_status w = ct_work_wait(fl->rs);
            if (st == CT_OK) st = w;
            ct_work_destroy(fl->rs);
            fl->rs = NULL;
        }
        if (st == CT_OK && hooked(s, u)) {
            ct_comm_bucket b;
            hook_bucket(s, u, k, &b);
            st = ct__comm_hook_finish_on(s, u->sg, &b);
        }
        void *r = u->ns > 1 ? (fl->rsbuf ? fl->rsbuf : (void *)fl->gshard)
                            : (fl->wire ? fl->wire : ct_storage_ptr(fl->flat.st[CT__FL_GRAD]));
        if (st == CT_OK && u->rg) st = ct_group_allreduce(u->rg, r, fl->flat.shard, dt, CT_OP_SUM, NULL);
        if (st == CT_OK && r != fl->gshard) ct__wire_unpack(dt, r, fl->gshard, fl->flat.shard, !fl->gzero);
        if (st == CT_OK && fl->low && O(s)->keep_low_precision_grads) round_low(fl->gshard, fl->flat.shard);
        fl->gzero = 0;
        ct_free(fl->rsbuf);
        ct_free(fl->wire);
        fl->rsbuf = fl->wire = NULL;
    }
    double t1 = ct_now();
    s->stats.comm_wait += t1 - t0;
    s->stats.comm_total += t1 - u->t_rs;
    if (t1 - t0 > 1e-6) ct_trace_event("wait for reduce-scatter", "comm", t0, t1, 0);
    ct_trace_event("reduce-scatter", "comm", u->t_rs, t1, 1);
    if (st == CT_OK && ct__fsdp_of(s)->off) st = ct__fsdp_off_reduced(s, u);
    free_grads(u);
    u->reducing = 0;
    return st;
}

/* Finishes the reduce of the unit at place q of the queue. */
static ct_status finish_queued(ct_strategy *s, int q)
{
    fsdp_t *f = ct__fsdp_of(s);
    return finish_reduce(s, &f->u[ct__inflight_take(&f->q, q)]);
}

static ct_status finish_oldest(ct_strategy *s) { return finish_queued(s, 0); }

/* A unit that runs backward again (a module called twice) while its last
 * reduce is in flight: that reduce ends first, then its gradients start
 * from zero again and the next reduce adds to the piece. */
static ct_status finish_unit(ct_strategy *s, fsdp_unit *u)
{
    fsdp_t *f = ct__fsdp_of(s);
    int q = ct__inflight_find(&f->q, (int)(u - f->u));
    return q >= 0 ? finish_queued(s, q) : CT_OK;
}

ct_status ct__fsdp_finish_all(ct_strategy *s)
{
    ct_status st = CT_OK;
    while (ct__fsdp_of(s)->q.n) {
        ct_status w = finish_oldest(s);
        if (st == CT_OK) st = w;
    }
    return st;
}

/* ---- the unit hooks --------------------------------------------------------- */

static void record(int *order, int *n, int *seen, int idx)
{
    if (*seen) return;
    *seen = 1;
    order[(*n)++] = idx;
}

/* A checkpoint's recompute (m->recomputing: activation checkpointing runs
 * a forward again in backward) gathers a unit again; the unit the
 * recompute runs (2: its backward follows at once) stays gathered for that
 * backward, whose post-backward frees it: one gather per backward, not two.
 * Units inside it (1) free after their forward as usual (their backward
 * comes later, after the others').  No forward prefetch in a recompute: the
 * next unit in forward order had its backward already. */
static ct_status unit_hook(ct_module *m, ct_hook_kind kind, void *ud)
{
    fsdp_unit *u = ud;
    ct_strategy *s = u->s;
    fsdp_t *f = ct__fsdp_of(s);
    int idx = (int)(u - f->u);
    switch (kind) {
    case CT_HOOK_PRE_FORWARD:
        if (!f->recorded) record(f->fwd_order, &f->nfwd, &u->seen_fwd, idx);
        CT_TRY(finish_gather(s, u));
        if (O(s)->forward_prefetch && !m->recomputing) CT_TRY(prefetch(s, f->fwd_order, f->nfwd, u));
        return CT_OK;
    case CT_HOOK_POST_FORWARD:
        if (u->reshard_after_fwd && !u->is_root && m->recomputing != 2) free_params(u);
        return CT_OK;
    case CT_HOOK_PRE_BACKWARD:
        if (!f->recorded) record(f->bwd_order, &f->nbwd, &u->seen_bwd, idx);
        if (u->reducing) CT_TRY(finish_unit(s, u));
        CT_TRY(start_gather(s, u));
        if (O(s)->backward_prefetch == FSDP_PREFETCH_PRE) CT_TRY(prefetch(s, f->bwd_order, f->nbwd, u));
        CT_TRY(finish_gather(s, u));
        return alloc_grads(u);
    case CT_HOOK_POST_BACKWARD:
        if (!s->no_sync) {
            CT_TRY(start_reduce(s, u));
            /* two units' gradients in flight at most: the older one has had
             * a whole unit's backward to finish */
            while (f->q.n > 1) CT_TRY(finish_oldest(s));
        }
        free_params(u);
        if (O(s)->backward_prefetch == FSDP_PREFETCH_POST) CT_TRY(prefetch(s, f->bwd_order, f->nbwd, u));
        return CT_OK;
    default:
        return CT_OK;
    }
}

/* ---- the strategy entries ---------------------------------------------------- */

static float fsdp_grad_scale(ct_strategy *s) { return 1.0f / (float)ct_group_size(s->g); }

static ct_status fsdp_post_backward(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    for (int i = 0; i < s->nparams; i++)
        if (s->params[i]->requires_grad && ct__shards_index(&f->sh, s->params[i]) < 0)
            return ct_error(CT_ESTATE, "fsdp: parameter '%s' was frozen when the model was wrapped and is trainable "
                            "now; its unit's flat parameter only holds what was trainable then: wrap the model "
                            "after unfreezing it", s->params[i]->name);
    ct_status st = s->no_sync ? CT_OK : ct__fsdp_finish_all(s);
    ct_status w = ct__fsdp_reshard_all(s); /* and a prefetch nobody used */
    f->recorded = 1;
    return st == CT_OK ? w : st;
}

/* Synchronises the gradients accumulated under no_sync, unit by unit in
 * the same order on every rank. */
static ct_status fsdp_reduce(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    for (int i = f->nu - 1; i >= 0; i--)
        if (f->u[i].grads && !f->u[i].reducing) CT_TRY(start_reduce(s, &f->u[i]));
    return ct__fsdp_finish_all(s);
}

static void fsdp_zero_grad(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    ct__fsdp_finish_all(s);
    for (int i = 0; i < f->nu; i++) {
        if (f->u[i].grads) free_grads(&f->u[i]);
        for (int k = 0; k < f->u[i].nfl; k++) f->u[i].fl[k].gzero = 1;
    }
}

/* Pieces no backward reached since zero_grad step with zero gradients (as
 * DDP's do). */
static ct_status zero_untouched_pieces(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    CT_TRY(ct__fsdp_finish_all(s));
    for (int i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++)
            if (f->u[i].fl[k].gzero) memset(f->u[i].fl[k].gshard, 0, (size_t)f->u[i].fl[k].flat.shard * sizeof(float));
    return CT_OK;
}

ct_status ct__fsdp_reshard_all(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    ct_status st = CT_OK;
    for (int i = 0; i < f->nu; i++) {
        if (f->u[i].state == UNIT_GATHERING) {
            ct_status w = finish_gather(s, &f->u[i]);
            if (st == CT_OK) st = w;
        }
        free_params(&f->u[i]);
    }
    return st;
}

/* The pieces step; parameters gathered before the step are stale after it
 * (a root kept after an evaluation's forward, say). */
static ct_status fsdp_step(ct_strategy *s)
{
    if (ct__fsdp_of(s)->off) { /* flat by flat through the store */
        CT_TRY(ct__fsdp_finish_all(s));
        CT_TRY(ct__fsdp_off_step(s));
        return ct__fsdp_reshard_all(s);
    }
    CT_TRY(zero_untouched_pieces(s));
    CT_TRY(ct_optim_step(s->opt));
    return ct__fsdp_reshard_all(s);
}

/* The optimizer over this rank's pieces, one slot per piece of a
 * parameter, recorded in the shard table (f->sh) the state I/O reads: tp is
 * the flattened parameters in model order, the partition their pieces with
 * owners counted in each unit's shard group. */
static ct_status fsdp_build_optim(ct_strategy *s, const ct_optim_opts *oo)
{
    fsdp_t *f = ct__fsdp_of(s);
    ct__shards *z = &f->sh;
    int total = 0;
    for (int i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) total += f->u[i].fl[k].pt.n;
    size_t nt = (size_t)z->ntp + 1, nr = (size_t)total + 1;
    z->pt.ranges = ct_alloc_zeroed(sizeof *z->pt.ranges * nr, CT_MEM_OTHER);
    z->slot = ct_alloc_zeroed(sizeof *z->slot * nr, CT_MEM_OTHER);
    z->first = ct_alloc_zeroed(sizeof *z->first * nt, CT_MEM_OTHER);
    z->pg = ct_alloc_zeroed(sizeof *z->pg * nt, CT_MEM_OTHER);
    z->quiet = ct_alloc_zeroed(nt, CT_MEM_OTHER);
    int maxns = 1;
    for (int i = 0; i < f->nu; i++) maxns = f->u[i].ns > maxns ? f->u[i].ns : maxns;
    z->pt.load = ct_alloc_zeroed(sizeof *z->pt.load * (size_t)maxns, CT_MEM_OTHER);
    ct_optim_slot *sl = ct_alloc_zeroed(sizeof *sl * nr, CT_MEM_OTHER);
    if (!z->pt.ranges || !z->slot || !z->first || !z->pg || !z->quiet || !z->pt.load || !sl) {
        ct_free(sl);
        return CT_ENOMEM;
    }
    z->pt.nranks = maxns;
    int nslots = 0;
    for (int i = 0; i < z->ntp; i++) {
        ct_param *p = z->tp[i];
        fsdp_unit *u = NULL;
        fsdp_flat *fl = NULL;
        int j = -1;
        for (int a = 0; a < f->nu && j < 0; a++)
            for (int k = 0; k < f->u[a].nfl && j < 0; k++)
                for (int q = 0; q < f->u[a].fl[k].flat.n; q++)
                    if (f->u[a].fl[k].flat.p[q] == p) {
                        u = &f->u[a], fl = &u->fl[k], j = q;
                        break;
                    }
        z->pg[i] = u->sg;
        z->quiet[i] = u->rg && ct_group_rank(u->rg) != 0;
        z->first[i] = z->pt.n;
        for (int r = 0; r < fl->pt.n; r++) {
            const ct_part_range *x = &fl->pt.ranges[r];
            if (x->param != j) continue;
            int k = z->pt.n++;
            z->pt.ranges[k] = (ct_part_range){i, x->offset, x->count, x->owner};
            z->pt.load[x->owner] += x->count;
            z->slot[k] = -1;
            if (x->owner != u->srank || !x->count) continue;
            int64_t at = fl->flat.off[j] + x->offset - (int64_t)u->srank * fl->flat.shard; /* in the piece */
            z->slot[k] = nslots;
            sl[nslots++] = (ct_optim_slot){fl->master + at, fl->gshard + at, x->count, p->name, x->offset};
        }
    }
    s->opt = ct_optim_create_slots(oo, sl, nslots);
    ct_free(sl);
    return s->opt ? CT_OK : ct_last_status();
}

/* Memory and views for one flat: the piece (copied out of the parameters),
 * its gradient, and storages the parameters' tensors become views of. */
static ct_status setup_flat(fsdp_unit *u, fsdp_flat *fl)
{
    ct__flat *fa = &fl->flat;
    int64_t *numel = ct_alloc(sizeof *numel * (size_t)fa->n, CT_MEM_OTHER);
    if (!numel) return CT_ENOMEM;
    for (int j = 0; j < fa->n; j++) numel[j] = fa->p[j]->data->numel;
    ct_status st = ct_partition_init(&fl->pt, numel, fa->n, u->ns, 1);
    ct_free(numel);
    CT_TRY(st);
    ct__flat_shard(fa, u->ns, u->srank);
    fl->master = ct_alloc_zeroed((size_t)fa->shard * sizeof(float) + 64, CT_MEM_PARAM);
    fl->gshard = ct_alloc_zeroed((size_t)fa->shard * sizeof(float) + 64, CT_MEM_GRAD);
    if (!fl->master || !fl->gshard) return CT_ENOMEM;
    fl->gzero = 1;
    int64_t lo = (int64_t)u->srank * fa->shard;
    for (int j = 0; j < fa->n; j++) { /* this rank's piece of each parameter (of a shape-only one: made here) */
        int64_t a = fa->off[j], b = a + fa->p[j]->data->numel;
        int64_t x = a > lo ? a : lo, y = b < lo + fa->shard ? b : lo + fa->shard;
        if (x < y) CT_TRY(ct_param_values(fa->p[j], x - a, y - x, fl->master + (x - lo)));
    }
    /* every part absent until the unit computes; with one shard the data is the master itself (with
     * offloaded masters, their home: owned, so the store can take and bring back its memory) */
    int home = u->ns == 1 && ct__fsdp_off_masters_out(u->s);
    CT_TRY(ct__flat_storage(fa, CT__FL_DATA, CT_MEM_PARAM, home, 0, u->ns == 1 && !home ? fl->master : NULL));
    CT_TRY(ct__flat_storage(fa, CT__FL_GRAD, CT_MEM_GRAD, 0, 0, NULL));
    if (fl->low) CT_TRY(ct__flat_storage(fa, CT__FL_LOW, CT_MEM_PARAM, 0, 0, NULL));
    unsigned parts = CT__FL_BIT(CT__FL_DATA) | CT__FL_BIT(CT__FL_GRAD) | (fl->low ? CT__FL_BIT(CT__FL_LOW) : 0);
    return ct__flat_point(fa, parts, 0);
}

/* Once set-up is over on every rank: the parameters' own tensors go (keep
 * 0), or come back because set-up failed somewhere (keep 1). */
static void settle_old(fsdp_t *f, int keep)
{
    for (int i = 0; f->u && i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) {
            if (keep) ct__flat_rollback(&f->u[i].fl[k].flat);
            else ct__flat_commit(&f->u[i].fl[k].flat);
        }
}

static ct_status make_groups(ct_strategy *s, fsdp_t *f)
{
    int rank = ct_group_rank(s->g), sharding = O(s)->sharding;
    ct_group *shard = s->g, *rep = NULL, *self = NULL;
    int need_self = sharding == FSDP_NO_SHARD;
    for (int i = 0; i < f->nu; i++) need_self |= f->u[i].ignored;
    if (need_self && ct_group_size(s->g) > 1) {
        CT_TRY(ct_group_split(s->g, rank, 0, &self));
        f->own[f->nown++] = self;
    } else if (need_self) {
        self = s->g;
    }
    if (sharding == FSDP_HYBRID && ct_group_num_nodes(s->g) > 1) {
        CT_TRY(ct_group_split(s->g, ct_group_node(s->g), rank, &shard));
        f->own[f->nown++] = shard;
        CT_TRY(ct_group_split(s->g, ct_group_rank(shard), rank, &rep));
        f->own[f->nown++] = rep;
    }
    if (sharding == FSDP_NO_SHARD) shard = self;
    for (int i = 0; i < f->nu; i++) {
        fsdp_unit *u = &f->u[i];
        int ign = u->ignored || sharding == FSDP_NO_SHARD;
        u->sg = ign ? self : shard;
        u->rg = ign ? (ct_group_size(s->g) > 1 ? s->g : NULL) : rep;
        u->ns = ct_group_size(u->sg);
        u->srank = ct_group_rank(u->sg);
        u->reshard_after_fwd = sharding == FSDP_FULL_SHARD || sharding == FSDP_HYBRID;
        int g = 0;
        while (g < f->ngroups && f->groups[g] != u->sg) g++;
        if (g == f->ngroups) f->groups[f->ngroups++] = u->sg;
        u->gi = g;
    }
    return CT_OK;
}

/* Hybrid sharding cuts every node's ranks the same way: the pieces of one
 * node must line up with the pieces of every other. */
static ct_status check_nodes(ct_strategy *s)
{
    int size = ct_group_size(s->g), mine = ct_group_local_size(s->g);
    int *all = ct_alloc(sizeof *all * (size_t)size, CT_MEM_OTHER);
    if (!all) return CT_ENOMEM;
    ct_status st = ct_group_allgather(s->g, &mine, all, 1, CT_I32, NULL);
    for (int r = 1; st == CT_OK && r < size; r++)
        if (all[r] != all[0])
            st = ct_error(CT_EINVAL, "fsdp sharding=hybrid needs the same number of ranks on every node, but "
                          "rank 0's node has %d and rank %d's has %d; start as many ranks per node everywhere "
                          "(or use sharding=full)", all[0], r, all[r]);
    ct_free(all);
    return st;
}

/* Everything but the final agreement, which fsdp_init adds. */
static ct_status setup(ct_strategy *s)
{
    CT_TRY(ct_group_check(s->g, ct__check_same_model(s)));
    if (O(s)->sync_module_states) CT_TRY(ct__broadcast_state(s, 0));
    fsdp_t *f = ct_alloc_zeroed(sizeof *f, CT_MEM_OTHER);
    if (!f) return CT_ENOMEM;
    s->priv = f;
    ct__shards *z = &f->sh;
    for (int i = 0; i < s->nparams; i++)
        if (s->params[i]->compute)
            return ct_error(CT_ESTATE, "parameter '%s' already has a compute copy: is the model wrapped by another "
                            "strategy?", s->params[i]->name);
    CT_TRY(ct__fsdp_build_units(s, f));
    CT_TRY(make_groups(s, f));
    if (O(s)->sharding == FSDP_HYBRID) CT_TRY(check_nodes(s));
    size_t nu = (size_t)f->nu + 1;
    f->fwd_order = ct_alloc(sizeof *f->fwd_order * nu, CT_MEM_OTHER);
    f->bwd_order = ct_alloc(sizeof *f->bwd_order * nu, CT_MEM_OTHER);
    z->tp = ct_alloc(sizeof *z->tp * ((size_t)s->nparams + 1), CT_MEM_OTHER);
    if (!f->fwd_order || !f->bwd_order || !z->tp) return CT_ENOMEM;
    CT_TRY(ct__inflight_init(&f->q, f->nu));
    for (int i = 0; i < f->nu; i++) f->u[i].s = s;
    CT_TRY(ct__fsdp_off_open(s));
    for (int i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) {
            CT_TRY(setup_flat(&f->u[i], &f->u[i].fl[k]));
            if (f->off) CT_TRY(ct__fsdp_off_adopt(s, &f->u[i], k));
        }
    for (int q = 0; q < s->nparams; q++) /* the flattened parameters, in model order */
        for (int i = 0; i < f->nu; i++)
            for (int k = 0; k < f->u[i].nfl; k++)
                for (int j = 0; j < f->u[i].fl[k].flat.n; j++)
                    if (f->u[i].fl[k].flat.p[j] == s->params[q]) z->tp[z->ntp++] = s->params[q];
    static const ct_hook_kind kinds[4] = {CT_HOOK_PRE_FORWARD, CT_HOOK_POST_FORWARD, CT_HOOK_PRE_BACKWARD,
                                          CT_HOOK_POST_BACKWARD};
    for (int i = 0; i < f->nu; i++) f->u[i].s = s;
    for (int i = 0; i < f->nu; i++)
        for (int k = 0; k < 4; k++)
            if (!(f->u[i].h[k] = ct_module_add_hook(f->u[i].m, kinds[k], unit_hook, &f->u[i]))) return CT_ENOMEM;
    return CT_OK;
}

static ct_status fsdp_init(ct_strategy *s)
{
    if (O(s)->keep_low_precision_grads && s->common.param_dtype == CT_F32)
        return ct_error(CT_EINVAL, "fsdp: keep_low_precision_grads=1 keeps gradients at param_dtype's precision, "
                        "which is f32 here; add param_dtype=bf16 (--mixed bf16) or leave it out");
    ct_status st = ct_group_check(s->g, setup(s));
    if (st == CT_OK) {
        ct__fsdp_of(s)->ready = 1;
        settle_old(ct__fsdp_of(s), 0);
        ct_mem_trim(); /* a whole model's own tensors, just dropped, go back to the OS, not to the cache */
    }
    return st;
}

/* Frees, and gathers nothing: the parameters leave without memory, so a
 * teardown never holds the whole model.  The explicit unwrap is to summon
 * the full parameters first (ct_strategy_summon_full_params on every rank):
 * then every parameter leaves with its full values and a zero gradient. */
static void fsdp_fini(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    if (f) {
        ct__fsdp_finish_all(s);
        ct__fsdp_off_close(s);
        if (!f->ready) settle_old(f, 1); /* set-up failed: the parameters as they were */
        int full = f->ready;
        for (int i = 0; f->u && i < f->nu; i++) full &= f->u[i].summoned && (!f->u[i].nfl || f->u[i].ns == 1 || ct__flat_resident(&f->u[i].fl[0].flat, CT__FL_DATA));
        for (int i = 0; f->u && i < f->nu; i++) {
            fsdp_unit *u = &f->u[i];
            for (int k = 0; k < 4; k++) ct_hook_remove(u->h[k]);
            for (int k = 0; k < u->nfl; k++) {
                fsdp_flat *fl = &u->fl[k];
                if (!full && ct__flat_resident(&fl->flat, CT__FL_DATA) && u->ns > 1) ct__flat_evict(&fl->flat, CT__FL_DATA);
                ct__flat_unpoint(&fl->flat, NULL, NULL);
                if (fl->ag) ct_work_wait(fl->ag), ct_work_destroy(fl->ag);
                ct_free(fl->master);
                ct_free(fl->gshard);
                ct_free(fl->send);
                ct_partition_fini(&fl->pt);
            }
        }
        ct__fsdp_free_units(f);
        for (int i = f->nown - 1; i >= 0; i--) ct_group_destroy(f->own[i]);
        ct_free(f->fwd_order);
        ct_free(f->bwd_order);
        ct__inflight_fini(&f->q);
        ct__shards_fini(&f->sh);
        ct_free(f);
        s->priv = NULL;
    }
}

/* ---- full parameters ---------------------------------------------------------- */

ct_status ct__fsdp_summon(ct_strategy *s, int writeback, int rank0_only)
{
    fsdp_t *f = ct__fsdp_of(s);
    if (writeback && rank0_only)
        return ct_error(CT_EINVAL, "summon_full_params: writeback with rank0_only is not supported (the other "
                        "ranks would have nothing to write back); drop one of them");
    CT_TRY(ct__fsdp_finish_all(s));
    for (int i = 0; i < f->nu; i++) {
        fsdp_unit *u = &f->u[i];
        if (u->state == UNIT_GATHERING) CT_TRY(finish_gather(s, u));
        for (int k = 0; k < u->nfl && u->ns > 1; k++) {
            fsdp_flat *fl = &u->fl[k];
            CT_TRY(ct_storage_alloc_data(fl->flat.st[CT__FL_DATA], 0));
            CT_TRY(ct_group_allgather(u->sg, fl->master, ct_storage_ptr(fl->flat.st[CT__FL_DATA]), fl->flat.shard, CT_F32, NULL));
            if (rank0_only && ct_group_rank(s->g) != 0) CT_TRY(ct_storage_free_data(fl->flat.st[CT__FL_DATA]));
        }
        u->summoned = 1;
        u->summon_writeback = writeback;
    }
    return CT_OK;
}

ct_status ct__fsdp_release(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    for (int i = 0; i < f->nu; i++) {
        fsdp_unit *u = &f->u[i];
        if (!u->summoned) continue;
        for (int k = 0; k < u->nfl && u->ns > 1; k++) {
            fsdp_flat *fl = &u->fl[k];
            if (u->summon_writeback && ct_storage_has_data(fl->flat.st[CT__FL_DATA]))
                memcpy(fl->master, (float *)ct_storage_ptr(fl->flat.st[CT__FL_DATA]) + (int64_t)u->srank * fl->flat.shard,
                       (size_t)fl->flat.shard * sizeof(float));
        }
        u->summoned = 0;
        u->summon_writeback = 0;
        u->state = UNIT_FULL; /* free everything, whatever was gathered before */
        free_params(u);
        for (int k = 0; k < u->nfl && u->ns > 1; k++) ct_storage_free_data(u->fl[k].flat.st[CT__FL_DATA]);
    }
    return CT_OK;
}

const ct__strategy_ops ct__fsdp_ops = {
    .kind = "fsdp",
    .replicas_share_batch = 1,
    .opts = fsdp_opt_defs,
    .nopts = (int)(sizeof fsdp_opt_defs / sizeof fsdp_opt_defs[0]),
    .opts_size = sizeof(fsdp_opts),
    .manages_compute = 1,
    .makes_params = 1,
    .takes_comm_hook = 1,
    .place = {
        .init = fsdp_init,
        .fini = fsdp_fini,
        .build_optim = fsdp_build_optim,
        .partition = ct__fsdp_partition,
        .summon = ct__fsdp_summon,
        .release = ct__fsdp_release,
        .units = ct__fsdp_units,
        .unit_params = ct__fsdp_unit_params,
        .unit_io = ct__fsdp_unit_io,
    },
    .sync = {
        .post_backward = fsdp_post_backward,
        .grad_scale = fsdp_grad_scale,
        .grad_norm = ct__fsdp_grad_norm,
        .scale_grads = ct__fsdp_scale_grads,
        .reduce = fsdp_reduce,
        .step = fsdp_step,
        .zero_grad = fsdp_zero_grad,
    },
    .state = {
        .model = ct__fsdp_model_state,
        .optim = ct__fsdp_optim_state,
        .each = ct__fsdp_each,
        .shard = ct__fsdp_shard_state,
        .local = ct__fsdp_local_state,
        .share = ct__fsdp_share,
        .load = ct__fsdp_load_state,
    },
};

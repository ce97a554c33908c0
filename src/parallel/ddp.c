/*
 * DistributedDataParallel, the way PyTorch's C++ reducer does it.
 *
 * At wrap: the model is checked to be the same on every rank, parameters
 * and buffers are broadcast from rank 0, and trainable parameters are put
 * into buckets in reverse order (the last layers' gradients are ready
 * first), a small first bucket and then bucket_cap_mb (auto: sized from
 * the gradients' bytes, ct__ddp_auto_cap).  A bucket is a flat
 * (flat.c) with only a gradient part, over shared memory: every gradient
 * becomes a view into it, so a bucket is allreduced where the gradients
 * already are: no copy.
 *
 * During backward the grad-ready hook of each parameter counts down its
 * bucket; when a bucket's last gradient is ready its allreduce starts on the
 * comm thread, buckets strictly in order, so communication overlaps the
 * rest of backward.  post_backward waits for them all (the average is done
 * by the collective).  After the first synchronised step the buckets are
 * rebuilt in the order the gradients actually became ready (rank 0's order,
 * broadcast), as PyTorch does.
 *
 * All of this is one handle (ct__ddp, internal.h) with its options passed
 * in: DDP's strategy entries at the bottom wrap it, and ZeRO-1 holds one
 * under its sharded optimizer.  A trainable set that changes between steps
 * re-buckets the same handle (ct__ddp_follow_trainable).
 */
#include <stdio.h>
#include <string.h>

#include "flat.h"

const ct__opt_def ct__ddp_opt_defs[CT__DDP_NOPTS] = {
    {"bucket_cap_mb", CT__OPT_AUTO_NUM, offsetof(ct__ddp_opts, bucket_cap_mb), "auto",
     "gradient bucket size in MiB after the first bucket (auto: 25 on one node; across nodes a "
     "sixteenth of the gradients, 1 to 25 MiB)", 0, NULL},
    {"first_bucket_mb", CT__OPT_NUM, offsetof(ct__ddp_opts, first_bucket_mb), "1",
     "first bucket in MiB (small, so the first allreduce starts early)", 0, NULL},
    {"broadcast_buffers", CT__OPT_BOOL, offsetof(ct__ddp_opts, broadcast_buffers), "1",
     "broadcast buffers (batchnorm statistics) from rank 0 before every forward", 0, NULL},
    {"find_unused_parameters", CT__OPT_BOOL, offsetof(ct__ddp_opts, find_unused_parameters), "0",
     "mark parameters of modules that did not run as ready", 0, NULL},
    {"rebuild_buckets", CT__OPT_BOOL, offsetof(ct__ddp_opts, rebuild_buckets), "1",
     "after the first step, rebuild buckets in the order gradients became ready", 0, NULL},
    {"static_graph", CT__OPT_BOOL, offsetof(ct__ddp_opts, static_graph), "0",
     "every step runs the same graph: the first step's unused parameters and bucket order hold for good "
     "(no tracking of which modules ran after it)", 0, NULL},
    /* PowerSGD (comm_hook.h, powersgd.c): PyTorch's PowerSGDState settings */
    {"powersgd_rank", CT__OPT_COUNT, offsetof(ct__ddp_opts, powersgd_rank), "0",
     "reduce buckets by PowerSGD at this rank (0: off; --grad-compress powersgd:R)", 0, NULL},
    {"powersgd_start_iter", CT__OPT_COUNT, offsetof(ct__ddp_opts, powersgd_start_iter), "1000",
     "PowerSGD: steps reduced uncompressed first (PyTorch's start_powerSGD_iter default)", 0, NULL},
    {"powersgd_min_compression_rate", CT__OPT_NUM, offsetof(ct__ddp_opts, powersgd_min_compression_rate), "2",
     "PowerSGD: compress a gradient only when its factors are this many times smaller", 0, NULL},
    {"powersgd_error_feedback", CT__OPT_BOOL, offsetof(ct__ddp_opts, powersgd_error_feedback), "1",
     "PowerSGD: add what compression lost to the next step's gradient", 0, NULL},
    {"powersgd_warm_start", CT__OPT_BOOL, offsetof(ct__ddp_opts, powersgd_warm_start), "1",
     "PowerSGD: start from the last step's Q (else a fresh random one)", 0, NULL},
    {"powersgd_seed", CT__OPT_COUNT, offsetof(ct__ddp_opts, powersgd_seed), "0",
     "PowerSGD: seed of the random Q (the same on every rank)", 0, NULL},
};


typedef struct {
    ct__flat fl;      /* the members' gradients end to end, over mem */
    float *mem;       /* from ct_group_alloc_shared: reduced in place without copies on one node */
    uint16_t *wire;   /* 16-bit copy for compressed allreduce (shared too), or NULL */
    int pending;      /* gradients not yet ready in this backward */
    ct_work *work;
    double t_start;
    double t_end;     /* set by the completion callback (comm thread) */
} bucket_t;

struct ct__ddp {
    ct_strategy *s;   /* the strategy it synchronises for (DDP, or ZeRO-1 composing it) */
    const ct__ddp_opts *o; /* its options, as the composing strategy holds them */
    ct_param **tp;    /* trainable parameters, model order (room for every parameter) */
    int ntp;
    int *bucket_of;   /* [ntp] */
    char *ready;      /* [ntp] ready in this backward */
    int *ready_order; /* [ntp] first synchronised backward's order */
    int nready;
    bucket_t *b;
    int nb;
    int next_launch;
    int synced_steps; /* synchronised backwards so far */
    int rebuilt;
    ct_hook **grad_hooks;  /* [ntp] */
    ct_hook **fwd_hooks;   /* [nmods] for find_unused_parameters */
    ct_module **mods;
    char *ran;             /* [nmods] module ran forward since the last backward */
    int nmods;
    char *unused;          /* [ntp] static_graph: got no gradient in the first step (then ran goes) */
    ct_status hook_error;
    char rebuild_error[512]; /* why the rebuild at zero_grad failed, for the next backward */
};
typedef struct ct__ddp ddp_t;

/* Trainable-parameter index, kept in the parameter's strategy slot. */
static int index_of(const ct_param *p) { return (int)(intptr_t)p->user; }

/* ---- buckets ----------------------------------------------------------- */

/* bucket_cap_mb=auto.  The last bucket holds the first layers, whose
 * gradients are ready only when backward ends, so its allreduce can hide
 * behind nothing: the step waits its whole wire time, and on a slow link
 * that is bucket bytes / link rate.  PyTorch's fixed 25 MiB makes that tail
 * up to 25 MiB long whatever the model; a sixteenth of the gradients keeps
 * it to ~6% of the gradients' wire time, which backward hides the rest of
 * when the link keeps up with it.  More, smaller buckets cost a collective's
 * latency each, hidden while the previous bucket is on the wire (two run at
 * once, engine.c), so the floor is 1 MiB, as the first bucket; the cap is
 * PyTorch's 25 MiB.  2 hosts at 1 Gbit/s, the 6 x 384 GPT (41 MiB of
 * gradients, 13 buckets instead of 3): the step's wait after backward went
 * from 217 to 35 ms (medians, bench/cluster-gpt).  On one node there is no
 * wire: the allreduce sums out of shared memory at memory speed, the tail
 * is short at any size, and each bucket costs its wake-ups of the
 * communication thread on cores backward uses, so it is PyTorch's 25 MiB:
 * the reference MLP's DDP step (bench/ddp, bf16, 2 ranks) took 41 ms with
 * 16 buckets against 36.7 with 3. */
#define AUTO_BUCKETS 16
size_t ct__ddp_auto_cap(uint64_t grad_bytes, int nodes)
{
    uint64_t lo = (uint64_t)1 << 20, hi = (uint64_t)25 << 20, c = grad_bytes / AUTO_BUCKETS;
    if (nodes <= 1) return (size_t)hi;
    return (size_t)(c < lo ? lo : c > hi ? hi : c);
}

/* Collective (the shared allocations are): every rank frees the same buckets. */
static void release_buckets(ct_group *g, bucket_t *b, int nb)
{
    for (int i = 0; i < nb; i++) {
        if (b[i].work) ct_work_wait(b[i].work);
        ct_work_destroy(b[i].work);
        ct__flat_fini(&b[i].fl);
        ct_group_free_shared(g, b[i].mem);
        ct_group_free_shared(g, b[i].wire);
    }
    ct_free(b);
}

static void free_buckets(ddp_t *d)
{
    release_buckets(d->s->g, d->b, d->nb);
    d->b = NULL;
    d->nb = 0;
}

/* Puts the trainable parameters into buckets in the given order (indices
 * into d->tp) and re-points their gradients into the bucket buffers,
 * keeping the current gradient values, or (keep_values 0: the old buckets
 * are gone and every gradient is marked zero) not. */
static ct_status build_buckets(ddp_t *d, const int *order, int keep_values)
{
    ct_strategy *s = d->s;
    int n = d->ntp;
    size_t *bytes = ct_alloc_zeroed(sizeof *bytes * (size_t)(n + 1), CT_MEM_OTHER);
    int *keys = ct_alloc_zeroed(sizeof *keys * (size_t)(n + 1), CT_MEM_OTHER);
    int *of = ct_alloc_zeroed(sizeof *of * (size_t)(n + 1), CT_MEM_OTHER);
    ct_status st = CT_OK;
    if (!bytes || !keys || !of) {
        st = CT_ENOMEM;
        goto out;
    }
    for (int k = 0; k < n; k++) {
        bytes[k] = (size_t)d->tp[order[k]]->data->numel * 4;
        keys[k] = 0; /* every gradient is f32 */
    }
    uint64_t total = 0;
    for (int k = 0; k < n; k++) total += bytes[k];
    size_t limits[2] = {(size_t)(d->o->first_bucket_mb * 1048576.0),
                        d->o->bucket_cap_mb > 0 ? (size_t)(d->o->bucket_cap_mb * 1048576.0)
                                                : ct__ddp_auto_cap(total, ct_group_num_nodes(s->g))};
    if (!limits[0]) limits[0] = 1;
    if (!limits[1]) limits[1] = 1;
    int nb;
    if ((st = ct_bucket_assign(bytes, keys, n, limits, 2, of, &nb))) goto out;
    bucket_t *nbk = ct_alloc_zeroed(sizeof *nbk * (size_t)(nb ? nb : 1), CT_MEM_OTHER);
    ct_param **members = ct_alloc(sizeof *members * (size_t)(n ? n : 1), CT_MEM_OTHER);
    if (!nbk || !members) {
        ct_free(nbk);
        ct_free(members);
        st = CT_ENOMEM;
        goto out;
    }
    /* Bucket memory comes from the group's shared-memory windows when all
     * ranks share a node, so the allreduce sums straight out of every rank's
     * bucket (no copies through MPI); same layout on every rank. */
    for (int b = 0; b < nb && st == CT_OK; b++) {
        int m = 0;
        for (int k = 0; k < n; k++)
            if (of[k] == b) members[m++] = d->tp[order[k]];
        st = ct__flat_init(&nbk[b].fl, members, m, 1, 0, 0);
        if (st == CT_OK)
            st = ct_group_alloc_shared(s->g, (size_t)nbk[b].fl.numel * 4, CT_MEM_GRAD, (void **)&nbk[b].mem);
        if (st == CT_OK) st = ct__flat_storage(&nbk[b].fl, CT__FL_GRAD, CT_MEM_GRAD, 1, 0, nbk[b].mem);
        if (st == CT_OK && (ct_dtype)s->common.reduce_dtype != CT_F32)
            st = ct_group_alloc_shared(s->g, (size_t)nbk[b].fl.numel * 2, CT_MEM_COMM, (void **)&nbk[b].wire);
    }
    ct_free(members);
    /* Re-point gradients: views into the new buffers, values kept.  The old
     * tensors stay until every bucket is pointed, so running out of memory
     * leaves the old buckets in place (found by the allocation walk). */
    int pointed = 0;
    while (st == CT_OK && pointed < nb) {
        st = ct__flat_point(&nbk[pointed].fl, CT__FL_BIT(CT__FL_GRAD), keep_values ? CT__FL_BIT(CT__FL_GRAD) : 0);
        if (st == CT_OK) pointed++;
    }
    if (st != CT_OK) {
        while (pointed > 0) ct__flat_rollback(&nbk[--pointed].fl);
        release_buckets(s->g, nbk, nb);
        goto out;
    }
    for (int b = 0; b < nb; b++) {
        ct__flat_commit(&nbk[b].fl);
        for (int j = 0; j < nbk[b].fl.n; j++) d->bucket_of[index_of(nbk[b].fl.p[j])] = b;
    }
    free_buckets(d);
    d->b = nbk;
    d->nb = nb;
    s->stats.nbuckets = nb; /* the optimizer's slots follow p->grad by themselves */
out:
    ct_free(bytes);
    ct_free(keys);
    ct_free(of);
    return st;
}

static void on_allreduce_done(ct_work *w, ct_status status, void *arg)
{
    (void)w;
    (void)status;
    bucket_t *b = arg;
    b->t_end = ct_now();
}

/* The bucket as its communication hook (comm_hook.c) gets it. */
/* The bucket as its communication hook sees it: the flat's members in the
 * order they lie. */
static ct_comm_bucket hook_bucket(const ddp_t *d, bucket_t *b)
{
    return (ct_comm_bucket){(int)(b - d->b), d->nb, b->mem, b->fl.numel, b->fl.n, b->fl.p, b->fl.off, b->wire, NULL, 0};
}

static ct_status launch(ddp_t *d, bucket_t *b)
{
    /* Only with find_unused_parameters or static_graph can a member have got
     * no gradient and still be only marked zero; every module that ran has
     * synced its own. */
    for (int j = 0; (d->ran || d->unused) && j < b->fl.n; j++) ct_param_grad_sync(b->fl.p[j]);
    b->t_start = ct_now();
    b->t_end = 0;
    ct_work_destroy(b->work);
    b->work = NULL;
    /* A sum: gradients were already scaled by 1/world (ct__ddp_grad_scale);
     * the hook (the built-in allreduce in reduce_dtype, PowerSGD, or the
     * user's) starts it. */
    ct_comm_bucket hb = hook_bucket(d, b);
    CT_TRY(ct__comm_hook_start(d->s, &hb, &b->work));
    if (!b->work) b->t_end = ct_now(); /* the hook sent nothing (local SGD) or finished at once */
    return b->work ? ct_work_on_complete(b->work, on_allreduce_done, b) : CT_OK;
}

/* Starts every bucket that is complete, strictly in bucket order. */
static ct_status launch_ready(ddp_t *d)
{
    while (d->next_launch < d->nb && d->b[d->next_launch].pending == 0)
        CT_TRY(launch(d, &d->b[d->next_launch++]));
    return CT_OK;
}

static ct_status mark_ready(ddp_t *d, int i)
{
    if (d->ready[i] && d->unused && d->unused[i] && !d->ran)
        return ct_error(CT_ESTATE, "DDP static_graph: parameter '%s' got no gradient in the first step and has "
                        "one now, so the graph changed; static_graph needs the same graph every step: drop it "
                        "(find_unused_parameters=1 tracks a graph that changes)", d->tp[i]->name);
    if (d->ready[i])
        return ct_error(CT_ESTATE, "DDP: parameter '%s' received its gradient twice in one backward "
                        "(a module called twice?); DDP reduces each gradient once per backward: give each "
                        "call its own parameter, or tie a weight used by two modules with "
                        "ct_module_share_param, which completes it once",
                        d->tp[i]->name);
    d->ready[i] = 1;
    if (d->synced_steps == 0) d->ready_order[d->nready++] = i;
    d->b[d->bucket_of[i]].pending--;
    return launch_ready(d);
}

static ct_status grad_ready_hook(ct_param *p, void *ud)
{
    ddp_t *d = ud;
    if (d->s->no_sync) return CT_OK;
    return mark_ready(d, index_of(p));
}

static ct_status ran_hook(ct_module *m, ct_hook_kind kind, void *ud)
{
    (void)kind;
    ddp_t *d = ud;
    for (int i = 0; i < d->nmods; i++)
        if (d->mods[i] == m) d->ran[i] = 1;
    return CT_OK;
}

/* ---- checks at wrap ----------------------------------------------------- */

/* Every rank must hold the same parameters (names, shapes) in the same order. */
ct_status ct__check_same_model(ct_strategy *s)
{
    int ntp = 0;
    for (int i = 0; i < s->nparams; i++) ntp += s->params[i]->requires_grad != 0;
    /* A hash chain over (name, requires_grad, shape) of every parameter. */
    uint64_t h = 0;
    for (int i = 0; i < s->nparams; i++) {
        ct_param *p = s->params[i];
        uint64_t part[3] = {h, ct_hash64(p->name, strlen(p->name)) + (uint64_t)p->requires_grad,
                            ct_hash64(p->data->shape, sizeof(int64_t) * (size_t)p->data->ndim)};
        h = ct_hash64(part, sizeof part);
    }
    int size = ct_group_size(s->g), rank = ct_group_rank(s->g);
    int64_t mine[2] = {(int64_t)(h >> 1), (int64_t)ntp};
    int64_t *all = ct_alloc_zeroed(sizeof *all * 2 * (size_t)size, CT_MEM_COMM);
    if (!all) return CT_ENOMEM;
    ct_status st = ct_group_allgather(s->g, mine, all, 2, CT_I64, NULL);
    for (int r = 1; st == CT_OK && r < size; r++)
        if (all[2 * r] != all[0] || all[2 * r + 1] != all[1])
            st = ct_error(CT_EINVAL, "%s: rank %d's model differs from rank 0's (%lld vs %lld trainable "
                          "parameters, or different names/shapes); every rank must build the same model "
                          "(this is rank %d)", s->ops->kind, r, (long long)all[2 * r + 1], (long long)all[1],
                          rank);
    ct_free(all);
    return st;
}

/* Rank 0's values everywhere.  A shape-only parameter's values are its
 * rule at its seed, so rank 0's seed is all that travels: 8 bytes, not the
 * parameter, and no rank makes what it does not hold. */
ct_status ct__broadcast_state(ct_strategy *s, int buffers_only)
{
    if (ct_group_size(s->g) == 1) return CT_OK;
    for (int pass = buffers_only; pass < 2; pass++) {
        ct_param **ps = pass ? s->buffers : s->params;
        int n = pass ? s->nbuffers : s->nparams;
        for (int i = 0; i < n; i++) {
            if (ps[i]->shape_only)
                CT_TRY(ct_group_broadcast(s->g, &ps[i]->seed, 1, CT_I64, 0, NULL));
            else
                CT_TRY(ct_group_broadcast_tensor(s->g, ps[i]->data, 0, NULL));
        }
    }
    return CT_OK;
}

/* ---- the gradient flats' life ------------------------------------------- */

/* Stops tracking which modules run (static_graph after its first step; fini). */
static void drop_tracking(ddp_t *d)
{
    for (int i = 0; d->fwd_hooks && i < d->nmods; i++) ct_hook_remove(d->fwd_hooks[i]);
    ct_free(d->fwd_hooks);
    ct_free(d->mods);
    ct_free(d->ran);
    d->fwd_hooks = NULL;
    d->mods = NULL;
    d->ran = NULL;
    d->nmods = 0;
}

/* Every parameter gets a gradient of its own again (values kept), the
 * hooks go, the buckets are freed and the counts start over: what follows
 * a changed trainable set and what fini does. */
static void untrack(ddp_t *d)
{
    for (int i = 0; i < d->nb; i++)
        if (d->b[i].work) ct_work_wait(d->b[i].work);
    for (int b = 0; b < d->nb; b++) ct__flat_unpoint(&d->b[b].fl, NULL, NULL);
    for (int i = 0; d->tp && i < d->ntp; i++) {
        ct_param *p = d->tp[i];
        if (!p) continue; /* init failed before filling the table (found by the allocation walk) */
        if (d->grad_hooks) {
            ct_hook_remove(d->grad_hooks[i]);
            d->grad_hooks[i] = NULL;
        }
        p->user = NULL;
    }
    drop_tracking(d);
    free_buckets(d);
    ct_free(d->unused);
    d->unused = NULL;
    d->ntp = d->nready = d->next_launch = d->synced_steps = d->rebuilt = 0;
    d->hook_error = CT_OK;
}

/* Buckets over the parameters that take gradients now (reverse order: last
 * layers first), their ready hooks, and the tracking find_unused_parameters
 * and static_graph need.  Collective (the buckets' shared memory). */
static ct_status track(ddp_t *d)
{
    ct_strategy *s = d->s;
    int n = 0;
    for (int i = 0; i < s->nparams; i++)
        if (s->params[i]->requires_grad) {
            s->params[i]->user = (void *)(intptr_t)n;
            d->tp[n++] = s->params[i];
        }
    d->ntp = n;
    int *order = ct_alloc_zeroed(sizeof *order * (size_t)(n + 1), CT_MEM_OTHER);
    if (!order) return CT_ENOMEM;
    for (int k = 0; k < n; k++) order[k] = n - 1 - k;
    ct_status st = build_buckets(d, order, 1);
    ct_free(order);
    for (int i = 0; st == CT_OK && i < n; i++)
        if (!(d->grad_hooks[i] = ct_param_add_hook(d->tp[i], grad_ready_hook, d))) st = CT_ENOMEM;
    if (st == CT_OK && d->o->static_graph && !(d->unused = ct_alloc_zeroed((size_t)n + 1, CT_MEM_OTHER)))
        st = CT_ENOMEM;
    /* static_graph tracks which modules ran in the first step only (post_backward drops it) */
    if (st == CT_OK && (d->o->find_unused_parameters || d->o->static_graph)) {
        st = ct_module_modules(s->model, &d->mods, &d->nmods);
        if (st == CT_OK) {
            d->ran = ct_alloc_zeroed((size_t)d->nmods + 1, CT_MEM_OTHER);
            d->fwd_hooks = ct_alloc_zeroed(sizeof *d->fwd_hooks * ((size_t)d->nmods + 1), CT_MEM_OTHER);
            if (!d->ran || !d->fwd_hooks) st = CT_ENOMEM;
        }
        for (int i = 0; st == CT_OK && i < d->nmods; i++)
            if (!(d->fwd_hooks[i] = ct_module_add_hook(d->mods[i], CT_HOOK_PRE_FORWARD, ran_hook, d)))
                st = CT_ENOMEM;
    }
    return st;
}

ct_status ct__ddp_create(ct_strategy *s, const ct__ddp_opts *o, ct__ddp **out)
{
    *out = NULL;
    ddp_t *d = ct_alloc_zeroed(sizeof *d, CT_MEM_OTHER);
    if (!d) return CT_ENOMEM;
    d->s = s;
    d->o = o;
    size_t nn = (size_t)s->nparams + 1; /* room for every parameter: the trainable set may change */
    d->tp = ct_alloc_zeroed(sizeof *d->tp * nn, CT_MEM_OTHER);
    d->bucket_of = ct_alloc_zeroed(sizeof *d->bucket_of * nn, CT_MEM_OTHER);
    d->ready = ct_alloc_zeroed(nn, CT_MEM_OTHER);
    d->ready_order = ct_alloc_zeroed(sizeof *d->ready_order * nn, CT_MEM_OTHER);
    d->grad_hooks = ct_alloc_zeroed(sizeof *d->grad_hooks * nn, CT_MEM_OTHER);
    ct_status st = CT_OK;
    if (!d->tp || !d->bucket_of || !d->ready || !d->ready_order || !d->grad_hooks) st = CT_ENOMEM;
    if (st == CT_OK) st = ct_group_check(s->g, ct__check_same_model(s));
    if (st == CT_OK) st = ct__comm_hook_setup(s, o);
    if (st == CT_OK) st = ct__broadcast_state(s, 0);
    if (st == CT_OK) st = track(d);
    if (st != CT_OK) {
        ct__ddp_destroy(d);
        return st;
    }
    *out = d;
    return CT_OK;
}

void ct__ddp_destroy(ct__ddp *d)
{
    if (!d) return;
    untrack(d);
    ct_free(d->tp);
    ct_free(d->bucket_of);
    ct_free(d->ready);
    ct_free(d->ready_order);
    ct_free(d->grad_hooks);
    ct_free(d);
}

/* The buckets are rebuilt over the new set in place: no second strategy
 * made and torn down, and the parameters are already equal on every rank
 * (nothing broadcast again). */
ct_status ct__ddp_follow_trainable(ct__ddp *d)
{
    untrack(d);
    CT_TRY(ct_group_check(d->s->g, ct__check_same_model(d->s)));
    return track(d);
}

/* ---- the synchronisation ------------------------------------------------ */

ct_status ct__ddp_pre_forward(ct__ddp *d)
{
    if (d->ran) memset(d->ran, 0, (size_t)d->nmods);
    if (d->o->broadcast_buffers && d->s->nbuffers) return ct__broadcast_state(d->s, 1);
    return CT_OK;
}

/* Rebuilds the buckets in the order gradients became ready in the first
 * synchronised backward; rank 0's order is used everywhere.  From
 * zero_grad (gradients about to be dropped) the old buckets go first, so
 * the rebuild costs no second copy of all gradient memory; from backward
 * (a caller that never zeroes, say accumulating across steps) the values
 * move over. */
static ct_status rebuild(ddp_t *d, int keep_values)
{
    d->rebuilt = 1;
    if (d->nready != d->ntp) return CT_OK; /* some gradients never became ready: keep the layout */
    CT_TRY(ct_group_broadcast(d->s->g, d->ready_order, d->ntp, CT_I32, 0, NULL));
    if (!keep_values) free_buckets(d);
    ct_status st = build_buckets(d, d->ready_order, keep_values);
    if (st == CT_OK || keep_values) return st;
    /* The old buckets are gone and the gradients still point into them (found
     * by the allocation walk): never leave them so.  Try once more (the bytes
     * were just freed); failing that, the gradients let go of the memory, and
     * the error (reported by the next backward) ends the run. */
    char why[512];
    snprintf(why, sizeof why, "%s", ct_last_error());
    if (build_buckets(d, d->ready_order, 0) != CT_OK)
        for (int i = 0; i < d->ntp; i++) {
            ct_tensor_release(d->tp[i]->grad);
            d->tp[i]->grad = NULL;
        }
    return ct_error(st, "%s", why);
}

static int rebuild_due(const ddp_t *d)
{
    return (d->o->rebuild_buckets || d->o->static_graph) && !d->rebuilt && d->synced_steps == 1;
}

/* Collective the first time after the first synchronised step (the rebuild). */
void ct__ddp_zero_grad(ct__ddp *d)
{
    ct_module_zero_grad_lazy(d->s->model);
    if (!rebuild_due(d)) return;
    ct_status st = rebuild(d, 0);
    if (st != CT_OK) { /* zero_grad returns nothing: the next backward reports it */
        d->hook_error = st;
        snprintf(d->rebuild_error, sizeof d->rebuild_error, "%s", ct_last_error());
    }
}

ct_status ct__ddp_pre_backward(ct__ddp *d)
{
    if (d->s->no_sync) return CT_OK;
    if (d->hook_error) {
        ct_status st = d->hook_error;
        d->hook_error = CT_OK;
        return ct_error(st, "DDP: rebuilding the gradient buckets at zero_grad failed: %s", d->rebuild_error);
    }
    if (rebuild_due(d)) CT_TRY(rebuild(d, 1));
    memset(d->ready, 0, (size_t)d->ntp);
    for (int b = 0; b < d->nb; b++) d->b[b].pending = d->b[b].fl.n;
    d->next_launch = 0;
    if (d->synced_steps == 0) d->nready = 0;
    if (d->ran) {
        /* Parameters of modules that did not run get no gradient: ready now. */
        for (int i = 0; i < d->ntp; i++) {
            ct_module *owner = d->tp[i]->owner;
            int ran = 0;
            for (int k = 0; k < d->nmods; k++)
                if (d->mods[k] == owner) ran = d->ran[k];
            if (d->unused) d->unused[i] = !ran; /* static_graph: found once, in the first step */
            if (!ran) CT_TRY(mark_ready(d, i));
        }
    } else if (d->unused) {
        for (int i = 0; i < d->ntp; i++)
            if (d->unused[i]) CT_TRY(mark_ready(d, i));
    }
    return CT_OK;
}

/* fairscale's reduce(): the gradients accumulated under no_sync are
 * synchronised now, as a synchronised backward would have.  Every
 * gradient is ready at once (values marked zero are cleared first). */
ct_status ct__ddp_reduce(ct__ddp *d)
{
    ct_strategy *s = d->s;
    int saved = s->no_sync;
    s->no_sync = 0;
    ct_status st = ct__ddp_pre_backward(d);
    for (int i = 0; st == CT_OK && i < d->ntp; i++) {
        if (d->ready[i]) continue;
        ct_param_grad_sync(d->tp[i]);
        st = mark_ready(d, i);
    }
    if (st == CT_OK) st = ct__ddp_post_backward(d);
    s->no_sync = saved;
    return st;
}

ct_status ct__ddp_post_backward(ct__ddp *d)
{
    ct_strategy *s = d->s;
    if (s->no_sync) return CT_OK;
    ct_status st = CT_OK;
    if (d->next_launch < d->nb) {
        char names[512] = "";
        int listed = 0;
        size_t off = 0;
        for (int i = 0; i < d->ntp && off < sizeof names - 64; i++)
            if (!d->ready[i] && listed++ < 4)
                off += (size_t)snprintf(names + off, sizeof names - off, "%s'%s'", off ? ", " : "", d->tp[i]->name);
        st = ct_error(CT_ESTATE, "DDP: parameters %s%s got no gradient in this backward, so their "
                      "buckets were never reduced; pass find_unused_parameters (--find-unused-parameters) "
                      "if some modules do not run every step", names, listed > 4 ? ", ..." : "");
    }
    double t0 = ct_now(), comm = 0;
    for (int b = 0; b < d->next_launch; b++) {
        ct_status w = d->b[b].work ? ct_work_wait(d->b[b].work) : CT_OK; /* a hook may finish at once */
        if (st == CT_OK) st = w;
    }
    double t1 = ct_now();
    if (st != CT_OK) return st;
    for (int b = 0; b < d->nb; b++) {
        bucket_t *bk = &d->b[b];
        double end = bk->t_end > 0 ? bk->t_end : t1;
        comm += end - bk->t_start;
        ct_trace_event("allreduce", "comm", bk->t_start, end, 1);
        ct_comm_bucket hb = hook_bucket(d, bk);
        CT_TRY(ct__comm_hook_finish(s, &hb));
    }
    if (d->nb) ct_trace_event("wait for allreduce", "comm", t0, t1, 0);
    s->stats.comm_wait += t1 - t0;
    s->stats.comm_total += comm;
    d->synced_steps++;
    if (d->unused) drop_tracking(d); /* static_graph: the first step said which parameters go unused */
    return CT_OK;
}

/* The average over ranks is folded into the loss gradient, so the
 * collective is a plain sum with no scaling pass afterwards. */
float ct__ddp_grad_scale(ct_strategy *s) { return 1.0f / (float)ct_group_size(s->g); }

/* ---- DDP itself: the gradient flats and nothing else ---------------------- */

static ct__ddp *D(ct_strategy *s) { return s->priv; }

static ct_status ddp_init(ct_strategy *s)
{
    ct__ddp *d;
    CT_TRY(ct__ddp_create(s, s->kopts, &d));
    s->priv = d;
    return CT_OK;
}

static void ddp_fini(ct_strategy *s)
{
    ct__ddp_destroy(D(s));
    s->priv = NULL;
}

static ct_status ddp_pre_forward(ct_strategy *s) { return ct__ddp_pre_forward(D(s)); }
static ct_status ddp_pre_backward(ct_strategy *s) { return ct__ddp_pre_backward(D(s)); }
static ct_status ddp_post_backward(ct_strategy *s) { return ct__ddp_post_backward(D(s)); }
static void ddp_zero_grad(ct_strategy *s) { ct__ddp_zero_grad(D(s)); }
static ct_status ddp_reduce(ct_strategy *s) { return ct__ddp_reduce(D(s)); }

/* The optimizer, post-local SGD's averaging (local_sgd.c), then the
 * mixed-precision copies of the (averaged) parameters. */
static ct_status ddp_step(ct_strategy *s)
{
    CT_TRY(ct_optim_step(s->opt));
    CT_TRY(ct__local_sgd_average(s, s->kopts));
    return ct__mixed_refresh(s);
}

const ct__strategy_ops ct__ddp_ops = {
    .kind = "ddp",
    .replicas_share_batch = 1,
    .base_opts = ct__ddp_opt_defs, /* DDP's keys, shared with its composers */
    .nbase_opts = CT__DDP_NOPTS,
    .base_off = 0,
    .opts = ct__local_sgd_opt_defs, /* and its own: post-local SGD */
    .nopts = CT__LOCAL_SGD_NOPTS,
    .opts_size = sizeof(ct__ddp_opts),
    .takes_comm_hook = 1,
    .place = {
        .init = ddp_init,
        .fini = ddp_fini,
    },
    .sync = {
        .pre_forward = ddp_pre_forward,
        .pre_backward = ddp_pre_backward,
        .post_backward = ddp_post_backward,
        .grad_scale = ct__ddp_grad_scale,
        .zero_grad = ddp_zero_grad,
        .reduce = ddp_reduce,
        .step = ddp_step,
    },
};

/*
 * ZeRO-1 (fairscale's OSS under DDP): gradients are allreduced exactly as
 * DDP does (same buckets, same overlap with backward), but the optimizer
 * state exists only for the parameter ranges this rank owns (the partition,
 * partition.c), so optimizer memory falls as 1/N.  After the step each
 * owner broadcasts its updated ranges; the broadcasts run on the comm
 * thread while the next step begins, and a module's pre-forward hook waits
 * only for the ranges of its own parameters, so the first layers compute
 * while the last ones are still arriving (fairscale's OSS broadcasts
 * everything before returning from step).
 *
 * ZeRO-2 (fairscale's ShardedDataParallel) keeps no gradient buckets: a
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
 *
 * Checkpoints: the consolidated optimizer state is assembled on rank 0 (a
 * reduce of each full buffer, every non-owner contributing zeros), a
 * sharded one gives each parameter's whole state to the owner of its first
 * range; loading takes the owned ranges out of full tensors, so any world
 * size loads any checkpoint.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

typedef struct {
    ct__ddp_opts ddp; /* first: DDP's code reads its options from s->kopts */
    int split_params;
    int auto_refresh_trainable;
    int warn_on_trainable_params_changed;
} zero1_opts;

#define REFRESH_OPTS(type)                                                                              \
    {"auto_refresh_trainable", CT__OPT_BOOL, offsetof(type, auto_refresh_trainable), "1",              \
     "follow parameters frozen or unfrozen between steps (else that is an error)", 0},                 \
    {"warn_on_trainable_params_changed", CT__OPT_BOOL, offsetof(type, warn_on_trainable_params_changed), \
     "1", "warn when the trainable parameters change", 0}

static const ct__opt_def zero1_opt_defs[] = {
    REFRESH_OPTS(zero1_opts),
    {"split_params", CT__OPT_BOOL, offsetof(zero1_opts, split_params), "0",
     "partition the parameters laid end to end into equal pieces (exact balance) instead of whole tensors", 0},
};

typedef struct {
    int split_params;
    int auto_refresh_trainable;
    int warn_on_trainable_params_changed;
    int broadcast_buffers;
    int sync_models_at_startup;
    double reduce_buffer_mb;
} zero2_opts;

static const ct__opt_def zero2_opt_defs[] = {
    REFRESH_OPTS(zero2_opts),
    {"split_params", CT__OPT_BOOL, offsetof(zero2_opts, split_params), "0",
     "partition the parameters laid end to end into equal pieces (exact balance) instead of whole tensors", 0},
    {"broadcast_buffers", CT__OPT_BOOL, offsetof(zero2_opts, broadcast_buffers), "1",
     "broadcast buffers (batchnorm statistics) from rank 0 before every forward", 0},
    {"sync_models_at_startup", CT__OPT_BOOL, offsetof(zero2_opts, sync_models_at_startup), "1",
     "broadcast rank 0's parameters and buffers when wrapping", 0},
    {"reduce_buffer_mb", CT__OPT_NUM, offsetof(zero2_opts, reduce_buffer_mb), "8",
     "gradient MiB in flight to their owners before backward waits for the oldest", 0},
};

typedef struct {
    ct_param **tp;      /* trainable parameters, model order (DDP's indices) */
    int ntp;
    ct_partition pt;
    int *first;         /* [ntp] index of the parameter's first range in pt */
    int *slot;          /* [pt.n] optimizer slot of an owned range, else -1 */
    ct_work **work;     /* [pt.n] broadcast of the range after the step, or NULL */
    ct_hook **hooks;    /* pre-forward (and, zero2, pre-backward) hooks of the modules with parameters */
    int nhooks;
    /* zero2 */
    ct_hook **grad_hooks; /* [ntp] */
    char *trainable;    /* [ntp] requires_grad as last seen (a parameter may be frozen and unfrozen) */
    int stepped;        /* no gradients pending: the trainable set may be refreshed */
    float *gshard;      /* this rank's reduced gradients, owned ranges end to end (optimizer slots) */
    int64_t *goff;      /* [pt.n] offset of an owned range in gshard, else -1 */
    int64_t nshard;
    char *ready;        /* [ntp] reduced in this backward */
    ct_work **red;      /* [pt.n] reduce of the range to its owner */
    uint16_t **wire;    /* [ntp] 16-bit copy on the wire (reduce_dtype bf16/f16), or NULL */
    int *fifo;          /* [ntp] parameters in flight, oldest first */
    int fifo_head, fifo_len;
    size_t inflight, limit; /* bytes of gradients in flight, and the bound */
    int nready;
    double *t_start;    /* [ntp] when the parameter's reduces started */
    double *t_end;      /* [pt.n] when the range's reduce completed (comm thread) */
    double t_comm;      /* sum over parameters of (last reduce end - start) in this backward */
    double t_room;      /* time backward waited for reduces to make room (counted as comm wait) */
} zero_t;

static zero_t *Z(ct_strategy *s) { return s->ext; }
/* Index of p among the parameters trainable at wrap, or -1.  (p->user is
 * DDP's numbering, which changes when parameters are frozen.) */
static int tindex(const zero_t *z, const ct_param *p)
{
    for (int i = 0; i < z->ntp; i++)
        if (z->tp[i] == p) return i;
    return -1;
}

/* Waits for the broadcasts of trainable parameter i's ranges; then its
 * mixed-precision copy can be made. */
static ct_status wait_param(ct_strategy *s, int i)
{
    zero_t *z = Z(s);
    ct_status st = CT_OK;
    int pending = 0;
    for (int k = z->first[i]; k < z->pt.n && z->pt.ranges[k].param == i; k++) {
        if (!z->work[k]) continue;
        pending = 1;
        ct_status w = ct_work_wait(z->work[k]);
        if (st == CT_OK) st = w;
        ct_work_destroy(z->work[k]);
        z->work[k] = NULL;
    }
    if (pending && st == CT_OK) ct__mixed_refresh_param(s, z->tp[i]);
    return st;
}

static ct_status wait_all(ct_strategy *s)
{
    zero_t *z = Z(s);
    ct_status st = CT_OK;
    for (int i = 0; z && i < z->ntp; i++) {
        ct_status w = wait_param(s, i);
        if (st == CT_OK) st = w;
    }
    return st;
}

static ct_status params_arrived(ct_module *m, ct_hook_kind kind, void *ud)
{
    (void)kind;
    ct_strategy *s = ud;
    for (int j = 0; j < m->nparams; j++)
    {
        int i = tindex(Z(s), m->params[j]);
        if (i >= 0) CT_TRY(wait_param(s, i));
    }
    return CT_OK;
}

static void zero2_drain(ct_strategy *s);

static void zero_core_fini(ct_strategy *s)
{
    zero_t *z = Z(s);
    if (z) {
        wait_all(s);
        if (z->red) zero2_drain(s);
        for (int i = 0; i < z->nhooks; i++) ct_hook_remove(z->hooks[i]);
        for (int i = 0; z->grad_hooks && i < z->ntp; i++) {
            ct_hook_remove(z->grad_hooks[i]);
            /* every parameter leaves with a gradient of its own again */
            ct_param *p = z->tp[i];
            if (p->grad && !ct_tensor_data(p->grad) && ct_storage_alloc_data(p->grad->storage, 1) == CT_OK) {
                p->grad_stale = 0;
                for (int k = z->first[i]; z->gshard && k < z->pt.n && z->pt.ranges[k].param == i; k++)
                    if (z->goff[k] >= 0) /* the reduced values this rank holds */
                        memcpy((float *)ct_tensor_data(p->grad) + z->pt.ranges[k].offset, z->gshard + z->goff[k],
                               (size_t)z->pt.ranges[k].count * sizeof(float));
            }
        }
        ct_free(z->grad_hooks);
        ct_free(z->trainable);
        ct_free(z->gshard);
        ct_free(z->goff);
        ct_free(z->ready);
        ct_free(z->red);
        ct_free(z->wire);
        ct_free(z->fifo);
        ct_free(z->t_start);
        ct_free(z->t_end);
        ct_partition_fini(&z->pt);
        ct_free(z->tp);
        ct_free(z->first);
        ct_free(z->slot);
        ct_free(z->work);
        ct_free(z->hooks);
        ct_free(z);
        s->ext = NULL;
    }
}

static void zero1_fini(ct_strategy *s)
{
    zero_core_fini(s);
    ct__ddp_fini(s);
}

/* What ZeRO-1 and ZeRO-2 share: the trainable list, the partition, the
 * broadcast handles and the pre-forward hooks that wait for them. */
static ct_status zero_core_init(ct_strategy *s, int split, int number_params)
{
    zero_t *z = ct_alloc_zeroed(sizeof *z, CT_MEM_OTHER);
    if (!z) return CT_ENOMEM;
    s->ext = z;
    for (int i = 0; i < s->nparams; i++) z->ntp += s->params[i]->requires_grad != 0;
    size_t nt = (size_t)z->ntp + 1;
    z->tp = ct_alloc_zeroed(sizeof *z->tp * nt, CT_MEM_OTHER);
    int64_t *numel = ct_alloc_zeroed(sizeof *numel * nt, CT_MEM_OTHER);
    z->first = ct_alloc_zeroed(sizeof *z->first * nt, CT_MEM_OTHER);
    ct_status st = z->tp && numel && z->first ? CT_OK : CT_ENOMEM;
    for (int i = 0, n = 0; st == CT_OK && i < s->nparams; i++)
        if (s->params[i]->requires_grad) {
            z->tp[n] = s->params[i];
            (void)number_params;
            numel[n++] = s->params[i]->data->numel;
        }
    if (st == CT_OK && !(z->trainable = ct_alloc_zeroed(nt, CT_MEM_OTHER))) st = CT_ENOMEM;
    for (int i = 0; st == CT_OK && i < z->ntp; i++) z->trainable[i] = 1;
    z->stepped = 1;
    if (st == CT_OK) st = ct_partition_init(&z->pt, numel, z->ntp, ct_group_size(s->g), split);
    ct_free(numel);
    if (st == CT_OK) {
        size_t nr = (size_t)z->pt.n + 1;
        z->slot = ct_alloc_zeroed(sizeof *z->slot * nr, CT_MEM_OTHER);
        z->work = ct_alloc_zeroed(sizeof *z->work * nr, CT_MEM_OTHER);
        if (!z->slot || !z->work) st = CT_ENOMEM;
    }
    for (int k = z->pt.n - 1; st == CT_OK && k >= 0; k--) z->first[z->pt.ranges[k].param] = k;
    ct_module **mods = NULL;
    int nmods = 0;
    if (st == CT_OK) st = ct_module_modules(s->model, &mods, &nmods);
    if (st == CT_OK && !(z->hooks = ct_alloc_zeroed(sizeof *z->hooks * (size_t)(nmods + 1), CT_MEM_OTHER)))
        st = CT_ENOMEM;
    for (int i = 0; st == CT_OK && i < nmods; i++) {
        if (!mods[i]->nparams) continue;
        if (!(z->hooks[z->nhooks++] = ct_module_add_hook(mods[i], CT_HOOK_PRE_FORWARD, params_arrived, s)))
            st = CT_ENOMEM;
    }
    ct_free(mods);
    return st;
}

/* fairscale's auto_refresh_trainable: parameters frozen (requires_grad = 0)
 * or unfrozen again between steps.  The partition and the optimizer state
 * stay (a frozen parameter keeps its state and, its gradient being zero,
 * is stepped as a plain optimizer steps it); what changes is which
 * gradients are reduced: zero1 rebuilds DDP's buckets over the trainable
 * ones, zero2 expects fewer.  Returns 1 in *changed if anything did. */
static ct_status refresh_trainable(ct_strategy *s, int auto_refresh, int warn, int *changed)
{
    zero_t *z = Z(s);
    int frozen = 0, thawed = 0;
    *changed = 0;
    for (int i = 0; i < z->ntp; i++) {
        int now = z->tp[i]->requires_grad != 0;
        frozen += z->trainable[i] && !now;
        thawed += !z->trainable[i] && now;
    }
    for (int i = 0; i < s->nparams; i++)
        if (s->params[i]->requires_grad && !s->params[i]->is_buffer && tindex(z, s->params[i]) < 0)
            return ct_error(CT_EINVAL, "%s: parameter '%s' was frozen when the model was wrapped and is trainable "
                            "now; the partition only holds what was trainable then: wrap the model after "
                            "unfreezing it", s->ops->kind, s->params[i]->name);
    if (!frozen && !thawed) return CT_OK;
    if (!auto_refresh)
        return ct_error(CT_ESTATE, "%s: %d parameters were frozen and %d unfrozen since the last step; pass "
                        "auto_refresh_trainable=1 to follow such changes", s->ops->kind, frozen, thawed);
    if (warn && ct_group_rank(s->g) == 0)
        ct_log(CT_LOG_WARN, "%s: %d parameters frozen and %d unfrozen since the last step; following the change "
               "(warn_on_trainable_params_changed=0 silences this)", s->ops->kind, frozen, thawed);
    for (int i = 0; i < z->ntp; i++) z->trainable[i] = z->tp[i]->requires_grad != 0;
    *changed = 1;
    return CT_OK;
}

static ct_status zero1_init(ct_strategy *s)
{
    CT_TRY(ct__ddp_init(s));
    return zero_core_init(s, ((const zero1_opts *)s->kopts)->split_params, 0);
}

/* Before the first forward of a step: a changed trainable set rebuilds
 * DDP's buckets over the parameters that now take gradients (collective:
 * every rank froze the same ones, or DDP's model check says which differs). */
static ct_status zero1_pre_forward(ct_strategy *s)
{
    zero_t *z = Z(s);
    const zero1_opts *o = s->kopts;
    if (z->stepped) {
        int changed;
        z->stepped = 0;
        CT_TRY(refresh_trainable(s, o->auto_refresh_trainable, o->warn_on_trainable_params_changed, &changed));
        if (changed) {
            CT_TRY(wait_all(s));
            ct__ddp_fini(s);
            CT_TRY(ct__ddp_init(s));
        }
    }
    return ct__ddp_pre_forward(s);
}

/* The optimizer over this rank's ranges only: its state is 1/N of DDP's. */
static ct_status zero_build_optim(ct_strategy *s, const ct_optim_opts *oo)
{
    zero_t *z = Z(s);
    int rank = ct_group_rank(s->g), n = 0;
    ct_optim_range *r = ct_alloc_zeroed(sizeof *r * (size_t)(z->pt.n + 1), CT_MEM_OTHER);
    if (!r) return CT_ENOMEM;
    for (int k = 0; k < z->pt.n; k++) {
        const ct_part_range *x = &z->pt.ranges[k];
        z->slot[k] = x->owner == rank ? n : -1;
        if (x->owner == rank) r[n++] = (ct_optim_range){z->tp[x->param], x->offset, x->count};
    }
    s->opt = ct_optim_create_ranges(oo, r, n);
    ct_free(r);
    return s->opt ? CT_OK : (ct_status)CT_EINVAL;
}

/* Before the optimizer writes the owned ranges: the last broadcasts are
 * done (forward hooks waited for all but unused modules' parameters). */
static ct_status zero_pre_step(ct_strategy *s) { return wait_all(s); }

/* ZeRO-2's optimizer steps the owned ranges from the gradient shard; the
 * parameters do not move under it, so the slots point straight at them. */
static ct_status zero2_build_optim(ct_strategy *s, const ct_optim_opts *oo)
{
    zero_t *z = Z(s);
    int n = 0;
    ct_optim_slot *sl = ct_alloc_zeroed(sizeof *sl * (size_t)(z->pt.n + 1), CT_MEM_OTHER);
    if (!sl) return CT_ENOMEM;
    for (int k = 0; k < z->pt.n; k++) {
        const ct_part_range *x = &z->pt.ranges[k];
        z->slot[k] = z->goff[k] >= 0 ? n : -1;
        if (z->goff[k] < 0) continue;
        ct_param *p = z->tp[x->param];
        sl[n++] = (ct_optim_slot){(float *)ct_tensor_data(p->data) + x->offset, z->gshard + z->goff[k], x->count,
                                  p->name, x->offset};
    }
    s->opt = ct_optim_create_slots(oo, sl, n);
    ct_free(sl);
    return s->opt ? CT_OK : (ct_status)CT_EINVAL;
}

/* Each owner sends its updated ranges; nobody waits here. */
static ct_status zero_post_step(ct_strategy *s)
{
    zero_t *z = Z(s);
    z->stepped = 1;
    if (ct_group_size(s->g) == 1) return ct__mixed_refresh(s);
    for (int k = 0; k < z->pt.n; k++) {
        const ct_part_range *x = &z->pt.ranges[k];
        if (!x->count) continue;
        float *p = (float *)ct_tensor_data(z->tp[x->param]->data) + x->offset;
        CT_TRY(ct_group_broadcast(s->g, p, x->count, CT_F32, x->owner, &z->work[k]));
    }
    return CT_OK;
}

/* ---- state ------------------------------------------------------------- */

/* State buffer names of the optimizer kind ("exp_avg", ...); returns how many. */
static int buffer_names(const ct_optim *opt, const char **names)
{
    const ct_optim_opts *o = ct_optim_get_opts(opt);
    if (o->kind == CT_OPT_ADAMW) {
        names[0] = "exp_avg";
        names[1] = "exp_avg_sq";
        return 2;
    }
    if (o->momentum != 0) {
        names[0] = "momentum_buffer";
        return 1;
    }
    return 0;
}

/* Buffer b of trainable parameter i as a full tensor on root: owners copy
 * their ranges into zeros and the ranks' buffers are summed there.  *out is
 * NULL on other ranks. */
static ct_status gather_buffer(ct_strategy *s, int i, int b, int root, ct_tensor **out)
{
    zero_t *z = Z(s);
    *out = NULL;
    ct_param *p = z->tp[i];
    ct_tensor *full = ct_tensor_create(CT_F32, p->data->ndim, p->data->shape, CT_MEM_COMM);
    if (!full) return CT_ENOMEM;
    int local_only = 1;
    for (int k = z->first[i]; k < z->pt.n && z->pt.ranges[k].param == i; k++) {
        const ct_part_range *x = &z->pt.ranges[k];
        local_only &= x->owner == root;
        if (z->slot[k] < 0) continue;
        float *bufs[CT_OPTIM_MAX_STATE];
        int nb = ct_optim_state(s->opt, z->slot[k], bufs, NULL);
        if (nb < 0) {
            ct_tensor_release(full);
            return nb;
        }
        memcpy(ct_f32(full) + x->offset, bufs[b], (size_t)x->count * sizeof(float));
    }
    ct_status st = CT_OK;
    if (!local_only) st = ct_group_reduce(s->g, ct_tensor_data(full), full->numel, CT_F32, CT_OP_SUM, root, NULL);
    if (st == CT_OK && ct_group_rank(s->g) == root) *out = full;
    else ct_tensor_release(full);
    return st;
}

static ct_status add_step(ct_strategy *s, ct_state *out)
{
    ct_tensor *step = ct_tensor_create(CT_I64, 1, (int64_t[]){1}, CT_MEM_OTHER);
    if (!step) return CT_ENOMEM;
    ((int64_t *)ct_tensor_data(step))[0] = ct_optim_get_step(s->opt);
    ct_status st = ct_state_add(out, "step", step);
    ct_tensor_release(step);
    return st;
}

/* Every parameter's state on root(i) (0: consolidated; the owner of its
 * first range: sharded), "step" on rank 0. */
static ct_status collect(ct_strategy *s, int sharded, ct_state *out)
{
    zero_t *z = Z(s);
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = buffer_names(s->opt, bn);
    char name[512];
    ct_status st = CT_OK;
    for (int i = 0; i < z->ntp && st == CT_OK; i++) {
        int root = sharded ? z->pt.ranges[z->first[i]].owner : 0;
        for (int b = 0; b < nb && st == CT_OK; b++) {
            ct_tensor *t;
            st = gather_buffer(s, i, b, root, &t);
            if (st == CT_OK && t) {
                snprintf(name, sizeof name, "%s.%s", z->tp[i]->name, bn[b]);
                st = ct_state_add(out, name, t);
            }
            ct_tensor_release(t);
        }
    }
    if (st == CT_OK && ct_group_rank(s->g) == 0) st = add_step(s, out);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

static ct_status zero_model_state(ct_strategy *s, ct_state *out)
{
    CT_TRY(wait_all(s));
    return ct__replicated_model_state(s, out);
}

static ct_status zero_optim_state(ct_strategy *s, ct_state *out) { return collect(s, 0, out); }

static ct_status zero_shard_state(ct_strategy *s, int optim, ct_state *out)
{
    if (optim) return collect(s, 1, out);
    CT_TRY(wait_all(s));
    return ct__replicated_shard_state(s, 0, out);
}

static const ct_tensor *find(const char *const *names, ct_tensor *const *ts, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], name)) return ts[i];
    return NULL;
}

/* Owned ranges out of full tensors: a checkpoint of any world size loads. */
static ct_status load_optim(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n)
{
    zero_t *z = Z(s);
    const ct_tensor *step = find(names, ts, n, "step");
    if (!step || step->dtype != CT_I64 || step->numel != 1)
        return ct_error(CT_EINVAL, "optimizer state has no I64 'step' tensor");
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = buffer_names(s->opt, bn);
    char name[512];
    for (int k = 0; k < z->pt.n; k++) {
        if (z->slot[k] < 0) continue;
        const ct_part_range *x = &z->pt.ranges[k];
        ct_param *p = z->tp[x->param];
        float *bufs[CT_OPTIM_MAX_STATE];
        int got = ct_optim_state(s->opt, z->slot[k], bufs, NULL);
        if (got < 0) return got;
        for (int b = 0; b < nb; b++) {
            snprintf(name, sizeof name, "%s.%s", p->name, bn[b]);
            const ct_tensor *src = find(names, ts, n, name);
            if (!src)
                return ct_error(CT_EINVAL, "optimizer state has no '%s' (saved with another optimizer? this run "
                                "uses %s)", name, ct_optim_name(s->opt));
            if (src->dtype != CT_F32 || src->numel != p->data->numel)
                return ct_error(CT_EINVAL, "'%s' is %s[%lld] in the checkpoint but F32[%lld] here", name,
                                ct_dtype_name(src->dtype), (long long)src->numel, (long long)p->data->numel);
            memcpy(bufs[b], (const float *)ct_tensor_data(src) + x->offset, (size_t)x->count * sizeof(float));
        }
    }
    ct_optim_set_step(s->opt, ((const int64_t *)ct_tensor_data(step))[0]);
    return CT_OK;
}

static ct_status zero_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                                 int optim)
{
    CT_TRY(wait_all(s));
    return optim ? load_optim(s, names, ts, n) : ct__replicated_load_state(s, names, ts, n, 0);
}

static const ct_partition *zero_partition(const ct_strategy *s)
{
    return s->ext ? &((const zero_t *)s->ext)->pt : NULL;
}

const ct__strategy_ops ct__zero1_ops = {
    .kind = "zero1",
    .opts = zero1_opt_defs,
    .nopts = (int)(sizeof zero1_opt_defs / sizeof zero1_opt_defs[0]),
    .base_opts = ct__ddp_opt_defs,
    .nbase_opts = CT__DDP_NOPTS,
    .opts_size = sizeof(zero1_opts),
    .refreshes_compute = 1,
    .init = zero1_init,
    .fini = zero1_fini,
    .pre_forward = zero1_pre_forward,
    .pre_backward = ct__ddp_pre_backward,
    .post_backward = ct__ddp_post_backward,
    .grad_scale = ct__ddp_grad_scale,
    .zero_grad = ct__ddp_zero_grad,
    .reduce = ct__ddp_reduce,
    .build_optim = zero_build_optim,
    .pre_step = zero_pre_step,
    .post_step = zero_post_step,
    .partition = zero_partition,
    .model_state = zero_model_state,
    .optim_state = zero_optim_state,
    .shard_state = zero_shard_state,
    .load_state = zero_load_state,
};

/* ---- ZeRO-2: gradients reduced to their owners ----------------------------- */

static const zero2_opts *O2(const ct_strategy *s) { return s->kopts; }

/* Waits for the oldest parameter in flight: its owners copy their ranges
 * of the sum into the shard, and every rank frees the gradient. */
static ct_status finish_oldest(ct_strategy *s)
{
    zero_t *z = Z(s);
    int i = z->fifo[z->fifo_head];
    z->fifo_head = (z->fifo_head + 1) % z->ntp;
    z->fifo_len--;
    ct_param *p = z->tp[i];
    ct_status st = CT_OK;
    for (int k = z->first[i]; k < z->pt.n && z->pt.ranges[k].param == i; k++) {
        if (!z->red[k]) continue;
        ct_status w = ct_work_wait(z->red[k]);
        if (st == CT_OK) st = w;
        ct_work_destroy(z->red[k]);
        z->red[k] = NULL;
        const ct_part_range *x = &z->pt.ranges[k];
        if (z->goff[k] < 0) continue;
        float *g = z->gshard + z->goff[k];
        if (!z->wire[i]) memcpy(g, (const float *)ct_tensor_data(p->grad) + x->offset, (size_t)x->count * 4);
        else if (s->common.reduce_dtype == CT_BF16) ct_bf16_to_f32_n(z->wire[i] + x->offset, g, (size_t)x->count);
        else ct_f16_to_f32_n(z->wire[i] + x->offset, g, (size_t)x->count);
    }
    double end = z->t_start[i];
    for (int k = z->first[i]; k < z->pt.n && z->pt.ranges[k].param == i; k++)
        if (z->t_end[k] > end) end = z->t_end[k];
    z->t_comm += end - z->t_start[i]; /* the callbacks ran before the waits returned */
    ct_trace_event("reduce to owners", "comm", z->t_start[i], end, 1);
    ct_free(z->wire[i]);
    z->wire[i] = NULL;
    z->inflight -= ct_tensor_bytes(p->grad);
    ct_storage_free_data(p->grad->storage);
    p->grad_stale = 1;
    return st;
}

static void zero2_drain(ct_strategy *s)
{
    while (Z(s)->fifo_len) finish_oldest(s);
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
    zero_t *z = Z(s);
    if (s->no_sync) return CT_OK;
    int i = tindex(z, p);
    if (z->ready[i])
        return ct_error(CT_ESTATE, "%s: parameter '%s' received its gradient twice in one backward (a module "
                        "called twice or a shared weight); give each use its own parameter", s->ops->kind,
                        p->name);
    z->ready[i] = 1;
    z->nready++;
    ct_dtype dt = (ct_dtype)s->common.reduce_dtype;
    void *buf = ct_tensor_data(p->grad);
    if (dt != CT_F32) {
        if (!(z->wire[i] = ct_alloc((size_t)p->grad->numel * 2, CT_MEM_COMM))) return CT_ENOMEM;
        if (dt == CT_BF16) ct_f32_to_bf16_n(buf, z->wire[i], (size_t)p->grad->numel);
        else ct_f32_to_f16_n(buf, z->wire[i], (size_t)p->grad->numel);
        buf = z->wire[i];
    }
    size_t es = ct_dtype_size(dt);
    z->t_start[i] = ct_now();
    for (int k = z->first[i]; k < z->pt.n && z->pt.ranges[k].param == i; k++) {
        const ct_part_range *x = &z->pt.ranges[k];
        if (!x->count) continue;
        /* A sum: the loss gradient was scaled by 1/world (ct__ddp_grad_scale). */
        z->t_end[k] = 0;
        CT_TRY(ct_group_reduce(s->g, (char *)buf + (size_t)x->offset * es, x->count, dt, CT_OP_SUM, x->owner,
                               &z->red[k]));
        CT_TRY(ct_work_on_complete(z->red[k], on_reduced, &z->t_end[k]));
    }
    z->fifo[(z->fifo_head + z->fifo_len) % z->ntp] = i;
    z->fifo_len++;
    z->inflight += ct_tensor_bytes(p->grad);
    return CT_OK;
}

/* A module about to run backward: its gradients need memory, after the
 * oldest reduces have made room within reduce_buffer_mb. */
static ct_status grads_needed(ct_module *m, ct_hook_kind kind, void *ud)
{
    (void)kind;
    ct_strategy *s = ud;
    zero_t *z = Z(s);
    size_t need = 0;
    for (int j = 0; j < m->nparams; j++)
        if (m->params[j]->requires_grad && !ct_tensor_data(m->params[j]->grad))
            need += ct_tensor_bytes(m->params[j]->grad);
    double t0 = ct_now();
    while (z->fifo_len && z->inflight + need > z->limit) CT_TRY(finish_oldest(s));
    double t1 = ct_now();
    if (t1 - t0 > 1e-6) {
        z->t_room += t1 - t0;
        ct_trace_event("wait for room", "comm", t0, t1, 0);
    }
    for (int j = 0; j < m->nparams; j++) {
        ct_param *p = m->params[j];
        if (!p->requires_grad || ct_tensor_data(p->grad)) continue;
        CT_TRY(ct_storage_alloc_data(p->grad->storage, 0));
        p->grad_stale = 1; /* the memory is new: the layer overwrites it */
    }
    return CT_OK;
}

static ct_status zero2_init(ct_strategy *s)
{
    const zero2_opts *o = O2(s);
    CT_TRY(ct_group_check(s->g, ct__check_same_model(s)));
    if (o->sync_models_at_startup) CT_TRY(ct__broadcast_state(s, 0));
    CT_TRY(zero_core_init(s, o->split_params, 1));
    zero_t *z = Z(s);
    size_t nt = (size_t)z->ntp + 1, nr = (size_t)z->pt.n + 1;
    z->grad_hooks = ct_alloc_zeroed(sizeof *z->grad_hooks * nt, CT_MEM_OTHER);
    z->goff = ct_alloc_zeroed(sizeof *z->goff * nr, CT_MEM_OTHER);
    z->ready = ct_alloc_zeroed(nt, CT_MEM_OTHER);
    z->red = ct_alloc_zeroed(sizeof *z->red * nr, CT_MEM_OTHER);
    z->wire = ct_alloc_zeroed(sizeof *z->wire * nt, CT_MEM_OTHER);
    z->fifo = ct_alloc_zeroed(sizeof *z->fifo * nt, CT_MEM_OTHER);
    z->t_start = ct_alloc_zeroed(sizeof *z->t_start * nt, CT_MEM_OTHER);
    z->t_end = ct_alloc_zeroed(sizeof *z->t_end * nr, CT_MEM_OTHER);
    if (!z->grad_hooks || !z->goff || !z->ready || !z->red || !z->wire || !z->fifo || !z->t_start || !z->t_end)
        return CT_ENOMEM;
    z->limit = (size_t)(o->reduce_buffer_mb * 1048576.0);
    int rank = ct_group_rank(s->g);
    for (int k = 0; k < z->pt.n; k++) {
        z->goff[k] = z->pt.ranges[k].owner == rank ? z->nshard : -1;
        if (z->goff[k] >= 0) z->nshard += z->pt.ranges[k].count;
    }
    if (!(z->gshard = ct_alloc_zeroed((size_t)z->nshard * sizeof(float) + 64, CT_MEM_GRAD))) return CT_ENOMEM;
    for (int i = 0; i < z->ntp; i++) {
        ct_param *p = z->tp[i];
        const ct_storage *gs = p->grad ? p->grad->storage : NULL;
        if (!gs || !gs->owns || gs->window || gs->refcount != 1 || p->grad->offset || gs->bytes != ct_tensor_bytes(p->grad))
            return ct_error(CT_ESTATE, "zero2: the gradient of '%s' is a view into other memory (is the model "
                            "wrapped by another strategy?)", p->name);
        if (!(z->grad_hooks[i] = ct_param_add_hook(p, grad_to_owners, s))) return CT_ENOMEM;
        /* materialised by its module's backward, freed once reduced */
        CT_TRY(ct_storage_free_data(p->grad->storage));
        p->grad_stale = 1;
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

static void zero2_fini(ct_strategy *s) { zero_core_fini(s); }

static ct_status zero2_pre_forward(ct_strategy *s)
{
    zero_t *z = Z(s);
    if (z->stepped) {
        int changed;
        z->stepped = 0;
        CT_TRY(refresh_trainable(s, O2(s)->auto_refresh_trainable, O2(s)->warn_on_trainable_params_changed,
                                 &changed));
    }
    if (O2(s)->broadcast_buffers && s->nbuffers) return ct__broadcast_state(s, 1);
    return CT_OK;
}

static ct_status zero2_pre_backward(ct_strategy *s)
{
    zero_t *z = Z(s);
    if (s->no_sync) return CT_OK;
    memset(z->ready, 0, (size_t)z->ntp);
    z->nready = 0;
    z->t_comm = 0;
    z->t_room = 0;
    return CT_OK;
}

static ct_status zero2_post_backward(ct_strategy *s)
{
    zero_t *z = Z(s);
    if (s->no_sync) return CT_OK;
    ct_status st = CT_OK;
    int expected = 0;
    for (int i = 0; i < z->ntp; i++) expected += z->trainable[i];
    if (z->nready != expected) {
        int i = 0;
        while (i + 1 < z->ntp && (z->ready[i] || !z->trainable[i])) i++;
        st = ct_error(CT_ESTATE, "zero2: parameter '%s' got no gradient in this backward, so its owner would "
                      "wait for it forever; every trainable parameter must take part in every step (freeze "
                      "it with requires_grad = 0 otherwise)", z->tp[i]->name);
    }
    double t0 = ct_now();
    while (z->fifo_len) {
        ct_status w = finish_oldest(s);
        if (st == CT_OK) st = w;
    }
    /* A frozen parameter's gradient is zero, as a plain optimizer sees it. */
    for (int k = 0; k < z->pt.n; k++)
        if (z->goff[k] >= 0 && !z->trainable[z->pt.ranges[k].param])
            memset(z->gshard + z->goff[k], 0, (size_t)z->pt.ranges[k].count * sizeof(float));
    double t1 = ct_now();
    if (z->ntp) ct_trace_event("wait for reduce", "comm", t0, t1, 0);
    /* waits inside backward for room are communication, not compute */
    s->stats.backward -= z->t_room;
    s->stats.comm_wait += t1 - t0 + z->t_room;
    s->stats.comm_total += z->t_comm;
    s->stats.nbuckets = z->ntp; /* each gradient goes to its owners as a bucket of its own */
    return st;
}

/* Gradients accumulated under no_sync go to their owners now. */
static ct_status zero2_reduce(ct_strategy *s)
{
    zero_t *z = Z(s);
    int saved = s->no_sync;
    s->no_sync = 0;
    ct_status st = zero2_pre_backward(s);
    for (int i = 0; st == CT_OK && i < z->ntp; i++) {
        ct_param *p = z->tp[i];
        if (!z->trainable[i]) continue;
        if (!ct_tensor_data(p->grad)) { /* no backward wrote it: a zero gradient */
            st = ct_storage_alloc_data(p->grad->storage, 0);
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
 * there only), combined over the group. */
static ct_status zero2_grad_norm(ct_strategy *s, double norm_type, double *norm)
{
    zero_t *z = Z(s);
    int inf = norm_type != 2.0;
    double acc = 0;
    for (int64_t j = 0; j < z->nshard; j++) {
        double a = fabs((double)z->gshard[j]);
        if (inf) acc = a > acc || isnan(a) ? a : acc;
        else acc += a * a;
    }
    float v = (float)acc;
    CT_TRY(ct_group_allreduce(s->g, &v, 1, CT_F32, inf ? CT_OP_MAX : CT_OP_SUM, NULL));
    *norm = inf ? (double)v : sqrt((double)v);
    return CT_OK;
}

static void zero2_scale_grads(ct_strategy *s, float c)
{
    zero_t *z = Z(s);
    for (int64_t j = 0; j < z->nshard; j++) z->gshard[j] *= c;
}

const ct__strategy_ops ct__zero2_ops = {
    .kind = "zero2",
    .opts = zero2_opt_defs,
    .nopts = (int)(sizeof zero2_opt_defs / sizeof zero2_opt_defs[0]),
    .opts_size = sizeof(zero2_opts),
    .refreshes_compute = 1,
    .init = zero2_init,
    .fini = zero2_fini,
    .pre_forward = zero2_pre_forward,
    .pre_backward = zero2_pre_backward,
    .post_backward = zero2_post_backward,
    .reduce = zero2_reduce,
    .grad_scale = ct__ddp_grad_scale,
    .build_optim = zero2_build_optim,
    .grad_norm = zero2_grad_norm,
    .scale_grads = zero2_scale_grads,
    .pre_step = zero_pre_step,
    .post_step = zero_post_step,
    .partition = zero_partition,
    .model_state = zero_model_state,
    .optim_state = zero_optim_state,
    .shard_state = zero_shard_state,
    .load_state = zero_load_state,
};

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
 * Checkpoints: the consolidated optimizer state is assembled on rank 0 (a
 * reduce of each full buffer, every non-owner contributing zeros), a
 * sharded one gives each parameter's whole state to the owner of its first
 * range; loading takes the owned ranges out of full tensors, so any world
 * size loads any checkpoint.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "zero.h"

typedef struct {
    ct__ddp_opts ddp; /* first: DDP's code reads its options from s->kopts */
    int split_params;
    int auto_refresh_trainable;
    int warn_on_trainable_params_changed;
    int broadcast_fp16;
} zero1_opts;

static const ct__opt_def zero1_opt_defs[] = {
    REFRESH_OPTS(zero1_opts),
    SPLIT_OPT(zero1_opts),
    BCAST16_OPT(zero1_opts),
};

ct__zero *ct__zero_of(ct_strategy *s) { return s->ext; }
/* Index of p among the parameters trainable at wrap, or -1.  (p->user is
 * DDP's numbering, which changes when parameters are frozen.) */
int ct__zero_index(const ct__zero *z, const ct_param *p)
{
    for (int i = 0; i < z->ntp; i++)
        if (z->tp[i] == p) return i;
    return -1;
}

/* Waits for the broadcasts of trainable parameter i's ranges; then its
 * mixed-precision copy can be made. */
static ct_status wait_param(ct_strategy *s, int i)
{
    ct__zero *z = ct__zero_of(s);
    ct_status st = CT_OK;
    int pending = 0;
    for (int k = z->first[i]; k < z->pt.n && z->pt.ranges[k].param == i; k++) {
        if (!z->work[k]) continue;
        pending = 1;
        ct_status w = ct_work_wait(z->work[k]);
        if (st == CT_OK) st = w;
        ct_work_destroy(z->work[k]);
        z->work[k] = NULL;
        if (z->bwire && z->bwire[k]) { /* broadcast_fp16: others take the owner's values rounded to bf16 */
            const ct_part_range *x = &z->pt.ranges[k];
            if (w == CT_OK && x->owner != ct_group_rank(s->g))
                ct__wire_unpack(CT_BF16, z->bwire[k], (float *)ct_tensor_data(z->tp[i]->data) + x->offset,
                                x->count, 0);
            ct_free(z->bwire[k]);
            z->bwire[k] = NULL;
        }
    }
    if (pending && st == CT_OK) ct__mixed_refresh_param(s, z->tp[i]);
    return st;
}

ct_status ct__zero_summon(ct_strategy *s, int writeback, int rank0_only)
{
    (void)writeback, (void)rank0_only; /* whole on every rank: they read and write it in place */
    return ct__zero_wait_all(s);
}

ct_status ct__zero_wait_all(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    ct_status st = CT_OK;
    if (!z || !z->first || !z->work || !z->pt.ranges) return CT_OK; /* init failed part-way: nothing in flight */
    for (int i = 0; i < z->ntp; i++) {
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
        int i = ct__zero_index(ct__zero_of(s), m->params[j]);
        if (i >= 0) CT_TRY(wait_param(s, i));
    }
    return CT_OK;
}

void ct__zero_core_fini(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    if (z) {
        ct__zero_wait_all(s);
        for (int i = 0; i < z->nhooks; i++) ct_hook_remove(z->hooks[i]);
        ct_free(z->trainable);
        for (int k = 0; z->bwire && k < z->pt.n; k++) ct_free(z->bwire[k]); /* a step that failed part-way */
        ct_partition_fini(&z->pt);
        ct_free(z->tp);
        ct_free(z->first);
        ct_free(z->slot);
        ct_free(z->work);
        ct_free(z->bwire);
        ct_free(z->hooks);
        ct_free(z);
        s->ext = NULL;
    }
}

static void zero1_fini(ct_strategy *s)
{
    ct__zero_core_fini(s);
    ct__ddp_fini(s);
}

/* What ZeRO-1 and ZeRO-2 share: the trainable list, the partition, the
 * broadcast handles and the pre-forward hooks that wait for them. */
ct_status ct__zero_core_init(ct_strategy *s, int split, int bcast_bf16)
{
    ct__zero *z = ct_alloc_zeroed(sizeof *z, CT_MEM_OTHER);
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
        z->bcast_bf16 = bcast_bf16;
        if (st == CT_OK && bcast_bf16 && !(z->bwire = ct_alloc_zeroed(sizeof *z->bwire * nr, CT_MEM_OTHER)))
            st = CT_ENOMEM;
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
ct_status ct__zero_refresh_trainable(ct_strategy *s, int auto_refresh, int warn, int *changed)
{
    ct__zero *z = ct__zero_of(s);
    int frozen = 0, thawed = 0;
    *changed = 0;
    for (int i = 0; i < z->ntp; i++) {
        int now = z->tp[i]->requires_grad != 0;
        frozen += z->trainable[i] && !now;
        thawed += !z->trainable[i] && now;
    }
    for (int i = 0; i < s->nparams; i++)
        if (s->params[i]->requires_grad && !s->params[i]->is_buffer && ct__zero_index(z, s->params[i]) < 0)
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
    const zero1_opts *o = s->kopts;
    return ct__zero_core_init(s, o->split_params, o->broadcast_fp16);
}

/* Before the first forward of a step: a changed trainable set rebuilds
 * DDP's buckets over the parameters that now take gradients (collective:
 * every rank froze the same ones, or DDP's model check says which differs). */
static ct_status zero1_pre_forward(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    const zero1_opts *o = s->kopts;
    if (z->stepped) {
        int changed;
        z->stepped = 0;
        CT_TRY(ct__zero_refresh_trainable(s, o->auto_refresh_trainable, o->warn_on_trainable_params_changed, &changed));
        if (changed) {
            CT_TRY(ct__zero_wait_all(s));
            ct__ddp_fini(s);
            CT_TRY(ct__ddp_init(s));
        }
    }
    return ct__ddp_pre_forward(s);
}

/* The optimizer over this rank's ranges only: its state is 1/N of DDP's. */
static ct_status zero_build_optim(ct_strategy *s, const ct_optim_opts *oo)
{
    ct__zero *z = ct__zero_of(s);
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
    return s->opt ? CT_OK : ct_last_status();
}

/* Before the optimizer writes the owned ranges the last broadcasts are done
 * (forward hooks waited for all but unused modules' parameters); after it,
 * each owner sends its updated ranges and nobody waits here. */
ct_status ct__zero_step(ct_strategy *s)
{
    ct__zero *z = ct__zero_of(s);
    CT_TRY(ct__zero_wait_all(s));
    CT_TRY(ct_optim_step(s->opt));
    z->stepped = 1;
    if (ct_group_size(s->g) == 1) return ct__mixed_refresh(s);
    for (int k = 0; k < z->pt.n; k++) {
        const ct_part_range *x = &z->pt.ranges[k];
        if (!x->count) continue;
        float *p = (float *)ct_tensor_data(z->tp[x->param]->data) + x->offset;
        if (!z->bcast_bf16) {
            CT_TRY(ct_group_broadcast(s->g, p, x->count, CT_F32, x->owner, &z->work[k]));
            continue;
        }
        /* fairscale's broadcast_fp16, in bf16 (f32's range): half the bytes on the wire, the
         * owner's f32 values untouched (its optimizer keeps stepping them) */
        if (!(z->bwire[k] = ct__wire_alloc(CT_BF16, x->count))) return CT_ENOMEM;
        if (x->owner == ct_group_rank(s->g)) ct__wire_pack(CT_BF16, p, z->bwire[k], x->count);
        CT_TRY(ct_group_broadcast(s->g, z->bwire[k], x->count, CT_BF16, x->owner, &z->work[k]));
    }
    return CT_OK;
}

/* ---- state ------------------------------------------------------------- */

static ct_group *group_of(ct_strategy *s, const ct__zero *z, int i) { return z->pg ? z->pg[i] : s->g; }

/* Owners copy their ranges into zeros and the group's buffers are summed on root. */
ct_status ct__zero_gather(ct_strategy *s, int i, int b, int root, ct_tensor **out)
{
    ct__zero *z = ct__zero_of(s);
    *out = NULL;
    ct_param *p = z->tp[i];
    ct_group *g = group_of(s, z, i);
    ct_tensor *full = ct_tensor_create(CT_F32, p->data->ndim, p->data->shape, CT_MEM_COMM);
    if (!full) return CT_ENOMEM;
    int local_only = 1;
    for (int k = z->first[i]; k < z->pt.n && z->pt.ranges[k].param == i; k++) {
        const ct_part_range *x = &z->pt.ranges[k];
        local_only &= x->owner == root;
        if (z->slot[k] < 0) continue;
        float *bufs[CT_OPTIM_MAX_STATE];
        const float *src = b < 0 ? ct_optim_slot_at(s->opt, z->slot[k])->data : NULL;
        if (b >= 0) {
            int nb = ct_optim_state(s->opt, z->slot[k], bufs, NULL);
            if (nb < 0) {
                ct_tensor_release(full);
                return nb;
            }
            src = bufs[b];
        }
        memcpy(ct_f32(full) + x->offset, src, (size_t)x->count * sizeof(float));
    }
    ct_status st = CT_OK;
    if (!local_only) st = ct_group_reduce(g, ct_tensor_data(full), full->numel, CT_F32, CT_OP_SUM, root, NULL);
    if (st == CT_OK && ct_group_rank(g) == root && !(z->quiet && z->quiet[i])) *out = full;
    else ct_tensor_release(full);
    return st;
}

ct_status ct__zero_shard_roots(ct_strategy *s, int **roots)
{
    ct__zero *z = ct__zero_of(s);
    int size = ct_group_size(s->g);
    int *order = ct_alloc(sizeof *order * (size_t)(z->ntp + 1), CT_MEM_OTHER);
    int64_t *load = ct_alloc_zeroed(sizeof *load * (size_t)size, CT_MEM_OTHER);
    *roots = ct_alloc(sizeof **roots * (size_t)(z->ntp + 1), CT_MEM_OTHER);
    if (!order || !load || !*roots) {
        ct_free(order);
        ct_free(load);
        ct_free(*roots);
        *roots = NULL;
        return CT_ENOMEM;
    }
    for (int i = 0; i < z->ntp; i++) { /* insertion by elements descending, stable */
        int j = i;
        while (j > 0 && z->tp[order[j - 1]]->data->numel < z->tp[i]->data->numel) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = i;
    }
    for (int k = 0; k < z->ntp; k++) {
        int i = order[k], gs = ct_group_size(group_of(s, z, i)), r = 0;
        for (int q = 1; q < gs && q < size; q++)
            if (load[q] < load[r]) r = q;
        load[r] += z->tp[i]->data->numel;
        (*roots)[i] = r;
    }
    ct_free(order);
    ct_free(load);
    return CT_OK;
}

int ct__zero_reports(ct_strategy *s, int i, int root)
{
    ct__zero *z = ct__zero_of(s);
    return ct_group_rank(group_of(s, z, i)) == root && !(z->quiet && z->quiet[i]);
}

ct_status ct__zero_optim_each(ct_strategy *s, const int *roots, int shapes_only, ct_state_fn fn, void *ud)
{
    ct__zero *z = ct__zero_of(s);
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = ct_optim_state_names(s->opt, bn);
    char name[512];
    ct_status st = CT_OK, fst = CT_OK; /* a failing fn stops the calls, never the collectives */
    for (int i = 0; i < z->ntp && st == CT_OK; i++) {
        int root = roots ? roots[i] : 0;
        for (int b = 0; b < nb && st == CT_OK; b++) {
            snprintf(name, sizeof name, "%s.%s", z->tp[i]->name, bn[b]);
            if (shapes_only) {
                if (fst == CT_OK && ct__zero_reports(s, i, root)) fst = ct__state_emit(fn, ud, name, z->tp[i]->data, 1);
                continue;
            }
            ct_tensor *t;
            st = ct__zero_gather(s, i, b, root, &t);
            if (st == CT_OK && t && fst == CT_OK) fst = fn(ud, name, t);
            ct_tensor_release(t);
        }
    }
    if (st == CT_OK && fst == CT_OK && ct_group_rank(s->g) == 0) fst = ct__state_emit_step(s, shapes_only, fn, ud);
    return st != CT_OK ? st : fst;
}

/* Every parameter's state on its root (0: consolidated; balanced by bytes:
 * sharded, ct__zero_shard_roots), "step" on rank 0. */
static ct_status collect(ct_strategy *s, int sharded, ct_state *out)
{
    int *roots = NULL;
    ct_status st = sharded ? ct__zero_shard_roots(s, &roots) : CT_OK;
    if (st == CT_OK) st = ct__zero_optim_each(s, roots, 0, ct__state_collect, out);
    ct_free(roots);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

ct_status ct__zero_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    if (optim) return ct__zero_optim_each(s, NULL, shapes_only, fn, ud);
    return ct__replicated_each(s, 0, shapes_only, fn, ud);
}

ct_status ct__zero_model_state(ct_strategy *s, ct_state *out)
{
    CT_TRY(ct__zero_wait_all(s));
    return ct__replicated_model_state(s, out);
}

ct_status ct__zero_optim_state(ct_strategy *s, ct_state *out) { return collect(s, 0, out); }

ct_status ct__zero_shard_state(ct_strategy *s, int optim, ct_state *out)
{
    if (optim) return collect(s, 1, out);
    CT_TRY(ct__zero_wait_all(s));
    return ct__replicated_shard_state(s, 0, out);
}

/* A piece of p (or of its optimizer buffer buf) of count floats at data,
 * named "<name>[.<buf>]@<offset>", or whole (p's shape) when it is all of it. */
static ct_status add_piece(ct_state *out, const ct_param *p, const char *buf, int64_t offset, int64_t count,
                           float *data)
{
    char full[600];
    int whole = offset == 0 && count == p->data->numel;
    snprintf(full, sizeof full, "%s%s%s", p->name, buf ? "." : "", buf ? buf : "");
    if (!whole) snprintf(full + strlen(full), sizeof full - strlen(full), "@%lld", (long long)offset);
    ct_tensor *t = whole ? ct_tensor_wrap(CT_F32, p->data->ndim, p->data->shape, data)
                         : ct_tensor_wrap(CT_F32, 1, &count, data);
    if (!t) return CT_ENOMEM;
    ct_status st = ct_state_add(out, full, t);
    ct_tensor_release(t);
    return st;
}

ct_status ct__zero_local_state(ct_strategy *s, int optim, ct_state *out)
{
    ct__zero *z = ct__zero_of(s);
    CT_TRY(ct__zero_wait_all(s));
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = optim ? ct_optim_state_names(s->opt, bn) : 1, rank = ct_group_rank(s->g);
    ct_status st = CT_OK;
    for (int k = 0; k < z->pt.n && st == CT_OK; k++) {
        const ct_part_range *x = &z->pt.ranges[k];
        if (z->slot[k] < 0 || (z->quiet && z->quiet[x->param])) continue;
        ct_param *p = z->tp[x->param];
        float *bufs[CT_OPTIM_MAX_STATE] = {ct_optim_slot_at(s->opt, z->slot[k])->data};
        if (optim) {
            int got = ct_optim_state(s->opt, z->slot[k], bufs, NULL);
            if (got < 0) st = got;
        }
        for (int b = 0; b < nb && st == CT_OK; b++)
            st = add_piece(out, p, optim ? bn[b] : NULL, x->offset, x->count, bufs[b]);
    }
    for (int i = 0; st == CT_OK && rank == 0 && !optim && i < s->nparams; i++) /* outside the partition */
        if (ct__zero_index(z, s->params[i]) < 0) st = ct_state_add(out, s->params[i]->name, s->params[i]->data);
    for (int i = 0; st == CT_OK && rank == 0 && !optim && i < s->nbuffers; i++)
        st = ct_state_add(out, s->buffers[i]->name, s->buffers[i]->data);
    if (st == CT_OK && optim && rank == 0) st = ct__state_add_step(s, out);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

/* Owned ranges out of full tensors: a checkpoint of any world size loads. */
static ct_status load_optim(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n)
{
    ct__zero *z = ct__zero_of(s);
    int64_t step;
    CT_TRY(ct__state_step(names, ts, n, &step));
    const char *bn[CT_OPTIM_MAX_STATE];
    int nb = ct_optim_state_names(s->opt, bn);
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
            const ct_tensor *src = ct__state_find(names, ts, n, name);
            if (!src)
                return ct_error(CT_EINVAL, "optimizer state has no '%s' (saved with another optimizer? this run "
                                "uses %s)", name, ct_optim_name(s->opt));
            if (src->dtype != CT_F32 || src->numel != p->data->numel)
                return ct_error(CT_EINVAL, "'%s' is %s[%lld] in the checkpoint but F32[%lld] here", name,
                                ct_dtype_name(src->dtype), (long long)src->numel, (long long)p->data->numel);
            CT_TRY(ct__load_range(s, bufs[b], src, x->offset, x->count, name)); /* only the range this rank owns */
        }
    }
    ct_optim_set_step(s->opt, step);
    return CT_OK;
}

ct_status ct__zero_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                                 int optim)
{
    CT_TRY(ct__zero_wait_all(s));
    return optim ? load_optim(s, names, ts, n) : ct__replicated_load_state(s, names, ts, n, 0);
}

const ct_partition *ct__zero_partition(const ct_strategy *s)
{
    return s->ext ? &((const ct__zero *)s->ext)->pt : NULL;
}

const ct__strategy_ops ct__zero1_ops = {
    .kind = "zero1",
    .replicas_share_batch = 1,
    .opts = zero1_opt_defs,
    .nopts = (int)(sizeof zero1_opt_defs / sizeof zero1_opt_defs[0]),
    .takes_comm_hook = 1,
    .base_opts = ct__ddp_opt_defs,
    .nbase_opts = CT__DDP_NOPTS,
    .opts_size = sizeof(zero1_opts),
    .place = {
        .init = zero1_init,
        .fini = zero1_fini,
        .build_optim = zero_build_optim,
        .partition = ct__zero_partition,
        .summon = ct__zero_summon,
    },
    .sync = {
        .pre_forward = zero1_pre_forward,
        .pre_backward = ct__ddp_pre_backward,
        .post_backward = ct__ddp_post_backward,
        .grad_scale = ct__ddp_grad_scale,
        .zero_grad = ct__ddp_zero_grad,
        .reduce = ct__ddp_reduce,
        .step = ct__zero_step,
    },
    .state = CT__ZERO_STATE_OPS,
};


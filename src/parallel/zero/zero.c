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
 * ZeRO-1 composes DDP's gradient flats through their handle (z->ddp,
 * ct__ddp_*), with its own copy of DDP's options; a parameter frozen or
 * unfrozen between steps re-buckets those flats in place.
 *
 * Checkpoints: the shard table's state I/O (shards.c), the same FSDP uses:
 * full tensors assembled on their root one at a time, owned ranges loaded
 * out of full tensors, so any world size loads any checkpoint.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "zero.h"

typedef struct {
    ct__ddp_opts ddp; /* DDP's keys (base_opts at base_off), handed to its gradient flats */
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

ct__zero *ct__zero_of(ct_strategy *s) { return s->priv; }
/* Waits for the broadcasts of trainable parameter i's ranges; then its
 * mixed-precision copy can be made. */
static ct_status wait_param(ct_strategy *s, int i)
{
    ct__zero *z = ct__zero_of(s);
    ct_status st = CT_OK;
    int pending = 0;
    for (int k = z->sh.first[i]; k < z->sh.pt.n && z->sh.pt.ranges[k].param == i; k++) {
        if (!z->work[k]) continue;
        pending = 1;
        ct_status w = ct_work_wait(z->work[k]);
        if (st == CT_OK) st = w;
        ct_work_destroy(z->work[k]);
        z->work[k] = NULL;
        if (z->bwire && z->bwire[k]) { /* broadcast_fp16: others take the owner's values rounded to bf16 */
            const ct_part_range *x = &z->sh.pt.ranges[k];
            if (w == CT_OK && x->owner != ct_group_rank(s->g))
                ct__wire_unpack(CT_BF16, z->bwire[k], (float *)ct_tensor_data(z->sh.tp[i]->data) + x->offset,
                                x->count, 0);
            ct_free(z->bwire[k]);
            z->bwire[k] = NULL;
        }
    }
    if (pending && st == CT_OK) ct__mixed_refresh_param(s, z->sh.tp[i]);
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
    if (!z || !z->sh.first || !z->work || !z->sh.pt.ranges) return CT_OK; /* init failed part-way: nothing in flight */
    for (int i = 0; i < z->sh.ntp; i++) {
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
        int i = ct__shards_index(&ct__zero_of(s)->sh, m->params[j]);
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
        for (int k = 0; z->bwire && k < z->sh.pt.n; k++) ct_free(z->bwire[k]); /* a step that failed part-way */
        ct__ddp_destroy(z->ddp); /* zero1: every gradient its own memory again */
        ct__shards_fini(&z->sh);
        ct_free(z->work);
        ct_free(z->bwire);
        ct_free(z->hooks);
        ct_free(z);
        s->priv = NULL;
    }
}

/* What ZeRO-1 and ZeRO-2 share: the trainable list, the partition, the
 * broadcast handles and the pre-forward hooks that wait for them. */
ct_status ct__zero_core_init(ct_strategy *s, int split, int bcast_bf16)
{
    ct__zero *z = ct_alloc_zeroed(sizeof *z, CT_MEM_OTHER);
    if (!z) return CT_ENOMEM;
    s->priv = z;
    for (int i = 0; i < s->nparams; i++) z->sh.ntp += s->params[i]->requires_grad != 0;
    size_t nt = (size_t)z->sh.ntp + 1;
    z->sh.tp = ct_alloc_zeroed(sizeof *z->sh.tp * nt, CT_MEM_OTHER);
    int64_t *numel = ct_alloc_zeroed(sizeof *numel * nt, CT_MEM_OTHER);
    z->sh.first = ct_alloc_zeroed(sizeof *z->sh.first * nt, CT_MEM_OTHER);
    ct_status st = z->sh.tp && numel && z->sh.first ? CT_OK : CT_ENOMEM;
    for (int i = 0, n = 0; st == CT_OK && i < s->nparams; i++)
        if (s->params[i]->requires_grad) {
            z->sh.tp[n] = s->params[i];
            numel[n++] = s->params[i]->data->numel;
        }
    if (st == CT_OK && !(z->trainable = ct_alloc_zeroed(nt, CT_MEM_OTHER))) st = CT_ENOMEM;
    for (int i = 0; st == CT_OK && i < z->sh.ntp; i++) z->trainable[i] = 1;
    z->stepped = 1;
    if (st == CT_OK) st = ct_partition_init(&z->sh.pt, numel, z->sh.ntp, ct_group_size(s->g), split);
    ct_free(numel);
    if (st == CT_OK) {
        size_t nr = (size_t)z->sh.pt.n + 1;
        z->sh.slot = ct_alloc_zeroed(sizeof *z->sh.slot * nr, CT_MEM_OTHER);
        z->work = ct_alloc_zeroed(sizeof *z->work * nr, CT_MEM_OTHER);
        if (!z->sh.slot || !z->work) st = CT_ENOMEM;
        z->bcast_bf16 = bcast_bf16;
        if (st == CT_OK && bcast_bf16 && !(z->bwire = ct_alloc_zeroed(sizeof *z->bwire * nr, CT_MEM_OTHER)))
            st = CT_ENOMEM;
    }
    for (int k = z->sh.pt.n - 1; st == CT_OK && k >= 0; k--) z->sh.first[z->sh.pt.ranges[k].param] = k;
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
    for (int i = 0; i < z->sh.ntp; i++) {
        int now = z->sh.tp[i]->requires_grad != 0;
        frozen += z->trainable[i] && !now;
        thawed += !z->trainable[i] && now;
    }
    for (int i = 0; i < s->nparams; i++)
        if (s->params[i]->requires_grad && !s->params[i]->is_buffer && ct__shards_index(&z->sh, s->params[i]) < 0)
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
    for (int i = 0; i < z->sh.ntp; i++) z->trainable[i] = z->sh.tp[i]->requires_grad != 0;
    *changed = 1;
    return CT_OK;
}

/* DDP's gradient flats with zero1's DDP options (first: their set-up is
 * collective and checks the model on every rank), then the ZeRO core over
 * the same trainable parameters, which holds them from then on. */
static ct_status zero1_init(ct_strategy *s)
{
    const zero1_opts *o = s->kopts;
    ct__ddp *d;
    CT_TRY(ct__ddp_create(s, &o->ddp, &d));
    ct_status st = ct__zero_core_init(s, o->split_params, o->broadcast_fp16);
    if (ct__zero_of(s)) ct__zero_of(s)->ddp = d; /* freed with the core (fini) */
    else ct__ddp_destroy(d);
    return st;
}

/* Before the first forward of a step: a changed trainable set re-buckets
 * DDP's flats over the parameters that now take gradients (collective:
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
            CT_TRY(ct__ddp_follow_trainable(z->ddp));
        }
    }
    return ct__ddp_pre_forward(z->ddp);
}

static ct_status zero1_pre_backward(ct_strategy *s) { return ct__ddp_pre_backward(ct__zero_of(s)->ddp); }
static ct_status zero1_post_backward(ct_strategy *s) { return ct__ddp_post_backward(ct__zero_of(s)->ddp); }
static void zero1_zero_grad(ct_strategy *s) { ct__ddp_zero_grad(ct__zero_of(s)->ddp); }
static ct_status zero1_reduce(ct_strategy *s) { return ct__ddp_reduce(ct__zero_of(s)->ddp); }

/* The optimizer over this rank's ranges only: its state is 1/N of DDP's. */
static ct_status zero_build_optim(ct_strategy *s, const ct_optim_opts *oo)
{
    ct__zero *z = ct__zero_of(s);
    int rank = ct_group_rank(s->g), n = 0;
    ct_optim_range *r = ct_alloc_zeroed(sizeof *r * (size_t)(z->sh.pt.n + 1), CT_MEM_OTHER);
    if (!r) return CT_ENOMEM;
    for (int k = 0; k < z->sh.pt.n; k++) {
        const ct_part_range *x = &z->sh.pt.ranges[k];
        z->sh.slot[k] = x->owner == rank ? n : -1;
        if (x->owner == rank) r[n++] = (ct_optim_range){z->sh.tp[x->param], x->offset, x->count};
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
    for (int k = 0; k < z->sh.pt.n; k++) {
        const ct_part_range *x = &z->sh.pt.ranges[k];
        if (!x->count) continue;
        float *p = (float *)ct_tensor_data(z->sh.tp[x->param]->data) + x->offset;
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

/* ---- state: the shard table's (shards.c), after the step's broadcasts -------- */

ct_status ct__zero_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    if (optim) return ct__shards_optim_each(s, &ct__zero_of(s)->sh, NULL, shapes_only, fn, ud);
    return ct__replicated_each(s, 0, shapes_only, fn, ud);
}

ct_status ct__zero_model_state(ct_strategy *s, ct_state *out)
{
    CT_TRY(ct__zero_wait_all(s));
    return ct__replicated_model_state(s, out);
}

ct_status ct__zero_optim_state(ct_strategy *s, ct_state *out)
{
    return ct__shards_optim_state(s, &ct__zero_of(s)->sh, 0, out);
}

ct_status ct__zero_shard_state(ct_strategy *s, int optim, ct_state *out)
{
    if (optim) return ct__shards_optim_state(s, &ct__zero_of(s)->sh, 1, out);
    CT_TRY(ct__zero_wait_all(s));
    return ct__replicated_shard_state(s, 0, out);
}

ct_status ct__zero_local_state(ct_strategy *s, int optim, ct_state *out)
{
    CT_TRY(ct__zero_wait_all(s));
    return ct__shards_local_state(s, &ct__zero_of(s)->sh, optim, out);
}

ct_status ct__zero_share(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud)
{
    const ct__shards *z = &ct__zero_of(s)->sh;
    CT_TRY(ct__zero_wait_all(s));
    if (local) return ct__shards_local_each(s, z, optim, shapes_only, fn, ud);
    if (!optim) return ct__collected_share(s, 0, 0, shapes_only, fn, ud); /* whole parameters: views */
    int *roots = NULL;
    CT_TRY(ct__shards_roots(s, z, &roots));
    ct_status st = ct__shards_optim_each(s, z, roots, shapes_only, fn, ud);
    ct_free(roots);
    return st;
}

ct_status ct__zero_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                                 int optim)
{
    CT_TRY(ct__zero_wait_all(s));
    return optim ? ct__shards_load_optim(s, &ct__zero_of(s)->sh, names, ts, n)
                 : ct__replicated_load_state(s, names, ts, n, 0);
}

const ct_partition *ct__zero_partition(const ct_strategy *s)
{
    return s->priv ? &((const ct__zero *)s->priv)->sh.pt : NULL;
}

const ct__strategy_ops ct__zero1_ops = {
    .kind = "zero1",
    .replicas_share_batch = 1,
    .opts = zero1_opt_defs,
    .nopts = (int)(sizeof zero1_opt_defs / sizeof zero1_opt_defs[0]),
    .takes_comm_hook = 1,
    .base_opts = ct__ddp_opt_defs,
    .nbase_opts = CT__DDP_NOPTS,
    .base_off = offsetof(zero1_opts, ddp),
    .opts_size = sizeof(zero1_opts),
    .place = {
        .init = zero1_init,
        .fini = ct__zero_core_fini,
        .build_optim = zero_build_optim,
        .partition = ct__zero_partition,
        .summon = ct__zero_summon,
    },
    .sync = {
        .pre_forward = zero1_pre_forward,
        .pre_backward = zero1_pre_backward,
        .post_backward = zero1_post_backward,
        .grad_scale = ct__ddp_grad_scale,
        .zero_grad = zero1_zero_grad,
        .reduce = zero1_reduce,
        .step = ct__zero_step,
    },
    .state = CT__ZERO_STATE_OPS,
};


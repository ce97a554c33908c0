/*
 * FSDP's view of the whole model from its pieces: gradient norms summed
 * over each shard group, full and sharded state dicts (one parameter at a
 * time, through the shard table's gather (shards.c), so rank 0 never holds
 * more than the model plus one parameter), loading (each rank copies its pieces out of full
 * tensors: any world size and any sharding loads any checkpoint), and the
 * public full-parameter calls.
 */
#include <math.h>
#include <string.h>

#include "fsdp.h"

/* Each shard group's pieces, combined over that group (a hybrid's replicas
 * hold the same pieces: they are counted once). */
ct_status ct__fsdp_grad_norm(ct_strategy *s, ct_norm_acc *acc)
{
    fsdp_t *f = ct__fsdp_of(s);
    if (f->off && ct__fsdp_off_grads_out(s)) return ct__fsdp_off_grad_norm(s, acc);
    for (int g = 0; g < f->ngroups; g++) {
        ct_norm_acc part = ct_norm_acc_init(acc->p);
        for (int i = 0; i < f->nu; i++) {
            if (f->u[i].gi != g) continue;
            for (int k = 0; k < f->u[i].nfl; k++) {
                if (s->clip_filter) ct__flat_shard_norm_sel(s, &f->u[i].fl[k].flat, f->u[i].fl[k].gshard, &part);
                else ct_norm_acc_f32(&part, f->u[i].fl[k].gshard, f->u[i].fl[k].flat.shard);
            }
        }
        CT_TRY(ct__norm_combine(f->groups[g], &part));
        ct_norm_acc_add(acc, part.v);
    }
    return CT_OK;
}

void ct__fsdp_scale_grads(ct_strategy *s, float k)
{
    fsdp_t *f = ct__fsdp_of(s);
    if (f->off && ct__fsdp_off_grads_out(s)) {
        ct__fsdp_off_scale(s, k);
        return;
    }
    for (int i = 0; i < f->nu; i++)
        for (int q = 0; q < f->u[i].nfl; q++) {
            fsdp_flat *fl = &f->u[i].fl[q];
            if (s->clip_filter) ct__flat_shard_scale_sel(s, &fl->flat, fl->gshard, k);
            else for (int64_t j = 0; j < fl->flat.shard; j++) fl->gshard[j] *= k;
        }
}

/* Parameters gathered one at a time to the rank that reports each (rank 0
 * for the full state, roots[i] for a sharded save), given to fn there and
 * freed, then the parameters outside every flat (frozen) and the buffers,
 * from rank 0. */
static ct_status model_each(ct_strategy *s, const int *roots, int shapes_only, ct_state_fn fn, void *ud)
{
    const ct__shards *z = &ct__fsdp_of(s)->sh;
    int rank = ct_group_rank(s->g);
    ct_status st = CT_OK, fst = CT_OK; /* a failing fn stops the calls, never the collectives */
    for (int q = 0; q < s->nparams && st == CT_OK; q++) {
        ct_param *p = s->params[q];
        int i = ct__shards_index(z, p), root = roots && i >= 0 ? roots[i] : 0;
        if (i < 0 || shapes_only) {
            if (fst == CT_OK && (i < 0 ? rank == 0 : ct__shards_reports(s, z, i, root)))
                fst = ct__state_emit(fn, ud, p->name, p->data, shapes_only);
            continue;
        }
        ct_tensor *t = NULL;
        st = ct__shards_gather(s, z, i, -1, root, &t);
        if (st == CT_OK && t && fst == CT_OK) fst = fn(ud, p->name, t);
        ct_tensor_release(t);
    }
    for (int b = 0; b < s->nbuffers && st == CT_OK && fst == CT_OK && rank == 0; b++)
        fst = ct__state_emit(fn, ud, s->buffers[b]->name, s->buffers[b]->data, shapes_only);
    return st != CT_OK ? st : fst;
}

static ct_status model_state(ct_strategy *s, int sharded, ct_state *out)
{
    int *roots = NULL;
    memset(out, 0, sizeof *out);
    ct_status st = sharded ? ct__shards_roots(s, &ct__fsdp_of(s)->sh, &roots) : CT_OK;
    if (st == CT_OK) st = model_each(s, roots, 0, ct__state_collect, out);
    ct_free(roots);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

ct_status ct__fsdp_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    return optim ? ct__shards_optim_each(s, &ct__fsdp_of(s)->sh, NULL, shapes_only, fn, ud)
                 : model_each(s, NULL, shapes_only, fn, ud);
}

ct_status ct__fsdp_share(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud)
{
    const ct__shards *z = &ct__fsdp_of(s)->sh;
    if (local) return ct__shards_local_each(s, z, optim, shapes_only, fn, ud);
    int *roots = NULL;
    CT_TRY(ct__shards_roots(s, z, &roots));
    ct_status st = optim ? ct__shards_optim_each(s, z, roots, shapes_only, fn, ud)
                         : model_each(s, roots, shapes_only, fn, ud);
    ct_free(roots);
    return st;
}

ct_status ct__fsdp_optim_state(ct_strategy *s, ct_state *out)
{
    return ct__shards_optim_state(s, &ct__fsdp_of(s)->sh, 0, out);
}

ct_status ct__fsdp_local_state(ct_strategy *s, int optim, ct_state *out)
{
    return ct__shards_local_state(s, &ct__fsdp_of(s)->sh, optim, out);
}

const ct_partition *ct__fsdp_partition(const ct_strategy *s)
{
    const fsdp_t *f = s->priv;
    return f ? &f->sh.pt : NULL;
}

ct_status ct__fsdp_model_state(ct_strategy *s, ct_state *out) { return model_state(s, 0, out); }

ct_status ct__fsdp_shard_state(ct_strategy *s, int optim, ct_state *out)
{
    return optim ? ct__shards_optim_state(s, &ct__fsdp_of(s)->sh, 1, out) : model_state(s, 1, out);
}

/* A flattened parameter's pieces on this rank come out of the full tensor;
 * anything else is whole. */
static ct_status put_pieces(ct_strategy *s, ct_param *p, const ct_tensor *src)
{
    return ct__shards_load_param(s, &ct__fsdp_of(s)->sh, p, src);
}

ct_status ct__fsdp_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n, int optim)
{
    if (optim) return ct__shards_load_optim(s, &ct__fsdp_of(s)->sh, names, ts, n);
    CT_TRY(ct__load_model_with(s, names, ts, n, put_pieces));
    return ct__fsdp_reshard_all(s); /* whatever was gathered holds the old values */
}

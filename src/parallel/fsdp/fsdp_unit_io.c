/*
 * FSDP's units one at a time (PyTorch's summon_full_params(recurse=False)
 * and its offload_to_cpu): a unit's own parameters, full, into a buffer
 * the caller owns, and the caller's values back into this rank's pieces.
 * Nothing of the strategy's stays gathered: the only transient is one
 * flat's all-gather target (padded to the shard group), so a model far
 * larger than one rank's memory can be read or changed unit by unit.
 */
#include <string.h>

#include "fsdp.h"

int ct__fsdp_units(ct_strategy *s) { return ct__fsdp_of(s)->nu; }

ct_status ct__fsdp_unit_params(ct_strategy *s, int i, ct_module **m, ct_param ***ps, int *n)
{
    fsdp_unit *u = &ct__fsdp_of(s)->u[i];
    int total = 0;
    for (int k = 0; k < u->nfl; k++) total += u->fl[k].flat.n;
    ct_param **out = ct_alloc(sizeof *out * (size_t)(total + 1), CT_MEM_OTHER);
    if (!out) return CT_ENOMEM;
    int j = 0;
    for (int k = 0; k < u->nfl; k++)
        for (int q = 0; q < u->fl[k].flat.n; q++) out[j++] = u->fl[k].flat.p[q];
    *m = u->m;
    *ps = out;
    *n = total;
    return CT_OK;
}

/* Flat fl of unit u, whole, in *full (this rank's master when the shard
 * group is one rank, else an all-gather into *tmp, which the caller frees). */
static ct_status whole_flat(const fsdp_unit *u, const fsdp_flat *fl, const float **full, float **tmp)
{
    *tmp = NULL;
    if (u->ns == 1) {
        *full = fl->master;
        return CT_OK;
    }
    float *t = ct_alloc(sizeof *t * (size_t)(fl->flat.shard * u->ns), CT_MEM_COMM);
    if (!t) return ct_error(CT_ENOMEM, "fsdp: no memory to gather a unit's %lld parameters",
                            (long long)(fl->flat.shard * u->ns));
    ct_status st = ct_group_allgather(u->sg, fl->master, t, fl->flat.shard, CT_F32, NULL);
    if (st != CT_OK) {
        ct_free(t);
        return st;
    }
    *full = *tmp = t;
    return CT_OK;
}

/* buf's values of parameter j of fl (at buf) into this rank's piece of it. */
static void write_piece(const fsdp_unit *u, fsdp_flat *fl, int j, const float *buf)
{
    int64_t lo = fl->flat.off[j], hi = lo + fl->flat.p[j]->data->numel;
    int64_t mine = (int64_t)u->srank * fl->flat.shard, end = mine + fl->flat.shard;
    int64_t a = lo > mine ? lo : mine, b = hi < end ? hi : end;
    if (a < b) memcpy(fl->master + (a - mine), buf + (a - lo), sizeof *buf * (size_t)(b - a));
}

ct_status ct__fsdp_unit_io(ct_strategy *s, int i, float *buf, int write)
{
    fsdp_t *f = ct__fsdp_of(s);
    for (int q = 0; q < f->nu; q++)
        if (f->u[q].summoned)
            return ct_error(CT_ESTATE, "fsdp: the full parameters are summoned; call "
                            "ct_strategy_release_full_params before reading or writing a unit");
    CT_TRY(ct__fsdp_finish_all(s));
    fsdp_unit *u = &f->u[i];
    int64_t base = 0;
    for (int k = 0; k < u->nfl; k++) {
        fsdp_flat *fl = &u->fl[k];
        if (write) {
            for (int j = 0; j < fl->flat.n; j++) {
                write_piece(u, fl, j, buf + base);
                base += fl->flat.p[j]->data->numel;
            }
            continue;
        }
        const float *full = NULL;
        float *tmp = NULL;
        CT_TRY(whole_flat(u, fl, &full, &tmp));
        for (int j = 0; j < fl->flat.n; j++) {
            int64_t n = fl->flat.p[j]->data->numel;
            memcpy(buf + base, full + fl->flat.off[j], sizeof *buf * (size_t)n);
            base += n;
        }
        ct_free(tmp);
    }
    /* a unit kept gathered (the root, grad_op, a prefetch) holds the old values */
    return write ? ct__fsdp_reshard_all(s) : CT_OK;
}

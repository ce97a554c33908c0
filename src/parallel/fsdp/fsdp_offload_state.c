/*
 * FSDP offload's checkpoints, summons and unit I/O, straight from the store
 * (fsdp_offload.h).  The shard table's state I/O (shards.c) reads and
 * writes each owned range where its part rests (range_io): in memory while
 * resident, else the store's file by position.  A checkpoint first applies
 * the last step's pending updates a chunk at a time (apply_streamed), then
 * a save holds one tensor (a parameter gathered, a piece) at a time and a
 * load one chunk: no unit's shard comes in.  A summon brings every flat's
 * masters in until its release; a unit's I/O that unit's.
 */
#include <math.h>
#include <string.h>

#include "fsdp_offload.h"

/* ---- checkpoints: the store's ranges a piece at a time; summons pinned ------------- */

/* Each range this rank owns, in the optimizer's slot order (the walk of
 * fsdp_build_optim): fn gets its slot, flat, offloaded parts and offset in
 * the shard. */
typedef void (*slot_fn)(ct_strategy *s, int slot, fsdp_flat *fl, off_flat *x, int64_t at, void *ud);

static void each_slot(ct_strategy *s, slot_fn fn, void *ud)
{
    fsdp_t *f = ct__fsdp_of(s);
    const ct__shards *z = &f->sh;
    int slot = 0;
    for (int t = 0; t < z->ntp; t++)
        for (int i = 0; i < f->nu; i++)
            for (int k = 0; k < f->u[i].nfl; k++) {
                fsdp_unit *u = &f->u[i];
                fsdp_flat *fl = &u->fl[k];
                for (int j = 0; j < fl->flat.n; j++) {
                    if (fl->flat.p[j] != z->tp[t]) continue;
                    for (int r = 0; r < fl->pt.n; r++) {
                        const ct_part_range *pr = &fl->pt.ranges[r];
                        if (pr->param != j || pr->owner != u->srank || !pr->count) continue;
                        int64_t at = fl->flat.off[j] + pr->offset - (int64_t)u->srank * fl->flat.shard;
                        fn(s, slot++, fl, OF(s, u, k), at, ud);
                    }
                }
            }
}

/* Where each optimizer slot's range lies: its flat and offset in the piece. */
static void note_slot(ct_strategy *s, int slot, fsdp_flat *fl, off_flat *x, int64_t at, void *ud)
{
    fsdp_off *o = OFF(s);
    (void)ud;
    o->slot_flat[slot] = fl;
    o->slot_x[slot] = x;
    o->slot_at[slot] = at;
}

/* Elements [e, e + n) of flat x's part p (the state's buffers end to end)
 * from or into buf: the part's memory while it is resident, else the
 * store's file by position (between steps, the queue drained first).
 * State never written reads as zeros. */
static ct_status part_io(fsdp_off *o, fsdp_flat *fl, off_flat *x, int p, int64_t e, int64_t n, float *buf, int write)
{
    size_t bytes = (size_t)n * sizeof(float);
    if (p == PS && x->fresh && !write) {
        memset(buf, 0, bytes);
        return CT_OK;
    }
    if (x->st[p] && x->where[p] == P_LOADING) {
        CT_TRY(ct__ostore_wait(o->store, x->tk[p]));
        x->where[p] = P_RES;
        sync_ptrs(fl, x);
    }
    float *mem = !x->st[p] ? (p == PM ? fl->master : p == PG ? fl->gshard : NULL)
               : x->where[p] == P_RES ? ct_storage_ptr(x->st[p]) : NULL;
    if (!mem) return ct__ostore_rw(o->store, write, buf, bytes, x->off[p] + (off_t)e * (off_t)sizeof(float));
    memcpy(write ? mem + e : buf, write ? buf : mem + e, bytes);
    if (write) x->dirty[p] = 1;
    return CT_OK;
}

/* The shard table's io (shards.h): owned range k's values (b < 0: the
 * masters) or state buffer b, through part_io. */
static ct_status range_io(ct_strategy *s, int k, int b, int64_t at, int64_t n, float *buf, int write)
{
    fsdp_off *o = OFF(s);
    int slot = ct__fsdp_of(s)->sh.slot[k];
    fsdp_flat *fl = o->slot_flat[slot];
    int64_t e = (b < 0 ? 0 : (int64_t)b * fl->flat.shard) + o->slot_at[slot] + at;
    return part_io(o, fl, o->slot_x[slot], b < 0 ? PM : PS, e, n, buf, write);
}

/* Elements of the piece a checkpoint's update moves at a time (1 MiB of
 * masters, gradients and AdamW state together). */
#define UPDATE_CHUNK 65536

/* Flat k of u takes its pending update as apply_update gives it, element
 * for element, but a chunk of the piece at a time between the parts and
 * one buffer (a checkpoint's: it never brings a flat's parts in whole).
 * The norm terms of a clipped gradient are summed by chunk (in double). */
static ct_status apply_streamed(ct_strategy *s, fsdp_unit *u, int k)
{
    fsdp_off *o = OFF(s);
    fsdp_flat *fl = &u->fl[k];
    off_flat *x = OF(s, u, k);
    if (!x->pend) return CT_OK;
    int64_t shard = fl->flat.shard, chunk = shard < UPDATE_CHUNK ? shard : UPDATE_CHUNK;
    float *m = ct_alloc(sizeof(float) * (size_t)chunk * (size_t)(2 + o->nstate) + 4, CT_MEM_COMM);
    if (!m) return CT_ENOMEM;
    float *g = m + chunk, *st = g + chunk;
    int scaled = !x->pend_gzero && x->st[PG] && o->pend_nscales; /* resident pieces were scaled at the clip */
    ct_norm_acc sq = ct_norm_acc_init(2.0), mx = ct_norm_acc_init(INFINITY);
    ct_status rc = CT_OK;
    for (int64_t c0 = 0; rc == CT_OK && c0 < shard; c0 += chunk) {
        int64_t n = shard - c0 < chunk ? shard - c0 : chunk;
        rc = part_io(o, fl, x, PM, c0, n, m, 0);
        if (rc == CT_OK && x->pend_gzero) memset(g, 0, (size_t)n * sizeof(float)); /* untouched since zero_grad */
        else if (rc == CT_OK) rc = part_io(o, fl, x, PG, c0, n, g, 0);
        for (int b = 0; rc == CT_OK && b < o->nstate; b++) rc = part_io(o, fl, x, PS, b * shard + c0, n, st + b * chunk, 0);
        if (rc != CT_OK) break;
        for (int q = 0; scaled && q < o->pend_nscales; q++)
            for (int64_t j = 0; j < n; j++) g[j] *= o->pend_scales[q];
        if (scaled) ct_norm_acc_f32(&sq, g, n), ct_norm_acc_f32(&mx, g, n);
        for (int r = 0; r < fl->pt.n; r++) { /* the owned ranges' parts in this chunk */
            const ct_part_range *pr = &fl->pt.ranges[r];
            if (pr->owner != u->srank || !pr->count) continue;
            int64_t at = fl->flat.off[pr->param] + pr->offset - (int64_t)u->srank * shard;
            int64_t lo = at > c0 ? at : c0, hi = at + pr->count < c0 + n ? at + pr->count : c0 + n;
            if (lo >= hi) continue;
            float *bufs[CT_OPTIM_MAX_STATE] = {0};
            for (int b = 0; b < o->nstate; b++) bufs[b] = st + b * chunk + (lo - c0);
            ct_optim_opts po;
            ct_optim_param_opts(&o->pend_o, fl->flat.p[pr->param]->name, &po);
            ct_optim_update_range(&po, m + (lo - c0), g + (lo - c0), bufs, hi - lo, o->pend_step);
        }
        rc = part_io(o, fl, x, PM, c0, n, m, 1);
        for (int b = 0; rc == CT_OK && b < o->nstate; b++) rc = part_io(o, fl, x, PS, b * shard + c0, n, st + b * chunk, 1);
        if (rc == CT_OK && scaled) rc = part_io(o, fl, x, PG, c0, n, g, 1);
    }
    ct_free(m);
    CT_TRY(rc);
    if (scaled) x->sq = sq.v, x->mx = mx.v;
    if (x->pend_gzero && !x->st[PG]) memset(fl->gshard, 0, (size_t)shard * sizeof(float)); /* as apply_update */
    x->fresh = 0;
    x->pend = 0;
    o->npend--;
    return CT_OK;
}

/* Every pending update, streamed (before a checkpoint reads or writes state). */
static ct_status flush_streamed(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    for (int i = 0; f->off->npend && i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) CT_TRY(apply_streamed(s, &f->u[i], k));
    return CT_OK;
}

/* Every flat's masters resident (a summon reads and writes them whole). */
static ct_status pin(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    CT_TRY(ct__fsdp_off_flush(s));
    for (int n = 0, i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++, n++) CT_TRY(ct__fsdp_off_have(o, &f->u[i].fl[k], &o->fl[n], PM, 0));
    o->pinned = 1;
    return CT_OK;
}

/* Lets the masters go (written when a writeback changed them). */
static ct_status unpin(ct_strategy *s, int changed)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    o->pinned = 0;
    ct_status st = CT_OK;
    for (int n = 0, i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++, n++) {
            fsdp_unit *u = &f->u[i];
            if (changed) o->fl[n].dirty[PM] = 1;
            ct_status w = CT_OK;
            if (u->state == UNIT_SHARDED || u->ns > 1 || u->fl[k].low) w = ct__fsdp_off_send_out(o, &u->fl[k], &o->fl[n], PM);
            if (st == CT_OK) st = w;
        }
    if (st == CT_OK) st = ct__ostore_drain(o->store);
    return st;
}

/* The state entries read and write through range_io once every pending
 * update is applied (streamed): a save holds one tensor (a parameter
 * gathered, a piece) at a time and a load a chunk, never a unit's shard. */
static ct_status wrap_model(ct_strategy *s, ct_state *out)
{
    CT_TRY(flush_streamed(s));
    return OFF(s)->saved.state.model(s, out);
}
static ct_status wrap_optim(ct_strategy *s, ct_state *out)
{
    CT_TRY(flush_streamed(s));
    return OFF(s)->saved.state.optim(s, out);
}
static ct_status wrap_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    CT_TRY(flush_streamed(s));
    return OFF(s)->saved.state.each(s, optim, shapes_only, fn, ud);
}
static ct_status wrap_shard(ct_strategy *s, int optim, ct_state *out)
{
    CT_TRY(flush_streamed(s));
    return OFF(s)->saved.state.shard(s, optim, out);
}
static ct_status wrap_local(ct_strategy *s, int optim, ct_state *out)
{
    CT_TRY(flush_streamed(s));
    return OFF(s)->saved.state.local(s, optim, out);
}

static ct_status wrap_share(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud)
{
    CT_TRY(flush_streamed(s));
    return OFF(s)->saved.state.share(s, optim, local, shapes_only, fn, ud);
}

/* State never written (fresh) takes the loaded ranges: resident, it is
 * zeroed first; in the store, the load writes the ranges there and the
 * part counts as written once the whole load succeeded (a failed one
 * leaves it zeros, as it was). */
static ct_status wrap_load(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n, int optim)
{
    fsdp_off *o = OFF(s);
    CT_TRY(flush_streamed(s));
    for (int i = 0; optim && i < o->nflats; i++) {
        off_flat *x = &o->fl[i];
        if (!x->st[PS] || !x->fresh) continue;
        if (x->where[PS] == P_OUT) continue;
        CT_TRY(ct__ostore_wait(o->store, x->tk[PS])); /* loading, or in: its memory is ours */
        x->where[PS] = P_RES;
        memset(ct_storage_ptr(x->st[PS]), 0, x->st[PS]->bytes);
        x->fresh = 0;
        x->dirty[PS] = 1;
    }
    ct_status st = o->saved.state.load(s, names, ts, n, optim);
    for (int i = 0; st == CT_OK && optim && i < o->nflats; i++) o->fl[i].fresh = 0;
    return st;
}

/* The optimizer's slots are made over masters that are in the store: they
 * point into one placeholder of the largest piece while it is made (no one
 * reads them after: the step updates by range, the state I/O goes through
 * range_io, which finds each slot's flat and offset in the map made here). */
static ct_status wrap_build_optim(ct_strategy *s, const ct_optim_opts *oo)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    int64_t most = 1;
    for (int i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) most = f->u[i].fl[k].flat.shard > most ? f->u[i].fl[k].flat.shard : most;
    float *ph = ct_alloc_zeroed((size_t)most * sizeof(float), CT_MEM_OTHER);
    if (!ph) return CT_ENOMEM;
    for (int i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++)
            if (!f->u[i].fl[k].master) f->u[i].fl[k].master = ph;
    ct_status st = o->saved.place.build_optim(s, oo);
    for (int i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) sync_ptrs(&f->u[i].fl[k], OF(s, &f->u[i], k));
    ct_free(ph);
    CT_TRY(st);
    size_t ns = (size_t)ct_optim_num_slots(s->opt) + 1;
    o->slot_flat = ct_alloc(sizeof *o->slot_flat * ns, CT_MEM_OTHER);
    o->slot_x = ct_alloc(sizeof *o->slot_x * ns, CT_MEM_OTHER);
    o->slot_at = ct_alloc(sizeof *o->slot_at * ns, CT_MEM_OTHER);
    if (!o->slot_flat || !o->slot_x || !o->slot_at) return CT_ENOMEM;
    each_slot(s, note_slot, NULL);
    f->sh.io = range_io; /* the state I/O reads and writes where the parts rest */
    return CT_OK;
}

/* Summoned parameters come from the masters: pinned until the release. */
static ct_status wrap_summon(ct_strategy *s, int writeback, int rank0_only)
{
    CT_TRY(pin(s));
    ct_status st = OFF(s)->saved.place.summon(s, writeback, rank0_only);
    if (st != CT_OK) unpin(s, 0);
    return st;
}

static ct_status wrap_release(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    int wb = 0;
    for (int i = 0; i < f->nu; i++) wb |= f->u[i].summon_writeback;
    ct_status st = OFF(s)->saved.place.release(s);
    ct_status u = OFF(s)->pinned ? unpin(s, wb) : CT_OK;
    return st != CT_OK ? st : u;
}

/* One unit's parameters read or written whole (ct_strategy_unit_read and
 * _write): the pending updates first (streamed), then that unit's masters
 * in for the call and out after it (written when the call wrote them). */
static ct_status wrap_unit_io(ct_strategy *s, int i, float *buf, int write)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    fsdp_unit *u = &f->u[i];
    CT_TRY(flush_streamed(s));
    for (int k = 0; k < u->nfl; k++) {
        CT_TRY(ct__fsdp_off_have(o, &u->fl[k], OF(s, u, k), PM, 0));
        if (write) OF(s, u, k)->dirty[PM] = 1;
    }
    ct_status st = o->saved.place.unit_io(s, i, buf, write);
    for (int k = 0; k < u->nfl; k++) { /* a gathered unit of one shard keeps its masters: they are its data */
        ct_status w = u->state == UNIT_SHARDED || u->ns > 1 || u->fl[k].low ? ct__fsdp_off_send_out(o, &u->fl[k], OF(s, u, k), PM) : CT_OK;
        if (st == CT_OK) st = w;
    }
    return st;
}

void ct__fsdp_off_wrap(ct_strategy *s)
{
    OFF(s)->saved = s->vt;
    s->vt.place.build_optim = wrap_build_optim;
    s->vt.place.summon = wrap_summon;
    s->vt.place.release = wrap_release;
    s->vt.place.unit_io = wrap_unit_io;
    s->vt.state.model = wrap_model;
    s->vt.state.optim = wrap_optim;
    s->vt.state.each = wrap_each;
    s->vt.state.shard = wrap_shard;
    s->vt.state.local = wrap_local;
    s->vt.state.share = wrap_share;
    s->vt.state.load = wrap_load;
}

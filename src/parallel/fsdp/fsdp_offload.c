/*
 * FSDP with its shards in the store (ZeRO-Infinity on CPUs).  Each flat's
 * piece on this rank has three parts: M, the f32 masters; G, the reduced
 * gradient piece; S, the optimizer state (nstate buffers of the piece's
 * length).  offload=optim puts S in the store, params M and G, all the
 * three; the others stay resident.  The store (parallel/store.c, offload's)
 * keeps each flat's parts end to end, [M][G][S], so a step reads and writes
 * one run per flat.
 *
 * A part is resident, loading (a job queued: its memory is the I/O
 * thread's until the caller waits for the ticket) or out.  The unit hooks
 * of fsdp.c call in here: masters load before a gather (the next units'
 * behind them, in the order one pass gathered them) and go back
 * after it (dropped when unchanged: the store has them); a gradient piece
 * comes back before its reduce (new when the reduce overwrites it) and is
 * written after it, its norm terms noted while resident, so clipping knows
 * the global norm before any flat steps.  The step moves nothing: it keeps
 * the optimizer's options, step count and clip factors, and each flat's
 * update runs when its masters next come in (the next forward's gather),
 * its gradient piece and state loaded with them, by the optimizer's own
 * rule (ct_optim_update_range, bitwise ct_optim_step): the step's I/O runs
 * behind the forward's compute and the masters are read once for both.
 * Whatever reads or changes state first applies what is still pending.
 *
 * The ct_optim keeps the slots, step count, learning rate and groups; its
 * own state buffers stay unallocated.  Checkpoints read and write the
 * store's ranges a tensor or a chunk at a time (fsdp_offload_state.c).
 */
#include <math.h>
#include <string.h>

#include "fsdp_offload.h"

static unsigned mode_mask(int m)
{
    return m == FSDP_OFF_OPTIM ? 1u << PS : m == FSDP_OFF_PARAMS ? (1u << PM | 1u << PG)
         : m == FSDP_OFF_ALL ? (1u << PM | 1u << PG | 1u << PS) : 0;
}
static size_t part_bytes(const fsdp_off *o, const fsdp_flat *fl, int p)
{
    return (size_t)fl->flat.shard * sizeof(float) * (size_t)(p == PS ? o->nstate : 1);
}

int ct__fsdp_off_masters_out(const ct_strategy *s) { return (mode_mask(O(s)->offload) >> PM) & 1; }
int ct__fsdp_off_grads_out(const ct_strategy *s) { return (mode_mask(O(s)->offload) >> PG) & 1; }

/* ---- residency ---------------------------------------------------------------- */

/* Queues part p in (read, or new memory with fresh), unless it is in or coming. */
static ct_status bring(fsdp_off *o, off_flat *x, int p, int fresh)
{
    if (!x->st[p] || x->where[p] != P_OUT) return CT_OK;
    if (fresh && p == PG) { /* new memory for a reduce to overwrite: not queued behind the loads, only
                             * behind the job that took the memory away */
        CT_TRY(ct__ostore_wait(o->store, x->out_tk[p]));
        CT_TRY(ct_storage_alloc_data(x->st[p], 0));
        x->where[p] = P_RES;
        x->dirty[p] = 0;
        return CT_OK;
    }
    ct__io_piece pc = {x->st[p], x->off[p], fresh ? CT__IO_ALLOC : CT__IO_READ};
    CT_TRY(ct__ostore_submit(o->store, &pc, 1, &x->tk[p]));
    x->where[p] = P_LOADING;
    x->dirty[p] = 0;
    return CT_OK;
}

/* Part p resident: waits for its load. */
ct_status ct__fsdp_off_have(fsdp_off *o, fsdp_flat *fl, off_flat *x, int p, int fresh)
{
    CT_TRY(bring(o, x, p, fresh));
    if (x->st[p] && x->where[p] == P_LOADING) {
        CT_TRY(ct__ostore_wait(o->store, x->tk[p]));
        x->where[p] = P_RES;
    }
    sync_ptrs(fl, x);
    return CT_OK;
}

/* Part p goes out: written when it changed, else dropped (the store has it). */
ct_status ct__fsdp_off_send_out(fsdp_off *o, fsdp_flat *fl, off_flat *x, int p)
{
    if (!x->st[p] || !(o->mask >> p & 1) || x->where[p] == P_OUT || o->pinned) return CT_OK;
    if (x->where[p] == P_LOADING) { /* its memory is the I/O thread's until then */
        CT_TRY(ct__ostore_wait(o->store, x->tk[p]));
        x->where[p] = P_RES;
    }
    ct__io_piece pc = {x->st[p], x->off[p], x->dirty[p] ? CT__IO_WRITE : CT__IO_DROP};
    CT_TRY(ct__ostore_submit(o->store, &pc, 1, &x->out_tk[p]));
    if (p == PS && x->dirty[p]) x->fresh = 0;
    x->where[p] = P_OUT;
    x->dirty[p] = 0;
    sync_ptrs(fl, x);
    return CT_OK;
}

/* ---- set-up ----------------------------------------------------------------- */

static ct_status apply_update(ct_strategy *s, fsdp_unit *u, int k);
static ct_status bring_unit(ct_strategy *s, fsdp_unit *u);
static void settle_unit(ct_strategy *s, fsdp_unit *u);

#define MIB 1048576.0

/* Bytes of unit u resident while it computes: its gathered flats (data or
 * low copy, and gradients) and its offloaded shard parts. */
static double unit_bytes(const fsdp_off *o, const fsdp_unit *u)
{
    double b = 0;
    for (int k = 0; k < u->nfl; k++) {
        const fsdp_flat *fl = &u->fl[k];
        double padded = (double)fl->flat.shard * u->ns;
        b += padded * 4 + (fl->low ? (double)fl->flat.nlow * 2 : (u->ns > 1 ? padded * 4 : 0));
        for (int p = 0; p < NPART; p++)
            if (o->mask >> p & 1) b += (double)part_bytes(o, fl, p);
    }
    return b;
}

ct_status ct__fsdp_off_open(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    if (O(s)->offload == FSDP_OFF_NONE) {
        if (*ct_strategy_opt(s, "offload_dir") || O(s)->max_resident_mb)
            return ct_error(CT_EINVAL, "fsdp options offload_dir and max_resident_mb apply with offload only; "
                            "add offload=optim|params|all (--offload) or drop them");
        return CT_OK;
    }
    fsdp_off *o = ct_alloc_zeroed(sizeof *o, CT_MEM_OTHER);
    if (!o) return CT_ENOMEM;
    f->off = o;
    o->mask = mode_mask(O(s)->offload);
    ct_optim *tmp = ct_optim_create_slots(&s->spec, NULL, 0); /* the one place that names the state */
    if (!tmp) return ct_last_status();
    o->nstate = ct_optim_state_names(tmp, NULL);
    ct_optim_destroy(tmp);
    for (int i = 0; i < f->nu; i++) o->nflats += f->u[i].nfl;
    o->fl = ct_alloc_zeroed(sizeof *o->fl * ((size_t)o->nflats + 1), CT_MEM_OTHER);
    o->first = ct_alloc_zeroed(sizeof *o->first * ((size_t)f->nu + 1), CT_MEM_OTHER);
    o->seq_max = 3 * f->nu;
    if (!o->fl || !o->first) return CT_ENOMEM;
    size_t total = 0;
    double fixed = 0, largest = 0;
    const char *big = "";
    for (int i = 0, n = 0; i < f->nu; i++) {
        fsdp_unit *u = &f->u[i];
        o->first[i] = n;
        for (int k = 0; k < u->nfl; k++, n++) {
            fsdp_flat *fl = &u->fl[k];
            ct__flat_shard(&fl->flat, u->ns, u->srank); /* setup_flat does it again: the same */
            for (int p = 0; p < NPART; p++) {
                size_t b = part_bytes(o, fl, p);
                /* each part on a 4 KiB boundary, so the store moves it by direct I/O */
                if (o->mask >> p & 1) total = (total + 4095) / 4096 * 4096;
                o->fl[n].off[p] = (off_t)total;
                if (o->mask >> p & 1) total += b;
                else fixed += (double)b;
            }
        }
        double ub = unit_bytes(o, u);
        if (ub > largest) largest = ub, big = u->m->fqn[0] ? u->m->fqn : "(the model)";
    }
    double budget = (double)O(s)->max_resident_mb * MIB;
    o->ahead = 3; /* the one in use and two loading */
    /* FSDP's own window is two units (one computing while the next gathers,
     * or its gradients reduce): one more when the store loads ahead */
    if (budget > 0 && fixed + 2 * largest > budget)
        return ct_error(CT_EINVAL, "fsdp offload=%s: max_resident_mb=%d is below the %.1f MiB this rank needs "
                        "(%.1f MiB of shard parts kept resident, and two units as large as '%s', %.1f MiB each while they compute); "
                        "raise --max-resident-mb, offload more (--offload all), or wrap smaller units",
                        ct_strategy_opt(s, "offload"), O(s)->max_resident_mb, (fixed + 2 * largest) / MIB, fixed / MIB,
                        big, largest / MIB);
    if (budget > 0 && fixed + 4 * largest > budget) o->ahead = 2;
    if (budget > 0 && fixed + 3 * largest > budget) o->ahead = 1;
    CT_TRY(ct__ostore_open(O(s)->store == FSDP_STORE_MEMORY, ct_strategy_opt(s, "offload_dir"), total,
                           O(s)->drop_cache, &o->store));
    ct__fsdp_off_wrap(s); /* checkpoints, summons and unit I/O through the store (fsdp_offload_state.c) */
    return CT_OK;
}

/* Moves storage-less memory of n bytes into a new storage (copied: the
 * peak is one flat's part twice, never the shard). */
static ct_storage *adopt_mem(void *mem, size_t bytes, ct_mem_cat cat)
{
    ct_storage *st = ct_storage_create(bytes ? bytes : 4, cat, 0);
    if (st && mem) memcpy(ct_storage_ptr(st), mem, bytes);
    return st;
}

ct_status ct__fsdp_off_adopt(ct_strategy *s, fsdp_unit *u, int k)
{
    fsdp_off *o = OFF(s);
    fsdp_flat *fl = &u->fl[k];
    off_flat *x = OF(s, u, k);
    size_t b = part_bytes(o, fl, PM);
    if (o->mask >> PM & 1) {
        if (u->ns == 1) { /* the data part is the masters' home (setup_flat made it owned) */
            x->st[PM] = ct_storage_retain(fl->flat.st[CT__FL_DATA]);
            memcpy(ct_storage_ptr(x->st[PM]), fl->master, b);
        } else if (!(x->st[PM] = adopt_mem(fl->master, b, CT_MEM_PARAM))) {
            return ct_last_status();
        }
        ct_free(fl->master);
        fl->master = ct_storage_ptr(x->st[PM]);
        x->dirty[PM] = 1;
    }
    if (o->mask >> PG & 1) {
        if (!(x->st[PG] = ct_storage_absent(b ? b : 4, CT_MEM_GRAD))) return ct_last_status();
        ct_free(fl->gshard);
        fl->gshard = NULL;
        x->where[PG] = P_OUT; /* gzero: the first reduce overwrites it */
    }
    size_t sb = part_bytes(o, fl, PS);
    x->fresh = 1;
    if (sb && (o->mask >> PS & 1)) {
        if (!(x->st[PS] = ct_storage_absent(sb, CT_MEM_OPTIM))) return ct_last_status();
        x->where[PS] = P_OUT;
    } else if (sb) {
        if (!(x->st[PS] = ct_storage_create(sb, CT_MEM_OPTIM, 1))) return ct_last_status(); /* resident for good */
    }
    /* masters go out now: set-up never holds more than a flat of them */
    CT_TRY(ct__fsdp_off_send_out(o, fl, x, PM));
    return ct__ostore_drain(o->store);
}

void ct__fsdp_off_close(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    if (!o) return;
    if (o->store) ct__ostore_drain(o->store);
    ct__ostore_close(o->store);
    for (int i = 0; o->fl && i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) {
            off_flat *x = &o->fl[o->first[i] + k];
            fsdp_flat *fl = &f->u[i].fl[k];
            if (x->st[PM]) fl->master = NULL;
            if (x->st[PG]) fl->gshard = NULL;
            for (int p = 0; p < NPART; p++) ct_storage_release(x->st[p]);
        }
    if (o->saved.kind) { /* the wrapped entries back */
        s->vt.place.build_optim = o->saved.place.build_optim;
        s->vt.place.summon = o->saved.place.summon;
        s->vt.place.release = o->saved.place.release;
        s->vt.place.unit_io = o->saved.place.unit_io;
        s->vt.state = o->saved.state;
    }
    ct_free(o->fl);
    ct_free(o->first);
    ct_free(o->seq);
    ct_free(o->slot_flat);
    ct_free(o->slot_x);
    ct_free(o->slot_at);
    f->sh.io = NULL;
    ct_free(o);
    f->off = NULL;
}

/* ---- the unit hooks ------------------------------------------------------------ */

static ct_status unit_parts(ct_strategy *s, fsdp_unit *u, int p, int load)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++) {
        off_flat *x = OF(s, u, k);
        CT_TRY(load ? ct__fsdp_off_have(o, &u->fl[k], x, p, 0) : bring(o, x, p, 0));
    }
    return CT_OK;
}

ct_status ct__fsdp_off_masters(ct_strategy *s, fsdp_unit *u)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    int me = (int)(u - f->u);
    if (!o->recorded) {
        /* One pass is recorded: up to the first step, or as many gathers as
         * every unit's forward, a checkpoint's recompute and backward make
         * (forward-only loops, an evaluation, would grow it without end). */
        int *g = ct_grow(o->seq, o->nseq, &o->cap, sizeof *o->seq, CT_MEM_OTHER);
        if (!g) return CT_ENOMEM;
        o->seq = g;
        o->seq[o->nseq++] = me;
        if (o->nseq >= o->seq_max) o->recorded = 1, o->cur = o->nseq;
    } else { /* the next place of me in the recorded order, round to its start (passes repeat) */
        for (int k = 0; k < o->nseq; k++) {
            int i = (o->cur + k) % o->nseq;
            if (o->seq[i] != me) continue;
            o->cur = i + 1;
            break;
        }
    }
    CT_TRY(bring_unit(s, u));
    for (int k = 0; o->recorded && k < o->nseq - 1 && k < o->ahead - 1; k++)
        CT_TRY(bring_unit(s, &f->u[o->seq[(o->cur + k) % o->nseq]]));
    CT_TRY(unit_parts(s, u, PM, 1));
    for (int k = 0; k < u->nfl; k++) CT_TRY(apply_update(s, u, k));
    return CT_OK;
}

void ct__fsdp_off_gathered(ct_strategy *s, fsdp_unit *u)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++)
        if (u->ns > 1 || u->fl[k].low) ct__fsdp_off_send_out(o, &u->fl[k], OF(s, u, k), PM); /* a failure is sticky: the next wait reports it */
    settle_unit(s, u);
}

void ct__fsdp_off_freed(ct_strategy *s, fsdp_unit *u)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++) ct__fsdp_off_send_out(o, &u->fl[k], OF(s, u, k), PM);
}

ct_status ct__fsdp_off_grads(ct_strategy *s, fsdp_unit *u)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++) { /* a pending update takes the old gradient first */
        CT_TRY(apply_update(s, u, k));
        if (u->ns > 1 || u->fl[k].low) CT_TRY(ct__fsdp_off_send_out(o, &u->fl[k], OF(s, u, k), PM));
        CT_TRY(ct__fsdp_off_send_out(o, &u->fl[k], OF(s, u, k), PS));
    }
    for (int k = 0; k < u->nfl; k++) CT_TRY(ct__fsdp_off_have(o, &u->fl[k], OF(s, u, k), PG, u->fl[k].gzero));
    return CT_OK;
}

static void note_norms(fsdp_flat *fl, off_flat *x)
{
    ct_norm_acc sq = ct_norm_acc_init(2.0), mx = ct_norm_acc_init(INFINITY);
    ct_norm_acc_f32(&sq, fl->gshard, fl->flat.shard);
    ct_norm_acc_f32(&mx, fl->gshard, fl->flat.shard);
    x->sq = sq.v;
    x->mx = mx.v;
}

ct_status ct__fsdp_off_reduced(ct_strategy *s, fsdp_unit *u)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++) {
        off_flat *x = OF(s, u, k);
        if (!x->st[PG] || x->where[PG] != P_RES) continue;
        note_norms(&u->fl[k], x);
        x->dirty[PG] = 1;
        CT_TRY(ct__fsdp_off_send_out(o, &u->fl[k], x, PG));
    }
    return CT_OK;
}

/* ---- clipping ------------------------------------------------------------------ */

static void apply_scales(const float *scales, int n, fsdp_flat *fl, off_flat *x)
{
    for (int q = 0; q < n; q++)
        for (int64_t j = 0; j < fl->flat.shard; j++) fl->gshard[j] *= scales[q];
    if (n) x->dirty[PG] = 1;
}

/* Pending factors applied to every stored piece (a norm asked for after a
 * clip, or more factors than kept): a pass over the gradients. */
static ct_status flush_scales(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    for (int i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) {
            fsdp_flat *fl = &f->u[i].fl[k];
            off_flat *x = OF(s, &f->u[i], k);
            if (fl->gzero) continue;
            CT_TRY(ct__fsdp_off_have(o, fl, x, PG, 0));
            apply_scales(o->scales, o->nscales, fl, x);
            note_norms(fl, x);
            CT_TRY(ct__fsdp_off_send_out(o, fl, x, PG));
        }
    o->nscales = 0;
    return CT_OK;
}

/* The norm terms noted at each reduce, combined per shard group as the
 * resident pieces' would be (in double; only the summation's order differs). */
ct_status ct__fsdp_off_grad_norm(ct_strategy *s, ct_norm_acc *acc)
{
    fsdp_t *f = ct__fsdp_of(s);
    CT_TRY(ct__fsdp_off_flush(s)); /* a norm of the gradients a pending update still has to take */
    if (f->off->nscales) CT_TRY(flush_scales(s));
    for (int g = 0; g < f->ngroups; g++) {
        ct_norm_acc part = ct_norm_acc_init(acc->inf ? INFINITY : 2.0);
        for (int i = 0; i < f->nu; i++) {
            if (f->u[i].gi != g) continue;
            for (int k = 0; k < f->u[i].nfl; k++) {
                const off_flat *x = OF(s, &f->u[i], k);
                if (f->u[i].fl[k].gzero) continue;
                ct_norm_acc_add(&part, acc->inf ? x->mx : x->sq);
            }
        }
        CT_TRY(ct__norm_combine(f->groups[g], &part));
        ct_norm_acc_add(acc, part.v);
    }
    return CT_OK;
}

void ct__fsdp_off_scale(ct_strategy *s, float k)
{
    fsdp_off *o = OFF(s);
    if (o->npend && ct__fsdp_off_flush(s) != CT_OK) return; /* the failure is sticky: the next wait reports it */
    if (o->nscales == (int)(sizeof o->scales / sizeof o->scales[0]) && flush_scales(s) != CT_OK) return;
    o->scales[o->nscales++] = k;
}

/* ---- the step, applied when each flat is next in ---------------------------------- */

/* Flat x of unit u takes the update the last step left pending: its parts
 * in (the gradient as the step found it, zero when it was untouched), the
 * step's clip factors, the optimizer's own rule with the step's options. */
static ct_status apply_update(ct_strategy *s, fsdp_unit *u, int k)
{
    fsdp_off *o = OFF(s);
    fsdp_flat *fl = &u->fl[k];
    off_flat *x = OF(s, u, k);
    if (!x->pend) return CT_OK;
    CT_TRY(ct__fsdp_off_have(o, fl, x, PM, 0));
    CT_TRY(ct__fsdp_off_have(o, fl, x, PG, x->pend_gzero));
    CT_TRY(ct__fsdp_off_have(o, fl, x, PS, x->fresh));
    if (x->pend_gzero) {
        memset(fl->gshard, 0, (size_t)fl->flat.shard * sizeof(float)); /* untouched since zero_grad: zero */
    } else if (x->st[PG] && o->pend_nscales) {
        apply_scales(o->pend_scales, o->pend_nscales, fl, x);
        note_norms(fl, x);
    }
    float *st = x->st[PS] ? ct_storage_ptr(x->st[PS]) : NULL;
    if (x->fresh && st) memset(st, 0, part_bytes(o, fl, PS));
    for (int r = 0; r < fl->pt.n; r++) {
        const ct_part_range *pr = &fl->pt.ranges[r];
        if (pr->owner != u->srank || !pr->count) continue;
        ct_param *p = fl->flat.p[pr->param];
        int64_t at = fl->flat.off[pr->param] + pr->offset - (int64_t)u->srank * fl->flat.shard;
        float *bufs[CT_OPTIM_MAX_STATE] = {0};
        for (int b = 0; b < o->nstate; b++) bufs[b] = st + (int64_t)b * fl->flat.shard + at;
        ct_optim_opts po;
        ct_optim_param_opts(&o->pend_o, p->name, &po);
        ct_optim_update_range(&po, fl->master + at, fl->gshard + at, bufs, pr->count, o->pend_step);
    }
    x->fresh = 0;
    x->dirty[PM] = x->dirty[PS] = 1;
    if (x->pend_gzero) x->dirty[PG] = 0; /* logically zero still: nothing to keep */
    x->pend = 0;
    o->npend--;
    return CT_OK;
}

/* Unit u's parts on their way in: masters, and what a pending update needs. */
static ct_status bring_unit(ct_strategy *s, fsdp_unit *u)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++) {
        off_flat *x = OF(s, u, k);
        CT_TRY(bring(o, x, PM, 0));
        if (!x->pend) continue;
        CT_TRY(bring(o, x, PG, x->pend_gzero));
        CT_TRY(bring(o, x, PS, x->fresh));
    }
    return CT_OK;
}

/* Unit u's parts other than the masters go back (the gradient piece not
 * while its reduce needs it). */
static void settle_unit(ct_strategy *s, fsdp_unit *u)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++) {
        off_flat *x = OF(s, u, k);
        if (!u->reducing) ct__fsdp_off_send_out(o, &u->fl[k], x, PG);
        ct__fsdp_off_send_out(o, &u->fl[k], x, PS);
    }
}

/* Every update still pending, unit by unit, the next unit loading meanwhile
 * (before state is read or written, another step, or a norm). */
ct_status ct__fsdp_off_flush(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    for (int i = 0; o->npend && i < f->nu; i++) {
        fsdp_unit *u = &f->u[i];
        if (i + 1 < f->nu) CT_TRY(bring_unit(s, &f->u[i + 1]));
        for (int k = 0; k < u->nfl; k++) CT_TRY(apply_update(s, u, k));
        if (u->state == UNIT_SHARDED || u->ns > 1)
            for (int k = 0; k < u->nfl; k++) CT_TRY(ct__fsdp_off_send_out(o, &u->fl[k], OF(s, u, k), PM));
        settle_unit(s, u);
    }
    return CT_OK;
}

/* The step takes the optimizer's options, step count and clip factors now
 * and leaves each flat's update to the moment its masters come in next (the
 * next forward's gather): the update needs the masters, the gradient piece
 * and the state in memory, and the gather brings the masters anyway, so the
 * step costs no pass over the store of its own and its I/O runs behind the
 * forward's compute. */
ct_status ct__fsdp_off_step(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    const ct_optim_opts *oo = ct_optim_get_opts(s->opt);
    CT_TRY(ct_optim_validate(oo)); /* a schedule's learning rate, before anything changes */
    CT_TRY(ct__fsdp_off_flush(s)); /* a step before the last one reached every flat */
    int64_t step = ct_optim_get_step(s->opt) + 1;
    o->pend_o = *oo;
    o->pend_step = step;
    memcpy(o->pend_scales, o->scales, sizeof o->scales);
    o->pend_nscales = o->nscales;
    o->nscales = 0;
    for (int i = 0, n = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++, n++) {
            o->fl[n].pend = 1;
            o->fl[n].pend_gzero = f->u[i].fl[k].gzero;
        }
    o->npend = o->nflats;
    ct_optim_set_step(s->opt, step);
    o->recorded = 1;
    o->cur = 0;
    double busy, waited;
    ct__ostore_times(o->store, &busy, &waited);
    s->stats.io_total += busy;
    s->stats.io_wait += waited;
    double rd, wr;
    ct__ostore_bytes(o->store, &rd, &wr);
    s->stats.io_bytes += rd + wr - o->moved;
    o->moved = rd + wr;
    return CT_OK;
}

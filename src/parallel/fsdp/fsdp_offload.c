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
 * own state buffers stay unallocated.  A checkpoint, a load or a summon
 * pins every flat's M and S resident and lends S to the optimizer's
 * buffers for the existing code paths, then gives them back: correct, but
 * the whole shard is resident meanwhile (not streamed).
 */
#include <math.h>
#include <string.h>

#include "fsdp.h"
#include "parallel/store.h"

enum { PM = 0, PG, PS, NPART };
enum { P_RES = 0, P_LOADING, P_OUT };

typedef struct {
    ct_storage *st[NPART]; /* NULL: not offloaded (fsdp.c's own pointers) or no state */
    int where[NPART];      /* P_* */
    long tk[NPART];        /* ticket of the job bringing it in */
    long out_tk[NPART];    /* ticket of the job that last took it out */
    int dirty[NPART];      /* resident copy differs from the store's */
    int fresh;             /* S never written: zeros, nothing to read */
    off_t off[NPART];
    float *state;          /* S when resident and not offloaded */
    double sq, mx;         /* norm terms of G after its last reduce */
    int pend;              /* the last step's update is still to be applied */
    int pend_gzero;        /* its gradient was untouched since zero_grad (zero) */
} off_flat;

typedef struct fsdp_off {
    ct__ostore *store;
    off_flat *fl;          /* [nflats]: unit by unit, flat by flat */
    int *first;            /* [nu] index of the unit's first flat */
    int nflats;
    unsigned mask;         /* bits of the parts in the store */
    int nstate;
    int ahead;             /* 2: load one unit ahead; 1: on demand */
    int *seq, nseq, cap, cur, recorded; /* units in the order their masters were needed (one pass) */
    int seq_max;           /* the recording's bound: every unit's forward, recompute and backward */
    float scales[16];      /* clip factors since the last step */
    int nscales;
    int npend;             /* flats whose update is pending */
    ct_optim_opts pend_o;  /* the pending update: the step's options (its learning rate), */
    int64_t pend_step;     /* its 1-based step count */
    float pend_scales[16]; /* and the clip factors it took */
    int pend_nscales;
    int pinned;
    fsdp_flat **slot_flat; /* [optimizer slots] the flat of each slot's range, */
    off_flat **slot_x;     /* its parts, */
    int64_t *slot_at;      /* and its offset in the piece (range_io) */
    double moved;          /* the store's bytes read plus written at the last step's end */
    ct__strategy_ops saved; /* the entries this file wraps */
} fsdp_off;

static const fsdp_opts *O(const ct_strategy *s) { return s->kopts; }
static fsdp_off *OFF(ct_strategy *s) { return ct__fsdp_of(s)->off; }
static off_flat *OF(ct_strategy *s, const fsdp_unit *u, int k)
{
    fsdp_off *o = OFF(s);
    return &o->fl[o->first[u - ct__fsdp_of(s)->u] + k];
}
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

/* The pointers fsdp.c reads follow the parts' residency. */
static void sync_ptrs(fsdp_flat *fl, off_flat *x)
{
    if (x->st[PM]) fl->master = x->where[PM] == P_RES ? ct_storage_ptr(x->st[PM]) : NULL;
    if (x->st[PG]) fl->gshard = x->where[PG] == P_RES ? ct_storage_ptr(x->st[PG]) : NULL;
}

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
static ct_status have(fsdp_off *o, fsdp_flat *fl, off_flat *x, int p, int fresh)
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
static ct_status send_out(fsdp_off *o, fsdp_flat *fl, off_flat *x, int p)
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
static ct_status flush(ct_strategy *s);
static ct_status wrap_build_optim(ct_strategy *s, const ct_optim_opts *oo);
static ct_status wrap_summon(ct_strategy *s, int writeback, int rank0_only);
static ct_status wrap_release(ct_strategy *s);
static ct_status wrap_unit_io(ct_strategy *s, int i, float *buf, int write);
static ct_status wrap_model(ct_strategy *s, ct_state *out);
static ct_status wrap_optim(ct_strategy *s, ct_state *out);
static ct_status wrap_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud);
static ct_status wrap_shard(ct_strategy *s, int optim, ct_state *out);
static ct_status wrap_local(ct_strategy *s, int optim, ct_state *out);
static ct_status wrap_share(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud);
static ct_status wrap_load(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n, int optim);

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
    /* checkpoints and summons pin every part (see the top) */
    o->saved = s->vt;
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
    CT_TRY(send_out(o, fl, x, PM));
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
        CT_TRY(load ? have(o, &u->fl[k], x, p, 0) : bring(o, x, p, 0));
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
        if (u->ns > 1 || u->fl[k].low) send_out(o, &u->fl[k], OF(s, u, k), PM); /* a failure is sticky: the next wait reports it */
    settle_unit(s, u);
}

void ct__fsdp_off_freed(ct_strategy *s, fsdp_unit *u)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++) send_out(o, &u->fl[k], OF(s, u, k), PM);
}

ct_status ct__fsdp_off_grads(ct_strategy *s, fsdp_unit *u)
{
    fsdp_off *o = OFF(s);
    for (int k = 0; k < u->nfl; k++) { /* a pending update takes the old gradient first */
        CT_TRY(apply_update(s, u, k));
        if (u->ns > 1 || u->fl[k].low) CT_TRY(send_out(o, &u->fl[k], OF(s, u, k), PM));
        CT_TRY(send_out(o, &u->fl[k], OF(s, u, k), PS));
    }
    for (int k = 0; k < u->nfl; k++) CT_TRY(have(o, &u->fl[k], OF(s, u, k), PG, u->fl[k].gzero));
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
        CT_TRY(send_out(o, &u->fl[k], x, PG));
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
            CT_TRY(have(o, fl, x, PG, 0));
            apply_scales(o->scales, o->nscales, fl, x);
            note_norms(fl, x);
            CT_TRY(send_out(o, fl, x, PG));
        }
    o->nscales = 0;
    return CT_OK;
}

/* The norm terms noted at each reduce, combined per shard group as the
 * resident pieces' would be (in double; only the summation's order differs). */
ct_status ct__fsdp_off_grad_norm(ct_strategy *s, ct_norm_acc *acc)
{
    fsdp_t *f = ct__fsdp_of(s);
    CT_TRY(flush(s)); /* a norm of the gradients a pending update still has to take */
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
    if (o->npend && flush(s) != CT_OK) return; /* the failure is sticky: the next wait reports it */
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
    CT_TRY(have(o, fl, x, PM, 0));
    CT_TRY(have(o, fl, x, PG, x->pend_gzero));
    CT_TRY(have(o, fl, x, PS, x->fresh));
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
        if (!u->reducing) send_out(o, &u->fl[k], x, PG);
        send_out(o, &u->fl[k], x, PS);
    }
}

/* Every update still pending, unit by unit, the next unit loading meanwhile
 * (before state is read or written, another step, or a norm). */
static ct_status flush(ct_strategy *s)
{
    fsdp_t *f = ct__fsdp_of(s);
    fsdp_off *o = f->off;
    for (int i = 0; o->npend && i < f->nu; i++) {
        fsdp_unit *u = &f->u[i];
        if (i + 1 < f->nu) CT_TRY(bring_unit(s, &f->u[i + 1]));
        for (int k = 0; k < u->nfl; k++) CT_TRY(apply_update(s, u, k));
        if (u->state == UNIT_SHARDED || u->ns > 1)
            for (int k = 0; k < u->nfl; k++) CT_TRY(send_out(o, &u->fl[k], OF(s, u, k), PM));
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
    CT_TRY(flush(s));               /* a step before the last one reached every flat */
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
    CT_TRY(flush(s));
    for (int n = 0, i = 0; i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++, n++) CT_TRY(have(o, &f->u[i].fl[k], &o->fl[n], PM, 0));
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
            if (u->state == UNIT_SHARDED || u->ns > 1 || u->fl[k].low) w = send_out(o, &u->fl[k], &o->fl[n], PM);
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
        CT_TRY(have(o, &u->fl[k], OF(s, u, k), PM, 0));
        if (write) OF(s, u, k)->dirty[PM] = 1;
    }
    ct_status st = o->saved.place.unit_io(s, i, buf, write);
    for (int k = 0; k < u->nfl; k++) { /* a gathered unit of one shard keeps its masters: they are its data */
        ct_status w = u->state == UNIT_SHARDED || u->ns > 1 || u->fl[k].low ? send_out(o, &u->fl[k], OF(s, u, k), PM) : CT_OK;
        if (st == CT_OK) st = w;
    }
    return st;
}

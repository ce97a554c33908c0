/*
 * FSDP's memory plan (fsdp*.c), over the units ct_fsdp_plan says it makes
 * (the same cut fsdp_units.c gives the strategy): every rank keeps 1/ns of
 * each unit's flat parameter, gradient and optimizer state (ns the world, or
 * 1 for sharding=none and ignored modules; the plan knows no nodes, so
 * hybrid counts as full), and on top what backward has unsharded at once.
 */
#include <string.h>

#include "plan.h"

/* FSDP's backward on one rank, replayed over the units other than the root
 * in the order backward reaches them (the reverse of pre-order), on top of
 * the root's parameters and gradients, which live through the whole
 * backward: a unit's parameters are gathered at its pre-backward (and, with
 * prefetch pre, the next unit's with them; post, after its reduce started),
 * its gradients get memory, and at its post-backward its reduce starts, the
 * previous unit's reduce is waited for (its gradients freed) and its
 * parameters are freed.  grad_op starts with every unit's parameters still
 * there from forward.  fp/fg: each unit's unsharded parameter and gradient
 * bytes; peaks in p, g and p + g. */
static void fsdp_backward(const uint64_t *fp, const uint64_t *fg, int m, uint64_t root_p, uint64_t root_g,
                          int grad_op, int prefetch, uint64_t peak[3])
{
    uint64_t sp = root_p, sg = root_g;
    for (int k = 0; grad_op && k < m; k++) sp += fp[k];
    int gathered = -1, prev = -1; /* the unit prefetched; the one whose reduce is in flight */
#define PEAK()                                           \
    do {                                                 \
        peak[0] = sp > peak[0] ? sp : peak[0];           \
        peak[1] = sg > peak[1] ? sg : peak[1];           \
        peak[2] = sp + sg > peak[2] ? sp + sg : peak[2]; \
    } while (0)
    PEAK();
    for (int k = m - 1; k >= 0; k--) {
        if (!grad_op && gathered != k) sp += fp[k];
        if (!grad_op && prefetch == 1 && k > 0) sp += fp[gathered = k - 1];
        sg += fg[k];
        PEAK();
        if (prev >= 0) sg -= fg[prev];
        prev = k;
        sp -= fp[k];
        if (!grad_op && prefetch == 2 && k > 0) sp += fp[gathered = k - 1];
        PEAK();
    }
#undef PEAK
}

ct_status ct__plan_fsdp(const ct__plan *pl, ct_mem_plan *out)
{
    uint64_t act;
    CT_TRY(ct__plan_act(pl, pl->rows, (int)ct__plan_num(pl, "grad_accum", 1), ct__plan_is16(pl, "param_dtype"), &act));
    int n = 0, world = pl->spec->world;
    CT_TRY(ct_fsdp_plan(pl->model, pl->opts, NULL, 0, &n));
    ct_fsdp_unit *u = ct_alloc(sizeof *u * (size_t)(n + 1), CT_MEM_OTHER);
    int64_t *counts = ct_alloc(sizeof *counts * (size_t)(2 * n + 1), CT_MEM_OTHER);
    uint64_t *fp = ct_alloc(sizeof *fp * (size_t)(2 * n + 2), CT_MEM_OTHER), *fg = fp ? fp + n + 1 : NULL;
    ct_status st = u && counts && fp ? ct_fsdp_plan(pl->model, pl->opts, u, n, &n) : CT_ENOMEM;
    char b[64], c[64];
    const char *sh = ct__plan_opt(pl, "sharding", b, sizeof b), *pf = ct__plan_opt(pl, "backward_prefetch", c, sizeof c);
    int none = sh && !strcmp(sh, "none"), grad_op = sh && !strcmp(sh, "grad_op");
    int prefetch = !pf || !strcmp(pf, "pre") ? 1 : !strcmp(pf, "post") ? 2 : 0;
    char ob[64];
    const char *off = ct__plan_opt(pl, "offload", ob, sizeof ob);
    int om = !off || !strcmp(off, "none") ? 0 : !strcmp(off, "optim") ? 1 : !strcmp(off, "params") ? 2 : 3;
    uint64_t whole = pl->buffer_bytes; /* what fsdp leaves whole: frozen parameters, buffers */
    for (int i = 0; i < pl->nparams; i++)
        if (!pl->params[i]->requires_grad) whole += ct__plan_bytes(pl->params[i]);
    for (int r = 0; st == CT_OK && r < world; r++) {
        uint64_t pp = 0, root_p = 0, root_g = 0, peak[3] = {0, 0, 0}, ring_tmp[2] = {0, 0}, maxp = 0;
        int nc = 0, m = 0;
        for (int i = 0; i < n; i++) {
            int64_t ns = none || u[i].replicated ? 1 : world;
            uint64_t p1 = 0, g1 = 0;
            for (int low = 0; low < 2; low++) {
                int64_t e = low ? u[i].low : u[i].numel, shard = (e + ns - 1) / ns;
                if (!e) continue;
                int64_t owned = e - r * shard;
                counts[nc++] = ns == 1 ? e : owned < 0 ? 0 : owned > shard ? shard : owned;
                pp += (uint64_t)shard * 4;
                p1 += low ? (uint64_t)(shard * ns) * 2 : ns > 1 ? (uint64_t)(shard * ns) * 4 : 0;
                g1 += (uint64_t)(shard * ns) * 4;
            }
            if ((uint64_t)u[i].numel * 4 > out->flat) out->flat = (uint64_t)u[i].numel * 4; /* a unit's flat */
            uint64_t up = 0; /* the unit's piece on a rank (its largest) */
            for (int low = 0; low < 2; low++) up += (uint64_t)(((low ? u[i].low : u[i].numel) + ns - 1) / ns) * 4;
            maxp = up > maxp ? up : maxp;
            /* the ring reduce-scatter's temporaries (src/comm/reduce_scatter.c): two of the
             * unit's gradient blocks per rank (one at two ranks), whatever the world size; two
             * reduce-scatters run at once (the engine's max_running), so the two largest units' */
            uint64_t ring = ns > 1 ? g1 / (uint64_t)ns * (ns > 2 ? 2 : 1) : 0;
            if (ring > ring_tmp[0]) {
                ring_tmp[1] = ring_tmp[0];
                ring_tmp[0] = ring;
            } else if (ring > ring_tmp[1]) {
                ring_tmp[1] = ring;
            }
            if (u[i].is_root) {
                root_p += p1;
                root_g += g1;
            } else {
                fp[m] = p1;
                fg[m++] = g1;
            }
        }
        fsdp_backward(fp, fg, m, root_p, root_g, grad_op, prefetch, peak);
        uint64_t optim = ct__plan_optim(pl, counts, nc), fixed_g = ct__plan_frozen_grads(pl) + pp;
        if (om) { /* fsdp_offload.c: what rests in the store, what is in at once, what moves */
            uint64_t sopt = pp ? (uint64_t)((double)optim * (double)maxp / (double)pp) : 0; /* a unit's state */
            uint64_t store = 0, moved = 0, res_p = pp, res_g = pp, res_o = optim;
            if (om >= 2) { /* masters: in for each gather (twice under full; the first also takes the last
                            * step's update), out after that update; gradients: out at each reduce, in for the
                            * update */
                store += 2 * pp;
                moved += (grad_op ? 1 : 2) * pp + pp + 2 * pp;
                res_p = 3 * maxp < pp ? 3 * maxp : pp; /* gathering, the next loading, one going out */
                res_g = 3 * maxp < pp ? 3 * maxp : pp; /* forward: updates take three; backward: two reduces */
            }
            if (om != 2) {
                store += optim;
                moved += 2 * optim;
                res_o = 3 * sopt < optim ? 3 * sopt : optim; /* updating a unit, the next two loading */
            }
            fixed_g += res_g - pp;
            pp = res_p;
            optim = res_o;
            out->store = store > out->store ? store : out->store;
            out->moved = moved > out->moved ? moved : out->moved;
        }
        uint64_t resident = whole + pp + fixed_g + peak[2] + optim;
        if (om && om != 2) { /* offloaded state is in during the forward only (the updates), beside two units */
            uint64_t fwd = 0;
            for (int k = 0; k < m; k++) fwd = fp[k] > fwd ? fp[k] : fwd;
            uint64_t a = whole + pp + fixed_g + peak[2], b = whole + pp + fixed_g + optim + root_p + 2 * fwd;
            resident = a > b ? a : b;
        }
        ct__plan_peaks(out, whole + pp + peak[0], fixed_g + peak[1], optim, act, ring_tmp[0] + ring_tmp[1], resident);
    }
    ct_free(u);
    ct_free(counts);
    ct_free(fp);
    return st;
}

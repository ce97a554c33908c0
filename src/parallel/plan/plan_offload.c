/*
 * Offload's memory plan (offload*.c): the model cut into slices by
 * ct_offload_split (or the balance option), as the strategy cuts it.  A
 * slice's parameters, gradients and optimizer state (unpadded: one flat run
 * per slice) are in memory only while it is in use; with prefetch two slices
 * are (the one computing, the next loading; three over several ranks, where
 * a slice's allreduce overlaps the next), one without or when
 * max_resident_mb holds only one.  The forward after a step holds a slice's
 * all three at once (the update is applied there), so the categories peak
 * together: the plan takes the largest slices.  Activations without
 * checkpoint_activation are the whole model's records, every micro-batch's
 * (a model with checkpoint wrappers keeps their inputs only); with it,
 * this rank's batch, every later slice's input for the whole batch, plus one
 * micro-batch's records of the largest slice (its input and its children's
 * outputs).  A parameter that children of two slices use (the gpt's tied
 * embedding) stays resident throughout, with its gradient and state; with
 * param_dtype=bf16 a slice's compute copies come and go with it.
 */
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "parallel/offload/offload.h"

/* Children per slice: the balance option, or ct_offload_split's. */
static ct_status slices(const ct__plan *pl, int *sz, int *ns)
{
    CT_TRY(ct__plan_balance(pl, "offload", sz, ns));
    if (*ns) return CT_OK;
    *ns = (int)ct__plan_num(pl, "slices", 4);
    return ct_offload_split(pl->model, *ns, sz);
}

ct_status ct__plan_offload(const ct__plan *pl, ct_mem_plan *out)
{
    ct_module *m = pl->model;
    int n = m->nkids, ns = 0;
    int *sz = ct_alloc(sizeof *sz * (size_t)(n + 1), CT_MEM_OTHER);
    int64_t *outn = ct_alloc(sizeof *outn * (size_t)(n + 1), CT_MEM_OTHER);
    uint64_t *sp = ct_alloc(sizeof *sp * (size_t)(n + 1), CT_MEM_OTHER);
    int *where = ct_alloc(sizeof *where * (size_t)(pl->ntp + 1), CT_MEM_OTHER);
    ct_status st = sz && outn && sp && where ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) st = slices(pl, sz, &ns);
    if (st == CT_OK) st = ct__offload_where(m, sz, ns, pl->tp, pl->ntp, where); /* the strategy's own rule */
    int nbufs = (int)(ct_optim_state_bytes(&pl->spec->optim, (int64_t[]){16}, 1) / 64); /* state floats per element */
    int64_t shape[CT_MAX_DIMS], in1 = 1;
    int nd = pl->spec->in_ndim + 1;
    shape[0] = 1;
    for (int d = 0; d < pl->spec->in_ndim; d++) in1 *= shape[d + 1] = pl->spec->in_shape[d];
    for (int i = 0; st == CT_OK && i < n; i++) {
        st = ct_module_out_shape(m->kids[i], nd, shape, &nd, shape);
        outn[i] = 1;
        for (int d = 1; d < nd; d++) outn[i] *= shape[d];
    }
    int64_t rows = pl->rows;
    int M = (int)ct__plan_num(pl, "microbatches", 1), ckpt = ct__plan_num(pl, "checkpoint_activation", 0) != 0;
    int64_t mrows = (rows + M - 1) / M;
    int mixed = ct__plan_is16(pl, "param_dtype");
    uint64_t largest = 0, bound = 0, maxrec = 0, tied = 0, tlow = 0, lowmax = 0, per = 0;
    for (int k = 0, lo = 0; st == CT_OK && k < ns; lo += sz[k], k++) {
        uint64_t floats = 0, low = 0;
        for (int i = 0; i < pl->ntp; i++) {
            const ct_param *p = pl->tp[i];
            uint64_t lb = ct__plan_copy_bytes(p, mixed);
            if (where[i] == ns && k == 0) { /* used by two slices: resident, counted once */
                tied += (uint64_t)p->data->numel * 4;
                tlow += lb;
            } else if (where[i] == k) {
                floats += (uint64_t)p->data->numel;
                low += lb;
            }
        }
        sp[k] = floats * 4;
        largest = sp[k] > largest ? sp[k] : largest;
        lowmax = low > lowmax ? low : lowmax;
        uint64_t mem = ct__offload_slice_bytes((int64_t)floats, (int64_t)(low / 2), nbufs);
        per = mem > per ? mem : per; /* the budget's largest slice, as the strategy counts it */
        int64_t inrow = lo ? outn[lo - 1] : in1, rec = inrow;
        for (int i = lo; i < lo + sz[k]; i++) rec += outn[i];
        if (lo) bound += (uint64_t)(rows * inrow) * 4; /* the first slice's input is the batch itself */
        maxrec = (uint64_t)(mrows * rec) * 4 > maxrec ? (uint64_t)(mrows * rec) * 4 : maxrec;
    }
    out->flat = largest; /* a slice's flat */
    int prefetch = ct__plan_num(pl, "prefetch", 1) != 0, ahead = 1;
    /* the tied parameters' data, gradients, state and copies are resident from the start */
    uint64_t tmem = ct__offload_slice_bytes((int64_t)(tied / 4), (int64_t)(tlow / 2), nbufs);
    uint64_t fixed = pl->buffer_bytes + tmem;
    if (st == CT_OK)
        st = ct__offload_budget(prefetch, ct__plan_num(pl, "max_resident_mb", 0) /* "auto" reads as 0 */, fixed,
                                per, tmem, &ahead);
    /* the strategy allows three with prefetch; one rank holds two (the one
     * computing, the next loading), several three (an allreduce in flight) */
    if (ahead > 2 && pl->spec->world == 1) ahead = 2;
    /* the largest slices: pb[a] the a largest together */
    uint64_t pb[4] = {0, 0, 0, 0};
    for (int a = 1; st == CT_OK && a <= 3 && a <= ns; a++) {
        int best = 0;
        for (int k = 1; k < ns; k++)
            if (sp[k] > sp[best]) best = k;
        pb[a] = pb[a - 1] + sp[best];
        sp[best] = 0;
    }
    for (int a = ns + 1; a <= 3; a++) pb[a] = pb[ns < 3 ? ns : 3];
    /* two slices in full (a forward that applies the step), or three with
     * parameters and gradients (a backward whose allreduce is in flight) */
    int full = ahead < 2 ? ahead : 2;
    uint64_t act = 0;
    if (st == CT_OK && ckpt) {
        act = ct__plan_batch_bytes(pl, rows) + bound + maxrec;
    } else if (st == CT_OK) {
        /* every micro-batch's records stay until its backward (small ones
         * when the model has checkpoint wrappers); the output goes once
         * the loss has its gradient, which is scaled in place */
        ct_act_plan ap;
        st = ct__plan_stage_act(pl, 0, n, mrows, mixed, CT_ACT_HANDED, &ap);
        act = ct__plan_batch_bytes(pl, rows) + (uint64_t)(M - 1) * ap.kept + ap.peak;
    }
    if (st == CT_OK) {
        uint64_t both = pb[full] * (uint64_t)(2 + nbufs), three = 2 * pb[ahead];
        uint64_t lows = lowmax * (uint64_t)ahead; /* the compute copies of the slices in memory, at most */
        ct__plan_rank(out, pl->buffer_bytes + tied + tlow + pb[ahead] + lows, tied + pb[ahead],
                      (tied + pb[full]) * (uint64_t)nbufs, act, 0);
        uint64_t res = fixed + lows + (both > three ? both : three); /* the categories do not peak together at 3 */
        out->resident = res > out->resident ? out->resident : res;
        out->total = out->resident + out->act + out->comm;
    }
    ct_free(sz);
    ct_free(outn);
    ct_free(sp);
    ct_free(where);
    return st;
}

/*
 * Offload's step: forward slice by slice (each slice runs every
 * micro-batch while it is resident), backward in reverse (recomputing a
 * slice from its kept input under checkpoint_activation, with the same
 * context marked a recompute (as ct_module_recompute: dropout draws the same
 * masks, batchnorm statistics are not counted twice)), and the optimizer slice by
 * slice.  The store's I/O thread loads the next slice while this one
 * computes and writes back the one just used; jobs run in queue order, so
 * at most `ahead` slices hold memory at once (1: no prefetch; 2: the next
 * one loads meanwhile; 3: also a slice's gradient allreduce (DDP) runs
 * while the next slice computes).  The tied group is resident: its
 * gradients gather both uses during the backward and are reduced after the
 * last slice; it is stepped in ct__offload_pre_step.  bf16 compute copies
 * are cast after each load of a slice's data (and after its update).
 */
#include <math.h>
#include <string.h>

#include "offload.h"

static ct_status write_updated(ct_strategy *s, int i, int keep_data);

/* Rows [r0, r0 + n) of t: a view. */
static ct_status load(ct_strategy *s, int i, int mask, int grad_alloc, long *t)
{
    long a = 0, b = 0;
    if (mask & ~OFF_GRAD) CT_TRY(ct__offload_io(s, i, mask & ~OFF_GRAD, CT__IO_READ, &a));
    if (mask & OFF_GRAD) CT_TRY(ct__offload_io(s, i, OFF_GRAD, grad_alloc ? CT__IO_ALLOC : CT__IO_READ, &b));
    *t = b ? b : a;
    return CT_OK;
}

/* Norm terms of slice i's gradients, exactly as the replicated norm takes them. */
void ct__offload_norms(ct_strategy *s, const offload_slice *sl)
{
    offload_t *f = ct__offload(s);
    for (int k = 0; k < sl->np; k++) {
        int j = sl->pj[k];
        ct_param *p = s->params[j];
        ct_param_grad_sync(p);
        if (!p->grad || !p->requires_grad) continue;
        ct_norm_acc sq = ct_norm_acc_init(2.0), mx = ct_norm_acc_init(INFINITY);
        ct_norm_acc_tensor(&sq, p->grad);
        ct_norm_acc_tensor(&mx, p->grad);
        f->gsq[j] = sq.v;
        f->gmax[j] = mx.v;
    }
}

/* Slice i's gradients are final (reduced): note the norms, write them back
 * and release the slice. */
static ct_status finish_slice(ct_strategy *s, int i)
{
    offload_slice *sl = &ct__offload(s)->sl[i];
    if (sl->ar) {
        ct_status st = ct_work_wait(sl->ar);
        ct_work_destroy(sl->ar);
        sl->ar = NULL;
        CT_TRY(st);
    }
    ct__offload_norms(s, sl);
    long t;
    CT_TRY(ct__offload_io(s, i, OFF_GRAD, CT__IO_WRITE, &t));
    return ct__offload_io(s, i, OFF_DATA | OFF_LOW, CT__IO_DROP, &t);
}

/* Runs children [k0, k1) from *x (consumed) into *x; recs (may be NULL) get
 * one record per child. */
static ct_status run_slice(ct_strategy *s, const offload_slice *sl, ct_tensor **x, ct_record **recs,
                           const ct_fwd_ctx *ctx)
{
    for (int c = sl->k0; c < sl->k1; c++) {
        ct_tensor *out = NULL;
        ct_status st = ct_module_forward(s->model->kids[c], *x, &out, recs ? &recs[c] : NULL, ctx);
        ct_tensor_release(*x);
        *x = out;
        if (st != CT_OK) return st;
    }
    return CT_OK;
}

/* Backward of children [k0, k1) from *d (consumed) into *d (NULL when
 * want_din is 0 and this is the model's first child). */
static ct_status back_slice(ct_strategy *s, const offload_slice *sl, ct_tensor **d, ct_record **recs)
{
    for (int c = sl->k1 - 1; c >= sl->k0; c--) {
        ct_tensor *din = NULL;
        ct_record *r = recs[c];
        recs[c] = NULL;
        ct_status st = ct_module_backward(s->model->kids[c], *d, c ? &din : NULL, r);
        ct_tensor_release(*d);
        *d = din;
        if (st != CT_OK) return st;
    }
    return CT_OK;
}

/* After a failure: nothing of any slice stays resident, nothing in flight. */
static void unwind(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    ct__ostore_drain(f->store);
    for (int i = 0; i < f->ns; i++) {
        offload_slice *sl = &f->sl[i];
        if (sl->ar) {
            ct_work_wait(sl->ar);
            ct_work_destroy(sl->ar);
            sl->ar = NULL;
        }
        long t;
        ct__offload_io(s, i, OFF_DATA | OFF_GRAD | OFF_STATE | OFF_LOW, CT__IO_DROP, &t);
    }
    ct__ostore_drain(f->store);
    f->grads_zero = 1; /* the failed step's gradients are gone */
}

static void add_io_times(ct_strategy *s)
{
    double busy, waited;
    ct__ostore_times(ct__offload(s)->store, &busy, &waited);
    s->stats.io_total += busy;
    s->stats.io_wait += waited;
}

ct_status ct__offload_train_step(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                                 const ct_fwd_ctx *ctx, ct_step_out *out)
{
    offload_t *f = ct__offload(s);
    const offload_opts *O = ct__offload_opts(s);
    int M = O->microbatches, ns = f->ns, ckpt = O->checkpoint_activation, nk = s->model->nkids;
    int64_t nrows = b->x->shape[0];
    if (f->summoned)
        return ct_error(CT_ESTATE, "offload: a train step between ct_strategy_summon_full_params and its release; "
                        "release the full parameters first");
    if (nrows < M)
        return ct_error(CT_EINVAL, "offload: %lld rows on this rank cannot fill %d micro-batches; give every "
                        "rank at least %d rows or lower --microbatches", (long long)nrows, M, M);
    int64_t global = b->global_rows ? b->global_rows : nrows * ct__offload_ranks(s);
    int dist = ct__offload_ranks(s) > 1 && !s->no_sync;
    /* per micro-batch: the activation flowing (forward) or its gradient
     * (backward), the inputs kept under checkpointing, and one record per
     * child (micro-batch m's at recs + m * nk; with checkpoint_activation
     * only the slice being recomputed has them; without it, several
     * micro-batches need a checkpointed model, whose records are small) */
    size_t nkeep = ckpt ? (size_t)ns * (size_t)M : 0, nrec = (size_t)M * (size_t)nk;
    ct_tensor **act = ct_alloc_zeroed(sizeof *act * (size_t)M, CT_MEM_OTHER);
    ct_tensor **keep = ct_alloc_zeroed(sizeof *keep * (nkeep + 1), CT_MEM_OTHER);
    ct_record **recs = ct_alloc_zeroed(sizeof *recs * (nrec + 1), CT_MEM_OTHER);
    ct_fwd_ctx *cm = ct_alloc(sizeof *cm * (size_t)M, CT_MEM_OTHER);
    int64_t *nm = ct_alloc(sizeof *nm * (size_t)M, CT_MEM_OTHER);
    ct_status st = act && keep && recs && cm && nm ? CT_OK : CT_ENOMEM;
    int64_t r0 = 0;
    for (int m = 0; st == CT_OK && m < M; m++) {
        nm[m] = nrows / M + (m < nrows % M); /* as even as rows allow */
        cm[m] = *ctx;
        cm[m].sample0 = b->sample0 + r0;
        if (!(act[m] = ct_tensor_rows(b->x, r0, nm[m]))) st = CT_ENOMEM;
        r0 += nm[m];
    }
    double t0 = ct_now();
    long t = 0, tn = 0;
    /* ---- forward: slice by slice, every micro-batch while it is resident;
     * a slice the last step has not reached yet comes with its gradients and
     * state, is updated, and goes back while it computes ---- */
    const int all = OFF_DATA | OFF_GRAD | OFF_STATE, use = OFF_DATA | OFF_LOW;
    if (st == CT_OK) st = load(s, 0, f->sl[0].pending ? all | OFF_LOW : use, 0, &t);
    for (int i = 0; st == CT_OK && i < ns; i++) {
        offload_slice *sl = &f->sl[i];
        if ((st = ct__ostore_wait(f->store, t)) != CT_OK) break;
        if (f->ahead >= 2 && i + 1 < ns &&
            (st = load(s, i + 1, f->sl[i + 1].pending ? all | OFF_LOW : use, 0, &tn)) != CT_OK)
            break;
        if (sl->pending) {
            ct__offload_update(s, sl);
            if ((st = write_updated(s, i, 1)) != CT_OK) break;
        }
        ct__offload_cast(s, sl);
        for (int m = 0; st == CT_OK && m < M; m++) {
            if (ckpt) keep[(size_t)i * (size_t)M + (size_t)m] = ct_tensor_retain(act[m]);
            st = run_slice(s, sl, &act[m], ckpt ? NULL : recs + (size_t)m * (size_t)nk, &cm[m]);
        }
        if (st != CT_OK || i + 1 == ns) break; /* the last slice stays for backward */
        if ((st = ct__offload_io(s, i, use, CT__IO_DROP, &t)) != CT_OK) break;
        if (f->ahead < 2 && (st = load(s, i + 1, f->sl[i + 1].pending ? all | OFF_LOW : use, 0, &tn)) != CT_OK) break;
        t = tn;
    }
    /* ---- loss: act[m] becomes the scaled gradient of the global mean ---- */
    for (int m = 0; st == CT_OK && m < M; m++) {
        float l = 0;
        ct_tensor *dz = NULL;
        ct_tensor *y = ct_tensor_rows(b->y, (int64_t)(cm[m].sample0 - b->sample0), nm[m]);
        st = y ? loss(act[m], y, ud, &l, &dz) : CT_ENOMEM;
        ct_tensor_release(y);
        if (st != CT_OK) break;
        out->loss_sum += (double)l * (double)nm[m];
        out->rows += nm[m];
        float k = (float)((double)nm[m] / (double)global), *g = ct_f32(dz);
        for (int64_t e = 0; e < dz->numel; e++) g[e] *= k;
        ct_tensor_release(act[m]);
        act[m] = dz;
    }
    double t1 = ct_now();
    s->stats.forward += t1 - t0;
    /* ---- backward: slices in reverse, gradients written back as they finish ---- */
    int gz = f->grads_zero;
    if (gz) /* the tied group's gradients: every use adds, the first overwrites */
        for (int k = 0; k < f->tied.np; k++) s->params[f->tied.pj[k]]->grad_stale = 1;
    if (st == CT_OK) st = load(s, ns - 1, OFF_GRAD, gz, &t);
    for (int i = ns - 1; st == CT_OK && i >= 0; i--) {
        offload_slice *sl = &f->sl[i];
        if ((st = ct__ostore_wait(f->store, t)) != CT_OK) break;
        if (gz)
            for (int k = 0; k < sl->np; k++) s->params[sl->pj[k]]->grad_stale = 1; /* overwrite, not add */
        if (i + 1 < ns) ct__offload_cast(s, sl); /* loaded again (the last slice kept its copies) */
        if (f->ahead >= 2 && i > 0 && (st = load(s, i - 1, OFF_DATA | OFF_GRAD | OFF_LOW, gz, &tn)) != CT_OK) break;
        for (int m = 0; st == CT_OK && m < M; m++) {
            if (ckpt) {
                ct_tensor *x = keep[(size_t)i * (size_t)M + (size_t)m];
                keep[(size_t)i * (size_t)M + (size_t)m] = NULL;
                ct_fwd_ctx rc = cm[m];
                rc.recompute = 1; /* as ct_module_recompute: the same masks, not another batch */
                st = run_slice(s, sl, &x, recs + (size_t)m * (size_t)nk, &rc);
                ct_tensor_release(x);
                if (st != CT_OK) break;
            }
            st = back_slice(s, sl, &act[m], recs + (size_t)m * (size_t)nk);
        }
        if (st != CT_OK) break;
        if (dist) {
            /* Sum over ranks (the loss gradient carries 1/global); with room
             * for three slices it runs while the next slice computes. */
            int async = f->ahead >= 3;
            for (int k = 0; k < sl->np; k++) ct_param_grad_sync(s->params[sl->pj[k]]);
            st = ct_group_allreduce(s->g, ct_storage_ptr(sl->flat.st[CT__FL_GRAD]), sl->flat.numel, CT_F32, CT_OP_SUM, async ? &sl->ar : NULL);
        }
        if (st == CT_OK && i + 1 < ns && f->sl[i + 1].ar) st = finish_slice(s, i + 1);
        if (st == CT_OK && !sl->ar) st = finish_slice(s, i);
        if (st == CT_OK && f->ahead < 2 && i > 0) st = load(s, i - 1, OFF_DATA | OFF_GRAD | OFF_LOW, gz, &tn);
        t = tn;
    }
    if (st == CT_OK && f->sl[0].ar) st = finish_slice(s, 0);
    if (st == CT_OK) st = ct__offload_reduce_tied(s, dist);
    if (st == CT_OK) st = ct__ostore_drain(f->store);
    s->stats.backward += ct_now() - t1;
    for (int m = 0; act && m < M; m++) ct_tensor_release(act[m]);
    for (size_t k = 0; keep && k < nkeep; k++) ct_tensor_release(keep[k]);
    for (size_t c = 0; recs && c < nrec; c++) ct_record_destroy(recs[c]);
    ct_free(act);
    ct_free(keep);
    ct_free(recs);
    ct_free(cm);
    ct_free(nm);
    if (st != CT_OK) unwind(s);
    else f->grads_zero = 0;
    add_io_times(s);
    return st;
}

ct_status ct__offload_predict(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out)
{
    offload_t *f = ct__offload(s);
    CT_TRY(ct__offload_flush(s));
    long t = 0, tn = 0;
    ct_tensor *a = ct_tensor_retain(x);
    const int use = OFF_DATA | OFF_LOW;
    ct_status st = load(s, 0, use, 0, &t);
    for (int i = 0; st == CT_OK && i < f->ns; i++) {
        if ((st = ct__ostore_wait(f->store, t)) != CT_OK) break;
        if (f->ahead >= 2 && i + 1 < f->ns && (st = load(s, i + 1, use, 0, &tn)) != CT_OK) break;
        ct__offload_cast(s, &f->sl[i]);
        if ((st = run_slice(s, &f->sl[i], &a, NULL, ctx)) != CT_OK) break;
        if ((st = ct__offload_io(s, i, use, CT__IO_DROP, &t)) != CT_OK) break;
        if (f->ahead < 2 && i + 1 < f->ns && (st = load(s, i + 1, use, 0, &tn)) != CT_OK) break;
        t = tn;
    }
    if (st == CT_OK) st = ct__ostore_drain(f->store);
    if (st != CT_OK) {
        ct_tensor_release(a);
        unwind(s);
        return st;
    }
    *out = a;
    return CT_OK;
}

/* The pending optimizer step on resident slice i (parameters, gradients
 * and state in memory): the clip factors apply as ct_scale_grads would, the
 * update is the optimizer's own (ct_optim_update_range, bitwise what
 * ct_optim_step does on whole parameters: the updates are per element). */
void ct__offload_update(ct_strategy *s, offload_slice *sl)
{
    offload_t *f = ct__offload(s);
    /* The step's learning rate with the optimizer's groups as they are now:
     * pend_o's pointer to them may be stale after ct_optim_add_param_group. */
    ct_optim_opts step_o = f->pend_o;
    step_o.groups = ct_optim_get_opts(s->opt)->groups;
    step_o.ngroups = ct_optim_get_opts(s->opt)->ngroups;
    const ct_optim_opts *o = &step_o;
    float *state = sl->state ? ct_storage_ptr(sl->state) : NULL;
    int64_t off = 0;
    for (int k = 0; k < sl->np; k++) {
        ct_param *p = s->params[sl->pj[k]];
        int64_t n = p->data->numel;
        if (p->requires_grad && p->grad) {
            for (int q = 0; q < f->pend_nscales; q++)
                if (f->pend_smask[sl->pj[k]] & (1u << q)) ct_scale_grads(&p, 1, f->pend_scales[q]);
            float *bufs[CT_OPTIM_MAX_STATE] = {NULL};
            for (int b = 0; state && b < f->nstate; b++) bufs[b] = state + (int64_t)b * sl->flat.numel + off;
            ct_optim_opts po; /* the parameter's group's, at the step's learning rate */
            ct_optim_param_opts(o, p->name, &po);
            ct_optim_update_range(&po, ct_f32(p->data), ct_f32(p->grad), bufs, n, f->pend_step);
        }
        off += n;
    }
    sl->pending = 0;
}

/* Queues the write-back of slice i just updated: parameters saved (kept
 * for the forward that reads them), state written, gradients dropped, or
 * written when the clip factors changed them (a later step on the same
 * gradients, or a backward adding to them, sees the clipped ones, as in
 * PyTorch where clipping scales .grad in place). */
static ct_status write_updated(ct_strategy *s, int i, int keep_data)
{
    long t;
    CT_TRY(ct__offload_io(s, i, OFF_DATA, keep_data ? CT__IO_SAVE : CT__IO_WRITE, &t));
    CT_TRY(ct__offload_io(s, i, OFF_STATE, CT__IO_WRITE, &t));
    return ct__offload_io(s, i, OFF_GRAD, ct__offload(s)->pend_nscales ? CT__IO_WRITE : CT__IO_DROP, &t);
}

ct_status ct__offload_flush(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    int idx[1024], n = 0; /* slices still pending, in order (a partial forward left the rest) */
    for (int i = 0; i < f->ns; i++)
        if (f->sl[i].pending) {
            if (n == (int)(sizeof idx / sizeof idx[0])) break; /* the rest on the next call */
            idx[n++] = i;
        }
    if (!n) return CT_OK;
    const int all = OFF_DATA | OFF_GRAD | OFF_STATE;
    long t = 0, tn = 0;
    ct_status st = load(s, idx[0], all, 0, &t);
    for (int k = 0; st == CT_OK && k < n; k++) {
        if ((st = ct__ostore_wait(f->store, t)) != CT_OK) break;
        if (f->ahead >= 2 && k + 1 < n && (st = load(s, idx[k + 1], all, 0, &tn)) != CT_OK) break;
        ct__offload_update(s, &f->sl[idx[k]]);
        if ((st = write_updated(s, idx[k], 0)) != CT_OK) break;
        if (f->ahead < 2 && k + 1 < n && (st = load(s, idx[k + 1], all, 0, &tn)) != CT_OK) break;
        t = tn;
    }
    if (st == CT_OK) st = ct__ostore_drain(f->store);
    if (st != CT_OK) unwind(s);
    add_io_times(s);
    return st == CT_OK ? ct__offload_flush(s) : st; /* more than idx holds: again */
}

/* ct_strategy_step: the step is recorded (learning rate, step number, clip
 * factors) and applied to each slice in the next forward, which loads the
 * slice anyway (or by a flush before anything reads the state).  Then
 * ct_strategy_step counts it on the slot-less optimizer. */
ct_status ct__offload_pre_step(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    ct_optim_opts o = *ct_optim_get_opts(s->opt);
    CT_TRY(ct_optim_validate(&o));
    if (f->clip_overflow) {
        f->clip_overflow = 0;
        return ct_error(CT_EUNSUPPORTED, "offload: more than %d clips between two steps, the last ones with different "
                        "parameter filters; clip at most %d times a step", (int)(sizeof f->scales / sizeof f->scales[0]),
                        (int)(sizeof f->scales / sizeof f->scales[0]));
    }
    CT_TRY(ct__offload_flush(s)); /* an earlier step some slices still wait for */
    f->pend_o = o;
    f->pend_step = ct_optim_get_step(s->opt) + 1;
    memcpy(f->pend_scales, f->scales, sizeof f->scales);
    f->pend_nscales = f->nscales;
    memcpy(f->pend_smask, f->smask, (size_t)s->nparams);
    memset(f->smask, 0, (size_t)s->nparams);
    f->nscales = 0;
    for (int i = 0; i < f->ns; i++) f->sl[i].pending = 1;
    /* the tied group is resident: stepped now, its compute copies after it */
    ct__offload_update(s, &f->tied);
    ct__offload_cast(s, &f->tied);
    return CT_OK;
}

void ct__offload_cast(ct_strategy *s, const offload_slice *sl)
{
    for (int k = 0; sl->flat.st[CT__FL_LOW] && k < sl->np; k++) {
        ct_param *p = s->params[sl->pj[k]];
        if (p->compute) ct_f32_to_bf16_n(ct_f32(p->data), ct_tensor_data(p->compute), (size_t)p->data->numel);
    }
}

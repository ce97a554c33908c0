/*
 * Offload (fairscale's OffloadModel, after L2L and ZeRO-Offload, with the
 * store on local disk as in ZeRO-Infinity): set-up, the budget, and the
 * strategy entries other than the step (offload_step.c) and the checkpoint
 * state (offload_state.c).  A sequential model is cut into slices of
 * whole children, about equal in parameters; each slice's
 * parameters, gradients and optimizer state are flat storages that hold
 * memory only while the slice is in use, and live in the store's file
 * otherwise.  Parameters become views of their slice's storages (as FSDP's
 * flat parameters are), so layers run unchanged and names stay PyTorch's.
 * Between calls nothing of a slice is resident: state dicts read the file.
 * A parameter that children of two slices use (a tied weight) cannot live
 * in two slices' storages: it joins the tied group, resident throughout.
 * With param_dtype=bf16 a slice's compute copies live in a fourth storage
 * that is made from the data whenever the slice loads (never stored).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "offload.h"

static const ct__opt_def offload_opt_defs[] = {
    {"slices", CT__OPT_INT, offsetof(offload_opts, slices), "4",
     "slices the sequential is cut into (about equal parameter counts; the last takes the rest)", 0, NULL},
    {"balance", CT__OPT_TEXT, 0, "",
     "children of the sequential per slice, ':' separated (3:3:2); empty: by parameter count", 0, NULL},
    {"checkpoint_activation", CT__OPT_BOOL, offsetof(offload_opts, checkpoint_activation), "0",
     "keep only each slice's input in forward and recompute the slice in backward", 0, NULL},
    {"microbatches", CT__OPT_INT, offsetof(offload_opts, microbatches), "1",
     "micro-batches per step, each slice runs all of them while resident (needs checkpoint_activation, or "
     "a model with checkpoint wrappers)",
     0, NULL},
    {"dir", CT__OPT_TEXT, 0, "",
     "directory of the offload file (empty: $TMPDIR, else /tmp); the file is unlinked at once", 0, NULL},
    {"max_resident_mb", CT__OPT_AUTO_INT, offsetof(offload_opts, max_resident_mb), "auto",
     "bound in MiB on resident parameter + gradient + optimizer bytes (auto: no bound)", 0, NULL},
    {"prefetch", CT__OPT_BOOL, offsetof(offload_opts, prefetch), "1",
     "load the next slice while this one computes (when the budget holds two)", 0, NULL},
    {"drop_cache", CT__OPT_BOOL, offsetof(offload_opts, drop_cache), "1",
     "drop the store's pages from the page cache after each read and write (RAM stays free)", 0, NULL},
    {"store", CT__OPT_CHOICE, offsetof(offload_opts, store), "file",
     "where slices not in use live: file (in dir, on disk) or memory (a pool in RAM, counted as other)", 0,
     "file|memory"},
};

#define MIB 1048576.0

/* ---- slices ----------------------------------------------------------------- */

static int is_sequential(const ct_module *m) { return ct_module_is(m, CT_MOD_SEQUENTIAL); }

/* w[k]: elements of the parameters child k lists that no earlier child (nor
 * seq itself) does, so a tied weight counts once, where it first appears. */
static ct_status child_weights(ct_module *seq, int64_t *w)
{
    ct_param **all;
    int na, seen = seq->nparams; /* seq's own come first in the model's list */
    CT_TRY(ct_module_params(seq, &all, &na));
    ct_status st = CT_OK;
    for (int k = 0; k < seq->nkids && st == CT_OK; k++) {
        ct_param **ps;
        int np;
        if ((st = ct_module_params(seq->kids[k], &ps, &np)) != CT_OK) break;
        w[k] = 0;
        int fresh = 0;
        for (int j = 0; j < np; j++) {
            int old = 0;
            for (int q = 0; q < seen && !old; q++) old = all[q] == ps[j];
            if (!old) {
                w[k] += ps[j]->data->numel;
                fresh++;
            }
        }
        seen += fresh;
        ct_free(ps);
    }
    ct_free(all);
    return st;
}

ct_status ct_offload_split(ct_module *seq, int nslices, int *sizes)
{
    if (!is_sequential(seq))
        return ct_error(CT_EINVAL, "offload needs a sequential model (its children become slices); got '%s'",
                        seq ? seq->ops->kind : "(null)");
    int n = seq->nkids;
    if (nslices < 1 || n < nslices)
        return ct_error(CT_EINVAL, "cannot cut %d children into %d slices: every slice needs a child; "
                        "use at most %d slices", n, nslices, n);
    int64_t *wk = ct_alloc(sizeof *wk * (size_t)n, CT_MEM_OTHER);
    if (!wk) return CT_ENOMEM;
    ct_status st = child_weights(seq, wk);
    if (st != CT_OK) {
        ct_free(wk);
        return st;
    }
    int64_t total = 0;
    for (int k = 0; k < n; k++) total += wk[k];
    /* fairscale's split, to the nearest boundary: a slice closes before a
     * child when the slices so far are then closer to their share of the
     * parameters (cumulative, so rounding does not pile onto the last) than
     * with it; a child without parameters stays with the slice before it;
     * every slice still to come keeps a child. */
    int j = 0, cnt = 0;
    int64_t acc = 0;
    for (int k = 0; k < n; k++) {
        int64_t w = wk[k];
        if (j < nslices - 1 && cnt > 0) {
            double target = (double)total * (j + 1) / nslices;
            int must = n - k == nslices - j - 1; /* the rest are one child per slice */
            if (must || fabs((double)acc - target) < fabs((double)(acc + w) - target)) {
                sizes[j++] = cnt;
                cnt = 0;
            }
        }
        acc += w;
        cnt++;
    }
    sizes[j++] = cnt;
    ct_free(wk);
    CT_ASSERT(j == nslices && cnt > 0);
    return CT_OK;
}

ct_status ct__offload_where(ct_module *seq, const int *sz, int ns, ct_param *const *params, int np, int *where)
{
    for (int j = 0; j < np; j++) where[j] = -1;
    for (int i = 0, c = 0; i < ns; i++)
        for (int end = c + sz[i]; c < end; c++) {
            ct_param **ps;
            int n;
            CT_TRY(ct_module_params(seq->kids[c], &ps, &n));
            for (int q = 0; q < n; q++) {
                int j = 0;
                while (j < np && params[j] != ps[q]) j++;
                if (j < np) where[j] = where[j] < 0 || where[j] == i ? i : ns;
            }
            ct_free(ps);
        }
    return CT_OK;
}

/* Each parameter goes to its slice or the tied group (ct__offload_where),
 * and every group's parameters are laid out as a flat.  Sets where, eoff,
 * and every group's pj, n and nlow. */
static ct_status group_params(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    int ns = f->ns, np = s->nparams;
    f->where = ct_alloc(sizeof *f->where * (size_t)(np + 1), CT_MEM_OTHER);
    f->eoff = ct_alloc(sizeof *f->eoff * (size_t)(np + 1), CT_MEM_OTHER);
    int *pjs = ct_alloc(sizeof *pjs * (size_t)(np + 1), CT_MEM_OTHER);
    f->pjs = pjs;
    int *sz = ct_alloc(sizeof *sz * (size_t)(ns + 1), CT_MEM_OTHER);
    ct_status st = f->where && f->eoff && pjs && sz ? CT_OK : CT_ENOMEM;
    for (int i = 0; st == CT_OK && i < ns; i++) sz[i] = f->sl[i].k1 - f->sl[i].k0;
    if (st == CT_OK) st = ct__offload_where(s->model, sz, ns, s->params, np, f->where);
    ct_free(sz);
    CT_TRY(st);
    /* pj runs laid end to end in pjs: the slices in order, then the tied group;
     * each group's parameters laid out as a flat */
    int at = 0;
    int low = s->common.param_dtype != CT_F32;
    ct_param **ps = ct_alloc(sizeof *ps * (size_t)(np + 1), CT_MEM_OTHER);
    if (!ps) return CT_ENOMEM;
    for (int g = 0; g <= ns && st == CT_OK; g++) {
        offload_slice *sl = g < ns ? &f->sl[g] : &f->tied;
        sl->pj = pjs + at;
        for (int j = 0; j < np; j++) {
            CT_ASSERT(f->where[j] >= 0); /* the sequential has no parameters of its own */
            if (f->where[j] != g) continue;
            ps[at - (int)(sl->pj - pjs)] = s->params[j];
            pjs[at++] = j;
        }
        sl->np = (int)(pjs + at - sl->pj);
        st = ct__flat_init(&sl->flat, ps, sl->np, 1, 0, low);
        for (int k = 0; st == CT_OK && k < sl->np; k++) f->eoff[sl->pj[k]] = sl->flat.off[k];
    }
    ct_free(ps);
    return st;
}

/* 1 if a child of seq is a checkpoint wrapper (its micro-batches keep only inputs there). */
static int checkpointed(const ct_module *seq)
{
    for (int i = 0; i < seq->nkids; i++)
        if (ct_module_is(seq->kids[i], CT_MOD_CHECKPOINT)) return 1;
    return 0;
}

static ct_status offload_init(ct_strategy *s)
{
    const offload_opts *O = ct__offload_opts(s);
    if (!is_sequential(s->model))
        return ct_error(CT_EINVAL, "offload needs a sequential model (its children become slices); got '%s'",
                        s->model->ops->kind);
    if (s->model->nparams)
        return ct_error(CT_EINVAL, "offload: the sequential has parameters of its own; put them in a child");
    if (O->microbatches > 1 && !O->checkpoint_activation && !checkpointed(s->model))
        return ct_error(CT_EINVAL, "offload: %d micro-batches need checkpoint_activation or a checkpointed model (as in fairscale: "
                        "without it each micro-batch's activations would stay for every slice); pass "
                        "--checkpoint-activation (ct_module_apply_activation_checkpointing), checkpoint_activation=1 "
                        "or --microbatches 1", O->microbatches);
    if (s->common.grad_accum != 1)
        return ct_error(CT_EINVAL, "offload: grad_accum=%d is not taken; offload splits the batch with "
                        "microbatches=N (--microbatches)", s->common.grad_accum);
    if (s->common.reduce_dtype != CT_F32)
        return ct_error(CT_EUNSUPPORTED, "offload reduces f32 gradients (a slice's are summed in its flat f32 "
                        "storage); drop reduce_dtype (--grad-compress) with offload");
    for (int i = 0; i < s->nparams; i++) {
        if (s->params[i]->data->dtype != CT_F32)
            return ct_error(CT_EUNSUPPORTED, "offload: parameter '%s' is %s; offload takes f32 parameters",
                            s->params[i]->name, ct_dtype_name(s->params[i]->data->dtype));
        if (s->params[i]->compute)
            return ct_error(CT_ESTATE, "parameter '%s' already has a compute copy: is the model wrapped by "
                            "another mixed-precision strategy?", s->params[i]->name);
    }
    offload_t *f = ct_alloc_zeroed(sizeof *f, CT_MEM_OTHER);
    if (!f) return CT_ENOMEM;
    s->priv = f;
    int *sizes = NULL, ns = 0;
    const char *balance = ct_strategy_opt(s, "balance");
    if (balance && balance[0]) {
        CT_TRY(ct__parse_balance("offload", balance, s->model->nkids, &sizes, &ns));
    } else {
        if (!(sizes = ct_alloc(sizeof *sizes * (size_t)(O->slices > 0 ? O->slices : 1), CT_MEM_OTHER)))
            return CT_ENOMEM;
        ct_status st = ct_offload_split(s->model, O->slices, sizes);
        if (st != CT_OK) {
            ct_free(sizes);
            return st;
        }
        ns = O->slices;
    }
    f->sl = ct_alloc_zeroed(sizeof *f->sl * (size_t)ns, CT_MEM_OTHER);
    f->gsq = ct_alloc_zeroed(sizeof *f->gsq * (size_t)(s->nparams + 1), CT_MEM_OTHER);
    f->gmax = ct_alloc_zeroed(sizeof *f->gmax * (size_t)(s->nparams + 1), CT_MEM_OTHER);
    f->smask = ct_alloc_zeroed((size_t)(s->nparams + 1), CT_MEM_OTHER);
    f->pend_smask = ct_alloc_zeroed((size_t)(s->nparams + 1), CT_MEM_OTHER);
    if (!f->sl || !f->gsq || !f->gmax || !f->smask || !f->pend_smask) {
        ct_free(sizes);
        return CT_ENOMEM;
    }
    f->ns = ns;
    int k = 0;
    char text[OFF_TEXT_MAX];
    int toff = 0;
    for (int i = 0; i < ns; i++) {
        f->sl[i].k0 = k;
        f->sl[i].k1 = k += sizes[i];
        if (toff < (int)sizeof text) toff += snprintf(text + toff, sizeof text - (size_t)toff, "%s%d", i ? ":" : "", sizes[i]);
    }
    ct_free(sizes);
    CT_TRY(group_params(s));
    CT_TRY(ct__opts_set_text(s, "balance", text));
    if (ct__offload_ranks(s) > 1) {
        CT_TRY(ct_group_check(s->g, ct__check_same_model(s)));
        CT_TRY(ct__broadcast_state(s, 0));
    }
    return CT_OK;
}

/* ---- the store: layout, first write, budget ---------------------------------- */

/* Bytes of slice sl in the file: parameters, gradients, optimizer state. */
static size_t file_bytes(const offload_t *f, const offload_slice *sl)
{
    return (size_t)sl->flat.numel * sizeof(float) * (size_t)(2 + f->nstate);
}

/* Bytes of slice sl when resident: those and its bf16 compute copies. */
static size_t mem_bytes(const offload_t *f, const offload_slice *sl)
{
    return ct__offload_slice_bytes(sl->flat.numel, sl->flat.nlow, f->nstate);
}

ct_status ct__offload_budget(int prefetch, double budget_mb, size_t fixed, size_t largest, size_t tied, int *ahead)
{
    *ahead = prefetch ? 3 : 1;
    if (budget_mb <= 0) return CT_OK;
    size_t budget = (size_t)(budget_mb * MIB);
    char t[128] = "";
    if (tied)
        snprintf(t, sizeof t, " (%.2f MiB of them for parameters two slices use, which stay)", (double)tied / MIB);
    if (fixed + largest > budget)
        return ct_error(CT_EINVAL, "offload: the largest slice needs %.2f MiB resident (parameters, "
                        "gradients and optimizer state) on top of %.2f MiB already resident%s, over the "
                        "budget of %.0f MiB; use more slices (--slices) or raise --max-resident-mb to at least %.0f",
                        (double)largest / MIB, (double)fixed / MIB, t, budget_mb,
                        ceil((double)(fixed + largest) / MIB));
    size_t room = (budget - fixed) / largest;
    if ((size_t)*ahead > room) *ahead = (int)room;
    return CT_OK;
}


ct_status ct__offload_io(ct_strategy *s, int i, int mask, int op, long *ticket)
{
    offload_t *f = ct__offload(s);
    offload_slice *sl = &f->sl[i];
    ct__io_piece p[CT__IO_MAX_PIECES];
    int n = 0;
    if (mask & OFF_DATA) p[n++] = (ct__io_piece){sl->flat.st[CT__FL_DATA], sl->off, op};
    if (mask & OFF_GRAD) p[n++] = (ct__io_piece){sl->flat.st[CT__FL_GRAD], ct__offload_grad_off(sl), op};
    if ((mask & OFF_STATE) && sl->state) p[n++] = (ct__io_piece){sl->state, ct__offload_state_off(sl), op};
    /* compute copies are made from the data, never stored: memory back, or gone */
    if ((mask & OFF_LOW) && sl->flat.st[CT__FL_LOW])
        p[n++] = (ct__io_piece){sl->flat.st[CT__FL_LOW], 0, op == CT__IO_READ || op == CT__IO_ALLOC ? CT__IO_ALLOC : CT__IO_DROP};
    *ticket = 0;
    return n ? ct__ostore_submit(f->store, p, n, ticket) : CT_OK;
}

/* Moves sl's parameters into its flat storages (made here): their data,
 * zero gradients and state, and views of the compute copies for those the
 * mixed-precision policy gives one. */
static ct_status move_in(ct_strategy *s, offload_slice *sl)
{
    offload_t *f = ct__offload(s);
    ct__flat *fl = &sl->flat;
    CT_TRY(ct__flat_storage(fl, CT__FL_DATA, CT_MEM_PARAM, 1, 0, NULL));
    CT_TRY(ct__flat_storage(fl, CT__FL_GRAD, CT_MEM_GRAD, 1, 1, NULL));
    if (fl->nlow) CT_TRY(ct__flat_storage(fl, CT__FL_LOW, CT_MEM_PARAM, 1, 0, NULL));
    if (f->nstate && !(sl->state = ct_storage_create((size_t)fl->numel * 4 * (size_t)f->nstate, CT_MEM_OPTIM, 1)))
        return CT_ENOMEM;
    CT_TRY(ct__flat_move(fl, CT__FL_BIT(CT__FL_DATA) | CT__FL_BIT(CT__FL_GRAD) | CT__FL_BIT(CT__FL_LOW),
                         CT__FL_BIT(CT__FL_DATA)));
    for (int k = 0; k < fl->n; k++) fl->p[k]->grad_stale = 0; /* zeroed storage */
    return CT_OK;
}

/* Moves slice i's parameters into its storages and writes the slice out:
 * its data, zero gradients and zero optimizer state. */
static ct_status offload_slice_out(ct_strategy *s, int i)
{
    offload_t *f = ct__offload(s);
    CT_TRY(move_in(s, &f->sl[i]));
    long t;
    CT_TRY(ct__offload_io(s, i, OFF_DATA | OFF_GRAD | OFF_STATE | OFF_LOW, CT__IO_WRITE, &t));
    return ct__ostore_wait(f->store, t);
}

static ct_status offload_build_optim(ct_strategy *s, const ct_optim_opts *o)
{
    offload_t *f = ct__offload(s);
    const offload_opts *O = ct__offload_opts(s);
    /* The optimizer keeps the step count, learning rate and state names; the
     * updates run per resident slice on the store's state (offload_step.c). */
    if (!(s->opt = ct_optim_create_slots(o, NULL, 0))) return ct_last_status(); /* CT_ENOMEM stays CT_ENOMEM */
    f->nstate = ct_optim_state_names(s->opt, NULL);
    size_t total = 0, largest = 0;
    for (int i = 0; i < f->ns; i++) {
        f->sl[i].off = (off_t)total;
        total += file_bytes(f, &f->sl[i]);
        if (mem_bytes(f, &f->sl[i]) > largest) largest = mem_bytes(f, &f->sl[i]);
    }
    CT_TRY(ct__ostore_open(O->store == OFF_STORE_MEMORY, ct_strategy_opt(s, "dir"), total, O->drop_cache, &f->store));
    for (int i = 0; i < f->ns; i++) CT_TRY(offload_slice_out(s, i));
    if (f->tied.np) { /* resident from here on: counted in fixed below, so in the budget */
        CT_TRY(move_in(s, &f->tied));
        ct__offload_cast(s, &f->tied);
    }
    ct_mem_report r;
    ct_mem_report_get(&r);
    f->fixed = r.resident;
    CT_TRY(ct__offload_budget(O->prefetch, O->max_resident_mb, f->fixed, largest,
                              f->tied.np ? mem_bytes(f, &f->tied) : 0, &f->ahead));
    if (O->max_resident_mb && f->ahead < 2 && O->prefetch)
        ct_log(CT_LOG_WARN, "offload: the budget of %d MiB holds one slice of %.2f MiB, not two: slices "
               "load without prefetch (a budget for two slices lets I/O overlap compute)", O->max_resident_mb,
               (double)largest / MIB);
    f->grads_zero = 1;
    f->ready = 1;
    return CT_OK;
}

/* Reads parameter j of a slice not in memory from the store; after a
 * failed read, zeros without reading again. */
typedef struct {
    offload_t *f;
    const offload_slice *sl;
    int *ok;
} fetch_ctx;

static ct_status fetch_from_store(void *ud, int j, float *dst)
{
    fetch_ctx *c = ud;
    size_t bytes = (size_t)c->sl->flat.p[j]->data->numel * 4;
    if (!*c->ok) {
        memset(dst, 0, bytes);
        return CT_OK;
    }
    ct_status st = ct__ostore_rw(c->f->store, 0, dst, bytes, c->sl->off + (off_t)(c->sl->flat.off[j] * 4));
    if (st != CT_OK) *c->ok = 0;
    return st;
}

/* Gives slice sl's moved parameters tensors of their own again, with the
 * data from memory (the tied group) or from the store (zeros once a read
 * failed: *ok 0). */
static void move_out(ct_strategy *s, offload_slice *sl, int *ok)
{
    fetch_ctx c = {ct__offload(s), sl, ok};
    ct__flat_unpoint(&sl->flat, fetch_from_store, &c);
}

static void release_slice(offload_slice *sl)
{
    ct__flat_fini(&sl->flat);
    ct_storage_release(sl->state);
}

/* Frees, and reads nothing back: the parameters leave without memory, so
 * a teardown never holds the whole model (the store is what made it fit).
 * The explicit unwrap is to summon the full parameters first: then every
 * parameter leaves with its values, as after a set-up that failed. */
static void offload_fini(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    if (!f) return;
    int keep = f->summoned || !f->ready, ok = 1;
    if (keep) ok = f->store && ct__ostore_drain(f->store) == CT_OK && ct__offload_flush(s) == CT_OK;
    else if (f->store) ct__ostore_drain(f->store);
    if (keep && f->store && !ok)
        ct_log(CT_LOG_WARN, "offload: the store failed (%s); the unwrapped model's parameters are zeros: load "
               "the last checkpoint", ct_last_error());
    for (int i = 0; f->sl && i < f->ns; i++) {
        offload_slice *sl = &f->sl[i];
        if (sl->ar) {
            ct_work_wait(sl->ar);
            ct_work_destroy(sl->ar);
        }
        if (!keep && sl->pj && ct__flat_resident(&sl->flat, CT__FL_DATA)) ct__flat_evict(&sl->flat, CT__FL_DATA);
        if (sl->pj && keep) move_out(s, sl, &ok);
        else if (sl->pj) ct__flat_unpoint(&sl->flat, NULL, NULL);
    }
    if (f->tied.pj && keep) move_out(s, &f->tied, &ok);
    else if (f->tied.pj) {
        if (ct__flat_resident(&f->tied.flat, CT__FL_DATA)) ct__flat_evict(&f->tied.flat, CT__FL_DATA);
        ct__flat_unpoint(&f->tied.flat, NULL, NULL);
    }
    ct__ostore_close(f->store);
    for (int i = 0; f->sl && i < f->ns; i++) release_slice(&f->sl[i]);
    release_slice(&f->tied);
    ct_free(f->sl);
    ct_free(f->where);
    ct_free(f->eoff);
    ct_free(f->pjs);
    ct_free(f->gsq);
    ct_free(f->gmax);
    ct_free(f->smask);
    ct_free(f->pend_smask);
    ct_free(f);
    s->priv = NULL;
}

/* ---- entries --------------------------------------------------------------- */

static ct_status not_here(ct_strategy *s)
{
    (void)s;
    return ct_error(CT_ESTATE, "offload keeps the parameters in its store between calls: run forward and "
                    "backward through ct_strategy_train_step (inference: ct_strategy_predict)");
}

/* Term of parameter j's resident gradient for acc's norm type, with the
 * clip factors recorded since backward (which the gradients in the store
 * have not had yet) applied to it. */
static double term_scaled(ct_strategy *s, const ct_norm_acc *acc, int j, const float *k, int nk)
{
    ct_param *p = s->params[j];
    ct_param_grad_sync(p);
    if (!p->grad || !p->requires_grad) return 0;
    ct_norm_acc one = ct_norm_acc_init(acc->p);
    ct_norm_acc_tensor(&one, p->grad);
    for (int i = 0; i < nk; i++) one.v = ct_norm_acc_scaled(&one, one.v, k[i]);
    return one.v;
}

/* The clip factors parameter j's gradient in the store has yet to take,
 * into ks (room for 16): a step still pending on its slice scales first,
 * then the clips since; each only where its clip's filter took j. */
static int factors_of(const offload_t *f, int j, int pending, float *ks)
{
    int nk = 0;
    for (int q = 0; pending && q < f->pend_nscales; q++)
        if (f->pend_smask[j] & (1u << q)) ks[nk++] = f->pend_scales[q];
    for (int q = 0; q < f->nscales; q++)
        if (f->smask[j] & (1u << q)) ks[nk++] = f->scales[q];
    return nk;
}

/* A norm type the slices did not note as they finished (a p other than 2
 * and infinity): each slice's gradients are read back from the store, one
 * slice at a time (bounded memory: one slice's gradients), measured and
 * dropped; the terms are added in parameter order. */
static ct_status norm_from_store(ct_strategy *s, ct_norm_acc *acc)
{
    offload_t *f = ct__offload(s);
    if (f->grads_zero) return CT_OK; /* no backward since zero_grad: every term is 0 */
    double *term = ct_alloc_zeroed(sizeof *term * (size_t)(s->nparams + 1), CT_MEM_OTHER);
    if (!term) return ct_error(CT_ENOMEM, "offload: no memory for %d norm terms", s->nparams);
    ct_status st = CT_OK;
    float ks[16];
    for (int k = 0; k < f->tied.np; k++)
        term[f->tied.pj[k]] = term_scaled(s, acc, f->tied.pj[k], ks, factors_of(f, f->tied.pj[k], 0, ks));
    for (int i = 0; st == CT_OK && i < f->ns; i++) {
        offload_slice *sl = &f->sl[i];
        long t;
        if ((st = ct__offload_io(s, i, OFF_GRAD, CT__IO_READ, &t)) != CT_OK) break;
        if ((st = ct__ostore_wait(f->store, t)) != CT_OK) break;
        for (int k = 0; k < sl->np; k++) {
            int j = sl->pj[k];
            term[j] = term_scaled(s, acc, j, ks, factors_of(f, j, sl->pending, ks));
        }
        if ((st = ct__offload_io(s, i, OFF_GRAD, CT__IO_DROP, &t)) != CT_OK) break;
        st = ct__ostore_wait(f->store, t);
    }
    for (int j = 0; st == CT_OK && j < s->nparams; j++)
        if (ct__clip_selects(s, s->params[j])) ct_norm_acc_add(acc, term[j]);
    ct_free(term);
    return st;
}

/* The terms each slice left when its gradients were final, added in
 * parameter order as the replicated norm adds them: bitwise equal. */
static ct_status offload_grad_norm(ct_strategy *s, ct_norm_acc *acc)
{
    offload_t *f = ct__offload(s);
    if (!acc->inf && acc->p != 2.0) return norm_from_store(s, acc);
    for (int i = 0; i < s->nparams; i++)
        if (s->params[i]->requires_grad && s->params[i]->grad && ct__clip_selects(s, s->params[i]))
            ct_norm_acc_add(acc, acc->inf ? f->gmax[i] : f->gsq[i]);
    return CT_OK;
}

/* Gradients are in the store: the factor waits for the step, which applies
 * it (as ct_scale_grads would, one multiply per factor) while the slice is
 * resident.  The norms kept follow, up to rounding. */
static void offload_scale_grads(ct_strategy *s, float k)
{
    offload_t *f = ct__offload(s);
    int q = f->nscales;
    if (q == (int)(sizeof f->scales / sizeof f->scales[0])) {
        q--; /* more clips than anyone does in one step: fold into the last, when it took the same parameters */
        for (int i = 0; i < s->nparams; i++)
            if (!(f->smask[i] & (1u << q)) != !ct__clip_selects(s, s->params[i])) {
                f->clip_overflow = 1; /* the step says so: void here */
                return;
            }
        f->scales[q] *= k;
    } else {
        f->scales[f->nscales++] = k;
    }
    for (int i = 0; i < s->nparams; i++) {
        if (!ct__clip_selects(s, s->params[i])) continue; /* a clip's filter left it out */
        f->smask[i] |= (unsigned char)(1u << q);
        f->gsq[i] *= (double)k * (double)k;
        f->gmax[i] = (double)((float)f->gmax[i] * fabsf(k)); /* as the scaled f32 gradients' max */
    }
}

static void offload_zero_grad(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    f->grads_zero = 1;
    f->nscales = 0;
    f->clip_overflow = 0;
    memset(f->smask, 0, (size_t)s->nparams);
    memset(f->gsq, 0, sizeof *f->gsq * (size_t)s->nparams);
    memset(f->gmax, 0, sizeof *f->gmax * (size_t)s->nparams);
    for (int k = 0; k < f->tied.np; k++) s->params[f->tied.pj[k]]->grad_stale = 1; /* resident: lazily, as none */
}

ct_status ct__offload_reduce_tied(ct_strategy *s, int allreduce)
{
    offload_t *f = ct__offload(s);
    if (!f->tied.np) return CT_OK;
    for (int k = 0; k < f->tied.np; k++) ct_param_grad_sync(s->params[f->tied.pj[k]]);
    if (allreduce)
        CT_TRY(ct_group_allreduce(s->g, ct_storage_ptr(f->tied.flat.st[CT__FL_GRAD]), f->tied.flat.numel, CT_F32, CT_OP_SUM, NULL));
    ct__offload_norms(s, &f->tied);
    return CT_OK;
}

/* Gradients kept local under no_sync: reduce them slice by slice now. */
static ct_status offload_reduce(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    if (ct__offload_ranks(s) == 1) return CT_OK;
    CT_TRY(ct__offload_flush(s)); /* a step still pending used the gradients before this */
    for (int i = 0; i < f->ns; i++) {
        offload_slice *sl = &f->sl[i];
        long t;
        CT_TRY(ct__offload_io(s, i, OFF_GRAD, CT__IO_READ, &t));
        CT_TRY(ct__ostore_wait(f->store, t));
        CT_TRY(ct_group_allreduce(s->g, ct_storage_ptr(sl->flat.st[CT__FL_GRAD]), sl->flat.numel, CT_F32, CT_OP_SUM, NULL));
        ct__offload_norms(s, sl);
        CT_TRY(ct__offload_io(s, i, OFF_GRAD, CT__IO_WRITE, &t));
        CT_TRY(ct__ostore_wait(f->store, t));
    }
    return ct__offload_reduce_tied(s, 1);
}

/* The step is recorded and applied slice by slice later (offload_step.c);
 * the slot-less optimizer counts it. */
static ct_status offload_step(ct_strategy *s)
{
    CT_TRY(ct__offload_pre_step(s));
    return ct_optim_step(s->opt);
}

void ct_strategy_offload_info(const ct_strategy *s, int *nslices, int *ahead)
{
    const offload_t *f = !strcmp(ct_strategy_kind(s), "offload") ? ct__offload(s) : NULL;
    *nslices = f ? f->ns : 0;
    *ahead = f ? f->ahead : 0;
}

const ct__strategy_ops ct__offload_ops = {
    .kind = "offload",
    .opts = offload_opt_defs,
    .nopts = (int)(sizeof offload_opt_defs / sizeof offload_opt_defs[0]),
    .opts_size = sizeof(offload_opts),
    .runs_alone = 1,
    .manages_compute = 1, /* a slice's compute copies exist while it is resident (offload_step.c) */
    .makes_params = 1,    /* one slice at a time, straight into the store */
    .place = {
        .init = offload_init,
        .fini = offload_fini,
        .summon = ct__offload_summon,
        .release = ct__offload_release,
        .build_optim = offload_build_optim,
    },
    .sync = {
        .pre_forward = not_here,
        .pre_backward = not_here,
        .grad_norm = offload_grad_norm,
        .scale_grads = offload_scale_grads,
        .reduce = offload_reduce,
        .step = offload_step,
        .zero_grad = offload_zero_grad,
        .train_step = ct__offload_train_step,
        .predict = ct__offload_predict,
    },
    .state = {
        .model = ct__offload_model_state,
        .optim = ct__offload_optim_state,
        .each = ct__offload_each,
        .load = ct__offload_load_state,
    },
};

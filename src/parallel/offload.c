/*
 * Offload (fairscale's OffloadModel, after L2L and ZeRO-Offload, with the
 * store on local disk as in ZeRO-Infinity): set-up, the budget, and the
 * strategy entries other than the step.  A sequential model is cut into
 * slices of whole children, about equal in parameters; each slice's
 * parameters, gradients and optimizer state are flat storages that hold
 * memory only while the slice is in use, and live in the store's file
 * otherwise.  Parameters become views of their slice's storages (as FSDP's
 * flat parameters are), so layers run unchanged and names stay PyTorch's.
 * Between calls nothing of a slice is resident: state dicts read the file.
 * The forward/backward/step streaming is in offload_step.c.
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
     "micro-batches per step, each slice runs all of them while resident (needs checkpoint_activation)",
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

static int is_sequential(const ct_module *m) { return m && !strcmp(m->ops->kind, "sequential"); }

ct_status ct_offload_split(ct_module *seq, int nslices, int *sizes)
{
    if (!is_sequential(seq))
        return ct_error(CT_EINVAL, "offload needs a sequential model (its children become slices); got '%s'",
                        seq ? seq->ops->kind : "(null)");
    int n = seq->nkids;
    if (nslices < 1 || n < nslices)
        return ct_error(CT_EINVAL, "cannot cut %d children into %d slices: every slice needs a child; "
                        "use at most %d slices", n, nslices, n);
    int64_t total = 0;
    for (int k = 0; k < n; k++) total += ct_module_num_params(seq->kids[k]);
    /* fairscale's split, to the nearest boundary: a slice closes before a
     * child when the slices so far are then closer to their share of the
     * parameters (cumulative, so rounding does not pile onto the last) than
     * with it; a child without parameters stays with the slice before it;
     * every slice still to come keeps a child. */
    int j = 0, cnt = 0;
    int64_t acc = 0;
    for (int k = 0; k < n; k++) {
        int64_t w = ct_module_num_params(seq->kids[k]);
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
    CT_ASSERT(j == nslices && cnt > 0);
    return CT_OK;
}

/* A parameter used by two children of the sequential (a tied weight, such
 * as the gpt's embedding and head) would live in two slices' flat storages
 * at once; refuse it with the reason rather than train two copies. */
static ct_status check_untied(ct_strategy *s)
{
    int *child = ct_alloc(sizeof *child * ((size_t)s->nparams + 1), CT_MEM_OTHER);
    if (!child) return CT_ENOMEM;
    for (int i = 0; i < s->nparams; i++) child[i] = -1;
    ct_status st = CT_OK;
    for (int c = 0; c < s->model->nkids && st == CT_OK; c++) {
        ct_param **ps;
        int np;
        if ((st = ct_module_params(s->model->kids[c], &ps, &np)) != CT_OK) break;
        for (int j = 0; j < np && st == CT_OK; j++)
            for (int i = 0; i < s->nparams; i++) {
                if (s->params[i] != ps[j]) continue;
                if (child[i] >= 0 && child[i] != c)
                    st = ct_error(CT_EUNSUPPORTED, "offload: parameter '%s' is used by children %d and %d of the "
                                  "model (a tied weight); offload streams each slice's parameters on their own and "
                                  "cannot hold one in two slices: train this model with another strategy",
                                  ps[j]->name, child[i], c);
                child[i] = c;
            }
        ct_free(ps);
    }
    ct_free(child);
    return st;
}

static ct_status parse_balance(const char *text, int nkids, int **out, int *n)
{
    int cap = 1;
    for (const char *c = text; *c; c++) cap += *c == ':';
    int *b = ct_alloc(sizeof *b * (size_t)cap, CT_MEM_OTHER);
    if (!b) return CT_ENOMEM;
    int k = 0, sum = 0;
    const char *c = text;
    while (*c) {
        char *end;
        long v = strtol(c, &end, 10);
        if (end == c || v < 1 || v > nkids || (*end && *end != ':')) {
            ct_free(b);
            return ct_error(CT_EINVAL, "offload balance '%s': expected whole numbers from 1 separated by ':' "
                            "(children per slice, 3:3:2)", text);
        }
        b[k++] = (int)v;
        sum += (int)v;
        c = *end ? end + 1 : end;
    }
    if (sum != nkids) {
        ct_free(b);
        return ct_error(CT_EINVAL, "offload balance '%s' sums to %d but the model has %d children; "
                        "make the counts add up to %d", text, sum, nkids, nkids);
    }
    *out = b;
    *n = k;
    return CT_OK;
}

static ct_status offload_init(ct_strategy *s)
{
    const offload_opts *O = ct__offload_opts(s);
    if (!is_sequential(s->model))
        return ct_error(CT_EINVAL, "offload needs a sequential model (its children become slices); got '%s'",
                        s->model->ops->kind);
    if (s->model->nparams)
        return ct_error(CT_EINVAL, "offload: the sequential has parameters of its own; put them in a child");
    if (O->microbatches > 1 && !O->checkpoint_activation)
        return ct_error(CT_EINVAL, "offload: %d micro-batches need checkpoint_activation (as in fairscale: "
                        "without it each micro-batch's activations would stay for every slice); pass "
                        "--checkpoint-activation or --microbatches 1", O->microbatches);
    if (s->common.grad_accum != 1)
        return ct_error(CT_EINVAL, "offload: grad_accum=%d is not taken; offload splits the batch with "
                        "microbatches=N (--microbatches)", s->common.grad_accum);
    if (s->common.param_dtype != CT_F32 || s->common.reduce_dtype != CT_F32)
        return ct_error(CT_EUNSUPPORTED, "offload keeps f32 parameters and reduces f32 gradients; drop "
                        "param_dtype/reduce_dtype (--mixed) with offload");
    for (int i = 0; i < s->nparams; i++)
        if (s->params[i]->data->dtype != CT_F32)
            return ct_error(CT_EUNSUPPORTED, "offload: parameter '%s' is %s; offload takes f32 parameters",
                            s->params[i]->name, ct_dtype_name(s->params[i]->data->dtype));
    CT_TRY(check_untied(s));
    offload_t *f = ct_alloc_zeroed(sizeof *f, CT_MEM_OTHER);
    if (!f) return CT_ENOMEM;
    s->priv = f;
    int *sizes = NULL, ns = 0;
    const char *balance = ct_strategy_opt(s, "balance");
    if (balance && balance[0]) {
        CT_TRY(parse_balance(balance, s->model->nkids, &sizes, &ns));
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
    if (!f->sl || !f->gsq || !f->gmax) {
        ct_free(sizes);
        return CT_ENOMEM;
    }
    f->ns = ns;
    /* Parameters come in model order, a child's all together: a slice's
     * are a contiguous run of s->params. */
    int k = 0, p = 0;
    char text[OFF_TEXT_MAX];
    int toff = 0;
    for (int i = 0; i < ns; i++) {
        offload_slice *sl = &f->sl[i];
        sl->k0 = k;
        sl->k1 = k += sizes[i];
        sl->p0 = p;
        for (int c = sl->k0; c < sl->k1; c++) {
            ct_param **ps;
            int np;
            CT_TRY(ct_module_params(s->model->kids[c], &ps, &np));
            for (int j = 0; j < np; j++) {
                CT_ASSERT(p < s->nparams && s->params[p] == ps[j]);
                sl->n += s->params[p++]->data->numel;
            }
            ct_free(ps);
        }
        sl->p1 = p;
        if (toff < (int)sizeof text) toff += snprintf(text + toff, sizeof text - (size_t)toff, "%s%d", i ? ":" : "", sizes[i]);
    }
    ct_free(sizes);
    CT_ASSERT(p == s->nparams);
    CT_TRY(ct__opts_set_text(s, "balance", text));
    ct_module **mods;
    int nm;
    CT_TRY(ct_module_modules(s->model, &mods, &nm));
    f->bns = mods; /* reused in place: batchnorms packed at the front */
    for (int i = 0; i < nm; i++)
        if (!strcmp(mods[i]->ops->kind, "batchnorm")) f->bns[f->nbns++] = mods[i];
    if (ct__offload_ranks(s) > 1) {
        CT_TRY(ct_group_check(s->g, ct__check_same_model(s)));
        CT_TRY(ct__broadcast_state(s, 0));
    }
    return CT_OK;
}

/* ---- the store: layout, first write, budget ---------------------------------- */

static size_t slice_bytes(const offload_t *f, const offload_slice *sl)
{
    return (size_t)sl->n * sizeof(float) * (size_t)(2 + f->nstate);
}

static off_t grad_off(const offload_slice *sl) { return sl->off + (off_t)(sl->n * 4); }
static off_t state_off(const offload_slice *sl) { return sl->off + (off_t)(2 * sl->n * 4); }

ct_status ct__offload_io(ct_strategy *s, int i, int mask, int op, long *ticket)
{
    offload_t *f = ct__offload(s);
    offload_slice *sl = &f->sl[i];
    ct__io_piece p[3];
    int n = 0;
    if (mask & OFF_DATA) p[n++] = (ct__io_piece){sl->data, sl->off, op};
    if (mask & OFF_GRAD) p[n++] = (ct__io_piece){sl->grad, grad_off(sl), op};
    if ((mask & OFF_STATE) && sl->state) p[n++] = (ct__io_piece){sl->state, state_off(sl), op};
    *ticket = 0;
    return n ? ct__ostore_submit(f->store, p, n, ticket) : CT_OK;
}

/* Moves slice i's parameters into its storages and writes the slice out:
 * its data, zero gradients and zero optimizer state. */
static ct_status offload_slice_out(ct_strategy *s, int i)
{
    offload_t *f = ct__offload(s);
    offload_slice *sl = &f->sl[i];
    size_t b = (size_t)sl->n * 4;
    if (!(sl->data = ct_storage_create(b, CT_MEM_PARAM, 0)) || !(sl->grad = ct_storage_create(b, CT_MEM_GRAD, 1)))
        return CT_ENOMEM;
    if (f->nstate && !(sl->state = ct_storage_create(b * (size_t)f->nstate, CT_MEM_OPTIM, 1))) return CT_ENOMEM;
    size_t off = 0;
    for (int j = sl->p0; j < sl->p1; j++) {
        ct_param *p = s->params[j];
        ct_tensor *d = ct_tensor_on(sl->data, off, CT_F32, p->data->ndim, p->data->shape);
        ct_tensor *g = p->grad ? ct_tensor_on(sl->grad, off, CT_F32, p->data->ndim, p->data->shape) : NULL;
        if (!d || (p->grad && !g)) {
            ct_tensor_release(d);
            return CT_ENOMEM;
        }
        memcpy((char *)ct_storage_ptr(sl->data) + off, ct_tensor_data(p->data), (size_t)p->data->numel * 4);
        ct_tensor_release(p->data);
        ct_tensor_release(p->grad);
        p->data = d;
        p->grad = g;
        p->grad_stale = 0;
        p->user = f; /* marks the parameter as moved, for fini */
        off += (size_t)p->data->numel * 4;
    }
    long t;
    CT_TRY(ct__offload_io(s, i, OFF_DATA | OFF_GRAD | OFF_STATE, CT__IO_WRITE, &t));
    return ct__ostore_wait(f->store, t);
}

static ct_status offload_build_optim(ct_strategy *s, const ct_optim_opts *o)
{
    offload_t *f = ct__offload(s);
    const offload_opts *O = ct__offload_opts(s);
    /* The optimizer keeps the step count, learning rate and state names; the
     * updates run per resident slice on the store's state (offload_step.c). */
    if (!(s->opt = ct_optim_create_slots(o, NULL, 0))) return CT_EINVAL;
    f->nstate = ct_optim_state_names(s->opt, NULL);
    size_t total = 0, largest = 0;
    for (int i = 0; i < f->ns; i++) {
        f->sl[i].off = (off_t)total;
        total += slice_bytes(f, &f->sl[i]);
        if (slice_bytes(f, &f->sl[i]) > largest) largest = slice_bytes(f, &f->sl[i]);
    }
    CT_TRY(ct__ostore_open(O->store == OFF_STORE_MEMORY, ct_strategy_opt(s, "dir"), total, O->drop_cache, &f->store));
    for (int i = 0; i < f->ns; i++) CT_TRY(offload_slice_out(s, i));
    ct_mem_report r;
    ct_mem_report_get(&r);
    f->fixed = r.resident;
    f->ahead = O->prefetch ? 3 : 1;
    if (O->max_resident_mb) {
        size_t budget = (size_t)O->max_resident_mb * (size_t)MIB;
        if (f->fixed + largest > budget)
            return ct_error(CT_EINVAL, "offload: the largest slice needs %.2f MiB resident (parameters, "
                            "gradients and optimizer state) on top of %.2f MiB already resident, over the "
                            "budget of %d MiB; use more slices (--slices) or raise --max-resident-mb to at "
                            "least %.0f", (double)largest / MIB, (double)f->fixed / MIB, O->max_resident_mb,
                            ceil((double)(f->fixed + largest) / MIB));
        size_t room = (budget - f->fixed) / largest;
        if ((size_t)f->ahead > room) f->ahead = (int)room;
        if (f->ahead < 2 && O->prefetch)
            ct_log(CT_LOG_WARN, "offload: the budget of %d MiB holds one slice of %.2f MiB, not two: slices "
                   "load without prefetch (a budget for two slices lets I/O overlap compute)", O->max_resident_mb,
                   (double)largest / MIB);
    }
    f->grads_zero = 1;
    return CT_OK;
}

static void offload_fini(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    if (!f) return;
    int ok = f->store && ct__ostore_drain(f->store) == CT_OK && ct__offload_flush(s) == CT_OK;
    if (f->store && !ok)
        ct_log(CT_LOG_WARN, "offload: the store failed (%s); the unwrapped model's parameters are zeros: load "
               "the last checkpoint", ct_last_error());
    for (int i = 0; i < f->ns; i++) {
        offload_slice *sl = &f->sl[i];
        if (sl->ar) {
            ct_work_wait(sl->ar);
            ct_work_destroy(sl->ar);
        }
        size_t off = 0;
        for (int j = sl->p0; j < sl->p1; j++) {
            ct_param *p = s->params[j];
            if (p->user != f) continue; /* set-up stopped before it */
            ct_tensor *d = ct_tensor_empty(CT_F32, p->data->ndim, p->data->shape, CT_MEM_PARAM);
            ct_tensor *g = ct_tensor_create(CT_F32, p->data->ndim, p->data->shape, CT_MEM_GRAD);
            if (d && ok && ct__ostore_rw(f->store, 0, ct_tensor_data(d), (size_t)d->numel * 4,
                                         sl->off + (off_t)off) != CT_OK) {
                ok = 0;
                ct_tensor_fill(d, 0);
            } else if (d && !ok) {
                ct_tensor_fill(d, 0);
            }
            if (d && g) {
                ct_tensor_release(p->data);
                ct_tensor_release(p->grad);
                p->data = d;
                p->grad = g;
                p->grad_stale = 0;
            } else {
                ct_tensor_release(d);
                ct_tensor_release(g);
            }
            p->user = NULL;
            off += (size_t)p->data->numel * 4;
        }
    }
    ct__ostore_close(f->store);
    for (int i = 0; i < f->ns; i++) {
        ct_storage_release(f->sl[i].data);
        ct_storage_release(f->sl[i].grad);
        ct_storage_release(f->sl[i].state);
    }
    ct_free(f->sl);
    ct_free(f->gsq);
    ct_free(f->gmax);
    ct_free(f->bns);
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

static ct_status offload_grad_norm(ct_strategy *s, double norm_type, double *norm)
{
    offload_t *f = ct__offload(s);
    double acc = 0; /* the same order and rule as the replicated norm: bitwise equal */
    for (int i = 0; i < s->nparams; i++) {
        if (!s->params[i]->requires_grad || !s->params[i]->grad) continue;
        if (isinf(norm_type)) {
            double a = f->gmax[i];
            if (a > acc || isnan(a)) acc = a;
        } else {
            acc += f->gsq[i];
        }
    }
    *norm = isinf(norm_type) ? acc : sqrt(acc);
    return CT_OK;
}

/* Gradients are in the store: the factor waits for the step, which applies
 * it (as ct_scale_grads would, one multiply per factor) while the slice is
 * resident.  The norms kept follow, up to rounding. */
static void offload_scale_grads(ct_strategy *s, float k)
{
    offload_t *f = ct__offload(s);
    if (f->nscales == (int)(sizeof f->scales / sizeof f->scales[0])) {
        f->scales[f->nscales - 1] *= k; /* more clips than anyone does in one step: fold */
    } else {
        f->scales[f->nscales++] = k;
    }
    for (int i = 0; i < s->nparams; i++) {
        f->gsq[i] *= (double)k * (double)k;
        f->gmax[i] *= fabsf(k);
    }
}

static void offload_zero_grad(ct_strategy *s)
{
    offload_t *f = ct__offload(s);
    f->grads_zero = 1;
    f->nscales = 0;
    memset(f->gsq, 0, sizeof *f->gsq * (size_t)s->nparams);
    memset(f->gmax, 0, sizeof *f->gmax * (size_t)s->nparams);
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
        CT_TRY(ct_group_allreduce(s->g, ct_storage_ptr(sl->grad), sl->n, CT_F32, CT_OP_SUM, NULL));
        ct__offload_norms(s, i);
        CT_TRY(ct__offload_io(s, i, OFF_GRAD, CT__IO_WRITE, &t));
        CT_TRY(ct__ostore_wait(f->store, t));
    }
    return CT_OK;
}

/* ---- state: the normal full state dict, read from and written to the store ---- */

/* Where parameter j's data sits in the file (and its slice). */
static off_t param_off(ct_strategy *s, int j, offload_slice **slp)
{
    offload_t *f = ct__offload(s);
    for (int i = 0; i < f->ns; i++) {
        offload_slice *sl = &f->sl[i];
        if (j < sl->p0 || j >= sl->p1) continue;
        int64_t e = 0;
        for (int q = sl->p0; q < j; q++) e += s->params[q]->data->numel;
        *slp = sl;
        return (off_t)(e * 4);
    }
    CT_ASSERT(0);
    return 0;
}

static ct_status add_read(ct_strategy *s, ct_state *out, const char *name, ct_param *p, off_t at)
{
    ct_tensor *t = ct_tensor_empty(CT_F32, p->data->ndim, p->data->shape, CT_MEM_OTHER);
    if (!t) return CT_ENOMEM;
    ct_status st = ct__ostore_rw(ct__offload(s)->store, 0, ct_tensor_data(t), (size_t)t->numel * 4, at);
    if (st == CT_OK) st = ct_state_add(out, name, t);
    ct_tensor_release(t);
    return st;
}

static ct_status offload_model_state(ct_strategy *s, ct_state *out)
{
    ct_status st = ct__offload_flush(s);
    for (int j = 0; j < s->nparams && st == CT_OK; j++) {
        offload_slice *sl;
        off_t o = param_off(s, j, &sl);
        st = add_read(s, out, s->params[j]->name, s->params[j], sl->off + o);
    }
    for (int i = 0; i < s->nbuffers && st == CT_OK; i++) st = ct_state_add(out, s->buffers[i]->name, s->buffers[i]->data);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

static ct_status offload_optim_state(ct_strategy *s, ct_state *out)
{
    offload_t *f = ct__offload(s);
    const char *names[CT_OPTIM_MAX_STATE];
    ct_optim_state_names(s->opt, names);
    char name[512];
    ct_status st = ct__offload_flush(s);
    for (int j = 0; j < s->nparams && st == CT_OK; j++) {
        ct_param *p = s->params[j];
        if (!p->requires_grad) continue;
        offload_slice *sl;
        off_t o = param_off(s, j, &sl);
        for (int b = 0; b < f->nstate && st == CT_OK; b++) {
            snprintf(name, sizeof name, "%s.%s", p->name, names[b]);
            st = add_read(s, out, name, p, state_off(sl) + (off_t)((int64_t)b * sl->n * 4) + o);
        }
    }
    if (st == CT_OK) {
        ct_tensor *step = ct_tensor_create(CT_I64, 1, (int64_t[]){1}, CT_MEM_OTHER);
        if (!step) st = CT_ENOMEM;
        else {
            ((int64_t *)ct_tensor_data(step))[0] = ct_optim_get_step(s->opt);
            st = ct_state_add(out, "step", step);
            ct_tensor_release(step);
        }
    }
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

static const ct_tensor *find(const char *const *names, ct_tensor *const *ts, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], name)) return ts[i];
    return NULL;
}

/* src (f32/bf16/f16, numel elements) as f32 written at `at`. */
static ct_status write_f32(ct_strategy *s, const ct_tensor *src, int64_t numel, const char *name, off_t at)
{
    if (src->numel != numel)
        return ct_error(CT_EINVAL, "'%s' has %lld elements in the checkpoint but %lld in the model; the "
                        "checkpoint is for a different model configuration", name, (long long)src->numel,
                        (long long)numel);
    float *tmp = ct_alloc((size_t)numel * 4 + 4, CT_MEM_OTHER);
    if (!tmp) return CT_ENOMEM;
    ct_status st = CT_OK;
    switch (src->dtype) {
    case CT_F32: memcpy(tmp, ct_tensor_data(src), (size_t)numel * 4); break;
    case CT_BF16: ct_bf16_to_f32_n(ct_tensor_data(src), tmp, (size_t)numel); break;
    case CT_F16: ct_f16_to_f32_n(ct_tensor_data(src), tmp, (size_t)numel); break;
    default:
        st = ct_error(CT_EINVAL, "'%s' is %s in the checkpoint; parameters must be F32, BF16 or F16", name,
                      ct_dtype_name(src->dtype));
    }
    if (st == CT_OK) st = ct__ostore_rw(ct__offload(s)->store, 1, tmp, (size_t)numel * 4, at);
    ct_free(tmp);
    return st;
}

static ct_status load_model(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n)
{
    for (int i = 0; i < n; i++)
        if (!ct_module_find(s->model, names[i]))
            return ct_error(CT_EINVAL, "checkpoint tensor '%s' is not in the model (wrong --model, or an "
                            "optimizer file where the model file belongs?)", names[i]);
    /* Check everything before writing anything: a bad file leaves the run as it was. */
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < (pass ? s->nbuffers : s->nparams); j++) {
            ct_param *p = pass ? s->buffers[j] : s->params[j];
            const ct_tensor *src = find(names, ts, n, p->name);
            if (!src) return ct_error(CT_EINVAL, "checkpoint has no tensor '%s' that the model needs", p->name);
            if (src->ndim != p->data->ndim || memcmp(src->shape, p->data->shape, sizeof(int64_t) * (size_t)src->ndim)) {
                char a[64], b[64];
                return ct_error(CT_EINVAL, "'%s' is %s in the checkpoint but %s in the model", p->name,
                                ct_shape_str(src, a, sizeof a), ct_shape_str(p->data, b, sizeof b));
            }
            if (pass && src->dtype != CT_F32)
                return ct_error(CT_EINVAL, "buffer '%s' is %s in the checkpoint; buffers load from F32", p->name,
                                ct_dtype_name(src->dtype));
        }
    for (int j = 0; j < s->nparams; j++) {
        offload_slice *sl;
        off_t o = param_off(s, j, &sl);
        ct_param *p = s->params[j];
        CT_TRY(write_f32(s, find(names, ts, n, p->name), p->data->numel, p->name, sl->off + o));
    }
    for (int j = 0; j < s->nbuffers; j++)
        memcpy(ct_tensor_data(s->buffers[j]->data), ct_tensor_data(find(names, ts, n, s->buffers[j]->name)),
               ct_tensor_bytes(s->buffers[j]->data));
    return CT_OK;
}

static ct_status load_optim(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n)
{
    offload_t *f = ct__offload(s);
    const ct_tensor *stp = find(names, ts, n, "step");
    if (!stp || stp->dtype != CT_I64 || stp->numel != 1)
        return ct_error(CT_EINVAL, "optimizer state has no I64 'step' tensor");
    const char *bn[CT_OPTIM_MAX_STATE];
    ct_optim_state_names(s->opt, bn);
    char name[512];
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < s->nparams; j++) {
            ct_param *p = s->params[j];
            if (!p->requires_grad) continue;
            offload_slice *sl;
            off_t o = param_off(s, j, &sl);
            for (int b = 0; b < f->nstate; b++) {
                snprintf(name, sizeof name, "%s.%s", p->name, bn[b]);
                const ct_tensor *src = find(names, ts, n, name);
                if (!src)
                    return ct_error(CT_EINVAL, "optimizer state has no '%s' (saved with another optimizer? "
                                    "this run uses %s)", name, ct_optim_name(s->opt));
                if (pass)
                    CT_TRY(write_f32(s, src, p->data->numel, name, state_off(sl) + (off_t)((int64_t)b * sl->n * 4) + o));
                else if (src->numel != p->data->numel)
                    return ct_error(CT_EINVAL, "'%s' has %lld elements in the checkpoint but %lld in the model",
                                    name, (long long)src->numel, (long long)p->data->numel);
            }
        }
    ct_optim_set_step(s->opt, ((const int64_t *)ct_tensor_data(stp))[0]);
    return CT_OK;
}

static ct_status offload_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n,
                                    int optim)
{
    CT_TRY(ct__offload_flush(s)); /* the step taken happened before the load */
    return optim ? load_optim(s, names, ts, n) : load_model(s, names, ts, n);
}

void ct_strategy_offload_info(const ct_strategy *s, int *nslices, int *ahead)
{
    const offload_t *f = s->ops == &ct__offload_ops ? ct__offload(s) : NULL;
    *nslices = f ? f->ns : 0;
    *ahead = f ? f->ahead : 0;
}

const ct__strategy_ops ct__offload_ops = {
    .kind = "offload",
    .opts = offload_opt_defs,
    .nopts = (int)(sizeof offload_opt_defs / sizeof offload_opt_defs[0]),
    .opts_size = sizeof(offload_opts),
    .runs_alone = 1,
    .init = offload_init,
    .fini = offload_fini,
    .pre_forward = not_here,
    .pre_backward = not_here,
    .build_optim = offload_build_optim,
    .grad_norm = offload_grad_norm,
    .scale_grads = offload_scale_grads,
    .reduce = offload_reduce,
    .pre_step = ct__offload_pre_step,
    .zero_grad = offload_zero_grad,
    .model_state = offload_model_state,
    .optim_state = offload_optim_state,
    .load_state = offload_load_state,
    .train_step = ct__offload_train_step,
    .predict = ct__offload_predict,
};

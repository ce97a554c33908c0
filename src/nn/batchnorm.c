/*
 * Batch normalisation over channel dim 1 of [N, C] or [N, C, *spatial]
 * (PyTorch's BatchNorm1d/2d): weight and bias [C], buffers running_mean,
 * running_var [C] and num_batches_tracked (a 0-dim F32 here; PyTorch's is
 * I64 and load_state_dict converts).
 *
 * Training normalises with the batch's mean and biased variance and updates
 * the running stats (unbiased variance, as PyTorch) -- the one piece of
 * state a forward call writes into its module.  Each forward updates them,
 * so every micro-batch counts as a batch, as in PyTorch; a checkpoint's
 * recompute does not (PyTorch's does: its statistics move twice).  Eval normalises with the running stats.  The record keeps the
 * input and the mean and 1/std it used.
 *
 * Deferred statistics (fairscale's DeferredBatchNorm, for pipelines): in
 * CT_BN_DEFER a training forward still normalises with its own batch's
 * statistics but, instead of updating the running ones, merges its count,
 * mean and sum of squared deviations per channel into an accumulator
 * (Chan's parallel formula, so micro-batches combine exactly as one
 * batch); ct_batchnorm_commit then makes one update from the whole.
 * CT_BN_HOLD does neither, and neither does a recompute (ct_fwd_ctx.recompute:
 * activation checkpointing repeats a forward that was already counted).
 *
 * Synchronised statistics (PyTorch's SyncBatchNorm): with a sync function
 * the count and the per-channel sums, then the squared deviations from the
 * common mean, are summed over the replicas before use (two passes, as
 * here without replicas, rather than E[x^2] - mean^2, which cancels), and
 * backward sums its two per-channel terms the same way, so every replica
 * normalises and differentiates exactly as one process on the whole batch.
 * The sums travel as f32 (PyTorch's SyncBatchNorm gathers f32 statistics).
 * The layer knows nothing of ranks: the function is the strategy's.
 */
#include <math.h>
#include <string.h>

#include "internal.h"

typedef struct {
    int64_t c;
    float eps, momentum;
    int mode;    /* CT_BN_NOW, CT_BN_DEFER, CT_BN_HOLD */
    double *acc; /* CT_BN_DEFER: [3*C] count, mean, sum of squared deviations per channel */
    ct_stats_sync_fn sync; /* NULL: this replica's batch only */
    void *sync_ud;
} bn_impl;

/* Sums n doubles over the replicas through B->sync (as f32). */
static ct_status sync_sum(const bn_impl *B, double *v, int64_t n)
{
    float *f = ct_alloc(sizeof *f * (size_t)n, CT_MEM_COMM);
    if (!f) return CT_ENOMEM;
    for (int64_t i = 0; i < n; i++) f[i] = (float)v[i];
    ct_status st = B->sync(f, n, B->sync_ud);
    for (int64_t i = 0; st == CT_OK && i < n; i++) v[i] = f[i];
    ct_free(f);
    return st;
}

/* The training statistics of x [N, C, S]: mean[c] and the sum of squared
 * deviations ss[c] over *cnt values, over every replica with a sync. */
static ct_status batch_stats(const bn_impl *B, const float *x, int64_t N, int64_t S, double *mean, double *ss,
                             double *cnt)
{
    int64_t C = B->c;
    for (int64_t c = 0; c < C; c++) {
        double s = 0.0;
        for (int64_t n = 0; n < N; n++) {
            const float *xc = x + (n * C + c) * S;
            for (int64_t i = 0; i < S; i++) s += xc[i];
        }
        mean[c] = s;
    }
    mean[C] = (double)(N * S);
    if (B->sync) CT_TRY(sync_sum(B, mean, C + 1));
    *cnt = mean[C];
    for (int64_t c = 0; c < C; c++) {
        double mc = mean[c] / *cnt, q = 0.0;
        for (int64_t n = 0; n < N; n++) {
            const float *xc = x + (n * C + c) * S;
            for (int64_t i = 0; i < S; i++) q += (xc[i] - mc) * (xc[i] - mc);
        }
        mean[c] = mc;
        ss[c] = q;
    }
    return B->sync ? sync_sum(B, ss, C) : CT_OK;
}

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

/* x [N, C, S...] -> y; saves x, mean [C], rstd [C] and ival[0] = training. */
static ct_status bn_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                            const ct_fwd_ctx *ctx)
{
    const bn_impl *B = m->impl;
    char sh[64];
    if (in->dtype != CT_F32 || in->ndim < 2 || in->shape[1] != B->c)
        return ct_error(CT_EINVAL, "batchnorm '%s': input %s %s must be F32 [N, %lld, ...]; check "
                        "the channel count of the previous layer", nm(m), ct_dtype_name(in->dtype),
                        ct_shape_str(in, sh, sizeof sh), (long long)B->c);
    int64_t N = in->shape[0], C = B->c, S = 1;
    for (int i = 2; i < in->ndim; i++) S *= in->shape[i];
    int training = ctx->training, mode = ctx->recompute ? CT_BN_HOLD : B->mode;
    double cnt = (double)(N * S);
    double *stats = NULL; /* training: mean [C + 1] (the sums, then the count), ss [C] */
    if (training) {
        if (!(stats = ct_alloc(sizeof *stats * (size_t)(2 * C + 1), CT_MEM_ACT))) return CT_ENOMEM;
        ct_status st = batch_stats(B, ct_f32(in), N, S, stats, stats + C + 1, &cnt);
        if (st == CT_OK && cnt < 2)
            st = ct_error(CT_EINVAL, "batchnorm '%s': training needs more than 1 value per channel, "
                          "input is %s%s; use a larger batch or eval mode", nm(m), ct_shape_str(in, sh, sizeof sh),
                          B->sync ? " over every replica" : "");
        if (st != CT_OK) {
            ct_free(stats);
            return st;
        }
    }
    ct_tensor *y = ct_tensor_create(CT_F32, in->ndim, in->shape, CT_MEM_ACT);
    ct_tensor *mean = ct_tensor_create1(C, CT_MEM_ACT), *rstd = ct_tensor_create1(C, CT_MEM_ACT);
    /* Saved before any running stat is written, so a failure changes nothing;
     * the record holds its own references to mean and rstd (released below). */
    if (!y || !mean || !rstd ||
        (rec && (ct_record_save(rec, in) < 0 || ct_record_save(rec, mean) < 0 ||
                 ct_record_save(rec, rstd) < 0))) {
        ct_tensor_release(y);
        ct_tensor_release(mean);
        ct_tensor_release(rstd);
        ct_free(stats);
        return CT_ENOMEM;
    }
    const float *x = ct_f32(in), *w = ct_f32(m->params[0]->data), *b = ct_f32(m->params[1]->data);
    float *rm = ct_f32(m->buffers[0]->data), *rv = ct_f32(m->buffers[1]->data);
    float *mu = ct_f32(mean), *rs = ct_f32(rstd), *yd = ct_f32(y);
    for (int64_t c = 0; c < C; c++) {
        if (training) {
            double mc = stats[c], ss = stats[C + 1 + c];
            double var = ss / cnt;
            mu[c] = (float)mc;
            rs[c] = (float)(1.0 / sqrt(var + (double)B->eps));
            float mom = B->momentum;
            if (mode == CT_BN_NOW) {
                rm[c] = (1.0f - mom) * rm[c] + mom * (float)mc;
                rv[c] = (1.0f - mom) * rv[c] + mom * (float)(var * cnt / (cnt - 1));
            } else if (mode == CT_BN_DEFER) {
                double *a = B->acc + 3 * c, n = a[0] + cnt, d = mc - a[1];
                a[2] += ss + d * d * a[0] * cnt / n;
                a[1] += d * cnt / n;
                a[0] = n;
            }
        } else {
            mu[c] = rm[c];
            rs[c] = (float)(1.0 / sqrt((double)rv[c] + (double)B->eps));
        }
        float a = rs[c] * w[c], sh0 = b[c] - mu[c] * a;
        for (int64_t n = 0; n < N; n++) {
            const float *xc = x + (n * C + c) * S;
            float *yc = yd + (n * C + c) * S;
            for (int64_t i = 0; i < S; i++) yc[i] = xc[i] * a + sh0;
        }
    }
    if (training && mode == CT_BN_NOW) ct_f32(m->buffers[2]->data)[0] += 1.0f;
    if (rec) rec->ival[0] = training;
    if (rec) rec->fval[0] = cnt; /* values the statistics are over (every replica's) */
    ct_free(stats);
    ct_tensor_release(mean);
    ct_tensor_release(rstd);
    *out = y;
    return CT_OK;
}

/* Training: dx = w*rstd*(dy - mean(dy) - xhat*mean(dy*xhat)) per channel;
 * eval (stats are constants): dx = w*rstd*dy.  dw += sum dy*xhat, db += sum dy. */
static ct_status bn_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const bn_impl *B = m->impl;
    const ct_tensor *xt = ct_record_saved(rec, 0);
    if (!ct_tensor_same_shape(dout, xt)) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "batchnorm '%s': output gradient %s does not match the output %s",
                        nm(m), ct_shape_str(dout, a, sizeof a), ct_shape_str(xt, b, sizeof b));
    }
    int64_t N = xt->shape[0], C = B->c, S = 1;
    for (int i = 2; i < xt->ndim; i++) S *= xt->shape[i];
    double cnt = rec->ival[0] ? rec->fval[0] : (double)(N * S);
    ct_tensor *dx = NULL;
    if (din && !(dx = ct_tensor_create(CT_F32, xt->ndim, xt->shape, CT_MEM_ACT))) return CT_ENOMEM;
    /* sum dy and sum dy*xhat per channel: [2C], over every replica for dx with a sync */
    double *red = ct_alloc(sizeof *red * (size_t)(2 * C + 1), CT_MEM_ACT);
    if (!red) {
        ct_tensor_release(dx);
        return CT_ENOMEM;
    }
    const float *x = ct_f32(xt), *dy = ct_f32(dout), *w = ct_f32(m->params[0]->data);
    const float *mu = ct_f32(ct_record_saved(rec, 1)), *rs = ct_f32(ct_record_saved(rec, 2));
    ct_param *Wp = m->params[0], *Bp = m->params[1];
    float *gw = Wp->requires_grad && Wp->grad ? ct_f32(Wp->grad) : NULL;
    float *gb = Bp->requires_grad && Bp->grad ? ct_f32(Bp->grad) : NULL;
    for (int64_t c = 0; c < C; c++) {
        double sdy = 0.0, sdyx = 0.0; /* sum dy, sum dy*xhat */
        for (int64_t n = 0; n < N; n++) {
            const float *xc = x + (n * C + c) * S, *dc = dy + (n * C + c) * S;
            for (int64_t i = 0; i < S; i++) {
                sdy += dc[i];
                sdyx += dc[i] * (xc[i] - mu[c]) * rs[c];
            }
        }
        if (gw) gw[c] += (float)sdyx;
        if (gb) gb[c] += (float)sdy;
        red[c] = sdy;
        red[C + c] = sdyx;
    }
    /* Every replica's backward reaches here (dx or not), so the collective matches. */
    if (B->sync && rec->ival[0]) {
        ct_status st = sync_sum(B, red, 2 * C);
        if (st != CT_OK) {
            ct_free(red);
            ct_tensor_release(dx);
            return st;
        }
    }
    for (int64_t c = 0; dx && c < C; c++) {
        double sdy = red[c], sdyx = red[C + c];
        float k = w[c] * rs[c];
        float mdy = rec->ival[0] ? (float)(sdy / cnt) : 0.0f;
        float mdyx = rec->ival[0] ? (float)(sdyx / cnt) : 0.0f;
        for (int64_t n = 0; n < N; n++) {
            const float *xc = x + (n * C + c) * S, *dc = dy + (n * C + c) * S;
            float *g = ct_f32(dx) + (n * C + c) * S;
            for (int64_t i = 0; i < S; i++)
                g[i] = k * (dc[i] - mdy - (xc[i] - mu[c]) * rs[c] * mdyx);
        }
    }
    ct_free(red);
    if (din) *din = dx;
    return CT_OK;
}

static void bn_destroy(ct_module *m)
{
    bn_impl *B = m->impl;
    ct_free(B->acc);
    ct_free(B);
}

static const ct_module_ops bn_ops;

static ct_status need_bn(const ct_module *m, const char *what)
{
    if (!m || m->ops != &bn_ops)
        return ct_error(CT_EINVAL, "%s: '%s' is not a batchnorm module", what, m ? nm(m) : "NULL");
    return CT_OK;
}

ct_status ct_batchnorm_set_mode(ct_module *m, int mode)
{
    CT_TRY(need_bn(m, "ct_batchnorm_set_mode"));
    bn_impl *B = m->impl;
    if (mode != CT_BN_NOW && mode != CT_BN_DEFER && mode != CT_BN_HOLD)
        return ct_error(CT_EINVAL, "batchnorm '%s': unknown statistics mode %d", nm(m), mode);
    if (mode == CT_BN_DEFER && !B->acc) {
        if (!(B->acc = ct_alloc_zeroed(sizeof *B->acc * 3 * (size_t)B->c, CT_MEM_OTHER))) return CT_ENOMEM;
    }
    B->mode = mode;
    return CT_OK;
}

ct_status ct_batchnorm_set_sync(ct_module *m, ct_stats_sync_fn fn, void *ud)
{
    CT_TRY(need_bn(m, "ct_batchnorm_set_sync"));
    bn_impl *B = m->impl;
    B->sync = fn;
    B->sync_ud = fn ? ud : NULL;
    return CT_OK;
}

ct_status ct_module_set_stats_sync(ct_module *root, ct_stats_sync_fn fn, void *ud, int *n)
{
    ct_module **mods;
    int nm_, count = 0;
    CT_TRY(ct_module_modules(root, &mods, &nm_));
    for (int i = 0; i < nm_; i++)
        if (mods[i]->ops == &bn_ops) {
            ct_batchnorm_set_sync(mods[i], fn, ud);
            count++;
        }
    ct_free(mods);
    if (n) *n = count;
    return CT_OK;
}

ct_status ct_batchnorm_commit(ct_module *m)
{
    CT_TRY(need_bn(m, "ct_batchnorm_commit"));
    bn_impl *B = m->impl;
    if (!B->acc || B->acc[0] < 2) return CT_OK; /* nothing (or one value) accumulated */
    float *rm = ct_f32(m->buffers[0]->data), *rv = ct_f32(m->buffers[1]->data), mom = B->momentum;
    for (int64_t c = 0; c < B->c; c++) {
        const double *a = B->acc + 3 * c;
        rm[c] = (1.0f - mom) * rm[c] + mom * (float)a[1];
        rv[c] = (1.0f - mom) * rv[c] + mom * (float)(a[2] / (a[0] - 1.0));
    }
    ct_f32(m->buffers[2]->data)[0] += 1.0f;
    memset(B->acc, 0, sizeof *B->acc * 3 * (size_t)B->c);
    return CT_OK;
}

static ct_status bn_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                              int64_t *out_shape)
{
    const bn_impl *B = m->impl;
    if (ndim < 2 || in_shape[1] != B->c) {
        ct_tensor t = ct__shape_header(ndim, in_shape);
        char sh[64];
        return ct_error(CT_EINVAL, "batchnorm '%s': input %s must be [N, %lld, ...]; check the "
                        "channel count of the previous layer", nm(m),
                        ct_shape_str(&t, sh, sizeof sh), (long long)B->c);
    }
    return ct_module_out_shape_same(m, ndim, in_shape, out_ndim, out_shape);
}

/* The record keeps the input and mean and rstd per channel. */
static ct_status bn_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)mixed, (void)need_dx;
    c->keep_in = 1;
    c->saved = (nd > 1 ? (uint64_t)sh[1] : 1) * 8;
    return CT_OK;
}

static const ct_module_ops bn_ops = {"batchnorm", bn_forward, bn_backward, bn_destroy, 0, bn_out_shape,
                                     bn_act_cost, CT_MOD_KEEP_F32 | CT_MOD_RUNNING_STATS};

ct_module *ct_batchnorm_create(int64_t c, float eps, float momentum)
{
    if (c <= 0 || !(eps >= 0.0f) || !(momentum >= 0.0f && momentum <= 1.0f)) {
        ct_error(CT_EINVAL, "batchnorm needs c > 0, eps >= 0 and momentum in [0, 1]; got c=%lld "
                 "eps=%g momentum=%g", (long long)c, (double)eps, (double)momentum);
        return NULL;
    }
    bn_impl *B = ct_alloc_zeroed(sizeof *B, CT_MEM_OTHER);
    if (!B) return NULL;
    *B = (bn_impl){c, eps, momentum, CT_BN_NOW, NULL, NULL, NULL};
    ct_module *m = ct_module_create(&bn_ops, B);
    if (!m) {
        ct_free(B);
        return NULL;
    }
    /* Buffer order is relied on above: running_mean, running_var, num_batches_tracked. */
    ct_param *w = ct_module_add_param(m, "weight", 1, (int64_t[]){c}), *b = NULL;
    if (!w || !(b = ct_module_add_param(m, "bias", 1, (int64_t[]){c})) ||
        !ct_module_add_buffer(m, "running_mean", 1, (int64_t[]){c}, 0.0f) ||
        !ct_module_add_buffer(m, "running_var", 1, (int64_t[]){c}, 1.0f) ||
        !ct_module_add_buffer(m, "num_batches_tracked", 0, NULL, 0.0f)) {
        ct_module_destroy(m);
        return NULL;
    }
    ct_param_set_init(w, ct_init_const(1.0f));
    ct_param_set_init(b, ct_init_const(0.0f));
    return m;
}

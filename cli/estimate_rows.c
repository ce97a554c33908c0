/*
 * `ctrain estimate`'s rows: the per-rank bytes of each strategy for a model,
 * from its shapes alone.  Each figure follows how the strategy's code
 * allocates; the categories are those of the memory report `ctrain train`
 * prints, so the two compare line by line.  A row is one function of est_in
 * and the strategy's resolved options: a new strategy adds its function and
 * a line to est_kinds (at the end).
 */
#include <stdlib.h>
#include <string.h>

#include "estimate.h"

/* ---- the figures of a row ---------------------------------------------- */


/* Folds one rank's figures into the row; resident is the peak of param +
 * grad + optim together (less than the sum of their peaks when those fall
 * at different times). */
static void take_peaks(est_row *row, uint64_t param, uint64_t grad, uint64_t optim, uint64_t act, uint64_t comm,
                       uint64_t resident)
{
#define MAX(f) row->f = f > row->f ? f : row->f
    uint64_t total = resident + act + comm;
    MAX(param);
    MAX(grad);
    MAX(optim);
    MAX(act);
    MAX(comm);
    MAX(resident);
    MAX(total);
#undef MAX
}

/* Folds one rank's figures into the row, their peaks at the same time. */
static void take_rank(est_row *row, uint64_t param, uint64_t grad, uint64_t optim, uint64_t act, uint64_t comm)
{
    take_peaks(row, param, grad, optim, act, comm, param + grad + optim);
}

/* The value of key in a strategy's resolved options ("key=value\n" lines). */
static const char *optv(const char *vals, const char *key, char *buf, size_t n)
{
    size_t len = strlen(key);
    for (const char *p = vals; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, key, len) && p[len] == '=') {
            size_t vl = strcspn(p + len + 1, "\n");
            snprintf(buf, n, "%.*s", (int)vl, p + len + 1);
            return buf;
        }
    return NULL;
}

static double optnum(const char *vals, const char *key, double def)
{
    char b[64];
    const char *v = optv(vals, key, b, sizeof b);
    return v ? atof(v) : def;
}

static int opt16(const char *vals, const char *key)
{
    char b[64];
    const char *v = optv(vals, key, b, sizeof b);
    return v && strcmp(v, "f32") && strcmp(v, "fp32") && strcmp(v, "float32");
}

/* ---- what the strategies share ----------------------------------------- */

static uint64_t bytes_of(const ct_param *p) { return (uint64_t)ct_tensor_bytes(p->data); }

/* Every parameter (f32 master) and buffer on this rank, plus with
 * param_dtype=bf16 a bf16 compute copy of every trainable parameter of two
 * or more dims outside norm layers (src/parallel/mixed.c). */
static uint64_t param_bytes(const est_in *in, int mixed)
{
    uint64_t b = in->buffer_bytes;
    for (int i = 0; i < in->nparams; i++) {
        const ct_param *p = in->params[i];
        b += bytes_of(p);
        const char *kind = p->owner && p->owner->ops ? p->owner->ops->kind : "";
        if (mixed && p->requires_grad && p->data->ndim >= 2 && p->data->dtype == CT_F32 &&
            strcmp(kind, "layernorm") && strcmp(kind, "batchnorm"))
            b += (uint64_t)p->data->numel * 2;
    }
    return b;
}

/* Gradients of frozen parameters: no strategy takes them, they keep their own. */
static uint64_t frozen_grad_bytes(const est_in *in)
{
    uint64_t b = 0;
    for (int i = 0; i < in->nparams; i++)
        if (!in->params[i]->requires_grad && in->params[i]->grad) b += (uint64_t)ct_tensor_bytes(in->params[i]->grad);
    return b;
}

static uint64_t trainable_bytes(const est_in *in)
{
    uint64_t b = 0;
    for (int i = 0; i < in->ntp; i++) b += (uint64_t)in->tp[i]->data->numel * 4;
    return b;
}

/* The optimizer's state slab over slots of counts[0..n) elements
 * (src/optim/optim.c): AdamW two buffers, SGD with momentum one, without
 * none; each slot padded to 16 floats; at least 16 floats once there is
 * state.  The slot table (about 100 bytes a slot) is left out. */
static uint64_t optim_bytes(const est_in *in, const int64_t *counts, int n)
{
    int nbufs = in->optim == CT_OPT_ADAMW ? 2 : in->momentum != 0 ? 1 : 0;
    uint64_t floats = 0;
    for (int i = 0; i < n; i++) floats += ((uint64_t)counts[i] + 15) & ~(uint64_t)15;
    floats *= (uint64_t)nbufs;
    if (nbufs && floats < 16) floats = 16;
    return floats * 4;
}

static uint64_t optim_whole(const est_in *in)
{
    int64_t *c = ct_alloc(sizeof *c * (size_t)(in->ntp + 1), CT_MEM_OTHER);
    if (!c) return 0;
    for (int i = 0; i < in->ntp; i++) c[i] = in->tp[i]->data->numel;
    uint64_t b = optim_bytes(in, c, in->ntp);
    ct_free(c);
    return b;
}

/* Activations of this rank's share of the global batch (the largest share:
 * the sampler gives the first ranks the extra rows). */
static ct_status activations(const est_in *in, const char *vals, uint64_t *act)
{
    int k = (int)optnum(vals, "grad_accum", 1);
    int64_t rows = in->batch / in->world + (in->batch % in->world != 0);
    int64_t micro = rows / k + (rows % k != 0); /* the first micro-batch, the largest */
    /* The loss gradient is scaled by micro / global (a copy) unless the micro-batch is the whole batch. */
    return est_activations(in, rows, k, micro != in->batch, opt16(vals, "param_dtype"), act);
}

/* The partition of the trainable parameters over the ranks (as the sharded strategies make it). */
static ct_status partition(const est_in *in, const char *vals, ct_partition *pt)
{
    int64_t *c = ct_alloc(sizeof *c * (size_t)(in->ntp + 1), CT_MEM_OTHER);
    if (!c) return CT_ENOMEM;
    for (int i = 0; i < in->ntp; i++) c[i] = in->tp[i]->data->numel;
    ct_status st = ct_partition_init(pt, c, in->ntp, in->world, optnum(vals, "split_params", 0) != 0);
    ct_free(c);
    return st;
}

/* Optimizer bytes of rank r: its ranges of the partition. */
static uint64_t optim_share(const est_in *in, const ct_partition *pt, int r, int64_t *counts)
{
    int n = 0;
    for (int k = 0; k < pt->n; k++)
        if (pt->ranges[k].owner == r) counts[n++] = pt->ranges[k].count;
    return optim_bytes(in, counts, n);
}

/* ---- the rows ----------------------------------------------------------- */

/* One replica, nothing shared: every gradient where the model made it. */
static ct_status row_none(const est_in *in, const char *vals, est_row *row)
{
    uint64_t act;
    CT_TRY(activations(in, vals, &act));
    take_rank(row, param_bytes(in, opt16(vals, "param_dtype")), trainable_bytes(in) + frozen_grad_bytes(in),
              optim_whole(in), act, 0);
    return CT_OK;
}

/* DDP (src/parallel/ddp.c): gradients live once, in the buckets (rebuilt at
 * zero_grad with the old ones freed first); a 16-bit reduce_dtype adds a
 * 2-byte wire copy of every bucket. */
static ct_status row_ddp(const est_in *in, const char *vals, est_row *row)
{
    uint64_t act;
    CT_TRY(activations(in, vals, &act));
    uint64_t tb = trainable_bytes(in);
    take_rank(row, param_bytes(in, opt16(vals, "param_dtype")), tb + frozen_grad_bytes(in), optim_whole(in), act,
              opt16(vals, "reduce_dtype") ? tb / 2 : 0);
    return CT_OK;
}

/* ZeRO-1 (src/parallel/zero.c): DDP's buckets, optimizer state for this rank's ranges only. */
static ct_status row_zero1(const est_in *in, const char *vals, est_row *row)
{
    uint64_t act;
    ct_partition pt;
    CT_TRY(activations(in, vals, &act));
    CT_TRY(partition(in, vals, &pt));
    int64_t *counts = ct_alloc(sizeof *counts * (size_t)(pt.n + 1), CT_MEM_OTHER);
    if (!counts) {
        ct_partition_fini(&pt);
        return CT_ENOMEM;
    }
    uint64_t tb = trainable_bytes(in), param = param_bytes(in, opt16(vals, "param_dtype"));
    for (int r = 0; r < in->world; r++)
        take_rank(row, param, tb + frozen_grad_bytes(in), optim_share(in, &pt, r, counts), act,
                  opt16(vals, "reduce_dtype") ? tb / 2 : 0);
    ct_free(counts);
    ct_partition_fini(&pt);
    return CT_OK;
}

/* Index of a trainable parameter (build_input numbers them in p->user), or -1. */
static int tindex(const ct_param *p) { return (int)(intptr_t)p->user - 1; }

/* ZeRO-2's backward on one rank, replayed (src/parallel/zero.c): the
 * rank's reduced ranges live in its gradient shard (counted by the caller;
 * owns is all zero for it now); every parameter's gradient is materialised when its module starts backward,
 * after the oldest reduces are waited for while the bytes in flight plus
 * the module's need exceed reduce_buffer_mb, and freed when its reduce is
 * waited for (all of them at the end of backward).  With a 16-bit
 * reduce_dtype each gradient's 2-byte wire copy lives from its grad-ready
 * hook to that wait.  Returns the peaks of gradient and wire bytes. */
static ct_status zero2_backward(const est_in *in, const char *owns, uint64_t limit, int wire, uint64_t *grad,
                                uint64_t *comm)
{
    int n = in->ntp, *fifo = ct_alloc(sizeof *fifo * (size_t)(n + 1), CT_MEM_OTHER);
    char *have = ct_alloc_zeroed((size_t)n + 1, CT_MEM_OTHER);
    if (!fifo || !have) {
        ct_free(fifo);
        ct_free(have);
        return CT_ENOMEM;
    }
    uint64_t owned = 0, alloc = 0, inflight = 0, wires = 0;
    for (int i = 0; i < n; i++) owned += owns[i] ? (uint64_t)in->tp[i]->data->numel * 4 : 0;
    *grad = owned;
    *comm = 0;
    int head = 0, len = 0;
    for (int m = 0; m < in->nmods; m++) {
        const ct_module *mod = in->bwd[m];
        uint64_t need = 0;
        for (int j = 0; j < mod->nparams; j++) {
            int t = tindex(mod->params[j]);
            if (t >= 0 && !owns[t] && !have[t]) need += (uint64_t)mod->params[j]->data->numel * 4;
        }
        while (len && inflight + need > limit) { /* finish_oldest */
            int t = fifo[head];
            head = (head + 1) % n;
            len--;
            uint64_t b = (uint64_t)in->tp[t]->data->numel * 4;
            inflight -= b;
            if (wire) wires -= b / 2;
            if (!owns[t]) {
                alloc -= b;
                have[t] = 0;
            }
        }
        for (int j = 0; j < mod->nparams; j++) {
            int t = tindex(mod->params[j]);
            if (t >= 0 && !owns[t] && !have[t]) have[t] = 1;
        }
        alloc += need;
        if (owned + alloc > *grad) *grad = owned + alloc;
        for (int j = 0; j < mod->nparams; j++) { /* grad_to_owners, in parameter order */
            int t = tindex(mod->params[j]);
            if (t < 0) continue;
            uint64_t b = (uint64_t)in->tp[t]->data->numel * 4;
            fifo[(head + len++) % n] = t;
            inflight += b;
            if (wire) wires += b / 2;
            if (wires > *comm) *comm = wires;
        }
    }
    ct_free(fifo);
    ct_free(have);
    return CT_OK;
}

/* ZeRO-2 (src/parallel/zero.c): no buckets; gradients this rank keeps plus those in flight. */
static ct_status row_zero2(const est_in *in, const char *vals, est_row *row)
{
    uint64_t act;
    ct_partition pt;
    CT_TRY(activations(in, vals, &act));
    CT_TRY(partition(in, vals, &pt));
    int64_t *counts = ct_alloc(sizeof *counts * (size_t)(pt.n + 1), CT_MEM_OTHER);
    char *owns = ct_alloc((size_t)in->ntp + 1, CT_MEM_OTHER);
    ct_status st = counts && owns ? CT_OK : CT_ENOMEM;
    uint64_t param = param_bytes(in, opt16(vals, "param_dtype"));
    uint64_t limit = (uint64_t)(optnum(vals, "reduce_buffer_mb", 8) * 1048576.0);
    for (int r = 0; st == CT_OK && r < in->world; r++) {
        /* the shard: exactly the owned elements (src/parallel/zero.c allocates 64 bytes more) */
        memset(owns, 0, (size_t)in->ntp + 1);
        uint64_t shard = 64;
        for (int k = 0; k < pt.n; k++)
            if (pt.ranges[k].owner == r) shard += (uint64_t)pt.ranges[k].count * 4;
        uint64_t grad, comm;
        st = zero2_backward(in, owns, limit, opt16(vals, "reduce_dtype"), &grad, &comm);
        grad += shard;
        if (st == CT_OK) take_rank(row, param, grad + frozen_grad_bytes(in), optim_share(in, &pt, r, counts), act, comm);
    }
    ct_free(counts);
    ct_free(owns);
    ct_partition_fini(&pt);
    return st;
}

/* The top-level child of the model that holds p (its owner's; a tied
 * parameter's is its first user's). */
static int child_of(const est_in *in, const ct_param *p)
{
    const ct_module *m = p->owner;
    while (m && m->parent && m->parent != in->model) m = m->parent;
    for (int i = 0; i < in->model->nkids; i++)
        if (in->model->kids[i] == m) return i;
    return -1;
}

/* The parameters of the model's top-level children [lo, hi), each once:
 * what a pipeline stage keeps (a parameter tied across stages, as the
 * gpt's embedding and head, is in every stage that uses it). */
static ct_status stage_params(const est_in *in, int lo, int hi, const ct_param **out, int *n)
{
    *n = 0;
    for (int c = lo; c < hi; c++) {
        ct_param **ps;
        int np;
        CT_TRY(ct_module_params(in->model->kids[c], &ps, &np));
        for (int i = 0; i < np; i++) {
            int seen = 0;
            for (int j = 0; j < *n && !seen; j++) seen = out[j] == ps[i];
            if (!seen) out[(*n)++] = ps[i];
        }
        ct_free(ps);
    }
    return CT_OK;
}

/* Pipe (src/parallel/pipe*.c): each stage keeps its children's parameters,
 * gradients and optimizer state (sharded over its replicas with dp=zero1);
 * the largest stage sets the row.  Activations: one micro-batch through
 * the stage replayed as est_activations replays a step (what its record
 * keeps, the peak of its forward and backward), then the schedule: a stage
 * holds `chunks` micro-batches (GPipe) or at most P - k (1F1B, receiving
 * one more ahead), each with its received input; the checkpointed ones keep only that (one at a time
 * is recomputed), and under 1F1B with except_last the last one's record
 * lives through another's backward; the last stage under GPipe keeps every
 * micro-batch's loss gradient until its backward, the others receive the
 * next gradient ahead; plus this rank's batch, and one message in flight
 * (comm). */
static ct_status row_pipe(const est_in *in, const char *vals, est_row *row)
{
    char b[256];
    ct_module *m = in->model;
    int n = m->nkids, P = 0;
    const char *sv = optv(vals, "stages", b, sizeof b);
    if (sv && strcmp(sv, "auto")) P = atoi(sv); /* checked by ct_strategy_check_opts */
    int *bal = ct_alloc(sizeof *bal * (size_t)(n + 1), CT_MEM_OTHER);
    const ct_param **sp = ct_alloc(sizeof *sp * (size_t)(in->nparams + 1), CT_MEM_OTHER);
    int64_t *counts = ct_alloc(sizeof *counts * (size_t)(in->ntp + 1), CT_MEM_OTHER);
    ct_status st = bal && sp && counts ? CT_OK : CT_ENOMEM;
    const char *bv = optv(vals, "balance", b, sizeof b);
    int nb = 0;
    for (const char *q = bv; st == CT_OK && q && *q; nb++) {
        bal[nb] = atoi(q);
        q += strcspn(q, ":,");
        q += *q != 0;
    }
    if (!P) P = nb ? nb : in->world < n ? in->world : n; /* auto: as many stages as ranks and layers allow */
    if (st == CT_OK && (P > in->world || P > n || (nb && nb != P)))
        st = ct_error(CT_EINVAL, "pipe: %d stages do not fit %d ranks and a model of %d layers (balance %s)", P, in->world,
                      n, bv && *bv ? bv : "by parameters");
    if (st == CT_OK && !nb) st = ct_pipe_balance_by_params(m, P, bal);
    int R = in->world / (P ? P : 1), chunks = (int)optnum(vals, "chunks", 4), zero1 = 0;
    char dv[32];
    if (optv(vals, "dp", dv, sizeof dv) && !strcmp(dv, "zero1")) zero1 = 1;
    char sch[32], ck[32] = "except_last";
    int gpipe = optv(vals, "schedule", sch, sizeof sch) && !strcmp(sch, "gpipe");
    optv(vals, "checkpoint", ck, sizeof ck);
    int64_t rows = in->batch / (R ? R : 1) + (in->batch % (R ? R : 1) != 0);
    int64_t mrows = (rows + chunks - 1) / chunks, mbs = (rows + mrows - 1) / mrows;
    int mixed = opt16(vals, "param_dtype");
    for (int k = 0, lo = 0; st == CT_OK && k < P; lo += bal[k], k++) {
        int hi = lo + bal[k], ns = 0;
        uint64_t param = 0, grad = 0;
        int nc = 0;
        st = stage_params(in, lo, hi, sp, &ns);
        for (int i = 0; st == CT_OK && i < ns; i++) {
            const ct_param *p = sp[i];
            const char *kind = p->owner && p->owner->ops ? p->owner->ops->kind : "";
            param += bytes_of(p);
            if (mixed && p->requires_grad && p->data->ndim >= 2 && strcmp(kind, "layernorm") && strcmp(kind, "batchnorm"))
                param += (uint64_t)p->data->numel * 2;
            if (p->requires_grad) {
                grad += (uint64_t)p->data->numel * 4;
                counts[nc++] = p->data->numel;
            } else if (p->grad) {
                grad += (uint64_t)ct_tensor_bytes(p->grad);
            }
        }
        if (st != CT_OK) break;
        uint64_t optim = optim_bytes(in, counts, nc);
        if (zero1 && R > 1) { /* the ZeRO partition over the stage's replicas: the largest share */
            ct_partition pt;
            st = ct_partition_init(&pt, counts, nc, R, optnum(vals, "split_params", 0) != 0);
            if (st != CT_OK) break;
            int64_t *share = ct_alloc(sizeof *share * (size_t)(pt.n + 1), CT_MEM_OTHER);
            optim = 0;
            for (int r = 0; share && r < R; r++) {
                uint64_t o = optim_share(in, &pt, r, share);
                optim = o > optim ? o : optim;
            }
            ct_free(share);
            ct_partition_fini(&pt);
        }
        uint64_t kept, peak, inb, outb;
        st = est_stage_activations(in, lo, hi, mrows, mixed, &kept, &peak, &inb, &outb);
        if (st != CT_OK) break;
        int held = gpipe ? (int)mbs : (P - k < mbs ? P - k : (int)mbs), never = !strcmp(ck, "never");
        uint64_t recv = k ? inb + 4 : 0; /* a received input: its values and the sender's status */
        /* 1F1B receives the next micro-batch's input ahead; GPipe all of them at once (held) */
        uint64_t act = peak + (uint64_t)(held + (!gpipe && held < mbs)) * recv + (uint64_t)(held - 1) * (never ? kept : 0);
        if (!never && !gpipe && !strcmp(ck, "except_last") && held > 1) act += kept;
        /* the last stage's loss gradients; the others' next gradient received ahead (messages carry a status) */
        act += k + 1 == P ? (uint64_t)(held - 1) * outb : outb + 8;
        act += est_batch_bytes(in, rows);
        uint64_t comm = k + 1 < P ? outb + 4 : 0;
        if (k && inb + 4 > comm) comm = inb + 4;
        take_rank(row, param, grad, optim, act, comm);
    }
    ct_free(bal);
    ct_free(sp);
    ct_free(counts);
    return st;
}

/* FSDP's backward on one rank, replayed (src/parallel/fsdp.c) over the
 * units other than the root in the order backward reaches them (the
 * reverse of pre-order: a sequential's last unit first), on top of the
 * root's parameters and gradients, which live through the whole backward:
 * a unit's parameters are gathered at its pre-backward (and, with prefetch
 * pre, the next unit's with them; post, after its reduce started), its
 * gradients get memory, and at its post-backward its reduce starts, the
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
#define PEAK()                                             \
    do {                                                   \
        peak[0] = sp > peak[0] ? sp : peak[0];             \
        peak[1] = sg > peak[1] ? sg : peak[1];             \
        peak[2] = sp + sg > peak[2] ? sp + sg : peak[2];   \
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

/* FSDP (src/parallel/fsdp.c), with the units ct_fsdp_plan says it makes:
 * every rank keeps 1/ns of each unit's flat parameter, gradient and
 * optimizer state (ns the world, or 1 for sharding=none and ignored
 * modules; the estimate knows no nodes, so hybrid counts as full), and on
 * top what backward has unsharded at once (fsdp_backward). */
static ct_status row_fsdp(const est_in *in, const char *vals, est_row *row)
{
    uint64_t act;
    CT_TRY(activations(in, vals, &act));
    char opts[2048], b[64], c[64];
    snprintf(opts, sizeof opts, "%s", vals);
    for (char *p = opts; *p; p++)
        if (*p == '\n') *p = ',';
    int n = 0;
    CT_TRY(ct_fsdp_plan(in->model, opts, NULL, 0, &n));
    ct_fsdp_unit *u = ct_alloc(sizeof *u * (size_t)(n + 1), CT_MEM_OTHER);
    int64_t *counts = ct_alloc(sizeof *counts * (size_t)(2 * n + 1), CT_MEM_OTHER);
    uint64_t *fp = ct_alloc(sizeof *fp * (size_t)(2 * n + 2), CT_MEM_OTHER), *fg = fp ? fp + n + 1 : NULL;
    ct_status st = u && counts && fp ? ct_fsdp_plan(in->model, opts, u, n, &n) : CT_ENOMEM;
    const char *sh = optv(vals, "sharding", b, sizeof b), *pf = optv(vals, "backward_prefetch", c, sizeof c);
    int none = sh && !strcmp(sh, "none"), grad_op = sh && !strcmp(sh, "grad_op");
    int prefetch = !pf || !strcmp(pf, "pre") ? 1 : !strcmp(pf, "post") ? 2 : 0;
    uint64_t whole = in->buffer_bytes; /* what fsdp leaves whole: frozen parameters, buffers */
    for (int i = 0; i < in->nparams; i++)
        if (!in->params[i]->requires_grad) whole += bytes_of(in->params[i]);
    for (int r = 0; st == CT_OK && r < in->world; r++) {
        uint64_t pp = 0, root_p = 0, root_g = 0, peak[3] = {0, 0, 0};
        int nc = 0, m = 0;
        for (int i = 0; i < n; i++) {
            int64_t ns = none || u[i].replicated ? 1 : in->world;
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
            if (u[i].is_root) {
                root_p += p1;
                root_g += g1;
            } else {
                fp[m] = p1;
                fg[m++] = g1;
            }
        }
        fsdp_backward(fp, fg, m, root_p, root_g, grad_op, prefetch, peak);
        uint64_t optim = optim_bytes(in, counts, nc), fixed_g = frozen_grad_bytes(in) + pp;
        take_peaks(row, whole + pp + peak[0], fixed_g + peak[1], optim, act, 0, whole + pp + fixed_g + peak[2] + optim);
    }
    ct_free(u);
    ct_free(counts);
    ct_free(fp);
    return st;
}

/* Offload (src/parallel/offload*.c): a slice's parameters, gradients and
 * optimizer state (unpadded: one flat run per slice) are in memory only
 * while it is in use; with prefetch two slices are (the one computing, the
 * next loading; three over several ranks, where a slice's allreduce
 * overlaps the next), one without or when --max-resident-mb holds only
 * one.  The forward after a step holds a slice's all three at once (the
 * update is applied there), so the categories peak together: the row takes
 * the largest slices.  Activations without checkpoint_activation are the
 * whole model's records (as none); with it, every slice's input for the
 * whole batch plus one micro-batch's records of the largest slice.  A
 * parameter that children of two slices use (the gpt's tied embedding)
 * stays resident throughout, with its gradient and state; with
 * param_dtype=bf16 a slice's compute copies come and go with it. */
static int last_user(const est_in *in, const ct_param *p)
{
    int last = -1;
    for (int k = 0; k < in->model->nkids; k++) {
        ct_param **ps;
        int n;
        if (ct_module_params(in->model->kids[k], &ps, &n) != CT_OK) return -1;
        for (int j = 0; j < n; j++) last = ps[j] == p ? k : last;
        ct_free(ps);
    }
    return last;
}

static ct_status row_offload(const est_in *in, const char *vals, est_row *row)
{
    char b[256];
    ct_module *m = in->model;
    int n = m->nkids, ns = (int)optnum(vals, "slices", 4);
    int *sz = ct_alloc(sizeof *sz * (size_t)(n + 1), CT_MEM_OTHER);
    int64_t *outn = ct_alloc(sizeof *outn * (size_t)(n + 1), CT_MEM_OTHER);
    uint64_t *sp = ct_alloc(sizeof *sp * (size_t)(n + 1), CT_MEM_OTHER);
    ct_status st = sz && outn && sp ? CT_OK : CT_ENOMEM;
    const char *bv = optv(vals, "balance", b, sizeof b);
    if (st == CT_OK && bv && *bv) {
        ns = 0;
        for (const char *q = bv; *q; ns++) {
            sz[ns] = atoi(q);
            q += strcspn(q, ":,");
            q += *q != 0;
        }
    } else if (st == CT_OK) {
        st = ct_offload_split(m, ns, sz);
    }
    int nbufs = in->optim == CT_OPT_ADAMW ? 2 : in->momentum != 0 ? 1 : 0;
    int64_t shape[CT_MAX_DIMS], in1 = ct_model_input_numel(&in->cfg);
    int nd = st == CT_OK ? ct_model_input_shape(&in->cfg, 1, shape) : 0;
    for (int i = 0; st == CT_OK && i < n; i++) {
        st = ct_module_out_shape(m->kids[i], nd, shape, &nd, shape);
        outn[i] = 1;
        for (int d = 1; d < nd; d++) outn[i] *= shape[d];
    }
    int64_t rows = in->batch / in->world + (in->batch % in->world != 0);
    int M = (int)optnum(vals, "microbatches", 1), ckpt = optnum(vals, "checkpoint_activation", 0) != 0;
    int64_t mrows = (rows + M - 1) / M;
    int mixed = opt16(vals, "param_dtype");
    uint64_t largest = 0, bound = 0, maxrec = 0, tied = 0, tlow = 0, lowmax = 0;
    for (int k = 0, lo = 0; st == CT_OK && k < ns; lo += sz[k], k++) {
        uint64_t floats = 0, low = 0;
        for (int i = 0; i < in->ntp; i++) {
            const ct_param *p = in->tp[i];
            int c = child_of(in, p), l = c >= lo && c < lo + sz[k] ? last_user(in, p) : -1;
            const char *kind = p->owner && p->owner->ops ? p->owner->ops->kind : "";
            uint64_t lb = mixed && p->data->ndim >= 2 && strcmp(kind, "layernorm") && strcmp(kind, "batchnorm")
                              ? (uint64_t)p->data->numel * 2 : 0;
            if (l < 0) continue;
            if (l >= lo + sz[k]) { /* used by a later slice too: resident */
                tied += (uint64_t)p->data->numel * 4;
                tlow += lb;
            } else {
                floats += (uint64_t)p->data->numel;
                low += lb;
            }
        }
        sp[k] = floats * 4;
        largest = sp[k] > largest ? sp[k] : largest;
        lowmax = low > lowmax ? low : lowmax;
        int64_t inrow = lo ? outn[lo - 1] : in1, rec = inrow;
        for (int i = lo; i < lo + sz[k]; i++) rec += outn[i];
        if (lo) bound += (uint64_t)(rows * inrow) * 4; /* the first slice's input is the batch itself */
        maxrec = (uint64_t)(mrows * rec) * 4 > maxrec ? (uint64_t)(mrows * rec) * 4 : maxrec;
    }
    int ahead = optnum(vals, "prefetch", 1) != 0 ? (in->world > 1 ? 3 : 2) : 1;
    double mb = optnum(vals, "max_resident_mb", 0); /* "auto" reads as 0 */
    /* the tied parameters' data, gradients, state and copies are resident from the start */
    uint64_t fixed = in->buffer_bytes + tied * (uint64_t)(2 + nbufs) + tlow;
    uint64_t per = largest * (uint64_t)(2 + nbufs) + lowmax;
    if (st == CT_OK && mb > 0) {
        uint64_t budget = (uint64_t)(mb * 1048576.0);
        if (fixed + per > budget)
            st = ct_error(CT_EINVAL, "offload: the largest slice needs %.2f MiB resident, over the budget of %.0f MiB; "
                          "use more slices or a larger --max-resident-mb", (double)per / 1048576.0, mb);
        else if ((budget - fixed) / per < (uint64_t)ahead)
            ahead = (int)((budget - fixed) / per);
    }
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
    if (st == CT_OK && ckpt) act = (uint64_t)rows * ((uint64_t)in1 * 4 + 4) + bound + maxrec;
    else if (st == CT_OK) st = est_activations(in, rows, 1, rows != in->batch, mixed, &act);
    if (st == CT_OK) {
        uint64_t both = pb[full] * (uint64_t)(2 + nbufs), three = 2 * pb[ahead];
        uint64_t lows = lowmax * (uint64_t)ahead; /* the compute copies of the slices in memory, at most */
        take_rank(row, in->buffer_bytes + tied + tlow + pb[ahead] + lows, tied + pb[ahead],
                  (tied + pb[full]) * (uint64_t)nbufs, act, 0);
        uint64_t res = fixed + lows + (both > three ? both : three); /* the categories do not peak together at 3 */
        row->resident = res > row->resident ? row->resident : res;
        row->total = row->resident + row->act + row->comm;
    }
    ct_free(sz);
    ct_free(outn);
    ct_free(sp);
    return st;
}

const est_kind est_kinds[] = {
    {"none", 1, row_none},
    {"ddp", 0, row_ddp},
    {"zero1", 0, row_zero1},
    {"zero2", 0, row_zero2},
    {"fsdp", 0, row_fsdp},
    {"pipe", 0, row_pipe},
    {"offload", 0, row_offload},
};
const int est_nkinds = (int)(sizeof est_kinds / sizeof est_kinds[0]);


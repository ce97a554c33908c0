/*
 * ct_strategy_plan: the per-rank memory of a strategy from a model's shapes
 * alone (`ctrain estimate` prints it), like DeepSpeed's memory estimators
 * but for every strategy.  This file reads the model and the run once
 * (ct__plan), holds the figures every planner shares, and the plans of the
 * strategies without a schedule of their own: none, ddp, zero1, zero2.
 * pipe, fsdp and offload are in plan_pipe.c, plan_fsdp.c, plan_offload.c.
 * Each figure follows how the strategy's code allocates, through the rules
 * it uses itself: the partition (ct_partition_init), the mixed-precision
 * policy (ct_param_takes_bf16_copy), the optimizer's state layout
 * (ct_optim_state_bytes), the layers' act_cost (ct_act_plan_run) and the
 * options' defaults (ct_strategy_check_opts).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan.h"
#include "parallel/zero/zero.h"

/* ---- options ----------------------------------------------------------- */

const char *ct__plan_opt(const ct__plan *pl, const char *key, char *buf, size_t n)
{
    size_t len = strlen(key);
    for (const char *p = pl->vals; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, key, len) && p[len] == '=') {
            size_t vl = strcspn(p + len + 1, "\n");
            snprintf(buf, n, "%.*s", (int)vl, p + len + 1);
            return buf;
        }
    return NULL;
}

double ct__plan_num(const ct__plan *pl, const char *key, double def)
{
    char b[64];
    const char *v = ct__plan_opt(pl, key, b, sizeof b);
    return v ? atof(v) : def;
}

int ct__plan_is16(const ct__plan *pl, const char *key)
{
    char b[64];
    const char *v = ct__plan_opt(pl, key, b, sizeof b);
    return v && strcmp(v, "f32") && strcmp(v, "fp32") && strcmp(v, "float32");
}

ct_status ct__plan_balance(const ct__plan *pl, const char *what, int *sizes, int *n)
{
    char b[256];
    const char *bv = ct__plan_opt(pl, "balance", b, sizeof b);
    int *got = NULL;
    *n = 0;
    if (!bv || !bv[0]) return CT_OK;
    CT_TRY(ct__parse_balance(what, bv, pl->model->nkids, &got, n)); /* the strategies' own parser */
    memcpy(sizes, got, sizeof *sizes * (size_t)*n);
    ct_free(got);
    return CT_OK;
}

/* ---- figures the planners share ------------------------------------------ */

void ct__plan_peaks(ct_mem_plan *out, uint64_t param, uint64_t grad, uint64_t optim, uint64_t act, uint64_t comm,
                    uint64_t resident)
{
#define MAX(f) out->f = f > out->f ? f : out->f
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

void ct__plan_rank(ct_mem_plan *out, uint64_t param, uint64_t grad, uint64_t optim, uint64_t act, uint64_t comm)
{
    ct__plan_peaks(out, param, grad, optim, act, comm, param + grad + optim);
}

uint64_t ct__plan_bytes(const ct_param *p) { return (uint64_t)ct_tensor_bytes(p->data); }

uint64_t ct__plan_copy_bytes(const ct_param *p, int mixed)
{
    return mixed && ct_param_takes_bf16_copy(p) ? (uint64_t)p->data->numel * 2 : 0;
}

uint64_t ct__plan_frozen_grads(const ct__plan *pl)
{
    uint64_t b = 0;
    for (int i = 0; i < pl->nparams; i++)
        if (!pl->params[i]->requires_grad && pl->params[i]->grad) b += (uint64_t)ct_tensor_bytes(pl->params[i]->grad);
    return b;
}

uint64_t ct__plan_optim(const ct__plan *pl, const int64_t *counts, int n)
{
    return ct_optim_state_bytes(&pl->spec->optim, counts, n);
}

uint64_t ct__plan_optim_share(const ct__plan *pl, const ct_partition *pt, int r, int64_t *counts)
{
    int n = 0;
    for (int k = 0; k < pt->n; k++)
        if (pt->ranges[k].owner == r) counts[n++] = pt->ranges[k].count;
    return ct__plan_optim(pl, counts, n);
}

uint64_t ct__plan_batch_bytes(const ct__plan *pl, int64_t rows) { return (uint64_t)rows * pl->spec->sample_bytes; }

/* The input of mrows rows: [mrows, in_shape...]. */
static int input_shape(const ct__plan *pl, int64_t mrows, int64_t *sh)
{
    sh[0] = mrows;
    for (int d = 0; d < pl->spec->in_ndim; d++) sh[d + 1] = pl->spec->in_shape[d];
    return pl->spec->in_ndim + 1;
}

ct_status ct__plan_act(const ct__plan *pl, int64_t rows, int k, int mixed, uint64_t *act)
{
    int64_t mrows = rows / k + (rows % k != 0), sh[CT_MAX_DIMS + 1];
    int nd = input_shape(pl, mrows, sh);
    /* The loss gradient is scaled by micro / global (a copy) unless the micro-batch is the whole batch. */
    int flags = CT_ACT_WHOLE | (mixed ? CT_ACT_MIXED : 0) | (mrows != pl->spec->batch ? CT_ACT_SCALED : 0);
    ct_act_plan ap;
    ct_module *root = pl->model;
    CT_TRY(ct_act_plan_run(&root, 1, nd, sh, flags, &ap));
    *act = ap.peak + ct__plan_batch_bytes(pl, rows);
    return CT_OK;
}

ct_status ct__plan_stage_act(const ct__plan *pl, int lo, int hi, int64_t mrows, int mixed, int flags, ct_act_plan *out)
{
    int64_t sh[CT_MAX_DIMS + 1];
    int nd = input_shape(pl, mrows, sh);
    for (int i = 0; i < lo; i++) CT_TRY(ct_module_out_shape(pl->model->kids[i], nd, sh, &nd, sh));
    return ct_act_plan_run(pl->model->kids + lo, hi - lo, nd, sh,
                           flags | (lo > 0 ? CT_ACT_DX0 : 0) | (mixed ? CT_ACT_MIXED : 0), out);
}

static int by_addr(const void *a, const void *b)
{
    const ct_param *x = ((const struct ct__plan_ix *)a)->p, *y = ((const struct ct__plan_ix *)b)->p;
    return x < y ? -1 : x > y;
}

int ct__plan_tindex(const ct__plan *pl, const ct_param *p)
{
    struct ct__plan_ix key = {p, 0};
    const struct ct__plan_ix *hit = bsearch(&key, pl->by_addr, (size_t)pl->ntp, sizeof key, by_addr);
    return hit ? hit->i : -1;
}

/* Every parameter (f32 master) and buffer, plus the compute copies. */
static uint64_t param_bytes(const ct__plan *pl, int mixed)
{
    uint64_t b = pl->buffer_bytes;
    for (int i = 0; i < pl->nparams; i++) b += ct__plan_bytes(pl->params[i]) + ct__plan_copy_bytes(pl->params[i], mixed);
    return b;
}

static uint64_t trainable_bytes(const ct__plan *pl)
{
    uint64_t b = 0;
    for (int i = 0; i < pl->ntp; i++) b += (uint64_t)pl->tp[i]->data->numel * 4;
    return b;
}

static ct_status optim_whole(const ct__plan *pl, uint64_t *b)
{
    int64_t *c = ct_alloc(sizeof *c * (size_t)(pl->ntp + 1), CT_MEM_OTHER);
    if (!c) return CT_ENOMEM;
    for (int i = 0; i < pl->ntp; i++) c[i] = pl->tp[i]->data->numel;
    *b = ct__plan_optim(pl, c, pl->ntp);
    ct_free(c);
    return CT_OK;
}

/* Activations of this rank's share of the global batch in grad_accum micro-batches. */
static ct_status activations(const ct__plan *pl, uint64_t *act)
{
    return ct__plan_act(pl, pl->rows, (int)ct__plan_num(pl, "grad_accum", 1), ct__plan_is16(pl, "param_dtype"), act);
}

/* The partition of the trainable parameters over the ranks (as the sharded strategies make it). */
static ct_status partition(const ct__plan *pl, ct_partition *pt)
{
    int64_t *c = ct_alloc(sizeof *c * (size_t)(pl->ntp + 1), CT_MEM_OTHER);
    if (!c) return CT_ENOMEM;
    for (int i = 0; i < pl->ntp; i++) c[i] = pl->tp[i]->data->numel;
    ct_status st = ct_partition_init(pt, c, pl->ntp, pl->spec->world, ct__plan_num(pl, "split_params", 0) != 0);
    ct_free(c);
    return st;
}

/* ---- none, ddp, zero1 ---------------------------------------------------- */

/* One replica, nothing shared: every gradient where the model made it. */
static ct_status plan_none(const ct__plan *pl, ct_mem_plan *out)
{
    if (pl->spec->world > 1)
        return ct_error(CT_EUNSUPPORTED, "strategy none runs every rank alone; it plans --ranks 1 only");
    uint64_t act, optim;
    CT_TRY(activations(pl, &act));
    CT_TRY(optim_whole(pl, &optim));
    ct__plan_rank(out, param_bytes(pl, ct__plan_is16(pl, "param_dtype")), trainable_bytes(pl) + ct__plan_frozen_grads(pl),
                  optim, act, 0);
    return CT_OK;
}

/* PowerSGD's buffers (powersgd.c, bucket_plan), kept from the first
 * compressed step on: per gradient P [n, r] and Q [m, r] in f32 where it is
 * compressed (the same rule: viewed as [n = shape[0], m = the rest],
 * r = min(n, m, rank), (n + m) r rate < n m), else its copy in the
 * uncompressed part; with error feedback the error and a copy of every
 * bucket (2 x 4 bytes an element); a few floats per bucket are left out. */
static uint64_t powersgd_bytes(const ct__plan *pl)
{
    double rank = ct__plan_num(pl, "powersgd_rank", 0), rate = ct__plan_num(pl, "powersgd_min_compression_rate", 2);
    if (rank <= 0) return 0;
    uint64_t b = 0;
    for (int i = 0; i < pl->ntp; i++) {
        const ct_tensor *t = pl->tp[i]->data;
        int64_t rows = t->ndim > 1 ? t->shape[0] : 0, cols = rows ? t->numel / rows : 0;
        double r = (double)(rows < cols ? rows : cols);
        if (r > rank) r = rank;
        if (rows > 0 && (double)(rows + cols) * r * rate < (double)t->numel) b += (uint64_t)((double)(rows + cols) * r) * 4;
        else b += (uint64_t)t->numel * 4;
        if (ct__plan_num(pl, "powersgd_error_feedback", 1) != 0) b += (uint64_t)t->numel * 8;
    }
    return b;
}

/* The communication bytes of DDP's (and ZeRO-1's) buckets beside the
 * gradients: a 16-bit reduce_dtype's 2-byte wire copy of every bucket, or
 * PowerSGD's buffers. */
static uint64_t bucket_comm(const ct__plan *pl, uint64_t tb)
{
    return ct__plan_is16(pl, "reduce_dtype") ? tb / 2 : powersgd_bytes(pl);
}

/* DDP (ddp.c): gradients live once, in the buckets (rebuilt at zero_grad
 * with the old ones freed first), and bucket_comm's bytes. */
static ct_status plan_ddp(const ct__plan *pl, ct_mem_plan *out)
{
    uint64_t act, optim, tb = trainable_bytes(pl);
    CT_TRY(activations(pl, &act));
    CT_TRY(optim_whole(pl, &optim));
    ct__plan_rank(out, param_bytes(pl, ct__plan_is16(pl, "param_dtype")), tb + ct__plan_frozen_grads(pl), optim, act,
                  bucket_comm(pl, tb));
    return CT_OK;
}

/* ZeRO-1 (zero.c): DDP's buckets, optimizer state for this rank's ranges only. */
static ct_status plan_zero1(const ct__plan *pl, ct_mem_plan *out)
{
    uint64_t act;
    ct_partition pt;
    CT_TRY(activations(pl, &act));
    CT_TRY(partition(pl, &pt));
    int64_t *counts = ct_alloc(sizeof *counts * (size_t)(pt.n + 1), CT_MEM_OTHER);
    if (!counts) {
        ct_partition_fini(&pt);
        return CT_ENOMEM;
    }
    uint64_t tb = trainable_bytes(pl), param = param_bytes(pl, ct__plan_is16(pl, "param_dtype"));
    for (int r = 0; r < pl->spec->world; r++)
        ct__plan_rank(out, param, tb + ct__plan_frozen_grads(pl), ct__plan_optim_share(pl, &pt, r, counts), act,
                      bucket_comm(pl, tb));
    ct_free(counts);
    ct_partition_fini(&pt);
    return CT_OK;
}

/* ---- zero2 --------------------------------------------------------------- */

/* ZeRO-2's backward on one rank, replayed (zero2.c): every parameter's
 * gradient is materialised when its module starts backward, after the
 * oldest reduces are waited for while the bytes in flight plus the module's
 * need exceed reduce_buffer_mb, and freed when its reduce is waited for (all
 * of them at the end of backward).  With a 16-bit reduce_dtype each
 * gradient's 2-byte wire copy lives from its grad-ready hook to that wait.
 * The peaks of gradient and wire bytes go to *grad and *comm. */
static ct_status zero2_backward(const ct__plan *pl, uint64_t limit, int wire, uint64_t *grad, uint64_t *comm)
{
    int n = pl->ntp, *fifo = ct_alloc(sizeof *fifo * (size_t)(n + 1), CT_MEM_OTHER);
    char *have = ct_alloc_zeroed((size_t)n + 1, CT_MEM_OTHER);
    if (!fifo || !have) {
        ct_free(fifo);
        ct_free(have);
        return CT_ENOMEM;
    }
    uint64_t alloc = 0, inflight = 0, wires = 0;
    *grad = *comm = 0;
    int head = 0, len = 0;
    for (int m = 0; m < pl->nmods; m++) {
        const ct_module *mod = pl->bwd[m];
        uint64_t need = 0;
        for (int j = 0; j < mod->nparams; j++) {
            int t = ct__plan_tindex(pl, mod->params[j]);
            if (t >= 0 && !have[t]) need += (uint64_t)mod->params[j]->data->numel * 4;
        }
        while (len && inflight + need > limit) { /* finish the oldest */
            int t = fifo[head];
            head = (head + 1) % n;
            len--;
            uint64_t b = (uint64_t)pl->tp[t]->data->numel * 4;
            inflight -= b;
            if (wire) wires -= b / 2;
            alloc -= b;
            have[t] = 0;
        }
        for (int j = 0; j < mod->nparams; j++) {
            int t = ct__plan_tindex(pl, mod->params[j]);
            if (t >= 0) have[t] = 1;
        }
        alloc += need;
        *grad = alloc > *grad ? alloc : *grad;
        for (int j = 0; j < mod->nparams; j++) { /* to the owners, in parameter order */
            int t = ct__plan_tindex(pl, mod->params[j]);
            if (t < 0) continue;
            uint64_t b = (uint64_t)pl->tp[t]->data->numel * 4;
            fifo[(head + len++) % n] = t;
            inflight += b;
            if (wire) wires += b / 2;
            *comm = wires > *comm ? wires : *comm;
        }
    }
    ct_free(fifo);
    ct_free(have);
    return CT_OK;
}

/* ZeRO-2 (zero2.c): the gradient shard this rank keeps (ct__zero2_shard_bytes)
 * plus the gradients in flight; with reduce_bucket_size, the
 * buckets (every rank holds all of them) count as comm.  The replay still
 * counts a bucketed gradient in flight until its wait, though it goes as
 * soon as it is packed: the plan errs high there. */
static ct_status plan_zero2(const ct__plan *pl, ct_mem_plan *out)
{
    uint64_t act, grad, comm;
    ct_partition pt;
    CT_TRY(activations(pl, &act));
    CT_TRY(zero2_backward(pl, (uint64_t)(ct__plan_num(pl, "reduce_buffer_mb", 8) * 1048576.0),
                          ct__plan_is16(pl, "reduce_dtype"), &grad, &comm));
    CT_TRY(partition(pl, &pt));
    int64_t *counts = ct_alloc(sizeof *counts * (size_t)(pt.n + 1), CT_MEM_OTHER);
    if (!counts) {
        ct_partition_fini(&pt);
        return CT_ENOMEM;
    }
    comm += ct__zbuckets_plan_bytes(&pt, (int64_t)ct__plan_num(pl, "reduce_bucket_size", 0),
                                    ct__plan_is16(pl, "reduce_dtype") ? CT_BF16 : CT_F32);
    uint64_t param = param_bytes(pl, ct__plan_is16(pl, "param_dtype"));
    for (int r = 0; r < pl->spec->world; r++) {
        uint64_t shard = ct__zero2_shard_bytes(&pt, r);
        ct__plan_rank(out, param, grad + shard + ct__plan_frozen_grads(pl), ct__plan_optim_share(pl, &pt, r, counts),
                      act, comm);
    }
    ct_free(counts);
    ct_partition_fini(&pt);
    return CT_OK;
}

/* ---- the whole life: set-up and save ------------------------------------ */

/* Resident bytes of the whole model as ct_model_build leaves it on every
 * rank: the parameters and buffers it initialised (its zeroed gradients are
 * fresh pages, counted by the allocator but not resident until written). */
static uint64_t model_whole(const ct__plan *pl) { return param_bytes(pl, 0); }

/* Set-up, one function per strategy: what the code does.  The model is
 * built shape-only (ctrain train does; no parameter memory), and each
 * strategy makes what its rank holds from the parameters' rules: the
 * replicated ones the whole model, fsdp its shards, pipe its stage, offload
 * one slice at a time on its way to the store. */
static uint64_t setup_replicated(const ct__plan *pl, const ct_mem_plan *p)
{
    (void)p; /* DDP's buckets and ZeRO's gradients are written by the first backward, not at wrap */
    return model_whole(pl);
}

static uint64_t setup_fsdp(const ct__plan *pl, const ct_mem_plan *p)
{
    (void)p; /* every unit's shard, made from the rules: no unit is ever whole */
    uint64_t t = trainable_bytes(pl);
    return model_whole(pl) - t + (t + (uint64_t)pl->spec->world - 1) / (uint64_t)pl->spec->world;
}

static uint64_t setup_pipe(const ct__plan *pl, const ct_mem_plan *p)
{
    (void)pl;
    return p->param; /* this rank's stage, made by its replica strategy */
}

static uint64_t setup_offload(const ct__plan *pl, const ct_mem_plan *p)
{
    return pl->buffer_bytes + p->flat; /* a slice at a time moves into its flat and out to the store */
}

/* A full save's peak on rank 0: the steady state alone where the state is
 * the parameters and slots themselves (none, ddp); plus the largest tensor
 * where the state is streamed one tensor at a time (ct_strategy_state_foreach:
 * zero, fsdp gather it, pipe's later stages send it, offload reads it from
 * its store; fsdp's offloaded parts too, after its pending updates went
 * through a 1 MiB buffer: no unit's shard comes in). */
static uint64_t save_views(const ct__plan *pl, const ct_mem_plan *p)
{
    (void)pl;
    return p->resident;
}

static uint64_t largest_param(const ct__plan *pl);
static uint64_t save_streamed(const ct__plan *pl, const ct_mem_plan *p) { return p->resident + largest_param(pl); }

/* Other ranks' pages in this rank's resident set: DDP's buckets (ZeRO-1's
 * too) are shared-memory windows when the ranks share a node, and
 * ct_group_alloc_shared maps every peer's pages at creation (a byte read per
 * page), so each rank holds every local rank's buckets.  The plan knows no
 * nodes: it takes one. */
static uint64_t peers_none(const ct__plan *pl)
{
    (void)pl;
    return 0;
}

static uint64_t peers_buckets(const ct__plan *pl)
{
    return (uint64_t)(pl->spec->world - 1) * trainable_bytes(pl);
}

/* The largest flat where the planner did not say: a DDP bucket (bucket_cap_mb,
 * or one parameter larger than that), or ZeRO-2's one gradient. */
static uint64_t largest_param(const ct__plan *pl)
{
    uint64_t b = 0;
    for (int i = 0; i < pl->ntp; i++) b = (uint64_t)pl->tp[i]->data->numel * 4 > b ? (uint64_t)pl->tp[i]->data->numel * 4 : b;
    return b;
}

/* What a teardown adds to training's resident set: ZeRO-2 hands every
 * parameter a gradient of its own and writes this rank's reduced pieces into
 * them while its own shard is still held (the other strategies' teardowns
 * free, or hand over the bytes they hold). */
static uint64_t teardown_none(const ct__plan *pl)
{
    (void)pl;
    return 0;
}

static uint64_t teardown_zero2(const ct__plan *pl)
{
    return (trainable_bytes(pl) + (uint64_t)pl->spec->world - 1) / (uint64_t)pl->spec->world;
}

static void whole_life(const ct__plan *pl, uint64_t (*setup)(const ct__plan *, const ct_mem_plan *),
                       uint64_t (*save)(const ct__plan *, const ct_mem_plan *), uint64_t (*peers)(const ct__plan *),
                       uint64_t (*teardown)(const ct__plan *), ct_mem_plan *out)
{
    if (!out->flat) {
        char cb[32];
        const char *cv = ct__plan_opt(pl, "bucket_cap_mb", cb, sizeof cb); /* NULL: no buckets */
        uint64_t tb = trainable_bytes(pl), cap = cv ? (uint64_t)(atof(cv) * 1048576.0) : 0;
        if (cv && !strcmp(cv, "auto")) cap = ct__ddp_auto_cap(tb, 1); /* the plan's ranks share a node */
        out->flat = largest_param(pl);
        if (cap > out->flat) out->flat = cap < tb ? cap : tb;
    }
    double mb = ct__plan_num(pl, "alloc_cache_mb", -1); /* "auto" reads as 0: atof */
    char b[32];
    const char *v = ct__plan_opt(pl, "alloc_cache_mb", b, sizeof b);
    uint64_t floor_b = (uint64_t)CT_MEM_CACHE_MIN_MB << 20;
    out->cache = v && strcmp(v, "auto") ? (uint64_t)(mb * 1048576.0)
               : out->flat * CT_MEM_CACHE_UNITS > floor_b ? out->flat * CT_MEM_CACHE_UNITS : floor_b;
    out->shared = peers(pl);
    out->setup = out->shared + setup(pl, out);
    out->save = out->shared + save(pl, out);
    /* The cache holds blocks training freed and has not reused: at most its bound, and in practice a
     * step's activations and two flats (a small model never fills the 64 MiB floor).  A save after it
     * takes its transients from those blocks first, so the resident set is the larger of training's
     * with the cache and the save's own. */
    uint64_t churn = out->act + out->comm + 2 * out->flat;
    uint64_t top = out->shared + out->total + (out->cache < churn ? out->cache : churn);
    out->life_phase = CT_PHASE_TRAIN;
    uint64_t down = teardown(pl);
    if (down) top += down, out->life_phase = CT_PHASE_TEARDOWN; /* on top of what training left resident */
    if (out->setup > top) top = out->setup, out->life_phase = CT_PHASE_WRAP;
    if (out->save > top) top = out->save, out->life_phase = CT_PHASE_SAVE;
    out->life = top;
}

/* ---- the entry ------------------------------------------------------------ */

static const struct {
    const char *kind;
    ct_status (*plan)(const ct__plan *pl, ct_mem_plan *out);
    uint64_t (*setup)(const ct__plan *pl, const ct_mem_plan *p); /* the set-up peak */
    uint64_t (*save)(const ct__plan *pl, const ct_mem_plan *p);  /* a full save's peak on rank 0 */
    uint64_t (*peers)(const ct__plan *pl);                       /* other ranks' pages mapped here */
    uint64_t (*teardown)(const ct__plan *pl);                    /* what a teardown adds to training's */
} planners[] = {
    {"none", plan_none, setup_replicated, save_views, peers_none, teardown_none},
    {"ddp", plan_ddp, setup_replicated, save_views, peers_buckets, teardown_none},
    {"zero1", plan_zero1, setup_replicated, save_streamed, peers_buckets, teardown_none},
    {"zero2", plan_zero2, setup_replicated, save_streamed, peers_none, teardown_zero2},
    {"fsdp", ct__plan_fsdp, setup_fsdp, save_streamed, peers_none, teardown_none},
    {"pipe", ct__plan_pipe, setup_pipe, save_streamed, peers_none, teardown_none},
    {"offload", ct__plan_offload, setup_offload, save_streamed, peers_none, teardown_none},
};

/* The model's parameters, buffers and the order backward reaches its modules. */
static ct_status read_model(ct__plan *pl)
{
    CT_TRY(ct_module_params(pl->model, &pl->params, &pl->nparams));
    pl->tp = ct_alloc(sizeof *pl->tp * (size_t)(pl->nparams + 1), CT_MEM_OTHER);
    pl->by_addr = ct_alloc(sizeof *pl->by_addr * (size_t)(pl->nparams + 1), CT_MEM_OTHER);
    if (!pl->tp || !pl->by_addr) return CT_ENOMEM;
    for (int i = 0; i < pl->nparams; i++)
        if (pl->params[i]->requires_grad) {
            pl->by_addr[pl->ntp] = (struct ct__plan_ix){pl->params[i], pl->ntp};
            pl->tp[pl->ntp++] = pl->params[i];
        }
    qsort(pl->by_addr, (size_t)pl->ntp, sizeof *pl->by_addr, by_addr);
    ct_param **bufs;
    int nb;
    CT_TRY(ct_module_buffers(pl->model, &bufs, &nb));
    for (int i = 0; i < nb; i++) pl->buffer_bytes += (uint64_t)ct_tensor_bytes(bufs[i]->data);
    ct_free(bufs);
    /* Backward runs the modules in the reverse of forward's order (pre-order for the containers). */
    ct_module **mods;
    int nm;
    CT_TRY(ct_module_modules(pl->model, &mods, &nm));
    pl->bwd = ct_alloc(sizeof *pl->bwd * (size_t)(nm + 1), CT_MEM_OTHER);
    for (int i = nm - 1; pl->bwd && i >= 0; i--) {
        int trainable = 0;
        for (int j = 0; j < mods[i]->nparams; j++) trainable |= mods[i]->params[j]->requires_grad;
        if (trainable) pl->bwd[pl->nmods++] = mods[i];
    }
    ct_free(mods);
    return pl->bwd ? CT_OK : CT_ENOMEM;
}

ct_status ct_strategy_plan(const char *kind, ct_module *model, const char *opts, const ct_plan_spec *spec,
                           ct_mem_plan *out)
{
    if (!model || !spec || !out) return ct_error(CT_EINVAL, "ct_strategy_plan: model, spec and out must not be NULL");
    if (spec->world < 1 || spec->batch < 1)
        return ct_error(CT_EINVAL, "ct_strategy_plan: %d ranks and a batch of %lld; both must be at least 1",
                        spec->world, (long long)spec->batch);
    if (spec->in_ndim < 0 || spec->in_ndim >= CT_MAX_DIMS)
        return ct_error(CT_EINVAL, "ct_strategy_plan: a sample of %d dims; give 0 to %d (the batch dim is added)",
                        spec->in_ndim, CT_MAX_DIMS - 1);
    size_t k = 0;
    while (k < sizeof planners / sizeof planners[0] && (!kind || strcmp(planners[k].kind, kind))) k++;
    if (k == sizeof planners / sizeof planners[0])
        return ct_error(CT_EINVAL, "unknown strategy '%s' to plan; choose one of: %s", kind ? kind : "(null)",
                        ct_strategy_list());
    *out = (ct_mem_plan){0};
    ct__plan *pl = ct_alloc_zeroed(sizeof *pl, CT_MEM_OTHER);
    if (!pl) return CT_ENOMEM;
    pl->model = model;
    pl->spec = spec;
    pl->opts = opts;
    pl->rows = spec->batch / spec->world + (spec->batch % spec->world != 0);
    size_t nvals = 4096 + (opts ? strlen(opts) : 0);
    ct_status st = (pl->vals = ct_alloc(nvals, CT_MEM_OTHER)) ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) st = ct_strategy_check_opts(kind, opts, pl->vals, nvals);
    if (st == CT_OK) st = read_model(pl);
    if (st == CT_OK) st = planners[k].plan(pl, out);
    if (st == CT_OK) whole_life(pl, planners[k].setup, planners[k].save, planners[k].peers, planners[k].teardown, out);
    ct_free(pl->params);
    ct_free(pl->tp);
    ct_free(pl->by_addr);
    ct_free(pl->bwd);
    ct_free(pl->vals);
    ct_free(pl);
    return st;
}

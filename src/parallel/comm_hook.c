/*
 * Communication hooks: how DDP's (and ZeRO-1's) gradient buckets, and
 * FSDP's unit gradients, are reduced (include/ctrain/comm_hook.h).  This file owns the mechanism (a
 * strategy's hook, made from its options or registered by the user, and the
 * public view of a bucket it is handed) and the built-in allreduce, in f32
 * or with a 16-bit wire dtype.  PowerSGD is in powersgd.c.
 */
#include <string.h>

#include "ctrain/comm_hook.h"
#include "internal.h"

struct ct__hook {
    const ct_comm_hook_ops *ops;
    void *state;
};

/* ---- the built-in allreduce --------------------------------------------- */

typedef struct {
    uint16_t *buf;
    int64_t n;
} scratch_t;

typedef struct {
    ct_dtype wire;
    /* 16-bit scratch per bucket index where the bucket brings none (registered
     * on an f32 strategy, or FSDP's units): several are in flight at once */
    scratch_t *own;
    int nown;
} allreduce_hook;

/* The 16-bit wire of b: the bucket's own, or n elements of scratch for its index. */
static uint16_t *wire_of(allreduce_hook *h, const ct_comm_bucket *b, int64_t n)
{
    if (b->wire && !b->shard) return b->wire;
    if (b->index < 0) return NULL;
    if (b->index >= h->nown) {
        int nn = b->index + 1 > 2 * h->nown ? b->index + 1 : 2 * h->nown;
        scratch_t *o = ct_alloc_zeroed(sizeof *o * (size_t)nn, CT_MEM_OTHER);
        if (!o) return NULL;
        if (h->nown) memcpy(o, h->own, sizeof *o * (size_t)h->nown);
        ct_free(h->own);
        h->own = o;
        h->nown = nn;
    }
    scratch_t *s = &h->own[b->index];
    if (s->n < n) {
        ct_free(s->buf);
        s->n = 0;
        if (!(s->buf = ct_alloc((size_t)n * 2, CT_MEM_COMM))) return NULL;
        s->n = n;
    }
    return s->buf;
}

/* An allreduce of the bucket, or for FSDP (b->shard) a reduce-scatter into
 * this rank's piece; 16-bit: the packed gradients, then the piece after them. */
static ct_status allreduce_start(void *state, ct_group *g, const ct_comm_bucket *b, ct_work **work)
{
    allreduce_hook *h = state;
    void *buf = b->grad, *out = b->shard;
    if (h->wire != CT_F32) {
        uint16_t *w = wire_of(h, b, b->numel + (b->shard ? b->shard_numel : 0));
        if (!w) return CT_ENOMEM;
        ct__wire_pack(h->wire, b->grad, w, b->numel);
        buf = w;
        out = w + b->numel;
    }
    if (b->shard) return ct_group_reduce_scatter(g, buf, out, b->shard_numel, h->wire, CT_OP_SUM, work);
    return ct_group_allreduce(g, buf, b->numel, h->wire, CT_OP_SUM, work);
}

static ct_status allreduce_finish(void *state, ct_group *g, const ct_comm_bucket *b)
{
    (void)g;
    allreduce_hook *h = state;
    if (h->wire == CT_F32) return CT_OK;
    uint16_t *w = wire_of(h, b, 0); /* the start's */
    if (b->shard) ct__wire_unpack(h->wire, w + b->numel, b->shard, b->shard_numel, 0);
    else ct__wire_unpack(h->wire, w, b->grad, b->numel, 0);
    return CT_OK;
}

static void allreduce_destroy(void *state)
{
    allreduce_hook *h = state;
    if (!h) return;
    for (int i = 0; i < h->nown; i++) ct_free(h->own[i].buf);
    ct_free(h->own);
    ct_free(h);
}

static const ct_comm_hook_ops allreduce_ops[3] = {
    {"allreduce", allreduce_start, allreduce_finish, allreduce_destroy},
    {"bf16", allreduce_start, allreduce_finish, allreduce_destroy},
    {"f16", allreduce_start, allreduce_finish, allreduce_destroy},
};

ct_status ct_comm_hook_allreduce(ct_dtype wire, const ct_comm_hook_ops **ops, void **state)
{
    if (wire != CT_F32 && wire != CT_BF16 && wire != CT_F16)
        return ct_error(CT_EINVAL, "ct_comm_hook_allreduce: wire dtype %s: give f32, bf16 or f16", ct_dtype_name(wire));
    allreduce_hook *h = ct_alloc_zeroed(sizeof *h, CT_MEM_OTHER);
    if (!h) return CT_ENOMEM;
    h->wire = wire;
    *ops = &allreduce_ops[wire == CT_F32 ? 0 : wire == CT_BF16 ? 1 : 2];
    *state = h;
    return CT_OK;
}

/* ---- a strategy's hook -------------------------------------------------- */

static void hook_release(ct_strategy *s)
{
    if (!s->hook) return;
    if (s->hook->ops->destroy) s->hook->ops->destroy(s->hook->state);
    ct_free(s->hook);
    s->hook = NULL;
}

static ct_status hook_set(ct_strategy *s, const ct_comm_hook_ops *ops, void *state)
{
    struct ct__hook *h = ct_alloc_zeroed(sizeof *h, CT_MEM_OTHER);
    if (!h) {
        if (ops->destroy) ops->destroy(state);
        return CT_ENOMEM;
    }
    hook_release(s);
    h->ops = ops;
    h->state = state;
    s->hook = h;
    return CT_OK;
}

void ct__comm_hook_free(ct_strategy *s) { hook_release(s); }

ct_status ct__comm_hook_setup(ct_strategy *s, const ct__ddp_opts *o)
{
    if (s->hook) return CT_OK; /* registered before the buckets were made */
    const ct_comm_hook_ops *ops;
    void *state;
    if (o->local_sgd != CT__LOCAL_SGD_OFF) {
        CT_TRY(ct__local_sgd_hook(s, o, &ops, &state));
    } else if (o->powersgd_rank > 0) {
        if (s->common.reduce_dtype != CT_F32)
            return ct_error(CT_EINVAL, "%s: powersgd_rank with reduce_dtype=%s: PowerSGD sends its factors in f32; "
                            "choose one (drop --grad-compress bf16|f16 or powersgd)", s->ops->kind,
                            ct_dtype_name((ct_dtype)s->common.reduce_dtype));
        if (o->powersgd_rank > 1 << 20)
            return ct_error(CT_EINVAL, "%s: powersgd_rank=%lld is too large (at most %d)", s->ops->kind,
                            (long long)o->powersgd_rank, 1 << 20);
        ct_powersgd_opts p = ct_powersgd_defaults((int)o->powersgd_rank);
        p.start_iter = o->powersgd_start_iter > 1 << 30 ? 1 << 30 : (int)o->powersgd_start_iter;
        p.min_compression_rate = o->powersgd_min_compression_rate;
        p.error_feedback = o->powersgd_error_feedback;
        p.warm_start = o->powersgd_warm_start;
        p.seed = (uint64_t)o->powersgd_seed;
        CT_TRY(ct_comm_hook_powersgd(&p, &ops, &state));
    } else {
        CT_TRY(ct_comm_hook_allreduce((ct_dtype)s->common.reduce_dtype, &ops, &state));
    }
    return hook_set(s, ops, state);
}

ct_status ct_strategy_register_comm_hook(ct_strategy *s, const ct_comm_hook_ops *ops, void *state)
{
    if (!ops || !ops->start || !ops->finish) {
        if (ops && ops->destroy) ops->destroy(state);
        return ct_error(CT_EINVAL, "ct_strategy_register_comm_hook: the hook needs start and finish");
    }
    if (!s->ops->takes_comm_hook) {
        if (ops->destroy) ops->destroy(state);
        return ct_error(CT_EINVAL, "ct_strategy_register_comm_hook: strategy %s has no gradient buckets to reduce "
                        "through a hook; communication hooks apply to ddp, zero1 and fsdp", s->ops->kind);
    }
    const char *ls = ct_strategy_opt(s, "local_sgd");
    if (ls && strcmp(ls, "off")) {
        if (ops->destroy) ops->destroy(state);
        return ct_error(CT_EINVAL, "ct_strategy_register_comm_hook: this ddp runs post-local SGD (local_sgd=%s), "
                        "which is its comm hook; register yours on a ddp without local_sgd", ls);
    }
    const char *sh = ct_strategy_opt(s, "sharding");
    if (!strcmp(s->ops->kind, "fsdp") && sh && !strcmp(sh, "none")) {
        if (ops->destroy) ops->destroy(state);
        return ct_error(CT_EINVAL, "ct_strategy_register_comm_hook: fsdp with sharding=none allreduces whole "
                        "gradients as DDP does; use strategy ddp, whose buckets take hooks");
    }
    if (!strcmp(s->ops->kind, "fsdp") && ops->name && !strcmp(ops->name, "powersgd")) {
        if (ops->destroy) ops->destroy(state);
        return ct_error(CT_EINVAL, "ct_strategy_register_comm_hook: PowerSGD compresses whole gradient matrices; "
                        "FSDP's sharded gradients need a reduce-scatter (PyTorch refuses it too): register the bf16 "
                        "or f16 allreduce hook, or use ddp");
    }
    return hook_set(s, ops, state);
}

const char *ct_strategy_comm_hook(const ct_strategy *s, void **state)
{
    if (!s->hook) return NULL;
    if (state) *state = s->hook->state;
    return s->hook->ops->name;
}

ct_status ct__comm_hook_start_on(ct_strategy *s, ct_group *g, const ct_comm_bucket *b, ct_work **work)
{
    *work = NULL;
    return s->hook->ops->start(s->hook->state, g, b, work);
}

ct_status ct__comm_hook_finish_on(ct_strategy *s, ct_group *g, const ct_comm_bucket *b)
{
    return s->hook->ops->finish(s->hook->state, g, b);
}

ct_status ct__comm_hook_start(ct_strategy *s, const ct_comm_bucket *b, ct_work **work)
{
    *work = NULL;
    if (!s->hook) /* DDP's create sets it up before any bucket exists */
        return ct_error(CT_ESTATE, "%s: a bucket was started before the strategy's comm hook was set up", s->ops->kind);
    return ct__comm_hook_start_on(s, s->g, b, work);
}

ct_status ct__comm_hook_finish(ct_strategy *s, const ct_comm_bucket *b) { return ct__comm_hook_finish_on(s, s->g, b); }

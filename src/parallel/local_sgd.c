/*
 * Post-local SGD and periodic model averaging for DDP (PyTorch 1.13's
 * post_localSGD_hook with PostLocalSGDState, and
 * model_averaging.averagers.PeriodicModelAverager run after every step, as
 * PostLocalSGDOptimizer does).  This file owns both halves:
 *
 *  - the hook (DDP's comm hook mechanism, comm_hook.c): before
 *    local_sgd_start steps it allreduces a bucket over the group, as plain
 *    DDP; from then on it reduces over the subgroup (local_sgd=node: the
 *    ranks of this node, PyTorch's default subgroup) or not at all
 *    (local_sgd=none), and the gradient becomes the mean over the subgroup's
 *    rows rather than the group's;
 *  - the averager: after optimizer step t (0-based, the optimizer's count,
 *    so a resumed run averages at the same steps), when t >= average_warmup
 *    and (t - average_warmup) % average_period == 0, every trainable
 *    parameter becomes its mean over the group (each divided by the group
 *    size, then summed, as PyTorch's average_parameters).  Optimizer state
 *    stays each rank's own, as PyTorch's.
 *
 * Both count steps with the optimizer's step count rather than counters of
 * their own: PostLocalSGDState.iter counts synchronised backwards, one per
 * step, and the averager's step one per optimizer step, so they agree with
 * it in a plain loop, and a checkpoint (which saves the step) resumes both.
 */
#include <string.h>

#include "internal.h"

const ct__opt_def ct__local_sgd_opt_defs[CT__LOCAL_SGD_NOPTS] = {
    {"local_sgd", CT__OPT_CHOICE, offsetof(ct__ddp_opts, local_sgd), "off",
     "post-local SGD: after local_sgd_start steps reduce gradients over none (each rank alone) or node "
     "(the ranks of this node), and average parameters every average_period steps (off: plain DDP)",
     0, "off|none|node"},
    {"local_sgd_start", CT__OPT_COUNT, offsetof(ct__ddp_opts, local_sgd_start), "100",
     "post-local SGD: steps of plain DDP first (PostLocalSGDState's start_localSGD_iter)", 0, NULL},
    {"average_period", CT__OPT_INT, offsetof(ct__ddp_opts, average_period), "4",
     "post-local SGD: average parameters over the group every this many steps (PeriodicModelAverager's period)",
     0, NULL},
    {"average_warmup", CT__OPT_AUTO_COUNT, offsetof(ct__ddp_opts, average_warmup), "auto",
     "post-local SGD: the first step that may average (warmup_steps; auto: local_sgd_start)", 0, NULL},
};

int ct__local_sgd_key(const char *key)
{
    for (int i = 0; i < CT__LOCAL_SGD_NOPTS; i++)
        if (!strcmp(ct__local_sgd_opt_defs[i].key, key)) return 1;
    return 0;
}

/* ---- the hook ------------------------------------------------------------ */

typedef struct {
    const ct_strategy *s; /* whose optimizer counts the steps */
    int mode;             /* CT__LOCAL_SGD_NONE or CT__LOCAL_SGD_NODE */
    int64_t start;
    ct_group *sub;        /* node: this node's ranks of the group */
} local_hook;

static int local_now(const local_hook *h) { return !h->s->opt || ct_optim_get_step(h->s->opt) >= h->start; }

static ct_status local_start(void *state, ct_group *g, const ct_comm_bucket *b, ct_work **work)
{
    local_hook *h = state;
    if (!local_now(h)) return ct_group_allreduce(g, b->grad, b->numel, CT_F32, CT_OP_SUM, work);
    if (h->mode == CT__LOCAL_SGD_NONE) return CT_OK; /* nothing to send: the gradient stays this rank's */
    return ct_group_allreduce(h->sub, b->grad, b->numel, CT_F32, CT_OP_SUM, work);
}

/* The bucket arrived scaled by 1/size(g) (DDP folds the group's mean into
 * the loss gradient); local SGD's mean is over the subgroup (PyTorch's
 * hook divides by the subgroup's size, and by nothing without one). */
static ct_status local_finish(void *state, ct_group *g, const ct_comm_bucket *b)
{
    local_hook *h = state;
    if (!local_now(h)) return CT_OK;
    int sub = h->mode == CT__LOCAL_SGD_NONE ? 1 : ct_group_size(h->sub);
    float k = (float)ct_group_size(g) / (float)sub;
    if (k != 1.0f)
        for (int64_t i = 0; i < b->numel; i++) b->grad[i] *= k;
    return CT_OK;
}

static void local_destroy(void *state)
{
    local_hook *h = state;
    if (!h) return;
    ct_group_destroy(h->sub);
    ct_free(h);
}

static const ct_comm_hook_ops local_ops = {"post_local_sgd", local_start, local_finish, local_destroy};

ct_status ct__local_sgd_hook(ct_strategy *s, const ct__ddp_opts *o, const ct_comm_hook_ops **ops, void **state)
{
    if (o->powersgd_rank > 0)
        return ct_error(CT_EINVAL, "%s: local_sgd=%s with powersgd_rank: both are ways to reduce the gradient "
                        "buckets (PyTorch's post_localSGD_hook and powerSGD_hook); choose one", s->ops->kind,
                        o->local_sgd == CT__LOCAL_SGD_NODE ? "node" : "none");
    if (s->common.reduce_dtype != CT_F32)
        return ct_error(CT_EINVAL, "%s: local_sgd with reduce_dtype=%s: post-local SGD reduces in f32 (as PyTorch's "
                        "post_localSGD_hook); drop --grad-compress or local SGD", s->ops->kind,
                        ct_dtype_name((ct_dtype)s->common.reduce_dtype));
    local_hook *h = ct_alloc_zeroed(sizeof *h, CT_MEM_OTHER);
    if (!h) return CT_ENOMEM;
    h->s = s;
    h->mode = o->local_sgd;
    h->start = o->local_sgd_start;
    if (h->mode == CT__LOCAL_SGD_NODE) {
        ct_status st = ct_group_split(s->g, ct_group_node(s->g), ct_group_rank(s->g), &h->sub);
        if (st != CT_OK) {
            ct_free(h);
            return st;
        }
    }
    *ops = &local_ops;
    *state = h;
    return CT_OK;
}

/* ---- the averager -------------------------------------------------------- */

int ct__local_sgd_averages(const ct__ddp_opts *o, int64_t t)
{
    if (o->local_sgd == CT__LOCAL_SGD_OFF) return 0;
    int64_t warmup = o->average_warmup < 0 ? o->local_sgd_start : o->average_warmup;
    return t >= warmup && (t - warmup) % o->average_period == 0;
}

ct_status ct__local_sgd_average(ct_strategy *s, const ct__ddp_opts *o)
{
    if (!ct__local_sgd_averages(o, ct_optim_get_step(s->opt) - 1)) return CT_OK;
    int size = ct_group_size(s->g);
    if (size == 1) return CT_OK;
    double t0 = ct_now();
    float inv = 1.0f / (float)size;
    for (int i = 0; i < s->nparams; i++) {
        ct_param *p = s->params[i];
        if (!p->requires_grad) continue; /* frozen: the same on every rank since the wrap's broadcast */
        float *x = ct_f32(p->data);
        for (int64_t j = 0; j < p->data->numel; j++) x[j] *= inv;
        CT_TRY(ct_group_allreduce(s->g, x, p->data->numel, CT_F32, CT_OP_SUM, NULL));
    }
    double t1 = ct_now();
    ct_trace_event("average parameters", "comm", t0, t1, 0);
    /* blocking communication, not the optimizer's time (step_impl times the whole step entry) */
    s->stats.comm_total += t1 - t0;
    s->stats.comm_wait += t1 - t0;
    s->stats.optimizer -= t1 - t0;
    return CT_OK;
}

/*
 * The pipeline's checkpoint state.  Each stage's state comes from its
 * replica strategy (whatever that shards), and the full state dict is
 * assembled on rank 0 from the first replica's stages, in stage order, with
 * the model's own names: a pipelined run saves the file any strategy, any
 * stage count or PyTorch loads (a parameter tied across stages once, from
 * the first stage holding it).  Loading takes the full set on every rank
 * and gives each stage the tensors of its layers, so every copy of a tied
 * parameter gets the one saved tensor.
 */
#include <stdio.h>
#include <string.h>

#include "pipe.h"

#define TAG_STATE 32766 /* above any micro-batch tag (chunks <= 16000), within MPI's smallest tag bound */

/* One tensor of a stage's state on its way to rank 0: a header (more,
 * dtype, ndim, name length, shape), the name, then, unless shapes only,
 * rank 0's answer (1: send it; 0: it could not take it) and the values. */
enum { H_MORE, H_DTYPE, H_NDIM, H_NAMELEN, H_SHAPE, H_N = H_SHAPE + CT_MAX_DIMS };

typedef struct {
    ct_strategy *s;
    int optim, shapes_only;
    ct_state_fn fn;
    void *ud;
    ct_status fn_st; /* rank 0: fn's first failure; fn is not called after it */
} each_ctx;

/* Rank 0: fn on one tensor, until it fails once. */
static void emit(each_ctx *c, const char *name, ct_tensor *t)
{
    if (c->fn_st == CT_OK) c->fn_st = c->fn(c->ud, name, t);
}

/* The inner strategy's callback on this stage: rank 0 (stage 0) hands the
 * tensor to fn, the first replica of another stage sends it to rank 0;
 * "step" is stage 0's, a tied parameter its first holding stage's. */
static ct_status each_cb(void *ud, const char *name, ct_tensor *t)
{
    each_ctx *c = ud;
    pipe_t *p = ct__pipe(c->s);
    ct_group *g = c->s->g;
    if ((p->stage != 0 && !strcmp(name, "step")) || ct__pipe_tie_is_copy(p, name, c->optim)) return CT_OK;
    if (ct_group_rank(g) == 0) {
        emit(c, name, t);
        return c->fn_st;
    }
    if (p->replica != 0) return CT_OK;
    int64_t h[H_N] = {1, t->dtype, t->ndim, (int64_t)strlen(name) + 1}, ok = 0;
    for (int d = 0; d < CT_MAX_DIMS; d++) h[H_SHAPE + d] = d < t->ndim ? t->shape[d] : 0;
    CT_TRY(ct_group_send(g, h, H_N, CT_I64, 0, TAG_STATE, NULL));
    CT_TRY(ct_group_send(g, name, h[H_NAMELEN], CT_U8, 0, TAG_STATE, NULL));
    if (c->shapes_only) return CT_OK;
    CT_TRY(ct_group_recv(g, &ok, 1, CT_I64, 0, TAG_STATE, NULL));
    return ok && t->numel ? ct_group_send(g, ct_tensor_data(t), t->numel, t->dtype, 0, TAG_STATE, NULL) : CT_OK;
}

/* Rank 0: stage k's tensors as they come, until its end marker. */
static ct_status recv_stage(each_ctx *c, int k)
{
    ct_group *g = c->s->g;
    char name[1024];
    for (;;) {
        int64_t h[H_N];
        CT_TRY(ct_group_recv(g, h, H_N, CT_I64, k, TAG_STATE, NULL));
        if (!h[H_MORE]) return CT_OK;
        if (h[H_NAMELEN] < 1 || h[H_NAMELEN] > (int64_t)sizeof name || h[H_NDIM] < 0 || h[H_NDIM] > CT_MAX_DIMS)
            return ct_error(CT_ECOMM, "pipe state: stage %d sent a malformed tensor header", k);
        CT_TRY(ct_group_recv(g, name, h[H_NAMELEN], CT_U8, k, TAG_STATE, NULL));
        name[h[H_NAMELEN] - 1] = 0;
        ct_dtype dt = (ct_dtype)h[H_DTYPE];
        int nd = (int)h[H_NDIM];
        ct_tensor *t = c->shapes_only ? ct_tensor_wrap(dt, nd, h + H_SHAPE, NULL)
                     : c->fn_st == CT_OK ? ct_tensor_empty(dt, nd, h + H_SHAPE, CT_MEM_COMM) : NULL;
        if (!t && c->fn_st == CT_OK) c->fn_st = CT_ENOMEM;
        if (!c->shapes_only) {
            int64_t ok = t != NULL;
            ct_status st = ct_group_send(g, &ok, 1, CT_I64, k, TAG_STATE, NULL);
            if (st == CT_OK && ok && t->numel) st = ct_group_recv(g, ct_tensor_data(t), t->numel, dt, k, TAG_STATE, NULL);
            if (st != CT_OK) {
                ct_tensor_release(t);
                return st;
            }
        }
        if (t) emit(c, name, t);
        ct_tensor_release(t);
    }
}

/* ct_strategy_state_foreach: each stage's state through its replicas'
 * strategy, stage by stage in order, on rank 0 one tensor at a time (the
 * first replica's stages send theirs as their strategy hands them over), so
 * no rank holds more than its stage and one tensor: the file any strategy,
 * any stage count or PyTorch loads. */
ct_status ct__pipe_each(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud)
{
    pipe_t *p = ct__pipe(s);
    each_ctx c = {s, optim, shapes_only, fn, ud, CT_OK};
    int rank = ct_group_rank(s->g);
    ct_status st = CT_OK;
    if (p->stage >= 0) {
        st = ct_strategy_state_foreach(p->inner, optim, shapes_only, each_cb, &c);
        if (c.fn_st != CT_OK) st = CT_OK; /* fn failed (returned below): rank 0 drains the other stages all the same */
    }
    if (rank != 0 && p->replica == 0 && p->stage > 0) {
        int64_t end[H_N] = {0};
        ct_status e = ct_group_send(s->g, end, H_N, CT_I64, 0, TAG_STATE, NULL);
        if (st == CT_OK) st = e;
    }
    for (int k = 1; rank == 0 && st == CT_OK && k < p->nstages; k++) st = recv_stage(&c, k);
    if (st == CT_OK) st = c.fn_st;
    return ct_group_check(s->g, st);
}

static ct_status gather(ct_strategy *s, int optim, ct_state *out)
{
    ct_status st = ct__pipe_each(s, optim, 0, ct__state_collect, out);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

ct_status ct__pipe_model_state(ct_strategy *s, ct_state *out) { return gather(s, 0, out); }
ct_status ct__pipe_optim_state(ct_strategy *s, ct_state *out) { return gather(s, 1, out); }

/* Each stage's share over its replicas (every tensor once; local: the
 * pieces as they lie, ct_strategy_local_state), "step" once, a tied
 * parameter from its first holding stage only. */
static ct_status stage_share(ct_strategy *s, int optim, int local, ct_state *out)
{
    pipe_t *p = ct__pipe(s);
    ct_state share = {0};
    ct_status st = CT_OK;
    memset(out, 0, sizeof *out);
    if (p->stage >= 0)
        st = local ? ct_strategy_local_state(p->inner, optim, &share) : ct_strategy_shard_state(p->inner, optim, &share);
    for (int i = 0; st == CT_OK && i < share.n; i++)
        if ((p->stage == 0 || strcmp(share.names[i], "step")) && !ct__pipe_tie_is_copy(p, share.names[i], optim))
            st = ct_state_add(out, share.names[i], share.tensors[i]);
    ct_state_fini(&share);
    if (st != CT_OK) ct_state_fini(out);
    return st;
}

ct_status ct__pipe_shard_state(ct_strategy *s, int optim, ct_state *out) { return stage_share(s, optim, 0, out); }
ct_status ct__pipe_local_state(ct_strategy *s, int optim, ct_state *out) { return stage_share(s, optim, 1, out); }

static int known(const pipe_t *p, const char *name, size_t len)
{
    for (int i = 0; i < p->nnames; i++)
        if (strlen(p->names[i]) == len && !strncmp(p->names[i], name, len)) return 1;
    return 0;
}

ct_status ct__pipe_load_state(ct_strategy *s, const char *const *names, ct_tensor *const *ts, int n, int optim)
{
    pipe_t *p = ct__pipe(s);
    const char **mine = ct_alloc(sizeof *mine * (size_t)(n + 1), CT_MEM_OTHER);
    ct_tensor **mt = ct_alloc(sizeof *mt * (size_t)(n + 1), CT_MEM_OTHER);
    ct_status st = mine && mt ? CT_OK : CT_ENOMEM;
    int nm = 0;
    for (int i = 0; st == CT_OK && i < n; i++) {
        const char *name = names[i], *at = strchr(name, '@'), *dot = NULL;
        int step = optim && !strcmp(name, "step");
        /* a local piece "<tensor>@<offset>" of another stage's tensor is that tensor's (this stage's pieces
         * came assembled); optimizer state is "<param>.<slot>": the parameter decides the stage */
        size_t whole = at ? (size_t)(at - name) : strlen(name);
        for (size_t c = 0; c < whole; c++)
            if (name[c] == '.') dot = name + c;
        size_t len = optim && !step ? (dot ? (size_t)(dot - name) : 0) : whole;
        if (!step && !known(p, name, len)) {
            st = ct_error(CT_EINVAL, "checkpoint tensor '%s' is not %s of the model; load a checkpoint of this model",
                          name, optim ? "optimizer state of a parameter" : "a parameter or buffer");
            break;
        }
        char pname[512];
        snprintf(pname, sizeof pname, "%.*s", (int)len, name);
        if (step || (!at && p->stage >= 0 && ct_module_find(s->model, pname))) {
            mine[nm] = name;
            mt[nm++] = ts[i];
        }
    }
    /* the stage's strategy reads through this load (its source, the pieces stitched here) */
    if (st == CT_OK) st = ct__strategy_load(p->inner, mine, mt, nm, optim, NULL, s->load);
    if (st == CT_OK && !optim && !p->inner->ops->manages_compute) st = ct__mixed_refresh(p->inner);
    ct_free(mine);
    ct_free(mt);
    return st;
}

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

/* Sends st's names, dtypes, shapes and values to rank peer of g. */
static ct_status send_state(ct_group *g, int peer, const ct_state *st)
{
    int64_t head[2] = {st->n, 0};
    for (int i = 0; i < st->n; i++) head[1] += (int64_t)strlen(st->names[i]) + 1;
    char *names = ct_alloc((size_t)head[1] + 1, CT_MEM_COMM);
    int64_t *meta = ct_alloc(sizeof *meta * (size_t)(st->n * (2 + CT_MAX_DIMS) + 1), CT_MEM_COMM);
    ct_status s = names && meta ? CT_OK : CT_ENOMEM;
    for (int i = 0, off = 0; s == CT_OK && i < st->n; i++) {
        size_t len = strlen(st->names[i]) + 1;
        memcpy(names + off, st->names[i], len);
        off += (int)len;
        const ct_tensor *t = st->tensors[i];
        int64_t *mi = meta + (size_t)i * (2 + CT_MAX_DIMS);
        mi[0] = t->dtype;
        mi[1] = t->ndim;
        for (int d = 0; d < CT_MAX_DIMS; d++) mi[2 + d] = d < t->ndim ? t->shape[d] : 0;
    }
    if (s == CT_OK) s = ct_group_send(g, head, 2, CT_I64, peer, TAG_STATE, NULL);
    if (s == CT_OK && st->n) s = ct_group_send(g, names, head[1], CT_U8, peer, TAG_STATE, NULL);
    if (s == CT_OK && st->n) s = ct_group_send(g, meta, st->n * (2 + CT_MAX_DIMS), CT_I64, peer, TAG_STATE, NULL);
    for (int i = 0; s == CT_OK && i < st->n; i++)
        if (st->tensors[i]->numel)
            s = ct_group_send(g, ct_tensor_data(st->tensors[i]), st->tensors[i]->numel, st->tensors[i]->dtype, peer,
                              TAG_STATE, NULL);
    ct_free(names);
    ct_free(meta);
    return s;
}

static int has_name(const ct_state *st, const char *name)
{
    for (int i = 0; i < st->n; i++)
        if (!strcmp(st->names[i], name)) return 1;
    return 0;
}

/* Receives what send_state sent from peer, appending to out the names out
 * does not have yet: "step" is stage 0's, a tied parameter (and its state)
 * the first holding stage's. */
static ct_status recv_state(ct_group *g, int peer, ct_state *out)
{
    int64_t head[2];
    CT_TRY(ct_group_recv(g, head, 2, CT_I64, peer, TAG_STATE, NULL));
    if (!head[0]) return CT_OK;
    char *names = ct_alloc((size_t)head[1] + 1, CT_MEM_COMM);
    int64_t *meta = ct_alloc(sizeof *meta * (size_t)(head[0] * (2 + CT_MAX_DIMS)), CT_MEM_COMM);
    ct_status s = names && meta ? CT_OK : CT_ENOMEM;
    if (s == CT_OK) s = ct_group_recv(g, names, head[1], CT_U8, peer, TAG_STATE, NULL);
    if (s == CT_OK) s = ct_group_recv(g, meta, head[0] * (2 + CT_MAX_DIMS), CT_I64, peer, TAG_STATE, NULL);
    const char *name = names;
    for (int64_t i = 0; s == CT_OK && i < head[0]; i++) {
        const int64_t *mi = meta + (size_t)i * (2 + CT_MAX_DIMS);
        int64_t shape[CT_MAX_DIMS];
        for (int d = 0; d < CT_MAX_DIMS; d++) shape[d] = mi[2 + d];
        ct_tensor *t = ct_tensor_empty((ct_dtype)mi[0], (int)mi[1], shape, CT_MEM_COMM);
        if (!t) s = CT_ENOMEM;
        if (s == CT_OK && t->numel) s = ct_group_recv(g, ct_tensor_data(t), t->numel, t->dtype, peer, TAG_STATE, NULL);
        if (s == CT_OK && !has_name(out, name)) s = ct_state_add(out, name, t);
        ct_tensor_release(t);
        name += strlen(name) + 1;
    }
    ct_free(names);
    ct_free(meta);
    return s;
}

/* Stage states of the first replica, gathered on rank 0 in stage order. */
static ct_status gather(ct_strategy *s, int optim, ct_state *out)
{
    pipe_t *p = ct__pipe(s);
    ct_state mine = {0};
    ct_status st = CT_OK;
    if (p->stage >= 0) st = optim ? ct_strategy_optim_state(p->inner, &mine) : ct_strategy_model_state(p->inner, &mine);
    /* Every rank takes part in the agreement, so a failure anywhere is everyone's. */
    st = ct_group_check(s->g, st);
    if (st != CT_OK) {
        ct_state_fini(&mine);
        return st;
    }
    int rank = ct_group_rank(s->g);
    if (rank == 0) {
        *out = mine;
        for (int k = 1; st == CT_OK && k < p->nstages; k++) st = recv_state(s->g, k, out);
    } else {
        if (p->replica == 0 && p->stage > 0) st = send_state(s->g, 0, &mine);
        ct_state_fini(&mine);
    }
    return ct_group_check(s->g, st);
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

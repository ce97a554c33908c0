/*
 * Skip connections across stage boundaries (torchgpipe's skip tracker in
 * its simplest form): a skip whose stash is in stage a and whose last pop
 * is in stage b > a travels with the activations of every boundary between
 * them, in the same message (pipe_sched.c), and its gradient comes back
 * the same way.  Stages a+1..b hold a proxy stash of the same name that
 * takes the received value; their pops are bound to it.
 */
#include <stdio.h>
#include <string.h>

#include "nn/skip.h"
#include "pipe.h"

/* The stage of each child of the sequential. */
static int *stages_of(const int *balance, int nstages, int nkids)
{
    int *st = ct_alloc(sizeof *st * (size_t)(nkids + 1), CT_MEM_OTHER);
    if (!st) return NULL;
    for (int k = 0, i = 0; k < nstages; k++)
        for (int j = 0; j < balance[k] && i < nkids; j++) st[i++] = k;
    return st;
}

/* Adds skip name stashed in child j to *skips (*n of them) when it crosses
 * a boundary: its last pop's stage, errors for a pop in an earlier stage or
 * a second stash of the name. */
static ct_status add_skip(pipe_skip **skips, int *nskips, ct_module *m, const int *stage_of, int j, const char *name)
{
    int a = stage_of[j], b = a, nstash = 0;
    ct_status st = CT_OK;
    for (int i = 0; i < m->nkids && st == CT_OK; i++) {
        ct_module **ms = NULL;
        int n = 0;
        if ((st = ct_module_modules(m->kids[i], &ms, &n)) != CT_OK) break;
        for (int q = 0; q < n && st == CT_OK; q++) {
            const char *sn;
            int kind = ct_skip_info(ms[q], &sn);
            if (!kind || strcmp(sn, name)) continue;
            if (kind == 1 && ++nstash > 1)
                st = ct_error(CT_EINVAL, "pipe: the model has two stashes named '%s' (in children %d and %d); a "
                              "skip's name must be unique", name, j, i);
            if (kind == 2 && stage_of[i] < a)
                st = ct_error(CT_EINVAL, "pipe: skip '%s' is popped in child %d (stage %d) before its stash in "
                              "child %d (stage %d); a pop must come after its stash", name, i, stage_of[i], j, a);
            if (kind == 2 && stage_of[i] > b) b = stage_of[i];
        }
        ct_free(ms);
    }
    if (st != CT_OK || b == a) return st;
    pipe_skip *ns = ct_alloc(sizeof *ns * (size_t)(*nskips + 1), CT_MEM_OTHER);
    if (!ns) return CT_ENOMEM;
    if (*nskips) memcpy(ns, *skips, sizeof *ns * (size_t)*nskips);
    ct_free(*skips);
    *skips = ns;
    pipe_skip *sk = &ns[(*nskips)++];
    memset(sk, 0, sizeof *sk);
    snprintf(sk->name, sizeof sk->name, "%s", name);
    sk->a = a;
    sk->b = b;
    return CT_OK;
}

/* This stage's stash of sk: the model's own, or a new proxy its pops take from. */
static ct_status give_stash(ct_strategy *s, pipe_t *p, pipe_skip *sk)
{
    int k = p->stage;
    ct_module *m = s->model;
    if (k == sk->a) {
        for (int i = p->lo; i < p->hi && !sk->stash; i++) sk->stash = ct__skip_find_stash(m->kids[i], sk->name);
        return CT_OK;
    }
    if (!ct__pipe_skip_in(sk, k)) return CT_OK;
    if (!(sk->stash = ct_skip_stash_create(sk->name))) return CT_ENOMEM;
    sk->own = 1;
    for (int i = p->lo; i < p->hi; i++) {
        ct_module **ms = NULL;
        int n = 0;
        CT_TRY(ct_module_modules(m->kids[i], &ms, &n));
        for (int q = 0; q < n; q++) {
            const char *sn;
            if (ct_skip_info(ms[q], &sn) == 2 && !strcmp(sn, sk->name)) ct__skip_bind(ms[q], sk->stash);
        }
        ct_free(ms);
    }
    return CT_OK;
}

ct_status ct__pipe_skips_list(ct_module *m, const int *balance, int nstages, pipe_skip **out, int *nout)
{
    *out = NULL;
    *nout = 0;
    int *stage_of = stages_of(balance, nstages, m->nkids);
    if (!stage_of) return CT_ENOMEM;
    ct_status st = CT_OK;
    for (int j = 0; j < m->nkids && st == CT_OK; j++) {
        ct_module **ms = NULL;
        int n = 0;
        if ((st = ct_module_modules(m->kids[j], &ms, &n)) != CT_OK) break;
        for (int q = 0; q < n && st == CT_OK; q++) {
            const char *name;
            if (ct_skip_info(ms[q], &name) == 1) st = add_skip(out, nout, m, stage_of, j, name);
        }
        ct_free(ms);
    }
    ct_free(stage_of);
    for (int k = 0; k + 1 < nstages && st == CT_OK; k++) {
        int live = 0;
        for (int i = 0; i < *nout; i++) live += ct__pipe_skip_out(&(*out)[i], k);
        if (live > CT_PIPE_MAX_SKIPS)
            st = ct_error(CT_EUNSUPPORTED, "pipe: %d skips cross the boundary after stage %d, more than %d; cut the "
                          "stages elsewhere (balance) or join skips", live, k, CT_PIPE_MAX_SKIPS);
    }
    if (st != CT_OK) {
        ct_free(*out);
        *out = NULL;
        *nout = 0;
    }
    return st;
}

ct_status ct__pipe_skips_init(ct_strategy *s, pipe_t *p)
{
    CT_TRY(ct__pipe_skips_list(s->model, p->balance, p->nstages, &p->skips, &p->nskips));
    ct_status st = CT_OK;
    for (int i = 0; i < p->nskips && st == CT_OK && p->stage >= 0; i++) st = give_stash(s, p, &p->skips[i]);
    return st;
}

void ct__pipe_skips_fini(pipe_t *p)
{
    for (int i = 0; i < p->nskips; i++)
        if (p->skips[i].own) ct_module_destroy(p->skips[i].stash);
    ct_free(p->skips);
    p->skips = NULL;
    p->nskips = 0;
}

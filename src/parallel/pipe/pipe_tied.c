/*
 * Tied parameters across pipeline stages (Megatron's and DeepSpeed's tied
 * embeddings).  A parameter listed by children in several stages (one
 * ct_param shared with ct_module_share_param: the GPT's token embedding in
 * the first stage, its LM head in the last) becomes one copy per holding
 * stage once each rank frees the other stages' children.  Every copy starts
 * equal (the same parameter before the cut, or the same checkpoint), and
 * after a step's backwards each copy's gradient is summed over the ranks of
 * one replica that hold it, so every copy gets the gradient the unsplit
 * model would (the replicas' own average has run by then: the sum of
 * averages is the average of sums) and the same update.  The first holding
 * stage counts the parameter in the gradient norm and saves it; the others'
 * copies are left out, so a pipelined run clips and saves as one process
 * does.
 */
#include <string.h>

#include "pipe.h"

/* Which children's stage: the k with lo_k <= i < lo_k + balance[k]. */
static int stage_of(const pipe_t *p, int child)
{
    for (int k = 0, lo = 0; k < p->nstages; lo += p->balance[k++])
        if (child < lo + p->balance[k]) return k;
    return p->nstages - 1;
}

static int index_of(ct_param **all, int n, const ct_param *q)
{
    for (int i = 0; i < n; i++)
        if (all[i] == q) return i;
    return -1;
}

ct_status ct__pipe_ties_init(ct_strategy *s, pipe_t *p)
{
    ct_module *m = s->model;
    int P = p->nstages, n = s->nparams;
    ct_param **all = s->params; /* the unsplit model's, each once, model order */
    /* in[i * P + k]: parameter i is in a child of stage k */
    unsigned char *in = ct_alloc_zeroed((size_t)(n + 1) * (size_t)P, CT_MEM_OTHER);
    int *set = ct_alloc(sizeof *set * (size_t)(n + 1), CT_MEM_OTHER); /* set of i: first parameter with its row */
    ct_status st = in && set ? CT_OK : CT_ENOMEM;
    for (int c = 0; st == CT_OK && c < m->nkids; c++) {
        ct_param **kp;
        int nk;
        st = ct_module_params(m->kids[c], &kp, &nk);
        for (int j = 0; st == CT_OK && j < nk; j++) {
            int i = index_of(all, n, kp[j]);
            if (i >= 0) in[(size_t)i * (size_t)P + (size_t)stage_of(p, c)] = 1;
        }
        if (st == CT_OK) ct_free(kp);
    }
    int nsets = 0;
    for (int i = 0; st == CT_OK && i < n; i++) {
        const unsigned char *row = in + (size_t)i * (size_t)P;
        int holders = 0;
        for (int k = 0; k < P; k++) holders += row[k];
        set[i] = -1;
        if (holders < 2) continue;
        for (int j = 0; j < i && set[i] < 0; j++)
            if (set[j] == j && !memcmp(row, in + (size_t)j * (size_t)P, (size_t)P)) set[i] = j;
        if (set[i] < 0) {
            set[i] = i;
            nsets++;
        }
    }
    if (st == CT_OK && nsets && !(p->ties = ct_alloc_zeroed(sizeof *p->ties * (size_t)nsets, CT_MEM_OTHER)))
        st = CT_ENOMEM;
    /* One group per set, split in model order by every rank (the model is
     * the same everywhere, so the splits match; a rank that failed so far
     * must not leave the others in a split). */
    st = ct_group_check(s->g, st);
    for (int i = 0; st == CT_OK && i < n; i++) {
        if (set[i] != i) continue;
        const unsigned char *row = in + (size_t)i * (size_t)P;
        int holds = p->stage >= 0 && row[p->stage], first = 0;
        while (!row[first]) first++;
        pipe_tie *t = &p->ties[p->nties++];
        st = ct_group_split(s->g, holds ? p->replica : CT_GROUP_NONE, p->stage, &t->g);
        if (st != CT_OK || !holds) continue;
        t->first = p->stage == first;
        int cnt = 0;
        for (int j = i; j < n; j++) cnt += set[j] == i;
        if (!(t->ps = ct_alloc(sizeof *t->ps * (size_t)cnt, CT_MEM_OTHER))) st = CT_ENOMEM;
        for (int j = i; st == CT_OK && j < n; j++)
            if (set[j] == i) t->ps[t->nps++] = all[j];
    }
    ct_free(in);
    ct_free(set);
    return st;
}

static ct_module *lister(ct_module *m, const ct_param *q)
{
    for (int i = 0; i < m->nparams; i++)
        if (m->params[i] == q) return m;
    for (int i = 0; i < m->nkids; i++) {
        ct_module *f = lister(m->kids[i], q);
        if (f) return f;
    }
    return NULL;
}

void ct__pipe_ties_adopt(ct_strategy *s, pipe_t *p)
{
    for (int t = 0; t < p->nties; t++)
        for (int i = 0; i < p->ties[t].nps; i++) {
            ct_param *q = p->ties[t].ps[i];
            if (!q->owner) q->owner = lister(s->model, q); /* DDP's unused-parameter check asks it */
        }
}

void ct__pipe_ties_fini(pipe_t *p)
{
    for (int t = 0; t < p->nties; t++) {
        ct_group_destroy(p->ties[t].g);
        ct_free(p->ties[t].ps);
    }
    ct_free(p->ties);
    p->ties = NULL;
    p->nties = 0;
}

void ct__pipe_ties_begin(pipe_t *p)
{
    if (!p->ties_summed) return;
    for (int t = 0; t < p->nties; t++)
        for (int i = 0; !p->ties[t].first && i < p->ties[t].nps; i++) {
            ct_param *q = p->ties[t].ps[i];
            ct_param_grad_sync(q);
            if (q->grad) ct_tensor_fill(q->grad, 0.0f);
        }
    p->ties_summed = 0;
}

ct_status ct__pipe_ties_sum(pipe_t *p)
{
    for (int t = 0; t < p->nties; t++)
        for (int i = 0; p->ties[t].g && i < p->ties[t].nps; i++) {
            ct_param *q = p->ties[t].ps[i];
            if (!q->requires_grad || !q->grad) continue;
            ct_param_grad_sync(q);
            ct_status st = ct_group_allreduce_tensor(p->ties[t].g, q->grad, CT_OP_SUM, NULL);
            if (st != CT_OK)
                return ct_error(st, "pipe: summing the gradient of '%s' over the stages that hold it failed: %s",
                                q->name, ct_last_error());
        }
    p->ties_summed = 1;
    return CT_OK;
}

double ct__pipe_ties_uncounted(const ct_strategy *s, const pipe_t *p, double norm_type)
{
    double acc = 0;
    for (int t = 0; t < p->nties; t++)
        for (int i = 0; !p->ties[t].first && i < p->ties[t].nps; i++) {
            ct_param *q = p->ties[t].ps[i];
            ct_norm_acc one = ct_norm_acc_init(norm_type);
            if (q->requires_grad && q->grad && ct__clip_selects(s, q)) ct_norm_acc_tensor(&one, q->grad);
            acc += one.v;
        }
    return acc;
}

int ct__pipe_tie_is_copy(const pipe_t *p, const char *name, int optim)
{
    const char *at = strchr(name, '@'), *dot = NULL;
    size_t len = at ? (size_t)(at - name) : strlen(name);
    for (size_t i = 0; optim && i < len; i++)
        if (name[i] == '.') dot = name + i;
    if (optim) len = dot ? (size_t)(dot - name) : 0;
    for (int t = 0; t < p->nties; t++)
        for (int i = 0; !p->ties[t].first && i < p->ties[t].nps; i++)
            if (strlen(p->ties[t].ps[i]->name) == len && !strncmp(p->ties[t].ps[i]->name, name, len)) return 1;
    return 0;
}

/*
 * Activation planning: one micro-batch through a run of modules replayed on
 * shapes only.  Every tensor of the call is a buffer with a reference
 * count, as ctrain holds it: the chain of outputs through forward, what each
 * record keeps for backward (the modules' act_cost, written next to each
 * layer's forward), the loss gradient, and the input gradients flowing back.
 * The peak of the live bytes, plus the scratch a module holds only while it
 * runs, is the figure.  Containers whose act_cost says walk (sequential,
 * residual) are replayed as their children in sequence: approximate (a
 * residual holds a sum more); a checkpoint wrapper keeps its input and
 * replays its child inside its backward (checkpoint.c).  The loss gradient
 * is held to the end (the caller's), unless handed over (CT_ACT_HANDED).
 */
#include "internal.h"

typedef struct {
    uint64_t bytes;
    int refs;
} sbuf;

typedef struct {
    sbuf *b;
    int n, cap;
    uint64_t alive, peak;
} sim;

static int sim_new(sim *s, uint64_t bytes)
{
    CT_ASSERT(s->n < s->cap);
    s->b[s->n] = (sbuf){bytes, 1};
    s->alive += bytes;
    return s->n++;
}

/* Buffer -1 is the input (the caller's): references to it cost nothing. */
static void sim_ref(sim *s, int i)
{
    if (i >= 0) s->b[i].refs++;
}

static void sim_unref(sim *s, int i)
{
    if (i >= 0 && --s->b[i].refs == 0) s->alive -= s->b[i].bytes;
}

/* A moment of the call: what is alive plus scratch held only now. */
static void sim_peak(sim *s, uint64_t scratch)
{
    if (s->alive + scratch > s->peak) s->peak = s->alive + scratch;
}

static uint64_t f32_bytes(int nd, const int64_t *sh)
{
    uint64_t n = 4;
    for (int i = 0; i < nd; i++) n *= (uint64_t)sh[i];
    return n;
}

uint64_t ct__act_out_numel(ct_module *m, int nd, const int64_t *sh)
{
    int ond;
    int64_t osh[CT_MAX_DIMS];
    return ct_module_out_shape(m, nd, sh, &ond, osh) == CT_OK ? ct__act_numel(ond, osh) : 0;
}

int ct__act_has_copy(const ct_module *m)
{
    return m->nparams && ct_param_takes_bf16_copy(m->params[0]);
}

ct_status ct__act_cost_walk(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)nd, (void)sh, (void)mixed, (void)need_dx;
    c->walk = 1;
    return CT_OK;
}

/* Modules in the tree under m: room for its leaves. */
static int tree_size(const ct_module *m)
{
    int n = 1;
    for (int i = 0; i < m->nkids; i++) n += tree_size(m->kids[i]);
    return n;
}

/* The modules that run, in forward order, walking the containers whose
 * act_cost says so, with each one's input shape (shapes[*n]) and cost:
 * appends m on an input of shapes[*n] and leaves its output's in
 * shapes[*n] after the last appended. */
typedef struct {
    ct_module **lv;
    int64_t (*shapes)[CT_MAX_DIMS];
    int *nds;
    ct_act_cost *cost;
    int n, mixed, dx0;
} walk_t;

static ct_status walk(walk_t *w, ct_module *m)
{
    int i = w->n;
    ct_act_cost *c = &w->cost[i];
    CT_TRY(ct_module_act_cost(m, w->nds[i], w->shapes[i], w->mixed, i > 0 || w->dx0, c));
    if (c->walk) {
        for (int k = 0; k < m->nkids; k++) CT_TRY(walk(w, m->kids[k]));
        return CT_OK;
    }
    w->lv[w->n++] = m;
    return ct_module_out_shape(m, w->nds[i], w->shapes[i], &w->nds[i + 1], w->shapes[i + 1]);
}

ct_status ct_act_plan_run(ct_module *const *mods, int nm, int nd0, const int64_t *sh0, int flags, ct_act_plan *out)
{
    int cap = 0;
    *out = (ct_act_plan){0};
    if (nd0 < 0 || nd0 > CT_MAX_DIMS) return ct_error(CT_EINVAL, "activation plan: an input of %d dims", nd0);
    for (int i = 0; i < nm; i++) cap += tree_size(mods[i]);
    walk_t w = {.mixed = (flags & CT_ACT_MIXED) != 0, .dx0 = (flags & CT_ACT_DX0) != 0};
    w.lv = ct_alloc(sizeof *w.lv * (size_t)(cap + 1), CT_MEM_OTHER);
    w.shapes = ct_alloc(sizeof *w.shapes * (size_t)(cap + 1), CT_MEM_OTHER);
    w.nds = ct_alloc(sizeof *w.nds * (size_t)(cap + 1), CT_MEM_OTHER);
    w.cost = ct_alloc(sizeof *w.cost * (size_t)(cap + 1), CT_MEM_OTHER);
    sim s = {.cap = 4 * cap + 8};
    s.b = ct_alloc(sizeof *s.b * (size_t)s.cap, CT_MEM_OTHER);
    /* what each module's record holds: its input, its output, its saved block (buffer ids, -1 none) */
    int *kin = ct_alloc(sizeof *kin * 3 * (size_t)(cap + 1), CT_MEM_OTHER), *kout = NULL, *ksav = NULL;
    ct_status st = w.lv && w.shapes && w.nds && w.cost && s.b && kin ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) {
        kout = kin + cap;
        ksav = kin + 2 * cap;
    }
    if (st == CT_OK) {
        w.nds[0] = nd0;
        for (int d = 0; d < nd0; d++) w.shapes[0][d] = sh0[d];
    }
    for (int i = 0; st == CT_OK && i < nm; i++) st = walk(&w, mods[i]);
    int n = w.n, whole = (flags & CT_ACT_WHOLE) != 0, dx0 = w.dx0;
    int64_t(*shapes)[CT_MAX_DIMS] = w.shapes;
    int *nds = w.nds;
    const ct_act_cost *rl = w.cost;

    /* Forward: buffer -1 is the input. */
    int x = -1;
    for (int i = 0; st == CT_OK && i < n; i++) {
        const ct_act_cost *r = &rl[i];
        int o = x;
        if (r->alias) sim_ref(&s, x);
        else o = sim_new(&s, f32_bytes(nds[i + 1], shapes[i + 1]));
        ksav[i] = r->saved ? sim_new(&s, r->saved) : -1;
        sim_peak(&s, r->fwd_tmp);
        kin[i] = r->keep_in ? x : -1;
        kout[i] = r->keep_out ? o : -1;
        sim_ref(&s, kin[i]);
        sim_ref(&s, kout[i]);
        sim_unref(&s, x);
        x = o;
    }
    if (st == CT_OK) {
        uint64_t lb = f32_bytes(nds[n], shapes[n]);
        out->in_bytes = f32_bytes(nd0, sh0);
        out->out_bytes = lb;
        out->kept = s.alive - (x >= 0 && s.b[x].refs == 1 ? s.b[x].bytes : 0);
        if (!whole) sim_unref(&s, x); /* sent: the message is a copy (comm) */
        /* The loss gradient (and its scaled copy), or the next stage's gradient. */
        int g = sim_new(&s, lb);
        if (whole && (flags & CT_ACT_SCALED)) g = sim_new(&s, lb);
        if (!(flags & CT_ACT_HANDED)) sim_ref(&s, g); /* the caller's reference, to the end */
        sim_peak(&s, 0);
        /* Backward: each module makes its input gradient (not the first), then its record goes. */
        for (int i = n - 1; i >= 0; i--) {
            const ct_act_cost *r = &rl[i];
            int dx = -1;
            if ((i > 0 || dx0) && r->alias) sim_ref(&s, dx = g);
            else if (i > 0 || dx0) dx = sim_new(&s, f32_bytes(nds[i], shapes[i]));
            sim_peak(&s, r->bwd_tmp);
            sim_unref(&s, kin[i]);
            sim_unref(&s, kout[i]);
            sim_unref(&s, ksav[i]);
            sim_unref(&s, g);
            g = dx;
        }
        out->peak = s.peak;
    }
    ct_free(w.lv);
    ct_free(w.shapes);
    ct_free(w.nds);
    ct_free(w.cost);
    ct_free(s.b);
    ct_free(kin);
    return st;
}

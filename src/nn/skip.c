/*
 * Skip connections between layers of a sequential (torchgpipe's and
 * fairscale's @skippable stash/pop): a stash layer passes its input on and
 * keeps it under a name; a later pop layer of that name adds the kept
 * tensor to its input.  Modules take one tensor in and out, so the kept
 * tensor lives in the stash module, one entry per forward call keyed by the
 * call's first row (ctx.sample0): a pipeline's micro-batches in flight each
 * find their own.  An entry lives until the stash's backward (which adds
 * the pop's gradient to its own), so a recompute (activation checkpointing)
 * finds it again; a later forward of the same rows replaces it.
 */
#include "internal.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    int64_t key;      /* ctx.sample0 of the call */
    ct_tensor *x;     /* the stashed input */
    ct_tensor *g;     /* the pops' gradient for it, NULL before any */
} skip_entry;

typedef struct {
    char name[64];
    int pop;
    skip_entry *e;    /* stash only */
    int ne, cap;
    int ndim;         /* stash: the input shape its last shape inference saw (a pipeline sizes it) */
    int64_t shape[CT_MAX_DIMS];
    ct_module *bound; /* pop: the stash a pipeline stage holds for a stash of another stage */
} skip_t;

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

static void entry_drop(skip_t *s, int i)
{
    ct_tensor_release(s->e[i].x);
    ct_tensor_release(s->e[i].g);
    s->e[i] = s->e[--s->ne];
}

static skip_entry *entry_find(skip_t *s, int64_t key)
{
    for (int i = 0; i < s->ne; i++)
        if (s->e[i].key == key) return &s->e[i];
    return NULL;
}

/* keep_g: the same values again (a recompute): the pops' gradient stays. */
static ct_status entry_put(skip_t *s, int64_t key, ct_tensor *x, int keep_g)
{
    skip_entry *e = entry_find(s, key);
    if (e && keep_g) {
        ct_tensor_release(e->x);
        e->x = ct_tensor_retain(x);
        return CT_OK;
    }
    if (e) entry_drop(s, (int)(e - s->e));
    if (s->ne == s->cap) {
        int cap = s->cap ? 2 * s->cap : 4;
        skip_entry *ne = ct_alloc(sizeof *ne * (size_t)cap, CT_MEM_OTHER);
        if (!ne) return CT_ENOMEM;
        if (s->ne) memcpy(ne, s->e, sizeof *ne * (size_t)s->ne);
        ct_free(s->e);
        s->e = ne;
        s->cap = cap;
    }
    s->e[s->ne++] = (skip_entry){key, ct_tensor_retain(x), NULL};
    return CT_OK;
}

static const ct_module_ops stash_ops, pop_ops;

static ct_module *find_stash(ct_module *m, const char *name)
{
    if (m->ops == &stash_ops && !strcmp(((skip_t *)m->impl)->name, name)) return m;
    for (int i = 0; i < m->nkids; i++) {
        ct_module *f = find_stash(m->kids[i], name);
        if (f) return f;
    }
    return NULL;
}

static ct_status stash_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                               const ct_fwd_ctx *ctx)
{
    (void)rec;
    skip_t *s = m->impl;
    if (in->dtype != CT_F32)
        return ct_error(CT_EINVAL, "skip stash '%s' ('%s'): input must be f32", s->name, nm(m));
    CT_TRY(entry_put(s, ctx->sample0, in, ctx->recompute));
    *out = ct_tensor_retain(in);
    return CT_OK;
}

/* dx = dout + the pops' gradient; the entry goes. */
static ct_status stash_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    skip_t *s = m->impl;
    skip_entry *e = entry_find(s, rec->ctx.sample0);
    ct_tensor *dx = NULL;
    if (din) {
        if (e && e->g) {
            if (!ct_tensor_same_shape(e->g, dout))
                return ct_error(CT_EINVAL, "skip stash '%s': output gradient and pop gradient differ in shape",
                                s->name);
            if (!(dx = ct_tensor_create(CT_F32, dout->ndim, dout->shape, CT_MEM_ACT))) return CT_ENOMEM;
            const float *a = ct_f32(dout), *b = ct_f32(e->g);
            float *y = ct_f32(dx);
            for (int64_t i = 0; i < dx->numel; i++) y[i] = a[i] + b[i];
        } else
            dx = ct_tensor_retain(dout);
        *din = dx;
    }
    if (e) entry_drop(s, (int)(e - s->e));
    return CT_OK;
}

static ct_status pop_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                             const ct_fwd_ctx *ctx)
{
    (void)rec;
    skip_t *p = m->impl;
    ct_module *root = m;
    while (root->parent) root = root->parent;
    ct_module *sm = find_stash(root, p->name);
    if (!sm) sm = p->bound;
    if (!sm)
        return ct_error(CT_EINVAL, "skip pop '%s' ('%s'): the model has no stash named '%s'; put "
                        "ct_skip_stash_create(\"%s\") before it", p->name, nm(m), p->name, p->name);
    skip_entry *e = entry_find(sm->impl, ctx->sample0);
    if (!e)
        return ct_error(CT_EINVAL, "skip pop '%s' ('%s'): stash '%s' ('%s') has not run for these rows; the "
                        "stash must come before the pop in the forward order", p->name, nm(m), p->name, nm(sm));
    if (in->dtype != CT_F32 || !ct_tensor_same_shape(in, e->x)) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "skip pop '%s' ('%s'): input %s and stashed %s must be f32 of one shape",
                        p->name, nm(m), ct_shape_str(in, a, sizeof a), ct_shape_str(e->x, b, sizeof b));
    }
    ct_tensor *y = ct_tensor_create(CT_F32, in->ndim, in->shape, CT_MEM_ACT);
    if (!y) return CT_ENOMEM;
    const float *a = ct_f32(in), *b = ct_f32(e->x);
    float *o = ct_f32(y);
    for (int64_t i = 0; i < y->numel; i++) o[i] = a[i] + b[i];
    *out = y;
    return CT_OK;
}

/* The stash's entry gets dout (summed over pops of one name); dx = dout. */
static ct_status pop_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    skip_t *p = m->impl;
    ct_module *root = m;
    while (root->parent) root = root->parent;
    ct_module *sm = find_stash(root, p->name);
    if (!sm) sm = p->bound;
    skip_entry *e = sm ? entry_find(sm->impl, rec->ctx.sample0) : NULL;
    if (!e)
        return ct_error(CT_ESTATE, "skip pop '%s' ('%s'): its stash's entry went before the pop's backward "
                        "(backward in forward order?)", p->name, nm(m));
    if (!e->g) {
        if (!(e->g = ct_tensor_clone(dout, CT_MEM_ACT))) return CT_ENOMEM;
    } else {
        float *g = ct_f32(e->g);
        const float *d = ct_f32(dout);
        for (int64_t i = 0; i < dout->numel; i++) g[i] += d[i];
    }
    if (din) *din = ct_tensor_retain(dout);
    return CT_OK;
}

static void skip_destroy(ct_module *m)
{
    skip_t *s = m->impl;
    while (s->ne) entry_drop(s, s->ne - 1);
    ct_free(s->e);
    ct_free(s);
}

/* The stash keeps its input (the entry) and aliases it; the pop makes a sum. */
static ct_status stash_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)nd, (void)sh, (void)mixed, (void)need_dx;
    c->keep_in = 1;
    c->alias = 1;
    return CT_OK;
}

static ct_status pop_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)nd, (void)sh, (void)mixed, (void)need_dx;
    (void)c;
    return CT_OK;
}

/* Same shape; notes it for a pipeline that sends the stash between stages. */
static ct_status stash_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                 int64_t *out_shape)
{
    skip_t *s = m->impl;
    s->ndim = ndim;
    for (int d = 0; d < ndim; d++) s->shape[d] = in_shape[d];
    return ct_module_out_shape_same(m, ndim, in_shape, out_ndim, out_shape);
}

static const ct_module_ops stash_ops = {"skip_stash", stash_forward, stash_backward, skip_destroy, 0,
                                        stash_out_shape, stash_cost, 0};
static const ct_module_ops pop_ops = {"skip_pop", pop_forward, pop_backward, skip_destroy, 0,
                                      ct_module_out_shape_same, pop_cost, 0};

static ct_module *skip_create(const char *name, int pop)
{
    if (!name || !*name || strlen(name) >= sizeof ((skip_t *)0)->name) {
        ct_error(CT_EINVAL, "skip %s: name must be 1 to 63 characters", pop ? "pop" : "stash");
        return NULL;
    }
    skip_t *s = ct_alloc_zeroed(sizeof *s, CT_MEM_OTHER);
    if (!s) return NULL;
    snprintf(s->name, sizeof s->name, "%s", name);
    s->pop = pop;
    ct_module *m = ct_module_create(pop ? &pop_ops : &stash_ops, s);
    if (!m) ct_free(s);
    return m;
}

ct_module *ct_skip_stash_create(const char *name) { return skip_create(name, 0); }
ct_module *ct_skip_pop_create(const char *name) { return skip_create(name, 1); }

int ct_skip_info(const ct_module *m, const char **name)
{
    if (!m || (m->ops != &stash_ops && m->ops != &pop_ops)) return 0;
    if (name) *name = ((skip_t *)m->impl)->name;
    return m->ops == &pop_ops ? 2 : 1;
}

/* ---- for a pipeline (nn/skip.h) ---------------------------------------- */

ct_module *ct__skip_find_stash(ct_module *root, const char *name) { return find_stash(root, name); }

void ct__skip_bind(ct_module *pop, ct_module *stash)
{
    if (ct_skip_info(pop, NULL) == 2) ((skip_t *)pop->impl)->bound = stash;
}

int ct__skip_shape(const ct_module *stash, int64_t *shape)
{
    const skip_t *s = stash->impl;
    for (int d = 0; d < s->ndim; d++) shape[d] = s->shape[d];
    return s->ndim;
}

ct_status ct__skip_put(ct_module *stash, int64_t key, ct_tensor *x) { return entry_put(stash->impl, key, x, 0); }

ct_tensor *ct__skip_value(ct_module *stash, int64_t key, int grad)
{
    skip_entry *e = entry_find(stash->impl, key);
    return e ? (grad ? e->g : e->x) : NULL;
}

ct_status ct__skip_set_grad(ct_module *stash, int64_t key, ct_tensor *g)
{
    skip_entry *e = entry_find(stash->impl, key);
    if (!e) return ct_error(CT_ESTATE, "skip '%s': no stashed value for rows from %lld to take a gradient",
                            ((skip_t *)stash->impl)->name, (long long)key);
    ct_tensor_release(e->g);
    e->g = ct_tensor_retain(g);
    return CT_OK;
}

void ct__skip_drop(ct_module *stash, int64_t key)
{
    skip_t *s = stash->impl;
    skip_entry *e = entry_find(s, key);
    if (e) entry_drop(s, (int)(e - s->e));
}

void ct__skip_clear(ct_module *stash)
{
    skip_t *s = stash->impl;
    while (s->ne) entry_drop(s, s->ne - 1);
}

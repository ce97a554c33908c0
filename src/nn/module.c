/*
 * The module tree: building it (children, parameters, buffers, names),
 * walking it, hooks, activation records, and the forward/backward wrappers
 * that every call goes through so hooks fire in one documented order:
 *   forward:  pre-forward(m), m's forward (children in turn), post-forward(m)
 *   backward: pre-backward(m), m's backward (children in reverse),
 *             grad-ready of m's own parameters, post-backward(m)
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"

struct ct_hook {
    ct_hook_kind kind;
    ct_module_hook_fn mfn;
    ct_param_hook_fn pfn;
    void *ud;
    ct_hook *next;
    ct_hook **head; /* list this hook is on, for removal */
};

static char *dupstr(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = ct_alloc_zeroed(n, CT_MEM_OTHER);
    if (d) memcpy(d, s, n);
    return d;
}

/* ---- records ----------------------------------------------------------- */

ct_record *ct_record_create(ct_module *m, const ct_fwd_ctx *ctx)
{
    ct_record *r = ct_alloc_zeroed(sizeof *r, CT_MEM_OTHER);
    if (!r) return NULL;
    if (!ct__record_live_add(r)) {
        ct_free(r);
        return NULL;
    }
    r->m = m;
    if (ctx) r->ctx = *ctx;
    return r;
}

ct_status ct_record_add_kid(ct_record *rec, ct_record *kid)
{
    ct_record **k = ct_grow(rec->kids, rec->nkids, &rec->kcap, sizeof *k, CT_MEM_OTHER);
    if (!k) return CT_ENOMEM;
    rec->kids = k;
    k[rec->nkids++] = kid;
    return CT_OK;
}

int ct_record_save(ct_record *rec, ct_tensor *t)
{
    CT_ASSERT(rec && t);
    ct_tensor **sv = ct_grow(rec->saved, rec->nsaved, &rec->saved_cap, sizeof *sv, CT_MEM_OTHER);
    if (!sv) return CT_ENOMEM;
    rec->saved = sv;
    sv[rec->nsaved] = ct_tensor_retain(t);
    return rec->nsaved++;
}

ct_tensor *ct_record_saved(const ct_record *rec, int i)
{
    CT_ASSERT(rec && i >= 0 && i < rec->nsaved);
    return rec->saved[i];
}

/* Uses of shared parameters: counted by a forward that keeps a record,
 * given back by its backward or by dropping the record unused. */
static void count_uses(ct_module *m, int delta)
{
    for (int i = 0; i < m->nparams; i++)
        if (m->params[i]->nmodules > 1) m->params[i]->uses_pending += delta;
}

static int has_shared(const ct_module *m)
{
    for (int i = 0; i < m->nparams; i++)
        if (m->params[i]->nmodules > 1) return 1;
    return 0;
}

void ct_record_destroy(ct_record *rec)
{
    if (!rec) return;
    if (!ct__record_live_take(rec)) {
        /* Freed already (a second destroy, or destroy after backward consumed it). */
        ct_log(CT_LOG_ERROR, "ct_record_destroy: this record was already freed (backward consumes its "
                             "record); nothing done");
        return;
    }
    if (rec->shared_uses) count_uses(rec->m, -1);
    for (int i = 0; i < rec->nsaved; i++) ct_tensor_release(rec->saved[i]);
    for (int i = 0; i < rec->nkids; i++) ct_record_destroy(rec->kids[i]);
    ct_free(rec->saved);
    ct_free(rec->kids);
    ct_free(rec->extra);
    ct_free(rec);
}

/* ---- hooks ------------------------------------------------------------- */

static ct_hook *hook_push(ct_hook **head, ct_hook_kind kind, void *ud)
{
    ct_hook *h = ct_alloc_zeroed(sizeof *h, CT_MEM_OTHER);
    if (!h) return NULL;
    h->kind = kind;
    h->ud = ud;
    h->head = head;
    /* Append so hooks of one kind fire in registration order. */
    ct_hook **p = head;
    while (*p) p = &(*p)->next;
    *p = h;
    return h;
}

ct_hook *ct_module_add_hook(ct_module *m, ct_hook_kind kind, ct_module_hook_fn fn, void *ud)
{
    if (!fn || kind == CT_HOOK_GRAD_READY) {
        ct_error(CT_EINVAL, "module hook needs a function and a module hook kind; grad-ready "
                            "hooks go on parameters with ct_param_add_hook");
        return NULL;
    }
    ct_hook *h = hook_push(&m->hooks, kind, ud);
    if (h) h->mfn = fn;
    return h;
}

ct_hook *ct_param_add_hook(ct_param *p, ct_param_hook_fn fn, void *ud)
{
    if (!fn) {
        ct_error(CT_EINVAL, "grad-ready hook on '%s' needs a function", p->name ? p->name : "?");
        return NULL;
    }
    ct_hook *h = hook_push(&p->grad_hooks, CT_HOOK_GRAD_READY, ud);
    if (h) h->pfn = fn;
    return h;
}

void ct_hook_remove(ct_hook *h)
{
    if (!h) return;
    for (ct_hook **p = h->head; *p; p = &(*p)->next) {
        if (*p == h) {
            *p = h->next;
            break;
        }
    }
    ct_free(h);
}

static void hooks_free(ct_hook *h)
{
    while (h) {
        ct_hook *n = h->next;
        ct_free(h);
        h = n;
    }
}

static ct_status fire_module(ct_module *m, ct_hook_kind kind)
{
    for (ct_hook *h = m->hooks, *n; h; h = n) {
        n = h->next; /* a hook may remove itself */
        if (h->kind == kind) CT_TRY(h->mfn(m, kind, h->ud));
    }
    return CT_OK;
}

static ct_status fire_grad_ready(ct_param *p)
{
    for (ct_hook *h = p->grad_hooks, *n; h; h = n) {
        n = h->next;
        CT_TRY(h->pfn(p, h->ud));
    }
    return CT_OK;
}

/* ---- running ----------------------------------------------------------- */

/* ct_module_forward; top: m is the module a recompute runs (ct_module_recompute). */
static ct_status forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record **rec, const ct_fwd_ctx *ctx,
                         int top)
{
    static const ct_fwd_ctx eval_ctx = {.training = 0, .seed = 0, .step = 0};
    if (!ctx) ctx = &eval_ctx;
    *out = NULL;
    if (rec) *rec = NULL;
    /* hooks see whether this call is a recompute (restored after: calls nest) */
    int was = m->recomputing;
    m->recomputing = top ? 2 : ctx->recompute != 0;
    ct_status s = fire_module(m, CT_HOOK_PRE_FORWARD);
    for (int i = 0; s == CT_OK && i < m->nparams; i++) /* after the hooks: a strategy's may have made it */
        if (m->params[i]->shape_only && !ct_tensor_data(m->params[i]->data))
            s = ct_error(CT_ESTATE, "parameter '%s' was built shape-only and has no values yet: wrap the model "
                         "in a strategy (it makes what each rank holds) or call ct_module_materialize",
                         m->params[i]->name);
    ct_record *r = NULL;
    if (s == CT_OK && rec && !(r = ct_record_create(m, ctx))) s = CT_ENOMEM;
    if (s == CT_OK) s = m->ops->forward(m, in, out, r, ctx);
    if (s == CT_OK && !*out)
        s = ct_error(CT_ESTATE, "module '%s' (%s) returned no output", m->fqn, m->ops->kind);
    if (s == CT_OK) s = fire_module(m, CT_HOOK_POST_FORWARD);
    m->recomputing = was;
    if (s != CT_OK) {
        ct_tensor_release(*out);
        *out = NULL;
        ct_record_destroy(r);
        return s;
    }
    if (r && has_shared(m)) {
        count_uses(m, +1);
        r->shared_uses = 1;
    }
    if (rec) *rec = r;
    return CT_OK;
}

ct_status ct_module_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record **rec,
                            const ct_fwd_ctx *ctx)
{
    return forward(m, in, out, rec, ctx, 0);
}

ct_status ct_module_recompute(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record **rec,
                              const ct_fwd_ctx *ctx)
{
    ct_fwd_ctx c = *ctx;
    ct_tensor *y = NULL;
    c.recompute = 1;
    ct_status st = forward(m, in, &y, rec, &c, 1);
    if (out) *out = y;
    else ct_tensor_release(y);
    return st;
}

ct_status ct_module_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    if (din) *din = NULL;
    if (!rec)
        return ct_error(CT_ESTATE, "backward of '%s' (%s) without an activation record: run "
                                   "forward with a record (rec != NULL) first", m->fqn, m->ops->kind);
    if (!ct__record_live(rec))
        return ct_error(CT_ESTATE, "backward of '%s' (%s) on a record that was already consumed: a "
                                   "backward frees its record, so each forward's record serves one "
                                   "backward; run forward again for another", ct__nn_name(m), m->ops->kind);
    if (rec->m != m) {
        ct_record_destroy(rec);
        return ct_error(CT_EINVAL, "record passed to backward of '%s' belongs to another module", m->fqn);
    }
    ct_status s = fire_module(m, CT_HOOK_PRE_BACKWARD);
    if (!m->ops->lazy_grad)
        for (int i = 0; i < m->nparams; i++) ct_param_grad_sync(m->params[i]);
    if (s == CT_OK) s = m->ops->backward(m, dout, din, rec);
    int counted = rec->shared_uses;
    rec->shared_uses = 0;
    ct_record_destroy(rec);
    if (counted) count_uses(m, -1);
    /* A gradient the backward did not write (frozen, skipped) is still zero. */
    for (int i = 0; i < m->nparams; i++) ct_param_grad_sync(m->params[i]);
    for (int i = 0; s == CT_OK && i < m->nparams; i++) {
        ct_param *p = m->params[i];
        /* A shared parameter is complete only after its last use's backward. */
        if (p->requires_grad && !(p->nmodules > 1 && p->uses_pending > 0)) s = fire_grad_ready(p);
    }
    if (s == CT_OK) s = fire_module(m, CT_HOOK_POST_BACKWARD);
    if (s != CT_OK && din) {
        ct_tensor_release(*din);
        *din = NULL;
    }
    return s;
}

/* ---- shapes ------------------------------------------------------------ */

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

ct_status ct_module_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                              int64_t *out_shape)
{
    int64_t in[CT_MAX_DIMS]; /* a copy: out_shape may be in_shape */
    if (ndim < 0 || ndim > CT_MAX_DIMS || (ndim && !in_shape))
        return ct_error(CT_EINVAL, "output shape of '%s': an input of %d dims; a tensor has 0 to %d",
                        nm(m), ndim, CT_MAX_DIMS);
    for (int i = 0; i < ndim; i++) {
        if (in_shape[i] < 0)
            return ct_error(CT_EINVAL, "output shape of '%s': input dim %d is %lld; sizes are >= 0",
                            nm(m), i, (long long)in_shape[i]);
        in[i] = in_shape[i];
    }
    if (!m->ops->out_shape)
        return ct_error(CT_EUNSUPPORTED, "module '%s' (%s) cannot infer its output shape: its "
                        "ct_module_ops has no out_shape; give it one (ct_module_out_shape_same "
                        "if the output has the input's shape)", nm(m), m->ops->kind);
    return m->ops->out_shape(m, ndim, in, out_ndim, out_shape);
}

ct_status ct_module_act_cost(ct_module *m, int ndim, const int64_t *in_shape, int mixed, int need_dx,
                             ct_act_cost *out)
{
    int ond;
    int64_t osh[CT_MAX_DIMS];
    CT_TRY(ct_module_out_shape(m, ndim, in_shape, &ond, osh)); /* checks the shape as forward would */
    *out = (ct_act_cost){0};
    if (!m->ops->act_cost) { /* a custom kind: keeping both is the most a record usually holds */
        out->keep_in = out->keep_out = 1;
        return CT_OK;
    }
    return m->ops->act_cost(m, ndim, in_shape, mixed, need_dx, out);
}

ct_status ct_module_out_shape_same(ct_module *m, int ndim, const int64_t *in_shape,
                                   int *out_ndim, int64_t *out_shape)
{
    (void)m;
    for (int i = 0; i < ndim; i++) out_shape[i] = in_shape[i];
    *out_ndim = ndim;
    return CT_OK;
}

/* ---- building ---------------------------------------------------------- */

int ct_module_is(const ct_module *m, unsigned flags) { return m && m->ops && (m->ops->flags & flags) == flags; }

int ct_param_takes_bf16_copy(const ct_param *p)
{
    return p->requires_grad && p->data->ndim >= 2 && p->data->dtype == CT_F32 && !ct_module_is(p->owner, CT_MOD_KEEP_F32);
}

ct_module *ct_module_create(const ct_module_ops *ops, void *impl)
{
    CT_ASSERT(ops && ops->forward && ops->backward && ops->kind);
    ct_module *m = ct_alloc_zeroed(sizeof *m, CT_MEM_OTHER);
    if (!m) return NULL;
    m->ops = ops;
    m->impl = impl;
    m->name = dupstr("");
    m->fqn = dupstr("");
    if (!m->name || !m->fqn) {
        ct_free(m->name);
        ct_free(m->fqn);
        ct_free(m);
        return NULL;
    }
    m->rng_stream = ct_hash64("", 0);
    return m;
}

static void param_free(ct_param *p)
{
    if (!p) return;
    if (--p->nmodules > 0) return; /* still listed by another module (shared) */
    ct_tensor_release(p->data);
    ct_tensor_release(p->grad);
    hooks_free(p->grad_hooks);
    ct_free(p->name);
    ct_free((void *)p->local);
    ct_free(p);
}

ct_status ct_module_hold(ct_module *root, const char *who)
{
    if (!root) return ct_error(CT_EINVAL, "ct_module_hold: model is NULL");
    if (root->held_by)
        return ct_error(CT_ESTATE, "this model is already wrapped by %s; a model can be wrapped once: "
                                   "destroy that strategy first, or build a second model", root->held_by);
    root->held_by = who;
    return CT_OK;
}

void ct_module_unhold(ct_module *root)
{
    if (root) root->held_by = NULL;
}

static void destroy_tree(ct_module *m);

ct_status ct_module_destroy(ct_module *m)
{
    if (!m) return CT_OK;
    if (m->held_by)
        return ct_error(CT_ESTATE, "ct_module_destroy: the model is wrapped by %s, which uses it until "
                                   "it is destroyed; call ct_strategy_destroy first (nothing was freed)",
                        m->held_by);
    destroy_tree(m);
    return CT_OK;
}

static void destroy_tree(ct_module *m)
{
    if (!m) return;
    for (int i = 0; i < m->nkids; i++) destroy_tree(m->kids[i]);
    for (int i = 0; i < m->nparams; i++) {
        if (m->params[i]->owner == m) m->params[i]->owner = NULL; /* a sharer may outlive m */
        param_free(m->params[i]);
    }
    for (int i = 0; i < m->nbuffers; i++) param_free(m->buffers[i]);
    if (m->ops->destroy) m->ops->destroy(m);
    hooks_free(m->hooks);
    ct_free(m->kids);
    ct_free(m->params);
    ct_free(m->buffers);
    ct_free(m->name);
    ct_free(m->fqn);
    ct_free(m);
}

static char *join(const char *prefix, const char *name)
{
    size_t a = strlen(prefix), b = strlen(name);
    char *s = ct_alloc_zeroed(a + b + 2, CT_MEM_OTHER);
    if (!s) return NULL;
    if (a && b) sprintf(s, "%s.%s", prefix, name);
    else sprintf(s, "%s", a ? prefix : name);
    return s;
}

/* A shared parameter is named by its owner only. */
static ct_status name_params(ct_module *m, ct_param **ps, int n, const char *prefix)
{
    for (int i = 0; i < n; i++) {
        if (ps[i]->owner != m) continue;
        char *fq = join(prefix, ps[i]->local);
        if (!fq) return CT_ENOMEM;
        ct_free(ps[i]->name);
        ps[i]->name = fq;
    }
    return CT_OK;
}

static ct_status name_subtree(ct_module *m, const char *fqn)
{
    char *copy = dupstr(fqn);
    if (!copy) return CT_ENOMEM;
    ct_free(m->fqn); /* may be the string fqn points at (the root's own name) */
    m->fqn = copy;
    fqn = copy;
    m->rng_stream = ct_hash64(fqn, strlen(fqn));
    CT_TRY(name_params(m, m->params, m->nparams, fqn));
    CT_TRY(name_params(m, m->buffers, m->nbuffers, fqn));
    for (int i = 0; i < m->nkids; i++) {
        ct_module *k = m->kids[i];
        if (m->transparent) {
            CT_TRY(name_subtree(k, fqn));
        } else {
            char *kf = join(fqn, k->name);
            if (!kf) return CT_ENOMEM;
            ct_status s = name_subtree(k, kf);
            ct_free(kf);
            CT_TRY(s);
        }
    }
    return CT_OK;
}

ct_status ct_module_name_tree(ct_module *root) { return name_subtree(root, root->fqn); }

static ct_module *root_of(ct_module *m)
{
    while (m->parent) m = m->parent;
    return m;
}

ct_status ct_module_add(ct_module *m, const char *name, ct_module *kid)
{
    char idx[24];
    ct_status st = CT_OK;
    if (!kid) return ct_error(CT_EINVAL, "adding a NULL child to '%s' (did its constructor fail?)", m->fqn);
    /* A child of another tree is not ours to free. */
    if (kid->parent) return ct_error(CT_EINVAL, "module '%s' already has a parent", kid->fqn);
    if (!name) {
        snprintf(idx, sizeof idx, "%d", m->nkids);
        name = idx;
    }
    /* A dotted name ("transformer.h.0") lets a flat sequential carry a nested
     * model's state_dict names; its parts must not be empty. */
    size_t len = strlen(name);
    if (!len || name[0] == '.' || name[len - 1] == '.' || strstr(name, "..")) {
        st = ct_error(CT_EINVAL, "child name '%s' must be non-empty, and each of its dot-separated "
                      "parts too", name);
        goto out_free_kid;
    }
    for (int i = 0; i < m->nkids; i++)
        if (!strcmp(m->kids[i]->name, name)) {
            st = ct_error(CT_EINVAL, "'%s' already has a child named '%s'", m->fqn, name);
            goto out_free_kid;
        }
    char *nm = dupstr(name);
    ct_module **kids = nm ? ct_grow(m->kids, m->nkids, &m->kids_cap, sizeof *kids, CT_MEM_OTHER) : NULL;
    if (!kids) {
        ct_free(nm);
        st = CT_ENOMEM;
        goto out_free_kid;
    }
    m->kids = kids;
    kids[m->nkids++] = kid;
    ct_free(kid->name);
    kid->name = nm;
    kid->parent = m;
    return ct_module_name_tree(root_of(m));
out_free_kid:
    ct_module_destroy(kid);
    return st;
}

ct_module *ct_module_detach(ct_module *parent, int index)
{
    if (index < 0 || index >= parent->nkids) {
        ct_error(CT_EINVAL, "'%s' has %d children, so there is no child %d to detach",
                 nm(parent), parent->nkids, index);
        return NULL;
    }
    ct_module *kid = parent->kids[index];
    memmove(parent->kids + index, parent->kids + index + 1,
            (size_t)(parent->nkids - index - 1) * sizeof *parent->kids);
    parent->nkids--;
    kid->parent = NULL; /* names untouched: its fqn is the prefix of its subtree */
    return kid;
}

static ct_param *new_param(ct_module *m, const char *local, int ndim, const int64_t *shape, int buffer)
{
    ct_param **list = buffer ? m->buffers : m->params;
    int n = buffer ? m->nbuffers : m->nparams;
    for (int i = 0; i < n; i++)
        if (!strcmp(list[i]->local, local)) {
            ct_error(CT_EINVAL, "module '%s' already has '%s'", m->fqn, local);
            return NULL;
        }
    ct_param *p = ct_alloc_zeroed(sizeof *p, CT_MEM_OTHER);
    if (!p) return NULL;
    p->local = dupstr(local);
    p->owner = m;
    p->nmodules = 1;
    p->is_buffer = buffer;
    p->requires_grad = !buffer;
    p->shape_only = !buffer && ct__nn_shape_only();
    p->data = p->shape_only ? ct_tensor_absent(CT_F32, ndim, shape, CT_MEM_PARAM)
                            : ct_tensor_create(CT_F32, ndim, shape, CT_MEM_PARAM);
    if (!buffer && p->data)
        p->grad = p->shape_only ? ct_tensor_absent(CT_F32, ndim, shape, CT_MEM_GRAD)
                                : ct_tensor_create(CT_F32, ndim, shape, CT_MEM_GRAD);
    p->name = join(m->fqn, local);
    if (!p->local || !p->data || (!buffer && !p->grad) || !p->name) goto out_free;
    if (buffer) {
        ct_param **b = ct_grow(m->buffers, m->nbuffers, &m->buffers_cap, sizeof *b, CT_MEM_OTHER);
        if (!b) goto out_free;
        m->buffers = b;
        b[m->nbuffers++] = p;
    } else {
        ct_param **a = ct_grow(m->params, m->nparams, &m->params_cap, sizeof *a, CT_MEM_OTHER);
        if (!a) goto out_free;
        m->params = a;
        a[m->nparams++] = p;
    }
    return p;
out_free:
    param_free(p);
    return NULL;
}

ct_param *ct_module_add_param(ct_module *m, const char *local, int ndim, const int64_t *shape)
{
    return new_param(m, local, ndim, shape, 0);
}

ct_status ct_module_share_param(ct_module *m, const char *local, ct_param *p)
{
    int k = -1;
    for (int i = 0; i < m->nparams; i++)
        if (!strcmp(m->params[i]->local, local)) k = i;
    if (k < 0)
        return ct_error(CT_EINVAL, "sharing '%s' into '%s': that module has no parameter '%s' to replace",
                        p->name ? p->name : "?", nm(m), local);
    ct_param *old = m->params[k];
    if (old == p) return CT_OK;
    if (p->is_buffer || !ct_tensor_same_shape(old->data, p->data)) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "sharing '%s' %s as '%s' of '%s' %s: a shared parameter needs the "
                        "shape of the one it replaces", p->name ? p->name : "?",
                        ct_shape_str(p->data, a, sizeof a), local, nm(m), ct_shape_str(old->data, b, sizeof b));
    }
    if (old->grad_hooks || old->uses_pending)
        return ct_error(CT_ESTATE, "sharing into '%s.%s': it already has hooks or a forward in flight; "
                        "tie weights before wrapping the model in a strategy", nm(m), local);
    m->params[k] = p;
    p->nmodules++;
    param_free(old);
    return CT_OK;
}

ct_param *ct_module_add_buffer(ct_module *m, const char *local, int ndim, const int64_t *shape,
                               float value)
{
    ct_param *p = new_param(m, local, ndim, shape, 1);
    if (p) ct_tensor_fill(p->data, value);
    return p;
}

/* ---- walking ----------------------------------------------------------- */

typedef struct {
    void **items;
    int n, cap;
    int what; /* 0 params, 1 buffers, 2 modules */
} collect_t;

static int collect_push(collect_t *c, void *x)
{
    void **a = ct_grow(c->items, c->n, &c->cap, sizeof *a, CT_MEM_OTHER);
    if (!a) return -1;
    c->items = a;
    a[c->n++] = x;
    return 0;
}

static int seen(const collect_t *c, const void *x)
{
    for (int i = 0; i < c->n; i++)
        if (c->items[i] == x) return 1;
    return 0;
}

static int collect(ct_module *m, collect_t *c)
{
    if (c->what == 2) {
        if (collect_push(c, m)) return -1;
    } else {
        ct_param **ps = c->what ? m->buffers : m->params;
        int n = c->what ? m->nbuffers : m->nparams;
        for (int i = 0; i < n; i++) /* a shared parameter is listed once, as PyTorch does */
            if (!seen(c, ps[i]) && collect_push(c, ps[i])) return -1;
    }
    for (int i = 0; i < m->nkids; i++)
        if (collect(m->kids[i], c)) return -1;
    return 0;
}

static ct_status collect_into(ct_module *root, int what, void ***list, int *n)
{
    collect_t c = {NULL, 0, 0, what};
    if (collect(root, &c)) {
        ct_free(c.items);
        return CT_ENOMEM;
    }
    *list = c.items;
    *n = c.n;
    return CT_OK;
}

ct_status ct_module_params(ct_module *root, ct_param ***list, int *n)
{
    return collect_into(root, 0, (void ***)list, n);
}

ct_status ct_module_buffers(ct_module *root, ct_param ***list, int *n)
{
    return collect_into(root, 1, (void ***)list, n);
}

ct_status ct_module_modules(ct_module *root, ct_module ***list, int *n)
{
    return collect_into(root, 2, (void ***)list, n);
}

static ct_param *find_in(ct_module *m, const char *fqn)
{
    for (int i = 0; i < m->nparams; i++)
        if (!strcmp(m->params[i]->name, fqn)) return m->params[i];
    for (int i = 0; i < m->nbuffers; i++)
        if (!strcmp(m->buffers[i]->name, fqn)) return m->buffers[i];
    for (int i = 0; i < m->nkids; i++) {
        ct_param *p = find_in(m->kids[i], fqn);
        if (p) return p;
    }
    return NULL;
}

ct_param *ct_module_find(ct_module *root, const char *fqn) { return find_in(root, fqn); }

int64_t ct_module_num_params(ct_module *root)
{
    ct_param **ps;
    int n;
    if (ct_module_params(root, &ps, &n)) return -1;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += ps[i]->data->numel;
    ct_free(ps);
    return total;
}

static void zero_grads(ct_module *m, int lazy)
{
    for (int i = 0; i < m->nparams; i++) {
        ct_param *p = m->params[i];
        if (!p->grad) continue;
        /* A released gradient (a sharded strategy frees what it does not own) can only be marked. */
        int mark = lazy || !ct_tensor_data(p->grad);
        p->grad_stale = mark;
        if (!mark) ct_tensor_fill(p->grad, 0.0f);
    }
    for (int i = 0; i < m->nkids; i++) zero_grads(m->kids[i], lazy);
}

void ct_module_zero_grad(ct_module *root) { zero_grads(root, 0); }
void ct_module_zero_grad_lazy(ct_module *root) { zero_grads(root, 1); }

void ct_param_grad_sync(ct_param *p)
{
    if (!p->grad_stale || (p->grad && !ct_tensor_data(p->grad))) return; /* released: stays marked */
    p->grad_stale = 0;
    if (p->grad) ct_tensor_fill(p->grad, 0.0f);
}

float ct_param_grad_beta(ct_param *p)
{
    float beta = p->grad_stale ? 0.0f : 1.0f;
    p->grad_stale = 0;
    return beta;
}

static void describe(ct_module *m, int depth, char *buf, size_t n, size_t *off)
{
    if (*off >= n) return;
    int64_t np = 0;
    for (int i = 0; i < m->nparams; i++) np += m->params[i]->data->numel;
    *off += (size_t)snprintf(buf + *off, n - *off, "%*s%s %s", 2 * depth, "",
                             *m->fqn ? m->fqn : "(root)", m->ops->kind);
    for (int i = 0; i < m->nparams && *off < n; i++) {
        char sh[64];
        *off += (size_t)snprintf(buf + *off, n - *off, " %s%s", m->params[i]->local,
                                 ct_shape_str(m->params[i]->data, sh, sizeof sh));
    }
    if (*off < n) *off += (size_t)snprintf(buf + *off, n - *off, np ? " (%lld params)\n" : "\n",
                                           (long long)np);
    for (int i = 0; i < m->nkids; i++) describe(m->kids[i], depth + 1, buf, n, off);
}

void ct_module_describe(ct_module *root, char *buf, size_t n)
{
    size_t off = 0;
    if (n) buf[0] = 0;
    describe(root, 0, buf, n, &off);
}

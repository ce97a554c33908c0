/*
 * Activation checkpointing: the checkpoint wrapper (its forward keeps only
 * its input and runs the child without records; its backward recomputes the
 * child with ct_module_recompute, the one recompute pipelines and offload
 * use too, then runs the child's backward) and
 * ct_module_apply_activation_checkpointing, which wraps the modules a
 * policy picks in place (PyTorch's apply_activation_checkpointing).  The
 * wrapper is transparent in names, so wrapping changes no parameter name,
 * dropout stream or state dict entry.
 */
#include <string.h>

#include "internal.h"

/* The wrapper has exactly one child; ct_module_detach can take it. */
static ct_status need_inner(const ct_module *m)
{
    if (m->nkids == 1) return CT_OK;
    return ct_error(CT_ESTATE, "checkpoint '%s' has %d children instead of its one inner module (was it "
                    "detached?)", ct__nn_name(m), m->nkids);
}

static ct_status ckpt_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                              const ct_fwd_ctx *ctx)
{
    /* Run the body without records: only our input survives until backward. */
    CT_TRY(need_inner(m));
    if (rec && ct_record_save(rec, in) < 0) return CT_ENOMEM;
    m->kids[0]->emit_bf16 = m->emit_bf16; /* the child's output is ours */
    return ct_module_forward(m->kids[0], in, out, NULL, ctx);
}

static ct_status ckpt_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    ct_record *kr;
    CT_TRY(need_inner(m));
    /* Same context as the first forward: same seed, step and first sample
     * index, so the recomputed dropout masks are the ones the loss saw. */
    CT_TRY(ct_module_recompute(m->kids[0], ct_record_saved(rec, 0), NULL, &kr, &rec->ctx));
    m->kids[0]->emit_bf16_grad = m->emit_bf16_grad; /* its input gradient is ours */
    return ct_module_backward(m->kids[0], dout, din, kr);
}

static ct_status ckpt_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                int64_t *out_shape)
{
    CT_TRY(need_inner(m));
    return ct_module_out_shape(m->kids[0], ndim, in_shape, out_ndim, out_shape);
}

/* The record keeps the input only.  Backward recomputes the body with its
 * records and runs its backward: the body's own plan, less the output
 * gradient and input gradient the caller's replay already holds.  The
 * forward without records frees each output as the next is made, so its
 * scratch is left out (one layer's output at most). */
static ct_status ckpt_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    CT_TRY(need_inner(m));
    ct_act_plan p;
    CT_TRY(ct_act_plan_run(&m->kids[0], 1, nd, sh, (mixed ? CT_ACT_MIXED : 0) | (need_dx ? CT_ACT_DX0 : 0), &p));
    uint64_t held = p.out_bytes + (need_dx ? p.in_bytes : 0);
    c->keep_in = 1;
    c->bwd_tmp = p.peak > held ? p.peak - held : 0;
    return CT_OK;
}

static const ct_module_ops ckpt_ops = {"checkpoint", ckpt_forward, ckpt_backward, NULL, 0, ckpt_out_shape,
                                       ckpt_act_cost, CT_MOD_CHECKPOINT};

ct_module *ct_checkpoint_create(ct_module *inner)
{
    if (!inner) {
        ct_error(CT_EINVAL, "checkpoint needs a module to wrap");
        return NULL;
    }
    ct_module *m = ct_module_create(&ckpt_ops, NULL);
    if (!m) {
        ct_module_destroy(inner);
        return NULL;
    }
    m->transparent = 1;
    if (ct_module_add(m, "inner", inner) != CT_OK) { /* inner freed by the add */
        ct_module_destroy(m);
        return NULL;
    }
    return m;
}

/* ---- applying it to a model ------------------------------------------------ */

static int count_flag(const ct_module *m, unsigned flag)
{
    int n = ct_module_is(m, flag);
    for (int i = 0; i < m->nkids; i++) n += count_flag(m->kids[i], flag);
    return n;
}

static const ct_module *find_flag(const ct_module *m, unsigned flag)
{
    if (ct_module_is(m, flag)) return m;
    for (int i = 0; i < m->nkids; i++) {
        const ct_module *f = find_flag(m->kids[i], flag);
        if (f) return f;
    }
    return NULL;
}

typedef struct {
    ct_ckpt_check_fn check;
    void *ud;
    int blocks;            /* default policy: the tree has blocks */
    const ct_module *root;
} policy_t;

static int picks(const policy_t *p, const ct_module *m)
{
    if (p->check) return p->check(m, p->ud);
    if (p->blocks) return ct_module_is(m, CT_MOD_BLOCK);
    return m->parent == p->root; /* a sequential root's children */
}

/* Pre-order: the modules below m that the policy picks, not looking inside a pick. */
static void collect(const policy_t *p, ct_module *m, ct_module **out, int *n)
{
    for (int i = 0; i < m->nkids; i++) {
        ct_module *k = m->kids[i];
        if (picks(p, k)) {
            if (out) out[*n] = k;
            (*n)++;
        } else {
            collect(p, k, out, n);
        }
    }
}

static char *dupstr(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = ct_alloc(n, CT_MEM_OTHER);
    if (d) memcpy(d, s, n);
    return d;
}

ct_status ct_module_apply_activation_checkpointing(ct_module *root, ct_ckpt_check_fn check, void *ud,
                                                   int *nwrapped)
{
    if (nwrapped) *nwrapped = 0;
    if (!root) return ct_error(CT_EINVAL, "apply_activation_checkpointing: the model is NULL");
    if (root->held_by)
        return ct_error(CT_ESTATE, "apply_activation_checkpointing: the model is wrapped by %s, which has laid out "
                        "its modules already; apply activation checkpointing before wrapping the model",
                        root->held_by);
    const ct_module *old = find_flag(root, CT_MOD_CHECKPOINT);
    if (old)
        return ct_error(CT_ESTATE, "apply_activation_checkpointing: '%s' is checkpointed already (it was applied "
                        "before, or the model was built with checkpoint wrappers); apply it once, or a backward "
                        "would recompute twice", ct__nn_name(old));
    policy_t p = {check, ud, !check && count_flag(root, CT_MOD_BLOCK) > 0, root};
    if (check && check(root, ud))
        return ct_error(CT_EINVAL, "apply_activation_checkpointing: the policy picks the model itself, which would "
                        "keep only the batch and recompute everything in one go; pick its blocks or children");
    if (!check && !p.blocks && !ct_module_is(root, CT_MOD_SEQUENTIAL))
        return ct_error(CT_EINVAL, "apply_activation_checkpointing: the model (%s) has no blocks and is not a "
                        "sequential, so the default policy has nothing to wrap; pass a check function",
                        root->ops->kind);
    int n = 0;
    collect(&p, root, NULL, &n);
    if (!n)
        return ct_error(CT_EINVAL, "apply_activation_checkpointing: the policy picks no module of the model; "
                        "nothing would be checkpointed");
    /* Everything that can fail first, so a failure changes nothing. */
    ct_module **mods = ct_alloc(sizeof *mods * (size_t)n, CT_MEM_OTHER);
    ct_module **wraps = ct_alloc_zeroed(sizeof *wraps * (size_t)n, CT_MEM_OTHER);
    ct_status st = mods && wraps ? CT_OK : CT_ENOMEM;
    int k = 0;
    if (st == CT_OK) collect(&p, root, mods, &k);
    for (int i = 0; st == CT_OK && i < n; i++) {
        ct_module *w = wraps[i] = ct_module_create(&ckpt_ops, NULL);
        char *inner = w ? dupstr("inner") : NULL, *fqn = inner ? dupstr(mods[i]->fqn) : NULL;
        ct_module **kids = fqn ? ct_alloc(sizeof *kids, CT_MEM_OTHER) : NULL;
        if (!kids) {
            ct_free(inner);
            ct_free(fqn);
            st = CT_ENOMEM;
            break;
        }
        /* the wrapper's name and path are the module's; the module becomes its "inner" */
        ct_free(w->name);
        ct_free(w->fqn);
        w->name = inner; /* swapped with the module's below */
        w->fqn = fqn;
        w->kids = kids;
        w->kids_cap = 1;
    }
    if (st != CT_OK) {
        for (int i = 0; wraps && i < n; i++) ct_module_destroy(wraps[i]);
        ct_free(mods);
        ct_free(wraps);
        return st;
    }
    for (int i = 0; i < n; i++) {
        ct_module *m = mods[i], *w = wraps[i], *par = m->parent;
        int at = 0;
        while (par->kids[at] != m) at++;
        char *name = m->name;
        m->name = w->name;
        w->name = name;
        w->transparent = 1;
        w->rng_stream = m->rng_stream;
        w->parent = par;
        par->kids[at] = w;
        w->kids[w->nkids++] = m;
        m->parent = w;
    }
    ct_free(mods);
    ct_free(wraps);
    if (nwrapped) *nwrapped = n;
    return CT_OK;
}

/*
 * Containers: sequential (children in order; split into pipeline stages)
 * and residual (x + body(x)).  Their output shapes compose their
 * children's.  The checkpoint wrapper is in checkpoint.c.
 */
#include <string.h>

#include "internal.h"

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

/* A residual has exactly one child; ct_module_detach can take it. */
static ct_status need_child(const ct_module *m)
{
    if (m->nkids == 1) return CT_OK;
    return ct_error(CT_ESTATE, "residual '%s' has %d children instead of its one body (was it detached?)",
                    nm(m), m->nkids);
}

/* ---- sequential -------------------------------------------------------- */

static ct_status seq_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                             const ct_fwd_ctx *ctx)
{
    ct_tensor *x = ct_tensor_retain(in);
    for (int i = 0; i < m->nkids; i++) {
        ct_tensor *y;
        ct_record *kr = NULL;
        m->kids[i]->emit_bf16 = i + 1 < m->nkids ? ct__takes_bf16(m->kids[i + 1]) : m->emit_bf16;
        ct_status s = ct_module_forward(m->kids[i], x, &y, rec ? &kr : NULL, ctx);
        ct_tensor_release(x);
        if (s == CT_OK && rec && ct_record_add_kid(rec, kr) != CT_OK) {
            ct_record_destroy(kr);
            ct_tensor_release(y);
            s = CT_ENOMEM;
        }
        if (s != CT_OK) return s;
        x = y;
    }
    *out = x;
    return CT_OK;
}

static ct_status seq_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    if (rec->nkids != m->nkids)
        return ct_error(CT_ESTATE, "sequential '%s' has %d children but its record has %d",
                        m->fqn, m->nkids, rec->nkids);
    ct_tensor *g = ct_tensor_retain(dout);
    for (int i = m->nkids - 1; i >= 0; i--) {
        ct_record *kr = rec->kids[i];
        rec->kids[i] = NULL; /* consumed by the child's backward */
        int need = i > 0 || din;
        ct_tensor *gin = NULL;
        m->kids[i]->emit_bf16_grad = i > 0 ? ct__takes_bf16_grad(m->kids[i - 1], rec->kids[i - 1]) : m->emit_bf16_grad;
        ct_status s = ct_module_backward(m->kids[i], g, need ? &gin : NULL, kr);
        ct_tensor_release(g);
        if (s != CT_OK) return s;
        if (need && !gin)
            return ct_error(CT_EUNSUPPORTED, "'%s' (%s) gives no input gradient, so it can only be "
                            "the first layer", m->kids[i]->fqn, m->kids[i]->ops->kind);
        g = gin;
    }
    if (din) *din = g;
    else ct_tensor_release(g);
    return CT_OK;
}

static ct_status seq_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                               int64_t *out_shape)
{
    int64_t cur[CT_MAX_DIMS];
    int n = ndim;
    memcpy(cur, in_shape, (size_t)ndim * sizeof *cur);
    for (int i = 0; i < m->nkids; i++) CT_TRY(ct_module_out_shape(m->kids[i], n, cur, &n, cur));
    memcpy(out_shape, cur, (size_t)n * sizeof *cur);
    *out_ndim = n;
    return CT_OK;
}

static const ct_module_ops seq_ops = {"sequential", seq_forward, seq_backward, NULL, 0, seq_out_shape,
                                      ct__act_cost_walk, CT_MOD_SEQUENTIAL};

ct_module *ct_sequential_create(void) { return ct_module_create(&seq_ops, NULL); }

static char *dupstr(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = ct_alloc(n, CT_MEM_OTHER);
    if (d) memcpy(d, s, n);
    return d;
}

ct_status ct_sequential_split(ct_module *seq, const int *sizes, int nparts, ct_module **parts)
{
    if (seq->ops != &seq_ops)
        return ct_error(CT_EINVAL, "ct_sequential_split: '%s' is a %s, not a sequential; split the "
                        "sequential that holds the layers", nm(seq), seq->ops->kind);
    if (nparts < 1 || !sizes || !parts)
        return ct_error(CT_EINVAL, "ct_sequential_split: %d parts; give at least one part size and "
                        "room for the parts", nparts);
    long long sum = 0;
    for (int i = 0; i < nparts; i++) {
        if (sizes[i] < 1)
            return ct_error(CT_EINVAL, "ct_sequential_split: part %d has %d layers; every part needs "
                            "at least one", i, sizes[i]);
        sum += sizes[i];
    }
    if (sum != seq->nkids)
        return ct_error(CT_EINVAL, "ct_sequential_split: sizes sum to %lld but the model ('%s') has "
                        "%d layers; give sizes that add up to %d", sum, nm(seq), seq->nkids,
                        seq->nkids);
    /* Everything that can fail first, so a failure changes nothing. */
    for (int i = 0; i < nparts; i++) parts[i] = NULL;
    for (int i = 0; i < nparts; i++) {
        ct_module *p = parts[i] = ct_sequential_create();
        char *fqn = p ? dupstr(seq->fqn) : NULL;
        ct_module **kids = fqn ? ct_alloc((size_t)sizes[i] * sizeof *kids, CT_MEM_OTHER) : NULL;
        if (!kids) {
            ct_free(fqn);
            goto out_free_parts;
        }
        /* The part's path is seq's: its children's names come out as they were. */
        ct_free(p->fqn);
        p->fqn = fqn;
        p->rng_stream = seq->rng_stream;
        p->kids = kids;
        p->kids_cap = sizes[i];
    }
    for (int i = 0, k = 0; i < nparts; i++)
        for (int j = 0; j < sizes[i]; j++) {
            ct_module *kid = seq->kids[k++];
            kid->parent = parts[i];
            parts[i]->kids[parts[i]->nkids++] = kid;
        }
    seq->nkids = 0;
    return CT_OK;
out_free_parts:
    for (int i = 0; i < nparts; i++) {
        ct_module_destroy(parts[i]);
        parts[i] = NULL;
    }
    return CT_ENOMEM;
}

/* ---- residual ---------------------------------------------------------- */

static ct_status res_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                             const ct_fwd_ctx *ctx)
{
    ct_tensor *y;
    ct_record *kr = NULL;
    CT_TRY(need_child(m));
    CT_TRY(ct_module_forward(m->kids[0], in, &y, rec ? &kr : NULL, ctx));
    ct_status s = CT_OK;
    if (!ct_tensor_same_shape(in, y) || in->dtype != CT_F32) {
        char a[64], b[64];
        s = ct_error(CT_EINVAL, "residual '%s': body maps %s to %s; a residual body must keep the "
                     "shape (f32)", m->fqn, ct_shape_str(in, a, sizeof a), ct_shape_str(y, b, sizeof b));
    }
    if (s == CT_OK && rec) s = ct_record_add_kid(rec, kr) ? CT_ENOMEM : CT_OK;
    if (s != CT_OK) {
        ct_record_destroy(kr);
        ct_tensor_release(y);
        return s;
    }
    ct_tensor *o = ct_tensor_create(CT_F32, in->ndim, in->shape, CT_MEM_ACT);
    if (!o) {
        ct_tensor_release(y);
        return CT_ENOMEM;
    }
    const float *xp = ct_f32(in), *yp = ct_f32(y);
    float *op = ct_f32(o);
    for (int64_t i = 0; i < o->numel; i++) op[i] = xp[i] + yp[i];
    ct_tensor_release(y);
    *out = o;
    return CT_OK;
}

static ct_status res_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    CT_TRY(need_child(m));
    ct_record *kr = rec->kids[0];
    rec->kids[0] = NULL;
    ct_tensor *gx = NULL;
    CT_TRY(ct_module_backward(m->kids[0], dout, din ? &gx : NULL, kr));
    if (!din) return CT_OK;
    if (!gx) return ct_error(CT_EUNSUPPORTED, "residual '%s': body gives no input gradient", m->fqn);
    ct_tensor *g = ct_tensor_create(CT_F32, dout->ndim, dout->shape, CT_MEM_ACT);
    if (!g) {
        ct_tensor_release(gx);
        return CT_ENOMEM;
    }
    const float *a = ct_f32(dout), *b = ct_f32(gx);
    float *gp = ct_f32(g);
    for (int64_t i = 0; i < g->numel; i++) gp[i] = a[i] + b[i];
    ct_tensor_release(gx);
    *din = g;
    return CT_OK;
}

static ct_status res_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                               int64_t *out_shape)
{
    int64_t y[CT_MAX_DIMS];
    int n;
    CT_TRY(need_child(m));
    CT_TRY(ct_module_out_shape(m->kids[0], ndim, in_shape, &n, y));
    if (n != ndim || memcmp(y, in_shape, (size_t)n * sizeof *y)) {
        ct_tensor a = ct__shape_header(ndim, in_shape), b = ct__shape_header(n, y);
        char sa[64], sb[64];
        return ct_error(CT_EINVAL, "residual '%s': body maps %s to %s; a residual body must keep "
                        "the shape (f32)", nm(m), ct_shape_str(&a, sa, sizeof sa),
                        ct_shape_str(&b, sb, sizeof sb));
    }
    return ct_module_out_shape_same(m, ndim, in_shape, out_ndim, out_shape);
}

static const ct_module_ops res_ops = {"residual", res_forward, res_backward, NULL, 0, res_out_shape,
                                      ct__act_cost_walk, 0};

ct_module *ct_residual_create(ct_module *body)
{
    if (!body) {
        ct_error(CT_EINVAL, "residual needs a body module");
        return NULL;
    }
    ct_module *m = ct_module_create(&res_ops, NULL);
    if (!m) {
        ct_module_destroy(body);
        return NULL;
    }
    if (ct_module_add(m, "body", body) != CT_OK) { /* body freed by the add */
        ct_module_destroy(m);
        return NULL;
    }
    return m;
}

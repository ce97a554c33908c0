/*
 * The other pieces of a GPT, named as nanoGPT names them:
 * - the pre-LN residual block (Block): x + attn(ln_1(x)), then
 *   h + mlp(ln_2(h)), with children ln_1, attn, ln_2, mlp, where mlp is a
 *   sequential c_fc (Linear(D, 4D)), gelu (exact erf), c_proj (Linear(4D, D)),
 *   dropout;
 * - token and position embeddings: wte(idx) + wpe(0..T-1), then drop, with
 *   children wte, wpe, drop.
 * Both call their children through ct_module_forward/backward, so hooks and
 * grad-ready fire for every linear, norm and embedding as strategies expect.
 */
#include <limits.h>

#include "internal.h"

#define nm ct__nn_name

/* Runs child k of m on x into *y, keeping its record in rec (if any). */
static ct_status kid_forward(ct_module *m, int k, ct_tensor *x, ct_tensor **y, ct_record *rec,
                             const ct_fwd_ctx *ctx)
{
    ct_record *kr = NULL;
    CT_TRY(ct_module_forward(m->kids[k], x, y, rec ? &kr : NULL, ctx));
    if (rec && ct_record_add_kid(rec, kr) != CT_OK) {
        ct_record_destroy(kr);
        ct_tensor_release(*y);
        *y = NULL;
        return CT_ENOMEM;
    }
    return CT_OK;
}

/* Backward of child k (its record taken out of rec); *din as ct_module_backward. */
static ct_status kid_backward(ct_module *m, int k, ct_tensor *dy, ct_tensor **din, ct_record *rec)
{
    ct_record *kr = rec->kids[k];
    rec->kids[k] = NULL;
    return ct_module_backward(m->kids[k], dy, din, kr);
}

/* Only this reference sees t's memory, so t may be overwritten. */
static int sole_owner(const ct_tensor *t)
{
    return t->dtype == CT_F32 && __atomic_load_n(&t->refcount, __ATOMIC_ACQUIRE) == 1 &&
           __atomic_load_n(&t->storage->refcount, __ATOMIC_ACQUIRE) == 1 && t->storage->owns &&
           !t->storage->window;
}

static void add_part(void *ctx, int64_t lo, int64_t hi)
{
    const float *const *io = ctx;
    const float *restrict x = io[0], *restrict y = io[1];
    float *z = (float *)io[2]; /* may be y itself */
    for (int64_t i = lo; i < hi; i++) z[i] = x[i] + y[i];
}

/* a + b as a new reference: into b when nothing else holds b (a branch's
 * fresh output or gradient: no allocation, one stream less), else a new
 * tensor of a's shape. */
static ct_tensor *add(const ct_tensor *a, ct_tensor *b)
{
    ct_tensor *o = sole_owner(b) ? ct_tensor_retain(b) : ct_tensor_empty(CT_F32, a->ndim, a->shape, CT_MEM_ACT);
    if (!o) return NULL;
    const float *io[3] = {ct_f32(a), ct_f32(b), ct_f32(o)};
    ct_parallel_for(o->numel, 16384, add_part, io); /* elementwise: any cut, one thread's bits */
    return o;
}

static ct_status need_kids(const ct_module *m, int n, const char *which)
{
    if (m->nkids == n) return CT_OK;
    return ct_error(CT_ESTATE, "%s '%s' has %d children instead of %s (was one detached?)", m->ops->kind,
                    nm(m), m->nkids, which);
}

/* ---- block --------------------------------------------------------------- */

enum { B_LN1 = 0, B_ATTN, B_LN2, B_MLP };

/* x + branch(x) for the branch of children a then b. */
static ct_status branch_forward(ct_module *m, int a, ct_tensor *x, ct_tensor **out, ct_record *rec,
                                const ct_fwd_ctx *ctx)
{
    ct_tensor *u = NULL, *v = NULL;
    m->kids[a]->emit_bf16 = ct__takes_bf16(m->kids[a + 1]); /* the norm's output feeds only the branch */
    m->kids[a + 1]->emit_bf16 = 0;                          /* the residual sum is f32 */
    CT_TRY(kid_forward(m, a, x, &u, rec, ctx));
    ct_status st = kid_forward(m, a + 1, u, &v, rec, ctx);
    ct_tensor_release(u);
    if (st != CT_OK) return st;
    if (!ct_tensor_same_shape(v, x)) {
        char s1[64], s2[64];
        st = ct_error(CT_EINVAL, "block '%s': '%s' maps %s to %s; a residual branch keeps the shape", nm(m),
                      m->kids[a + 1]->fqn, ct_shape_str(x, s1, sizeof s1), ct_shape_str(v, s2, sizeof s2));
    }
    *out = st == CT_OK ? add(x, v) : NULL;
    ct_tensor_release(v);
    if (st == CT_OK && !*out) st = CT_ENOMEM;
    return st;
}

/* dx = dout + d(branch)/dx dout */
static ct_status branch_backward(ct_module *m, int a, ct_tensor *dout, ct_tensor **dx, ct_record *rec)
{
    ct_tensor *du = NULL, *dxb = NULL;
    m->kids[a + 1]->emit_bf16_grad = 0; /* the norm's backward takes f32 */
    m->kids[a]->emit_bf16_grad = 0;     /* so does the residual sum */
    CT_TRY(kid_backward(m, a + 1, dout, &du, rec));
    ct_status st = du ? kid_backward(m, a, du, &dxb, rec) : ct_error(CT_EUNSUPPORTED, "block '%s': '%s' gives "
                                                                    "no input gradient", nm(m), m->kids[a + 1]->fqn);
    ct_tensor_release(du);
    if (st == CT_OK && !dxb)
        st = ct_error(CT_EUNSUPPORTED, "block '%s': '%s' gives no input gradient", nm(m), m->kids[a]->fqn);
    *dx = st == CT_OK ? add(dout, dxb) : NULL;
    ct_tensor_release(dxb);
    if (st == CT_OK && !*dx) st = CT_ENOMEM;
    return st;
}

static ct_status block_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                               const ct_fwd_ctx *ctx)
{
    CT_TRY(need_kids(m, 4, "ln_1, attn, ln_2 and mlp"));
    if (in->dtype != CT_F32)
        return ct_error(CT_EINVAL, "block '%s': input is %s; it takes F32", nm(m), ct_dtype_name(in->dtype));
    ct_tensor *h = NULL;
    CT_TRY(branch_forward(m, B_LN1, in, &h, rec, ctx));
    ct_status st = branch_forward(m, B_LN2, h, out, rec, ctx);
    ct_tensor_release(h);
    return st;
}

static ct_status block_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    CT_TRY(need_kids(m, 4, "ln_1, attn, ln_2 and mlp"));
    if (rec->nkids != 4)
        return ct_error(CT_ESTATE, "block '%s': its record has %d child records instead of 4", nm(m), rec->nkids);
    ct_tensor *dh = NULL, *dx = NULL;
    CT_TRY(branch_backward(m, B_LN2, dout, &dh, rec));
    ct_status st = branch_backward(m, B_LN1, dh, &dx, rec);
    ct_tensor_release(dh);
    if (st != CT_OK) return st;
    if (din) *din = dx;
    else ct_tensor_release(dx);
    return CT_OK;
}

static ct_status block_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                 int64_t *out_shape)
{
    int64_t s[CT_MAX_DIMS];
    int n;
    CT_TRY(need_kids(m, 4, "ln_1, attn, ln_2 and mlp"));
    for (int k = 0; k < 4; k += 2) {
        CT_TRY(ct_module_out_shape(m->kids[k], ndim, in_shape, &n, s));
        CT_TRY(ct_module_out_shape(m->kids[k + 1], n, s, &n, s));
        if (n != ndim || memcmp(s, in_shape, sizeof *s * (size_t)n))
            return ct_error(CT_EINVAL, "block '%s': '%s' changes the shape; a residual branch keeps it", nm(m),
                            m->kids[k + 1]->fqn);
    }
    return ct_module_out_shape_same(m, ndim, in_shape, out_ndim, out_shape);
}

/* Per block of rows BT, width D: ln_1 and ln_2 keep their inputs (x here,
 * h below) and 8 bytes a row; the attention what its act_cost says (it keeps
 * ln_1's output or its bf16 cast); c_fc and the MLP's c_proj keep their
 * inputs (bf16 under mixed); gelu keeps gelu'(x); the dropout a byte mask.
 * Scratch: the attention's, and backward d(gelu) and the branch gradients
 * (f32: an upper bound under mixed, where d(gelu) may be bf16). */
static ct_status block_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)need_dx;
    ct_act_cost a = {0};
    /* ct_module_act_cost ran block_out_shape first: four children, x [B, T, D] */
    CT_TRY(ct_module_act_cost(m->kids[1], nd, sh, mixed, 1, &a));
    const ct_module *mlp = m->kids[3];
    int mdrop = mlp->nkids > 3 && ct__dropout_p(mlp->kids[3]) > 0;
    uint64_t BT = (uint64_t)sh[0] * (uint64_t)sh[1], D = (uint64_t)sh[2];
    uint64_t lin = mixed && mlp->nkids && ct__act_has_copy(mlp->kids[0]) ? 2 : 4;
    c->keep_in = 1;
    c->saved = 2 * BT * 8 + a.saved + (a.keep_in ? BT * D * 4 : 0) + BT * D * 4 /* h */ +
               BT * D * lin /* c_fc's input */ + 4 * BT * D * 4 /* gelu'(x) */ + 4 * BT * D * lin /* c_proj's */ +
               (mdrop ? BT * D : 0);
    c->fwd_tmp = a.fwd_tmp;
    c->bwd_tmp = a.bwd_tmp + 4 * BT * D * 4 + 2 * BT * D * 4;
    return CT_OK;
}

static const ct_module_ops block_ops = {"block", block_forward, block_backward, NULL, 0, block_out_shape,
                                        block_act_cost, CT_MOD_BLOCK};

ct_module *ct_transformer_block_create(int64_t dim, int heads, float dropout)
{
    ct_module *m = ct_module_create(&block_ops, NULL);
    ct_module *mlp = ct_sequential_create();
    if (!m || !mlp) goto out_free;
    if (ct_module_add(mlp, "c_fc", ct_linear_create(dim, 4 * dim, 1)) != CT_OK ||
        ct_module_add(mlp, "gelu", ct_gelu_create()) != CT_OK ||
        ct_module_add(mlp, "c_proj", ct_linear_create(4 * dim, dim, 1)) != CT_OK ||
        ct_module_add(mlp, "dropout", ct_dropout_create(dropout)) != CT_OK)
        goto out_free;
    if (ct_module_add(m, "ln_1", ct_layernorm_create(dim, 1e-5f)) != CT_OK ||
        ct_module_add(m, "attn", ct_attention_create(dim, heads, dropout, dropout)) != CT_OK ||
        ct_module_add(m, "ln_2", ct_layernorm_create(dim, 1e-5f)) != CT_OK) {
        ct_module_destroy(mlp);
        ct_module_destroy(m);
        return NULL;
    }
    if (ct_module_add(m, "mlp", mlp) != CT_OK) { /* mlp freed by the add */
        ct_module_destroy(m);
        return NULL;
    }
    return m;
out_free:
    ct_module_destroy(mlp);
    ct_module_destroy(m);
    return NULL;
}

/* ---- token and position embeddings ---------------------------------------- */

enum { E_WTE = 0, E_WPE, E_DROP };

typedef struct {
    int64_t context;
} tokpos_impl;

static ct_status tokpos_check(const ct_module *m, int ndim, const int64_t *shape)
{
    const tokpos_impl *E = m->impl;
    ct_tensor t = ct__shape_header(ndim, shape);
    char sh[64];
    if (ndim != 2)
        return ct_error(CT_EINVAL, "embeddings '%s': input %s must be token indices [batch, time]", nm(m),
                        ct_shape_str(&t, sh, sizeof sh));
    if (shape[1] > E->context)
        return ct_error(CT_EINVAL, "embeddings '%s': %lld tokens per sequence but the context is %lld; "
                        "give at most %lld (the model's --context)", nm(m), (long long)shape[1],
                        (long long)E->context, (long long)E->context);
    return CT_OK;
}

static ct_status tokpos_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                                const ct_fwd_ctx *ctx)
{
    CT_TRY(need_kids(m, 3, "wte, wpe and drop"));
    CT_TRY(tokpos_check(m, in->ndim, in->shape));
    int64_t B = in->shape[0], T = in->shape[1];
    ct_tensor *pos = ct_tensor_empty(CT_I64, 1, &T, CT_MEM_ACT), *tok = NULL, *pe = NULL, *sum = NULL;
    if (!pos) return CT_ENOMEM;
    for (int64_t t = 0; t < T; t++) ((int64_t *)ct_tensor_data(pos))[t] = t;
    ct_status st = kid_forward(m, E_WTE, in, &tok, rec, ctx);
    if (st == CT_OK) st = kid_forward(m, E_WPE, pos, &pe, rec, ctx);
    ct_tensor_release(pos);
    if (st == CT_OK) {
        int64_t D = tok->shape[2];
        float *x = ct_f32(tok); /* ours alone: add the positions in place */
        const float *p = ct_f32(pe);
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < T * D; i++) x[b * T * D + i] += p[i];
        st = kid_forward(m, E_DROP, tok, &sum, rec, ctx);
    }
    ct_tensor_release(tok);
    ct_tensor_release(pe);
    if (st == CT_OK) *out = sum;
    return st;
}

/* Indices have no gradient: *din stays NULL. */
static ct_status tokpos_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    (void)din;
    CT_TRY(need_kids(m, 3, "wte, wpe and drop"));
    if (rec->nkids != 3)
        return ct_error(CT_ESTATE, "embeddings '%s': its record has %d child records instead of 3", nm(m),
                        rec->nkids);
    ct_tensor *g = NULL;
    CT_TRY(kid_backward(m, E_DROP, dout, &g, rec));
    int64_t B = g->shape[0], T = g->shape[1], D = g->shape[2], ps[2] = {T, D};
    ct_tensor *gp = ct_tensor_create(CT_F32, 2, ps, CT_MEM_ACT);
    ct_status st = gp ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) {
        const float *x = ct_f32(g);
        float *p = ct_f32(gp);
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < T * D; i++) p[i] += x[b * T * D + i];
        st = kid_backward(m, E_WPE, gp, NULL, rec);
    }
    if (st == CT_OK) st = kid_backward(m, E_WTE, g, NULL, rec);
    ct_tensor_release(gp);
    ct_tensor_release(g);
    return st;
}

static ct_status tokpos_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                  int64_t *out_shape)
{
    CT_TRY(need_kids(m, 3, "wte, wpe and drop"));
    CT_TRY(tokpos_check(m, ndim, in_shape));
    return ct_module_out_shape(m->kids[E_WTE], ndim, in_shape, out_ndim, out_shape);
}

static void tokpos_destroy(ct_module *m) { ct_free(m->impl); }

/* The record keeps the i64 positions and the dropout's byte mask; forward
 * holds the position rows (the sum before dropout) meanwhile. */
static ct_status tokpos_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)mixed, (void)need_dx;
    uint64_t no = ct__act_out_numel(m, nd, sh);
    c->saved = (uint64_t)(nd > 1 ? sh[1] : 1) * 8 + (ct__dropout_p(m->kids[E_DROP]) > 0 ? no : 0);
    c->fwd_tmp = no * 4;
    return CT_OK;
}

static const ct_module_ops tokpos_ops = {"tokpos_embedding", tokpos_forward, tokpos_backward, tokpos_destroy, 0,
                                         tokpos_out_shape, tokpos_act_cost, 0};

ct_module *ct_tokpos_embedding_create(int64_t vocab, int64_t context, int64_t dim, float dropout)
{
    if (context <= 0 || context > INT_MAX) {
        ct_error(CT_EINVAL, "token and position embeddings need a context of 1 to 2^31-1, got %lld",
                 (long long)context);
        return NULL;
    }
    tokpos_impl *E = ct_alloc(sizeof *E, CT_MEM_OTHER);
    if (!E) return NULL;
    E->context = context;
    ct_module *m = ct_module_create(&tokpos_ops, E);
    if (!m) {
        ct_free(E);
        return NULL;
    }
    if (ct_module_add(m, "wte", ct_embedding_create(vocab, dim)) != CT_OK ||
        ct_module_add(m, "wpe", ct_embedding_create(context, dim)) != CT_OK ||
        ct_module_add(m, "drop", ct_dropout_create(dropout)) != CT_OK) {
        ct_module_destroy(m);
        return NULL;
    }
    return m;
}

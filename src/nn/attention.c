/*
 * Causal self-attention as nanoGPT's CausalSelfAttention: a fused QKV
 * projection c_attn (Linear(D, 3D)), scaled dot-product attention per head
 * with the causal mask (position t sees positions 0..t only), dropout on the
 * attention probabilities, the output projection c_proj (Linear(D, D)) and
 * resid_dropout.  c_attn, c_proj and resid_dropout are children, so their
 * parameters are "attn.c_attn.weight" ... as in nanoGPT's state_dict, and
 * strategies see them as ordinary linear layers.
 *
 * The core between the projections runs per (sample, head) as matrix
 * products on strided views of qkv [B, T, 3D] (q, k, v of head h are columns
 * h*hd, D + h*hd, 2D + h*hd, each hd wide, row stride 3D), so nothing is
 * transposed or copied into head-major layout.  The record keeps qkv (or its
 * bf16 cast), the probabilities P [B, H, T, T] before dropout, and the
 * dropout mask.  When c_attn's weight has a bf16 compute copy (mixed
 * precision) the four products of the core run in bf16 too (oneDNN, f32
 * accumulation) and qkv is kept as bf16; softmax and its gradient stay f32.
 *
 * Attention dropout draws element (h, i, j) of sample b from the Philox
 * stream keyed by (seed, step, this module's stream) at counter (sample0 + b,
 * h*T*T + i*T + j), like ct_dropout_create: any split of the global batch
 * over ranks and micro-batches draws the masks one process would.
 */
#include <limits.h>
#include <math.h>

#include "internal.h"

typedef struct {
    int64_t dim;
    int heads;
    float attn_p;
} attn_impl;

#define nm ct__nn_name

enum { K_C_ATTN = 0, K_C_PROJ, K_RESID_DROP };

static uint64_t mix64(uint64_t z) /* splitmix64 finaliser (as dropout.c) */
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static ct_status check_kids(const ct_module *m)
{
    if (m->nkids == 3) return CT_OK;
    return ct_error(CT_ESTATE, "attention '%s' has %d children instead of c_attn, c_proj and "
                    "resid_dropout (was one detached?)", nm(m), m->nkids);
}

static ct_status check_input(const ct_module *m, int ndim, const int64_t *shape)
{
    const attn_impl *A = m->impl;
    ct_tensor t = ct__shape_header(ndim, shape);
    char sh[64];
    if (ndim != 3 || shape[2] != A->dim)
        return ct_error(CT_EINVAL, "attention '%s': input %s must be [batch, time, %lld]", nm(m),
                        ct_shape_str(&t, sh, sizeof sh), (long long)A->dim);
    if (shape[1] > INT_MAX / 4 || shape[0] * shape[1] > INT_MAX)
        return ct_error(CT_EINVAL, "attention '%s': input %s is too large for one call; split the batch",
                        nm(m), ct_shape_str(&t, sh, sizeof sh));
    return CT_OK;
}

/* Row i of a causal score matrix s [T, T] -> softmax over j <= i, 0 beyond. */
/* Sum and max of x[0..n) in 16 lanes, which the compiler keeps in vector
 * registers (one running value is a serial chain). */
static float lane_sum(const float *x, int64_t n)
{
    float a[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++) a[k] += x[j + k];
    float s = 0;
    for (; j < n; j++) s += x[j];
    for (int k = 0; k < 16; k++) s += a[k];
    return s;
}

static float lane_dot(const float *x, const float *y, int64_t n)
{
    float a[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++) a[k] += x[j + k] * y[j + k];
    float s = 0;
    for (; j < n; j++) s += x[j] * y[j];
    for (int k = 0; k < 16; k++) s += a[k];
    return s;
}

static float lane_max(const float *x, int64_t n)
{
    float a[16];
    int64_t j = 0;
    for (int k = 0; k < 16; k++) a[k] = x[0];
    for (; j + 16 <= n; j += 16)
        for (int k = 0; k < 16; k++) a[k] = x[j + k] > a[k] ? x[j + k] : a[k];
    float m = x[0];
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    for (int k = 0; k < 16; k++) m = a[k] > m ? a[k] : m;
    return m;
}

static void causal_softmax(float *s, int64_t T)
{
    for (int64_t i = 0; i < T; i++) {
        float *r = s + i * T, mx = lane_max(r, i + 1);
        for (int64_t j = 0; j <= i; j++) r[j] = ct__expf(r[j] - mx);
        float inv = 1.0f / lane_sum(r, i + 1);
        for (int64_t j = 0; j <= i; j++) r[j] *= inv;
        for (int64_t j = i + 1; j < T; j++) r[j] = 0.0f;
    }
}

/* Products of the core on either precision: operands are f32 pointers or
 * bf16 bits; the product's output is f32. */
typedef struct {
    int bf16;
} prec;

static ct_status mm(prec p, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *a,
                    int64_t lda, const void *b, int64_t ldb, float *c, int64_t ldc)
{
    if (p.bf16)
        return ct_gemm_bf16(ta, tb, (int)M, (int)N, (int)K, alpha, a, (int)lda, b, (int)ldb, 0.0f, c, (int)ldc);
    return ct_gemm_f32(CT_GEMM_AUTO, ta, tb, (int)M, (int)N, (int)K, alpha, a, (int)lda, b, (int)ldb, 0.0f, c,
                       (int)ldc);
}

/* The dropped probabilities of one (sample, head): pd = P * keep / (1 - p),
 * as f32 or bf16 into out; f32 scratch of n floats for the bf16 case (the
 * vectorised cast wants an f32 array). */
static void dropped(const float *P, const uint8_t *mask, float p, int64_t n, int bf16, void *out, float *scratch)
{
    const float *src = P;
    if (mask) {
        float scale = 1.0f / (1.0f - p), *o = bf16 ? scratch : out;
        for (int64_t i = 0; i < n; i++) o[i] = mask[i] ? P[i] * scale : 0.0f;
        src = o;
    }
    if (bf16) ct_f32_to_bf16_n(src, out, (size_t)n);
    else if (src != out) memcpy(out, src, sizeof(float) * (size_t)n);
}

/* qkv [B, T, 3D] (f32 or bf16) -> y [B, T, D]; P [B, H, T, T] receives the
 * probabilities; mask (or NULL) the keep-bytes of the attention dropout. */
static ct_status core_forward(const attn_impl *A, const ct_tensor *qkv, ct_tensor *P, const uint8_t *mask,
                              ct_tensor *y)
{
    int64_t B = qkv->shape[0], T = qkv->shape[1], D = A->dim, H = A->heads, hd = D / H;
    prec pr = {qkv->dtype == CT_BF16};
    size_t es = pr.bf16 ? 2 : 4;
    const char *base = ct_tensor_data(qkv);
    float *Pd = ct_f32(P), *yd = ct_f32(y);
    void *tmp = ct_alloc((size_t)(T * T) * (es + sizeof(float)), CT_MEM_ACT);
    if (!tmp) return CT_ENOMEM;
    float *scratch = (float *)((char *)tmp + (size_t)(T * T) * es);
    float scale = 1.0f / sqrtf((float)hd);
    ct_status st = CT_OK;
    for (int64_t b = 0; b < B && st == CT_OK; b++)
        for (int64_t h = 0; h < H && st == CT_OK; h++) {
            const char *q = base + ((size_t)(b * T * 3 * D + h * hd)) * es;
            const char *k = q + (size_t)D * es, *v = q + (size_t)(2 * D) * es;
            float *S = Pd + (b * H + h) * T * T;
            st = mm(pr, 0, 1, T, T, hd, scale, q, 3 * D, k, 3 * D, S, T);
            if (st != CT_OK) break;
            causal_softmax(S, T);
            const void *pv = S;
            if (pr.bf16 || mask) {
                dropped(S, mask ? mask + (b * H + h) * T * T : NULL, A->attn_p, T * T, pr.bf16, tmp, scratch);
                pv = tmp;
            }
            st = mm(pr, 0, 0, T, hd, T, 1.0f, pv, T, v, 3 * D, yd + b * T * D + h * hd, D);
        }
    ct_free(tmp);
    return st;
}

/* dy [B, T, D] -> dqkv [B, T, 3D] (every element written). */
static ct_status core_backward(const attn_impl *A, const ct_tensor *qkv, const ct_tensor *P, const uint8_t *mask,
                               const ct_tensor *dy, ct_tensor *dqkv)
{
    int64_t B = qkv->shape[0], T = qkv->shape[1], D = A->dim, H = A->heads, hd = D / H;
    prec pr = {qkv->dtype == CT_BF16};
    size_t es = pr.bf16 ? 2 : 4;
    const char *base = ct_tensor_data(qkv);
    const float *Pd = ct_f32(P);
    float *dq_all = ct_f32(dqkv);
    /* bf16: dy cast once; per head the dropped P and dS in bf16. */
    uint16_t *dyh = pr.bf16 ? ct_alloc((size_t)dy->numel * 2, CT_MEM_ACT) : NULL;
    void *pdrop = ct_alloc((size_t)(T * T) * (es + sizeof(float)), CT_MEM_ACT);
    float *dP = ct_alloc((size_t)(T * T) * sizeof(float), CT_MEM_ACT);
    uint16_t *dSh = pr.bf16 ? ct_alloc((size_t)(T * T) * 2, CT_MEM_ACT) : NULL;
    ct_status st = CT_OK;
    if (!pdrop || !dP || (pr.bf16 && (!dyh || !dSh))) st = CT_ENOMEM;
    if (st == CT_OK && pr.bf16) ct_f32_to_bf16_n(ct_f32(dy), dyh, (size_t)dy->numel);
    const char *dyb = pr.bf16 ? (const char *)dyh : (const char *)ct_f32(dy);
    float scale = 1.0f / sqrtf((float)hd), keep = mask ? 1.0f / (1.0f - A->attn_p) : 1.0f;
    for (int64_t b = 0; b < B && st == CT_OK; b++)
        for (int64_t h = 0; h < H && st == CT_OK; h++) {
            const char *q = base + ((size_t)(b * T * 3 * D + h * hd)) * es;
            const char *k = q + (size_t)D * es, *v = q + (size_t)(2 * D) * es;
            const char *g = dyb + (size_t)(b * T * D + h * hd) * es;
            const float *Pb = Pd + (b * H + h) * T * T;
            const uint8_t *mk = mask ? mask + (b * H + h) * T * T : NULL;
            float *dq = dq_all + b * T * 3 * D + h * hd, *dk = dq + D, *dv = dq + 2 * D;
            const void *pv = Pb;
            if (pr.bf16 || mk) {
                dropped(Pb, mk, A->attn_p, T * T, pr.bf16, pdrop, (float *)((char *)pdrop + (size_t)(T * T) * es));
                pv = pdrop;
            }
            /* dv = Pdrop^T dy; dPdrop = dy v^T */
            st = mm(pr, 1, 0, T, hd, T, 1.0f, pv, T, g, D, dv, 3 * D);
            if (st == CT_OK) st = mm(pr, 0, 1, T, T, hd, 1.0f, g, D, v, 3 * D, dP, T);
            if (st != CT_OK) break;
            /* Through dropout and softmax: dS = P (dP - rowsum(P dP)), times the score scale. */
            for (int64_t i = 0; i < T; i++) {
                float *r = dP + i * T;
                const float *pr_ = Pb + i * T;
                if (mk)
                    for (int64_t j = 0; j <= i; j++) r[j] = mk[i * T + j] ? r[j] * keep : 0.0f;
                float dot = lane_dot(pr_, r, i + 1);
                for (int64_t j = 0; j <= i; j++) r[j] = pr_[j] * (r[j] - dot) * scale;
                for (int64_t j = i + 1; j < T; j++) r[j] = 0.0f;
            }
            const void *ds = dP;
            if (pr.bf16) {
                ct_f32_to_bf16_n(dP, dSh, (size_t)(T * T));
                ds = dSh;
            }
            /* dq = dS k; dk = dS^T q */
            st = mm(pr, 0, 0, T, hd, T, 1.0f, ds, T, k, 3 * D, dq, 3 * D);
            if (st == CT_OK) st = mm(pr, 1, 0, T, hd, T, 1.0f, ds, T, q, 3 * D, dk, 3 * D);
        }
    ct_free(dyh);
    ct_free(pdrop);
    ct_free(dP);
    ct_free(dSh);
    return st;
}

/* The keep-mask of the attention dropout for this call: [B, H, T, T] bytes. */
static void draw_mask(const ct_module *m, const ct_fwd_ctx *ctx, int64_t B, int64_t n, uint8_t *mk)
{
    const attn_impl *A = m->impl;
    uint64_t key = mix64(ctx->seed + mix64(m->rng_stream + mix64(ctx->step)));
    float u[256];
    for (int64_t b = 0; b < B; b++) {
        ct_rng g;
        ct_rng_init(&g, key, (uint64_t)(ctx->sample0 + b));
        for (int64_t j0 = 0; j0 < n; j0 += 256) {
            int64_t c = n - j0 < 256 ? n - j0 : 256;
            ct_rng_uniform(&g, u, (size_t)c);
            for (int64_t j = 0; j < c; j++) mk[b * n + j0 + j] = u[j] >= A->attn_p;
        }
    }
}

/* Saves: 0 qkv (f32 or bf16), 1 P, 2 mask (when dropout is active). */
static ct_status attn_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                              const ct_fwd_ctx *ctx)
{
    const attn_impl *A = m->impl;
    CT_TRY(check_kids(m));
    if (in->dtype != CT_F32 && in->dtype != CT_BF16) /* BF16 from a norm that emits it (ct__takes_bf16) */
        return ct_error(CT_EINVAL, "attention '%s': input is %s; it takes F32 or BF16", nm(m),
                        ct_dtype_name(in->dtype));
    CT_TRY(check_input(m, in->ndim, in->shape));
    int64_t B = in->shape[0], T = in->shape[1], H = A->heads;
    int bf16;
    CT_TRY(ct__param_compute(m->kids[K_C_ATTN], m->kids[K_C_ATTN]->params[0], &bf16));
    ct_record *kr = NULL;
    ct_tensor *qkv32 = NULL, *qkv = NULL, *P = NULL, *mask = NULL, *y = NULL, *z = NULL;
    ct_status st = ct_module_forward(m->kids[K_C_ATTN], in, &qkv32, rec ? &kr : NULL, ctx);
    if (st == CT_OK && rec && (st = ct_record_add_kid(rec, kr)) != CT_OK) ct_record_destroy(kr);
    if (st != CT_OK) return st;
    qkv = bf16 ? ct__tensor_bf16(qkv32) : ct_tensor_retain(qkv32);
    ct_tensor_release(qkv32);
    int64_t ps[4] = {B, H, T, T};
    P = ct_tensor_empty(CT_F32, 4, ps, CT_MEM_ACT);
    int drop = ctx->training && A->attn_p > 0;
    if (drop) mask = ct_tensor_empty(CT_U8, 4, ps, CT_MEM_ACT);
    y = ct_tensor_empty(CT_F32, 3, in->shape, CT_MEM_ACT);
    if (!qkv || !P || !y || (drop && !mask)) st = CT_ENOMEM;
    if (st == CT_OK && drop) draw_mask(m, ctx, B, H * T * T, ct_tensor_data(mask));
    if (st == CT_OK) st = core_forward(A, qkv, P, drop ? ct_tensor_data(mask) : NULL, y);
    if (st == CT_OK && rec &&
        (ct_record_save(rec, qkv) < 0 || ct_record_save(rec, P) < 0 || (drop && ct_record_save(rec, mask) < 0)))
        st = CT_ENOMEM;
    if (rec) rec->ival[0] = drop;
    ct_tensor_release(qkv);
    ct_tensor_release(P);
    ct_tensor_release(mask);
    /* c_proj, then the residual dropout. */
    for (int k = K_C_PROJ; k <= K_RESID_DROP && st == CT_OK; k++) {
        kr = NULL;
        st = ct_module_forward(m->kids[k], y, &z, rec ? &kr : NULL, ctx);
        if (st == CT_OK && rec && (st = ct_record_add_kid(rec, kr)) != CT_OK) {
            ct_record_destroy(kr);
            ct_tensor_release(z);
        }
        ct_tensor_release(y);
        y = st == CT_OK ? z : NULL;
    }
    if (st != CT_OK) {
        ct_tensor_release(y);
        return st;
    }
    *out = y;
    return CT_OK;
}

static ct_status attn_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const attn_impl *A = m->impl;
    CT_TRY(check_kids(m));
    if (rec->nkids != 3)
        return ct_error(CT_ESTATE, "attention '%s': its record has %d child records instead of 3", nm(m),
                        rec->nkids);
    ct_tensor *g = ct_tensor_retain(dout), *gin = NULL;
    ct_status st = CT_OK;
    for (int k = K_RESID_DROP; k >= K_C_PROJ && st == CT_OK; k--) {
        ct_record *kr = rec->kids[k];
        rec->kids[k] = NULL;
        st = ct_module_backward(m->kids[k], g, &gin, kr);
        ct_tensor_release(g);
        g = gin;
        gin = NULL;
    }
    if (st != CT_OK) {
        ct_tensor_release(g);
        return st;
    }
    const ct_tensor *qkv = ct_record_saved(rec, 0), *P = ct_record_saved(rec, 1);
    const uint8_t *mask = rec->ival[0] ? ct_tensor_data(ct_record_saved(rec, 2)) : NULL;
    ct_tensor *dqkv = ct_tensor_empty(CT_F32, 3, qkv->shape, CT_MEM_ACT);
    st = dqkv ? core_backward(A, qkv, P, mask, g, dqkv) : CT_ENOMEM;
    ct_tensor_release(g);
    ct_record *kr = rec->kids[K_C_ATTN];
    rec->kids[K_C_ATTN] = NULL;
    if (st != CT_OK) {
        ct_record_destroy(kr);
        ct_tensor_release(dqkv);
        return st;
    }
    st = ct_module_backward(m->kids[K_C_ATTN], dqkv, din, kr);
    ct_tensor_release(dqkv);
    return st;
}

static ct_status attn_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                int64_t *out_shape)
{
    CT_TRY(check_kids(m));
    CT_TRY(check_input(m, ndim, in_shape));
    return ct_module_out_shape_same(m, ndim, in_shape, out_ndim, out_shape);
}

static void attn_destroy(ct_module *m) { ct_free(m->impl); }

static const ct_module_ops attn_ops = {"attention", attn_forward, attn_backward, attn_destroy, 0,
                                       attn_out_shape};

ct_module *ct_attention_create(int64_t dim, int heads, float attn_p, float resid_p)
{
    if (dim <= 0 || heads <= 0 || dim % heads || dim > INT_MAX / 3) {
        ct_error(CT_EINVAL, "attention needs a width divisible by the number of heads, got dim=%lld heads=%d",
                 (long long)dim, heads);
        return NULL;
    }
    if (!(attn_p >= 0.0f && attn_p < 1.0f)) {
        ct_error(CT_EINVAL, "attention dropout probability %g must be in [0, 1)", (double)attn_p);
        return NULL;
    }
    attn_impl *A = ct_alloc(sizeof *A, CT_MEM_OTHER);
    if (!A) return NULL;
    *A = (attn_impl){dim, heads, attn_p};
    ct_module *m = ct_module_create(&attn_ops, A);
    if (!m) {
        ct_free(A);
        return NULL;
    }
    if (ct_module_add(m, "c_attn", ct_linear_create(dim, 3 * dim, 1)) != CT_OK ||
        ct_module_add(m, "c_proj", ct_linear_create(dim, dim, 1)) != CT_OK ||
        ct_module_add(m, "resid_dropout", ct_dropout_create(resid_p)) != CT_OK) {
        ct_module_destroy(m);
        return NULL;
    }
    return m;
}

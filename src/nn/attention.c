/*
 * Causal self-attention as nanoGPT's CausalSelfAttention: a fused QKV
 * projection c_attn (Linear(D, 3D)), scaled dot-product attention per head
 * with the causal mask (position t sees positions 0..t only), dropout on the
 * attention probabilities, the output projection c_proj (Linear(D, D)) and
 * resid_dropout.  c_attn, c_proj and resid_dropout are children, so their
 * parameters are "attn.c_attn.weight" ... as in nanoGPT's state_dict, and
 * strategies see them as ordinary linear layers.
 *
 * The core between the projections (q k^T, the causal softmax, dropout, P v
 * and their gradients) runs per (sample, head) on views of qkv [B, T, 3D]
 * (q, k, v of head h are columns h*hd, D + h*hd, 2D + h*hd, each hd wide, row
 * stride 3D) and never computes the masked half: query rows go in blocks,
 * each against the keys up to its last row only.  Two paths:
 * - bf16 (c_attn's weight has a bf16 compute copy), on CPUs with AVX512_BF16
 *   and hd a multiple of 16: the kernels of attn_bf16.c, 16-row tiles with
 *   every step fused, no library call (a oneDNN call costs as much as one of
 *   these small products: this path ran a 12 x 768 GPT's attention 11x
 *   faster than the portable one on an AMX CPU), their products on AMX
 *   tiles where the CPU has them (attn_amx.c).  They write y as BF16 when
 *   c_proj casts its input to bf16 anyway.
 * - portable (f32; bf16 elsewhere, or with CTRAIN_ATTN_PORTABLE=1, which the
 *   tests use to hold the two against each other): blocks of PB rows through
 *   ct_gemm_f32 / ct_gemm_bf16, softmax and its gradient in f32 between.
 * The record keeps qkv (or its bf16 cast), P before dropout in the products'
 * precision (bf16 P is what P v multiplies, and what the gradient of the
 * softmax reads back, widened), lower blocks only, and the dropout's mask.
 * With dropout the dropped bf16 P is rne(P_bf16 * 1/(1-p)) on both paths.
 *
 * Attention dropout draws element (h, i, j) of sample b from the Philox
 * stream keyed by (seed, step, this module's stream) at counter (sample0 + b,
 * h*T*T + i*T + j), like ct_dropout_create: any split of the global batch
 * over ranks and micro-batches draws the masks one process would.
 */
#include <limits.h>
#include <math.h>
#include <stdlib.h>

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

/* Softmax of score row r over its first n entries (the positions row n-1
 * sees), in place; zeros in [n, w). */
static void softmax_row(float *r, int64_t n, int64_t w)
{
    float mx = lane_max(r, n);
    for (int64_t j = 0; j < n; j++) r[j] = ct__expf(r[j] - mx);
    float inv = 1.0f / lane_sum(r, n);
    for (int64_t j = 0; j < n; j++) r[j] *= inv;
    for (int64_t j = n; j < w; j++) r[j] = 0.0f;
}

/* Products of the portable path on either precision: operands are f32
 * pointers or bf16 bits; the product's output is f32. */
typedef struct {
    int bf16;
} prec;

static ct_status mm(prec p, int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const void *a,
                    int64_t lda, const void *b, int64_t ldb, float *c, int64_t ldc)
{
    if (p.bf16)
        return ct_gemm_bf16(ta, tb, (int)M, (int)N, (int)K, alpha, a, (int)lda, b, (int)ldb, 0.0f, c, (int)ldc);
    /* OpenBLAS at any thread count: (sample, head) pairs run side by side
     * on the rank's threads, and the engine must not depend on how many */
    return ct_gemm_f32(CT_GEMM_OPENBLAS, ta, tb, (int)M, (int)N, (int)K, alpha, a, (int)lda, b, (int)ldb, 0.0f, c,
                       (int)ldc);
}

/* Rows per block of the portable path: a block's products stop at its last
 * row's keys (blocks of 64 of 128 rows skip a quarter of the work for a few
 * more oneDNN calls of ~0.6 us each). */
#define PB 64

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Elements of P per (sample, head) in the portable layout: the rows of row
 * block i0 (min(PB, T - i0) of them) are min(T, i0 + PB) wide, blocks one
 * after another. */
static int64_t portable_pnumel(int64_t T)
{
    int64_t n = 0;
    for (int64_t i0 = 0; i0 < T; i0 += PB) n += (min64(T, i0 + PB) - i0) * min64(T, i0 + PB);
    return n;
}

/* The dropped probabilities of n entries of one row into out (f32, or bf16
 * bits when bf16; f32 P is then the bf16 P widened, so pd = rne(P*keep) as
 * the kernel makes it): P * keep where kept, 0 elsewhere; tmp holds n f32. */
static void drop_row(const float *P, const uint8_t *mrow, float keep, int64_t n, int bf16, void *out, float *tmp)
{
    float *o = bf16 ? tmp : out;
    for (int64_t j = 0; j < n; j++) o[j] = mrow[j] ? P[j] * keep : 0.0f;
    if (bf16) ct_f32_to_bf16_n(o, out, (size_t)n);
}

/* Row i of a block of the record's P (w wide) as f32: a pointer into it when
 * it is f32, else widened into tmp. */
static const float *p_row(prec pr, const char *blk, int64_t i, int64_t w, float *tmp)
{
    if (!pr.bf16) return (const float *)(const void *)blk + i * w;
    ct_bf16_to_f32_n((const uint16_t *)(const void *)blk + i * w, tmp, (size_t)w);
    return tmp;
}

typedef struct {
    int64_t B, T, D, H, hd;
    float scale, keep;
    const uint8_t *mask; /* [B, H, T, T] keep-bytes or NULL */
} core_dims;

static core_dims dims_of(const attn_impl *A, const ct_tensor *qkv, const uint8_t *mask)
{
    int64_t hd = A->dim / A->heads;
    return (core_dims){qkv->shape[0], qkv->shape[1], A->dim, A->heads, hd, 1.0f / sqrtf((float)hd),
                       mask ? 1.0f / (1.0f - A->attn_p) : 1.0f, mask};
}

/* One call of the portable path over (sample, head) pairs [lo, hi): the
 * pairs write disjoint parts of P, y and dqkv, so f32 runs them on the
 * rank's threads (bf16 products go through oneDNN, which runs one at a
 * time: bf16 stays on one thread here). */
typedef struct {
    const core_dims *c;
    const ct_tensor *qkv, *P;
    const void *dy;
    float *y;     /* forward's output */
    float *dqkv;  /* backward's output */
    ct_status st; /* the first failure of any range */
} portable_job;

/* Records a range's failure (the first one wins; the message is that thread's). */
static void job_fail(portable_job *j, ct_status st)
{
    if (st == CT_OK) return;
#pragma omp critical(ct_attn_portable)
    if (j->st == CT_OK) j->st = st;
}

/* Portable: qkv [B, T, 3D] (f32 or bf16) -> y [B, T, D] f32 for pairs
 * [lo, hi); P (in qkv's precision, portable_pnumel(T) per (sample, head))
 * receives the probabilities. */
static void portable_forward_pairs(void *ctx, int64_t lo, int64_t hi)
{
    portable_job *j = ctx;
    const core_dims *c = j->c;
    const ct_tensor *qkv = j->qkv, *P = j->P;
    float *y = j->y;
    int64_t T = c->T, D = c->D, hd = c->hd, pn = portable_pnumel(T);
    prec pr = {qkv->dtype == CT_BF16};
    size_t es = pr.bf16 ? 2 : 4;
    const char *base = ct_tensor_data(qkv);
    /* f32 scores of a row block (bf16: P is cast from them), its dropped P, an f32 row. */
    char *tmp = ct_alloc((size_t)(PB * T) * (4 + es) + (size_t)T * 4, CT_MEM_ACT);
    if (!tmp) {
        job_fail(j, CT_ENOMEM);
        return;
    }
    float *sc = (float *)(void *)tmp, *row = sc + PB * T;
    char *pd = (char *)(row + T);
    ct_status st = CT_OK;
    for (int64_t bh = lo; bh < hi && st == CT_OK; bh++) {
        int64_t b = bh / c->H, h = bh % c->H;
        const char *q = base + ((size_t)(b * T * 3 * D + h * hd)) * es;
        const char *k = q + (size_t)D * es, *v = q + (size_t)(2 * D) * es;
        const uint8_t *mk = c->mask ? c->mask + (b * c->H + h) * T * T : NULL;
        char *blk = (char *)ct_tensor_data(P) + (size_t)((b * c->H + h) * pn) * es;
        for (int64_t i0 = 0; i0 < T && st == CT_OK; i0 += PB) {
            int64_t m = min64(PB, T - i0), w = i0 + m;
            float *S = pr.bf16 ? sc : (float *)(void *)blk;
            st = mm(pr, 0, 1, m, w, hd, c->scale, q + (size_t)(i0 * 3 * D) * es, 3 * D, k, 3 * D, S, w);
            if (st != CT_OK) break;
            for (int64_t l = 0; l < m; l++) softmax_row(S + l * w, i0 + l + 1, w);
            if (pr.bf16) ct_f32_to_bf16_n(S, (uint16_t *)(void *)blk, (size_t)(m * w));
            const void *pv = blk;
            if (mk) {
                for (int64_t l = 0; l < m; l++)
                    drop_row(p_row(pr, blk, l, w, row), mk + (i0 + l) * T, c->keep, w, pr.bf16,
                             pd + (size_t)(l * w) * es, sc + l * w);
                pv = pd;
            }
            st = mm(pr, 0, 0, m, hd, w, 1.0f, pv, w, v, 3 * D, y + (b * T + i0) * D + h * hd, D);
            blk += (size_t)(m * w) * es;
        }
    }
    ct_free(tmp);
    job_fail(j, st);
}

/* Portable: dy [B, T, D] (f32, or its bf16 cast) -> dqkv [B, T, 3D] (every
 * element written) for pairs [lo, hi). */
static void portable_backward_pairs(void *ctx, int64_t lo, int64_t hi)
{
    portable_job *job = ctx;
    const core_dims *c = job->c;
    const ct_tensor *qkv = job->qkv, *P = job->P;
    float *dqkv = job->dqkv;
    int64_t T = c->T, D = c->D, hd = c->hd, pn = portable_pnumel(T);
    float keep = c->keep, scale = c->scale; /* locals: stores through float pointers cannot change them */
    prec pr = {qkv->dtype == CT_BF16};
    size_t es = pr.bf16 ? 2 : 4;
    const char *base = ct_tensor_data(qkv), *dyb = job->dy;
    /* dS and Pd [T, T] in the products' precision (row blocks' widths only),
     * bf16: dP of a row block in f32 (f32: dP becomes dS in place), two f32 rows. */
    char *tmp = ct_alloc((size_t)(T * T) * 2 * es + (size_t)(PB * T + 2 * T) * 4, CT_MEM_ACT);
    if (!tmp) {
        job_fail(job, CT_ENOMEM);
        return;
    }
    char *dS = tmp, *Pd = tmp + (size_t)(T * T) * es;
    float *dP = (float *)(void *)(Pd + (size_t)(T * T) * es), *row = dP + PB * T, *row2 = row + T;
    ct_status st = CT_OK;
    for (int64_t bh = lo; bh < hi && st == CT_OK; bh++) {
        int64_t b = bh / c->H, h = bh % c->H;
        const char *q = base + ((size_t)(b * T * 3 * D + h * hd)) * es;
        const char *k = q + (size_t)D * es, *v = q + (size_t)(2 * D) * es;
        const char *g = dyb + (size_t)(b * T * D + h * hd) * es;
        const uint8_t *mk = c->mask ? c->mask + (b * c->H + h) * T * T : NULL;
        const char *blk = (const char *)ct_tensor_data(P) + (size_t)((b * c->H + h) * pn) * es;
        float *dq = dqkv + b * T * 3 * D + h * hd, *dk = dq + D, *dv = dq + 2 * D;
        for (int64_t i0 = 0; i0 < T && st == CT_OK; i0 += PB) {
            int64_t m = min64(PB, T - i0), w = i0 + m;
            /* dPd = dy v^T; through dropout and softmax: dS = P (dP - rowsum(P dP)) * scale. */
            int64_t ldp = pr.bf16 ? w : T;
            float *dPb = pr.bf16 ? dP : (float *)(void *)dS + i0 * T;
            st = mm(pr, 0, 1, m, w, hd, 1.0f, g + (size_t)(i0 * D) * es, D, v, 3 * D, dPb, ldp);
            if (st != CT_OK) break;
            for (int64_t l = 0; l < m; l++) {
                int64_t i = i0 + l;
                const float *p = p_row(pr, blk, l, w, row);
                float *r = dPb + l * ldp;
                char *pdo = Pd + (size_t)(i * T) * es;
                if (mk) {
                    for (int64_t j = 0; j <= i; j++) r[j] = mk[i * T + j] ? r[j] * keep : 0.0f;
                    drop_row(p, mk + i * T, keep, w, pr.bf16, pdo, row2);
                } else {
                    memcpy(pdo, blk + (size_t)(l * w) * es, (size_t)w * es);
                }
                float dot = lane_dot(p, r, i + 1);
                for (int64_t j = 0; j <= i; j++) r[j] = p[j] * (r[j] - dot) * scale;
                for (int64_t j = i + 1; j < w; j++) r[j] = 0.0f;
                if (pr.bf16) ct_f32_to_bf16_n(r, (uint16_t *)(void *)(dS + (size_t)(i * T) * es), (size_t)w);
            }
            /* dq = dS k */
            st = mm(pr, 0, 0, m, hd, w, 1.0f, dS + (size_t)(i0 * T) * es, T, k, 3 * D, dq + i0 * 3 * D, 3 * D);
            blk += (size_t)(m * w) * es;
        }
        /* Column block j0: dv = Pd^T dy, dk = dS^T q over rows i >= j0. */
        for (int64_t j0 = 0; j0 < T && st == CT_OK; j0 += PB) {
            int64_t n = min64(PB, T - j0), K = T - j0;
            size_t at = (size_t)(j0 * T + j0) * es;
            st = mm(pr, 1, 0, n, hd, K, 1.0f, Pd + at, T, g + (size_t)(j0 * D) * es, D, dv + j0 * 3 * D,
                    3 * D);
            if (st == CT_OK)
                st = mm(pr, 1, 0, n, hd, K, 1.0f, dS + at, T, q + (size_t)(j0 * 3 * D) * es, 3 * D,
                        dk + j0 * 3 * D, 3 * D);
        }
    }
    ct_free(tmp);
    job_fail(job, st);
}

/* Pairs per thread below which the portable path stays on one thread. */
#define PAIR_GRAIN 2

static ct_status portable_run(const core_dims *c, const ct_tensor *qkv, const ct_tensor *P, const void *dy,
                              float *y, float *dqkv)
{
    portable_job j = {c, qkv, P, dy, y, dqkv, CT_OK};
    ct_range_fn fn = y ? portable_forward_pairs : portable_backward_pairs;
    if (qkv->dtype == CT_BF16) fn(&j, 0, c->B * c->H);
    else ct_parallel_for(c->B * c->H, PAIR_GRAIN, fn, &j);
    return j.st;
}

static ct_status portable_forward(const core_dims *c, const ct_tensor *qkv, ct_tensor *P, float *y)
{
    return portable_run(c, qkv, P, NULL, y, NULL);
}

static ct_status portable_backward(const core_dims *c, const ct_tensor *qkv, const ct_tensor *P, const void *dy,
                                   float *dqkv)
{
    return portable_run(c, qkv, P, dy, NULL, dqkv);
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

/* 1 when the AVX512_BF16 kernels run this bf16 core: the CPU has them, the
 * head width suits them and CTRAIN_ATTN_PORTABLE is unset (tests set it to
 * hold the kernels against the portable path). */
static int use_kernels(const attn_impl *A)
{
    const char *e = getenv("CTRAIN_ATTN_PORTABLE");
    return ct__attn_bf16_usable(A->dim / A->heads) && !(e && *e && strcmp(e, "0"));
}

/* The core: qkv -> P (allocated here) and y (allocated here: BF16 when the
 * kernels run and c_proj casts its input to bf16 anyway, else F32). */
static ct_status core_forward(const ct_module *m, const ct_tensor *qkv, const uint8_t *mask, int kern,
                              ct_tensor **P, ct_tensor **y)
{
    const attn_impl *A = m->impl;
    core_dims c = dims_of(A, qkv, mask);
    int y_bf16 = kern && ct__takes_bf16(m->kids[K_C_PROJ]);
    int64_t ps[3] = {c.B, c.H, kern ? 2 * ct__attn_bf16_pwords(c.T) : portable_pnumel(c.T)};
    int64_t ys[3] = {c.B, c.T, c.D};
    *P = ct_tensor_empty(kern ? CT_BF16 : qkv->dtype, 3, ps, CT_MEM_ACT);
    *y = ct_tensor_empty(y_bf16 ? CT_BF16 : CT_F32, 3, ys, CT_MEM_ACT);
    if (!*P || !*y) return CT_ENOMEM;
    if (!kern) return portable_forward(&c, qkv, *P, ct_f32(*y));
    ct__attn_dims d = {c.B, c.T, c.D, c.H, A->attn_p};
    return ct__attn_bf16_forward(&d, ct_tensor_data(qkv), mask, ct_tensor_data(*P), ct_tensor_data(*y), y_bf16);
}

/* dy [B, T, D] f32 -> dqkv [B, T, 3D] on the path forward took: f32, or
 * from the kernels a bf16 gradient with column sums (ct__grad_bf16). */
static ct_status core_backward(const attn_impl *A, const ct_tensor *qkv, const ct_tensor *P, const uint8_t *mask,
                               int kern, const ct_tensor *dy, ct_tensor *dqkv)
{
    core_dims c = dims_of(A, qkv, mask);
    if (kern) {
        ct__attn_dims d = {c.B, c.T, c.D, c.H, A->attn_p};
        return ct__attn_bf16_backward(&d, ct_tensor_data(qkv), mask, ct_tensor_data(P), ct_f32(dy),
                                      ct_tensor_data(dqkv), ct__grad_bf16_colsum(dqkv));
    }
    if (qkv->dtype != CT_BF16) return portable_backward(&c, qkv, P, ct_f32(dy), ct_f32(dqkv));
    uint16_t *dyh = ct_alloc((size_t)dy->numel * 2, CT_MEM_ACT); /* dy cast once for every head */
    if (!dyh) return CT_ENOMEM;
    ct_f32_to_bf16_n(ct_f32(dy), dyh, (size_t)dy->numel);
    ct_status st = portable_backward(&c, qkv, P, dyh, ct_f32(dqkv));
    ct_free(dyh);
    return st;
}

/* Saves: 0 qkv (f32 or bf16), 1 P, 2 mask (when dropout is active);
 * ival[0] dropout on, ival[1] the kernels ran. */
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
    /* kind only: c_attn may be a unit of its own (FSDP), released until its own forward */
    CT_TRY(ct__param_compute_kind(m->kids[K_C_ATTN], m->kids[K_C_ATTN]->params[0], &bf16));
    ct_record *kr = NULL;
    ct_tensor *qkv32 = NULL, *qkv = NULL, *P = NULL, *mask = NULL, *y = NULL, *z = NULL;
    m->kids[K_C_ATTN]->emit_bf16 = bf16; /* the bf16 core casts qkv first: c_attn may store it so */
    ct_status st = ct_module_forward(m->kids[K_C_ATTN], in, &qkv32, rec ? &kr : NULL, ctx);
    if (st == CT_OK && rec && (st = ct_record_add_kid(rec, kr)) != CT_OK) ct_record_destroy(kr);
    if (st != CT_OK) return st;
    qkv = bf16 ? ct__tensor_bf16(qkv32) : ct_tensor_retain(qkv32);
    ct_tensor_release(qkv32);
    int drop = ctx->training && A->attn_p > 0, kern = bf16 && use_kernels(A);
    if (drop) mask = ct_tensor_empty(CT_U8, 4, (int64_t[]){B, H, T, T}, CT_MEM_ACT);
    if (!qkv || (drop && !mask)) st = CT_ENOMEM;
    if (st == CT_OK && drop) draw_mask(m, ctx, B, H * T * T, ct_tensor_data(mask));
    double t0 = ct_ledger_begin();
    if (st == CT_OK) st = core_forward(m, qkv, drop ? ct_tensor_data(mask) : NULL, kern, &P, &y);
    ct_ledger_end(CT_LEDGER_ATTENTION, t0);
    if (st == CT_OK && rec &&
        (ct_record_save(rec, qkv) < 0 || ct_record_save(rec, P) < 0 || (drop && ct_record_save(rec, mask) < 0)))
        st = CT_ENOMEM;
    if (rec) {
        rec->ival[0] = drop;
        rec->ival[1] = kern;
    }
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
    ct_record *kr = rec->kids[K_C_ATTN];
    /* The kernels hand a bf16 c_attn its gradient as bf16 with column sums. */
    int kern = (int)rec->ival[1], emit = kern && ct__takes_bf16_grad(m->kids[K_C_ATTN], kr);
    ct_tensor *dqkv = emit ? ct__grad_bf16_create(3, qkv->shape) : ct_tensor_empty(CT_F32, 3, qkv->shape, CT_MEM_ACT);
    double t0 = ct_ledger_begin();
    st = dqkv ? core_backward(A, qkv, P, mask, kern, g, dqkv) : CT_ENOMEM;
    ct_ledger_end(CT_LEDGER_ATTENTION, t0);
    ct_tensor_release(g);
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

const char *ct_attention_bf16_path(int64_t head_dim)
{
    attn_impl A = {head_dim, 1, 0.0f};
    if (!use_kernels(&A)) return "portable, oneDNN products";
    return ct__attn_amx_usable() ? "ctrain kernels on AMX tiles" : "ctrain avx512bf16 kernels";
}

int64_t ct_attention_saved_bytes(int64_t batch, int64_t T, int64_t dim, int heads, int bf16, int dropout)
{
    attn_impl A = {dim, heads, 0.0f};
    int64_t es = bf16 ? 2 : 4, P = bf16 && use_kernels(&A) ? 4 * ct__attn_bf16_pwords(T) : es * portable_pnumel(T);
    return batch * T * 3 * dim * es + batch * heads * (P + (dropout ? T * T : 0));
}

static ct_status attn_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                int64_t *out_shape)
{
    CT_TRY(check_kids(m));
    CT_TRY(check_input(m, ndim, in_shape));
    return ct_module_out_shape_same(m, ndim, in_shape, out_ndim, out_shape);
}

static void attn_destroy(ct_module *m) { ct_free(m->impl); }

/* x [B,T,D]: c_attn keeps x (or its bf16 cast), the core what
 * ct_attention_saved_bytes says, c_proj its input (bf16 under mixed),
 * resid_dropout a byte mask.  Scratch: qkv in f32 before its cast and the
 * per-head scores forward, dqkv and the scores' gradients backward. */
static ct_status attn_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)need_dx;
    CT_TRY(check_kids(m));
    CT_TRY(check_input(m, nd, sh));
    const attn_impl *a = m->impl;
    int bf16 = mixed && ct__act_has_copy(m->kids[K_C_ATTN]), rdrop = ct__dropout_p(m->kids[K_RESID_DROP]) > 0;
    uint64_t B = (uint64_t)sh[0], T = (uint64_t)sh[1], D = (uint64_t)sh[2], BTD = B * T * D;
    c->keep_in = !bf16;
    c->saved = (bf16 ? BTD * 2 : 0) + BTD * (bf16 ? 2 : 4) /* c_proj's input */ + (rdrop ? BTD : 0) +
               (uint64_t)ct_attention_saved_bytes((int64_t)B, (int64_t)T, (int64_t)D, a->heads, bf16, a->attn_p > 0);
    c->fwd_tmp = 3 * BTD * 4 + T * T * 8;
    c->bwd_tmp = 3 * BTD * 4 + T * T * 12;
    return CT_OK;
}

static const ct_module_ops attn_ops = {"attention", attn_forward, attn_backward, attn_destroy, 0,
                                       attn_out_shape, attn_act_cost, 0};

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

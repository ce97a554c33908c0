/*
 * What the layers of src/nn share privately: the bf16 compute path.  A layer
 * computes its products in bf16 (oneDNN, f32 accumulation) when its weight
 * has a bf16 compute copy (ct_param.compute) or its input is bf16; the
 * decision is made by what the layer is given, so src/nn holds no policy.
 * And a shape-only tensor header for the out_shape ops.
 */
#ifndef CTRAIN_NN_INTERNAL_H
#define CTRAIN_NN_INTERNAL_H

#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "ctrain/nn.h"

/* Name of m for messages ("(root)" for an unnamed root). */
static inline const char *ct__nn_name(const ct_module *m)
{
    return m->fqn && *m->fqn ? m->fqn : "(root)";
}

/* 1 while ct_module_shape_only is on for this thread. */
int ct__nn_shape_only(void);
/* PyTorch's default for a layer with fan_in inputs per output (Linear,
 * Conv2d): every parameter of m U(-1/sqrt(fan_in), 1/sqrt(fan_in)). */
void ct__init_fan_in(ct_module *m, int64_t fan_in);

/* ---- act_cost helpers (see ct_act_cost) ---- */
/* Elements of a shape. */
static inline uint64_t ct__act_numel(int nd, const int64_t *sh)
{
    uint64_t n = 1;
    for (int i = 0; i < nd; i++) n *= (uint64_t)sh[i];
    return n;
}
/* Elements of m's output for an input of in_shape (0 on a shape m rejects). */
uint64_t ct__act_out_numel(ct_module *m, int nd, const int64_t *sh);
/* 1 if m's weight (its first parameter) takes a bf16 compute copy when the
 * run is mixed: a trainable f32 matrix (the layer side of the policy). */
int ct__act_has_copy(const ct_module *m);
/* An act_cost for containers whose children run one after another. */
ct_status ct__act_cost_walk(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c);
/* The dropout probability of a dropout module (0 for any other). */
float ct__dropout_p(const ct_module *m);
/* The set of live records (record_live.c): add (0 when out of memory), is
 * it live, and take it out (0 if it was not there: freed already). */
int ct__record_live_add(const void *rec);
int ct__record_live(const void *rec);
int ct__record_live_take(const void *rec);

/* Checks p's compute copy: NULL or a BF16 tensor of data's shape with
 * memory.  *bf16 = 1 when there is one.  The error names the layer and says
 * how to make the copy. */
ct_status ct__param_compute(const ct_module *m, const ct_param *p, int *bf16);
/* The same without the memory: for a parent deciding before the child's
 * forward, whose pre-forward hooks bring the memory back (FSDP: the child a
 * unit of its own, its compute copy released until then). */
ct_status ct__param_compute_kind(const ct_module *m, const ct_param *p, int *bf16);

/* p's weight as bf16 bits: its compute copy, or else a cast of p->data
 * into a new block stored in *tmp (ct_free it; NULL when not needed). */
ct_status ct__param_bf16(const ct_param *p, const uint16_t **w, uint16_t **tmp);

/* t as a BF16 tensor: t itself retained when it is BF16, else a new cast of
 * its F32 data (CT_MEM_ACT). */
ct_tensor *ct__tensor_bf16(ct_tensor *t);

/* 1 if m's forward casts its input to bf16 before anything reads it (a
 * linear, or a container whose first layer is one, whose weight has a bf16
 * compute copy): its producer may then emit BF16 (ct_module.emit_bf16). */
int ct__takes_bf16(const ct_module *m);

/* Input gradients in bf16 (ct_module.emit_bf16_grad).  A bf16 linear casts
 * its output gradient to bf16 and sums its columns for the bias gradient; a
 * producer that knows this (GELU, the attention core) hands it both at once:
 * a BF16 tensor whose storage also holds the f32 column sums (the last dim,
 * over all rows, from 0, in row order: the sums of the values before
 * rounding, which the linear cannot get back from the bf16 ones).
 * ct__grad_bf16_create makes one (sums 0); ct__grad_bf16_put casts n values
 * starting at flat index at into it and adds them to the sums, so puts in
 * increasing row order sum as the linear's own pass would;
 * ct__grad_bf16_colsum returns the sums, or NULL for any other tensor. */
ct_tensor *ct__grad_bf16_create(int ndim, const int64_t *shape);
void ct__grad_bf16_put(ct_tensor *g, int64_t at, const float *x, int64_t n);
float *ct__grad_bf16_colsum(const ct_tensor *g);

/* 1 if m, whose forward made record r, takes its output gradient as bf16
 * with column sums (a linear whose forward took the bf16 path): its
 * producer may then emit it so (ct_module.emit_bf16_grad). */
int ct__takes_bf16_grad(const ct_module *m, const ct_record *r);

/* The causal attention core's AVX512_BF16 kernels (attn_bf16.c; attention.c
 * holds the layer and the portable path).  qkv [B, T, 3D] bf16; mask the
 * dropout's keep-bytes [B, H, T, T] or NULL (then attn_p is not read). */
typedef struct {
    int64_t B, T, D, H;
    float attn_p;
} ct__attn_dims;

/* 1 when the CPU has AVX512_BF16 and the head width hd is a multiple of 16. */
int ct__attn_bf16_usable(int64_t hd);
/* 32-bit words of P the forward keeps per (sample, head) (its layout: attn_bf16.c). */
int64_t ct__attn_bf16_pwords(int64_t T);
/* -> P (B*H*ct__attn_bf16_pwords(T) words, all written; 64-byte aligned, as
 * ct_alloc's blocks are) and y [B, T, D], F32 or, if y_bf16, BF16 rounded as
 * ct_f32_to_bf16. */
ct_status ct__attn_bf16_forward(const ct__attn_dims *a, const uint16_t *qkv, const uint8_t *mask, uint16_t *P,
                                void *y, int y_bf16);
/* dy [B, T, D] f32 -> dqkv [B, T, 3D], every element written: f32, or with
 * colsum bf16 rounded as ct_f32_to_bf16, its columns summed into colsum [3D]
 * in row order (a gradient of ct__grad_bf16_create's). */
ct_status ct__attn_bf16_backward(const ct__attn_dims *a, const uint16_t *qkv, const uint8_t *mask,
                                 const uint16_t *P, const float *dy, void *dqkv, float *colsum);

/* Those kernels' products on AMX tiles (attn_amx.c).  1 when the CPU has AMX
 * (under CTRAIN_ISA's cap) and Linux granted this process its tiles. */
int ct__attn_amx_usable(void);
/* Load this thread's tile shapes for ct__attn_amx_product; release them. */
void ct__attn_amx_begin(void);
void ct__attn_amx_end(void);
/* C[M][ncol] f32 (ldc apart, rows [0, mrows) stored) = A . B over kp pair
 * words: A's rows of words as apart, B's rows of ncol words ldb apart, pair
 * words as attn_bf16.c packs them.  M and ncol multiples of 16, kp of 8. */
void ct__attn_amx_product(int64_t M, int64_t ncol, int64_t kp, const uint32_t *a, ptrdiff_t as, const uint32_t *b,
                          ptrdiff_t ldb, float *c, ptrdiff_t ldc, int64_t mrows);

/* Branch-free expf and erff that compilers vectorise (libm's are calls per
 * element: 20% of a GPT step went to erff and expf).  ct__expf: Cephes'
 * range reduction and polynomial, within 2 ulp of expf on [-87, 88] (inputs
 * are clamped there: 0 below is 1e-38, never a subnormal).  ct__erff:
 * Eigen's rational approximation on [-4, 4] (erf is +-1 in f32 beyond),
 * within 4.5e-7 of erf (4 ulp of 1; libm's erff: 5e-8); tests/test_gpt_layers.c
 * holds both to it (fast_expf_and_erff_are_accurate). */
static inline float ct__expf(float x)
{
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = __builtin_fmaf(n, -0.693359375f, x);
    r = __builtin_fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    p = __builtin_fmaf(p, r * r, r) + 1.0f;
    union {
        uint32_t u;
        float f;
    } s;
    s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

static inline float ct__erff(float x)
{
    x = x < -4.0f ? -4.0f : x > 4.0f ? 4.0f : x;
    float x2 = x * x;
    float p = __builtin_fmaf(x2, -2.72614225801306e-10f, 2.77068142495902e-08f);
    p = __builtin_fmaf(x2, p, -2.10102402082508e-06f);
    p = __builtin_fmaf(x2, p, -5.69250639462346e-05f);
    p = __builtin_fmaf(x2, p, -7.34990630326855e-04f);
    p = __builtin_fmaf(x2, p, -2.95459980854025e-03f);
    p = __builtin_fmaf(x2, p, -1.60960333262415e-02f);
    p *= x;
    float q = __builtin_fmaf(x2, -1.45660718464996e-05f, -2.13374055278905e-04f);
    q = __builtin_fmaf(x2, q, -1.68282697438203e-03f);
    q = __builtin_fmaf(x2, q, -7.37332916720468e-03f);
    q = __builtin_fmaf(x2, q, -1.42647390514189e-02f);
    return p / q;
}

#if defined(__AVX512F__)
/* ct__expf and ct__erff on 16 lanes, operation for operation, so the same
 * values bit for bit (tests/test_gpt_layers.c compares them): GCC turns the
 * scalar clamps into mask juggling, where MAXPS(lo, x) and MINPS(hi, x) are
 * exactly x < lo ? lo : x and x > hi ? hi : x, nan included.  GELU's
 * loops, bound by vector ALU throughput, run 13% faster on them. */
static inline __m512 ct__expf16(__m512 x)
{
#define K_(c) _mm512_set1_ps(c)
    x = _mm512_min_ps(K_(88.0f), _mm512_max_ps(K_(-87.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, K_(1.44269504088896341f)), _MM_FROUND_CUR_DIRECTION);
    __m512 r = _mm512_fmadd_ps(n, K_(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, K_(2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(K_(1.9875691500e-4f), r, K_(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, K_(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, K_(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, K_(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, K_(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), K_(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __m512 ct__erff16(__m512 x)
{
    x = _mm512_min_ps(K_(4.0f), _mm512_max_ps(K_(-4.0f), x));
    __m512 x2 = _mm512_mul_ps(x, x);
    __m512 p = _mm512_fmadd_ps(x2, K_(-2.72614225801306e-10f), K_(2.77068142495902e-08f));
    p = _mm512_fmadd_ps(x2, p, K_(-2.10102402082508e-06f));
    p = _mm512_fmadd_ps(x2, p, K_(-5.69250639462346e-05f));
    p = _mm512_fmadd_ps(x2, p, K_(-7.34990630326855e-04f));
    p = _mm512_fmadd_ps(x2, p, K_(-2.95459980854025e-03f));
    p = _mm512_fmadd_ps(x2, p, K_(-1.60960333262415e-02f));
    p = _mm512_mul_ps(p, x);
    __m512 q = _mm512_fmadd_ps(x2, K_(-1.45660718464996e-05f), K_(-2.13374055278905e-04f));
    q = _mm512_fmadd_ps(x2, q, K_(-1.68282697438203e-03f));
    q = _mm512_fmadd_ps(x2, q, K_(-7.37332916720468e-03f));
    q = _mm512_fmadd_ps(x2, q, K_(-1.42647390514189e-02f));
    return _mm512_div_ps(p, q);
#undef K_
}
#endif

/* Chunk of the buffer in which layers that emit BF16 (ct_module.emit_bf16)
 * make their f32 outputs, to cast them with ct_f32_to_bf16_n while in L1
 * (floats): 2 KiB. */
enum { CT__EMIT_CHUNK = 512 };

/* The bits of 2^(i/32) minus i << 47, i < 32: adding k << 47 to entry k % 32
 * gives 2^(k/32) for the k of ct__expf_libm (glibc's __exp2f_data.tab). */
static inline const uint64_t *ct__exp2_32(void)
{
    static const uint64_t tab[32] = {
        0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
        0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
        0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
        0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
        0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
        0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
        0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
        0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
    };
    return tab;
}

/* expf exactly as glibc computes it (sysdeps/ieee754/flt-32/e_expf.c, from
 * Arm's optimized-routines, built for FMA CPUs: __expf_fma) for |x| < 88,
 * where glibc takes no special case: x = (k + r) ln2 / 32 with k rounded to
 * even, exp(x) = 2^(k/32) 2^(r/32), the first from the table, the second a
 * cubic, all in double with glibc's operations and fusings, so the value is
 * libm's bit for bit (tests/test_gpt_layers.c checks it) without a call per
 * element.  The cross-entropy uses it: its values are what every loss so far
 * was made of.  Outside |x| < 88 (and for nan) call expf. */
static inline float ct__expf_libm(float x)
{
    const double inv_ln2_32 = 0x1.71547652b82fep+5, shift = 0x1.8p+52;
    const double c0 = 0x1.c6af84b912394p-20, c1 = 0x1.ebfce50fac4f3p-13, c2 = 0x1.62e42ff0c52d6p-6;
    double xd = x, kd = __builtin_fma(inv_ln2_32, xd, shift), r, s;
    uint64_t ki, t;
    memcpy(&ki, &kd, sizeof ki);
    kd -= shift;
    r = __builtin_fma(inv_ln2_32, xd, -kd);
    t = ct__exp2_32()[ki % 32] + (ki << 47);
    memcpy(&s, &t, sizeof s);
    double p = __builtin_fma(c0, r, c1), r2 = r * r, y = __builtin_fma(c2, r, 1.0);
    return (float)(__builtin_fma(p, r2, y) * s);
}

/* A tensor header of this shape with no storage (dtype F32), so an out_shape
 * op can run the checks and messages (ct_shape_str) its forward uses on a
 * shape alone.  Its data must never be read: ct_tensor_data would fail. */
static inline ct_tensor ct__shape_header(int ndim, const int64_t *shape)
{
    ct_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = CT_F32;
    t.ndim = ndim;
    t.numel = 1;
    for (int i = 0; i < ndim; i++) {
        t.shape[i] = shape[i];
        t.numel *= shape[i];
    }
    return t;
}

#endif

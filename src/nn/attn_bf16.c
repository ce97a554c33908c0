/*
 * The causal attention core on CPUs with AVX512_BF16 (attention.c owns the
 * layer, the choice of path and the portable path).  Per (sample, head) the
 * rows go in tiles of 16 queries, each against the key tiles at or below the
 * diagonal only, and every product is a register-blocked VDPBF16PS loop
 * (bf16 pairs, f32 accumulation) over operands packed for it in L1: at these
 * sizes (T = 128, head dim 32) a oneDNN call costs about as much as the tile
 * it multiplies.  Scale, causal mask, softmax, dropout and the bf16 casts
 * run on the f32 tile between the products.
 *
 * VDPBF16PS adds a[2l]*b[2l] + a[2l+1]*b[2l+1] into lane l, so both operands
 * hold pairs along the contraction: the broadcast one is read as words (two
 * adjacent bf16, the first in the low half), the one in vectors is packed
 * with its 16 lanes along the output's columns and the pairs interleaved.
 * The packs, per (sample, head), for Tp = T rounded up to 16 (padding is
 * zeros, so it adds nothing to any sum):
 *   rows  [Tp][hd]     bf16 rows as given (broadcast side; q, dy)
 *   trans [hd/2][Tp]   word (x[j][2p], x[j][2p+1]) at [p][j]  (k for S, v for dP)
 *   pairs [Tp/2][hd]   word (x[2i][d], x[2i+1][d]) at [i][d]  (v, k, q, dy)
 * The record keeps P in bf16 as row-pair words over the lower tiles only:
 * tile r (rows 16r..16r+15) holds 8 row pairs of 16(r+1) words, tiles one
 * after another, zeros right of the diagonal and in padding rows.  Its two
 * halves give each row's P back in f32 with one shift or mask, and the words
 * are the broadcast operand of dv = Pd^T dy as they stand.
 *
 * The record streams past the caches (the backward reads it long after);
 * everything else that crosses memory (qkv, dy, y, dqkv) is asked for a
 * head ahead (fetch_plan).
 *
 * A BF16 y rounds as ct_f32_to_bf16, so it is what c_proj's own cast would
 * make; the operands between the products round with VCVTNE2PS2BF16, which
 * differs from it only in flushing subnormals, as VDPBF16PS reads them.
 */
#include <immintrin.h>
#include <stdatomic.h>
#include <math.h>
#include <stddef.h>

#include "internal.h"

#if defined(__clang__) /* clang ignores GCC's target pragma (make fuzz builds with clang) */
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma,prfchw"))), \
                             apply_to = function)
#define _m_prefetchw(p) __builtin_prefetch((p), 1) /* prfchwintrin.h is not in clang's immintrin.h */
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,fma")
#endif

#define TILE 16
#define MR 8 /* rows of the register block; TILE is two of them */

typedef uint32_t word;

static int64_t round16(int64_t n) { return (n + TILE - 1) / TILE * TILE; }

/* Words of the record per (sample, head): 8 row pairs of 16(r+1) words per tile r. */
int64_t ct__attn_bf16_pwords(int64_t T)
{
    int64_t nt = round16(T) / TILE;
    return 64 * nt * (nt + 1);
}

static int64_t tile_off(int64_t r) { return 64 * r * (r + 1); }

int ct__attn_bf16_usable(int64_t hd) { return ct_cpu_has_avx512_bf16() && hd % TILE == 0; }

/* ---- conversions ------------------------------------------------------- */

/* ct_f32_to_bf16 on 16 lanes, the bits in each lane's low half: for y, which
 * must be what c_proj's own cast would make. */
static inline __m512i bf16_exact(__m512 x)
{
    __m512i u = _mm512_castps_si512(x), hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(hi, _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
}

/* Two rows of 16 bf16 (the even one in the low half) -> 16 pair words. */
static inline __m512i zip_words(__m512i rows)
{
    static const uint16_t zip[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(zip), rows);
}

/* Two rows of 16 -> 16 pair words (the even row in the low halves). */
static inline __m512i pair_words(__m512 even, __m512 odd)
{
    return zip_words((__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

/* pair_words, also storing the two rows as bf16 at re and ro: one rounding for both layouts. */
static inline __m512i rows_and_pairs(__m512 even, __m512 odd, uint16_t *re, uint16_t *ro)
{
    __m512i b = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    _mm256_storeu_si256((void *)re, _mm512_castsi512_si256(b));
    _mm256_storeu_si256((void *)ro, _mm512_extracti64x4_epi64(b, 1));
    return zip_words(b);
}

/* 16 lanes as 16 bf16 to memory. */
static inline void store_row(uint16_t *p, __m512 x)
{
    _mm256_storeu_si256((void *)p, (__m256i)_mm512_cvtneps_pbh(x));
}

static inline __m512 lo_f32(__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); }
static inline __m512 hi_f32(__m512i w)
{
    return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
}

/* exp(x) on 16 lanes, within 5e-5 relative for x <= 0 (the lanes softmax
 * keeps): enough for P, which is kept in bf16 (2^-9), at half the cost of
 * ct__expf's polynomial.
 * exp(x) = 2^n e^r with |r| <= ln2/2, e^r by its Taylor series to r^4;
 * VSCALEFPS makes 2^n, gradually underflowing to 0 far below. */
static inline __m512 exp16(__m512 x)
{
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693147180559945f), x);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 24), r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Lanes of key tile t that row i may see (j <= i) and that exist (j < T). */
static inline __mmask16 seen(int64_t i, int64_t t, int64_t T)
{
    int64_t last = (i < T - 1 ? i : T - 1) - TILE * t; /* highest visible lane */
    if (last < 0) return 0;
    return last >= TILE - 1 ? (__mmask16)0xffff : (__mmask16)((1u << (last + 1)) - 1);
}

/* The keep-lanes of the dropout mask for row i's key tile t (bytes past T are not read). */
static inline __mmask16 kept(const uint8_t *mrow, int64_t t, int64_t T)
{
    __mmask16 in = seen(T - 1, t, T);
    __m128i b = _mm_maskz_loadu_epi8(in, mrow + TILE * t);
    return _mm_mask_cmpneq_epi8_mask(in, b, _mm_setzero_si128());
}

/* ---- the product ------------------------------------------------------- */

/* A word of bf16 rows written as 16-bit elements (memcpy: no aliasing question). */
static inline int load_word(const word *p)
{
    int v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* C[m][16n + l] = sum over p < kp of dot2(A(m, p), B(p)[16n + l]) for MR rows
 * and N vectors, A(m, p) the word at a[m*as + p*ps], B(p) the words at
 * b + p*ldb; C (f32) goes to c, ldc apart. */
static inline __attribute__((always_inline)) void block(const int N, int64_t kp, const word *a, ptrdiff_t as,
                                                        ptrdiff_t ps, const word *b, ptrdiff_t ldb, float *c,
                                                        ptrdiff_t ldc)
{
    __m512 acc[MR][2];
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
        for (int n = 0; n < N; n++) acc[m][n] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kp; p++) {
        __m512bh bv[2];
#pragma GCC unroll 2
        for (int n = 0; n < N; n++) bv[n] = (__m512bh)_mm512_loadu_si512(b + p * ldb + TILE * n);
#pragma GCC unroll 8
        for (int m = 0; m < MR; m++) {
            __m512bh av = (__m512bh)_mm512_set1_epi32(load_word(a + m * as + p * ps));
#pragma GCC unroll 2
            for (int n = 0; n < N; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], av, bv[n]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; m++)
#pragma GCC unroll 2
        for (int n = 0; n < N; n++) _mm512_storeu_ps(c + m * ldc + TILE * n, acc[m][n]);
}

static void block1(int64_t kp, const word *a, ptrdiff_t as, ptrdiff_t ps, const word *b, ptrdiff_t ldb,
                   float *c, ptrdiff_t ldc)
{
    block(1, kp, a, as, ps, b, ldb, c, ldc);
}
static void block2(int64_t kp, const word *a, ptrdiff_t as, ptrdiff_t ps, const word *b, ptrdiff_t ldb,
                   float *c, ptrdiff_t ldc)
{
    block(2, kp, a, as, ps, b, ldb, c, ldc);
}

/* Which p of a tile's product are zero words of A (right of the causal
 * diagonal) in a whole block of MR rows, and so skipped: none; the last
 * MR/2 for the first block (A: P or dS rows of a diagonal tile, p along
 * keys); the first MR/2 for the second (A: their pair words, m along keys,
 * p along query pairs from the tile's own). */
enum { FULL, TRIM_END, TRIM_START };

/* A tile of 16 rows and ncol columns (a multiple of 16) in register blocks
 * of MR rows by two vectors (16 accumulators: more would spill); only the
 * first mrows rows of C are stored. */
static void tile_product(int64_t ncol, int64_t kp, const word *a, ptrdiff_t as, ptrdiff_t ps, const word *b,
                         ptrdiff_t ldb, float *c, ptrdiff_t ldc, int64_t mrows, int trim)
{
    if (ps == 1 && ct__attn_amx_usable()) { /* A's rows as AMX loads them: the skipped words are zeros */
        ct__attn_amx_product(TILE, ncol, kp, a, as, b, ldb, c, ldc, mrows);
        return;
    }
    float part[MR * 2 * TILE];
    for (int64_t m0 = 0; m0 < TILE && m0 < mrows; m0 += MR) {
        int64_t p0 = trim == TRIM_START && m0 ? MR / 2 : 0, p1 = trim == TRIM_END && !m0 ? kp - MR / 2 : kp;
        const word *am = a + m0 * as + p0 * ps;
        for (int64_t n0 = 0; n0 < ncol; n0 += 2 * TILE) {
            int two = ncol - n0 >= 2 * TILE, whole = mrows - m0 >= MR;
            float *cm = whole ? c + m0 * ldc + n0 : part;
            ptrdiff_t ld = whole ? ldc : 2 * TILE;
            if (two) block2(p1 - p0, am, as, ps, b + n0 + p0 * ldb, ldb, cm, ld);
            else block1(p1 - p0, am, as, ps, b + n0 + p0 * ldb, ldb, cm, ld);
            for (int64_t m = 0; !whole && m < mrows - m0; m++)
                memcpy(c + (m0 + m) * ldc + n0, part + m * 2 * TILE, sizeof(float) * (size_t)(two ? 2 : 1) * TILE);
        }
    }
}

/* ---- packing ----------------------------------------------------------- */

/* The mask of the first n of 16 lanes. */
static inline __mmask16 first(int64_t n) { return n >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

/* rows: x rows [T][hd] (row stride ld elements) -> [Tp][hd] bf16, zero rows past T. */
static void pack_rows(const uint16_t *x, int64_t ld, int64_t T, int64_t Tp, int64_t hd, uint16_t *out)
{
    for (int64_t i = 0; i < Tp; i++)
        for (int64_t c = 0; c < hd; c += TILE) {
            __m256i v = i < T ? _mm256_loadu_si256((const void *)(x + i * ld + c)) : _mm256_setzero_si256();
            _mm256_storeu_si256((void *)(out + i * hd + c), v);
        }
}

/* pairs: word (x[2i][d], x[2i+1][d]) at out[i*hd + d]. */
static void pack_pairs(const uint16_t *x, int64_t ld, int64_t T, int64_t Tp, int64_t hd, word *out)
{
    for (int64_t i = 0; i < Tp; i += 2)
        for (int64_t d = 0; d < hd; d += TILE) {
            __m512i e = _mm512_setzero_si512(), o = e;
            if (i < T) e = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(x + i * ld + d)));
            if (i + 1 < T) o = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(x + (i + 1) * ld + d)));
            _mm512_storeu_si512(out + i / 2 * hd + d, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
        }
}

/* rows and pairs at once from f32 x (one rounding for both). */
static void pack_rows_pairs_f32(const float *x, int64_t ld, int64_t T, int64_t Tp, int64_t hd, uint16_t *rows,
                                word *pairs)
{
    for (int64_t i = 0; i < Tp; i += 2)
        for (int64_t d = 0; d < hd; d += TILE) {
            __m512 e = i < T ? _mm512_loadu_ps(x + i * ld + d) : _mm512_setzero_ps();
            __m512 o = i + 1 < T ? _mm512_loadu_ps(x + (i + 1) * ld + d) : _mm512_setzero_ps();
            uint16_t *re = rows + i * hd + d;
            _mm512_storeu_si512(pairs + i / 2 * hd + d, rows_and_pairs(e, o, re, re + hd));
        }
}

/* 16x16 words: r[i] lane j -> r[j] lane i. */
static inline void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* r[4g + c] lane L now holds column 4L + c of rows 4g..4g+3: swap 128-bit lanes. */
    for (int c = 0; c < 4; c++) {
        __m512i y0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), y1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
        __m512i y2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
        __m512i y3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
        t[c] = _mm512_shuffle_i32x4(y0, y2, 0x88);
        t[4 + c] = _mm512_shuffle_i32x4(y0, y2, 0xdd);
        t[8 + c] = _mm512_shuffle_i32x4(y1, y3, 0x88);
        t[12 + c] = _mm512_shuffle_i32x4(y1, y3, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* trans: word (x[j][2p], x[j][2p+1]) at out[p*Tp + j]. */
static void pack_trans(const uint16_t *x, int64_t ld, int64_t T, int64_t Tp, int64_t hd, word *out)
{
    int64_t hp = hd / 2;
    for (int64_t j0 = 0; j0 < Tp; j0 += TILE)
        for (int64_t p0 = 0; p0 < hp; p0 += TILE) {
            __mmask16 lanes = first(hp - p0);
            __m512i r[16];
            for (int l = 0; l < TILE; l++)
                r[l] = j0 + l < T ? _mm512_maskz_loadu_epi32(lanes, x + (j0 + l) * ld + 2 * p0)
                                  : _mm512_setzero_si512();
            transpose16(r);
            for (int64_t p = 0; p < TILE && p0 + p < hp; p++) _mm512_storeu_si512(out + (p0 + p) * Tp + j0, r[p]);
        }
}

/* tpairs, for AMX: pair words [W][hd] transposed, out[d*W + i] = in[i*hd + d]. */
static void pack_tpairs(const word *in, int64_t W, int64_t hd, word *out)
{
    for (int64_t i0 = 0; i0 < W; i0 += TILE)
        for (int64_t d0 = 0; d0 < hd; d0 += TILE) {
            __m512i r[16];
            for (int l = 0; l < TILE; l++)
                r[l] = i0 + l < W ? _mm512_loadu_si512(in + (i0 + l) * hd + d0) : _mm512_setzero_si512();
            transpose16(r);
            for (int l = 0; l < TILE; l++) _mm512_mask_storeu_epi32(out + (d0 + l) * W + i0, first(W - i0), r[l]);
        }
}

/* ---- prefetching ------------------------------------------------------- */

/* The big tensors (qkv, dy, P, dqkv: megabytes a layer) stream through once,
 * a head at a time, in short strided runs the hardware prefetcher barely
 * starts on.  So each head asks for the next head's rows, a few at a time
 * between its steps (hundreds of lines at once only stall on the miss
 * buffers), row by row across the next head's tensors: a plan of streams of
 * T rows and a cursor through them. */
typedef struct {
    struct {
        const char *p;
        int64_t ld, lines;
        int write;
    } s[8];
    int n;
    int64_t rows, row, step; /* rows of every stream; the cursor; rows a call asks for */
} fetch_plan;

/* A stream of the plan's rows, bytes each, ld bytes apart. */
static void plan_add(fetch_plan *f, const void *p, int64_t ld, int64_t bytes, int write)
{
    CT_ASSERT(f->n < (int)(sizeof f->s / sizeof f->s[0]));
    f->s[f->n].p = p;
    f->s[f->n].ld = ld;
    f->s[f->n].lines = (bytes + 63) / 64;
    f->s[f->n].write = write;
    f->n++;
}

/* A block of bytes as a stream of the plan's rows. */
static void plan_add_block(fetch_plan *f, const void *p, int64_t bytes)
{
    int64_t ld = (bytes + f->rows - 1) / f->rows;
    plan_add(f, p, ld, ld, 0);
}

/* The plan's next step rows, stream after stream (few instructions a line:
 * this runs for every line the kernels touch). */
static void fetch_some(fetch_plan *f)
{
    int64_t n = f->rows - f->row < f->step ? f->rows - f->row : f->step;
    for (int k = 0; k < f->n; k++) {
        const char *a = f->s[k].p + f->row * f->s[k].ld, *end = a + n * f->s[k].ld;
        int64_t ld = f->s[k].ld, bytes = 64 * f->s[k].lines;
        if (f->s[k].write)
            for (; a < end; a += ld)
                for (int64_t c = 0; c < bytes; c += 64) _m_prefetchw((void *)(a + c));
        else
            for (; a < end; a += ld)
                for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(a + c, _MM_HINT_T0);
    }
    f->row += n;
}

/* ---- forward ----------------------------------------------------------- */

typedef struct {
    int64_t T, Tp, hd, nt;
    float scale, keep; /* score scale; dropout's 1/(1-p) */
} dims;

/* Lane l: the max (sum) of v[l]'s 16 lanes, for 16 rows at once (46
 * instructions and no serial chain, where 16 one-row reductions take 128).
 * Each level halves the vectors and folds each row into half the lanes. */
#define REDUCE16(name, op)                                                                                  \
    static inline __m512 name(const __m512 v[16])                                                         \
    {                                                                                                      \
        static const int32_t order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};             \
        __m512 c[8], e[4];                                                                                 \
        for (int k = 0; k < 8; k++) /* 128-bit lanes 0-1: row 2k, 2-3: row 2k+1 */                          \
            c[k] = op(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),                                  \
                      _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xee));                                 \
        for (int k = 0; k < 4; k++) /* lane L: row 4k + L */                                               \
            e[k] = op(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),                                  \
                      _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xdd));                                 \
        for (int k = 0; k < 2; k++) /* lane L: row 8k + L twice, then row 8k + 4 + L twice */              \
            e[k] = op(_mm512_shuffle_ps(e[2 * k], e[2 * k + 1], 0x44),                                     \
                      _mm512_shuffle_ps(e[2 * k], e[2 * k + 1], 0xee));                                    \
        /* lane L, element j: row 4j + L */                                                                \
        __m512 f = op(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));            \
        return _mm512_permutexvar_ps(_mm512_loadu_si512(order), f);                                        \
    }
REDUCE16(rows_max, _mm512_max_ps)
REDUCE16(rows_sum, _mm512_add_ps)

/* Softmax of the scores of tile r (s [16][Tp] f32, rows past T ignored):
 * P as the record's pair words at rec (zeros right of the diagonal and in
 * rows past T) and the dropped P, rne(P * keep) where kept, as bf16 rows pd
 * [16][Tp] for y = Pd v.  mask: the tile's first row of keep-bytes. */
static void softmax_tile(const dims *d, int64_t r, float *s, const uint8_t *mask, word *rec, uint16_t *pd)
{
    int64_t w = TILE * (r + 1);
    __m512 keep = _mm512_set1_ps(d->keep), sc = _mm512_set1_ps(d->scale), v[TILE];
    float off[TILE], inv[TILE];
    /* The lanes row l sees: all of the key tiles left of the diagonal one
     * (their keys precede row 16r), none in a row past T. */
    __mmask16 diag[TILE], left[TILE];
    for (int64_t l = 0; l < TILE; l++) {
        int64_t i = TILE * r + l;
        diag[l] = i < d->T ? seen(i, r, d->T) : 0;
        left[l] = i < d->T ? 0xffff : 0;
        v[l] = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t <= r; t++)
            v[l] = _mm512_mask_max_ps(v[l], t < r ? left[l] : diag[l], v[l],
                                      _mm512_loadu_ps(s + l * d->Tp + TILE * t));
    }
    /* exp(scale * (s - max)) in place (a row past T: max -inf, no lanes). */
    _mm512_storeu_ps(off, _mm512_mul_ps(rows_max(v), _mm512_set1_ps(-d->scale)));
    for (int64_t l = 0; l < TILE; l++) {
        float *row = s + l * d->Tp;
        __m512 o = _mm512_set1_ps(diag[l] ? off[l] : 0.0f);
        v[l] = _mm512_setzero_ps();
        for (int64_t t = 0; t <= r; t++) {
            __mmask16 in = t < r ? left[l] : diag[l];
            __m512 e = _mm512_maskz_mov_ps(in, exp16(_mm512_fmadd_ps(_mm512_loadu_ps(row + TILE * t), sc, o)));
            v[l] = _mm512_add_ps(v[l], e);
            _mm512_storeu_ps(row + TILE * t, e);
        }
    }
    /* A row past T sums to 0 and normalises to zeros. */
    __m512 sum = rows_sum(v);
    __mmask16 some = _mm512_cmpneq_ps_mask(sum, _mm512_setzero_ps());
    _mm512_storeu_ps(inv, _mm512_maskz_div_ps(some, _mm512_set1_ps(1.0f), sum));
    for (int64_t l = 0; l < TILE; l += 2) {
        int64_t i = TILE * r + l;
        float *s0 = s + l * d->Tp, *s1 = s0 + d->Tp;
        __m512 inv0 = _mm512_set1_ps(inv[l]), inv1 = _mm512_set1_ps(inv[l + 1]);
        for (int64_t t = 0; t <= r; t++) {
            uint16_t *pd0 = pd + l * d->Tp + TILE * t, *pd1 = pd0 + d->Tp;
            __m512 q0 = _mm512_mul_ps(_mm512_loadu_ps(s0 + TILE * t), inv0);
            __m512 q1 = _mm512_mul_ps(_mm512_loadu_ps(s1 + TILE * t), inv1);
            /* Without dropout Pd is P: its rows come from the same rounding. */
            __m512i pw = mask ? pair_words(q0, q1) : rows_and_pairs(q0, q1, pd0, pd1);
            /* Streamed past the caches: backward reads it long after, from memory anyway. */
            _mm512_stream_si512((void *)(rec + l / 2 * w + TILE * t), pw);
            if (mask) {
                __m512 p0 = lo_f32(pw), p1 = hi_f32(pw); /* the bf16 P, as y and backward see it */
                __mmask16 k0 = i < d->T ? kept(mask + l * d->T, t, d->T) : 0;
                __mmask16 k1 = i + 1 < d->T ? kept(mask + (l + 1) * d->T, t, d->T) : 0;
                store_row(pd0, _mm512_maskz_mul_ps(k0, p0, keep));
                store_row(pd1, _mm512_maskz_mul_ps(k1, p1, keep));
            }
        }
    }
}

/* y rows of tile r from f32 ys [16][hd]: f32, or bf16 rounded as ct_f32_to_bf16. */
static void store_y(const dims *d, int64_t r, const float *ys, void *y, int64_t ldy, int y_bf16)
{
    for (int64_t l = 0; l < TILE && TILE * r + l < d->T; l++) {
        int64_t i = TILE * r + l;
        for (int64_t c = 0; c < d->hd; c += TILE) {
            __m512 v = _mm512_loadu_ps(ys + l * d->hd + c);
            if (y_bf16)
                _mm256_storeu_si256((void *)((uint16_t *)y + i * ldy + c), _mm512_cvtepi32_epi16(bf16_exact(v)));
            else _mm512_storeu_ps((float *)y + i * ldy + c, v);
        }
    }
}

/* One call of a kernel over (sample, head) pairs: each range of pairs has a
 * workspace of its own, so the rank's threads run ranges side by side. */
typedef struct {
    const ct__attn_dims *a;
    const uint16_t *qkv;
    const uint8_t *mask;
    uint16_t *P;
    void *y;
    int y_bf16;
    const float *dy;
    void *dqkv;
    float *colsum;
    atomic_int nomem; /* a range could not get its workspace */
} kern_job;

/* Forward of pairs [lo, hi) in the order b * H + h. */
static void forward_pairs(void *ctx, int64_t lo, int64_t hi)
{
    kern_job *j = ctx;
    const ct__attn_dims *a = j->a;
    const uint16_t *qkv = j->qkv;
    const uint8_t *mask = j->mask;
    uint16_t *P = j->P;
    void *y = j->y;
    int y_bf16 = j->y_bf16;
    int64_t H = a->H, D = a->D, T = a->T, hd = D / H, Tp = round16(T);
    dims d = {T, Tp, hd, Tp / TILE, 1.0f / sqrtf((float)hd), mask ? 1.0f / (1.0f - a->attn_p) : 1.0f};
    /* q rows, k trans, v pairs; scores, dropped P and y of one tile. */
    size_t pk = (size_t)(Tp * hd), nw = 3 * pk / 2 + (size_t)(TILE * Tp) * 3 / 2 + (size_t)(TILE * hd);
    word *ws = ct_alloc(nw * sizeof(word), CT_MEM_ACT);
    if (!ws) {
        atomic_store(&j->nomem, 1);
        return;
    }
    uint16_t *qn = (uint16_t *)ws;
    word *kt = ws + pk / 2, *vp = kt + pk / 2;
    float *s = (float *)(vp + pk / 2), *ys = s + TILE * Tp;
    uint16_t *pd = (uint16_t *)(ys + TILE * hd);
    int64_t pw = ct__attn_bf16_pwords(T);
    int amx = ct__attn_amx_usable();
    if (amx) ct__attn_amx_begin();
    for (int64_t bh = lo; bh < hi; bh++) {
        int64_t b = bh / H, h = bh % H;
        const uint16_t *q = qkv + b * T * 3 * D + h * hd;
        const uint8_t *mk = mask ? mask + (b * H + h) * T * T : NULL;
        word *rec = (word *)(void *)P + (b * H + h) * pw;
        /* The next head's q, k, v and y rows: hd columns on, or the next sample's first. */
        fetch_plan f = {.rows = bh + 1 < hi ? T : 0, .step = TILE};
        if (f.rows) {
            int64_t nx = h + 1 < H ? hd : T * 3 * D - (H - 1) * hd, ye = y_bf16 ? 2 : 4;
            int64_t ny = b * T * D + (h + 1 < H ? (h + 1) * hd : T * D);
            for (int k = 0; k < 3; k++) plan_add(&f, q + nx + k * D, 3 * D * 2, hd * 2, 0);
            plan_add(&f, (char *)y + ny * ye, D * ye, hd * ye, 1);
        }
        pack_rows(q, 3 * D, T, Tp, hd, qn);
        pack_trans(q + D, 3 * D, T, Tp, hd, kt);
        pack_pairs(q + 2 * D, 3 * D, T, Tp, hd, vp);
        for (int64_t r = 0; r < d.nt; r++) {
            int64_t rows = T - TILE * r < TILE ? T - TILE * r : TILE, w = TILE * (r + 1);
            /* S = q k^T over key tiles 0..r (rows past T are zeros in qn). */
            fetch_some(&f);
            tile_product(w, hd / 2, (const word *)qn + TILE * r * hd / 2, hd / 2, 1, kt, Tp, s, Tp, TILE, FULL);
            softmax_tile(&d, r, s, mk ? mk + TILE * r * T : NULL, rec + tile_off(r), pd);
            /* y = Pd v over keys 0..w: the bf16 rows of pd as pair words. */
            tile_product(hd, w / 2, (const word *)pd, Tp / 2, 1, vp, hd, ys, hd, rows, TRIM_END);
            int64_t yo = b * T * D + h * hd;
            store_y(&d, r, ys, y_bf16 ? (void *)((uint16_t *)y + yo) : (void *)((float *)y + yo), D, y_bf16);
        }
    }
    if (amx) ct__attn_amx_end();
    _mm_sfence();
    ct_free(ws);
}

ct_status ct__attn_bf16_forward(const ct__attn_dims *a, const uint16_t *qkv, const uint8_t *mask, uint16_t *P,
                                void *y, int y_bf16)
{
    CT_ASSERT((uintptr_t)P % 64 == 0); /* streaming stores */
    kern_job j = {a, qkv, mask, P, y, y_bf16, NULL, NULL, NULL, 0};
    /* Pairs write disjoint parts of P and y: any cut gives one thread's bits. */
    ct_parallel_for(a->B * a->H, 1, forward_pairs, &j);
    return atomic_load(&j.nomem) ? CT_ENOMEM : CT_OK;
}

/* ---- backward ---------------------------------------------------------- */

/* The lanes of key tile t row i of tile r takes dP from: seen, and kept by
 * the dropout (mask: the tile's first row of keep-bytes); none past T.
 * full and diag: seen's lanes of row i left of and on the diagonal. */
static inline __mmask16 grad_lanes(const dims *d, int64_t r, int64_t i, int64_t t, __mmask16 full, __mmask16 diag,
                                   const uint8_t *mask)
{
    __mmask16 v = t < r ? full : diag;
    return mask && v ? v & kept(mask + (i - TILE * r) * d->T, t, d->T) : v;
}

/* Through dropout and softmax for tile r: from dP [16][Tp] f32 and the
 * record's P, dS = P (dP' - rowsum(P dP')) * scale with dP' = dP * keep on
 * grad_lanes, 0 elsewhere (so nothing right of the diagonal reaches dS, not
 * even a NaN); writes dS as bf16 rows ds [16][Tp] (for dq) and as pair
 * words dsi, and Pd as pair words pdi (for dk and dv; both [Tp/2][Tp], this
 * tile's rows).  With dropout the first pass leaves dP' in dP for the second. */
static void grad_tile(const dims *d, int64_t r, float *dP, const word *rec, const uint8_t *mask, uint16_t *ds,
                      word *dsi, word *pdi)
{
    int64_t w = TILE * (r + 1);
    __m512 sc = _mm512_set1_ps(d->scale), keep = _mm512_set1_ps(d->keep);
    for (int64_t l = 0; l < TILE; l += 2) {
        int64_t i = TILE * r + l;
        __mmask16 f0 = i < d->T ? 0xffff : 0, f1 = i + 1 < d->T ? 0xffff : 0;
        __mmask16 dg0 = f0 ? seen(i, r, d->T) : 0, dg1 = f1 ? seen(i + 1, r, d->T) : 0;
        const word *pr = rec + l / 2 * w;
        float *g0 = dP + l * d->Tp, *g1 = g0 + d->Tp;
        __m512 dot0 = _mm512_setzero_ps(), dot1 = dot0;
        for (int64_t t = 0; t <= r; t++) {
            __m512i pw = _mm512_loadu_si512(pr + TILE * t);
            __mmask16 k0 = grad_lanes(d, r, i, t, f0, dg0, mask), k1 = grad_lanes(d, r, i + 1, t, f1, dg1, mask);
            __m512 a = _mm512_maskz_mul_ps(k0, _mm512_loadu_ps(g0 + TILE * t), keep);
            __m512 b = _mm512_maskz_mul_ps(k1, _mm512_loadu_ps(g1 + TILE * t), keep);
            if (mask) {
                _mm512_storeu_ps(g0 + TILE * t, a);
                _mm512_storeu_ps(g1 + TILE * t, b);
            }
            dot0 = _mm512_fmadd_ps(lo_f32(pw), a, dot0);
            dot1 = _mm512_fmadd_ps(hi_f32(pw), b, dot1);
        }
        __m512 rs0 = _mm512_set1_ps(_mm512_reduce_add_ps(dot0));
        __m512 rs1 = _mm512_set1_ps(_mm512_reduce_add_ps(dot1));
        for (int64_t t = 0; t <= r; t++) {
            __mmask16 k0 = t < r ? f0 : dg0, k1 = t < r ? f1 : dg1; /* no dropout: dP' = dP on these */
            __m512i pw = _mm512_loadu_si512(pr + TILE * t);
            __m512 p0 = lo_f32(pw), p1 = hi_f32(pw);
            __m512 a = mask ? _mm512_loadu_ps(g0 + TILE * t) : _mm512_maskz_loadu_ps(k0, g0 + TILE * t);
            __m512 b = mask ? _mm512_loadu_ps(g1 + TILE * t) : _mm512_maskz_loadu_ps(k1, g1 + TILE * t);
            __m512 s0 = _mm512_mul_ps(_mm512_mul_ps(p0, sc), _mm512_sub_ps(a, rs0));
            __m512 s1 = _mm512_mul_ps(_mm512_mul_ps(p1, sc), _mm512_sub_ps(b, rs1));
            int64_t o = (TILE / 2 * r + l / 2) * d->Tp + TILE * t; /* this pair's words in dsi, pdi */
            uint16_t *d0 = ds + l * d->Tp + TILE * t;
            _mm512_storeu_si512(dsi + o, rows_and_pairs(s0, s1, d0, d0 + d->Tp));
            if (mask) {
                k0 = grad_lanes(d, r, i, t, f0, dg0, mask);
                k1 = grad_lanes(d, r, i + 1, t, f1, dg1, mask);
                pw = pair_words(_mm512_maskz_mul_ps(k0, p0, keep), _mm512_maskz_mul_ps(k1, p1, keep));
            }
            _mm512_storeu_si512(pdi + o, pw);
        }
    }
}

/* Rows [0, rows) of a gradient tile gt [rows][hd] f32 into bf16 out (row
 * stride ld), rounded as ct_f32_to_bf16, and added to the column sums cs
 * row after row: the order of c_attn's own pass over dqkv. */
static void put_grad(const float *gt, int64_t rows, int64_t hd, uint16_t *out, int64_t ld, float *cs)
{
    for (int64_t c = 0; c < hd; c += TILE) {
        __m512 sum = _mm512_loadu_ps(cs + c);
        for (int64_t l = 0; l < rows; l++) {
            __m512 v = _mm512_loadu_ps(gt + l * hd + c);
            _mm256_storeu_si256((void *)(out + l * ld + c), _mm512_cvtepi32_epi16(bf16_exact(v)));
            sum = _mm512_add_ps(sum, v);
        }
        _mm512_storeu_ps(cs + c, sum);
    }
}

/* One gradient tile of rows x hd: straight into f32 dqkv (row stride ld),
 * or through gt into bf16 dqkv and the column sums cs. */
static void grad_product(int64_t kp, const word *a, ptrdiff_t as, ptrdiff_t ps, const word *b, int64_t hd,
                         void *out, int64_t ld, int64_t rows, int trim, float *gt, float *cs)
{
    if (!cs) {
        tile_product(hd, kp, a, as, ps, b, hd, out, ld, rows, trim);
        return;
    }
    tile_product(hd, kp, a, as, ps, b, hd, gt, hd, rows, trim);
    put_grad(gt, rows, hd, out, ld, cs);
}

/* grad_product's key tiles on AMX, whose A must hold the contraction along
 * its rows: the transposed tile C^T [hd][16] = at . b, at the pairs
 * transposed (pack_tpairs, rows W apart), b the tile's Pd or dS pair words
 * (rows ldb apart); then back to rows x hd through ct ([hd][16] f32) and
 * stored as grad_product stores. */
static void grad_product_t(int64_t kp, const word *at, int64_t W, const word *b, ptrdiff_t ldb, int64_t hd,
                           void *out, int64_t ld, int64_t rows, float *ct, float *gt, float *cs)
{
    ct__attn_amx_product(hd, TILE, kp, at, W, b, ldb, ct, TILE, hd);
    float *g = cs ? gt : out;
    int64_t lg = cs ? hd : ld;
    for (int64_t d0 = 0; d0 < hd; d0 += TILE) {
        __m512i r[16];
        for (int l = 0; l < TILE; l++) r[l] = _mm512_loadu_si512(ct + (d0 + l) * TILE);
        transpose16(r);
        for (int64_t m = 0; m < rows; m++) _mm512_storeu_si512(g + m * lg + d0, r[m]);
    }
    if (cs) put_grad(gt, rows, hd, out, ld, cs);
}

/* Backward of heads [lo, hi), each over the samples in order: a head's
 * columns of the column sums take the samples in the order one thread
 * takes them, and no other head touches them. */
static void backward_heads(void *ctx, int64_t lo, int64_t hi)
{
    kern_job *j = ctx;
    const ct__attn_dims *a = j->a;
    const uint16_t *qkv = j->qkv, *P = j->P;
    const uint8_t *mask = j->mask;
    const float *dy = j->dy;
    void *dqkv = j->dqkv;
    float *colsum = j->colsum;
    int64_t B = a->B, H = a->H, D = a->D, T = a->T, hd = D / H, Tp = round16(T), W = Tp / 2;
    dims d = {T, Tp, hd, Tp / TILE, 1.0f / sqrtf((float)hd), mask ? 1.0f / (1.0f - a->attn_p) : 1.0f};
    int64_t ge = colsum ? 2 : 4; /* bytes of a dqkv element */
    /* dy rows; dy, k, q pairs; v trans; dS and Pd pair words; dP and dS rows
     * of one tile; a gradient tile on its way to bf16. */
    size_t pk = (size_t)(Tp * hd) / 2, sq = (size_t)(W * Tp);
    int amx = ct__attn_amx_usable(); /* and dy, q pairs transposed, a transposed gradient tile */
    size_t nw = 5 * pk + 2 * sq + (size_t)(TILE * Tp) + (size_t)(TILE * Tp) / 2 + (size_t)(TILE * hd) +
                (amx ? 2 * pk + (size_t)(TILE * hd) : 0);
    word *ws = ct_alloc(nw * sizeof(word), CT_MEM_ACT);
    if (!ws) {
        atomic_store(&j->nomem, 1);
        return;
    }
    uint16_t *dyn = (uint16_t *)ws;
    word *dyp = ws + pk, *kp = dyp + pk, *qp = kp + pk, *vt = qp + pk, *dsi = vt + pk, *pdi = dsi + sq;
    float *dP = (float *)(pdi + sq);
    uint16_t *ds = (uint16_t *)(dP + TILE * Tp);
    float *gt = (float *)(void *)(ds + TILE * Tp);
    word *dyt = (word *)(gt + TILE * hd), *qt = dyt + pk;
    float *ct = (float *)(qt + pk);
    int64_t pw = ct__attn_bf16_pwords(T);
    if (amx) ct__attn_amx_begin();
    for (int64_t h = lo; h < hi; h++)
        for (int64_t b = 0; b < B; b++) {
            const uint16_t *q = qkv + b * T * 3 * D + h * hd;
            const float *g = dy + b * T * D + h * hd;
            const uint8_t *mk = mask ? mask + (b * H + h) * T * T : NULL;
            const word *rec = (const word *)(const void *)P + (b * H + h) * pw;
            char *dq = (char *)dqkv + (b * T * 3 * D + h * hd) * ge, *dk = dq + D * ge, *dv = dq + 2 * D * ge;
            float *csq = colsum ? colsum + h * hd : NULL, *csk = colsum ? csq + D : NULL, *csv = colsum ? csq + 2 * D : NULL;
            /* The next pair's operands in the order it reads them, then its
             * outputs: the next sample of this head, or the first of the next. */
            int64_t nb = b + 1 < B ? b + 1 : 0, nh = b + 1 < B ? h : h + 1;
            fetch_plan f = {.rows = nh < hi ? T : 0, .step = (T + 5 * d.nt - 1) / (5 * d.nt)};
            if (f.rows) {
                const uint16_t *nq = qkv + nb * T * 3 * D + nh * hd;
                char *ndq = (char *)dqkv + (nb * T * 3 * D + nh * hd) * ge;
                plan_add(&f, dy + nb * T * D + nh * hd, D * 4, hd * 4, 0);
                for (int k = 0; k < 3; k++) plan_add(&f, nq + k * D, 3 * D * 2, hd * 2, 0);
                plan_add_block(&f, (const word *)(const void *)P + (nb * H + nh) * pw, 4 * pw);
                for (int k = 0; k < 3; k++) plan_add(&f, ndq + k * D * ge, 3 * D * ge, hd * ge, 1);
            }
            pack_rows_pairs_f32(g, D, T, Tp, hd, dyn, dyp);
            pack_pairs(q + D, 3 * D, T, Tp, hd, kp);
            pack_pairs(q, 3 * D, T, Tp, hd, qp);
            pack_trans(q + 2 * D, 3 * D, T, Tp, hd, vt);
            if (amx) {
                pack_tpairs(dyp, W, hd, dyt);
                pack_tpairs(qp, W, hd, qt);
            }
            for (int64_t r = 0; r < d.nt; r++) {
                int64_t rows = T - TILE * r < TILE ? T - TILE * r : TILE, w = TILE * (r + 1);
                /* dPd = dy v^T, then dS; dq = dS k. */
                fetch_some(&f);
                tile_product(w, hd / 2, (const word *)dyn + TILE * r * hd / 2, hd / 2, 1, vt, Tp, dP, Tp, TILE, FULL);
                fetch_some(&f);
                grad_tile(&d, r, dP, rec + tile_off(r), mk ? mk + TILE * r * T : NULL, ds, dsi, pdi);
                fetch_some(&f);
                grad_product(w / 2, (const word *)ds, Tp / 2, 1, kp, hd, dq + TILE * r * 3 * D * ge, 3 * D, rows,
                             TRIM_END, gt, csq);
            }
            /* Key tile c: dv = Pd^T dy and dk = dS^T q over rows i >= 16c. */
            for (int64_t c = 0; c < d.nt; c++) {
                int64_t rows = T - TILE * c < TILE ? T - TILE * c : TILE, p0 = TILE / 2 * c;
                char *dvc = dv + TILE * c * 3 * D * ge, *dkc = dk + TILE * c * 3 * D * ge;
                fetch_some(&f);
                if (amx) grad_product_t(W - p0, dyt + p0, W, pdi + p0 * Tp + TILE * c, Tp, hd, dvc, 3 * D, rows, ct, gt, csv);
                else grad_product(W - p0, pdi + p0 * Tp + TILE * c, 1, Tp, dyp + p0 * hd, hd, dvc, 3 * D, rows,
                                  TRIM_START, gt, csv);
                fetch_some(&f);
                if (amx) grad_product_t(W - p0, qt + p0, W, dsi + p0 * Tp + TILE * c, Tp, hd, dkc, 3 * D, rows, ct, gt, csk);
                else grad_product(W - p0, dsi + p0 * Tp + TILE * c, 1, Tp, qp + p0 * hd, hd, dkc, 3 * D, rows,
                                  TRIM_START, gt, csk);
            }
        }
    if (amx) ct__attn_amx_end();
    ct_free(ws);
}

ct_status ct__attn_bf16_backward(const ct__attn_dims *a, const uint16_t *qkv, const uint8_t *mask,
                                 const uint16_t *P, const float *dy, void *dqkv, float *colsum)
{
    kern_job j = {a, qkv, mask, (uint16_t *)P, NULL, 0, dy, dqkv, colsum, 0};
    ct_parallel_for(a->H, 1, backward_heads, &j);
    return atomic_load(&j.nomem) ? CT_ENOMEM : CT_OK;
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

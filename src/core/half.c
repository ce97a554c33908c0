/*
 * f32 <-> bf16 / f16 conversion with round-to-nearest-even, done on the bits
 * so the result does not depend on the FPU rounding mode.  inf stays inf and
 * nan stays a (quiet) nan.
 *
 * The bulk bf16 conversions are on the hot path of bf16 compute (every
 * product casts its f32 operand) and of 16-bit communication, so on CPUs
 * with AVX-512 they run the same integer recipe 16 lanes at a time (chosen
 * at run time; the library may be built for other CPUs).  Where the CPU
 * has AVX512_BF16, f32 -> bf16 is one VCVTNEPS2BF16 per 16 values, which
 * rounds the same (nearest even, nan made quiet) but flushes subnormal
 * inputs to zero: a vector holding one is cast the integer way, so every
 * result stays bit-identical to the scalar form.
 */
#include "ctrain/core.h"
#include "internal.h"

#include <float.h>
#include <immintrin.h>
#include <string.h>

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t ct_f32_to_bf16(float f)
{
    uint32_t x = bits_of(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

float ct_bf16_to_f32(uint16_t h) { return float_of((uint32_t)h << 16); }

uint16_t ct_f32_to_f16(float f)
{
    uint32_t x = bits_of(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) /* inf or nan */
        return sign | (x > 0x7f800000u ? (uint16_t)(0x7e00u | ((x >> 13) & 0x3ffu)) : 0x7c00u);
    if (x >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds to inf */
    if (x < 0x38800000u) {                        /* below 2^-14: f16 subnormal */
        if (x < 0x33000000u) return sign;         /* below 2^-25: rounds to zero */
        uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e, m16 = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (m16 & 1u))) m16++;
        return sign | (uint16_t)m16;
    }
    uint32_t h = (x - 0x38000000u) >> 13, rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}

float ct_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    if (e == 0) {
        if (m == 0) {
            bits = sign;
        } else {
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; e--; }
            bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    return float_of(bits);
}

/* ct_f32_to_bf16 on 16 lanes, each result in the low half of its 32-bit
 * lane: x + 0x7fff + lsb, high half; nan -> high half | quiet bit. */
__attribute__((target("avx512f"))) static inline __m512i bf16_lanes(__m512i x)
{
    const __m512i one = _mm512_set1_epi32(1), round = _mm512_set1_epi32(0x7fff);
    const __m512i abs = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x40);
    __m512i hi = _mm512_srli_epi32(x, 16);
    __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(round, _mm512_and_si512(hi, one)));
    r = _mm512_srli_epi32(r, 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, abs), inf);
    return _mm512_mask_or_epi32(r, nan, hi, quiet);
}

__attribute__((target("avx512f"))) static size_t f32_to_bf16_avx512(const float *in, uint16_t *out,
                                                                    size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i r = bf16_lanes(_mm512_loadu_si512((const void *)(in + i)));
        _mm256_storeu_si256((__m256i *)(void *)(out + i), _mm512_cvtepi32_epi16(r));
    }
    return i;
}

__attribute__((target("avx512f"))) static size_t bf16_to_f32_avx512(const uint16_t *in, float *out,
                                                                    size_t n)
{
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(in + i));
        _mm512_storeu_si512((void *)(out + i), _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return i;
}

void ct_f32_to_bf16_rows(const float *x, int64_t rows, int64_t cols, uint16_t *y, float *colsum)
{
    for (int64_t r = 0; r < rows; r++) { /* a row is cast and summed while it is in L1 */
        const float *xr = x + r * cols;
        if (y) ct_f32_to_bf16_n(xr, y + r * cols, (size_t)cols);
        if (colsum)
            for (int64_t j = 0; j < cols; j++) colsum[j] += xr[j];
    }
}

__attribute__((target("avx512f,avx512bf16"))) static size_t f32_to_bf16_vcvt(const float *in, uint16_t *out,
                                                                            size_t n)
{
    const __m512 tiny = _mm512_set1_ps(FLT_MIN), zero = _mm512_setzero_ps();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 f = _mm512_loadu_ps(in + i), a = _mm512_abs_ps(f);
        __m256i h = (__m256i)_mm512_cvtneps_pbh(f);
        /* a nan compares false both ways, so only true subnormals take the integer way */
        if (_mm512_cmp_ps_mask(a, tiny, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a, zero, _CMP_NEQ_OQ))
            h = _mm512_cvtepi32_epi16(bf16_lanes(_mm512_castps_si512(f)));
        _mm256_storeu_si256((__m256i *)(void *)(out + i), h);
    }
    return i;
}

static void f32_to_bf16_part(void *ctx, int64_t lo, int64_t hi)
{
    const void *const *io = ctx;
    const float *in = (const float *)io[0] + lo;
    uint16_t *out = (uint16_t *)io[1] + lo;
    size_t n = (size_t)(hi - lo);
    size_t i = ct__cpu_has(CT__CPU_AVX512BF16) ? f32_to_bf16_vcvt(in, out, n) : ct__cpu_has(CT__CPU_AVX512F) ? f32_to_bf16_avx512(in, out, n) : 0;
    for (; i < n; i++) out[i] = ct_f32_to_bf16(in[i]);
}

static void bf16_to_f32_part(void *ctx, int64_t lo, int64_t hi)
{
    const void *const *io = ctx;
    const uint16_t *in = (const uint16_t *)io[0] + lo;
    float *out = (float *)io[1] + lo;
    size_t n = (size_t)(hi - lo);
    size_t i = ct__cpu_has(CT__CPU_AVX512F) ? bf16_to_f32_avx512(in, out, n) : 0;
    for (; i < n; i++) out[i] = ct_bf16_to_f32(in[i]);
}

/* Values per thread below which a cast stays on one thread. */
#define CAST_GRAIN 32768

/* Each value casts on its own, so the rank's threads share the bulk casts. */
void ct_f32_to_bf16_n(const float *in, uint16_t *out, size_t n)
{
    const void *io[2] = {in, out};
    ct_parallel_for((int64_t)n, CAST_GRAIN, f32_to_bf16_part, (void *)io);
}
void ct_bf16_to_f32_n(const uint16_t *in, float *out, size_t n)
{
    const void *io[2] = {in, out};
    ct_parallel_for((int64_t)n, CAST_GRAIN, bf16_to_f32_part, (void *)io);
}
void ct_f32_to_f16_n(const float *in, uint16_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = ct_f32_to_f16(in[i]);
}
void ct_f16_to_f32_n(const uint16_t *in, float *out, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = ct_f16_to_f32(in[i]);
}

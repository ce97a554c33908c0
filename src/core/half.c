/*
 * f32 <-> bf16 / f16 conversion with round-to-nearest-even, done on the bits
 * so the result does not depend on the FPU rounding mode.  inf stays inf and
 * nan stays a (quiet) nan.
 */
#include "ctrain/core.h"

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

void ct_f32_to_bf16_n(const float *in, uint16_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = ct_f32_to_bf16(in[i]);
}
void ct_bf16_to_f32_n(const uint16_t *in, float *out, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = ct_bf16_to_f32(in[i]);
}
void ct_f32_to_f16_n(const float *in, uint16_t *out, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = ct_f32_to_f16(in[i]);
}
void ct_f16_to_f32_n(const uint16_t *in, float *out, size_t n)
{
    for (size_t i = 0; i < n; i++) out[i] = ct_f16_to_f32(in[i]);
}

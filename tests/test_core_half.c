/*
 * Tests of the f32 <-> bf16 / f16 conversions (src/core/half.c).  Special
 * cases are built from bit patterns; the bulk checks compare against a
 * reference that decodes 16-bit values with ldexp and picks the nearest one
 * in double arithmetic, so it shares no code with the bit tricks under test.
 */
#include <stdint.h>
#include <stdlib.h>

#include "test.h"

static float f32_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static int f16_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu); }
static int bf16_is_nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu); }

/* Value of a finite f16 bit pattern by the IEEE 754 formula. */
static double f16_value(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return (h & 0x8000u) ? -v : v;
}

/* Value of a finite bf16 bit pattern: 8 exponent bits, 7 mantissa bits. */
static double bf16_value(uint16_t h)
{
    int e = (h >> 7) & 0xff, m = h & 0x7f;
    double v = e ? ldexp(128 + m, e - 134) : ldexp(m, -133);
    return (h & 0x8000u) ? -v : v;
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Nearest f16 to a finite float, ties to the even pattern.  The positive
 * patterns 0x0000..0x7bff increase with their value; 0x7c00 stands in as
 * 65536, the next step of the top binade, so that values from the midpoint
 * 65520 up round to inf exactly as round-to-nearest-even demands. */
static double f16_table[0x7c01];

static void f16_table_init(void)
{
    for (int h = 0; h < 0x7c00; h++) f16_table[h] = f16_value((uint16_t)h);
    f16_table[0x7c00] = 65536.0;
}

static uint16_t ref_f32_to_f16(float f)
{
    double d = fabs((double)f);
    uint16_t sign = signbit(f) ? 0x8000u : 0;
    if (d >= 65536.0) return sign | 0x7c00u;
    int lo = 0, hi = 0x7c00; /* table[lo] <= d < table[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (f16_table[mid] <= d) lo = mid;
        else hi = mid;
    }
    double dlo = d - f16_table[lo], dhi = f16_table[hi] - d; /* exact in double */
    int pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1) ? hi : lo;
    return sign | (uint16_t)pick;
}

/* Nearest bf16 to a finite float: the two candidates are the truncation and
 * the next pattern up (0x7f80 standing in as 2^128); ties to the even one. */
static uint16_t ref_f32_to_bf16(float f)
{
    uint32_t u = bits_of(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u), lo = (uint16_t)((u >> 16) & 0x7fffu);
    uint16_t hi = (uint16_t)(lo + 1);
    double d = fabs((double)f);
    double vlo = bf16_value(lo), vhi = hi == 0x7f80u ? ldexp(1.0, 128) : bf16_value(hi);
    double dlo = d - vlo, dhi = vhi - d;
    uint16_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo & 1) ? hi : lo;
    return sign | pick;
}

TEST(core_f16_round_to_nearest_even)
{
    /* 1.0 is 0x3f800000; f16 keeps the top 10 mantissa bits, so bit 12 of the
     * f32 pattern is half an f16 ulp. */
    ASSERT_EQ(ct_f32_to_f16(1.0f), 0x3c00);
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x3f801000u)), 0x3c00); /* 1+2^-11: tie, even stays */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x3f801001u)), 0x3c01); /* just above the tie */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x3f800fffu)), 0x3c00); /* just below */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x3f803000u)), 0x3c02); /* 1+3*2^-11: tie, odd goes up */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x3f802fffu)), 0x3c01);
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x3f803001u)), 0x3c02);
    ASSERT_EQ(ct_f32_to_f16(f32_of(0xbf803000u)), 0xbc02); /* negative ties mirror */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0xbf801000u)), 0xbc00);
    /* A tie that carries into the exponent: 2 - 2^-11 is halfway between
     * 0x3fff (2 - 2^-10, odd) and 2.0 = 0x4000. */
    ASSERT_EQ(ct_f32_to_f16(2.0f - 0x1p-11f), 0x4000);
    ASSERT_EQ(ct_f32_to_f16(2.0f - 0x1p-11f - 0x1p-23f), 0x3fff);
    ASSERT_EQ(ct_f32_to_f16(-2.0f), 0xc000);
    ASSERT_EQ(ct_f32_to_f16(0.5f), 0x3800);
    ASSERT_EQ(ct_f32_to_f16(0.1f), 0x2e66); /* 0.0999755859375 is nearest */
}

TEST(core_f16_range_ends)
{
    ASSERT_EQ(ct_f32_to_f16(65504.0f), 0x7bff);            /* max finite */
    ASSERT_EQ(ct_f32_to_f16(65519.99f), 0x7bff);           /* below the midpoint */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x477fefffu)), 0x7bff); /* largest float below 65520 */
    ASSERT_EQ(ct_f32_to_f16(65520.0f), 0x7c00);            /* midpoint, odd max: to inf */
    ASSERT_EQ(ct_f32_to_f16(-65520.0f), 0xfc00);
    ASSERT_EQ(ct_f32_to_f16(-65504.0f), 0xfbff);
    ASSERT_EQ(ct_f32_to_f16(65536.0f), 0x7c00);
    ASSERT_EQ(ct_f32_to_f16(100000.0f), 0x7c00);
    ASSERT_EQ(ct_f32_to_f16(-131000.0f), 0xfc00);
    ASSERT_EQ(ct_f32_to_f16(1e10f), 0x7c00);
    ASSERT_EQ(ct_f32_to_f16(3.4028235e38f), 0x7c00);
    ASSERT_EQ(ct_f32_to_f16(-3.4028235e38f), 0xfc00);

    /* Subnormals: the f16 unit in the last place below 2^-14 is 2^-24. */
    ASSERT_EQ(ct_f32_to_f16(0x1p-24f), 0x0001);
    ASSERT_EQ(ct_f32_to_f16(0x1p-25f), 0x0000);                      /* tie with 0: even */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x33000001u)), 0x0001);           /* just above 2^-25 */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x32ffffffu)), 0x0000);           /* just below */
    ASSERT_EQ(ct_f32_to_f16(-0x1p-25f), 0x8000);                     /* keeps the sign */
    ASSERT_EQ(ct_f32_to_f16(3.0f * 0x1p-25f), 0x0002);               /* 1.5 units: tie to 2 */
    ASSERT_EQ(ct_f32_to_f16(5.0f * 0x1p-25f), 0x0002);               /* 2.5 units: tie to 2 */
    ASSERT_EQ(ct_f32_to_f16(1023.0f * 0x1p-24f), 0x03ff);            /* largest subnormal */
    ASSERT_EQ(ct_f32_to_f16(0x1p-14f - 0x1p-25f), 0x0400);           /* tie into the normals */
    ASSERT_EQ(ct_f32_to_f16(0x1p-14f), 0x0400);                      /* smallest normal */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x00000001u)), 0x0000);           /* f32 subnormal */
    ASSERT_EQ(ct_f32_to_f16(f32_of(0x80000001u)), 0x8000);

    /* And back: decoded values are exact. */
    ASSERT(ct_f16_to_f32(0x0001) == 0x1p-24f);
    ASSERT(ct_f16_to_f32(0x03ff) == 1023.0f * 0x1p-24f);
    ASSERT(ct_f16_to_f32(0x0400) == 0x1p-14f);
    ASSERT(ct_f16_to_f32(0x7bff) == 65504.0f);
    ASSERT(ct_f16_to_f32(0x3c00) == 1.0f);
    ASSERT(ct_f16_to_f32(0xc000) == -2.0f);
    ASSERT(ct_f16_to_f32(0x8001) == -0x1p-24f);
}

TEST(core_f16_specials)
{
    ASSERT_EQ(ct_f32_to_f16(0.0f), 0x0000);
    ASSERT_EQ(ct_f32_to_f16(-0.0f), 0x8000);
    ASSERT_EQ(bits_of(ct_f16_to_f32(0x8000)), 0x80000000u);
    ASSERT_EQ(bits_of(ct_f16_to_f32(0x0000)), 0);
    ASSERT_EQ(ct_f32_to_f16(INFINITY), 0x7c00);
    ASSERT_EQ(ct_f32_to_f16(-INFINITY), 0xfc00);
    ASSERT(isinf(ct_f16_to_f32(0x7c00)) && ct_f16_to_f32(0x7c00) > 0);
    ASSERT(isinf(ct_f16_to_f32(0xfc00)) && ct_f16_to_f32(0xfc00) < 0);

    /* nan stays nan with its sign, also when the payload sits only in bits
     * that the narrowing drops (plain truncation would make those inf). */
    uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0x7f802000u, 0xffc00000u, 0xff800001u};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t h = ct_f32_to_f16(f32_of(nans[i]));
        ASSERT(f16_is_nan(h));
        ASSERT_EQ(h >> 15, nans[i] >> 31);
        uint16_t b = ct_f32_to_bf16(f32_of(nans[i]));
        ASSERT(bf16_is_nan(b));
        ASSERT_EQ(b >> 15, nans[i] >> 31);
    }
    uint16_t hnans[] = {0x7e00, 0x7c01, 0x7fff, 0xfe00, 0xfc01};
    for (size_t i = 0; i < sizeof hnans / sizeof hnans[0]; i++) {
        float f = ct_f16_to_f32(hnans[i]);
        ASSERT(isnan(f));
        ASSERT_EQ(!!signbit(f), hnans[i] >> 15);
        float g = ct_bf16_to_f32(hnans[i] | 0x7fc0); /* the same spirit for bf16 */
        ASSERT(isnan(g));
        ASSERT_EQ(!!signbit(g), hnans[i] >> 15);
    }
}

TEST(core_bf16_rounding_and_specials)
{
    ASSERT_EQ(ct_f32_to_bf16(1.0f), 0x3f80);
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x3f808000u)), 0x3f80); /* tie, even stays */
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x3f808001u)), 0x3f81); /* just above */
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x3f807fffu)), 0x3f80); /* just below */
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x3f818000u)), 0x3f82); /* tie, odd goes up */
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0xbf818000u)), 0xbf82);
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x3fff8000u)), 0x4000); /* carry into the exponent */
    ASSERT_EQ(ct_f32_to_bf16(-2.0f), 0xc000);
    /* max finite bf16 is 0x7f7f; the midpoint to 2^128 rounds to inf (0x7f7f is odd). */
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x7f7f0000u)), 0x7f7f);
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x7f7f7fffu)), 0x7f7f);
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x7f7f8000u)), 0x7f80);
    ASSERT_EQ(ct_f32_to_bf16(3.4028235e38f), 0x7f80);
    ASSERT_EQ(ct_f32_to_bf16(-3.4028235e38f), 0xff80);
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x7f7e8000u)), 0x7f7e); /* tie below, even stays */
    /* Subnormals (bf16 has the f32 exponent, so f32 subnormals round too). */
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x00008000u)), 0x0000);
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x00008001u)), 0x0001);
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x00018000u)), 0x0002);
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x007fffffu)), 0x0080); /* rounds up to the smallest normal */
    ASSERT_EQ(ct_f32_to_bf16(f32_of(0x80008000u)), 0x8000);
    ASSERT_EQ(ct_f32_to_bf16(0.0f), 0x0000);
    ASSERT_EQ(ct_f32_to_bf16(-0.0f), 0x8000);
    ASSERT_EQ(bits_of(ct_bf16_to_f32(0x8000)), 0x80000000u);
    ASSERT_EQ(ct_f32_to_bf16(INFINITY), 0x7f80);
    ASSERT_EQ(ct_f32_to_bf16(-INFINITY), 0xff80);
    ASSERT(isinf(ct_bf16_to_f32(0x7f80)) && ct_bf16_to_f32(0x7f80) > 0);
    ASSERT(isinf(ct_bf16_to_f32(0xff80)) && ct_bf16_to_f32(0xff80) < 0);
    ASSERT(ct_bf16_to_f32(0x3f80) == 1.0f);
    ASSERT(ct_bf16_to_f32(0x4049) == 3.140625f);
}

/* Every 16-bit pattern: the decoded value matches the IEEE formula and
 * encoding it again gives the same pattern (nan patterns give a nan). */
TEST(core_half_exhaustive_round_trip)
{
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i;
        float f = ct_f16_to_f32(h);
        if (f16_is_nan(h)) {
            ASSERT(isnan(f));
            uint16_t back = ct_f32_to_f16(f);
            ASSERT(f16_is_nan(back));
            ASSERT_EQ(back >> 15, h >> 15);
        } else if ((h & 0x7fffu) == 0x7c00u) {
            ASSERT(isinf(f));
            ASSERT_EQ(ct_f32_to_f16(f), h);
        } else {
            if ((double)f != f16_value(h) || !!signbit(f) != (h >> 15))
                ct_test_fail(__FILE__, __LINE__, "f16 %04x decodes to %.9g, want %.9g", (unsigned)h,
                             (double)f, f16_value(h));
            if (ct_f32_to_f16(f) != h)
                ct_test_fail(__FILE__, __LINE__, "f16 %04x -> %.9g -> %04x", (unsigned)h, (double)f,
                             (unsigned)ct_f32_to_f16(f));
        }

        float g = ct_bf16_to_f32(h);
        if (bf16_is_nan(h)) {
            ASSERT(isnan(g));
            uint16_t back = ct_f32_to_bf16(g);
            ASSERT(bf16_is_nan(back));
            ASSERT_EQ(back >> 15, h >> 15);
        } else {
            ASSERT_EQ(bits_of(g), (uint32_t)h << 16);
            if ((h & 0x7fffu) != 0x7f80u && (double)g != bf16_value(h))
                ct_test_fail(__FILE__, __LINE__, "bf16 %04x decodes to %.9g, want %.9g", (unsigned)h,
                             (double)g, bf16_value(h));
            if (ct_f32_to_bf16(g) != h)
                ct_test_fail(__FILE__, __LINE__, "bf16 %04x -> %.9g -> %04x", (unsigned)h, (double)g,
                             (unsigned)ct_f32_to_bf16(g));
        }
    }
}

/* A float for the random comparison.  Most draws have an exponent near the
 * f16 range (uniform bit patterns would almost never land there); some sit
 * exactly on or next to an f16 tie; the rest are arbitrary bit patterns. */
static float draw(uint64_t *s)
{
    uint64_t r = splitmix(s);
    uint32_t lo = (uint32_t)r, kind = (uint32_t)(r >> 32) & 7u, sign = (uint32_t)(r >> 40) & 1u;
    if (kind == 0) return f32_of(lo);
    if (kind <= 2) { /* tie +-0/1 ulp: f16 pattern, then the dropped 13 bits at 0x1000 */
        uint32_t e = 101u + (uint32_t)((r >> 44) % 43u); /* 2^-26 .. 2^16 */
        uint32_t u = (sign << 31) | (e << 23) | (lo & 0x7fe000u) | 0x1000u;
        return f32_of(u + (uint32_t)((int)((r >> 48) % 3u) - 1));
    }
    uint32_t e = 98u + (uint32_t)((r >> 44) % 50u); /* 2^-29 .. 2^21 */
    return f32_of((sign << 31) | (e << 23) | (lo & 0x7fffffu));
}

TEST(core_f16_random_vs_reference)
{
    f16_table_init();
    uint64_t s = 12345;
    enum { N = 3 << 20 };
    static float in[4096];
    static uint16_t out[4096], outb[4096];
    long checked = 0;
    for (long done = 0; done < N; done += 4096) {
        for (int i = 0; i < 4096; i++) in[i] = draw(&s);
        ct_f32_to_f16_n(in, out, 4096); /* the batch form must agree with the scalar one */
        ct_f32_to_bf16_n(in, outb, 4096);
        for (int i = 0; i < 4096; i++) {
            float f = in[i];
            if (isnan(f)) {
                ASSERT(f16_is_nan(out[i]) && bf16_is_nan(outb[i]));
                continue;
            }
            uint16_t want = ref_f32_to_f16(f);
            if (out[i] != want || ct_f32_to_f16(f) != want)
                ct_test_fail(__FILE__, __LINE__, "f16 of %.9g (bits %08x): got %04x, want %04x",
                             (double)f, bits_of(f), (unsigned)out[i], (unsigned)want);
            uint16_t wantb = isinf(f) ? (uint16_t)(bits_of(f) >> 16) : ref_f32_to_bf16(f);
            if (outb[i] != wantb)
                ct_test_fail(__FILE__, __LINE__, "bf16 of %.9g (bits %08x): got %04x, want %04x",
                             (double)f, bits_of(f), (unsigned)outb[i], (unsigned)wantb);
            checked++;
        }
    }
    ASSERT(checked > N / 2);
}

TEST(core_half_batch_decode)
{
    uint16_t h[5] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x8000};
    float f[5];
    ct_f16_to_f32_n(h, f, 5);
    ASSERT(f[0] == 1.0f && f[1] == -2.0f && f[2] == 65504.0f && f[3] == 0x1p-24f);
    ASSERT_EQ(bits_of(f[4]), 0x80000000u);
    uint16_t b[3] = {0x3f80, 0xc040, 0x0000};
    ct_bf16_to_f32_n(b, f, 3);
    ASSERT(f[0] == 1.0f && f[1] == -3.0f && f[2] == 0.0f);
}

/* The bulk bf16 conversions (vectorised where the CPU allows) agree bit for
 * bit with the scalar ones on every edge case: ties, the largest finite
 * values rounding to inf, subnormals (which VCVTNEPS2BF16 would flush), nan
 * payloads of both signs; at every alignment and length around the vector
 * width. */
TEST(core_bf16_batch_matches_scalar)
{
    static const uint32_t exps[] = {0x00, 0x01, 0x02, 0x7e, 0x7f, 0x80, 0xfe, 0xff};
    static const uint32_t mants[] = {0x000000, 0x000001, 0x007fff, 0x008000, 0x008001, 0x00ffff,
                                     0x017fff, 0x018000, 0x018001, 0x3fffff, 0x400000, 0x400001,
                                     0x7f7fff, 0x7f8000, 0x7fff80, 0x7fffff};
    enum { NS = 2 * 8 * 16, NR = 4096, N = NS + NR };
    static uint32_t bits[N];
    static float in[N + 4];
    static uint16_t out[N + 4];
    int n = 0;
    for (uint32_t s = 0; s < 2; s++)
        for (size_t e = 0; e < sizeof exps / sizeof exps[0]; e++)
            for (size_t m = 0; m < sizeof mants / sizeof mants[0]; m++)
                bits[n++] = s << 31 | exps[e] << 23 | mants[m];
    uint64_t st = 99;
    while (n < N) bits[n++] = (uint32_t)splitmix(&st);
    for (int off = 0; off < 4; off++)
        for (int len = 0; len <= N - off; len += len < 70 ? 1 : 997) {
            for (int i = 0; i < len; i++) in[off + i] = f32_of(bits[i]);
            out[off + len] = 0xbeef;
            ct_f32_to_bf16_n(in + off, out + off, (size_t)len);
            ASSERT_EQ(out[off + len], 0xbeef); /* nothing written past the end */
            for (int i = 0; i < len; i++)
                if (out[off + i] != ct_f32_to_bf16(f32_of(bits[i])))
                    ct_test_fail(__FILE__, __LINE__, "bf16 of bits %08x at offset %d length %d: "
                                 "batch %04x, scalar %04x", bits[i], off, len,
                                 (unsigned)out[off + i], (unsigned)ct_f32_to_bf16(f32_of(bits[i])));
        }
    /* Every bf16 pattern decodes the same in bulk. */
    static uint16_t h[65536 + 3];
    static float f[65536 + 3];
    for (int off = 0; off < 3; off++) {
        for (int i = 0; i < 65536; i++) h[off + i] = (uint16_t)i;
        ct_bf16_to_f32_n(h + off, f + off, 65536 - off);
        for (int i = 0; i < 65536 - off; i++)
            if (bits_of(f[off + i]) != bits_of(ct_bf16_to_f32((uint16_t)i)))
                ct_test_fail(__FILE__, __LINE__, "bf16 %04x decodes to %08x in bulk", i,
                             bits_of(f[off + i]));
    }
}

/* ct_f32_to_bf16_rows against the scalar cast and column sums taken down
 * the rows in order (bit for bit; a nan sum only has to be nan), on odd and
 * vector-sized shapes with specials mixed in, each output on or off; nothing
 * is written past either output. */
TEST(core_bf16_rows_cast_and_colsum)
{
    static const int dims[] = {1, 3, 15, 16, 17, 33, 70};
    enum { ND = sizeof dims / sizeof dims[0] };
    uint64_t st = 7;
    for (int a = 0; a < ND; a++)
        for (int b = 0; b < ND; b++)
            for (int want = 1; want < 4; want++) {
                int rows = dims[a], cols = dims[b], n = rows * cols;
                float *x = malloc(sizeof(float) * (size_t)n), *cs = malloc(sizeof(float) * (size_t)(cols + 1));
                float *ref = malloc(sizeof(float) * (size_t)cols);
                uint16_t *y = malloc(2 * (size_t)(n + 1));
                ASSERT(x && cs && ref && y);
                for (int i = 0; i < n; i++) {
                    uint32_t r = (uint32_t)splitmix(&st);
                    /* mostly ordinary values; now and then a nan, an inf or a subnormal */
                    x[i] = r % 29 == 0 ? f32_of(0x7fc00001u | (r & 0x80000000u))
                           : r % 31 == 0 ? f32_of(0x7f800000u | (r & 0x80000000u))
                           : r % 37 == 0 ? f32_of(r & 0x807fffffu)
                                         : f32_of((r & 0x807fffffu) | 0x3f000000u) * 4.0f;
                }
                for (int j = 0; j < cols; j++) cs[j] = ref[j] = (float)j * 0.5f;
                cs[cols] = 42.0f;
                y[n] = 0xbeef;
                for (int r = 0; r < rows; r++)
                    for (int j = 0; j < cols; j++) ref[j] += x[r * cols + j];
                ct_f32_to_bf16_rows(x, rows, cols, want & 1 ? y : NULL, want & 2 ? cs : NULL);
                ASSERT(y[n] == 0xbeef && cs[cols] == 42.0f);
                for (int i = 0; i < n && (want & 1); i++)
                    if (y[i] != ct_f32_to_bf16(x[i]))
                        ct_test_fail(__FILE__, __LINE__, "%dx%d: element %d: cast %04x, want %04x", rows, cols, i,
                                     (unsigned)y[i], (unsigned)ct_f32_to_bf16(x[i]));
                for (int j = 0; j < cols && (want & 2); j++)
                    if (memcmp(&cs[j], &ref[j], sizeof(float)) && !(isnan(cs[j]) && isnan(ref[j])))
                        ct_test_fail(__FILE__, __LINE__, "%dx%d: column %d sums to %.9g, want %.9g", rows, cols, j,
                                     (double)cs[j], (double)ref[j]);
                free(x), free(cs), free(ref), free(y);
            }
}

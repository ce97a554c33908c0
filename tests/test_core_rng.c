/*
 * Tests of the counter-based RNG (src/core/rng.c): Philox4x32-10 against the
 * known-answer vectors of the Random123 distribution, then the stream
 * properties the rest of ctrain relies on (reproducible, sliceable by offset,
 * independent streams) and the first two moments of the distributions.
 */
#include <stdint.h>
#include <stdlib.h>

#include "core/internal.h" /* ct__rng_path */
#include "test.h"

/* Philox4x32-10 known answers: counter (4 words), key (2 words), expected
 * output (4 words).  The first three are the "philox4x32 10" lines of
 * Random123's kat_vectors file, as quoted in DEShawResearch/Random123-Boost,
 * libs/random/test/test_philox.cpp ("cut-and-pasted from the kat_vectors
 * file in the original Random123 distribution").  The others come from the
 * extended kat_vectors in girving/random123-manual, examples/kat_vectors;
 * they set one key word at a time and so pin down the key word order.
 * ct_philox4x32 takes the key as a uint64: key word 0 is its low half. */
static const struct {
    uint32_t ctr[4], key[2], out[4];
} kat[] = {
    {{0x00000000, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000000},
     {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
    {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
     {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
     {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    {{0x00000001, 0x00000000, 0x00000000, 0x00000000}, {0x00000001, 0x00000000},
     {0xac08141b, 0xdfc5ccbe, 0x79c07a47, 0xa7f66093}},
    {{0x00000001, 0x00000000, 0x00000000, 0x00000000}, {0x00000000, 0x00000001},
     {0xccf3076a, 0x6306f434, 0xbea71965, 0xd96fe48a}},
    {{0x00000000, 0x00000000, 0x00000000, 0x80000000}, {0x00000000, 0xffffffff},
     {0x2a460458, 0x0a2709e5, 0x47bc9115, 0x0f96d8af}},
    {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0x00000000, 0x80000000},
     {0x63675d2c, 0x422d7c4d, 0x3145d30d, 0x3bce33a4}},
};

TEST(core_philox_known_answers)
{
    for (size_t i = 0; i < sizeof kat / sizeof kat[0]; i++) {
        uint64_t key = (uint64_t)kat[i].key[0] | (uint64_t)kat[i].key[1] << 32;
        uint32_t out[4];
        ct_philox4x32(key, kat[i].ctr, out);
        for (int j = 0; j < 4; j++)
            if (out[j] != kat[i].out[j])
                ct_test_fail(__FILE__, __LINE__, "vector %zu word %d: %08x, want %08x", i, j, out[j],
                             kat[i].out[j]);
    }
}

TEST(core_rng_reproducible_and_sliceable)
{
    enum { N = 1000 };
    float a[N], b[N];
    ct_rng r1, r2;
    ct_rng_init(&r1, 42, 7);
    ct_rng_init(&r2, 42, 7);
    ASSERT_EQ(r1.offset, 0);
    ct_rng_uniform(&r1, a, N);
    ct_rng_uniform(&r2, b, N);
    ASSERT(!memcmp(a, b, sizeof a));
    ASSERT_EQ(r1.offset, N);

    /* Draws of 10 then 5 equal one draw of 15, and so on for odd cuts that
     * straddle the 4-word Philox blocks. */
    float whole[15], part[15];
    ct_rng_init(&r1, 42, 7);
    ct_rng_uniform(&r1, whole, 15);
    ct_rng_init(&r2, 42, 7);
    ct_rng_uniform(&r2, part, 10);
    ct_rng_uniform(&r2, part + 10, 5);
    ASSERT(!memcmp(whole, part, sizeof whole));
    ASSERT_EQ(r2.offset, 15);
    ct_rng_init(&r2, 42, 7);
    size_t cuts[] = {1, 2, 3, 1, 5, 0, 3};
    size_t at = 0;
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        ct_rng_uniform(&r2, part + at, cuts[i]);
        at += cuts[i];
    }
    ASSERT_EQ(at, 15);
    ASSERT(!memcmp(whole, part, sizeof whole));

    /* Element i depends only on (seed, stream, i): starting at an offset
     * gives the tail of the long draw. */
    ct_rng_init(&r2, 42, 7);
    r2.offset = 777;
    ct_rng_uniform(&r2, b, N - 777);
    ASSERT(!memcmp(a + 777, b, (N - 777) * sizeof(float)));
}

/* Word i of stream (seed, stream) straight from the Philox block it sits in,
 * as the float ct_rng_uniform makes of it: the reference its vector paths
 * must match bit for bit. */
static float reference_uniform(uint64_t seed, uint64_t stream, uint64_t i)
{
    uint64_t blk = i >> 2;
    uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), (uint32_t)stream, (uint32_t)(stream >> 32)}, w[4];
    ct_philox4x32(seed, ctr, w);
    return (float)(w[i & 3] >> 8) * (1.0f / 16777216.0f);
}

/* Draws n words at offset off and fails on the first that differs from the
 * reference, on a write past the n-th, or on the offset not advancing by n. */
static void check_draw(uint64_t seed, uint64_t stream, uint64_t off, size_t n, float *buf)
{
    const float canary = -1.0f;
    ct_rng r;
    ct_rng_init(&r, seed, stream);
    r.offset = off;
    for (size_t i = 0; i < n + 17; i++) buf[i] = canary;
    ct_rng_uniform(&r, buf, n);
    for (size_t i = 0; i < n; i++) {
        float want = reference_uniform(seed, stream, off + i);
        if (memcmp(&buf[i], &want, sizeof want))
            ct_test_fail(__FILE__, __LINE__, "%s path: seed %llx stream %llx offset %llu n %zu: word %zu is %.9g, want %.9g",
                         ct__rng_path(), (unsigned long long)seed, (unsigned long long)stream,
                         (unsigned long long)off, n, i, (double)buf[i], (double)want);
    }
    for (size_t i = n; i < n + 17; i++)
        if (buf[i] != canary)
            ct_test_fail(__FILE__, __LINE__, "%s path: offset %llu n %zu wrote word %zu", ct__rng_path(),
                         (unsigned long long)off, n, i);
    ASSERT_EQ(r.offset, off + n);
}

/* The path ct_rng_uniform takes after CTRAIN_RNG_ISA=isa (NULL: unset) must
 * be want, and give the reference's floats for every offset within and
 * across blocks and vectors (16 words at AVX-512, 8 at AVX2, 8 vectors at a
 * time), every short count, long ones, and an offset about to wrap at 2^64. */
static void check_path(const char *isa, const char *want, int cpu_has)
{
    if (!cpu_has) SKIP("this CPU lacks %s", want);
    if (isa) setenv("CTRAIN_RNG_ISA", isa, 1);
    else unsetenv("CTRAIN_RNG_ISA");
    ASSERT(!strcmp(ct__rng_path(), want));
    enum { MAXN = 4099 };
    float *buf = malloc((MAXN + 17) * sizeof *buf);
    ASSERT(buf != NULL);
    const uint64_t seeds[] = {0, 1, 0xdeadbeefcafef00dull, UINT64_MAX};
    const uint64_t streams[] = {0, 7, (uint64_t)5 << 32 | 3, UINT64_MAX};
    const uint64_t offs[] = {0, 1, 2, 3, 4, 5, 6, 7, 9, 13, 15, 16, 17, 30, 31, 63, 64, 65, 127, 128, 129,
                             1000003, (uint64_t)1 << 34 | 2, UINT64_MAX - 200, UINT64_MAX - 2};
    const size_t longs[] = {127, 128, 129, 255, 256, 257, 511, 1000, 1024, 4096, MAXN};
    for (size_t a = 0; a < sizeof seeds / sizeof seeds[0]; a++)
        for (size_t b = 0; b < sizeof streams / sizeof streams[0]; b++)
            for (size_t o = 0; o < sizeof offs / sizeof offs[0]; o++) {
                for (size_t n = 0; n <= 100; n++) check_draw(seeds[a], streams[b], offs[o], n, buf);
                for (size_t k = 0; k < sizeof longs / sizeof longs[0]; k++)
                    check_draw(seeds[a], streams[b], offs[o], longs[k], buf);
            }
    /* Draws one after another, of every length up to 70, carry on the stream. */
    ct_rng r;
    ct_rng_init(&r, 42, 9);
    for (size_t n = 0, at = 0; n <= 70; at += n, n++) {
        ct_rng_uniform(&r, buf, n);
        for (size_t i = 0; i < n; i++) {
            float want = reference_uniform(42, 9, at + i);
            if (memcmp(&buf[i], &want, sizeof want))
                ct_test_fail(__FILE__, __LINE__, "%s path: the draw of %zu at %zu differs at word %zu",
                             ct__rng_path(), n, at, i);
        }
    }
    free(buf);
}

TEST(core_rng_uniform_widest_path_matches_philox)
{
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f"), avx2 = __builtin_cpu_supports("avx2");
    check_path(NULL, avx512 ? "avx512" : avx2 ? "avx2" : "portable", 1);
}

TEST(core_rng_uniform_avx2_path_matches_philox)
{
    __builtin_cpu_init();
    check_path("avx2", "avx2", __builtin_cpu_supports("avx2"));
}

TEST(core_rng_uniform_portable_path_matches_philox)
{
    check_path("portable", "portable", 1);
}

TEST(core_rng_streams_and_seeds_differ)
{
    enum { N = 256 };
    float base[N], other[N];
    ct_rng r;
    ct_rng_init(&r, 1, 0);
    ct_rng_uniform(&r, base, N);
    uint64_t variants[][2] = {{1, 1}, {1, (uint64_t)1 << 32}, {2, 0}, {(uint64_t)1 | (uint64_t)1 << 32, 0}};
    for (size_t v = 0; v < sizeof variants / sizeof variants[0]; v++) {
        ct_rng_init(&r, variants[v][0], variants[v][1]);
        ct_rng_uniform(&r, other, N);
        int same = 0;
        for (int i = 0; i < N; i++) same += base[i] == other[i];
        /* Independent streams agree on a value about N/2^24 times. */
        if (same > 2)
            ct_test_fail(__FILE__, __LINE__, "seed %llu stream %llu matches seed 1 stream 0 in %d of %d",
                         (unsigned long long)variants[v][0], (unsigned long long)variants[v][1], same, N);
    }
}

TEST(core_rng_uniform_moments)
{
    enum { N = 1000000 };
    float *u = malloc(N * sizeof *u);
    ASSERT(u != NULL);
    ct_rng r;
    ct_rng_init(&r, 2024, 3);
    ct_rng_uniform(&r, u, N);
    double sum = 0, sq = 0, lo = 1, hi = 0;
    long below_tenth = 0;
    for (int i = 0; i < N; i++) {
        if (!(u[i] >= 0.0f && u[i] < 1.0f)) {
            float v = u[i];
            free(u);
            ct_test_fail(__FILE__, __LINE__, "uniform[%d] = %.9g is outside [0, 1)", i, (double)v);
        }
        sum += u[i];
        sq += (double)u[i] * u[i];
        lo = fmin(lo, u[i]);
        hi = fmax(hi, u[i]);
        below_tenth += u[i] < 0.1f;
    }
    free(u);
    double mean = sum / N, var = sq / N - mean * mean;
    /* Standard errors: mean 0.289/sqrt(N) = 2.9e-4, variance ~7.5e-5. */
    ASSERT_NEAR(mean, 0.5, 2e-3);
    ASSERT_NEAR(var, 1.0 / 12.0, 6e-4);
    ASSERT_NEAR((double)below_tenth / N, 0.1, 2e-3);
    ASSERT(lo < 1e-4 && hi > 1 - 1e-4);
}

TEST(core_rng_normal_moments)
{
    enum { N = 1000000 };
    float *x = malloc(N * sizeof *x);
    ASSERT(x != NULL);
    ct_rng r;
    ct_rng_init(&r, 99, 5);
    ct_rng_normal(&r, x, N, 2.0f, 3.0f);
    ASSERT_EQ(r.offset, N);
    double sum = 0, sq = 0, m4 = 0;
    long within1 = 0;
    int finite = 1;
    for (int i = 0; i < N; i++) {
        finite &= isfinite(x[i]) != 0;
        double z = (x[i] - 2.0) / 3.0;
        sum += x[i];
        sq += (double)x[i] * x[i];
        m4 += z * z * z * z;
        within1 += fabs(z) < 1.0;
    }
    free(x);
    ASSERT(finite);
    double mean = sum / N, sd = sqrt(sq / N - mean * mean);
    ASSERT_NEAR(mean, 2.0, 0.015);               /* 5 standard errors of 3/sqrt(N) */
    ASSERT_NEAR(sd, 3.0, 0.015);
    ASSERT_NEAR((double)within1 / N, 0.682689, 0.003); /* P(|z| < 1) */
    ASSERT_NEAR(m4 / N, 3.0, 0.05);              /* kurtosis of a normal */
}

TEST(core_rng_normal_odd_count)
{
    /* An odd count uses the pair's second value slot but still advances by a
     * whole pair, and its values are a prefix of the even draw. */
    float five[5], six[6];
    ct_rng r;
    ct_rng_init(&r, 5, 5);
    ct_rng_normal(&r, five, 5, 0.0f, 1.0f);
    ASSERT_EQ(r.offset, 6);
    ct_rng_init(&r, 5, 5);
    ct_rng_normal(&r, six, 6, 0.0f, 1.0f);
    ASSERT(!memcmp(five, six, sizeof five));
    /* std scales and mean shifts the same underlying draw */
    float scaled[6];
    ct_rng_init(&r, 5, 5);
    ct_rng_normal(&r, scaled, 6, 1.0f, 2.0f);
    for (int i = 0; i < 6; i++) ASSERT_NEAR(scaled[i], 1.0 + 2.0 * six[i], 1e-5);
}

TEST(core_hash64_fnv1a)
{
    /* Reference values of 64-bit FNV-1a (offset basis 0xcbf29ce484222325,
     * prime 0x100000001b3); "" is the offset basis itself. */
    ASSERT_EQ(ct_hash64("", 0), 0xcbf29ce484222325ull);
    ASSERT_EQ(ct_hash64("a", 1), 0xaf63dc4c8601ec8cull);
    ASSERT_EQ(ct_hash64("foobar", 6), 0x85944171f73967e8ull);
    ASSERT_EQ(ct_hash64("layers.0.weight", 15), 0x718a5d75ec8bf0d9ull);
}

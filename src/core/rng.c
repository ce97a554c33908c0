/*
 * Counter-based RNG: Philox 4x32-10 (Salmon et al., "Parallel random numbers:
 * as easy as 1, 2, 3").  Element i of stream (seed, stream) is a pure function
 * of the three, so recomputing dropout or restarting from a checkpoint draws
 * the same numbers without carrying generator state around.
 */
#include "ctrain/core.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static inline void mulhilo(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo)
{
    uint64_t p = (uint64_t)a * b;
    *hi = (uint32_t)(p >> 32);
    *lo = (uint32_t)p;
}

void ct_philox4x32(uint64_t key, const uint32_t ctr[4], uint32_t out[4])
{
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
    for (int r = 0; r < 10; r++) {
        uint32_t hi0, lo0, hi1, lo1;
        mulhilo(0xD2511F53u, c0, &hi0, &lo0);
        mulhilo(0xCD9E8D57u, c2, &hi1, &lo1);
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

void ct_rng_init(ct_rng *r, uint64_t seed, uint64_t stream)
{
    r->seed = seed;
    r->stream = stream;
    r->offset = 0;
}

/* Word at absolute index i of the stream. */
static void block_at(const ct_rng *r, uint64_t blk, uint32_t out[4])
{
    uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), (uint32_t)r->stream,
                       (uint32_t)(r->stream >> 32)};
    ct_philox4x32(r->seed, ctr, out);
}

/* The portable path: one block at a time.  The vector paths below must give
 * these floats bit for bit. */
static void uniform_portable(ct_rng *r, float *out, size_t n)
{
    uint32_t w[4];
    uint64_t cached = UINT64_MAX;
    for (size_t i = 0; i < n; i++) {
        uint64_t idx = r->offset + i, blk = idx >> 2;
        if (blk != cached) { block_at(r, blk, w); cached = blk; }
        out[i] = (float)(w[idx & 3] >> 8) * (1.0f / 16777216.0f);
    }
    r->offset += n;
}

/* The same numbers many blocks at a time (rng_lanes.h), built for AVX-512
 * and AVX2 whatever -march says and chosen at run time, so one binary runs
 * on any x86-64.  Its constants, 64 bytes each (the AVX2 body reads the
 * first 32): a 128-bit lane holds one block; Philox's multipliers and the
 * Weyl steps of its key sit in words 0 and 2; odd marks the high 64-bit half
 * of each lane, shift takes the seed's low word to the low half and its high
 * word to the high half, block numbers the lanes' blocks. */
static const uint32_t lanes_mul[16] = {0xD2511F53u, 0, 0xCD9E8D57u, 0, 0xD2511F53u, 0, 0xCD9E8D57u, 0,
                                       0xD2511F53u, 0, 0xCD9E8D57u, 0, 0xD2511F53u, 0, 0xCD9E8D57u, 0};
static const uint32_t lanes_weyl[16] = {0x9E3779B9u, 0, 0xBB67AE85u, 0, 0x9E3779B9u, 0, 0xBB67AE85u, 0,
                                        0x9E3779B9u, 0, 0xBB67AE85u, 0, 0x9E3779B9u, 0, 0xBB67AE85u, 0};
static const uint64_t lanes_odd[8] = {0, UINT64_MAX, 0, UINT64_MAX, 0, UINT64_MAX, 0, UINT64_MAX};
static const uint64_t lanes_shift[8] = {0, 32, 0, 32, 0, 32, 0, 32};
static const uint64_t lanes_block[8] = {0, 0, 1, 0, 2, 0, 3, 0};

#if defined(__clang__) /* clang ignores GCC's target pragma (make fuzz builds with clang) */
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif
#define LANES_BYTES 64
#define LANES_INT __m512i
#define LANES_MUL _mm512_mul_epu32
#define LANES_SWAP(v) _mm512_shuffle_epi32(v, 0x1B)
#define LANES_NAME(f) f##_avx512
#include "rng_lanes.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#if defined(__clang__) /* clang ignores GCC's target pragma (make fuzz builds with clang) */
#pragma clang attribute push(__attribute__((target("avx2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2")
#endif
#define LANES_BYTES 32
#define LANES_INT __m256i
#define LANES_MUL _mm256_mul_epu32
#define LANES_SWAP(v) _mm256_shuffle_epi32(v, 0x1B)
#define LANES_NAME(f) f##_avx2
#include "rng_lanes.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

typedef void (*uniform_fn)(uint64_t seed, uint64_t stream, uint64_t blk, float *out, size_t n);

static const struct rng_path {
    const char *name;
    uniform_fn fn; /* NULL: the portable path */
} paths[] = {{"portable", NULL}, {"avx2", uniform_avx2}, {"avx512", uniform_avx512}};

/* The widest path this CPU runs, asked once: cpuid and getenv cost more
 * than drawing the two numbers ct_rng_normal asks for at a time.
 * CTRAIN_RNG_ISA=portable or avx2 caps it (tests hold each path against
 * the portable one). */
static const struct rng_path *rng_path(void)
{
    static int chosen = -1;
    int c = __atomic_load_n(&chosen, __ATOMIC_RELAXED);
    if (c < 0) {
        c = ct__cpu_has(CT__CPU_AVX512F) ? 2 : ct__cpu_has(CT__CPU_AVX2) ? 1 : 0;
        const char *e = getenv("CTRAIN_RNG_ISA");
        for (int i = 0; e && i < c; i++)
            if (!strcmp(e, paths[i].name)) c = i;
        __atomic_store_n(&chosen, c, __ATOMIC_RELAXED);
    }
    return &paths[c];
}

const char *ct__rng_path(void) { return rng_path()->name; }

void ct_rng_uniform(ct_rng *r, float *out, size_t n)
{
    uniform_fn fn = rng_path()->fn;
    /* The portable path up to a block boundary, then whole vectors up to
     * where the word index wraps at 2^64 (the block index wraps with it
     * there, not 4 blocks later), then the portable path again for the rest. */
    size_t head = (size_t)(-r->offset & 3);
    if (!fn || head >= n) {
        uniform_portable(r, out, n);
        return;
    }
    uniform_portable(r, out, head);
    uint64_t room = r->offset ? -r->offset : UINT64_MAX;
    size_t body = n - head < room ? n - head : (size_t)room;
    fn(r->seed, r->stream, r->offset >> 2, out + head, body);
    r->offset += body;
    uniform_portable(r, out + head + body, n - head - body);
}

void ct_rng_normal(ct_rng *r, float *out, size_t n, float mean, float std)
{
    for (size_t i = 0; i < n; i += 2) {
        float u[2];
        ct_rng_uniform(r, u, 2);
        double u1 = 1.0 - (double)u[0]; /* (0,1]: log is finite */
        double rad = sqrt(-2.0 * log(u1)), th = 2.0 * M_PI * (double)u[1];
        out[i] = mean + std * (float)(rad * cos(th));
        if (i + 1 < n) out[i + 1] = mean + std * (float)(rad * sin(th));
    }
}

uint64_t ct_hash64(const void *data, size_t n)
{
    const unsigned char *p = data;
    uint64_t h = 14695981039346656037ull; /* the FNV-1a 64-bit offset basis */
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 1099511628211ull; }
    return h;
}

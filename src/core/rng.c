/*
 * Counter-based RNG: Philox 4x32-10 (Salmon et al., "Parallel random numbers:
 * as easy as 1, 2, 3").  Element i of stream (seed, stream) is a pure function
 * of the three, so recomputing dropout or restarting from a checkpoint draws
 * the same numbers without carrying generator state around.
 */
#include "ctrain/core.h"

#include <math.h>

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

void ct_rng_uniform(ct_rng *r, float *out, size_t n)
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

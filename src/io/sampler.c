/*
 * The deterministic data-parallel sampler.  An epoch's order is a
 * Fisher-Yates shuffle driven by Philox words of the stream
 * (seed, SAMPLER_STREAM + epoch), so it is a pure function of (seed, epoch)
 * and every rank computes the same permutation without talking.  Ranks then
 * cut each global batch into contiguous slices, which keeps the samples of
 * every step, and their order, independent of the world size.
 */
#include "ctrain/io.h"

#include <string.h>

/* "sampler" in ASCII: keeps these streams apart from other users of a seed. */
#define SAMPLER_STREAM 0x73616d706c657200ull

__extension__ typedef unsigned __int128 u128;

/* Next 64 bits of the stream: words offset and offset+1, counted like ct_rng. */
static uint64_t next64(ct_rng *r)
{
    uint32_t w[4], out[2];
    for (int k = 0; k < 2; k++) {
        uint64_t idx = r->offset++, blk = idx >> 2;
        uint32_t ctr[4] = {(uint32_t)blk, (uint32_t)(blk >> 32), (uint32_t)r->stream,
                           (uint32_t)(r->stream >> 32)};
        ct_philox4x32(r->seed, ctr, w);
        out[k] = w[idx & 3];
    }
    return (uint64_t)out[0] | (uint64_t)out[1] << 32;
}

/* Uniform integer in [0, bound) without bias (Lemire's multiply-and-reject). */
static uint64_t below(ct_rng *r, uint64_t bound)
{
    u128 m = (u128)next64(r) * bound;
    uint64_t lo = (uint64_t)m;
    if (lo < bound) {
        uint64_t t = (0 - bound) % bound;
        while (lo < t) {
            m = (u128)next64(r) * bound;
            lo = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

ct_status ct_sampler_init(ct_sampler *s, int64_t n, int64_t batch, uint64_t seed,
                          int shuffle, int drop_last)
{
    CT_ASSERT(s);
    memset(s, 0, sizeof *s);
    if (n < 0 || n > INT64_MAX / 8)
        return ct_error(CT_EINVAL, "sampler over %lld samples; the count must be in [0, 2^60)", (long long)n);
    if (batch < 1)
        return ct_error(CT_EINVAL, "batch size is %lld; it must be at least 1", (long long)batch);
    s->n = n;
    s->batch = batch;
    s->seed = seed;
    s->shuffle = shuffle != 0;
    s->drop_last = drop_last != 0;
    s->perm = ct_alloc_zeroed((size_t)n * sizeof *s->perm + 1, CT_MEM_OTHER);
    if (!s->perm) return CT_ENOMEM;
    ct_status st = ct_sampler_set_epoch(s, 0);
    if (st != CT_OK) ct_sampler_fini(s);
    return st;
}

void ct_sampler_fini(ct_sampler *s)
{
    if (!s) return;
    ct_free(s->perm);
    memset(s, 0, sizeof *s);
}

ct_status ct_sampler_set_epoch(ct_sampler *s, int64_t epoch)
{
    CT_ASSERT(s && s->perm);
    if (epoch < 0) return ct_error(CT_EINVAL, "epoch is %lld; it must be >= 0", (long long)epoch);
    s->epoch = epoch;
    for (int64_t i = 0; i < s->n; i++) s->perm[i] = i;
    if (!s->shuffle) return CT_OK;
    ct_rng r;
    ct_rng_init(&r, s->seed, SAMPLER_STREAM + (uint64_t)epoch);
    for (int64_t i = s->n - 1; i > 0; i--) {
        int64_t j = (int64_t)below(&r, (uint64_t)i + 1);
        int64_t t = s->perm[i];
        s->perm[i] = s->perm[j];
        s->perm[j] = t;
    }
    return CT_OK;
}

int64_t ct_sampler_nbatches(const ct_sampler *s)
{
    return s->drop_last ? s->n / s->batch : (s->n + s->batch - 1) / s->batch;
}

int64_t ct_sampler_batch_size(const ct_sampler *s, int64_t b)
{
    if (b < 0 || b >= ct_sampler_nbatches(s)) return 0;
    int64_t left = s->n - b * s->batch;
    return left < s->batch ? left : s->batch;
}

/* The first g % world ranks take one sample more. */
int64_t ct_sampler_first(const ct_sampler *s, int64_t b, int rank, int world)
{
    int64_t g = ct_sampler_batch_size(s, b), q = g / world, rem = g % world;
    return rank * q + (rank < rem ? rank : rem);
}

ct_status ct_sampler_batch(const ct_sampler *s, int64_t b, int rank, int world,
                           int64_t *idx, int64_t *count)
{
    CT_ASSERT(s && s->perm && count);
    *count = 0;
    if (world < 1 || rank < 0 || rank >= world)
        return ct_error(CT_EINVAL, "rank %d of a world of %d does not exist", rank, world);
    int64_t nb = ct_sampler_nbatches(s);
    if (b < 0 || b >= nb)
        return ct_error(CT_EINVAL, "batch %lld is out of range: epoch %lld has %lld batches",
                        (long long)b, (long long)s->epoch, (long long)nb);
    int64_t g = ct_sampler_batch_size(s, b), q = g / world, rem = g % world;
    int64_t start = ct_sampler_first(s, b, rank, world), len = q + (rank < rem);
    CT_ASSERT(idx || len == 0);
    if (len) memcpy(idx, s->perm + b * s->batch + start, (size_t)len * sizeof *idx);
    *count = len;
    return CT_OK;
}

/*
 * Philox 4x32-10 on a whole vector of blocks: the body of ct_rng_uniform for
 * one x86 vector width.  src/core/rng.c includes this file once per width,
 * inside #pragma GCC target for that width, after defining
 *   LANES_BYTES    the width in bytes (64: AVX-512, 32: AVX2)
 *   LANES_INT      its integer vector type (__m512i, __m256i)
 *   LANES_MUL      its 32x32->64 product of the even words of two of them
 *   LANES_SWAP     its reversal of the four words of each 128-bit lane
 *   LANES_NAME(f)  f with the width's suffix
 * and undefines them at its end.  Everything else is GCC vector arithmetic, the same text at either width.
 *
 * A vector holds LANES_BYTES / 16 blocks, a block's four words in a 128-bit
 * lane in stream order, so the result stores as it is.  That layout suits
 * Philox: the words it multiplies (0 and 2) are the even ones the vector
 * product takes, and a round is one product, one shuffle within the lane,
 * one shift and an xor.
 */

typedef uint32_t LANES_NAME(u32v) __attribute__((vector_size(LANES_BYTES)));
typedef uint64_t LANES_NAME(u64v) __attribute__((vector_size(LANES_BYTES)));
typedef int32_t LANES_NAME(i32v) __attribute__((vector_size(LANES_BYTES)));
typedef float LANES_NAME(f32v) __attribute__((vector_size(LANES_BYTES)));

/* Ten rounds on m vectors of blocks.  key holds the key in words 0 and 2 of
 * every lane and grows by the Weyl constants after each round. */
static inline __attribute__((always_inline)) void LANES_NAME(rounds)(LANES_NAME(u32v) *x, int m,
                                                                     LANES_NAME(u32v) key)
{
    typedef LANES_NAME(u32v) u32v;
    typedef LANES_NAME(u64v) u64v;
    u32v mul, weyl;
    memcpy(&mul, lanes_mul, sizeof mul);
    memcpy(&weyl, lanes_weyl, sizeof weyl);
    for (int r = 0; r < 10; r++, key += weyl)
        for (int j = 0; j < m; j++) {
            /* p = [lo0, hi0, lo1, hi1]; next = [hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0] */
            u32v p = (u32v)LANES_MUL((LANES_INT)x[j], (LANES_INT)mul);
            x[j] = (u32v)LANES_SWAP((LANES_INT)p) ^ (u32v)((u64v)x[j] >> 32) ^ key;
        }
}

/* The first n words of m vectors as uniform floats, made as the scalar path
 * makes them ((w >> 8) * 2^-24, exact in float). */
static inline __attribute__((always_inline)) void LANES_NAME(store)(const LANES_NAME(u32v) *x, int m, float *out,
                                                                    size_t n)
{
    typedef LANES_NAME(i32v) i32v;
    typedef LANES_NAME(f32v) f32v;
    for (int j = 0; j < m; j++) {
        f32v f = __builtin_convertvector((i32v)(x[j] >> 8), f32v) * (1.0f / 16777216.0f);
        size_t w = sizeof f / 4, k = (size_t)j * w;
        memcpy(out + k, &f, (n - k < w ? n - k : w) * 4);
    }
}

/* n words of stream (seed, stream) from block blk on (the caller keeps the
 * 64-bit counter from wrapping) as uniform floats into out. */
static void LANES_NAME(uniform)(uint64_t seed, uint64_t stream, uint64_t blk, float *out, size_t n)
{
    typedef LANES_NAME(u32v) u32v;
    typedef LANES_NAME(u64v) u64v;
    enum { W = LANES_BYTES / 4, U = 8 }; /* words a vector; vectors in flight, to hide the product's latency */
    u64v odd, shift, first;
    memcpy(&odd, lanes_odd, sizeof odd);
    memcpy(&shift, lanes_shift, sizeof shift);
    memcpy(&first, lanes_block, sizeof first);
    u32v key = (u32v)(((seed + (u64v){}) >> shift) & 0xffffffffu); /* [lo(seed), 0, hi(seed), 0] */
    /* A lane's words 0-1 are its block, 2-3 the stream. */
    u64v ctr = ((blk + first) & ~odd) | (stream & odd), step = (W / 4) & ~odd;
    size_t i = 0;
    for (; n - i >= (size_t)(U * W); i += U * W) {
        u32v x[U];
        for (int j = 0; j < U; j++, ctr += step) x[j] = (u32v)ctr;
        LANES_NAME(rounds)(x, U, key);
        LANES_NAME(store)(x, U, out + i, U * W);
    }
    for (; i < n; i += W, ctr += step) {
        u32v x[1] = {(u32v)ctr};
        LANES_NAME(rounds)(x, 1, key);
        LANES_NAME(store)(x, 1, out + i, n - i);
    }
}

#undef LANES_BYTES
#undef LANES_INT
#undef LANES_MUL
#undef LANES_SWAP
#undef LANES_NAME

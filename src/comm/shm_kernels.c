/*
 * The arithmetic of the shared-memory paths: reductions across ranks'
 * buffers, blocked so the accumulator stays in L1, and how a range is split
 * into per-rank slices on cache-line boundaries.
 *
 * Order: element i of the result is ((src0 + src1) + src2) + ... in source
 * (rank) order, one rank computing it once, so every copy of the result is
 * the same bits; with two sources an f32 sum is exactly MPI's a + b.
 * bf16/f16 are widened to f32, combined over all sources and rounded once.
 */
#include <math.h>
#include <string.h>

#include "internal.h"

#define BLOCK 1024 /* elements per block of the general kernels: fits L1 */

static void sum2_f32(float *restrict x, float *restrict y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] + y[i];
        x[i] = v;
        y[i] = v;
    }
}

static void avg2_f32(float *restrict x, float *restrict y, int64_t n, float inv)
{
    for (int64_t i = 0; i < n; i++) {
        float v = (x[i] + y[i]) * inv;
        x[i] = v;
        y[i] = v;
    }
}

/* acc[i] = combine(acc[i], x[i]); MAX/MIN on f32 as MPI_MAX/MPI_MIN do it. */
static void add_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] += x[i];
}
static void max_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] = acc[i] > x[i] ? acc[i] : x[i];
}
static void min_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] = acc[i] < x[i] ? acc[i] : x[i];
}
/* 16-bit MAX/MIN as dtype.c's MPI ops: a nan loses to a number. */
static void fmax_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] = fmaxf(acc[i], x[i]);
}
static void fmin_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] = fminf(acc[i], x[i]);
}
static void scale_f32(float *restrict acc, int n, float inv)
{
    for (int i = 0; i < n; i++) acc[i] *= inv;
}

static void reduce_f32(float *const *src, int ns, float *const *dst, int nd, int64_t n,
                       ct_reduce_op op, float inv)
{
    /* Two ranks reducing into both buffers: one pass, no accumulator. */
    if (ns == 2 && nd == 2 && dst[0] == src[0] && dst[1] == src[1] &&
        (op == CT_OP_SUM || op == CT_OP_AVG)) {
        if (op == CT_OP_SUM) sum2_f32(src[0], src[1], n);
        else avg2_f32(src[0], src[1], n, inv);
        return;
    }
    void (*combine)(float *restrict, const float *restrict, int) =
        op == CT_OP_MAX ? max_f32 : op == CT_OP_MIN ? min_f32 : add_f32;
    float acc[BLOCK];
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
        int m = (int)(n - i0 < BLOCK ? n - i0 : BLOCK);
        memcpy(acc, src[0] + i0, (size_t)m * sizeof *acc);
        for (int r = 1; r < ns; r++) combine(acc, src[r] + i0, m);
        if (op == CT_OP_AVG) scale_f32(acc, m, inv);
        for (int d = 0; d < nd; d++) memcpy(dst[d] + i0, acc, (size_t)m * sizeof *acc);
    }
}

static void reduce_16(uint16_t *const *src, int ns, uint16_t *const *dst, int nd, int64_t n,
                      ct_dtype dt, ct_reduce_op op, float inv)
{
    void (*to32)(const uint16_t *, float *, size_t) =
        dt == CT_BF16 ? ct_bf16_to_f32_n : ct_f16_to_f32_n;
    void (*from32)(const float *, uint16_t *, size_t) =
        dt == CT_BF16 ? ct_f32_to_bf16_n : ct_f32_to_f16_n;
    void (*combine)(float *restrict, const float *restrict, int) =
        op == CT_OP_MAX ? fmax_f32 : op == CT_OP_MIN ? fmin_f32 : add_f32;
    float acc[BLOCK], x[BLOCK];
    uint16_t out[BLOCK];
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
        int m = (int)(n - i0 < BLOCK ? n - i0 : BLOCK);
        to32(src[0] + i0, acc, (size_t)m);
        for (int r = 1; r < ns; r++) {
            to32(src[r] + i0, x, (size_t)m);
            combine(acc, x, m);
        }
        if (op == CT_OP_AVG) scale_f32(acc, m, inv);
        from32(acc, out, (size_t)m);
        for (int d = 0; d < nd; d++) memcpy(dst[d] + i0, out, (size_t)m * sizeof *out);
    }
}

void ct__reduce_into(void *const *src, int nsrc, void *const *dst, int ndst, int64_t n,
                     ct_dtype dt, ct_reduce_op op, float inv)
{
    CT_ASSERT(dt == CT_F32 || dt == CT_BF16 || dt == CT_F16);
    if (n <= 0) return;
    if (dt == CT_F32)
        reduce_f32((float *const *)src, nsrc, (float *const *)dst, ndst, n, op, inv);
    else
        reduce_16((uint16_t *const *)src, nsrc, (uint16_t *const *)dst, ndst, n, dt, op, inv);
}

void ct__shm_slice(int64_t n, size_t off, size_t esz, int W, int me, int64_t *lo, int64_t *hi)
{
    int64_t line = 64 / (int64_t)esz;
    /* Elements before the range's first full line go to rank 0. */
    int64_t head = (int64_t)((64 - off % 64) % 64) / (int64_t)esz;
    if (head > n) head = n;
    *lo = me == 0 ? 0 : head + (n - head) * me / W / line * line;
    *hi = me == W - 1 ? n : head + (n - head) * (me + 1) / W / line * line;
    if (*hi < *lo) *hi = *lo;
}

/*
 * The attention kernels' products on AMX tiles (attn_bf16.c calls them where
 * the CPU has AMX; CTRAIN_ISA=avx512bf16 keeps its VDPBF16PS loops).  The
 * operands are the pair words attn_bf16.c packs for VDPBF16PS, which are
 * what TDPBF16PS reads as they stand: A's rows hold pairs along the
 * contraction (a tile's row is 16 words), B's rows are pairs of contraction
 * rows with the output's columns along them (VNNI), so no packing changes.
 * One TDPBF16PS multiplies 16 x 32 by 32 x 16 where a VDPBF16PS loop needs
 * 32 instructions: measured on the 12 x 768 GPT (bench/gpt) the attention
 * core is several times faster this way.
 *
 * The sums run over the contraction in the same order on any thread count,
 * so the bits are one thread's; they differ from the VDPBF16PS loops' in the
 * last place of some elements (the two instructions round their pair sums
 * differently), as products on different CPUs do.
 *
 * Linux hands a process the AMX registers only when asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM); where it refuses, ct__attn_amx_usable is 0 and the
 * VDPBF16PS loops run.  The tile shapes are per thread and oneDNN sets its
 * own between our calls, so each kernel call loads ours and releases them.
 */
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "internal.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-tile,amx-bf16,avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f")
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int ct__attn_amx_usable(void)
{
    static int ok = -1;
    int v = __atomic_load_n(&ok, __ATOMIC_ACQUIRE);
    if (v < 0) {
        v = !strcmp(ct_cpu_isa(), "amx") && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        __atomic_store_n(&ok, v, __ATOMIC_RELEASE);
    }
    return v;
}

/* Tiles: 0, 1 two C tiles side by side; 2 A (16 rows of 16 words), 3, 4 the
 * B tiles under C0 and C1 (16 pair rows); 5, 6, 7 the same for a last
 * contraction step of 8 words (A 16 x 8, B 8 pair rows). */
typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Static: GCC 12 drops the stores to a local one (its ldtilecfg builtin is not
 * seen to read memory). */
static const tile_config shapes = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 32, 64, 64}, /* 5: A of 16 rows of 8 words */
    .rows = {16, 16, 16, 16, 16, 16, 8, 8},    /* 6, 7: B of 8 pair rows */
};

void ct__attn_amx_begin(void) { _tile_loadconfig(&shapes); }

void ct__attn_amx_end(void) { _tile_release(); }

/* C tiles at (row, col) of c: both (two) or the first only, stored whole or
 * through a 16 x 16 buffer when fewer than 16 rows are wanted. */
static void store_c(int two, float *c, ptrdiff_t ldc, int64_t mrows)
{
    if (mrows >= 16) {
        _tile_stored(0, c, ldc * 4);
        if (two) _tile_stored(1, c + 16, ldc * 4);
        return;
    }
    float buf[2][16 * 16];
    _tile_stored(0, buf[0], 64);
    if (two) _tile_stored(1, buf[1], 64);
    for (int64_t m = 0; m < mrows; m++) {
        memcpy(c + m * ldc, buf[0] + m * 16, 64);
        if (two) memcpy(c + m * ldc + 16, buf[1] + m * 16, 64);
    }
}

void ct__attn_amx_product(int64_t M, int64_t ncol, int64_t kp, const uint32_t *a, ptrdiff_t as, const uint32_t *b,
                          ptrdiff_t ldb, float *c, ptrdiff_t ldc, int64_t mrows)
{
    CT_ASSERT(M % 16 == 0 && ncol % 16 == 0 && kp % 8 == 0);
    __asm__ volatile("" ::: "memory"); /* GCC 12's tileloadd is not seen to read memory: stores land first */
    const ptrdiff_t sa = as * 4, sb = ldb * 4;
    const int64_t kfull = kp / 16 * 16;
    for (int64_t m0 = 0; m0 < M && m0 < mrows; m0 += 16) {
        const uint32_t *am = a + m0 * as;
        for (int64_t n0 = 0; n0 < ncol; n0 += 32) {
            int two = ncol - n0 >= 32;
            const uint32_t *bn = b + n0;
            _tile_zero(0);
            _tile_zero(1);
            /* One contraction step at word k on tiles A and B0 (B1 beside it):
             * a macro, as tile numbers must be constants. */
#define STEP(A, B0, B1, k)                                \
    do {                                                  \
        _tile_loadd(A, am + (k), sa);                     \
        _tile_loadd(B0, bn + (k) * ldb, sb);              \
        _tile_dpbf16ps(0, A, B0);                         \
        if (two) {                                        \
            _tile_loadd(B1, bn + (k) * ldb + 16, sb);     \
            _tile_dpbf16ps(1, A, B1);                     \
        }                                                 \
    } while (0)
            for (int64_t k = 0; k < kfull; k += 16) STEP(2, 3, 4, k);
            if (kfull < kp) STEP(5, 6, 7, kfull);
#undef STEP
            store_c(two, c + m0 * ldc + n0, ldc, mrows - m0);
        }
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

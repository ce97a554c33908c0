/*
 * bf16 products where oneDNN has none: its bf16 matmul needs AVX-512 (it
 * emulates bf16 there when the CPU lacks AVX512_BF16), so on an AVX2 CPU, or
 * under CTRAIN_ISA=avx2 or lower, the bf16 operands are widened to f32 (exact:
 * a bf16 is the top half of an f32) and OpenBLAS multiplies them, cut over
 * the rank's threads by ct_sgemm.  The math is the bf16 product's (bf16
 * inputs, f32 accumulation); only the order of the sums differs from
 * oneDNN's.
 */
#include <string.h>

#include "ctrain/core.h"
#include "internal.h"

/* rows x cols of bf16 s (row stride ld) widened into d with the same stride. */
static void widen(const uint16_t *s, int rows, int cols, int ld, float *d)
{
    for (int r = 0; r < rows; r++) ct_bf16_to_f32_n(s + (size_t)r * ld, d + (size_t)r * ld, (size_t)cols);
}

ct_status ct__gemm_bf16_widened(int ta, int tb, int m, int n, int k, float alpha, const uint16_t *a, int lda,
                                const uint16_t *b, int ldb, const float *bias, float beta, void *c, int c_bf16,
                                int ldc)
{
    int ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
    size_t na = ar ? (size_t)(ar - 1) * lda + ac : 0, nb = br ? (size_t)(br - 1) * ldb + bc : 0;
    size_t nc = c_bf16 ? (size_t)m * n : 0;
    float *buf = ct_alloc((na + nb + nc) * sizeof(float) + 1, CT_MEM_OTHER);
    if (!buf) return CT_ENOMEM;
    float *fa = buf, *fb = buf + na, *fc = c_bf16 ? buf + na + nb : c;
    int ldf = c_bf16 ? n : ldc;
    widen(a, ar, ac, lda, fa);
    widen(b, br, bc, ldb, fb);
    if (bias) { /* rows start as the bias and the product adds onto them */
        for (int i = 0; i < m; i++) memcpy(fc + (size_t)i * ldf, bias, (size_t)n * sizeof *fc);
        beta = 1.0f;
    }
    ct_sgemm(ta, tb, m, n, k, alpha, fa, lda, fb, ldb, beta, fc, ldf);
    for (int i = 0; c_bf16 && i < m; i++)
        ct_f32_to_bf16_n(fc + (size_t)i * n, (uint16_t *)c + (size_t)i * ldc, (size_t)n);
    ct_free(buf);
    return CT_OK;
}

/*
 * Tests of the products by dtype (src/core/gemm.c): ct_gemm_f32 on each
 * engine against a double-precision triple loop, ct_gemm_bf16 against a
 * reference that rounds the inputs to bf16 and sums in double (so the only
 * difference left is f32 accumulation, which bounds the tolerance), and
 * crafted inputs on which a product that quietly ran in f32 would give a
 * different answer than one that ran in bf16.
 */
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>

#include "test.h"

static uint64_t lcg_state = 0x9e3779b97f4a7c15ull;

static float rnd(void)
{
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(lcg_state >> 40) / (double)(1 << 24) * 2.0 - 1.0);
}

static float bf16_round(float x) { return ct_bf16_to_f32(ct_f32_to_bf16(x)); }

enum { ENG_BLAS, ENG_DNNL, ENG_AUTO, ENG_BF16 };
static const char *eng_name[] = {"f32 OpenBLAS", "f32 oneDNN", "f32 AUTO", "bf16"};

static ct_status run(int eng, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                     const uint16_t *ah, int lda, const float *b, const uint16_t *bh, int ldb,
                     float beta, float *c, int ldc)
{
    static const ct_gemm_engine e[] = {CT_GEMM_OPENBLAS, CT_GEMM_ONEDNN, CT_GEMM_AUTO};
    if (eng == ENG_BF16) return ct_gemm_bf16(ta, tb, m, n, k, alpha, ah, lda, bh, ldb, beta, c, ldc);
    return ct_gemm_f32(e[eng], ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* C = alpha*op(A)*op(B) + beta*C with padded leading dimensions; A and B
 * padding holds nan (reading it poisons C), C padding a marker that must
 * survive; with beta 0, C starts as nan.  The reference sums in double over
 * the operands as the engine sees them (bf16-rounded for ENG_BF16).  The
 * tolerance is the f32 accumulation bound (k+2) u sum|a b| (u = 2^-24) plus
 * one rounding of beta*C. */
static void check(int eng, int ta, int tb, int m, int n, int k, int pad, float alpha, float beta)
{
    int arows = ta ? k : m, acols = ta ? m : k, brows = tb ? n : k, bcols = tb ? k : n;
    int lda = acols + pad, ldb = bcols + pad + 1, ldc = n + pad + 2;
    size_t na = (size_t)arows * lda, nb = (size_t)brows * ldb, nc = (size_t)m * ldc;
    float *a = malloc(sizeof(float) * na), *b = malloc(sizeof(float) * nb);
    float *c = malloc(sizeof(float) * nc), *c0 = malloc(sizeof(float) * nc);
    uint16_t *ah = malloc(2 * na), *bh = malloc(2 * nb);
    ASSERT(a && b && c && c0 && ah && bh);
    for (size_t i = 0; i < na; i++) a[i] = (int)(i % lda) < acols ? rnd() : NAN;
    for (size_t i = 0; i < nb; i++) b[i] = (int)(i % ldb) < bcols ? rnd() : NAN;
    for (size_t i = 0; i < nc; i++)
        c[i] = c0[i] = (int)(i % ldc) < n ? (beta == 0.0f ? NAN : rnd()) : 12345.0f;
    ct_f32_to_bf16_n(a, ah, na);
    ct_f32_to_bf16_n(b, bh, nb);
    int bf = eng == ENG_BF16;

    ASSERT_OK(run(eng, ta, tb, m, n, k, alpha, a, ah, lda, b, bh, ldb, beta, c, ldc));

    char what[128];
    snprintf(what, sizeof what, "%s ta=%d tb=%d m=%d n=%d k=%d lda=%d ldb=%d ldc=%d beta=%g",
             eng_name[eng], ta, tb, m, n, k, lda, ldb, ldc, (double)beta);
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            double s = 0, mag = 0;
            for (int p = 0; p < k; p++) {
                double x = ta ? a[p * lda + i] : a[i * lda + p];
                double y = tb ? b[j * ldb + p] : b[p * ldb + j];
                if (bf) {
                    x = bf16_round((float)x);
                    y = bf16_round((float)y);
                }
                s += x * y;
                mag += fabs(x * y);
            }
            double cold = beta == 0.0f ? 0.0 : (double)c0[i * ldc + j];
            double want = alpha * s + beta * cold;
            double tol = (k + 2) * 0x1p-24 * (fabs(alpha) * mag + fabs(beta * cold)) + 1e-30;
            double got = c[i * ldc + j];
            if (!(fabs(got - want) <= tol))
                ct_test_fail(__FILE__, __LINE__, "%s: C[%d][%d] = %.9g, want %.9g (tol %.3g)", what,
                             i, j, got, want, tol);
        }
        for (int j = n; j < ldc; j++)
            if (c[i * ldc + j] != 12345.0f)
                ct_test_fail(__FILE__, __LINE__, "%s: padding C[%d][%d] was written", what, i, j);
    }
    free(a);
    free(b);
    free(c);
    free(c0);
    free(ah);
    free(bh);
}

static const int sizes[][3] = {{1, 1, 1},    {7, 5, 9},     {3, 11, 1},   {13, 1, 7},
                               {33, 17, 29}, {65, 31, 47},  {64, 40, 70}, {5, 130, 66}};
#define NSIZES ((int)(sizeof sizes / sizeof sizes[0]))

static void check_engine(int eng)
{
    ct_blas_set_threads(1);
    for (int s = 0; s < NSIZES; s++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                int m = sizes[s][0], n = sizes[s][1], k = sizes[s][2];
                check(eng, ta, tb, m, n, k, 3, 1.5f, -0.7f);
                check(eng, ta, tb, m, n, k, 0, 1.0f, 0.0f);
                check(eng, ta, tb, m, n, k, 5, -0.25f, 1.0f);
            }
}

TEST(core_gemm_f32_openblas_vs_naive) { check_engine(ENG_BLAS); }
TEST(core_gemm_f32_onednn_vs_naive) { check_engine(ENG_DNNL); }
TEST(core_gemm_f32_auto_vs_naive) { check_engine(ENG_AUTO); }
TEST(core_gemm_bf16_vs_rounded_reference) { check_engine(ENG_BF16); }

/* Accumulating into a C of at least 2^19 elements over k <= 256 goes by row
 * panels of 64 (src/core/gemm.c): a partial last panel, transposed A,
 * padded C, beta 1 and beta -0.5, alpha 2. */
TEST(core_gemm_accumulate_by_panels)
{
    ct_blas_set_threads(1);
    for (int eng = ENG_DNNL; eng <= ENG_BF16; eng += ENG_BF16 - ENG_DNNL)
        for (int ta = 0; ta < 2; ta++) {
            check(eng, ta, 0, 200, 2700, 33, 3, 1.0f, 1.0f);
            check(eng, ta, 1, 130, 4100, 20, 0, 2.0f, -0.5f);
        }
}

/* A bf16 A^T B with m > n goes as (B^T A)^T through a scratch (src/core/gemm.c):
 * padded C, beta 0, 1 and -0.5, alpha 2; and m > n past the scratch's limit. */
TEST(core_gemm_bf16_wide_first_swapped)
{
    ct_blas_set_threads(1);
    check(ENG_BF16, 1, 0, 300, 70, 500, 3, 1.0f, 0.0f);
    check(ENG_BF16, 1, 0, 257, 128, 300, 0, 1.0f, 1.0f);
    check(ENG_BF16, 1, 0, 130, 129, 64, 5, 2.0f, -0.5f);
    check(ENG_BF16, 1, 0, 2100, 130, 20, 1, 1.0f, 1.0f);
}

/* A bf16 A^T B over k >= 1024 (a weight gradient) copies A^T first (src/core/gemm.c):
 * m and k off the 16x16 blocks, m below one block, padded A and C, beta 0, 1
 * and -0.5, alpha 2, and m > n, where the swapped product copies B^T. */
TEST(core_gemm_bf16_long_reduction_transposed)
{
    ct_blas_set_threads(1);
    check(ENG_BF16, 1, 0, 17, 40, 1024, 3, 1.0f, 0.0f);
    check(ENG_BF16, 1, 0, 128, 384, 1100, 0, 1.0f, 1.0f);
    check(ENG_BF16, 1, 0, 5, 3, 2048, 1, 2.0f, -0.5f);
    check(ENG_BF16, 1, 0, 96, 33, 1037, 5, 1.0f, 1.0f); /* swapped: B^T is the copy */
    ct_blas_set_threads(2); /* the copy is cut over the threads */
    check(ENG_BF16, 1, 0, 200, 384, 1100, 2, 1.0f, 1.0f);
    ct_blas_set_threads(1);
}

/* The weight gradients' products (bf16 A^T B, k >= 1024) run on oneDNN's
 * gemm:jit: with AMX on A^T as it lies (its AMX kernels pack A themselves;
 * oneDNN's first choice, brgemm, copies A^T its own way and then gave other
 * bits at 2 threads), without AMX on the padded copy of A^T, which brgemm
 * refuses.  The forward product runs on oneDNN's AMX brgemm where there is
 * AMX. */
TEST(core_gemm_bf16_weight_gradient_kernel)
{
    ct_blas_set_threads(1);
    char fwd[96], dw[96];
    ASSERT_OK(ct_gemm_onednn_impl(1, 0, 1, 2048, 768, 768, 0.0f, fwd, sizeof fwd));
    ASSERT_OK(ct_gemm_onednn_impl(1, 1, 0, 768, 768, 2048, 0.0f, dw, sizeof dw));
    if (ct_cpu_has_avx512_bf16()) ASSERT_STR_CONTAINS(dw, "gemm:jit");
    if (!strcmp(ct_cpu_isa(), "amx")) ASSERT_STR_CONTAINS(fwd, "amx");
}

/* Two threads (from ct_blas_set_threads) must still give right answers, and
 * the same as one thread for the same key shape. */
TEST(core_gemm_threads)
{
    ct_blas_set_threads(2);
    ASSERT_EQ(omp_get_max_threads(), 2);
    check(ENG_BF16, 0, 1, 67, 45, 53, 2, 0.5f, 2.0f);
    check(ENG_DNNL, 1, 0, 67, 45, 53, 2, 0.5f, 2.0f);
    ct_blas_set_threads(1);
    ASSERT_EQ(omp_get_max_threads(), 1);
}

static void *other_thread(void *arg)
{
    (void)arg;
    uint16_t a[4] = {0x3f80, 0x3f80, 0x3f80, 0x3f80}; /* ones */
    float c[4] = {0};
    if (ct_gemm_bf16(0, 0, 2, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2) != CT_OK || c[0] != 2.0f) return NULL;
    /* OpenMP's thread count is per thread: the product applied the rank's count here too. */
    return omp_get_max_threads() == ct_blas_get_threads() ? (void *)1 : NULL;
}

TEST(core_gemm_thread_count_follows_other_threads)
{
    ct_blas_set_threads(1);
    pthread_t t;
    void *ok = NULL;
    ASSERT_EQ(pthread_create(&t, NULL, other_thread, NULL), 0);
    ASSERT_EQ(pthread_join(t, &ok), 0);
    ASSERT(ok != NULL);
}

/* A product that ran in f32 instead of bf16 is caught: 1 + 2^-9 is not a
 * bf16 number and rounds to 1 (tie to even), so A = 1+2^-9 times B = 1 over
 * k = 256 sums to exactly 256 in bf16 and to 256.5 in f32. */
TEST(core_gemm_bf16_really_rounds)
{
    enum { M = 8, N = 24, K = 256 };
    static float a[M * K], b[K * N], c[M * N];
    static uint16_t ah[M * K], bh[K * N];
    for (int i = 0; i < M * K; i++) a[i] = 1.0f + 0x1p-9f;
    for (int i = 0; i < K * N; i++) b[i] = 1.0f;
    ct_f32_to_bf16_n(a, ah, M * K);
    ct_f32_to_bf16_n(b, bh, K * N);
    ASSERT_EQ(ah[0], 0x3f80);
    ASSERT_OK(ct_gemm_bf16(0, 0, M, N, K, 1.0f, ah, K, bh, N, 0.0f, c, N));
    for (int i = 0; i < M * N; i++) ASSERT(c[i] == 256.0f);
    ASSERT_OK(ct_gemm_f32(CT_GEMM_ONEDNN, 0, 0, M, N, K, 1.0f, a, K, b, N, 0.0f, c, N));
    for (int i = 0; i < M * N; i++) ASSERT(c[i] == 256.5f);

    /* Random data: every element is far closer to the bf16-rounded reference
     * than the f32 one is, summed over the matrix. */
    enum { R = 48 };
    static float x[R * R], y[R * R], z[R * R];
    static uint16_t xh[R * R], yh[R * R];
    for (int i = 0; i < R * R; i++) x[i] = rnd(), y[i] = rnd();
    ct_f32_to_bf16_n(x, xh, R * R);
    ct_f32_to_bf16_n(y, yh, R * R);
    ASSERT_OK(ct_gemm_bf16(0, 1, R, R, R, 1.0f, xh, R, yh, R, 0.0f, z, R));
    double to_rounded = 0, to_exact = 0;
    for (int i = 0; i < R; i++)
        for (int j = 0; j < R; j++) {
            double sr = 0, se = 0;
            for (int p = 0; p < R; p++) {
                sr += (double)bf16_round(x[i * R + p]) * bf16_round(y[j * R + p]);
                se += (double)x[i * R + p] * y[j * R + p];
            }
            to_rounded += fabs(z[i * R + j] - sr);
            to_exact += fabs(z[i * R + j] - se);
        }
    /* bf16 inputs carry ~2^-9 relative error each, f32 accumulation ~R*2^-24. */
    ASSERT(to_exact > 0.0);
    if (!(to_rounded * 100.0 < to_exact))
        ct_test_fail(__FILE__, __LINE__, "bf16 product is %.3g from the bf16 reference and %.3g "
                     "from the f32 one: it did not run in bf16", to_rounded, to_exact);
}

/* C = op(A) op(B) + bias (ct_gemm_f32_bias on each engine, ct_gemm_bf16_bias
 * into f32 and into bf16 C) against a double reference; C padding survives,
 * no bias adds nothing, and k = 0 leaves the bias alone in C. */
static void check_bias(int eng, int c_bf16, int ta, int tb, int m, int n, int k, int with_bias)
{
    static const ct_gemm_engine e[] = {CT_GEMM_OPENBLAS, CT_GEMM_ONEDNN, CT_GEMM_AUTO};
    int lda = (ta ? m : k) + 1, ldb = (tb ? k : n) + 2, ldc = n + 3;
    size_t na = (size_t)(ta ? k : m) * lda, nb = (size_t)(tb ? n : k) * ldb, nc = (size_t)m * ldc;
    float *a = malloc(4 * na + 4), *b = malloc(4 * nb + 4), *c = malloc(4 * nc), *bias = malloc(4 * (size_t)n);
    uint16_t *ah = malloc(2 * na + 2), *bh = malloc(2 * nb + 2), *ch = malloc(2 * nc);
    ASSERT(a && b && c && bias && ah && bh && ch);
    for (size_t i = 0; i < na; i++) a[i] = rnd();
    for (size_t i = 0; i < nb; i++) b[i] = rnd();
    for (int j = 0; j < n; j++) bias[j] = 4.0f * rnd();
    for (size_t i = 0; i < nc; i++) c[i] = NAN, ch[i] = 0x7fc0;
    for (int i = 0; i < m; i++)
        for (int j = n; j < ldc; j++) c[i * ldc + j] = 12345.0f, ch[i * ldc + j] = 0x1234;
    ct_f32_to_bf16_n(a, ah, na);
    ct_f32_to_bf16_n(b, bh, nb);
    const float *bz = with_bias ? bias : NULL;
    if (eng == ENG_BF16)
        ASSERT_OK(ct_gemm_bf16_bias(ta, tb, m, n, k, ah, lda, bh, ldb, bz, c_bf16 ? (void *)ch : c, c_bf16, ldc));
    else
        ASSERT_OK(ct_gemm_f32_bias(e[eng], ta, tb, m, n, k, a, lda, b, ldb, bz, c, ldc));
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            double s = bz ? bz[j] : 0.0, mag = fabs(s);
            for (int p = 0; p < k; p++) {
                double x = ta ? a[p * lda + i] : a[i * lda + p], y = tb ? b[j * ldb + p] : b[p * ldb + j];
                if (eng == ENG_BF16) x = bf16_round((float)x), y = bf16_round((float)y);
                s += x * y;
                mag += fabs(x * y);
            }
            double got = c_bf16 ? ct_bf16_to_f32(ch[i * ldc + j]) : c[i * ldc + j];
            /* f32 accumulation, and for bf16 C one rounding to 8 significant bits */
            double tol = (k + 2) * 0x1p-24 * mag + (c_bf16 ? 0x1p-8 * fabs(s) : 0.0) + 1e-30;
            if (!(fabs(got - s) <= tol))
                ct_test_fail(__FILE__, __LINE__, "%s%s bias=%d ta=%d tb=%d m=%d n=%d k=%d: C[%d][%d] = %.9g, "
                             "want %.9g (tol %.3g)", eng_name[eng], c_bf16 ? " into bf16" : "", with_bias, ta, tb,
                             m, n, k, i, j, got, s, tol);
        }
        for (int j = n; j < ldc; j++)
            ASSERT(c_bf16 ? ch[i * ldc + j] == 0x1234 : c[i * ldc + j] == 12345.0f);
    }
    free(a), free(b), free(c), free(bias), free(ah), free(bh), free(ch);
}

TEST(core_gemm_bias)
{
    ct_blas_set_threads(1);
    static const int shapes[][3] = {{1, 1, 1}, {7, 5, 9}, {64, 130, 66}, {200, 40, 33}, {9, 6, 0}};
    for (int eng = ENG_BLAS; eng <= ENG_BF16; eng++)
        for (int cb = 0; cb <= (eng == ENG_BF16); cb++)
            for (int s = 0; s < 5; s++)
                for (int t = 0; t < 4; t++)
                    for (int wb = 0; wb < 2; wb++)
                        check_bias(eng, cb, t & 1, t >> 1, shapes[s][0], shapes[s][1], shapes[s][2], wb);
}

TEST(core_gemm_degenerate)
{
    float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
    uint16_t ah[6], bh[6];
    ct_f32_to_bf16_n(a, ah, 6);
    ct_f32_to_bf16_n(b, bh, 6);
    for (int eng = 0; eng < 4; eng++) {
        float c[4] = {1, 2, 3, 4};
        ASSERT_OK(run(eng, 0, 0, 0, 2, 3, 1.0f, a, ah, 3, b, bh, 2, 0.0f, c, 2)); /* m = 0 */
        ASSERT_OK(run(eng, 0, 0, 2, 0, 3, 1.0f, a, ah, 3, b, bh, 2, 0.0f, c, 2)); /* n = 0 */
        ASSERT(c[0] == 1 && c[1] == 2 && c[2] == 3 && c[3] == 4);
        ASSERT_OK(run(eng, 0, 0, 2, 2, 0, 1.0f, a, ah, 1, b, bh, 2, 0.5f, c, 2)); /* k = 0 */
        ASSERT(c[0] == 0.5f && c[1] == 1.0f && c[2] == 1.5f && c[3] == 2.0f);
        float d[4] = {NAN, NAN, NAN, NAN};
        ASSERT_OK(run(eng, 0, 0, 2, 2, 3, 1.0f, a, ah, 3, b, bh, 2, 0.0f, d, 2));
        ASSERT(d[0] == 4 && d[1] == 5 && d[2] == 10 && d[3] == 11);
    }
}

TEST(core_gemm_bad_arguments)
{
    float a[4] = {0}, c[4] = {0};
    uint16_t h[4] = {0};
    ASSERT_ERR(ct_gemm_bf16(0, 0, -1, 2, 2, 1.0f, h, 2, h, 2, 0.0f, c, 2), CT_EINVAL, "negative size");
    ASSERT_ERR(ct_gemm_f32(CT_GEMM_ONEDNN, 0, 0, 2, 2, 2, 1.0f, a, 1, a, 2, 0.0f, c, 2), CT_EINVAL,
               "lda=1");
    ASSERT_ERR(ct_gemm_f32((ct_gemm_engine)7, 0, 0, 2, 2, 2, 1.0f, a, 2, a, 2, 0.0f, c, 2),
               CT_EINVAL, "engine 7");
    char buf[64];
    ASSERT_ERR(ct_gemm_onednn_impl(1, 0, 0, 0, 4, 4, 0.0f, buf, sizeof buf), CT_EINVAL, "positive");
    ASSERT_OK(ct_gemm_onednn_impl(1, 0, 1, 64, 64, 64, 0.0f, buf, sizeof buf));
    ASSERT(buf[0] != 0);
}

/* AUTO follows the measured rule documented in src/core/gemm.c: forward and
 * input-gradient shapes of a large linear layer go to oneDNN on AVX-512 CPUs,
 * the weight gradient only when OpenBLAS runs an AVX2 kernel there, tiny or
 * narrow products never. */
TEST(core_gemm_auto_engine_rule)
{
    __builtin_cpu_init();
    int cpu512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const char *core = ct_blas_corename();
    int blas512 = !strcmp(core, "SkylakeX") || !strcmp(core, "Cooperlake") ||
                  !strcmp(core, "SapphireRapids");
    ct_gemm_engine big = cpu512 ? CT_GEMM_ONEDNN : CT_GEMM_OPENBLAS;
    ASSERT_EQ(ct_gemm_f32_engine(0, 1, 64, 1024, 1024), big);
    ASSERT_EQ(ct_gemm_f32_engine(0, 0, 256, 1024, 1024), big);
    ASSERT_EQ(ct_gemm_f32_engine(1, 0, 1024, 1024, 64),
              cpu512 && !blas512 ? CT_GEMM_ONEDNN : CT_GEMM_OPENBLAS);
    ASSERT_EQ(ct_gemm_f32_engine(0, 0, 16, 16, 16), CT_GEMM_OPENBLAS);
    ASSERT_EQ(ct_gemm_f32_engine(0, 0, 1024, 8, 1024), CT_GEMM_OPENBLAS);
}

/* The cache's memory is counted (CT_MEM_OTHER) and ct_gemm_cache_clear gives
 * all of it back; products afterwards set up again and still agree. */
TEST(core_gemm_cache_clear)
{
    size_t before = ct_mem_current(CT_MEM_OTHER);
    check(ENG_BF16, 0, 1, 7, 5, 9, 0, 1.0f, 0.0f);
    check(ENG_DNNL, 1, 0, 130, 4100, 20, 0, 1.0f, 1.0f); /* by panels: scratch too */
    ASSERT(ct_mem_current(CT_MEM_OTHER) > before);
    ct_gemm_cache_clear();
    ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), before);
    check(ENG_BF16, 0, 1, 7, 5, 9, 0, 1.0f, 0.0f);
    check(ENG_DNNL, 1, 0, 130, 4100, 20, 0, 1.0f, 1.0f);
    ct_gemm_cache_clear();
    ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), before);
}

/* When oneDNN cannot set a product up (here: the cache cannot grow), C is
 * left as it was; ct_gemm_bf16 reports it, and an AUTO f32 product carries
 * on with OpenBLAS, which it keeps using from then on. */
TEST(core_gemm_setup_failure_leaves_c_alone)
{
    ct_blas_set_threads(1);
    static float c[64 * 128];
    static uint16_t h[128 * 128];
    for (int i = 0; i < 64 * 128; i++) c[i] = 5.0f;
    ct_mem_fail_after(0);
    ASSERT_ERR(ct_gemm_bf16(0, 0, 64, 128, 128, 1.0f, h, 128, h, 128, 1.0f, c, 128), CT_ENOMEM,
               "injected");
    ct_mem_fail_after(0);
    ASSERT_ERR(ct_gemm_bf16(1, 0, 1024, 1024, 64, 1.0f, h, 1024, h, 1024, 1.0f, NULL, 1024),
               CT_ENOMEM, "injected"); /* by panels: fails before C is read */
    ct_mem_fail_after(-1);
    for (int i = 0; i < 64 * 128; i++) ASSERT(c[i] == 5.0f);

    ct_gemm_engine before = ct_gemm_f32_engine(0, 0, 64, 128, 128);
    ct_mem_fail_after(0);
    check(ENG_AUTO, 0, 0, 64, 128, 128, 0, 1.0f, 1.0f);
    ct_mem_fail_after(-1);
    if (before == CT_GEMM_ONEDNN) ASSERT_EQ(ct_gemm_f32_engine(0, 0, 64, 128, 128), CT_GEMM_OPENBLAS);
}

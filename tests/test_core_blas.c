/*
 * Tests of the BLAS layer (src/core/blas.c): ct_sgemm against a naive
 * double-precision triple loop, and the kernel selection, seen from outside
 * by running the built ctrain program and tests/ctor_prog.c (a user's
 * program with a constructor of its own) with different environments.
 */
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include "test.h"

static uint64_t lcg_state = 88172645463325252ull;

static float rnd(void)
{
    lcg_state = lcg_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(lcg_state >> 40) / (double)(1 << 24) * 2.0 - 1.0);
}

/* C = alpha*op(A)*op(B) + beta*C, row-major, with op(A) MxK and op(B) KxN;
 * checks the MxN block of c_got against the naive sum and that the padding
 * columns of each row (ldc > n) were not touched. */
static void check_gemm(int ta, int tb, int m, int n, int k, int pad, float alpha, float beta)
{
    int arows = ta ? k : m, acols = ta ? m : k, brows = tb ? n : k, bcols = tb ? k : n;
    int lda = acols + pad, ldb = bcols + pad + 1, ldc = n + pad + 2;
    float *a = malloc(sizeof(float) * (size_t)arows * lda);
    float *b = malloc(sizeof(float) * (size_t)brows * ldb);
    float *c = malloc(sizeof(float) * (size_t)m * ldc);
    float *c0 = malloc(sizeof(float) * (size_t)m * ldc);
    ASSERT(a && b && c && c0);
    /* Padding holds nan: reading it would poison the result. */
    for (int i = 0; i < arows * lda; i++) a[i] = (i % lda) < acols ? rnd() : NAN;
    for (int i = 0; i < brows * ldb; i++) b[i] = (i % ldb) < bcols ? rnd() : NAN;
    for (int i = 0; i < m * ldc; i++) c[i] = c0[i] = (i % ldc) < n ? rnd() : 12345.0f;

    ct_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);

    char what[96];
    snprintf(what, sizeof what, "ta=%d tb=%d m=%d n=%d k=%d lda=%d ldb=%d ldc=%d", ta, tb, m, n, k,
             lda, ldb, ldc);
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < n; j++) {
            double s = 0, mag = 0;
            for (int p = 0; p < k; p++) {
                double x = ta ? a[p * lda + i] : a[i * lda + p];
                double y = tb ? b[j * ldb + p] : b[p * ldb + j];
                s += x * y;
                mag += fabs(x * y);
            }
            double want = alpha * s + beta * (double)c0[i * ldc + j];
            double tol = 1e-5 * (fabs(alpha) * mag + fabs(beta * c0[i * ldc + j])) + 1e-6;
            double got = c[i * ldc + j];
            if (!(fabs(got - want) <= tol))
                ct_test_fail(__FILE__, __LINE__, "%s: C[%d][%d] = %.9g, want %.9g", what, i, j, got, want);
        }
        for (int j = n; j < ldc; j++)
            if (c[i * ldc + j] != 12345.0f)
                ct_test_fail(__FILE__, __LINE__, "%s: padding C[%d][%d] was written", what, i, j);
    }
    free(a);
    free(b);
    free(c);
    free(c0);
}

TEST(core_sgemm_vs_naive)
{
    ct_blas_set_threads(1);
    ASSERT_EQ(ct_blas_get_threads(), 1);
    int sizes[][3] = {{1, 1, 1}, {7, 5, 9}, {3, 11, 1}, {13, 1, 7}, {33, 17, 29}, {65, 31, 47}};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                check_gemm(ta, tb, sizes[s][0], sizes[s][1], sizes[s][2], 3, 1.5f, -0.7f);
                check_gemm(ta, tb, sizes[s][0], sizes[s][1], sizes[s][2], 0, 1.0f, 0.0f);
                check_gemm(ta, tb, sizes[s][0], sizes[s][1], sizes[s][2], 5, -0.25f, 1.0f);
            }
    /* More threads must give the same answers. */
    ct_blas_set_threads(2);
    check_gemm(1, 0, 67, 45, 53, 2, 0.5f, 2.0f);
    ct_blas_set_threads(0); /* clamps to 1 */
    ASSERT_EQ(ct_blas_get_threads(), 1);
}

TEST(core_sgemm_degenerate)
{
    float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1};
    float c[4] = {1, 2, 3, 4};
    ct_sgemm(0, 0, 0, 2, 3, 1.0f, a, 3, b, 2, 0.0f, c, 2); /* m = 0: nothing */
    ct_sgemm(0, 0, 2, 0, 3, 1.0f, a, 3, b, 2, 0.0f, c, 2); /* n = 0: nothing */
    ASSERT(c[0] == 1 && c[1] == 2 && c[2] == 3 && c[3] == 4);
    ct_sgemm(0, 0, 2, 2, 0, 1.0f, a, 1, b, 2, 0.5f, c, 2); /* k = 0: C = beta*C */
    ASSERT(c[0] == 0.5f && c[1] == 1.0f && c[2] == 1.5f && c[3] == 2.0f);
    /* beta = 0 ignores whatever C held, even nan. */
    float d[4] = {NAN, NAN, NAN, NAN};
    ct_sgemm(0, 0, 2, 2, 3, 1.0f, a, 3, b, 2, 0.0f, d, 2);
    ASSERT(d[0] == 4 && d[1] == 5 && d[2] == 10 && d[3] == 11);
}

/* ---- kernel selection, seen through `ctrain version` and ctor_prog ----- */

/* Path of a program of this build: rel is relative to this binary's folder. */
static void built_path(char *out, size_t n, const char *rel)
{
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    ASSERT(len > 0);
    self[len] = 0;
    char *slash = strrchr(self, '/');
    ASSERT(slash != NULL);
    *slash = 0;
    snprintf(out, n, "%s/%s", self, rel);
    if (access(out, X_OK))
        ct_test_fail(__FILE__, __LINE__, "%s is missing: build it first (make test builds it; "
                     "make B=<dir> for that build)", out);
}

/* Runs the program rel (see built_path) with args, with the given variables
 * set; every BLAS-related variable not listed is unset, since this process
 * may have been started with some of them.  Returns its output (stdout and
 * stderr). */
static const char *run_prog(const char *rel, const char *args, const char *const *vars)
{
    static char out[4096];
    static const char *ours[] = {"OPENBLAS_CORETYPE", "CTRAIN_CORETYPE_AUTO", "CTRAIN_NO_REEXEC",
                                 "CTRAIN_BLAS_DISTRUST", "CTOR_PROG_LOG", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                 "CTRAIN_OMP_WAIT_AUTO", NULL};
    char path[PATH_MAX + 16], cmd[PATH_MAX + 128];
    built_path(path, sizeof path, rel);
    for (int i = 0; ours[i]; i++) unsetenv(ours[i]);
    for (int i = 0; vars[i]; i += 2) setenv(vars[i], vars[i + 1], 1);
    snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", path, args);
    FILE *p = popen(cmd, "r");
    ASSERT(p != NULL);
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    for (int i = 0; ours[i]; i++) unsetenv(ours[i]);
    if (st != 0) ct_test_fail(__FILE__, __LINE__, "%s exited with %d:\n%s", cmd, st, out);
    return out;
}

/* Runs `ctrain version` (see run_prog). */
static const char *run_version(const char *const *vars)
{
    const char *out = run_prog("../ctrain", "version", vars);
    ASSERT_STR_CONTAINS(out, "ctrain " CT_VERSION);
    return out;
}

static int cpu_has_avx512(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512cd");
}

static int cpu_has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

TEST(core_blas_user_coretype_respected)
{
    const char *out = run_version((const char *[]){"OPENBLAS_CORETYPE", "Haswell", NULL});
    ASSERT_STR_CONTAINS(out, "kernel Haswell (user's OPENBLAS_CORETYPE)");
    /* A marker inherited from a re-executed parent does not make the user's
     * own choice look like ours. */
    out = run_version((const char *[]){"OPENBLAS_CORETYPE", "Haswell", "CTRAIN_CORETYPE_AUTO",
                                       "SkylakeX", NULL});
    ASSERT_STR_CONTAINS(out, "kernel Haswell (user's OPENBLAS_CORETYPE)");
    out = run_version((const char *[]){"OPENBLAS_CORETYPE", "Haswell", "CTRAIN_CORETYPE_AUTO", "1", NULL});
    ASSERT_STR_CONTAINS(out, "kernel Haswell (user's OPENBLAS_CORETYPE)");
}

TEST(core_blas_reexec_selects_kernel)
{
    const char *out = run_version((const char *[]){"CTRAIN_BLAS_DISTRUST", "1", NULL});
    if (cpu_has_avx512()) ASSERT_STR_CONTAINS(out, "kernel SkylakeX (auto-selected by ctrain)");
    else if (cpu_has_avx2()) ASSERT_STR_CONTAINS(out, "kernel Haswell (auto-selected by ctrain)");
    else ASSERT_STR_CONTAINS(out, "(OpenBLAS default)"); /* nothing better to choose */

    /* CTRAIN_NO_REEXEC turns the re-exec off even when distrusting. */
    out = run_version((const char *[]){"CTRAIN_BLAS_DISTRUST", "1", "CTRAIN_NO_REEXEC", "1", NULL});
    ASSERT_STR_CONTAINS(out, "(OpenBLAS default)");
}

TEST(core_blas_default_kernel_not_slow)
{
    const char *out = run_version((const char *[]){NULL});
    const char *k = strstr(out, "kernel ");
    ASSERT(k != NULL);
    char name[64] = "";
    sscanf(k + 7, "%63[^ (]", name);
    ASSERT(name[0]);
    if (cpu_has_avx512() && !strcmp(name, "Prescott"))
        ct_test_fail(__FILE__, __LINE__, "an AVX-512 CPU runs the Prescott kernel:\n%s", out);
    if (cpu_has_avx2() && !strcmp(name, "Prescott"))
        ct_test_fail(__FILE__, __LINE__, "an AVX2 CPU runs the Prescott kernel:\n%s", out);
    /* And in this process too. */
    const char *here = ct_blas_corename();
    ASSERT(here != NULL && here[0]);
    if (cpu_has_avx512() && strcmp(ct_blas_kernel_source(), "user's OPENBLAS_CORETYPE"))
        ASSERT(strcmp(here, "Prescott"));
}

/* ---- linking libctrain changes nothing about how a program starts ------ */

/* Lines in the constructor log (each run of ctor_prog's constructor adds one). */
static int log_lines(const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0, ch;
    while ((ch = fgetc(f)) != EOF) n += ch == '\n';
    fclose(f);
    return n;
}

static const char *wanted_kernel(void)
{
    return cpu_has_avx512() ? "SkylakeX" : cpu_has_avx2() ? "Haswell" : NULL;
}

/* A program with a constructor of its own, linked with libctrain statically
 * and as a shared library, runs that constructor once and sees its own
 * environment, even when OpenBLAS's kernel looks slow (forced here with
 * CTRAIN_BLAS_DISTRUST): the library does not re-execute anyone. */
TEST(core_blas_linking_does_not_reexec)
{
    const char *progs[] = {"ctor_prog", "ctor_prog_so"};
    char log[1024];
    snprintf(log, sizeof log, "%s/ctor.log", ct_test_tmpdir());
    for (int i = 0; i < 2; i++) {
        unlink(log);
        const char *out = run_prog(progs[i], "", (const char *[]){"CTRAIN_BLAS_DISTRUST", "1",
                                                                  "CTOR_PROG_LOG", log, NULL});
        if (log_lines(log) != 1)
            ct_test_fail(__FILE__, __LINE__, "%s: its constructor ran %d times (once wanted):\n%s",
                         progs[i], log_lines(log), out);
        ASSERT_STR_CONTAINS(out, "constructor runs in this image: 1");
        ASSERT_STR_CONTAINS(out, "OPENBLAS_CORETYPE: (unset)");
        ASSERT_STR_CONTAINS(out, "(OpenBLAS default)");
    }
}

/* ct_blas_select_kernel re-executes the program once, with the fast kernel,
 * when asked to; never when the user chose a kernel or CTRAIN_NO_REEXEC is set. */
TEST(core_blas_select_kernel_reexecs_once)
{
    char log[1024], want[96];
    snprintf(log, sizeof log, "%s/ctor.log", ct_test_tmpdir());
    const char *k = wanted_kernel();
    const char *out = run_prog("ctor_prog", "--select", (const char *[]){"CTRAIN_BLAS_DISTRUST", "1",
                                                                         "CTOR_PROG_LOG", log, NULL});
    if (k) {
        ASSERT_EQ(log_lines(log), 2); /* the first image and the re-executed one */
        snprintf(want, sizeof want, "kernel %s (auto-selected by ctrain)", k);
        ASSERT_STR_CONTAINS(out, want);
        snprintf(want, sizeof want, "OPENBLAS_CORETYPE: %s", k);
        ASSERT_STR_CONTAINS(out, want);
    } else {
        ASSERT_EQ(log_lines(log), 2); /* no better kernel, but the wait policy to set */
        ASSERT_STR_CONTAINS(out, "(OpenBLAS default)");
    }

    unlink(log);
    out = run_prog("ctor_prog", "--select", (const char *[]){"CTRAIN_BLAS_DISTRUST", "1", "CTRAIN_NO_REEXEC", "1",
                                                             "CTOR_PROG_LOG", log, NULL});
    ASSERT_EQ(log_lines(log), 1);
    ASSERT_STR_CONTAINS(out, "(OpenBLAS default)");

    unlink(log);
    out = run_prog("ctor_prog", "--select", (const char *[]){"CTRAIN_BLAS_DISTRUST", "1", "OPENBLAS_CORETYPE",
                                                             "Haswell", "OMP_WAIT_POLICY", "ACTIVE", "CTOR_PROG_LOG",
                                                             log, NULL});
    ASSERT_EQ(log_lines(log), 1); /* both the user's: nothing to do */
    ASSERT_STR_CONTAINS(out, "kernel Haswell (user's OPENBLAS_CORETYPE)");

    /* The kernel the user's, the wait policy not: one re-exec, for the policy only. */
    unlink(log);
    out = run_prog("ctor_prog", "--select", (const char *[]){"CTRAIN_BLAS_DISTRUST", "1", "OPENBLAS_CORETYPE",
                                                             "Haswell", "CTOR_PROG_LOG", log, NULL});
    ASSERT_EQ(log_lines(log), 2);
    ASSERT_STR_CONTAINS(out, "kernel Haswell (user's OPENBLAS_CORETYPE)");
    ASSERT_STR_CONTAINS(out, "OMP_WAIT_POLICY: PASSIVE");
}

/* Issue 24, case 8: with 2 oneDNN threads per rank on shared cores,
 * libgomp's spinning threads made a bf16 GPT step 10x slower unless the
 * user knew to set OMP_WAIT_POLICY=PASSIVE.  ctrain now sets it (one
 * re-exec, with the kernel's), respects the user's OMP_WAIT_POLICY or
 * GOMP_SPINCOUNT, and `ctrain version` says which policy runs and why. */
TEST(core_omp_wait_policy_chosen)
{
    const char *out = run_version((const char *[]){NULL});
    ASSERT_STR_CONTAINS(out, "wait policy PASSIVE (set by ctrain");
    out = run_version((const char *[]){"OMP_WAIT_POLICY", "ACTIVE", NULL});
    ASSERT_STR_CONTAINS(out, "wait policy ACTIVE (user's OMP_WAIT_POLICY)");
    out = run_version((const char *[]){"GOMP_SPINCOUNT", "1000", NULL});
    ASSERT_STR_CONTAINS(out, "(user's GOMP_SPINCOUNT)");
    /* The mark alone does not make a user's value ours. */
    out = run_version((const char *[]){"OMP_WAIT_POLICY", "ACTIVE", "CTRAIN_OMP_WAIT_AUTO", "PASSIVE", NULL});
    ASSERT_STR_CONTAINS(out, "wait policy ACTIVE (user's OMP_WAIT_POLICY)");
    out = run_version((const char *[]){"CTRAIN_NO_REEXEC", "1", NULL});
    ASSERT_STR_CONTAINS(out, "libgomp's default");
}

/* ct_blas_warn_if_slow: one line naming the fix, once per process; silent
 * when the user chose the kernel. */
TEST(core_blas_warn_if_slow)
{
    const char *out = run_prog("ctor_prog", "--warn", (const char *[]){"CTRAIN_BLAS_DISTRUST", "1", NULL});
    const char *k = wanted_kernel();
    if (k) {
        char fix[64];
        snprintf(fix, sizeof fix, "set OPENBLAS_CORETYPE=%s", k);
        ASSERT_STR_CONTAINS(out, fix);
        ASSERT_STR_CONTAINS(out, "ct_blas_select_kernel");
        const char *first = strstr(out, fix);
        ASSERT(strstr(first + 1, fix) == NULL); /* once, though called twice */
    } else {
        ASSERT(!strstr(out, "OPENBLAS_CORETYPE="));
    }
    out = run_prog("ctor_prog", "--warn", (const char *[]){"CTRAIN_BLAS_DISTRUST", "1", "OPENBLAS_CORETYPE",
                                                           "Haswell", NULL});
    ASSERT(!strstr(out, "OPENBLAS_CORETYPE="));
    /* A library user hears it from ct_comm_init, and the program still starts once. */
    /* (Open MPI's own allocations at exit are not ours: no leak check here, as in the MPI suite) */
    out = run_prog("ctor_prog", "--comm", (const char *[]){"CTRAIN_BLAS_DISTRUST", "1", "ASAN_OPTIONS",
                                                           "detect_leaks=0", NULL});
    ASSERT_STR_CONTAINS(out, "constructor runs in this image: 1");
    if (k) ASSERT_STR_CONTAINS(out, "call ct_blas_select_kernel(argc, argv) first thing in main");
}

/*
 * BLAS set-up.  Debian's OpenBLAS 0.3.21 is built for many CPUs and picks its
 * kernel when the library loads; on some AVX-512 machines it misdetects the
 * CPU and falls back to 'Prescott', about 4.5x slower.  OpenBLAS reads
 * OPENBLAS_CORETYPE only at load time, so setting it later does nothing:
 * this constructor (which runs after OpenBLAS's own, since we link to it)
 * checks the kernel against what the CPU can do and, if it is the slow one,
 * sets OPENBLAS_CORETYPE and re-executes the program once, before main.
 * A user's own OPENBLAS_CORETYPE is always respected; CTRAIN_NO_REEXEC=1
 * turns the re-exec off (for debuggers).  CTRAIN_BLAS_DISTRUST=1 makes the
 * check treat any kernel as misdetected, so tests can exercise the re-exec on
 * machines where OpenBLAS already gets it right.
 */
#include "ctrain/core.h"

#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char *openblas_get_corename(void);
extern void openblas_set_num_threads(int);
extern int openblas_get_num_threads(void);

#define MARK "CTRAIN_CORETYPE_AUTO"

static const char *kernel_source = "OpenBLAS default";

static const char *wanted_core(void)
{
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd"))
        return "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
    return NULL;
}

static int is_slower_kernel(const char *have)
{
    /* The kernels that are at least as fast as what we would choose. */
    static const char *good[] = {"SkylakeX", "Cooperlake", "SapphireRapids", "Zen", NULL};
    for (int i = 0; good[i]; i++)
        if (!strcasecmp(have, good[i])) return 0;
    return 1;
}

__attribute__((constructor)) static void ct_blas_boot(int argc, char **argv, char **envp)
{
    (void)argc;
    (void)envp;
    const char *core = getenv("OPENBLAS_CORETYPE");
    if (core) {
        /* MARK holds the core we chose and is inherited by child processes: it
         * only vouches for OPENBLAS_CORETYPE while the two still agree. */
        const char *mark = getenv(MARK);
        kernel_source = mark && !strcmp(mark, core) ? "auto-selected by ctrain"
                                                     : "user's OPENBLAS_CORETYPE";
        return;
    }
    const char *want = wanted_core();
    if (!want || getenv("CTRAIN_NO_REEXEC") || !argv || !argv[0]) return;
    const char *have = openblas_get_corename();
    int distrust = getenv("CTRAIN_BLAS_DISTRUST") != NULL;
    if (!distrust && have && (!strcasecmp(have, want) || !is_slower_kernel(have))) return;
    setenv("OPENBLAS_CORETYPE", want, 1);
    setenv(MARK, want, 1);
    execv("/proc/self/exe", argv);
    /* exec failed: carry on with the slow kernel rather than fail. */
    unsetenv("OPENBLAS_CORETYPE");
    unsetenv(MARK);
}

void ct_sgemm(int trans_a, int trans_b, int m, int n, int k, float alpha,
              const float *a, int lda, const float *b, int ldb, float beta,
              float *c, int ldc)
{
    if (m == 0 || n == 0) return;
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb,
                beta, c, ldc);
}

void ct_blas_set_threads(int n)
{
    n = n < 1 ? 1 : n;
    openblas_set_num_threads(n);
    /* oneDNN's team (src/core/gemm.c applies it again on other calling threads). */
    omp_set_num_threads(n);
}
int ct_blas_get_threads(void) { return openblas_get_num_threads(); }
const char *ct_blas_corename(void) { return openblas_get_corename(); }
const char *ct_blas_kernel_source(void) { return kernel_source; }

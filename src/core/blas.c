/*
 * BLAS set-up.  Debian's OpenBLAS 0.3.21 is built for many CPUs and picks its
 * kernel when the library loads; on some AVX-512 machines it misdetects the
 * CPU and falls back to 'Prescott', about 4.5x slower.  OpenBLAS reads
 * OPENBLAS_CORETYPE only at load time, so setting it later does nothing: the
 * only cure inside a running program is to set it and execute the program
 * again.  The library never does that on its own (linking libctrain changes
 * nothing about how a program starts: no constructor here); a program that
 * wants it calls ct_blas_select_kernel first thing in main, as the ctrain
 * program does, and ct_blas_warn_if_slow tells everyone else how to fix it.
 *
 * A user's own OPENBLAS_CORETYPE is always respected; CTRAIN_NO_REEXEC=1
 * turns the re-exec off (for debuggers).
 *
 * The same re-exec picks OpenMP's wait policy.  oneDNN's threads are
 * libgomp's, which by default spin for a while at every barrier; with
 * several ranks of 2 threads each on shared cores a spinning thread holds
 * the core its partner needs, and a bf16 GPT step went from 0.26 s to 3 s.
 * libgomp reads OMP_WAIT_POLICY only when it loads, so, as for the kernel,
 * the only cure is to set it and start again: PASSIVE (threads sleep at
 * once), unless the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT.  CTRAIN_BLAS_DISTRUST=1 makes the
 * check treat any kernel as misdetected, so tests can exercise the re-exec
 * on machines where OpenBLAS already gets it right.
 */
#include "ctrain/core.h"

#include <cblas.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

extern char *openblas_get_corename(void);

/* Set with OPENBLAS_CORETYPE when ct_blas_select_kernel re-executes; it is
 * inherited by child processes, so it only vouches for OPENBLAS_CORETYPE
 * while the two agree. */
#define MARK "CTRAIN_CORETYPE_AUTO"
/* The same for OMP_WAIT_POLICY. */
#define WAIT_MARK "CTRAIN_OMP_WAIT_AUTO"
#define SAFE_WAIT "PASSIVE"

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

/* 1 if OpenBLAS runs a kernel slower than want (or CTRAIN_BLAS_DISTRUST). */
static int kernel_is_slow(const char *have, const char *want)
{
    /* The kernels that are at least as fast as what we would choose. */
    static const char *good[] = {"SkylakeX", "Cooperlake", "SapphireRapids", "Zen", NULL};
    if (getenv("CTRAIN_BLAS_DISTRUST")) return 1;
    if (!have || !strcasecmp(have, want)) return 0;
    for (int i = 0; good[i]; i++)
        if (!strcasecmp(have, good[i])) return 0;
    return 1;
}

/* How the kernel was chosen, from the environment OpenBLAS saw at load time
 * (read once, before ct_blas_select_kernel touches it). */
static pthread_once_t source_once = PTHREAD_ONCE_INIT;
static const char *kernel_source = "OpenBLAS default";
static int user_chose; /* OPENBLAS_CORETYPE was set when the program started */
static char wait_policy[96] = "libgomp's default (spin, then sleep)";
static int wait_chosen; /* OMP_WAIT_POLICY or GOMP_SPINCOUNT was set when the program started */

static void read_source(void)
{
    const char *wait = getenv("OMP_WAIT_POLICY"), *spin = getenv("GOMP_SPINCOUNT"), *wmark = getenv(WAIT_MARK);
    if (wait) {
        wait_chosen = 1;
        snprintf(wait_policy, sizeof wait_policy, "%.32s (%s)", wait,
                 wmark && !strcmp(wmark, wait) ? "set by ctrain: threads sharing cores sleep, not spin"
                                               : "user's OMP_WAIT_POLICY");
    } else if (spin) {
        wait_chosen = 1;
        snprintf(wait_policy, sizeof wait_policy, "spin count %.32s (user's GOMP_SPINCOUNT)", spin);
    }
    const char *core = getenv("OPENBLAS_CORETYPE");
    if (!core) return;
    const char *mark = getenv(MARK);
    user_chose = 1;
    kernel_source = mark && !strcmp(mark, core) ? "auto-selected by ctrain" : "user's OPENBLAS_CORETYPE";
}

ct_status ct_blas_select_kernel(int argc, char **argv)
{
    pthread_once(&source_once, read_source);
    if (getenv("CTRAIN_NO_REEXEC")) return CT_OK;
    /* Each is the user's choice, or already ours when this is the re-executed image. */
    const char *want = user_chose ? NULL : wanted_core();
    int fix_kernel = want && kernel_is_slow(openblas_get_corename(), want), fix_wait = !wait_chosen;
    if (!fix_kernel && !fix_wait) return CT_OK;
    if (argc < 1 || !argv || !argv[0] || argv[argc])
        return ct_error(CT_EINVAL, "ct_blas_select_kernel needs main's argc and argv (argv[argc] NULL) "
                        "to re-execute the program; pass them unchanged");
    if (fix_kernel) {
        setenv("OPENBLAS_CORETYPE", want, 1);
        setenv(MARK, want, 1);
    }
    if (fix_wait) {
        setenv("OMP_WAIT_POLICY", SAFE_WAIT, 1);
        setenv(WAIT_MARK, SAFE_WAIT, 1);
    }
    fflush(NULL); /* output buffered so far would be written twice */
    execv("/proc/self/exe", argv);
    int err = errno;
    const char *vars[] = {"OPENBLAS_CORETYPE", MARK, "OMP_WAIT_POLICY", WAIT_MARK};
    for (int i = fix_kernel ? 0 : 2; i < (fix_wait ? 4 : 2); i++) unsetenv(vars[i]);
    if (!fix_kernel)
        return ct_error(CT_EUNSUPPORTED, "cannot re-execute %s to set OMP_WAIT_POLICY=%s (%s); the program goes "
                        "on with libgomp's spinning threads, slow when ranks share cores: set OMP_WAIT_POLICY=%s "
                        "before starting it", argv[0], SAFE_WAIT, strerror(err), SAFE_WAIT);
    return ct_error(CT_EUNSUPPORTED, "cannot re-execute %s to select OpenBLAS's %s kernel (%s); the "
                    "program goes on with the %s kernel: set OPENBLAS_CORETYPE=%s before starting it",
                    argv[0], want, strerror(err), openblas_get_corename(), want);
}

const char *ct_omp_wait_policy(void)
{
    pthread_once(&source_once, read_source);
    return wait_policy;
}

void ct_blas_warn_if_slow(void)
{
    static atomic_int warned;
    pthread_once(&source_once, read_source);
    const char *want = wanted_core();
    if (user_chose || !want) return;
    const char *have = openblas_get_corename();
    if (!kernel_is_slow(have, want) || atomic_exchange(&warned, 1)) return;
    ct_log(CT_LOG_WARN, "OpenBLAS runs its %s kernel on a CPU that supports %s, up to ~4.5x slower for "
           "matrix products: set OPENBLAS_CORETYPE=%s before starting the program, or call "
           "ct_blas_select_kernel(argc, argv) first thing in main", have ? have : "?", want, want);
}

/* One thread's share of ct_sgemm: rows [lo, hi) of C, or its columns. */
typedef struct {
    int ta, tb, m, n, k, lda, ldb, ldc, by_cols;
    float alpha, beta;
    const float *a, *b;
    float *c;
} sgemm_job;

static void sgemm_part(void *ctx, int64_t lo, int64_t hi)
{
    const sgemm_job *j = ctx;
    const float *a = j->a, *b = j->b;
    float *c = j->c;
    int m = j->m, n = j->n;
    if (j->by_cols) {
        b += j->tb ? lo * j->ldb : lo;
        c += lo;
        n = (int)(hi - lo);
    } else {
        a += j->ta ? lo : lo * j->lda;
        c += lo * j->ldc;
        m = (int)(hi - lo);
    }
    cblas_sgemm(CblasRowMajor, j->ta ? CblasTrans : CblasNoTrans, j->tb ? CblasTrans : CblasNoTrans, m, n,
                j->k, j->alpha, a, j->lda, b, j->ldb, j->beta, c, j->ldc);
}

/* Products below this many multiply-adds are not worth waking the team for. */
#define SGEMM_SHARE_MIN (1 << 21)

void ct_sgemm(int trans_a, int trans_b, int m, int n, int k, float alpha,
              const float *a, int lda, const float *b, int ldb, float beta,
              float *c, int ldc)
{
    if (m == 0 || n == 0) return;
    /* OpenBLAS runs one thread (src/core/parallel.c); a big product is cut
     * into blocks of C, the longer side, one per thread of the team.  Each
     * element of C still sums over all of k in OpenBLAS's order. */
    sgemm_job j = {trans_a != 0, trans_b != 0, m, n, k, lda, ldb, ldc, n > m, alpha, beta, a, b, c};
    int64_t side = j.by_cols ? n : m;
    double t0 = ct_ledger_begin();
    if ((int64_t)m * n * k < SGEMM_SHARE_MIN) sgemm_part(&j, 0, side);
    else ct_parallel_for(side, 32, sgemm_part, &j);
    ct_ledger_end(CT_LEDGER_PRODUCTS, t0);
}

const char *ct_blas_corename(void) { return openblas_get_corename(); }
const char *ct_blas_kernel_source(void)
{
    pthread_once(&source_once, read_source);
    return kernel_source;
}

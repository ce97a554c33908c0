/*
 * The one thread policy of a rank, and the parallel-for every kernel shares.
 *
 * A rank is given a number of threads (ct_blas_set_threads, the CLI's
 * --threads).  All of them are one OpenMP team: oneDNN's products run on it,
 * OpenBLAS is called from it (its own pthread pool stays at one thread, so
 * two pools never spin against each other on the same cores, see
 * ct_sgemm), and ctrain's own kernels (casts, LayerNorm, GELU, attention,
 * the loss, the optimizer) split their work over it through
 * ct_parallel_for.
 *
 * ct_parallel_for cuts [0, n) into one contiguous range per thread, by the
 * index only, and each range runs the same code a single thread would run
 * over it.  A kernel whose items are independent (elements, rows, heads)
 * therefore gives the same bits at any thread count; that is the contract
 * of every caller, and tests/test_threads.c holds them to it.
 *
 * A thread that is not the rank's compute thread (the communication thread,
 * offload's I/O thread) calls ct_parallel_serial_here once: a team of its
 * own would take cores the compute thread's team is using.
 */
#include <omp.h>
#include <stdatomic.h>

#include "ctrain/core.h"

extern void openblas_set_num_threads(int);
extern int openblas_get_num_threads(void);

static atomic_int team;                 /* 0: not set; OpenBLAS's default is then the count */
static _Thread_local int serial_thread; /* ct_parallel_serial_here was called on this thread */

void ct_blas_set_threads(int n)
{
    n = n < 1 ? 1 : n;
    atomic_store(&team, n);
    /* OpenBLAS is only ever called with one thread: where a product is big
     * enough to share, ct_sgemm splits it over the OpenMP team. */
    openblas_set_num_threads(1);
    /* oneDNN's team (src/core/gemm.c applies it again on other calling threads). */
    omp_set_num_threads(n);
}

int ct_blas_get_threads(void)
{
    int n = atomic_load(&team);
    return n > 0 ? n : openblas_get_num_threads();
}

void ct_parallel_serial_here(void) { serial_thread = 1; }

int ct_parallel_threads(int64_t n, int64_t grain)
{
    if (serial_thread || omp_in_parallel() || n <= 0) return 1;
    int t = ct_blas_get_threads();
    int64_t most = grain > 0 ? n / grain : n;
    return most < t ? (most < 1 ? 1 : (int)most) : t;
}

void ct_parallel_for(int64_t n, int64_t grain, ct_range_fn fn, void *ctx)
{
    int t = ct_parallel_threads(n, grain);
    if (t <= 1) {
        if (n > 0) fn(ctx, 0, n);
        return;
    }
#pragma omp parallel num_threads(t)
    {
        int i = omp_get_thread_num(), nt = omp_get_num_threads();
        /* Boundaries on multiples of 16 items keep vector loops whole. */
        int64_t lo = n * i / nt, hi = n * (i + 1) / nt;
        if (n >= 16 * (int64_t)nt) {
            lo = i == 0 ? 0 : lo / 16 * 16;
            hi = i == nt - 1 ? n : hi / 16 * 16;
        }
        if (lo < hi) fn(ctx, lo, hi);
    }
}

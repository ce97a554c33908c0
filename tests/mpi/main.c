/*
 * The multi-rank test program, run by tests/runner.c under mpirun at 2, 3
 * and 4 ranks:  mpirun -np N mpi_run [NAME-SUBSTRING...]
 *
 * Every rank runs every selected test, in the same order (collectives must
 * be called in the same order on all ranks).  A test passes when it passes
 * on all ranks (an allreduce MIN of the outcome: fail < skip < ok, so a
 * test that skips on some rank and passes on the others is skipped); rank 0
 * prints one line "ok NAME", "skip NAME" or "FAIL NAME" per test, which the
 * runner counts.  Each test's scratch directory is removed when it ends.  A watchdog
 * turns a test that hangs (say, one rank failed an assertion and skipped a
 * collective the others wait in) into a FAIL line and a job abort instead
 * of a silent hang.  Exit status 0 means the suite ran, whatever failed;
 * 1 also when all passed but ctrain memory was left allocated.
 *
 *   mpi_run --abort-demo   the last rank calls ct_comm_abort while the
 *                          others wait in a barrier (tests/test_comm_single.c
 *                          checks that the job ends with the rank's message).
 *   mpi_run --timeout-demo run with CTRAIN_COMM_TIMEOUT=2: three allreduces on
 *                          the world, then the last rank skips the fourth and
 *                          sleeps; the job must end with "allreduce #4 on group
 *                          world" logged by every rank (tests/test_comm_single.c).
 */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "../harness.h"
#include "ctrain/comm.h"

/* Under AddressSanitizer the suite runs without leak detection: Open MPI
 * keeps allocations past MPI_Finalize (in plugins it has unloaded by then, so
 * they cannot be suppressed by name).  ctrain's own memory is checked instead:
 * every byte from ct_alloc must be back when the suite ends. */
#if defined(__SANITIZE_ADDRESS__)
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "detect_leaks=0"; }
#endif

__attribute__((noinline)) static size_t ctrain_bytes(void)
{
    size_t n = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) n += ct_mem_current((ct_mem_cat)c);
    return n;
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const char *name; /* test running, NULL between tests */
    int seq;          /* bumped when a test ends */
    int done;
    double timeout;
} dog = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *watchdog(void *arg)
{
    int rank = *(int *)arg;
    pthread_mutex_lock(&dog.mu);
    while (!dog.done) {
        if (!dog.name) {
            pthread_cond_wait(&dog.cv, &dog.mu);
            continue;
        }
        int seq = dog.seq;
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += (time_t)dog.timeout;
        while (dog.seq == seq && !dog.done)
            if (pthread_cond_timedwait(&dog.cv, &dog.mu, &until)) break;
        if (dog.seq == seq && !dog.done) {
            if (rank == 0) {
                printf("FAIL %s (hung for %.0fs; aborting the suite)\n", dog.name, dog.timeout);
                fflush(stdout);
            }
            ct_comm_abort("test %s hung for %.0fs", dog.name, dog.timeout);
        }
    }
    pthread_mutex_unlock(&dog.mu);
    return NULL;
}

static void dog_set(const char *name)
{
    pthread_mutex_lock(&dog.mu);
    dog.name = name;
    dog.seq++;
    pthread_cond_broadcast(&dog.cv);
    pthread_mutex_unlock(&dog.mu);
}

static int matches(const char *name, int nfilt, char **filt)
{
    if (nfilt == 0) return 1;
    for (int i = 0; i < nfilt; i++)
        if (strstr(name, filt[i])) return 1;
    return 0;
}

static int abort_demo(ct_group *w)
{
    if (ct_group_rank(w) == ct_group_size(w) - 1) ct_comm_abort("demo failure requested by --abort-demo");
    ct_group_barrier(w); /* never returns: the last rank does not come */
    fprintf(stderr, "abort demo: barrier returned, which it must not\n");
    return 1;
}

static int timeout_demo(ct_group *w)
{
    float x = 1;
    for (int i = 0; i < 3; i++)
        if (ct_group_allreduce(w, &x, 1, CT_F32, CT_OP_SUM, NULL) != CT_OK) return 1;
    if (ct_group_rank(w) == ct_group_size(w) - 1) {
        sleep(60); /* never joins the fourth: the others' timeout must end the job */
        fprintf(stderr, "timeout demo: rank %d was not ended\n", ct_group_rank(w));
        return 1;
    }
    ct_group_allreduce(w, &x, 1, CT_F32, CT_OP_SUM, NULL);
    fprintf(stderr, "timeout demo: the allreduce returned, which it must not\n");
    return 1;
}

int main(int argc, char **argv)
{
    if (ct_blas_select_kernel(argc, argv) != CT_OK) fprintf(stderr, "mpi_run: warning: %s\n", ct_last_error());
    setvbuf(stdout, NULL, _IOLBF, 0);
    size_t bytes0 = ctrain_bytes();
    if (ct_comm_init(&argc, &argv) != CT_OK) {
        fprintf(stderr, "mpi_run: ct_comm_init failed: %s\n", ct_last_error());
        return 1;
    }
    ct_group *w = ct_group_world();
    int rank = ct_group_rank(w);
    if (argc > 1 && !strcmp(argv[1], "--abort-demo")) return abort_demo(w);
    if (argc > 1 && !strcmp(argv[1], "--timeout-demo")) return timeout_demo(w);

    const char *t = getenv("CTRAIN_MPI_TEST_TIMEOUT");
    dog.timeout = t ? atof(t) : 30;
    pthread_t dog_th;
    pthread_create(&dog_th, NULL, watchdog, &rank);

    ct_tests_sort();
    double t0 = now();
    enum { OUT_FAIL = 0, OUT_SKIP = 1, OUT_OK = 2 };
    static const char *const out_word[] = {"FAIL", "skip", "ok"};
    int nrun = 0, nfail = 0, nskip = 0;
    for (int i = 0; i < ct_ntests; i++) {
        if (!matches(ct_tests[i].name, argc - 1, argv + 1)) continue;
        dog_set(ct_tests[i].name);
        volatile int outcome = OUT_FAIL;
        double ts = now();
        int end = setjmp(ct_test_jmp);
        if (end == 0) {
            ct_tests[i].fn();
            outcome = OUT_OK;
        } else if (end == CT_TEST_JMP_SKIP) {
            outcome = OUT_SKIP;
        } else {
            fprintf(stderr, "    (%s failed on rank %d)\n", ct_tests[i].name, rank);
        }
        ct__test_tmpdir_done(outcome == OUT_FAIL);
        int32_t all = outcome;
        if (ct_group_allreduce(w, &all, 1, CT_I32, CT_OP_MIN, NULL) != CT_OK)
            ct_comm_abort("cannot combine the results of %s: %s", ct_tests[i].name, ct_last_error());
        dog_set(NULL);
        nrun++;
        nfail += all == OUT_FAIL;
        nskip += all == OUT_SKIP;
        if (rank == 0) {
            printf("%s %s\n", out_word[all], ct_tests[i].name);
            if (getenv("CTRAIN_MPI_TEST_TIMES"))
                fprintf(stderr, "    %s %.3fs\n", ct_tests[i].name, now() - ts);
            fflush(stdout);
        }
    }
    pthread_mutex_lock(&dog.mu);
    dog.done = 1;
    pthread_cond_broadcast(&dog.cv);
    pthread_mutex_unlock(&dog.mu);
    pthread_join(dog_th, NULL);
    if (rank == 0 && nrun == 0) fprintf(stderr, "mpi_run: no test matched\n");
    if (rank == 0)
        fprintf(stderr, "mpi_run: %d tests, %d failed, %d skipped, at %d ranks, %.2fs\n", nrun,
                nfail, nskip, ct_group_size(w), now() - t0);
    ct_comm_finalize();
    ct_gemm_cache_clear(); /* oneDNN's cached primitives are kept for the process, not leaked */
    size_t left = ctrain_bytes();
    if (nfail == 0 && left != bytes0) {
        fprintf(stderr, "mpi_run: rank %d: %zu bytes from ct_alloc still allocated after the "
                        "suite (%zu before): a test or the library leaks\n", rank, left, bytes0);
        return 1;
    }
    return 0;
}

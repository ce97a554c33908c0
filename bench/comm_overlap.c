/*
 * bench/comm_overlap: do allreduces started asynchronously run while the
 * main thread computes?  With one BLAS thread per rank it times
 *   T_compute  a fixed amount of sgemm work (8 products 1024x1024x64),
 *   T_comm     allreducing 8 buffers of 4 MiB f32 alone (start all, wait all),
 *   T_both     starting the allreduces, doing the compute, then waiting,
 * each the slowest rank's time, median over the repetitions, and prints
 *   overlap = (T_compute + T_comm - T_both) / min(T_compute, T_comm)
 * (1.0: communication fully hidden, 0: none).  Shared-memory communication
 * is itself CPU work (copies and sums), so when every core computes it can
 * only hide the time the comm thread spends waiting; the same overlap with
 * the compute replaced by a sleep as long shows what the comm thread does
 * when a core is free (compute on a GPU, or fewer ranks than cores).  CPU figures are the process
 * CPU time over wall time on rank 0, which shows whether waiting costs CPU;
 * a last phase has rank 0 wait 200 ms for a late peer and reports what that
 * waiting costs (the comm thread's polling).
 *
 *   bench/comm_overlap [--reps N] [--poll-us US] [--mib M] [--nbuf N] [--ngemm N]
 *   bench/comm_overlap --compare-shm [--reps N] [--ngemm N]
 *
 * --compare-shm times the two allreduce paths side by side, for 8 x 4 MiB
 * and 1 x 28 MiB f32 (DDP's bucket shapes): MPI (private buffers: Open MPI's
 * ring, copies through vader) and the direct shared-memory path (buffers
 * from ct_group_alloc_shared).  For each: T_comm (slowest rank) and the CPU
 * time rank 0's process spends in it (its main thread sleeps in
 * ct_work_wait, so that is the comm thread's work), then T_both with the
 * compute running and the CPU the allreduces added to it (CPU of T_both
 * minus CPU of the compute alone).
 *
 *   bench/comm_overlap --compare-two-level [--reps N] [--nodes K] [--mib M] [--nbuf N]
 *
 * --compare-two-level times (allreduce, then reduce-scatter and all-gather of
 * the same buffers in blocks), on a copy of the world cut into K fake nodes
 * (ct_comm_set_fake_nodes, default 2; run it on 4 ranks: mpirun -np 4), the
 * flat allreduce (private buffers: one MPI_Iallreduce over all ranks) and
 * the two-level one (buffers from ct_group_alloc_shared: shared memory in
 * each node, MPI between node leaders): T_comm for nbuf x M MiB f32
 * (default 8 x 4), slowest rank, median, and rank 0's CPU time in it.
 *
 * Started without mpirun it re-launches itself on 2 ranks.  The last line is
 * machine-readable: "ctrain_comm_overlap t_compute_ms=... overlap=..." (or
 * "ctrain_comm_shm ..." with --compare-shm).
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctrain/comm.h"
#include "bench.h"

static double wall(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void check(ct_status s, const char *what)
{
    if (s != CT_OK) ct_comm_abort("%s failed: %s", what, ct_last_error());
}

enum { M = 1024, N = 1024, K = 64, MAXBUF = 64 };

static float *a, *b, *c;
static double last_cpu; /* this rank's CPU seconds in the last phase */
static float *buf[MAXBUF];
static int nbuf = 8, ngemm = 8;
static int64_t count;

static void compute(void)
{
    for (int i = 0; i < ngemm; i++) ct_sgemm(0, 0, M, N, K, 1.0f, a, K, b, N, 0.0f, c, N);
}

static void start_allreduces(ct_work **w)
{
    for (int i = 0; i < nbuf; i++)
        check(ct_group_allreduce(ct_group_world(), buf[i], count, CT_F32, CT_OP_SUM, &w[i]),
              "allreduce");
}

static void wait_allreduces(ct_work **w)
{
    check(ct_work_wait_all(w, nbuf), "waiting for the allreduces");
    for (int i = 0; i < nbuf; i++) ct_work_destroy(w[i]);
}

enum phase { COMPUTE, COMM, BOTH, SLEEP_BOTH, LATE_PEER };

static void sleep_for(double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
}

/* Runs one phase on every rank from a common start; returns the slowest
 * rank's wall time and sets *cpu_frac to this rank's CPU time / wall time.
 * SLEEP_BOTH sleeps for `idle` seconds instead of computing: what overlap
 * looks like when the compute leaves the CPU free (as a GPU would). */
static double phase(enum phase which, double idle, double *cpu_frac)
{
    ct_work *w[MAXBUF];
    ct_group *g = ct_group_world();
    check(ct_group_barrier(g), "barrier");
    double t0 = wall(), c0 = cpu();
    switch (which) {
    case COMPUTE: compute(); break;
    case COMM: start_allreduces(w), wait_allreduces(w); break;
    case BOTH: start_allreduces(w), compute(), wait_allreduces(w); break;
    case SLEEP_BOTH: start_allreduces(w), sleep_for(idle), wait_allreduces(w); break;
    case LATE_PEER: { /* the last rank comes 200 ms late: what does waiting cost the others? */
        float x = 1;
        if (ct_group_rank(g) == ct_group_size(g) - 1) sleep_for(0.2);
        check(ct_group_allreduce(g, &x, 1, CT_F32, CT_OP_SUM, &w[0]), "allreduce");
        check(ct_work_wait(w[0]), "allreduce");
        ct_work_destroy(w[0]);
        break;
    }
    }
    double t = wall() - t0;
    last_cpu = cpu() - c0;
    *cpu_frac = last_cpu / t;
    int64_t ns = (int64_t)(t * 1e9); /* ctrain has no f64: the max in integer ns */
    check(ct_group_allreduce(g, &ns, 1, CT_I64, CT_OP_MAX, NULL), "allreduce");
    return (double)ns * 1e-9;
}

/* --compare-shm: per path and shape, reps rounds of (compute alone, the
 * allreduces alone, both), interleaved so that drift and other load hit all
 * three alike; medians of the slowest rank's wall time and of rank 0's CPU. */
static void compare_shm(int reps)
{
    static const struct { int nbuf; double mib; const char *name; } cfg[] = {
        {8, 4, "8x4MiB"}, {1, 28, "1x28MiB"}};
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    char line[1024];
    int len = snprintf(line, sizeof line, "ctrain_comm_shm");
    if (rank == 0)
        printf("comm_overlap --compare-shm: %d ranks, 1 BLAS thread each, %d x sgemm %dx%dx%d, "
               "median of %d\n", ct_group_size(g), ngemm, M, N, K, reps);
    for (int k = 0; k < 2; k++) {
        nbuf = cfg[k].nbuf;
        count = (int64_t)(cfg[k].mib * 1024 * 1024 / sizeof(float));
        size_t bytes = (size_t)count * sizeof(float);
        for (int path = 0; path < 2; path++) {
            for (int i = 0; i < nbuf; i++) {
                if (path) check(ct_group_alloc_shared(g, bytes, CT_MEM_COMM, (void **)&buf[i]),
                                "ct_group_alloc_shared");
                else if (!(buf[i] = ct_alloc_zeroed(bytes, CT_MEM_COMM))) ct_comm_abort("out of memory");
                for (int64_t j = 0; j < count; j++) buf[i][j] = 1e-3f * (float)(j % 7);
            }
            int direct = ct_group_is_shared(g, buf[0], bytes);
            double tc[1000], tm[1000], cm[1000], tb[1000], cadd[1000], dummy;
            phase(COMM, 0, &dummy), phase(BOTH, 0, &dummy); /* warm-up */
            for (int r = 0; r < reps; r++) {
                tc[r] = phase(COMPUTE, 0, &dummy) * 1e3;
                double cc = last_cpu;
                tm[r] = phase(COMM, 0, &dummy) * 1e3;
                cm[r] = last_cpu * 1e3;
                tb[r] = phase(BOTH, 0, &dummy) * 1e3;
                cadd[r] = (last_cpu - cc) * 1e3;
            }
            double Tc = median(tc, reps), Tm = median(tm, reps), Cm = median(cm, reps);
            double Tb = median(tb, reps), Ca = median(cadd, reps);
            const char *pname = path ? (direct ? "shm" : "shm-unavailable") : "mpi";
            if (rank == 0)
                printf("  %-8s %-4s T_comm %6.2f ms  cpu %6.2f ms | T_compute %6.2f ms  "
                       "T_both %6.2f ms  cpu added %6.2f ms\n",
                       cfg[k].name, pname, Tm, Cm, Tc, Tb, Ca);
            len += snprintf(line + len, sizeof line - (size_t)len,
                            " %s_%s_comm_ms=%.3f cpu_ms=%.3f compute_ms=%.3f both_ms=%.3f "
                            "cpu_added_ms=%.3f", pname, cfg[k].name, Tm, Cm, Tc, Tb, Ca);
            for (int i = 0; i < nbuf; i++) {
                if (path) ct_group_free_shared(g, buf[i]);
                else ct_free(buf[i]);
                buf[i] = NULL;
            }
        }
    }
    if (rank == 0) printf("%s\n", line);
}

/* --compare-two-level: allreduce, reduce-scatter (the buffer is the send,
 * a private block the recv) and all-gather (the buffer is the recv, a
 * private block the send) of nbuf buffers of n f32, flat and two-level. */
static void compare_two_level(int reps, int nodes, int64_t n)
{
    static const char *names[3] = {"allreduce", "reduce_scatter", "allgather"};
    ct_comm_set_fake_nodes(nodes);
    ct_group *g = NULL;
    check(ct_group_split(ct_group_world(), 0, ct_group_rank(ct_group_world()), &g), "split");
    ct_comm_set_fake_nodes(0);
    int rank = ct_group_rank(g), size = ct_group_size(g);
    n -= n % size; /* whole blocks */
    int64_t blk = n / size;
    float *priv[MAXBUF];
    for (int i = 0; i < nbuf; i++)
        if (!(priv[i] = ct_alloc_zeroed((size_t)blk * sizeof(float), CT_MEM_COMM)))
            ct_comm_abort("out of memory");
    for (int coll = 0; coll < 3; coll++) {
        double ms[2] = {0, 0}, cpums[2] = {0, 0};
        for (int path = 0; path < 2; path++) {
            size_t bytes = (size_t)n * sizeof(float);
            for (int i = 0; i < nbuf; i++) {
                if (path) check(ct_group_alloc_shared(g, bytes, CT_MEM_COMM, (void **)&buf[i]), "alloc");
                else if (!(buf[i] = ct_alloc_zeroed(bytes, CT_MEM_COMM))) ct_comm_abort("out of memory");
                for (int64_t j = 0; j < n; j++) buf[i][j] = 1e-3f * (float)(j % 7);
            }
            double t[1000], c[1000];
            for (int r = -1; r < reps; r++) {
                ct_work *w[MAXBUF];
                check(ct_group_barrier(g), "barrier");
                double t0 = wall(), c0 = cpu();
                for (int i = 0; i < nbuf; i++) {
                    if (coll == 0)
                        check(ct_group_allreduce(g, buf[i], n, CT_F32, CT_OP_SUM, &w[i]), "allreduce");
                    else if (coll == 1)
                        check(ct_group_reduce_scatter(g, buf[i], priv[i], blk, CT_F32, CT_OP_SUM,
                                                      &w[i]), "reduce_scatter");
                    else
                        check(ct_group_allgather(g, priv[i], buf[i], blk, CT_F32, &w[i]),
                              "allgather");
                }
                check(ct_work_wait_all(w, nbuf), "wait");
                for (int i = 0; i < nbuf; i++) ct_work_destroy(w[i]);
                int64_t ns = (int64_t)((wall() - t0) * 1e9);
                double cc = cpu() - c0;
                check(ct_group_allreduce(g, &ns, 1, CT_I64, CT_OP_MAX, NULL), "allreduce");
                if (r >= 0) t[r] = (double)ns * 1e-6, c[r] = cc * 1e3;
            }
            ms[path] = median(t, reps);
            cpums[path] = median(c, reps);
            for (int i = 0; i < nbuf; i++) {
                if (path) ct_group_free_shared(g, buf[i]);
                else ct_free(buf[i]);
                buf[i] = NULL;
            }
        }
        if (rank == 0) {
            printf("comm_overlap --compare-two-level: %d ranks on %d fake nodes, %d x %.3g MiB f32 "
                   "%s, median of %d\n", size, nodes, nbuf, (double)n * 4 / 1048576,
                   names[coll], reps);
            printf("  flat (MPI)         T_comm %8.2f ms  rank 0 cpu %8.2f ms\n", ms[0], cpums[0]);
            printf("  two-level (shm+MPI) T_comm %8.2f ms  rank 0 cpu %8.2f ms\n", ms[1], cpums[1]);
            printf("ctrain_comm_two_level%s%s flat_ms=%.3f two_level_ms=%.3f flat_cpu_ms=%.3f "
                   "two_level_cpu_ms=%.3f\n", coll ? "_" : "", coll ? names[coll] : "", ms[0],
                   ms[1], cpums[0], cpums[1]);
        }
    }
    for (int i = 0; i < nbuf; i++) ct_free(priv[i]);
    ct_group_destroy(g);
}

int main(int argc, char **argv)
{
    ct_blas_select_kernel(argc, argv); /* measure the fast kernel, as ctrain runs it */
    bench_relaunch_under_mpirun(argc, argv, 2);
    int reps = 9, shm_mode = 0, two_level = 0, nodes = 2;
    double mib = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--poll-us") && i + 1 < argc) setenv("CTRAIN_COMM_POLL_US", argv[++i], 1);
        else if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = atof(argv[++i]);
        else if (!strcmp(argv[i], "--nbuf") && i + 1 < argc) nbuf = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ngemm") && i + 1 < argc) ngemm = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--compare-shm")) shm_mode = 1;
        else if (!strcmp(argv[i], "--compare-two-level")) two_level = 1;
        else if (!strcmp(argv[i], "--nodes") && i + 1 < argc) nodes = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: comm_overlap [--reps N] [--poll-us US] [--mib M] [--nbuf N] "
                            "[--ngemm N] [--compare-shm] [--compare-two-level [--nodes K]]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 1000 || nbuf < 1 || nbuf > MAXBUF || ngemm < 0 || mib <= 0) {
        fprintf(stderr, "comm_overlap: bad option value\n");
        return 2;
    }
    check(ct_comm_init(&argc, &argv), "ct_comm_init");
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    ct_blas_set_threads(1);
    count = (int64_t)(mib * 1024 * 1024 / sizeof(float));
    a = ct_alloc_zeroed((size_t)M * K * sizeof(float), CT_MEM_ACT);
    b = ct_alloc_zeroed((size_t)K * N * sizeof(float), CT_MEM_ACT);
    c = ct_alloc_zeroed((size_t)M * N * sizeof(float), CT_MEM_ACT);
    if (!a || !b || !c) ct_comm_abort("out of memory");
    for (int i = 0; i < M * K; i++) a[i] = (float)(i % 7) * 0.01f;
    for (int i = 0; i < K * N; i++) b[i] = (float)(i % 5) * 0.01f;
    if (two_level) {
        compare_two_level(reps, nodes, count);
        ct_free(a), ct_free(b), ct_free(c);
        ct_comm_finalize();
        return 0;
    }
    if (shm_mode) {
        compare_shm(reps);
        ct_free(a), ct_free(b), ct_free(c);
        ct_comm_finalize();
        return 0;
    }
    for (int i = 0; i < nbuf; i++) {
        buf[i] = ct_alloc_zeroed((size_t)count * sizeof(float), CT_MEM_COMM);
        if (!buf[i]) ct_comm_abort("out of memory");
    }

    double tc[1000], tm[1000], tb[1000], ts[1000], fc[1000], fm[1000], fb[1000], fs[1000];
    double dummy, idle_cpu;
    phase(COMPUTE, 0, &dummy), phase(COMM, 0, &dummy), phase(BOTH, 0, &dummy); /* warm-up */
    for (int r = 0; r < reps; r++) {
        tc[r] = phase(COMPUTE, 0, &fc[r]);
        tm[r] = phase(COMM, 0, &fm[r]);
        tb[r] = phase(BOTH, 0, &fb[r]);
        ts[r] = phase(SLEEP_BOTH, tc[r], &fs[r]);
    }
    phase(LATE_PEER, 0, &idle_cpu);
    double Tc = median(tc, reps), Tm = median(tm, reps), Tb = median(tb, reps);
    double Ts = median(ts, reps), lo = Tc < Tm ? Tc : Tm;
    double overlap = lo > 0 ? (Tc + Tm - Tb) / lo : 0;
    double overlap_idle = lo > 0 ? (Tc + Tm - Ts) / lo : 0;
    if (rank == 0) {
        printf("comm_overlap: %d ranks, 1 BLAS thread each, %d x sgemm %dx%dx%d, %d x %.3g MiB f32 "
               "allreduce, poll %d-%d us, %s, median of %d\n",
               ct_group_size(g), ngemm, M, N, K, nbuf, mib, ct_comm_get_poll_us(),
               ct_comm_get_poll_max_us(), ct_comm_thread_level(), reps);
        printf("  T_compute      %8.2f ms   (rank 0 cpu/wall %.2f)\n", Tc * 1e3, median(fc, reps));
        printf("  T_comm         %8.2f ms   (rank 0 cpu/wall %.2f)\n", Tm * 1e3, median(fm, reps));
        printf("  T_both         %8.2f ms   (rank 0 cpu/wall %.2f)\n", Tb * 1e3, median(fb, reps));
        printf("  overlap        %8.2f      (1 = communication fully hidden, 0 = none)\n", overlap);
        printf("  T_both, sleep  %8.2f ms   (rank 0 cpu/wall %.2f; the compute replaced by a "
               "sleep as long)\n", Ts * 1e3, median(fs, reps));
        printf("  overlap, sleep %8.2f      (what the comm thread achieves when a core is free)\n",
               overlap_idle);
        printf("  waiting 200 ms for a late peer costs rank 0 %.1f%% of a core\n", idle_cpu * 100);
        printf("ctrain_comm_overlap t_compute_ms=%.3f t_comm_ms=%.3f t_both_ms=%.3f overlap=%.3f "
               "t_both_sleep_ms=%.3f overlap_sleep=%.3f idle_wait_cpu=%.3f\n",
               Tc * 1e3, Tm * 1e3, Tb * 1e3, overlap, Ts * 1e3, overlap_idle, idle_cpu);
    }
    ct_free(a), ct_free(b), ct_free(c);
    for (int i = 0; i < nbuf; i++) ct_free(buf[i]);
    ct_comm_finalize();
    return 0;
}

/*
 * bench/p2p: point-to-point latency through ct_group_send / ct_group_recv,
 * the path pipeline activations take between stages.
 *
 *   ping-pong   rank 0 sends, rank 1 sends back, both with the blocking form
 *               (the caller waits in ct_work_wait): half the median round trip.
 *   late send   rank 1 posts its recv and waits in ct_work_wait; rank 0 sleeps
 *               `--late-ms` first (a stage still computing), then sends its
 *               CLOCK_MONOTONIC time, which rank 1 subtracts from its own when
 *               the wait returns (one machine, one clock): the one-way
 *               latency after a long wait, when the comm thread has had time
 *               to back off into long naps.
 *
 *   bench/p2p [--reps N] [--bytes B] [--late-ms MS]
 *
 * Started without mpirun it re-launches itself on 2 ranks.  The last line is
 * machine-readable: "ctrain_p2p bytes=... pingpong_us=... late_us=...".
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

static void check(ct_status s, const char *what)
{
    if (s != CT_OK) ct_comm_abort("%s failed: %s", what, ct_last_error());
}

static void sleep_for(double seconds)
{
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv)
{
    bench_relaunch_under_mpirun(argc, argv, 2);
    int reps = 2000;
    long bytes = 8;
    double late_ms = 2;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bytes") && i + 1 < argc) bytes = atol(argv[++i]);
        else if (!strcmp(argv[i], "--late-ms") && i + 1 < argc) late_ms = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: p2p [--reps N] [--bytes B] [--late-ms MS]\n");
            return 2;
        }
    }
    if (reps < 1 || reps > 100000 || bytes < 8 || bytes > (1l << 30) || late_ms < 0) {
        fprintf(stderr, "p2p: bad option value\n");
        return 2;
    }
    check(ct_comm_init(&argc, &argv), "ct_comm_init");
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    if (ct_group_size(g) < 2) ct_comm_abort("bench/p2p needs 2 ranks");
    int64_t n = bytes / 8;
    double *msg = ct_alloc_zeroed((size_t)n * sizeof(double), CT_MEM_COMM);
    double *pp = ct_alloc_zeroed((size_t)reps * sizeof(double), CT_MEM_OTHER);
    int late_reps = reps / 10 > 0 ? reps / 10 : 1;
    double *late = ct_alloc_zeroed((size_t)late_reps * sizeof(double), CT_MEM_OTHER);
    if (!msg || !pp || !late) ct_comm_abort("out of memory");
    memset(msg, 0, (size_t)n * sizeof(double));

    check(ct_group_barrier(g), "barrier");
    for (int r = -10; r < reps; r++) { /* 10 rounds of warm-up */
        double t0 = wall();
        if (rank == 0) {
            check(ct_group_send(g, msg, n, CT_I64, 1, 1, NULL), "send");
            check(ct_group_recv(g, msg, n, CT_I64, 1, 2, NULL), "recv");
        } else if (rank == 1) {
            check(ct_group_recv(g, msg, n, CT_I64, 0, 1, NULL), "recv");
            check(ct_group_send(g, msg, n, CT_I64, 0, 2, NULL), "send");
        }
        if (r >= 0) pp[r] = (wall() - t0) / 2;
    }
    for (int r = 0; r < late_reps; r++) {
        check(ct_group_barrier(g), "barrier");
        if (rank == 0) {
            sleep_for(late_ms * 1e-3);
            msg[0] = wall();
            check(ct_group_send(g, msg, n, CT_I64, 1, 3, NULL), "send");
        } else if (rank == 1) {
            ct_work *w;
            check(ct_group_recv(g, msg, n, CT_I64, 0, 3, &w), "recv");
            check(ct_work_wait(w), "recv");
            late[r] = wall() - msg[0];
            ct_work_destroy(w);
        }
    }
    int64_t lat[2] = {0, 0};
    if (rank == 1) lat[0] = (int64_t)(median(late, late_reps) * 1e9);
    if (rank == 0) lat[1] = (int64_t)(median(pp, reps) * 1e9);
    check(ct_group_allreduce(g, lat, 2, CT_I64, CT_OP_MAX, NULL), "allreduce");
    if (rank == 0) {
        printf("p2p: %d ranks, %ld bytes, %s, median of %d (late: %d, %.1f ms late)\n",
               ct_group_size(g), bytes, ct_comm_thread_level(), reps, late_reps, late_ms);
        printf("  ping-pong, one way     %8.1f us\n", lat[1] * 1e-3);
        printf("  late send, one way     %8.1f us\n", lat[0] * 1e-3);
        printf("ctrain_p2p bytes=%ld pingpong_us=%.1f late_us=%.1f\n", bytes, lat[1] * 1e-3,
               lat[0] * 1e-3);
    }
    ct_free(msg), ct_free(pp), ct_free(late);
    ct_comm_finalize();
    return 0;
}

/*
 * Multi-rank tests of the collectives against naive references computed
 * locally: every rank can generate every rank's input (a hash of rank,
 * index and seed), so each rank knows what the reduction must give.
 *
 * f32 inputs are multiples of 2^-10 below 8 in magnitude, so their sums are
 * exact in any order and results must match bit for bit.  bf16/f16 inputs
 * are representable values in [-1, 1); a sum over P ranks rounds at most P-1
 * times, so it must lie within P*u*sum|x| of the exact sum (u = 2^-8 for
 * bf16, 2^-11 for f16), and must be bitwise the same on every rank.
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <time.h>

#include "coll_ref.h"
#include "comm/internal.h" /* ct__reduce_scatter_ring_runs */


static void *fill_new(ct_dtype dt, int64_t n, int r, int seed)
{
    void *b = ct_alloc_zeroed((size_t)(n ? n : 1) * ct_dtype_size(dt), CT_MEM_COMM);
    ASSERT(b);
    for (int64_t i = 0; i < n; i++) put(b, dt, i, input(r, i, seed, dt));
    return b;
}


/* Compares buf[0..n) with the reduction of inputs (seed) over p ranks,
 * starting at element `first` of the full reduction. */
static void check_reduced_at(const void *buf, ct_dtype dt, ct_reduce_op op, int64_t n,
                             int64_t first, int p, int seed, const char *what)
{
    int64_t bad = 0, at = -1;
    double gotf = 0, wantf = 0, tolf = 0;
    for (int64_t i = 0; i < n; i++) {
        double sa, want = reference(dt, op, first + i, p, seed, &sa), got = get(buf, dt, i);
        double tol = tolerance(dt, op, p, want, sa);
        if (!(fabs(got - want) <= tol)) {
            if (!bad++) at = i, gotf = got, wantf = want, tolf = tol;
        }
    }
    if (bad)
        soft_fail("%s %s %s n=%lld: %lld elements wrong; first [%lld] = %.9g, want %.9g (tol %g)",
                  what, ct_dtype_name(dt), op_name(op), (long long)n, (long long)bad,
                  (long long)at, gotf, wantf, tolf);
}

static void check_reduced(const void *buf, ct_dtype dt, ct_reduce_op op, int64_t n, int p,
                          int seed, const char *what)
{
    check_reduced_at(buf, dt, op, n, 0, p, seed, what);
}

/* Checks that buf holds the same bytes on every rank of g. */
static void check_same_on_all(ct_group *g, const void *buf, size_t bytes, const char *what)
{
    int64_t h[2];
    h[0] = h[1] = (int64_t)(ct_hash64(buf, bytes) >> 1);
    ASSERT_OK(ct_group_allreduce(g, &h[0], 1, CT_I64, CT_OP_MIN, NULL));
    ASSERT_OK(ct_group_allreduce(g, &h[1], 1, CT_I64, CT_OP_MAX, NULL));
    if (h[0] != h[1]) soft_fail("%s: result differs across ranks", what);
}

static void allreduce_case(ct_dtype dt, ct_reduce_op op, int64_t n, int seed)
{
    ct_group *g = W();
    void *b = fill_new(dt, n, ct_group_rank(g), seed);
    ct_work *w = NULL;
    ASSERT_OK(ct_group_allreduce(g, b, n, dt, op, &w));
    ASSERT_OK(ct_work_wait(w));
    ASSERT(ct_work_test(w));
    ct_work_destroy(w);
    check_reduced(b, dt, op, n, ct_group_size(g), seed, "allreduce");
    check_same_on_all(g, b, (size_t)n * ct_dtype_size(dt), "allreduce");
    ct_free(b);
}

TEST(comm_allreduce_f32)
{
    soft_begin();
    static const int64_t sizes[] = {1, 7, 1000, 1000003};
    for (int s = 0; s < 4; s++)
        for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++)
            if (sizes[s] < 1000000 || op <= CT_OP_AVG)
                allreduce_case(CT_F32, (ct_reduce_op)op, sizes[s], 10 * s + op);
    ASSERT_NO_SOFT_FAIL();
}

TEST(comm_allreduce_bf16_f16)
{
    soft_begin();
    static const int64_t sizes[] = {1, 7, 4099, 300007};
    static const ct_dtype dts[] = {CT_BF16, CT_F16};
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < 4; s++)
            for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++)
                if (sizes[s] < 100000 || op == CT_OP_SUM)
                    allreduce_case(dts[d], (ct_reduce_op)op, sizes[s], 100 + 10 * s + op);
    ASSERT_NO_SOFT_FAIL();
}

TEST(comm_allreduce_int)
{
    soft_begin();
    static const ct_dtype dts[] = {CT_I32, CT_I64, CT_U8};
    for (int d = 0; d < 3; d++)
        for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++)
            if (op != CT_OP_AVG) allreduce_case(dts[d], (ct_reduce_op)op, 1001, 200 + op);
    ASSERT_NO_SOFT_FAIL();
}

TEST(comm_allreduce_zero_count)
{
    soft_begin();
    float x = 3;
    ASSERT_OK(ct_group_allreduce(W(), &x, 0, CT_F32, CT_OP_SUM, NULL));
    ASSERT_EQ(x, 3);
    ASSERT_OK(ct_group_allreduce(W(), NULL, 0, CT_BF16, CT_OP_SUM, NULL));
    ASSERT_NO_SOFT_FAIL();
}

TEST(comm_allreduce_tensor)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g);
    ct_tensor *t = ct_tensor_create2(3, 5, CT_MEM_GRAD);
    ASSERT(t);
    for (int i = 0; i < 15; i++) ct_f32(t)[i] = (float)(ct_group_rank(g) + i);
    ASSERT_OK(ct_group_allreduce_tensor(g, t, CT_OP_SUM, NULL));
    for (int i = 0; i < 15; i++) ASSERT_EQ(ct_f32(t)[i], p * (p - 1) / 2 + p * i);
    if (ct_group_rank(g) == p - 1) ct_tensor_fill(t, 42);
    ASSERT_OK(ct_group_broadcast_tensor(g, t, p - 1, NULL));
    for (int i = 0; i < 15; i++) ASSERT_EQ(ct_f32(t)[i], 42);
    ct_tensor_release(t);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- reduce, broadcast ------------------------------------------------- */

TEST(comm_reduce_every_root)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    static const struct { ct_dtype dt; ct_reduce_op op; int64_t n; } cases[] = {
        {CT_F32, CT_OP_SUM, 1000}, {CT_F32, CT_OP_AVG, 7}, {CT_BF16, CT_OP_AVG, 77},
        {CT_F16, CT_OP_SUM, 300}, {CT_I64, CT_OP_MAX, 5}, {CT_F32, CT_OP_SUM, 200003}};
    for (int root = 0; root < p; root++)
        for (int c = 0; c < 6; c++) {
            int seed = 300 + 10 * root + c;
            void *b = fill_new(cases[c].dt, cases[c].n, me, seed);
            ct_work *w;
            ASSERT_OK(ct_group_reduce(g, b, cases[c].n, cases[c].dt, cases[c].op, root, &w));
            ASSERT_OK(ct_work_wait(w));
            ct_work_destroy(w);
            if (me == root) {
                check_reduced(b, cases[c].dt, cases[c].op, cases[c].n, p, seed, "reduce");
            } else { /* non-roots keep their input */
                for (int64_t i = 0; i < cases[c].n; i++)
                    if (get(b, cases[c].dt, i) != input(me, i, seed, cases[c].dt)) {
                        soft_fail("reduce to %d changed rank %d's buffer at [%lld]", root, me,
                                  (long long)i);
                        break;
                    }
            }
            ct_free(b);
        }
    ASSERT_NO_SOFT_FAIL();
}

TEST(comm_broadcast_every_root_and_dtype)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    static const int64_t sizes[] = {1, 7, 100003};
    for (int root = 0; root < p; root++)
        for (int dt = 0; dt < CT_NDTYPE; dt++)
            for (int s = 0; s < 3; s++) {
                int seed = 400 + 10 * dt + s;
                void *b = fill_new((ct_dtype)dt, sizes[s], me, seed);
                ASSERT_OK(ct_group_broadcast(g, b, sizes[s], (ct_dtype)dt, root, NULL));
                void *want = fill_new((ct_dtype)dt, sizes[s], root, seed);
                if (memcmp(b, want, (size_t)sizes[s] * ct_dtype_size((ct_dtype)dt)))
                    soft_fail("broadcast %s n=%lld from %d differs", ct_dtype_name((ct_dtype)dt),
                              (long long)sizes[s], root);
                ct_free(want);
                ct_free(b);
            }
    ASSERT_NO_SOFT_FAIL();
}

/* ---- all-gather -------------------------------------------------------- */

TEST(comm_allgather)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    static const ct_dtype dts[] = {CT_F32, CT_BF16, CT_I64, CT_U8};
    static const int64_t sizes[] = {1, 7, 10001};
    for (int d = 0; d < 4; d++)
        for (int s = 0; s < 3; s++)
            for (int inplace = 0; inplace < 2; inplace++) {
                ct_dtype dt = dts[d];
                int64_t n = sizes[s];
                size_t esz = ct_dtype_size(dt);
                int seed = 500 + 10 * d + s;
                char *recv = ct_alloc_zeroed((size_t)(n * p) * esz, CT_MEM_COMM);
                void *mine = fill_new(dt, n, me, seed);
                const void *send = mine;
                if (inplace) {
                    memcpy(recv + (size_t)(me * n) * esz, mine, (size_t)n * esz);
                    send = recv + (size_t)(me * n) * esz;
                }
                ct_work *w;
                ASSERT_OK(ct_group_allgather(g, send, recv, n, dt, &w));
                ASSERT_OK(ct_work_wait(w));
                ct_work_destroy(w);
                for (int r = 0; r < p; r++) {
                    void *want = fill_new(dt, n, r, seed);
                    if (memcmp(recv + (size_t)(r * n) * esz, want, (size_t)n * esz))
                        soft_fail("allgather %s n=%lld inplace=%d: block %d differs",
                                  ct_dtype_name(dt), (long long)n, inplace, r);
                    ct_free(want);
                }
                ct_free(mine);
                ct_free(recv);
            }
    ASSERT_NO_SOFT_FAIL();
}

TEST(comm_allgatherv)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int64_t counts[8], displs[8], packed[8], end = 0, pend = 0;
    for (int r = 0; r < p; r++) {
        counts[r] = (r * 3 + 1) % 5; /* 1, 4, 2, 0: includes an empty rank at 4 */
        displs[r] = end + 2;          /* gaps of 2 that must stay untouched */
        end = displs[r] + counts[r];
        packed[r] = pend;
        pend += counts[r];
    }
    for (int mode = 0; mode < 3; mode++) { /* packed, with gaps, gaps in place */
        int gaps = mode > 0;
        int64_t total = gaps ? end : pend;
        float *recv = ct_alloc_zeroed((size_t)(total + 1) * sizeof(float), CT_MEM_COMM);
        for (int64_t i = 0; i < total; i++) recv[i] = -1000;
        float *mine = fill_new(CT_F32, counts[me], me, 600);
        const float *send = mine;
        if (mode == 2) {
            memcpy(recv + displs[me], mine, (size_t)counts[me] * sizeof(float));
            send = recv + displs[me];
        }
        ASSERT_OK(ct_group_allgatherv(g, send, counts[me], recv, counts, gaps ? displs : NULL,
                                      CT_F32, NULL));
        for (int r = 0; r < p; r++) {
            int64_t at = gaps ? displs[r] : packed[r];
            for (int64_t i = 0; i < counts[r]; i++)
                if (recv[at + i] != input(r, i, 600, CT_F32))
                    soft_fail("allgatherv mode %d: rank %d's [%lld] differs", mode, r, (long long)i);
            if (gaps && recv[at - 1] != -1000) soft_fail("allgatherv wrote into a gap");
        }
        ct_free(mine);
        ct_free(recv);
    }
    ASSERT_NO_SOFT_FAIL();
}

/* ---- reduce-scatter ---------------------------------------------------- */

TEST(comm_reduce_scatter)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    static const struct { ct_dtype dt; ct_reduce_op op; int64_t n; } cases[] = {
        {CT_F32, CT_OP_SUM, 1}, {CT_F32, CT_OP_AVG, 7}, {CT_F32, CT_OP_MAX, 1000},
        {CT_BF16, CT_OP_SUM, 777}, {CT_F16, CT_OP_AVG, 33}, {CT_I32, CT_OP_SUM, 5},
        {CT_F32, CT_OP_SUM, 250007}};
    for (int c = 0; c < 7; c++)
        for (int inplace = 0; inplace < 2; inplace++) {
            ct_dtype dt = cases[c].dt;
            int64_t n = cases[c].n;
            size_t esz = ct_dtype_size(dt);
            int seed = 700 + c;
            char *send = fill_new(dt, n * p, me, seed);
            char *recv = inplace ? send + (size_t)(me * n) * esz : ct_alloc_zeroed((size_t)n * esz, CT_MEM_COMM);
            ct_work *w;
            ASSERT_OK(ct_group_reduce_scatter(g, send, recv, n, dt, cases[c].op, &w));
            ASSERT_OK(ct_work_wait(w));
            ct_work_destroy(w);
            /* this rank's block of the full reduction */
            check_reduced_at(recv, dt, cases[c].op, n, me * n, p, seed,
                             inplace ? "reduce_scatter in place" : "reduce_scatter");
            if (!inplace) ct_free(recv);
            ct_free(send);
        }
    ASSERT_NO_SOFT_FAIL();
}

/* A large reduce-scatter in private memory costs every rank at most its two
 * ring blocks beyond its buffers: Open MPI's own (libnbc) reduced to rank 0
 * along a binomial tree, so rank 0 and the tree's inner ranks held the whole
 * input again (an FSDP unit's gradient over budget on half the ranks). */
TEST(comm_reduce_scatter_holds_two_blocks_on_every_rank)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    if (p < 2) SKIP("needs 2 or more ranks");
    const int64_t n = (int64_t)(24 << 20) / 4 / p; /* 24 MiB of f32 in all */
    size_t block = (size_t)n * sizeof(float);
    for (int inplace = 0; inplace < 2; inplace++) {
        float *send = fill_new(CT_F32, n * p, me, 31 + inplace);
        float *recv = inplace ? send + me * n : ct_alloc_zeroed(block, CT_MEM_COMM);
        memset(recv, 0, inplace ? 0 : block); /* resident before the peak is taken */
        uint64_t rings0 = atomic_load(&ct__reduce_scatter_ring_runs);
        ct_mem_reset_peak();
        ct_mem_report r0;
        ct_mem_report_get(&r0);
        ct_work *w;
        ASSERT_OK(ct_group_reduce_scatter(g, send, recv, n, CT_F32, CT_OP_SUM, &w));
        ASSERT_OK(ct_work_wait(w));
        ct_work_destroy(w);
        ct_mem_report r1;
        ct_mem_report_get(&r1);
        check_reduced_at(recv, CT_F32, CT_OP_SUM, n, me * n, p, 31 + inplace, "ring reduce_scatter");
        if (atomic_load(&ct__reduce_scatter_ring_runs) != rings0 + 1)
            soft_fail("rank %d: the reduce-scatter in private memory did not take the ring", me);
        size_t grew = r1.peak_rss > r0.rss ? r1.peak_rss - r0.rss : 0;
        size_t allowed = (p > 2 ? 2 : 1) * block + (4u << 20);
        if (r1.peak_rss && grew > allowed)
            soft_fail("rank %d of %d: RSS grew %zu bytes during a reduce-scatter of %zu-byte "
                      "blocks (allowed %zu: the ring's temporaries)", me, p, grew, block, allowed);
        if (!inplace) ct_free(recv);
        ct_free(send);
    }
    ASSERT_NO_SOFT_FAIL();
}

/* ---- many in flight, ordering, callbacks, progress -------------------- */

#define NFLIGHT 30 /* at most CB_MAX (coll_ref.h) */

TEST(comm_many_in_flight_complete_in_order)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    void *buf[NFLIGHT];
    ct_work *w[NFLIGHT];
    int64_t n[NFLIGHT];
    ct_dtype dt[NFLIGHT];
    atomic_store(&cb_next, 0);
    for (int i = 0; i < NFLIGHT; i++) {
        atomic_store(&cb_count[i], 0);
        /* big and small mixed, so later small ones finish first in MPI */
        n[i] = i % 5 == 0 ? 262147 : 1 + 37 * i;
        dt[i] = i % 3 == 2 ? CT_BF16 : CT_F32;
        buf[i] = fill_new(dt[i], n[i], me, 800 + i);
        ASSERT_OK(ct_group_allreduce(g, buf[i], n[i], dt[i], CT_OP_SUM, &w[i]));
        ASSERT_OK(ct_work_on_complete(w[i], on_done, (void *)(intptr_t)i));
    }
    for (int i = NFLIGHT - 1; i >= 0; i--) ASSERT_OK(ct_work_wait(w[i])); /* any wait order */
    for (int i = 0; i < NFLIGHT; i++) {
        ASSERT(ct_work_test(w[i]));
        ASSERT_EQ(atomic_load(&cb_count[i]), 1);
        ASSERT_EQ(cb_order[i], i);
        ct_work_destroy(w[i]);
        check_reduced(buf[i], dt[i], CT_OP_SUM, n[i], p, 800 + i, "in flight");
        ct_free(buf[i]);
    }
    ASSERT_EQ(atomic_load(&cb_next), NFLIGHT);
    ASSERT_NO_SOFT_FAIL();
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The comm thread must drive an allreduce to completion while this thread
 * computes and never calls into comm except to read the done flag. */
TEST(comm_progress_while_computing)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int64_t n = 1 << 20;
    float *b = fill_new(CT_F32, n, me, 900);
    float *a = ct_alloc_zeroed(128 * 128 * sizeof(float), CT_MEM_ACT);
    float *c = ct_alloc_zeroed(128 * 128 * sizeof(float), CT_MEM_ACT);
    ct_work *w;
    ASSERT_OK(ct_group_allreduce(g, b, n, CT_F32, CT_OP_SUM, &w));
    double t0 = now();
    int done = 0;
    while (!(done = ct_work_test(w)) && now() - t0 < 10)
        ct_sgemm(0, 0, 128, 128, 128, 1.0f, a, 128, a, 128, 0.0f, c, 128);
    ASSERT(done);
    ASSERT_OK(ct_work_wait(w));
    ct_work_destroy(w);
    check_reduced(b, CT_F32, CT_OP_SUM, n, p, 900, "progress");
    ct_free(a);
    ct_free(c);
    ct_free(b);
    ASSERT_NO_SOFT_FAIL();
}

/* With one collective running at a time per group, the rest queue behind it
 * and start in order; mixed kinds, a blocking split in the middle, and a
 * second group with its own queue must all come out right. */
TEST(comm_held_back_collectives_start_in_order)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int saved = ct_comm_get_max_running();
    ct_comm_set_max_running(1);
    enum { NA = 6, NB = 3000 };
    static float a[NA][NB], gathered[8 * 16], mine[16], scattered[16];
    ct_work *w[NA + 3];
    atomic_store(&cb_next, 0);
    for (int i = 0; i < NA; i++) {
        for (int j = 0; j < NB; j++) a[i][j] = (float)(me + i + j);
        ASSERT_OK(ct_group_allreduce(g, a[i], NB, CT_F32, i % 2 ? CT_OP_MAX : CT_OP_SUM, &w[i]));
        ASSERT_OK(ct_work_on_complete(w[i], on_done, (void *)(intptr_t)i));
    }
    ct_group *dup = NULL;
    ASSERT_OK(ct_group_split(g, 0, me, &dup)); /* blocking, queued behind the six */
    for (int j = 0; j < 16; j++) mine[j] = (float)(me * 100 + j);
    ASSERT_OK(ct_group_allgather(dup, mine, gathered, 16, CT_F32, &w[NA]));
    static float rs[8 * 16];
    for (int j = 0; j < 16 * p; j++) rs[j] = (float)j;
    ASSERT_OK(ct_group_reduce_scatter(g, rs, scattered, 16, CT_F32, CT_OP_SUM, &w[NA + 1]));
    ASSERT_OK(ct_group_barrier(dup));
    ASSERT_OK(ct_work_wait_all(w, NA + 2));
    for (int i = 0; i < NA + 2; i++) ct_work_destroy(w[i]);
    ct_group_destroy(dup);
    ct_comm_set_max_running(saved);
    for (int i = 0; i < NA; i++) {
        if (cb_order[i] != i) soft_fail("callback %d ran as number %d", cb_order[i], i);
        for (int j = 0; j < NB; j += 97) {
            float want = i % 2 ? (float)(p - 1 + i + j) : (float)(p * (i + j) + p * (p - 1) / 2);
            if (a[i][j] != want) soft_fail("allreduce %d [%d] = %g, want %g", i, j, a[i][j], want);
        }
    }
    for (int r = 0; r < p; r++)
        for (int j = 0; j < 16; j++)
            if (gathered[r * 16 + j] != (float)(r * 100 + j)) soft_fail("allgather wrong");
    for (int j = 0; j < 16; j++)
        if (scattered[j] != (float)(p * (me * 16 + j))) soft_fail("reduce_scatter wrong");
    ASSERT_NO_SOFT_FAIL();
}

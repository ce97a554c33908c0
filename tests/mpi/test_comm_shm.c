/*
 * Multi-rank tests of shared allocations and the direct shared-memory
 * allreduce (src/comm/shm.c), against references every rank computes from
 * every rank's inputs (a hash of rank, index and seed), and against the MPI
 * path on private memory.
 *
 * "Exact" f32 inputs are multiples of 2^-10 below 8 in magnitude, so sums
 * are exact in any order and results must match bit for bit.  "Random" f32
 * inputs use the whole mantissa: at 2 ranks the direct path must equal the
 * MPI path bit for bit (one addition), at more ranks lie within rounding of
 * the exact sum.  bf16/f16 sums must lie within P*u*sum|x| of the exact sum.
 *
 * Tests that expect the direct path check ct_group_is_shared first, so the
 * suite also passes (testing the MPI fallback) with CTRAIN_COMM_SHM=0.
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "coll_ref.h"



/* A float with a full mantissa, of varied sign and size. */
static float rnd(int r, int64_t i, int seed)
{
    uint64_t h = mix(((uint64_t)seed << 48) ^ ((uint64_t)r << 40) ^ (uint64_t)i ^ 0x5555);
    double u = (double)(h >> 11) / 9007199254740992.0 * 2 - 1;
    return (float)(u * (double)(1 << (h % 7)));
}



static void fill(void *buf, ct_dtype dt, int64_t n, int r, int seed)
{
    for (int64_t i = 0; i < n; i++) put(buf, dt, i, input(r, i, seed, dt));
}


static void check_reduced(const void *buf, ct_dtype dt, ct_reduce_op op, int64_t n, int p,
                          int seed, const char *what)
{
    int64_t bad = 0, at = -1;
    double gotf = 0, wantf = 0, tolf = 0;
    for (int64_t i = 0; i < n; i++) {
        double sa, want = reference(dt, op, i, p, seed, &sa), got = get(buf, dt, i);
        double tol = tolerance(dt, op, p, want, sa);
        if (!(fabs(got - want) <= tol) && !bad++) at = i, gotf = got, wantf = want, tolf = tol;
    }
    if (bad)
        soft_fail("%s %s %s n=%lld: %lld elements wrong; first [%lld] = %.9g, want %.9g (tol %g)",
                  what, ct_dtype_name(dt), op_name(op), (long long)n, (long long)bad,
                  (long long)at, gotf, wantf, tolf);
}

/* buf holds the same bytes on every rank of g. */
static void check_same_on_all(ct_group *g, const void *buf, size_t bytes, const char *what)
{
    int64_t h[2];
    h[0] = h[1] = (int64_t)(ct_hash64(buf, bytes) >> 1);
    ASSERT_OK(ct_group_allreduce(g, &h[0], 1, CT_I64, CT_OP_MIN, NULL));
    ASSERT_OK(ct_group_allreduce(g, &h[1], 1, CT_I64, CT_OP_MAX, NULL));
    if (h[0] != h[1]) soft_fail("%s: result differs across ranks", what);
}

/* Whether shared allocations of g are shared (every rank agrees): on one
 * node, a window over the group; spanning nodes (CTRAIN_FAKE_NODES), one
 * per node when some node has two of its ranks (collective over g). */
static int shm_expected(ct_group *g)
{
    const char *e = getenv("CTRAIN_COMM_SHM");
    int maxlocal = ct_group_local_size(g);
    ASSERT_OK(ct_group_allreduce(g, &maxlocal, 1, CT_I32, CT_OP_MAX, NULL));
    return ct_group_size(g) > 1 && maxlocal > 1 && !(e && !strcmp(e, "0"));
}

/* Whether allreduces on shared allocations of g take the direct path (one
 * node), whose f32 sums run in rank order. */
static int direct_expected(ct_group *g, const void *p, size_t bytes)
{
    return ct_group_is_shared(g, p, bytes) && ct_group_local_size(g) == ct_group_size(g);
}

static void *alloc_shared(ct_group *g, size_t bytes)
{
    void *p = NULL;
    ASSERT_OK(ct_group_alloc_shared(g, bytes, CT_MEM_COMM, &p));
    ASSERT(p);
    ASSERT_EQ(ct_group_is_shared(g, p, bytes), shm_expected(g));
    return p;
}

/* ---- allocation -------------------------------------------------------- */

TEST(shm_alloc_is_shared_and_accounted)
{
    ct_group *g = W();
    size_t comm0 = ct_mem_current(CT_MEM_COMM), other0 = ct_mem_current(CT_MEM_OTHER);
    size_t grad0 = ct_mem_current(CT_MEM_GRAD);
    size_t n = 1000003;
    char *x = NULL, *y = NULL, *z = NULL;
    ASSERT_OK(ct_group_alloc_shared(g, n, CT_MEM_COMM, (void **)&x));
    ASSERT_OK(ct_group_alloc_shared(g, 100, CT_MEM_GRAD, (void **)&y));
    ASSERT_OK(ct_group_alloc_shared(g, 0, CT_MEM_COMM, (void **)&z));
    ASSERT(x && y && z);
    ASSERT_EQ((uintptr_t)x % 64, 0);
    ASSERT_EQ((uintptr_t)y % 64, 0);
    for (size_t i = 0; i < n; i++) ASSERT_EQ(x[i], 0);
    ASSERT_EQ(ct_mem_current(CT_MEM_COMM) - comm0, n);
    ASSERT_EQ(ct_mem_current(CT_MEM_GRAD) - grad0, 100);
    int sh = shm_expected(g);
    ASSERT_EQ(ct_group_is_shared(g, x, n), sh);
    ASSERT_EQ(ct_group_is_shared(g, x + 1000, 5), sh);
    ASSERT_EQ(ct_group_is_shared(g, x + n - 1, 1), sh);
    ASSERT_EQ(ct_group_is_shared(g, y, 100), sh);
    ASSERT(!ct_group_is_shared(g, x, n + 1));
    ASSERT(!ct_group_is_shared(g, x + n, 1));
    ASSERT(!ct_group_is_shared(g, x - 1, 2));
    ASSERT(!ct_group_is_shared(g, y, 101));
    int local = 0;
    ASSERT(!ct_group_is_shared(g, &local, sizeof local));
    ASSERT(!ct_group_is_shared(g, NULL, 0));
    ASSERT(!ct_group_is_shared(NULL, x, 1));
    memset(x, 0x5a, n); /* this rank's memory is writable to its end */
    ct_group_free_shared(g, y);
    ASSERT_EQ(ct_group_is_shared(g, x, n), sh); /* the others stay */
    ct_group_free_shared(g, x);
    ct_group_free_shared(g, z);
    ct_group_free_shared(g, NULL);
    ASSERT(!ct_group_is_shared(g, x, 1));
    ASSERT_EQ(ct_mem_current(CT_MEM_COMM), comm0);
    ASSERT_EQ(ct_mem_current(CT_MEM_GRAD), grad0);
    ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), other0);
}

TEST(shm_alloc_bad_arguments)
{
    void *p = (void *)1;
    ASSERT_ERR(ct_group_alloc_shared(NULL, 8, CT_MEM_COMM, &p), CT_EINVAL, "group is NULL");
    ASSERT(p == NULL);
    ASSERT_ERR(ct_group_alloc_shared(W(), 8, CT_MEM_COMM, NULL), CT_EINVAL, "ptr is NULL");
    ASSERT_ERR(ct_group_alloc_shared(W(), 8, (ct_mem_cat)99, &p), CT_EINVAL, "category");
}

/* CTRAIN_COMM_SHM=0: ordinary memory, the MPI path, the same results. */
TEST(shm_disabled_by_env)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    const char *old = getenv("CTRAIN_COMM_SHM");
    char saved[16] = "";
    if (old) snprintf(saved, sizeof saved, "%s", old);
    setenv("CTRAIN_COMM_SHM", "0", 1);
    size_t comm0 = ct_mem_current(CT_MEM_COMM);
    int64_t n = 1001;
    float *x = NULL;
    ct_status s = ct_group_alloc_shared(g, (size_t)n * sizeof *x, CT_MEM_COMM, (void **)&x);
    if (old) setenv("CTRAIN_COMM_SHM", saved, 1);
    else unsetenv("CTRAIN_COMM_SHM");
    ASSERT_OK(s);
    ASSERT(!ct_group_is_shared(g, x, (size_t)n * sizeof *x));
    ASSERT_EQ(ct_mem_current(CT_MEM_COMM) - comm0, (size_t)n * sizeof *x);
    fill(x, CT_F32, n, me, 41);
    ASSERT_OK(ct_group_allreduce(g, x, n, CT_F32, CT_OP_SUM, NULL));
    check_reduced(x, CT_F32, CT_OP_SUM, n, p, 41, "allreduce, shm disabled");
    ct_group_free_shared(g, x);
    ASSERT_EQ(ct_mem_current(CT_MEM_COMM), comm0);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- results ----------------------------------------------------------- */

static void shared_case(ct_group *g, void *b, ct_dtype dt, ct_reduce_op op, int64_t n, int seed)
{
    fill(b, dt, n, ct_group_rank(g), seed);
    ct_work *w = NULL;
    ASSERT_OK(ct_group_allreduce(g, b, n, dt, op, &w));
    ASSERT_OK(ct_work_wait(w));
    ASSERT(ct_work_test(w));
    ct_work_destroy(w);
    check_reduced(b, dt, op, n, ct_group_size(g), seed, "shm allreduce");
    check_same_on_all(g, b, (size_t)n * ct_dtype_size(dt), "shm allreduce");
}

TEST(shm_allreduce_f32_every_op)
{
    soft_begin();
    ct_group *g = W();
    static const int64_t sizes[] = {1, 7, 1000, 1000003};
    float *b = alloc_shared(g, 1000003 * sizeof(float));
    for (int s = 0; s < 4; s++)
        for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++)
            shared_case(g, b, CT_F32, (ct_reduce_op)op, sizes[s], 10 * s + op);
    ct_group_free_shared(g, b);
    ASSERT_NO_SOFT_FAIL();
}

TEST(shm_allreduce_bf16_f16_every_op)
{
    soft_begin();
    ct_group *g = W();
    static const int64_t sizes[] = {1, 7, 4099, 300007};
    static const ct_dtype dts[] = {CT_BF16, CT_F16};
    void *b = alloc_shared(g, 300007 * 2);
    for (int d = 0; d < 2; d++)
        for (int s = 0; s < 4; s++)
            for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++)
                shared_case(g, b, dts[d], (ct_reduce_op)op, sizes[s], 100 + 10 * s + op);
    ct_group_free_shared(g, b);
    ASSERT_NO_SOFT_FAIL();
}

/* Integer dtypes on shared memory go through MPI, and zero counts do nothing. */
TEST(shm_allreduce_int_and_empty)
{
    soft_begin();
    ct_group *g = W();
    int32_t *b = alloc_shared(g, 1001 * sizeof(int32_t));
    for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++)
        if (op != CT_OP_AVG) shared_case(g, b, CT_I32, (ct_reduce_op)op, 1001, 150 + op);
    b[0] = 77;
    ASSERT_OK(ct_group_allreduce(g, b, 0, CT_F32, CT_OP_SUM, NULL));
    ASSERT_EQ(b[0], 77);
    ASSERT_OK(ct_group_allreduce(g, NULL, 0, CT_BF16, CT_OP_AVG, NULL));
    ct_group_free_shared(g, b);
    ASSERT_NO_SOFT_FAIL();
}

/* Full-mantissa floats: against the MPI path on private memory.  The direct
 * path adds the ranks' values in rank order, one rank per element, so at any
 * size it must also equal that float sum bit for bit (which the MPI path
 * need not: this is also how the test knows the direct path ran). */
TEST(shm_allreduce_f32_matches_mpi_path)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int64_t n = 100003;
    float *sh = alloc_shared(g, (size_t)n * sizeof(float));
    int direct = direct_expected(g, sh, (size_t)n * sizeof(float));
    float *pr = ct_alloc_zeroed((size_t)n * sizeof(float), CT_MEM_COMM);
    ASSERT(pr);
    for (int op = CT_OP_SUM; op <= CT_OP_MIN; op++) {
        for (int64_t i = 0; i < n; i++) sh[i] = pr[i] = rnd(me, i, op);
        ASSERT_OK(ct_group_allreduce(g, sh, n, CT_F32, (ct_reduce_op)op, NULL));
        ASSERT_OK(ct_group_allreduce(g, pr, n, CT_F32, (ct_reduce_op)op, NULL));
        int64_t bad = 0, at = -1;
        for (int64_t i = 0; i < n; i++) {
            double sum = 0, sumabs = 0;
            for (int r = 0; r < p; r++) sum += rnd(r, i, op), sumabs += fabs(rnd(r, i, op));
            int exact = p == 2 || op == CT_OP_MAX || op == CT_OP_MIN;
            double want = op == CT_OP_AVG ? sum / p : sum;
            double tol = exact ? 0 : (p * 0x1p-24) * sumabs * (op == CT_OP_AVG ? 2.0 / p : 1);
            int ok = exact ? !memcmp(&sh[i], &pr[i], sizeof(float))
                           : fabs((double)sh[i] - want) <= tol;
            if (direct && (op == CT_OP_SUM || op == CT_OP_AVG)) {
                float f = rnd(0, i, op);
                for (int r = 1; r < p; r++) f += rnd(r, i, op);
                if (op == CT_OP_AVG) f *= 1.0f / (float)p;
                ok = ok && !memcmp(&f, &sh[i], sizeof f);
            }
            if (!ok && !bad++) at = i;
        }
        if (bad)
            soft_fail("%s: %lld elements differ from the %s; first [%lld]: shm %.9g, mpi %.9g",
                      op_name((ct_reduce_op)op), (long long)bad,
                      p == 2 ? "MPI path" : "exact sum", (long long)at, sh[at], pr[at]);
        check_same_on_all(g, sh, (size_t)n * sizeof(float), "shm vs mpi");
    }
    ct_free(pr);
    ct_group_free_shared(g, sh);
    ASSERT_NO_SOFT_FAIL();
}

/* Ranges of one allocation at many offsets (aligned and not): the range is
 * reduced, everything around it stays as it was. */
TEST(shm_allreduce_subranges)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    size_t bytes = 3u << 20;
    char *base = alloc_shared(g, bytes);
    static const struct { size_t off; int64_t n; ct_dtype dt; ct_reduce_op op; } cases[] = {
        {0, 1, CT_F32, CT_OP_SUM},          {4, 7, CT_F32, CT_OP_SUM},
        {60, 1000, CT_F32, CT_OP_AVG},      {64, 100003, CT_F32, CT_OP_SUM},
        {4096 + 12, 65536, CT_F32, CT_OP_MAX}, {(3u << 20) - 28, 7, CT_F32, CT_OP_SUM},
        {2, 77777, CT_BF16, CT_OP_SUM},     {62, 4099, CT_F16, CT_OP_AVG},
        {1000, 250000, CT_F32, CT_OP_MIN},  {(3u << 20) - 400000, 100000, CT_F32, CT_OP_SUM}};
    for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++) {
        memset(base, 0x40 + me, bytes);
        char *b = base + cases[c].off;
        size_t len = (size_t)cases[c].n * ct_dtype_size(cases[c].dt);
        shared_case(g, b, cases[c].dt, cases[c].op, cases[c].n, 900 + c);
        for (size_t i = 0; i < bytes; i++)
            if ((i < cases[c].off || i >= cases[c].off + len) && base[i] != (char)(0x40 + me)) {
                soft_fail("case %d: byte %zu outside the range [%zu, %zu) changed", c, i,
                          cases[c].off, cases[c].off + len);
                break;
            }
    }
    (void)p;
    ct_group_free_shared(g, base);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- ordering, callbacks, in flight with other collectives -------------- */

#define NOPS 14 /* at most CB_MAX (coll_ref.h) */

TEST(shm_in_flight_mixed_with_mpi_collectives)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    enum { NSH = 6 };
    static const int64_t n_sh[NSH] = {262147, 1, 4099, 100000, 7, 65536};
    size_t total = 0, off[NSH];
    for (int i = 0; i < NSH; i++) {
        off[i] = total;
        total += ((size_t)n_sh[i] * 4 + 63) & ~(size_t)63;
    }
    char *sh = alloc_shared(g, total);
    int64_t n_pr = 30011;
    float *pr = ct_alloc_zeroed((size_t)n_pr * 4, CT_MEM_COMM);
    float *bc = ct_alloc_zeroed(1000 * 4, CT_MEM_COMM);
    float *ag_send = ct_alloc_zeroed(100 * 4, CT_MEM_COMM), *ag = ct_alloc_zeroed((size_t)p * 100 * 4, CT_MEM_COMM);
    ct_work *w[NOPS];
    atomic_store(&cb_next, 0);
    for (int i = 0; i < NOPS; i++) atomic_store(&cb_count[i], 0);
    int k = 0;
    for (int i = 0; i < NSH; i++) {
        ct_dtype dt = i == 2 ? CT_BF16 : CT_F32;
        fill(sh + off[i], dt, n_sh[i], me, 1000 + i);
        ASSERT_OK(ct_group_allreduce(g, sh + off[i], n_sh[i], dt, CT_OP_SUM, &w[k++]));
        if (i == 1) {
            fill(pr, CT_F32, n_pr, me, 1100);
            ASSERT_OK(ct_group_allreduce(g, pr, n_pr, CT_F32, CT_OP_AVG, &w[k++]));
        } else if (i == 3) {
            fill(bc, CT_F32, 1000, me, 1200);
            ASSERT_OK(ct_group_broadcast(g, bc, 1000, CT_F32, p - 1, &w[k++]));
        } else if (i == 4) {
            fill(ag_send, CT_F32, 100, me, 1300);
            ASSERT_OK(ct_group_allgather(g, ag_send, ag, 100, CT_F32, &w[k++]));
        }
    }
    int nops = k;
    for (int i = 0; i < nops; i++)
        ASSERT_OK(ct_work_on_complete(w[i], on_done, (void *)(intptr_t)i));
    for (int i = nops - 1; i >= 0; i--) ASSERT_OK(ct_work_wait(w[i])); /* any wait order */
    for (int i = 0; i < nops; i++) {
        ASSERT(ct_work_test(w[i]));
        if (atomic_load(&cb_count[i]) != 1) soft_fail("callback %d ran %d times", i, atomic_load(&cb_count[i]));
        if (cb_order[i] != i) soft_fail("callback %d ran as number %d", cb_order[i], i);
        ct_work_destroy(w[i]);
    }
    if (atomic_load(&cb_next) != nops) soft_fail("%d callbacks for %d works", atomic_load(&cb_next), nops);
    for (int i = 0; i < NSH; i++)
        check_reduced(sh + off[i], i == 2 ? CT_BF16 : CT_F32, CT_OP_SUM, n_sh[i], p, 1000 + i,
                      "in flight, shared");
    check_reduced(pr, CT_F32, CT_OP_AVG, n_pr, p, 1100, "in flight, private");
    for (int64_t i = 0; i < 1000; i++)
        if (bc[i] != (float)input(p - 1, i, 1200, CT_F32)) {
            soft_fail("in flight: broadcast [%lld] wrong", (long long)i);
            break;
        }
    for (int r = 0; r < p; r++)
        for (int64_t i = 0; i < 100; i++)
            if (ag[r * 100 + i] != (float)input(r, i, 1300, CT_F32)) {
                soft_fail("in flight: allgather block %d [%lld] wrong", r, (long long)i);
                r = p;
                break;
            }
    ct_free(pr), ct_free(bc), ct_free(ag_send), ct_free(ag);
    ct_group_free_shared(g, sh);
    ASSERT_NO_SOFT_FAIL();
}

/* Hundreds of back-to-back allreduces, two in flight, data changing every
 * iteration and ranks arriving in turn late: a barrier that lets a rank run
 * ahead shows up as a stale or mixed element. */
TEST(shm_stress_back_to_back)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    enum { N = 4099, ITERS = 300 };
    float *a = alloc_shared(g, N * sizeof(float) * 2);
    float *b = a + N + 5; /* a second range of the same allocation, unaligned */
    float priv[64];
    for (int it = 0; it < ITERS; it++) {
        for (int i = 0; i < N; i++) a[i] = (float)((me + 1) * (it % 13 + 1) + i % 17);
        for (int i = 0; i < N - 5; i++) b[i] = (float)((me + 2) * (it % 7) - i % 5);
        ct_work *wa, *wb, *wp = NULL;
        if (it % p == me) { /* this rank comes late this time */
            double t0 = ct_now();
            while (ct_now() - t0 < 50e-6) {}
        }
        ASSERT_OK(ct_group_allreduce(g, a, N, CT_F32, CT_OP_SUM, &wa));
        ASSERT_OK(ct_group_allreduce(g, b, N - 5, CT_F32, it % 2 ? CT_OP_MAX : CT_OP_SUM, &wb));
        if (it % 50 == 0) {
            for (int i = 0; i < 64; i++) priv[i] = (float)(me + i);
            ASSERT_OK(ct_group_allreduce(g, priv, 64, CT_F32, CT_OP_SUM, &wp));
        }
        ASSERT_OK(ct_work_wait(wb));
        ASSERT_OK(ct_work_wait(wa));
        if (wp) ASSERT_OK(ct_work_wait(wp));
        ct_work_destroy(wa), ct_work_destroy(wb), ct_work_destroy(wp);
        float s1 = (float)(p * (p + 1) / 2), s2 = (float)(p * (p + 3) / 2);
        for (int i = 0; i < N; i++) {
            float want = s1 * (float)(it % 13 + 1) + (float)(p * (i % 17));
            if (a[i] != want) {
                soft_fail("iteration %d: a[%d] = %g, want %g", it, i, a[i], want);
                break;
            }
        }
        for (int i = 0; i < N - 5; i++) {
            float want = it % 2 ? (float)((p + 1) * (it % 7) - i % 5)
                                : s2 * (float)(it % 7) - (float)(p * (i % 5));
            if (b[i] != want) {
                soft_fail("iteration %d: b[%d] = %g, want %g", it, i, b[i], want);
                break;
            }
        }
        if (it % 50 == 0)
            for (int i = 0; i < 64; i++)
                if (priv[i] != (float)(p * (p - 1) / 2 + p * i)) {
                    soft_fail("iteration %d: private [%d] wrong", it, i);
                    break;
                }
    }
    ct_group_free_shared(g, a);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- arguments that differ across ranks --------------------------------- */

TEST(shm_mismatch_fails_on_every_rank)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int64_t n = 4096;
    float *x = alloc_shared(g, (size_t)n * sizeof(float));
    if (!direct_expected(g, x, (size_t)n * sizeof(float))) { /* not on one node: other tests */
        ct_group_free_shared(g, x);
        return;
    }
    float *priv = ct_alloc_zeroed((size_t)n * sizeof(float), CT_MEM_COMM);
    for (int64_t i = 0; i < n; i++) x[i] = priv[i] = (float)(me * 10000 + i);
    /* offsets differ */
    ASSERT_ERR(ct_group_allreduce(g, x + 16 * me, 1000, CT_F32, CT_OP_SUM, NULL), CT_EINVAL,
               "different arguments");
    ASSERT_STR_CONTAINS(ct_last_error(), "at byte 64 of shared allocation");
    /* counts differ, with a handle and a callback */
    ct_work *w;
    atomic_store(&cb_next, 0);
    atomic_store(&cb_count[0], 0);
    ASSERT_OK(ct_group_allreduce(g, x, me ? 101 : 100, CT_F32, CT_OP_SUM, &w));
    ASSERT_OK(ct_work_on_complete(w, on_done, (void *)(intptr_t)0));
    ASSERT_ERR(ct_work_wait(w), CT_EINVAL, "rank 1 101 x F32 SUM");
    ct_work_destroy(w);
    ASSERT_EQ(atomic_load(&cb_next), 1); /* ran once, with the error */
    ASSERT_EQ(atomic_load(&cb_count[0]), 0);
    /* the last rank passes private memory, the others shared */
    ASSERT_ERR(ct_group_allreduce(g, me == p - 1 ? priv : x, n, CT_F32, CT_OP_SUM, NULL),
               CT_EINVAL, "private memory");
    /* ops differ */
    ASSERT_ERR(ct_group_allreduce(g, x, n, CT_F32, me ? CT_OP_MAX : CT_OP_SUM, NULL), CT_EINVAL,
               "different arguments");
    /* past the end: refused before anything is sent, on every rank alike */
    ASSERT_ERR(ct_group_allreduce(g, x + n - 10, 11, CT_F32, CT_OP_SUM, NULL), CT_EINVAL,
               "runs past");
    /* nothing was touched, and the group still works */
    for (int64_t i = 0; i < n; i++)
        if (x[i] != (float)(me * 10000 + i)) {
            soft_fail("a failed allreduce changed x[%lld]", (long long)i);
            break;
        }
    ASSERT_OK(ct_group_allreduce(g, x, n, CT_F32, CT_OP_SUM, NULL));
    for (int64_t i = 0; i < n; i++)
        if (x[i] != (float)(10000 * p * (p - 1) / 2 + p * i)) {
            soft_fail("allreduce after the errors: x[%lld] = %g", (long long)i, x[i]);
            break;
        }
    ASSERT_OK(ct_group_allreduce(g, priv, n, CT_F32, CT_OP_SUM, NULL));
    ct_free(priv);
    ct_group_free_shared(g, x);
    ASSERT_NO_SOFT_FAIL();
}

/* ---- sub-groups ---------------------------------------------------------- */

TEST(shm_split_subgroups)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    size_t comm0 = ct_mem_current(CT_MEM_COMM), other0 = ct_mem_current(CT_MEM_OTHER);
    /* all ranks, numbered in reverse */
    ct_group *rev = NULL;
    ASSERT_OK(ct_group_split(g, 0, -me, &rev));
    ASSERT_EQ(ct_group_rank(rev), p - 1 - me);
    int64_t n = 50001;
    float *x = alloc_shared(rev, (size_t)n * sizeof(float));
    ASSERT(!ct_group_is_shared(g, x, 4)); /* an allocation of rev, not of the world */
    fill(x, CT_F32, n, ct_group_rank(rev), 1500);
    ASSERT_OK(ct_group_allreduce(rev, x, n, CT_F32, CT_OP_AVG, NULL));
    check_reduced(x, CT_F32, CT_OP_AVG, n, p, 1500, "reversed group");
    /* the same memory through the world group: private there, MPI path */
    fill(x, CT_F32, n, me, 1501);
    ASSERT_OK(ct_group_allreduce(g, x, n, CT_F32, CT_OP_SUM, NULL));
    check_reduced(x, CT_F32, CT_OP_SUM, n, p, 1501, "world over rev's memory");
    /* even and odd ranks: groups of one get ordinary memory */
    ct_group *half = NULL;
    ASSERT_OK(ct_group_split(g, me % 2, me, &half));
    int hp = ct_group_size(half), hme = ct_group_rank(half);
    float *y = alloc_shared(half, (size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) y[i] = (float)(me * 3 + i % 11);
    ASSERT_OK(ct_group_allreduce(half, y, n, CT_F32, CT_OP_SUM, NULL));
    float members = 0;
    for (int r = me % 2; r < p; r += 2) members += (float)r;
    for (int64_t i = 0; i < n; i++)
        if (y[i] != 3 * members + (float)(hp * (i % 11))) {
            soft_fail("half group (%d of %d): y[%lld] = %g", hme, hp, (long long)i, y[i]);
            break;
        }
    ct_group_free_shared(half, y);
    ct_group_destroy(half);
    /* destroying a group frees what it still holds */
    ct_group_destroy(rev);
    ASSERT_EQ(ct_mem_current(CT_MEM_COMM), comm0);
    ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), other0);
    ASSERT_NO_SOFT_FAIL();
}

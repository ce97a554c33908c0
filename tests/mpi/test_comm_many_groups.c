/*
 * Many groups in flight: a blocking call on one group (split, shared-window
 * allocation) must not stall the shared-memory work of another group, which
 * a peer may be waiting for before it makes the same blocking call.  Every
 * rank starts each group's collectives in the same order, as required, but
 * the order across groups differs from rank to rank.
 *
 * With CTRAIN_COMM_SHM=0 (or ranks on several nodes) the same sequences run
 * on the MPI path and must give the same results.
 */
#include <stdint.h>

#include "coll_ref.h"

static float *alloc_shared(ct_group *g, int64_t n)
{
    float *p = NULL;
    ASSERT_OK(ct_group_alloc_shared(g, (size_t)n * sizeof *p, CT_MEM_COMM, (void **)&p));
    ASSERT(p);
    return p;
}

/* buf[i] = rank + i on every rank, summed: p*(p-1)/2 + p*i. */
static void fill_rank(float *buf, int64_t n, int rank)
{
    for (int64_t i = 0; i < n; i++) buf[i] = (float)(rank + i % 1000);
}

static void check_sum(const float *buf, int64_t n, int p, const char *what)
{
    for (int64_t i = 0; i < n; i++)
        if (buf[i] != (float)(p * (p - 1) / 2 + p * (i % 1000))) {
            soft_fail("%s: [%lld] = %g, want %g", what, (long long)i, buf[i],
                      (float)(p * (p - 1) / 2 + p * (i % 1000)));
            return;
        }
}

/* Rank 0 starts a shared-memory allreduce on the world, then splits another
 * group, then waits; the other ranks start the allreduce, wait for it, then
 * split.  Rank 0's split can only return once the others reach it, and they
 * reach it only once the allreduce completed, which needs rank 0's comm
 * thread to do its part while rank 0 is blocked in the split. */
TEST(comm_blocking_split_does_not_stall_shm_of_another_group)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    ct_group *other = NULL, *sub = NULL;
    ASSERT_OK(ct_group_split(g, 0, me, &other));
    enum { N = 100003 };
    float *x = alloc_shared(g, N);
    for (int round = 0; round < 3; round++) {
        fill_rank(x, N, me);
        ct_work *w = NULL;
        ASSERT_OK(ct_group_allreduce(g, x, N, CT_F32, CT_OP_SUM, &w));
        if (me == 0) {
            ASSERT_OK(ct_group_split(other, round % 2, -me, &sub));
            ASSERT_OK(ct_work_wait(w));
        } else {
            ASSERT_OK(ct_work_wait(w));
            ASSERT_OK(ct_group_split(other, round % 2, -me, &sub));
        }
        ct_work_destroy(w);
        check_sum(x, N, p, "world allreduce");
        ASSERT_EQ(ct_group_size(sub), p);
        ASSERT_EQ(ct_group_rank(sub), p - 1 - me);
        int32_t v = me;
        ASSERT_OK(ct_group_allreduce(sub, &v, 1, CT_I32, CT_OP_SUM, NULL));
        ASSERT_EQ(v, p * (p - 1) / 2);
        ct_group_destroy(sub);
    }
    ct_group_free_shared(g, x);
    ct_group_destroy(other);
    ASSERT_NO_SOFT_FAIL();
}

/* The same with a shared-window allocation as the blocking call. */
TEST(comm_blocking_alloc_does_not_stall_shm_of_another_group)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    ct_group *other = NULL;
    ASSERT_OK(ct_group_split(g, 0, me, &other));
    enum { N = 4099 };
    float *x = alloc_shared(g, N);
    float *y = NULL;
    fill_rank(x, N, me);
    ct_work *w = NULL;
    ASSERT_OK(ct_group_allreduce(g, x, N, CT_F32, CT_OP_SUM, &w));
    if (me == p - 1) {
        y = alloc_shared(other, N);
        ASSERT_OK(ct_work_wait(w));
    } else {
        ASSERT_OK(ct_work_wait(w));
        y = alloc_shared(other, N);
    }
    ct_work_destroy(w);
    check_sum(x, N, p, "world allreduce");
    fill_rank(y, N, me);
    ASSERT_OK(ct_group_allreduce(other, y, N, CT_F32, CT_OP_SUM, NULL));
    check_sum(y, N, p, "allreduce on the other group");
    ct_group_free_shared(other, y);
    ct_group_free_shared(g, x);
    ct_group_destroy(other);
    ASSERT_NO_SOFT_FAIL();
}

/* Four groups with shared allocations.  Each round every rank starts an
 * allreduce on three of them, in an order that depends on the rank, then
 * makes blocking calls on all four (the same calls in the same order on
 * every rank, as MPI requires of blocking collectives).  Half the ranks
 * first wait for two of their allreduces, which needs the other half's comm
 * threads to do their share while those are blocked in the calls. */
TEST(comm_many_groups_interleaved)
{
    soft_begin();
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    ct_group *a = NULL, *b = NULL, *c = NULL;
    ASSERT_OK(ct_group_split(g, 0, me, &a));
    ASSERT_OK(ct_group_split(g, 0, -me, &b));
    ASSERT_OK(ct_group_split(g, 0, me, &c));
    enum { N = 30011 };
    float *xw = alloc_shared(g, N), *xa = alloc_shared(a, N), *xb = alloc_shared(b, N);
    float *xc = NULL;
    ct_group *sa = NULL;
    for (int round = 0; round < 4; round++) {
        fill_rank(xw, N, me);
        fill_rank(xa, N, ct_group_rank(a));
        fill_rank(xb, N, ct_group_rank(b));
        ct_work *ww = NULL, *wa = NULL, *wb = NULL;
        if ((me + round) % 2 == 0) {
            ASSERT_OK(ct_group_allreduce(g, xw, N, CT_F32, CT_OP_SUM, &ww));
            ASSERT_OK(ct_group_allreduce(b, xb, N, CT_F32, CT_OP_SUM, &wb));
            ASSERT_OK(ct_group_allreduce(a, xa, N, CT_F32, CT_OP_SUM, &wa));
        } else {
            ASSERT_OK(ct_group_allreduce(a, xa, N, CT_F32, CT_OP_SUM, &wa));
            ASSERT_OK(ct_group_allreduce(b, xb, N, CT_F32, CT_OP_SUM, &wb));
            ASSERT_OK(ct_group_allreduce(g, xw, N, CT_F32, CT_OP_SUM, &ww));
            ASSERT_OK(ct_work_wait(wa));
            ASSERT_OK(ct_work_wait(ww));
        }
        if (round == 0) xc = alloc_shared(c, N);
        ASSERT_OK(ct_group_split(a, 1, me, &sa)); /* after a's allreduce, on every rank */
        ASSERT_OK(ct_group_barrier(c));
        ASSERT_OK(ct_group_barrier(b)); /* after b's allreduce */
        ASSERT_OK(ct_work_wait(ww));
        ASSERT_OK(ct_work_wait(wa));
        ASSERT_OK(ct_work_wait(wb));
        ct_work_destroy(ww), ct_work_destroy(wa), ct_work_destroy(wb);
        check_sum(xw, N, p, "world");
        check_sum(xa, N, p, "group a");
        check_sum(xb, N, p, "group b");
        fill_rank(xc, N, me);
        ASSERT_OK(ct_group_allreduce(c, xc, N, CT_F32, CT_OP_SUM, NULL));
        check_sum(xc, N, p, "group c");
        ASSERT_EQ(ct_group_size(sa), p);
        ct_group_destroy(sa);
    }
    ct_group_free_shared(c, xc);
    ct_group_free_shared(b, xb);
    ct_group_free_shared(a, xa);
    ct_group_free_shared(g, xw);
    ct_group_destroy(c);
    ct_group_destroy(b);
    ct_group_destroy(a);
    ASSERT_NO_SOFT_FAIL();
}

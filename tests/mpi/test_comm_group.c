/*
 * Multi-rank tests of groups, point-to-point transfers, work handles and
 * errors: world and node info, even/odd sub-groups with collectives in each,
 * a send/recv ring, barrier, agreement on a failure one rank saw, callback
 * semantics, and argument errors with their messages.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "../test.h"
#include "ctrain/comm.h"

static ct_group *W(void) { return ct_group_world(); }

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

TEST(comm_world_matches_mpirun)
{
    ct_group *g = W();
    ASSERT(g);
    const char *sz = getenv("OMPI_COMM_WORLD_SIZE"), *rk = getenv("OMPI_COMM_WORLD_RANK");
    ASSERT(sz && rk);
    ASSERT_EQ(ct_group_size(g), atoi(sz));
    ASSERT_EQ(ct_group_rank(g), atoi(rk));
    /* mpirun here starts every rank on this one machine, cut into K nodes
     * of contiguous ranks (rank r on node r*K/P) if CTRAIN_FAKE_NODES=K */
    const char *fk = getenv("CTRAIN_FAKE_NODES");
    int p = ct_group_size(g), me = ct_group_rank(g), k = fk ? atoi(fk) : 0;
    if (k <= 0) k = 1;
    if (k > p) k = p;
    ASSERT_EQ(ct_comm_get_fake_nodes(), fk ? atoi(fk) : 0);
    int lsize = 0, lrank = 0;
    for (int r = 0; r < p; r++)
        if (r * k / p == me * k / p) lsize++, lrank += r < me;
    ASSERT_EQ(ct_group_local_size(g), lsize);
    ASSERT_EQ(ct_group_local_rank(g), lrank);
    ASSERT(ct_comm_initialized());
    ASSERT_OK(ct_comm_init(NULL, NULL)); /* idempotent */
    ct_group_destroy(g);                 /* the world is not destroyed */
    ASSERT_EQ(ct_group_size(W()), atoi(sz));
}

TEST(comm_split_even_odd)
{
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    ct_group *sub = NULL;
    /* key = -rank: the sub-group numbers its ranks in reverse */
    ASSERT_OK(ct_group_split(g, me % 2, -me, &sub));
    ASSERT(sub);
    int nsame = 0, above = 0, want_sum = 0;
    for (int r = 0; r < p; r++)
        if (r % 2 == me % 2) {
            nsame++;
            above += r > me;
            want_sum += r;
        }
    ASSERT_EQ(ct_group_size(sub), nsame);
    ASSERT_EQ(ct_group_rank(sub), above);
    /* the ranks of sub on this node (one machine, or CTRAIN_FAKE_NODES=K
     * blocks of contiguous ranks) */
    int k = ct_comm_get_fake_nodes(), lsize = 0;
    if (k <= 0) k = 1;
    if (k > p) k = p;
    for (int r = me % 2; r < p; r += 2) lsize += r * k / p == me * k / p;
    ASSERT_EQ(ct_group_local_size(sub), lsize);

    /* collectives in each sub-group, in flight together with one on the world */
    int32_t s = me, world_sum = me, from_last = me * 10;
    ct_work *w[3];
    ASSERT_OK(ct_group_allreduce(sub, &s, 1, CT_I32, CT_OP_SUM, &w[0]));
    ASSERT_OK(ct_group_allreduce(g, &world_sum, 1, CT_I32, CT_OP_SUM, &w[1]));
    ASSERT_OK(ct_group_broadcast(sub, &from_last, 1, CT_I32, nsame - 1, &w[2]));
    ASSERT_OK(ct_work_wait_all(w, 3));
    for (int i = 0; i < 3; i++) ct_work_destroy(w[i]);
    ASSERT_EQ(s, want_sum);
    ASSERT_EQ(world_sum, p * (p - 1) / 2);
    /* sub-rank nsame-1 is the lowest world rank of this parity */
    ASSERT_EQ(from_last, (me % 2) * 10);

    /* a sub-group of a sub-group */
    ct_group *subsub = NULL;
    ASSERT_OK(ct_group_split(sub, 0, ct_group_rank(sub), &subsub));
    ASSERT_EQ(ct_group_size(subsub), nsame);
    ASSERT_OK(ct_group_barrier(subsub));
    ct_group_destroy(subsub);
    ct_group_destroy(sub);
}

TEST(comm_split_with_ranks_left_out)
{
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    ct_group *sub = (ct_group *)1;
    ASSERT_OK(ct_group_split(g, me == 0 ? CT_GROUP_NONE : 7, me, &sub));
    if (me == 0) {
        ASSERT(sub == NULL);
        return;
    }
    ASSERT(sub);
    ASSERT_EQ(ct_group_size(sub), p - 1);
    ASSERT_EQ(ct_group_rank(sub), me - 1);
    float x = (float)me;
    ASSERT_OK(ct_group_allreduce(sub, &x, 1, CT_F32, CT_OP_AVG, NULL));
    ASSERT_NEAR(x, p / 2.0, 1e-6);
    ct_group_destroy(sub);
}

/* Leaves a group undestroyed with an operation in flight: finalize must cope. */
TEST(comm_split_then_destroy_with_work_in_flight)
{
    ct_group *g = W();
    ct_group *sub = NULL;
    ASSERT_OK(ct_group_split(g, 0, 0, &sub));
    static float big[1 << 18];
    ct_work *w;
    ASSERT_OK(ct_group_allreduce(sub, big, 1 << 18, CT_F32, CT_OP_SUM, &w));
    ct_work_destroy(w);       /* detached: completes in the background */
    ct_group_destroy(sub); /* waits for it */
}

TEST(comm_send_recv_ring)
{
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int right = (me + 1) % p, left = (me + p - 1) % p;
    enum { N = 3, LEN = 1001 };
    /* three messages with one tag must arrive in order; a fourth with another tag */
    float out[N][LEN], in[N][LEN];
    uint16_t hout[5], hin[5];
    ct_work *w[2 * N + 2];
    for (int m = 0; m < N; m++) {
        for (int i = 0; i < LEN; i++) out[m][i] = (float)(me * 100000 + m * 1000 + i);
        ASSERT_OK(ct_group_recv(g, in[m], LEN, CT_F32, left, 5, &w[m]));
    }
    for (int i = 0; i < 5; i++) hout[i] = ct_f32_to_f16((float)(me + i) / 4);
    ASSERT_OK(ct_group_recv(g, hin, 5, CT_F16, left, 9, &w[2 * N]));
    ASSERT_OK(ct_group_send(g, hout, 5, CT_F16, right, 9, &w[2 * N + 1]));
    for (int m = 0; m < N; m++) ASSERT_OK(ct_group_send(g, out[m], LEN, CT_F32, right, 5, &w[N + m]));
    ASSERT_OK(ct_work_wait_all(w, 2 * N + 2));
    for (int i = 0; i < 2 * N + 2; i++) ct_work_destroy(w[i]);
    for (int m = 0; m < N; m++)
        for (int i = 0; i < LEN; i += 100) ASSERT_EQ(in[m][i], left * 100000 + m * 1000 + i);
    for (int i = 0; i < 5; i++) ASSERT_EQ(ct_f16_to_f32(hin[i]) * 4, left + i);
}

TEST(comm_send_to_self)
{
    ct_group *g = W();
    int me = ct_group_rank(g);
    int64_t a[4] = {1, 2, 3, (int64_t)me << 40}, b[4] = {0};
    ct_work *r, *s;
    ASSERT_OK(ct_group_recv(g, b, 4, CT_I64, me, 0, &r));
    ASSERT_OK(ct_group_send(g, a, 4, CT_I64, me, 0, &s));
    ASSERT_OK(ct_work_wait(s));
    ASSERT_OK(ct_work_wait(r));
    ct_work_destroy(r);
    ct_work_destroy(s);
    ASSERT(!memcmp(a, b, sizeof a));
}

TEST(comm_barrier_waits_for_the_last_rank)
{
    ct_group *g = W();
    int me = ct_group_rank(g);
    ASSERT_OK(ct_group_barrier(g));
    double t0 = now();
    if (me == 0) usleep(150000);
    ASSERT_OK(ct_group_barrier(g));
    if (me != 0) ASSERT(now() - t0 > 0.1);
}

TEST(comm_check_agrees_on_one_rank_failure)
{
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    ASSERT_OK(ct_group_check(g, CT_OK));
    ct_status local = CT_OK;
    if (me == p - 1) local = ct_error(CT_EINVAL, "model differs: layer 3 has 10 parameters");
    ct_status s = ct_group_check(g, local);
    ASSERT_EQ(s, CT_EINVAL);
    ASSERT_STR_CONTAINS(ct_last_error(), "model differs: layer 3 has 10 parameters");
    if (me != p - 1) {
        char want[32];
        snprintf(want, sizeof want, "rank %d failed", p - 1);
        ASSERT_STR_CONTAINS(ct_last_error(), want);
    }
    /* two ranks fail: everyone reports the lower one */
    local = me >= p - 2 ? ct_error(CT_EIO, "disk %d full", me) : CT_OK;
    ASSERT_EQ(ct_group_check(g, local), CT_EIO);
    char want[32];
    snprintf(want, sizeof want, "disk %d full", p - 2);
    ASSERT_STR_CONTAINS(ct_last_error(), want);
}

/* ---- work handles ------------------------------------------------------ */

static _Atomic int ncalls;
static pthread_t cb_thread;
static ct_status cb_status, cb_nested;
static ct_work *chained;

static void count_cb(ct_work *w, ct_status s, void *arg)
{
    (void)w;
    (void)arg;
    cb_thread = pthread_self();
    cb_status = s;
    atomic_fetch_add(&ncalls, 1);
}

static void nested_cb(ct_work *w, ct_status s, void *arg)
{
    (void)w;
    (void)s;
    /* blocking from the comm thread would deadlock: must be refused */
    float x = 1;
    cb_nested = ct_group_allreduce(ct_group_world(), &x, 1, CT_F32, CT_OP_SUM, NULL);
    /* starting new work is fine */
    ct_group_allreduce(ct_group_world(), arg, 1, CT_F32, CT_OP_SUM, &chained);
    atomic_fetch_add(&ncalls, 1);
}

TEST(comm_callbacks_run_once_on_the_comm_thread)
{
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int right = (me + 1) % p, left = (me + p - 1) % p;
    int x = me, y = -1;

    /* The recv cannot finish before every rank has set its callback (barrier). */
    atomic_store(&ncalls, 0);
    ct_work *r, *s;
    ASSERT_OK(ct_group_recv(g, &y, 1, CT_I32, left, 1, &r));
    ASSERT_OK(ct_work_on_complete(r, count_cb, NULL));
    ASSERT_ERR(ct_work_on_complete(r, count_cb, NULL), CT_ESTATE, "already has a completion callback");
    ASSERT(!ct_work_test(r));
    ASSERT_OK(ct_group_barrier(g));
    ASSERT_OK(ct_group_send(g, &x, 1, CT_I32, right, 1, &s));
    ASSERT_OK(ct_work_wait(r));
    ASSERT_EQ(atomic_load(&ncalls), 1); /* ran before wait returned */
    ASSERT(!pthread_equal(cb_thread, pthread_self()));
    ASSERT_EQ(cb_status, CT_OK);
    ASSERT_EQ(y, left);
    ASSERT_OK(ct_work_wait(r)); /* again: same answer, no second call */
    ASSERT_EQ(atomic_load(&ncalls), 1);

    /* A callback set after completion runs at once, on this thread. */
    ct_work_destroy(r);
    ASSERT_OK(ct_work_wait(s));
    ASSERT_OK(ct_work_on_complete(s, count_cb, NULL));
    ASSERT_EQ(atomic_load(&ncalls), 2);
    ASSERT(pthread_equal(cb_thread, pthread_self()));
    ct_work_destroy(s);

    /* A freed (detached) handle still completes and calls back once. */
    ASSERT_OK(ct_group_recv(g, &y, 1, CT_I32, left, 2, &r));
    ASSERT_OK(ct_work_on_complete(r, count_cb, NULL));
    ct_work_destroy(r);
    ASSERT_OK(ct_group_barrier(g));
    ASSERT_OK(ct_group_send(g, &x, 1, CT_I32, right, 2, NULL));
    double t0 = now();
    while (atomic_load(&ncalls) < 3 && now() - t0 < 5) usleep(1000);
    ASSERT_EQ(atomic_load(&ncalls), 3);

    /* Callbacks may start work but not block. */
    float a = 1, b = (float)me;
    chained = NULL;
    ASSERT_OK(ct_group_allreduce(g, &a, 1, CT_F32, CT_OP_SUM, &r));
    ASSERT_OK(ct_work_on_complete(r, nested_cb, &b));
    ASSERT_OK(ct_work_wait(r));
    ct_work_destroy(r);
    ASSERT_EQ(cb_nested, CT_ESTATE);
    ASSERT(chained);
    ASSERT_OK(ct_work_wait(chained));
    ct_work_destroy(chained);
    ASSERT_EQ(a, p);
    ASSERT_EQ(b, p * (p - 1) / 2);
}

/* ---- errors ------------------------------------------------------------ */

TEST(comm_bad_arguments_fail_with_a_message)
{
    ct_group *g = W();
    int p = ct_group_size(g);
    float buf[16] = {0};
    int32_t ib[4] = {0};
    ct_work *w = NULL;
    ASSERT_ERR(ct_group_allreduce(g, buf, -1, CT_F32, CT_OP_SUM, &w), CT_EINVAL, "count is -1");
    ASSERT(w == NULL);
    ASSERT_ERR(ct_group_allreduce(g, buf, 1ll << 31, CT_F32, CT_OP_SUM, NULL), CT_EINVAL,
               "exceeds MPI's limit");
    ASSERT_ERR(ct_group_allreduce(g, NULL, 3, CT_F32, CT_OP_SUM, NULL), CT_EINVAL, "buffer is NULL");
    ASSERT_ERR(ct_group_allreduce(NULL, buf, 3, CT_F32, CT_OP_SUM, NULL), CT_EINVAL, "group is NULL");
    ASSERT_ERR(ct_group_allreduce(g, buf, 3, (ct_dtype)42, CT_OP_SUM, NULL), CT_EINVAL,
               "unknown dtype 42");
    ASSERT_ERR(ct_group_allreduce(g, buf, 3, CT_F32, (ct_reduce_op)9, NULL), CT_EINVAL,
               "unknown reduce op 9");
    ASSERT_ERR(ct_group_allreduce(g, ib, 3, CT_I32, CT_OP_AVG, NULL), CT_EUNSUPPORTED,
               "AVG is not defined for I32");
    ASSERT_ERR(ct_group_reduce_scatter(g, ib, ib, 1, CT_U8, CT_OP_AVG, NULL), CT_EUNSUPPORTED,
               "AVG is not defined for U8");
    char want[64];
    snprintf(want, sizeof want, "root %d is out of range for a group of %d ranks", p, p);
    ASSERT_ERR(ct_group_reduce(g, buf, 3, CT_F32, CT_OP_SUM, p, NULL), CT_EINVAL, want);
    ASSERT_ERR(ct_group_broadcast(g, buf, 3, CT_F32, -1, NULL), CT_EINVAL, "root -1 is out of range");
    ASSERT_ERR(ct_group_send(g, buf, 3, CT_F32, p, 0, NULL), CT_EINVAL, "peer");
    ASSERT_ERR(ct_group_recv(g, buf, 3, CT_F32, 0, -2, NULL), CT_EINVAL, "tag -2 is out of range");
    ASSERT_ERR(ct_group_allgather(g, buf + 1, buf, 2, CT_F32, NULL), CT_EINVAL, "overlaps");
    /* overlapping by one element: never the in-place layout (offsets of rank*2) */
    ASSERT_ERR(ct_group_reduce_scatter(g, buf, buf + 1, 2, CT_F32, CT_OP_SUM, NULL), CT_EINVAL,
               "overlaps");
    int64_t counts[8] = {0};
    ASSERT_ERR(ct_group_allgatherv(g, buf, 2, buf + 4, counts, NULL, CT_F32, NULL), CT_EINVAL,
               "differs from counts");
    counts[p - 1] = -3;
    ASSERT_ERR(ct_group_allgatherv(g, buf, 0, buf + 4, counts, NULL, CT_F32, NULL), CT_EINVAL,
               "count -3");
    ASSERT_ERR(ct_group_split(g, 0, 0, NULL), CT_EINVAL, "out is NULL");
    /* nothing was sent: the group still works */
    ASSERT_OK(ct_group_barrier(g));
}

/* MPI's own errors come back as CT_ECOMM with MPI's error string. */
TEST(comm_mpi_errors_become_statuses)
{
    ct_group *g = W();
    int p = ct_group_size(g), me = ct_group_rank(g);
    int right = (me + 1) % p, left = (me + p - 1) % p;
    float out[5] = {1, 2, 3, 4, 5}, in[5];
    /* 5 sent, room for 3: MPI truncates */
    ct_work *r, *s;
    ASSERT_OK(ct_group_recv(g, in, 3, CT_F32, left, 3, &r));
    ASSERT_OK(ct_group_send(g, out, 5, CT_F32, right, 3, &s));
    ct_status rs = ct_work_wait(r);
    char msg[512];
    snprintf(msg, sizeof msg, "%s", ct_last_error());
    ASSERT_OK(ct_work_wait(s));
    ct_work_destroy(r);
    ct_work_destroy(s);
    ASSERT_EQ(rs, CT_ECOMM);
    ASSERT_STR_CONTAINS(msg, "MPI_Irecv failed on rank");
    ASSERT_STR_CONTAINS(msg, "MPI_ERR_TRUNCATE");
    /* 3 sent, 5 expected: MPI accepts, ctrain does not */
    ASSERT_OK(ct_group_recv(g, in, 5, CT_F32, left, 4, &r));
    ASSERT_OK(ct_group_send(g, out, 3, CT_F32, right, 4, NULL));
    ASSERT_ERR(ct_work_wait(r), CT_ECOMM, "sent 3 elements with tag 4 but 5 were expected");
    ct_work_destroy(r);
}

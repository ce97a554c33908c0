/*
 * The engine: one communication thread per process, its FIFO of submitted
 * works, and the work handles callers hold.
 *
 * The comm thread initialises MPI and makes every nonblocking MPI call.  It
 * takes works off the queue in submission order and starts them; then,
 * while requests are in flight, it calls MPI_Testsome, which is also what
 * drives Open MPI's progress, and naps between calls that made no progress:
 * 20 us at first, doubling while nothing moves up to 500 us.  It sleeps on
 * a condition variable when idle.  While a caller is blocked in
 * ct_work_wait (its core has nothing else to do) the thread polls without
 * napping, yielding the CPU between polls, for up to wait_spin_us (10 ms)
 * after the wait began: a message or a peer's shared-memory arrival is then
 * seen within microseconds, not after a nap that has grown to 500 us while
 * the peer computed (bench/p2p: 8 bytes sent 2 ms after the receiver began
 * to wait arrive in ~25 us instead of ~300 us).  Longer waits go back to
 * napping, so waiting for a slow peer does not cost a whole core.  A
 * caller starting to wait ends a nap at once.  Waiters sleep on another
 * condition variable.
 *
 * Many groups, no deadlock.  Some group calls can only be blocking MPI
 * calls (MPI_Comm_split, MPI_Win_allocate_shared, MPI_Win_free: MPI has no
 * nonblocking form).  Made on the comm thread, such a call would stop it
 * from driving anything else until the peers make the same call, and a
 * peer may first be waiting for this rank's share of a shared-memory
 * collective on another group, which only the comm thread does: rank 0
 * starts a shared-memory allreduce on the world and splits another group,
 * rank 1 waits for the allreduce before it splits, and both wait forever.
 * (MPI's own nonblocking collectives do progress inside a blocking call,
 * which is why the MPI path alone never hung.)  So operations marked
 * CT__OP_BLOCKING make their blocking call on a second thread, the
 * blocking-call thread, and the comm thread goes on driving every other
 * operation, shared-memory or MPI, of every group, meanwhile.  The blocking
 * operation holds its own group (later collectives of that group wait, as
 * MPI's ordering requires) and completes through the comm thread like any
 * other.  Two threads calling MPI at once needs MPI_THREAD_MULTIPLE; below
 * it blocking calls run on the comm thread and shared allocations fall back
 * to ordinary memory (shm.c), so the stall cannot arise.
 *
 * Collectives of one group run in MPI at most max_running at a time (2 by
 * default); the rest wait in the group's queue and start in order as
 * earlier ones finish.  Large collectives all in flight at once compete for
 * memory bandwidth and cache and take longer in total.  Holding back later
 * collectives of a group cannot deadlock: every rank starts a group's
 * collectives in the same order, so the one running everywhere is the same.
 *
 * Completion order: MPI may finish independent collectives in any order;
 * collectives on one group are completed (state, callback) in the order
 * they were started, so a strategy sees buckets finish in order.
 * Point-to-point works are never held back and complete as soon as MPI
 * says so.
 *
 * Operations: each is a struct of its own that starts with a ct_work and
 * comes with a vtable (internal.h).  The engine calls start, then, while
 * the operation waits on an MPI request, MPI_Testsome (and progress when
 * the request completes); while it waits on no request (shared memory: its
 * peers' atomics), progress every round, with the same naps.  The engine
 * knows nothing of what an operation does.  An operation with CT__OP_GATE
 * holds its group from its start until it clears w->gate or finishes: later
 * collectives of the group wait behind it, like those over max_running, so
 * every rank makes the group's MPI calls and barriers in the same order.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>

#include "internal.h"

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake; /* comm thread: queue not empty, or stop */
    pthread_cond_t done; /* waiters: a work completed, or start-up finished */
    pthread_t th;
    int running, stop, started;
    ct_work *qhead, *qtail;
    long pending; /* submitted works not yet completed */
    int waiters;  /* threads blocked in ct_work_wait */
    double wait_start; /* ct_now() when the latest of them started waiting */
    ct_group *groups;
    ct_status (*on_start)(void);
    void (*on_stop)(void);
    ct_status start_status;
    char start_msg[512];
} E = {.mu = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
       .done = PTHREAD_COND_INITIALIZER};

static _Atomic int poll_us = -1, poll_max_us = 500, wait_spin_us = -1;
/* Collectives of one group running in MPI at once (0: no limit). */
static _Atomic int max_running = -1;

/* The blocking-call thread: operations with CT__OP_BLOCKING run their start
 * here, so that the comm thread keeps driving everything else meanwhile.
 * Guarded by E.mu. */
static struct {
    pthread_t th;
    pthread_cond_t cv;     /* a job was queued, or stop */
    int on, stop;
    ct_work *head, *tail;  /* queued (linked by next) */
    ct_work *cur;          /* running */
    ct_work *done;         /* finished, for the comm thread to file (linked by next) */
    int busy;              /* handed over, not yet filed by the comm thread */
} R = {.cv = PTHREAD_COND_INITIALIZER};

/* Works waiting on no MPI request (progress every round), in start order;
 * touched only by the comm thread. */
static struct {
    ct_work *head, *tail;
} P;

/* In-flight requests; touched only by the comm thread. */
static struct {
    ct_work **work;
    MPI_Request *req;
    MPI_Status *st;
    int *idx;
    int n, cap;
} F;

static void lock(void) { pthread_mutex_lock(&E.mu); }
static void unlock(void) { pthread_mutex_unlock(&E.mu); }

static _Thread_local int is_comm_thread;

int ct__on_comm_thread(void) { return is_comm_thread; }

int ct__engine_concurrent(void)
{
    lock();
    int on = R.on;
    unlock();
    return on;
}

/* ---- work handles ------------------------------------------------------ */

/* The reserve: when ct_alloc cannot give an operation its bookkeeping (a
 * few hundred bytes), one of these slots does, so a rank that ran out of
 * memory still takes part in the collectives and messages that tell its
 * peers (ct_group_check, a pipeline's failure marks) instead of leaving
 * them waiting on it.  Lock-free: a bit per slot. */
#define RESERVE_SLOTS 16
#define RESERVE_BYTES 2048
static _Alignas(64) unsigned char reserve[RESERVE_SLOTS][RESERVE_BYTES];
static _Atomic uint32_t reserve_used;
static _Atomic long reserve_taken;

static void *reserve_take(size_t size)
{
    if (size > RESERVE_BYTES) return NULL;
    uint32_t used = atomic_load(&reserve_used);
    for (;;) {
        int i = 0;
        while (i < RESERVE_SLOTS && (used >> i & 1u)) i++;
        if (i == RESERVE_SLOTS) return NULL;
        if (atomic_compare_exchange_weak(&reserve_used, &used, used | 1u << i)) {
            atomic_fetch_add(&reserve_taken, 1);
            return reserve[i];
        }
    }
}

/* 1 (and the slot is free again) if w is a reserve slot. */
static int reserve_give(void *w)
{
    unsigned char *p = w;
    if (p < reserve[0] || p >= reserve[0] + sizeof reserve) return 0;
    atomic_fetch_and(&reserve_used, ~(1u << ((size_t)(p - reserve[0]) / RESERVE_BYTES)));
    return 1;
}

long ct_comm_reserve_taken(void) { return atomic_load(&reserve_taken); }

void *ct__work_new(ct_group *g, const ct__op_vt *vt, size_t size)
{
    CT_ASSERT(size >= sizeof(ct_work));
    ct_work *w = ct_alloc_zeroed(size, CT_MEM_OTHER);
    if (!w && !(w = reserve_take(size))) return NULL;
    memset(w, 0, size);
    w->vt = vt;
    w->g = g;
    w->req = MPI_REQUEST_NULL;
    w->state = CT__W_QUEUED;
    w->fp_dtype = w->fp_root = w->fp_redop = -1;
    w->fp_count = -1;
    return w;
}

void ct__work_destroy(ct_work *w)
{
    if (!w) return;
    if (w->vt->destroy) w->vt->destroy(w);
    ct_free(w->fp_all);
    if (!reserve_give(w)) ct_free(w);
}

int ct__op_fail(ct_work *w, ct_status s)
{
    w->status = s;
    snprintf(w->msg, sizeof w->msg, "%s", ct_last_error());
    return CT__DONE;
}

int ct__op_mpi(ct_work *w, int rc, const char *what)
{
    if (rc == MPI_SUCCESS) return CT__WAIT;
    w->req = MPI_REQUEST_NULL;
    return ct__op_fail(w, ct__mpi_fail(rc, what));
}

ct_status ct_work_wait(ct_work *w)
{
    CT_ASSERT(w);
    lock();
    if (w->state != CT__W_DONE && ct__on_comm_thread()) {
        unlock();
        return ct_error(CT_ESTATE, "ct_work_wait called from a completion callback, which would "
                                   "deadlock; wait from the thread that started the work");
    }
    if (w->state != CT__W_DONE) {
        E.waiters++;
        E.wait_start = ct_now();
        pthread_cond_signal(&E.wake); /* end the comm thread's nap: poll without sleeping */
        while (w->state != CT__W_DONE) pthread_cond_wait(&E.done, &E.mu);
        E.waiters--;
    }
    ct_status s = w->status;
    unlock();
    if (s != CT_OK) ct_error(s, "%s", w->msg);
    return s;
}

ct_status ct_work_wait_all(ct_work **w, int n)
{
    ct_status first = CT_OK;
    char msg[512] = "";
    for (int i = 0; i < n; i++) {
        if (!w[i]) continue;
        ct_status s = ct_work_wait(w[i]);
        if (s != CT_OK && first == CT_OK) {
            first = s;
            snprintf(msg, sizeof msg, "%s", ct_last_error());
        }
    }
    if (first != CT_OK) ct_error(first, "%s", msg);
    return first;
}

int ct_work_test(const ct_work *w)
{
    CT_ASSERT(w);
    lock();
    int done = w->state == CT__W_DONE;
    unlock();
    return done;
}

ct_status ct_work_on_complete(ct_work *w, ct_work_fn fn, void *arg)
{
    CT_ASSERT(w && fn);
    lock();
    if (w->cb) {
        unlock();
        return ct_error(CT_ESTATE, "this work already has a completion callback; chain your "
                                   "calls inside one callback");
    }
    if (w->state < CT__W_CALLING) {
        w->cb = fn;
        w->cb_arg = arg;
        unlock();
        return CT_OK;
    }
    if (w->state == CT__W_CALLING && ct__on_comm_thread()) {
        unlock();
        return ct_error(CT_ESTATE, "cannot add a callback to a work from inside its own callback");
    }
    while (w->state != CT__W_DONE) pthread_cond_wait(&E.done, &E.mu);
    w->cb = fn;
    unlock();
    fn(w, w->status, arg);
    return CT_OK;
}

void ct_work_destroy(ct_work *w)
{
    if (!w) return;
    lock();
    if (w->state != CT__W_DONE) {
        w->detached = 1; /* the engine frees it when it completes */
        unlock();
        return;
    }
    unlock();
    ct__work_destroy(w);
}

/* ---- submission -------------------------------------------------------- */

/* Hands w to the comm thread; on failure w stays the caller's. */
static ct_status enqueue(ct_work *w)
{
    lock();
    if (!E.running || E.stop) {
        unlock();
        return ct_error(CT_ESTATE, "comm is not initialised; call ct_comm_init first");
    }
    if (E.qtail) E.qtail->next = w;
    else E.qhead = w;
    E.qtail = w;
    if (w->vt->flags & CT__OP_ORDERED) w->seq = ++w->g->nseq;
    w->call = ct_comm_current_call(); /* read on the caller's thread: the name is per thread */
    w->g->pending++;
    E.pending++;
    pthread_cond_signal(&E.wake);
    unlock();
    return CT_OK;
}

ct_status ct__submit(ct_work *w, ct_work **out)
{
    if (!out) {
        ct_status s = ct__submit_wait(w);
        ct__work_destroy(w);
        return s;
    }
    ct_status s = enqueue(w);
    if (s != CT_OK) {
        ct__work_destroy(w);
        return s;
    }
    *out = w;
    return CT_OK;
}

ct_status ct__submit_wait(ct_work *w)
{
    if (ct__on_comm_thread())
        return ct_error(CT_ESTATE, "blocking comm call from a completion callback would deadlock; "
                                   "pass a ct_work ** and do not wait inside callbacks");
    CT_TRY(enqueue(w));
    return ct_work_wait(w);
}

void ct__group_quiesce(ct_group *g)
{
    lock();
    while (g->pending > 0) pthread_cond_wait(&E.done, &E.mu);
    unlock();
}

void ct__group_register(ct_group *g)
{
    lock();
    g->next_all = E.groups;
    E.groups = g;
    unlock();
}

void ct__group_unregister(ct_group *g)
{
    lock();
    for (ct_group **p = &E.groups; *p; p = &(*p)->next_all)
        if (*p == g) {
            *p = g->next_all;
            break;
        }
    unlock();
}

ct_group *ct__group_pop(void)
{
    lock();
    ct_group *g = E.groups;
    if (g) E.groups = g->next_all;
    unlock();
    return g;
}

/* ---- the comm thread --------------------------------------------------- */

/* Marks w done, runs its callback (outside the lock, so it may submit). */
static void complete(ct_work *w)
{
    lock();
    ct_work_fn cb = w->cb;
    w->state = CT__W_CALLING;
    unlock();
    if (cb) cb(w, w->status, w->cb_arg);
    lock();
    w->state = CT__W_DONE;
    w->g->pending--;
    E.pending--;
    int detached = w->detached;
    pthread_cond_broadcast(&E.done);
    unlock();
    if (detached) ct__work_destroy(w);
}

static int ordered(const ct_work *w) { return (w->vt->flags & CT__OP_ORDERED) != 0; }

/* Completes the group's collectives that are finished and have no
 * unfinished collective started before them. */
static void drain_ordered(ct_group *g)
{
    while (g->ord_head && g->ord_head->mpi_done) {
        ct_work *w = g->ord_head;
        g->ord_head = w->ord_next;
        if (!g->ord_head) g->ord_tail = NULL;
        complete(w);
    }
}

static void launch(ct_work *w);

/* Starts the group's held-back collectives while it has room and no
 * collective holds it. */
static void start_deferred(ct_group *g)
{
    int cap = ct__fp_on() ? 1 : atomic_load(&max_running);
    while (g->defer_head && !g->gate && (cap <= 0 || g->running < cap)) {
        ct_work *d = g->defer_head;
        g->defer_head = d->next;
        if (!g->defer_head) g->defer_tail = NULL;
        launch(d);
    }
}

/* w has finished (w->status says how): post-process, let the group's next
 * collective start, then complete in order. */
static void finished(ct_work *w)
{
    if (w->status == CT_OK && w->vt->finish) {
        ct_clear_error();
        ct_status s = w->vt->finish(w);
        if (s != CT_OK) ct__op_fail(w, s);
    }
    w->mpi_done = 1;
    if (!ordered(w)) {
        complete(w);
        return;
    }
    ct_group *g = w->g;
    g->running--;
    start_deferred(g);
    drain_ordered(g);
}

static int reserve_inflight(void)
{
    if (F.n < F.cap) return 0;
    int cap = F.cap ? 2 * F.cap : 64;
    ct_work **work = ct_alloc_zeroed((size_t)cap * sizeof *work, CT_MEM_OTHER);
    MPI_Request *req = ct_alloc_zeroed((size_t)cap * sizeof *req, CT_MEM_OTHER);
    MPI_Status *st = ct_alloc_zeroed((size_t)cap * sizeof *st, CT_MEM_OTHER);
    int *idx = ct_alloc_zeroed((size_t)cap * sizeof *idx, CT_MEM_OTHER);
    if (!work || !req || !st || !idx) {
        ct_free(work), ct_free(req), ct_free(st), ct_free(idx);
        return -1;
    }
    if (F.n) {
        memcpy(work, F.work, (size_t)F.n * sizeof *work);
        memcpy(req, F.req, (size_t)F.n * sizeof *req);
    }
    ct_free(F.work), ct_free(F.req), ct_free(F.st), ct_free(F.idx);
    F.work = work, F.req = req, F.st = st, F.idx = idx, F.cap = cap;
    return 0;
}

/* Files w after start or progress reported r: finished, waiting on its
 * request, or polled.  Releases the group if w let go of it. */
static void after_step(ct_work *w, int r)
{
    ct_group *g = w->g;
    int release = g->gate == w && (r == CT__DONE || !w->gate);
    if (release) {
        g->gate = NULL;
        w->gate = 0;
    }
    if (r == CT__DONE) {
        CT_ASSERT(w->req == MPI_REQUEST_NULL);
        finished(w);
        return;
    }
    if (w->req != MPI_REQUEST_NULL) {
        CT_ASSERT(F.n < F.cap); /* reserved before start / progress */
        F.work[F.n] = w;
        F.req[F.n] = w->req;
        F.n++;
    } else {
        w->poll_next = NULL;
        if (P.tail) P.tail->poll_next = w;
        else P.head = w;
        P.tail = w;
    }
    if (release) start_deferred(g);
}

/* Starts w now. */
static void launch(ct_work *w)
{
    ct_group *g = w->g;
    if (ordered(w)) {
        w->t_start = ct_now();
        g->running++;
        if (g->ord_tail) g->ord_tail->ord_next = w;
        else g->ord_head = w;
        g->ord_tail = w;
    }
    if (w->vt->flags & (CT__OP_GATE | CT__OP_BLOCKING)) {
        w->gate = 1;
        g->gate = w;
    }
    lock();
    w->state = CT__W_INFLIGHT;
    if ((w->vt->flags & CT__OP_BLOCKING) && R.on) {
        w->next = NULL;
        if (R.tail) R.tail->next = w;
        else R.head = w;
        R.tail = w;
        R.busy++;
        pthread_cond_signal(&R.cv);
        unlock();
        return;
    }
    unlock();
    ct_clear_error();
    if (reserve_inflight()) {
        after_step(w, ct__op_fail(w, ct_error(CT_ENOMEM, "out of memory for the comm thread's "
                                                         "request list")));
        return;
    }
    /* CTRAIN_DEBUG=collectives: the fingerprint first; start runs when it matches. */
    after_step(w, ordered(w) && ct__fp_on() ? ct__fp_start(w) : w->vt->start(w));
}

/* Starts w, or, if its group already has max_running collectives running
 * or is held, queues it behind them: started in order later. */
static void start_one(ct_work *w)
{
    ct_group *g = w->g;
    int cap = ct__fp_on() ? 1 : atomic_load(&max_running); /* fingerprints: one at a time (fingerprint.c) */
    if (ordered(w) && (g->gate || g->defer_head || (cap > 0 && g->running >= cap))) {
        w->next = NULL;
        if (g->defer_tail) g->defer_tail->next = w;
        else g->defer_head = w;
        g->defer_tail = w;
        return;
    }
    launch(w);
}

/* One MPI_Testsome over everything in flight; returns how many finished. */
static int poll_inflight(void)
{
    int nout = 0;
    int rc = MPI_Testsome(F.n, F.req, &nout, F.idx, F.st);
    if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
        /* The request array itself is broken: fail everything in flight. */
        ct_status s = ct__mpi_fail(rc, "MPI_Testsome");
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ct_last_error());
        int n = F.n;
        ct_work *all[n]; /* a copy: finishing may start held-back works into F */
        memcpy(all, F.work, (size_t)n * sizeof *all);
        F.n = 0;
        for (int i = 0; i < n; i++) {
            ct_error(s, "%s", msg); /* each gets the same message */
            all[i]->req = MPI_REQUEST_NULL;
            after_step(all[i], ct__op_fail(all[i], s));
        }
        return n;
    }
    if (nout == MPI_UNDEFINED || nout == 0) return 0;
    ct_work *fin[nout];
    for (int i = 0; i < nout; i++) {
        int j = F.idx[i];
        fin[i] = F.work[j];
        fin[i]->req = MPI_REQUEST_NULL;
        fin[i]->mpi_status = F.st[i];
        if (rc != MPI_ERR_IN_STATUS) fin[i]->mpi_status.MPI_ERROR = MPI_SUCCESS;
        F.work[j] = NULL;
    }
    int k = 0; /* compact, keeping start order */
    for (int j = 0; j < F.n; j++)
        if (F.work[j]) {
            F.work[k] = F.work[j];
            F.req[k] = F.req[j];
            k++;
        }
    F.n = k;
    for (int i = 0; i < nout; i++) {
        ct_work *w = fin[i];
        ct_clear_error();
        int r;
        if (w->mpi_status.MPI_ERROR != MPI_SUCCESS)
            r = ct__op_fail(w, ct__mpi_fail(w->mpi_status.MPI_ERROR, w->vt->name));
        else if (w->fp_phase) { /* the fingerprint all-gather finished */
            if (ct__fp_check(w)) continue; /* mismatched: parked until rank 0's notice ends the job */
            r = reserve_inflight() ? ct__op_fail(w, ct_error(CT_ENOMEM, "out of memory for the comm thread's "
                                                             "request list"))
                                   : w->vt->start(w);
        } else if (!w->vt->progress)
            r = CT__DONE;
        else if (reserve_inflight())
            r = ct__op_fail(w, ct_error(CT_ENOMEM, "out of memory for the comm thread's "
                                                   "request list"));
        else
            r = w->vt->progress(w);
        after_step(w, r);
    }
    return nout;
}

/* Advances every polled work once; returns how many moved. */
static int poll_polled(void)
{
    ct_work *list = P.head;
    P.head = P.tail = NULL;
    int moved = 0;
    while (list) {
        ct_work *w = list;
        list = w->poll_next;
        w->poll_next = NULL;
        int r = CT__WAIT;
        ct_clear_error();
        /* Room for the request it may hand over; without it, try next round. */
        if (reserve_inflight() == 0) r = w->vt->progress(w);
        moved += r != CT__WAIT;
        after_step(w, r);
    }
    return moved;
}

/* The blocking-call thread: runs start of each job (which may block in a
 * collective MPI call until the peers make it too), then hands the job back
 * to the comm thread. */
static void *runner_main(void *unused)
{
    (void)unused;
    ct_parallel_serial_here(); /* the compute thread's team has the cores */
    lock();
    for (;;) {
        while (!R.head && !R.stop) pthread_cond_wait(&R.cv, &E.mu);
        if (!R.head) break;
        ct_work *w = R.head;
        R.head = w->next;
        if (!R.head) R.tail = NULL;
        R.cur = w;
        unlock();
        ct_clear_error();
        int r = w->vt->start(w);
        CT_ASSERT(r == CT__DONE && "a CT__OP_BLOCKING start must finish the operation");
        lock();
        R.cur = NULL;
        w->next = R.done;
        R.done = w;
        pthread_cond_signal(&E.wake);
    }
    unlock();
    return NULL;
}

/* Files the jobs the blocking-call thread finished (list taken under E.mu). */
static int file_blocking(ct_work *done)
{
    int n = 0;
    while (done) {
        ct_work *w = done;
        done = w->next;
        n++;
        after_step(w, CT__DONE);
    }
    if (n) {
        lock();
        R.busy -= n;
        unlock();
    }
    return n;
}

/* Sleeps (E.mu held) between rounds that found nothing to do.  The first
 * naps after any progress are short (poll_us), so the rounds of a
 * collective follow each other quickly; while nothing moves (a peer is
 * still computing) the nap doubles every 8 empty rounds up to poll_max_us,
 * so waiting costs little CPU.  A new submission or a caller starting to
 * wait (ct_work_wait) ends the nap at once. */
static void nap(int idle)
{
    int us = atomic_load(&poll_us), max = atomic_load(&poll_max_us);
    for (int k = idle / 8; k > 0 && us < max; k--) us *= 2;
    if (us > max) us = max;
    if (us <= 0) {
        unlock();
        sched_yield();
        lock();
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_nsec += (long)us * 1000;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
    }
    pthread_cond_timedwait(&E.wake, &E.mu, &ts);
}

/* Ends the job if w, a collective, has run past the timeout. */
static void check_expired(const ct_work *w, double now, double timeout)
{
    if (!w || !ordered(w) || now - w->t_start <= timeout) return;
    const ct_group *g = w->g;
    char msg[1024];
    snprintf(msg, sizeof msg, "comm timeout: %s #%llu on group %s (%d ranks; this rank is %d of "
                              "it) has not completed %.0f s after it started "
                              "(CTRAIN_COMM_TIMEOUT=%g)",
             w->vt->name, (unsigned long long)w->seq, g->name, g->size, g->rank,
             now - w->t_start, timeout);
    if (w->vt->blame) w->vt->blame(w, msg, sizeof msg);
    size_t len = strlen(msg);
    if (w->call) {
        /* The user's code calls ctrain, not allgather: name the call every rank must make. */
        snprintf(msg + len, sizeof msg - len, "; this rank is in %s, a collective call: every rank of "
                                              "the group must make it, not only some (if (rank == 0) ...)", w->call);
        len = strlen(msg);
    }
    snprintf(msg + len, sizeof msg - len, "; a rank of the group never started it, or started the "
                                          "group's collectives in another order: every rank must "
                                          "start the same collectives on a group in the same "
                                          "order (if it is merely slow, raise "
                                          "CTRAIN_COMM_TIMEOUT)");
    ct__watch_expired(msg);
}

/* Every 10 ms or so: another rank's report of an expired collective ends
 * the job here too; so does one of this rank's collectives expiring. */
static void watch(void)
{
    static double last;
    double now = ct_now();
    if (now - last < 0.01) return;
    last = now;
    ct__watch_poll();
    double timeout = ct__watch_timeout();
    if (timeout <= 0) return;
    for (int i = 0; i < F.n; i++) check_expired(F.work[i], now, timeout);
    for (ct_work *w = P.head; w; w = w->poll_next) check_expired(w, now, timeout);
    lock();
    ct_work *cur = R.cur; /* completes only through this thread: stays valid */
    unlock();
    check_expired(cur, now, timeout);
}

static void comm_loop(void)
{
    int idle = 0; /* rounds in a row that made no progress */
    lock();
    for (;;) {
        while (!E.qhead && F.n == 0 && !P.head && !R.done && !E.stop) {
            /* Idle, but another rank's report or a blocking call may expire. */
            struct timespec ts;
            clock_gettime(CLOCK_MONOTONIC, &ts);
            ts.tv_nsec += 100000000L;
            if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
            if (pthread_cond_timedwait(&E.wake, &E.mu, &ts)) {
                unlock();
                watch();
                lock();
            }
        }
        if (!E.qhead && F.n == 0 && !P.head && !R.done && !R.busy && E.stop) break;
        ct_work *batch = E.qhead, *done = R.done;
        E.qhead = E.qtail = NULL;
        R.done = NULL;
        unlock();
        int progressed = batch != NULL;
        progressed += file_blocking(done);
        while (batch) {
            ct_work *next = batch->next;
            start_one(batch);
            batch = next;
        }
        if (F.n) progressed += poll_inflight();
        if (P.head) progressed += poll_polled();
        watch();
        lock();
        if (progressed || E.qhead || R.done || (F.n == 0 && !P.head)) {
            idle = 0;
            continue;
        }
        if (E.waiters && ct_now() - E.wait_start < 1e-6 * atomic_load(&wait_spin_us)) {
            /* A caller is blocked in ct_work_wait: its core is free, and
             * whatever it waits for should complete the moment MPI or a
             * peer delivers it, not a nap later. */
            idle = 0;
            unlock();
            sched_yield();
            lock();
            continue;
        }
        nap(idle++);
    }
    unlock();
}

static void *comm_main(void *unused)
{
    (void)unused;
    is_comm_thread = 1;
    ct_parallel_serial_here(); /* the compute thread's team has the cores */
    /* The default 50 us timer slack would stretch every short nap. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
    ct_clear_error();
    ct_status s = E.on_start();
    lock();
    E.start_status = s;
    snprintf(E.start_msg, sizeof E.start_msg, "%s", s ? ct_last_error() : "");
    E.started = 1;
    pthread_cond_broadcast(&E.done);
    unlock();
    if (s != CT_OK) return NULL;
    /* Blocking calls on their own thread need MPI_THREAD_MULTIPLE; below it
     * they run here, on the comm thread. */
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    if (level == MPI_THREAD_MULTIPLE) {
        lock();
        R.stop = 0;
        R.on = pthread_create(&R.th, NULL, runner_main, NULL) == 0;
        unlock();
        if (!R.on) ct_log(CT_LOG_WARN, "comm: cannot start the blocking-call thread; blocking "
                                       "group calls run on the comm thread");
    }
    comm_loop();
    if (R.on) {
        lock();
        R.stop = 1;
        pthread_cond_signal(&R.cv);
        unlock();
        pthread_join(R.th, NULL);
        R.on = 0;
    }
    E.on_stop();
    ct_free(F.work), ct_free(F.req), ct_free(F.st), ct_free(F.idx);
    memset(&F, 0, sizeof F);
    return NULL;
}

ct_status ct__engine_start(ct_status (*on_start)(void), void (*on_stop)(void))
{
    if (atomic_load(&poll_us) < 0) {
        const char *e = getenv("CTRAIN_COMM_POLL_US"), *m = getenv("CTRAIN_COMM_POLL_MAX_US");
        ct_comm_set_poll_us(e ? atoi(e) : 20);
        if (m) ct_comm_set_poll_max_us(atoi(m));
    }
    if (atomic_load(&wait_spin_us) < 0) {
        const char *e = getenv("CTRAIN_COMM_WAIT_SPIN_US");
        ct_comm_set_wait_spin_us(e ? atoi(e) : 10000);
    }
    if (atomic_load(&max_running) < 0) {
        const char *e = getenv("CTRAIN_COMM_MAX_RUNNING");
        ct_comm_set_max_running(e ? atoi(e) : 2);
    }
    /* Naps are timed waits on E.wake, measured on the monotonic clock. */
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_destroy(&E.wake);
    pthread_cond_init(&E.wake, &ca);
    pthread_condattr_destroy(&ca);
    lock();
    E.on_start = on_start;
    E.on_stop = on_stop;
    E.started = E.stop = 0;
    E.running = 1;
    unlock();
    int rc = pthread_create(&E.th, NULL, comm_main, NULL);
    if (rc) {
        E.running = 0;
        return ct_error(CT_ENOMEM, "cannot start the communication thread: %s", strerror(rc));
    }
    lock();
    while (!E.started) pthread_cond_wait(&E.done, &E.mu);
    ct_status s = E.start_status;
    unlock();
    if (s != CT_OK) {
        pthread_join(E.th, NULL);
        lock();
        E.running = 0;
        unlock();
        return ct_error(s, "%s", E.start_msg);
    }
    return CT_OK;
}

void ct__engine_stop(void)
{
    CT_ASSERT(!ct__on_comm_thread());
    lock();
    if (!E.running) {
        unlock();
        return;
    }
    while (E.pending > 0) pthread_cond_wait(&E.done, &E.mu);
    E.stop = 1;
    pthread_cond_signal(&E.wake);
    unlock();
    pthread_join(E.th, NULL);
    lock();
    E.running = 0;
    unlock();
}

void ct_comm_set_poll_us(int us) { atomic_store(&poll_us, us < 0 ? 0 : us > 100000 ? 100000 : us); }

void ct_comm_set_poll_max_us(int us)
{
    atomic_store(&poll_max_us, us < 0 ? 0 : us > 1000000 ? 1000000 : us);
}

int ct_comm_get_poll_max_us(void) { return atomic_load(&poll_max_us); }

void ct_comm_set_wait_spin_us(int us)
{
    atomic_store(&wait_spin_us, us < 0 ? 0 : us > 10000000 ? 10000000 : us);
}

int ct_comm_get_wait_spin_us(void)
{
    int us = atomic_load(&wait_spin_us);
    return us < 0 ? 10000 : us;
}

void ct_comm_set_max_running(int n) { atomic_store(&max_running, n < 0 ? 0 : n); }

int ct_comm_get_max_running(void)
{
    int n = atomic_load(&max_running);
    return n < 0 ? 2 : n;
}

double ct_comm_thread_cpu_get(void)
{
    double s = 0;
    lock(); /* the thread is joined only after E.stop is set, under this lock */
    clockid_t c;
    struct timespec ts;
    if (E.running && E.started && !E.stop && pthread_getcpuclockid(E.th, &c) == 0 && clock_gettime(c, &ts) == 0)
        s = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    unlock();
    return s;
}

int ct_comm_get_poll_us(void)
{
    int us = atomic_load(&poll_us);
    return us < 0 ? 20 : us;
}

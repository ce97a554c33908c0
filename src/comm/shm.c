/*
 * Shared allocations and the direct shared-memory allreduce.
 *
 * ct_group_alloc_shared puts each rank's buffer in one MPI-3 shared-memory
 * window (MPI_Win_allocate_shared over the group's communicator) when every
 * rank of the group is on this node, so every rank can address every rank's
 * buffer.  An allreduce over the same range of such an allocation on every
 * rank then needs no messages and no temporary copies: after a barrier, rank
 * r reduces slice r (W slices split on 64-byte lines) across the W buffers
 * and writes the result into slice r of every buffer; after a second barrier
 * every buffer holds the whole result.  Each rank reads ~N and writes ~N
 * bytes for an N-byte buffer, for any W.  The comm thread does the sums, as
 * it drives MPI.  One rank computes each element, once, so the result is the
 * same bits on every rank; with W = 2 an f32 sum is exactly a + b.
 *
 * Synchronisation is a control block, itself a small shared window that a
 * group has while it has shared allocations: per rank a slot with a count of
 * the barriers it reached and the arguments of its last two allreduces.  A
 * rank reaches barrier k by storing k in its slot (release) and has passed
 * it when every slot shows k or more (acquire): no read-modify-write, no
 * contended line.  The data follows the MPI-3 shared memory model: each
 * window is locked once (MPI_Win_lock_all) and MPI_Win_sync runs before
 * publishing an arrival and after seeing the others'.
 *
 * Agreement: every allreduce on a group with shared allocations, shared
 * buffer or not, first publishes (allocation id, offset, count, dtype, op)
 * and passes a barrier; every rank then reads the same W records and makes
 * the same choice: the direct path (same range of one allocation on every
 * rank, f32/bf16/f16), MPI (private memory on every rank, or an integer
 * dtype), or CT_EINVAL on every rank when the records differ.  So a caller
 * who passes different ranges, or private memory on one rank, gets an error
 * everywhere instead of corrupted data or a hang.  Records are kept by the
 * parity of the agreement's number: a rank overwrites one only after every
 * rank passed the next agreement, so after every rank read it.
 *
 * Waiting never blocks the comm thread: the engine polls (engine.c) with
 * its usual naps, so MPI work of other groups keeps moving.  Only after its
 * own slice does a rank spin briefly for the second barrier (its peers are
 * summing their slices at the same time), yielding after a few hundred
 * spins so that oversubscribed runs do not starve the peers they wait for.
 * A wait that lasts a minute is logged with the ranks that did not come.
 *
 * CTRAIN_COMM_SHM=0 makes ct_group_alloc_shared return ordinary memory, so
 * everything takes the MPI path.  Whether a group gets shared memory is
 * agreed by all its ranks (one MPI_Allreduce at allocation), so settings
 * that differ across ranks cannot split the group.
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if ATOMIC_LONG_LOCK_FREE != 2 && ATOMIC_LLONG_LOCK_FREE != 2
#error "the shared-memory barrier needs lock-free 64-bit atomics"
#endif

/* What a rank passed to one allreduce; alloc_id 0 means private memory. */
typedef struct {
    uint64_t alloc_id;
    uint64_t offset;
    int64_t count;
    int32_t dtype, op;
} shm_args;

/* One rank's part of the control block.  Its barrier count has a cache line
 * to itself: peers poll it while its owner writes only the records. */
typedef struct {
    _Atomic uint64_t arrived;
    char pad[64 - sizeof(uint64_t)];
    shm_args args[2]; /* by parity of the agreement number */
} shm_slot;

_Static_assert(sizeof(shm_slot) % 64 == 0, "slots keep each other 64-byte aligned");

typedef struct shm_alloc {
    struct shm_alloc *next;
    MPI_Win win;
    uint64_t id;   /* the same on every rank: allocations run in group order */
    size_t bytes;  /* asked for by this rank */
    ct_mem_cat cat;
    char **base;   /* [size]: every rank's segment, as mapped in this process */
} shm_alloc;

struct ct__shm {
    MPI_Win win;         /* the control block */
    shm_slot **slot;     /* [size] */
    uint64_t arrived;    /* barriers this rank reached (comm thread) */
    uint64_t handshakes; /* agreements started (comm thread) */
    uint64_t next_id;    /* (comm thread) */
    shm_alloc *allocs;   /* live allocations (reg_mu) */
};

/* Ordinary memory handed out by ct_group_alloc_shared, so that
 * ct_group_free_shared can tell it from windows and a group's destruction
 * frees it like the windows. */
struct ct__plain {
    struct ct__plain *next;
    void *p;
};

/* Guards every group's shm pointer and allocation lists: read on callers'
 * threads (ct_group_is_shared, allreduce set-up), changed by allocation and
 * free (windows on the comm thread, ordinary memory on the caller's). */
static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;

enum { PH_AGREE = 0, PH_DONE };

#define SPIN_SECONDS 100e-6 /* the second barrier's busy wait before handing back to the engine */
#define WARN_SECONDS 60.0   /* a wait this long is logged */
#define BLOCK 1024          /* elements per block of the general kernels: fits L1 */

static int shm_enabled(void)
{
    const char *e = getenv("CTRAIN_COMM_SHM");
    return !(e && !strcmp(e, "0"));
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* ---- windows ----------------------------------------------------------- */

/* Collective over g: a shared window with `bytes` on this rank; base[r]
 * becomes rank r's segment.  noncontig starts each rank's segment on a page
 * of its own, so no page holds two ranks' buffers. */
static ct_status win_create(ct_group *g, size_t bytes, int noncontig, MPI_Win *win, char **base)
{
    MPI_Info info = MPI_INFO_NULL;
    if (noncontig) {
        MPI_Info_create(&info);
        MPI_Info_set(info, "alloc_shared_noncontig", "true");
    }
    void *mine = NULL;
    int rc = MPI_Win_allocate_shared((MPI_Aint)bytes, 1, info, g->comm, &mine, win);
    if (info != MPI_INFO_NULL) MPI_Info_free(&info);
    if (rc != MPI_SUCCESS)
        return ct__mpi_fail(rc, "MPI_Win_allocate_shared (is /dev/shm large enough? Open MPI "
                                "backs shared windows there; or set CTRAIN_COMM_SHM=0)");
    MPI_Win_set_errhandler(*win, MPI_ERRORS_RETURN);
    /* One passive-target epoch for the window's life, as the MPI-3 shared
     * memory model asks for loads, stores and MPI_Win_sync on it. */
    if ((rc = MPI_Win_lock_all(MPI_MODE_NOCHECK, *win)) != MPI_SUCCESS) {
        MPI_Win_free(win);
        return ct__mpi_fail(rc, "MPI_Win_lock_all");
    }
    for (int r = 0; r < g->size; r++) {
        MPI_Aint size = 0;
        int unit = 0;
        void *p = NULL;
        if ((rc = MPI_Win_shared_query(*win, r, &size, &unit, &p)) != MPI_SUCCESS) {
            MPI_Win_unlock_all(*win);
            MPI_Win_free(win);
            return ct__mpi_fail(rc, "MPI_Win_shared_query");
        }
        base[r] = p;
    }
    return CT_OK;
}

/* Collective: ends the epoch and frees the window. */
static ct_status win_free(MPI_Win *win)
{
    MPI_Win_unlock_all(*win);
    int rc = MPI_Win_free(win);
    return rc == MPI_SUCCESS ? CT_OK : ct__mpi_fail(rc, "MPI_Win_free");
}

/* ---- allocation and free (comm thread) ---------------------------------- */

typedef struct {
    size_t bytes;
    ct_mem_cat cat;
    shm_alloc *out; /* NULL afterwards: use ordinary memory */
} alloc_req;

static void free_alloc_struct(shm_alloc *a)
{
    if (!a) return;
    ct_free(a->base);
    ct_free(a);
}

static void free_shm_struct(struct ct__shm *s)
{
    if (!s) return;
    ct_free(s->slot);
    ct_free(s);
}

/* Zeroes this rank's slot and waits until every rank has (a peer must not
 * read a stale count), then publishes g->shm. */
static ct_status shm_open(ct_group *g, struct ct__shm *s)
{
    char *base[g->size];
    CT_TRY(win_create(g, sizeof(shm_slot) + 64, 0, &s->win, base));
    for (int r = 0; r < g->size; r++) /* on a line of its own (see alloc_start) */
        s->slot[r] = (shm_slot *)(((uintptr_t)base[r] + 63) & ~(uintptr_t)63);
    memset(s->slot[g->rank], 0, sizeof(shm_slot));
    s->next_id = 1;
    ct__mem_account(CT_MEM_OTHER, (int64_t)sizeof(shm_slot) + 64);
    pthread_mutex_lock(&reg_mu);
    g->shm = s;
    pthread_mutex_unlock(&reg_mu);
    return CT_OK;
}

static ct_status shm_close(ct_group *g)
{
    struct ct__shm *s = g->shm;
    pthread_mutex_lock(&reg_mu);
    g->shm = NULL;
    pthread_mutex_unlock(&reg_mu);
    ct_status st = win_free(&s->win);
    ct__mem_account(CT_MEM_OTHER, -(int64_t)sizeof(shm_slot) - 64);
    free_shm_struct(s);
    return st;
}

static ct_status alloc_start(ct_work *w, MPI_Request *req)
{
    (void)req; /* collective and blocking, like MPI_Comm_split: done here */
    alloc_req *q = w->arg;
    ct_group *g = w->g;
    /* Allocate what can fail locally first, so every rank knows before the
     * window's collective call whether all can go on. */
    struct ct__shm *s = NULL;
    shm_alloc *a = ct_alloc_zeroed(sizeof *a, CT_MEM_OTHER);
    if (a) a->base = ct_alloc_zeroed((size_t)g->size * sizeof *a->base, CT_MEM_OTHER);
    if (!g->shm) {
        s = ct_alloc_zeroed(sizeof *s, CT_MEM_OTHER);
        if (s) s->slot = ct_alloc_zeroed((size_t)g->size * sizeof *s->slot, CT_MEM_OTHER);
    }
    int local[2] = {shm_enabled() && g->size > 1 && g->local_size == g->size,
                    a && a->base && (g->shm || (s && s->slot))};
    int all[2] = {0, 0};
    int rc = MPI_Allreduce(local, all, 2, MPI_INT, MPI_MIN, g->comm);
    ct_status st = CT_OK;
    if (rc != MPI_SUCCESS) {
        st = ct__mpi_fail(rc, "MPI_Allreduce (agreeing on shared memory)");
        goto out_free;
    }
    if (!all[0]) goto out_free; /* ordinary memory: not all on one node, or disabled */
    if (!all[1]) {
        st = ct_error(CT_ENOMEM, "ct_group_alloc_shared: a rank ran out of memory for the "
                                 "bookkeeping of a shared allocation");
        goto out_free;
    }
    if (s) {
        if ((st = shm_open(g, s)) != CT_OK) goto out_free;
        s = NULL; /* now g->shm */
    }
    /* Open MPI's segments start 8 bytes past a line (its window state comes
     * first): ask for a line more and start each rank's buffer on the next
     * line.  Offsets within a page are the same in every process, so every
     * rank finds the same start for every segment. */
    size_t cap = ((q->bytes + 63) & ~(size_t)63) + 64;
    if ((st = win_create(g, cap, 1, &a->win, a->base)) != CT_OK) goto out_close;
    for (int r = 0; r < g->size; r++)
        a->base[r] = (char *)(((uintptr_t)a->base[r] + 63) & ~(uintptr_t)63);
    /* Zeroed for the caller, and first touched by its owner (the page's NUMA
     * home).  Peers' pages are mapped into this process now, not in the
     * first allreduce: reading a byte per page is enough. */
    memset(a->base[g->rank], 0, q->bytes);
    for (int r = 0; r < g->size; r++) {
        MPI_Aint size = 0;
        int unit = 0;
        void *p = NULL;
        if (r == g->rank || MPI_Win_shared_query(a->win, r, &size, &unit, &p) != MPI_SUCCESS)
            continue;
        for (MPI_Aint o = 0; o < size; o += 4096) (void)*(volatile char *)((char *)p + o);
    }
    /* Every rank's barrier slot is zero before anyone uses it. */
    if ((rc = MPI_Barrier(g->comm)) != MPI_SUCCESS) {
        st = ct__mpi_fail(rc, "MPI_Barrier (after creating a shared window)");
        win_free(&a->win);
        goto out_close;
    }
    a->id = g->shm->next_id++;
    a->bytes = q->bytes;
    a->cat = q->cat;
    ct__mem_account(q->cat, (int64_t)q->bytes);
    pthread_mutex_lock(&reg_mu);
    a->next = g->shm->allocs;
    g->shm->allocs = a;
    pthread_mutex_unlock(&reg_mu);
    q->out = a;
    return CT_OK;

out_close:
    if (g->shm && !g->shm->allocs) shm_close(g);
out_free:
    free_alloc_struct(a);
    free_shm_struct(s);
    return st;
}

/* Collective: frees a and, with the group's last allocation, the control block. */
static ct_status free_one(ct_group *g, shm_alloc *a)
{
    struct ct__shm *s = g->shm;
    pthread_mutex_lock(&reg_mu);
    for (shm_alloc **p = &s->allocs; *p; p = &(*p)->next)
        if (*p == a) {
            *p = a->next;
            break;
        }
    pthread_mutex_unlock(&reg_mu);
    ct_status st = win_free(&a->win);
    ct__mem_account(a->cat, -(int64_t)a->bytes);
    free_alloc_struct(a);
    if (!s->allocs) {
        ct_status st2 = shm_close(g);
        if (st == CT_OK) st = st2;
    }
    return st;
}

static ct_status free_start(ct_work *w, MPI_Request *req)
{
    (void)req;
    return free_one(w->g, w->arg);
}

static ct_status release_start(ct_work *w, MPI_Request *req)
{
    (void)req;
    ct_status st = CT_OK;
    while (w->g->shm) {
        ct_status s = w->g->shm->allocs ? free_one(w->g, w->g->shm->allocs) : shm_close(w->g);
        if (st == CT_OK) st = s;
    }
    return st;
}

/* The allocation of g whose segment on this rank holds p, or NULL (reg_mu held). */
static shm_alloc *containing(const ct_group *g, const void *p)
{
    if (!g->shm) return NULL;
    uintptr_t x = (uintptr_t)p;
    for (shm_alloc *a = g->shm->allocs; a; a = a->next) {
        uintptr_t b = (uintptr_t)a->base[g->rank];
        if (x >= b && x - b < a->bytes) return a;
    }
    return NULL;
}

/* The allocation of g that starts at p on this rank (even of 0 bytes), else
 * the one holding p, else NULL (reg_mu held). */
static shm_alloc *allocation_at(const ct_group *g, const void *p)
{
    if (!g->shm) return NULL;
    for (shm_alloc *a = g->shm->allocs; a; a = a->next)
        if (a->base[g->rank] == p) return a;
    return containing(g, p);
}

/* ---- public API ----------------------------------------------------------- */

ct_status ct_group_alloc_shared(ct_group *g, size_t bytes, ct_mem_cat cat, void **ptr)
{
    if (!ptr) return ct_error(CT_EINVAL, "ct_group_alloc_shared: ptr is NULL");
    *ptr = NULL;
    if (!g)
        return ct_error(CT_EINVAL, "ct_group_alloc_shared: group is NULL; pass ct_group_world() "
                                   "or a group from ct_group_split");
    if ((int)cat < 0 || cat >= CT_MEM_NCAT)
        return ct_error(CT_EINVAL, "ct_group_alloc_shared: unknown memory category %d", (int)cat);
    if (bytes > (size_t)PTRDIFF_MAX / 2)
        return ct_error(CT_ENOMEM, "ct_group_alloc_shared: %zu bytes is too large", bytes);
    if (ct__on_comm_thread())
        return ct_error(CT_ESTATE, "ct_group_alloc_shared is collective and blocking; call it "
                                   "from the training thread, not from a completion callback");
    /* Nothing of g may be running while the window is made (MPI calls of
     * the group in the same order on every rank, and a stable g->shm). */
    ct__group_quiesce(g);
    alloc_req q = {bytes, cat, NULL};
    ct_work *w = ct__work_new(g, "MPI_Win_allocate_shared", alloc_start, NULL, 1);
    if (!w) return CT_ENOMEM;
    w->arg = &q;
    CT_TRY(ct__submit(w, NULL));
    if (q.out) {
        *ptr = q.out->base[g->rank];
        return CT_OK;
    }
    struct ct__plain *node = ct_alloc_zeroed(sizeof *node, CT_MEM_OTHER);
    void *p = node ? ct_alloc_zeroed(bytes, cat) : NULL;
    if (!p) {
        ct_free(node);
        return CT_ENOMEM;
    }
    node->p = p;
    pthread_mutex_lock(&reg_mu);
    node->next = g->plain;
    g->plain = node;
    pthread_mutex_unlock(&reg_mu);
    *ptr = p;
    return CT_OK;
}

/* Unlinks and returns g's ordinary allocation p (any if p is NULL), or NULL. */
static struct ct__plain *take_plain(ct_group *g, const void *p)
{
    pthread_mutex_lock(&reg_mu);
    struct ct__plain *n = NULL;
    for (struct ct__plain **q = &g->plain; *q; q = &(*q)->next)
        if (!p || (*q)->p == p) {
            n = *q;
            *q = n->next;
            break;
        }
    pthread_mutex_unlock(&reg_mu);
    return n;
}

void ct_group_free_shared(ct_group *g, void *ptr)
{
    if (!ptr) return;
    CT_ASSERT(g);
    pthread_mutex_lock(&reg_mu);
    shm_alloc *a = allocation_at(g, ptr);
    pthread_mutex_unlock(&reg_mu);
    if (!a) {
        struct ct__plain *n = take_plain(g, ptr);
        CT_ASSERT(n && "ct_group_free_shared: not from ct_group_alloc_shared on this group");
        ct_free(n->p);
        ct_free(n);
        return;
    }
    CT_ASSERT(ptr == a->base[g->rank] && "ct_group_free_shared: not the start of an allocation");
    CT_ASSERT(!ct__on_comm_thread()); /* would wait on itself */
    ct__group_quiesce(g); /* its works may still use the memory */
    ct_work *w = ct__work_new(g, "MPI_Win_free", free_start, NULL, 1);
    if (!w) {
        ct_log(CT_LOG_WARN, "ct_group_free_shared: out of memory; the window stays allocated");
        return;
    }
    w->arg = a;
    if (ct__submit(w, NULL) != CT_OK)
        ct_log(CT_LOG_WARN, "ct_group_free_shared: %s", ct_last_error());
}

int ct_group_is_shared(const ct_group *g, const void *ptr, size_t bytes)
{
    if (!g || !ptr) return 0;
    pthread_mutex_lock(&reg_mu);
    shm_alloc *a = containing(g, ptr);
    int ok = a && bytes <= a->bytes - (size_t)((uintptr_t)ptr - (uintptr_t)a->base[g->rank]);
    pthread_mutex_unlock(&reg_mu);
    return ok;
}

void ct__shm_release(ct_group *g)
{
    for (struct ct__plain *n; (n = take_plain(g, NULL));) {
        ct_free(n->p);
        ct_free(n);
    }
    pthread_mutex_lock(&reg_mu);
    int has = g->shm != NULL;
    pthread_mutex_unlock(&reg_mu);
    if (!has) return;
    ct_log(CT_LOG_DEBUG, "comm: freeing shared allocations still live on a group");
    ct_work *w = ct__work_new(g, "MPI_Win_free", release_start, NULL, 1);
    if (!w || ct__submit(w, NULL) != CT_OK)
        ct_log(CT_LOG_WARN, "freeing a group's shared allocations: %s", ct_last_error());
}

/* ---- barrier -------------------------------------------------------------- */

/* Reaches the next barrier (after making this rank's stores visible). */
static uint64_t arrive(ct_group *g, shm_alloc *a)
{
    struct ct__shm *s = g->shm;
    if (a) MPI_Win_sync(a->win);
    MPI_Win_sync(s->win);
    atomic_store_explicit(&s->slot[g->rank]->arrived, ++s->arrived, memory_order_release);
    return s->arrived;
}

static int all_reached(const ct_group *g, uint64_t target)
{
    for (int r = 0; r < g->size; r++)
        if (atomic_load_explicit(&g->shm->slot[r]->arrived, memory_order_acquire) < target)
            return 0;
    return 1;
}

/* 1 when every rank reached barrier target (then their stores are visible). */
static int passed(ct_group *g, uint64_t target, shm_alloc *a)
{
    if (!all_reached(g, target)) return 0;
    MPI_Win_sync(g->shm->win);
    if (a) MPI_Win_sync(a->win);
    return 1;
}

/* Busy-waits up to `budget` seconds for barrier target: pauses first, then
 * sched_yield so a peer sharing this core can run. */
static int spin_until(const ct_group *g, uint64_t target, double budget)
{
    double t0 = 0;
    for (int k = 0;; k++) {
        if (all_reached(g, target)) return 1;
        if (k < 256) {
            cpu_relax();
            continue;
        }
        if (k == 256) t0 = ct_now();
        else if (ct_now() - t0 > budget) return 0;
        sched_yield();
    }
}

/* Still waiting; logs once, naming the absent ranks, if it has been long. */
static int waiting(ct_work *w)
{
    if (w->warned || ct_now() - w->t_wait < WARN_SECONDS) return CT__POLL_WAIT;
    w->warned = 1;
    char who[256] = "";
    size_t len = 0;
    for (int r = 0; r < w->g->size && len < sizeof who - 16; r++)
        if (atomic_load_explicit(&w->g->shm->slot[r]->arrived, memory_order_acquire) < w->target)
            len += (size_t)snprintf(who + len, sizeof who - len, "%s%d", len ? ", " : "", r);
    ct_log(CT_LOG_WARN, "allreduce on a group of %d has waited %.0f s in shared memory for "
                        "rank(s) %s of the group; every rank must start the same collectives on "
                        "the group in the same order", w->g->size, ct_now() - w->t_wait, who);
    return CT__POLL_WAIT;
}

/* ---- the reduction -------------------------------------------------------- */

static void sum2_f32(float *restrict x, float *restrict y, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] + y[i];
        x[i] = v;
        y[i] = v;
    }
}

static void avg2_f32(float *restrict x, float *restrict y, int64_t n, float inv)
{
    for (int64_t i = 0; i < n; i++) {
        float v = (x[i] + y[i]) * inv;
        x[i] = v;
        y[i] = v;
    }
}

/* acc[i] = combine(acc[i], x[i]); MAX/MIN on f32 as MPI_MAX/MPI_MIN do it. */
static void add_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] += x[i];
}
static void max_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] = acc[i] > x[i] ? acc[i] : x[i];
}
static void min_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] = acc[i] < x[i] ? acc[i] : x[i];
}
/* 16-bit MAX/MIN as dtype.c's MPI ops: a nan loses to a number. */
static void fmax_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] = fmaxf(acc[i], x[i]);
}
static void fmin_f32(float *restrict acc, const float *restrict x, int n)
{
    for (int i = 0; i < n; i++) acc[i] = fminf(acc[i], x[i]);
}
static void scale_f32(float *restrict acc, int n, float inv)
{
    for (int i = 0; i < n; i++) acc[i] *= inv;
}

/* Each src[r] (n f32) becomes the reduction over r, summed in rank order. */
static void reduce_f32(float **src, int W, int64_t n, ct_reduce_op op, float inv)
{
    if (W == 2 && (op == CT_OP_SUM || op == CT_OP_AVG)) {
        if (op == CT_OP_SUM) sum2_f32(src[0], src[1], n);
        else avg2_f32(src[0], src[1], n, inv);
        return;
    }
    void (*combine)(float *restrict, const float *restrict, int) =
        op == CT_OP_MAX ? max_f32 : op == CT_OP_MIN ? min_f32 : add_f32;
    float acc[BLOCK];
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
        int m = (int)(n - i0 < BLOCK ? n - i0 : BLOCK);
        memcpy(acc, src[0] + i0, (size_t)m * sizeof *acc);
        for (int r = 1; r < W; r++) combine(acc, src[r] + i0, m);
        if (op == CT_OP_AVG) scale_f32(acc, m, inv);
        for (int r = 0; r < W; r++) memcpy(src[r] + i0, acc, (size_t)m * sizeof *acc);
    }
}

/* The same for bf16/f16: widened to f32, combined over all ranks, rounded once. */
static void reduce_16(uint16_t **src, int W, int64_t n, ct_dtype dt, ct_reduce_op op, float inv)
{
    void (*to32)(const uint16_t *, float *, size_t) =
        dt == CT_BF16 ? ct_bf16_to_f32_n : ct_f16_to_f32_n;
    void (*from32)(const float *, uint16_t *, size_t) =
        dt == CT_BF16 ? ct_f32_to_bf16_n : ct_f32_to_f16_n;
    void (*combine)(float *restrict, const float *restrict, int) =
        op == CT_OP_MAX ? fmax_f32 : op == CT_OP_MIN ? fmin_f32 : add_f32;
    float acc[BLOCK], x[BLOCK];
    uint16_t out[BLOCK];
    for (int64_t i0 = 0; i0 < n; i0 += BLOCK) {
        int m = (int)(n - i0 < BLOCK ? n - i0 : BLOCK);
        to32(src[0] + i0, acc, (size_t)m);
        for (int r = 1; r < W; r++) {
            to32(src[r] + i0, x, (size_t)m);
            combine(acc, x, m);
        }
        if (op == CT_OP_AVG) scale_f32(acc, m, inv);
        from32(acc, out, (size_t)m);
        for (int r = 0; r < W; r++) memcpy(src[r] + i0, out, (size_t)m * sizeof *out);
    }
}

/* Reduces this rank's slice of w's range across all ranks' buffers.  Slice
 * bounds fall on 64-byte lines (found from the offset, the same on every
 * rank: buffers start on a line), so no two ranks write one cache line. */
static void reduce_slice(ct_work *w, shm_alloc *a)
{
    int W = w->g->size, me = w->g->rank;
    int64_t n = w->count, esz = (int64_t)ct_dtype_size(w->dt), line = 64 / esz;
    int64_t head = (int64_t)((64 - w->shm_off % 64) % 64) / esz;
    if (head > n) head = n;
    int64_t lo = me == 0 ? 0 : head + (n - head) * me / W / line * line;
    int64_t hi = me == W - 1 ? n : head + (n - head) * (me + 1) / W / line * line;
    if (hi <= lo) return;
    void *src[W];
    for (int r = 0; r < W; r++) src[r] = a->base[r] + w->shm_off + (size_t)(lo * esz);
    float inv = w->op == CT_OP_AVG ? 1.0f / (float)W : 1.0f;
    if (w->dt == CT_F32) reduce_f32((float **)src, W, hi - lo, w->op, inv);
    else reduce_16((uint16_t **)src, W, hi - lo, w->dt, w->op, inv);
}

/* ---- the allreduce ------------------------------------------------------- */

static void describe(const shm_args *m, char *out, size_t n)
{
    int len = snprintf(out, n, "%lld x %s %s ", (long long)m->count,
                       ct_dtype_name((ct_dtype)m->dtype), ct__op_name((ct_reduce_op)m->op));
    if (len < 0 || (size_t)len >= n) return;
    if (m->alloc_id)
        snprintf(out + len, n - (size_t)len, "at byte %llu of shared allocation #%llu",
                 (unsigned long long)m->offset, (unsigned long long)m->alloc_id);
    else
        snprintf(out + len, n - (size_t)len, "in private memory");
}

static int same_args(const shm_args *x, const shm_args *y)
{
    if (x->count != y->count || x->dtype != y->dtype || x->op != y->op) return 0;
    return x->count == 0 || (x->alloc_id == y->alloc_id && x->offset == y->offset);
}

static int poll_allreduce(ct_work *w, MPI_Request *req, ct_status *st);

static ct_status start_allreduce(ct_work *w, MPI_Request *req)
{
    (void)req;
    ct_group *g = w->g;
    struct ct__shm *s = g->shm;
    CT_ASSERT(s); /* alloc and free quiesce the group, so it cannot change under a work */
    shm_alloc *a = w->shm_alloc;
    w->handshake = s->handshakes++;
    shm_args *m = &s->slot[g->rank]->args[w->handshake & 1];
    m->alloc_id = a ? a->id : 0;
    m->offset = a ? w->shm_off : 0;
    m->count = w->count;
    m->dtype = (int32_t)w->dt;
    m->op = (int32_t)w->op;
    w->target = arrive(g, a);
    w->phase = PH_AGREE;
    w->poll = poll_allreduce;
    w->t_wait = ct_now();
    w->warned = 0;
    return CT_OK;
}

static int poll_allreduce(ct_work *w, MPI_Request *req, ct_status *st)
{
    ct_group *g = w->g;
    shm_alloc *a = w->shm_alloc;
    if (w->phase == PH_DONE) {
        if (!passed(g, w->target, a)) return waiting(w);
        *st = CT_OK;
        return CT__POLL_DONE;
    }
    if (!passed(g, w->target, a)) return waiting(w);
    /* Every rank reads the same records and so decides the same. */
    int par = (int)(w->handshake & 1);
    const shm_args *first = &g->shm->slot[0]->args[par];
    for (int r = 1; r < g->size; r++) {
        const shm_args *m = &g->shm->slot[r]->args[par];
        if (!same_args(first, m)) {
            char d0[160], dr[160];
            describe(first, d0, sizeof d0);
            describe(m, dr, sizeof dr);
            *st = ct_error(CT_EINVAL, "allreduce: the ranks passed different arguments: rank 0 "
                                      "%s, rank %d %s; pass the same count, dtype and op on "
                                      "every rank, and the same range of one "
                                      "ct_group_alloc_shared allocation on every rank (or "
                                      "private memory on every rank)", d0, r, dr);
            return CT__POLL_DONE;
        }
    }
    if (w->count == 0) {
        *st = CT_OK;
        return CT__POLL_DONE;
    }
    if (!a || (w->dt != CT_F32 && w->dt != CT_BF16 && w->dt != CT_F16)) {
        int rc = MPI_Iallreduce(MPI_IN_PLACE, w->buf, w->count, ct__mpi_dtype(w->dt),
                                ct__mpi_op(w->dt, w->op), g->comm, req);
        *st = rc == MPI_SUCCESS ? CT_OK : ct__mpi_fail(rc, "MPI_Iallreduce");
        return CT__POLL_DONE;
    }
    double t0 = ct_now();
    reduce_slice(w, a);
    w->finish = NULL; /* AVG was applied with the sum */
    double t1 = ct_now();
    ct_trace_event("shm allreduce", "comm", t0, t1, 1);
    w->target = arrive(g, a);
    w->phase = PH_DONE;
    w->t_wait = t1;
    /* The peers are most likely summing their slices right now. */
    if (!spin_until(g, w->target, SPIN_SECONDS)) return CT__POLL_MOVED;
    passed(g, w->target, a);
    *st = CT_OK;
    return CT__POLL_DONE;
}

ct_status ct__shm_allreduce_setup(ct_work *w, const void *buf, size_t bytes)
{
    ct_group *g = w->g;
    pthread_mutex_lock(&reg_mu);
    int has = g->shm != NULL;
    shm_alloc *a = has ? containing(g, buf) : NULL;
    size_t off = a ? (size_t)((uintptr_t)buf - (uintptr_t)a->base[g->rank]) : 0;
    size_t size = a ? a->bytes : 0;
    pthread_mutex_unlock(&reg_mu);
    if (!has) return CT_OK;
    if (a && bytes > size - off)
        return ct_error(CT_EINVAL, "allreduce: the buffer (%zu bytes at byte %zu of a shared "
                                   "allocation of %zu bytes) runs past the allocation's end; "
                                   "pass a range inside one ct_group_alloc_shared allocation",
                        bytes, off, size);
    w->start = start_allreduce;
    w->shm_alloc = a;
    w->shm_off = off;
    return CT_OK;
}

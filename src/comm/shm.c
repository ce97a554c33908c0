/*
 * Shared allocations, the control block with its barrier, and the agreement
 * on arguments that every collective with a shared-memory path runs first.
 *
 * ct_group_alloc_shared puts each rank's buffer in one MPI-3 shared-memory
 * window (MPI_Win_allocate_shared over the group's communicator) when every
 * rank of the group is on this node, so every rank can address every rank's
 * buffer; the collectives (allreduce.c, ...) then read and write their
 * peers' buffers directly.
 *
 * Synchronisation is a control block, itself a small shared window that a
 * group has while it has shared allocations: per rank a slot with a count of
 * the barriers it reached and the arguments of its last two agreements.  A
 * rank reaches barrier k by storing k in its slot (release) and has passed
 * it when every slot shows k or more (acquire): no read-modify-write, no
 * contended line.  The data follows the MPI-3 shared memory model: each
 * window is locked once (MPI_Win_lock_all) and MPI_Win_sync runs before
 * publishing an arrival and after seeing the others'.
 *
 * Agreement: every collective with a shared path, on a group with shared
 * allocations, shared buffer or not, first publishes (kind, allocation id,
 * offset, count, dtype, op, root) and passes a barrier; every rank then
 * reads the same W records and makes the same choice: the direct path (same
 * range of one allocation on every rank), MPI (private memory on every
 * rank), or CT_EINVAL on every rank when the records differ.  So a caller
 * who passes different ranges, or private memory on one rank, gets an error
 * everywhere instead of corrupted data or a hang.  Records are kept by the
 * parity of the agreement's number: a rank overwrites one only after every
 * rank passed the next agreement, so after every rank read it.
 *
 * Waiting never blocks the comm thread: collectives poll the barrier from
 * the engine (engine.c), so MPI work of other groups keeps moving.
 *
 * CTRAIN_COMM_SHM=0 makes ct_group_alloc_shared return ordinary memory, so
 * everything takes the MPI path.  Whether a group gets shared memory is
 * agreed by all its ranks (one MPI_Allreduce at allocation), so settings
 * that differ across ranks cannot split the group.
 */
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

/* What a rank passed to one collective; alloc_id 0 means private memory. */
typedef struct {
    uint64_t alloc_id;
    uint64_t offset;
    int64_t count;
    int32_t dtype, op, kind, root;
} shm_args;

/* One rank's part of the control block.  Its barrier count has a cache line
 * to itself: peers poll it while its owner writes only the records. */
typedef struct {
    _Atomic uint64_t arrived;
    char pad[64 - sizeof(uint64_t)];
    shm_args args[2]; /* by parity of the agreement number */
    char pad2[128 - 2 * sizeof(shm_args)];
} shm_slot;

_Static_assert(sizeof(shm_slot) % 64 == 0, "slots keep each other 64-byte aligned");

struct ct__shm_alloc {
    struct ct__shm_alloc *next;
    MPI_Win win;
    uint64_t id;   /* the same on every rank: allocations run in group order */
    size_t bytes;  /* asked for by this rank */
    ct_mem_cat cat;
    char **base;   /* [size]: every rank's segment, as mapped in this process */
};
typedef struct ct__shm_alloc shm_alloc;

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


/* The group whose windows hold g's shared allocations: g itself on one
 * node, else this rank's node (the ranks of g on it). */
static ct_group *owner(const ct_group *g) { return g->node ? g->node : (ct_group *)g; }

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
    ct_work w;
    size_t bytes;
    ct_mem_cat cat;
    shm_alloc *out; /* NULL afterwards: use ordinary memory */
} alloc_op;

/* Freeing one allocation (a), or all of a group's (a NULL). */
typedef struct {
    ct_work w;
    shm_alloc *a;
} free_op;

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

/* Collective and blocking, like MPI_Comm_split. */
static ct_status alloc_run(alloc_op *q)
{
    ct_group *g = q->w.g, *t = owner(g);
    int rc;
    /* Allocate what can fail locally first, so every rank knows before the
     * window's collective call whether all can go on. */
    /* Without MPI_THREAD_MULTIPLE, blocking calls of other groups would stall
     * the comm thread, and with it the shared-memory paths: MPI only then. */
    /* On one node: one window over the group.  Spanning nodes, when some
     * node has two of its ranks: a window per node, over the group's ranks
     * on it (two-level collectives use them). */
    int want = shm_enabled() && ct__engine_concurrent() && g->size > 1 && (g->nnodes == 1 || g->nnodes < g->size);
    /* The bookkeeping only when a window may follow: an allocation whose
     * failure would be ignored is one a fault-injection walk cannot check. */
    struct ct__shm *s = NULL;
    shm_alloc *a = want ? ct_alloc_zeroed(sizeof *a, CT_MEM_OTHER) : NULL;
    if (a) a->base = ct_alloc_zeroed((size_t)t->size * sizeof *a->base, CT_MEM_OTHER);
    if (want && !t->shm) {
        s = ct_alloc_zeroed(sizeof *s, CT_MEM_OTHER);
        if (s) s->slot = ct_alloc_zeroed((size_t)t->size * sizeof *s->slot, CT_MEM_OTHER);
    }
    int local[2] = {want, a && a->base && (t->shm || (s && s->slot))};
    int all[2] = {0, 0};
    rc = MPI_Allreduce(local, all, 2, MPI_INT, MPI_MIN, g->comm);
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
        if ((st = shm_open(t, s)) != CT_OK) goto out_free;
        s = NULL; /* now t->shm */
    }
    /* Open MPI's segments start 8 bytes past a line (its window state comes
     * first): ask for a line more and start each rank's buffer on the next
     * line.  Offsets within a page are the same in every process, so every
     * rank finds the same start for every segment. */
    size_t cap = ((q->bytes + 63) & ~(size_t)63) + 64;
    if ((st = win_create(t, cap, 1, &a->win, a->base)) != CT_OK) goto out_close;
    for (int r = 0; r < t->size; r++)
        a->base[r] = (char *)(((uintptr_t)a->base[r] + 63) & ~(uintptr_t)63);
    /* Zeroed for the caller, and first touched by its owner (the page's NUMA
     * home).  Peers' pages are mapped into this process now, not in the
     * first allreduce: reading a byte per page is enough. */
    memset(a->base[t->rank], 0, q->bytes);
    for (int r = 0; r < t->size; r++) {
        MPI_Aint size = 0;
        int unit = 0;
        void *p = NULL;
        if (r == t->rank || MPI_Win_shared_query(a->win, r, &size, &unit, &p) != MPI_SUCCESS)
            continue;
        for (MPI_Aint o = 0; o < size; o += 4096) (void)*(volatile char *)((char *)p + o);
    }
    /* Every rank's barrier slot is zero before anyone uses it. */
    if ((rc = MPI_Barrier(t->comm)) != MPI_SUCCESS) {
        st = ct__mpi_fail(rc, "MPI_Barrier (after creating a shared window)");
        win_free(&a->win);
        goto out_close;
    }
    a->id = t->shm->next_id++;
    a->bytes = q->bytes;
    a->cat = q->cat;
    ct__mem_account(q->cat, (int64_t)q->bytes);
    pthread_mutex_lock(&reg_mu);
    a->next = t->shm->allocs;
    t->shm->allocs = a;
    pthread_mutex_unlock(&reg_mu);
    q->out = a;
    return CT_OK;

out_close:
    if (t->shm && !t->shm->allocs) shm_close(t);
out_free:
    free_alloc_struct(a);
    free_shm_struct(s);
    return st;
}

/* Collective: frees a and, with the group's last allocation, the control block. */
static ct_status free_one(ct_group *g, shm_alloc *a)
{
    g = owner(g);
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

static int alloc_start(ct_work *w)
{
    ct_status s = alloc_run((alloc_op *)w);
    return s == CT_OK ? CT__DONE : ct__op_fail(w, s);
}

static int free_start(ct_work *w)
{
    free_op *o = (free_op *)w;
    ct_status st = CT_OK;
    if (o->a) {
        st = free_one(w->g, o->a);
    } else {
        ct_group *t = owner(w->g);
        while (t->shm) {
            ct_status s = t->shm->allocs ? free_one(t, t->shm->allocs) : shm_close(t);
            if (st == CT_OK) st = s;
        }
    }
    return st == CT_OK ? CT__DONE : ct__op_fail(w, st);
}

static const ct__op_vt alloc_vt = {.name = "MPI_Win_allocate_shared",
                                   .flags = CT__OP_ORDERED | CT__OP_BLOCKING,
                                   .start = alloc_start};
static const ct__op_vt free_vt = {.name = "MPI_Win_free",
                                  .flags = CT__OP_ORDERED | CT__OP_BLOCKING,
                                  .start = free_start};

/* The allocation of g whose segment on this rank holds p, or NULL (reg_mu held). */
static shm_alloc *containing(const ct_group *g, const void *p)
{
    g = owner(g);
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
    const ct_group *t = owner(g);
    if (!t->shm) return NULL;
    for (shm_alloc *a = t->shm->allocs; a; a = a->next)
        if (a->base[t->rank] == p) return a;
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
    alloc_op *q = ct__work_new(g, &alloc_vt, sizeof *q);
    if (!q) return CT_ENOMEM;
    q->bytes = bytes;
    q->cat = cat;
    ct_status st = ct__submit_wait(&q->w);
    shm_alloc *a = q->out;
    ct__work_destroy(&q->w);
    CT_TRY(st);
    if (a) {
        *ptr = a->base[owner(g)->rank];
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
    CT_ASSERT(ptr == a->base[owner(g)->rank] &&
              "ct_group_free_shared: not the start of an allocation");
    CT_ASSERT(!ct__on_comm_thread()); /* would wait on itself */
    ct__group_quiesce(g); /* its works may still use the memory */
    free_op *o = ct__work_new(g, &free_vt, sizeof *o);
    if (!o) {
        ct_log(CT_LOG_WARN, "ct_group_free_shared: out of memory; the window stays allocated");
        return;
    }
    o->a = a;
    if (ct__submit(&o->w, NULL) != CT_OK)
        ct_log(CT_LOG_WARN, "ct_group_free_shared: %s", ct_last_error());
}

int ct_group_is_shared(const ct_group *g, const void *ptr, size_t bytes)
{
    if (!g || !ptr) return 0;
    pthread_mutex_lock(&reg_mu);
    shm_alloc *a = containing(g, ptr);
    int ok = a && bytes <= a->bytes - (size_t)((uintptr_t)ptr - (uintptr_t)a->base[owner(g)->rank]);
    pthread_mutex_unlock(&reg_mu);
    return ok;
}

int ct__shm_window_ranks(const ct_group *g, const void *p)
{
    pthread_mutex_lock(&reg_mu);
    int n = containing(g, p) ? owner(g)->size : 0;
    pthread_mutex_unlock(&reg_mu);
    return n;
}

void ct__shm_release(ct_group *g)
{
    for (struct ct__plain *n; (n = take_plain(g, NULL));) {
        ct_free(n->p);
        ct_free(n);
    }
    pthread_mutex_lock(&reg_mu);
    int has = owner(g)->shm != NULL;
    pthread_mutex_unlock(&reg_mu);
    if (!has) return;
    ct_log(CT_LOG_DEBUG, "comm: freeing shared allocations still live on a group");
    free_op *o = ct__work_new(g, &free_vt, sizeof *o);
    if (!o || ct__submit(&o->w, NULL) != CT_OK)
        ct_log(CT_LOG_WARN, "freeing a group's shared allocations: %s", ct_last_error());
}

/* ---- barrier -------------------------------------------------------------- */

static MPI_Win ref_win(const ct__shm_ref *ref) { return ref && ref->a ? ref->a->win : MPI_WIN_NULL; }

uint64_t ct__shm_arrive(ct_group *g, const ct__shm_ref *ref)
{
    struct ct__shm *s = g->shm;
    MPI_Win win = ref_win(ref);
    if (win != MPI_WIN_NULL) MPI_Win_sync(win);
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

int ct__shm_passed(ct_group *g, uint64_t target, const ct__shm_ref *ref)
{
    if (!all_reached(g, target)) return 0;
    MPI_Win_sync(g->shm->win);
    MPI_Win win = ref_win(ref);
    if (win != MPI_WIN_NULL) MPI_Win_sync(win);
    return 1;
}

/* Pauses first, then sched_yield so a peer sharing this core can run. */
int ct__shm_spin(const ct_group *g, uint64_t target, double budget)
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

void ct__shm_absent(const ct_group *g, uint64_t target, char *out, size_t n)
{
    size_t len = strlen(out);
    int any = 0;
    for (int r = 0; r < g->size && len + 16 < n; r++)
        if (atomic_load_explicit(&g->shm->slot[r]->arrived, memory_order_acquire) < target) {
            len += (size_t)snprintf(out + len, n - len, "%s%d", any ? ", " : "; rank(s) ", r);
            any = 1;
        }
    if (any && len < n) snprintf(out + len, n - len, " of the group have not arrived");
}

void *ct__shm_peer(const ct__shm_ref *ref, int r) { return ref->a->base[r] + ref->off; }

/* ---- agreement ----------------------------------------------------------- */

static const char *kind_name(int kind)
{
    switch (kind) {
    case CT__KIND_ALLREDUCE: return "allreduce";
    case CT__KIND_REDUCE: return "reduce";
    case CT__KIND_REDUCE_SCATTER: return "reduce_scatter";
    case CT__KIND_ALLGATHER: return "allgather";
    }
    return "?";
}

/* "100 x F32 SUM at byte 64 of shared allocation #1", with the kind first
 * ("reduce of ...") if with_kind. */
static void describe(const shm_args *m, int with_kind, char *out, size_t n)
{
    int len = snprintf(out, n, "%s%s%lld x %s", with_kind ? kind_name(m->kind) : "",
                       with_kind ? " of " : "", (long long)m->count,
                       ct_dtype_name((ct_dtype)m->dtype));
    if (len < 0 || (size_t)len >= n) return;
    if (m->kind != CT__KIND_ALLGATHER)
        len += snprintf(out + len, n - (size_t)len, " %s", ct__op_name((ct_reduce_op)m->op));
    if (m->root >= 0 && (size_t)len < n)
        len += snprintf(out + len, n - (size_t)len, " to root %d", m->root);
    if ((size_t)len >= n) return;
    if (m->alloc_id)
        snprintf(out + len, n - (size_t)len, " at byte %llu of shared allocation #%llu",
                 (unsigned long long)m->offset, (unsigned long long)m->alloc_id);
    else
        snprintf(out + len, n - (size_t)len, " in private memory");
}

static int same_args(const shm_args *x, const shm_args *y)
{
    if (x->kind != y->kind || x->count != y->count || x->dtype != y->dtype || x->op != y->op ||
        x->root != y->root)
        return 0;
    return x->count == 0 || (x->alloc_id == y->alloc_id && x->offset == y->offset);
}

void ct__agree_start(ct_group *g, ct__agree *ag, const ct__shm_ref *ref, int64_t count,
                     ct_dtype dt, ct_reduce_op op, int kind, int root)
{
    struct ct__shm *s = g->shm;
    CT_ASSERT(s); /* alloc and free quiesce the group, so it cannot change under a work */
    ag->handshake = s->handshakes++;
    shm_args *m = &s->slot[g->rank]->args[ag->handshake & 1];
    memset(m, 0, sizeof *m);
    m->alloc_id = ref->a ? ref->a->id : 0;
    m->offset = ref->a ? ref->off : 0;
    m->count = count;
    m->dtype = (int32_t)dt;
    m->op = (int32_t)op;
    m->kind = kind;
    m->root = root;
    ag->target = ct__shm_arrive(g, ref);
}

int ct__agree_poll(ct_work *w, ct__agree *ag, const char *what)
{
    ct_group *g = w->g;
    if (!ct__shm_passed(g, ag->target, NULL)) return CT__WAIT;
    /* Every rank reads the same records and so decides the same. */
    int par = (int)(ag->handshake & 1);
    const shm_args *first = &g->shm->slot[0]->args[par];
    for (int r = 1; r < g->size; r++) {
        const shm_args *m = &g->shm->slot[r]->args[par];
        if (!same_args(first, m)) {
            char d0[200], dr[200];
            int kinds = first->kind != m->kind;
            describe(first, kinds, d0, sizeof d0);
            describe(m, kinds, dr, sizeof dr);
            return ct__op_fail(w, ct_error(CT_EINVAL, "%s: the ranks passed different arguments: "
                                                      "rank 0 %s, rank %d %s; start the same "
                                                      "collectives in the same order with the "
                                                      "same count, dtype, op and root on every "
                                                      "rank, on the same range of one "
                                                      "ct_group_alloc_shared allocation on every "
                                                      "rank (or private memory on every rank)",
                                           what, d0, r, dr));
        }
    }
    return CT__DONE;
}

int ct__shm_active(const ct_group *g)
{
    pthread_mutex_lock(&reg_mu);
    int has = g->shm != NULL;
    pthread_mutex_unlock(&reg_mu);
    return has;
}

int ct__shm_node_active(const ct_group *g)
{
    pthread_mutex_lock(&reg_mu);
    int has = g->node && g->node->shm;
    pthread_mutex_unlock(&reg_mu);
    return has;
}

uint64_t ct__shm_alloc_id(const ct__shm_ref *ref) { return ref->a ? ref->a->id : 0; }

ct_status ct__shm_locate(const ct_group *g, const void *buf, size_t bytes, ct__shm_ref *ref,
                         const char *what)
{
    pthread_mutex_lock(&reg_mu);
    shm_alloc *a = containing(g, buf);
    size_t off = a ? (size_t)((uintptr_t)buf - (uintptr_t)a->base[owner(g)->rank]) : 0;
    size_t size = a ? a->bytes : 0;
    pthread_mutex_unlock(&reg_mu);
    ref->a = a;
    ref->off = off;
    if (a && bytes > size - off)
        return ct_error(CT_EINVAL, "%s: the buffer (%zu bytes at byte %zu of a shared "
                                   "allocation of %zu bytes) runs past the allocation's end; "
                                   "pass a range inside one ct_group_alloc_shared allocation",
                        what, bytes, off, size);
    return CT_OK;
}

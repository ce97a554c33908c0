/*
 * Private to src/comm.  The room's files:
 *   engine.c          the comm thread, its queue, work handles, the generic
 *                     driving of operations through their vtables, and the
 *                     blocking-call thread
 *   watch.c           bounded waits: timeouts and the job-ending notices
 *   group.c           MPI start-up and shut-down, groups and their nodes (real
 *                     or CTRAIN_FAKE_NODES), split, barrier, agreement on
 *                     errors, abort, MPI error conversion
 *   dtype.c           MPI datatypes and reduction ops for ctrain's dtypes
 *   args.c            argument checks the collectives share; tensor forms
 *   allreduce.c, reduce.c, bcast.c, allgather.c, reduce_scatter.c, p2p.c
 *                     one kind of operation each: its struct, its vtable,
 *                     its paths (MPI, shared memory, two-level)
 *   shm.c             shared allocations (MPI-3 windows), the control block,
 *                     its barrier and the agreement on arguments
 *   shm_kernels.c     the reductions the shared-memory paths run
 *
 * An operation is a struct that starts with a ct_work (the header the engine
 * knows) followed by its own arguments and state, plus a const vtable
 * (ct__op_vt) saying how to start and advance it.  Adding a collective adds
 * a file with a struct and a vtable, not fields here or cases in the engine.
 */
#ifndef CTRAIN_COMM_INTERNAL_H
#define CTRAIN_COMM_INTERNAL_H

#include <mpi.h>
#include <stdatomic.h>

#include "ctrain/comm.h"

struct ct_group {
    MPI_Comm comm;
    /* A duplicate of comm for the point-to-point messages of ctrain's own
     * collective algorithms (the ring reduce-scatter), so they can never
     * match a caller's ct_group_send/recv on comm.  MPI_COMM_NULL on the
     * internal node and leader groups, which run MPI's collectives only. */
    MPI_Comm ring;
    int rank, size, local_rank, local_size;
    int is_world;
    char name[96];  /* "world", "world/split1.color0", ...: the same on every member */
    int nsplit;     /* splits of this group so far (the caller's thread), for names */
    uint64_t nseq;  /* collectives submitted so far (engine lock): their numbers */
    /* Nodes (real, or CTRAIN_FAKE_NODES): how many the group spans, and when
     * more than one, this rank's node as a group of its own (the ranks of g
     * on it) and, on each node's first rank, the group of those first ranks.
     * Internal groups: no works of their own, freed with g. */
    int nnodes;
    ct_group *node, *leaders;
    /* When spanning nodes: [size], each rank's node, numbered as the leaders
     * rank (by their first rank in g); the two-level all-gather and
     * reduce-scatter lay node blocks out by it.  NULL on one node. */
    int *node_of;
    int pending;                  /* submitted works not yet completed (engine lock) */
    ct_work *ord_head, *ord_tail; /* started collectives, in start order (comm thread) */
    ct_work *defer_head, *defer_tail; /* collectives waiting to start (comm thread) */
    int running;                      /* collectives started, not finished (comm thread) */
    /* A collective that holds the group (see CT__OP_GATE): later collectives
     * of the group wait behind it, so every rank makes the group's MPI calls
     * and shared-memory barriers in the same order (comm thread). */
    ct_work *gate;
    struct ct__shm *shm; /* shared allocations and control block, NULL if none (shm.c) */
    struct ct__plain *plain; /* ordinary memory from ct_group_alloc_shared (shm.c) */
    ct_group *next_all;           /* registry of live groups, for finalize (engine lock) */
};

/* ---- operations -------------------------------------------------------- */

/* What start and progress report. */
enum { CT__WAIT = 0, /* nothing changed */
       CT__MOVED,    /* advanced, not finished */
       CT__DONE };   /* finished; w->status says how (ct__op_fail on error) */

enum {
    /* A collective: numbered in its group, held back while the group has
     * max_running collectives running, completed in start order. */
    CT__OP_ORDERED = 1,
    /* Holds its group from its start until it clears w->gate or finishes
     * (the engine sets w->gate at start): for operations whose later steps
     * (shared-memory barriers, MPI calls made after polling) must not
     * interleave with the next collective's on some ranks. */
    CT__OP_GATE = 2,
    /* start makes a blocking collective MPI call (MPI_Comm_split,
     * MPI_Win_allocate_shared): it runs on the engine's blocking-call thread
     * and must return CT__DONE; the comm thread keeps driving every other
     * operation meanwhile, so a peer waiting on this rank's shared-memory
     * work elsewhere can get there and make the same call.  Holds its group
     * until done, like CT__OP_GATE. */
    CT__OP_BLOCKING = 4,
};

typedef struct ct__op_vt {
    const char *name; /* "MPI_Iallreduce", "allreduce", ... for messages */
    unsigned flags;   /* CT__OP_* */
    /* Comm thread: starts the operation.  Returns CT__DONE, or CT__WAIT /
     * CT__MOVED with w->req either an active MPI request (progress runs when
     * it completes, w->mpi_status set) or MPI_REQUEST_NULL (progress runs
     * every round, alongside the other operations: it must not block). */
    int (*start)(ct_work *w);
    /* Comm thread: advances it; same contract as start.  NULL: the operation
     * is done when its request completes. */
    int (*progress)(ct_work *w);
    /* Comm thread, once, after it finished without error: post-processing
     * (AVG scaling, count checks); may fail.  NULL: none. */
    ct_status (*finish)(ct_work *w);
    /* Frees what the operation owns besides its struct.  NULL: nothing. */
    void (*destroy)(ct_work *w);
    /* Comm thread, for the timeout message: appends whom it waits for
     * ("; rank(s) 2 of the group have not arrived").  NULL: not known. */
    void (*blame)(const ct_work *w, char *out, size_t n);
} ct__op_vt;

/* ct_work.state */
enum { CT__W_QUEUED = 0, CT__W_INFLIGHT, CT__W_CALLING, CT__W_DONE };

/* The header every operation starts with. */
struct ct_work {
    const ct__op_vt *vt;
    ct_group *g;
    MPI_Request req;        /* what the operation waits on, or MPI_REQUEST_NULL */
    MPI_Status mpi_status;  /* of the last request that completed */
    int gate;               /* CT__OP_GATE: still holding the group */
    uint64_t seq;           /* collectives: number in its group, from 1 */
    /* What the collective is, for its fingerprint (fingerprint.c): set by
     * ct__work_describe, -1 where it has no such argument. */
    int fp_dtype, fp_root, fp_redop;
    int64_t fp_count;
    int fp_phase;           /* 1 while the fingerprint all-gather runs */
    int64_t *fp_all;        /* every rank's fingerprint, then this rank's */
    double t_start;         /* collectives: ct_now() when started */
    const char *call;       /* the public ctrain call that issued it (ct_comm_enter_call), or NULL */

    /* engine state */
    ct_work *next;      /* submit queue, then the group's deferred queue */
    ct_work *ord_next;  /* group's in-order completion list (comm thread) */
    ct_work *poll_next; /* the engine's list of polled works (comm thread) */
    int state;
    int mpi_done; /* finished; waiting for earlier collectives (comm thread) */
    int detached; /* handle freed while running: engine frees on completion */
    ct_status status;
    char msg[512];
    ct_work_fn cb;
    void *cb_arg;
};

/* ---- calls.c ----------------------------------------------------------- */

/* The public call the program's thread is in (ct_comm_enter_call), read from any thread; NULL outside. */
const char *ct__comm_process_call(void);
/* Open ct_comm_hold's; *who gets the last holder's name. */
int ct__comm_holds(const char **who);

/* ---- engine.c ---------------------------------------------------------- */

/* Starts the comm thread, which runs on_start (MPI set-up) first; returns its status. */
ct_status ct__engine_start(ct_status (*on_start)(void), void (*on_stop)(void));
/* Waits until every submitted work has completed, then stops the thread,
 * which runs on_stop (MPI shut-down) last. */
void ct__engine_stop(void);
/* A zeroed operation of `size` bytes (at least sizeof(ct_work)) for g, run
 * by vt; from the engine's reserve when ct_alloc fails (ct_comm_reserve_taken);
 * NULL (error set) if that is used up too. */
void *ct__work_new(ct_group *g, const ct__op_vt *vt, size_t size);
/* Frees a work (vt->destroy, then the struct); NULL is a no-op. */
void ct__work_destroy(ct_work *w);
/* Records failure s (message: ct_last_error()) in w; returns CT__DONE. */
int ct__op_fail(ct_work *w, ct_status s);
/* After an MPI_I* call that set w->req: CT__WAIT, or ct__op_fail with
 * "<what> failed ..." if rc is an error. */
int ct__op_mpi(ct_work *w, int rc, const char *what);
/* Two-level collectives agree across nodes on a hash of their arguments
 * before touching memory: h becomes {hash, -hash} MIN-allreduced over the
 * group, so every rank had the same hash exactly when ct__hash_agreed(h).  what
 * names the collective for MPI errors. */
int ct__hash_agree_start(ct_work *w, int64_t h[2], int64_t hash, const char *what);
static inline int ct__hash_agreed(const int64_t h[2]) { return h[0] == -h[1]; }
/* Queues w for the comm thread.  With out, hands the handle back; without,
 * waits, frees w and returns its status.  Takes ownership of w either way. */
ct_status ct__submit(ct_work *w, ct_work **out);
/* Queues w and waits for it; the caller then reads its results and frees
 * it (also when this fails).  Returns its status (message set). */
ct_status ct__submit_wait(ct_work *w);
/* 1 when called on the comm thread (where waiting would deadlock). */
int ct__on_comm_thread(void);
/* 1 if CT__OP_BLOCKING operations run on their own thread (MPI granted
 * MPI_THREAD_MULTIPLE), 0 if they block the comm thread. */
int ct__engine_concurrent(void);
/* Blocks until g has no outstanding works. */
void ct__group_quiesce(ct_group *g);
/* Registry of live groups (for finalize). */
void ct__group_register(ct_group *g);
void ct__group_unregister(ct_group *g);
/* Removes and returns the most recently registered group, or NULL. */
ct_group *ct__group_pop(void);

/* ---- fingerprint.c ----------------------------------------------------- */

/* Comm thread, after MPI_Init: agrees over world whether CTRAIN_DEBUG asks
 * for collective fingerprints (any rank asking turns them on for all). */
ct_status ct__fp_init(MPI_Comm world);
/* 1 when collectives carry fingerprints (then one runs at a time per group). */
int ct__fp_on(void);
/* Records what w does, for its fingerprint (-1: no such argument). */
void ct__work_describe(ct_work *w, int dtype, int64_t count, int root, int redop);
/* Adds w's call and payload to its kind's tally (tally.c). */
void ct__tally_add(const ct_work *w, int dtype, int64_t count);
/* Adds what this rank sends and receives in one MPI collective over n ranks
 * (pos: its place counted from the root; 0 where there is none) moving b
 * bytes (tally.c says which b and the algorithm's figures).  kind may also be
 * CT__COLL_SCATTER. */
#define CT__COLL_SCATTER ((ct_coll_kind)CT_COLL_NKINDS)
void ct__traffic_coll(ct_coll_kind kind, int n, int pos, uint64_t b);
/* Adds a send's (s) or a recv's (r) bytes. */
void ct__traffic_p2p(uint64_t s, uint64_t r);
/* Comm thread: starts w's fingerprint all-gather (w->req set; CT__WAIT). */
int ct__fp_start(ct_work *w);
/* Comm thread, when the all-gather completed: 0 when every rank's matches
 * (w may start); otherwise rank 0 of the group ends the job naming both
 * ranks and operations (no return) and the others return 1 (park w). */
int ct__fp_check(ct_work *w);

/* ---- watch.c ----------------------------------------------------------- */

/* Comm thread, after MPI_Init: reads CTRAIN_COMM_TIMEOUT and opens the
 * job's notice channel (a duplicate of world). */
ct_status ct__watch_start(MPI_Comm world);
/* Comm thread, before MPI_Finalize. */
void ct__watch_stop(void);
/* Seconds after which a collective that has not completed ends the job (0: never). */
double ct__watch_timeout(void);
/* Comm thread: if another rank reported an expired collective, logs its
 * message and ends the job (does not return); else returns at once. */
void ct__watch_poll(void);
/* Comm thread: logs msg, sends it to every other rank (which log it), and
 * ends the job.  Does not return. */
void ct__watch_expired(const char *msg) __attribute__((noreturn));

/* ---- dtype.c ----------------------------------------------------------- */

/* Creates the 16-bit datatypes and reduction ops (comm thread, after MPI_Init). */
ct_status ct__dtypes_create(void);
void ct__dtypes_free(void);
MPI_Datatype ct__mpi_dtype(ct_dtype dt);
/* MPI op for (dt, op); AVG maps to the sum. */
MPI_Op ct__mpi_op(ct_dtype dt, ct_reduce_op op);
/* CT_OK if op is defined for dt, else CT_EUNSUPPORTED with a message. */
ct_status ct__check_op(ct_dtype dt, ct_reduce_op op, const char *what);
/* buf[0..n) *= 1/size, in dt's arithmetic (f32 for 16-bit types). */
void ct__scale(void *buf, int64_t n, ct_dtype dt, int size);
const char *ct__op_name(ct_reduce_op op);

/* ---- allreduce.c ------------------------------------------------------- */

/* Two-level allreduces that took the shared-memory + leaders path (for tests). */
extern _Atomic uint64_t ct__allreduce_two_level_runs;

/* ---- reduce_scatter.c, allgather.c -------------------------------------- */

/* Two-level reduce-scatters and all-gathers that ran (for tests). */
extern _Atomic uint64_t ct__reduce_scatter_two_level_runs;
extern _Atomic uint64_t ct__allgather_two_level_runs;
/* Reduce-scatters that ran as ctrain's ring (for tests). */
extern _Atomic uint64_t ct__reduce_scatter_ring_runs;

/* Where node blocks go in a two-level collective over g (spanning nodes;
 * size*count at most INT_MAX, as MPI's counts are ints), in new arrays (the
 * caller frees them with ct_free, also on failure): for each node n,
 * (*cnt)[n] = count * (ranks on n) and (*dsp)[n] its offset in a node-major
 * layout (node 0's ranks in rank order, then node 1's, ...); (*pos)[r] the
 * element offset of rank r's block in it.  Returns 1 when that layout is
 * rank order (every node's ranks are contiguous in g: the buffer's own
 * layout), 0 when it is not, -1 when out of memory. */
int ct__node_layout(const ct_group *g, int64_t count, int **cnt, int **dsp, int64_t **pos);

/* ---- args.c ------------------------------------------------------------ */

/* Group non-NULL, dtype known, 0 <= count <= INT_MAX, buf non-NULL if count > 0. */
ct_status ct__check_args(const ct_group *g, const void *buf, int64_t count, ct_dtype dt,
                         const char *what);
/* 0 <= r < size of g, else CT_EINVAL naming the role ("root", "peer"). */
ct_status ct__check_rank(const ct_group *g, int r, const char *role, const char *what);
/* 1 if [a, a+na) and [b, b+nb) share a byte. */
int ct__overlaps(const void *a, size_t na, const void *b, size_t nb);

/* ---- group.c ----------------------------------------------------------- */

/* CT_ECOMM with "<what> failed on rank R: <MPI error string>; <hint>". */
ct_status ct__mpi_fail(int rc, const char *what);
/* Collective over comm: MPI_ERRORS_RETURN, rank/size, and the node
 * structure (local rank/size, nnodes, node and leaders groups) for a new
 * group (comm thread or blocking-call thread).  Set g->name first. */
ct_status ct__group_setup(ct_group *g, MPI_Comm comm);
/* Frees g's communicator and its node and leaders groups (not g). */
ct_status ct__group_free_comms(ct_group *g);
/* MPI_TAG_UB of the job. */
int ct__tag_ub(void);

/* ---- shm.c ------------------------------------------------------------- */

typedef struct ct__shm_alloc ct__shm_alloc;

/* Where a buffer lies among a group's shared allocations: a NULL if in
 * private memory, else the allocation and the byte offset in this rank's
 * segment. */
typedef struct {
    ct__shm_alloc *a;
    size_t off;
} ct__shm_ref;

/* What the ranks agree on before a collective with a shared-memory path. */
enum { CT__KIND_ALLREDUCE = 1, CT__KIND_REDUCE, CT__KIND_REDUCE_SCATTER, CT__KIND_ALLGATHER };

/* One agreement in flight (see shm.c). */
typedef struct {
    uint64_t target;    /* barrier arrival awaited */
    uint64_t handshake; /* number of the agreement */
} ct__agree;

/* Caller's thread: 1 if g has shared allocations (collectives with a shared
 * path then agree on their arguments first). */
int ct__shm_active(const ct_group *g);
/* Caller's thread: 1 if g spans nodes and has shared allocations (windows
 * per node, over g->node: the two-level paths). */
int ct__shm_node_active(const ct_group *g);
/* The allocation's number (the same on every rank of its group), 0 if private. */
uint64_t ct__shm_alloc_id(const ct__shm_ref *ref);
/* (args.c) What a two-level collective agrees on (ct__hash_agree_start): a
 * hash of kind (CT__KIND_*), where ref lies, count, dt, op and inplace
 * (pass 0 for those a kind does not compare), or 0 when ref is private
 * memory, so that "all private" and "all shared" both agree. */
int64_t ct__args_hash(int kind, const ct__shm_ref *ref, int64_t count, ct_dtype dt, int op, int inplace);
/* Caller's thread: where buf..buf+bytes lies among g's shared allocations
 * (on a group spanning nodes: among its node's windows, offsets in g->node).
 * CT_EINVAL naming `what` if it starts in one and runs past its end. */
ct_status ct__shm_locate(const ct_group *g, const void *buf, size_t bytes, ct__shm_ref *ref,
                         const char *what);
/* Comm thread: publishes this rank's arguments for agreement and reaches
 * the agreement's barrier. */
void ct__agree_start(ct_group *g, ct__agree *ag, const ct__shm_ref *ref, int64_t count,
                     ct_dtype dt, ct_reduce_op op, int kind, int root);
/* Comm thread: CT__WAIT until every rank published; then CT__DONE with
 * w->status CT_OK if every rank passed the same arguments, else the
 * failure (the same on every rank) recorded in w. */
int ct__agree_poll(ct_work *w, ct__agree *ag, const char *what);
/* Comm thread: reaches the group's next barrier after making this rank's
 * stores (to ref's allocation, if any) visible; returns its number. */
uint64_t ct__shm_arrive(ct_group *g, const ct__shm_ref *ref);
/* Comm thread: 1 once every rank reached barrier target (their stores are
 * then visible), else 0. */
int ct__shm_passed(ct_group *g, uint64_t target, const ct__shm_ref *ref);
/* Busy-waits up to `budget` seconds for barrier target; 1 if reached. */
int ct__shm_spin(const ct_group *g, uint64_t target, double budget);
/* Appends "; rank(s) 1, 3 of the group have not reached it" for barrier
 * target (nothing if all have). */
void ct__shm_absent(const ct_group *g, uint64_t target, char *out, size_t n);
/* Rank r's copy of the buffer ref points at (the same offset in r's segment). */
void *ct__shm_peer(const ct__shm_ref *ref, int r);
/* Caller's thread, for tests: how many ranks map the shared allocation of g
 * holding p (the ranks of its window), 0 if p is not in one. */
int ct__shm_window_ranks(const ct_group *g, const void *p);
/* Frees every allocation from ct_group_alloc_shared g still has
 * (collective; g quiesced). */
void ct__shm_release(ct_group *g);

/* ---- shm_kernels.c ----------------------------------------------------- */

/* For i in [0, n): every dst[d][i] becomes the reduction of src[0..nsrc)[i],
 * combined in source order (f32 sums: ((s0 + s1) + s2) + ...; bf16/f16
 * widened to f32, combined, rounded once), times inv for AVG.  A dst may be
 * one of the srcs.  MAX/MIN as the MPI path computes them. */
void ct__reduce_into(void *const *src, int nsrc, void *const *dst, int ndst, int64_t n,
                     ct_dtype dt, ct_reduce_op op, float inv);
/* Rank me's slice [lo, hi) of n elements of size esz starting at byte off of
 * a 64-byte aligned segment, split among W ranks on 64-byte lines (no line
 * written by two ranks); the same split on every rank. */
void ct__shm_slice(int64_t n, size_t off, size_t esz, int W, int me, int64_t *lo, int64_t *hi);

/* ---- src/core/alloc.c -------------------------------------------------- */

/* Counts bytes allocated outside ct_alloc (MPI shared-memory windows) under
 * cat in the tracked allocator's current and peak figures; delta < 0 gives
 * them back. */
void ct__mem_account(ct_mem_cat cat, int64_t delta);

#endif

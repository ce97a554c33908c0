/*
 * Private to src/comm: the group and work structs, the engine (the comm
 * thread and its queue, engine.c), MPI datatypes and reduction ops for
 * ctrain's dtypes (dtype.c), MPI error conversion (group.c), and shared
 * allocations with the direct shared-memory allreduce (shm.c).
 */
#ifndef CTRAIN_COMM_INTERNAL_H
#define CTRAIN_COMM_INTERNAL_H

#include <mpi.h>

#include "ctrain/comm.h"

struct ct_group {
    MPI_Comm comm;
    int rank, size, local_rank, local_size;
    int is_world;
    int pending;                  /* submitted works not yet completed (engine lock) */
    ct_work *ord_head, *ord_tail; /* started collectives, in start order (comm thread) */
    ct_work *defer_head, *defer_tail; /* collectives waiting for a running slot (comm thread) */
    int running;                      /* collectives started, MPI not done (comm thread) */
    /* A polled collective (shm.c) still agreeing with its peers: later
     * collectives of the group wait behind it, so every rank makes the
     * group's MPI calls in the same order (comm thread). */
    ct_work *gate;
    struct ct__shm *shm; /* shared allocations and control block, NULL if none (shm.c) */
    struct ct__plain *plain; /* ordinary memory from ct_group_alloc_shared (shm.c) */
    ct_group *next_all;           /* registry of live groups, for finalize (engine lock) */
};

/* Runs on the comm thread: makes the MPI call(s).  Returns CT_OK with *req
 * set to an active request, or to MPI_REQUEST_NULL when already complete;
 * or an error with ct_error's message set on the comm thread. */
typedef ct_status (*ct__start_fn)(ct_work *w, MPI_Request *req);
/* Runs on the comm thread after MPI completed the request without error:
 * post-processing (avg scaling, moving an in-place result, count checks). */
typedef ct_status (*ct__finish_fn)(ct_work *w);
/* Runs on the comm thread, each round, for a work whose start set w->poll
 * (and left *req at MPI_REQUEST_NULL): advances it without waiting long.
 * Returns CT__POLL_WAIT (nothing changed), CT__POLL_MOVED (advanced, still
 * waiting) or CT__POLL_DONE: then *s is the outcome (message set on error)
 * and *req is MPI_REQUEST_NULL (finished) or an active request (the work
 * goes on in MPI like any other). */
typedef int (*ct__poll_fn)(ct_work *w, MPI_Request *req, ct_status *s);
enum { CT__POLL_WAIT = 0, CT__POLL_MOVED, CT__POLL_DONE };

enum { CT__QUEUED = 0, CT__INFLIGHT, CT__CALLING, CT__DONE };

struct ct_work {
    ct_work *next;     /* submit queue (engine lock) */
    ct_work *ord_next; /* group's in-order completion list (comm thread) */
    ct_group *g;
    const char *name; /* "allreduce", ... for messages */
    ct__start_fn start;
    ct__finish_fn finish;
    int ordered; /* collective: completes in start order within its group */

    /* operation arguments */
    void *buf;
    const void *sbuf;
    int count;
    ct_dtype dt;
    ct_reduce_op op;
    int root, peer, tag;
    int *counts, *displs; /* allgatherv, ct_alloc'd, freed with the work */
    int color, key;       /* split */
    int inplace;
    void *arg;            /* split: the new group; shm.c: its request */
    MPI_Status mpi_status;

    /* polled works (shm.c); comm thread */
    ct__poll_fn poll;
    ct_work *poll_next; /* the engine's list of works being polled */
    int phase;
    uint64_t target;    /* barrier arrival awaited */
    uint64_t handshake; /* number of the agreement step */
    void *shm_alloc;    /* the shared allocation buf lies in, or NULL */
    size_t shm_off;     /* byte offset of buf in it */
    double t_wait;      /* when the current wait began */
    int warned;         /* a long wait was logged */

    /* engine state */
    int state;
    int mpi_done; /* MPI part finished; waiting for earlier collectives (comm thread) */
    int detached; /* handle freed while running: engine frees on completion */
    ct_status status;
    char msg[512];
    ct_work_fn cb;
    void *cb_arg;
};

/* ---- engine.c ---------------------------------------------------------- */

/* Starts the comm thread, which runs on_start (MPI set-up) first; returns its status. */
ct_status ct__engine_start(ct_status (*on_start)(void), void (*on_stop)(void));
/* Waits until every submitted work has completed, then stops the thread,
 * which runs on_stop (MPI shut-down) last. */
void ct__engine_stop(void);
/* A zeroed work for g; NULL (error set) if out of memory. */
ct_work *ct__work_new(ct_group *g, const char *name, ct__start_fn start, ct__finish_fn finish,
                      int ordered);
/* Frees a work that was never submitted. */
void ct__work_destroy(ct_work *w);
/* Queues w for the comm thread.  With out, hands the handle back; without,
 * waits, frees w and returns its status.  Takes ownership of w either way. */
ct_status ct__submit(ct_work *w, ct_work **out);
/* 1 when called on the comm thread (where waiting would deadlock). */
int ct__on_comm_thread(void);
/* Blocks until g has no outstanding works. */
void ct__group_quiesce(ct_group *g);
/* Registry of live groups (for finalize). */
void ct__group_register(ct_group *g);
void ct__group_unregister(ct_group *g);
/* Removes and returns the most recently registered group, or NULL. */
ct_group *ct__group_pop(void);

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

/* ---- group.c ----------------------------------------------------------- */

/* CT_ECOMM with "<what> failed on rank R: <MPI error string>; <hint>". */
ct_status ct__mpi_fail(int rc, const char *what);
/* MPI_ERRORS_RETURN and rank/size/local info for a new communicator (comm thread). */
ct_status ct__group_setup(ct_group *g, MPI_Comm comm);
/* MPI_TAG_UB of the job. */
int ct__tag_ub(void);

/* ---- shm.c ------------------------------------------------------------- */

/* Caller's thread, for an allreduce w of `bytes` at buf on a group: if the
 * group has shared allocations, routes w through the shared-memory
 * agreement (direct reduction when every rank passes the same range of one
 * shared allocation, MPI otherwise).  CT_EINVAL if buf starts in a shared
 * allocation and runs past its end. */
ct_status ct__shm_allreduce_setup(ct_work *w, const void *buf, size_t bytes);
/* Frees every allocation from ct_group_alloc_shared g still has
 * (collective; g quiesced). */
void ct__shm_release(ct_group *g);

/* ---- src/core/alloc.c -------------------------------------------------- */

/* Counts bytes allocated outside ct_alloc (MPI shared-memory windows) under
 * cat in the tracked allocator's current and peak figures; delta < 0 gives
 * them back. */
void ct__mem_account(ct_mem_cat cat, int64_t delta);

#endif

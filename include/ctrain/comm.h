/*
 * ctrain comm: process groups and collectives over MPI.  This room owns MPI:
 * start-up and shut-down, groups (a world group and sub-groups split from
 * it), asynchronous collectives and point-to-point transfers that return
 * work handles, and the communication thread that drives them.  It knows
 * tensors and dtypes, nothing of layers or models.
 *
 * Threading.  ct_comm_init starts one communication thread per process.
 * That thread calls MPI_Init_thread and then makes ctrain's MPI calls; it
 * starts the collectives of a group in the order the caller issued them, so
 * MPI's rule that all ranks call collectives on a communicator in the same
 * order holds as long as all ranks issue ctrain's collectives on a group in
 * the same order.  Calls that MPI only has in blocking form (split, shared
 * window allocation and free) run on a second, blocking-call thread, so that
 * while one rank waits in such a call on one group, the comm thread still
 * drives every other group's operations (a peer may need them before it can
 * make the same call): any number of groups may have work in flight, and
 * only the orders within each group must match across ranks (blocking calls,
 * as in MPI, must also come in the same order on every rank).
 * While an operation is in flight the thread polls MPI (Open MPI does not
 * progress nonblocking collectives by itself) with short sleeps in between,
 * so communication runs while the caller computes without taking a core;
 * while the caller waits in ct_work_wait it polls without sleeping for a
 * while (ct_comm_set_wait_spin_us), so a waited-for message is seen at once.
 * Starting operations, waiting and testing are thread-safe, but the order in
 * which collectives on a group are started must be the same on every rank,
 * so start them from one thread (normally the training loop's).  Init,
 * finalize, split and destroy belong to that thread too.  Completion
 * callbacks run on the comm thread.
 *
 * Buffers.  An operation reads and writes the caller's memory until it
 * completes: keep buffers alive and untouched until ct_work_wait returns or
 * ct_work_test says done.  Counts are elements (not bytes) and must fit in
 * an int (MPI's limit).
 *
 * Errors.  Bad arguments are caught before anything is sent and return
 * CT_EINVAL / CT_EUNSUPPORTED with a message; MPI failures return CT_ECOMM
 * with MPI's error string.  A rank that rejects its arguments returns
 * without taking part, so its peers would wait for it: when arguments may
 * differ across ranks, agree first with ct_group_check, or stop the job
 * with ct_comm_abort.
 *
 * Shared memory.  When every rank of a group is on one node, buffers from
 * ct_group_alloc_shared live in an MPI-3 shared-memory window, and
 * collectives over the same range of one such allocation on every rank skip
 * MPI's messages (for f32, bf16, f16; all-gather for any dtype; integer
 * reductions go through MPI): an allreduce has each rank sum its slice of
 * the range across all ranks' buffers and write it into all of them; a
 * reduce writes the slices into the root's buffer only; a reduce-scatter
 * has rank r reduce block r of every rank's send buffer into its recv (which
 * may be private); an all-gather copies each rank's block out of its peers'
 * receive buffers.  Sums run in rank order, in f32 for 16-bit types,
 * rounded once.  They are queued, ordered and completed like any
 * collective.  On a group with shared allocations each of these first
 * agrees through shared memory on every rank's (collective, range, count,
 * dtype, op, root): ranks that differ all fail with CT_EINVAL.
 * When a group spans nodes, its shared allocations are windows per node
 * (over the group's ranks on that node), and an allreduce over them is
 * two-level: reduced through shared memory into each node's first rank,
 * allreduced between those with MPI, copied back through shared memory
 * (agreement across nodes through a small MPI allreduce first).  A
 * reduce-scatter whose send, or an all-gather whose recv, is such a range
 * is two-level too (node leaders exchange node blocks with MPI; nodes may
 * hold different numbers of ranks; reduce-scatter for f32/bf16/f16); its
 * other collectives use MPI.  CTRAIN_COMM_SHM=0 turns shared allocations into
 * ordinary memory (every collective then takes the MPI path), for
 * comparison or as an escape hatch.
 */
#ifndef CTRAIN_COMM_H
#define CTRAIN_COMM_H

#include "core.h"
#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ct_group ct_group; /* a set of ranks (wraps an MPI communicator) */
typedef struct ct_work ct_work;   /* one asynchronous operation */

typedef enum { CT_OP_SUM = 0, CT_OP_AVG, CT_OP_MAX, CT_OP_MIN } ct_reduce_op;

/* Color for ct_group_split: this rank joins no sub-group (*out becomes NULL). */
#define CT_GROUP_NONE (-1)

/* ---- start-up and shut-down ------------------------------------------- */

/* Initialises MPI (a process without mpirun is a world of 1) and starts the
 * comm thread; argc/argv may be NULL.  A second call is a no-op.  If MPI was
 * already initialised by the program, it is used and left for the program to
 * finalise (it must allow at least MPI_THREAD_SERIALIZED). */
ct_status ct_comm_init(int *argc, char ***argv);
/* Waits for outstanding operations, frees every group, stops the comm thread
 * and finalises MPI (if ct_comm_init initialised it).  MPI cannot start
 * again in the same process afterwards.  No-op if not initialised.
 * CT_ESTATE, changing nothing, while something still holds communication
 * (ct_comm_hold: a strategy not yet destroyed): destroy it first.  With
 * CTRAIN_DEBUG=collectives it is a fingerprinted barrier over the world, so
 * a rank still waiting in a collective call of its own (say a
 * ct_strategy_model_state made on rank 0 only) ends the job with a message
 * naming both calls instead of waiting for the timeout. */
ct_status ct_comm_finalize(void);
/* Marks this thread as inside the public ctrain call name (a string that
 * outlives the call, such as "ct_strategy_model_state") and returns the
 * previous mark for ct_comm_leave_call; nested calls keep the outermost
 * name.  Collectives started meanwhile carry it: the comm timeout and the
 * CTRAIN_DEBUG=collectives mismatch messages name the call a rank is in.
 * Library code calls these around its collective entry points; a program
 * may too, around collective code of its own. */
const char *ct_comm_enter_call(const char *name);
void ct_comm_leave_call(const char *prev);
/* The call this thread is in, or NULL. */
const char *ct_comm_current_call(void);
/* Something that communicates while it lives (a strategy: who names it,
 * "strategy fsdp") holds communication from creation to destruction, so
 * ct_comm_finalize refuses instead of freeing what it still uses. */
void ct_comm_hold(const char *who);
void ct_comm_unhold(const char *who);
/* 1 between ct_comm_init and ct_comm_finalize. */
int ct_comm_initialized(void);
/* Logs "rank R: message" and aborts the whole job (MPI_Abort), so a failing
 * rank stops every rank with a message instead of leaving them waiting. */
void ct_comm_abort(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));

/* ---- groups ----------------------------------------------------------- */

/* Every rank of the job; owned by ctrain (do not destroy).  NULL before init. */
ct_group *ct_group_world(void);
/* This rank's index in g, 0..size-1. */
int ct_group_rank(const ct_group *g);
int ct_group_size(const ct_group *g);
/* This rank's index among the ranks of g on the same node, and how many
 * those are.  Nodes are machines, or with CTRAIN_FAKE_NODES=K (see
 * ct_comm_set_fake_nodes) K blocks of contiguous world ranks per machine. */
int ct_group_local_rank(const ct_group *g);
int ct_group_local_size(const ct_group *g);
/* The node this rank is on, numbered 0..ct_group_num_nodes(g)-1 in the
 * order of each node's lowest rank in g (a split color for per-node groups). */
int ct_group_node(const ct_group *g);
int ct_group_num_nodes(const ct_group *g);
/* Collective over g: ranks with the same color form a sub-group, ordered by
 * key (ties by rank in g).  color CT_GROUP_NONE (or any negative) joins
 * none and sets *out to NULL.  The caller destroys *out. */
ct_status ct_group_split(ct_group *g, int color, int key, ct_group **out);
/* Collective over g: returns when every rank of g has called it. */
ct_status ct_group_barrier(ct_group *g);
/* Collective over g: agrees whether every rank of g succeeded.  Pass this
 * rank's outcome (its message is ct_last_error()).  Returns CT_OK on every
 * rank if all passed local == CT_OK; otherwise every rank returns the error
 * of the lowest failing rank, with that rank's number and message. */
ct_status ct_group_check(ct_group *g, ct_status local);
/* 1 when collectives carry fingerprints: CTRAIN_DEBUG=collectives on any
 * rank at ct_comm_init turns them on for all.  Each collective then first
 * compares (group, operation, dtype, count, root, reduction, sequence
 * number) across its ranks, and the first mismatch ends the job naming
 * both ranks and both operations; collectives of a group run one at a time. */
int ct_comm_debug_collectives(void);
/* Operations whose bookkeeping came from the engine's reserve since the
 * process started: an operation that ct_alloc cannot serve (out of memory)
 * takes one of a few preallocated slots, so a rank out of memory still
 * tells its peers (ct_group_check) instead of leaving them waiting.  For
 * tests of allocation failure: a fault the reserve absorbed is no error. */
long ct_comm_reserve_taken(void);
/* Collective: checks that every rank of g holds the same n settings
 * (keys[i] = vals[i], text) before work that depends on them.  The calls
 * it makes do not depend on the values, so ranks that disagree never hang.
 * On any difference every rank gets CT_EINVAL and the same message naming
 * what ("the command line"), the settings and which ranks hold which value:
 * "ranks disagree on the command line: --steps differs: rank 0 has '100',
 * rank 1 has '200'; ...". */
ct_status ct_group_agree_settings(ct_group *g, const char *what, const char *const *keys, const char *const *vals,
                                  int n);
/* Waits for the group's outstanding operations and frees it (collective, as
 * MPI_Comm_free is).  NULL and the world group are no-ops. */
void ct_group_destroy(ct_group *g);

/* ---- asynchronous collectives ------------------------------------------
 * Each starts an operation on g and returns at once.  Pass a ct_work ** to
 * get a handle (free it with ct_work_destroy), or NULL to wait for completion
 * before returning (the blocking form).  Reductions support CT_F32, CT_BF16
 * and CT_F16 with every op (16-bit values are added in f32 and rounded back
 * at each step; on the shared-memory path, summed in f32 over all ranks and
 * rounded once), and CT_I32, CT_I64, CT_U8 with SUM, MAX and MIN (integer
 * sums wrap).  AVG is the sum times 1/size.  Collectives on one group
 * complete, and run their callbacks, in the order they were started. */

/* ---- counting collectives --------------------------------------------- */

/* What this process's collectives of one kind amounted to: calls started
 * and their payload bytes (count x dtype size as given: a broadcast's
 * buffer, an allgather's receive size), however they travel (shared memory
 * or messages).  For tests and reports that say what a step sends. */
typedef struct {
    uint64_t calls, bytes;
} ct_comm_tally;
typedef enum { CT_COLL_ALLREDUCE = 0, CT_COLL_REDUCE, CT_COLL_BROADCAST, CT_COLL_ALLGATHER,
               CT_COLL_REDUCE_SCATTER, CT_COLL_NKINDS } ct_coll_kind;
/* The tallies since the start or the last ct_comm_tally_reset, by kind. */
void ct_comm_tally_get(ct_comm_tally out[CT_COLL_NKINDS]);
void ct_comm_tally_reset(void);
/* What this process sent and received in messages (MPI) since the start or
 * the last ct_comm_tally_reset: collectives (their steps between nodes, and
 * inside a node where they pass messages), sends and recvs.  ctrain's own
 * shared-memory paths count nothing: they pass no message.  MPI picks its
 * algorithms out of sight, so a collective counts what the bandwidth-
 * optimal one moves (an allreduce of b bytes over n ranks: 2 (n-1)/n b
 * each way; a reduce-scatter or an all-gather: (n-1)/n b; src/comm/tally.c),
 * the least any algorithm can.  For the step report and tests. */
typedef struct {
    uint64_t sent, received;
} ct_comm_traffic;
ct_comm_traffic ct_comm_traffic_get(void);
/* Seconds of CPU ctrain's communication thread has used since ct_comm_init
 * (driving MPI, polling, shared-memory reductions, and the kernel's side of
 * its socket calls): where the computation fills the cores, what
 * communication takes from it.  0 outside ct_comm_init .. ct_comm_finalize. */
double ct_comm_thread_cpu_get(void);

/* buf[0..count) on every rank becomes the reduction over ranks of buf.
 * Without messages when buf is the same range of one of g's shared
 * allocations on every rank; two-level when g spans nodes (see Shared
 * memory above). */
ct_status ct_group_allreduce(ct_group *g, void *buf, int64_t count, ct_dtype dt,
                             ct_reduce_op op, ct_work **work);
/* buf on rank root becomes the reduction over ranks; other ranks' buf is
 * unchanged.  Without messages when buf is the same range of one of g's
 * shared allocations on every rank (one node). */
ct_status ct_group_reduce(ct_group *g, void *buf, int64_t count, ct_dtype dt,
                          ct_reduce_op op, int root, ct_work **work);
/* buf on every rank becomes root's buf (any dtype). */
ct_status ct_group_broadcast(ct_group *g, void *buf, int64_t count, ct_dtype dt, int root,
                             ct_work **work);
/* recv[r*count .. (r+1)*count) becomes rank r's send[0..count) (any dtype).
 * In place when send == recv + rank*count.  Without messages when recv is
 * the same range of one of g's shared allocations on every rank (one node). */
ct_status ct_group_allgather(ct_group *g, const void *send, void *recv, int64_t count,
                             ct_dtype dt, ct_work **work);
/* Every rank's memory report (ct_mem_report_get on each, taken now) into
 * all[0 .. size) on every rank; the one way reports cross ranks.  Collective. */
ct_status ct_group_mem_reports(ct_group *g, ct_mem_report *all);
/* Like allgather with count[r] elements from rank r placed at recv + displ[r]
 * (displ NULL: packed in rank order).  counts/displs are copied.  In place
 * when send == recv + displ[rank]; send_count must equal counts[rank]. */
ct_status ct_group_allgatherv(ct_group *g, const void *send, int64_t send_count, void *recv,
                              const int64_t *counts, const int64_t *displs, ct_dtype dt,
                              ct_work **work);
/* send has size*count elements; recv[0..count) becomes the reduction over
 * ranks of block `rank` of send.  In place when recv == send + rank*count
 * (the other blocks of send are then clobbered).  Without messages when send
 * is the same range of one of g's shared allocations on every rank (one
 * node). */
ct_status ct_group_reduce_scatter(ct_group *g, const void *send, void *recv, int64_t count,
                                  ct_dtype dt, ct_reduce_op op, ct_work **work);

/* ---- shared memory ----------------------------------------------------- */

/* Collective over g: `bytes` bytes of zeroed, 64-byte aligned memory that
 * collectives on g can work on in place without copies: an MPI shared-memory
 * window over g when all of g's ranks share a node, or over g's ranks on
 * each node when g spans nodes (if some node has two of them); otherwise (a
 * group of one, one rank per node, CTRAIN_COMM_SHM=0, MPI without
 * MPI_THREAD_MULTIPLE) ordinary memory.  Counted under
 * cat in the tracked allocator.  Waits for g's outstanding operations
 * first.  Free with ct_group_free_shared (collective); ct_group_destroy and
 * ct_comm_finalize free what is left. */
ct_status ct_group_alloc_shared(ct_group *g, size_t bytes, ct_mem_cat cat, void **ptr);
/* Collective over g (waits for g's outstanding operations): frees ptr from
 * ct_group_alloc_shared on g.  NULL is a no-op. */
void ct_group_free_shared(ct_group *g, void *ptr);
/* 1 if ptr..ptr+bytes lies in a shared allocation of g that is shared
 * memory (with g's ranks on this node, when g spans nodes). */
int ct_group_is_shared(const ct_group *g, const void *ptr, size_t bytes);

/* ---- point to point ----------------------------------------------------
 * A send matches the recv on peer with the same tag (>= 0); messages between
 * two ranks with the same tag arrive in the order they were sent.  A recv
 * fails if the message does not hold exactly count elements. */
ct_status ct_group_send(ct_group *g, const void *buf, int64_t count, ct_dtype dt, int peer,
                        int tag, ct_work **work);
ct_status ct_group_recv(ct_group *g, void *buf, int64_t count, ct_dtype dt, int peer, int tag,
                        ct_work **work);

/* ---- tensor forms (whole tensor, its dtype) ---------------------------- */

ct_status ct_group_allreduce_tensor(ct_group *g, ct_tensor *t, ct_reduce_op op, ct_work **work);
ct_status ct_group_broadcast_tensor(ct_group *g, ct_tensor *t, int root, ct_work **work);

/* ---- work handles ----------------------------------------------------- */

/* Called once when the operation completes, with its status. */
typedef void (*ct_work_fn)(ct_work *w, ct_status status, void *arg);

/* Blocks (the calling thread sleeps; the comm thread polls for it, see
 * ct_comm_set_wait_spin_us) until w completes and its callback has run; returns its status (message set in the calling thread).  May be
 * called again; the result does not change. */
ct_status ct_work_wait(ct_work *w);
/* Waits for n handles in order (NULL entries skipped); returns the first failure. */
ct_status ct_work_wait_all(ct_work **w, int n);
/* 1 if w has completed (its callback has run), else 0; never blocks. */
int ct_work_test(const ct_work *w);
/* Sets w's completion callback (one per handle; CT_ESTATE on a second).  It
 * runs on the comm thread when the operation completes, or at once on the
 * calling thread if w has already completed.  It must be short and must not
 * wait on work; it may start new operations. */
ct_status ct_work_on_complete(ct_work *w, ct_work_fn fn, void *arg);
/* Releases the handle.  If the operation is still running it completes in
 * the background (its callback still runs) and its buffers must stay valid
 * until then.  NULL is a no-op. */
void ct_work_destroy(ct_work *w);

/* ---- tuning and introspection -----------------------------------------
 * Defaults come from bench/comm_overlap on 2 ranks.  ct_comm_init also sets
 * OMPI_MCA_coll_libnbc_iallreduce_algorithm=1 (ring) unless it is set. */

/* MPI thread level MPI granted ("MPI_THREAD_MULTIPLE", ...). */
const char *ct_comm_thread_level(void);
/* Microseconds the comm thread sleeps between polls while operations are in
 * flight and none moved (default 20, or CTRAIN_COMM_POLL_US; 0 yields
 * instead of sleeping).  While nothing moves the sleep doubles every 8 polls
 * up to the maximum (default 500, or CTRAIN_COMM_POLL_MAX_US), so waiting
 * for a late peer costs little CPU and adds at most that much latency. */
void ct_comm_set_poll_us(int us);
int ct_comm_get_poll_us(void);
void ct_comm_set_poll_max_us(int us);
int ct_comm_get_poll_max_us(void);
/* Microseconds the comm thread polls without napping after a caller starts
 * to wait in ct_work_wait (default 10000, or CTRAIN_COMM_WAIT_SPIN_US; 0
 * never): the caller's core is idle then, and a message or peer arriving
 * during that time is seen at once instead of after a nap of up to the
 * maximum.  Costs that core's time while the wait lasts, up to this long. */
void ct_comm_set_wait_spin_us(int us);
int ct_comm_get_wait_spin_us(void);
/* Collectives of one group that run in MPI at once (default 2, or
 * CTRAIN_COMM_MAX_RUNNING; 0 = no limit).  Later ones wait in order and
 * start as earlier ones finish: large collectives running together compete
 * for memory bandwidth and cache (8 x 4 MiB allreduces on 2 ranks take
 * ~11 ms with 2 at a time, ~18 ms all at once). */
void ct_comm_set_max_running(int n);
int ct_comm_get_max_running(void);
/* Seconds a collective (or a blocking group call) may take from its start
 * before it ends the job (default 300, or CTRAIN_COMM_TIMEOUT; 0 never).
 * Then every rank logs "comm timeout: allreduce #12 on group world (...)"
 * (the operation, its number among the group's collectives counted from 1,
 * and the group: "world", or "world/split1.color0" for the first split of
 * the world, color 0) and the job ends (MPI_Abort): a rank that never
 * starts a collective, or starts a group's collectives in another order,
 * is an error on every rank, not a silent hang.  Point-to-point transfers
 * have no timeout (a pipeline stage may wait long for its input). */
void ct_comm_set_timeout(double seconds);
double ct_comm_get_timeout(void);
/* Fake node boundaries, to test multi-node paths on one machine: with K > 0
 * every machine's ranks count as K nodes of contiguous world ranks (rank r
 * of a world of P is on node r*K/P: 4 ranks, K=2: ranks 0,1 on node 0 and
 * 2,3 on node 1; sizes differ by one when K does not divide P; K >= P: one
 * rank per node).  Everything that asks "which node" follows: local
 * rank/size, shared-memory windows (never across nodes), two-level
 * collectives.  Read from CTRAIN_FAKE_NODES at ct_comm_init (default 0:
 * real nodes only), which fixes the world group's nodes; the setter changes
 * it for groups split afterwards.  Must be the same on every rank. */
void ct_comm_set_fake_nodes(int k);
int ct_comm_get_fake_nodes(void);

#ifdef __cplusplus
}
#endif
#endif

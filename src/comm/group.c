/*
 * Start-up and shut-down of MPI, process groups (the world and sub-groups
 * split from it), barrier, agreement on errors across ranks, job abort,
 * and the conversion of MPI error codes into ct_status messages.
 *
 * MPI is initialised on the comm thread (engine.c), which then makes every
 * MPI call; the functions here build works and submit them to it.
 */
#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static struct {
    int inited;    /* between ct_comm_init and ct_comm_finalize */
    int finalized; /* MPI finalised by us: cannot start again */
    int owns_mpi;  /* we called MPI_Init_thread, so we finalise */
    int provided;  /* thread level granted */
    int tag_ub;
    int *argc;
    char ***argv;
    ct_group world;
} S;

/* ---- errors ------------------------------------------------------------ */

ct_status ct__mpi_fail(int rc, const char *what)
{
    char es[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    if (MPI_Error_string(rc, es, &len) != MPI_SUCCESS || len == 0)
        snprintf(es, sizeof es, "MPI error code %d", rc);
    return ct_error(CT_ECOMM, "%s failed on rank %d: %s; if another rank failed first, its log "
                              "says why",
                    what, S.world.rank, es);
}

int ct__tag_ub(void) { return S.tag_ub; }

/* ---- start-up ---------------------------------------------------------- */

/* ---- nodes ------------------------------------------------------------- */

static _Atomic int fake_nodes = -1;
static int real_node; /* the lowest world rank on this rank's machine (set at start-up) */

void ct_comm_set_fake_nodes(int k) { atomic_store(&fake_nodes, k < 0 ? 0 : k); }

int ct_comm_get_fake_nodes(void)
{
    int k = atomic_load(&fake_nodes);
    return k < 0 ? 0 : k;
}

/* Collective over the world: which machine this rank is on, by the lowest
 * world rank that shares its memory. */
static ct_status find_real_node(void)
{
    MPI_Comm local = MPI_COMM_NULL;
    int rc, wr = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    if ((rc = MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, wr, MPI_INFO_NULL,
                                  &local)) != MPI_SUCCESS ||
        (rc = MPI_Allreduce(&wr, &real_node, 1, MPI_INT, MPI_MIN, local)) != MPI_SUCCESS) {
        if (local != MPI_COMM_NULL) MPI_Comm_free(&local);
        return ct__mpi_fail(rc, "MPI_Comm_split_type (finding the ranks on this node)");
    }
    MPI_Comm_free(&local);
    return CT_OK;
}

/* The node this rank is on, as a split color: its machine, cut into K
 * blocks of contiguous world ranks with CTRAIN_FAKE_NODES=K. */
static int node_color(void)
{
    int k = ct_comm_get_fake_nodes(), wr = 0, ws = 1;
    if (k <= 0) return real_node;
    MPI_Comm_rank(MPI_COMM_WORLD, &wr);
    MPI_Comm_size(MPI_COMM_WORLD, &ws);
    if (k > ws) k = ws;
    return real_node * k + (int)((int64_t)wr * k / ws);
}

/* An internal group over comm (one node's ranks, or the leaders). */
static ct_status internal_group(MPI_Comm comm, const char *name, const char *suffix,
                                ct_group **out)
{
    ct_group *n = ct_alloc_zeroed(sizeof *n, CT_MEM_OTHER);
    if (!n) {
        MPI_Comm_free(&comm);
        return CT_ENOMEM;
    }
    memset(n, 0, sizeof *n);
    n->comm = comm;
    n->ring = MPI_COMM_NULL;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &n->rank);
    MPI_Comm_size(comm, &n->size);
    n->local_rank = n->rank;
    n->local_size = n->size;
    n->nnodes = 1;
    snprintf(n->name, sizeof n->name, "%.80s%s", name, suffix);
    *out = n;
    return CT_OK;
}

static void free_internal(ct_group **n)
{
    if (!*n) return;
    MPI_Comm_free(&(*n)->comm);
    ct_free(*n);
    *n = NULL;
}

static ct_status setup_nodes(ct_group *g, MPI_Comm comm);

ct_status ct__group_setup(ct_group *g, MPI_Comm comm)
{
    g->ring = MPI_COMM_NULL;
    CT_TRY(setup_nodes(g, comm));
    int rc = MPI_Comm_dup(comm, &g->ring);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(g->ring, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
        if (g->ring != MPI_COMM_NULL) MPI_Comm_free(&g->ring);
        free_internal(&g->node);
        free_internal(&g->leaders);
        ct_free(g->node_of);
        g->node_of = NULL;
        return ct__mpi_fail(rc, "MPI_Comm_dup (the group's own point-to-point channel)");
    }
    return CT_OK;
}

/* comm's rank and size, and the nodes it spans (g->node, leaders, node_of). */
static ct_status setup_nodes(ct_group *g, MPI_Comm comm)
{
    int rc;
    MPI_Comm local = MPI_COMM_NULL, lead = MPI_COMM_NULL;
    g->comm = comm;
    g->node = g->leaders = NULL;
    g->node_of = NULL;
    if ((rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN)) != MPI_SUCCESS ||
        (rc = MPI_Comm_rank(comm, &g->rank)) != MPI_SUCCESS ||
        (rc = MPI_Comm_size(comm, &g->size)) != MPI_SUCCESS)
        return ct__mpi_fail(rc, "setting up a communicator");
    /* The ranks of g on this rank's node, and how many nodes g spans. */
    int first = 0;
    if ((rc = MPI_Comm_split(comm, node_color(), g->rank, &local)) != MPI_SUCCESS ||
        (rc = MPI_Comm_rank(local, &g->local_rank)) != MPI_SUCCESS ||
        (rc = MPI_Comm_size(local, &g->local_size)) != MPI_SUCCESS ||
        (first = g->local_rank == 0,
         rc = MPI_Allreduce(&first, &g->nnodes, 1, MPI_INT, MPI_SUM, comm)) != MPI_SUCCESS) {
        if (local != MPI_COMM_NULL) MPI_Comm_free(&local);
        return ct__mpi_fail(rc, "MPI_Comm_split (finding the ranks on this node)");
    }
    if (g->nnodes == 1) {
        MPI_Comm_free(&local);
        return CT_OK;
    }
    /* Spanning nodes: keep this node's ranks, and the nodes' first ranks, as
     * groups of their own for two-level collectives. */
    if ((rc = MPI_Comm_split(comm, first ? 0 : MPI_UNDEFINED, g->rank, &lead)) != MPI_SUCCESS) {
        MPI_Comm_free(&local);
        return ct__mpi_fail(rc, "MPI_Comm_split (the group of node leaders)");
    }
    /* Each rank's node, numbered in the leaders' order: every rank learns
     * its node's first rank in g, and the leaders are those first ranks. */
    int lead_rank = 0, *lead_of = ct_alloc((size_t)g->size * sizeof(int), CT_MEM_OTHER);
    g->node_of = ct_alloc((size_t)g->size * sizeof(int), CT_MEM_OTHER);
    MPI_Group gg = MPI_GROUP_NULL, lg = MPI_GROUP_NULL;
    int zero = 0;
    if (!lead_of || !g->node_of) rc = MPI_ERR_NO_MEM;
    else if ((rc = MPI_Comm_group(comm, &gg)) == MPI_SUCCESS &&
             (rc = MPI_Comm_group(local, &lg)) == MPI_SUCCESS &&
             (rc = MPI_Group_translate_ranks(lg, 1, &zero, gg, &lead_rank)) == MPI_SUCCESS)
        rc = MPI_Allgather(&lead_rank, 1, MPI_INT, lead_of, 1, MPI_INT, comm);
    if (gg != MPI_GROUP_NULL) MPI_Group_free(&gg);
    if (lg != MPI_GROUP_NULL) MPI_Group_free(&lg);
    if (rc == MPI_SUCCESS) {
        /* node number of leader rank l: leaders below it; g->node_of as scratch */
        for (int r = 0; r < g->size; r++) g->node_of[r] = 0;
        for (int r = 0; r < g->size; r++) g->node_of[lead_of[r]] = 1;
        for (int r = 0, n = 0; r < g->size; r++) {
            int is = g->node_of[r];
            g->node_of[r] = n;
            n += is;
        }
        for (int r = 0; r < g->size; r++) lead_of[r] = g->node_of[lead_of[r]];
        for (int r = 0; r < g->size; r++) g->node_of[r] = lead_of[r];
    }
    ct_free(lead_of);
    if (rc != MPI_SUCCESS) {
        ct_free(g->node_of);
        g->node_of = NULL;
        MPI_Comm_free(&local);
        if (lead != MPI_COMM_NULL) MPI_Comm_free(&lead);
        return rc == MPI_ERR_NO_MEM ? ct_error(CT_ENOMEM, "group set-up: out of memory for the "
                                                          "node map")
                                    : ct__mpi_fail(rc, "MPI_Allgather (the ranks' nodes)");
    }
    ct_status s = internal_group(local, g->name, ".node", &g->node);
    if (s == CT_OK && first) s = internal_group(lead, g->name, ".leaders", &g->leaders);
    else if (lead != MPI_COMM_NULL) MPI_Comm_free(&lead);
    if (s != CT_OK) {
        free_internal(&g->node);
        ct_free(g->node_of);
        g->node_of = NULL;
    }
    return s;
}

int ct__node_layout(const ct_group *g, int64_t count, int **cntp, int **dspp, int64_t **posp)
{
    CT_ASSERT((int64_t)g->size * count <= INT_MAX);
    int *cnt = *cntp = ct_alloc((size_t)g->nnodes * sizeof(int), CT_MEM_OTHER);
    int *dsp = *dspp = ct_alloc((size_t)g->nnodes * sizeof(int), CT_MEM_OTHER);
    int64_t *pos = *posp = ct_alloc((size_t)g->size * sizeof(int64_t), CT_MEM_OTHER);
    if (!cnt || !dsp || !pos) return -1;
    int rank_order = 1;
    for (int n = 0; n < g->nnodes; n++) cnt[n] = 0;
    for (int r = 0; r < g->size; r++) {
        cnt[g->node_of[r]] += (int)count;
        /* nodes are numbered by their first rank: non-decreasing = contiguous */
        if (r > 0 && g->node_of[r] < g->node_of[r - 1]) rank_order = 0;
    }
    for (int n = 0, at = 0; n < g->nnodes; n++) {
        dsp[n] = at;
        at += cnt[n];
    }
    int next[g->nnodes];
    for (int n = 0; n < g->nnodes; n++) next[n] = dsp[n];
    for (int r = 0; r < g->size; r++) {
        pos[r] = next[g->node_of[r]];
        next[g->node_of[r]] += (int)count;
    }
    return rank_order;
}

ct_status ct__group_free_comms(ct_group *g)
{
    free_internal(&g->node);
    free_internal(&g->leaders);
    ct_free(g->node_of);
    g->node_of = NULL;
    if (g->ring != MPI_COMM_NULL) MPI_Comm_free(&g->ring);
    int rc = MPI_Comm_free(&g->comm);
    return rc == MPI_SUCCESS ? CT_OK : ct__mpi_fail(rc, "MPI_Comm_free");
}

static const char *level_name(int level)
{
    switch (level) {
    case MPI_THREAD_SINGLE: return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED: return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED: return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE: return "MPI_THREAD_MULTIPLE";
    }
    return "unknown";
}

const char *ct_comm_thread_level(void) { return S.inited ? level_name(S.provided) : "none"; }

/* Runs on the comm thread before anything else. */
static ct_status comm_start(void)
{
    int rc, inited = 0, fin = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (fin)
        return ct_error(CT_ESTATE, "MPI was already finalised in this process; call "
                                   "ct_comm_init before anything finalises MPI");
    if (!inited) {
        /* Open MPI's nonblocking allreduce (libnbc) picks, for in-place calls
         * and fewer than 4 ranks, a binomial tree: one rank does every sum
         * and the data crosses twice.  A ring spreads the sums and moves
         * each byte once; on 2 ranks it halves the time of an 8 x 4 MiB
         * allreduce (bench/comm_overlap).  The user's own setting wins. */
        setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", 0);
        /* Its nonblocking reduce picks, on 2 ranks for 64 KiB and more, a
         * chain of 8 KiB segments that moves only when the comm thread polls:
         * a 4 MiB gradient to its ZeRO-2 owner took 9-10 ms; binomial takes
         * 2.4-3 ms (bench/zero). */
        setenv("OMPI_MCA_coll_libnbc_ireduce_algorithm", "2", 0);
        /* Without /sys (containers, chroots) hwloc prints a topology warning
         * per process on every start; it changes nothing for us, and it
         * would bury ctrain's own one-line errors. */
        setenv("HWLOC_HIDE_ERRORS", "2", 0);
        rc = MPI_Init_thread(S.argc, S.argv, MPI_THREAD_MULTIPLE, &S.provided);
        if (rc != MPI_SUCCESS)
            return ct_error(CT_ECOMM, "MPI_Init_thread failed (code %d); check that Open MPI works "
                                      "(mpirun -np 2 hostname)", rc);
        S.owns_mpi = 1;
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    } else {
        MPI_Query_thread(&S.provided);
        /* Only this thread calls MPI from now on, but the program's own
         * thread initialised it: that needs at least SERIALIZED. */
        if (S.provided < MPI_THREAD_SERIALIZED)
            return ct_error(CT_EUNSUPPORTED, "MPI was initialised with %s, but ctrain calls MPI "
                                             "from its communication thread; initialise with "
                                             "MPI_Init_thread(MPI_THREAD_MULTIPLE) or let "
                                             "ct_comm_init do it",
                            level_name(S.provided));
    }
    MPI_Comm dup;
    ct_status s;
    if ((s = ct__fp_init(MPI_COMM_WORLD)) != CT_OK) goto out_finalize;
    if (atomic_load(&fake_nodes) < 0) {
        const char *e = getenv("CTRAIN_FAKE_NODES");
        ct_comm_set_fake_nodes(e ? atoi(e) : 0);
    }
    if ((s = find_real_node()) != CT_OK) goto out_finalize;
    if ((rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup)) != MPI_SUCCESS) {
        s = ct__mpi_fail(rc, "MPI_Comm_dup(MPI_COMM_WORLD)");
        goto out_finalize;
    }
    S.world.is_world = 1;
    snprintf(S.world.name, sizeof S.world.name, "world");
    if ((s = ct__group_setup(&S.world, dup)) != CT_OK) goto out_free_world;
    void *ub = NULL;
    int flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    S.tag_ub = flag && ub ? *(int *)ub : 32767;
    if ((s = ct__dtypes_create()) != CT_OK) goto out_free_types;
    if ((s = ct__watch_start(MPI_COMM_WORLD)) != CT_OK) goto out_free_types;
    return CT_OK;

out_free_types:
    ct__dtypes_free();
out_free_world:
    ct__group_free_comms(&S.world);
out_finalize:
    if (S.owns_mpi) {
        MPI_Finalize();
        S.finalized = 1;
    }
    return s;
}

/* Runs on the comm thread last. */
static void comm_stop(void)
{
    ct__watch_stop();
    ct__dtypes_free();
    ct__group_free_comms(&S.world);
    if (S.owns_mpi) MPI_Finalize();
}

ct_status ct_comm_init(int *argc, char ***argv)
{
    if (S.inited) return CT_OK;
    if (S.finalized)
        return ct_error(CT_ESTATE, "ct_comm_init after ct_comm_finalize: MPI cannot restart in "
                                   "the same process; finalise only at the end of the program");
    S.argc = argc;
    S.argv = argv;
    CT_TRY(ct__engine_start(comm_start, comm_stop));
    S.inited = 1;
    ct_log_set_rank(S.world.rank, S.world.size);
    /* A library user whose OpenBLAS picked a slow kernel learns how to fix it
     * (the ctrain program fixes it itself with ct_blas_select_kernel). */
    ct_blas_warn_if_slow();
    ct_log(CT_LOG_DEBUG, "comm: %d ranks, %d on this node, %s, poll %d us", S.world.size,
           S.world.local_size, level_name(S.provided), ct_comm_get_poll_us());
    return CT_OK;
}

int ct_comm_initialized(void) { return S.inited; }

/* ---- groups ------------------------------------------------------------ */

ct_group *ct_group_world(void) { return S.inited ? &S.world : NULL; }

int ct_group_rank(const ct_group *g)
{
    CT_ASSERT(g);
    return g->rank;
}

int ct_group_size(const ct_group *g)
{
    CT_ASSERT(g);
    return g->size;
}

int ct_group_local_rank(const ct_group *g)
{
    CT_ASSERT(g);
    return g->local_rank;
}

int ct_group_local_size(const ct_group *g)
{
    CT_ASSERT(g);
    return g->local_size;
}

int ct_group_node(const ct_group *g)
{
    CT_ASSERT(g);
    return g->node_of ? g->node_of[g->rank] : 0;
}

int ct_group_num_nodes(const ct_group *g)
{
    CT_ASSERT(g);
    return g->nnodes;
}

/* Split: MPI has no nonblocking MPI_Comm_split, so start makes the call. */
typedef struct {
    ct_work w;
    int color, key;
    ct_group *ng; /* filled in; its comm stays MPI_COMM_NULL if this rank joins none */
} split_op;

static int split_start(ct_work *w)
{
    split_op *o = (split_op *)w;
    MPI_Comm nc = MPI_COMM_NULL;
    int rc = MPI_Comm_split(w->g->comm, o->color < 0 ? MPI_UNDEFINED : o->color, o->key, &nc);
    if (rc != MPI_SUCCESS) return ct__op_fail(w, ct__mpi_fail(rc, "MPI_Comm_split"));
    if (nc == MPI_COMM_NULL) return CT__DONE;
    ct_status s = ct__group_setup(o->ng, nc);
    if (s != CT_OK) {
        MPI_Comm_free(&o->ng->comm);
        o->ng->comm = MPI_COMM_NULL;
        return ct__op_fail(w, s);
    }
    return CT__DONE;
}

static const ct__op_vt split_vt = {.name = "split", .flags = CT__OP_ORDERED | CT__OP_BLOCKING,
                                   .start = split_start};

ct_status ct_group_split(ct_group *g, int color, int key, ct_group **out)
{
    if (!g || !out)
        return ct_error(CT_EINVAL, "ct_group_split: %s is NULL", g ? "out" : "group");
    *out = NULL;
    ct_group *ng = ct_alloc_zeroed(sizeof *ng, CT_MEM_OTHER);
    if (!ng) return CT_ENOMEM;
    memset(ng, 0, sizeof *ng);
    ng->comm = ng->ring = MPI_COMM_NULL;
    split_op *o = ct__work_new(g, &split_vt, sizeof *o);
    if (!o) {
        ct_free(ng);
        return CT_ENOMEM;
    }
    o->color = color;
    o->key = key;
    o->ng = ng;
    snprintf(ng->name, sizeof ng->name, "%.60s/split%d.color%d", g->name, ++g->nsplit, color);
    ct_status s = ct__submit_wait(&o->w);
    ct__work_destroy(&o->w);
    if (s != CT_OK || ng->comm == MPI_COMM_NULL) {
        ct_free(ng);
        return s;
    }
    ct__group_register(ng);
    *out = ng;
    return CT_OK;
}

static int barrier_start(ct_work *w)
{
    return ct__op_mpi(w, MPI_Ibarrier(w->g->comm, &w->req), "MPI_Ibarrier");
}

static const ct__op_vt barrier_vt = {.name = "barrier", .flags = CT__OP_ORDERED,
                                     .start = barrier_start};

ct_status ct_group_barrier(ct_group *g)
{
    if (!g) return ct_error(CT_EINVAL, "ct_group_barrier: group is NULL");
    ct_work *w = ct__work_new(g, &barrier_vt, sizeof *w);
    if (!w) return CT_ENOMEM;
    return ct__submit(w, NULL);
}

ct_status ct_group_check(ct_group *g, ct_status local)
{
    if (!g) return ct_error(CT_EINVAL, "ct_group_check: group is NULL");
    char mine[400];
    snprintf(mine, sizeof mine, "%s", local != CT_OK ? ct_last_error() : "");
    int32_t first = local != CT_OK ? g->rank : INT32_MAX;
    CT_TRY(ct_group_allreduce(g, &first, 1, CT_I32, CT_OP_MIN, NULL));
    if (first == INT32_MAX) return CT_OK;
    /* Everyone now knows the lowest failing rank; it tells them why. */
    struct {
        int32_t status, world_rank;
        char msg[400];
    } m = {local, S.world.rank, ""};
    snprintf(m.msg, sizeof m.msg, "%s", mine);
    CT_TRY(ct_group_broadcast(g, &m, (int64_t)sizeof m, CT_U8, (int)first, NULL));
    if (g->rank == first) return ct_error(local, "%s", mine);
    m.msg[sizeof m.msg - 1] = 0;
    if (m.status >= 0) m.status = CT_EINVAL;
    if (g->is_world) return ct_error(m.status, "rank %d failed: %s", (int)first, m.msg);
    return ct_error(m.status, "rank %d of the group (world rank %d) failed: %s", (int)first,
                    m.world_rank, m.msg);
}

static int free_start(ct_work *w)
{
    ct_status s = ct__group_free_comms(w->g);
    return s == CT_OK ? CT__DONE : ct__op_fail(w, s);
}

static const ct__op_vt free_vt = {.name = "MPI_Comm_free", .start = free_start};

static void free_group(ct_group *g)
{
    ct__group_quiesce(g);
    ct__shm_release(g);
    ct_work *w = ct__work_new(g, &free_vt, sizeof *w);
    if (!w || ct__submit(w, NULL) != CT_OK)
        ct_log(CT_LOG_WARN, "freeing a group: %s", ct_last_error());
    ct_free(g);
}

void ct_group_destroy(ct_group *g)
{
    if (!g || g->is_world) return;
    CT_ASSERT(!ct__on_comm_thread()); /* would wait on itself */
    ct__group_unregister(g);
    free_group(g);
}

ct_status ct_comm_finalize(void)
{
    if (!S.inited) return CT_OK;
    CT_ASSERT(!ct__on_comm_thread());
    const char *who = NULL;
    int holds = ct__comm_holds(&who);
    if (holds > 0)
        return ct_error(CT_ESTATE, "ct_comm_finalize: %d object%s still communicate%s (the last made: %s); "
                        "destroy %s first (ct_strategy_destroy), then finalize",
                        holds, holds == 1 ? "" : "s", holds == 1 ? "s" : "", who ? who : "?",
                        holds == 1 ? "it" : "them");
    if (ct__fp_on() && S.world.size > 1) {
        /* Its fingerprint meets whatever collective a peer is still in. */
        const char *prev = ct_comm_enter_call("ct_comm_finalize");
        ct_status st = ct_group_barrier(&S.world);
        ct_comm_leave_call(prev);
        if (st != CT_OK) return st;
    }
    ct_group *g;
    while ((g = ct__group_pop())) free_group(g);
    ct__group_quiesce(&S.world);
    ct__shm_release(&S.world);
    ct__engine_stop();
    S.inited = 0;
    S.finalized = S.owns_mpi;
    ct_log_set_rank(0, 1);
    return CT_OK;
}

void ct_comm_abort(const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int inited = 0, fin = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    int rank = S.inited ? S.world.rank : 0;
    ct_log(CT_LOG_ERROR, "rank %d: %s", rank, msg);
    fflush(stderr);
    if (inited && !fin) MPI_Abort(MPI_COMM_WORLD, 1);
    abort();
}

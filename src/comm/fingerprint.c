/*
 * Collective fingerprints (CTRAIN_DEBUG=collectives): before a collective
 * starts, its ranks all-gather what each is about to do (group, operation,
 * dtype, count, root, reduction, sequence number).  The first difference
 * ends the job naming both ranks and both operations, where without it
 * ranks would wait in different calls until the timeout or reduce
 * mismatched buffers into wrong sums.  The fingerprint's all-gather is the
 * same call on every rank whatever the collective, so it always matches;
 * collectives run one at a time per group while it is on, so the MPI calls
 * of fingerprints and operations keep one order on every rank.  Whether it
 * is on is agreed at start-up (any rank asking turns it on for all), so a
 * variable set on some ranks only cannot split the job.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* F_CALL0..: the public ctrain call that issued the collective (ct_comm_enter_call), up
 * to 31 characters: ranks in different calls is the mistake users make, and the
 * message then names the calls, not only the collectives inside them. */
enum { F_SEQ, F_GROUP, F_DTYPE, F_COUNT, F_ROOT, F_REDOP, F_KIND0, F_KIND1, F_CALL0, F_CALL3 = F_CALL0 + 3, F_N };

static int fp_on;

int ct__fp_on(void) { return fp_on; }

int ct_comm_debug_collectives(void) { return fp_on; }

ct_status ct__fp_init(MPI_Comm world)
{
    const char *e = getenv("CTRAIN_DEBUG");
    int mine = e && strstr(e, "collectives") != NULL, any = 0;
    int rc = MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, world);
    if (rc != MPI_SUCCESS) return ct__mpi_fail(rc, "MPI_Allreduce (CTRAIN_DEBUG agreement)");
    fp_on = any;
    return CT_OK;
}

void ct__work_describe(ct_work *w, int dtype, int64_t count, int root, int redop)
{
    w->fp_dtype = dtype;
    w->fp_count = count;
    w->fp_root = root;
    w->fp_redop = redop;
    ct__tally_add(w, dtype, count);
}

static uint64_t hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

int ct__fp_start(ct_work *w)
{
    ct_group *g = w->g;
    w->fp_all = ct_alloc(sizeof(int64_t) * F_N * (size_t)(g->size + 1), CT_MEM_COMM);
    if (!w->fp_all) return ct__op_fail(w, ct_error(CT_ENOMEM, "out of memory for a collective's fingerprint"));
    int64_t *me = w->fp_all + (size_t)F_N * (size_t)g->size;
    memset(me, 0, sizeof(int64_t) * F_N);
    me[F_SEQ] = (int64_t)w->seq;
    me[F_GROUP] = (int64_t)hash(g->name);
    me[F_DTYPE] = w->fp_dtype;
    me[F_COUNT] = w->fp_count;
    me[F_ROOT] = w->fp_root;
    me[F_REDOP] = w->fp_redop;
    strncpy((char *)&me[F_KIND0], w->vt->name, 2 * sizeof(int64_t) - 1);
    if (w->call) strncpy((char *)&me[F_CALL0], w->call, 4 * sizeof(int64_t) - 1);
    w->fp_phase = 1;
    return ct__op_mpi(w, MPI_Iallgather(me, F_N, MPI_INT64_T, w->fp_all, F_N, MPI_INT64_T, g->comm, &w->req),
                      "MPI_Iallgather (collective fingerprint)");
}

/* "allreduce(f32, 1024 elements, sum) #5" */
static void describe(const int64_t *f, char *buf, size_t n)
{
    char kind[2 * sizeof(int64_t) + 1] = {0};
    memcpy(kind, &f[F_KIND0], 2 * sizeof(int64_t));
    int at = snprintf(buf, n, "%s(", kind);
    if (f[F_DTYPE] >= 0 && f[F_DTYPE] < CT_NDTYPE)
        at += snprintf(buf + at, n - (size_t)at, "%s, ", ct_dtype_name((ct_dtype)f[F_DTYPE]));
    at += snprintf(buf + at, n - (size_t)at, "%lld elements", (long long)f[F_COUNT]);
    if (f[F_ROOT] >= 0) at += snprintf(buf + at, n - (size_t)at, ", root %lld", (long long)f[F_ROOT]);
    if (f[F_REDOP] >= 0) at += snprintf(buf + at, n - (size_t)at, ", %s", ct__op_name((ct_reduce_op)f[F_REDOP]));
    at += snprintf(buf + at, n - (size_t)at, ") #%lld", (long long)f[F_SEQ]);
    char call[4 * sizeof(int64_t) + 1] = {0};
    memcpy(call, &f[F_CALL0], 4 * sizeof(int64_t));
    if (call[0]) snprintf(buf + at, n - (size_t)at, " in %s", call);
}

int ct__fp_check(ct_work *w)
{
    ct_group *g = w->g;
    const int64_t *all = w->fp_all;
    w->fp_phase = 0;
    int bad = -1;
    for (int r = 1; r < g->size && bad < 0; r++)
        if (memcmp(all, all + (size_t)F_N * (size_t)r, sizeof(int64_t) * F_N)) bad = r;
    if (bad < 0) {
        ct_free(w->fp_all);
        w->fp_all = NULL;
        return 0;
    }
    if (g->rank != 0) return 1; /* rank 0 of the group ends the job and says why; wait for it */
    char a[200], b[200], msg[1000];
    describe(all, a, sizeof a);
    describe(all + (size_t)F_N * (size_t)bad, b, sizeof b);
    const int64_t *fb = all + (size_t)F_N * (size_t)bad;
    int calls_differ = memcmp(&all[F_CALL0], &fb[F_CALL0], 4 * sizeof(int64_t)) != 0;
    snprintf(msg, sizeof msg, "collective mismatch on group %s: rank 0 called %s but rank %d called %s; every rank "
             "must make the same collective calls in the same order%s (found by CTRAIN_DEBUG=collectives)",
             g->name, a, bad, b,
             calls_differ ? ": the ranks are in different ctrain calls, so one was made on some ranks only "
                            "(collective ctrain calls go on every rank, not under if (rank == 0))" : "");
    ct__watch_expired(msg);
}

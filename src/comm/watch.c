/*
 * Bounded waits: a collective that has not completed CTRAIN_COMM_TIMEOUT
 * seconds (default 300) after it started ends the job, with a message that
 * names the operation, its number in its group and the group, on every rank
 * - never a silent hang.
 *
 * The engine (engine.c) notices the expired collective on its comm thread
 * and calls ct__watch_expired.  MPI_Abort alone would end the job, but only
 * the rank that called it would say why, and the rank that never joined the
 * collective (the one to look at) would be killed silently.  So each process
 * keeps a receive posted on a private duplicate of the world communicator;
 * the rank whose collective expired sends its message there to every other
 * rank, whose comm thread (polling it every round, and at least every 100 ms
 * when idle) logs it and answers; once all have answered, or after a few
 * seconds, it calls MPI_Abort.  A rank whose comm thread is stuck (a blocking
 * call without MPI_THREAD_MULTIPLE) cannot answer: the job still ends, that
 * rank silently.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

enum { TAG_NOTICE = 1, TAG_ACK = 2, NOTICE_LEN = 1024 };

#define ACK_SECONDS 5.0   /* how long the first rank waits for the others' answers */
#define KILL_SECONDS 15.0 /* how long a notified rank waits to be ended */

static struct {
    MPI_Comm ctl; /* MPI_COMM_NULL when not running */
    MPI_Request rreq;
    char rbuf[NOTICE_LEN];
    int rank, size;
    double timeout; /* seconds; 0: none */
} X = {.ctl = MPI_COMM_NULL, .rreq = MPI_REQUEST_NULL, .timeout = -1};

static void post_recv(void)
{
    MPI_Irecv(X.rbuf, NOTICE_LEN, MPI_CHAR, MPI_ANY_SOURCE, TAG_NOTICE, X.ctl, &X.rreq);
}

ct_status ct__watch_start(MPI_Comm world)
{
    if (X.timeout < 0) {
        const char *e = getenv("CTRAIN_COMM_TIMEOUT");
        ct_comm_set_timeout(e ? atof(e) : 300);
    }
    MPI_Comm_rank(world, &X.rank);
    MPI_Comm_size(world, &X.size);
    if (X.size == 1) return CT_OK;
    int rc = MPI_Comm_dup(world, &X.ctl);
    if (rc != MPI_SUCCESS) return ct__mpi_fail(rc, "MPI_Comm_dup (the job's notice channel)");
    MPI_Comm_set_errhandler(X.ctl, MPI_ERRORS_RETURN);
    post_recv();
    return CT_OK;
}

void ct__watch_stop(void)
{
    if (X.ctl == MPI_COMM_NULL) return;
    if (X.rreq != MPI_REQUEST_NULL) {
        MPI_Cancel(&X.rreq);
        MPI_Wait(&X.rreq, MPI_STATUS_IGNORE);
    }
    MPI_Comm_free(&X.ctl);
}

double ct__watch_timeout(void) { return X.timeout < 0 ? 300 : X.timeout; }

void ct_comm_set_timeout(double seconds) { X.timeout = seconds > 0 ? seconds : 0; }

double ct_comm_get_timeout(void) { return ct__watch_timeout(); }

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A notice arrived (in X.rbuf, from src): answers it and re-posts the receive. */
static void answer(int src)
{
    char ack = 1;
    MPI_Send(&ack, 1, MPI_CHAR, src, TAG_ACK, X.ctl);
    post_recv();
}

/* Returns the source of a notice that has arrived, or -1. */
static int notice_arrived(void)
{
    if (X.rreq == MPI_REQUEST_NULL) return -1;
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&X.rreq, &flag, &st) != MPI_SUCCESS || !flag) return -1;
    X.rbuf[NOTICE_LEN - 1] = 0;
    return st.MPI_SOURCE;
}

void ct__watch_poll(void)
{
    if (X.ctl == MPI_COMM_NULL) return;
    int src = notice_arrived();
    if (src < 0) return;
    const char *call = ct__comm_process_call();
    ct_log(CT_LOG_ERROR, "rank %d: ending the job because rank %d reports: %s", X.rank, src, X.rbuf);
    /* The reporting rank named its call; this one names its own, so the two differ in plain sight. */
    if (call) ct_log(CT_LOG_ERROR, "rank %d: this rank is in %s", X.rank, call);
    fflush(stderr);
    answer(src);
    /* The reporting rank ends the job once the others answered; answer any
     * further reports meanwhile, and end it from here if that never comes. */
    double t0 = ct_now();
    while (ct_now() - t0 < KILL_SECONDS) {
        if ((src = notice_arrived()) >= 0) answer(src);
        sleep_ms(10);
    }
    MPI_Abort(MPI_COMM_WORLD, 1);
    abort();
}

void ct__watch_expired(const char *msg)
{
    ct_log(CT_LOG_ERROR, "rank %d: %s", X.rank, msg);
    fflush(stderr);
    if (X.ctl != MPI_COMM_NULL) {
        char note[NOTICE_LEN];
        snprintf(note, sizeof note, "%s", msg);
        int len = (int)strlen(note) + 1, peers = X.size - 1, acks = 0;
        MPI_Request sreq[X.size], areq = MPI_REQUEST_NULL;
        char abuf;
        for (int r = 0; r < X.size; r++) {
            sreq[r] = MPI_REQUEST_NULL;
            if (r != X.rank) MPI_Isend(note, len, MPI_CHAR, r, TAG_NOTICE, X.ctl, &sreq[r]);
        }
        MPI_Irecv(&abuf, 1, MPI_CHAR, MPI_ANY_SOURCE, TAG_ACK, X.ctl, &areq);
        double t0 = ct_now();
        while (acks < peers && ct_now() - t0 < ACK_SECONDS) {
            int flag = 0, src;
            if (MPI_Test(&areq, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
                acks++;
                if (acks < peers) MPI_Irecv(&abuf, 1, MPI_CHAR, MPI_ANY_SOURCE, TAG_ACK, X.ctl, &areq);
                continue;
            }
            if ((src = notice_arrived()) >= 0) answer(src); /* another rank timed out too */
            sleep_ms(1);
        }
    }
    MPI_Abort(MPI_COMM_WORLD, 1);
    abort();
}

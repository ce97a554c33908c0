/*
 * Which public ctrain call a rank is in, and who still needs communication.
 *
 * Users write ct_strategy_model_state, not allgather: when ranks disagree
 * (a collective call made under `if (rank == 0)`), a message that names
 * only "allgather #8" leaves them guessing.  Public calls that communicate
 * mark the thread (ct_comm_enter_call); the collectives they issue carry
 * the name into the timeout message and the CTRAIN_DEBUG=collectives
 * fingerprint.  And objects that communicate while they live (strategies)
 * hold communication, so ct_comm_finalize refuses to free the groups under
 * them instead of leaving them to crash in their destroy.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "internal.h"

static _Thread_local const char *cur_call;
/* The same, for the comm thread to read when another rank's notice ends the
 * job: the rank then says which call it was in (the other half of the story). */
static _Atomic(const char *) process_call;

const char *ct_comm_enter_call(const char *name)
{
    const char *prev = cur_call;
    if (!prev) cur_call = name; /* nested calls (pipe's replicas) keep the outermost name */
    atomic_store(&process_call, cur_call);
    return prev;
}

void ct_comm_leave_call(const char *prev)
{
    cur_call = prev;
    atomic_store(&process_call, prev);
}

const char *ct__comm_process_call(void) { return atomic_load(&process_call); }

const char *ct_comm_current_call(void) { return cur_call; }

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int nholds;
static const char *last_holder;

void ct_comm_hold(const char *who)
{
    pthread_mutex_lock(&mu);
    nholds++;
    last_holder = who;
    pthread_mutex_unlock(&mu);
}

void ct_comm_unhold(const char *who)
{
    (void)who;
    pthread_mutex_lock(&mu);
    if (nholds > 0) nholds--;
    pthread_mutex_unlock(&mu);
}

int ct__comm_holds(const char **who)
{
    pthread_mutex_lock(&mu);
    int n = nholds;
    *who = last_holder;
    pthread_mutex_unlock(&mu);
    return n;
}

/*
 * Trace events for Chrome's about:tracing / Perfetto ("X" complete events):
 * forward, backward per module, each bucket's allreduce on its own lane, the
 * optimizer.  Events are kept in memory under a mutex (the comm thread
 * records too) and written once at the end.
 */
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ctrain/core.h"

typedef struct {
    char name[48];
    char cat[16];
    double t0, t1;
    int tid;
} event_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static event_t *events;
static size_t nev, cap;
static int enabled, trace_pid;
static double origin;

double ct_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void ct_trace_enable(int pid)
{
    pthread_mutex_lock(&mu);
    enabled = 1;
    trace_pid = pid;
    origin = ct_now();
    pthread_mutex_unlock(&mu);
}

int ct_trace_enabled(void) { return enabled; }

void ct_trace_event(const char *name, const char *cat, double t0, double t1, int tid)
{
    if (!enabled) return;
    pthread_mutex_lock(&mu);
    if (nev == cap) {
        size_t nc = cap ? 2 * cap : 4096;
        event_t *e = ct_alloc_zeroed(nc * sizeof *e, CT_MEM_OTHER);
        if (!e) {
            pthread_mutex_unlock(&mu);
            return; /* tracing is best effort: never fail training for it */
        }
        if (nev) memcpy(e, events, nev * sizeof *e);
        ct_free(events);
        events = e;
        cap = nc;
    }
    event_t *e = &events[nev++];
    snprintf(e->name, sizeof e->name, "%s", name);
    snprintf(e->cat, sizeof e->cat, "%s", cat);
    e->t0 = t0;
    e->t1 = t1;
    e->tid = tid;
    pthread_mutex_unlock(&mu);
}

ct_status ct_trace_write(const char *path)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return ct_error(CT_EIO, "cannot write trace file %s: check the directory exists and is writable", tmp);
    pthread_mutex_lock(&mu);
    fprintf(f, "{\"traceEvents\": [\n");
    fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}},\n",
            trace_pid, trace_pid);
    fprintf(f, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"compute\"}},\n", trace_pid);
    fprintf(f, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":1,\"args\":{\"name\":\"communication\"}}", trace_pid);
    for (size_t i = 0; i < nev; i++) {
        const event_t *e = &events[i];
        fprintf(f, ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.1f,\"dur\":%.1f}",
                e->name, e->cat, trace_pid, e->tid, (e->t0 - origin) * 1e6, (e->t1 - e->t0) * 1e6);
    }
    fprintf(f, "\n]}\n");
    ct_free(events);
    events = NULL;
    nev = cap = 0;
    enabled = 0;
    pthread_mutex_unlock(&mu);
    if (fflush(f) || fsync(fileno(f)) || fclose(f)) {
        remove(tmp);
        return ct_error(CT_EIO, "writing trace file %s failed (disk full?)", tmp);
    }
    if (rename(tmp, path)) {
        remove(tmp);
        return ct_error(CT_EIO, "cannot rename %s to %s", tmp, path);
    }
    return CT_OK;
}

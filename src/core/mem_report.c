/*
 * The per-rank memory report: the allocator's counters (src/core/alloc.c)
 * plus the process's resident set from /proc/self/status, as a plain struct,
 * a table for people and a JSON object for programs; and the phases of the
 * process's life (ct_mem_phase_begin), each with its peak RSS, so the report
 * names the phase of the whole-life peak next to the steady-state window.
 *
 * Peak RSS: Linux keeps the high-water mark VmHWM, and writing "5" to
 * /proc/self/clear_refs resets it to the current RSS.  Every phase change
 * and every ct_mem_reset_peak first folds VmHWM into the peaks it belongs
 * to (the window's, the phase's and the whole life's: VmHWM since the last
 * reset covers the current phase only), then resets it.  So each phase has
 * its own true peak, the window's is the largest over its phases, and the
 * life's is VmHWM as it would read at exit without any reset.  Where the
 * write fails (an old kernel, a locked-down /proc) VmHWM is never reset: the
 * life's peak is still exact, the window's and the phases' are the highest
 * RSS sampled (at each fold), which can miss a spike between samples.
 */
#include "ctrain/core.h"
#include "internal.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

static pthread_mutex_t rss_mu = PTHREAD_MUTEX_INITIALIZER;
static size_t window_peak;              /* the window's peak folded so far */
static size_t life_peak;                /* the whole life's */
static ct_mem_phase life_phase;         /* the phase in which life_peak was reached */
static size_t phase_peak[CT_PHASE_N];   /* each phase's, over all its spans */
static _Atomic int cur_phase;           /* CT_PHASE_START until the first mark */
static int hwm_valid = 1;               /* VmHWM covers the current phase (true from process start) */

/* VmRSS and VmHWM in bytes; 0 for what cannot be read. */
static void read_status(size_t *rss, size_t *hwm)
{
    *rss = *hwm = 0;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return;
    char line[256];
    unsigned long long kb;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) *rss = (size_t)kb << 10;
        else if (sscanf(line, "VmHWM: %llu kB", &kb) == 1) *hwm = (size_t)kb << 10;
    }
    fclose(f);
}

static int clear_hwm(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return 0;
    int ok = fputs("5", f) >= 0;
    ok &= fclose(f) == 0;
    return ok;
}

/* Under rss_mu: the peak since the last reset into the window, the current
 * phase and the life; *rss gets VmRSS now. */
static void fold(size_t *rss)
{
    size_t hwm;
    read_status(rss, &hwm);
    size_t seen = hwm_valid && hwm > *rss ? hwm : *rss;
    ct_mem_phase ph = (ct_mem_phase)atomic_load(&cur_phase);
    if (seen > window_peak) window_peak = seen;
    if (seen > phase_peak[ph]) phase_peak[ph] = seen;
    if (hwm < seen) hwm = seen; /* never reset when clear_refs fails: the life's peak either way */
    if (hwm > life_peak) {
        life_peak = hwm;
        life_phase = ph;
    }
}

/* Under rss_mu: VmHWM restarts at the current RSS. */
static void restart_hwm(void)
{
    if (hwm_valid) hwm_valid = clear_hwm();
}

void ct__rss_reset_peak(void)
{
    pthread_mutex_lock(&rss_mu);
    size_t rss;
    fold(&rss);
    restart_hwm();
    window_peak = rss;
    pthread_mutex_unlock(&rss_mu);
}

void ct_mem_phase_begin(ct_mem_phase p)
{
    CT_ASSERT(p >= 0 && p < CT_PHASE_N);
    if (atomic_load(&cur_phase) == (int)p) return; /* the train loop marks every step */
    pthread_mutex_lock(&rss_mu);
    size_t rss;
    fold(&rss);
    restart_hwm();
    atomic_store(&cur_phase, (int)p);
    if (rss > phase_peak[p]) phase_peak[p] = rss;
    pthread_mutex_unlock(&rss_mu);
}

ct_mem_phase ct_mem_phase_current(void) { return (ct_mem_phase)atomic_load(&cur_phase); }

const char *ct_mem_phase_name(ct_mem_phase p)
{
    static const char *names[] = {"start", "build", "wrap", "load", "train", "eval", "save", "teardown"};
    _Static_assert(sizeof names / sizeof names[0] == CT_PHASE_N, "one name per phase");
    return (p >= 0 && p < CT_PHASE_N) ? names[p] : "?";
}

void ct_mem_report_get(ct_mem_report *r)
{
    memset(r, 0, sizeof *r);
    ct__mem_counters(r);
    pthread_mutex_lock(&rss_mu);
    size_t rss;
    fold(&rss);
    r->rss = rss;
    r->peak_rss = window_peak;
    r->life_peak_rss = life_peak;
    r->life_peak_phase = life_phase;
    r->phase = (ct_mem_phase)atomic_load(&cur_phase);
    memcpy(r->phase_peak_rss, phase_peak, sizeof phase_peak);
    pthread_mutex_unlock(&rss_mu);
}

/* ---- formatting -------------------------------------------------------- */

/* "512 B", "1.5 KiB", "12.0 MiB", "3.25 GiB" into b. */
static const char *human(size_t bytes, char *b, size_t n)
{
    static const char *unit[] = {"KiB", "MiB", "GiB", "TiB"};
    if (bytes < 1024) {
        snprintf(b, n, "%zu B", bytes);
        return b;
    }
    double v = (double)bytes / 1024;
    int u = 0;
    while (v >= 1024 && u < 3) v /= 1024, u++;
    snprintf(b, n, v < 10 ? "%.2f %s" : "%.1f %s", v, unit[u]);
    return b;
}

typedef struct {
    char *buf;
    size_t n, len; /* len: bytes wanted so far, may pass n */
} out_t;

static void put(out_t *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(out_t *o, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    size_t room = o->len < o->n ? o->n - o->len : 0;
    int k = vsnprintf(room ? o->buf + o->len : NULL, room, fmt, ap);
    va_end(ap);
    if (k > 0) o->len += (size_t)k;
}

static ct_status finish(out_t *o, const char *what, size_t max)
{
    if (o->len < o->n) return CT_OK;
    if (o->n) o->buf[0] = 0; /* never hand back a cut report */
    return ct_error(CT_EINVAL, "a buffer of %zu bytes is too small for the memory %s (it needs %zu); "
                    "pass at least %zu bytes", o->n, what, o->len + 1, max);
}

static void row(out_t *o, const char *name, size_t cur, size_t peak, const char *note)
{
    char a[32], b[32];
    put(o, "  %-10s %12s %12s%s%s\n", name, human(cur, a, sizeof a), human(peak, b, sizeof b),
        note[0] ? "  " : "", note);
}

ct_status ct_mem_report_format(const ct_mem_report *r, char *buf, size_t n)
{
    out_t o = {buf, n, 0};
    char a[32], b[32], c[32];
    put(&o, "%-13s%12s %12s\n", "memory", "current", "peak");
    for (int c = 0; c < CT_MEM_NCAT; c++)
        row(&o, ct_mem_cat_name((ct_mem_cat)c), r->current[c], r->peak[c], "");
    row(&o, "total", r->current_total, r->peak_total, "(peak of the sum)");
    row(&o, "resident", r->resident, r->peak_resident, "(param + grad + optim)");
    put(&o, "  %-10s %12s %12s  (freed blocks kept for reuse; not in total; bound %s)\n", "cached",
        human(r->cached, a, sizeof a), human(r->peak_cached, b, sizeof b), human(r->cache_limit, c, sizeof c));
    if (r->rss || r->peak_rss) row(&o, "rss", r->rss, r->peak_rss, "(whole process)");
    else put(&o, "  %-10s %12s %12s  (/proc/self/status unreadable)\n", "rss", "?", "?");
    if (r->life_peak_rss) {
        put(&o, "  %-10s %12s %12s  (whole life so far, reached in %s)\n  phases   ", "rss life", "",
            human(r->life_peak_rss, a, sizeof a), ct_mem_phase_name(r->life_peak_phase));
        for (int p = 0; p < CT_PHASE_N; p++)
            if (r->phase_peak_rss[p])
                put(&o, " %s %s", ct_mem_phase_name((ct_mem_phase)p), human(r->phase_peak_rss[p], a, sizeof a));
        put(&o, "  (peak RSS of each)\n");
    }
    return finish(&o, "table", CT_MEM_REPORT_TABLE_MAX);
}

ct_status ct_mem_report_json(const ct_mem_report *r, int rank, char *buf, size_t n)
{
    out_t o = {buf, n, 0};
    put(&o, "{\"rank\":%d", rank);
    for (int c = 0; c < CT_MEM_NCAT; c++)
        put(&o, ",\"%s\":%zu", ct_mem_cat_name((ct_mem_cat)c), r->peak[c]);
    put(&o, ",\"peak_total\":%zu,\"resident\":%zu,\"cached\":%zu,\"peak_cached\":%zu,\"cache_limit\":%zu,"
        "\"rss\":%zu,\"rss_life\":%zu,\"rss_life_phase\":\"%s\",\"rss_phases\":{", r->peak_total, r->peak_resident,
        r->cached, r->peak_cached, r->cache_limit, r->peak_rss, r->life_peak_rss,
        ct_mem_phase_name(r->life_peak_phase));
    for (int p = 0, k = 0; p < CT_PHASE_N; p++)
        if (r->phase_peak_rss[p])
            put(&o, "%s\"%s\":%zu", k++ ? "," : "", ct_mem_phase_name((ct_mem_phase)p), r->phase_peak_rss[p]);
    put(&o, "}}");
    return finish(&o, "report JSON", CT_MEM_REPORT_JSON_MAX);
}

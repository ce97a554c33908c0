/*
 * The per-rank memory report: the allocator's counters (src/core/alloc.c)
 * plus the process's resident set from /proc/self/status, as a plain struct,
 * a table for people and a JSON object for programs.
 *
 * Peak RSS: Linux keeps the high-water mark VmHWM, and writing "5" to
 * /proc/self/clear_refs resets it to the current RSS, so after
 * ct_mem_reset_peak VmHWM is the true peak of the new window.  Where that
 * write fails (an old kernel, a locked-down /proc) the peak is the highest
 * RSS sampled since the reset (at the reset and at each ct_mem_report_get),
 * which can miss a spike between samples.
 */
#include "ctrain/core.h"
#include "internal.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static pthread_mutex_t rss_mu = PTHREAD_MUTEX_INITIALIZER;
static size_t rss_sampled_max; /* highest RSS sampled in this window */
static int hwm_valid = 1;      /* VmHWM covers this window (true from process start) */

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

void ct__rss_reset_peak(void)
{
    pthread_mutex_lock(&rss_mu);
    hwm_valid = clear_hwm();
    size_t rss, hwm;
    read_status(&rss, &hwm);
    rss_sampled_max = rss;
    pthread_mutex_unlock(&rss_mu);
}

void ct_mem_report_get(ct_mem_report *r)
{
    memset(r, 0, sizeof *r);
    ct__mem_counters(r);
    size_t rss, hwm;
    read_status(&rss, &hwm);
    pthread_mutex_lock(&rss_mu);
    if (rss > rss_sampled_max) rss_sampled_max = rss;
    r->rss = rss;
    r->peak_rss = rss_sampled_max;
    if (hwm_valid && hwm > r->peak_rss) r->peak_rss = hwm;
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
    char a[32];
    put(&o, "%-13s%12s %12s\n", "memory", "current", "peak");
    for (int c = 0; c < CT_MEM_NCAT; c++)
        row(&o, ct_mem_cat_name((ct_mem_cat)c), r->current[c], r->peak[c], "");
    row(&o, "total", r->current_total, r->peak_total, "(peak of the sum)");
    row(&o, "resident", r->resident, r->peak_resident, "(param + grad + optim)");
    put(&o, "  %-10s %12s %12s  (freed blocks kept for reuse; not in total)\n", "cached",
        human(r->cached, a, sizeof a), "");
    if (r->rss || r->peak_rss) row(&o, "rss", r->rss, r->peak_rss, "(whole process)");
    else put(&o, "  %-10s %12s %12s  (/proc/self/status unreadable)\n", "rss", "?", "?");
    return finish(&o, "table", CT_MEM_REPORT_TABLE_MAX);
}

ct_status ct_mem_report_json(const ct_mem_report *r, int rank, char *buf, size_t n)
{
    out_t o = {buf, n, 0};
    put(&o, "{\"rank\":%d", rank);
    for (int c = 0; c < CT_MEM_NCAT; c++)
        put(&o, ",\"%s\":%zu", ct_mem_cat_name((ct_mem_cat)c), r->peak[c]);
    put(&o, ",\"peak_total\":%zu,\"resident\":%zu,\"cached\":%zu,\"rss\":%zu}", r->peak_total,
        r->peak_resident, r->cached, r->peak_rss);
    return finish(&o, "report JSON", CT_MEM_REPORT_JSON_MAX);
}

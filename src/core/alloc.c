/*
 * The tracked allocator.  Every block carries a small header with its size
 * and category so ct_free can keep per-category current and peak counts.
 * Counters are atomic because the communication thread allocates too.
 *
 * Large blocks (64 KiB and up) are kept in a cache of exact sizes when
 * freed, the way PyTorch's caching allocator keeps device memory: a
 * training step allocates the same activation and gradient sizes every
 * time, and handing them back to the OS makes every step pay page faults
 * again (measured: a Linear(1024,1024) forward at batch 64 spent ~5% of its
 * time faulting in its output).  Cached bytes are not counted as in use.
 * CTRAIN_ALLOC_CACHE_MB bounds the cache (default 2048; 0 turns it off);
 * AddressSanitizer builds turn it off so use-after-free stays visible.
 */
#include "ctrain/core.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define HDR 64 /* keeps the user block 64-byte aligned */
#define MAGIC 0xC7A1A10Cu
#define CACHE_MIN (64u << 10)
#define NBINS 256

#if defined(__SANITIZE_ADDRESS__)
#define CACHE_DEFAULT_MB 0
#else
#define CACHE_DEFAULT_MB 2048
#endif

typedef struct {
    size_t size;  /* bytes asked for */
    size_t cap;   /* bytes usable after the header */
    uint32_t magic;
    int cat;
    void *next;   /* free list link while cached */
} hdr_t;

typedef struct {
    size_t cap;
    hdr_t *head;
} bin_t;

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static bin_t bins[NBINS];
static size_t cached_bytes, cache_limit = (size_t)-1;

static size_t cache_limit_bytes(void)
{
    if (cache_limit == (size_t)-1) {
        const char *e = getenv("CTRAIN_ALLOC_CACHE_MB");
        long mb = e ? atol(e) : CACHE_DEFAULT_MB;
        cache_limit = mb > 0 ? (size_t)mb << 20 : 0;
    }
    return cache_limit;
}

/* Bin for cap: the bin holding cap, else an empty one (create), else NULL. */
static bin_t *bin_for(size_t cap, int create)
{
    size_t i = (cap >> 12) % NBINS;
    for (int k = 0; k < NBINS; k++, i = (i + 1) % NBINS) {
        if (bins[i].cap == cap) return &bins[i];
        if (bins[i].cap == 0) {
            if (!create) return NULL;
            bins[i].cap = cap;
            return &bins[i];
        }
    }
    return NULL;
}

static hdr_t *cache_take(size_t cap)
{
    hdr_t *h = NULL;
    pthread_mutex_lock(&cache_mu);
    bin_t *b = bin_for(cap, 0);
    if (b && b->head) {
        h = b->head;
        b->head = h->next;
        cached_bytes -= cap;
    }
    pthread_mutex_unlock(&cache_mu);
    return h;
}

static int cache_put(hdr_t *h)
{
    int kept = 0;
    pthread_mutex_lock(&cache_mu);
    if (cached_bytes + h->cap <= cache_limit_bytes()) {
        bin_t *b = bin_for(h->cap, 1);
        if (b) {
            h->next = b->head;
            b->head = h;
            cached_bytes += h->cap;
            kept = 1;
        }
    }
    pthread_mutex_unlock(&cache_mu);
    return kept;
}

size_t ct_mem_cached(void)
{
    pthread_mutex_lock(&cache_mu);
    size_t n = cached_bytes;
    pthread_mutex_unlock(&cache_mu);
    return n;
}

void ct_mem_trim(void)
{
    pthread_mutex_lock(&cache_mu);
    for (int i = 0; i < NBINS; i++) {
        while (bins[i].head) {
            hdr_t *h = bins[i].head;
            bins[i].head = h->next;
            free(h);
        }
        bins[i].cap = 0;
    }
    cached_bytes = 0;
    pthread_mutex_unlock(&cache_mu);
}

static _Atomic size_t cur[CT_MEM_NCAT], peak[CT_MEM_NCAT];
static _Atomic size_t cur_total, peak_total;
static _Atomic long fail_countdown = -1;

static void raise_peak(_Atomic size_t *pk, size_t v)
{
    size_t old = atomic_load(pk);
    while (v > old && !atomic_compare_exchange_weak(pk, &old, v)) {}
}

void *ct_alloc(size_t bytes, ct_mem_cat cat)
{
    CT_ASSERT(cat >= 0 && cat < CT_MEM_NCAT);
    long fc = atomic_load(&fail_countdown);
    if (fc >= 0) {
        if (atomic_fetch_sub(&fail_countdown, 1) == 0) {
            ct_error(CT_ENOMEM, "out of memory allocating %zu bytes (injected fault)", bytes);
            return NULL;
        }
    }
    if (bytes > SIZE_MAX - HDR - 4096) {
        ct_error(CT_ENOMEM, "allocation of %zu bytes overflows", bytes);
        return NULL;
    }
    size_t cap = (bytes + 63) & ~(size_t)63;
    if (cap >= CACHE_MIN) cap = (cap + 4095) & ~(size_t)4095;
    hdr_t *h = cap >= CACHE_MIN ? cache_take(cap) : NULL;
    char *raw = (char *)h;
    if (!raw) raw = aligned_alloc(64, HDR + cap);
    if (!raw) {
        ct_mem_trim(); /* the cache may hold what we need, in other sizes */
        raw = aligned_alloc(64, HDR + cap);
    }
    if (!raw) {
        ct_error(CT_ENOMEM, "out of memory allocating %zu bytes for %s; reduce the batch or model size",
                 bytes, ct_mem_cat_name(cat));
        return NULL;
    }
    memset(raw + HDR, 0, bytes);
    h = (hdr_t *)raw;
    h->cap = cap;
    h->size = bytes;
    h->magic = MAGIC;
    h->cat = (int)cat;
    raise_peak(&peak[cat], atomic_fetch_add(&cur[cat], bytes) + bytes);
    raise_peak(&peak_total, atomic_fetch_add(&cur_total, bytes) + bytes);
    return raw + HDR;
}

void ct_free(void *p)
{
    if (!p) return;
    hdr_t *h = (hdr_t *)((char *)p - HDR);
    CT_ASSERT(h->magic == MAGIC);
    h->magic = 0;
    atomic_fetch_sub(&cur[h->cat], h->size);
    atomic_fetch_sub(&cur_total, h->size);
    if (h->cap < CACHE_MIN || !cache_put(h)) free(h);
}

/* Declared in src/comm/internal.h: memory MPI allocated for ctrain (shared
 * windows) is counted like ct_alloc's, so reports and peaks include it. */
void ct__mem_account(ct_mem_cat cat, int64_t delta)
{
    CT_ASSERT(cat >= 0 && cat < CT_MEM_NCAT);
    if (delta >= 0) {
        size_t d = (size_t)delta;
        raise_peak(&peak[cat], atomic_fetch_add(&cur[cat], d) + d);
        raise_peak(&peak_total, atomic_fetch_add(&cur_total, d) + d);
    } else {
        size_t d = (size_t)-delta;
        atomic_fetch_sub(&cur[cat], d);
        atomic_fetch_sub(&cur_total, d);
    }
}

size_t ct_alloc_size(const void *p)
{
    if (!p) return 0;
    const hdr_t *h = (const hdr_t *)((const char *)p - HDR);
    CT_ASSERT(h->magic == MAGIC);
    return h->size;
}

size_t ct_mem_current(ct_mem_cat cat) { return atomic_load(&cur[cat]); }
size_t ct_mem_peak(ct_mem_cat cat) { return atomic_load(&peak[cat]); }
size_t ct_mem_peak_total(void) { return atomic_load(&peak_total); }

void ct_mem_reset_peak(void)
{
    for (int c = 0; c < CT_MEM_NCAT; c++) atomic_store(&peak[c], atomic_load(&cur[c]));
    atomic_store(&peak_total, atomic_load(&cur_total));
}

const char *ct_mem_cat_name(ct_mem_cat cat)
{
    static const char *names[] = {"param", "grad", "optim", "act", "comm", "other"};
    return (cat >= 0 && cat < CT_MEM_NCAT) ? names[cat] : "?";
}

void ct_mem_fail_after(long n) { atomic_store(&fail_countdown, n); }

/*
 * The tracked allocator.  Every block carries a small header with its size
 * and category so ct_free can keep per-category current and peak counts,
 * and a running count of resident bytes (param + grad + optim together)
 * with its own peak.  Counters are atomic because the communication thread
 * allocates too.
 *
 * Small blocks come from malloc (aligned_alloc).  Large blocks (64 KiB and
 * up) are mapped from the OS with mmap and given back with munmap, so
 * freeing them really lowers the process's RSS: glibc would keep big freed
 * chunks in its heap once its dynamic mmap threshold has grown.  The data of
 * a large block starts on a page boundary; its header sits at the end of
 * the page before.
 *
 * Freed large blocks are kept in a cache by size, the way PyTorch's
 * caching allocator keeps device memory (a request takes a block of its
 * size, else the smallest cached one up to a third larger): a training step allocates the same
 * activation and gradient sizes every time, and handing them back to the OS
 * makes every step pay page faults again (measured: a Linear(1024,1024)
 * forward at batch 64 spent ~5% of its time faulting in its output).  Cached
 * bytes are not counted as in use (ct_mem_cached reports them apart) and
 * ct_mem_trim returns them to the OS.
 *
 * The cache is bounded, so the process's RSS tracks what is in use.  The
 * automatic bound has two parts.  The cache may always hold
 * CT_MEM_CACHE_UNITS times the largest block a strategy says it allocates
 * over and over (ct_mem_cache_hint: a DDP bucket, an FSDP unit, an offload
 * slice; the flat layer hints every flat), at least CT_MEM_CACHE_MIN_MB.
 * Beyond that, blocks in use plus blocks cached may fill the most they
 * have ever been together (map_mark: large blocks counted by their whole
 * size, as the OS holds them; raised only when a block is mapped), so a
 * freed block is always kept, caching raises the whole-life RSS by at most
 * the first part (which the memory plan counts), and a step's activations,
 * freed in backward, are there for the next forward.  Bounded by the hint alone, a 12 x 768 GPT
 * trained by one process (950 MiB of activations, bf16, 2 threads)
 * unmapped and faulted in its activations every step: page faults, zeroing
 * and, with two threads, the TLB shootdowns of every munmap took 21% of the
 * step (1765 -> 1388 ms) at the same whole-life RSS.  When a new block is
 * mapped, cached blocks go back to the OS first until the rule holds again
 * for the higher count, so a cache of sizes nobody asks for any more cannot
 * pile up on top of a new peak.  (A fixed 2 GiB bound let FSDP on a 12 x 768
 * GPT at 2 ranks hold 858 MiB of freed blocks at a 655 MiB tracked peak:
 * RSS 1244 MiB.)  A block that fits under neither goes back to the OS
 * (munmap).  A larger cached block handed to a smaller request keeps its
 * tail's pages and counts them as mapped: giving them back (MADV_DONTNEED)
 * made the next larger request fault them in again, and the small GPT of
 * bench/gpt (one thread) paid 2000-3800 page faults a step and 5-13% of its
 * step time for it; a mark of requested bytes in use alone (not mapped
 * bytes, not the cache) was passed by a step's blocks, and an 8 MiB block
 * went back to the OS every step.  (A mark of mapped bytes in use plus the
 * whole first part let offload at 2 ranks, 12 x 768 GPT, reach 1127 MiB
 * against 708.)  CTRAIN_ALLOC_CACHE_MB sets a fixed bound
 * (0 turns the cache off; no high-water part), ct_mem_set_cache_limit
 * overrides both; AddressSanitizer builds turn it off by default so
 * use-after-free stays visible, and poison the blocks it holds when it is
 * turned on.
 *
 * ct_alloc does not zero (torch.empty); ct_alloc_zeroed does, and skips the
 * memset for freshly mapped pages, which the OS hands out zeroed.
 */
#include "ctrain/core.h"
#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#define CACHE_OFF_BY_DEFAULT 1
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#define CACHE_OFF_BY_DEFAULT 0
#endif

#define HDR 64 /* keeps the user block of a small block 64-byte aligned */
#define MAGIC 0xC7A1A10Cu
#define LARGE_MIN (64u << 10)
#define NBINS 256

typedef struct {
    size_t size;  /* bytes asked for */
    size_t cap;   /* bytes usable (a multiple of the page size for large blocks) */
    uint32_t magic;
    int cat;
    int mapped;   /* large block: data is at a page boundary of an mmap of page + cap */
    void *next;   /* free list link while cached */
} hdr_t;

_Static_assert(sizeof(hdr_t) <= HDR, "the block header must fit in HDR bytes");

static size_t page_size(void)
{
    static _Atomic size_t pg; /* threads may race to set it, to the same value */
    size_t v = atomic_load_explicit(&pg, memory_order_relaxed);
    if (!v) {
        long p = sysconf(_SC_PAGESIZE);
        v = p > 0 ? (size_t)p : 4096;
        atomic_store_explicit(&pg, v, memory_order_relaxed);
    }
    return v;
}

static hdr_t *hdr_of(const void *p) { return (hdr_t *)((char *)p - HDR); }
static char *data_of(hdr_t *h) { return (char *)h + HDR; }

/* ---- large blocks: mmap / munmap --------------------------------------- */

static hdr_t *map_block(size_t cap)
{
    size_t pg = page_size();
    char *base = mmap(NULL, pg + cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    hdr_t *h = (hdr_t *)(base + pg - HDR);
    h->cap = cap;
    h->mapped = 1;
    return h;
}

static void unmap_block(hdr_t *h)
{
    size_t pg = page_size();
    UNPOISON(data_of(h), h->cap);
    munmap(data_of(h) - pg, pg + h->cap);
}

/* ---- the cache of freed large blocks ----------------------------------- */

typedef struct {
    size_t cap;
    hdr_t *head;
} bin_t;

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static bin_t bins[NBINS];
static size_t cached_bytes, cached_peak;
static size_t hint_bytes;                /* the largest ct_mem_cache_hint */
static size_t fixed_limit = (size_t)-2;  /* -2: not read from the environment yet; CT_MEM_CACHE_AUTO: auto */

/* The highest count of tracked bytes in use over the process's life
 * (never reset, unlike the report's windows), and the count now; both are
 * kept by count_up and count_down below. */
static _Atomic size_t life_total, cur_total;
/* Bytes of large blocks in use counted by their whole mapped size, and the
 * most that and the cache have held together (raised when a block is
 * mapped, under cache_mu): the cache's second bound. */
static _Atomic size_t map_cur, map_mark;

/* Under cache_mu. */
static size_t cache_limit_bytes(void)
{
    if (fixed_limit == (size_t)-2) {
        const char *e = getenv("CTRAIN_ALLOC_CACHE_MB");
        if (e && *e && strcmp(e, "auto")) {
            long mb = atol(e);
            fixed_limit = mb > 0 ? (size_t)mb << 20 : 0;
        } else {
            fixed_limit = CACHE_OFF_BY_DEFAULT && !e ? 0 : CT_MEM_CACHE_AUTO;
        }
    }
    if (fixed_limit != CT_MEM_CACHE_AUTO) return fixed_limit;
    size_t lo = (size_t)CT_MEM_CACHE_MIN_MB << 20, auto_b = hint_bytes * CT_MEM_CACHE_UNITS;
    return auto_b > lo ? auto_b : lo;
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

/* A cached block for cap bytes: one of exactly cap, else the smallest that
 * holds cap and is at most a third larger (h->cap says which).  Taking
 * larger ones keeps the cache from hoarding a block per size when the sizes
 * vary from step to step or part to part (FSDP's units of different sizes,
 * gathered one after another, share a few blocks instead of keeping one
 * each); a third, not twice, because the tail stays mapped: with twice,
 * offload at 2 ranks (12 x 768 GPT) peaked at 1121 MiB RSS, with a third
 * at 1069. */
static hdr_t *cache_take(size_t cap)
{
    hdr_t *h = NULL;
    pthread_mutex_lock(&cache_mu);
    bin_t *b = bin_for(cap, 0);
    if (!b || !b->head) {
        b = NULL;
        for (int i = 0; i < NBINS; i++)
            if (bins[i].head && bins[i].cap > cap && bins[i].cap - bins[i].cap / 4 <= cap && (!b || bins[i].cap < b->cap))
                b = &bins[i];
    }
    if (b && b->head) {
        h = b->head;
        b->head = h->next;
        cached_bytes -= h->cap;
    }
    pthread_mutex_unlock(&cache_mu);
    if (!h) return NULL;
    UNPOISON(data_of(h), h->cap);
    return h;
}

/* Under cache_mu: may the cache hold `bytes` in all while `live` mapped
 * bytes are in use?  Under the bound always; past it (automatic bound only)
 * while live + cached stays under the mark. */
static int cache_may_hold(size_t bytes, size_t live)
{
    if (bytes <= cache_limit_bytes()) return 1;
    return fixed_limit == CT_MEM_CACHE_AUTO && live + bytes <= atomic_load(&map_mark);
}

/* Before `cap` new bytes are mapped: cached blocks, largest first, go back
 * to the OS until the cache may hold what is left beside the grown count. */
static void cache_shed(size_t cap)
{
    hdr_t *out = NULL;
    pthread_mutex_lock(&cache_mu);
    size_t live = atomic_load(&map_cur) + cap;
    while (cached_bytes && !cache_may_hold(cached_bytes, live)) {
        bin_t *b = NULL;
        for (int i = 0; i < NBINS; i++)
            if (bins[i].head && (!b || bins[i].cap > b->cap)) b = &bins[i];
        hdr_t *h = b->head;
        b->head = h->next;
        cached_bytes -= h->cap;
        h->next = out;
        out = h;
    }
    pthread_mutex_unlock(&cache_mu);
    while (out) { /* munmap outside the lock: it waits for other cores */
        hdr_t *h = out;
        out = h->next;
        unmap_block(h);
    }
}

static int cache_put(hdr_t *h)
{
    int kept = 0;
    pthread_mutex_lock(&cache_mu);
    if (cache_may_hold(cached_bytes + h->cap, atomic_load(&map_cur))) {
        bin_t *b = bin_for(h->cap, 1);
        if (b) {
            POISON(data_of(h), h->cap);
            h->next = b->head;
            b->head = h;
            cached_bytes += h->cap;
            if (cached_bytes > cached_peak) cached_peak = cached_bytes;
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
            unmap_block(h);
        }
        bins[i].cap = 0;
    }
    cached_bytes = 0;
    pthread_mutex_unlock(&cache_mu);
#if defined(__GLIBC__)
    malloc_trim(0); /* and what small blocks left free at the top of malloc's heap */
#endif
}

size_t ct_mem_cached_peak(void)
{
    pthread_mutex_lock(&cache_mu);
    size_t n = cached_peak;
    pthread_mutex_unlock(&cache_mu);
    return n;
}

size_t ct_mem_get_cache_limit(void)
{
    pthread_mutex_lock(&cache_mu);
    size_t n = cache_limit_bytes();
    pthread_mutex_unlock(&cache_mu);
    return n;
}

/* Under the new bound at once: freed blocks beyond it go back to the OS. */
static void fit_cache(void)
{
    pthread_mutex_lock(&cache_mu);
    int fits = cache_may_hold(cached_bytes, atomic_load(&cur_total));
    pthread_mutex_unlock(&cache_mu);
    if (!fits) ct_mem_trim();
}

void ct_mem_set_cache_limit(size_t bytes)
{
    pthread_mutex_lock(&cache_mu);
    fixed_limit = bytes;
    pthread_mutex_unlock(&cache_mu);
    fit_cache();
}

void ct_mem_cache_hint(size_t bytes)
{
    pthread_mutex_lock(&cache_mu);
    if (bytes > hint_bytes) hint_bytes = bytes;
    pthread_mutex_unlock(&cache_mu);
}

size_t ct_mem_cache_hinted(void)
{
    pthread_mutex_lock(&cache_mu);
    size_t n = hint_bytes;
    pthread_mutex_unlock(&cache_mu);
    return n;
}

/* ---- counters ---------------------------------------------------------- */

static _Atomic size_t cur[CT_MEM_NCAT], peak[CT_MEM_NCAT];
static _Atomic size_t peak_total;
static _Atomic size_t cur_resident, peak_resident; /* param + grad + optim */
static _Atomic long fail_countdown = -1;

static int is_resident(int cat) { return cat == CT_MEM_PARAM || cat == CT_MEM_GRAD || cat == CT_MEM_OPTIM; }

static void raise_peak(_Atomic size_t *pk, size_t v)
{
    size_t old = atomic_load(pk);
    while (v > old && !atomic_compare_exchange_weak(pk, &old, v)) {}
}

static void count_up(int cat, size_t d)
{
    raise_peak(&peak[cat], atomic_fetch_add(&cur[cat], d) + d);
    size_t total = atomic_fetch_add(&cur_total, d) + d;
    raise_peak(&peak_total, total);
    raise_peak(&life_total, total);
    if (is_resident(cat)) raise_peak(&peak_resident, atomic_fetch_add(&cur_resident, d) + d);
}

static void count_down(int cat, size_t d)
{
    atomic_fetch_sub(&cur[cat], d);
    atomic_fetch_sub(&cur_total, d);
    if (is_resident(cat)) atomic_fetch_sub(&cur_resident, d);
}

/* ---- ct_alloc / ct_free ------------------------------------------------ */

/* A block of bytes under cat; *fresh says its memory came zeroed from the OS. */
static void *alloc_block(size_t bytes, ct_mem_cat cat, int *fresh)
{
    CT_ASSERT(cat >= 0 && cat < CT_MEM_NCAT);
    *fresh = 0;
    long fc = atomic_load(&fail_countdown);
    if (fc >= 0) {
        if (atomic_fetch_sub(&fail_countdown, 1) == 0) {
            ct_error(CT_ENOMEM, "out of memory allocating %zu bytes (injected fault)", bytes);
            return NULL;
        }
    }
    size_t pg = page_size();
    if (bytes > SIZE_MAX / 2 - pg) {
        ct_error(CT_ENOMEM, "allocation of %zu bytes is larger than any address space; check the size "
                 "for an overflowed or negative value", bytes);
        return NULL;
    }
    size_t cap = (bytes + 63) & ~(size_t)63;
    hdr_t *h = NULL;
    if (cap >= LARGE_MIN) {
        cap = (cap + pg - 1) & ~(pg - 1);
        if ((h = cache_take(cap))) {
            cap = h->cap; /* the block's own size, which munmap needs */
        } else {
            cache_shed(cap);
            h = map_block(cap);
            if (!h) {
                ct_mem_trim(); /* the cache may hold what we need, in other sizes */
                h = map_block(cap);
            }
            *fresh = h != NULL;
        }
        if (h) {
            size_t in_use = atomic_fetch_add(&map_cur, h->cap) + h->cap;
            if (*fresh) { /* only a new mapping grows what is mapped */
                pthread_mutex_lock(&cache_mu);
                raise_peak(&map_mark, in_use + cached_bytes);
                pthread_mutex_unlock(&cache_mu);
            }
        }
    } else {
        h = aligned_alloc(64, HDR + cap);
        if (h) h->mapped = 0;
    }
    if (!h) {
        ct_error(CT_ENOMEM, "out of memory allocating %zu bytes for %s; reduce the batch or model size "
                 "(the memory report says what holds memory)", bytes, ct_mem_cat_name(cat));
        return NULL;
    }
    h->cap = cap;
    h->size = bytes;
    h->magic = MAGIC;
    h->cat = (int)cat;
    POISON(data_of(h) + bytes, cap - bytes); /* slack after the block: no one's */
    count_up(cat, bytes);
    return data_of(h);
}

void *ct_alloc(size_t bytes, ct_mem_cat cat)
{
    int fresh;
    return alloc_block(bytes, cat, &fresh);
}

void *ct_alloc_zeroed(size_t bytes, ct_mem_cat cat)
{
    int fresh;
    void *p = alloc_block(bytes, cat, &fresh);
    if (p && !fresh) memset(p, 0, bytes);
    return p;
}

void ct_free(void *p)
{
    if (!p) return;
    hdr_t *h = hdr_of(p);
    CT_ASSERT(h->magic == MAGIC);
    h->magic = 0;
    count_down(h->cat, h->size);
    UNPOISON(p, h->cap);
    if (!h->mapped) {
        free(h);
        return;
    }
    atomic_fetch_sub(&map_cur, h->cap);
    if (!cache_put(h)) unmap_block(h);
}

/* Declared in src/comm/internal.h: memory MPI allocated for ctrain (shared
 * windows) is counted like ct_alloc's, so reports and peaks include it. */
void ct__mem_account(ct_mem_cat cat, int64_t delta)
{
    CT_ASSERT(cat >= 0 && cat < CT_MEM_NCAT);
    if (delta >= 0) count_up(cat, (size_t)delta);
    else count_down(cat, (size_t)-delta);
}

size_t ct_alloc_size(const void *p)
{
    if (!p) return 0;
    const hdr_t *h = hdr_of(p);
    CT_ASSERT(h->magic == MAGIC);
    return h->size;
}

size_t ct_mem_current(ct_mem_cat cat) { return atomic_load(&cur[cat]); }
size_t ct_mem_peak(ct_mem_cat cat) { return atomic_load(&peak[cat]); }
size_t ct_mem_peak_total(void) { return atomic_load(&peak_total); }
size_t ct_mem_life_peak_total(void) { return atomic_load(&life_total); }

void ct_mem_reset_peak(void)
{
    for (int c = 0; c < CT_MEM_NCAT; c++) atomic_store(&peak[c], atomic_load(&cur[c]));
    atomic_store(&peak_total, atomic_load(&cur_total));
    atomic_store(&peak_resident, atomic_load(&cur_resident));
    pthread_mutex_lock(&cache_mu);
    cached_peak = cached_bytes;
    pthread_mutex_unlock(&cache_mu);
    ct__rss_reset_peak();
}

void ct__mem_counters(ct_mem_report *r)
{
    size_t sum = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) {
        r->current[c] = atomic_load(&cur[c]);
        r->peak[c] = atomic_load(&peak[c]);
        /* Other threads may move a counter between the two loads. */
        if (r->peak[c] < r->current[c]) r->peak[c] = r->current[c];
        sum += r->current[c];
    }
    r->current_total = sum;
    r->peak_total = atomic_load(&peak_total);
    if (r->peak_total < sum) r->peak_total = sum;
    r->resident = r->current[CT_MEM_PARAM] + r->current[CT_MEM_GRAD] + r->current[CT_MEM_OPTIM];
    r->peak_resident = atomic_load(&peak_resident);
    if (r->peak_resident < r->resident) r->peak_resident = r->resident;
    pthread_mutex_lock(&cache_mu);
    r->cached = cached_bytes;
    r->peak_cached = cached_peak;
    r->cache_limit = cache_limit_bytes();
    r->mapped = atomic_load(&map_cur);
    r->life_mapped = atomic_load(&map_mark);
    pthread_mutex_unlock(&cache_mu);
}

const char *ct_mem_cat_name(ct_mem_cat cat)
{
    static const char *names[] = {"param", "grad", "optim", "act", "comm", "data", "other"};
    _Static_assert(sizeof names / sizeof names[0] == CT_MEM_NCAT, "one name per category");
    return (cat >= 0 && cat < CT_MEM_NCAT) ? names[cat] : "?";
}

void ct_mem_fail_after(long n) { atomic_store(&fail_countdown, n); }

long ct_mem_fail_pending(void)
{
    long n = atomic_load(&fail_countdown);
    return n < 0 ? -1 : n;
}

void *ct_grow(void *arr, int n, int *cap, size_t elem, ct_mem_cat cat)
{
    if (n < *cap) return arr;
    int c = *cap ? 2 * *cap : 4;
    void *a = ct_alloc((size_t)c * elem, cat);
    if (!a) return NULL;
    if (n) memcpy(a, arr, (size_t)n * elem);
    ct_free(arr);
    *cap = c;
    return a;
}

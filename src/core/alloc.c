/*
 * The tracked allocator.  Every block carries a small header with its size
 * and category so ct_free can keep per-category current and peak counts.
 * Counters are atomic because the communication thread allocates too.
 */
#include "ctrain/core.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define HDR 64 /* keeps the user block 64-byte aligned */
#define MAGIC 0xC7A1A10Cu

typedef struct {
    size_t size;
    uint32_t magic;
    int cat;
} hdr_t;

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
    size_t total = HDR + ((bytes + 63) & ~(size_t)63);
    if (total < bytes) {
        ct_error(CT_ENOMEM, "allocation of %zu bytes overflows", bytes);
        return NULL;
    }
    char *raw = aligned_alloc(64, total);
    if (!raw) {
        ct_error(CT_ENOMEM, "out of memory allocating %zu bytes for %s; reduce the batch or model size",
                 bytes, ct_mem_cat_name(cat));
        return NULL;
    }
    memset(raw + HDR, 0, total - HDR);
    hdr_t *h = (hdr_t *)raw;
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
    free(h);
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

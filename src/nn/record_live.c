/*
 * The records that exist: a set of their addresses.  A record is consumed
 * by its backward (or freed by ct_record_destroy), so a second backward on
 * the same pointer would read freed memory; checking the set first turns
 * that mistake into an error naming it.  (A pointer whose memory was since
 * reused by a new record cannot be told apart: that record then runs.)
 * Open addressing with tombstones, grown geometrically; a mutex, since
 * records may be made on more than one thread.  The table is bookkeeping
 * that lives as long as the process, so it comes from malloc, outside the
 * tracked allocator's counts (which tests check for leaks).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "internal.h"

#define TOMB ((const void *)1)

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static const void **slots;
static size_t cap, used; /* used counts live entries and tombstones */

static size_t slot_of(const void *p, size_t n)
{
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17) & (n - 1);
}

static int grow(void)
{
    size_t ncap = cap ? cap * 2 : 256;
    const void **ns = calloc(ncap, sizeof *ns);
    if (!ns) return 0;
    size_t live = 0;
    for (size_t i = 0; i < cap; i++) {
        if (!slots[i] || slots[i] == TOMB) continue;
        size_t j = slot_of(slots[i], ncap);
        while (ns[j]) j = (j + 1) & (ncap - 1);
        ns[j] = slots[i];
        live++;
    }
    free(slots);
    slots = ns;
    cap = ncap;
    used = live;
    return 1;
}

int ct__record_live_add(const void *rec)
{
    pthread_mutex_lock(&mu);
    int ok = (used + 1) * 2 <= cap || grow();
    if (ok) {
        size_t j = slot_of(rec, cap);
        while (slots[j] && slots[j] != TOMB) j = (j + 1) & (cap - 1);
        if (!slots[j]) used++;
        slots[j] = rec;
    }
    pthread_mutex_unlock(&mu);
    return ok;
}

/* 1 if rec is live; with take, it leaves the set. */
static int find(const void *rec, int take)
{
    pthread_mutex_lock(&mu);
    int found = 0;
    if (cap) {
        size_t j = slot_of(rec, cap);
        while (slots[j]) {
            if (slots[j] == rec) {
                found = 1;
                if (take) slots[j] = TOMB;
                break;
            }
            j = (j + 1) & (cap - 1);
        }
    }
    pthread_mutex_unlock(&mu);
    return found;
}

int ct__record_live(const void *rec) { return find(rec, 0); }
int ct__record_live_take(const void *rec) { return find(rec, 1); }

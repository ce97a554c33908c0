/*
 * Tests of the tracked allocator (src/core/alloc.c): per-category counters
 * and peaks against hand-computed sums, alignment, zeroing, and fault
 * injection, including tensors built under an injected failure.
 */
#include <stdint.h>
#include <stdlib.h>

#include "test.h"

/* Counters are process-wide; each test runs in its own process but may find
 * a few bytes allocated before main, so every check is relative to a start. */
typedef struct {
    size_t cur[CT_MEM_NCAT], total;
} snap;

static snap take(void)
{
    snap s = {{0}, 0};
    for (int c = 0; c < CT_MEM_NCAT; c++) {
        s.cur[c] = ct_mem_current((ct_mem_cat)c);
        s.total += s.cur[c];
    }
    return s;
}

TEST(core_alloc_counters_and_peaks)
{
    ct_mem_reset_peak();
    snap s0 = take();
    for (int c = 0; c < CT_MEM_NCAT; c++) ASSERT_EQ(ct_mem_peak((ct_mem_cat)c), s0.cur[c]);
    ASSERT_EQ(ct_mem_peak_total(), s0.total);

    void *a = ct_alloc(1000, CT_MEM_PARAM);
    void *b = ct_alloc(3000, CT_MEM_GRAD);
    void *c = ct_alloc(500, CT_MEM_PARAM);
    ASSERT(a && b && c);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - s0.cur[CT_MEM_PARAM], 1500);
    ASSERT_EQ(ct_mem_current(CT_MEM_GRAD) - s0.cur[CT_MEM_GRAD], 3000);
    ASSERT_EQ(ct_mem_peak_total() - s0.total, 4500);

    ct_free(a); /* param 1500 -> 500: the peak stays */
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - s0.cur[CT_MEM_PARAM], 500);
    ASSERT_EQ(ct_mem_peak(CT_MEM_PARAM) - s0.cur[CT_MEM_PARAM], 1500);

    void *d = ct_alloc(200, CT_MEM_PARAM);
    ct_free(b);
    void *e = ct_alloc(2000, CT_MEM_ACT);
    void *f = ct_alloc(64, CT_MEM_COMM);
    /* now: param 700, grad 0, act 2000, comm 64 => 2764 over the start; peak was 4500 */
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - s0.cur[CT_MEM_PARAM], 700);
    ASSERT_EQ(ct_mem_current(CT_MEM_GRAD) - s0.cur[CT_MEM_GRAD], 0);
    ASSERT_EQ(ct_mem_current(CT_MEM_ACT) - s0.cur[CT_MEM_ACT], 2000);
    ASSERT_EQ(ct_mem_current(CT_MEM_COMM) - s0.cur[CT_MEM_COMM], 64);
    ASSERT_EQ(ct_mem_peak(CT_MEM_PARAM) - s0.cur[CT_MEM_PARAM], 1500);
    ASSERT_EQ(ct_mem_peak(CT_MEM_GRAD) - s0.cur[CT_MEM_GRAD], 3000);
    ASSERT_EQ(ct_mem_peak(CT_MEM_ACT) - s0.cur[CT_MEM_ACT], 2000);
    ASSERT_EQ(ct_mem_peak_total() - s0.total, 4500);

    ct_mem_reset_peak();
    ASSERT_EQ(ct_mem_peak(CT_MEM_PARAM) - s0.cur[CT_MEM_PARAM], 700);
    ASSERT_EQ(ct_mem_peak(CT_MEM_GRAD) - s0.cur[CT_MEM_GRAD], 0);
    ASSERT_EQ(ct_mem_peak_total() - s0.total, 2764);

    /* The total peak is the highest simultaneous sum, not a sum of peaks:
     * 2764 + 1000 (optim) then -2000 (act) +1500 (other) peaks at 3764. */
    void *g = ct_alloc(1000, CT_MEM_OPTIM);
    ct_free(e);
    void *h = ct_alloc(1500, CT_MEM_OTHER);
    ASSERT_EQ(ct_mem_peak_total() - s0.total, 3764);
    ASSERT_EQ(ct_mem_peak(CT_MEM_ACT) - s0.cur[CT_MEM_ACT], 2000);
    ASSERT_EQ(ct_mem_peak(CT_MEM_OTHER) - s0.cur[CT_MEM_OTHER], 1500);

    ct_free(c);
    ct_free(d);
    ct_free(f);
    ct_free(g);
    ct_free(h);
    ct_free(NULL);
    snap s1 = take();
    for (int k = 0; k < CT_MEM_NCAT; k++) ASSERT_EQ(s1.cur[k], s0.cur[k]);
}

TEST(core_alloc_alignment_zero_size)
{
    size_t sizes[] = {0, 1, 3, 63, 64, 65, 100, 4095, 4096, 100000};
    void *p[sizeof sizes / sizeof sizes[0]];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        p[i] = ct_alloc(sizes[i], CT_MEM_OTHER);
        ASSERT(p[i] != NULL);
        ASSERT_EQ((uintptr_t)p[i] % 64, 0);
        ASSERT_EQ(ct_alloc_size(p[i]), sizes[i]);
        const unsigned char *b = p[i];
        for (size_t j = 0; j < sizes[i]; j++)
            if (b[j]) ct_test_fail(__FILE__, __LINE__, "byte %zu of a %zu-byte block is %d", j, sizes[i], b[j]);
        memset(p[i], 0xab, sizes[i]); /* dirty it for the reuse below; ASan checks the bounds */
    }
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) ct_free(p[i]);
    /* Fresh blocks of the same sizes (often the same memory) are zero again. */
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        unsigned char *b = ct_alloc(sizes[i], CT_MEM_ACT);
        ASSERT(b != NULL);
        for (size_t j = 0; j < sizes[i]; j++) ASSERT_EQ(b[j], 0);
        ct_free(b);
    }
    ASSERT_EQ(ct_alloc_size(NULL), 0);
}

TEST(core_alloc_cat_names)
{
    const char *want[] = {"param", "grad", "optim", "act", "comm", "other"};
    ASSERT_EQ(CT_MEM_NCAT, 6);
    for (int c = 0; c < CT_MEM_NCAT; c++) ASSERT(!strcmp(ct_mem_cat_name((ct_mem_cat)c), want[c]));
    ASSERT(ct_mem_cat_name(CT_MEM_NCAT) != NULL);
}

TEST(core_alloc_fault_injection)
{
    snap s0 = take();
    ct_mem_fail_after(2); /* allocations #0 and #1 succeed, #2 fails, the rest succeed */
    void *a = ct_alloc(10, CT_MEM_PARAM);
    void *b = ct_alloc(20, CT_MEM_PARAM);
    ASSERT(a && b);
    ct_clear_error();
    void *c = ct_alloc(30, CT_MEM_PARAM);
    ASSERT(c == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "out of memory");
    ASSERT_STR_CONTAINS(ct_last_error(), "30 bytes");
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - s0.cur[CT_MEM_PARAM], 30); /* the failure counted nothing */
    for (int i = 0; i < 5; i++) {
        void *d = ct_alloc(40, CT_MEM_PARAM);
        ASSERT(d != NULL);
        ct_free(d);
    }
    ct_mem_fail_after(0); /* the very next one */
    ASSERT(ct_alloc(1, CT_MEM_GRAD) == NULL);
    void *e = ct_alloc(1, CT_MEM_GRAD);
    ASSERT(e != NULL);
    ct_mem_fail_after(3);
    ct_mem_fail_after(-1); /* turning it off cancels a pending failure */
    for (int i = 0; i < 6; i++) {
        void *d = ct_alloc(8, CT_MEM_OTHER);
        ASSERT(d != NULL);
        ct_free(d);
    }
    ct_free(a);
    ct_free(b);
    ct_free(e);
    snap s1 = take();
    for (int k = 0; k < CT_MEM_NCAT; k++) ASSERT_EQ(s1.cur[k], s0.cur[k]);
}

TEST(core_alloc_huge_requests_fail_cleanly)
{
    /* Sizes whose rounding up would wrap around must not become small blocks. */
    size_t act0 = ct_mem_current(CT_MEM_ACT);
    size_t huge[] = {SIZE_MAX, SIZE_MAX - 1, SIZE_MAX - 63, SIZE_MAX - 64};
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        ct_clear_error();
        ASSERT(ct_alloc(huge[i], CT_MEM_ACT) == NULL);
        ASSERT_STR_CONTAINS(ct_last_error(), "bytes");
    }
    ASSERT_EQ(ct_mem_current(CT_MEM_ACT), act0);
#if !defined(__SANITIZE_ADDRESS__)
    /* A request the system refuses (ASan would abort on it instead of
     * returning NULL, so only in the plain build). */
    ct_clear_error();
    ASSERT(ct_alloc((size_t)1 << 62, CT_MEM_ACT) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "out of memory");
    ASSERT_STR_CONTAINS(ct_last_error(), "act");
#endif
}

TEST(core_alloc_fault_injection_tensors)
{
    snap s0 = take();
    /* Fails on the tensor header. */
    ct_mem_fail_after(0);
    ct_clear_error();
    ASSERT(ct_tensor_create2(4, 5, CT_MEM_PARAM) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "out of memory");
    /* Fails on the data, after the header succeeded: the header must be freed. */
    ct_mem_fail_after(1);
    ct_clear_error();
    ASSERT(ct_tensor_create2(4, 5, CT_MEM_PARAM) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "out of memory");
    snap s1 = take();
    for (int k = 0; k < CT_MEM_NCAT; k++) ASSERT_EQ(s1.cur[k], s0.cur[k]);

    /* Views and clones under failure leave the source untouched. */
    ct_tensor *t = ct_tensor_create1(16, CT_MEM_ACT);
    ASSERT(t != NULL);
    ct_f32(t)[3] = 7.0f;
    ct_mem_fail_after(0);
    ASSERT(ct_tensor_view(t, 0, 1, (int64_t[]){4}) == NULL);
    ASSERT_EQ(t->refcount, 1);
    ct_mem_fail_after(0);
    ASSERT(ct_tensor_reshape(t, 2, (int64_t[]){4, 4}) == NULL);
    ASSERT_EQ(t->refcount, 1);
    ct_mem_fail_after(1);
    ASSERT(ct_tensor_clone(t, CT_MEM_ACT) == NULL);
    ct_mem_fail_after(-1);
    ct_tensor *c = ct_tensor_clone(t, CT_MEM_ACT);
    ASSERT(c != NULL);
    ASSERT(ct_f32(c)[3] == 7.0f);
    ct_tensor_release(c);
    ct_tensor_release(t);
    s1 = take();
    for (int k = 0; k < CT_MEM_NCAT; k++) ASSERT_EQ(s1.cur[k], s0.cur[k]);
}

/* Large blocks come back from the cache zeroed and are not counted while cached. */
TEST(core_alloc_cache_reuses_large_blocks)
{
    ct_mem_trim();
    size_t base = ct_mem_current(CT_MEM_ACT);
    unsigned char *a = ct_alloc(1 << 20, CT_MEM_ACT);
    ASSERT(a);
    memset(a, 0xAB, 1 << 20);
    ct_free(a);
    ASSERT_EQ(ct_mem_current(CT_MEM_ACT), base);
#if !defined(__SANITIZE_ADDRESS__)
    if (!getenv("CTRAIN_ALLOC_CACHE_MB")) {
        ASSERT(ct_mem_cached() >= (1u << 20));
        unsigned char *b = ct_alloc(1 << 20, CT_MEM_GRAD);
        ASSERT(b == a); /* same block, handed out again */
        for (size_t i = 0; i < (1u << 20); i += 4093) ASSERT_EQ(b[i], 0);
        ASSERT_EQ(ct_alloc_size(b), 1 << 20);
        ASSERT_EQ(ct_mem_current(CT_MEM_GRAD) >= (1u << 20), 1);
        ct_free(b);
    }
#endif
    ct_mem_trim();
    ASSERT_EQ(ct_mem_cached(), 0);
}

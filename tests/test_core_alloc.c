/*
 * Tests of the tracked allocator (src/core/alloc.c) and the memory report
 * (src/core/mem_report.c): per-category counters and peaks against
 * hand-computed sums, the resident peak as a peak of the sum, alignment,
 * zeroing (ct_alloc_zeroed) and its absence (ct_alloc), the cache of large
 * blocks and RSS falling when it is trimmed, the table and JSON forms of the
 * report, and fault injection, including tensors built under an injected
 * failure.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

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
    size_t sizes[] = {0, 1, 3, 63, 64, 65, 100, 4095, 4096, 100000, 65536, 65537, 1 << 20};
    void *p[sizeof sizes / sizeof sizes[0]];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        p[i] = ct_alloc_zeroed(sizes[i], CT_MEM_OTHER);
        ASSERT(p[i] != NULL);
        ASSERT_EQ((uintptr_t)p[i] % 64, 0);
        if (sizes[i] >= 65536) ASSERT_EQ((uintptr_t)p[i] % 4096, 0); /* large blocks are page aligned */
        ASSERT_EQ(ct_alloc_size(p[i]), sizes[i]);
        const unsigned char *b = p[i];
        for (size_t j = 0; j < sizes[i]; j++)
            if (b[j]) ct_test_fail(__FILE__, __LINE__, "byte %zu of a %zu-byte block is %d", j, sizes[i], b[j]);
        memset(p[i], 0xab, sizes[i]); /* dirty it for the reuse below; ASan checks the bounds */
    }
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) ct_free(p[i]);
    /* Zeroed blocks of the same sizes (often the same memory) are zero again. */
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        unsigned char *b = ct_alloc_zeroed(sizes[i], CT_MEM_ACT);
        ASSERT(b != NULL);
        for (size_t j = 0; j < sizes[i]; j++) ASSERT_EQ(b[j], 0);
        ct_free(b);
    }
    ASSERT_EQ(ct_alloc_size(NULL), 0);
}

TEST(core_alloc_cat_names)
{
    const char *want[] = {"param", "grad", "optim", "act", "comm", "data", "other"};
    ASSERT_EQ(CT_MEM_NCAT, 7);
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


/* ---- zeroing and the cache of large blocks ----------------------------- */

/* A freed large block is cached and handed out again as it was: ct_alloc
 * returns it with the old bytes (it does not zero), ct_alloc_zeroed and
 * ct_tensor_create return it zeroed, ct_tensor_empty does not.  The cache is
 * turned on explicitly, so this also runs under AddressSanitizer. */
TEST(core_alloc_zeroed_and_not)
{
    const size_t MB = 1 << 20;
    ct_mem_set_cache_limit(64 * MB);
    ct_mem_trim();
    size_t base = ct_mem_current(CT_MEM_ACT);
    unsigned char *a = ct_alloc(MB, CT_MEM_ACT);
    ASSERT(a);
    memset(a, 0xAB, MB);
    ct_free(a);
    ASSERT_EQ(ct_mem_current(CT_MEM_ACT), base);
    ASSERT_EQ(ct_mem_cached(), MB); /* cached bytes are reported apart from live ones */

    unsigned char *b = ct_alloc(MB, CT_MEM_GRAD);
    ASSERT(b == a); /* the same block, handed out again */
    ASSERT_EQ(ct_mem_cached(), 0);
    ASSERT_EQ(ct_alloc_size(b), MB);
    for (size_t i = 0; i < MB; i += 4093) ASSERT_EQ(b[i], 0xAB); /* not zeroed */
    b[0] = 0x11;
    ct_free(b);

    unsigned char *c = ct_alloc_zeroed(MB, CT_MEM_GRAD);
    ASSERT(c == a);
    for (size_t i = 0; i < MB; i++)
        if (c[i]) ct_test_fail(__FILE__, __LINE__, "byte %zu of a zeroed block is %d", i, c[i]);
    memset(c, 0xCD, MB);
    ct_free(c);

    /* Tensors: empty keeps the old bytes, create zeroes. */
    ct_tensor *e = ct_tensor_empty(CT_U8, 1, (int64_t[]){(int64_t)MB}, CT_MEM_ACT);
    ASSERT(e && ct_tensor_data(e) == (void *)a);
    ASSERT_EQ(((unsigned char *)ct_tensor_data(e))[MB / 2], 0xCD);
    ct_tensor_release(e);
    ct_tensor *z = ct_tensor_create(CT_U8, 1, (int64_t[]){(int64_t)MB}, CT_MEM_ACT);
    ASSERT(z && ct_tensor_data(z) == (void *)a);
    for (size_t i = 0; i < MB; i += 509) ASSERT_EQ(((unsigned char *)ct_tensor_data(z))[i], 0);
    ct_tensor_release(z);

    /* A fresh mapping (nothing cached) comes zeroed by the OS. */
    ct_mem_trim();
    ASSERT_EQ(ct_mem_cached(), 0);
    unsigned char *f = ct_alloc_zeroed(3 * MB + 5, CT_MEM_ACT);
    ASSERT(f);
    for (size_t i = 0; i < 3 * MB + 5; i += 1021) ASSERT_EQ(f[i], 0);
    ASSERT_EQ(f[3 * MB + 4], 0);
    ct_free(f);

    /* Limit 0 turns the cache off: blocks go straight back to the OS. */
    ct_mem_set_cache_limit(0);
    void *g = ct_alloc(MB, CT_MEM_ACT);
    ct_free(g);
    ASSERT_EQ(ct_mem_cached(), 0);
    ASSERT_EQ(ct_mem_current(CT_MEM_ACT), base);
}

/* ---- peaks and the memory report --------------------------------------- */

/* One training step's allocations, by hand: activations, gradients, the
 * optimizer state (created by the first step and kept), a communication
 * buffer; then activations and gradients are freed. */
static void *optim_state;
static void fake_step(void)
{
    void *act1 = ct_alloc(25600, CT_MEM_ACT), *act2 = ct_alloc(12800, CT_MEM_ACT);
    void *gw = ct_alloc_zeroed(40000, CT_MEM_GRAD), *gb = ct_alloc_zeroed(400, CT_MEM_GRAD);
    ASSERT(act1 && act2 && gw && gb);
    ct_free(act2);
    ct_free(act1);
    if (!optim_state) ASSERT((optim_state = ct_alloc_zeroed(80800, CT_MEM_OPTIM)) != NULL);
    void *comm = ct_alloc(40400, CT_MEM_COMM);
    ASSERT(comm);
    ct_free(comm);
    ct_free(gw);
    ct_free(gb);
}

/* r's peaks over the start s0, against the numbers a step gives. */
static void expect_step_peaks(const ct_mem_report *r, const snap *s0)
{
    ASSERT_EQ(r->peak[CT_MEM_PARAM] - s0->cur[CT_MEM_PARAM], 40400);
    ASSERT_EQ(r->peak[CT_MEM_GRAD] - s0->cur[CT_MEM_GRAD], 40400);
    ASSERT_EQ(r->peak[CT_MEM_OPTIM] - s0->cur[CT_MEM_OPTIM], 80800);
    ASSERT_EQ(r->peak[CT_MEM_ACT] - s0->cur[CT_MEM_ACT], 38400);
    ASSERT_EQ(r->peak[CT_MEM_COMM] - s0->cur[CT_MEM_COMM], 40400);
    ASSERT_EQ(r->peak[CT_MEM_DATA] - s0->cur[CT_MEM_DATA], 0);
    ASSERT_EQ(r->peak[CT_MEM_OTHER] - s0->cur[CT_MEM_OTHER], 0);
    /* The highest simultaneous sum: param 40400 + optim 80800 + grads 40400
     * + comm 40400, while the comm buffer is live. */
    ASSERT_EQ(r->peak_total - s0->total, 202000);
    /* Resident: param + grads + optim = 161600 at the optimizer step. */
    size_t res0 = s0->cur[CT_MEM_PARAM] + s0->cur[CT_MEM_GRAD] + s0->cur[CT_MEM_OPTIM];
    ASSERT_EQ(r->peak_resident - res0, 161600);
}

TEST(core_mem_peaks_after_reset_match_a_steady_step)
{
    ct_mem_set_cache_limit(0); /* exact bytes either way; keep the cache out of it */
    snap s0 = take();
    void *w = ct_alloc_zeroed(40000, CT_MEM_PARAM), *b = ct_alloc_zeroed(400, CT_MEM_PARAM);
    ASSERT(w && b);
    ct_mem_reset_peak();
    ct_mem_report r;
    ct_mem_report_get(&r);
    ASSERT_EQ(r.peak[CT_MEM_PARAM] - s0.cur[CT_MEM_PARAM], 40400);
    ASSERT_EQ(r.peak_total - s0.total, 40400);
    ASSERT_EQ(r.peak[CT_MEM_GRAD], r.current[CT_MEM_GRAD]);

    fake_step(); /* the first step also creates the optimizer state */
    ct_mem_report_get(&r);
    expect_step_peaks(&r, &s0);
    ASSERT_EQ(r.current[CT_MEM_OPTIM] - s0.cur[CT_MEM_OPTIM], 80800);
    ASSERT_EQ(r.current_total - s0.total, 121200);
    ASSERT_EQ(r.resident - (s0.cur[CT_MEM_PARAM] + s0.cur[CT_MEM_GRAD] + s0.cur[CT_MEM_OPTIM]), 121200);

    /* Steady state: a reset between steps, then one step, gives the same
     * peaks again, however many steps came before. */
    for (int i = 0; i < 3; i++) {
        fake_step();
        ct_mem_reset_peak();
        ct_mem_report_get(&r);
        ASSERT_EQ(r.peak_total - s0.total, 121200); /* param + optim, nothing else live */
        ASSERT_EQ(r.peak[CT_MEM_ACT], r.current[CT_MEM_ACT]);
        fake_step();
        ct_mem_report_get(&r);
        expect_step_peaks(&r, &s0);
        /* The getters agree with the report. */
        for (int c = 0; c < CT_MEM_NCAT; c++) ASSERT_EQ(ct_mem_peak((ct_mem_cat)c), r.peak[c]);
        ASSERT_EQ(ct_mem_peak_total(), r.peak_total);
    }
    ct_free(optim_state);
    optim_state = NULL;
    ct_free(w);
    ct_free(b);
    snap s1 = take();
    for (int k = 0; k < CT_MEM_NCAT; k++) ASSERT_EQ(s1.cur[k], s0.cur[k]);
}

/* The resident peak is the peak of param + grad + optim together, not the
 * sum of their separate peaks. */
TEST(core_mem_resident_peak_is_peak_of_sum)
{
    ct_mem_reset_peak();
    ct_mem_report r0;
    ct_mem_report_get(&r0);
    void *p = ct_alloc(1000, CT_MEM_PARAM);
    void *g = ct_alloc(3000, CT_MEM_GRAD); /* resident 4000 */
    ct_free(g);                           /* 1000 */
    void *o = ct_alloc(2000, CT_MEM_OPTIM); /* 3000 */
    void *a = ct_alloc(9000, CT_MEM_ACT);   /* not resident */
    ct_mem_report r;
    ct_mem_report_get(&r);
    ASSERT_EQ(r.peak_resident - r0.resident, 4000);
    size_t sum_of_peaks = (r.peak[CT_MEM_PARAM] - r0.current[CT_MEM_PARAM]) +
                          (r.peak[CT_MEM_GRAD] - r0.current[CT_MEM_GRAD]) +
                          (r.peak[CT_MEM_OPTIM] - r0.current[CT_MEM_OPTIM]);
    ASSERT_EQ(sum_of_peaks, 6000); /* what a sum of peaks would wrongly claim */
    ASSERT_EQ(r.resident - r0.resident, 3000);
    ASSERT_EQ(r.peak_total - r0.current_total, 12000); /* 1000 + 2000 + 9000 */

    /* A reset starts the resident peak at the current sum. */
    ct_mem_reset_peak();
    ct_mem_report_get(&r);
    ASSERT_EQ(r.peak_resident - r0.resident, 3000);
    ct_free(o);
    void *g2 = ct_alloc(500, CT_MEM_GRAD); /* 1500 */
    ct_mem_report_get(&r);
    ASSERT_EQ(r.peak_resident - r0.resident, 3000);
    ASSERT_EQ(r.resident - r0.resident, 1500);
    ct_free(g2);
    ct_free(a);
    ct_free(p);
}

/* VmRSS of this process, read independently of the report. */
static size_t proc_rss(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    ASSERT(f);
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmRSS: %llu kB", &kb) == 1) break;
    fclose(f);
    return (size_t)kb << 10;
}

/* 64 MiB in 1 MiB blocks, touched: freeing them into the cache keeps the
 * RSS (and the report says so, apart from live bytes); ct_mem_trim returns
 * them and the RSS falls by most of the 64 MiB.  The way a program really
 * allocates: a large block was freed before (glibc then raises its mmap
 * threshold and serves later large blocks from its heap) and small blocks
 * (tensor headers) are made between the large ones and outlive them. */
TEST(core_mem_rss_falls_after_trim)
{
    enum { NB = 64 };
    const size_t MB = 1 << 20;
    ct_mem_set_cache_limit(256 * MB);
    ct_mem_trim();
    ct_mem_reset_peak();
    ct_mem_report r0, r1, r2, r3;
    ct_mem_report_get(&r0);
    ASSERT(r0.rss > 0);
    ASSERT(r0.peak_rss >= r0.rss);
    ct_free(ct_alloc(4 * MB, CT_MEM_ACT));
    ct_mem_trim();
    void *blk[NB], *small[NB];
    for (int i = 0; i < NB; i++) {
        ASSERT((blk[i] = ct_alloc(MB, CT_MEM_ACT)) != NULL);
        ASSERT((small[i] = ct_alloc(128, CT_MEM_OTHER)) != NULL);
        memset(blk[i], i + 1, MB); /* touch every page */
    }
    ct_mem_report_get(&r1);
    ASSERT_EQ(r1.current[CT_MEM_ACT] - r0.current[CT_MEM_ACT], NB * MB);
    ASSERT(r1.rss >= r0.rss + 60 * MB);
    ASSERT(r1.peak_rss >= r1.rss);

    for (int i = 0; i < NB; i++) ct_free(blk[i]);
    ct_mem_report_get(&r2);
    ASSERT_EQ(r2.current[CT_MEM_ACT], r0.current[CT_MEM_ACT]);
    ASSERT_EQ(r2.cached, NB * MB); /* reported apart from live bytes */
    ASSERT(r2.rss >= r0.rss + 60 * MB); /* the cache still holds the pages */
    ASSERT(r2.peak_rss >= r1.rss);
    printf("    rss: %zu MiB before, %zu MiB allocated, %zu MiB cached", r0.rss / MB, r1.rss / MB, r2.rss / MB);

    ct_mem_trim();
    ct_mem_report_get(&r3);
    printf(", %zu MiB trimmed (peak %zu MiB)\n", r3.rss / MB, r3.peak_rss / MB);
    ASSERT_EQ(r3.cached, 0);
    ASSERT_EQ(ct_mem_cached(), 0);
    ASSERT(r3.rss + 57 * MB <= r2.rss); /* fell by at least 90% of 64 MiB */
    ASSERT(proc_rss() + 57 * MB <= r2.rss);
    ASSERT(r3.peak_rss >= r1.rss); /* the peak remembers */

    /* A reset starts a new peak window at the current RSS. */
    ct_mem_reset_peak();
    ct_mem_report r4;
    ct_mem_report_get(&r4);
    ASSERT(r4.peak_rss + 48 * MB <= r1.rss);
    ASSERT(r4.peak_rss >= r4.rss);
    for (int i = 0; i < NB; i++) ct_free(small[i]);
}

TEST(core_mem_report_json_and_table)
{
    ct_mem_report r;
    memset(&r, 0, sizeof r);
    for (int c = 0; c < CT_MEM_NCAT; c++) {
        r.current[c] = (size_t)(c + 1) * 1000;
        r.peak[c] = (size_t)(c + 1) * 1111;
    }
    r.current_total = 28000;
    r.peak_total = 30000;
    r.resident = 6000;
    r.peak_resident = 7000;
    r.cached = (size_t)3 << 20;
    r.rss = (size_t)100 << 20;
    r.peak_rss = ((size_t)5 << 30) + 1;
    char buf[CT_MEM_REPORT_JSON_MAX];
    ASSERT_OK(ct_mem_report_json(&r, 3, buf, sizeof buf));
    r.peak_cached = (size_t)4 << 20;
    r.cache_limit = (size_t)64 << 20;
    r.life_peak_rss = (size_t)6 << 30;
    r.life_peak_phase = CT_PHASE_WRAP;
    r.phase_peak_rss[CT_PHASE_START] = 1000;
    r.phase_peak_rss[CT_PHASE_WRAP] = (size_t)6 << 30;
    r.phase_peak_rss[CT_PHASE_TEARDOWN] = 2000;
    ASSERT_OK(ct_mem_report_json(&r, 3, buf, sizeof buf));
    ASSERT(!strcmp(buf, "{\"rank\":3,\"param\":1111,\"grad\":2222,\"optim\":3333,\"act\":4444,"
                        "\"comm\":5555,\"data\":6666,\"other\":7777,\"peak_total\":30000,"
                        "\"resident\":7000,\"cached\":3145728,\"peak_cached\":4194304,\"cache_limit\":67108864,"
                        "\"rss\":5368709121,\"rss_life\":6442450944,\"rss_life_phase\":\"wrap\","
                        "\"rss_phases\":{\"start\":1000,\"wrap\":6442450944,\"teardown\":2000}}"));
    /* Too small a buffer is an error, never a cut object. */
    char small[40];
    ASSERT_ERR(ct_mem_report_json(&r, 3, small, sizeof small), CT_EINVAL, "too small");
    ASSERT_STR_CONTAINS(ct_last_error(), "pass at least");
    ASSERT_EQ(small[0], 0);
    /* The largest values still fit the documented size. */
    ct_mem_report big;
    memset(&big, 0xff, sizeof big);
    ASSERT_OK(ct_mem_report_json(&big, -2147483647 - 1, buf, sizeof buf));

    char table[CT_MEM_REPORT_TABLE_MAX];
    ASSERT_OK(ct_mem_report_format(&r, table, sizeof table));
    ASSERT_STR_CONTAINS(table, "current");
    ASSERT_STR_CONTAINS(table, "  param ");
    ASSERT_STR_CONTAINS(table, "1000 B");
    ASSERT_STR_CONTAINS(table, "1.08 KiB"); /* 1111 bytes */
    ASSERT_STR_CONTAINS(table, "  data ");
    ASSERT_STR_CONTAINS(table, "(param + grad + optim)");
    ASSERT_STR_CONTAINS(table, "3.00 MiB");
    ASSERT_STR_CONTAINS(table, "100.0 MiB");
    ASSERT_STR_CONTAINS(table, "5.00 GiB");
    int lines = 0;
    for (const char *s = table; *s; s++) lines += *s == '\n';
    ASSERT_STR_CONTAINS(table, "reached in wrap");
    ASSERT_STR_CONTAINS(table, "6.00 GiB");
    ASSERT_STR_CONTAINS(table, " wrap 6.00 GiB teardown 1.95 KiB");
    ASSERT_STR_CONTAINS(table, "bound 64.0 MiB");
    ASSERT_EQ(lines, 1 + CT_MEM_NCAT + 6);
    ASSERT_OK(ct_mem_report_format(&big, table, sizeof table));
    ASSERT_ERR(ct_mem_report_format(&r, table, 100), CT_EINVAL, "too small");

    /* A live report of this process. */
    ct_mem_report live;
    ct_mem_report_get(&live);
    ASSERT_OK(ct_mem_report_json(&live, 0, buf, sizeof buf));
    ASSERT(!strncmp(buf, "{\"rank\":0,\"param\":", 18));
    ASSERT(live.rss > 0 && live.peak_rss >= live.rss);
}

/* ---- the cache's bound ----------------------------------------------------- */

static size_t live_bytes(void)
{
    size_t n = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) n += ct_mem_current((ct_mem_cat)c);
    return n;
}

/* The automatic bound is CT_MEM_CACHE_UNITS times the largest hint, at least
 * CT_MEM_CACHE_MIN_MB; past it the cache holds what fits, beside the mapped
 * blocks in use, under the most both have held together, and gives blocks
 * back to the OS (largest first, no more than needed) before a new block
 * would take the process past it; a fixed bound has no high-water part; the
 * cache's peak is reported with its bound.  Turned on explicitly, so this also runs
 * under AddressSanitizer. */
TEST(core_alloc_cache_bound_follows_the_largest_unit)
{
    const size_t MB = 1 << 20, floor_b = (size_t)CT_MEM_CACHE_MIN_MB << 20;
    ct_mem_set_cache_limit(CT_MEM_CACHE_AUTO);
    ct_mem_trim();
    ASSERT_EQ(ct_mem_cache_hinted(), 0);
    ASSERT_EQ(ct_mem_get_cache_limit(), floor_b); /* no strategy yet: the floor */
    ct_mem_cache_hint(3 * MB);
    ASSERT_EQ(ct_mem_get_cache_limit(), floor_b);
    ct_mem_cache_hint(20 * MB + 4096);
    ct_mem_cache_hint(5 * MB); /* smaller hints leave the largest */
    ASSERT_EQ(ct_mem_cache_hinted(), 20 * MB + 4096);
    size_t bound = (size_t)CT_MEM_CACHE_UNITS * (20 * MB + 4096);
    ASSERT_EQ(ct_mem_get_cache_limit(), bound);

    /* Free more than the bound in blocks of 16 MiB: all of them were live at
     * once, so all fit under the high-water mark and the cache keeps them. */
    enum { NB = 8 };
    void *blk[NB];
    ct_mem_reset_peak();
    for (int i = 0; i < NB; i++) ASSERT((blk[i] = ct_alloc(16 * MB, CT_MEM_ACT)) != NULL);
    size_t high = ct_mem_life_peak_total();
    ASSERT(high >= live_bytes());
    for (int i = 0; i < NB; i++) ct_free(blk[i]);
    ASSERT_EQ(ct_mem_cached(), NB * 16 * MB);
    ct_mem_report r;
    ct_mem_report_get(&r);
    ASSERT_EQ(r.peak_cached, NB * 16 * MB);
    ASSERT_EQ(r.cache_limit, bound);
    ASSERT_EQ(ct_mem_cached_peak(), NB * 16 * MB);
    ASSERT_EQ(ct_mem_life_peak_total(), high); /* the mark is not moved by caching */

    /* A block none of them serves (more than 16 MiB): before it is mapped
     * the cache gives back 16 MiB blocks until mapped + cached fits under
     * the mark again, or the cache under the bound, and no more. */
    void *big = ct_alloc(100 * MB, CT_MEM_ACT);
    ASSERT(big);
    ct_mem_report_get(&r);
    ASSERT(r.mapped >= 100 * MB);
    ASSERT(r.life_mapped >= NB * 16 * MB);
    size_t cached = ct_mem_cached(), allowed = r.life_mapped - r.mapped > bound ? r.life_mapped - r.mapped : bound;
    ASSERT(cached <= allowed);
    ASSERT(cached + 16 * MB > allowed);
    ASSERT(cached < NB * 16 * MB);
    ct_free(big);

    /* A fixed bound has no high-water part: a smaller one trims at once; a
     * reset starts the peak at what is cached. */
    ct_mem_set_cache_limit(8 * MB);
    ASSERT_EQ(ct_mem_cached(), 0);
    ASSERT_EQ(ct_mem_get_cache_limit(), 8 * MB);
    ct_mem_reset_peak();
    ASSERT_EQ(ct_mem_cached_peak(), 0);
    for (int i = 0; i < 2; i++) ASSERT((blk[i] = ct_alloc(16 * MB, CT_MEM_ACT)) != NULL);
    for (int i = 0; i < 2; i++) ct_free(blk[i]);
    ASSERT_EQ(ct_mem_cached(), 0);
    ct_mem_set_cache_limit(CT_MEM_CACHE_AUTO);
    ASSERT_EQ(ct_mem_get_cache_limit(), bound);
    ct_mem_trim();
}

#ifndef __SANITIZE_ADDRESS__ /* the cache is off under AddressSanitizer */
/* Minor page faults of this process so far. */
static long minor_faults(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
}

/* A step allocates the same sizes in the same order every time, some served
 * by larger cached blocks: once the first steps have mapped what the
 * pattern needs, later steps fault no pages in.  Larger blocks used to give
 * their tails back on reuse and the bound counted requests, not mapped
 * bytes: a small GPT step faulted 2000-3800 pages every step. */
TEST(core_alloc_a_repeated_step_faults_no_pages)
{
    const size_t MB = 1 << 20;
    ct_mem_set_cache_limit(CT_MEM_CACHE_AUTO);
    ct_mem_trim();
    /* a forward keeping activations of mixed sizes, a backward freeing them
     * while it allocates gradients of other sizes */
    static const int fwd[] = {8, 5, 8, 6, 8, 3, 8, 7}, bwd[] = {6, 8, 5, 8};
    enum { NF = sizeof fwd / sizeof *fwd, NBW = sizeof bwd / sizeof *bwd };
    long before = 0;
    for (int step = 0; step < 8; step++) {
        if (step == 3) before = minor_faults();
        unsigned char *a[NF], *g[NBW];
        for (int i = 0; i < NF; i++) {
            ASSERT((a[i] = ct_alloc((size_t)fwd[i] * MB - 4096 * (size_t)i, CT_MEM_ACT)) != NULL);
            memset(a[i], step, (size_t)fwd[i] * MB - 4096 * (size_t)i);
        }
        for (int i = 0; i < NBW; i++) {
            ct_free(a[NF - 1 - i]);
            ASSERT((g[i] = ct_alloc((size_t)bwd[i] * MB, CT_MEM_GRAD)) != NULL);
            memset(g[i], step, (size_t)bwd[i] * MB);
        }
        for (int i = 0; i < NF - NBW; i++) ct_free(a[i]);
        for (int i = 0; i < NBW; i++) ct_free(g[i]);
    }
    long faults = minor_faults() - before;
    if (faults > 256) /* some for the test's own stack and libc; a step's blocks are 16000 pages */
        ct_test_fail(__FILE__, __LINE__, "%ld page faults over 5 repeated steps", faults);
    ct_mem_report r;
    ct_mem_report_get(&r);
    ASSERT(r.cached + r.mapped <= r.life_mapped);
    ct_mem_trim();
}
#endif

/* Each phase keeps its own peak RSS; the whole life's is the largest, named
 * by its phase, and survives the window resets the steady-state report uses. */
TEST(core_mem_phases_name_the_life_peak)
{
    const size_t MB = 1 << 20;
    ct_mem_set_cache_limit(0); /* freed blocks leave at once */
    ct_mem_report r0, r1, r2;
    ct_mem_report_get(&r0);
    ASSERT_EQ(r0.phase, CT_PHASE_START);
    ASSERT(r0.life_peak_rss >= r0.rss);

    ct_mem_phase_begin(CT_PHASE_BUILD);
    ASSERT_EQ(ct_mem_phase_current(), CT_PHASE_BUILD);
    unsigned char *big = ct_alloc(96 * MB, CT_MEM_PARAM);
    ASSERT(big);
    memset(big, 1, 96 * MB);
    ct_free(big); /* gone before the next phase begins: only VmHWM saw it */

    ct_mem_phase_begin(CT_PHASE_TRAIN);
    ct_mem_reset_peak(); /* the steady-state window starts here */
    unsigned char *small = ct_alloc(16 * MB, CT_MEM_ACT);
    ASSERT(small);
    memset(small, 1, 16 * MB);
    ct_mem_report_get(&r1);
    ct_free(small);
    ct_mem_phase_begin(CT_PHASE_TEARDOWN);
    ct_mem_report_get(&r2);

    ASSERT_EQ(r1.phase, CT_PHASE_TRAIN);
    ASSERT_EQ(r2.phase, CT_PHASE_TEARDOWN);
    ASSERT_EQ(r2.life_peak_phase, CT_PHASE_BUILD);
    ASSERT(r2.life_peak_rss >= r0.rss + 90 * MB);
    ASSERT(r2.phase_peak_rss[CT_PHASE_BUILD] >= r0.rss + 90 * MB);
    ASSERT_EQ(r2.phase_peak_rss[CT_PHASE_BUILD], r2.life_peak_rss);
    /* training's own peak holds its 16 MiB, not the build's 96 */
    ASSERT(r2.phase_peak_rss[CT_PHASE_TRAIN] >= r1.rss);
    ASSERT(r2.phase_peak_rss[CT_PHASE_TRAIN] + 60 * MB <= r2.life_peak_rss);
    ASSERT(r1.peak_rss + 60 * MB <= r1.life_peak_rss); /* the window does not see the build */
    ASSERT_EQ(r2.phase_peak_rss[CT_PHASE_WRAP], 0);    /* never entered */
    ASSERT(!strcmp(ct_mem_phase_name(CT_PHASE_SAVE), "save"));
    ASSERT(!strcmp(ct_mem_phase_name(CT_PHASE_N), "?"));
}

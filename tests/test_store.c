/*
 * The store's file back end: what a transfer writes it reads back, bit for
 * bit, whether it goes by direct I/O (a page-aligned block at a
 * page-aligned offset), through the page cache (anything else) or split
 * between the two (an aligned block with a tail); and the aligned blocks do
 * go by direct I/O where the filesystem allows it.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "parallel/store.h"

#define PAGE 4096

/* 1 when a file in dir opens with O_DIRECT (tmpfs and others refuse it). */
static int direct_io_here(const char *dir)
{
    char path[600];
    snprintf(path, sizeof path, "%s/direct-probe-XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0) return 0;
    int d = open(path, O_RDWR | O_DIRECT);
    unlink(path);
    close(fd);
    if (d < 0) return 0;
    close(d);
    return 1;
}

TEST(store_file_moves_aligned_blocks_directly_and_the_rest_through_the_cache)
{
    const char *dir = ct_test_tmpdir();
    if (!direct_io_here(dir)) SKIP("the filesystem of %s refuses O_DIRECT (tmpfs?); set TMPDIR to a disk", dir);
    const size_t big = 4 * PAGE * 64, tail = 100; /* 1 MiB, then a tail */
    ct__ostore *o;
    ASSERT_OK(ct__ostore_open(0, dir, 4 * big, 1, &o));
    unsigned char *src = ct_alloc(big + 2 * PAGE, CT_MEM_OTHER), *dst = ct_alloc(big + 2 * PAGE, CT_MEM_OTHER);
    ASSERT(src && dst && (uintptr_t)src % PAGE == 0 && (uintptr_t)dst % PAGE == 0);
    for (size_t i = 0; i < big + 2 * PAGE; i++) src[i] = (unsigned char)(i * 131 + 7);
    struct {
        size_t src_at, bytes;
        off_t off;
        double direct; /* bytes the file should move directly, write and read back into dst together */
    } cases[] = {
        {0, big, 0, 2.0 * big},                          /* all aligned */
        {0, big + tail, (off_t)big, 2.0 * big},          /* aligned with a tail */
        {1, big, (off_t)(2 * big), (double)big},         /* the written buffer is not aligned; dst is */
        {0, PAGE * 3, (off_t)(3 * big + 512), 0},        /* the offset is not */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        double before = ct__ostore_direct_bytes(o);
        ASSERT_OK(ct__ostore_rw(o, 1, src + cases[c].src_at, cases[c].bytes, cases[c].off));
        memset(dst, 0, big + 2 * PAGE);
        ASSERT_OK(ct__ostore_rw(o, 0, dst, cases[c].bytes, cases[c].off));
        ASSERT(memcmp(dst, src + cases[c].src_at, cases[c].bytes) == 0);
        ASSERT_NEAR(ct__ostore_direct_bytes(o) - before, cases[c].direct, 0.0);
    }
    /* every case's bytes are still there after the others' writes */
    memset(dst, 0, big + 2 * PAGE);
    ASSERT_OK(ct__ostore_rw(o, 0, dst, big, 0));
    ASSERT(memcmp(dst, src, big) == 0);
    ct_free(src);
    ct_free(dst);
    ct__ostore_close(o);
}

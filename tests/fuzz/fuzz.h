/*
 * Shared by the libFuzzer targets (make fuzz): each target is built with
 * clang's -fsanitize=fuzzer,address,undefined over the library's own
 * sources, so a crash, a leak, an overflow or undefined behaviour in a
 * parser stops the run with the input that caused it.  Inputs that only
 * exist as files go through an in-memory file (memfd), so no disk is
 * touched per input.
 */
#ifndef CTRAIN_FUZZ_H
#define CTRAIN_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ctrain/ctrain.h"

/* Replaces the contents of the memfd *fd (made on first use) with data[0..n)
 * and writes its path ("/proc/self/fd/N") into path. */
static inline void fuzz_memfile(int *fd, const uint8_t *data, size_t n, char *path, size_t pn)
{
    if (*fd < 0) *fd = memfd_create("ctrain-fuzz", 0);
    if (*fd < 0) abort();
    if (ftruncate(*fd, 0) != 0 || pwrite(*fd, data, n, 0) != (ssize_t)n) abort();
    snprintf(path, pn, "/proc/self/fd/%d", *fd);
}

/* Every allocation is returned: the tracked allocator's counters prove it. */
static inline size_t fuzz_mem_now(void);

static inline void fuzz_check_no_leak(size_t before)
{
    size_t now = fuzz_mem_now();
    if (now != before) {
        fprintf(stderr, "fuzz: %zu bytes still allocated after the input\n", now - before);
        abort();
    }
}

static inline size_t fuzz_mem_now(void)
{
    size_t now = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) now += ct_mem_current((ct_mem_cat)c);
    return now;
}

#endif

/* Internals shared by the unit runner (tests/runner.c) and the MPI runner. */
#ifndef CTRAIN_TEST_HARNESS_H
#define CTRAIN_TEST_HARNESS_H

#include <setjmp.h>

#include "test.h"

#define CT_MAX_TESTS 1024

typedef struct {
    const char *name;
    ct_test_fn fn;
    const char *file;
} ct_test_entry;

extern ct_test_entry ct_tests[CT_MAX_TESTS];
extern int ct_ntests;
extern jmp_buf ct_test_jmp;

/* Orders tests by file then name, so output is stable. */
void ct_tests_sort(void);

#endif

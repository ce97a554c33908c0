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

/* What ct_test_jmp's setjmp returns when a test ends early. */
#define CT_TEST_JMP_FAIL 1
#define CT_TEST_JMP_SKIP 2
/* Exit status of "run --one NAME" for a skipped test (automake's 77). */
#define CT_TEST_EXIT_SKIP 77

/* Ends the running test's scratch directory: removes it and everything in it
 * (kept, and named on stderr, if failed and CTRAIN_TEST_KEEP_TMP is set).
 * The next ct_test_tmpdir makes a fresh one.  No-op if none was made. */
void ct__test_tmpdir_done(int failed);
/* Removes the scratch directories process pid made and left behind (it
 * crashed or was killed); the runner calls it for every test process. */
void ct__test_tmpdir_reap(int pid);

#endif

/* Test registry, failure reporting and scratch directories shared by both runners. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"

ct_test_entry ct_tests[CT_MAX_TESTS];
int ct_ntests;
jmp_buf ct_test_jmp;

void ct_test_register(const char *name, ct_test_fn fn, const char *file)
{
    if (ct_ntests >= CT_MAX_TESTS) {
        fprintf(stderr, "too many tests: raise CT_MAX_TESTS in tests/harness.h\n");
        abort();
    }
    ct_tests[ct_ntests++] = (ct_test_entry){name, fn, file};
}

void ct_test_fail(const char *file, int line, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "    %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    longjmp(ct_test_jmp, 1);
}

const char *ct_test_tmpdir(void)
{
    static char dir[256];
    if (!dir[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/ctrain-test-%d", base ? base : "/tmp", (int)getpid());
        mkdir(dir, 0700);
    }
    return dir;
}

static int cmp_entry(const void *a, const void *b)
{
    const ct_test_entry *x = a, *y = b;
    int c = strcmp(x->file, y->file);
    return c ? c : strcmp(x->name, y->name);
}

void ct_tests_sort(void) { qsort(ct_tests, (size_t)ct_ntests, sizeof ct_tests[0], cmp_entry); }

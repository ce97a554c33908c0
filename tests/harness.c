/* Test registry, failure and skip reporting, and scratch directories shared
 * by both runners. */
#include <dirent.h>
#include <errno.h>
#include <ftw.h>
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
    longjmp(ct_test_jmp, CT_TEST_JMP_FAIL);
}

void ct_test_skip(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    printf("    skipped: ");
    vprintf(fmt, ap);
    printf("\n");
    fflush(stdout);
    va_end(ap);
    longjmp(ct_test_jmp, CT_TEST_JMP_SKIP);
}

/* ---- scratch directories ----------------------------------------------- */

static char tmpdir[512];

static const char *tmp_base(void)
{
    const char *base = getenv("TMPDIR");
    return base && *base ? base : "/tmp";
}

const char *ct_test_tmpdir(void)
{
    if (!tmpdir[0]) {
        /* The pid in the name lets the runner find and remove the directory
         * of a test process that crashed before it could clean up. */
        snprintf(tmpdir, sizeof tmpdir, "%s/ctrain-test-%d-XXXXXX", tmp_base(), (int)getpid());
        if (!mkdtemp(tmpdir)) {
            char want[sizeof tmpdir];
            snprintf(want, sizeof want, "%s", tmpdir);
            tmpdir[0] = 0;
            ct_test_fail(__FILE__, __LINE__, "cannot make a scratch directory %s: %s; set TMPDIR "
                         "to a writable directory", want, strerror(errno));
        }
    }
    return tmpdir;
}

static int rm_entry(const char *path, const struct stat *st, int type, struct FTW *ftw)
{
    (void)st;
    (void)ftw;
    if (type == FTW_DP) rmdir(path);
    else unlink(path);
    return 0; /* keep going: remove as much as possible */
}

int ct_test_rmtree(const char *path)
{
    if (nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS) != 0) return -1;
    return access(path, F_OK) == 0 ? -1 : 0;
}

void ct__test_tmpdir_done(int failed)
{
    if (!tmpdir[0]) return;
    if (failed && getenv("CTRAIN_TEST_KEEP_TMP"))
        fprintf(stderr, "    scratch files kept in %s\n", tmpdir);
    else if (ct_test_rmtree(tmpdir))
        fprintf(stderr, "    warning: could not remove the scratch directory %s\n", tmpdir);
    tmpdir[0] = 0;
}

void ct__test_tmpdir_reap(int pid)
{
    char prefix[64];
    int n = snprintf(prefix, sizeof prefix, "ctrain-test-%d-", pid);
    DIR *d = opendir(tmp_base());
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (strncmp(e->d_name, prefix, (size_t)n)) continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", tmp_base(), e->d_name);
        if (getenv("CTRAIN_TEST_KEEP_TMP")) fprintf(stderr, "    scratch files kept in %s\n", path);
        else ct_test_rmtree(path);
    }
    closedir(d);
}

static int cmp_entry(const void *a, const void *b)
{
    const ct_test_entry *x = a, *y = b;
    int c = strcmp(x->file, y->file);
    return c ? c : strcmp(x->name, y->name);
}

void ct_tests_sort(void) { qsort(ct_tests, (size_t)ct_ntests, sizeof ct_tests[0], cmp_entry); }

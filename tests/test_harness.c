/*
 * Tests of the test harness itself (tests/runner.c, tests/harness.c): a
 * skipped test is counted as skipped, never as passed, by the unit runner
 * and in the multi-rank suite; scratch directories are gone when a test
 * ends, whether it passed, failed, skipped or crashed.  Each check runs this
 * runner again on a probe test that acts only when CTRAIN_TEST_PROBE names
 * it, and reads the runner's output.
 */
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test.h"

/* Probes: without CTRAIN_TEST_PROBE they pass and do nothing. */
static int probing(const char *what)
{
    const char *p = getenv("CTRAIN_TEST_PROBE");
    return p && !strcmp(p, what);
}

/* Makes a scratch file and prints the directory for the parent to check. */
static void make_scratch(void)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/sub", ct_test_tmpdir());
    ASSERT(mkdir(path, 0700) == 0);
    snprintf(path, sizeof path, "%s/sub/file.txt", ct_test_tmpdir());
    FILE *f = fopen(path, "w");
    ASSERT(f);
    fputs("scratch\n", f);
    fclose(f);
    printf("    scratch=%s\n", ct_test_tmpdir());
    fflush(stdout);
}

TEST(harness_probe)
{
    if (probing("skip")) SKIP("probe asked to skip");
    if (probing("pass")) make_scratch();
    if (probing("fail")) {
        make_scratch();
        ASSERT_EQ(1, 2);
    }
    if (probing("scratch-skip")) {
        make_scratch();
        SKIP("probe skips after making scratch files");
    }
    if (probing("crash")) {
        make_scratch();
        raise(SIGKILL); /* no chance to clean up: the runner must */
    }
}

/* Runs "run ARGS" (this binary) with CTRAIN_TEST_PROBE=probe; output in out. */
static int run_runner(const char *probe, const char *args, char *out, size_t cap)
{
    char self[PATH_MAX], cmd[PATH_MAX + 256];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    ASSERT(n > 0);
    self[n] = 0;
    snprintf(cmd, sizeof cmd, "CTRAIN_TEST_PROBE=%s '%s' %s 2>&1", probe, self, args);
    FILE *p = popen(cmd, "r");
    ASSERT(p);
    size_t len = fread(out, 1, cap - 1, p);
    out[len] = 0;
    int st = pclose(p);
    ASSERT(WIFEXITED(st));
    return WEXITSTATUS(st);
}

/* The scratch directory the probe printed must no longer exist. */
static void expect_scratch_gone(const char *out)
{
    const char *s = strstr(out, "scratch=");
    if (!s) ct_test_fail(__FILE__, __LINE__, "the probe printed no scratch directory:\n%s", out);
    char dir[1024];
    ASSERT_EQ(sscanf(s + 8, "%1023s", dir), 1);
    ASSERT_STR_CONTAINS(dir, "ctrain-test-");
    if (access(dir, F_OK) == 0)
        ct_test_fail(__FILE__, __LINE__, "scratch directory %s is still there", dir);
}

TEST(harness_skip_counts_as_skipped)
{
    static char out[8192];
    int rc = run_runner("skip", "harness_probe", out, sizeof out);
    ASSERT_EQ(rc, 0); /* a skip is not a failure */
    ASSERT_STR_CONTAINS(out, "    skipped: probe asked to skip");
    ASSERT_STR_CONTAINS(out, "skip harness_probe");
    ASSERT_STR_CONTAINS(out, "0 passed, 0 failed, 1 skipped");
    ASSERT(!strstr(out, "ok   harness_probe"));
}

TEST(harness_scratch_removed_after_pass_fail_skip_crash)
{
    static char out[8192];
    ASSERT_EQ(run_runner("pass", "harness_probe", out, sizeof out), 0);
    ASSERT_STR_CONTAINS(out, "1 passed, 0 failed, 0 skipped");
    expect_scratch_gone(out);

    ASSERT_EQ(run_runner("fail", "harness_probe", out, sizeof out), 1);
    ASSERT_STR_CONTAINS(out, "0 passed, 1 failed, 0 skipped");
    expect_scratch_gone(out);

    ASSERT_EQ(run_runner("scratch-skip", "harness_probe", out, sizeof out), 0);
    ASSERT_STR_CONTAINS(out, "0 passed, 0 failed, 1 skipped");
    expect_scratch_gone(out);

    ASSERT_EQ(run_runner("crash", "harness_probe", out, sizeof out), 1);
    ASSERT_STR_CONTAINS(out, "killed by signal");
    expect_scratch_gone(out);
}

TEST(harness_mpi_skip_counts_as_skipped)
{
    char mpi[PATH_MAX + 16], args[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", mpi, PATH_MAX - 1);
    ASSERT(n > 0);
    mpi[n] = 0;
    char *slash = strrchr(mpi, '/');
    ASSERT(slash);
    strcpy(slash + 1, "mpi_run");
    if (access(mpi, X_OK)) SKIP("%s is not built (make it to run this test)", mpi);
    /* The filter matches the multi-rank probe and no unit test. */
    snprintf(args, sizeof args, "--mpi '%s' --np 2 harness_mpi_probe", mpi);
    static char out[16384];
    int rc = run_runner("skip", args, out, sizeof out);
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "runner exited with %d:\n%s", rc, out);
    ASSERT_STR_CONTAINS(out, "skipped: multi-rank probe asked to skip");
    ASSERT_STR_CONTAINS(out, "skip harness_mpi_probe");
    ASSERT_STR_CONTAINS(out, "[np=2]");
    ASSERT_STR_CONTAINS(out, "0 passed, 0 failed, 1 skipped");
}

/*
 * The unit test runner.  Each test runs in a fresh process (fork + exec of
 * this binary with --one NAME) under a timeout, so a crash or a hang fails
 * that test alone.  With --mpi BIN it then runs the multi-rank suite BIN
 * under mpirun at each rank count and counts its per-test lines.  A test
 * that calls SKIP exits with CT_TEST_EXIT_SKIP and counts as skipped, never
 * as passed.  The last line is "N passed, N failed, N skipped".  Scratch
 * directories a test process leaves behind (it crashed) are removed.
 *
 *   run [--timeout S] [--mpi BIN] [--np 2,3,4] [NAME-SUBSTRING...]
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

static int passed, failed, skipped;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int run_one_inprocess(const char *name)
{
    for (int i = 0; i < ct_ntests; i++) {
        if (strcmp(ct_tests[i].name, name)) continue;
        ct_test_fn volatile fn = ct_tests[i].fn;
        int end = setjmp(ct_test_jmp);
        if (end == 0) fn();
        ct__test_tmpdir_done(end == CT_TEST_JMP_FAIL);
        return end == CT_TEST_JMP_SKIP ? CT_TEST_EXIT_SKIP : end == CT_TEST_JMP_FAIL;
    }
    fprintf(stderr, "no test named %s\n", name);
    return 2;
}

static int matches(const char *name, int nfilt, char **filt)
{
    if (nfilt == 0) return 1;
    for (int i = 0; i < nfilt; i++)
        if (strstr(name, filt[i])) return 1;
    return 0;
}

/* Waits for pid up to timeout seconds; kills its process group on expiry. */
static int wait_timeout(pid_t pid, double timeout, int *timed_out)
{
    double end = now() + timeout;
    int st = 0;
    *timed_out = 0;
    for (;;) {
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return st;
        if (now() > end) {
            kill(-pid, SIGKILL);
            waitpid(pid, &st, 0);
            *timed_out = 1;
            return st;
        }
        usleep(2000);
    }
}

static void run_unit(const ct_test_entry *t, double timeout)
{
    double t0 = now();
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        execl("/proc/self/exe", "run", "--one", t->name, (char *)NULL);
        _exit(127);
    }
    int to, st = wait_timeout(pid, timeout, &to);
    double dt = now() - t0;
    ct__test_tmpdir_reap((int)pid);
    if (!to && WIFEXITED(st) && WEXITSTATUS(st) == 0) {
        passed++;
        printf("ok   %-48s %6.2fs\n", t->name, dt);
    } else if (!to && WIFEXITED(st) && WEXITSTATUS(st) == CT_TEST_EXIT_SKIP) {
        skipped++;
        printf("skip %-48s %6.2fs\n", t->name, dt);
    } else {
        failed++;
        if (to) printf("FAIL %-48s timed out after %.0fs\n", t->name, timeout);
        else if (WIFSIGNALED(st)) printf("FAIL %-48s killed by signal %d\n", t->name, WTERMSIG(st));
        else printf("FAIL %-48s (%s)\n", t->name, t->file);
    }
    fflush(stdout);
}

/* Runs the MPI suite at np ranks; every "ok NAME" / "FAIL NAME" / "skip NAME"
 * line of its stdout counts once.  A suite that crashes or hangs counts one failure. */
static void run_mpi(const char *bin, int np, double timeout, int nfilt, char **filt)
{
    int fd[2];
    if (pipe(fd)) { perror("pipe"); failed++; return; }
    char npbuf[16];
    snprintf(npbuf, sizeof npbuf, "%d", np);
    pid_t pid = fork();
    if (pid == 0) {
        setpgid(0, 0);
        dup2(fd[1], 1);
        close(fd[0]);
        close(fd[1]);
        char *argv[64];
        int a = 0;
        argv[a++] = "mpirun";
        argv[a++] = "--oversubscribe";
        argv[a++] = "--bind-to";
        argv[a++] = "none";
        argv[a++] = "-np";
        argv[a++] = npbuf;
        argv[a++] = (char *)bin;
        for (int i = 0; i < nfilt && a < 62; i++) argv[a++] = filt[i];
        argv[a] = NULL;
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
        execvp("mpirun", argv);
        _exit(127);
    }
    close(fd[1]);
    FILE *in = fdopen(fd[0], "r");
    double end = now() + timeout, t0 = now();
    int seen = 0, timed_out = 0;
    char line[512];
    fcntl(fd[0], F_SETFL, O_NONBLOCK);
    size_t len = 0;
    char buf[4096];
    for (;;) {
        struct pollfd p = {fd[0], POLLIN, 0};
        double left = end - now();
        if (left <= 0) { timed_out = 1; break; }
        int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r <= 0) continue;
        ssize_t k = read(fd[0], buf, sizeof buf);
        if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (k <= 0) break;
        for (ssize_t i = 0; i < k; i++) {
            if (buf[i] != '\n') {
                if (len < sizeof line - 1) line[len++] = buf[i];
                continue;
            }
            line[len] = 0;
            len = 0;
            if (!strncmp(line, "ok ", 3)) {
                passed++; seen++;
                printf("ok   %-48s [np=%d]\n", line + 3, np);
            } else if (!strncmp(line, "FAIL ", 5)) {
                failed++; seen++;
                printf("FAIL %-48s [np=%d]\n", line + 5, np);
            } else if (!strncmp(line, "skip ", 5)) {
                skipped++; seen++;
                printf("skip %-48s [np=%d]\n", line + 5, np);
            } else {
                printf("     %s\n", line);
            }
            fflush(stdout);
        }
    }
    int st = 0;
    if (timed_out) kill(-pid, SIGKILL);
    waitpid(pid, &st, 0);
    fclose(in);
    /* A name filter may select no multi-rank test: nothing ran, nothing failed. */
    if (!timed_out && WIFEXITED(st) && WEXITSTATUS(st) == 0 && seen == 0 && nfilt > 0) {
        printf("     mpi suite at %d ranks: no test matched the filter\n", np);
        return;
    }
    if (timed_out || !WIFEXITED(st) || WEXITSTATUS(st) != 0 || seen == 0) {
        failed++;
        printf("FAIL %-48s [np=%d] %s\n", "mpi suite", np,
               timed_out ? "timed out" : seen == 0 ? "ran no test" : "exited with an error");
    } else {
        printf("     mpi suite at %d ranks took %.1fs\n", np, now() - t0);
    }
}

int main(int argc, char **argv)
{
    /* Tests run with the fast BLAS kernel, as the ctrain program does (the
     * test processes inherit the choice through the environment). */
    if (ct_blas_select_kernel(argc, argv) != CT_OK) fprintf(stderr, "run: warning: %s\n", ct_last_error());
    setvbuf(stdout, NULL, _IOLBF, 0);
    ct_tests_sort();
    if (argc == 3 && !strcmp(argv[1], "--one")) {
        alarm(600); /* backstop if the parent dies */
        return run_one_inprocess(argv[2]);
    }
    double timeout = 120;
    const char *mpi_bin = NULL;
    int nps[8] = {2, 3, 4}, nnp = 3, nfilt = 0;
    char *filt[64];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--timeout") && i + 1 < argc) timeout = atof(argv[++i]);
        else if (!strcmp(argv[i], "--mpi") && i + 1 < argc) mpi_bin = argv[++i];
        else if (!strcmp(argv[i], "--np") && i + 1 < argc) {
            nnp = 0;
            for (char *s = strtok(argv[++i], ","); s && nnp < 8; s = strtok(NULL, ",")) nps[nnp++] = atoi(s);
        } else if (nfilt < 64) filt[nfilt++] = argv[i];
    }
    for (int i = 0; i < ct_ntests; i++)
        if (matches(ct_tests[i].name, nfilt, filt)) run_unit(&ct_tests[i], timeout);
    if (mpi_bin) {
        /* The suite's watchdog names a hung test after the same time a unit
         * test gets, not a fixed 30 s a busy machine can exceed. */
        char per[32];
        snprintf(per, sizeof per, "%g", timeout);
        setenv("CTRAIN_MPI_TEST_TIMEOUT", per, 0);
        for (int i = 0; i < nnp; i++) run_mpi(mpi_bin, nps[i], timeout * 4, nfilt, filt);
    }
    printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    return failed ? 1 : 0;
}

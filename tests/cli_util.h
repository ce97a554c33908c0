/* Helpers the tests of the ctrain program share: run it (alone or under
 * mpirun, with a shell prefix), and read numbers, lines and JSON fields
 * out of what it printed, and compare checkpoint files. */
#ifndef CTRAIN_TESTS_CLI_UTIL_H
#define CTRAIN_TESTS_CLI_UTIL_H

#include "test.h"

#define OUT_MAX (1 << 16)

/* Directory holding the ctrain binary (the test binary's "../"). */
const char *cli_bin_dir(void);
/* Runs "PREFIX ctrain ARGS" through sh (np > 0: under mpirun -np np) with
 * stderr joined to stdout into out (OUT_MAX bytes); returns the exit code. */
int run_sh(int np, const char *prefix, char *out, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
#define run_np(np, out, ...) run_sh(np, "", out, __VA_ARGS__)
#define RUN(out, ...) run_sh(0, "", out, __VA_ARGS__)
/* How a run is set up: fault injection for the checkpoint code. */
typedef struct {
    int kill_at;    /* > 0: CTRAIN_FAULT_KILL_AT */
    int fail_at;    /* > 0: CTRAIN_FAULT_FAIL_AT */
} run_env;
/* Runs "sh -c CMD" (CMD's ctrain is build/ctrain; "mpirun ARGS" runs
 * "mpirun --oversubscribe ARGS" with $CTRAIN the ctrain binary) with
 * stderr joined to stdout into out; returns the exit code, or -SIG when a
 * signal ended it. */
int run_cmd(const run_env *env, char *out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* A small data set in the Fashion-MNIST layout under the test's temporary
 * directory (256 training and 64 test images); its directory. */
const char *tiny_data(void);
/* Writes dir/name, an IDX file of n 28x28 images (images != 0) or n labels. */
void write_idx(const char *dir, const char *name, int images, int n);
/* Runs the shell command fmt (np > 0: under mpirun -np np, allowed as root)
 * with stderr joined to stdout into out (OUT_MAX bytes); returns the exit code.
 * For programs other than ctrain (examples, test programs). */
int run_shell(int np, char *out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int count_lines(const char *s);
int occurrences(const char *s, const char *needle);
/* The number after "key" in s (e.g. "final train loss "); fails the test if absent. */
double number_after(const char *s, const char *key);
/* The rest of the line after key into buf. */
void line_after(const char *s, const char *key, char *buf, size_t n);
/* The largest value of "key": in a JSON line (one per rank in a summary). */
double json_max(const char *line, const char *key);
/* Two safetensors files (or sharded directories) hold the same tensors bit for bit. */
void same_files(const char *a, const char *b);

/* A folder under the test's temporary directory holding one text file of
 * the given number of lines (for --data-dir); its path. */
const char *small_text(int lines);

/* Runs the shell command line cmd (join stderr in it yourself) and reads
 * what it prints into out (OUT_MAX bytes); its exit code. */
int capture(const char *cmd, char *out);

/* Entries of dir besides . and ..; fails the test if dir cannot be opened. */
int count_entries(const char *dir);
/* 1 once process pid holds open a file under dir that is already unlinked
 * (an offload store), polling /proc/PID/fd for up to 20 s; 0 if it never did. */
int holds_unlinked_file(int pid, const char *dir);

/* After a job run under scripts/memlimit TAG with np ranks: rank r's peak
 * usage as the kernel counted it (bytes; 0 where unreadable) into peak[r],
 * 1 into killed[r] if the OOM killer struck it; then removes the cgroups. */
void memlimit_collect(const char *tag, int np, double *peak, int *killed);

/* name under the test's temporary directory (8 results live at once). */
char *path_in(const char *name);
/* The whole file at path in a new buffer (free), its length in *n; fails the test if unreadable. */
unsigned char *read_file(const char *path, size_t *n);

#endif

/*
 * What the benchmarks share: medians of repeated timings, and re-launching
 * under mpirun for those that need several ranks when started directly (as
 * `make bench` does), so one command runs them.
 */
#ifndef CTRAIN_BENCH_H
#define CTRAIN_BENCH_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of v[0..n) (sorts v). */
static inline double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* The argv of `mpirun -np np <this program> args...` (calloc'd; free it),
 * using npbuf (16 bytes) and self (4096 bytes) for its strings; NULL
 * (message printed) if this program's path cannot be read. */
static inline char **bench_mpirun_argv(int argc, char **argv, int np, char *npbuf, char *self)
{
    ssize_t len = readlink("/proc/self/exe", self, 4095);
    if (len <= 0) {
        perror("readlink /proc/self/exe");
        return NULL;
    }
    self[len] = 0;
    snprintf(npbuf, 16, "%d", np);
    char **av = calloc((size_t)argc + 8, sizeof *av);
    if (!av) return NULL;
    int a = 0;
    av[a++] = "mpirun";
    av[a++] = "--oversubscribe";
    av[a++] = "--bind-to";
    av[a++] = "none";
    av[a++] = "-np";
    av[a++] = npbuf;
    av[a++] = self;
    for (int i = 1; i < argc; i++) av[a++] = argv[i];
    av[a] = NULL;
    return av;
}

/* Returns if this process already runs under mpirun; otherwise replaces it
 * with `mpirun -np np <this program> args...` (or exits 1 if that fails). */
static inline void bench_relaunch_under_mpirun(int argc, char **argv, int np)
{
    if (getenv("OMPI_COMM_WORLD_SIZE")) return;
    char npbuf[16], self[4096];
    char **av = bench_mpirun_argv(argc, argv, np, npbuf, self);
    if (!av) exit(1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    execvp("mpirun", av);
    perror("cannot start mpirun (install openmpi-bin)");
    exit(1);
}

/* A label ("fsdp:sharding=grad_op") as a key of the machine-readable last
 * line: characters other than letters, digits and '_' become '_'. */
static inline void bench_key(const char *label, char *key, size_t n)
{
    size_t i = 0;
    for (; label[i] && i + 1 < n; i++) {
        char c = label[i];
        key[i] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ? c : '_';
    }
    key[i] = 0;
}

#endif

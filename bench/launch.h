/*
 * Benchmarks that need several ranks re-launch themselves under mpirun when
 * started directly (as `make bench` does), so one command runs them.
 */
#ifndef CTRAIN_BENCH_LAUNCH_H
#define CTRAIN_BENCH_LAUNCH_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Returns if this process already runs under mpirun; otherwise replaces it
 * with `mpirun -np np <this program> args...` (or exits 1 if that fails). */
static void bench_relaunch_under_mpirun(int argc, char **argv, int np)
{
    if (getenv("OMPI_COMM_WORLD_SIZE")) return;
    char npbuf[16], self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) {
        perror("readlink /proc/self/exe");
        exit(1);
    }
    self[len] = 0;
    snprintf(npbuf, sizeof npbuf, "%d", np);
    char **av = calloc((size_t)argc + 8, sizeof *av);
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
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    execvp("mpirun", av);
    perror("cannot start mpirun (install openmpi-bin)");
    exit(1);
}

#endif

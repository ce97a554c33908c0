/*
 * A user's program with a constructor of its own, linked with libctrain
 * (tests/test_core_blas.c runs it).  Linking libctrain must change nothing
 * about how a program starts: the constructor runs once, main sees the
 * environment it was given.  Every run of the constructor appends a line to
 * $CTOR_PROG_LOG, so a re-executed program shows as two lines.
 *
 *   ctor_prog            reports and exits
 *   ctor_prog --select   calls ct_blas_select_kernel first thing, as the
 *                        ctrain program does
 *   ctor_prog --warn     calls ct_blas_warn_if_slow twice
 *   ctor_prog --comm     starts and stops communication (ct_comm_init warns)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ctrain/comm.h"

static int ctor_runs;

__attribute__((constructor)) static void user_ctor(void)
{
    ctor_runs++;
    const char *log = getenv("CTOR_PROG_LOG");
    FILE *f = log ? fopen(log, "a") : NULL;
    if (f) {
        fprintf(f, "constructor ran in pid %d\n", (int)getpid());
        fclose(f);
    }
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--select") && ct_blas_select_kernel(argc, argv) != CT_OK)
        fprintf(stderr, "ctor_prog: %s\n", ct_last_error());
    if (argc > 1 && !strcmp(argv[1], "--warn")) {
        ct_blas_warn_if_slow();
        ct_blas_warn_if_slow(); /* once per process */
    }
    if (argc > 1 && !strcmp(argv[1], "--comm")) {
        if (ct_comm_init(NULL, NULL) != CT_OK) fprintf(stderr, "ctor_prog: %s\n", ct_last_error());
        ct_comm_finalize();
    }
    const char *core = getenv("OPENBLAS_CORETYPE");
    printf("constructor runs in this image: %d\n", ctor_runs);
    printf("OPENBLAS_CORETYPE: %s\n", core ? core : "(unset)");
    printf("OMP_WAIT_POLICY: %s\n", getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "(unset)");
    printf("kernel %s (%s)\n", ct_blas_corename(), ct_blas_kernel_source());
    return 0;
}

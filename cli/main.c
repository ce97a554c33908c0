/* The ctrain program: dispatches subcommands. */
#include <stdio.h>
#include <string.h>

#include "ctrain/ctrain.h"

static int usage(FILE *f)
{
    fprintf(f, "usage: ctrain <command> [options]\n\n"
               "commands:\n"
               "  version    print the version and the BLAS kernel in use\n");
    return f == stderr ? 2 : 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) return usage(stderr);
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "help")) return usage(stdout);
    if (!strcmp(argv[1], "version") || !strcmp(argv[1], "--version")) {
        printf("ctrain %s\nBLAS: OpenBLAS, kernel %s (%s), %d threads\n", CT_VERSION,
               ct_blas_corename(), ct_blas_kernel_source(), ct_blas_get_threads());
        return 0;
    }
    fprintf(stderr, "ctrain: unknown command '%s'; run 'ctrain --help' for the list\n", argv[1]);
    return 2;
}

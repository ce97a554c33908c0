/* The ctrain program: dispatches subcommands; train and eval start MPI themselves. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* Under AddressSanitizer, leak detection is off: Open MPI keeps allocations
 * past MPI_Finalize in plugins it has unloaded, which cannot be suppressed
 * by name.  ctrain's own memory is checked instead (main, at exit). */
#if defined(__SANITIZE_ADDRESS__)
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "detect_leaks=0"; }
#endif

static int usage(FILE *f)
{
    fprintf(f, "usage: ctrain <command> [options]\n\n"
               "commands:\n"
               "  train      train a model (mlp, cnn on Fashion-MNIST; gpt on text), alone or under mpirun\n"
               "  eval       evaluate a checkpoint on the test set (accuracy, confusion matrix; gpt: loss, bits per byte)\n"
               "  sample     generate text from a gpt checkpoint (KV cache)\n"
               "  estimate   predict the memory per rank of every strategy for a model (nothing is trained)\n"
               "  inspect    list the tensors and metadata of a safetensors file\n"
               "  version    print the version and the BLAS kernel in use\n\n"
               "'ctrain <command> --help' describes a command's options.\n");
    return f == stderr ? CLI_USAGE : CLI_OK;
}

static int version(int argc, char **argv)
{
    (void)argv;
    if (argc > 0 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h"))) {
        printf("usage: ctrain version\n\nPrints the version, the BLAS kernel and OpenMP's wait policy, and how "
               "each was chosen.\n");
        return CLI_OK;
    }
    if (argc > 0) {
        fprintf(stderr, "ctrain version: unexpected argument '%s'; it takes none\n", argv[0]);
        return CLI_USAGE;
    }
    /* The paths a GPT step of width 768 takes (oneDNN names its kernel per shape). */
    char f32[64] = "-", bf16[64] = "-", dw[64] = "-";
    if (ct_gemm_onednn_impl(0, 0, 1, 2048, 768, 768, 0.0f, f32, sizeof f32) != CT_OK) snprintf(f32, sizeof f32, "unavailable");
    if (ct_gemm_onednn_impl(1, 0, 1, 2048, 768, 768, 0.0f, bf16, sizeof bf16) != CT_OK) snprintf(bf16, sizeof bf16, "unavailable");
    if (ct_gemm_onednn_impl(1, 1, 0, 768, 768, 2048, 0.0f, dw, sizeof dw) != CT_OK) snprintf(dw, sizeof dw, "unavailable");
    const char *cap = getenv("CTRAIN_ISA");
    char capped[96] = "";
    if (cap) snprintf(capped, sizeof capped, " (capped by CTRAIN_ISA=%.40s)", cap);
    printf("ctrain %s\nCPU: %s, ISA %s%s\nBLAS: OpenBLAS, kernel %s (%s), %d threads\n"
           "OpenMP (oneDNN's threads): wait policy %s\n"
           "paths: f32 products OpenBLAS %s or oneDNN %s (by shape); bf16 products oneDNN %s (weight gradients %s); "
           "bf16 attention %s; threads one OpenMP team per rank for products and ctrain's kernels\n"
           "strategies: %s\nmodels: %s\n", CT_VERSION, ct_cpu_model(), ct_cpu_isa(), capped,
           ct_blas_corename(), ct_blas_kernel_source(), ct_blas_get_threads(), ct_omp_wait_policy(),
           ct_blas_corename(), f32, bf16, dw, ct_attention_bf16_path(64), ct_strategy_list(), ct_model_list());
    return CLI_OK;
}

static int dispatch(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) return usage(stderr);
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) return usage(stdout);
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) return version(argc - 2, argv + 2);
    if (!strcmp(cmd, "train")) return cli_train(argc - 2, argv + 2);
    if (!strcmp(cmd, "eval")) return cli_eval_cmd(argc - 2, argv + 2);
    if (!strcmp(cmd, "inspect")) return cli_inspect(argc - 2, argv + 2);
    if (!strcmp(cmd, "estimate")) return cli_estimate(argc - 2, argv + 2);
    if (!strcmp(cmd, "sample")) return cli_sample(argc - 2, argv + 2);
    fprintf(stderr, "ctrain: unknown command '%s'; run 'ctrain --help' for the list\n", cmd);
    return CLI_USAGE;
}

int main(int argc, char **argv)
{
    /* First thing: may start this program again with OpenBLAS's fast kernel
     * and OpenMP threads that sleep rather than spin. */
    if (ct_blas_select_kernel(argc, argv) != CT_OK) fprintf(stderr, "ctrain: warning: %s\n", ct_last_error());
    int rc = dispatch(argc, argv);
    ct_gemm_cache_clear(); /* oneDNN primitives cached by the products */
#if defined(__SANITIZE_ADDRESS__)
    size_t left = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) left += ct_mem_current((ct_mem_cat)c);
    if (left) {
        fprintf(stderr, "ctrain: %zu bytes from ct_alloc were not freed\n", left);
        if (!rc) rc = 3;
    }
#endif
    return rc;
}

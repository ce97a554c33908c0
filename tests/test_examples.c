/*
 * The examples (examples/, each built by the Makefile against the build
 * tree's ctrain-uninstalled.pc, public headers only) run as a user runs
 * them, so none can rot: the custom layer trains the same under every
 * strategy and resumes to the numbers of one run; the GPT fine-tunes from
 * a checkpoint of `ctrain train` under ddp and pipe to the numbers of one
 * process; and `make install` into a scratch prefix gives files that build
 * and run a program with one pkg-config line (scripts/installcheck.sh).
 */
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_util.h"

/* Under `make sanitize` the examples are ASan builds too: Open MPI's allocations
 * after MPI_Finalize are not ours (see test_comm_single.c), and an example is a
 * user's program, with no hook to turn leak checks off itself.  The children
 * inherit it (this process read its own ASAN_OPTIONS at start). */
static void no_leak_check_in_children(void) { setenv("ASAN_OPTIONS", "detect_leaks=0", 1); }

/* "weights l1 X" of a custom_layer run (fails the test if it did not finish). */
static double custom_run(int np, const char *kind, const char *dir, const char *extra, char *out)
{
    int rc = run_shell(np, out, "%s/examples/custom_layer %s %s 12 %s", cli_bin_dir(), kind, dir, extra);
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "custom_layer %s %s failed (%d):\n%s", kind, extra, rc, out);
    return number_after(out, "weights l1 ");
}

TEST(examples_custom_layer_trains_and_resumes_under_every_strategy)
{
    static char out[OUT_MAX];
    no_leak_check_in_children();
    const char *kinds[] = {"none", "ddp", "zero1", "zero2", "fsdp", "pipe", "offload"};
    char a[PATH_MAX], b[PATH_MAX];
    double ref = 0;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        int np = strcmp(kinds[i], "none") ? 2 : 0; /* "none" is one process */
        snprintf(a, sizeof a, "%s/%s-a", ct_test_tmpdir(), kinds[i]);
        snprintf(b, sizeof b, "%s/%s-b", ct_test_tmpdir(), kinds[i]);
        ASSERT(mkdir(a, 0755) == 0 && mkdir(b, 0755) == 0);
        double straight = custom_run(np, kinds[i], a, "", out);
        double l5 = number_after(out, "step 5 loss "), l12 = number_after(out, "step 12 loss ");
        ASSERT(l12 < l5 * 0.9); /* it learns */
        custom_run(np, kinds[i], b, "--until 6", out);
        double resumed = custom_run(np, kinds[i], b, "--resume", out);
        ASSERT_STR_CONTAINS(out, "steps 6 to 12");
        ASSERT_CLOSE(resumed, straight, 1e-7, 0); /* the same numbers as one run */
        if (i == 0) ref = straight;
        ASSERT_CLOSE(straight, ref, 1e-5, 0);     /* and as one process */
    }
}

TEST(examples_gpt_finetune_under_ddp_and_pipe)
{
    static char out[OUT_MAX];
    no_leak_check_in_children();
    const char *tmp = ct_test_tmpdir();
    char txt[PATH_MAX], path[PATH_MAX + 16];
    snprintf(txt, sizeof txt, "%s/text", tmp);
    ASSERT(mkdir(txt, 0755) == 0);
    snprintf(path, sizeof path, "%s/a.txt", txt);
    FILE *f = fopen(path, "w");
    ASSERT(f != NULL);
    const char *words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat"};
    uint64_t r = 1;
    for (int line = 0; line < 500; line++) {
        for (int w = 0; w < 10; w++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            fprintf(f, "%s%s", w ? " " : "", words[(r >> 33) % 10]);
        }
        fputc('\n', f);
    }
    fclose(f);
    ASSERT_EQ(RUN(out, "train --model gpt --layers 2 --heads 2 --dim 32 --context 32 --steps 30 --batch 8 "
                       "--lr 0.003 --data-dir %s --save %s/gpt.safetensors --log-every 0", txt, tmp), 0);
    double before = 0, after = 0;
    const char *kinds[] = {"none", "ddp", "pipe"};
    for (int i = 0; i < 3; i++) {
        int rc = run_shell(i ? 2 : 0, out, "%s/examples/gpt_finetune %s/gpt.safetensors %s 20 %s", cli_bin_dir(), tmp,
                         txt, kinds[i]);
        if (rc != 0) ct_test_fail(__FILE__, __LINE__, "gpt_finetune %s failed (%d):\n%s", kinds[i], rc, out);
        double b = number_after(out, "val loss before "), a = number_after(out, "val loss after ");
        ASSERT(a < b - 0.05); /* fine-tuning lowers the validation loss */
        ASSERT_STR_CONTAINS(out, "sample: The ");
        if (i == 0) before = b, after = a;
        ASSERT_CLOSE(b, before, 1e-6, 0); /* the checkpoint loads the same under every strategy */
        ASSERT_CLOSE(a, after, 1e-4, 0);  /* and trains as one process */
    }
}

TEST(examples_install_into_a_prefix_builds_a_program)
{
    static char out[OUT_MAX];
    no_leak_check_in_children();
    /* The build directory is the test binary's parent; the Makefile sits beside it. */
    char b[PATH_MAX];
    ASSERT(realpath(cli_bin_dir(), b) != NULL);
    char *slash = strrchr(b, '/');
    ASSERT(slash != NULL);
    *slash = 0;
    if (chdir(b) != 0 || access("Makefile", R_OK) != 0) SKIP("no Makefile beside %s (not a source tree)", cli_bin_dir());
    int rc = run_shell(0, out, "sh scripts/installcheck.sh %s %s", slash + 1, ct_test_tmpdir());
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "scripts/installcheck.sh failed (%d):\n%s", rc, out);
    ASSERT_STR_CONTAINS(out, "installcheck: ok");
    ASSERT_STR_CONTAINS(out, "step 6 loss");
}

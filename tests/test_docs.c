/*
 * Text that must match the code: train --help names every model and
 * strategy the library has; --strategy-opt help alone lists every
 * strategy's keys; the inspect error for a directory names a flag that
 * exists; parallel.h's header names every strategy; and the checkpoints of
 * every model load strictly into PyTorch's module with the script the README
 * shows (scripts/load_in_pytorch.py; skipped without torch).
 */
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_util.h"

/* Calls f(name, ud) for every name of a "a, b, c" list. */
static void each_name(const char *list, void (*f)(const char *name, void *ud), void *ud)
{
    char name[64];
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ",");
        snprintf(name, sizeof name, "%.*s", (int)len, p);
        f(name, ud);
        p += len;
        p += strspn(p, ", ");
    }
}

static void in_help_line(const char *name, void *line)
{
    ASSERT_STR_CONTAINS((const char *)line, name);
}

TEST(docs_train_help_names_every_model_and_strategy)
{
    static char out[OUT_MAX];
    char line[512];
    ASSERT_EQ(RUN(out, "train --help"), 0);
    line_after(out, "  --model NAME", line, sizeof line);
    each_name(ct_model_list(), in_help_line, line);
    line_after(out, "  --strategy NAME", line, sizeof line);
    each_name(ct_strategy_list(), in_help_line, line);
}

static void keys_listed(const char *name, void *out)
{
    char want[96];
    snprintf(want, sizeof want, "--strategy %s takes --strategy-opt", name);
    ASSERT_STR_CONTAINS((const char *)out, want);
}

TEST(docs_strategy_opt_help_alone_lists_every_strategy)
{
    static char out[OUT_MAX];
    ASSERT_EQ(RUN(out, "train --strategy-opt help"), 0);
    each_name(ct_strategy_list(), keys_listed, out);
    ASSERT_STR_CONTAINS(out, "grad_accum=");
    ASSERT_STR_CONTAINS(out, "bucket_cap_mb=");
    /* with --strategy: that one only */
    ASSERT_EQ(RUN(out, "train --strategy fsdp --strategy-opt help"), 0);
    ASSERT_EQ(occurrences(out, "takes --strategy-opt"), 1);
    /* estimate's too, without a model */
    ASSERT_EQ(RUN(out, "estimate --strategy-opt help"), 0);
    ASSERT_STR_CONTAINS(out, "--strategy zero2 takes --strategy-opt");
}

TEST(docs_inspect_of_a_directory_names_a_real_flag)
{
    static char out[OUT_MAX], help[OUT_MAX];
    ASSERT(RUN(out, "inspect %s", ct_test_tmpdir()) != 0);
    ASSERT_STR_CONTAINS(out, "--state-dict sharded");
    ASSERT_EQ(RUN(help, "train --help"), 0);
    ASSERT_STR_CONTAINS(help, "--state-dict FMT");
}

static void in_header(const char *name, void *text)
{
    char quoted[80];
    snprintf(quoted, sizeof quoted, "\"%s\"", name);
    ASSERT_STR_CONTAINS((const char *)text, quoted);
}

TEST(docs_parallel_header_names_every_strategy)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/../include/ctrain/parallel.h", cli_bin_dir());
    FILE *f = fopen(path, "r");
    if (!f) SKIP("%s is missing (not a source tree)", path);
    static char text[1 << 16];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    char *end = strstr(text, "#ifndef CTRAIN_PARALLEL_H"); /* the header comment: the kinds, quoted */
    ASSERT(end != NULL);
    *end = 0;
    each_name(ct_strategy_list(), in_header, text);
}

/* The README's recipe: scripts/load_in_pytorch.py builds nn.Sequential (mlp,
 * with and without dropout, and cnn) or nanoGPT's GPT (the tied head given
 * both names) and loads the checkpoint with strict=True. */
TEST(docs_checkpoints_load_strictly_in_pytorch)
{
    static char out[OUT_MAX];
    if (system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) SKIP("/usr/bin/python3 cannot import torch");
    const char *tmp = ct_test_tmpdir(), *txt = small_text(400);
    ASSERT_EQ(RUN(out, "train --model gpt --layers 2 --heads 2 --dim 16 --context 16 --steps 2 --batch 4 "
                       "--data-dir %s --save %s/gpt.safetensors --log-every 0", txt, tmp), 0);
    ASSERT_EQ(run_np(2, out, "train --model gpt --layers 2 --heads 2 --dim 16 --context 16 --steps 2 --batch 4 "
                             "--data-dir %s --save %s/gpt-sharded --state-dict sharded --log-every 0", txt, tmp), 0);
    int rc = RUN(out, "train --model mlp --hidden 16 --steps 2 --batch 16 --save %s/mlp.safetensors --log-every 0", tmp);
    if (rc == 1 && strstr(out, "fashion-mnist")) SKIP("the Fashion-MNIST files are missing");
    ASSERT_EQ(rc, 0);
    ASSERT_EQ(RUN(out, "train --model mlp --hidden 16,8 --dropout 0.3 --steps 2 --batch 16 "
                       "--save %s/mlpd.safetensors --log-every 0", tmp), 0);
    ASSERT_EQ(RUN(out, "train --model cnn --hidden 4,8,16 --steps 2 --batch 16 --save %s/cnn.safetensors "
                       "--log-every 0", tmp), 0);
    rc = run_shell(0, out, "/usr/bin/python3 %s/../scripts/load_in_pytorch.py %s/mlp.safetensors %s/mlpd.safetensors "
                           "%s/cnn.safetensors %s/gpt.safetensors %s/gpt-sharded", cli_bin_dir(), tmp, tmp, tmp, tmp, tmp);
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "load_in_pytorch.py failed (%d):\n%s", rc, out);
    ASSERT_EQ(occurrences(out, "strictly"), 5);
    ASSERT_STR_CONTAINS(out, "strictly: mlp, 6 tensors, output [1, 10]");
    ASSERT_STR_CONTAINS(out, "strictly: cnn, 8 tensors, output [1, 10]");
    ASSERT_STR_CONTAINS(out, "strictly: gpt, 28 tensors, output [1, 16, 256]");
}

/*
 * Text that must match the code: train --help names every model and
 * strategy the library has; --strategy-opt help alone lists every
 * strategy's keys; the inspect error for a directory names a flag that
 * exists; parallel.h's header names every strategy; the README's feature
 * table names only tests, flags, options and calls that exist; and the
 * checkpoints of every model load strictly into PyTorch's module with the
 * script the README shows (scripts/load_in_pytorch.py; skipped without torch).
 */
#include <dirent.h>
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

/* Every file of dir (under the source tree) ending in ext, appended to buf
 * (*len of cap bytes used), NUL-terminated. */
static void append_files(const char *dir, const char *ext, char *buf, size_t *len, size_t cap)
{
    char path[1400];
    snprintf(path, sizeof path, "%s/../%s", cli_bin_dir(), dir);
    DIR *d = opendir(path);
    ASSERT(d != NULL);
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t nl = strlen(e->d_name), el = strlen(ext);
        if (nl <= el || strcmp(e->d_name + nl - el, ext)) continue;
        snprintf(path, sizeof path, "%s/../%s/%s", cli_bin_dir(), dir, e->d_name);
        size_t n;
        unsigned char *text = read_file(path, &n);
        ASSERT(*len + n + 1 < cap);
        memcpy(buf + *len, text, n);
        *len += n;
        buf[*len] = 0;
        free(text);
    }
    closedir(d);
}

/* 1 if word occurs in text after prefix and not followed by a name character. */
static int has_word(const char *text, const char *prefix, const char *word)
{
    char needle[200];
    snprintf(needle, sizeof needle, "%s%s", prefix, word);
    size_t n = strlen(needle);
    for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle)) {
        char c = p[n];
        if (!(c == '_' || c == '-' || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return 1;
    }
    return 0;
}

/* Calls fn on each backticked word of the cell [a, b); how many. */
static int each_code(const char *a, const char *b, void (*fn)(const char *word, void *ud), void *ud)
{
    int n = 0;
    for (const char *p = a; p < b; p++) {
        if (*p != '`') continue;
        const char *q = memchr(p + 1, '`', (size_t)(b - p - 1));
        if (!q) break;
        char w[160];
        snprintf(w, sizeof w, "%.*s", (int)(q - p - 1), p + 1);
        fn(w, ud);
        n++;
        p = q;
    }
    return n;
}

typedef struct {
    const char *tests, *headers, *help, *opts;
} docs_refs;

/* A word of the ctrain column: a flag in a --help, a key=value strategy
 * option, or a ct_ name of the public headers. */
static void check_ctrain_word(const char *w, void *ud)
{
    const docs_refs *r = ud;
    char name[160];
    snprintf(name, sizeof name, "%s", w);
    name[strcspn(name, " =.(")] = 0;
    if (!strncmp(w, "--", 2)) {
        if (!has_word(r->help, "  ", name)) ct_test_fail(__FILE__, __LINE__, "feature table: flag %s is in no --help", name);
    } else if (strchr(w, '=')) {
        if (!has_word(r->opts, "  ", name)) ct_test_fail(__FILE__, __LINE__, "feature table: %s is no strategy option", name);
    } else if (!strncmp(w, "ct_", 3)) {
        if (!has_word(r->headers, " ", name) && !has_word(r->headers, "*", name))
            ct_test_fail(__FILE__, __LINE__, "feature table: %s is not in include/ctrain", name);
    }
}

static void check_test_word(const char *w, void *ud)
{
    const docs_refs *r = ud;
    char needle[200];
    snprintf(needle, sizeof needle, "TEST(%s)", w);
    if (!strstr(r->tests, needle)) ct_test_fail(__FILE__, __LINE__, "feature table: no test %s in tests/", w);
}

TEST(docs_feature_table_names_real_tests_flags_and_options)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/../README.md", cli_bin_dir());
    if (access(path, R_OK)) SKIP("%s is missing (not a source tree)", path);
    size_t n;
    char *readme = (char *)read_file(path, &n);
    readme[n] = 0;
    const size_t cap = 16u << 20;
    char *tests = malloc(cap), *headers = malloc(1u << 20);
    static char help[3 * OUT_MAX], opts[OUT_MAX];
    ASSERT(tests && headers);
    size_t tl = 0, hl = 0;
    append_files("tests", ".c", tests, &tl, cap);
    append_files("tests/mpi", ".c", tests, &tl, cap);
    append_files("include/ctrain", ".h", headers, &hl, 1u << 20);
    ASSERT_EQ(RUN(help, "train --help"), 0);
    size_t l = strlen(help);
    ASSERT_EQ(RUN(help + l, "estimate --help"), 0);
    ASSERT_EQ(RUN(opts, "train --strategy-opt help"), 0);
    docs_refs r = {tests, headers, help, opts};
    const char *sec = strstr(readme, "\n## Feature table");
    ASSERT(sec != NULL);
    const char *end = strstr(sec + 1, "\n## ");
    ASSERT(end != NULL);
    int rows = 0, named = 0;
    for (const char *line = sec; line && line < end; line = strchr(line + 1, '\n')) {
        const char *p = line + 1, *eol = strchr(p, '\n');
        if (strncmp(p, "| ", 2) || !strncmp(p, "| Option", 8)) continue;
        /* | option | ctrain | tests |: the cells between the bars (cells hold no bar) */
        const char *b1 = memchr(p + 1, '|', (size_t)(eol - p - 1));
        const char *b2 = b1 ? memchr(b1 + 1, '|', (size_t)(eol - b1 - 1)) : NULL;
        const char *b3 = b2 ? memchr(b2 + 1, '|', (size_t)(eol - b2 - 1)) : NULL;
        if (!b3) ct_test_fail(__FILE__, __LINE__, "feature table: a row without three cells: %.*s", (int)(eol - p), p);
        each_code(b1 + 1, b2, check_ctrain_word, &r);
        named += each_code(b2 + 1, b3, check_test_word, &r);
        rows++;
    }
    ASSERT(rows >= 80); /* the five tables were read */
    ASSERT(named >= 80);
    free(tests);
    free(headers);
    free(readme);
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

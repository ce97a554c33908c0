/*
 * `ctrain train --strategy offload` as a user runs it: an offloaded run
 * saves the checkpoint a plain run saves, bit for bit (with dropout,
 * activation checkpointing and micro-batches), resumes under another
 * strategy, runs over 2 ranks like one process, keeps its resident memory
 * under --max-resident-mb, leaves nothing in --offload-dir whatever way it
 * ends (SIGTERM included), and a full disk or a bad directory is one clear
 * line that leaves the last checkpoint as it was.
 */
#include <dirent.h>
#include <libgen.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli_util.h"

/* path gets NAME under the test's temporary directory, made there (it must not exist yet). */
static void make_dir(char *path, size_t n, const char *name)
{
    snprintf(path, n, "%s/%s", ct_test_tmpdir(), name);
    ASSERT(mkdir(path, 0700) == 0);
}

#define SMALL "--model mlp --hidden 64,32 --limit-train 1000 --limit-test 200 --threads 1 --log-every 0 --seed 4"
#define B48 " --batch 48"

/* Offloaded training writes the checkpoint plain training writes. */
TEST(cli_offload_checkpoint_equals_plain_run)
{
    static char out[OUT_MAX];
    char dir[4096], a[4096], b[4096], oa[4096], ob[4096];
    make_dir(dir, sizeof dir, "store");
    const char *tmp = ct_test_tmpdir();
    static const char *const cases[][2] = {
        {"--dropout 0.2", "--slices 3"},
        {"--dropout 0.2", "--slices 2 --checkpoint-activation --max-resident-mb 1"},
        {"--dropout 0.2 --grad-accum 4", "--dropout 0.2 --slices 3 --checkpoint-activation --microbatches 4"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        snprintf(a, sizeof a, "%s/plain%zu.safetensors", tmp, k);
        snprintf(b, sizeof b, "%s/off%zu.safetensors", tmp, k);
        int code = RUN(out, "train " SMALL B48 " --steps 25 --clip 0.5 %s --strategy none --save %s", cases[k][0], a);
        if (code) ct_test_fail(__FILE__, __LINE__, "plain run failed:\n%s", out);
        double la = number_after(out, "final train loss ");
        const char *extra = strstr(cases[k][1], "--dropout") ? "" : cases[k][0];
        code = RUN(out, "train " SMALL B48 " --steps 25 --clip 0.5 %s --strategy offload %s --offload-dir %s --save %s",
                   extra, cases[k][1], dir, b);
        if (code) ct_test_fail(__FILE__, __LINE__, "offloaded run failed:\n%s", out);
        ASSERT_STR_CONTAINS(out, "offload: ");
        ASSERT_STR_CONTAINS(out, "hidden behind compute");
        ASSERT(number_after(out, "final train loss ") == la);
        same_files(a, b);
        snprintf(oa, sizeof oa, "%s/plain%zu.optim.safetensors", tmp, k);
        snprintf(ob, sizeof ob, "%s/off%zu.optim.safetensors", tmp, k);
        same_files(oa, ob);
        ASSERT_EQ(count_entries(dir), 0);
    }
}

/* An offloaded checkpoint resumes under "none" (and a plain one under
 * offload) exactly where a straight run goes.  The save falls mid-epoch
 * (20 steps of 48 make an epoch of the 1000 samples): a resume exactly at
 * an epoch's end is not bit-exact even between plain runs (reported). */
TEST(cli_offload_resume_in_other_strategies)
{
    static char out[OUT_MAX];
    const char *tmp = ct_test_tmpdir();
    char a[4096], b[4096], c[4096], d[4096];
    snprintf(a, sizeof a, "%s/a.safetensors", tmp);
    snprintf(b, sizeof b, "%s/b.safetensors", tmp);
    snprintf(c, sizeof c, "%s/c.safetensors", tmp);
    snprintf(d, sizeof d, "%s/d.safetensors", tmp);
    int code = RUN(out, "train " SMALL B48 " --steps 17 --strategy offload --slices 3 --save %s", a);
    if (code) ct_test_fail(__FILE__, __LINE__, "first half failed:\n%s", out);
    code = RUN(out, "train --resume %s --steps 40 --threads 1 --limit-train 1000 --limit-test 200 --log-every 0 "
               "--strategy none --save %s", a, b);
    if (code) ct_test_fail(__FILE__, __LINE__, "resume under none failed:\n%s", out);
    code = RUN(out, "train " SMALL B48 " --steps 40 --strategy none --save %s", c);
    if (code) ct_test_fail(__FILE__, __LINE__, "straight run failed:\n%s", out);
    same_files(b, c);
    code = RUN(out, "train " SMALL B48 " --steps 17 --strategy none --save %s", a);
    if (code) ct_test_fail(__FILE__, __LINE__, "plain first half failed:\n%s", out);
    code = RUN(out, "train --resume %s --steps 40 --threads 1 --limit-train 1000 --limit-test 200 --log-every 0 "
               "--strategy offload --slices 2 --save %s", a, d);
    if (code) ct_test_fail(__FILE__, __LINE__, "resume under offload failed:\n%s", out);
    same_files(d, c);
}

/* Two ranks, each offloading its replica, reach the loss of one process. */
TEST(cli_offload_two_ranks_match_one_process)
{
    static char out[OUT_MAX];
    int code = RUN(out, "train " SMALL " --steps 30 --batch 49 --strategy none");
    if (code) ct_test_fail(__FILE__, __LINE__, "single process failed:\n%s", out);
    double l1 = number_after(out, "final train loss ");
    code = run_sh(2, "", out, "train " SMALL " --steps 30 --batch 49 --strategy offload --slices 3");
    if (code) ct_test_fail(__FILE__, __LINE__, "offload at 2 ranks failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "over 2 ranks (offload)");
    ASSERT_NEAR(number_after(out, "final train loss "), l1, 1e-4);
}

/* The memory report's peak resident stays under --max-resident-mb for a
 * model whose parameters, gradients and AdamW state are 4x more. */
TEST(cli_offload_resident_under_budget)
{
    static char out[OUT_MAX];
    /* 784*512 + 512*256 + 256*256 + 256*10 parameters: the first layer alone is 6.1 MiB at 16 bytes each */
    int code = RUN(out, "train --model mlp --hidden 512,256,256 --limit-train 500 --limit-test 100 --threads 1 "
                   "--log-every 0 --steps 3 --strategy offload --slices 4 --max-resident-mb 2");
    ASSERT_EQ(code, 2);
    ASSERT_STR_CONTAINS(out, "over the budget of 2 MiB; use more slices");
    /* 784*256 + 15*(256*256) + 256*10 parameters and biases (1190410): 18.2 MiB at 16 bytes, 4.5x the budget */
    char hidden[512] = "256";
    for (int k = 0; k < 15; k++) strcat(hidden, ",256");
    code = RUN(out, "train --model mlp --hidden %s --limit-train 500 --limit-test 100 --threads 1 "
               "--log-every 0 --steps 3 --strategy offload --slices 8 --max-resident-mb 4", hidden);
    ASSERT_STR_CONTAINS(out, "(1190410 parameters)");
    if (code) ct_test_fail(__FILE__, __LINE__, "budgeted run failed:\n%s", out);
    const char *p = strstr(out, "  resident");
    ASSERT(p);
    double v = atof(p + 10);
    const char *unit = p + 10 + strspn(p + 10, " 0123456789.");
    double bytes = v * (!strncmp(unit, "MiB", 3) ? 1048576.0 : !strncmp(unit, "KiB", 3) ? 1024.0 : 1.0);
    if (bytes > 4 * 1048576.0) ct_test_fail(__FILE__, __LINE__, "peak resident %g bytes over 4 MiB:\n%s", bytes, out);
    ASSERT(bytes > 0);
}

/* The store's file sits in --offload-dir while the run lives (open,
 * already unlinked) and nothing is left after SIGTERM or SIGKILL. */
TEST(cli_offload_dir_left_empty_on_signals)
{
    char dir[4096];
    make_dir(dir, sizeof dir, "store");
    int sigs[] = {SIGTERM, SIGKILL, SIGINT};
    for (int k = 0; k < 3; k++) {
        pid_t pid = fork();
        ASSERT(pid >= 0);
        if (pid == 0) {
            char bin[2048];
            snprintf(bin, sizeof bin, "%s/ctrain", cli_bin_dir());
            freopen("/dev/null", "w", stdout);
            freopen("/dev/null", "w", stderr);
            /* a test run started in the background inherits SIGINT ignored
             * (the shell's rule for asynchronous commands), which exec
             * keeps: the run then trained its 100000 steps (280 s) */
            signal(SIGINT, SIG_DFL);
            signal(SIGTERM, SIG_DFL);
            execl(bin, bin, "train", "--model", "mlp", "--hidden", "64,32", "--limit-train", "1000", "--threads", "1",
                  "--steps", "100000", "--log-every", "0", "--strategy", "offload", "--slices", "3", "--offload-dir",
                  dir, (char *)NULL);
            _exit(127);
        }
        int seen = holds_unlinked_file((int)pid, dir);
        ASSERT_EQ(count_entries(dir), 0);
        kill(pid, sigs[k]);
        int st;
        ASSERT(waitpid(pid, &st, 0) == pid);
        if (!seen) ct_test_fail(__FILE__, __LINE__, "the run never held a store file in %s", dir);
        ASSERT(!WIFEXITED(st) || WEXITSTATUS(st) != 127);
        ASSERT_EQ(count_entries(dir), 0);
    }
}

/* A disk that cannot take the store (a file size limit: EFBIG, as a full
 * disk gives ENOSPC) and a directory that is not there are one clear line,
 * exit 1, and the checkpoint the run resumed from and would save to is
 * untouched. */
TEST(cli_offload_full_disk_and_bad_dir_keep_checkpoint)
{
    static char out[OUT_MAX];
    const char *tmp = ct_test_tmpdir();
    char ck[4096], copy[4096], dir[4096];
    make_dir(dir, sizeof dir, "store");
    snprintf(ck, sizeof ck, "%s/ck.safetensors", tmp);
    snprintf(copy, sizeof copy, "%s/copy.safetensors", tmp);
#define BIG "--model mlp --hidden 1024,1024 --limit-train 200 --limit-test 100 --threads 1 --log-every 0 --batch 20"
    int code = RUN(out, "train " BIG " --steps 2 --save %s", ck);
    if (code) ct_test_fail(__FILE__, __LINE__, "first run failed:\n%s", out);
    code = RUN(out, "train " BIG " --steps 2 --save %s", copy);
    ASSERT_EQ(code, 0);
    /* files of 10 MB at most (MPI's own start-up files fit): the store's 28 MiB do not */
    code = run_sh(0, "trap '' XFSZ; ulimit -f 20000;", out,
                  "train --resume %s --steps 4 --threads 1 --limit-train 200 --log-every 0 --strategy offload "
                  "--slices 3 --offload-dir %s --save %s", ck, dir, ck);
    ASSERT_EQ(code, 1);
    ASSERT_STR_CONTAINS(out, "File too large");
    ASSERT_STR_CONTAINS(out, "--offload-dir");
    ASSERT_EQ(count_entries(dir), 0);
    same_files(ck, copy);
    code = RUN(out, "train --resume %s --steps 4 --threads 1 --limit-train 200 --log-every 0 --strategy offload "
               "--offload-dir %s/missing --save %s", ck, tmp, ck);
    ASSERT_EQ(code, 1);
    ASSERT_STR_CONTAINS(out, "No such file or directory; create it or pass --offload-dir");
    same_files(ck, copy);
}

/* `ctrain estimate`'s offload row against the memory report of a run:
 * param, grad, optim and resident within 10%, activations within 25%. */
static void estimate_matches_model(int np, const char *model, const char *data, const char *extra, double act_tol)
{
    static char out[OUT_MAX], est[OUT_MAX];
    char metrics[1024], line[8192] = "";
    snprintf(metrics, sizeof metrics, "%s/est-%d.jsonl", ct_test_tmpdir(), np);
    int code = run_sh(np, "", out, "train %s --steps 5 %s --threads 1 --log-every 0 --strategy offload %s --metrics %s",
                      model, data, extra, metrics);
    if (code) ct_test_fail(__FILE__, __LINE__, "train --strategy offload %s failed:\n%s", extra, out);
    FILE *f = fopen(metrics, "r");
    ASSERT(f);
    while (fgets(line, sizeof line, f) && !strstr(line, "\"summary\"")) {}
    fclose(f);
    ASSERT_STR_CONTAINS(line, "\"summary\"");
    ASSERT_EQ(unlink(metrics), 0);
    code = RUN(est, "estimate %s --ranks %d --strategy offload %s --json", model, np, extra);
    if (code) ct_test_fail(__FILE__, __LINE__, "estimate --strategy offload %s failed:\n%s", extra, est);
    const char *keys[] = {"param", "grad", "optim", "resident", "act"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        double m = json_max(line, keys[i]), e = json_max(est, keys[i]);
        double tol = strcmp(keys[i], "act") ? 0.10 : act_tol;
        if (!(fabs(e - m) <= tol * m))
            ct_test_fail(__FILE__, __LINE__, "offload on %d ranks %s: %s predicted %.0f, measured %.0f\nestimate: %s"
                         "measured: %s", np, extra, keys[i], e, m, est, line);
    }
}

static void estimate_matches(int np, const char *extra)
{
    estimate_matches_model(np, "--model mlp --hidden 512,512,512", "--limit-train 2000 --limit-test 200", extra, 0.25);
}

/* Prefetch (two slices), no prefetch (one), checkpointed micro-batches,
 * and two ranks (three slices' parameters and gradients while an allreduce
 * overlaps the next slice); the gpt, whose tied embedding stays resident,
 * in f32 and with bf16 compute copies. */
TEST(cli_offload_estimate_matches_runs)
{
    char dir[600], data[700], path[700];
    snprintf(dir, sizeof dir, "%s/text", ct_test_tmpdir());
    ASSERT(mkdir(dir, 0755) == 0);
    snprintf(path, sizeof path, "%s/a", dir);
    FILE *f = fopen(path, "w");
    ASSERT(f);
    for (int i = 0; i < 300; i++) fputs("the quick brown fox jumps over the lazy dog\n", f);
    fclose(f);
    snprintf(data, sizeof data, "--data-dir %s", dir);
    const char *gpt = "--model gpt --layers 2 --heads 2 --dim 64 --context 32 --batch 16";
    estimate_matches_model(1, gpt, data, "--strategy-opt slices=3", 0.25);
    /* activations taken as none's, which measures 16% above offload's in bf16 here: the estimate errs high */
    estimate_matches_model(1, gpt, data, "--strategy-opt slices=3 --mixed bf16", 0.30);
    estimate_matches(1, "");
    estimate_matches(1, "--strategy-opt slices=3,prefetch=0");
    estimate_matches(1, "--strategy-opt checkpoint_activation=1,microbatches=4");
    estimate_matches(2, "");
}

TEST(cli_offload_usage_errors)
{
    static char out[OUT_MAX];
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --slices 3"), 2);
    ASSERT_STR_CONTAINS(out, "--slices applies to --strategy offload only");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --strategy ddp --offload-dir /tmp"), 2);
    ASSERT_STR_CONTAINS(out, "--offload-dir applies to --strategy offload only");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --strategy offload --microbatches 2"), 2);
    ASSERT_STR_CONTAINS(out, "--microbatches 2 needs --checkpoint-activation");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --strategy offload --slices 0"), 2);
    ASSERT_STR_CONTAINS(out, "--slices 0 must be at least 1");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --strategy offload --grad-accum 2"), 2);
    ASSERT_STR_CONTAINS(out, "its micro-batches are --microbatches");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --strategy offload --slices 9"), 2);
    ASSERT_STR_CONTAINS(out, "cannot cut");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --strategy offload --checkpoint-activation --microbatches 50 "
                  "--batch 40"), 2);
    ASSERT_STR_CONTAINS(out, "every rank needs at least one sample per micro-batch");
}

/*
 * `ctrain train --strategy fsdp --offload optim|params|all` as a user runs
 * it: a gpt trains as in-memory FSDP does (f32 and --mixed bf16), its full,
 * sharded and local checkpoints resume under other strategies and world
 * sizes and back, the resident bytes fall to what the budget allows, the
 * store's directory is left empty even after SIGKILL, and a disk without
 * room is refused before training with the bytes needed and free.
 */
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli_util.h"

#define LINE "the quick brown fox jumps over the lazy dog\n"

static const char *text_dir(void)
{
    static char dir[600];
    snprintf(dir, sizeof dir, "%s/text", ct_test_tmpdir());
    mkdir(dir, 0755);
    char path[700];
    snprintf(path, sizeof path, "%s/a", dir);
    FILE *f = fopen(path, "w");
    ASSERT(f);
    for (int i = 0; i < 300; i++) fputs(LINE, f);
    fclose(f);
    return dir;
}

static const char *store_dir(void)
{
    static char dir[700];
    snprintf(dir, sizeof dir, "%s/store", ct_test_tmpdir());
    mkdir(dir, 0700);
    return dir;
}

/* A line of the memory report ("  resident   4.4 MiB ..."), in bytes. */
static double report(const char *out, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\n  %s ", key);
    const char *p = strstr(out, k);
    ASSERT(p);
    p += strlen(k);
    double v = atof(p);
    const char *unit = p + strspn(p, " 0123456789.");
    return v * (!strncmp(unit, "MiB", 3) ? 1048576.0 : !strncmp(unit, "KiB", 3) ? 1024.0 : 1.0);
}
#define resident(out) report(out, "resident")

#define GPT_FLAGS "--model gpt --layers 2 --heads 2 --dim 32 --context 24 --batch 8 --lr 0.01 --threads 1 --log-every 0"

/* Every --offload trains the gpt as in-memory FSDP does, at 2 and 3 ranks,
 * with clipping and dropout, in f32 and with bf16 compute copies. */
TEST(cli_fsdp_offload_gpt_equals_in_memory_fsdp)
{
    static char a[OUT_MAX], b[OUT_MAX];
    const char *dir = text_dir(), *sd = store_dir();
    const char *mixed[] = {"", "--mixed bf16"};
    for (int m = 0; m < 2; m++)
        for (int np = 2; np <= 3; np++) {
            int rc = run_np(np, a, "train " GPT_FLAGS " --steps 6 --data-dir %s --dropout 0.1 --clip 0.5 %s "
                            "--strategy fsdp", dir, mixed[m]);
            if (rc) ct_test_fail(__FILE__, __LINE__, "fsdp failed:\n%s", a);
            const char *parts[] = {"optim", "params", "all"};
            for (int k = 0; k < 3; k++) {
                rc = run_np(np, b, "train " GPT_FLAGS " --steps 6 --data-dir %s --dropout 0.1 --clip 0.5 %s "
                            "--strategy fsdp --offload %s --offload-dir %s", dir, mixed[m], parts[k], sd);
                if (rc) ct_test_fail(__FILE__, __LINE__, "fsdp --offload %s failed:\n%s", parts[k], b);
                ASSERT_NEAR(number_after(b, "final train loss "), number_after(a, "final train loss "), 1e-6);
                ASSERT_NEAR(number_after(b, "val loss "), number_after(a, "val loss "), 1e-6);
                if (k == 2) ASSERT(resident(b) < resident(a)); /* all: no part is resident for good */
            }
        }
    ASSERT_EQ(count_entries(sd), 0);
}

/* Checkpoints of every kind leave an offloaded run and come back into one:
 * the resumed run ends where one that never stopped does. */
TEST(cli_fsdp_offload_checkpoints_move_between_strategies)
{
    static char a[OUT_MAX], b[OUT_MAX];
    const char *dir = text_dir(), *sd = store_dir();
    char ck[700];
    int rc = RUN(a, "train " GPT_FLAGS " --steps 12 --data-dir %s --dropout 0.1 --seed 4", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", a);
    double loss = number_after(a, "final train loss "), val = number_after(a, "val loss ");
    /* {state dict, the run that saves at step 6, the run that resumes to step 12} */
    static const char *const cases[][3] = {
        {"full", "-np 2 --strategy fsdp --offload all", "-np 2 --strategy ddp"},
        {"full", "-np 2 --strategy fsdp", "-np 3 --strategy fsdp --offload all"},
        {"sharded", "-np 2 --strategy fsdp --offload params", "-np 3 --strategy fsdp --offload optim"},
        {"sharded", "-np 3 --strategy fsdp --offload all", "-np 1 --strategy none"},
        {"local", "-np 2 --strategy fsdp --offload all", "-np 2 --strategy fsdp --offload all"},
        {"local", "-np 2 --strategy fsdp", "-np 2 --strategy fsdp --offload all"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        snprintf(ck, sizeof ck, "%s/ck%zu%s", ct_test_tmpdir(), k, strcmp(cases[k][0], "full") ? "" : ".safetensors");
        int np1 = atoi(cases[k][1] + 4), np2 = atoi(cases[k][2] + 4);
        const char *off1 = strstr(cases[k][1], "--offload") ? "--offload-dir" : "";
        rc = run_np(np1, b, "train " GPT_FLAGS " --steps 6 --data-dir %s --dropout 0.1 --seed 4 %s %s %s "
                    "--state-dict %s --save %s", dir, cases[k][1] + 6, off1, *off1 ? sd : "", cases[k][0], ck);
        if (rc) ct_test_fail(__FILE__, __LINE__, "saving run %zu failed:\n%s", k, b);
        const char *off = strstr(cases[k][2], "--offload") ? "--offload-dir" : "";
        rc = run_np(np2, b, "train --steps 12 --resume %s --data-dir %s --threads 1 --log-every 0 %s %s %s", ck, dir,
                    cases[k][2] + 6, off, *off ? sd : "");
        if (rc) ct_test_fail(__FILE__, __LINE__, "resuming run %zu failed:\n%s", k, b);
        ASSERT_NEAR(number_after(b, "final train loss "), loss, 2e-5);
        ASSERT_NEAR(number_after(b, "val loss "), val, 2e-4);
    }
    ASSERT_EQ(count_entries(sd), 0);
}

#define BIG_FLAGS "--model gpt --layers 3 --heads 2 --dim 128 --context 24 --batch 8 --lr 0.01 --threads 1 --log-every 0"

/* A budget below FSDP's window of two units is refused naming what it
 * needs; one that holds it trains as the unbounded run does, its resident
 * bytes under the budget and below in-memory FSDP's. */
TEST(cli_fsdp_offload_budget)
{
    static char a[OUT_MAX], b[OUT_MAX];
    const char *dir = text_dir(), *sd = store_dir();
    int rc = run_np(2, a, "train " BIG_FLAGS " --steps 3 --data-dir %s --strategy fsdp --offload all --offload-dir %s "
                    "--max-resident-mb 4", dir, sd);
    ASSERT(rc != 0);
    ASSERT_STR_CONTAINS(a, "max_resident_mb=4 is below the 6.1 MiB this rank needs");
    ASSERT_STR_CONTAINS(a, "raise --max-resident-mb");
    rc = run_np(2, a, "train " BIG_FLAGS " --steps 3 --data-dir %s --strategy fsdp --offload all --offload-dir %s "
                "--max-resident-mb 7", dir, sd);
    if (rc) ct_test_fail(__FILE__, __LINE__, "budgeted run failed:\n%s", a);
    rc = run_np(2, b, "train " BIG_FLAGS " --steps 3 --data-dir %s --strategy fsdp", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "fsdp failed:\n%s", b);
    ASSERT_NEAR(number_after(a, "final train loss "), number_after(b, "final train loss "), 1e-6);
    ASSERT(resident(a) <= 7 * 1048576.0);
    ASSERT(resident(a) < resident(b));
    rc = RUN(a, "train " GPT_FLAGS " --steps 1 --data-dir %s --offload all", dir);
    ASSERT_EQ(rc, 2);
    ASSERT_STR_CONTAINS(a, "--offload applies to --strategy fsdp only");
    ASSERT_EQ(count_entries(sd), 0);
}

/* The store's file is unlinked from the start: nothing is left in
 * --offload-dir after SIGKILL; a disk without room for it is refused at
 * start with the bytes needed and free, before any step. */
TEST(cli_fsdp_offload_leaves_nothing_and_refuses_a_full_disk)
{
    static char out[OUT_MAX];
    const char *dir = text_dir(), *sd = store_dir();
    pid_t pid = fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        char bin[2048];
        snprintf(bin, sizeof bin, "%s/ctrain", cli_bin_dir());
        freopen("/dev/null", "w", stdout);
        freopen("/dev/null", "w", stderr);
        execl(bin, bin, "train", "--model", "gpt", "--layers", "2", "--heads", "2", "--dim", "32", "--context", "24",
              "--batch", "8", "--threads", "1", "--log-every", "0", "--steps", "100000", "--data-dir", dir,
              "--strategy", "fsdp", "--offload", "all", "--offload-dir", sd, (char *)NULL);
        _exit(127);
    }
    int seen = holds_unlinked_file((int)pid, sd);
    ASSERT_EQ(count_entries(sd), 0);
    kill(pid, SIGKILL);
    int st;
    ASSERT(waitpid(pid, &st, 0) == pid);
    if (!seen) ct_test_fail(__FILE__, __LINE__, "the run never held a store file in %s", sd);
    ASSERT_EQ(count_entries(sd), 0);
    /* files of 10 MB at most (MPI's start-up files fit): the store of a 2.4M-parameter gpt (38 MB) does not */
    int code = run_sh(0, "trap '' XFSZ; ulimit -f 20000;", out,
                      "train --model gpt --layers 4 --heads 2 --dim 224 --context 24 --batch 8 --threads 1 "
                      "--log-every 1 --steps 2 --data-dir %s --strategy fsdp --offload all --offload-dir %s", dir, sd);
    ASSERT_EQ(code, 1);
    ASSERT_STR_CONTAINS(out, "cannot reserve");
    ASSERT_STR_CONTAINS(out, "MiB free there");
    ASSERT_STR_CONTAINS(out, "--offload-dir");
    ASSERT(!strstr(out, "step 1 "));
    ASSERT_EQ(count_entries(sd), 0);
}

/* `ctrain estimate --offload` against a run: param, grad and optim from
 * 0.9x to 1.25x what the run measured (the plan bounds what the I/O
 * thread's timing decides), resident within 25% (the plan's peaks are not
 * simultaneous), the bytes the store moved in a steady step within 5%
 * (measured: all and params 0.3%, optim 2-3%). */
TEST(cli_fsdp_offload_estimate_matches_training)
{
    static char out[OUT_MAX], est[OUT_MAX];
    const char *dir = text_dir(), *sd = store_dir();
    const char *parts[] = {"optim", "params", "all"};
    for (int k = 0; k < 3; k++) {
        int rc = run_np(2, out, "train " BIG_FLAGS " --steps 16 --data-dir %s --strategy fsdp --offload %s "
                        "--offload-dir %s", dir, parts[k], sd);
        if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
        rc = RUN(est, "estimate --model gpt --layers 3 --heads 2 --dim 128 --context 24 --batch 8 --ranks 2 "
                 "--strategy fsdp --offload %s --json", parts[k]);
        if (rc) ct_test_fail(__FILE__, __LINE__, "estimate failed:\n%s", est);
        static const char *const keys[] = {"param", "grad", "optim"};
        /* the plan is the bound: how many loads overlap the drops before them is up to the I/O thread */
        for (int q = 0; q < 3; q++) {
            double r = json_max(est, keys[q]) / report(out, keys[q]);
            if (!(r >= 0.9 && r <= 1.25)) ct_test_fail(__FILE__, __LINE__, "--offload %s: %s estimated %.3fx the run's",
                                                      parts[k], keys[q], r);
        }
        ASSERT_NEAR(json_max(est, "resident") / resident(out), 1.0, 0.25);
        /* a steady step's bytes: the mean after the first two (no update to load, then no state yet) */
        double steady = number_after(out, "MiB per step (") * 1048576.0;
        if (!(fabs(json_max(est, "moved") / steady - 1.0) <= 0.05))
            ct_test_fail(__FILE__, __LINE__, "--offload %s: the estimate moves %.0f bytes a step, the run %.0f after its "
                         "first two steps (%.0f with them)", parts[k], json_max(est, "moved"), steady,
                         number_after(out, "store moved ") * 1048576.0);
        ASSERT(json_max(est, "store") > 0);
    }
}

/* The whole job in memory cgroups (scripts/memlimit: 90 MiB per rank, 180
 * for the job) trains a gpt of 58M parameters, whose f32 AdamW state (16
 * bytes each: 886 MiB) is 4.9x the job's limit, to the loss in-memory FSDP
 * reaches; every rank's peak usage as the kernel counts it (page cache
 * included) stays under its limit.  Skipped where cgroups are not writable. */
TEST(cli_fsdp_offload_trains_a_model_4x_the_memory_limit)
{
    static char out[OUT_MAX], ref[OUT_MAX];
    const char *dir = text_dir(), *sd = store_dir();
    char tag[64];
    snprintf(tag, sizeof tag, "ctrain-test-%d", (int)getpid());
#define M58 "--model gpt --layers 24 --heads 4 --dim 448 --context 32 --batch 2 --steps 2 --threads 1 --log-every 0 " \
            "--wrap-min-params 150000 --data-dir %s"
    int rc = run_shell(2, out, "%s/../scripts/memlimit %s 90 %s/ctrain train " M58 " --strategy fsdp --offload all "
                       "--offload-dir %s --strategy-opt alloc_cache_mb=4", cli_bin_dir(), tag, cli_bin_dir(), dir, sd);
    double peak[2];
    int k[2];
    memlimit_collect(tag, 2, peak, k);
    int killed = k[0] || k[1];
    if (strstr(out, "is not writable")) SKIP("cgroup v1 memory hierarchy not writable here");
    if (rc || killed) ct_test_fail(__FILE__, __LINE__, "the limited run failed (OOM kill: %d):\n%s", killed, out);
    ASSERT_STR_CONTAINS(out, "(58072448 parameters)");
    for (int r = 0; r < 2; r++) {
        if (!(peak[r] > 0 && peak[r] <= 90 * 1048576.0))
            ct_test_fail(__FILE__, __LINE__, "rank %d's cgroup peak %.1f MiB (limit 90)", r, peak[r] / 1048576.0);
    }
    rc = run_np(2, ref, "train " M58 " --strategy fsdp", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "in-memory fsdp failed:\n%s", ref);
    ASSERT_NEAR(number_after(out, "final train loss "), number_after(ref, "final train loss "), 1e-6);
    ASSERT_EQ(count_entries(sd), 0);
}

/*
 * The gpt through the ctrain program, as a user runs it: training on a
 * folder of text learns it (the greedy sample continues the text), eval
 * agrees with train, resume is bit for bit, DDP and ZeRO over 2 ranks match
 * one process, the fortunes corpus loads, and bad flags are one clear line.
 */
#include <libgen.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli_util.h"

/* "ctrain ARGS" (under mpirun -np np when np > 0), stderr joined; exit code, output in out. */
#define LINE "the quick brown fox jumps over the lazy dog\n"

/* A folder with one text file of LINE repeated (13 KB), and a .dat file
 * and a hidden file that must be skipped. */
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
    const char *skip[] = {"a.dat", ".hidden"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, skip[i]);
        f = fopen(path, "w");
        ASSERT(f);
        fputs("\xff\xfe binary that would spoil the greedy sample \xff", f);
        fclose(f);
    }
    return dir;
}

#define GPT_FLAGS "--model gpt --layers 1 --heads 2 --dim 32 --context 24 --batch 8 --lr 0.01 --threads 1 --log-every 0"

TEST(cli_gpt_learns_text_eval_agrees_and_sample_continues_it)
{
    static char out[OUT_MAX], out2[OUT_MAX];
    const char *dir = text_dir();
    char ck[700];
    snprintf(ck, sizeof ck, "%s/g.safetensors", ct_test_tmpdir());
    int rc = RUN(out, "train " GPT_FLAGS " --steps 300 --data-dir %s --save %s", dir, ck);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed (%d):\n%s", rc, out);
    ASSERT_STR_CONTAINS(out, "gpt [1 layers, 2 heads, dim 32, context 24, vocab 256]");
    double loss = number_after(out, "val loss "), base = number_after(out, "unigram baseline ");
    if (!(loss < 0.3 * base)) ct_test_fail(__FILE__, __LINE__, "val loss %g is not far below the unigram %g:\n%s", loss, base, out);
    /* eval rebuilds the model from the checkpoint alone and gets the same number. */
    rc = RUN(out2, "eval --checkpoint %s --data-dir %s", ck, dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "eval failed (%d):\n%s", rc, out2);
    ASSERT_NEAR(number_after(out2, "val loss "), loss, 1e-4);
    ASSERT_STR_CONTAINS(out2, "1 files");
    ASSERT_NEAR(number_after(out2, "nats/byte ("), loss / log(2.0), 1e-3); /* bits per byte */
    /* Greedy continuation of the text it learnt, past its context of 24 bytes. */
    rc = RUN(out2, "sample --checkpoint %s --prompt 'the quick' --tokens 60 --temperature 0", ck);
    if (rc) ct_test_fail(__FILE__, __LINE__, "sample failed (%d):\n%s", rc, out2);
    ASSERT_STR_CONTAINS(out2, "the quick brown fox jumps over the lazy dog\nthe quick brown fox");
    /* Sampling is reproducible from its seed. */
    RUN(out, "sample --checkpoint %s --tokens 40 --temperature 1.5 --top-k 5 --seed 3", ck);
    RUN(out2, "sample --checkpoint %s --tokens 40 --temperature 1.5 --top-k 5 --seed 3", ck);
    ASSERT(!strcmp(out, out2));
}

TEST(cli_gpt_resume_is_bit_exact)
{
    static char a[OUT_MAX], b[OUT_MAX];
    const char *dir = text_dir();
    char ck[700];
    snprintf(ck, sizeof ck, "%s/r.safetensors", ct_test_tmpdir());
    int rc = RUN(a, "train " GPT_FLAGS " --steps 16 --data-dir %s --dropout 0.1 --seed 4", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", a);
    rc = RUN(b, "train " GPT_FLAGS " --steps 8 --data-dir %s --dropout 0.1 --seed 4 --save %s", dir, ck);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", b);
    rc = RUN(b, "train --steps 16 --resume %s --data-dir %s --threads 1 --log-every 0", ck, dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "resume failed:\n%s", b);
    ASSERT_STR_CONTAINS(b, "dropout 0.1");
    ASSERT_EQ(number_after(a, "val loss "), number_after(b, "val loss ")); /* printed digits equal */
    ASSERT_EQ(number_after(a, "final train loss "), number_after(b, "final train loss "));
}

/* Every strategy over 2 ranks trains what one process does (dropout on: masks key on the global sample). */
TEST(cli_gpt_strategies_match_one_process)
{
    static char one[OUT_MAX], two[OUT_MAX];
    const char *dir = text_dir();
    int rc = RUN(one, "train " GPT_FLAGS " --steps 6 --data-dir %s --dropout 0.1", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", one);
    double l1 = number_after(one, "final train loss "), v1 = number_after(one, "val loss ");
    /* fsdp: a unit per block; pipe: stages of blocks, the tied weight in the first and the last;
     * offload: a slice per child, the tied weight resident */
    const char *kinds[] = {"ddp", "zero1", "zero2", "fsdp", "pipe", "offload"};
    for (int k = 0; k < 6; k++) {
        rc = run_np(2, two, "train " GPT_FLAGS " --steps 6 --data-dir %s --dropout 0.1 --strategy %s", dir, kinds[k]);
        if (rc) ct_test_fail(__FILE__, __LINE__, "%s failed:\n%s", kinds[k], two);
        ASSERT_NEAR(number_after(two, "final train loss "), l1, 2e-5);
        ASSERT_NEAR(number_after(two, "val loss "), v1, 2e-4);
    }
}

/* A gpt checkpoint written by offload (the tied weight once, from its
 * resident group; the rest read from the store) resumes under ddp on 2
 * ranks and ends where a run that never stopped does, and under offload
 * with bf16 compute copies too. */
TEST(cli_gpt_offload_checkpoint_resumes_under_ddp)
{
    static char a[OUT_MAX], b[OUT_MAX];
    const char *dir = text_dir();
    char ck[700];
    snprintf(ck, sizeof ck, "%s/o.safetensors", ct_test_tmpdir());
    int rc = RUN(a, "train " GPT_FLAGS " --steps 12 --data-dir %s --dropout 0.1 --seed 4", dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", a);
    rc = RUN(b, "train " GPT_FLAGS " --steps 6 --data-dir %s --dropout 0.1 --seed 4 --strategy offload --slices 3 "
             "--save %s", dir, ck);
    if (rc) ct_test_fail(__FILE__, __LINE__, "offload train failed:\n%s", b);
    rc = run_np(2, b, "train --steps 12 --resume %s --data-dir %s --threads 1 --log-every 0 --strategy ddp", ck, dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "resume under ddp failed:\n%s", b);
    ASSERT_NEAR(number_after(b, "final train loss "), number_after(a, "final train loss "), 2e-5);
    ASSERT_NEAR(number_after(b, "val loss "), number_after(a, "val loss "), 2e-4);
    rc = RUN(b, "train --steps 8 --resume %s --data-dir %s --threads 1 --log-every 0 --strategy offload --mixed bf16",
             ck, dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "resume under offload with bf16 failed:\n%s", b);
    ASSERT_STR_CONTAINS(b, "final train loss ");
}

/* Evaluation through a sharded strategy: every forward is collective
 * (FSDP gathers each unit from all ranks), so ranks with fewer validation
 * windows than others (here one window over 2 and 3 ranks) still join
 * every forward; they used to leave their peers in a gather and crash. */
TEST(cli_gpt_fsdp_eval_with_uneven_shares)
{
    static char out[OUT_MAX];
    const char *dir = text_dir();
    for (int np = 2; np <= 3; np++) {
        int rc = run_np(np, out, "train " GPT_FLAGS " --steps 2 --data-dir %s --strategy fsdp --mixed bf16 "
                        "--limit-test 1", dir);
        if (rc) ct_test_fail(__FILE__, __LINE__, "fsdp on %d ranks, one validation window, failed:\n%s", np, out);
        ASSERT_STR_CONTAINS(out, "over 24 bytes");
    }
    int rc = run_np(3, out, "train --model mlp --limit-train 200 --limit-test 1 --threads 1 --steps 2 "
                    "--strategy fsdp --wrap-min-params 1000 --log-every 0");
    if (rc) ct_test_fail(__FILE__, __LINE__, "fsdp mlp on 3 ranks, one test sample, failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "/1)"); /* the one sample counted once */
}

/* A pipelined run's checkpoint (the tied weight saved once, by the first
 * stage: full, sharded and local alike) resumes under ddp and goes on as
 * one process's checkpoint resumed by one process (the final train loss is
 * the resumed steps' mean). */
TEST(cli_gpt_pipe_checkpoint_resumes_under_ddp)
{
    static char a[OUT_MAX], b[OUT_MAX];
    const char *dir = text_dir();
    char ck1[700], ckp[700], what[2000];
    snprintf(ck1, sizeof ck1, "%s/o.safetensors", ct_test_tmpdir());
    int rc = RUN(a, "train " GPT_FLAGS " --steps 6 --data-dir %s --dropout 0.1 --seed 5 --save %s", dir, ck1);
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", a);
    rc = RUN(a, "train --steps 12 --resume %s --data-dir %s --threads 1 --log-every 0", ck1, dir);
    if (rc) ct_test_fail(__FILE__, __LINE__, "resume failed:\n%s", a);
    const char *formats[] = {"full", "sharded", "local"};
    for (int f = 0; f < 3; f++) {
        snprintf(ckp, sizeof ckp, "%s/p-%s%s", ct_test_tmpdir(), formats[f], f ? "" : ".safetensors");
        rc = run_np(2, b, "train " GPT_FLAGS " --steps 6 --data-dir %s --dropout 0.1 --seed 5 --strategy pipe "
                    "--chunks 3 --save %s --state-dict %s", dir, ckp, formats[f]);
        if (rc) ct_test_fail(__FILE__, __LINE__, "pipe (%s) failed:\n%s", formats[f], b);
        /* the tensors saved: the file's, or the model index's */
        if (f) snprintf(what, sizeof what, "cat %s/model.safetensors.index.json", ckp);
        else snprintf(what, sizeof what, "%s/ctrain inspect %s", cli_bin_dir(), ckp);
        FILE *p = popen(what, "r");
        ASSERT(p);
        size_t n = fread(b, 1, OUT_MAX - 1, p);
        b[n] = 0;
        pclose(p);
        ASSERT_STR_CONTAINS(b, "transformer.wte.weight");
        ASSERT_STR_CONTAINS(b, "transformer.h.0.mlp.c_proj.bias"); /* the last stage's too */
        ASSERT(!strstr(b, "lm_head"));
        ASSERT(strstr(strstr(b, "transformer.wte.weight") + 1, "transformer.wte.weight") == NULL); /* once */
        rc = run_np(2, b, "train --steps 12 --resume %s --data-dir %s --threads 1 --log-every 0 --strategy ddp", ckp,
                    dir);
        if (rc) ct_test_fail(__FILE__, __LINE__, "resume (%s) under ddp failed:\n%s", formats[f], b);
        ASSERT_NEAR(number_after(b, "final train loss "), number_after(a, "final train loss "), 2e-5);
        ASSERT_NEAR(number_after(b, "val loss "), number_after(a, "val loss "), 2e-4);
    }
}

TEST(cli_gpt_trains_on_fortunes)
{
    static char out[OUT_MAX];
    if (access(CT_FORTUNES_DIR "/fortunes", R_OK) != 0) SKIP("the fortunes package is not installed (make installs it)");
    int rc = RUN(out, "train --model gpt --layers 1 --heads 1 --dim 16 --context 16 --steps 2 --batch 2 --threads 1 "
                 "--log-every 0 --eval-batch 256");
    if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "on fortunes");
    ASSERT_NEAR(number_after(out, "unigram baseline "), 3.32, 0.005); /* the corpus's byte entropy */
    ASSERT_STR_CONTAINS(out, "bits per byte");
}

TEST(cli_gpt_usage_errors)
{
    static char out[OUT_MAX];
    const char *dir = text_dir();
    struct {
        const char *args, *needle;
        int code;
    } cases[] = {
        {"train --model mlp --layers 2 --steps 1", "apply to --model gpt only", 2},
        {"train --model gpt --dim 30 --heads 4 --steps 1", "multiple of --heads", 2},
        {"train --model gpt --context 0 --steps 1", "--context 0", 2},
        {"train --model gpt --data fashion-mnist --steps 1", "does not suit --model gpt", 2},
        {"train --model mlp --data fortunes --steps 1", "does not suit --model mlp", 2},
        {"train --model gpt --vocab 100 --steps 1", "use --vocab 256", 1},
        {"train --model gpt --steps 1 --data-dir /nonexistent", "text data folder /nonexistent", 1},
        {"sample", "--checkpoint CKPT is required", 2},
        {"sample --checkpoint x --top-k -1", "--top-k -1", 2},
        {"sample --checkpoint /nonexistent.safetensors", "nonexistent", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = RUN(out, "%s", cases[i].args);
        if (rc != cases[i].code || !strstr(out, cases[i].needle))
            ct_test_fail(__FILE__, __LINE__, "'%s' gave %d (want %d) and:\n%s(want '%s')", cases[i].args, rc,
                         cases[i].code, out, cases[i].needle);
    }
    /* A context longer than the text's validation split is refused with the sizes. */
    int rc = RUN(out, "train --model gpt --layers 1 --heads 1 --dim 8 --context 2000 --steps 1 --data-dir %s", dir);
    ASSERT_EQ(rc, 1);
    ASSERT_STR_CONTAINS(out, "lower --context");
    /* A folder without text files. */
    char empty[700];
    snprintf(empty, sizeof empty, "%s/empty", ct_test_tmpdir());
    mkdir(empty, 0755);
    rc = RUN(out, "train --model gpt --steps 1 --data-dir %s", empty);
    ASSERT_EQ(rc, 1);
    ASSERT_STR_CONTAINS(out, "no text files");
    /* sample needs a gpt. */
    char ck[700];
    snprintf(ck, sizeof ck, "%s/m.safetensors", ct_test_tmpdir());
    rc = RUN(out, "train --model mlp --steps 1 --limit-train 64 --limit-test 10 --log-every 0 --save %s", ck);
    ASSERT_EQ(rc, 0);
    rc = RUN(out, "sample --checkpoint %s", ck);
    ASSERT_EQ(rc, 1);
    ASSERT_STR_CONTAINS(out, "holds a mlp");
}

/* The integer after "\"key\":" in a JSON line. */
static long long json_int(const char *s, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    return (long long)number_after(s, k);
}

/* ctrain estimate's gpt figures against what training measures: param and
 * grad exact, optim within its slot table, activations 0 to 20% high (a
 * block is replayed as one layer). */
TEST(cli_gpt_estimate_matches_training)
{
    static char out[OUT_MAX], est[OUT_MAX];
    const char *dir = text_dir();
    char metrics[700], cmd[900];
    for (int mixed = 0; mixed <= 1; mixed++) {
        snprintf(metrics, sizeof metrics, "%s/m%d.jsonl", ct_test_tmpdir(), mixed);
        int rc = RUN(out, "train " GPT_FLAGS " --steps 3 --dropout 0.1 --data-dir %s --mixed %s --metrics %s", dir,
                     mixed ? "bf16" : "none", metrics);
        if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
        rc = RUN(est, "estimate --model gpt --layers 1 --heads 2 --dim 32 --context 24 --batch 8 --dropout 0.1 "
                 "--ranks 1 --strategy none --json --mixed %s", mixed ? "bf16" : "none");
        if (rc) ct_test_fail(__FILE__, __LINE__, "estimate failed:\n%s", est);
        snprintf(cmd, sizeof cmd, "tail -1 %s", metrics);
        FILE *p = popen(cmd, "r");
        ASSERT(p);
        size_t n = fread(out, 1, OUT_MAX - 1, p);
        out[n] = 0;
        pclose(p);
        ASSERT_EQ(json_int(est, "param"), json_int(out, "param"));
        ASSERT_EQ(json_int(est, "grad"), json_int(out, "grad"));
        ASSERT_CLOSE(json_int(est, "optim"), json_int(out, "optim"), 0.01, 0); /* without the slot table */
        double a = (double)json_int(est, "act"), m = (double)json_int(out, "act");
        /* Errs high, never low: a block's records go at once in the replay, one by one in ctrain. */
        if (!(a >= m && a <= 1.2 * m))
            ct_test_fail(__FILE__, __LINE__, "mixed %d: estimated act %g vs measured %g", mixed, a, m);
    }
}

/* The pipelined gpt's estimate against a 2-rank run (the largest stage's
 * figures): param and grad exact, the last stage's counting the tied
 * weight its head uses; optim within its slot table; the activations a
 * replay of a stage's micro-batch scheduled (0 to 20% high), for both
 * schedules, a checkpoint mode and bf16. */
TEST(cli_gpt_estimate_matches_pipe)
{
    static char out[OUT_MAX], est[OUT_MAX];
    const char *dir = text_dir();
    char metrics[700], cmd[900];
    const char *extra[] = {"", "--mixed bf16 --strategy-opt chunks=2", "--strategy-opt schedule=gpipe,chunks=8",
                           "--strategy-opt checkpoint=never,chunks=3"};
    for (size_t c = 0; c < sizeof extra / sizeof extra[0]; c++) {
        snprintf(metrics, sizeof metrics, "%s/p%zu.jsonl", ct_test_tmpdir(), c);
        int rc = run_np(2, out, "train " GPT_FLAGS " --steps 3 --dropout 0.1 --data-dir %s --strategy pipe %s "
                        "--metrics %s", dir, extra[c], metrics);
        if (rc) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
        rc = RUN(est, "estimate --model gpt --layers 1 --heads 2 --dim 32 --context 24 --batch 8 --dropout 0.1 "
                 "--ranks 2 --strategy pipe --json %s", extra[c]);
        if (rc) ct_test_fail(__FILE__, __LINE__, "estimate failed:\n%s", est);
        snprintf(cmd, sizeof cmd, "tail -1 %s", metrics);
        FILE *p = popen(cmd, "r");
        ASSERT(p);
        size_t n = fread(out, 1, OUT_MAX - 1, p);
        out[n] = 0;
        pclose(p);
        ASSERT_EQ(json_max(est, "param"), json_max(out, "param"));
        ASSERT_EQ(json_max(est, "grad"), json_max(out, "grad"));
        ASSERT_CLOSE(json_max(est, "optim"), json_max(out, "optim"), 0.01, 0);
        double a = json_max(est, "act"), m = json_max(out, "act");
        if (!(a >= m && a <= 1.2 * m))
            ct_test_fail(__FILE__, __LINE__, "'%s': estimated act %g vs measured %g", extra[c], a, m);
    }
}

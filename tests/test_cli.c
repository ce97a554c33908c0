/*
 * The ctrain program, run as a user runs it (popen of build/ctrain, found
 * next to this test binary): help texts, one-line errors with the right
 * exit code, a short training run on a subset that learns, eval agreeing
 * with train, inspect, bit-exact resume, DDP under mpirun matching a single
 * process, and PyTorch loading a checkpoint and computing the same logits.
 */
#include <libgen.h>
#include <stdarg.h>
#include <stdlib.h>
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli_util.h"

/* Runs "ctrain ARGS" (or, with np > 0, under mpirun) through sh with
 * stderr joined to stdout; returns the exit code, output in out. */
/* A small, fast run: the first 2000 training samples, 1 BLAS thread. */
#define SMALL "--model mlp --limit-train 2000 --limit-test 1000 --threads 1"

TEST(cli_help)
{
    static char out[OUT_MAX];
    ASSERT_EQ(RUN(out, "--help"), 0);
    ASSERT_STR_CONTAINS(out, "train");
    ASSERT_STR_CONTAINS(out, "inspect");
    ASSERT_STR_CONTAINS(out, "estimate");
    ASSERT_EQ(RUN(out, "estimate --help"), 0);
    ASSERT_STR_CONTAINS(out, "ctrain estimate --model mlp|cnn|gpt --ranks N");
    ASSERT_EQ(RUN(out, "train --help"), 0);
    const char *flags[] = {"--model", "--hidden", "--epochs", "--steps", "--batch", "--lr", "--optim",
                           "--weight-decay", "--momentum", "--schedule", "--warmup", "--clip", "--seed",
                           "--clip-norm", "--mixed", "--strategy-opt", "--dropout", "--no-shuffle", "--init",
                           "--resume", "--save", "--save-every", "--state-dict", "sharded", "--log-every",
                           "--metrics", "--strategy", "--grad-accum", "--bucket-cap-mb",
                           "--find-unused-parameters", "--grad-compress", "--threads", "--trace", "--data-dir"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) ASSERT_STR_CONTAINS(out, flags[i]);
    ASSERT(!strstr(out, "--limit-train")); /* for tests only: unlisted */
    ASSERT_EQ(RUN(out, "eval --help"), 0);
    ASSERT_STR_CONTAINS(out, "--checkpoint");
    ASSERT_STR_CONTAINS(out, "confusion");
    ASSERT_EQ(RUN(out, "inspect --help"), 0);
    ASSERT_STR_CONTAINS(out, "ctrain inspect CKPT");
    ASSERT_EQ(RUN(out, "version"), 0);
    ASSERT_STR_CONTAINS(out, "ctrain " CT_VERSION);
    ASSERT_EQ(RUN(out, "version --help"), 0);
}

/* Each bad command line: exit code, one line, and text naming the cause and fix. */
TEST(cli_usage_errors)
{
    static char out[OUT_MAX];
    struct {
        const char *args;
        int code;
        const char *text;
    } cases[] = {
        {"", 2, "usage: ctrain <command>"},
        {"fly", 2, "unknown command 'fly'"},
        {"train --model mlp", 2, "give --epochs N or --steps K"},
        {"train --model mlp --epochs 1 --steps 5", 2, "--epochs and --steps are both given"},
        {"train --model mlp --steps abc", 2, "--steps 'abc' is not a whole number"},
        {"train --model mlp --steps 5 --lr fast", 2, "--lr 'fast' is not a number"},
        {"train --model mlp --steps 5 --bogus", 2, "unknown option '--bogus'"},
        {"train --model mlp --steps", 2, "--steps needs a value"},
        {"train --model mlp --steps 5 --batch", 2, "--batch needs a value"},
        {"train --model resnet --steps 5", 2, "choose one of: mlp, cnn"},
        {"train --steps 5", 2, "--model is required"},
        {"train --model mlp --steps 5 --batch 0", 2, "--batch 0 must be at least 1"},
        {"train --model mlp --steps 5 --hidden 256,x", 2, "'x' is not a positive integer"},
        {"train --model mlp --steps 5 --strategy zero9", 2, "choose one of: none, ddp"},
        {"train --model mlp --steps 5 --mixed f16", 2, "need oneDNN's f16 matmul"},
        {"train --model mlp --steps 5 --sharding grad-op", 2, "--sharding applies to --strategy fsdp only"},
        {"train --model mlp --steps 5 --strategy fsdp --sharding half", 2, "choose full, grad-op, none or hybrid"},
        {"train --model mlp --steps 5 --strategy fsdp --prefetch early", 2, "choose pre, post or none"},
        {"train --model mlp --steps 5 --optim lbfgs", 2, "choose sgd or adamw"},
        {"train --model mlp --steps 5 --momentum 0.9", 2, "--optim sgd only"},
        {"train --model mlp --steps 5 --save-every 10", 2, "--save-every needs --save"},
        {"train --model mlp --steps 5 --state-dict sharded", 2, "--state-dict needs --save"},
        {"train --model mlp --steps 5 --save d --state-dict zip", 2, "choose full (one file), sharded or local (a directory)"},
        {"train --model mlp --steps 5 --init a --resume b", 2, "--init and --resume are both given"},
        {"train --model mlp --steps 5 --grad-compress zip", 2, "choose none, bf16, f16 or powersgd:R"},
        {"train --model mlp --steps 5 --grad-compress powersgd:0", 2, "powersgd:R (R a rank from 1"},
        {"train --model mlp --steps 5 --grad-compress powersgd:2", 2, "applies to --strategy ddp and zero1"},
        {"train --model mlp --steps 5 --data cifar", 2, "unknown data set 'cifar'"},
        {"train --model mlp --steps 5 --steps 6", 2, "give it once"},
        {"eval", 2, "--checkpoint CKPT is required"},
        {"eval --checkpoint", 2, "--checkpoint needs a value"},
        {"inspect", 2, "ctrain inspect CKPT"},
        {"inspect a b", 2, "unexpected argument 'b'"},
        {"version now", 2, "it takes none"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int code = RUN(out, "%s", cases[i].args);
        if (code != cases[i].code || !strstr(out, cases[i].text))
            ct_test_fail(__FILE__, __LINE__, "ctrain %s: exit %d (wanted %d), output:\n%s(wanted '%s')",
                         cases[i].args, code, cases[i].code, out, cases[i].text);
        if (*cases[i].args && count_lines(out) != 1)
            ct_test_fail(__FILE__, __LINE__, "ctrain %s: wanted one line, got:\n%s", cases[i].args, out);
    }
}

/* Failures found while running: exit code 1, one line naming the file or dir and the fix. */
TEST(cli_runtime_errors)
{
    static char out[OUT_MAX];
    char path[4096], side[4096];
    const char *tmp = ct_test_tmpdir();
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 5 --data-dir %s/nowhere", tmp), 1);
    ASSERT_STR_CONTAINS(out, "nowhere");
    ASSERT_STR_CONTAINS(out, "--data-dir");
    ASSERT_EQ(count_lines(out), 1);
    ASSERT_EQ(RUN(out, "eval --checkpoint %s/none.safetensors", tmp), 1);
    ASSERT_STR_CONTAINS(out, "cannot read the checkpoint");
    ASSERT_STR_CONTAINS(out, "none.safetensors");
    ASSERT_EQ(count_lines(out), 1);
    ASSERT_EQ(RUN(out, "inspect %s/none.safetensors", tmp), 1);
    ASSERT_STR_CONTAINS(out, "none.safetensors");
    /* Not a safetensors file. */
    snprintf(path, sizeof path, "%s/junk.safetensors", tmp);
    FILE *f = fopen(path, "w");
    ASSERT(f);
    fputs("this is not a checkpoint", f);
    fclose(f);
    ASSERT_EQ(RUN(out, "inspect %s", path), 1);
    ASSERT_EQ(count_lines(out), 1);
    ASSERT_EQ(RUN(out, "eval --checkpoint %s", path), 1);
    ASSERT_EQ(count_lines(out), 1);

    /* A checkpoint of another shape, and a resume without the optimizer sidecar. */
    snprintf(path, sizeof path, "%s/small.safetensors", tmp);
    ASSERT_EQ(RUN(out, "train " SMALL " --hidden 32 --steps 2 --log-every 0 --save %s", path), 0);
    ASSERT_EQ(RUN(out, "train " SMALL " --hidden 64 --steps 2 --init %s", path), 1);
    ASSERT_STR_CONTAINS(out, "'0.weight' is [32, 784] in the checkpoint but [64, 784] in the model");
    ASSERT_EQ(count_lines(out), 1);
    ASSERT_EQ(RUN(out, "train " SMALL " --hidden 32,16 --steps 2 --init %s", path), 1);
    ASSERT_STR_CONTAINS(out, "2.weight");
    ASSERT_EQ(RUN(out, "train --hidden 64 --steps 4 --limit-train 2000 --resume %s", path), 2);
    ASSERT_STR_CONTAINS(out, "--hidden 64 differs from the checkpoint's 32");
    snprintf(side, sizeof side, "%s/small.optim.safetensors", tmp);
    ASSERT_EQ(unlink(side), 0);
    ASSERT_EQ(RUN(out, "train --steps 4 --resume %s", path), 1);
    ASSERT_STR_CONTAINS(out, "small.optim.safetensors is missing");
    ASSERT_STR_CONTAINS(out, "use --init");
    ASSERT_EQ(count_lines(out), 1);
}

/* Trains on 2000 samples, then eval and inspect the checkpoint. */
TEST(cli_train_eval_inspect)
{
    static char out[OUT_MAX], ev[OUT_MAX];
    char ckpt[4096], metrics[4096], acc_train[256], acc_eval[256];
    const char *tmp = ct_test_tmpdir();
    snprintf(ckpt, sizeof ckpt, "%s/mlp.safetensors", tmp);
    snprintf(metrics, sizeof metrics, "%s/metrics.jsonl", tmp);
    int code = RUN(out, "train " SMALL " --steps 250 --batch 64 --seed 1 --log-every 50 --save %s --metrics %s", ckpt,
                   metrics);
    if (code) ct_test_fail(__FILE__, __LINE__, "train failed (%d):\n%s", code, out);
    double loss = number_after(out, "final train loss ");
    ASSERT(loss < 1.0); /* chance is ln 10 = 2.30 */
    ASSERT_STR_CONTAINS(out, "step 250/250");
    ASSERT_STR_CONTAINS(out, "peak memory over the training steps");
    ASSERT_STR_CONTAINS(out, "  resident      3.6 MiB");
    ASSERT_STR_CONTAINS(out, "whole-life peak RSS (set-up to teardown): rank 0 ");
    ASSERT_STR_CONTAINS(out, " train ");
    ASSERT_STR_CONTAINS(out, "step time (none");
    line_after(out, "test: ", acc_train, sizeof acc_train);
    ASSERT(number_after(out, "accuracy ") > 60);

    /* The metrics file: one JSON object per logged step, the last step's evaluation, then the summary:
     * median step time and the memory report, in bytes.  235146 f32
     * parameters: 940584 bytes each of param and grad, two AdamW moments. */
    FILE *f = fopen(metrics, "r");
    ASSERT(f);
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        n++;
        if (n == 6) {
            ASSERT_STR_CONTAINS(line, "{\"event\":\"eval\",\"step\":250,");
            ASSERT(number_after(line, "\"val_loss\":") > 0);
            continue;
        }
        if (n == 7) {
            ASSERT_STR_CONTAINS(line, "{\"event\":\"summary\",\"step_ms\":");
            ASSERT(number_after(line, "\"step_ms\":") > 0);
            ASSERT_STR_CONTAINS(line, "\"memory\":[{\"rank\":0,\"param\":940584,\"grad\":940584,");
            /* the moments, plus the optimizer's small per-slot bookkeeping */
            double optim = number_after(line, "\"optim\":"), resident = number_after(line, "\"resident\":");
            ASSERT(optim >= 1881168 && optim < 1881168 + 4096);
            ASSERT_EQ((int64_t)resident, 940584 * 2 + (int64_t)optim);
            ASSERT(number_after(line, "\"data\":") > 2000 * 784 * 4);
            ASSERT(number_after(line, "\"rss\":") > number_after(line, "\"peak_total\":"));
            /* the whole life's peak RSS covers the training window's, and every phase the run went through */
            ASSERT(number_after(line, "\"rss_life\":") >= number_after(line, "\"rss\":"));
            ASSERT(number_after(line, "\"rss_life\":") >= number_after(line, "\"build\":"));
            ASSERT(number_after(line, "\"teardown\":") > 0 && number_after(line, "\"eval\":") > 0);
            ASSERT(number_after(line, "\"peak_cached\":") <= number_after(line, "\"cache_limit\":"));
            ASSERT_STR_CONTAINS(line, "\"rss_life_phase\":\"");
            ASSERT_STR_CONTAINS(line, "}}]}");
            continue;
        }
        ASSERT_STR_CONTAINS(line, "{\"step\":");
        ASSERT_STR_CONTAINS(line, "\"loss\":");
        ASSERT_STR_CONTAINS(line, "\"lr\":0.001");
        ASSERT_STR_CONTAINS(line, "\"samples_per_s\":");
    }
    fclose(f);
    ASSERT_EQ(n, 7);

    /* eval rebuilds the model from the checkpoint alone and agrees with train. */
    code = RUN(ev, "eval --checkpoint %s --limit-test 1000", ckpt);
    if (code) ct_test_fail(__FILE__, __LINE__, "eval failed (%d):\n%s", code, ev);
    line_after(ev, "test: ", acc_eval, sizeof acc_eval);
    if (strcmp(acc_train, acc_eval))
        ct_test_fail(__FILE__, __LINE__, "train said '%s', eval says '%s'", acc_train, acc_eval);
    ASSERT_STR_CONTAINS(ev, "confusion matrix");
    ASSERT_STR_CONTAINS(ev, "Ankle boot");
    ASSERT_STR_CONTAINS(ev, "T-shirt/top");
    ASSERT_EQ(count_lines(ev), 2 + 1 + 1 + 10);
    /* The optimizer sidecar is not a model: the message says which file to pass. */
    char side[4200];
    snprintf(side, sizeof side, "%s/mlp.optim.safetensors", tmp);
    ASSERT_EQ(RUN(out, "eval --checkpoint %s", side), 1);
    ASSERT_STR_CONTAINS(out, "optimizer file");

    ASSERT_EQ(RUN(out, "inspect %s", ckpt), 0);
    ASSERT_STR_CONTAINS(out, "6 tensors");
    ASSERT_STR_CONTAINS(out, "0.weight");
    ASSERT_STR_CONTAINS(out, "[256, 784]");
    ASSERT_STR_CONTAINS(out, "802816"); /* 256*784*4 bytes */
    ASSERT_STR_CONTAINS(out, "total: 235146 parameters, 940584 bytes");
    ASSERT_STR_CONTAINS(out, "ctrain.model = mlp");
    ASSERT_STR_CONTAINS(out, "ctrain.hidden = 256,128");
    ASSERT_STR_CONTAINS(out, "ctrain.step = 250");
    ASSERT_STR_CONTAINS(out, "ctrain.optim = adamw");
}

/* K steps + save + resume K more == 2K straight steps, bit for bit: the
 * subset has 15 batches an epoch, so the run crosses epochs (reshuffles)
 * and the save falls mid-epoch. */
TEST(cli_resume_is_bit_exact)
{
    static char out[OUT_MAX];
    char a[4096], b[4096], c[4096], sb[4096], sc[4096];
    const char *tmp = ct_test_tmpdir();
    snprintf(a, sizeof a, "%s/a.safetensors", tmp);
    snprintf(b, sizeof b, "%s/b.safetensors", tmp);
    snprintf(c, sizeof c, "%s/c.safetensors", tmp);
    /* --clip-norm 1.5 comes back from the checkpoint too (2 would clip otherwise) */
    const char *hyper = "--limit-train 1000 --batch 64 --seed 3 --lr 0.002 --warmup 10 --clip 0.5 --clip-norm 1.5 "
                        "--log-every 0 --limit-test 200 --threads 1";
    int code = RUN(out, "train --model mlp --hidden 64,32 %s --steps 37 --save %s", hyper, a);
    if (code) ct_test_fail(__FILE__, __LINE__, "first half failed:\n%s", out);
    /* Only --steps: everything else comes from the checkpoint. */
    code = RUN(out, "train --resume %s --steps 74 --save %s --threads 1 --limit-train 1000 --limit-test 200 "
               "--log-every 0", a, b);
    if (code) ct_test_fail(__FILE__, __LINE__, "resume failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "trained 37 steps (to step 74");
    code = RUN(out, "train --model mlp --hidden 64,32 %s --steps 74 --save %s", hyper, c);
    if (code) ct_test_fail(__FILE__, __LINE__, "straight run failed:\n%s", out);
    same_files(b, c);
    snprintf(sb, sizeof sb, "%s/b.optim.safetensors", tmp);
    snprintf(sc, sizeof sc, "%s/c.optim.safetensors", tmp);
    same_files(sb, sc);
    /* And the resumed run is not trivially equal to its start. */
    ct_safetensors *x, *y;
    ASSERT_OK(ct_safetensors_load(a, &x));
    ASSERT_OK(ct_safetensors_load(b, &y));
    const ct_tensor *wa = ct_safetensors_find(x, "0.weight"), *wb = ct_safetensors_find(y, "0.weight");
    ASSERT(memcmp(ct_tensor_data(wa), ct_tensor_data(wb), ct_tensor_bytes(wa)));
    ct_safetensors_destroy(x);
    ct_safetensors_destroy(y);
    /* A flag that would change the data order is refused, not silently ignored. */
    ASSERT_EQ(RUN(out, "train --resume %s --steps 80 --seed 4 --limit-train 1000", a), 2);
    ASSERT_STR_CONTAINS(out, "--seed 4 differs from the 3");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --clip 1 --clip-norm 0"), 2);
    ASSERT_STR_CONTAINS(out, "--clip-norm '0' is not a norm type");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --clip 1 --clip-norm 2x"), 2);
    ASSERT_STR_CONTAINS(out, "give a number > 0");
}

/* Two ranks with DDP reach the loss one process reaches with the same
 * global batch: 65 samples split 33/32 (and 17/16/16/16 with two
 * micro-batches), so the loss-gradient scaling must be exact.  The loss
 * compared is the last step's (--log-every 1). */
#define DDP_ARGS SMALL " --steps 40 --batch 65 --seed 5 --lr 0.003 --log-every 1"

static double single_process_loss(char *out)
{
    int code = RUN(out, "train " DDP_ARGS " --strategy none");
    if (code) ct_test_fail(__FILE__, __LINE__, "single process failed:\n%s", out);
    double l = number_after(out, "final train loss ");
    ASSERT(l < 1.5);
    return l;
}

TEST(cli_ddp_matches_single_process)
{
    static char out[OUT_MAX];
    double l1 = single_process_loss(out);
    char metrics[512], line[4096] = "";
    snprintf(metrics, sizeof metrics, "%s/ddp.jsonl", ct_test_tmpdir());
    int code = run_np(2, out, "train " DDP_ARGS " --strategy ddp --metrics %s", metrics);
    if (code) ct_test_fail(__FILE__, __LINE__, "ddp failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "over 2 ranks (ddp)");
    ASSERT_STR_CONTAINS(out, "rank 0      rank 1");
    /* The summary has a memory object per rank; the gradients live in the
     * buckets once, also after they were rebuilt in ready order (step 2). */
    FILE *f = fopen(metrics, "r");
    ASSERT(f);
    while (fgets(line, sizeof line, f) && !strstr(line, "\"summary\"")) {}
    fclose(f);
    ASSERT_STR_CONTAINS(line, "{\"rank\":0,\"param\":940584,\"grad\":940584,");
    ASSERT_STR_CONTAINS(line, "{\"rank\":1,\"param\":940584,\"grad\":940584,");
    /* Only rank 0 prints. */
    ASSERT_EQ(occurrences(out, "test: loss"), 1);
    ASSERT_EQ(occurrences(out, "step 40/40"), 1);
    ASSERT_NEAR(number_after(out, "final train loss "), l1, 1e-4);
}

TEST(cli_ddp_grad_accum_matches_single_process)
{
    static char out[OUT_MAX];
    double l1 = single_process_loss(out);
    int code = run_np(2, out, "train " DDP_ARGS " --grad-accum 2");
    if (code) ct_test_fail(__FILE__, __LINE__, "ddp with --grad-accum 2 failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "over 2 ranks (ddp)");
    ASSERT_NEAR(number_after(out, "final train loss "), l1, 1e-4);
}

/* Dropout keys on a sample's place in the global batch: 1 process and 2, 3
 * and 4 ranks draw the same masks and train the same weights. */
TEST(cli_dropout_same_for_any_number_of_ranks)
{
    static char out[OUT_MAX];
    char ref[512], path[512];
    snprintf(ref, sizeof ref, "%s/drop1.safetensors", ct_test_tmpdir());
    int code = RUN(out, "train " SMALL " --steps 5 --batch 48 --seed 2 --dropout 0.2 --log-every 1 --save %s", ref);
    if (code) ct_test_fail(__FILE__, __LINE__, "single process failed:\n%s", out);
    ASSERT_STR_CONTAINS(out, "dropout 0.2");
    double l1 = number_after(out, "final train loss ");
    ct_safetensors *a;
    ASSERT_OK(ct_safetensors_load(ref, &a));
    for (int np = 2; np <= 4; np++) {
        snprintf(path, sizeof path, "%s/drop%d.safetensors", ct_test_tmpdir(), np);
        code = run_np(np, out, "train " SMALL " --steps 5 --batch 48 --seed 2 --dropout 0.2 --log-every 1 --save %s",
                      path);
        if (code) ct_test_fail(__FILE__, __LINE__, "%d ranks failed:\n%s", np, out);
        ASSERT_NEAR(number_after(out, "final train loss "), l1, 1e-5);
        ct_safetensors *b;
        ASSERT_OK(ct_safetensors_load(path, &b));
        ASSERT_EQ(ct_safetensors_count(a), ct_safetensors_count(b));
        for (int i = 0; i < ct_safetensors_count(a); i++) {
            ct_tensor *ta = ct_safetensors_tensor(a, i), *tb = ct_safetensors_find(b, ct_safetensors_name(a, i));
            ASSERT(tb && ta->numel == tb->numel);
            for (int64_t j = 0; j < ta->numel; j++) ASSERT_NEAR(ct_f32(ta)[j], ct_f32(tb)[j], 1e-5);
        }
        ct_safetensors_destroy(b);
    }
    /* and the mask is real: without dropout the run differs */
    code = RUN(out, "train " SMALL " --steps 5 --batch 48 --seed 2 --log-every 1");
    ASSERT_EQ(code, 0);
    ASSERT(fabs(number_after(out, "final train loss ") - l1) > 1e-4);
    ct_safetensors_destroy(a);
}

/* --mixed bf16 (bf16 products on f32 master weights) over 2 DDP ranks
 * reaches the f32 accuracy on the whole Fashion-MNIST test set: within 0.5
 * points after 2 epochs. */
TEST(cli_mixed_bf16_accuracy_matches_f32)
{
    static char out[OUT_MAX];
    const char *args = "train --model mlp --epochs 2 --seed 3 --log-every 0 --threads 1";
    int code = RUN(out, "%s", args);
    if (code == 1 && strstr(out, "fashion-mnist")) SKIP("the Fashion-MNIST files are missing");
    if (code) ct_test_fail(__FILE__, __LINE__, "f32 run failed:\n%s", out);
    double f32 = number_after(out, "accuracy ");
    code = run_np(2, out, "%s --mixed bf16", args);
    if (code) ct_test_fail(__FILE__, __LINE__, "bf16 run failed:\n%s", out);
    double bf16 = number_after(out, "accuracy ");
    ASSERT(f32 > 84);
    ASSERT_NEAR(bf16, f32, 0.5);
    ASSERT_EQ(run_np(2, out, "train " SMALL " --steps 3 --mixed fp8"), 2);
    ASSERT_STR_CONTAINS(out, "unknown --mixed 'fp8'; choose none or bf16");
}

/* ---- ZeRO ------------------------------------------------------------------- */

/* Field key of rank r's memory object in a metrics summary line. */
static double mem_field(const char *summary, int r, const char *key)
{
    char tag[32], k[48];
    snprintf(tag, sizeof tag, "{\"rank\":%d,", r);
    const char *o = strstr(summary, tag);
    if (!o) ct_test_fail(__FILE__, __LINE__, "no rank %d in %s", r, summary);
    snprintf(k, sizeof k, "\"%s\":", key);
    return number_after(o, k);
}

/* The summary line of a metrics file (its last line). */
static void summary_of(const char *path, char *line, size_t n)
{
    FILE *f = fopen(path, "r");
    ASSERT(f);
    line[0] = 0;
    while (fgets(line, (int)n, f) && !strstr(line, "\"summary\"")) {}
    fclose(f);
    ASSERT_STR_CONTAINS(line, "\"summary\"");
}

/* What sharding saves, read off the memory report: optimizer state per rank
 * is 1/N of DDP's (zero1 with the flat partition: exact balance), and
 * zero2's optimizer state and gradients are what the rank owns (whole
 * parameters here, so the partition's figures are exact) plus, for
 * gradients, what is in flight: reduce_buffer_mb and the largest gradient
 * being materialised. */
TEST(cli_zero_memory_follows_the_formulas)
{
    static char out[OUT_MAX];
    static char ddp[4096], z1[4096], z2[4096];
    char m[512];
    const char *args = "train --model mlp --hidden 512,512,512 --limit-train 2000 --limit-test 200 --threads 1 "
                       "--steps 6 --log-every 0 --batch 32 --verbose";
    const char *names[3] = {"ddp", "zero1 --strategy-opt split_params=1",
                            "zero2 --strategy-opt reduce_buffer_mb=0.5"};
    char *lines[3] = {ddp, z1, z2};
    double owned[2] = {0, 0};
    for (int k = 0; k < 3; k++) {
        snprintf(m, sizeof m, "%s/m%d.jsonl", ct_test_tmpdir(), k);
        int code = run_np(2, out, "%s --strategy %s --metrics %s", args, names[k], m);
        if (code) ct_test_fail(__FILE__, __LINE__, "%s failed:\n%s", names[k], out);
        summary_of(m, lines[k], 4096);
        if (k == 2) {
            owned[0] = number_after(out, "rank 0 owns ");
            owned[1] = number_after(out, "rank 1 owns ");
        }
    }
    ASSERT_EQ(owned[0] + owned[1], 932362);
    for (int r = 0; r < 2; r++) {
        double optim = mem_field(ddp, r, "optim"), grad = mem_field(ddp, r, "grad");
        double param = mem_field(ddp, r, "param");
        ASSERT_EQ(mem_field(z1, r, "param"), param);
        ASSERT_EQ(mem_field(z1, r, "grad"), grad); /* zero1 keeps DDP's buckets */
        ASSERT_NEAR(mem_field(z1, r, "optim"), optim / 2, 0.1 * optim / 2);
        ASSERT_NEAR(mem_field(z2, r, "optim"), 8 * owned[r], 0.01 * 8 * owned[r]);
        double g2 = mem_field(z2, r, "grad");
        ASSERT(g2 >= 4 * owned[r]);
        ASSERT(g2 <= 4 * owned[r] + 0.5 * 1048576 + (784.0 * 512 + 512) * 4);
    }
}

/* A checkpoint saved by strategy on na ranks resumes under strategy2 on nb
 * ranks (in the given format): weights and optimizer state equal an
 * uninterrupted run of strategy on na ranks.  Pieces (local) name
 * different tensors at different world sizes, so those runs end with full
 * checkpoints to compare. */
static void resume_case(const char *strategy, int na, const char *strategy2, int nb, const char *format)
{
    static char out[OUT_MAX];
    char a[512], a2[512], b[512];
    const char *tmp = ct_test_tmpdir(), *fin = strcmp(format, "local") ? format : "full";
    const char *base = "train --model mlp --limit-train 2000 --limit-test 200 --threads 1 --log-every 0 --batch 48 "
                       "--seed 7";
    snprintf(a, sizeof a, "%s/%s-a%s", tmp, strategy, strcmp(format, "full") ? "" : ".safetensors");
    snprintf(a2, sizeof a2, "%s/%s-a%s", tmp, strategy, strcmp(fin, "full") ? "" : ".safetensors");
    snprintf(b, sizeof b, "%s/%s-b%s", tmp, strategy, strcmp(fin, "full") ? "" : ".safetensors");
    int code = run_np(na, out, "%s --strategy %s --steps 12 --save %s --state-dict %s", base, strategy, a, format);
    if (code) ct_test_fail(__FILE__, __LINE__, "%d ranks failed:\n%s", na, out);
    code = run_np(nb, out, "train --strategy %s --steps 24 --resume %s --save %s --state-dict %s --threads 1 "
                           "--log-every 0 --limit-train 2000 --limit-test 200", strategy2, a, a2, fin);
    if (code) ct_test_fail(__FILE__, __LINE__, "resume on %d ranks failed:\n%s", nb, out);
    code = run_np(na, out, "%s --strategy %s --steps 24 --save %s --state-dict %s", base, strategy, b, fin);
    if (code) ct_test_fail(__FILE__, __LINE__, "straight run failed:\n%s", out);
    snprintf(a, sizeof a, "%s", a2);
    for (int side = 0; side < 2; side++) {
        char pa[600], pb[600];
        if (side && !strcmp(fin, "full")) { /* X.safetensors -> X.optim.safetensors */
            snprintf(pa, sizeof pa, "%.*s.optim.safetensors", (int)strlen(a) - 12, a);
            snprintf(pb, sizeof pb, "%.*s.optim.safetensors", (int)strlen(b) - 12, b);
        } else if (side) {
            snprintf(pa, sizeof pa, "%s/optim.safetensors.index.json", a);
            snprintf(pb, sizeof pb, "%s/optim.safetensors.index.json", b);
        } else {
            snprintf(pa, sizeof pa, "%s", a);
            snprintf(pb, sizeof pb, "%s", b);
        }
        ct_safetensors *x, *y;
        ASSERT_OK(ct_safetensors_load(pa, &x));
        ASSERT_OK(ct_safetensors_load(pb, &y));
        ASSERT_EQ(ct_safetensors_count(x), ct_safetensors_count(y));
        double num = 0, den = 0;
        for (int i = 0; i < ct_safetensors_count(x); i++) {
            ct_tensor *tx = ct_safetensors_tensor(x, i), *ty = ct_safetensors_find(y, ct_safetensors_name(x, i));
            ASSERT(ty && tx->numel == ty->numel && tx->dtype == ty->dtype);
            if (tx->dtype == CT_I64) {
                ASSERT_EQ(((int64_t *)ct_tensor_data(tx))[0], ((int64_t *)ct_tensor_data(ty))[0]);
                continue;
            }
            for (int64_t j = 0; j < tx->numel; j++) {
                double d = (double)ct_f32(tx)[j] - ct_f32(ty)[j];
                num += d * d;
                den += (double)ct_f32(ty)[j] * ct_f32(ty)[j];
            }
        }
        if (!(sqrt(num / den) < 1e-5))
            ct_test_fail(__FILE__, __LINE__, "%s %s %s: relative L2 %g", strategy, format, side ? "optim" : "model",
                         sqrt(num / den));
        ct_safetensors_destroy(x);
        ct_safetensors_destroy(y);
    }
}

TEST(cli_zero_checkpoints_move_between_world_sizes)
{
    resume_case("zero1", 4, "zero1", 2, "full");
    resume_case("zero2", 4, "zero2", 2, "sharded");
}

/* FSDP's full and sharded checkpoints move between world sizes (4 -> 2,
 * 2 -> 3) and strategies (fsdp -> ddp -> fsdp). */
TEST(cli_fsdp_checkpoints_move_between_world_sizes_and_strategies)
{
    resume_case("fsdp", 4, "fsdp", 2, "full");
    resume_case("fsdp", 2, "fsdp", 3, "sharded");
    resume_case("fsdp", 2, "ddp", 2, "full");
    resume_case("ddp", 2, "fsdp", 3, "sharded");
}

/* Each rank's own pieces (--state-dict local, nothing gathered) load at
 * another world size and under another strategy.  fsdp's under pipe failed
 * before (issue 24, case 3): a stage's model lacks the other stages'
 * tensors, so their pieces "belonged to no tensor". */
TEST(cli_local_checkpoints_move_between_world_sizes_and_strategies)
{
    resume_case("fsdp", 2, "fsdp", 3, "local");
    resume_case("fsdp", 2, "pipe", 3, "local");
    resume_case("zero2", 3, "ddp", 2, "local");
    resume_case("ddp", 2, "fsdp", 4, "local");
}

/* World-size errors: every rank sees them, rank 0 says them once. */
TEST(cli_ddp_usage_errors)
{
    static char out[OUT_MAX];
    ASSERT_EQ(run_np(2, out, "train " SMALL " --steps 2 --batch 1"), 2);
    ASSERT_STR_CONTAINS(out, "--batch 1 is smaller than the 2 ranks");
    ASSERT_EQ(occurrences(out, "ctrain train:"), 1);
    ASSERT_EQ(run_np(2, out, "train " SMALL " --steps 2 --strategy none"), 2);
    ASSERT_STR_CONTAINS(out, "use --strategy ddp");
    ASSERT_EQ(occurrences(out, "ctrain train:"), 1);
    /* a DDP flag given to a strategy without buckets is refused, not ignored */
    ASSERT_EQ(run_np(2, out, "train " SMALL " --steps 2 --strategy zero2 --find-unused-parameters"), 2);
    ASSERT_STR_CONTAINS(out, "strategy zero2 has no option 'find_unused_parameters'");
    ASSERT_EQ(occurrences(out, "ctrain train:"), 1);
    ASSERT_EQ(run_np(2, out, "train " SMALL " --steps 2 --batch 3 --grad-accum 2"), 2);
    ASSERT_STR_CONTAINS(out, "2 ranks x 2 micro-batches");
    /* A flag error found before MPI starts is also said once. */
    ASSERT_EQ(run_np(2, out, "train " SMALL " --steps x"), 2);
    ASSERT_EQ(occurrences(out, "ctrain train:"), 1);
}

/* ---- ctrain estimate ------------------------------------------------------ */

#define EST_MODEL "--model mlp --hidden 512,512,512"
#define EST_RUN "--steps 5 --limit-train 2000 --limit-test 200 --threads 1 --log-every 0"

/* `ctrain estimate` against the memory report of a short `ctrain train` of
 * the same model on np ranks (max over ranks): param, grad, optim and
 * resident within 10%, activations within 25%. */
static void estimate_matches_model(const char *model, int np, const char *strategy, const char *extra)
{
    static char out[OUT_MAX], est[OUT_MAX];
    char metrics[1024], line[8192] = "";
    snprintf(metrics, sizeof metrics, "%s/est-%s-%d.jsonl", ct_test_tmpdir(), strategy, np);
    char saved[1024]; /* the estimate's whole life holds a full save */
    snprintf(saved, sizeof saved, "%s/est-%s-%d.safetensors", ct_test_tmpdir(), strategy, np);
    int code = run_np(np, out, "train %s " EST_RUN " --strategy %s %s --metrics %s --save %s", model, strategy, extra,
                      metrics, saved);
    if (code) ct_test_fail(__FILE__, __LINE__, "train %s --strategy %s %s failed:\n%s", model, strategy, extra, out);
    FILE *f = fopen(metrics, "r");
    ASSERT(f);
    while (fgets(line, sizeof line, f) && !strstr(line, "\"summary\"")) {}
    fclose(f);
    ASSERT_STR_CONTAINS(line, "\"summary\"");
    ASSERT_EQ(unlink(metrics), 0);
    code = RUN(est, "estimate %s --ranks %d --strategy %s %s --json", model, np, strategy, extra);
    if (code) ct_test_fail(__FILE__, __LINE__, "estimate %s --strategy %s %s failed:\n%s", model, strategy, extra, est);
    ASSERT_EQ(count_lines(est), 1);
    /* comm: PowerSGD's buffers (P, Q, the uncompressed part, error
     * feedback); pipe's sends in flight and its spare */
    const char *keys[] = {"param", "grad", "optim", "resident", "act", "comm"};
    int comm = strstr(extra, "powersgd") || !strcmp(strategy, "pipe");
    for (size_t i = 0; i < sizeof keys / sizeof keys[0] - !comm; i++) {
        double m = json_max(line, keys[i]), e = json_max(est, keys[i]);
        double tol = strcmp(keys[i], "act") ? 0.10 : 0.25;
        /* pipe's sends stay until reaped, and how many the peer has taken by
         * then is timing: the plan is their bound, and a run holds up to it */
        int bound = !strcmp(strategy, "pipe") && !strcmp(keys[i], "comm");
        if (bound ? !(m <= (1 + tol) * e) : !(fabs(e - m) <= tol * m))
            ct_test_fail(__FILE__, __LINE__, "%s %s on %d ranks %s: %s predicted %.0f, measured %.0f (more than "
                         "%.0f%% apart)\nestimate: %smeasured: %s", model, strategy, np, extra, keys[i], e, m,
                         tol * 100, est, line);
    }
    /* The whole life's peak RSS: the runtime's fixed RSS the estimate measured, plus the plan's peak; the
     * data set (the whole Fashion-MNIST, whatever --limit-train keeps) is not in the estimate.  The MLP's
     * only: the CNN's peak is its evaluation's (batches of --eval-batch rows through conv scratch), which
     * the estimate does not plan. */
    double life = json_max(line, "rss_life") - json_max(line, "data"), want = json_max(est, "rss");
    ASSERT(json_max(est, "fixed") > 4 << 20);
#ifdef __SANITIZE_ADDRESS__
    (void)life, (void)want; /* AddressSanitizer's shadow and quarantine are RSS no plan knows of */
#else
    if (!strcmp(model, EST_MODEL) && !(fabs(want - life) <= 0.25 * life))
        ct_test_fail(__FILE__, __LINE__, "%s %s on %d ranks %s: whole-life peak RSS predicted %.0f, measured %.0f "
                     "without the data set (more than 25%% apart)\nestimate: %smeasured: %s", model, strategy, np, extra,
                     want, life, est, line);
#endif
}

static void estimate_matches_run(int np, const char *strategy, const char *extra)
{
    estimate_matches_model(EST_MODEL, np, strategy, extra);
}

TEST(cli_estimate_matches_ddp_and_zero1_runs)
{
    estimate_matches_run(2, "ddp", "");
    estimate_matches_run(2, "ddp", "--mixed bf16");
    estimate_matches_run(2, "zero1", "");
    /* conv2d's records and im2col scratch, maxpool's argmax, flatten's view */
    estimate_matches_model("--model cnn --hidden 8,16,64", 2, "ddp", "--batch 32");
    /* batchnorm's parameters, running statistics and records */
    estimate_matches_model("--model cnn --batchnorm --hidden 8,16,64", 2, "ddp", "--batch 32");
}

/* --grad-compress powersgd:4 from its first compressed step (the third):
 * the comm column is PowerSGD's buffers; only ddp and zero1 take it. */
TEST(cli_estimate_matches_powersgd_runs)
{
    estimate_matches_run(2, "ddp", "--grad-compress powersgd:4 --strategy-opt powersgd_start_iter=2");
    estimate_matches_run(3, "zero1", "--grad-compress powersgd:2 --strategy-opt powersgd_start_iter=2");
    static char out[OUT_MAX];
    ASSERT_EQ(RUN(out, "estimate " EST_MODEL " --ranks 2 --grad-compress powersgd:4"), 0);
    ASSERT_STR_CONTAINS(out, ", powersgd:4 reduce");
    ASSERT_STR_CONTAINS(out, "\n  ddp ");
    ASSERT_STR_CONTAINS(out, "\n  zero1 ");
    ASSERT(!strstr(out, "\n  fsdp "));
    /* without error feedback only the factors and the uncompressed part: far less */
    ASSERT_EQ(RUN(out, "estimate " EST_MODEL " --ranks 2 --strategy ddp --grad-compress powersgd:4 --json"), 0);
    double with = json_max(out, "comm");
    ASSERT_EQ(RUN(out, "estimate " EST_MODEL " --ranks 2 --strategy ddp --grad-compress powersgd:4 --json "
                       "--strategy-opt powersgd_error_feedback=0"), 0);
    ASSERT(json_max(out, "comm") < with / 20);
    ASSERT_EQ(RUN(out, "estimate " EST_MODEL " --ranks 2 --strategy fsdp --grad-compress powersgd:4"), 2);
    ASSERT_STR_CONTAINS(out, "applies to --strategy ddp and zero1");
    ASSERT_EQ(RUN(out, "estimate " EST_MODEL " --ranks 2 --grad-compress powersgd:x"), 2);
    ASSERT_STR_CONTAINS(out, "choose none, bf16, f16 or powersgd:R");
}

/* ZeRO-2 at 2 ranks (every gradient fits reduce_buffer_mb) and at 3 ranks
 * with 1 MiB in flight, where a rank's gradients are its share plus what
 * the in-flight bound lets live. */
TEST(cli_estimate_matches_zero2_runs)
{
    estimate_matches_run(2, "zero2", "");
    estimate_matches_run(3, "zero2", "--strategy-opt reduce_buffer_mb=1");
}

/* Pipe: every stage's parameters, gradients and optimizer state; the
 * activations of each schedule and checkpoint mode (the largest stage's). */
TEST(cli_estimate_matches_pipe_runs)
{
    estimate_matches_run(2, "pipe", "--strategy-opt chunks=4,checkpoint=never");
    estimate_matches_run(2, "pipe", "--strategy-opt chunks=8,schedule=gpipe");
    estimate_matches_run(3, "pipe", "--strategy-opt chunks=6,checkpoint=always");
    estimate_matches_run(4, "pipe", "--strategy-opt stages=2,dp=zero1");
}

/* FSDP: pieces plus the units unsharded at once (ct_fsdp_plan's units), in
 * f32 and bf16 (the weights gathered in bf16), FULL_SHARD and SHARD_GRAD_OP. */
TEST(cli_estimate_matches_fsdp_runs)
{
    estimate_matches_run(2, "fsdp", "");
    estimate_matches_run(3, "fsdp", "--mixed bf16");
    estimate_matches_run(2, "fsdp", "--strategy-opt sharding=grad_op,backward_prefetch=none");
}

/* The table: a row per strategy that applies (none only on one rank), the
 * columns, and figures that follow from the model alone. */
TEST(cli_estimate_table)
{
    static char out[OUT_MAX];
    ASSERT_EQ(RUN(out, "estimate --model mlp --ranks 1"), 0);
    ASSERT_STR_CONTAINS(out, "mlp [256,128] (235146 parameters)");
    const char *cols[] = {"strategy", "param", "grad", "optim", "act", "comm", "resident", "total",
                          "\n  none ", "\n  ddp ", "\n  zero1 ", "\n  zero2 ", "\n  fsdp "};
    for (size_t i = 0; i < sizeof cols / sizeof cols[0]; i++) ASSERT_STR_CONTAINS(out, cols[i]);
    ASSERT_EQ(RUN(out, "estimate --model mlp --ranks 4 --json"), 0);
    ASSERT_EQ(count_lines(out), 6); /* ddp, zero1, zero2, fsdp, pipe, offload: none is one rank's */
    ASSERT(!strstr(out, "\"none\""));
    /* 235146 f32 parameters; AdamW's two moments, each slot padded to 16 floats (4.bias: 10 -> 16). */
    ASSERT_STR_CONTAINS(out, "{\"strategy\":\"ddp\",\"ranks\":4,\"param\":940584,\"grad\":940584,\"optim\":1881216,");
    ASSERT_EQ(RUN(out, "estimate --model mlp --ranks 2 --strategy ddp --grad-compress bf16 --json"), 0);
    ASSERT_STR_CONTAINS(out, "\"comm\":470292,"); /* a 2-byte wire copy of every bucket */
    ASSERT_EQ(RUN(out, "estimate --model mlp --ranks 2 --strategy ddp --optim sgd --json"), 0);
    ASSERT_STR_CONTAINS(out, "\"optim\":0,");
    ASSERT_EQ(RUN(out, "estimate --model cnn --ranks 2 --strategy zero2 --strategy-opt split_params=1"), 0);
    ASSERT_STR_CONTAINS(out, "\n  zero2 ");
    ASSERT_EQ(RUN(out, "estimate --model mlp --ranks 2 --strategy-opt help"), 0);
    ASSERT_STR_CONTAINS(out, "reduce_buffer_mb=8");
}

/* Bad command lines: exit 2 and one line naming the fix. */
/* The estimate reads shapes only: a 2B-parameter GPT (8 GB of f32 weights)
 * is planned under a 600 MB address-space limit, where building it whole
 * (as the estimate once did, drawing every initial value) fails. */
TEST(cli_estimate_builds_the_model_shape_only)
{
#if defined(__SANITIZE_ADDRESS__)
    SKIP("AddressSanitizer reserves terabytes of address space for its shadow: no ulimit -v under it");
#endif
    static char out[OUT_MAX];
    int code = run_sh(0, "ulimit -v 600000;", out, "estimate --model gpt --layers 40 --heads 16 --dim 2048 --context 64 "
                      "--batch 2 --ranks 2 --strategy fsdp --offload all");
    if (code != 0) printf("%s\n", out);
    ASSERT_EQ(code, 0);
    ASSERT(strstr(out, "(2014990336 parameters)") != NULL);
}

TEST(cli_estimate_usage_errors)
{
    static char out[OUT_MAX];
    struct {
        const char *args, *text;
    } cases[] = {
        {"estimate --ranks 2", "--model is required; choose one of: mlp, cnn"},
        {"estimate --model resnet --ranks 2", "choose one of: mlp, cnn"},
        {"estimate --model mlp", "--ranks is required"},
        {"estimate --model mlp --ranks 0", "--ranks 0 must be at least 1"},
        {"estimate --model mlp --ranks -3", "--ranks -3 must be at least 1"},
        {"estimate --model mlp --ranks 2 --strategy ddp --strategy-opt split_params=1",
         "--strategy-opt split_params: no strategy estimated here takes it (zero1, zero2 do)"},
        {"estimate --model mlp --ranks 2 --strategy-opt bucket=4", "--strategy-opt bucket: no strategy takes this key"},
        {"estimate --model mlp --ranks 2 --strategy-opt reduce_buffer_mb=0", "expected a positive number"},
        {"estimate --model mlp --ranks 2 --strategy none", "applies to --ranks 1 only"},
        {"estimate --model mlp --ranks 2 --strategy fsdp9", "unknown strategy 'fsdp9'"},
        {"estimate --model mlp --ranks 128", "--batch 64 is smaller than the 128 ranks"},
        {"estimate --model mlp --ranks 2 --kernel 3", "--kernel applies to --model cnn only"},
        {"estimate --model mlp --ranks 2 --optim lbfgs", "choose sgd or adamw"},
        {"estimate --model mlp --ranks 2 --mixed fp8", "choose none or bf16"},
        {"estimate --model mlp --ranks 2 x", "unexpected argument 'x'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int code = RUN(out, "%s", cases[i].args);
        if (code != 2 || !strstr(out, cases[i].text) || count_lines(out) != 1)
            ct_test_fail(__FILE__, __LINE__, "ctrain %s: exit %d (wanted 2), output:\n%s(wanted one line with '%s')",
                         cases[i].args, code, out, cases[i].text);
    }
}

/* PyTorch builds nn.Sequential(Linear(784,256), ReLU(), Linear(256,128),
 * ReLU(), Linear(128,10)), loads the checkpoint with strict=True, and
 * computes the same logits as ctrain on fixed inputs. */
static const char torch_check_py[] =
    "import sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "import torch\n"
    "from st_check import load, load_checkpoint\n"
    "state, meta = load_checkpoint(sys.argv[2])\n"
    "io, _ = load(sys.argv[3])\n"
    "assert meta['ctrain.model'] == 'mlp', meta\n"
    "net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),\n"
    "                          torch.nn.ReLU(), torch.nn.Linear(128, 10))\n"
    "net.load_state_dict(state, strict=True)\n"
    "with torch.no_grad():\n"
    "    got = net(io['x'])\n"
    "diff = (got - io['logits']).abs().max().item()\n"
    "print('max abs diff', diff)\n"
    "sys.exit(0 if diff < 1e-4 else 1)\n";

/* 1 when /usr/bin/python3 has torch and scripts/st_check.py is there; else says why the test skips. */
static int torch_available(char *scripts, size_t n)
{
    if (system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
        SKIP("/usr/bin/python3 cannot import torch");
    }
    snprintf(scripts, n, "%s/../scripts", cli_bin_dir());
    char probe[1200];
    snprintf(probe, sizeof probe, "%s/st_check.py", scripts);
    if (access(probe, R_OK) != 0) {
        SKIP("%s is missing", probe);
    }
    return 1;
}

/* ctrain's logits from checkpoint ckpt (a file or a sharded directory),
 * through the public API, on inputs made here; then PyTorch loads ckpt
 * itself (scripts/st_check.py's load_checkpoint) and must agree. */
static void torch_logits_check(const char *scripts, const char *ckpt, char *out)
{
    char io[1024], py[1024], cmd[8192];
    const char *tmp = ct_test_tmpdir();
    snprintf(io, sizeof io, "%s/io.safetensors", tmp);
    snprintf(py, sizeof py, "%s/check.py", tmp);
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(ckpt, &st));
    ct_meta m;
    memset(&m, 0, sizeof m);
    for (int i = 0; i < ct_safetensors_meta_count(st); i++)
        ASSERT_OK(ct_meta_set(&m, ct_safetensors_meta_key(st, i), "%s", ct_safetensors_meta_value(st, i)));
    ct_model_config cfg;
    ASSERT_OK(ct_model_config_from_meta(&m, &cfg));
    ct_meta_fini(&m);
    ct_module *model;
    ASSERT_OK(ct_model_build(&cfg, 0, &model));
    for (int i = 0; i < ct_safetensors_count(st); i++) {
        ct_param *p = ct_module_find(model, ct_safetensors_name(st, i));
        ASSERT(p);
        ASSERT_OK(ct_tensor_copy(p->data, ct_safetensors_tensor(st, i)));
    }
    ct_tensor *x = ct_tensor_create2(5, 784, CT_MEM_ACT), *y;
    for (int64_t i = 0; i < x->numel; i++) ct_f32(x)[i] = (float)sin(0.37 * (double)i) * 1.5f;
    ct_fwd_ctx ctx = {.training = 0, .seed = 0, .step = 0};
    ASSERT_OK(ct_module_forward(model, x, &y, NULL, &ctx));
    const char *names[] = {"x", "logits"};
    ct_tensor *ts[] = {x, y};
    ASSERT_OK(ct_safetensors_save(io, names, ts, 2, NULL, NULL, 0));

    FILE *f = fopen(py, "w");
    ASSERT(f);
    fputs(torch_check_py, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s %s %s %s 2>&1", py, scripts, ckpt, io);
    FILE *p = popen(cmd, "r");
    ASSERT(p);
    size_t n = fread(out, 1, OUT_MAX - 1, p);
    out[n] = 0;
    int stc = pclose(p);
    if (!WIFEXITED(stc) || WEXITSTATUS(stc) != 0)
        ct_test_fail(__FILE__, __LINE__, "PyTorch check of %s failed:\n%s", ckpt, out);
    ASSERT_STR_CONTAINS(out, "max abs diff");
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_module_destroy(model);
    ct_safetensors_destroy(st);
}

TEST(cli_checkpoint_loads_in_pytorch)
{
    static char out[OUT_MAX];
    char scripts[1100], ckpt[1024];
    if (!torch_available(scripts, sizeof scripts)) return;
    snprintf(ckpt, sizeof ckpt, "%s/torch.safetensors", ct_test_tmpdir());
    int code = RUN(out, "train " SMALL " --steps 20 --log-every 0 --save %s", ckpt);
    if (code) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
    torch_logits_check(scripts, ckpt, out);
}

/* A sharded checkpoint of 2 ranks loads in PyTorch through its index (the
 * script checks the index against the shards) and gives ctrain's logits. */
TEST(cli_sharded_checkpoint_loads_in_pytorch)
{
    static char out[OUT_MAX];
    char scripts[1100], dir[1024];
    if (!torch_available(scripts, sizeof scripts)) return;
    snprintf(dir, sizeof dir, "%s/torch-sharded", ct_test_tmpdir());
    int code = run_np(2, out, "train " SMALL " --steps 20 --log-every 0 --save %s --state-dict sharded", dir);
    if (code) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
    torch_logits_check(scripts, dir, out);
}

/* FSDP's full state dict (gathered a parameter at a time to rank 0) is an
 * nn.Sequential state_dict that PyTorch loads strictly. */
TEST(cli_fsdp_checkpoint_loads_in_pytorch)
{
    static char out[OUT_MAX];
    char scripts[1100], ckpt[1024];
    if (!torch_available(scripts, sizeof scripts)) return;
    snprintf(ckpt, sizeof ckpt, "%s/fsdp.safetensors", ct_test_tmpdir());
    int code = run_np(2, out, "train " SMALL " --steps 20 --log-every 0 --strategy fsdp --wrap-min-params 1000 "
                      "--mixed bf16 --save %s", ckpt);
    if (code) ct_test_fail(__FILE__, __LINE__, "train failed:\n%s", out);
    torch_logits_check(scripts, ckpt, out);
}

/* ---- sharded checkpoints ------------------------------------------------ */

/* Number of entries in dir; each of the n names must be among them. */
static int dir_has_exactly(const char *dir, const char *const *names, int n)
{
    DIR *d = opendir(dir);
    if (!d) ct_test_fail(__FILE__, __LINE__, "cannot open %s", dir);
    struct dirent *e;
    int count = 0, found = 0;
    char seen[4096] = "";
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        count++;
        size_t at = strlen(seen);
        snprintf(seen + at, sizeof seen - at, " %s", e->d_name);
        for (int i = 0; i < n; i++) found += !strcmp(e->d_name, names[i]);
    }
    closedir(d);
    if (count != n || found != n) ct_test_fail(__FILE__, __LINE__, "%s holds%s; wanted exactly the %d expected", dir, seen, n);
    return count;
}

/* Two checkpoints with the same tensors, every f32 value within tol. */
static void near_files(const char *x, const char *y, double tol)
{
    ct_safetensors *a, *b;
    ASSERT_OK(ct_safetensors_load(x, &a));
    ASSERT_OK(ct_safetensors_load(y, &b));
    ASSERT_EQ(ct_safetensors_count(a), ct_safetensors_count(b));
    for (int i = 0; i < ct_safetensors_count(a); i++) {
        ct_tensor *ta = ct_safetensors_tensor(a, i), *tb = ct_safetensors_find(b, ct_safetensors_name(a, i));
        ASSERT(tb && ta->numel == tb->numel && ta->dtype == CT_F32 && tb->dtype == CT_F32);
        for (int64_t j = 0; j < ta->numel; j++) ASSERT_NEAR(ct_f32(ta)[j], ct_f32(tb)[j], tol);
    }
    ct_safetensors_destroy(a);
    ct_safetensors_destroy(b);
}

static void run_ok(int np, char *out, const char *what, const char *fmt, const char *a, const char *b)
{
    int code = run_np(np, out, fmt, a, b);
    if (code) ct_test_fail(__FILE__, __LINE__, "%s (exit %d):\n%s", what, code, out);
}

/* 2 ranks (DDP) save a sharded checkpoint at step 20.  It holds bit for bit
 * what a full checkpoint of the same run holds; resuming it to step 40 with
 * 1 process, 2 ranks and 3 ranks gives bit for bit what resuming the full
 * checkpoint gives (and, with 2 ranks, what a straight 40-step run gives);
 * the 2-rank resume saves into the same directory, which then holds only
 * the new generation. */
#define SH_HYPER "--model mlp --hidden 64,32 --limit-train 1000 --batch 64 --seed 3 --lr 0.002 --warmup 10 " \
                 "--clip 0.5 --log-every 0 --limit-test 200 --threads 1"
#define SH_REST "--threads 1 --limit-train 1000 --limit-test 200 --log-every 0"

TEST(cli_sharded_resume_matches_full_checkpoint)
{
    static char out[OUT_MAX];
    const char *tmp = ct_test_tmpdir();
    char sh[1024], full[1024], d3[1024], p[4][1100], q[4][1100];
    snprintf(sh, sizeof sh, "%s/sharded", tmp);
    snprintf(full, sizeof full, "%s/full.safetensors", tmp);
    run_ok(2, out, "sharded save", "train " SH_HYPER " --steps 20 --save %s --state-dict sharded%s", sh, "");
    ASSERT_STR_CONTAINS(out, "sharded over 2 ranks");
    run_ok(2, out, "full save", "train " SH_HYPER " --steps 20 --save %s%s", full, "");
    const char *layout[] = {"model.safetensors.index.json", "optim.safetensors.index.json",
                            "model-step000020-00000-of-00002.safetensors", "model-step000020-00001-of-00002.safetensors",
                            "optim-step000020-00000-of-00002.safetensors", "optim-step000020-00001-of-00002.safetensors"};
    dir_has_exactly(sh, layout, 6);
    snprintf(p[0], sizeof p[0], "%s/optim.safetensors.index.json", sh);
    snprintf(q[0], sizeof q[0], "%s/full.optim.safetensors", tmp);
    same_files(sh, full);
    same_files(p[0], q[0]);
    /* The index's metadata is the full checkpoint's, plus total_size and the save's generation, less
     * the file's own checksums (each shard has its own); each save has its own id (ctrain.commit). */
    ct_safetensors *a, *b;
    ASSERT_OK(ct_safetensors_load(sh, &a));
    ASSERT_OK(ct_safetensors_load(full, &b));
    ASSERT_EQ(ct_safetensors_meta_count(a), ct_safetensors_meta_count(b) - 1 + 2);
    ASSERT(!strcmp(ct_safetensors_meta(a, "ctrain.generation"), "step000020"));
    ASSERT(ct_safetensors_meta(b, "ctrain.crc32") && !ct_safetensors_meta(a, "ctrain.crc32"));
    for (int i = 0; i < ct_safetensors_meta_count(b); i++) {
        const char *k = ct_safetensors_meta_key(b, i);
        if (strcmp(k, "ctrain.crc32") && strcmp(k, "ctrain.commit"))
            ASSERT(!strcmp(ct_safetensors_meta(a, k), ct_safetensors_meta_value(b, i)));
    }
    ASSERT_EQ(atoll(ct_safetensors_meta(a, "total_size")), 52650 * 4);
    ct_safetensors_destroy(a);
    ct_safetensors_destroy(b);

    /* 1 process and 3 ranks continue from either checkpoint alike. */
    snprintf(p[1], sizeof p[1], "%s/from-sharded-1.safetensors", tmp);
    snprintf(q[1], sizeof q[1], "%s/from-full-1.safetensors", tmp);
    run_ok(0, out, "1-process resume of the sharded checkpoint", "train --resume %s --steps 40 --save %s " SH_REST, sh, p[1]);
    ASSERT_STR_CONTAINS(out, "trained 20 steps (to step 40");
    run_ok(0, out, "1-process resume of the full checkpoint", "train --resume %s --steps 40 --save %s " SH_REST, full, q[1]);
    same_files(p[1], q[1]);
    snprintf(d3, sizeof d3, "%s/from-sharded-3", tmp);
    snprintf(q[2], sizeof q[2], "%s/from-full-3.safetensors", tmp);
    run_ok(3, out, "3-rank resume of the sharded checkpoint",
           "train --resume %s --steps 40 --save %s --state-dict sharded " SH_REST, sh, d3);
    run_ok(3, out, "3-rank resume of the full checkpoint", "train --resume %s --steps 40 --save %s " SH_REST, full, q[2]);
    same_files(d3, q[2]);
    snprintf(p[3], sizeof p[3], "%s/optim.safetensors.index.json", d3);
    snprintf(q[3], sizeof q[3], "%s/from-full-3.optim.safetensors", tmp);
    same_files(p[3], q[3]);

    /* 2 ranks resume into the same directory: bit for bit a straight 40-step run. */
    snprintf(q[1], sizeof q[1], "%s/straight.safetensors", tmp);
    run_ok(2, out, "2-rank resume into the same directory",
           "train --resume %s --steps 40 --save %s --state-dict sharded " SH_REST, sh, sh);
    run_ok(2, out, "straight 2-rank run", "train " SH_HYPER " --steps 40 --save %s%s", q[1], "");
    same_files(sh, q[1]);
    const char *layout40[] = {"model.safetensors.index.json", "optim.safetensors.index.json",
                              "model-step000040-00000-of-00002.safetensors", "model-step000040-00001-of-00002.safetensors",
                              "optim-step000040-00000-of-00002.safetensors", "optim-step000040-00001-of-00002.safetensors"};
    dir_has_exactly(sh, layout40, 6);
    /* Rank counts change the order of the gradient sums, no more: 1 process
     * and 3 ranks end within 1e-6 of 2 ranks (measured: 4e-8). */
    near_files(p[1], sh, 1e-6);
    near_files(d3, sh, 1e-6);
}

/* --save-every into a sharded directory, eval and inspect of it, a re-save
 * at the same step with another world size, and a missing shard. */
TEST(cli_sharded_eval_inspect_and_errors)
{
    static char out[OUT_MAX], ev[OUT_MAX];
    const char *tmp = ct_test_tmpdir();
    char dir[1024], full[1024], acc_sh[256], acc_full[256], path[1200];
    snprintf(dir, sizeof dir, "%s/ck", tmp);
    snprintf(full, sizeof full, "%s/full.safetensors", tmp);
    run_ok(2, out, "sharded run", "train " SMALL " --hidden 32 --steps 6 --save-every 3 --log-every 0 --save %s "
           "--state-dict sharded%s", dir, "");
    run_ok(2, out, "full run", "train " SMALL " --hidden 32 --steps 6 --log-every 0 --save %s%s", full, "");
    const char *layout[] = {"model.safetensors.index.json", "optim.safetensors.index.json",
                            "model-step000006-00000-of-00002.safetensors", "model-step000006-00001-of-00002.safetensors",
                            "optim-step000006-00000-of-00002.safetensors", "optim-step000006-00001-of-00002.safetensors"};
    dir_has_exactly(dir, layout, 6); /* step 3's files are gone */

    run_ok(0, ev, "eval of the directory", "eval --checkpoint %s --limit-test 1000%s", dir, "");
    line_after(ev, "test: ", acc_sh, sizeof acc_sh);
    ASSERT_STR_CONTAINS(ev, ", step 6");
    run_ok(0, out, "eval of the full file", "eval --checkpoint %s --limit-test 1000%s", full, "");
    line_after(out, "test: ", acc_full, sizeof acc_full);
    if (strcmp(acc_sh, acc_full)) ct_test_fail(__FILE__, __LINE__, "sharded: '%s', full: '%s'", acc_sh, acc_full);
    /* and under mpirun, the test set split over the ranks */
    run_ok(2, ev, "eval of the directory on 2 ranks", "eval --checkpoint %s --limit-test 1000%s", dir, "");
    line_after(ev, "test: ", acc_sh, sizeof acc_sh);
    ASSERT(!strcmp(acc_sh, acc_full));

    run_ok(0, out, "inspect", "inspect %s%s", dir, "");
    ASSERT_STR_CONTAINS(out, "4 tensors");
    ASSERT_STR_CONTAINS(out, "[32, 784]");
    ASSERT_STR_CONTAINS(out, "total: 25450 parameters, 101800 bytes");
    ASSERT_STR_CONTAINS(out, "total_size = 101800");
    ASSERT_STR_CONTAINS(out, "ctrain.hidden = 32");
    ASSERT_STR_CONTAINS(out, "ctrain.step = 6");
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    run_ok(0, out, "inspect of the model index", "inspect %s%s", path, "");
    ASSERT_STR_CONTAINS(out, "total: 25450 parameters, 101800 bytes");
    snprintf(path, sizeof path, "%s/optim.safetensors.index.json", dir);
    run_ok(0, out, "inspect of the optimizer index", "inspect %s%s", path, "");
    ASSERT_STR_CONTAINS(out, "0.weight.exp_avg_sq");
    ASSERT_STR_CONTAINS(out, "ctrain.position = 6");
    /* The optimizer index is not a model: the message says so. */
    ASSERT_EQ(RUN(out, "eval --checkpoint %s", path), 1);
    ASSERT_STR_CONTAINS(out, "optimizer file");

    /* Saved again at the same step by 3 ranks: a new generation, and only it remains. */
    run_ok(3, out, "re-save at the same step", "train --resume %s --steps 6 --save %s --state-dict sharded "
           "--threads 1 --limit-train 2000 --limit-test 1000 --log-every 0", dir, dir);
    ASSERT_STR_CONTAINS(out, "nothing to train");
    const char *layout3[] = {"model.safetensors.index.json", "optim.safetensors.index.json",
                             "model-step000006.1-00000-of-00003.safetensors", "model-step000006.1-00001-of-00003.safetensors",
                             "model-step000006.1-00002-of-00003.safetensors", "optim-step000006.1-00000-of-00003.safetensors",
                             "optim-step000006.1-00001-of-00003.safetensors", "optim-step000006.1-00002-of-00003.safetensors"};
    dir_has_exactly(dir, layout3, 8);
    same_files(dir, full);

    /* Indexes of two saves (a crash between rank 0's two index writes) are refused by --resume. */
    snprintf(path, sizeof path, "%s/optim.safetensors.index.json", dir);
    FILE *f = fopen(path, "r");
    ASSERT(f);
    size_t n = fread(ev, 1, OUT_MAX - 1, f);
    ev[n] = 0;
    fclose(f);
    char *gen = strstr(ev, "\"step000006.1\"");
    ASSERT(gen);
    memmove(gen + 11, gen + 13, strlen(gen + 13) + 1); /* "step000006.1" -> "step000006" */
    f = fopen(path, "w");
    ASSERT(f);
    fputs(ev, f);
    fclose(f);
    ASSERT_EQ(RUN(out, "train --resume %s --steps 8 --limit-train 2000", dir), 1);
    ASSERT_STR_CONTAINS(out, "are from different saves (put together by hand?)");
    ASSERT_EQ(RUN(out, "eval --checkpoint %s --limit-test 100", dir), 0); /* the model alone is sound */

    /* A missing shard: every command names it and says what to do. */
    snprintf(path, sizeof path, "%s/model-step000006.1-00001-of-00003.safetensors", dir);
    ASSERT_EQ(unlink(path), 0);
    const char *cmds[] = {"eval --checkpoint %s", "inspect %s", "train --resume %s --steps 8 --limit-train 2000",
                          "train --init %s --steps 8 --limit-train 2000"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        ASSERT_EQ(RUN(out, cmds[i], dir), 1);
        ASSERT_STR_CONTAINS(out, "model-step000006.1-00001-of-00003.safetensors is missing");
        ASSERT_STR_CONTAINS(out, "the checkpoint is incomplete");
        ASSERT_EQ(count_lines(out), 1);
    }
    /* The wrong kind of --save path is refused before training. */
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --save %s", dir), 2);
    ASSERT_STR_CONTAINS(out, "is a directory; save a sharded checkpoint into it with --state-dict sharded");
    ASSERT_EQ(RUN(out, "train " SMALL " --steps 2 --save %s --state-dict sharded", full), 2);
    ASSERT_STR_CONTAINS(out, "--state-dict sharded writes a directory, but");
}

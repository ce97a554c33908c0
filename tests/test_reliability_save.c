/*
 * Reliability, third pass (issue 24): a failed save never costs a
 * checkpoint, `inspect --verify` passes exactly when a load would, nothing
 * hangs on odd files, no staged file outlives a failed save.  Each
 * numbered case of the issue has a test here that failed before its fix.
 */
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_util.h"

#undef RUN
#define RUN(out, ...) run_cmd(NULL, out, __VA_ARGS__)

#define TINY "--model mlp --hidden 16 --data-dir %s --threads 1 --batch 32 --log-every 0"


static int exists(const char *path) { return access(path, F_OK) == 0; }

/* A shell command that must succeed. */
static void sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void sh(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    if (system(cmd) != 0) ct_test_fail(__FILE__, __LINE__, "'%s' failed", cmd);
}

/* Issue 24, case 1: a failed save left an empty step directory; the next
 * run pruned by step number, kept it, and deleted the valid checkpoints,
 * so --resume latest started from step 0.  Now only members that verify
 * count, and nothing is pruned before the new one verifies. */
TEST(rel3_failed_save_never_costs_a_checkpoint)
{
    static char out[OUT_MAX];
    char m[1400], member[700];
    const char *ck = path_in("kl");
    snprintf(m, sizeof m, "mpirun -np 2 $CTRAIN train " TINY " --strategy fsdp --save %s --state-dict sharded "
             "--keep-last 1 --resume latest", tiny_data(), ck);
    ASSERT_EQ(RUN(out, "%s --steps 2", m), 0);
    snprintf(member, sizeof member, "%s-step00000004", ck); /* what a failed save at step 4 leaves */
    ASSERT_EQ(mkdir(member, 0777), 0);
    ASSERT_EQ(RUN(out, "%s --steps 3", m), 0);
    ASSERT_STR_CONTAINS(out, "continuing from");
    ASSERT(!exists(member)); /* unfinished: removed, never counted */
    snprintf(member, sizeof member, "%s-step00000003", ck);
    ASSERT(exists(member));
    ASSERT_EQ(RUN(out, "inspect --verify %s", member), 0);
    ASSERT_EQ(RUN(out, "%s --steps 5", m), 0);
    ASSERT_STR_CONTAINS(out, "continuing from");
    ASSERT_STR_CONTAINS(out, "steps 3..5");
    /* A damaged member (complete, but its optimizer index lists a missing
     * shard) is not counted and not removed: latest starts a new run. */
    char side[800];
    snprintf(side, sizeof side, "%s-step00000005/optim.safetensors.index.json", ck);
    FILE *f = fopen(side, "w");
    ASSERT(f && fputs("{\"metadata\": {}, \"weight_map\": {\"step\": \"nowhere.safetensors\"}}", f) >= 0);
    ASSERT_EQ(fclose(f), 0);
    ASSERT_EQ(RUN(out, "%s --steps 2", m), 0);
    ASSERT_STR_CONTAINS(out, "no checkpoint of");
    snprintf(member, sizeof member, "%s-step00000005", ck);
    ASSERT(exists(member));
}

/* Writes dst, a copy of the local checkpoint directory src whose model
 * pieces named from become to (to "": dropped; from "": piece to of one
 * element added), all model tensors in one shard; the optimizer files are
 * copied as they are, so only the model's pieces are damaged. */
static void remake(const char *src, const char *dst, const char *from, const char *to)
{
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(src, &st));
    sh("rm -rf %s && mkdir %s && cp %s/optim* %s/", dst, dst, src, dst);
    int n = ct_safetensors_count(st), k = 0;
    const char *names[64], *files[64], *mk[64], *mv[64];
    ct_tensor *ts[64];
    ASSERT(n < 63 && ct_safetensors_meta_count(st) < 64);
    ct_tensor *extra = ct_tensor_create1(1, CT_MEM_OTHER);
    for (int i = 0; i < n; i++) {
        const char *name = ct_safetensors_name(st, i);
        if (*from && !strcmp(name, from)) {
            if (!*to) continue;
            name = to;
        }
        names[k] = name;
        ts[k++] = ct_safetensors_tensor(st, i);
    }
    if (!*from) {
        names[k] = to;
        ts[k++] = extra;
    }
    for (int i = 0; i < k; i++) files[i] = "model-x.safetensors";
    int nm = ct_safetensors_meta_count(st);
    for (int i = 0; i < nm; i++) {
        mk[i] = ct_safetensors_meta_key(st, i);
        mv[i] = ct_safetensors_meta_value(st, i);
    }
    char p[1400];
    snprintf(p, sizeof p, "%s/model-x.safetensors", dst);
    if (k) ASSERT_OK(ct_safetensors_save(p, names, ts, k, NULL, NULL, 0));
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dst);
    ASSERT_OK(ct_safetensors_save_index(p, names, files, k, mk, mv, nm));
    ct_tensor_release(extra);
    ct_safetensors_destroy(st);
}

/* Issue 24, case 2: `inspect --verify` said "intact" for local pieces with
 * a gap, an overlap, a missing piece, a piece past the end, offsets -5 and
 * 2^64-1, and an index with an empty weight_map; --resume rejected each.
 * Now verify is the load (cli_ckpt_verify): both reject every one, and the
 * message no longer reads "holds mlp [16], not the mlp [16]". */
TEST(rel3_verify_passes_exactly_when_resume_would)
{
    static char out[OUT_MAX];
    const char *ck = path_in("local"), *bad = path_in("bad");
    ASSERT_EQ(RUN(out, "mpirun -np 2 $CTRAIN train " TINY " --steps 2 --strategy fsdp --save %s --state-dict local",
                  tiny_data(), ck), 0);
    ASSERT_EQ(RUN(out, "inspect --verify %s", ck), 0);
    ASSERT_STR_CONTAINS(out, "loads");
    static const char *const cases[][2] = {
        {"0.weight@6365", "0.weight@6366"},                 /* a gap */
        {"0.weight@6365", "0.weight@6364"},                 /* an overlap */
        {"0.weight@6365", ""},                              /* a missing piece */
        {"", "0.weight@12730"},                             /* a piece past the end */
        {"0.weight@6365", "0.weight@-5"},                   /* a negative offset */
        {"0.weight@6365", "0.weight@18446744073709551615"}, /* 2^64 - 1 */
        {"", "0.weight@00"},                                /* offset 0 twice, spelled two ways */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        remake(ck, bad, cases[i][0], cases[i][1]);
        int v = RUN(out, "inspect --verify %s", bad);
        if (v != 1) ct_test_fail(__FILE__, __LINE__, "case %zu: verify exit %d:\n%s", i, v, out);
        ASSERT_STR_CONTAINS(out, "does not load");
        int r = RUN(out, "train " TINY " --steps 3 --resume %s", tiny_data(), bad);
        if (r != 1) ct_test_fail(__FILE__, __LINE__, "case %zu: resume exit %d:\n%s", i, r, out);
        ASSERT(!strstr(out, "not the mlp"));
    }
    /* An index with an empty weight_map: no tensor, so nothing to load. */
    char p[1400];
    sh("rm -rf %s && cp -r %s %s", bad, ck, bad);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", bad);
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(ck, &st));
    const char *mk[64], *mv[64];
    int nm = ct_safetensors_meta_count(st);
    for (int i = 0; i < nm; i++) {
        mk[i] = ct_safetensors_meta_key(st, i);
        mv[i] = ct_safetensors_meta_value(st, i);
    }
    ASSERT_OK(ct_safetensors_save_index(p, NULL, NULL, 0, mk, mv, nm));
    ct_safetensors_destroy(st);
    ASSERT_EQ(RUN(out, "inspect --verify %s", bad), 1);
    ASSERT_STR_CONTAINS(out, "has no tensor");
    ASSERT_EQ(RUN(out, "train " TINY " --steps 3 --resume %s", tiny_data(), bad), 1);
    ASSERT_STR_CONTAINS(out, "has no tensor");
}

/* Issue 24, case 4: a FIFO in a checkpoint directory hung inspect and
 * --resume forever.  Now every file a checkpoint names is opened without
 * blocking and must be a regular file: a FIFO in the place of a shard, an
 * index, the optimizer state or the commit journal is an error naming it. */
TEST(rel3_fifo_in_a_checkpoint_never_hangs)
{
    static char out[OUT_MAX];
    const char *ck = path_in("ck"), *bad = path_in("bad"), *full = path_in("full.safetensors");
    ASSERT_EQ(RUN(out, "train " TINY " --steps 2 --save %s --state-dict sharded", tiny_data(), ck), 0);
    ASSERT_EQ(RUN(out, "train " TINY " --steps 2 --save %s", tiny_data(), full), 0);
    static const char *const parts[] = {"model-step000002-00000-of-00001.safetensors", "model.safetensors.index.json",
                                        "optim.safetensors.index.json", "model.safetensors.index.json.commit"};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        char p[1400];
        sh("rm -rf %s && cp -r %s %s && rm -f %s/%s", bad, ck, bad, bad, parts[i]);
        snprintf(p, sizeof p, "%s/%s", bad, parts[i]);
        ASSERT_EQ(mkfifo(p, 0600), 0);
        int rc = RUN(out, "inspect --verify %s", bad);
        if (rc != 1) ct_test_fail(__FILE__, __LINE__, "FIFO %s: inspect exit %d:\n%s", parts[i], rc, out);
        ASSERT_STR_CONTAINS(out, "is not a regular file (a FIFO)");
        rc = RUN(out, "train " TINY " --steps 3 --resume %s", tiny_data(), bad);
        if (rc != 1) ct_test_fail(__FILE__, __LINE__, "FIFO %s: resume exit %d:\n%s", parts[i], rc, out);
        ASSERT_STR_CONTAINS(out, "is not a regular file (a FIFO)");
    }
    /* The optimizer file of a full checkpoint, and one reached through a symlink. */
    char side[1400], link[1400];
    snprintf(side, sizeof side, "%.*s.optim.safetensors", (int)strlen(full) - 12, full);
    ASSERT_EQ(unlink(side), 0);
    ASSERT_EQ(mkfifo(side, 0600), 0);
    ASSERT_EQ(RUN(out, "train " TINY " --steps 3 --resume %s", tiny_data(), full), 1);
    ASSERT_STR_CONTAINS(out, "is not a regular file (a FIFO)");
    ASSERT_EQ(RUN(out, "inspect --verify %s", full), 1);
    ASSERT_STR_CONTAINS(out, "is not a regular file (a FIFO)");
    snprintf(link, sizeof link, "%s/link.safetensors", ct_test_tmpdir());
    ASSERT_EQ(symlink(side, link), 0);
    ASSERT_EQ(RUN(out, "inspect %s", link), 1);
}

/* Issue 24, case 7: a save exactly at the end of an epoch recorded the next
 * epoch and also the old epoch's last position, so the resume skipped an
 * epoch and was not bit-exact.  1000 samples in batches of 48: 20 steps an
 * epoch; saved at step 20, resumed to 40, equal to 40 straight steps (and
 * the sidecar says epoch 1, batch 0). */
TEST(rel3_resume_at_an_epoch_boundary_is_bit_exact)
{
    static char out[OUT_MAX];
    const char *a = path_in("e20.safetensors"), *b = path_in("e40r.safetensors"), *c = path_in("e40.safetensors");
    ASSERT_EQ(RUN(out, "train --model mlp --hidden 16 --limit-train 1000 --batch 48 --threads 1 --log-every 0 "
                  "--limit-test 64 --steps 20 --save %s", a), 0);
    ASSERT_STR_CONTAINS(out, "epoch 1.00");
    char side[700];
    snprintf(side, sizeof side, "%.*s.optim.safetensors", (int)strlen(a) - 12, a);
    ASSERT_EQ(RUN(out, "inspect %s", side), 0);
    ASSERT_STR_CONTAINS(out, "ctrain.epoch = 1\n");
    ASSERT_STR_CONTAINS(out, "ctrain.position = 0\n");
    ASSERT_EQ(RUN(out, "train --resume %s --steps 40 --save %s --threads 1 --log-every 0 --limit-train 1000 "
                  "--limit-test 64", a, b), 0);
    ASSERT_STR_CONTAINS(out, "steps 20..40");
    ASSERT_EQ(RUN(out, "train --model mlp --hidden 16 --limit-train 1000 --batch 48 --threads 1 --log-every 0 "
                  "--limit-test 64 --steps 40 --save %s", c), 0);
    same_files(b, c);
    char sb[700], sc[700];
    snprintf(sb, sizeof sb, "%.*s.optim.safetensors", (int)strlen(b) - 12, b);
    snprintf(sc, sizeof sc, "%.*s.optim.safetensors", (int)strlen(c) - 12, c);
    same_files(sb, sc);
}

/* Issue 24, case 6: `sample --temperature 1e9` said "must be 0 or more". */
TEST(rel3_sample_temperature_names_its_range)
{
    static char out[OUT_MAX];
    ASSERT_EQ(RUN(out, "sample --checkpoint nowhere.safetensors --temperature 1e9"), 2);
    ASSERT_STR_CONTAINS(out, "between 0 and 1e6");
    ASSERT_EQ(RUN(out, "sample --checkpoint nowhere.safetensors --temperature -1"), 2);
    ASSERT_STR_CONTAINS(out, "between 0 and 1e6");
}

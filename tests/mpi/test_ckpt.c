/*
 * The library's checkpoints across ranks (include/ctrain/checkpoint.h):
 * every kind saved under one strategy loads under others to the same
 * state, with its metadata and position; a series keeps its newest
 * members; a load reads only the element ranges a rank keeps (counted by
 * the reader); a sharded save's shares are balanced by bytes.
 */
#include <stdlib.h>
#include <sys/stat.h>

#include "train_util.h"

#define ROWS 24

/* A directory every rank sees: rank 0's scratch directory. */
static void shared_dir(char *buf, size_t n)
{
    ct_group *g = ct_group_world();
    memset(buf, 0, n);
    if (ct_group_rank(g) == 0) snprintf(buf, n, "%s", ct_test_tmpdir());
    ASSERT_OK(ct_group_broadcast(g, buf, (int64_t)n, CT_U8, 0, NULL));
}

/* An fsdp run of two AdamW steps (units of the 8-child model: a rank keeps pieces). */
static ct_strategy *trained(ct_module **m)
{
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *s;
    *m = mlp8(5, 200);
    ASSERT_OK(ct_strategy_create("fsdp", *m, &oo, ct_group_world(), "wrap_min_params=300", &s));
    for (int step = 0; step < 2; step++) step_on_data_rank(s, step, ROWS, 0, NULL, NULL);
    return s;
}

static ct_strategy *fresh(const char *kind, ct_module **m, ct_group *g)
{
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *s;
    *m = mlp8(77, 200);
    const char *opts = !strcmp(kind, "fsdp") ? "wrap_min_params=1000" : NULL; /* other units than the saver's */
    ASSERT_OK(ct_strategy_create(kind, *m, &oo, g, opts, &s));
    return s;
}

/* On rank 0 (or alone): a's state equals b's exactly. */
static void assert_same_state(ct_strategy *a, ct_strategy *b, int check)
{
    for (int optim = 0; optim < 2; optim++) {
        ct_state x, y;
        ASSERT_OK(optim ? ct_strategy_optim_state(a, &x) : ct_strategy_model_state(a, &x));
        ASSERT_OK(optim ? ct_strategy_optim_state(b, &y) : ct_strategy_model_state(b, &y));
        if (check) {
            ASSERT_EQ(x.n, y.n);
            ASSERT(state_rel_l2(&x, &y) == 0);
        }
        ct_state_fini(&x);
        ct_state_fini(&y);
    }
}

/* s saved as kind into dir (path gets where), with metadata in both files
 * and the optimizer's, at step 2 of epoch 1, 7 batches in. */
static void save_kind(ct_strategy *s, const char *dir, int kind, char *path, size_t n)
{
    static const char *const names[3] = {"full.safetensors", "sharded", "local"};
    snprintf(path, n, "%s/%s", dir, names[kind]);
    ct_meta meta = {0}, om = {0};
    ASSERT_OK(ct_meta_set(&meta, "mine.note", "kind %d", kind));
    ASSERT_OK(ct_meta_set(&om, "mine.lr", "0.01"));
    ct_ckpt_position pos = {2, 1, 7};
    ct_ckpt_opts co = {(ct_ckpt_kind)kind, &om, 0};
    ASSERT_OK(ct_checkpoint_save(s, path, &meta, &pos, &co));
    ct_meta_fini(&meta);
    ct_meta_fini(&om);
}

TEST(ckpt_every_kind_loads_under_other_strategies_with_its_position)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    char dir[1024], path[1100];
    shared_dir(dir, sizeof dir);
    ct_module *m;
    ct_strategy *s = trained(&m);
    for (int kind = CT_CKPT_FULL; kind <= CT_CKPT_LOCAL; kind++) {
        save_kind(s, dir, kind, path, sizeof path);

        ct_ckpt_info info;
        ASSERT_OK(ct_checkpoint_info(g, path, 1, &info));
        ASSERT_EQ(info.has_optim, 1);
        ASSERT_EQ(info.pos.step, 2);
        ASSERT_EQ(info.pos.epoch, 1);
        ASSERT_EQ(info.pos.position, 7);
        ASSERT(ct_meta_get(&info.meta, "mine.note") && ct_meta_get(&info.optim_meta, "mine.lr"));
        ASSERT(!ct_meta_get(&info.meta, "mine.lr")); /* the optimizer file's keys stay there */
        /* ct_meta holds all a file's metadata, its checksums too (a directory's index has none) */
        if (kind == CT_CKPT_FULL) ASSERT(ct_meta_get(&info.meta, "ctrain.crc32"));
        ct_ckpt_info_fini(&info);

        const char *kinds[] = {"fsdp", "zero2", "ddp"};
        for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
            ct_module *m2;
            ct_strategy *t = fresh(kinds[k], &m2, g);
            ASSERT_OK(ct_checkpoint_load(t, path, 1));
            assert_same_state(s, t, rank == 0);
            ct_strategy_destroy(t);
            ct_module_destroy(m2);
        }
        /* and one process alone, with no group: every rank by itself */
        ct_module *m3;
        ct_strategy *one = fresh("none", &m3, NULL);
        ASSERT_OK(ct_checkpoint_load(one, path, 1));
        ct_state a, b;
        ASSERT_OK(ct_strategy_model_state(s, &a));
        ASSERT_OK(ct_strategy_model_state(one, &b));
        if (rank == 0) ASSERT(state_rel_l2(&a, &b) == 0);
        ct_state_fini(&a);
        ct_state_fini(&b);
        ct_strategy_destroy(one);
        ct_module_destroy(m3);
    }
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

TEST(ckpt_series_keeps_the_newest_and_finds_the_latest)
{
    ct_group *g = ct_group_world();
    char dir[1024], series[1100], member[1200], latest[1200];
    shared_dir(dir, sizeof dir);
    snprintf(series, sizeof series, "%s/run", dir);
    ct_module *m;
    ct_strategy *s = trained(&m);
    ASSERT_OK(ct_checkpoint_latest(g, series, latest, sizeof latest));
    ASSERT_EQ(latest[0], 0); /* none yet */
    for (int64_t step = 1; step <= 3; step++) {
        ct_ckpt_position pos = {step, 0, step};
        ct_ckpt_opts co = {CT_CKPT_SHARDED, NULL, 2};
        ASSERT_OK(ct_checkpoint_save(s, series, NULL, &pos, &co));
    }
    ASSERT_OK(ct_checkpoint_latest(g, series, latest, sizeof latest));
    ct_checkpoint_series_path(series, 3, member, sizeof member);
    ASSERT(!strcmp(latest, member));
    struct stat sb;
    ct_checkpoint_series_path(series, 1, member, sizeof member);
    ASSERT(stat(member, &sb) != 0); /* pruned: two kept */
    ct_checkpoint_series_path(series, 2, member, sizeof member);
    ASSERT(stat(member, &sb) == 0);
    ct_ckpt_verified v;
    ASSERT_OK(ct_checkpoint_verify(latest, 1, &v));
    ASSERT_EQ(v.has_optim, 1);
    /* misuse: the same clear error on every rank, no hang */
    ct_ckpt_opts bad = {(ct_ckpt_kind)9, NULL, 0};
    ASSERT_ERR(ct_checkpoint_save(s, series, NULL, NULL, &bad), CT_EINVAL, "CT_CKPT_FULL, SHARDED or LOCAL");
    snprintf(member, sizeof member, "%s/absent.safetensors", dir);
    ASSERT_ERR(ct_checkpoint_load(s, member, 1), CT_EIO, "absent.safetensors");
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* A load's source that counts: reads through the lazily opened file. */
static ct_status counted_read(void *ud, const ct_tensor *t, int64_t off, int64_t count, void *dst)
{
    size_t es = ct_dtype_size(t->dtype);
    return ct_safetensors_read(ud, t, (size_t)off * es, (size_t)count * es, dst);
}

/* Bytes this rank reads loading file (its model, or its optimizer state) into s. */
static int64_t bytes_loading(ct_strategy *s, const char *file, int optim, int64_t *total)
{
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_open(file, &st));
    int n = ct_safetensors_count(st);
    const char *names[64];
    ct_tensor *ts[64];
    ASSERT(n <= 64);
    *total = 0;
    for (int i = 0; i < n; i++) {
        names[i] = ct_safetensors_name(st, i);
        ts[i] = ct_safetensors_tensor(st, i);
        if (ts[i]->dtype == CT_F32) *total += (int64_t)ct_tensor_bytes(ts[i]);
        ASSERT(ts[i]->dtype != CT_F32 || ct_tensor_data(ts[i]) == NULL); /* nothing read yet */
    }
    ct_state_source src = {counted_read, st};
    ASSERT_OK(ct_strategy_load_source(s, names, ts, n, optim, &src));
    int64_t b = ct_safetensors_bytes_read(st);
    ct_safetensors_destroy(st);
    return b;
}

/* F32 bytes of what this rank keeps of s's model or optimizer state: its local pieces. */
static int64_t kept(ct_strategy *s, int optim)
{
    ct_state st;
    ASSERT_OK(ct_strategy_local_state(s, optim, &st));
    int64_t b = 0;
    for (int i = 0; i < st.n; i++)
        if (st.tensors[i]->dtype == CT_F32) b += (int64_t)ct_tensor_bytes(st.tensors[i]);
    ct_state_fini(&st);
    return b;
}

/* The sum over the ranks. */
static int64_t sum_of(int64_t v)
{
    ASSERT_OK(ct_group_allreduce(ct_group_world(), &v, 1, CT_I64, CT_OP_SUM, NULL));
    return v;
}

TEST(ckpt_load_reads_only_the_ranges_a_rank_keeps)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g);
    char dir[1024], path[1100], side[1200];
    shared_dir(dir, sizeof dir);
    ct_module *m;
    ct_strategy *s = trained(&m);
    for (int kind = CT_CKPT_FULL; kind <= CT_CKPT_LOCAL; kind++) {
        save_kind(s, dir, kind, path, sizeof path);
        ct_checkpoint_optim_path(path, side, sizeof side);
        int64_t total, mine;
        /* fsdp: exactly its pieces of the model and of the optimizer state, so
         * every element is read once over the ranks (about 1/world each) */
        ct_module *m2;
        ct_strategy *t = fresh("fsdp", &m2, g);
        for (int optim = 0; optim < 2; optim++) {
            mine = bytes_loading(t, optim ? side : path, optim, &total);
            ASSERT_EQ(mine, kept(t, optim));
            ASSERT_EQ(sum_of(mine), total);
            ASSERT(mine * world <= total + total / 2);
        }
        assert_same_state(s, t, ct_group_rank(g) == 0);
        ct_strategy_destroy(t);
        ct_module_destroy(m2);
        /* zero2: whole parameters (it replicates them), its own ranges of the optimizer state */
        t = fresh("zero2", &m2, g);
        ASSERT_EQ(bytes_loading(t, path, 0, &total), total);
        mine = bytes_loading(t, side, 1, &total);
        ASSERT_EQ(mine, kept(t, 1));
        ASSERT_EQ(sum_of(mine), total);
        assert_same_state(s, t, ct_group_rank(g) == 0);
        ct_strategy_destroy(t);
        ct_module_destroy(m2);
    }
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* A sharded save's shares differ by at most the largest tensor (greedy by
 * bytes): before, an FSDP unit's tensors went to the owner of their first
 * element, and rank 0 wrote two thirds of a gpt at 2 ranks. */
TEST(ckpt_sharded_shares_are_balanced_by_bytes)
{
    ct_group *g = ct_group_world();
    ct_model_config cfg = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&cfg, 4, 2, 32, 16, 64);
    ct_module *m;
    ASSERT_OK(ct_model_build(&cfg, 1, &m));
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("fsdp", m, &oo, g, "wrap_kinds=block", &s));
    for (int optim = 0; optim < 2; optim++) {
        ct_state mine;
        ASSERT_OK(ct_strategy_shard_state(s, optim, &mine));
        int64_t bytes = 0, largest = 0;
        for (int i = 0; i < mine.n; i++) bytes += (int64_t)ct_tensor_bytes(mine.tensors[i]);
        ct_state_fini(&mine);
        ASSERT_OK(optim ? ct_strategy_optim_state(s, &mine) : ct_strategy_model_state(s, &mine));
        for (int i = 0; i < mine.n; i++)
            if ((int64_t)ct_tensor_bytes(mine.tensors[i]) > largest) largest = (int64_t)ct_tensor_bytes(mine.tensors[i]);
        ct_state_fini(&mine);
        ASSERT_OK(ct_group_allreduce(g, &largest, 1, CT_I64, CT_OP_MAX, NULL));
        int64_t hi = bytes, lo = bytes;
        ASSERT_OK(ct_group_allreduce(g, &hi, 1, CT_I64, CT_OP_MAX, NULL));
        ASSERT_OK(ct_group_allreduce(g, &lo, 1, CT_I64, CT_OP_MIN, NULL));
        ASSERT(hi - lo <= largest + 64); /* the optimizer's I64 step rides with rank 0 */
    }
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

/* A FULL save streams: rank 0 gets one tensor at a time (gathered from
 * fsdp's shards, sent by pipe's later stages, read from offload's store)
 * and writes it where it belongs, so its peak over the save stays far below
 * the model (gathering the state first held the model and twice it again
 * in AdamW's state).  The file is the one a gathered state gives. */
static void full_save_streams(const char *kind, const char *opts)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    ct_model_config cfg = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&cfg, 4, 2, 64, 16, 64);
    ct_module *m;
    ASSERT_OK(ct_model_build(&cfg, 1, &m));
    int64_t model_bytes = ct_module_num_params(m) * 4;
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create(kind, m, &oo, g, opts, &s));
    char dir[1024], path[1100];
    shared_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/gpt-%s.safetensors", dir, kind);
    /* AdamW makes its moments when first asked (no step has run): a first
     * save does, so the one measured is the save alone */
    ASSERT_OK(ct_checkpoint_save(s, path, NULL, NULL, NULL));
    /* the peak rise of each category, summed: a bound on the rise of the total */
    size_t base[CT_MEM_NCAT];
    ct_mem_reset_peak();
    for (int c = 0; c < CT_MEM_NCAT; c++) base[c] = ct_mem_current((ct_mem_cat)c);
    ASSERT_OK(ct_checkpoint_save(s, path, NULL, NULL, NULL));
    int64_t peak = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) peak += (int64_t)(ct_mem_peak((ct_mem_cat)c) - base[c]);
    if (rank == 0 && !(peak < model_bytes / 4))
        ct_test_fail(__FILE__, __LINE__, "%s: a full save rose %lld bytes on rank 0 for a %lld-byte model", kind,
                     (long long)peak, (long long)model_bytes);
    /* what was written is the state, whole */
    ct_module *m2;
    ASSERT_OK(ct_model_build(&cfg, 99, &m2));
    ct_strategy *t;
    ASSERT_OK(ct_strategy_create("none", m2, &oo, NULL, NULL, &t));
    ASSERT_OK(ct_checkpoint_load(t, path, 1));
    assert_same_state(s, t, rank == 0);
    ct_strategy_destroy(t);
    ct_module_destroy(m2);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

TEST(ckpt_full_save_under_fsdp_never_holds_the_whole_model) { full_save_streams("fsdp", "wrap_kinds=block"); }
TEST(ckpt_full_save_under_pipe_never_holds_the_whole_model) { full_save_streams("pipe", "stages=2,chunks=2"); }
TEST(ckpt_full_save_under_offload_never_holds_the_whole_model) { full_save_streams("offload", "slices=3"); }

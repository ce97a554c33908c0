/*
 * FSDP offload's checkpoints straight from the store: a sharded or local
 * save and a load move one tensor (a gathered parameter, a piece) or one
 * chunk at a time between the store and the files, never a unit's shard;
 * what is saved is in-memory FSDP's save bit for bit, and a resume goes on
 * exactly as the run it was saved from.
 */
#include <stdio.h>
#include <string.h>

#include "train_util.h"

#define DIM 512
#define LAYERS 2

/* Every rank's scratch directory: rank 0's. */
static void shared_dir(char *buf, size_t n)
{
    memset(buf, 0, n);
    if (ct_group_rank(ct_group_world()) == 0) snprintf(buf, n, "%s", ct_test_tmpdir());
    ASSERT_OK(ct_group_broadcast(ct_group_world(), buf, (int64_t)n, CT_U8, 0, NULL));
}

/* A gpt whose blocks (the units) are large: width 512, 3.1M parameters a block. */
static ct_strategy *gpt_fsdp(const char *opts, uint64_t seed, ct_module **m)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, LAYERS, 4, DIM, GPT_CTX, GPT_VOCAB);
    ASSERT_OK(ct_model_build(&c, seed, m));
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("fsdp", *m, &oo, ct_group_world(), opts, &s));
    return s;
}

/* The summed rise of every category's peak since ct_mem_reset_peak over
 * base: a bound on the rise of the total. */
static void mark(size_t *base)
{
    ct_mem_reset_peak();
    for (int c = 0; c < CT_MEM_NCAT; c++) base[c] = ct_mem_current((ct_mem_cat)c);
}

static int64_t rise_since(const size_t *base)
{
    int64_t r = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) r += (int64_t)(ct_mem_peak((ct_mem_cat)c) - base[c]);
    ASSERT_OK(ct_group_allreduce(ct_group_world(), &r, 1, CT_I64, CT_OP_MAX, NULL)); /* the largest rank's */
    return r;
}

static void save(ct_strategy *s, const char *path, ct_ckpt_kind kind)
{
    ct_ckpt_position pos = {2, 0, 2};
    ct_ckpt_opts co = {kind, NULL, 0};
    ASSERT_OK(ct_checkpoint_save(s, path, NULL, &pos, &co));
}

/* Every tensor of the checkpoints a and b (any kind) equal bit for bit, with the same names. */
static void same_files(const char *a, const char *b)
{
    if (ct_group_rank(ct_group_world()) != 0) return;
    for (int optim = 0; optim < 2; optim++) {
        char pa[1200], pb[1200];
        if (optim) {
            ct_checkpoint_optim_path(a, pa, sizeof pa);
            ct_checkpoint_optim_path(b, pb, sizeof pb);
        } else {
            snprintf(pa, sizeof pa, "%s", a);
            snprintf(pb, sizeof pb, "%s", b);
        }
        ct_safetensors *x, *y;
        ASSERT_OK(ct_safetensors_load(pa, &x));
        ASSERT_OK(ct_safetensors_load(pb, &y));
        ASSERT_EQ(ct_safetensors_count(x), ct_safetensors_count(y));
        for (int i = 0; i < ct_safetensors_count(x); i++) {
            ct_tensor *t = ct_safetensors_tensor(x, i), *u = ct_safetensors_find(y, ct_safetensors_name(x, i));
            if (!u || ct_tensor_bytes(t) != ct_tensor_bytes(u) ||
                memcmp(ct_tensor_data(t), ct_tensor_data(u), ct_tensor_bytes(t)))
                ct_test_fail(__FILE__, __LINE__, "%s: tensor '%s' differs from in-memory fsdp's save", pa,
                             ct_safetensors_name(x, i));
        }
        ct_safetensors_destroy(x);
        ct_safetensors_destroy(y);
    }
}

static void same_state(ct_strategy *a, ct_strategy *b, const char *what)
{
    for (int optim = 0; optim < 2; optim++) {
        ct_state x, y;
        ASSERT_OK(optim ? ct_strategy_optim_state(a, &x) : ct_strategy_model_state(a, &x));
        ASSERT_OK(optim ? ct_strategy_optim_state(b, &y) : ct_strategy_model_state(b, &y));
        if (ct_group_rank(ct_group_world()) == 0 && !(x.n == y.n && state_rel_l2(&x, &y) == 0))
            ct_test_fail(__FILE__, __LINE__, "%s: the %s differs", what, optim ? "optimizer state" : "model");
        ct_state_fini(&x);
        ct_state_fini(&y);
    }
}

/* Under --offload all, a sharded and a local save, and a resume from each,
 * raise no rank's tracked memory by more than one tensor of the model (the
 * largest, 4 MiB, gathered whole for a sharded save) and 1 MiB: far below a
 * unit's shard parts (its masters, gradients and AdamW state: 4 x 12.6 MB
 * over the ranks, 25 MB at 2 ranks).  Pinning the parts for a save held
 * every unit's masters and state, and a copy of them.  The files equal
 * in-memory FSDP's, tensor for tensor, bit for bit; a resume trains on as
 * the run it was saved from. */
TEST(fsdp_offload_checkpoints_stream_from_the_store)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g);
    char dir[1024], path[1100], ref[1100];
    shared_dir(dir, sizeof dir);
    ct_module *om, *mm;
    ct_strategy *os = gpt_fsdp("wrap_kinds=block,offload=all", 3, &om);
    ct_strategy *ms = gpt_fsdp("wrap_kinds=block", 3, &mm);
    double loss;
    for (int step = 0; step < 2; step++) {
        gpt_step(os, step, 8, 0, &loss);
        gpt_step(ms, step, 8, 0, &loss);
        ASSERT_OK(ct_strategy_step(os));
        ASSERT_OK(ct_strategy_step(ms));
        ct_strategy_zero_grad(os);
        ct_strategy_zero_grad(ms);
    }
    const int64_t largest = (int64_t)4 * DIM * DIM * 4; /* the MLP's weights: 4 DIM x DIM floats */
    const int64_t unit = (int64_t)12 * DIM * DIM * 4 * 4 / world; /* a block's shard parts on a rank */
    const int64_t bound = largest + (1 << 20);
    ASSERT(bound * 2 < unit || world > 4);
    static const char *const names[2] = {"sharded", "local"};
    for (int kind = CT_CKPT_SHARDED; kind <= CT_CKPT_LOCAL; kind++) {
        snprintf(path, sizeof path, "%s/off-%s", dir, names[kind - 1]);
        snprintf(ref, sizeof ref, "%s/mem-%s", dir, names[kind - 1]);
        size_t base[CT_MEM_NCAT];
        mark(base);
        save(os, path, (ct_ckpt_kind)kind);
        int64_t r = rise_since(base);
        if (!(r < bound))
            ct_test_fail(__FILE__, __LINE__, "a %s save under offload=all rose %lld bytes on a rank (bound %lld, a "
                         "unit's shard parts %lld)", names[kind - 1], (long long)r, (long long)bound, (long long)unit);
        int64_t saved = r;
        save(ms, ref, (ct_ckpt_kind)kind);
        same_files(path, ref); /* local pieces too: the same cut */

        /* resume into a fresh offloaded run (other weights), then one step on both */
        ct_module *rm;
        ct_strategy *rs = gpt_fsdp("wrap_kinds=block,offload=all", 77, &rm);
        mark(base);
        ASSERT_OK(ct_checkpoint_load(rs, path, 1));
        r = rise_since(base);
        if (!(r < (2 << 20)))
            ct_test_fail(__FILE__, __LINE__, "a resume from a %s save under offload=all rose %lld bytes on a rank "
                         "(bound 2 MiB: a chunk and the file's headers)", names[kind - 1], (long long)r);
        if (ct_group_rank(g) == 0)
            printf("    %s: save rose %lld B, resume %lld B (bound %lld; a unit's shard parts %lld)\n", names[kind - 1],
                   (long long)saved, (long long)r, (long long)bound, (long long)unit);
        same_state(rs, os, "resumed, before a step");
        gpt_step(rs, 2 + kind, 8, 0, &loss);
        gpt_step(os, 2 + kind, 8, 0, &loss);
        gpt_step(ms, 2 + kind, 8, 0, &loss);
        ASSERT_OK(ct_strategy_step(rs));
        ASSERT_OK(ct_strategy_step(os));
        ASSERT_OK(ct_strategy_step(ms));
        ct_strategy_zero_grad(rs);
        ct_strategy_zero_grad(os);
        ct_strategy_zero_grad(ms);
        same_state(rs, os, "resumed and stepped, vs the run it was saved from");
        same_state(os, ms, "offload=all vs in-memory fsdp");
        UNWRAP(rs);
        ct_module_destroy(rm);
    }
    UNWRAP(os);
    UNWRAP(ms);
    ct_module_destroy(om);
    ct_module_destroy(mm);
}

/*
 * FSDP under mpirun: every sharding strategy, with the model as one unit,
 * nested units, auto-wrapped units and ignored modules, must train as one
 * process on the whole batch does (weights and consolidated optimizer
 * state after several steps), with clipping, micro-batches, prefetching,
 * dropout and mixed precision; states load back at any world size; the
 * unsharded parameters exist only while their unit computes.
 */
#include "train_util.h"

#define H 16

typedef struct {
    const char *opts;      /* fsdp's */
    const char *ref_opts;  /* the one process's ("none") */
    ct_optim_kind ok;
    float clip;
    double norm_type;
    int steps, dropout;
    double tol;
} fsdp_case;

/* fsdp over g equals "none" on the whole batch. */
static void fsdp_vs_single_on(ct_group *g, const fsdp_case *c)
{
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 6 * world + 2;
    /* different seeds per rank: sync_module_states makes rank 0's the model */
    ct_module *dm = fsdp_nested(21 + (uint64_t)rank, c->dropout), *rm = fsdp_nested(21, c->dropout);
    ct_optim_opts oo = optim_for(c->ok);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create("fsdp", dm, &oo, g, c->opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, c->ref_opts, &rs));
    ASSERT(ct_strategy_partition(ds) != NULL);
    for (int step = 0; step < c->steps; step++) {
        ct_step_out o;
        step_on_slice(ds, step, n, rank, world, &o);
        step_on_slice(rs, step, n, 0, 1, &o);
        if (c->clip > 0) {
            float a, b;
            ASSERT_OK(ct_strategy_clip_grad_norm(ds, c->clip, c->norm_type, &a));
            ASSERT_OK(ct_strategy_clip_grad_norm(rs, c->clip, c->norm_type, &b));
            ASSERT_CLOSE(a, b, 1e-5, 1e-6);
        }
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs);
    }
    ct_state a, b;
    ASSERT_OK(ct_strategy_model_state(ds, &a)); /* collective: complete on rank 0 */
    ASSERT_OK(ct_strategy_model_state(rs, &b));
    if (rank == 0) {
        double d = state_rel_l2(&a, &b);
        if (!(d < c->tol)) ct_test_fail(__FILE__, __LINE__, "fsdp '%s': weights differ by %g", c->opts, d);
    }
    ct_state_fini(&a);
    ct_state_fini(&b);
    ASSERT_OK(ct_strategy_optim_state(ds, &a));
    ASSERT_OK(ct_strategy_optim_state(rs, &b));
    if (rank == 0) {
        double d = state_rel_l2(&a, &b);
        if (!(d < c->tol)) ct_test_fail(__FILE__, __LINE__, "fsdp '%s': optimizer state differs by %g", c->opts, d);
    }
    ct_state_fini(&a);
    ct_state_fini(&b);
    UNWRAP(ds); /* the parameters back whole: the same model on every rank */
    ct_strategy_destroy(rs);
    assert_params_close(dm, rm, c->tol * 10);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

static void fsdp_vs_single(const char *opts, ct_optim_kind ok, float clip, int steps)
{
    fsdp_case c = {opts, NULL, ok, clip, 2.0, steps, 0, 1e-5};
    fsdp_vs_single_on(ct_group_world(), &c);
}

TEST(fsdp_full_shard_equals_one_process)
{
    fsdp_vs_single(NULL, CT_OPT_ADAMW, 0, 4);                       /* the model is one unit */
    fsdp_vs_single("wrap_modules=2", CT_OPT_ADAMW, 0, 3);           /* nested */
    fsdp_vs_single("wrap_min_params=200", CT_OPT_ADAMW, 0, 4);      /* auto-wrapped by size */
    fsdp_vs_single("wrap_kinds=linear+layernorm", CT_OPT_SGD, 0, 3); /* by kind */
    fsdp_vs_single("wrap_min_params=200,ignored_modules=2.2", CT_OPT_ADAMW, 0, 3);
}

TEST(fsdp_each_sharding_strategy_equals_one_process)
{
    fsdp_vs_single("sharding=grad_op,wrap_min_params=200", CT_OPT_ADAMW, 0, 3);
    fsdp_vs_single("sharding=none,wrap_min_params=200", CT_OPT_ADAMW, 0, 3);
    fsdp_vs_single("sharding=hybrid,wrap_modules=2", CT_OPT_ADAMW, 0, 3); /* one node: full */
}

TEST(fsdp_prefetch_modes_equal_one_process)
{
    fsdp_vs_single("wrap_min_params=200,backward_prefetch=post,forward_prefetch=1", CT_OPT_ADAMW, 0, 3);
    fsdp_vs_single("wrap_kinds=linear,backward_prefetch=none", CT_OPT_ADAMW, 0, 3);
    fsdp_vs_single("wrap_kinds=linear,forward_prefetch=1,limit_all_gathers=1", CT_OPT_ADAMW, 0, 3);
}

TEST(fsdp_clip_micro_batches_and_dropout_equal_one_process)
{
    fsdp_vs_single("wrap_min_params=200", CT_OPT_ADAMW, 0.05f, 3);
    fsdp_case inf = {"wrap_kinds=linear", NULL, CT_OPT_ADAMW, 0.01f, INFINITY, 3, 0, 1e-5};
    fsdp_vs_single_on(ct_group_world(), &inf);
    fsdp_case accum = {"wrap_min_params=200,grad_accum=3", "grad_accum=3", CT_OPT_SGD, 0, 2.0, 3, 0, 1e-5};
    fsdp_vs_single_on(ct_group_world(), &accum);
    fsdp_case drop = {"wrap_min_params=200", NULL, CT_OPT_ADAMW, 0, 2.0, 3, 1, 1e-5};
    fsdp_vs_single_on(ct_group_world(), &drop);
}

/* bf16 compute copies gathered in bf16 are the casts one process makes of
 * the same master weights, so the runs agree to f32 rounding; bf16 on the
 * wire for the gradients costs about 3 significant digits. */
TEST(fsdp_mixed_precision_equals_one_process_with_the_same_casts)
{
    fsdp_case mp = {"wrap_min_params=200,param_dtype=bf16", "param_dtype=bf16", CT_OPT_ADAMW, 0, 2.0, 3, 0, 1e-4};
    fsdp_vs_single_on(ct_group_world(), &mp);
    fsdp_case mps = {"sharding=none,param_dtype=bf16", "param_dtype=bf16", CT_OPT_ADAMW, 0, 2.0, 3, 0, 1e-4};
    fsdp_vs_single_on(ct_group_world(), &mps);
    fsdp_case red = {"wrap_kinds=linear,param_dtype=bf16,reduce_dtype=bf16", "param_dtype=bf16", CT_OPT_SGD, 0, 2.0,
                     3, 0, 2e-2};
    fsdp_vs_single_on(ct_group_world(), &red);
}

/* HYBRID_SHARD across two fake nodes: shard inside each, allreduce across. */
TEST(fsdp_hybrid_across_fake_nodes_equals_one_process)
{
    ct_group *g = NULL;
    int saved = ct_comm_get_fake_nodes();
    ct_comm_set_fake_nodes(2);
    ct_status st = ct_group_split(ct_group_world(), 0, ct_group_rank(ct_group_world()), &g);
    ct_comm_set_fake_nodes(saved);
    ASSERT_OK(st);
    ASSERT_EQ(ct_group_num_nodes(g), 2);
    fsdp_case c = {"sharding=hybrid,wrap_min_params=200", NULL, CT_OPT_ADAMW, 0.05f, 2.0, 3, 0, 1e-5};
    if (ct_group_size(g) % 2 == 0) {
        fsdp_vs_single_on(g, &c);
    } else { /* nodes of 2 and 1 ranks cannot line their pieces up */
        ct_module *m = fsdp_nested(3, 0);
        ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
        ct_strategy *s = NULL;
        ASSERT_EQ(ct_strategy_create("fsdp", m, &oo, g, c.opts, &s), CT_EINVAL);
        ASSERT(strstr(ct_last_error(), "same number of ranks on every node") != NULL);
        ct_module_destroy(m);
    }
    ct_group_destroy(g);
}

/* no_sync accumulates unsharded gradients; the next synchronised backward
 * (or a manual reduce) reduces their sum. */
TEST(fsdp_no_sync_and_manual_reduce_equal_one_process)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 4 * world;
    for (int manual = 0; manual < 2; manual++) {
        ct_module *dm = fsdp_nested(8, 0), *rm = fsdp_nested(8, 0);
        ct_optim_opts oo = optim_for(CT_OPT_SGD);
        ct_strategy *ds, *rs;
        ASSERT_OK(ct_strategy_create("fsdp", dm, &oo, g, "wrap_min_params=200", &ds));
        ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
        for (int step = 0; step < 2; step++) {
            ct_step_out o;
            /* two half-batches, the first without synchronising */
            ct_strategy_set_no_sync(ds, 1);
            step_on_slice(ds, 2 * step, n, rank, world, &o);
            ct_strategy_set_no_sync(ds, manual);
            step_on_slice(ds, 2 * step + 1, n, rank, world, &o);
            ct_strategy_set_no_sync(ds, 0);
            if (manual) ASSERT_OK(ct_strategy_reduce(ds));
            step_on_slice(rs, 2 * step, n, 0, 1, &o);
            step_on_slice(rs, 2 * step + 1, n, 0, 1, &o);
            ASSERT_OK(ct_strategy_step(ds));
            ASSERT_OK(ct_strategy_step(rs));
            ct_strategy_zero_grad(ds);
            ct_strategy_zero_grad(rs);
        }
        UNWRAP(ds);
        ct_strategy_destroy(rs);
        assert_params_close(dm, rm, 1e-5);
        ct_module_destroy(dm);
        ct_module_destroy(rm);
    }
}

/* A full state (as one process has it) loads into fsdp at this world size
 * and training goes on as it would have; the state fsdp gives back, full
 * and sharded, is the one it was given. */
TEST(fsdp_state_round_trips_at_any_world_size)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 5 * world + 1;
    ct_module *rm = fsdp_nested(30, 0), *dm = fsdp_nested(99, 0);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *rs, *ds;
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    ct_step_out o;
    for (int step = 0; step < 2; step++) {
        step_on_slice(rs, step, n, 0, 1, &o);
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(rs);
    }
    ASSERT_OK(ct_strategy_create("fsdp", dm, &oo, g, "wrap_min_params=200,param_dtype=bf16", &ds));
    ct_state ms, os;
    ASSERT_OK(ct_strategy_model_state(rs, &ms));
    ASSERT_OK(ct_strategy_optim_state(rs, &os));
    ASSERT_OK(ct_strategy_load_state(ds, (const char *const *)ms.names, ms.tensors, ms.n, 0));
    ASSERT_OK(ct_strategy_load_state(ds, (const char *const *)os.names, os.tensors, os.n, 1));
    ct_state a;
    ASSERT_OK(ct_strategy_model_state(ds, &a));
    if (rank == 0) ASSERT(state_rel_l2(&a, &ms) == 0);
    ct_state_fini(&a);
    /* the shards cover every tensor once over the ranks */
    for (int optim = 0; optim < 2; optim++) {
        ASSERT_OK(ct_strategy_shard_state(ds, optim, &a));
        int64_t mine = a.n, total = 0;
        ASSERT_OK(ct_group_allreduce(g, &mine, 1, CT_I64, CT_OP_SUM, NULL));
        total = mine;
        ASSERT_EQ(total, optim ? os.n : ms.n);
        ct_state_fini(&a);
    }
    /* both go on alike (the reference with the same casts, loaded the same way) */
    ct_module *rm2 = fsdp_nested(77, 0);
    ct_strategy *rs2;
    ASSERT_OK(ct_strategy_create("none", rm2, &oo, NULL, "param_dtype=bf16", &rs2));
    ASSERT_OK(ct_strategy_load_state(rs2, (const char *const *)ms.names, ms.tensors, ms.n, 0));
    ASSERT_OK(ct_strategy_load_state(rs2, (const char *const *)os.names, os.tensors, os.n, 1));
    ct_state_fini(&ms);
    ct_state_fini(&os);
    for (int step = 2; step < 4; step++) {
        step_on_slice(ds, step, n, rank, world, &o);
        step_on_slice(rs2, step, n, 0, 1, &o);
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs2));
        ct_strategy_zero_grad(ds);
        ct_strategy_zero_grad(rs2);
    }
    ct_state b;
    ASSERT_OK(ct_strategy_model_state(ds, &a));
    ASSERT_OK(ct_strategy_model_state(rs2, &b));
    if (rank == 0) ASSERT(state_rel_l2(&a, &b) < 1e-4);
    ct_state_fini(&a);
    ct_state_fini(&b);
    ct_strategy_destroy(rs2);
    ct_strategy_destroy(rs);
    ct_strategy_destroy(ds);
    ct_module_destroy(rm);
    ct_module_destroy(rm2);
    ct_module_destroy(dm);
}

/* summon_full_params: every parameter readable whole; writeback keeps a
 * change, no writeback drops it; rank0_only with writeback is refused. */
TEST(fsdp_summon_full_params)
{
    ct_group *g = ct_group_world();
    ct_module *dm = fsdp_nested(4, 0), *rm = fsdp_nested(4, 0);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *ds;
    ASSERT_OK(ct_strategy_create("fsdp", dm, &oo, g, "wrap_min_params=200", &ds));
    ct_param *w = ct_module_find(dm, "2.0.weight");
    ASSERT(!ct_storage_has_data(w->data->storage) || ct_group_size(g) == 1); /* sharded */
    ASSERT_OK(ct_strategy_summon_full_params(ds, 0, 0));
    assert_params_close(dm, rm, 0);
    ct_f32(w->data)[3] = 42;
    ASSERT_OK(ct_strategy_release_full_params(ds));
    ASSERT_OK(ct_strategy_summon_full_params(ds, 1, 0));
    ASSERT_CLOSE(ct_f32(w->data)[3], ct_f32(ct_module_find(rm, "2.0.weight")->data)[3], 0, 0); /* dropped */
    ct_f32(w->data)[3] = 42;
    ASSERT_OK(ct_strategy_release_full_params(ds));
    ASSERT_EQ(ct_strategy_summon_full_params(ds, 1, 1), CT_EINVAL);
    ASSERT_OK(ct_strategy_summon_full_params(ds, 0, 1));
    if (ct_group_rank(g) == 0) ASSERT_CLOSE(ct_f32(w->data)[3], 42, 0, 0); /* kept */
    ASSERT_OK(ct_strategy_release_full_params(ds));
    UNWRAP(ds);
    ASSERT_CLOSE(ct_f32(w->data)[3], 42, 0, 0);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

/* FULL_SHARD's resident memory: pieces (params, grads, AdamW state: 16/N
 * bytes per parameter) plus what is unsharded at once, at most two units'
 * parameters and gradients and the root's; after a step nothing unsharded
 * is left. */
TEST(fsdp_memory_is_pieces_plus_two_units)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g);
    ct_module *m = ct_sequential_create();
    const int D = 64, L = 6;
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, D, 1)));
    for (int i = 0; i < L; i++) {
        ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(D, D, 1)));
        ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    }
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(D, NCLS, 1)));
    ct_module_init_params(m, 1);
    int64_t P = ct_module_num_params(m), U = (int64_t)D * D + D, R = (int64_t)IN * D + D + (int64_t)D * NCLS + NCLS;
    for (int limit = 0; limit < 2; limit++) {
        ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
        ct_strategy *s;
        char opts[128];
        snprintf(opts, sizeof opts, "wrap_min_params=%lld,forward_prefetch=1,limit_all_gathers=%d", (long long)U, limit);
        ASSERT_OK(ct_strategy_create("fsdp", m, &oo, g, opts, &s));
        ct_step_out o;
        step_on_slice(s, 0, 4 * world, ct_group_rank(g), world, &o); /* the optimizer state exists after a step */
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
        ct_mem_reset_peak();
        for (int step = 1; step < 3; step++) {
            step_on_slice(s, step, 4 * world, ct_group_rank(g), world, &o);
            ASSERT_OK(ct_strategy_step(s));
            ct_strategy_zero_grad(s);
        }
        ct_mem_report r;
        ct_mem_report_get(&r);
        double pieces = 16.0 * (double)P / world + 16.0 * 64 * 10; /* and padding */
        double bound = pieces + 2 * 8.0 * (double)U + 8.0 * (double)R + 4096;
        if (!((double)r.peak_resident <= bound))
            ct_test_fail(__FILE__, __LINE__, "peak resident %zu > bound %.0f (P %lld, world %d, limit %d)",
                         r.peak_resident, bound, (long long)P, world, limit);
        /* after the step only the pieces remain */
        double params = 4.0 * (double)P / world + 4.0 * 64 * 10 + 4096;
        if (!((double)r.current[CT_MEM_PARAM] <= params))
            ct_test_fail(__FILE__, __LINE__, "%zu parameter bytes after the step, pieces are %.0f",
                         r.current[CT_MEM_PARAM], params);
        if (limit && world > 1) /* at most two units other than the root unsharded: params peak */
            ASSERT((double)r.peak[CT_MEM_PARAM] <= params + 2 * 4.0 * (double)U + 4.0 * (double)R);
        UNWRAP(s); /* the model whole again, for the next wrap */
    }
    ct_module_destroy(m);
}

/* A module called twice per step: as a unit, or holding one, its
 * gradients from both calls add up before the piece is stepped; a
 * parameter unfrozen after wrapping is refused. */
TEST(fsdp_module_called_twice_and_unfrozen_parameter)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    const char *opts[] = {"wrap_kinds=linear", "wrap_kinds=twice", "wrap_kinds=twice+linear"};
    for (int k = 0; k < 3; k++) {
        ct_module *ms[2];
        ct_strategy *ss[2];
        ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
        for (int j = 0; j < 2; j++) {
            ms[j] = ct_sequential_create();
            ASSERT_OK(ct_module_add(ms[j], NULL, ct_linear_create(IN, H, 1)));
            ASSERT_OK(ct_module_add(ms[j], NULL, ct_tanh_create()));
            ASSERT_OK(ct_module_add(ms[j], NULL, twice_create(ct_linear_create(H, H, 1))));
            ASSERT_OK(ct_module_add(ms[j], NULL, ct_linear_create(H, NCLS, 1)));
            ct_module_init_params(ms[j], 6);
            ASSERT_OK(ct_strategy_create(j ? "none" : "fsdp", ms[j], &oo, j ? NULL : g, j ? NULL : opts[k], &ss[j]));
        }
        for (int step = 0; step < 3; step++) {
            ct_step_out o;
            step_on_slice(ss[0], step, 3 * world + 1, rank, world, &o);
            step_on_slice(ss[1], step, 3 * world + 1, 0, 1, &o);
            for (int j = 0; j < 2; j++) {
                ASSERT_OK(ct_strategy_step(ss[j]));
                ct_strategy_zero_grad(ss[j]);
            }
        }
        for (int j = 0; j < 2; j++) UNWRAP(ss[j]);
        assert_params_close(ms[0], ms[1], 1e-5);
        for (int j = 0; j < 2; j++) ct_module_destroy(ms[j]);
    }
    ct_module *m = fsdp_nested(5, 0);
    ct_module_find(m, "2.0.weight")->requires_grad = 0;
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("fsdp", m, &oo, g, "wrap_min_params=200", &s));
    ct_module_find(m, "2.0.weight")->requires_grad = 1;
    ct_tensor *x, *y;
    global_batch(0, 4, &x, &y);
    ct_batch b = {x, y, 4 * world, 4 * rank};
    ct_fwd_ctx ctx = {.training = 1, .seed = 1};
    ASSERT_EQ(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL), CT_ESTATE);
    ASSERT(strstr(ct_last_error(), "'2.0.weight' was frozen when the model was wrapped") != NULL);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_module_find(m, "2.0.weight")->requires_grad = 0;
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

TEST(fsdp_rejects_bad_options)
{
    ct_module *m = fsdp_nested(1, 0);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s = NULL;
    ASSERT_EQ(ct_strategy_create("fsdp", m, &oo, NULL, "sharding=most", &s), CT_EINVAL);
    ASSERT(strstr(ct_last_error(), "full|grad_op|none|hybrid") != NULL);
    ASSERT_EQ(ct_strategy_create("fsdp", m, &oo, NULL, "wrap_modules=2+7", &s), CT_EINVAL);
    ASSERT(strstr(ct_last_error(), "no module '7'") != NULL);
    ASSERT_EQ(ct_strategy_create("fsdp", m, &oo, NULL, "wrap_kinds=conv2d", &s), CT_EINVAL);
    ASSERT(strstr(ct_last_error(), "linear") != NULL);
    ASSERT_EQ(ct_strategy_create("fsdp", m, &oo, NULL, "wrap_min_params=-3", &s), CT_EINVAL);
    ct_module_destroy(m);
}

/* After resharding, freed units are neither kept per size nor kept at all
 * when the cache is off: units of different sizes share the allocator's
 * cached blocks (a block serves requests down to half its size), so what
 * stays cached after a step is at most what one step held unsharded at
 * once; with the cache off, RSS falls back by about a unit's parameters
 * once the step is done. */
static size_t rss_mid;
static ct_status note_rss(ct_module *m, ct_hook_kind kind, void *ud)
{
    (void)m, (void)kind, (void)ud;
    ct_mem_report r;
    ct_mem_report_get(&r);
    rss_mid = r.rss;
    return CT_OK;
}

static ct_module *chain(const int64_t *w, int n)
{
    ct_module *m = ct_sequential_create();
    for (int i = 0; i + 1 < n; i++) {
        ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(w[i], w[i + 1], 1)));
        if (i + 2 < n) ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    }
    ct_module_init_params(m, 2);
    return m;
}

TEST(fsdp_freed_units_are_not_hoarded)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g), rank = ct_group_rank(g);
    if (world == 1) return;
    const int64_t varied[] = {IN, 640, 1024, 768, 896, NCLS}, big[] = {IN, 1024, 4096, 1024, NCLS};
    size_t limit = ct_mem_get_cache_limit();
    for (int cache = 1; cache >= 0; cache--) {
        ct_mem_set_cache_limit(cache ? (size_t)2048 << 20 : 0);
        ct_mem_trim();
        ct_module *m = cache ? chain(varied, 6) : chain(big, 5);
        ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create("fsdp", m, &oo, g, "wrap_kinds=linear", &s));
        /* Linear(1024,4096): after fsdp's own hook has gathered it */
        ct_hook *h = ct_module_add_hook(m->kids[2], CT_HOOK_PRE_BACKWARD, note_rss, NULL);
        ASSERT(h != NULL);
        ct_step_out o;
        for (int step = 0; step < 3; step++) {
            step_on_slice(s, step, 4 * world, rank, world, &o);
            ASSERT_OK(ct_strategy_step(s));
            ct_strategy_zero_grad(s);
        }
        ct_mem_report r;
        ct_mem_report_get(&r);
        /* what the steps held unsharded at once, above the pieces */
        double transient = (double)(r.peak[CT_MEM_PARAM] - r.current[CT_MEM_PARAM]) +
                           (double)(r.peak[CT_MEM_GRAD] - r.current[CT_MEM_GRAD]);
        /* measured per rank; agreed, so every rank fails (and none runs ahead into other collectives) */
        ct_status st = CT_OK;
        if (cache && !((double)r.cached <= 1.25 * transient + (1 << 20)))
            st = ct_error(CT_EINVAL, "%zu bytes cached after the steps, but at most %.0f were unsharded at once",
                          r.cached, transient);
        double unit = (4096.0 * 1024 + 4096) * 4; /* its parameters; its gradients' pages are only mapped then */
#ifndef __SANITIZE_ADDRESS__ /* AddressSanitizer's shadow memory and quarantine move RSS on their own */
        if (!cache && !((double)rss_mid - (double)r.rss >= 0.75 * unit))
            st = ct_error(CT_EINVAL, "RSS %zu in backward, %zu after the step: did not fall by a unit (%.0f bytes)",
                          rss_mid, r.rss, unit);
#else
        (void)unit;
#endif
        ASSERT_OK(ct_group_check(g, st));
        ct_hook_remove(h);
        ct_strategy_destroy(s);
        ct_module_destroy(m);
    }
    ct_mem_set_cache_limit(limit);
}

/* The allocator's cache through FSDP steps: its automatic bound is
 * CT_MEM_CACHE_UNITS times the largest unit's bytes (the flats hint it); the
 * steps free and reuse blocks of the same sizes, so it holds no more (past
 * the bound it may only hold what fits under the high-water mark, which
 * test_core_alloc checks), and the RSS stays within the live bytes plus the bound;
 * alloc_cache_mb sets the bound instead.  The library names the phases. */
TEST(fsdp_cache_stays_under_its_bound)
{
    ct_group *g = ct_group_world();
    int world = ct_group_size(g), rank = ct_group_rank(g);
    const int64_t w[] = {IN, 2048, 2560, 512, NCLS}; /* Linear(2048,2560): a 20 MiB unit */
    size_t limit = ct_mem_get_cache_limit();
    ct_mem_set_cache_limit(CT_MEM_CACHE_AUTO); /* on under AddressSanitizer too (it poisons what it holds) */
    ct_mem_trim();
    ct_module *m = chain(w, 5);
    ct_fsdp_unit u[8];
    int nu;
    ASSERT_OK(ct_fsdp_plan(m, "wrap_kinds=linear", u, 8, &nu));
    int64_t largest = 0;
    for (int i = 0; i < nu; i++) largest = u[i].numel > largest ? u[i].numel : largest;
    ASSERT_EQ(largest, (int64_t)2048 * 2560 + 2560);
    for (int pass = 0; pass < 2; pass++) {
        ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create("fsdp", m, &oo, g, pass ? "wrap_kinds=linear,alloc_cache_mb=8" : "wrap_kinds=linear", &s));
        ASSERT_EQ(ct_mem_phase_current(), CT_PHASE_WRAP);
        size_t bound = pass ? (size_t)8 << 20 : (size_t)CT_MEM_CACHE_UNITS * (size_t)largest * sizeof(float);
        ASSERT_EQ(ct_mem_get_cache_limit(), bound);
        ct_step_out o;
        ct_mem_report r0, r;
        ct_mem_reset_peak();
        ct_mem_report_get(&r0);
        for (int step = 0; step < 3; step++) {
            step_on_slice(s, step, 8 * world, rank, world, &o);
            ASSERT_OK(ct_strategy_step(s));
            ct_strategy_zero_grad(s);
        }
        ct_mem_report_get(&r);
        ASSERT_EQ(r.phase, CT_PHASE_TRAIN);
        ASSERT_EQ(r.cache_limit, bound);
        ct_status st = CT_OK;
        if (!(r.peak_cached <= bound && (pass || world == 1 || r.peak_cached > 0)))
            st = ct_error(CT_EINVAL, "the cache held up to %zu bytes over the steps; its bound is %zu", r.peak_cached, bound);
#ifndef __SANITIZE_ADDRESS__ /* its shadow memory and quarantine move RSS on their own */
        /* what the kernel sees: the live bytes' growth and the cache, MPI's own temporaries (libnbc's
         * reduce-scatter and allgather: up to a unit each on the ranks their algorithms make intermediate
         * roots, at a world that is not a power of two; measured 93-120 MB here at 3 ranks), and 16 MiB
         * of slack (malloc, stacks) */
        double grown = (double)r.peak_rss - (double)r0.rss,
               allowed = (double)(r.peak_total - r0.current_total) + (double)bound + 2.0 * (double)largest * 4 +
                         16.0 * (1 << 20);
        if (st == CT_OK && !(grown <= allowed))
            st = ct_error(CT_EINVAL, "RSS grew by %.0f bytes over the steps, more than the live bytes' %zu plus the cache's bound %zu",
                          grown, r.peak_total - r0.current_total, bound);
#endif
        ASSERT_OK(ct_group_check(g, st));
        UNWRAP(s); /* the model whole again, for the next pass */
        ASSERT_EQ(ct_mem_phase_current(), CT_PHASE_TEARDOWN);
    }
    ct_module_destroy(m);
    ct_mem_set_cache_limit(limit);
}

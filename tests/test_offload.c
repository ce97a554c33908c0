/*
 * The offload strategy in one process: offloaded training equals plain
 * training bit for bit (with and without activation checkpointing, with
 * micro-batches, dropout and clipping; the gpt, whose tied weight two
 * slices use; bf16 compute copies), the resident bytes stay under the
 * budget for a model several times its size, state saves and resumes in
 * any strategy, the store lives in the offload directory and leaves nothing
 * there, and a full disk or a bad directory is a clear error.
 */
#include <dirent.h>
#include <math.h>
#include <sys/stat.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include "cli_util.h"

/* 9 children, dropout between: slices cut between any of them. */
static ct_module *model(uint64_t seed, float drop)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(12, 32, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_dropout_create(drop)));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(32, 48, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_gelu_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(48, 32, 0)));
    ASSERT_OK(ct_module_add(m, NULL, ct_dropout_create(drop)));
    ASSERT_OK(ct_module_add(m, NULL, ct_layernorm_create(32, 1e-5f)));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(32, 5, 1)));
    ct_module_init_params(m, seed);
    return m;
}

/* One step on a batch drawn from step; clip < 0: no clipping. */
static double step_on(ct_strategy *s, int step, float clip)
{
    int64_t n = 24;
    ct_tensor *x = ct_tensor_create2(n, 12, CT_MEM_ACT), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 41, (uint64_t)step);
    ct_rng_normal(&r, ct_f32(x), (size_t)(n * 12), 0, 1);
    for (int64_t i = 0; i < n; i++) ((int32_t *)ct_tensor_data(y))[i] = (int32_t)((i * 7 + step) % 5);
    ct_batch b = {x, y, n, 0};
    ct_fwd_ctx ctx = {.training = 1, .seed = 11, .step = (uint64_t)step};
    ct_step_out out;
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
    ASSERT_EQ(out.rows, n);
    if (clip >= 0) ASSERT_OK(ct_strategy_clip_grad_norm(s, clip, 2.0, NULL));
    ASSERT_OK(ct_strategy_step(s));
    ct_strategy_zero_grad(s);
    ct_tensor_release(x);
    ct_tensor_release(y);
    return out.loss_sum;
}

/* Both strategies' full states (model, then optimizer) are bit for bit equal. */
static void assert_same_state(ct_strategy *a, ct_strategy *b)
{
    for (int optim = 0; optim < 2; optim++) {
        ct_state sa, sb;
        ASSERT_OK(optim ? ct_strategy_optim_state(a, &sa) : ct_strategy_model_state(a, &sa));
        ASSERT_OK(optim ? ct_strategy_optim_state(b, &sb) : ct_strategy_model_state(b, &sb));
        ASSERT_EQ(sa.n, sb.n);
        for (int i = 0; i < sa.n; i++) {
            ASSERT(!strcmp(sa.names[i], sb.names[i]));
            ASSERT_EQ(ct_tensor_bytes(sa.tensors[i]), ct_tensor_bytes(sb.tensors[i]));
            if (memcmp(ct_tensor_data(sa.tensors[i]), ct_tensor_data(sb.tensors[i]), ct_tensor_bytes(sa.tensors[i])))
                ct_test_fail(__FILE__, __LINE__, "'%s' differs", sa.names[i]);
        }
        ct_state_fini(&sa);
        ct_state_fini(&sb);
    }
}

/* Offloaded with opts vs plain with popts: 5 AdamW steps, same losses and
 * bit-identical parameters and optimizer state. */
static void check_equal(const char *opts, const char *popts, float drop, float clip)
{
    ct_module *a = model(3, drop), *b = model(3, drop);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    oo.lr = 0.01;
    ct_strategy *sa, *sb;
    ASSERT_OK(ct_strategy_create("none", a, &oo, NULL, popts, &sa));
    char full[512];
    snprintf(full, sizeof full, "%s,dir=%s", opts, ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("offload", b, &oo, NULL, full, &sb));
    for (int step = 0; step < 5; step++) {
        double la = step_on(sa, step, clip), lb = step_on(sb, step, clip);
        if (la != lb) ct_test_fail(__FILE__, __LINE__, "%s: step %d loss %.9g vs plain %.9g", opts, step, lb, la);
    }
    assert_same_state(sa, sb);
    UNWRAP(sb);
    UNWRAP(sa);
    /* unwrapped: the parameters are the model's own again, with the trained values */
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    for (int i = 0; i < na; i++)
        ASSERT(!memcmp(ct_tensor_data(pa[i]->data), ct_tensor_data(pb[i]->data), ct_tensor_bytes(pa[i]->data)));
    ct_free(pa);
    ct_free(pb);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

TEST(offload_equals_plain_training_bitwise)
{
    check_equal("slices=3", "", 0.0f, -1);
    check_equal("slices=4,prefetch=0", "", 0.0f, -1);
    check_equal("balance=1:8", "", 0.0f, -1);
    check_equal("slices=9", "", 0.0f, -1);
    check_equal("slices=3,store=memory", "", 0.0f, -1);
    check_equal("balance=1:1:1:6", "", 0.0f, -1); /* slices without parameters (tanh, dropout) */
}

TEST(offload_equals_plain_with_dropout_checkpointing_and_clipping)
{
    check_equal("slices=3", "", 0.3f, 0.05f);
    check_equal("slices=3,checkpoint_activation=1", "", 0.3f, -1);
    check_equal("slices=2,checkpoint_activation=1", "", 0.3f, 0.05f);
}

/* Gradients accumulated over two train steps without zero_grad (the second
 * backward adds to what the store holds), two optimizer steps on the same
 * gradients (the first, still pending, is applied before the second is
 * taken), clipping in between: all as plain training does them. */
TEST(offload_accumulation_and_repeated_steps_equal_plain)
{
    ct_module *a = model(6, 0.1f), *b = model(6, 0.1f);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    oo.lr = 0.05;
    oo.momentum = 0.9;
    ct_strategy *s[2];
    char opts[512];
    snprintf(opts, sizeof opts, "slices=3,dir=%s", ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("none", a, &oo, NULL, "", &s[0]));
    ASSERT_OK(ct_strategy_create("offload", b, &oo, NULL, opts, &s[1]));
    for (int k = 0; k < 2; k++) {
        for (int step = 0; step < 2; step++) {
            int64_t n = 10;
            ct_tensor *x = ct_tensor_create2(n, 12, CT_MEM_ACT), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
            ct_rng r;
            ct_rng_init(&r, 8, (uint64_t)step);
            ct_rng_normal(&r, ct_f32(x), (size_t)(n * 12), 0, 1);
            for (int64_t i = 0; i < n; i++) ((int32_t *)ct_tensor_data(y))[i] = (int32_t)(i % 5);
            ct_batch bt = {x, y, n, 0};
            ct_fwd_ctx ctx = {.training = 1, .seed = 2, .step = (uint64_t)step};
            ASSERT_OK(ct_strategy_train_step(s[k], &bt, ct_loss_cross_entropy, NULL, &ctx, NULL));
            ct_tensor_release(x);
            ct_tensor_release(y);
        }
        ASSERT_OK(ct_strategy_clip_grad_norm(s[k], 0.1f, 2.0, NULL));
        ASSERT_OK(ct_strategy_step(s[k]));
        ASSERT_OK(ct_strategy_step(s[k]));
        ASSERT_OK(ct_strategy_step(s[k]));
    }
    assert_same_state(s[0], s[1]);
    UNWRAP(s[0]);
    UNWRAP(s[1]);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* Batchnorm under checkpointing: the recompute does not count as another
 * batch, so the running statistics (buffers, in the state) equal plain
 * training's; eval through the strategy then uses them alike. */
TEST(offload_checkpoint_recompute_keeps_batchnorm_statistics)
{
    ct_module *m[2];
    for (int k = 0; k < 2; k++) {
        m[k] = ct_sequential_create();
        ASSERT_OK(ct_module_add(m[k], NULL, ct_linear_create(12, 16, 1)));
        ASSERT_OK(ct_module_add(m[k], NULL, ct_batchnorm_create(16, 1e-5f, 0.1f)));
        ASSERT_OK(ct_module_add(m[k], NULL, ct_relu_create()));
        ASSERT_OK(ct_module_add(m[k], NULL, ct_linear_create(16, 16, 1)));
        ASSERT_OK(ct_module_add(m[k], NULL, ct_batchnorm_create(16, 1e-5f, 0.1f)));
        ASSERT_OK(ct_module_add(m[k], NULL, ct_linear_create(16, 5, 1)));
        ct_module_init_params(m[k], 4);
    }
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *sa, *sb;
    char opts[512];
    snprintf(opts, sizeof opts, "slices=3,checkpoint_activation=1,dir=%s", ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("none", m[0], &oo, NULL, "", &sa));
    ASSERT_OK(ct_strategy_create("offload", m[1], &oo, NULL, opts, &sb));
    for (int step = 0; step < 3; step++) {
        double la = step_on(sa, step, -1), lb = step_on(sb, step, -1);
        ASSERT(la == lb);
    }
    assert_same_state(sa, sb); /* running_mean, running_var, num_batches_tracked included */
    ct_param *nb = ct_module_find(m[1], "1.num_batches_tracked");
    ASSERT(nb && ct_f32(nb->data)[0] == 3.0f);
    UNWRAP(sa);
    UNWRAP(sb);
    ct_module_destroy(m[0]);
    ct_module_destroy(m[1]);
}

/* Micro-batches: each slice runs them all while resident; the gradients
 * add up in the order grad_accum adds them. */
TEST(offload_microbatches_equal_grad_accum)
{
    check_equal("slices=3,checkpoint_activation=1,microbatches=4", "grad_accum=4", 0.3f, -1);
    check_equal("slices=4,checkpoint_activation=1,microbatches=3,prefetch=0", "grad_accum=3", 0.0f, 0.05f);
}

/* A model 5x the budget trains with the memory report's peak resident
 * (param + grad + optim) under the budget; 1 MiB too little is refused
 * with the numbers. */
TEST(offload_resident_stays_under_budget)
{
    ct_module *m = ct_sequential_create();
    for (int k = 0; k < 20; k++) {
        ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(k ? 250 : 12, 250, 1)));
        ASSERT_OK(ct_module_add(m, NULL, ct_relu_create()));
    }
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(250, 5, 1)));
    ct_module_init_params(m, 1);
    int64_t np = ct_module_num_params(m);
    size_t whole = (size_t)np * 4 * 4; /* params, grads, AdamW's two moments */
    const int budget_mb = 4;
    ASSERT(whole >= 4 * (size_t)budget_mb * 1048576);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    char opts[512];
    snprintf(opts, sizeof opts, "slices=4,max_resident_mb=%d,dir=%s", budget_mb, ct_test_tmpdir());
    ASSERT_ERR(ct_strategy_create("offload", m, &oo, NULL, opts, &s), CT_EINVAL, "over the budget of 4 MiB");
    ASSERT_STR_CONTAINS(ct_last_error(), "use more slices (--slices)");
    /* the memory plan applies the strategy's own rule: the same refusal, and
     * where it fits, the same slices resident at once */
    ct_plan_spec spec = {.world = 1, .batch = 16, .in_ndim = 1, .in_shape = {12}, .sample_bytes = 52, .optim = oo};
    ct_mem_plan plan;
    ASSERT_ERR(ct_strategy_plan("offload", m, opts, &spec, &plan), CT_EINVAL, "over the budget of 4 MiB");
    ASSERT_STR_CONTAINS(ct_last_error(), "use more slices (--slices)");
    snprintf(opts, sizeof opts, "slices=20,max_resident_mb=%d,dir=%s", budget_mb, ct_test_tmpdir());
    ASSERT_OK(ct_strategy_plan("offload", m, opts, &spec, &plan));
    ASSERT(plan.resident <= (size_t)budget_mb * 1048576);
    ASSERT_OK(ct_strategy_create("offload", m, &oo, NULL, opts, &s));
    int ns, ahead;
    ct_strategy_offload_info(s, &ns, &ahead);
    ASSERT_EQ(ns, 20);
    ASSERT(ahead >= 2); /* room to prefetch */
    ct_mem_reset_peak();
    for (int step = 0; step < 3; step++) {
        int64_t n = 16;
        ct_tensor *x = ct_tensor_create2(n, 12, CT_MEM_ACT), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
        ct_batch b = {x, y, n, 0};
        ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = (uint64_t)step};
        ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL));
        ASSERT_OK(ct_strategy_clip_grad_norm(s, 1.0f, 2.0, NULL));
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    ct_mem_report r;
    ct_mem_report_get(&r);
    if (r.peak_resident > (size_t)budget_mb * 1048576)
        ct_test_fail(__FILE__, __LINE__, "peak resident %zu bytes over the budget %d MiB (model %zu bytes)",
                     r.peak_resident, budget_mb, whole);
    ASSERT(r.peak[CT_MEM_OPTIM] > 0 && r.peak[CT_MEM_GRAD] > 0); /* slices did come in */
    ct_step_stats st = ct_strategy_stats(s);
    ASSERT(st.io_total > 0);
    UNWRAP(s);
    ct_module_destroy(m);
}

typedef ct_module *(*model_fn)(uint64_t seed, float drop);
typedef double (*step_fn)(ct_strategy *s, int step, float clip);

/* A run saved under offload (options opts; plain: popts) resumes under
 * "none" (and a plain run's state under offload) exactly as if it had not
 * stopped. */
static void check_resume(model_fn model, step_fn step_on, const char *oopts, const char *popts)
{
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    oo.lr = 0.01;
    const char *kinds[2][2] = {{"offload", "none"}, {"none", "offload"}};
    for (int dir = 0; dir < 2; dir++) {
        ct_module *a = model(8, 0.2f), *b = model(99, 0.2f), *c = model(8, 0.2f);
        char opts[512];
        snprintf(opts, sizeof opts, "%s,dir=%s", oopts, ct_test_tmpdir());
        const char *ka = kinds[dir][0], *kb = kinds[dir][1];
        ct_strategy *sa, *sb, *sc;
        ASSERT_OK(ct_strategy_create(ka, a, &oo, NULL, strcmp(ka, "none") ? opts : popts, &sa));
        ASSERT_OK(ct_strategy_create(kb, b, &oo, NULL, strcmp(kb, "none") ? opts : popts, &sb));
        ASSERT_OK(ct_strategy_create("none", c, &oo, NULL, popts, &sc)); /* never stops */
        for (int step = 0; step < 3; step++) {
            step_on(sa, step, -1);
            step_on(sc, step, -1);
        }
        /* through a safetensors file, as ctrain --save / --resume do */
        for (int optim = 0; optim < 2; optim++) {
            ct_state st;
            ASSERT_OK(optim ? ct_strategy_optim_state(sa, &st) : ct_strategy_model_state(sa, &st));
            char path[PATH_MAX];
            snprintf(path, sizeof path, "%s/ck%d.safetensors", ct_test_tmpdir(), optim);
            ASSERT_OK(ct_safetensors_save(path, (const char *const *)st.names, st.tensors,
                                          st.n, NULL, NULL, 0));
            ct_state_fini(&st);
            ct_safetensors *f;
            ASSERT_OK(ct_safetensors_load(path, &f));
            const char **names;
            ct_tensor **ts;
            int n = ct_safetensors_count(f);
            names = ct_alloc(sizeof *names * (size_t)n, CT_MEM_OTHER);
            ts = ct_alloc(sizeof *ts * (size_t)n, CT_MEM_OTHER);
            for (int i = 0; i < n; i++) {
                names[i] = ct_safetensors_name(f, i);
                ts[i] = ct_safetensors_tensor(f, i);
            }
            ASSERT_OK(ct_strategy_load_state(sb, names, ts, n, optim));
            ct_free(names);
            ct_free(ts);
            ct_safetensors_destroy(f);
        }
        for (int step = 3; step < 6; step++) {
            double lb = step_on(sb, step, -1), lc = step_on(sc, step, -1);
            ASSERT(lb == lc);
        }
        assert_same_state(sb, sc);
        UNWRAP(sa);
        UNWRAP(sb);
        UNWRAP(sc);
        ct_module_destroy(a);
        ct_module_destroy(b);
        ct_module_destroy(c);
    }
}

TEST(offload_state_saves_and_resumes_in_any_strategy)
{
    check_resume(model, step_on, "slices=3,checkpoint_activation=1", "");
}

/* Eval through the strategy streams the slices and equals the plain forward. */
TEST(offload_predict_equals_plain_forward)
{
    ct_module *a = model(5, 0.5f), *b = model(5, 0.5f);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    char opts[512];
    snprintf(opts, sizeof opts, "slices=4,dir=%s", ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("offload", b, &oo, NULL, opts, &s));
    ct_tensor *x = ct_tensor_create2(7, 12, CT_MEM_ACT), *ya = NULL, *yb = NULL;
    ct_rng r;
    ct_rng_init(&r, 1, 2);
    ct_rng_normal(&r, ct_f32(x), 7 * 12, 0, 1);
    ct_fwd_ctx ctx = {.training = 0};
    ASSERT_OK(ct_module_forward(a, x, &ya, NULL, &ctx));
    ASSERT_OK(ct_strategy_predict(s, x, &ctx, &yb));
    ASSERT(yb && !memcmp(ct_tensor_data(ya), ct_tensor_data(yb), ct_tensor_bytes(ya)));
    /* forward outside the train step would find no parameters: refused */
    ct_tensor *z = NULL;
    ASSERT_ERR(ct_strategy_forward(s, x, &z, NULL, &ctx), CT_ESTATE, "ct_strategy_train_step");
    ct_tensor_release(x);
    ct_tensor_release(ya);
    ct_tensor_release(yb);
    UNWRAP(s);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* The store is a file in the given directory, unlinked from the start, so
 * nothing is ever left there (not even after SIGKILL); the process holds
 * it open while the strategy lives. */
TEST(offload_store_lives_in_the_directory_and_leaves_nothing)
{
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s/store", ct_test_tmpdir());
    ASSERT(mkdir(dir, 0700) == 0);
    ct_module *m = model(1, 0);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    char opts[PATH_MAX + 64];
    snprintf(opts, sizeof opts, "slices=2,dir=%s", dir);
    ASSERT_OK(ct_strategy_create("offload", m, &oo, NULL, opts, &s));
    step_on(s, 0, -1);
    ASSERT_EQ(count_entries(dir), 0);
    /* one file (held by one descriptor, or two where it also moves by direct I/O) */
    int found = 0, fds_on_it = 0;
    static char first[PATH_MAX];
    DIR *fds = opendir("/proc/self/fd");
    if (!fds) SKIP("no /proc/self/fd to see the open store");
    struct dirent *e;
    while ((e = readdir(fds))) {
        char link[PATH_MAX], target[PATH_MAX];
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t k = readlink(link, target, sizeof target - 1);
        if (k <= 0) continue;
        target[k] = 0;
        if (!strncmp(target, dir, strlen(dir)) && strstr(target, "ctrain-offload") && strstr(target, "(deleted)")) {
            fds_on_it++;
            if (!found || strcmp(first, target)) found++;
            snprintf(first, sizeof first, "%s", target);
        }
    }
    closedir(fds);
    ASSERT_EQ(found, 1);
    ASSERT(fds_on_it == 1 || fds_on_it == 2);
    UNWRAP(s);
    ASSERT_EQ(count_entries(dir), 0);
    ct_module_destroy(m);
}

/* Bad set-ups are refused with the cause and the fix. */
TEST(offload_bad_configurations_are_clear_errors)
{
    ct_module *m = model(1, 0);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    char opts[PATH_MAX + 64];
    ASSERT_ERR(ct_strategy_create("offload", m, &oo, NULL, "microbatches=4", &s), CT_EINVAL,
               "need checkpoint_activation");
    ASSERT_ERR(ct_strategy_create("offload", m, &oo, NULL, "slices=10", &s), CT_EINVAL,
               "cannot cut 9 children into 10 slices");
    ASSERT_ERR(ct_strategy_create("offload", m, &oo, NULL, "balance=3:3", &s), CT_EINVAL, "sums to 6");
    ASSERT_ERR(ct_strategy_create("offload", m, &oo, NULL, "grad_accum=2", &s), CT_EINVAL, "--microbatches");
    snprintf(opts, sizeof opts, "dir=%s/missing", ct_test_tmpdir());
    ASSERT_ERR(ct_strategy_create("offload", m, &oo, NULL, opts, &s), CT_EIO, "No such file or directory");
    char file[PATH_MAX];
    snprintf(file, sizeof file, "%s/plain", ct_test_tmpdir());
    FILE *fp = fopen(file, "w");
    ASSERT(fp);
    fclose(fp);
    snprintf(opts, sizeof opts, "dir=%s", file);
    ASSERT_ERR(ct_strategy_create("offload", m, &oo, NULL, opts, &s), CT_EIO, "is not a directory");
    ct_module *lin = ct_linear_create(3, 3, 1);
    ASSERT_ERR(ct_strategy_create("offload", lin, &oo, NULL, "", &s), CT_EINVAL, "needs a sequential");
    ct_module_destroy(lin);
    /* the model came through the failed set-ups unchanged: it still trains offloaded */
    snprintf(opts, sizeof opts, "dir=%s", ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("offload", m, &oo, NULL, opts, &s));
    step_on(s, 0, -1);
    UNWRAP(s);
    ct_module_destroy(m);
}

/* A disk that fills (or fails) in the middle of a step: the step fails
 * naming the store's directory and the fix, the store is given up, and a
 * checkpoint written before is untouched and still loads. */
TEST(offload_full_disk_mid_step_is_a_clear_error)
{
    ct_module *m = model(2, 0), *ref = model(2, 0);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s, *sr;
    char opts[PATH_MAX + 64];
    snprintf(opts, sizeof opts, "slices=3,dir=%s", ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("offload", m, &oo, NULL, opts, &s));
    ASSERT_OK(ct_strategy_create("none", ref, &oo, NULL, "", &sr));
    step_on(s, 0, -1);
    step_on(sr, 0, -1);
    ct_state st;
    ASSERT_OK(ct_strategy_model_state(s, &st));
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/last.safetensors", ct_test_tmpdir());
    ASSERT_OK(ct_safetensors_save(path, (const char *const *)st.names, st.tensors, st.n, NULL, NULL, 0));
    ct_state_fini(&st);
    for (int when = 0; when < 12; when += 5) {
        ct_offload_fail_io_after(when);
        int64_t n = 8;
        ct_tensor *x = ct_tensor_create2(n, 12, CT_MEM_ACT), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
        ct_batch b = {x, y, n, 0};
        ct_fwd_ctx ctx = {.training = 1};
        ct_status r = ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL);
        if (r == CT_OK) r = ct_strategy_step(s);
        ASSERT_EQ(r, CT_EIO);
        ASSERT_STR_CONTAINS(ct_last_error(), ct_test_tmpdir());
        ASSERT_STR_CONTAINS(ct_last_error(), "--offload-dir");
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    ct_offload_fail_io_after(-1);
    ct_mem_report rep;
    ct_mem_report_get(&rep);
    /* nothing of a slice stays resident after the failures (only the reference's) */
    ASSERT(rep.current[CT_MEM_GRAD] <= (size_t)ct_module_num_params(ref) * 4);
    ct_strategy_destroy(s); /* the store failed: nothing to summon */
    ct_safetensors *f;
    ASSERT_OK(ct_safetensors_load(path, &f));
    for (int i = 0; i < ct_safetensors_count(f); i++) {
        ct_param *p = ct_module_find(ref, ct_safetensors_name(f, i));
        ASSERT(p);
        ASSERT(!memcmp(ct_tensor_data(ct_safetensors_tensor(f, i)), ct_tensor_data(p->data), ct_tensor_bytes(p->data)));
    }
    ct_safetensors_destroy(f);
    UNWRAP(sr);
    ct_module_destroy(m);
    ct_module_destroy(ref);
}

TEST(offload_split_by_parameter_count)
{
    ct_module *m = ct_sequential_create();
    int widths[] = {100, 10, 10, 10, 100, 10, 10, 100};
    for (int k = 0; k < 8; k++) ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(10, widths[k], 0)));
    int sizes[9];
    ASSERT_OK(ct_offload_split(m, 3, sizes));
    /* 3500 parameters, a share of ~1167 (cumulative 1167, 2333): [1000+100+100]
     * closes at 1200 (33 over beats 133 over), [100+1000] at 2300 (33 under
     * beats 67 over), the last takes [100+100+1000] */
    ASSERT_EQ(sizes[0], 3);
    ASSERT_EQ(sizes[1], 2);
    ASSERT_EQ(sizes[2], 3);
    /* children without parameters stay with the slice before them */
    ct_module *r = ct_sequential_create();
    for (int k = 0; k < 4; k++) {
        ASSERT_OK(ct_module_add(r, NULL, ct_linear_create(10, 10, 0)));
        ASSERT_OK(ct_module_add(r, NULL, ct_relu_create()));
    }
    ASSERT_OK(ct_offload_split(r, 4, sizes));
    for (int k = 0; k < 4; k++) ASSERT_EQ(sizes[k], 2);
    ASSERT_OK(ct_offload_split(r, 8, sizes));
    for (int k = 0; k < 8; k++) ASSERT_EQ(sizes[k], 1);
    ct_module_destroy(r);
    ASSERT_OK(ct_offload_split(m, 8, sizes));
    for (int k = 0; k < 8; k++) ASSERT_EQ(sizes[k], 1);
    ASSERT_ERR(ct_offload_split(m, 9, sizes), CT_EINVAL, "use at most 8 slices");
    ct_module_destroy(m);
}

/* ---- the gpt: a tied weight used by the first slice and the last ---------- */

#define GV 13 /* vocabulary */
#define GT 8  /* context */

static ct_module *gpt(uint64_t seed, float drop)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 2, 2, 16, GT, GV);
    c.dropout = drop;
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, seed, &m));
    return m;
}

/* One step of the gpt on 6 sequences drawn from step. */
static double gpt_step(ct_strategy *s, int step, float clip)
{
    int64_t n = 6, sh[2] = {n, GT};
    ct_tensor *x = ct_tensor_create(CT_I64, 2, sh, CT_MEM_ACT), *y = ct_tensor_create(CT_I64, 2, sh, CT_MEM_ACT);
    for (int64_t i = 0; i < n * GT; i++) {
        ((int64_t *)ct_tensor_data(x))[i] = (i * 5 + step * 3) % GV;
        ((int64_t *)ct_tensor_data(y))[i] = (i * 5 + step * 3 + 1 + i / 7) % GV;
    }
    ct_batch b = {x, y, n, 0};
    ct_fwd_ctx ctx = {.training = 1, .seed = 5, .step = (uint64_t)step};
    ct_step_out out;
    ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
    if (clip >= 0) ASSERT_OK(ct_strategy_clip_grad_norm(s, clip, 2.0, NULL));
    ASSERT_OK(ct_strategy_step(s));
    ct_strategy_zero_grad(s);
    ct_tensor_release(x);
    ct_tensor_release(y);
    return out.loss_sum;
}

/* Relative L2 distance of a's states (model and optimizer) from b's, the larger. */
static double state_diff(ct_strategy *a, ct_strategy *b)
{
    double worst = 0;
    for (int optim = 0; optim < 2; optim++) {
        ct_state sa, sb;
        ASSERT_OK(optim ? ct_strategy_optim_state(a, &sa) : ct_strategy_model_state(a, &sa));
        ASSERT_OK(optim ? ct_strategy_optim_state(b, &sb) : ct_strategy_model_state(b, &sb));
        ASSERT_EQ(sa.n, sb.n);
        double num = 0, den = 0;
        for (int i = 0; i < sa.n; i++) {
            ASSERT(!strcmp(sa.names[i], sb.names[i]));
            if (sa.tensors[i]->dtype != CT_F32) continue; /* the step count */
            for (int64_t e = 0; e < sa.tensors[i]->numel; e++) {
                double x = ct_f32(sa.tensors[i])[e], y = ct_f32(sb.tensors[i])[e];
                num += (x - y) * (x - y);
                den += y * y;
            }
        }
        if (sqrt(num / den) > worst) worst = sqrt(num / den);
        ct_state_fini(&sa);
        ct_state_fini(&sb);
    }
    return worst;
}

/* The gpt offloaded with opts vs plain with popts for 4 AdamW steps: same
 * losses and states bit for bit (tol 0; else within tol), the tied weight
 * saved once under the embedding's name, and the unwrapped model's weights
 * equal. */
static void check_gpt(const char *opts, const char *popts, float drop, float clip, double tol)
{
    ct_module *a = gpt(3, drop), *b = gpt(3, drop);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    oo.lr = 0.01;
    /* Some gradients are zero in exact arithmetic (the key bias), so runs
     * that round apart hold different noise there, which AdamW with eps
     * 1e-8 would blow up to full steps (as tests/mpi/test_gpt.c). */
    oo.eps = 1e-4;
    ct_strategy *sa, *sb;
    ASSERT_OK(ct_strategy_create("none", a, &oo, NULL, popts, &sa));
    char full[512];
    snprintf(full, sizeof full, "%s,dir=%s", opts, ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("offload", b, &oo, NULL, full, &sb));
    for (int step = 0; step < 4; step++) {
        double la = gpt_step(sa, step, clip), lb = gpt_step(sb, step, clip);
        if (tol ? fabs(la - lb) > tol * fabs(la) : la != lb)
            ct_test_fail(__FILE__, __LINE__, "%s: step %d loss %.9g vs plain %.9g", opts, step, lb, la);
    }
    if (tol) {
        double d = state_diff(sb, sa);
        if (!(d < tol)) ct_test_fail(__FILE__, __LINE__, "%s: state differs from plain by %g (tol %g)", opts, d, tol);
    } else {
        assert_same_state(sa, sb);
    }
    ct_state st;
    ASSERT_OK(ct_strategy_model_state(sb, &st));
    int wte = 0;
    for (int i = 0; i < st.n; i++) {
        ASSERT(strcmp(st.names[i], "lm_head.weight") != 0);
        wte += !strcmp(st.names[i], "transformer.wte.weight");
    }
    ASSERT_EQ(wte, 1);
    ct_state_fini(&st);
    UNWRAP(sb);
    UNWRAP(sa);
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    ASSERT_EQ(na, nb);
    for (int i = 0; i < na; i++) {
        ASSERT(!pb[i]->compute);
        ASSERT(tol || !memcmp(ct_tensor_data(pa[i]->data), ct_tensor_data(pb[i]->data), ct_tensor_bytes(pa[i]->data)));
    }
    ct_free(pa);
    ct_free(pb);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* The tied weight (embedding in the first slice, head in the last) stays
 * resident, takes the gradient of both uses and steps as plain training. */
TEST(offload_tied_gpt_equals_plain_bitwise)
{
    check_gpt("slices=3", "", 0.1f, -1, 0);
    check_gpt("slices=5,prefetch=0", "", 0.1f, 0.5f, 0);
    check_gpt("slices=2,checkpoint_activation=1", "", 0.1f, 0.5f, 0);
    check_gpt("balance=1:3:1", "", 0.0f, -1, 0); /* ln_f and the head in one slice, the embedding alone */
    check_gpt("slices=1", "", 0.1f, -1, 0);      /* both uses in one slice: nothing tied */
}

/* Micro-batches: each slice runs them all while resident, so the tied
 * weight's gradient adds the head's uses of every micro-batch before the
 * embedding's, where grad_accum alternates them (head 1, embedding 1, head
 * 2, ...): the same terms in another order, equal to rounding (every
 * untied gradient adds in grad_accum's order, as the bitwise tests above). */
TEST(offload_tied_gpt_microbatches_equal_grad_accum_to_rounding)
{
    check_gpt("slices=3,checkpoint_activation=1,microbatches=2", "grad_accum=2", 0.1f, -1, 1e-5);
    check_gpt("slices=4,checkpoint_activation=1,microbatches=3,prefetch=0", "grad_accum=3", 0.1f, 0.5f, 1e-5);
}

/* param_dtype=bf16: a slice's compute copies are made when it loads and
 * after its update, the tied weight's after every step, from the same f32
 * masters: the casts plain mixed precision makes, so the same numbers. */
TEST(offload_bf16_equals_plain_bf16)
{
    check_gpt("slices=3,param_dtype=bf16", "param_dtype=bf16", 0.1f, -1, 0);
    check_gpt("slices=4,param_dtype=bf16,prefetch=0", "param_dtype=bf16", 0.1f, 0.5f, 0);
    check_gpt("slices=3,param_dtype=bf16,checkpoint_activation=1", "param_dtype=bf16", 0.1f, -1, 0);
    check_gpt("slices=3,param_dtype=bf16,checkpoint_activation=1,microbatches=2", "param_dtype=bf16,grad_accum=2",
              0.1f, -1, 1e-5);
    /* compute copies exist only while their slice is in use: none after a step but the tied weight's */
    ct_module *m = gpt(3, 0);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    char opts[512];
    snprintf(opts, sizeof opts, "slices=3,param_dtype=bf16,dir=%s", ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("offload", m, &oo, NULL, opts, &s));
    gpt_step(s, 0, -1);
    ct_param *wte = ct_module_find(m, "transformer.wte.weight"), *fc = ct_module_find(m, "transformer.h.0.mlp.c_fc.weight");
    ASSERT(wte->compute && ct_tensor_data(wte->compute) && wte->compute->dtype == CT_BF16);
    ASSERT(fc->compute && !ct_tensor_data(fc->compute));
    ASSERT(!ct_module_find(m, "transformer.h.0.ln_1.weight")->compute); /* norms stay f32 */
    UNWRAP(s);
    ASSERT(!wte->compute && !fc->compute);
    ct_module_destroy(m);
}

/* The gpt's state through a file: the tied weight once, as
 * transformer.wte.weight, loaded into the resident group (and its compute
 * copy) or into the store, resumed in either direction. */
TEST(offload_tied_gpt_state_resumes_in_any_strategy)
{
    check_resume(gpt, gpt_step, "slices=3", "");
    check_resume(gpt, gpt_step, "slices=4,param_dtype=bf16", "param_dtype=bf16");
}

/* The tied weight is resident from wrap on, so it counts with what is
 * already resident: in the budget's check, its refusal, and the peak.  A
 * gpt whose embedding (4096 x 64: 4 MiB with its gradient and AdamW's
 * moments) outweighs a block (0.8 MiB). */
TEST(offload_tied_weight_counts_in_the_budget)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 2, 2, 64, GT, 4096);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 1, &m));
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    char opts[512];
    snprintf(opts, sizeof opts, "slices=4,max_resident_mb=4,dir=%s", ct_test_tmpdir());
    ASSERT_ERR(ct_strategy_create("offload", m, &oo, NULL, opts, &s), CT_EINVAL, "over the budget of 4 MiB");
    ASSERT_STR_CONTAINS(ct_last_error(), "(4.00 MiB of them for parameters two slices use");
    snprintf(opts, sizeof opts, "slices=4,max_resident_mb=6,dir=%s", ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("offload", m, &oo, NULL, opts, &s));
    ct_mem_report r;
    ct_mem_report_get(&r);
    ASSERT(r.current[CT_MEM_OPTIM] >= 2u << 20); /* the tied weight's moments stay */
    ct_mem_reset_peak();
    for (int step = 0; step < 2; step++) {
        int64_t sh[2] = {2, GT};
        ct_tensor *x = ct_tensor_create(CT_I64, 2, sh, CT_MEM_ACT), *y = ct_tensor_create(CT_I64, 2, sh, CT_MEM_ACT);
        ct_batch b = {x, y, 2, 0};
        ct_fwd_ctx ctx = {.training = 1, .step = (uint64_t)step};
        ASSERT_OK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL));
        ASSERT_OK(ct_strategy_step(s));
        ct_strategy_zero_grad(s);
        ct_tensor_release(x);
        ct_tensor_release(y);
    }
    ct_mem_report_get(&r);
    if (r.peak_resident > 6u << 20 || r.peak_resident < 4u << 20)
        ct_test_fail(__FILE__, __LINE__, "peak resident %zu bytes: want the tied 4 MiB and at most the budget 6 MiB",
                     r.peak_resident);
    UNWRAP(s);
    ct_module_destroy(m);
}

/* The explicit unwrap: summon makes every parameter readable (the slices
 * read from the store), a train step meanwhile is refused, release frees
 * what summon brought in (writing back with writeback); a plain destroy
 * frees and reads nothing back. */
TEST(offload_summon_release_and_teardown_that_frees)
{
    ct_module *a = model(3, 0), *b = model(3, 0);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *sa, *sb;
    char opts[512];
    snprintf(opts, sizeof opts, "slices=3,dir=%s", ct_test_tmpdir());
    ASSERT_OK(ct_strategy_create("none", a, &oo, NULL, NULL, &sa));
    ASSERT_OK(ct_strategy_create("offload", b, &oo, NULL, opts, &sb));
    for (int step = 0; step < 2; step++) step_on(sa, step, 0), step_on(sb, step, 0);
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    ASSERT_OK(ct_strategy_summon_full_params(sb, 1, 0));
    for (int i = 0; i < nb; i++) {
        ASSERT_OK(ct_tensor_check_data(pb[i]->data));
        ASSERT(!memcmp(ct_tensor_data(pa[i]->data), ct_tensor_data(pb[i]->data), ct_tensor_bytes(pa[i]->data)));
    }
    int64_t n = 4;
    ct_tensor *x = ct_tensor_create2(n, 12, CT_MEM_ACT), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    ct_batch batch = {x, y, n, 0};
    ct_fwd_ctx ctx = {.training = 1};
    ASSERT_ERR(ct_strategy_train_step(sb, &batch, ct_loss_cross_entropy, NULL, &ctx, NULL), CT_ESTATE,
               "release the full parameters first");
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_f32(pb[0]->data)[0] = 42.0f; /* written back on release */
    ASSERT_OK(ct_strategy_release_full_params(sb));
    ct_state st;
    ASSERT_OK(ct_strategy_model_state(sb, &st));
    ASSERT(ct_f32(st.tensors[0])[0] == 42.0f);
    ct_state_fini(&st);
    ct_mem_report before, after;
    ct_mem_report_get(&before);
    ct_strategy_destroy(sb);
    ct_mem_report_get(&after);
    ASSERT(after.peak[CT_MEM_PARAM] == before.peak[CT_MEM_PARAM]); /* nothing read back */
    for (int i = 0; i < nb; i++) ASSERT_ERR(ct_tensor_check_data(pb[i]->data), CT_ESTATE, "summon");
    ct_free(pa);
    ct_free(pb);
    ct_strategy_destroy(sa);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

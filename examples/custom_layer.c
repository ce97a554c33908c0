/*
 * A model with a layer of your own, trained under any strategy, saved and
 * resumed: the library's public API only.
 *
 *   custom_layer STRATEGY DIR STEPS [--until K] [--resume] [--format full|sharded|local]
 *   mpirun -np 2 build/examples/custom_layer fsdp /tmp/run 40 --until 20
 *   mpirun -np 3 build/examples/custom_layer zero2 /tmp/run 40 --resume
 *
 * The layer is RMSNorm (y = x / sqrt(mean(x^2) + eps) * weight), with a
 * forward that saves what its backward needs in the call's record, a
 * backward that accumulates its weight's gradient and returns the input's,
 * an init, and an out_shape (pipe sizes the activations between stages with
 * it).  The data are synthetic: the label of x is the argmax of a fixed
 * projection of x, so the loss falls within a few steps.  Each step's global
 * batch is the same whatever the number of ranks; each rank takes its rows
 * with ct_strategy_local_rows (under pipe, the stages of one pipeline must
 * get the same rows).  At the end every rank calls ct_checkpoint_save (it
 * is collective): the model (a PyTorch state_dict), its optimizer state and
 * the data position, committed as one unit, in a series of which the two
 * newest stay (DIR/run-step00000020.safetensors and its
 * .optim.safetensors; with --format sharded or local a directory
 * DIR/run-step00000020 of every rank's share or pieces).  --resume finds
 * the newest checkpoint that verifies (ct_checkpoint_latest), reads where
 * the run stood (ct_checkpoint_info) and loads it (ct_checkpoint_load) under
 * any strategy and world size, to the same numbers as one run (STEPS is the
 * learning-rate schedule's length; --until K stops at K).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ctrain/ctrain.h>

#define IN 16
#define HID 32
#define CLASSES 4
#define BATCH 32 /* global rows per step */

/* ---- the custom layer ----------------------------------------------------- */

typedef struct {
    float eps;
} rmsnorm;

/* x [N, D] -> y [N, D]; saves x for backward. */
static ct_status rms_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec, const ct_fwd_ctx *ctx)
{
    (void)ctx;
    const rmsnorm *r = m->impl;
    if (in->dtype != CT_F32 || in->ndim != 2)
        return ct_error(CT_EINVAL, "rmsnorm '%s': input must be F32 [N, D]", m->fqn);
    int64_t n = in->shape[0], d = in->shape[1];
    ct_tensor *y = ct_tensor_empty(CT_F32, 2, in->shape, CT_MEM_ACT);
    if (!y) return CT_ENOMEM;
    const float *x = ct_f32(in), *w = ct_f32(m->params[0]->data);
    float *yp = ct_f32(y);
    for (int64_t i = 0; i < n; i++) {
        double ms = 0;
        for (int64_t j = 0; j < d; j++) ms += (double)x[i * d + j] * x[i * d + j];
        float inv = 1.0f / sqrtf((float)(ms / (double)d) + r->eps);
        for (int64_t j = 0; j < d; j++) yp[i * d + j] = x[i * d + j] * inv * w[j];
    }
    if (rec && ct_record_save(rec, in) < 0) {
        ct_tensor_release(y);
        return CT_ENOMEM;
    }
    *out = y;
    return CT_OK;
}

/* dweight += sum_i dy * xhat; dx = inv * (g - xhat * mean(g * xhat)), g = dy * w. */
static ct_status rms_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const rmsnorm *r = m->impl;
    ct_tensor *in = ct_record_saved(rec, 0);
    int64_t n = in->shape[0], d = in->shape[1];
    const float *x = ct_f32(in), *dy = ct_f32(dout), *w = ct_f32(m->params[0]->data);
    float *dw = ct_f32(m->params[0]->grad); /* accumulated: ops.lazy_grad is 0, so it holds its value */
    ct_tensor *dx = din ? ct_tensor_empty(CT_F32, 2, in->shape, CT_MEM_ACT) : NULL;
    if (din && !dx) return CT_ENOMEM;
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * d, *gi = dy + i * d;
        double ms = 0, dot = 0;
        for (int64_t j = 0; j < d; j++) ms += (double)xi[j] * xi[j];
        float inv = 1.0f / sqrtf((float)(ms / (double)d) + r->eps);
        for (int64_t j = 0; j < d; j++) {
            dw[j] += gi[j] * xi[j] * inv;
            dot += (double)gi[j] * w[j] * xi[j] * inv;
        }
        if (!dx) continue;
        float mean = (float)(dot / (double)d);
        for (int64_t j = 0; j < d; j++) ct_f32(dx)[i * d + j] = inv * (gi[j] * w[j] - xi[j] * inv * mean);
    }
    if (din) *din = dx;
    return CT_OK;
}

static void rms_destroy(ct_module *m) { free(m->impl); }

static const ct_module_ops rmsnorm_ops = {
    .kind = "rmsnorm",
    .forward = rms_forward,
    .backward = rms_backward,
    .destroy = rms_destroy,
    .out_shape = ct_module_out_shape_same,
};

static ct_module *rmsnorm_create(int64_t dim)
{
    rmsnorm *r = malloc(sizeof *r);
    ct_module *m = r ? ct_module_create(&rmsnorm_ops, r) : NULL;
    if (!m) {
        free(r);
        return NULL;
    }
    r->eps = 1e-6f;
    ct_param *w = ct_module_add_param(m, "weight", 1, &dim);
    if (!w) {
        ct_module_destroy(m);
        return NULL;
    }
    /* Its initial values: weight 1, as torch.nn.RMSNorm starts.  A rule, not
     * values, so a sharded strategy can make any part of it (ct_init_with
     * takes a function for any other rule). */
    ct_param_set_init(w, ct_init_const(1.0f));
    return m;
}

/* ---- the model, the data, the state files ------------------------------- */

/* Sequential(Linear, RMSNorm, ReLU, Linear, RMSNorm, ReLU, Linear): names "0.weight", "1.weight", ... */
static ct_module *build_model(void)
{
    ct_module *m = ct_sequential_create();
    ct_module *kids[] = {ct_linear_create(IN, HID, 1), rmsnorm_create(HID), ct_relu_create(),
                         ct_linear_create(HID, HID, 1), rmsnorm_create(HID), ct_relu_create(),
                         ct_linear_create(HID, CLASSES, 1)};
    for (size_t i = 0; i < sizeof kids / sizeof kids[0]; i++)
        if (!m || !kids[i] || ct_module_add(m, NULL, kids[i]) != CT_OK) return NULL;
    ct_module_init_params(m, 1234);
    return m;
}

/* Rows [first, first + count) of step's global batch: x ~ N(0, 1) keyed by
 * (step, row), the label the argmax of a fixed projection. */
static void make_batch(int64_t step, int64_t first, int64_t count, ct_tensor **x, ct_tensor **y)
{
    *x = ct_tensor_create2(count, IN, CT_MEM_ACT);
    *y = ct_tensor_create(CT_I32, 1, &count, CT_MEM_ACT);
    for (int64_t i = 0; i < count; i++) {
        ct_rng r;
        ct_rng_init(&r, 99, (uint64_t)(step * BATCH + first + i));
        float *xi = ct_f32(*x) + i * IN;
        ct_rng_normal(&r, xi, IN, 0.0f, 1.0f);
        int best = 0;
        float bv = -INFINITY;
        for (int c = 0; c < CLASSES; c++) {
            float v = 0;
            for (int j = 0; j < IN; j++) v += xi[j] * (float)(((j * 7 + c * 3) % 5) - 2);
            if (v > bv) bv = v, best = c;
        }
        ((int32_t *)ct_tensor_data(*y))[i] = best;
    }
}

#define CHECK(call)                                                               \
    do {                                                                          \
        ct_status rc_ = (call);                                                   \
        if (rc_ != CT_OK) {                                                       \
            fprintf(stderr, "custom_layer: %s: %s\n", #call, ct_last_error());    \
            ct_comm_abort("custom_layer failed");                                 \
        }                                                                         \
    } while (0)

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: custom_layer STRATEGY DIR STEPS [--until K] [--resume]   (STRATEGY: %s)\n",
                ct_strategy_list());
        return 2;
    }
    const char *kind = argv[1], *dir = argv[2];
    int64_t steps = atoll(argv[3]), until = steps; /* the schedule's length; where this run stops */
    int resume = 0;
    ct_ckpt_opts save_opts = {.kind = CT_CKPT_FULL, .keep_last = 2};
    for (int i = 4; i < argc; i++) {
        if (!strcmp(argv[i], "--resume")) resume = 1;
        else if (!strcmp(argv[i], "--until") && i + 1 < argc) until = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--format") && i + 1 < argc) {
            i++;
            save_opts.kind = !strcmp(argv[i], "sharded") ? CT_CKPT_SHARDED
                           : !strcmp(argv[i], "local")   ? CT_CKPT_LOCAL : CT_CKPT_FULL;
        }
    }
    /* the series' name: a file, or a directory for the sharded kinds */
    char series[1024];
    snprintf(series, sizeof series, "%s/run%s", dir, save_opts.kind == CT_CKPT_FULL ? ".safetensors" : "");

    CHECK(ct_comm_init(&argc, &argv));
    int rank = ct_group_rank(ct_group_world());
    ct_module *model = build_model();
    if (!model) CHECK(ct_last_status());
    ct_optim_opts adamw = ct_optim_defaults(CT_OPT_ADAMW);
    adamw.lr = 0.01;
    adamw.weight_decay = 0.01;
    ct_strategy *s;
    /* pipe cuts the 7 children into 2 stages; the other strategies take no options here */
    CHECK(ct_strategy_create(kind, model, &adamw, NULL, !strcmp(kind, "pipe") ? "stages=2,chunks=2" : NULL, &s));
    ct_lr_schedule cos = {CT_SCHED_COSINE, 0.01, 2, steps, 0};
    CHECK(ct_strategy_set_schedule(s, &cos));
    int64_t start = 0;
    if (resume) {
        char latest[1024];
        ct_ckpt_info info;
        CHECK(ct_checkpoint_latest(ct_group_world(), series, latest, sizeof latest));
        if (!latest[0]) CHECK(ct_error(CT_EIO, "--resume: %s holds no checkpoint of %s", dir, series));
        CHECK(ct_checkpoint_info(ct_group_world(), latest, 1, &info));
        start = info.pos.step; /* where the data stood: here one global batch per step */
        ct_ckpt_info_fini(&info);
        CHECK(ct_checkpoint_load(s, latest, 1)); /* the weights and the optimizer state */
    }
    if (rank == 0) printf("custom_layer: %s, steps %lld to %lld\n", kind, (long long)start, (long long)until);

    float sums[2] = {0, 0}; /* loss x rows and rows over the last steps, this rank */
    for (int64_t step = start; step < until; step++) {
        int64_t first, count;
        CHECK(ct_strategy_local_rows(s, BATCH, &first, &count));
        ct_batch b = {.global_rows = BATCH, .sample0 = first};
        make_batch(step, first, count, &b.x, &b.y);
        ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = (uint64_t)step};
        ct_step_out out;
        ct_strategy_zero_grad(s);
        CHECK(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
        CHECK(ct_strategy_clip_grad_norm(s, 1.0f, 2.0, NULL));
        CHECK(ct_strategy_step(s));
        ct_tensor_release(b.x);
        ct_tensor_release(b.y);
        sums[0] += (float)out.loss_sum;
        sums[1] += (float)out.rows;
        if ((step + 1) % 5 == 0 || step + 1 == until) {
            /* Under pipe only last stages see the loss: the sums over all ranks count each row once. */
            CHECK(ct_group_allreduce(ct_group_world(), sums, 2, CT_F32, CT_OP_SUM, NULL));
            if (rank == 0) printf("step %lld loss %.6f\n", (long long)step + 1, sums[0] / sums[1]);
            sums[0] = sums[1] = 0;
        }
    }

    /* The data position (one global batch per step of an endless stream here)
     * and, in the metadata, whatever the program wants back on resume. */
    ct_ckpt_position pos = {.step = until, .epoch = 0, .position = until};
    ct_meta meta = {0};
    CHECK(ct_meta_set(&meta, "custom_layer.strategy", "%s", kind));
    CHECK(ct_checkpoint_save(s, series, &meta, &pos, &save_opts));
    ct_meta_fini(&meta);
    char saved[1024];
    ct_checkpoint_series_path(series, until, saved, sizeof saved);
    /* A fingerprint of the weights, to compare runs: the sum of |w| over the saved state. */
    ct_state st;
    CHECK(ct_strategy_model_state(s, &st));
    double l1 = 0;
    for (int i = 0; rank == 0 && i < st.n; i++)
        for (int64_t j = 0; j < st.tensors[i]->numel; j++) l1 += fabs((double)ct_f32(st.tensors[i])[j]);
    ct_state_fini(&st);
    if (rank == 0) printf("saved %s: weights l1 %.9g\n", saved, l1);

    ct_strategy_destroy(s); /* before the model it borrows, and before ct_comm_finalize */
    ct_module_destroy(model);
    ct_comm_finalize();
    return 0;
}

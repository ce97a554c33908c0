/*
 * A model with a layer of your own, trained under any strategy, saved and
 * resumed: the library's public API only.
 *
 *   custom_layer STRATEGY DIR STEPS [--until K] [--resume]
 *   mpirun -np 2 build/examples/custom_layer fsdp /tmp/run 40 --until 20
 *   mpirun -np 2 build/examples/custom_layer fsdp /tmp/run 40 --resume
 *
 * The layer is RMSNorm (y = x / sqrt(mean(x^2) + eps) * weight), with a
 * forward that saves what its backward needs in the call's record, a
 * backward that accumulates its weight's gradient and returns the input's,
 * an init, and an out_shape (pipe sizes the activations between stages with
 * it).  The data are synthetic: the label of x is the argmax of a fixed
 * projection of x, so the loss falls within a few steps.  Each step's global
 * batch is the same whatever the number of ranks; each rank takes its rows
 * with ct_strategy_local_rows (under pipe, the stages of one pipeline must
 * get the same rows).  At the end every rank takes part in the state calls
 * (they are collective), and rank 0 writes DIR/model.safetensors (a
 * PyTorch state_dict) and DIR/optim.safetensors; --resume loads them and
 * continues from the optimizer's step, to the same numbers as one run
 * (STEPS is the learning-rate schedule's length; --until K stops at K).
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

/* Collective: every rank asks for the state; rank 0 writes it. */
static ct_status save_state(ct_strategy *s, const char *path, int optim, int rank)
{
    ct_state st;
    ct_status rc = optim ? ct_strategy_optim_state(s, &st) : ct_strategy_model_state(s, &st);
    if (rc == CT_OK && rank == 0)
        rc = ct_safetensors_save(path, (const char *const *)st.names, st.tensors, st.n, NULL, NULL, 0);
    ct_state_fini(&st);
    return ct_group_check(ct_strategy_group(s), rc); /* one rank's failure is every rank's */
}

/* Every rank reads the whole file: any world size and strategy can load it. */
static ct_status load_state(ct_strategy *s, const char *path, int optim)
{
    ct_safetensors *f;
    CT_TRY(ct_safetensors_load(path, &f));
    int n = ct_safetensors_count(f);
    const char **names = malloc(sizeof *names * (size_t)n);
    ct_tensor **ts = malloc(sizeof *ts * (size_t)n);
    for (int i = 0; names && ts && i < n; i++) {
        names[i] = ct_safetensors_name(f, i);
        ts[i] = ct_safetensors_tensor(f, i);
    }
    ct_status rc = names && ts ? ct_strategy_load_state(s, names, ts, n, optim) : CT_ENOMEM;
    free(names);
    free(ts);
    ct_safetensors_destroy(f);
    return rc;
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
    for (int i = 4; i < argc; i++) {
        if (!strcmp(argv[i], "--resume")) resume = 1;
        else if (!strcmp(argv[i], "--until") && i + 1 < argc) until = atoll(argv[++i]);
    }
    char model_path[1024], optim_path[1024];
    snprintf(model_path, sizeof model_path, "%s/model.safetensors", dir);
    snprintf(optim_path, sizeof optim_path, "%s/optim.safetensors", dir);

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
    if (resume) {
        CHECK(load_state(s, model_path, 0));
        CHECK(load_state(s, optim_path, 1));
    }
    int64_t start = ct_optim_get_step(ct_strategy_optim(s));
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

    CHECK(save_state(s, model_path, 0, rank));
    CHECK(save_state(s, optim_path, 1, rank));
    /* A fingerprint of the weights, to compare runs: the sum of |w| over the saved state. */
    ct_state st;
    CHECK(ct_strategy_model_state(s, &st));
    double l1 = 0;
    for (int i = 0; rank == 0 && i < st.n; i++)
        for (int64_t j = 0; j < st.tensors[i]->numel; j++) l1 += fabs((double)ct_f32(st.tensors[i])[j]);
    ct_state_fini(&st);
    if (rank == 0) printf("saved %s: weights l1 %.9g\n", model_path, l1);

    ct_strategy_destroy(s); /* before the model it borrows, and before ct_comm_finalize */
    ct_module_destroy(model);
    ct_comm_finalize();
    return 0;
}

/*
 * bench/ddp: one DDP training step on the reference model, split into
 * forward, backward, waiting on communication and optimizer, with the
 * overlap achieved (the share of allreduce time hidden behind backward).
 * Reference: an MLP of 8 x (Linear(1024,1024) + ReLU), batch 64 per rank,
 * AdamW, 2 ranks, one BLAS thread per rank, cross-entropy over 1024 classes.
 *
 *   bench/ddp [--steps N] [--warmup N] [--trace FILE] [--compress bf16|f16] [--bucket-cap-mb X]
 *             [--strategy ddp|zero1|zero2] [--opt KEY=VALUE]...
 *
 * --strategy times the same loop under another strategy (bench/compare-pytorch
 * runs zero1 and zero2 against PyTorch's ZeroRedundancyOptimizer this way;
 * --bucket-cap-mb is a DDP and zero1 option only); --opt passes any option
 * of the strategy (ct_strategy_help), e.g. --opt reduce_buffer_mb=64 for
 * zero2.  Started without mpirun it re-launches itself on 2 ranks.  The last
 * line is machine-readable: "ctrain_<strategy> step_ms=<median> ..."
 * ("ctrain_ddp step_ms=..." by default).
 */
#include <stdlib.h>
#include <string.h>

#include "ctrain/ctrain.h"
#include "bench.h"

#define WIDTH 1024
#define DEPTH 8
#define BATCH 64

static void check(ct_status s, const char *what)
{
    if (s != CT_OK) ct_comm_abort("%s failed: %s", what, ct_last_error());
}

int main(int argc, char **argv)
{
    ct_blas_select_kernel(argc, argv); /* measure the fast kernel, as ctrain runs it */
    bench_relaunch_under_mpirun(argc, argv, 2);
    int steps = 20, warmup = 3;
    const char *trace = NULL, *kind = "ddp";
    char so[256] = "";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--trace") && i + 1 < argc) trace = argv[++i];
        else if (!strcmp(argv[i], "--strategy") && i + 1 < argc) kind = argv[++i];
        else if (!strcmp(argv[i], "--opt") && i + 1 < argc)
            snprintf(so + strlen(so), sizeof so - strlen(so), ",%s", argv[++i]);
        else if (!strcmp(argv[i], "--bucket-cap-mb") && i + 1 < argc) snprintf(so + strlen(so), sizeof so - strlen(so), ",bucket_cap_mb=%s", argv[++i]);
        else if (!strcmp(argv[i], "--compress") && i + 1 < argc)
            snprintf(so + strlen(so), sizeof so - strlen(so), ",reduce_dtype=%s", argv[++i]);
        else if (!strcmp(argv[i], "--mixed") && i + 1 < argc)
            snprintf(so + strlen(so), sizeof so - strlen(so), ",param_dtype=%s", argv[++i]);
        else {
            fprintf(stderr, "usage: bench/ddp [--steps N] [--warmup N] [--trace FILE] "
                            "[--compress bf16|f16] [--mixed bf16] [--bucket-cap-mb X] "
                            "[--strategy ddp|zero1|zero2] [--opt KEY=VALUE]\n");
            return 2;
        }
    }
    check(ct_comm_init(&argc, &argv), "ct_comm_init");
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_blas_set_threads(1);

    ct_module *m = ct_sequential_create();
    for (int l = 0; l < DEPTH; l++) {
        check(ct_module_add(m, NULL, ct_linear_create(WIDTH, WIDTH, 1)), "add linear");
        check(ct_module_add(m, NULL, ct_relu_create()), "add relu");
    }
    ct_module_init_params(m, 1);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    check(ct_strategy_create(kind, m, &oo, g, so, &s), kind);

    ct_tensor *x = ct_tensor_create2(BATCH, WIDTH, CT_MEM_ACT);
    ct_tensor *y = ct_tensor_create(CT_I32, 1, (int64_t[]){BATCH}, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 7, (uint64_t)rank);
    ct_rng_normal(&r, ct_f32(x), (size_t)x->numel, 0, 1);
    for (int i = 0; i < BATCH; i++) ((int32_t *)ct_tensor_data(y))[i] = (i * 37 + rank) % WIDTH;

    double *t_step = calloc((size_t)steps, sizeof(double)), *t_f = calloc((size_t)steps, sizeof(double)),
           *t_b = calloc((size_t)steps, sizeof(double)), *t_w = calloc((size_t)steps, sizeof(double)),
           *t_o = calloc((size_t)steps, sizeof(double)), *t_ov = calloc((size_t)steps, sizeof(double));
    for (int it = 0; it < warmup + steps; it++) {
        if (trace && it == warmup) ct_trace_enable(rank);
        double t0 = ct_now();
        ct_tensor *logits, *dl;
        ct_record *rec;
        float loss;
        ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = (uint64_t)it};
        check(ct_strategy_forward(s, x, &logits, &rec, &ctx), "forward");
        double l0 = ct_now();
        check(ct_cross_entropy(logits, y, -100, &loss, &dl), "loss");
        ct_trace_event("loss", "step", l0, ct_now(), 0);
        check(ct_strategy_backward(s, dl, rec), "backward");
        check(ct_strategy_step(s), "step");
        double z0 = ct_now();
        ct_strategy_zero_grad(s);
        ct_tensor_release(logits);
        ct_tensor_release(dl);
        double t1 = ct_now();
        ct_trace_event("zero_grad", "step", z0, t1, 0);
        if (it >= warmup) {
            ct_step_stats st = ct_strategy_stats(s);
            int k = it - warmup;
            t_step[k] = t1 - t0;
            t_f[k] = st.forward;
            t_b[k] = st.backward;
            t_w[k] = st.comm_wait;
            t_o[k] = st.optimizer;
            t_ov[k] = st.overlap;
        }
    }
    ct_step_stats last = ct_strategy_stats(s);
    if (trace) {
        char path[4096];
        snprintf(path, sizeof path, "%s.rank%d.json", trace, rank);
        check(ct_trace_write(path), "trace");
    }
    if (rank == 0) {
        printf("ctrain %s, %d ranks, MLP %d x Linear(%d,%d)+ReLU, batch %d/rank, AdamW, 1 BLAS thread/rank "
               "(%s), %d buckets, reduce %s, compute %s\n", kind, world, DEPTH, WIDTH, WIDTH, BATCH, ct_blas_corename(),
               last.nbuckets, ct_strategy_opt(s, "reduce_dtype"), ct_strategy_opt(s, "param_dtype"));
        double fw = median(t_f, steps), bw = median(t_b, steps), wt = median(t_w, steps),
               op = median(t_o, steps), ov = median(t_ov, steps), st = median(t_step, steps);
        printf("  forward   %8.2f ms\n  backward  %8.2f ms  (allreduce runs during it)\n"
               "  comm wait %8.2f ms\n  optimizer %8.2f ms\n  step      %8.2f ms (median of %d)\n"
               "  overlap   %8.0f %% of allreduce time hidden behind backward\n",
               fw * 1e3, bw * 1e3, wt * 1e3, op * 1e3, st * 1e3, steps, ov * 100);
        printf("ctrain_%s step_ms=%.3f forward_ms=%.3f backward_ms=%.3f wait_ms=%.3f optim_ms=%.3f overlap=%.3f\n",
               kind, st * 1e3, fw * 1e3, bw * 1e3, wt * 1e3, op * 1e3, ov);
    }
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
    free(t_step); free(t_f); free(t_b); free(t_w); free(t_o); free(t_ov);
    ct_comm_finalize();
    return 0;
}

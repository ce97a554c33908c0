/*
 * bench/gemm: how close the linear layer comes to raw BLAS.  A Linear(1024,
 * 1024) on a batch of 64 runs forward and backward through
 * ct_module_forward / ct_module_backward (records, output allocation, bias,
 * hooks machinery and all), next to bare ct_sgemm calls of the same three
 * shapes the layer uses:
 *   forward  y  = x W^T    NT  64 x 1024 x 1024
 *   backward dW += dy^T x  TN  1024 x 1024 x 64
 *            dx = dy W     NN  64 x 1024 x 1024
 * Layer and raw runs are interleaved rep by rep so that load from other
 * processes hits both alike; GFLOP/s are from the median times over the
 * reps after a warm-up, and the ratio (layer GFLOP/s over sgemm GFLOP/s) is
 * the median of the per-rep ratios, which is steadier on a shared machine.
 * Runs with 1 BLAS thread and with the default thread count.
 *
 *   bench/gemm [--reps N] [--warmup N]
 *
 * The last line is machine-readable: "ctrain_gemm ratio_fwd_1t=... ...".
 * The target is ratio >= 0.8.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctrain/ctrain.h"
#include "bench.h"

#define IN 1024
#define OUT 1024
#define BATCH 64

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void check(ct_status s, const char *what)
{
    if (s != CT_OK) {
        fprintf(stderr, "bench/gemm: %s failed: %s\n", what, ct_last_error());
        exit(1);
    }
}

static void fill(float *p, size_t n, uint64_t seed)
{
    ct_rng r;
    ct_rng_init(&r, seed, 0);
    ct_rng_normal(&r, p, n, 0.0f, 1.0f);
}

typedef struct {
    double layer_fwd, layer_bwd, raw_nt, raw_tn, raw_nn, raw_bwd; /* medians, seconds */
    double ratio_fwd, ratio_bwd, ratio_all; /* medians of per-rep raw/layer time ratios */
} timings;

static timings run(ct_module *lin, ct_tensor *x, ct_tensor *dy, int reps, int warmup)
{
    /* Raw operands, separate from the layer's so neither warms the other's cache unfairly. */
    float *w = ct_alloc_zeroed((size_t)OUT * IN * sizeof(float), CT_MEM_OTHER);
    float *gw = ct_alloc_zeroed((size_t)OUT * IN * sizeof(float), CT_MEM_OTHER);
    float *xr = ct_alloc_zeroed((size_t)BATCH * IN * sizeof(float), CT_MEM_OTHER);
    float *dyr = ct_alloc_zeroed((size_t)BATCH * OUT * sizeof(float), CT_MEM_OTHER);
    float *y = ct_alloc_zeroed((size_t)BATCH * OUT * sizeof(float), CT_MEM_OTHER);
    float *dx = ct_alloc_zeroed((size_t)BATCH * IN * sizeof(float), CT_MEM_OTHER);
    if (!w || !gw || !xr || !dyr || !y || !dx) check(CT_ENOMEM, "allocation");
    fill(w, (size_t)OUT * IN, 1);
    fill(xr, (size_t)BATCH * IN, 2);
    fill(dyr, (size_t)BATCH * OUT, 3);

    int n = reps + warmup;
    double *lf = malloc(sizeof(double) * (size_t)n * 9);
    double *lb = lf + n, *nt = lb + n, *tn = nt + n, *nn = tn + n, *rb = nn + n;
    double *qf = rb + n, *qb = qf + n, *qa = qb + n;
    ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = 0};
    for (int i = 0; i < n; i++) {
        double t0 = now();
        ct_sgemm(0, 1, BATCH, OUT, IN, 1.0f, xr, IN, w, IN, 0.0f, y, OUT);
        double t1 = now();
        ct_tensor *out, *din;
        ct_record *rec;
        check(ct_module_forward(lin, x, &out, &rec, &ctx), "linear forward");
        double t2 = now();
        ct_sgemm(1, 0, OUT, IN, BATCH, 1.0f, dyr, OUT, xr, IN, 1.0f, gw, IN);
        double t3 = now();
        ct_sgemm(0, 0, BATCH, IN, OUT, 1.0f, dyr, OUT, w, IN, 0.0f, dx, IN);
        double t4 = now();
        check(ct_module_backward(lin, dy, &din, rec), "linear backward");
        double t5 = now();
        ct_tensor_release(din);
        ct_tensor_release(out);
        nt[i] = t1 - t0;
        lf[i] = t2 - t1;
        tn[i] = t3 - t2;
        nn[i] = t4 - t3;
        rb[i] = t4 - t2;
        lb[i] = t5 - t4;
        /* Paired ratios: a burst of load from elsewhere hits a rep's layer and raw runs alike. */
        qf[i] = nt[i] / lf[i];
        qb[i] = rb[i] / lb[i];
        qa[i] = (nt[i] + rb[i]) / (lf[i] + lb[i]);
    }
    timings t = {median(lf + warmup, reps), median(lb + warmup, reps), median(nt + warmup, reps),
                 median(tn + warmup, reps), median(nn + warmup, reps), median(rb + warmup, reps),
                 median(qf + warmup, reps), median(qb + warmup, reps), median(qa + warmup, reps)};
    free(lf);
    ct_free(w);
    ct_free(gw);
    ct_free(xr);
    ct_free(dyr);
    ct_free(y);
    ct_free(dx);
    return t;
}

int main(int argc, char **argv)
{
    ct_blas_select_kernel(argc, argv); /* measure the fast kernel, as ctrain runs it */
    int reps = 200, warmup = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench/gemm [--reps N] [--warmup N]\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (warmup < 0) warmup = 0;
    int default_threads = ct_blas_get_threads();

    ct_module *lin = ct_linear_create(IN, OUT, 1);
    if (!lin) check(CT_ENOMEM, "ct_linear_create");
    ct_module_init_params(lin, 42);
    ct_tensor *x = ct_tensor_create2(BATCH, IN, CT_MEM_ACT), *dy = ct_tensor_create2(BATCH, OUT, CT_MEM_ACT);
    if (!x || !dy) check(CT_ENOMEM, "inputs");
    fill(ct_f32(x), (size_t)x->numel, 4);
    fill(ct_f32(dy), (size_t)dy->numel, 5);

    const double flop = 2.0 * BATCH * IN * OUT; /* one product */
    printf("Linear(%d, %d) + bias, batch %d; BLAS kernel %s (%s); median of %d reps after %d warm-up\n",
           IN, OUT, BATCH, ct_blas_corename(), ct_blas_kernel_source(), reps, warmup);
    printf("%-8s %-9s %14s %14s %8s\n", "threads", "pass", "layer GFLOP/s", "sgemm GFLOP/s", "ratio");
    int tcount[2] = {1, default_threads};
    double ratio[2][3] = {{0}};
    int nt = default_threads > 1 ? 2 : 1;
    for (int k = 0; k < nt; k++) {
        ct_blas_set_threads(tcount[k]);
        timings t = run(lin, x, dy, reps, warmup);
        double lf = flop / t.layer_fwd * 1e-9, rf = flop / t.raw_nt * 1e-9;
        double lb = 2 * flop / t.layer_bwd * 1e-9, rb = 2 * flop / t.raw_bwd * 1e-9;
        double la = 3 * flop / (t.layer_fwd + t.layer_bwd) * 1e-9;
        double ra = 3 * flop / (t.raw_nt + t.raw_bwd) * 1e-9;
        ratio[k][0] = t.ratio_fwd;
        ratio[k][1] = t.ratio_bwd;
        ratio[k][2] = t.ratio_all;
        printf("%-8d %-9s %14.1f %14.1f %8.3f   (sgemm NT %.3f ms)\n", tcount[k], "forward", lf, rf,
               ratio[k][0], t.raw_nt * 1e3);
        printf("%-8d %-9s %14.1f %14.1f %8.3f   (sgemm TN %.3f ms + NN %.3f ms)\n", tcount[k],
               "backward", lb, rb, ratio[k][1], t.raw_tn * 1e3, t.raw_nn * 1e3);
        printf("%-8d %-9s %14.1f %14.1f %8.3f\n", tcount[k], "fwd+bwd", la, ra, ratio[k][2]);
    }
    ct_blas_set_threads(default_threads);
    printf("ctrain_gemm ratio_fwd_1t=%.3f ratio_bwd_1t=%.3f ratio_fwd_%dt=%.3f ratio_bwd_%dt=%.3f "
           "target=0.8\n", ratio[0][0], ratio[0][1], tcount[nt - 1], ratio[nt - 1][0],
           tcount[nt - 1], ratio[nt - 1][1]);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(lin);
    return 0;
}

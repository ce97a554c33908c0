/*
 * bench/gemm: the linear layer's products in f32 and bf16.  For a
 * Linear(1024, 1024) at batch 64 and 256 it times, in the same run:
 *
 * 1. the three raw products the layer makes, on each engine side by side:
 *      forward  y  = x W^T    NT  B x 1024 x 1024
 *      backward dW += dy^T x  TN  1024 x 1024 x B
 *               dx = dy W     NN  B x 1024 x 1024
 *    through OpenBLAS sgemm, oneDNN f32 and oneDNN bf16 (bf16 operands,
 *    f32 accumulation and output);
 * 2. the layer itself through ct_module_forward / ct_module_backward
 *    (records, output allocation, bias, casts and all), once in f32 and
 *    once with a bf16 compute copy of the weight.
 *
 * Everything is interleaved rep by rep so that load from other processes
 * hits all variants alike; GFLOP/s are from median times over the reps after
 * a warm-up, and ratios are medians of the per-rep ratios, which are
 * steadier on a shared machine.  One BLAS/oneDNN thread by default, as each
 * rank trains.
 *
 *   bench/gemm [--reps N] [--warmup N] [--threads N] [--gpt]
 *
 * --gpt times instead the bf16 products of a step of the 12 x 768 GPT
 * (context 256, batch 8: 2048 rows) through ct_gemm_bf16, as its layers
 * call them: each linear's forward (bias added), weight gradient and input
 * gradient, with the oneDNN kernel each one runs on.
 *
 * The last line is machine-readable: "ctrain_gemm bf16_over_f32_b64=... ...".
 * Targets: the bf16 layer's forward+backward at least 2x the f32 layer's
 * GFLOP/s; each layer within 0.8 of its raw products.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctrain/ctrain.h"
#include "bench.h"

#define IN 1024
#define OUT 1024

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

static void *alloc(size_t bytes)
{
    void *p = ct_alloc(bytes, CT_MEM_OTHER);
    if (!p) check(CT_ENOMEM, "allocation");
    return p;
}

enum { E_SGEMM, E_DNNL32, E_BF16, NENG };
enum { P_FWD, P_DW, P_DX, NPROD };
static const char *eng_name[NENG] = {"sgemm", "oneDNN f32", "oneDNN bf16"};

/* One product p of the layer at batch B on engine e, on the raw operands. */
typedef struct {
    float *w, *gw, *x, *dy, *y, *dx;
    uint16_t *wh, *xh, *dyh;
} operands;

static void product(int e, int p, int B, const operands *o)
{
    static const ct_gemm_engine f32e[] = {CT_GEMM_OPENBLAS, CT_GEMM_ONEDNN};
    ct_status s;
    if (p == P_FWD)
        s = e == E_BF16 ? ct_gemm_bf16(0, 1, B, OUT, IN, 1.0f, o->xh, IN, o->wh, IN, 0.0f, o->y, OUT)
                        : ct_gemm_f32(f32e[e], 0, 1, B, OUT, IN, 1.0f, o->x, IN, o->w, IN, 0.0f, o->y, OUT);
    else if (p == P_DW)
        s = e == E_BF16 ? ct_gemm_bf16(1, 0, OUT, IN, B, 1.0f, o->dyh, OUT, o->xh, IN, 1.0f, o->gw, IN)
                        : ct_gemm_f32(f32e[e], 1, 0, OUT, IN, B, 1.0f, o->dy, OUT, o->x, IN, 1.0f, o->gw, IN);
    else
        s = e == E_BF16 ? ct_gemm_bf16(0, 0, B, IN, OUT, 1.0f, o->dyh, OUT, o->wh, IN, 0.0f, o->dx, IN)
                        : ct_gemm_f32(f32e[e], 0, 0, B, IN, OUT, 1.0f, o->dy, OUT, o->w, IN, 0.0f, o->dx, IN);
    check(s, eng_name[e]);
}

typedef struct {
    double raw[NENG][NPROD];       /* median seconds */
    double raw_ratio[NENG][NPROD]; /* median of per-rep sgemm time / engine time */
    double layer[2][2];            /* [f32, bf16][fwd, bwd] median seconds */
    double bf16_over_f32;          /* median per-rep f32 layer time / bf16 layer time, fwd+bwd */
    double bf16_over_sgemm;        /* median per-rep raw sgemm time / bf16 layer time, fwd+bwd */
    double overhead[2];            /* median per-rep raw time / layer time, [f32, bf16], fwd+bwd */
} result;

/* Forward and backward of the layer; returns the two durations. */
static void layer_step(ct_module *lin, ct_tensor *x, ct_tensor *dy, double *tf, double *tb)
{
    ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = 0, .sample0 = 0};
    ct_tensor *out, *din;
    ct_record *rec;
    double t0 = now();
    check(ct_module_forward(lin, x, &out, &rec, &ctx), "linear forward");
    double t1 = now();
    check(ct_module_backward(lin, dy, &din, rec), "linear backward");
    double t2 = now();
    ct_tensor_release(din);
    ct_tensor_release(out);
    *tf = t1 - t0;
    *tb = t2 - t1;
}

static result run(int B, int reps, int warmup)
{
    operands o;
    o.w = alloc((size_t)OUT * IN * sizeof(float));
    o.gw = alloc((size_t)OUT * IN * sizeof(float));
    o.x = alloc((size_t)B * IN * sizeof(float));
    o.dy = alloc((size_t)B * OUT * sizeof(float));
    o.y = alloc((size_t)B * OUT * sizeof(float));
    o.dx = alloc((size_t)B * IN * sizeof(float));
    o.wh = alloc((size_t)OUT * IN * 2);
    o.xh = alloc((size_t)B * IN * 2);
    o.dyh = alloc((size_t)B * OUT * 2);
    fill(o.w, (size_t)OUT * IN, 1);
    fill(o.x, (size_t)B * IN, 2);
    fill(o.dy, (size_t)B * OUT, 3);
    ct_f32_to_bf16_n(o.w, o.wh, (size_t)OUT * IN);
    ct_f32_to_bf16_n(o.x, o.xh, (size_t)B * IN);
    ct_f32_to_bf16_n(o.dy, o.dyh, (size_t)B * OUT);

    /* Two layers with the same weights: one f32, one with a bf16 compute copy. */
    ct_module *lin[2];
    for (int l = 0; l < 2; l++) {
        lin[l] = ct_linear_create(IN, OUT, 1);
        if (!lin[l]) check(CT_ENOMEM, "ct_linear_create");
        ct_module_init_params(lin[l], 42);
    }
    ct_param *W = lin[1]->params[0];
    W->compute = ct_tensor_create(CT_BF16, 2, W->data->shape, CT_MEM_PARAM);
    if (!W->compute) check(CT_ENOMEM, "compute copy");
    ct_f32_to_bf16_n(ct_f32(W->data), ct_tensor_data(W->compute), (size_t)W->data->numel);
    ct_tensor *x = ct_tensor_create2(B, IN, CT_MEM_ACT), *dy = ct_tensor_create2(B, OUT, CT_MEM_ACT);
    if (!x || !dy) check(CT_ENOMEM, "inputs");
    fill(ct_f32(x), (size_t)x->numel, 4);
    fill(ct_f32(dy), (size_t)dy->numel, 5);

    int n = reps + warmup;
    /* Per rep: 9 raw times, 4 layer times, 6 ratios. */
    enum { NSER = NENG * NPROD + 4 + NENG * NPROD + 4 };
    double *v = malloc(sizeof(double) * (size_t)n * NSER);
    if (!v) check(CT_ENOMEM, "timings");
#define SER(k) (v + (size_t)(k) * n)
    for (int i = 0; i < n; i++) {
        double t[NENG][NPROD], lt[2][2];
        for (int p = 0; p < NPROD; p++)
            for (int e = 0; e < NENG; e++) {
                double t0 = now();
                product(e, p, B, &o);
                t[e][p] = now() - t0;
            }
        for (int l = 0; l < 2; l++) layer_step(lin[l], x, dy, &lt[l][0], &lt[l][1]);
        int k = 0;
        for (int e = 0; e < NENG; e++)
            for (int p = 0; p < NPROD; p++) SER(k++)[i] = t[e][p];
        for (int l = 0; l < 2; l++)
            for (int p = 0; p < 2; p++) SER(k++)[i] = lt[l][p];
        for (int e = 0; e < NENG; e++)
            for (int p = 0; p < NPROD; p++) SER(k++)[i] = t[E_SGEMM][p] / t[e][p];
        double f32_layer = lt[0][0] + lt[0][1], bf16_layer = lt[1][0] + lt[1][1];
        double sgemm = t[E_SGEMM][0] + t[E_SGEMM][1] + t[E_SGEMM][2];
        /* The f32 layer's raw products run on the engine it picks for each shape. */
        double f32_raw = 0;
        for (int p = 0; p < NPROD; p++) {
            static const int sh[NPROD][3] = {{0, 1, 0}, {1, 0, 1}, {0, 0, 0}};
            int m = p == P_DW ? OUT : B, nn = p == P_DW ? IN : p == P_FWD ? OUT : IN;
            int kk = p == P_DW ? B : p == P_FWD ? IN : OUT;
            int e = ct_gemm_f32_engine(sh[p][0], sh[p][1], m, nn, kk) == CT_GEMM_ONEDNN ? E_DNNL32 : E_SGEMM;
            f32_raw += t[e][p];
        }
        double bf16_raw = t[E_BF16][0] + t[E_BF16][1] + t[E_BF16][2];
        SER(k++)[i] = f32_layer / bf16_layer;
        SER(k++)[i] = sgemm / bf16_layer;
        SER(k++)[i] = f32_raw / f32_layer;
        SER(k++)[i] = bf16_raw / bf16_layer;
    }
    result r;
    int k = 0;
    for (int e = 0; e < NENG; e++)
        for (int p = 0; p < NPROD; p++) r.raw[e][p] = median(SER(k++) + warmup, reps);
    for (int l = 0; l < 2; l++)
        for (int p = 0; p < 2; p++) r.layer[l][p] = median(SER(k++) + warmup, reps);
    for (int e = 0; e < NENG; e++)
        for (int p = 0; p < NPROD; p++) r.raw_ratio[e][p] = median(SER(k++) + warmup, reps);
    r.bf16_over_f32 = median(SER(k++) + warmup, reps);
    r.bf16_over_sgemm = median(SER(k++) + warmup, reps);
    r.overhead[0] = median(SER(k++) + warmup, reps);
    r.overhead[1] = median(SER(k++) + warmup, reps);
#undef SER
    free(v);
    ct_tensor_release(W->compute);
    W->compute = NULL;
    for (int l = 0; l < 2; l++) ct_module_destroy(lin[l]);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_free(o.w);
    ct_free(o.gw);
    ct_free(o.x);
    ct_free(o.dy);
    ct_free(o.y);
    ct_free(o.dx);
    ct_free(o.wh);
    ct_free(o.xh);
    ct_free(o.dyh);
    return r;
}

static const char *engine_str(int ta, int tb, int m, int n, int k)
{
    return ct_gemm_f32_engine(ta, tb, m, n, k) == CT_GEMM_ONEDNN ? "oneDNN" : "OpenBLAS";
}

/* --gpt: the bf16 products of one layer of the 12 x 768 GPT at 2048 rows
 * (and the tied head's), as linear.c calls them, interleaved rep by rep. */
static int gpt_products(int reps, int warmup, int threads)
{
    enum { ROWS = 2048, NLIN = 5 };
    static const struct { const char *name; int in, out; } lin[NLIN] = {
        {"attn c_attn", 768, 2304}, {"attn c_proj", 768, 768}, {"mlp c_fc", 768, 3072},
        {"mlp c_proj", 3072, 768},  {"head (tied)", 768, 256}};
    size_t most = (size_t)ROWS * 3072;
    uint16_t *x = alloc(most * 2), *dy = alloc(most * 2), *w = alloc((size_t)3072 * 768 * 2);
    float *y = alloc(most * 4), *gw = alloc((size_t)3072 * 768 * 4), *bias = alloc(3072 * 4);
    float *tmp = alloc(most * 4);
    fill(tmp, most, 6);
    ct_f32_to_bf16_n(tmp, x, most);
    fill(tmp, most, 7);
    ct_f32_to_bf16_n(tmp, dy, most);
    ct_f32_to_bf16_n(tmp, w, (size_t)3072 * 768);
    fill(bias, 3072, 8);
    int n = reps + warmup;
    double *t = malloc(sizeof(double) * NLIN * NPROD * (size_t)n);
    if (!t) check(CT_ENOMEM, "timings");
    for (int i = 0; i < n; i++)
        for (int l = 0; l < NLIN; l++)
            for (int p = 0; p < NPROD; p++) {
                int in = lin[l].in, out = lin[l].out;
                double t0 = now();
                if (p == P_FWD) check(ct_gemm_bf16_bias(0, 1, ROWS, out, in, x, in, w, in, bias, y, 0, out), "fwd");
                else if (p == P_DW) check(ct_gemm_bf16(1, 0, out, in, ROWS, 1.0f, dy, out, x, in, 0.0f, gw, in), "dW");
                else check(ct_gemm_bf16(0, 0, ROWS, in, out, 1.0f, dy, out, w, in, 0.0f, y, in), "dx");
                t[((size_t)l * NPROD + p) * n + i] = now() - t0;
            }
    printf("bf16 products of the 12 x 768 GPT at %d rows, %d thread%s, median of %d reps after %d warm-up\n",
           ROWS, threads, threads == 1 ? "" : "s", reps, warmup);
    printf("  %-12s %-4s %-17s %9s  %s\n", "layer", "", "m x n x k", "GFLOP/s", "oneDNN kernel");
    static const char *pn[NPROD] = {"fwd", "dW", "dx"};
    double flop_all = 0, time_all = 0;
    for (int l = 0; l < NLIN; l++)
        for (int p = 0; p < NPROD; p++) {
            int in = lin[l].in, out = lin[l].out;
            int m = p == P_DW ? out : ROWS, nn = p == P_DW ? in : p == P_FWD ? out : in;
            int k = p == P_DW ? ROWS : p == P_FWD ? in : out;
            char impl[96], shape[40];
            check(ct_gemm_onednn_impl(1, p == P_DW, p == P_FWD, m, nn, k, 0.0f, impl, sizeof impl), "kernel");
            double s = median(t + ((size_t)l * NPROD + p) * n + warmup, reps), flop = 2.0 * m * nn * k;
            int times = l == NLIN - 1 ? 1 : 12; /* a step: 12 layers, one head */
            flop_all += times * flop;
            time_all += times * s;
            snprintf(shape, sizeof shape, "%s %dx%dx%d", p == P_FWD ? "NT" : p == P_DW ? "TN" : "NN", m, nn, k);
            printf("  %-12s %-4s %-17s %9.1f  %s\n", lin[l].name, pn[p], shape, flop / s * 1e-9, impl);
        }
    printf("  a step's products (12 layers and the head): %.1f GFLOP in %.1f ms, %.1f GFLOP/s\n", flop_all * 1e-9,
           time_all * 1e3, flop_all / time_all * 1e-9);
    printf("ctrain_gemm_gpt threads=%d step_gflops=%.1f step_products_ms=%.1f\n", threads, flop_all / time_all * 1e-9,
           time_all * 1e3);
    free(t);
    ct_free(x);
    ct_free(dy);
    ct_free(w);
    ct_free(y);
    ct_free(gw);
    ct_free(bias);
    ct_free(tmp);
    return 0;
}

int main(int argc, char **argv)
{
    int reps = 50, warmup = 5, threads = 1, gpt = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--gpt")) gpt = 1;
        else {
            fprintf(stderr, "usage: bench/gemm [--reps N] [--warmup N] [--threads N] [--gpt]\n");
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (warmup < 0) warmup = 0;
    ct_blas_set_threads(threads);
    if (gpt) return gpt_products(reps, warmup, threads);
    char k32[64], k16[64];
    check(ct_gemm_onednn_impl(0, 0, 1, 64, OUT, IN, 0.0f, k32, sizeof k32), "oneDNN f32");
    check(ct_gemm_onednn_impl(1, 0, 1, 64, OUT, IN, 0.0f, k16, sizeof k16), "oneDNN bf16");
    printf("Linear(%d, %d) + bias, %d thread%s; OpenBLAS kernel %s (%s); oneDNN kernels %s (f32), "
           "%s (bf16; CPU %s AVX512_BF16); median of %d reps after %d warm-up\n",
           IN, OUT, threads, threads == 1 ? "" : "s", ct_blas_corename(), ct_blas_kernel_source(),
           k32, k16, ct_cpu_has_avx512_bf16() ? "has" : "lacks (emulated)", reps, warmup);

    static const int batches[2] = {64, 256};
    double bf16_over_f32[2], bf16_over_sgemm[2], overhead[2][2];
    for (int bi = 0; bi < 2; bi++) {
        int B = batches[bi];
        result r = run(B, reps, warmup);
        double flop = 2.0 * B * IN * OUT; /* one product */
        printf("\nbatch %d: raw products, GFLOP/s (and speed-up over sgemm)\n", B);
        printf("  %-20s %-17s %9s %17s %17s\n", "product", "shape m x n x k", "sgemm",
               "oneDNN f32", "oneDNN bf16");
        static const char *pname[NPROD] = {"forward y=xW^T", "backward dW+=dy^Tx", "backward dx=dyW"};
        for (int p = 0; p < NPROD; p++) {
            char shape[40];
            snprintf(shape, sizeof shape, "%s %dx%dx%d", p == P_FWD ? "NT" : p == P_DW ? "TN" : "NN",
                     p == P_DW ? OUT : B, p == P_DW ? IN : p == P_FWD ? OUT : IN,
                     p == P_DW ? B : p == P_FWD ? IN : OUT);
            printf("  %-20s %-17s %9.1f %9.1f (%4.2fx) %9.1f (%4.2fx)\n", pname[p], shape,
                   flop / r.raw[E_SGEMM][p] * 1e-9, flop / r.raw[E_DNNL32][p] * 1e-9,
                   r.raw_ratio[E_DNNL32][p], flop / r.raw[E_BF16][p] * 1e-9, r.raw_ratio[E_BF16][p]);
        }
        printf("batch %d: the layer (ct_module_forward/backward), GFLOP/s; f32 products on %s/%s/%s "
               "(fwd/dW/dx)\n", B, engine_str(0, 1, B, OUT, IN), engine_str(1, 0, OUT, IN, B),
               engine_str(0, 0, B, IN, OUT));
        printf("  %-10s %12s %12s\n", "pass", "f32 layer", "bf16 layer");
        printf("  %-10s %12.1f %12.1f\n", "forward", flop / r.layer[0][0] * 1e-9, flop / r.layer[1][0] * 1e-9);
        printf("  %-10s %12.1f %12.1f\n", "backward", 2 * flop / r.layer[0][1] * 1e-9,
               2 * flop / r.layer[1][1] * 1e-9);
        printf("  %-10s %12.1f %12.1f\n", "fwd+bwd", 3 * flop / (r.layer[0][0] + r.layer[0][1]) * 1e-9,
               3 * flop / (r.layer[1][0] + r.layer[1][1]) * 1e-9);
        printf("  fwd+bwd: bf16 layer / f32 layer %.2fx (target >= 2), bf16 layer / raw sgemm "
               "%.2fx; layer / its raw products: f32 %.3f, bf16 %.3f (target >= 0.8)\n",
               r.bf16_over_f32, r.bf16_over_sgemm, r.overhead[0], r.overhead[1]);
        bf16_over_f32[bi] = r.bf16_over_f32;
        bf16_over_sgemm[bi] = r.bf16_over_sgemm;
        overhead[bi][0] = r.overhead[0];
        overhead[bi][1] = r.overhead[1];
    }
    printf("ctrain_gemm threads=%d bf16_over_f32_b64=%.3f bf16_over_f32_b256=%.3f "
           "bf16_over_sgemm_b64=%.3f bf16_over_sgemm_b256=%.3f layer_over_raw_f32_b64=%.3f "
           "layer_over_raw_bf16_b64=%.3f layer_over_raw_f32_b256=%.3f layer_over_raw_bf16_b256=%.3f "
           "target_bf16=2 target_layer=0.8\n",
           threads, bf16_over_f32[0], bf16_over_f32[1], bf16_over_sgemm[0], bf16_over_sgemm[1],
           overhead[0][0], overhead[0][1], overhead[1][0], overhead[1][1]);
    return 0;
}

/*
 * bench/offload: what streaming a model through a file on local disk costs.
 * A sequential of L x (Linear(W, W) + ReLU) and a Linear(W, 10), AdamW,
 * batches of R rows, one process, one BLAS thread.  For fully resident
 * training ("none") and offload at 2, 4 and 8 slices (no budget: the next
 * slice loads while this one computes), then with --max-resident-mb a
 * quarter of the model's param + grad + optim bytes (the "4x" rows, 8 and
 * 16 slices), it measures
 *   - the median step time (train step + optimizer step) and its ratio to
 *     the resident step;
 *   - the memory report's peak resident (param + grad + optim) and the
 *     process's peak RSS (each configuration runs in a fresh child process
 *     so the peaks are its own);
 *   - the offload I/O time per step and the share of it hidden behind
 *     compute, 1 - (time the step waited for I/O) / (I/O thread busy time).
 * The page cache: by default the store drops every page it reads or writes
 * (sync_file_range then posix_fadvise DONTNEED; drop_cache=1), so reads
 * come from the disk and the store costs no RAM; --cache keeps the pages
 * (drop_cache=0) to show the difference.
 *
 *   bench/offload [--width W] [--layers L] [--rows R] [--steps N] [--warmup N] [--dir DIR] [--cache]
 *
 * The last line is machine-readable: "ctrain_offload resident_ms=...
 * s2_ms=... s4_ms=... s8_ms=... q8_ms=... q16_ms=... q_best_ratio=...".
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "ctrain/ctrain.h"
#include "bench.h"

typedef struct {
    double step_ms, io_ms, hidden, resident_mb, rss_mb;
    int ahead, ok;
} row;

static int W = 1024, L = 16, R = 1024, STEPS = 5, WARM = 1, CACHE = 0;
static const char *DIR_ = "";

static ct_module *model(void)
{
    ct_module *m = ct_sequential_create();
    for (int i = 0; i < L; i++) {
        if (ct_module_add(m, NULL, ct_linear_create(W, W, 1)) || ct_module_add(m, NULL, ct_relu_create())) return NULL;
    }
    if (ct_module_add(m, NULL, ct_linear_create(W, 10, 1))) return NULL;
    ct_module_init_params(m, 1);
    return m;
}

/* One configuration in this process; fills *r. */
static int run(const char *kind, const char *opts, row *r)
{
    ct_module *m = model();
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    if (!m || ct_strategy_create(kind, m, &oo, NULL, opts, &s) != CT_OK) {
        fprintf(stderr, "%s %s: %s\n", kind, opts, ct_last_error());
        return 1;
    }
    int64_t n = R;
    ct_tensor *x = ct_tensor_create2(n, W, CT_MEM_DATA), *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_DATA);
    ct_rng g;
    ct_rng_init(&g, 5, 0);
    ct_rng_normal(&g, ct_f32(x), (size_t)(n * W), 0, 1);
    for (int64_t i = 0; i < n; i++) ((int32_t *)ct_tensor_data(y))[i] = (int32_t)(i % 10);
    ct_batch b = {x, y, n, 0};
    double t[64], io = 0, wait = 0;
    ct_mem_reset_peak();
    for (int k = 0; k < WARM + STEPS; k++) {
        ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = (uint64_t)k};
        double t0 = ct_now();
        if (ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, NULL) != CT_OK ||
            ct_strategy_step(s) != CT_OK) {
            fprintf(stderr, "%s %s: %s\n", kind, opts, ct_last_error());
            return 1;
        }
        ct_strategy_zero_grad(s);
        if (k >= WARM) {
            t[k - WARM] = ct_now() - t0;
            ct_step_stats st = ct_strategy_stats(s);
            io += st.io_total;
            wait += st.io_wait;
        }
    }
    ct_mem_report rep;
    ct_mem_report_get(&rep);
    r->step_ms = 1000 * median(t, STEPS);
    r->io_ms = 1000 * io / STEPS;
    r->hidden = io > 0 ? fmax(0, 1 - wait / io) : 1;
    r->resident_mb = (double)rep.peak_resident / 1048576.0;
    r->rss_mb = (double)rep.peak_rss / 1048576.0;
    int ns;
    ct_strategy_offload_info(s, &ns, &r->ahead);
    r->ok = 1;
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
    return 0;
}

/* Runs a configuration in a child process (its own peaks) and reads its row back. */
static row child(const char *kind, const char *opts)
{
    row r = {0};
    int fd[2];
    if (pipe(fd)) return r;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        row mine = {0};
        run(kind, opts, &mine);
        ssize_t w = write(fd[1], &mine, sizeof mine);
        _exit(w == (ssize_t)sizeof mine ? 0 : 1);
    }
    close(fd[1]);
    if (read(fd[0], &r, sizeof r) != (ssize_t)sizeof r) r.ok = 0;
    close(fd[0]);
    waitpid(pid, NULL, 0);
    return r;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--width") && i + 1 < argc) W = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--layers") && i + 1 < argc) L = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) R = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) STEPS = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) WARM = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc) DIR_ = argv[++i];
        else if (!strcmp(argv[i], "--cache")) CACHE = 1;
        else {
            fprintf(stderr, "usage: bench/offload [--width W] [--layers L] [--rows R] [--steps N] [--warmup N] "
                    "[--dir DIR] [--cache]\n");
            return 2;
        }
    }
    if (W < 1 || L < 8 || R < 1 || STEPS < 1 || STEPS > 64 || WARM < 0) {
        fprintf(stderr, "bench/offload: --width, --rows >= 1, --layers >= 8 (8 and 16 slices), 1 <= --steps <= 64\n");
        return 2;
    }
    ct_blas_set_threads(1);
    double params = (double)L * ((double)W * W + W) + (double)W * 10 + 10;
    double whole_mb = params * 16 / 1048576.0; /* param + grad + AdamW's two moments */
    int quarter = (int)floor(whole_mb / 4);
    printf("bench/offload: %d x Linear(%d, %d) + ReLU, Linear(%d, 10): %.1fM parameters, %.1f MiB of param + grad + "
           "optim; batch %d, AdamW, 1 BLAS thread; store in %s, page cache %s\n",
           L, W, W, W, params / 1e6, whole_mb, R, *DIR_ ? DIR_ : "$TMPDIR or /tmp",
           CACHE ? "kept (drop_cache=0)" : "dropped after every read and write (drop_cache=1)");
    printf("%-26s %10s %7s %9s %9s %8s %7s %6s\n", "configuration", "step ms", "x res", "resident", "peak RSS",
           "I/O ms", "hidden", "ahead");
    struct { const char *name, *kind; char opts[256]; row r; } c[6];
    static const char *const names[6] = {"resident (none)", "offload 2 slices", "offload 4 slices", "offload 8 slices",
                                         "offload 8, budget 1/4", "offload 16, budget 1/4"};
    memset(c, 0, sizeof c);
    for (int k = 0; k < 6; k++) {
        c[k].name = names[k];
        c[k].kind = k ? "offload" : "none";
    }
    int slices[6] = {0, 2, 4, 8, 8, 16};
    for (int k = 1; k < 6; k++) {
        int n = snprintf(c[k].opts, sizeof c[k].opts, "slices=%d,drop_cache=%d", slices[k], !CACHE);
        if (*DIR_) n += snprintf(c[k].opts + n, sizeof c[k].opts - (size_t)n, ",dir=%s", DIR_);
        if (k >= 4) snprintf(c[k].opts + n, sizeof c[k].opts - (size_t)n, ",max_resident_mb=%d", quarter);
    }
    double base = 0;
    for (int k = 0; k < 6; k++) {
        c[k].r = child(c[k].kind, c[k].opts);
        row *r = &c[k].r;
        if (!r->ok) {
            printf("%-26s failed (see the message above)\n", c[k].name);
            continue;
        }
        if (k == 0) base = r->step_ms;
        printf("%-26s %10.1f %7.2f %6.1f MiB %5.0f MiB %8.1f %6.0f%% %6d\n", c[k].name, r->step_ms,
               base > 0 ? r->step_ms / base : 0, r->resident_mb, r->rss_mb, r->io_ms, 100 * r->hidden,
               k ? r->ahead : 0);
    }
    double best = INFINITY;
    for (int k = 4; k < 6; k++)
        if (c[k].r.ok && base > 0) best = fmin(best, c[k].r.step_ms / base);
    printf("budget rows: max_resident_mb=%d (the model's %.1f MiB / 4); best step time %.2fx the resident step "
           "(target: within 2x)\n", quarter, whole_mb, best);
    printf("ctrain_offload resident_ms=%.1f s2_ms=%.1f s4_ms=%.1f s8_ms=%.1f q8_ms=%.1f q16_ms=%.1f q_best_ratio=%.3f\n",
           c[0].r.step_ms, c[1].r.step_ms, c[2].r.step_ms, c[3].r.step_ms, c[4].r.step_ms, c[5].r.step_ms, best);
    return 0;
}

/*
 * bench/pipe: the pipeline's bubble and memory.  A model of P equal stages
 * (each 4 x (Linear(W, W) + ReLU), W 512, the last Linear to W classes),
 * micro-batches of 16 rows, AdamW, one BLAS thread per rank, one stage per
 * rank (P = the world size), for chunks m in 1, 4, 8, 16 and both
 * schedules, it measures
 *   - the median step time (ct_strategy_train_step; the optimizer is apart);
 *   - the bubble: the fraction of the step a stage spends not computing,
 *     1 - (forward + backward + recompute time) / step time, per stage and
 *     its mean over stages, against the ideal (P-1)/(m+P-1) of equal stages
 *     (GPipe's and 1F1B's bubbles are the same; 1F1B saves memory);
 *   - every stage's peak activation bytes over the timed steps (the memory
 *     report's "act"), with checkpoint=never so the schedules' difference is
 *     what shows, and the ratio 1F1B / GPipe at the largest m.
 * --trace FILE writes one Chrome trace per rank of a step of each schedule
 * at the largest m (FILE.<schedule>.np<P>.rank<r>.json): forward, backward
 * and recompute of each micro-batch on the compute lane, waits in between.
 *
 *   bench/pipe [--np 2,4] [--chunks 1,4,8,16] [--steps N] [--warmup N] [--rows R] [--trace FILE]
 *
 * --rows sets the micro-batch (16): larger ones make each forward and
 * backward long next to the scheduler's time slices on a shared machine.
 *
 * Started without mpirun it runs itself under mpirun once per --np value.
 * 4 ranks on a 2-core machine are oversubscribed (it says so): a stage then
 * waits for a core as well as for its neighbours, which the measured bubble
 * counts.  A waiting rank naps instead of spinning when oversubscribed
 * (CTRAIN_COMM_WAIT_SPIN_US=0), so it does not take the core its neighbour
 * needs.  The last line is machine-readable: "ctrain_pipe np=P
 * m16_1f1b_bubble=... m16_1f1b_ideal=... m16_act_ratio=...".
 */
#include <math.h>
#include <string.h>
#include <sys/wait.h>

#include "ctrain/ctrain.h"
#include "bench.h"

#define WIDTH 512
#define PER_STAGE 4
#define MAX_CHUNKS 8

static void check(ct_status s, const char *what)
{
    if (s != CT_OK) ct_comm_abort("%s failed: %s", what, ct_last_error());
}

static ct_module *model(int P)
{
    ct_module *m = ct_sequential_create();
    for (int i = 0; i < P * PER_STAGE; i++) {
        check(ct_module_add(m, NULL, ct_linear_create(WIDTH, WIDTH, 1)), "add linear");
        check(ct_module_add(m, NULL, ct_relu_create()), "add relu");
    }
    ct_module_init_params(m, 1);
    return m;
}

typedef struct {
    double step_ms, bubble, act;
} meas;

/* One configuration on this rank: median step, bubble of this stage, peak act. */
static int MB_ROWS = 16;

static meas run_config(int P, const char *sched, int chunks, int steps, int warmup, const char *trace)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g);
    ct_module *m = model(P);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    char opts[256];
    snprintf(opts, sizeof opts, "stages=%d,chunks=%d,schedule=%s,checkpoint=never", P, chunks, sched);
    ct_strategy *s;
    check(ct_strategy_create("pipe", m, &oo, g, opts, &s), "ct_strategy_create pipe");
    int64_t rows = (int64_t)MB_ROWS * chunks;
    ct_tensor *x = ct_tensor_create2(rows, WIDTH, CT_MEM_DATA);
    ct_tensor *y = ct_tensor_create(CT_I32, 1, &rows, CT_MEM_DATA);
    if (!x || !y) ct_comm_abort("out of memory");
    ct_rng rng;
    ct_rng_init(&rng, 7, 0);
    ct_rng_normal(&rng, ct_f32(x), (size_t)x->numel, 0, 1);
    for (int64_t i = 0; i < rows; i++) ((int32_t *)ct_tensor_data(y))[i] = (int32_t)((i * 37) % WIDTH);
    ct_batch b = {.x = x, .y = y, .global_rows = rows};
    double *t = calloc((size_t)steps, sizeof *t), *bub = calloc((size_t)steps, sizeof *bub);
    if (!t || !bub) ct_comm_abort("out of memory");
    for (int i = 0; i < warmup + steps; i++) {
        if (i == warmup) ct_mem_reset_peak();
        int traced = trace && i == warmup + steps - 1;
        if (traced) ct_trace_enable(rank);
        ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = (uint64_t)i};
        ct_step_out out;
        check(ct_group_barrier(g), "barrier"); /* every stage starts the step together */
        double t0 = ct_now();
        check(ct_strategy_train_step(s, &b, ct_loss_cross_entropy, NULL, &ctx, &out), "train step");
        double t1 = ct_now();
        check(ct_strategy_step(s), "step");
        ct_strategy_zero_grad(s);
        if (traced) {
            char path[4096];
            snprintf(path, sizeof path, "%s.%s.np%d.rank%d.json", trace, sched, P, rank);
            check(ct_trace_write(path), "trace write");
            if (rank == 0) printf("  trace of one %s step at %d chunks: %s.%s.np%d.rank*.json\n", sched, chunks, trace, sched, P);
        }
        if (i >= warmup) {
            ct_step_stats st = ct_strategy_stats(s);
            t[i - warmup] = t1 - t0;
            bub[i - warmup] = 1.0 - (st.forward + st.backward) / (t1 - t0);
        }
    }
    meas r = {median(t, steps) * 1e3, median(bub, steps), 0};
    ct_mem_report mine;
    ct_mem_report_get(&mine);
    r.act = (double)mine.peak[CT_MEM_ACT];
    free(t);
    free(bub);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_strategy_destroy(s);
    ct_module_destroy(m);
    return r;
}

static int run_world(int argc, char **argv, int np)
{
    char npbuf[16], self[4096];
    char **av = bench_mpirun_argv(argc, argv, np, npbuf, self);
    if (!av) return 1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        execvp("mpirun", av);
        perror("cannot start mpirun (install openmpi-bin)");
        _exit(127);
    }
    free(av);
    int status = 1;
    if (pid < 0 || waitpid(pid, &status, 0) < 0) return 1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

int main(int argc, char **argv)
{
    ct_blas_select_kernel(argc, argv);
    int steps = 10, warmup = 3, chunks[MAX_CHUNKS], nch = 0;
    const char *nps = "2,4", *chs = "1,4,8,16", *trace = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--np") && i + 1 < argc) nps = argv[++i];
        else if (!strcmp(argv[i], "--chunks") && i + 1 < argc) chs = argv[++i];
        else if (!strcmp(argv[i], "--trace") && i + 1 < argc) trace = argv[++i];
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) MB_ROWS = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench/pipe [--np 2,4] [--chunks 1,4,8,16] [--steps N] [--warmup N] [--rows R] [--trace FILE]\n");
            return 2;
        }
    }
    char cbuf[256];
    snprintf(cbuf, sizeof cbuf, "%s", chs);
    for (char *c = strtok(cbuf, ","); c && nch < MAX_CHUNKS; c = strtok(NULL, ",")) chunks[nch++] = atoi(c);
    if (steps < 1 || warmup < 0 || !nch || MB_ROWS < 1) {
        fprintf(stderr, "bench/pipe: --steps and --rows must be >= 1, --warmup >= 0, --chunks a list of counts\n");
        return 2;
    }
    for (int i = 0; i < nch; i++)
        if (chunks[i] < 1) {
            fprintf(stderr, "bench/pipe: --chunks takes counts >= 1\n");
            return 2;
        }

    if (!getenv("OMPI_COMM_WORLD_SIZE")) { /* the launcher: one mpirun per world size */
        char buf[256];
        snprintf(buf, sizeof buf, "%s", nps);
        for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
            int np = atoi(t);
            if (np < 2) {
                fprintf(stderr, "bench/pipe: --np takes world sizes >= 2 (got '%s')\n", t);
                return 2;
            }
            int rc = run_world(argc, argv, np);
            if (rc) {
                fprintf(stderr, "bench/pipe: the run on %d ranks failed (exit %d)\n", np, rc);
                return 1;
            }
        }
        return 0;
    }

    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int size = atoi(getenv("OMPI_COMM_WORLD_SIZE"));
    if (size > cores && !getenv("CTRAIN_COMM_WAIT_SPIN_US")) setenv("CTRAIN_COMM_WAIT_SPIN_US", "0", 1);
    check(ct_comm_init(&argc, &argv), "ct_comm_init");
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), P = ct_group_size(g);
    ct_blas_set_threads(1);
    if (rank == 0) {
        printf("bench/pipe: %d stages of %d x (Linear(%d,%d) + ReLU), micro-batches of %d rows, AdamW, 1 BLAS "
               "thread per rank%s\n", P, PER_STAGE, WIDTH, WIDTH, MB_ROWS,
               P > cores ? " -- OVERSUBSCRIBED: more ranks than cores, times compare only with each other" : "");
        printf("  %-6s %-5s %9s %8s %8s %6s  %s\n", "chunks", "sched", "step ms", "bubble", "ideal", "ratio",
               "bubble per stage | peak act per stage");
    }
    static const char *const scheds[] = {"gpipe", "1f1b"};
    char tail[4096];
    int tl = snprintf(tail, sizeof tail, "ctrain_pipe np=%d", P);
    double act_last[2] = {0, 0};
    for (int c = 0; c < nch; c++)
        for (int k = 0; k < 2; k++) {
            meas r = run_config(P, scheds[k], chunks[c], steps, warmup, c == nch - 1 ? trace : NULL);
            double *all = calloc((size_t)P * 3, sizeof *all);
            if (!all) ct_comm_abort("out of memory");
            double mine[3] = {r.step_ms, r.bubble, r.act};
            check(ct_group_allgather(g, mine, all, (int64_t)sizeof mine, CT_U8, NULL), "allgather");
            if (rank == 0) {
                double bubble = 0, step = 0, maxact = 0;
                for (int q = 0; q < P; q++) {
                    bubble += all[3 * q + 1] / P;
                    step = fmax(step, all[3 * q]);
                    maxact = fmax(maxact, all[3 * q + 2]);
                }
                double ideal = (double)(P - 1) / (chunks[c] + P - 1);
                printf("  %-6d %-5s %9.2f %8.3f %8.3f %6.2f  ", chunks[c], scheds[k], step, bubble, ideal,
                       ideal > 0 ? bubble / ideal : 0);
                for (int q = 0; q < P; q++) printf("%s%.2f", q ? " " : "", all[3 * q + 1]);
                printf(" |");
                for (int q = 0; q < P; q++) printf(" %.0fK", all[3 * q + 2] / 1024);
                printf("\n");
                if (c == nch - 1) act_last[k] = maxact;
                tl += snprintf(tail + tl, sizeof tail - (size_t)tl, " m%d_%s_step_ms=%.3f m%d_%s_bubble=%.4f m%d_%s_ideal=%.4f "
                               "m%d_%s_act_max=%.0f", chunks[c], scheds[k], step, chunks[c], scheds[k], bubble, chunks[c],
                               scheds[k], ideal, chunks[c], scheds[k], maxact);
            }
            free(all);
        }
    if (rank == 0) {
        printf("  peak activations at %d chunks, largest stage: 1f1b / gpipe = %.2f (target <= 0.5)\n",
               chunks[nch - 1], act_last[1] / act_last[0]);
        snprintf(tail + tl, sizeof tail - (size_t)tl, " m%d_act_ratio=%.3f", chunks[nch - 1], act_last[1] / act_last[0]);
        printf("%s\n", tail);
    }
    ct_comm_finalize();
    return 0;
}

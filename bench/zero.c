/*
 * bench/zero: what ZeRO saves and what it costs.  For DDP, ZeRO-1 and ZeRO-2
 * (and FSDP when --strategy names it: a unit per Linear unless a wrap_ option
 * is given, as a PyTorch user's auto_wrap_policy would make) on the reference model (8 x (Linear(1024,1024) + ReLU), batch 64 per rank,
 * AdamW, one BLAS thread per rank, cross-entropy over 1024 classes) it
 * measures, at each world size,
 *   - every rank's peak memory per category (param, grad, optim, act, comm)
 *     and resident (the peak of param + grad + optim together) over the
 *     timed steps: ct_mem_reset_peak after the warm-up steps, then
 *     ct_strategy_memory once they are done;
 *   - the bytes per parameter of the highest rank next to the ZeRO paper's
 *     for f32 AdamW (param 4 + grad 4 + optim 8; ZeRO-1 shards the optimizer
 *     state, ZeRO-2 the gradients too):
 *         replicated 16,  zero1 8 + 8/N,  zero2 4 + 12/N,
 *     their ratio, and OK when resident and every category are within 10%
 *     of the formula (MISMATCH otherwise, with the excess; the bench does not
 *     fail on it);
 *   - the median step time: ct_strategy_train_step (forward, loss, backward
 *     and the gradient synchronisation), ct_strategy_step, zero_grad; and
 *     the medians of the strategy's own split (forward, backward, comm wait,
 *     optimizer; for ZeRO-1 and ZeRO-2 the wait for the parameters the owners
 *     broadcast after the previous step falls in forward).
 * Strategies run in alternating rounds (ddp, zero1, zero2, ddp, ...), each a
 * fresh model and strategy, so the machine's noise falls on all of them
 * alike; step times pool every round's timed steps.
 *
 *   bench/zero [--np 2,4] [--strategy ddp,zero1,zero2] [--steps N] [--warmup N]
 *              [--rounds N] [--trace FILE] [--opt KEY=VALUE]...
 *
 * Started without mpirun it runs itself under mpirun once per --np value
 * (world sizes above the machine's core count are oversubscribed; it says so,
 * and their times only compare with each other).  Under mpirun it runs at
 * that world size.  --trace writes Chrome traces of the first round's timed
 * steps, FILE.<strategy>.np<N>.rank<r>.json.  --opt passes a strategy option
 * to every strategy run (each must take it: --strategy zero2 --opt
 * reduce_buffer_mb=64).  The last line is
 * machine-readable: "ctrain_zero np2_ddp_step_ms=... np2_ddp_resident_bpp=...
 * np2_ddp_mem=OK ..." (under mpirun: "ctrain_zero np=N ddp_step_ms=...").
 */
#include <math.h>
#include <string.h>
#include <sys/wait.h>

#include "ctrain/ctrain.h"
#include "bench.h"

#define BATCH 64
#define MAX_KINDS 8
#define TOLERANCE 0.10

static int WIDTH = 1024, DEPTH = 8; /* the model: --width, --depth */

static void check(ct_status s, const char *what)
{
    if (s != CT_OK) ct_comm_abort("%s failed: %s", what, ct_last_error());
}

/* ---- launching one mpirun per world size --------------------------------- */

/* Runs `mpirun -np np <this program> args...`, copying its output through
 * and keeping its last "ctrain_zero " line in last (n bytes); returns its
 * exit status. */
static int run_world(int argc, char **argv, int np, char *last, size_t n)
{
    char npbuf[16], self[4096];
    char **av = bench_mpirun_argv(argc, argv, np, npbuf, self);
    if (!av) return 1;
    int fd[2];
    if (pipe(fd)) {
        perror("pipe");
        free(av);
        return 1;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fd[1], 1);
        close(fd[0]);
        close(fd[1]);
        setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
        setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
        execvp("mpirun", av);
        perror("cannot start mpirun (install openmpi-bin)");
        _exit(127);
    }
    free(av);
    close(fd[1]);
    if (pid < 0) {
        perror("fork");
        close(fd[0]);
        return 1;
    }
    FILE *f = fdopen(fd[0], "r");
    char line[8192];
    last[0] = 0;
    while (f && fgets(line, sizeof line, f)) {
        fputs(line, stdout);
        fflush(stdout);
        if (!strncmp(line, "ctrain_zero ", 12) && n) {
            size_t l = strlen(line) < n - 1 ? strlen(line) : n - 1;
            memcpy(last, line, l);
            last[l] = 0;
        }
    }
    if (f) fclose(f);
    int status = 1;
    if (waitpid(pid, &status, 0) < 0) return 1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}

/* "ctrain_zero np=N k=v ..." -> " npN_k=v ..." appended to out (n bytes). */
static void append_prefixed(char *out, size_t n, const char *line)
{
    int np = 0;
    const char *p = strstr(line, "np=");
    if (!p || sscanf(p, "np=%d", &np) != 1) return;
    p = strchr(p, ' ');
    while (p && *p) {
        while (*p == ' ') p++;
        size_t l = strcspn(p, " \n");
        if (!l) break;
        size_t used = strlen(out);
        snprintf(out + used, n - used, " np%d_%.*s", np, (int)l, p);
        p += l;
    }
}

/* ---- one world size ------------------------------------------------------ */

typedef struct {
    const char *kind;   /* the strategy */
    char label[128];    /* as given: KIND[:K=V;K=V...] */
    char opts[256];     /* the kind's own options (K=V,...) */
    double *t_step, *t_f, *t_b, *t_w, *t_o;
    int n;
    ct_mem_report *mem; /* [world], from the last round */
    int nbuckets;
    double inflight_mb; /* zero2's reduce_buffer_mb, else < 0 */
} result;

/* The ZeRO paper's bytes per parameter for f32 AdamW, per category (FSDP
 * is its stage 3: parameters sharded too; SHARD_GRAD_OP holds every unit's
 * parameters from forward to backward on top of the pieces). */
static double formula(const result *r, ct_mem_cat cat, int world)
{
    const char *kind = r->kind;
    int fsdp = !strcmp(kind, "fsdp");
    if (fsdp && cat == CT_MEM_PARAM && strstr(r->opts, "sharding=grad_op")) return 4 + 4.0 / world;
    int shard_optim = !strcmp(kind, "zero1") || !strcmp(kind, "zero2") || fsdp;
    int shard_grad = !strcmp(kind, "zero2") || fsdp;
    switch (cat) {
    case CT_MEM_PARAM: return fsdp ? 4.0 / world : 4;
    case CT_MEM_GRAD: return shard_grad ? 4.0 / world : 4;
    case CT_MEM_OPTIM: return shard_optim ? 8.0 / world : 8;
    default: return 0;
    }
}

static ct_module *reference_model(void)
{
    ct_module *m = ct_sequential_create();
    for (int l = 0; l < DEPTH; l++) {
        check(ct_module_add(m, NULL, ct_linear_create(WIDTH, WIDTH, 1)), "add linear");
        check(ct_module_add(m, NULL, ct_relu_create()), "add relu");
    }
    ct_module_init_params(m, 1);
    return m;
}

/* A fresh model and strategy: warm-up, reset the peaks, timed steps. */
static void run_round(result *r, const ct_batch *b, const char *opts, int steps, int warmup, const char *trace,
                      int round)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_module *m = reference_model();
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    ct_strategy *s;
    char all[1536];
    snprintf(all, sizeof all, "%s%s%s", opts, opts[0] && r->opts[0] ? "," : "", r->opts);
    /* FSDP without a wrap option would be one unit, the whole model gathered
     * at once; its formula (and a PyTorch user's auto_wrap_policy) has a unit
     * per layer, so that is the default here */
    if (!strcmp(r->kind, "fsdp") && !strstr(all, "wrap_")) {
        size_t l = strlen(all);
        snprintf(all + l, sizeof all - l, "%swrap_min_params=%d", l ? "," : "", WIDTH * WIDTH);
    }
    check(ct_strategy_create(r->kind, m, &oo, g, all, &s), r->label);
    const char *rb = ct_strategy_opt(s, "reduce_buffer_mb");
    r->inflight_mb = rb ? atof(rb) : -1;
    for (int it = 0; it < warmup + steps; it++) {
        if (it == warmup) {
            ct_mem_reset_peak();
            if (trace && round == 0) ct_trace_enable(rank);
        }
        double t0 = ct_now();
        ct_fwd_ctx ctx = {.training = 1, .seed = 1, .step = (uint64_t)it};
        check(ct_strategy_train_step(s, b, ct_loss_cross_entropy, NULL, &ctx, NULL), "train step");
        check(ct_strategy_step(s), "step");
        ct_strategy_zero_grad(s);
        double t1 = ct_now();
        if (it >= warmup) {
            ct_step_stats st = ct_strategy_stats(s);
            r->t_step[r->n] = t1 - t0;
            r->t_f[r->n] = st.forward;
            r->t_b[r->n] = st.backward;
            r->t_w[r->n] = st.comm_wait;
            r->t_o[r->n] = st.optimizer;
            r->nbuckets = st.nbuckets;
            r->n++;
        }
    }
    check(ct_strategy_memory(s, r->mem), "memory report");
    if (trace && round == 0) {
        char path[4096], key[128];
        bench_key(r->label, key, sizeof key);
        snprintf(path, sizeof path, "%s.%s.np%d.rank%d.json", trace, key, world, rank);
        check(ct_trace_write(path), "trace");
    }
    ct_strategy_destroy(s);
    ct_module_destroy(m);
    ct_mem_trim(); /* the next round's RSS is its own, not this one's cached blocks */
}

static double mib(size_t b) { return (double)b / 1048576.0; }

static size_t max_over_ranks(const ct_mem_report *all, int world, int cat)
{
    size_t v = 0;
    for (int r = 0; r < world; r++) {
        size_t x = cat < 0 ? all[r].peak_resident : all[r].peak[cat];
        if (x > v) v = x;
    }
    return v;
}

static void report(result *res, int nk, int world, int64_t nparams)
{
    static const ct_mem_cat cats[] = {CT_MEM_PARAM, CT_MEM_GRAD, CT_MEM_OPTIM};
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    printf("ctrain sharding, %d ranks%s, MLP %d x Linear(%d,%d)+ReLU (%lld parameters), batch %d/rank, AdamW, "
           "1 BLAS thread/rank (%s)\n", world,
           cores > 0 && world > cores ? " OVERSUBSCRIBED on fewer cores (times compare only at this size)" : "",
           DEPTH, WIDTH, WIDTH, (long long)nparams, BATCH, ct_blas_corename());
    printf("peak MiB per rank over the %d timed steps:\n", res[0].n);
    printf("  %-8s %4s %9s %9s %9s %9s %9s %9s %9s\n", "strategy", "rank", "param", "grad", "optim", "act", "comm",
           "resident", "rss");
    for (int k = 0; k < nk; k++)
        for (int r = 0; r < world; r++) {
            const ct_mem_report *m = &res[k].mem[r];
            printf("  %-8s %4d %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n", res[k].label, r,
                   mib(m->peak[CT_MEM_PARAM]), mib(m->peak[CT_MEM_GRAD]), mib(m->peak[CT_MEM_OPTIM]),
                   mib(m->peak[CT_MEM_ACT]), mib(m->peak[CT_MEM_COMM]), mib(m->peak_resident), mib(m->peak_rss));
        }
    printf("bytes per parameter, highest rank, measured/formula (ZeRO paper, f32 AdamW: param 4 + grad 4 + "
           "optim 8;\nreplicated 16, zero1 8 + 8/N, zero2 4 + 12/N), check within %.0f%%:\n", TOLERANCE * 100);
    printf("  %-8s %11s %11s %11s %13s %7s  %s\n", "strategy", "param", "grad", "optim", "resident", "ratio",
           "check");
    char last[4096];
    int used = snprintf(last, sizeof last, "ctrain_zero np=%d", world);
    for (int k = 0; k < nk; k++) {
        const char *kind = res[k].kind, *label = res[k].label;
        double fr = 0, mr = (double)max_over_ranks(res[k].mem, world, -1) / (double)nparams;
        /* FSDP's unsharded units (the one computing and the one prefetched:
         * parameters, and gradients until reduced): a constant too */
        double unit = (double)(WIDTH * WIDTH + WIDTH) * 4.0 / nparams;
        int fsdp = !strcmp(kind, "fsdp");
        /* zero2's gradients in flight to their owners (the "plus the
         * bucket buffers"): a constant of at most max(reduce_buffer_mb, one
         * module's gradients), allowed on top of the formula */
        double buf = res[k].inflight_mb >= 0
                         ? fmax(res[k].inflight_mb, (WIDTH * WIDTH + WIDTH) * 4.0 / 1048576.0) * 1048576.0 / nparams
                         : 0;
        char cols[3][32], bad[256] = "";
        for (int c = 0; c < 3; c++) {
            double f = formula(&res[k], cats[c], world), fb = cats[c] == CT_MEM_GRAD ? buf : 0;
            if (fsdp && cats[c] != CT_MEM_OPTIM) fb = 2 * unit;
            size_t peak = max_over_ranks(res[k].mem, world, cats[c]);
            double v = (double)peak / (double)nparams;
            fr += f;
            snprintf(cols[c], sizeof cols[c], "%.2f/%.2f", v, f);
            if (fb > 0 ? v < f * (1 - TOLERANCE) || v > (f + fb) * (1 + TOLERANCE) : fabs(v / f - 1) > TOLERANCE) {
                size_t l = strlen(bad);
                snprintf(bad + l, sizeof bad - l, " %s %+.0f%% (%+.2f MiB)", ct_mem_cat_name(cats[c]),
                         (v / f - 1) * 100, mib(peak) - f * (double)nparams / 1048576.0);
            }
        }
        double ratio = mr / fr;
        if (fsdp) buf = 4 * unit;
        if (buf > 0 ? ratio < 1 - TOLERANCE || mr > (fr + buf) * (1 + TOLERANCE) : fabs(ratio - 1) > TOLERANCE) {
            size_t l = strlen(bad);
            snprintf(bad + l, sizeof bad - l, " resident %+.0f%%", (ratio - 1) * 100);
        }
        printf("  %-8s %11s %11s %11s %6.2f/%6.2f %7.3f  %s%s\n", label, cols[0], cols[1], cols[2], mr, fr, ratio,
               bad[0] ? "MISMATCH:" : "OK", bad);
        if (res[k].inflight_mb >= 0) /* what the formula leaves out: a constant, not bytes per parameter */
            printf("  %-8s   grad also holds, beyond this rank's share, the gradients in flight to their owners: "
                   "a constant,\n  %-8s   at most max(reduce_buffer_mb = %g MiB, one module's) = %.2f B/param, "
                   "allowed on top (the issue's \"plus the bucket buffers\")\n", "", "", res[k].inflight_mb, buf);
        if (fsdp)
            printf("  %-8s   param and grad also hold the units being gathered or computed: at most two units' "
                   "parameters\n  %-8s   and gradients, %.3f B/param each, allowed on top\n", "", "", 2 * unit);
        char key[128];
        bench_key(label, key, sizeof key);
        used += snprintf(last + used, sizeof last - (size_t)used, " %s_resident_bpp=%.3f %s_formula_bpp=%.3f "
                         "%s_mem=%s", key, mr, key, fr, key, bad[0] ? "MISMATCH" : "OK");
    }
    printf("step time, median of %d timed steps (train_step + step + zero_grad), and the strategy's split:\n",
           res[0].n);
    printf("  %-8s %9s %9s %9s %9s %9s %8s\n", "strategy", "step ms", "forward", "backward", "comm wait",
           "optimizer", "buckets");
    double base = 0;
    for (int k = 0; k < nk; k++) {
        result *r = &res[k];
        double st = median(r->t_step, r->n) * 1e3;
        if (k == 0) base = st;
        printf("  %-8s %9.2f %9.2f %9.2f %9.2f %9.2f %8d   x%.2f of %s\n", r->label, st, median(r->t_f, r->n) * 1e3,
               median(r->t_b, r->n) * 1e3, median(r->t_w, r->n) * 1e3, median(r->t_o, r->n) * 1e3, r->nbuckets,
               st / base, res[0].label);
        char key[128];
        bench_key(r->label, key, sizeof key);
        used += snprintf(last + used, sizeof last - (size_t)used, " %s_step_ms=%.3f", key, st);
    }
    printf("%s\n", last);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    ct_blas_select_kernel(argc, argv); /* measure the fast kernel, as ctrain runs it */
    int steps = 10, warmup = 3, rounds = 3;
    const char *nps = "2,4", *kinds = "ddp,zero1,zero2", *trace = NULL;
    char opts[1024] = "";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--np") && i + 1 < argc) nps = argv[++i];
        else if (!strcmp(argv[i], "--strategy") && i + 1 < argc) kinds = argv[++i];
        else if (!strcmp(argv[i], "--trace") && i + 1 < argc) trace = argv[++i];
        else if (!strcmp(argv[i], "--width") && i + 1 < argc) WIDTH = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--depth") && i + 1 < argc) DEPTH = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--opt") && i + 1 < argc) {
            size_t l = strlen(opts);
            snprintf(opts + l, sizeof opts - l, "%s%s", l ? "," : "", argv[++i]);
        } else {
            fprintf(stderr, "usage: bench/zero [--np 2,4] [--strategy ddp,zero1,zero2,fsdp:K=V;K=V] [--steps N] "
                            "[--warmup N] [--rounds N] [--width W] [--depth D] [--trace FILE] [--opt KEY=VALUE]\n");
            return 2;
        }
    }
    if (steps < 1 || warmup < 0 || rounds < 1 || WIDTH < 1 || DEPTH < 1) {
        fprintf(stderr, "bench/zero: --steps, --rounds, --width and --depth must be >= 1 and --warmup >= 0\n");
        return 2;
    }

    if (!getenv("OMPI_COMM_WORLD_SIZE")) { /* the launcher: one mpirun per world size */
        char all[16384] = "ctrain_zero", last[4096], buf[256];
        snprintf(buf, sizeof buf, "%s", nps);
        for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
            int np = atoi(t);
            if (np < 1) {
                fprintf(stderr, "bench/zero: --np takes world sizes >= 1 (got '%s')\n", t);
                return 2;
            }
            int rc = run_world(argc, argv, np, last, sizeof last);
            if (rc) {
                fprintf(stderr, "bench/zero: the run on %d ranks failed (exit %d)\n", np, rc);
                return 1;
            }
            append_prefixed(all, sizeof all, last);
        }
        printf("%s\n", all);
        return 0;
    }

    check(ct_comm_init(&argc, &argv), "ct_comm_init");
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_blas_set_threads(1);

    result res[MAX_KINDS];
    int nk = 0;
    char kbuf[256];
    snprintf(kbuf, sizeof kbuf, "%s", kinds);
    for (char *t = strtok(kbuf, ","); t; t = strtok(NULL, ",")) {
        if (nk == MAX_KINDS) ct_comm_abort("bench/zero: at most %d strategies", MAX_KINDS);
        result *r = &res[nk++];
        memset(r, 0, sizeof *r);
        snprintf(r->label, sizeof r->label, "%s", t);
        char *colon = strchr(t, ':');
        if (colon) { /* KIND:K=V;K=V -> the kind's options K=V,K=V */
            *colon = 0;
            snprintf(r->opts, sizeof r->opts, "%s", colon + 1);
            for (char *c = r->opts; *c; c++)
                if (*c == ';') *c = ',';
        }
        r->kind = t;
        size_t n = (size_t)steps * (size_t)rounds;
        r->t_step = calloc(n, sizeof(double));
        r->t_f = calloc(n, sizeof(double));
        r->t_b = calloc(n, sizeof(double));
        r->t_w = calloc(n, sizeof(double));
        r->t_o = calloc(n, sizeof(double));
        r->mem = calloc((size_t)world, sizeof *r->mem);
        if (!r->t_step || !r->t_f || !r->t_b || !r->t_w || !r->t_o || !r->mem) ct_comm_abort("out of memory");
    }
    if (!nk) ct_comm_abort("bench/zero: --strategy names none");

    /* This rank's batch: data, not activations, so it stays out of "act". */
    ct_tensor *x = ct_tensor_create2(BATCH, WIDTH, CT_MEM_DATA);
    ct_tensor *y = ct_tensor_create(CT_I32, 1, (int64_t[]){BATCH}, CT_MEM_DATA);
    if (!x || !y) ct_comm_abort("out of memory");
    ct_rng rng;
    ct_rng_init(&rng, 7, (uint64_t)rank);
    ct_rng_normal(&rng, ct_f32(x), (size_t)x->numel, 0, 1);
    for (int i = 0; i < BATCH; i++) ((int32_t *)ct_tensor_data(y))[i] = (i * 37 + rank) % WIDTH;
    ct_batch b = {.x = x, .y = y};

    for (int round = 0; round < rounds; round++)
        for (int k = 0; k < nk; k++) run_round(&res[k], &b, opts, steps, warmup, trace, round);

    if (rank == 0) report(res, nk, world, (int64_t)DEPTH * (WIDTH * WIDTH + WIDTH));

    ct_tensor_release(x);
    ct_tensor_release(y);
    for (int k = 0; k < nk; k++) {
        free(res[k].t_step); free(res[k].t_f); free(res[k].t_b); free(res[k].t_w); free(res[k].t_o);
        free(res[k].mem);
    }
    ct_comm_finalize();
    return 0;
}

/*
 * What `ctrain train` prints about a run: its description before training
 * and its report after (evaluation, memory per rank, the strategy's times).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train_loop.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double train_median_step_ms(trainer *t)
{
    if (!t->nstep_s) return 0;
    qsort(t->step_s, (size_t)t->nstep_s, sizeof *t->step_s, cmp_double);
    int64_t n = t->nstep_s;
    return 1000.0 * (n % 2 ? t->step_s[n / 2] : 0.5 * (t->step_s[n / 2 - 1] + t->step_s[n / 2]));
}

/* Peak bytes per category over the training steps, a column per rank (up
 * to 8; beyond that the largest rank's figure). */
static void print_memory(trainer *t)
{
    static const char *rows[] = {"param", "grad", "optim", "act", "comm", "data", "other",
                                 "total", "resident", "cached", "rss"};
    int cols = t->world <= 8 ? t->world : 1;
    char b[32];
    cli_out("peak memory over the training steps%s:\n  %-9s", t->world > 8 ? " (max over ranks)" : "", "");
    for (int r = 0; r < cols; r++) {
        char h[16];
        snprintf(h, sizeof h, cols == 1 && t->world == 1 ? "bytes" : t->world > 8 ? "max" : "rank %d", r);
        cli_out("%12s", h);
    }
    cli_out("\n");
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        cli_out("  %-9s", rows[k]);
        for (int r = 0; r < cols; r++) {
            size_t v = 0;
            for (int q = t->world > 8 ? 0 : r; q < (t->world > 8 ? t->world : r + 1); q++) {
                const ct_mem_report *m = &t->mem[q];
                size_t x = k < CT_MEM_NCAT ? m->peak[k] : k == 7 ? m->peak_total : k == 8 ? m->peak_resident
                         : k == 9 ? m->cached : m->peak_rss;
                if (x > v) v = x;
            }
            cli_out("%12s", cli_bytes((double)v, b, sizeof b));
        }
        cli_out("\n");
    }
    cli_out("  (resident = param + grad + optim at its peak; cached = freed blocks kept for reuse at the end, bound "
            "%s; rss = the process's peak resident set)\n", cli_bytes((double)t->mem[0].cache_limit, b, sizeof b));
}

ct_status train_life(trainer *t, cli_progress *prog, double step_ms)
{
    ct_mem_report *fin = ct_alloc(sizeof *fin * (size_t)t->world, CT_MEM_OTHER);
    CT_TRY(ct_group_check(t->g, fin ? CT_OK : CT_ENOMEM));
    ct_status st = ct_group_mem_reports(t->g, fin);
    size_t phase_max[CT_PHASE_N] = {0};
    for (int r = 0; st == CT_OK && r < t->world; r++) {
        /* the training window's figures stay; the life's come from now */
        t->mem[r].life_peak_rss = fin[r].life_peak_rss;
        t->mem[r].life_peak_phase = fin[r].life_peak_phase;
        memcpy(t->mem[r].phase_peak_rss, fin[r].phase_peak_rss, sizeof fin[r].phase_peak_rss);
        for (int p = 0; p < CT_PHASE_N; p++)
            if (fin[r].phase_peak_rss[p] > phase_max[p]) phase_max[p] = fin[r].phase_peak_rss[p];
    }
    if (st == CT_OK && t->rank == 0) st = cli_progress_summary(prog, step_ms, t->mem, t->traffic_all, t->world);
    char b[32];
    int top = 0;
    for (int r = 1; st == CT_OK && r < t->world; r++)
        if (fin[r].life_peak_rss > fin[top].life_peak_rss) top = r;
    if (st == CT_OK && t->world <= 8) {
        cli_out("whole-life peak RSS (set-up to teardown):");
        for (int r = 0; r < t->world; r++)
            cli_out("%s rank %d %s in %s", r ? "," : "", r, cli_bytes((double)fin[r].life_peak_rss, b, sizeof b),
                    ct_mem_phase_name(fin[r].life_peak_phase));
    } else if (st == CT_OK) {
        cli_out("whole-life peak RSS (set-up to teardown): at most %s (rank %d, in %s)",
                cli_bytes((double)fin[top].life_peak_rss, b, sizeof b), top, ct_mem_phase_name(fin[top].life_peak_phase));
    }
    if (st == CT_OK) {
        cli_out("; per phase%s:", t->world > 1 ? " (largest rank)" : "");
        for (int p = 0; p < CT_PHASE_N; p++)
            if (phase_max[p]) cli_out(" %s %s", ct_mem_phase_name((ct_mem_phase)p), cli_bytes((double)phase_max[p], b, sizeof b));
        cli_out("\n");
    }
    ct_free(fin);
    return st;
}

static ct_status evaluate(trainer *t, cli_eval *ev)
{
    train_opts *o = t->o;
    /* Text windows are long: a few per forward keeps the logits small. */
    if (t->is_text)
        return cli_evaluate_text(t->s, t->model, &t->cfg, &t->text, o->eval_batch < 32 ? o->eval_batch : 32,
                                 o->limit_test, t->g, ev);
    return cli_evaluate(t->s, t->model, &t->cfg, &t->test, o->eval_batch, t->g, ev, NULL);
}

ct_status train_eval(trainer *t, cli_progress *prog)
{
    ct_mem_phase_begin(CT_PHASE_EVAL);
    double t0 = ct_now();
    CT_TRY(evaluate(t, &t->last_eval));
    t->last_eval_step = t->step;
    cli_progress_eval(prog, t->step, t->last_eval.loss);
    t->eval_seconds += ct_now() - t0;
    return CT_OK;
}

/* Every rank's messages per training step (ct_comm_traffic: what MPI
 * carried; the shared-memory paths inside a node carry none) and the CPU its
 * communication thread used (on cores the computation fills, time taken
 * from it), gathered into t->traffic_all for the metrics summary, and
 * printed. */
static ct_status report_traffic(trainer *t)
{
    if (t->world < 2 || !t->nstats) return CT_OK;
    double n = (double)t->nstats;
    double mine[3] = {(double)t->traffic.sent / n, (double)t->traffic.received / n, t->comm_cpu * 1e3 / n};
    t->traffic_all = ct_alloc(sizeof *t->traffic_all * 3 * (size_t)t->world, CT_MEM_OTHER);
    CT_TRY(ct_group_check(t->g, t->traffic_all ? CT_OK : CT_ENOMEM));
    CT_TRY(ct_group_allgather(t->g, mine, t->traffic_all, 3 * (int64_t)sizeof(double), CT_U8, NULL));
    char a[32], b[32];
    const double *x = t->traffic_all;
    cli_out("messages per step (mean over %lld steps; MPI's traffic, none through shared memory; the "
            "communication thread's CPU):", (long long)t->nstats);
    if (t->world <= 8) {
        for (int r = 0; r < t->world; r++)
            cli_out("%s rank %d sent %s, received %s, %.1f ms of CPU", r ? ";" : "", r, cli_bytes(x[3 * r], a, sizeof a),
                    cli_bytes(x[3 * r + 1], b, sizeof b), x[3 * r + 2]);
    } else {
        double ms = 0, mr = 0, mc = 0;
        for (int r = 0; r < t->world; r++) {
            if (x[3 * r] > ms) ms = x[3 * r];
            if (x[3 * r + 1] > mr) mr = x[3 * r + 1];
            if (x[3 * r + 2] > mc) mc = x[3 * r + 2];
        }
        cli_out(" a rank sent at most %s, received at most %s, used at most %.1f ms of CPU", cli_bytes(ms, a, sizeof a),
                cli_bytes(mr, b, sizeof b), mc);
    }
    cli_out("\n");
    return CT_OK;
}

ct_status train_report(trainer *t, double seconds)
{
    train_opts *o = t->o;
    cli_eval ev = t->last_eval;
    char buf[512];
    if (t->last_eval_step != t->step) CT_TRY(evaluate(t, &ev));
    int64_t steps = t->step - t->start_step;
    if (steps > 0)
        cli_out("trained %lld steps (to step %lld, epoch %.2f) in %.1f s, %.0f samples/s; final train loss %.6f\n",
                (long long)steps, (long long)t->step, (double)t->step / (double)t->spe, seconds,
                (double)steps * (double)o->batch / seconds, t->last_loss);
    if (t->skipped)
        cli_out("skipped %lld step%s with a non-finite loss or gradient norm (--on-nonfinite skip)\n",
                (long long)t->skipped, t->skipped == 1 ? "" : "s");
    if (t->is_text) cli_out("%s\n", cli_eval_text_str(&ev, ct_text_unigram_entropy(&t->text), buf, sizeof buf));
    else cli_out("test: %s\n", cli_eval_str(&ev, buf, sizeof buf));
    print_memory(t);
    if (t->nstats) {
        double n = (double)t->nstats, ms = 1000.0 / n;
        ct_step_stats s = t->sum;
        double ov = s.comm_total > 0 ? 1.0 - s.comm_wait / s.comm_total : 1.0;
        if (ov < 0) ov = 0;
        cli_out("step time (%s, mean over %lld steps): forward %.2f ms, backward %.2f ms, optimizer %.2f ms",
                ct_strategy_kind(t->s), (long long)t->nstats, s.forward * ms, s.backward * ms, s.optimizer * ms);
        if (s.io_total > 0)
            cli_out("; offload I/O %.2f ms, waited %.2f ms (%.0f%% hidden behind compute)", s.io_total * ms,
                    s.io_wait * ms, 100.0 * (s.io_total > s.io_wait ? 1.0 - s.io_wait / s.io_total : 0.0));
        if (s.io_bytes > 0 && n > 2) /* a step's loads may start in the one before it: means, not one step's */
            cli_out(", store moved %.3f MiB per step (%.3f after the first two, which load no update and no "
                    "optimizer state yet)", s.io_bytes / n / 1048576.0, (s.io_bytes - t->first_io_bytes) / (n - 2) / 1048576.0);
        else if (s.io_bytes > 0)
            cli_out(", store moved %.3f MiB per step", s.io_bytes / n / 1048576.0);
        if (!strcmp(ct_strategy_kind(t->s), "pipe"))
            cli_out("; waited %.2f ms for other stages (the pipeline's bubble) and the replicas' allreduce "
                    "(%.2f ms in %d bucket%s)", s.comm_wait * ms, s.comm_total * ms, s.nbuckets, s.nbuckets == 1 ? "" : "s");
        else if (t->world > 1 && s.nbuckets)
            cli_out("; allreduce %.2f ms in %d bucket%s, waited %.2f ms (%.0f%% overlapped with backward)",
                    s.comm_total * ms, s.nbuckets, s.nbuckets == 1 ? "" : "s", s.comm_wait * ms, ov * 100);
        else if (t->world > 1) /* gathers and reduce-scatters */
            cli_out("; communication %.2f ms, waited %.2f ms (%.0f%% overlapped with compute)", s.comm_total * ms,
                    s.comm_wait * ms, ov * 100);
        cli_out("\n");
        /* Where it goes: the ledger's kinds, the waits for communication, and the rest
         * (elementwise layers, casts, the loss, bookkeeping). */
        double rest = t->step_total - t->ledger[CT_LEDGER_PRODUCTS] - t->ledger[CT_LEDGER_ATTENTION] -
                      t->ledger[CT_LEDGER_OPTIMIZER] - s.comm_wait;
        cli_out("step time split (mean ms): products %.2f, attention %.2f, elementwise and the rest %.2f, "
                "optimizer %.2f, communication waits %.2f", t->ledger[CT_LEDGER_PRODUCTS] * ms,
                t->ledger[CT_LEDGER_ATTENTION] * ms, (rest > 0 ? rest : 0) * ms, t->ledger[CT_LEDGER_OPTIMIZER] * ms,
                s.comm_wait * ms);
        cli_out("\n");
        (void)n;
    }
    CT_TRY(report_traffic(t));
    void *hs;
    const char *hook = ct_strategy_comm_hook(t->s, &hs);
    if (hook && !strcmp(hook, "powersgd")) {
        int64_t it, before, after;
        ct_powersgd_stats(hs, &it, &before, &after);
        if (after > 0)
            cli_out("PowerSGD: a rank sent %lld of its %lld gradient elements in the last step (%.1fx fewer)\n",
                    (long long)after, (long long)before, (double)before / (double)after);
    }
    return CT_OK;
}

void train_describe(trainer *t)
{
    train_opts *o = t->o;
    char desc[300];
    cli_out("ctrain train: %s (%lld parameters) on %s (%lld training samples), %s lr %g, batch %lld%s "
            "over %d rank%s (%s), %d BLAS thread%s per rank (OpenBLAS %s), steps %lld..%lld (%lld per epoch)\n",
            cli_config_str(&t->cfg, desc, sizeof desc), (long long)t->nparams, o->data, (long long)t->train.n, ct_optim_name(t->opt),
            t->sched.base_lr, (long long)o->batch, o->grad_accum > 1 ? " (accumulated)" : "", t->world,
            t->world == 1 ? "" : "s", ct_strategy_kind(t->s), ct_blas_get_threads(),
            ct_blas_get_threads() == 1 ? "" : "s", ct_blas_corename(), (long long)t->step, (long long)t->total, (long long)t->spe);
    const ct_optim_opts *oo = ct_optim_get_opts(t->opt);
    char betas[64] = "";
    if (oo->kind == CT_OPT_ADAMW) snprintf(betas, sizeof betas, ", betas (%g, %g)", oo->beta1, oo->beta2);
    cli_out("optimizer: weight decay %g, none on %d parameter%s (--no-decay %s)%s\n", oo->weight_decay, t->nnd,
            t->nnd == 1 ? "" : "s", o->no_decay, betas);
    /* Where the ranks are (the shared-memory paths work inside a node
     * only), and how gradient buckets travel when not plainly summed. */
    ct_group *g = ct_strategy_group(t->s);
    if (t->world > 1 && g)
        cli_out("ranks on %d node%s\n", ct_group_num_nodes(g), ct_group_num_nodes(g) == 1 ? "" : "s");
    const char *hook = ct_strategy_comm_hook(t->s, NULL);
    if (hook && !strcmp(hook, "powersgd"))
        cli_out("gradient buckets reduced by PowerSGD at rank %s (uncompressed for the first %s steps, error feedback %s, "
                "warm start %s)\n", ct_strategy_opt(t->s, "powersgd_rank"), ct_strategy_opt(t->s, "powersgd_start_iter"),
                ct_strategy_opt(t->s, "powersgd_error_feedback"), ct_strategy_opt(t->s, "powersgd_warm_start"));
    if (t->nckpt)
        cli_out("activation checkpointing: %d %s keep only their input, recomputed in backward\n", t->nckpt,
                t->cfg.kind == CT_MODEL_GPT ? "blocks" : "layers");
    int stage, nstages;
    ct_strategy_pipe_stage(t->s, &stage, &nstages);
    if (!strcmp(ct_strategy_kind(t->s), "pipe"))
        cli_out("pipeline: %d stage%s (children per stage %s) x %d replica%s; %s micro-batches, schedule %s, "
                "checkpoint %s; rank r is stage r %% %d of replica r / %d\n", nstages, nstages == 1 ? "" : "s", ct_strategy_opt(t->s, "balance"),
                t->dsize, t->dsize == 1 ? "" : "s", ct_strategy_opt(t->s, "chunks"), ct_strategy_opt(t->s, "schedule"),
                ct_strategy_opt(t->s, "checkpoint"), nstages, nstages);
    int nsl, ahead;
    ct_strategy_offload_info(t->s, &nsl, &ahead);
    if (nsl)
        cli_out("offload: %d slices (children per slice %s), up to %d resident (%s), micro-batches %s, "
                "activation checkpointing %s, budget %s MiB; store in %s\n", nsl, ct_strategy_opt(t->s, "balance"), ahead,
                ahead == 1 ? "no prefetch" : ahead == 2 ? "the next slice loads meanwhile" : "prefetch and overlapped allreduce",
                ct_strategy_opt(t->s, "microbatches"), strcmp(ct_strategy_opt(t->s, "checkpoint_activation"), "0") ? "on (slice inputs)" : o->checkpoint_activation ? "on (each layer)" : "off",
                ct_strategy_opt(t->s, "max_resident_mb"), o->offload_dir ? o->offload_dir : "$TMPDIR or /tmp");
    const ct_partition *pt = ct_strategy_partition(t->s);
    if (!o->verbose || !pt) return;
    /* Who owns what: the partition's parameter indices count trainable parameters. */
    ct_param **ps;
    int np, nt = 0;
    if (ct_module_params(t->model, &ps, &np) != CT_OK) return;
    const char **names = ct_alloc_zeroed(sizeof *names * (size_t)(np + 1), CT_MEM_OTHER);
    size_t n = 256 + 64 * (size_t)pt->n;
    char *buf = ct_alloc_zeroed(n, CT_MEM_OTHER);
    for (int i = 0; names && i < np; i++)
        if (ps[i]->requires_grad) names[nt++] = ps[i]->name;
    if (names && buf && ct_partition_describe(pt, names, buf, n) == CT_OK) cli_out("partition (%s):\n%s", ct_strategy_kind(t->s), buf);
    ct_free(buf);
    ct_free(names);
    ct_free(ps);
}


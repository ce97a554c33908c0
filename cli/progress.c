/*
 * Progress while training (rank 0): a permanent line every --log-every
 * steps, a live bar redrawn in place with \r when stderr is a terminal,
 * and the --metrics file (one JSON object per logged step; its "epoch" is
 * epochs completed, fractional, so curves of runs with other batch sizes line up).
 */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

ct_status cli_progress_init(cli_progress *p, int64_t total_steps, int64_t steps_per_epoch,
                            const char *metrics_path, int append)
{
    memset(p, 0, sizeof *p);
    p->tty = cli_rank == 0 && isatty(2);
    p->t_start = ct_now();
    p->total_steps = total_steps;
    p->steps_per_epoch = steps_per_epoch;
    p->epochs = total_steps / steps_per_epoch + (total_steps % steps_per_epoch != 0); /* no overflow at INT64_MAX */
    if (metrics_path && cli_rank == 0) {
        p->metrics = fopen(metrics_path, append ? "a" : "w");
        if (!p->metrics)
            return ct_error(CT_EIO, "cannot write the metrics file %s: %s; pass a writable path to --metrics",
                            metrics_path, strerror(errno));
    }
    return CT_OK;
}

static void clear_bar(cli_progress *p)
{
    if (p->bar_shown) fprintf(stderr, "\r\033[K");
    p->bar_shown = 0;
}

void cli_progress_tick(cli_progress *p, int64_t step, int64_t epoch, double last_loss)
{
    if (!p->tty) return;
    double now = ct_now();
    if (now - p->t_last_draw < 0.1 && step < p->total_steps) return;
    p->t_last_draw = now;
    double el = now - p->t_start, frac = (double)step / (double)(p->total_steps ? p->total_steps : 1);
    char bar[31], e[32], eta[32], loss[32] = "-";
    if (last_loss == last_loss) snprintf(loss, sizeof loss, "%.4f", last_loss); /* NaN: none logged yet */
    int fill = (int)(frac * 30);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
    bar[30] = 0;
    fprintf(stderr, "\r\033[Kepoch %lld/%lld [%s] %lld/%lld  loss %s  %s<%s", (long long)epoch + 1,
            (long long)p->epochs, bar, (long long)step, (long long)p->total_steps, loss,
            cli_hms(el, e, sizeof e), frac > 0 ? cli_hms(el / frac - el, eta, sizeof eta) : "?");
    fflush(stderr);
    p->bar_shown = 1;
}

void cli_progress_log(cli_progress *p, int64_t step, int64_t epoch, double loss, double lr,
                      double samples_per_s)
{
    if (cli_rank != 0) return;
    double el = ct_now() - p->t_start, frac = (double)step / (double)(p->total_steps ? p->total_steps : 1);
    char e[32], eta[32];
    clear_bar(p);
    fprintf(stderr, "epoch %lld/%lld  step %lld/%lld  loss %.4f  lr %.3g  %.0f samples/s  elapsed %s  ETA %s\n",
            (long long)epoch + 1, (long long)p->epochs, (long long)step, (long long)p->total_steps, loss, lr,
            samples_per_s, cli_hms(el, e, sizeof e), frac > 0 ? cli_hms(el / frac - el, eta, sizeof eta) : "?");
    fflush(stderr);
    if (p->metrics) {
        fprintf(p->metrics, "{\"step\":%lld,\"epoch\":%.4f,\"loss\":%.9g,\"lr\":%.9g,\"samples_per_s\":%.1f}\n",
                (long long)step, (double)step / (double)p->steps_per_epoch, loss, lr, samples_per_s);
        fflush(p->metrics);
    }
}

void cli_progress_eval(cli_progress *p, int64_t step, double val_loss)
{
    if (cli_rank != 0) return;
    if (step < p->total_steps) { /* the last step's is in the final report */
        clear_bar(p);
        fprintf(stderr, "step %lld/%lld  val loss %.4f\n", (long long)step, (long long)p->total_steps, val_loss);
    }
    if (p->metrics) {
        fprintf(p->metrics, "{\"event\":\"eval\",\"step\":%lld,\"epoch\":%.4f,\"val_loss\":%.9g}\n", (long long)step,
                (double)step / (double)p->steps_per_epoch, val_loss);
        fflush(p->metrics);
    }
}

ct_status cli_progress_summary(cli_progress *p, double step_ms, const ct_mem_report *mem, const double *traffic,
                               int nranks)
{
    if (!p->metrics) return CT_OK;
    fprintf(p->metrics, "{\"event\":\"summary\",\"step_ms\":%.4f,\"memory\":[", step_ms);
    for (int r = 0; r < nranks; r++) {
        char js[CT_MEM_REPORT_JSON_MAX];
        CT_TRY(ct_mem_report_json(&mem[r], r, js, sizeof js));
        fprintf(p->metrics, "%s%s", r ? "," : "", js);
    }
    fprintf(p->metrics, "]");
    if (traffic) { /* bytes per training step, and the comm thread's CPU ms, by rank */
        fprintf(p->metrics, ",\"traffic\":[");
        for (int r = 0; r < nranks; r++)
            fprintf(p->metrics, "%s{\"rank\":%d,\"sent\":%.1f,\"received\":%.1f,\"comm_cpu_ms\":%.3f}", r ? "," : "", r,
                    traffic[3 * r], traffic[3 * r + 1], traffic[3 * r + 2]);
        fprintf(p->metrics, "]");
    }
    fprintf(p->metrics, "}\n");
    if (fflush(p->metrics) != 0) return ct_error(CT_EIO, "cannot write the metrics file: %s", strerror(errno));
    return CT_OK;
}

void cli_progress_clear(cli_progress *p)
{
    if (cli_rank == 0) clear_bar(p);
}

void cli_progress_finish(cli_progress *p)
{
    if (cli_rank == 0) clear_bar(p);
    if (p->metrics) fclose(p->metrics);
    p->metrics = NULL;
}

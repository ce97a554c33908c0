/*
 * What the program prints and how: rank 0 speaks for the job, errors are
 * one line "ctrain CMD: cause; fix", and a few formatting and reduction
 * helpers the commands share.
 */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

int cli_rank = 0, cli_world = 1;

int cli_launcher_rank(void)
{
    /* Before MPI starts, the launcher's environment is the only way to know. */
    static const char *const vars[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return atoi(v);
    }
    return 0;
}

void cli_out(const char *fmt, ...)
{
    if (cli_rank != 0) return;
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    fflush(stdout);
}

void cli_err(const char *cmd, const char *fmt, ...)
{
    if (cli_rank != 0) return;
    char msg[8192], shown[16384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fflush(stdout);
    /* Messages quote names and values from files: control characters are shown escaped. */
    fprintf(stderr, "ctrain %s: %s\n", cmd, cli_printable(msg, shown, sizeof shown));
    fflush(stderr);
}

const char *cli_bytes(double b, char *buf, size_t n)
{
    if (b < 1024) snprintf(buf, n, "%.0f B", b);
    else if (b < 1048576.0) snprintf(buf, n, "%.1f KiB", b / 1024);
    else if (b < 1073741824.0) snprintf(buf, n, "%.1f MiB", b / 1048576.0);
    else snprintf(buf, n, "%.2f GiB", b / 1073741824.0);
    return buf;
}

const char *cli_hms(double s, char *buf, size_t n)
{
    if (!(s >= 0) || s > 1e8) {
        snprintf(buf, n, "?");
        return buf;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, n, "%ld:%02ld", t / 60, t % 60);
    return buf;
}

ct_status cli_sum_f64(ct_group *g, double *v, int n)
{
    int size = ct_group_size(g);
    if (size == 1) return CT_OK;
    double *all = ct_alloc_zeroed(sizeof *all * (size_t)n * (size_t)size, CT_MEM_COMM);
    if (!all) return CT_ENOMEM;
    /* Bytes, not a reduction: the sum is then done in rank order, the same on every rank. */
    ct_status st = ct_group_allgather(g, v, all, (int64_t)(sizeof *v * (size_t)n), CT_U8, NULL);
    if (st == CT_OK)
        for (int i = 0; i < n; i++) {
            double s = 0;
            for (int r = 0; r < size; r++) s += all[(size_t)r * (size_t)n + (size_t)i];
            v[i] = s;
        }
    ct_free(all);
    return st;
}

int cli_default_threads(ct_group *g)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int local = ct_group_local_size(g);
    long t = cores / (local > 0 ? local : 1);
    return t < 1 ? 1 : (int)t;
}

const char *cli_config_str(const ct_model_config *cfg, char *buf, size_t n)
{
    char hid[256];
    if (cfg->kind == CT_MODEL_GPT) {
        char drop[32] = "";
        if (cfg->dropout > 0) snprintf(drop, sizeof drop, ", dropout %g", (double)cfg->dropout);
        snprintf(buf, n, "gpt [%lld layers, %lld heads, dim %lld, context %lld, vocab %lld%s]",
                 (long long)cfg->layers, (long long)cfg->heads, (long long)cfg->dim, (long long)cfg->context,
                 (long long)cfg->vocab, drop);
    } else if (cfg->kind == CT_MODEL_CNN)
        snprintf(buf, n, "%s [%s] %dx%d%s", ct_model_kind_name(cfg->kind),
                 ct_model_config_hidden_str(cfg, hid, sizeof hid), cfg->kernel, cfg->kernel,
                 cfg->batchnorm ? " batchnorm" : "");
    else if (cfg->dropout > 0)
        snprintf(buf, n, "%s [%s] dropout %g", ct_model_kind_name(cfg->kind),
                 ct_model_config_hidden_str(cfg, hid, sizeof hid), (double)cfg->dropout);
    else
        snprintf(buf, n, "%s [%s]", ct_model_kind_name(cfg->kind), ct_model_config_hidden_str(cfg, hid, sizeof hid));
    return buf;
}

const char *cli_printable(const char *s, char *buf, size_t n)
{
    size_t at = 0;
    for (; *s && at + 7 < n; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == 0xc2 && (unsigned char)s[1] >= 0x80 && (unsigned char)s[1] < 0xa0) /* a C1 control, as UTF-8 */
            at += (size_t)snprintf(buf + at, n - at, "\\u%04x", (unsigned char)*++s);
        else if (c < 0x20 || c == 0x7f) at += (size_t)snprintf(buf + at, n - at, "\\x%02x", c);
        else if (c == '\\') at += (size_t)snprintf(buf + at, n - at, "\\\\");
        else buf[at++] = (char)c;
    }
    if (*s && n >= 4) { /* cut: say so */
        if (at > n - 4) at = n - 4;
        memcpy(buf + at, "...", 3);
        at += 3;
    }
    buf[at < n ? at : n - 1] = 0;
    return buf;
}

int cli_powersgd_rank(const char *grad_compress)
{
    if (strncmp(grad_compress, "powersgd:", 9)) return 0;
    const char *r = grad_compress + 9;
    char *end;
    long v = strtol(r, &end, 10);
    return *r >= '0' && *r <= '9' && !*end && v >= 1 && v <= 1 << 20 ? (int)v : -1;
}

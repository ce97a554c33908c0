/* Logging to stderr with a rank prefix, so lines from many ranks can be told apart. */
#include "ctrain/core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int log_rank, log_size = 1;
static int log_level = -1;

void ct_log_set_rank(int rank, int size)
{
    log_rank = rank;
    log_size = size;
}

static void level_from_env(void)
{
    const char *e = getenv("CTRAIN_LOG");
    log_level = CT_LOG_INFO;
    if (!e) return;
    if (!strcmp(e, "error")) log_level = CT_LOG_ERROR;
    else if (!strcmp(e, "warn")) log_level = CT_LOG_WARN;
    else if (!strcmp(e, "debug")) log_level = CT_LOG_DEBUG;
}

void ct_log_set_level(ct_log_level level) { log_level = (int)level; }

ct_log_level ct_log_get_level(void)
{
    if (log_level < 0) level_from_env();
    return (ct_log_level)log_level;
}

void ct_log(ct_log_level level, const char *fmt, ...)
{
    static const char *tag[] = {"error: ", "warning: ", "", "debug: "};
    if ((int)level > (int)ct_log_get_level()) return;
    char line[2048];
    int off = 0;
    if (log_size > 1) off = snprintf(line, sizeof line, "[rank %d/%d] ", log_rank, log_size);
    off += snprintf(line + off, sizeof line - (size_t)off, "%s", tag[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + off, sizeof line - (size_t)off, fmt, ap);
    va_end(ap);
    /* One fputs per line keeps lines from different threads whole. */
    size_t len = strlen(line);
    if (len + 1 >= sizeof line) len = sizeof line - 2; /* truncated: still end the line */
    line[len] = '\n';
    line[len + 1] = 0;
    fputs(line, stderr);
}

/* Status codes and the per-thread error message. */
#include "ctrain/core.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Long enough for a message that wraps a few others (paths included); a
 * longer one ends in "..." so the cut shows. */
static _Thread_local char errbuf[4096];

const char *ct_strerror(ct_status s)
{
    switch (s) {
    case CT_OK: return "ok";
    case CT_EINVAL: return "invalid argument";
    case CT_ENOMEM: return "out of memory";
    case CT_EIO: return "i/o error";
    case CT_EFORMAT: return "malformed data";
    case CT_ECOMM: return "communication error";
    case CT_ESTATE: return "invalid state";
    case CT_EUNSUPPORTED: return "unsupported";
    }
    return "unknown error";
}

static _Thread_local ct_status errcode;

const char *ct_last_error(void) { return errbuf; }

ct_status ct_last_status(void) { return errcode; }

void ct_clear_error(void)
{
    errbuf[0] = 0;
    errcode = CT_OK;
}

ct_status ct_error(ct_status code, const char *fmt, ...)
{
    /* Format aside first: callers wrap the previous message
     * (ct_error(c, "loading %s: %s", path, ct_last_error())), and printing
     * into the buffer an argument points into would garble it. */
    char tmp[sizeof errbuf];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof tmp) memcpy(tmp + sizeof tmp - 4, "...", 4);
    memcpy(errbuf, tmp, sizeof errbuf);
    errcode = code;
    return code;
}

void ct__assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "ctrain: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

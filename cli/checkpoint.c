/*
 * Checkpoint metadata as the program reads it.  Saving, loading, verifying
 * and series of checkpoints are the library's (include/ctrain/checkpoint.h,
 * src/ckpt): the program calls them like any user.
 */
#include <errno.h>
#include <stdlib.h>

#include "cli.h"

ct_status cli_meta_int(const ct_meta *m, const char *file, const char *key, int64_t *v)
{
    const char *s = ct_meta_get(m, key);
    if (!s) return ct_error(CT_EFORMAT, "%s has no metadata '%s'; was it written by 'ctrain train'?", file, key);
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (end == s || *end || errno)
        return ct_error(CT_EFORMAT, "%s: metadata '%s' is '%s', not an integer", file, key, s);
    *v = x;
    return CT_OK;
}

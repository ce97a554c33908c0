/*
 * --metrics on --resume: the file may hold records past the checkpoint's
 * step (the run went on after its last save, or it is resumed from an
 * older checkpoint).  Appending would repeat those steps, so the records
 * with a "step" beyond the resumed one (logged steps, evaluations) are dropped first (the file is
 * rewritten to a temp file and renamed, so a crash keeps the old one).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

ct_status cli_metrics_rewind(const char *path, int64_t step)
{
    FILE *in = fopen(path, "rb");
    if (!in) return errno == ENOENT ? CT_OK : ct_error(CT_EIO, "cannot read the metrics file %s: %s", path, strerror(errno));
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *out = fopen(tmp, "wb");
    if (!out) {
        fclose(in);
        return ct_error(CT_EIO, "cannot write beside the metrics file %s: %s", path, strerror(errno));
    }
    char line[1 << 16];
    int64_t dropped = 0;
    while (fgets(line, sizeof line, in)) {
        const char *s = strstr(line, "{\"step\":"), *e = strstr(line, "{\"event\":\"eval\",\"step\":");
        if ((s == line && strtoll(s + 8, NULL, 10) > step) || (e == line && strtoll(e + 23, NULL, 10) > step)) {
            dropped++;
            continue;
        }
        fputs(line, out);
    }
    int bad = ferror(in) | ferror(out);
    fclose(in);
    if (fclose(out) != 0 || bad || (dropped && rename(tmp, path) != 0)) {
        ct_status st = ct_error(CT_EIO, "cannot rewrite the metrics file %s: %s", path, strerror(errno));
        unlink(tmp);
        return st;
    }
    if (!dropped) unlink(tmp);
    return CT_OK;
}

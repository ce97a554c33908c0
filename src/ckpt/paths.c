/*
 * Checkpoint names: where the optimizer state of a checkpoint goes, the
 * file whose journal commits it, and the finishing of a commit a crash
 * interrupted (ct_ckpt_recover) before anyone reads.
 */
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

#include "internal.h"

static int is_dir(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

void ct_checkpoint_optim_path(const char *path, char *buf, size_t n)
{
    static const char ext[] = ".safetensors", model_index[] = "model.safetensors.index.json";
    size_t len = strlen(path), el = sizeof ext - 1, ml = sizeof model_index - 1;
    if (is_dir(path))
        snprintf(buf, n, "%s%soptim.safetensors.index.json", path, len && path[len - 1] == '/' ? "" : "/");
    else if (len >= ml && !strcmp(path + len - ml, model_index) && (len == ml || path[len - ml - 1] == '/'))
        snprintf(buf, n, "%.*soptim.safetensors.index.json", (int)(len - ml), path);
    else if (len > ml - 5 && !strcmp(path + len - (ml - 5), model_index + 5)) /* P.safetensors.index.json */
        snprintf(buf, n, "%.*s.optim%s", (int)(len - (ml - 5)), path, model_index + 5);
    else if (len > el && !strcmp(path + len - el, ext))
        snprintf(buf, n, "%.*s.optim%s", (int)(len - el), path, ext);
    else
        snprintf(buf, n, "%s.optim%s", path, ext);
}

void ct__ckpt_anchor(const char *path, char *buf, size_t n)
{
    size_t len = strlen(path);
    if (is_dir(path))
        snprintf(buf, n, "%s%smodel.safetensors.index.json", path, len && path[len - 1] == '/' ? "" : "/");
    else
        snprintf(buf, n, "%s", path);
}

ct_status ct__ckpt_recover(ct_group *g, const char *path)
{
    char anchor[4096];
    ct__ckpt_anchor(path, anchor, sizeof anchor);
    return ct__ckpt_check(g, !g || ct_group_rank(g) == 0 ? ct_ckpt_recover(anchor) : CT_OK);
}

ct_status ct__ckpt_check(ct_group *g, ct_status st) { return g ? ct_group_check(g, st) : st; }

ct_status ct__ckpt_check_regular(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) return ct_error(CT_EIO, "cannot read the checkpoint %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode) && !S_ISDIR(sb.st_mode))
        return ct_error(CT_EINVAL, "%s is not a regular file or a directory (a pipe or a device?); give a checkpoint "
                        "file or a sharded checkpoint's directory", path);
    return CT_OK;
}

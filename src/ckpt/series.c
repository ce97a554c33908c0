/*
 * A series of checkpoints: keep_last K (`--save CKPT --keep-last K`) writes every save
 * under its own name, CKPT with the step in it (run.safetensors ->
 * run-step00000100.safetensors and its run-step00000100.optim.safetensors;
 * a sharded directory ckpt -> ckpt-step00000100), each committed as one
 * unit, and once a save verifies removes all but the K newest members
 * that verify.  ct_checkpoint_latest (`--resume latest`) finds the newest
 * member that verifies (or CKPT itself, saved without keep_last), or none,
 * so a preemptible job can be restarted with the same command line.
 * "Verifies" is ct_checkpoint_verify: it would load.
 */
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define EXT ".safetensors"
#define TAG "-step"
#define DIGITS 8

/* Splits path into dir ("." if none), the stem before the step tag and the extension. */
static void split(const char *path, char *dir, size_t dn, char *stem, size_t sn, const char **ext)
{
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    if (slash) snprintf(dir, dn, "%.*s", (int)(slash == path ? 1 : slash - path), path);
    else snprintf(dir, dn, ".");
    size_t bl = strlen(base), el = sizeof EXT - 1;
    int has_ext = bl > el && !strcmp(base + bl - el, EXT);
    *ext = has_ext ? EXT : "";
    snprintf(stem, sn, "%.*s", (int)(has_ext ? bl - el : bl), base);
}

void ct_checkpoint_series_path(const char *path, int64_t step, char *buf, size_t n)
{
    size_t pl = strlen(path), el = sizeof EXT - 1;
    int has_ext = pl > el && !strcmp(path + pl - el, EXT);
    while (pl > 1 && !has_ext && path[pl - 1] == '/') pl--; /* "dir/" */
    snprintf(buf, n, "%.*s" TAG "%0*lld%s", (int)(has_ext ? pl - el : pl), path, DIGITS, (long long)step,
             has_ext ? EXT : "");
}

/* The step of directory entry name when it is a member of the series
 * (stem, ext); -1 otherwise. */
static int64_t member_step(const char *name, const char *stem, const char *ext)
{
    size_t sl = strlen(stem), tl = sizeof TAG - 1, el = strlen(ext), nl = strlen(name);
    if (nl <= sl + tl + el || strncmp(name, stem, sl) || strncmp(name + sl, TAG, tl)) return -1;
    const char *d = name + sl + tl;
    size_t dl = nl - sl - tl - el;
    if (strcmp(name + nl - el, ext) || dl < DIGITS || dl > 18) return -1;
    for (size_t i = 0; i < dl; i++)
        if (d[i] < '0' || d[i] > '9') return -1;
    return strtoll(d, NULL, 10);
}

/* Steps of the series' members in dir, newest first, into *steps (caller frees). */
static ct_status list_members(const char *path, int64_t **steps, int *n)
{
    char dir[4096], stem[1024];
    const char *ext;
    split(path, dir, sizeof dir, stem, sizeof stem, &ext);
    *steps = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? CT_OK : ct_error(CT_EIO, "cannot read %s: %s", dir, strerror(errno));
    int cap = 0;
    struct dirent *e;
    ct_status st = CT_OK;
    while ((e = readdir(d)) && st == CT_OK) {
        int64_t s = member_step(e->d_name, stem, ext);
        if (s < 0) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            int64_t *g = ct_alloc(sizeof *g * (size_t)cap, CT_MEM_OTHER);
            if (!g) {
                st = CT_ENOMEM;
                break;
            }
            if (*n) memcpy(g, *steps, sizeof *g * (size_t)*n);
            ct_free(*steps);
            *steps = g;
        }
        int i = (*n)++;
        for (; i > 0 && (*steps)[i - 1] < s; i--) (*steps)[i] = (*steps)[i - 1]; /* newest first */
        (*steps)[i] = s;
    }
    closedir(d);
    return st;
}

/* A member counts as a checkpoint only when it verifies: it loads, with its
 * optimizer state, exactly as --resume would load it (ct_checkpoint_verify).
 * An empty directory a failed save left, or a damaged member, is none. */
static int verifies(const char *ck)
{
    ct_ckpt_verified v;
    if (ct_checkpoint_verify(ck, 1, &v) == CT_OK) return 1;
    ct_clear_error();
    return 0;
}

/* What a save that failed or was killed leaves: a member without the file
 * that makes it one (its index, or its optimizer state), so no load could
 * ever use it.  A member that has both but does not verify is damaged, not
 * unfinished: it is not counted, but left for the user to look at. */
static int unfinished(const char *ck)
{
    char side[4096];
    struct stat sb;
    if (ct__ckpt_recover(NULL, ck) != CT_OK) {
        ct_clear_error();
        return 0;
    }
    if (stat(ck, &sb) != 0) return 0;
    if (S_ISDIR(sb.st_mode)) {
        char idx[4200];
        snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", ck);
        if (access(idx, F_OK) != 0) return 1;
    }
    ct_checkpoint_optim_path(ck, side, sizeof side);
    return access(side, F_OK) != 0;
}

/* The step a checkpoint saved without keep_last is at, -1 if unreadable. */
static int64_t saved_step(const char *ck)
{
    ct_safetensors *st;
    if (ct_safetensors_load(ck, &st) != CT_OK) {
        ct_clear_error();
        return -1;
    }
    const char *s = ct_safetensors_meta(st, "ctrain.step");
    int64_t v = s ? strtoll(s, NULL, 10) : -1;
    ct_safetensors_destroy(st);
    return v;
}

/* Rank 0: the newest complete checkpoint of the series into buf ("" if none). */
static ct_status find_latest(const char *save, char *buf, size_t n)
{
    int64_t *steps;
    int count;
    buf[0] = 0;
    CT_TRY(list_members(save, &steps, &count));
    int64_t best = -1;
    for (int i = 0; i < count; i++) {
        char p[4096];
        ct_checkpoint_series_path(save, steps[i], p, sizeof p);
        if (verifies(p)) {
            best = steps[i];
            snprintf(buf, n, "%s", p);
            break;
        }
    }
    ct_free(steps);
    struct stat sb;
    if (stat(save, &sb) == 0 && verifies(save)) {
        int64_t s = saved_step(save);
        if (s > best) snprintf(buf, n, "%s", save);
    }
    return CT_OK;
}

ct_status ct_checkpoint_latest(ct_group *g, const char *save, char *buf, size_t n)
{
    if (!save || !buf || !n) return ct__ckpt_check(g, ct_error(CT_EINVAL, "ct_checkpoint_latest: no path or no buffer"));
    ct_status st = ct__ckpt_check(g, !g || ct_group_rank(g) == 0 ? find_latest(save, buf, n) : CT_OK);
    if (st == CT_OK && g) st = ct_group_broadcast(g, buf, (int64_t)n, CT_U8, 0, NULL);
    buf[n - 1] = 0;
    return st;
}

/* Removes a member: the part that makes it complete goes first, so a crash
 * half-way leaves something --resume latest passes over. */
static ct_status remove_member(const char *ck)
{
    char side[4096], path[4400];
    struct stat sb;
    if (stat(ck, &sb) != 0) return CT_OK;
    if (!S_ISDIR(sb.st_mode)) {
        ct_checkpoint_optim_path(ck, side, sizeof side);
        if ((unlink(side) != 0 && errno != ENOENT) || unlink(ck) != 0)
            return ct_error(CT_EIO, "keep_last (--keep-last): cannot remove the old checkpoint %s: %s", ck, strerror(errno));
        return CT_OK;
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", ck);
    if (unlink(path) != 0 && errno != ENOENT)
        return ct_error(CT_EIO, "keep_last (--keep-last): cannot remove %s: %s", path, strerror(errno));
    DIR *d = opendir(ck);
    if (!d) return ct_error(CT_EIO, "keep_last (--keep-last): cannot read %s: %s", ck, strerror(errno));
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(path, sizeof path, "%s/%s", ck, e->d_name);
            unlink(path);
        }
    closedir(d);
    if (rmdir(ck) != 0)
        return ct_error(CT_EIO, "keep_last (--keep-last): cannot remove the old checkpoint %s: %s", ck, strerror(errno));
    return CT_OK;
}

/* Rank 0, after a save to newest: removes all but the keep newest members
 * that verify, and the unfinished ones a failed or killed save left.
 * Nothing goes unless newest itself verifies, so a save that went wrong
 * never costs a checkpoint, and the newest verifiable member always stays
 * (keep >= 1). */
static ct_status prune(const char *save, const char *newest, int64_t keep)
{
    ct_ckpt_verified v;
    ct_status st = ct_checkpoint_verify(newest, 1, &v);
    if (st != CT_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", ct_last_error());
        return ct_error(st, "keep_last (--keep-last): the checkpoint just saved does not verify, so no older one is removed: "
                        "%s", why);
    }
    int64_t *steps;
    int count;
    CT_TRY(list_members(save, &steps, &count));
    int64_t kept = 0;
    for (int i = 0; i < count && st == CT_OK; i++) {
        char p[4096];
        ct_checkpoint_series_path(save, steps[i], p, sizeof p);
        if (!strcmp(p, newest) || verifies(p)) {
            if (++kept > keep) st = remove_member(p);
        } else if (unfinished(p)) {
            st = remove_member(p);
        }
    }
    ct_free(steps);
    return st;
}

ct_status ct__ckpt_prune(ct_group *g, const char *save, const char *newest, int64_t keep)
{
    return ct__ckpt_check(g, !g || ct_group_rank(g) == 0 ? prune(save, newest, keep) : CT_OK);
}

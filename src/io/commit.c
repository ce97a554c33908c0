/*
 * Checkpoints that commit as one unit (io.h says how to use it): a redo
 * journal.  The parts are complete and fsynced under staged names before
 * the journal exists; the journal's atomic write is the commit point; the
 * renames after it are repeatable, so whoever finds a journal (the next
 * save, or a reader) finishes them.  The journal is text:
 *
 *   ctrain-commit 1
 *   <final file name of part 1>          (bare names in the journal's directory)
 *   ...
 */
#include "internal.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define STAGED ".staged"
#define JOURNAL ".commit"
#define MAGIC "ctrain-commit 1\n"
#define JOURNAL_MAX (1 << 20)

ct_status ct_ckpt_staged_path(const char *final, char *buf, size_t n)
{
    if ((size_t)snprintf(buf, n, "%s" STAGED, final) >= n)
        return ct_error(CT_EINVAL, "%s: path too long for its staged name", final);
    return CT_OK;
}

/* Length of path's directory part including the '/' (0: current directory). */
static size_t dir_len(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? (size_t)(slash - path) + 1 : 0;
}

/* Why name cannot be a part's bare file name, or NULL. */
static const char *bad_name(const char *name, size_t len)
{
    if (!len) return "is empty";
    if (memchr(name, '/', len) || memchr(name, '\n', len) || memchr(name, 0, len)) return "holds '/' or a newline";
    if ((len == 1 && name[0] == '.') || (len == 2 && !memcmp(name, "..", 2))) return "is . or ..";
    return NULL;
}

/* Renames dir/name.staged over dir/name when the staged file exists. */
static ct_status apply_one(const char *anchor, size_t dl, const char *name, size_t len)
{
    char final[4096], staged[4112];
    if (dl + len >= sizeof final) return ct_error(CT_EINVAL, "%s: part name too long", anchor);
    snprintf(final, sizeof final, "%.*s%.*s", (int)dl, anchor, (int)len, name);
    snprintf(staged, sizeof staged, "%s" STAGED, final);
    struct stat sb;
    if (stat(staged, &sb) != 0) {
        if (errno == ENOENT && stat(final, &sb) == 0) return CT_OK; /* renamed before the crash */
        return ct_error(CT_EIO, "%s: the commit of this checkpoint lists %s, but neither it nor %s exists; the "
                        "checkpoint was damaged by hand: save it again", anchor, final, staged);
    }
    if (ct__io_point() || rename(staged, final) != 0)
        return ct_error(CT_EIO, "%s: cannot rename %s over %s to finish its commit: %s; make the directory "
                        "writable", anchor, staged, final, strerror(errno));
    return CT_OK;
}

/* Applies the journal text j[0..len) (renames), then removes the journal. */
static ct_status apply_journal(const char *anchor, const char *jpath, const char *j, size_t len)
{
    size_t ml = sizeof MAGIC - 1, dl = dir_len(anchor);
    if (len < ml || memcmp(j, MAGIC, ml) || j[len - 1] != '\n')
        return ct_error(CT_EFORMAT, "%s is not a ctrain commit journal; remove it if you put it there", jpath);
    for (size_t at = ml; at < len;) {
        const char *nl = memchr(j + at, '\n', len - at);
        size_t l = (size_t)(nl - (j + at));
        const char *why = bad_name(j + at, l);
        if (why) return ct_error(CT_EFORMAT, "%s: a part's name %s; remove the journal and save again", jpath, why);
        CT_TRY(apply_one(anchor, dl, j + at, l));
        at += l + 1;
    }
    CT_TRY(ct__sync_dir(anchor));
    if ((ct__io_point() || unlink(jpath) != 0) && errno != ENOENT)
        return ct_error(CT_EIO, "%s: cannot remove the finished commit journal: %s", jpath, strerror(errno));
    return ct__sync_dir(anchor);
}

ct_status ct_ckpt_recover(const char *anchor)
{
    char jpath[4096];
    if ((size_t)snprintf(jpath, sizeof jpath, "%s" JOURNAL, anchor) >= sizeof jpath)
        return ct_error(CT_EINVAL, "%s: path too long", anchor);
    struct stat sb;
    if (lstat(jpath, &sb) != 0 && errno == ENOENT) return CT_OK;
    FILE *f;
    CT_TRY(ct__open_regular(jpath, &f, &sb)); /* never blocks on a FIFO put in its place */
    char *buf = ct_alloc(JOURNAL_MAX, CT_MEM_OTHER);
    if (!buf) {
        fclose(f);
        return CT_ENOMEM;
    }
    size_t len = fread(buf, 1, JOURNAL_MAX, f);
    int bad = ferror(f) || len == JOURNAL_MAX;
    fclose(f);
    ct_status s = bad ? ct_error(CT_EFORMAT, "%s: unreadable or over 1 MiB; remove it and save again", jpath)
                      : apply_journal(anchor, jpath, buf, len);
    ct_free(buf);
    return s;
}

ct_status ct_ckpt_commit(const char *anchor, const char *const *finals, int n)
{
    CT_ASSERT(anchor && n >= 0 && (n == 0 || finals));
    size_t dl = dir_len(anchor);
    ct__buf j = {0};
    ct__buf_puts(&j, MAGIC);
    ct_status s = CT_OK;
    for (int i = 0; i < n && s == CT_OK; i++) {
        const char *name = finals[i] + dir_len(finals[i]);
        char staged[4112];
        struct stat sb;
        if (dir_len(finals[i]) != dl || strncmp(finals[i], anchor, dl))
            s = ct_error(CT_EINVAL, "%s: part %s is not in the checkpoint's directory", anchor, finals[i]);
        else if (bad_name(name, strlen(name)))
            s = ct_error(CT_EINVAL, "%s: part '%s' %s", anchor, finals[i], bad_name(name, strlen(name)));
        else if (ct_ckpt_staged_path(finals[i], staged, sizeof staged) == CT_OK && stat(staged, &sb) != 0)
            s = ct_error(CT_EIO, "%s: part %s was not written (%s: %s)", anchor, finals[i], staged, strerror(errno));
        else {
            ct__buf_puts(&j, name);
            ct__buf_puts(&j, "\n");
        }
    }
    if (s == CT_OK && j.failed) s = CT_ENOMEM;
    char jpath[4096];
    if (s == CT_OK && (size_t)snprintf(jpath, sizeof jpath, "%s" JOURNAL, anchor) >= sizeof jpath)
        s = ct_error(CT_EINVAL, "%s: path too long", anchor);
    if (s == CT_OK) {
        ct__afile af;
        s = ct__afile_open(&af, jpath);
        if (s == CT_OK) s = ct__afile_write(&af, j.p, j.len);
        if (s == CT_OK) s = ct__afile_commit(&af); /* the commit point */
        else ct__afile_abort(&af);
    }
    if (s == CT_OK) s = apply_journal(anchor, jpath, j.p, j.len);
    ct__buf_free(&j);
    return s;
}

/* Removes dir's files named prefix + anything (prefix a bare name). */
static void remove_prefixed(const char *final, const char *suffix)
{
    size_t dl = dir_len(final);
    char dir[4096], pre[4200], path[8400];
    snprintf(dir, sizeof dir, "%.*s", dl ? (int)dl : 1, dl ? final : ".");
    snprintf(pre, sizeof pre, "%s%s", final + dl, suffix);
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, pre, strlen(pre))) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            unlink(path);
        }
    closedir(d);
}

int ct_ckpt_discard(const char *anchor, const char *const *finals, int n)
{
    char jpath[4096];
    struct stat sb;
    snprintf(jpath, sizeof jpath, "%s" JOURNAL, anchor);
    if (lstat(jpath, &sb) == 0) return 0; /* committed: the staged parts are the unit's, ct_ckpt_recover renames them */
    /* A staged part without a journal: certainly before the commit point.
     * None at all may also be after it (all renamed, journal removed). */
    int before = 0;
    for (int i = 0; i < n; i++) {
        char staged[4112];
        if (ct_ckpt_staged_path(finals[i], staged, sizeof staged) != CT_OK) continue;
        before |= unlink(staged) == 0;
        remove_prefixed(finals[i], STAGED ".tmp."); /* a killed write of the staged part */
        remove_prefixed(finals[i], ".tmp.");        /* a killed in-place write */
    }
    return before;
}

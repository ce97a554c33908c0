/*
 * Atomic file replacement for everything src/io writes (safetensors files,
 * sharded-checkpoint indexes): the bytes go to path.tmp.<pid>, which is
 * flushed, fsync'd and renamed over path, and then the directory is fsync'd
 * so the rename itself survives a crash.  A reader sees the old file or the
 * new one, never a mix; a failure leaves no temp file behind.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

ct_status ct__afile_open(ct__afile *a, const char *path)
{
    memset(a, 0, sizeof *a);
    a->path = path;
    size_t tlen = strlen(path) + 32;
    a->tmp = ct_alloc_zeroed(tlen, CT_MEM_OTHER);
    if (!a->tmp) return CT_ENOMEM;
    snprintf(a->tmp, tlen, "%s.tmp.%d", path, (int)getpid());
    a->f = fopen(a->tmp, "wb");
    if (!a->f) {
        ct_status s = ct_error(CT_EIO, "%s: cannot create: %s", a->tmp, strerror(errno));
        ct_free(a->tmp);
        a->tmp = NULL;
        return s;
    }
    return CT_OK;
}

ct_status ct__afile_write(ct__afile *a, const void *p, size_t n)
{
    if (n && fwrite(p, 1, n, a->f) != n)
        return ct_error(CT_EIO, "%s: write failed: %s; is the disk full?", a->tmp, strerror(errno));
    return CT_OK;
}

/* Makes a completed rename durable. */
static ct_status sync_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return ct_error(CT_EIO, "%s: cannot open directory to sync: %s", dir, strerror(errno));
    int r = fsync(fd), e = errno;
    close(fd);
    /* Some file systems cannot fsync a directory; the data is still written. */
    if (r != 0 && e != EINVAL && e != ENOTSUP)
        return ct_error(CT_EIO, "%s: fsync of directory failed: %s", dir, strerror(e));
    return CT_OK;
}

ct_status ct__afile_commit(ct__afile *a)
{
    ct_status s;
    if (fflush(a->f) != 0 || fsync(fileno(a->f)) != 0) {
        s = ct_error(CT_EIO, "%s: flush failed: %s; is the disk full?", a->tmp, strerror(errno));
        goto out_abort;
    }
    int r = fclose(a->f);
    a->f = NULL;
    if (r != 0) {
        s = ct_error(CT_EIO, "%s: close failed: %s", a->tmp, strerror(errno));
        goto out_abort;
    }
    if (rename(a->tmp, a->path) != 0) {
        s = ct_error(CT_EIO, "%s: cannot rename %s over it: %s", a->path, a->tmp, strerror(errno));
        goto out_abort;
    }
    ct_free(a->tmp);
    a->tmp = NULL;
    return sync_dir(a->path);
out_abort:
    ct__afile_abort(a);
    return s;
}

void ct__afile_abort(ct__afile *a)
{
    if (a->f) fclose(a->f);
    a->f = NULL;
    if (a->tmp) unlink(a->tmp);
    ct_free(a->tmp);
    a->tmp = NULL;
}

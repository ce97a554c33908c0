/*
 * Atomic file replacement for everything src/io writes (safetensors files,
 * sharded-checkpoint indexes): the bytes go to path.tmp.<pid>, which is
 * flushed, fsync'd and renamed over path, and then the directory is fsync'd
 * so the rename itself survives a crash.  A reader sees the old file or the
 * new one, never a mix; a failure leaves no temp file behind.  And the one
 * way src/io opens a file to read (ct__open_regular): a FIFO, device or
 * socket in a checkpoint is an error, never a read that blocks forever.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Crash and full-disk testing: with CTRAIN_FAULT_KILL_AT=k in the
 * environment, the k-th point at which a checkpoint write touches the file
 * system (create, each write, fsync, rename, unlink) kills the process with
 * SIGKILL before doing it; with CTRAIN_FAULT_FAIL_AT=k that step fails
 * with ENOSPC instead (a full disk), so a test can stop a save at every one
 * of its steps in turn.  Returns -1 (errno ENOSPC) for the failing step. */
int ct__io_point(void)
{
    static long kill_at = -1, fail_at, count;
    if (kill_at < 0) {
        const char *k = getenv("CTRAIN_FAULT_KILL_AT"), *f = getenv("CTRAIN_FAULT_FAIL_AT");
        kill_at = k && *k ? strtol(k, NULL, 10) : 0;
        fail_at = f && *f ? strtol(f, NULL, 10) : 0;
    }
    if (!kill_at && !fail_at) return 0;
    ++count;
    if (count == kill_at) raise(SIGKILL);
    if (count == fail_at) {
        errno = ENOSPC;
        return -1;
    }
    return 0;
}

ct_status ct__afile_open(ct__afile *a, const char *path)
{
    memset(a, 0, sizeof *a);
    a->path = path;
    size_t tlen = strlen(path) + 32;
    a->tmp = ct_alloc_zeroed(tlen, CT_MEM_OTHER);
    if (!a->tmp) return CT_ENOMEM;
    snprintf(a->tmp, tlen, "%s.tmp.%d", path, (int)getpid());
    a->f = ct__io_point() ? NULL : fopen(a->tmp, "wb");
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
    if (n && (ct__io_point() || fwrite(p, 1, n, a->f) != n))
        return ct_error(CT_EIO, "%s: write failed: %s; is the disk full?", a->tmp, strerror(errno));
    return CT_OK;
}

ct_status ct__afile_pwrite(ct__afile *a, const void *p, size_t n, uint64_t off)
{
    if (ct__io_point() || fflush(a->f) != 0) /* what fwrite buffered goes first */
        return ct_error(CT_EIO, "%s: write failed: %s; is the disk full?", a->tmp, strerror(errno));
    for (size_t done = 0; done < n;) {
        ssize_t r = pwrite(fileno(a->f), (const char *)p + done, n - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return ct_error(CT_EIO, "%s: write failed: %s; is the disk full?", a->tmp, strerror(errno));
        done += (size_t)r;
    }
    return CT_OK;
}

/* Makes a completed rename durable. */
ct_status ct__sync_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    int fd = ct__io_point() ? -1 : open(dir, O_RDONLY | O_DIRECTORY);
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
    if (ct__io_point() || fflush(a->f) != 0 || fsync(fileno(a->f)) != 0) {
        s = ct_error(CT_EIO, "%s: flush failed: %s; is the disk full?", a->tmp, strerror(errno));
        goto out_abort;
    }
    int r = fclose(a->f);
    a->f = NULL;
    if (r != 0) {
        s = ct_error(CT_EIO, "%s: close failed: %s", a->tmp, strerror(errno));
        goto out_abort;
    }
    if (ct__io_point() || rename(a->tmp, a->path) != 0) {
        s = ct_error(CT_EIO, "%s: cannot rename %s over it: %s", a->path, a->tmp, strerror(errno));
        goto out_abort;
    }
    ct_free(a->tmp);
    a->tmp = NULL;
    return ct__sync_dir(a->path);
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

ct_status ct__open_regular(const char *path, FILE **f, struct stat *sb)
{
    *f = NULL;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
     * writer forever.  The kernel resolves a symlink once, and fstat checks
     * the very file opened, so nothing can swap it between check and read. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return ct_error(CT_EIO, "%s: cannot open: %s", path, strerror(errno));
    if (fstat(fd, sb) != 0) {
        int e = errno;
        close(fd);
        return ct_error(CT_EIO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb->st_mode)) {
        close(fd);
        return ct_error(CT_EINVAL, "%s is not a regular file (%s); a checkpoint's files are regular files: "
                        "remove it, or give the path of the real file", path,
                        S_ISFIFO(sb->st_mode) ? "a FIFO" : S_ISDIR(sb->st_mode) ? "a directory"
                        : S_ISSOCK(sb->st_mode) ? "a socket" : "a device");
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0 || !(*f = fdopen(fd, "rb"))) {
        int e = errno;
        close(fd);
        return ct_error(CT_EIO, "%s: cannot open: %s", path, strerror(e));
    }
    return CT_OK;
}

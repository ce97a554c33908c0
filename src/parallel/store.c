/*
 * The store, shared by offload's slices and FSDP's offloaded shards: one
 * I/O thread that runs jobs (read a piece into memory, write it back and
 * release it) in queue order while the caller computes, over a back end (a struct of function pointers): a file on
 * local disk, or a memory pool.  The file is unlinked right after it is
 * created, so it disappears however the process ends; its space is
 * reserved up front so a full disk is an error at set-up, not mid-step.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sys/statvfs.h>

#include "store.h"

#define QCAP 64

typedef struct {
    ct__io_piece p[CT__IO_MAX_PIECES];
    int n;
} job;

/* A back end: whole transfers at byte offsets, errno on failure. */
typedef struct {
    int (*rw)(void *ctx, int write, void *buf, size_t bytes, off_t off);
    void (*close)(void *ctx);
} backend;

struct ct__ostore {
    const backend *be;
    void *ctx;
    size_t bytes;
    char dir[CT__STORE_DIR_MAX];
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;       /* the thread waits for jobs; callers wait for completion */
    job q[QCAP];
    long submitted, done;    /* tickets: job k (1-based) is done when done >= k */
    int stop;
    /* first failure: sticky */
    int err_errno;
    char err_alloc[256]; /* ENOMEM: the I/O thread's own allocation message */
    int err_write;
    size_t err_bytes;
    off_t err_off;
    double busy, waited;     /* seconds: thread in I/O, callers in wait */
    double rd, wr;           /* bytes moved */
};

/* Fault injection for tests (ct_offload_fail_io_after): the n-th store I/O
 * from now fails, as a full disk (ENOSPC) for a write or EIO for a read. */
static _Atomic long fail_after = -1;

void ct_offload_fail_io_after(long n) { atomic_store(&fail_after, n); }

static int injected(void)
{
    long v = atomic_load(&fail_after);
    while (v >= 0) {
        if (atomic_compare_exchange_weak(&fail_after, &v, v - 1)) return v == 0;
    }
    return 0;
}

/* ---- the file back end ---------------------------------------------------- */

/* Direct I/O moves whole blocks of this many bytes at offsets and
 * addresses that are multiples of it. */
#define DIRECT_ALIGN 4096

typedef struct {
    int fd;
    int direct_fd; /* the same file opened O_DIRECT, or -1 */
    int drop_cache;
    double direct; /* bytes moved by direct I/O */
} file_ctx;

/* All of bytes through fd, or an errno. */
static int rw_all(int fd, int write, char *buf, size_t bytes, off_t off)
{
    size_t done = 0;
    while (done < bytes) {
        ssize_t r = write ? pwrite(fd, buf + done, bytes - done, off + (off_t)done)
                          : pread(fd, buf + done, bytes - done, off + (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return write ? ENOSPC : EIO; /* a short file: it was truncated under us */
        done += (size_t)r;
    }
    return 0;
}

/* With drop_cache the store keeps nothing in the page cache.  Blocks that
 * are aligned go by direct I/O, straight between the disk and the caller's
 * memory: no copy through the page cache and no dropping afterwards, the
 * kernel time that made up much of fsdp offload's overhead on two cores.
 * The rest (a small piece's, a part's tail) goes through the page cache,
 * written back and dropped at once. */
static int file_rw(void *ctx, int write, void *buf, size_t bytes, off_t off)
{
    file_ctx *fc = ctx;
    size_t head = 0;
    if (fc->direct_fd >= 0 && (uintptr_t)buf % DIRECT_ALIGN == 0 && off % DIRECT_ALIGN == 0)
        head = bytes / DIRECT_ALIGN * DIRECT_ALIGN;
    if (head) {
        int e = rw_all(fc->direct_fd, write, buf, head, off);
        if (e != EINVAL) {
            if (e) return e;
            fc->direct += (double)head;
        } else { /* a filesystem that takes O_DIRECT at open but not these transfers */
            close(fc->direct_fd);
            fc->direct_fd = -1;
            head = 0;
        }
    }
    if (head == bytes) return 0;
    char *rest = (char *)buf + head;
    off_t at = off + (off_t)head;
    size_t n = bytes - head;
    int e = rw_all(fc->fd, write, rest, n, at);
    if (e) return e;
    if (fc->drop_cache) {
        /* Written pages must reach the disk before the kernel can drop them;
         * read pages are clean and drop at once. */
        if (write) (void)sync_file_range(fc->fd, at, (off_t)n, SYNC_FILE_RANGE_WAIT_BEFORE |
                                         SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
        (void)posix_fadvise(fc->fd, at, (off_t)n, POSIX_FADV_DONTNEED);
    }
    return 0;
}

static void file_close(void *ctx)
{
    file_ctx *fc = ctx;
    close(fc->fd);
    if (fc->direct_fd >= 0) close(fc->direct_fd);
    ct_free(fc);
}

static const backend file_backend = {file_rw, file_close};

/* Creates the unlinked file in dir and reserves bytes. */
static ct_status file_open(const char *dir, size_t bytes, int drop_cache, void **out)
{
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return ct_error(CT_EIO, "offload directory '%s': %s; create it or pass --offload-dir with an "
                        "existing directory", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return ct_error(CT_EIO, "offload directory '%s' is not a directory; pass --offload-dir with a directory", dir);
    file_ctx *fc = ct_alloc_zeroed(sizeof *fc, CT_MEM_OTHER);
    if (!fc) return CT_ENOMEM;
    fc->drop_cache = drop_cache;
    char path[CT__STORE_DIR_MAX + 64];
    snprintf(path, sizeof path, "%s/ctrain-offload-%ld-XXXXXX", dir, (long)getpid());
    fc->fd = mkstemp(path);
    if (fc->fd < 0) {
        int e = errno;
        ct_free(fc);
        return ct_error(CT_EIO, "cannot create the offload file in '%s': %s; pass --offload-dir with a "
                        "directory you can write", dir, strerror(e));
    }
    /* The same file once more for direct I/O, while it has a name (tmpfs
     * and some others refuse O_DIRECT: the page cache path then does all). */
    fc->direct_fd = drop_cache ? open(path, O_RDWR | O_DIRECT) : -1;
    /* Gone from the directory now; the descriptors keep the space until close. */
    unlink(path);
    int e = bytes ? posix_fallocate(fc->fd, 0, (off_t)bytes) : 0;
    if (e == EOPNOTSUPP || e == EINVAL) e = ftruncate(fc->fd, (off_t)bytes) ? errno : 0; /* no reservation there */
    if (e) {
        file_close(fc);
        struct statvfs vs; /* the free space, so the message says how short the disk is */
        double avail = statvfs(dir, &vs) == 0 ? (double)vs.f_bavail * (double)vs.f_frsize : -1.0;
        return ct_error(CT_EIO, "cannot reserve %zu bytes (%.1f MiB) for the offload store in '%s': %s "
                        "(%.1f MiB free there); free space or pass --offload-dir on a filesystem with room",
                        bytes, (double)bytes / 1048576.0, dir, strerror(e), avail / 1048576.0);
    }
    *out = fc;
    return CT_OK;
}

/* ---- the memory back end: a pool of the store's size ------------------------ */

static int mem_rw(void *ctx, int write, void *buf, size_t bytes, off_t off)
{
    char *pool = ctx;
    if (write) memcpy(pool + off, buf, bytes);
    else memcpy(buf, pool + off, bytes);
    return 0;
}

static void mem_close(void *ctx) { ct_free(ctx); }

static const backend mem_backend = {mem_rw, mem_close};

/* ---- jobs ------------------------------------------------------------------- */

/* Whole transfer or an errno. */
static int xfer(ct__ostore *o, int write, void *buf, size_t bytes, off_t off)
{
    if (injected()) return write ? ENOSPC : EIO;
    int e = o->be->rw(o->ctx, write, buf, bytes, off);
    if (!e && write) o->wr += (double)bytes;
    else if (!e) o->rd += (double)bytes;
    return e;
}

static ct_status failure(ct__ostore *o)
{
    if (o->err_errno == ENOMEM) /* no memory to read a slice into: not the disk's fault */
        return ct_error(CT_ENOMEM, "offload store: %s, reading %zu bytes back; lower --max-resident-mb, or use "
                        "more --slices (offload) or more units (fsdp)", o->err_alloc, o->err_bytes);
    if (o->err_errno == ENOSPC || o->err_errno == EFBIG || o->err_errno == EDQUOT)
        return ct_error(CT_EIO, "offload store in '%s': %s writing %zu bytes at offset %lld; the store "
                        "needs %zu bytes there: free space, or pass --offload-dir on a filesystem with room",
                        o->dir, strerror(o->err_errno), o->err_bytes, (long long)o->err_off, o->bytes);
    return ct_error(CT_EIO, "offload store in '%s': %s %s %zu bytes at offset %lld; check the disk under "
                    "that directory or pass --offload-dir elsewhere",
                    o->dir, strerror(o->err_errno), o->err_write ? "writing" : "reading", o->err_bytes,
                    (long long)o->err_off);
}

/* Runs one piece; errno on failure (0 ok). */
static int run_piece(ct__ostore *o, const ct__io_piece *p)
{
    ct_storage *st = p->st;
    switch (p->op) {
    case CT__IO_READ:
    case CT__IO_ALLOC:
        if (ct_storage_alloc_data(st, 0) != CT_OK) {
            snprintf(o->err_alloc, sizeof o->err_alloc, "%s", ct_last_error()); /* this thread's message */
            return ENOMEM;
        }
        return p->op == CT__IO_READ ? xfer(o, 0, ct_storage_ptr(st), st->bytes, p->off) : 0;
    case CT__IO_WRITE:
    case CT__IO_SAVE: {
        int e = ct_storage_has_data(st) ? xfer(o, 1, ct_storage_ptr(st), st->bytes, p->off) : 0;
        if (e) return e;
        if (p->op == CT__IO_WRITE) ct_storage_free_data(st);
        return 0;
    }
    default:
        ct_storage_free_data(st);
        return 0;
    }
}

static void *io_main(void *arg)
{
    ct__ostore *o = arg;
    ct_parallel_serial_here(); /* the compute thread's team has the cores */
    pthread_mutex_lock(&o->mu);
    for (;;) {
        while (!o->stop && o->done == o->submitted) pthread_cond_wait(&o->cv, &o->mu);
        if (o->done == o->submitted) break; /* stop, queue empty */
        /* submit never writes the slot of a job not yet done: read it unlocked */
        const job *j = &o->q[o->done % QCAP];
        int failed = o->err_errno != 0;
        pthread_mutex_unlock(&o->mu);
        double t0 = ct_now();
        int e = 0;
        const ct__io_piece *bad = NULL;
        /* After a failure the store is lost; later jobs still release memory. */
        for (int k = 0; k < j->n; k++) {
            if (failed || e) {
                if (j->p[k].op == CT__IO_WRITE || j->p[k].op == CT__IO_DROP) ct_storage_free_data(j->p[k].st);
                continue;
            }
            if ((e = run_piece(o, &j->p[k]))) bad = &j->p[k];
        }
        double t1 = ct_now();
        pthread_mutex_lock(&o->mu);
        o->busy += t1 - t0;
        if (e && !o->err_errno) {
            o->err_errno = e;
            o->err_write = bad->op == CT__IO_WRITE || bad->op == CT__IO_SAVE;
            o->err_bytes = bad->st->bytes;
            o->err_off = bad->off;
        }
        o->done++;
        pthread_cond_broadcast(&o->cv);
    }
    pthread_mutex_unlock(&o->mu);
    return NULL;
}

ct_status ct__ostore_open(int memory, const char *dir, size_t bytes, int drop_cache, ct__ostore **out)
{
    *out = NULL;
    if (!dir || !*dir) dir = getenv("TMPDIR");
    if (!dir || !*dir) dir = "/tmp";
    if (strlen(dir) >= CT__STORE_DIR_MAX)
        return ct_error(CT_EINVAL, "offload dir '%.60s...' is longer than %d characters; give a shorter path",
                        dir, CT__STORE_DIR_MAX - 1);
    ct__ostore *o = ct_alloc_zeroed(sizeof *o, CT_MEM_OTHER);
    if (!o) return CT_ENOMEM;
    snprintf(o->dir, sizeof o->dir, "%s", memory ? "memory" : dir);
    o->bytes = bytes;
    ct_status st = CT_OK;
    if (memory) {
        /* Not resident by the report's definition (param + grad + optim): the
         * pool is where slices are not in use, as the file would be. */
        o->be = &mem_backend;
        if (!(o->ctx = ct_alloc(bytes ? bytes : 1, CT_MEM_OTHER)))
            st = ct_error(CT_ENOMEM, "offload store=memory: no room for a pool of %zu bytes (%.1f MiB); use "
                          "store=file", bytes, (double)bytes / 1048576.0);
    } else {
        o->be = &file_backend;
        st = file_open(dir, bytes, drop_cache, &o->ctx);
    }
    if (st != CT_OK) {
        ct_free(o);
        return st;
    }
    pthread_mutex_init(&o->mu, NULL);
    pthread_cond_init(&o->cv, NULL);
    int e = pthread_create(&o->th, NULL, io_main, o);
    if (e) {
        pthread_mutex_destroy(&o->mu);
        pthread_cond_destroy(&o->cv);
        o->be->close(o->ctx);
        ct_free(o);
        return ct_error(CT_ENOMEM, "cannot start the offload I/O thread: %s", strerror(e));
    }
    *out = o;
    return CT_OK;
}

void ct__ostore_close(ct__ostore *o)
{
    if (!o) return;
    pthread_mutex_lock(&o->mu);
    o->stop = 1;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
    pthread_join(o->th, NULL);
    pthread_mutex_destroy(&o->mu);
    pthread_cond_destroy(&o->cv);
    o->be->close(o->ctx);
    ct_free(o);
}

ct_status ct__ostore_submit(ct__ostore *o, const ct__io_piece *p, int n, long *ticket)
{
    CT_ASSERT(n >= 1 && n <= CT__IO_MAX_PIECES);
    pthread_mutex_lock(&o->mu);
    while (o->submitted - o->done >= QCAP) pthread_cond_wait(&o->cv, &o->mu);
    job *j = &o->q[o->submitted % QCAP];
    memcpy(j->p, p, sizeof *p * (size_t)n);
    j->n = n;
    *ticket = ++o->submitted;
    pthread_cond_broadcast(&o->cv);
    pthread_mutex_unlock(&o->mu);
    return CT_OK;
}

ct_status ct__ostore_wait(ct__ostore *o, long ticket)
{
    double t0 = ct_now();
    pthread_mutex_lock(&o->mu);
    while (o->done < ticket) pthread_cond_wait(&o->cv, &o->mu);
    o->waited += ct_now() - t0;
    ct_status st = o->err_errno ? failure(o) : CT_OK;
    pthread_mutex_unlock(&o->mu);
    return st;
}

ct_status ct__ostore_drain(ct__ostore *o)
{
    pthread_mutex_lock(&o->mu);
    long t = o->submitted;
    pthread_mutex_unlock(&o->mu);
    return ct__ostore_wait(o, t);
}

ct_status ct__ostore_rw(ct__ostore *o, int write, void *buf, size_t bytes, off_t off)
{
    CT_TRY(ct__ostore_drain(o));
    int e = xfer(o, write, buf, bytes, off);
    if (!e) return CT_OK;
    pthread_mutex_lock(&o->mu);
    o->err_errno = e;
    o->err_write = write;
    o->err_bytes = bytes;
    o->err_off = off;
    ct_status st = failure(o);
    pthread_mutex_unlock(&o->mu);
    return st;
}

void ct__ostore_times(ct__ostore *o, double *busy, double *waited)
{
    pthread_mutex_lock(&o->mu);
    *busy = o->busy;
    *waited = o->waited;
    o->busy = o->waited = 0;
    pthread_mutex_unlock(&o->mu);
}

void ct__ostore_bytes(const ct__ostore *o, double *rd, double *wr)
{
    *rd = o->rd;
    *wr = o->wr;
}

double ct__ostore_direct_bytes(const ct__ostore *o)
{
    return o->be == &file_backend ? ((const file_ctx *)o->ctx)->direct : 0.0;
}

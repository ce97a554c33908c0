/* Private to src/parallel: the store, where a strategy's bytes rest while
 * not in use (offload's slices, FSDP's offloaded shards): a back end (a file
 * or a memory pool) and one I/O thread. */
#ifndef CTRAIN_PARALLEL_STORE_H
#define CTRAIN_PARALLEL_STORE_H

#include <sys/types.h>

#include "internal.h"

/* Longest directory path the store takes. */
#define CT__STORE_DIR_MAX 4096

/* ---- the store: a back end and one I/O thread ----------------------------- */

/* The file back end: a file in a directory, unlinked as soon as it is
 * created so that nothing is left behind whatever way the process ends
 * (exit, error, a signal, even SIGKILL): the open descriptor keeps the
 * space until it is closed.  The memory back end: a pool of the store's
 * size.  One background thread runs jobs in the order they were queued; a
 * job moves memory between storages and the store. */
typedef struct ct__ostore ct__ostore;

/* One piece of a job.  READ: bring the storage's memory back
 * (ct_storage_alloc_data) and fill it from the file at off; WRITE: write the
 * storage's memory to off, then release it; SAVE: write it and keep it
 * (the caller may read it meanwhile, not change it); ALLOC: bring the
 * memory back without reading (contents undefined); DROP: release without
 * writing. */
enum { CT__IO_READ = 0, CT__IO_WRITE, CT__IO_SAVE, CT__IO_ALLOC, CT__IO_DROP };
typedef struct {
    ct_storage *st;
    off_t off;
    int op;
} ct__io_piece;
#define CT__IO_MAX_PIECES 4

/* memory 0: creates the file in dir (NULL or "": $TMPDIR, else /tmp) and
 * reserves bytes for it, so a full disk is found here, not in the middle of
 * a step; drop_cache: every read and write is followed by dropping those
 * pages from the page cache (written ones after writeback), so the store
 * costs disk time and not RAM.  CT_EIO naming the directory, the cause and
 * the fix.  memory 1: a pool of bytes (CT_MEM_OTHER), CT_ENOMEM. */
ct_status ct__ostore_open(int memory, const char *dir, size_t bytes, int drop_cache, ct__ostore **out);
/* Waits for queued jobs, stops the thread and closes (frees) the file. NULL: no-op. */
void ct__ostore_close(ct__ostore *o);
/* Queues a job of n pieces; returns its ticket (> 0) in *ticket.  Memory
 * of a READ/ALLOC storage is allocated by the I/O thread when the job runs,
 * after every job queued before it has released its memory: jobs in order
 * keep the resident set to what the caller planned. */
ct_status ct__ostore_submit(ct__ostore *o, const ct__io_piece *p, int n, long *ticket);
/* Waits until the job with this ticket (and every earlier one) has run.  A
 * job that failed makes this and every later wait fail with its message
 * (the store is then unusable: the data of the failed job is lost). */
ct_status ct__ostore_wait(ct__ostore *o, long ticket);
/* Waits for every queued job. */
ct_status ct__ostore_drain(ct__ostore *o);
/* Synchronous read or write of bytes at off, on the caller's thread (for
 * checkpoints, between steps, with the queue drained). */
ct_status ct__ostore_rw(ct__ostore *o, int write, void *buf, size_t bytes, off_t off);
/* Seconds the I/O thread spent in reads and writes, and the caller in
 * ct__ostore_wait, since the last call; both reset. */
void ct__ostore_times(ct__ostore *o, double *busy, double *waited);
/* Bytes read and written since open. */
void ct__ostore_bytes(const ct__ostore *o, double *rd, double *wr);
/* Of those, the bytes the file moved by direct I/O (page-aligned blocks). */
double ct__ostore_direct_bytes(const ct__ostore *o);

#endif

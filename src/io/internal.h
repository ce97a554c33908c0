/* Helpers shared inside src/io: a strict JSON parser for safetensors headers,
 * UTF-8 validation and a growable byte buffer. */
#ifndef CTRAIN_IO_INTERNAL_H
#define CTRAIN_IO_INTERNAL_H

#include <stdio.h>

#include "ctrain/io.h"

/* ---- JSON -------------------------------------------------------------- */

typedef enum { CT__JNULL, CT__JBOOL, CT__JINT, CT__JSTR, CT__JARR, CT__JOBJ } ct__jkind;

/* One JSON value.  Children of arrays and objects are linked by index, so
 * the node array can grow while parsing. */
typedef struct {
    ct__jkind kind;
    int32_t first;      /* ARR/OBJ: first child, -1 if empty */
    int32_t next;       /* next sibling, -1 at the end */
    int32_t count;      /* ARR/OBJ: number of children */
    int64_t ival;       /* INT value; BOOL 0 or 1 */
    const char *str;    /* STR: decoded, NUL-terminated */
    size_t len;         /* STR: bytes (a \u0000 escape makes len > strlen) */
    const char *key;    /* member of an OBJ: decoded key, NUL-terminated */
    size_t keylen;
    size_t pos;         /* byte offset in the text, for messages */
} ct__json;

/* A parsed document; node 0 is the root. */
typedef struct {
    ct__json *nodes;
    int32_t n, cap;
    char *strs;         /* decoded strings, sized so it never moves */
    size_t strs_used;
} ct__json_doc;

/* Parses text[0..len) as one JSON value: objects, arrays, strings (all
 * escapes, \uXXXX with surrogate pairs, UTF-8 checked), integers that fit
 * int64, true, false, null.  Fractions and exponents are rejected.  Errors
 * read "<what>: header JSON: <problem> at byte <n>". */
ct_status ct__json_parse(const char *text, size_t len, const char *what, ct__json_doc *doc);
/* The same for other documents: errors read "<what>: <label>: <problem> at
 * byte <n>; <hint>" (ct__json_parse: "header JSON", "the file is corrupt or
 * not safetensors"). */
ct_status ct__json_parse_as(const char *text, size_t len, const char *what, const char *label,
                            const char *hint, ct__json_doc *doc);
void ct__json_free(ct__json_doc *doc);

/* Offset of the first byte that is not valid UTF-8 (overlongs, surrogates
 * and code points past U+10FFFF are invalid), or n if all is valid. */
size_t ct__utf8_check(const char *s, size_t n);

/* ---- safetensors objects --------------------------------------------- */

/* A loaded file, or a sharded checkpoint presented as one (safetensors_index.c). */
struct ct_safetensors {
    int n;
    const char **names;    /* sorted; strings live in doc.strs or in parts */
    ct_tensor **tensors;   /* one reference each */
    int nmeta;
    const char **mkeys;    /* sorted */
    const char **mvals;
    ct__json_doc doc;      /* keeps the decoded strings (of the header, or of the index) */
    ct_safetensors **parts; /* sharded: the shard files, which own the tensor names */
    int nparts;
    char *numbuf;          /* sharded: integer metadata values written out as text */
    /* opened lazily (ct_safetensors_open): float tensors have no data until read */
    int lazy;
    int fd;                /* one file: open for positioned reads (-1: none) */
    char *path;            /* one file: for messages */
    int64_t *foff;         /* one file: [n] where each tensor's data starts in the file */
    uint32_t *crc;         /* one file: [n] each tensor's stored crc32, when has_crc */
    int has_crc;
    int64_t bytes_read;    /* one file: tensor bytes read since it was opened */
};

/* Sorts st's metadata by key (keys and values move together); CT_EFORMAT
 * naming path when a key appears twice. */
ct_status ct__st_sort_meta(const char *path, ct_safetensors *st);
/* Loads one safetensors file (never an index or a directory); lazy: only
 * its header, as ct_safetensors_open does. */
ct_status ct__st_load_file(const char *path, int lazy, ct_safetensors **out);
/* Loads a sharded checkpoint from its index file, or from a directory
 * holding its index (safetensors_index.c); lazy: its shards' headers only. */
ct_status ct__st_load_index(const char *index_path, int lazy, ct_safetensors **out);
ct_status ct__st_load_dir(const char *dir, int lazy, ct_safetensors **out);
/* A file, an index or a directory holding one (ct_safetensors_load; lazy: ct_safetensors_open). */
ct_status ct__st_load_any(const char *path, int lazy, ct_safetensors **out);
/* Index of tensor t (by identity) in st, or -1. */
int ct__st_index_of(const ct_safetensors *st, const ct_tensor *t);
/* 1 when path names a sharded checkpoint index ("*.safetensors.index.json"). */
int ct__st_is_index(const char *path);

/* ---- growable byte buffer ---------------------------------------------- */

typedef struct {
    char *p;
    size_t len, cap;
    int failed;         /* an allocation failed; later appends do nothing */
} ct__buf;

void ct__buf_put(ct__buf *b, const void *data, size_t n);
void ct__buf_puts(ct__buf *b, const char *s);
void ct__buf_printf(ct__buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Appends s[0..n) as a JSON string literal with quotes and escapes. */
void ct__buf_json_str(ct__buf *b, const char *s, size_t n);
void ct__buf_free(ct__buf *b);

/* ---- atomic file replacement (atomic.c) -------------------------------- */

/* A file being written to path.tmp.<pid>; commit renames it over path. */
typedef struct {
    FILE *f;
    char *tmp;
    const char *path;   /* borrowed: must outlive the ct__afile */
} ct__afile;

/* Creates the temp file (CT_EIO "cannot create" naming it). */
ct_status ct__afile_open(ct__afile *a, const char *path);
ct_status ct__afile_write(ct__afile *a, const void *p, size_t n);
/* Writes p[0..n) at byte off of the file (after what was written before). */
ct_status ct__afile_pwrite(ct__afile *a, const void *p, size_t n, uint64_t off);
/* Flushes, fsyncs, closes, renames over path and fsyncs the directory.  On
 * failure the temp file is removed (no abort needed). */
ct_status ct__afile_commit(ct__afile *a);
/* Closes and removes the temp file; safe after a failed open. */
void ct__afile_abort(ct__afile *a);
/* fsyncs the directory holding path, so a rename or unlink in it is durable. */
ct_status ct__sync_dir(const char *path);
/* A point where a checkpoint write touches the file system: with
 * CTRAIN_FAULT_KILL_AT=k the k-th such point kills the process, with
 * CTRAIN_FAULT_FAIL_AT=k it returns -1 with errno ENOSPC (crash and
 * full-disk tests); otherwise 0. */
int ct__io_point(void);
/* Opens path to read only if it is a regular file (after following
 * symlinks): CT_EINVAL naming what it is otherwise, never blocking on a
 * FIFO.  *sb gets the opened file's stat. */
struct stat;
ct_status ct__open_regular(const char *path, FILE **f, struct stat *sb);

/* ---- checksums (checksum.c) --------------------------------------------- */

/* Metadata key holding one crc32 per tensor, in name order, comma-separated. */
#define CT__CRC_KEY "ctrain.crc32"
/* Checks st's tensors against its CT__CRC_KEY metadata (absent: nothing to
 * check, *checked 0); CT_EFORMAT naming path and the first tensor that
 * differs.  *checked gets the number of tensors verified.  A lazily opened
 * file keeps the list (st->crc) and checks its tensors as they are read. */
ct_status ct__st_verify(const char *path, ct_safetensors *st, int *checked);
/* CT_EFORMAT naming path and tensor i of st unless data (its whole bytes)
 * has the stored crc32 (nothing to check without one). */
ct_status ct__st_check_crc(const char *path, const ct_safetensors *st, int i, const void *data);

#endif

/*
 * safetensors writer.  Tensors are laid out by element size (largest
 * first) then name, as the Python library does, so each tensor starts at a
 * multiple of its element size; the header is padded with spaces to a
 * multiple of 8.  The file is replaced atomically (atomic.c): written to
 * path.tmp.<pid>, flushed and fsync'd, renamed over path, and the directory
 * fsync'd so the rename itself survives a crash.  Every file carries a
 * crc32 of each tensor in its metadata (CT__CRC_KEY), checked on load.
 * The streaming writer (ct_safetensors_writer) puts the header first, from
 * the tensors' shapes, with placeholder checksums of the same width, then
 * each tensor's bytes at its place as they arrive, in any order, and the
 * checksums last: the same file as ct_safetensors_save, byte for byte,
 * without ever holding more than one tensor.
 */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this file assumes a little-endian host"
#endif

typedef struct {
    const char *name;
    const ct_tensor *t;
} entry;

/* The CT__CRC_KEY value: every tensor's crc32, in name order (crc NULL:
 * of their data; else crc[i], zeros for a placeholder of the same width). */
static ct_status crc_list(const entry *ents, int n, const uint32_t *crc, ct__buf *b)
{
    b->len = 0;
    for (int i = 0; i < n; i++)
        ct__buf_printf(b, "%s%08lx", i ? "," : "",
                       crc ? (unsigned long)crc[i] : crc32_z(0L, ct_tensor_data(ents[i].t), ct_tensor_bytes(ents[i].t)));
    ct__buf_puts(b, "");
    return b->failed ? CT_ENOMEM : CT_OK;
}

typedef struct {
    const char *key, *val;
} meta;

static int cmp_layout(const void *a, const void *b)
{
    const entry *x = a, *y = b;
    size_t sx = ct_dtype_size(x->t->dtype), sy = ct_dtype_size(y->t->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const entry *)a)->name, ((const entry *)b)->name);
}

static int cmp_meta(const void *a, const void *b) { return strcmp(((const meta *)a)->key, ((const meta *)b)->key); }

static ct_status check_utf8(const char *path, const char *what, const char *s)
{
    if (ct__utf8_check(s, strlen(s)) != strlen(s))
        return ct_error(CT_EINVAL, "%s: %s '%s' is not valid UTF-8; safetensors headers are JSON text",
                        path, what, s);
    return CT_OK;
}

/* Validates the inputs and builds the sorted tables (ents in layout
 * order); shapes: the tensors need no data yet (placeholder checksums). */
static ct_status prepare(const char *path, const char *const *names, ct_tensor *const *tensors, int n,
                         const char *const *mk, const char *const *mv, int *nmeta_io, entry *ents, meta *ms,
                         ct__buf *crcs, uint32_t *zeros)
{
    int nmeta = *nmeta_io;
    for (int i = 0; i < n; i++) {
        CT_ASSERT(names[i] && tensors[i]);
        const ct_tensor *t = tensors[i];
        CT_ASSERT(t->dtype >= 0 && t->dtype < CT_NDTYPE);
        if (!strcmp(names[i], "__metadata__"))
            return ct_error(CT_EINVAL, "%s: '__metadata__' is reserved and cannot name a tensor", path);
        CT_TRY(check_utf8(path, "tensor name", names[i]));
        if (!zeros && !ct_tensor_data(t) && ct_tensor_bytes(t))
            return ct_error(CT_EINVAL, "%s: tensor '%s' has no data", path, names[i]);
        ents[i] = (entry){names[i], t};
    }
    qsort(ents, (size_t)n, sizeof *ents, cmp_name);
    for (int i = 1; i < n; i++)
        if (!strcmp(ents[i - 1].name, ents[i].name))
            return ct_error(CT_EINVAL, "%s: tensor name '%s' is given twice", path, ents[i].name);
    CT_TRY(crc_list(ents, n, zeros, crcs));
    qsort(ents, (size_t)n, sizeof *ents, cmp_layout);

    int k = 0;
    for (int i = 0; i < nmeta; i++) {
        CT_ASSERT(mk[i] && mv[i]);
        CT_TRY(check_utf8(path, "metadata key", mk[i]));
        CT_TRY(check_utf8(path, "metadata value", mv[i]));
        if (strcmp(mk[i], CT__CRC_KEY)) ms[k++] = (meta){mk[i], mv[i]}; /* a copied file's are stale */
    }
    if (n) ms[k++] = (meta){CT__CRC_KEY, crcs->p};
    *nmeta_io = nmeta = k;
    qsort(ms, (size_t)nmeta, sizeof *ms, cmp_meta);
    for (int i = 1; i < nmeta; i++)
        if (!strcmp(ms[i - 1].key, ms[i].key))
            return ct_error(CT_EINVAL, "%s: metadata key '%s' is given twice", path, ms[i].key);
    return CT_OK;
}

/* JSON header, padded with spaces to a multiple of 8. */
static ct_status build_header(const entry *ents, int n, const meta *ms, int nmeta, ct__buf *b)
{
    ct__buf_puts(b, "{");
    if (nmeta) {
        ct__buf_puts(b, "\"__metadata__\":{");
        for (int i = 0; i < nmeta; i++) {
            if (i) ct__buf_puts(b, ",");
            ct__buf_json_str(b, ms[i].key, strlen(ms[i].key));
            ct__buf_puts(b, ":");
            ct__buf_json_str(b, ms[i].val, strlen(ms[i].val));
        }
        ct__buf_puts(b, "}");
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        const ct_tensor *t = ents[i].t;
        if (i || nmeta) ct__buf_puts(b, ",");
        ct__buf_json_str(b, ents[i].name, strlen(ents[i].name));
        ct__buf_printf(b, ":{\"dtype\":\"%s\",\"shape\":[", ct_dtype_name(t->dtype));
        for (int d = 0; d < t->ndim; d++) ct__buf_printf(b, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        uint64_t end = off + ct_tensor_bytes(t);
        ct__buf_printf(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                       (unsigned long long)end);
        off = end;
    }
    ct__buf_puts(b, "}");
    while (b->len % 8) ct__buf_puts(b, " ");
    return b->failed ? CT_ENOMEM : CT_OK;
}

ct_status ct_safetensors_save(const char *path, const char *const *names,
                              ct_tensor *const *tensors, int n,
                              const char *const *meta_keys, const char *const *meta_vals,
                              int nmeta)
{
    CT_ASSERT(path && n >= 0 && nmeta >= 0);
    CT_ASSERT(n == 0 || (names && tensors));
    CT_ASSERT(nmeta == 0 || (meta_keys && meta_vals));
    ct_status s;
    ct__buf hdr = {0}, crcs = {0};
    entry *ents = ct_alloc_zeroed((size_t)n * sizeof *ents + 1, CT_MEM_OTHER);
    meta *ms = ct_alloc_zeroed((size_t)(nmeta + 1) * sizeof *ms, CT_MEM_OTHER);
    if (!ents || !ms) { s = CT_ENOMEM; goto out_free; }
    if ((s = prepare(path, names, tensors, n, meta_keys, meta_vals, &nmeta, ents, ms, &crcs, NULL)) != CT_OK)
        goto out_free;
    if ((s = build_header(ents, n, ms, nmeta, &hdr)) != CT_OK) goto out_free;

    ct__afile af;
    if ((s = ct__afile_open(&af, path)) != CT_OK) goto out_free;
    unsigned char lenb[8];
    for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)hdr.len >> (8 * i));
    s = ct__afile_write(&af, lenb, 8);
    if (s == CT_OK) s = ct__afile_write(&af, hdr.p, hdr.len);
    for (int i = 0; i < n && s == CT_OK; i++)
        s = ct__afile_write(&af, ct_tensor_data(ents[i].t), ct_tensor_bytes(ents[i].t));
    if (s == CT_OK) s = ct__afile_commit(&af);
    else ct__afile_abort(&af);
out_free:
    ct__buf_free(&hdr);
    ct__buf_free(&crcs);
    ct_free(ents);
    ct_free(ms);
    return s;
}

/* ---- streaming: header first, tensors as they come -------------------- */

struct ct_safetensors_writer {
    ct__afile af;
    char *path;        /* af.path points here */
    entry *ents;       /* layout order; names and shapes are copies (tensors below) */
    ct_tensor **shape; /* [n] shape-only tensors the entries point at */
    char **names;      /* [n] */
    uint64_t *off;     /* [n] byte offset of each entry's data in the file */
    uint32_t *crc;     /* [n] in name order */
    int *rank_of;      /* [n] entry (layout order) -> name order */
    char *written;     /* [n] */
    int n, nmeta;
    meta *ms;
    ct__buf crcs, hdr;
    int open;          /* af is open */
};

void ct_safetensors_writer_destroy(ct_safetensors_writer *w)
{
    if (!w) return;
    if (w->open) ct__afile_abort(&w->af);
    for (int i = 0; i < w->n; i++) {
        ct_tensor_release(w->shape ? w->shape[i] : NULL);
        ct_free(w->names ? w->names[i] : NULL);
    }
    ct_free(w->shape);
    ct_free(w->names);
    ct_free(w->ents);
    ct_free(w->off);
    ct_free(w->crc);
    ct_free(w->rank_of);
    ct_free(w->written);
    ct_free(w->ms);
    ct__buf_free(&w->crcs);
    ct__buf_free(&w->hdr);
    ct_free(w->path);
    ct_free(w);
}

ct_status ct_safetensors_writer_create(const char *path, const char *const *names, ct_tensor *const *shapes, int n,
                                       const char *const *meta_keys, const char *const *meta_vals, int nmeta,
                                       ct_safetensors_writer **out)
{
    CT_ASSERT(path && n >= 0 && nmeta >= 0 && out && (n == 0 || (names && shapes)));
    *out = NULL;
    ct_safetensors_writer *w = ct_alloc_zeroed(sizeof *w, CT_MEM_OTHER);
    if (!w) return CT_ENOMEM;
    size_t pl = strlen(path) + 1;
    w->path = ct_alloc(pl, CT_MEM_OTHER);
    w->shape = ct_alloc_zeroed(sizeof *w->shape * (size_t)(n + 1), CT_MEM_OTHER);
    w->names = ct_alloc_zeroed(sizeof *w->names * (size_t)(n + 1), CT_MEM_OTHER);
    w->ents = ct_alloc_zeroed(sizeof *w->ents * (size_t)(n + 1), CT_MEM_OTHER);
    w->off = ct_alloc_zeroed(sizeof *w->off * (size_t)(n + 1), CT_MEM_OTHER);
    w->crc = ct_alloc_zeroed(sizeof *w->crc * (size_t)(n + 1), CT_MEM_OTHER);
    w->rank_of = ct_alloc_zeroed(sizeof *w->rank_of * (size_t)(n + 1), CT_MEM_OTHER);
    w->written = ct_alloc_zeroed((size_t)n + 1, CT_MEM_OTHER);
    w->ms = ct_alloc_zeroed(sizeof *w->ms * (size_t)(nmeta + 1), CT_MEM_OTHER);
    ct_status s = w->path && w->shape && w->names && w->ents && w->off && w->crc && w->rank_of && w->written && w->ms
                      ? CT_OK : CT_ENOMEM;
    if (s == CT_OK) memcpy(w->path, path, pl);
    for (int i = 0; i < n && s == CT_OK; i++) { /* copies: the caller's tensors may go */
        size_t l = strlen(names[i]) + 1;
        w->names[i] = ct_alloc(l, CT_MEM_OTHER);
        w->shape[i] = ct_tensor_wrap(shapes[i]->dtype, shapes[i]->ndim, shapes[i]->shape, NULL);
        w->n = i + 1;
        if (!w->names[i] || !w->shape[i]) s = CT_ENOMEM;
        else memcpy(w->names[i], names[i], l);
    }
    w->nmeta = nmeta;
    if (s == CT_OK)
        s = prepare(path, (const char *const *)w->names, w->shape, n, meta_keys, meta_vals, &w->nmeta, w->ents, w->ms,
                    &w->crcs, w->crc);
    if (s == CT_OK) s = build_header(w->ents, n, w->ms, w->nmeta, &w->hdr);
    uint64_t at = 8 + (uint64_t)w->hdr.len;
    for (int i = 0; i < n && s == CT_OK; i++) {
        w->off[i] = at;
        at += ct_tensor_bytes(w->ents[i].t);
        int r = 0; /* its place in name order: the checksum list's */
        for (int j = 0; j < n; j++) r += strcmp(w->ents[j].name, w->ents[i].name) < 0;
        w->rank_of[i] = r;
    }
    if (s == CT_OK && (s = ct__afile_open(&w->af, w->path)) == CT_OK) {
        w->open = 1;
        unsigned char lenb[8];
        for (int i = 0; i < 8; i++) lenb[i] = (unsigned char)((uint64_t)w->hdr.len >> (8 * i));
        s = ct__afile_write(&w->af, lenb, 8);
        if (s == CT_OK) s = ct__afile_write(&w->af, w->hdr.p, w->hdr.len);
    }
    if (s != CT_OK) {
        ct_safetensors_writer_destroy(w);
        return s;
    }
    *out = w;
    return CT_OK;
}

ct_status ct_safetensors_writer_put(ct_safetensors_writer *w, const char *name, const ct_tensor *t)
{
    int i = 0;
    while (i < w->n && strcmp(w->ents[i].name, name)) i++;
    if (i == w->n || w->written[i])
        return ct_error(CT_EINVAL, "%s: tensor '%s' %s; put each tensor the writer was created with once", w->path,
                        name, i == w->n ? "was not announced when the writer was created" : "is written twice");
    const ct_tensor *e = w->ents[i].t;
    if (t->dtype != e->dtype || t->numel != e->numel || !ct_tensor_data(t))
        return ct_error(CT_EINVAL, "%s: tensor '%s' is %s[%lld]%s but was announced as %s[%lld]", w->path, name,
                        ct_dtype_name(t->dtype), (long long)t->numel, ct_tensor_data(t) ? "" : " without data",
                        ct_dtype_name(e->dtype), (long long)e->numel);
    size_t nb = ct_tensor_bytes(t);
    CT_TRY(ct__afile_pwrite(&w->af, ct_tensor_data(t), nb, w->off[i]));
    w->crc[w->rank_of[i]] = (uint32_t)crc32_z(0L, ct_tensor_data(t), nb);
    w->written[i] = 1;
    return CT_OK;
}

ct_status ct_safetensors_writer_commit(ct_safetensors_writer *w)
{
    for (int i = 0; i < w->n; i++)
        if (!w->written[i])
            return ct_error(CT_EINVAL, "%s: tensor '%s' was announced but never written", w->path, w->ents[i].name);
    /* the real checksums, the same width as the placeholders: the header keeps its length */
    size_t len = w->hdr.len;
    const char *was = w->crcs.p;
    ct_status s = crc_list(w->ents, w->n, w->crc, &w->crcs);
    for (int k = 0; k < w->nmeta && s == CT_OK; k++)
        if (w->ms[k].val == was) w->ms[k].val = w->crcs.p;
    w->hdr.len = 0;
    if (s == CT_OK) s = build_header(w->ents, w->n, w->ms, w->nmeta, &w->hdr);
    CT_ASSERT(s != CT_OK || w->hdr.len == len);
    if (s == CT_OK) s = ct__afile_pwrite(&w->af, w->hdr.p, w->hdr.len, 8);
    if (s == CT_OK) {
        w->open = 0;
        s = ct__afile_commit(&w->af); /* aborts the file itself on failure */
    }
    return s;
}

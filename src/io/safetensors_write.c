/*
 * safetensors writer.  Tensors are laid out by element size (largest
 * first) then name, as the Python library does, so each tensor starts at a
 * multiple of its element size; the header is padded with spaces to a
 * multiple of 8.  The file is replaced atomically (atomic.c): written to
 * path.tmp.<pid>, flushed and fsync'd, renamed over path, and the directory
 * fsync'd so the rename itself survives a crash.  Every file carries a
 * crc32 of each tensor in its metadata (CT__CRC_KEY), checked on load.
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

/* The CT__CRC_KEY value: every tensor's crc32, in name order. */
static ct_status crc_list(const entry *ents, int n, ct__buf *b)
{
    for (int i = 0; i < n; i++)
        ct__buf_printf(b, "%s%08lx", i ? "," : "",
                       crc32_z(0L, ct_tensor_data(ents[i].t), ct_tensor_bytes(ents[i].t)));
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

/* Validates the inputs and builds the sorted tables. */
static ct_status prepare(const char *path, const char *const *names, ct_tensor *const *tensors, int n,
                         const char *const *mk, const char *const *mv, int *nmeta_io, entry *ents, meta *ms,
                         ct__buf *crcs)
{
    int nmeta = *nmeta_io;
    for (int i = 0; i < n; i++) {
        CT_ASSERT(names[i] && tensors[i]);
        const ct_tensor *t = tensors[i];
        CT_ASSERT(t->dtype >= 0 && t->dtype < CT_NDTYPE);
        if (!strcmp(names[i], "__metadata__"))
            return ct_error(CT_EINVAL, "%s: '__metadata__' is reserved and cannot name a tensor", path);
        CT_TRY(check_utf8(path, "tensor name", names[i]));
        if (!ct_tensor_data(t) && ct_tensor_bytes(t))
            return ct_error(CT_EINVAL, "%s: tensor '%s' has no data", path, names[i]);
        ents[i] = (entry){names[i], t};
    }
    qsort(ents, (size_t)n, sizeof *ents, cmp_name);
    for (int i = 1; i < n; i++)
        if (!strcmp(ents[i - 1].name, ents[i].name))
            return ct_error(CT_EINVAL, "%s: tensor name '%s' is given twice", path, ents[i].name);
    CT_TRY(crc_list(ents, n, crcs));
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
    if ((s = prepare(path, names, tensors, n, meta_keys, meta_vals, &nmeta, ents, ms, &crcs)) != CT_OK)
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

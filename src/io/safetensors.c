/*
 * safetensors read and write (https://github.com/huggingface/safetensors):
 * an 8-byte little-endian header length N, N bytes of JSON naming each
 * tensor's dtype, shape and [begin, end) byte range in the data section,
 * then the raw little-endian data.  The reader trusts nothing in the file:
 * it checks the header against the file size, the JSON, every field, and
 * that the tensors tile the data section exactly (no overlaps, no holes,
 * as the format requires).  The writer replaces files atomically.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this file assumes a little-endian host"
#endif

/* The Python library's limit: a bigger header is corrupt or hostile. */
#define MAX_HEADER (100u << 20)

/* What the header says about one tensor. */
typedef struct {
    const char *name;
    ct_dtype dt;
    int ndim;
    int64_t shape[CT_MAX_DIMS];
    int64_t begin, end;
} tinfo;

/* ---- reading ----------------------------------------------------------- */

/* Valid safetensors dtypes ctrain does not hold, so their error can say so. */
static int dtype_known_elsewhere(const char *s)
{
    static const char *other[] = {"BOOL", "I8", "I16", "U16", "U32", "U64", "F64",
                                  "F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2",
                                  "F4", "C64"};
    for (size_t i = 0; i < sizeof other / sizeof other[0]; i++)
        if (!strcmp(s, other[i])) return 1;
    return 0;
}

static void shape_str(const int64_t *shape, int ndim, char *buf, size_t n)
{
    size_t off = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && off < n; i++)
        off += (size_t)snprintf(buf + off, n - off, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (off < n) snprintf(buf + off, n - off, "]");
}

static ct_status parse_dtype(const char *path, tinfo *ti, const ct__json *v)
{
    if (v->kind != CT__JSTR)
        return ct_error(CT_EFORMAT, "%s: tensor '%s': field 'dtype' is not a string", path, ti->name);
    if (ct_dtype_parse(v->str, &ti->dt) == 0 && strlen(v->str) == v->len) return CT_OK;
    if (dtype_known_elsewhere(v->str))
        return ct_error(CT_EUNSUPPORTED,
                        "%s: tensor '%s': dtype %s is not supported by ctrain (it holds F32, BF16, "
                        "F16, I64, I32, U8); convert the tensor before loading", path, ti->name, v->str);
    return ct_error(CT_EFORMAT, "%s: tensor '%s': unknown dtype '%s'", path, ti->name, v->str);
}

static ct_status parse_shape(const char *path, tinfo *ti, const ct__json_doc *d, const ct__json *v)
{
    if (v->kind != CT__JARR)
        return ct_error(CT_EFORMAT, "%s: tensor '%s': field 'shape' is not an array", path, ti->name);
    if (v->count > CT_MAX_DIMS)
        return ct_error(CT_EUNSUPPORTED, "%s: tensor '%s': shape has %d dims; ctrain supports at most %d",
                        path, ti->name, v->count, CT_MAX_DIMS);
    ti->ndim = 0;
    for (int32_t k = v->first; k >= 0; k = d->nodes[k].next) {
        const ct__json *e = &d->nodes[k];
        if (e->kind != CT__JINT || e->ival < 0)
            return ct_error(CT_EFORMAT, "%s: tensor '%s': shape[%d] is not a non-negative integer",
                            path, ti->name, ti->ndim);
        ti->shape[ti->ndim++] = e->ival;
    }
    return CT_OK;
}

static ct_status parse_offsets(const char *path, tinfo *ti, const ct__json_doc *d, const ct__json *v)
{
    if (v->kind != CT__JARR || v->count != 2)
        return ct_error(CT_EFORMAT, "%s: tensor '%s': field 'data_offsets' is not an array of two integers",
                        path, ti->name);
    const ct__json *b = &d->nodes[v->first], *e = &d->nodes[b->next];
    if (b->kind != CT__JINT || e->kind != CT__JINT || b->ival < 0 || e->ival < 0)
        return ct_error(CT_EFORMAT, "%s: tensor '%s': data_offsets must be non-negative integers",
                        path, ti->name);
    ti->begin = b->ival;
    ti->end = e->ival;
    return CT_OK;
}

/* Fills ti from a header entry and checks it against the data section size. */
static ct_status parse_tensor(const char *path, const ct__json_doc *d, const ct__json *obj,
                              int64_t data_size, tinfo *ti)
{
    ti->name = obj->key;
    if (strlen(obj->key) != obj->keylen)
        return ct_error(CT_EFORMAT, "%s: a tensor name contains a NUL character", path);
    if (obj->kind != CT__JOBJ)
        return ct_error(CT_EFORMAT, "%s: tensor '%s': header entry is not an object", path, ti->name);
    const ct__json *dt = NULL, *shape = NULL, *offs = NULL;
    for (int32_t k = obj->first; k >= 0; k = d->nodes[k].next) {
        const ct__json *m = &d->nodes[k];
        const ct__json **slot = !strcmp(m->key, "dtype") ? &dt
                              : !strcmp(m->key, "shape") ? &shape
                              : !strcmp(m->key, "data_offsets") ? &offs : NULL;
        if (!slot) continue; /* unknown fields are allowed, as in the Python library */
        if (*slot)
            return ct_error(CT_EFORMAT, "%s: tensor '%s': field '%s' appears twice", path, ti->name, m->key);
        *slot = m;
    }
    const char *missing = !dt ? "dtype" : !shape ? "shape" : !offs ? "data_offsets" : NULL;
    if (missing)
        return ct_error(CT_EFORMAT, "%s: tensor '%s': missing field '%s'", path, ti->name, missing);
    CT_TRY(parse_dtype(path, ti, dt));
    CT_TRY(parse_shape(path, ti, d, shape));
    CT_TRY(parse_offsets(path, ti, d, offs));

    char sb[160];
    shape_str(ti->shape, ti->ndim, sb, sizeof sb);
    if (ti->begin > ti->end)
        return ct_error(CT_EFORMAT, "%s: tensor '%s': data_offsets [%lld, %lld] end before they begin",
                        path, ti->name, (long long)ti->begin, (long long)ti->end);
    if (ti->end > data_size)
        return ct_error(CT_EFORMAT,
                        "%s: tensor '%s': data_offsets [%lld, %lld] run past the end of the data section "
                        "(%lld bytes); the file is truncated or corrupt",
                        path, ti->name, (long long)ti->begin, (long long)ti->end, (long long)data_size);
    /* Nonzero dims multiply without overflow, so tensor code that multiplies
     * dims in any order stays defined even when a zero dim makes numel 0. */
    int64_t esize = (int64_t)ct_dtype_size(ti->dt), prod = 1, numel = 1;
    for (int i = 0; i < ti->ndim; i++) {
        int64_t s = ti->shape[i];
        if (s == 0) { numel = 0; continue; }
        if (prod > INT64_MAX / esize / s)
            return ct_error(CT_EFORMAT, "%s: tensor '%s': shape %s overflows", path, ti->name, sb);
        prod *= s;
    }
    if (numel) numel = prod;
    if (numel * esize != ti->end - ti->begin)
        return ct_error(CT_EFORMAT,
                        "%s: tensor '%s': shape %s of %s is %lld bytes but data_offsets [%lld, %lld] "
                        "hold %lld; the size does not match",
                        path, ti->name, sb, ct_dtype_name(ti->dt), (long long)(numel * esize),
                        (long long)ti->begin, (long long)ti->end, (long long)(ti->end - ti->begin));
    return CT_OK;
}

static ct_status parse_meta(const char *path, const ct__json_doc *d, const ct__json *m,
                            ct_safetensors *st)
{
    if (m->kind == CT__JNULL) return CT_OK; /* the Rust library writes null for none */
    if (m->kind != CT__JOBJ)
        return ct_error(CT_EFORMAT, "%s: __metadata__ is not an object", path);
    if (m->count == 0) return CT_OK;
    st->mkeys = ct_alloc_zeroed((size_t)m->count * sizeof *st->mkeys, CT_MEM_OTHER);
    st->mvals = ct_alloc_zeroed((size_t)m->count * sizeof *st->mvals, CT_MEM_OTHER);
    if (!st->mkeys || !st->mvals) return CT_ENOMEM;
    for (int32_t k = m->first; k >= 0; k = d->nodes[k].next) {
        const ct__json *v = &d->nodes[k];
        if (strlen(v->key) != v->keylen)
            return ct_error(CT_EFORMAT, "%s: a __metadata__ key contains a NUL character", path);
        if (v->kind != CT__JSTR)
            return ct_error(CT_EFORMAT, "%s: __metadata__ value of '%s' is not a string", path, v->key);
        if (strlen(v->str) != v->len)
            return ct_error(CT_EFORMAT, "%s: __metadata__ value of '%s' contains a NUL character",
                            path, v->key);
        st->mkeys[st->nmeta] = v->key;
        st->mvals[st->nmeta++] = v->str;
    }
    return CT_OK;
}

static int cmp_tinfo_name(const void *a, const void *b)
{
    return strcmp(((const tinfo *)a)->name, ((const tinfo *)b)->name);
}

static int cmp_tinfo_offset(const void *a, const void *b)
{
    const tinfo *x = *(const tinfo *const *)a, *y = *(const tinfo *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* Sorts metadata by key (keys and values move together) and rejects duplicates. */
ct_status ct__st_sort_meta(const char *path, ct_safetensors *st)
{
    for (int i = 1; i < st->nmeta; i++) /* insertion sort: metadata is small */
        for (int j = i; j > 0 && strcmp(st->mkeys[j - 1], st->mkeys[j]) > 0; j--) {
            const char *k = st->mkeys[j], *v = st->mvals[j];
            st->mkeys[j] = st->mkeys[j - 1];
            st->mvals[j] = st->mvals[j - 1];
            st->mkeys[j - 1] = k;
            st->mvals[j - 1] = v;
        }
    for (int i = 1; i < st->nmeta; i++)
        if (!strcmp(st->mkeys[i - 1], st->mkeys[i]))
            return ct_error(CT_EFORMAT, "%s: __metadata__ key '%s' appears twice", path, st->mkeys[i]);
    return CT_OK;
}

/* Tensors must cover the data section exactly, in offset order. */
static ct_status check_tiling(const char *path, tinfo *ti, int n, int64_t data_size, tinfo **by_off)
{
    for (int i = 0; i < n; i++) by_off[i] = &ti[i];
    qsort(by_off, (size_t)n, sizeof *by_off, cmp_tinfo_offset);
    int64_t at = 0;
    for (int i = 0; i < n; i++) {
        const tinfo *t = by_off[i];
        if (t->begin < at)
            return ct_error(CT_EFORMAT, "%s: tensors '%s' [%lld, %lld) and '%s' [%lld, %lld) overlap",
                            path, by_off[i - 1]->name, (long long)by_off[i - 1]->begin,
                            (long long)by_off[i - 1]->end, t->name, (long long)t->begin,
                            (long long)t->end);
        if (t->begin > at)
            return ct_error(CT_EFORMAT,
                            "%s: bytes [%lld, %lld) of the data section belong to no tensor (a hole "
                            "before '%s'); the file is corrupt", path, (long long)at,
                            (long long)t->begin, t->name);
        at = t->end;
    }
    if (at != data_size)
        return ct_error(CT_EFORMAT,
                        "%s: the data section has %lld bytes but the tensors end at byte %lld; the file "
                        "has trailing bytes or a tensor is missing from the header",
                        path, (long long)data_size, (long long)at);
    return CT_OK;
}

/* Where the bytes come from: a file read front to back, or memory; lazy:
 * the header only (ct_safetensors_open), the data read later by position. */
typedef struct {
    FILE *f;
    const unsigned char *mem;
    size_t pos;
    int64_t size;
    int lazy;
} source;

static ct_status read_full(source *src, void *buf, size_t n, const char *path, const char *what)
{
    if (src->mem) { /* callers never read past size: the header checks come first */
        CT_ASSERT(src->pos + n <= (size_t)src->size);
        if (n) memcpy(buf, src->mem + src->pos, n);
        src->pos += n;
        return CT_OK;
    }
    size_t got = n ? fread(buf, 1, n, src->f) : 0;
    if (got != n)
        return ct_error(CT_EIO, "%s: read of %s stopped after %zu of %zu bytes: %s", path, what, got, n,
                        ferror(src->f) ? strerror(errno) : "unexpected end of file (did the file change?)");
    return CT_OK;
}

/* Everything after the header length: parse, validate, then read data. */
static ct_status load_from(source *f, const char *path, ct_safetensors *st)
{
    int64_t fsize = f->size;
    unsigned char lenb[8];
    CT_TRY(read_full(f, lenb, 8, path, "the header length"));
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | lenb[i];
    if (hlen > (uint64_t)fsize - 8)
        return ct_error(CT_EFORMAT,
                        "%s: header length %llu runs past the end of the file (%lld bytes); the file is "
                        "truncated or not safetensors", path, (unsigned long long)hlen, (long long)fsize);
    if (hlen > MAX_HEADER)
        return ct_error(CT_EFORMAT, "%s: header length %llu is over the %u MB limit; the file is corrupt",
                        path, (unsigned long long)hlen, MAX_HEADER >> 20);
    if (hlen < 2)
        return ct_error(CT_EFORMAT, "%s: header length %llu cannot hold a JSON object; the file is corrupt",
                        path, (unsigned long long)hlen);
    int64_t data_size = fsize - 8 - (int64_t)hlen;

    char *hdr = ct_alloc_zeroed(hlen, CT_MEM_OTHER);
    if (!hdr) return CT_ENOMEM;
    ct_status s = read_full(f, hdr, hlen, path, "the header");
    if (s == CT_OK) s = ct__json_parse(hdr, hlen, path, &st->doc);
    ct_free(hdr);
    CT_TRY(s);

    const ct__json_doc *d = &st->doc;
    const ct__json *root = &d->nodes[0];
    if (root->kind != CT__JOBJ)
        return ct_error(CT_EFORMAT, "%s: header is not a JSON object; the file is not safetensors", path);
    int nt = 0, nmeta_entries = 0;
    for (int32_t k = root->first; k >= 0; k = d->nodes[k].next) {
        if (!strcmp(d->nodes[k].key, "__metadata__") && d->nodes[k].keylen == 12) nmeta_entries++;
        else nt++;
    }
    if (nmeta_entries > 1) return ct_error(CT_EFORMAT, "%s: __metadata__ appears twice", path);

    tinfo *ti = ct_alloc_zeroed((size_t)nt * sizeof *ti + 1, CT_MEM_OTHER);
    tinfo **by_off = ct_alloc_zeroed((size_t)nt * sizeof *by_off + 1, CT_MEM_OTHER);
    st->names = ct_alloc_zeroed((size_t)nt * sizeof *st->names + 1, CT_MEM_OTHER);
    st->tensors = ct_alloc_zeroed((size_t)nt * sizeof *st->tensors + 1, CT_MEM_OTHER);
    if (!ti || !by_off || !st->names || !st->tensors) { s = CT_ENOMEM; goto out_free_info; }
    int i = 0;
    for (int32_t k = root->first; k >= 0; k = d->nodes[k].next) {
        const ct__json *m = &d->nodes[k];
        if (!strcmp(m->key, "__metadata__") && m->keylen == 12) s = parse_meta(path, d, m, st);
        else s = parse_tensor(path, d, m, data_size, &ti[i++]);
        if (s != CT_OK) goto out_free_info;
    }
    if ((s = ct__st_sort_meta(path, st)) != CT_OK) goto out_free_info;
    qsort(ti, (size_t)nt, sizeof *ti, cmp_tinfo_name);
    for (i = 1; i < nt; i++)
        if (!strcmp(ti[i - 1].name, ti[i].name)) {
            s = ct_error(CT_EFORMAT, "%s: tensor name '%s' appears twice in the header", path, ti[i].name);
            goto out_free_info;
        }
    if ((s = check_tiling(path, ti, nt, data_size, by_off)) != CT_OK) goto out_free_info;

    if (f->lazy && !(st->foff = ct_alloc(sizeof *st->foff * (size_t)(nt + 1), CT_MEM_OTHER))) {
        s = CT_ENOMEM;
        goto out_free_info;
    }
    /* Lazy: float tensors are shapes whose bytes are read on demand
     * (ct_safetensors_read); the rest (a step count) is small and read now. */
    for (i = 0; i < nt; i++) {
        int later = f->lazy && (ti[i].dt == CT_F32 || ti[i].dt == CT_BF16 || ti[i].dt == CT_F16);
        st->names[i] = ti[i].name;
        st->tensors[i] = later ? ct_tensor_wrap(ti[i].dt, ti[i].ndim, ti[i].shape, NULL)
                               : ct_tensor_create(ti[i].dt, ti[i].ndim, ti[i].shape, CT_MEM_OTHER);
        if (!st->tensors[i]) { s = CT_ENOMEM; goto out_free_info; }
        if (f->lazy) st->foff[i] = 8 + (int64_t)hlen + ti[i].begin;
        st->n = i + 1;
    }
    for (i = 0; i < nt && f->lazy; i++) {
        ct_tensor *t = st->tensors[i];
        size_t nb = ct_tensor_bytes(t);
        if (ct_tensor_data(t) && pread(fileno(f->f), ct_tensor_data(t), nb, (off_t)st->foff[i]) != (ssize_t)nb) {
            s = ct_error(CT_EIO, "%s: cannot read tensor '%.64s': %s", path, st->names[i],
                         errno ? strerror(errno) : "unexpected end of file (did the file change?)");
            goto out_free_info;
        }
    }
    /* Tensors tile the data section, so reading them in offset order is one
     * sequential pass with one fread per tensor, straight into its memory. */
    for (i = 0; i < nt && !f->lazy; i++) {
        tinfo *t = by_off[i];
        ct_tensor *dst = st->tensors[t - ti];
        char what[96];
        snprintf(what, sizeof what, "tensor '%.64s'", t->name);
        if ((s = read_full(f, ct_tensor_data(dst), (size_t)(t->end - t->begin), path, what)) != CT_OK) break;
    }
out_free_info:
    ct_free(ti);
    ct_free(by_off);
    return s;
}

/* Checks the size, then parses and reads from src into a new file object. */
static ct_status load_source(source *src, const char *path, ct_safetensors **out)
{
    if (src->size < 8)
        return ct_error(CT_EFORMAT, "%s: file is %lld bytes, too short for the 8-byte header length; "
                        "the file is truncated or not safetensors", path, (long long)src->size);
    ct_safetensors *st = ct_alloc_zeroed(sizeof *st, CT_MEM_OTHER);
    if (!st) return CT_ENOMEM;
    st->fd = -1;
    int checked;
    ct_status s = load_from(src, path, st);
    if (s == CT_OK) s = ct__st_verify(path, st, &checked);
    if (s != CT_OK) {
        ct_safetensors_destroy(st);
        return s;
    }
    ct_free(st->doc.nodes); /* the strings stay; the tree is no longer needed */
    st->doc.nodes = NULL;
    *out = st;
    return CT_OK;
}

ct_status ct__st_load_file(const char *path, int lazy, ct_safetensors **out)
{
    *out = NULL;
    FILE *f;
    struct stat sb;
    CT_TRY(ct__open_regular(path, &f, &sb));
    source src = {f, NULL, 0, (int64_t)sb.st_size, lazy};
    ct_status s = load_source(&src, path, out);
    if (s == CT_OK && lazy) { /* the file stays open for the reads to come */
        size_t pl = strlen(path) + 1;
        (*out)->lazy = 1;
        (*out)->fd = dup(fileno(f));
        (*out)->path = ct_alloc(pl, CT_MEM_OTHER);
        if ((*out)->path) memcpy((*out)->path, path, pl);
        if ((*out)->fd < 0 || !(*out)->path) {
            s = (*out)->path ? ct_error(CT_EIO, "%s: cannot keep the file open: %s", path, strerror(errno))
                             : CT_ENOMEM;
            ct_safetensors_destroy(*out);
            *out = NULL;
        }
    }
    fclose(f);
    return s;
}

/* A directory or an index is a sharded checkpoint (safetensors_index.c);
 * anything else is one file. */
ct_status ct__st_load_any(const char *path, int lazy, ct_safetensors **out)
{
    CT_ASSERT(path && out);
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) return ct__st_load_dir(path, lazy, out);
    if (ct__st_is_index(path)) return ct__st_load_index(path, lazy, out);
    return ct__st_load_file(path, lazy, out);
}

ct_status ct_safetensors_load(const char *path, ct_safetensors **out) { return ct__st_load_any(path, 0, out); }

ct_status ct_safetensors_load_mem(const void *data, size_t len, const char *name, ct_safetensors **out)
{
    CT_ASSERT((data || len == 0) && out);
    *out = NULL;
    if (len > INT64_MAX) return ct_error(CT_EINVAL, "%s: %zu bytes is too large", name, len);
    source src = {NULL, data ? data : (const void *)"", 0, (int64_t)len, 0};
    return load_source(&src, name ? name : "(memory)", out);
}

void ct_safetensors_destroy(ct_safetensors *st)
{
    if (!st) return;
    for (int i = 0; i < st->n; i++) ct_tensor_release(st->tensors[i]);
    ct_free(st->tensors);
    ct_free(st->names);
    ct_free(st->mkeys);
    ct_free(st->mvals);
    ct__json_free(&st->doc);
    for (int i = 0; i < st->nparts; i++) ct_safetensors_destroy(st->parts[i]);
    ct_free(st->parts);
    ct_free(st->numbuf);
    if (st->fd >= 0) close(st->fd);
    ct_free(st->path);
    ct_free(st->foff);
    ct_free(st->crc);
    ct_free(st);
}

int ct_safetensors_count(const ct_safetensors *st) { return st->n; }

const char *ct_safetensors_name(const ct_safetensors *st, int i)
{
    CT_ASSERT(i >= 0 && i < st->n);
    return st->names[i];
}

ct_tensor *ct_safetensors_tensor(const ct_safetensors *st, int i)
{
    CT_ASSERT(i >= 0 && i < st->n);
    return st->tensors[i];
}

ct_tensor *ct_safetensors_find(const ct_safetensors *st, const char *name)
{
    int lo = 0, hi = st->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(st->names[mid], name);
        if (!c) return st->tensors[mid];
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return NULL;
}

const char *ct_safetensors_meta(const ct_safetensors *st, const char *key)
{
    for (int i = 0; i < st->nmeta; i++)
        if (!strcmp(st->mkeys[i], key)) return st->mvals[i];
    return NULL;
}

int ct_safetensors_meta_count(const ct_safetensors *st) { return st->nmeta; }

const char *ct_safetensors_meta_key(const ct_safetensors *st, int i)
{
    CT_ASSERT(i >= 0 && i < st->nmeta);
    return st->mkeys[i];
}

const char *ct_safetensors_meta_value(const ct_safetensors *st, int i)
{
    CT_ASSERT(i >= 0 && i < st->nmeta);
    return st->mvals[i];
}

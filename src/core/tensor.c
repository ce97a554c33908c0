/* Storage (memory that can leave and return) and the tensors that view it. */
#include "ctrain/tensor.h"

#include <stdio.h>
#include <string.h>

size_t ct_dtype_size(ct_dtype dt)
{
    static const size_t sz[] = {4, 2, 2, 8, 4, 1};
    CT_ASSERT(dt >= 0 && dt < CT_NDTYPE);
    return sz[dt];
}

static const char *dtype_names[] = {"F32", "BF16", "F16", "I64", "I32", "U8"};

const char *ct_dtype_name(ct_dtype dt) { return (dt >= 0 && dt < CT_NDTYPE) ? dtype_names[dt] : "?"; }

int ct_dtype_parse(const char *name, ct_dtype *dt)
{
    for (int i = 0; i < CT_NDTYPE; i++)
        if (!strcmp(name, dtype_names[i])) { *dt = (ct_dtype)i; return 0; }
    return -1;
}

/* numel of a shape; rejects negative dims and shapes whose bytes would not
 * fit in an int64 (an overflowed product would allocate too small a block). */
static ct_status shape_numel(ct_dtype dt, int ndim, const int64_t *shape, int64_t *numel)
{
    int64_t n = 1, limit = INT64_MAX / (int64_t)ct_dtype_size(dt);
    int empty = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return ct_error(CT_EINVAL, "tensor dim %d is negative (%lld)", i, (long long)shape[i]);
        empty |= shape[i] == 0;
    }
    for (int i = 0; i < ndim && !empty; i++) {
        if (n > limit / shape[i])
            return ct_error(CT_EINVAL, "tensor shape is too large: dim %d (%lld) overflows the "
                            "element count; check the shape for a corrupt dim", i,
                            (long long)shape[i]);
        n *= shape[i];
    }
    *numel = empty ? 0 : n;
    return CT_OK;
}

/* ---- storage ----------------------------------------------------------- */

static int refs_inc(int *rc) { return __atomic_add_fetch(rc, 1, __ATOMIC_RELAXED); }
static int refs_dec(int *rc) { return __atomic_sub_fetch(rc, 1, __ATOMIC_ACQ_REL); }

static void *alloc_bytes(size_t bytes, ct_mem_cat cat, int zero)
{
    /* ct_alloc never returns NULL for 0 bytes, so an empty tensor still has
     * an address (and ct_tensor_data NULL keeps meaning "released"). */
    return zero ? ct_alloc_zeroed(bytes, cat) : ct_alloc(bytes, cat);
}

/* zero -1: no memory yet (a released storage, brought in by ct_storage_alloc_data). */
static ct_storage *storage_new(size_t bytes, ct_mem_cat cat, int zero)
{
    ct_storage *s = ct_alloc(sizeof *s, CT_MEM_OTHER);
    if (!s) return NULL;
    memset(s, 0, sizeof *s);
    if (zero >= 0 && !(s->ptr = alloc_bytes(bytes, cat, zero))) {
        ct_free(s);
        return NULL;
    }
    s->bytes = bytes;
    s->cat = cat;
    s->refcount = 1;
    s->owns = 1;
    return s;
}

ct_storage *ct_storage_create(size_t bytes, ct_mem_cat cat, int zero) { return storage_new(bytes, cat, zero != 0); }
ct_storage *ct_storage_absent(size_t bytes, ct_mem_cat cat) { return storage_new(bytes, cat, -1); }

ct_storage *ct_storage_wrap(void *ptr, size_t bytes)
{
    ct_storage *s = ct_alloc(sizeof *s, CT_MEM_OTHER);
    if (!s) return NULL;
    memset(s, 0, sizeof *s);
    s->ptr = ptr;
    s->bytes = bytes;
    s->cat = CT_MEM_OTHER;
    s->refcount = 1;
    return s;
}

ct_storage *ct_storage_retain(ct_storage *s)
{
    if (s) refs_inc(&s->refcount);
    return s;
}

void ct_storage_release(ct_storage *s)
{
    if (!s) return;
    int left = refs_dec(&s->refcount);
    CT_ASSERT(left >= 0);
    if (left > 0) return;
    if (s->owns) ct_free(s->ptr);
    ct_storage_release(s->window);
    ct_free(s);
}

ct_status ct_storage_free_data(ct_storage *s)
{
    if (!s->owns || s->window)
        return ct_error(CT_ESTATE, "cannot free the memory of a storage that does not own it "
                        "(wrapped or repointed into a flat buffer); free the flat buffer instead");
    ct_free(s->ptr);
    s->ptr = NULL;
    return CT_OK;
}

ct_status ct_storage_alloc_data(ct_storage *s, int zero)
{
    if (s->window || (!s->owns && s->ptr)) return CT_OK;
    if (s->ptr) return CT_OK;
    if (!(s->ptr = alloc_bytes(s->bytes, s->cat, zero))) return CT_ENOMEM;
    s->owns = 1;
    return CT_OK;
}

int ct_storage_has_data(const ct_storage *s) { return ct_storage_ptr(s) != NULL; }

ct_status ct_storage_repoint(ct_storage *s, ct_storage *flat, size_t off, int copy)
{
    if (off > flat->bytes || s->bytes > flat->bytes - off)
        return ct_error(CT_EINVAL, "window of %zu bytes at %zu does not fit a flat buffer of %zu bytes",
                        s->bytes, off, flat->bytes);
    if (s == flat) return ct_error(CT_EINVAL, "a storage cannot be a window onto itself");
    char *dst = ct_storage_ptr(flat);
    const void *src = ct_storage_ptr(s);
    if (copy && s->bytes) {
        if (!dst || !src)
            return ct_error(CT_ESTATE, "repoint with copy needs memory on both sides (one is released)");
        memmove(dst + off, src, s->bytes);
    }
    ct_storage_retain(flat);
    if (s->owns) ct_free(s->ptr);
    ct_storage_release(s->window);
    s->ptr = NULL;
    s->owns = 0;
    s->window = flat;
    s->window_off = off;
    s->cat = flat->cat;
    return CT_OK;
}

/* ---- tensors ----------------------------------------------------------- */

static ct_tensor *header(ct_dtype dt, int ndim, const int64_t *shape)
{
    if (ndim < 0 || ndim > CT_MAX_DIMS) {
        ct_error(CT_EINVAL, "tensor has %d dims; ctrain supports at most %d", ndim, CT_MAX_DIMS);
        return NULL;
    }
    int64_t numel;
    if (shape_numel(dt, ndim, shape, &numel) != CT_OK) return NULL;
    ct_tensor *t = ct_alloc(sizeof *t, CT_MEM_OTHER);
    if (!t) return NULL;
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->numel = numel;
    t->refcount = 1;
    return t;
}

static ct_tensor *create(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat, int zero)
{
    ct_tensor *t = header(dt, ndim, shape);
    if (!t) return NULL;
    if (!(t->storage = storage_new(ct_tensor_bytes(t), cat, zero))) {
        ct_free(t);
        return NULL;
    }
    return t;
}

ct_tensor *ct_tensor_create(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat)
{
    return create(dt, ndim, shape, cat, 1);
}

ct_tensor *ct_tensor_empty(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat)
{
    return create(dt, ndim, shape, cat, 0);
}

ct_tensor *ct_tensor_absent(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat)
{
    return create(dt, ndim, shape, cat, -1);
}

ct_tensor *ct_tensor_create1(int64_t d0, ct_mem_cat cat)
{
    return ct_tensor_create(CT_F32, 1, (int64_t[]){d0}, cat);
}
ct_tensor *ct_tensor_create2(int64_t d0, int64_t d1, ct_mem_cat cat)
{
    return ct_tensor_create(CT_F32, 2, (int64_t[]){d0, d1}, cat);
}
ct_tensor *ct_tensor_create4(int64_t d0, int64_t d1, int64_t d2, int64_t d3, ct_mem_cat cat)
{
    return ct_tensor_create(CT_F32, 4, (int64_t[]){d0, d1, d2, d3}, cat);
}

ct_tensor *ct_tensor_on(ct_storage *s, size_t offset, ct_dtype dt, int ndim, const int64_t *shape)
{
    ct_tensor *t = header(dt, ndim, shape);
    if (!t) return NULL;
    size_t bytes = ct_tensor_bytes(t);
    if (offset > s->bytes || bytes > s->bytes - offset) { /* no offset + bytes: it could overflow */
        ct_error(CT_EINVAL, "view of %zu bytes at byte offset %zu exceeds a storage of %zu bytes",
                 bytes, offset, s->bytes);
        ct_free(t);
        return NULL;
    }
    t->storage = ct_storage_retain(s);
    t->offset = offset;
    return t;
}

ct_tensor *ct_tensor_wrap(ct_dtype dt, int ndim, const int64_t *shape, void *data)
{
    ct_tensor *t = header(dt, ndim, shape);
    if (!t) return NULL;
    if (!(t->storage = ct_storage_wrap(data, ct_tensor_bytes(t)))) {
        ct_free(t);
        return NULL;
    }
    return t;
}

ct_tensor *ct_tensor_rows(ct_tensor *t, int64_t r0, int64_t n)
{
    if (t->ndim < 1 || r0 < 0 || n < 0 || r0 > t->shape[0] - n) {
        ct_error(CT_EINVAL, "rows [%lld, %lld) of a tensor of %lld rows", (long long)r0, (long long)(r0 + n),
                 (long long)(t->ndim ? t->shape[0] : 0));
        return NULL;
    }
    int64_t shape[CT_MAX_DIMS];
    memcpy(shape, t->shape, sizeof shape);
    shape[0] = n;
    return ct_tensor_view(t, t->shape[0] ? r0 * (t->numel / t->shape[0]) : 0, t->ndim, shape);
}

ct_tensor *ct_tensor_view(ct_tensor *base, int64_t offset, int ndim, const int64_t *shape)
{
    ct_tensor *t = header(base->dtype, ndim, shape);
    if (!t) return NULL;
    if (offset < 0 || offset > base->numel - t->numel) { /* no offset + numel: it could overflow */
        ct_error(CT_EINVAL, "view of %lld elements at offset %lld exceeds a tensor of %lld",
                 (long long)t->numel, (long long)offset, (long long)base->numel);
        ct_free(t); /* after the message, which reads t->numel */
        return NULL;
    }
    t->storage = ct_storage_retain(base->storage);
    t->offset = base->offset + (size_t)offset * ct_dtype_size(base->dtype);
    return t;
}

ct_tensor *ct_tensor_reshape(ct_tensor *t, int ndim, const int64_t *shape)
{
    if (ndim < 0 || ndim > CT_MAX_DIMS) {
        ct_error(CT_EINVAL, "tensor has %d dims; ctrain supports at most %d", ndim, CT_MAX_DIMS);
        return NULL;
    }
    int64_t numel;
    if (shape_numel(t->dtype, ndim, shape, &numel) != CT_OK) return NULL;
    if (numel != t->numel) {
        char b[64];
        ct_error(CT_EINVAL, "cannot reshape %s (%lld elements) to %lld elements",
                 ct_shape_str(t, b, sizeof b), (long long)t->numel, (long long)numel);
        return NULL;
    }
    return ct_tensor_view(t, 0, ndim, shape);
}

/* Why a tensor has no memory and what to do: the one case users meet is a
 * parameter a sharding strategy holds in pieces. */
#define NO_DATA_HINT "its storage is released here (a sharded strategy such as fsdp keeps only this rank's " \
                     "shard of a parameter): read parameters between ct_strategy_summon_full_params and "  \
                     "ct_strategy_release_full_params, or take ct_strategy_model_state; a model built shape-only " \
                     "(ct_module_shape_only) is made by wrapping it or by ct_module_materialize; to keep a " \
                     "sharded model whole after ct_strategy_destroy, summon its full parameters before it"

ct_status ct_tensor_check_data(const ct_tensor *t)
{
    if (!t) return ct_error(CT_EINVAL, "tensor is NULL");
    if (t->numel > 0 && !ct_tensor_data(t))
        return ct_error(CT_ESTATE, "tensor %s has no data: " NO_DATA_HINT, ct_dtype_name(t->dtype));
    return CT_OK;
}

ct_tensor *ct_tensor_clone(const ct_tensor *t, ct_mem_cat cat)
{
    if (ct_tensor_check_data(t) != CT_OK) return NULL;
    ct_tensor *c = ct_tensor_empty(t->dtype, t->ndim, t->shape, cat);
    if (c) memcpy(ct_tensor_data(c), ct_tensor_data(t), ct_tensor_bytes(t));
    return c;
}

ct_tensor *ct_tensor_retain(ct_tensor *t)
{
    if (t) refs_inc(&t->refcount);
    return t;
}

void ct_tensor_release(ct_tensor *t)
{
    if (!t) return;
    int left = refs_dec(&t->refcount);
    CT_ASSERT(left >= 0);
    if (left > 0) return;
    ct_storage_release(t->storage);
    ct_free(t);
}

size_t ct_tensor_bytes(const ct_tensor *t) { return (size_t)t->numel * ct_dtype_size(t->dtype); }

int ct_tensor_same_shape(const ct_tensor *a, const ct_tensor *b)
{
    if (a->dtype != b->dtype || a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

char *ct_shape_str(const ct_tensor *t, char *buf, size_t n)
{
    size_t off = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < t->ndim && off < n; i++)
        off += (size_t)snprintf(buf + off, n - off, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (off < n) snprintf(buf + off, n - off, "]");
    return buf;
}

void ct_tensor_fill(ct_tensor *t, float v)
{
    if (v == 0.0f) {
        memset(ct_tensor_data(t), 0, ct_tensor_bytes(t));
        return;
    }
    float *p = ct_f32(t);
    for (int64_t i = 0; i < t->numel; i++) p[i] = v;
}

ct_status ct_tensor_copy(ct_tensor *dst, const ct_tensor *src)
{
    CT_TRY(ct_tensor_check_data(src));
    CT_TRY(ct_tensor_check_data(dst));
    if (dst->dtype != src->dtype || dst->numel != src->numel)
        return ct_error(CT_EINVAL, "copy between %s[%lld] and %s[%lld]: dtype or size differ",
                        ct_dtype_name(dst->dtype), (long long)dst->numel,
                        ct_dtype_name(src->dtype), (long long)src->numel);
    memmove(ct_tensor_data(dst), ct_tensor_data(src), ct_tensor_bytes(src));
    return CT_OK;
}

float *ct_f32(const ct_tensor *t)
{
    CT_ASSERT(t->dtype == CT_F32);
    float *p = ct_tensor_data(t);
    if (p == NULL && t->numel != 0) {
        /* A pointer cannot carry a status: say why before the assertion ends the program. */
        ct_log(CT_LOG_ERROR, "ct_f32: the tensor has no data: " NO_DATA_HINT
                             " (ct_tensor_check_data returns this as a ct_status instead)");
        CT_ASSERT(p != NULL || t->numel == 0);
    }
    return p;
}

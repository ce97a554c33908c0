/* Reference-counted tensors over tracked memory, views and wrapped memory. */
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
    t->dtype = dt;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->numel = numel;
    t->refcount = 1;
    return t;
}

ct_tensor *ct_tensor_create(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat)
{
    ct_tensor *t = header(dt, ndim, shape);
    if (!t) return NULL;
    t->cat = cat;
    t->data = ct_alloc((size_t)t->numel * ct_dtype_size(dt), cat);
    if (!t->data) {
        ct_free(t);
        return NULL;
    }
    t->owns = 1;
    return t;
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

ct_tensor *ct_tensor_wrap(ct_dtype dt, int ndim, const int64_t *shape, void *data)
{
    ct_tensor *t = header(dt, ndim, shape);
    if (!t) return NULL;
    t->data = data;
    t->cat = CT_MEM_OTHER;
    return t;
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
    t->data = (char *)base->data + (size_t)offset * ct_dtype_size(base->dtype);
    t->cat = base->cat;
    t->base = ct_tensor_retain(base);
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

ct_tensor *ct_tensor_clone(const ct_tensor *t, ct_mem_cat cat)
{
    ct_tensor *c = ct_tensor_create(t->dtype, t->ndim, t->shape, cat);
    if (c) memcpy(c->data, t->data, ct_tensor_bytes(t));
    return c;
}

ct_tensor *ct_tensor_retain(ct_tensor *t)
{
    if (t) t->refcount++;
    return t;
}

void ct_tensor_release(ct_tensor *t)
{
    if (!t) return;
    CT_ASSERT(t->refcount > 0);
    if (--t->refcount > 0) return;
    if (t->owns) ct_free(t->data);
    ct_tensor_release(t->base);
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
        memset(t->data, 0, ct_tensor_bytes(t));
        return;
    }
    float *p = ct_f32(t);
    for (int64_t i = 0; i < t->numel; i++) p[i] = v;
}

ct_status ct_tensor_copy(ct_tensor *dst, const ct_tensor *src)
{
    if (dst->dtype != src->dtype || dst->numel != src->numel)
        return ct_error(CT_EINVAL, "copy between %s[%lld] and %s[%lld]: dtype or size differ",
                        ct_dtype_name(dst->dtype), (long long)dst->numel,
                        ct_dtype_name(src->dtype), (long long)src->numel);
    memmove(dst->data, src->data, ct_tensor_bytes(src));
    return CT_OK;
}

float *ct_f32(const ct_tensor *t)
{
    CT_ASSERT(t->dtype == CT_F32);
    return (float *)t->data;
}

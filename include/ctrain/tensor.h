/*
 * ctrain tensors: a dtype, a shape and contiguous data in a storage.
 *
 * A storage is the memory (pointer, bytes, category) behind one or more
 * tensors; a tensor is a view of its storage at a byte offset.  Both are
 * reference counted (atomically: the communication thread may release), so
 * an activation record can keep an input alive after its caller let go.
 *
 * Storage can leave and come back, and every view follows, because a view
 * reads its storage's pointer at each ct_tensor_data call instead of keeping
 * a copy: FSDP frees a flat parameter after use and brings it back before
 * the next (ct_storage_free_data / ct_storage_alloc_data).  The strategies
 * own parameter bytes through one flat layer (src/parallel/flat.c), which
 * gives each parameter views of a group's storage; ct_storage_repoint
 * moves a storage of your own into a larger buffer without touching the
 * tensors that view it.  A released storage's views have no data
 * (ct_tensor_data returns NULL) until it is allocated again.
 */
#ifndef CTRAIN_TENSOR_H
#define CTRAIN_TENSOR_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { CT_F32 = 0, CT_BF16, CT_F16, CT_I64, CT_I32, CT_U8, CT_NDTYPE } ct_dtype;

#define CT_MAX_DIMS 6

typedef struct ct_storage ct_storage;
struct ct_storage {
    void *ptr;           /* NULL while released; read through ct_storage_ptr */
    size_t bytes;
    ct_mem_cat cat;
    int refcount;        /* atomic: ct_storage_retain / ct_storage_release */
    int owns;            /* ptr came from ct_alloc and is freed with the storage */
    ct_storage *window;  /* set by ct_storage_repoint: this storage is bytes of window at window_off */
    size_t window_off;
};

typedef struct ct_tensor {
    ct_dtype dtype;
    int ndim;
    int64_t shape[CT_MAX_DIMS];
    int64_t numel;
    ct_storage *storage; /* retained */
    size_t offset;       /* bytes into storage */
    int refcount;        /* atomic: ct_tensor_retain / ct_tensor_release */
} ct_tensor;

/* ---- storage ----------------------------------------------------------- */

/* New storage of bytes under cat (refcount 1), zeroed if zero; NULL (error set) on failure. */
ct_storage *ct_storage_create(size_t bytes, ct_mem_cat cat, int zero);
/* New storage of bytes under cat with no memory yet (released: brought in by
 * ct_storage_alloc_data), so a part that is absent until used never costs its bytes. */
ct_storage *ct_storage_absent(size_t bytes, ct_mem_cat cat);
/* Storage over memory the caller owns and keeps alive longer than it (counted nowhere). */
ct_storage *ct_storage_wrap(void *ptr, size_t bytes);
ct_storage *ct_storage_retain(ct_storage *s);
/* Drops a reference; frees the memory it owns at zero.  NULL is a no-op. */
void ct_storage_release(ct_storage *s);
/* Current address of the storage's memory (NULL while released). */
static inline void *ct_storage_ptr(const ct_storage *s)
{
    if (s->window) {
        char *w = (char *)ct_storage_ptr(s->window);
        return w ? w + s->window_off : NULL;
    }
    return s->ptr;
}
/* Frees the memory of an owning storage; its views have no data until
 * ct_storage_alloc_data.  No-op if already released.  CT_ESTATE for a
 * wrapped or repointed storage (its memory is not its own to free). */
ct_status ct_storage_free_data(ct_storage *s);
/* Brings back the memory of a released storage (same bytes and category),
 * zeroed if zero; no-op if it has memory.  CT_ENOMEM on failure. */
ct_status ct_storage_alloc_data(ct_storage *s, int zero);
/* 1 if the storage has memory now. */
int ct_storage_has_data(const ct_storage *s);
/* Makes s a window onto bytes [off, off + s->bytes) of flat (retained): with
 * copy, s's current contents are copied there first; then s's own memory is
 * freed.  Every view of s follows.  CT_EINVAL if the window does not fit. */
ct_status ct_storage_repoint(ct_storage *s, ct_storage *flat, size_t off, int copy);

/* ---- tensors ----------------------------------------------------------- */

/* Current address of t's first element (NULL while its storage is released). */
static inline void *ct_tensor_data(const ct_tensor *t)
{
    char *p = (char *)ct_storage_ptr(t->storage);
    return p ? p + t->offset : NULL;
}
/* Category of the memory behind t. */
static inline ct_mem_cat ct_tensor_cat(const ct_tensor *t) { return t->storage->cat; }

/* Bytes per element (2 for bf16/f16). */
size_t ct_dtype_size(ct_dtype dt);
/* "F32", "BF16", "F16", "I64", "I32", "U8" (safetensors spelling). */
const char *ct_dtype_name(ct_dtype dt);
/* Parses a safetensors dtype name; returns 0 and sets *dt, or -1. */
int ct_dtype_parse(const char *name, ct_dtype *dt);

/* New zeroed tensor (refcount 1) with a storage of its own under cat; NULL (error set) on failure. */
ct_tensor *ct_tensor_create(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat);
/* Same, not zeroed (torch.empty): for outputs that are written in full. */
ct_tensor *ct_tensor_empty(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat);
/* Same, with no memory yet (a released storage: ct_tensor_data is NULL until
 * ct_storage_alloc_data): a shape-only parameter's tensor. */
ct_tensor *ct_tensor_absent(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat);
/* Tensor over bytes [offset, offset + numel*size) of storage s (retained). */
ct_tensor *ct_tensor_on(ct_storage *s, size_t offset, ct_dtype dt, int ndim, const int64_t *shape);
/* Shorthands for f32 tensors of 1..4 dims. */
ct_tensor *ct_tensor_create1(int64_t d0, ct_mem_cat cat);
ct_tensor *ct_tensor_create2(int64_t d0, int64_t d1, ct_mem_cat cat);
ct_tensor *ct_tensor_create4(int64_t d0, int64_t d1, int64_t d2, int64_t d3, ct_mem_cat cat);
/* Tensor over memory the caller owns and keeps alive longer than the tensor. */
ct_tensor *ct_tensor_wrap(ct_dtype dt, int ndim, const int64_t *shape, void *data);
/* View of numel(shape) elements of base starting at element offset (shares base's storage). */
ct_tensor *ct_tensor_view(ct_tensor *base, int64_t offset, int ndim, const int64_t *shape);
/* Rows [r0, r0 + n) of t along its first dim: a view (a rank's slice of a
 * batch, a micro-batch); NULL (error set) outside t or without dims. */
ct_tensor *ct_tensor_rows(ct_tensor *t, int64_t r0, int64_t n);
/* Same data, new shape of the same numel (a view). */
ct_tensor *ct_tensor_reshape(ct_tensor *t, int ndim, const int64_t *shape);
/* New owning copy with the same dtype and shape; NULL with the error set
 * when t has no data (see ct_tensor_check_data). */
ct_tensor *ct_tensor_clone(const ct_tensor *t, ct_mem_cat cat);
/* CT_OK if t's data can be read here; CT_ESTATE naming the fix when its
 * storage is released (a parameter that a sharded strategy such as fsdp
 * holds in pieces, outside ct_strategy_summon_full_params), CT_EINVAL for
 * NULL.  Check before reading a strategy's parameters through ct_f32. */
ct_status ct_tensor_check_data(const ct_tensor *t);
/* Adds a reference; returns t. */
ct_tensor *ct_tensor_retain(ct_tensor *t);
/* Drops a reference; frees at zero. NULL is a no-op. */
void ct_tensor_release(ct_tensor *t);
/* Bytes of data. */
size_t ct_tensor_bytes(const ct_tensor *t);
/* 1 if both have the same dtype and shape. */
int ct_tensor_same_shape(const ct_tensor *a, const ct_tensor *b);
/* "[64, 784]" into buf; returns buf. */
char *ct_shape_str(const ct_tensor *t, char *buf, size_t n);
/* Sets every element of an f32 tensor to v (0 also works for any dtype). */
void ct_tensor_fill(ct_tensor *t, float v);
/* Copies src's data into dst (same dtype and numel); CT_ESTATE when either
 * has no data (ct_tensor_check_data). */
ct_status ct_tensor_copy(ct_tensor *dst, const ct_tensor *src);

/* Typed data pointer (asserts the dtype and that the storage has memory,
 * after logging why; ct_tensor_check_data tells first, as a status). */
float *ct_f32(const ct_tensor *t);

#ifdef __cplusplus
}
#endif
#endif

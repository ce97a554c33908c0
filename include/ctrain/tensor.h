/*
 * ctrain tensors: a dtype, a shape and contiguous data, reference counted
 * so that an activation record can keep an input alive after its caller has
 * let go of it.  A tensor either owns its data (allocated through the
 * tracked allocator under a category), views part of another tensor (and
 * keeps that one alive), or wraps memory someone else owns.
 */
#ifndef CTRAIN_TENSOR_H
#define CTRAIN_TENSOR_H

#include "core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { CT_F32 = 0, CT_BF16, CT_F16, CT_I64, CT_I32, CT_U8, CT_NDTYPE } ct_dtype;

#define CT_MAX_DIMS 6

typedef struct ct_tensor {
    ct_dtype dtype;
    int ndim;
    int64_t shape[CT_MAX_DIMS];
    int64_t numel;
    void *data;
    ct_mem_cat cat;
    int refcount;
    struct ct_tensor *base; /* viewed tensor, retained; NULL otherwise */
    int owns;               /* data came from ct_alloc and is freed with the tensor */
} ct_tensor;

/* Bytes per element (2 for bf16/f16). */
size_t ct_dtype_size(ct_dtype dt);
/* "F32", "BF16", "F16", "I64", "I32", "U8" (safetensors spelling). */
const char *ct_dtype_name(ct_dtype dt);
/* Parses a safetensors dtype name; returns 0 and sets *dt, or -1. */
int ct_dtype_parse(const char *name, ct_dtype *dt);

/* New zeroed tensor (refcount 1) owning its data under cat; NULL (error set) on failure. */
ct_tensor *ct_tensor_create(ct_dtype dt, int ndim, const int64_t *shape, ct_mem_cat cat);
/* Shorthands for f32 tensors of 1..4 dims. */
ct_tensor *ct_tensor_create1(int64_t d0, ct_mem_cat cat);
ct_tensor *ct_tensor_create2(int64_t d0, int64_t d1, ct_mem_cat cat);
ct_tensor *ct_tensor_create4(int64_t d0, int64_t d1, int64_t d2, int64_t d3, ct_mem_cat cat);
/* Tensor over memory the caller owns and keeps alive longer than the tensor. */
ct_tensor *ct_tensor_wrap(ct_dtype dt, int ndim, const int64_t *shape, void *data);
/* View of numel(shape) elements of base starting at element offset; retains base. */
ct_tensor *ct_tensor_view(ct_tensor *base, int64_t offset, int ndim, const int64_t *shape);
/* Same data, new shape of the same numel (a view). */
ct_tensor *ct_tensor_reshape(ct_tensor *t, int ndim, const int64_t *shape);
/* New owning copy with the same dtype and shape. */
ct_tensor *ct_tensor_clone(const ct_tensor *t, ct_mem_cat cat);
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
/* Copies src's data into dst (same dtype and numel). */
ct_status ct_tensor_copy(ct_tensor *dst, const ct_tensor *src);

/* Typed data pointer (asserts the dtype). */
float *ct_f32(const ct_tensor *t);

#ifdef __cplusplus
}
#endif
#endif

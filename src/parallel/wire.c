/*
 * Gradients on the wire: the one path by which a strategy reduces f32
 * gradients in reduce_dtype (bf16 or f16: half the bytes) and takes the
 * result back into f32, overwriting or adding (DDP's buckets, ZeRO-2's
 * reduces to the owners, FSDP's reduce-scatters).  The casts round to
 * nearest even (ct_f32_to_bf16_n, ct_f32_to_f16_n), as PyTorch's
 * bf16/fp16 compression hooks do.
 */
#include <string.h>

#include "internal.h"

void *ct__wire_alloc(ct_dtype dt, int64_t n)
{
    return ct_alloc((size_t)n * ct_dtype_size(dt) + 64, CT_MEM_COMM);
}

void ct__wire_pack(ct_dtype dt, const float *src, void *dst, int64_t n)
{
    switch (dt) {
    case CT_BF16:
        ct_f32_to_bf16_n(src, dst, (size_t)n);
        return;
    case CT_F16:
        ct_f32_to_f16_n(src, dst, (size_t)n);
        return;
    case CT_F32:
        if (dst != src) memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    default:
        CT_ASSERT(!"reduce_dtype is f32, bf16 or f16 (the option parser allows no other)");
    }
}

void ct__wire_unpack(ct_dtype dt, const void *src, float *dst, int64_t n, int add)
{
    if (dt == CT_F32) {
        const float *x = src;
        if (!add) {
            if ((const void *)dst != src) memcpy(dst, x, (size_t)n * sizeof(float));
        } else {
            for (int64_t i = 0; i < n; i++) dst[i] += x[i];
        }
        return;
    }
    CT_ASSERT(dt == CT_BF16 || dt == CT_F16);
    void (*to32)(const uint16_t *, float *, size_t) = dt == CT_BF16 ? ct_bf16_to_f32_n : ct_f16_to_f32_n;
    const uint16_t *h = src;
    if (!add) {
        to32(h, dst, (size_t)n);
        return;
    }
    float tmp[256]; /* in blocks that stay in L1 */
    for (int64_t i = 0; i < n; i += 256) {
        size_t c = (size_t)(n - i < 256 ? n - i : 256);
        to32(h + i, tmp, c);
        for (size_t j = 0; j < c; j++) dst[i + (int64_t)j] += tmp[j];
    }
}

/*
 * Helpers of the bf16 compute path shared by linear, conv2d and embedding
 * (see internal.h): checking a parameter's compute copy and casting
 * operands to bf16; and the cast of layers that emit BF16 themselves.
 */
#include <float.h>
#include <immintrin.h>
#include <string.h>

#include "internal.h"

ct_status ct__param_compute(const ct_module *m, const ct_param *p, int *bf16)
{
    *bf16 = 0;
    const ct_tensor *c = p->compute;
    if (!c) return CT_OK;
    if (c->dtype != CT_BF16 || c->numel != p->data->numel || c->ndim != p->data->ndim ||
        memcmp(c->shape, p->data->shape, (size_t)c->ndim * sizeof c->shape[0])) {
        char a[64], b[64];
        return ct_error(CT_EINVAL, "%s '%s': compute copy of '%s' is %s %s but must be BF16 %s like "
                        "its data; set p->compute to a BF16 cast of p->data (or NULL for F32)",
                        m->ops->kind, ct__nn_name(m), p->local, ct_dtype_name(c->dtype),
                        ct_shape_str(c, a, sizeof a), ct_shape_str(p->data, b, sizeof b));
    }
    if (!ct_tensor_data(c))
        return ct_error(CT_ESTATE, "%s '%s': compute copy of '%s' has no memory (its storage was "
                        "released); bring it back before the forward", m->ops->kind,
                        ct__nn_name(m), p->local);
    *bf16 = 1;
    return CT_OK;
}

ct_status ct__param_bf16(const ct_param *p, const uint16_t **w, uint16_t **tmp)
{
    *tmp = NULL;
    if (p->compute) {
        *w = ct_tensor_data(p->compute);
        return CT_OK;
    }
    uint16_t *h = ct_alloc((size_t)p->data->numel * sizeof *h, CT_MEM_ACT);
    if (!h) return CT_ENOMEM;
    ct_f32_to_bf16_n(ct_f32(p->data), h, (size_t)p->data->numel);
    *w = *tmp = h;
    return CT_OK;
}

ct_tensor *ct__tensor_bf16(ct_tensor *t)
{
    if (t->dtype == CT_BF16) return ct_tensor_retain(t);
    ct_tensor *h = ct_tensor_empty(CT_BF16, t->ndim, t->shape, CT_MEM_ACT);
    if (h) ct_f32_to_bf16_n(ct_f32(t), ct_tensor_data(h), (size_t)t->numel);
    return h;
}

int ct__takes_bf16(const ct_module *m)
{
    /* A kind whose forward hands its input straight to its first child. */
    static const char *const first_kid[] = {"attention", "sequential"};
    for (int depth = 0; m && depth < 8; depth++) {
        if (!strcmp(m->ops->kind, "linear")) return m->nparams > 0 && m->params[0]->compute != NULL;
        int pass = 0;
        for (size_t i = 0; i < sizeof first_kid / sizeof *first_kid; i++) pass |= !strcmp(m->ops->kind, first_kid[i]);
        if (!pass || m->nkids == 0) return 0;
        m = m->kids[0];
    }
    return 0;
}

/* Asked once; modules may run on several threads, hence the atomic. */
static int have_vcvt(void)
{
    static int have = -1;
    int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
    if (h < 0) {
        __builtin_cpu_init();
        h = __builtin_cpu_supports("avx512bf16") != 0;
        __atomic_store_n(&have, h, __ATOMIC_RELAXED);
    }
    return h;
}

/* VCVTNEPS2BF16 rounds as ct_f32_to_bf16 (nearest even, nan made quiet)
 * except that it flushes subnormal inputs to zero.  So the smallest |x| is
 * tracked alongside (MINPS keeps lo when x is a nan, so a nan cannot hide a
 * subnormal), and a chunk holding a subnormal or a zero answers 0: the
 * caller casts it the exact way.  Else the number of values done (a
 * multiple of 16). */
__attribute__((target("avx512f,avx512bf16"))) static size_t vcvt_chunk(const float *in, uint16_t *out, size_t n)
{
    __m512 lo = _mm512_set1_ps(1.0f);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 f = _mm512_loadu_ps(in + i);
        _mm256_storeu_si256((__m256i *)(void *)(out + i), (__m256i)_mm512_cvtneps_pbh(f));
        lo = _mm512_min_ps(_mm512_abs_ps(f), lo);
    }
    return _mm512_cmp_ps_mask(lo, _mm512_set1_ps(FLT_MIN), _CMP_LT_OQ) ? 0 : i;
}

void ct__bf16_from_f32(const float *in, uint16_t *out, size_t n)
{
    size_t i = have_vcvt() ? vcvt_chunk(in, out, n) : 0;
    ct_f32_to_bf16_n(in + i, out + i, n - i);
}

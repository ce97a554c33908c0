/*
 * What the multi-rank collective tests share: every rank can generate every
 * rank's input (a hash of rank, index and seed) as an exact double, so each
 * rank knows what a reduction must give; tolerances for 16-bit sums; and
 * "soft" failures, recorded instead of asserted at once, because a rank that
 * leaves a test early would leave the others waiting in its next collective.
 */
#ifndef CTRAIN_TEST_COLL_REF_H
#define CTRAIN_TEST_COLL_REF_H

#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>

#include "../test.h"
#include "ctrain/comm.h"

static inline ct_group *W(void) { return ct_group_world(); }

static inline uint64_t mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Rank r's element i for a given seed and dtype, as an exact double. */
static inline double input(int r, int64_t i, int seed, ct_dtype dt)
{
    uint64_t h = mix(((uint64_t)seed << 48) ^ ((uint64_t)r << 40) ^ (uint64_t)i);
    double u = (double)(h >> 11) / 9007199254740992.0 * 2 - 1; /* [-1, 1) */
    switch (dt) {
    case CT_F32: return (double)((int64_t)(h % 16384) - 8192) / 1024.0;
    case CT_BF16: return ct_bf16_to_f32(ct_f32_to_bf16((float)u));
    case CT_F16: return ct_f16_to_f32(ct_f32_to_f16((float)u));
    case CT_I32: return (double)((int64_t)(h % 2001) - 1000);
    case CT_I64: return (double)((int64_t)(h % (1ull << 40)) - (1ll << 39));
    case CT_U8: return (double)(h % 64);
    default: return 0;
    }
}

static inline double get(const void *buf, ct_dtype dt, int64_t i)
{
    switch (dt) {
    case CT_F32: return ((const float *)buf)[i];
    case CT_BF16: return ct_bf16_to_f32(((const uint16_t *)buf)[i]);
    case CT_F16: return ct_f16_to_f32(((const uint16_t *)buf)[i]);
    case CT_I32: return ((const int32_t *)buf)[i];
    case CT_I64: return (double)((const int64_t *)buf)[i];
    case CT_U8: return ((const uint8_t *)buf)[i];
    default: return 0;
    }
}

static inline void put(void *buf, ct_dtype dt, int64_t i, double v)
{
    switch (dt) {
    case CT_F32: ((float *)buf)[i] = (float)v; break;
    case CT_BF16: ((uint16_t *)buf)[i] = ct_f32_to_bf16((float)v); break;
    case CT_F16: ((uint16_t *)buf)[i] = ct_f32_to_f16((float)v); break;
    case CT_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case CT_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case CT_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    default: break;
    }
}

/* Element i of the reduction over ranks 0..p-1, and sum |x| for tolerances. */
static inline double reference(ct_dtype dt, ct_reduce_op op, int64_t i, int p, int seed, double *sumabs)
{
    double acc = input(0, i, seed, dt);
    *sumabs = fabs(acc);
    for (int r = 1; r < p; r++) {
        double x = input(r, i, seed, dt);
        *sumabs += fabs(x);
        if (op == CT_OP_MAX) acc = acc > x ? acc : x;
        else if (op == CT_OP_MIN) acc = acc < x ? acc : x;
        else acc += x;
    }
    if (op == CT_OP_AVG && dt == CT_F32) return (double)((float)acc * (1.0f / (float)p));
    if (op == CT_OP_AVG) return acc / p;
    if (dt == CT_U8) return (double)((uint8_t)(int64_t)acc);
    return acc;
}

/* The largest error a correct reduction may have (0: must be exact). */
static inline double tolerance(ct_dtype dt, ct_reduce_op op, int p, double ref, double sumabs)
{
    double u = dt == CT_BF16 ? 1.0 / 256 : dt == CT_F16 ? 1.0 / 2048 : 0;
    if (u == 0 || op == CT_OP_MAX || op == CT_OP_MIN) return 0;
    double t = p * u * sumabs;
    if (op == CT_OP_AVG) t = t / p + u * fabs(ref);
    return t * (1 + 1e-6) + 1e-30;
}

static inline const char *op_name(ct_reduce_op op)
{
    return op == CT_OP_SUM ? "SUM" : op == CT_OP_AVG ? "AVG" : op == CT_OP_MAX ? "MAX" : "MIN";
}

/* A mismatch seen on some ranks only must not make them leave a test early
 * (the others would wait in its next collective): checks record the first
 * failure here and each test asserts at its end, after its last collective. */
static char soft_msg[512];
static int soft_bad;

static void soft_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void soft_fail(const char *fmt, ...)
{
    if (soft_bad++) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(soft_msg, sizeof soft_msg, fmt, ap);
    va_end(ap);
}

static inline void soft_begin(void) { soft_bad = 0, soft_msg[0] = 0; }

#define ASSERT_NO_SOFT_FAIL()                                                  \
    do {                                                                      \
        if (soft_bad) ct_test_fail(__FILE__, __LINE__, "%d checks failed; first: %s", soft_bad, soft_msg); \
    } while (0)

/* A completion callback that records how often each work (arg = its index)
 * succeeded and in which order the callbacks ran. */
#define CB_MAX 32
static _Atomic int cb_count[CB_MAX];
static int cb_order[CB_MAX];
static _Atomic int cb_next;

__attribute__((unused)) static void on_done(ct_work *w, ct_status s, void *arg)
{
    (void)w;
    int i = (int)(intptr_t)arg;
    if (s == CT_OK) atomic_fetch_add(&cb_count[i], 1);
    cb_order[atomic_fetch_add(&cb_next, 1)] = i;
}

#endif

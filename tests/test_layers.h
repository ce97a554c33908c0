/*
 * Helpers for the layer tests: random tensors and the finite-difference
 * gradient check.  The check uses a random projection loss L = sum(y * R),
 * so every output element matters, and compares each analytic input and
 * parameter gradient with the central difference (L(v+h) - L(v-h)) / 2h,
 * evaluated in double from f32 forward passes.
 */
#ifndef CTRAIN_TEST_LAYERS_H
#define CTRAIN_TEST_LAYERS_H

#include <stdlib.h>

#include "test.h"

/* Uniform values in [lo, hi). */
static inline ct_tensor *rand_tensor(int ndim, const int64_t *shape, uint64_t seed, float lo, float hi)
{
    ct_tensor *t = ct_tensor_create(CT_F32, ndim, shape, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, seed, 77);
    ct_rng_uniform(&r, ct_f32(t), (size_t)t->numel);
    for (int64_t i = 0; i < t->numel; i++) ct_f32(t)[i] = lo + (hi - lo) * ct_f32(t)[i];
    return t;
}

static inline void rand_fill(ct_tensor *t, uint64_t seed, float lo, float hi)
{
    ct_rng r;
    ct_rng_init(&r, seed, 78);
    ct_rng_uniform(&r, ct_f32(t), (size_t)t->numel);
    for (int64_t i = 0; i < t->numel; i++) ct_f32(t)[i] = lo + (hi - lo) * ct_f32(t)[i];
}

/* Random parameters for every parameter of m (so zero-initialised biases do not hide bugs). */
static inline void rand_params(ct_module *m, uint64_t seed)
{
    for (int i = 0; i < m->nparams; i++) rand_fill(m->params[i]->data, seed + 101 * (uint64_t)i, -1.0f, 1.0f);
}

static inline ct_fwd_ctx train_ctx(void) { return (ct_fwd_ctx){.training = 1, .seed = 1234, .step = 5}; }

/* sum(y * R) in double for one inference forward. */
static inline double fd_proj(ct_module *m, ct_tensor *x, const ct_tensor *R, const ct_fwd_ctx *ctx)
{
    ct_tensor *y;
    ct_status s = ct_module_forward(m, x, &y, NULL, ctx);
    if (s != CT_OK) ct_test_fail(__FILE__, __LINE__, "forward failed: %s", ct_last_error());
    double L = 0.0;
    for (int64_t i = 0; i < y->numel; i++) L += (double)ct_f32(y)[i] * (double)ct_f32(R)[i];
    ct_tensor_release(y);
    return L;
}

typedef struct {
    double worst;   /* max |analytic - numeric| / (atol + rtol*|numeric|): <= 1 passes */
    double a, n;    /* the values at the worst element */
    char where[96]; /* "input[3]" or "weight[17]" */
    int64_t checked;
    double maxabs;  /* largest |numeric|: proves the gradients are not all zero */
} fd_result;

static inline void fd_compare(fd_result *r, const char *what, int64_t i, double a, double n,
                              double rtol, double atol)
{
    double q = fabs(a - n) / (atol + rtol * fabs(n));
    r->checked++;
    if (fabs(n) > r->maxabs) r->maxabs = fabs(n);
    if (q > r->worst || r->checked == 1) {
        r->worst = q;
        r->a = a;
        r->n = n;
        snprintf(r->where, sizeof r->where, "%s[%lld]", what, (long long)i);
    }
}

/* Checks m's backward at x against central differences.  The input gradient
 * is checked when x is F32; every parameter under m with requires_grad is.
 * Parameter grads are zeroed first. */
static inline fd_result fd_check(ct_module *m, ct_tensor *x, const ct_fwd_ctx *ctx, double h,
                                 double rtol, double atol, uint64_t seed)
{
    fd_result res = {0};
    ct_module_zero_grad(m);
    ct_tensor *y, *dx = NULL;
    ct_record *rec;
    ct_status s = ct_module_forward(m, x, &y, &rec, ctx);
    if (s != CT_OK) ct_test_fail(__FILE__, __LINE__, "forward failed: %s", ct_last_error());
    ct_tensor *R = ct_tensor_create(CT_F32, y->ndim, y->shape, CT_MEM_ACT);
    ct_rng rng;
    ct_rng_init(&rng, seed, 99);
    ct_rng_normal(&rng, ct_f32(R), (size_t)R->numel, 0.0f, 1.0f);
    ct_tensor_release(y);
    int want_dx = x->dtype == CT_F32;
    s = ct_module_backward(m, R, want_dx ? &dx : NULL, rec);
    if (s != CT_OK) ct_test_fail(__FILE__, __LINE__, "backward failed: %s", ct_last_error());
    if (want_dx) {
        if (!dx || !ct_tensor_same_shape(dx, x))
            ct_test_fail(__FILE__, __LINE__, "input gradient missing or of the wrong shape");
        float *xd = ct_f32(x);
        for (int64_t i = 0; i < x->numel; i++) {
            float v = xd[i];
            xd[i] = v + (float)h;
            double lp = fd_proj(m, x, R, ctx);
            xd[i] = v - (float)h;
            double lm = fd_proj(m, x, R, ctx);
            xd[i] = v;
            fd_compare(&res, "input", i, ct_f32(dx)[i], (lp - lm) / (2.0 * h), rtol, atol);
        }
    }
    ct_param **ps;
    int np;
    if (ct_module_params(m, &ps, &np) != CT_OK) ct_test_fail(__FILE__, __LINE__, "params walk failed");
    for (int p = 0; p < np; p++) {
        ct_param *pr = ps[p];
        if (!pr->requires_grad) continue;
        float *pd = ct_f32(pr->data);
        for (int64_t i = 0; i < pr->data->numel; i++) {
            float v = pd[i];
            pd[i] = v + (float)h;
            double lp = fd_proj(m, x, R, ctx);
            pd[i] = v - (float)h;
            double lm = fd_proj(m, x, R, ctx);
            pd[i] = v;
            fd_compare(&res, pr->name, i, ct_f32(pr->grad)[i], (lp - lm) / (2.0 * h), rtol, atol);
        }
    }
    ct_free(ps);
    ct_tensor_release(dx);
    ct_tensor_release(R);
    return res;
}

/* Default tolerances: f32 forward passes with h = 1e-3 carry ~1e-4 noise. */
#define FD_H 1e-3
#define FD_RTOL 1e-2
#define FD_ATOL 2e-3

#define ASSERT_FD(r)                                                                      \
    do {                                                                                  \
        fd_result ct__r = (r);                                                            \
        if (getenv("CTRAIN_FD_VERBOSE"))                                                  \
            fprintf(stderr, "    %s:%d: worst %.3g of tolerance at %s (%lld checked)\n",   \
                    __FILE__, __LINE__, ct__r.worst, ct__r.where, (long long)ct__r.checked); \
        if (ct__r.checked == 0 || ct__r.worst > 1.0 || ct__r.maxabs == 0.0)               \
            ct_test_fail(__FILE__, __LINE__,                                              \
                         "gradient check: worst at %s: analytic %.7g numeric %.7g "       \
                         "(ratio %.3g of tolerance, %lld checked, max |num| %g)",         \
                         ct__r.where, ct__r.a, ct__r.n, ct__r.worst,                      \
                         (long long)ct__r.checked, ct__r.maxabs);                         \
    } while (0)

#endif

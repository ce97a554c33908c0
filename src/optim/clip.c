/*
 * Gradient clipping by global p-norm, as torch.nn.utils.clip_grad_norm_,
 * split into its parts (sum of |g|^p or the max, coefficient, scaling) so that a
 * sharded strategy can add up the sums of all ranks before scaling, and
 * the same parts over an optimizer's slots (its shard).
 *
 * Sums of squares are accumulated in double: a float sum over a hundred
 * million gradients loses the small ones, and ranks add their partial sums
 * in different orders, so the extra precision keeps strategies agreeing.
 */
#include <math.h>

#include "ctrain/optim.h"

/* Four partial sums keep the additions independent, so the loop is not
 * bound by the latency of one chain of adds. */
static double sq_sum_f32(const float *x, int64_t n)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)x[i] * x[i];
        s1 += (double)x[i + 1] * x[i + 1];
        s2 += (double)x[i + 2] * x[i + 2];
        s3 += (double)x[i + 3] * x[i + 3];
    }
    for (; i < n; i++) s0 += (double)x[i] * x[i];
    return (s0 + s1) + (s2 + s3);
}

static void scale_f32(float *x, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++) x[i] *= scale;
}

static double sq_sum_tensor(const ct_tensor *t)
{
    switch (t->dtype) {
    case CT_F32:
        return sq_sum_f32(ct_tensor_data(t), t->numel);
    case CT_BF16:
    case CT_F16: {
        const uint16_t *h = ct_tensor_data(t);
        double s = 0;
        for (int64_t i = 0; i < t->numel; i++) {
            double x = t->dtype == CT_BF16 ? ct_bf16_to_f32(h[i]) : ct_f16_to_f32(h[i]);
            s += x * x;
        }
        return s;
    }
    default:
        CT_ASSERT(!"gradients are f32, bf16 or f16");
        return 0;
    }
}

static void scale_tensor(ct_tensor *t, float scale)
{
    switch (t->dtype) {
    case CT_F32:
        scale_f32(ct_tensor_data(t), t->numel, scale);
        return;
    case CT_BF16:
        for (int64_t i = 0; i < t->numel; i++) {
            uint16_t *h = (uint16_t *)ct_tensor_data(t) + i;
            *h = ct_f32_to_bf16(ct_bf16_to_f32(*h) * scale);
        }
        return;
    case CT_F16:
        for (int64_t i = 0; i < t->numel; i++) {
            uint16_t *h = (uint16_t *)ct_tensor_data(t) + i;
            *h = ct_f32_to_f16(ct_f16_to_f32(*h) * scale);
        }
        return;
    default:
        CT_ASSERT(!"gradients are f32, bf16 or f16");
    }
}

static double max_abs_f32(const float *x, int64_t n)
{
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double a = fabs((double)x[i]);
        if (a > m || isnan(a)) m = a;
    }
    return m;
}

static double max_abs_16(const ct_tensor *t)
{
    const uint16_t *h = ct_tensor_data(t);
    double m = 0;
    for (int64_t i = 0; i < t->numel; i++) {
        double a = fabs((double)(t->dtype == CT_BF16 ? ct_bf16_to_f32(h[i]) : ct_f16_to_f32(h[i])));
        if (a > m || isnan(a)) m = a;
    }
    return m;
}

/* Sum of |x|^p for a finite p other than 2 (2 keeps sq_sum_f32's order, so
 * the 2-norm stays bitwise what it was).  p = 1 skips pow. */
static double pow_sum_f32(const float *x, int64_t n, double p)
{
    double s = 0;
    if (p == 1.0)
        for (int64_t i = 0; i < n; i++) s += fabs((double)x[i]);
    else
        for (int64_t i = 0; i < n; i++) s += pow(fabs((double)x[i]), p);
    return s;
}

static double pow_sum_16(const ct_tensor *t, double p)
{
    const uint16_t *h = ct_tensor_data(t);
    double s = 0;
    for (int64_t i = 0; i < t->numel; i++) {
        double a = fabs((double)(t->dtype == CT_BF16 ? ct_bf16_to_f32(h[i]) : ct_f16_to_f32(h[i])));
        s += p == 1.0 ? a : pow(a, p);
    }
    return s;
}

int ct_norm_type_ok(double norm_type) { return norm_type > 0; /* NaN and -inf compare false */ }

/* The norm type; 2 for a zeroed accumulator (written before p existed). */
static double p_of(const ct_norm_acc *a) { return a->p > 0 ? a->p : 2.0; }

ct_norm_acc ct_norm_acc_init(double norm_type)
{
    if (!ct_norm_type_ok(norm_type)) norm_type = 2.0; /* a zeroed accumulator's 0: the 2-norm it always was */
    return (ct_norm_acc){0.0, isinf(norm_type) != 0, norm_type};
}

void ct_norm_acc_add(ct_norm_acc *a, double v)
{
    if (!a->inf) a->v += v;
    else if (v > a->v || isnan(v)) a->v = v;
}

void ct_norm_acc_f32(ct_norm_acc *a, const float *g, int64_t n)
{
    ct_norm_acc_add(a, a->inf ? max_abs_f32(g, n) : p_of(a) == 2.0 ? sq_sum_f32(g, n) : pow_sum_f32(g, n, p_of(a)));
}

void ct_norm_acc_tensor(ct_norm_acc *a, const ct_tensor *g)
{
    if (g->dtype == CT_F32) ct_norm_acc_f32(a, ct_tensor_data(g), g->numel);
    else ct_norm_acc_add(a, a->inf ? max_abs_16(g) : p_of(a) == 2.0 ? sq_sum_tensor(g) : pow_sum_16(g, p_of(a)));
}

double ct_norm_acc_norm(const ct_norm_acc *a)
{
    if (a->inf) return a->v;
    if (p_of(a) == 2.0) return sqrt(a->v);
    return p_of(a) == 1.0 ? a->v : pow(a->v, 1.0 / p_of(a));
}

double ct_norm_acc_scaled(const ct_norm_acc *a, double v, float k)
{
    if (a->inf) return (double)((float)v * fabsf(k)); /* as the scaled f32 gradients' max */
    return v * pow(fabs((double)k), p_of(a));
}

double ct_grad_sq_sum(ct_param **params, int n)
{
    ct_norm_acc a = ct_norm_acc_init(2.0);
    for (int i = 0; i < n; i++)
        if (params[i] && params[i]->grad) ct_norm_acc_tensor(&a, params[i]->grad);
    return a.v;
}

float ct_clip_coef(double total_norm, double max_norm)
{
    double coef = max_norm / (total_norm + 1e-6);
    /* NaN (a NaN gradient) compares false: the gradients stay as they are
     * and the caller sees the NaN norm. */
    return coef < 1.0 ? (float)coef : 1.0f;
}

void ct_scale_grads(ct_param **params, int n, float scale)
{
    for (int i = 0; i < n; i++)
        if (params[i] && params[i]->grad) scale_tensor(params[i]->grad, scale);
}

ct_status ct_clip_grad_norm(ct_param **params, int n, float max_norm, float *norm)
{
    return ct_clip_grad_norm_p(params, n, max_norm, 2.0, norm);
}

ct_status ct_clip_grad_norm_p(ct_param **params, int n, float max_norm, double norm_type, float *norm)
{
    if (!(max_norm >= 0))
        return ct_error(CT_EINVAL, "max_norm %g for gradient clipping is invalid; use a value >= 0 "
                        "(or no clipping)", (double)max_norm);
    if (!ct_norm_type_ok(norm_type))
        return ct_error(CT_EINVAL, "norm_type %g for gradient clipping is invalid; use a number > 0 "
                        "or infinity (2 is the usual)", norm_type);
    ct_norm_acc a = ct_norm_acc_init(norm_type);
    for (int i = 0; i < n; i++)
        if (params[i] && params[i]->grad) ct_norm_acc_tensor(&a, params[i]->grad);
    double total = ct_norm_acc_norm(&a);
    if (norm) *norm = (float)total;
    float coef = ct_clip_coef(total, max_norm);
    if (coef < 1.0f) ct_scale_grads(params, n, coef);
    return CT_OK;
}

void ct_optim_grad_norm_acc(ct_optim *opt, ct_norm_acc *a)
{
    for (int i = 0; i < ct_optim_num_slots(opt); i++) {
        const ct_optim_slot *sl = ct_optim_slot_at(opt, i);
        if (sl->grad) ct_norm_acc_f32(a, sl->grad, sl->n);
    }
}

void ct_optim_scale_grads(ct_optim *opt, float scale)
{
    for (int i = 0; i < ct_optim_num_slots(opt); i++) {
        const ct_optim_slot *sl = ct_optim_slot_at(opt, i);
        if (sl->grad) scale_f32(sl->grad, sl->n, scale);
    }
}

/*
 * The per-element update rules of SGD and AdamW over one flat range.
 *
 * They follow PyTorch 1.13's single-tensor CPU path operation by operation
 * (torch/optim/sgd.py, adamw.py and the ATen kernels underneath), because
 * "the same numbers as PyTorch" is what lets a ctrain run be checked against
 * a PyTorch run:
 *   - hyper-parameters are Python floats (double); derived constants such
 *     as 1 - beta2 or 1 - lr*wd are computed in double and then rounded to
 *     float, as ATen rounds a Scalar for a float kernel;
 *   - add(x, alpha=a) and addcmul are fused multiply-adds in ATen's kernels
 *     (checked against torch 1.13 on AVX2/AVX-512 CPUs), so we use fmaf
 *     where the CPU has it; without hardware FMA a separate multiply and
 *     add is within an ulp and avoids a slow software fmaf;
 *   - addcdiv(m, d, value=v) computes (v*m)/d, in that order.
 * The loops are branch-free over elements (selects on loop invariants) so
 * that the compiler can vectorise them; with -std=c11 it does not contract
 * a*b+c on its own, which keeps the rounding ours.
 */
#include <math.h>

#include "ctrain/optim.h"

#ifdef FP_FAST_FMAF
static inline float fmadd(float a, float b, float c) { return fmaf(a, b, c); }
#else
static inline float fmadd(float a, float b, float c) { return a * b + c; }
#endif

/* PyTorch: d = g + wd*p (if wd); buf = d on the first step, else
 * momentum*buf + (1-dampening)*d; d = nesterov ? d + momentum*buf : buf;
 * p -= lr*d.  Weight decay 0 is skipped exactly like PyTorch (so an inf in
 * p does not turn the gradient into NaN). */
void ct_sgd_update(float *p, const float *g, float *buf, int64_t n,
                   const ct_optim_opts *o, int first_step)
{
    const int use_wd = o->weight_decay != 0;
    const float wd = (float)o->weight_decay;
    const float nlr = (float)-o->lr;
    float *restrict pp = p;
    const float *restrict gg = g;

    if (o->momentum == 0) {
        for (int64_t i = 0; i < n; i++) {
            float d = use_wd ? fmadd(pp[i], wd, gg[i]) : gg[i];
            pp[i] = fmadd(d, nlr, pp[i]);
        }
        return;
    }
    CT_ASSERT(buf != NULL || n == 0);
    const float mom = (float)o->momentum;
    const float damp1 = (float)(1.0 - o->dampening);
    const int nesterov = o->nesterov != 0, first = first_step != 0;
    float *restrict bb = buf;
    for (int64_t i = 0; i < n; i++) {
        float d = use_wd ? fmadd(pp[i], wd, gg[i]) : gg[i];
        float b = first ? d : fmadd(d, damp1, bb[i] * mom);
        bb[i] = b;
        d = nesterov ? fmadd(b, mom, d) : b;
        pp[i] = fmadd(d, nlr, pp[i]);
    }
}

/* PyTorch (decoupled weight decay): p *= 1 - lr*wd; m = b1*m + (1-b1)*g;
 * v = b2*v + (1-b2)*g*g; p -= (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
 * with bc = 1 - beta^step. */
void ct_adamw_update(float *p, const float *g, float *m, float *v, int64_t n,
                     const ct_optim_opts *o, int64_t step)
{
    CT_ASSERT(step >= 1);
    const double bc1 = 1.0 - pow(o->beta1, (double)step);
    const double bc2 = 1.0 - pow(o->beta2, (double)step);
    const float decay = (float)(1.0 - o->lr * o->weight_decay);
    const float b1 = (float)o->beta1, omb1 = (float)(1.0 - o->beta1);
    const float b2 = (float)o->beta2, omb2 = (float)(1.0 - o->beta2);
    const float nstep = (float)-(o->lr / bc1);
    const float bc2_sqrt = (float)sqrt(bc2);
    const float eps = (float)o->eps;
    float *restrict pp = p, *restrict mm = m, *restrict vv = v;
    const float *restrict gg = g;

    for (int64_t i = 0; i < n; i++) {
        float gi = gg[i];
        float mi = fmadd(gi, omb1, mm[i] * b1);
        float vi = fmadd(omb2 * gi, gi, vv[i] * b2);
        mm[i] = mi;
        vv[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        pp[i] = pp[i] * decay + (nstep * mi) / denom;
    }
}

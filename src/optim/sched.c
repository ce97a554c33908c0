/*
 * Learning-rate schedules: constant and cosine decay, both with an
 * optional linear warmup.  Pure functions of the step, so a run resumed
 * from a checkpoint at step k continues with exactly the rate it would
 * have had.
 */
#include <math.h>
#include <string.h>

#include "ctrain/optim.h"

static const char *sched_names[] = {"constant", "cosine"};

int ct_sched_parse(const char *name, ct_sched_kind *kind)
{
    for (int i = 0; i < 2; i++)
        if (name && !strcmp(name, sched_names[i])) { *kind = (ct_sched_kind)i; return 0; }
    return -1;
}

const char *ct_sched_name(ct_sched_kind kind)
{
    return (kind == CT_SCHED_CONSTANT || kind == CT_SCHED_COSINE) ? sched_names[kind] : "?";
}

ct_status ct_sched_validate(const ct_lr_schedule *s)
{
    CT_ASSERT(s);
    if (s->kind != CT_SCHED_CONSTANT && s->kind != CT_SCHED_COSINE)
        return ct_error(CT_EINVAL, "LR schedule kind %d is unknown; use constant or cosine", (int)s->kind);
    if (!(s->base_lr >= 0) || isinf(s->base_lr))
        return ct_error(CT_EINVAL, "base learning rate %g is invalid; use a finite value >= 0", s->base_lr);
    if (s->warmup_steps < 0)
        return ct_error(CT_EINVAL, "warmup_steps %lld is negative", (long long)s->warmup_steps);
    if (s->kind == CT_SCHED_CONSTANT) return CT_OK;
    if (!(s->min_lr >= 0) || s->min_lr > s->base_lr)
        return ct_error(CT_EINVAL, "cosine min_lr %g must be in [0, base lr %g]", s->min_lr, s->base_lr);
    if (s->total_steps <= 0)
        return ct_error(CT_EINVAL, "cosine schedule needs total_steps > 0 (got %lld); set it to the "
                        "number of optimizer steps of the run", (long long)s->total_steps);
    if (s->warmup_steps > s->total_steps)
        return ct_error(CT_EINVAL, "warmup_steps %lld exceeds total_steps %lld of the cosine schedule",
                        (long long)s->warmup_steps, (long long)s->total_steps);
    return CT_OK;
}

double ct_lr_at(const ct_lr_schedule *s, int64_t step)
{
    if (step < 0) step = 0;
    if (step < s->warmup_steps) return s->base_lr * (double)(step + 1) / (double)s->warmup_steps;
    if (s->kind == CT_SCHED_CONSTANT) return s->base_lr;
    int64_t span = s->total_steps - s->warmup_steps;
    double progress = (double)(step - s->warmup_steps) / (double)(span > 1 ? span : 1);
    if (progress > 1) progress = 1;
    return s->min_lr + (s->base_lr - s->min_lr) * 0.5 * (1.0 + cos(M_PI * progress));
}

/*
 * A strategy's parameters one unit at a time, in a buffer the caller owns
 * (PyTorch FSDP's summon_full_params(recurse=False) with offload_to_cpu,
 * and apply over the full parameters unit by unit): FSDP's units are its
 * wrap units (fsdp_unit_io.c); every other strategy is one unit, its
 * trainable parameters, through summon and release.  Memory stays bounded
 * by the largest unit, not the model.
 */
#include <string.h>

#include "internal.h"

int ct__whole_units(ct_strategy *s)
{
    (void)s;
    return 1;
}

ct_status ct__whole_unit_params(ct_strategy *s, int i, ct_module **m, ct_param ***ps, int *n)
{
    (void)i;
    ct_param **out = ct_alloc(sizeof *out * (size_t)(s->nparams + 1), CT_MEM_OTHER);
    if (!out) return CT_ENOMEM;
    int k = 0;
    for (int j = 0; j < s->nparams; j++)
        if (s->params[j]->requires_grad) out[k++] = s->params[j];
    *m = s->model;
    *ps = out;
    *n = k;
    return CT_OK;
}

ct_status ct__whole_unit_io(ct_strategy *s, int i, float *buf, int write)
{
    ct_module *m;
    ct_param **ps;
    int n;
    CT_TRY(s->vt.place.unit_params(s, i, &m, &ps, &n));
    ct_status st = s->vt.place.summon(s, write, 0);
    int64_t base = 0;
    for (int j = 0; st == CT_OK && j < n; j++) {
        float *d = ct_f32(ps[j]->data);
        int64_t k = ps[j]->data->numel;
        if (write) memcpy(d, buf + base, sizeof *d * (size_t)k);
        else memcpy(buf + base, d, sizeof *d * (size_t)k);
        base += k;
    }
    ct_status r = st == CT_OK ? s->vt.place.release(s) : CT_OK;
    if (st == CT_OK) st = r;
    if (st == CT_OK && write && !s->ops->manages_compute) st = ct__mixed_refresh(s);
    ct_free(ps);
    return st;
}

/* ct_group_check over s's group; a strategy without one is a process of its own */
static ct_status agree(ct_strategy *s, ct_status local) { return s->g ? ct_group_check(s->g, local) : local; }

static ct_status check_unit(ct_strategy *s, int i)
{
    int n = s->vt.place.units(s);
    if (i < 0 || i >= n)
        return ct_error(CT_EINVAL, "unit %d does not exist: %s has %d unit%s (0 to %d)", i, s->ops->kind, n,
                        n == 1 ? "" : "s", n - 1);
    return CT_OK;
}

int ct_strategy_num_units(ct_strategy *s) { return s->vt.place.units(s); }

ct_status ct_strategy_unit_params(ct_strategy *s, int i, ct_module **m, ct_param ***ps, int *n, int64_t *numel)
{
    *ps = NULL;
    *n = 0;
    CT_TRY(check_unit(s, i));
    CT_TRY(s->vt.place.unit_params(s, i, m, ps, n));
    int64_t t = 0;
    for (int j = 0; j < *n; j++) t += (*ps)[j]->data->numel;
    if (numel) *numel = t;
    return CT_OK;
}

/* unit i's element count, checking buf holds it */
static ct_status unit_fits(ct_strategy *s, int i, const float *buf, int64_t n, const char *what)
{
    ct_module *m;
    ct_param **ps;
    int np;
    int64_t need;
    CT_TRY(ct_strategy_unit_params(s, i, &m, &ps, &np, &need));
    ct_free(ps);
    if (!buf || n < need)
        return ct_error(CT_EINVAL, "%s: unit %d has %lld parameter elements but the buffer %s %lld; size it with "
                        "ct_strategy_unit_params", what, i, (long long)need, buf ? "holds" : "is NULL, of",
                        (long long)n);
    return CT_OK;
}

ct_status ct_strategy_unit_read(ct_strategy *s, int i, float *buf, int64_t n)
{
    CT_TRY(unit_fits(s, i, buf, n, "ct_strategy_unit_read"));
    const char *prev = ct_comm_enter_call("ct_strategy_unit_read");
    ct_status st = s->vt.place.unit_io(s, i, buf, 0);
    ct_comm_leave_call(prev);
    return st;
}

ct_status ct_strategy_unit_write(ct_strategy *s, int i, const float *buf, int64_t n)
{
    CT_TRY(unit_fits(s, i, buf, n, "ct_strategy_unit_write"));
    const char *prev = ct_comm_enter_call("ct_strategy_unit_write");
    ct_status st = s->vt.place.unit_io(s, i, (float *)buf, 1); /* write: buf is only read */
    ct_comm_leave_call(prev);
    return st;
}

ct_status ct_strategy_apply_units(ct_strategy *s, int writeback, ct_unit_fn fn, void *ud)
{
    if (!fn) return ct_error(CT_EINVAL, "ct_strategy_apply_units: fn is NULL");
    int nu = ct_strategy_num_units(s);
    int64_t most = 0;
    for (int i = 0; i < nu; i++) {
        ct_module *m;
        ct_param **ps;
        int n;
        int64_t k;
        CT_TRY(ct_strategy_unit_params(s, i, &m, &ps, &n, &k));
        ct_free(ps);
        if (k > most) most = k;
    }
    float *buf = ct_alloc(sizeof *buf * (size_t)(most + 1), CT_MEM_OTHER); /* the one buffer: the largest unit */
    ct_status st = buf ? CT_OK : CT_ENOMEM;
    st = agree(s, st);
    for (int i = 0; st == CT_OK && i < nu; i++) {
        ct_module *m;
        ct_param **ps = NULL;
        int n;
        int64_t k;
        st = ct_strategy_unit_params(s, i, &m, &ps, &n, &k);
        if (st == CT_OK) st = ct_strategy_unit_read(s, i, buf, most);
        ct_status local = st == CT_OK ? fn(m, ps, n, buf, ud) : st;
        ct_free(ps);
        if (st == CT_OK) st = agree(s, local); /* every rank stops at a failure of any */
        if (st == CT_OK && writeback) st = ct_strategy_unit_write(s, i, buf, most);
    }
    ct_free(buf);
    return st;
}

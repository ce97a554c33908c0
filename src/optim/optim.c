/*
 * The optimizer object: options and their validation, the slot table
 * (whole parameters that are followed through re-pointing, or explicit flat
 * ranges), the state slab, stepping and checkpoint access to state.
 *
 * State for all slots lives in one CT_MEM_OPTIM slab, sized at creation and
 * allocated on first need (a step or a ct_optim_state call), so an
 * optimizer that is created but never stepped costs nothing and a failed
 * allocation leaves no half-initialised state behind.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

typedef struct {
    ct_optim_slot s;
    ct_param *param;  /* followed parameter, or NULL for an explicit range */
    int ranged;       /* follows [s.offset, s.offset + s.n) of param, not all of it */
    char *name;       /* our copy of the name for explicit ranges */
    size_t state_off; /* floats from the slab start to this slot's first buffer */
    int64_t step;     /* PyTorch's per-parameter step */
    int group;        /* index into the optimizer's groups, -1: the default group */
} slot_t;

struct ct_optim {
    ct_optim_opts o;
    slot_t *slots;
    int nslots;
    int64_t step;
    int nbufs;        /* state buffers per slot */
    size_t slab_len;  /* floats */
    float *slab;      /* NULL until first needed */
    ct_optim_group *gtab; /* our copy of the groups; o.groups points here */
};

/* ---- options ----------------------------------------------------------- */

ct_optim_opts ct_optim_defaults(ct_optim_kind kind)
{
    ct_optim_opts o = {
        .kind = kind,
        .lr = kind == CT_OPT_ADAMW ? 1e-3 : 0.01,
        .weight_decay = kind == CT_OPT_ADAMW ? 0.01 : 0.0,
        .momentum = 0.0,
        .dampening = 0.0,
        .nesterov = 0,
        .beta1 = 0.9,
        .beta2 = 0.999,
        .eps = 1e-8,
    };
    return o;
}

/* !(x >= 0) also catches NaN. */
static ct_status check_nonneg(double x, const char *what)
{
    if (!(x >= 0) || isinf(x))
        return ct_error(CT_EINVAL, "optimizer %s %g is invalid; use a finite value >= 0", what, x);
    return CT_OK;
}

static ct_status check_beta(double b, int which)
{
    if (!(b >= 0 && b < 1))
        return ct_error(CT_EINVAL, "AdamW beta%d %g is outside [0, 1); typical values are 0.9 and 0.999",
                        which, b);
    return CT_OK;
}

static ct_status validate_values(const ct_optim_opts *o)
{
    CT_TRY(check_nonneg(o->lr, "lr"));
    CT_TRY(check_nonneg(o->weight_decay, "weight_decay"));
    switch (o->kind) {
    case CT_OPT_SGD:
        CT_TRY(check_nonneg(o->momentum, "momentum"));
        if (!isfinite(o->dampening))
            return ct_error(CT_EINVAL, "SGD dampening %g is not finite; use a value in [0, 1]", o->dampening);
        if (o->nesterov && (o->momentum <= 0 || o->dampening != 0))
            return ct_error(CT_EINVAL,
                            "SGD nesterov needs momentum > 0 and dampening 0 (got momentum %g, dampening %g)",
                            o->momentum, o->dampening);
        return CT_OK;
    case CT_OPT_ADAMW:
        CT_TRY(check_beta(o->beta1, 1));
        CT_TRY(check_beta(o->beta2, 2));
        CT_TRY(check_nonneg(o->eps, "eps"));
        return CT_OK;
    }
    return ct_error(CT_EINVAL, "optimizer kind %d is unknown; use CT_OPT_SGD or CT_OPT_ADAMW", (int)o->kind);
}

ct_status ct_optim_validate(const ct_optim_opts *o)
{
    CT_ASSERT(o);
    CT_TRY(validate_values(o));
    return o->groups || o->ngroups ? ct__optim_groups_check(o) : CT_OK;
}

static const char *kind_names[] = {"sgd", "adamw"};

int ct_optim_parse(const char *name, ct_optim_kind *kind)
{
    for (int i = 0; i < 2; i++)
        if (name && !strcmp(name, kind_names[i])) { *kind = (ct_optim_kind)i; return 0; }
    return -1;
}

const char *ct_optim_name(const ct_optim *opt) { return kind_names[opt->o.kind]; }

/* ---- slots ------------------------------------------------------------- */

static int state_bufs(const ct_optim_opts *o)
{
    if (o->kind == CT_OPT_ADAMW) return 2;
    return o->momentum != 0 ? 1 : 0;
}

/* Re-reads a followed parameter's data, grad and name.  Fails if it no
 * longer matches what the state was sized for. */
static ct_status refresh(slot_t *sl)
{
    ct_param *p = sl->param;
    if (!p) return CT_OK;
    sl->s.name = p->name ? p->name : "";
    int64_t need = sl->ranged ? sl->s.offset + sl->s.n : sl->s.n;
    if (!p->data || p->data->dtype != CT_F32 || (sl->ranged ? p->data->numel < need : p->data->numel != need))
        return ct_error(CT_ESTATE,
                        "parameter %s is no longer an f32 tensor of %lld elements as when the "
                        "optimizer was created; create the optimizer after re-pointing parameters",
                        p->name ? p->name : "?", (long long)need);
    if (p->grad && (p->grad->dtype != CT_F32 || p->grad->numel != p->data->numel))
        return ct_error(CT_ESTATE, "gradient of parameter %s is %s with %lld elements; the optimizer needs f32 with %lld",
                        p->name ? p->name : "?", ct_dtype_name(p->grad->dtype),
                        (long long)p->grad->numel, (long long)p->data->numel);
    int64_t off = sl->ranged ? sl->s.offset : 0;
    sl->s.data = (float *)ct_tensor_data(p->data) + off;
    sl->s.grad = p->grad ? (float *)ct_tensor_data(p->grad) + off : NULL;
    return CT_OK;
}

/* A slot's state buffer in floats: each slot's buffers start on a 64-byte
 * boundary so the update loops see aligned data. */
static size_t slot_floats(size_t n) { return (n + 15) & ~(size_t)15; }

/* The slab holds at least this many floats, so that empty slots still get
 * non-NULL buffers. */
#define SLAB_MIN_FLOATS 16

uint64_t ct_optim_state_bytes(const ct_optim_opts *o, const int64_t *counts, int n)
{
    uint64_t floats = 0, nbufs = (uint64_t)state_bufs(o);
    for (int i = 0; i < n; i++) floats += slot_floats((size_t)counts[i]) * nbufs;
    if (nbufs && floats < SLAB_MIN_FLOATS) floats = SLAB_MIN_FLOATS;
    return floats * sizeof(float);
}

/* Each slot's group, by its parameter's name (a piece of a parameter is in
 * the parameter's group). */
static void assign_groups(ct_optim *opt)
{
    for (int i = 0; i < opt->nslots; i++) opt->slots[i].group = ct_optim_group_of(&opt->o, opt->slots[i].s.name);
}

/* Sizes the state slab. */
static ct_status layout_state(ct_optim *opt)
{
    opt->nbufs = state_bufs(&opt->o);
    size_t off = 0;
    for (int i = 0; i < opt->nslots; i++) {
        size_t n = (size_t)opt->slots[i].s.n;
        size_t padded = slot_floats(n);
        opt->slots[i].state_off = off;
        size_t add = padded * (size_t)opt->nbufs;
        if (padded < n || (opt->nbufs && add / (size_t)opt->nbufs != padded) || off + add < off)
            return ct_error(CT_EINVAL, "optimizer state for %d slots overflows the address space", opt->nslots);
        off += add;
    }
    opt->slab_len = off;
    return CT_OK;
}

static ct_optim *optim_new(const ct_optim_opts *o, int nslots)
{
    if (!o) {
        ct_error(CT_EINVAL, "optimizer options are NULL; start from ct_optim_defaults()");
        return NULL;
    }
    if (ct_optim_validate(o) != CT_OK) return NULL;
    if (nslots < 0) {
        ct_error(CT_EINVAL, "optimizer got %d slots; the count must be >= 0", nslots);
        return NULL;
    }
    ct_optim *opt = ct_alloc_zeroed(sizeof *opt, CT_MEM_OPTIM);
    if (!opt) return NULL;
    opt->o = *o;
    opt->o.groups = NULL;
    opt->o.ngroups = 0;
    if (ct__optim_groups_append(&opt->gtab, 0, o->groups, o->ngroups) != CT_OK) {
        ct_free(opt);
        return NULL;
    }
    opt->o.groups = opt->gtab;
    opt->o.ngroups = o->ngroups;
    if (nslots > 0) {
        opt->slots = ct_alloc_zeroed(sizeof *opt->slots * (size_t)nslots, CT_MEM_OPTIM);
        if (!opt->slots) {
            ct__optim_groups_free(opt->gtab, opt->o.ngroups);
            ct_free(opt);
            return NULL;
        }
    }
    return opt;
}

ct_optim *ct_optim_create(const ct_optim_opts *o, ct_param **params, int n)
{
    if (n < 0 || (n > 0 && !params)) {
        ct_error(CT_EINVAL, "ct_optim_create got %d parameters%s", n, params ? "" : " and a NULL list");
        return NULL;
    }
    int count = 0;
    for (int i = 0; i < n; i++) {
        ct_param *p = params[i];
        if (!p) {
            ct_error(CT_EINVAL, "parameter %d of %d is NULL", i, n);
            return NULL;
        }
        if (!p->requires_grad) continue;
        if (!p->data) {
            ct_error(CT_EINVAL, "parameter %s has no data tensor", p->name ? p->name : "?");
            return NULL;
        }
        if (p->data->dtype != CT_F32) {
            ct_error(CT_EUNSUPPORTED, "parameter %s is %s; the optimizer steps f32 (master) weights",
                     p->name ? p->name : "?", ct_dtype_name(p->data->dtype));
            return NULL;
        }
        /* Listed twice, it would be stepped twice (PyTorch refuses too). */
        for (int j = 0; j < i; j++)
            if (params[j] == p) {
                ct_error(CT_EINVAL, "parameter %s appears twice in the optimizer's list (at %d and %d)",
                         p->name ? p->name : "?", j, i);
                return NULL;
            }
        count++;
    }
    ct_optim *opt = optim_new(o, count);
    if (!opt) return NULL;
    for (int i = 0; i < n; i++) {
        if (!params[i]->requires_grad) continue;
        slot_t *sl = &opt->slots[opt->nslots++];
        sl->param = params[i];
        sl->s.n = params[i]->data->numel;
        if (refresh(sl) != CT_OK) goto out_destroy;
    }
    if (layout_state(opt) != CT_OK) goto out_destroy;
    assign_groups(opt);
    return opt;

out_destroy:
    ct_optim_destroy(opt);
    return NULL;
}

ct_optim *ct_optim_create_ranges(const ct_optim_opts *o, const ct_optim_range *r, int n)
{
    if (n < 0 || (n > 0 && !r)) {
        ct_error(CT_EINVAL, "ct_optim_create_ranges got %d ranges%s", n, r ? "" : " and a NULL table");
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        const ct_param *p = r[i].param;
        if (!p || !p->data || r[i].offset < 0 || r[i].count < 0 || r[i].offset > p->data->numel - r[i].count) {
            ct_error(CT_EINVAL, "range %d (%s [%lld, +%lld)) is not inside its parameter", i,
                     p && p->name ? p->name : "?", (long long)r[i].offset, (long long)r[i].count);
            return NULL;
        }
        if (p->data->dtype != CT_F32) {
            ct_error(CT_EUNSUPPORTED, "parameter %s is %s; the optimizer steps f32 (master) weights",
                     p->name ? p->name : "?", ct_dtype_name(p->data->dtype));
            return NULL;
        }
    }
    ct_optim *opt = optim_new(o, n);
    if (!opt) return NULL;
    for (int i = 0; i < n; i++) {
        slot_t *sl = &opt->slots[opt->nslots++];
        sl->param = r[i].param;
        sl->ranged = 1;
        sl->s.offset = r[i].offset;
        sl->s.n = r[i].count;
        if (refresh(sl) != CT_OK) goto out_destroy;
    }
    if (layout_state(opt) != CT_OK) goto out_destroy;
    assign_groups(opt);
    return opt;

out_destroy:
    ct_optim_destroy(opt);
    return NULL;
}

ct_optim *ct_optim_create_slots(const ct_optim_opts *o, const ct_optim_slot *slots, int n)
{
    if (n < 0 || (n > 0 && !slots)) {
        ct_error(CT_EINVAL, "ct_optim_create_slots got %d slots%s", n, slots ? "" : " and a NULL table");
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        const ct_optim_slot *s = &slots[i];
        if (s->n < 0 || s->offset < 0 || (s->n > 0 && !s->data)) {
            ct_error(CT_EINVAL, "slot %d (%s) has n %lld, offset %lld, data %s; need n >= 0, offset >= 0 and data",
                     i, s->name ? s->name : "unnamed", (long long)s->n, (long long)s->offset,
                     s->data ? "set" : "NULL");
            return NULL;
        }
    }
    ct_optim *opt = optim_new(o, n);
    if (!opt) return NULL;
    for (int i = 0; i < n; i++) {
        slot_t *sl = &opt->slots[opt->nslots++];
        sl->s = slots[i];
        char tmp[32];
        const char *nm = slots[i].name;
        if (!nm) {
            snprintf(tmp, sizeof tmp, "slot%d", i);
            nm = tmp;
        }
        size_t len = strlen(nm) + 1;
        sl->name = ct_alloc_zeroed(len, CT_MEM_OPTIM);
        if (!sl->name) goto out_destroy;
        memcpy(sl->name, nm, len);
        sl->s.name = sl->name;
    }
    if (layout_state(opt) != CT_OK) goto out_destroy;
    assign_groups(opt);
    return opt;

out_destroy:
    ct_optim_destroy(opt);
    return NULL;
}

void ct_optim_destroy(ct_optim *opt)
{
    if (!opt) return;
    for (int i = 0; i < opt->nslots; i++) ct_free(opt->slots[i].name);
    ct_free(opt->slots);
    ct_free(opt->slab);
    ct__optim_groups_free(opt->gtab, opt->o.ngroups);
    ct_free(opt);
}

void ct_optim_set_slot(ct_optim *opt, int i, float *data, float *grad)
{
    CT_ASSERT(opt && i >= 0 && i < opt->nslots);
    slot_t *sl = &opt->slots[i];
    CT_ASSERT(data || sl->s.n == 0);
    if (sl->param) {
        sl->ranged = 0;
        /* The parameter's name may be freed by a later renaming; keep a copy. */
        (void)refresh(sl);
        size_t len = strlen(sl->s.name) + 1;
        char *nm = ct_alloc_zeroed(len, CT_MEM_OPTIM);
        if (nm) {
            memcpy(nm, sl->s.name, len);
            sl->name = nm;
        }
        sl->s.name = sl->name ? sl->name : "";
        sl->param = NULL;
    }
    sl->s.data = data;
    sl->s.grad = grad;
}

int ct_optim_num_slots(const ct_optim *opt) { return opt->nslots; }

const ct_optim_slot *ct_optim_slot_at(const ct_optim *opt, int i)
{
    CT_ASSERT(opt && i >= 0 && i < opt->nslots);
    /* Best effort: a parameter that no longer fits keeps its last pointers
     * here; ct_optim_step reports the mismatch. */
    (void)refresh(&opt->slots[i]);
    return &opt->slots[i].s;
}

ct_status ct_optim_add_param_group(ct_optim *opt, const ct_optim_group *g)
{
    CT_ASSERT(opt);
    if (!g) return ct_error(CT_EINVAL, "ct_optim_add_param_group got a NULL group");
    /* Checked as the table it would make, so a name another group has is refused. */
    int n0 = opt->o.ngroups;
    ct_optim_group *all = ct_alloc(sizeof *all * (size_t)(n0 + 1), CT_MEM_OTHER);
    if (!all) return CT_ENOMEM;
    if (n0) memcpy(all, opt->gtab, sizeof *all * (size_t)n0);
    all[n0] = *g;
    ct_optim_opts o = opt->o;
    o.groups = all;
    o.ngroups = n0 + 1;
    ct_status st = ct__optim_groups_check(&o);
    ct_free(all);
    CT_TRY(st);
    CT_TRY(ct__optim_groups_append(&opt->gtab, n0, g, 1));
    opt->o.groups = opt->gtab;
    opt->o.ngroups = n0 + 1;
    assign_groups(opt);
    return CT_OK;
}

int ct_optim_num_groups(const ct_optim *opt) { return opt->o.ngroups; }

void ct_optim_set_lr(ct_optim *opt, double lr) { opt->o.lr = lr; }
double ct_optim_get_lr(const ct_optim *opt) { return opt->o.lr; }
const ct_optim_opts *ct_optim_get_opts(const ct_optim *opt) { return &opt->o; }
int64_t ct_optim_get_step(const ct_optim *opt) { return opt->step; }

void ct_optim_set_step(ct_optim *opt, int64_t step)
{
    CT_ASSERT(opt && step >= 0);
    opt->step = step;
    for (int i = 0; i < opt->nslots; i++) opt->slots[i].step = step;
}

/* ---- state and stepping ------------------------------------------------ */

static void zero_part(void *slab, int64_t lo, int64_t hi)
{
    memset((float *)slab + lo, 0, (size_t)(hi - lo) * sizeof(float));
}

static ct_status ensure_state(ct_optim *opt)
{
    if (opt->slab || opt->nbufs == 0) return CT_OK;
    if (opt->slab_len > SIZE_MAX / sizeof(float))
        return ct_error(CT_ENOMEM, "optimizer state of %zu floats is too large", opt->slab_len);
    size_t len = opt->slab_len > SLAB_MIN_FLOATS ? opt->slab_len : SLAB_MIN_FLOATS;
    opt->slab = ct_alloc(len * sizeof(float), CT_MEM_OPTIM);
    if (!opt->slab) return CT_ENOMEM;
    /* Zeroed by writing, on the rank's threads: left to a fresh mapping's
     * zero pages, the first update read-faults each page in and then
     * write-faults it again, and every such fault flushes the other threads'
     * TLBs (12 x 768 GPT, bf16, 2 threads: the first optimizer step took
     * 2.3 s against 0.1 s for the next). */
    ct_parallel_for((int64_t)len, 1 << 16, zero_part, opt->slab);
    return CT_OK;
}

void ct_optim_release_state(ct_optim *opt)
{
    CT_ASSERT(opt);
    ct_free(opt->slab);
    opt->slab = NULL;
}

static float *slot_buf(const ct_optim *opt, const slot_t *sl, int b)
{
    size_t padded = slot_floats((size_t)sl->s.n);
    return opt->slab + sl->state_off + (size_t)b * padded;
}

int ct_optim_state_names(const ct_optim *opt, const char **names)
{
    static const char *sgd_names[] = {"momentum_buffer"};
    static const char *adamw_names[] = {"exp_avg", "exp_avg_sq"};
    const char **nm = opt->o.kind == CT_OPT_ADAMW ? adamw_names : sgd_names;
    for (int b = 0; names && b < opt->nbufs; b++) names[b] = nm[b];
    return opt->nbufs;
}

int ct_optim_state(ct_optim *opt, int i, float **bufs, const char **names)
{
    CT_ASSERT(opt && i >= 0 && i < opt->nslots);
    if (opt->nbufs == 0) return 0;
    CT_TRY(ensure_state(opt));
    ct_optim_state_names(opt, names);
    for (int b = 0; bufs && b < opt->nbufs; b++) bufs[b] = slot_buf(opt, &opt->slots[i], b);
    return opt->nbufs;
}

/* One thread's elements of ct_optim_update_range. */
typedef struct {
    const ct_optim_opts *o;
    float *data, *const *state;
    const float *grad;
    int64_t step;
} update_job;

static void update_part(void *ctx, int64_t lo, int64_t hi)
{
    const update_job *j = ctx;
    float *s0 = j->state && j->state[0] ? j->state[0] + lo : NULL;
    switch (j->o->kind) {
    case CT_OPT_ADAMW:
        ct_adamw_update(j->data + lo, j->grad + lo, s0, j->state[1] + lo, hi - lo, j->o, j->step);
        return;
    case CT_OPT_SGD:
        ct_sgd_update(j->data + lo, j->grad + lo, state_bufs(j->o) ? s0 : NULL, hi - lo, j->o, j->step == 1);
        return;
    }
    CT_ASSERT(!"ct_optim_validate accepts only known optimizer kinds");
}

/* Elements per thread below which waking the team costs more than it saves. */
#define UPDATE_GRAIN 16384

void ct_optim_update_range(const ct_optim_opts *o, float *data, const float *grad, float *const *state,
                           int64_t n, int64_t step)
{
    /* Each element's update reads only its own p, g and state: cut over the
     * rank's threads, the bits are those of one thread. */
    update_job j = {o, data, state, grad, step};
    double t0 = ct_ledger_begin();
    ct_parallel_for(n, UPDATE_GRAIN, update_part, &j);
    ct_ledger_end(CT_LEDGER_OPTIMIZER, t0);
}

/* The hyper-parameters of each group for this step: [0] the default
 * group's, [1 + g] group g's.  NULL with the error set if a value is bad
 * (the learning rate may have been changed by a schedule since creation). */
static ct_optim_opts *step_opts(ct_optim *opt)
{
    ct_optim_opts *e = ct_alloc(sizeof *e * (size_t)(opt->o.ngroups + 1), CT_MEM_OTHER);
    if (!e) return NULL;
    e[0] = ct__optim_group_opts(&opt->o, -1);
    for (int g = 0; g < opt->o.ngroups; g++) e[1 + g] = ct__optim_group_opts(&opt->o, g);
    for (int g = 0; g <= opt->o.ngroups; g++)
        if (ct_optim_validate(&e[g]) != CT_OK) {
            if (g) ct_error(ct_last_status(), "optimizer group %d: %s", g - 1, ct_last_error());
            ct_free(e);
            return NULL;
        }
    return e;
}

ct_status ct_optim_step(ct_optim *opt)
{
    CT_ASSERT(opt);
    ct_optim_opts *eo = step_opts(opt);
    if (!eo) return ct_last_status();
    ct_status st = CT_OK;
    for (int i = 0; st == CT_OK && i < opt->nslots; i++) st = refresh(&opt->slots[i]);
    if (st == CT_OK) st = ensure_state(opt);
    if (st != CT_OK) {
        ct_free(eo);
        return st;
    }

    for (int i = 0; i < opt->nslots; i++) {
        slot_t *sl = &opt->slots[i];
        if (!sl->s.grad) continue;
        float *bufs[CT_OPTIM_MAX_STATE] = {NULL};
        for (int b = 0; b < opt->nbufs; b++) bufs[b] = slot_buf(opt, sl, b);
        ct_optim_update_range(&eo[1 + sl->group], sl->s.data, sl->s.grad, bufs, sl->s.n, ++sl->step);
    }
    opt->step++;
    ct_free(eo);
    return CT_OK;
}

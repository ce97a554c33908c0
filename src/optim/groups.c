/*
 * Parameter groups (PyTorch's param_groups): which parameter trains with
 * which hyper-parameters, their checks, and the optimizer's private copy
 * of the table.  Groups name their parameters, so the same table serves a
 * whole-parameter optimizer, ZeRO's ranges, FSDP's pieces and offload's
 * slices: each piece carries its parameter's name.  The copies are
 * bookkeeping (CT_MEM_OTHER), not optimizer state: the state per element
 * is the same whatever the groups, so a memory plan needs no change.
 */
#include <fnmatch.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

ct_optim_group ct_optim_group_init(const ct_optim_opts *o)
{
    ct_optim_group g = {
        .lr_scale = 1.0,
        .weight_decay = o->weight_decay,
        .beta1 = o->beta1,
        .beta2 = o->beta2,
        .eps = o->eps,
    };
    return g;
}

int ct_optim_group_of(const ct_optim_opts *o, const char *name)
{
    for (int i = 0; name && o->groups && i < o->ngroups; i++)
        for (int j = 0; j < o->groups[i].nparams; j++)
            if (!strcmp(o->groups[i].params[j], name)) return i;
    return -1;
}

/* A group's values over the defaults; lr_scale 1 keeps the lr bit for bit. */
static ct_optim_opts apply(const ct_optim_opts *o, const ct_optim_group *g)
{
    ct_optim_opts e = *o;
    e.groups = NULL;
    e.ngroups = 0;
    if (!g) return e;
    e.lr = o->lr * g->lr_scale;
    e.weight_decay = g->weight_decay;
    e.beta1 = g->beta1;
    e.beta2 = g->beta2;
    e.eps = g->eps;
    return e;
}

ct_optim_opts ct__optim_group_opts(const ct_optim_opts *o, int group)
{
    return apply(o, group >= 0 ? &o->groups[group] : NULL);
}

void ct_optim_param_opts(const ct_optim_opts *o, const char *name, ct_optim_opts *out)
{
    *out = ct__optim_group_opts(o, ct_optim_group_of(o, name));
}

ct_status ct__optim_groups_check(const ct_optim_opts *o)
{
    if (o->ngroups < 0 || (o->ngroups > 0 && !o->groups))
        return ct_error(CT_EINVAL, "optimizer has %d groups%s; give ngroups >= 0 and the table", o->ngroups,
                        o->groups ? "" : " and a NULL table");
    for (int i = 0; i < o->ngroups; i++) {
        const ct_optim_group *g = &o->groups[i];
        if (!(g->lr_scale >= 0) || isinf(g->lr_scale))
            return ct_error(CT_EINVAL, "optimizer group %d has lr_scale %g; use a finite value >= 0 (1: the "
                            "optimizer's lr)", i, g->lr_scale);
        if (g->nparams < 0 || (g->nparams > 0 && !g->params))
            return ct_error(CT_EINVAL, "optimizer group %d lists %d parameters%s", i, g->nparams,
                            g->params ? "" : " and a NULL list");
        ct_optim_opts e = apply(o, g);
        ct_status st = ct_optim_validate(&e);
        if (st != CT_OK)
            return ct_error(st, "optimizer group %d: %s", i, ct_last_error());
        for (int j = 0; j < g->nparams; j++) {
            const char *nm = g->params[j];
            if (!nm) return ct_error(CT_EINVAL, "optimizer group %d: parameter name %d is NULL", i, j);
            /* PyTorch refuses a parameter in two groups: which values would it take? */
            for (int a = 0; a <= i; a++)
                for (int b = 0; b < (a == i ? j : o->groups[a].nparams); b++)
                    if (o->groups[a].params[b] && !strcmp(o->groups[a].params[b], nm))
                        return ct_error(CT_EINVAL, "parameter %s is in optimizer group %d and again in group "
                                        "%d; a parameter belongs to one group", nm, a, i);
        }
    }
    return CT_OK;
}

static void free_names(ct_optim_group *g, int n)
{
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < g[i].nparams; j++) ct_free((void *)g[i].params[j]);
        ct_free((void *)g[i].params);
    }
}

void ct__optim_groups_free(ct_optim_group *tab, int n)
{
    if (!tab) return;
    free_names(tab, n);
    ct_free(tab);
}

static ct_status copy_group(ct_optim_group *dst, const ct_optim_group *src)
{
    *dst = *src;
    dst->params = NULL;
    dst->nparams = 0;
    if (!src->nparams) return CT_OK;
    char **names = ct_alloc_zeroed(sizeof *names * (size_t)src->nparams, CT_MEM_OTHER);
    if (!names) return CT_ENOMEM;
    dst->params = (const char *const *)names;
    for (int j = 0; j < src->nparams; j++) {
        size_t len = strlen(src->params[j]) + 1;
        if (!(names[j] = ct_alloc(len, CT_MEM_OTHER))) return CT_ENOMEM;
        memcpy(names[j], src->params[j], len);
        dst->nparams = j + 1;
    }
    return CT_OK;
}

ct_status ct__optim_groups_append(ct_optim_group **tab, int n0, const ct_optim_group *add, int n)
{
    if (n <= 0) return CT_OK;
    ct_optim_group *t = ct_alloc_zeroed(sizeof *t * (size_t)(n0 + n), CT_MEM_OTHER);
    if (!t) return CT_ENOMEM;
    for (int i = 0; i < n; i++)
        if (copy_group(&t[n0 + i], &add[i]) != CT_OK) {
            free_names(t + n0, i + 1); /* the first n0 entries are still *tab's */
            ct_free(t);
            return ct_error(CT_ENOMEM, "no memory for a copy of %d optimizer groups", n);
        }
    if (n0) memcpy(t, *tab, sizeof *t * (size_t)n0);
    ct_free(*tab);
    *tab = t;
    return CT_OK;
}

/* ---- selecting a group's parameters by rule ----------------------------- */

/* Whether p matches rule r (len bytes, not terminated); -1 for a malformed
 * "ndim<" rule. */
static int rule_matches(const char *r, size_t len, const ct_param *p)
{
    char buf[256];
    if (len >= sizeof buf) return -1;
    memcpy(buf, r, len);
    buf[len] = 0;
    if (!strcmp(buf, "none")) return 0;
    if (!strncmp(buf, "ndim<", 5)) {
        char *end;
        long k = strtol(buf + 5, &end, 10);
        if (end == buf + 5 || *end || k < 0 || k > CT_MAX_DIMS + 1) return -1;
        return p->data->ndim < k;
    }
    return fnmatch(buf, p->name ? p->name : "", 0) == 0;
}

ct_status ct_optim_select(ct_param **params, int n, const char *rules, const char ***names, int *count)
{
    *names = NULL;
    *count = 0;
    if (!rules || !*rules)
        return ct_error(CT_EINVAL, "parameter rules are empty; give 'ndim<2', a glob such as '*.bias', or 'none'");
    /* The rules are checked even with no parameters to try them on. */
    for (const char *r = rules;;) {
        size_t len = strcspn(r, ",");
        if (!len || len >= 256 || (!strncmp(r, "ndim<", 5) && rule_matches(r, len, &(ct_param){.data = &(ct_tensor){.ndim = 0}}) < 0))
            return ct_error(CT_EINVAL, "parameter rule '%.*s' in '%s' is %s; rules are 'ndim<K', a glob on the full "
                            "name such as '*.bias', or 'none', separated by commas", (int)(len < 64 ? len : 64), r,
                            rules, len ? "malformed" : "empty");
        if (!r[len]) break;
        r += len + 1;
    }
    const char **out = ct_alloc(sizeof *out * (size_t)(n + 1), CT_MEM_OTHER);
    if (!out) return CT_ENOMEM;
    int c = 0;
    for (int i = 0; i < n; i++) {
        ct_param *p = params[i];
        if (!p || !p->requires_grad || !p->data) continue;
        int hit = 0;
        for (const char *r = rules; !hit;) {
            size_t len = strcspn(r, ",");
            hit = rule_matches(r, len, p) > 0;
            if (!r[len]) break;
            r += len + 1;
        }
        if (hit) out[c++] = p->name;
    }
    *names = out;
    *count = c;
    return CT_OK;
}

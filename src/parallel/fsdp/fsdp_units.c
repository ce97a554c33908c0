/*
 * Which modules become FSDP units, and which unit's flat parameter each
 * trainable parameter joins.  The model itself is always a unit; so is
 * every module named by wrap_modules or of a kind in wrap_kinds, and (as
 * PyTorch's size_based_auto_wrap_policy) every module whose parameters not
 * yet in a unit below it reach wrap_min_params elements.  A module named by
 * ignored_modules keeps its whole subtree's parameters replicated, a unit
 * of its own that is never sharded.  A parameter used by several modules (a
 * tied weight) joins the unit enclosing all of its users, so its gradient
 * is complete before that unit reduces it.
 */
#include <stdio.h>
#include <string.h>

#include "fsdp.h"

/* 1 if word is one of the '+'-separated items of list. */
static int in_list(const char *list, const char *word)
{
    size_t len = strlen(word);
    for (const char *c = list ? list : ""; *c;) {
        const char *plus = strchr(c, '+');
        size_t w = plus ? (size_t)(plus - c) : strlen(c);
        if (w == len && !strncmp(c, word, len)) return 1;
        c += w + (plus != NULL);
    }
    return 0;
}

/* Every item of list must name something: fqn (by_kind 0) or kind (1). */
static ct_status check_list(const char *key, const char *list, ct_module **mods, int nm, int by_kind)
{
    char item[256];
    for (const char *c = list ? list : ""; *c;) {
        const char *plus = strchr(c, '+');
        size_t w = plus ? (size_t)(plus - c) : strlen(c);
        c += w + (plus != NULL);
        if (!w) continue;
        if (w >= sizeof item) return ct_error(CT_EINVAL, "fsdp option %s: '%.40s...' is too long", key, c - w);
        memcpy(item, c - w - (plus != NULL), w);
        item[w] = 0;
        int found = 0;
        for (int i = 0; i < nm && !found; i++)
            found = !strcmp(by_kind ? mods[i]->ops->kind : mods[i]->fqn, item);
        if (!found) {
            char have[512] = "";
            size_t off = 0;
            for (int i = by_kind ? 0 : 1; i < nm && off < sizeof have; i++) {
                const char *x = by_kind ? mods[i]->ops->kind : mods[i]->fqn;
                if (by_kind && strstr(have, x)) continue;
                off += (size_t)snprintf(have + off, sizeof have - off, "%s%s", off ? ", " : "", x);
            }
            return ct_error(CT_EINVAL, "fsdp option %s: the model has no %s '%s'; it has: %s (separate several "
                            "with '+')", key, by_kind ? "module kind" : "module", item, have);
        }
    }
    return CT_OK;
}

static int index_of(ct_module **mods, int nm, const ct_module *m)
{
    for (int i = 0; i < nm; i++)
        if (mods[i] == m) return i;
    return -1;
}

void ct__fsdp_free_units(fsdp_t *f)
{
    for (int i = 0; f->u && i < f->nu; i++)
        for (int k = 0; k < f->u[i].nfl; k++) {
            ct__flat_fini(&f->u[i].fl[k].flat);
        }
    ct_free(f->u);
    f->u = NULL;
    f->nu = 0;
}

ct_status ct__fsdp_build_units(ct_strategy *s, fsdp_t *f)
{
    const fsdp_opts *o = s->kopts;
    const char *wrap_modules = ct_strategy_opt(s, "wrap_modules");
    const char *wrap_kinds = ct_strategy_opt(s, "wrap_kinds");
    const char *ignored = ct_strategy_opt(s, "ignored_modules");
    ct_module **mods = NULL;
    int nm = 0;
    CT_TRY(ct_module_modules(s->model, &mods, &nm));
    size_t n1 = (size_t)nm + 1;
    int *par = ct_alloc(sizeof *par * n1, CT_MEM_OTHER), *mark = ct_alloc_zeroed(sizeof *mark * n1, CT_MEM_OTHER);
    int *ign = ct_alloc_zeroed(sizeof *ign * n1, CT_MEM_OTHER), *depth = ct_alloc(sizeof *depth * n1, CT_MEM_OTHER);
    int *unit_of = ct_alloc(sizeof *unit_of * n1, CT_MEM_OTHER); /* module index -> unit number */
    int *home = ct_alloc(sizeof *home * ((size_t)s->nparams + 1), CT_MEM_OTHER); /* param -> module index */
    int64_t *cnt = ct_alloc_zeroed(sizeof *cnt * n1, CT_MEM_OTHER);
    ct_status st = par && mark && ign && depth && unit_of && home && cnt ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) st = check_list("wrap_modules", wrap_modules, mods, nm, 0);
    if (st == CT_OK) st = check_list("wrap_kinds", wrap_kinds, mods, nm, 1);
    if (st == CT_OK) st = check_list("ignored_modules", ignored, mods, nm, 0);
    if (st != CT_OK) goto out;
    /* pre-order: a parent comes before its children */
    for (int i = 0; i < nm; i++) {
        par[i] = i ? index_of(mods, i, mods[i]->parent) : -1;
        depth[i] = i ? depth[par[i]] + 1 : 0;
        ign[i] = i && (ign[par[i]] || in_list(ignored, mods[i]->fqn));
        if (ign[i] && !ign[par[i]]) mark[i] = 2; /* the top of an ignored subtree */
        else if (!ign[i] && (!i || in_list(wrap_modules, mods[i]->fqn) || in_list(wrap_kinds, mods[i]->ops->kind)))
            mark[i] = 1;
    }
    if (ign[0] || in_list(ignored, "")) {
        st = ct_error(CT_EINVAL, "fsdp option ignored_modules names the whole model; ignore parts of it");
        goto out;
    }
    /* size policy, children before parents: what is not yet in a unit below */
    for (int i = nm - 1; i >= 0; i--) {
        ct_module *m = mods[i];
        for (int j = 0; j < m->nparams; j++)
            if (m->params[j]->requires_grad) cnt[i] += m->params[j]->data->numel;
        if (!mark[i] && !ign[i] && o->wrap_min_params > 0 && cnt[i] >= o->wrap_min_params) mark[i] = 1;
        if (i && !mark[i]) cnt[par[i]] += cnt[i];
    }
    /* each trainable parameter's home: the deepest module enclosing all its users */
    for (int q = 0; q < s->nparams; q++) {
        home[q] = -1;
        if (!s->params[q]->requires_grad) continue;
        for (int i = 0; i < nm; i++)
            for (int j = 0; j < mods[i]->nparams; j++) {
                if (mods[i]->params[j] != s->params[q]) continue;
                int a = home[q] < 0 ? i : home[q], b = i;
                while (depth[a] > depth[b]) a = par[a];
                while (depth[b] > depth[a]) b = par[b];
                while (a != b) a = par[a], b = par[b];
                home[q] = a;
            }
        while (home[q] >= 0 && !mark[home[q]]) home[q] = par[home[q]];
        if (home[q] >= 0) cnt[home[q]] = -1; /* a unit that holds something */
    }
    /* units: marked modules that hold parameters, in pre-order */
    for (int i = 0; i < nm; i++) {
        unit_of[i] = -1;
        if (mark[i] && cnt[i] < 0) f->nu++;
    }
    if (!(f->u = ct_alloc_zeroed(sizeof *f->u * (size_t)(f->nu + 1), CT_MEM_OTHER))) {
        f->nu = 0;
        st = CT_ENOMEM;
        goto out;
    }
    for (int i = 0, k = 0; i < nm; i++) {
        if (!(mark[i] && cnt[i] < 0)) continue;
        fsdp_unit *u = &f->u[k];
        u->m = mods[i];
        u->ignored = mark[i] == 2;
        u->is_root = i == 0;
        u->parent = -1;
        for (int a = par[i]; a >= 0 && u->parent < 0; a = par[a]) u->parent = unit_of[a];
        unit_of[i] = k++;
    }
    /* flats: f32 parameters, then (mixed precision) those with compute copies */
    for (int pass = 0; pass < 2 && st == CT_OK; pass++)
        for (int q = 0; q < s->nparams && st == CT_OK; q++) {
            if (home[q] < 0) continue;
            ct_param *p = s->params[q];
            int low = s->common.param_dtype != CT_F32 && ct_param_takes_bf16_copy(p);
            fsdp_unit *u = &f->u[unit_of[home[q]]];
            int k = 0;
            while (k < u->nfl && u->fl[k].low != low) k++;
            fsdp_flat *fl = &u->fl[k];
            if (k == u->nfl) {
                u->nfl++;
                fl->low = low;
            }
            if (pass == 0) {
                fl->flat.n++;
                continue;
            }
            if (!fl->flat.p) { /* the list first; ct__flat_init lays it out below */
                fl->flat.p = ct_alloc(sizeof *fl->flat.p * (size_t)fl->flat.n, CT_MEM_OTHER);
                fl->flat.n = 0; /* counts the entries filled from here */
                if (!fl->flat.p) {
                    st = CT_ENOMEM;
                    break;
                }
            }
            fl->flat.p[fl->flat.n++] = p;
        }
    /* one shard until the caller knows the shard groups (ct__flat_shard) */
    for (int i = 0; st == CT_OK && i < f->nu; i++)
        for (int k = 0; st == CT_OK && k < f->u[i].nfl; k++) {
            fsdp_flat *fl = &f->u[i].fl[k];
            ct_param **list = fl->flat.p;
            int n = fl->flat.n;
            fl->flat.p = NULL;
            st = ct__flat_init(&fl->flat, list, n, 1, 0, fl->low);
            ct_free(list);
        }
out:
    ct_free(mods);
    ct_free(par);
    ct_free(mark);
    ct_free(ign);
    ct_free(depth);
    ct_free(unit_of);
    ct_free(home);
    ct_free(cnt);
    return st;
}

ct_status ct_fsdp_plan(ct_module *model, const char *opts, ct_fsdp_unit *units, int max, int *n)
{
    *n = 0;
    ct_strategy *s = ct_alloc_zeroed(sizeof *s, CT_MEM_OTHER); /* options and parameters only */
    if (!s) return CT_ENOMEM;
    s->ops = &ct__fsdp_ops;
    s->model = model;
    fsdp_t f;
    memset(&f, 0, sizeof f);
    ct_status st = ct__opts_parse(s, opts);
    if (st == CT_OK) st = ct_module_params(model, &s->params, &s->nparams);
    if (st == CT_OK) st = ct__fsdp_build_units(s, &f);
    for (int i = 0; st == CT_OK && i < f.nu && i < max; i++) {
        ct_fsdp_unit *u = &units[i];
        memset(u, 0, sizeof *u);
        u->is_root = f.u[i].is_root;
        u->replicated = f.u[i].ignored;
        for (int k = 0; k < f.u[i].nfl; k++) *(f.u[i].fl[k].low ? &u->low : &u->numel) = f.u[i].fl[k].flat.numel;
    }
    if (st == CT_OK) *n = f.nu;
    ct__fsdp_free_units(&f);
    ct__opts_free(s);
    ct_free(s->params);
    ct_free(s);
    return st;
}

/*
 * One configuration across ranks, for the program's commands: every
 * option of a command's table is compared over the world before any work
 * (ct_group_agree_settings), by its parsed value, so "--lr 0.1" and
 * "--lr=1e-1" agree and a flag left at its default agrees with one given
 * its default.  A new option joins the comparison by being in the table;
 * the few that may differ per rank (thread counts, per-rank output files)
 * are named in the command's per-rank list.
 */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static int listed(const char *name, const char *const *list)
{
    for (; list && *list; list++)
        if (!strcmp(name, *list)) return 1;
    return 0;
}

/* The shortest text that reads back as x ("0.1", not "0.10000000000000001"). */
static void shortest(double x, char *buf, size_t n)
{
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, n, "%.*g", p, x);
        if (strtod(buf, NULL) == x) return;
    }
}

ct_status cli_agree_options(ct_group *g, const char *what, const cli_opt *opts, int n, const char *const *per_rank)
{
    enum { VAL = 48 };
    const char **keys = ct_alloc(sizeof *keys * (size_t)(n + 1), CT_MEM_OTHER);
    const char **vals = ct_alloc(sizeof *vals * (size_t)(n + 1), CT_MEM_OTHER);
    char *nums = ct_alloc((size_t)VAL * (size_t)(n + 1), CT_MEM_OTHER);
    int k = 0;
    for (int i = 0; keys && vals && nums && i < n; i++) {
        const cli_opt *o = &opts[i];
        if (listed(o->name, per_rank)) continue;
        char *num = nums + (size_t)VAL * (size_t)k;
        keys[k] = o->name;
        /* Whether it was given counts too: on --resume a setting not given is the checkpoint's, and
         * some defaults depend on other flags (--lr on --optim). */
        vals[k] = num;
        if (!o->given && o->type != OPT_FLAG) snprintf(num, VAL, "(not given)");
        else if (o->type == OPT_FLAG) snprintf(num, VAL, "%s", *(const int *)o->dest ? "given" : "(not given)");
        else if (o->type == OPT_INT) snprintf(num, VAL, "%lld", (long long)*(const int64_t *)o->dest);
        else if (o->type == OPT_NUM) shortest(*(const double *)o->dest, num, VAL);
        else vals[k] = *(const char *const *)o->dest;
        k++;
    }
    /* Every rank reaches the agreement, even one whose allocation failed. */
    ct_status st = keys && vals && nums ? ct_group_agree_settings(g, what, keys, vals, k)
                                        : ct_group_agree_settings(g, what, NULL, NULL, 0);
    if (!(keys && vals && nums) && st == CT_OK) st = CT_ENOMEM;
    ct_free(keys);
    ct_free(vals);
    ct_free(nums);
    return st;
}

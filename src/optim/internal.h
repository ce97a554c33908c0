/* Private to src/optim: what optim.c and groups.c share. */
#ifndef CTRAIN_OPTIM_INTERNAL_H
#define CTRAIN_OPTIM_INTERNAL_H

#include "ctrain/optim.h"

/* CT_OK, or CT_EINVAL naming the group and the bad value, a NULL name, or a
 * parameter named twice (in one group or two). */
ct_status ct__optim_groups_check(const ct_optim_opts *o);
/* A deep copy of n groups (names included) appended after the n0 groups of
 * *tab (which it frees, moving them): one allocation per table, so the
 * copy's lifetime is the optimizer's.  CT_ENOMEM leaves *tab as it was. */
ct_status ct__optim_groups_append(ct_optim_group **tab, int n0, const ct_optim_group *add, int n);
/* o's hyper-parameters with group's values (-1: the defaults), no groups. */
ct_optim_opts ct__optim_group_opts(const ct_optim_opts *o, int group);
/* Frees a table made by ct__optim_groups_append; NULL is a no-op. */
void ct__optim_groups_free(ct_optim_group *tab, int n);

#endif

/* Private to src: what a pipeline needs of the skip modules (skip.c) to
 * send a stashed tensor, and its gradient, between stages.  A stash here is
 * a stash module; its entries are keyed by a call's ctx.sample0. */
#ifndef CTRAIN_NN_SKIP_H
#define CTRAIN_NN_SKIP_H

#include "ctrain/nn.h"

/* The stash named name under root, or NULL. */
ct_module *ct__skip_find_stash(ct_module *root, const char *name);
/* Pop (any other module: no-op) takes its value from stash when its own
 * tree has none (the stash lives in another stage). */
void ct__skip_bind(ct_module *pop, ct_module *stash);
/* The input shape the stash's last shape inference saw, into shape; its ndim. */
int ct__skip_shape(const ct_module *stash, int64_t *shape);
/* Keeps x (retained) for the rows keyed key, as the stash's forward would. */
ct_status ct__skip_put(ct_module *stash, int64_t key, ct_tensor *x);
/* The kept value (grad 0) or the pops' gradient for it (grad 1), borrowed; NULL if none. */
ct_tensor *ct__skip_value(ct_module *stash, int64_t key, int grad);
/* Sets the gradient of the value kept for key (retains g). */
ct_status ct__skip_set_grad(ct_module *stash, int64_t key, ct_tensor *g);
/* Drops what is kept for key; every key. */
void ct__skip_drop(ct_module *stash, int64_t key);
void ct__skip_clear(ct_module *stash);

#endif

/* Private to src/parallel: the strategy object and the vtable each strategy fills. */
#ifndef CTRAIN_PARALLEL_INTERNAL_H
#define CTRAIN_PARALLEL_INTERNAL_H

#include "ctrain/parallel.h"

typedef struct {
    const char *kind;
    /* Sets up s->priv; collective for distributed strategies. */
    ct_status (*init)(ct_strategy *s);
    void (*fini)(ct_strategy *s);
    /* Before the model's forward / backward, and after backward (sync). */
    ct_status (*pre_forward)(ct_strategy *s);
    ct_status (*pre_backward)(ct_strategy *s);
    ct_status (*post_backward)(ct_strategy *s);
    /* Factor applied to the loss gradient before backward (NULL: 1). */
    float (*grad_scale)(ct_strategy *s);
} ct__strategy_ops;

struct ct_strategy {
    const ct__strategy_ops *ops;
    ct_module *model;
    ct_optim *opt;
    ct_group *g;
    ct_strategy_opts o;
    int no_sync;
    ct_param **params; /* every parameter, model order */
    int nparams;
    ct_param **buffers;
    int nbuffers;
    ct_step_stats stats;   /* being measured */
    ct_step_stats last;    /* last completed step */
    void *priv;
};

extern const ct__strategy_ops ct__ddp_ops;

#endif

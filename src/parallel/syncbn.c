/*
 * SyncBatchNorm for the strategies whose ranks share each batch (ddp,
 * zero1, zero2, fsdp): the strategy gives every batchnorm of its model a
 * function that sums the layer's statistics over the group, so the layer
 * (which knows nothing of ranks) normalises over the whole batch.  A rank
 * that has joined (ct_strategy_set_joined: uneven inputs) runs a shadow
 * batch and adds nothing to the sums.
 */
#include <string.h>

#include "internal.h"

static ct_status sum_over_group(float *v, int64_t n, void *ud)
{
    ct_strategy *s = ud;
    if (s->joined) memset(v, 0, sizeof *v * (size_t)n);
    return ct_group_allreduce(s->g, v, n, CT_F32, CT_OP_SUM, NULL);
}

ct_status ct__syncbn_init(ct_strategy *s)
{
    if (!s->common.sync_batchnorm || s->ops->runs_alone) return CT_OK; /* alone: its batch is the batch */
    if (!s->ops->replicas_share_batch)
        return ct_error(CT_EINVAL, "sync_batchnorm=1 applies to ddp, zero1, zero2 and fsdp, whose ranks share each "
                        "batch; %s's ranks hold different layers (pipe: deferred_batch_norm=1 gives one update per "
                        "step)", s->ops->kind);
    int n;
    CT_TRY(ct_module_set_stats_sync(s->model, sum_over_group, s, &n));
    if (!n) ct_log(CT_LOG_WARN, "sync_batchnorm=1: the model has no batchnorm; nothing to synchronise");
    return CT_OK;
}

void ct__syncbn_fini(ct_strategy *s)
{
    if (s->common.sync_batchnorm && s->ops->replicas_share_batch && s->model)
        (void)ct_module_set_stats_sync(s->model, NULL, NULL, NULL);
}

/*
 * buffer_dtype (PyTorch 1.13 MixedPrecision's): buffers, the batchnorm
 * running statistics, held at bf16 precision.  A hook before and after
 * every forward of a module with buffers rounds them to bf16 (round to
 * nearest even): before, so values loaded or broadcast in f32 are used as
 * bf16 ones; after, so each update of the statistics lands on a bf16 value,
 * as PyTorch's in-place update of a bf16 buffer rounds it.  The words stay
 * f32 (a layer's statistics are two floats a channel: halving them saves
 * nothing worth a second path through the layers), and checkpoints carry
 * them as f32, as PyTorch 1.13's full state dict casts buffers back.
 * num_batches_tracked is an integer in PyTorch and is never cast.
 */
#include <string.h>

#include "internal.h"

static ct_status round_buffers(ct_module *m, ct_hook_kind kind, void *ud)
{
    (void)kind, (void)ud;
    for (int j = 0; j < m->nbuffers; j++) {
        ct_param *b = m->buffers[j];
        if (b->data->dtype != CT_F32 || !ct_tensor_data(b->data) || !strcmp(b->local, "num_batches_tracked"))
            continue;
        float *v = ct_f32(b->data);
        for (int64_t i = 0; i < b->data->numel; i++) v[i] = ct_bf16_to_f32(ct_f32_to_bf16(v[i]));
    }
    return CT_OK;
}

ct_status ct__buffers_init(ct_strategy *s)
{
    if (s->common.buffer_dtype == CT_F32) return CT_OK;
    if (!s->ops->replicas_share_batch && !s->ops->runs_alone)
        return ct_error(CT_EINVAL, "buffer_dtype=bf16 applies to none, ddp, zero1, zero2 and fsdp, whose ranks run "
                        "the whole model; %s's ranks hold parts of it: leave buffer_dtype out", s->ops->kind);
    ct_module **mods;
    int nm, n = 0;
    CT_TRY(ct_module_modules(s->model, &mods, &nm));
    for (int i = 0; i < nm; i++) n += mods[i]->nbuffers > 0;
    s->buf_hooks = ct_alloc_zeroed(sizeof *s->buf_hooks * (size_t)(2 * n + 1), CT_MEM_OTHER);
    ct_status st = s->buf_hooks ? CT_OK : CT_ENOMEM;
    for (int i = 0; st == CT_OK && i < nm; i++) {
        if (!mods[i]->nbuffers) continue;
        for (int k = 0; k < 2 && st == CT_OK; k++) {
            ct_hook *h = ct_module_add_hook(mods[i], k ? CT_HOOK_POST_FORWARD : CT_HOOK_PRE_FORWARD, round_buffers, s);
            if (!h) st = CT_ENOMEM;
            else s->buf_hooks[s->nbuf_hooks++] = h;
        }
        if (st == CT_OK) st = round_buffers(mods[i], CT_HOOK_PRE_FORWARD, s);
    }
    ct_free(mods);
    if (!n && st == CT_OK) ct_log(CT_LOG_WARN, "buffer_dtype=bf16: the model has no buffers; nothing to cast");
    return st; /* on failure ct_strategy_destroy removes the hooks made */
}

void ct__buffers_fini(ct_strategy *s)
{
    for (int i = 0; i < s->nbuf_hooks; i++) ct_hook_remove(s->buf_hooks[i]);
    ct_free(s->buf_hooks);
    s->buf_hooks = NULL;
    s->nbuf_hooks = 0;
}

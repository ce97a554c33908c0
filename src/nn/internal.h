/*
 * What the layers of src/nn share privately: the bf16 compute path.  A layer
 * computes its products in bf16 (oneDNN, f32 accumulation) when its weight
 * has a bf16 compute copy (ct_param.compute) or its input is bf16; the
 * decision is made by what the layer is given, so src/nn holds no policy.
 */
#ifndef CTRAIN_NN_INTERNAL_H
#define CTRAIN_NN_INTERNAL_H

#include "ctrain/nn.h"

/* Name of m for messages ("(root)" for an unnamed root). */
static inline const char *ct__nn_name(const ct_module *m)
{
    return m->fqn && *m->fqn ? m->fqn : "(root)";
}

/* Checks p's compute copy: NULL or a BF16 tensor of data's shape with
 * memory.  *bf16 = 1 when there is one.  The error names the layer and says
 * how to make the copy. */
ct_status ct__param_compute(const ct_module *m, const ct_param *p, int *bf16);

/* p's weight as bf16 bits: its compute copy, or else a cast of p->data
 * into a new block stored in *tmp (ct_free it; NULL when not needed). */
ct_status ct__param_bf16(const ct_param *p, const uint16_t **w, uint16_t **tmp);

/* t as a BF16 tensor: t itself retained when it is BF16, else a new cast of
 * its F32 data (CT_MEM_ACT). */
ct_tensor *ct__tensor_bf16(ct_tensor *t);

#endif

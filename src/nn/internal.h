/*
 * What the layers of src/nn share privately: the bf16 compute path.  A layer
 * computes its products in bf16 (oneDNN, f32 accumulation) when its weight
 * has a bf16 compute copy (ct_param.compute) or its input is bf16; the
 * decision is made by what the layer is given, so src/nn holds no policy.
 * And a shape-only tensor header for the out_shape ops.
 */
#ifndef CTRAIN_NN_INTERNAL_H
#define CTRAIN_NN_INTERNAL_H

#include <string.h>

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

/* A tensor header of this shape with no storage (dtype F32), so an out_shape
 * op can run the checks and messages (ct_shape_str) its forward uses on a
 * shape alone.  Its data must never be read: ct_tensor_data would fail. */
static inline ct_tensor ct__shape_header(int ndim, const int64_t *shape)
{
    ct_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = CT_F32;
    t.ndim = ndim;
    t.numel = 1;
    for (int i = 0; i < ndim; i++) {
        t.shape[i] = shape[i];
        t.numel *= shape[i];
    }
    return t;
}

#endif

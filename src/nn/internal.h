/* Private to src/nn: helpers the layer files share. */
#ifndef CTRAIN_NN_INTERNAL_H
#define CTRAIN_NN_INTERNAL_H

#include <string.h>

#include "ctrain/nn.h"

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

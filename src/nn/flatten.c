/*
 * Flatten: [N, ...] -> [N, prod(...)], as nn.Flatten() with its defaults.
 * Output and input gradient are views sharing their argument's data (no
 * copy); the record keeps only the input's shape, not the input itself, so
 * flatten never holds an activation alive.
 */
#include "internal.h"

typedef struct {
    int ndim;
    int64_t shape[CT_MAX_DIMS];
} flat_shape;

static const char *nm(const ct_module *m) { return m->fqn && *m->fqn ? m->fqn : "(root)"; }

static ct_status flat_forward(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec,
                              const ct_fwd_ctx *ctx)
{
    (void)ctx;
    if (in->ndim < 1)
        return ct_error(CT_EINVAL, "flatten '%s': input is a scalar; it needs a batch dim", nm(m));
    int64_t n = in->shape[0], rest = n ? in->numel / n : 1;
    if (n == 0)
        for (int i = 1; i < in->ndim; i++) rest *= in->shape[i];
    flat_shape *fs = NULL;
    if (rec) {
        if (!(fs = ct_alloc_zeroed(sizeof *fs, CT_MEM_OTHER))) return CT_ENOMEM;
        fs->ndim = in->ndim;
        for (int i = 0; i < in->ndim; i++) fs->shape[i] = in->shape[i];
    }
    ct_tensor *y = ct_tensor_reshape(in, 2, (int64_t[]){n, rest});
    if (!y) {
        ct_free(fs);
        return CT_ENOMEM;
    }
    if (rec) rec->extra = fs;
    *out = y;
    return CT_OK;
}

static ct_status flat_backward(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    const flat_shape *fs = rec->extra;
    int64_t numel = 1;
    for (int i = 0; i < fs->ndim; i++) numel *= fs->shape[i];
    if (dout->numel != numel) {
        char a[64];
        return ct_error(CT_EINVAL, "flatten '%s': output gradient %s has %lld elements, the output "
                        "had %lld", nm(m), ct_shape_str(dout, a, sizeof a), (long long)dout->numel,
                        (long long)numel);
    }
    if (!din) return CT_OK;
    ct_tensor *dx = ct_tensor_reshape(dout, fs->ndim, fs->shape);
    if (!dx) return CT_ENOMEM;
    *din = dx;
    return CT_OK;
}

static ct_status flat_out_shape(ct_module *m, int ndim, const int64_t *in_shape, int *out_ndim,
                                int64_t *out_shape)
{
    if (ndim < 1)
        return ct_error(CT_EINVAL, "flatten '%s': input is a scalar; it needs a batch dim", nm(m));
    int64_t rest = 1;
    for (int i = 1; i < ndim; i++) rest *= in_shape[i];
    out_shape[0] = in_shape[0];
    out_shape[1] = rest;
    *out_ndim = 2;
    return CT_OK;
}

/* A view both ways: nothing new. */
static ct_status flat_act_cost(ct_module *m, int nd, const int64_t *sh, int mixed, int need_dx, ct_act_cost *c)
{
    (void)m, (void)nd, (void)sh, (void)mixed, (void)need_dx;
    c->alias = 1;
    return CT_OK;
}

static const ct_module_ops flat_ops = {"flatten", flat_forward, flat_backward, NULL, 0, flat_out_shape,
                                       flat_act_cost, 0};

ct_module *ct_flatten_create(void) { return ct_module_create(&flat_ops, NULL); }

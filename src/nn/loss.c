/*
 * Softmax cross-entropy and accuracy counting.  Logits are [..., C] (rows =
 * everything before the last dim) and targets hold one i32/i64 class per
 * row, so [N, C] batches and [B, T, V] sequences both work.  The log-softmax
 * subtracts each row's max first, so large logits do not overflow.
 *
 * When every target is ignore_index the mean is over zero rows: PyTorch
 * gives nan there; ctrain gives loss 0 and a zero gradient, so a batch of
 * padding contributes nothing instead of poisoning the run.
 */
#include <math.h>

#include "ctrain/nn.h"

static inline int64_t target_at(const ct_tensor *t, int64_t i)
{
    return t->dtype == CT_I64 ? ((const int64_t *)ct_tensor_data(t))[i] : ((const int32_t *)ct_tensor_data(t))[i];
}

static ct_status check(const ct_tensor *logits, const ct_tensor *targets, int64_t ignore_index,
                       int64_t *rows, int64_t *C)
{
    char a[64], b[64];
    if (logits->dtype != CT_F32 || logits->ndim < 1 || logits->shape[logits->ndim - 1] < 1)
        return ct_error(CT_EINVAL, "cross-entropy: logits %s %s must be F32 [N, C] with C >= 1",
                        ct_dtype_name(logits->dtype), ct_shape_str(logits, a, sizeof a));
    if (targets->dtype != CT_I32 && targets->dtype != CT_I64)
        return ct_error(CT_EINVAL, "cross-entropy: targets are %s; class indices must be I32 or I64",
                        ct_dtype_name(targets->dtype));
    *C = logits->shape[logits->ndim - 1];
    *rows = logits->numel / *C;
    if (targets->numel != *rows)
        return ct_error(CT_EINVAL, "cross-entropy: %lld targets %s for %lld rows of logits %s; "
                        "each row needs one target", (long long)targets->numel,
                        ct_shape_str(targets, b, sizeof b), (long long)*rows,
                        ct_shape_str(logits, a, sizeof a));
    for (int64_t r = 0; r < *rows; r++) {
        int64_t t = target_at(targets, r);
        if (t != ignore_index && (t < 0 || t >= *C))
            return ct_error(CT_EINVAL, "cross-entropy: target %lld at row %lld is outside [0, %lld) "
                            "and is not ignore_index %lld; check the labels and the class count",
                            (long long)t, (long long)r, (long long)*C, (long long)ignore_index);
    }
    return CT_OK;
}

ct_status ct_cross_entropy(const ct_tensor *logits, const ct_tensor *targets, int64_t ignore_index,
                           float *loss, ct_tensor **dlogits)
{
    int64_t rows, C;
    if (dlogits) *dlogits = NULL;
    CT_TRY(check(logits, targets, ignore_index, &rows, &C));
    ct_tensor *d = NULL;
    if (dlogits && !(d = ct_tensor_create(CT_F32, logits->ndim, logits->shape, CT_MEM_ACT)))
        return CT_ENOMEM;
    int64_t count = 0;
    for (int64_t r = 0; r < rows; r++) count += target_at(targets, r) != ignore_index;
    const float *z = ct_f32(logits);
    double total = 0.0, inv = count ? 1.0 / (double)count : 0.0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target_at(targets, r);
        if (t == ignore_index) continue; /* its gradient row stays zero */
        const float *zr = z + r * C;
        float mx = zr[0];
        for (int64_t j = 1; j < C; j++) mx = zr[j] > mx ? zr[j] : mx;
        /* One float exp per element (kept in the gradient row for the
         * softmax), summed in double: a double exp per element twice made
         * this a visible part of a training step. */
        float *dr = d ? ct_f32(d) + r * C : NULL;
        double se = 0.0;
        if (dr) {
            for (int64_t j = 0; j < C; j++) {
                dr[j] = expf(zr[j] - mx);
                se += dr[j];
            }
        } else {
            for (int64_t j = 0; j < C; j++) se += expf(zr[j] - mx);
        }
        total += log(se) - (double)(zr[t] - mx);
        if (dr) {
            float scale = (float)(inv / se);
            for (int64_t j = 0; j < C; j++) dr[j] *= scale;
            dr[t] -= (float)inv;
        }
    }
    *loss = (float)(total * inv);
    if (dlogits) *dlogits = d;
    return CT_OK;
}

int64_t ct_count_correct(const ct_tensor *logits, const ct_tensor *targets, int64_t ignore_index)
{
    int64_t rows, C;
    if (check(logits, targets, ignore_index, &rows, &C) != CT_OK) return -1; /* error set */
    const float *z = ct_f32(logits);
    int64_t correct = 0;
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = target_at(targets, r);
        if (t == ignore_index) continue;
        const float *zr = z + r * C;
        int64_t best = 0; /* first maximum wins ties, as torch.argmax */
        for (int64_t j = 1; j < C; j++)
            if (zr[j] > zr[best]) best = j;
        correct += best == t;
    }
    return correct;
}

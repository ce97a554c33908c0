/*
 * Evaluation on a test set: inference (no activation records), each rank a
 * contiguous share of the samples, loss and counts summed over ranks so
 * that every rank ends with the whole set's numbers.  Through a strategy
 * (ct_strategy_predict), the shares are its data slices: the ranks of a
 * pipeline share one, and only the rank holding the output counts it.
 */
#include <string.h>

#include "cli.h"

/* Argmax of each row of logits [n, C] (first maximum on ties), counted into
 * correct and the confusion matrix. */
static void tally(const ct_tensor *logits, const ct_tensor *y, int64_t classes, int64_t *correct,
                  int64_t *confusion)
{
    int64_t n = logits->shape[0], C = logits->shape[1];
    const float *z = ct_f32(logits);
    const int32_t *t = ct_tensor_data(y);
    for (int64_t i = 0; i < n; i++) {
        int64_t best = 0;
        for (int64_t c = 1; c < C; c++)
            if (z[i * C + c] > z[i * C + best]) best = c;
        *correct += best == t[i];
        if (confusion && t[i] < classes && best < classes) confusion[t[i] * classes + best]++;
    }
}

ct_status cli_evaluate(ct_strategy *s, ct_module *model, const ct_model_config *cfg, const ct_dataset *ds,
                       int64_t batch, ct_group *g, cli_eval *out, int64_t *confusion)
{
    memset(out, 0, sizeof *out);
    int rank = ct_group_rank(g), size = ct_group_size(g);
    if (s) ct_strategy_data_rank(s, &rank, &size);
    int64_t q = ds->n / size, rem = ds->n % size;
    int64_t lo = rank * q + (rank < rem ? rank : rem), hi = lo + q + (rank < rem);
    int64_t C = cfg->classes;
    if (confusion) memset(confusion, 0, sizeof *confusion * (size_t)(C * C));
    int64_t *idx = ct_alloc_zeroed(sizeof *idx * (size_t)(batch > 0 ? batch : 1), CT_MEM_OTHER);
    if (!idx) return CT_ENOMEM;
    ct_fwd_ctx ctx = {.training = 0, .seed = 0, .step = 0};
    double loss_sum = 0;
    int64_t correct = 0;
    ct_status st = CT_OK;
    for (int64_t b = lo; b < hi && st == CT_OK; b += batch) {
        int64_t n = hi - b < batch ? hi - b : batch;
        for (int64_t i = 0; i < n; i++) idx[i] = b + i;
        ct_tensor *x = NULL, *y = NULL, *z = NULL;
        float loss = 0;
        st = cli_batch(ds, cfg, idx, n, &x, &y);
        if (st == CT_OK) st = s ? ct_strategy_predict(s, x, &ctx, &z) : ct_module_forward(model, x, &z, NULL, &ctx);
        if (st == CT_OK && z) st = ct_cross_entropy(z, y, -100, &loss, NULL);
        if (st == CT_OK && z) {
            loss_sum += (double)loss * (double)n;
            tally(z, y, C, &correct, confusion);
        }
        ct_tensor_release(x);
        ct_tensor_release(y);
        ct_tensor_release(z);
    }
    ct_free(idx);
    /* Every rank takes part in the sums even after a local failure, so none waits forever. */
    st = ct_group_check(g, st);
    CT_TRY(st);
    double sums[2] = {loss_sum, (double)correct};
    CT_TRY(cli_sum_f64(g, sums, 2));
    if (confusion && size > 1) CT_TRY(ct_group_allreduce(g, confusion, C * C, CT_I64, CT_OP_SUM, NULL));
    out->loss = ds->n ? sums[0] / (double)ds->n : 0;
    out->correct = (int64_t)sums[1];
    out->n = ds->n;
    out->confusion = confusion;
    return CT_OK;
}

const char *cli_eval_str(const cli_eval *e, char *buf, size_t n)
{
    snprintf(buf, n, "loss %.4f  accuracy %.2f%% (%lld/%lld)", e->loss,
             e->n ? 100.0 * (double)e->correct / (double)e->n : 0.0, (long long)e->correct, (long long)e->n);
    return buf;
}

/*
 * The pipe strategy's memory plan (pipe*.c): each stage keeps its
 * children's parameters, gradients and optimizer state (sharded over its
 * replicas with dp=zero1); the largest stage sets the plan.  Activations:
 * one micro-batch through the stage replayed by ct_act_plan_run (what its
 * record keeps, the peak of its forward and backward), then the schedule:
 * a stage holds `chunks` micro-batches (GPipe) or at most P - k (1F1B,
 * receiving one more ahead), each with its received input; the
 * checkpointed ones keep only that (one at a time is recomputed), and under
 * 1F1B with except_last the last one's record lives through another's
 * backward; the last stage under GPipe keeps every micro-batch's loss
 * gradient until its backward, the others receive the next gradient ahead;
 * plus this rank's batch; comm: the most sends a run can hold (a stage's
 * micro-batches in flight and one more, each the largest message) and the
 * spare the step keeps for failed messages.
 * Skips crossing a boundary (pipe_skip.c) ride in its messages: each
 * received input and gradient is wider by their rows; the stash's stage
 * keeps its value through a checkpointed micro-batch too (the stash holds
 * it until its backward), and a skip's last stage makes its gradient and
 * its first the stash's summed input gradient, one micro-batch at a time.
 */
#include <stdlib.h>
#include <string.h>

#include "nn/skip.h"
#include "plan.h"
#include "parallel/pipe/pipe.h"

/* The parameters of the model's top-level children [lo, hi), each once:
 * what a stage keeps (a parameter tied across stages, as the gpt's
 * embedding and head, is in every stage that uses it). */
static ct_status stage_params(const ct__plan *pl, int lo, int hi, const ct_param **out, int *n)
{
    *n = 0;
    for (int c = lo; c < hi; c++) {
        ct_param **ps;
        int np;
        CT_TRY(ct_module_params(pl->model->kids[c], &ps, &np));
        for (int i = 0; i < np; i++) {
            int seen = 0;
            for (int j = 0; j < *n && !seen; j++) seen = out[j] == ps[i];
            if (!seen) out[(*n)++] = ps[i];
        }
        ct_free(ps);
    }
    return CT_OK;
}

/* The stages' layer counts: the balance option, or by parameters over the
 * stages option's count (auto: as many stages as ranks and layers allow). */
static ct_status stages(const ct__plan *pl, int *bal, int *P)
{
    char b[64];
    int n = pl->model->nkids, nb = 0;
    *P = 0;
    const char *sv = ct__plan_opt(pl, "stages", b, sizeof b);
    if (sv && strcmp(sv, "auto")) *P = atoi(sv); /* checked by ct_strategy_check_opts */
    CT_TRY(ct__plan_balance(pl, "pipe", bal, &nb));
    if (!*P) *P = nb ? nb : pl->spec->world < n ? pl->spec->world : n;
    if (*P > pl->spec->world || *P > n || (nb && nb != *P))
        return ct_error(CT_EINVAL, "pipe: %d stages do not fit %d ranks and a model of %d layers (balance %s)", *P,
                        pl->spec->world, n, nb ? ct__plan_opt(pl, "balance", b, sizeof b) : "by parameters");
    return nb ? CT_OK : ct_pipe_balance_by_params(pl->model, *P, bal);
}

/* The bytes of one micro-batch's crossing skips at stage k (after its
 * activation plan ran shape inference through stages 0..k, which leaves
 * each stash's shape): into k (in), out of k (out), stashed in k and last
 * popped in k. */
typedef struct {
    uint64_t in, out, stash, pop;
} skip_bytes;

static skip_bytes stage_skips(const ct__plan *pl, const pipe_skip *sk, int nsk, int k, int64_t mrows)
{
    skip_bytes b = {0};
    for (int i = 0; i < nsk; i++) {
        if (sk[i].a > k) continue;
        ct_module *stash = ct__skip_find_stash(pl->model, sk[i].name);
        int64_t sh[CT_MAX_DIMS];
        int nd = stash ? ct__skip_shape(stash, sh) : 0;
        uint64_t v = nd ? 4 * (uint64_t)mrows : 0; /* f32 rows of the row shape */
        for (int d = 1; d < nd; d++) v *= (uint64_t)sh[d];
        b.in += ct__pipe_skip_in(&sk[i], k) ? v : 0;
        b.out += ct__pipe_skip_out(&sk[i], k) ? v : 0;
        b.stash += sk[i].a == k ? v : 0;
        b.pop += sk[i].b == k ? v : 0;
    }
    return b;
}

ct_status ct__plan_pipe(const ct__plan *pl, ct_mem_plan *out)
{
    int n = pl->model->nkids, P = 0;
    int *bal = ct_alloc(sizeof *bal * (size_t)(n + 1), CT_MEM_OTHER);
    const ct_param **sp = ct_alloc(sizeof *sp * (size_t)(pl->nparams + 1), CT_MEM_OTHER);
    int64_t *counts = ct_alloc(sizeof *counts * (size_t)(pl->ntp + 1), CT_MEM_OTHER);
    ct_status st = bal && sp && counts ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) st = stages(pl, bal, &P);
    pipe_skip *sk = NULL;
    int nsk = 0;
    if (st == CT_OK) st = ct__pipe_skips_list(pl->model, bal, P, &sk, &nsk);
    int R = pl->spec->world / (P ? P : 1), chunks = (int)ct__plan_num(pl, "chunks", 4);
    char dv[32], sch[32], ck[32] = "except_last";
    int zero1 = ct__plan_opt(pl, "dp", dv, sizeof dv) && !strcmp(dv, "zero1");
    int gpipe = ct__plan_opt(pl, "schedule", sch, sizeof sch) && !strcmp(sch, "gpipe");
    ct__plan_opt(pl, "checkpoint", ck, sizeof ck);
    int64_t batch = pl->spec->batch, rows = batch / (R ? R : 1) + (batch % (R ? R : 1) != 0);
    int64_t mrows = (rows + chunks - 1) / chunks, mbs = (rows + mrows - 1) / mrows;
    int mixed = ct__plan_is16(pl, "param_dtype");
    for (int k = 0, lo = 0; st == CT_OK && k < P; lo += bal[k], k++) {
        int hi = lo + bal[k], ns = 0, nc = 0;
        uint64_t param = 0, grad = 0;
        st = stage_params(pl, lo, hi, sp, &ns);
        for (int i = 0; st == CT_OK && i < ns; i++) {
            const ct_param *p = sp[i];
            param += ct__plan_bytes(p) + ct__plan_copy_bytes(p, mixed);
            if (p->requires_grad) {
                grad += (uint64_t)p->data->numel * 4;
                counts[nc++] = p->data->numel;
            } else if (p->grad) {
                grad += (uint64_t)ct_tensor_bytes(p->grad);
            }
        }
        if (st != CT_OK) break;
        uint64_t optim = ct__plan_optim(pl, counts, nc);
        if (zero1 && R > 1) { /* the ZeRO partition over the stage's replicas: the largest share */
            ct_partition pt;
            st = ct_partition_init(&pt, counts, nc, R, ct__plan_num(pl, "split_params", 0) != 0);
            if (st != CT_OK) break;
            int64_t *share = ct_alloc(sizeof *share * (size_t)(pt.n + 1), CT_MEM_OTHER);
            optim = 0;
            for (int r = 0; share && r < R; r++) {
                uint64_t o = ct__plan_optim_share(pl, &pt, r, share);
                optim = o > optim ? o : optim;
            }
            st = share ? CT_OK : CT_ENOMEM;
            ct_free(share);
            ct_partition_fini(&pt);
            if (st != CT_OK) break;
        }
        ct_act_plan ap;
        st = ct__plan_stage_act(pl, lo, hi, mrows, mixed, 0, &ap);
        if (st != CT_OK) break;
        int held = gpipe ? (int)mbs : (P - k < mbs ? P - k : (int)mbs), never = !strcmp(ck, "never");
        skip_bytes sb = stage_skips(pl, sk, nsk, k, mrows);
        /* a received input: its values, its skips' and the sender's status */
        uint64_t recv = k ? ap.in_bytes + sb.in + 4 : 0;
        /* 1F1B receives the next micro-batch's input ahead; GPipe all of them at once (held) */
        uint64_t act = ap.peak + (uint64_t)(held + (!gpipe && held < mbs)) * recv +
                       (uint64_t)(held - 1) * (never ? ap.kept : sb.stash) + sb.stash + sb.pop;
        if (!never && !gpipe && !strcmp(ck, "except_last") && held > 1) act += ap.kept;
        /* the last stage's loss gradients; the others' next gradient received ahead (messages carry a status) */
        act += k + 1 == P ? (uint64_t)(held - 1) * ap.out_bytes : ap.out_bytes + sb.out + 8;
        act += ct__plan_batch_bytes(pl, rows);
        uint64_t comm = k + 1 < P ? ap.out_bytes + sb.out + 4 : 0;
        if (k && ap.in_bytes + sb.in + 4 > comm) comm = ap.in_bytes + sb.in + 4;
        /* sends stay until reaped at a later send, so a stage holds those of
         * its micro-batches in flight and one more (its peer takes them as it
         * goes, so a run often holds fewer), and the spare */
        uint64_t sends = (uint64_t)(held + 1 < mbs ? held + 1 : mbs);
        ct__plan_rank(out, param, grad, optim, act, P > 1 ? (sends + 1) * comm : 0);
    }
    ct_free(sk);
    ct_free(bal);
    ct_free(sp);
    ct_free(counts);
    return st;
}

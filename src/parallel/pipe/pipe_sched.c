/*
 * The pipeline's schedules: one training step (or one inference pass) of a
 * stage.  The batch is cut along dim 0 as torch.chunk cuts it (pieces of
 * ceil(rows / chunks), the last one smaller, so possibly fewer pieces), and
 * every rank of a pipeline runs its stage's share of
 *   GPipe:  F0 F1 ... F(m-1), then B(m-1) ... B0 (fill, drain)
 *   1F1B:   P-k-1 forwards to fill, then one forward and one backward in
 *           turn, then the remaining backwards: stage k never holds more
 *           than P-k micro-batches' activations (PipeDream-flush).
 * Activations go to the next stage and gradients to the previous one as
 * asynchronous MPI messages; the receive of the next micro-batch is posted
 * before the current one computes, so transfers overlap compute.
 *
 * Shapes.  Before the first micro-batch, stage 0 tells its pipeline the
 * batch's rows and input shape; when that shape is new, the stages agree
 * in turn on every boundary's shape by shape inference (ct_module_out_shape),
 * so a stage that cannot take its predecessor's output is an error on every
 * rank naming both stages, before anything runs.  On arrival each message's
 * size is checked against the agreed shape.
 *
 * Failures.  A message carries the sender's status after its values.  A
 * rank that fails mid-step keeps the schedule (it sends a message marked
 * failed, receives and drops) instead of leaving its peers waiting; a rank
 * that receives a failed mark skips its compute the same way.  At the end
 * the pipeline agrees (ct_group_check): every rank returns the failing
 * rank's message.  Running out of memory is such a failure, never a hang:
 * the plan of the step and a spare message buffer are allocated before
 * any message, and the pipeline agrees on that first (a stage that cannot
 * hold its plan is CT_ENOMEM on every rank, nothing run).  From then on a
 * message that cannot get a buffer is sent from the spare, marked failed,
 * and one that cannot get a receive buffer is taken into the spare when
 * its turn comes (so it never meets the next step's receive); the comm
 * engine's reserve (ct_comm_reserve_taken) serves the operations'
 * bookkeeping.  No optimizer step runs in a train step, so the model's
 * parameters are as they were.
 *
 * Checkpointing.  A checkpointed micro-batch keeps only its stage input;
 * its forward runs again right before its backward with the same context
 * (seed, step, sample0), so dropout draws the same masks: the recompute of
 * every activation checkpointing (ct_module_recompute), which leaves
 * batchnorm's running statistics alone (it is not another batch).  always:
 * every micro-batch; except_last: all but the last (whose backward comes
 * first in GPipe); never.  Checkpoint wrappers inside the stage
 * (ct_module_apply_activation_checkpointing) nest under it.  With
 * deferred_batch_norm the statistics are updated once per step from all
 * micro-batches (ct_batchnorm_commit), as if not split.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "nn/skip.h"
#include "pipe.h"

#define TAG_FWD(j) (2 * (j))
#define TAG_BWD(j) (2 * (j) + 1)

/* A transfer: count values, then the sender's status (0 ok, 1 failed). */
typedef struct {
    ct_tensor *buf;
    ct_work *w;
    int drain;       /* a receive that got no buffer: its message is taken into the spare */
    int peer, tag;
    int64_t count;
} xfer_t;

typedef struct {
    int64_t r0, n;
    ct_tensor *x;    /* the stage's input (a view of the batch, or of fin.buf) */
    ct_record *rec;  /* NULL when checkpointed */
    ct_tensor *dz;   /* last stage: the scaled loss gradient */
    xfer_t fin, bin; /* receives: forward input, backward gradient */
    int ckpt;
} mb_t;

typedef struct {
    ct_strategy *s;
    pipe_t *p;
    int m, train;
    mb_t *mb;
    const ct_batch *b;
    ct_tensor *x;         /* the whole input (predict) */
    ct_loss_fn loss;
    void *ud;
    ct_fwd_ctx ctx;
    int64_t global;
    ct_tensor *out;       /* predict, last stage: the outputs of every micro-batch */
    ct_status st;         /* this rank's own failure (its message is the step's) */
    int poisoned;         /* a peer sent a failed mark: compute is skipped, transfers go on */
    xfer_t *sends;        /* sends in flight; room for every send of the step */
    int nsends, cap;
    ct_tensor *spare;     /* a message of the largest size: failed sends and drained receives */
    ct_work *spare_w;     /* the failed send in flight from it */
    double t_fwd, t_bwd, t_wait;
    ct_step_out *res;
} run_t;

static int O_ckpt(const run_t *r) { return ((const pipe_opts *)r->s->kopts)->checkpoint; }

static int ok(const run_t *r) { return r->st == CT_OK && !r->poisoned; }

static void fail(run_t *r, ct_status st)
{
    if (r->st == CT_OK) r->st = st;
}

/* Rows [r0, r0 + n) of t, with shape sh (NULL: t's) for the rest: a view. */
static ct_tensor *rows_view(ct_tensor *t, int64_t r0, int64_t n, const pipe_shape *sh)
{
    if (!sh) return ct_tensor_rows(t, r0, n);
    int64_t shape[CT_MAX_DIMS];
    int ndim = sh->ndim;
    memcpy(shape, sh->shape, sizeof shape);
    shape[0] = n;
    return ct_tensor_view(t, r0 * sh->row_numel, ndim, shape);
}

static void shape_set(pipe_shape *sh, int ndim, const int64_t *shape)
{
    memset(sh, 0, sizeof *sh);
    sh->ndim = ndim;
    sh->row_numel = 1;
    for (int d = 0; d < ndim; d++) {
        sh->shape[d] = shape[d];
        if (d) sh->row_numel *= shape[d];
    }
}

static char *shape_str(const pipe_shape *sh, int64_t rows, char *buf, size_t n)
{
    size_t off = (size_t)snprintf(buf, n, "[%lld", (long long)rows);
    for (int d = 1; d < sh->ndim && off < n; d++) off += (size_t)snprintf(buf + off, n - off, ", %lld", (long long)sh->shape[d]);
    if (off < n) snprintf(buf + off, n - off, "]");
    return buf;
}

/* ---- transfers -------------------------------------------------------------- */

/* The spare is free once the failed send from it has gone. */
static void spare_free(run_t *r)
{
    if (!r->spare_w) return;
    ct_status st = ct_work_wait(r->spare_w);
    ct_work_destroy(r->spare_w);
    r->spare_w = NULL;
    if (st != CT_OK) fail(r, st);
}

static void post_recv(run_t *r, xfer_t *x, int peer, int tag, int64_t count)
{
    if (x->buf || x->drain) return;
    int64_t shape[1] = {count + 1};
    x->peer = peer;
    x->tag = tag;
    x->count = count;
    ct_status st = (x->buf = ct_tensor_empty(CT_F32, 1, shape, CT_MEM_ACT)) ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) st = ct_group_recv(r->p->pg, ct_tensor_data(x->buf), count + 1, CT_F32, peer, tag, &x->w);
    if (st != CT_OK) {
        fail(r, st);
        ct_tensor_release(x->buf);
        x->buf = NULL;
        x->drain = 1; /* the message comes all the same */
    }
}

/* Takes the message x could not get a buffer for into the spare (blocking),
 * so it never meets a later receive of the same tag. */
static void drain(run_t *r, xfer_t *x)
{
    if (!x->drain) return;
    x->drain = 0;
    spare_free(r);
    ct_status st = ct_group_recv(r->p->pg, ct_tensor_data(r->spare), x->count + 1, CT_F32, x->peer, x->tag, NULL);
    if (st != CT_OK) /* the message would be left for the next step to take as its own */
        ct_comm_abort("pipe: receiving a message from stage peer %d failed: %s", x->peer, ct_last_error());
}

/* Waits for x; 1 if its values may be used. */
static int wait_recv(run_t *r, xfer_t *x, int from, const char *what, int j)
{
    if (x->drain) { /* failed already: the message only has to be taken */
        drain(r, x);
        return 0;
    }
    if (!x->w) {
        if (r->st == CT_OK) fail(r, ct_error(CT_ESTATE, "pipe: the %s of micro-batch %d from stage %d was never "
                                             "received", what, j, from));
        return 0;
    }
    double t0 = ct_now();
    ct_status st = ct_work_wait(x->w);
    double t1 = ct_now();
    r->t_wait += t1 - t0;
    if (t1 - t0 > 20e-6) ct_trace_event("wait", "pipe", t0, t1, 0);
    ct_work_destroy(x->w);
    x->w = NULL;
    if (st != CT_OK) {
        fail(r, ct_error(st, "pipe: receiving the %s of micro-batch %d from stage %d failed (a message of another "
                         "size than the agreed shape?): %s", what, j, from, ct_last_error()));
        return 0;
    }
    const float *v = ct_f32(x->buf);
    if (v[x->buf->numel - 1] != 0.0f) r->poisoned = 1;
    return ok(r);
}

/* Frees the buffers of sends that completed (all of them, waiting, if all). */
static void reap_sends(run_t *r, int all)
{
    int keep = 0;
    for (int i = 0; i < r->nsends; i++) {
        xfer_t *x = &r->sends[i];
        if (all || ct_work_test(x->w)) {
            ct_status st = ct_work_wait(x->w);
            if (st != CT_OK) fail(r, st);
            ct_work_destroy(x->w);
            ct_tensor_release(x->buf);
        } else {
            r->sends[keep++] = *x;
        }
    }
    r->nsends = keep;
}

/* Tells stage peer that this message failed: the spare, marked, needs no memory. */
static void send_failed(run_t *r, int64_t count, int peer, int tag)
{
    spare_free(r);
    float *v = ct_f32(r->spare);
    v[count] = 1.0f; /* the receiver reads the mark only */
    ct_status st = ct_group_send(r->p->pg, v, count + 1, CT_F32, peer, tag, &r->spare_w);
    if (st != CT_OK) /* cannot even say that we failed: the job has to end, or the peer waits forever */
        ct_comm_abort("pipe: sending to stage %d failed: %s", peer, ct_last_error());
}

/* Sends the values of ts[0..nt) one after another, count in all (a failed
 * mark when one is NULL or this step failed), to stage peer. */
static void send_to(run_t *r, const ct_tensor *const *ts, int nt, int64_t count, int peer, int tag)
{
    reap_sends(r, 0);
    int64_t shape[1] = {count + 1}, have = 0;
    int good = ok(r);
    for (int i = 0; i < nt && good; i++)
        if (!ts[i] || ts[i]->dtype != CT_F32) good = 0;
        else have += ts[i]->numel;
    good = good && have == count;
    xfer_t x = {good ? ct_tensor_empty(CT_F32, 1, shape, CT_MEM_COMM) : NULL, NULL, 0, 0, 0, 0};
    ct_status st = !good || x.buf ? CT_OK : CT_ENOMEM;
    if (x.buf) {
        float *v = ct_f32(x.buf);
        int64_t off = 0;
        for (int i = 0; i < nt; off += ts[i]->numel, i++)
            memcpy(v + off, ct_f32(ts[i]), sizeof *v * (size_t)ts[i]->numel);
        v[count] = 0.0f;
        st = ct_group_send(r->p->pg, v, count + 1, CT_F32, peer, tag, &x.w);
    }
    if (st == CT_OK && x.buf) {
        CT_ASSERT(r->nsends < r->cap); /* room for every send of the step (run) */
        r->sends[r->nsends++] = x;
        return;
    }
    ct_tensor_release(x.buf);
    if (st != CT_OK) fail(r, st);
    send_failed(r, count, peer, tag);
}

/* ---- forward and backward of one micro-batch ------------------------------- */

static ct_fwd_ctx mb_ctx(const run_t *r, const mb_t *b)
{
    ct_fwd_ctx c = r->ctx;
    c.sample0 = (r->b ? r->b->sample0 : 0) + b->r0;
    return c;
}

/* ---- skips crossing a boundary (pipe_skip.c) ----------------------------- */

/* A message holds the activation's rows, then each live skip's rows, in
 * the order of p->skips.  Takes micro-batch b's received skip values
 * (grad 0: from the input message into this stage's proxies) or their
 * gradients (grad 1: from the gradient message into the stashes). */
static void skip_take(run_t *r, mb_t *b, int k, int grad)
{
    pipe_t *p = r->p;
    xfer_t *x = grad ? &b->bin : &b->fin;
    int64_t off = b->n * (grad ? p->out.row_numel : p->in.row_numel);
    int64_t key = mb_ctx(r, b).sample0;
    for (int i = 0; i < p->nskips && ok(r); i++) {
        pipe_skip *sk = &p->skips[i];
        if (!(grad ? ct__pipe_skip_out(sk, k) : ct__pipe_skip_in(sk, k))) continue;
        int64_t shape[CT_MAX_DIMS];
        memcpy(shape, sk->sh.shape, sizeof shape);
        shape[0] = b->n;
        ct_tensor *v = ct_tensor_view(x->buf, off, sk->sh.ndim, shape);
        ct_status st = !v ? CT_ENOMEM : grad ? ct__skip_set_grad(sk->stash, key, v) : ct__skip_put(sk->stash, key, v);
        ct_tensor_release(v);
        if (st != CT_OK) fail(r, st);
        off += b->n * sk->sh.row_numel;
    }
}

/* The live skips' values (grad 0, to send forward) or gradients (grad 1,
 * back) of micro-batch b into ts; how many.  A value missing fails the
 * step (the message goes marked); a gradient no pop made is zeros. */
static int skip_parts(run_t *r, mb_t *b, int k, int grad, const ct_tensor **ts)
{
    pipe_t *p = r->p;
    int64_t key = mb_ctx(r, b).sample0;
    int nt = 0;
    for (int i = 0; i < p->nskips; i++) {
        pipe_skip *sk = &p->skips[i];
        if (!(grad ? ct__pipe_skip_in(sk, k) : ct__pipe_skip_out(sk, k))) continue;
        ct_tensor *v = ok(r) ? ct__skip_value(sk->stash, key, grad) : NULL;
        if (!v && ok(r) && grad && (v = ct__skip_value(sk->stash, key, 0))) {
            ct_tensor *z = ct_tensor_create(CT_F32, v->ndim, v->shape, CT_MEM_ACT);
            ct_status st = z ? ct__skip_set_grad(sk->stash, key, z) : CT_ENOMEM;
            ct_tensor_release(z);
            v = st == CT_OK ? ct__skip_value(sk->stash, key, 1) : NULL;
        }
        if (!v && ok(r))
            fail(r, ct_error(CT_ESTATE, "pipe: stage %d has no %s of skip '%s' for micro-batch rows %lld..", k,
                             grad ? "gradient" : "value", sk->name, (long long)key));
        if (v && v->numel != b->n * sk->sh.row_numel && ok(r))
            fail(r, ct_error(CT_EINVAL, "pipe: skip '%s' has %lld values for %lld rows, not the %lld per row shape "
                             "inference gave", sk->name, (long long)v->numel, (long long)b->n,
                             (long long)sk->sh.row_numel));
        ts[nt++] = v;
    }
    return nt;
}

/* Micro-batch b is done on this stage: the proxies let its values go. */
static void skip_done(run_t *r, mb_t *b, int k)
{
    pipe_t *p = r->p;
    int64_t key = mb_ctx(r, b).sample0;
    for (int i = 0; i < p->nskips; i++)
        if (p->skips[i].own && ct__pipe_skip_in(&p->skips[i], k)) ct__skip_drop(p->skips[i].stash, key);
}

static void forward(run_t *r, int j)
{
    pipe_t *p = r->p;
    mb_t *b = &r->mb[j];
    int k = p->stage, last = k == p->nstages - 1;
    int64_t n = b->n;
    int have = 1;
    reap_sends(r, 0); /* sends done since the last operation give their copies back */
    if (k > 0) {
        have = wait_recv(r, &b->fin, k - 1, "activations", j);
        if (j + 1 < r->m) post_recv(r, &r->mb[j + 1].fin, k - 1, TAG_FWD(j + 1), r->mb[j + 1].n * p->in_wide);
    }
    ct_tensor *y = NULL;
    if (have && ok(r)) {
        ct_tensor *src = k == 0 ? (r->b ? r->b->x : r->x) : b->fin.buf;
        b->x = rows_view(src, k == 0 ? b->r0 : 0, n, k == 0 ? NULL : &p->in);
        if (k > 0 && b->x) skip_take(r, b, k, 0);
        b->ckpt = r->train && (O_ckpt(r) == PIPE_CKPT_ALWAYS || (O_ckpt(r) == PIPE_CKPT_EXCEPT_LAST && j < r->m - 1));
        ct_fwd_ctx c = mb_ctx(r, b);
        double t0 = ct_now();
        ct_status st = b->x ? ct_module_forward(r->s->model, b->x, &y, r->train && !b->ckpt ? &b->rec : NULL, &c)
                            : CT_ENOMEM;
        double t1 = ct_now();
        r->t_fwd += t1 - t0;
        ct_trace_event(r->train ? (b->ckpt ? "forward (checkpointed)" : "forward") : "forward (inference)", "pipe",
                       t0, t1, 0);
        if (st == CT_OK && (y->dtype != CT_F32 || y->numel != n * p->out.row_numel)) {
            char want[96];
            st = ct_error(CT_EINVAL, "pipe: stage %d's output is %s with %lld values, not the F32 %s agreed by "
                          "shape inference", k, ct_dtype_name(y->dtype), (long long)y->numel,
                          shape_str(&p->out, n, want, sizeof want));
        }
        if (st != CT_OK) fail(r, st);
    }
    if (!last) {
        const ct_tensor *ts[1 + CT_PIPE_MAX_SKIPS] = {y};
        int nt = 1 + skip_parts(r, b, k, 0, ts + 1);
        send_to(r, ts, nt, n * p->out_wide, k + 1, TAG_FWD(j));
    } else if (ok(r) && r->train) {
        ct_tensor *t = rows_view(r->b->y, b->r0, n, NULL);
        float l = 0;
        ct_status st = t ? r->loss(y, t, r->ud, &l, &b->dz) : CT_ENOMEM;
        ct_tensor_release(t);
        if (st == CT_OK && b->dz->dtype != CT_F32)
            st = ct_error(CT_EINVAL, "pipe: the loss gradient is %s; it must be F32", ct_dtype_name(b->dz->dtype));
        if (st == CT_OK) {
            /* d(global mean)/d(micro-batch mean) = n / global; replicas' reductions sum. */
            float scale = (float)((double)n / (double)r->global), *g = ct_f32(b->dz);
            for (int64_t i = 0; i < b->dz->numel; i++) g[i] *= scale;
            r->res->loss_sum += (double)l * (double)n;
            r->res->rows += n;
        } else {
            fail(r, st);
        }
    } else if (ok(r)) {
        memcpy((float *)ct_f32(r->out) + b->r0 * p->out.row_numel, ct_f32(y), sizeof(float) * (size_t)y->numel);
    }
    ct_tensor_release(y);
    if (!r->train) skip_done(r, b, k);
    if (!r->train) {
        ct_tensor_release(b->x);
        ct_tensor_release(b->fin.buf);
        b->x = b->fin.buf = NULL;
    }
}

static void backward(run_t *r, int j, int final, int next)
{
    pipe_t *p = r->p;
    mb_t *b = &r->mb[j];
    int k = p->stage, last = k == p->nstages - 1;
    ct_tensor *dout = NULL, *din = NULL;
    reap_sends(r, 0);
    if (!last) {
        int have = wait_recv(r, &b->bin, k + 1, "gradients", j);
        if (next >= 0) post_recv(r, &r->mb[next].bin, k + 1, TAG_BWD(next), r->mb[next].n * p->out_wide);
        if (have && !(dout = rows_view(b->bin.buf, 0, b->n, &p->out))) fail(r, CT_ENOMEM);
        if (have && dout) skip_take(r, b, k, 1);
    } else if (b->dz) {
        dout = ct_tensor_retain(b->dz);
    }
    if (ok(r) && dout) {
        double t0 = ct_now();
        ct_status st = CT_OK;
        if (b->ckpt) {
            ct_fwd_ctx c = mb_ctx(r, b);
            st = ct_module_recompute(r->s->model, b->x, NULL, &b->rec, &c);
            double t1 = ct_now();
            r->t_bwd += t1 - t0;
            ct_trace_event("recompute", "pipe", t0, t1, 0);
            t0 = t1;
        }
        ct_strategy *in = p->inner;
        in->no_sync = !final; /* the replicas reduce once, after the last micro-batch */
        if (st == CT_OK) st = ct_strategy_backward_ex(in, dout, b->rec, 1.0f, k > 0 ? &din : NULL);
        else ct_record_destroy(b->rec);
        b->rec = NULL;
        in->no_sync = 0;
        ct_trace_event("backward", "pipe", t0, ct_now(), 0);
        if (st != CT_OK) fail(r, st);
    }
    if (k > 0) {
        const ct_tensor *ts[1 + CT_PIPE_MAX_SKIPS] = {din};
        int nt = 1 + skip_parts(r, b, k, 1, ts + 1);
        send_to(r, ts, nt, b->n * p->in_wide, k - 1, TAG_BWD(j));
        skip_done(r, b, k);
    }
    ct_tensor_release(din);
    ct_tensor_release(dout);
    ct_record_destroy(b->rec);
    ct_tensor_release(b->x);
    ct_tensor_release(b->dz);
    ct_tensor_release(b->fin.buf);
    ct_tensor_release(b->bin.buf);
    b->rec = NULL;
    b->x = b->dz = b->fin.buf = b->bin.buf = NULL;
}

/* ---- shapes ---------------------------------------------------------------- */

/* Stage 0 tells the pipeline the batch's rows and input shape; a new input
 * shape has the stages agree on every boundary by shape inference, stage by
 * stage, each failure an error on every rank naming both stages.  own is
 * this rank's input (its rows must be stage 0's). */
static ct_status agree(run_t *r, const ct_tensor *own, int64_t *nrows)
{
    pipe_t *p = r->p;
    int P = p->nstages, k = p->stage;
    int64_t hdr[2 + CT_MAX_DIMS] = {-1, 0};
    ct_status local = CT_OK;
    if (k == 0) {
        if (!own || own->ndim < 1 || own->shape[0] < 1)
            local = ct_error(CT_EINVAL, "pipe: stage 0 needs an input with at least one row");
        else {
            hdr[0] = own->shape[0];
            hdr[1] = own->ndim;
            for (int d = 1; d < own->ndim; d++) hdr[2 + d] = own->shape[d];
        }
    }
    if (P > 1) CT_TRY(ct_group_broadcast(p->pg, hdr, 2 + CT_MAX_DIMS, CT_I64, 0, NULL));
    if (local == CT_OK && hdr[0] >= 0 && (!own || own->ndim < 1 || own->shape[0] != hdr[0]))
        local = ct_error(CT_EINVAL, "pipe: stage %d was given %lld rows but stage 0 %lld; every rank of a pipeline "
                         "takes the same batch", k, (long long)(own && own->ndim ? own->shape[0] : 0),
                         (long long)hdr[0]);
    if (P > 1) CT_TRY(ct_group_check(p->pg, local));
    else CT_TRY(local);
    *nrows = hdr[0];
    pipe_shape in;
    int64_t shape[CT_MAX_DIMS] = {0};
    for (int d = 0; d < hdr[1]; d++) shape[d] = d ? hdr[2 + d] : 1;
    shape_set(&in, (int)hdr[1], shape);
    if (p->have_shapes && !memcmp(&in, &p->key, sizeof in)) return CT_OK;
    p->have_shapes = 0;
    pipe_shape cur = in;
    for (int s = 0; s < P; s++) {
        int64_t msg[1 + CT_MAX_DIMS] = {0};
        local = CT_OK;
        if (s == k) {
            int ondim = 0;
            int64_t oshape[CT_MAX_DIMS] = {0};
            char a[96];
            p->in = cur;
            local = ct_module_out_shape(r->s->model, cur.ndim, cur.shape, &ondim, oshape);
            if (local != CT_OK) {
                char why[400];
                snprintf(why, sizeof why, "%s", ct_last_error());
                if (k == 0)
                    local = ct_error(local, "pipe: stage 0 (children %d..%d) cannot take the input %s: %s", p->lo,
                                     p->hi - 1, shape_str(&cur, 1, a, sizeof a), why);
                else
                    local = ct_error(local, "pipe: stage %d (children %d..%d) cannot take the output of stage %d, "
                                     "shape %s per row: %s", k, p->lo, p->hi - 1, k - 1,
                                     shape_str(&cur, 1, a, sizeof a), why);
            }
            msg[0] = ondim;
            for (int d = 1; d < ondim; d++) msg[1 + d] = oshape[d];
        }
        if (P > 1) CT_TRY(ct_group_check(p->pg, local));
        else CT_TRY(local);
        if (P > 1) CT_TRY(ct_group_broadcast(p->pg, msg, 1 + CT_MAX_DIMS, CT_I64, s, NULL));
        for (int d = 0; d < msg[0]; d++) shape[d] = d ? msg[1 + d] : 1;
        shape_set(&cur, (int)msg[0], shape);
        if (s == k) p->out = cur;
    }
    /* each crossing skip's row shape, from its stash's stage */
    p->in_wide = p->in.row_numel;
    p->out_wide = p->out.row_numel;
    for (int i = 0; i < p->nskips; i++) {
        pipe_skip *sk = &p->skips[i];
        int64_t msg[1 + CT_MAX_DIMS] = {0};
        if (k == sk->a) msg[0] = ct__skip_shape(sk->stash, msg + 1);
        CT_TRY(ct_group_broadcast(p->pg, msg, 1 + CT_MAX_DIMS, CT_I64, sk->a, NULL));
        if (msg[0] < 1)
            return ct_error(CT_EINVAL, "pipe: skip '%s' stashed in stage %d was not reached by shape inference",
                            sk->name, sk->a);
        for (int d = 0; d < msg[0]; d++) shape[d] = d ? msg[1 + d] : 1;
        shape_set(&sk->sh, (int)msg[0], shape);
        if (ct__pipe_skip_in(sk, k)) p->in_wide += sk->sh.row_numel;
        if (ct__pipe_skip_out(sk, k)) p->out_wide += sk->sh.row_numel;
    }
    p->key = in;
    p->have_shapes = 1;
    return CT_OK;
}

/* ---- running a schedule ------------------------------------------------------- */

enum { OP_F = 0, OP_B = 1 };

/* Stage k's operations in order: (kind << 16 | micro-batch). */
static int build_ops(const run_t *r, int *ops)
{
    int m = r->m, n = 0, k = r->p->stage, P = r->p->nstages;
    int sched = ((const pipe_opts *)r->s->kopts)->schedule;
    if (!r->train) {
        for (int j = 0; j < m; j++) ops[n++] = OP_F << 16 | j;
    } else if (sched == PIPE_GPIPE) {
        for (int j = 0; j < m; j++) ops[n++] = OP_F << 16 | j;
        for (int j = m - 1; j >= 0; j--) ops[n++] = OP_B << 16 | j;
    } else {
        int warm = P - k - 1 < m ? P - k - 1 : m;
        for (int j = 0; j < warm; j++) ops[n++] = OP_F << 16 | j;
        for (int i = 0; i < m - warm; i++) {
            ops[n++] = OP_F << 16 | (warm + i);
            ops[n++] = OP_B << 16 | i;
        }
        for (int j = m - warm; j < m; j++) ops[n++] = OP_B << 16 | j;
    }
    return n;
}

/* Frees the step's plan (run allocates it before any message). */
static void free_plan(run_t *r, int *ops, int *border)
{
    ct_free(border);
    ct_free(ops);
    ct_free(r->mb);
    ct_free(r->sends);
    ct_tensor_release(r->spare);
    r->mb = NULL;
    r->sends = NULL;
    r->spare = NULL;
}

static ct_status run(run_t *r, int64_t nrows, int chunks)
{
    pipe_t *p = r->p;
    int k = p->stage, P = p->nstages;
    int64_t size = (nrows + chunks - 1) / chunks; /* torch.chunk */
    r->m = (int)((nrows + size - 1) / size);
    /* Everything the schedule needs before it talks: its plan, room for
     * every send's handle and the spare (the largest message), so that a
     * rank short of memory says so here, on every rank, before any message. */
    r->cap = (k + 1 < P ? r->m : 0) + (k > 0 && r->train ? r->m : 0);
    int64_t most = 0;
    if (k + 1 < P) most = size * p->out_wide;
    if (k > 0 && size * p->in_wide > most) most = size * p->in_wide;
    int64_t sshape[1] = {most + 1};
    r->mb = ct_alloc_zeroed(sizeof *r->mb * (size_t)r->m, CT_MEM_OTHER);
    int *ops = ct_alloc(sizeof *ops * (size_t)(2 * r->m), CT_MEM_OTHER);
    int *border = ct_alloc(sizeof *border * (size_t)(r->m + 1), CT_MEM_OTHER);
    r->sends = ct_alloc(sizeof *r->sends * (size_t)(r->cap + 1), CT_MEM_OTHER);
    r->spare = P > 1 ? ct_tensor_empty(CT_F32, 1, sshape, CT_MEM_COMM) : NULL;
    ct_status st = r->mb && ops && border && r->sends && (r->spare || P == 1) ? CT_OK : CT_ENOMEM;
    if (st != CT_OK) st = ct_error(CT_ENOMEM, "pipe: stage %d is out of memory for the plan of %d micro-batches: %s", k,
                                   r->m, ct_last_error());
    if (P > 1) st = ct_group_check(p->pg, st);
    if (st != CT_OK) {
        free_plan(r, ops, border);
        return st;
    }
    for (int j = 0; j < r->m; j++) {
        r->mb[j].r0 = (int64_t)j * size;
        r->mb[j].n = j + 1 < r->m ? size : nrows - (int64_t)j * size;
    }
    int nops = build_ops(r, ops), nb = 0, last_b = -1;
    for (int i = 0; i < nops; i++)
        if (ops[i] >> 16 == OP_B) {
            border[nb++] = ops[i] & 0xffff;
            last_b = i;
        }
    /* GPipe holds every micro-batch's input until its backward anyway: receive
     * them all as they come, so the sender's copies go at once instead of
     * waiting in its memory for a receive posted one ahead. */
    int ahead = r->train && ((const pipe_opts *)r->s->kopts)->schedule == PIPE_GPIPE ? r->m : 1;
    for (int j = 0; k > 0 && j < ahead; j++) post_recv(r, &r->mb[j].fin, k - 1, TAG_FWD(j), r->mb[j].n * p->in_wide);
    if (k < P - 1 && nb) post_recv(r, &r->mb[border[0]].bin, k + 1, TAG_BWD(border[0]), r->mb[border[0]].n * p->out_wide);
    /* The replica strategy's before-forward work (ZeRO-1: parameters refreshed; DDP: buffers broadcast). */
    if (r->train) {
        ct_status st = ct_strategy_pre_forward(p->inner);
        if (st != CT_OK) fail(r, st);
    }
    for (int i = 0, bi = 0; i < nops; i++) {
        int j = ops[i] & 0xffff;
        if (ops[i] >> 16 == OP_F) {
            forward(r, j);
        } else {
            bi++;
            backward(r, j, i == last_b, bi < nb ? border[bi] : -1);
        }
    }
    reap_sends(r, 1);
    /* Receives a failure left unwaited or undrained (it cannot happen on the schedule's own path) end here. */
    for (int j = 0; j < r->m; j++) {
        mb_t *b = &r->mb[j];
        xfer_t *xs[2] = {&b->fin, &b->bin};
        for (int q = 0; q < 2; q++) {
            if (xs[q]->w) {
                ct_work_wait(xs[q]->w);
                ct_work_destroy(xs[q]->w);
            }
            drain(r, xs[q]);
            ct_tensor_release(xs[q]->buf);
        }
        ct_record_destroy(b->rec);
        ct_tensor_release(b->x);
        ct_tensor_release(b->dz);
    }
    for (int i = 0; i < p->nskips; i++) /* what a failed step left */
        if (p->skips[i].stash) ct__skip_clear(p->skips[i].stash);
    spare_free(r);
    free_plan(r, ops, border);
    /* Every rank of the pipeline returns the first failing rank's message. */
    return P > 1 ? ct_group_check(p->pg, r->st) : r->st;
}

static void merge_stats(ct_strategy *s, run_t *r)
{
    ct_strategy *in = r->p->inner;
    s->stats.forward += r->t_fwd;
    s->stats.backward += r->t_bwd + in->stats.backward;
    s->stats.comm_wait += r->t_wait + in->stats.comm_wait;
    s->stats.comm_total += in->stats.comm_total;
    s->stats.nbuckets = in->stats.nbuckets;
    int nb = in->stats.nbuckets; /* DDP counts its buckets once, at build */
    memset(&in->stats, 0, sizeof in->stats);
    in->stats.nbuckets = nb;
}

ct_status ct__pipe_train_step(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                              const ct_fwd_ctx *ctx, ct_step_out *out)
{
    pipe_t *p = ct__pipe(s);
    if (p->stage < 0) return CT_OK; /* sitting out */
    run_t r = {.s = s, .p = p, .train = 1, .b = b, .loss = loss, .ud = ud, .ctx = *ctx, .res = out};
    int64_t nrows;
    CT_TRY(agree(&r, b->x, &nrows));
    r.global = b->global_rows ? b->global_rows : nrows * p->replicas;
    ct__pipe_ties_begin(p);
    ct_status st = run(&r, nrows, ((const pipe_opts *)s->kopts)->chunks);
    /* The tied copies' sum, after the replicas' average, before any clip or step. */
    if (st == CT_OK) st = ct__pipe_ties_sum(p);
    merge_stats(s, &r);
    /* deferred batchnorm: one update from the step's micro-batches */
    for (int i = 0; ((const pipe_opts *)s->kopts)->deferred_batch_norm && i < p->nbns; i++) {
        ct_status c = ct_batchnorm_commit(p->bns[i]);
        if (st == CT_OK) st = c;
    }
    return st;
}

ct_status ct__pipe_predict(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out)
{
    pipe_t *p = ct__pipe(s);
    *out = NULL;
    if (p->stage < 0) return CT_OK;
    run_t r = {.s = s, .p = p, .train = 0, .x = x, .ctx = *ctx};
    r.ctx.training = 0;
    int64_t nrows;
    CT_TRY(agree(&r, x, &nrows));
    if (p->stage == p->nstages - 1) {
        int64_t shape[CT_MAX_DIMS];
        memcpy(shape, p->out.shape, sizeof shape);
        shape[0] = nrows;
        if (!(r.out = ct_tensor_empty(CT_F32, p->out.ndim, shape, CT_MEM_ACT))) r.st = CT_ENOMEM;
    }
    ct_status st = run(&r, nrows, ((const pipe_opts *)s->kopts)->chunks);
    if (st == CT_OK) *out = r.out;
    else ct_tensor_release(r.out);
    return st;
}

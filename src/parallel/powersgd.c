/*
 * PowerSGD (Vogels, Karimireddy and Jaggi, 2019) as a communication hook,
 * following PyTorch 1.13's powerSGD_hook step for step, so the same
 * settings train the same way:
 *
 *  - the first start_iter steps (1000 by default, as PyTorch's: compressing
 *    the fast-changing gradients of the first steps costs accuracy that
 *    error feedback does not win back) every bucket is allreduced as it is;
 *  - then, per bucket: the last step's error is added to the gradients
 *    (error feedback) and a copy kept; each gradient of two or more
 *    dimensions, viewed as a matrix M [n = shape[0], m = the rest], whose
 *    factors are at least min_compression_rate times smaller than it
 *    (n*m > (n+m)*r*rate, r = min(n, m, rank)) is compressed, the rest
 *    (biases, small matrices) allreduced as they are, concatenated;
 *  - Q [m, r] is the last step's (warm start), orthogonalized, or fresh
 *    normal numbers from (seed, step, bucket), the same on every rank;
 *    P = M Q is allreduced, orthogonalized (Gram-Schmidt), Q = M^T P
 *    allreduced, and M becomes P Q^T;
 *  - the error is the copy minus what the bucket now holds.
 *
 * ctrain folds 1/world into the loss gradient, so the bucket holds g/world
 * and every allreduce is a sum: the average PyTorch divides by afterwards;
 * the error is kept in the bucket's units (PyTorch's over world).  So over
 * N ranks the update is what one process would make of the whole batch
 * (tests/mpi/test_powersgd.c): P, Q and the errors' sum are linear in the
 * ranks' gradients.
 * P and Q go in f32 through MPI (never a shared-memory window: each rank's
 * buffers are its own).  The start of a bucket (error feedback, P = M Q)
 * runs on the training thread when the bucket fills, and its two
 * allreduces overlap the rest of backward; the second half (Q, the product
 * back) runs when backward is over.
 */
#include <math.h>
#include <string.h>

#include "ctrain/comm_hook.h"
#include "internal.h"

typedef struct {
    int n, m, r;
    int64_t off;          /* first element in the bucket */
    int64_t p_off, q_off; /* in the bucket's P and Q memory */
} mat_t;

typedef struct {
    int64_t numel;
    uint64_t sig;      /* layout: the members' sizes and shapes */
    int nmats, nunc;
    mat_t *mats;
    int64_t *unc_off, *unc_len; /* uncompressed members */
    int64_t np, nq, nunc_el;
    float *p, *q, *unc;
    float *error, *copy; /* [numel] with error feedback */
    int have_q;          /* q holds the last step's (warm start) */
    int compressed;      /* this step's start compressed the bucket */
    ct_work *unc_work, *p_work;
} bucket_t;

typedef struct {
    ct_powersgd_opts o;
    int64_t iter;
    int64_t before, after;         /* elements a rank sends, in the step being reduced */
    int64_t last_before, last_after;
    bucket_t *b;
    int nb;
} psgd_t;

ct_powersgd_opts ct_powersgd_defaults(int rank)
{
    return (ct_powersgd_opts){rank, 1000, 2.0, 1, 1, 0, 0.0f};
}

static void bucket_clear(bucket_t *b)
{
    if (b->unc_work) ct_work_wait(b->unc_work);
    if (b->p_work) ct_work_wait(b->p_work);
    ct_work_destroy(b->unc_work);
    ct_work_destroy(b->p_work);
    ct_free(b->mats);
    ct_free(b->unc_off);
    ct_free(b->unc_len);
    ct_free(b->p);
    ct_free(b->q);
    ct_free(b->unc);
    ct_free(b->error);
    ct_free(b->copy);
    memset(b, 0, sizeof *b);
}

static void psgd_destroy(void *state)
{
    psgd_t *s = state;
    if (!s) return;
    for (int i = 0; i < s->nb; i++) bucket_clear(&s->b[i]);
    ct_free(s->b);
    ct_free(s);
}

static uint64_t layout_sig(const ct_comm_bucket *cb)
{
    uint64_t h = ct_hash64(&cb->numel, sizeof cb->numel);
    for (int i = 0; i < cb->nparams; i++) {
        const ct_tensor *t = cb->params[i]->data;
        uint64_t part[4] = {h, (uint64_t)cb->offsets[i], (uint64_t)t->numel, (uint64_t)t->shape[0]};
        h = ct_hash64(part, sizeof part);
    }
    return h;
}

/* Which members are compressed, and where their factors go (PyTorch's
 * _should_compress); every buffer sized.  On failure b is left clear. */
static ct_status bucket_plan(const psgd_t *s, bucket_t *b, const ct_comm_bucket *cb)
{
    bucket_clear(b);
    b->numel = cb->numel;
    b->sig = layout_sig(cb);
    int n = cb->nparams ? cb->nparams : 1;
    b->mats = ct_alloc(sizeof *b->mats * (size_t)n, CT_MEM_OTHER);
    b->unc_off = ct_alloc(sizeof *b->unc_off * (size_t)n, CT_MEM_OTHER);
    b->unc_len = ct_alloc(sizeof *b->unc_len * (size_t)n, CT_MEM_OTHER);
    if (!b->mats || !b->unc_off || !b->unc_len) goto nomem;
    for (int i = 0; i < cb->nparams; i++) {
        const ct_tensor *t = cb->params[i]->data;
        int64_t rows = t->ndim > 1 ? t->shape[0] : 0, cols = rows ? t->numel / rows : 0;
        int64_t r = rows < cols ? rows : cols;
        if (r > s->o.rank) r = s->o.rank;
        /* a vector (bias, norm weight) is a 1 x numel matrix to PyTorch, never worth compressing */
        int compress = rows > 0 && (double)(rows + cols) * (double)r * s->o.min_compression_rate < (double)t->numel;
        if (compress && rows <= 1 << 30 && cols <= 1 << 30) {
            b->mats[b->nmats++] = (mat_t){(int)rows, (int)cols, (int)r, cb->offsets[i], 0, 0};
        } else {
            b->unc_off[b->nunc] = cb->offsets[i];
            b->unc_len[b->nunc++] = t->numel;
            b->nunc_el += t->numel;
        }
    }
    /* P and Q lie as PyTorch lays them: matrices grouped by shape, groups
     * in the order their shape first appears, members in bucket order. */
    for (int k = 1; k < b->nmats; k++) {
        mat_t x = b->mats[k];
        int first = 0; /* the first of x's shape before it */
        while (first < k && (b->mats[first].n != x.n || b->mats[first].m != x.m)) first++;
        if (first == k) continue;
        int j = k; /* move x back to just after the last of its group */
        while (j > first + 1 && (b->mats[j - 1].n != x.n || b->mats[j - 1].m != x.m)) {
            b->mats[j] = b->mats[j - 1];
            j--;
        }
        b->mats[j] = x;
    }
    for (int k = 0; k < b->nmats; k++) {
        b->mats[k].p_off = b->np;
        b->mats[k].q_off = b->nq;
        b->np += (int64_t)b->mats[k].n * b->mats[k].r;
        b->nq += (int64_t)b->mats[k].m * b->mats[k].r;
    }
    if (b->np > (1ll << 31) - 1 || b->nq > (1ll << 31) - 1 || b->nunc_el > (1ll << 31) - 1) {
        bucket_clear(b);
        return ct_error(CT_EINVAL, "PowerSGD: a bucket's factors exceed 2^31 elements; give a smaller bucket_cap_mb");
    }
    b->p = ct_alloc_zeroed(sizeof(float) * (size_t)(b->np + 1), CT_MEM_COMM);
    b->q = ct_alloc_zeroed(sizeof(float) * (size_t)(b->nq + 1), CT_MEM_COMM);
    b->unc = ct_alloc(sizeof(float) * (size_t)(b->nunc_el + 1), CT_MEM_COMM);
    if (!b->p || !b->q || !b->unc) goto nomem;
    if (s->o.error_feedback) {
        b->error = ct_alloc_zeroed(sizeof(float) * (size_t)b->numel, CT_MEM_COMM);
        b->copy = ct_alloc(sizeof(float) * (size_t)b->numel, CT_MEM_COMM);
        if (!b->error || !b->copy) goto nomem;
    }
    return CT_OK;
nomem:
    bucket_clear(b);
    return CT_ENOMEM;
}

/* A zero column stays zero (PyTorch would divide by zero). */
void ct__powersgd_orthogonalize(float *a, int rows, int cols, float eps)
{
    for (int i = 0; i < cols; i++) {
        double ss = 0;
        for (int k = 0; k < rows; k++) ss += (double)a[(int64_t)k * cols + i] * a[(int64_t)k * cols + i];
        double d = sqrt(ss) + eps;
        if (d > 0)
            for (int k = 0; k < rows; k++) a[(int64_t)k * cols + i] = (float)(a[(int64_t)k * cols + i] / d);
        for (int j = i + 1; j < cols; j++) {
            double dot = 0;
            for (int k = 0; k < rows; k++) dot += (double)a[(int64_t)k * cols + i] * a[(int64_t)k * cols + j];
            for (int k = 0; k < rows; k++) a[(int64_t)k * cols + j] -= (float)(dot * a[(int64_t)k * cols + i]);
        }
    }
}

static ct_status bucket_slot(psgd_t *s, int index, bucket_t **out)
{
    if (index >= s->nb) {
        int nb = s->nb ? s->nb : 4;
        while (nb <= index) nb *= 2;
        bucket_t *b = ct_alloc_zeroed(sizeof *b * (size_t)nb, CT_MEM_OTHER);
        if (!b) return CT_ENOMEM;
        if (s->nb) memcpy(b, s->b, sizeof *b * (size_t)s->nb);
        ct_free(s->b);
        s->b = b;
        s->nb = nb;
    }
    *out = &s->b[index];
    return CT_OK;
}

static ct_status psgd_start(void *state, ct_group *g, const ct_comm_bucket *cb, ct_work **work)
{
    psgd_t *s = state;
    bucket_t *b;
    if (cb->shard)
        return ct_error(CT_EINVAL, "PowerSGD compresses whole gradient matrices and allreduces their factors; "
                                   "FSDP's sharded gradients need a reduce-scatter (PyTorch refuses it too): "
                                   "register the bf16 or f16 allreduce hook, or use ddp");
    CT_TRY(bucket_slot(s, cb->index, &b));
    if (cb->index == 0) s->before = s->after = 0;
    s->before += cb->numel;
    if (s->iter < s->o.start_iter) { /* the uncompressed start */
        b->compressed = 0;
        s->after += cb->numel;
        return ct_group_allreduce(g, cb->grad, cb->numel, CT_F32, CT_OP_SUM, work);
    }
    if (!b->mats || b->sig != layout_sig(cb)) CT_TRY(bucket_plan(s, b, cb));
    b->compressed = 1;
    s->after += b->np + b->nq + b->nunc_el;
    float *grad = cb->grad;
    if (s->o.error_feedback) {
        for (int64_t i = 0; i < cb->numel; i++) grad[i] += b->error[i];
        memcpy(b->copy, grad, sizeof(float) * (size_t)cb->numel);
    }
    if (!s->o.warm_start || !b->have_q) {
        /* fresh: one stream per (seed, step, bucket), the same on every rank */
        ct_rng rng;
        ct_rng_init(&rng, s->o.seed, ((uint64_t)s->iter << 20) ^ (uint64_t)cb->index ^ 0x50575347ull << 40);
        ct_rng_normal(&rng, b->q, (size_t)b->nq, 0.0f, 1.0f);
    }
    for (int k = 0; k < b->nmats; k++) {
        mat_t *x = &b->mats[k];
        ct__powersgd_orthogonalize(b->q + x->q_off, x->m, x->r, s->o.epsilon);
        /* P [n, r] = M [n, m] Q [m, r] */
        CT_TRY(ct_gemm_f32(CT_GEMM_AUTO, 0, 0, x->n, x->r, x->m, 1.0f, grad + x->off, x->m, b->q + x->q_off, x->r,
                           0.0f, b->p + x->p_off, x->r));
    }
    for (int k = 0, at = 0; k < b->nunc; at += (int)b->unc_len[k], k++)
        memcpy(b->unc + at, grad + b->unc_off[k], sizeof(float) * (size_t)b->unc_len[k]);
    if (b->nunc_el) CT_TRY(ct_group_allreduce(g, b->unc, b->nunc_el, CT_F32, CT_OP_SUM, &b->unc_work));
    if (b->np) CT_TRY(ct_group_allreduce(g, b->p, b->np, CT_F32, CT_OP_SUM, &b->p_work));
    *work = NULL; /* finish waits for both itself */
    return CT_OK;
}

static ct_status wait_drop(ct_work **w)
{
    if (!*w) return CT_OK;
    ct_status st = ct_work_wait(*w);
    ct_work_destroy(*w);
    *w = NULL;
    return st;
}

static ct_status psgd_finish(void *state, ct_group *g, const ct_comm_bucket *cb)
{
    psgd_t *s = state;
    bucket_t *b = &s->b[cb->index];
    int last = cb->index == cb->nbuckets - 1;
    if (b->compressed) {
        float *grad = cb->grad;
        ct_status st = wait_drop(&b->unc_work), st2 = wait_drop(&b->p_work);
        CT_TRY(st);
        CT_TRY(st2);
        for (int k = 0, at = 0; k < b->nunc; at += (int)b->unc_len[k], k++)
            memcpy(grad + b->unc_off[k], b->unc + at, sizeof(float) * (size_t)b->unc_len[k]);
        for (int k = 0; k < b->nmats; k++) {
            mat_t *x = &b->mats[k];
            ct__powersgd_orthogonalize(b->p + x->p_off, x->n, x->r, s->o.epsilon);
            /* Q [m, r] = M^T P */
            CT_TRY(ct_gemm_f32(CT_GEMM_AUTO, 1, 0, x->m, x->r, x->n, 1.0f, grad + x->off, x->m, b->p + x->p_off,
                               x->r, 0.0f, b->q + x->q_off, x->r));
        }
        if (b->nq) CT_TRY(ct_group_allreduce(g, b->q, b->nq, CT_F32, CT_OP_SUM, NULL));
        for (int k = 0; k < b->nmats; k++) {
            mat_t *x = &b->mats[k];
            /* M [n, m] = P [n, r] Q^T [r, m] */
            CT_TRY(ct_gemm_f32(CT_GEMM_AUTO, 0, 1, x->n, x->m, x->r, 1.0f, b->p + x->p_off, x->r, b->q + x->q_off,
                               x->r, 0.0f, grad + x->off, x->m));
        }
        if (s->o.error_feedback) {
            /* In the units the bucket came in (g/world): PyTorch's error,
             * the rank's gradient minus the average, over world. */
            float inv = 1.0f / (float)ct_group_size(g);
            for (int64_t i = 0; i < cb->numel; i++) b->error[i] = b->copy[i] - grad[i] * inv;
        }
        b->have_q = s->o.warm_start;
    }
    if (last) {
        s->iter++;
        s->last_before = s->before;
        s->last_after = s->after;
    }
    return CT_OK;
}

static const ct_comm_hook_ops psgd_ops = {"powersgd", psgd_start, psgd_finish, psgd_destroy};

ct_status ct_comm_hook_powersgd(const ct_powersgd_opts *o, const ct_comm_hook_ops **ops, void **state)
{
    if (o->rank < 1) return ct_error(CT_EINVAL, "PowerSGD: rank %d: give a rank of at least 1 (powersgd:R)", o->rank);
    if (o->start_iter < 0) return ct_error(CT_EINVAL, "PowerSGD: start_iter %d must not be negative", o->start_iter);
    if (!(o->min_compression_rate > 0))
        return ct_error(CT_EINVAL, "PowerSGD: min_compression_rate %g must be positive", o->min_compression_rate);
    if (!(o->epsilon >= 0)) return ct_error(CT_EINVAL, "PowerSGD: epsilon %g must not be negative", (double)o->epsilon);
    if ((o->error_feedback || o->warm_start) && o->start_iter < 2)
        return ct_error(CT_EINVAL, "PowerSGD: start_iter %d with error feedback or warm start: give at least 2 "
                        "(DDP rebuilds its buckets after the first step, and PowerSGD's state follows a bucket's "
                        "index; PyTorch asks the same)", o->start_iter);
    psgd_t *s = ct_alloc_zeroed(sizeof *s, CT_MEM_OTHER);
    if (!s) return CT_ENOMEM;
    s->o = *o;
    *ops = &psgd_ops;
    *state = s;
    return CT_OK;
}

void ct_powersgd_stats(const void *state, int64_t *iter, int64_t *numel_before, int64_t *numel_after)
{
    const psgd_t *s = state;
    if (iter) *iter = s->iter;
    if (numel_before) *numel_before = s->last_before;
    if (numel_after) *numel_after = s->last_after;
}

int ct__powersgd_peek(const void *state, int index, const float **q, int64_t *nq, const float **error)
{
    const psgd_t *s = state;
    if (index >= s->nb || !s->b[index].mats) return 0;
    *q = s->b[index].q;
    *nq = s->b[index].nq;
    *error = s->b[index].error;
    return 1;
}

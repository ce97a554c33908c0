/*
 * Softmax cross-entropy and accuracy counting.  Logits are [..., C] (rows =
 * everything before the last dim) and targets hold one i32/i64 class per
 * row, so [N, C] batches and [B, T, V] sequences both work.  The log-softmax
 * subtracts each row's max first, so large logits do not overflow.
 *
 * A row is three passes over values in L1: its max (and min), exp(z - max)
 * written into the gradient row with the sum in 8 double lanes, then the
 * scale to softmax / count minus the one-hot.  libm's expf was a call per
 * element and most of the loss's time, but its values are what the losses
 * of every run so far were made of (ct__expf, 2 ulp, moved a bf16-vs-f32
 * accuracy test past its tolerance), so the exp here is glibc's own
 * algorithm written to vectorise (ct__expf_libm): the same numbers, bit for
 * bit.  The row's log stays libm's: one call per row.
 *
 * When every target is ignore_index the mean is over zero rows: PyTorch
 * gives nan there; ctrain gives loss 0 and a zero gradient, so a batch of
 * padding contributes nothing instead of poisoning the run.
 */
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "internal.h"

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

/* Lanes as GCC/Clang vectors: the compiler does not reorder a reduction
 * by itself (no -ffast-math). */
typedef double v8d __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* Max and min of zr [C] in 16 lanes, each lane keeping its running max and
 * min as the scalar loop did: a nan never replaces them.  (A nan logit then
 * makes nans where glibc would too, maybe with another payload.) */
static float row_range(const float *zr, int64_t C, float *min)
{
    float mx = zr[0], mn = zr[0];
    int64_t j = 0;
    if (C >= 16) {
        v16f hi, lo, v;
        memcpy(&hi, zr, sizeof hi);
        lo = hi;
        for (j = 16; j + 16 <= C; j += 16) {
            memcpy(&v, zr + j, sizeof v);
            v16i gt = v > hi, lt = v < lo;
            hi = (v16f)((gt & (v16i)v) | (~gt & (v16i)hi));
            lo = (v16f)((lt & (v16i)v) | (~lt & (v16i)lo));
        }
        for (int l = 0; l < 16; l++) {
            mx = hi[l] > mx ? hi[l] : mx;
            mn = lo[l] < mn ? lo[l] : mn;
        }
    }
    for (; j < C; j++) {
        mx = zr[j] > mx ? zr[j] : mx;
        mn = zr[j] < mn ? zr[j] : mn;
    }
    *min = mn;
    return mx;
}

#if defined(__AVX512F__)
/* ct__expf_libm of zr[j] - mx, 8 at a time, its table read with two
 * two-register permutes instead of a gather (the gather was half the loss's
 * time); the exps are summed into a's 8 lanes as they are made. */
static int64_t exp_avx512(const float *zr, float mx, int64_t C, float *e, v8d *a)
{
    const __m512d inv = _mm512_set1_pd(0x1.71547652b82fep+5), shift = _mm512_set1_pd(0x1.8p+52);
    const __m512d c0 = _mm512_set1_pd(0x1.c6af84b912394p-20), c1 = _mm512_set1_pd(0x1.ebfce50fac4f3p-13);
    const __m512d c2 = _mm512_set1_pd(0x1.62e42ff0c52d6p-6), one = _mm512_set1_pd(1.0);
    const uint64_t *tab = ct__exp2_32();
    const __m512i t0 = _mm512_loadu_si512(tab), t1 = _mm512_loadu_si512(tab + 8);
    const __m512i t2 = _mm512_loadu_si512(tab + 16), t3 = _mm512_loadu_si512(tab + 24);
    const __m512i bit4 = _mm512_set1_epi64(16);
    const __m256 m = _mm256_set1_ps(mx);
    __m512d sum;
    memcpy(&sum, a, sizeof sum);
    int64_t j = 0;
    for (; j + 8 <= C; j += 8) {
        __m512d xd = _mm512_cvtps_pd(_mm256_sub_ps(_mm256_loadu_ps(zr + j), m));
        __m512d kd = _mm512_fmadd_pd(inv, xd, shift);
        __m512i ki = _mm512_castpd_si512(kd);
        kd = _mm512_sub_pd(kd, shift);
        __m512d r = _mm512_fmsub_pd(inv, xd, kd);
        __m512i t = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(ki, bit4), _mm512_permutex2var_epi64(t0, ki, t1),
                                            _mm512_permutex2var_epi64(t2, ki, t3));
        __m512d s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64(ki, 47)));
        __m512d p = _mm512_fmadd_pd(c0, r, c1), r2 = _mm512_mul_pd(r, r), y = _mm512_fmadd_pd(c2, r, one);
        __m256 f = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_fmadd_pd(p, r2, y), s));
        _mm256_storeu_ps(e + j, f);
        sum = _mm512_add_pd(sum, _mm512_cvtps_pd(f));
    }
    memcpy(a, &sum, sizeof sum);
    return j;
}
#endif

/* e[j] = exp(zr[j] - mx) for j < C, as libm's expf; returns their sum in
 * double (element j in lane j % 8, the last C % 8 first, then the lanes).
 * Rows whose arguments reach -88 (logits 88 apart, or infinite) call libm,
 * whose special cases are its own; a nan logit gives nans either way. */
static double row_exp(const float *zr, float mx, float mn, int64_t C, float *e)
{
    v8d a = {0};
    int64_t j = 0;
    if (mn - mx > -88.0f) {
#if defined(__AVX512F__)
        j = exp_avx512(zr, mx, C, e, &a);
#endif
        for (int64_t i = j; i < C; i++) e[i] = ct__expf_libm(zr[i] - mx);
    } else {
        for (int64_t i = 0; i < C; i++) e[i] = expf(zr[i] - mx);
    }
    for (; j + 8 <= C; j += 8) {
        v8f v;
        memcpy(&v, e + j, sizeof v);
        a += __builtin_convertvector(v, v8d);
    }
    double se = 0.0;
    for (; j < C; j++) se += e[j];
    for (int l = 0; l < 8; l++) se += a[l];
    return se;
}

/* Rows of one cross-entropy: each row's loss term (0 when ignored) and its gradient. */
typedef struct {
    const float *z;
    const ct_tensor *targets;
    int64_t ignore_index, C;
    double inv;
    ct_tensor *d;
    float *scratch;
    double *terms;
} ce_job;

static void ce_rows(void *ctx, int64_t lo, int64_t hi)
{
    const ce_job *j = ctx;
    int64_t C = j->C;
    for (int64_t r = lo; r < hi; r++) {
        int64_t t = target_at(j->targets, r);
        float *dr = j->d ? ct_f32(j->d) + r * C : j->scratch;
        j->terms[r] = 0.0;
        if (t == j->ignore_index) { /* contributes nothing */
            if (j->d) memset(dr, 0, (size_t)C * sizeof *dr);
            continue;
        }
        const float *zr = j->z + r * C;
        float mn, mx = row_range(zr, C, &mn);
        double se = row_exp(zr, mx, mn, C, dr);
        j->terms[r] = log(se) - (double)(zr[t] - mx);
        if (j->d) {
            float scale = (float)(j->inv / se);
            for (int64_t c = 0; c < C; c++) dr[c] *= scale;
            dr[t] -= (float)j->inv;
        }
    }
}

ct_status ct_cross_entropy(const ct_tensor *logits, const ct_tensor *targets, int64_t ignore_index,
                           float *loss, ct_tensor **dlogits)
{
    int64_t rows, C;
    if (dlogits) *dlogits = NULL;
    CT_TRY(check(logits, targets, ignore_index, &rows, &C));
    ct_tensor *d = NULL;
    if (dlogits && !(d = ct_tensor_empty(CT_F32, logits->ndim, logits->shape, CT_MEM_ACT))) /* written in full */
        return CT_ENOMEM;
    /* Without a gradient the exps go to a row of scratch. */
    float *scratch = d ? NULL : ct_alloc((size_t)C * sizeof *scratch, CT_MEM_ACT);
    if (!d && !scratch) return CT_ENOMEM;
    int64_t count = 0;
    for (int64_t r = 0; r < rows; r++) count += target_at(targets, r) != ignore_index;
    double *terms = ct_alloc((size_t)rows * sizeof *terms, CT_MEM_ACT);
    if (!terms) {
        ct_free(scratch);
        ct_tensor_release(d);
        return CT_ENOMEM;
    }
    ce_job j = {ct_f32(logits), targets, ignore_index, C, count ? 1.0 / (double)count : 0.0, d, scratch, terms};
    /* Rows on the rank's threads (without a gradient one scratch row: one thread);
     * the loss sums their terms in row order, as one thread does. */
    if (d) ct_parallel_for(rows, 16, ce_rows, &j);
    else ce_rows(&j, 0, rows);
    double total = 0.0, inv = j.inv;
    for (int64_t r = 0; r < rows; r++) total += terms[r];
    ct_free(terms);
    ct_free(scratch);
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

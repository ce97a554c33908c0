/*
 * Matrix products by dtype.  f32 x f32 goes to OpenBLAS (ct_sgemm) or to
 * oneDNN's f32 matmul, whichever measured faster for the shape class (see
 * use_onednn_f32); bf16 x bf16 goes to oneDNN's matmul, which accumulates in
 * f32 and writes f32 (AVX512_BF16 instructions where the CPU has them,
 * emulation otherwise).  Debian's OpenBLAS 0.3.21 has no sbgemm, so oneDNN is
 * the only bf16 engine we have.
 *
 * oneDNN wants a primitive per problem (shapes, strides, dtypes, alpha/beta
 * as attributes), and creating one costs far more than a small product, so
 * primitives live in a cache keyed by everything that shapes them, including
 * the thread count: with the OpenMP runtime oneDNN sizes its kernels for the
 * threads present at creation and must run with the same number.  The cache
 * holds one mutex over lookup and execution (the entry's memory objects are
 * re-pointed at each call), which is enough for one compute thread per
 * process and safe, if serial, for more.
 *
 * Threads: oneDNN runs on OpenMP; ct_blas_set_threads sets the count for
 * OpenBLAS and for the OpenMP team oneDNN uses, so a rank's products use the
 * same cores whichever library runs them.  OpenMP's count is per calling
 * thread, so it is applied again on whichever thread calls the product.
 */
#include <immintrin.h>
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "ctrain/core.h"
#include "internal.h"

typedef struct {
    int bf16, ta, tb, m, n, k, lda, ldb, ldc, nthr;
    int bias, c_bf16; /* a bias row added to C; C stored as bf16 */
    int jit;          /* run oneDNN's gemm:jit kernel, not its first choice (see TRANS_MIN_K) */
    float alpha, beta;
} gemm_key;

typedef struct {
    gemm_key key;
    dnnl_primitive_t prim;
    dnnl_memory_t a, b, c, bias;
    dnnl_primitive_desc_t pd;
    const char *impl; /* oneDNN's implementation name, owned by pd */
} gemm_entry;

/* More entries than any model has product shapes; past it the cache is
 * emptied and refilled (a run that keeps changing shapes pays creation). */
#define CACHE_MAX 512

static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;
static gemm_entry *cache;
static int ncache, cache_cap;
static dnnl_engine_t engine;
static dnnl_stream_t stream;

static const char *dnnl_err(dnnl_status_t s)
{
    switch (s) {
    case dnnl_success: return "success";
    case dnnl_out_of_memory: return "out of memory";
    case dnnl_invalid_arguments: return "invalid arguments";
    case dnnl_unimplemented: return "no implementation for this problem";
    case dnnl_iterator_ends: return "iterator ends";
    case dnnl_runtime_error: return "runtime error";
    case dnnl_not_required: return "not required";
    default: return "unknown oneDNN status";
    }
}

static void entry_fini(gemm_entry *e)
{
    dnnl_memory_destroy(e->a);
    dnnl_memory_destroy(e->b);
    dnnl_memory_destroy(e->c);
    dnnl_memory_destroy(e->bias);
    dnnl_primitive_destroy(e->prim);
    dnnl_primitive_desc_destroy(e->pd);
}

static ct_status setup_engine(void)
{
    if (engine) return CT_OK;
    /* CTRAIN_ISA caps oneDNN's kernels as it caps ctrain's (src/core/cpu.c);
     * oneDNN takes the cap only before its first primitive, hence here. */
    static const dnnl_cpu_isa_t isa[] = {dnnl_cpu_isa_sse41, dnnl_cpu_isa_avx2, dnnl_cpu_isa_avx512_core,
                                         dnnl_cpu_isa_avx512_core_bf16, dnnl_cpu_isa_all};
    static int capped;
    if (!capped && ct__cpu_cap() < 4) dnnl_set_max_cpu_isa(isa[ct__cpu_cap()]);
    capped = 1;
    dnnl_status_t s = dnnl_engine_create(&engine, dnnl_cpu, 0);
    if (s == dnnl_success) s = dnnl_stream_create(&stream, engine, dnnl_stream_default_flags);
    if (s != dnnl_success) {
        if (engine) dnnl_engine_destroy(engine);
        engine = NULL;
        return ct_error(CT_EUNSUPPORTED, "oneDNN: cannot create the CPU engine (%s); check that "
                        "libdnnl2 is installed and matches the headers", dnnl_err(s));
    }
    return CT_OK;
}

static void describe(const gemm_key *k, char *buf, size_t n)
{
    snprintf(buf, n, "%s %c%c m=%d n=%d k=%d lda=%d ldb=%d ldc=%d alpha=%g beta=%g%s%s threads=%d",
             k->bf16 ? "bf16" : "f32", k->ta ? 'T' : 'N', k->tb ? 'T' : 'N', k->m, k->n,
             k->k, k->lda, k->ldb, k->ldc, (double)k->alpha, (double)k->beta, k->bias ? " bias" : "",
             k->c_bf16 ? " C bf16" : "", k->nthr);
}

/* The primitive descriptor of oneDNN's gemm:jit implementation of md, or
 * (none there) of its first choice. */
static dnnl_status_t pick_jit(dnnl_primitive_desc_t *pd, const dnnl_matmul_desc_t *md, dnnl_primitive_attr_t attr)
{
    dnnl_primitive_desc_iterator_t it;
    dnnl_status_t s = dnnl_primitive_desc_iterator_create(&it, md, attr, engine, NULL);
    if (s != dnnl_success) return s;
    dnnl_primitive_desc_t first = NULL;
    for (;;) {
        dnnl_primitive_desc_t p = dnnl_primitive_desc_iterator_fetch(it);
        const char *name = "";
        if (!p) break;
        dnnl_primitive_desc_query(p, dnnl_query_impl_info_str, 0, &name);
        if (!strncmp(name, "gemm:jit", 8)) {
            dnnl_primitive_desc_destroy(first);
            first = p;
            break;
        }
        if (!first) first = p;
        else dnnl_primitive_desc_destroy(p);
        if (dnnl_primitive_desc_iterator_next(it) != dnnl_success) break;
    }
    dnnl_primitive_desc_iterator_destroy(it);
    *pd = first;
    return first ? dnnl_success : dnnl_unimplemented;
}

/* Builds the primitive and its memory objects for key (under cache_lock). */
static ct_status entry_init(gemm_entry *e, const gemm_key *k)
{
    memset(e, 0, sizeof *e);
    e->key = *k;
    dnnl_data_type_t in = k->bf16 ? dnnl_bf16 : dnnl_f32;
    /* Row-major op(A) [m, k]: element (i, p) at i*lda + p, or p*lda + i when transposed. */
    dnnl_dims_t ad = {k->m, k->k}, as = {k->ta ? 1 : k->lda, k->ta ? k->lda : 1};
    dnnl_dims_t bd = {k->k, k->n}, bs = {k->tb ? 1 : k->ldb, k->tb ? k->ldb : 1};
    dnnl_dims_t cd = {k->m, k->n}, cs = {k->ldc, 1}, zd = {1, k->n}, zs = {k->n, 1};
    dnnl_memory_desc_t amd, bmd, cmd, zmd;
    dnnl_matmul_desc_t md;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    const char *step = "memory descriptors";
    dnnl_status_t s = dnnl_memory_desc_init_by_strides(&amd, 2, ad, in, as);
    if (s == dnnl_success) s = dnnl_memory_desc_init_by_strides(&bmd, 2, bd, in, bs);
    if (s == dnnl_success)
        s = dnnl_memory_desc_init_by_strides(&cmd, 2, cd, k->c_bf16 ? dnnl_bf16 : dnnl_f32, cs);
    if (s == dnnl_success) s = dnnl_memory_desc_init_by_strides(&zmd, 2, zd, dnnl_f32, zs);
    if (s == dnnl_success)
        step = "matmul descriptor", s = dnnl_matmul_desc_init(&md, &amd, &bmd, k->bias ? &zmd : NULL, &cmd);
    if (s == dnnl_success) step = "attributes", s = dnnl_primitive_attr_create(&attr);
    if (s == dnnl_success && k->alpha != 1.0f)
        s = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &k->alpha);
    if (s == dnnl_success && k->beta != 0.0f) {
        /* C = alpha*A*B + beta*C: the sum post-op scales the old C by beta. */
        s = dnnl_post_ops_create(&po);
        if (s == dnnl_success) s = dnnl_post_ops_append_sum(po, k->beta);
        if (s == dnnl_success) s = dnnl_primitive_attr_set_post_ops(attr, po);
    }
    if (s == dnnl_success && !k->jit) step = "primitive descriptor", s = dnnl_primitive_desc_create(&e->pd, &md, attr, engine, NULL);
    if (s == dnnl_success && k->jit) step = "primitive descriptor", s = pick_jit(&e->pd, &md, attr);
    if (s == dnnl_success) step = "primitive", s = dnnl_primitive_create(&e->prim, e->pd);
    if (s == dnnl_success) step = "memory objects", s = dnnl_memory_create(&e->a, &amd, engine, DNNL_MEMORY_NONE);
    if (s == dnnl_success) s = dnnl_memory_create(&e->b, &bmd, engine, DNNL_MEMORY_NONE);
    if (s == dnnl_success) s = dnnl_memory_create(&e->c, &cmd, engine, DNNL_MEMORY_NONE);
    if (s == dnnl_success && k->bias) s = dnnl_memory_create(&e->bias, &zmd, engine, DNNL_MEMORY_NONE);
    if (s == dnnl_success && dnnl_primitive_desc_query(e->pd, dnnl_query_impl_info_str, 0, &e->impl) != dnnl_success)
        e->impl = "?";
    dnnl_post_ops_destroy(po);
    dnnl_primitive_attr_destroy(attr);
    if (s != dnnl_success) {
        char d[192];
        describe(k, d, sizeof d);
        entry_fini(e);
        return ct_error(s == dnnl_out_of_memory ? CT_ENOMEM : CT_EUNSUPPORTED,
                        "oneDNN matmul (%s): creating the %s failed: %s; %s", d, step, dnnl_err(s),
                        s == dnnl_out_of_memory ? "free memory or use a smaller batch"
                        : "this oneDNN build cannot run the product (DNNL_VERBOSE=all says why)");
    }
    return CT_OK;
}

/* The cached entry for k, created on first use (under cache_lock). */
static ct_status lookup(const gemm_key *k, gemm_entry **out)
{
    static int last = -1;
    if (last >= 0 && last < ncache && !memcmp(&cache[last].key, k, sizeof *k)) {
        *out = &cache[last];
        return CT_OK;
    }
    for (int i = 0; i < ncache; i++)
        if (!memcmp(&cache[i].key, k, sizeof *k)) {
            *out = &cache[last = i];
            return CT_OK;
        }
    CT_TRY(setup_engine());
    if (ncache == CACHE_MAX) {
        for (int i = 0; i < ncache; i++) entry_fini(&cache[i]);
        ncache = 0;
    }
    if (ncache == cache_cap) {
        int cap = cache_cap ? 2 * cache_cap : 16;
        gemm_entry *c = ct_alloc((size_t)cap * sizeof *c, CT_MEM_OTHER);
        if (!c) return CT_ENOMEM;
        if (ncache) memcpy(c, cache, (size_t)ncache * sizeof *c);
        ct_free(cache);
        cache = c;
        cache_cap = cap;
    }
    CT_TRY(entry_init(&cache[ncache], k));
    *out = &cache[last = ncache++];
    return CT_OK;
}

/* A bf16 A^T B over a long reduction (a weight gradient: k is the batch's
 * rows).  oneDNN's first choice, brgemm, wants A with k contiguous and
 * otherwise transposes it itself; that copy ran the weight gradients of a
 * GPT step at 300-350 GFLOP/s against 410-440 for its other products (AMD
 * EPYC, AVX512_BF16), and with AMX its results at 2 threads differed from
 * those at 1 (tests/test_threads.c).  So:
 * - with AMX, oneDNN's gemm:jit runs it on A as it lies: it packs its
 *   operands itself, into AMX kernels.  One core of a Xeon with AMX,
 *   median GFLOP/s of the GPT 12 x 768's weight gradients (k = 2048),
 *   brgemm on A^T / A^T copied here + gemm:jit (copy included) / gemm:jit
 *   on A^T: 2304x768 495 / 428 / 662, 768x768 549 / 490 / 617, 3072x768
 *   426 / 345 / 578, 768x3072 430 / 482 / 509 (a loaded machine; the
 *   copy, a scalar one in that probe, is what separates the last two);
 * - without AMX, A^T is copied here first (tn_product) and oneDNN runs
 *   A' B on the copy, whose row stride is padded off a power of two (rows
 *   2^n bytes apart share a few cache sets), which brgemm refuses and
 *   gemm:jit takes: 350-390 GFLOP/s on that EPYC. */
#define TRANS_MIN_K 1024

static int is_weight_gradient(int bf16, int ta, int tb, int k) { return bf16 && ta && !tb && k >= TRANS_MIN_K; }

/* 1 if a product of this shape runs on oneDNN's gemm:jit (see above). */
static int wants_jit(int bf16, int ta, int tb, int k)
{
    return is_weight_gradient(bf16, ta, tb, k) && ct__cpu_has(CT__CPU_AMX);
}

/* 1 if key's product runs as A' B on a copy of A^T (tn_product): a weight
 * gradient that does not run on gemm:jit. */
static int copies_a_t(const gemm_key *k) { return is_weight_gradient(k->bf16, k->ta, k->tb, k->k) && !k->jit; }

static gemm_key make_key(int bf16, int ta, int tb, int m, int n, int k, float alpha,
                         int lda, int ldb, float beta, int ldc)
{ /* bias and c_bf16 start 0: the callers that want them set them */
    gemm_key key;
    memset(&key, 0, sizeof key); /* no padding garbage: keys compare with memcmp */
    key.bf16 = bf16;
    key.ta = ta != 0;
    key.tb = tb != 0;
    key.m = m;
    key.n = n;
    key.k = k;
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.nthr = ct_blas_get_threads();
    key.alpha = alpha;
    key.beta = beta;
    key.jit = wants_jit(bf16, ta, tb, k);
    return key;
}

static ct_status check_args(const char *fn, int ta, int tb, int m, int n, int k, int lda, int ldb,
                            int ldc)
{
    if (m < 0 || n < 0 || k < 0)
        return ct_error(CT_EINVAL, "%s: negative size m=%d n=%d k=%d", fn, m, n, k);
    int acols = ta ? m : k, bcols = tb ? k : n;
    if (lda < (acols > 1 ? acols : 1) || ldb < (bcols > 1 ? bcols : 1) || ldc < (n > 1 ? n : 1))
        return ct_error(CT_EINVAL, "%s: leading dimensions lda=%d ldb=%d ldc=%d are shorter than "
                        "the rows they stride (%d, %d, %d); pass the row length of each matrix "
                        "as stored", fn, lda, ldb, ldc, acols, bcols, n);
    return CT_OK;
}

/* Runs primitive e on a, b, c and the bias row (if e has one) (under cache_lock). */
static ct_status execute(gemm_entry *e, const void *a, const void *b, void *c, const float *bias)
{
    dnnl_status_t s = dnnl_memory_set_data_handle(e->a, (void *)a);
    if (s == dnnl_success) s = dnnl_memory_set_data_handle(e->b, (void *)b);
    if (s == dnnl_success) s = dnnl_memory_set_data_handle(e->c, c);
    if (s == dnnl_success && e->bias) s = dnnl_memory_set_data_handle(e->bias, (void *)bias);
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, e->a}, {DNNL_ARG_WEIGHTS, e->b}, {DNNL_ARG_DST, e->c},
                               {DNNL_ARG_BIAS, e->bias}};
    if (s == dnnl_success) s = dnnl_primitive_execute(e->prim, stream, e->bias ? 4 : 3, args);
    if (s == dnnl_success) s = dnnl_stream_wait(stream);
    if (s != dnnl_success) {
        char d[192];
        describe(&e->key, d, sizeof d);
        return ct_error(CT_EUNSUPPORTED, "oneDNN matmul (%s) failed to run: %s", d, dnnl_err(s));
    }
    return CT_OK;
}

/* Accumulating into a large C over a short reduction goes by row panels.
 * oneDNN's sum post-op reads C as it goes, without the prefetching OpenBLAS
 * does, so on a C larger than L2 it waits on memory: each panel of PANEL
 * rows is computed with beta 0 into an L2-sized scratch and then added to C
 * in one streaming pass.  One core, C 1024x1024 f32 not in cache, median
 * GFLOP/s, C += A^T B direct -> by panels:
 *   bf16 k=64  127 -> 221     bf16 k=256  252 -> 302
 *   f32  k=64   98 -> 136     f32  k=256  160 -> 156 (even)
 * (the weight gradient of Linear(1024, 1024) at batch 64 and 256). */
#define PANEL 64
#define PANEL_MAX_K 256
#define PANEL_MIN_C (1 << 19)

static float *scratch_buf; /* product scratch of by_panels and swapped, under cache_lock */
static size_t scratch_bytes;

/* *buf (of *have bytes) with room for bytes, its old contents dropped. */
static ct_status grow(void **buf, size_t *have, size_t bytes)
{
    if (*have >= bytes) return CT_OK;
    void *p = ct_alloc(bytes, CT_MEM_OTHER);
    if (!p) return CT_ENOMEM;
    ct_free(*buf);
    *buf = p;
    *have = bytes;
    return CT_OK;
}

/* scratch_buf with room for n floats. */
static ct_status scratch(int64_t n) { return grow((void **)&scratch_buf, &scratch_bytes, (size_t)n * sizeof(float)); }

/* The product of one panel of key (last: the last, maybe partial, one) into the scratch. */
static gemm_key panel_key(const gemm_key *key, int last)
{
    gemm_key p = *key;
    p.m = !last || key->m % PANEL == 0 ? PANEL : key->m % PANEL;
    p.beta = 0.0f;
    p.ldc = key->n;
    return p;
}

/* C = alpha A B + beta C by panels; *ran is set once C may have changed. */
static ct_status by_panels(const gemm_key *key, const void *a, const void *b, float *c, int *ran)
{
    CT_TRY(scratch((int64_t)PANEL * key->n));
    /* Both panel primitives (full and last) exist before C is touched, so a
     * set-up failure leaves C as it was. */
    gemm_key pk[2] = {panel_key(key, 0), panel_key(key, 1)};
    gemm_entry *e[2];
    CT_TRY(lookup(&pk[1], &e[1]));
    CT_TRY(lookup(&pk[0], &e[0]));
    CT_TRY(lookup(&pk[1], &e[1])); /* creating e[0] may have moved the cache */
    size_t esz = key->bf16 ? 2 : 4;
    *ran = 1;
    for (int i0 = 0; i0 < key->m; i0 += PANEL) {
        int last = key->m - i0 <= PANEL, rows = last ? pk[1].m : PANEL;
        const char *ap = (const char *)a + (key->ta ? (size_t)i0 : (size_t)i0 * key->lda) * esz;
        CT_TRY(execute(last ? e[1] : e[0], ap, b, scratch_buf, NULL));
        float beta = key->beta;
        for (int r = 0; r < rows; r++) {
            float *restrict cr = c + (size_t)(i0 + r) * key->ldc;
            const float *restrict pr = scratch_buf + (size_t)r * key->n;
            if (beta == 1.0f)
                for (int j = 0; j < key->n; j++) cr[j] += pr[j];
            else
                for (int j = 0; j < key->n; j++) cr[j] = pr[j] + beta * cr[j];
        }
    }
    return CT_OK;
}

static uint16_t *trans_buf; /* A^T for tn_product, under cache_lock */
static size_t trans_bytes;

/* The 16x16 block at s (row stride ls) transposed into d (row stride ld). */
__attribute__((target("avx2"))) static void tr16(const uint16_t *s, int64_t ls, uint16_t *d, int64_t ld)
{
    __m256i r[16], a[16], b[16], c[16];
    for (int i = 0; i < 16; i++) r[i] = _mm256_loadu_si256((const void *)(s + i * ls));
    for (int i = 0; i < 8; i++) { /* pairs of rows interleaved, by 16 bits */
        a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) /* groups of four rows, by 32 bits */
        for (int h = 0; h < 2; h++) {
            b[4 * g + 2 * h] = _mm256_unpacklo_epi32(a[4 * g + h], a[4 * g + h + 2]);
            b[4 * g + 2 * h + 1] = _mm256_unpackhi_epi32(a[4 * g + h], a[4 * g + h + 2]);
        }
    /* b[4g + q]: rows 4g..4g+3 of columns 2q and 2q + 1 (+8 in the high lane) */
    for (int g = 0; g < 2; g++) /* groups of eight rows, by 64 bits */
        for (int q = 0; q < 4; q++) {
            c[8 * g + 2 * q] = _mm256_unpacklo_epi64(b[8 * g + q], b[8 * g + 4 + q]);
            c[8 * g + 2 * q + 1] = _mm256_unpackhi_epi64(b[8 * g + q], b[8 * g + 4 + q]);
        }
    /* c[8g + j]: rows 8g..8g+7 of column j (j + 8 in the high lane) */
    for (int j = 0; j < 8; j++) {
        _mm256_storeu_si256((void *)(d + j * ld), _mm256_permute2x128_si256(c[j], c[8 + j], 0x20));
        _mm256_storeu_si256((void *)(d + (j + 8) * ld), _mm256_permute2x128_si256(c[j], c[8 + j], 0x31));
    }
}

/* d [m][ld] = s^T for s [k][ls] of bf16 bits: 16x16 blocks, two along k at
 * a time so each row of d gets whole 64-byte lines; edges one by one. */
static void transpose_bf16(const uint16_t *s, int64_t ls, int64_t k, int64_t m, uint16_t *d, int64_t ld)
{
    int vec = ct__cpu_has(CT__CPU_AVX2);
    int64_t m16 = vec ? m / 16 * 16 : 0, k16 = vec ? k / 16 * 16 : 0;
    for (int64_t j = 0; j < m16; j += 16)
        for (int64_t p = 0; p < k16; p += 16) tr16(s + p * ls + j, ls, d + j * ld + p, ld);
    for (int64_t j = 0; j < m; j++)
        for (int64_t p = j < m16 ? k16 : 0; p < k; p++) d[j * ld + p] = s[p * ls + j];
}

/* The product tn_product runs for key: A' B with A' = A^T as copied. */
static gemm_key transposed_key(const gemm_key *key)
{
    gemm_key t = *key;
    t.ta = 0;
    t.lda = (key->k + 31) / 32 * 32 + 32;
    return t;
}

/* C = alpha A^T B + beta C for bf16 A over k >= TRANS_MIN_K, through A^T
 * copied (without AMX); *ran as by_panels. */
static ct_status tn_product(const gemm_key *key, const void *a, const void *b, void *c, const float *bias, int *ran)
{
    gemm_key t = transposed_key(key);
    CT_TRY(grow((void **)&trans_buf, &trans_bytes, (size_t)t.lda * (size_t)key->m * sizeof *trans_buf));
    gemm_entry *e;
    CT_TRY(lookup(&t, &e));
    transpose_bf16(a, key->lda, key->k, key->m, trans_buf, t.lda);
    *ran = 1;
    return execute(e, trans_buf, b, c, bias);
}

/* A^T B with the wide side first (m > n) goes as (B^T A)^T: oneDNN copies
 * the transposed operand for its kernel, and copying the narrow one is what
 * is fast (bf16, one core: 512 x 128 x 4096 223 -> 340 GFLOP/s, the weight
 * gradient of Linear(128, 512); f32 was even).  B^T A lands in an L2-sized
 * scratch and is added into C transposed; oneDNN asked to store C
 * transposed itself ran a reference kernel at 0.1 GFLOP/s. */
#define SWAP_MAX_C (1 << 18)

/* The product swapped runs for key: B^T A into the scratch. */
static gemm_key swapped_key(const gemm_key *key)
{
    gemm_key t = *key;
    t.m = key->n, t.n = key->m, t.lda = key->ldb, t.ldb = key->lda, t.ldc = key->m, t.beta = 0.0f;
    return t;
}

/* C = alpha A^T B + beta C through B^T A; *ran as by_panels. */
static ct_status swapped(const gemm_key *key, const void *a, const void *b, float *c, int *ran)
{
    CT_TRY(scratch((int64_t)key->m * key->n));
    gemm_key t = swapped_key(key);
    if (copies_a_t(&t)) {
        CT_TRY(tn_product(&t, b, a, scratch_buf, NULL, ran));
    } else {
        gemm_entry *e;
        CT_TRY(lookup(&t, &e));
        *ran = 1;
        CT_TRY(execute(e, b, a, scratch_buf, NULL));
    }
    float beta = key->beta;
    /* Row i of C is column i of the swapped product; 16x16 tiles, so the 16
     * lines of the scratch a tile reads stay in L1 across its rows. */
    for (int i0 = 0; i0 < key->m; i0 += 16)
        for (int j0 = 0; j0 < key->n; j0 += 16)
            for (int i = i0; i < i0 + 16 && i < key->m; i++) {
                float *restrict cr = c + (size_t)i * key->ldc;
                const float *restrict col = scratch_buf + i;
                int j1 = j0 + 16 < key->n ? j0 + 16 : key->n;
                if (beta == 0.0f)
                    for (int j = j0; j < j1; j++) cr[j] = col[(size_t)j * key->m];
                else
                    for (int j = j0; j < j1; j++) cr[j] = col[(size_t)j * key->m] + beta * cr[j];
            }
    return CT_OK;
}

/* The ways onednn_gemm_run carries a product out, chosen by its key alone
 * (never by the thread count, so a product sums in the same order at any). */
typedef enum { ROUTE_DIRECT, ROUTE_PANELS, ROUTE_SWAPPED, ROUTE_TRANSPOSED } gemm_route;

static gemm_route route_of(const gemm_key *k)
{
    int tn = k->bf16 && k->ta && !k->tb;
    if (k->beta != 0.0f && !k->bias && k->k <= PANEL_MAX_K && k->m > PANEL && (int64_t)k->m * k->n >= PANEL_MIN_C)
        return ROUTE_PANELS;
    if (tn && k->m > k->n && !k->bias && !k->c_bf16 && (int64_t)k->m * k->n <= SWAP_MAX_C) return ROUTE_SWAPPED;
    if (copies_a_t(k)) return ROUTE_TRANSPOSED;
    return ROUTE_DIRECT;
}

/* The key of the primitive that does the work of key's route (the one
 * whose kernel ct_gemm_onednn_impl names). */
static gemm_key work_key(const gemm_key *k)
{
    switch (route_of(k)) {
    case ROUTE_PANELS: return panel_key(k, 0);
    case ROUTE_SWAPPED: {
        gemm_key t = swapped_key(k);
        return copies_a_t(&t) ? transposed_key(&t) : t;
    }
    case ROUTE_TRANSPOSED: return transposed_key(k);
    default: return *k;
    }
}

/* oneDNN matmul of f32 (bf16 = 0) or bf16 operands into C, f32 or (c_bf16,
 * then beta is 0) bf16, plus the bias row when bias is not NULL.  *ran is
 * set once C may have changed (a failure before that leaves C as it was). */
static ct_status onednn_gemm_run(int bf16, int trans_a, int trans_b, int m, int n, int k, float alpha,
                                 const void *a, int lda, const void *b, int ldb, const float *bias, float beta,
                                 void *c, int c_bf16, int ldc, int *ran)
{
    *ran = 0;
    CT_TRY(check_args(bf16 ? "gemm_bf16" : "gemm_f32", trans_a, trans_b, m, n, k, lda, ldb, ldc));
    if (m == 0 || n == 0) return CT_OK;
    if (k == 0) { /* oneDNN rejects empty reductions; the answer is bias + beta*C */
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                size_t at = (size_t)i * ldc + j;
                float v = bias ? bias[j] : 0.0f;
                if (c_bf16) ((uint16_t *)c)[at] = ct_f32_to_bf16(v);
                else ((float *)c)[at] = beta == 0.0f ? v : v + beta * ((float *)c)[at];
            }
        return CT_OK;
    }
    if (bf16 && !ct__cpu_has(CT__CPU_AVX512F)) { /* oneDNN's bf16 matmul needs AVX-512 */
        *ran = 1;
        return ct__gemm_bf16_widened(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, bias, beta, c, c_bf16, ldc);
    }
    gemm_key key = make_key(bf16, trans_a, trans_b, m, n, k, alpha, lda, ldb, beta, ldc);
    key.bias = bias != NULL;
    key.c_bf16 = c_bf16 != 0;
    if (omp_get_max_threads() != key.nthr) omp_set_num_threads(key.nthr);
    pthread_mutex_lock(&cache_lock);
    ct_status st;
    switch (route_of(&key)) {
    case ROUTE_PANELS: st = by_panels(&key, a, b, c, ran); break;
    case ROUTE_SWAPPED: st = swapped(&key, a, b, c, ran); break;
    case ROUTE_TRANSPOSED: st = tn_product(&key, a, b, c, bias, ran); break;
    default: {
        gemm_entry *e;
        st = lookup(&key, &e);
        if (st == CT_OK) {
            *ran = 1;
            st = execute(e, a, b, c, bias);
        }
    }
    }
    pthread_mutex_unlock(&cache_lock);
    return st;
}

/* onednn_gemm_run, timed as products in the ledger. */
static ct_status onednn_gemm(int bf16, int trans_a, int trans_b, int m, int n, int k, float alpha,
                             const void *a, int lda, const void *b, int ldb, const float *bias, float beta,
                             void *c, int c_bf16, int ldc, int *ran)
{
    double t0 = ct_ledger_begin();
    ct_status st = onednn_gemm_run(bf16, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, bias, beta, c, c_bf16,
                                   ldc, ran);
    ct_ledger_end(CT_LEDGER_PRODUCTS, t0);
    return st;
}

/* Where f32 products go (CT_GEMM_AUTO): measured, per shape class, on one
 * core of an AMD EPYC with AVX-512 (and AVX512_BF16), OpenBLAS 0.3.21 vs
 * oneDNN 2.6 (brg:avx512_core), C += op(A) op(B), engines interleaved rep by
 * rep, median GFLOP/s of 31-41 reps on a shared machine.  The answer depends
 * on which kernel OpenBLAS runs, so the rule asks it.
 *
 * OpenBLAS with an AVX-512 kernel (Cooperlake, its default here; SkylakeX):
 *   NT 64x1024x1024  150 vs 189   NN 64x1024x1024  119 vs 157
 *   NT 256x1024x1024 193 vs 217   NN 256x1024x1024 199 vs 214
 *   TN 1024x1024x64  204 vs 162   TN 1024x1024x256 220 vs 185  (dW: OpenBLAS)
 *   NT 64x256x784    174 vs 211   NN 64x784x256    201 vs 223
 *   NN 16x1600x150   145 vs 213   NT 16x150x1600    92 vs 143
 *   NN 6x6272x25     150 vs 125   NN 64x256x10     176 vs 146  (small: OpenBLAS)
 *   NN 64^3          234 vs 203   NN 32^3          177 vs  95
 *   NN 1024x16x1024  142 vs 120   NN 1024^3        157 vs 150  (about even)
 *   CNN convs (im2col): NN 32x784x144 151 vs 188, NT 32x144x784 108 vs 158,
 *                       NN 16x14112x9 104 vs 79, NN 16x1568x36 198 vs 165
 * -> oneDNN for NN/NT with n >= 128, k >= 64 and m*n*k >= 2^20 (1.1-1.5x),
 *    else OpenBLAS.
 *
 * OpenBLAS with an AVX2 kernel on the same CPU (OPENBLAS_CORETYPE=Haswell,
 * as this machine's environment sets it):
 *   NT 64x1024x1024   44 vs  84   TN 1024x1024x64   84 vs 133
 *   NN 64x1024x1024   47 vs 128   NT 256x1024x1024  62 vs 160
 *   TN 1024x1024x256  46 vs  68   NN 256x1024x1024  58 vs 107
 *   NT 64x10x256      62 vs 109   NN 6x6272x25      60 vs 127
 *   NN 64^3          106 vs 199   NN 32^3           77 vs  91
 *   NN 1024x16x1024   53 vs  81   NN 1024x8x1024    54 vs  41  (narrow C: OpenBLAS)
 *   CNN convs:        NN 16x14112x9 70 vs 83, NN 32x784x144 98 vs 192
 * -> oneDNN wherever n >= 16 and m*n*k >= 65536 (1.2-2.5x).
 *
 * oneDNN pays ~0.6 us per call (cache lookup, execute), which is why tiny
 * products stay on OpenBLAS.  CPUs without AVX-512 were not measured: they
 * stay on OpenBLAS.  Two threads on the shared 2-core machine were too noisy
 * to tell apart; ranks train on one thread each. */
static int onednn_f32_class(void)
{
    /* 0: never oneDNN; 1: OpenBLAS runs an AVX2 kernel; 2: both AVX-512. */
    static int cls = -1;
    int c = __atomic_load_n(&cls, __ATOMIC_RELAXED);
    if (c < 0) {
        __builtin_cpu_init();
        int cpu512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
        static const char *k512[] = {"SkylakeX", "Cooperlake", "SapphireRapids", NULL};
        const char *core = ct_blas_corename();
        int blas512 = 0;
        for (int i = 0; core && k512[i]; i++) blas512 |= !strcasecmp(core, k512[i]);
        c = !cpu512 ? 0 : blas512 ? 2 : 1;
        __atomic_store_n(&cls, c, __ATOMIC_RELAXED);
    }
    return c;
}

static int use_onednn_f32(int ta, int tb, int m, int n, int k)
{
    (void)tb;
    int64_t mnk = (int64_t)m * n * k;
    switch (onednn_f32_class()) {
    case 1: return n >= 16 && mnk >= 65536;
    case 2: return !ta && n >= 128 && k >= 64 && mnk >= ((int64_t)1 << 20);
    default: return 0;
    }
}

/* Set when oneDNN could not run an f32 product: AUTO then stays on OpenBLAS. */
static int onednn_f32_failed;

ct_gemm_engine ct_gemm_f32_engine(int trans_a, int trans_b, int m, int n, int k)
{
    int failed = __atomic_load_n(&onednn_f32_failed, __ATOMIC_RELAXED);
    return !failed && use_onednn_f32(trans_a != 0, trans_b != 0, m, n, k) ? CT_GEMM_ONEDNN
                                                                          : CT_GEMM_OPENBLAS;
}

ct_status ct_gemm_f32(ct_gemm_engine engine, int trans_a, int trans_b, int m, int n, int k,
                      float alpha, const float *a, int lda, const float *b, int ldb, float beta,
                      float *c, int ldc)
{
    CT_TRY(check_args("gemm_f32", trans_a, trans_b, m, n, k, lda, ldb, ldc));
    int auto_ = engine == CT_GEMM_AUTO;
    if (auto_) engine = ct_gemm_f32_engine(trans_a, trans_b, m, n, k);
    if (engine == CT_GEMM_ONEDNN) {
        int ran;
        ct_status s = onednn_gemm(0, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, NULL, beta, c, 0,
                                  ldc, &ran);
        if (s == CT_OK || !auto_ || ran) return s;
        /* Set-up failed and C is untouched: OpenBLAS gives the same f32
         * answer, so carry on there, and say so once. */
        ct_log(CT_LOG_WARN, "%s; f32 products use OpenBLAS from now on", ct_last_error());
        __atomic_store_n(&onednn_f32_failed, 1, __ATOMIC_RELAXED);
    } else if (engine != CT_GEMM_OPENBLAS) {
        return ct_error(CT_EINVAL, "gemm_f32: engine %d is not CT_GEMM_AUTO, CT_GEMM_OPENBLAS or "
                        "CT_GEMM_ONEDNN", (int)engine);
    }
    ct_sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return CT_OK;
}

ct_status ct_gemm_bf16(int trans_a, int trans_b, int m, int n, int k, float alpha,
                       const uint16_t *a, int lda, const uint16_t *b, int ldb, float beta,
                       float *c, int ldc)
{
    int ran;
    return onednn_gemm(1, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, NULL, beta, c, 0, ldc, &ran);
}

ct_status ct_gemm_bf16_bias(int trans_a, int trans_b, int m, int n, int k, const uint16_t *a, int lda,
                            const uint16_t *b, int ldb, const float *bias, void *c, int c_bf16, int ldc)
{
    int ran;
    return onednn_gemm(1, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, bias, 0.0f, c, c_bf16, ldc, &ran);
}

ct_status ct_gemm_f32_bias(ct_gemm_engine engine, int trans_a, int trans_b, int m, int n, int k,
                           const float *a, int lda, const float *b, int ldb, const float *bias, float *c,
                           int ldc)
{
    CT_TRY(check_args("gemm_f32", trans_a, trans_b, m, n, k, lda, ldb, ldc));
    int auto_ = engine == CT_GEMM_AUTO;
    if (auto_) engine = ct_gemm_f32_engine(trans_a, trans_b, m, n, k);
    if (engine == CT_GEMM_ONEDNN && bias) {
        int ran;
        ct_status s = onednn_gemm(0, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, bias, 0.0f, c, 0, ldc,
                                  &ran);
        if (s == CT_OK || !auto_ || ran) return s;
        engine = CT_GEMM_AUTO; /* ct_gemm_f32 below tells of the failure and stays on OpenBLAS */
    }
    if (!bias) return ct_gemm_f32(engine, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 0.0f, c, ldc);
    /* No bias in OpenBLAS: rows start as the bias and the product adds onto them. */
    for (int i = 0; i < m; i++) memcpy(c + (size_t)i * ldc, bias, (size_t)n * sizeof *c);
    return ct_gemm_f32(engine, trans_a, trans_b, m, n, k, 1.0f, a, lda, b, ldb, 1.0f, c, ldc);
}

ct_status ct_gemm_onednn_impl(int bf16, int trans_a, int trans_b, int m, int n, int k, float beta,
                              char *buf, size_t len)
{
    int lda = trans_a ? m : k, ldb = trans_b ? k : n, ldc = n;
    if (len) buf[0] = 0;
    if (m <= 0 || n <= 0 || k <= 0)
        return ct_error(CT_EINVAL, "gemm_onednn_impl: sizes m=%d n=%d k=%d must be positive", m, n, k);
    gemm_key key = make_key(bf16 != 0, trans_a, trans_b, m, n, k, 1.0f, lda, ldb, beta, ldc);
    if (omp_get_max_threads() != key.nthr) omp_set_num_threads(key.nthr);
    key = work_key(&key);
    pthread_mutex_lock(&cache_lock);
    gemm_entry *e;
    ct_status s = lookup(&key, &e);
    if (s == CT_OK && len) snprintf(buf, len, "%s", e->impl);
    pthread_mutex_unlock(&cache_lock);
    return s;
}

void ct_gemm_cache_clear(void)
{
    pthread_mutex_lock(&cache_lock);
    for (int i = 0; i < ncache; i++) entry_fini(&cache[i]);
    ct_free(cache);
    cache = NULL;
    ncache = cache_cap = 0;
    ct_free(scratch_buf);
    scratch_buf = NULL;
    scratch_bytes = 0;
    ct_free(trans_buf);
    trans_buf = NULL;
    trans_bytes = 0;
    if (stream) dnnl_stream_destroy(stream);
    if (engine) dnnl_engine_destroy(engine);
    stream = NULL;
    engine = NULL;
    pthread_mutex_unlock(&cache_lock);
}

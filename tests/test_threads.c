/*
 * Every part of a step on the rank's threads gives the bits of one thread:
 * the parallel-for itself (each item once, serial where it must be), the
 * f32 products OpenBLAS runs cut over the team, the bf16 products oneDNN
 * runs on each of gemm.c's routes, the optimizer updates, the
 * casts, and whole GPT training steps (f32, bf16 on the kernels and on the
 * portable path, with dropout) through the ctrain program at --threads 1
 * and 2.
 */
#include <pthread.h>
#include <stdlib.h>

#include "cli_util.h"

/* ---- the parallel-for -------------------------------------------------- */

typedef struct {
    int *hits;
    int ranges;
} cover_ctx;

static void cover(void *ctx, int64_t lo, int64_t hi)
{
    cover_ctx *c = ctx;
    for (int64_t i = lo; i < hi; i++) __atomic_add_fetch(&c->hits[i], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&c->ranges, 1, __ATOMIC_RELAXED);
}

static void *serial_thread(void *arg)
{
    ct_parallel_serial_here();
    *(int *)arg = ct_parallel_threads(1 << 20, 1);
    return NULL;
}

TEST(threads_parallel_for_cuts_each_item_once)
{
    ct_blas_set_threads(2);
    ASSERT_EQ(ct_blas_get_threads(), 2);
    ASSERT_EQ(ct_parallel_threads(1 << 20, 1), 2);
    ASSERT_EQ(ct_parallel_threads(100, 64), 1); /* too little for two */
    const int64_t sizes[] = {0, 1, 15, 31, 32, 33, 1000, 4097};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        int64_t n = sizes[s];
        int *hits = calloc((size_t)n + 1, sizeof *hits);
        cover_ctx c = {hits, 0};
        ct_parallel_for(n, 1, cover, &c);
        for (int64_t i = 0; i < n; i++) ASSERT_EQ(hits[i], 1);
        ASSERT_EQ(c.ranges, n == 0 ? 0 : n == 1 ? 1 : 2);
        free(hits);
    }
    /* A thread that is not the compute thread runs kernels on itself alone. */
    int t = -1;
    pthread_t th;
    ASSERT_EQ(pthread_create(&th, NULL, serial_thread, &t), 0);
    pthread_join(th, NULL);
    ASSERT_EQ(t, 1);
    ct_blas_set_threads(1);
    ASSERT_EQ(ct_parallel_threads(1 << 20, 1), 1);
}

/* ---- kernels at 1 and 2 threads ---------------------------------------- */

static float *randoms(size_t n, uint64_t seed)
{
    float *x = malloc(n * sizeof *x);
    ct_rng r;
    ct_rng_init(&r, seed, 0);
    ct_rng_normal(&r, x, n, 0.0f, 1.0f);
    return x;
}

/* Each product {m, n, k, ta, tb, beta} of shapes through ct_sgemm (bf16 0)
 * or ct_gemm_bf16 on bf16 copies of the operands, at 1 and at 2 threads:
 * the same bits. */
static void products_match_one_thread(const int (*shapes)[6], size_t nshapes, int bf16)
{
    for (size_t s = 0; s < nshapes; s++) {
        int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2], ta = shapes[s][3], tb = shapes[s][4];
        float beta = (float)shapes[s][5];
        int lda = ta ? m : k, ldb = tb ? k : n;
        float *a = randoms((size_t)m * k, 1 + s), *b = randoms((size_t)k * n, 100 + s);
        float *c[2] = {randoms((size_t)m * n, 200 + s), malloc((size_t)m * n * sizeof(float))};
        uint16_t *ah = malloc((size_t)m * k * 2), *bh = malloc((size_t)k * n * 2);
        ct_f32_to_bf16_n(a, ah, (size_t)m * k);
        ct_f32_to_bf16_n(b, bh, (size_t)k * n);
        memcpy(c[1], c[0], (size_t)m * n * sizeof(float));
        for (int t = 0; t < 2; t++) {
            ct_blas_set_threads(t + 1);
            if (bf16) ASSERT_OK(ct_gemm_bf16(ta, tb, m, n, k, 0.5f, ah, lda, bh, ldb, beta, c[t], n));
            else ct_sgemm(ta, tb, m, n, k, 0.5f, a, lda, b, ldb, beta, c[t], n);
        }
        if (memcmp(c[0], c[1], (size_t)m * n * sizeof(float)))
            ct_test_fail(__FILE__, __LINE__, "%s product %dx%dx%d ta=%d tb=%d beta=%g differs at 2 threads",
                         bf16 ? "bf16" : "f32", m, n, k, ta, tb, (double)beta);
        free(a);
        free(b);
        free(c[0]);
        free(c[1]);
        free(ah);
        free(bh);
    }
    ct_blas_set_threads(1);
}

TEST(threads_sgemm_bits_match_one_thread)
{
    /* m > n (cut by rows), n > m (by columns), each transposition, beta 0 and 1,
     * and a long reduction (the weight gradients). */
    static const int shapes[][6] = {{256, 96, 192, 0, 0, 0}, {96, 300, 128, 0, 1, 1}, {200, 160, 512, 1, 0, 0},
                                    {64, 768, 2048, 1, 0, 1}, {130, 70, 257, 1, 1, 0}, {768, 64, 1024, 0, 1, 0}};
    products_match_one_thread(shapes, sizeof shapes / sizeof *shapes, 0);
}

/* oneDNN's bf16 products on each of gemm.c's routes: direct (NT, NN), the
 * weight gradients' long reductions (A^T copied; on AMX oneDNN could cut
 * k over threads), the swapped product and the panels. */
TEST(threads_bf16_products_bits_match_one_thread)
{
    static const int shapes[][6] = {{512, 768, 256, 0, 1, 0},  {512, 256, 768, 0, 0, 0}, {768, 768, 2048, 1, 0, 0},
                                    {256, 768, 2048, 1, 0, 1}, {384, 96, 1024, 1, 0, 0}, {512, 1024, 64, 1, 0, 1}};
    products_match_one_thread(shapes, sizeof shapes / sizeof *shapes, 1);
}

/* Two steps of o over n elements at the given thread count; p, m, v returned in one block. */
static float *optim_run(const ct_optim_opts *o, int64_t n, int threads)
{
    float *all = randoms((size_t)(4 * n), 7), *p = all, *g = all + n, *m = all + 2 * n, *v = all + 3 * n;
    for (int64_t i = 0; i < n; i++) v[i] = fabsf(v[i]);
    float *state[2] = {m, v};
    ct_blas_set_threads(threads);
    for (int step = 1; step <= 2; step++) ct_optim_update_range(o, p, g, state, n, step);
    return all;
}

TEST(threads_optimizer_bits_match_one_thread)
{
    const int64_t n = 200003; /* several ranges, and a tail off the vector width */
    ct_optim_opts o[3] = {ct_optim_defaults(CT_OPT_ADAMW), ct_optim_defaults(CT_OPT_SGD),
                          ct_optim_defaults(CT_OPT_SGD)};
    o[0].weight_decay = 0.1;
    o[1].momentum = 0.9;
    o[1].weight_decay = 0.01;
    o[2].momentum = 0.9;
    o[2].nesterov = 1;
    for (int i = 0; i < 3; i++) {
        ASSERT_OK(ct_optim_validate(&o[i]));
        float *a = optim_run(&o[i], n, 1), *b = optim_run(&o[i], n, 2);
        if (memcmp(a, b, (size_t)(4 * n) * sizeof *a))
            ct_test_fail(__FILE__, __LINE__, "optimizer %d differs at 2 threads", i);
        free(a);
        free(b);
    }
}

TEST(threads_casts_bits_match_one_thread)
{
    const size_t n = 300007;
    float *x = randoms(n, 9), *back1 = malloc(n * sizeof *back1), *back2 = malloc(n * sizeof *back2);
    x[5] = 1e-40f; /* subnormal: the vector cast takes the integer way */
    x[70000] = NAN;
    x[150000] = -INFINITY;
    uint16_t *h1 = malloc(n * 2), *h2 = malloc(n * 2);
    ct_blas_set_threads(1);
    ct_f32_to_bf16_n(x, h1, n);
    ct_bf16_to_f32_n(h1, back1, n);
    ct_blas_set_threads(2);
    ct_f32_to_bf16_n(x, h2, n);
    ct_bf16_to_f32_n(h2, back2, n);
    ASSERT(!memcmp(h1, h2, n * 2));
    ASSERT(!memcmp(back1, back2, n * sizeof *back1));
    for (size_t i = 0; i < n; i += 997) ASSERT_EQ(h2[i], ct_f32_to_bf16(x[i])); /* and each is the scalar cast */
    free(x);
    free(back1);
    free(back2);
    free(h1);
    free(h2);
}

/* ---- whole training steps ---------------------------------------------- */

/* Big enough that every kernel cuts its work in two at 2 threads. */
#define STEP_FLAGS "train --model gpt --layers 2 --heads 4 --dim 128 --context 64 --batch 8 --steps 3 --log-every 0 --limit-test 1"

/* Trains with extra flags (env: a shell prefix) at 1 and 2 threads and compares the saved weights. */
static void step_bits(const char *env, const char *extra)
{
    static char out[OUT_MAX];
    char *one = path_in("one.safetensors"), *two = path_in("two.safetensors");
    for (int t = 1; t <= 2; t++) {
        int rc = run_sh(0, env, out, STEP_FLAGS " %s --threads %d --save %s", extra, t, t == 1 ? one : two);
        if (rc) ct_test_fail(__FILE__, __LINE__, "train %s at %d threads failed (%d):\n%s", extra, t, rc, out);
        ASSERT_STR_CONTAINS(out, t == 1 ? "1 BLAS thread per rank" : "2 BLAS threads per rank");
    }
    same_files(one, two);
}

TEST(threads_gpt_step_f32_bits_match_one_thread)
{
    step_bits("", "--mixed none");
    step_bits("", "--mixed none --dropout 0.1 --optim sgd --momentum 0.9");
}

TEST(threads_gpt_step_bf16_bits_match_one_thread)
{
    step_bits("", "--mixed bf16");
    step_bits("", "--mixed bf16 --dropout 0.1");
    step_bits("CTRAIN_ATTN_PORTABLE=1", "--mixed bf16");
}

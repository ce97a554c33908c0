/* The data-parallel sampler: permutations, determinism, and the same global
 * order for every world size. */
#include <stdlib.h>

#include "ctrain/io.h"
#include "test.h"

static void assert_permutation(const int64_t *p, int64_t n)
{
    char *seen = calloc((size_t)n + 1, 1);
    for (int64_t i = 0; i < n; i++) {
        ASSERT(p[i] >= 0 && p[i] < n);
        ASSERT(!seen[p[i]]);
        seen[p[i]] = 1;
    }
    free(seen);
}

TEST(sampler_is_a_deterministic_permutation)
{
    ct_sampler a, b;
    ASSERT_OK(ct_sampler_init(&a, 1000, 32, 42, 1, 0));
    ASSERT_OK(ct_sampler_init(&b, 1000, 32, 42, 1, 0));
    assert_permutation(a.perm, 1000);
    ASSERT_EQ(memcmp(a.perm, b.perm, 1000 * sizeof(int64_t)), 0);
    int64_t fixed = 0;
    for (int64_t i = 0; i < 1000; i++) fixed += a.perm[i] == i;
    ASSERT(fixed < 10); /* a shuffle, not the identity (expected 1 fixed point) */

    /* Another epoch: a different permutation; back to epoch 0: the same one. */
    int64_t *e0 = malloc(1000 * sizeof(int64_t));
    memcpy(e0, a.perm, 1000 * sizeof(int64_t));
    ASSERT_OK(ct_sampler_set_epoch(&a, 1));
    assert_permutation(a.perm, 1000);
    ASSERT(memcmp(a.perm, e0, 1000 * sizeof(int64_t)) != 0);
    ASSERT_OK(ct_sampler_set_epoch(&a, 0));
    ASSERT_EQ(memcmp(a.perm, e0, 1000 * sizeof(int64_t)), 0);

    /* Another seed: a different permutation. */
    ct_sampler c;
    ASSERT_OK(ct_sampler_init(&c, 1000, 32, 43, 1, 0));
    ASSERT(memcmp(c.perm, e0, 1000 * sizeof(int64_t)) != 0);
    ct_sampler_fini(&c);

    /* No shuffle: identity in every epoch. */
    ASSERT_OK(ct_sampler_init(&c, 10, 3, 42, 0, 0));
    ASSERT_OK(ct_sampler_set_epoch(&c, 5));
    for (int64_t i = 0; i < 10; i++) ASSERT_EQ(c.perm[i], i);
    ct_sampler_fini(&c);
    ct_sampler_fini(&c); /* twice is safe */
    free(e0);
    ct_sampler_fini(&a);
    ct_sampler_fini(&b);
}

/* Pins the order against an independent Python implementation (Philox
 * 4x32-10 checked against Random123's known answers, Lemire's bounded draw,
 * Fisher-Yates from the top): a changed shuffle would silently change every
 * run's data order and break reproducible resumes. */
TEST(sampler_order_is_pinned)
{
    ct_sampler s;
    ASSERT_OK(ct_sampler_init(&s, 10, 4, 7, 1, 0));
    ASSERT_OK(ct_sampler_set_epoch(&s, 3));
    static const int64_t want[10] = {8, 6, 7, 2, 1, 9, 3, 0, 5, 4};
    for (int i = 0; i < 10; i++) ASSERT_EQ(s.perm[i], want[i]);
    ct_sampler_fini(&s);

    ASSERT_OK(ct_sampler_init(&s, 60000, 64, 1234, 1, 0));
    static const int64_t head[8] = {4723, 24940, 25179, 40066, 56410, 12663, 30200, 6955};
    for (int i = 0; i < 8; i++) ASSERT_EQ(s.perm[i], head[i]);
    ASSERT_EQ(s.perm[59999], 7206);
    ct_sampler_fini(&s);
}

/* Every value lands in every position about equally often. */
TEST(sampler_is_uniform)
{
    enum { N = 8, EPOCHS = 4000 };
    int counts[N][N] = {{0}};
    ct_sampler s;
    ASSERT_OK(ct_sampler_init(&s, N, N, 99, 1, 0));
    for (int e = 0; e < EPOCHS; e++) {
        ASSERT_OK(ct_sampler_set_epoch(&s, e));
        for (int i = 0; i < N; i++) counts[i][s.perm[i]]++;
    }
    /* Each count is Binomial(4000, 1/8): mean 500, sd 20.9; 5 sd = 105. */
    double chi2 = 0;
    for (int i = 0; i < N; i++)
        for (int v = 0; v < N; v++) {
            ASSERT_NEAR(counts[i][v], EPOCHS / N, 105);
            double d = counts[i][v] - EPOCHS / (double)N;
            chi2 += d * d / (EPOCHS / (double)N);
        }
    /* 64 cells, 49 degrees of freedom: p(chi2 > 100) < 1e-5. */
    ASSERT(chi2 < 100);
    ct_sampler_fini(&s);
}

TEST(sampler_same_global_order_for_any_world_size)
{
    for (int drop = 0; drop < 2; drop++) {
        ct_sampler s;
        ASSERT_OK(ct_sampler_init(&s, 103, 10, 5, 1, drop));
        ASSERT_EQ(ct_sampler_nbatches(&s), drop ? 10 : 11);
        ASSERT_EQ(ct_sampler_batch_size(&s, 9), 10);
        ASSERT_EQ(ct_sampler_batch_size(&s, 10), drop ? 0 : 3);
        for (int epoch = 0; epoch < 3; epoch++) {
            ASSERT_OK(ct_sampler_set_epoch(&s, epoch));
            int64_t seen = 0;
            for (int64_t b = 0; b < ct_sampler_nbatches(&s); b++) {
                int64_t g = ct_sampler_batch_size(&s, b), ref[10], nref;
                ASSERT_OK(ct_sampler_batch(&s, b, 0, 1, ref, &nref));
                ASSERT_EQ(nref, g);
                for (int64_t i = 0; i < g; i++) ASSERT_EQ(ref[i], s.perm[b * 10 + i]);
                for (int w = 2; w <= 4; w++) {
                    int64_t cat[10], ncat = 0, mn = 99, mx = 0;
                    for (int r = 0; r < w; r++) {
                        int64_t part[10], np;
                        ASSERT_OK(ct_sampler_batch(&s, b, r, w, part, &np));
                        memcpy(cat + ncat, part, (size_t)np * sizeof *part);
                        ncat += np;
                        mn = np < mn ? np : mn;
                        mx = np > mx ? np : mx;
                    }
                    ASSERT_EQ(ncat, g);
                    ASSERT(mx - mn <= 1);
                    ASSERT_EQ(memcmp(cat, ref, (size_t)g * sizeof *ref), 0);
                }
                seen += g;
            }
            ASSERT_EQ(seen, drop ? 100 : 103);
        }
        ct_sampler_fini(&s);
    }
}

TEST(sampler_edges_and_errors)
{
    ct_sampler s;
    ASSERT_ERR(ct_sampler_init(&s, 10, 0, 1, 1, 0), CT_EINVAL, "batch size is 0");
    ASSERT_ERR(ct_sampler_init(&s, -1, 4, 1, 1, 0), CT_EINVAL, "samples");
    ASSERT_OK(ct_sampler_init(&s, 3, 4, 1, 1, 1));
    ASSERT_EQ(ct_sampler_nbatches(&s), 0); /* drop_last with fewer samples than a batch */
    ct_sampler_fini(&s);
    ASSERT_OK(ct_sampler_init(&s, 3, 4, 1, 1, 0));
    ASSERT_EQ(ct_sampler_nbatches(&s), 1);
    int64_t idx[4], n = -1;
    ASSERT_OK(ct_sampler_batch(&s, 0, 3, 4, idx, &n)); /* more ranks than samples */
    ASSERT_EQ(n, 0);
    ASSERT_OK(ct_sampler_batch(&s, 0, 2, 4, idx, &n));
    ASSERT_EQ(n, 1);
    ASSERT_ERR(ct_sampler_batch(&s, 1, 0, 1, idx, &n), CT_EINVAL, "batch 1 is out of range");
    ASSERT_ERR(ct_sampler_batch(&s, 0, 4, 4, idx, &n), CT_EINVAL, "rank 4 of a world of 4");
    ASSERT_ERR(ct_sampler_set_epoch(&s, -1), CT_EINVAL, "epoch is -1");
    ct_sampler_fini(&s);
    ASSERT_OK(ct_sampler_init(&s, 0, 4, 1, 1, 0));
    ASSERT_EQ(ct_sampler_nbatches(&s), 0);
    ct_sampler_fini(&s);
}

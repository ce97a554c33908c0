/* Bucket assignment against PyTorch's published cases (test_c10d_common.py) and more. */
#include "test.h"

#define F32 0
#define F64 1

/* Formats bucket_of as "[[0,2],[1,3]]" for comparison with PyTorch's lists. */
static const char *fmt(const int *bucket_of, int n, int nb)
{
    static char s[512];
    int off = sprintf(s, "[");
    for (int b = 0; b < nb; b++) {
        off += sprintf(s + off, "%s[", b ? "," : "");
        int first = 1;
        for (int i = 0; i < n; i++)
            if (bucket_of[i] == b) {
                off += sprintf(s + off, "%s%d", first ? "" : ",", i);
                first = 0;
            }
        off += sprintf(s + off, "]");
    }
    sprintf(s + off, "]");
    return s;
}

static void check(const int64_t *numel, const int *keys, int n, const size_t *limits, int nl,
                  const char *want)
{
    size_t bytes[64];
    int of[64], nb;
    for (int i = 0; i < n; i++) bytes[i] = (size_t)numel[i] * (keys[i] == F64 ? 8 : 4);
    ASSERT_OK(ct_bucket_assign(bytes, keys, n, limits, nl, of, &nb));
    const char *got = fmt(of, n, nb);
    if (strcmp(got, want)) ct_test_fail(__FILE__, __LINE__, "got %s want %s", got, want);
}

TEST(bucket_pytorch_case_single_limit)
{
    check((int64_t[]){100, 200, 100, 50}, (int[]){F32, F32, F32, F32}, 4, (size_t[]){400}, 1,
          "[[0],[1],[2],[3]]");
}

TEST(bucket_pytorch_case_multi_dtype)
{
    check((int64_t[]){50, 25, 50, 25, 50, 25}, (int[]){F32, F64, F32, F64, F32, F64}, 6,
          (size_t[]){400}, 1, "[[0,2],[1,3],[4],[5]]");
}

TEST(bucket_pytorch_case_multi_limit)
{
    check((int64_t[]){10, 10, 10, 10}, (int[]){F32, F32, F32, F32}, 4, (size_t[]){40, 80}, 2,
          "[[0],[1,2],[3]]");
}

TEST(bucket_pytorch_case_multi_limit_multi_dtype)
{
    check((int64_t[]){50, 25, 50, 25, 50, 25}, (int[]){F32, F64, F32, F64, F32, F64}, 6,
          (size_t[]){200, 400}, 2, "[[0],[1],[2,4],[3,5]]");
}

TEST(bucket_more_cases)
{
    /* Everything fits in one bucket. */
    check((int64_t[]){1, 2, 3}, (int[]){F32, F32, F32}, 3, (size_t[]){1 << 20}, 1, "[[0,1,2]]");
    /* A tensor bigger than the limit closes a bucket on its own, and the last limit repeats. */
    check((int64_t[]){5, 1000, 5, 5, 5, 5}, (int[]){F32, F32, F32, F32, F32, F32}, 6,
          (size_t[]){4, 40}, 2, "[[0],[1],[2,3],[4,5]]");
    /* DDP's layout: reversed parameters, 1 MiB first bucket, then 25 MiB. */
    int64_t mlp[16];
    int keys[16];
    for (int i = 0; i < 16; i++) {
        mlp[i] = (i % 2) ? 1024 : 1024 * 1024; /* 8 x (weight, bias) of Linear(1024,1024) */
        keys[i] = F32;
    }
    check(mlp, keys, 16, (size_t[]){1 << 20, 25u << 20}, 2,
          "[[0],[1,2,3,4,5,6,7,8,9,10,11,12,13,14],[15]]");
    /* Empty input. */
    int of[1], nb = -1;
    ASSERT_OK(ct_bucket_assign(NULL, NULL, 0, (size_t[]){10}, 1, of, &nb));
    ASSERT_EQ(nb, 0);
    ASSERT_ERR(ct_bucket_assign(NULL, NULL, 0, NULL, 0, of, &nb), CT_EINVAL, "size limit");
}

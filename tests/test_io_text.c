/* Byte-level text corpora: which files, in which order, the 90/10 split,
 * training windows keyed by (seed, step, sample) only, consecutive
 * validation windows, and the errors. */
#include <sys/stat.h>
#include <unistd.h>

#include "test.h"

static void put(const char *dir, const char *name, const char *text)
{
    char path[700];
    ASSERT(snprintf(path, sizeof path, "%s/%s", dir, name) < (int)sizeof path);
    FILE *f = fopen(path, "w");
    ASSERT(f);
    fputs(text, f);
    fclose(f);
}

TEST(text_files_order_and_split)
{
    const char *dir = ct_test_tmpdir();
    put(dir, "b", "BBBBBBBBBB");            /* 10 */
    put(dir, "a", "aaaaaaaaaaaaaaaaaaaa");  /* 20: first, by name */
    put(dir, "a.dat", "index");             /* fortune's index: skipped */
    put(dir, ".hidden", "hidden");          /* skipped */
    char link[700], sub[700];
    ASSERT(snprintf(link, sizeof link, "%s/a.u8", dir) < (int)sizeof link);
    ASSERT(symlink("a", link) == 0); /* the .u8 links: skipped (and any link) */
    ASSERT(snprintf(link, sizeof link, "%s/c", dir) < (int)sizeof link);
    ASSERT(symlink("b", link) == 0);
    ASSERT(snprintf(sub, sizeof sub, "%s/sub", dir) < (int)sizeof sub);
    ASSERT(mkdir(sub, 0755) == 0); /* folders: skipped */
    put(sub, "z", "zzz");
    put(dir, "c2", "0123456789abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz0123456789"); /* 82 */
    ct_text t;
    ASSERT_OK(ct_text_load(dir, &t));
    ASSERT_EQ(t.nfiles, 3);
    ASSERT_EQ(t.n, 112);
    ASSERT_EQ(t.ntrain, 100); /* floor(0.9 * 112) = floor(100.8) */
    ASSERT(!memcmp(t.bytes, "aaaaaaaaaaaaaaaaaaaaBBBBBBBBBB0123", 34));
    ASSERT(t.bytes[111] == '9');
    /* The byte distribution's entropy. */
    int64_t c[256] = {0};
    for (int64_t i = 0; i < t.n; i++) c[t.bytes[i]]++;
    double h = 0;
    for (int k = 0; k < 256; k++)
        if (c[k]) h -= (double)c[k] / 112 * log((double)c[k] / 112);
    ASSERT_NEAR(ct_text_unigram_entropy(&t), h, 1e-12);
    ct_text_fini(&t);
    ct_text_fini(&t); /* twice is safe */
}

TEST(text_windows)
{
    const char *dir = ct_test_tmpdir();
    char buf[1001];
    for (int i = 0; i < 1000; i++) buf[i] = (char)('a' + i % 26);
    buf[1000] = 0;
    put(dir, "t", buf);
    ct_text t;
    ASSERT_OK(ct_text_load(dir, &t));
    ASSERT_EQ(t.ntrain, 900);
    int64_t T = 7;
    ASSERT_OK(ct_text_check(&t, T));
    /* Starts depend on (seed, step, sample) only, stay inside the training split, and vary. */
    int64_t seen_lo = 1 << 30, seen_hi = -1;
    for (int64_t g = 0; g < 2000; g++) {
        int64_t s = ct_text_train_start(&t, T, 5, 3, g);
        ASSERT(s >= 0 && s + T + 1 <= t.ntrain);
        ASSERT_EQ(s, ct_text_train_start(&t, T, 5, 3, g));
        seen_lo = s < seen_lo ? s : seen_lo;
        seen_hi = s > seen_hi ? s : seen_hi;
    }
    ASSERT(seen_lo < 10 && seen_hi > t.ntrain - T - 10); /* the whole range is reachable */
    ASSERT(ct_text_train_start(&t, T, 5, 3, 1) != ct_text_train_start(&t, T, 5, 4, 1) ||
           ct_text_train_start(&t, T, 5, 3, 2) != ct_text_train_start(&t, T, 5, 4, 2));
    ASSERT(ct_text_train_start(&t, T, 5, 3, 1) != ct_text_train_start(&t, T, 6, 3, 1) ||
           ct_text_train_start(&t, T, 5, 3, 2) != ct_text_train_start(&t, T, 6, 3, 2));
    /* A batch: y is x shifted by one; samples 2..4 are the same whichever batch they are cut from. */
    ct_tensor *x, *y, *x2, *y2;
    ASSERT_OK(ct_text_train_batch(&t, T, 5, 3, 0, 5, &x, &y));
    ASSERT_OK(ct_text_train_batch(&t, T, 5, 3, 2, 3, &x2, &y2));
    ASSERT(x->dtype == CT_I64 && x->shape[0] == 5 && x->shape[1] == T);
    const int64_t *xd = ct_tensor_data(x), *yd = ct_tensor_data(y);
    for (int64_t i = 0; i < 5; i++) {
        int64_t s = ct_text_train_start(&t, T, 5, 3, i);
        for (int64_t j = 0; j < T; j++) {
            ASSERT_EQ(xd[i * T + j], t.bytes[s + j]);
            ASSERT_EQ(yd[i * T + j], t.bytes[s + j + 1]);
        }
    }
    ASSERT(!memcmp(xd + 2 * T, ct_tensor_data(x2), sizeof(int64_t) * 3 * (size_t)T));
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_tensor_release(x2);
    ct_tensor_release(y2);
    /* Validation: floor(100 / 8) = 12 consecutive windows of 8 bytes from byte 900. */
    ASSERT_EQ(ct_text_val_windows(&t, T), 12);
    ASSERT_OK(ct_text_val_batch(&t, T, 11, 1, &x, &y));
    ASSERT_EQ(((int64_t *)ct_tensor_data(x))[0], t.bytes[900 + 88]);
    ASSERT_EQ(((int64_t *)ct_tensor_data(y))[T - 1], t.bytes[900 + 95]);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ASSERT_ERR(ct_text_val_batch(&t, T, 11, 2, &x, &y), CT_EINVAL, "validation windows");
    ASSERT_ERR(ct_text_check(&t, 100), CT_EINVAL, "lower --context");
    ASSERT_ERR(ct_text_train_batch(&t, 100, 5, 3, 0, 1, &x, &y), CT_EINVAL, "lower --context");
    ct_text_fini(&t);
}

TEST(text_load_errors)
{
    ct_text t;
    ASSERT_ERR(ct_text_load("/nonexistent-ctrain-text", &t), CT_EIO, "/nonexistent-ctrain-text");
    ASSERT(t.bytes == NULL);
    ASSERT_ERR(ct_text_load(ct_test_tmpdir(), &t), CT_EIO, "no text files");
    put(ct_test_tmpdir(), "only.dat", "x");
    ASSERT_ERR(ct_text_load(ct_test_tmpdir(), &t), CT_EIO, "no text files");
    /* Out of memory: the whole corpus is one allocation. */
    put(ct_test_tmpdir(), "text", "hello world");
    ct_mem_fail_after(0);
    ct_status s = ct_text_load(ct_test_tmpdir(), &t);
    ct_mem_fail_after(-1);
    ASSERT(s == CT_ENOMEM);
    ASSERT(t.bytes == NULL);
    ASSERT_OK(ct_text_load(ct_test_tmpdir(), &t));
    ASSERT_EQ(t.n, 11);
    ct_text_fini(&t);
}

/* The fortunes package's corpus as the issue describes it (skipped when not installed). */
TEST(text_fortunes_corpus)
{
    if (access(CT_FORTUNES_DIR "/fortunes", R_OK) != 0) SKIP("the fortunes package is not installed (make installs it)");
    ct_text t;
    ASSERT_OK(ct_text_load(NULL, &t));
    ASSERT_EQ(t.nfiles, 43);
    ASSERT(t.n > 2500000 && t.n < 2650000); /* 2576674 bytes in Debian 12's fortunes-2.x */
    ASSERT_EQ(t.ntrain, t.n * 9 / 10);
    ASSERT_NEAR(ct_text_unigram_entropy(&t), 3.32, 0.005);
    ct_text_fini(&t);
}

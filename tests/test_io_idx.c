/* IDX data sets: round trips through gzip'd and plain files written here
 * with zlib, every malformed file, batches, and the real Fashion-MNIST. */
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "ctrain/io.h"
#include "test.h"

static const char *tmp_path(const char *name)
{
    static char buf[4][512];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 512, "%s/%s", ct_test_tmpdir(), name);
    return p;
}

/* An IDX file: magic 00 00 type ndim, big-endian dims, then data. */
static size_t idx_bytes(unsigned char *out, int type, int ndim, const uint32_t *dims,
                        const unsigned char *data, size_t ndata)
{
    size_t k = 0;
    out[k++] = 0; out[k++] = 0; out[k++] = (unsigned char)type; out[k++] = (unsigned char)ndim;
    for (int i = 0; i < ndim; i++)
        for (int s = 24; s >= 0; s -= 8) out[k++] = (unsigned char)(dims[i] >> s);
    if (ndata) memcpy(out + k, data, ndata);
    return k + ndata;
}

static void write_file(const char *path, const void *p, size_t n, int gz)
{
    if (gz) {
        gzFile f = gzopen(path, "wb");
        ASSERT(f);
        ASSERT_EQ(gzwrite(f, p, (unsigned)n), (int)n);
        ASSERT_EQ(gzclose(f), Z_OK);
    } else {
        FILE *f = fopen(path, "wb");
        ASSERT(f);
        ASSERT_EQ(fwrite(p, 1, n, f), n);
        fclose(f);
    }
}

enum { N = 7, R = 3, C = 4 };

typedef struct {
    unsigned char pix[N * R * C], lab[N];
    unsigned char img_file[16 + N * R * C], lab_file[8 + N];
    size_t img_len, lab_len;
} fixture;

static void make_fixture(fixture *fx)
{
    for (int i = 0; i < N * R * C; i++) fx->pix[i] = (unsigned char)(i * 37 % 256);
    fx->pix[0] = 0;
    fx->pix[1] = 255;
    for (int i = 0; i < N; i++) fx->lab[i] = (unsigned char)(i * 3 % 10);
    fx->img_len = idx_bytes(fx->img_file, 8, 3, (uint32_t[]){N, R, C}, fx->pix, sizeof fx->pix);
    fx->lab_len = idx_bytes(fx->lab_file, 8, 1, (uint32_t[]){N}, fx->lab, N);
}

static void check_loaded(const fixture *fx, const ct_dataset *ds, float mean, float std)
{
    ASSERT_EQ(ds->n, N);
    ASSERT_EQ(ds->rows, R);
    ASSERT_EQ(ds->cols, C);
    ASSERT_EQ(ds->nclasses, 10);
    ASSERT_EQ(ds->images->dtype, CT_F32);
    ASSERT_EQ(ds->images->ndim, 4);
    ASSERT_EQ(ds->images->shape[0], N);
    ASSERT_EQ(ds->images->shape[1], 1);
    ASSERT_EQ(ds->images->shape[2], R);
    ASSERT_EQ(ds->images->shape[3], C);
    ASSERT_EQ(ds->labels->dtype, CT_I32);
    for (int i = 0; i < N * R * C; i++)
        ASSERT_NEAR(ct_f32(ds->images)[i], (fx->pix[i] / 255.0 - mean) / std, 1e-5);
    for (int i = 0; i < N; i++) ASSERT_EQ(((int32_t *)ct_tensor_data(ds->labels))[i], fx->lab[i]);
}

TEST(idx_roundtrip_gzip_and_plain)
{
    fixture fx;
    make_fixture(&fx);
    for (int gz = 0; gz < 2; gz++) {
        const char *img = tmp_path(gz ? "img.gz" : "img"), *lab = tmp_path(gz ? "lab.gz" : "lab");
        write_file(img, fx.img_file, fx.img_len, gz);
        write_file(lab, fx.lab_file, fx.lab_len, gz);
        ct_dataset ds;
        ASSERT_OK(ct_idx_load(img, lab, 10, 0.5f, 0.25f, &ds));
        check_loaded(&fx, &ds, 0.5f, 0.25f);
        ASSERT_NEAR(ct_f32(ds.images)[1], (1.0 - 0.5) / 0.25, 1e-6);
        ASSERT_NEAR(ct_f32(ds.images)[0], -2.0, 1e-6);
        ct_dataset_fini(&ds);
        ASSERT(ds.images == NULL);
        ct_dataset_fini(&ds); /* twice is safe */
    }
}

TEST(idx_gather_makes_batches)
{
    fixture fx;
    make_fixture(&fx);
    const char *img = tmp_path("g_img.gz"), *lab = tmp_path("g_lab.gz");
    write_file(img, fx.img_file, fx.img_len, 1);
    write_file(lab, fx.lab_file, fx.lab_len, 1);
    ct_dataset ds;
    ASSERT_OK(ct_idx_load(img, lab, 10, 0.0f, 1.0f, &ds));
    int64_t idx[3] = {6, 0, 6};
    ct_tensor *x, *y;
    size_t act0 = ct_mem_current(CT_MEM_ACT);
    ASSERT_OK(ct_dataset_gather(&ds, idx, 3, &x, &y));
    ASSERT(ct_mem_current(CT_MEM_ACT) >= act0 + 3 * R * C * 4 + 3 * 4);
    ASSERT_EQ(x->ndim, 4);
    ASSERT_EQ(x->shape[0], 3);
    ASSERT_EQ(x->shape[1], 1);
    ASSERT_EQ(x->shape[2], R);
    ASSERT_EQ(x->shape[3], C);
    ASSERT_EQ(y->dtype, CT_I32);
    ASSERT_EQ(y->shape[0], 3);
    for (int b = 0; b < 3; b++) {
        for (int p = 0; p < R * C; p++)
            ASSERT_NEAR(ct_f32(x)[b * R * C + p], fx.pix[idx[b] * R * C + p] / 255.0, 1e-6);
        ASSERT_EQ(((int32_t *)ct_tensor_data(y))[b], fx.lab[idx[b]]);
    }
    ct_tensor_release(x);
    ct_tensor_release(y);
    ASSERT_EQ(ct_mem_current(CT_MEM_ACT), act0);
    ASSERT_ERR(ct_dataset_gather(&ds, (int64_t[]){0, 7}, 2, &x, &y), CT_EINVAL,
               "sample index 7 (position 1 of the batch) is outside the data set of 7 samples");
    ASSERT(x == NULL && y == NULL);
    ct_dataset_fini(&ds);
}

/* Loads img/lab (written from the given bytes) and expects a failure naming
 * the bad file. */
static void expect_fail(const void *img, size_t ni, int gzi, const void *lab, size_t nl, int gzl,
                        ct_status code, const char *msg, int bad_is_labels)
{
    const char *ip = tmp_path("bad_img"), *lp = tmp_path("bad_lab");
    write_file(ip, img, ni, gzi);
    write_file(lp, lab, nl, gzl);
    ct_dataset ds;
    memset(&ds, 0x5a, sizeof ds);
    ASSERT_ERR(ct_idx_load(ip, lp, 10, 0.0f, 1.0f, &ds), code, msg);
    ASSERT_STR_CONTAINS(ct_last_error(), bad_is_labels ? lp : ip);
    ASSERT(ds.images == NULL && ds.labels == NULL && ds.n == 0);
}

TEST(idx_rejects_malformed_files)
{
    fixture fx;
    make_fixture(&fx);
    unsigned char b[512];
    size_t n;
    size_t base = ct_mem_current(CT_MEM_OTHER) + ct_mem_current(CT_MEM_DATA);

    /* Bad magic: a zip file, and a gzip file wrapped twice. */
    expect_fail("PK\x03\x04 not idx at all", 20, 1, fx.lab_file, fx.lab_len, 1, CT_EFORMAT,
                "not an IDX file: bad magic 50 4b 03 04", 0);
    const char *once = tmp_path("once.gz");
    write_file(once, fx.lab_file, fx.lab_len, 1);
    FILE *f = fopen(once, "rb");
    n = fread(b, 1, sizeof b, f);
    fclose(f);
    expect_fail(fx.img_file, fx.img_len, 1, b, n, 1, CT_EFORMAT, "bad magic 1f 8b", 1);
    /* Element type other than u8. */
    n = idx_bytes(b, 0x0D, 3, (uint32_t[]){N, R, C}, fx.pix, sizeof fx.pix);
    expect_fail(b, n, 1, fx.lab_file, fx.lab_len, 1, CT_EFORMAT, "element type 0x0d is not supported", 0);
    /* Wrong dims: labels given as images and the reverse. */
    expect_fail(fx.lab_file, fx.lab_len, 1, fx.lab_file, fx.lab_len, 1, CT_EFORMAT,
                "IDX file has 1 dims; a image file has 3", 0);
    expect_fail(fx.img_file, fx.img_len, 1, fx.img_file, fx.img_len, 1, CT_EFORMAT,
                "IDX file has 3 dims; a label file has 1", 1);
    /* Empty images. */
    n = idx_bytes(b, 8, 3, (uint32_t[]){N, 0, C}, NULL, 0);
    expect_fail(b, n, 1, fx.lab_file, fx.lab_len, 1, CT_EFORMAT, "the data set is empty", 0);
    /* Image count differs from label count. */
    n = idx_bytes(b, 8, 1, (uint32_t[]){N - 1}, fx.lab, N - 1);
    expect_fail(fx.img_file, fx.img_len, 1, b, n, 1, CT_EFORMAT, "has 7 images but", 0);
    ASSERT_STR_CONTAINS(ct_last_error(), "has 6 labels; the files do not belong together");
    /* Truncated: header cut, pixels cut, labels cut; gzip'd and plain. */
    for (int gz = 0; gz < 2; gz++) {
        expect_fail(fx.img_file, 10, gz, fx.lab_file, fx.lab_len, gz, CT_EFORMAT,
                    "truncated: the data ends after 10 bytes, inside the IDX header", 0);
        expect_fail(fx.img_file, fx.img_len - 5, gz, fx.lab_file, fx.lab_len, gz, CT_EFORMAT,
                    "truncated: the data ends after 95 bytes, inside the pixel data (84 bytes expected)", 0);
        expect_fail(fx.img_file, fx.img_len, gz, fx.lab_file, fx.lab_len - 1, gz, CT_EFORMAT,
                    "inside the labels", 1);
        expect_fail("", 0, gz, fx.lab_file, fx.lab_len, gz, CT_EFORMAT, "ends after 0 bytes", 0);
    }
    /* Label out of range. */
    memcpy(b, fx.lab_file, fx.lab_len);
    b[8 + 4] = 10;
    expect_fail(fx.img_file, fx.img_len, 1, b, fx.lab_len, 1, CT_EFORMAT,
                "label 10 at index 4 is out of range: the data set has 10 classes", 1);
    /* A header claiming far more data than the file can hold is refused before allocating. */
    n = idx_bytes(b, 8, 3, (uint32_t[]){4000000000u, 1000, 1000}, NULL, 0);
    unsigned char lab_big[8];
    idx_bytes(lab_big, 8, 1, (uint32_t[]){4000000000u}, NULL, 0);
    expect_fail(b, n, 1, lab_big, 8, 1, CT_EFORMAT, "header claims", 0);
    /* Missing file. */
    ct_dataset ds;
    ASSERT_ERR(ct_idx_load(tmp_path("nope.gz"), tmp_path("nope2.gz"), 10, 0, 1, &ds), CT_EIO, "nope.gz: cannot open");
    ASSERT_ERR(ct_idx_load(tmp_path("a"), tmp_path("b"), 10, 0, 0, &ds), CT_EINVAL, "std is 0");
    ASSERT_EQ(ct_mem_current(CT_MEM_OTHER) + ct_mem_current(CT_MEM_DATA), base);
}

/* A damaged gzip stream: an error or (if the damage misses) a load, never a crash. */
TEST(idx_corrupt_gzip)
{
    fixture fx;
    make_fixture(&fx);
    const char *ip = tmp_path("cz_img.gz"), *lp = tmp_path("cz_lab.gz");
    write_file(ip, fx.img_file, fx.img_len, 1);
    write_file(lp, fx.lab_file, fx.lab_len, 1);
    FILE *f = fopen(ip, "rb");
    unsigned char gzb[1024];
    size_t n = fread(gzb, 1, sizeof gzb, f);
    fclose(f);
    /* Garbage in the deflate stream itself. */
    unsigned char bad[1024];
    memcpy(bad, gzb, n);
    for (size_t i = 12; i < n - 8; i++) bad[i] = 0xff;
    f = fopen(ip, "wb");
    fwrite(bad, 1, n, f);
    fclose(f);
    ct_dataset ds;
    ASSERT_ERR(ct_idx_load(ip, lp, 10, 0, 1, &ds), CT_EFORMAT, "corrupt gzip data");
    ASSERT_STR_CONTAINS(ct_last_error(), ip);

    /* Deterministic mutations of the compressed bytes. */
    uint64_t seed = 7;
    size_t base = ct_mem_current(CT_MEM_OTHER) + ct_mem_current(CT_MEM_DATA);
    int failed = 0;
    for (int it = 0; it < 200; it++) {
        memcpy(bad, gzb, n);
        size_t len = n;
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        if (it % 4 == 3) len = (size_t)(seed >> 33) % n;
        else bad[(seed >> 33) % n] ^= (unsigned char)(1u << ((seed >> 20) % 8));
        f = fopen(ip, "wb");
        fwrite(bad, 1, len, f);
        fclose(f);
        ct_status s = ct_idx_load(ip, lp, 10, 0, 1, &ds);
        if (s == CT_OK) ct_dataset_fini(&ds);
        else {
            failed++;
            ASSERT_EQ(s, CT_EFORMAT);
            ASSERT_STR_CONTAINS(ct_last_error(), ip);
        }
        ASSERT_EQ(ct_mem_current(CT_MEM_OTHER) + ct_mem_current(CT_MEM_DATA), base);
    }
    ASSERT(failed > 50);
}

TEST(idx_fashion_mnist_missing_dir)
{
    ct_dataset ds;
    ASSERT_ERR(ct_fashion_mnist_load("/nonexistent/fmnist", 1, &ds), CT_EIO, "install the Debian package dataset-fashion-mnist");
    ASSERT_STR_CONTAINS(ct_last_error(), "--data-dir");
    ASSERT_STR_CONTAINS(ct_last_error(), "/nonexistent/fmnist");
    /* Directory present, files absent. */
    ASSERT_ERR(ct_fashion_mnist_load(ct_test_tmpdir(), 0, &ds), CT_EIO, "t10k-images-idx3-ubyte.gz is missing");
    ASSERT_STR_CONTAINS(ct_last_error(), "dataset-fashion-mnist");
    ASSERT(!strcmp(ct_fashion_mnist_class(9), "Ankle boot"));
    ASSERT(!strcmp(ct_fashion_mnist_class(10), "?"));
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

TEST(idx_fashion_mnist_real)
{
    char path[512];
    snprintf(path, sizeof path, "%s/t10k-images-idx3-ubyte.gz", CT_FASHION_MNIST_DIR);
    if (access(path, R_OK) != 0) {
        SKIP("%s absent (Debian package dataset-fashion-mnist)", path);
    }
    ct_dataset ds;
    ASSERT_OK(ct_fashion_mnist_load(NULL, 0, &ds));
    ASSERT_EQ(ds.n, 10000);
    ASSERT_EQ(ds.rows, 28);
    ASSERT_EQ(ds.cols, 28);
    int hist[10] = {0};
    for (int64_t i = 0; i < ds.n; i++) hist[((int32_t *)ct_tensor_data(ds.labels))[i]]++;
    for (int c = 0; c < 10; c++) ASSERT_EQ(hist[c], 1000);
    double sum = 0, sq = 0;
    const float *x = ct_f32(ds.images);
    for (int64_t i = 0; i < ds.images->numel; i++) { sum += x[i]; sq += (double)x[i] * x[i]; }
    double mean = sum / (double)ds.images->numel, sd = sqrt(sq / (double)ds.images->numel - mean * mean);
    printf("    t10k: mean %.4f std %.4f after normalisation\n", mean, sd);
    ASSERT_NEAR(mean, 0.0, 0.01);
    ASSERT_NEAR(sd, 1.0, 0.01);
    ct_dataset_fini(&ds);

    /* The training set: 60000 images (the time is printed, not asserted: speed is a benchmark's job). */
    double t0 = now();
    ASSERT_OK(ct_fashion_mnist_load(NULL, 1, &ds));
    double dt = now() - t0;
    printf("    train: %lld images in %.2fs\n", (long long)ds.n, dt);
    ASSERT_EQ(ds.n, 60000);
    sum = 0;
    x = ct_f32(ds.images);
    for (int64_t i = 0; i < ds.images->numel; i++) sum += x[i];
    ASSERT_NEAR(sum / (double)ds.images->numel, 0.0, 0.002); /* mean and std come from this set */
    ct_dataset_fini(&ds);
}

/* Issue 13, failure 5: dimensions of 2^32-1 made rows * cols overflow (a
 * signed overflow UBSan flags; a fuzzer found it) and the message did not
 * name the file.  Every large shape is an error naming the image file. */
TEST(idx_huge_dimensions_do_not_overflow)
{
    static const uint32_t shapes[][3] = {
        {1, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu, 0xffffffffu}, {2, 0x80000000u, 0x80000000u},
        {0xffffffffu, 1, 0xffffffffu}, {3, 0x10000u, 0x10000u}};
    unsigned char img[64], lab[64];
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        size_t ni = idx_bytes(img, 0x08, 3, shapes[i], (const unsigned char *)"\1\2\3\4", 4);
        size_t nl = idx_bytes(lab, 0x08, 1, &shapes[i][0], (const unsigned char *)"\1\2\3", 3);
        expect_fail(img, ni, 0, lab, nl, 0, CT_EFORMAT, "", 0);
    }
}

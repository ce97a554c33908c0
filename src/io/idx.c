/*
 * IDX image data sets (the MNIST family's format): a 4-byte magic
 * 00 00 <type> <ndim>, ndim big-endian u32 dims, then the elements.  Files
 * are read through zlib, which reads plain files transparently, in large
 * chunks; pixels are normalised through a 256-entry table.  Also owns
 * Fashion-MNIST's location and statistics, and making a batch from indices.
 */
#include "ctrain/io.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#define CHUNK (1 << 20)
/* Deflate cannot expand data by more than about 1032:1, so a header that
 * claims more than this many bytes per byte on disk is corrupt. */
#define MAX_RATIO 1100

typedef struct {
    gzFile gz;
    const char *path;
    int64_t dims[3];
    int64_t file_bytes; /* size on disk */
    int64_t pos;        /* uncompressed bytes read so far */
} idx_file;

/* Reads exactly n bytes; what names them in messages ("the pixel data"). */
static ct_status read_exact(idx_file *f, void *buf, int64_t n, const char *what)
{
    int64_t got = 0;
    while (got < n) {
        unsigned want = (unsigned)(n - got > (1 << 30) ? (1 << 30) : n - got);
        int r = gzread(f->gz, (char *)buf + got, want);
        if (r < 0 || (r == 0 && !gzeof(f->gz))) {
            int zerr;
            const char *msg = gzerror(f->gz, &zerr);
            if (zerr == Z_ERRNO)
                return ct_error(CT_EIO, "%s: read error in %s: %s", f->path, what, strerror(errno));
            return ct_error(CT_EFORMAT, "%s: corrupt gzip data in %s (%s); download the file again",
                            f->path, what, msg);
        }
        if (r == 0) break;
        got += r;
    }
    f->pos += got;
    if (got < n) {
        int zerr;
        const char *msg = gzerror(f->gz, &zerr);
        return ct_error(CT_EFORMAT, "%s: truncated: the data ends after %lld bytes, inside %s%s%s%s; "
                        "download the file again", f->path, (long long)f->pos, what,
                        zerr != Z_OK ? " (gzip: " : "", zerr != Z_OK ? msg : "", zerr != Z_OK ? ")" : "");
    }
    return CT_OK;
}

/* Opens path and reads its header; kind is "image" (3 dims) or "label" (1 dim). */
static ct_status idx_open(idx_file *f, const char *path, int ndim, const char *kind)
{
    memset(f, 0, sizeof *f);
    f->path = path;
    struct stat sb;
    if (stat(path, &sb) != 0) return ct_error(CT_EIO, "%s: cannot open: %s", path, strerror(errno));
    f->file_bytes = (int64_t)sb.st_size;
    errno = 0;
    f->gz = gzopen(path, "rb");
    if (!f->gz)
        return ct_error(CT_EIO, "%s: cannot open: %s", path, errno ? strerror(errno) : "out of memory");
    gzbuffer(f->gz, 1 << 18);
    unsigned char h[16];
    CT_TRY(read_exact(f, h, 4, "the IDX header"));
    if (h[0] || h[1])
        return ct_error(CT_EFORMAT,
                        "%s: not an IDX file: bad magic %02x %02x %02x %02x (an IDX %s file starts "
                        "00 00 08 %02x)", path, h[0], h[1], h[2], h[3], kind, ndim);
    if (h[2] != 0x08)
        return ct_error(CT_EFORMAT, "%s: IDX element type 0x%02x is not supported (only unsigned bytes, 0x08)",
                        path, h[2]);
    if (h[3] != ndim)
        return ct_error(CT_EFORMAT, "%s: IDX file has %d dims; a %s file has %d", path, h[3], kind, ndim);
    CT_TRY(read_exact(f, h, 4 * ndim, "the IDX header"));
    for (int i = 0; i < ndim; i++)
        f->dims[i] = (int64_t)h[4 * i] << 24 | h[4 * i + 1] << 16 | h[4 * i + 2] << 8 | h[4 * i + 3];
    return CT_OK;
}

static void idx_close(idx_file *f)
{
    if (f->gz) gzclose_r(f->gz);
    f->gz = NULL;
}

/* Rejects headers that claim more data than the file can hold. */
static ct_status check_claim(const idx_file *f, int64_t bytes, const char *what)
{
    if (bytes / MAX_RATIO > f->file_bytes)
        return ct_error(CT_EFORMAT, "%s: header claims %lld bytes of %s but the file is only %lld bytes; "
                        "the header is corrupt", f->path, (long long)bytes, what, (long long)f->file_bytes);
    return CT_OK;
}

static ct_status read_pixels(idx_file *f, float *out, int64_t total, float mean, float std)
{
    float lut[256];
    for (int v = 0; v < 256; v++) lut[v] = ((float)v / 255.0f - mean) / std;
    unsigned char *buf = ct_alloc_zeroed(CHUNK, CT_MEM_OTHER);
    if (!buf) return CT_ENOMEM;
    char what[96];
    snprintf(what, sizeof what, "the pixel data (%lld bytes expected)", (long long)total);
    ct_status s = CT_OK;
    for (int64_t at = 0; at < total && s == CT_OK; at += CHUNK) {
        int64_t n = total - at < CHUNK ? total - at : CHUNK;
        s = read_exact(f, buf, n, what);
        if (s == CT_OK)
            for (int64_t i = 0; i < n; i++) out[at + i] = lut[buf[i]];
    }
    ct_free(buf);
    return s;
}

static ct_status read_labels(idx_file *f, int32_t *out, int64_t n, int nclasses)
{
    unsigned char *buf = ct_alloc_zeroed((size_t)n, CT_MEM_OTHER);
    if (!buf) return CT_ENOMEM;
    ct_status s = read_exact(f, buf, n, "the labels");
    for (int64_t i = 0; s == CT_OK && i < n; i++) {
        if (buf[i] >= nclasses)
            s = ct_error(CT_EFORMAT, "%s: label %d at index %lld is out of range: the data set has %d classes",
                         f->path, buf[i], (long long)i, nclasses);
        out[i] = buf[i];
    }
    ct_free(buf);
    return s;
}

ct_status ct_idx_load(const char *images_path, const char *labels_path, int nclasses,
                      float mean, float std, ct_dataset *out)
{
    CT_ASSERT(images_path && labels_path && out);
    memset(out, 0, sizeof *out);
    if (nclasses < 1 || nclasses > 256)
        return ct_error(CT_EINVAL, "nclasses is %d; IDX labels are bytes, so it must be in [1, 256]", nclasses);
    if (!(std > 0.0f))
        return ct_error(CT_EINVAL, "normalisation std is %g; it must be positive", (double)std);
    idx_file fi, fl;
    memset(&fl, 0, sizeof fl);
    ct_status s = idx_open(&fi, images_path, 3, "image");
    if (s == CT_OK) s = idx_open(&fl, labels_path, 1, "label");
    if (s != CT_OK) goto out_close;

    int64_t n = fi.dims[0], rows = fi.dims[1], cols = fi.dims[2];
    if (n != fl.dims[0]) {
        s = ct_error(CT_EFORMAT, "%s has %lld images but %s has %lld labels; the files do not belong together",
                     images_path, (long long)n, labels_path, (long long)fl.dims[0]);
        goto out_close;
    }
    if (n == 0 || rows == 0 || cols == 0) {
        s = ct_error(CT_EFORMAT, "%s: holds %lld images of %lldx%lld pixels; the data set is empty",
                     images_path, (long long)n, (long long)rows, (long long)cols);
        goto out_close;
    }
    /* Each dim is below 2^32, but rows*cols need not fit in int64: divide, never multiply, to bound it. */
    if (rows > INT64_MAX / 4 / n / cols) {
        s = ct_error(CT_EFORMAT, "%s: header claims %lld images of %lldx%lld pixels, too many to address",
                     images_path, (long long)n, (long long)rows, (long long)cols);
        goto out_close;
    }
    int64_t total = n * rows * cols;
    if ((s = check_claim(&fi, total, "pixels")) != CT_OK) goto out_close;
    if ((s = check_claim(&fl, n, "labels")) != CT_OK) goto out_close;

    out->images = ct_tensor_create4(n, 1, rows, cols, CT_MEM_DATA);
    out->labels = ct_tensor_create(CT_I32, 1, &n, CT_MEM_DATA);
    if (!out->images || !out->labels) { s = CT_ENOMEM; goto out_close; }
    if ((s = read_pixels(&fi, ct_f32(out->images), total, mean, std)) != CT_OK) goto out_close;
    if ((s = read_labels(&fl, ct_tensor_data(out->labels), n, nclasses)) != CT_OK) goto out_close;
    out->n = n;
    out->rows = rows;
    out->cols = cols;
    out->nclasses = nclasses;
out_close:
    idx_close(&fi);
    idx_close(&fl);
    if (s != CT_OK) ct_dataset_fini(out);
    return s;
}

/* ---- Fashion-MNIST ----------------------------------------------------- */

/* Finds dir/base.gz or the unpacked dir/base. */
static ct_status find_file(const char *dir, const char *base, char *out, size_t n)
{
    struct stat sb;
    snprintf(out, n, "%s/%s.gz", dir, base);
    if (stat(out, &sb) == 0) return CT_OK;
    snprintf(out, n, "%s/%s", dir, base);
    if (stat(out, &sb) == 0) return CT_OK;
    return ct_error(CT_EIO, "Fashion-MNIST file %s/%s.gz is missing; install the Debian package "
                    "dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass --data-dir DIR",
                    dir, base);
}

ct_status ct_fashion_mnist_load(const char *dir, int train, ct_dataset *out)
{
    CT_ASSERT(out);
    memset(out, 0, sizeof *out);
    if (!dir) dir = CT_FASHION_MNIST_DIR;
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return ct_error(CT_EIO, "Fashion-MNIST not found: %s is not a directory; install the Debian package "
                        "dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass --data-dir DIR",
                        dir);
    const char *split = train ? "train" : "t10k";
    char base[64], img[4096], lab[4096];
    snprintf(base, sizeof base, "%s-images-idx3-ubyte", split);
    CT_TRY(find_file(dir, base, img, sizeof img));
    snprintf(base, sizeof base, "%s-labels-idx1-ubyte", split);
    CT_TRY(find_file(dir, base, lab, sizeof lab));
    CT_TRY(ct_idx_load(img, lab, 10, CT_FASHION_MNIST_MEAN, CT_FASHION_MNIST_STD, out));
    if (out->rows != 28 || out->cols != 28) {
        ct_status s = ct_error(CT_EFORMAT, "%s: Fashion-MNIST images are 28x28 but this file holds %lldx%lld",
                               img, (long long)out->rows, (long long)out->cols);
        ct_dataset_fini(out);
        return s;
    }
    return CT_OK;
}

const char *ct_fashion_mnist_class(int label)
{
    static const char *names[] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                  "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};
    return label >= 0 && label < 10 ? names[label] : "?";
}

void ct_dataset_fini(ct_dataset *d)
{
    if (!d) return;
    ct_tensor_release(d->images);
    ct_tensor_release(d->labels);
    memset(d, 0, sizeof *d);
}

ct_status ct_dataset_gather(const ct_dataset *ds, const int64_t *idx, int64_t count,
                            ct_tensor **x, ct_tensor **y)
{
    CT_ASSERT(ds && x && y && count >= 0 && (idx || count == 0));
    *x = *y = NULL;
    if (!ds->images || !ds->labels) return ct_error(CT_ESTATE, "data set is not loaded");
    for (int64_t i = 0; i < count; i++)
        if (idx[i] < 0 || idx[i] >= ds->n)
            return ct_error(CT_EINVAL, "sample index %lld (position %lld of the batch) is outside the data set "
                            "of %lld samples", (long long)idx[i], (long long)i, (long long)ds->n);
    ct_tensor *tx = ct_tensor_create4(count, 1, ds->rows, ds->cols, CT_MEM_ACT);
    ct_tensor *ty = ct_tensor_create(CT_I32, 1, &count, CT_MEM_ACT);
    if (!tx || !ty) {
        ct_tensor_release(tx);
        ct_tensor_release(ty);
        return CT_ENOMEM;
    }
    size_t per = (size_t)(ds->rows * ds->cols);
    const float *src = ct_f32(ds->images);
    const int32_t *lab = ct_tensor_data(ds->labels);
    float *dx = ct_f32(tx);
    int32_t *dy = ct_tensor_data(ty);
    for (int64_t i = 0; i < count; i++) {
        memcpy(dx + (size_t)i * per, src + (size_t)idx[i] * per, per * sizeof(float));
        dy[i] = lab[idx[i]];
    }
    *x = tx;
    *y = ty;
    return CT_OK;
}

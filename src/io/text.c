/*
 * Byte-level text corpora: a folder of text files read as one byte string
 * (a byte is a token, vocabulary 256, so any program tokenises it the same
 * way), split 90/10 into training and validation, with the windows training
 * and evaluation take from it.
 *
 * Which files: the regular files of the folder (symbolic links and
 * subfolders skipped; so are hidden files, and the fortune program's
 * ".dat" indexes and ".u8" names), concatenated in sorted name order (byte
 * order, strcmp).  For the fortunes package that is its 43 cookie files,
 * 2.58 MB.  The split is at floor(0.9 * bytes).
 *
 * Training windows: sample gidx of step `step` (gidx its place in the global
 * batch) starts at a uniform position of [0, ntrain - context - 1] drawn from
 * Philox keyed by the seed at counter (step, gidx): the same windows for
 * any number of ranks and micro-batches, and again after a restart.
 * Validation windows: consecutive, non-overlapping, of context + 1 bytes
 * from the split's start; a last partial window is dropped.
 */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "internal.h"

static int ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static ct_status not_found(const char *dir, const char *why)
{
    if (!strcmp(dir, CT_FORTUNES_DIR))
        return ct_error(CT_EIO, "the fortunes corpus is not there (%s: %s); install the Debian package fortunes "
                        "(apt-get install fortunes; make does it through scripts/deps.sh) or pass --data-dir DIR "
                        "with text files", dir, why);
    return ct_error(CT_EIO, "text data folder %s: %s; pass --data-dir a folder of text files", dir, why);
}

/* The names of the corpus's files in dir, sorted; *n of them. */
static ct_status list_files(const char *dir, char ***names, int *n)
{
    DIR *d = opendir(dir);
    if (!d) return not_found(dir, strerror(errno));
    char **v = NULL;
    int cnt = 0, cap = 0;
    ct_status st = CT_OK;
    struct dirent *e;
    while (st == CT_OK && (e = readdir(d))) {
        const char *nm = e->d_name;
        if (nm[0] == '.' || ends_with(nm, ".dat") || ends_with(nm, ".u8")) continue;
        char path[4096];
        struct stat sb;
        if (snprintf(path, sizeof path, "%s/%s", dir, nm) >= (int)sizeof path) continue;
        if (lstat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
        if (cnt == cap) {
            int c = cap ? 2 * cap : 64;
            char **w = ct_alloc(sizeof *w * (size_t)c, CT_MEM_OTHER);
            if (!w) {
                st = CT_ENOMEM;
                break;
            }
            if (cnt) memcpy(w, v, sizeof *w * (size_t)cnt);
            ct_free(v);
            v = w;
            cap = c;
        }
        size_t len = strlen(nm) + 1;
        if (!(v[cnt] = ct_alloc(len, CT_MEM_OTHER))) {
            st = CT_ENOMEM;
            break;
        }
        memcpy(v[cnt++], nm, len);
    }
    closedir(d);
    if (st == CT_OK && cnt == 0) st = not_found(dir, "no text files in it");
    if (st != CT_OK) {
        for (int i = 0; i < cnt; i++) ct_free(v[i]);
        ct_free(v);
        return st;
    }
    qsort(v, (size_t)cnt, sizeof *v, cmp_str);
    *names = v;
    *n = cnt;
    return CT_OK;
}

ct_status ct_text_load(const char *dir, ct_text *out)
{
    CT_ASSERT(out);
    memset(out, 0, sizeof *out);
    if (!dir) dir = CT_FORTUNES_DIR;
    char **names = NULL;
    int n = 0;
    CT_TRY(list_files(dir, &names, &n));
    ct_status st = CT_OK;
    int64_t total = 0;
    char path[4096];
    for (int i = 0; i < n && st == CT_OK; i++) {
        struct stat sb;
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        if (stat(path, &sb) != 0) st = ct_error(CT_EIO, "cannot read %s: %s", path, strerror(errno));
        else total += sb.st_size;
    }
    if (st == CT_OK && !(out->bytes = ct_alloc(total ? (size_t)total : 1, CT_MEM_DATA))) st = CT_ENOMEM;
    int64_t off = 0;
    for (int i = 0; i < n && st == CT_OK; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        FILE *f = fopen(path, "rb");
        if (!f) {
            st = ct_error(CT_EIO, "cannot open %s: %s", path, strerror(errno));
            break;
        }
        size_t got;
        while (off < total && (got = fread(out->bytes + off, 1, (size_t)(total - off), f)) > 0) off += (int64_t)got;
        /* A file that grew since it was measured is read up to its measured size. */
        if (ferror(f)) st = ct_error(CT_EIO, "reading %s failed", path);
        fclose(f);
    }
    for (int i = 0; i < n; i++) ct_free(names[i]);
    ct_free(names);
    if (st == CT_OK && off != total)
        st = ct_error(CT_EIO, "the text files in %s changed while they were read (%lld of %lld bytes); try again",
                      dir, (long long)off, (long long)total);
    if (st != CT_OK) {
        ct_text_fini(out);
        return st;
    }
    out->n = total;
    out->ntrain = total / 10 * 9 + total % 10 * 9 / 10; /* floor(0.9 total), exactly */
    out->nfiles = n;
    return CT_OK;
}

void ct_text_fini(ct_text *t)
{
    if (!t) return;
    ct_free(t->bytes);
    memset(t, 0, sizeof *t);
}

ct_status ct_text_check(const ct_text *t, int64_t context)
{
    if (context < 1) return ct_error(CT_EINVAL, "a context of %lld tokens; it must be at least 1", (long long)context);
    if (t->ntrain < context + 1 || t->n - t->ntrain < context + 1)
        return ct_error(CT_EINVAL, "the text has %lld training and %lld validation bytes; each needs at least one "
                        "window of context + 1 = %lld bytes: lower --context or give more text",
                        (long long)t->ntrain, (long long)(t->n - t->ntrain), (long long)(context + 1));
    return CT_OK;
}

int64_t ct_text_train_start(const ct_text *t, int64_t context, uint64_t seed, uint64_t step, int64_t gidx)
{
    uint32_t ctr[4] = {(uint32_t)step, (uint32_t)(step >> 32), (uint32_t)gidx, (uint32_t)((uint64_t)gidx >> 32)};
    uint32_t r[4];
    ct_philox4x32(seed ^ 0x74657874ull /* "text" */, ctr, r);
    uint64_t u = ((uint64_t)r[0] << 32) | r[1];
    uint64_t span = (uint64_t)(t->ntrain - context); /* starts 0 .. ntrain - context - 1 */
    return (int64_t)(u % span);
}

int64_t ct_text_val_windows(const ct_text *t, int64_t context)
{
    return (t->n - t->ntrain) / (context + 1);
}

static ct_status windows(const ct_text *t, int64_t context, int64_t count, const int64_t *starts, ct_tensor **x,
                         ct_tensor **y)
{
    int64_t sh[2] = {count, context};
    *x = ct_tensor_empty(CT_I64, 2, sh, CT_MEM_ACT);
    *y = ct_tensor_empty(CT_I64, 2, sh, CT_MEM_ACT);
    if (!*x || !*y) {
        ct_tensor_release(*x);
        ct_tensor_release(*y);
        *x = *y = NULL;
        return CT_ENOMEM;
    }
    int64_t *xd = ct_tensor_data(*x), *yd = ct_tensor_data(*y);
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *w = t->bytes + starts[i];
        for (int64_t j = 0; j < context; j++) {
            xd[i * context + j] = w[j];
            yd[i * context + j] = w[j + 1];
        }
    }
    return CT_OK;
}

ct_status ct_text_train_batch(const ct_text *t, int64_t context, uint64_t seed, uint64_t step, int64_t gidx0,
                              int64_t count, ct_tensor **x, ct_tensor **y)
{
    *x = *y = NULL;
    CT_TRY(ct_text_check(t, context));
    int64_t *st = ct_alloc(sizeof *st * (size_t)(count > 0 ? count : 1), CT_MEM_OTHER);
    if (!st) return CT_ENOMEM;
    for (int64_t i = 0; i < count; i++) st[i] = ct_text_train_start(t, context, seed, step, gidx0 + i);
    ct_status s = windows(t, context, count, st, x, y);
    ct_free(st);
    return s;
}

ct_status ct_text_val_batch(const ct_text *t, int64_t context, int64_t w0, int64_t count, ct_tensor **x,
                            ct_tensor **y)
{
    *x = *y = NULL;
    CT_TRY(ct_text_check(t, context));
    if (w0 < 0 || count < 0 || w0 + count > ct_text_val_windows(t, context))
        return ct_error(CT_EINVAL, "validation windows %lld..%lld: the split has %lld of %lld bytes", (long long)w0,
                        (long long)(w0 + count), (long long)ct_text_val_windows(t, context), (long long)(context + 1));
    int64_t *st = ct_alloc(sizeof *st * (size_t)(count > 0 ? count : 1), CT_MEM_OTHER);
    if (!st) return CT_ENOMEM;
    for (int64_t i = 0; i < count; i++) st[i] = t->ntrain + (w0 + i) * (context + 1);
    ct_status s = windows(t, context, count, st, x, y);
    ct_free(st);
    return s;
}

double ct_text_unigram_entropy(const ct_text *t)
{
    int64_t c[256] = {0};
    for (int64_t i = 0; i < t->n; i++) c[t->bytes[i]]++;
    double h = 0;
    for (int k = 0; k < 256; k++)
        if (c[k]) {
            double p = (double)c[k] / (double)t->n;
            h -= p * log(p);
        }
    return h;
}

/*
 * Sharded checkpoints in Hugging Face's layout: safetensors files side by
 * side plus an index "<prefix>.safetensors.index.json",
 *
 *   {"metadata": {"total_size": "940584", ...}, "weight_map": {"0.weight": "model-00000-of-00002.safetensors", ...}}
 *
 * The writer replaces the index atomically (atomic.c).  The reader trusts
 * neither the index nor the shards: every tensor the index lists must be in
 * the file it names, every tensor of a listed file must be listed under
 * that file, and a file name may not leave the index's directory.  The
 * result is one ct_safetensors (tensors sorted by name across files,
 * metadata from the index), so callers cannot tell a sharded checkpoint
 * from a single file.
 */
#include "internal.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define INDEX_EXT ".safetensors.index.json"
#define DEFAULT_INDEX "model" INDEX_EXT
#define MAX_INDEX (100u << 20) /* as for a safetensors header: bigger is corrupt */
#define HINT_CORRUPT "the index is corrupt: save the checkpoint again"
#define HINT_MIXED "the index and its shards are from different saves: save the checkpoint again"

int ct__st_is_index(const char *path)
{
    size_t n = strlen(path), e = sizeof INDEX_EXT - 1;
    return n >= e && !strcmp(path + n - e, INDEX_EXT);
}

/* Why a shard's file name is unsafe, or NULL.  Shards sit beside their
 * index: a bare file name, never a path, so an index cannot make a loader
 * read (or a writer point) outside its directory. */
static const char *bad_file_name(const char *f, size_t len)
{
    if (len == 0) return "is empty";
    if (strlen(f) != len) return "contains a NUL character";
    if (strchr(f, '/') || strchr(f, '\\')) return "contains a path separator";
    if (strstr(f, "..")) return "contains '..'";
    if (!strcmp(f, ".")) return "names a directory";
    return NULL;
}

/* ---- writing ------------------------------------------------------------ */

typedef struct {
    const char *name, *file;
    int part; /* reading: which shard holds it */
} wentry;

typedef struct {
    const char *key, *val;
} kv;

static int cmp_wentry_name(const void *a, const void *b)
{
    return strcmp(((const wentry *)a)->name, ((const wentry *)b)->name);
}

static int cmp_kv(const void *a, const void *b) { return strcmp(((const kv *)a)->key, ((const kv *)b)->key); }

static ct_status check_text(const char *path, const char *what, const char *s)
{
    if (ct__utf8_check(s, strlen(s)) != strlen(s))
        return ct_error(CT_EINVAL, "%s: %s '%s' is not valid UTF-8; an index is JSON text", path, what, s);
    return CT_OK;
}

static ct_status prepare_index(const char *path, const char *const *names, const char *const *files, int n,
                               const char *const *mk, const char *const *mv, int nmeta, wentry *ws, kv *ms)
{
    size_t pl = strlen(path), sl = sizeof ".staged" - 1;
    char unstaged[4096];
    /* A staged index (ct_ckpt_staged_path) is checked by the name it will commit to. */
    snprintf(unstaged, sizeof unstaged, "%.*s", (int)(pl > sl && !strcmp(path + pl - sl, ".staged") ? pl - sl : pl),
             path);
    if (!ct__st_is_index(unstaged))
        return ct_error(CT_EINVAL, "%s: an index's name must end in '%s' (loaders recognise it by that); "
                        "name it like model%s", path, INDEX_EXT, INDEX_EXT);
    for (int i = 0; i < n; i++) {
        CT_ASSERT(names[i] && files[i]);
        CT_TRY(check_text(path, "tensor name", names[i]));
        CT_TRY(check_text(path, "file name", files[i]));
        const char *why = bad_file_name(files[i], strlen(files[i]));
        if (why)
            return ct_error(CT_EINVAL, "%s: tensor '%s' is in file '%s', which %s; give the bare name of a file "
                            "beside the index", path, names[i], files[i], why);
        ws[i] = (wentry){names[i], files[i], 0};
    }
    qsort(ws, (size_t)n, sizeof *ws, cmp_wentry_name);
    for (int i = 1; i < n; i++)
        if (!strcmp(ws[i - 1].name, ws[i].name))
            return ct_error(CT_EINVAL, "%s: tensor name '%s' is given twice", path, ws[i].name);
    for (int i = 0; i < nmeta; i++) {
        CT_ASSERT(mk[i] && mv[i]);
        CT_TRY(check_text(path, "metadata key", mk[i]));
        CT_TRY(check_text(path, "metadata value", mv[i]));
        ms[i] = (kv){mk[i], mv[i]};
    }
    qsort(ms, (size_t)nmeta, sizeof *ms, cmp_kv);
    for (int i = 1; i < nmeta; i++)
        if (!strcmp(ms[i - 1].key, ms[i].key))
            return ct_error(CT_EINVAL, "%s: metadata key '%s' is given twice", path, ms[i].key);
    return CT_OK;
}

/* Two-space indented, keys sorted: what Hugging Face's writers produce. */
static ct_status build_index(const wentry *ws, int n, const kv *ms, int nmeta, ct__buf *b)
{
    ct__buf_puts(b, "{\n  \"metadata\": {");
    for (int i = 0; i < nmeta; i++) {
        ct__buf_puts(b, i ? ",\n    " : "\n    ");
        ct__buf_json_str(b, ms[i].key, strlen(ms[i].key));
        ct__buf_puts(b, ": ");
        ct__buf_json_str(b, ms[i].val, strlen(ms[i].val));
    }
    ct__buf_puts(b, nmeta ? "\n  },\n  \"weight_map\": {" : "},\n  \"weight_map\": {");
    for (int i = 0; i < n; i++) {
        ct__buf_puts(b, i ? ",\n    " : "\n    ");
        ct__buf_json_str(b, ws[i].name, strlen(ws[i].name));
        ct__buf_puts(b, ": ");
        ct__buf_json_str(b, ws[i].file, strlen(ws[i].file));
    }
    ct__buf_puts(b, n ? "\n  }\n}\n" : "}\n}\n");
    return b->failed ? CT_ENOMEM : CT_OK;
}

ct_status ct_safetensors_save_index(const char *path, const char *const *names, const char *const *files, int n,
                                    const char *const *meta_keys, const char *const *meta_vals, int nmeta)
{
    CT_ASSERT(path && n >= 0 && nmeta >= 0);
    CT_ASSERT(n == 0 || (names && files));
    CT_ASSERT(nmeta == 0 || (meta_keys && meta_vals));
    ct_status s;
    ct__buf text = {0};
    wentry *ws = ct_alloc_zeroed((size_t)n * sizeof *ws + 1, CT_MEM_OTHER);
    kv *ms = ct_alloc_zeroed((size_t)nmeta * sizeof *ms + 1, CT_MEM_OTHER);
    if (!ws || !ms) { s = CT_ENOMEM; goto out_free; }
    if ((s = prepare_index(path, names, files, n, meta_keys, meta_vals, nmeta, ws, ms)) != CT_OK) goto out_free;
    if ((s = build_index(ws, n, ms, nmeta, &text)) != CT_OK) goto out_free;
    ct__afile af;
    if ((s = ct__afile_open(&af, path)) != CT_OK) goto out_free;
    s = ct__afile_write(&af, text.p, text.len);
    if (s == CT_OK) s = ct__afile_commit(&af);
    else ct__afile_abort(&af);
out_free:
    ct__buf_free(&text);
    ct_free(ws);
    ct_free(ms);
    return s;
}

/* ---- reading ------------------------------------------------------------ */

static ct_status read_text(const char *path, char **text, size_t *len)
{
    *text = NULL;
    FILE *f;
    struct stat sb;
    CT_TRY(ct__open_regular(path, &f, &sb));
    ct_status s = CT_OK;
    if ((uint64_t)sb.st_size > MAX_INDEX)
        s = ct_error(CT_EFORMAT, "%s: the index is %lld bytes, over the %u MB limit; %s", path,
                     (long long)sb.st_size, MAX_INDEX >> 20, HINT_CORRUPT);
    else if (!(*text = ct_alloc_zeroed((size_t)sb.st_size + 1, CT_MEM_OTHER))) s = CT_ENOMEM;
    else if (fread(*text, 1, (size_t)sb.st_size, f) != (size_t)sb.st_size)
        s = ct_error(CT_EIO, "%s: read stopped early: %s", path,
                     ferror(f) ? strerror(errno) : "unexpected end of file (did the file change?)");
    *len = s == CT_OK ? (size_t)sb.st_size : 0;
    fclose(f);
    if (s != CT_OK) {
        ct_free(*text);
        *text = NULL;
    }
    return s;
}

/* The index's "metadata" and "weight_map" members. */
static ct_status index_root(const char *path, const ct__json_doc *d, const ct__json **meta, const ct__json **wmap)
{
    const ct__json *root = &d->nodes[0];
    *meta = *wmap = NULL;
    if (root->kind != CT__JOBJ)
        return ct_error(CT_EFORMAT, "%s: the index is not a JSON object (it should be {\"metadata\": {...}, "
                        "\"weight_map\": {...}}); %s", path, HINT_CORRUPT);
    for (int32_t k = root->first; k >= 0; k = d->nodes[k].next) {
        const ct__json *m = &d->nodes[k];
        const ct__json **slot = strlen(m->key) != m->keylen ? NULL
                              : !strcmp(m->key, "metadata") ? meta
                              : !strcmp(m->key, "weight_map") ? wmap : NULL;
        if (!slot) continue; /* other members are allowed, as in Hugging Face's loaders */
        if (*slot) return ct_error(CT_EFORMAT, "%s: \"%s\" appears twice in the index; %s", path, m->key, HINT_CORRUPT);
        *slot = m;
    }
    if (!*wmap)
        return ct_error(CT_EFORMAT, "%s: the index has no \"weight_map\" (tensor name -> shard file); is it a "
                        "sharded checkpoint index?", path);
    if ((*wmap)->kind != CT__JOBJ)
        return ct_error(CT_EFORMAT, "%s: \"weight_map\" is not an object; %s", path, HINT_CORRUPT);
    if (*meta && (*meta)->kind != CT__JOBJ && (*meta)->kind != CT__JNULL)
        return ct_error(CT_EFORMAT, "%s: \"metadata\" is not an object; %s", path, HINT_CORRUPT);
    return CT_OK;
}

/* String metadata; integers (Hugging Face writes "total_size" as one) become their decimal text. */
static ct_status index_meta(const char *path, const ct__json_doc *d, const ct__json *m, ct_safetensors *st)
{
    if (!m || m->kind == CT__JNULL || m->count == 0) return CT_OK;
    st->mkeys = ct_alloc_zeroed((size_t)m->count * sizeof *st->mkeys, CT_MEM_OTHER);
    st->mvals = ct_alloc_zeroed((size_t)m->count * sizeof *st->mvals, CT_MEM_OTHER);
    st->numbuf = ct_alloc_zeroed((size_t)m->count * 24, CT_MEM_OTHER);
    if (!st->mkeys || !st->mvals || !st->numbuf) return CT_ENOMEM;
    for (int32_t k = m->first; k >= 0; k = d->nodes[k].next) {
        const ct__json *v = &d->nodes[k];
        if (strlen(v->key) != v->keylen)
            return ct_error(CT_EFORMAT, "%s: a metadata key contains a NUL character; %s", path, HINT_CORRUPT);
        const char *val;
        if (v->kind == CT__JINT) {
            char *at = st->numbuf + 24 * (size_t)st->nmeta;
            snprintf(at, 24, "%lld", (long long)v->ival);
            val = at;
        } else if (v->kind == CT__JSTR && strlen(v->str) == v->len) {
            val = v->str;
        } else {
            return ct_error(CT_EFORMAT, "%s: metadata value of '%s' is %s; index metadata holds strings (and "
                            "integers such as total_size)", path, v->key,
                            v->kind == CT__JSTR ? "a string with a NUL character" : "neither a string nor an integer");
        }
        st->mkeys[st->nmeta] = v->key;
        st->mvals[st->nmeta++] = val;
    }
    return ct__st_sort_meta(path, st);
}

/* Fills ws[0..count) from the weight_map, sorted by name, names unique. */
static ct_status index_entries(const char *path, const ct__json_doc *d, const ct__json *wmap, wentry *ws)
{
    int i = 0;
    for (int32_t k = wmap->first; k >= 0; k = d->nodes[k].next, i++) {
        const ct__json *v = &d->nodes[k];
        if (strlen(v->key) != v->keylen)
            return ct_error(CT_EFORMAT, "%s: a weight_map tensor name contains a NUL character; %s", path,
                            HINT_CORRUPT);
        if (v->kind != CT__JSTR)
            return ct_error(CT_EFORMAT, "%s: weight_map entry of tensor '%s' is not a file name (a string); %s",
                            path, v->key, HINT_CORRUPT);
        const char *why = bad_file_name(v->str, v->len);
        if (why)
            return ct_error(CT_EFORMAT, "%s: weight_map puts tensor '%s' in file '%s', which %s; shard files must "
                            "be bare names of files beside the index, so the index cannot reach outside its "
                            "directory: fix or replace the index", path, v->key, v->str, why);
        ws[i] = (wentry){v->key, v->str, -1};
    }
    qsort(ws, (size_t)i, sizeof *ws, cmp_wentry_name);
    for (int j = 1; j < i; j++)
        if (!strcmp(ws[j - 1].name, ws[j].name))
            return ct_error(CT_EFORMAT, "%s: weight_map lists tensor '%s' twice; %s", path, ws[j].name, HINT_CORRUPT);
    return CT_OK;
}

static int cmp_wentry_file(const void *a, const void *b)
{
    const wentry *x = *(const wentry *const *)a, *y = *(const wentry *const *)b;
    int c = strcmp(x->file, y->file);
    return c ? c : strcmp(x->name, y->name);
}

/* The entry called name in ws (sorted by name), or NULL. */
static wentry *find_entry(wentry *ws, int n, const char *name)
{
    wentry key = {name, NULL, 0};
    return bsearch(&key, ws, (size_t)n, sizeof *ws, cmp_wentry_name);
}

/* Loads shard file (listed for the entries g[0..ng)) and checks it against the index both ways. */
static ct_status load_shard(const char *index, const char *dir, wentry **g, int ng, wentry *ws, int n, int lazy,
                            ct_safetensors **out)
{
    const char *file = g[0]->file;
    size_t plen = strlen(dir) + strlen(file) + 2;
    char *path = ct_alloc_zeroed(plen, CT_MEM_OTHER);
    if (!path) return CT_ENOMEM;
    snprintf(path, plen, "%s%s", dir, file);
    ct_status s = CT_OK;
    if (access(path, F_OK) != 0 && errno == ENOENT) {
        s = ct_error(CT_EIO, "%s lists shard file '%s' (%d tensor%s, such as '%s'), but %s is missing; the "
                     "checkpoint is incomplete: copy the file back, or load a complete save", index, file, ng,
                     ng == 1 ? "" : "s", g[0]->name, path);
        goto out_free;
    }
    if ((s = ct__st_load_file(path, lazy, out)) != CT_OK) {
        char why[1024];
        snprintf(why, sizeof why, "%s", ct_last_error());
        s = ct_error(s, "%s (a shard of %s)", why, index);
        goto out_free;
    }
    for (int i = 0; i < ng && s == CT_OK; i++)
        if (!ct_safetensors_find(*out, g[i]->name))
            s = ct_error(CT_EFORMAT, "%s puts tensor '%s' in %s, but that file does not hold it; %s", index,
                         g[i]->name, path, HINT_MIXED);
    for (int i = 0; i < ct_safetensors_count(*out) && s == CT_OK; i++) {
        const char *name = ct_safetensors_name(*out, i);
        const wentry *e = find_entry(ws, n, name);
        if (!e)
            s = ct_error(CT_EFORMAT, "shard %s holds tensor '%s', which %s does not list; %s", path, name,
                         index, HINT_MIXED);
        else if (strcmp(e->file, file))
            s = ct_error(CT_EFORMAT, "shard %s holds tensor '%s', which %s puts in '%s'; %s", path, name, index,
                         e->file, HINT_MIXED);
    }
    if (s != CT_OK) {
        ct_safetensors_destroy(*out);
        *out = NULL;
    }
out_free:
    ct_free(path);
    return s;
}

/* Every shard the entries name, in file order; entries learn their shard. */
static ct_status load_shards(const char *index, wentry *ws, int n, int lazy, ct_safetensors *st)
{
    const char *slash = strrchr(index, '/');
    size_t dlen = slash ? (size_t)(slash - index) + 1 : 0;
    char *dir = ct_alloc_zeroed(dlen + 1, CT_MEM_OTHER);
    wentry **byfile = ct_alloc_zeroed((size_t)n * sizeof *byfile + 1, CT_MEM_OTHER);
    st->parts = ct_alloc_zeroed((size_t)n * sizeof *st->parts + 1, CT_MEM_OTHER);
    ct_status s = dir && byfile && st->parts ? CT_OK : CT_ENOMEM;
    if (s == CT_OK) {
        memcpy(dir, index, dlen);
        for (int i = 0; i < n; i++) byfile[i] = &ws[i];
        qsort(byfile, (size_t)n, sizeof *byfile, cmp_wentry_file);
    }
    for (int i = 0; i < n && s == CT_OK;) {
        int j = i;
        while (j < n && !strcmp(byfile[j]->file, byfile[i]->file)) j++;
        s = load_shard(index, dir, byfile + i, j - i, ws, n, lazy, &st->parts[st->nparts]);
        if (s == CT_OK) {
            for (int k = i; k < j; k++) byfile[k]->part = st->nparts;
            st->nparts++;
        }
        i = j;
    }
    ct_free(dir);
    ct_free(byfile);
    return s;
}

static ct_status load_index_into(const char *path, int lazy, ct_safetensors *st)
{
    char *text;
    size_t len = 0;
    CT_TRY(read_text(path, &text, &len));
    ct_status s = ct__json_parse_as(text, len, path, "index JSON", HINT_CORRUPT, &st->doc);
    ct_free(text);
    CT_TRY(s);
    const ct__json *meta, *wmap;
    CT_TRY(index_root(path, &st->doc, &meta, &wmap));
    CT_TRY(index_meta(path, &st->doc, meta, st));
    int n = wmap->count;
    wentry *ws = ct_alloc_zeroed((size_t)n * sizeof *ws + 1, CT_MEM_OTHER);
    st->names = ct_alloc_zeroed((size_t)n * sizeof *st->names + 1, CT_MEM_OTHER);
    st->tensors = ct_alloc_zeroed((size_t)n * sizeof *st->tensors + 1, CT_MEM_OTHER);
    s = ws && st->names && st->tensors ? CT_OK : CT_ENOMEM;
    if (s == CT_OK) s = index_entries(path, &st->doc, wmap, ws);
    if (s == CT_OK) s = load_shards(path, ws, n, lazy, st);
    /* ws is sorted by name: the merged view's order.  Names live in the index's strings. */
    for (int i = 0; i < n && s == CT_OK; i++) {
        st->names[i] = ws[i].name;
        st->tensors[i] = ct_tensor_retain(ct_safetensors_find(st->parts[ws[i].part], ws[i].name));
        st->n = i + 1;
    }
    ct_free(ws);
    return s;
}

ct_status ct__st_load_index(const char *path, int lazy, ct_safetensors **out)
{
    *out = NULL;
    ct_safetensors *st = ct_alloc_zeroed(sizeof *st, CT_MEM_OTHER);
    if (!st) return CT_ENOMEM;
    st->fd = -1;
    st->lazy = lazy;
    ct_status s = load_index_into(path, lazy, st);
    if (s != CT_OK) {
        ct_safetensors_destroy(st);
        return s;
    }
    ct_free(st->doc.nodes); /* the strings stay; the tree is no longer needed */
    st->doc.nodes = NULL;
    *out = st;
    return CT_OK;
}

/* A directory is loaded through its model index: model.safetensors.index.json
 * (Hugging Face's name) if present, else its only index. */
ct_status ct__st_load_dir(const char *dir, int lazy, ct_safetensors **out)
{
    *out = NULL;
    DIR *d = opendir(dir);
    if (!d) return ct_error(CT_EIO, "%s: cannot open directory: %s", dir, strerror(errno));
    int count = 0, has_default = 0;
    char first[256] = "", seen[512] = "";
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!ct__st_is_index(e->d_name)) continue;
        if (!strcmp(e->d_name, DEFAULT_INDEX)) has_default = 1;
        if (!count) snprintf(first, sizeof first, "%s", e->d_name);
        size_t at = strlen(seen);
        if (at < sizeof seen - 1) snprintf(seen + at, sizeof seen - at, "%s%s", count ? ", " : "", e->d_name);
        count++;
    }
    closedir(d);
    if (!has_default && count != 1) {
        if (count == 0)
            return ct_error(CT_EIO, "%s is a directory without a sharded checkpoint index (*%s); pass a "
                            "safetensors file, or a directory written by 'ctrain train --save DIR --state-dict "
                            "sharded'", dir, INDEX_EXT);
        return ct_error(CT_EINVAL, "%s holds %d indexes (%s) and none is %s; pass the index file itself", dir,
                        count, seen, DEFAULT_INDEX);
    }
    size_t plen = strlen(dir) + sizeof DEFAULT_INDEX + sizeof first + 2;
    char *path = ct_alloc_zeroed(plen, CT_MEM_OTHER);
    if (!path) return CT_ENOMEM;
    size_t dl = strlen(dir);
    snprintf(path, plen, "%s%s%s", dir, dl && dir[dl - 1] == '/' ? "" : "/", has_default ? DEFAULT_INDEX : first);
    ct_status s = ct__st_load_index(path, lazy, out);
    ct_free(path);
    return s;
}

/*
 * Sharded checkpoints (ct_checkpoint_save with CT_CKPT_SHARDED or LOCAL;
 * `ctrain train --save DIR --state-dict sharded|local`): every rank writes its share of the model and of the
 * optimizer state at once, streamed a tensor at a time (ct_strategy_share_foreach: the header from the
 * shapes, then each tensor as it is gathered or read from an offload store), and rank 0 then
 * writes two Hugging Face indexes, DIR/optim.safetensors.index.json and
 * last DIR/model.safetensors.index.json, with the run's metadata:
 *
 *   DIR/model-step000100-00000-of-00002.safetensors   rank 0's share of the model
 *   DIR/model-step000100-00001-of-00002.safetensors   rank 1's
 *   DIR/optim-step000100-0000R-of-00002.safetensors   optimizer state ("step" on rank 0)
 *   DIR/model.safetensors.index.json, DIR/optim.safetensors.index.json
 *
 * Shard names carry the step (and, when that step was saved here before,
 * a generation number: model-step000100.1-...), so a save never replaces a
 * file an existing index lists.  Files of older generations are removed
 * only after both indexes are written.  A crash at any point therefore
 * leaves loadable indexes whose files all exist.  The two indexes are
 * written staged and commit as one unit (ct_ckpt_commit), so a crash never
 * leaves them from different saves (both carry "ctrain.generation", the
 * shard names' tag, which --resume compares).  A rank whose share is empty
 * writes no file.
 */
#include <dirent.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

static const char *const kinds[2] = {"model", "optim"};

#define FNAME 128 /* room for a shard's file name */

/* "step000100" or, for generation k > 0 of that step, "step000100.k". */
static void gen_tag(char *buf, size_t n, int64_t step, int64_t k)
{
    if (k) snprintf(buf, n, "step%06lld.%lld", (long long)step, (long long)k);
    else snprintf(buf, n, "step%06lld", (long long)step);
}

static void shard_name(char *buf, size_t n, int kind, const char *tag, int rank, int size)
{
    snprintf(buf, n, "%s-%s-%05d-of-%05d.safetensors", kinds[kind], tag, rank, size);
}

/* A file of ctrain's shard sets: "model-step..." or "optim-step...". */
static int is_shard_file(const char *name)
{
    return !strncmp(name, "model-step", 10) || !strncmp(name, "optim-step", 10);
}

/* Rank 0: makes dir if needed and picks the first generation of step whose
 * names no file in dir starts with. */
static ct_status prepare_dir(const char *dir, int64_t step, int64_t *gen)
{
    struct stat sb;
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return ct_error(CT_EIO, "cannot create the checkpoint directory %s: %s", dir, strerror(errno));
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return ct_error(CT_EIO, "%s is not a directory, but --state-dict sharded writes one; give another --save path",
                        dir);
    char anchor[4096];
    snprintf(anchor, sizeof anchor, "%s/model.safetensors.index.json", dir);
    CT_TRY(ct_ckpt_recover(anchor)); /* an earlier save's interrupted commit first */
    char oidx[4096];
    snprintf(oidx, sizeof oidx, "%s/optim.safetensors.index.json", dir);
    const char *idx[2] = {anchor, oidx};
    ct_ckpt_discard(anchor, idx, 2); /* indexes a killed save left staged (its shards go in remove_old) */
    for (*gen = 0;; ++*gen) {
        char tag[64], pre[2][80];
        gen_tag(tag, sizeof tag, step, *gen);
        for (int k = 0; k < 2; k++) snprintf(pre[k], sizeof pre[k], "%s-%s-", kinds[k], tag);
        DIR *d = opendir(dir);
        if (!d) return ct_error(CT_EIO, "cannot read the checkpoint directory %s: %s", dir, strerror(errno));
        int taken = 0;
        struct dirent *e;
        while ((e = readdir(d)) && !taken)
            taken = !strncmp(e->d_name, pre[0], strlen(pre[0])) || !strncmp(e->d_name, pre[1], strlen(pre[1]));
        closedir(d);
        if (!taken) return CT_OK;
    }
}

static ct_status skip_one(void *ud, const char *name, ct_tensor *t)
{
    (void)ud, (void)name, (void)t;
    return CT_OK;
}

/* One share streamed into its file: the names and shapes first (the
 * header), then each tensor as the strategy gathers or reads it
 * (ct_strategy_share_foreach), written at its place and freed, so a rank
 * never holds its share, only one tensor of it. */
typedef struct {
    const char *dir;
    ct_state shapes;
    ct_safetensors_writer *w;
} share_file;

static ct_status add_shape(void *ud, const char *name, ct_tensor *t)
{
    return ct_state_add(&((share_file *)ud)->shapes, name, t);
}

static ct_status put_one(void *ud, const char *name, ct_tensor *t)
{
    share_file *c = ud;
    CT_TRY(ct__ckpt_check_finite(c->dir, name, t));
    return ct_safetensors_writer_put(c->w, name, t);
}

/* Collective: this rank's share of kind k (model 0, optim 1) written to
 * dir/file unless it is empty; *shapes (the caller's to fini) gets its
 * names and shapes, *bytes its tensor bytes.  Agreed over the group. */
static ct_status stream_share(ct_strategy *s, int local, int k, const char *dir, const char *file, ct_state *shapes,
                              int64_t *bytes)
{
    ct_group *g = ct_strategy_group(s);
    share_file c = {dir, {0}, NULL};
    ct_status st = ct_strategy_share_foreach(s, k, local, 1, add_shape, &c);
    *bytes = 0;
    for (int i = 0; i < c.shapes.n; i++) *bytes += (int64_t)ct_tensor_bytes(c.shapes.tensors[i]);
    if (st == CT_OK && c.shapes.n) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, file);
        const char *fk[] = {"format"}, *fv[] = {"pt"}; /* what Hugging Face's loaders look for in a shard */
        st = ct_safetensors_writer_create(path, (const char *const *)c.shapes.names, c.shapes.tensors, c.shapes.n, fk,
                                          fv, 1, &c.w);
    }
    st = ct__ckpt_check(g, st);
    if (st == CT_OK) /* an empty share takes part in the collectives and writes nothing */
        st = ct__ckpt_check(g, ct_strategy_share_foreach(s, k, local, 0, c.w ? put_one : skip_one, &c));
    if (st == CT_OK && c.w) st = ct_safetensors_writer_commit(c.w);
    ct_safetensors_writer_destroy(c.w);
    *shapes = c.shapes;
    return ct__ckpt_check(g, st);
}

/* Every rank's names of both kinds on every rank: counts[r*4 + 0/1] are
 * rank r's byte lengths of packed model / optimizer names, [r*4 + 2/3] its
 * tensor bytes; *packed holds all names, rank by rank, model then optim. */
static ct_status gather_names(ct_group *g, ct_state *st, const int64_t *bytes, int64_t *counts, char **packed)
{
    int size = ct_group_size(g);
    int64_t mine[4] = {0, 0, bytes[0], bytes[1]};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < st[k].n; i++) mine[k] += (int64_t)strlen(st[k].names[i]) + 1;
    if (g) CT_TRY(ct_group_allgather(g, mine, counts, 4, CT_I64, NULL));
    else memcpy(counts, mine, sizeof mine);
    int64_t total = 0, *lens = ct_alloc_zeroed(sizeof *lens * (size_t)size, CT_MEM_OTHER);
    char *send = ct_alloc_zeroed((size_t)(mine[0] + mine[1]) + 1, CT_MEM_OTHER);
    for (int r = 0; r < size && lens; r++) total += lens[r] = counts[r * 4] + counts[r * 4 + 1];
    *packed = ct_alloc_zeroed((size_t)total + 1, CT_MEM_OTHER);
    ct_status rc = lens && send && *packed ? CT_OK : CT_ENOMEM;
    if (rc == CT_OK) {
        size_t at = 0;
        for (int k = 0; k < 2; k++)
            for (int i = 0; i < st[k].n; i++) {
                size_t l = strlen(st[k].names[i]) + 1;
                memcpy(send + at, st[k].names[i], l);
                at += l;
            }
    }
    /* Every rank reaches the collective, so a local allocation failure cannot hang the others. */
    rc = ct__ckpt_check(g, rc);
    if (rc == CT_OK && g) rc = ct_group_allgatherv(g, send, mine[0] + mine[1], *packed, lens, NULL, CT_U8, NULL);
    else if (rc == CT_OK) memcpy(*packed, send, (size_t)(mine[0] + mine[1]));
    ct_free(lens);
    ct_free(send);
    if (rc != CT_OK) {
        ct_free(*packed);
        *packed = NULL;
    }
    return rc;
}

/* Rank 0: writes kind's index from the gathered names, metadata plus total_size. */
static ct_status write_index(const char *dir, int kind, const char *tag, int size, const int64_t *counts,
                             const char *packed, const ct_meta *meta)
{
    int n = 0;
    int64_t total = 0;
    const char *p = packed;
    for (int r = 0; r < size; r++) {
        for (int k = 0; k < 2; k++) {
            const char *end = p + counts[r * 4 + k];
            for (; p < end; p += strlen(p) + 1) n += k == kind;
        }
        total += counts[r * 4 + 2 + kind];
    }
    const char **names = ct_alloc_zeroed(sizeof *names * (size_t)(n + 1), CT_MEM_OTHER);
    const char **files = ct_alloc_zeroed(sizeof *files * (size_t)(n + 1), CT_MEM_OTHER);
    char *fnames = ct_alloc_zeroed((size_t)size * FNAME, CT_MEM_OTHER);
    if (!names || !files || !fnames) {
        ct_free(names);
        ct_free(files);
        ct_free(fnames);
        return CT_ENOMEM;
    }
    int i = 0;
    p = packed;
    for (int r = 0; r < size; r++) {
        shard_name(fnames + (size_t)r * FNAME, FNAME, kind, tag, r, size);
        for (int k = 0; k < 2; k++) {
            const char *end = p + counts[r * 4 + k];
            for (; p < end; p += strlen(p) + 1)
                if (k == kind) {
                    names[i] = p;
                    files[i++] = fnames + (size_t)r * FNAME;
                }
        }
    }
    const char **keys = ct_alloc(sizeof *keys * (size_t)(meta->n + 2), CT_MEM_OTHER);
    const char **vals = ct_alloc(sizeof *vals * (size_t)(meta->n + 2), CT_MEM_OTHER);
    if (!keys || !vals) {
        ct_free(keys);
        ct_free(vals);
        ct_free(names);
        ct_free(files);
        ct_free(fnames);
        return CT_ENOMEM;
    }
    char tot[32];
    ct_meta_arrays(meta, keys, vals);
    snprintf(tot, sizeof tot, "%lld", (long long)total);
    keys[meta->n] = "total_size";
    vals[meta->n] = tot;
    keys[meta->n + 1] = "ctrain.generation"; /* both indexes of one save carry the same */
    vals[meta->n + 1] = tag;
    char path[4096], staged[4112];
    snprintf(path, sizeof path, "%s/%s.safetensors.index.json", dir, kinds[kind]);
    ct_status st = ct_ckpt_staged_path(path, staged, sizeof staged);
    if (st == CT_OK) st = ct_safetensors_save_index(staged, names, files, n, keys, vals, meta->n + 2);
    ct_free(keys);
    ct_free(vals);
    ct_free(names);
    ct_free(files);
    ct_free(fnames);
    return st;
}

/* Rank 0, after both indexes are written: removes every shard file of dir
 * that is not of generation tag (older saves, and temp files of crashed ones). */
static ct_status remove_old(const char *dir, const char *tag)
{
    char pre[2][80], path[4096];
    for (int k = 0; k < 2; k++) snprintf(pre[k], sizeof pre[k], "%s-%s-", kinds[k], tag);
    DIR *d = opendir(dir);
    if (!d) return ct_error(CT_EIO, "cannot read the checkpoint directory %s: %s", dir, strerror(errno));
    ct_status st = CT_OK;
    struct dirent *e;
    while ((e = readdir(d)) && st == CT_OK) {
        if (!is_shard_file(e->d_name) || !strncmp(e->d_name, pre[0], strlen(pre[0])) ||
            !strncmp(e->d_name, pre[1], strlen(pre[1])))
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (unlink(path) != 0 && errno != ENOENT)
            st = ct_error(CT_EIO, "saved %s, but cannot remove %s of an older save: %s", dir, path, strerror(errno));
    }
    closedir(d);
    return st;
}

/* Removes the new shard files of ranks [r0, r1) (generation tag), which
 * no index lists because the save failed. */
static void take_back(const char *dir, const char *tag, int r0, int r1, int size)
{
    for (int r = r0; r < r1; r++)
        for (int k = 0; k < 2; k++) {
            char file[FNAME], path[4096];
            shard_name(file, sizeof file, k, tag, r, size);
            snprintf(path, sizeof path, "%s/%s", dir, file);
            unlink(path);
        }
}

ct_status ct__ckpt_save_sharded(ct_strategy *s, const char *dir, const ct_meta *model_meta,
                                const ct_meta *sidecar_meta, int64_t step, int local)
{
    ct_group *g = ct_strategy_group(s);
    int rank = g ? ct_group_rank(g) : 0, size = g ? ct_group_size(g) : 1; /* no group: alone */
    int64_t gen = 0;
    CT_TRY(ct__ckpt_check(g, rank == 0 ? prepare_dir(dir, step, &gen) : CT_OK));
    if (g) CT_TRY(ct_group_broadcast(g, &gen, 1, CT_I64, 0, NULL));
    char tag[64], file[FNAME];
    gen_tag(tag, sizeof tag, step, gen);

    /* Every rank writes both of its shares, agreeing after each. */
    ct_state st[2];
    memset(st, 0, sizeof st);
    int64_t bytes[2] = {0, 0}, *counts = NULL;
    char *packed = NULL;
    ct_status rc = CT_OK;
    for (int k = 0; k < 2 && rc == CT_OK; k++) {
        shard_name(file, sizeof file, k, tag, rank, size);
        rc = stream_share(s, local, k, dir, file, &st[k], &bytes[k]);
    }
    if (rc == CT_OK) {
        counts = ct_alloc_zeroed(sizeof *counts * 4 * (size_t)size, CT_MEM_OTHER);
        rc = ct__ckpt_check(g, counts ? CT_OK : CT_ENOMEM);
    }
    if (rc == CT_OK) rc = gather_names(g, st, bytes, counts, &packed);
    if (rc != CT_OK) take_back(dir, tag, rank, rank + 1, size); /* no index lists them */

    /* Rank 0 makes the new shards the checkpoint: the optimizer's index, the
     * model's, then the older files go. */
    if (rc == CT_OK) {
        ct_status r0 = CT_OK;
        if (rank == 0) {
            char idx[2][4096];
            const char *parts[2] = {idx[1], idx[0]};
            for (int k = 0; k < 2; k++) snprintf(idx[k], sizeof idx[k], "%s/%s.safetensors.index.json", dir, kinds[k]);
            r0 = write_index(dir, 1, tag, size, counts, packed, sidecar_meta);
            if (r0 == CT_OK) r0 = write_index(dir, 0, tag, size, counts, packed, model_meta);
            if (r0 == CT_OK) r0 = ct_ckpt_commit(idx[0], parts, 2); /* both indexes become current at once */
            /* A save that failed before its commit point leaves no file behind: no staged index, no shard. */
            if (r0 != CT_OK && ct_ckpt_discard(idx[0], parts, 2)) take_back(dir, tag, 0, size, size);
            if (r0 == CT_OK) r0 = remove_old(dir, tag);
        }
        rc = ct__ckpt_check(g, r0);
    }
    ct_free(packed);
    ct_free(counts);
    ct_state_fini(&st[0]);
    ct_state_fini(&st[1]);
    return rc;
}

/*
 * Checkpoints as the program writes them: the model state in CKPT (it
 * loads into the PyTorch nn.Sequential as its state_dict, and its metadata
 * rebuilds the model), and the optimizer state with the training position
 * in a sidecar "<CKPT without .safetensors>.optim.safetensors".  Both are
 * written under staged names and commit as one unit (ct_ckpt_commit): a
 * save that fails or is killed leaves the previous pair, never a mix.  A sharded checkpoint is a
 * directory (sharded.c); its sidecar is its optimizer index.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

void cli_sidecar_path(const char *path, char *buf, size_t n)
{
    static const char ext[] = ".safetensors", model_index[] = "model.safetensors.index.json";
    size_t len = strlen(path), el = sizeof ext - 1, ml = sizeof model_index - 1;
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        snprintf(buf, n, "%s%soptim.safetensors.index.json", path, len && path[len - 1] == '/' ? "" : "/");
    else if (len >= ml && !strcmp(path + len - ml, model_index) && (len == ml || path[len - ml - 1] == '/'))
        snprintf(buf, n, "%.*soptim.safetensors.index.json", (int)(len - ml), path);
    else if (len > ml - 5 && !strcmp(path + len - (ml - 5), model_index + 5)) /* P.safetensors.index.json */
        snprintf(buf, n, "%.*s.optim%s", (int)(len - (ml - 5)), path, model_index + 5);
    else if (len > el && !strcmp(path + len - el, ext))
        snprintf(buf, n, "%.*s.optim%s", (int)(len - el), path, ext);
    else
        snprintf(buf, n, "%s.optim%s", path, ext);
}

ct_status cli_load_file(const char *path, const char *what, ct_safetensors **out)
{
    ct_status st = ct_safetensors_load(path, out);
    if (st == CT_OK) return CT_OK;
    char why[512];
    snprintf(why, sizeof why, "%s", ct_last_error());
    return ct_error(st, "cannot read %s: %s", what, why);
}

ct_status cli_file_meta(const ct_safetensors *st, ct_meta *m)
{
    memset(m, 0, sizeof *m);
    for (int i = 0; i < ct_safetensors_meta_count(st); i++) {
        const char *k = ct_safetensors_meta_key(st, i), *v = ct_safetensors_meta_value(st, i);
        if (!strcmp(k, "ctrain.crc32")) continue; /* the file's own checksums, checked on load */
        /* Other tools' long entries are not ours to keep; ctrain's must fit. */
        if (ct_meta_set(m, k, "%s", v) != CT_OK && !strncmp(k, "ctrain.", 7)) return CT_EFORMAT;
    }
    ct_clear_error();
    return CT_OK;
}

ct_status cli_meta_int(const ct_meta *m, const char *file, const char *key, int64_t *v)
{
    const char *s = ct_meta_get(m, key);
    if (!s) return ct_error(CT_EFORMAT, "%s has no metadata '%s'; was it written by 'ctrain train'?", file, key);
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (end == s || *end || errno)
        return ct_error(CT_EFORMAT, "%s: metadata '%s' is '%s', not an integer", file, key, s);
    *v = x;
    return CT_OK;
}

ct_status cli_load_state(ct_strategy *s, const ct_safetensors *st, int optim)
{
    int n = ct_safetensors_count(st);
    const char **names = ct_alloc_zeroed(sizeof *names * (size_t)(n + 1), CT_MEM_OTHER);
    ct_tensor **ts = ct_alloc_zeroed(sizeof *ts * (size_t)(n + 1), CT_MEM_OTHER);
    ct_status r = CT_ENOMEM;
    if (names && ts) {
        for (int i = 0; i < n; i++) {
            names[i] = ct_safetensors_name(st, i);
            ts[i] = ct_safetensors_tensor(st, i);
        }
        r = ct_strategy_load_state(s, names, ts, n, optim);
    }
    ct_free(names);
    ct_free(ts);
    return r;
}

/* A diverged run must never replace a good checkpoint: every f32 value is checked. */
static ct_status check_finite(const char *path, const ct_state *state)
{
    for (int i = 0; i < state->n; i++) {
        const ct_tensor *t = state->tensors[i];
        if (t->dtype != CT_F32) continue;
        const float *x = ct_tensor_data(t);
        for (int64_t k = 0; k < t->numel; k++)
            if (!isfinite(x[k]))
                return ct_error(CT_EINVAL, "not saving %s: tensor '%s' holds a non-finite value (%g at element "
                                "%lld); the run diverged: lower --lr or use --clip, and resume from the last good "
                                "checkpoint", path, state->names[i], (double)x[k], (long long)k);
    }
    return CT_OK;
}

ct_status cli_check_state_finite(const char *path, const ct_state *state) { return check_finite(path, state); }

/* Writes state to path's staged name (ct_ckpt_staged_path). */
static ct_status save_state(const char *path, ct_state *state, const ct_meta *meta)
{
    const char *keys[CT_META_MAX], *vals[CT_META_MAX];
    char staged[4112];
    CT_TRY(check_finite(path, state));
    CT_TRY(ct_ckpt_staged_path(path, staged, sizeof staged));
    ct_meta_arrays(meta, keys, vals);
    return ct_safetensors_save(staged, (const char *const *)state->names, state->tensors, state->n, keys, vals,
                               meta->n);
}

ct_status cli_ckpt_recover(ct_group *g, const char *path)
{
    char anchor[4096];
    struct stat sb;
    size_t len = strlen(path);
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
        snprintf(anchor, sizeof anchor, "%s%smodel.safetensors.index.json", path, len && path[len - 1] == '/' ? "" : "/");
    else
        snprintf(anchor, sizeof anchor, "%s", path);
    if (!g) return ct_ckpt_recover(anchor);
    return ct_group_check(g, ct_group_rank(g) == 0 ? ct_ckpt_recover(anchor) : CT_OK);
}

ct_status cli_check_regular(const char *path)
{
    struct stat sb;
    if (stat(path, &sb) != 0) return ct_error(CT_EIO, "cannot read %s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode) && !S_ISDIR(sb.st_mode))
        return ct_error(CT_EINVAL, "%s is not a regular file or a directory (a pipe or a device?); give a checkpoint "
                        "file or a sharded checkpoint's directory", path);
    return CT_OK;
}

/* The state is gathered collectively (a sharded strategy assembles it on
 * rank 0); rank 0 writes both files staged, then commits them as one unit
 * (ct_ckpt_commit), so a failed or killed save leaves the previous pair
 * current; every rank learns whether it worked. */
ct_status cli_save(ct_strategy *s, const char *path, const ct_meta *model_meta, const ct_meta *sidecar_meta)
{
    ct_group *g = ct_strategy_group(s);
    int writer = ct_group_rank(g) == 0;
    char side[4096];
    cli_sidecar_path(path, side, sizeof side);
    CT_TRY(cli_ckpt_recover(g, path)); /* finish an earlier save a crash interrupted */
    const char *parts[2] = {path, side};
    int nparts = sidecar_meta ? 2 : 1;
    if (writer) ct_ckpt_discard(path, parts, 2); /* what a killed save left staged */
    ct_state state;
    ct_status st = ct_strategy_model_state(s, &state);
    if (st == CT_OK && writer) st = save_state(path, &state, model_meta);
    ct_state_fini(&state);
    st = ct_group_check(g, st);
    if (st == CT_OK && sidecar_meta) {
        st = ct_strategy_optim_state(s, &state);
        if (st == CT_OK && writer) st = save_state(side, &state, sidecar_meta);
        ct_state_fini(&state);
        st = ct_group_check(g, st);
    }
    if (st == CT_OK && writer) st = ct_ckpt_commit(path, parts, nparts);
    /* A save that failed leaves no staged file (after the commit point there
     * is a journal, and discard leaves its files for the reader to finish). */
    if (st != CT_OK && writer) ct_ckpt_discard(path, parts, 2);
    return ct_group_check(g, st);
}

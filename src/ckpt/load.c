/*
 * Reading a checkpoint back: its metadata before a model exists (to
 * rebuild the model and resume the run's settings), and its state into a
 * strategy.  Both finish a save a crash interrupted first, and both check
 * that a model file and its optimizer state are from one save.  Files are
 * opened lazily (ct_safetensors_open): the metadata costs the headers, and
 * a load reads, by position, only the element ranges each rank keeps
 * (ct_strategy_load_source), from a full file, a sharded directory or
 * local pieces alike.
 */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

ct_status ct__ckpt_read(const char *path, const char *what, int lazy, ct_safetensors **out)
{
    ct_status st = lazy ? ct_safetensors_open(path, out) : ct_safetensors_load(path, out);
    if (st == CT_OK) return CT_OK;
    char why[512];
    snprintf(why, sizeof why, "%s", ct_last_error());
    return ct_error(st, "cannot read %s: %s", what, why);
}

ct_status ct__ckpt_file_meta(const ct_safetensors *st, ct_meta *m)
{
    ct_meta_fini(m);
    for (int i = 0; i < ct_safetensors_meta_count(st); i++)
        if (ct_meta_set(m, ct_safetensors_meta_key(st, i), "%s", ct_safetensors_meta_value(st, i)) != CT_OK) {
            ct_meta_fini(m);
            return CT_ENOMEM;
        }
    return CT_OK;
}

ct_status ct__ckpt_same_save(const char *path, const ct_meta *model, const char *side, const ct_meta *optim)
{
    /* Both files of a save carry its step, seed and id; the indexes of a
     * sharded save also the shard names' generation. */
    static const char *const keys[] = {"ctrain.step", "ctrain.seed", "ctrain.commit", "ctrain.generation"};
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
        const char *a = ct_meta_get(model, keys[k]), *b = ct_meta_get(optim, keys[k]);
        if ((a || b) && (!a || !b || strcmp(a, b)))
            return ct_error(CT_EFORMAT, "%s and its optimizer state %s are from different saves (put together by "
                            "hand?): '%s' is %s and %s; resume from a matching pair, or use --init for the "
                            "weights alone", path, side, keys[k], a ? a : "absent", b ? b : "absent");
    }
    return CT_OK;
}

/* A lazily opened file as a load's source: elements by positioned reads. */
static ct_status read_elems(void *ud, const ct_tensor *t, int64_t off, int64_t count, void *dst)
{
    size_t es = ct_dtype_size(t->dtype);
    return ct_safetensors_read(ud, t, (size_t)off * es, (size_t)count * es, dst);
}

ct_status ct__ckpt_load_tensors(ct_strategy *s, const ct_safetensors *st, int optim)
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
        ct_state_source src = {read_elems, (void *)st}; /* used for tensors opened without data */
        r = ct_strategy_load_source(s, names, ts, n, optim, &src);
    }
    ct_free(names);
    ct_free(ts);
    return r;
}

/* The position a save wrote (absent keys: 0; a model file has no position). */
static ct_status read_position(const char *file, const ct_meta *m, const char *key, int64_t *v)
{
    const char *s = ct_meta_get(m, key);
    *v = 0;
    if (!s) return CT_OK;
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (end == s || *end || errno)
        return ct_error(CT_EFORMAT, "%s: metadata '%s' is '%s', not an integer", file, key, s);
    if (x < 0)
        return ct_error(CT_EFORMAT, "%s: metadata '%s' is %lld, but a position counts from 0; the file is damaged "
                        "or was edited: resume from another checkpoint", file, key, x);
    *v = x;
    return CT_OK;
}

/* One process: the metadata of path (and of its optimizer state). */
static ct_status read_info(const char *path, int need_optim, ct_ckpt_info *out)
{
    ct_safetensors *model = NULL, *optim = NULL;
    char side[4096];
    CT_TRY(ct__ckpt_check_regular(path));
    CT_TRY(ct__ckpt_read(path, "the checkpoint", 1, &model));
    ct_status st = ct__ckpt_file_meta(model, &out->meta);
    ct_safetensors_destroy(model);
    ct_checkpoint_optim_path(path, side, sizeof side);
    if (st == CT_OK && access(side, F_OK) == 0) {
        st = ct__ckpt_read(side, "the optimizer state", 1, &optim);
        if (st == CT_OK) st = ct__ckpt_file_meta(optim, &out->optim_meta);
        if (st == CT_OK) st = ct__ckpt_same_save(path, &out->meta, side, &out->optim_meta);
        out->has_optim = st == CT_OK;
        ct_safetensors_destroy(optim);
        if (st != CT_OK && st != CT_ENOMEM && !need_optim) { /* the weights alone are asked for: they are sound */
            ct_meta_fini(&out->optim_meta);
            ct_clear_error();
            st = CT_OK;
        }
    } else if (st == CT_OK && need_optim) {
        st = ct_error(CT_EIO, "cannot resume from %s: its optimizer state %s is missing (it is written beside "
                      "the checkpoint when it is saved); load the weights alone (use --init %s, or "
                      "ct_checkpoint_load without the optimizer)", path, side, path);
    }
    /* the optimizer file has the whole position (the model file its step and epoch) */
    const ct_meta *pm = out->has_optim ? &out->optim_meta : &out->meta;
    const char *pf = out->has_optim ? side : path;
    if (st == CT_OK) st = read_position(pf, pm, "ctrain.step", &out->pos.step);
    if (st == CT_OK) st = read_position(pf, pm, "ctrain.epoch", &out->pos.epoch);
    if (st == CT_OK) st = read_position(pf, pm, "ctrain.position", &out->pos.position);
    return st;
}

ct_status ct_checkpoint_info(ct_group *g, const char *path, int need_optim, ct_ckpt_info *out)
{
    memset(out, 0, sizeof *out);
    CT_TRY(ct__ckpt_check(g, path ? CT_OK : ct_error(CT_EINVAL, "ct_checkpoint_info: path is NULL")));
    CT_TRY(ct__ckpt_recover(g, path)); /* a save a crash interrupted is finished first */
    ct_status st = ct__ckpt_check(g, read_info(path, need_optim, out));
    if (st != CT_OK) ct_ckpt_info_fini(out);
    return st;
}

void ct_ckpt_info_fini(ct_ckpt_info *info)
{
    ct_meta_fini(&info->meta);
    ct_meta_fini(&info->optim_meta);
    memset(info, 0, sizeof *info);
}

/* This rank's part of a load: the model state, then the optimizer state
 * after checking it is from the same save. */
static ct_status load_local(ct_strategy *s, const char *path, int optim)
{
    ct_safetensors *model = NULL, *side_st = NULL;
    ct_meta mm = {0}, om = {0};
    char side[4096];
    ct_status st = ct__ckpt_check_regular(path);
    if (st == CT_OK) st = ct__ckpt_read(path, "the checkpoint", 1, &model);
    if (st == CT_OK && optim) {
        ct_checkpoint_optim_path(path, side, sizeof side);
        if (access(side, F_OK) != 0)
            st = ct_error(CT_EIO, "cannot resume from %s: its optimizer state %s is missing (it is written beside "
                          "the checkpoint when it is saved); load the weights alone (use --init %s, or "
                          "ct_checkpoint_load without the optimizer)", path, side, path);
        if (st == CT_OK) st = ct__ckpt_read(side, "the optimizer state", 1, &side_st);
        if (st == CT_OK) st = ct__ckpt_file_meta(model, &mm);
        if (st == CT_OK) st = ct__ckpt_file_meta(side_st, &om);
        if (st == CT_OK) st = ct__ckpt_same_save(path, &mm, side, &om);
    }
    ct_meta_fini(&mm);
    ct_meta_fini(&om);
    ct_status r = ct__ckpt_check(ct_strategy_group(s), st);
    /* the state calls are collective: every rank makes them, or none */
    if (r == CT_OK) r = ct__ckpt_load_tensors(s, model, 0);
    if (r == CT_OK && optim) r = ct__ckpt_load_tensors(s, side_st, 1);
    ct_safetensors_destroy(model);
    ct_safetensors_destroy(side_st);
    return r;
}

ct_status ct_checkpoint_load(ct_strategy *s, const char *path, int optim)
{
    ct_group *g = ct_strategy_group(s);
    CT_TRY(ct__ckpt_check(g, path ? CT_OK : ct_error(CT_EINVAL, "ct_checkpoint_load: path is NULL")));
    CT_TRY(ct__ckpt_recover(g, path));
    return ct__ckpt_check(g, load_local(s, path, optim));
}

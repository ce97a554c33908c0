/*
 * Saving a run: the metadata every save carries (the caller's, the
 * position, the save's id), the full pair, and ct_checkpoint_save, which
 * picks the kind and keeps a series.  FULL: the state is streamed to rank
 * 0 one tensor at a time (a sharded strategy gathers each and frees it),
 * which writes both files under staged names, header first, then commits
 * them as one unit (ct_ckpt_commit), so a failed or killed save leaves the
 * previous pair; every rank learns whether it worked.
 */
#include <math.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* A diverged run must never replace a good checkpoint: every f32 value is checked. */
ct_status ct__ckpt_check_finite(const char *path, const char *name, const ct_tensor *t)
{
    if (t->dtype != CT_F32) return CT_OK;
    const float *x = ct_tensor_data(t);
    for (int64_t k = 0; k < t->numel; k++)
        if (!isfinite(x[k]))
            return ct_error(CT_EINVAL, "not saving %s: tensor '%s' holds a non-finite value (%g at element "
                            "%lld); the run diverged: lower --lr or use --clip, and resume from the last good "
                            "checkpoint", path, name, (double)x[k], (long long)k);
    return CT_OK;
}

/* One file of the pair, streamed: the names and shapes first (the header
 * goes out before any data), then each tensor as the strategy gathers it
 * (ct_strategy_state_foreach), written where it belongs and freed, so the
 * writer never holds more than one tensor of a sharded state. */
typedef struct {
    int writer;
    const char *path;
    ct_state shapes;
    ct_safetensors_writer *w;
} stream;

static ct_status add_shape(void *ud, const char *name, ct_tensor *t)
{
    stream *c = ud;
    return c->writer ? ct_state_add(&c->shapes, name, t) : CT_OK;
}

static ct_status put_one(void *ud, const char *name, ct_tensor *t)
{
    stream *c = ud;
    if (!c->writer) return CT_OK;
    CT_TRY(ct__ckpt_check_finite(c->path, name, t));
    return ct_safetensors_writer_put(c->w, name, t);
}

/* Collective: optim's state written to path's staged name (ct_ckpt_staged_path) by the writer rank. */
static ct_status save_state(ct_strategy *s, int writer, int optim, const char *path, const ct_meta *meta)
{
    ct_group *g = ct_strategy_group(s);
    stream c = {writer, path, {0}, NULL};
    char staged[4112];
    const char **keys = ct_alloc(sizeof *keys * (size_t)(meta->n + 1), CT_MEM_OTHER);
    const char **vals = ct_alloc(sizeof *vals * (size_t)(meta->n + 1), CT_MEM_OTHER);
    ct_status st = keys && vals ? CT_OK : CT_ENOMEM;
    st = ct__ckpt_check(g, st);
    if (st == CT_OK) st = ct_strategy_state_foreach(s, optim, 1, add_shape, &c);
    if (st == CT_OK && writer) st = ct_ckpt_staged_path(path, staged, sizeof staged);
    if (st == CT_OK && writer) {
        ct_meta_arrays(meta, keys, vals);
        st = ct_safetensors_writer_create(staged, (const char *const *)c.shapes.names, c.shapes.tensors, c.shapes.n,
                                          keys, vals, meta->n, &c.w);
    }
    st = ct__ckpt_check(g, st);
    if (st == CT_OK) st = ct__ckpt_check(g, ct_strategy_state_foreach(s, optim, 0, put_one, &c));
    if (st == CT_OK && writer) st = ct_safetensors_writer_commit(c.w);
    ct_safetensors_writer_destroy(c.w);
    ct_state_fini(&c.shapes);
    ct_free(keys);
    ct_free(vals);
    return ct__ckpt_check(g, st);
}

ct_status ct__ckpt_save_full(ct_strategy *s, const char *path, const ct_meta *mm, const ct_meta *om)
{
    ct_group *g = ct_strategy_group(s);
    int writer = !g || ct_group_rank(g) == 0;
    char side[4096];
    ct_checkpoint_optim_path(path, side, sizeof side);
    CT_TRY(ct__ckpt_recover(g, path)); /* finish an earlier save a crash interrupted */
    const char *parts[2] = {path, side};
    int nparts = om ? 2 : 1;
    if (writer) ct_ckpt_discard(path, parts, 2); /* what a killed save left staged */
    ct_status st = save_state(s, writer, 0, path, mm);
    if (st == CT_OK && om) st = save_state(s, writer, 1, side, om);
    if (st == CT_OK && writer) st = ct_ckpt_commit(path, parts, nparts);
    /* A save that failed leaves no staged file (after the commit point there
     * is a journal, and discard leaves its files for the reader to finish). */
    if (st != CT_OK && writer) ct_ckpt_discard(path, parts, 2);
    return ct__ckpt_check(g, st);
}

/* The two files' metadata: the caller's, the position, and one id for the
 * save, so a pair put together from two saves is recognised (rank 0
 * writes the files and the indexes; its id counts). */
static ct_status fill_meta(const ct_meta *meta, const ct_ckpt_position *pos, const ct_meta *extra, ct_meta *mm,
                           ct_meta *om)
{
    if (meta) CT_TRY(ct_meta_copy(mm, meta));
    CT_TRY(ct_meta_set(mm, "ctrain.step", "%lld", (long long)pos->step));
    CT_TRY(ct_meta_set(mm, "ctrain.epoch", "%lld", (long long)pos->epoch));
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    CT_TRY(ct_meta_set(mm, "ctrain.commit", "%llx-%x-%llx", (unsigned long long)ts.tv_sec, (unsigned)getpid(),
                       (unsigned long long)ts.tv_nsec));
    CT_TRY(ct_meta_copy(om, mm));
    CT_TRY(ct_meta_set(om, "ctrain.position", "%lld", (long long)pos->position));
    for (int i = 0; extra && i < extra->n; i++) CT_TRY(ct_meta_set(om, extra->key[i], "%s", extra->val[i]));
    return CT_OK;
}

ct_status ct_checkpoint_save(ct_strategy *s, const char *path, const ct_meta *meta, const ct_ckpt_position *pos,
                             const ct_ckpt_opts *opts)
{
    static const ct_ckpt_opts defaults;
    static const ct_ckpt_position start;
    if (!opts) opts = &defaults;
    if (!pos) pos = &start;
    ct_group *g = ct_strategy_group(s);
    if (!path || !*path || (unsigned)opts->kind > CT_CKPT_LOCAL || opts->keep_last < 0 || pos->step < 0 ||
        pos->epoch < 0 || pos->position < 0)
        return ct_error(CT_EINVAL, "ct_checkpoint_save: %s; give a path, a kind of CT_CKPT_FULL, SHARDED or LOCAL, "
                        "keep_last >= 0 and a position of whole numbers",
                        !path || !*path ? "no path" : "an argument is out of range");
    ct_meta mm = {0}, om = {0};
    ct_status st = fill_meta(meta, pos, opts->optim_meta, &mm, &om);
    st = ct__ckpt_check(g, st);
    char member[4096];
    snprintf(member, sizeof member, "%s", path);
    if (opts->keep_last) ct_checkpoint_series_path(path, pos->step, member, sizeof member);
    if (st == CT_OK && opts->kind == CT_CKPT_FULL) st = ct__ckpt_save_full(s, member, &mm, &om);
    else if (st == CT_OK) st = ct__ckpt_save_sharded(s, member, &mm, &om, pos->step, opts->kind == CT_CKPT_LOCAL);
    if (st == CT_OK && opts->keep_last) st = ct__ckpt_prune(g, path, member, opts->keep_last);
    ct_meta_fini(&mm);
    ct_meta_fini(&om);
    return st;
}

/*
 * ctrain checkpoint: a training run saved and resumed through a strategy,
 * as `ctrain train --save/--resume` does it (the program calls these).
 * This room (src/ckpt) uses parallel (the strategy's state calls), io
 * (safetensors, the commit journal), comm (agreement across ranks) and
 * models (verify rebuilds the model a checkpoint's metadata describes).
 *
 * A checkpoint is a model file and its optimizer state, committed as one
 * unit (a failed or killed save leaves the previous pair, never a mix):
 *   FULL     path is one file (the model's state_dict, loadable in PyTorch)
 *            and "<path without .safetensors>.optim.safetensors" beside it;
 *   SHARDED  path is a directory in Hugging Face's sharded layout: every
 *            rank writes its share of whole tensors (balanced by bytes), rank
 *            0 the two indexes model.safetensors.index.json and
 *            optim.safetensors.index.json;
 *   LOCAL    the same directory layout, but each rank writes the pieces it
 *            holds ("<name>@<offset>", no communication).
 * Every file carries a crc32 per tensor; the metadata of both files names
 * the save ("ctrain.commit"), its step and epoch, and the optimizer file the
 * data position.  Any kind loads under any strategy at any world size.
 *
 * Every call taking a strategy or a group is collective over that group:
 * call it on every rank, never under if (rank == 0).
 *
 * Ownership: ct_ckpt_info is caller-owned (ct_ckpt_info_fini); paths are
 * written into caller buffers.
 */
#ifndef CTRAIN_CHECKPOINT_H
#define CTRAIN_CHECKPOINT_H

#include "io.h"
#include "models.h"
#include "parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { CT_CKPT_FULL = 0, CT_CKPT_SHARDED, CT_CKPT_LOCAL } ct_ckpt_kind;

/* Where a run stands: what a resume needs to continue the same data order
 * (ct_sampler): steps taken, the epoch of the next step, and the global
 * batches of that epoch already trained. */
typedef struct {
    int64_t step, epoch, position;
} ct_ckpt_position;

/* What a save writes besides the state (all optional; zeroed: a FULL save
 * of model and optimizer at path itself). */
typedef struct {
    ct_ckpt_kind kind;
    const ct_meta *optim_meta; /* more keys for the optimizer file only (a run's hyper-parameters) */
    int64_t keep_last;         /* > 0: a series (see ct_checkpoint_series_path) keeping this many */
} ct_ckpt_opts;

/* Collective: writes s's model and optimizer state as a checkpoint at path
 * (opts->kind; with keep_last, at ct_checkpoint_series_path(path, step),
 * then removes all but the keep_last newest members that verify, once the
 * new one does).  meta (may be NULL) goes in both files, with the
 * position's "ctrain.step", "ctrain.epoch" and, in the optimizer file,
 * "ctrain.position".  A state holding NaN or inf is refused.  The same
 * status on every rank. */
ct_status ct_checkpoint_save(ct_strategy *s, const char *path, const ct_meta *meta, const ct_ckpt_position *pos,
                             const ct_ckpt_opts *opts);

/* A checkpoint's metadata, read before a model is built (to rebuild it and
 * to resume its run's settings). */
typedef struct {
    ct_meta meta;        /* the model file's (an index's "metadata" for a directory) */
    ct_meta optim_meta;  /* the optimizer file's; empty when has_optim is 0 */
    int has_optim;
    ct_ckpt_position pos; /* from the metadata; zeros when absent */
} ct_ckpt_info;

/* Collective over g (NULL: this process alone): finishes a save a crash
 * interrupted, reads path's metadata (its headers only) into *out; with
 * need_optim the optimizer state must be there and from the same save
 * (without, an optimizer state that is not is left out: has_optim 0).
 * The message names the file and the fix. */
ct_status ct_checkpoint_info(ct_group *g, const char *path, int need_optim, ct_ckpt_info *out);
/* Frees the metadata and zeroes *info. */
void ct_ckpt_info_fini(ct_ckpt_info *info);
/* Collective: loads path's model state (optim: and its optimizer state,
 * which must be from the same save) into s, whatever kind, strategy and
 * world size wrote it.  Each rank reads only the byte ranges it keeps. */
ct_status ct_checkpoint_load(ct_strategy *s, const char *path, int optim);

/* What ct_checkpoint_verify found. */
typedef struct {
    int has_optim; /* its optimizer state is there (and was checked) */
    int is_ctrain; /* its metadata describes a ctrain model, and it loaded into one */
} ct_ckpt_verified;
/* One process, no collectives: CT_OK exactly when path would load (every
 * checksum, the pair from one save, both states into the model its
 * metadata describes); need_optim: the optimizer state must be there. */
ct_status ct_checkpoint_verify(const char *path, int need_optim, ct_ckpt_verified *out);

/* The optimizer state's path of checkpoint path: "run.safetensors" ->
 * "run.optim.safetensors", other names + ".optim.safetensors", a directory
 * (or its model index) -> "DIR/optim.safetensors.index.json". */
void ct_checkpoint_optim_path(const char *path, char *buf, size_t n);
/* The series member of path at step: "run.safetensors" ->
 * "run-step00000100.safetensors", a directory "ckpt" -> "ckpt-step00000100". */
void ct_checkpoint_series_path(const char *path, int64_t step, char *buf, size_t n);
/* Collective: the newest checkpoint of path's series (or path itself) that
 * verifies, into buf on every rank; "" when there is none. */
ct_status ct_checkpoint_latest(ct_group *g, const char *path, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif

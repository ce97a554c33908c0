/* Private to src/ckpt, the room that saves and resumes a training run
 * through a strategy (include/ctrain/checkpoint.h says what it owns): the
 * parts the public calls share.  Files: paths.c (names and recovery),
 * save.c (the full pair, and ct_checkpoint_save), sharded.c (directories),
 * load.c (metadata and state in), verify.c, series.c. */
#ifndef CTRAIN_CKPT_INTERNAL_H
#define CTRAIN_CKPT_INTERNAL_H

#include "ctrain/checkpoint.h"
#include <stdio.h>
#include <stdlib.h>

#include "ctrain/comm.h"

/* A status agreed over g (ct_group_check); g NULL: this process alone, st as it is. */
ct_status ct__ckpt_check(ct_group *g, ct_status st);

/* The file whose journal commits a checkpoint: path itself, or a
 * directory's model.safetensors.index.json. */
void ct__ckpt_anchor(const char *path, char *buf, size_t n);
/* Collective over g (NULL: this process alone): rank 0 finishes a commit
 * of path that a crash interrupted. */
ct_status ct__ckpt_recover(ct_group *g, const char *path);
/* CT_OK when path is a regular file or a directory (never a FIFO a read would block on). */
ct_status ct__ckpt_check_regular(const char *path);
/* CT_EINVAL naming path and the tensor when f32 tensor t (name) holds NaN or inf. */
ct_status ct__ckpt_check_finite(const char *path, const char *name, const ct_tensor *t);

/* Collective: the full pair (save.c); om NULL: the model file alone. */
ct_status ct__ckpt_save_full(ct_strategy *s, const char *path, const ct_meta *mm, const ct_meta *om);
/* Collective: a sharded or local directory (sharded.c). */
ct_status ct__ckpt_save_sharded(ct_strategy *s, const char *dir, const ct_meta *mm, const ct_meta *om,
                                int64_t step, int local);

/* Loads a safetensors file (or sharded checkpoint) naming what it is in
 * the message; lazy: its headers only (ct_safetensors_open). */
ct_status ct__ckpt_read(const char *path, const char *what, int lazy, ct_safetensors **out);
/* The file's metadata (its own checksums included) into m (emptied first). */
ct_status ct__ckpt_file_meta(const ct_safetensors *st, ct_meta *m);
/* CT_EFORMAT naming both files and the key unless the model file and its
 * optimizer state carry the same step, seed, save id and generation. */
ct_status ct__ckpt_same_save(const char *path, const ct_meta *model, const char *side, const ct_meta *optim);
/* Every tensor of st into s's model (optim 0) or optimizer (optim 1);
 * from a lazily opened st each rank reads only what it keeps. */
ct_status ct__ckpt_load_tensors(ct_strategy *s, const ct_safetensors *st, int optim);

/* Collective: once newest (just saved) verifies, rank 0 removes all but
 * the keep newest members of save's series that verify (series.c). */
ct_status ct__ckpt_prune(ct_group *g, const char *save, const char *newest, int64_t keep);

#endif

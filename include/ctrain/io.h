/*
 * ctrain io: what goes in and out of files.  safetensors checkpoints (read
 * and atomic write, PyTorch-compatible names and layouts; whole files, or
 * sharded over several files with a Hugging Face index), IDX image data
 * sets such as Fashion-MNIST, and the deterministic sampler that gives each
 * rank its slice of every global batch.  This room uses src/core only.
 *
 * Ownership: ct_dataset is caller-owned (ct_dataset_fini frees its
 * tensors); ct_sampler is caller-owned (ct_sampler_fini); ct_safetensors
 * is a heap handle (ct_safetensors_destroy) that owns the tensors it hands out.
 */
#ifndef CTRAIN_IO_H
#define CTRAIN_IO_H

#include "tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- image data sets (IDX) --------------------------------------------- */

/* Images and labels held in memory; the struct is the caller's. */
typedef struct {
    ct_tensor *images; /* f32 [n, 1, rows, cols], (pixel/255 - mean)/std */
    ct_tensor *labels; /* i32 [n], each in [0, nclasses) */
    int64_t n, rows, cols;
    int nclasses;
} ct_dataset;

#define CT_FASHION_MNIST_DIR "/usr/share/datasets/fashion-mnist"
#define CT_FASHION_MNIST_MEAN 0.2860f
#define CT_FASHION_MNIST_STD 0.3530f

/* Loads an IDX image file (u8, 3 dims) and its IDX label file (u8, 1 dim),
 * gzip'd or plain, into *out.  Every label must be < nclasses.  On failure
 * *out is left empty and the message names the file and the problem. */
ct_status ct_idx_load(const char *images_path, const char *labels_path, int nclasses,
                      float mean, float std, ct_dataset *out);
/* Loads Fashion-MNIST's training (train != 0, 60000 images) or test set
 * (10000) from dir (NULL: CT_FASHION_MNIST_DIR), normalised with the
 * training set's mean and std.  Accepts the .gz files or unpacked ones. */
ct_status ct_fashion_mnist_load(const char *dir, int train, ct_dataset *out);
/* Fashion-MNIST class name ("T-shirt/top", ...); "?" outside [0, 10). */
const char *ct_fashion_mnist_class(int label);
/* Releases the tensors and zeroes *d; safe on a zeroed or deinited struct. */
void ct_dataset_fini(ct_dataset *d);
/* New batch of the count samples idx[0..count): *x f32 [count, 1, rows, cols]
 * and *y i32 [count], both under CT_MEM_ACT; the caller releases them. */
ct_status ct_dataset_gather(const ct_dataset *ds, const int64_t *idx, int64_t count,
                            ct_tensor **x, ct_tensor **y);

/* ---- byte-level text (src/io/text.c says how windows are drawn) -------- */

#define CT_FORTUNES_DIR "/usr/share/games/fortunes"

/* A folder of text files as one byte string (a byte is a token); the
 * struct is the caller's (ct_text_fini). */
typedef struct {
    uint8_t *bytes;  /* [n]: the regular files (not hidden, not .dat/.u8, no links) in sorted name order */
    int64_t n;
    int64_t ntrain;  /* floor(0.9 n): bytes [0, ntrain) train, [ntrain, n) validate */
    int nfiles;
} ct_text;

/* Loads dir (NULL: CT_FORTUNES_DIR, the Debian package fortunes) into
 * *out; CT_EIO naming the folder and the fix (the package to install, or
 * --data-dir) when it is missing or holds no text files. */
ct_status ct_text_load(const char *dir, ct_text *out);
/* Frees the bytes and zeroes *t; safe on a zeroed struct. */
void ct_text_fini(ct_text *t);
/* CT_EINVAL unless both splits hold a window of context + 1 bytes. */
ct_status ct_text_check(const ct_text *t, int64_t context);
/* First byte of training sample gidx (its index in the step's global batch)
 * of step: uniform in [0, ntrain - context - 1], from (seed, step, gidx)
 * only.  Needs ct_text_check to pass. */
int64_t ct_text_train_start(const ct_text *t, int64_t context, uint64_t seed, uint64_t step, int64_t gidx);
/* Training samples gidx0 .. gidx0+count-1 of step: *x the windows' first
 * context bytes, *y the next byte of each position, both I64 [count,
 * context] (CT_MEM_ACT; the caller releases them). */
ct_status ct_text_train_batch(const ct_text *t, int64_t context, uint64_t seed, uint64_t step, int64_t gidx0,
                              int64_t count, ct_tensor **x, ct_tensor **y);
/* Validation windows: floor((n - ntrain) / (context + 1)) of them, window w
 * the bytes [ntrain + w (context+1), ntrain + (w+1)(context+1)). */
int64_t ct_text_val_windows(const ct_text *t, int64_t context);
/* Windows w0 .. w0+count-1 as ct_text_train_batch shapes them. */
ct_status ct_text_val_batch(const ct_text *t, int64_t context, int64_t w0, int64_t count, ct_tensor **x,
                            ct_tensor **y);
/* Entropy in nats of the byte distribution of the whole text: the loss of
 * the best model that ignores context (the unigram baseline). */
double ct_text_unigram_entropy(const ct_text *t);

/* ---- deterministic data-parallel sampler ------------------------------- */

/* The order of an epoch is a permutation of [0, n) that depends only on
 * (seed, epoch), so every rank and every run computes the same one.  Global
 * batch b is perm[b*batch .. b*batch + batch); rank r of world W takes a
 * contiguous slice of it (sizes differ by at most one), so the samples of a
 * step and their order are the same for any world size. */
typedef struct {
    int64_t n;        /* samples in the data set */
    int64_t batch;    /* global batch size */
    uint64_t seed;
    int shuffle;      /* 0: identity order */
    int drop_last;    /* 1: a short last batch is skipped */
    int64_t epoch;    /* epoch of perm */
    int64_t *perm;    /* [n], the current epoch's order */
} ct_sampler;

/* Sets up a sampler at epoch 0. */
ct_status ct_sampler_init(ct_sampler *s, int64_t n, int64_t batch, uint64_t seed,
                          int shuffle, int drop_last);
/* Frees the permutation; safe on a zeroed or deinited struct. */
void ct_sampler_fini(ct_sampler *s);
/* Computes the order of epoch (>= 0). */
ct_status ct_sampler_set_epoch(ct_sampler *s, int64_t epoch);
/* Global batches in an epoch. */
int64_t ct_sampler_nbatches(const ct_sampler *s);
/* Samples in global batch b (batch, or fewer for a short last batch); 0 if b is out of range. */
int64_t ct_sampler_batch_size(const ct_sampler *s, int64_t b);
/* Writes rank's slice of global batch b into idx (room for ceil(batch/world)
 * entries; batch entries always suffice) and its length into *count, which is
 * 0 when the batch has fewer samples than the world has ranks. */
ct_status ct_sampler_batch(const ct_sampler *s, int64_t b, int rank, int world,
                           int64_t *idx, int64_t *count);
/* Position within global batch b where rank's slice starts (ranks' slices
 * are contiguous and in rank order), for ct_batch.sample0. */
int64_t ct_sampler_first(const ct_sampler *s, int64_t b, int rank, int world);

/* ---- safetensors ------------------------------------------------------- */

/* A loaded safetensors file: tensors sorted by name, plus string metadata. */
typedef struct ct_safetensors ct_safetensors;

/* Writes the n tensors under their names and nmeta string pairs of metadata
 * to path atomically (path.tmp.<pid>, fsync, rename, fsync of the
 * directory): a crash leaves the old file or the new one, never a mix.
 * Names must be unique, valid UTF-8 and not "__metadata__"; metadata keys
 * unique and valid UTF-8.  Tensors are laid out by element size then name,
 * as the Python library does, so every tensor is aligned in the file. */
ct_status ct_safetensors_save(const char *path, const char *const *names,
                              ct_tensor *const *tensors, int n,
                              const char *const *meta_keys, const char *const *meta_vals,
                              int nmeta);
/* A safetensors file written one tensor at a time (the header first, from
 * the shapes), for a state that is never whole in memory: the result is
 * the file ct_safetensors_save writes, byte for byte, committed atomically
 * the same way.  A heap handle: ct_safetensors_writer_destroy (which
 * removes an unfinished file). */
typedef struct ct_safetensors_writer ct_safetensors_writer;
/* Creates the temporary file and writes the header for the n tensors
 * (names, and the dtypes and shapes of shapes[i]: no data needed) and
 * metadata, as ct_safetensors_save would lay them out. */
ct_status ct_safetensors_writer_create(const char *path, const char *const *names, ct_tensor *const *shapes, int n,
                                       const char *const *meta_keys, const char *const *meta_vals, int nmeta,
                                       ct_safetensors_writer **out);
/* Writes tensor name's data (dtype and numel as announced), in any order, once each. */
ct_status ct_safetensors_writer_put(ct_safetensors_writer *w, const char *name, const ct_tensor *t);
/* Every tensor written: checksums into the header, fsync, rename over path.
 * On failure the file is removed; destroy w either way. */
ct_status ct_safetensors_writer_commit(ct_safetensors_writer *w);
/* NULL is a no-op. */
void ct_safetensors_writer_destroy(ct_safetensors_writer *w);
/* Reads and validates path (header, dtypes, shapes, offsets, sizes) and
 * every tensor's data into memory of its own (CT_MEM_OTHER).  *out is NULL
 * on failure, and the message names the file and the tensor or field.
 * path may also be a sharded checkpoint: an index "*.safetensors.index.json",
 * or a directory holding one (model.safetensors.index.json if there are
 * several).  Every shard the index lists is loaded and checked against it
 * (each listed tensor is in its file, each tensor of a listed file is
 * listed there, file names stay in the index's directory), and the result
 * is one object: tensors sorted by name across files, metadata from the
 * index's "metadata" (integer values, such as Hugging Face's total_size,
 * read as their decimal text). */
ct_status ct_safetensors_load(const char *path, ct_safetensors **out);
/* ---- sharded checkpoints (Hugging Face's layout) -------------------------
 * A directory of safetensors files (the shards) and an index
 * "<prefix>.safetensors.index.json":
 *   {"metadata": {"total_size": "<bytes of all tensors>", ...},
 *    "weight_map": {"<tensor name>": "<shard file name>", ...}}
 * Write the shards with ct_safetensors_save, then the index; the index is
 * what makes a new set of shards the checkpoint, so write it last.
 * ct_safetensors_load reads the whole checkpoint from the index or its
 * directory. */

/* Writes the index at path (its name must end in ".safetensors.index.json")
 * mapping tensor names[i] to the shard file files[i] (a bare file name in
 * the index's directory: no '/', no ".."), with nmeta string pairs of
 * metadata (pass "total_size", the bytes of all tensors, as Hugging Face
 * does; the writer cannot know it).  Atomic like ct_safetensors_save.
 * Names must be unique, metadata keys unique, all of it valid UTF-8. */
ct_status ct_safetensors_save_index(const char *path, const char *const *names, const char *const *files,
                                    int n, const char *const *meta_keys, const char *const *meta_vals,
                                    int nmeta);
/* Like ct_safetensors_load, but reads only the headers (and a sharded
 * checkpoint's index): every tensor has its name, dtype and shape, the F32,
 * BF16 and F16 ones no data (ct_tensor_data is NULL) until read with
 * ct_safetensors_read; the files stay open until ct_safetensors_destroy.
 * The same checks as a load, except that a tensor's checksum is checked
 * when a read covers it whole (ct_safetensors_verify checks all). */
ct_status ct_safetensors_open(const char *path, ct_safetensors **out);
/* Reads bytes [off, off + n) of tensor t (one of st's) into dst, by
 * position, from the file that holds it.  CT_EIO naming the file when the
 * read fails; CT_EFORMAT when a whole tensor fails its checksum. */
ct_status ct_safetensors_read(ct_safetensors *st, const ct_tensor *t, size_t off, size_t n, void *dst);
/* Tensor bytes read from st's files since it was opened (ct_safetensors_read). */
int64_t ct_safetensors_bytes_read(const ct_safetensors *st);
/* Same as ct_safetensors_load for a file already in memory (say, read once
 * and broadcast to every rank); name stands for the file in messages. */
ct_status ct_safetensors_load_mem(const void *data, size_t len, const char *name, ct_safetensors **out);
/* Frees the file object and its tensors (retain a tensor to keep it); NULL is a no-op. */
void ct_safetensors_destroy(ct_safetensors *st);
/* Number of tensors. */
int ct_safetensors_count(const ct_safetensors *st);
/* Name of tensor i (0 <= i < count), in sorted order. */
const char *ct_safetensors_name(const ct_safetensors *st, int i);
/* Tensor i, owned by st. */
ct_tensor *ct_safetensors_tensor(const ct_safetensors *st, int i);
/* Tensor called name, owned by st; NULL if absent. */
ct_tensor *ct_safetensors_find(const ct_safetensors *st, const char *name);
/* Metadata value for key; NULL if absent. */
const char *ct_safetensors_meta(const ct_safetensors *st, const char *key);
/* Number of metadata entries, and entry i's key and value (sorted by key). */
int ct_safetensors_meta_count(const ct_safetensors *st);
const char *ct_safetensors_meta_key(const ct_safetensors *st, int i);
const char *ct_safetensors_meta_value(const ct_safetensors *st, int i);

/* ---- checkpoints that commit as one unit -------------------------------
 * A checkpoint is often several files (model and optimizer state, shards and
 * their indexes) that are only useful together.  To replace one unit by the
 * next without ever leaving a mix:
 *   1. ct_ckpt_recover(anchor): finish any earlier commit a crash interrupted;
 *   2. write every part that replaces a file to ct_ckpt_staged_path(final)
 *      (ct_safetensors_save and ct_safetensors_save_index take staged paths);
 *      parts with new, unique names can be written in place;
 *   3. ct_ckpt_commit(anchor, finals, n): writes the journal "<anchor>.commit"
 *      listing the staged parts (atomically: that write is the commit point),
 *      renames each over its final name and removes the journal.
 * A crash before the journal leaves the previous unit untouched (staged
 * files are left over until the next save's ct_ckpt_discard); a crash after it
 * is finished by the next ct_ckpt_recover.  Readers call ct_ckpt_recover
 * before loading (from one process: it renames).  All parts sit in the
 * anchor's directory.  CTRAIN_FAULT_KILL_AT=k kills the process at the k-th
 * file-system step of a save, for crash tests. */

/* "<final>.staged" into buf (n bytes); CT_EINVAL if it does not fit. */
ct_status ct_ckpt_staged_path(const char *final, char *buf, size_t n);
/* Makes the n staged parts (given by their final paths, all in anchor's
 * directory) current as one unit; see above.  On failure before the commit
 * point the previous unit is still current, and the message says why. */
ct_status ct_ckpt_commit(const char *anchor, const char *const *finals, int n);
/* Finishes an interrupted commit of anchor's unit (nothing to do without a
 * journal).  CT_EIO naming the file when a rename fails. */
ct_status ct_ckpt_recover(const char *anchor);
/* The writer's clean-up, for a save that failed before its commit point
 * and, before a save, for what a killed one left: removes the staged files
 * of the n parts (given by their final paths) and the temporary files of
 * their interrupted writes ("<final>.staged.tmp.*", "<final>.tmp.*").
 * Does nothing while anchor's journal exists (then the staged files are
 * committed, and ct_ckpt_recover finishes them).  Best effort: a file that
 * cannot be removed stays.  Returns 1 when a staged part was there without
 * a journal (the unit is certainly not committed), else 0. */
int ct_ckpt_discard(const char *anchor, const char *const *finals, int n);

/* Checks every tensor of the safetensors file or sharded checkpoint at
 * path against the crc32 checksums ct_safetensors_save stores in each file
 * ("ctrain.crc32" metadata; ct_safetensors_load checks them too).
 * *checked gets the tensors verified, *unchecked those in files written
 * without checksums.  CT_EFORMAT naming the file and tensor on a mismatch. */
ct_status ct_safetensors_verify(const char *path, int *checked, int *unchecked);

#ifdef __cplusplus
}
#endif
#endif

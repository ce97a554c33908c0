/*
 * The shard table: which ranges of which parameters this rank owns, the
 * optimizer slot of each, and the state I/O that follows from it (whole
 * tensors gathered on a root one at a time, this rank's pieces as
 * "name[.buf]@offset", owned ranges loaded out of full tensors).  ZeRO-1/2
 * (zero/) and FSDP (fsdp/) each fill one; neither reaches into the other's
 * structs.  Private to src/parallel.
 */
#ifndef CTRAIN_PARALLEL_SHARDS_H
#define CTRAIN_PARALLEL_SHARDS_H

#include "internal.h"

typedef struct {
    ct_param **tp;      /* [ntp] the partitioned parameters, model order */
    int ntp;
    ct_partition pt;    /* their ranges and owners (ranges of one parameter adjacent, in order) */
    int *first;         /* [ntp] index of the parameter's first range in pt */
    int *slot;          /* [pt.n] optimizer slot of a range this rank owns, else -1 */
    ct_group **pg;      /* [ntp] the group parameter i is partitioned over (NULL table: all s->g);
                           owners count in it (FSDP: each unit's shard group) */
    char *quiet;        /* [ntp] or NULL: 1 where this rank's pieces are a replica's (FSDP hybrid):
                           it takes part in gathers but another rank reports the state */
    /* NULL: an owned range's values and state are the memory its optimizer slot points at.  Else
     * where they rest (FSDP's store): moves elements [at, at + n) of range k's buffer b (b < 0: the
     * values) into buf (write 0) or from it (write 1); the state I/O then goes through it in pieces
     * of at most CT__SHARDS_CHUNK elements and never holds a range. */
    ct_status (*io)(ct_strategy *s, int k, int b, int64_t at, int64_t n, float *buf, int write);
} ct__shards;

/* Elements a load moves through the table's io at a time (1 MiB of f32). */
#define CT__SHARDS_CHUNK 262144

/* Frees the table's arrays (the parameters are the model's); zeroes sh. */
void ct__shards_fini(ct__shards *sh);
/* Index of p among sh's parameters, or -1. */
int ct__shards_index(const ct__shards *sh, const ct_param *p);
/* Parameter i's optimizer buffer b (b < 0: its values) as a full tensor on
 * rank root of its group, *out NULL elsewhere (collective over the group:
 * owners copy their ranges into zeros and the group sums on root). */
ct_status ct__shards_gather(ct_strategy *s, const ct__shards *sh, int i, int b, int root, ct_tensor **out);
/* For a sharded save: *roots (ct_free) gets, for every parameter i, the
 * rank of its group that writes it, balanced by bytes (largest first onto
 * the least loaded rank; the same on every rank). */
ct_status ct__shards_roots(ct_strategy *s, const ct__shards *sh, int **roots);
/* 1 when this rank reports parameter i's tensor gathered on root (of i's group). */
int ct__shards_reports(ct_strategy *s, const ct__shards *sh, int i, int root);
/* Every parameter's optimizer state gathered one tensor at a time on its
 * root (roots[i], or rank 0 with roots NULL), given to fn there and freed,
 * then "step" on rank 0 (ct_strategy_state_foreach). */
ct_status ct__shards_optim_each(ct_strategy *s, const ct__shards *sh, const int *roots, int shapes_only,
                                ct_state_fn fn, void *ud);
/* The optimizer state into out: consolidated on rank 0, or (sharded) each
 * parameter's on its ct__shards_roots rank. */
ct_status ct__shards_optim_state(ct_strategy *s, const ct__shards *sh, int sharded, ct_state *out);
/* This rank's owned ranges as pieces (ct_strategy_local_state); with optim
 * 0 rank 0 adds the parameters outside the table and the buffers whole. */
ct_status ct__shards_local_state(ct_strategy *s, const ct__shards *sh, int optim, ct_state *out);
/* The same pieces one at a time to fn (views of the slots' memory, or with
 * io read into a tensor of their own for the call); shapes_only: no data. */
ct_status ct__shards_local_each(ct_strategy *s, const ct__shards *sh, int optim, int shapes_only, ct_state_fn fn,
                                void *ud);
/* The owned ranges of every optimizer buffer out of full tensors (any world
 * size loads any checkpoint), and the step. */
ct_status ct__shards_load_optim(ct_strategy *s, const ct__shards *sh, const char *const *names,
                                ct_tensor *const *ts, int n);
/* The owned ranges of p's values out of the full src (p outside the table:
 * all of it into p->data). */
ct_status ct__shards_load_param(ct_strategy *s, const ct__shards *sh, ct_param *p, const ct_tensor *src);

#endif

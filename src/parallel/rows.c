/*
 * Which rows of a step's global batch a rank trains on, and the check that
 * ranks were given rows that fit together: ct_strategy_local_rows cuts a
 * batch by data slice (ct_strategy_data_rank), and ct__check_rows catches,
 * across the group, the two mistakes that otherwise give wrong numbers
 * without a word.
 */
#include <string.h>

#include "internal.h"

ct_status ct_strategy_local_rows(const ct_strategy *s, int64_t global_rows, int64_t *first, int64_t *count)
{
    *first = *count = 0;
    if (global_rows < 0)
        return ct_error(CT_EINVAL, "local rows: global_rows is %lld; give the step's batch size (0 or more)",
                        (long long)global_rows);
    int r, n;
    ct_strategy_data_rank(s, &r, &n);
    /* As ct_sampler_first cuts a global batch: the first global_rows % n slices take one row more. */
    int64_t q = global_rows / n, rem = global_rows % n;
    *first = (int64_t)r * q + (r < rem ? r : rem);
    *count = q + (r < rem);
    return CT_OK;
}

/* A cheap fingerprint of a tensor's bytes (8 at a time), to tell whether two
 * ranks were given the same batch without sending it. */
static int64_t bytes_hash(const ct_tensor *t)
{
    const unsigned char *p = ct_tensor_data(t);
    size_t n = p ? ct_tensor_bytes(t) : 0;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ n, w;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&w, p + i, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 29;
    }
    for (; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return (int64_t)h;
}

enum { R_DRANK, R_ROWS, R_SAMPLE0, R_GLOBAL, R_HX, R_HY, R_JOINED, R_N };

/* Two mistakes that give wrong numbers without an error, caught across the
 * group before the step: ranks with different row counts and no
 * global_rows (each would divide by its own count), and ranks that must
 * share a slice of the batch (the stages of one pipeline:
 * ct_strategy_data_rank) given different ones (stage 0 would train on one
 * slice's inputs, the last stage on another's targets).  Costs one small
 * all-gather, and only when either can happen. */
ct_status ct__check_rows(ct_strategy *s, const ct_batch *b, int64_t nrows, int alone)
{
    int gsize = s->g && !alone ? ct_group_size(s->g) : 1;
    if (gsize < 2) return CT_OK;
    int drank, dsize, stage, nstages;
    ct_strategy_data_rank(s, &drank, &dsize);
    int shared = dsize < gsize;
    if (!shared && b->global_rows) return CT_OK;
    ct_strategy_pipe_stage(s, &stage, &nstages);
    int64_t me[R_N] = {stage < 0 ? -1 : drank, nrows, b->sample0, b->global_rows, 0, 0, s->joined};
    if (shared) {
        me[R_HX] = bytes_hash(b->x);
        me[R_HY] = bytes_hash(b->y);
    }
    /* Every rank must reach the allgather, even one short of memory: up to
     * 64 ranks on the stack; beyond, the group agrees on the buffer first. */
    int64_t local[R_N * 64], *all = gsize <= 64 ? local : ct_alloc(sizeof(int64_t) * R_N * (size_t)gsize, CT_MEM_OTHER);
    ct_status st = gsize <= 64 ? CT_OK : ct_group_check(s->g, all ? CT_OK : CT_ENOMEM);
    if (st != CT_OK) {
        ct_free(all);
        return st;
    }
    st = ct_group_allgather(s->g, me, all, R_N, CT_I64, NULL);
    for (int r = 1; st == CT_OK && r < gsize; r++) {
        const int64_t *a = all, *o = all + (size_t)R_N * (size_t)r;
        if (!b->global_rows && !a[R_JOINED] && !o[R_JOINED] && a[R_ROWS] != o[R_ROWS] && !shared)
            st = ct_error(CT_EINVAL, "train step: ranks were given different row counts (rank 0 has %lld, rank %d "
                          "has %lld) and ct_batch.global_rows is 0, so each would average over its own rows; "
                          "set global_rows to the step's batch over all ranks (ct_strategy_join gives it for "
                          "uneven data), or give every rank the same rows",
                          (long long)a[R_ROWS], r, (long long)o[R_ROWS]);
    }
    for (int r = 0; st == CT_OK && shared && r < gsize; r++)
        for (int q = r + 1; st == CT_OK && q < gsize; q++) {
            const int64_t *a = all + (size_t)R_N * (size_t)r, *o = all + (size_t)R_N * (size_t)q;
            if (a[R_DRANK] < 0 || a[R_DRANK] != o[R_DRANK]) continue;
            if (memcmp(a + 1, o + 1, sizeof(int64_t) * (R_N - 1)))
                st = ct_error(CT_EINVAL, "train step: ranks %d and %d hold stages of one pipeline (data slice %lld) but "
                              "were given different rows (%lld rows from sample %lld, and %lld rows from sample "
                              "%lld%s); every rank of a pipeline must get the same slice of the batch, inputs and "
                              "targets: take it from ct_strategy_local_rows (or ct_strategy_data_rank), not "
                              "from the rank number", r, q, (long long)a[R_DRANK], (long long)a[R_ROWS],
                              (long long)a[R_SAMPLE0], (long long)o[R_ROWS], (long long)o[R_SAMPLE0],
                              a[R_ROWS] == o[R_ROWS] && a[R_SAMPLE0] == o[R_SAMPLE0] ? ", different data" : "");
        }
    if (all != local) ct_free(all);
    return st;
}

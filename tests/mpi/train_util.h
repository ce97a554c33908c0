/* Helpers the multi-rank training tests share: a deterministic global
 * batch per step, row views, the sampler's split of rows over ranks, one
 * train step over a rank's slice, a small sequential model for the pipe
 * and offload tests, and comparisons of models and states. */
#ifndef CTRAIN_TESTS_TRAIN_UTIL_H
#define CTRAIN_TESTS_TRAIN_UTIL_H

#include <math.h>
#include <string.h>

#include "../test.h"

#define IN 12
#define NCLS 5

/* Global batch of a step: [n, IN] inputs and [n] targets, the same on every rank. */
void global_batch(int step, int64_t n, ct_tensor **x, ct_tensor **y);
/* Another global batch of a step (other inputs and targets, the same on
 * every rank): the one step_on_data_rank trains on. */
void global_batch2(int step, int64_t n, ct_tensor **x, ct_tensor **y);
/* Rows [start, start + count) of t as a view. */
ct_tensor *rows(ct_tensor *t, int64_t start, int64_t count);
/* SGD (lr 0.1, momentum 0.9) or AdamW (lr 0.01). */
ct_optim_opts optim_for(ct_optim_kind k);
/* Every parameter of a and b within tol (absolute and relative). */
void assert_params_close(ct_module *a, ct_module *b, double tol);
/* Rank r's contiguous slice of n rows, the first n % world ranks one more
 * (the sampler's split). */
void slice(int64_t n, int rank, int world, int64_t *first, int64_t *count);
/* One train step over this rank's slice of the global batch of `step`. */
void step_on_slice(ct_strategy *s, int step, int64_t n, int rank, int world, ct_step_out *out);
/* One optimizer step of s (zero_grad, train step, with clip > 0 clipping to
 * clip with the norm into *norm, step) on its rows (ct_strategy_data_rank;
 * "none": all) of global_batch2 of `step`; out (may be NULL) gets the train
 * step's result. */
void step_on_data_rank(ct_strategy *s, int step, int64_t n, double clip, float *norm, ct_step_out *out);
/* Its first half: zero_grad and the train step, no clip, no step. */
void train_on_data_rank(ct_strategy *s, int step, int64_t n, ct_step_out *out);
/* steps optimizer steps of ds (this rank's slice of n rows) and of the
 * one-process reference rs (all n rows) in lock step: train step, step,
 * zero_grad. */
void steps_vs_one(ct_strategy *ds, ct_strategy *rs, int steps, int64_t n, int rank, int world);
/* One step of a and b in lock step, both on this rank's slice of n rows:
 * train step, step, zero_grad. */
void step_both(ct_strategy *a, ct_strategy *b, int step, int64_t n, int rank, int world);
/* 8 children with dropout, one stage or slice each: Linear(IN, 16), Tanh,
 * Dropout(0.25), Linear(16, mid), ReLU, Linear(mid, 16), Tanh, Linear(16, NCLS);
 * weights from seed. */
ct_module *mlp8(uint64_t seed, int64_t mid);
/* The FSDP tests' model, nested units and all: 0 linear(IN, 16), 1 tanh,
 * 2 (linear, relu, linear), 3 layernorm, [dropout 0.25], then linear(16, NCLS). */
ct_module *fsdp_nested(uint64_t seed, int dropout);
/* Relative L2 distance of two states over the names of a (on rank 0 only
 * for a sharded strategy); tensors of b missing from a fail. */
double state_rel_l2(const ct_state *a, const ct_state *b);
/* The two strategies' whole model states (collective) have a relative L2
 * below tol on rank 0; else the test fails naming what. */
void states_close(ct_strategy *a, ct_strategy *b, double tol, const char *what);

/* A module with children "used" and "unused" that runs only child
 * branch_take (0: "used"; a test may switch it to change the graph). */
extern int branch_take;
ct_module *branch_create(ct_module *used, ct_module *unused);

/* A module that calls f twice, y = f(f(x)), so f's gradients arrive twice
 * per backward; f is its child "f". */
ct_module *twice_create(ct_module *f);

/* The gpt of the multi-rank tests: 2 blocks, 2 heads, width 8, GPT_CTX
 * tokens of GPT_VOCAB, dropout 0.1, its matrices normal(0, 0.3) from seed
 * (so a few steps move the loss visibly). */
#define GPT_VOCAB 13
#define GPT_CTX 6
ct_module *gpt_tiny(uint64_t seed);
/* One train step of s on this rank's slice (ct_strategy_data_rank) of the
 * global token batch of `step` (n sequences), or on all of it (whole);
 * *loss gets the step's loss sum. */
void gpt_step(ct_strategy *s, int step, int64_t n, int whole, double *loss);

#endif

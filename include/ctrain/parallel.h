/*
 * ctrain parallel: training strategies.  One interface drives a training
 * step whatever the strategy: forward, backward (gradients are synchronised
 * across ranks by the time it returns, as in PyTorch where loss.backward()
 * finishes DDP's allreduce), clip, step, zero_grad, no_sync, state for
 * checkpoints, and a memory/timing report.  A strategy is a flag, not a fork
 * of the loop:
 *   "none"  one replica, no communication (a world of 1, or every rank alone)
 *   "ddp"   DistributedDataParallel: replicas, bucketed gradient allreduce
 *           started from grad-ready hooks so it overlaps backward
 *   "zero1", "zero2"  ZeRO: optimizer state (and gradients) sharded
 *   "fsdp"  FullyShardedDataParallel (ZeRO-3): parameters, gradients and
 *           optimizer state sharded in units, gathered around each unit's
 *           forward and backward (sharding=full|grad_op|none|hybrid)
 *   "pipe"  pipeline parallelism: a sequential cut into stages, one per
 *           rank, micro-batches flowing through them (GPipe or 1F1B), with
 *           data-parallel replicas of the pipeline when ranks allow; a
 *           parameter tied across stages trains as one (gradients summed
 *           over its copies, counted and saved once)
 *   "offload"  fairscale's OffloadModel: a sequential cut into slices whose
 *           parameters, gradients and optimizer state live in a file on
 *           local disk; only the slices in use are in memory, the next one
 *           loads while this one computes (each rank offloads its replica
 *           and allreduces a slice's gradients as DDP would)
 *
 * The strategy owns the step: it builds the optimizer over what this rank
 * owns, runs micro-batches (ct_strategy_train_step), synchronises, clips
 * over whatever is sharded, steps, and saves and loads state.  Before any
 * of that, ct_strategy_plan says what a strategy would take per rank, in the
 * categories of the memory report, from the model's shapes alone.
 *
 * Ownership: the strategy borrows the model and the group (they must
 * outlive it) and owns its optimizer.  While it lives the model is held
 * (ct_module_hold): destroying it or wrapping it again is CT_ESTATE, and so
 * is ct_comm_finalize (destroy strategies first).
 *
 * Collective calls: every function below that says "collective" must be
 * called by every rank of the group, whatever the strategy (a replicated
 * one may not communicate in it today; a sharded one does).  A call made on
 * some ranks only ends, after CTRAIN_COMM_TIMEOUT, with a message naming the
 * call; with CTRAIN_DEBUG=collectives at once, naming the calls each rank
 * is in.  A strategy may re-point parameter
 * data and gradients into storage it owns (DDP: gradients are views into
 * bucket buffers); destroying the strategy gives every parameter memory of
 * its own again.
 */
#ifndef CTRAIN_PARALLEL_H
#define CTRAIN_PARALLEL_H

#include "comm.h"
#include "nn.h"
#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- bucket assignment ------------------------------------------------- */

/* PyTorch's compute_bucket_assignment_by_size: tensors (in the given order)
 * go into per-key (dtype) buckets; a bucket closes when its bytes reach the
 * current limit of its key; each key walks through limits in turn and keeps
 * the last one; open buckets are appended at the end; the result is sorted
 * by each bucket's smallest index.  Output: bucket_of[i] for each tensor and
 * *nbuckets; bucket b's members are the i with bucket_of[i] == b, ascending. */
ct_status ct_bucket_assign(const size_t *bytes, const int *keys, int n, const size_t *limits,
                           int nlimits, int *bucket_of, int *nbuckets);

/* ---- partition: which rank owns which parameter range ------------------ */

/* Elements [offset, offset + count) of trainable parameter `param` (an index
 * into the list the partition was made from) belong to rank `owner`. */
typedef struct {
    int param;
    int64_t offset, count;
    int owner;
} ct_part_range;

/* Ranges in model order (param, then offset); load[r] is rank r's element count. */
typedef struct {
    int nranks, n;
    ct_part_range *ranges;
    int64_t *load;
} ct_partition;

/* Assigns nparams parameters of numels[i] elements to nranks ranks: whole
 * parameters, largest first onto the least loaded rank (fairscale's OSS),
 * deterministic (the same on every rank); or, with split, equal contiguous
 * pieces of the parameters laid end to end (DeepSpeed's flat partition:
 * exact balance, a parameter may straddle ranks).  Free with
 * ct_partition_fini. */
ct_status ct_partition_init(ct_partition *pt, const int64_t *numels, int nparams, int nranks, int split);
void ct_partition_fini(ct_partition *pt);
/* "rank 0 owns N elements: 0.weight 2.bias[0:512] ...", a line per rank, into
 * buf (n bytes); names[i] names parameter i (NULL: "#i").  CT_EINVAL if n is
 * too small. */
ct_status ct_partition_describe(const ct_partition *pt, const char *const *names, char *buf, size_t n);

/* ---- FSDP's units, for planning ---------------------------------------- */

/* One FSDP unit as ct_strategy_create("fsdp", ...) would cut the model. */
typedef struct {
    int64_t numel;   /* elements of its f32 flat parameter */
    int64_t low;     /* elements of its bf16 one (param_dtype=bf16: the weights with compute copies) */
    int is_root;     /* the model itself (keeps its parameters from forward to backward) */
    int replicated;  /* an ignored module's: never sharded */
} ct_fsdp_unit;

/* The units fsdp makes of model under opts (its key=value options), in
 * pre-order, without wrapping anything or communicating (for tools that
 * plan a run, such as `ctrain estimate`): the first min(*n, max) go to
 * units, *n gets their number.  CT_EINVAL for options fsdp refuses. */
ct_status ct_fsdp_plan(ct_module *model, const char *opts, ct_fsdp_unit *units, int max, int *n);

/* An auto-wrap policy (PyTorch's auto_wrap_policy, lambda_auto_wrap_policy):
 * 1 if module m becomes an FSDP unit.  nonwrapped_numel: trainable parameter
 * elements under m (its own and its descendants') that no unit the policy
 * chose below m holds, as PyTorch passes it (a size-based policy compares it
 * with a minimum); ud is the caller's. */
typedef int (*ct_wrap_policy_fn)(const ct_module *m, int64_t nonwrapped_numel, void *ud);
/* Asks policy about every module of model but the model itself (always a
 * unit), children before parents, and writes *out: opts (NULL: none) with
 * ",wrap_modules=" and the modules it picked, '+' between; free it with
 * ct_free.  The result is fsdp's options as ct_strategy_create,
 * ct_fsdp_plan and ct_strategy_plan take them (the callback is not kept).
 * Options' own wrap_kinds and wrap_min_params add their units on top.
 * CT_EINVAL for a NULL model or policy, or opts that set wrap_modules. */
ct_status ct_fsdp_auto_wrap(ct_module *model, ct_wrap_policy_fn policy, void *ud, const char *opts, char **out);

/* ---- memory planning ---------------------------------------------------- */

/* Predicted peak bytes per rank in the categories of ct_mem_report: each
 * column its own maximum over ranks; resident (param + grad + optim) the
 * peak of the three together on the largest rank, total adds act and comm. */
typedef struct {
    uint64_t param, grad, optim, act, comm, resident, total;
    /* The whole life, as the kernel sees it (resident pages; the runtime's
     * fixed RSS, MPI and libraries, comes on top): */
    uint64_t flat;   /* the largest flat (bucket, unit, slice), which the cache's bound follows */
    uint64_t cache;  /* the allocator cache's bound (ct_mem_get_cache_limit as the run would set it) */
    uint64_t shared; /* other ranks' shared-memory pages mapped into this one (DDP's and ZeRO-1's
                        buckets are windows every local rank touches; the plan takes one node),
                        included in setup, save and life */
    uint64_t setup;  /* at the set-up peak: building the model, then wrapping it */
    uint64_t save;   /* at a full save's peak, on rank 0, which holds what it writes */
    uint64_t life;   /* the whole life's peak: the largest of setup, total plus the cache (at
                        most its bound, at most a step's act and comm and two flats), and save
                        (whose transients reuse the cached blocks first) */
    int life_phase;  /* the ct_mem_phase of life: CT_PHASE_WRAP, CT_PHASE_TRAIN or CT_PHASE_SAVE */
    /* fsdp offload=optim|params|all: */
    uint64_t store;  /* bytes of this rank's shard parts in the store (the largest rank's) */
    uint64_t moved;  /* bytes read plus written to the store per optimizer step */
} ct_mem_plan;

/* What a run is, besides the model and the strategy's options. */
typedef struct {
    int world;                     /* ranks */
    int64_t batch;                 /* global batch rows per step, as ct_strategy_train_step's */
    int in_ndim;                   /* one sample's input shape (no batch dim) */
    int64_t in_shape[CT_MAX_DIMS];
    uint64_t sample_bytes;         /* bytes a loader holds per sample: input and target */
    ct_optim_opts optim;           /* the optimizer the strategy would build */
} ct_plan_spec;

/* The per-rank memory strategy kind would take to train model under opts
 * (as ct_strategy_create takes them) over spec->world ranks, from shapes
 * alone: nothing is wrapped, allocated for the model or communicated.  Each
 * strategy's figures come from the rules its code follows (the partition,
 * FSDP's units, the pipe balance, the offload split, the mixed-precision
 * policy, the optimizer's state layout, the layers' act_cost; see
 * src/parallel/plan*.c), so the plan and ct_strategy_memory compare line by
 * line.  CT_EINVAL for options the strategy refuses or a spec that does not
 * fit (a pipe with more stages than ranks); CT_EUNSUPPORTED for a kind that
 * runs every rank alone ("none") with world > 1. */
ct_status ct_strategy_plan(const char *kind, ct_module *model, const char *opts, const ct_plan_spec *spec,
                           ct_mem_plan *out);

/* ---- pipeline balance -------------------------------------------------- */

/* Cuts n layers of weights w (negative counts as 0) into nstages contiguous
 * stages of at least one layer each so that the heaviest stage is as light
 * as possible; balance[k] (room for nstages) gets stage k's layer count.
 * CT_EINVAL if n < nstages. */
ct_status ct_pipe_balance_weights(const double *w, int n, int nstages, int *balance);
/* balance for sequential seq by its children's parameter counts (fairscale's
 * balance_by_size); a parameter shared by several children (a tied weight)
 * counts in each, as each stage using it keeps a copy.  CT_EINVAL if seq is not a sequential or has fewer
 * children than nstages. */
ct_status ct_pipe_balance_by_params(ct_module *seq, int nstages, int *balance);
/* balance by measured time: runs every child's forward and backward on
 * sample (a batch of the model's input; the output must be F32) twice and
 * weighs each child by the second round's time (fairscale's
 * balance_by_time).  Zeroes seq's gradients afterwards. */
ct_status ct_pipe_balance_by_time(ct_module *seq, ct_tensor *sample, int nstages, int *balance);

/* ---- the strategy interface ------------------------------------------- */

typedef struct ct_strategy ct_strategy;

/* Options are "key=value" pairs separated by commas, parsed by the strategy:
 * a strategy's options grow without breaking any caller (no struct layout
 * to keep), the command line passes them through unchanged (--strategy-opt),
 * and a key the strategy does not know is an error that lists the ones it
 * does.  Keys every strategy takes:
 *   grad_accum=N        micro-batches per ct_strategy_train_step (1)
 *   param_dtype=f32|bf16  mixed precision: dtype of the compute copies of
 *                       the parameters (f32 master weights and optimizer
 *                       state stay; norm layers' parameters stay f32)
 *   reduce_dtype=f32|bf16|f16  dtype gradients are reduced in (f32)
 *   buffer_dtype=f32|bf16  precision buffers (batchnorm statistics) are held
 *                       at (f32; not pipe or offload)
 * DDP's keys: bucket_cap_mb (auto: 25 MiB on one node, as PyTorch's; across
 * nodes a sixteenth of the gradient bytes, 1 to 25 MiB), first_bucket_mb (1), broadcast_buffers
 * (1), find_unused_parameters (0), rebuild_buckets (1), static_graph (0);
 * and ddp's alone, post-local SGD: local_sgd (off|none|node: after
 * local_sgd_start (100) steps, gradients are reduced over no one or the
 * node's ranks), average_period (4: the parameters' mean over the group
 * every this many steps, from average_warmup (auto: local_sgd_start)).
 * Every strategy whose ranks share each batch (ddp, zero1, zero2, fsdp)
 * takes sync_batchnorm (0): batchnorm statistics over the whole batch.
 * pipe's keys: stages (auto), balance (children per stage, "3:3:2"), chunks
 * (4), schedule (gpipe|1f1b), checkpoint (always|except_last|never), dp
 * (ddp|zero1: between a stage's replicas), deferred_batch_norm (0), and
 * DDP's for its replicas.
 * offload's keys: slices (4), balance (children per slice, "3:3:2"),
 * checkpoint_activation (0), microbatches (1; more need
 * checkpoint_activation or a model with checkpoint wrappers,
 * ct_module_apply_activation_checkpointing), dir (the store's directory: $TMPDIR or /tmp),
 * max_resident_mb (auto: no bound; else the bound on param + grad + optim
 * bytes, refused at wrap when the largest slice cannot fit), prefetch (1),
 * drop_cache (1: the store's pages leave the page cache after each I/O),
 * store (file: in dir on disk; memory: a RAM pool, counted as "other").
 * ct_strategy_help lists every key of a kind with its default. */

/* Writes the keys kind accepts, one per line ("key=default  meaning"), to
 * buf (n bytes).  CT_EINVAL for an unknown kind. */
ct_status ct_strategy_help(const char *kind, char *buf, size_t n);

/* Checks opts against the keys kind takes, exactly as ct_strategy_create
 * parses them, without a model or a group (for tools that plan a run, such
 * as `ctrain estimate`).  With buf != NULL writes every key's value (the
 * given one, else the default), one "key=value" per line, into buf (n
 * bytes).  CT_EINVAL naming the unknown kind, the key the kind does not take
 * or the bad value, or a buf too small. */
ct_status ct_strategy_check_opts(const char *kind, const char *opts, char *buf, size_t n);

/* Timings of the last step, in seconds, and how much communication hid
 * behind backward. */
typedef struct {
    double forward, backward, comm_wait, optimizer;
    double comm_total;  /* sum over buckets of (allreduce end - start) */
    double overlap;     /* 1 - comm_wait / comm_total, clipped to [0,1]; 1 when no comm */
    int nbuckets;
    double io_total;    /* offload: seconds the store's I/O thread spent reading and writing */
    double io_wait;     /* offload: seconds the step waited for it (io_total - io_wait was hidden) */
    double io_bytes;    /* fsdp offload: bytes the store read plus wrote (the step and the passes before it) */
} ct_step_stats;

/* Wraps model for training over group g (NULL: the world) with the strategy
 * named kind (one of ct_strategy_list(): none, ddp, zero1, zero2, fsdp,
 * pipe, offload), options opts (NULL or "" for defaults), and builds the
 * optimizer described by optim over what this rank owns (whole parameters
 * for ddp).  Collective over g for every kind but "none": all ranks call it
 * with the same arguments; parameters and buffers are broadcast from rank
 * 0; a model that differs across ranks is an error on every rank.  A kind
 * that communicates on a group of one rank logs a warning (nothing to
 * shard: started without mpirun?).  CT_ESTATE if model is already wrapped
 * by a live strategy. */
ct_status ct_strategy_create(const char *kind, ct_module *model, const ct_optim_opts *optim,
                             ct_group *g, const char *opts, ct_strategy **out);
/* Unwraps (parameters get tensors of their own again) and frees the
 * strategy and its optimizer; NULL is a no-op.  It gathers nothing: the
 * parameters a strategy keeps in pieces or in a store (fsdp, offload) leave
 * without memory, unless ct_strategy_summon_full_params (every rank) came
 * first, which is the explicit unwrap to a whole model.  A model left
 * without values cannot be wrapped again (CT_ESTATE). */
void ct_strategy_destroy(ct_strategy *s);
/* "none", "ddp", "zero1", "zero2", "fsdp", "pipe" or "offload". */
const char *ct_strategy_kind(const ct_strategy *s);
/* Which rank owns which parameter range (sharded strategies), else NULL.
 * Parameter indices count the trainable parameters in model order. */
const ct_partition *ct_strategy_partition(const ct_strategy *s);
/* Under "pipe": this rank's stage (-1 if it sits out) and the number of
 * stages; any other strategy: 0 of 1. */
void ct_strategy_pipe_stage(const ct_strategy *s, int *stage, int *nstages);
/* Names accepted by ct_strategy_create, comma separated. */
const char *ct_strategy_list(void);
/* Under "offload": the number of slices and how many may be resident at
 * once (1: no prefetch, 2: the next slice loads meanwhile, 3: also a
 * slice's gradient allreduce overlaps the next); any other strategy: 0, 0. */
void ct_strategy_offload_info(const ct_strategy *s, int *nslices, int *ahead);
/* Children per slice when offload cuts sequential seq into nslices (room
 * for nslices in sizes): a slice closes once the slices so far hold their
 * share of the parameters, the last takes the rest, every slice has a child
 * (fairscale's OffloadModel split); a parameter several children list (a
 * tied weight) counts once, at the first.  CT_EINVAL if seq is not a sequential
 * or has fewer children than nslices. */
ct_status ct_offload_split(ct_module *seq, int nslices, int *sizes);
/* Fault injection for tests: the n-th offload store read or write from now
 * (0 = the next) fails, a write as a full disk (ENOSPC), a read as EIO;
 * -1 turns it off. */
void ct_offload_fail_io_after(long n);

/* ---- one training step, the strategy's way ----------------------------- */

/* A loss: from the model's output and the targets, the mean loss over the
 * rows and (dout != NULL) a new tensor with d(mean loss)/d(out). */
typedef ct_status (*ct_loss_fn)(ct_tensor *out, ct_tensor *target, void *ud, float *loss,
                                ct_tensor **dout);
/* Softmax cross-entropy (ct_cross_entropy with ignore_index -100); ud unused. */
ct_status ct_loss_cross_entropy(ct_tensor *out, ct_tensor *target, void *ud, float *loss,
                                ct_tensor **dout);

/* This rank's rows of a step's global batch of global_rows rows, for any
 * strategy: rows [*first, *first + *count), contiguous, cut as evenly as
 * ct_sampler_first cuts them, by data slice (ct_strategy_data_rank), so
 * the stages of one pipeline get the same rows.  Pass *first as
 * ct_batch.sample0 and global_rows as ct_batch.global_rows.  CT_EINVAL for
 * a negative global_rows. */
ct_status ct_strategy_local_rows(const ct_strategy *s, int64_t global_rows, int64_t *first, int64_t *count);

/* This rank's share of one step's global batch. */
typedef struct {
    ct_tensor *x;         /* inputs [rows, ...] */
    ct_tensor *y;         /* targets [rows, ...] */
    int64_t global_rows;  /* rows of the step's batch over all ranks (0: rows x group size, and
                             ranks with different rows are an error: give it for uneven rows) */
    int64_t sample0;      /* index of x's first row within the global batch (dropout keys on it) */
} ct_batch;

/* What a train step measured on this rank. */
typedef struct {
    double loss_sum;      /* sum over this rank's rows of the loss (mean x rows per micro-batch) */
    int64_t rows;
} ct_step_out;

/* Forward, loss and backward over this rank's batch in grad_accum
 * micro-batches (contiguous row ranges), then the synchronisation: when it
 * returns, the gradients are the mean loss gradient over the global batch,
 * however rows fall over ranks and micro-batches.  ctx gives training,
 * seed and step (sample0 is set per micro-batch).  Every rank
 * of the group calls it; each needs at least grad_accum rows.  The
 * optimizer step is separate (ct_strategy_step), so a caller can clip
 * first.  Checked across the group first (CT_EINVAL on every rank): with
 * global_rows 0, ranks with different row counts; under pipe, stages of one
 * pipeline given different rows (sample0, counts, or data). */
/* Uneven inputs (PyTorch's Join): collective over s's group, once per step
 * before ct_strategy_train_step.  Every rank gives the rows it has for the
 * step (0: it has run out of data); *global_rows gets their sum (pass it as
 * ct_batch.global_rows: the divisor of the mean over the ranks that still
 * have data) and *active the number of ranks with rows.  While *active > 0
 * every rank runs the step, a rank without rows with a shadow batch
 * (ct_strategy_set_joined), so it keeps answering its peers' collectives with zeros and
 * uneven data sets never hang; *active 0 means every rank is done.  A
 * joined rank's buffers (BatchNorm statistics) see its shadow batch. */
ct_status ct_strategy_join(ct_strategy *s, int64_t rows, int64_t *global_rows, int *active);
/* joined 1: the next train steps run on a shadow batch (any rows of the
 * right shapes, at least grad_accum) whose gradients count as zeros and
 * whose loss and rows are not counted; 0 (the default): real data. */
void ct_strategy_set_joined(ct_strategy *s, int joined);
ct_status ct_strategy_train_step(ct_strategy *s, const ct_batch *b, ct_loss_fn loss, void *ud,
                                 const ct_fwd_ctx *ctx, ct_step_out *out);

/* Inference (no records) over the whole model, however it is placed: *out
 * gets a new reference to the model's output on the ranks that hold it
 * (every rank for the replicated and sharded strategies; a pipeline's last
 * stage) and NULL elsewhere.  Collective over the group for pipe (every
 * rank of a pipeline passes x with the same rows) and for strategies whose
 * forward communicates. */
ct_status ct_strategy_predict(ct_strategy *s, ct_tensor *x, const ct_fwd_ctx *ctx, ct_tensor **out);
/* Which slice of each global batch this rank is given: *rank of *size
 * slices.  The group rank and size, except under pipe, where the ranks of
 * one pipeline share a slice (the replica index of the pipeline; ranks that
 * sit out get slice 0 and train on nothing). */
void ct_strategy_data_rank(const ct_strategy *s, int *rank, int *size);

/* ---- the pieces, for a loop of one's own ------------------------------- */

/* Forward through the wrapped model (see ct_module_forward). */
ct_status ct_strategy_forward(ct_strategy *s, ct_tensor *in, ct_tensor **out, ct_record **rec,
                              const ct_fwd_ctx *ctx);
/* Backward from dout (consumes rec).  Gradients accumulate; unless no_sync
 * is on, they are averaged over the group's ranks when this returns (as
 * PyTorch's DDP does).  DDP folds the 1/world of the average into dout, so
 * under no_sync the local gradients read as 1/world of their plain sum. */
ct_status ct_strategy_backward(ct_strategy *s, ct_tensor *dout, ct_record *rec);
/* Backward from dout times scale instead of the strategy's own factor (the
 * caller already scaled the loss: a pipeline stage, a micro-batch loop of
 * your own), with the strategy's hooks; *din (din != NULL) gets the input
 * gradient.  Consumes rec. */
ct_status ct_strategy_backward_ex(ct_strategy *s, ct_tensor *dout, ct_record *rec, float scale,
                                  ct_tensor **din);
/* The strategy's work before a forward that does not go through
 * ct_strategy_forward (a pipeline stage running its module by micro-batch):
 * DDP's buffer broadcast, ZeRO's parameter refresh. */
ct_status ct_strategy_pre_forward(ct_strategy *s);
/* While on, backward only accumulates locally (gradient accumulation); the
 * first backward after turning it off synchronises the accumulated sum. */
void ct_strategy_set_no_sync(ct_strategy *s, int on);
/* fairscale's manual reduce(): synchronises the gradients accumulated so
 * far (backward passes under no_sync) now, as a synchronised backward
 * would.  Collective over the group; a no-op for "none". */
ct_status ct_strategy_reduce(ct_strategy *s);

/* Clips the gradients by their global norm over the whole model, however
 * they are sharded (torch.nn.utils.clip_grad_norm_, FSDP's clip_grad_norm_);
 * norm_type any p > 0 or INFINITY.  *norm (may be NULL) gets the norm before
 * clipping; the same on every rank.  CT_EINVAL for a negative or NaN
 * max_norm, or a norm_type of 0, below 0 or NaN. */
ct_status ct_strategy_clip_grad_norm(ct_strategy *s, float max_norm, double norm_type, float *norm);
/* Which parameters take part in a clip (fairscale OSS.clip_grad_norm's
 * filter_params_fn): 1 to include p.  ud is the caller's. */
typedef int (*ct_param_filter_fn)(const ct_param *p, void *ud);
/* ct_strategy_clip_grad_norm over the trainable parameters filter selects
 * (NULL: all of them): only their gradients count in the norm, however
 * they are sharded, and only they are scaled; the others stay as they are.
 * filter must give the same answer for a parameter on every rank.
 * CT_EUNSUPPORTED for a filter under fsdp with offload=, which keeps its
 * norm terms and clip factors per flat, not per parameter. */
ct_status ct_strategy_clip_grad_norm_filter(ct_strategy *s, float max_norm, double norm_type,
                                            ct_param_filter_fn filter, void *ud, float *norm);
/* The parts of clipping, for composing strategies and clipping rules of your
 * own: adds the norm terms of every gradient s trains, combined over the
 * ranks that shard them (the same value on every rank), to acc; and
 * multiplies every gradient s holds by k. */
ct_status ct_strategy_grad_norm_acc(ct_strategy *s, ct_norm_acc *acc);
void ct_strategy_scale_grads(ct_strategy *s, float k);
/* Optimizer step on the synchronised gradients (with the schedule's
 * learning rate if one is set), then whatever the strategy does after it
 * (mixed precision: refresh the compute copies).  With no backward (nor
 * train step) since the last step it does nothing, as PyTorch's optimizers
 * skip parameters whose grad is None: no update, no weight decay, the step
 * count and the schedule stay.  Unlike PyTorch, a parameter that a backward
 * did not reach (an unused branch) steps with a zero gradient (weight
 * decay and momentum still apply). */
ct_status ct_strategy_step(ct_strategy *s);
/* Zeroes every gradient (lazily: the next backward overwrites). */
void ct_strategy_zero_grad(ct_strategy *s);
/* Learning rate from now on (replaces a schedule). */
void ct_strategy_set_lr(ct_strategy *s, double lr);
/* Learning rate by schedule: each ct_strategy_step first sets
 * ct_lr_at(sched, optimizer step count).  The schedule is copied. */
ct_status ct_strategy_set_schedule(ct_strategy *s, const ct_lr_schedule *sched);
/* Learning rate the next step will use. */
double ct_strategy_lr(const ct_strategy *s);

/* The model, the optimizer the strategy built, and the group. */
ct_module *ct_strategy_model(const ct_strategy *s);
ct_optim *ct_strategy_optim(const ct_strategy *s);
ct_group *ct_strategy_group(const ct_strategy *s);
/* Timings of the last completed step. */
ct_step_stats ct_strategy_stats(const ct_strategy *s);
/* Every rank's memory report (ct_mem_report_get on each), gathered into
 * all[0 .. group size) on every rank (ct_group_mem_reports over the
 * strategy's group).  Collective over the group.  Call ct_mem_reset_peak
 * after set-up so the peaks cover the training steps; the whole life's peak
 * RSS and its phase (the library marks build, wrap, load, train, save and
 * teardown: ct_mem_phase_begin) are in every report regardless. */
ct_status ct_strategy_memory(ct_strategy *s, ct_mem_report *all);
/* Option value as the strategy parsed it ("25" for bucket_cap_mb), or NULL
 * for a key it does not take. */
const char *ct_strategy_opt(const ct_strategy *s, const char *key);

/* Makes every parameter's full value readable in p->data until
 * ct_strategy_release_full_params (PyTorch's summon_full_params): FSDP
 * gathers its pieces; zero1 and zero2 wait for the last step's broadcasts
 * of the updated ranges; other strategies that keep whole parameters have
 * nothing to do.  With writeback, changes made to them meanwhile are kept (copied
 * back into the pieces on release); without, they are dropped (except
 * under fsdp sharding=none, whose parameters are the pieces).  rank0_only:
 * only rank 0 keeps them (not with writeback: CT_EINVAL).  Collective. */
ct_status ct_strategy_summon_full_params(ct_strategy *s, int writeback, int rank0_only);
/* Ends ct_strategy_summon_full_params (writes back if asked, frees). */
ct_status ct_strategy_release_full_params(ct_strategy *s);
/* A function of one module, for ct_strategy_apply. */
typedef ct_status (*ct_module_fn)(ct_module *m, void *ud);
/* PyTorch FSDP's apply(fn): fn(m, ud) on every module of the model this
 * rank holds (a pipeline stage's), children before their parent as
 * nn.Module.apply orders them, with the full parameters readable and
 * writable and the changes kept (summoned with writeback, then released;
 * mixed-precision copies refreshed).  Collective; fn must do the same on
 * every rank (it changes every rank's copy).  The first failure of fn ends
 * the walk and is returned after the release. */
ct_status ct_strategy_apply(ct_strategy *s, ct_module_fn fn, void *ud);

/* Units, one at a time in a buffer of the caller's (PyTorch FSDP's
 * summon_full_params(recurse=False) with offload_to_cpu): FSDP's units are
 * its wrap units in pre-order (0: the model's own), each holding the
 * trainable parameters no unit nested in it holds; every other strategy is
 * one unit of all its trainable parameters.  Memory stays bounded by one
 * unit: nothing the strategy keeps is gathered after a call returns. */
int ct_strategy_num_units(ct_strategy *s);
/* Unit i's module and its parameters in the order the buffers lay them end
 * to end (*ps: free with ct_free); *numel (may be NULL) their elements.
 * CT_EINVAL for an i out of range. */
ct_status ct_strategy_unit_params(ct_strategy *s, int i, ct_module **m, ct_param ***ps, int *n, int64_t *numel);
/* Unit i's full f32 values into buf (n floats, at least its numel) on every
 * rank.  Collective; CT_EINVAL for a buffer too small, CT_ESTATE while
 * ct_strategy_summon_full_params is in effect. */
ct_status ct_strategy_unit_read(ct_strategy *s, int i, float *buf, int64_t n);
/* buf's values (the same on every rank) into unit i's parameters, wherever
 * the strategy keeps them (FSDP: each rank's pieces; mixed-precision copies
 * follow).  Collective; errors as ct_strategy_unit_read. */
ct_status ct_strategy_unit_write(ct_strategy *s, int i, const float *buf, int64_t n);
/* A function of one unit: its module, parameters and their full values. */
typedef ct_status (*ct_unit_fn)(ct_module *unit, ct_param *const *ps, int n, float *values, void *ud);
/* apply(fn) unit by unit: each unit read into one buffer of the largest
 * unit's size, fn called on it, and (writeback) its values written back.
 * Collective; a failure of fn on any rank stops every rank (the lowest
 * failing rank's error). */
ct_status ct_strategy_apply_units(ct_strategy *s, int writeback, ct_unit_fn fn, void *ud);

/* ---- state for checkpoints -------------------------------------------- */

/* Named tensors (retained references); free with ct_state_fini. */
typedef struct {
    int n, cap;
    char **names;
    ct_tensor **tensors;
} ct_state;

/* Appends a retained reference under a copy of name. */
ct_status ct_state_add(ct_state *st, const char *name, ct_tensor *t);
/* Releases the tensors and names and zeroes st. */
void ct_state_fini(ct_state *st);

/* The full model state (parameters then buffers, PyTorch names).
 * Collective over the group, for every strategy: call it on every rank
 * (then write the file on rank 0), never under if (rank == 0).  A sharded
 * strategy assembles it on rank 0 (other ranks may get less); a replicated
 * one has it on every rank. */
ct_status ct_strategy_model_state(ct_strategy *s, ct_state *out);
/* The optimizer state: "<param>.exp_avg", "<param>.exp_avg_sq" (AdamW) or
 * "<param>.momentum_buffer" (SGD), full tensors, plus an I64 tensor "step".
 * Collective like ct_strategy_model_state: complete on rank 0 (fairscale's
 * consolidate_state_dict), on every rank for a replicated strategy. */
ct_status ct_strategy_optim_state(ct_strategy *s, ct_state *out);
/* Called with each tensor of a state, one at a time (the tensor is the
 * strategy's: retain it to keep it). */
typedef ct_status (*ct_state_fn)(void *ud, const char *name, ct_tensor *t);
/* The full model state (optim 0) or optimizer state (optim 1) of
 * ct_strategy_model_state / ct_strategy_optim_state, one tensor at a time:
 * fn runs where those would have the tensor (rank 0 for a sharded strategy,
 * every rank for a replicated one), and a sharded strategy gathers each
 * tensor for its call and frees it after, so no rank holds more than one
 * (a file can be written as they come).  shapes_only: every tensor without
 * data and nothing gathered (names, dtypes and shapes, for a header).  A
 * failing fn ends the calls on its rank, not the collectives: the first
 * failure is returned.  Collective over the group. */
ct_status ct_strategy_state_foreach(ct_strategy *s, int optim, int shapes_only, ct_state_fn fn, void *ud);
/* This rank's share of model_state (optim 0) or optim_state (optim 1) for
 * a sharded checkpoint: over the group's ranks every tensor appears exactly
 * once (I64 "step" on rank 0), shares balanced by bytes, so every rank
 * writes its own file at once.  Collective over the group. */
ct_status ct_strategy_shard_state(ct_strategy *s, int optim, ct_state *out);
/* This rank's own pieces of the model state (optim 0) or of the optimizer
 * state (optim 1), as they lie in its memory, with no communication:
 * "<name>@<offset>" holds elements [offset, offset + numel) of tensor
 * <name> flattened (1-D), "<name>" a whole one.  Over the ranks every
 * element appears once (a replicated strategy: rank 0 has everything;
 * buffers, frozen parameters and "step" are on rank 0).  PyTorch's
 * LOCAL_STATE_DICT, except that it loads anywhere: ct_strategy_load_state
 * assembles pieces into whole tensors, so any world size and any strategy
 * loads them.  Collective only in that every rank calls it. */
ct_status ct_strategy_local_state(ct_strategy *s, int optim, ct_state *out);
/* This rank's share (local 0: ct_strategy_shard_state) or pieces (local 1:
 * ct_strategy_local_state) one tensor at a time, as
 * ct_strategy_state_foreach gives the full state: FSDP and ZeRO gather
 * each tensor for its call (FSDP's offloaded parts: read from the store)
 * and free it after, so a sharded save never holds the share; shapes_only:
 * names, dtypes and shapes, nothing gathered.  Collective over the group. */
ct_status ct_strategy_share_foreach(ct_strategy *s, int optim, int local, int shapes_only, ct_state_fn fn, void *ud);
/* Loads tensors by name into the model (every parameter and buffer must be
 * present with its shape; f32, or bf16/f16 converted) or, with optim != 0,
 * into the optimizer state (a sharded strategy takes what this rank owns).
 * Names not in the model are an error.  The same set on every rank (any
 * world size can load it).  Pieces ("<name>@<offset>", see
 * ct_strategy_local_state) stand for their tensors (each range read from
 * the pieces that cover it); pieces that overlap, leave a gap or run past
 * the tensor are an error naming it. */
ct_status ct_strategy_load_state(ct_strategy *s, const char *const *names,
                                 ct_tensor *const *tensors, int n, int optim);
/* Where a load reads the tensors it is given without data (shapes only,
 * as ct_safetensors_open gives them): read puts elements [off, off + count)
 * of t, in t's dtype, into dst. */
typedef struct {
    ct_status (*read)(void *ud, const ct_tensor *t, int64_t off, int64_t count, void *dst);
    void *ud;
} ct_state_source;
/* ct_strategy_load_state, reading tensors without data through src: each
 * rank reads only the element ranges it keeps (a replicated strategy whole
 * parameters; ZeRO's optimizer state, FSDP, a pipe stage their own part),
 * from whole tensors or local pieces alike.  Collective like the load. */
ct_status ct_strategy_load_source(ct_strategy *s, const char *const *names, ct_tensor *const *tensors, int n,
                                  int optim, const ct_state_source *src);

#ifdef __cplusplus
}
#endif
#endif

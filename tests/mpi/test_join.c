/*
 * Uneven inputs (ct_strategy_join, PyTorch's Join): every rank has its own
 * number of batches (rank r has 3 + 2r steps of its own data, of 4 + r rows
 * each).  A rank that has run out keeps running steps with a shadow batch
 * until all are done: nothing hangs, and the model equals one process
 * training on, at each step, the rows of the ranks that still had data
 * (computed on every rank as the reference), for DDP, ZeRO-1 and ZeRO-2.
 */
#include "../test.h"

#define IN 10
#define NCLS 4

static ct_module *model(void)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(IN, 16, 1)));
    ASSERT_OK(ct_module_add(m, NULL, ct_tanh_create()));
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(16, NCLS, 1)));
    ct_module_init_params(m, 11);
    return m;
}

static int steps_of(int rank) { return 3 + 2 * rank; }
static int64_t rows_of(int rank) { return 4 + rank; }

/* Rank r's batch of step s: x [rows, IN], y [rows]. */
static void batch_of(int rank, int step, ct_tensor **x, ct_tensor **y)
{
    int64_t n = rows_of(rank);
    *x = ct_tensor_create2(n, IN, CT_MEM_ACT);
    *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 99 + (uint64_t)rank, (uint64_t)step);
    ct_rng_normal(&r, ct_f32(*x), (size_t)(n * IN), 0, 1);
    for (int64_t i = 0; i < n; i++) ((int32_t *)ct_tensor_data(*y))[i] = (int32_t)((i + step + rank) % NCLS);
}

/* The reference's batch of a step: every active rank's rows, in rank order. */
static int64_t concat_batch(int world, int step, ct_tensor **x, ct_tensor **y)
{
    int64_t n = 0;
    for (int r = 0; r < world; r++) n += step < steps_of(r) ? rows_of(r) : 0;
    *x = ct_tensor_create2(n, IN, CT_MEM_ACT);
    *y = ct_tensor_create(CT_I32, 1, &n, CT_MEM_ACT);
    int64_t at = 0;
    for (int r = 0; r < world; r++) {
        if (step >= steps_of(r)) continue;
        ct_tensor *bx, *by;
        batch_of(r, step, &bx, &by);
        memcpy(ct_f32(*x) + at * IN, ct_f32(bx), sizeof(float) * (size_t)(rows_of(r) * IN));
        memcpy((int32_t *)ct_tensor_data(*y) + at, ct_tensor_data(by), sizeof(int32_t) * (size_t)rows_of(r));
        at += rows_of(r);
        ct_tensor_release(bx);
        ct_tensor_release(by);
    }
    return n;
}

static void join_case(const char *kind)
{
    ct_group *g = ct_group_world();
    int rank = ct_group_rank(g), world = ct_group_size(g);
    ct_module *dm = model(), *rm = model();
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_ADAMW);
    oo.lr = 0.01f;
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, g, NULL, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, NULL, &rs));
    ct_fwd_ctx ctx = {.training = 1, .seed = 3};
    int step = 0, joined_steps = 0;
    for (;; step++) {
        int mine = step < steps_of(rank), active;
        int64_t global;
        ASSERT_OK(ct_strategy_join(ds, mine ? rows_of(rank) : 0, &global, &active));
        if (!active) break;
        ct_tensor *x, *y;
        /* Out of data: the last batch again, as the shadow. */
        batch_of(rank, mine ? step : steps_of(rank) - 1, &x, &y);
        ct_batch b = {x, y, global, 0};
        ct_strategy_set_joined(ds, !mine);
        ctx.step = (uint64_t)step;
        ct_step_out out;
        ASSERT_OK(ct_strategy_train_step(ds, &b, ct_loss_cross_entropy, NULL, &ctx, &out));
        ASSERT_EQ(out.rows, mine ? rows_of(rank) : 0);
        joined_steps += !mine;
        ASSERT_OK(ct_strategy_step(ds));
        ct_strategy_zero_grad(ds);
        ct_tensor_release(x);
        ct_tensor_release(y);

        ct_tensor *rx, *ry;
        int64_t n = concat_batch(world, step, &rx, &ry);
        ASSERT_EQ(n, global);
        ct_batch rb = {rx, ry, n, 0};
        ASSERT_OK(ct_strategy_train_step(rs, &rb, ct_loss_cross_entropy, NULL, &ctx, &out));
        ASSERT_OK(ct_strategy_step(rs));
        ct_strategy_zero_grad(rs);
        ct_tensor_release(rx);
        ct_tensor_release(ry);
    }
    ASSERT_EQ(step, steps_of(world - 1));
    ASSERT_EQ(joined_steps, steps_of(world - 1) - steps_of(rank));
    /* The model as the strategy gives it (gathered on rank 0 where it is sharded). */
    ct_state ms;
    ASSERT_OK(ct_strategy_model_state(ds, &ms));
    ct_param **pb;
    int nb;
    ASSERT_OK(ct_module_params(rm, &pb, &nb));
    if (rank == 0) ASSERT_EQ(ms.n, nb);
    for (int i = 0; i < ms.n; i++) {
        const ct_param *q = NULL;
        for (int k = 0; k < nb; k++)
            if (!strcmp(pb[k]->name, ms.names[i])) q = pb[k];
        ASSERT(q && ms.tensors[i]->numel == q->data->numel);
        for (int64_t j = 0; j < q->data->numel; j++)
            ASSERT_CLOSE(ct_f32(ms.tensors[i])[j], ct_f32(q->data)[j], 1e-5, 1e-5);
    }
    ct_state_fini(&ms);
    ct_free(pb);
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

TEST(join_uneven_inputs_ddp) { join_case("ddp"); }
TEST(join_uneven_inputs_zero1) { join_case("zero1"); }
TEST(join_uneven_inputs_zero2) { join_case("zero2"); }
TEST(join_uneven_inputs_fsdp) { join_case("fsdp"); }

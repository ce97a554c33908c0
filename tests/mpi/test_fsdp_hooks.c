/*
 * Communication hooks on FSDP (comm_hook.h): a registered hook replaces the
 * reduce-scatter of every sharded unit's gradient.  The built-in allreduce
 * hooks registered on FSDP (f32, bf16, f16) train bit for bit as FSDP's own
 * reduce_dtype does, with nested units, mixed precision and no_sync (where
 * the piece is added to what the last backward left); each unit's flat
 * reaches the hook once a step with its piece to fill; PowerSGD and
 * sharding=none are refused with the reason.
 */
#include "train_util.h"


/* Counts its calls, checks what FSDP hands it, and passes on to a built-in hook. */
typedef struct {
    int starts, finishes, size;
    const ct_comm_hook_ops *inner;
    void *inner_state;
} counting;

static ct_status counting_start(void *st, ct_group *g, const ct_comm_bucket *b, ct_work **w)
{
    counting *c = st;
    c->starts++;
    ASSERT(b->shard != NULL);
    ASSERT(b->shard_numel > 0);
    ASSERT_EQ(b->numel, b->shard_numel * ct_group_size(g));
    ASSERT(b->nparams > 0 && b->offsets[0] == 0 && b->index >= 0 && b->index < b->nbuckets);
    return c->inner->start(c->inner_state, g, b, w);
}
static ct_status counting_finish(void *st, ct_group *g, const ct_comm_bucket *b)
{
    counting *c = st;
    c->finishes++;
    return c->inner->finish(c->inner_state, g, b);
}
static void counting_destroy(void *st)
{
    counting *c = st;
    c->inner->destroy(c->inner_state);
}
static const ct_comm_hook_ops counting_ops = {"counting", counting_start, counting_finish, counting_destroy};

/* Every weight of a and b the same bits. */
static void same_params(ct_module *a, ct_module *b)
{
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    ASSERT_EQ(na, nb);
    for (int i = 0; i < na; i++)
        ASSERT(!memcmp(ct_f32(pa[i]->data), ct_f32(pb[i]->data), (size_t)pa[i]->data->numel * sizeof(float)));
    ct_free(pa);
    ct_free(pb);
}

/* FSDP with reduce_dtype=wire against FSDP with the built-in hook of that dtype registered. */
static void hook_equals_built_in_on(ct_group *g, const char *opts, ct_dtype wire, int no_sync)
{
    int rank = ct_group_rank(g), world = ct_group_size(g);
    int64_t n = 4 * world + 1;
    char with[256];
    snprintf(with, sizeof with, "%s%sreduce_dtype=%s", opts, opts[0] ? "," : "",
             wire == CT_F32 ? "f32" : wire == CT_BF16 ? "bf16" : "f16");
    ct_module *am = fsdp_nested(31, 0), *bm = fsdp_nested(31, 0);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *a, *b;
    ASSERT_OK(ct_strategy_create("fsdp", am, &oo, g, with, &a));
    ASSERT_OK(ct_strategy_create("fsdp", bm, &oo, g, opts, &b));
    static counting c;
    memset(&c, 0, sizeof c);
    ASSERT_OK(ct_comm_hook_allreduce(wire, &c.inner, &c.inner_state));
    ASSERT_OK(ct_strategy_register_comm_hook(b, &counting_ops, &c));
    ASSERT(!strcmp(ct_strategy_comm_hook(b, NULL), "counting"));
    int steps = 3;
    for (int step = 0; step < steps; step++) {
        ct_step_out o;
        for (int k = 0; k < 2; k++) {
            ct_strategy *s = k ? b : a;
            if (no_sync) { /* a half-batch without synchronising first: the piece adds to it */
                ct_strategy_set_no_sync(s, 1);
                step_on_slice(s, 2 * step, n, rank, world, &o);
                ct_strategy_set_no_sync(s, 0);
            }
            step_on_slice(s, 2 * step + 1, n, rank, world, &o);
            ASSERT_OK(ct_strategy_step(s));
            ct_strategy_zero_grad(s);
        }
    }
    ASSERT(c.starts > 0);
    ASSERT_EQ(c.starts, c.finishes);
    ASSERT_EQ(c.starts % steps, 0);
    UNWRAP(a);
    UNWRAP(b);
    same_params(am, bm);
    ct_module_destroy(am);
    ct_module_destroy(bm);
}

static void hook_equals_built_in(const char *opts, ct_dtype wire, int no_sync)
{
    hook_equals_built_in_on(ct_group_world(), opts, wire, no_sync);
}

TEST(fsdp_comm_hooks_equal_the_built_in_reduce)
{
    hook_equals_built_in("", CT_F32, 0);
    hook_equals_built_in("wrap_min_params=200", CT_BF16, 0);
    hook_equals_built_in("wrap_min_params=200,param_dtype=bf16", CT_F16, 1);
    hook_equals_built_in("wrap_min_params=200,sharding=grad_op", CT_F32, 1);
    /* hybrid over two (fake) nodes: the hook reduce-scatters inside a node, FSDP allreduces the pieces
     * across in f32 (with reduce_dtype bf16 it would round them to bf16 first, so f32 here) */
    /* nodes of 2 and 1 ranks cannot line their pieces up; nodes of 1 have nothing to reduce-scatter */
    if (ct_group_size(ct_group_world()) % 2 || ct_group_size(ct_group_world()) < 4) return;
    ct_group *g = NULL;
    int saved = ct_comm_get_fake_nodes();
    ct_comm_set_fake_nodes(2);
    ct_status st = ct_group_split(ct_group_world(), 0, ct_group_rank(ct_group_world()), &g);
    ct_comm_set_fake_nodes(saved);
    ASSERT_OK(st);
    ASSERT_EQ(ct_group_num_nodes(g), 2);
    hook_equals_built_in_on(g, "sharding=hybrid,wrap_min_params=200", CT_F32, 1);
    ct_group_destroy(g);
}

TEST(fsdp_comm_hooks_refused_where_they_do_not_apply)
{
    ct_group *g = ct_group_world();
    ct_module *m = fsdp_nested(3, 0);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    const ct_comm_hook_ops *ops;
    void *st;
    ASSERT_OK(ct_strategy_create("fsdp", m, &oo, g, "sharding=none", &s));
    ASSERT_OK(ct_comm_hook_allreduce(CT_BF16, &ops, &st));
    ASSERT_EQ(ct_strategy_register_comm_hook(s, ops, st), CT_EINVAL); /* st freed */
    ASSERT_STR_CONTAINS(ct_last_error(), "use strategy ddp");
    UNWRAP(s);
    ASSERT_OK(ct_strategy_create("fsdp", m, &oo, g, NULL, &s));
    ct_powersgd_opts po = ct_powersgd_defaults(2);
    ASSERT_OK(ct_comm_hook_powersgd(&po, &ops, &st));
    ASSERT_EQ(ct_strategy_register_comm_hook(s, ops, st), CT_EINVAL);
    ASSERT_STR_CONTAINS(ct_last_error(), "reduce-scatter");
    UNWRAP(s);
    ct_module_destroy(m);
}

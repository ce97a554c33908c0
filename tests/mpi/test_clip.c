/*
 * ct_strategy_clip_grad_norm for any norm type (torch.nn.utils.clip_grad_norm_
 * and FSDP's clip_grad_norm_ take any p): under every strategy the norm
 * equals one process's on the whole batch for p = 1, 3, 0.5 and inf, the
 * clip is real (the norm is above max_norm), and the weights after a few
 * clipped steps equal one process's.
 */
#include "train_util.h"

/* kind (opts) against "none" (ref_opts: its mixed precision) */
static void clip_vs_one(const char *kind, const char *opts, const char *ref_opts, double p)
{
    ct_group *g = ct_group_world();
    const int64_t n = 11;
    ct_module *dm = mlp8(31, 20), *rm = mlp8(31, 20);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ds, *rs;
    ASSERT_OK(ct_strategy_create(kind, dm, &oo, g, opts, &ds));
    ASSERT_OK(ct_strategy_create("none", rm, &oo, NULL, ref_opts, &rs));
    for (int step = 0; step < 3; step++) {
        train_on_data_rank(ds, step, n, NULL);
        train_on_data_rank(rs, step, n, NULL);
        float a = 0, b = 0;
        float max = p == 0.5 ? 20.0f : 0.05f; /* below every norm: a real clip */
        ASSERT_OK(ct_strategy_clip_grad_norm(ds, max, p, &a));
        ASSERT_OK(ct_strategy_clip_grad_norm(rs, max, p, &b));
        if (!(fabsf(a - b) <= 1e-5f * fabsf(b)) || !(b > max))
            ct_test_fail(__FILE__, __LINE__, "%s (%s), p %g, step %d: norm %.9g, one process %.9g (max_norm %g)", kind,
                         opts ? opts : "", p, step, (double)a, (double)b, (double)max);
        /* clipped: the norm measured again is max_norm (up to the 1e-6) */
        ASSERT_OK(ct_strategy_clip_grad_norm(ds, 1e9f, p, &a));
        ASSERT_CLOSE(a, max, 1e-4, 1e-6);
        ASSERT_OK(ct_strategy_step(ds));
        ASSERT_OK(ct_strategy_step(rs));
    }
    char what[256];
    snprintf(what, sizeof what, "%s (%s), p %g: weights", kind, opts ? opts : "", p);
    states_close(ds, rs, 2e-5, what);
    ASSERT_ERR(ct_strategy_clip_grad_norm(ds, 1.0f, 0.0, NULL), CT_EINVAL, "norm_type 0");
    ASSERT_ERR(ct_strategy_clip_grad_norm(ds, 1.0f, -1.0, NULL), CT_EINVAL, "norm_type -1");
    ct_strategy_destroy(ds);
    ct_strategy_destroy(rs);
    ct_module_destroy(dm);
    ct_module_destroy(rm);
}

static void every_p_ref(const char *kind, const char *opts, const char *ref_opts)
{
    static const double ps[] = {1.0, 3.0, 0.5, INFINITY};
    for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++) clip_vs_one(kind, opts, ref_opts, ps[i]);
}

static void every_p(const char *kind, const char *opts) { every_p_ref(kind, opts, NULL); }

TEST(clip_any_p_ddp_zero_equal_one_process)
{
    every_p("ddp", NULL);
    every_p("zero1", NULL);
    every_p("zero2", NULL);
}

TEST(clip_any_p_fsdp_equals_one_process)
{
    every_p("fsdp", "wrap_kinds=linear");
    every_p_ref("fsdp", "wrap_kinds=linear,sharding=grad_op,param_dtype=bf16", "param_dtype=bf16");
    every_p("fsdp", "wrap_kinds=linear,sharding=hybrid");
}

TEST(clip_any_p_pipe_offload_equal_one_process)
{
    every_p("pipe", "schedule=1f1b,chunks=2");
    every_p("offload", "slices=3");
    every_p("offload", "slices=2,microbatches=2,checkpoint_activation=1");
}

/*
 * ct_fsdp_auto_wrap (an auto-wrap policy given as a function): the units
 * fsdp makes from the options it writes equal the ones the named rules
 * make (by kind, by size with PyTorch's nonwrapped_numel, by name), a deep
 * model's kilobytes of module names pass through the options, and bad
 * calls are refused.  Training from such options: tests/mpi/test_gpt.c.
 */
#include <stdlib.h>

#include "test.h"

static ct_module *gpt(void)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 2, 2, 8, 6, 13);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 1, &m));
    return m;
}

static int is_linear(const ct_module *m, int64_t n, void *ud)
{
    (void)n, (void)ud;
    return !strcmp(m->ops->kind, "linear");
}

static int at_least(const ct_module *m, int64_t n, void *ud)
{
    (void)m;
    return n >= *(const int64_t *)ud;
}

static int named_c_attn(const ct_module *m, int64_t n, void *ud)
{
    (void)n, (void)ud;
    size_t l = strlen(m->fqn);
    return l >= 6 && !strcmp(m->fqn + l - 6, "c_attn");
}

#define MAXU 512

/* The units of opts_a and opts_b on model are the same, in the same order,
 * and at least expect of them (a module whose parameters all sit in units
 * below makes none: the root, a tied lm_head). */
static void same_units(ct_module *m, const char *a, const char *b, int expect)
{
    static ct_fsdp_unit ua[MAXU], ub[MAXU];
    int na = 0, nb = 0;
    ASSERT_OK(ct_fsdp_plan(m, a, ua, MAXU, &na));
    ASSERT_OK(ct_fsdp_plan(m, b, ub, MAXU, &nb));
    if (na != nb || na < expect)
        ct_test_fail(__FILE__, __LINE__, "'%.80s' makes %d units, '%s' %d (expected %d)", a, na, b, nb, expect);
    for (int i = 0; i < na; i++) {
        ASSERT_EQ(ua[i].numel, ub[i].numel);
        ASSERT_EQ(ua[i].is_root, ub[i].is_root);
    }
}

TEST(fsdp_auto_wrap_policy_equals_the_named_rules)
{
    ct_module *m = gpt();
    char *o = NULL;
    /* by kind: every linear (c_attn, c_proj, c_fc, mlp's c_proj; lm_head is tied to wte) */
    ASSERT_OK(ct_fsdp_auto_wrap(m, is_linear, NULL, NULL, &o));
    ASSERT(strstr(o, "wrap_modules=") == o);
    same_units(m, o, "wrap_kinds=linear", 9); /* 4 linears a block, and the rest in the root */
    ct_free(o);
    /* by size: nonwrapped_numel is what wrap_min_params compares, for several minimums */
    static const int64_t mins[] = {30, 100, 200, 300};
    for (size_t k = 0; k < sizeof mins / sizeof mins[0]; k++) {
        char named[64];
        snprintf(named, sizeof named, "wrap_min_params=%lld", (long long)mins[k]);
        ASSERT_OK(ct_fsdp_auto_wrap(m, at_least, (void *)&mins[k], "sharding=grad_op", &o));
        ct_fsdp_unit u[MAXU];
        int n = 0;
        ASSERT_OK(ct_fsdp_plan(m, named, u, MAXU, &n));
        ASSERT(n > 1);
        same_units(m, o, named, n);
        ASSERT(strstr(o, "sharding=grad_op,wrap_modules=") == o); /* the caller's options kept in front */
        ct_free(o);
    }
    /* by name (lambda_auto_wrap_policy): the two c_attn */
    ASSERT_OK(ct_fsdp_auto_wrap(m, named_c_attn, NULL, "param_dtype=bf16", &o));
    ASSERT(!strcmp(o, "param_dtype=bf16,wrap_modules=transformer.h.1.attn.c_attn+transformer.h.0.attn.c_attn"));
    ct_free(o);
    ct_module_destroy(m);
}

/* 300 linears with long names: the list is 9 KB, more than one option, or
 * the plan's resolved options, could hold before. */
TEST(fsdp_auto_wrap_deep_model_and_errors)
{
    ct_module *m = ct_sequential_create();
    for (int i = 0; i < 300; i++) {
        char name[64];
        snprintf(name, sizeof name, "a_linear_with_a_long_name_%03d", i);
        ASSERT_OK(ct_module_add(m, name, ct_linear_create(2, 2, 1)));
    }
    ct_module_init_params(m, 1);
    char *o = NULL;
    ASSERT_OK(ct_fsdp_auto_wrap(m, is_linear, NULL, "", &o));
    ASSERT(strlen(o) > 8000);
    same_units(m, o, "wrap_kinds=linear", 300);
    ct_plan_spec spec = {.world = 2, .batch = 4, .in_ndim = 1, .in_shape = {2}, .sample_bytes = 12,
                         .optim = ct_optim_defaults(CT_OPT_ADAMW)};
    ct_mem_plan a, b;
    ASSERT_OK(ct_strategy_plan("fsdp", m, o, &spec, &a));
    ASSERT_OK(ct_strategy_plan("fsdp", m, "wrap_kinds=linear", &spec, &b));
    ASSERT_EQ(a.total, b.total);
    ct_free(o);
    /* a policy that picks nothing: the model is the one unit */
    int64_t never = INT64_MAX;
    ASSERT_OK(ct_fsdp_auto_wrap(m, at_least, &never, NULL, &o));
    ASSERT(!strcmp(o, ""));
    same_units(m, o, "", 1);
    ct_free(o);
    ASSERT_ERR(ct_fsdp_auto_wrap(m, NULL, NULL, NULL, &o), CT_EINVAL, "the policy is NULL");
    ASSERT(o == NULL);
    ASSERT_ERR(ct_fsdp_auto_wrap(m, is_linear, NULL, "wrap_modules=0", &o), CT_EINVAL, "already set wrap_modules");
    ct_module_destroy(m);
}

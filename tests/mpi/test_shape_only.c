/*
 * Models that never exist whole: a model built shape-only (no parameter
 * memory) and wrapped in any strategy must hold exactly the values of the
 * same model built and initialised whole, bit for bit, at any world size;
 * train as it does; and a rank must never make more than it holds.
 */
#include "train_util.h"

/* Every tensor of a equals b's bit for bit (on rank 0: a sharded strategy's
 * full state is complete there). */
static void assert_states_equal(const ct_state *a, const ct_state *b, const char *what)
{
    if (ct_group_rank(ct_group_world()) != 0) return;
    if (a->n != b->n) ct_test_fail(__FILE__, __LINE__, "%s: %d tensors, wanted %d", what, a->n, b->n);
    for (int i = 0; i < a->n; i++) {
        int j = 0;
        while (j < b->n && strcmp(a->names[i], b->names[j])) j++;
        if (j == b->n) ct_test_fail(__FILE__, __LINE__, "%s: '%s' is not in the whole model", what, a->names[i]);
        const ct_tensor *x = a->tensors[i], *y = b->tensors[j];
        if (x->numel != y->numel || memcmp(ct_tensor_data(x), ct_tensor_data(y), ct_tensor_bytes(x)))
            ct_test_fail(__FILE__, __LINE__, "%s: '%s' differs from the whole model's init", what, a->names[i]);
    }
}

static ct_model_config config(ct_model_kind kind)
{
    ct_model_config c = ct_model_config_default(kind);
    if (kind == CT_MODEL_GPT) ct_model_config_gpt(&c, 2, 2, 32, 16, 64);
    if (kind == CT_MODEL_CNN) ct_model_config_parse_hidden(&c, "4,8,32");
    return c;
}

/* Built shape-only under kind/opts, the model state equals a whole build's. */
static void wrap_equals_whole(ct_model_kind mk, const char *kind, const char *opts)
{
    ct_model_config c = config(mk);
    ct_module *whole, *shapes;
    ASSERT_OK(ct_model_build(&c, 77, &whole));
    int was = ct_module_shape_only(1);
    ASSERT_OK(ct_model_build(&c, 77, &shapes));
    ct_module_shape_only(was);
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(shapes, &ps, &n));
    for (int i = 0; i < n; i++) ASSERT(ps[i]->shape_only && !ct_tensor_data(ps[i]->data));
    ct_free(ps);
    ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
    ct_strategy *ws, *ss;
    ASSERT_OK(ct_strategy_create("none", whole, &oo, NULL, NULL, &ws));
    ASSERT_OK(ct_strategy_create(kind, shapes, &oo, NULL, opts, &ss));
    ct_state a, b;
    ASSERT_OK(ct_strategy_model_state(ss, &a));
    ASSERT_OK(ct_strategy_model_state(ws, &b));
    char what[160];
    snprintf(what, sizeof what, "%s model under %s '%s'", c.kind == CT_MODEL_GPT ? "gpt" : c.kind == CT_MODEL_CNN ? "cnn" : "mlp",
             kind, opts ? opts : "");
    assert_states_equal(&a, &b, what);
    ct_state_fini(&a);
    ct_state_fini(&b);
    ct_strategy_destroy(ss);
    ct_strategy_destroy(ws);
    ct_module_destroy(shapes);
    ct_module_destroy(whole);
}

TEST(shape_only_wrap_equals_whole_init_for_every_strategy)
{
    static const struct {
        const char *kind, *opts;
    } cases[] = {
        {"fsdp", "sharding=full"}, {"fsdp", "sharding=grad_op"}, {"fsdp", "sharding=none"},
        {"fsdp", "sharding=full,wrap_min_params=2000,sync_module_states=0"},
        {"fsdp", "sharding=full,param_dtype=bf16"}, {"ddp", NULL}, {"zero1", NULL}, {"zero2", NULL},
        {"pipe", NULL}, {"offload", NULL},
    };
    ct_model_kind models[] = {CT_MODEL_MLP, CT_MODEL_CNN, CT_MODEL_GPT};
    for (size_t m = 0; m < sizeof models / sizeof models[0]; m++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            if (!strcmp(cases[i].kind, "pipe") && models[m] == CT_MODEL_MLP) continue; /* fewer layers than 4 ranks */
            wrap_equals_whole(models[m], cases[i].kind, cases[i].opts);
        }
}

/* FSDP makes this rank's shard only: the parameter memory it holds after
 * wrapping a shape-only model is its pieces, about 1/world of the model
 * (plus each flat's padding), and no unit was ever whole meanwhile;
 * teardown frees and gathers nothing. */
TEST(shape_only_fsdp_makes_only_its_shard_and_teardown_frees)
{
    int world = ct_group_size(ct_group_world());
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 4, 4, 128, 64, 256);
    ct_mem_report before, after, end;
    ct_mem_reset_peak();
    ct_mem_report_get(&before);
    int was = ct_module_shape_only(1);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 3, &m));
    ct_module_shape_only(was);
    ct_optim_opts oo = optim_for(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("fsdp", m, &oo, NULL, "sharding=full", &s));
    ct_mem_report_get(&after);
    size_t whole = (size_t)ct_module_num_params(m) * 4, slack = 64 * 1024;
    size_t held = after.current[CT_MEM_PARAM] - before.current[CT_MEM_PARAM];
    size_t peak = after.peak[CT_MEM_PARAM] - before.current[CT_MEM_PARAM];
    if (held > whole / (size_t)world + slack || peak > whole / (size_t)world + slack)
        ct_test_fail(__FILE__, __LINE__, "fsdp holds %zu bytes of parameters (peak %zu) of a %zu-byte model "
                     "at %d ranks: more than its shard", held, peak, whole, world);
    ct_strategy_destroy(s);
    ct_mem_report_get(&end);
    ASSERT(end.current[CT_MEM_PARAM] == before.current[CT_MEM_PARAM]);
    ASSERT(end.peak[CT_MEM_PARAM] == after.peak[CT_MEM_PARAM]); /* nothing gathered at teardown */
    ct_param **ps;
    int n;
    ASSERT_OK(ct_module_params(m, &ps, &n));
    for (int i = 0; i < n; i++) ASSERT_ERR(ct_tensor_check_data(ps[i]->data), CT_ESTATE, "summon");
    ct_free(ps);
    /* its values are gone: wrapping it again says so (no rank gets that far, so no collective is left waiting) */
    ASSERT_ERR(ct_strategy_create("fsdp", m, &oo, NULL, NULL, &s), CT_ESTATE, "summon its full parameters");
    ct_module_destroy(m);
}

/* A shape-only model trains as the whole one does: the same steps under the
 * same strategy give the same weights bit for bit (dropout, clipping). */
static ct_module *small(uint64_t seed, int shapes)
{
    int was = ct_module_shape_only(shapes);
    ct_module *m = mlp8(seed, 24);
    ct_module_shape_only(was);
    return m;
}

TEST(shape_only_trains_as_the_whole_model)
{
    static const char *const kinds[][2] = {{"fsdp", "sharding=full"}, {"fsdp", "sharding=hybrid"},
                                           {"ddp", NULL}, {"zero2", NULL}, {"pipe", "chunks=2"},
                                           {"offload", NULL}};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        ct_module *a = small(5, 1), *b = small(5, 0);
        ct_optim_opts oo = optim_for(CT_OPT_ADAMW);
        ct_strategy *sa, *sb;
        ASSERT_OK(ct_strategy_create(kinds[k][0], a, &oo, NULL, kinds[k][1], &sa));
        ASSERT_OK(ct_strategy_create(kinds[k][0], b, &oo, NULL, kinds[k][1], &sb));
        for (int step = 0; step < 3; step++) {
            step_on_data_rank(sa, step, 12, 0.5, NULL, NULL);
            step_on_data_rank(sb, step, 12, 0.5, NULL, NULL);
        }
        ct_state x, y;
        ASSERT_OK(ct_strategy_model_state(sa, &x));
        ASSERT_OK(ct_strategy_model_state(sb, &y));
        assert_states_equal(&x, &y, kinds[k][0]);
        ct_state_fini(&x);
        ct_state_fini(&y);
        ct_strategy_destroy(sa);
        ct_strategy_destroy(sb);
        ct_module_destroy(a);
        ct_module_destroy(b);
    }
}

/* Initial values as rules: any element range of a parameter equals the same
 * elements of a whole initialisation; shape-only models cost no parameter
 * memory, refuse to run until made, and make the whole-init values. */
#include "test.h"

static ct_status affine(const ct_param *p, uint64_t seed, int64_t first, int64_t n, float *out)
{
    (void)p;
    for (int64_t i = 0; i < n; i++) out[i] = (float)(first + i) + (float)seed;
    return CT_OK;
}

/* Every range [a, b) of every rule equals the whole's elements a..b, for
 * odd and even starts (a normal draws its numbers in pairs). */
TEST(init_ranges_equal_the_whole_for_every_rule)
{
    ct_module *m = ct_sequential_create();
    ASSERT_OK(ct_module_add(m, NULL, ct_linear_create(7, 5, 1)));
    ct_param *w = m->kids[0]->params[0];
    const ct_init rules[] = {ct_init_const(0.5f), ct_init_uniform(0.3f), ct_init_normal(0.1f, 2.0f),
                             ct_init_with(affine)};
    float whole[35], part[35];
    for (size_t k = 0; k < sizeof rules / sizeof rules[0]; k++) {
        ct_param_set_init(w, rules[k]);
        ct_module_init_params(m, 9);
        ASSERT_OK(ct_param_init_values(w, 0, 35, whole));
        ASSERT(!memcmp(whole, ct_f32(w->data), sizeof whole)); /* init_params wrote the rule's values */
        for (int a = 0; a < 35; a++)
            for (int b = a; b <= 35; b++) {
                ASSERT_OK(ct_param_init_values(w, a, b - a, part));
                if (memcmp(part, whole + a, sizeof(float) * (size_t)(b - a)))
                    ct_test_fail(__FILE__, __LINE__, "rule %zu: elements [%d, %d) differ from the whole's", k, a, b);
            }
    }
    ASSERT_ERR(ct_param_init_values(w, 30, 6, part), CT_EINVAL, "outside");
    w->init = (ct_init){0};
    ASSERT_ERR(ct_param_init_values(w, 0, 1, part), CT_EUNSUPPORTED, "ct_param_set_init");
    ct_module_destroy(m);
}

/* Each ready model built shape-only has no parameter memory, will not run,
 * and once made equals the whole build bit for bit. */
TEST(init_shape_only_models_make_the_whole_init)
{
    ct_model_kind kinds[] = {CT_MODEL_MLP, CT_MODEL_CNN, CT_MODEL_GPT};
    for (size_t k = 0; k < 3; k++) {
        ct_model_config c = ct_model_config_default(kinds[k]);
        if (kinds[k] == CT_MODEL_GPT) ct_model_config_gpt(&c, 2, 2, 32, 16, 64);
        ct_mem_report r0, r1;
        ct_mem_report_get(&r0);
        ct_module *whole, *shapes;
        int was = ct_module_shape_only(1);
        ASSERT_OK(ct_model_build(&c, 4, &shapes));
        ASSERT_EQ(ct_module_shape_only(was), 1);
        ct_mem_report_get(&r1);
        ASSERT(r1.current[CT_MEM_PARAM] == r0.current[CT_MEM_PARAM]);
        ASSERT(r1.current[CT_MEM_GRAD] == r0.current[CT_MEM_GRAD]);
        ASSERT_OK(ct_model_build(&c, 4, &whole));
        int64_t shape[4];
        int nd = ct_model_input_shape(&c, 2, shape);
        ct_tensor *x = ct_tensor_create(kinds[k] == CT_MODEL_GPT ? CT_I64 : CT_F32, nd, shape, CT_MEM_ACT), *y = NULL;
        ASSERT_ERR(ct_module_forward(shapes, x, &y, NULL, NULL), CT_ESTATE, "ct_module_materialize");
        ASSERT_OK(ct_module_materialize(shapes));
        ASSERT_OK(ct_module_forward(shapes, x, &y, NULL, NULL));
        ct_tensor_release(y);
        ct_tensor_release(x);
        ct_param **a, **b;
        int na, nb;
        ASSERT_OK(ct_module_params(shapes, &a, &na));
        ASSERT_OK(ct_module_params(whole, &b, &nb));
        ASSERT_EQ(na, nb);
        for (int i = 0; i < na; i++) {
            ASSERT(!a[i]->shape_only);
            if (memcmp(ct_f32(a[i]->data), ct_f32(b[i]->data), ct_tensor_bytes(a[i]->data)))
                ct_test_fail(__FILE__, __LINE__, "model %zu: '%s' made from its rule differs from the whole build", k, a[i]->name);
        }
        ct_free(a);
        ct_free(b);
        ct_module_destroy(shapes);
        ct_module_destroy(whole);
    }
}

/* Generation: the KV cache gives the module forward's logits at every
 * length, before and after the window slides past the context; sampling
 * honours temperature and top-k. */
#include "test_layers.h"

static ct_model_config small(void)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 2, 2, 16, 5, 256);
    return c;
}

/* Logits of the last position of seq[0..n) by the module (the last context tokens of it). */
static void forward_last(ct_module *m, const ct_model_config *c, const int64_t *seq, int64_t n, float *out)
{
    int64_t w = n < c->context ? n : c->context;
    ct_tensor *x = ct_tensor_create(CT_I64, 2, (int64_t[]){1, w}, CT_MEM_ACT), *y;
    memcpy(ct_tensor_data(x), seq + n - w, sizeof(int64_t) * (size_t)w);
    ASSERT_OK(ct_module_forward(m, x, &y, NULL, NULL));
    memcpy(out, ct_f32(y) + (w - 1) * c->vocab, sizeof(float) * (size_t)c->vocab);
    ct_tensor_release(y);
    ct_tensor_release(x);
}

TEST(gpt_kv_cache_equals_forward_and_slides_past_context)
{
    ct_model_config c = small();
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 7, &m));
    /* Bigger weights than the init, so every path matters. */
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    for (int i = 0; i < np; i++) rand_fill(ps[i]->data, 40 + (uint64_t)i, -0.3f, 0.3f);
    ct_free(ps);
    ct_gpt_gen *g;
    ASSERT_OK(ct_gpt_gen_create(m, &c, &g));
    int64_t seq[13];
    float ref[256];
    for (int64_t n = 0; n < 13; n++) {
        seq[n] = (n * 37 + 11) % 256;
        const float *lg;
        ASSERT_OK(ct_gpt_gen_feed(g, seq[n], &lg));
        forward_last(m, &c, seq, n + 1, ref);
        double worst = 0, scale = 0;
        for (int v = 0; v < 256; v++) {
            double d = fabs((double)lg[v] - ref[v]);
            worst = d > worst ? d : worst;
            scale = fabs(ref[v]) > scale ? fabs(ref[v]) : scale;
        }
        if (!(worst <= 1e-4 * (1 + scale)))
            ct_test_fail(__FILE__, __LINE__, "after %lld tokens the cached logits differ by %g", (long long)n + 1, worst);
        ASSERT(scale > 0.1);
    }
    /* Reset starts over at position 0. */
    ct_gpt_gen_reset(g);
    const float *lg;
    ASSERT_OK(ct_gpt_gen_feed(g, seq[0], &lg));
    forward_last(m, &c, seq, 1, ref);
    ASSERT_NEAR(lg[3], ref[3], 1e-4);
    ASSERT_ERR(ct_gpt_gen_feed(g, 256, &lg), CT_EINVAL, "outside the vocabulary");
    ct_gpt_gen_destroy(g);
    /* A model without the gpt's weights is refused by name. */
    ct_module *mlp;
    ct_model_config mc = ct_model_config_default(CT_MODEL_MLP);
    ASSERT_OK(ct_model_build(&mc, 1, &mlp));
    ASSERT_ERR(ct_gpt_gen_create(mlp, &c, &g), CT_EINVAL, "transformer.wte.weight");
    ct_module_destroy(mlp);
    ct_module_destroy(m);
}

TEST(gpt_sampling_temperature_and_top_k)
{
    float logits[5] = {1.0f, 3.0f, 2.0f, 3.0f - 1e-3f, -1.0f};
    ct_rng r;
    ct_rng_init(&r, 1, 2);
    ASSERT_EQ(ct_gpt_sample_logits(logits, 5, 0.0f, 0, &r), 1); /* argmax */
    for (int i = 0; i < 50; i++) ASSERT_EQ(ct_gpt_sample_logits(logits, 5, 1.0f, 1, &r), 1);
    int count[5] = {0};
    for (int i = 0; i < 4000; i++) {
        int64_t t = ct_gpt_sample_logits(logits, 5, 1.0f, 2, &r);
        ASSERT(t == 1 || t == 3); /* only the two largest */
        count[t]++;
    }
    ASSERT(count[1] > 1800 && count[3] > 1800);
    /* Full softmax at temperature 1: frequencies near the probabilities. */
    memset(count, 0, sizeof count);
    double z = 0, p[5];
    for (int v = 0; v < 5; v++) z += exp(logits[v]);
    for (int i = 0; i < 20000; i++) count[ct_gpt_sample_logits(logits, 5, 1.0f, 0, &r)]++;
    for (int v = 0; v < 5; v++) {
        p[v] = exp(logits[v]) / z;
        ASSERT_NEAR(count[v] / 20000.0, p[v], 0.015);
    }
    /* A high temperature flattens: the least likely gets much more than at 1. */
    int low = 0;
    for (int i = 0; i < 20000; i++) low += ct_gpt_sample_logits(logits, 5, 10.0f, 0, &r) == 4;
    ASSERT(low > 2500);
}

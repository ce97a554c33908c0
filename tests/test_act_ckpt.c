/*
 * Activation checkpointing through the library
 * (ct_module_apply_activation_checkpointing): the wrapped model keeps its
 * names and state dict, computes the same gradients bit for bit with
 * dropout on, keeps fewer activation bytes, counts batchnorm statistics
 * once per forward, and misuse (applying twice, applying to a wrapped
 * model, a policy that picks nothing or the root) is an error that names
 * the fix.  The multi-rank strategies: tests/mpi/test_act_ckpt.c.
 */
#include "test.h"

static ct_module *gpt(uint64_t seed)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_GPT);
    ct_model_config_gpt(&c, 3, 2, 16, 8, 17);
    c.dropout = 0.2f;
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, seed, &m));
    return m;
}

static ct_tensor *tokens(int64_t n)
{
    ct_tensor *x = ct_tensor_create(CT_I64, 2, (int64_t[]){n, 8}, CT_MEM_ACT);
    ASSERT(x);
    for (int64_t i = 0; i < x->numel; i++) ((int64_t *)ct_tensor_data(x))[i] = (i * 5 + 3) % 17;
    return x;
}

/* Forward and backward of m on x; *kept gets the activation bytes the
 * records hold after forward (the output not counted). */
static void step(ct_module *m, ct_tensor *x, const ct_fwd_ctx *ctx, size_t *kept)
{
    size_t base = ct_mem_current(CT_MEM_ACT);
    ct_tensor *y;
    ct_record *rec;
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, ctx));
    if (kept) *kept = ct_mem_current(CT_MEM_ACT) - base - ct_tensor_bytes(y);
    ct_tensor *dy = ct_tensor_create(CT_F32, y->ndim, y->shape, CT_MEM_ACT);
    ASSERT(dy);
    for (int64_t i = 0; i < dy->numel; i++) ct_f32(dy)[i] = 1e-2f * (float)(i % 11) - 0.05f;
    ASSERT_OK(ct_module_backward(m, dy, NULL, rec));
    ct_tensor_release(dy);
    ct_tensor_release(y);
}

/* Every parameter's name, value and gradient equal, bit for bit. */
static void same_params(ct_module *a, ct_module *b)
{
    ct_param **pa, **pb;
    int na, nb;
    ASSERT_OK(ct_module_params(a, &pa, &na));
    ASSERT_OK(ct_module_params(b, &pb, &nb));
    ASSERT_EQ(na, nb);
    for (int i = 0; i < na; i++) {
        ASSERT_STR_CONTAINS(pa[i]->name, pb[i]->name);
        ASSERT_EQ(strlen(pa[i]->name), strlen(pb[i]->name));
        ct_param_grad_sync(pa[i]);
        ct_param_grad_sync(pb[i]);
        ASSERT(!memcmp(ct_tensor_data(pa[i]->data), ct_tensor_data(pb[i]->data), ct_tensor_bytes(pa[i]->data)));
        if (memcmp(ct_tensor_data(pa[i]->grad), ct_tensor_data(pb[i]->grad), ct_tensor_bytes(pa[i]->grad)))
            ct_test_fail(__FILE__, __LINE__, "gradient of '%s' differs with checkpointing", pa[i]->name);
    }
    ct_free(pa);
    ct_free(pb);
}

TEST(act_ckpt_gpt_blocks_same_gradients_fewer_bytes)
{
    ct_module *a = gpt(4), *b = gpt(4);
    int n = 0;
    ASSERT_OK(ct_module_apply_activation_checkpointing(b, NULL, NULL, &n));
    ASSERT_EQ(n, 3); /* the blocks, not the embeddings, the final norm or the head */
    for (int i = 0; i < b->nkids; i++)
        ASSERT_EQ(ct_module_is(b->kids[i], CT_MOD_CHECKPOINT), i >= 1 && i <= 3);
    ASSERT_STR_CONTAINS(b->kids[2]->fqn, "transformer.h.1");
    ASSERT(ct_module_find(b, "transformer.h.1.attn.c_attn.weight") != NULL);
    ct_tensor *x = tokens(4);
    size_t ka, kb;
    for (int s = 0; s < 2; s++) { /* two steps: the second accumulates */
        ct_fwd_ctx ctx = {.training = 1, .seed = 7, .step = (uint64_t)s, .sample0 = 3};
        step(a, x, &ctx, &ka);
        step(b, x, &ctx, &kb);
    }
    same_params(a, b);
    /* the records keep a block's input instead of its insides */
    if (!(kb * 2 < ka)) ct_test_fail(__FILE__, __LINE__, "checkpointed records keep %zu bytes, plain %zu", kb, ka);
    ct_tensor_release(x);
    ct_module_destroy(a);
    ct_module_destroy(b);
}

/* A model without blocks: each child of the sequential is wrapped; bf16
 * compute copies give the same numbers too. */
TEST(act_ckpt_mlp_children_same_gradients_bf16)
{
    for (int bf16 = 0; bf16 < 2; bf16++) {
        ct_model_config c = ct_model_config_default(CT_MODEL_MLP);
        ASSERT_OK(ct_model_config_parse_hidden(&c, "32,16"));
        c.in[0] = 12;
        c.dropout = 0.3f;
        ct_module *a, *b;
        ASSERT_OK(ct_model_build(&c, 2, &a));
        ASSERT_OK(ct_model_build(&c, 2, &b));
        int n = 0, kids = b->nkids;
        ASSERT_OK(ct_module_apply_activation_checkpointing(b, NULL, NULL, &n));
        ASSERT_EQ(n, kids);
        ct_tensor *copies[2][8] = {{NULL}};
        for (int m = 0; bf16 && m < 2; m++) { /* the compute copies a mixed-precision strategy makes */
            ct_param **ps;
            int np;
            ASSERT_OK(ct_module_params(m ? b : a, &ps, &np));
            for (int i = 0; i < np && i < 8; i++)
                if (ct_param_takes_bf16_copy(ps[i])) {
                    ct_tensor *t = copies[m][i] = ct_tensor_create(CT_BF16, ps[i]->data->ndim, ps[i]->data->shape, CT_MEM_PARAM);
                    ASSERT(t);
                    ct_f32_to_bf16_n(ct_f32(ps[i]->data), ct_tensor_data(t), (size_t)t->numel);
                    ps[i]->compute = t;
                }
            ct_free(ps);
        }
        ct_tensor *x = ct_tensor_create(CT_F32, 2, (int64_t[]){6, 12}, CT_MEM_ACT);
        ct_rng r;
        ct_rng_init(&r, 1, 2);
        ct_rng_normal(&r, ct_f32(x), (size_t)x->numel, 0, 1);
        ct_fwd_ctx ctx = {.training = 1, .seed = 5, .step = 1};
        step(a, x, &ctx, NULL);
        step(b, x, &ctx, NULL);
        same_params(a, b);
        for (int m = 0; m < 2; m++) {
            ct_param **ps;
            int np;
            ASSERT_OK(ct_module_params(m ? b : a, &ps, &np));
            for (int i = 0; i < np && i < 8; i++) {
                ps[i]->compute = NULL;
                ct_tensor_release(copies[m][i]);
            }
            ct_free(ps);
        }
        ct_tensor_release(x);
        ct_module_destroy(a);
        ct_module_destroy(b);
    }
}

/* A recompute is not another batch: batchnorm's running statistics move
 * once per training forward, checkpointed or not. */
TEST(act_ckpt_batchnorm_counts_a_batch_once)
{
    ct_module *m[2];
    for (int k = 0; k < 2; k++) {
        m[k] = ct_sequential_create();
        ASSERT_OK(ct_module_add(m[k], NULL, ct_conv2d_create(2, 3, 3, 1, 1, 1)));
        ASSERT_OK(ct_module_add(m[k], NULL, ct_batchnorm_create(3, 1e-5f, 0.1f)));
        ASSERT_OK(ct_module_add(m[k], NULL, ct_relu_create()));
        ASSERT_OK(ct_module_add(m[k], NULL, ct_flatten_create()));
        ct_module_init_params(m[k], 3);
    }
    ASSERT_OK(ct_module_apply_activation_checkpointing(m[1], NULL, NULL, NULL));
    ct_tensor *x = ct_tensor_create4(4, 2, 5, 5, CT_MEM_ACT);
    ct_rng r;
    ct_rng_init(&r, 3, 4);
    ct_rng_normal(&r, ct_f32(x), (size_t)x->numel, 1, 2);
    ct_fwd_ctx ctx = {.training = 1, .seed = 1};
    step(m[0], x, &ctx, NULL);
    step(m[1], x, &ctx, NULL);
    same_params(m[0], m[1]);
    ct_param *n0 = ct_module_find(m[0], "1.num_batches_tracked"), *n1 = ct_module_find(m[1], "1.num_batches_tracked");
    ASSERT(n0 && n1);
    ASSERT_NEAR(ct_f32(n1->data)[0], 1.0, 0);
    ASSERT_NEAR(ct_f32(n0->data)[0], 1.0, 0);
    const char *stats[2] = {"1.running_mean", "1.running_var"};
    for (int k = 0; k < 2; k++)
        ASSERT(!memcmp(ct_tensor_data(ct_module_find(m[0], stats[k])->data),
                       ct_tensor_data(ct_module_find(m[1], stats[k])->data), 3 * sizeof(float)));
    ct_tensor_release(x);
    ct_module_destroy(m[0]);
    ct_module_destroy(m[1]);
}

static int pick_ln_f(const ct_module *m, void *ud)
{
    (void)ud;
    return !strcmp(m->fqn, "transformer.ln_f");
}

static int pick_all(const ct_module *m, void *ud)
{
    (void)m, (void)ud;
    return 1;
}

static int pick_none(const ct_module *m, void *ud)
{
    (void)m, (void)ud;
    return 0;
}

TEST(act_ckpt_misuse_is_an_error)
{
    ct_module *m = gpt(1);
    ASSERT_ERR(ct_module_apply_activation_checkpointing(NULL, NULL, NULL, NULL), CT_EINVAL, "NULL");
    ASSERT_ERR(ct_module_apply_activation_checkpointing(m, pick_none, NULL, NULL), CT_EINVAL, "picks no module");
    ASSERT_ERR(ct_module_apply_activation_checkpointing(m, pick_all, NULL, NULL), CT_EINVAL, "picks the model itself");
    ct_module *relu = ct_relu_create();
    ASSERT_ERR(ct_module_apply_activation_checkpointing(relu, NULL, NULL, NULL), CT_EINVAL, "pass a check function");
    ct_module_destroy(relu);
    /* a custom policy */
    int n = 0;
    ASSERT_OK(ct_module_apply_activation_checkpointing(m, pick_ln_f, NULL, &n));
    ASSERT_EQ(n, 1);
    ASSERT(ct_module_is(m->kids[m->nkids - 2], CT_MOD_CHECKPOINT));
    /* twice: each backward would recompute twice */
    ASSERT_ERR(ct_module_apply_activation_checkpointing(m, NULL, NULL, &n), CT_ESTATE, "checkpointed already");
    ASSERT_EQ(n, 0);
    ct_module_destroy(m);
    /* after a strategy wrapped the model: its layout is fixed */
    m = gpt(1);
    ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
    ct_strategy *s;
    ASSERT_OK(ct_strategy_create("none", m, &oo, NULL, NULL, &s));
    ASSERT_ERR(ct_module_apply_activation_checkpointing(m, NULL, NULL, NULL), CT_ESTATE,
               "apply activation checkpointing before wrapping");
    ct_strategy_destroy(s);
    ct_module_destroy(m);
}

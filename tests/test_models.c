/*
 * Ready models: parameter names, shapes and layer order exactly as
 * torch.nn.Sequential's state_dict, forward results against sums worked
 * out by hand, the config's round trip through checkpoint metadata, and
 * the errors for bad configs.
 */
#include "test.h"

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[4];
} want_param;

/* The model's named parameters must be exactly want, in PyTorch's order. */
static void check_params(ct_module *m, const want_param *want, int n)
{
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(m, &ps, &np));
    ASSERT_EQ(np, n);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(ps[i]->name, want[i].name))
            ct_test_fail(__FILE__, __LINE__, "parameter %d is '%s', wanted '%s'", i, ps[i]->name, want[i].name);
        ASSERT_EQ(ps[i]->data->ndim, want[i].ndim);
        int64_t numel = 1;
        for (int d = 0; d < want[i].ndim; d++) {
            ASSERT_EQ(ps[i]->data->shape[d], want[i].shape[d]);
            numel *= want[i].shape[d];
        }
        ASSERT_EQ(ps[i]->data->dtype, CT_F32);
        ASSERT(ps[i]->requires_grad);
        total += numel;
    }
    ct_free(ps);
    ASSERT_EQ(ct_module_num_params(m), total);
    ASSERT_OK(ct_module_buffers(m, &ps, &np));
    ASSERT_EQ(np, 0);
    ct_free(ps);
}

/* Children's kinds in order, as "linear relu linear". */
static void check_kinds(ct_module *m, const char *want)
{
    char got[256] = "";
    for (int i = 0; i < m->nkids; i++) {
        if (i) strcat(got, " ");
        strcat(got, m->kids[i]->ops->kind);
    }
    if (strcmp(got, want)) ct_test_fail(__FILE__, __LINE__, "layers are '%s', wanted '%s'", got, want);
}

TEST(models_mlp_matches_pytorch_sequential)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_MLP);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 1, &m));
    /* nn.Sequential(Linear(784,256), ReLU(), Linear(256,128), ReLU(), Linear(128,10)).state_dict() */
    const want_param want[] = {
        {"0.weight", 2, {256, 784}}, {"0.bias", 1, {256}}, {"2.weight", 2, {128, 256}},
        {"2.bias", 1, {128}},        {"4.weight", 2, {10, 128}}, {"4.bias", 1, {10}},
    };
    check_params(m, want, 6);
    ASSERT_EQ(ct_module_num_params(m), 235146);
    check_kinds(m, "linear relu linear relu linear");
    ct_module_destroy(m);

    ASSERT_OK(ct_model_config_parse_hidden(&c, "64"));
    ASSERT_OK(ct_model_build(&c, 1, &m));
    const want_param one[] = {{"0.weight", 2, {64, 784}}, {"0.bias", 1, {64}}, {"2.weight", 2, {10, 64}},
                              {"2.bias", 1, {10}}};
    check_params(m, one, 4);
    check_kinds(m, "linear relu linear");
    ct_module_destroy(m);
}

TEST(models_cnn_matches_pytorch_sequential)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_CNN);
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 1, &m));
    /* Conv2d(1,16,3,padding=1), ReLU, MaxPool2d(2), Conv2d(16,32,3,padding=1), ReLU, MaxPool2d(2),
     * Flatten, Linear(32*7*7,128), ReLU, Linear(128,10) */
    const want_param want[] = {
        {"0.weight", 4, {16, 1, 3, 3}}, {"0.bias", 1, {16}},       {"3.weight", 4, {32, 16, 3, 3}},
        {"3.bias", 1, {32}},            {"7.weight", 2, {128, 1568}}, {"7.bias", 1, {128}},
        {"9.weight", 2, {10, 128}},     {"9.bias", 1, {10}},
    };
    check_params(m, want, 8);
    check_kinds(m, "conv2d relu maxpool2d conv2d relu maxpool2d flatten linear relu linear");
    ct_tensor *x = ct_tensor_create4(3, 1, 28, 28, CT_MEM_ACT);
    ct_tensor_fill(x, 0.5f);
    ct_tensor *y;
    ct_fwd_ctx ctx = {.training = 0, .seed = 0, .step = 0};
    ASSERT_OK(ct_module_forward(m, x, &y, NULL, &ctx));
    ASSERT_EQ(y->ndim, 2);
    ASSERT_EQ(y->shape[0], 3);
    ASSERT_EQ(y->shape[1], 10);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_module_destroy(m);

    /* Three 5x5 convs on 28x28: 28 -> 14 -> 7 -> 3, so the fc takes 8*3*3. */
    ASSERT_OK(ct_model_config_parse_hidden(&c, "4,6,8,20"));
    c.kernel = 5;
    ASSERT_OK(ct_model_build(&c, 1, &m));
    const want_param three[] = {
        {"0.weight", 4, {4, 1, 5, 5}}, {"0.bias", 1, {4}},  {"3.weight", 4, {6, 4, 5, 5}}, {"3.bias", 1, {6}},
        {"6.weight", 4, {8, 6, 5, 5}}, {"6.bias", 1, {8}},  {"10.weight", 2, {20, 72}},    {"10.bias", 1, {20}},
        {"12.weight", 2, {10, 20}},    {"12.bias", 1, {10}},
    };
    check_params(m, three, 10);
    ct_module_destroy(m);
}

/* A 3-2-2 MLP with weights set by hand: the output is worked out here
 * from the definition y = W2 relu(W1 x + b1) + b2. */
TEST(models_mlp_forward_by_hand)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_MLP);
    c.in[0] = 3;
    c.classes = 2;
    ASSERT_OK(ct_model_config_parse_hidden(&c, "2"));
    ct_module *m;
    ASSERT_OK(ct_model_build(&c, 0, &m));
    const float w1[] = {1, -1, 2, 0.5f, 0.5f, -3}, b1[] = {0.25f, -0.5f};
    const float w2[] = {1, 2, -1, 4}, b2[] = {0.125f, -1};
    memcpy(ct_tensor_data(ct_module_find(m, "0.weight")->data), w1, sizeof w1);
    memcpy(ct_tensor_data(ct_module_find(m, "0.bias")->data), b1, sizeof b1);
    memcpy(ct_tensor_data(ct_module_find(m, "2.weight")->data), w2, sizeof w2);
    memcpy(ct_tensor_data(ct_module_find(m, "2.bias")->data), b2, sizeof b2);
    int64_t shape[4];
    ASSERT_EQ(ct_model_input_shape(&c, 2, shape), 2);
    ct_tensor *x = ct_tensor_create(CT_F32, 2, shape, CT_MEM_ACT);
    const float xs[] = {1, 2, 3, -1, 0, 1};
    memcpy(ct_tensor_data(x), xs, sizeof xs);
    ct_tensor *y;
    ct_fwd_ctx ctx = {.training = 0, .seed = 0, .step = 0};
    ASSERT_OK(ct_module_forward(m, x, &y, NULL, &ctx));
    /* x0: h = relu(1-2+6+0.25, 0.5+1-9-0.5) = (5.25, 0); y = (5.25+0.125, -5.25-1)
     * x1: h = relu(-1+0+2+0.25, -0.5+0-3-0.5) = (1.25, 0); y = (1.25+0.125, -1.25-1) */
    const float want[] = {5.375f, -6.25f, 1.375f, -2.25f};
    for (int i = 0; i < 4; i++) ASSERT_NEAR(ct_f32(y)[i], want[i], 1e-6);
    ct_tensor_release(x);
    ct_tensor_release(y);
    ct_module_destroy(m);
}

TEST(models_init_is_seeded_and_bounded)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_MLP);
    ct_module *a, *b, *d;
    ASSERT_OK(ct_model_build(&c, 7, &a));
    ASSERT_OK(ct_model_build(&c, 7, &b));
    ASSERT_OK(ct_model_build(&c, 8, &d));
    const char *names[] = {"0.weight", "0.bias", "2.weight", "4.bias"};
    const double fan_in[] = {784, 784, 256, 128};
    for (int k = 0; k < 4; k++) {
        ct_tensor *ta = ct_module_find(a, names[k])->data, *tb = ct_module_find(b, names[k])->data;
        ct_tensor *td = ct_module_find(d, names[k])->data;
        ASSERT(!memcmp(ct_tensor_data(ta), ct_tensor_data(tb), ct_tensor_bytes(ta)));
        ASSERT(memcmp(ct_tensor_data(ta), ct_tensor_data(td), ct_tensor_bytes(ta)));
        /* PyTorch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for Linear weight and bias. */
        double bound = 1.0 / sqrt(fan_in[k]), maxabs = 0;
        for (int64_t i = 0; i < ta->numel; i++) maxabs = fmax(maxabs, fabs(ct_f32(ta)[i]));
        ASSERT(maxabs <= bound);
        ASSERT(maxabs > 0.9 * bound);
    }
    ct_module_destroy(a);
    ct_module_destroy(b);
    ct_module_destroy(d);
}


TEST(models_config_meta_round_trip)
{
    ct_meta m;
    memset(&m, 0, sizeof m);
    ct_model_config c = ct_model_config_default(CT_MODEL_MLP), back;
    ASSERT_OK(ct_model_config_to_meta(&c, &m));
    ASSERT(!strcmp(ct_meta_get(&m, "ctrain.model"), "mlp"));
    ASSERT(!strcmp(ct_meta_get(&m, "ctrain.hidden"), "256,128"));
    ASSERT(!strcmp(ct_meta_get(&m, "ctrain.in"), "784"));
    ASSERT(!strcmp(ct_meta_get(&m, "ctrain.classes"), "10"));
    ASSERT(ct_meta_get(&m, "ctrain.kernel") == NULL);
    memset(&back, 0x5a, sizeof back);
    ASSERT_OK(ct_model_config_from_meta(&m, &back));
    ASSERT_EQ(back.kind, CT_MODEL_MLP);
    ASSERT_EQ(back.in_ndim, 1);
    ASSERT_EQ(back.in[0], 784);
    ASSERT_EQ(back.nhidden, 2);
    ASSERT_EQ(back.hidden[0], 256);
    ASSERT_EQ(back.hidden[1], 128);
    ASSERT_EQ(back.classes, 10);

    ct_meta_fini(&m);
    c = ct_model_config_default(CT_MODEL_CNN);
    ASSERT_OK(ct_model_config_parse_hidden(&c, "8,12,40"));
    c.kernel = 3;
    c.classes = 7;
    ASSERT_OK(ct_model_config_to_meta(&c, &m));
    ASSERT(!strcmp(ct_meta_get(&m, "ctrain.model"), "cnn"));
    ASSERT(!strcmp(ct_meta_get(&m, "ctrain.in"), "1,28,28"));
    ASSERT(!strcmp(ct_meta_get(&m, "ctrain.hidden"), "8,12,40"));
    ASSERT(!strcmp(ct_meta_get(&m, "ctrain.kernel"), "3"));
    /* Other keys (the trainer's) ride along and do not disturb the config. */
    ASSERT_OK(ct_meta_set(&m, "ctrain.step", "%d", 1200));
    ASSERT_OK(ct_model_config_from_meta(&m, &back));
    ASSERT_EQ(back.kind, CT_MODEL_CNN);
    ASSERT_EQ(back.in_ndim, 3);
    ASSERT_EQ(back.in[0], 1);
    ASSERT_EQ(back.in[2], 28);
    ASSERT_EQ(back.nhidden, 3);
    ASSERT_EQ(back.hidden[2], 40);
    ASSERT_EQ(back.kernel, 3);
    ASSERT_EQ(back.classes, 7);

    /* Broken or foreign metadata names the key. */
    ct_meta bad;
    memset(&bad, 0, sizeof bad);
    ASSERT_OK(ct_meta_set(&bad, "format", "pt"));
    ASSERT_ERR(ct_model_config_from_meta(&bad, &back), CT_EFORMAT, "ctrain.model");
    ASSERT_OK(ct_meta_copy(&bad, &m));
    ASSERT_OK(ct_meta_set(&bad, "ctrain.model", "resnet"));
    ASSERT_ERR(ct_model_config_from_meta(&bad, &back), CT_EFORMAT, "mlp, cnn");
    ASSERT_OK(ct_meta_copy(&bad, &m));
    ASSERT_OK(ct_meta_set(&bad, "ctrain.hidden", "8,x"));
    ASSERT_ERR(ct_model_config_from_meta(&bad, &back), CT_EFORMAT, "ctrain.hidden");
    ASSERT_OK(ct_meta_copy(&bad, &m));
    ASSERT_OK(ct_meta_set(&bad, "ctrain.in", "784"));
    ASSERT_ERR(ct_model_config_from_meta(&bad, &back), CT_EFORMAT, "C,H,W");
    ASSERT_OK(ct_meta_copy(&bad, &m));
    ASSERT_OK(ct_meta_set(&bad, "ctrain.hidden", "8"));
    ASSERT_ERR(ct_model_config_from_meta(&bad, &back), CT_EFORMAT, "cannot be built");
    ct_meta_fini(&bad);
    ct_meta_fini(&m);
}

TEST(models_meta_map)
{
    ct_meta m = {0};
    ASSERT_OK(ct_meta_set(&m, "a", "%d", 1));
    ASSERT_OK(ct_meta_set(&m, "b", "x"));
    ASSERT_OK(ct_meta_set(&m, "a", "%s", "two"));
    ASSERT_EQ(m.n, 2);
    ASSERT(!strcmp(ct_meta_get(&m, "a"), "two"));
    ASSERT(ct_meta_get(&m, "c") == NULL);
    const char *k[2], *v[2];
    ct_meta_arrays(&m, k, v);
    ASSERT(!strcmp(k[1], "b") && !strcmp(v[1], "x"));
    ASSERT_ERR(ct_meta_set(&m, "", "%s", "x"), CT_EINVAL, "must not be empty");
    /* any length, any number: a checkpoint's whole metadata fits, ctrain.crc32 of
     * thousands of tensors included (it once stopped at 255 bytes and 48 keys) */
    static char big[100000];
    memset(big, 'z', sizeof big - 1);
    ASSERT_OK(ct_meta_set(&m, "ctrain.crc32", "%s", big));
    ASSERT_EQ(strlen(ct_meta_get(&m, "ctrain.crc32")), sizeof big - 1);
    char key[16];
    for (int i = 0; i < 1000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        ASSERT_OK(ct_meta_set(&m, key, "%d", i));
    }
    ASSERT_EQ(m.n, 1003);
    ASSERT(!strcmp(ct_meta_get(&m, "k999"), "999"));
    ct_meta c = {0};
    ASSERT_OK(ct_meta_copy(&c, &m));
    ASSERT_OK(ct_meta_set(&m, "k3", "replaced"));
    ASSERT(!strcmp(ct_meta_get(&c, "k3"), "3")); /* a copy is its own */
    ASSERT_EQ(c.n, m.n);
    ct_meta_fini(&m);
    ASSERT_EQ(m.n, 0);
    ct_meta_fini(&m); /* twice is fine */
    ct_meta_fini(&c);
}

TEST(models_bad_configs)
{
    ct_model_kind k;
    ASSERT_ERR(ct_model_parse_kind("resnet", &k), CT_EINVAL, "choose one of: mlp, cnn");
    ASSERT_OK(ct_model_parse_kind("cnn", &k));
    ASSERT_EQ(k, CT_MODEL_CNN);
    ASSERT(!strcmp(ct_model_kind_name(CT_MODEL_MLP), "mlp"));

    ct_model_config c = ct_model_config_default(CT_MODEL_MLP);
    ASSERT_ERR(ct_model_config_parse_hidden(&c, "256,abc"), CT_EINVAL, "'abc' is not a positive integer");
    ASSERT_ERR(ct_model_config_parse_hidden(&c, "256,,128"), CT_EINVAL, "not a positive integer");
    ASSERT_ERR(ct_model_config_parse_hidden(&c, "0"), CT_EINVAL, "'0'");
    ASSERT_ERR(ct_model_config_parse_hidden(&c, "-4"), CT_EINVAL, "'-4'");
    ASSERT_ERR(ct_model_config_parse_hidden(&c, "12,"), CT_EINVAL, "not a positive integer");
    ASSERT_ERR(ct_model_config_parse_hidden(&c, ""), CT_EINVAL, "empty");
    ASSERT_ERR(ct_model_config_parse_hidden(&c, "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17"), CT_EINVAL,
               "more than 16");
    /* A failed parse leaves the config as it was. */
    ASSERT_EQ(c.nhidden, 2);
    ASSERT_EQ(c.hidden[0], 256);
    char buf[64];
    ASSERT(!strcmp(ct_model_config_hidden_str(&c, buf, sizeof buf), "256,128"));

    ct_module *m = (ct_module *)1;
    c.classes = 0;
    ASSERT_ERR(ct_model_build(&c, 0, &m), CT_EINVAL, "classes");
    ASSERT(m == NULL);
    c = ct_model_config_default(CT_MODEL_CNN);
    ASSERT_OK(ct_model_config_parse_hidden(&c, "16"));
    ASSERT_ERR(ct_model_build(&c, 0, &m), CT_EINVAL, "conv channels then the fully connected width");
    ASSERT_OK(ct_model_config_parse_hidden(&c, "2,2,2,2,2,2,10"));
    ASSERT_ERR(ct_model_build(&c, 0, &m), CT_EINVAL, "fewer conv sizes");
    c = ct_model_config_default(CT_MODEL_CNN);
    c.kernel = 4;
    ASSERT_ERR(ct_model_build(&c, 0, &m), CT_EINVAL, "odd");
    c = ct_model_config_default(CT_MODEL_MLP);
    c.kind = (ct_model_kind)9;
    ASSERT_ERR(ct_model_build(&c, 0, &m), CT_EINVAL, "mlp, cnn");
}

TEST(models_input_shape)
{
    int64_t s[4];
    ct_model_config c = ct_model_config_default(CT_MODEL_MLP);
    ASSERT_EQ(ct_model_input_shape(&c, 5, s), 2);
    ASSERT(s[0] == 5 && s[1] == 784);
    ASSERT_EQ(ct_model_input_numel(&c), 784);
    c = ct_model_config_default(CT_MODEL_CNN);
    ASSERT_EQ(ct_model_input_shape(&c, 5, s), 4);
    ASSERT(s[0] == 5 && s[1] == 1 && s[2] == 28 && s[3] == 28);
    ASSERT_EQ(ct_model_input_numel(&c), 784);
}

/* Every allocation failure while building is reported, and leaves nothing allocated. */
TEST(models_build_survives_allocation_failures)
{
    ct_model_kind kinds[] = {CT_MODEL_MLP, CT_MODEL_CNN};
    for (int k = 0; k < 2; k++) {
        ct_model_config c = ct_model_config_default(kinds[k]);
        size_t before[CT_MEM_NCAT];
        for (int cat = 0; cat < CT_MEM_NCAT; cat++) before[cat] = ct_mem_current((ct_mem_cat)cat);
        int failures = 0;
        for (long n = 0; n < 10000; n++) {
            ct_module *m = NULL;
            ct_mem_fail_after(n);
            ct_status st = ct_model_build(&c, 3, &m);
            ct_mem_fail_after(-1);
            if (st == CT_OK) {
                ASSERT(m != NULL);
                ct_module_destroy(m);
                break;
            }
            failures++;
            ASSERT(m == NULL);
            ASSERT(*ct_last_error());
            for (int cat = 0; cat < CT_MEM_NCAT; cat++) ASSERT_EQ(ct_mem_current((ct_mem_cat)cat), before[cat]);
        }
        ASSERT(failures > 5);
        for (int cat = 0; cat < CT_MEM_NCAT; cat++) ASSERT_EQ(ct_mem_current((ct_mem_cat)cat), before[cat]);
    }
}

/* ---- pipeline stages and shape inference -------------------------------- */

static int same_tensor(const ct_tensor *a, const ct_tensor *b)
{
    return ct_tensor_same_shape(a, b) && !memcmp(ct_tensor_data(a), ct_tensor_data(b), ct_tensor_bytes(a));
}

/* ct_module_out_shape(m) at x's shape must be y's shape. */
static void check_inferred(ct_module *m, const ct_tensor *x, const ct_tensor *y)
{
    int on;
    int64_t os[CT_MAX_DIMS];
    ASSERT_OK(ct_module_out_shape(m, x->ndim, x->shape, &on, os));
    ASSERT_EQ(on, y->ndim);
    for (int i = 0; i < on; i++) ASSERT_EQ(os[i], y->shape[i]);
}

/* The model split by sizes into stages run one after the other -- forward
 * in order, backward in reverse, each stage's input gradient the previous
 * stage's output gradient, as a pipeline runs them -- computes what the
 * whole model does, bit for bit, and names every parameter as the whole. */
static void check_split(const ct_model_config *c, const int *sizes, int nparts)
{
    ct_module *whole, *seq, *st[4];
    ASSERT_OK(ct_model_build(c, 3, &whole));
    ASSERT_OK(ct_model_build(c, 3, &seq));
    int nlayers = seq->nkids;
    ASSERT_OK(ct_sequential_split(seq, sizes, nparts, st));
    ASSERT_EQ(seq->nkids, 0);
    ct_module_destroy(seq);

    ct_param **pw;
    int nw, k = 0, layers = 0;
    ASSERT_OK(ct_module_params(whole, &pw, &nw));
    for (int s = 0; s < nparts; s++) {
        ct_param **ps;
        int np;
        ASSERT_OK(ct_module_params(st[s], &ps, &np));
        for (int i = 0; i < np; i++, k++) {
            ASSERT(k < nw);
            if (strcmp(ps[i]->name, pw[k]->name))
                ct_test_fail(__FILE__, __LINE__, "stage %d names '%s' where the model has '%s'", s,
                             ps[i]->name, pw[k]->name);
            ASSERT(ct_module_find(st[s], pw[k]->name) == ps[i]);
        }
        ct_free(ps);
        ASSERT_EQ(st[s]->nkids, sizes[s]);
        ASSERT(st[s]->parent == NULL);
        layers += st[s]->nkids;
    }
    ASSERT_EQ(k, nw);
    ASSERT_EQ(layers, nlayers);

    int64_t shape[4];
    int nd = ct_model_input_shape(c, 5, shape);
    ct_tensor *x = ct_tensor_create(CT_F32, nd, shape, CT_MEM_ACT);
    ct_rng g;
    ct_rng_init(&g, 8, 1);
    ct_rng_normal(&g, ct_f32(x), (size_t)x->numel, 0, 1);
    ct_fwd_ctx ctx = {.training = 1, .seed = 9, .step = 2, .sample0 = 0};
    ct_tensor *y, *dx;
    ct_record *rec;
    ASSERT_OK(ct_module_forward(whole, x, &y, &rec, &ctx));
    check_inferred(whole, x, y);
    ct_tensor *dy = ct_tensor_create(CT_F32, y->ndim, y->shape, CT_MEM_ACT);
    ct_rng_normal(&g, ct_f32(dy), (size_t)dy->numel, 0, 1);
    ASSERT_OK(ct_module_backward(whole, dy, &dx, rec));

    ct_tensor *act[5];
    ct_record *recs[4];
    act[0] = ct_tensor_retain(x);
    for (int s = 0; s < nparts; s++) {
        ASSERT_OK(ct_module_forward(st[s], act[s], &act[s + 1], &recs[s], &ctx));
        check_inferred(st[s], act[s], act[s + 1]);
    }
    ASSERT(same_tensor(act[nparts], y));
    ct_tensor *g_ = ct_tensor_retain(dy);
    for (int s = nparts - 1; s >= 0; s--) {
        ct_tensor *gin;
        ASSERT_OK(ct_module_backward(st[s], g_, &gin, recs[s]));
        ct_tensor_release(g_);
        g_ = gin;
    }
    ASSERT(same_tensor(g_, dx));
    k = 0;
    for (int s = 0; s < nparts; s++) {
        ct_param **ps;
        int np;
        ASSERT_OK(ct_module_params(st[s], &ps, &np));
        for (int i = 0; i < np; i++, k++)
            if (!same_tensor(ps[i]->grad, pw[k]->grad))
                ct_test_fail(__FILE__, __LINE__, "gradient of '%s' differs in stage %d", ps[i]->name, s);
        ct_free(ps);
    }
    ct_free(pw);
    ct_tensor_release(g_);
    for (int s = 0; s <= nparts; s++) ct_tensor_release(act[s]);
    for (int s = 0; s < nparts; s++) ct_module_destroy(st[s]);
    ct_tensor *ts[] = {x, y, dy, dx};
    for (int i = 0; i < 4; i++) ct_tensor_release(ts[i]);
    ct_module_destroy(whole);
}

TEST(models_split_into_stages_matches_whole)
{
    ct_model_config mlp = ct_model_config_default(CT_MODEL_MLP);
    check_split(&mlp, (int[]){2, 3}, 2);          /* linear relu | linear relu linear */
    check_split(&mlp, (int[]){1, 2, 2}, 3);
    ct_model_config cnn = ct_model_config_default(CT_MODEL_CNN);
    ASSERT_OK(ct_model_config_parse_hidden(&cnn, "4,6,16"));
    check_split(&cnn, (int[]){3, 7}, 2);          /* conv relu pool | conv relu pool flatten linear relu linear */
    check_split(&cnn, (int[]){4, 3, 3}, 3);       /* ... | relu pool flatten | linear relu linear */
}

TEST(models_split_balance_errors_name_the_fix)
{
    ct_model_config c = ct_model_config_default(CT_MODEL_MLP); /* 5 layers */
    ct_module *m, *st[3] = {NULL, NULL, NULL};
    ASSERT_OK(ct_model_build(&c, 1, &m));
    ASSERT_ERR(ct_sequential_split(m, (int[]){2, 2}, 2, st), CT_EINVAL,
               "sizes sum to 4 but the model ('(root)') has 5 layers; give sizes that add up to 5");
    ASSERT_ERR(ct_sequential_split(m, (int[]){3, 3}, 2, st), CT_EINVAL, "sizes sum to 6");
    ASSERT_ERR(ct_sequential_split(m, (int[]){5, 0}, 2, st), CT_EINVAL, "part 1 has 0 layers");
    ASSERT_ERR(ct_sequential_split(m, (int[]){5}, 0, st), CT_EINVAL, "at least one part");
    ASSERT_ERR(ct_sequential_split(m->kids[0], (int[]){1}, 1, st), CT_EINVAL, "is a linear, not a sequential");
    ASSERT(st[0] == NULL && st[1] == NULL);
    ASSERT_EQ(m->nkids, 5); /* untouched */
    /* Out of memory at every allocation in turn: nothing changes, nothing leaks. */
    int ok = 0;
    for (long f = 0; f < 32 && !ok; f++) {
        ct_mem_fail_after(f);
        ct_status s = ct_sequential_split(m, (int[]){1, 2, 2}, 3, st);
        ct_mem_fail_after(-1);
        if (s == CT_OK) {
            ok = 1;
        } else {
            ASSERT_EQ(s, CT_ENOMEM);
            ASSERT_EQ(m->nkids, 5);
            ASSERT(st[0] == NULL && st[1] == NULL && st[2] == NULL);
        }
    }
    ASSERT(ok);
    ASSERT_EQ(m->nkids, 0);
    ASSERT(!strcmp(st[2]->kids[1]->params[0]->name, "4.weight"));
    for (int i = 0; i < 3; i++) ct_module_destroy(st[i]);
    ct_module_destroy(m);
}

/* Shape inference of the ready models equals their forward's output shape. */
TEST(models_out_shape_matches_forward)
{
    ct_model_config cs[3] = {ct_model_config_default(CT_MODEL_MLP), ct_model_config_default(CT_MODEL_CNN),
                             ct_model_config_default(CT_MODEL_CNN)};
    ASSERT_OK(ct_model_config_parse_hidden(&cs[2], "4,6,8,20"));
    cs[2].kernel = 5;
    for (int i = 0; i < 3; i++) {
        ct_module *m;
        ASSERT_OK(ct_model_build(&cs[i], 1, &m));
        int64_t shape[4];
        int nd = ct_model_input_shape(&cs[i], 3, shape);
        ct_tensor *x = ct_tensor_create(CT_F32, nd, shape, CT_MEM_ACT), *y;
        ASSERT_OK(ct_module_forward(m, x, &y, NULL, NULL));
        check_inferred(m, x, y);
        ASSERT_EQ(y->shape[1], cs[i].classes);
        ct_tensor_release(x);
        ct_tensor_release(y);
        ct_module_destroy(m);
    }
}

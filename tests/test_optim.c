/*
 * Tests of src/optim: SGD and AdamW against numbers from PyTorch 1.13 and
 * against double-precision references written out here, slot ranges,
 * state save/restore, gradient clipping, LR schedules and error cases.
 *
 * The PyTorch numbers below were produced with /usr/bin/python3 (torch
 * 1.13, CPU) by this script; %.9g prints floats so that they round-trip:
 *
 *   import torch
 *   N = 8
 *   def p0(): return torch.tensor([0.3 * i - 1.1 for i in range(N)], dtype=torch.float32)
 *   def grad(t): return torch.tensor([((i * 7 + t * 3) % 11 - 5) * 0.13 + 0.05 * t
 *                                     for i in range(N)], dtype=torch.float32)
 *   def run(make, steps):
 *       p = p0().requires_grad_(True); opt = make([p])
 *       for t in range(1, steps + 1):
 *           p.grad = grad(t); opt.step()
 *       return p.detach(), opt.state[p]
 *   # SGD, 5 steps:   p, st = run(lambda ps: torch.optim.SGD(ps, **kw), 5)
 *   #   print p and st["momentum_buffer"] for each kw in the table below
 *   # AdamW, 7 steps: p, st = run(lambda ps: torch.optim.AdamW(ps, **kw), 7)
 *   #   print p, st["exp_avg"], st["exp_avg_sq"]
 *   # clipping: a.grad = grad(1); b.grad = grad(2)[:3] * 2
 *   #   tot = torch.nn.utils.clip_grad_norm_([a, b], max_norm)  (100 and 1)
 *   #   and with max_norm 1, norm_type=p for p in (1, 3, 0.5, inf) on fresh gradients
 *
 * ctrain follows PyTorch's operation order and fused multiply-adds, so on a
 * CPU with FMA the results must be bit-identical; without FMA (e.g. the
 * sanitizer build without -march=native) they must agree to about an ulp.
 */
#include <stdint.h>
#include <stdlib.h>

#include "test.h"

#define N 8

#ifdef FP_FAST_FMAF
#define ASSERT_TORCH(got, want) ASSERT_NEAR(got, want, 0)
#else
#define ASSERT_TORCH(got, want) ASSERT_CLOSE(got, want, 1e-6, 1e-7)
#endif

static float p0v(int i) { return (float)(0.3 * i - 1.1); }
static float gradv(int i, int t) { return (float)(((i * 7 + t * 3) % 11 - 5) * 0.13 + 0.05 * t); }

/* A parameter built by hand: the optimizer only reads these fields. */
static ct_param *make_param(const char *name, int64_t n)
{
    ct_param *p = ct_alloc_zeroed(sizeof *p, CT_MEM_OTHER);
    ASSERT(p);
    size_t len = strlen(name) + 1;
    p->name = ct_alloc_zeroed(len, CT_MEM_OTHER);
    memcpy(p->name, name, len);
    p->data = ct_tensor_create1(n, CT_MEM_PARAM);
    p->grad = ct_tensor_create1(n, CT_MEM_GRAD);
    ASSERT(p->data && p->grad);
    p->requires_grad = 1;
    return p;
}

static void free_param(ct_param *p)
{
    ct_tensor_release(p->data);
    ct_tensor_release(p->grad);
    ct_free(p->name);
    ct_free(p);
}

static void set_grad_t(ct_param *p, int t)
{
    for (int i = 0; i < p->data->numel; i++) ct_f32(p->grad)[i] = gradv(i, t);
}

/* ---- double-precision references, written from the PyTorch docs -------- */

static void ref_sgd(double *p, double *buf, const float *g, int n, double lr, double mom,
                    double damp, int nesterov, double wd, int first)
{
    for (int i = 0; i < n; i++) {
        double d = g[i] + wd * p[i];
        if (mom != 0) {
            buf[i] = first ? d : mom * buf[i] + (1 - damp) * d;
            d = nesterov ? d + mom * buf[i] : buf[i];
        }
        p[i] -= lr * d;
    }
}

static void ref_adamw(double *p, double *m, double *v, const float *g, int n, double lr,
                      double b1, double b2, double eps, double wd, int t)
{
    for (int i = 0; i < n; i++) {
        p[i] *= 1 - lr * wd;
        m[i] = b1 * m[i] + (1 - b1) * g[i];
        v[i] = b2 * v[i] + (1 - b2) * (double)g[i] * g[i];
        double mhat = m[i] / (1 - pow(b1, t)), vhat = v[i] / (1 - pow(b2, t));
        p[i] -= lr * mhat / (sqrt(vhat) + eps);
    }
}

/* ---- SGD ---------------------------------------------------------------- */

static const float sgd_plain_p[N] = {-1.14900005, -0.875, -0.601000011, -0.184000015, -0.0529999956, 0.364000052, 0.638000011, 0.911999941};
static const float sgd_mom_p[N] = {-1.22586989, -1.09967589, -0.750959754, -0.154996604, -0.171802685, 0.319913536, 0.644176662, 0.899070561};
static const float sgd_mom_buf[N] = {0.404588968, 0.500359893, 0.843377948, -0.12777397, 1.3979969, 0.31101501, 0.626863003, 0.865633965};
static const float sgd_damp_p[N] = {-1.16230977, -1.09577036, -0.697785378, -0.126727611, -0.160288081, 0.337796777, 0.718664527, 0.875294089};
static const float sgd_damp_buf[N] = {0.241877988, 0.488032907, 0.625793993, -0.156363964, 1.09079087, 0.227552012, 0.346294016, 0.69254899};
static const float sgd_nest_p[N] = {-1.26228297, -1.14470851, -0.826863825, -0.143496946, -0.297622412, 0.291922182, 0.587759018, 0.821163535};
static const float sgd_nest_buf[N] = {0.404588968, 0.500359893, 0.843377948, -0.12777397, 1.3979969, 0.31101501, 0.626863003, 0.865633965};
static const float sgd_wd_p[N] = {-1.15194643, -1.00233328, -0.685116947, -0.154900685, -0.14828752, 0.311928838, 0.585460067, 0.848758221};
static const float sgd_wd_buf[N] = {0.138241261, 0.153537631, 0.622801244, -0.1412884, 1.30400801, 0.343271524, 0.716031849, 1.0244782};
static const float sgd_nest_wd_p[N] = {-1.03087747, -0.812208235, -0.553446829, -0.160131335, -0.0630121902, 0.317299187, 0.556096077, 0.807733834};
static const float sgd_nest_wd_buf[N] = {-0.337875098, -0.306372344, 0.342739761, -0.207150131, 1.25435257, 0.473464698, 0.90026474, 1.38507748};

static const struct {
    const char *what; /* the torch.optim.SGD keyword arguments */
    double lr, momentum, dampening, wd;
    int nesterov;
    const float *p, *buf;
} sgd_cases[] = {
    {"lr=0.1", 0.1, 0, 0, 0, 0, sgd_plain_p, NULL},
    {"lr=0.1, momentum=0.9", 0.1, 0.9, 0, 0, 0, sgd_mom_p, sgd_mom_buf},
    {"lr=0.1, momentum=0.9, dampening=0.3", 0.1, 0.9, 0.3, 0, 0, sgd_damp_p, sgd_damp_buf},
    {"lr=0.1, momentum=0.9, nesterov=True", 0.1, 0.9, 0, 0, 1, sgd_nest_p, sgd_nest_buf},
    {"lr=0.1, momentum=0.8, weight_decay=0.05", 0.1, 0.8, 0, 0.05, 0, sgd_wd_p, sgd_wd_buf},
    {"lr=0.05, momentum=0.7, nesterov=True, weight_decay=0.2", 0.05, 0.7, 0, 0.2, 1, sgd_nest_wd_p,
     sgd_nest_wd_buf},
};

static void check_sgd_case(int c)
{
    ct_param *p = make_param("w", N);
    for (int i = 0; i < N; i++) ct_f32(p->data)[i] = p0v(i);
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    o.lr = sgd_cases[c].lr;
    o.momentum = sgd_cases[c].momentum;
    o.dampening = sgd_cases[c].dampening;
    o.weight_decay = sgd_cases[c].wd;
    o.nesterov = sgd_cases[c].nesterov;
    ct_optim *opt = ct_optim_create(&o, &p, 1);
    ASSERT(opt);

    double rp[N], rbuf[N] = {0};
    for (int i = 0; i < N; i++) rp[i] = p0v(i);
    for (int t = 1; t <= 5; t++) {
        set_grad_t(p, t);
        ASSERT_OK(ct_optim_step(opt));
        ref_sgd(rp, rbuf, ct_f32(p->grad), N, o.lr, o.momentum, o.dampening, o.nesterov,
                o.weight_decay, t == 1);
    }
    ASSERT_EQ(ct_optim_get_step(opt), 5);
    float *bufs[CT_OPTIM_MAX_STATE];
    const char *names[CT_OPTIM_MAX_STATE];
    int nb = ct_optim_state(opt, 0, bufs, names);
    ASSERT_EQ(nb, sgd_cases[c].buf ? 1 : 0);
    for (int i = 0; i < N; i++) {
        ASSERT_TORCH(ct_f32(p->data)[i], sgd_cases[c].p[i]);
        /* The pasted numbers agree with the formula in double. */
        ASSERT_CLOSE(rp[i], sgd_cases[c].p[i], 1e-5, 1e-6);
        if (nb) {
            ASSERT_TORCH(bufs[0][i], sgd_cases[c].buf[i]);
            ASSERT_CLOSE(rbuf[i], sgd_cases[c].buf[i], 1e-5, 1e-6);
        }
    }
    if (nb) ASSERT(!strcmp(names[0], "momentum_buffer"));
    ct_optim_destroy(opt);
    free_param(p);
}

TEST(optim_sgd_plain_matches_torch) { check_sgd_case(0); }
TEST(optim_sgd_momentum_matches_torch) { check_sgd_case(1); }
TEST(optim_sgd_dampening_matches_torch) { check_sgd_case(2); }
TEST(optim_sgd_nesterov_matches_torch) { check_sgd_case(3); }
TEST(optim_sgd_weight_decay_matches_torch) { check_sgd_case(4); }
TEST(optim_sgd_nesterov_weight_decay_matches_torch) { check_sgd_case(5); }

/* ---- AdamW -------------------------------------------------------------- */

static const float adamw_p[N] = {-1.10591769, -0.826481938, -0.538814127, -0.192516237, 0.0670308173, 0.369308114, 0.694396913, 0.976037443};
static const float adamw_m[N] = {0.183171704, 0.0921291485, 0.149813622, 0.115350313, 0.140137747, 0.0819922164, 0.151775911, 0.0723163486};
static const float adamw_v[N] = {0.00197333004, 0.00133189326, 0.00171870412, 0.00155890174, 0.00164881232, 0.00133871671, 0.00176530785, 0.00130252377};
static const float adamw2_p[N] = {-1.18084359, -0.952028334, -0.713078141, -0.184542432, -0.0634104311, 0.257598937, 0.674996793, 0.912293375};
static const float adamw2_m[N] = {0.331141651, 0.141598716, 0.236207128, 0.228404611, 0.221901685, 0.133470088, 0.272099584, 0.119164675};
static const float adamw2_v[N] = {0.0918846801, 0.055918429, 0.0765340254, 0.0718244091, 0.0709146336, 0.0596168339, 0.0785119534, 0.0554539226};

static const struct {
    const char *what;
    double lr, b1, b2, eps, wd;
    const float *p, *m, *v;
} adamw_cases[] = {
    {"lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1", 0.01, 0.9, 0.999, 1e-8, 0.1, adamw_p,
     adamw_m, adamw_v},
    {"lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0", 0.05, 0.8, 0.95, 1e-6, 0, adamw2_p, adamw2_m,
     adamw2_v},
};

static void check_adamw_case(int c)
{
    ct_param *p = make_param("w", N);
    for (int i = 0; i < N; i++) ct_f32(p->data)[i] = p0v(i);
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.lr = adamw_cases[c].lr;
    o.beta1 = adamw_cases[c].b1;
    o.beta2 = adamw_cases[c].b2;
    o.eps = adamw_cases[c].eps;
    o.weight_decay = adamw_cases[c].wd;
    ct_optim *opt = ct_optim_create(&o, &p, 1);
    ASSERT(opt);
    ASSERT(!strcmp(ct_optim_name(opt), "adamw"));

    double rp[N], rm[N] = {0}, rv[N] = {0};
    for (int i = 0; i < N; i++) rp[i] = p0v(i);
    for (int t = 1; t <= 7; t++) {
        set_grad_t(p, t);
        ASSERT_OK(ct_optim_step(opt));
        ref_adamw(rp, rm, rv, ct_f32(p->grad), N, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, t);
    }
    float *bufs[CT_OPTIM_MAX_STATE];
    const char *names[CT_OPTIM_MAX_STATE];
    ASSERT_EQ(ct_optim_state(opt, 0, bufs, names), 2);
    ASSERT(!strcmp(names[0], "exp_avg") && !strcmp(names[1], "exp_avg_sq"));
    for (int i = 0; i < N; i++) {
        ASSERT_TORCH(ct_f32(p->data)[i], adamw_cases[c].p[i]);
        ASSERT_TORCH(bufs[0][i], adamw_cases[c].m[i]);
        ASSERT_TORCH(bufs[1][i], adamw_cases[c].v[i]);
        ASSERT_CLOSE(rp[i], adamw_cases[c].p[i], 1e-5, 1e-6);
        ASSERT_CLOSE(rm[i], adamw_cases[c].m[i], 1e-5, 1e-7);
        ASSERT_CLOSE(rv[i], adamw_cases[c].v[i], 1e-5, 1e-9);
    }
    ct_optim_destroy(opt);
    free_param(p);
}

TEST(optim_adamw_matches_torch) { check_adamw_case(0); }
TEST(optim_adamw_no_decay_other_betas_matches_torch) { check_adamw_case(1); }

/* Many elements (the vectorisable body and its tail) and many steps of the
 * raw update against the double reference. */
TEST(optim_adamw_long_run_vs_double)
{
    enum { M = 1003, STEPS = 30 };
    float *p = malloc(M * sizeof *p), *g = malloc(M * sizeof *g);
    float *m = calloc(M, sizeof *m), *v = calloc(M, sizeof *v);
    double *rp = malloc(M * sizeof *rp), *rm = calloc(M, sizeof *rm), *rv = calloc(M, sizeof *rv);
    ASSERT(p && g && m && v && rp && rm && rv);
    ct_rng r;
    ct_rng_init(&r, 7, 1);
    ct_rng_normal(&r, p, M, 0, 1);
    for (int i = 0; i < M; i++) rp[i] = p[i];
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.lr = 0.01;
    o.weight_decay = 0.05;
    for (int t = 1; t <= STEPS; t++) {
        ct_rng_normal(&r, g, M, 0.1f, 1);
        ct_adamw_update(p, g, m, v, M, &o, t);
        ref_adamw(rp, rm, rv, g, M, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, t);
    }
    for (int i = 0; i < M; i++) {
        ASSERT_CLOSE(p[i], rp[i], 1e-6, 2e-6);
        ASSERT_CLOSE(m[i], rm[i], 1e-5, 1e-7);
        ASSERT_CLOSE(v[i], rv[i], 1e-5, 1e-9);
    }
    free(p), free(g), free(m), free(v), free(rp), free(rm), free(rv);
}

/* ---- slots -------------------------------------------------------------- */

/* Stepping a parameter as two ranges with their own state gives the same
 * bits as stepping it whole. */
static void check_split(ct_optim_opts o)
{
    enum { L = 10, CUT = 4, STEPS = 6 };
    ct_param *w = make_param("layer.weight", L);
    float data[L], grad[L];
    for (int i = 0; i < L; i++) data[i] = ct_f32(w->data)[i] = p0v(i);
    ct_optim *whole = ct_optim_create(&o, &w, 1);
    ct_optim_slot halves[2] = {
        {.data = data, .grad = grad, .n = CUT, .name = "layer.weight", .offset = 0},
        {.data = data + CUT, .grad = grad + CUT, .n = L - CUT, .name = "layer.weight", .offset = CUT},
    };
    ct_optim *split = ct_optim_create_slots(&o, halves, 2);
    ASSERT(whole && split);
    ASSERT_EQ(ct_optim_num_slots(split), 2);
    ASSERT_EQ(ct_optim_slot_at(split, 1)->offset, CUT);
    ASSERT_EQ(ct_optim_slot_at(split, 1)->n, L - CUT);
    ASSERT(!strcmp(ct_optim_slot_at(split, 1)->name, "layer.weight"));
    for (int t = 1; t <= STEPS; t++) {
        set_grad_t(w, t);
        memcpy(grad, ct_f32(w->grad), sizeof grad);
        ASSERT_OK(ct_optim_step(whole));
        ASSERT_OK(ct_optim_step(split));
    }
    ASSERT(memcmp(data, ct_f32(w->data), sizeof data) == 0);
    float *wb[CT_OPTIM_MAX_STATE], *hb[CT_OPTIM_MAX_STATE];
    int nb = ct_optim_state(whole, 0, wb, NULL);
    ASSERT(nb >= 1);
    for (int h = 0; h < 2; h++) {
        ASSERT_EQ(ct_optim_state(split, h, hb, NULL), nb);
        for (int b = 0; b < nb; b++)
            ASSERT(memcmp(hb[b], wb[b] + halves[h].offset, (size_t)halves[h].n * sizeof(float)) == 0);
    }
    /* And the step really moved the parameter (so equality means something). */
    ASSERT(fabsf(data[3] - p0v(3)) > 1e-3f);
    ct_optim_destroy(whole);
    ct_optim_destroy(split);
    free_param(w);
}

TEST(optim_slot_ranges_equal_whole)
{
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.lr = 0.01;
    check_split(o);
    o = ct_optim_defaults(CT_OPT_SGD);
    o.lr = 0.1;
    o.momentum = 0.9;
    o.nesterov = 1;
    o.weight_decay = 0.01;
    check_split(o);
}

/* ---- state round trip --------------------------------------------------- */

/* Trains 3 steps, copies the state into a fresh optimizer over a copy of
 * the parameter, and checks 3 more steps agree bit for bit.  Without
 * set_step the continuation must differ (the test can tell). */
static void check_resume(ct_optim_opts o)
{
    ct_param *a = make_param("w", N), *b = make_param("w", N), *c = make_param("w", N);
    for (int i = 0; i < N; i++) ct_f32(a->data)[i] = p0v(i);
    ct_optim *oa = ct_optim_create(&o, &a, 1);
    ASSERT(oa);
    for (int t = 1; t <= 3; t++) {
        set_grad_t(a, t);
        ASSERT_OK(ct_optim_step(oa));
    }
    /* Checkpoint: parameter, state buffers and step. */
    ct_optim *ob = ct_optim_create(&o, &b, 1), *oc = ct_optim_create(&o, &c, 1);
    ASSERT(ob && oc);
    ASSERT_OK(ct_tensor_copy(b->data, a->data));
    ASSERT_OK(ct_tensor_copy(c->data, a->data));
    float *sa[CT_OPTIM_MAX_STATE], *sb[CT_OPTIM_MAX_STATE], *sc[CT_OPTIM_MAX_STATE];
    int nb = ct_optim_state(oa, 0, sa, NULL);
    ASSERT(nb >= 1);
    ASSERT_EQ(ct_optim_state(ob, 0, sb, NULL), nb);
    ASSERT_EQ(ct_optim_state(oc, 0, sc, NULL), nb);
    for (int k = 0; k < nb; k++) {
        for (int i = 0; i < N; i++) ASSERT_EQ(sb[k][i], 0); /* zeroed before the first step */
        memcpy(sb[k], sa[k], N * sizeof(float));
        memcpy(sc[k], sa[k], N * sizeof(float));
    }
    ct_optim_set_step(ob, ct_optim_get_step(oa));
    ASSERT_EQ(ct_optim_get_step(ob), 3);
    for (int t = 4; t <= 6; t++) {
        set_grad_t(a, t);
        set_grad_t(b, t);
        set_grad_t(c, t);
        ASSERT_OK(ct_optim_step(oa));
        ASSERT_OK(ct_optim_step(ob));
        ASSERT_OK(ct_optim_step(oc));
    }
    ASSERT(memcmp(ct_f32(a->data), ct_f32(b->data), N * sizeof(float)) == 0);
    for (int k = 0; k < nb; k++) ASSERT(memcmp(sa[k], sb[k], N * sizeof(float)) == 0);
    ASSERT(memcmp(ct_f32(a->data), ct_f32(c->data), N * sizeof(float)) != 0);
    ct_optim_destroy(oa), ct_optim_destroy(ob), ct_optim_destroy(oc);
    free_param(a), free_param(b), free_param(c);
}

TEST(optim_state_round_trip_resumes_exactly)
{
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.lr = 0.01;
    check_resume(o);
    o = ct_optim_defaults(CT_OPT_SGD);
    o.lr = 0.1;
    o.momentum = 0.9;
    o.dampening = 0.5; /* so "first step" (buf = g) differs from a restored buffer */
    check_resume(o);
}

TEST(optim_state_memory_is_lazy_and_counted)
{
    ct_param *ps[2] = {make_param("a", 10), make_param("b", 5)};
    size_t base = ct_mem_current(CT_MEM_OPTIM);
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    ct_optim *opt = ct_optim_create(&o, ps, 2);
    ASSERT(opt);
    size_t created = ct_mem_current(CT_MEM_OPTIM);
    set_grad_t(ps[0], 1);
    set_grad_t(ps[1], 1);
    ASSERT_OK(ct_optim_step(opt));
    /* Two moments for 10 + 5 floats, each range padded to 16 floats. */
    ASSERT_EQ(ct_mem_current(CT_MEM_OPTIM) - created, 2 * (16 + 16) * sizeof(float));
    ct_optim_destroy(opt);
    ASSERT_EQ(ct_mem_current(CT_MEM_OPTIM), base);
    /* SGD without momentum keeps no state at all. */
    o = ct_optim_defaults(CT_OPT_SGD);
    opt = ct_optim_create(&o, ps, 2);
    created = ct_mem_current(CT_MEM_OPTIM);
    ASSERT_OK(ct_optim_step(opt));
    ASSERT_EQ(ct_optim_state(opt, 0, NULL, NULL), 0);
    ASSERT_EQ(ct_mem_current(CT_MEM_OPTIM), created);
    ct_optim_destroy(opt);
    free_param(ps[0]), free_param(ps[1]);
}

/* ---- slots that follow parameters, NULL grads, empty shards -------------- */

TEST(optim_param_slots_follow_repointing)
{
    ct_param *p = make_param("w", N);
    ct_param *frozen = make_param("frozen", 3);
    frozen->requires_grad = 0;
    ct_param *list[2] = {frozen, p};
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    o.lr = 0.5;
    ct_optim *opt = ct_optim_create(&o, list, 2);
    ASSERT(opt);
    ASSERT_EQ(ct_optim_num_slots(opt), 1);
    /* A strategy re-points data and grad at its own storage (a bucket). */
    ct_tensor *bucket = ct_tensor_create1(2 * N, CT_MEM_COMM);
    ct_tensor *gview = ct_tensor_view(bucket, N, 1, (int64_t[]){N});
    ct_tensor *newdata = ct_tensor_create1(N, CT_MEM_PARAM);
    for (int i = 0; i < N; i++) ct_f32(gview)[i] = (float)i, ct_f32(newdata)[i] = 1;
    ct_tensor_release(p->grad);
    ct_tensor_release(p->data);
    p->grad = gview;
    p->data = newdata;
    ASSERT(ct_optim_slot_at(opt, 0)->grad == ct_f32(gview));
    ASSERT_OK(ct_optim_step(opt));
    for (int i = 0; i < N; i++) ASSERT_NEAR(ct_f32(p->data)[i], 1 - 0.5f * (float)i, 0);
    set_grad_t(frozen, 1);
    ASSERT_EQ(ct_f32(frozen->data)[0], 0);

    /* A parameter that changes size under the optimizer is refused, untouched. */
    ct_tensor *wrong = ct_tensor_create1(N + 1, CT_MEM_PARAM);
    ct_tensor *keep = p->data;
    p->data = wrong;
    ASSERT_ERR(ct_optim_step(opt), CT_ESTATE, "parameter w");
    ASSERT_EQ(ct_optim_get_step(opt), 1);
    p->data = keep;
    ct_tensor_release(wrong);

    /* After set_slot the slot no longer follows the parameter. */
    float d2[N] = {0}, g2[N];
    for (int i = 0; i < N; i++) g2[i] = 2;
    ct_optim_set_slot(opt, 0, d2, g2);
    ASSERT_OK(ct_optim_step(opt));
    ASSERT_NEAR(d2[5], -1.0, 0);
    ASSERT_NEAR(ct_f32(p->data)[5], 1 - 0.5 * 5, 0);
    ASSERT(!strcmp(ct_optim_slot_at(opt, 0)->name, "w"));
    ct_optim_destroy(opt);
    ct_tensor_release(bucket);
    free_param(p);
    free_param(frozen);
}

/* PyTorch skips a parameter whose .grad is None and does not advance its
 * step: its first real update must use bias correction for t = 1. */
TEST(optim_null_grad_is_skipped)
{
    ct_param *a = make_param("a", N), *b = make_param("b", N);
    ct_tensor *bgrad = b->grad;
    b->grad = NULL;
    for (int i = 0; i < N; i++) ct_f32(a->data)[i] = ct_f32(b->data)[i] = p0v(i);
    ct_param *list[2] = {a, b};
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    o.lr = 0.01;
    ct_optim *opt = ct_optim_create(&o, list, 2);
    ASSERT(opt);
    set_grad_t(a, 1);
    ASSERT_OK(ct_optim_step(opt));
    for (int i = 0; i < N; i++) ASSERT_EQ(ct_f32(b->data)[i], p0v(i));
    b->grad = bgrad;
    set_grad_t(a, 1);
    set_grad_t(b, 1);
    /* a is now at t = 2, b at t = 1: b's result is a's first step. */
    float a_after1[N];
    memcpy(a_after1, ct_f32(a->data), sizeof a_after1);
    ASSERT_OK(ct_optim_step(opt));
    ASSERT(memcmp(ct_f32(b->data), a_after1, sizeof a_after1) == 0);
    ct_optim_destroy(opt);
    free_param(a), free_param(b);
}

TEST(optim_empty_shards)
{
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    ct_optim *opt = ct_optim_create_slots(&o, NULL, 0);
    ASSERT(opt);
    ASSERT_OK(ct_optim_step(opt));
    ASSERT_EQ(ct_optim_get_step(opt), 1);
    ct_norm_acc e = ct_norm_acc_init(2.0);
    ct_optim_grad_norm_acc(opt, &e);
    ASSERT_EQ(e.v, 0);
    ct_optim_destroy(opt);
    float x[2] = {1, 2}, g[2] = {1, 1};
    ct_optim_slot s[2] = {{.data = NULL, .grad = NULL, .n = 0}, {.data = x, .grad = g, .n = 2}};
    opt = ct_optim_create_slots(&o, s, 2);
    ASSERT(opt);
    ASSERT(!strcmp(ct_optim_slot_at(opt, 0)->name, "slot0"));
    float *bufs[CT_OPTIM_MAX_STATE];
    ASSERT_EQ(ct_optim_state(opt, 0, bufs, NULL), 2);
    ASSERT(bufs[0] && bufs[1]);
    ASSERT_OK(ct_optim_step(opt));
    ASSERT(x[0] < 1);
    ct_optim_destroy(opt);
}

/* ---- errors ------------------------------------------------------------- */

TEST(optim_invalid_options)
{
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ASSERT_OK(ct_optim_validate(&o));
    ASSERT_NEAR(o.lr, 0.01, 0);
    ASSERT_EQ(o.nesterov, 0);
    o.lr = -0.1;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "lr -0.1");
    o.lr = NAN;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "lr nan");
    o = ct_optim_defaults(CT_OPT_SGD);
    o.momentum = -0.5;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "momentum -0.5");
    o.momentum = 0;
    o.nesterov = 1;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "nesterov needs momentum > 0");
    o.momentum = 0.9;
    o.dampening = 0.1;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "dampening 0.1");
    o.dampening = 0;
    ASSERT_OK(ct_optim_validate(&o));
    o.weight_decay = -1e-4;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "weight_decay -0.0001");

    o = ct_optim_defaults(CT_OPT_ADAMW);
    ASSERT_OK(ct_optim_validate(&o));
    ASSERT_NEAR(o.weight_decay, 0.01, 0);
    ASSERT_NEAR(o.beta2, 0.999, 0);
    o.beta1 = 1.0;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "beta1 1 is outside [0, 1)");
    o.beta1 = 0.9;
    o.beta2 = -0.1;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "beta2 -0.1");
    o.beta2 = 0.999;
    o.eps = -1e-8;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "eps -1e-08");
    o.eps = 1e-8;
    o.kind = (ct_optim_kind)7;
    ASSERT_ERR(ct_optim_validate(&o), CT_EINVAL, "kind 7");

    /* create refuses them too, with the same message. */
    o = ct_optim_defaults(CT_OPT_ADAMW);
    o.beta2 = 1.5;
    ct_param *p = make_param("w", 4);
    ct_clear_error();
    ASSERT(ct_optim_create(&o, &p, 1) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "beta2 1.5");
    ASSERT(ct_optim_create_slots(&o, NULL, 0) == NULL);
    ASSERT(ct_optim_create(NULL, &p, 1) == NULL);
    ct_optim_slot bad = {.data = NULL, .grad = NULL, .n = 3, .name = "x"};
    o = ct_optim_defaults(CT_OPT_ADAMW);
    ct_clear_error();
    ASSERT(ct_optim_create_slots(&o, &bad, 1) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "slot 0 (x)");

    /* A bf16 parameter is not something the optimizer can step. */
    ct_tensor *f32 = p->data;
    p->data = ct_tensor_create(CT_BF16, 1, (int64_t[]){4}, CT_MEM_PARAM);
    ct_clear_error();
    ASSERT(ct_optim_create(&o, &p, 1) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "parameter w is BF16");
    ct_tensor_release(p->data);
    p->data = f32;
    ct_param *twice[2] = {p, p};
    ct_clear_error();
    ASSERT(ct_optim_create(&o, twice, 2) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "parameter w appears twice");

    /* A learning rate set later is checked by the step, which changes nothing. */
    ct_optim *opt = ct_optim_create(&o, &p, 1);
    ASSERT(opt);
    ct_optim_set_lr(opt, -1);
    ASSERT_NEAR(ct_optim_get_lr(opt), -1, 0);
    ASSERT_ERR(ct_optim_step(opt), CT_EINVAL, "lr -1");
    ASSERT_EQ(ct_optim_get_step(opt), 0);
    ct_optim_destroy(opt);
    free_param(p);

    ct_optim_kind k;
    ASSERT_EQ(ct_optim_parse("adamw", &k), 0);
    ASSERT_EQ(k, CT_OPT_ADAMW);
    ASSERT_EQ(ct_optim_parse("sgd", &k), 0);
    ASSERT_EQ(k, CT_OPT_SGD);
    ASSERT_EQ(ct_optim_parse("adam", &k), -1);
}

/* A failed state allocation fails the step without touching anything, and
 * the next step works as if nothing had happened. */
TEST(optim_out_of_memory)
{
    ct_param *a = make_param("a", N), *b = make_param("b", N);
    for (int i = 0; i < N; i++) ct_f32(a->data)[i] = ct_f32(b->data)[i] = p0v(i);
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    ct_optim *oa = ct_optim_create(&o, &a, 1), *ob = ct_optim_create(&o, &b, 1);
    ASSERT(oa && ob);
    set_grad_t(a, 1);
    set_grad_t(b, 1);
    ct_mem_fail_after(0);
    ASSERT_ERR(ct_optim_step(oa), CT_ENOMEM, "out of memory");
    ct_mem_fail_after(0);
    ASSERT_EQ(ct_optim_state(oa, 0, NULL, NULL), CT_ENOMEM);
    ct_mem_fail_after(-1);
    ASSERT_EQ(ct_optim_get_step(oa), 0);
    for (int i = 0; i < N; i++) ASSERT_EQ(ct_f32(a->data)[i], p0v(i));
    ASSERT_OK(ct_optim_step(oa));
    ASSERT_OK(ct_optim_step(ob));
    ASSERT(memcmp(ct_f32(a->data), ct_f32(b->data), N * sizeof(float)) == 0);
    ct_optim_destroy(oa), ct_optim_destroy(ob);

    /* Creation under every possible allocation failure leaks nothing. */
    size_t base = ct_mem_current(CT_MEM_OPTIM);
    ct_optim_slot s = {.data = ct_f32(a->data), .grad = ct_f32(a->grad), .n = N, .name = "a"};
    for (long k = 0; k < 4; k++) {
        ct_mem_fail_after(k);
        ct_optim *opt = ct_optim_create_slots(&o, &s, 1);
        ct_mem_fail_after(-1);
        ct_optim_destroy(opt);
        ASSERT_EQ(ct_mem_current(CT_MEM_OPTIM), base);
    }
    free_param(a), free_param(b);
}

/* ---- gradient clipping -------------------------------------------------- */

static const double clip_total = 1.87339258; /* torch.nn.utils.clip_grad_norm_ return value */
static const float clip1_a[N] = {-0.112096034, 0.373653442, 0.0960823223, -0.181488827, 0.304260671, 0.0266895331, -0.250881612, 0.234867886};
static const float clip1_b[3] = {0.245543703, -0.309598565, 0.661900401};

static void clip_grads(ct_param *a, ct_param *b)
{
    set_grad_t(a, 1);
    for (int i = 0; i < 3; i++) ct_f32(b->grad)[i] = gradv(i, 2) * 2;
}

TEST(optim_clip_grad_norm_matches_torch)
{
    ct_param *a = make_param("a", N), *b = make_param("b", 3), *nog = make_param("c", 2);
    ct_tensor_release(nog->grad);
    nog->grad = NULL;
    ct_param *list[3] = {a, nog, b};
    clip_grads(a, b);
    double sq = 0;
    for (int i = 0; i < N; i++) sq += (double)ct_f32(a->grad)[i] * ct_f32(a->grad)[i];
    for (int i = 0; i < 3; i++) sq += (double)ct_f32(b->grad)[i] * ct_f32(b->grad)[i];
    ASSERT_CLOSE(ct_grad_sq_sum(list, 3), sq, 1e-15, 0);
    ASSERT_CLOSE(sqrt(sq), clip_total, 1e-7, 0);

    /* Not scaled: max_norm above the norm leaves the gradients alone. */
    float before[N], norm = 0;
    memcpy(before, ct_f32(a->grad), sizeof before);
    ASSERT_OK(ct_clip_grad_norm(list, 3, 100, &norm));
    ASSERT_CLOSE(norm, clip_total, 1e-7, 0);
    ASSERT(memcmp(before, ct_f32(a->grad), sizeof before) == 0);
    /* At max_norm == norm PyTorch still scales, by norm/(norm + 1e-6). */
    ASSERT(ct_clip_coef(sqrt(sq), sqrt(sq)) < 1);

    /* Scaled by 1/(norm + 1e-6). */
    ASSERT_OK(ct_clip_grad_norm(list, 3, 1, &norm));
    for (int i = 0; i < N; i++) {
        ASSERT_CLOSE(ct_f32(a->grad)[i], clip1_a[i], 3e-7, 0);
        ASSERT_CLOSE(ct_f32(a->grad)[i], before[i] / (sqrt(sq) + 1e-6), 2e-7, 0);
    }
    for (int i = 0; i < 3; i++) ASSERT_CLOSE(ct_f32(b->grad)[i], clip1_b[i], 3e-7, 0);
    ASSERT_CLOSE(sqrt(ct_grad_sq_sum(list, 3)), 1.0, 1e-6, 0);
    ASSERT_ERR(ct_clip_grad_norm(list, 3, -1, NULL), CT_EINVAL, "max_norm -1");
    ASSERT_ERR(ct_clip_grad_norm(list, 3, NAN, NULL), CT_EINVAL, "max_norm nan");
    ASSERT_NEAR(ct_clip_coef(4.0, 2.0), 2.0 / (4.0 + 1e-6), 1e-7);
    ASSERT_EQ(ct_clip_coef(NAN, 1.0), 1);
    free_param(a), free_param(b), free_param(nog);
}

/* torch.nn.utils.clip_grad_norm_([a, b], 1.0, norm_type=p) on clip_grads'
 * gradients (the script above), for p = 1, 3, 0.5 and inf: the norm it
 * returns and the first and last clipped elements. */
TEST(optim_clip_grad_norm_any_p_matches_torch)
{
    static const struct {
        double p, total;
        float a0, b2;
    } ref[] = {
        {1.0, 5.23999977, -0.0400763266f, 0.236641183f},
        {3.0, 1.43755412, -0.146081358f, 0.86257571f},
        {0.5, 51.5972252, -0.00406998629f, 0.0240323003f},
        {INFINITY, 1.24000001, -0.169354692f, 0.999999225f},
    };
    ct_param *a = make_param("a", N), *b = make_param("b", 3);
    ct_param *list[2] = {a, b};
    for (size_t k = 0; k < sizeof ref / sizeof ref[0]; k++) {
        clip_grads(a, b);
        float norm = 0;
        ASSERT_OK(ct_clip_grad_norm_p(list, 2, 1.0f, ref[k].p, &norm));
        ASSERT_CLOSE(norm, ref[k].total, 1e-6, 0);
        ASSERT_CLOSE(ct_f32(a->grad)[0], ref[k].a0, 1e-6, 0);
        ASSERT_CLOSE(ct_f32(b->grad)[2], ref[k].b2, 1e-6, 0);
        /* the parts a sharded strategy adds: a split sum is the same norm */
        clip_grads(a, b);
        ct_norm_acc whole = ct_norm_acc_init(ref[k].p), lo = ct_norm_acc_init(ref[k].p), hi = lo;
        ct_norm_acc_f32(&whole, ct_f32(a->grad), N);
        ct_norm_acc_f32(&lo, ct_f32(a->grad), 3);
        ct_norm_acc_f32(&hi, ct_f32(a->grad) + 3, N - 3);
        ct_norm_acc_add(&lo, hi.v);
        ASSERT_CLOSE(ct_norm_acc_norm(&lo), ct_norm_acc_norm(&whole), 1e-14, 0);
        /* a term after scaling the gradients by k is the term of the scaled ones */
        ct_norm_acc scaled = ct_norm_acc_init(ref[k].p);
        float half[N];
        for (int i = 0; i < N; i++) half[i] = ct_f32(a->grad)[i] * -0.5f;
        ct_norm_acc_f32(&scaled, half, N);
        ASSERT_CLOSE(ct_norm_acc_scaled(&whole, whole.v, -0.5f), scaled.v, 1e-14, 0);
    }
    ASSERT_ERR(ct_clip_grad_norm_p(list, 2, 1.0f, 0.0, NULL), CT_EINVAL, "norm_type 0");
    ASSERT_ERR(ct_clip_grad_norm_p(list, 2, 1.0f, -2.0, NULL), CT_EINVAL, "norm_type -2");
    ASSERT_ERR(ct_clip_grad_norm_p(list, 2, 1.0f, NAN, NULL), CT_EINVAL, "norm_type nan");
    ASSERT_ERR(ct_clip_grad_norm_p(list, 2, 1.0f, -INFINITY, NULL), CT_EINVAL, "norm_type -inf");
    free_param(a), free_param(b);
}

TEST(optim_clip_parts_over_shards_and_half_grads)
{
    /* The same sum over an optimizer's two half slots as over the parameter. */
    ct_param *a = make_param("a", N);
    set_grad_t(a, 3);
    ct_optim_slot s[2] = {
        {.data = ct_f32(a->data), .grad = ct_f32(a->grad), .n = 5, .name = "a"},
        {.data = ct_f32(a->data) + 5, .grad = ct_f32(a->grad) + 5, .n = N - 5, .name = "a", .offset = 5},
    };
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_optim *opt = ct_optim_create_slots(&o, s, 2);
    ASSERT(opt);
    double want = 0;
    for (int i = 0; i < N; i++) want += (double)gradv(i, 3) * gradv(i, 3);
    ct_norm_acc acc = ct_norm_acc_init(2.0), mx = ct_norm_acc_init(INFINITY);
    ct_optim_grad_norm_acc(opt, &acc);
    ct_optim_grad_norm_acc(opt, &mx);
    ASSERT_CLOSE(acc.v, want, 1e-15, 0);
    ASSERT_CLOSE(ct_norm_acc_norm(&acc), sqrt(want), 1e-15, 0);
    double want_max = 0;
    for (int i = 0; i < N; i++) want_max = fmax(want_max, fabs((double)gradv(i, 3)));
    ASSERT_EQ(ct_norm_acc_norm(&mx), want_max);
    ASSERT_CLOSE(ct_grad_sq_sum(&a, 1), want, 1e-15, 0);
    ct_optim_scale_grads(opt, 0.5f);
    for (int i = 0; i < N; i++) ASSERT_EQ(ct_f32(a->grad)[i], gradv(i, 3) * 0.5f);
    ct_optim_destroy(opt);

    /* bf16 gradients (exact small values) are summed and scaled too. */
    ct_tensor_release(a->grad);
    a->grad = ct_tensor_create(CT_BF16, 1, (int64_t[]){N}, CT_MEM_GRAD);
    uint16_t *h = ct_tensor_data(a->grad);
    for (int i = 0; i < N; i++) h[i] = ct_f32_to_bf16((float)(i - 3));
    ASSERT_NEAR(ct_grad_sq_sum(&a, 1), 9 + 4 + 1 + 0 + 1 + 4 + 9 + 16, 0);
    ct_scale_grads(&a, 1, 0.5f);
    ASSERT_NEAR(ct_bf16_to_f32(h[0]), -1.5, 0);
    free_param(a);
}

/* ---- LR schedules ------------------------------------------------------- */

TEST(optim_lr_schedules)
{
    ct_lr_schedule c = {.kind = CT_SCHED_CONSTANT, .base_lr = 0.1};
    ASSERT_OK(ct_sched_validate(&c));
    ASSERT_NEAR(ct_lr_at(&c, 0), 0.1, 0);
    ASSERT_NEAR(ct_lr_at(&c, 123456), 0.1, 0);
    c.warmup_steps = 4;
    ASSERT_NEAR(ct_lr_at(&c, 0), 0.025, 1e-15);
    ASSERT_NEAR(ct_lr_at(&c, 3), 0.1, 1e-15);
    ASSERT_NEAR(ct_lr_at(&c, 4), 0.1, 0);

    /* Warmup 10, total 110, base 1, min 0.1: cosine over 100 steps. */
    ct_lr_schedule s = {.kind = CT_SCHED_COSINE, .base_lr = 1.0, .warmup_steps = 10,
                        .total_steps = 110, .min_lr = 0.1};
    ASSERT_OK(ct_sched_validate(&s));
    ASSERT_NEAR(ct_lr_at(&s, 0), 0.1, 1e-15);   /* base * 1/10 */
    ASSERT_NEAR(ct_lr_at(&s, 4), 0.5, 1e-15);   /* base * 5/10 */
    ASSERT_NEAR(ct_lr_at(&s, 9), 1.0, 1e-15);   /* last warmup step reaches base */
    ASSERT_NEAR(ct_lr_at(&s, 10), 1.0, 1e-15);  /* progress 0 */
    ASSERT_NEAR(ct_lr_at(&s, 35), 0.1 + 0.9 * 0.5 * (1 + sqrt(0.5)), 1e-12); /* progress 1/4 */
    ASSERT_NEAR(ct_lr_at(&s, 60), 0.55, 1e-12); /* progress 1/2: halfway between */
    ASSERT_NEAR(ct_lr_at(&s, 110), 0.1, 1e-12); /* end */
    ASSERT_NEAR(ct_lr_at(&s, 500), 0.1, 1e-12); /* clipped after the end */
    /* Monotone non-increasing after warmup. */
    for (int64_t t = 10; t < 115; t++) ASSERT(ct_lr_at(&s, t + 1) <= ct_lr_at(&s, t));
    /* No warmup, total == warmup: max(1, ...) keeps the division defined. */
    ct_lr_schedule z = {.kind = CT_SCHED_COSINE, .base_lr = 2, .warmup_steps = 3, .total_steps = 3};
    ASSERT_OK(ct_sched_validate(&z));
    ASSERT_NEAR(ct_lr_at(&z, 3), 2, 1e-15);
    ASSERT_NEAR(ct_lr_at(&z, 4), 0, 1e-15);

    ct_sched_kind k;
    ASSERT_EQ(ct_sched_parse("cosine", &k), 0);
    ASSERT_EQ(k, CT_SCHED_COSINE);
    ASSERT_EQ(ct_sched_parse("constant", &k), 0);
    ASSERT_EQ(k, CT_SCHED_CONSTANT);
    ASSERT_EQ(ct_sched_parse("linear", &k), -1);
    ASSERT(!strcmp(ct_sched_name(CT_SCHED_COSINE), "cosine"));

    ct_lr_schedule bad = s;
    bad.base_lr = -1;
    ASSERT_ERR(ct_sched_validate(&bad), CT_EINVAL, "base learning rate -1");
    bad = s;
    bad.min_lr = 2;
    ASSERT_ERR(ct_sched_validate(&bad), CT_EINVAL, "min_lr 2");
    bad = s;
    bad.total_steps = 0;
    ASSERT_ERR(ct_sched_validate(&bad), CT_EINVAL, "total_steps > 0");
    bad = s;
    bad.warmup_steps = 200;
    ASSERT_ERR(ct_sched_validate(&bad), CT_EINVAL, "warmup_steps 200 exceeds total_steps 110");
    bad = s;
    bad.warmup_steps = -1;
    ASSERT_ERR(ct_sched_validate(&bad), CT_EINVAL, "warmup_steps -1");

    /* A schedule drives an optimizer through set_lr. */
    ct_optim_opts o = ct_optim_defaults(CT_OPT_SGD);
    ct_optim *opt = ct_optim_create_slots(&o, NULL, 0);
    ct_optim_set_lr(opt, ct_lr_at(&s, 60));
    ASSERT_NEAR(ct_optim_get_lr(opt), 0.55, 1e-12);
    ASSERT_NEAR(ct_optim_get_opts(opt)->lr, 0.55, 1e-12);
    ct_optim_destroy(opt);
}

/* Ranges of a parameter (a ZeRO rank's share) step exactly as the whole
 * parameter does, follow the parameter when it is re-pointed, and reject
 * ranges outside it. */
#define NR 37
TEST(optim_ranges_follow_their_parameter)
{
    ct_param *a = make_param("w", NR), *b = make_param("w", NR);
    for (int i = 0; i < NR; i++) ct_f32(a->data)[i] = ct_f32(b->data)[i] = p0v(i);
    ct_optim_opts o = ct_optim_defaults(CT_OPT_ADAMW);
    ct_optim *whole = ct_optim_create(&o, &a, 1);
    ct_optim_range r[3] = {{b, 0, 10}, {b, 10, 0}, {b, 10, 27}};
    ct_optim *parts = ct_optim_create_ranges(&o, r, 3);
    ASSERT(whole && parts);
    ASSERT_EQ(ct_optim_slot_at(parts, 2)->offset, 10);
    for (int t = 0; t < 4; t++) {
        set_grad_t(a, t);
        set_grad_t(b, t);
        if (t == 2) { /* re-point b's data and grad: the ranges follow */
            ct_tensor *d = ct_tensor_clone(b->data, CT_MEM_PARAM), *g = ct_tensor_clone(b->grad, CT_MEM_GRAD);
            ct_tensor_release(b->data);
            ct_tensor_release(b->grad);
            b->data = d;
            b->grad = g;
        }
        ASSERT_OK(ct_optim_step(whole));
        ASSERT_OK(ct_optim_step(parts));
        ASSERT(!memcmp(ct_tensor_data(a->data), ct_tensor_data(b->data), (size_t)NR * 4));
    }
    ct_optim_range bad = {b, 30, 8};
    ASSERT(ct_optim_create_ranges(&o, &bad, 1) == NULL);
    ASSERT_STR_CONTAINS(ct_last_error(), "not inside its parameter");
    ct_optim_destroy(whole);
    ct_optim_destroy(parts);
    free_param(a);
    free_param(b);
}

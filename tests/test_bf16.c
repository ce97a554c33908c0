/*
 * bf16 compute in the layers: linear, conv2d and embedding with a bf16
 * compute copy of their weight (ct_param.compute) or a bf16 input.
 *
 * Every product element is checked against two double-precision references:
 * - the rounded one, whose inputs are first rounded to bf16 as the layer
 *   rounds them (x, W, dy): it differs from the layer only by f32
 *   accumulation, at most (K+2) 2^-24 sum|terms| for K terms (one rounding
 *   per term and two for the output scale/sum);
 * - the exact one, on the f32 inputs: bf16 has an 8-bit significand, so
 *   rounding an input costs at most u = 2^-8 of it and a product of two
 *   rounded inputs at most (2u + u^2) of it, which with the accumulation
 *   bound on the rounded terms gives
 *       |got - exact| <= (2u + u^2 + (K+2) 2^-24 (1+u)^2) sum|terms|.
 * A layer that quietly stayed in f32 passes the second and fails the first
 * (and the summed distance to the rounded reference must be far below the
 * distance to the exact one), so bf16 cannot fall back unnoticed.
 */
#include "nn/internal.h" /* ct__grad_bf16_* */
#include "test_layers.h"

#define U_BF16 0x1p-8
#define U_F32 0x1p-24

static float bfr(float x) { return ct_bf16_to_f32(ct_f32_to_bf16(x)); }

/* A bf16 cast of p's data set as its compute copy (the test owns it). */
static void set_compute(ct_param *p)
{
    ct_tensor *h = ct_tensor_create(CT_BF16, p->data->ndim, p->data->shape, CT_MEM_PARAM);
    ASSERT(h != NULL);
    ct_f32_to_bf16_n(ct_f32(p->data), ct_tensor_data(h), (size_t)p->data->numel);
    p->compute = h;
}

static void drop_compute(ct_param *p)
{
    ct_tensor_release(p->compute);
    p->compute = NULL;
}

/* Reference sums for one output element: rounded (r) and exact (x) values
 * and magnitudes, filled term by term. */
typedef struct {
    double r, x, mr, mx;
} ref_sum;

static inline void ref_add(ref_sum *s, float a, float b)
{
    double tr = (double)bfr(a) * bfr(b), tx = (double)a * b;
    s->r += tr;
    s->x += tx;
    s->mr += fabs(tr);
    s->mx += fabs(tx);
}

typedef struct {
    double to_r, to_x; /* summed distances of the layer's results to each reference */
} dist;

/* got = base + s (base: an f32 addend outside the product, such as the bias
 * or the old gradient), with K terms in s. */
static void check_elem(const char *what, int64_t i, float got, double base, const ref_sum *s,
                       double K, dist *d)
{
    double acc = (K + 2) * U_F32;
    double want_r = base + s->r, tol_r = acc * (s->mr + fabs(base)) + 1e-30;
    double want_x = base + s->x;
    double tol_x = (2 * U_BF16 + U_BF16 * U_BF16 + acc * (1 + U_BF16) * (1 + U_BF16)) * s->mx +
                   acc * fabs(base) + 1e-30;
    if (!(fabs(got - want_r) <= tol_r))
        ct_test_fail(__FILE__, __LINE__, "%s[%lld] = %.9g but the bf16-rounded reference is %.9g "
                     "(tol %.3g)", what, (long long)i, (double)got, want_r, tol_r);
    if (!(fabs(got - want_x) <= tol_x))
        ct_test_fail(__FILE__, __LINE__, "%s[%lld] = %.9g is further from the f32 value %.9g than "
                     "bf16 rounding allows (%.3g)", what, (long long)i, (double)got, want_x, tol_x);
    d->to_r += fabs(got - want_r);
    d->to_x += fabs(got - want_x);
}

static void check_really_bf16(const char *what, const dist *d)
{
    if (!(d->to_x > 0 && d->to_r * 100 < d->to_x))
        ct_test_fail(__FILE__, __LINE__, "%s: summed distance %.3g to the bf16 reference and %.3g "
                     "to the f32 one: the product did not run in bf16", what, d->to_r, d->to_x);
}

static void assert_same_bits(const ct_tensor *a, const ct_tensor *b, const char *what)
{
    ASSERT_EQ(a->numel, b->numel);
    if (memcmp(ct_tensor_data(a), ct_tensor_data(b), ct_tensor_bytes(a)))
        ct_test_fail(__FILE__, __LINE__, "%s differs", what);
}

/* ---- linear ------------------------------------------------------------ */

TEST(bf16_linear_forward_backward)
{
    enum { IN = 96, OUT = 40, ROWS = 24 };
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_linear_create(IN, OUT, 1);
    rand_params(m, 11);
    ct_param *W = m->params[0], *B = m->params[1];
    ct_tensor *x = rand_tensor(3, (int64_t[]){4, 6, IN}, 12, -1.0f, 1.0f);
    ct_tensor *dy = rand_tensor(3, (int64_t[]){4, 6, OUT}, 13, -1.0f, 1.0f);
    const float *xd = ct_f32(x), *w = ct_f32(W->data), *b = ct_f32(B->data), *g = ct_f32(dy);

    /* The f32 bias gradient, to compare with. */
    ct_tensor *y, *dx;
    ct_record *rec;
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, &dx, rec));
    ct_tensor *db32 = ct_tensor_clone(B->grad, CT_MEM_ACT);
    ct_tensor_release(y);
    ct_tensor_release(dx);

    set_compute(W);
    /* Stale gradient memory under the lazy zero-grad protocol: backward must overwrite it. */
    ct_tensor_fill(W->grad, 7.0f);
    ct_module_zero_grad_lazy(m);
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    ASSERT_EQ(y->dtype, CT_F32);
    ASSERT_EQ(rec->saved[0]->dtype, CT_BF16); /* the record keeps x in half the memory */
    ASSERT_OK(ct_module_backward(m, dy, &dx, rec));
    ASSERT_EQ(dx->dtype, CT_F32);
    ASSERT(ct_tensor_same_shape(dx, x));

    dist dyd = {0}, dwd = {0}, dxd = {0};
    for (int r = 0; r < ROWS; r++)
        for (int o = 0; o < OUT; o++) {
            ref_sum s = {0};
            for (int i = 0; i < IN; i++) ref_add(&s, xd[r * IN + i], w[o * IN + i]);
            check_elem("y", r * OUT + o, ct_f32(y)[r * OUT + o], b[o], &s, IN, &dyd);
        }
    for (int o = 0; o < OUT; o++)
        for (int i = 0; i < IN; i++) {
            ref_sum s = {0};
            for (int r = 0; r < ROWS; r++) ref_add(&s, g[r * OUT + o], xd[r * IN + i]);
            check_elem("dW", o * IN + i, ct_f32(W->grad)[o * IN + i], 0.0, &s, ROWS, &dwd);
        }
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < IN; i++) {
            ref_sum s = {0};
            for (int o = 0; o < OUT; o++) ref_add(&s, g[r * OUT + o], w[o * IN + i]);
            check_elem("dx", r * IN + i, ct_f32(dx)[r * IN + i], 0.0, &s, OUT, &dxd);
        }
    check_really_bf16("y", &dyd);
    check_really_bf16("dW", &dwd);
    check_really_bf16("dx", &dxd);
    assert_same_bits(B->grad, db32, "bias gradient (f32 in both paths)");

    /* A second backward accumulates: exactly twice the first. */
    ct_tensor *dw1 = ct_tensor_clone(W->grad, CT_MEM_ACT);
    ct_tensor *y2, *dx2;
    ASSERT_OK(ct_module_forward(m, x, &y2, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, &dx2, rec));
    for (int64_t i = 0; i < dw1->numel; i++) ASSERT(ct_f32(W->grad)[i] == 2.0f * ct_f32(dw1)[i]);
    ct_tensor_release(y2);
    ct_tensor_release(dx2);

    /* A bf16 input without a compute copy takes the same path (the layer
     * casts W itself) and gives the same bits. */
    drop_compute(W);
    ct_tensor *xh = ct_tensor_create(CT_BF16, x->ndim, x->shape, CT_MEM_ACT);
    ct_f32_to_bf16_n(xd, ct_tensor_data(xh), (size_t)x->numel);
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, xh, &y2, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, &dx2, rec));
    assert_same_bits(y2, y, "output from a bf16 input");
    assert_same_bits(dx2, dx, "input gradient from a bf16 input");
    assert_same_bits(W->grad, dw1, "weight gradient from a bf16 input");

    ct_tensor_release(xh);
    ct_tensor_release(y2);
    ct_tensor_release(dx2);
    ct_tensor_release(dw1);
    ct_tensor_release(db32);
    ct_tensor_release(y);
    ct_tensor_release(dx);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(m);
}

/* The weight's f32 master is not what the products read: changing it
 * without re-casting the compute copy leaves the output alone. */
TEST(bf16_linear_reads_the_compute_copy)
{
    ct_module *m = ct_linear_create(8, 4, 0);
    rand_params(m, 3);
    ct_tensor *x = rand_tensor(2, (int64_t[]){2, 8}, 4, -1.0f, 1.0f);
    set_compute(m->params[0]);
    ct_tensor *y1, *y2;
    ASSERT_OK(ct_module_forward(m, x, &y1, NULL, NULL));
    ct_tensor_fill(m->params[0]->data, 100.0f);
    ASSERT_OK(ct_module_forward(m, x, &y2, NULL, NULL));
    assert_same_bits(y1, y2, "output after changing the f32 master only");
    ct_tensor_release(y1);
    ct_tensor_release(y2);
    ct_tensor_release(x);
    drop_compute(m->params[0]);
    ct_module_destroy(m);
}

/* emit_bf16 (set by a parent whose next layer casts to bf16 anyway) makes a
 * bf16 linear store its output as bf16: the f32 output rounded, nothing else.
 * Without a compute copy the layer computes in f32 and keeps f32. */
TEST(bf16_linear_emits_bf16_when_asked)
{
    ct_module *m = ct_linear_create(70, 33, 1);
    rand_params(m, 5);
    ct_tensor *x = rand_tensor(2, (int64_t[]){9, 70}, 6, -1.0f, 1.0f);
    ct_tensor *y32, *yb, *yf;
    ASSERT_OK(ct_module_forward(m, x, &yf, NULL, NULL));
    set_compute(m->params[0]);
    ASSERT_OK(ct_module_forward(m, x, &y32, NULL, NULL));
    m->emit_bf16 = 1;
    ASSERT_OK(ct_module_forward(m, x, &yb, NULL, NULL));
    ASSERT(y32->dtype == CT_F32 && yb->dtype == CT_BF16 && yb->numel == y32->numel);
    const uint16_t *h = ct_tensor_data(yb);
    for (int64_t i = 0; i < yb->numel; i++) ASSERT(h[i] == ct_f32_to_bf16(ct_f32(y32)[i]));
    ct_tensor_release(yb);
    drop_compute(m->params[0]);
    ASSERT_OK(ct_module_forward(m, x, &yb, NULL, NULL));
    ASSERT(yb->dtype == CT_F32);
    assert_same_bits(yb, yf, "f32 layer asked to emit bf16");
    ct_tensor_release(yb);
    ct_tensor_release(yf);
    ct_tensor_release(y32);
    ct_tensor_release(x);
    ct_module_destroy(m);
}

/* A sequential asks a layer to emit bf16 only when the next one casts to
 * bf16: the output and the gradients are bit for bit those of the same
 * layers run one by one with f32 hand-offs. */
TEST(bf16_sequential_hands_bf16_to_a_bf16_linear)
{
    ct_module *s = ct_sequential_create();
    ASSERT_OK(ct_module_add(s, "a", ct_linear_create(12, 20, 1)));
    ASSERT_OK(ct_module_add(s, "b", ct_linear_create(20, 7, 1)));
    ct_module *a = s->kids[0], *b = s->kids[1];
    rand_params(a, 8);
    rand_params(b, 7);
    set_compute(a->params[0]);
    set_compute(b->params[0]);
    ct_tensor *x = rand_tensor(2, (int64_t[]){6, 12}, 9, -1.0f, 1.0f);
    ct_tensor *dy = rand_tensor(2, (int64_t[]){6, 7}, 10, -1.0f, 1.0f);
    ct_tensor *y[2], *dx[2], *g[2];
    for (int run = 0; run < 2; run++) {
        ct_module_zero_grad(s);
        if (run == 0) { /* the sequential: a emits bf16 */
            ct_record *r;
            ASSERT_OK(ct_module_forward(s, x, &y[0], &r, NULL));
            ASSERT(a->emit_bf16 == 1);
            ASSERT_OK(ct_module_backward(s, dy, &dx[0], r));
        } else { /* one by one, f32 between them */
            ct_record *ra, *rb;
            ct_tensor *h, *dh;
            a->emit_bf16 = b->emit_bf16 = 0;
            ASSERT_OK(ct_module_forward(a, x, &h, &ra, NULL));
            ASSERT(h->dtype == CT_F32);
            ASSERT_OK(ct_module_forward(b, h, &y[1], &rb, NULL));
            ASSERT_OK(ct_module_backward(b, dy, &dh, rb));
            ASSERT_OK(ct_module_backward(a, dh, &dx[1], ra));
            ct_tensor_release(h);
            ct_tensor_release(dh);
        }
        g[run] = ct_tensor_clone(a->params[0]->grad, CT_MEM_OTHER);
    }
    assert_same_bits(y[0], y[1], "output");
    assert_same_bits(g[0], g[1], "a's weight gradient");
    assert_same_bits(dx[0], dx[1], "input gradient");
    for (int i = 0; i < 2; i++) {
        ct_tensor_release(y[i]);
        ct_tensor_release(dx[i]);
        ct_tensor_release(g[i]);
    }
    drop_compute(a->params[0]);
    drop_compute(b->params[0]);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(s);
}

/* GELU hands a bf16 c_fc its gradient as bf16 with column sums
 * (emit_bf16_grad): c_fc's gradients and the input gradient are bit for bit
 * those of the f32 hand-off, over two accumulated steps (the bias gradient
 * adds the rows' sum once per step either way). */
TEST(bf16_gelu_hands_a_bf16_linear_its_gradient)
{
    ct_module *s = ct_sequential_create();
    ASSERT_OK(ct_module_add(s, "a", ct_linear_create(12, 40, 1)));
    ASSERT_OK(ct_module_add(s, "gelu", ct_gelu_create()));
    ASSERT_OK(ct_module_add(s, "b", ct_linear_create(40, 7, 1)));
    ct_module *a = s->kids[0], *gelu = s->kids[1], *b = s->kids[2];
    rand_params(a, 18);
    rand_params(b, 17);
    set_compute(a->params[0]);
    set_compute(b->params[0]);
    ct_tensor *x = rand_tensor(3, (int64_t[]){3, 5, 12}, 19, -2.0f, 2.0f);
    ct_tensor *dy = rand_tensor(3, (int64_t[]){3, 5, 7}, 20, -1.0f, 1.0f);
    ct_tensor *dx[2], *gw[2], *gb[2];
    for (int run = 0; run < 2; run++) {
        /* run 0: the sequential (GELU emits); run 1: layer by layer, f32 hand-offs */
        ct_module_zero_grad(s);
        for (int step = 0; step < 2; step++) {
            ct_tensor_release(step ? dx[run] : NULL);
            if (run == 0) {
                ct_record *r;
                ct_tensor *y;
                ASSERT_OK(ct_module_forward(s, x, &y, &r, NULL));
                ASSERT_OK(ct_module_backward(s, dy, &dx[run], r));
                ASSERT(gelu->emit_bf16_grad == 1);
                ct_tensor_release(y);
                continue;
            }
            ct_record *ra, *rg, *rb;
            ct_tensor *h, *u, *y, *du, *dh;
            gelu->emit_bf16_grad = 0;
            a->emit_bf16 = gelu->emit_bf16 = b->emit_bf16 = 0;
            ASSERT_OK(ct_module_forward(a, x, &h, &ra, NULL));
            ASSERT_OK(ct_module_forward(gelu, h, &u, &rg, NULL));
            ASSERT_OK(ct_module_forward(b, u, &y, &rb, NULL));
            ASSERT_OK(ct_module_backward(b, dy, &du, rb));
            ASSERT_OK(ct_module_backward(gelu, du, &dh, rg));
            ASSERT(dh->dtype == CT_F32);
            ASSERT_OK(ct_module_backward(a, dh, &dx[run], ra));
            ct_tensor_release(h);
            ct_tensor_release(u);
            ct_tensor_release(y);
            ct_tensor_release(du);
            ct_tensor_release(dh);
        }
        gw[run] = ct_tensor_clone(a->params[0]->grad, CT_MEM_OTHER);
        gb[run] = ct_tensor_clone(a->params[1]->grad, CT_MEM_OTHER);
    }
    assert_same_bits(gw[0], gw[1], "c_fc's weight gradient");
    assert_same_bits(gb[0], gb[1], "c_fc's bias gradient");
    assert_same_bits(dx[0], dx[1], "input gradient");
    for (int i = 0; i < 2; i++) {
        ct_tensor_release(dx[i]);
        ct_tensor_release(gw[i]);
        ct_tensor_release(gb[i]);
    }
    drop_compute(a->params[0]);
    drop_compute(b->params[0]);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(s);
}

/* A bf16 gradient with column sums: puts of any length, across rows, cast
 * as ct_f32_to_bf16 and summed per column in row order; no other tensor
 * passes for one. */
TEST(bf16_gradient_with_column_sums)
{
    int64_t shape[3] = {3, 5, 7}, n = 3 * 5 * 7;
    ct_tensor *g = ct__grad_bf16_create(3, shape);
    ASSERT(g && g->dtype == CT_BF16 && g->numel == n);
    float *sum = ct__grad_bf16_colsum(g);
    ASSERT(sum);
    for (int j = 0; j < 7; j++) ASSERT(sum[j] == 0.0f);
    ct_tensor *src = rand_tensor(3, shape, 21, -3.0f, 3.0f);
    const float *x = ct_f32(src);
    int64_t pieces[] = {1, 6, 13, 0, 2, 40, 33}, at = 0; /* 95 + the rest */
    for (size_t i = 0; i < sizeof pieces / sizeof *pieces; i++) {
        ct__grad_bf16_put(g, at, x + at, pieces[i]);
        at += pieces[i];
    }
    ct__grad_bf16_put(g, at, x + at, n - at);
    float want[7] = {0};
    for (int64_t r = 0; r < n / 7; r++)
        for (int j = 0; j < 7; j++) want[j] += x[r * 7 + j];
    for (int j = 0; j < 7; j++) ASSERT(sum[j] == want[j]);
    for (int64_t i = 0; i < n; i++) ASSERT_EQ(((uint16_t *)ct_tensor_data(g))[i], ct_f32_to_bf16(x[i]));
    ct_tensor *plain = ct_tensor_empty(CT_BF16, 3, shape, CT_MEM_ACT);
    ASSERT(!ct__grad_bf16_colsum(plain) && !ct__grad_bf16_colsum(src));
    ct_tensor *view = ct_tensor_on(g->storage, 0, CT_BF16, 1, (int64_t[]){7});
    ASSERT(!ct__grad_bf16_colsum(view));
    ct_tensor_release(view);
    ct_tensor_release(plain);
    ct_tensor_release(src);
    ct_tensor_release(g);
}

TEST(bf16_compute_copy_must_match)
{
    ct_module *m = ct_linear_create(8, 4, 1);
    ct_tensor *x = rand_tensor(2, (int64_t[]){2, 8}, 4, -1.0f, 1.0f), *y;
    ct_param *W = m->params[0];
    W->compute = ct_tensor_create(CT_F16, 2, (int64_t[]){4, 8}, CT_MEM_PARAM);
    ASSERT_ERR(ct_module_forward(m, x, &y, NULL, NULL), CT_EINVAL, "must be BF16 [4, 8]");
    drop_compute(W);
    W->compute = ct_tensor_create(CT_BF16, 2, (int64_t[]){8, 4}, CT_MEM_PARAM);
    ASSERT_ERR(ct_module_forward(m, x, &y, NULL, NULL), CT_EINVAL, "compute copy of 'weight'");
    drop_compute(W);
    ct_module_destroy(m);

    ct_module *e = ct_embedding_create(5, 3);
    ct_tensor *idx = ct_tensor_create(CT_I32, 1, (int64_t[]){2}, CT_MEM_ACT);
    e->params[0]->compute = ct_tensor_create(CT_F32, 2, (int64_t[]){5, 3}, CT_MEM_PARAM);
    ASSERT_ERR(ct_module_forward(e, idx, &y, NULL, NULL), CT_EINVAL, "embedding '(root)'");
    drop_compute(e->params[0]);
    ct_module_destroy(e);

    ct_module *c = ct_conv2d_create(2, 3, 3, 1, 0, 0);
    ct_tensor *xc = rand_tensor(4, (int64_t[]){1, 2, 4, 4}, 5, -1.0f, 1.0f);
    c->params[0]->compute = ct_tensor_create(CT_BF16, 1, (int64_t[]){54}, CT_MEM_PARAM);
    ASSERT_ERR(ct_module_forward(c, xc, &y, NULL, NULL), CT_EINVAL, "BF16 [3, 2, 3, 3]");
    drop_compute(c->params[0]);
    ct_module_destroy(c);
    ct_tensor_release(xc);
    ct_tensor_release(idx);
    ct_tensor_release(x);
}

/* ---- conv2d ------------------------------------------------------------ */

/* Direct convolution references for y (with bias), dW and dx, element sums
 * in double (rounded and exact). */
static void conv_refs(const float *x, const float *w, const float *dy, int N, int C, int H, int Wd,
                      int O, int k, int s, int pad, ref_sum *y, ref_sum *dw, ref_sum *dx)
{
    int Ho = (H + 2 * pad - k) / s + 1, Wo = (Wd + 2 * pad - k) / s + 1;
    for (int n = 0; n < N; n++)
        for (int o = 0; o < O; o++)
            for (int oh = 0; oh < Ho; oh++)
                for (int ow = 0; ow < Wo; ow++) {
                    int64_t yi = (((int64_t)n * O + o) * Ho + oh) * Wo + ow;
                    for (int c = 0; c < C; c++)
                        for (int ki = 0; ki < k; ki++)
                            for (int kj = 0; kj < k; kj++) {
                                int ih = oh * s - pad + ki, iw = ow * s - pad + kj;
                                if (ih < 0 || ih >= H || iw < 0 || iw >= Wd) continue;
                                int64_t xi = (((int64_t)n * C + c) * H + ih) * Wd + iw;
                                int64_t wi = (((int64_t)o * C + c) * k + ki) * k + kj;
                                ref_add(&y[yi], x[xi], w[wi]);
                                ref_add(&dw[wi], dy[yi], x[xi]);
                                ref_add(&dx[xi], dy[yi], w[wi]);
                            }
                }
}

static void check_conv(int N, int C, int H, int O, int k, int s, int pad)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_conv2d_create(C, O, k, s, pad, 1);
    rand_params(m, 21);
    ct_param *Wp = m->params[0], *Bp = m->params[1];
    ct_tensor *x = rand_tensor(4, (int64_t[]){N, C, H, H}, 22, -1.0f, 1.0f);
    int Ho = (H + 2 * pad - k) / s + 1;
    ct_tensor *dy = rand_tensor(4, (int64_t[]){N, O, Ho, Ho}, 23, -1.0f, 1.0f);

    ct_tensor *y, *dx;
    ct_record *rec;
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, &dx, rec));
    ct_tensor *db32 = ct_tensor_clone(Bp->grad, CT_MEM_ACT);
    ct_tensor_release(y);
    ct_tensor_release(dx);

    set_compute(Wp);
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, x, &y, &rec, &ctx));
    ASSERT_EQ(rec->saved[0]->dtype, CT_BF16);
    ASSERT_OK(ct_module_backward(m, dy, &dx, rec));

    ref_sum *ry = calloc((size_t)y->numel, sizeof *ry), *rw = calloc((size_t)Wp->data->numel, sizeof *rw);
    ref_sum *rx = calloc((size_t)x->numel, sizeof *rx);
    ASSERT(ry && rw && rx);
    conv_refs(ct_f32(x), ct_f32(Wp->data), ct_f32(dy), N, C, H, H, O, k, s, pad, ry, rw, rx);
    dist dyd = {0}, dwd = {0}, dxd = {0};
    int P = Ho * Ho;
    for (int64_t i = 0; i < y->numel; i++)
        check_elem("y", i, ct_f32(y)[i], ct_f32(Bp->data)[(i / P) % O], &ry[i], C * k * k, &dyd);
    /* dW sums N*P terms over up to N chunk products (one more rounding each). */
    for (int64_t i = 0; i < Wp->data->numel; i++)
        check_elem("dW", i, ct_f32(Wp->grad)[i], 0.0, &rw[i], (double)N * P + N, &dwd);
    /* dx: col2im adds up to k*k f32 products of O terms each. */
    for (int64_t i = 0; i < x->numel; i++)
        check_elem("dx", i, ct_f32(dx)[i], 0.0, &rx[i], (double)O * k * k + k * k, &dxd);
    check_really_bf16("conv y", &dyd);
    check_really_bf16("conv dW", &dwd);
    check_really_bf16("conv dx", &dxd);
    assert_same_bits(Bp->grad, db32, "conv bias gradient (f32 in both paths)");

    free(ry);
    free(rw);
    free(rx);
    ct_tensor_release(db32);
    ct_tensor_release(y);
    ct_tensor_release(dx);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    drop_compute(Wp);
    ct_module_destroy(m);
}

/* Small images batch into one product per chunk (nb > 1); large ones go one
 * image at a time (nb == 1, the product lands in y directly). */
TEST(bf16_conv_batched_images) { check_conv(5, 3, 9, 6, 3, 2, 1); }
TEST(bf16_conv_one_image_per_product) { check_conv(2, 8, 48, 4, 3, 1, 1); }

TEST(bf16_conv_bf16_input)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_conv2d_create(2, 3, 3, 1, 1, 1);
    rand_params(m, 31);
    ct_tensor *x = rand_tensor(4, (int64_t[]){2, 2, 6, 6}, 32, -1.0f, 1.0f);
    ct_tensor *xh = ct_tensor_create(CT_BF16, 4, x->shape, CT_MEM_ACT);
    ct_f32_to_bf16_n(ct_f32(x), ct_tensor_data(xh), (size_t)x->numel);
    ct_tensor *dy = rand_tensor(4, (int64_t[]){2, 3, 6, 6}, 33, -1.0f, 1.0f);
    ct_tensor *y1, *y2, *dx1, *dx2;
    ct_record *rec;
    set_compute(m->params[0]);
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, x, &y1, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, &dx1, rec));
    ct_tensor *dw1 = ct_tensor_clone(m->params[0]->grad, CT_MEM_ACT);
    drop_compute(m->params[0]);
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, xh, &y2, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, &dx2, rec));
    assert_same_bits(y1, y2, "conv output from a bf16 input");
    assert_same_bits(dx1, dx2, "conv input gradient from a bf16 input");
    assert_same_bits(dw1, m->params[0]->grad, "conv weight gradient from a bf16 input");
    ct_tensor_release(dw1);
    ct_tensor_release(y1);
    ct_tensor_release(y2);
    ct_tensor_release(dx1);
    ct_tensor_release(dx2);
    ct_tensor_release(xh);
    ct_tensor_release(x);
    ct_tensor_release(dy);
    ct_module_destroy(m);
}

/* ---- embedding --------------------------------------------------------- */

TEST(bf16_embedding_gathers_bf16_rows)
{
    enum { NUM = 11, DIM = 37, NIDX = 9 };
    ct_fwd_ctx ctx = train_ctx();
    ct_module *m = ct_embedding_create(NUM, DIM);
    rand_params(m, 41);
    ct_param *W = m->params[0];
    ct_tensor *idx = ct_tensor_create(CT_I64, 2, (int64_t[]){3, 3}, CT_MEM_ACT);
    int64_t *id = ct_tensor_data(idx);
    static const int64_t pick[NIDX] = {3, 0, 10, 3, 7, 7, 1, 3, 5};
    memcpy(id, pick, sizeof pick);
    ct_tensor *dy = rand_tensor(3, (int64_t[]){3, 3, DIM}, 42, -1.0f, 1.0f);

    ct_tensor *y;
    ct_record *rec;
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, idx, &y, &rec, &ctx));
    ASSERT_OK(ct_module_backward(m, dy, NULL, rec));
    ct_tensor *g32 = ct_tensor_clone(W->grad, CT_MEM_ACT);
    ct_tensor_release(y);

    set_compute(W);
    ct_module_zero_grad(m);
    ASSERT_OK(ct_module_forward(m, idx, &y, &rec, &ctx));
    ASSERT_EQ(y->dtype, CT_F32);
    int differs = 0;
    for (int i = 0; i < NIDX; i++)
        for (int j = 0; j < DIM; j++) {
            float want = bfr(ct_f32(W->data)[pick[i] * DIM + j]);
            ASSERT(ct_f32(y)[i * DIM + j] == want);
            differs |= want != ct_f32(W->data)[pick[i] * DIM + j];
        }
    ASSERT(differs); /* the rows really were the rounded ones */
    ASSERT_OK(ct_module_backward(m, dy, NULL, rec));
    assert_same_bits(W->grad, g32, "embedding gradient (f32 in both paths)");
    ct_tensor_release(g32);
    ct_tensor_release(y);
    ct_tensor_release(dy);
    ct_tensor_release(idx);
    drop_compute(W);
    ct_module_destroy(m);
}

/* A small MLP with every linear on a compute copy trains through the module
 * tree: the loss and its gradients stay close to the f32 ones. */
TEST(bf16_mlp_loss_close_to_f32)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_module *seq = ct_sequential_create();
    ASSERT_OK(ct_module_add(seq, NULL, ct_linear_create(32, 64, 1)));
    ASSERT_OK(ct_module_add(seq, NULL, ct_gelu_create()));
    ASSERT_OK(ct_module_add(seq, NULL, ct_linear_create(64, 10, 1)));
    ct_module_init_params(seq, 5);
    ct_tensor *x = rand_tensor(2, (int64_t[]){16, 32}, 51, -1.0f, 1.0f);
    ct_tensor *t = ct_tensor_create(CT_I32, 1, (int64_t[]){16}, CT_MEM_ACT);
    for (int i = 0; i < 16; i++) ((int32_t *)ct_tensor_data(t))[i] = i % 10;
    float loss[2];
    ct_param **ps;
    int np;
    ASSERT_OK(ct_module_params(seq, &ps, &np));
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1)
            for (int i = 0; i < np; i++)
                if (ps[i]->data->ndim == 2) set_compute(ps[i]);
        ct_tensor *y, *dl;
        ct_record *rec;
        ASSERT_OK(ct_module_forward(seq, x, &y, &rec, &ctx));
        ASSERT_OK(ct_cross_entropy(y, t, -100, &loss[pass], &dl));
        ASSERT_OK(ct_module_backward(seq, dl, NULL, rec));
        ct_tensor_release(y);
        ct_tensor_release(dl);
    }
    /* Logits carry ~2^-7 relative error from bf16 inputs; the loss (about
     * ln 10) moves by far less than 1%. */
    ASSERT(loss[0] != loss[1]);
    ASSERT_CLOSE(loss[1], loss[0], 1e-2, 0.0);
    for (int i = 0; i < np; i++) drop_compute(ps[i]);
    ct_free(ps);
    ct_tensor_release(x);
    ct_tensor_release(t);
    ct_module_destroy(seq);
}

/* ---- layers that emit BF16 (ct_module.emit_bf16) ---------------------------- */

/* The bulk cast the emitters use (ct_f32_to_bf16_n) is the scalar cast bit
 * for bit: over a sweep of bit
 * patterns (every exponent, both signs) fed in chunks of uneven lengths, and
 * over chunks of normal values holding a subnormal, a zero or a nan in each
 * lane (VCVTNEPS2BF16 flushes subnormals, so such a chunk must be cast the
 * exact way; a nan must not hide a subnormal in its lane or another). */
TEST(bf16_bulk_cast_is_the_scalar_cast)
{
    enum { N = 4096 };
    float *v = ct_alloc(N * sizeof *v, CT_MEM_OTHER);
    uint16_t *got = ct_alloc(N * sizeof *got, CT_MEM_OTHER), *want = ct_alloc(N * sizeof *want, CT_MEM_OTHER);
    ASSERT(v && got && want);
    uint64_t u = 0, len = 1;
    while (u < (1ull << 32)) {
        for (int i = 0; i < N; i++, u += 1021) {
            uint32_t b = (uint32_t)u;
            memcpy(&v[i], &b, sizeof b);
        }
        for (size_t off = 0; off < N; off += len, len = len % 700 + 37) {
            size_t n = off + len <= N ? len : N - off;
            ct_f32_to_bf16_n(v + off, got + off, n);
        }
        for (int i = 0; i < N; i++) want[i] = ct_f32_to_bf16(v[i]);
        for (int i = 0; i < N; i++)
            if (got[i] != want[i])
                ct_test_fail(__FILE__, __LINE__, "bits %08x: %04x, want %04x", (unsigned)(u - (uint64_t)(N - i) * 1021),
                             got[i], want[i]);
    }
    const uint32_t odd[] = {0x00000001, 0x007fffff, 0x80400000, 0x00000000, 0x80000000, 0x7fc00000, 0xffa00001, 0x7f800000};
    for (int a = 0; a < 8; a++)
        for (int b = 0; b < 8; b++)
            for (int p = 0; p < 48; p++) {
                for (int i = 0; i < 48; i++) v[i] = 1.0f + (float)i / 64.0f;
                memcpy(&v[p], &odd[a], 4);
                memcpy(&v[(p * 7 + 3) % 48], &odd[b], 4); /* another lane */
                memcpy(&v[(p + 16) % 48], &odd[b], 4);    /* the same lane, the next 16 */
                ct_f32_to_bf16_n(v, got, 48);
                for (int i = 0; i < 48; i++) want[i] = ct_f32_to_bf16(v[i]);
                ASSERT(!memcmp(got, want, 48 * sizeof *got));
            }
    ct_free(v);
    ct_free(got);
    ct_free(want);
}

/* Forward with emit_bf16 set and with it clear; the BF16 output must be the
 * cast of the F32 one exactly, and the two records must give the same
 * gradients (dy is f32 either way). */
static void check_emit(ct_module *m, ct_tensor *x, const char *what)
{
    ct_fwd_ctx ctx = train_ctx();
    ct_tensor *y[2], *dx[2], *g[2][2] = {{NULL, NULL}, {NULL, NULL}};
    ct_record *rec[2];
    for (int e = 0; e < 2; e++) {
        m->emit_bf16 = e;
        ASSERT_OK(ct_module_forward(m, x, &y[e], &rec[e], &ctx));
    }
    m->emit_bf16 = 0;
    ASSERT_EQ(y[0]->dtype, CT_F32);
    if (y[1]->dtype != CT_BF16) ct_test_fail(__FILE__, __LINE__, "%s: emits %s", what, ct_dtype_name(y[1]->dtype));
    ASSERT_EQ(y[1]->ndim, y[0]->ndim);
    for (int d = 0; d < y[0]->ndim; d++) ASSERT_EQ(y[1]->shape[d], y[0]->shape[d]);
    uint16_t *want = ct_alloc((size_t)y[0]->numel * sizeof *want, CT_MEM_OTHER);
    ct_f32_to_bf16_n(ct_f32(y[0]), want, (size_t)y[0]->numel);
    const uint16_t *got = ct_tensor_data(y[1]);
    for (int64_t i = 0; i < y[0]->numel; i++)
        if (got[i] != want[i])
            ct_test_fail(__FILE__, __LINE__, "%s: element %lld is %04x, the cast of %a is %04x", what, (long long)i,
                         got[i], (double)ct_f32(y[0])[i], want[i]);
    ct_free(want);
    ct_tensor *dy = rand_tensor(x->ndim, x->shape, 99, -1.0f, 1.0f);
    for (int e = 0; e < 2; e++) {
        ct_module_zero_grad(m);
        ASSERT_OK(ct_module_backward(m, dy, &dx[e], rec[e]));
        for (int k = 0; k < m->nparams; k++) g[e][k] = ct_tensor_clone(m->params[k]->grad, CT_MEM_OTHER);
    }
    ASSERT(!memcmp(ct_f32(dx[0]), ct_f32(dx[1]), (size_t)x->numel * sizeof(float)));
    for (int k = 0; k < m->nparams; k++)
        ASSERT(!memcmp(ct_f32(g[0][k]), ct_f32(g[1][k]), (size_t)g[0][k]->numel * sizeof(float)));
    for (int e = 0; e < 2; e++) {
        ct_tensor_release(y[e]);
        ct_tensor_release(dx[e]);
        for (int k = 0; k < 2; k++) ct_tensor_release(g[e][k]);
    }
    ct_tensor_release(dy);
}

/* Odd widths (not multiples of 16 or of the emitters' 512-value chunk), and
 * values whose outputs are subnormal, zero, nan or infinite. */
TEST(bf16_layernorm_and_gelu_emit_the_cast_of_their_output)
{
    const int64_t dims[] = {1, 7, 16, 37, 129, 600}, rows[] = {1, 3, 5};
    char what[64];
    for (size_t a = 0; a < sizeof dims / sizeof *dims; a++)
        for (size_t b = 0; b < sizeof rows / sizeof *rows; b++) {
            int64_t D = dims[a], R = rows[b];
            ct_module *ln = ct_layernorm_create(D, 1e-5f);
            rand_params(ln, 70 + (uint64_t)D);
            float *w = ct_f32(ln->params[0]->data), *bias = ct_f32(ln->params[1]->data);
            w[0] = 1e-39f; /* subnormal outputs in column 0 */
            if (D > 2) bias[2] = 0.0f, w[2] = 0.0f; /* zeros in column 2 */
            ct_tensor *x = rand_tensor(2, (int64_t[]){R, D}, 80 + (uint64_t)(D * R), -3.0f, 3.0f);
            if (R > 1 && D > 1) ct_f32(x)[D + 1] = NAN; /* a nan row */
            snprintf(what, sizeof what, "layernorm %lld x %lld", (long long)R, (long long)D);
            check_emit(ln, x, what);
            ct_tensor_release(x);
            ct_module_destroy(ln);
        }
    const int64_t ns[] = {1, 15, 16, 17, 513, 1100};
    const float odd[] = {0.0f, -0.0f, 1e-39f, -3e-39f, 1e-30f, NAN, -INFINITY, INFINITY, -20.0f, 7.0f};
    for (size_t a = 0; a < sizeof ns / sizeof *ns; a++) {
        ct_module *g = ct_gelu_create();
        ct_tensor *x = rand_tensor(1, &ns[a], 90 + (uint64_t)ns[a], -4.0f, 4.0f);
        for (int64_t i = 0; i < ns[a]; i += 7) ct_f32(x)[i] = odd[(i / 7) % 10];
        snprintf(what, sizeof what, "gelu %lld", (long long)ns[a]);
        check_emit(g, x, what);
        ct_tensor_release(x);
        ct_module_destroy(g);
    }
}

/* Mixed precision asks a layer what it is (CT_MOD_KEEP_F32), never its kind
 * name: a custom norm layer with a 2-D weight that says so keeps f32, the
 * same layer without the flag gets a bf16 compute copy, and the library's
 * own norm layers say so too. */
static ct_status ident_fwd(ct_module *m, ct_tensor *in, ct_tensor **out, ct_record *rec, const ct_fwd_ctx *ctx)
{
    (void)m, (void)rec, (void)ctx;
    *out = ct_tensor_retain(in);
    return CT_OK;
}
static ct_status ident_bwd(ct_module *m, ct_tensor *dout, ct_tensor **din, ct_record *rec)
{
    (void)m, (void)rec;
    if (din) *din = ct_tensor_retain(dout);
    return CT_OK;
}

TEST(bf16_policy_asks_layers_not_kind_names)
{
    static const ct_module_ops norm_ops = {"my_rmsnorm", ident_fwd, ident_bwd, NULL, 0, ct_module_out_shape_same,
                                           NULL, CT_MOD_KEEP_F32};
    static const ct_module_ops plain_ops = {"my_rmsnorm", ident_fwd, ident_bwd, NULL, 0, ct_module_out_shape_same, NULL, 0};
    for (int keep = 0; keep < 2; keep++) {
        ct_module *m = ct_sequential_create();
        ct_module *n = ct_module_create(keep ? &norm_ops : &plain_ops, NULL);
        int64_t shape[2] = {4, 4};
        ASSERT(ct_module_add_param(n, "weight", 2, shape));
        ASSERT_OK(ct_module_add(m, NULL, n));
        ASSERT_OK(ct_module_add(m, NULL, ct_layernorm_create(4, 1e-5f)));
        ct_optim_opts oo = ct_optim_defaults(CT_OPT_SGD);
        ct_strategy *s;
        ASSERT_OK(ct_strategy_create("none", m, &oo, NULL, "param_dtype=bf16", &s));
        ASSERT_EQ(n->params[0]->compute == NULL, keep);
        ASSERT(ct_module_is(m->kids[1], CT_MOD_KEEP_F32));
        ASSERT(ct_module_is(m, CT_MOD_SEQUENTIAL));
        ct_strategy_destroy(s);
        ct_module_destroy(m);
    }
}

/*
 * The activation estimate of `ctrain estimate`: one training step replayed
 * on shapes only.  Every tensor of the step is a buffer with a reference
 * count, as in ctrain: the chain of outputs through forward, what each
 * layer's record keeps for backward, the loss gradient, and the input
 * gradients flowing back.  The peak of the live bytes, plus the scratch a
 * layer holds only while it runs, is the figure; shapes come from
 * ct_module_out_shape.  What each kind of layer keeps and allocates is read
 * off src/nn (the rules below say which file); a kind not listed is assumed
 * to keep its input and its output, which errs high.  Containers other than
 * sequential (residual, checkpoint) are replayed as their children in
 * sequence: approximate (a checkpoint keeps less, a residual a sum more).
 */
#include <string.h>

#include "estimate.h"

/* src/nn/conv.c's COL_LIMIT: the im2col scratch holds at most this many floats. */
#define CONV_COL_LIMIT (128L << 10)

typedef struct {
    uint64_t bytes;
    int refs;
} sbuf;

typedef struct {
    sbuf *b;
    int n, cap;
    uint64_t alive, peak;
} sim;

static int sim_new(sim *s, uint64_t bytes)
{
    CT_ASSERT(s->n < s->cap);
    s->b[s->n] = (sbuf){bytes, 1};
    s->alive += bytes;
    return s->n++;
}

/* Buffer -1 is the batch (counted apart): references to it cost nothing. */
static void sim_ref(sim *s, int i)
{
    if (i >= 0) s->b[i].refs++;
}

static void sim_unref(sim *s, int i)
{
    if (i >= 0 && --s->b[i].refs == 0) s->alive -= s->b[i].bytes;
}

/* A moment of the step: what is alive plus scratch held only now. */
static void sim_peak(sim *s, uint64_t scratch)
{
    if (s->alive + scratch > s->peak) s->peak = s->alive + scratch;
}

/* What one layer call keeps and allocates (bytes; f32 outputs). */
typedef struct {
    int keep_in, keep_out; /* the record holds the input / output tensor */
    int alias;             /* the output is a view of the input, the input gradient of dout (flatten) */
    uint64_t saved;        /* new memory the record keeps (masks, bf16 copies, statistics) */
    uint64_t fwd_tmp;      /* scratch while forward runs */
    uint64_t bwd_tmp;      /* scratch while backward runs (besides the input gradient) */
} rule;

static int64_t numel(int nd, const int64_t *sh)
{
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= sh[i];
    return n;
}

/* The weight gets a bf16 compute copy under param_dtype=bf16 (src/parallel/mixed.c). */
static int has_copy(const ct_module *m)
{
    if (!m->nparams) return 0;
    const ct_param *w = m->params[0];
    return w->requires_grad && w->data->ndim >= 2 && w->data->dtype == CT_F32;
}

/* Layer m from input [ish] (nd dims) to output [osh] (ond dims); need_dx: backward makes an input gradient. */
static rule rule_of(const est_in *in, const ct_module *m, int nd, const int64_t *ish, int ond, const int64_t *osh,
                    int mixed, int need_dx)
{
    const char *k = m->ops->kind;
    uint64_t ni = (uint64_t)numel(nd, ish), no = (uint64_t)numel(ond, osh);
    rule r = {0};
    int bf16 = mixed && has_copy(m);
    if (!strcmp(k, "linear")) { /* linear.c: saves x, or its bf16 cast; bf16 backward casts dy */
        if (bf16) {
            r.saved = ni * 2;
            r.bwd_tmp = no * 2;
        } else {
            r.keep_in = 1;
        }
    } else if (!strcmp(k, "conv2d")) { /* conv.c: im2col of nb images at a time, recomputed in backward */
        const ct_param *w = m->params[0];
        int64_t cout = w->data->shape[0], K = w->data->shape[1] * w->data->shape[2] * w->data->shape[3];
        int64_t P = ond == 4 ? osh[2] * osh[3] : 1, N = nd ? ish[0] : 1;
        int64_t nb = K * P > 0 ? CONV_COL_LIMIT / (K * P) : N;
        if (nb < 1) nb = 1;
        if (nb > N) nb = N;
        uint64_t ld = (uint64_t)(nb * P), col = (uint64_t)K * ld * (bf16 ? 2 : 4);
        uint64_t chunk = nb > 1 ? (uint64_t)cout * ld * 4 : 0; /* tmp (forward), dyc (backward) */
        if (bf16) r.saved = ni * 2;
        else r.keep_in = 1;
        r.fwd_tmp = col + chunk;
        r.bwd_tmp = col + chunk + (bf16 ? (need_dx ? (uint64_t)K * ld * 4 : 0) + (uint64_t)cout * ld * 2 : 0);
    } else if (!strcmp(k, "relu") || !strcmp(k, "tanh")) { /* activation.c: the output */
        r.keep_out = 1;
    } else if (!strcmp(k, "gelu")) { /* activation.c: gelu'(x), f32, the input's size */
        r.saved = ni * 4;
    } else if (!strcmp(k, "embedding")) {
        r.keep_in = 1;
    } else if (!strcmp(k, "dropout")) { /* dropout.c: a u8 keep-mask in training */
        if (in->cfg.dropout > 0) r.saved = ni;
    } else if (!strcmp(k, "maxpool2d")) { /* conv.c: i32 argmax of every output */
        r.saved = no * 4;
    } else if (!strcmp(k, "flatten")) {
        r.alias = 1;
    } else if (!strcmp(k, "layernorm")) { /* mean and rstd per row */
        r.keep_in = 1;
        r.saved = (nd ? ni / (uint64_t)ish[nd - 1] : 1) * 8;
    } else if (!strcmp(k, "tokpos_embedding")) { /* transformer.c: positions (i64), the dropout mask */
        r.saved = (uint64_t)(nd > 1 ? ish[1] : 1) * 8 + (in->cfg.dropout > 0 ? no : 0);
        r.fwd_tmp = no * 4; /* the position rows, the sum before dropout */
    } else if (!strcmp(k, "block")) {
        /* transformer.c + attention.c, per block of rows BT, width D, H heads, T positions:
         * ln_1 and ln_2 keep their inputs (x here, h below) and 8 bytes a row; c_attn,
         * c_proj, c_fc and the MLP's c_proj keep their inputs (bf16 under mixed); the
         * attention keeps what ct_attention_saved_bytes says; gelu keeps gelu'(x);
         * the dropouts keep byte masks. */
        const ct_model_config *c = &in->cfg;
        uint64_t BT = ni / (uint64_t)c->dim, D = (uint64_t)c->dim, B = BT / (uint64_t)(nd > 1 ? ish[1] : 1);
        uint64_t T = (uint64_t)(nd > 1 ? ish[1] : 1), lin = mixed ? 2 : 4;
        int drop = c->dropout > 0;
        r.keep_in = 1;
        r.saved = 2 * BT * 8 + BT * D * lin /* ln_1 out, c_attn's input */ +
                  (uint64_t)ct_attention_saved_bytes((int64_t)B, (int64_t)T, (int64_t)D, (int)c->heads, mixed, drop) +
                  BT * D * lin /* c_proj's input */ + (drop ? BT * D : 0) +
                  BT * D * 4 /* h */ + BT * D * lin /* c_fc's input */ + 4 * BT * D * 4 /* gelu'(x) */ +
                  4 * BT * D * lin /* mlp c_proj's input */ + (drop ? BT * D : 0);
        r.fwd_tmp = 3 * BT * D * 4 + T * T * 8; /* qkv in f32 before its cast, per-head scratch */
        /* dqkv, d(gelu), branch grads; f32: under mixed the first two may be bf16, so an upper bound */
        r.bwd_tmp = 3 * BT * D * 4 + 4 * BT * D * 4 + 2 * BT * D * 4 + T * T * 12;
    } else if (!strcmp(k, "batchnorm")) { /* mean and rstd per channel */
        r.keep_in = 1;
        r.saved = (nd > 1 ? (uint64_t)ish[1] : 1) * 8;
    } else {
        r.keep_in = r.keep_out = 1;
    }
    return r;
}

/* Leaves in forward order; sequential, residual and checkpoint are walked through. */
static void leaves(ct_module *m, ct_module **out, int *n)
{
    const char *k = m->ops->kind;
    if (m->nkids && (!strcmp(k, "sequential") || !strcmp(k, "residual") || !strcmp(k, "checkpoint"))) {
        for (int i = 0; i < m->nkids; i++) leaves(m->kids[i], out, n);
        return;
    }
    out[(*n)++] = m;
}

/* One micro-batch through the leaves lv[0..n) from an input of shape sh0
 * (nd0 dims; the input is a view of the batch or a buffer counted by the
 * caller), forward then backward.  dx0: the first leaf makes an input
 * gradient (a pipeline stage after the first).  whole: the model's output
 * and the loss gradient (and its scaled copy when scaled) stay with the
 * caller to the end; otherwise (a pipeline stage) the output is sent away
 * after forward and one gradient of its shape (the loss's or the next
 * stage's) lives through the backward.  *kept: the bytes the micro-batch's
 * record holds between its forward and its backward; *peak: the peak of
 * the whole replay. */
static ct_status replay(const est_in *in, ct_module **lv, int n, int nd0, const int64_t *sh0, int dx0, int whole,
                        int scaled, int mixed, uint64_t *kept, uint64_t *peak)
{
    int64_t(*shapes)[CT_MAX_DIMS] = ct_alloc(sizeof *shapes * (size_t)(n + 1), CT_MEM_OTHER);
    int *nds = ct_alloc(sizeof *nds * (size_t)(n + 1), CT_MEM_OTHER);
    sim s = {.cap = 4 * n + 8};
    s.b = ct_alloc(sizeof *s.b * (size_t)s.cap, CT_MEM_OTHER);
    int *kin = ct_alloc(sizeof *kin * 3 * (size_t)(n + 1), CT_MEM_OTHER), *kout = kin + n, *ksav = kin + 2 * n;
    rule *rl = ct_alloc(sizeof *rl * (size_t)(n + 1), CT_MEM_OTHER);
    ct_status st = shapes && nds && s.b && kin && rl ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) {
        nds[0] = nd0;
        memcpy(shapes[0], sh0, sizeof shapes[0]);
    }
    for (int i = 0; st == CT_OK && i < n; i++)
        st = ct_module_out_shape(lv[i], nds[i], shapes[i], &nds[i + 1], shapes[i + 1]);

    /* Forward: buffer -1 is the micro-batch's input. */
    int x = -1;
    for (int i = 0; st == CT_OK && i < n; i++) {
        rl[i] = rule_of(in, lv[i], nds[i], shapes[i], nds[i + 1], shapes[i + 1], mixed, i > 0 || dx0);
        const rule *r = &rl[i];
        int out = x;
        if (r->alias) sim_ref(&s, x);
        else out = sim_new(&s, (uint64_t)numel(nds[i + 1], shapes[i + 1]) * 4);
        ksav[i] = r->saved ? sim_new(&s, r->saved) : -1;
        sim_peak(&s, r->fwd_tmp);
        kin[i] = r->keep_in ? x : -1;
        kout[i] = r->keep_out ? out : -1;
        sim_ref(&s, kin[i]);
        sim_ref(&s, kout[i]);
        sim_unref(&s, x);
        x = out;
    }
    if (st == CT_OK) {
        uint64_t lb = (uint64_t)numel(nds[n], shapes[n]) * 4;
        *kept = s.alive - (x >= 0 && s.b[x].refs == 1 ? s.b[x].bytes : 0);
        if (!whole) sim_unref(&s, x); /* sent: the message is a copy (comm) */
        /* The loss gradient (and its scaled copy), or the next stage's gradient. */
        int g = sim_new(&s, lb);
        if (whole && scaled) g = sim_new(&s, lb);
        sim_ref(&s, g);
        sim_peak(&s, 0);
        /* Backward: each layer makes its input gradient (not the first), then its record goes. */
        for (int i = n - 1; i >= 0; i--) {
            const rule *r = &rl[i];
            int dx = -1;
            if ((i > 0 || dx0) && r->alias) sim_ref(&s, dx = g);
            else if (i > 0 || dx0) dx = sim_new(&s, (uint64_t)numel(nds[i], shapes[i]) * 4);
            sim_peak(&s, r->bwd_tmp);
            sim_unref(&s, kin[i]);
            sim_unref(&s, kout[i]);
            sim_unref(&s, ksav[i]);
            sim_unref(&s, g);
            g = dx;
        }
        *peak = s.peak;
    }
    ct_free(shapes);
    ct_free(nds);
    ct_free(s.b);
    ct_free(kin);
    ct_free(rl);
    return st;
}

/* This rank's whole batch of rows: f32 inputs and i32 targets (src/io/idx.c);
 * the gpt's i64 tokens and i64 next tokens (src/io/text.c). */
uint64_t est_batch_bytes(const est_in *in, int64_t rows)
{
    if (in->cfg.kind == CT_MODEL_GPT) return (uint64_t)rows * (uint64_t)in->cfg.context * 16;
    return (uint64_t)rows * ((uint64_t)ct_model_input_numel(&in->cfg) * 4 + 4);
}

ct_status est_activations(const est_in *in, int64_t rows, int k, int scaled, int mixed, uint64_t *bytes)
{
    ct_module **mods = NULL, **lv;
    int nmods, n = 0;
    CT_TRY(ct_module_modules(in->model, &mods, &nmods));
    lv = ct_alloc(sizeof *lv * (size_t)nmods, CT_MEM_OTHER);
    ct_status st = lv ? CT_OK : CT_ENOMEM;
    if (st == CT_OK) leaves(in->model, lv, &n);
    /* The first micro-batch is the largest (train_step cuts rows as evenly as they go). */
    int64_t mrows = rows / k + (rows % k != 0), sh0[CT_MAX_DIMS] = {0};
    int nd0 = ct_model_input_shape(&in->cfg, mrows, sh0);
    uint64_t kept, peak = 0;
    if (st == CT_OK) st = replay(in, lv, n, nd0, sh0, 0, 1, scaled, mixed, &kept, &peak);
    if (st == CT_OK) *bytes = peak + est_batch_bytes(in, rows);
    ct_free(mods);
    ct_free(lv);
    return st;
}

ct_status est_stage_activations(const est_in *in, int lo, int hi, int64_t mrows, int mixed, uint64_t *kept,
                                uint64_t *peak, uint64_t *in_bytes, uint64_t *out_bytes)
{
    ct_module **mods = NULL, **lv;
    int nmods, n = 0;
    CT_TRY(ct_module_modules(in->model, &mods, &nmods));
    lv = ct_alloc(sizeof *lv * (size_t)nmods, CT_MEM_OTHER);
    ct_status st = lv ? CT_OK : CT_ENOMEM;
    int64_t sh[CT_MAX_DIMS] = {0};
    int nd = ct_model_input_shape(&in->cfg, mrows, sh);
    for (int i = 0; st == CT_OK && i < lo; i++) st = ct_module_out_shape(in->model->kids[i], nd, sh, &nd, sh);
    *in_bytes = (uint64_t)numel(nd, sh) * 4;
    for (int i = lo; st == CT_OK && i < hi; i++) leaves(in->model->kids[i], lv, &n);
    if (st == CT_OK) st = replay(in, lv, n, nd, sh, lo > 0, 0, 0, mixed, kept, peak);
    for (int i = lo; st == CT_OK && i < hi; i++) st = ct_module_out_shape(in->model->kids[i], nd, sh, &nd, sh);
    *out_bytes = (uint64_t)numel(nd, sh) * 4;
    ct_free(mods);
    ct_free(lv);
    return st;
}

/*
 * Loading state by element ranges: the one place where a strategy's load
 * gets values out of a checkpoint tensor.  A strategy asks for the ranges
 * it keeps (ct__load_range: a replicated one whole tensors, ZeRO and FSDP
 * their pieces of the partition); the values come from memory when the
 * tensor has data, else through the caller's source (a file read by
 * position, ct_strategy_load_source), so a rank reads only what it keeps.
 * Local pieces ("<name>@<offset>") are stitched into shape-only whole
 * tensors whose ranges map onto the pieces that cover them: nothing is
 * assembled in memory, and a range reads only the pieces it overlaps.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* A whole tensor stitched from pieces. */
typedef struct {
    const ct_tensor *whole;
    int np;
    int64_t *off;   /* [np] element offset of each piece, ascending */
    ct_tensor **t;  /* [np] the pieces (borrowed from the caller's list) */
} stitched;

struct ct__load_ctx {
    const ct_state_source *src;   /* reads tensors without data; NULL: every tensor has data */
    stitched *st;
    int nst, cap;
    const ct__load_ctx *parent;   /* the strategy this one loads for (pipe's stage) */
};

static const stitched *find_stitched(const ct__load_ctx *c, const ct_tensor *t)
{
    for (; c; c = c->parent)
        for (int i = 0; i < c->nst; i++)
            if (c->st[i].whole == t) return &c->st[i];
    return NULL;
}

static const ct_state_source *find_source(const ct__load_ctx *c)
{
    for (; c; c = c->parent)
        if (c->src) return c->src;
    return NULL;
}

ct_status ct__load_range(ct_strategy *s, float *dst, const ct_tensor *src, int64_t off, int64_t count,
                         const char *name)
{
    if (src->dtype != CT_F32 && src->dtype != CT_BF16 && src->dtype != CT_F16)
        return ct_error(CT_EINVAL, "'%s' is %s in the checkpoint; parameters must be F32, BF16 or F16",
                        name, ct_dtype_name(src->dtype));
    CT_ASSERT(off >= 0 && count >= 0 && off + count <= src->numel);
    const void *mem = ct_tensor_data(src);
    if (mem) {
        switch (src->dtype) {
        case CT_F32: memcpy(dst, (const float *)mem + off, (size_t)count * 4); break;
        case CT_BF16: ct_bf16_to_f32_n((const uint16_t *)mem + off, dst, (size_t)count); break;
        default: ct_f16_to_f32_n((const uint16_t *)mem + off, dst, (size_t)count); break;
        }
        return CT_OK;
    }
    const stitched *w = find_stitched(s->load, src);
    if (w) { /* the pieces the range overlaps, each from its own place */
        for (int k = 0; k < w->np; k++) {
            int64_t lo = w->off[k], hi = lo + w->t[k]->numel;
            if (hi <= off || lo >= off + count) continue;
            int64_t a = lo > off ? lo : off, b = hi < off + count ? hi : off + count;
            CT_TRY(ct__load_range(s, dst + (a - off), w->t[k], a - lo, b - a, name));
        }
        return CT_OK;
    }
    const ct_state_source *from = find_source(s->load);
    if (!from)
        return ct_error(CT_EINVAL, "checkpoint tensor '%s' has no data in memory; a tensor opened without its "
                        "data (ct_safetensors_open) loads through ct_strategy_load_source", name);
    if (src->dtype == CT_F32) return from->read(from->ud, src, off, count, dst);
    uint16_t *half = ct_alloc((size_t)count * 2 + 2, CT_MEM_OTHER);
    if (!half) return CT_ENOMEM;
    ct_status st = from->read(from->ud, src, off, count, half);
    if (st == CT_OK && src->dtype == CT_BF16) ct_bf16_to_f32_n(half, dst, (size_t)count);
    else if (st == CT_OK) ct_f16_to_f32_n(half, dst, (size_t)count);
    ct_free(half);
    return st;
}

ct_status ct__load_whole(ct_strategy *s, float *dst, int64_t n, const ct_tensor *src, const char *name)
{
    if (src->numel != n)
        return ct_error(CT_EINVAL, "'%s' has %lld elements in the checkpoint but %lld in the model; "
                        "the checkpoint is for a different model configuration",
                        name, (long long)src->numel, (long long)n);
    return ct__load_range(s, dst, src, 0, n, name);
}

typedef struct {
    int64_t off;
    int i; /* index into names/ts */
} piece;

static int cmp_piece(const void *a, const void *b)
{
    const piece *x = a, *y = b;
    return (x->off > y->off) - (x->off < y->off);
}

/* The model tensor a (possibly optimizer-state) name describes: the
 * parameter or buffer of that name, or "<param>.<state>"'s parameter. */
static const ct_tensor *shape_of(ct_strategy *s, const char *base)
{
    ct_param *p = ct_module_find(s->model, base);
    if (p) return p->data;
    const char *dot = strrchr(base, '.');
    if (!dot) return NULL;
    char name[512];
    snprintf(name, sizeof name, "%.*s", (int)(dot - base), base);
    p = ct_module_find(s->model, name);
    return p ? p->data : NULL;
}

/* Records whole (retained by out) as stitched from pieces pc[0..np). */
static ct_status add_stitched(ct__load_ctx *c, const ct_tensor *whole, const piece *pc, int np,
                              ct_tensor *const *ts)
{
    if (c->nst == c->cap) {
        stitched *g = ct_grow(c->st, c->nst, &c->cap, sizeof *g, CT_MEM_OTHER);
        if (!g) return CT_ENOMEM;
        c->st = g;
    }
    stitched *w = &c->st[c->nst];
    w->whole = whole;
    w->np = np;
    w->off = ct_alloc(sizeof *w->off * (size_t)np, CT_MEM_OTHER);
    w->t = ct_alloc(sizeof *w->t * (size_t)np, CT_MEM_OTHER);
    if (!w->off || !w->t) {
        ct_free(w->off);
        ct_free(w->t);
        return CT_ENOMEM;
    }
    for (int k = 0; k < np; k++) {
        w->off[k] = pc[k].off;
        w->t[k] = ts[pc[k].i];
    }
    c->nst++;
    return CT_OK;
}

/* Whole tensors out of names/ts where some are pieces ("<name>@<offset>",
 * 1-D): *out gets every whole tensor (retained) and, for the pieces of a
 * tensor of this rank's model, a shape-only tensor of that name stitched
 * from them in c (the pieces must tile it).  Pieces of tensors the model
 * does not know are passed on (a pipe stage's load judges them). */
static ct_status stitch_pieces(ct_strategy *s, ct__load_ctx *c, const char *const *names, ct_tensor *const *ts,
                               int n, ct_state *out)
{
    memset(out, 0, sizeof *out);
    piece *pc = ct_alloc(sizeof *pc * (size_t)(n + 1), CT_MEM_OTHER);
    char *done = ct_alloc_zeroed((size_t)n + 1, CT_MEM_OTHER);
    ct_status st = pc && done ? CT_OK : CT_ENOMEM;
    char base[512];
    for (int i = 0; i < n && st == CT_OK; i++) {
        const char *at = strrchr(names[i], '@');
        if (!at) {
            st = ct_state_add(out, names[i], ts[i]);
            continue;
        }
        if (done[i]) continue;
        snprintf(base, sizeof base, "%.*s", (int)(at - names[i]), names[i]);
        const ct_tensor *like = shape_of(s, base);
        if (!like) { /* not this rank's model's (a pipe stage holds a few layers): its load_state judges it */
            st = ct_state_add(out, names[i], ts[i]);
            continue;
        }
        int np = 0;
        size_t bl = strlen(base);
        for (int j = i; j < n; j++) { /* every piece of base */
            char *end;
            if (strncmp(names[j], base, bl) || names[j][bl] != '@') continue;
            long long off = strtoll(names[j] + bl + 1, &end, 10);
            if (*end || off < 0 || ts[j]->dtype != CT_F32 || ts[j]->ndim != 1) {
                st = ct_error(CT_EINVAL, "checkpoint piece '%s' is not an F32 vector at a whole offset", names[j]);
                break;
            }
            pc[np++] = (piece){off, j};
            done[j] = 1;
        }
        if (st != CT_OK) break;
        qsort(pc, (size_t)np, sizeof *pc, cmp_piece);
        int64_t at_elem = 0;
        for (int k = 0; k < np && st == CT_OK; k++) {
            if (pc[k].off != at_elem)
                st = ct_error(CT_EINVAL, "checkpoint pieces of '%s' %s at element %lld: the checkpoint is "
                              "incomplete or mixes two saves", base, pc[k].off > at_elem ? "leave a gap" : "overlap",
                              (long long)at_elem);
            at_elem += ts[pc[k].i]->numel;
        }
        if (st == CT_OK && at_elem != like->numel)
            st = ct_error(CT_EINVAL, "checkpoint pieces of '%s' hold %lld elements but the model's tensor has %lld",
                          base, (long long)at_elem, (long long)like->numel);
        ct_tensor *whole = st == CT_OK ? ct_tensor_wrap(CT_F32, like->ndim, like->shape, NULL) : NULL;
        if (st == CT_OK && !whole) st = CT_ENOMEM;
        if (st == CT_OK) st = ct_state_add(out, base, whole);
        if (st == CT_OK) st = add_stitched(c, whole, pc, np, ts);
        ct_tensor_release(whole);
    }
    ct_free(pc);
    ct_free(done);
    return st;
}

ct_status ct__strategy_load(ct_strategy *s, const char *const *names, ct_tensor *const *tensors, int n, int optim,
                            const ct_state_source *src, const ct__load_ctx *parent)
{
    ct__load_ctx c = {src, NULL, 0, 0, parent};
    ct_state list;
    const ct__load_ctx *was = s->load;
    s->load = &c;
    ct_status st = stitch_pieces(s, &c, names, tensors, n, &list);
    if (st == CT_OK)
        st = s->vt.state.load(s, (const char *const *)list.names, list.tensors, list.n, optim);
    s->load = was;
    for (int i = 0; i < c.nst; i++) {
        ct_free(c.st[i].off);
        ct_free(c.st[i].t);
    }
    ct_free(c.st);
    ct_state_fini(&list);
    return st;
}

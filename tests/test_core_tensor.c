/*
 * Tests of tensors (src/core/tensor.c): construction and accounting,
 * views and reshapes that keep their base alive, clones, reference counts,
 * rejected shapes with their messages, shape strings and dtype names.  Run
 * under ASan, the lifetime tests catch use-after-free and leaks.
 */
#include <stdint.h>

#include "test.h"

static size_t mem_total(void)
{
    size_t s = 0;
    for (int c = 0; c < CT_MEM_NCAT; c++) s += ct_mem_current((ct_mem_cat)c);
    return s;
}

TEST(core_tensor_new_and_accounting)
{
    size_t param0 = ct_mem_current(CT_MEM_PARAM), total0 = mem_total();
    ct_tensor *t = ct_tensor_create(CT_F32, 3, (int64_t[]){2, 3, 5}, CT_MEM_PARAM);
    ASSERT(t != NULL);
    ASSERT_EQ(t->dtype, CT_F32);
    ASSERT_EQ(t->ndim, 3);
    ASSERT(t->shape[0] == 2 && t->shape[1] == 3 && t->shape[2] == 5);
    ASSERT_EQ(t->numel, 30);
    ASSERT_EQ(t->refcount, 1);
    ASSERT(t->storage && t->storage->owns && !t->storage->window && t->offset == 0);
    ASSERT_EQ(ct_tensor_cat(t), CT_MEM_PARAM);
    ASSERT_EQ(ct_tensor_bytes(t), 120);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 120);
    ASSERT_EQ((uintptr_t)ct_tensor_data(t) % 64, 0);
    for (int i = 0; i < 30; i++) ASSERT(ct_f32(t)[i] == 0.0f);
    ct_tensor_release(t);
    ASSERT_EQ(mem_total(), total0);

    ct_tensor *a = ct_tensor_create1(7, CT_MEM_ACT);
    ct_tensor *b = ct_tensor_create2(3, 4, CT_MEM_ACT);
    ct_tensor *c = ct_tensor_create4(2, 3, 4, 5, CT_MEM_ACT);
    ASSERT(a && b && c);
    ASSERT(a->ndim == 1 && a->numel == 7);
    ASSERT(b->ndim == 2 && b->shape[0] == 3 && b->shape[1] == 4 && b->numel == 12);
    ASSERT(c->ndim == 4 && c->shape[3] == 5 && c->numel == 120);
    ASSERT(a->dtype == CT_F32 && b->dtype == CT_F32 && c->dtype == CT_F32);

    /* Other dtypes take their own element size. */
    ct_tensor *h = ct_tensor_create(CT_BF16, 1, (int64_t[]){9}, CT_MEM_GRAD);
    ct_tensor *l = ct_tensor_create(CT_I64, 2, (int64_t[]){2, 2}, CT_MEM_GRAD);
    ASSERT(h && l);
    ASSERT_EQ(ct_tensor_bytes(h), 18);
    ASSERT_EQ(ct_tensor_bytes(l), 32);

    /* Scalars and empty tensors are valid. */
    ct_tensor *s = ct_tensor_create(CT_F32, 0, NULL, CT_MEM_OTHER);
    ct_tensor *e = ct_tensor_create(CT_F32, 2, (int64_t[]){0, 5}, CT_MEM_OTHER);
    ASSERT(s && e);
    ASSERT_EQ(s->numel, 1);
    ASSERT_EQ(e->numel, 0);
    ASSERT_EQ(ct_tensor_bytes(e), 0);

    ct_tensor *all[] = {a, b, c, h, l, s, e};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ct_tensor_release(all[i]);
    ct_tensor_release(NULL);
    ASSERT_EQ(mem_total(), total0);
}

TEST(core_tensor_view_keeps_base_alive)
{
    size_t total0 = mem_total();
    ct_tensor *base = ct_tensor_create1(10, CT_MEM_PARAM);
    for (int i = 0; i < 10; i++) ct_f32(base)[i] = (float)i;
    ct_tensor *v = ct_tensor_view(base, 4, 2, (int64_t[]){2, 3});
    ASSERT(v != NULL);
    ASSERT(v->storage == base->storage);
    ASSERT_EQ(base->storage->refcount, 2);
    ASSERT_EQ(base->refcount, 1);
    ASSERT_EQ(v->numel, 6);
    ASSERT(ct_tensor_data(v) == (char *)ct_tensor_data(base) + 4 * sizeof(float));
    ASSERT(ct_f32(v)[0] == 4.0f && ct_f32(v)[5] == 9.0f);
    ASSERT_EQ(ct_tensor_cat(v), CT_MEM_PARAM);

    /* Writes through the view land in the base. */
    ct_f32(v)[1] = 50.0f;
    ASSERT(ct_f32(base)[5] == 50.0f);

    /* Views of views: the chain keeps everything alive. */
    ct_tensor *vv = ct_tensor_view(v, 3, 1, (int64_t[]){3});
    ASSERT(vv && vv->storage == base->storage && base->storage->refcount == 3);
    ASSERT(ct_f32(vv)[0] == 7.0f);

    ct_storage *mem = base->storage;
    ct_tensor_release(base); /* the caller lets go; the views still hold the storage */
    ASSERT_EQ(mem->refcount, 2);
    ct_tensor_release(v);
    ASSERT_EQ(mem->refcount, 1);
    ct_f32(vv)[2] += 1.0f; /* ASan: would be a use-after-free if the base had gone */
    ASSERT(ct_f32(vv)[2] == 10.0f);
    ASSERT(ct_f32(vv)[0] == 7.0f);
    ct_tensor_release(vv); /* frees vv, then the storage */
    ASSERT_EQ(mem_total(), total0);
}

TEST(core_tensor_reshape_clone_retain)
{
    size_t total0 = mem_total();
    ct_tensor *t = ct_tensor_create2(3, 4, CT_MEM_ACT);
    for (int i = 0; i < 12; i++) ct_f32(t)[i] = (float)i * 0.5f;

    ct_tensor *r = ct_tensor_reshape(t, 3, (int64_t[]){2, 2, 3});
    ASSERT(r != NULL);
    ASSERT(ct_tensor_data(r) == ct_tensor_data(t) && r->ndim == 3 && r->shape[2] == 3 && r->numel == 12);
    ASSERT_EQ(t->storage->refcount, 2);

    ct_tensor *c = ct_tensor_clone(r, CT_MEM_GRAD);
    ASSERT(c != NULL);
    ASSERT(ct_tensor_data(c) != ct_tensor_data(t) && c->storage != t->storage && c->refcount == 1);
    ASSERT_EQ(ct_tensor_cat(c), CT_MEM_GRAD);
    ASSERT(ct_tensor_same_shape(c, r));
    ASSERT(!ct_tensor_same_shape(c, t));
    ASSERT(!memcmp(ct_tensor_data(c), ct_tensor_data(t), 48));
    ct_f32(c)[0] = -1.0f; /* a clone is independent */
    ASSERT(ct_f32(t)[0] == 0.0f);

    ASSERT(ct_tensor_retain(c) == c);
    ASSERT_EQ(c->refcount, 2);
    ct_tensor_release(c);
    ASSERT_EQ(c->refcount, 1);
    ASSERT(ct_f32(c)[0] == -1.0f);
    ct_tensor_release(c);

    ct_tensor_release(t);
    ASSERT(ct_f32(r)[11] == 5.5f);
    ct_tensor_release(r);
    ASSERT_EQ(mem_total(), total0);
}

TEST(core_tensor_wrap_fill_copy)
{
    size_t total0 = mem_total();
    float buf[6] = {1, 2, 3, 4, 5, 6};
    ct_tensor *w = ct_tensor_wrap(CT_F32, 2, (int64_t[]){2, 3}, buf);
    ASSERT(w != NULL);
    ASSERT(ct_tensor_data(w) == buf && !w->storage->owns && w->numel == 6);

    ct_tensor *t = ct_tensor_create2(2, 3, CT_MEM_ACT);
    ASSERT_OK(ct_tensor_copy(t, w));
    ASSERT(ct_f32(t)[5] == 6.0f);
    ct_tensor_fill(w, 2.5f);
    for (int i = 0; i < 6; i++) ASSERT(buf[i] == 2.5f);
    ct_tensor_fill(t, 0.0f);
    for (int i = 0; i < 6; i++) ASSERT(ct_f32(t)[i] == 0.0f);

    ct_tensor *small = ct_tensor_create1(5, CT_MEM_ACT);
    ct_tensor *half = ct_tensor_create(CT_F16, 2, (int64_t[]){2, 3}, CT_MEM_ACT);
    ASSERT_ERR(ct_tensor_copy(t, small), CT_EINVAL, "differ");
    ASSERT_ERR(ct_tensor_copy(t, half), CT_EINVAL, "F16");
    ct_tensor_release(small);
    ct_tensor_release(half);

    /* Copy between overlapping views of one tensor (memmove semantics). */
    ct_tensor *seq = ct_tensor_create1(8, CT_MEM_ACT);
    for (int i = 0; i < 8; i++) ct_f32(seq)[i] = (float)i;
    ct_tensor *lo = ct_tensor_view(seq, 0, 1, (int64_t[]){6});
    ct_tensor *hi = ct_tensor_view(seq, 2, 1, (int64_t[]){6});
    ASSERT_OK(ct_tensor_copy(hi, lo));
    float want[8] = {0, 1, 0, 1, 2, 3, 4, 5};
    ASSERT(!memcmp(ct_f32(seq), want, sizeof want));
    ct_tensor_release(lo);
    ct_tensor_release(hi);
    ct_tensor_release(seq);

    ct_tensor_release(w); /* must not free buf (ASan would report a bad free) */
    ASSERT(buf[0] == 2.5f);
    ct_tensor_release(t);
    ASSERT_EQ(mem_total(), total0);
}

/* Expects NULL from a constructor and a message containing needle. */
#define ASSERT_NULL_ERR(expr, needle)                                         \
    do {                                                                      \
        ct_clear_error();                                                     \
        ASSERT((expr) == NULL);                                               \
        ASSERT_STR_CONTAINS(ct_last_error(), needle);                         \
    } while (0)

TEST(core_tensor_bad_shapes_rejected)
{
    size_t total0 = mem_total();
    int64_t seven[7] = {1, 1, 1, 1, 1, 1, 1};
    ASSERT_NULL_ERR(ct_tensor_create(CT_F32, 7, seven, CT_MEM_ACT), "at most 6");
    ASSERT_NULL_ERR(ct_tensor_create(CT_F32, -1, seven, CT_MEM_ACT), "dims");
    ASSERT_NULL_ERR(ct_tensor_create2(3, -2, CT_MEM_ACT), "negative");
    ASSERT_NULL_ERR(ct_tensor_wrap(CT_F32, 1, (int64_t[]){-1}, seven), "negative");
    /* Six dims is the limit and is fine. */
    ct_tensor *six = ct_tensor_create(CT_U8, 6, (int64_t[]){1, 2, 1, 2, 1, 2}, CT_MEM_ACT);
    ASSERT(six != NULL && six->numel == 8);
    ct_tensor_release(six);

    /* Element counts whose product or byte size overflows int64 must be
     * refused, not wrapped around into a small allocation. */
    int64_t big = (int64_t)1 << 32;
    ASSERT_NULL_ERR(ct_tensor_create(CT_F32, 2, (int64_t[]){big, big}, CT_MEM_ACT), "too large");
    ct_tensor *zero = ct_tensor_create(CT_F32, 3, (int64_t[]){big, big, 0}, CT_MEM_ACT);
    ASSERT(zero != NULL && zero->numel == 0); /* a zero dim makes any product empty */
    ct_tensor_release(zero);
    ASSERT_NULL_ERR(ct_tensor_create(CT_I64, 1, (int64_t[]){INT64_MAX / 4}, CT_MEM_ACT), "too large");
    ASSERT_NULL_ERR(ct_tensor_create1(INT64_MAX, CT_MEM_ACT), "too large");

    ct_tensor *t = ct_tensor_create1(10, CT_MEM_ACT);
    ASSERT_NULL_ERR(ct_tensor_view(t, 5, 1, (int64_t[]){6}), "exceeds");
    ASSERT_NULL_ERR(ct_tensor_view(t, -1, 1, (int64_t[]){2}), "exceeds");
    ASSERT_NULL_ERR(ct_tensor_view(t, 11, 1, (int64_t[]){0}), "exceeds");
    ASSERT_NULL_ERR(ct_tensor_view(t, INT64_MAX, 1, (int64_t[]){1}), "exceeds");
    ASSERT_NULL_ERR(ct_tensor_view(t, 0, 7, seven), "at most 6");
    ASSERT_NULL_ERR(ct_tensor_view(t, 0, 1, (int64_t[]){-3}), "negative");
    ASSERT_EQ(t->storage->refcount, 1); /* failed views hold no reference */
    ct_tensor *edge = ct_tensor_view(t, 10, 1, (int64_t[]){0}); /* empty view at the end */
    ASSERT(edge != NULL);
    ct_tensor_release(edge);

    ASSERT_NULL_ERR(ct_tensor_reshape(t, 2, (int64_t[]){3, 3}), "cannot reshape [10] (10 elements) to 9");
    ASSERT_NULL_ERR(ct_tensor_reshape(t, 2, (int64_t[]){-2, -5}), "negative");
    ASSERT_NULL_ERR(ct_tensor_reshape(t, 7, seven), "at most 6");
    ASSERT_NULL_ERR(ct_tensor_reshape(t, 2, (int64_t[]){big, big}), "too large");
    ASSERT_EQ(t->refcount, 1);
    ct_tensor_release(t);
    ASSERT_EQ(mem_total(), total0);
}

TEST(core_tensor_shape_str)
{
    char buf[64];
    ct_tensor *t = ct_tensor_create2(64, 784, CT_MEM_ACT);
    ASSERT(!strcmp(ct_shape_str(t, buf, sizeof buf), "[64, 784]"));
    ct_tensor *r = ct_tensor_reshape(t, 1, (int64_t[]){64 * 784});
    ASSERT(!strcmp(ct_shape_str(r, buf, sizeof buf), "[50176]"));
    ct_tensor *s = ct_tensor_create(CT_F32, 0, NULL, CT_MEM_ACT);
    ASSERT(!strcmp(ct_shape_str(s, buf, sizeof buf), "[]"));
    ct_tensor *six = ct_tensor_create(CT_U8, 6, (int64_t[]){1, 2, 3, 4, 5, 0}, CT_MEM_ACT);
    ASSERT(!strcmp(ct_shape_str(six, buf, sizeof buf), "[1, 2, 3, 4, 5, 0]"));
    /* A short buffer gets a terminated prefix, never an overflow. */
    for (size_t n = 1; n <= 10; n++) {
        char small[16];
        memset(small, 'x', sizeof small);
        ct_shape_str(t, small, n);
        ASSERT(strlen(small) < n);
        ASSERT(!strncmp(small, "[64, 784]", strlen(small)));
        ASSERT(small[n] == 'x'); /* nothing written past n */
    }
    ct_tensor_release(r);
    ct_tensor_release(t);
    ct_tensor_release(s);
    ct_tensor_release(six);
}

TEST(core_dtype_names_and_sizes)
{
    const char *names[] = {"F32", "BF16", "F16", "I64", "I32", "U8"};
    const size_t sizes[] = {4, 2, 2, 8, 4, 1};
    ASSERT_EQ(CT_NDTYPE, 6);
    for (int i = 0; i < CT_NDTYPE; i++) {
        ASSERT(!strcmp(ct_dtype_name((ct_dtype)i), names[i]));
        ASSERT_EQ(ct_dtype_size((ct_dtype)i), sizes[i]);
        ct_dtype dt = CT_NDTYPE;
        ASSERT_EQ(ct_dtype_parse(ct_dtype_name((ct_dtype)i), &dt), 0);
        ASSERT_EQ(dt, i);
    }
    const char *bad[] = {"f32", "F64", "BOOL", "", "F3", "F32 ", "BF"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ct_dtype dt = CT_F16;
        ASSERT_EQ(ct_dtype_parse(bad[i], &dt), -1);
        ASSERT_EQ(dt, CT_F16); /* untouched on failure */
    }
    ASSERT(!strcmp(ct_dtype_name(CT_NDTYPE), "?"));
}

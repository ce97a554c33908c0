/*
 * Tests of tensors (src/core/tensor.c): construction and accounting,
 * views and reshapes that keep their base alive, clones, reference counts,
 * rejected shapes with their messages, shape strings and dtype names;
 * storage that is released and brought back or repointed into a flat buffer
 * under several views; references released from several threads at once.
 * Run under ASan, the lifetime tests catch use-after-free and leaks.
 */
#include <pthread.h>
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

/* ---- storage that leaves and comes back -------------------------------- */

/* A flat storage under several views (two of it, one a view of a view):
 * releasing its memory takes the data from every view and the bytes from
 * the counters; bringing it back gives every view the new memory. */
TEST(core_storage_release_and_rematerialise)
{
    size_t total0 = mem_total(), param0 = ct_mem_current(CT_MEM_PARAM);
    ct_storage *flat = ct_storage_create(4000, CT_MEM_PARAM, 1);
    ASSERT(flat && flat->refcount == 1 && ct_storage_has_data(flat));
    ct_tensor *a = ct_tensor_on(flat, 0, CT_F32, 2, (int64_t[]){10, 20});
    ct_tensor *b = ct_tensor_on(flat, 800, CT_F32, 1, (int64_t[]){100});
    ASSERT(a && b);
    ct_tensor *c = ct_tensor_view(a, 5, 1, (int64_t[]){3});
    ASSERT(c);
    ASSERT_EQ(flat->refcount, 4);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 4000);
    for (int i = 0; i < 200; i++) ct_f32(a)[i] = (float)i;
    for (int i = 0; i < 100; i++) ct_f32(b)[i] = -(float)i;
    ASSERT(ct_f32(c)[1] == 6.0f);
    ASSERT(((float *)ct_storage_ptr(flat))[200 + 7] == -7.0f);

    /* Released: no data through any view, no bytes counted. */
    ASSERT_OK(ct_storage_free_data(flat));
    ASSERT(!ct_storage_has_data(flat));
    ASSERT(ct_tensor_data(a) == NULL && ct_tensor_data(b) == NULL && ct_tensor_data(c) == NULL);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM), param0);
    ASSERT_EQ(flat->refcount, 4); /* the views stay */
    ASSERT_OK(ct_storage_free_data(flat)); /* released twice: a no-op */
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM), param0);

    /* Back, zeroed: every view follows the new memory at its offset. */
    ASSERT_OK(ct_storage_alloc_data(flat, 1));
    char *p = ct_storage_ptr(flat);
    ASSERT(p != NULL);
    ASSERT(ct_tensor_data(a) == p && ct_tensor_data(b) == p + 800 && ct_tensor_data(c) == p + 20);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 4000);
    for (int i = 0; i < 1000; i++) ASSERT(((float *)p)[i] == 0.0f);
    ASSERT_OK(ct_storage_alloc_data(flat, 1)); /* has memory: a no-op */
    ASSERT(ct_storage_ptr(flat) == p);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 4000);
    ct_f32(c)[2] = 42.0f;
    ASSERT(ct_f32(a)[7] == 42.0f);

    /* Several rounds, as FSDP does every step; without zeroing the caller
     * writes everything (here through the views). */
    for (int round = 0; round < 5; round++) {
        ASSERT_OK(ct_storage_free_data(flat));
        ASSERT(ct_tensor_data(c) == NULL);
        ASSERT_EQ(ct_mem_current(CT_MEM_PARAM), param0);
        ASSERT_OK(ct_storage_alloc_data(flat, 0));
        for (int i = 0; i < 200; i++) ct_f32(a)[i] = (float)(round * 1000 + i);
        ASSERT(ct_f32(c)[0] == (float)(round * 1000 + 5));
        ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 4000);
    }

    /* Bringing it back can fail like any allocation, and then changes nothing. */
    ASSERT_OK(ct_storage_free_data(flat));
    ct_mem_fail_after(0);
    ct_clear_error();
    ASSERT_EQ(ct_storage_alloc_data(flat, 1), CT_ENOMEM);
    ASSERT_STR_CONTAINS(ct_last_error(), "out of memory");
    ASSERT(!ct_storage_has_data(flat) && ct_tensor_data(b) == NULL);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM), param0);
    ASSERT_OK(ct_storage_alloc_data(flat, 1));
    ASSERT(ct_f32(b)[99] == 0.0f);

    /* Memory that is not the storage's own cannot be freed through it. */
    float buf[4];
    ct_tensor *w = ct_tensor_wrap(CT_F32, 1, (int64_t[]){4}, buf);
    ASSERT_ERR(ct_storage_free_data(w->storage), CT_ESTATE, "does not own it");
    ASSERT(ct_tensor_data(w) == buf);
    ct_tensor_release(w);

    /* Refcounts drop to zero cleanly whatever the order: the storage goes
     * with its last view (ASan checks for leaks and double frees). */
    ct_storage_release(flat);
    ASSERT_EQ(flat->refcount, 3);
    ct_tensor_release(a);
    ASSERT(ct_f32(c)[0] == 0.0f); /* c keeps the storage alive */
    ct_tensor_release(c);
    ASSERT_EQ(flat->refcount, 1);
    ct_tensor_release(b);
    ASSERT_EQ(mem_total(), total0);

    /* A storage released while its memory is out frees cleanly too. */
    ct_storage *gone = ct_storage_create(256, CT_MEM_GRAD, 0);
    ct_tensor *gv = ct_tensor_on(gone, 128, CT_U8, 1, (int64_t[]){128});
    ASSERT(gone && gv);
    ASSERT_OK(ct_storage_free_data(gone));
    ct_storage_release(gone);
    ct_tensor_release(gv);
    ASSERT_EQ(mem_total(), total0);
}

/* Parameters moved into a flat buffer (ct_storage_repoint with copy) keep
 * their values and their views; their own memory is freed; the flat buffer
 * can then leave and come back with every window following it. */
TEST(core_storage_repoint_keeps_values)
{
    size_t total0 = mem_total(), param0 = ct_mem_current(CT_MEM_PARAM);
    ct_tensor *w = ct_tensor_create2(3, 4, CT_MEM_PARAM);
    ct_tensor *bias = ct_tensor_create1(4, CT_MEM_PARAM);
    ASSERT(w && bias);
    for (int i = 0; i < 12; i++) ct_f32(w)[i] = 0.5f * (float)i + 1.0f;
    for (int i = 0; i < 4; i++) ct_f32(bias)[i] = -(float)i - 0.25f;
    ct_tensor *row1 = ct_tensor_view(w, 4, 1, (int64_t[]){4});
    ASSERT(row1);
    ct_storage *flat = ct_storage_create(48 + 16 + 64, CT_MEM_PARAM, 1);
    ASSERT(flat);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 48 + 16 + 128);

    ASSERT_OK(ct_storage_repoint(w->storage, flat, 0, 1));
    ASSERT_OK(ct_storage_repoint(bias->storage, flat, 64, 1)); /* leaves a 16-byte gap */
    char *fp = ct_storage_ptr(flat);
    ASSERT(ct_tensor_data(w) == fp && ct_tensor_data(row1) == fp + 16 && ct_tensor_data(bias) == fp + 64);
    for (int i = 0; i < 12; i++) ASSERT(ct_f32(w)[i] == 0.5f * (float)i + 1.0f);
    for (int i = 0; i < 4; i++) ASSERT(ct_f32(row1)[i] == 0.5f * (float)(4 + i) + 1.0f);
    for (int i = 0; i < 4; i++) ASSERT(ct_f32(bias)[i] == -(float)i - 0.25f);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 128); /* the old memory is gone */
    ASSERT_EQ(flat->refcount, 3);
    ASSERT(!w->storage->owns && w->storage->window == flat);
    ((float *)fp)[5] = 99.0f; /* writes through the flat buffer land in the views */
    ASSERT(ct_f32(row1)[1] == 99.0f);

    /* A window cannot be freed on its own, nor placed outside the buffer. */
    ASSERT_ERR(ct_storage_free_data(w->storage), CT_ESTATE, "repointed");
    ct_storage *extra = ct_storage_create(80, CT_MEM_PARAM, 1);
    ASSERT_ERR(ct_storage_repoint(extra, flat, 64, 1), CT_EINVAL, "does not fit");
    ASSERT_ERR(ct_storage_repoint(extra, flat, (size_t)-1, 1), CT_EINVAL, "does not fit");
    ASSERT_ERR(ct_storage_repoint(flat, flat, 0, 0), CT_EINVAL, "itself");
    ASSERT(extra->owns && ct_storage_has_data(extra)); /* untouched by the failures */

    /* The flat buffer leaves: every window and view loses its data, and the
     * bytes are counted nowhere; it comes back and they follow. */
    ASSERT_OK(ct_storage_free_data(flat));
    ASSERT(ct_tensor_data(w) == NULL && ct_tensor_data(row1) == NULL && ct_tensor_data(bias) == NULL);
    ASSERT(!ct_storage_has_data(w->storage));
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 80);
    ASSERT_ERR(ct_storage_repoint(extra, flat, 0, 1), CT_ESTATE, "released");
    ASSERT_OK(ct_storage_alloc_data(flat, 1));
    fp = ct_storage_ptr(flat);
    ASSERT(ct_tensor_data(w) == fp && ct_tensor_data(row1) == fp + 16 && ct_tensor_data(bias) == fp + 64);
    ASSERT(ct_f32(bias)[3] == 0.0f);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 128 + 80);

    /* The caller lets go of the buffer first; the windows keep it alive. */
    ct_storage_release(extra);
    ct_storage_release(flat);
    ASSERT_EQ(flat->refcount, 2);
    ct_f32(w)[11] = 7.0f; /* ASan: a use-after-free if the buffer had gone */
    ct_tensor_release(w);
    ct_tensor_release(bias);
    ASSERT_EQ(ct_mem_current(CT_MEM_PARAM) - param0, 128);
    ASSERT(ct_f32(row1)[0] == 0.0f);
    ct_tensor_release(row1); /* the last reference: window storage, then the buffer */
    ASSERT_EQ(mem_total(), total0);
}

/* ---- references released from several threads ------------------------- */

enum { NTHREADS = 4, NVIEWS = 16, SPINS = 20000 };

typedef struct {
    ct_tensor *t;
    ct_tensor *views[NVIEWS];
    pthread_barrier_t *go;
} thread_arg;

static void *hammer(void *p)
{
    thread_arg *a = p;
    pthread_barrier_wait(a->go);
    for (int i = 0; i < SPINS; i++) {
        ct_tensor_retain(a->t);
        ct_storage_retain(a->t->storage);
        ct_storage_release(a->t->storage);
        ct_tensor_release(a->t);
    }
    for (int v = 0; v < NVIEWS; v++) ct_tensor_release(a->views[v]);
    ct_tensor_release(a->t); /* whichever thread is last frees t and the storage */
    return NULL;
}

TEST(core_tensor_refcounts_released_from_threads)
{
    size_t total0 = mem_total();
    for (int round = 0; round < 4; round++) {
        ct_tensor *t = ct_tensor_create1(1 << 16, CT_MEM_ACT);
        ASSERT(t);
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, NTHREADS);
        thread_arg args[NTHREADS];
        for (int k = 0; k < NTHREADS; k++) {
            args[k].t = ct_tensor_retain(t);
            args[k].go = &go;
            for (int v = 0; v < NVIEWS; v++)
                ASSERT((args[k].views[v] = ct_tensor_view(t, v * 64, 1, (int64_t[]){64})) != NULL);
        }
        ASSERT_EQ(t->refcount, NTHREADS + 1);
        ASSERT_EQ(t->storage->refcount, 1 + NTHREADS * NVIEWS);
        ct_tensor_release(t); /* from here on only the threads hold it */
        pthread_t th[NTHREADS];
        for (int k = 0; k < NTHREADS; k++) ASSERT_EQ(pthread_create(&th[k], NULL, hammer, &args[k]), 0);
        for (int k = 0; k < NTHREADS; k++) pthread_join(th[k], NULL);
        pthread_barrier_destroy(&go);
        /* Every count reached zero exactly once: all freed, nothing twice. */
        ASSERT_EQ(mem_total(), total0);
    }
}

TEST(tensor_rows_is_a_view_of_contiguous_rows)
{
    ct_tensor *t = ct_tensor_create2(5, 3, CT_MEM_OTHER);
    ASSERT(t);
    for (int i = 0; i < 15; i++) ct_f32(t)[i] = (float)i;
    ct_tensor *r = ct_tensor_rows(t, 1, 2);
    ASSERT(r);
    ASSERT_EQ(r->ndim, 2);
    ASSERT_EQ(r->shape[0], 2);
    ASSERT_EQ(r->shape[1], 3);
    ASSERT(ct_f32(r) == ct_f32(t) + 3);
    ct_tensor_release(r);
    ASSERT(!ct_tensor_rows(t, 4, 2));
    ASSERT(strstr(ct_last_error(), "rows [4, 6) of a tensor of 5 rows"));
    ASSERT(!ct_tensor_rows(t, -1, 1));
    ct_tensor_release(t);
}

/*
 * safetensors by pieces: the streaming writer gives ct_safetensors_save's
 * file byte for byte whatever order the tensors come in; the lazy reader
 * reads only the ranges asked for (counted), checks a whole tensor's
 * checksum, and refuses misuse with a message.
 */
#include <stdlib.h>

#include "cli_util.h"

#define NT 5

static void make_tensors(ct_tensor **t)
{
    t[0] = ct_tensor_create2(30, 7, CT_MEM_OTHER);
    t[1] = ct_tensor_create1(7, CT_MEM_OTHER);
    t[2] = ct_tensor_create(CT_BF16, 2, (int64_t[]){4, 3}, CT_MEM_OTHER);
    t[3] = ct_tensor_create(CT_I64, 1, (int64_t[]){1}, CT_MEM_OTHER);
    t[4] = ct_tensor_create1(1000, CT_MEM_OTHER);
    for (int i = 0; i < 210; i++) ct_f32(t[0])[i] = (float)i * 0.5f - 3.0f;
    for (int i = 0; i < 7; i++) ct_f32(t[1])[i] = -(float)i;
    for (int i = 0; i < 12; i++) ((uint16_t *)ct_tensor_data(t[2]))[i] = ct_f32_to_bf16((float)i);
    ((int64_t *)ct_tensor_data(t[3]))[0] = 42;
    for (int i = 0; i < 1000; i++) ct_f32(t[4])[i] = (float)i;
}

static const char *names[NT] = {"w", "b", "half", "step", "long"};

TEST(stream_writer_gives_save_s_file_byte_for_byte)
{
    ct_tensor *t[NT];
    make_tensors(t);
    const char *mk[] = {"format", "ctrain.note"}, *mv[] = {"pt", "x"};
    const char *a = path_in("saved.safetensors"), *b = path_in("streamed.safetensors");
    ASSERT_OK(ct_safetensors_save(a, names, t, NT, mk, mv, 2));
    /* shapes only for the header: the data comes later, in another order */
    ct_tensor *shapes[NT];
    for (int i = 0; i < NT; i++) shapes[i] = ct_tensor_wrap(t[i]->dtype, t[i]->ndim, t[i]->shape, NULL);
    ct_safetensors_writer *w;
    ASSERT_OK(ct_safetensors_writer_create(b, names, shapes, NT, mk, mv, 2, &w));
    for (int i = 0; i < NT; i++) ct_tensor_release(shapes[i]);
    ASSERT_ERR(ct_safetensors_writer_commit(w), CT_EINVAL, "never written");
    const int order[NT] = {4, 2, 0, 3, 1};
    for (int k = 0; k < NT; k++) ASSERT_OK(ct_safetensors_writer_put(w, names[order[k]], t[order[k]]));
    ASSERT_ERR(ct_safetensors_writer_put(w, "w", t[0]), CT_EINVAL, "written twice");
    ASSERT_ERR(ct_safetensors_writer_put(w, "other", t[0]), CT_EINVAL, "not announced");
    ASSERT_OK(ct_safetensors_writer_commit(w));
    ct_safetensors_writer_destroy(w);
    size_t na, nb;
    unsigned char *x = read_file(a, &na), *y = read_file(b, &nb);
    ASSERT_EQ(na, nb);
    ASSERT(memcmp(x, y, na) == 0);
    free(x);
    free(y);
    /* an abandoned writer leaves no file */
    const char *c = path_in("abandoned.safetensors");
    ASSERT_OK(ct_safetensors_writer_create(c, names, t, NT, NULL, NULL, 0, &w));
    ASSERT_OK(ct_safetensors_writer_put(w, "w", t[0]));
    ASSERT_ERR(ct_safetensors_writer_put(w, "b", t[0]), CT_EINVAL, "announced as F32[7]");
    ct_safetensors_writer_destroy(w);
    FILE *f = fopen(c, "rb");
    ASSERT(f == NULL);
    for (int i = 0; i < NT; i++) ct_tensor_release(t[i]);
}

TEST(stream_reader_reads_only_the_ranges_asked_for)
{
    ct_tensor *t[NT];
    make_tensors(t);
    const char *a = path_in("lazy.safetensors");
    ASSERT_OK(ct_safetensors_save(a, names, t, NT, NULL, NULL, 0));
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_open(a, &st));
    ASSERT_EQ(ct_safetensors_bytes_read(st), 0);
    ct_tensor *lw = ct_safetensors_find(st, "long"), *step = ct_safetensors_find(st, "step");
    ASSERT(lw && ct_tensor_data(lw) == NULL && lw->numel == 1000);
    ASSERT(step && ((int64_t *)ct_tensor_data(step))[0] == 42); /* small integer tensors are read at once */
    float v[10];
    ASSERT_OK(ct_safetensors_read(st, lw, 500 * 4, sizeof v, v));
    for (int i = 0; i < 10; i++) ASSERT_NEAR(v[i], 500 + i, 0);
    ASSERT_EQ(ct_safetensors_bytes_read(st), 40);
    float *whole = malloc(4000);
    ASSERT_OK(ct_safetensors_read(st, lw, 0, 4000, whole)); /* whole: checked against its crc32 */
    ASSERT_EQ(ct_safetensors_bytes_read(st), 4040);
    ASSERT_ERR(ct_safetensors_read(st, lw, 3996, 8, v), CT_EINVAL, "runs past the tensor");
    ASSERT_ERR(ct_safetensors_read(st, t[0], 0, 4, v), CT_EINVAL, "not one of this file's");
    ct_safetensors_destroy(st);
    /* a flipped bit in "long" (where its value 777 lies): a whole read names
     * the tensor; a read of another range cannot know, and does not fail */
    size_t n;
    unsigned char *bytes = read_file(a, &n);
    float mark = 777.0f;
    unsigned char *hit = memmem(bytes, n, &mark, 4);
    ASSERT(hit);
    long at = (long)(hit - bytes);
    free(bytes);
    FILE *f = fopen(a, "r+b");
    ASSERT(f && fseek(f, at, SEEK_SET) == 0);
    unsigned char flipped = (unsigned char)(((const unsigned char *)&mark)[0] ^ 1);
    ASSERT_EQ(fwrite(&flipped, 1, 1, f), 1);
    fclose(f);
    ASSERT_OK(ct_safetensors_open(a, &st));
    ct_tensor *l2 = ct_safetensors_find(st, "long");
    ASSERT_OK(ct_safetensors_read(st, l2, 0, 40, v));
    ASSERT_ERR(ct_safetensors_read(st, l2, 0, 4000, whole), CT_EFORMAT, "'long' fails its checksum");
    ct_safetensors_destroy(st);
    free(whole);
    for (int i = 0; i < NT; i++) ct_tensor_release(t[i]);
}

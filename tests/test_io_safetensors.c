/* safetensors: round trips of every dtype, the exact bytes the writer
 * produces, and every kind of malformed file the reader must reject.  Bad
 * files are built by hand here, not with the writer under test. */
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ctrain/io.h"
#include "cli_util.h"

static char *tmp_path(const char *name)
{
    static char buf[4][512];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 512, "%s/%s", ct_test_tmpdir(), name);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    ASSERT(f);
    ASSERT_EQ(fwrite(data, 1, n, f), n);
    ASSERT_EQ(fclose(f), 0);
}

/* A file with the given header text (not padded) and data bytes, built by hand. */
static const char *make_st(const char *name, const char *header, const void *data, size_t ndata)
{
    const char *path = tmp_path(name);
    size_t h = strlen(header);
    unsigned char *buf = malloc(8 + h + ndata + 1);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, header, h);
    if (ndata) memcpy(buf + 8 + h, data, ndata);
    write_bytes(path, buf, 8 + h + ndata);
    free(buf);
    return path;
}

static ct_status load_and_free(const char *path)
{
    ct_safetensors *st = (ct_safetensors *)0x1;
    ct_status s = ct_safetensors_load(path, &st);
    if (s != CT_OK) ASSERT(st == NULL);
    ct_safetensors_destroy(st);
    return s;
}

/* ---- round trips -------------------------------------------------------- */

TEST(st_roundtrip_all_dtypes_and_metadata)
{
    ct_tensor *t[8];
    const char *names[8] = {"fc.weight", "fc.bias", "emb.bf16", "half", "steps", "ids", "bytes", "scalar"};
    t[0] = ct_tensor_create2(3, 5, CT_MEM_PARAM);
    t[1] = ct_tensor_create1(5, CT_MEM_PARAM);
    t[2] = ct_tensor_create(CT_BF16, 2, (int64_t[]){2, 3}, CT_MEM_PARAM);
    t[3] = ct_tensor_create(CT_F16, 3, (int64_t[]){1, 2, 2}, CT_MEM_PARAM);
    t[4] = ct_tensor_create(CT_I64, 1, (int64_t[]){4}, CT_MEM_OTHER);
    t[5] = ct_tensor_create(CT_I32, 2, (int64_t[]){0, 3}, CT_MEM_OTHER); /* empty */
    t[6] = ct_tensor_create(CT_U8, 1, (int64_t[]){7}, CT_MEM_OTHER);     /* odd size: alignment */
    t[7] = ct_tensor_create(CT_F32, 0, NULL, CT_MEM_OTHER);              /* 0-dim */
    for (int i = 0; i < 15; i++) ct_f32(t[0])[i] = (float)i * 0.25f - 1.0f;
    for (int i = 0; i < 5; i++) ct_f32(t[1])[i] = -(float)i / 3.0f;
    for (int i = 0; i < 6; i++) ((uint16_t *)ct_tensor_data(t[2]))[i] = ct_f32_to_bf16((float)i - 2.5f);
    for (int i = 0; i < 4; i++) ((uint16_t *)ct_tensor_data(t[3]))[i] = ct_f32_to_f16((float)i * 1.5f);
    int64_t i64[4] = {0, -1, (int64_t)1 << 40, INT64_MIN};
    memcpy(ct_tensor_data(t[4]), i64, sizeof i64);
    for (int i = 0; i < 7; i++) ((uint8_t *)ct_tensor_data(t[6]))[i] = (uint8_t)(250 + i);
    ct_f32(t[7])[0] = 3.5f;
    const char *mk[] = {"format", "note", "", "ünïcode"};
    const char *mv[] = {"pt", "quote \" backslash \\ slash / nl \n tab \t cr \r ctl \x01\x1f end",
                        "empty key", "✓ 😀 é"};
    const char *path = tmp_path("all.safetensors");
    ASSERT_OK(ct_safetensors_save(path, names, t, 8, mk, mv, 4));

    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(path, &st));
    ASSERT_EQ(ct_safetensors_count(st), 8);
    for (int i = 1; i < 8; i++) /* sorted by name */
        ASSERT(strcmp(ct_safetensors_name(st, i - 1), ct_safetensors_name(st, i)) < 0);
    for (int i = 0; i < 8; i++) {
        ct_tensor *g = ct_safetensors_find(st, names[i]);
        ASSERT(g != NULL);
        ASSERT(g != t[i] && ct_tensor_data(g) != ct_tensor_data(t[i]));
        ASSERT(ct_tensor_same_shape(g, t[i]));
        ASSERT_EQ(memcmp(ct_tensor_data(g), ct_tensor_data(t[i]), ct_tensor_bytes(t[i])), 0);
    }
    ASSERT(ct_safetensors_find(st, "nope") == NULL);
    ASSERT_NEAR(ct_f32(ct_safetensors_find(st, "fc.weight"))[14], 2.5, 0);
    ASSERT_EQ(((int64_t *)ct_tensor_data(ct_safetensors_find(st, "steps")))[3], INT64_MIN);
    ASSERT_EQ(ct_safetensors_meta_count(st), 5); /* and the writer's ctrain.crc32 */
    for (int i = 0; i < 4; i++) {
        const char *v = ct_safetensors_meta(st, mk[i]);
        ASSERT(v != NULL);
        ASSERT(!strcmp(v, mv[i]));
    }
    ASSERT(ct_safetensors_meta(st, "missing") == NULL);
    ASSERT(!strcmp(ct_safetensors_meta_key(st, 0), "")); /* sorted by key */
    ASSERT(!strcmp(ct_safetensors_meta_value(st, 0), "empty key"));
    ct_safetensors_destroy(st);
    for (int i = 0; i < 8; i++) ct_tensor_release(t[i]);

    /* No temp file is left behind. */
    char tmpf[600];
    snprintf(tmpf, sizeof tmpf, "%s.tmp.%d", path, (int)getpid());
    ASSERT(access(tmpf, F_OK) != 0);
}

TEST(st_writer_exact_bytes)
{
    /* Layout by element size then name: b (F32) before a (U8); header padded. */
    ct_tensor *a = ct_tensor_create(CT_U8, 1, (int64_t[]){3}, CT_MEM_OTHER);
    ct_tensor *b = ct_tensor_create1(2, CT_MEM_OTHER);
    memcpy(ct_tensor_data(a), "xyz", 3);
    ct_f32(b)[0] = 1.0f;
    ct_f32(b)[1] = -2.0f;
    const char *path = tmp_path("exact.safetensors");
    ASSERT_OK(ct_safetensors_save(path, (const char *[]){"a", "b"}, (ct_tensor *[]){a, b}, 2,
                                  (const char *[]){"k"}, (const char *[]){"v\"\n"}, 1));
    /* the writer adds each tensor's crc32, in name order (zlib.crc32 in Python agrees) */
    const char *want = "{\"__metadata__\":{\"ctrain.crc32\":\"eb8eba67,c3872656\",\"k\":\"v\\\"\\n\"},"
                       "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                       "\"a\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[8,11]}}";
    size_t wl = strlen(want), padded = (wl + 7) / 8 * 8, n;
    unsigned char *f = read_file(path, &n);
    ASSERT_EQ(n, 8 + padded + 11);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = hl << 8 | f[i];
    ASSERT_EQ(hl, padded);
    ASSERT_EQ(memcmp(f + 8, want, wl), 0);
    for (size_t i = wl; i < padded; i++) ASSERT_EQ(f[8 + i], ' ');
    float fb[2] = {1.0f, -2.0f};
    ASSERT_EQ(memcmp(f + 8 + padded, fb, 8), 0);
    ASSERT_EQ(memcmp(f + 8 + padded + 8, "xyz", 3), 0);
    free(f);

    /* Empty file: "{}" padded to 8. */
    ASSERT_OK(ct_safetensors_save(path, NULL, NULL, 0, NULL, NULL, 0));
    f = read_file(path, &n);
    ASSERT_EQ(n, 16);
    ASSERT_EQ(memcmp(f + 8, "{}      ", 8), 0);
    free(f);
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(path, &st));
    ASSERT_EQ(ct_safetensors_count(st), 0);
    ASSERT_EQ(ct_safetensors_meta_count(st), 0);
    ct_safetensors_destroy(st);
    ct_tensor_release(a);
    ct_tensor_release(b);
}

TEST(st_writer_rejects_bad_input)
{
    ct_tensor *a = ct_tensor_create1(2, CT_MEM_OTHER);
    const char *path = tmp_path("bad_in.safetensors");
    ASSERT_ERR(ct_safetensors_save(path, (const char *[]){"w", "w"}, (ct_tensor *[]){a, a}, 2, NULL, NULL, 0),
               CT_EINVAL, "tensor name 'w' is given twice");
    ASSERT_ERR(ct_safetensors_save(path, (const char *[]){"__metadata__"}, (ct_tensor *[]){a}, 1, NULL, NULL, 0),
               CT_EINVAL, "reserved");
    ASSERT_ERR(ct_safetensors_save(path, (const char *[]){"bad\xff"}, (ct_tensor *[]){a}, 1, NULL, NULL, 0),
               CT_EINVAL, "not valid UTF-8");
    ASSERT_ERR(ct_safetensors_save(path, (const char *[]){"w"}, (ct_tensor *[]){a}, 1,
                                   (const char *[]){"k", "k"}, (const char *[]){"1", "2"}, 2),
               CT_EINVAL, "metadata key 'k' is given twice");
    ASSERT_ERR(ct_safetensors_save("/nonexistent-dir/x.safetensors", (const char *[]){"w"},
                                   (ct_tensor *[]){a}, 1, NULL, NULL, 0),
               CT_EIO, "cannot create");
    ASSERT(access(path, F_OK) != 0); /* nothing written on failure */
    ct_tensor_release(a);
}

TEST(st_save_replaces_atomically)
{
    const char *path = tmp_path("replace.safetensors");
    ct_tensor *a = ct_tensor_create1(4, CT_MEM_OTHER), *b = ct_tensor_create1(1000, CT_MEM_OTHER);
    ct_tensor_fill(a, 1.0f);
    ct_tensor_fill(b, 2.0f);
    ASSERT_OK(ct_safetensors_save(path, (const char *[]){"x"}, &a, 1, NULL, NULL, 0));
    ASSERT_OK(ct_safetensors_save(path, (const char *[]){"x"}, &b, 1, NULL, NULL, 0));
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(path, &st));
    ASSERT_EQ(ct_safetensors_find(st, "x")->numel, 1000);
    ASSERT_NEAR(ct_f32(ct_safetensors_find(st, "x"))[999], 2.0, 0);
    /* A tensor can outlive its file object when retained. */
    ct_tensor *keep = ct_tensor_retain(ct_safetensors_find(st, "x"));
    ct_safetensors_destroy(st);
    ASSERT_NEAR(ct_f32(keep)[0], 2.0, 0);
    ct_tensor_release(keep);
    ct_tensor_release(a);
    ct_tensor_release(b);
}

/* Every allocation failure is reported as ENOMEM and leaks nothing. */
TEST(st_alloc_failures)
{
    const char *path = tmp_path("oom.safetensors");
    ct_tensor *a = ct_tensor_create2(3, 4, CT_MEM_OTHER), *b = ct_tensor_create(CT_I64, 1, (int64_t[]){5}, CT_MEM_OTHER);
    const char *names[] = {"a", "b"};
    ct_tensor *ts[] = {a, b};
    size_t base = ct_mem_current(CT_MEM_OTHER);
    int saved = 0, loaded = 0;
    for (long k = 0; k < 100 && !saved; k++) {
        ct_mem_fail_after(k);
        ct_status s = ct_safetensors_save(path, names, ts, 2, (const char *[]){"m"}, (const char *[]){"v"}, 1);
        ct_mem_fail_after(-1);
        ASSERT(s == CT_OK || s == CT_ENOMEM);
        ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), base);
        saved = s == CT_OK;
    }
    ASSERT(saved);
    for (long k = 0; k < 100 && !loaded; k++) {
        ct_safetensors *st = NULL;
        ct_mem_fail_after(k);
        ct_status s = ct_safetensors_load(path, &st);
        ct_mem_fail_after(-1);
        ASSERT(s == CT_OK || s == CT_ENOMEM);
        loaded = s == CT_OK;
        ct_safetensors_destroy(st);
        ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), base);
    }
    ASSERT(loaded);
    ct_tensor_release(a);
    ct_tensor_release(b);
}

/* ---- malformed files ---------------------------------------------------- */

#define T1_ENTRY "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}"
#define T1 "{" T1_ENTRY "}"

TEST(st_reader_accepts_hand_built_file)
{
    float d[2] = {1.5f, -3.0f};
    ct_safetensors *st;
    /* Unpadded header, whitespace, unknown fields and null metadata are all valid. */
    const char *p = make_st("hand.st", " { \"__metadata__\" : null , \"a\":{\"shape\":[2],\"x\":[true,false,"
                                       "null,{\"y\":\"\\u00e9\\ud83d\\ude00\"}],\"dtype\":\"F32\","
                                       "\"data_offsets\":[0,8]}}\t\n", d, 8);
    ASSERT_OK(ct_safetensors_load(p, &st));
    ASSERT_EQ(ct_safetensors_count(st), 1);
    ASSERT_NEAR(ct_f32(ct_safetensors_tensor(st, 0))[1], -3.0, 0);
    ct_safetensors_destroy(st);
    /* Escaped name and metadata. */
    p = make_st("hand2.st", "{\"__metadata__\":{\"k\\u00e9\":\"a\\\"b\\\\c\\/d\\n\\ud83d\\ude00\"},"
                            "\"w\\t\":{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}}", "Z", 1);
    ASSERT_OK(ct_safetensors_load(p, &st));
    ASSERT(!strcmp(ct_safetensors_name(st, 0), "w\t"));
    ASSERT(!strcmp(ct_safetensors_meta(st, "k\xc3\xa9"), "a\"b\\c/d\n\xf0\x9f\x98\x80"));
    ASSERT_EQ(ct_safetensors_tensor(st, 0)->ndim, 0);
    ct_safetensors_destroy(st);
}

TEST(st_reader_rejects_short_files)
{
    ASSERT_ERR(load_and_free(tmp_path("does-not-exist.st")), CT_EIO, "cannot open");
    const char *p = tmp_path("short.st");
    write_bytes(p, "\x08\x00\x00", 3);
    ASSERT_ERR(load_and_free(p), CT_EFORMAT, "too short for the 8-byte header length");
    ASSERT_STR_CONTAINS(ct_last_error(), p);
    write_bytes(p, "", 0);
    ASSERT_ERR(load_and_free(p), CT_EFORMAT, "is 0 bytes");
    /* Header length past the end of the file. */
    unsigned char b[18] = {0xe8, 0x03, 0, 0, 0, 0, 0, 0, '{', '}'};
    write_bytes(p, b, 18);
    ASSERT_ERR(load_and_free(p), CT_EFORMAT, "header length 1000 runs past the end of the file (18 bytes)");
    b[7] = 0x80; /* 2^63 + 1000: no overflow in the comparison */
    write_bytes(p, b, 18);
    ASSERT_ERR(load_and_free(p), CT_EFORMAT, "runs past the end of the file");
    /* Header cut short: length says 20, file holds 10 header bytes. */
    p = make_st("cut.st", T1, "12345678", 8);
    size_t n;
    unsigned char *f = read_file(p, &n);
    write_bytes(p, f, 18);
    free(f);
    ASSERT_ERR(load_and_free(p), CT_EFORMAT, "runs past the end");
    /* Header length 0 and 1. */
    memset(b, 0, sizeof b);
    write_bytes(p, b, 8);
    ASSERT_ERR(load_and_free(p), CT_EFORMAT, "cannot hold a JSON object");
}

TEST(st_reader_rejects_huge_header_length)
{
    /* A sparse 101 MB file costs nothing on disk. */
    const char *p = tmp_path("huge.st");
    int fd = open(p, O_CREAT | O_TRUNC | O_WRONLY, 0600);
    ASSERT(fd >= 0);
    uint64_t len = (100u << 20) + 8;
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(len >> (8 * i));
    ASSERT_EQ(write(fd, b, 8), 8);
    ASSERT_EQ(ftruncate(fd, (off_t)(101u << 20)), 0);
    close(fd);
    ASSERT_ERR(load_and_free(p), CT_EFORMAT, "is over the 100 MB limit");
    unlink(p);
}

TEST(st_reader_rejects_bad_json)
{
    static const struct { const char *hdr, *msg; } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",}}", "header JSON: expected a string key at byte 20"},
        {"{\"a\":{\"dtype\":\"F32\"}", "unterminated object"},
        {"{\"a\" {}}", "expected ':' after a key"},
        {"[1,2]", "header is not a JSON object"},
        {"{}x", "trailing characters"},
        {"{\"a\":\"\x01\"}", "control character inside a string"},
        {"{\"a\":\"\\q\"}", "unknown escape"},
        {"{\"a\":\"\\u12G4\"}", "bad \\u escape"},
        {"{\"a\":\"\\udc00\"}", "lone low surrogate"},
        {"{\"a\":\"\\ud800x\"}", "high surrogate without its low half"},
        {"{\"a\":\"\\ud800\\u0041\"}", "bad low half"},
        {"{\"a\":\"\xc3\x28\"}", "not valid UTF-8 at byte 6"},
        {"{\"a\":\"\xed\xa0\x80\"}", "not valid UTF-8"},        /* encoded surrogate */
        {"{\"a\":\"\xc0\xaf\"}", "not valid UTF-8"},            /* overlong */
        {"{\"a\":01}", "leading zero"},
        {"{\"a\":1.5}", "not an integer"},
        {"{\"a\":1e3}", "not an integer"},
        {"{\"a\":-}", "bad number"},
        {"{\"a\":99999999999999999999}", "does not fit in 64 bits"},
        {"{\"a\":tru}", "unexpected character"},
        {"{\"a\":\"abc", "unterminated string"},
        {"{\"a\":[1,2}", "expected ',' or ']'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *p = make_st("json.st", cases[i].hdr, NULL, 0);
        ASSERT_ERR(load_and_free(p), CT_EFORMAT, cases[i].msg);
        ASSERT_STR_CONTAINS(ct_last_error(), p);
    }
    /* Deep nesting is refused, not a stack overflow. */
    char deep[4096] = "{\"a\":";
    size_t k = strlen(deep);
    for (int i = 0; i < 1000; i++) deep[k++] = '[';
    deep[k] = 0;
    ASSERT_ERR(load_and_free(make_st("deep.st", deep, NULL, 0)), CT_EFORMAT, "nesting deeper than 64");
}

TEST(st_reader_rejects_bad_tensor_entries)
{
    unsigned char data[64] = {0};
    static const struct { const char *hdr; size_t ndata; ct_status code; const char *msg; } cases[] = {
        {"{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT,
         "tensor 'a': unknown dtype 'F33'"},
        {"{\"a\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, CT_EUNSUPPORTED,
         "tensor 'a': dtype F64 is not supported"},
        {"{\"a\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT, "'dtype' is not a string"},
        {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT, "tensor 'a': missing field 'dtype'"},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, CT_EFORMAT, "missing field 'shape'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, CT_EFORMAT, "missing field 'data_offsets'"},
        {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT,
         "field 'dtype' appears twice"},
        {"{\"a\":[]}", 0, CT_EFORMAT, "tensor 'a': header entry is not an object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT,
         "tensor 'a': shape[0] is not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT, "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8, CT_EFORMAT, "'shape' is not an array"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}", 8, CT_EUNSUPPORTED,
         "shape has 7 dims"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,8]}}", 8,
         CT_EFORMAT, "shape [4294967296, 4294967296, 4294967296] overflows"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[0,4294967296,4294967296,4294967296],\"data_offsets\":[0,0]}}", 0,
         CT_EFORMAT, "overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, CT_EFORMAT,
         "'data_offsets' is not an array of two integers"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,-8]}}", 8, CT_EFORMAT, "non-negative"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 8, CT_EFORMAT,
         "data_offsets [8, 0] end before they begin"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8, CT_EFORMAT,
         "tensor 'a': data_offsets [0, 16] run past the end of the data section (8 bytes)"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT,
         "tensor 'a': shape [3] of F32 is 12 bytes but data_offsets [0, 8] hold 8"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, CT_EFORMAT,
         "tensors 'a' [0, 8) and 'b' [4, 12) overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT, "overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20, CT_EFORMAT,
         "bytes [8, 12) of the data section belong to no tensor"},
        {T1, 12, CT_EFORMAT, "the data section has 12 bytes but the tensors end at byte 8"},
        {"{}", 4, CT_EFORMAT, "the data section has 4 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16, CT_EFORMAT,
         "tensor name 'a' appears twice"},
        {"{\"a\\u0000b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, CT_EFORMAT,
         "tensor name contains a NUL"},
        {"{\"__metadata__\":{\"k\":1}," T1_ENTRY "}", 8, CT_EFORMAT, "__metadata__ value of 'k' is not a string"},
        {"{\"__metadata__\":[]," T1_ENTRY "}", 8, CT_EFORMAT, "__metadata__ is not an object"},
        {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}," T1_ENTRY "}", 8, CT_EFORMAT, "__metadata__ key 'k' appears twice"},
        {"{\"__metadata__\":{},\"__metadata__\":{}," T1_ENTRY "}", 8, CT_EFORMAT, "__metadata__ appears twice"},
        {"{\"__metadata__\":{\"k\":\"a\\u0000\"}," T1_ENTRY "}", 8, CT_EFORMAT, "contains a NUL"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *p = make_st("entry.st", cases[i].hdr, data, cases[i].ndata);
        ASSERT_ERR(load_and_free(p), cases[i].code, cases[i].msg);
        ASSERT_STR_CONTAINS(ct_last_error(), p);
    }
    /* The same entries made valid load, so the cases above fail for their stated reason. */
    ASSERT_OK(load_and_free(make_st("ok.st", T1, data, 8)));
    ASSERT_OK(load_and_free(make_st("ok2.st", "{\"a\":{\"dtype\":\"U8\",\"shape\":[0,4294967296,1024],"
                                              "\"data_offsets\":[0,0]}}", data, 0)));
}

/* ---- mutation fuzzing --------------------------------------------------- */

static uint64_t lcg(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

TEST(st_fuzz_mutations)
{
    ct_tensor *t[4];
    t[0] = ct_tensor_create2(2, 3, CT_MEM_OTHER);
    t[1] = ct_tensor_create(CT_BF16, 1, (int64_t[]){3}, CT_MEM_OTHER);
    t[2] = ct_tensor_create(CT_I64, 2, (int64_t[]){1, 2}, CT_MEM_OTHER);
    t[3] = ct_tensor_create(CT_U8, 1, (int64_t[]){5}, CT_MEM_OTHER);
    const char *src = tmp_path("fuzz_src.st"), *dst = "fuzz-case.st";
    ASSERT_OK(ct_safetensors_save(src, (const char *[]){"layer.0.weight", "b\\\"", "n", "u"}, t, 4,
                                  (const char *[]){"format", "\xc3\xa9"}, (const char *[]){"pt", "\"\\\n"}, 2));
    size_t n;
    unsigned char *orig = read_file(src, &n), *buf = malloc(n + 16);
    size_t hlen = orig[0] | (size_t)orig[1] << 8;
    static const char interesting[] = "{}[]\":,\\-0123456789 eu\x00\xff\x80";
    uint64_t seed = 12345;
    size_t base = ct_mem_current(CT_MEM_OTHER);
    int ok = 0, bad = 0;
    for (int it = 0; it < 15000; it++) {
        memcpy(buf, orig, n);
        size_t len = n;
        int mode = (int)(lcg(&seed) % 6), nmut = 1 + (int)(lcg(&seed) % 3);
        for (int m = 0; m < nmut; m++) {
            /* Mostly the header: that is where the parser lives. */
            size_t at = lcg(&seed) % 4 ? 8 + lcg(&seed) % hlen : lcg(&seed) % (len + 1);
            switch (mode) {
            case 0: buf[at] ^= (unsigned char)(1u << (lcg(&seed) % 8)); break;
            case 1: buf[at] = (unsigned char)interesting[lcg(&seed) % (sizeof interesting - 1)]; break;
            case 2: len = lcg(&seed) % n; break;
            case 3: buf[lcg(&seed) % 8] = (unsigned char)lcg(&seed); break;
            case 4: /* delete a byte */
                if (at < len) { memmove(buf + at, buf + at + 1, len - at - 1); len--; }
                break;
            default: /* duplicate a byte */
                if (at < len) { memmove(buf + at + 1, buf + at, len - at); len++; }
                break;
            }
            if (len > n + 8) len = n + 8;
        }
        /* Memory, not files: the parser is the same and thousands of cases stay fast.
         * Every 100th case also goes through a file. */
        ct_safetensors *st = NULL;
        ct_status s;
        if (it % 100 == 0) {
            write_bytes(tmp_path(dst), buf, len);
            s = ct_safetensors_load(tmp_path(dst), &st);
        } else {
            s = ct_safetensors_load_mem(buf, len, dst, &st);
        }
        if (s == CT_OK) {
            ok++;
            for (int i = 0; i < ct_safetensors_count(st); i++) {
                ct_tensor *x = ct_safetensors_tensor(st, i);
                ASSERT(ct_tensor_bytes(x) <= len);
            }
            ct_safetensors_destroy(st);
        } else {
            bad++;
            ASSERT(st == NULL);
            ASSERT(s == CT_EFORMAT || s == CT_EUNSUPPORTED);
            ASSERT_STR_CONTAINS(ct_last_error(), dst);
        }
        ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), base); /* error paths leak nothing */
    }
    printf("    fuzz: %d loaded, %d rejected\n", ok, bad);
    ASSERT(ok > 150 && bad > 7500);
    free(orig);
    free(buf);
    for (int i = 0; i < 4; i++) ct_tensor_release(t[i]);
}

TEST(st_load_from_memory)
{
    ct_tensor *a = ct_tensor_create(CT_I32, 2, (int64_t[]){2, 2}, CT_MEM_OTHER);
    for (int i = 0; i < 4; i++) ((int32_t *)ct_tensor_data(a))[i] = -7 * i;
    const char *path = tmp_path("mem.st");
    ASSERT_OK(ct_safetensors_save(path, (const char *[]){"m"}, &a, 1, (const char *[]){"k"}, (const char *[]){"v"}, 1));
    size_t n;
    unsigned char *f = read_file(path, &n);
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load_mem(f, n, "bcast", &st));
    ASSERT_EQ(memcmp(ct_tensor_data(ct_safetensors_find(st, "m")), ct_tensor_data(a), 16), 0);
    ASSERT(!strcmp(ct_safetensors_meta(st, "k"), "v"));
    ct_safetensors_destroy(st);
    ASSERT_ERR(ct_safetensors_load_mem(f, n - 1, "bcast", &st), CT_EFORMAT,
               "bcast: tensor 'm': data_offsets [0, 16] run past the end of the data section (15 bytes)");
    ASSERT_ERR(ct_safetensors_load_mem(NULL, 0, "empty", &st), CT_EFORMAT, "empty: file is 0 bytes");
    ASSERT(st == NULL);
    free(f);
    ct_tensor_release(a);
}

/* A large tensor goes through one read, not per-element work. */
TEST(st_large_tensor)
{
    int64_t numel = 32 << 20; /* 128 MB of f32 */
    ct_tensor *a = ct_tensor_create1(numel, CT_MEM_OTHER);
    float *p = ct_f32(a);
    for (int64_t i = 0; i < numel; i += 4096) p[i] = (float)i;
    p[numel - 1] = 42.0f;
    const char *path = tmp_path("large.st");
    ASSERT_OK(ct_safetensors_save(path, (const char *[]){"big"}, &a, 1, NULL, NULL, 0));
    ct_tensor_release(a);
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(path, &st));
    const float *q = ct_f32(ct_safetensors_find(st, "big"));
    for (int64_t i = 0; i < numel - 1; i += 4096) ASSERT_EQ(q[i], (float)i);
    ASSERT_EQ(q[numel - 1], 42.0f);
    ct_safetensors_destroy(st);
    unlink(path);
}

/* ---- sharded checkpoints (index + shards) ------------------------------- */

#include <dirent.h>

/* Removes dir and the files in it (one level: the tests below make no deeper trees). */
static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[1024];
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
    closedir(d);
    rmdir(dir);
}

/* A fresh directory under the test's scratch directory. */
static const char *fresh_dir(const char *name)
{
    const char *d = tmp_path(name);
    remove_dir(d);
    ASSERT_EQ(mkdir(d, 0700), 0);
    return d;
}

static void write_text(const char *path, const char *text) { write_bytes(path, text, strlen(text)); }

/* Three shards a.safetensors {w, b}, b.safetensors {emb, steps}, c.safetensors {z}
 * in dir, each with metadata of its own that the index's replaces. */
static void make_shards(const char *dir, ct_tensor **t)
{
    t[0] = ct_tensor_create2(3, 4, CT_MEM_OTHER);                          /* w */
    t[1] = ct_tensor_create1(3, CT_MEM_OTHER);                             /* b */
    t[2] = ct_tensor_create(CT_BF16, 2, (int64_t[]){2, 2}, CT_MEM_OTHER); /* emb */
    t[3] = ct_tensor_create(CT_I64, 1, (int64_t[]){1}, CT_MEM_OTHER);     /* steps */
    t[4] = ct_tensor_create(CT_U8, 1, (int64_t[]){0}, CT_MEM_OTHER);      /* z, empty */
    for (int i = 0; i < 12; i++) ct_f32(t[0])[i] = (float)i * 0.5f - 2.0f;
    for (int i = 0; i < 3; i++) ct_f32(t[1])[i] = (float)-i;
    for (int i = 0; i < 4; i++) ((uint16_t *)ct_tensor_data(t[2]))[i] = ct_f32_to_bf16((float)i + 0.25f);
    ((int64_t *)ct_tensor_data(t[3]))[0] = 1234567890123;
    char p[600];
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    ASSERT_OK(ct_safetensors_save(p, (const char *[]){"w", "b"}, t, 2, (const char *[]){"shard"},
                                  (const char *[]){"a"}, 1));
    snprintf(p, sizeof p, "%s/b.safetensors", dir);
    ASSERT_OK(ct_safetensors_save(p, (const char *[]){"emb", "steps"}, t + 2, 2, NULL, NULL, 0));
    snprintf(p, sizeof p, "%s/c.safetensors", dir);
    ASSERT_OK(ct_safetensors_save(p, (const char *[]){"z"}, t + 4, 1, (const char *[]){"format"},
                                  (const char *[]){"pt"}, 1));
}

static const char *const SH_NAMES[] = {"w", "b", "emb", "steps", "z"};
static const char *const SH_FILES[] = {"a.safetensors", "a.safetensors", "b.safetensors", "b.safetensors",
                                       "c.safetensors"};

static void check_merged(const ct_safetensors *st, ct_tensor **t)
{
    ASSERT_EQ(ct_safetensors_count(st), 5);
    const char *sorted[] = {"b", "emb", "steps", "w", "z"};
    for (int i = 0; i < 5; i++) ASSERT(!strcmp(ct_safetensors_name(st, i), sorted[i]));
    for (int i = 0; i < 5; i++) {
        ct_tensor *g = ct_safetensors_find(st, SH_NAMES[i]);
        ASSERT(g != NULL);
        ASSERT(ct_tensor_same_shape(g, t[i]));
        ASSERT_EQ(memcmp(ct_tensor_data(g), ct_tensor_data(t[i]), ct_tensor_bytes(t[i])), 0);
    }
    ASSERT_EQ(ct_safetensors_meta_count(st), 2); /* the index's, not the shards' */
    ASSERT(!strcmp(ct_safetensors_meta(st, "total_size"), "76"));
    ASSERT(!strcmp(ct_safetensors_meta(st, "ctrain.step"), "7"));
    ASSERT(ct_safetensors_meta(st, "shard") == NULL);
}

TEST(st_index_roundtrip)
{
    const char *dir = fresh_dir("sharded");
    ct_tensor *t[5];
    make_shards(dir, t);
    char idx[600], exact[4096];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    ASSERT_OK(ct_safetensors_save_index(idx, SH_NAMES, SH_FILES, 5, (const char *[]){"total_size", "ctrain.step"},
                                        (const char *[]){"76", "7"}, 2));
    /* Hugging Face's layout: indented, keys sorted. */
    size_t n;
    char *text = (char *)read_file(idx, &n);
    text[n] = 0;
    snprintf(exact, sizeof exact, "{\n  \"metadata\": {\n    \"ctrain.step\": \"7\",\n    \"total_size\": \"76\"\n  },\n"
             "  \"weight_map\": {\n    \"b\": \"a.safetensors\",\n    \"emb\": \"b.safetensors\",\n"
             "    \"steps\": \"b.safetensors\",\n    \"w\": \"a.safetensors\",\n    \"z\": \"c.safetensors\"\n  }\n}\n");
    ASSERT(!strcmp(text, exact));
    free(text);

    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(idx, &st)); /* the index */
    check_merged(st, t);
    ct_tensor *keep = ct_tensor_retain(ct_safetensors_find(st, "w"));
    ct_safetensors_destroy(st);
    ASSERT_EQ(ct_f32(keep)[11], 3.5f); /* a tensor outlives the object when retained */
    ct_tensor_release(keep);
    ASSERT_OK(ct_safetensors_load(dir, &st)); /* its directory */
    check_merged(st, t);
    ct_safetensors_destroy(st);
    char slash[600];
    snprintf(slash, sizeof slash, "%s/", dir);
    ASSERT_OK(ct_safetensors_load(slash, &st));
    check_merged(st, t);
    ct_safetensors_destroy(st);

    /* Beside a second index, the directory means model.safetensors.index.json. */
    char other[600];
    snprintf(other, sizeof other, "%s/optim.safetensors.index.json", dir);
    ASSERT_OK(ct_safetensors_save_index(other, (const char *[]){"steps"}, (const char *[]){"b.safetensors"}, 1,
                                        NULL, NULL, 0));
    ASSERT_OK(ct_safetensors_load(dir, &st));
    check_merged(st, t);
    ct_safetensors_destroy(st);
    /* A shard may be listed only in part of the files: the optim index reads b alone... no: b holds
     * emb too, which this index does not list. */
    ASSERT_ERR(load_and_free(other), CT_EFORMAT, "holds tensor 'emb', which");
    /* The only index of a directory is its model index, whatever its name. */
    ASSERT_EQ(unlink(idx), 0);
    ASSERT_EQ(rename(other, idx), 0);
    snprintf(other, sizeof other, "%s/weights.safetensors.index.json", dir);
    ASSERT_EQ(rename(idx, other), 0);
    ASSERT_OK(ct_safetensors_save_index(other, SH_NAMES, SH_FILES, 5, NULL, NULL, 0));
    ASSERT_OK(ct_safetensors_load(dir, &st));
    ASSERT_EQ(ct_safetensors_count(st), 5);
    ASSERT_EQ(ct_safetensors_meta_count(st), 0);
    ct_safetensors_destroy(st);

    /* Hugging Face writes total_size as an integer; other members are ignored. */
    snprintf(idx, sizeof idx, "%s/hf.safetensors.index.json", dir);
    write_text(idx, "{\"metadata\": {\"total_size\": 76, \"format\": \"pt\"}, \"extra\": [1, {}],"
                    " \"weight_map\": {\"z\": \"c.safetensors\", \"w\": \"a.safetensors\", \"b\": \"a.safetensors\"}}");
    ASSERT_OK(ct_safetensors_load(idx, &st));
    ASSERT_EQ(ct_safetensors_count(st), 3);
    ASSERT(!strcmp(ct_safetensors_meta(st, "total_size"), "76"));
    ASSERT(!strcmp(ct_safetensors_meta_key(st, 0), "format"));
    ct_safetensors_destroy(st);
    /* Two indexes, neither the model's: the caller must choose. */
    ASSERT_ERR(load_and_free(dir), CT_EINVAL, "none is model.safetensors.index.json; pass the index file itself");
    /* No metadata, no tensors: an empty checkpoint. */
    write_text(idx, "{\"weight_map\": {}}");
    ASSERT_OK(ct_safetensors_load(idx, &st));
    ASSERT_EQ(ct_safetensors_count(st), 0);
    ASSERT_EQ(ct_safetensors_meta_count(st), 0);
    ct_safetensors_destroy(st);
    for (int i = 0; i < 5; i++) ct_tensor_release(t[i]);
    remove_dir(dir);
    /* A directory without an index. */
    dir = fresh_dir("no-index");
    ASSERT_ERR(load_and_free(dir), CT_EIO, "is a directory without a sharded checkpoint index");
    ASSERT_STR_CONTAINS(ct_last_error(), dir);
    remove_dir(dir);
    rmdir(ct_test_tmpdir()); /* empty unless another test left files */
}

TEST(st_index_writer_rejects_bad_input)
{
    const char *dir = fresh_dir("bad-index-in");
    char idx[600];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    const char *f1[] = {"a.safetensors"};
    static const struct { const char *file, *msg; } bad_files[] = {
        {"../a.safetensors", "contains a path separator"}, {"..", "contains '..'"},
        {"/etc/passwd", "contains a path separator"}, {"a\\b", "contains a path separator"},
        {"", "is empty"}, {".", "names a directory"}, {"x..y", "contains '..'"},
    };
    for (size_t i = 0; i < sizeof bad_files / sizeof bad_files[0]; i++) {
        ASSERT_ERR(ct_safetensors_save_index(idx, (const char *[]){"w"}, &bad_files[i].file, 1, NULL, NULL, 0),
                   CT_EINVAL, bad_files[i].msg);
        ASSERT_STR_CONTAINS(ct_last_error(), "tensor 'w' is in file");
    }
    ASSERT_ERR(ct_safetensors_save_index(idx, (const char *[]){"w", "w"}, (const char *[]){"a", "b"}, 2, NULL, NULL, 0),
               CT_EINVAL, "tensor name 'w' is given twice");
    ASSERT_ERR(ct_safetensors_save_index(idx, (const char *[]){"w"}, f1, 1, (const char *[]){"k", "k"},
                                         (const char *[]){"1", "2"}, 2),
               CT_EINVAL, "metadata key 'k' is given twice");
    ASSERT_ERR(ct_safetensors_save_index(idx, (const char *[]){"w\xff"}, f1, 1, NULL, NULL, 0), CT_EINVAL,
               "not valid UTF-8");
    ASSERT_ERR(ct_safetensors_save_index(idx, (const char *[]){"w"}, f1, 1, (const char *[]){"k"},
                                         (const char *[]){"\xc0\xaf"}, 1),
               CT_EINVAL, "metadata value");
    char wrong[600];
    snprintf(wrong, sizeof wrong, "%s/model.json", dir);
    ASSERT_ERR(ct_safetensors_save_index(wrong, (const char *[]){"w"}, f1, 1, NULL, NULL, 0), CT_EINVAL,
               "must end in '.safetensors.index.json'");
    ASSERT_ERR(ct_safetensors_save_index("/nonexistent-dir/m.safetensors.index.json", (const char *[]){"w"}, f1, 1,
                                         NULL, NULL, 0),
               CT_EIO, "cannot create");
    DIR *d = opendir(dir); /* nothing written, no temp file left */
    ASSERT(d);
    struct dirent *e;
    int files = 0;
    while ((e = readdir(d))) files += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    ASSERT_EQ(files, 0);
    remove_dir(dir);
    rmdir(ct_test_tmpdir()); /* empty unless another test left files */
}

/* Each broken index or shard set: the error names the file and the cause. */
TEST(st_index_rejects_bad_checkpoints)
{
    const char *dir = fresh_dir("bad-index");
    ct_tensor *t[5];
    make_shards(dir, t);
    char idx[600];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
#define WM_OK "\"w\":\"a.safetensors\",\"b\":\"a.safetensors\",\"emb\":\"b.safetensors\",\"steps\":\"b.safetensors\""
    static const struct { const char *text; ct_status code; const char *msg; } cases[] = {
        /* the shard set disagrees with the index */
        {"{\"weight_map\":{" WM_OK ",\"z\":\"gone.safetensors\"}}", CT_EIO,
         "lists shard file 'gone.safetensors' (1 tensor, such as 'z'), but "},
        {"{\"weight_map\":{" WM_OK ",\"z\":\"c.safetensors\",\"q\":\"c.safetensors\"}}", CT_EFORMAT,
         "puts tensor 'q' in "},
        {"{\"weight_map\":{\"w\":\"a.safetensors\",\"emb\":\"b.safetensors\",\"steps\":\"b.safetensors\"}}", CT_EFORMAT,
         "holds tensor 'b', which "},
        {"{\"weight_map\":{" WM_OK ",\"z\":\"a.safetensors\"}}", CT_EFORMAT, "puts tensor 'z' in "},
        {"{\"weight_map\":{\"w\":\"a.safetensors\",\"b\":\"b.safetensors\",\"emb\":\"b.safetensors\","
         "\"steps\":\"b.safetensors\"}}", CT_EFORMAT, "holds tensor 'b', which "},
        {"{\"weight_map\":{" WM_OK ",\"z\":\"c.safetensors\",\"w\":\"a.safetensors\"}}", CT_EFORMAT,
         "weight_map lists tensor 'w' twice"},
        /* file names that would leave the directory */
        {"{\"weight_map\":{\"z\":\"../c.safetensors\"}}", CT_EFORMAT, "contains a path separator"},
        {"{\"weight_map\":{\"z\":\"/etc/passwd\"}}", CT_EFORMAT, "contains a path separator"},
        {"{\"weight_map\":{\"z\":\"..\"}}", CT_EFORMAT, "contains '..'"},
        {"{\"weight_map\":{\"z\":\"\"}}", CT_EFORMAT, "is empty"},
        {"{\"weight_map\":{\"z\":\"c.safetensors\\u0000x\"}}", CT_EFORMAT, "contains a NUL"},
        /* malformed */
        {"", CT_EFORMAT, "index JSON: unexpected end of text at byte 0"},
        {"{\"weight_map\":{\"z\":\"c.safetensors\"", CT_EFORMAT, "index JSON: unterminated object"},
        {"{\"weight_map\":{\"z\":\"c.safetensors\",}}", CT_EFORMAT, "index JSON: expected a string key"},
        {"[\"weight_map\"]", CT_EFORMAT, "the index is not a JSON object"},
        {"{\"metadata\":{}}", CT_EFORMAT, "the index has no \"weight_map\""},
        {"{\"weight_map\":[\"c.safetensors\"]}", CT_EFORMAT, "\"weight_map\" is not an object"},
        {"{\"weight_map\":{},\"weight_map\":{}}", CT_EFORMAT, "\"weight_map\" appears twice"},
        {"{\"metadata\":[],\"weight_map\":{}}", CT_EFORMAT, "\"metadata\" is not an object"},
        {"{\"metadata\":{\"k\":[1]},\"weight_map\":{}}", CT_EFORMAT,
         "metadata value of 'k' is neither a string nor an integer"},
        {"{\"metadata\":{\"total_size\":1.5},\"weight_map\":{}}", CT_EFORMAT, "not an integer"},
        {"{\"metadata\":{\"k\":\"1\",\"k\":\"2\"},\"weight_map\":{}}", CT_EFORMAT, "key 'k' appears twice"},
        {"{\"weight_map\":{\"z\":7}}", CT_EFORMAT, "weight_map entry of tensor 'z' is not a file name"},
        {"{\"weight_map\":{\"z\\u0000\":\"c.safetensors\"}}", CT_EFORMAT, "tensor name contains a NUL"},
        {"{\"weight_map\":{\"z\":\"c.safetensors\"}}\xff", CT_EFORMAT, "index JSON is not valid UTF-8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_text(idx, cases[i].text);
        ASSERT_ERR(load_and_free(idx), cases[i].code, cases[i].msg);
        ASSERT_STR_CONTAINS(ct_last_error(), idx);
    }
    /* The missing file is named with its path, and the fix is said. */
    write_text(idx, cases[0].text);
    ASSERT_ERR(load_and_free(dir), CT_EIO, "/gone.safetensors is missing; the checkpoint is incomplete");
    /* A shard that is itself broken: its own message, and which index it belongs to. */
    char c[600];
    snprintf(c, sizeof c, "%s/c.safetensors", dir);
    write_bytes(c, "\x08\x00\x00", 3);
    write_text(idx, "{\"weight_map\":{" WM_OK ",\"z\":\"c.safetensors\"}}");
    ASSERT_ERR(load_and_free(idx), CT_EFORMAT, "too short for the 8-byte header length");
    ASSERT_STR_CONTAINS(ct_last_error(), c);
    ASSERT_STR_CONTAINS(ct_last_error(), "(a shard of ");
    /* The same index over sound shards loads, so every case above failed for its stated reason. */
    ASSERT_OK(ct_safetensors_save(c, (const char *[]){"z"}, t + 4, 1, NULL, NULL, 0));
    ASSERT_OK(load_and_free(idx));
    ASSERT_ERR(load_and_free(tmp_path("missing.safetensors.index.json")), CT_EIO, "cannot open");
#undef WM_OK
    for (int i = 0; i < 5; i++) ct_tensor_release(t[i]);
    remove_dir(dir);
    rmdir(ct_test_tmpdir()); /* empty unless another test left files */
}

/* Allocation failures while writing and reading an index: ENOMEM, no leak. */
TEST(st_index_alloc_failures)
{
    const char *dir = fresh_dir("oom-index");
    ct_tensor *t[5];
    make_shards(dir, t);
    char idx[600];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    size_t base = ct_mem_current(CT_MEM_OTHER);
    int saved = 0, loaded = 0;
    for (long k = 0; k < 100 && !saved; k++) {
        ct_mem_fail_after(k);
        ct_status s = ct_safetensors_save_index(idx, SH_NAMES, SH_FILES, 5, (const char *[]){"total_size", "ctrain.step"},
                                                (const char *[]){"76", "7"}, 2);
        ct_mem_fail_after(-1);
        ASSERT(s == CT_OK || s == CT_ENOMEM);
        ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), base);
        saved = s == CT_OK;
    }
    ASSERT(saved);
    for (long k = 0; k < 200 && !loaded; k++) {
        ct_safetensors *st = NULL;
        ct_mem_fail_after(k);
        ct_status s = ct_safetensors_load(dir, &st);
        ct_mem_fail_after(-1);
        ASSERT(s == CT_OK || s == CT_ENOMEM);
        loaded = s == CT_OK;
        if (loaded) check_merged(st, t);
        ct_safetensors_destroy(st);
        ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), base);
    }
    ASSERT(loaded);
    for (int i = 0; i < 5; i++) ct_tensor_release(t[i]);
    remove_dir(dir);
    rmdir(ct_test_tmpdir()); /* empty unless another test left files */
}

/* Corrupted indexes (bytes flipped, replaced, cut, deleted): each loads or is
 * refused with the index or a shard named, never a crash or a leak. */
TEST(st_index_fuzz_mutations)
{
    const char *dir = fresh_dir("fuzz-index");
    ct_tensor *t[5];
    make_shards(dir, t);
    char idx[600];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    ASSERT_OK(ct_safetensors_save_index(idx, SH_NAMES, SH_FILES, 5, (const char *[]){"total_size"},
                                        (const char *[]){"76"}, 1));
    size_t n;
    unsigned char *orig = read_file(idx, &n), *buf = malloc(n + 16);
    static const char interesting[] = "{}[]\":,\\/.-0123456789 abc\x00\xff";
    uint64_t seed = 777;
    size_t base = ct_mem_current(CT_MEM_OTHER);
    int ok = 0, bad = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(buf, orig, n);
        size_t len = n;
        int mode = (int)(lcg(&seed) % 4), nmut = 1 + (int)(lcg(&seed) % 3);
        for (int m = 0; m < nmut; m++) {
            size_t at = lcg(&seed) % len;
            switch (mode) {
            case 0: buf[at] ^= (unsigned char)(1u << (lcg(&seed) % 8)); break;
            case 1: buf[at] = (unsigned char)interesting[lcg(&seed) % (sizeof interesting - 1)]; break;
            case 2: len = 1 + lcg(&seed) % n; break;
            default: memmove(buf + at, buf + at + 1, len - at - 1); len--; break;
            }
        }
        write_bytes(idx, buf, len);
        ct_safetensors *st = NULL;
        ct_status s = ct_safetensors_load(idx, &st);
        if (s == CT_OK) {
            ok++;
            ASSERT(ct_safetensors_count(st) <= 5);
            ct_safetensors_destroy(st);
        } else {
            bad++;
            ASSERT(st == NULL);
            ASSERT(s == CT_EFORMAT || s == CT_EIO);
            ASSERT_STR_CONTAINS(ct_last_error(), dir);
        }
        ASSERT_EQ(ct_mem_current(CT_MEM_OTHER), base);
    }
    printf("    fuzz: %d loaded, %d rejected\n", ok, bad);
    ASSERT(ok > 30 && bad > 1500);
    free(orig);
    free(buf);
    for (int i = 0; i < 5; i++) ct_tensor_release(t[i]);
    remove_dir(dir);
    rmdir(ct_test_tmpdir()); /* empty unless another test left files */
}

/* A bit flipped in a tensor's data is caught on load, naming the tensor. */
TEST(st_checksum_catches_a_flipped_bit)
{
    ct_tensor *a = ct_tensor_create1(4, CT_MEM_OTHER), *b = ct_tensor_create1(3, CT_MEM_OTHER);
    for (int i = 0; i < 4; i++) ct_f32(a)[i] = (float)i;
    for (int i = 0; i < 3; i++) ct_f32(b)[i] = -(float)i;
    const char *path = tmp_path("crc.safetensors");
    ASSERT_OK(ct_safetensors_save(path, (const char *[]){"a", "b"}, (ct_tensor *[]){a, b}, 2, NULL, NULL, 0));
    int checked, unchecked;
    ASSERT_OK(ct_safetensors_verify(path, &checked, &unchecked));
    ASSERT_EQ(checked, 2);
    ASSERT_EQ(unchecked, 0);
    size_t n;
    unsigned char *f = read_file(path, &n);
    f[n - 1] ^= 0x10; /* the last byte is in "a" (layout: by size, then name; a before b) */
    write_bytes(path, f, n);
    free(f);
    ct_safetensors *st;
    ASSERT_ERR(ct_safetensors_load(path, &st), CT_EFORMAT, "fails its checksum");
    ASSERT_STR_CONTAINS(ct_last_error(), "crc.safetensors");
    ASSERT_ERR(ct_safetensors_verify(path, &checked, &unchecked), CT_EFORMAT, "tensor 'b'");
    ct_tensor_release(a);
    ct_tensor_release(b);
}

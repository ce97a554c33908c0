/* safetensors interoperability with PyTorch: scripts/st_check.py (torch,
 * json and the format by hand, no safetensors package) writes a file that
 * ctrain must read value for value, and reads a file ctrain wrote.  Skipped
 * with a note when /usr/bin/python3 has no torch or the script is absent
 * (tests run from the repository root). */
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ctrain/io.h"
#include "test.h"

#define PY "/usr/bin/python3"
#define SCRIPT "scripts/st_check.py"

/* Runs the script; returns its exit code (3: no torch), output in out. */
static int run_script(const char *mode, const char *path, char *out, size_t cap)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s %s %s '%s' 2>&1", PY, SCRIPT, mode, path);
    FILE *p = popen(cmd, "r");
    ASSERT(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Skips the test unless the interpreter and the script are there. */
static void require_script(void)
{
    if (access(PY, X_OK) != 0 || access(SCRIPT, R_OK) != 0)
        SKIP("needs %s and %s (run from the repository root)", PY, SCRIPT);
}

static void tmp_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s", ct_test_tmpdir(), name);
}

static void expect_meta(const ct_safetensors *st, const char *key, const char *val)
{
    const char *v = ct_safetensors_meta(st, key);
    ASSERT(v != NULL);
    ASSERT(!strcmp(v, val));
}

TEST(pytorch_writes_ctrain_reads)
{
    require_script();
    char path[512], out[4096];
    tmp_path(path, sizeof path, "from_torch.safetensors");
    int rc = run_script("write", path, out, sizeof out);
    if (rc == 3) SKIP("%s cannot import torch", PY);
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "st_check.py write failed (%d): %s", rc, out);
    ct_safetensors *st;
    ASSERT_OK(ct_safetensors_load(path, &st));
    ASSERT_EQ(ct_safetensors_count(st), 8);

    ct_tensor *t = ct_safetensors_find(st, "model.layers.0.weight");
    ASSERT(t && t->dtype == CT_F32 && t->ndim == 2 && t->shape[0] == 3 && t->shape[1] == 4);
    for (int i = 0; i < 12; i++) ASSERT_EQ(ct_f32(t)[i], i * 0.5f - 1.0f);

    t = ct_safetensors_find(st, "bf16");
    ASSERT(t && t->dtype == CT_BF16 && t->ndim == 1 && t->shape[0] == 4);
    const float bf[4] = {1.5f, -2.25f, 3072.0f, 0.0078125f};
    for (int i = 0; i < 4; i++) ASSERT_EQ(ct_bf16_to_f32(((uint16_t *)ct_tensor_data(t))[i]), bf[i]);

    t = ct_safetensors_find(st, "f16");
    ASSERT(t && t->dtype == CT_F16 && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 2);
    const float hf[4] = {0.5f, -1.0f, 65504.0f, 5.9604644775390625e-08f};
    for (int i = 0; i < 4; i++) ASSERT_EQ(ct_f16_to_f32(((uint16_t *)ct_tensor_data(t))[i]), hf[i]);

    t = ct_safetensors_find(st, "i64");
    ASSERT(t && t->dtype == CT_I64 && t->numel == 4);
    const int64_t i64[4] = {0, -1, ((int64_t)1 << 40) + 3, -((int64_t)1 << 62)};
    for (int i = 0; i < 4; i++) ASSERT_EQ(((int64_t *)ct_tensor_data(t))[i], i64[i]);

    t = ct_safetensors_find(st, "i32");
    ASSERT(t && t->dtype == CT_I32 && t->ndim == 2 && t->shape[0] == 1 && t->shape[1] == 3);
    const int32_t i32[3] = {INT32_MIN, INT32_MAX, 7};
    for (int i = 0; i < 3; i++) ASSERT_EQ(((int32_t *)ct_tensor_data(t))[i], i32[i]);

    t = ct_safetensors_find(st, "u8");
    ASSERT(t && t->dtype == CT_U8 && t->numel == 5);
    const uint8_t u8[5] = {0, 1, 127, 128, 255};
    ASSERT_EQ(memcmp(ct_tensor_data(t), u8, 5), 0);

    t = ct_safetensors_find(st, "scalar");
    ASSERT(t && t->dtype == CT_F32 && t->ndim == 0 && t->numel == 1);
    ASSERT_EQ(ct_f32(t)[0], 3.25f);

    t = ct_safetensors_find(st, "empty");
    ASSERT(t && t->dtype == CT_I32 && t->ndim == 2 && t->shape[0] == 0 && t->shape[1] == 3);

    ASSERT_EQ(ct_safetensors_meta_count(st), 3);
    expect_meta(st, "format", "pt");
    expect_meta(st, "note", "quote \" backslash \\ newline \n tab \t \xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x98\x80");
    expect_meta(st, "ctl", "\x01");
    ct_safetensors_destroy(st);
}

static void hex(const char *s, char *out)
{
    for (; *s; s++, out += 2) sprintf(out, "%02x", (unsigned char)*s);
    *out = 0;
}

TEST(ctrain_writes_pytorch_reads)
{
    require_script();
    enum { NT = 7 };
    const char *names[NT] = {"w", "h.bf16", "h.f16", "steps", "ids", "bytes", "s"};
    ct_tensor *t[NT];
    t[0] = ct_tensor_create2(4, 5, CT_MEM_OTHER);
    t[1] = ct_tensor_create(CT_BF16, 2, (int64_t[]){3, 2}, CT_MEM_OTHER);
    t[2] = ct_tensor_create(CT_F16, 1, (int64_t[]){5}, CT_MEM_OTHER);
    t[3] = ct_tensor_create(CT_I64, 1, (int64_t[]){3}, CT_MEM_OTHER);
    t[4] = ct_tensor_create(CT_I32, 3, (int64_t[]){2, 1, 2}, CT_MEM_OTHER);
    t[5] = ct_tensor_create(CT_U8, 1, (int64_t[]){9}, CT_MEM_OTHER);
    t[6] = ct_tensor_create(CT_F32, 0, NULL, CT_MEM_OTHER);
    /* Sums computed here in double, independently of any reader. */
    double sums[NT] = {0};
    for (int i = 0; i < 20; i++) sums[0] += ct_f32(t[0])[i] = (float)(i - 7) * 0.125f;
    for (int i = 0; i < 6; i++) {
        ((uint16_t *)ct_tensor_data(t[1]))[i] = ct_f32_to_bf16((float)i * -1.75f);
        sums[1] += ct_bf16_to_f32(((uint16_t *)ct_tensor_data(t[1]))[i]);
    }
    for (int i = 0; i < 5; i++) {
        ((uint16_t *)ct_tensor_data(t[2]))[i] = ct_f32_to_f16((float)i / 8.0f + 1000.0f);
        sums[2] += ct_f16_to_f32(((uint16_t *)ct_tensor_data(t[2]))[i]);
    }
    const int64_t steps[3] = {1, (int64_t)1 << 35, -12345};
    memcpy(ct_tensor_data(t[3]), steps, sizeof steps);
    sums[3] = 1.0 + 34359738368.0 - 12345.0;
    for (int i = 0; i < 4; i++) sums[4] += ((int32_t *)ct_tensor_data(t[4]))[i] = -100000 * (i + 1);
    for (int i = 0; i < 9; i++) sums[5] += ((uint8_t *)ct_tensor_data(t[5]))[i] = (uint8_t)(200 + i * 7);
    sums[6] = ct_f32(t[6])[0] = -0.75f;
    const char *shapes[NT] = {"[4, 5]", "[3, 2]", "[5]", "[3]", "[2, 1, 2]", "[9]", "[]"};
    const char *mk[] = {"format", "weird"}, *mv[] = {"pt", "\"q\" \\b\\ \n\t \xc3\xa9\xe2\x9c\x93\xf0\x9f\x98\x80 \x02"};

    char path[512], out[8192];
    tmp_path(path, sizeof path, "from_ctrain.safetensors");
    ASSERT_OK(ct_safetensors_save(path, names, t, NT, mk, mv, 2));
    int rc = run_script("read", path, out, sizeof out);
    if (rc == 3) {
        for (int i = 0; i < NT; i++) ct_tensor_release(t[i]);
        SKIP("%s cannot import torch", PY);
    }
    if (rc != 0) ct_test_fail(__FILE__, __LINE__, "st_check.py read failed (%d): %s", rc, out);
    int seen = 0, seen_meta = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "meta ", 5)) {
            char k[256], v[1024], want[1024];
            ASSERT_EQ(sscanf(line + 5, "%255s %1023s", k, v), 2);
            for (int i = 0; i < 2; i++) {
                char hk[256];
                hex(mk[i], hk);
                if (strcmp(hk, k)) continue;
                hex(mv[i], want);
                ASSERT(!strcmp(v, want));
                seen_meta++;
            }
            continue;
        }
        char name[64], dt[8], *lb = strchr(line, '['), *rb = strchr(line, ']');
        ASSERT(lb && rb);
        ASSERT_EQ(sscanf(line, "%63s %7s", name, dt), 2);
        double sum = atof(rb + 1);
        int i = 0;
        while (i < NT && strcmp(names[i], name)) i++;
        if (i == NT) ct_test_fail(__FILE__, __LINE__, "python reported an unknown tensor: %s", line);
        ASSERT(!strcmp(dt, ct_dtype_name(t[i]->dtype)));
        ASSERT_EQ((long)(rb + 1 - lb), (long)strlen(shapes[i]));
        ASSERT_EQ(strncmp(lb, shapes[i], strlen(shapes[i])), 0);
        ASSERT_CLOSE(sum, sums[i], 1e-12, 1e-9);
        seen++;
    }
    ASSERT_EQ(seen, NT);
    ASSERT_EQ(seen_meta, 2);
    for (int i = 0; i < NT; i++) ct_tensor_release(t[i]);
}

/* Fuzz target: sharded-checkpoint indexes.  Each input is written as
 * DIR/model.safetensors.index.json beside two real shards (a.safetensors
 * holding "x" and "y", b.safetensors holding "z") and loaded as a whole
 * checkpoint, so the index's JSON, its weight map and its checks against
 * the shards (missing, duplicated or unlisted tensors, file names that
 * leave the directory) all run. */
#include "fuzz.h"

static char dir[64];

static void setup(void)
{
    snprintf(dir, sizeof dir, "/dev/shm/ctrain-fuzz-index-%d", (int)getpid());
    mkdir(dir, 0700);
    ct_tensor *t[3];
    for (int i = 0; i < 3; i++) {
        t[i] = ct_tensor_create1(4, CT_MEM_OTHER);
        for (int k = 0; k < 4; k++) ct_f32(t[i])[k] = (float)(i * 4 + k);
    }
    char p[128];
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    if (ct_safetensors_save(p, (const char *[]){"x", "y"}, t, 2, NULL, NULL, 0) != CT_OK) abort();
    snprintf(p, sizeof p, "%s/b.safetensors", dir);
    if (ct_safetensors_save(p, (const char *[]){"z"}, t + 2, 1, NULL, NULL, 0) != CT_OK) abort();
    for (int i = 0; i < 3; i++) ct_tensor_release(t[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    if (!dir[0]) setup();
    char p[128];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(p, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) abort();
    size_t before = fuzz_mem_now();
    ct_safetensors *st = NULL;
    if (ct_safetensors_load(p, &st) == CT_OK) ct_safetensors_destroy(st);
    else if (st) abort();
    fuzz_check_no_leak(before);
    return 0;
}

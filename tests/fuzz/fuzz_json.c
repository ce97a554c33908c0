/* Fuzz target: the strict JSON parser behind safetensors headers and
 * sharded-checkpoint indexes (src/io/json.c). */
#include "fuzz.h"
#include "io/internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    size_t before = fuzz_mem_now();
    ct__json_doc doc;
    memset(&doc, 0, sizeof doc);
    if (ct__json_parse((const char *)data, n, "fuzz", &doc) == CT_OK && doc.n < 1) abort();
    ct__json_free(&doc);
    fuzz_check_no_leak(before);
    return 0;
}

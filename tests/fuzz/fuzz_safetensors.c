/* Fuzz target: the safetensors reader on arbitrary bytes (header JSON,
 * dtypes, shapes, offsets, checksums), through ct_safetensors_load_mem. */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    size_t before = fuzz_mem_now();
    ct_safetensors *st = NULL;
    if (ct_safetensors_load_mem(data, n, "fuzz.safetensors", &st) == CT_OK) {
        for (int i = 0; i < ct_safetensors_count(st); i++) (void)ct_tensor_bytes(ct_safetensors_tensor(st, i));
        ct_safetensors_destroy(st);
    } else if (st || !ct_last_error()[0]) {
        abort(); /* a failure leaves no object and says why */
    }
    fuzz_check_no_leak(before);
    return 0;
}

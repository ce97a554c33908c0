/* Fuzz target: the IDX data-set reader (plain or gzip'd images and labels).
 * The first two bytes say where the image file ends and the label file
 * starts in the rest of the input. */
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    static int fd_img = -1, fd_lab = -1;
    if (n < 2) return 0;
    size_t split = ((size_t)data[0] | (size_t)data[1] << 8) % (n - 1);
    char ip[64], lp[64];
    fuzz_memfile(&fd_img, data + 2, split, ip, sizeof ip);
    fuzz_memfile(&fd_lab, data + 2 + split, n - 2 - split, lp, sizeof lp);
    size_t before = fuzz_mem_now();
    ct_dataset ds;
    if (ct_idx_load(ip, lp, 10, 0.5f, 0.25f, &ds) == CT_OK) {
        if (ds.n < 1 || !ds.images || !ds.labels) abort();
        ct_dataset_fini(&ds);
    } else if (ds.images || ds.labels || !strstr(ct_last_error(), "/proc/self/fd/")) {
        abort(); /* a failure leaves nothing behind and names the file */
    }
    fuzz_check_no_leak(before);
    return 0;
}

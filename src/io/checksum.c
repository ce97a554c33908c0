/*
 * Per-tensor checksums: ct_safetensors_save stores a crc32 of every tensor
 * (in name order) under the metadata key "ctrain.crc32"; every load checks
 * them, so a bit flipped on disk or in a copy is an error naming the
 * tensor instead of a model that trains on from damaged weights.  Files
 * from other writers (PyTorch, older ctrain) have no checksums and load
 * as before.
 */
#include "internal.h"

#include <stdlib.h>
#include <string.h>
#include <zlib.h>

ct_status ct__st_check_crc(const char *path, const ct_safetensors *st, int i, const void *data)
{
    if (!st->has_crc) return CT_OK;
    unsigned long want = st->crc[i], got = crc32_z(0L, data, ct_tensor_bytes(st->tensors[i]));
    if (got != want)
        return ct_error(CT_EFORMAT, "%s: tensor '%s' fails its checksum (crc32 %08lx stored, %08lx read): the "
                        "file is damaged; restore it from a copy or save it again", path, st->names[i], want, got);
    return CT_OK;
}

ct_status ct__st_verify(const char *path, ct_safetensors *st, int *checked)
{
    *checked = 0;
    const char *v = ct_safetensors_meta(st, CT__CRC_KEY);
    if (!v) return CT_OK;
    st->crc = ct_alloc(sizeof *st->crc * (size_t)(st->n + 1), CT_MEM_OTHER);
    if (!st->crc) return CT_ENOMEM;
    const char *p = v;
    for (int i = 0; i < st->n; i++) {
        char *end;
        if ((i && *p++ != ',') || !*p)
            return ct_error(CT_EFORMAT, "%s: metadata '%s' lists fewer checksums than the %d tensors; the file is "
                            "damaged: restore it from a copy or save again", path, CT__CRC_KEY, st->n);
        unsigned long want = strtoul(p, &end, 16);
        if (end != p + 8)
            return ct_error(CT_EFORMAT, "%s: metadata '%s' is malformed at byte %d; the file is damaged", path,
                            CT__CRC_KEY, (int)(p - v));
        p = end;
        st->crc[i] = (uint32_t)want;
    }
    if (*p)
        return ct_error(CT_EFORMAT, "%s: metadata '%s' lists more checksums than the %d tensors; the file is "
                        "damaged: restore it from a copy or save again", path, CT__CRC_KEY, st->n);
    st->has_crc = 1;
    /* what is in memory now is checked now; a lazy file's other tensors as they are read */
    for (int i = 0; i < st->n; i++)
        if (ct_tensor_data(st->tensors[i])) CT_TRY(ct__st_check_crc(path, st, i, ct_tensor_data(st->tensors[i])));
    *checked = st->n;
    return CT_OK;
}

ct_status ct_safetensors_verify(const char *path, int *checked, int *unchecked)
{
    *checked = *unchecked = 0;
    ct_safetensors *st;
    CT_TRY(ct_safetensors_load(path, &st)); /* every file's checksums are checked as it loads */
    int nparts = st->nparts ? st->nparts : 1;
    for (int i = 0; i < nparts; i++) {
        const ct_safetensors *f = st->nparts ? st->parts[i] : st;
        if (ct_safetensors_meta(f, CT__CRC_KEY)) *checked += f->n;
        else *unchecked += f->n;
    }
    ct_safetensors_destroy(st);
    return CT_OK;
}

/*
 * Reading a checkpoint in pieces: ct_safetensors_open parses only the
 * headers (and a sharded checkpoint's index), keeps the files open, and
 * ct_safetensors_read fetches any byte range of a tensor with a positioned
 * read (pread), so a rank that keeps a shard of a tensor never reads, or
 * holds, the rest of it.  A read that covers a whole tensor is checked
 * against the file's crc32 for it; a part of one cannot be (the checksum
 * is of the whole: ct_safetensors_verify checks everything).
 */
#include "internal.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

ct_status ct_safetensors_open(const char *path, ct_safetensors **out) { return ct__st_load_any(path, 1, out); }

int ct__st_index_of(const ct_safetensors *st, const ct_tensor *t)
{
    for (int i = 0; i < st->n; i++)
        if (st->tensors[i] == t) return i;
    return -1;
}

ct_status ct_safetensors_read(ct_safetensors *st, const ct_tensor *t, size_t off, size_t n, void *dst)
{
    CT_ASSERT(st && t && (dst || !n));
    for (int k = 0; k < st->nparts; k++) /* a sharded checkpoint: the shard that holds t */
        if (ct__st_index_of(st->parts[k], t) >= 0) return ct_safetensors_read(st->parts[k], t, off, n, dst);
    int i = ct__st_index_of(st, t);
    size_t bytes = ct_tensor_bytes(t);
    if (i < 0 || off > bytes || n > bytes - off)
        return ct_error(CT_EINVAL, "ct_safetensors_read: %s; read the tensors of this file, within their bytes",
                        i < 0 ? "the tensor is not one of this file's" : "the range runs past the tensor");
    if (ct_tensor_data(t)) { /* read already (an eager file, or a small tensor of a lazy one) */
        memcpy(dst, (const char *)ct_tensor_data(t) + off, n);
        return CT_OK;
    }
    const char *path = st->path ? st->path : "(file)";
    for (size_t got = 0; got < n;) {
        ssize_t r = pread(st->fd, (char *)dst + got, n - got, (off_t)(st->foff[i] + (int64_t)(off + got)));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0)
            return ct_error(CT_EIO, "%s: read of tensor '%s' stopped after %zu of %zu bytes: %s", path,
                            st->names[i], got, n, r < 0 ? strerror(errno) : "unexpected end of file (did the "
                            "file change?)");
        got += (size_t)r;
        st->bytes_read += r;
    }
    return off == 0 && n == bytes ? ct__st_check_crc(path, st, i, dst) : CT_OK;
}

int64_t ct_safetensors_bytes_read(const ct_safetensors *st)
{
    int64_t b = st->bytes_read;
    for (int k = 0; k < st->nparts; k++) b += ct_safetensors_bytes_read(st->parts[k]);
    return b;
}

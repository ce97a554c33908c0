/*
 * `ctrain inspect`: what a safetensors file holds (any, not only ctrain's),
 * or a sharded checkpoint through its index: every tensor with its dtype,
 * shape and size, the totals, and the metadata.
 */
#include <string.h>

#include "cli.h"

static const char usage[] =
    "usage: ctrain inspect CKPT\n\n"
    "Lists every tensor of the safetensors file CKPT (name, dtype, shape, bytes),\n"
    "the total number of parameters and bytes, and the file's metadata.  CKPT may be a\n"
    "sharded checkpoint: its directory, or its index (*.safetensors.index.json).";

int cli_inspect(int argc, char **argv)
{
    const char *pos[2];
    int help, npos;
    char err[1024];
    int rc = cli_parse("inspect", argc, argv, NULL, 0, pos, 1, &npos, &help, err, sizeof err);
    if (help) {
        cli_print_help(stdout, usage, NULL, 0, NULL);
        return CLI_OK;
    }
    if (rc) {
        fprintf(stderr, "%s\n", err);
        return rc;
    }
    if (npos != 1) {
        fprintf(stderr, "ctrain inspect: give the file to inspect: ctrain inspect CKPT\n");
        return CLI_USAGE;
    }
    ct_safetensors *st;
    if (cli_load_file(pos[0], "the file", &st) != CT_OK) {
        cli_err("inspect", "%s", ct_last_error());
        return CLI_RUNTIME;
    }
    int n = ct_safetensors_count(st);
    size_t w = 4;
    for (int i = 0; i < n; i++)
        if (strlen(ct_safetensors_name(st, i)) > w) w = strlen(ct_safetensors_name(st, i));
    printf("%s: %d tensor%s\n", pos[0], n, n == 1 ? "" : "s");
    printf("  %-*s  %-5s  %-20s %12s\n", (int)w, "name", "dtype", "shape", "bytes");
    int64_t elems = 0;
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        const ct_tensor *t = ct_safetensors_tensor(st, i);
        char shape[128];
        printf("  %-*s  %-5s  %-20s %12zu\n", (int)w, ct_safetensors_name(st, i), ct_dtype_name(t->dtype),
               ct_shape_str(t, shape, sizeof shape), ct_tensor_bytes(t));
        elems += t->numel;
        bytes += ct_tensor_bytes(t);
    }
    char b[64];
    printf("total: %lld parameters, %zu bytes (%s)\n", (long long)elems, bytes, cli_bytes((double)bytes, b, sizeof b));
    int nm = ct_safetensors_meta_count(st);
    printf("metadata: %d entr%s\n", nm, nm == 1 ? "y" : "ies");
    for (int i = 0; i < nm; i++)
        printf("  %s = %s\n", ct_safetensors_meta_key(st, i), ct_safetensors_meta_value(st, i));
    ct_safetensors_destroy(st);
    return CLI_OK;
}

/*
 * `ctrain inspect`: what a safetensors file holds (any, not only ctrain's),
 * or a sharded checkpoint through its index: every tensor with its dtype,
 * shape and size, the totals, and the metadata.  --verify checks every
 * tensor against its stored checksum and, for a ctrain checkpoint, does
 * what a load does (ct_checkpoint_verify): its optimizer state belongs to the
 * same save and both load into the model its metadata describes.  Text from the file is printed
 * with control characters escaped, so a file cannot drive the terminal.
 */
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

static const char usage[] =
    "usage: ctrain inspect CKPT [--verify]\n\n"
    "Lists every tensor of the safetensors file CKPT (name, dtype, shape, bytes),\n"
    "the total number of parameters and bytes, and the file's metadata.  CKPT may be a\n"
    "sharded checkpoint: its directory, or its index (*.safetensors.index.json).\n"
    "--verify checks every tensor against the crc32 stored when it was saved and, for a\n"
    "checkpoint ctrain wrote, that it and its optimizer state (from the same save) load into\n"
    "the model its metadata describes, exactly as --resume would (exit 1 if not).";

int cli_inspect(int argc, char **argv)
{
    const char *pos[2];
    int help, npos, verify = 0;
    char err[1024];
    cli_opt opts[] = {{"--verify", OPT_FLAG, &verify, NULL, "check checksums and the optimizer pair", 0}};
    int rc = cli_parse("inspect", argc, argv, opts, 1, pos, 1, &npos, &help, err, sizeof err);
    if (help) {
        cli_print_help(stdout, usage, opts, 1, NULL);
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
    ct_ckpt_info ck; /* checks the path and finishes a save a crash interrupted */
    ct_status s = ct_checkpoint_info(NULL, pos[0], 0, &ck);
    ct_ckpt_info_fini(&ck);
    ct_safetensors *st = NULL;
    if (s == CT_OK) s = ct_safetensors_load(pos[0], &st);
    if (s != CT_OK) {
        cli_err("inspect", "%s", ct_last_error());
        return CLI_RUNTIME;
    }
    int n = ct_safetensors_count(st);
    size_t w = 4;
    char name[1024];
    for (int i = 0; i < n; i++) {
        size_t l = strlen(cli_printable(ct_safetensors_name(st, i), name, sizeof name));
        if (l > w) w = l;
    }
    printf("%s: %d tensor%s\n", cli_printable(pos[0], name, sizeof name), n, n == 1 ? "" : "s");
    printf("  %-*s  %-5s  %-20s %12s\n", (int)w, "name", "dtype", "shape", "bytes");
    int64_t elems = 0;
    size_t bytes = 0;
    for (int i = 0; i < n; i++) {
        const ct_tensor *t = ct_safetensors_tensor(st, i);
        char shape[128];
        printf("  %-*s  %-5s  %-20s %12zu\n", (int)w, cli_printable(ct_safetensors_name(st, i), name, sizeof name),
               ct_dtype_name(t->dtype), ct_shape_str(t, shape, sizeof shape), ct_tensor_bytes(t));
        elems += t->numel;
        bytes += ct_tensor_bytes(t);
    }
    char b[64], val[4096];
    printf("total: %lld parameters, %zu bytes (%s)\n", (long long)elems, bytes, cli_bytes((double)bytes, b, sizeof b));
    int nm = ct_safetensors_meta_count(st);
    printf("metadata: %d entr%s\n", nm, nm == 1 ? "y" : "ies");
    for (int i = 0; i < nm; i++)
        printf("  %s = %s\n", cli_printable(ct_safetensors_meta_key(st, i), name, sizeof name),
               cli_printable(ct_safetensors_meta_value(st, i), val, sizeof val));
    rc = CLI_OK;
    if (verify) {
        int checked, unchecked;
        ct_ckpt_verified v;
        s = ct_safetensors_verify(pos[0], &checked, &unchecked);
        if (s == CT_OK) s = ct_checkpoint_verify(pos[0], 0, &v); /* what a load does: verify means loadable */
        if (s != CT_OK) {
            cli_err("inspect", "verify failed: %s", ct_last_error());
            rc = CLI_RUNTIME;
        } else {
            printf("verify: %d tensor%s match their checksums", checked, checked == 1 ? "" : "s");
            if (unchecked) printf(", %d without checksums (written by another tool or an older ctrain)", unchecked);
            if (v.is_ctrain) printf("; it loads into the model its metadata describes");
            printf("%s\n", v.has_optim ? "; the optimizer state is from the same save, intact and loads" : "");
        }
    }
    ct_safetensors_destroy(st);
    return rc;
}

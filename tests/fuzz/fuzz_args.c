/* Fuzz target: the ctrain train command line (cli/args.c's option parser
 * and cli/train_args.c's checks).  The input is split at NUL bytes into
 * words.  Every outcome is parsed options or one error line, never a
 * crash, and no number overflows on the way. */
#include "fuzz.h"
#include "../../cli/train.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    enum { MAXW = 64 };
    char *buf = malloc(n + 1), *argv[MAXW];
    if (!buf) return 0;
    memcpy(buf, data, n);
    buf[n] = 0;
    int argc = 0;
    for (size_t at = 0; at <= n && argc < MAXW;) {
        argv[argc++] = buf + at;
        at += strlen(buf + at) + 1;
    }
    train_opts o;
    char err[1024] = "";
    int help = 0;
    int rc = train_parse(argc, argv, &o, &help, err, sizeof err);
    if (rc != 0 && rc != CLI_USAGE) abort();
    if (rc == CLI_USAGE && strncmp(err, "ctrain train: ", 14)) abort(); /* one line naming the command */
    if (rc == 0 && !help) {
        char err2[1024];
        (void)train_check_world(&o, 2, err2, sizeof err2);
    }
    free(buf);
    return 0;
}

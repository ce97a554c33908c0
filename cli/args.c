/*
 * The option parser of the ctrain program: "--name value" and
 * "--name=value", typed destinations, and help text.  Every failure is one
 * line naming the word at fault and what to do instead.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

cli_opt *cli_find(cli_opt *opts, int nopts, const char *name)
{
    for (int i = 0; i < nopts; i++)
        if (!strcmp(opts[i].name, name)) return &opts[i];
    return NULL;
}

static int set_value(const char *cmd, cli_opt *o, const char *v, char *err, size_t errn)
{
    char *end;
    switch (o->type) {
    case OPT_STR:
        *(const char **)o->dest = v;
        return 0;
    case OPT_INT: {
        errno = 0;
        long long x = strtoll(v, &end, 10);
        if (end == v || *end || errno) {
            snprintf(err, errn, "ctrain %s: %s '%s' is not a whole number; give %s as an integer, e.g. %s 10",
                     cmd, o->name, v, o->name, o->name);
            return CLI_USAGE;
        }
        *(int64_t *)o->dest = x;
        return 0;
    }
    case OPT_NUM: {
        errno = 0;
        double x = strtod(v, &end);
        if (end == v || *end || errno || !isfinite(x)) {
            snprintf(err, errn, "ctrain %s: %s '%s' is not a number; give %s as a decimal, e.g. %s 0.001",
                     cmd, o->name, v, o->name, o->name);
            return CLI_USAGE;
        }
        *(double *)o->dest = x;
        return 0;
    }
    case OPT_FLAG:
        break;
    }
    return 0;
}

int cli_parse(const char *cmd, int argc, char **argv, cli_opt *opts, int nopts, const char **pos,
              int maxpos, int *npos, int *help, char *err, size_t errn)
{
    *npos = 0;
    *help = 0;
    for (int i = 0; i < argc; i++) {
        const char *w = argv[i];
        if (!strcmp(w, "--help") || !strcmp(w, "-h")) {
            *help = 1;
            continue;
        }
        if (strncmp(w, "--", 2) || !w[2]) {
            if (w[0] == '-' && w[1]) {
                snprintf(err, errn, "ctrain %s: unknown option '%s'; options start with '--' (run 'ctrain %s --help')",
                         cmd, w, cmd);
                return CLI_USAGE;
            }
            if (*npos == maxpos) {
                snprintf(err, errn, "ctrain %s: unexpected argument '%s'; run 'ctrain %s --help' for the usage",
                         cmd, w, cmd);
                return CLI_USAGE;
            }
            pos[(*npos)++] = w;
            continue;
        }
        const char *eq = strchr(w, '=');
        size_t len = eq ? (size_t)(eq - w) : strlen(w);
        cli_opt *o = NULL;
        for (int k = 0; k < nopts && !o; k++)
            if (strlen(opts[k].name) == len && !strncmp(opts[k].name, w, len)) o = &opts[k];
        if (!o) {
            snprintf(err, errn, "ctrain %s: unknown option '%.*s'; run 'ctrain %s --help' for the list", cmd,
                     (int)len, w, cmd);
            return CLI_USAGE;
        }
        o->given++;
        if (o->type == OPT_FLAG) {
            if (eq) {
                snprintf(err, errn, "ctrain %s: %s takes no value; drop '=%s'", cmd, o->name, eq + 1);
                return CLI_USAGE;
            }
            *(int *)o->dest = 1;
            continue;
        }
        const char *v;
        if (eq) {
            v = eq + 1;
        } else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2)) {
            v = argv[++i];
        } else {
            snprintf(err, errn, "ctrain %s: %s needs a value; write %s %s", cmd, o->name, o->name,
                     o->metavar ? o->metavar : "VALUE");
            return CLI_USAGE;
        }
        if (!*v) {
            snprintf(err, errn, "ctrain %s: %s is empty; write %s %s", cmd, o->name, o->name,
                     o->metavar ? o->metavar : "VALUE");
            return CLI_USAGE;
        }
        int r = set_value(cmd, o, v, err, errn);
        if (r) return r;
    }
    return 0;
}

void cli_print_help(FILE *f, const char *usage, const cli_opt *opts, int nopts, const char *epilog)
{
    fprintf(f, "%s\n\noptions:\n", usage);
    for (int i = 0; i < nopts; i++) {
        if (!opts[i].help) continue;
        char left[64];
        snprintf(left, sizeof left, "%s%s%s", opts[i].name, opts[i].metavar ? " " : "",
                 opts[i].metavar ? opts[i].metavar : "");
        fprintf(f, "  %-26s %s\n", left, opts[i].help);
    }
    fprintf(f, "  %-26s %s\n", "--help", "show this help");
    if (epilog) fprintf(f, "\n%s", epilog);
}

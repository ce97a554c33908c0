/* See cli_util.h. */
#include <libgen.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli_util.h"

const char *cli_bin_dir(void)
{
    static char dir[1024];
    if (!*dir) {
        char exe[1000];
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        ASSERT(n > 0);
        exe[n] = 0;
        snprintf(dir, sizeof dir, "%s/..", dirname(exe));
    }
    return dir;
}

int run_sh(int np, const char *prefix, char *out, const char *fmt, ...)
{
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    if (np > 0)
        snprintf(cmd, sizeof cmd,
                 "%s OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe --bind-to none "
                 "-np %d %s/ctrain %s 2>&1", prefix, np, cli_bin_dir(), args);
    else
        snprintf(cmd, sizeof cmd, "%s %s/ctrain %s 2>&1", prefix, cli_bin_dir(), args);
    FILE *p = popen(cmd, "r");
    ASSERT(p != NULL);
    size_t n = fread(out, 1, OUT_MAX - 1, p);
    out[n] = 0;
    int st = pclose(p);
    ASSERT(WIFEXITED(st));
    return WEXITSTATUS(st);
}

int run_shell(int np, char *out, const char *fmt, ...)
{
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 %s%.0d %s 2>&1",
             np > 0 ? "mpirun --oversubscribe --bind-to none -np " : "", np, args);
    FILE *p = popen(cmd, "r");
    ASSERT(p != NULL);
    size_t n = fread(out, 1, OUT_MAX - 1, p);
    out[n] = 0;
    int st = pclose(p);
    ASSERT(WIFEXITED(st));
    return WEXITSTATUS(st);
}

int count_lines(const char *s)
{
    int n = 0;
    for (; *s; s++) n += *s == '\n';
    return n;
}

int occurrences(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

double number_after(const char *s, const char *key)
{
    const char *p = strstr(s, key);
    if (!p) ct_test_fail(__FILE__, __LINE__, "no '%s' in output:\n%s", key, s);
    return atof(p + strlen(key));
}

void line_after(const char *s, const char *key, char *buf, size_t n)
{
    const char *p = strstr(s, key);
    if (!p) ct_test_fail(__FILE__, __LINE__, "no '%s' in output:\n%s", key, s);
    p += strlen(key);
    size_t len = strcspn(p, "\n");
    snprintf(buf, n, "%.*s", (int)(len < n ? len : n - 1), p);
}

double json_max(const char *line, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    double best = -1;
    for (const char *p = line; (p = strstr(p, pat)); p += strlen(pat))
        if (atof(p + strlen(pat)) > best) best = atof(p + strlen(pat));
    if (best < 0) ct_test_fail(__FILE__, __LINE__, "no %s in: %s", pat, line);
    return best;
}

void same_files(const char *a, const char *b)
{
    ct_safetensors *x, *y;
    ASSERT_OK(ct_safetensors_load(a, &x));
    ASSERT_OK(ct_safetensors_load(b, &y));
    ASSERT_EQ(ct_safetensors_count(x), ct_safetensors_count(y));
    for (int i = 0; i < ct_safetensors_count(x); i++) {
        const ct_tensor *tx = ct_safetensors_tensor(x, i), *ty = ct_safetensors_tensor(y, i);
        ASSERT(!strcmp(ct_safetensors_name(x, i), ct_safetensors_name(y, i)));
        ASSERT(ct_tensor_same_shape(tx, ty));
        if (memcmp(ct_tensor_data(tx), ct_tensor_data(ty), ct_tensor_bytes(tx)))
            ct_test_fail(__FILE__, __LINE__, "%s differs between %s and %s", ct_safetensors_name(x, i), a, b);
    }
    ct_safetensors_destroy(x);
    ct_safetensors_destroy(y);
}

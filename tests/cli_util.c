/* See cli_util.h. */
#include <dirent.h>
#include <libgen.h>
#include <signal.h>
#include <sys/stat.h>
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

int capture(const char *cmd, char *out)
{
    FILE *p = popen(cmd, "r");
    ASSERT(p != NULL);
    size_t n = fread(out, 1, OUT_MAX - 1, p);
    out[n] = 0;
    int st = pclose(p);
    ASSERT(WIFEXITED(st));
    return WEXITSTATUS(st);
}

const char *small_text(int lines)
{
    static char txt[1024];
    char path[1100];
    snprintf(txt, sizeof txt, "%s/text", ct_test_tmpdir());
    ASSERT(mkdir(txt, 0755) == 0);
    snprintf(path, sizeof path, "%s/a.txt", txt);
    FILE *f = fopen(path, "w");
    ASSERT(f != NULL);
    for (int i = 0; i < lines; i++) fprintf(f, "line %d of a small text to train on\n", i);
    fclose(f);
    return txt;
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
    return capture(cmd, out);
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
    return capture(cmd, out);
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


int run_cmd(const run_env *env, char *out, const char *fmt, ...)
{
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    if (!strncmp(args, "mpirun ", 7)) /* "mpirun ... -np 1 CTRAIN args : ...": CTRAIN is build/ctrain */
        snprintf(cmd, sizeof cmd, "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CTRAIN=%s/ctrain; "
                 "exec mpirun --oversubscribe --bind-to none %s 2>&1", cli_bin_dir(), args + 7);
    else
        snprintf(cmd, sizeof cmd, "exec %s/ctrain %s 2>&1", cli_bin_dir(), args);
    int fd[2];
    ASSERT_EQ(pipe(fd), 0);
    pid_t pid = fork();
    ASSERT(pid >= 0);
    if (pid == 0) {
        dup2(fd[1], 1);
        close(fd[0]);
        close(fd[1]);
        char k[32];
        if (env && env->kill_at > 0) {
            snprintf(k, sizeof k, "%d", env->kill_at);
            setenv("CTRAIN_FAULT_KILL_AT", k, 1);
        }
        if (env && env->fail_at > 0) {
            snprintf(k, sizeof k, "%d", env->fail_at);
            setenv("CTRAIN_FAULT_FAIL_AT", k, 1);
        }
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(fd[1]);
    size_t n = 0;
    ssize_t r;
    while ((r = read(fd[0], out + n, OUT_MAX - 1 - n)) > 0) n += (size_t)r;
    out[n] = 0;
    close(fd[0]);
    int st;
    ASSERT_EQ(waitpid(pid, &st, 0), pid);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
}

/* Writes an IDX file: magic 0x0803 (images n x 28 x 28) or 0x0801 (labels). */
void write_idx(const char *dir, const char *name, int images, int n)
{
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    ASSERT(f);
    unsigned char hdr[16] = {0, 0, 8, images ? 3 : 1, (unsigned char)(n >> 24), (unsigned char)(n >> 16),
                             (unsigned char)(n >> 8), (unsigned char)n, 0, 0, 0, 28, 0, 0, 0, 28};
    ASSERT_EQ(fwrite(hdr, 1, images ? 16 : 8, f), (size_t)(images ? 16 : 8));
    for (long i = 0; i < (long)n * (images ? 784 : 1); i++)
        fputc(images ? (int)((i * 2654435761u) >> 24) : (int)(i % 10), f);
    ASSERT_EQ(fclose(f), 0);
}

/* A small data set in the Fashion-MNIST layout (256 training and 64 test
 * images), so each run spends its time on what is tested, not on loading. */
const char *tiny_data(void)
{
    static char dir[700];
    snprintf(dir, sizeof dir, "%s/data", ct_test_tmpdir());
    if (access(dir, F_OK) == 0) return dir;
    ASSERT_EQ(mkdir(dir, 0777), 0);
    write_idx(dir, "train-images-idx3-ubyte", 1, 256);
    write_idx(dir, "train-labels-idx1-ubyte", 0, 256);
    write_idx(dir, "t10k-images-idx3-ubyte", 1, 64);
    write_idx(dir, "t10k-labels-idx1-ubyte", 0, 64);
    return dir;
}

char *path_in(const char *name)
{
    static char buf[8][600];
    static int k;
    char *p = buf[k++ & 7];
    snprintf(p, 600, "%s/%s", ct_test_tmpdir(), name);
    return p;
}

unsigned char *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) ct_test_fail(__FILE__, __LINE__, "cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc((size_t)len + 1);
    ASSERT(p && fread(p, 1, (size_t)len, f) == (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return p;
}

int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    ASSERT(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

int holds_unlinked_file(int pid, const char *dir)
{
    for (int tries = 0; tries < 400; tries++) {
        char fddir[64];
        snprintf(fddir, sizeof fddir, "/proc/%d/fd", pid);
        DIR *d = opendir(fddir);
        struct dirent *e;
        int seen = 0;
        while (d && (e = readdir(d))) {
            char link[600], target[4096];
            snprintf(link, sizeof link, "%s/%s", fddir, e->d_name);
            ssize_t n = readlink(link, target, sizeof target - 1);
            if (n <= 0) continue;
            target[n] = 0;
            if (!strncmp(target, dir, strlen(dir)) && strstr(target, "(deleted)")) seen = 1;
        }
        if (d) closedir(d);
        if (seen) return 1;
        usleep(50000);
    }
    return 0;
}

/* The number after key at the start of a line of path (the first line's without key); -1 if none. */
static double read_num(const char *path, const char *key)
{
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[256];
    double v = -1;
    while (fgets(line, sizeof line, f))
        if (!key || !strncmp(line, key, strlen(key))) {
            v = atof(line + (key ? strlen(key) : 0));
            break;
        }
    fclose(f);
    return v;
}

void memlimit_collect(const char *tag, int np, double *peak, int *killed)
{
    char p[320];
    for (int r = 0; r < np; r++) {
        snprintf(p, sizeof p, "/sys/fs/cgroup/memory/%s/%d/memory.max_usage_in_bytes", tag, r);
        double u = read_num(p, NULL);
        peak[r] = u > 0 ? u : 0;
        snprintf(p, sizeof p, "/sys/fs/cgroup/memory/%s/%d/memory.oom_control", tag, r);
        killed[r] = read_num(p, "oom_kill ") > 0;
        snprintf(p, sizeof p, "/sys/fs/cgroup/memory/%s/%d", tag, r);
        rmdir(p);
    }
    snprintf(p, sizeof p, "/sys/fs/cgroup/memory/%s", tag);
    rmdir(p);
}

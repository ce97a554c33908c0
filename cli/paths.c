/*
 * Output paths checked before training, so a run never learns at its end
 * that it cannot write what it made: the directory must exist and take a
 * new file (probed by creating and removing one, which also catches a
 * read-only mount where permission bits say yes, and root, for whom
 * access() always does).
 */
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

/* Creates and removes a probe file in dir. */
static ct_status probe(const char *flag, const char *path, const char *dir)
{
    char p[4200];
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return ct_error(CT_EIO, "%s %s: the directory %s does not exist (%s); create it first (mkdir -p %s) or "
                        "choose another path", flag, path, dir, strerror(errno), dir);
    if (!S_ISDIR(sb.st_mode))
        return ct_error(CT_EIO, "%s %s: %s is not a directory; choose another path", flag, path, dir);
    snprintf(p, sizeof p, "%s/.ctrain-probe-%d", dir, (int)getpid());
    int fd = open(p, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (fd < 0)
        return ct_error(CT_EIO, "%s %s: cannot write in %s (%s); choose a writable place", flag, path, dir,
                        strerror(errno));
    close(fd);
    unlink(p);
    return CT_OK;
}

ct_status cli_check_output(const char *flag, const char *path, int is_dir)
{
    struct stat sb;
    if (is_dir && stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) return probe(flag, path, path);
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    if (!is_dir && slash && !slash[1])
        return ct_error(CT_EINVAL, "%s %s names a directory; give a file name", flag, path);
    return probe(flag, path, dir);
}

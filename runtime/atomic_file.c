/* atomic_file.c - see atomic_file.h. */
#define _GNU_SOURCE
#include "atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Creates "<path>.<pid>.<n>.tmp" next to path. Not mkstemp: it creates files with
 * mode 0600, and the umask that a normal file should get cannot be read without
 * changing it (not thread-safe); O_EXCL gives the same no-clobber guarantee. */
int kiln_file_open_temp(const char *path, char **tmp_out)
{
    static unsigned counter;
    size_t n = strlen(path) + 48;
    char *tmp = malloc(n);
    if (!tmp) { errno = ENOMEM; return -1; }
    for (int tries = 0; tries < 100; tries++) {
        unsigned k = __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED);
        snprintf(tmp, n, "%s.%ld.%u.tmp", path, (long)getpid(), k);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0) { *tmp_out = tmp; return fd; }
        if (errno != EEXIST) break;
    }
    int e = errno;
    free(tmp);
    errno = e;
    return -1;
}

/* Best effort: makes the rename itself durable. */
void kiln_file_sync_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    if (!dir) return;
    int fd = open(dir, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) { fsync(fd); close(fd); }
    free(dir);
}

/* atomic_file.c - see atomic_file.h: temporary file in the target's folder (a
 * rename only replaces atomically within one file system), fsync, rename. */
#define _GNU_SOURCE
#include "atomic_file.h"
#include "fault.h"
#include "meta.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Creates "<path>.<pid>.<n>.tmp" next to path. Not mkstemp: it creates files with
 * mode 0600, and the umask that a normal file should get cannot be read without
 * changing it (not thread-safe); O_EXCL gives the same no-clobber guarantee. */
static int open_temp(const char *path, char **tmp_out)
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
static void sync_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    if (!dir) return;
    int fd = open(dir, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) { fsync(fd); close(fd); }
    free(dir);
}

kiln_status kiln_atomic_file_open(kiln_atomic_file *f, const char *path)
{
    f->path = path;
    f->tmp = NULL;
    f->discard = 0;
    f->fd = open_temp(path, &f->tmp);
    if (f->fd < 0)
        return kiln_error(KILN_ERR_IO, "%s: cannot create a temporary file next to it: %s", path, strerror(errno));
    return KILN_OK;
}

kiln_status kiln_atomic_file_open_output(kiln_atomic_file *f, const char *path)
{
    kiln_status st = kiln_atomic_file_open(f, path);
    if (st || !kiln_meta_target()) return st;
    /* a dry run: the folder took the temporary file; nothing more reaches the disk */
    close(f->fd);
    f->fd = -1;
    unlink(f->tmp);
    f->discard = 1;
    return KILN_OK;
}

kiln_status kiln_atomic_file_write(kiln_atomic_file *f, const void *buf, size_t n)
{
    if (!f->tmp) return kiln_error(KILN_ERR_STATE, "%s: write to a closed save", f->path);
    if (f->discard) return KILN_OK;
    if (kiln_fault_hit(KILN_FAULT_WRITE))   /* a test's injected failure: as if the disk were full */
        return kiln_error(KILN_ERR_IO, "%s: write failed: %s (injected fault)", f->path, strerror(ENOSPC));
    const char *p = buf;
    while (n) {
        /* one write() moves at most about 2 GiB on Linux: ask for 1 GiB at a time */
        size_t chunk = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
        ssize_t w = write(f->fd, p, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return kiln_error(KILN_ERR_IO, "%s: write failed: %s", f->path, strerror(errno));
        }
        p += w;
        n -= (size_t)w;
    }
    return KILN_OK;
}

kiln_status kiln_atomic_file_commit(kiln_atomic_file *f)
{
    if (!f->tmp) return kiln_error(KILN_ERR_STATE, "%s: commit of a closed save", f->path);
    if (f->discard) { free(f->tmp); f->tmp = NULL; f->discard = 0; return KILN_OK; }
    kiln_status st = KILN_OK;
    if (fsync(f->fd) != 0) st = kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", f->path, strerror(errno));
    int rc = close(f->fd);
    f->fd = -1;
    if (rc != 0 && !st) st = kiln_error(KILN_ERR_IO, "%s: close failed: %s", f->path, strerror(errno));
    if (!st && rename(f->tmp, f->path) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: cannot rename the temporary file over it: %s", f->path, strerror(errno));
    if (st) unlink(f->tmp);
    else sync_dir(f->path);
    free(f->tmp);
    f->tmp = NULL;
    return st;
}

void kiln_atomic_file_abort(kiln_atomic_file *f)
{
    if (!f->tmp) return;
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
    if (!f->discard) unlink(f->tmp);
    f->discard = 0;
    free(f->tmp);
    f->tmp = NULL;
}

/* file_stamp.c - a mapped file's identity at open time and the check against it.
 * The path is stat'ed again (not the descriptor, which the mapping does not need):
 * a file renamed over the path is a change too, though the old mapping stays
 * readable, because the model would no longer be what the path holds. */
#define _POSIX_C_SOURCE 200809L
#include "file_stamp.h"

#include <errno.h>
#include <string.h>
#include <sys/stat.h>

static void fill(const struct stat *sb, kiln_file_stamp *out)
{
    out->dev = (uint64_t)sb->st_dev;
    out->ino = (uint64_t)sb->st_ino;
    out->size = (uint64_t)sb->st_size;
    out->mtime_sec = (int64_t)sb->st_mtim.tv_sec;
    out->mtime_nsec = (int64_t)sb->st_mtim.tv_nsec;
}

kiln_status kiln_file_stamp_take(int fd, const char *path, kiln_file_stamp *out)
{
    struct stat sb;
    memset(out, 0, sizeof *out);
    if (fstat(fd, &sb) != 0) return kiln_error(KILN_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    fill(&sb, out);
    return KILN_OK;
}

kiln_status kiln_file_stamp_check(const char *path, const kiln_file_stamp *s)
{
    struct stat sb;
    if (stat(path, &sb) != 0)
        return kiln_error(KILN_ERR_IO, "%s changed on disk since it was opened (now: %s)", path, strerror(errno));
    kiln_file_stamp now;
    fill(&sb, &now);
    if (now.dev != s->dev || now.ino != s->ino)
        return kiln_error(KILN_ERR_IO, "%s changed on disk since it was opened (replaced by another file)", path);
    if (now.size != s->size)
        return kiln_error(KILN_ERR_IO, "%s changed on disk since it was opened (%llu bytes then, %llu now)", path,
                          (unsigned long long)s->size, (unsigned long long)now.size);
    if (now.mtime_sec != s->mtime_sec || now.mtime_nsec != s->mtime_nsec)
        return kiln_error(KILN_ERR_IO, "%s changed on disk since it was opened (modified in place)", path);
    return KILN_OK;
}

/* file_stamp.h - what a mapped file looked like when it was opened (device, inode,
 * size, modification time), so a reader can tell that it was truncated or replaced
 * before touching the mapping again (a page past a truncated end is SIGBUS). A
 * truncation after the check is caught by the copy itself (mapped_read.h). */
#ifndef KILN_FILE_STAMP_H
#define KILN_FILE_STAMP_H

#include "status.h"

#include <stdint.h>

typedef struct {
    uint64_t dev, ino, size;
    int64_t mtime_sec, mtime_nsec;
} kiln_file_stamp;

/* Fills *out from fd (the open file). KILN_ERR_IO when fstat fails. */
kiln_status kiln_file_stamp_take(int fd, const char *path, kiln_file_stamp *out);
/* KILN_ERR_IO "PATH changed on disk since it was opened (...)" when path now names
 * another file (replaced, removed) or the same file with another size or mtime;
 * KILN_OK when it is as stamped. One stat call: cheap next to a block copy. */
kiln_status kiln_file_stamp_check(const char *path, const kiln_file_stamp *s);

#endif

/* mapped_read.h - copies out of a file's mapping that return an error instead of
 * killing the process when the file was truncated under the mapping (a read past
 * its new end is SIGBUS; a stamp checked before the read cannot close that window). */
#ifndef KILN_MAPPED_READ_H
#define KILN_MAPPED_READ_H

#include "dtype.h"
#include "status.h"

#include <stddef.h>

/* dst = n elements at src (inside the mapping of the file at path, dtype sdt),
 * converted to ddt as kiln_convert does. A SIGBUS while reading src's bytes returns
 * KILN_ERR_IO "PATH changed on disk while it was read (truncated?)", with dst
 * partly written. dst must not be mapped from a file and the conversion runs on the
 * calling thread, so nothing but the copy is cut short. path NULL: a plain
 * kiln_convert (the source is not a mapping). */
kiln_status kiln_mapped_read(const char *path, void *dst, kiln_dtype ddt, const void *src, kiln_dtype sdt,
                             size_t n);
/* The same for bytes: dst = n bytes at src. */
kiln_status kiln_mapped_read_bytes(const char *path, void *dst, const void *src, size_t n);

#endif

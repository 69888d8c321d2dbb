/* atomic_file.h - kiln's one way to replace a file (safetensors, PNG): write to a
 * temporary file next to the target, fsync, rename over it, so a failed save never
 * destroys what the user had and no reader ever sees half a file.
 *
 * During a dry run (meta.h: the shape-only device modelling another), a save of what
 * the run computed (a picture, weights) would write the zeros that stand in for data:
 * kiln_atomic_file_open_output then makes and removes the temporary file (so a folder
 * that cannot take the file still fails, as in the real run) and writes nothing; the
 * target stays as it was. Files that describe the run itself (a trace) open with
 * kiln_atomic_file_open and are written. */
#ifndef KILN_ATOMIC_FILE_H
#define KILN_ATOMIC_FILE_H

#include "status.h"

#include <stddef.h>

/* One save in progress. Open, write any number of times, then exactly one of
 * commit or abort; both leave it closed. A zeroed one counts as closed and abort
 * on a closed one does nothing, so error paths may call it unconditionally. */
typedef struct {
    const char *path; /* the target, borrowed from the caller for the save's duration */
    char *tmp;        /* "<path>.<pid>.<n>.tmp", NULL once closed */
    int fd;
    int discard;      /* a dry run's output: writes and the commit touch nothing */
} kiln_atomic_file;

/* Creates the temporary file in path's folder (mode 0666 & ~umask, as a plain
 * create gives). KILN_ERR_IO when it cannot; f is closed then. */
kiln_status kiln_atomic_file_open(kiln_atomic_file *f, const char *path);
/* The same for a save of computed data; during a dry run, a save that writes nothing
 * (above): write and commit succeed and leave path untouched. */
kiln_status kiln_atomic_file_open_output(kiln_atomic_file *f, const char *path);
/* Appends n bytes; KILN_ERR_IO with errno's reason on failure (f stays open: the
 * caller aborts). */
kiln_status kiln_atomic_file_write(kiln_atomic_file *f, const void *buf, size_t n);
/* fsyncs and closes the temporary, renames it over path and fsyncs the folder.
 * On failure the temporary is removed and path is untouched. */
kiln_status kiln_atomic_file_commit(kiln_atomic_file *f);
/* Closes and removes the temporary; path is untouched. Does not set an error, so
 * the message of whatever failed stays the thread's last error. */
void kiln_atomic_file_abort(kiln_atomic_file *f);

#endif

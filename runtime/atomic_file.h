/* atomic_file.h - the pieces of kiln's atomic saves (safetensors, PNG): write to a
 * temporary file next to the target, fsync, rename over it, so a failed save never
 * destroys what the user had. */
#ifndef KILN_ATOMIC_FILE_H
#define KILN_ATOMIC_FILE_H

/* Creates "<path>.<pid>.<n>.tmp" next to path (O_EXCL, mode 0666 & ~umask; not
 * mkstemp, whose 0600 would stick to the renamed file). Returns the fd and the
 * malloc'd name in *tmp_out, or -1 with errno. */
int kiln_file_open_temp(const char *path, char **tmp_out);
/* Best effort: fsyncs the folder of path, making a rename durable. */
void kiln_file_sync_dir(const char *path);

#endif

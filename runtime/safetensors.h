/* safetensors.h - reading (mmap, zero copy) and atomic writing of .safetensors files.
 * Format: u64 little-endian header length N, N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {"k": "v"}}, then the data section; offsets are relative to it.
 * Every field is validated; errors name the file and the offending tensor. */
#ifndef KILN_SAFETENSORS_H
#define KILN_SAFETENSORS_H

#include "dtype.h"
#include "file_stamp.h"

#define KILN_ST_MAX_DIMS 8

typedef struct {
    char *name;
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_ST_MAX_DIMS];
    uint64_t begin, end;          /* byte span within the data section */
} kiln_st_entry;

typedef struct kiln_st_file {
    char *path;
    int refcount;                 /* atomic; the mapping stays while tensors use it */
    void *map;                    /* whole file, read-only mmap (NULL for an empty data section) */
    size_t map_size;
    const uint8_t *data;          /* start of the data section */
    uint64_t data_size;
    int n;                        /* entries, in file (offset) order */
    kiln_st_entry *entries;
    int n_meta;
    char **meta_keys, **meta_values;
    kiln_file_stamp stamp;        /* the file as opened: see kiln_st_check */
} kiln_st_file;

/* Opens and validates; *out has refcount 1. */
kiln_status kiln_st_open(const char *path, kiln_st_file **out);
void kiln_st_retain(kiln_st_file *f);
void kiln_st_release(kiln_st_file *f);
/* KILN_OK while the file on disk is the one mapped; else KILN_ERR_IO "PATH changed
 * on disk since it was opened": call before reading a block from the mapping (a
 * truncated file would fault there with SIGBUS). */
kiln_status kiln_st_check(const kiln_st_file *f);
/* A file of another format (GGUF, gguf.c) read into the same description: *desc's
 * fields are taken over (path, map, entries, meta arrays: malloc'd; strings: the one
 * block holding names and metadata text, or NULL) and freed with the file, also on
 * error (a duplicate name). *out has refcount 1. */
kiln_status kiln_st_wrap(const kiln_st_file *desc, char *strings, kiln_st_file **out);
/* Index of the entry named name, or -1 (hash lookup). */
int kiln_st_find(const kiln_st_file *f, const char *name);
static inline const void *kiln_st_data(const kiln_st_file *f, int i)
{
    return f->data + f->entries[i].begin;
}

typedef struct {
    const char *name;
    kiln_dtype dtype;
    int ndim;
    const int64_t *shape;
    const void *data;             /* contiguous, nbytes = numel * dtype size */
} kiln_st_item;

/* Writes n items (and optional metadata) atomically: a temporary file in the same
 * folder, fsync, rename over path; on any failure path is untouched and the
 * temporary removed. Names must be unique and not "__metadata__". */
kiln_status kiln_st_save(const char *path, int n, const kiln_st_item *items,
                         int n_meta, const char *const *meta_keys,
                         const char *const *meta_values);

#endif

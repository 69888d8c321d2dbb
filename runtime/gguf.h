/* gguf.h - GGUF files (ggml's format, versions 2 and 3): reading into the same mapped,
 * zero-copy description as safetensors (kiln_st_file), and atomic writing.
 * Layout: "GGUF", u32 version, u64 tensor count, u64 key/value count, the key/values,
 * the tensor infos (name, u32 dims, u64 ne[dims] fastest first, u32 type, u64 offset),
 * padding to general.alignment (32 when absent), the data. Shapes come out in
 * PyTorch order (ne reversed). Every count, length and offset is bounded by the
 * file's size before anything is allocated; errors name the file and the tensor. */
#ifndef KILN_GGUF_H
#define KILN_GGUF_H

#include "safetensors.h"

/* Opens and validates a GGUF file; *out has refcount 1. The metadata comes out as
 * strings: numbers in decimal, booleans as "true"/"false", arrays as "[array of N]". */
kiln_status kiln_gguf_open(const char *path, kiln_st_file **out);
/* 1 when the file at path starts with the GGUF magic, else 0. */
int kiln_gguf_probe(const char *path);
/* A weight file of either format: GGUF by its magic, else safetensors. */
kiln_status kiln_weights_open(const char *path, kiln_st_file **out);

/* ggml's type number of a kiln dtype, or -1 when GGUF has no such type. */
int kiln_gguf_type_of(kiln_dtype dt);

/* Writes GGUF v3 atomically (temporary file, fsync, rename): items in their own dtype
 * (quantize before, e.g. with kiln_convert), metadata as string values. Names must be
 * unique; a block type needs the last dimension a multiple of its block. */
kiln_status kiln_gguf_save(const char *path, int n, const kiln_st_item *items,
                           int n_meta, const char *const *meta_keys, const char *const *meta_values);

#endif

/* png_io.h - PNG reading and atomic writing with libpng.
 * Pixels travel as planar f32 in [0,1], [C, H, W] (C = 1, 2, 3 or 4 as stored:
 * gray, gray+alpha, RGB, RGBA; palette expands to RGB or RGBA). */
#ifndef KILN_PNG_H
#define KILN_PNG_H

#include "status.h"

/* Reads path; *out (malloc'd, caller frees) holds c*h*w floats, planar.
 * 8- and 16-bit files are read at full precision (value / 255 or / 65535). */
kiln_status kiln_png_read(const char *path, float **out, int *c, int *h, int *w);

/* Writes planar f32 [c, h, w] (c = 1..4) as an 8-bit PNG (values clamped to [0,1] and
 * rounded), with n_text text chunks (iTXt for non-ASCII/Latin-1 values, tEXt
 * otherwise). Atomic: temp file in the same folder, fsync, rename. */
kiln_status kiln_png_write(const char *path, const float *pixels, int c, int h, int w,
                           int n_text, const char *const *keys, const char *const *values);

/* The same PNG as kiln_png_write would write, into memory: *out (malloc'd, the caller
 * frees) holds *len bytes. For answers sent over the network, where a file (and its
 * fsync) would only be written to be read back. */
kiln_status kiln_png_encode(const float *pixels, int c, int h, int w, int n_text, const char *const *keys,
                            const char *const *values, unsigned char **out, size_t *len);

/* Reads the text chunks of a PNG (for tests and metadata tools): arrays malloc'd,
 * free with kiln_png_free_text. */
kiln_status kiln_png_read_text(const char *path, int *n, char ***keys, char ***values);
void kiln_png_free_text(int n, char **keys, char **values);

#endif

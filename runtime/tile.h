/* tile.h - the tile primitive: a grid of overlapping tiles over the last two
 * (spatial) dimensions of a tensor, feather weights, and blending each tile's output
 * into a result whose spatial size is the input's times a rational scale (VAE decode
 * x8, encode /8, upscalers x4, UNet x1).
 *
 * The feather weights are separable and normalized per axis so that, at every output
 * pixel, the weights of the tiles covering it sum to 1 (a partition of unity). Each
 * tile's output is therefore added into the result already weighted: there is no
 * weight map and no final division, and the result is the only full-size allocation.
 * Only one tile's input copy, intermediates and output are alive at a time. */
#ifndef KILN_TILE_H
#define KILN_TILE_H

#include "tensor.h"

/* ORDER BLEND: keep blend_names in tile.c in this order */
typedef enum { KILN_BLEND_LINEAR = 0, KILN_BLEND_COSINE, KILN_BLEND_COUNT } kiln_blend;

const char *kiln_blend_name(kiln_blend b);
int kiln_blend_from_name(const char *name); /* -1 when unknown */

typedef struct {
    int64_t tile;              /* largest tile edge in input units (> 0); the tiles of an
                                * axis are shortened to what covers it with the overlap */
    int64_t overlap;           /* minimum overlap of neighbours, input units (0 <= overlap < tile) */
    int64_t scale_num;         /* out = in * scale_num / scale_den (both > 0) */
    int64_t scale_den;
    int64_t multiple;          /* tile edges are multiples of this (0: scale_den); starts
                                * are multiples of scale_den so output edges are integers */
    kiln_blend blend;
} kiln_tile_opts;

/* Fills o with tile, overlap, scale 1, linear blending. */
void kiln_tile_opts_init(kiln_tile_opts *o, int64_t tile, int64_t overlap);

typedef struct {
    int64_t in_start, in_len;     /* input range */
    int64_t out_start, out_len;   /* output range */
    int64_t w_offset;             /* this span's out_len weights start here in weight[] */
} kiln_tile_span;

typedef struct {
    int n;                        /* spans along the axis */
    int64_t in_size, out_size;
    kiln_tile_span *span;
    float *weight;                /* normalized weights of every span, concatenated */
} kiln_tile_axis;

typedef struct {
    kiln_tile_opts opts;          /* as resolved (multiple filled in, tile clamped) */
    kiln_tile_axis axis[2];       /* [0]: rows (dim -2), [1]: columns (dim -1) */
    int count;                    /* axis[0].n * axis[1].n, numbered row-major */
} kiln_tile_plan;

typedef struct { int64_t y, x, h, w; } kiln_tile_rect;

/* Plans the tiles of a height x width input. Errors (KILN_ERR_ARG) name the bad
 * option: sizes not divisible by the scale's denominator, overlap >= tile, ... */
kiln_status kiln_tile_plan_new(int64_t height, int64_t width, const kiln_tile_opts *o,
                               kiln_tile_plan **out);
void kiln_tile_plan_free(kiln_tile_plan *p);
/* Input and output rectangles of tile i (0 <= i < count); either pointer may be NULL. */
void kiln_tile_rects(const kiln_tile_plan *p, int i, kiln_tile_rect *in, kiln_tile_rect *out);
/* Feather weight of tile i at output pixel (y, x) relative to the tile (tests, tools). */
float kiln_tile_weight(const kiln_tile_plan *p, int i, int64_t y, int64_t x);

/* A view of tile i of x (the last two dims narrowed). */
kiln_status kiln_tile_input(const kiln_tile_plan *p, const kiln_tensor *x, int i, kiln_tensor **out);
/* Checks y, the output of tile i of x, against the plan and (when not NULL) the
 * result: same ndim as x, the dims before the channel dim (ndim-3) equal to x's,
 * the channel dim equal to the result's, spatial size the tile's times the scale,
 * the result's device. The message names the tile and both shapes. */
kiln_status kiln_tile_check_output(const kiln_tile_plan *p, const kiln_tensor *x, int i,
                                   const kiln_tensor *y, const kiln_tensor *result);
/* A zeroed result for the plan: y's dtype, device and leading dims, output spatial size. */
kiln_status kiln_tile_result_new(const kiln_tile_plan *p, const kiln_tensor *y, kiln_tensor **out);
/* result[..., out rect of tile i] += y * weights. Host f32 results are accumulated in
 * place without temporaries; other devices / dtypes go through ops (three tile-size
 * temporaries). y must have passed kiln_tile_check_output. */
kiln_status kiln_tile_accumulate(const kiln_tile_plan *p, kiln_tensor *result, int i,
                                 const kiln_tensor *y);

/* The whole loop for C callers. fn gets a contiguous copy of each tile (freed after
 * the call) and returns a new tensor the loop owns; a non-OK status from fn stops
 * the loop and is returned as is. progress (optional) is called after each tile;
 * nonzero from it stops with KILN_ERR_CANCELLED. Nothing leaks on any error. */
typedef kiln_status (*kiln_tile_fn)(void *ctx, int index, const kiln_tensor *tile, kiln_tensor **out);
typedef int (*kiln_tile_progress_fn)(void *ctx, int done, int total);
kiln_status kiln_tile_map(const kiln_tensor *x, const kiln_tile_opts *o, kiln_tile_fn fn,
                          kiln_tile_progress_fn progress, void *ctx, kiln_tensor **out);

#endif

/* adapter_delta.h - the arithmetic of weight adapters (LoRA with LoCon's CP middle,
 * LyCORIS LoHa and LoKr, full differences, DoRA) on f32 host buffers, as ComfyUI's
 * weight_adapter computes them. The model store (model.c) decides when and where a
 * patched weight is built; this file only knows how a delta is made from factors. */
#ifndef KILN_ADAPTER_DELTA_H
#define KILN_ADAPTER_DELTA_H

#include "tensor.h"

/* ORDER ADAPTER: keep kind_names in adapter_delta.c in this order */
typedef enum { KILN_ADAPTER_LORA = 0, KILN_ADAPTER_LOHA, KILN_ADAPTER_LOKR, KILN_ADAPTER_DIFF,
               KILN_ADAPTER_COUNT } kiln_adapter_kind;

/* The factors of a patch, by role; the names (factor_names in adapter_delta.c, ORDER
 * FACTOR) are the Lua spec's field names.
 *   lora: up [out, r] | [out, r, 1, 1]; down [r, in...]; mid [r, r', kh, kw] (CP: down
 *         then [r', in, 1, 1])
 *   loha: w1a, w1b, w2a, w2b; with t1, t2 (CP) w1a is [r, out] and w1b [r', in]
 *   lokr: w1 or (w1a, w1b); w2 or (w2a, w2b) with optional t2
 *   diff: diff (any shape of the weight's element count) */
/* ORDER FACTOR */
typedef enum { KILN_AF_UP = 0, KILN_AF_DOWN, KILN_AF_MID, KILN_AF_W1A, KILN_AF_W1B, KILN_AF_W2A,
               KILN_AF_W2B, KILN_AF_T1, KILN_AF_T2, KILN_AF_W1, KILN_AF_W2, KILN_AF_DIFF,
               KILN_AF_DORA_SCALE, KILN_AF_COUNT } kiln_adapter_factor;

typedef struct {
    kiln_adapter_kind kind;
    /* multiplies the delta: the caller folds strength and alpha/rank into it */
    double scale;
    /* only with a dora_scale: the share of scale that mixes the normalized weight in
     * (ComfyUI's weight_decompose: the delta is scaled by scale/strength, normalized,
     * then mixed by strength). 0 is taken as 1 when scale is not 0. */
    double strength;
    /* factors (any float dtype; on a device readable from the host or copied for
     * the computation), NULL when absent */
    const kiln_tensor *f[KILN_AF_COUNT];
} kiln_adapter;

const char *kiln_adapter_kind_name(kiln_adapter_kind k);
/* -1 when unknown */
int kiln_adapter_kind_from_name(const char *name);
const char *kiln_adapter_factor_name(kiln_adapter_factor f);

/* Checks the factors a kind needs (present, not foreign to the kind, float, ranks
 * agreeing) and gives the shape of the delta before any reshape (a LoRA's is
 * [out, in, kh, kw] or [out, in]). Errors name the field. */
kiln_status kiln_adapter_delta_shape(const kiln_adapter *a, int *ndim, int64_t shape[KILN_MAX_DIMS]);

/* w (ndim, shape: the weight or its row slice, as many elements as the delta) +=
 * scale * delta, in f32; with a dora_scale, ComfyUI's weight_decompose instead (its
 * norm is over every dim but dim 1 of shape, so ndim >= 2 and dora_scale has shape[1]
 * elements). Temporaries come from the cpu allocator (counted, freed before
 * return); f32 factors in host memory are read where they lie. Callable from any
 * thread; must not be called with a lock the allocators' evict hook takes. */
kiln_status kiln_adapter_apply(const kiln_adapter *a, float *w, int ndim, const int64_t *shape);

/* Row by row: a patch whose delta's rows are independent (a LoRA without a CP mid, or a
 * full difference; no DoRA, whose norm needs every row) can add its delta a block of
 * rows at a time, so a copy is built in cache-sized pieces instead of through a whole
 * f32 tensor. begin converts the factors once (nrows x row_len: the weight region the
 * delta covers; KILN_ERR_UNSUPPORTED when the patch is not row by
 * row or its factors do not have that row length: then use kiln_adapter_apply); add
 * does w[0 .. nrows*row_len) += scale * delta rows r0 .. r0+nrows-1; end frees. */
typedef struct kiln_adapter_rows kiln_adapter_rows;
kiln_status kiln_adapter_rows_begin(const kiln_adapter *a, int64_t nrows, int64_t row_len, kiln_adapter_rows **out);
void kiln_adapter_rows_add(kiln_adapter_rows *r, float *w, int64_t r0, int64_t nrows);
void kiln_adapter_rows_end(kiln_adapter_rows *r);

#endif

/* quant.h - ggml's block-quantized weight formats (q8_0 ... q6_K), decoded to f32
 * exactly as their definitions say and encoded by ggml's reference quantizers, bit
 * for bit. (fp8, one byte an element, is an element type: dtype.h.)
 * layer 1 of the memory core: uses dtype; never calls convert. */
#ifndef KILN_QUANT_H
#define KILN_QUANT_H

#include "dtype.h"

/* n elements (a multiple of the type's block) of block type dt at src to f32. */
void kiln_quant_decode(float *dst, const void *src, kiln_dtype dt, size_t n);
/* n f32 values (a multiple of the block) to block type dt with ggml's reference
 * quantizer (quantize_row_*_ref). */
void kiln_quant_encode(void *dst, kiln_dtype dt, const float *src, size_t n);

#endif

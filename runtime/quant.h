/* quant.h - the low-bit weight formats: fp8 (e4m3fn, e5m2, one byte an element) and
 * ggml's block-quantized types (q8_0 ... q6_K), decoded to f32 exactly as their
 * definitions say and encoded by ggml's reference quantizers, bit for bit. */
#ifndef KILN_QUANT_H
#define KILN_QUANT_H

#include "dtype.h"

float kiln_f8_e4m3fn_to_f32(uint8_t b);
float kiln_f8_e5m2_to_f32(uint8_t b);
/* Round to nearest even. e4m3fn has no infinity: what rounds past 448 (and nan)
 * becomes nan, as PyTorch's conversion does; e5m2 overflows to inf. */
uint8_t kiln_f32_to_f8_e4m3fn(float f);
uint8_t kiln_f32_to_f8_e5m2(float f);

/* n elements (a multiple of the type's block) of block type dt at src to f32. */
void kiln_quant_decode(float *dst, const void *src, kiln_dtype dt, size_t n);
/* n f32 values (a multiple of the block) to block type dt with ggml's reference
 * quantizer (quantize_row_*_ref). */
void kiln_quant_encode(void *dst, kiln_dtype dt, const float *src, size_t n);

#endif

/* convert.h - conversions of arrays between any two dtypes (element types and block
 * formats alike): the one converter, above dtype.h and quant.h, so neither calls the
 * other.
 * layer 2 of the memory core: uses dtype, quant; never calls device, tensor. */
#ifndef KILN_CONVERT_H
#define KILN_CONVERT_H

#include "dtype.h"

/* Converts n contiguous elements; src and dst must not overlap unless dt equal. A
 * block type on either side needs n a multiple of its block (decoded or quantized
 * with the reference quantizer, quant.h). */
void kiln_convert(void *dst, kiln_dtype dst_dt, const void *src, kiln_dtype src_dt, size_t n);
/* Bulk float conversion to f32 (the hot path of f16/bf16/fp8/block weights). */
void kiln_to_f32(float *dst, const void *src, kiln_dtype src_dt, size_t n);

/* n values at once, bit for bit as kiln_f32_to_f16 (the hardware conversion where the
 * CPU has one) */
void kiln_f32_to_f16_array(uint16_t *dst, const float *src, size_t n);

#endif

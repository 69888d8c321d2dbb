/* dtype.h - element types and the conversions of one element.
 * f16 and bf16 conversions round to nearest even and keep subnormals, inf and nan.
 * layer 0 of the memory core: uses nothing; never calls quant, convert.
 * Whole arrays convert through convert.h; block formats are quant.h's. */
#ifndef KILN_DTYPE_H
#define KILN_DTYPE_H

#include "status.h"

/* ORDER DTYPE: keep kiln_dtype_info in dtype.c in this order */
typedef enum {
    KILN_F32 = 0,
    KILN_F16,
    KILN_BF16,
    KILN_I32,
    KILN_I64,
    KILN_U8,
    KILN_F8_E4M3FN,               /* fp8: one byte an element */
    KILN_F8_E5M2,
    KILN_Q8_0,                    /* ggml's block types: see quant.h */
    KILN_Q4_0,
    KILN_Q4_1,
    KILN_Q5_0,
    KILN_Q5_1,
    KILN_Q4_K,
    KILN_Q5_K,
    KILN_Q6_K,
    KILN_DTYPE_COUNT
} kiln_dtype;

/* Bytes of one element; 0 for a block type (and an invalid dtype), whose elements are
 * only addressable a block at a time. */
size_t kiln_dtype_size(kiln_dtype dt);
/* Elements per block (1 for the element types) and bytes per block. */
int kiln_dtype_block(kiln_dtype dt);
size_t kiln_dtype_block_bytes(kiln_dtype dt);
static inline int kiln_dtype_is_blocked(kiln_dtype dt) { return dt >= KILN_Q8_0 && dt < KILN_DTYPE_COUNT; }
/* Bytes of n elements (n a multiple of the block). */
size_t kiln_dtype_nbytes(kiln_dtype dt, int64_t n);
const char *kiln_dtype_name(kiln_dtype dt); /* "f32", "f16", ... */
/* Parses "f32"/"float32"/"F32" etc.; returns -1 when unknown. */
int kiln_dtype_from_name(const char *name);
int kiln_dtype_is_float(kiln_dtype dt);

float kiln_f16_to_f32(uint16_t h);
uint16_t kiln_f32_to_f16(float f);
float kiln_bf16_to_f32(uint16_t h);
uint16_t kiln_f32_to_bf16(float f);
float kiln_f8_e4m3fn_to_f32(uint8_t b);
float kiln_f8_e5m2_to_f32(uint8_t b);
/* Round to nearest even. e4m3fn has no infinity: what rounds past 448 (and nan)
 * becomes nan, as PyTorch's conversion does; e5m2 overflows to inf. */
uint8_t kiln_f32_to_f8_e4m3fn(float f);
uint8_t kiln_f32_to_f8_e5m2(float f);

/* The one scalar load of an element of any dtype as a number: exact for every
 * supported float and integer value but i64 beyond 2^53. Kernels keep their own
 * vector paths; everything that reads one element at a time (strided kernel
 * loops, kiln_convert's fallback, the Lua bindings' :table() and indexing) calls
 * this. Inline because it sits in per-element loops. */
static inline double kiln_dtype_load(kiln_dtype dt, const void *p)
{
    switch (dt) {
    case KILN_F32: return *(const float *)p;
    case KILN_F16: return kiln_f16_to_f32(*(const uint16_t *)p);
    case KILN_BF16: return kiln_bf16_to_f32(*(const uint16_t *)p);
    case KILN_I32: return *(const int32_t *)p;
    case KILN_I64: return (double)*(const int64_t *)p;
    case KILN_U8: return *(const uint8_t *)p;
    case KILN_F8_E4M3FN: return kiln_f8_e4m3fn_to_f32(*(const uint8_t *)p);
    case KILN_F8_E5M2: return kiln_f8_e5m2_to_f32(*(const uint8_t *)p);
    default: return 0;
    }
}

#endif

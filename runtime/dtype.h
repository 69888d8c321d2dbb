/* dtype.h - element types and conversions between them.
 * f16 and bf16 conversions round to nearest even and keep subnormals, inf and nan. */
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
    KILN_DTYPE_COUNT
} kiln_dtype;

KILN_API size_t kiln_dtype_size(kiln_dtype dt);
KILN_API const char *kiln_dtype_name(kiln_dtype dt); /* "f32", "f16", ... */
/* Parses "f32"/"float32"/"F32" etc.; returns -1 when unknown. */
KILN_API int kiln_dtype_from_name(const char *name);
KILN_API int kiln_dtype_is_float(kiln_dtype dt);

KILN_API float kiln_f16_to_f32(uint16_t h);
KILN_API uint16_t kiln_f32_to_f16(float f);
KILN_API float kiln_bf16_to_f32(uint16_t h);
KILN_API uint16_t kiln_f32_to_bf16(float f);

/* Converts n contiguous elements; src and dst must not overlap unless dt equal. */
KILN_API void kiln_convert(void *dst, kiln_dtype dst_dt, const void *src, kiln_dtype src_dt, size_t n);
/* Bulk float conversion to f32 (the hot path of f16/bf16 weights). */
KILN_API void kiln_to_f32(float *dst, const void *src, kiln_dtype src_dt, size_t n);

#endif

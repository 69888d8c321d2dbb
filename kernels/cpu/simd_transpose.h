/* simd_transpose.h - the in-register 16 x 16 float transpose shared by the CPU kernels
 * (GEMM packing, Winograd weight transform). Private to kernels/cpu; include only
 * inside an x86 GCC/Clang section (the function carries its own target attribute). */
#ifndef KILN_SIMD_TRANSPOSE_H
#define KILN_SIMD_TRANSPOSE_H

#include <immintrin.h>

/* r[i][j] becomes r[j][i]. */
static inline __attribute__((always_inline, target("avx512f"))) void transpose16(__m512 *r)
{
    __m512 t[16], u[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    /* u[4g + c], 128-bit lane L: column 4L + c of rows 4g..4g+3 */
#pragma GCC unroll 4
    for (int g4 = 0; g4 < 16; g4 += 4) {
        u[g4 + 0] = _mm512_shuffle_ps(t[g4], t[g4 + 2], 0x44);
        u[g4 + 1] = _mm512_shuffle_ps(t[g4], t[g4 + 2], 0xEE);
        u[g4 + 2] = _mm512_shuffle_ps(t[g4 + 1], t[g4 + 3], 0x44);
        u[g4 + 3] = _mm512_shuffle_ps(t[g4 + 1], t[g4 + 3], 0xEE);
    }
    /* 4 x 4 transpose of 128-bit lanes across u[c], u[4+c], u[8+c], u[12+c] */
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m512 v = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), w = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
        __m512 v2 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD), w2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_f32x4(v, w, 0x88);
        r[8 + c] = _mm512_shuffle_f32x4(v, w, 0xDD);
        r[4 + c] = _mm512_shuffle_f32x4(v2, w2, 0x88);
        r[12 + c] = _mm512_shuffle_f32x4(v2, w2, 0xDD);
    }
}

#endif

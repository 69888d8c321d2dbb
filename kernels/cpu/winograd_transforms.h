/* winograd_transforms.h - the transforms of Winograd F(6x6, 3x3), F(4x4, 3x3),
 * F(2x2, 3x3) and F(4x4, 2x2) (Lavin & Gray, "Fast Algorithms for Convolutional Neural
 * Networks", 2016) on 16 lanes of AVX-512: U = G g G^T (weights), V = B^T d B (input
 * tiles of 8x8 / 6x6 / 4x4 / 5x5), y = A^T m A (outputs 6x6 / 4x4 / 2x2 / 4x4). F(6,3)
 * interpolates at 0, +-1, +-2, +-1/2 and infinity, F(4,3) at 0, +-3/2, +-5/8 and
 * infinity (below: why not Lavin's 0, +-1, +-2), F(2,3) at 0, +-1 and infinity, F(4,2)
 * at 0, +-1, 1/2 and infinity (the least f32 error of the sets tried: 2.3e-6 of the
 * output range over 256 channels, against 4.5e-6 with 2 in place of 1/2). Shared by the two Winograd paths (conv2d_winograd.c: tiles in
 * lanes, F(6,3), F(4,3) and F(4,2); conv2d_winograd_few.c: channels in lanes, F(4,3)
 * and F(2,3)). Private to kernels/cpu; include inside an x86 GCC/Clang section. */
#ifndef KILN_WINOGRAD_TRANSFORMS_H
#define KILN_WINOGRAD_TRANSFORMS_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* Rows [0, kn) of 16 f16 weight taps each (rows rstride bytes apart) widened to f32 as
 * they are loaded, zero past kn: the weight transforms' common case, unrolled so that
 * the rows stay in registers for the transpose that follows. */
static inline __attribute__((always_inline, target("avx512f"))) void wino_f16_rows(__m512 *r, const char *src,
                                                                                 size_t rstride, int64_t kn)
{
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++)
        r[k] = k < kn ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(src + k * rstride)))
                      : _mm512_setzero_ps();
}

/* F(4,3) at the points 0, +-a, +-b and infinity, a = 3/2 (xi index 1, 2) and b = 5/8
 * (3, 4), in place of Lavin's 0, +-1, +-2: with M(x) = x (x^2 - a^2)(x^2 - b^2),
 *   G's row at p: (1, p, p^2) / prod_{q != p} (p - q), at 0: (1, 0, 0) / (a^2 b^2);
 *   B^T's row at p: the coefficients of M(x) / (x - p), at infinity those of M(x);
 *   A^T's column at p: (1, p, p^2, p^3), at infinity (0, 0, 0, 1).
 * Lavin's points put 2^3 = 8 into A^T, so a rounding of U or V at +-2 reached the output
 * up to 64-fold; a point and (near) the reciprocal of the other spread the magnification
 * evenly (Barabasz et al., "Error analysis and improving the accuracy of Winograd
 * convolution for deep neural networks", 2020). Chosen by simulating bf16-rounded U and V
 * over random operands (a grid of symmetric pairs; the root-mean-square error against the
 * exact convolution, relative to that of a direct convolution of bf16 operands): these
 * two are near the grid's best, and keep Lavin's even/odd structure (one add and one
 * subtract per pair of points). f32 gains too: its error falls as well (README: bf16
 * accuracy; tests/bench/JOURNAL.md has the simulation's table). The constants that are
 * not dyadic (1 / prod (p - q)) are rounded to f32: an f32-level error, far below bf16's. */
#define WINO_PA 1.5
#define WINO_PB 0.625
#define WINO_PA2 (WINO_PA * WINO_PA)
#define WINO_PB2 (WINO_PB * WINO_PB)
#define WINO_GA (1.0 / (2 * WINO_PA2 * (WINO_PA2 - WINO_PB2))) /* 1 / prod (a - q) = 1 / prod (-a - q) */
#define WINO_GB (1.0 / (2 * WINO_PB2 * (WINO_PB2 - WINO_PA2)))

/* G (6x3) applied to the 3 values of one column, for 16 lanes. */
#define G_APPLY(g0, g1, g2, o)                                                                                  \
    do {                                                                                                        \
        o[0] = _mm512_mul_ps(g0, _mm512_set1_ps((float)(1.0 / (WINO_PA2 * WINO_PB2))));                        \
        __m512 ea_ = _mm512_fmadd_ps(g0, _mm512_set1_ps((float)WINO_GA),                                        \
                                     _mm512_mul_ps(g2, _mm512_set1_ps((float)(WINO_GA * WINO_PA2))));           \
        __m512 fa_ = _mm512_mul_ps(g1, _mm512_set1_ps((float)(WINO_GA * WINO_PA)));                             \
        o[1] = _mm512_add_ps(ea_, fa_);                                                                         \
        o[2] = _mm512_sub_ps(ea_, fa_);                                                                         \
        __m512 eb_ = _mm512_fmadd_ps(g0, _mm512_set1_ps((float)WINO_GB),                                        \
                                     _mm512_mul_ps(g2, _mm512_set1_ps((float)(WINO_GB * WINO_PB2))));           \
        __m512 fb_ = _mm512_mul_ps(g1, _mm512_set1_ps((float)(WINO_GB * WINO_PB)));                             \
        o[3] = _mm512_add_ps(eb_, fb_);                                                                         \
        o[4] = _mm512_sub_ps(eb_, fb_);                                                                         \
        o[5] = g2;                                                                                              \
    } while (0)

/* B^T (6x6) applied to 6 values, for 16 lanes: rows a^2 b^2 d0 - (a^2 + b^2) d2 + d4 (at 0),
 * (d4 - b^2 d2) +- a (d3 - b^2 d1) (at +-a), the same with a and b swapped (at +-b),
 * a^2 b^2 d1 - (a^2 + b^2) d3 + d5 (at infinity). */
#define BT_APPLY(d, o)                                                                                          \
    do {                                                                                                        \
        const __m512 ab2_ = _mm512_set1_ps((float)(WINO_PA2 * WINO_PB2)), s2_ = _mm512_set1_ps((float)(WINO_PA2 + WINO_PB2)); \
        const __m512 a2_ = _mm512_set1_ps((float)WINO_PA2), b2_ = _mm512_set1_ps((float)WINO_PB2);             \
        o[0] = _mm512_fmadd_ps(ab2_, d[0], _mm512_fnmadd_ps(s2_, d[2], d[4]));                                  \
        o[5] = _mm512_fmadd_ps(ab2_, d[1], _mm512_fnmadd_ps(s2_, d[3], d[5]));                                  \
        __m512 pa_ = _mm512_fnmadd_ps(b2_, d[2], d[4]), qa_ = _mm512_fnmadd_ps(b2_, d[1], d[3]);               \
        o[1] = _mm512_fmadd_ps(_mm512_set1_ps((float)WINO_PA), qa_, pa_);                                       \
        o[2] = _mm512_fnmadd_ps(_mm512_set1_ps((float)WINO_PA), qa_, pa_);                                      \
        __m512 pb_ = _mm512_fnmadd_ps(a2_, d[2], d[4]), qb_ = _mm512_fnmadd_ps(a2_, d[1], d[3]);               \
        o[3] = _mm512_fmadd_ps(_mm512_set1_ps((float)WINO_PB), qb_, pb_);                                       \
        o[4] = _mm512_fnmadd_ps(_mm512_set1_ps((float)WINO_PB), qb_, pb_);                                      \
    } while (0)

/* A^T (4x6) applied to 6 values, for 16 lanes. */
#define AT_APPLY(m, o)                                                                                          \
    do {                                                                                                        \
        __m512 sa_ = _mm512_add_ps(m[1], m[2]), da_ = _mm512_sub_ps(m[1], m[2]);                                  \
        __m512 sb_ = _mm512_add_ps(m[3], m[4]), db_ = _mm512_sub_ps(m[3], m[4]);                                  \
        o[0] = _mm512_add_ps(_mm512_add_ps(m[0], sa_), sb_);                                                      \
        o[1] = _mm512_fmadd_ps(_mm512_set1_ps((float)WINO_PA), da_, _mm512_mul_ps(_mm512_set1_ps((float)WINO_PB), db_)); \
        o[2] = _mm512_fmadd_ps(_mm512_set1_ps((float)WINO_PA2), sa_, _mm512_mul_ps(_mm512_set1_ps((float)WINO_PB2), sb_)); \
        o[3] = _mm512_fmadd_ps(_mm512_set1_ps((float)(WINO_PA2 * WINO_PA)), da_,                                 \
                               _mm512_fmadd_ps(_mm512_set1_ps((float)(WINO_PB2 * WINO_PB)), db_, m[5]));        \
    } while (0)

/* F(2,3): G (4x3), B^T (4x4), A^T (2x4). */
#define G2_APPLY(g0, g1, g2, o)                                                                                 \
    do {                                                                                                        \
        __m512 s02_ = _mm512_add_ps(g0, g2), h_ = _mm512_set1_ps(0.5f);                                         \
        o[0] = g0;                                                                                              \
        o[1] = _mm512_mul_ps(_mm512_add_ps(s02_, g1), h_);                                                      \
        o[2] = _mm512_mul_ps(_mm512_sub_ps(s02_, g1), h_);                                                      \
        o[3] = g2;                                                                                              \
    } while (0)

#define BT2_APPLY(d, o)                                                                                         \
    do {                                                                                                        \
        o[0] = _mm512_sub_ps(d[0], d[2]);                                                                       \
        o[1] = _mm512_add_ps(d[1], d[2]);                                                                       \
        o[2] = _mm512_sub_ps(d[2], d[1]);                                                                       \
        o[3] = _mm512_sub_ps(d[1], d[3]);                                                                       \
    } while (0)

#define AT2_APPLY(m, o)                                                                                         \
    do {                                                                                                        \
        o[0] = _mm512_add_ps(_mm512_add_ps(m[0], m[1]), m[2]);                                                  \
        o[1] = _mm512_sub_ps(_mm512_sub_ps(m[1], m[2]), m[3]);                                                  \
    } while (0)

/* F(6,3): G (8x3), B^T (8x8), A^T (6x8); the matrices of NNPACK and wincnn, checked
 * against the direct convolution in float64 (error 4e-14). */
#define G8_APPLY(g0, g1, g2, o)                                                                                 \
    do {                                                                                                        \
        __m512 s02_ = _mm512_add_ps(g0, g2);                                                                     \
        o[0] = g0;                                                                                              \
        o[1] = _mm512_mul_ps(_mm512_add_ps(s02_, g1), _mm512_set1_ps(-2.0f / 9));                                \
        o[2] = _mm512_mul_ps(_mm512_sub_ps(s02_, g1), _mm512_set1_ps(-2.0f / 9));                                \
        __m512 p_ = _mm512_fmadd_ps(g0, _mm512_set1_ps(1.0f / 90), _mm512_mul_ps(g2, _mm512_set1_ps(2.0f / 45)));  \
        __m512 q_ = _mm512_mul_ps(g1, _mm512_set1_ps(1.0f / 45));                                                \
        o[3] = _mm512_add_ps(p_, q_);                                                                           \
        o[4] = _mm512_sub_ps(p_, q_);                                                                           \
        __m512 r_ = _mm512_fmadd_ps(g0, _mm512_set1_ps(32.0f / 45), _mm512_mul_ps(g2, _mm512_set1_ps(8.0f / 45))); \
        __m512 t_ = _mm512_mul_ps(g1, _mm512_set1_ps(16.0f / 45));                                               \
        o[5] = _mm512_add_ps(r_, t_);                                                                           \
        o[6] = _mm512_sub_ps(r_, t_);                                                                           \
        o[7] = g2;                                                                                              \
    } while (0)

#define BT8_APPLY(d, o)                                                                                         \
    do {                                                                                                        \
        o[0] = _mm512_fmadd_ps(_mm512_set1_ps(5.25f), _mm512_sub_ps(d[4], d[2]), _mm512_sub_ps(d[0], d[6]));     \
        o[7] = _mm512_fmadd_ps(_mm512_set1_ps(5.25f), _mm512_sub_ps(d[3], d[5]), _mm512_sub_ps(d[7], d[1]));     \
        __m512 a_ = _mm512_fmadd_ps(_mm512_set1_ps(-4.25f), d[4], _mm512_add_ps(d[2], d[6]));                    \
        __m512 b_ = _mm512_fmadd_ps(_mm512_set1_ps(-4.25f), d[3], _mm512_add_ps(d[1], d[5]));                    \
        o[1] = _mm512_add_ps(a_, b_);                                                                           \
        o[2] = _mm512_sub_ps(a_, b_);                                                                           \
        __m512 c_ = _mm512_fmadd_ps(_mm512_set1_ps(-1.25f), d[4], _mm512_fmadd_ps(_mm512_set1_ps(0.25f), d[2], d[6])); \
        __m512 e_ = _mm512_fmadd_ps(_mm512_set1_ps(2.0f), d[5],                                                  \
                                    _mm512_fmadd_ps(_mm512_set1_ps(-2.5f), d[3], _mm512_mul_ps(_mm512_set1_ps(0.5f), d[1]))); \
        o[3] = _mm512_add_ps(c_, e_);                                                                           \
        o[4] = _mm512_sub_ps(c_, e_);                                                                           \
        __m512 f_ = _mm512_fmadd_ps(_mm512_set1_ps(-5.0f), d[4], _mm512_fmadd_ps(_mm512_set1_ps(4.0f), d[2], d[6])); \
        __m512 h_ = _mm512_fmadd_ps(_mm512_set1_ps(0.5f), d[5],                                                  \
                                    _mm512_fmadd_ps(_mm512_set1_ps(-2.5f), d[3], _mm512_mul_ps(_mm512_set1_ps(2.0f), d[1]))); \
        o[5] = _mm512_add_ps(f_, h_);                                                                           \
        o[6] = _mm512_sub_ps(f_, h_);                                                                           \
    } while (0)

#define AT6_APPLY(m, o)                                                                                         \
    do {                                                                                                        \
        __m512 s12_ = _mm512_add_ps(m[1], m[2]), d12_ = _mm512_sub_ps(m[1], m[2]);                                \
        __m512 s34_ = _mm512_add_ps(m[3], m[4]), d34_ = _mm512_sub_ps(m[3], m[4]);                                \
        __m512 s56_ = _mm512_add_ps(m[5], m[6]), d56_ = _mm512_sub_ps(m[5], m[6]);                                \
        o[0] = _mm512_add_ps(_mm512_add_ps(m[0], s12_), _mm512_add_ps(s34_, s56_));                               \
        o[1] = _mm512_fmadd_ps(_mm512_set1_ps(0.5f), d56_, _mm512_fmadd_ps(_mm512_set1_ps(2.0f), d34_, d12_));    \
        o[2] = _mm512_fmadd_ps(_mm512_set1_ps(0.25f), s56_, _mm512_fmadd_ps(_mm512_set1_ps(4.0f), s34_, s12_));   \
        o[3] = _mm512_fmadd_ps(_mm512_set1_ps(0.125f), d56_, _mm512_fmadd_ps(_mm512_set1_ps(8.0f), d34_, d12_));  \
        o[4] = _mm512_fmadd_ps(_mm512_set1_ps(0.0625f), s56_, _mm512_fmadd_ps(_mm512_set1_ps(16.0f), s34_, s12_)); \
        o[5] = _mm512_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(0.03125f), d56_,                                     \
                                             _mm512_fmadd_ps(_mm512_set1_ps(32.0f), d34_, d12_)), m[7]);         \
    } while (0)

/* F(4,2): G (5x2), B^T (5x5), A^T (4x5). The rows of B^T are scaled to small integers
 * and G's rows by the inverse factors (the products U . V are unchanged). */
#define G5_APPLY(g0, g1, o)                                                                                     \
    do {                                                                                                        \
        o[0] = g0;                                                                                              \
        o[1] = _mm512_mul_ps(_mm512_add_ps(g0, g1), _mm512_set1_ps(0.5f));                                       \
        o[2] = _mm512_mul_ps(_mm512_sub_ps(g1, g0), _mm512_set1_ps(1.0f / 6));                                   \
        o[3] = _mm512_fmadd_ps(g0, _mm512_set1_ps(-8.0f / 3), _mm512_mul_ps(g1, _mm512_set1_ps(-4.0f / 3)));      \
        o[4] = _mm512_mul_ps(g1, _mm512_set1_ps(0.5f));                                                          \
    } while (0)

#define BT5_APPLY(d, o)                                                                                         \
    do {                                                                                                        \
        __m512 t_ = _mm512_sub_ps(d[3], d[1]), two_ = _mm512_set1_ps(2.0f);                                      \
        o[0] = _mm512_fmadd_ps(two_, t_, _mm512_sub_ps(d[0], d[2]));                                             \
        o[1] = _mm512_fmadd_ps(two_, d[3], _mm512_sub_ps(d[2], d[1]));                                           \
        o[2] = _mm512_fmadd_ps(two_, d[3], _mm512_fnmadd_ps(_mm512_set1_ps(3.0f), d[2], d[1]));                  \
        o[3] = t_;                                                                                              \
        o[4] = _mm512_fmsub_ps(two_, _mm512_sub_ps(d[4], d[2]), t_);                                             \
    } while (0)

#define AT5_APPLY(m, o)                                                                                         \
    do {                                                                                                        \
        __m512 s12_ = _mm512_add_ps(m[1], m[2]), d12_ = _mm512_sub_ps(m[1], m[2]);                                \
        o[0] = _mm512_add_ps(_mm512_add_ps(m[0], s12_), m[3]);                                                    \
        o[1] = _mm512_fmadd_ps(_mm512_set1_ps(0.5f), m[3], d12_);                                                 \
        o[2] = _mm512_fmadd_ps(_mm512_set1_ps(0.25f), m[3], s12_);                                                \
        o[3] = _mm512_add_ps(_mm512_fmadd_ps(_mm512_set1_ps(0.125f), m[3], d12_), m[4]);                          \
    } while (0)

/* The transforms by input tile side A: 4 F(2,3), 5 F(4,2), 6 F(4,3), 8 F(6,3) (g_apply:
 * the 3x3 kernels only). A is a constant where these are inlined, so each variant
 * compiles to straight-line code. */
#define WINO_INLINE static inline __attribute__((always_inline, target("avx512f")))
WINO_INLINE void g_apply(int A, __m512 g0, __m512 g1, __m512 g2, __m512 *o)
{
    if (A == 8) G8_APPLY(g0, g1, g2, o);
    else if (A == 6) G_APPLY(g0, g1, g2, o);
    else G2_APPLY(g0, g1, g2, o);
}
WINO_INLINE void bt_apply(int A, const __m512 *d, __m512 *o)
{
    if (A == 8) BT8_APPLY(d, o);
    else if (A == 6) BT_APPLY(d, o);
    else if (A == 5) BT5_APPLY(d, o);
    else BT2_APPLY(d, o);
}
WINO_INLINE void at_apply(int A, const __m512 *m, __m512 *o)
{
    if (A == 8) AT6_APPLY(m, o);
    else if (A == 6) AT_APPLY(m, o);
    else if (A == 5) AT5_APPLY(m, o);
    else AT2_APPLY(m, o);
}

#endif

/* simd_exp.h - the vectorized exp shared by the CPU kernels (activations, norms):
 * n = round(x log2e), r = x - n ln2 in two parts (Cody-Waite), a degree-6 polynomial
 * fitted for relative error (~1e-7) on [-ln2/2, ln2/2]; AVX-512 scales by 2^n with
 * scalef (0 / inf come out of range by themselves), AVX2 builds 2^n in the exponent
 * field in two normal halves and sets 0 / inf outside. NaN propagates. Private to kernels/cpu;
 * include only inside an x86 GCC/Clang section (the functions carry their own
 * target attributes, so the file itself needs no -m flags). */
#ifndef KILN_SIMD_EXP_H
#define KILN_SIMD_EXP_H

#include <immintrin.h>
#include <math.h>

#define SIMD_EXP_AVX512 static inline __attribute__((always_inline, target("avx512f")))
#define SIMD_EXP_AVX2 static inline __attribute__((always_inline, target("avx2,fma")))

SIMD_EXP_AVX512 __m512 exp_avx512(__m512 x)
{
    x = _mm512_min_ps(_mm512_set1_ps(100.0f), x); /* constant first: NaN in x passes */
    x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(0.0013836842263117433f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.008374815806746483f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.04166822507977486f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.16666419804096222f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.49999991059303284f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

SIMD_EXP_AVX2 __m256 exp_avx2(__m256 x)
{
    __m256 lo = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
    __m256 hi = _mm256_cmp_ps(x, _mm256_set1_ps(88.7f), _CMP_GT_OQ);
    __m256 xc = _mm256_min_ps(_mm256_set1_ps(88.7f), x); /* constant first: NaN in x passes */
    xc = _mm256_max_ps(_mm256_set1_ps(-87.3f), xc);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(0.0013836842263117433f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.008374815806746483f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.04166822507977486f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.16666419804096222f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.49999991059303284f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* n in [-126, 128]: 2^n as 2^(n/2) twice keeps both factors normal */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i h1 = _mm256_srai_epi32(ni, 1);
    __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h1, _mm256_set1_epi32(127)), 23));
    __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h1), _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
    y = _mm256_andnot_ps(lo, y);
    return _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), hi);
}

#endif

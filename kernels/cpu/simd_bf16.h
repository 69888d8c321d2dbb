/* simd_bf16.h - f32 rounded to bf16 in AVX-512 lanes, and the pairs `vdpbf16ps` takes,
 * shared by the bf16 GEMM (gemm.c) and the attention's products (attention.c). Private
 * to kernels/cpu; include only inside an x86 GCC/Clang section (the functions carry their
 * own target attributes). */
#ifndef KILN_SIMD_BF16_H
#define KILN_SIMD_BF16_H

#include <immintrin.h>
#include <stdint.h>

#define SIMD_BF16_INLINE static inline __attribute__((always_inline, target("avx512f")))

/* x rounded to bf16 (nearest even, nan kept quiet), in the high half of each lane, as
 * vcvtneps2bf16 rounds: denormals (in and out) become zero of their sign, so that the
 * kernels that convert with the instruction and those that convert here agree bit for
 * bit. */
SIMD_BF16_INLINE __m512i bf16_hi(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x00400000));
    __mmask16 tiny = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000)); /* zero or denormal */
    r = _mm512_mask_and_epi32(r, tiny, u, _mm512_set1_epi32((int)0x80000000u));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}

/* Pair lanes from depth k (even: low half) and depth k+1 (odd: high half). */
SIMD_BF16_INLINE __m512i bf16_pair(__m512 even, __m512 odd)
{
    return _mm512_or_si512(_mm512_srli_epi32(bf16_hi(even), 16), bf16_hi(odd));
}

/* 32 consecutive values (lo: the first 16, hi: the next) as 16 pair lanes in memory
 * order, lane i = values (2i, 2i+1): what vcvtne2ps2bf16(hi, lo) gives, with the same
 * bits. */
SIMD_BF16_INLINE __m512i bf16_pairs_in_order(__m512 lo, __m512 hi)
{
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    return bf16_pair(_mm512_permutex2var_ps(lo, ie, hi), _mm512_permutex2var_ps(lo, io, hi));
}

/* ---- the same pairs with AVX512_BF16 (callers check kiln_cpu_has_bf16) ---- */
#define SIMD_BF16_NATIVE_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16")))

/* The vpermw index of bf16_pair_native: word 2l of a pair vector from word l (the even
 * values), word 2l+1 from word 16+l (the odd ones). Made once, outside the loops. */
SIMD_BF16_NATIVE_INLINE __m512i bf16_pair_index(void)
{
    int16_t il[32];
    for (int l = 0; l < 16; l++) il[2 * l] = (int16_t)l, il[2 * l + 1] = (int16_t)(16 + l);
    __m512i v;
    __builtin_memcpy(&v, il, sizeof il);
    return v;
}

/* bf16_pair by the instruction: vcvtne2ps2bf16 rounds both vectors (even's values to
 * words 0-15, odd's to 16-31), vpermw (idx: bf16_pair_index) interleaves them into pair
 * lanes; the same bits as bf16_pair. */
SIMD_BF16_NATIVE_INLINE __m512i bf16_pair_native(__m512 even, __m512 odd, __m512i idx)
{
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

#endif

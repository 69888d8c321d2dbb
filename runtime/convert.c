/* convert.c - conversions of arrays between any two dtypes: the one converter that
 * element types (dtype.h) and block formats (quant.h) meet in, with the hardware f16
 * paths and the fp8 tables that weights are converted through on every use.
 * layer 2 of the memory core: uses dtype, quant; never calls device, tensor. */
#include "convert.h"
#include "quant.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* f16 -> f32 for arrays: the hardware conversion (AVX-512F: 16 at a time, F16C: 8)
 * where the CPU has it - weights stored in f16 are converted on every use, so this
 * is on the hot path of every f16 checkpoint. A group holding a NaN goes through the
 * scalar code, which keeps the NaN's payload bit for bit (the instruction quiets a
 * signalling NaN; numpy and torch do not). Same results as kiln_f16_to_f32 for all
 * 65 536 inputs (tests/test_dtype.c). */
static void f16_to_f32_scalar(float *dst, const uint16_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = kiln_f16_to_f32(s[i]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define KILN_F16_SIMD 1

__attribute__((target("avx512f,avx2"))) static void f16_to_f32_avx512(float *dst, const uint16_t *s, size_t n)
{
    const __m256i abs_mask = _mm256_set1_epi16(0x7fff), inf = _mm256_set1_epi16(0x7c00);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(s + i));
        if (!_mm256_testz_si256(_mm256_cmpgt_epi16(_mm256_and_si256(h, abs_mask), inf), _mm256_set1_epi16(-1)))
            f16_to_f32_scalar(dst + i, s + i, 16);
        else
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(h));
    }
    f16_to_f32_scalar(dst + i, s + i, n - i);
}

__attribute__((target("f16c,avx2"))) static void f16_to_f32_f16c(float *dst, const uint16_t *s, size_t n)
{
    const __m128i abs_mask = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(0x7c00);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(s + i));
        if (!_mm_testz_si128(_mm_cmpgt_epi16(_mm_and_si128(h, abs_mask), inf), _mm_set1_epi16(-1)))
            f16_to_f32_scalar(dst + i, s + i, 8);
        else
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    f16_to_f32_scalar(dst + i, s + i, n - i);
}
#endif

/* f32 -> f16 for arrays, the reverse trip (every weight a LoRA patches, every f16 copy
 * of an f32 tensor): the hardware rounds to nearest even and makes subnormals and
 * infinities as kiln_f32_to_f16 does; a group holding an inf or a NaN goes through the
 * scalar code, which decides the NaN's payload. */
static void f32_to_f16_scalar(uint16_t *dst, const float *s, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = kiln_f32_to_f16(s[i]);
}

#ifdef KILN_F16_SIMD
__attribute__((target("avx512f,avx2"))) static void f32_to_f16_avx512(uint16_t *dst, const float *s, size_t n)
{
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(s + i);
        if (_mm512_cmpge_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), abs_mask), inf))
            f32_to_f16_scalar(dst + i, s + i, 16);
        else
            _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    f32_to_f16_scalar(dst + i, s + i, n - i);
}

__attribute__((target("f16c,avx2"))) static void f32_to_f16_f16c(uint16_t *dst, const float *s, size_t n)
{
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(s + i);
        __m256i a = _mm256_and_si256(_mm256_castps_si256(x), abs_mask);
        /* a >= inf  <=>  a > inf - 1 (both non-negative as signed 32-bit) */
        if (!_mm256_testz_si256(_mm256_cmpgt_epi32(a, _mm256_sub_epi32(inf, _mm256_set1_epi32(1))), _mm256_set1_epi32(-1)))
            f32_to_f16_scalar(dst + i, s + i, 8);
        else
            _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    f32_to_f16_scalar(dst + i, s + i, n - i);
}
#endif

/* 0 unknown, 1 scalar, 2 F16C, 3 AVX-512 (a benign race: every thread computes the same) */
static int f16_isa(void)
{
    static int isa;
#ifdef KILN_F16_SIMD
    if (!isa) {
        __builtin_cpu_init();
        /* F16C through cpuid: clang's __builtin_cpu_supports does not know "f16c" */
        unsigned a, b, c, d;
        int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
        isa = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") ? 3
            : f16c && __builtin_cpu_supports("avx2") ? 2 : 1;
    }
#else
    isa = 1;
#endif
    return isa;
}

static void f32_to_f16_array(uint16_t *dst, const float *s, size_t n)
{
#ifdef KILN_F16_SIMD
    int isa = f16_isa();
    if (isa == 3 && n >= 16) { f32_to_f16_avx512(dst, s, n); return; }
    if (isa >= 2 && n >= 8) { f32_to_f16_f16c(dst, s, n); return; }
#endif
    f32_to_f16_scalar(dst, s, n);
}

void kiln_f32_to_f16_array(uint16_t *dst, const float *src, size_t n) { f32_to_f16_array(dst, src, n); }

/* f32 -> bf16, nearest even, quiet nan (kiln_f32_to_bf16's rule), branch-free so the
 * compiler vectorizes it: every bf16 activation a kernel writes passes here. */
static void f32_to_bf16_array(uint16_t *dst, const float *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, s + i, 4);
        uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        uint32_t q = (u >> 16) | 0x40u;
        dst[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? q : r);
    }
}

static void f16_to_f32_array(float *dst, const uint16_t *s, size_t n)
{
#ifdef KILN_F16_SIMD
    int isa = f16_isa();
    if (isa == 3 && n >= 16) { f16_to_f32_avx512(dst, s, n); return; }
    if (isa >= 2 && n >= 8) { f16_to_f32_f16c(dst, s, n); return; }
#endif
    f16_to_f32_scalar(dst, s, n);
}

void kiln_to_f32(float *dst, const void *src, kiln_dtype dt, size_t n)
{
    switch (dt) {
    case KILN_F32: memmove(dst, src, n * 4); break;
    case KILN_F16: f16_to_f32_array(dst, src, n); break;
    case KILN_BF16: { const uint16_t *s = src; for (size_t i = 0; i < n; i++) dst[i] = bits_f32((uint32_t)s[i] << 16); break; }
    case KILN_I32: { const int32_t *s = src; for (size_t i = 0; i < n; i++) dst[i] = (float)s[i]; break; }
    case KILN_I64: { const int64_t *s = src; for (size_t i = 0; i < n; i++) dst[i] = (float)s[i]; break; }
    case KILN_U8: { const uint8_t *s = src; for (size_t i = 0; i < n; i++) dst[i] = (float)s[i]; break; }
    case KILN_F8_E4M3FN: case KILN_F8_E5M2: {
        /* a table of the 256 values: fp8 weights are converted on every use */
        static float lut[2][256];
        static _Atomic int ready[2];
        int k = dt == KILN_F8_E5M2;
        if (!ready[k]) {
            for (int b = 0; b < 256; b++) lut[k][b] = k ? kiln_f8_e5m2_to_f32((uint8_t)b) : kiln_f8_e4m3fn_to_f32((uint8_t)b);
            ready[k] = 1;
        }
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = lut[k][s[i]];
        break;
    }
    default:
        if (kiln_dtype_is_blocked(dt)) kiln_quant_decode(dst, src, dt, n);
        break;
    }
}

/* Conversions with a block type on one side go through f32 in pieces of this many
 * elements (a multiple of every block) so no conversion needs a heap buffer. */
enum { VIA_F32 = 2048 };

static void convert_blocked(void *dst, kiln_dtype ddt, const void *src, kiln_dtype sdt, size_t n)
{
    float buf[VIA_F32];
    for (size_t i = 0; i < n; i += VIA_F32) {
        size_t k = n - i < VIA_F32 ? n - i : VIA_F32;
        const void *s = (const char *)src + kiln_dtype_nbytes(sdt, (int64_t)i);
        void *d = (char *)dst + kiln_dtype_nbytes(ddt, (int64_t)i);
        kiln_to_f32(buf, s, sdt, k);
        if (kiln_dtype_is_blocked(ddt)) kiln_quant_encode(d, ddt, buf, k);
        else kiln_convert(d, ddt, buf, KILN_F32, k);
    }
}

/* Integer targets take the value truncated toward zero (as torch's .to(int)),
 * saturating and mapping nan to 0 so out-of-range input is never undefined behaviour. */
static int64_t to_i64_sat(double v, double lo, double hi)
{
    if (v != v) return 0;
    if (v <= lo) return (int64_t)lo;
    /* hi = 2^63 stands for INT64_MAX, which a double cannot hold */
    if (v >= hi) return hi >= 9223372036854775808.0 ? INT64_MAX : (int64_t)hi;
    return (int64_t)v;
}

void kiln_convert(void *dst, kiln_dtype ddt, const void *src, kiln_dtype sdt, size_t n)
{
    if (ddt == sdt) { memmove(dst, src, kiln_dtype_nbytes(ddt, (int64_t)n)); return; }
    if (kiln_dtype_is_blocked(ddt) || (kiln_dtype_is_blocked(sdt) && ddt != KILN_F32)) {
        convert_blocked(dst, ddt, src, sdt, n);
        return;
    }
    if (ddt == KILN_F32) { kiln_to_f32(dst, src, sdt, n); return; }
    if (ddt == KILN_F16 && sdt == KILN_F32) { f32_to_f16_array(dst, src, n); return; }
    if (ddt == KILN_BF16 && sdt == KILN_F32) { f32_to_bf16_array(dst, src, n); return; }
    if ((ddt == KILN_F8_E4M3FN || ddt == KILN_F8_E5M2) && (sdt == KILN_F32 || sdt == KILN_F16)) {
        /* storing weights as fp8: from f16 through a table of all 65536 inputs */
        uint8_t *d = dst;
        int k = ddt == KILN_F8_E5M2;
        if (sdt == KILN_F32) {
            const float *s = src;
            for (size_t i = 0; i < n; i++) d[i] = k ? kiln_f32_to_f8_e5m2(s[i]) : kiln_f32_to_f8_e4m3fn(s[i]);
            return;
        }
        static uint8_t *_Atomic lut[2];
        uint8_t *table = atomic_load(&lut[k]);
        if (!table) {
            uint8_t *t = malloc(65536);
            if (!t) {
                for (size_t i = 0; i < n; i++) {
                    float f = kiln_f16_to_f32(((const uint16_t *)src)[i]);
                    d[i] = k ? kiln_f32_to_f8_e5m2(f) : kiln_f32_to_f8_e4m3fn(f);
                }
                return;
            }
            for (int h = 0; h < 65536; h++) {
                float f = kiln_f16_to_f32((uint16_t)h);
                t[h] = k ? kiln_f32_to_f8_e5m2(f) : kiln_f32_to_f8_e4m3fn(f);
            }
            /* threads converting at once may each build one: the first published stays,
             * the others free theirs */
            uint8_t *none = NULL;
            if (atomic_compare_exchange_strong(&lut[k], &none, t)) table = t;
            else {
                free(t);
                table = none;
            }
        }
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) d[i] = table[s[i]];
        return;
    }
    if (ddt == KILN_F16 && (sdt == KILN_F8_E4M3FN || sdt == KILN_F8_E5M2)) {
        /* exact: every fp8 value is an f16 value (e5m2 is f16's upper byte) */
        static uint16_t lut[256];
        static _Atomic int ready;
        if (sdt == KILN_F8_E5M2) {
            for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = (uint16_t)(((const uint8_t *)src)[i] << 8);
            return;
        }
        if (!ready) {
            for (int b = 0; b < 256; b++) lut[b] = kiln_f32_to_f16(kiln_f8_e4m3fn_to_f32((uint8_t)b));
            ready = 1;
        }
        for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = lut[((const uint8_t *)src)[i]];
        return;
    }
    if (ddt == KILN_I64 && sdt == KILN_I32) {
        for (size_t i = 0; i < n; i++) ((int64_t *)dst)[i] = ((const int32_t *)src)[i];
        return;
    }
    for (size_t i = 0; i < n; i++) {
        double v = kiln_dtype_load(sdt, (const char *)src + i * kiln_dtype_size(sdt));
        /* i64 rounds to f32 directly (as torch does): via double it would round twice */
        float f = sdt == KILN_I64 ? (float)((const int64_t *)src)[i] : (float)v;
        switch (ddt) {
        case KILN_F16: ((uint16_t *)dst)[i] = kiln_f32_to_f16(f); break;
        case KILN_BF16: ((uint16_t *)dst)[i] = kiln_f32_to_bf16(f); break;
        case KILN_I32: ((int32_t *)dst)[i] = (int32_t)to_i64_sat(v, -2147483648.0, 2147483647.0); break;
        case KILN_I64:
            ((int64_t *)dst)[i] = sdt == KILN_I64 ? ((const int64_t *)src)[i]
                                                  : to_i64_sat(v, -9223372036854775808.0, 9223372036854775808.0);
            break;
        case KILN_U8: ((uint8_t *)dst)[i] = (uint8_t)to_i64_sat(v, 0, 255); break;
        case KILN_F8_E4M3FN: ((uint8_t *)dst)[i] = kiln_f32_to_f8_e4m3fn(f); break;
        case KILN_F8_E5M2: ((uint8_t *)dst)[i] = kiln_f32_to_f8_e5m2(f); break;
        default: break;
        }
    }
}

/* dtype.c - element sizes, names and the conversions of one element (f16/bf16 with
 * round to nearest even, subnormals, inf and nan handled bit-exactly as IEEE 754
 * requires; fp8 e4m3fn and e5m2). Arrays are convert.c's, blocks quant.c's.
 * layer 0 of the memory core: uses nothing; never calls quant, convert. */
#include "dtype.h"

#include <math.h>
#include <string.h>
#include <strings.h>

/* ORDER DTYPE */
static const struct { const char *name; size_t size; int is_float, block; size_t block_bytes; } dtype_info[KILN_DTYPE_COUNT] = {
    {"f32", 4, 1, 1, 4}, {"f16", 2, 1, 1, 2}, {"bf16", 2, 1, 1, 2}, {"i32", 4, 0, 1, 4}, {"i64", 8, 0, 1, 8},
    {"u8", 1, 0, 1, 1}, {"f8_e4m3fn", 1, 1, 1, 1}, {"f8_e5m2", 1, 1, 1, 1},
    {"q8_0", 0, 1, 32, 34}, {"q4_0", 0, 1, 32, 18}, {"q4_1", 0, 1, 32, 20}, {"q5_0", 0, 1, 32, 22},
    {"q5_1", 0, 1, 32, 24}, {"q4_k", 0, 1, 256, 144}, {"q5_k", 0, 1, 256, 176}, {"q6_k", 0, 1, 256, 210},
};

size_t kiln_dtype_size(kiln_dtype dt) { return (unsigned)dt < KILN_DTYPE_COUNT ? dtype_info[dt].size : 0; }
int kiln_dtype_block(kiln_dtype dt) { return (unsigned)dt < KILN_DTYPE_COUNT ? dtype_info[dt].block : 1; }
size_t kiln_dtype_block_bytes(kiln_dtype dt) { return (unsigned)dt < KILN_DTYPE_COUNT ? dtype_info[dt].block_bytes : 0; }
size_t kiln_dtype_nbytes(kiln_dtype dt, int64_t n)
{
    if ((unsigned)dt >= KILN_DTYPE_COUNT || n <= 0) return 0;
    return (size_t)(n / dtype_info[dt].block) * dtype_info[dt].block_bytes;
}
const char *kiln_dtype_name(kiln_dtype dt) { return (unsigned)dt < KILN_DTYPE_COUNT ? dtype_info[dt].name : "?"; }
int kiln_dtype_is_float(kiln_dtype dt) { return (unsigned)dt < KILN_DTYPE_COUNT && dtype_info[dt].is_float; }

int kiln_dtype_from_name(const char *name)
{
    static const struct { const char *alias; kiln_dtype dt; } aliases[] = {
        {"f32", KILN_F32}, {"float32", KILN_F32}, {"float", KILN_F32},
        {"f16", KILN_F16}, {"float16", KILN_F16}, {"half", KILN_F16},
        {"bf16", KILN_BF16}, {"bfloat16", KILN_BF16},
        {"i32", KILN_I32}, {"int32", KILN_I32}, {"int", KILN_I32},
        {"i64", KILN_I64}, {"int64", KILN_I64}, {"long", KILN_I64},
        {"u8", KILN_U8}, {"uint8", KILN_U8}, {"byte", KILN_U8},
        {"f8_e4m3fn", KILN_F8_E4M3FN}, {"float8_e4m3fn", KILN_F8_E4M3FN}, {"f8_e4m3", KILN_F8_E4M3FN},
        {"f8_e5m2", KILN_F8_E5M2}, {"float8_e5m2", KILN_F8_E5M2},
        {"q8_0", KILN_Q8_0}, {"q4_0", KILN_Q4_0}, {"q4_1", KILN_Q4_1}, {"q5_0", KILN_Q5_0}, {"q5_1", KILN_Q5_1},
        {"q4_k", KILN_Q4_K}, {"q5_k", KILN_Q5_K}, {"q6_k", KILN_Q6_K},
    };
    if (!name) return -1;
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
        if (strcasecmp(name, aliases[i].alias) == 0) return (int)aliases[i].dt;
    return -1;
}

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float kiln_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13)); /* inf / nan (payload kept) */
    if (exp == 0) {
        if (man == 0) return bits_f32(sign);
        /* subnormal: value = man * 2^-24, exact in f32 */
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t kiln_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) /* inf or nan: keep nan quiet and non-zero */
        return sign | 0x7c00 | (a > 0x7f800000u ? (uint16_t)(0x200 | ((a >> 13) & 0x3ff)) : 0);
    if (a >= 0x477ff000u) return sign | 0x7c00; /* rounds to >= 65520: overflow to inf */
    if (a < 0x38800000u) {
        /* result is subnormal or zero: value / 2^-24, rounded to nearest even */
        if (a < 0x33000000u) return sign; /* < 2^-25: rounds to 0 */
        uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000;
        int shift = 126 - (int)e; /* so that result = m >> (shift) with 2^-24 units */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return sign | (uint16_t)r;
    }
    /* normal: rebias exponent, round mantissa from 23 to 10 bits (nearest even) */
    uint32_t r = a - 0x38000000u; /* exponent -= 112 */
    uint32_t low = r & 0x1fff;
    r >>= 13;
    if (low > 0x1000 || (low == 0x1000 && (r & 1))) r++; /* carry may overflow into exp: correct */
    return sign | (uint16_t)r;
}

float kiln_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t kiln_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet nan */
    uint32_t lsb = (u >> 16) & 1;
    u += 0x7fffu + lsb; /* round to nearest even; overflow goes to inf correctly */
    return (uint16_t)(u >> 16);
}

/* ---- fp8 ---- */

float kiln_f8_e4m3fn_to_f32(uint8_t b)
{
    int sign = b & 0x80, e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) return sign ? -NAN : NAN;
    if (e == 0) v = (float)m * 0.001953125f; /* m * 2^-9 */
    else v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return sign ? -v : v;
}

float kiln_f8_e5m2_to_f32(uint8_t b) { return kiln_f16_to_f32((uint16_t)(b << 8)); }

/* Round |f| (finite, below the overflow bound) to nbits of mantissa with exponent
 * bias `bias` and subnormal unit 2^sub_exp; returns the code without sign. */
static uint32_t f8_round(float a, int mbits, int bias, int sub_exp)
{
    uint32_t u = f32_bits(a);
    int min_normal_exp = 1 - bias;
    if (a < ldexpf(1.0f, min_normal_exp)) /* subnormal: a multiple of 2^sub_exp, nearest even */
        return (uint32_t)rintf(ldexpf(a, -sub_exp));
    uint32_t r = u - ((uint32_t)(127 - bias) << 23);
    int drop = 23 - mbits;
    uint32_t low = r & ((1u << drop) - 1), half = 1u << (drop - 1);
    r >>= drop;
    if (low > half || (low == half && (r & 1))) r++;
    return r;
}

uint8_t kiln_f32_to_f8_e4m3fn(float f)
{
    uint8_t sign = (f32_bits(f) >> 24) & 0x80;
    float a = fabsf(f);
    if (a != a || a >= 480.0f) return sign | 0x7f;
    uint32_t r = f8_round(a, 3, 7, -9);
    return sign | (uint8_t)(r > 0x7f ? 0x7f : r); /* 0x7f: rounded past 448, nan */
}

uint8_t kiln_f32_to_f8_e5m2(float f)
{
    uint8_t sign = (f32_bits(f) >> 24) & 0x80;
    float a = fabsf(f);
    if (a != a) return sign | 0x7f;
    if (a >= 65536.0f) return sign | 0x7c;
    uint32_t r = f8_round(a, 2, 15, -16);
    return sign | (uint8_t)(r > 0x7c ? 0x7c : r);
}

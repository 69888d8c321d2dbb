/* rng.c - PyTorch-compatible CPU random numbers: ATen's mt19937 engine, and
 * torch.randn / torch.rand for float32 reproduced bit for bit (checked against
 * torch 1.13 by tests/golden/gen_randn.py). */
#include "rng.h"

#include <math.h>

/* The vectorized Box-Muller below must round every multiply and add exactly as
 * the compiled ATen code it mirrors. torch's AVX2 kernel is built with FMA and
 * GCC's default -ffp-contract=fast, which fuses each a*b followed by +c into one
 * fmadd; we call fmaf() at exactly those places (checked bit for bit against
 * torch 1.13: without them about 1% of values differ by one ulp) and forbid the
 * compiler from fusing anything else. clang honours the standard pragma; gcc
 * only contracts in GNU modes, so it is switched off for this file explicitly. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

enum { MT_N = 624, MT_M = 397 };
#define MT_MATRIX_A 0x9908b0dfu
#define MT_UPPER 0x80000000u
#define MT_LOWER 0x7fffffffu

/* at::mt19937 takes the seed as uint64 but initialises from its low 32 bits
 * (torch.manual_seed(2**32 + 5) equals torch.manual_seed(5)). manual_seed also
 * drops the cached second Box-Muller values. */
void kiln_rng_seed(kiln_rng *g, uint64_t seed)
{
    g->mt[0] = (uint32_t)(seed & 0xffffffffu);
    for (int j = 1; j < MT_N; j++)
        g->mt[j] = 1812433253u * (g->mt[j - 1] ^ (g->mt[j - 1] >> 30)) + (uint32_t)j;
    g->index = MT_N; /* the first draw regenerates the state, as ATen's left_ = 1 */
    g->has_next_double_normal = 0;
    g->next_double_normal = 0;
    g->has_next_float_normal = 0;
    g->next_float_normal = 0;
}

static void mt_next_state(kiln_rng *g)
{
    uint32_t *s = g->mt;
    for (int k = 0; k < MT_N; k++) {
        uint32_t y = (s[k] & MT_UPPER) | (s[(k + 1) % MT_N] & MT_LOWER);
        s[k] = s[(k + MT_M) % MT_N] ^ (y >> 1) ^ ((s[(k + 1) % MT_N] & 1u) ? MT_MATRIX_A : 0u);
    }
    g->index = 0;
}

uint32_t kiln_rng_u32(kiln_rng *g)
{
    if (g->index < 0 || g->index >= MT_N) mt_next_state(g);
    uint32_t y = g->mt[g->index++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

/* CPUGeneratorImpl::random64: the first 32-bit draw is the high word. */
uint64_t kiln_rng_u64(kiln_rng *g)
{
    uint64_t hi = kiln_rng_u32(g);
    uint64_t lo = kiln_rng_u32(g);
    return (hi << 32) | lo;
}

/* at::uniform_real_distribution<float>(0, 1): 24 random bits of one 32-bit draw. */
static float uniform_f32(kiln_rng *g)
{
    return (float)(kiln_rng_u32(g) & ((1u << 24) - 1)) * (1.0f / 16777216.0f);
}

/* at::uniform_real_distribution<double>(0, 1): 53 bits of one 64-bit draw. */
static double uniform_f64(kiln_rng *g)
{
    return (double)(kiln_rng_u64(g) & ((UINT64_C(1) << 53) - 1)) * (1.0 / 9007199254740992.0);
}

/* at::normal_distribution<double>(0, 1), used by torch for fewer than 16 floats:
 * each pair of uniforms gives r*cos (returned) and r*sin (cached in the generator
 * and returned by the next scalar normal, even one in a later torch call). */
static double normal_f64(kiln_rng *g)
{
    if (g->has_next_double_normal) {
        g->has_next_double_normal = 0;
        return g->next_double_normal;
    }
    const double pi = 3.14159265358979323846;
    double u1 = uniform_f64(g);
    double u2 = uniform_f64(g);
    double r = sqrt(-2.0 * log(1.0 - u2));
    double theta = 2.0 * pi * u1;
    g->next_double_normal = r * sin(theta);
    g->has_next_double_normal = 1;
    return r * cos(theta);
}

/* ---- the AVX2 path of ATen's normal_fill (numel >= 16) --------------------
 * ATen (x86-64 with AVX2) uses log256_ps and sincos256_ps from avx_mathfun.h,
 * the Cephes single-precision polynomials of Julien Pommier's sse_mathfun.
 * These scalar versions do the same float operations in the same order, fused
 * where the compiled vector code is; only the arguments that occur here are
 * handled (log of (0, 1], sincos of [0, 2pi)).
 * Not reproduced: ATen's non-AVX2 build (ATEN_CPU_CAPABILITY=default, ARM),
 * which uses libm logf/cosf/sinf in normal_fill_16 and so depends on the libm. */

static inline uint32_t f2u(float f) { union { float f; uint32_t u; } c; c.f = f; return c.u; }
static inline float u2f(uint32_t u) { union { float f; uint32_t u; } c; c.u = u; return c.f; }

static float cephes_logf(float x)
{
    int invalid = !(x > 0.0f); /* x <= 0 (or nan) gives nan, as the vector code's mask */
    if (x < u2f(0x00800000u)) x = u2f(0x00800000u); /* cut off subnormals */
    int32_t ei = (int32_t)(f2u(x) >> 23) - 0x7f;
    x = u2f((f2u(x) & ~0x7f800000u) | f2u(0.5f));
    float e = (float)ei;
    e = e + 1.0f;
    /* x < sqrt(1/2): e -= 1, x = x + x - 1; else x = x - 1 (as the masked vector ops) */
    int small = x < 0.707106781186547524f;
    float tmp = small ? x : 0.0f;
    x = x - 1.0f;
    e = e - (small ? 1.0f : 0.0f);
    x = x + tmp;
    float z = x * x;
    float y = 7.0376836292E-2f;
    y = fmaf(y, x, -1.1514610310E-1f);
    y = fmaf(y, x, 1.1676998740E-1f);
    y = fmaf(y, x, -1.2420140846E-1f);
    y = fmaf(y, x, 1.4249322787E-1f);
    y = fmaf(y, x, -1.6668057665E-1f);
    y = fmaf(y, x, 2.0000714765E-1f);
    y = fmaf(y, x, -2.4999993993E-1f);
    y = fmaf(y, x, 3.3333331174E-1f);
    y = y * x;
    y = fmaf(y, z, e * -2.12194440e-4f);
    y = fmaf(-z, 0.5f, y);
    x = x + y;
    x = fmaf(e, 0.693359375f, x);
    return invalid ? u2f(0xffffffffu) : x;
}

static void cephes_sincosf(float xin, float *s, float *c)
{
    uint32_t sign_sin = f2u(xin) & 0x80000000u;
    float x = u2f(f2u(xin) & 0x7fffffffu);
    float y = x * 1.27323954473516f; /* 4 / pi */
    int32_t j = (int32_t)y;          /* cvttps: truncation */
    j = (j + 1) & ~1;
    y = (float)j;
    uint32_t swap_sin = (uint32_t)(j & 4) << 29;
    int poly_sin = (j & 2) == 0; /* the sine polynomial gives the sine (else the cosine one) */
    x = fmaf(y, -0.78515625f, x);
    x = fmaf(y, -2.4187564849853515625e-4f, x);
    x = fmaf(y, -3.77489497744594108e-8f, x);
    uint32_t sign_cos = (uint32_t)(~(j - 2) & 4) << 29;
    sign_sin ^= swap_sin;

    float z = x * x;
    float yc = 2.443315711809948E-005f;
    yc = fmaf(yc, z, -1.388731625493765E-003f);
    yc = fmaf(yc, z, 4.166664568298827E-002f);
    yc = yc * z;
    yc = fmaf(yc, z, -(z * 0.5f));
    yc = yc + 1.0f;

    float ys = -1.9515295891E-4f;
    ys = fmaf(ys, z, 8.3321608736E-3f);
    ys = fmaf(ys, z, -1.6666654611E-1f);
    ys = ys * z;
    ys = fmaf(ys, x, x);

    /* the vector code adds the selected polynomial to +0.0f, which turns -0 into +0 */
    float vs = poly_sin ? 0.0f + ys : yc + 0.0f;
    float vc = poly_sin ? yc + 0.0f : 0.0f + ys;
    *s = u2f(f2u(vs) ^ sign_sin);
    *c = u2f(f2u(vc) ^ sign_cos);
}

/* normal_fill_16_AVX2 with mean 0, std 1: data[0..7] become r*cos, data[8..15] r*sin. */
static void normal_fill_16(float *data)
{
    const float two_pi = (float)(2.0f * 3.14159265358979323846);
    for (int j = 0; j < 8; j++) {
        float u1 = 1.0f - data[j];
        float u2 = data[j + 8];
        float radius = sqrtf(-2.0f * cephes_logf(u1));
        float theta = two_pi * u2;
        float sn, cs;
        cephes_sincosf(theta, &sn, &cs);
        /* fmadd(n, std = 1, mean = 0): exact, except that -0 becomes +0 */
        data[j] = radius * cs + 0.0f;
        data[j + 8] = radius * sn + 0.0f;
    }
}

void kiln_rng_randn_f32(kiln_rng *g, float *out, int64_t n)
{
    if (!g || !out || n <= 0) return;
    if (n < 16) {
        /* transformation::normal(v, mean 0, std 1) = v * 1 + 0: turns -0 into +0 */
        for (int64_t i = 0; i < n; i++) out[i] = (float)(normal_f64(g) + 0.0);
        return;
    }
    for (int64_t i = 0; i < n; i++) out[i] = uniform_f32(g);
    for (int64_t i = 0; i + 16 <= n; i += 16) normal_fill_16(out + i);
    if (n % 16 != 0) {
        /* ATen redraws the last 16 uniforms and recomputes them (overwriting
         * normals of the previous block). */
        float *d = out + n - 16;
        for (int i = 0; i < 16; i++) d[i] = uniform_f32(g);
        normal_fill_16(d);
    }
}

void kiln_rng_rand_f32(kiln_rng *g, float *out, int64_t n)
{
    if (!g || !out || n <= 0) return;
    for (int64_t i = 0; i < n; i++) out[i] = uniform_f32(g);
}

/* quant.c - ggml's block formats.
 * layer 1 of the memory core: uses dtype; never calls convert.
 * Decoding and the reference quantizers keep
 * the formats' float arithmetic in the same order (each product and sum rounded to
 * f32 where the definition rounds it), so results match ggml bit for bit. Nothing
 * here may fuse a*b+c into one rounding: GCC's -std=c11 turns contraction off, and
 * this file has no FMA target (tests/test_gguf.c would notice).
 * Block layouts (little-endian, f16 scales), elements per block / bytes per block:
 *   q4_0 32/18: d, qs[16]             q4_1 32/20: d, m, qs[16]
 *   q5_0 32/22: d, qh[4], qs[16]      q5_1 32/24: d, m, qh[4], qs[16]
 *   q8_0 32/34: d, int8 qs[32]
 *   q4_K 256/144: d, dmin, scales[12], qs[128]
 *   q5_K 256/176: d, dmin, scales[12], qh[32], qs[128]
 *   q6_K 256/210: ql[128], qh[64], int8 scales[16], d */
#include "quant.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* ---- decoding ---- */

static inline float half_at(const uint8_t *p) { return kiln_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }
static inline void half_put(uint8_t *p, float f) { uint16_t h = kiln_f32_to_f16(f); p[0] = (uint8_t)h; p[1] = (uint8_t)(h >> 8); }

static void dec_q4_0(float *y, const uint8_t *b)
{
    float d = half_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 15) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void dec_q4_1(float *y, const uint8_t *b)
{
    float d = half_at(b), m = half_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 15) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static void dec_q5_0(float *y, const uint8_t *b)
{
    float d = half_at(b);
    uint32_t qh = (uint32_t)b[2] | (uint32_t)b[3] << 8 | (uint32_t)b[4] << 16 | (uint32_t)b[5] << 24;
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        y[j] = (float)(((qs[j] & 15) | h0 << 4) - 16) * d;
        y[j + 16] = (float)(((qs[j] >> 4) | h1 << 4) - 16) * d;
    }
}

static void dec_q5_1(float *y, const uint8_t *b)
{
    float d = half_at(b), m = half_at(b + 2);
    uint32_t qh = (uint32_t)b[4] | (uint32_t)b[5] << 8 | (uint32_t)b[6] << 16 | (uint32_t)b[7] << 24;
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        y[j] = (float)((qs[j] & 15) | h0 << 4) * d + m;
        y[j + 16] = (float)((qs[j] >> 4) | h1 << 4) * d + m;
    }
}

static void dec_q8_0(float *y, const uint8_t *b)
{
    float d = half_at(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* The 6-bit scale and min of sub-block j (of 8) packed in 12 bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m)
{
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (uint8_t)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void dec_q4_k(float *y, const uint8_t *b)
{
    float d = half_at(b), mn = half_at(b + 2);
    const uint8_t *sc = b + 4, *q = b + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
        uint8_t s, m;
        scale_min_k4(is, sc, &s, &m);
        float d1 = d * (float)s, m1 = mn * (float)m;
        scale_min_k4(is + 1, sc, &s, &m);
        float d2 = d * (float)s, m2 = mn * (float)m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 15) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
    }
}

static void dec_q5_k(float *y, const uint8_t *b)
{
    float d = half_at(b), mn = half_at(b + 2);
    const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + 48;
    unsigned u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
        uint8_t s, m;
        scale_min_k4(is, sc, &s, &m);
        float d1 = d * (float)s, m1 = mn * (float)m;
        scale_min_k4(is + 1, sc, &s, &m);
        float d2 = d * (float)s, m2 = mn * (float)m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 15) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
}

static void dec_q6_k(float *y, const uint8_t *b)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_at(b + 208);
    for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

void kiln_quant_decode(float *dst, const void *src, kiln_dtype dt, size_t n)
{
    const uint8_t *s = src;
    size_t blk = (size_t)kiln_dtype_block(dt), bytes = kiln_dtype_block_bytes(dt);
    void (*dec)(float *, const uint8_t *) = NULL;
    switch (dt) {
    case KILN_Q4_0: dec = dec_q4_0; break;
    case KILN_Q4_1: dec = dec_q4_1; break;
    case KILN_Q5_0: dec = dec_q5_0; break;
    case KILN_Q5_1: dec = dec_q5_1; break;
    case KILN_Q8_0: dec = dec_q8_0; break;
    case KILN_Q4_K: dec = dec_q4_k; break;
    case KILN_Q5_K: dec = dec_q5_k; break;
    case KILN_Q6_K: dec = dec_q6_k; break;
    default: return;
    }
    for (size_t i = 0; i + blk <= n; i += blk, s += bytes) dec(dst + i, s);
}

/* ---- reference quantizers ---- */

/* Nearest integer, ties to even (ggml's nearest_int for |x| < 2^22). */
static inline int nearest_int(float x) { return (int)lrintf(x); }
#define MINI(a, b) ((a) < (b) ? (a) : (b))
#define MAXI(a, b) ((a) > (b) ? (a) : (b))

static void enc_q4_0(uint8_t *b, const float *x)
{
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
    float d = max / -8, id = d != 0 ? 1.0f / d : 0.0f;
    half_put(b, d);
    for (int j = 0; j < 16; j++) {
        int a = MINI(15, (int)(x[j] * id + 8.5f)), c = MINI(15, (int)(x[j + 16] * id + 8.5f));
        b[2 + j] = (uint8_t)(a | c << 4);
    }
}

static void enc_q4_1(uint8_t *b, const float *x)
{
    float mn = FLT_MAX, mx = -FLT_MAX;
    for (int j = 0; j < 32; j++) {
        if (x[j] < mn) mn = x[j];
        if (x[j] > mx) mx = x[j];
    }
    float d = (mx - mn) / 15, id = d != 0 ? 1.0f / d : 0.0f;
    half_put(b, d);
    half_put(b + 2, mn);
    for (int j = 0; j < 16; j++) {
        int a = MINI(15, (int)((x[j] - mn) * id + 0.5f)), c = MINI(15, (int)((x[j + 16] - mn) * id + 0.5f));
        b[4 + j] = (uint8_t)(a | c << 4);
    }
}

static void put_qh(uint8_t *p, uint32_t qh)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(qh >> (8 * i));
}

static void enc_q5_0(uint8_t *b, const float *x)
{
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
    float d = max / -16, id = d != 0 ? 1.0f / d : 0.0f;
    half_put(b, d);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        int a = MINI(31, (int)(x[j] * id + 16.5f)), c = MINI(31, (int)(x[j + 16] * id + 16.5f));
        b[6 + j] = (uint8_t)((a & 15) | (c & 15) << 4);
        qh |= (uint32_t)(a >> 4 & 1) << j;
        qh |= (uint32_t)(c >> 4 & 1) << (j + 16);
    }
    put_qh(b + 2, qh);
}

static void enc_q5_1(uint8_t *b, const float *x)
{
    float mn = FLT_MAX, mx = -FLT_MAX;
    for (int j = 0; j < 32; j++) {
        if (x[j] < mn) mn = x[j];
        if (x[j] > mx) mx = x[j];
    }
    float d = (mx - mn) / 31, id = d != 0 ? 1.0f / d : 0.0f;
    half_put(b, d);
    half_put(b + 2, mn);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        int a = (uint8_t)((x[j] - mn) * id + 0.5f), c = (uint8_t)((x[j + 16] - mn) * id + 0.5f);
        b[8 + j] = (uint8_t)((a & 15) | (c & 15) << 4);
        qh |= (uint32_t)(a >> 4 & 1) << j;
        qh |= (uint32_t)(c >> 4 & 1) << (j + 16);
    }
    put_qh(b + 4, qh);
}

static void enc_q8_0(uint8_t *b, const float *x)
{
    float amax = 0;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
    half_put(b, d);
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* Scale and min for n values in [0, nmax] minimising the weighted squared error
 * over a small grid of scales (ggml's make_qkx2_quants, use_mad false). */
static float qkx2(int n, int nmax, const float *x, const float *w, uint8_t *L, float *the_min, uint8_t *Laux,
                  float rmin, float rdelta, int nstep)
{
    float mn = x[0], mx = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (mn > 0) mn = 0;
    if (mx == mn) {
        memset(L, 0, (size_t)n);
        *the_min = -mn;
        return 0.0f;
    }
    float iscale = nmax / (mx - mn), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * (x[i] - mn));
        L[i] = (uint8_t)MAXI(0, MINI(nmax, l));
        float diff = scale * L[i] + mn - x[i];
        best += w[i] * (diff * diff);
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (mx - mn);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * (x[i] - mn));
            l = MAXI(0, MINI(nmax, l));
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                cur += w[i] * (diff * diff);
            }
            if (cur < best) {
                memcpy(L, Laux, (size_t)n);
                best = cur;
                scale = this_scale;
                mn = this_min;
            }
        }
    }
    *the_min = -mn;
    return scale;
}

/* q4_K and q5_K share everything but the number of levels and the bit packing. */
static void enc_kx(uint8_t *b, const float *x, int nmax, float rmin, float rdelta, int nstep, uint8_t *L)
{
    uint8_t Laux[32];
    float w[32], mins[8], scales[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = qkx2(32, nmax, x + 32 * j, w, L + 32 * j, &mins[j], Laux, rmin, rdelta, nstep);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t *sc = b + 4;
    for (int j = 0; j < 8; j++) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]), lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = MINI(63, ls);
        lm = MINI(63, lm);
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 15) | (lm & 15) << 4);
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    half_put(b, max_scale / 63.f);
    half_put(b + 2, max_min / 63.f);
    float d_all = half_at(b), dmin_all = half_at(b + 2);
    for (int j = 0; j < 8; j++) {
        uint8_t s, m;
        scale_min_k4(j, sc, &s, &m);
        float d = d_all * s;
        if (d == 0) continue;
        float dm = dmin_all * m;
        for (int i = 0; i < 32; i++) {
            int l = nearest_int((x[32 * j + i] + dm) / d);
            L[32 * j + i] = (uint8_t)MAXI(0, MINI(nmax, l));
        }
    }
}

static void enc_q4_k(uint8_t *b, const float *x)
{
    uint8_t L[256];
    memset(b, 0, 144);
    enc_kx(b, x, 15, -1.f, 0.1f, 20, L);
    uint8_t *q = b + 16;
    for (int j = 0; j < 256; j += 64, q += 32)
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | L[j + l + 32] << 4);
}

static void enc_q5_k(uint8_t *b, const float *x)
{
    uint8_t L[256];
    memset(b, 0, 176);
    enc_kx(b, x, 31, -0.5f, 0.1f, 15, L);
    uint8_t *qh = b + 16, *ql = b + 48, m1 = 1, m2 = 2;
    for (int n = 0; n < 256; n += 64, m1 <<= 2, m2 <<= 2, ql += 32)
        for (int j = 0; j < 32; j++) {
            int l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
            if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
            ql[j] = (uint8_t)(l1 | l2 << 4);
        }
}

/* Symmetric scale for n values in [-nmax, nmax-1] (ggml's make_qx_quants with
 * rmse_type 1 and no weights: w = x^2, then a search over 18 nearby scales). */
static float qx(int n, int nmax, const float *x, int8_t *L)
{
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }
    if (amax < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = -nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * x[i]);
        l = MAXI(-nmax, MINI(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 != 0 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * x[i]);
            l = MAXI(-nmax, MINI(nmax - 1, l));
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) {
                int l = nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + MAXI(-nmax, MINI(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

static void enc_q6_k(uint8_t *b, const float *x)
{
    int8_t L[256];
    float scales[16], max_scale = 0, max_abs = 0;
    memset(b, 0, 210);
    for (int ib = 0; ib < 16; ib++) {
        scales[ib] = qx(16, 32, x + 16 * ib, L + 16 * ib);
        if (fabsf(scales[ib]) > max_abs) { max_abs = fabsf(scales[ib]); max_scale = scales[ib]; }
    }
    if (max_abs < 1e-15f) return; /* all zero: d = 0 */
    float iscale = -128.f / max_scale;
    half_put(b + 208, 1 / iscale);
    int8_t *sc = (int8_t *)(b + 192);
    for (int ib = 0; ib < 16; ib++) sc[ib] = (int8_t)MINI(127, nearest_int(iscale * scales[ib]));
    float dall = half_at(b + 208);
    for (int j = 0; j < 16; j++) {
        float d = dall * sc[j];
        if (d == 0) continue;
        for (int i = 0; i < 16; i++) {
            int l = nearest_int(x[16 * j + i] / d);
            L[16 * j + i] = (int8_t)(MAXI(-32, MINI(31, l)) + 32);
        }
    }
    uint8_t *ql = b, *qh = b + 128;
    for (int j = 0; j < 256; j += 128, ql += 64, qh += 32)
        for (int l = 0; l < 32; l++) {
            uint8_t q1 = L[j + l] & 15, q2 = L[j + l + 32] & 15, q3 = L[j + l + 64] & 15, q4 = L[j + l + 96] & 15;
            ql[l] = (uint8_t)(q1 | q3 << 4);
            ql[l + 32] = (uint8_t)(q2 | q4 << 4);
            qh[l] = (uint8_t)((L[j + l] >> 4) | (L[j + l + 32] >> 4) << 2 | (L[j + l + 64] >> 4) << 4 |
                              (L[j + l + 96] >> 4) << 6);
        }
}

void kiln_quant_encode(void *dst, kiln_dtype dt, const float *src, size_t n)
{
    uint8_t *d = dst;
    size_t blk = (size_t)kiln_dtype_block(dt), bytes = kiln_dtype_block_bytes(dt);
    void (*enc)(uint8_t *, const float *) = NULL;
    switch (dt) {
    case KILN_Q4_0: enc = enc_q4_0; break;
    case KILN_Q4_1: enc = enc_q4_1; break;
    case KILN_Q5_0: enc = enc_q5_0; break;
    case KILN_Q5_1: enc = enc_q5_1; break;
    case KILN_Q8_0: enc = enc_q8_0; break;
    case KILN_Q4_K: enc = enc_q4_k; break;
    case KILN_Q5_K: enc = enc_q5_k; break;
    case KILN_Q6_K: enc = enc_q6_k; break;
    default: return;
    }
    for (size_t i = 0; i + blk <= n; i += blk, d += bytes) enc(d, src + i);
}

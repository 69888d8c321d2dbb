/* dequant.cu - low-bit weights on CUDA: fp8 and ggml's block types decoded to f32,
 * f16 or bf16 (a GEMM in half activations), one thread an element, before a GEMM or convolution uses them (kiln_cuda_copy
 * sends every low-bit source here). Same values as runtime/quant.c: each product and
 * difference is rounded on its own (the _rn intrinsics keep nvcc from fusing them). */
#include "cuda_dev.h"

__device__ __forceinline__ float half_at(const uint8_t *p)
{
    return __half2float(__ushort_as_half((unsigned short)(p[0] | p[1] << 8)));
}

__device__ __forceinline__ void scale_min_k4(int j, const uint8_t *q, int *d, int *m)
{
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* element i of a tensor of dtype dt at s */
__device__ float decode_elem(const uint8_t *s, int dt, int64_t i)
{
    switch (dt) {
    case KILN_F8_E4M3FN: return kiln_f8_e4m3fn_decode(s[i]);
    case KILN_F8_E5M2: return __half2float(__ushort_as_half((unsigned short)(s[i] << 8)));
    case KILN_Q8_0: {
        const uint8_t *b = s + (i / 32) * 34;
        return __fmul_rn((float)(int8_t)b[2 + i % 32], half_at(b));
    }
    case KILN_Q4_0: case KILN_Q4_1: case KILN_Q5_0: case KILN_Q5_1: {
        int size = dt == KILN_Q4_0 ? 18 : dt == KILN_Q4_1 ? 20 : dt == KILN_Q5_0 ? 22 : 24;
        const uint8_t *b = s + (i / 32) * size;
        int j = (int)(i % 32), hasm = dt == KILN_Q4_1 || dt == KILN_Q5_1, five = dt == KILN_Q5_0 || dt == KILN_Q5_1;
        const uint8_t *qs = b + 2 + (hasm ? 2 : 0) + (five ? 4 : 0);
        int q = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
        if (five) {
            const uint8_t *qh = b + 2 + (hasm ? 2 : 0);
            uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
            q |= (int)((h >> j) & 1) << 4;
        }
        float d = half_at(b);
        if (hasm) return __fadd_rn(__fmul_rn((float)q, d), half_at(b + 2));
        return __fmul_rn((float)(q - (five ? 16 : 8)), d);
    }
    case KILN_Q4_K: case KILN_Q5_K: {
        int five = dt == KILN_Q5_K;
        const uint8_t *b = s + (i / 256) * (five ? 176 : 144);
        int j = (int)(i % 256), c = j / 64, hi = (j % 64) >= 32, l = j % 32, sc, m;
        scale_min_k4(2 * c + hi, b + 4, &sc, &m);
        const uint8_t *qs = b + (five ? 48 : 16) + 32 * c;
        int q = hi ? qs[l] >> 4 : qs[l] & 15;
        if (five && (b[16 + l] & ((hi ? 2 : 1) << (2 * c)))) q += 16;
        float d1 = __fmul_rn(half_at(b), (float)sc), m1 = __fmul_rn(half_at(b + 2), (float)m);
        return __fsub_rn(__fmul_rn(d1, (float)q), m1);
    }
    case KILN_Q6_K: {
        const uint8_t *b = s + (i / 256) * 210;
        int j = (int)(i % 256), n = j / 128, k = (j % 128) / 32, l = j % 32;
        const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
        const int8_t *sc = (const int8_t *)(b + 192) + 8 * n;
        int lo = k & 1 ? ql[l + 32] : ql[l];
        lo = k < 2 ? lo & 15 : lo >> 4;
        int q = (lo | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
        return __fmul_rn(__fmul_rn(half_at(b + 208), (float)sc[l / 16 + 2 * k]), (float)q);
    }
    default: return 0.0f;
    }
}

__global__ void dequant_k(char *d, int ddt, const uint8_t *s, int sdt, int64_t n)
{
    KILN_GRID_STRIDE(i, n) {
        float v = decode_elem(s, sdt, i);
        if (ddt == KILN_F16) ((__half *)d)[i] = __float2half_rn(v);
        else if (ddt == KILN_BF16) ((kiln_bf16_t *)d)[i] = __float2bfloat16_rn(v);
        else ((float *)d)[i] = v;
    }
}

extern "C" kiln_status kiln_cuda_dequantize(kiln_cuda_ctx *c, void *dst, kiln_dtype ddt, const void *src, kiln_dtype sdt,
                                            int64_t n)
{
    if (n <= 0) return KILN_OK;
    unsigned blocks = kiln_cuda_blocks(c, n, KILN_CUDA_THREADS);
    dequant_k<<<blocks, KILN_CUDA_THREADS, 0, c->compute>>>((char *)dst, ddt, (const uint8_t *)src, sdt, n);
    return KILN_OK;
}

/* elementwise.c - CPU copy/convert, fill, binary and unary ops over strided tensors.
 * All-f32 operands take float loops the compiler vectorizes; other dtypes go through
 * double loads (kiln_dtype_load) and stores (exact for every supported integer and
 * float value), with the formulas CUDA shares (kernels/kernel_formulas.h). */
#include "../kernel_formulas.h"
#include "cpu_backend.h"
#include "cpu_isa.h"
#include "cpu_kernels.h"
#include "strided.h"
#include "threadpool.h"

#include <math.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define EW_X86 1
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))

/* Contiguous f32 runs of the commonest ops (the skip additions and ReLUs between
 * convolutions): explicit vectors, since the strided loops below do not vectorize.
 * The same arithmetic as the scalar loops, element by element. */
AVX512 static void add_sub_mul_avx512(kiln_binop op, float *o, const float *a, const float *b, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(a + i), y = _mm512_loadu_ps(b + i);
        __m512 r = op == KILN_BIN_ADD ? _mm512_add_ps(x, y) : op == KILN_BIN_SUB ? _mm512_sub_ps(x, y) : _mm512_mul_ps(x, y);
        _mm512_storeu_ps(o + i, r);
    }
    for (; i < n; i++) o[i] = op == KILN_BIN_ADD ? a[i] + b[i] : op == KILN_BIN_SUB ? a[i] - b[i] : a[i] * b[i];
}

/* relu: max(0, x) keeps a NaN x (the second operand is returned when either is NaN);
 * + 0 turns -0 into 0, as the scalar loop gives */
AVX512 static void relu_avx512(float *o, const float *a, int64_t n)
{
    const __m512 zero = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(o + i, _mm512_add_ps(_mm512_max_ps(zero, _mm512_loadu_ps(a + i)), zero));
    for (; i < n; i++) { float v = a[i], r = v > 0.0f ? v : 0.0f; o[i] = v != v ? v : r; }
}

/* 16 values of an f32 or bf16 run (stride 1, or 0: one value for all) as f32 */
#define AVX512BW __attribute__((target("avx512f,avx512bw,avx512vl")))
AVX512BW static inline __m512 ld16(const char *p, kiln_dtype dt, int64_t st, int64_t i, __mmask16 k)
{
    if (st == 0) return _mm512_set1_ps(dt == KILN_F32 ? *(const float *)(const void *)p : kiln_bf16_to_f32(*(const uint16_t *)(const void *)p));
    if (dt == KILN_F32) return _mm512_maskz_loadu_ps(k, (const float *)(const void *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)(const void *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* stored as f32, or as bf16 by kiln_f32_to_bf16's rule (nearest even, quiet nan) */
AVX512BW static inline void st16(char *p, kiln_dtype dt, int64_t i, __m512 v, __mmask16 k)
{
    if (dt == KILN_F32) { _mm512_mask_storeu_ps((float *)(void *)p + i, k, v); return; }
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_mask_storeu_epi16((uint16_t *)(void *)p + i, k, _mm512_cvtepi32_epi16(r));
}

/* + - * / over f32 / bf16 operands, each of stride 1 or 0 (b NULL: the scalar s, exact
 * in f32), in f32: the values the element-by-element loop gives (see PIECE below). */
AVX512BW static void arith_bf16_avx512(kiln_binop op, int swap, int64_t n, char **ptr, const int64_t *st,
                                        const kiln_dtype *dt, int has_b, float s)
{
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 x = ld16(ptr[1], dt[1], st[1], i, k), y = has_b ? ld16(ptr[2], dt[2], st[2], i, k) : _mm512_set1_ps(s);
        if (swap) { __m512 t = x; x = y; y = t; }
        __m512 r = op == KILN_BIN_ADD ? _mm512_add_ps(x, y) : op == KILN_BIN_SUB ? _mm512_sub_ps(x, y)
                 : op == KILN_BIN_MUL ? _mm512_mul_ps(x, y) : _mm512_div_ps(x, y);
        st16(ptr[0], dt[0], i, r, k);
    }
}
#endif

static inline void store(char *p, kiln_dtype dt, double v)
{
    switch (dt) {
    case KILN_F32: *(float *)p = (float)v; break;
    case KILN_F16: *(uint16_t *)p = kiln_f32_to_f16((float)v); break;
    case KILN_BF16: *(uint16_t *)p = kiln_f32_to_bf16((float)v); break;
    case KILN_F8_E4M3FN: case KILN_F8_E5M2: kiln_convert(p, dt, &(float){(float)v}, KILN_F32, 1); break;
    default: kiln_store_int(p, dt, v); break; /* integers: truncate, saturate, nan -> 0 */
    }
}

/* ---- copy ---- */
typedef struct { kiln_dtype dt[2]; } copy_ctx;

static void copy_run(void *p, int64_t n, char **ptr, const int64_t *st)
{
    const copy_ctx *c = p;
    kiln_dtype dd = c->dt[0], sd = c->dt[1];
    size_t de = kiln_dtype_size(dd), se = kiln_dtype_size(sd);
    if (st[0] == 1 && st[1] == 1) { kiln_convert(ptr[0], dd, ptr[1], sd, (size_t)n); return; }
    if (dd == sd) {
        /* typed element moves for the common sizes: memcpy of a run-time size is a call
         * per element (a transposing copy, such as NCHW to tokens, is all single ones) */
        char *d = ptr[0];
        const char *src = ptr[1];
        const int64_t ds = st[0] * (int64_t)de, ss = st[1] * (int64_t)se;
        if (de == 4)
            for (int64_t i = 0; i < n; i++) { uint32_t v; memcpy(&v, src + i * ss, 4); memcpy(d + i * ds, &v, 4); }
        else if (de == 2)
            for (int64_t i = 0; i < n; i++) { uint16_t v; memcpy(&v, src + i * ss, 2); memcpy(d + i * ds, &v, 2); }
        else
            for (int64_t i = 0; i < n; i++) memcpy(d + i * ds, src + i * ss, de);
        return;
    }
    if (dd == KILN_F32) {
        for (int64_t i = 0; i < n; i++) *(float *)(ptr[0] + i * st[0] * 4) = (float)kiln_dtype_load(sd, ptr[1] + i * st[1] * (int64_t)se);
        return;
    }
    for (int64_t i = 0; i < n; i++) kiln_convert(ptr[0] + i * st[0] * (int64_t)de, dd, ptr[1] + i * st[1] * (int64_t)se, sd, 1);
}

#ifdef EW_X86
#include "simd_transpose.h"

/* A copy that swaps the two innermost (merged) dimensions, 4-byte elements: dst[o][b][a]
 * = src[o][a][b], unit stride along a in dst and along b in src: a transpose followed
 * by contiguous() (channels <-> tokens around a UNet's transformers). Element by
 * element, each value is read a whole src row apart, so every cache line fetched gives
 * one value (a 4096-token image: rows 16 KiB apart); 16 x 16 tiles through registers
 * read and write whole lines. One task: 16 dst rows (b) of one outer index, all of a. */
typedef struct {
    const kiln_iter *it;
    int64_t na, nb;   /* extents along a (dst's unit dimension) and b (src's) */
    int64_t dsb, ssa; /* dst's stride along b, src's along a (elements) */
    int64_t tiles_b;  /* 16-row tiles along b per outer index */
} tcopy_ctx;

AVX512 static void tcopy_run(void *p, int64_t t0, int64_t t1)
{
    const tcopy_ctx *c = p;
    const kiln_iter *it = c->it;
    for (int64_t t = t0; t < t1; t++) {
        int64_t outer = t / c->tiles_b, b0 = (t % c->tiles_b) * 16, offd = 0, offs = 0;
        for (int d = it->ndim - 3; d >= 0; d--) {
            int64_t i = outer % it->shape[d];
            outer /= it->shape[d];
            offd += i * it->stride[0][d];
            offs += i * it->stride[1][d];
        }
        float *dst = (float *)(void *)it->base[0] + offd;
        const float *src = (const float *)(const void *)it->base[1] + offs;
        int nb = c->nb - b0 < 16 ? (int)(c->nb - b0) : 16;
        __mmask16 mb = (__mmask16)((1u << nb) - 1u);
        for (int64_t a0 = 0; a0 < c->na; a0 += 16) {
            int na = c->na - a0 < 16 ? (int)(c->na - a0) : 16;
            __mmask16 ma = (__mmask16)((1u << na) - 1u);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < na ? _mm512_maskz_loadu_ps(mb, src + (a0 + i) * c->ssa + b0) : _mm512_setzero_ps();
            transpose16(r);
            for (int j = 0; j < nb; j++) _mm512_mask_storeu_ps(dst + (b0 + j) * c->dsb + a0, ma, r[j]);
        }
    }
}

/* 1 when the copy was the transposing kind and is done. */
static int transposed_copy(const kiln_iter *it, kiln_dtype dd, kiln_dtype sd)
{
    int l = it->ndim - 1;
    if (dd != sd || kiln_dtype_size(dd) != 4 || l < 1 || kiln_cpu_isa() != ISA_AVX512) return 0;
    if (it->stride[0][l] != 1 || it->stride[1][l - 1] != 1 || it->stride[1][l] == 1 || it->stride[0][l - 1] == 1)
        return 0;
    if (it->shape[l] < 16 || it->shape[l - 1] < 16) return 0; /* thin: the run loop does as well */
    tcopy_ctx c = {it, it->shape[l], it->shape[l - 1], it->stride[0][l - 1], it->stride[1][l],
                   (it->shape[l - 1] + 15) / 16};
    int64_t outer = 1;
    for (int d = 0; d < l - 1; d++) outer *= it->shape[d];
    /* tasks of at least 16 Ki elements, so that small copies stay on the caller */
    int64_t per_task = 16 * c.na, grain = (16384 + per_task - 1) / per_task;
    kiln_parallel_for(outer * c.tiles_b, grain, tcopy_run, &c);
    return 1;
}
#endif

typedef struct { char *d; const char *s; kiln_dtype dd, sd; int64_t blk; } block_copy;

static void block_copy_run(void *p, int64_t b0, int64_t b1)
{
    const block_copy *c = p;
    kiln_convert(c->d + kiln_dtype_nbytes(c->dd, b0 * c->blk), c->dd, c->s + kiln_dtype_nbytes(c->sd, b0 * c->blk),
                 c->sd, (size_t)((b1 - b0) * c->blk));
}

kiln_status kiln_cpu_copy(kiln_tensor *dst, const kiln_tensor *src)
{
    if (kiln_dtype_is_blocked(dst->dtype) || kiln_dtype_is_blocked(src->dtype)) {
        /* block types are decoded / quantized whole rows at a time, so both sides must
         * be contiguous and of one shape; the pool takes pieces of 256 elements (a
         * multiple of every block) */
        if (!kiln_tensor_is_contiguous(dst) || !kiln_tensor_is_contiguous(src) || !kiln_shape_equal(dst, src))
            return kiln_error(KILN_ERR_UNSUPPORTED, "copy: %s to %s needs contiguous tensors of one shape",
                              kiln_dtype_name(src->dtype), kiln_dtype_name(dst->dtype));
        int64_t n = kiln_tensor_numel(dst), blk = 256;
        block_copy c = {kiln_tensor_data(dst), kiln_tensor_data(src), dst->dtype, src->dtype, blk};
        int64_t full = n / blk;
        if (full) kiln_parallel_for(full, 16, block_copy_run, &c);
        if (n > full * blk)
            kiln_convert(c.d + kiln_dtype_nbytes(c.dd, full * blk), c.dd, c.s + kiln_dtype_nbytes(c.sd, full * blk), c.sd,
                         (size_t)(n - full * blk));
        return KILN_OK;
    }
    const kiln_tensor *ops[2] = {dst, src};
    kiln_iter it;
    kiln_iter_init(&it, 2, ops);
#ifdef EW_X86
    if (transposed_copy(&it, dst->dtype, src->dtype)) return KILN_OK;
#endif
    copy_ctx c = {{dst->dtype, src->dtype}};
    kiln_iter_run(&it, copy_run, &c);
    return KILN_OK;
}

/* ---- fill ---- */
typedef struct { kiln_dtype dt; _Alignas(8) char bytes[8]; } fill_ctx;

static void fill_run(void *p, int64_t n, char **ptr, const int64_t *st)
{
    const fill_ctx *c = p;
    size_t e = kiln_dtype_size(c->dt);
    int zero = 1;
    for (size_t i = 0; i < e; i++) zero &= c->bytes[i] == 0;
    if (st[0] == 1 && zero) { memset(ptr[0], 0, (size_t)n * e); return; }
    if (c->dt == KILN_F32 && st[0] == 1) {
        float v; memcpy(&v, c->bytes, 4);
        float *o = (float *)ptr[0];
        for (int64_t i = 0; i < n; i++) o[i] = v;
        return;
    }
    for (int64_t i = 0; i < n; i++) memcpy(ptr[0] + i * st[0] * (int64_t)e, c->bytes, e);
}

kiln_status kiln_cpu_fill(kiln_tensor *t, double v)
{
    fill_ctx c;
    c.dt = t->dtype;
    memset(c.bytes, 0, sizeof c.bytes);
    store(c.bytes, t->dtype, v);
    const kiln_tensor *ops[1] = {t};
    kiln_iter it;
    kiln_iter_init(&it, 1, ops);
    kiln_iter_run(&it, fill_run, &c);
    return KILN_OK;
}

/* ---- float runs through f32 pieces ----
 * Operands of f32, f16 and bf16 mixed (bf16 activations between bf16 products): a run is
 * loaded in pieces into f32 buffers (a stride 0 operand is one value), computed in f32
 * and stored rounded once to the output's dtype. For + - * / of two floats that is the
 * value the double formula rounded to f32 gives (a double holds their exact result to
 * within one rounding that f32's cannot see), so these paths agree bit for bit with
 * the element-by-element loop below them; a scalar operand keeps its double value. */
#define PIECE 256

static int half_or_f32(kiln_dtype d) { return d == KILN_F32 || d == KILN_F16 || d == KILN_BF16; }

static void load_piece(float *t, const char *p, kiln_dtype dt, int64_t st, int64_t n)
{
    if (st == 1) { kiln_to_f32(t, p, dt, (size_t)n); return; }
    if (st == 0) {
        float v = (float)kiln_dtype_load(dt, p);
        for (int64_t i = 0; i < n; i++) t[i] = v;
        return;
    }
    if (dt == KILN_BF16) { /* a rotary embedding's pairs: every other value */
        const uint16_t *h = (const uint16_t *)(const void *)p;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)h[i * st] << 16;
            memcpy(t + i, &u, 4);
        }
        return;
    }
    int64_t e = (int64_t)kiln_dtype_size(dt);
    for (int64_t i = 0; i < n; i++) t[i] = (float)kiln_dtype_load(dt, p + i * st * e);
}

static void store_f32(char *p, kiln_dtype dt, float v);

static void store_piece(char *p, kiln_dtype dt, int64_t st, const float *t, int64_t n)
{
    if (st == 1) { kiln_convert(p, dt, t, KILN_F32, (size_t)n); return; }
    int64_t e = (int64_t)kiln_dtype_size(dt);
    for (int64_t i = 0; i < n; i++) store_f32(p + i * st * e, dt, t[i]);
}

static void store_f32(char *p, kiln_dtype dt, float v)
{
    if (dt == KILN_F32) *(float *)(void *)p = v;
    else if (dt == KILN_BF16) *(uint16_t *)(void *)p = kiln_f32_to_bf16(v);
    else *(uint16_t *)(void *)p = kiln_f32_to_f16(v);
}

/* ---- binary ---- */
typedef struct { kiln_binop op; kiln_dtype dt[3]; double s; int swap; int has_b; } bin_ctx;

#define BIN_F32_LOOP(EXPR) do { \
    if (st[0] == 1 && st[1] == 1 && (!c->has_b || st[2] == 1)) { \
        for (int64_t i = 0; i < n; i++) { float x = a[i], y = c->has_b ? b[i] : s; if (c->swap) { float t_ = x; x = y; y = t_; } o[i] = (EXPR); } \
    } else { \
        for (int64_t i = 0; i < n; i++) { float x = a[i * st[1]], y = c->has_b ? b[i * st[2]] : s; if (c->swap) { float t_ = x; x = y; y = t_; } o[i * st[0]] = (EXPR); } \
    } } while (0)

static void bin_run(void *p, int64_t n, char **ptr, const int64_t *st)
{
    const bin_ctx *c = p;
    int all_f32 = c->dt[0] == KILN_F32 && c->dt[1] == KILN_F32 && (!c->has_b || c->dt[2] == KILN_F32);
    if (all_f32) {
        float *o = (float *)ptr[0];
        const float *a = (const float *)ptr[1];
        const float *b = c->has_b ? (const float *)ptr[2] : NULL;
        float s = (float)c->s;
#ifdef EW_X86
        if (b && !c->swap && st[0] == 1 && st[1] == 1 && st[2] == 1 && kiln_cpu_isa() == ISA_AVX512 &&
            (c->op == KILN_BIN_ADD || c->op == KILN_BIN_SUB || c->op == KILN_BIN_MUL)) {
            add_sub_mul_avx512(c->op, o, a, b, n);
            return;
        }
#endif
        switch (c->op) {
        case KILN_BIN_ADD: BIN_F32_LOOP(x + y); return;
        case KILN_BIN_SUB: BIN_F32_LOOP(x - y); return;
        case KILN_BIN_MUL: BIN_F32_LOOP(x * y); return;
        case KILN_BIN_DIV: BIN_F32_LOOP(x / y); return;
        /* NaN in either operand gives NaN, as kiln_binary_d */
        case KILN_BIN_MIN: BIN_F32_LOOP((x != x || y != y) ? x + y : (x < y ? x : y)); return;
        case KILN_BIN_MAX: BIN_F32_LOOP((x != x || y != y) ? x + y : (x > y ? x : y)); return;
        default: break;
        }
    }
    if (half_or_f32(c->dt[0]) && half_or_f32(c->dt[1]) && (!c->has_b || half_or_f32(c->dt[2])) &&
        (c->op == KILN_BIN_ADD || c->op == KILN_BIN_SUB || c->op == KILN_BIN_MUL || c->op == KILN_BIN_DIV)) {
#ifdef EW_X86
        int fast = kiln_cpu_isa() == ISA_AVX512 && st[0] == 1 && c->dt[0] != KILN_F16 && c->dt[1] != KILN_F16 &&
                   (st[1] == 0 || st[1] == 1) &&
                   (c->has_b ? c->dt[2] != KILN_F16 && (st[2] == 0 || st[2] == 1) : (double)(float)c->s == c->s);
        if (fast) { arith_bf16_avx512(c->op, c->swap, n, ptr, st, c->dt, c->has_b, (float)c->s); return; }
#endif
        float ta[PIECE], tb[PIECE], to[PIECE];
        size_t e0 = kiln_dtype_size(c->dt[0]), e1 = kiln_dtype_size(c->dt[1]), e2 = c->has_b ? kiln_dtype_size(c->dt[2]) : 0;
        for (int64_t i0 = 0; i0 < n; i0 += PIECE) {
            int64_t m = n - i0 < PIECE ? n - i0 : PIECE;
            load_piece(ta, ptr[1] + i0 * st[1] * (int64_t)e1, c->dt[1], st[1], m);
            if (c->has_b) {
                load_piece(tb, ptr[2] + i0 * st[2] * (int64_t)e2, c->dt[2], st[2], m);
                if (c->swap) for (int64_t i = 0; i < m; i++) { float t_ = ta[i]; ta[i] = tb[i]; tb[i] = t_; }
                switch (c->op) {
                case KILN_BIN_ADD: for (int64_t i = 0; i < m; i++) to[i] = ta[i] + tb[i]; break;
                case KILN_BIN_SUB: for (int64_t i = 0; i < m; i++) to[i] = ta[i] - tb[i]; break;
                case KILN_BIN_MUL: for (int64_t i = 0; i < m; i++) to[i] = ta[i] * tb[i]; break;
                default: for (int64_t i = 0; i < m; i++) to[i] = ta[i] / tb[i]; break;
                }
            } else {
                const double s = c->s;
                if (!c->swap) {
                    switch (c->op) {
                    case KILN_BIN_ADD: for (int64_t i = 0; i < m; i++) to[i] = (float)((double)ta[i] + s); break;
                    case KILN_BIN_SUB: for (int64_t i = 0; i < m; i++) to[i] = (float)((double)ta[i] - s); break;
                    case KILN_BIN_MUL: for (int64_t i = 0; i < m; i++) to[i] = (float)((double)ta[i] * s); break;
                    default: for (int64_t i = 0; i < m; i++) to[i] = (float)((double)ta[i] / s); break;
                    }
                } else {
                    switch (c->op) {
                    case KILN_BIN_ADD: for (int64_t i = 0; i < m; i++) to[i] = (float)(s + (double)ta[i]); break;
                    case KILN_BIN_SUB: for (int64_t i = 0; i < m; i++) to[i] = (float)(s - (double)ta[i]); break;
                    case KILN_BIN_MUL: for (int64_t i = 0; i < m; i++) to[i] = (float)(s * (double)ta[i]); break;
                    default: for (int64_t i = 0; i < m; i++) to[i] = (float)(s / (double)ta[i]); break;
                    }
                }
            }
            store_piece(ptr[0] + i0 * st[0] * (int64_t)e0, c->dt[0], st[0], to, m);
        }
        return;
    }
    size_t e0 = kiln_dtype_size(c->dt[0]), e1 = kiln_dtype_size(c->dt[1]), e2 = c->has_b ? kiln_dtype_size(c->dt[2]) : 0;
    int int_out = !kiln_dtype_is_float(c->dt[0]);
    for (int64_t i = 0; i < n; i++) {
        double x = kiln_dtype_load(c->dt[1], ptr[1] + i * st[1] * (int64_t)e1);
        double y = c->has_b ? kiln_dtype_load(c->dt[2], ptr[2] + i * st[2] * (int64_t)e2) : c->s;
        if (c->swap) { double t = x; x = y; y = t; }
        /* an integer output: division truncates (documented) */
        store(ptr[0] + i * st[0] * (int64_t)e0, c->dt[0], kiln_binary_d(c->op, x, y, int_out));
    }
}

/* Elementwise loops address elements one by one, which block types do not allow. */
static kiln_status no_blocks(const char *op, const kiln_tensor *x, const kiln_tensor *y, const kiln_tensor *z)
{
    const kiln_tensor *t[3] = {x, y, z};
    for (int i = 0; i < 3; i++)
        if (t[i] && kiln_dtype_is_blocked(t[i]->dtype))
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: a %s tensor (a block type): convert it with :to(\"f32\") first",
                              op, kiln_dtype_name(t[i]->dtype));
    return KILN_OK;
}

kiln_status kiln_cpu_binary(kiln_binop op, kiln_tensor *out, const kiln_tensor *a,
                            const kiln_tensor *b, double s, int swap)
{
    kiln_status bst = no_blocks("elementwise op", out, a, b);
    if (bst) return bst;
    const kiln_tensor *ops[3] = {out, a, b};
    kiln_iter it;
    kiln_iter_init(&it, b ? 3 : 2, ops);
    bin_ctx c = {op, {out->dtype, a->dtype, b ? b->dtype : KILN_F32}, s, swap, b != NULL};
    kiln_iter_run(&it, bin_run, &c);
    return KILN_OK;
}

/* ---- unary ---- */
typedef struct { kiln_unop op; kiln_dtype dt[2]; double p0, p1; } un_ctx;

static void un_run(void *p, int64_t n, char **ptr, const int64_t *st)
{
    const un_ctx *c = p;
    if (c->dt[0] == KILN_F32 && c->dt[1] == KILN_F32 && st[0] == 1 && st[1] == 1) {
        float *o = (float *)ptr[0];
        const float *a = (const float *)ptr[1];
        switch (c->op) {
        case KILN_UN_NEG: for (int64_t i = 0; i < n; i++) o[i] = -a[i]; return;
        case KILN_UN_SILU: kiln_cpu_silu(o, a, n); return;
        case KILN_UN_GELU: kiln_cpu_gelu(o, a, n); return;
        case KILN_UN_GELU_TANH: kiln_cpu_gelu_tanh(o, a, n); return;
        case KILN_UN_QUICK_GELU: kiln_cpu_quick_gelu(o, a, n); return;
        case KILN_UN_SIGMOID: kiln_cpu_sigmoid(o, a, n); return;
        case KILN_UN_EXP: for (int64_t i = 0; i < n; i++) o[i] = expf(a[i]); return;
        case KILN_UN_SQRT: for (int64_t i = 0; i < n; i++) o[i] = sqrtf(a[i]); return;
        case KILN_UN_ABS: for (int64_t i = 0; i < n; i++) o[i] = fabsf(a[i]); return;
        /* written as selects the compiler turns into max / min instructions: a branch on the
         * sign of random data is mispredicted half the time; the NaN test is never taken */
        case KILN_UN_RELU:
#ifdef EW_X86
            if (kiln_cpu_isa() == ISA_AVX512) { relu_avx512(o, a, n); return; }
#endif
            for (int64_t i = 0; i < n; i++) { float v = a[i], r = v > 0.0f ? v : 0.0f; o[i] = v != v ? v : r; }
            return;
        case KILN_UN_LEAKY_RELU: {
            float s = (float)c->p0;
            for (int64_t i = 0; i < n; i++) {
                float v = a[i], pos = v > 0.0f ? v : 0.0f, neg = v < 0.0f ? v : 0.0f, r = pos + s * neg;
                o[i] = v != v ? v : r;
            }
            return;
        }
        case KILN_UN_CLAMP: {
            /* NaN bounds are absent bounds (kiln_unary_d); a NaN input stays NaN */
            float lo = c->p0 == c->p0 ? (float)c->p0 : -INFINITY, hi = c->p1 == c->p1 ? (float)c->p1 : INFINITY;
            for (int64_t i = 0; i < n; i++) {
                float v = a[i], r = v < lo ? lo : v;
                r = r > hi ? hi : r;
                o[i] = v != v ? v : r;
            }
            return;
        }
        default: break;
        }
    }
    if (half_or_f32(c->dt[0]) && half_or_f32(c->dt[1]) &&
        (c->op == KILN_UN_SILU || c->op == KILN_UN_GELU || c->op == KILN_UN_GELU_TANH || c->op == KILN_UN_QUICK_GELU ||
         c->op == KILN_UN_SIGMOID)) {
        /* the activations as their f32 kernels compute them, in f32 pieces */
        float t[PIECE];
        size_t e0 = kiln_dtype_size(c->dt[0]), e1 = kiln_dtype_size(c->dt[1]);
        for (int64_t i0 = 0; i0 < n; i0 += PIECE) {
            int64_t m = n - i0 < PIECE ? n - i0 : PIECE;
            load_piece(t, ptr[1] + i0 * st[1] * (int64_t)e1, c->dt[1], st[1], m);
            switch (c->op) {
            case KILN_UN_SILU: kiln_cpu_silu(t, t, m); break;
            case KILN_UN_GELU: kiln_cpu_gelu(t, t, m); break;
            case KILN_UN_GELU_TANH: kiln_cpu_gelu_tanh(t, t, m); break;
            case KILN_UN_QUICK_GELU: kiln_cpu_quick_gelu(t, t, m); break;
            default: kiln_cpu_sigmoid(t, t, m); break;
            }
            store_piece(ptr[0] + i0 * st[0] * (int64_t)e0, c->dt[0], st[0], t, m);
        }
        return;
    }
    size_t e0 = kiln_dtype_size(c->dt[0]), e1 = kiln_dtype_size(c->dt[1]);
    for (int64_t i = 0; i < n; i++)
        store(ptr[0] + i * st[0] * (int64_t)e0, c->dt[0],
              kiln_unary_d(c->op, kiln_dtype_load(c->dt[1], ptr[1] + i * st[1] * (int64_t)e1), c->p0, c->p1));
}

kiln_status kiln_cpu_unary(kiln_unop op, kiln_tensor *out, const kiln_tensor *a, double p0, double p1)
{
    kiln_status bst = no_blocks("elementwise op", out, a, NULL);
    if (bst) return bst;
    const kiln_tensor *ops[2] = {out, a};
    kiln_iter it;
    kiln_iter_init(&it, 2, ops);
    un_ctx c = {op, {out->dtype, a->dtype}, p0, p1};
    kiln_iter_run(&it, un_run, &c);
    return KILN_OK;
}

/* attention.c - memory-efficient attention (FlashAttention-style) on the CPU.
 * A task is (batch*head, block of QT queries); it streams over blocks of KB keys with
 * an online softmax, so a thread's scratch is QT*(D+Dv+2) + D*KB + QB*KB floats
 * (about 218 KB at D=40) and no Lq x Lk matrix ever exists. The q.k^T and p.v block
 * products are our own register-tiled kernels, AVX-512 or AVX2+FMA chosen at run
 * time, portable C otherwise (OpenBLAS would start its own threads inside ours); under
 * kiln.precision("bf16") the two products take bf16 inputs (see "bf16 products" below;
 * the values of a key block then take KB/2 x Dv more floats of scratch). */
#include "cpu_isa.h"
#include "cpu_internal.h"
#include "cpu_kernels.h"
#include "threadpool.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define ATT_X86 1
#include <immintrin.h>
#include "simd_bf16.h"
#include "simd_transpose.h"
#define AVX512 __attribute__((target("avx512f,fma")))
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx512f,fma")))
#endif

#define QT 512 /* queries per task: each task transposes every key block once */
#define QB 32  /* queries per q.k^T block (QB x KB scores live at a time) */
#define KB 192 /* keys per block, four 48-key tiles: a row's softmax overhead (max, sums,
                  * rescale) is paid once per 192 keys (96 is slower at SD's 4096) */
#define TR 8   /* rows of a micro-tile */
#define PREP_MAX_BYTES ((size_t)64 << 20) /* the shared key preparation's limit */
#define LOG2E 1.44269504088896341f


typedef struct {
    float *out;
    const float *q, *k, *v;
    int64_t Lq, Lk, D, Dv, nqb;
    float scale2;               /* scale * log2(e): the softmax runs in base 2 */
    int causal, isa;
    int bf16;                   /* products with bf16 inputs: 1 vdpbf16ps, 2 emulated */
    float *scratch;             /* one slot per pool thread */
    size_t slot;                /* floats per slot */
    int nslots;
    atomic_int oom;
    float *prep;                /* keys (and bf16 values) of every head's key blocks, made
                                 * once before the tasks; NULL: each task makes its own */
    int64_t nkb;                /* key blocks of a head */
    size_t prep_block;          /* floats of one prepared block */
} att_ctx;

static inline int64_t round16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* Scratch layout of one slot, in floats (each part 64-byte aligned). */
static size_t slot_floats(int64_t D, int64_t Dv)
{
    return (size_t)(round16(QT * D) + round16(D * KB) + QB * KB + round16(QT * Dv) + 2 * QT +
                    (KB / 2) * round16(Dv));
}

/* ---------------- portable path ---------------- */

/* s[i][j] = qs[i] . kt[:, j] for i < qn, j < kn (row stride KB) */
static void qk_generic(float *s, const float *qs, const float *kt, int64_t qn, int64_t kn, int64_t D)
{
    for (int64_t i = 0; i < qn; i++) {
        float *srow = s + i * KB;
        for (int64_t j = 0; j < kn; j++) srow[j] = 0;
        for (int64_t d = 0; d < D; d++) {
            float a = qs[i * D + d];
            const float *kr = kt + d * KB;
            for (int64_t j = 0; j < kn; j++) srow[j] += a * kr[j];
        }
    }
}

/* o[i] += sum_j p[i][j] v[j] */
static void pv_generic(float *o, const float *p, const float *v, int64_t qn, int64_t kn, int64_t Dv)
{
    for (int64_t i = 0; i < qn; i++) {
        float *orow = o + i * Dv;
        for (int64_t j = 0; j < kn; j++) {
            float w = p[i * KB + j];
            const float *vr = v + j * Dv;
            for (int64_t c = 0; c < Dv; c++) orow[c] += w * vr[c];
        }
    }
}

/* Online-softmax update of one row: s holds base-2 logits, the first nvalid of kn
 * are unmasked. Replaces s by p = 2^(s - m_new), rescales the row of o. */
static void softmax_row_generic(float *s, int64_t nvalid, int64_t kn, float *m, float *l, float *o, int64_t Dv)
{
    float mx = -INFINITY;
    for (int64_t j = 0; j < nvalid; j++) mx = s[j] > mx ? s[j] : mx;
    float mnew = mx > *m ? mx : *m;
    float sum = 0;
    for (int64_t j = 0; j < nvalid; j++) { s[j] = exp2f(s[j] - mnew); sum += s[j]; }
    for (int64_t j = nvalid < 0 ? 0 : nvalid; j < kn; j++) s[j] = 0;
    if (nvalid <= 0) return;
    float alpha = exp2f(*m - mnew); /* 0 on the first block (m = -inf) */
    if (alpha != 1.0f)
        for (int64_t c = 0; c < Dv; c++) o[c] *= alpha;
    *l = *l * alpha + sum;
    *m = mnew;
}

/* ---------------- AVX-512 path ---------------- */
#ifdef ATT_X86
AVX512_INLINE __mmask16 tail_mask(int64_t left)
{
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* 2^x = 2^n 2^f, n = round(x), f in [-0.5, 0.5], 2^f by a polynomial fitted for
 * relative error: degree 5 (max ~1.5e-7) for the f32 softmax; degree 3 (7.5e-5, far
 * below the 2^-9 of the bf16 rounding that follows, and two multiply-adds fewer on the
 * ports the bf16 products use; fitted by iteratively reweighted least squares) for the
 * probabilities of the bf16 products, whose row sums take the same values so the
 * normalization stays consistent. scalef takes any n; x is finite here (a score less
 * the row's max, <= 0). */
AVX512_INLINE __m512 exp2_poly(__m512 x, const int degree)
{
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n), p;
    if (degree == 5) {
        p = _mm512_set1_ps(0.0013276466634124517f);
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.009675541892647743f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05550713464617729f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022120237350464f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931469440460205f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001192092896f));
    } else {
        p = _mm512_set1_ps(0.0551716685295105f);
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2426111400127411f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6932609677314758f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999280571937561f));
    }
    return _mm512_scalef_ps(p, n);
}

AVX512_INLINE __m512 exp2_avx512(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-150.0f), x); /* constant first: NaN in x passes */
    return exp2_poly(x, 5);
}

AVX512_INLINE __m512 exp2_for_bf16(__m512 x) { return exp2_poly(x, 3); }

/* The micro-tiles keep their accumulators in named variables, written out through
 * R8(): with arrays and loops, clang keeps them on the stack (half speed). */
#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

/* kt[d][j] = k[j][d] for j < kn, zero up to knp (a multiple of 16): 16 x 16 blocks
 * transposed in registers (every task transposes every key block: a scalar copy was 6%
 * of an SD self-attention). */
AVX512 static void keys_t_avx512(float *kt, const float *k, int64_t kn, int64_t knp, int64_t D)
{
    for (int64_t j0 = 0; j0 < knp; j0 += 16)
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            int64_t dn = D - d0 < 16 ? D - d0 : 16;
            __mmask16 dm = tail_mask(dn);
            __m512 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = j0 + i < kn ? _mm512_maskz_loadu_ps(dm, k + (j0 + i) * D + d0) : _mm512_setzero_ps();
            transpose16(r);
            for (int64_t dd = 0; dd < dn; dd++) _mm512_store_ps(kt + (d0 + dd) * KB + j0, r[dd]);
        }
}

/* Micro-tile of s: TR rows x NC*16 keys, accumulated over D in registers.
 * Rows past qn read row 0 again and are not stored (a tail costs a little work,
 * never a branch in the inner loop). */
AVX512_INLINE void qk_tile(int NC, float *s, const float *qs, const float *kt, int64_t qn, int64_t D)
{
#define QK_DECL(r) \
    __m512 a##r##_0 = _mm512_setzero_ps(), a##r##_1 = a##r##_0, a##r##_2 = a##r##_0; \
    const float *q##r = qs + (r < qn ? r : 0) * D;
    R8(QK_DECL)
    for (int64_t d = 0; d < D; d++) {
        const float *kd = kt + d * KB;
        __m512 k0 = _mm512_load_ps(kd);
        __m512 k1 = NC > 1 ? _mm512_load_ps(kd + 16) : k0;
        __m512 k2 = NC > 2 ? _mm512_load_ps(kd + 32) : k0;
#define QK_STEP(r) { \
        __m512 bq = _mm512_set1_ps(q##r[d]); \
        a##r##_0 = _mm512_fmadd_ps(bq, k0, a##r##_0); \
        if (NC > 1) a##r##_1 = _mm512_fmadd_ps(bq, k1, a##r##_1); \
        if (NC > 2) a##r##_2 = _mm512_fmadd_ps(bq, k2, a##r##_2); }
        R8(QK_STEP)
    }
#define QK_STORE(r) \
    if (r < qn) { \
        _mm512_store_ps(s + r * KB, a##r##_0); \
        if (NC > 1) _mm512_store_ps(s + r * KB + 16, a##r##_1); \
        if (NC > 2) _mm512_store_ps(s + r * KB + 32, a##r##_2); }
    R8(QK_STORE)
#undef QK_DECL
#undef QK_STEP
#undef QK_STORE
}

AVX512 static void qk_avx512(float *s, const float *qs, const float *kt, int64_t qn, int64_t kn, int64_t D)
{
    for (int64_t i = 0; i < qn; i += TR) {
        for (int64_t j = 0; j < kn; j += 48) {
            int64_t left = kn - j;
            const float *q0 = qs + i * D, *k0 = kt + j;
            float *s0 = s + i * KB + j;
            if (left > 32) qk_tile(3, s0, q0, k0, qn - i, D);
            else if (left > 16) qk_tile(2, s0, q0, k0, qn - i, D);
            else qk_tile(1, s0, q0, k0, qn - i, D);
        }
    }
}

/* Micro-tile of o: TR rows x NV vectors of value columns, o[r] += sum_j p[r][j] v[j].
 * The last vector is full (TAIL_FULL), 8 lanes done as a ymm (TAIL_Y8: head dim 40
 * would waste a sixth of a zmm) or masked by vm (TAIL_MASK). */
enum { TAIL_FULL, TAIL_Y8, TAIL_MASK };

AVX512_INLINE void pv_tile(int NV, int TAIL, float *o, const float *p, const float *v, int64_t qn,
                           int64_t kn, int64_t Dv, __mmask16 vm)
{
    const int NZ = TAIL == TAIL_Y8 ? NV - 1 : NV; /* zmm vectors */
    const __mmask16 full = (__mmask16)0xFFFF;
    const __mmask16 m0 = TAIL == TAIL_MASK && NZ == 1 ? vm : full;
    const __mmask16 m1 = TAIL == TAIL_MASK && NZ == 2 ? vm : full;
    const __mmask16 m2 = TAIL == TAIL_MASK && NZ == 3 ? vm : full;
#define PV_DECL(r) \
    const float *o##r = o + (r < qn ? r : 0) * Dv, *p##r = p + (r < qn ? r : 0) * KB; \
    __m512 a##r##_0 = NZ > 0 ? _mm512_maskz_loadu_ps(m0, o##r) : _mm512_setzero_ps(); \
    __m512 a##r##_1 = NZ > 1 ? _mm512_maskz_loadu_ps(m1, o##r + 16) : _mm512_setzero_ps(); \
    __m512 a##r##_2 = NZ > 2 ? _mm512_maskz_loadu_ps(m2, o##r + 32) : _mm512_setzero_ps(); \
    __m256 y##r = TAIL == TAIL_Y8 ? _mm256_loadu_ps(o##r + 16 * NZ) : _mm256_setzero_ps();
    R8(PV_DECL)
    for (int64_t j = 0; j < kn; j++) {
        const float *vr = v + j * Dv;
        __m512 v0 = NZ > 0 ? _mm512_maskz_loadu_ps(m0, vr) : _mm512_setzero_ps();
        __m512 v1 = NZ > 1 ? _mm512_maskz_loadu_ps(m1, vr + 16) : v0;
        __m512 v2 = NZ > 2 ? _mm512_maskz_loadu_ps(m2, vr + 32) : v0;
        __m256 v8 = TAIL == TAIL_Y8 ? _mm256_loadu_ps(vr + 16 * NZ) : _mm256_setzero_ps();
#define PV_STEP(r) { \
        __m512 bp = _mm512_set1_ps(p##r[j]); \
        if (NZ > 0) a##r##_0 = _mm512_fmadd_ps(bp, v0, a##r##_0); \
        if (NZ > 1) a##r##_1 = _mm512_fmadd_ps(bp, v1, a##r##_1); \
        if (NZ > 2) a##r##_2 = _mm512_fmadd_ps(bp, v2, a##r##_2); \
        if (TAIL == TAIL_Y8) y##r = _mm256_fmadd_ps(_mm512_castps512_ps256(bp), v8, y##r); }
        R8(PV_STEP)
    }
#define PV_STORE(r) \
    if (r < qn) { \
        float *w##r = o + r * Dv; \
        if (NZ > 0) _mm512_mask_storeu_ps(w##r, m0, a##r##_0); \
        if (NZ > 1) _mm512_mask_storeu_ps(w##r + 16, m1, a##r##_1); \
        if (NZ > 2) _mm512_mask_storeu_ps(w##r + 32, m2, a##r##_2); \
        if (TAIL == TAIL_Y8) _mm256_storeu_ps(w##r + 16 * NZ, y##r); }
    R8(PV_STORE)
#undef PV_DECL
#undef PV_STEP
#undef PV_STORE
}

/* One chunk of value columns: nv vectors (<= 3), the last of `last` lanes. */
AVX512_INLINE void pv_chunk(int nv, int64_t last, float *o, const float *p, const float *v, int64_t qn,
                            int64_t kn, int64_t Dv)
{
    __mmask16 vm = tail_mask(last);
    int tail = last == 16 ? TAIL_FULL : last == 8 ? TAIL_Y8 : TAIL_MASK;
#define PV_CASE(N) \
    if (nv == N) { \
        if (tail == TAIL_FULL) pv_tile(N, TAIL_FULL, o, p, v, qn, kn, Dv, vm); \
        else if (tail == TAIL_Y8) pv_tile(N, TAIL_Y8, o, p, v, qn, kn, Dv, vm); \
        else pv_tile(N, TAIL_MASK, o, p, v, qn, kn, Dv, vm); \
        return; \
    }
    PV_CASE(1)
    PV_CASE(2)
    PV_CASE(3)
#undef PV_CASE
}

AVX512 static void pv_avx512(float *o, const float *p, const float *v, int64_t qn, int64_t kn, int64_t Dv)
{
    /* split the Dv/16 vectors into balanced chunks of at most 3 (24 accumulators) */
    int64_t nvec = (Dv + 15) / 16, nchunk = (nvec + 2) / 3;
    for (int64_t i = 0; i < qn; i += TR) {
        int64_t vec0 = 0;
        for (int64_t ch = 0; ch < nchunk; ch++) {
            int64_t nv = (nvec - vec0) / (nchunk - ch) + ((nvec - vec0) % (nchunk - ch) ? 1 : 0);
            int64_t c0 = 16 * vec0, w = Dv - c0 < 16 * nv ? Dv - c0 : 16 * nv;
            pv_chunk((int)nv, w - 16 * (nv - 1), o + i * Dv + c0, p + i * KB, v + c0, qn - i, kn, Dv);
            vec0 += nv;
        }
    }
}

/* The online softmax's two ends, shared by the f32 and bf16 rows: the new running max
 * over the nvalid logits of s and the old one m; then, with the block's sum, the
 * rescale of the row's output and its sum l by 2^(m - mnew). */
AVX512_INLINE float softmax_new_max(const float *s, int64_t nvalid, float m)
{
    __m512 mx = _mm512_set1_ps(-INFINITY), mx2 = mx;
    int64_t j = 0;
    for (; j + 32 <= nvalid; j += 32) {
        mx = _mm512_max_ps(mx, _mm512_load_ps(s + j));
        mx2 = _mm512_max_ps(mx2, _mm512_load_ps(s + j + 16));
    }
    mx = _mm512_max_ps(mx, mx2);
    for (; j < nvalid; j += 16) {
        __mmask16 mk = tail_mask(nvalid - j);
        mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_maskz_load_ps(mk, s + j));
    }
    float bmax = _mm512_reduce_max_ps(mx);
    return bmax > m ? bmax : m;
}

AVX512_INLINE void softmax_rescale(float *o, int64_t Dv, float *m, float *l, float mnew, __m512 sum)
{
    float alpha = exp2f(*m - mnew);
    if (alpha != 1.0f) {
        __m512 va = _mm512_set1_ps(alpha);
        for (int64_t c = 0; c < Dv; c += 16) {
            __mmask16 mk = tail_mask(Dv - c);
            _mm512_mask_storeu_ps(o + c, mk, _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, o + c), va));
        }
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = mnew;
}

AVX512 static void softmax_row_avx512(float *s, int64_t nvalid, int64_t kn, float *m, float *l, float *o, int64_t Dv)
{
    if (nvalid <= 0) {
        memset(s, 0, (size_t)kn * sizeof(float));
        return;
    }
    float mnew = softmax_new_max(s, nvalid, *m);
    __m512 vm = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= nvalid; j += 16) { /* whole vectors of valid keys: no masks */
        __m512 e = exp2_avx512(_mm512_sub_ps(_mm512_load_ps(s + j), vm));
        sum = _mm512_add_ps(sum, e);
        _mm512_store_ps(s + j, e);
    }
    for (; j < kn; j += 16) {
        __mmask16 mk = tail_mask(nvalid - j < 0 ? 0 : nvalid - j);
        __m512 e = _mm512_maskz_mov_ps(mk, exp2_avx512(_mm512_sub_ps(_mm512_load_ps(s + j), vm)));
        sum = _mm512_add_ps(sum, e);
        _mm512_store_ps(s + j, e);
    }
    softmax_rescale(o, Dv, m, l, mnew, sum);
}

/* ---------------- AVX2 + FMA path (16 ymm registers: 4-row tiles) ---------------- */
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))
#define R4(X) X(0) X(1) X(2) X(3)

/* lanes [0, n) set, n in [0, 8] */
AVX2_INLINE __m256i mask8(int64_t n)
{
    static const int32_t tbl[16] = { -1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0 };
    return _mm256_loadu_si256((const __m256i *)(tbl + 8 - (n < 0 ? 0 : n > 8 ? 8 : n)));
}

AVX2_INLINE float hmax8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

AVX2_INLINE float hsum8(__m256 v)
{
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* 2^x for x <= 0 (same fit as exp2_avx512); 2^n built in the exponent field, x
 * clamped at -126 (masked lanes are zeroed by the caller). */
AVX2_INLINE __m256 exp2_avx2(__m256 x)
{
    x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x); /* constant first: NaN in x passes */
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(0.0013276466634124517f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.009675541892647743f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.05550713464617729f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022120237350464f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6931469440460205f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0000001192092896f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* s tile: 4 rows x NC*8 keys (kt zero-padded to a multiple of 16 columns) */
AVX2_INLINE void qk_tile2(int NC, float *s, const float *qs, const float *kt, int64_t qn, int64_t D)
{
#define QK2_DECL(r) \
    __m256 a##r##_0 = _mm256_setzero_ps(), a##r##_1 = a##r##_0, a##r##_2 = a##r##_0; \
    const float *q##r = qs + (r < qn ? r : 0) * D;
    R4(QK2_DECL)
    for (int64_t d = 0; d < D; d++) {
        const float *kd = kt + d * KB;
        __m256 k0 = _mm256_loadu_ps(kd);
        __m256 k1 = NC > 1 ? _mm256_loadu_ps(kd + 8) : k0;
        __m256 k2 = NC > 2 ? _mm256_loadu_ps(kd + 16) : k0;
#define QK2_STEP(r) { \
        __m256 bq = _mm256_broadcast_ss(q##r + d); \
        a##r##_0 = _mm256_fmadd_ps(bq, k0, a##r##_0); \
        if (NC > 1) a##r##_1 = _mm256_fmadd_ps(bq, k1, a##r##_1); \
        if (NC > 2) a##r##_2 = _mm256_fmadd_ps(bq, k2, a##r##_2); }
        R4(QK2_STEP)
    }
#define QK2_STORE(r) \
    if (r < qn) { \
        _mm256_storeu_ps(s + r * KB, a##r##_0); \
        if (NC > 1) _mm256_storeu_ps(s + r * KB + 8, a##r##_1); \
        if (NC > 2) _mm256_storeu_ps(s + r * KB + 16, a##r##_2); }
    R4(QK2_STORE)
#undef QK2_DECL
#undef QK2_STEP
#undef QK2_STORE
}

AVX2 static void qk_avx2(float *s, const float *qs, const float *kt, int64_t qn, int64_t kn, int64_t D)
{
    for (int64_t i = 0; i < qn; i += 4)
        for (int64_t j = 0; j < kn; j += 24) {
            int64_t left = kn - j;
            const float *q0 = qs + i * D, *k0 = kt + j;
            float *s0 = s + i * KB + j;
            if (left > 16) qk_tile2(3, s0, q0, k0, qn - i, D);
            else if (left > 8) qk_tile2(2, s0, q0, k0, qn - i, D);
            else qk_tile2(1, s0, q0, k0, qn - i, D);
        }
}

/* o tile: 4 rows x NV*8 value columns, the last vector masked by vm (all lanes set
 * when full) */
AVX2_INLINE void pv_tile2(int NV, float *o, const float *p, const float *v, int64_t qn, int64_t kn,
                          int64_t Dv, __m256i vm)
{
    const __m256i all = _mm256_set1_epi32(-1);
    const __m256i m0 = NV == 1 ? vm : all, m1 = NV == 2 ? vm : all, m2 = NV == 3 ? vm : all;
#define PV2_DECL(r) \
    const float *o##r = o + (r < qn ? r : 0) * Dv, *p##r = p + (r < qn ? r : 0) * KB; \
    __m256 a##r##_0 = _mm256_maskload_ps(o##r, m0); \
    __m256 a##r##_1 = NV > 1 ? _mm256_maskload_ps(o##r + 8, m1) : _mm256_setzero_ps(); \
    __m256 a##r##_2 = NV > 2 ? _mm256_maskload_ps(o##r + 16, m2) : _mm256_setzero_ps();
    R4(PV2_DECL)
    for (int64_t j = 0; j < kn; j++) {
        const float *vr = v + j * Dv;
        __m256 v0 = _mm256_maskload_ps(vr, m0);
        __m256 v1 = NV > 1 ? _mm256_maskload_ps(vr + 8, m1) : v0;
        __m256 v2 = NV > 2 ? _mm256_maskload_ps(vr + 16, m2) : v0;
#define PV2_STEP(r) { \
        __m256 bp = _mm256_broadcast_ss(p##r + j); \
        a##r##_0 = _mm256_fmadd_ps(bp, v0, a##r##_0); \
        if (NV > 1) a##r##_1 = _mm256_fmadd_ps(bp, v1, a##r##_1); \
        if (NV > 2) a##r##_2 = _mm256_fmadd_ps(bp, v2, a##r##_2); }
        R4(PV2_STEP)
    }
#define PV2_STORE(r) \
    if (r < qn) { \
        float *w##r = o + r * Dv; \
        _mm256_maskstore_ps(w##r, m0, a##r##_0); \
        if (NV > 1) _mm256_maskstore_ps(w##r + 8, m1, a##r##_1); \
        if (NV > 2) _mm256_maskstore_ps(w##r + 16, m2, a##r##_2); }
    R4(PV2_STORE)
#undef PV2_DECL
#undef PV2_STEP
#undef PV2_STORE
}

AVX2 static void pv_avx2(float *o, const float *p, const float *v, int64_t qn, int64_t kn, int64_t Dv)
{
    int64_t nvec = (Dv + 7) / 8, nchunk = (nvec + 2) / 3;
    for (int64_t i = 0; i < qn; i += 4) {
        int64_t vec0 = 0;
        for (int64_t ch = 0; ch < nchunk; ch++) {
            int64_t nv = (nvec - vec0) / (nchunk - ch) + ((nvec - vec0) % (nchunk - ch) ? 1 : 0);
            int64_t c0 = 8 * vec0, w = Dv - c0 < 8 * nv ? Dv - c0 : 8 * nv;
            __m256i vm = mask8(w - 8 * (nv - 1));
            float *o0 = o + i * Dv + c0;
            const float *p0 = p + i * KB, *v0 = v + c0;
            if (nv == 3) pv_tile2(3, o0, p0, v0, qn - i, kn, Dv, vm);
            else if (nv == 2) pv_tile2(2, o0, p0, v0, qn - i, kn, Dv, vm);
            else pv_tile2(1, o0, p0, v0, qn - i, kn, Dv, vm);
            vec0 += nv;
        }
    }
}

AVX2 static void softmax_row_avx2(float *s, int64_t nvalid, int64_t kn, float *m, float *l, float *o, int64_t Dv)
{
    if (nvalid <= 0) {
        memset(s, 0, (size_t)kn * sizeof(float));
        return;
    }
    __m256 mx = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= nvalid; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + j));
    float bmax = hmax8(mx);
    for (; j < nvalid; j++) bmax = s[j] > bmax ? s[j] : bmax;
    float mnew = bmax > *m ? bmax : *m;
    __m256 vm = _mm256_set1_ps(mnew), sum = _mm256_setzero_ps();
    for (j = 0; j < kn; j += 8) {
        __m256 keep = _mm256_castsi256_ps(mask8(nvalid - j));
        __m256 e = _mm256_and_ps(keep, exp2_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm)));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(s + j, e);
    }
    float alpha = exp2f(*m - mnew);
    if (alpha != 1.0f) {
        __m256 va = _mm256_set1_ps(alpha);
        int64_t c = 0;
        for (; c + 8 <= Dv; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), va));
        for (; c < Dv; c++) o[c] *= alpha;
    }
    *l = *l * alpha + hsum8(sum);
    *m = mnew;
}
#endif

#ifdef ATT_X86
/* ---------------- bf16 products (kiln.precision "bf16") ----------------
 * q.k^T and p.v with inputs rounded to bf16 (nearest even) and f32 sums: operands in
 * pair lanes (depth 2i in the low half of a 32-bit lane, 2i+1 in the high half), what
 * vdpbf16ps multiplies. The scaled queries and the transposed keys are rounded in place
 * (pair row i where f32 row 2i was), the probabilities row by row in place, the values
 * once per key block into their own buffer. The softmax statistics stay f32. Without
 * AVX512_BF16 (emu) the same lanes go through two f32 FMAs, odd depth first, as the
 * instruction is specified; those functions never execute a bf16 instruction. */
#define BF16_FN static __attribute__((target("avx512f,avx512bf16,fma")))
#define BF16_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bf16,fma")))

/* acc += a . b over the pairs of each lane */
BF16_INLINE __m512 bf16_dot(int emu, __m512 acc, __m512i a, __m512i b)
{
    if (!emu) return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
    const __m512i hm = _mm512_set1_epi32((int)0xffff0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hm)), _mm512_castsi512_ps(_mm512_and_si512(b, hm)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}

/* rows x n f32 values (row stride ld floats) -> rows of ceil(n/2) pair lanes, in place */
BF16_FN void bf16_rows_inplace(float *x, int64_t rows, int64_t n, int64_t ld)
{
    int64_t np = (n + 1) / 2;
    for (int64_t r = 0; r < rows; r++) {
        float *row = x + r * ld;
        uint32_t *dst = (uint32_t *)row;
        for (int64_t j = 0; j < np; j += 16) { /* reads [2j, 2j+32) before writing [j, j+16) */
            __mmask16 mk = tail_mask(np - j);
            int64_t left = n - 2 * j; /* values from 2j on */
            __m512 a = _mm512_maskz_loadu_ps(tail_mask(left), row + 2 * j);
            __m512 b = _mm512_maskz_loadu_ps(tail_mask(left - 16 < 0 ? 0 : left - 16), row + 2 * j + 16);
            _mm512_mask_storeu_epi32(dst + j, mk, bf16_pairs_in_order(a, b));
        }
    }
}

/* Two rows' 16 lanes as pair lanes (row e in the low halves), by the instruction or
 * emulated (the same bits). */
#define BF16_BW_INLINE static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512bf16,fma")))
BF16_BW_INLINE __m512i rows_pair(int emu, __m512 e, __m512 o, __m512i ilv)
{
    return emu ? bf16_pair(e, o) : bf16_pair_native(e, o, ilv);
}

/* transposed keys kt[d][j] (rows of KB) -> pair rows kt[d/2][j] for knp keys, in place */
BF16_BW_INLINE void keys_pairs_body(int emu, float *kt, int64_t knp, int64_t D)
{
    uint32_t *dst = (uint32_t *)kt;
    const __m512i ilv = bf16_pair_index();
    for (int64_t dp = 0; dp < (D + 1) / 2; dp++)
        for (int64_t j = 0; j < knp; j += 16) {
            __m512 e = _mm512_load_ps(kt + 2 * dp * KB + j);
            __m512 o = 2 * dp + 1 < D ? _mm512_load_ps(kt + (2 * dp + 1) * KB + j) : _mm512_setzero_ps();
            _mm512_store_si512(dst + dp * KB + j, rows_pair(emu, e, o, ilv));
        }
}

/* values v[j][c] of the block (kn keys) -> vp[j/2][c] pair rows of dvp lanes (zero past Dv, kn) */
BF16_BW_INLINE void values_pairs_body(int emu, uint32_t *vp, const float *v, int64_t kn, int64_t Dv, int64_t dvp)
{
    const __m512i ilv = bf16_pair_index();
    for (int64_t jp = 0; jp < (kn + 1) / 2; jp++) {
        const float *v0 = v + 2 * jp * Dv, *v1 = v0 + Dv;
        int odd = 2 * jp + 1 < kn;
        for (int64_t c = 0; c < dvp; c += 16) {
            __mmask16 mk = tail_mask(Dv - c < 0 ? 0 : Dv - c);
            __m512 e = _mm512_maskz_loadu_ps(mk, v0 + c);
            __m512 o = odd ? _mm512_maskz_loadu_ps(mk, v1 + c) : _mm512_setzero_ps();
            _mm512_store_si512(vp + jp * dvp + c, rows_pair(emu, e, o, ilv));
        }
    }
}

/* one key block's keys and values in pairs */
static __attribute__((target("avx512f,avx512bw,avx512bf16,fma"))) void block_pairs(int emu, float *kt, int64_t knp,
                                                                                 int64_t D, uint32_t *vp,
                                                                                 const float *v, int64_t kn, int64_t Dv)
{
    if (emu) {
        keys_pairs_body(1, kt, knp, D);
        values_pairs_body(1, vp, v, kn, Dv, round16(Dv));
    } else {
        keys_pairs_body(0, kt, knp, D);
        values_pairs_body(0, vp, v, kn, Dv, round16(Dv));
    }
}

/* softmax_row_avx512 for bf16 products: the probabilities go straight into pair lanes
 * (probability 2i in the low half of lane i, 2i+1 in the high half, in place at the
 * row's start); the sum l is of the f32 values. Native: vcvtne2ps2bf16, whose word
 * order is already the pair order. */
BF16_INLINE void softmax_row_pairs(int emu, float *s, int64_t nvalid, int64_t kn, float *m, float *l, float *o,
                                   int64_t Dv)
{
    if (nvalid <= 0) {
        memset(s, 0, (size_t)kn * sizeof(float));
        return;
    }
    float mnew = softmax_new_max(s, nvalid, *m);
    __m512 vm = _mm512_set1_ps(mnew), sum = _mm512_setzero_ps();
    uint32_t *dst = (uint32_t *)s;
    int64_t j = 0;
    /* whole vectors of valid keys: no masks */
    for (; j + 32 <= nvalid; j += 32) { /* reads [j, j+32) before writing [j/2, j/2+16) */
        __m512 e0 = exp2_for_bf16(_mm512_sub_ps(_mm512_load_ps(s + j), vm));
        __m512 e1 = exp2_for_bf16(_mm512_sub_ps(_mm512_load_ps(s + j + 16), vm));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512(dst + j / 2, emu ? bf16_pairs_in_order(e0, e1) : (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    for (; j < kn; j += 32) {
        __mmask16 m0 = tail_mask(nvalid - j < 0 ? 0 : nvalid - j), m1 = tail_mask(nvalid - j - 16 < 0 ? 0 : nvalid - j - 16);
        __mmask16 l0 = tail_mask(kn - j), l1 = tail_mask(kn - j - 16 < 0 ? 0 : kn - j - 16);
        __m512 e0 = _mm512_maskz_mov_ps(m0, exp2_for_bf16(_mm512_sub_ps(_mm512_maskz_load_ps(l0, s + j), vm)));
        __m512 e1 = _mm512_maskz_mov_ps(m1, exp2_for_bf16(_mm512_sub_ps(_mm512_maskz_load_ps(l1, s + j + 16), vm)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512(dst + j / 2, emu ? bf16_pairs_in_order(e0, e1) : (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    softmax_rescale(o, Dv, m, l, mnew, sum);
}

BF16_FN void softmax_pairs(float *s, int64_t nvalid, int64_t kn, float *m, float *l, float *o, int64_t Dv)
{
    softmax_row_pairs(0, s, nvalid, kn, m, l, o, Dv);
}

BF16_FN void softmax_pairs_emu(float *s, int64_t nvalid, int64_t kn, float *m, float *l, float *o, int64_t Dv)
{
    softmax_row_pairs(1, s, nvalid, kn, m, l, o, Dv);
}

/* TR rows x NC*16 keys of s from pair rows of q (stride D floats) and kt (stride KB) */
BF16_INLINE void qk_tile_bf16(int emu, int NC, float *s, const float *qs, const float *kt, int64_t qn, int64_t D)
{
    int64_t dp_n = (D + 1) / 2;
#define QK_DECL(r) \
    __m512 a##r##_0 = _mm512_setzero_ps(), a##r##_1 = a##r##_0, a##r##_2 = a##r##_0; \
    const uint32_t *q##r = (const uint32_t *)(qs + (r < qn ? r : 0) * D);
    R8(QK_DECL)
    for (int64_t d = 0; d < dp_n; d++) {
        const uint32_t *kd = (const uint32_t *)kt + d * KB;
        __m512i k0 = _mm512_load_si512(kd);
        __m512i k1 = NC > 1 ? _mm512_load_si512(kd + 16) : k0;
        __m512i k2 = NC > 2 ? _mm512_load_si512(kd + 32) : k0;
#define QK_STEP(r) { \
        __m512i bq = _mm512_set1_epi32((int)q##r[d]); \
        a##r##_0 = bf16_dot(emu, a##r##_0, bq, k0); \
        if (NC > 1) a##r##_1 = bf16_dot(emu, a##r##_1, bq, k1); \
        if (NC > 2) a##r##_2 = bf16_dot(emu, a##r##_2, bq, k2); }
        R8(QK_STEP)
    }
#define QK_STORE(r) \
    if (r < qn) { \
        _mm512_store_ps(s + r * KB, a##r##_0); \
        if (NC > 1) _mm512_store_ps(s + r * KB + 16, a##r##_1); \
        if (NC > 2) _mm512_store_ps(s + r * KB + 32, a##r##_2); }
    R8(QK_STORE)
#undef QK_DECL
#undef QK_STEP
#undef QK_STORE
}

BF16_INLINE void qk_bf16_body(int emu, float *s, const float *qs, const float *kt, int64_t qn, int64_t kn, int64_t D)
{
    for (int64_t i = 0; i < qn; i += TR)
        for (int64_t j = 0; j < kn; j += 48) {
            int64_t left = kn - j;
            const float *q0 = qs + i * D, *k0 = kt + j;
            float *s0 = s + i * KB + j;
            if (left > 32) qk_tile_bf16(emu, 3, s0, q0, k0, qn - i, D);
            else if (left > 16) qk_tile_bf16(emu, 2, s0, q0, k0, qn - i, D);
            else qk_tile_bf16(emu, 1, s0, q0, k0, qn - i, D);
        }
}

BF16_FN void qk_bf16(float *s, const float *qs, const float *kt, int64_t qn, int64_t kn, int64_t D)
{
    qk_bf16_body(0, s, qs, kt, qn, kn, D);
}

BF16_FN void qk_bf16_emu(float *s, const float *qs, const float *kt, int64_t qn, int64_t kn, int64_t D)
{
    qk_bf16_body(1, s, qs, kt, qn, kn, D);
}

/* o[r][c] += sum over key pairs of p pairs (rows of s, stride KB lanes) times vp pair
 * rows (dvp lanes); NV vectors of columns from c0, the last masked by vm */
BF16_INLINE void pv_tile_bf16(int emu, int NV, float *o, const uint32_t *p, const uint32_t *vp, int64_t qn,
                              int64_t knp2, int64_t Dv, int64_t dvp, __mmask16 vm)
{
    const __mmask16 full = (__mmask16)0xFFFF;
    const __mmask16 m0 = NV == 1 ? vm : full, m1 = NV == 2 ? vm : full, m2 = NV == 3 ? vm : full;
#define PV_DECL(r) \
    const float *o##r = o + (r < qn ? r : 0) * Dv; const uint32_t *p##r = p + (r < qn ? r : 0) * KB; \
    __m512 a##r##_0 = _mm512_maskz_loadu_ps(m0, o##r); \
    __m512 a##r##_1 = NV > 1 ? _mm512_maskz_loadu_ps(m1, o##r + 16) : _mm512_setzero_ps(); \
    __m512 a##r##_2 = NV > 2 ? _mm512_maskz_loadu_ps(m2, o##r + 32) : _mm512_setzero_ps();
    R8(PV_DECL)
    for (int64_t j = 0; j < knp2; j++) {
        const uint32_t *vr = vp + j * dvp;
        __m512i v0 = _mm512_load_si512(vr);
        __m512i v1 = NV > 1 ? _mm512_load_si512(vr + 16) : v0;
        __m512i v2 = NV > 2 ? _mm512_load_si512(vr + 32) : v0;
#define PV_STEP(r) { \
        __m512i bp = _mm512_set1_epi32((int)p##r[j]); \
        a##r##_0 = bf16_dot(emu, a##r##_0, bp, v0); \
        if (NV > 1) a##r##_1 = bf16_dot(emu, a##r##_1, bp, v1); \
        if (NV > 2) a##r##_2 = bf16_dot(emu, a##r##_2, bp, v2); }
        R8(PV_STEP)
    }
#define PV_STORE(r) \
    if (r < qn) { \
        float *w##r = o + r * Dv; \
        _mm512_mask_storeu_ps(w##r, m0, a##r##_0); \
        if (NV > 1) _mm512_mask_storeu_ps(w##r + 16, m1, a##r##_1); \
        if (NV > 2) _mm512_mask_storeu_ps(w##r + 32, m2, a##r##_2); }
    R8(PV_STORE)
#undef PV_DECL
#undef PV_STEP
#undef PV_STORE
}

/* pv_tile_bf16 for Dv = 40 (SD 1.x's first level, where the attention is largest): two
 * full vectors of columns per row, and the last 8 columns of two rows in one vector
 * (row 2u in the low half, 2u+1 in the high half, their probabilities blended), so no
 * lane idles: 20 products per key pair for 8 rows instead of 24. */
BF16_INLINE void pv_tile_bf16_40(int emu, float *o, const uint32_t *p, const uint32_t *vp, int64_t qn, int64_t knp2,
                                 int64_t dvp)
{
    const int64_t Dv = 40;
#define PV_DECL(r) \
    const float *o##r = o + (r < qn ? r : 0) * Dv; const uint32_t *p##r = p + (r < qn ? r : 0) * KB; \
    __m512 a##r##_0 = _mm512_loadu_ps(o##r), a##r##_1 = _mm512_loadu_ps(o##r + 16);
    R8(PV_DECL)
#define PV_TDECL(u, r0, r1) \
    __m512 t##u = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(o##r0 + 32))), \
                                                      _mm256_castps_pd(_mm256_loadu_ps(o##r1 + 32)), 1));
    PV_TDECL(0, 0, 1) PV_TDECL(1, 2, 3) PV_TDECL(2, 4, 5) PV_TDECL(3, 6, 7)
    for (int64_t j = 0; j < knp2; j++) {
        const uint32_t *vr = vp + j * dvp;
        __m512i v0 = _mm512_load_si512(vr), v1 = _mm512_load_si512(vr + 16);
        __m512i vt = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(const void *)(vr + 32)));
#define PV_STEP(r) \
        __m512i bp##r = _mm512_set1_epi32((int)p##r[j]); \
        a##r##_0 = bf16_dot(emu, a##r##_0, bp##r, v0); \
        a##r##_1 = bf16_dot(emu, a##r##_1, bp##r, v1);
        R8(PV_STEP)
#define PV_TSTEP(u, r0, r1) t##u = bf16_dot(emu, t##u, _mm512_mask_blend_epi32(0xFF00, bp##r0, bp##r1), vt);
        PV_TSTEP(0, 0, 1) PV_TSTEP(1, 2, 3) PV_TSTEP(2, 4, 5) PV_TSTEP(3, 6, 7)
    }
#define PV_STORE(r) \
    if (r < qn) { \
        float *w##r = o + r * Dv; \
        _mm512_storeu_ps(w##r, a##r##_0); \
        _mm512_storeu_ps(w##r + 16, a##r##_1); \
        _mm256_storeu_ps(w##r + 32, (r & 1) ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t_of(r)), 1)) \
                                            : _mm512_castps512_ps256(t_of(r))); }
#define t_of(r) ((r) < 2 ? t0 : (r) < 4 ? t1 : (r) < 6 ? t2 : t3)
    R8(PV_STORE)
#undef t_of
#undef PV_DECL
#undef PV_TDECL
#undef PV_STEP
#undef PV_TSTEP
#undef PV_STORE
}

BF16_INLINE void pv_bf16_body(int emu, float *o, const float *s, const uint32_t *vp, int64_t qn, int64_t kn,
                              int64_t Dv)
{
    if (Dv == 40) {
        const uint32_t *p = (const uint32_t *)s;
        for (int64_t i = 0; i < qn; i += TR) pv_tile_bf16_40(emu, o + i * Dv, p + i * KB, vp, qn - i, (kn + 1) / 2, 48);
        return;
    }

    int64_t nvec = (Dv + 15) / 16, nchunk = (nvec + 2) / 3, dvp = nvec * 16, knp2 = (kn + 1) / 2;
    const uint32_t *p = (const uint32_t *)s;
    for (int64_t i = 0; i < qn; i += TR) {
        int64_t vec0 = 0;
        for (int64_t ch = 0; ch < nchunk; ch++) {
            int64_t nv = (nvec - vec0) / (nchunk - ch) + ((nvec - vec0) % (nchunk - ch) ? 1 : 0);
            int64_t c0 = 16 * vec0, w = Dv - c0 < 16 * nv ? Dv - c0 : 16 * nv;
            __mmask16 vm = tail_mask(w - 16 * (nv - 1));
            float *oc = o + i * Dv + c0;
            const uint32_t *pc = p + i * KB, *vc = vp + c0;
            if (nv == 1) pv_tile_bf16(emu, 1, oc, pc, vc, qn - i, knp2, Dv, dvp, vm);
            else if (nv == 2) pv_tile_bf16(emu, 2, oc, pc, vc, qn - i, knp2, Dv, dvp, vm);
            else pv_tile_bf16(emu, 3, oc, pc, vc, qn - i, knp2, Dv, dvp, vm);
            vec0 += nv;
        }
    }
}

BF16_FN void pv_bf16(float *o, const float *s, const uint32_t *vp, int64_t qn, int64_t kn, int64_t Dv)
{
    pv_bf16_body(0, o, s, vp, qn, kn, Dv);
}

BF16_FN void pv_bf16_emu(float *o, const float *s, const uint32_t *vp, int64_t qn, int64_t kn, int64_t Dv)
{
    pv_bf16_body(1, o, s, vp, qn, kn, Dv);
}
#endif

/* ---------------- one task ---------------- */

/* kt[d][j] = k[k0 + j][d] for the block's kn keys, zero-padded to a multiple of 16;
 * under bf16 products kt then holds pair rows and vp the block's values in pairs.
 * k, v: the head's keys and values. */
static void prep_keys(const att_ctx *c, float *kt, uint32_t *vp, const float *k, const float *v, int64_t k0,
                      int64_t kn)
{
    int64_t D = c->D, Dv = c->Dv, knp = round16(kn);
#ifdef ATT_X86
    if (c->isa == ISA_AVX512) {
        keys_t_avx512(kt, k + k0 * D, kn, knp, D);
        if (c->bf16) block_pairs(c->bf16 != 1, kt, knp, D, vp, v + k0 * Dv, kn, Dv);
        return;
    }
#endif
    (void)vp; (void)v;
    for (int64_t j = 0; j < kn; j++) {
        const float *kr = k + (k0 + j) * D;
        for (int64_t d = 0; d < D; d++) kt[d * KB + j] = kr[d];
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = kn; j < knp; j++) kt[d * KB + j] = 0;
}

/* Tasks (head, key block) of the shared preparation. */
static void prep_tasks(void *p, int64_t begin, int64_t end)
{
    const att_ctx *c = p;
    for (int64_t t = begin; t < end; t++) {
        int64_t b = t / c->nkb, k0 = (t % c->nkb) * KB;
        float *kt = c->prep + (size_t)t * c->prep_block;
        prep_keys(c, kt, (uint32_t *)(kt + round16(c->D * KB)), c->k + b * c->Lk * c->D, c->v + b * c->Lk * c->Dv,
                  k0, c->Lk - k0 < KB ? c->Lk - k0 : KB);
    }
}

/* Rows [qt0, qt0+qtn) of head b. Each key block is transposed once into kt and then
 * used by every QB-row sub-block of the task, which keeps its own running max m,
 * sum l and unnormalized output o. */
static void att_block(att_ctx *c, float *ws, int64_t t)
{
    int64_t b = t / c->nqb, qt0 = (t % c->nqb) * QT;
    int64_t D = c->D, Dv = c->Dv, Lk = c->Lk;
    int64_t qtn = c->Lq - qt0 < QT ? c->Lq - qt0 : QT;
    float *qs = ws;
    float *ws_kt = qs + round16(QT * D);
    float *s = ws_kt + round16(D * KB);
    float *o = s + QB * KB;
    float *m = o + round16(QT * Dv);
    float *l = m + QT;
    uint32_t *ws_vp = (uint32_t *)(l + QT); /* bf16: the block's values in pairs */
    float *kt;
    uint32_t *vp;
    const float *q = c->q + (b * c->Lq + qt0) * D;
    const float *k = c->k + b * Lk * D;
    const float *v = c->v + b * Lk * Dv;

    for (int64_t i = 0; i < qtn * D; i++) qs[i] = q[i] * c->scale2;
#ifdef ATT_X86
    if (c->bf16) bf16_rows_inplace(qs, qtn, D, D);
#endif
    memset(o, 0, (size_t)(qtn * Dv) * sizeof(float));
    for (int64_t i = 0; i < qtn; i++) { m[i] = -INFINITY; l[i] = 0; }

    /* causal: query i sees keys j <= i (torch's tril mask over [Lq, Lk]) */
    int64_t kend = c->causal && qt0 + qtn < Lk ? qt0 + qtn : Lk;
    for (int64_t k0 = 0; k0 < kend; k0 += KB) {
        int64_t kn = kend - k0 < KB ? kend - k0 : KB;
        int64_t knp = round16(kn);
        if (c->prep) { /* made before the tasks, shared by the head's query blocks */
            kt = c->prep + (size_t)(b * c->nkb + k0 / KB) * c->prep_block;
            vp = (uint32_t *)(kt + round16(D * KB));
        } else {
            kt = ws_kt;
            vp = ws_vp;
            prep_keys(c, kt, vp, k, v, k0, kn);
        }
        for (int64_t sb = 0; sb < qtn; sb += QB) {
            int64_t q0 = qt0 + sb, qn = qtn - sb < QB ? qtn - sb : QB;
            if (c->causal && k0 > q0 + qn - 1) continue; /* every key of the block is masked */
            const float *qsb = qs + sb * D;
            float *osb = o + sb * Dv;
#ifdef ATT_X86
            if (c->bf16 == 1) qk_bf16(s, qsb, kt, qn, knp, D);
            else if (c->bf16) qk_bf16_emu(s, qsb, kt, qn, knp, D);
            else if (c->isa == ISA_AVX512) qk_avx512(s, qsb, kt, qn, knp, D);
            else if (c->isa == ISA_AVX2) qk_avx2(s, qsb, kt, qn, knp, D);
            else
#endif
                qk_generic(s, qsb, kt, qn, kn, D);
            for (int64_t i = 0; i < qn; i++) {
                int64_t nvalid = kn;
                if (c->causal && q0 + i - k0 + 1 < nvalid) nvalid = q0 + i - k0 + 1;
#ifdef ATT_X86
                if (c->bf16 == 1) softmax_pairs(s + i * KB, nvalid, kn, m + sb + i, l + sb + i, osb + i * Dv, Dv);
                else if (c->bf16) softmax_pairs_emu(s + i * KB, nvalid, kn, m + sb + i, l + sb + i, osb + i * Dv, Dv);
                else if (c->isa == ISA_AVX512) softmax_row_avx512(s + i * KB, nvalid, kn, m + sb + i, l + sb + i, osb + i * Dv, Dv);
                else if (c->isa == ISA_AVX2) softmax_row_avx2(s + i * KB, nvalid, kn, m + sb + i, l + sb + i, osb + i * Dv, Dv);
                else
#endif
                    softmax_row_generic(s + i * KB, nvalid, kn, m + sb + i, l + sb + i, osb + i * Dv, Dv);
            }
#ifdef ATT_X86
            if (c->bf16) {
                if (c->bf16 == 1) pv_bf16(osb, s, vp, qn, kn, Dv);
                else pv_bf16_emu(osb, s, vp, qn, kn, Dv);
            } else if (c->isa == ISA_AVX512) pv_avx512(osb, s, v + k0 * Dv, qn, kn, Dv);
            else if (c->isa == ISA_AVX2) pv_avx2(osb, s, v + k0 * Dv, qn, kn, Dv);
            else
#endif
                pv_generic(osb, s, v + k0 * Dv, qn, kn, Dv);
        }
    }
    float *out = c->out + (b * c->Lq + qt0) * Dv;
    for (int64_t i = 0; i < qtn; i++) {
        float inv = l[i] > 0 ? 1.0f / l[i] : 0.0f;
        for (int64_t d = 0; d < Dv; d++) out[i * Dv + d] = o[i * Dv + d] * inv;
    }
}

static void att_tasks(void *p, int64_t b, int64_t e)
{
    att_ctx *c = p;
    int idx = kiln_thread_index();
    float *ws = NULL, *own = NULL;
    if (idx >= 0 && idx < c->nslots) ws = c->scratch + (size_t)idx * c->slot;
    else { /* not one of the pool's threads: use a private slot */
        own = kiln_cpu_scratch_get(c->slot * sizeof(float));
        if (!own) { atomic_store(&c->oom, 1); return; }
        ws = own;
    }
    for (int64_t t = b; t < e; t++) att_block(c, ws, t);
    kiln_cpu_scratch_put(own);
}

/* Bytes of scratch one kiln_cpu_attention call allocates (all pool threads), for
 * memory planning and the bench; it depends on D, Dv and the thread count only.
 * Not yet declared in cpu_kernels.h (proposed addition). */
size_t kiln_cpu_attention_scratch_bytes(int64_t D, int64_t Dv);
size_t kiln_cpu_attention_scratch_bytes(int64_t D, int64_t Dv)
{
    return (size_t)kiln_cpu_threads() * slot_floats(D, Dv) * sizeof(float);
}

/* The slots of every thread, a private slot for a caller outside the pool, and the
 * shared key preparation (sized for bf16, the larger), as kiln_cpu_attention takes them. */
size_t kiln_cpu_attention_scratch_bound(int64_t B, int64_t Lq, int64_t Lk, int64_t D, int64_t Dv)
{
    if (B <= 0 || Lq <= 0 || Lk <= 0 || D <= 0 || Dv <= 0) return 0;
    size_t n = kiln_cpu_scratch_block_bound(kiln_cpu_attention_scratch_bytes(D, Dv)) +
               kiln_cpu_scratch_block_bound(slot_floats(D, Dv) * sizeof(float));
    int64_t nqb = (Lq + QT - 1) / QT, nkb = (Lk + KB - 1) / KB;
    size_t keys = (size_t)(B * nkb) * (size_t)round16(D * KB) * sizeof(float);
    size_t pairs = keys + (size_t)(B * nkb) * (size_t)(KB / 2) * (size_t)round16(Dv) * sizeof(float);
    if (nqb > 1) /* the bf16 buffer where it is under the limit, else the f32 one where that is */
        n += kiln_cpu_scratch_block_bound(pairs <= PREP_MAX_BYTES ? pairs : keys <= PREP_MAX_BYTES ? keys : 0);
    return n;
}

kiln_status kiln_cpu_attention(float *out, const float *q, const float *k, const float *v,
                               int64_t B, int64_t Lq, int64_t Lk, int64_t D, int64_t Dv,
                               float scale, int causal)
{
    if (!out || !q || !k || !v)
        return kiln_error(KILN_ERR_ARG, "attention: NULL buffer (out %p, q %p, k %p, v %p)",
                          (void *)out, (const void *)q, (const void *)k, (const void *)v);
    if (B <= 0 || Lq <= 0 || Lk <= 0 || D <= 0 || Dv <= 0)
        return kiln_error(KILN_ERR_ARG, "attention: bad shape B=%lld Lq=%lld Lk=%lld D=%lld Dv=%lld",
                          (long long)B, (long long)Lq, (long long)Lk, (long long)D, (long long)Dv);
    if (!isfinite(scale))
        return kiln_error(KILN_ERR_ARG, "attention: scale %g is not finite", (double)scale);
    if (D > (1 << 20) || Dv > (1 << 20))
        return kiln_error(KILN_ERR_ARG, "attention: head dim D=%lld Dv=%lld too large",
                          (long long)D, (long long)Dv);

    int nslots = kiln_cpu_threads();
    size_t slot = slot_floats(D, Dv);
    size_t bytes = kiln_cpu_attention_scratch_bytes(D, Dv);
    float *scratch = kiln_cpu_scratch_get(bytes); /* cached: no fresh pages on every call */
    if (!scratch)
        return kiln_error_oom("cpu", bytes, 0, 0, "attention: no memory for %zu bytes of scratch", bytes);

    att_ctx c;
    c.out = out; c.q = q; c.k = k; c.v = v;
    c.Lq = Lq; c.Lk = Lk; c.D = D; c.Dv = Dv;
    c.nqb = (Lq + QT - 1) / QT;
    c.scale2 = scale * LOG2E;
    c.causal = causal != 0;
    c.isa = kiln_cpu_isa();
    c.bf16 = c.isa == ISA_AVX512 ? kiln_cpu_bf16_active() : 0;
    c.scratch = scratch; c.slot = slot; c.nslots = nslots;
    atomic_init(&c.oom, 0);
    /* Several query blocks a head: its keys transposed (and its keys and values paired
     * under bf16) once, not once per block; the buffer is the size of k and v again, so
     * past PREP_MAX_BYTES each task makes its own as before. */
    c.nkb = (Lk + KB - 1) / KB;
    c.prep_block = (size_t)round16(D * KB) + (c.bf16 ? (size_t)(KB / 2) * (size_t)round16(Dv) : 0);
    size_t prep_bytes = (size_t)(B * c.nkb) * c.prep_block * sizeof(float);
    c.prep = c.nqb > 1 && prep_bytes <= PREP_MAX_BYTES ? kiln_cpu_scratch_get(prep_bytes) : NULL;
    if (c.prep) kiln_parallel_for(B * c.nkb, 1, prep_tasks, &c);
    kiln_parallel_for(B * c.nqb, 1, att_tasks, &c);
    kiln_cpu_scratch_put(c.prep);
    kiln_cpu_scratch_put(scratch);
    if (atomic_load(&c.oom))
        return kiln_error_oom("cpu", slot * sizeof(float), 0, 0, "attention: no memory for a worker's scratch");
    return KILN_OK;
}

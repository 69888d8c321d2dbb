/* test_bf16.c - kiln.precision's C side (runtime/precision.c) and the CPU products with
 * bf16 inputs (kernels/cpu/gemm.c, attention.c; conv2d through implicit GEMM and
 * Winograd F(4x4, 3x3)) against double-precision references, with bounds derived from
 * bf16's 8-bit significand, not tuned:
 *   each input rounded to bf16 (nearest even): x(1 + d), |d| <= u = 2^-8; a product of two
 *   rounded inputs is exact in f32 and off by at most 2u + u^2 relative; summing n terms
 *   in f32 (any order) adds at most gamma_n = n 2^-24 / (1 - n 2^-24) of the sum of their
 *   magnitudes. So a dot product's error is at most (2u + u^2 + gamma_n (1 + 2u + u^2)) S,
 *   S = sum |a_k b_k| in exact arithmetic; an output with a bias adds 2^-24 |y|.
 *   Winograd (both paths, conv2d_winograd.c and conv2d_winograd_few.c): the rounding happens on the
 *   transformed tiles U = G g G^T, V = B^T d B, so
 *   the bound is (2u + u^2 + gamma_C) sum_p |A^T|_ip |A^T|_jp sum_c |U_cp| |V_cp|, with
 *   |U|, |V| bounded through the absolute transform matrices, on top of what the f32
 *   Winograd path already differs from the exact result (measured on the same inputs).
 *   Attention: scores off by at most D_s = (2u + u^2 + gamma_D) scale sum_d |q_d k_d|
 *   (natural-log units); softmax weights then by a factor within exp(+-2 max D_s); p and v
 *   rounded (2u + u^2), summed over Lk (gamma_Lk), exp's own error 2^-20: the output is off
 *   by at most (exp(2 max D_s) - 1 + 2u + u^2 + gamma_Lk + 2^-20) sum_j p_j |v_j|.
 * The emulated kernel (no vdpbf16ps) is compared with the native one: equal, or within the
 * f32 summation bound gamma_n S (the instruction's internal order is the CPU's). */
#define _POSIX_C_SOURCE 200809L
#include "test.h"

#include "cpu_isa.h"
#include "cpu_internal.h"
#include "cpu_kernels.h"
#include "precision.h"

#include <stdint.h>

static const double U = 1.0 / 256; /* bf16 unit roundoff */
static const double U32 = 1.0 / 16777216;

static double gamma_n(double n) { return n * U32 / (1 - n * U32); }
static double dot_bound(double n) { return 2 * U + U * U + gamma_n(n) * (1 + 2 * U + U * U); }

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static float frand(void)
{
    rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
    return (float)((rs >> 40) * (2.0 / 16777216.0)) - 1.0f;
}

static float *rand_buf(size_t n, float scale)
{
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = frand() * scale;
    return p;
}

/* 1 when the bf16 kernels run here (else the test skips) */
static int bf16_here(void)
{
    kiln_precision_set(KILN_PREC_BF16);
    int on = kiln_cpu_bf16_active();
    kiln_precision_set(KILN_PREC_F32);
    return on;
}

/* ---- the setting ---- */

static void t_precision_names(void)
{
    CHECK(!strcmp(kiln_precision_name(KILN_PREC_F32), "f32"), "f32");
    CHECK(!strcmp(kiln_precision_name(KILN_PREC_BF16), "bf16"), "bf16");
    CHECK(!strcmp(kiln_precision_name(KILN_PREC_F16), "f16"), "f16");
    CHECK(!strcmp(kiln_precision_name((kiln_precision)7), "?"), "past the end");
    CHECK(kiln_precision_from_name("bf16") == KILN_PREC_BF16, "from bf16");
    CHECK(kiln_precision_from_name("f16") == KILN_PREC_F16, "from f16");
    CHECK(kiln_precision_from_name("f32") == KILN_PREC_F32, "from f32");
    CHECK(kiln_precision_from_name("fp32") == -1 && kiln_precision_from_name(NULL) == -1, "unknown names");
}

static void t_precision_defaults(void)
{
    kiln_precision_unset();
    CHECK(!kiln_precision_is_set(), "unset");
    CHECK(kiln_precision_get() == KILN_PREC_F32, "the CPU's default is f32");
    CHECK(kiln_precision_for(NULL) == KILN_PREC_F32, "host");
    kiln_precision_set_default(KILN_DEV_CUDA, KILN_PREC_F16);
    CHECK(kiln_precision_for_type(KILN_DEV_CUDA) == KILN_PREC_F16, "a registered default");
    CHECK(kiln_precision_for_type(KILN_DEV_CPU) == KILN_PREC_F32, "others keep theirs");
    kiln_precision_set(KILN_PREC_BF16);
    CHECK(kiln_precision_is_set() && kiln_precision_get() == KILN_PREC_BF16, "set");
    CHECK(kiln_precision_for_type(KILN_DEV_CUDA) == KILN_PREC_BF16, "a set precision holds everywhere");
    kiln_precision_set((kiln_precision)9);
    CHECK(kiln_precision_get() == KILN_PREC_BF16, "an invalid value is ignored");
    kiln_precision_unset();
    CHECK(kiln_precision_for_type(KILN_DEV_CUDA) == KILN_PREC_F16, "unset: the default again");
    kiln_precision_set_default(KILN_DEV_CUDA, KILN_PREC_F32);
    kiln_precision_set(KILN_PREC_F32);
}

/* ---- linear ---- */

/* y = x w^T + b with x [M,K], w [N,K] (f32 or f16), each output against its bound */
static void check_linear(int64_t M, int64_t N, int64_t K, kiln_dtype wdt, int emulate)
{
    float *x = rand_buf((size_t)(M * K), 1.0f), *wf = rand_buf((size_t)(N * K), 0.5f), *b = rand_buf((size_t)N, 1.0f);
    void *w = wf;
    uint16_t *wh = NULL;
    if (wdt == KILN_F16 || wdt == KILN_BF16) {
        wh = malloc((size_t)(N * K) * 2);
        for (int64_t i = 0; i < N * K; i++) {
            wh[i] = wdt == KILN_F16 ? kiln_f32_to_f16(wf[i]) : kiln_f32_to_bf16(wf[i]);
            wf[i] = wdt == KILN_F16 ? kiln_f16_to_f32(wh[i]) : kiln_bf16_to_f32(wh[i]); /* the values the kernel sees */
        }
        w = wh;
    }
    float *y = malloc((size_t)(M * N) * sizeof *y);
    kiln_precision_set(KILN_PREC_BF16);
    kiln_cpu_bf16_set_emulation(emulate);
    kiln_status st = kiln_cpu_linear(y, x, w, wdt, b, M, N, K);
    kiln_cpu_bf16_set_emulation(0);
    kiln_precision_set(KILN_PREC_F32);
    CHECK(st == KILN_OK, "linear: %s", kiln_last_error());
    double worst = 0;
    int bad = 0;
    for (int64_t i = 0; i < M && !bad; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0, S = 0;
            for (int64_t k = 0; k < K; k++) {
                double p = (double)x[i * K + k] * wf[j * K + k];
                s += p;
                S += fabs(p);
            }
            double ref = s + b[j], err = fabs(y[i * N + j] - ref);
            double bound = dot_bound((double)K + 1) * S + U32 * (fabs(ref) + fabs(b[j]));
            if (err / bound > worst) worst = err / bound;
            if (!(err <= bound)) {
                CHECK(0, "linear %lldx%lldx%lld %s%s: y[%lld,%lld] = %.9g, exact %.9g, bound %.3g", (long long)M,
                      (long long)N, (long long)K, kiln_dtype_name(wdt), emulate ? " emulated" : "", (long long)i,
                      (long long)j, y[i * N + j], ref, bound);
                bad = 1;
                break;
            }
        }
    /* and bf16 really happened: an f32 result would be far inside the bound */
    CHECK(worst > 0.01, "linear %lldx%lldx%lld: error only %.3g of the bf16 bound (did f32 run?)", (long long)M,
          (long long)N, (long long)K, worst);
    free(x); free(wf); free(b); free(y); free(wh);
}

static void t_linear_bf16(void)
{
    if (!bf16_here()) { SKIP("no AVX-512 on this CPU: bf16 runs as f32"); return; }
    static const int64_t shapes[][3] = {{12, 32, 96}, {37, 45, 77}, {100, 320, 768}, {64, 33, 1281},
                                        {9, 700, 40}, {300, 96, 800}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        check_linear(shapes[s][0], shapes[s][1], shapes[s][2], KILN_F32, 0);
        check_linear(shapes[s][0], shapes[s][1], shapes[s][2], KILN_F16, 0);
        check_linear(shapes[s][0], shapes[s][1], shapes[s][2], KILN_BF16, 0);
    }
}

static void t_linear_bf16_emulated(void)
{
    if (!bf16_here()) { SKIP("no AVX-512 on this CPU"); return; }
    check_linear(37, 45, 77, KILN_F32, 1);
    check_linear(100, 320, 768, KILN_F16, 1);
    check_linear(100, 320, 768, KILN_BF16, 1);
}

/* gemm and batched gemm (kiln.nn.matmul) in every transposition, alpha and beta */
static void t_gemm_bf16(void)
{
    if (!bf16_here()) { SKIP("no AVX-512 on this CPU"); return; }
    const int64_t M = 45, N = 70, K = 333, batch = 3;
    float alpha = 0.75f, beta = 0.5f;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int batched = 0; batched < 2; batched++) {
                int64_t nb = batched ? batch : 1;
                float *A = rand_buf((size_t)(nb * M * K), 1.0f), *B = rand_buf((size_t)(nb * K * N), 1.0f);
                float *C = rand_buf((size_t)(nb * M * N), 1.0f), *C0 = malloc((size_t)(nb * M * N) * 4);
                memcpy(C0, C, (size_t)(nb * M * N) * 4);
                int64_t lda = ta ? M : K, ldb = tb ? K : N;
                kiln_precision_set(KILN_PREC_BF16);
                if (batched)
                    kiln_cpu_gemm_batched_f32(ta, tb, nb, M, N, K, alpha, A, lda, M * K, B, ldb, K * N, beta, C, N, M * N);
                else
                    kiln_cpu_gemm_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, N);
                kiln_precision_set(KILN_PREC_F32);
                double worst = 0;
                for (int64_t b = 0; b < nb; b++)
                    for (int64_t i = 0; i < M; i++)
                        for (int64_t j = 0; j < N; j++) {
                            double sum = 0, S = 0;
                            for (int64_t k = 0; k < K; k++) {
                                double a = A[b * M * K + (ta ? k * M + i : i * K + k)];
                                double bv = B[b * K * N + (tb ? j * K + k : k * N + j)];
                                sum += a * bv;
                                S += fabs(a * bv);
                            }
                            double c0 = C0[b * M * N + i * N + j], ref = alpha * sum + beta * c0;
                            /* alpha scales the sum (one rounding), beta*C adds one term */
                            double bound = dot_bound((double)K + 2) * fabs(alpha) * S + 2 * U32 * (fabs(ref) + fabs(beta * c0));
                            double r = fabs(C[b * M * N + i * N + j] - ref) / bound;
                            if (r > worst) worst = r;
                        }
                CHECK(worst <= 1.0, "gemm ta %d tb %d batched %d: worst error %.3g of the bound", ta, tb, batched, worst);
                CHECK(worst > 0.01, "gemm ta %d tb %d batched %d: error only %.3g of the bf16 bound", ta, tb, batched, worst);
                free(A); free(B); free(C); free(C0);
            }
}

/* tiny products keep f32 (<= 8 rows), and f32 precision is untouched by a bf16 run */
static void t_linear_f32_unchanged(void)
{
    int64_t M = 40, N = 64, K = 200;
    float *x = rand_buf((size_t)(M * K), 1.0f), *w = rand_buf((size_t)(N * K), 1.0f);
    float *y0 = malloc((size_t)(M * N) * 4), *y1 = malloc((size_t)(M * N) * 4), *y2 = malloc((size_t)(M * N) * 4);
    kiln_precision_set(KILN_PREC_F32);
    kiln_cpu_linear(y0, x, w, KILN_F32, NULL, M, N, K);
    kiln_precision_set(KILN_PREC_BF16);
    kiln_cpu_linear(y1, x, w, KILN_F32, NULL, M, N, K);
    kiln_precision_set(KILN_PREC_F32);
    kiln_cpu_linear(y2, x, w, KILN_F32, NULL, M, N, K);
    CHECK(!memcmp(y0, y2, (size_t)(M * N) * 4), "f32 after bf16 is the same f32");
    if (bf16_here()) CHECK(memcmp(y0, y1, (size_t)(M * N) * 4) != 0, "bf16 differs from f32");
    /* 8 rows: f32 even under bf16 */
    kiln_precision_set(KILN_PREC_BF16);
    kiln_cpu_linear(y1, x, w, KILN_F32, NULL, 8, N, K);
    kiln_precision_set(KILN_PREC_F32);
    kiln_cpu_linear(y2, x, w, KILN_F32, NULL, 8, N, K);
    CHECK(!memcmp(y1, y2, (size_t)(8 * N) * 4), "8 rows stay f32");
    kiln_precision_set(KILN_PREC_F16);
    kiln_cpu_linear(y1, x, w, KILN_F32, NULL, M, N, K);
    CHECK(!memcmp(y0, y1, (size_t)(M * N) * 4), "f16 on the CPU computes in f32");
    kiln_precision_set(KILN_PREC_F32);
    free(x); free(w); free(y0); free(y1); free(y2);
}

/* native and emulated: the same bits, or within the f32 summation-order bound */
static void t_native_vs_emulated(void)
{
    if (!bf16_here()) { SKIP("no AVX-512 on this CPU"); return; }
    kiln_precision_set(KILN_PREC_BF16);
    int native = kiln_cpu_bf16_active() == 1;
    kiln_precision_set(KILN_PREC_F32);
    if (!native) { SKIP("no AVX512_BF16 here: only the emulated kernel runs"); return; }
    int64_t M = 77, N = 100, K = 1000;
    float *x = rand_buf((size_t)(M * K), 1.0f), *w = rand_buf((size_t)(N * K), 1.0f);
    float *y0 = malloc((size_t)(M * N) * 4), *y1 = malloc((size_t)(M * N) * 4);
    kiln_precision_set(KILN_PREC_BF16);
    kiln_cpu_linear(y0, x, w, KILN_F32, NULL, M, N, K);
    kiln_cpu_bf16_set_emulation(1);
    kiln_cpu_linear(y1, x, w, KILN_F32, NULL, M, N, K);
    kiln_cpu_bf16_set_emulation(0);
    kiln_precision_set(KILN_PREC_F32);
    int64_t differ = 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            if (y0[i * N + j] == y1[i * N + j]) continue;
            differ++;
            double S = 0;
            for (int64_t k = 0; k < K; k++) S += fabs((double)x[i * K + k] * w[j * K + k]);
            double bound = 2 * gamma_n((double)K) * S * (1 + 2 * U + U * U);
            CHECK(fabs((double)y0[i * N + j] - y1[i * N + j]) <= bound, "native %.9g emulated %.9g, bound %.3g",
                  y0[i * N + j], y1[i * N + j], bound);
        }
    printf("# native vs emulated bf16: %lld of %lld outputs differ in their bits\n", (long long)differ,
           (long long)(M * N));
    free(x); free(w); free(y0); free(y1);
}

/* ---- conv2d ---- */

/* sum over the receptive field of |w x|, and the exact value (double) */
static void conv_exact(const float *x, const float *w, const float *b, const kiln_conv2d_params *p, int64_t n,
                       int64_t k, int64_t oy, int64_t ox, double *val, double *mag)
{
    double s = 0, S = 0;
    for (int64_t c = 0; c < p->c; c++)
        for (int64_t r = 0; r < p->r; r++)
            for (int64_t q = 0; q < p->s; q++) {
                int64_t iy = oy * p->stride_h - p->pad_h + r, ix = ox * p->stride_w - p->pad_w + q;
                if (iy < 0 || iy >= p->h || ix < 0 || ix >= p->w) continue;
                double t = (double)w[((k * p->c + c) * p->r + r) * p->s + q] * x[((n * p->c + c) * p->h + iy) * p->w + ix];
                s += t;
                S += fabs(t);
            }
    *val = s + (b ? b[k] : 0);
    *mag = S;
}

static void t_conv_gemm_bf16(void)
{
    if (!bf16_here()) { SKIP("no AVX-512 on this CPU"); return; }
    static const int64_t shapes[][6] = {/* n c h w k r(=s) */ {1, 16, 12, 13, 24, 3}, {2, 32, 9, 9, 40, 3},
                                        {1, 48, 8, 8, 16, 1}};
    setenv("KILN_CONV_PATH", "gemm", 1);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        kiln_conv2d_params p = {.n = shapes[si][0], .c = shapes[si][1], .h = shapes[si][2], .w = shapes[si][3],
                                .k = shapes[si][4], .r = shapes[si][5], .s = shapes[si][5], .stride_h = 1,
                                .stride_w = 1, .pad_h = shapes[si][5] / 2, .pad_w = shapes[si][5] / 2, .dil_h = 1,
                                .dil_w = 1, .groups = 1};
        kiln_conv2d_out_size(&p);
        float *x = rand_buf((size_t)(p.n * p.c * p.h * p.w), 1.0f);
        float *w = rand_buf((size_t)(p.k * p.c * p.r * p.s), 0.3f), *b = rand_buf((size_t)p.k, 1.0f);
        float *y = malloc((size_t)(p.n * p.k * p.oh * p.ow) * 4);
        kiln_precision_set(KILN_PREC_BF16);
        kiln_status st = kiln_cpu_conv2d(y, x, w, KILN_F32, b, &p);
        kiln_precision_set(KILN_PREC_F32);
        CHECK(st == KILN_OK, "conv2d: %s", kiln_last_error());
        int64_t n_terms = p.c * p.r * p.s + 1;
        double worst = 0;
        for (int64_t n = 0; n < p.n; n++)
            for (int64_t k = 0; k < p.k; k++)
                for (int64_t oy = 0; oy < p.oh; oy++)
                    for (int64_t ox = 0; ox < p.ow; ox++) {
                        double ref, S;
                        conv_exact(x, w, b, &p, n, k, oy, ox, &ref, &S);
                        double got = y[((n * p.k + k) * p.oh + oy) * p.ow + ox];
                        double bound = dot_bound((double)n_terms) * S + U32 * (fabs(ref) + fabs(b[k]));
                        if (fabs(got - ref) / bound > worst) worst = fabs(got - ref) / bound;
                    }
        CHECK(worst <= 1.0, "conv %zu (implicit GEMM): worst error %.3g of the bound", si, worst);
        CHECK(worst > 0.01, "conv %zu: error only %.3g of the bf16 bound (did f32 run?)", si, worst);
        free(x); free(w); free(b); free(y);
    }
    unsetenv("KILN_CONV_PATH");
}

/* Winograd F(4x4, 3x3): the transforms of winograd_transforms.h, in absolute value, at
 * its points 0, +-a, +-b and infinity (a = 3/2, b = 5/8) */
static double AT4[4][6], G4[6][3], BT4[6][6];

static void winograd_abs_init(void)
{
    const double a = 1.5, b = 0.625, a2 = a * a, b2 = b * b;
    const double ga = 1 / fabs(2 * a2 * (a2 - b2)), gb = 1 / fabs(2 * b2 * (b2 - a2));
    const double at[4][6] = {{1, 1, 1, 1, 1, 0}, {0, a, a, b, b, 0}, {0, a2, a2, b2, b2, 0},
                             {0, a2 * a, a2 * a, b2 * b, b2 * b, 1}};
    const double g[6][3] = {{1 / (a2 * b2), 0, 0}, {ga, ga * a, ga * a2}, {ga, ga * a, ga * a2},
                            {gb, gb * b, gb * b2}, {gb, gb * b, gb * b2}, {0, 0, 1}};
    const double bt[6][6] = {{a2 * b2, 0, a2 + b2, 0, 1, 0}, {0, a * b2, b2, a, 1, 0}, {0, a * b2, b2, a, 1, 0},
                             {0, b * a2, a2, b, 1, 0}, {0, b * a2, a2, b, 1, 0}, {0, a2 * b2, 0, a2 + b2, 0, 1}};
    memcpy(AT4, at, sizeof at);
    memcpy(G4, g, sizeof g);
    memcpy(BT4, bt, sizeof bt);
}

static void check_winograd(const char *path, int64_t C, int64_t H, int64_t W, int64_t K)
{
    kiln_conv2d_params p = {.n = 1, .c = C, .h = H, .w = W, .k = K, .r = 3, .s = 3, .stride_h = 1, .stride_w = 1,
                            .pad_h = 1, .pad_w = 1, .dil_h = 1, .dil_w = 1, .groups = 1};
    kiln_conv2d_out_size(&p);
    winograd_abs_init();
    size_t ny = (size_t)(K * p.oh * p.ow);
    float *x = rand_buf((size_t)(C * H * W), 1.0f), *w = rand_buf((size_t)(K * C * 9), 0.3f);
    float *y32 = malloc(ny * 4), *y16 = malloc(ny * 4);
    setenv("KILN_CONV_PATH", path, 1);
    setenv("KILN_WINOGRAD_TILE", "4", 1);
    setenv("KILN_WINOGRAD_FEW_TILE", "4", 1);
    kiln_precision_set(KILN_PREC_F32);
    kiln_status st = kiln_cpu_conv2d(y32, x, w, KILN_F32, NULL, &p);
    kiln_precision_set(KILN_PREC_BF16);
    st |= kiln_cpu_conv2d(y16, x, w, KILN_F32, NULL, &p);
    /* the emulated kernels (no vdpbf16ps) add in the instruction's order: the same bits */
    float *y16e = malloc(ny * 4);
    kiln_cpu_bf16_set_emulation(1);
    st |= kiln_cpu_conv2d(y16e, x, w, KILN_F32, NULL, &p);
    kiln_cpu_bf16_set_emulation(0);
    kiln_precision_set(KILN_PREC_F32);
    unsetenv("KILN_CONV_PATH");
    unsetenv("KILN_WINOGRAD_TILE");
    unsetenv("KILN_WINOGRAD_FEW_TILE");
    CHECK(st == KILN_OK, "conv2d %s: %s", path, kiln_last_error());
    /* |U| per (k, c, point), |V| per (tile, c, point) */
    int64_t ty_n = (p.oh + 3) / 4, tx_n = (p.ow + 3) / 4;
    double *Ua = calloc((size_t)(K * C * 36), sizeof(double)), *Va = calloc((size_t)(ty_n * tx_n * C * 36), sizeof(double));
    for (int64_t k = 0; k < K; k++)
        for (int64_t c = 0; c < C; c++)
            for (int pa = 0; pa < 6; pa++)
                for (int pb = 0; pb < 6; pb++) {
                    double s = 0;
                    for (int a = 0; a < 3; a++)
                        for (int bb = 0; bb < 3; bb++) s += G4[pa][a] * G4[pb][bb] * fabs(w[((k * C + c) * 3 + a) * 3 + bb]);
                    Ua[(k * C + c) * 36 + pa * 6 + pb] = s;
                }
    for (int64_t ty = 0; ty < ty_n; ty++)
        for (int64_t tx = 0; tx < tx_n; tx++)
            for (int64_t c = 0; c < C; c++)
                for (int pa = 0; pa < 6; pa++)
                    for (int pb = 0; pb < 6; pb++) {
                        double s = 0;
                        for (int q = 0; q < 6; q++)
                            for (int r = 0; r < 6; r++) {
                                int64_t iy = ty * 4 - 1 + q, ix = tx * 4 - 1 + r;
                                if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                                s += BT4[pa][q] * BT4[pb][r] * fabs(x[(c * H + iy) * W + ix]);
                            }
                        Va[((ty * tx_n + tx) * C + c) * 36 + pa * 6 + pb] = s;
                    }
    double worst = 0, coef = (2 * U + U * U + gamma_n((double)C)) * (1 + 1.0 / 65536);
    for (int64_t k = 0; k < K; k++)
        for (int64_t ty = 0; ty < ty_n; ty++)
            for (int64_t tx = 0; tx < tx_n; tx++) {
                double Sp[36];
                for (int pt = 0; pt < 36; pt++) {
                    double s = 0;
                    for (int64_t c = 0; c < C; c++) s += Ua[(k * C + c) * 36 + pt] * Va[((ty * tx_n + tx) * C + c) * 36 + pt];
                    Sp[pt] = s;
                }
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 4; j++) {
                        int64_t oy = ty * 4 + i, ox = tx * 4 + j;
                        if (oy >= p.oh || ox >= p.ow) continue;
                        double T = 0;
                        for (int pa = 0; pa < 6; pa++)
                            for (int pb = 0; pb < 6; pb++) T += AT4[i][pa] * AT4[j][pb] * Sp[pa * 6 + pb];
                        double ref, S;
                        conv_exact(x, w, NULL, &p, 0, k, oy, ox, &ref, &S);
                        size_t o = (size_t)((k * p.oh + oy) * p.ow + ox);
                        double f32_err = fabs(y32[o] - ref);
                        double r = (fabs(y16[o] - ref) - f32_err) / (coef * T);
                        if (r > worst) worst = r;
                    }
            }
    CHECK(worst <= 1.0, "winograd (%s) %lldx%lldx%lldx%lld: worst error %.3g of the bound", path, (long long)C,
          (long long)H, (long long)W, (long long)K, worst);
    /* bf16 ran: the bf16 result is off by more than f32's somewhere */
    CHECK(memcmp(y32, y16, ny * 4) != 0, "winograd (%s): bf16 gave the f32 bits", path);
    if (kiln_cpu_has_bf16()) CHECK(memcmp(y16e, y16, ny * 4) == 0, "winograd (%s): emulated bf16 differs from native", path);
    free(x); free(w); free(y32); free(y16); free(y16e); free(Ua); free(Va);
}

static void t_conv_winograd_bf16(void)
{
    if (!bf16_here()) { SKIP("no AVX-512 on this CPU"); return; }
    check_winograd("winograd", 32, 20, 18, 48);
    check_winograd("winograd", 24, 9, 30, 20);
    /* an odd channel count: a partial 16-channel chunk and a last pair with one channel */
    check_winograd("winograd", 19, 12, 17, 40);
    /* many channels, few tiles: output channels in blocks, V rounded once for all */
    check_winograd("winograd", 640, 12, 12, 96);
    /* the few-tiles path (output channels in the lanes), both GEMM tiles (100 = 96 + 4):
     * 25 and 15 tiles, whole 12-row slivers through the 12 x 32 tile and the rest 4 rows
     * at a time through the 4 x 96 one; 4 tiles through the 4 x 96 alone */
    check_winograd("winograd-few", 32, 20, 18, 48);
    check_winograd("winograd-few", 19, 12, 17, 100);
    check_winograd("winograd-few", 150, 8, 8, 40);
    /* 56 tiles: four whole slivers, the remaining 8 rows through the 4 x 96 tile and a
     * last sliver of 4 columns */
    check_winograd("winograd-few", 40, 32, 28, 100);
}

/* ---- attention ---- */

static void t_attention_bf16(void)
{
    if (!bf16_here()) { SKIP("no AVX-512 on this CPU"); return; }
    static const int64_t shapes[][4] = {/* Lq Lk D Dv */ {77, 77, 40, 40}, {50, 200, 64, 64}, {33, 385, 80, 80},
                                        {20, 9, 7, 12},
                                        /* several query blocks: the keys prepared once a head */
                                        {600, 400, 40, 40}, {700, 250, 24, 33}};
    for (int emulate = 0; emulate < 2; emulate++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            int64_t B = 2, Lq = shapes[si][0], Lk = shapes[si][1], D = shapes[si][2], Dv = shapes[si][3];
            float *q = rand_buf((size_t)(B * Lq * D), 1.0f), *k = rand_buf((size_t)(B * Lk * D), 1.0f);
            float *v = rand_buf((size_t)(B * Lk * Dv), 1.0f), *o = malloc((size_t)(B * Lq * Dv) * 4);
            double scale = 1.0 / sqrt((double)D);
            kiln_precision_set(KILN_PREC_BF16);
            kiln_cpu_bf16_set_emulation(emulate);
            kiln_status st = kiln_cpu_attention(o, q, k, v, B, Lq, Lk, D, Dv, (float)scale, 0);
            if (!emulate && kiln_cpu_has_bf16()) { /* the emulated kernels give the instructions' bits */
                float *oe = malloc((size_t)(B * Lq * Dv) * 4);
                kiln_cpu_bf16_set_emulation(1);
                st |= kiln_cpu_attention(oe, q, k, v, B, Lq, Lk, D, Dv, (float)scale, 0);
                CHECK(memcmp(o, oe, (size_t)(B * Lq * Dv) * 4) == 0, "attention %lld/%lld/%lld: emulated bf16 differs from native",
                      (long long)Lq, (long long)Lk, (long long)D);
                free(oe);
            }
            kiln_cpu_bf16_set_emulation(0);
            kiln_precision_set(KILN_PREC_F32);
            CHECK(st == KILN_OK, "attention: %s", kiln_last_error());
            double *s = malloc((size_t)Lk * sizeof *s), *pw = malloc((size_t)Lk * sizeof *pw);
            double worst = 0;
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < Lq; i++) {
                    const float *qi = q + (b * Lq + i) * D;
                    double mx = -INFINITY, ds = 0, l = 0;
                    for (int64_t j = 0; j < Lk; j++) {
                        const float *kj = k + (b * Lk + j) * D;
                        double t = 0, S = 0;
                        for (int64_t d = 0; d < D; d++) {
                            t += (double)qi[d] * kj[d];
                            S += fabs((double)qi[d] * kj[d]);
                        }
                        s[j] = t * scale;
                        double e = dot_bound((double)D) * S * scale;
                        if (e > ds) ds = e;
                        if (s[j] > mx) mx = s[j];
                    }
                    for (int64_t j = 0; j < Lk; j++) l += pw[j] = exp(s[j] - mx);
                    double coef = expm1(2 * ds) + 2 * U + U * U + gamma_n((double)Lk) + 1.0 / 1048576;
                    for (int64_t c = 0; c < Dv; c++) {
                        double ref = 0, mag = 0;
                        for (int64_t j = 0; j < Lk; j++) {
                            double vj = v[(b * Lk + j) * Dv + c];
                            ref += pw[j] / l * vj;
                            mag += pw[j] / l * fabs(vj);
                        }
                        double r = fabs(o[(b * Lq + i) * Dv + c] - ref) / (coef * mag);
                        if (r > worst) worst = r;
                    }
                }
            CHECK(worst <= 1.0, "attention %lld/%lld/%lld%s: worst error %.3g of the bound", (long long)Lq,
                  (long long)Lk, (long long)D, emulate ? " emulated" : "", worst);
            CHECK(worst > 0.001, "attention %lld/%lld/%lld: error only %.3g of the bf16 bound (did f32 run?)",
                  (long long)Lq, (long long)Lk, (long long)D, worst);
            free(q); free(k); free(v); free(o); free(s); free(pw);
        }
}

int main(void)
{
    RUN(t_precision_names);
    RUN(t_precision_defaults);
    RUN(t_linear_bf16);
    RUN(t_linear_bf16_emulated);
    RUN(t_gemm_bf16);
    RUN(t_linear_f32_unchanged);
    RUN(t_native_vs_emulated);
    RUN(t_conv_gemm_bf16);
    RUN(t_conv_winograd_bf16);
    RUN(t_attention_bf16);
    return test_summary();
}

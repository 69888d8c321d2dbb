/* test_cpu_gemm_conv.c - gemm, batched gemm, linear and conv2d (kernels/cpu/gemm.c,
 * conv2d.c, conv2d_winograd.c, conv2d_winograd_few.c) against torch 1.13 goldens (tests/golden/gen_gemm_conv.py
 * -> tests/golden/ops/{gemm,conv}_cases.safetensors) and against naive double references.
 * Every conv golden runs through each path (KILN_CONV_PATH = auto, gemm, winograd,
 * winograd-few, im2col, direct - depthwise or few outputs - where it applies); a child process reruns the program with
 * KILN_CPU_ISA=generic, which takes the OpenBLAS fallback everywhere.
 * Tolerances, as max |got - expected| / max |expected| (the goldens are float64 results
 * of the same f16-rounded inputs, so this is our error alone):
 *   gemm, linear (f32/f16/bf16 weights: exact in f32, same bound)  2e-6 x sqrt(K) + 1e-6
 *   conv2d through GEMM, im2col, direct                             1e-5
 *   conv2d through Winograd F(4x4, 3x3)                              1e-4
 * Outputs carry guard floats on both sides that must stay untouched. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"

#include "cpu_internal.h"
#include "device.h"
#include "safetensors.h"
#include "threadpool.h"

#include <pthread.h>
#include <stdint.h>

/* defined in kernels/cpu/gemm.c; proposed for cpu_kernels.h (memory-pressure hook) */
void kiln_cpu_scratch_trim(void);

#define GOLDEN "tests/golden/ops/"
#define GUARD 16
static const float CANARY = -12345.678f;

static int child_mode; /* running as the KILN_CPU_ISA=generic child */

/* ---- helpers ---- */

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static float frand(void)
{
    rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
    return (float)((rs >> 40) * (2.0 / 16777216.0)) - 1.0f;
}
static int irand(int n) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return (int)((rs >> 33) % (uint64_t)n); }

static float *rand_buf(int64_t n)
{
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    if (p) for (int64_t i = 0; i < n; i++) p[i] = frand();
    return p;
}

/* An output buffer of n floats with GUARD canaries on each side; returns the inside. */
static float *guarded(int64_t n)
{
    float *p = malloc((size_t)(n + 2 * GUARD) * sizeof *p);
    if (!p) return NULL;
    for (int64_t i = 0; i < n + 2 * GUARD; i++) p[i] = CANARY;
    return p + GUARD;
}
static int guards_ok(const float *y, int64_t n)
{
    for (int i = 0; i < GUARD; i++)
        if (y[-1 - i] != CANARY || y[n + i] != CANARY) return 0;
    return 1;
}
static void guarded_free(float *y) { if (y) free(y - GUARD); }

/* max |got - ref| / max |ref| (nan anywhere: infinity) */
static double rel_err(const float *got, const double *ref, int64_t n)
{
    double e = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (!(d <= e)) e = d; /* catches nan */
        if (fabs(ref[i]) > m) m = fabs(ref[i]);
    }
    return m > 0 ? e / m : e;
}

static kiln_st_file *open_golden(const char *name)
{
    char path[256];
    snprintf(path, sizeof path, GOLDEN "%s", name);
    kiln_st_file *f = NULL;
    kiln_status st = kiln_st_open(path, &f);
    CHECK(st == KILN_OK, "open %s: %s", path, kiln_last_error());
    return st == KILN_OK ? f : NULL;
}

static const kiln_st_entry *entry(const kiln_st_file *f, const char *c, const char *t, int *idx)
{
    char name[128];
    snprintf(name, sizeof name, "%.60s.%.20s", c, t);
    int i = kiln_st_find(f, name);
    if (idx) *idx = i;
    return i >= 0 ? &f->entries[i] : NULL;
}

static int64_t numel(const kiln_st_entry *e)
{
    int64_t n = 1;
    for (int d = 0; d < e->ndim; d++) n *= e->shape[d];
    return n;
}

/* "<c>.<t>" widened to a malloc'ed f32 array, or NULL when absent */
static float *get_f32(const kiln_st_file *f, const char *c, const char *t, int64_t *n_out)
{
    int i;
    const kiln_st_entry *e = entry(f, c, t, &i);
    if (!e) return NULL;
    int64_t n = numel(e);
    float *p = malloc((size_t)(n ? n : 1) * sizeof *p);
    if (p) kiln_to_f32(p, kiln_st_data(f, i), e->dtype, (size_t)n);
    if (n_out) *n_out = n;
    return p;
}

static double *get_f64(const kiln_st_file *f, const char *c, const char *t, int64_t *n_out)
{
    int64_t n = 0;
    float *p = get_f32(f, c, t, &n);
    if (!p) return NULL;
    double *d = malloc((size_t)(n ? n : 1) * sizeof *d);
    if (d) for (int64_t i = 0; i < n; i++) d[i] = p[i];
    free(p);
    if (n_out) *n_out = n;
    return d;
}

static int get_i64(const kiln_st_file *f, const char *c, const char *t, int64_t *out, int n)
{
    int i;
    const kiln_st_entry *e = entry(f, c, t, &i);
    if (!e || e->dtype != KILN_I64 || numel(e) != n) return 0;
    memcpy(out, kiln_st_data(f, i), (size_t)n * sizeof *out);
    return 1;
}

/* Case names listed in the U8 tensor "cases.<kind>" (comma separated). */
static int case_names(const kiln_st_file *f, const char *kind, char names[][32], int max)
{
    char key[64];
    snprintf(key, sizeof key, "cases.%s", kind);
    int i = kiln_st_find(f, key);
    if (i < 0) return 0;
    const char *s = kiln_st_data(f, i);
    int64_t len = numel(&f->entries[i]);
    int n = 0, at = 0;
    for (int64_t j = 0; j <= len && n < max; j++) {
        if (j == len || s[j] == ',') {
            names[n][at < 31 ? at : 31] = 0;
            n++;
            at = 0;
        } else if (at < 31) {
            names[n][at++] = s[j];
        }
    }
    return n;
}

/* ---- naive references ---- */

static void ref_gemm(double *C, int ta, int tb, int64_t M, int64_t N, int64_t K, double alpha, const float *A,
                     int64_t lda, const float *B, int64_t ldb, double beta, const float *C0, int64_t ldc)
{
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++)
                s += (double)(ta ? A[k * lda + i] : A[i * lda + k]) * (double)(tb ? B[j * ldb + k] : B[k * ldb + j]);
            C[i * N + j] = alpha * s + (beta != 0 ? beta * C0[i * ldc + j] : 0);
        }
}

static void ref_conv(double *y, const float *x, const float *w, const float *b, const kiln_conv2d_params *p)
{
    int64_t cg = p->c / p->groups, kg = p->k / p->groups;
    for (int64_t n = 0; n < p->n; n++)
        for (int64_t k = 0; k < p->k; k++) {
            int64_t g = k / kg;
            for (int64_t oy = 0; oy < p->oh; oy++)
                for (int64_t ox = 0; ox < p->ow; ox++) {
                    double s = b ? b[k] : 0;
                    for (int64_t c = 0; c < cg; c++)
                        for (int64_t r = 0; r < p->r; r++)
                            for (int64_t q = 0; q < p->s; q++) {
                                int64_t iy = oy * p->stride_h - p->pad_h + r * p->dil_h;
                                int64_t ix = ox * p->stride_w - p->pad_w + q * p->dil_w;
                                if (iy < 0 || iy >= p->h || ix < 0 || ix >= p->w) continue;
                                s += (double)x[((n * p->c + g * cg + c) * p->h + iy) * p->w + ix] *
                                     w[((k * cg + c) * p->r + r) * p->s + q];
                            }
                    y[((n * p->k + k) * p->oh + oy) * p->ow + ox] = s;
                }
        }
}

static double gemm_tol(int64_t K) { return 2e-6 * sqrt((double)(K > 0 ? K : 1)) + 1e-6; }

/* ---- gemm / linear goldens ---- */

static void t_gemm_golden(void)
{
    kiln_st_file *f = open_golden("gemm_cases.safetensors");
    if (!f) return;
    char names[32][32];
    int nc = case_names(f, "gemm", names, 32);
    CHECK(nc >= 8, "only %d gemm cases", nc);
    for (int ci = 0; ci < nc; ci++) {
        const char *c = names[ci];
        int64_t p[8];
        float *ab = get_f32(f, c, "ab", NULL), *A = get_f32(f, c, "x", NULL), *B = get_f32(f, c, "w", NULL);
        float *C0 = get_f32(f, c, "c0", NULL);
        int64_t ny = 0;
        double *y = get_f64(f, c, "y", &ny);
        if (!get_i64(f, c, "p", p, 8) || !ab || !A || !B || !y) {
            CHECK(0, "%s: golden tensors missing", c);
        } else {
            int64_t M = p[0], N = p[1], K = p[2], batch = p[5];
            int ta = (int)p[3], tb = (int)p[4];
            float *C = guarded(ny);
            if (C0) memcpy(C, C0, (size_t)ny * sizeof *C);
            int64_t lda = ta ? M : K, ldb = tb ? K : N;
            if (batch == 1)
                kiln_cpu_gemm_f32(ta, tb, M, N, K, ab[0], A, lda, B, ldb, ab[1], C, N);
            else
                kiln_cpu_gemm_batched_f32(ta, tb, batch, M, N, K, ab[0], A, lda, p[6], B, ldb, p[7], ab[1], C, N,
                                          M * N);
            double e = rel_err(C, y, ny);
            CHECK(e <= gemm_tol(K), "%s (%lldx%lldx%lld ta%d tb%d batch %lld): rel err %.3g", c, (long long)M,
                  (long long)N, (long long)K, ta, tb, (long long)batch, e);
            CHECK(guards_ok(C, ny), "%s: wrote outside C", c);
            guarded_free(C);
        }
        free(ab); free(A); free(B); free(C0); free(y);
    }
    kiln_st_release(f);
}

static void t_linear_golden(void)
{
    kiln_st_file *f = open_golden("gemm_cases.safetensors");
    if (!f) return;
    char names[32][32];
    int nc = case_names(f, "linear", names, 32);
    CHECK(nc >= 6, "only %d linear cases", nc);
    static const kiln_dtype dts[3] = {KILN_F32, KILN_F16, KILN_BF16};
    for (int ci = 0; ci < nc; ci++) {
        const char *c = names[ci];
        int64_t p[4], dt = 0, ny = 0;
        int wi;
        const kiln_st_entry *we = entry(f, c, "w", &wi);
        float *x = get_f32(f, c, "x", NULL), *wf = get_f32(f, c, "w", NULL), *b = get_f32(f, c, "b", NULL);
        double *y = get_f64(f, c, "y", &ny);
        if (!get_i64(f, c, "p", p, 4) || !get_i64(f, c, "dt", &dt, 1) || !we || !x || !wf || !y) {
            CHECK(0, "%s: golden tensors missing", c);
        } else {
            kiln_dtype wdt = dts[dt];
            /* the kernel gets f32 weights widened here, or the stored f16/bf16 bits as they are */
            const void *w = wdt == KILN_F32 ? (const void *)wf : kiln_st_data(f, wi);
            CHECK(wdt == KILN_F32 || we->dtype == wdt, "%s: stored weight dtype", c);
            float *out = guarded(ny);
            kiln_status st = kiln_cpu_linear(out, x, w, wdt, p[3] ? b : NULL, p[0], p[1], p[2]);
            CHECK(st == KILN_OK, "%s: %s", c, kiln_last_error());
            double e = rel_err(out, y, ny);
            CHECK(e <= gemm_tol(p[2]), "%s (%lldx%lldx%lld %s%s): rel err %.3g", c, (long long)p[0], (long long)p[1],
                  (long long)p[2], kiln_dtype_name(wdt), p[3] ? " bias" : "", e);
            CHECK(guards_ok(out, ny), "%s: wrote outside y", c);
            guarded_free(out);
        }
        free(x); free(wf); free(b); free(y);
    }
    kiln_st_release(f);
}

/* ---- gemm against the naive reference ---- */

static void t_gemm_shapes(void)
{
    static const int64_t sizes[] = {1, 5, 12, 13, 31, 32, 33, 100, 385};
    int n_sizes = (int)(sizeof sizes / sizeof *sizes);
    /* fixed cases first: few rows (the 4 x 96 kernel, twice for 5 to 8 rows), then random ones */
    static const int64_t fixed[][5] = {{3, 200, 50, 0, 0}, {4, 97, 400, 0, 1}, {1, 500, 33, 1, 1}, {2, 96, 7, 1, 0},
                                       {7, 200, 50, 0, 0}, {8, 300, 129, 1, 1}, {5, 96, 400, 0, 1}};
    int n_fixed = (int)(sizeof fixed / sizeof *fixed);
    for (int it = 0; it < 64; it++) {
        int64_t M = sizes[irand(n_sizes)], N = sizes[irand(n_sizes)], K = sizes[irand(n_sizes)];
        if (M * N * K > 2000000) K = 7;
        int ta = irand(2), tb = irand(2), pad = irand(3);
        if (it < n_fixed) {
            M = fixed[it][0]; N = fixed[it][1]; K = fixed[it][2]; ta = (int)fixed[it][3]; tb = (int)fixed[it][4];
        }
        float alpha = it % 5 == 0 ? 0.5f : 1.0f, beta = it % 3 == 0 ? 0.0f : it % 3 == 1 ? 1.0f : -0.75f;
        int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
        float *A = rand_buf((ta ? K : M) * lda), *B = rand_buf((tb ? N : K) * ldb), *C0 = rand_buf(M * ldc);
        float *C = guarded(M * ldc);
        double *R = malloc((size_t)(M * N) * sizeof *R);
        if (!A || !B || !C0 || !C || !R) { CHECK(0, "out of memory"); return; }
        memcpy(C, C0, (size_t)(M * ldc) * sizeof *C);
        /* beta == 0: C is not read, even when it holds nan */
        if (beta == 0.0f) for (int64_t i = 0; i < M * ldc; i++) C[i] = NAN;
        kiln_cpu_gemm_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        ref_gemm(R, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C0, ldc);
        double e = 0, m = 0;
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double d = fabs(C[i * ldc + j] - R[i * N + j]);
                if (!(d <= e)) e = d;
                if (fabs(R[i * N + j]) > m) m = fabs(R[i * N + j]);
            }
        int pad_ok = 1; /* columns past N of each row of C keep their value */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = N; j < ldc; j++)
                if (memcmp(&C[i * ldc + j], beta == 0.0f ? &(float){NAN} : &C0[i * ldc + j], sizeof(float)) &&
                    !(beta == 0.0f && isnan(C[i * ldc + j])))
                    pad_ok = 0;
        CHECK(e <= gemm_tol(K) * (m > 1 ? m : 1), "%lldx%lldx%lld ta%d tb%d ld+%d alpha %g beta %g: err %.3g (max %.3g)",
              (long long)M, (long long)N, (long long)K, ta, tb, pad, alpha, beta, e, m);
        CHECK(pad_ok && guards_ok(C, M * ldc), "%lldx%lldx%lld: wrote outside the C block", (long long)M, (long long)N,
              (long long)K);
        free(A); free(B); free(C0); guarded_free(C); free(R);
    }
    /* K = 0 and alpha = 0: C = beta * C */
    float C[6] = {1, 2, 3, 4, 5, 6}, A[1] = {7}, B[1] = {8};
    kiln_cpu_gemm_f32(0, 0, 2, 3, 0, 1.0f, A, 1, B, 3, 2.0f, C, 3);
    CHECK(C[0] == 2 && C[5] == 12, "K = 0: C = %g .. %g, expected 2 .. 12", C[0], C[5]);
    kiln_cpu_gemm_f32(0, 0, 2, 3, 1, 0.0f, A, 1, B, 3, 0.0f, C, 3);
    CHECK(C[0] == 0 && C[5] == 0, "alpha = beta = 0: C not zeroed");
    kiln_cpu_gemm_f32(0, 0, 0, 3, 1, 1.0f, A, 1, B, 3, 0.0f, C, 3); /* M = 0: nothing */
}

static void t_gemm_batched(void)
{
    /* many small products (one per thread), few large ones (split), broadcast B */
    static const int64_t cfg[][4] = {{16, 20, 24, 40}, {3, 200, 150, 96}, {5, 1, 1, 1}, {40, 77, 40, 40}};
    for (int ci = 0; ci < 4; ci++) {
        int64_t batch = cfg[ci][0], M = cfg[ci][1], N = cfg[ci][2], K = cfg[ci][3];
        for (int bc = 0; bc < 2; bc++) {
            float *A = rand_buf(batch * M * K), *B = rand_buf((bc ? 1 : batch) * K * N), *C = guarded(batch * M * N);
            double *R = malloc((size_t)(batch * M * N) * sizeof *R);
            if (!A || !B || !C || !R) { CHECK(0, "out of memory"); return; }
            kiln_cpu_gemm_batched_f32(0, 1, batch, M, N, K, 1.0f, A, K, M * K, B, K, bc ? 0 : N * K, 0.0f, C, N, M * N);
            for (int64_t b = 0; b < batch; b++)
                ref_gemm(R + b * M * N, 0, 1, M, N, K, 1.0, A + b * M * K, K, B + (bc ? 0 : b * N * K), K, 0, NULL, N);
            double e = rel_err(C, R, batch * M * N);
            CHECK(e <= gemm_tol(K), "batch %lld %lldx%lldx%lld%s: rel err %.3g", (long long)batch, (long long)M,
                  (long long)N, (long long)K, bc ? " broadcast B" : "", e);
            CHECK(guards_ok(C, batch * M * N), "batched: wrote outside C");
            free(A); free(B); guarded_free(C); free(R);
        }
    }
}

/* f16/bf16 weights over several packing panels (N > 512, K > 384), tiny M */
static void t_linear_panels(void)
{
    const int64_t M = 5, N = 600, K = 400;
    float *x = rand_buf(M * K), *wf = rand_buf(N * K), *b = rand_buf(N), *y = guarded(M * N);
    uint16_t *wh = malloc((size_t)(N * K) * sizeof *wh);
    double *R = malloc((size_t)(M * N) * sizeof *R);
    if (!x || !wf || !b || !y || !wh || !R) { CHECK(0, "out of memory"); return; }
    for (int d = 0; d < 2; d++) {
        kiln_dtype dt = d ? KILN_BF16 : KILN_F16;
        for (int64_t i = 0; i < N * K; i++) {
            wh[i] = dt == KILN_F16 ? kiln_f32_to_f16(wf[i]) : kiln_f32_to_bf16(wf[i]);
            wf[i] = dt == KILN_F16 ? kiln_f16_to_f32(wh[i]) : kiln_bf16_to_f32(wh[i]);
        }
        ref_gemm(R, 0, 1, M, N, K, 1.0, x, K, wf, K, 0, NULL, N);
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) R[i * N + j] += b[j];
        CHECK(kiln_cpu_linear(y, x, wh, dt, b, M, N, K) == KILN_OK, "linear %s: %s", kiln_dtype_name(dt),
              kiln_last_error());
        double e = rel_err(y, R, M * N);
        CHECK(e <= gemm_tol(K), "linear %s %lldx%lldx%lld: rel err %.3g", kiln_dtype_name(dt), (long long)M,
              (long long)N, (long long)K, e);
        CHECK(guards_ok(y, M * N), "linear: wrote outside y");
    }
    CHECK(kiln_cpu_linear(y, x, wh, KILN_I32, NULL, M, N, K) == KILN_ERR_UNSUPPORTED, "i32 weights accepted");
    CHECK(kiln_cpu_linear(y, x, wh, KILN_F16, NULL, -1, N, K) == KILN_ERR_ARG, "negative M accepted");
    free(x); free(wf); free(b); guarded_free(y); free(wh); free(R);
}

/* A gemm called from inside a pool job runs serially on that thread; the result has
 * the same bits as the one split over the pool (each C element is one thread's dot
 * product in the same order). */
typedef struct { const float *A, *B; float *C; int64_t M, N, K; } nested_ctx;
static void nested_fn(void *vctx, int64_t begin, int64_t end)
{
    nested_ctx *c = vctx;
    for (int64_t i = begin; i < end; i++)
        kiln_cpu_gemm_f32(0, 0, c->M, c->N, c->K, 1.0f, c->A, c->K, c->B, c->N, 0.0f, c->C + i * c->M * c->N, c->N);
}

static void t_gemm_nested(void)
{
    const int64_t M = 150, N = 130, K = 170;
    float *A = rand_buf(M * K), *B = rand_buf(K * N), *C = rand_buf(M * N), *C4 = rand_buf(4 * M * N);
    if (!A || !B || !C || !C4) { CHECK(0, "out of memory"); return; }
    kiln_cpu_gemm_f32(0, 0, M, N, K, 1.0f, A, K, B, N, 0.0f, C, N);
    nested_ctx c = {A, B, C4, M, N, K};
    kiln_parallel_for(4, 1, nested_fn, &c);
    int same = 1;
    for (int i = 0; i < 4; i++) same &= !memcmp(C4 + i * M * N, C, (size_t)(M * N) * sizeof *C);
    CHECK(same, "gemm inside a pool job differs from the pooled one");
    free(A); free(B); free(C); free(C4);
}

/* ---- conv2d ---- */

static const char *const PATHS[] = {"auto", "gemm", "winograd", "winograd-few", "im2col", "direct"};
enum { N_PATHS = sizeof PATHS / sizeof PATHS[0] };

static void set_path(const char *path)
{
    if (!strcmp(path, "auto")) unsetenv("KILN_CONV_PATH");
    else setenv("KILN_CONV_PATH", path, 1);
}

/* whether a forced path really runs this case (else it falls back to another) */
static int path_applies(const char *path, const kiln_conv2d_params *p)
{
    if (!strcmp(path, "winograd-few")) { /* at most 64 tiles of 4 x 4 over the batch */
        int64_t tiles = p->n * ((p->oh + 3) / 4) * ((p->ow + 3) / 4);
        return p->r == 3 && p->s == 3 && p->stride_h == 1 && p->stride_w == 1 && p->dil_h == 1 && p->dil_w == 1 &&
               p->groups == 1 && p->pad_h <= 2 && p->pad_w <= 2 && tiles <= 64;
    }
    if (!strcmp(path, "winograd"))
        return p->r == 3 && p->s == 3 && p->stride_h == 1 && p->stride_w == 1 && p->dil_h == 1 && p->dil_w == 1 &&
               p->groups == 1 && p->pad_h <= 4 && p->pad_w <= 4;
    if (!strcmp(path, "direct")) /* depthwise, or <= 4 outputs per group with stride_w 1 (AVX-512) */
        return p->c == p->groups || (p->k / p->groups <= 4 && p->stride_w == 1);
    return 1;
}

static double conv_tol(const char *path, const kiln_conv2d_params *p)
{
    int wino = !strncmp(path, "winograd", 8) && path_applies(path, p);
    return wino ? 1e-4 : 1e-5;
}

static void conv_golden(const char *path)
{
    kiln_st_file *f = open_golden("conv_cases.safetensors");
    if (!f) return;
    char names[64][32];
    int nc = case_names(f, "conv", names, 64);
    CHECK(nc >= 20, "only %d conv cases", nc);
    static const kiln_dtype dts[3] = {KILN_F32, KILN_F16, KILN_BF16};
    set_path(path);
    int ran = 0;
    for (int ci = 0; ci < nc; ci++) {
        const char *c = names[ci];
        int64_t v[14], dt = 0, ny = 0;
        int wi;
        const kiln_st_entry *we = entry(f, c, "w", &wi);
        float *x = get_f32(f, c, "x", NULL), *wf = get_f32(f, c, "w", NULL), *b = get_f32(f, c, "b", NULL);
        double *y = get_f64(f, c, "y", &ny);
        if (!get_i64(f, c, "p", v, 14) || !get_i64(f, c, "dt", &dt, 1) || !we || !x || !wf || !y) {
            CHECK(0, "%s: golden tensors missing", c);
        } else {
            kiln_conv2d_params p = {v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12],
                                    v[13], 0, 0, 0, 0.0f, NULL, NULL};
            kiln_status st = kiln_conv2d_out_size(&p);
            CHECK(st == KILN_OK && p.n * p.k * p.oh * p.ow == ny, "%s: out size %s", c, kiln_last_error());
            if (st == KILN_OK && p.n * p.k * p.oh * p.ow == ny && (path_applies(path, &p) || !strcmp(path, "auto"))) {
                kiln_dtype wdt = dts[dt];
                const void *w = wdt == KILN_F32 ? (const void *)wf : kiln_st_data(f, wi);
                float *out = guarded(ny);
                st = kiln_cpu_conv2d(out, x, w, wdt, b, &p);
                CHECK(st == KILN_OK, "%s: %s", c, kiln_last_error());
                double e = rel_err(out, y, ny);
                CHECK(e <= conv_tol(path, &p), "%s (%s, %s weights): rel err %.3g (tol %g)", c, path,
                      kiln_dtype_name(wdt), e, conv_tol(path, &p));
                CHECK(guards_ok(out, ny), "%s (%s): wrote outside y", c, path);
                guarded_free(out);
                ran++;
            }
        }
        free(x); free(wf); free(b); free(y);
    }
    set_path("auto");
    CHECK(ran > 0, "no case ran through %s", path);
    kiln_st_release(f);
}

static void t_conv_golden_auto(void) { conv_golden("auto"); }
static void t_conv_golden_gemm(void) { conv_golden("gemm"); }
static void t_conv_golden_winograd(void)
{
    for (int tile = 4; tile <= 6; tile += 2) { /* F(4,3) and F(6,3) */
        setenv("KILN_WINOGRAD_TILE", tile == 4 ? "4" : "6", 1);
        conv_golden("winograd");
    }
    unsetenv("KILN_WINOGRAD_TILE");
}
static void t_conv_golden_winograd_few(void) { conv_golden("winograd-few"); }
static void t_conv_golden_im2col(void) { conv_golden("im2col"); }
static void t_conv_golden_direct(void) { conv_golden("direct"); }

/* random parameter sets through every path against the naive reference */
static void t_conv_random(void)
{
    for (int it = 0; it < 40; it++) {
        kiln_conv2d_params p = {0};
        p.groups = it % 7 == 0 ? 1 + irand(3) : 1;
        p.n = 1 + irand(2);
        p.c = p.groups * (1 + irand(it % 4 == 0 ? 40 : 9));
        p.k = p.groups * (1 + irand(it % 4 == 0 ? 40 : 9));
        if (it % 9 == 0) p.groups = p.c = p.k = 1 + irand(12);          /* depthwise */
        p.r = it % 3 == 0 ? 3 : 1 + irand(4);
        p.s = it % 3 == 0 ? 3 : 1 + irand(4);
        p.h = 1 + irand(20);
        p.w = 1 + irand(20);
        p.stride_h = it % 2 ? 1 : 1 + irand(2);
        p.stride_w = it % 2 ? 1 : 1 + irand(3);
        p.dil_h = it % 5 == 0 ? 2 : 1;
        p.dil_w = it % 5 == 0 ? 1 + irand(2) : 1;
        p.pad_h = irand(3);
        p.pad_w = irand(3);
        if (kiln_conv2d_out_size(&p) != KILN_OK) continue; /* empty output: the errors test covers it */
        int64_t nx = p.n * p.c * p.h * p.w, nw = p.k * (p.c / p.groups) * p.r * p.s, ny = p.n * p.k * p.oh * p.ow;
        float *x = rand_buf(nx), *w = rand_buf(nw), *b = it % 2 ? rand_buf(p.k) : NULL;
        double *R = malloc((size_t)ny * sizeof *R);
        float *y = guarded(ny);
        if (!x || !w || !R || !y) { CHECK(0, "out of memory"); return; }
        ref_conv(R, x, w, b, &p);
        for (int pi = 0; pi < N_PATHS; pi++) {
            if (pi > 0 && !path_applies(PATHS[pi], &p)) continue;
            set_path(PATHS[pi]);
            kiln_status st = kiln_cpu_conv2d(y, x, w, KILN_F32, b, &p);
            double e = rel_err(y, R, ny);
            CHECK(st == KILN_OK && e <= conv_tol(PATHS[pi], &p) && guards_ok(y, ny),
                  "%s: n%lld c%lld %lldx%lld k%lld %lldx%lld s%lld,%lld p%lld,%lld d%lld,%lld g%lld: st %d err %.3g",
                  PATHS[pi], (long long)p.n, (long long)p.c, (long long)p.h, (long long)p.w, (long long)p.k,
                  (long long)p.r, (long long)p.s, (long long)p.stride_h, (long long)p.stride_w, (long long)p.pad_h,
                  (long long)p.pad_w, (long long)p.dil_h, (long long)p.dil_w, (long long)p.groups, st, e);
        }
        set_path("auto");
        free(x); free(w); free(b); free(R); guarded_free(y);
    }
}

/* Winograd with several output-channel blocks and tile strips (both loop orders),
 * F(4,3) and F(6,3), checked against the GEMM path on the same data. */
static void t_conv_winograd_blocks(void)
{
    if (child_mode) { SKIP("covered by the parent"); return; }
    static const int64_t cfg[][4] = {{448, 448, 36, 36}, {1024, 192, 48, 48}};
    for (int ci = 0; ci < 2; ci++) {
        kiln_conv2d_params p = {1, cfg[ci][0], cfg[ci][2], cfg[ci][3], cfg[ci][1], 3, 3, 1, 1, 1, 1, 1, 1, 1,
                                0, 0, 0, 0.0f, NULL, NULL};
        kiln_conv2d_out_size(&p);
        int64_t nx = p.c * p.h * p.w, nw = p.k * p.c * 9, ny = p.k * p.oh * p.ow;
        float *x = rand_buf(nx), *w = rand_buf(nw), *b = rand_buf(p.k), *y1 = guarded(ny), *y2 = guarded(ny);
        double *R = malloc((size_t)ny * sizeof *R);
        if (!x || !w || !b || !y1 || !y2 || !R) { CHECK(0, "out of memory"); return; }
        set_path("gemm");
        CHECK(kiln_cpu_conv2d(y1, x, w, KILN_F32, b, &p) == KILN_OK, "gemm: %s", kiln_last_error());
        for (int64_t i = 0; i < ny; i++) R[i] = y1[i];
        for (int tile = 4; tile <= 6; tile += 2) {
            set_path("winograd");
            setenv("KILN_WINOGRAD_TILE", tile == 4 ? "4" : "6", 1);
            CHECK(kiln_cpu_conv2d(y2, x, w, KILN_F32, b, &p) == KILN_OK, "winograd: %s", kiln_last_error());
            unsetenv("KILN_WINOGRAD_TILE");
            set_path("auto");
            double e = rel_err(y2, R, ny);
            CHECK(e <= 1e-4, "c%lld k%lld %lldx%lld F(%d,3): winograd vs gemm rel err %.3g", (long long)p.c,
                  (long long)p.k, (long long)p.h, (long long)p.w, tile, e);
        }
        CHECK(guards_ok(y1, ny) && guards_ok(y2, ny), "wrote outside y");
        free(x); free(w); free(b); guarded_free(y1); guarded_free(y2); free(R);
    }
}

/* A 3x3 convolution (q: n, c, h, w, k, pad) per weight dtype through `path` with the
 * environment variable `knob` set to each of `vals` in turn, against the GEMM path on
 * the same data; every output written (NaN-filled first), nothing outside y. */
static void winograd_vs_gemm(const int64_t *q, int with_bias, const char *path, const char *knob,
                             const char *const *vals, int nvals)
{
    static const kiln_dtype dts[3] = {KILN_F32, KILN_F16, KILN_BF16};
    kiln_conv2d_params p = {q[0], q[1], q[2], q[3], q[4], 3, 3, 1, 1, q[5], q[5], 1, 1, 1, 0, 0, 0, 0.0f, NULL, NULL};
    kiln_conv2d_out_size(&p);
    int64_t nx = p.n * p.c * p.h * p.w, nw = p.k * p.c * 9, ny = p.n * p.k * p.oh * p.ow;
    float *x = rand_buf(nx), *w = rand_buf(nw), *b = with_bias ? rand_buf(p.k) : NULL;
    float *y1 = guarded(ny), *y2 = guarded(ny);
    uint16_t *wh = malloc((size_t)nw * sizeof *wh);
    double *R = malloc((size_t)ny * sizeof *R);
    if (!x || !w || (!b && with_bias) || !y1 || !y2 || !wh || !R) { CHECK(0, "out of memory"); return; }
    for (int d = 0; d < 3; d++) {
        const void *wp = w;
        if (dts[d] != KILN_F32) {
            for (int64_t i = 0; i < nw; i++) wh[i] = dts[d] == KILN_F16 ? kiln_f32_to_f16(w[i]) : kiln_f32_to_bf16(w[i]);
            wp = wh;
        }
        set_path("gemm");
        CHECK(kiln_cpu_conv2d(y1, x, wp, dts[d], b, &p) == KILN_OK, "gemm: %s", kiln_last_error());
        for (int64_t i = 0; i < ny; i++) R[i] = y1[i];
        for (int v = 0; v < nvals; v++) {
            set_path(path);
            setenv(knob, vals[v], 1);
            for (int64_t i = 0; i < ny; i++) y2[i] = NAN;
            CHECK(kiln_cpu_conv2d(y2, x, wp, dts[d], b, &p) == KILN_OK, "%s: %s", path, kiln_last_error());
            unsetenv(knob);
            set_path("auto");
            double e = rel_err(y2, R, ny);
            CHECK(e <= 1e-4, "n%lld c%lld %lldx%lld k%lld pad %lld %s, %s=%s: %s vs gemm rel err %.3g", (long long)p.n,
                  (long long)p.c, (long long)p.h, (long long)p.w, (long long)p.k, (long long)p.pad_h,
                  kiln_dtype_name(dts[d]), knob, vals[v], path, e);
            CHECK(guards_ok(y2, ny), "%s wrote outside y", path);
        }
        CHECK(guards_ok(y1, ny), "gemm wrote outside y");
    }
    free(x); free(w); free(b); free(wh); guarded_free(y1); guarded_free(y2); free(R);
}

/* Winograd with tiles in the lanes (conv2d_winograd.c), F(4,3) and F(6,3): tile rows that
 * end inside a 16-tile block (the gather patch), images whose sides 4 and 6 do not
 * divide, pads 0 to 4, batches, channel counts off the 12-row slivers and the 48-channel
 * blocks, several strips. */
static void t_conv_winograd_tiles(void)
{
    if (child_mode) { SKIP("covered by the parent"); return; }
    static const int64_t cfg[][6] = { /* n, c, h, w, k, pad */
        {1, 40, 37, 23, 50, 1}, {2, 33, 20, 44, 36, 0}, {1, 96, 120, 100, 60, 1},
        {1, 130, 31, 29, 61, 2}, {1, 48, 18, 18, 48, 4}, {1, 32, 97, 13, 32, 3}};
    static const char *const tiles[2] = {"4", "6"};
    for (int ci = 0; ci < 6; ci++) winograd_vs_gemm(cfg[ci], ci % 2 == 0, "winograd", "KILN_WINOGRAD_TILE", tiles, 2);
}

/* Nearest 2x upsampling fused with a 3x3 convolution (kiln_cpu_conv2d_up2: F(4,2) on the
 * four parity kernels from 64 tiles a parity, the two ops in a row below) against upsampling
 * then the GEMM path: odd sizes, tile rows ending inside a 16-tile block, batches,
 * channel counts off the sliver and block sizes, several strips, f32 / f16 / bf16. */
static void t_conv_up2(void)
{
    if (child_mode) { SKIP("covered by the parent"); return; }
    static const int64_t cfg[][5] = { /* n, c, h, w, k */
        {1, 32, 32, 32, 32}, {2, 40, 33, 30, 50}, {1, 64, 37, 29, 36}, {1, 96, 60, 50, 60},
        {1, 130, 41, 39, 61}, {1, 8, 10, 10, 5}}; /* the last: the unfused pair */
    static const kiln_dtype dts[3] = {KILN_F32, KILN_F16, KILN_BF16};
    for (int ci = 0; ci < 6; ci++) {
        const int64_t *q = cfg[ci];
        int64_t N = q[0], C = q[1], H = q[2], W = q[3], K = q[4];
        int64_t nx = N * C * H * W, nw = K * C * 9, ny = N * K * 4 * H * W;
        float *x = rand_buf(nx), *w = rand_buf(nw), *b = ci % 2 ? NULL : rand_buf(K);
        float *u = malloc((size_t)(4 * nx) * sizeof *u), *y1 = guarded(ny), *y2 = guarded(ny);
        uint16_t *wh = malloc((size_t)nw * sizeof *wh);
        double *R = malloc((size_t)ny * sizeof *R);
        if (!x || !w || (!b && ci % 2 == 0) || !u || !y1 || !y2 || !wh || !R) { CHECK(0, "out of memory"); return; }
        kiln_cpu_upsample_nearest(u, x, N * C, H, W, 2);
        kiln_conv2d_params p = {N, C, 2 * H, 2 * W, K, 3, 3, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0.0f, NULL, NULL};
        kiln_conv2d_out_size(&p);
        for (int d = 0; d < 3; d++) {
            const void *wp = w;
            if (dts[d] != KILN_F32) {
                for (int64_t i = 0; i < nw; i++)
                    wh[i] = dts[d] == KILN_F16 ? kiln_f32_to_f16(w[i]) : kiln_f32_to_bf16(w[i]);
                wp = wh;
            }
            set_path("gemm");
            CHECK(kiln_cpu_conv2d(y1, u, wp, dts[d], b, &p) == KILN_OK, "gemm: %s", kiln_last_error());
            set_path("auto");
            for (int64_t i = 0; i < ny; i++) R[i] = y1[i];
            for (int64_t i = 0; i < ny; i++) y2[i] = NAN; /* every output must be written */
            CHECK(kiln_cpu_conv2d_up2(y2, x, wp, dts[d], b, N, C, H, W, K) == KILN_OK, "up2: %s", kiln_last_error());
            double e = rel_err(y2, R, ny);
            CHECK(e <= 1e-4, "n%lld c%lld %lldx%lld k%lld %s: upsample+conv fused vs gemm rel err %.3g", (long long)N,
                  (long long)C, (long long)H, (long long)W, (long long)K, kiln_dtype_name(dts[d]), e);
            CHECK(guards_ok(y2, ny), "up2 wrote outside y");
        }
        free(x); free(w); free(b); free(u); free(wh); guarded_free(y1); guarded_free(y2); free(R);
    }
}

/* Winograd with output channels in the lanes (conv2d_winograd_few.c), F(2,3) and F(4,3):
 * channel counts off the 16-lane and 96-channel blocks and the 128-channel chunks,
 * batches (one with more tiles than a group takes), odd sizes, pads 0 and 2. */
static void t_conv_winograd_few(void)
{
    if (child_mode) { SKIP("covered by the parent"); return; }
    static const int64_t cfg[][6] = { /* n, c, h, w, k, pad */
        {1, 1280, 8, 8, 1280, 1}, {2, 300, 16, 16, 200, 1}, {1, 70, 13, 9, 33, 1},
        {3, 64, 7, 7, 97, 0}, {1, 130, 10, 11, 16, 2}, {2, 48, 24, 20, 100, 1},
        {3, 40, 20, 18, 36, 1}}; /* the last: 75 tiles, run as groups of 2 and 1 images */
    static const char *const tiles[2] = {"2", "4"};
    for (int ci = 0; ci < 7; ci++)
        winograd_vs_gemm(cfg[ci], ci % 2 == 0, "winograd-few", "KILN_WINOGRAD_FEW_TILE", tiles, 2);
}

/* Two host threads convolving at once (the scratch cache hands each its own block),
 * then the cache emptied through the device: the same bits every time. */
typedef struct { const float *x, *w, *b; float *y; kiln_conv2d_params p; kiln_status st; } conc_job;
static void *conc_fn(void *v)
{
    conc_job *j = v;
    for (int i = 0; i < 3 && j->st == KILN_OK; i++) j->st = kiln_cpu_conv2d(j->y, j->x, j->w, KILN_F32, j->b, &j->p);
    return NULL;
}

static void t_conv_concurrent(void)
{
    kiln_conv2d_params p = {1, 64, 40, 40, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0.0f, NULL, NULL};
    kiln_conv2d_out_size(&p);
    int64_t nx = p.c * p.h * p.w, nw = p.k * p.c * 9, ny = p.k * p.oh * p.ow;
    float *x = rand_buf(nx), *w = rand_buf(nw), *b = rand_buf(p.k), *ref = rand_buf(ny);
    float *y1 = rand_buf(ny), *y2 = rand_buf(ny);
    if (!x || !w || !b || !ref || !y1 || !y2) { CHECK(0, "out of memory"); return; }
    CHECK(kiln_cpu_conv2d(ref, x, w, KILN_F32, b, &p) == KILN_OK, "%s", kiln_last_error());
    conc_job j1 = {x, w, b, y1, p, KILN_OK}, j2 = {x, w, b, y2, p, KILN_OK};
    pthread_t t1, t2;
    int ok1 = pthread_create(&t1, NULL, conc_fn, &j1) == 0, ok2 = pthread_create(&t2, NULL, conc_fn, &j2) == 0;
    if (ok1) pthread_join(t1, NULL);
    if (ok2) pthread_join(t2, NULL);
    CHECK(ok1 && ok2 && j1.st == KILN_OK && j2.st == KILN_OK, "threads: %d %d", j1.st, j2.st);
    CHECK(!memcmp(y1, ref, (size_t)ny * sizeof *ref) && !memcmp(y2, ref, (size_t)ny * sizeof *ref),
          "concurrent convolutions differ");
    /* the device's empty_cache (kiln.mem.empty_cache, unload) gives the idle scratch back */
    if (kiln_cpu_gemm_have_simd()) /* the OpenBLAS fallback keeps none */
        CHECK(kiln_cpu_scratch_cached() > 0, "no scratch cached after convolutions");
    kiln_device_empty_cache(kiln_device_cpu());
    CHECK(kiln_cpu_scratch_cached() == 0, "%zu bytes of scratch still cached after empty_cache",
          kiln_cpu_scratch_cached());
    CHECK(kiln_cpu_conv2d(y1, x, w, KILN_F32, b, &p) == KILN_OK && !memcmp(y1, ref, (size_t)ny * sizeof *ref),
          "after trim: differs");
    free(x); free(w); free(b); free(ref); free(y1); free(y2);
}

/* p->residual (then act) on every path, f32 and f16 weights, with and without bias:
 * the plain convolution of the same path, + r, then the leaky ReLU computed here.
 * A residual added after the activation, or to the wrong image, fails. */
static void t_conv_residual(void)
{
    static const int64_t cases[][9] = {
        /* n, c, h, w, k, r (= s), groups, pad, stride */
        {2, 64, 12, 12, 64, 3, 1, 1, 1}, /* Winograd (forced), few tiles, GEMM, im2col */
        {1, 48, 20, 20, 40, 3, 1, 1, 1}, /* Winograd on its own */
        {2, 8, 9, 11, 8, 3, 8, 1, 1},    /* depthwise (direct) */
        {1, 16, 10, 10, 3, 3, 1, 1, 1},  /* few outputs (direct) */
        {1, 16, 10, 10, 24, 1, 1, 0, 1}, /* 1x1: the plain GEMM */
        {2, 16, 11, 9, 24, 3, 1, 1, 2},  /* strided: implicit GEMM */
    };
    static const float slopes[3] = {-1.0f, 0.0f, 0.2f}; /* -1: no activation */
    static const kiln_dtype dts[2] = {KILN_F32, KILN_F16};
    int ran = 0;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t *v = cases[ci];
        kiln_conv2d_params base = {v[0], v[1], v[2], v[3], v[4], v[5], v[5], v[8], v[8], v[7], v[7], 1, 1, v[6],
                                   0, 0, 0, 0.0f, NULL, NULL};
        if (kiln_conv2d_out_size(&base) != KILN_OK) { CHECK(0, "case %zu: %s", ci, kiln_last_error()); continue; }
        int64_t nx = base.n * base.c * base.h * base.w, nw = base.k * (base.c / base.groups) * base.r * base.s;
        int64_t ny = base.n * base.k * base.oh * base.ow;
        float *x = rand_buf(nx), *w = rand_buf(nw), *b = rand_buf(base.k), *r = rand_buf(ny);
        float *plain = guarded(ny), *y = guarded(ny);
        uint16_t *wh = malloc((size_t)nw * sizeof *wh);
        double *want = malloc((size_t)ny * sizeof *want);
        if (!x || !w || !b || !r || !plain || !y || !wh || !want) { CHECK(0, "out of memory"); return; }
        for (int64_t i = 0; i < nw; i++) {
            wh[i] = kiln_f32_to_f16(w[i]);
            w[i] = kiln_f16_to_f32(wh[i]); /* both dtypes: the same weights */
        }
        for (int pi = 0; pi < N_PATHS; pi++) {
            if (strcmp(PATHS[pi], "auto") && !path_applies(PATHS[pi], &base)) continue;
            set_path(PATHS[pi]);
            for (int d = 0; d < 2; d++)
                for (int bi = 0; bi < 2; bi++)
                    for (int si = 0; si < 3; si++) {
                        const void *wd = dts[d] == KILN_F32 ? (const void *)w : (const void *)wh;
                        const float *bias = bi ? b : NULL;
                        kiln_conv2d_params p = base;
                        kiln_status st = kiln_cpu_conv2d(plain, x, wd, dts[d], bias, &p);
                        for (int64_t i = 0; i < ny && st == KILN_OK; i++) {
                            float s = plain[i] + r[i];
                            want[i] = slopes[si] >= 0 && s < 0 ? (double)(s * slopes[si]) : (double)s;
                        }
                        p.residual = r;
                        p.act = slopes[si] >= 0;
                        p.act_slope = slopes[si] >= 0 ? slopes[si] : 0.0f;
                        if (st == KILN_OK) st = kiln_cpu_conv2d(y, x, wd, dts[d], bias, &p);
                        double e = st == KILN_OK ? rel_err(y, want, ny) : 1.0;
                        CHECK(st == KILN_OK && e <= 1e-5, "case %zu (%s, %s weights, bias %d, slope %g): rel err %.3g %s",
                              ci, PATHS[pi], kiln_dtype_name(dts[d]), bi, slopes[si], e,
                              st ? kiln_last_error() : "");
                        CHECK(guards_ok(y, ny), "case %zu (%s): wrote outside y", ci, PATHS[pi]);
                        ran++;
                    }
        }
        set_path("auto");
        free(x); free(w); free(b); free(r); free(wh); free(want);
        guarded_free(plain); guarded_free(y);
    }
    CHECK(ran >= 6 * 12, "only %d residual convolutions ran", ran);
}

static void t_conv_errors(void)
{
    kiln_conv2d_params base = {1, 4, 8, 8, 6, 3, 3, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0.0f, NULL, NULL};
    kiln_conv2d_params p = base;
    CHECK(kiln_conv2d_out_size(&p) == KILN_OK && p.oh == 8 && p.ow == 8, "3x3 pad 1 on 8x8: %lldx%lld",
          (long long)p.oh, (long long)p.ow);
    p = base; p.groups = 3;
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "groups 3 of 4 channels accepted");
    CHECK(strstr(kiln_last_error(), "groups") != NULL, "message: %s", kiln_last_error());
    p = base; p.groups = 4; /* divides c = 4 but not k = 6 */
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "groups 4 of 6 output channels accepted");
    p = base; p.r = 11; p.pad_h = 1;
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "11-row kernel on 8+2 rows accepted (empty output)");
    CHECK(strstr(kiln_last_error(), "empty") != NULL, "message: %s", kiln_last_error());
    p = base; p.pad_h = 0; p.pad_w = 0; p.dil_w = 5;
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "dilated kernel wider than the input accepted");
    p = base; p.c = 0;
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "0 channels accepted");
    p = base; p.stride_h = 0;
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "stride 0 accepted");
    p = base; p.pad_w = -1;
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "negative padding accepted");
    p = base; p.n = (int64_t)1 << 40;
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "2^40 batch accepted");
    p = base; p.h = p.w = (int64_t)1 << 30; p.c = p.k = 1 << 20;
    CHECK(kiln_conv2d_out_size(&p) == KILN_ERR_ARG, "overflowing sizes accepted");
    CHECK(kiln_conv2d_out_size(NULL) == KILN_ERR_ARG, "NULL params accepted");

    /* kiln_cpu_conv2d validates too, and leaves y alone on error */
    float x[4 * 64], w[6 * 4 * 9], *y = guarded(6 * 64);
    for (int i = 0; i < 4 * 64; i++) x[i] = 1;
    for (int i = 0; i < 6 * 4 * 9; i++) w[i] = 1;
    for (int i = 0; i < 6 * 64; i++) y[i] = 7;
    p = base; p.groups = 3; p.oh = p.ow = 8;
    CHECK(kiln_cpu_conv2d(y, x, w, KILN_F32, NULL, &p) == KILN_ERR_ARG, "conv2d with groups 3 of 4 accepted");
    p = base; p.r = 11; p.oh = p.ow = 8;
    CHECK(kiln_cpu_conv2d(y, x, w, KILN_F32, NULL, &p) == KILN_ERR_ARG, "conv2d with an empty output accepted");
    p = base; kiln_conv2d_out_size(&p); p.oh = 9;
    CHECK(kiln_cpu_conv2d(y, x, w, KILN_F32, NULL, &p) == KILN_ERR_ARG, "conv2d with a wrong oh accepted");
    p = base; kiln_conv2d_out_size(&p);
    CHECK(kiln_cpu_conv2d(y, x, w, KILN_I64, NULL, &p) == KILN_ERR_UNSUPPORTED, "i64 weights accepted");
    CHECK(kiln_cpu_conv2d(NULL, x, w, KILN_F32, NULL, &p) == KILN_ERR_ARG, "NULL output accepted");
    CHECK(kiln_cpu_conv2d(y, x, w, KILN_F32, NULL, NULL) == KILN_ERR_ARG, "NULL params accepted");
    int untouched = 1;
    for (int i = 0; i < 6 * 64; i++) untouched &= y[i] == 7;
    CHECK(untouched && guards_ok(y, 6 * 64), "a failed conv2d wrote to y");
    CHECK(kiln_cpu_conv2d(y, x, w, KILN_F32, NULL, &p) == KILN_OK, "valid conv2d: %s", kiln_last_error());
    CHECK(y[0] == 16 && y[9] == 36, "all-ones conv: y[0] = %g (16), y[9] = %g (36)", y[0], y[9]);
    guarded_free(y);
}

/* the OpenBLAS path: this program again in a child with KILN_CPU_ISA=generic */
static const char *self_path;
static void t_blas_fallback(void)
{
    if (!self_path) { SKIP("own path unknown"); return; }
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "KILN_CPU_ISA=generic KILN_GEMM_CHILD=1 '%s' 2>&1", self_path);
    FILE *p = popen(cmd, "r");
    if (!p) { SKIP("popen failed"); return; }
    char line[512];
    int fails = 0, passes = 0;
    while (fgets(line, sizeof line, p)) {
        if (!strncmp(line, "FAIL", 4) || !strncmp(line, "    ", 4)) { fails++; printf("  generic: %s", line); }
        if (!strncmp(line, "PASS", 4)) passes++;
    }
    int rc = pclose(p);
    CHECK(rc == 0 && fails == 0 && passes > 8, "KILN_CPU_ISA=generic: rc %d, %d failures, %d passes", rc, fails,
          passes);
}

int main(int argc, char **argv)
{
    (void)argc;
    const char *cm = getenv("KILN_GEMM_CHILD");
    child_mode = cm && *cm == '1';
    if (!child_mode && argv[0] && strchr(argv[0], '/') && strlen(argv[0]) < 900 && !strchr(argv[0], '\''))
        self_path = argv[0];
    unsetenv("KILN_CONV_PATH");
    RUN(t_gemm_golden);
    RUN(t_linear_golden);
    RUN(t_gemm_shapes);
    RUN(t_gemm_batched);
    RUN(t_linear_panels);
    RUN(t_gemm_nested);
    RUN(t_conv_golden_auto);
    RUN(t_conv_golden_gemm);
    RUN(t_conv_golden_winograd);
    RUN(t_conv_golden_winograd_few);
    RUN(t_conv_golden_im2col);
    RUN(t_conv_golden_direct);
    RUN(t_conv_random);
    RUN(t_conv_winograd_blocks);
    RUN(t_conv_winograd_tiles);
    RUN(t_conv_up2);
    RUN(t_conv_winograd_few);
    RUN(t_conv_concurrent);
    RUN(t_conv_residual);
    RUN(t_conv_errors);
    if (!child_mode) RUN(t_blas_fallback);
    return test_summary();
}

/* bench_gemm_conv.c - speed of the CPU GEMM and conv2d kernels at Stable Diffusion 1.5's
 * shapes (512x512 image -> 64x64 latent, batch 1), next to raw OpenBLAS and to PyTorch
 * on the same machine and thread count (tests/bench/torch_gemm_conv.py, run from here
 * through /usr/bin/python3; KILN_BENCH_NO_TORCH=1 skips it). Run from the repository root:
 *   cc -std=c11 -O2 -Iruntime -Ikernels/cpu tests/bench/bench_gemm_conv.c build/libkiln.a \
 *      -lopenblas -lpthread -lm && ./a.out
 * With -DKILN_BENCH_DNNL and -ldnnl a oneDNN column is added (direct convolution,
 * including the reorders from and to NCHW that a caller holding NCHW tensors pays).
 * KILN_PEAK_GFLOPS sets the peak of the "% peak" column (default 185, 2 Zen 4 cores);
 * KILN_BENCH_FULL=1 adds the VAE's full-size 128 -> 128 @ 512x512 convolution.
 * Timing: one warm-up call, then repeats until 1 s (at least 3, at most 50; 0.5 s and
 * at least 2 for the per-path columns); the minimum is kept, the same rule as
 * torch_gemm_conv.py. Other work on the machine shows up as noise: rerun and compare. */
#define _POSIX_C_SOURCE 200809L
#include "cpu_kernels.h"
#include "precision.h"
#include "threadpool.h"

#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef KILN_BENCH_DNNL
#include <dnnl.h>
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t rs = 88172645463325252ull;
static float *rnd(int64_t n, float scale)
{
    float *p = malloc((size_t)n * sizeof(float));
    if (!p) { fprintf(stderr, "bench_gemm_conv: out of memory (%lld floats)\n", (long long)n); exit(1); }
    for (int64_t i = 0; i < n; i++) {
        rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
        p[i] = ((float)((rs >> 40) * (2.0 / 16777216.0)) - 1.0f) * scale;
    }
    return p;
}

/* best time of fn: warm-up, then until `budget` seconds (>= min_reps, <= 50) */
static double best_of(void (*fn)(void *), void *ctx, double budget, int min_reps)
{
    double best = 1e30, t_end = 0;
    for (int rep = -1;; rep++) {
        double t = now();
        fn(ctx);
        t = now() - t;
        if (rep < 0) { t_end = now() + budget; continue; }
        if (t < best) best = t;
        if (rep >= min_reps - 1 && (now() > t_end || rep >= 49)) break;
    }
    return best;
}

/* ---- cases ---- */

typedef struct {
    const char *name;
    int kind;           /* 0 linear x.W^T (kiln_cpu_linear), 1 A.B^T (kiln_cpu_gemm_f32), 2 conv2d */
    int64_t a, b, c, d; /* gemm M, N, K; conv Cin, Cout, R, H (= W) */
    const char *what;
} bench_case;

static const bench_case cases[] = {
    {"gemm_4096x320x320", 0, 4096, 320, 320, 0, "UNet attn q/k/v/out proj @64x64"},
    {"gemm_4096x1280x320", 0, 4096, 1280, 320, 0, "UNet FF (GEGLU half) @64x64"},
    {"gemm_4096x320x1280", 0, 4096, 320, 1280, 0, "UNet FF down @64x64"},
    {"gemm_77x768x320", 0, 77, 768, 320, 0, "77-token rows, 768 out"},
    {"gemm_77x320x768", 0, 77, 320, 768, 0, "cross-attn to_k/to_v on CLIP"},
    {"gemmnt_4096x4096x64", 1, 4096, 4096, 64, 0, "attention scores, d=64"},
    {"gemmnt_4096x4096x40", 1, 4096, 4096, 40, 0, "attention scores, SD1.5 d=40"},
    {"conv_320x320_k3_64x64", 2, 320, 320, 3, 64, "UNet level 1 resnet"},
    {"conv_640x640_k3_32x32", 2, 640, 640, 3, 32, "UNet level 2 resnet"},
    {"conv_1280x1280_k3_16x16", 2, 1280, 1280, 3, 16, "UNet level 3 resnet"},
    {"conv_1280x1280_k3_8x8", 2, 1280, 1280, 3, 8, "UNet level 4 / mid"},
    {"conv_320x320_k1_64x64", 2, 320, 320, 1, 64, "UNet 1x1 (proj_in/out)"},
    {"conv_512x512_k3_64x64", 2, 512, 512, 3, 64, "VAE decoder mid/up0"},
    {"conv_512x512_k3_128x128", 2, 512, 512, 3, 128, "VAE decoder up1"},
    {"conv_256x256_k3_256x256", 2, 256, 256, 3, 256, "VAE decoder up2"},
    {"conv_128x128_k3_256x256", 2, 128, 128, 3, 256, "VAE up3 at half size"},
    {"conv_128x128_k3_512x512", 2, 128, 128, 3, 512, "VAE decoder up3 (FULL=1)"},
};
#define NCASES (sizeof cases / sizeof *cases)

typedef struct {
    const bench_case *c;
    float *x, *w, *y, *b;
    void *wh;                 /* f16 copy of w (linear) */
    kiln_conv2d_params p;
    float *col;               /* OpenBLAS im2col buffer */
    int64_t col_rows;         /* output rows per im2col strip */
} run_ctx;

static void run_kiln(void *v)
{
    run_ctx *r = v;
    const bench_case *c = r->c;
    kiln_status st = KILN_OK;
    if (c->kind == 0) st = kiln_cpu_linear(r->y, r->x, r->w, KILN_F32, NULL, c->a, c->b, c->c);
    else if (c->kind == 1) kiln_cpu_gemm_f32(0, 1, c->a, c->b, c->c, 1.0f, r->x, c->c, r->w, c->c, 0.0f, r->y, c->b);
    else st = kiln_cpu_conv2d(r->y, r->x, r->w, KILN_F32, r->b, &r->p);
    if (st != KILN_OK) { fprintf(stderr, "bench_gemm_conv: %s: %s\n", c->name, kiln_last_error()); exit(1); }
}

static void run_kiln_f16(void *v)
{
    run_ctx *r = v;
    if (kiln_cpu_linear(r->y, r->x, r->wh, KILN_F16, NULL, r->c->a, r->c->b, r->c->c) != KILN_OK) exit(1);
}

/* raw OpenBLAS: sgemm; for conv, im2col over strips of output rows (16 MiB column
 * buffer) + sgemm per strip, bias added after */
static void run_blas(void *v)
{
    run_ctx *r = v;
    const bench_case *c = r->c;
    if (c->kind <= 1) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c->a, (int)c->b, (int)c->c, 1.0f, r->x, (int)c->c,
                    r->w, (int)c->c, 0.0f, r->y, (int)c->b);
        return;
    }
    const kiln_conv2d_params *p = &r->p;
    int64_t crs = p->c * p->r * p->s, ohw = p->oh * p->ow;
    if (p->r == 1) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)p->k, (int)ohw, (int)p->c, 1.0f, r->w, (int)p->c,
                    r->x, (int)ohw, 0.0f, r->y, (int)ohw);
    } else {
        for (int64_t oy0 = 0; oy0 < p->oh; oy0 += r->col_rows) {
            int64_t rows = p->oh - oy0 < r->col_rows ? p->oh - oy0 : r->col_rows, ncol = rows * p->ow;
            for (int64_t q = 0; q < crs; q++) {
                int64_t ch = q / (p->r * p->s), rr = (q / p->s) % p->r, ss = q % p->s;
                for (int64_t oy = oy0; oy < oy0 + rows; oy++) {
                    int64_t iy = oy - p->pad_h + rr;
                    float *d = r->col + q * ncol + (oy - oy0) * p->ow;
                    for (int64_t ox = 0; ox < p->ow; ox++) {
                        int64_t ix = ox - p->pad_w + ss;
                        d[ox] = iy >= 0 && iy < p->h && ix >= 0 && ix < p->w ? r->x[(ch * p->h + iy) * p->w + ix] : 0;
                    }
                }
            }
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)p->k, (int)ncol, (int)crs, 1.0f, r->w,
                        (int)crs, r->col, (int)ncol, 0.0f, r->y + oy0 * p->ow, (int)ohw);
        }
    }
    for (int64_t k = 0; k < p->k; k++)
        for (int64_t i = 0; i < ohw; i++) r->y[k * ohw + i] += r->b[k];
}

#ifdef KILN_BENCH_DNNL
/* oneDNN direct convolution (brgconv on AVX-512) with the NCHW <-> blocked reorders of
 * input, weights and output inside the timing. */
typedef struct {
    dnnl_engine_t eng;
    dnnl_stream_t st;
    dnnl_primitive_t conv, r_src, r_w, r_dst;
    dnnl_memory_t us, uw, ud, ms, mw, md, mb;
} dnnl_ctx;

static int bench_reorder(dnnl_ctx *d, dnnl_memory_t a, dnnl_memory_t b, dnnl_primitive_t *out)
{
    const dnnl_memory_desc_t *ma, *mb;
    dnnl_memory_get_memory_desc(a, &ma);
    dnnl_memory_get_memory_desc(b, &mb);
    dnnl_primitive_desc_t pd;
    if (dnnl_reorder_primitive_desc_create(&pd, ma, d->eng, mb, d->eng, NULL) != dnnl_success) return -1;
    dnnl_status_t s = dnnl_primitive_create(out, pd);
    dnnl_primitive_desc_destroy(pd);
    return s == dnnl_success ? 0 : -1;
}

static int dnnl_setup(dnnl_ctx *d, run_ctx *r)
{
    const kiln_conv2d_params *p = &r->p;
    dnnl_dims_t sd = {1, p->c, p->h, p->w}, wd = {p->k, p->c, p->r, p->s}, dd = {1, p->k, p->oh, p->ow}, bd = {p->k};
    dnnl_dims_t str = {1, 1}, pad = {p->pad_h, p->pad_w};
    dnnl_memory_desc_t sa, wa, da, bm, su, wu, du;
    dnnl_memory_desc_init_by_tag(&sa, 4, sd, dnnl_f32, dnnl_format_tag_any);
    dnnl_memory_desc_init_by_tag(&wa, 4, wd, dnnl_f32, dnnl_format_tag_any);
    dnnl_memory_desc_init_by_tag(&da, 4, dd, dnnl_f32, dnnl_format_tag_any);
    dnnl_memory_desc_init_by_tag(&bm, 1, bd, dnnl_f32, dnnl_x);
    dnnl_memory_desc_init_by_tag(&su, 4, sd, dnnl_f32, dnnl_nchw);
    dnnl_memory_desc_init_by_tag(&wu, 4, wd, dnnl_f32, dnnl_oihw);
    dnnl_memory_desc_init_by_tag(&du, 4, dd, dnnl_f32, dnnl_nchw);
    dnnl_convolution_desc_t cd;
    if (dnnl_engine_create(&d->eng, dnnl_cpu, 0) || dnnl_stream_create(&d->st, d->eng, dnnl_stream_default_flags) ||
        dnnl_convolution_forward_desc_init(&cd, dnnl_forward_inference, dnnl_convolution_direct, &sa, &wa, &bm, &da,
                                           str, pad, pad))
        return -1;
    dnnl_primitive_desc_t pd;
    if (dnnl_primitive_desc_create(&pd, &cd, NULL, d->eng, NULL) != dnnl_success) return -1;
    if (dnnl_memory_create(&d->us, &su, d->eng, r->x) || dnnl_memory_create(&d->uw, &wu, d->eng, r->w) ||
        dnnl_memory_create(&d->ud, &du, d->eng, r->y) || dnnl_memory_create(&d->mb, &bm, d->eng, r->b) ||
        dnnl_memory_create(&d->ms, dnnl_primitive_desc_query_md(pd, dnnl_query_src_md, 0), d->eng, DNNL_MEMORY_ALLOCATE) ||
        dnnl_memory_create(&d->mw, dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0), d->eng,
                           DNNL_MEMORY_ALLOCATE) ||
        dnnl_memory_create(&d->md, dnnl_primitive_desc_query_md(pd, dnnl_query_dst_md, 0), d->eng, DNNL_MEMORY_ALLOCATE) ||
        dnnl_primitive_create(&d->conv, pd))
        return -1;
    dnnl_primitive_desc_destroy(pd);
    if (bench_reorder(d, d->us, d->ms, &d->r_src) || bench_reorder(d, d->uw, d->mw, &d->r_w) ||
        bench_reorder(d, d->md, d->ud, &d->r_dst))
        return -1;
    return 0;
}

static dnnl_ctx *dnnl_cur;
static void run_dnnl(void *v)
{
    (void)v;
    dnnl_ctx *d = dnnl_cur;
    dnnl_exec_arg_t a1[2] = {{DNNL_ARG_FROM, d->us}, {DNNL_ARG_TO, d->ms}};
    dnnl_exec_arg_t a2[2] = {{DNNL_ARG_FROM, d->uw}, {DNNL_ARG_TO, d->mw}};
    dnnl_exec_arg_t a3[4] = {{DNNL_ARG_SRC, d->ms}, {DNNL_ARG_WEIGHTS, d->mw}, {DNNL_ARG_BIAS, d->mb}, {DNNL_ARG_DST, d->md}};
    dnnl_exec_arg_t a4[2] = {{DNNL_ARG_FROM, d->md}, {DNNL_ARG_TO, d->ud}};
    dnnl_primitive_execute(d->r_src, d->st, 2, a1);
    dnnl_primitive_execute(d->r_w, d->st, 2, a2);
    dnnl_primitive_execute(d->conv, d->st, 4, a3);
    dnnl_primitive_execute(d->r_dst, d->st, 2, a4);
    dnnl_stream_wait(d->st);
}

static void dnnl_free(dnnl_ctx *d)
{
    dnnl_primitive_destroy(d->conv); dnnl_primitive_destroy(d->r_src); dnnl_primitive_destroy(d->r_w);
    dnnl_primitive_destroy(d->r_dst);
    dnnl_memory_destroy(d->us); dnnl_memory_destroy(d->uw); dnnl_memory_destroy(d->ud); dnnl_memory_destroy(d->ms);
    dnnl_memory_destroy(d->mw); dnnl_memory_destroy(d->md); dnnl_memory_destroy(d->mb);
    dnnl_stream_destroy(d->st); dnnl_engine_destroy(d->eng);
}
#endif

static double flops(const bench_case *c)
{
    if (c->kind <= 1) return 2.0 * (double)c->a * (double)c->b * (double)c->c;
    return 2.0 * (double)c->a * (double)c->b * (double)(c->c * c->c) * (double)(c->d * c->d);
}

/* OpenBLAS's threads spin for a while after a call; let them sleep before kiln runs */
static void blas_quiet(void) { nanosleep(&(struct timespec){0, 300000000}, NULL); }

int main(void)
{
    int threads = kiln_cpu_threads();
    const char *pk = getenv("KILN_PEAK_GFLOPS");
    double peak = pk && atof(pk) > 0 ? atof(pk) : 185.0;
    const char *full_e = getenv("KILN_BENCH_FULL");
    int full = full_e && *full_e == '1';
    double torch_sec[NCASES];
    for (size_t i = 0; i < NCASES; i++) torch_sec[i] = -1;

    const char *no = getenv("KILN_BENCH_NO_TORCH");
    if (!(no && *no == '1')) {
        char cmd[4096];
        int n = snprintf(cmd, sizeof cmd, "/usr/bin/python3 tests/bench/torch_gemm_conv.py %d", threads);
        for (size_t i = 0; i < NCASES && n < (int)sizeof cmd - 64; i++)
            if (full || strcmp(cases[i].name, "conv_128x128_k3_512x512"))
                n += snprintf(cmd + n, sizeof cmd - (size_t)n, " %s", cases[i].name);
        snprintf(cmd + n, sizeof cmd - (size_t)n, " 2>/dev/null");
        FILE *p = popen(cmd, "r");
        char line[256];
        while (p && fgets(line, sizeof line, p)) {
            char name[64];
            double sec;
            if (sscanf(line, "{\"case\": \"%63[^\"]\", \"sec\": %lf}", name, &sec) != 2) continue;
            for (size_t i = 0; i < NCASES; i++)
                if (!strcmp(name, cases[i].name)) torch_sec[i] = sec;
        }
        if (p) pclose(p);
    }

    printf("bench_gemm_conv: %d threads (KILN_THREADS; OpenBLAS and torch get the same), best of >= 3 runs, "
           "peak %.0f GFLOP/s\n", threads, peak);
    printf("%-26s %9s %7s %6s %9s %7s %9s %7s  %s\n", "case", "kiln ms", "GFLOP/s", "%peak", "torch ms", "/torch",
           "blas ms", "/blas", "what");
    double path_ms[NCASES][5];
    for (size_t i = 0; i < NCASES; i++) {
        const bench_case *c = &cases[i];
        for (int j = 0; j < 5; j++) path_ms[i][j] = -1;
        if (!full && !strcmp(c->name, "conv_128x128_k3_512x512")) continue;
        run_ctx r = {0};
        r.c = c;
        if (c->kind <= 1) {
            r.x = rnd(c->a * c->c, 1.0f);
            r.w = rnd(c->b * c->c, 0.05f);
            r.y = rnd(c->a * c->b, 1.0f);
        } else {
            kiln_conv2d_params p = {1, c->a, c->d, c->d, c->b, c->c, c->c, 1, 1, c->c / 2, c->c / 2, 1, 1, 1, 0, 0};
            if (kiln_conv2d_out_size(&p) != KILN_OK) { fprintf(stderr, "%s\n", kiln_last_error()); return 1; }
            r.p = p;
            r.x = rnd(p.c * p.h * p.w, 1.0f);
            r.w = rnd(p.k * p.c * p.r * p.s, 0.05f);
            r.b = rnd(p.k, 1.0f);
            r.y = rnd(p.k * p.oh * p.ow, 1.0f);
            int64_t crs = p.c * p.r * p.s;
            r.col_rows = ((int64_t)4 << 20) / (crs * p.ow) > 0 ? ((int64_t)4 << 20) / (crs * p.ow) : 1;
            if (r.col_rows > p.oh) r.col_rows = p.oh;
            r.col = rnd(crs * r.col_rows * p.ow, 1.0f);
        }
        double t = best_of(run_kiln, &r, 1.0, 3);
        openblas_set_num_threads(threads);
        double tb = best_of(run_blas, &r, 1.0, 3);
        blas_quiet();
        double gf = flops(c) / t * 1e-9;
        char tor[32] = "n/a", tor_r[32] = "";
        if (torch_sec[i] > 0) {
            snprintf(tor, sizeof tor, "%.2f", torch_sec[i] * 1e3);
            snprintf(tor_r, sizeof tor_r, "%.2fx", t / torch_sec[i]);
        }
        printf("%-26s %9.2f %7.0f %5.0f%% %9s %7s %9.2f %6.2fx  %s\n", c->name, t * 1e3, gf, 100.0 * gf / peak, tor,
               tor_r, tb * 1e3, t / tb, c->what);
        fflush(stdout);
        if (c->kind == 0) {
            uint16_t *wh = malloc((size_t)(c->b * c->c) * sizeof *wh);
            if (wh) {
                for (int64_t j = 0; j < c->b * c->c; j++) wh[j] = kiln_f32_to_f16(r.w[j]);
                r.wh = wh;
                double th = best_of(run_kiln_f16, &r, 1.0, 3);
                printf("%-26s %9.2f %7.0f %5.0f%%   (f16 weights, converted panel by panel)\n", "  ... f16 weights",
                       th * 1e3, flops(c) / th * 1e-9, 100.0 * flops(c) / th * 1e-9 / peak);
                free(wh);
            }
        }
        { /* kiln.precision("bf16"): bf16 inputs, f32 sums (where the CPU has AVX-512) */
            kiln_precision_set(KILN_PREC_BF16);
            double tb16 = best_of(run_kiln, &r, 1.0, 3);
            kiln_precision_set(KILN_PREC_F32);
            printf("%-26s %9.2f %7.0f %5.0f%%   (precision bf16: x%.2f the f32 time)\n", "  ... bf16", tb16 * 1e3,
                   flops(c) / tb16 * 1e-9, 100.0 * flops(c) / tb16 * 1e-9 / peak, tb16 / t);
        }
        if (c->kind == 2) { /* the conv paths one by one */
            static const char *const paths[4] = {"gemm", "winograd", "winograd-few", "im2col"};
            for (int j = 0; j < 4; j++) {
                if ((j == 1 || j == 2) && c->c != 3) continue;
                setenv("KILN_CONV_PATH", paths[j], 1);
                path_ms[i][j] = best_of(run_kiln, &r, 0.5, 2) * 1e3;
            }
            unsetenv("KILN_CONV_PATH");
#ifdef KILN_BENCH_DNNL
            dnnl_ctx d = {0};
            if (dnnl_setup(&d, &r) == 0) {
                dnnl_cur = &d;
                path_ms[i][4] = best_of(run_dnnl, &r, 0.5, 2) * 1e3;
                dnnl_free(&d);
                blas_quiet(); /* OpenMP threads spin too */
            }
#endif
        }
        free(r.x); free(r.w); free(r.y); free(r.b); free(r.col);
    }
    printf("/torch, /blas = kiln time / their time (lower is better); blas = raw OpenBLAS sgemm, for conv "
           "im2col in 16 MiB strips + sgemm\n\n");
    printf("conv2d paths, ms (auto picks per shape; * = fastest)\n");
    printf("%-26s %9s %9s %12s %9s %9s\n", "case", "gemm", "winograd", "winograd-few", "im2col", "onednn");
    for (size_t i = 0; i < NCASES; i++) {
        if (cases[i].kind != 2 || path_ms[i][0] < 0) continue;
        int best = 0;
        for (int j = 1; j < 5; j++)
            if (path_ms[i][j] > 0 && path_ms[i][j] < path_ms[i][best]) best = j;
        printf("%-26s", cases[i].name);
        for (int j = 0; j < 5; j++) {
            char s[32] = "-";
            if (path_ms[i][j] > 0) snprintf(s, sizeof s, "%.2f%s", path_ms[i][j], j == best ? "*" : "");
            printf(j == 2 ? " %12s" : " %9s", s);
        }
        printf("\n");
    }
    printf("gemm = implicit GEMM (our kernel packs the image directly), winograd = F(4x4,3x3) with tiles in the "
           "lanes (F(6x6,3x3) for large images with few channels), winograd-few = F(4x4,3x3) / F(2x2,3x3) with channels in the lanes (declines more than 64 tiles: "
           "the next path runs), im2col = column strips + our GEMM, onednn = oneDNN 2.6 direct incl. reorders "
           "(-DKILN_BENCH_DNNL)\n");
    return 0;
}

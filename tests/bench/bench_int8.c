/* bench_int8.c - the int8 (W8A8, AVX512-VNNI) linear layer against the bf16 and f32 ones
 * (kiln_cpu_linear under kiln.precision "f32" / "bf16" / "int8"): a 3072 x 3072 layer
 * (a Flux / SD3 hidden size) over 1024 and 4096 tokens, with f16 weights and with q8_0
 * weights, and the linear layers of one Flux double block (img and txt streams: qkv,
 * proj, mlp up and down; 1024 image tokens and 256 text ones, a 512x512 picture). Runs
 * alternate between the precisions (a shared machine's speed drifts); the best time of
 * each and the median of the repeats' ratios are printed, and each precision's error
 * against the product in double precision on 64 rows (max |y - y_exact| / max |y_exact|).
 * int8 runs twice: packing the weights at each call (kiln_cpu_linear on raw buffers)
 * and over weights packed once beforehand (what a loaded model's layers do: the packed
 * form is kept with the weight, backend_cpu.c).
 * Build and run from the repository root:
 *   cc -std=c11 -O2 -Iruntime -Ikernels/cpu tests/bench/bench_int8.c build/libkiln.a \
 *      -lpng -lz -llua5.4 -lopenblas -lpthread -lm -o /tmp/bench_int8 && /tmp/bench_int8 [repeats] */
#define _POSIX_C_SOURCE 200809L
#include "cpu_internal.h"
#include "cpu_kernels.h"
#include "precision.h"
#include "quant.h"
#include "threadpool.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t rs = 88172645463325252ull;
static double gauss(void)
{
    double u = 0;
    for (int i = 0; i < 12; i++) {
        rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
        u += (double)(rs >> 11) * 0x1p-53;
    }
    return u - 6.0;
}

typedef struct {
    int64_t M, N, K;
    float *x, *bias, *y;
    void *w;
    kiln_dtype wdt;
    void *packed; /* the weights packed once, as a model keeps them (backend_cpu.c's cache) */
} layer;

static void layer_init(layer *l, int64_t M, int64_t N, int64_t K, kiln_dtype wdt)
{
    l->M = M; l->N = N; l->K = K; l->wdt = wdt;
    l->x = malloc((size_t)(M * K) * sizeof(float));
    l->y = malloc((size_t)(M * N) * sizeof(float));
    l->bias = malloc((size_t)N * sizeof(float));
    float *w = malloc((size_t)(N * K) * sizeof(float));
    for (int64_t i = 0; i < M * K; i++) l->x[i] = (float)gauss();
    for (int64_t i = 0; i < N * K; i++) w[i] = (float)(gauss() / sqrt((double)K));
    for (int64_t i = 0; i < N; i++) l->bias[i] = (float)(0.02 * gauss());
    l->w = malloc(kiln_dtype_nbytes(wdt, (size_t)(N * K)));
    if (wdt == KILN_F16)
        for (int64_t i = 0; i < N * K; i++) ((uint16_t *)l->w)[i] = kiln_f32_to_f16(w[i]);
    else kiln_quant_encode(l->w, wdt, w, (size_t)(N * K));
    free(w);
    size_t pb = kiln_cpu_int8_packed_bytes(N, K, wdt);
    l->packed = pb ? aligned_alloc(64, (pb + 63) / 64 * 64) : NULL;
    if (l->packed) kiln_cpu_int8_pack(l->packed, l->w, wdt, N, K);
}

static void layer_free(layer *l) { free(l->x); free(l->y); free(l->bias); free(l->w); free(l->packed); }

/* p: a precision, or PACKED: int8 over the weights packed beforehand */
#define PACKED ((kiln_precision)100)
static double run(layer *ls, int n, kiln_precision p)
{
    kiln_precision_set(p == PACKED ? KILN_PREC_INT8 : p);
    double t0 = now();
    for (int i = 0; i < n; i++)
        if (p == PACKED) {
            if (!ls[i].packed || kiln_cpu_linear_int8_packed(ls[i].y, KILN_F32, ls[i].x, KILN_F32, ls[i].packed, ls[i].bias, ls[i].M, ls[i].N,
                                                             ls[i].K) != 0) {
                fprintf(stderr, "bench_int8: the packed int8 product does not run here\n");
                exit(1);
            }
        } else if (kiln_cpu_linear(ls[i].y, ls[i].x, ls[i].w, ls[i].wdt, ls[i].bias, ls[i].M, ls[i].N, ls[i].K) != KILN_OK) {
            fprintf(stderr, "bench_int8: linear failed: %s\n", kiln_last_error());
            exit(1);
        }
    return now() - t0;
}

/* error of l->y (the last run) against the product of x and the dequantized weights in
 * double, on the first rows */
static double rel_err(const layer *l)
{
    int64_t R = l->M < 64 ? l->M : 64;
    float *w = malloc((size_t)(l->N * l->K) * sizeof(float));
    kiln_to_f32(w, l->w, l->wdt, (size_t)(l->N * l->K));
    double d = 0, m = 0;
    for (int64_t i = 0; i < R; i++)
        for (int64_t n = 0; n < l->N; n++) {
            double s = l->bias[n];
            for (int64_t k = 0; k < l->K; k++) s += (double)l->x[i * l->K + k] * w[n * l->K + k];
            double e = fabs(s - l->y[i * l->N + n]);
            if (e > d) d = e;
            if (fabs(s) > m) m = fabs(s);
        }
    free(w);
    return d / m;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void bench(const char *name, layer *ls, int n, int reps)
{
    /* f32, bf16, int8 packing at each call, int8 over weights packed once */
    const kiln_precision ps[4] = {KILN_PREC_F32, KILN_PREC_BF16, KILN_PREC_INT8, PACKED};
    const int nq = kiln_cpu_has_vnni() ? 4 : 3;
    double best[4] = {1e30, 1e30, 1e30, 1e30}, err[4] = {0, 0, 0, 0}, ratio_b[64], ratio_p[64];
    double flops = 0;
    for (int i = 0; i < n; i++) flops += 2.0 * (double)ls[i].M * (double)ls[i].N * (double)ls[i].K;
    for (int q = 0; q < nq; q++) {
        run(ls, n, ps[q]); /* warm-up */
        err[q] = rel_err(&ls[n - 1]);
    }
    for (int r = 0; r < reps; r++) {
        double t[4] = {1e30, 1e30, 1e30, 1e30};
        for (int q = 0; q < nq; q++) {
            t[q] = run(ls, n, ps[q]);
            if (t[q] < best[q]) best[q] = t[q];
        }
        ratio_b[r] = t[1] / t[2];
        ratio_p[r] = t[1] / t[3];
    }
    qsort(ratio_b, (size_t)reps, sizeof(double), cmp);
    qsort(ratio_p, (size_t)reps, sizeof(double), cmp);
    printf("%s\n  f32 %8.1f ms (%5.0f GFLOP/s, err %.1e)  bf16 %8.1f ms (%5.0f, err %.1e)\n"
           "  int8 packing per call %8.1f ms (%5.0f, err %.1e): x%.2f bf16 (median x%.2f)\n",
           name, best[0] * 1e3, flops / best[0] * 1e-9, err[0], best[1] * 1e3, flops / best[1] * 1e-9, err[1],
           best[2] * 1e3, flops / best[2] * 1e-9, err[2], best[1] / best[2], ratio_b[reps / 2]);
    if (nq == 4)
        printf("  int8 weights packed once %8.1f ms (%5.0f, err %.1e): x%.2f bf16 (median x%.2f), x%.2f f32\n",
               best[3] * 1e3, flops / best[3] * 1e-9, err[3], best[1] / best[3], ratio_p[reps / 2], best[0] / best[3]);
    fflush(stdout);
}

int main(int argc, char **argv)
{
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    if (reps < 1 || reps > 64) reps = 5;
    printf("int8 products: %s (AVX512-VNNI %s), %d threads, best of %d alternating runs\n",
           kiln_cpu_has_vnni() ? "vpdpbusd" : "absent: int8 runs the bf16 products",
           kiln_cpu_has_vnni() ? "present" : "absent", kiln_cpu_threads(), reps);
    const int64_t tokens[2] = {1024, 4096};
    const kiln_dtype wdts[2] = {KILN_F16, KILN_Q8_0};
    for (int ti = 0; ti < 2; ti++)
        for (int wi = 0; wi < 2; wi++) {
            layer l;
            layer_init(&l, tokens[ti], 3072, 3072, wdts[wi]);
            char name[64];
            snprintf(name, sizeof name, "linear 3072x3072, %lld tokens, %s", (long long)tokens[ti],
                     kiln_dtype_name(wdts[wi]));
            bench(name, &l, 1, reps);
            layer_free(&l);
        }
    /* Flux double block's linear layers: per stream qkv (3072 -> 9216), proj (3072 ->
     * 3072), mlp (3072 -> 12288 -> 3072); img 1024 tokens, txt 256 */
    layer fl[8];
    const int64_t shapes[4][2] = {{9216, 3072}, {3072, 3072}, {12288, 3072}, {3072, 12288}};
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 4; k++) layer_init(&fl[s * 4 + k], s ? 256 : 1024, shapes[k][0], shapes[k][1], KILN_F16);
    bench("flux double block linears, f16", fl, 8, reps > 3 ? 3 : reps);
    for (int i = 0; i < 8; i++) layer_free(&fl[i]);
    kiln_precision_unset();
    return 0;
}

/* bench_nn.c - speed of the CPU attention, norm and activation kernels at Stable
 * Diffusion shapes, next to PyTorch on the same machine and thread count
 * (tests/bench/torch_nn.py, run from here through /usr/bin/python3; set
 * KILN_BENCH_NO_TORCH=1 to skip it). Run from the repository root.
 * Timing: one warm-up call, then repeats until 1 s (at least 3); the minimum is
 * kept, the same rule as torch_nn.py. Attention rate counts 2*L*L*(D+Dv) flops per
 * head; the memory-bound ops count one read and one write of the tensor. */
#define _POSIX_C_SOURCE 200809L
#include "cpu_kernels.h"
#include "threadpool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* defined in kernels/cpu/attention.c; proposed for cpu_kernels.h */
size_t kiln_cpu_attention_scratch_bytes(int64_t D, int64_t Dv);

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint64_t rs = 88172645463325252ull;
static float *rnd(int64_t n)
{
    float *p = malloc((size_t)n * sizeof(float));
    if (!p) { fprintf(stderr, "bench_nn: out of memory (%lld floats)\n", (long long)n); exit(1); }
    for (int64_t i = 0; i < n; i++) {
        rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17;
        p[i] = (float)((rs >> 40) * (2.0 / 16777216.0)) - 1.0f;
    }
    return p;
}

typedef struct {
    const char *name;
    int kind; /* 0 attention, 1 group_norm, 2 layer_norm, 3 gelu, 4 silu */
    int64_t a, b, c, d; /* attention B, Lq, Lk, D; gn N, C, HW, silu; ln rows, D; act n */
} bench_case;

static const bench_case cases[] = {
    { "attn_4096_d40", 0, 16, 4096, 4096, 40 },
    { "attn_1024_d80", 0, 16, 1024, 1024, 80 },
    { "xattn_4096x77_d40", 0, 16, 4096, 77, 40 },
    { "gn_silu_2x320x64x64", 1, 2, 320, 64 * 64, 1 },
    { "gn_1x128x512x512", 1, 1, 128, 512 * 512, 0 },
    { "ln_4096x320", 2, 4096, 320, 0, 0 },
    { "gelu_10M", 3, 10000000, 0, 0, 0 },
    { "silu_10M", 4, 10000000, 0, 0, 0 },
};
#define NCASES (sizeof cases / sizeof *cases)

static double run_case(const bench_case *c)
{
    float *x = NULL, *y = NULL, *k = NULL, *v = NULL, *w = NULL, *b = NULL;
    int64_t n = 0;
    switch (c->kind) {
    case 0:
        x = rnd(c->a * c->b * c->d); k = rnd(c->a * c->c * c->d); v = rnd(c->a * c->c * c->d);
        y = rnd(c->a * c->b * c->d);
        break;
    case 1: n = c->a * c->b * c->c; x = rnd(n); y = rnd(n); w = rnd(c->b); b = rnd(c->b); break;
    case 2: n = c->a * c->b; x = rnd(n); y = rnd(n); w = rnd(c->b); b = rnd(c->b); break;
    default: n = c->a; x = rnd(n); y = rnd(n); break;
    }
    double best = 1e30, t_end = 0;
    for (int rep = -1;; rep++) {
        double t = now();
        switch (c->kind) {
        case 0:
            if (kiln_cpu_attention(y, x, k, v, c->a, c->b, c->c, c->d, c->d, 1.0f / 6.3245553f, 0) != KILN_OK) {
                fprintf(stderr, "bench_nn: %s: %s\n", c->name, kiln_last_error());
                exit(1);
            }
            break;
        case 1: kiln_cpu_group_norm(y, x, w, b, c->a, c->b, c->c, 32, 1e-6f, (int)c->d); break;
        case 2: kiln_cpu_layer_norm(y, x, w, b, c->a, c->b, 1e-5f); break;
        case 3: kiln_cpu_gelu(y, x, n); break;
        default: kiln_cpu_silu(y, x, n); break;
        }
        t = now() - t;
        if (rep < 0) { t_end = now() + 1.0; continue; }
        if (t < best) best = t;
        if (rep >= 2 && (now() > t_end || rep >= 49)) break;
    }
    free(x); free(y); free(k); free(v); free(w); free(b);
    return best;
}

int main(void)
{
    int threads = kiln_cpu_threads();
    double torch_sec[NCASES];
    for (size_t i = 0; i < NCASES; i++) torch_sec[i] = -1;

    const char *no = getenv("KILN_BENCH_NO_TORCH");
    if (!(no && *no == '1')) {
        char cmd[256];
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 tests/bench/torch_nn.py %d 2>/dev/null", threads);
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

    printf("bench_nn: %d threads (KILN_THREADS), best of >= 3 runs\n", threads);
    printf("%-22s %10s %12s %10s %8s\n", "case", "kiln ms", "rate", "torch ms", "ratio");
    for (size_t i = 0; i < NCASES; i++) {
        const bench_case *c = &cases[i];
        double t = run_case(c);
        char rate[32];
        if (c->kind == 0)
            snprintf(rate, sizeof rate, "%.1f GF/s", 4.0 * (double)(c->a * c->b * c->c * c->d) / t * 1e-9);
        else {
            double n = c->kind == 1 ? (double)(c->a * c->b * c->c) : c->kind == 2 ? (double)(c->a * c->b) : (double)c->a;
            snprintf(rate, sizeof rate, "%.1f GB/s", 8.0 * n / t * 1e-9);
        }
        if (torch_sec[i] > 0)
            printf("%-22s %10.2f %12s %10.2f %7.2fx\n", c->name, t * 1e3, rate, torch_sec[i] * 1e3, t / torch_sec[i]);
        else
            printf("%-22s %10.2f %12s %10s %8s\n", c->name, t * 1e3, rate, "n/a", "");
    }
    printf("ratio = kiln time / torch time (lower is better)\n");
    for (size_t i = 0; i < NCASES; i++) {
        const bench_case *c = &cases[i];
        if (c->kind != 0) continue;
        double scratch = (double)kiln_cpu_attention_scratch_bytes(c->d, c->d);
        double lxl = 4.0 * (double)(c->a * c->b * c->c);
        printf("%s: attention scratch %.2f MiB (all threads) vs %.1f MiB for the B x Lq x Lk scores torch holds "
               "(%.1f MiB per head)\n", c->name, scratch / 1048576.0, lxl / 1048576.0, lxl / (double)c->a / 1048576.0);
    }
    return 0;
}

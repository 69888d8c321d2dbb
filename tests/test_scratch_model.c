/* test_scratch_model.c - the model of the kernels' own scratch that dry runs use: the
 * CPU kernels' host scratch never exceeds the bound a dry run notes for the call (each
 * kernel run on real data, its scratch counted by gemm_scratch.c), and the CUDA
 * kernels' scratch and cuBLAS workspace are taken on meta as cuda_workspace.h sizes
 * them, never smaller than what any GPU's kernels would take. */
#define _POSIX_C_SOURCE 200809L
#include "backend.h"
#include "cpu_kernels.h"
#include "meta.h"
#include "ops.h"
#include "test.h"
#include "../kernels/cuda/cuda_workspace.h"

#define MiB ((size_t)1 << 20)

static float *filled(size_t n, float v)
{
    float *p = malloc((n ? n : 1) * sizeof *p);
    for (size_t i = 0; p && i < n; i++) p[i] = v * (float)((i % 7) + 1);
    return p;
}

/* The peak of scratch in use over one call, against the bound. */
#define MEASURE(label, bound, call) do { \
    kiln_cpu_scratch_stats(1); \
    call; \
    size_t used_ = kiln_cpu_scratch_stats(0).peak_in_use, bound_ = (bound); \
    CHECK(used_ <= bound_, "%s: %zu bytes of scratch in use, bound %zu", label, used_, bound_); \
    checked++; \
    if (used_ > 0) nonzero++; \
} while (0)

static void t_cpu_conv_bounds(void)
{
    /* depthwise, few output channels, 1x1, 3x3 from a 4x4 to a 64x64 image (the
     * few-tiles and Winograd paths), strided, grouped, f16 weights */
    struct { int64_t n, c, h, w, k, r, stride, pad, groups; kiln_dtype wdt; } cases[] = {
        {1, 8, 16, 16, 8, 3, 1, 1, 8, KILN_F32},    {2, 16, 12, 12, 3, 3, 1, 1, 1, KILN_F32},
        {1, 32, 16, 16, 64, 1, 1, 0, 1, KILN_F32},  {2, 96, 4, 4, 96, 3, 1, 1, 1, KILN_F32},
        {2, 64, 8, 8, 64, 3, 1, 1, 1, KILN_F16},    {1, 64, 32, 32, 64, 3, 1, 1, 1, KILN_F32},
        {1, 64, 64, 64, 64, 3, 1, 1, 1, KILN_BF16}, {2, 32, 48, 48, 32, 3, 1, 1, 1, KILN_F32},
        {1, 16, 33, 31, 24, 3, 2, 1, 1, KILN_F32},  {1, 32, 20, 20, 32, 3, 1, 1, 4, KILN_F16},
        {1, 4, 64, 64, 32, 3, 1, 1, 1, KILN_F32},   {1, 128, 16, 16, 128, 3, 1, 1, 1, KILN_F16},
    };
    int checked = 0, nonzero = 0;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_conv2d_params p = {cases[i].n, cases[i].c, cases[i].h, cases[i].w, cases[i].k, cases[i].r, cases[i].r,
                                cases[i].stride, cases[i].stride, cases[i].pad, cases[i].pad, 1, 1, cases[i].groups,
                                0, 0, 0, 0.0f, NULL, NULL};
        if (kiln_conv2d_out_size(&p)) { CHECK(0, "case %zu: %s", i, kiln_last_error()); continue; }
        size_t nx = (size_t)(p.n * p.c * p.h * p.w), nw = (size_t)(p.k * (p.c / p.groups) * p.r * p.s);
        size_t ny = (size_t)(p.n * p.k * p.oh * p.ow);
        float *x = filled(nx, 0.01f), *wf = filled(nw, 0.02f), *y = malloc(ny * sizeof *y);
        uint16_t *wh = malloc(nw * sizeof *wh);
        for (size_t j = 0; j < nw; j++) wh[j] = cases[i].wdt == KILN_BF16 ? 0x3c00 : 0x2000;
        const void *w = cases[i].wdt == KILN_F32 ? (const void *)wf : (const void *)wh;
        char label[96];
        snprintf(label, sizeof label, "conv %zu [%lld,%lld,%lld,%lld] k%lld r%lld", i, (long long)p.n,
                 (long long)p.c, (long long)p.h, (long long)p.w, (long long)p.k, (long long)p.r);
        MEASURE(label, kiln_cpu_conv2d_scratch_bound(&p, cases[i].wdt),
                CHECK(kiln_cpu_conv2d(y, x, w, cases[i].wdt, NULL, &p) == KILN_OK, "%s", kiln_last_error()));
        free(x); free(wf); free(wh); free(y);
    }
    /* the decoders' upsampling convolution, fused and not */
    int64_t up[][4] = {{1, 64, 32, 32}, {1, 32, 8, 8}, {2, 64, 16, 16}};
    for (size_t i = 0; i < sizeof up / sizeof up[0]; i++) {
        int64_t N = up[i][0], C = up[i][1], H = up[i][2], W = up[i][3], K = C;
        float *x = filled((size_t)(N * C * H * W), 0.01f), *w = filled((size_t)(K * C * 9), 0.02f);
        float *y = malloc((size_t)(N * K * 4 * H * W) * sizeof *y);
        char label[64];
        snprintf(label, sizeof label, "conv up2 %zu", i);
        MEASURE(label, kiln_cpu_conv2d_up2_scratch_bound(N, C, H, W, K, KILN_F32),
                CHECK(kiln_cpu_conv2d_up2(y, x, w, KILN_F32, NULL, N, C, H, W, K) == KILN_OK, "%s", kiln_last_error()));
        free(x); free(w); free(y);
    }
    CHECK(nonzero >= checked / 2, "only %d of %d calls took scratch: the count does not see them", nonzero, checked);
}

static void t_cpu_gemm_attention_bounds(void)
{
    int checked = 0, nonzero = 0;
    int64_t mnk[][3] = {{1, 320, 320}, {64, 640, 320}, {4096, 320, 320}, {77, 768, 768}, {512, 1280, 5120}};
    for (size_t i = 0; i < sizeof mnk / sizeof mnk[0]; i++) {
        int64_t M = mnk[i][0], N = mnk[i][1], K = mnk[i][2];
        float *x = filled((size_t)(M * K), 0.01f), *wf = filled((size_t)(N * K), 0.01f), *y = malloc((size_t)(M * N) * 4);
        uint16_t *wh = malloc((size_t)(N * K) * sizeof *wh);
        for (int64_t j = 0; j < N * K; j++) wh[j] = 0x2000;
        char label[64];
        snprintf(label, sizeof label, "linear f32 %lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
        MEASURE(label, kiln_cpu_gemm_scratch_bound(M, N, K, KILN_F32, 0),
                CHECK(kiln_cpu_linear(y, x, wf, KILN_F32, NULL, M, N, K) == KILN_OK, "%s", kiln_last_error()));
        snprintf(label, sizeof label, "linear f16 %lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
        MEASURE(label, kiln_cpu_gemm_scratch_bound(M, N, K, KILN_F16, 0),
                CHECK(kiln_cpu_linear(y, x, wh, KILN_F16, NULL, M, N, K) == KILN_OK, "%s", kiln_last_error()));
        free(x); free(wf); free(wh); free(y);
    }
    /* batched products (attention's scores outside the fused kernel) */
    int64_t bmnk[][4] = {{16, 64, 64, 40}, {2, 1024, 1024, 64}, {40, 77, 40, 77}};
    for (size_t i = 0; i < sizeof bmnk / sizeof bmnk[0]; i++) {
        int64_t B = bmnk[i][0], M = bmnk[i][1], N = bmnk[i][2], K = bmnk[i][3];
        float *a = filled((size_t)(B * M * K), 0.01f), *b = filled((size_t)(B * K * N), 0.01f);
        float *c = malloc((size_t)(B * M * N) * 4);
        char label[64];
        snprintf(label, sizeof label, "matmul %lld x %lldx%lldx%lld", (long long)B, (long long)M, (long long)N,
                 (long long)K);
        MEASURE(label, kiln_cpu_gemm_scratch_bound(M, N, K, KILN_F32, 1),
                kiln_cpu_gemm_batched_f32(0, 0, B, M, N, K, 1.0f, a, K, M * K, b, N, K * N, 0.0f, c, N, M * N));
        free(a); free(b); free(c);
    }
    int64_t att[][5] = {{16, 64, 64, 40, 40}, {8, 1024, 1024, 64, 64}, {16, 4096, 77, 40, 40}, {2, 77, 77, 64, 64}};
    for (size_t i = 0; i < sizeof att / sizeof att[0]; i++) {
        int64_t B = att[i][0], Lq = att[i][1], Lk = att[i][2], D = att[i][3], Dv = att[i][4];
        float *q = filled((size_t)(B * Lq * D), 0.01f), *k = filled((size_t)(B * Lk * D), 0.01f);
        float *v = filled((size_t)(B * Lk * Dv), 0.01f), *o = malloc((size_t)(B * Lq * Dv) * 4);
        char label[64];
        snprintf(label, sizeof label, "attention %lld x %lld x %lld", (long long)B, (long long)Lq, (long long)Lk);
        MEASURE(label, kiln_cpu_attention_scratch_bound(B, Lq, Lk, D, Dv),
                CHECK(kiln_cpu_attention(o, q, k, v, B, Lq, Lk, D, Dv, 0.125f, 0) == KILN_OK, "%s", kiln_last_error()));
        free(q); free(k); free(v); free(o);
    }
    CHECK(nonzero >= checked / 2, "only %d of %d calls took scratch", nonzero, checked);
}

/* The scratch count in the cpu device's statistics, reset with its peak. */
static void t_cpu_statistics(void)
{
    kiln_device *cpu = kiln_device_cpu();
    int64_t sx[4] = {1, 64, 32, 32}, sw[4] = {64, 64, 3, 3};
    kiln_tensor *x = NULL, *w = NULL, *y = NULL;
    kiln_conv_opts o = {{1, 1}, {1, 1}, {1, 1}, 1, 0, 0, 0, NULL};
    if (kiln_tensor_new(cpu, KILN_F32, 4, sx, &x) || kiln_tensor_new(cpu, KILN_F32, 4, sw, &w)) {
        CHECK(0, "%s", kiln_last_error());
        kiln_tensor_free(x);
        return;
    }
    kiln_tensor_fill(x, 0.5);
    kiln_tensor_fill(w, 0.01);
    kiln_device_empty_cache(cpu);
    kiln_device_reset_peak(cpu);
    CHECK(kiln_device_stats(cpu).workspace_peak == 0, "workspace_peak %llu after a reset with nothing in use",
          (unsigned long long)kiln_device_stats(cpu).workspace_peak);
    CHECK(kiln_op_conv2d(x, w, NULL, &o, &y) == KILN_OK, "%s", kiln_last_error());
    kiln_mem_stats s = kiln_device_stats(cpu);
    CHECK(s.workspace_peak > 0, "a 64-channel 3x3 convolution took no counted scratch");
    CHECK(s.workspace >= s.workspace_peak, "held %llu < peak in use %llu", (unsigned long long)s.workspace,
          (unsigned long long)s.workspace_peak);
    kiln_device_empty_cache(cpu);
    CHECK(kiln_device_stats(cpu).workspace == 0, "scratch held after empty_cache: %llu",
          (unsigned long long)kiln_device_stats(cpu).workspace);
    CHECK(kiln_device_stats(cpu).workspace_peak == s.workspace_peak, "empty_cache changed the peak");
    kiln_device_reset_peak(cpu);
    CHECK(kiln_device_stats(cpu).workspace_peak == 0, "peak not reset");
    kiln_tensor_free(x);
    kiln_tensor_free(w);
    kiln_tensor_free(y);
}

/* ---- CUDA's model, on meta ---- */

/* Whatever the GPU (its multiprocessor count), the kernels' partial sums are never
 * larger than the blocks a dry run takes for them. */
static void t_cuda_formulas(void)
{
    int64_t rows[] = {1, 2, 3, 7, 64, 77, 512, 4096, 65535, 65536, 1 << 20};
    int64_t lens[] = {0, 1, 100, 2047, 2048, 4097, 65536, 1 << 20, (int64_t)1 << 26};
    int sms[] = {0, 1, 16, 46, 80, 108, 132, 144, 170, 1024};
    long bad = 0;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        for (size_t j = 0; j < sizeof lens / sizeof lens[0]; j++)
            for (size_t k = 0; k < sizeof sms / sizeof sms[0]; k++) {
                int64_t r = rows[i], L = lens[j];
                if (kiln_cuda_stats_part_bytes(r, L, sms[k]) > kiln_cuda_stats_part_bytes(r, L, KILN_CUDA_SM_MODEL_MAX))
                    bad++;
                if (kiln_cuda_reduce_part_bytes(r, L, sms[k]) > kiln_cuda_reduce_part_bytes(r, L, KILN_CUDA_SM_MODEL_MAX))
                    bad++;
            }
    CHECK(bad == 0, "%ld shapes where a GPU's kernel takes more than the model", bad);
    /* hand-computed: 2 rows of 2^20 on an H100 (132 SMs): 264 chunks of 3 floats a row */
    CHECK(kiln_cuda_stats_part_bytes(2, 1 << 20, 132) == 2 * 264 * 12, "%zu", kiln_cuda_stats_part_bytes(2, 1 << 20, 132));
    CHECK(kiln_cuda_stats_part_bytes(2, 1 << 20, KILN_CUDA_SM_MODEL_MAX) == 2 * 512 * 12, "%zu",
          kiln_cuda_stats_part_bytes(2, 1 << 20, KILN_CUDA_SM_MODEL_MAX));
    CHECK(kiln_cuda_stats_bytes(64) == 512, "%zu", kiln_cuda_stats_bytes(64));
    CHECK(kiln_cuda_reduce_part_bytes(1, 1 << 16, 132) == 16 * 24, "%zu", kiln_cuda_reduce_part_bytes(1, 1 << 16, 132));
    CHECK(kiln_cuda_reduce_part_bytes(70000, 1 << 16, 132) == 0, "rows past the grid take no parts");
    CHECK(kiln_cuda_reduce_part_bytes(4096, 100, 132) == 0, "one chunk a row takes no parts");
    CHECK(kiln_cuda_blas_workspace_bytes(9) == 32 * MiB && kiln_cuda_blas_workspace_bytes(8) == 4 * MiB,
          "cuBLAS workspace sizes");
    CHECK(kiln_cuda_conv_workspace_cap(MiB, MiB) == 64 * MiB && kiln_cuda_conv_workspace_cap(100 * MiB, 28 * MiB) == 128 * MiB,
          "convolution workspace cap");
}

static int fake_supports(kiln_op op, kiln_dtype dt)
{
    (void)dt;
    return op >= 0 && op < KILN_OP_COUNT;
}

/* A stand-in for a CUDA device: meta models a device through its backend's name and
 * its allocator's settings, so a table named "cuda" is all a dry run needs. */
static const kiln_backend fake_cuda_backend = {.name = "cuda", .supports = fake_supports};

static kiln_device *fake_cuda(void)
{
    static kiln_device d;
    if (!d.alloc) {
        d.type = KILN_DEV_CUDA;
        snprintf(d.name, sizeof d.name, "cuda:9");
        d.alloc = kiln_allocator_new("cuda:9", kiln_meta_raw_memory(), 0, 1);
        d.backend = &fake_cuda_backend;
        d.total_memory = (uint64_t)80 << 30;
    }
    return &d;
}

static kiln_tensor *meta_tensor(int ndim, const int64_t *shape)
{
    kiln_tensor *t = NULL;
    CHECK(kiln_tensor_new(kiln_device_meta(), KILN_F32, ndim, shape, &t) == KILN_OK, "%s", kiln_last_error());
    return t;
}

static void t_cuda_on_meta(void)
{
    kiln_device *meta = kiln_device_meta();
    if (!meta) { SKIP("no meta device"); return; }
    CHECK(kiln_meta_begin(fake_cuda(), 0) == KILN_OK, "%s", kiln_last_error());
    int64_t sx[4] = {2, 64, 32, 32}, sg[1] = {64};
    kiln_tensor *x = meta_tensor(4, sx), *g = meta_tensor(1, sg), *y = NULL;
    if (!x || !g) { kiln_tensor_free(x); kiln_tensor_free(g); kiln_meta_end(); return; }
    uint64_t before = kiln_device_stats(meta).allocated;
    /* the first op starts the context: cuBLAS's workspace is held from then on */
    CHECK(kiln_op_group_norm(x, 32, g, g, 1e-5, 0, &y) == KILN_OK, "%s", kiln_last_error());
    kiln_mem_stats s = kiln_device_stats(meta);
    CHECK(s.workspace == KILN_CUDA_BLAS_WORKSPACE_MAX, "cuBLAS workspace on meta: %llu", (unsigned long long)s.workspace);
    CHECK(s.allocated >= before + KILN_CUDA_BLAS_WORKSPACE_MAX + kiln_tensor_nbytes(y), "allocated %llu",
          (unsigned long long)s.allocated);
    kiln_tensor_free(y);
    y = NULL;
    /* GroupNorm's statistics and partial sums on top of its output, then given back */
    kiln_device_reset_peak(meta);
    uint64_t base = kiln_device_stats(meta).allocated;
    CHECK(kiln_op_group_norm(x, 32, g, g, 1e-5, 0, &y) == KILN_OK, "%s", kiln_last_error());
    s = kiln_device_stats(meta);
    uint64_t scratch = kiln_cuda_stats_bytes(64) + kiln_cuda_stats_part_bytes(64, 2048, KILN_CUDA_SM_MODEL_MAX);
    CHECK(s.peak_allocated >= base + kiln_tensor_nbytes(y) + scratch, "peak %llu < %llu + output + %llu of scratch",
          (unsigned long long)s.peak_allocated, (unsigned long long)base, (unsigned long long)scratch);
    CHECK(s.allocated == base + kiln_tensor_nbytes(y), "the scratch was not given back");
    kiln_tensor_free(y);
    y = NULL;
    /* a convolution's cuDNN workspace: the cap where nothing limits it */
    int64_t sw[4] = {64, 64, 3, 3};
    kiln_tensor *w = meta_tensor(4, sw);
    kiln_conv_opts o = {{1, 1}, {1, 1}, {1, 1}, 1, 0, 0, 0, NULL};
    kiln_device_reset_peak(meta);
    base = kiln_device_stats(meta).allocated;
    CHECK(w && kiln_op_conv2d(x, w, NULL, &o, &y) == KILN_OK, "%s", kiln_last_error());
    s = kiln_device_stats(meta);
    CHECK(s.peak_allocated >= base + 64 * MiB, "conv workspace on meta: peak %llu, base %llu",
          (unsigned long long)s.peak_allocated, (unsigned long long)base);
    kiln_tensor_free(y);
    y = NULL;
    /* empty_cache gives cuBLAS's workspace back, as on the device */
    kiln_device_empty_cache(meta);
    CHECK(kiln_device_stats(meta).workspace == 0, "workspace kept after empty_cache");
    kiln_tensor_free(w);
    kiln_tensor_free(x);
    kiln_tensor_free(g);
    CHECK(kiln_meta_end() == 0, "left on meta after the dry run");

    /* under a budget the workspace takes only what fits without evicting: the budget holds */
    uint64_t budget = 40 * MiB;
    CHECK(kiln_meta_begin(fake_cuda(), budget) == KILN_OK, "%s", kiln_last_error());
    x = meta_tensor(4, sx);
    w = meta_tensor(4, sw);
    if (x && w) {
        CHECK(kiln_op_conv2d(x, w, NULL, &o, &y) == KILN_OK, "%s", kiln_last_error());
        s = kiln_device_stats(meta);
        CHECK(s.peak_reserved <= budget, "reserved %llu over the budget", (unsigned long long)s.peak_reserved);
        CHECK(s.workspace == KILN_CUDA_BLAS_WORKSPACE_MAX, "cuBLAS's 32 MiB fit in 40: %llu",
              (unsigned long long)s.workspace);
    }
    kiln_tensor_free(y);
    kiln_tensor_free(w);
    kiln_tensor_free(x);
    CHECK(kiln_meta_end() == 0, "left on meta after the second dry run");
}

int main(void)
{
    RUN(t_cpu_conv_bounds);
    RUN(t_cpu_gemm_attention_bounds);
    RUN(t_cpu_statistics);
    RUN(t_cuda_formulas);
    RUN(t_cuda_on_meta);
    return test_summary();
}

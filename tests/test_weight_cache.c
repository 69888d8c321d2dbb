/* test_weight_cache.c - the CPU backend's caches of weights in the form its bf16 products
 * read (kernels/cpu/backend_cpu.c; device.h's derived caches): a linear layer's pair
 * slivers and a 3x3 convolution's few-tiles Winograd U (F(2,3) by default; F(4,3) and a
 * batch in groups of images with KILN_WINOGRAD_FEW_CACHE=all; channel counts off the
 * vector widths). Each against the same kernel without a cache, bit for bit, at the
 * call that fills the cache and the calls that read it; for a weight in mapped (wrapped)
 * memory too. And the policy: the cache is counted,
 * dropped by a write to the weight, not taken in memory mode low, limited per device
 * (kiln_device_set_derived_limit), and given back before anything else when an
 * allocation does not fit the budget — in memory mode high too, so a cache never costs
 * an out-of-memory error or an eviction. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"

#include "alloc.h"
#include "cpu_backend.h"
#include "cpu_internal.h"
#include "cpu_kernels.h"
#include "ops.h"
#include "precision.h"

#include <stdint.h>

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float uniform(void)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((int64_t)(rng >> 40) - (1 << 23)) / (float)(1 << 23);
}

static kiln_tensor *random_f32(int ndim, const int64_t *shape, float scale)
{
    kiln_tensor *t = NULL;
    CHECK(kiln_tensor_new(kiln_device_cpu(), KILN_F32, ndim, shape, &t) == KILN_OK, "f32 tensor");
    if (!t) return NULL;
    float *p = kiln_tensor_data(t);
    for (int64_t i = 0; i < kiln_tensor_numel(t); i++) p[i] = scale * uniform();
    return t;
}

static void fill_f16(uint16_t *p, int64_t n, float scale)
{
    for (int64_t i = 0; i < n; i++) p[i] = kiln_f32_to_f16(scale * uniform());
}

/* an f16 weight in the allocator (a loaded copy) */
static kiln_tensor *random_f16(int ndim, const int64_t *shape, float scale)
{
    kiln_tensor *t = NULL;
    CHECK(kiln_tensor_new(kiln_device_cpu(), KILN_F16, ndim, shape, &t) == KILN_OK, "f16 tensor");
    if (t) fill_f16(kiln_tensor_data(t), kiln_tensor_numel(t), scale);
    return t;
}

/* an f16 weight in memory the allocator does not own, as a mapped checkpoint's */
static void free_wrapped(kiln_storage *s) { free(s->data); }

static kiln_tensor *wrapped_f16(int ndim, const int64_t *shape, float scale)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    uint16_t *p = malloc((size_t)n * 2);
    fill_f16(p, n, scale);
    kiln_storage *s = kiln_storage_wrap(kiln_device_cpu(), p, (size_t)n * 2, free_wrapped, NULL);
    kiln_tensor *t = kiln_tensor_from_storage(s, 0, KILN_F16, ndim, shape, NULL);
    kiln_storage_release(s);
    return t;
}

static int same_bits(const kiln_tensor *a, const float *want, int64_t n)
{
    return a && !memcmp(kiln_tensor_data(a), want, (size_t)n * sizeof(float));
}

static int bf16_ready(void)
{
    kiln_precision_set(KILN_PREC_BF16);
    if (kiln_cpu_bf16_active()) return 1;
    kiln_precision_set(KILN_PREC_F32);
    return 0;
}

/* Linear layers: the pairs are the per-call rounding's, the sums the same kernel's. */
static void t_linear_pairs(void)
{
    if (!bf16_ready()) { SKIP("no AVX-512: the bf16 products (and their weight caches) do not run here"); return; }
    static const int64_t shapes[][3] = {{64, 96, 80}, {300, 1000, 321}, {17, 96, 41}};
    for (int s = 0; s < 3; s++) {
        int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        int64_t xs[2] = {M, K}, ws[2] = {N, K};
        for (int mapped = 0; mapped < 2; mapped++) {
            kiln_tensor *x = random_f32(2, xs, 1.0f), *b = random_f32(1, &N, 0.5f);
            kiln_tensor *w = mapped ? wrapped_f16(2, ws, 0.2f) : random_f16(2, ws, 0.2f), *y1 = NULL, *y2 = NULL;
            float *want = malloc((size_t)(M * N) * sizeof *want);
            CHECK(kiln_cpu_linear(want, kiln_tensor_data(x), kiln_tensor_data(w), KILN_F16, kiln_tensor_data(b), M, N,
                                  K) == KILN_OK, "per-call product");
            uint64_t key[4];
            size_t bytes = kiln_cpu_bf16_cache_plan(w, M, key);
            CHECK(bytes == kiln_cpu_bf16_weight_pairs_bytes(N, K), "%lldx%lldx%lld: planned %zu bytes", (long long)M,
                  (long long)N, (long long)K, bytes);
            CHECK(kiln_op_linear(x, w, b, &y1) == KILN_OK, "first product");
            CHECK(kiln_storage_derived_bytes(w->storage) == bytes, "%s weight: the pairs kept (%zu bytes, want %zu)",
                  mapped ? "mapped" : "loaded", kiln_storage_derived_bytes(w->storage), bytes);
            CHECK(kiln_op_linear(x, w, b, &y2) == KILN_OK, "second product");
            CHECK(same_bits(y1, want, M * N), "%lldx%lldx%lld: the product filling the cache has the per-call bits",
                  (long long)M, (long long)N, (long long)K);
            CHECK(same_bits(y2, want, M * N), "%lldx%lldx%lld: the product reading it has the per-call bits",
                  (long long)M, (long long)N, (long long)K);
            kiln_tensor_free(y1); kiln_tensor_free(y2);
            kiln_tensor_free(x); kiln_tensor_free(b); kiln_tensor_free(w);
            free(want);
        }
    }
    /* too few rows for bf16 products: no cache */
    int64_t ws[2] = {64, 64};
    kiln_tensor *w = random_f16(2, ws, 0.2f);
    uint64_t key[4];
    CHECK(kiln_cpu_bf16_cache_plan(w, 8, key) == 0, "8 rows run in f32: no cache");
    kiln_precision_set(KILN_PREC_F32);
    CHECK(kiln_cpu_bf16_cache_plan(w, 256, key) == 0, "precision f32: no cache");
    kiln_tensor_free(w);
}

/* Convolutions on the few-tiles Winograd path: U in the cache, the same bits. */
static void t_conv_few(void)
{
    if (!bf16_ready()) { SKIP("no AVX-512: the bf16 products (and their weight caches) do not run here"); return; }
    /* n, c, h, w, k: F(4,3) at 16x16; F(2,3) at 8x8; 2 images of 64 tiles, one a group
     * (the second reads what the first wrote); channels that are no multiple of 16 or
     * 32; 32x32 with large weights (64 tiles) */
    static const int64_t shapes[][5] = {{1, 64, 16, 16, 64}, {1, 64, 8, 8, 96}, {2, 512, 32, 32, 1024},
                                        {1, 80, 16, 13, 72}, {1, 272, 8, 8, 300}, {1, 640, 32, 32, 1024}};
    /* by default only F(2,3)'s U is kept (8x8 images): the others with
     * KILN_WINOGRAD_FEW_CACHE=all */
    for (int s = 0; s < 6; s++) {
        const int64_t *q = shapes[s];
        kiln_conv2d_params d = {q[0], q[1], q[2], q[3], q[4], 3, 3, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0.0f, NULL, NULL};
        int variant = 0, f23 = q[2] == 8;
        unsetenv("KILN_WINOGRAD_FEW_CACHE");
        CHECK(kiln_conv2d_out_size(&d) == KILN_OK && (kiln_cpu_conv2d_weight_cache_plan(&d, KILN_F16, &variant) > 0) == f23,
              "shape %d: by default a cache %s", s, f23 ? "(F(2,3))" : "only with KILN_WINOGRAD_FEW_CACHE=all");
        setenv("KILN_WINOGRAD_FEW_CACHE", "none", 1);
        CHECK(kiln_cpu_conv2d_weight_cache_plan(&d, KILN_F16, &variant) == 0, "shape %d: none", s);
        setenv("KILN_WINOGRAD_FEW_CACHE", "all", 1);
        int64_t xs[4] = {q[0], q[1], q[2], q[3]}, ws[4] = {q[4], q[1], 3, 3};
        kiln_conv2d_params p = {q[0], q[1], q[2], q[3], q[4], 3, 3, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0.0f, NULL, NULL};
        CHECK(kiln_conv2d_out_size(&p) == KILN_OK, "out size");
        kiln_tensor *x = random_f32(4, xs, 1.0f), *b = random_f32(1, &q[4], 0.5f);
        kiln_tensor *w = s % 2 ? wrapped_f16(4, ws, 0.05f) : random_f16(4, ws, 0.05f), *y1 = NULL, *y2 = NULL;
        int64_t n = q[0] * q[4] * p.oh * p.ow;
        float *want = malloc((size_t)n * sizeof *want);
        CHECK(kiln_cpu_conv2d(want, kiln_tensor_data(x), kiln_tensor_data(w), KILN_F16, kiln_tensor_data(b), &p) ==
                  KILN_OK, "convolution without a cache");
        uint64_t key[4];
        size_t bytes = kiln_cpu_conv2d_cache_plan(w, &p, key);
        CHECK(bytes > 0, "shape %d: the few-tiles path keeps its U", s);
        kiln_conv_opts o = {.stride = {1, 1}, .padding = {1, 1}, .dilation = {1, 1}, .groups = 1};
        CHECK(kiln_op_conv2d(x, w, b, &o, &y1) == KILN_OK, "first convolution");
        CHECK(kiln_storage_derived_bytes(w->storage) == bytes, "shape %d: U kept (%zu bytes, want %zu)", s,
              kiln_storage_derived_bytes(w->storage), bytes);
        CHECK(kiln_op_conv2d(x, w, b, &o, &y2) == KILN_OK, "second convolution");
        CHECK(same_bits(y1, want, n), "shape %d: the convolution filling the cache has the uncached bits", s);
        CHECK(same_bits(y2, want, n), "shape %d: the convolution reading it has the uncached bits", s);
        kiln_tensor_free(y1); kiln_tensor_free(y2);
        kiln_tensor_free(x); kiln_tensor_free(b); kiln_tensor_free(w);
        free(want);
    }
    unsetenv("KILN_WINOGRAD_FEW_CACHE");
    kiln_precision_set(KILN_PREC_F32);
}

/* A write drops the cache; memory mode low takes none; the device's limit holds. */
static void t_policy(void)
{
    if (!bf16_ready()) { SKIP("no AVX-512: the bf16 products (and their weight caches) do not run here"); return; }
    kiln_device *dev = kiln_device_cpu();
    const int64_t M = 64, N = 256, K = 512;
    int64_t xs[2] = {M, K}, ws[2] = {N, K};
    kiln_tensor *x = random_f32(2, xs, 1.0f), *w = random_f16(2, ws, 0.2f), *y = NULL;
    size_t bytes = kiln_cpu_bf16_weight_pairs_bytes(N, K);
    CHECK(kiln_op_linear(x, w, NULL, &y) == KILN_OK, "product");
    CHECK(kiln_storage_derived_bytes(w->storage) == bytes, "cached");
    uint64_t held = __atomic_load_n(&dev->derived_bytes, __ATOMIC_RELAXED);
    CHECK(held >= bytes, "counted in the device's cache bytes: %llu", (unsigned long long)held);
    kiln_tensor_free(y); y = NULL;
    CHECK(kiln_tensor_fill(w, 0.0) == KILN_OK, "fill");
    CHECK(kiln_storage_derived_bytes(w->storage) == 0, "a write drops the cache");
    CHECK(__atomic_load_n(&dev->derived_bytes, __ATOMIC_RELAXED) == held - bytes, "and its count");
    CHECK(kiln_op_linear(x, w, NULL, &y) == KILN_OK, "product over the new values");
    CHECK(y && ((float *)kiln_tensor_data(y))[0] == 0.0f && ((float *)kiln_tensor_data(y))[M * N - 1] == 0.0f,
          "zero weights: zero output");
    kiln_tensor_free(y); y = NULL;
    /* low: none */
    kiln_storage_drop_derived(w->storage);
    kiln_memory_mode old = kiln_memory_mode_get();
    kiln_memory_mode_set(KILN_MEM_LOW);
    CHECK(kiln_op_linear(x, w, NULL, &y) == KILN_OK, "product in mode low");
    CHECK(kiln_storage_derived_bytes(w->storage) == 0, "mode low keeps no cache");
    kiln_memory_mode_set(old);
    kiln_tensor_free(y); y = NULL;
    /* the limit: 0 takes none; a lower limit drops what is over it */
    uint64_t limit = dev->derived_limit;
    kiln_device_set_derived_limit(dev, 0);
    CHECK(kiln_op_linear(x, w, NULL, &y) == KILN_OK, "product with no room for caches");
    CHECK(kiln_storage_derived_bytes(w->storage) == 0, "limit 0: no cache");
    kiln_tensor_free(y); y = NULL;
    kiln_device_set_derived_limit(dev, UINT64_MAX);
    CHECK(kiln_op_linear(x, w, NULL, &y) == KILN_OK, "product");
    CHECK(kiln_storage_derived_bytes(w->storage) == bytes, "cached again");
    kiln_device_set_derived_limit(dev, bytes / 2);
    CHECK(kiln_storage_derived_bytes(w->storage) == 0, "a limit below what is held drops it");
    kiln_device_set_derived_limit(dev, limit);
    kiln_tensor_free(y); kiln_tensor_free(x); kiln_tensor_free(w);
    kiln_precision_set(KILN_PREC_F32);
}

/* An allocation that does not fit the budget gets the caches' memory first: no OOM,
 * in mode high (which evicts nothing else) too. */
static void t_given_back_first(void)
{
    if (!bf16_ready()) { SKIP("no AVX-512: the bf16 products (and their weight caches) do not run here"); return; }
    kiln_device *dev = kiln_device_cpu();
    /* pairs of 16 MiB: larger than the free blocks the tests before leave */
    const int64_t M = 64, N = 4096, K = 2048;
    int64_t xs[2] = {M, K}, ws[2] = {N, K};
    size_t bytes = kiln_cpu_bf16_weight_pairs_bytes(N, K);
    kiln_memory_mode old = kiln_memory_mode_get();
    for (int high = 0; high < 2; high++) {
        kiln_memory_mode_set(high ? KILN_MEM_HIGH : KILN_MEM_NORMAL);
        kiln_tensor *x = random_f32(2, xs, 1.0f), *w = random_f16(2, ws, 0.2f), *y = NULL, *big = NULL;
        CHECK(kiln_op_linear(x, w, NULL, &y) == KILN_OK, "product");
        CHECK(kiln_storage_derived_bytes(w->storage) == bytes, "cached");
        kiln_allocator_empty_cache(dev->alloc);
        kiln_mem_stats st = kiln_device_stats(dev);
        /* a tensor larger than any free block and than the room the budget leaves, which
         * fits in the cache's block once that is given back */
        size_t want = (st.largest_free > bytes / 2 ? st.largest_free : bytes / 2) + 65536;
        CHECK(want <= bytes, "the free blocks (largest %llu bytes) leave the test room",
              (unsigned long long)st.largest_free);
        kiln_allocator_set_budget(dev->alloc, st.reserved + bytes / 2);
        int64_t bs[1] = {(int64_t)(want / 4)}; /* bytes of f32 */
        CHECK(kiln_tensor_new(dev, KILN_F32, 1, bs, &big) == KILN_OK, "%s: the allocation fits once the cache is gone",
              high ? "high" : "normal");
        CHECK(kiln_storage_derived_bytes(w->storage) == 0, "the cache was given back");
        CHECK(kiln_device_stats(dev).n_ooms == st.n_ooms, "no out-of-memory on the way");
        kiln_tensor_free(big);
        kiln_allocator_set_budget(dev->alloc, 0);
        kiln_tensor_free(y); kiln_tensor_free(x); kiln_tensor_free(w);
    }
    kiln_memory_mode_set(old);
    kiln_precision_set(KILN_PREC_F32);
}

int main(void)
{
    RUN(t_linear_pairs);
    RUN(t_conv_few);
    RUN(t_policy);
    RUN(t_given_back_first);
    kiln_precision_unset();
    return test_summary();
}

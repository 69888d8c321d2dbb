/* test_int8.c - the W8A8 linear layer (kernels/cpu/gemm_int8.c) against the rule it
 * states, reimplemented in numpy (tests/golden/gen_int8.py -> tests/golden/int8/): for
 * f16 weights and q8_0 weights (ggml's blocks, dequantized and quantized again per
 * group), the outputs within the f32 summation's rounding of the exact integer sums
 * (K not a multiple of 4 or 32 too); the error against the unquantized product within
 * the bound the kernel's header derives;
 * and kiln_cpu_linear under kiln.precision "int8" taking the int8 path where VNNI is
 * and falling back to the bf16 products where it is not (or is turned off). */
#define _POSIX_C_SOURCE 200809L
#include "test.h"

#include "cpu_internal.h"
#include "cpu_kernels.h"
#include "precision.h"
#include "safetensors.h"
#include "ops.h"
#include "alloc.h"

#include <stdint.h>

#define GOLDEN "tests/golden/int8/linear.safetensors"

static kiln_st_file *golden;

static const void *raw(const char *c, const char *t, kiln_dtype *dt)
{
    char name[64];
    snprintf(name, sizeof name, "%s.%s", c, t);
    int i = kiln_st_find(golden, name);
    CHECK(i >= 0, "%s missing from %s", name, GOLDEN);
    if (i < 0) return NULL;
    if (dt) *dt = golden->entries[i].dtype;
    return kiln_st_data(golden, i);
}

static const float *f32(const char *c, const char *t)
{
    kiln_dtype dt = KILN_F32;
    const void *p = raw(c, t, &dt);
    CHECK(!p || dt == KILN_F32, "%s.%s: dtype", c, t);
    return p && dt == KILN_F32 ? p : NULL;
}

static int has(const char *c, const char *t)
{
    char name[64];
    snprintf(name, sizeof name, "%s.%s", c, t);
    return kiln_st_find(golden, name) >= 0;
}

/* max over outputs of |y - want| / tol; > 1 fails */
static double worst(const float *y, const float *want, const float *mag, int64_t n, int64_t ng)
{
    double r = 0;
    for (int64_t i = 0; i < n; i++) {
        /* the f32 sum of ng scaled group sums: each sum's conversion to f32, the product
         * d_a d_w and the FMA rounded (2^-24 each, of the term or the partial sum): a few
         * 2^-24 (ng + 2) of the sum of magnitudes; the golden's own f32 storage 2^-24 |want| */
        double tol = 4.0 * (double)(ng + 2) * 0x1p-24 * mag[i] + 0x1p-23 * fabs(want[i]) + 1e-30;
        double e = fabs((double)y[i] - want[i]) / tol;
        if (e > r || isnan(e)) r = isnan(e) ? INFINITY : e;
    }
    return r;
}

#define NCASES 5
static const char *cases[NCASES] = {"edges", "square", "outlier", "oddk", "long"};

/* The case's sizes [M, N, K, G]; NULL (and a failure) when the golden was made for
 * another group length than the kernel's */
static const int64_t *sizes(const char *c)
{
    const int64_t *p = raw(c, "p", NULL);
    if (!p) return NULL;
    CHECK(p[3] == kiln_cpu_int8_group(p[2]), "%s: golden made for groups of %lld, the kernel takes %lld: rerun "
          "tests/golden/gen_int8.py", c, (long long)p[3], (long long)kiln_cpu_int8_group(p[2]));
    return p[3] == kiln_cpu_int8_group(p[2]) ? p : NULL;
}

static void t_int8_vs_rule(void)
{
    if (!kiln_cpu_has_vnni()) {
        SKIP("no AVX512-VNNI on this CPU: the int8 products do not run");
        return;
    }
    for (int ci = 0; ci < NCASES; ci++) {
        const char *c = cases[ci];
        const int64_t *p = sizes(c);
        const float *x = f32(c, "x"), *b = f32(c, "b"), *y16 = f32(c, "y16"), *m16 = f32(c, "mag16");
        const void *w16 = raw(c, "w16", NULL);
        if (!p || !x || !b || !y16 || !m16 || !w16) return;
        int64_t M = p[0], N = p[1], K = p[2], ng = (K + p[3] - 1) / p[3];
        float *y = malloc((size_t)(M * N) * sizeof *y);
        int rc = kiln_cpu_linear_int8(y, x, w16, KILN_F16, b, M, N, K);
        CHECK(rc == 0, "%s: f16 weights: rc %d", c, rc);
        double r = worst(y, y16, m16, M * N, ng);
        CHECK(r <= 1.0, "%s: f16 weights: off the rule's result by %.2fx the tolerance", c, r);
        if (getenv("KILN_TEST_VERBOSE")) printf("  %s: f16 weights, difference / tolerance %.3f\n", c, r);
        if (has(c, "wq")) { /* K a multiple of 32: the same weights as q8_0, requantized per group */
            const float *yq = f32(c, "yq"), *mq = f32(c, "magq");
            const void *wq = raw(c, "wq", NULL);
            if (!yq || !mq || !wq) { free(y); return; }
            rc = kiln_cpu_linear_int8(y, x, wq, KILN_Q8_0, b, M, N, K);
            CHECK(rc == 0, "%s: q8_0 weights: rc %d", c, rc);
            r = worst(y, yq, mq, M * N, ng);
            CHECK(r <= 1.0, "%s: q8_0 weights: off the rule's result by %.2fx the tolerance", c, r);
            if (getenv("KILN_TEST_VERBOSE")) printf("  %s: q8_0 weights, difference / tolerance %.3f\n", c, r);
        }
        free(y);
    }
}

/* The header's bound against the product of the unquantized operands (for q8_0 weights:
 * their dequantized values): sum_g (W_g/254 sum|x_k| + A_g/254 sum|w_k| + L_g A_g W_g /
 * 254^2), plus the f32 sums. */
static double bound_ratio(const char *c, const int64_t *p, const float *x, const float *w, const float *y,
                          const float *ye, double *mean_ratio)
{
    int64_t M = p[0], N = p[1], K = p[2], G = p[3];
    double ratio = 0, mean_err = 0, mean_bound = 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t n = 0; n < N; n++) {
            double bound = 0, mag = 0;
            for (int64_t k0 = 0; k0 < K; k0 += G) {
                int64_t len = K - k0 < G ? K - k0 : G;
                double A = 0, W = 0, sx = 0, sw = 0;
                for (int64_t k = k0; k < k0 + len; k++) {
                    double xv = fabs(x[i * K + k]), wv = fabs(w[n * K + k]);
                    A = xv > A ? xv : A; W = wv > W ? wv : W;
                    sx += xv; sw += wv;
                    mag += xv * wv;
                }
                bound += W / 254 * sx + A / 254 * sw + (double)len * A * W / (254.0 * 254.0);
            }
            int64_t ng = (K + G - 1) / G;
            bound += (double)(ng + 4) * 0x1p-22 * (mag + bound) + 0x1p-23 * fabs(ye[i * N + n]);
            double e = fabs((double)y[i * N + n] - ye[i * N + n]);
            if (e / bound > ratio) ratio = e / bound;
            mean_err += e; mean_bound += bound;
        }
    (void)c;
    *mean_ratio = mean_err / mean_bound;
    return ratio;
}

static void t_int8_error_bound(void)
{
    if (!kiln_cpu_has_vnni()) {
        SKIP("no AVX512-VNNI on this CPU");
        return;
    }
    for (int ci = 0; ci < NCASES; ci++) {
        const char *c = cases[ci];
        const int64_t *p = sizes(c);
        const float *x = f32(c, "x"), *b = f32(c, "b"), *ye = f32(c, "yexact");
        const void *w16 = raw(c, "w16", NULL);
        if (!p || !x || !b || !ye || !w16) return;
        int64_t M = p[0], N = p[1], K = p[2];
        float *w = malloc((size_t)(N * K) * sizeof *w), *y = malloc((size_t)(M * N) * sizeof *y);
        kiln_to_f32(w, w16, KILN_F16, (size_t)(N * K));
        CHECK(kiln_cpu_linear_int8(y, x, w16, KILN_F16, b, M, N, K) == 0, "%s: rc", c);
        double mean, ratio = bound_ratio(c, p, x, w, y, ye, &mean);
        CHECK(ratio <= 1.0, "%s: error %.2fx the bound", c, ratio);
        if (getenv("KILN_TEST_VERBOSE"))
            printf("  %s: worst error / bound %.3f, mean error / mean bound %.3f\n", c, ratio, mean);
        if (has(c, "wq")) { /* q8_0: against its own dequantized values, the requantization's error */
            const float *yqe = f32(c, "yqexact");
            const void *wq = raw(c, "wq", NULL);
            if (!yqe || !wq) { free(w); free(y); return; }
            kiln_to_f32(w, wq, KILN_Q8_0, (size_t)(N * K));
            CHECK(kiln_cpu_linear_int8(y, x, wq, KILN_Q8_0, b, M, N, K) == 0, "%s: q8_0 rc", c);
            ratio = bound_ratio(c, p, x, w, y, yqe, &mean);
            CHECK(ratio <= 1.0, "%s: q8_0 weights: error %.2fx the bound", c, ratio);
            if (getenv("KILN_TEST_VERBOSE"))
                printf("  %s: q8_0 weights: worst error / bound %.3f, mean error / mean bound %.3f\n", c, ratio, mean);
        }
        free(w); free(y);
    }
}

/* kiln_cpu_linear under precision int8: the int8 result where VNNI runs and the rows are
 * many (the square case's rows 4 times over: 256); with few rows (64), or VNNI off, the
 * bf16 products (the same as under precision bf16, bit for bit). */
static void t_int8_precision_dispatch(void)
{
    const char *c = "square";
    const int64_t *p = raw(c, "p", NULL);
    const float *x0 = f32(c, "x"), *b = f32(c, "b");
    const void *w16 = raw(c, "w16", NULL);
    if (!p || !x0 || !b || !w16) return;
    int64_t M0 = p[0], N = p[1], K = p[2], M = 4 * M0;
    size_t n = (size_t)(M * N);
    float *x = malloc((size_t)(M * K) * sizeof *x);
    for (int r = 0; r < 4; r++) memcpy(x + r * M0 * K, x0, (size_t)(M0 * K) * sizeof *x);
    float *y = malloc(n * sizeof *y), *yi = malloc(n * sizeof *yi), *yb = malloc(n * sizeof *yb);
    CHECK(kiln_precision_from_name("int8") == KILN_PREC_INT8, "int8 is a precision name");
    CHECK(!strcmp(kiln_precision_name(KILN_PREC_INT8), "int8"), "its name");
    kiln_precision_set(KILN_PREC_BF16);
    CHECK(kiln_cpu_linear(yb, x, w16, KILN_F16, b, M, N, K) == KILN_OK, "bf16 linear");
    kiln_precision_set(KILN_PREC_INT8);
    CHECK(kiln_cpu_linear(y, x, w16, KILN_F16, b, M, N, K) == KILN_OK, "int8 linear");
    if (kiln_cpu_has_vnni()) {
        CHECK(kiln_cpu_linear_int8(yi, x, w16, KILN_F16, b, M, N, K) == 0, "int8 kernel");
        CHECK(!memcmp(y, yi, n * sizeof *y), "precision int8: kiln_cpu_linear is the int8 kernel's result");
    }
    CHECK(kiln_cpu_linear(y, x, w16, KILN_F16, b, M0, N, K) == KILN_OK, "int8 linear, few rows");
    kiln_precision_set(KILN_PREC_BF16);
    CHECK(kiln_cpu_linear(yi, x, w16, KILN_F16, b, M0, N, K) == KILN_OK, "bf16 linear, few rows");
    CHECK(!memcmp(y, yi, (size_t)(M0 * N) * sizeof *y), "few rows under precision int8 run the bf16 products");
    kiln_precision_set(KILN_PREC_INT8);
    kiln_cpu_int8_set_disabled(1);
    CHECK(kiln_cpu_linear_int8(yi, x, w16, KILN_F16, b, M, N, K) == 1, "disabled: not applicable");
    CHECK(kiln_cpu_linear(y, x, w16, KILN_F16, b, M, N, K) == KILN_OK, "int8 linear, VNNI off");
    CHECK(!memcmp(y, yb, n * sizeof *y), "without VNNI precision int8 runs the bf16 products");
    kiln_cpu_int8_set_disabled(0);
    kiln_precision_set(KILN_PREC_F32);
    free(x); free(y); free(yi); free(yb);
}

/* A weight tensor in the host allocator (a model's loaded copy) under precision int8:
 * the first product packs it into a cache derived from its storage, counted in the
 * device's statistics; later products use it (the same bits as packing per call); a
 * write to the weight drops it; freeing the weight frees it; a budget it would not fit
 * in without evicting gets no cache and the same result. */
static void t_int8_cached_weights(void)
{
    if (!kiln_cpu_has_vnni()) {
        SKIP("no AVX512-VNNI on this CPU: no packed weights to keep");
        return;
    }
    /* packed weights over 2 MiB (a segment of the allocator's), so a budget can refuse them */
    const int64_t M = 256, N = 1024, K = 2048; /* rows enough for packing per call too */
    CHECK(M >= kiln_cpu_int8_min_rows(1), "rows enough for the cached path");
    kiln_device *dev = kiln_device_cpu();
    kiln_tensor *x, *w, *b, *y1 = NULL, *y2 = NULL;
    int64_t xs[2] = {M, K}, ws[2] = {N, K};
    CHECK(kiln_tensor_new(dev, KILN_F32, 2, xs, &x) == KILN_OK, "x");
    CHECK(kiln_tensor_new(dev, KILN_F16, 2, ws, &w) == KILN_OK, "w");
    CHECK(kiln_tensor_new(dev, KILN_F32, 1, &N, &b) == KILN_OK, "b");
    float *xf = kiln_tensor_data(x), *bf = kiln_tensor_data(b);
    uint16_t *wh = kiln_tensor_data(w);
    uint64_t r = 12345;
    for (int64_t i = 0; i < M * K; i++) { r = r * 6364136223846793005ull + 1442695040888963407ull; xf[i] = (float)((int64_t)(r >> 40) - (1 << 23)) / (1 << 23); }
    for (int64_t i = 0; i < N * K; i++) { r = r * 6364136223846793005ull + 1442695040888963407ull; wh[i] = kiln_f32_to_f16((float)((int64_t)(r >> 40) - (1 << 23)) / (1 << 28)); }
    for (int64_t i = 0; i < N; i++) bf[i] = (float)i / (float)N;
    uint16_t *w_copy = malloc((size_t)(N * K) * 2);
    memcpy(w_copy, wh, (size_t)(N * K) * 2);
    float *want = malloc((size_t)(M * N) * sizeof *want);
    CHECK(kiln_cpu_linear_int8(want, xf, wh, KILN_F16, bf, M, N, K) == 0, "the kernel packing per call");
    size_t packed = kiln_cpu_int8_packed_bytes(N, K, KILN_F16);
    uint64_t before = kiln_device_stats(dev).allocated;
    kiln_precision_set(KILN_PREC_INT8);
    CHECK(kiln_op_linear(x, w, b, &y1) == KILN_OK, "first product");
    CHECK(kiln_storage_derived_bytes(w->storage) == packed, "the packed weights are kept: %zu bytes, want %zu",
          kiln_storage_derived_bytes(w->storage), packed);
    uint64_t with = kiln_device_stats(dev).allocated;
    CHECK(with >= before + packed + kiln_tensor_nbytes(y1), "counted in the device's statistics: %llu -> %llu",
          (unsigned long long)before, (unsigned long long)with);
    CHECK(kiln_op_linear(x, w, b, &y2) == KILN_OK, "second product");
    CHECK(kiln_storage_derived_bytes(w->storage) == packed, "one cache for the weight");
    CHECK(!memcmp(kiln_tensor_data(y1), want, (size_t)(M * N) * 4), "first product: the per-call kernel's bits");
    CHECK(!memcmp(kiln_tensor_data(y2), want, (size_t)(M * N) * 4), "cached product: the per-call kernel's bits");
    kiln_tensor_free(y1); kiln_tensor_free(y2); y1 = y2 = NULL;
    /* a write to the weight: the cache goes, the next product packs the new values */
    CHECK(kiln_tensor_fill(w, 0.0) == KILN_OK, "fill");
    CHECK(kiln_storage_derived_bytes(w->storage) == 0, "a write drops the packed weights");
    CHECK(kiln_op_linear(x, w, b, &y2) == KILN_OK, "product over the new weight");
    CHECK(y2 && !memcmp(kiln_tensor_data(y2), bf, (size_t)N * 4), "zero weights: the bias");
    kiln_tensor_free(y2); y2 = NULL;
    memcpy(wh, w_copy, (size_t)(N * K) * 2); /* a raw write, so the cache is dropped by hand */
    kiln_storage_drop_derived(w->storage);
    /* a budget the cache would not fit in without evicting: no cache, the same result */
    kiln_allocator_empty_cache(dev->alloc);
    kiln_mem_stats st = kiln_device_stats(dev);
    kiln_allocator_set_budget(dev->alloc, st.reserved + (uint64_t)(M * N) * 4 + packed / 2);
    CHECK(kiln_op_linear(x, w, b, &y1) == KILN_OK, "product in a tight budget");
    CHECK(kiln_storage_derived_bytes(w->storage) == 0, "no cache where it would not fit without evicting");
    CHECK(y1 && !memcmp(kiln_tensor_data(y1), want, (size_t)(M * N) * 4), "same bits without the cache");
    kiln_allocator_set_budget(dev->alloc, 0);
    kiln_tensor_free(y1); y1 = NULL;
    CHECK(kiln_op_linear(x, w, b, &y1) == KILN_OK, "product without a budget");
    CHECK(kiln_storage_derived_bytes(w->storage) == packed, "cached again");
    kiln_tensor_free(y1);
    uint64_t held = kiln_device_stats(dev).allocated;
    kiln_tensor_free(w);
    uint64_t after = kiln_device_stats(dev).allocated;
    CHECK(held - after >= packed + (size_t)(N * K) * 2, "freeing the weight frees its packed form: %llu -> %llu",
          (unsigned long long)held, (unsigned long long)after);
    kiln_precision_set(KILN_PREC_F32);
    kiln_tensor_free(x); kiln_tensor_free(b);
    free(want); free(w_copy);
}

/* A 1x1 convolution under precision int8 (a UNet's projections): the linear layer's
 * W8A8 product over the pixels (each image transposed, the per-call kernel's bits),
 * then the residual and the leaky ReLU; its packed weights kept as a linear layer's. */
static void t_int8_conv1x1(void)
{
    if (!kiln_cpu_has_vnni()) {
        SKIP("no AVX512-VNNI on this CPU");
        return;
    }
    const int64_t n = 2, c = 64, k = 48, h = 6, wd = 8, hw = h * wd;
    kiln_device *dev = kiln_device_cpu();
    kiln_tensor *x, *w, *b, *res, *y = NULL;
    int64_t xs[4] = {n, c, h, wd}, ws[4] = {k, c, 1, 1}, rs[4] = {n, k, h, wd};
    CHECK(kiln_tensor_new(dev, KILN_F32, 4, xs, &x) == KILN_OK, "x");
    CHECK(kiln_tensor_new(dev, KILN_F16, 4, ws, &w) == KILN_OK, "w");
    CHECK(kiln_tensor_new(dev, KILN_F32, 1, &k, &b) == KILN_OK, "b");
    CHECK(kiln_tensor_new(dev, KILN_F32, 4, rs, &res) == KILN_OK, "residual");
    float *xf = kiln_tensor_data(x), *bf = kiln_tensor_data(b), *rf = kiln_tensor_data(res);
    uint16_t *wh = kiln_tensor_data(w);
    uint64_t r = 777;
#define NEXT() (r = r * 6364136223846793005ull + 1442695040888963407ull, (float)((int64_t)(r >> 40) - (1 << 23)) / (1 << 23))
    for (int64_t i = 0; i < n * c * hw; i++) xf[i] = NEXT();
    for (int64_t i = 0; i < k * c; i++) wh[i] = kiln_f32_to_f16(NEXT() / 8);
    for (int64_t i = 0; i < k; i++) bf[i] = NEXT();
    for (int64_t i = 0; i < n * k * hw; i++) rf[i] = NEXT();
#undef NEXT
    /* the expected values: per image, pixels-by-channels through the linear kernel */
    float *xt = malloc((size_t)(hw * c) * 4), *yt = malloc((size_t)(hw * k) * 4), *want = malloc((size_t)(n * k * hw) * 4);
    for (int64_t i = 0; i < n; i++) {
        for (int64_t ch = 0; ch < c; ch++)
            for (int64_t p = 0; p < hw; p++) xt[p * c + ch] = xf[(i * c + ch) * hw + p];
        CHECK(kiln_cpu_linear_int8(yt, xt, wh, KILN_F16, bf, hw, k, c) == 0, "linear int8");
        for (int64_t o = 0; o < k; o++)
            for (int64_t p = 0; p < hw; p++) {
                float v = yt[p * k + o] + rf[(i * k + o) * hw + p];
                want[(i * k + o) * hw + p] = v < 0.0f ? v * 0.25f + 0.0f : v;
            }
    }
    kiln_precision_set(KILN_PREC_INT8);
    kiln_conv_opts o = {.stride = {1, 1}, .padding = {0, 0}, .dilation = {1, 1}, .groups = 1, .upsample = 1,
                        .act = 1, .act_slope = 0.25, .residual = res};
    CHECK(kiln_op_conv2d(x, w, b, &o, &y) == KILN_OK, "conv2d: %s", kiln_last_error());
    CHECK(kiln_storage_derived_bytes(w->storage) == kiln_cpu_int8_packed_bytes(k, c, KILN_F16),
          "the packed weights are kept");
    CHECK(y && !memcmp(kiln_tensor_data(y), want, (size_t)(n * k * hw) * 4),
          "the linear layer's int8 product over the pixels, + residual, leaky ReLU");
    kiln_precision_set(KILN_PREC_F32);
    kiln_tensor_free(y); kiln_tensor_free(x); kiln_tensor_free(w); kiln_tensor_free(b); kiln_tensor_free(res);
    free(xt); free(yt); free(want);
}

/* bf16 / f16 activations (a DiT's under precision int8) into a linear layer with packed
 * weights: quantized as read and the output written in their dtype, the same bits as the
 * f32 product of the same values rounded by kiln_convert (K not a multiple of 4 too) */
static void half_activations(kiln_dtype dt)
{
    const int64_t M = 70, N = 150, K = 203;
    kiln_device *dev = kiln_device_cpu();
    kiln_tensor *x, *w, *b, *y = NULL;
    int64_t xs[2] = {M, K}, ws[2] = {N, K};
    CHECK(kiln_tensor_new(dev, dt, 2, xs, &x) == KILN_OK, "x");
    CHECK(kiln_tensor_new(dev, KILN_BF16, 2, ws, &w) == KILN_OK, "w");
    CHECK(kiln_tensor_new(dev, KILN_F32, 1, &N, &b) == KILN_OK, "b");
    uint16_t *xh = kiln_tensor_data(x), *wh = kiln_tensor_data(w);
    float *bf = kiln_tensor_data(b), *xf = malloc((size_t)(M * K) * 4), *yf = malloc((size_t)(M * N) * 4);
    uint16_t *want = malloc((size_t)(M * N) * 2);
    uint64_t r = 4242;
#define NEXT() (r = r * 6364136223846793005ull + 1442695040888963407ull, (float)((int64_t)(r >> 40) - (1 << 23)) / (1 << 23))
    for (int64_t i = 0; i < M * K; i++) xf[i] = NEXT() * 3;
    kiln_convert(xh, dt, xf, KILN_F32, (size_t)(M * K));
    for (int64_t i = 0; i < N * K; i++) wh[i] = kiln_f32_to_bf16(NEXT() / 16);
    for (int64_t i = 0; i < N; i++) bf[i] = NEXT();
#undef NEXT
    kiln_to_f32(xf, xh, dt, (size_t)(M * K));
    CHECK(kiln_cpu_linear_int8(yf, xf, wh, KILN_BF16, bf, M, N, K) == 0, "the f32 product");
    kiln_convert(want, dt, yf, KILN_F32, (size_t)(M * N));
    kiln_precision_set(KILN_PREC_INT8);
    CHECK(kiln_op_linear(x, w, b, &y) == KILN_OK, "linear: %s", kiln_last_error());
    CHECK(kiln_storage_derived_bytes(w->storage) == kiln_cpu_int8_packed_bytes(N, K, KILN_BF16), "packed weights kept");
    CHECK(y && y->dtype == dt, "a %s output", kiln_dtype_name(dt));
    CHECK(y && !memcmp(kiln_tensor_data(y), want, (size_t)(M * N) * 2), "%s: the f32 product's bits rounded",
          kiln_dtype_name(dt));
    kiln_precision_set(KILN_PREC_F32);
    kiln_tensor_free(y); kiln_tensor_free(x); kiln_tensor_free(w); kiln_tensor_free(b);
    free(xf); free(yf); free(want);
}

static void t_int8_half_activations(void)
{
    if (!kiln_cpu_has_vnni()) {
        SKIP("no AVX512-VNNI on this CPU");
        return;
    }
    half_activations(KILN_BF16);
    half_activations(KILN_F16);
}

int main(void)
{
    if (kiln_st_open(GOLDEN, &golden) != KILN_OK) {
        printf("FAIL open %s: %s\n", GOLDEN, kiln_last_error());
        return 1;
    }
    RUN(t_int8_vs_rule);
    RUN(t_int8_error_bound);
    RUN(t_int8_precision_dispatch);
    RUN(t_int8_cached_weights);
    RUN(t_int8_conv1x1);
    RUN(t_int8_half_activations);
    kiln_st_release(golden);
    kiln_precision_unset();
    return test_summary();
}

/* test_cpu_nn.c - CPU kernels for attention, norms, activations and resampling
 * against torch 1.13 goldens (tests/golden/gen_nn.py -> tests/golden/ops/nn_*.safetensors)
 * and against naive double-precision references.
 * The kernels pick AVX-512 / AVX2 / portable C at run time; this program reruns its
 * tests in children with KILN_CPU_ISA=avx2 and =generic, so every path the CPU can
 * run is covered on the same machine.
 * Tolerances (per op): attention 2e-5 of max|ref|; norms 1e-5 abs + 1e-5 rel;
 * activations 1e-7 abs + 2e-6 rel; bilinear 1e-6 abs; nearest modes and pad exact. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"

#include "cpu_kernels.h"
#include "safetensors.h"
#include "threadpool.h"

#include <stdint.h>
#include <time.h>

#define GOLDEN "tests/golden/ops/"

static int child_mode; /* running as the portable-path child: skip the slow tests */

/* ---- helpers ---- */

static kiln_st_file *open_golden(const char *name)
{
    char path[256];
    snprintf(path, sizeof path, GOLDEN "%s", name);
    kiln_st_file *f = NULL;
    kiln_status st = kiln_st_open(path, &f);
    CHECK(st == KILN_OK, "open %s: %s", path, kiln_last_error());
    return st == KILN_OK ? f : NULL;
}

/* Tensor `name` as a malloc'ed f32 copy (NULL and a FAIL when missing); shape and
 * element count through the optional out-parameters. */
static float *get(const kiln_st_file *f, const char *name, int64_t *shape, int *ndim, int64_t *numel)
{
    int i = kiln_st_find(f, name);
    CHECK(i >= 0, "golden tensor %s missing", name);
    if (i < 0) return NULL;
    const kiln_st_entry *e = &f->entries[i];
    int64_t n = 1;
    for (int d = 0; d < e->ndim; d++) n *= e->shape[d];
    float *p = malloc((size_t)(n ? n : 1) * sizeof(float));
    if (!p) return NULL;
    kiln_to_f32(p, kiln_st_data(f, i), e->dtype, (size_t)n);
    if (shape) memcpy(shape, e->shape, sizeof(int64_t) * (size_t)e->ndim);
    if (ndim) *ndim = e->ndim;
    if (numel) *numel = n;
    return p;
}

static float get_scalar(const kiln_st_file *f, const char *name)
{
    float *p = get(f, name, NULL, NULL, NULL);
    float v = p ? p[0] : 0.0f;
    free(p);
    return v;
}

/* |got - ref| <= atol + rtol*|ref| everywhere; reports the worst element */
static void check_close(const char *what, const float *got, const float *ref, int64_t n, double atol, double rtol)
{
    int64_t worst = -1;
    double wexc = 0;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - (double)ref[i]);
        double exc = err - (atol + rtol * fabs((double)ref[i]));
        if (!(exc <= 0) && (worst < 0 || exc > wexc || isnan(exc))) { worst = i; wexc = exc; }
    }
    if (worst >= 0)
        CHECK(0, "%s: element %lld = %.9g, expected %.9g (atol %g rtol %g)", what, (long long)worst,
              (double)got[worst], (double)ref[worst], atol, rtol);
}

/* max |got - ref| relative to max |ref| */
static double rel_to_max(const float *got, const float *ref, int64_t n)
{
    double e = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]);
        if (!(d <= e)) e = d;
        if (fabs((double)ref[i]) > m) m = fabs((double)ref[i]);
    }
    return m > 0 ? e / m : e;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float urand(void) /* uniform [-1, 1) */
{
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

static float *rand_buf(int64_t n, float s, float m)
{
    float *p = malloc((size_t)n * sizeof(float));
    if (p) for (int64_t i = 0; i < n; i++) p[i] = m + s * urand();
    return p;
}

/* naive attention of one query row in double */
static void naive_att_row(double *o, const float *q, const float *k, const float *v, int64_t Lk,
                          int64_t D, int64_t Dv, double scale, int64_t nkeys)
{
    double mx = -INFINITY, l = 0;
    double *p = malloc((size_t)Lk * sizeof(double));
    for (int64_t j = 0; j < nkeys; j++) {
        double s = 0;
        for (int64_t d = 0; d < D; d++) s += (double)q[d] * k[j * D + d];
        p[j] = s * scale;
        if (p[j] > mx) mx = p[j];
    }
    for (int64_t j = 0; j < nkeys; j++) { p[j] = exp(p[j] - mx); l += p[j]; }
    for (int64_t c = 0; c < Dv; c++) {
        double a = 0;
        for (int64_t j = 0; j < nkeys; j++) a += p[j] * v[j * Dv + c];
        o[c] = a / l;
    }
    free(p);
}

/* checks rows i = 0, stride, 2*stride, ... (and the last) of every batch */
static double att_check_rows(const float *out, const float *q, const float *k, const float *v, int64_t B,
                             int64_t Lq, int64_t Lk, int64_t D, int64_t Dv, float scale, int causal, int64_t stride)
{
    double *o = malloc((size_t)Dv * sizeof(double));
    double err = 0, mref = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Lq; i = (i + stride < Lq || i == Lq - 1) ? i + stride : Lq - 1) {
            int64_t nk = causal ? (i + 1 < Lk ? i + 1 : Lk) : Lk;
            naive_att_row(o, q + (b * Lq + i) * D, k + b * Lk * D, v + b * Lk * Dv, Lk, D, Dv, scale, nk);
            for (int64_t c = 0; c < Dv; c++) {
                double d = fabs(o[c] - out[(b * Lq + i) * Dv + c]);
                if (!(d <= err)) err = d;
                if (fabs(o[c]) > mref) mref = fabs(o[c]);
            }
            if (i == Lq - 1) break;
        }
    free(o);
    return mref > 0 ? err / mref : err;
}

/* ---- attention ---- */

static void t_attention_golden(void)
{
    static const char *cases[] = { "self", "cross", "d64", "d80", "d160", "causal", "causal_long", "dv" };
    kiln_st_file *f = open_golden("nn_attention.safetensors");
    if (!f) return;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        char n[96];
        int64_t qs[8], ks[8], vs[8];
#define T(suffix) (snprintf(n, sizeof n, "att_%s." suffix, cases[c]), n)
        float *q = get(f, T("q"), qs, NULL, NULL);
        float *k = get(f, T("k"), ks, NULL, NULL);
        float *v = get(f, T("v"), vs, NULL, NULL);
        int64_t numel = 0;
        float *ref = get(f, T("out"), NULL, NULL, &numel);
        float scale = get_scalar(f, T("scale"));
        int causal = get_scalar(f, T("causal")) != 0;
#undef T
        if (q && k && v && ref) {
            float *out = malloc((size_t)numel * sizeof(float));
            kiln_status st = kiln_cpu_attention(out, q, k, v, qs[0], qs[1], ks[1], qs[2], vs[2], scale, causal);
            CHECK(st == KILN_OK, "attention %s: %s", cases[c], kiln_last_error());
            double e = rel_to_max(out, ref, numel);
            CHECK(e <= 2e-5, "attention %s: error %.3g of max|ref| (tol 2e-5)", cases[c], e);
            free(out);
        }
        free(q); free(k); free(v); free(ref);
    }
    kiln_st_release(f);
}

/* odd shapes against the naive reference: 1 query, 1 key, head dims that are not
 * vector multiples, causal with Lq > Lk and Lq < Lk, tails of every block size */
static void t_attention_shapes(void)
{
    static const int64_t shapes[][6] = { /* B, Lq, Lk, D, Dv, causal */
        { 1, 1, 1, 1, 1, 0 }, { 3, 1, 50, 8, 8, 0 }, { 2, 50, 1, 40, 40, 0 }, { 2, 97, 193, 7, 13, 0 },
        { 1, 257, 97, 40, 40, 1 }, { 1, 60, 200, 24, 24, 1 }, { 2, 65, 96, 64, 72, 0 },
        { 1, 300, 300, 160, 160, 0 }, { 1, 33, 1000, 80, 80, 0 }, { 4, 77, 77, 64, 64, 1 },
        /* several query blocks a head: keys prepared once and shared, causal too */
        { 2, 700, 450, 40, 40, 0 }, { 1, 600, 600, 24, 20, 1 },
    };
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        int64_t B = shapes[s][0], Lq = shapes[s][1], Lk = shapes[s][2], D = shapes[s][3], Dv = shapes[s][4];
        int causal = (int)shapes[s][5];
        float *q = rand_buf(B * Lq * D, 2.0f, 0), *k = rand_buf(B * Lk * D, 2.0f, 0.1f);
        float *v = rand_buf(B * Lk * Dv, 1.0f, 0), *o = malloc((size_t)(B * Lq * Dv) * sizeof(float));
        float scale = 1.0f / sqrtf((float)D);
        kiln_status st = kiln_cpu_attention(o, q, k, v, B, Lq, Lk, D, Dv, scale, causal);
        CHECK(st == KILN_OK, "attention: %s", kiln_last_error());
        double e = att_check_rows(o, q, k, v, B, Lq, Lk, D, Dv, scale, causal, 1);
        CHECK(e <= 2e-5, "shape B%lld Lq%lld Lk%lld D%lld Dv%lld causal%d: error %.3g", (long long)B, (long long)Lq,
              (long long)Lk, (long long)D, (long long)Dv, causal, e);
        free(q); free(k); free(v); free(o);
    }
}

/* SD 1024x1024 self-attention length: one head, L = 16384 (the L x L matrix would be
 * 1 GiB); sampled rows against the naive reference. */
static void t_attention_16384(void)
{
    if (child_mode) { SKIP("other kernel paths: covered by t_attention_shapes"); return; }
    int64_t L = 16384, D = 40;
    float *q = rand_buf(L * D, 2.5f, 0), *k = rand_buf(L * D, 2.5f, 0), *v = rand_buf(L * D, 1.0f, 0);
    float *o = malloc((size_t)(L * D) * sizeof(float));
    if (!q || !k || !v || !o) { SKIP("no memory"); free(q); free(k); free(v); free(o); return; }
    kiln_status st = kiln_cpu_attention(o, q, k, v, 1, L, L, D, D, 1.0f / sqrtf((float)D), 0);
    CHECK(st == KILN_OK, "attention: %s", kiln_last_error());
    double e = att_check_rows(o, q, k, v, 1, L, L, D, D, 1.0f / sqrtf((float)D), 0, 1021);
    CHECK(e <= 2e-5, "L=16384: error %.3g of max|ref|", e);
    free(q); free(k); free(v); free(o);
}

static void t_attention_errors(void)
{
    float buf[16] = { 0 };
    kiln_status st = kiln_cpu_attention(buf, buf, buf, buf, 1, 0, 1, 1, 1, 1.0f, 0);
    CHECK(st == KILN_ERR_ARG && strstr(kiln_last_error(), "attention"), "Lq=0: %d %s", st, kiln_last_error());
    st = kiln_cpu_attention(buf, buf, NULL, buf, 1, 1, 1, 1, 1, 1.0f, 0);
    CHECK(st == KILN_ERR_ARG && strstr(kiln_last_error(), "NULL"), "NULL k: %d %s", st, kiln_last_error());
    st = kiln_cpu_attention(buf, buf, buf, buf, 1, 1, 1, 1, 1, NAN, 0);
    CHECK(st == KILN_ERR_ARG && strstr(kiln_last_error(), "scale"), "NaN scale: %d %s", st, kiln_last_error());
    /* a NaN in the input shows in the output instead of vanishing */
    float q[4] = { 1, NAN, 1, 1 }, kv[4] = { 1, 1, 1, 1 }, out[4];
    st = kiln_cpu_attention(out, q, kv, kv, 1, 2, 2, 2, 2, 1.0f, 0);
    CHECK(st == KILN_OK && isnan(out[0]) && !isnan(out[2]), "NaN row: %g %g", (double)out[0], (double)out[2]);
}

/* ---- norms ---- */

static void t_group_norm_golden(void)
{
    static const char *cases[] = { "c320", "c640", "c1280", "c128", "c256", "c512", "offset" };
    kiln_st_file *f = open_golden("nn_norm.safetensors");
    if (!f) return;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        char n[96], what[64];
        int64_t xs[8], numel = 0;
#define T(suffix) (snprintf(n, sizeof n, "gn_%s." suffix, cases[c]), n)
        float *x = get(f, T("x"), xs, NULL, &numel);
        float *w = get(f, T("gamma"), NULL, NULL, NULL), *b = get(f, T("beta"), NULL, NULL, NULL);
        float *ref = get(f, T("y"), NULL, NULL, NULL), *ref_s = get(f, T("y_silu"), NULL, NULL, NULL);
        int64_t G = (int64_t)get_scalar(f, T("groups"));
        float eps = get_scalar(f, T("eps"));
#undef T
        if (x && w && b && ref && ref_s) {
            float *y = malloc((size_t)numel * sizeof(float));
            kiln_cpu_group_norm(y, x, w, b, xs[0], xs[1], xs[2] * xs[3], G, eps, 0);
            snprintf(what, sizeof what, "group_norm %s", cases[c]);
            check_close(what, y, ref, numel, 1e-5, 1e-5);
            kiln_cpu_group_norm(y, x, w, b, xs[0], xs[1], xs[2] * xs[3], G, eps, 1);
            snprintf(what, sizeof what, "group_norm+silu %s", cases[c]);
            check_close(what, y, ref_s, numel, 1e-5, 1e-5);
            free(y);
        }
        free(x); free(w); free(b); free(ref); free(ref_s);
    }
    kiln_st_release(f);
}

/* a VAE-sized group (4 channels of 512x512 = 1M elements) with mean >> std, against
 * a two-pass double reference; also NULL gamma/beta */
static void t_group_norm_large(void)
{
    int64_t C = 4, HW = 512 * 512, n = C * HW;
    float *x = rand_buf(n, 0.05f, 3.0f), *y = malloc((size_t)n * sizeof(float));
    if (!x || !y) { SKIP("no memory"); free(x); free(y); return; }
    for (int64_t i = 0; i < n; i++) x[i] += 0.01f * (float)(i % 7);
    double m = 0, v = 0;
    for (int64_t i = 0; i < n; i++) m += x[i];
    m /= (double)n;
    for (int64_t i = 0; i < n; i++) v += (x[i] - m) * (x[i] - m);
    v /= (double)n;
    double rstd = 1.0 / sqrt(v + 1e-6);
    kiln_cpu_group_norm(y, x, NULL, NULL, 1, C, HW, 1, 1e-6f, 0);
    double err = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs(y[i] - (x[i] - m) * rstd);
        if (!(e <= err)) err = e;
    }
    CHECK(err <= 2e-5, "1M-element group: max error %.3g", err);
    free(x); free(y);
}

static void t_layer_norm_golden(void)
{
    static const char *cases[] = { "d768", "d320", "d1024" };
    kiln_st_file *f = open_golden("nn_norm.safetensors");
    if (!f) return;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        char n[96], what[64];
        int64_t xs[8], numel = 0;
#define T(suffix) (snprintf(n, sizeof n, "ln_%s." suffix, cases[c]), n)
        float *x = get(f, T("x"), xs, NULL, &numel);
        float *w = get(f, T("gamma"), NULL, NULL, NULL), *b = get(f, T("beta"), NULL, NULL, NULL);
        float *ref = get(f, T("y"), NULL, NULL, NULL), *ref_p = get(f, T("y_plain"), NULL, NULL, NULL);
        float eps = get_scalar(f, T("eps"));
#undef T
        if (x && w && b && ref && ref_p) {
            float *y = malloc((size_t)numel * sizeof(float));
            kiln_cpu_layer_norm(y, x, w, b, xs[0], xs[1], eps);
            snprintf(what, sizeof what, "layer_norm %s", cases[c]);
            check_close(what, y, ref, numel, 1e-5, 1e-5);
            kiln_cpu_layer_norm(y, x, NULL, NULL, xs[0], xs[1], eps);
            snprintf(what, sizeof what, "layer_norm (no affine) %s", cases[c]);
            check_close(what, y, ref_p, numel, 1e-5, 1e-5);
            free(y);
        }
        free(x); free(w); free(b); free(ref); free(ref_p);
    }
    kiln_st_release(f);
}

static void t_softmax_golden(void)
{
    static const char *cases[] = { "rows", "mid", "wide", "big", "first" };
    kiln_st_file *f = open_golden("nn_norm.safetensors");
    if (!f) return;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        char n[96], what[64];
        int64_t xs[8], numel = 0;
        int nd = 0;
#define T(suffix) (snprintf(n, sizeof n, "sm_%s." suffix, cases[c]), n)
        float *x = get(f, T("x"), xs, &nd, &numel);
        float *ref = get(f, T("y"), NULL, NULL, NULL);
        int dim = (int)get_scalar(f, T("dim"));
#undef T
        if (x && ref) {
            int64_t outer = 1, inner = 1;
            for (int d = 0; d < dim; d++) outer *= xs[d];
            for (int d = dim + 1; d < nd; d++) inner *= xs[d];
            float *y = malloc((size_t)numel * sizeof(float));
            kiln_cpu_softmax(y, x, outer, xs[dim], inner);
            snprintf(what, sizeof what, "softmax %s", cases[c]);
            check_close(what, y, ref, numel, 1e-7, 1e-5);
            free(y);
        }
        free(x); free(ref);
    }
    kiln_st_release(f);
}

/* ---- activations ---- */

static void t_activation_golden(void)
{
    kiln_st_file *f = open_golden("nn_activation.safetensors");
    if (!f) return;
    int64_t n = 0;
    float *x = get(f, "act.x", NULL, NULL, &n);
    static const char *names[] = { "silu", "gelu", "gelu_tanh", "quick_gelu", "sigmoid" };
    void (*fns[])(float *, const float *, int64_t) = { kiln_cpu_silu, kiln_cpu_gelu, kiln_cpu_gelu_tanh,
                                                       kiln_cpu_quick_gelu, kiln_cpu_sigmoid };
    for (int a = 0; a < 5 && x; a++) {
        char nm[64];
        snprintf(nm, sizeof nm, "act.%s", names[a]);
        float *ref = get(f, nm, NULL, NULL, NULL);
        float *y = malloc((size_t)n * sizeof(float));
        if (ref && y) {
            fns[a](y, x, n);
            check_close(names[a], y, ref, n, 1e-7, 2e-6);
            memcpy(y, x, (size_t)n * sizeof(float)); /* in place */
            fns[a](y, y, n);
            check_close(names[a], y, ref, n, 1e-7, 2e-6);
            /* every length 1..40 (vector tails) on a shifted window */
            for (int64_t len = 1; len <= 40; len++) {
                float t[40];
                fns[a](t, x + 1000, len);
                check_close(names[a], t, ref + 1000, len, 1e-7, 2e-6);
            }
        }
        free(ref); free(y);
    }
    for (int c = 0; c < 2; c++) {
        const char *cn = c ? "geglu_b" : "geglu_a";
        char nm[64];
        int64_t xs[8], numel = 0;
        snprintf(nm, sizeof nm, "%s.x", cn);
        float *gx = get(f, nm, xs, NULL, NULL);
        snprintf(nm, sizeof nm, "%s.y", cn);
        float *ref = get(f, nm, NULL, NULL, &numel);
        if (gx && ref) {
            float *y = malloc((size_t)numel * sizeof(float));
            kiln_cpu_geglu(y, gx, xs[0], xs[1] / 2);
            check_close(cn, y, ref, numel, 1e-6, 2e-6);
            free(y);
        }
        free(gx); free(ref);
    }
    free(x);
    /* NaN and infinities */
    float s[4] = { NAN, INFINITY, -INFINITY, 0 }, y[4];
    kiln_cpu_sigmoid(y, s, 4);
    CHECK(isnan(y[0]) && y[1] == 1.0f && y[2] == 0.0f && y[3] == 0.5f, "sigmoid specials %g %g %g %g",
          (double)y[0], (double)y[1], (double)y[2], (double)y[3]);
    kiln_cpu_gelu(y, s, 4);
    CHECK(isnan(y[0]) && isinf(y[1]) && y[3] == 0.0f, "gelu specials %g %g %g", (double)y[0], (double)y[1], (double)y[3]);
    kiln_st_release(f);
}

/* ---- resampling ---- */

static void t_resample_golden(void)
{
    kiln_st_file *f = open_golden("nn_resample.safetensors");
    if (!f) return;
    static const struct { const char *src; int64_t oh, ow; } sizes[] = {
        { "s7x9", 16, 12 }, { "s7x9", 3, 4 }, { "s7x9", 14, 18 }, { "s7x9", 7, 9 }, { "s64", 96, 80 }, { "s64", 23, 29 },
    };
    static const char *tags[] = { "bl", "ne", "nn" };
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        char nm[96];
        int64_t xs[8];
        snprintf(nm, sizeof nm, "rs_%s.x", sizes[s].src);
        float *x = get(f, nm, xs, NULL, NULL);
        for (int m = 0; m < 3 && x; m++) {
            int64_t numel = 0;
            snprintf(nm, sizeof nm, "rs_%s_%s_%lldx%lld.y", tags[m], sizes[s].src, (long long)sizes[s].oh,
                     (long long)sizes[s].ow);
            float *ref = get(f, nm, NULL, NULL, &numel);
            if (!ref) continue;
            float *y = malloc((size_t)numel * sizeof(float));
            if (m == 0) kiln_cpu_interpolate_bilinear(y, x, xs[0], xs[1], xs[2], sizes[s].oh, sizes[s].ow);
            if (m == 1) kiln_cpu_interpolate_nearest_exact(y, x, xs[0], xs[1], xs[2], sizes[s].oh, sizes[s].ow);
            if (m == 2) kiln_cpu_interpolate_nearest(y, x, xs[0], xs[1], xs[2], sizes[s].oh, sizes[s].ow);
            check_close(nm, y, ref, numel, m == 0 ? 1e-6 : 0, 0);
            free(y); free(ref);
        }
        free(x);
    }
    int64_t xs[8];
    float *x = get(f, "rs_s7x9.x", xs, NULL, NULL);
    for (int fct = 2; fct <= 3 && x; fct++) {
        char nm[64];
        int64_t numel = 0;
        snprintf(nm, sizeof nm, "rs_up%d.y", fct);
        float *ref = get(f, nm, NULL, NULL, &numel);
        float *y = malloc((size_t)numel * sizeof(float));
        if (ref) {
            kiln_cpu_upsample_nearest(y, x, xs[0], xs[1], xs[2], fct);
            check_close(nm, y, ref, numel, 0, 0);
        }
        free(y); free(ref);
    }
    free(x);
    kiln_st_release(f);
}

static void t_pad_golden(void)
{
    kiln_st_file *f = open_golden("nn_resample.safetensors");
    if (!f) return;
    int64_t xs[8];
    float *x = get(f, "rs_s5x6.x", xs, NULL, NULL);
    for (int i = 0; i < 9 && x; i++) { /* 6..8: circular */
        char nm[64];
        int64_t numel = 0;
        snprintf(nm, sizeof nm, "pad%d.pads", i);
        float *p = get(f, nm, NULL, NULL, NULL);
        snprintf(nm, sizeof nm, "pad%d.mode", i);
        int mode = (int)get_scalar(f, nm);
        snprintf(nm, sizeof nm, "pad%d.value", i);
        float value = get_scalar(f, nm);
        snprintf(nm, sizeof nm, "pad%d.y", i);
        float *ref = get(f, nm, NULL, NULL, &numel);
        if (p && ref) {
            float *y = malloc((size_t)numel * sizeof(float));
            kiln_cpu_pad2d(y, x, xs[0], xs[1], xs[2], (int64_t)p[2], (int64_t)p[3], (int64_t)p[0], (int64_t)p[1],
                           (kiln_pad_mode)mode, value);
            check_close(nm, y, ref, numel, 0, 0);
            free(y);
        }
        free(p); free(ref);
    }
    free(x);
    /* a reflect pad wider than the input (F.pad refuses it) must stay in bounds */
    float in[9] = { 1, 2, 3, 4, 5, 6, 7, 8, 9 }, out[23 * 23];
    kiln_cpu_pad2d(out, in, 1, 3, 3, 10, 10, 10, 10, KILN_PAD_REFLECT, 0);
    int ok = 1;
    for (int i = 0; i < 23 * 23; i++) ok &= out[i] >= 1 && out[i] <= 9;
    CHECK(ok, "wide reflect pad read outside the input");
    /* a circular pad wider than the input wraps again: out[i] = in[(i - pad) mod n] */
    kiln_cpu_pad2d(out, in, 1, 3, 3, 10, 10, 10, 10, KILN_PAD_CIRCULAR, 0);
    ok = 1;
    for (int y = 0; y < 23; y++)
        for (int x = 0; x < 23; x++) ok &= out[y * 23 + x] == in[((y + 2) % 3) * 3 + (x + 2) % 3];
    CHECK(ok, "wide circular pad: wrong wrap");
    kiln_st_release(f);
}

/* the other kernel paths: this program again in a child with KILN_CPU_ISA=isa */
static const char *self_path;
static void run_child(const char *isa)
{
    if (!self_path) { SKIP("own path unknown"); return; }
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "KILN_CPU_ISA=%s KILN_NN_CHILD=1 '%s' 2>&1", isa, self_path);
    FILE *p = popen(cmd, "r");
    if (!p) { SKIP("popen failed"); return; }
    char line[512];
    int fails = 0, passes = 0;
    while (fgets(line, sizeof line, p)) {
        if (!strncmp(line, "FAIL", 4) || !strncmp(line, "    ", 4)) { fails++; printf("  %s: %s", isa, line); }
        if (!strncmp(line, "PASS", 4)) passes++;
    }
    int rc = pclose(p);
    CHECK(rc == 0 && fails == 0 && passes > 5, "KILN_CPU_ISA=%s: rc %d, %d failures, %d passes", isa, rc, fails, passes);
}

static void t_path_avx2(void)
{
#if defined(__x86_64__) || defined(__i386__)
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) { SKIP("no AVX2+FMA on this CPU"); return; }
    run_child("avx2");
#else
    SKIP("not x86");
#endif
}

static void t_path_generic(void) { run_child("generic"); }

int main(int argc, char **argv)
{
    (void)argc;
    const char *cm = getenv("KILN_NN_CHILD");
    child_mode = cm && *cm == '1';
    if (!child_mode && argv[0] && strchr(argv[0], '/') && strlen(argv[0]) < 900 && !strchr(argv[0], '\''))
        self_path = argv[0];
    RUN(t_attention_golden);
    RUN(t_attention_shapes);
    RUN(t_attention_16384);
    RUN(t_attention_errors);
    RUN(t_group_norm_golden);
    RUN(t_group_norm_large);
    RUN(t_layer_norm_golden);
    RUN(t_softmax_golden);
    RUN(t_activation_golden);
    RUN(t_resample_golden);
    RUN(t_pad_golden);
    if (!child_mode) {
        RUN(t_path_avx2);
        RUN(t_path_generic);
    }
    return test_summary();
}

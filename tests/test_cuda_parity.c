/* test_cuda_parity.c - the CUDA backend against the CPU backend, in the spirit of
 * ggml's test-backend-ops: every op of the backend table x dtype x a few shapes
 * (strided and broadcast inputs included) runs on the cpu through kiln_op_* and on
 * cuda:0 through the device's table with the same inputs; results are compared by
 * normalized MSE with a per-op tolerance, and every device output is written into
 * a storage with guard bytes before and after it that must stay untouched. Also:
 * transfers (chunked, pending copies followed at once by compute), typed OOM under
 * a budget, conv2d with no room for a workspace, the backend's workspace counted
 * and released by empty_cache, clean errors, and a network's chain of ops in f16 /
 * bf16 activations against the cpu's f32 within bounds from the unit roundoff.
 *
 * Without a CUDA device it prints one SKIP with the reason. KILN_PARITY_DEVICE=sim
 * runs the same cases against the sim device (checks the harness on any machine).
 * `test_cuda_parity --bench` times a few SD 1.5-sized ops instead. */
#define _POSIX_C_SOURCE 200809L
#include "ops.h"
#include "test.h"

#include <stdint.h>
#include <time.h>

#define GUARD 256
#define SENTINEL 0xA5

static kiln_device *cpu, *dev;
static const char *dev_name = "cuda:0";

/* ---- inputs ---- */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static float frand(void) /* uniform in [-1, 1) */
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) & 0xFFFFFF) / (float)(1 << 23) - 1.0f;
}

/* Random cpu tensor of dtype dt: floats in [lo, hi), integers rounded. */
static kiln_tensor *rnd(kiln_dtype dt, int ndim, const int64_t *shape, float lo, float hi)
{
    kiln_tensor *f, *t = NULL;
    if (kiln_tensor_new(cpu, KILN_F32, ndim, shape, &f)) return NULL;
    float *p = kiln_tensor_data(f);
    int64_t n = kiln_tensor_numel(f);
    for (int64_t i = 0; i < n; i++) {
        float v = lo + (hi - lo) * (frand() + 1.0f) * 0.5f;
        p[i] = kiln_dtype_is_float(dt) ? v : (float)(int)v;
    }
    if (dt == KILN_F32) return f;
    kiln_tensor_to(f, cpu, dt, &t);
    kiln_tensor_free(f);
    return t;
}

static kiln_tensor *on_dev(const kiln_tensor *t)
{
    kiln_tensor *r = NULL;
    if (t && kiln_tensor_to(t, dev, t->dtype, &r)) CHECK(0, "to %s: %s", dev_name, kiln_last_error());
    return r;
}

/* ---- guarded device outputs ---- */

typedef struct {
    kiln_storage *s;
    kiln_tensor *t;
    size_t nbytes;
} guarded;

static int guarded_new(kiln_dtype dt, int ndim, const int64_t *shape, guarded *g)
{
    memset(g, 0, sizeof *g);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) n *= shape[i];
    g->nbytes = (size_t)n * kiln_dtype_size(dt);
    int64_t total = (int64_t)(g->nbytes + 2 * GUARD);
    kiln_tensor *bytes;
    if (kiln_storage_new(dev, (size_t)total, &g->s)) { CHECK(0, "guarded alloc: %s", kiln_last_error()); return 0; }
    bytes = kiln_tensor_from_storage(g->s, 0, KILN_U8, 1, &total, NULL);
    kiln_status st = kiln_tensor_fill(bytes, SENTINEL);
    kiln_tensor_free(bytes);
    g->t = kiln_tensor_from_storage(g->s, GUARD, dt, ndim, shape, NULL);
    CHECK(!st, "guard fill: %s", kiln_last_error());
    return !st;
}

static void guarded_free(guarded *g)
{
    kiln_tensor_free(g->t);
    kiln_storage_release(g->s);
    memset(g, 0, sizeof *g);
}

/* The whole storage as host bytes (caller frees). */
static kiln_tensor *storage_bytes(kiln_storage *s)
{
    int64_t n = (int64_t)s->nbytes;
    kiln_tensor *v = kiln_tensor_from_storage(s, 0, KILN_U8, 1, &n, NULL), *h = NULL;
    if (kiln_tensor_to(v, cpu, KILN_U8, &h)) CHECK(0, "read back: %s", kiln_last_error());
    kiln_tensor_free(v);
    return h;
}

static int guards_intact(const guarded *g, const char *what)
{
    kiln_tensor *h = storage_bytes(g->s);
    if (!h) return 0;
    const unsigned char *b = kiln_tensor_data(h);
    int bad = 0;
    for (size_t i = 0; i < GUARD; i++) bad += b[i] != SENTINEL;
    for (size_t i = GUARD + g->nbytes; i < g->nbytes + 2 * GUARD; i++) bad += b[i] != SENTINEL;
    kiln_tensor_free(h);
    CHECK(!bad, "%s: %d guard bytes overwritten", what, bad);
    return !bad;
}

/* ---- comparison ---- */

static kiln_tensor *host_f32(const kiln_tensor *t)
{
    kiln_tensor *r = NULL;
    if (kiln_tensor_to(t, cpu, KILN_F32, &r)) CHECK(0, "to cpu f32: %s", kiln_last_error());
    return r;
}

/* normalized MSE of got against ref (nan where exactly one of them is nan) */
static double nmse(const kiln_tensor *ref, const kiln_tensor *got)
{
    kiln_tensor *r = host_f32(ref), *g = host_f32(got);
    double err = 0, norm = 0;
    int nan_mismatch = 0;
    if (r && g) {
        const float *a = kiln_tensor_data(r), *b = kiln_tensor_data(g);
        int64_t n = kiln_tensor_numel(r);
        for (int64_t i = 0; i < n; i++) {
            if (isnan(a[i]) || isnan(b[i]) || isinf(a[i]) || isinf(b[i])) {
                nan_mismatch += !(isnan(a[i]) && isnan(b[i])) && a[i] != b[i];
                continue;
            }
            double d = (double)a[i] - (double)b[i];
            err += d * d;
            norm += (double)a[i] * a[i];
        }
    }
    kiln_tensor_free(r);
    kiln_tensor_free(g);
    if (!r || !g || nan_mismatch) return NAN;
    return norm > 0 ? err / norm : err;
}

static int n_cases;

/* Compares the guarded device output with the cpu reference. */
static void expect(const char *what, const kiln_tensor *ref, guarded *g, double tol)
{
    n_cases++;
    char b1[128], b2[128];
    if (!ref || !g->t) { CHECK(0, "%s: missing result", what); return; }
    if (!kiln_shape_equal(ref, g->t) || ref->dtype != g->t->dtype) {
        CHECK(0, "%s: shape/dtype %s %s vs %s %s", what, kiln_shape_str(ref, b1, sizeof b1), kiln_dtype_name(ref->dtype),
              kiln_shape_str(g->t, b2, sizeof b2), kiln_dtype_name(g->t->dtype));
        return;
    }
    guards_intact(g, what);
    double e = nmse(ref, g->t);
    if (getenv("KILN_TEST_VERBOSE") || !(e <= tol)) printf("#   %-60s nmse %.3g (tol %.0e)\n", what, e, tol);
    CHECK(e <= tol, "%s: nmse %.3g above %.3g", what, e, tol);
}

/* tolerances by the output dtype: (f32, f16, bf16); integers are exact */
static double tol_of(kiln_dtype dt, double f32, double f16, double bf16)
{
    return dt == KILN_F32 ? f32 : dt == KILN_F16 ? f16 : dt == KILN_BF16 ? bf16 : 0;
}
#define TOL_ELEM(dt) tol_of(dt, 1e-10, 1e-6, 1e-5)
#define TOL_ACC(dt) tol_of(dt, 1e-9, 1e-5, 1e-4)

static const kiln_dtype fdts[3] = {KILN_F32, KILN_F16, KILN_BF16};

#define SHAPE(t, b) kiln_shape_str((t), (b), sizeof(b))
#define RUN_OK(call) do { kiln_status s_ = (call); if (s_) CHECK(0, "%s: %s", #call, kiln_last_error()); } while (0)

/* ---- copy, fill ---- */

static void t_copy(void)
{
    int64_t shape[3] = {3, 5, 7};
    /* the element types the CUDA kernels convert (low-bit weights: gemm parity below) */
    for (int sd = 0; sd <= KILN_U8; sd++) {
        kiln_tensor *src = rnd((kiln_dtype)sd, 3, shape, sd == KILN_U8 ? 0 : -40, 40), *dsrc = on_dev(src);
        for (int dd = 0; dd <= KILN_U8 && dsrc; dd++) {
            char what[96];
            /* contiguous */
            kiln_tensor *ref = NULL;
            RUN_OK(kiln_tensor_to(src, cpu, (kiln_dtype)dd, &ref));
            guarded g;
            if (guarded_new((kiln_dtype)dd, 3, shape, &g)) {
                RUN_OK(dev->backend->copy(g.t, dsrc));
                snprintf(what, sizeof what, "copy %s -> %s", kiln_dtype_name((kiln_dtype)sd), kiln_dtype_name((kiln_dtype)dd));
                expect(what, ref, &g, 0);
                guarded_free(&g);
            }
            kiln_tensor_free(ref);
            /* permuted source */
            int perm[3] = {2, 0, 1};
            kiln_tensor *ps = NULL, *pd = NULL, *pr = NULL;
            RUN_OK(kiln_tensor_permute(src, perm, &ps));
            RUN_OK(kiln_tensor_permute(dsrc, perm, &pd));
            if (ps && pd && !kiln_tensor_to(ps, cpu, (kiln_dtype)dd, &pr) && guarded_new((kiln_dtype)dd, 3, pr->shape, &g)) {
                RUN_OK(dev->backend->copy(g.t, pd));
                snprintf(what, sizeof what, "copy %s -> %s permuted", kiln_dtype_name((kiln_dtype)sd), kiln_dtype_name((kiln_dtype)dd));
                expect(what, pr, &g, 0);
                guarded_free(&g);
            }
            kiln_tensor_free(ps); kiln_tensor_free(pd); kiln_tensor_free(pr);
        }
        kiln_tensor_free(src);
        kiln_tensor_free(dsrc);
    }
    /* broadcast source into a strided destination: a narrow of a sentinel-filled tensor */
    int64_t small[3] = {1, 5, 1}, big[3] = {3, 9, 7};
    kiln_tensor *s = rnd(KILN_F32, 3, small, -2, 2), *ds = on_dev(s), *es = NULL, *eds = NULL, *ref = NULL;
    guarded g;
    if (ds && guarded_new(KILN_F16, 3, big, &g)) {
        kiln_tensor *slot = NULL;
        RUN_OK(kiln_tensor_narrow(g.t, 1, 2, 5, &slot));
        RUN_OK(kiln_tensor_expand(ds, 3, slot->shape, &eds));
        RUN_OK(kiln_tensor_expand(s, 3, slot->shape, &es));
        RUN_OK(dev->backend->copy(slot, eds));
        RUN_OK(kiln_tensor_to(es, cpu, KILN_F16, &ref));
        kiln_tensor *got = host_f32(slot), *rf = host_f32(ref), *all = storage_bytes(g.s);
        if (got && rf && all) {
            CHECK(memcmp(kiln_tensor_data(got), kiln_tensor_data(rf), (size_t)kiln_tensor_nbytes(rf)) == 0, "broadcast copy values");
            const unsigned char *b = kiln_tensor_data(all);
            const uint16_t *h = (const uint16_t *)(b + GUARD);
            int bad = 0;
            for (int64_t i = 0; i < 3; i++)
                for (int64_t j = 0; j < 9; j++)
                    for (int64_t k = 0; k < 7; k++)
                        if (j < 2 || j >= 7) bad += h[(i * 9 + j) * 7 + k] != (uint16_t)(SENTINEL * 257);
            CHECK(!bad, "strided copy wrote %d elements outside its view", bad);
            n_cases++;
        }
        kiln_tensor_free(got); kiln_tensor_free(rf); kiln_tensor_free(all); kiln_tensor_free(slot);
        guards_intact(&g, "strided copy");
        guarded_free(&g);
    }
    kiln_tensor_free(s); kiln_tensor_free(ds); kiln_tensor_free(es); kiln_tensor_free(eds); kiln_tensor_free(ref);
}

static void t_fill(void)
{
    const double vals[] = {1.5, -3.25, 1e10, NAN, 0};
    int64_t big[2] = {6, 10};
    for (int dt = 0; dt <= KILN_U8; dt++)
        for (size_t vi = 0; vi < sizeof vals / sizeof vals[0]; vi++) {
            guarded g;
            kiln_tensor *ref = NULL, *slot = NULL, *rslot = NULL;
            if (kiln_tensor_zeros(cpu, (kiln_dtype)dt, 2, big, &ref) || !guarded_new((kiln_dtype)dt, 2, big, &g)) {
                kiln_tensor_free(ref);
                continue;
            }
            RUN_OK(dev->backend->fill(g.t, 0));
            RUN_OK(kiln_tensor_narrow(g.t, 1, 3, 4, &slot));
            RUN_OK(kiln_tensor_narrow(ref, 1, 3, 4, &rslot));
            RUN_OK(dev->backend->fill(slot, vals[vi]));
            RUN_OK(kiln_tensor_fill(rslot, vals[vi]));
            char what[64];
            snprintf(what, sizeof what, "fill %s %g (strided)", kiln_dtype_name((kiln_dtype)dt), vals[vi]);
            expect(what, ref, &g, 0);
            kiln_tensor_free(slot); kiln_tensor_free(rslot); kiln_tensor_free(ref);
            guarded_free(&g);
        }
}

/* ---- binary, unary ---- */

static const char *const bin_names[KILN_BIN_COUNT] = {"add", "sub", "mul", "div", "pow", "min", "max"};

static void binary_case(kiln_binop op, const kiln_tensor *a, const kiln_tensor *b, double s, int swap, const char *tag)
{
    kiln_tensor *ref = NULL, *da = on_dev(a), *db = b ? on_dev(b) : NULL, *ea = NULL, *eb = NULL;
    kiln_status st = b ? kiln_op_binary(op, a, b, &ref) : kiln_op_binary_scalar(op, a, s, swap, &ref);
    guarded g;
    char what[128];
    if (st) CHECK(0, "cpu %s: %s", bin_names[op], kiln_last_error());
    else if (da && (!b || db) && guarded_new(ref->dtype, ref->ndim, ref->shape, &g)) {
        RUN_OK(kiln_tensor_expand(da, ref->ndim, ref->shape, &ea));
        if (b) RUN_OK(kiln_tensor_expand(db, ref->ndim, ref->shape, &eb));
        if (ea && (!b || eb)) RUN_OK(dev->backend->binary(op, g.t, ea, eb, s, swap));
        snprintf(what, sizeof what, "%s %s %s%s", bin_names[op], kiln_dtype_name(a->dtype),
                 b ? kiln_dtype_name(b->dtype) : "scalar", tag);
        expect(what, ref, &g, TOL_ELEM(ref->dtype));
        guarded_free(&g);
    }
    kiln_tensor_free(ref); kiln_tensor_free(da); kiln_tensor_free(db); kiln_tensor_free(ea); kiln_tensor_free(eb);
}

static void t_binary(void)
{
    const kiln_dtype dts[5] = {KILN_F32, KILN_F16, KILN_BF16, KILN_I32, KILN_I64};
    int64_t sa[3] = {4, 33, 17}, sb1[3] = {4, 1, 17}, sb2[2] = {33, 1};
    for (int op = 0; op < KILN_BIN_COUNT; op++)
        for (int di = 0; di < 5; di++) {
            kiln_dtype dt = dts[di];
            int isf = kiln_dtype_is_float(dt);
            float lo = op == KILN_BIN_POW ? 0.1f : -8, hi = op == KILN_BIN_POW ? 3 : 8;
            if (op == KILN_BIN_POW && !isf) continue;
            kiln_tensor *a = rnd(dt, 3, sa, lo, hi), *b = rnd(dt, 3, sa, lo, hi);
            kiln_tensor *b1 = rnd(dt, 3, sb1, lo, hi), *b2 = rnd(dt, 2, sb2, lo, hi);
            if (op == KILN_BIN_DIV && !isf) { /* integer division: divisors max(|b|, 1) */
                kiln_tensor *t[3] = {b, b1, b2};
                for (int k = 0; k < 3 && b && b1 && b2; k++) {
                    kiln_tensor *ab = NULL, *m = NULL;
                    if (!kiln_op_unary(KILN_UN_ABS, t[k], 0, 0, &ab) && !kiln_op_binary_scalar(KILN_BIN_MAX, ab, 1, 0, &m))
                        RUN_OK(kiln_tensor_copy(t[k], m));
                    kiln_tensor_free(ab);
                    kiln_tensor_free(m);
                }
            }
            if (a && b && b1 && b2) {
                binary_case((kiln_binop)op, a, b, 0, 0, "");
                binary_case((kiln_binop)op, a, b1, 0, 0, " bcast");
                binary_case((kiln_binop)op, a, b2, 0, 0, " bcast2");
                binary_case((kiln_binop)op, a, NULL, op == KILN_BIN_POW ? 1.5 : 2.5, 0, "");
                binary_case((kiln_binop)op, a, NULL, op == KILN_BIN_POW ? 1.5 : 3.0, 1, " swapped");
            }
            kiln_tensor_free(a); kiln_tensor_free(b); kiln_tensor_free(b1); kiln_tensor_free(b2);
        }
    /* mixed dtypes promote to f32 */
    kiln_tensor *a = rnd(KILN_F16, 3, sa, -2, 2), *b = rnd(KILN_F32, 3, sb1, -2, 2), *c = rnd(KILN_BF16, 2, sb2, -2, 2);
    if (a && b && c) {
        binary_case(KILN_BIN_ADD, a, b, 0, 0, " mixed");
        binary_case(KILN_BIN_MUL, a, c, 0, 0, " mixed");
    }
    kiln_tensor_free(a); kiln_tensor_free(b); kiln_tensor_free(c);
}

static const char *const un_names[KILN_UN_COUNT] = {"neg", "exp", "log", "sqrt", "abs", "tanh", "sigmoid", "silu", "gelu",
                                                    "gelu_tanh", "quick_gelu", "relu", "sin", "cos", "clamp",
                                                    "leaky_relu"};

static void unary_case(kiln_unop op, const kiln_tensor *a, double p0, double p1, const char *tag)
{
    kiln_tensor *ref = NULL, *da = on_dev(a);
    guarded g;
    char what[96];
    if (kiln_op_unary(op, a, p0, p1, &ref)) CHECK(0, "cpu %s: %s", un_names[op], kiln_last_error());
    else if (da && guarded_new(ref->dtype, ref->ndim, ref->shape, &g)) {
        RUN_OK(dev->backend->unary(op, g.t, da, p0, p1));
        snprintf(what, sizeof what, "%s %s%s", un_names[op], kiln_dtype_name(a->dtype), tag);
        expect(what, ref, &g, TOL_ELEM(ref->dtype));
        guarded_free(&g);
    }
    kiln_tensor_free(ref);
    kiln_tensor_free(da);
}

static void t_unary(void)
{
    int64_t shape[3] = {5, 37, 11};
    for (int op = 0; op < KILN_UN_COUNT; op++)
        for (int di = 0; di < 4; di++) {
            kiln_dtype dt = di < 3 ? fdts[di] : KILN_I32;
            if (di == 3 && op != KILN_UN_NEG && op != KILN_UN_ABS && op != KILN_UN_CLAMP && op != KILN_UN_RELU) continue;
            int pos = op == KILN_UN_LOG || op == KILN_UN_SQRT;
            kiln_tensor *a = rnd(dt, 3, shape, pos ? 0.01f : -6, 6), *t = NULL;
            if (!a) continue;
            unary_case((kiln_unop)op, a, -0.5, 0.7, "");
            if (op == KILN_UN_CLAMP) unary_case((kiln_unop)op, a, NAN, 0.25, " (no lower bound)");
            if (!kiln_tensor_transpose(a, 0, 2, &t)) unary_case((kiln_unop)op, t, -0.5, 0.7, " transposed");
            kiln_tensor_free(t);
            kiln_tensor_free(a);
        }
}

/* ---- reduce ---- */

static void t_reduce(void)
{
    static const char *const names[KILN_RED_COUNT] = {"sum", "mean", "max", "min", "var"};
    int64_t shape[3] = {6, 513, 9}, longv[1] = {1 << 20};
    const kiln_dtype dts[4] = {KILN_F32, KILN_F16, KILN_BF16, KILN_I32};
    for (int di = 0; di < 4; di++) {
        kiln_tensor *a = rnd(dts[di], 3, shape, -5, 5), *da = on_dev(a), *big = NULL, *dbig = NULL;
        if (di == 0) { big = rnd(KILN_F32, 1, longv, -1, 1); dbig = on_dev(big); }
        for (int op = 0; op < KILN_RED_COUNT && da; op++)
            for (int dim = -1; dim < 3; dim++)
                for (int unb = 0; unb <= (op == KILN_RED_VAR); unb++) {
                    const kiln_tensor *x = dim == -1 && big ? big : a, *dx = dim == -1 && dbig ? dbig : da;
                    kiln_tensor *ref = NULL;
                    guarded g;
                    if (kiln_op_reduce((kiln_redop)op, x, dim, 1, unb, &ref)) { CHECK(0, "cpu reduce: %s", kiln_last_error()); continue; }
                    if (guarded_new(ref->dtype, ref->ndim, ref->shape, &g)) {
                        RUN_OK(dev->backend->reduce((kiln_redop)op, g.t, dx, dim, unb));
                        char what[96];
                        snprintf(what, sizeof what, "%s%s %s dim %d%s", names[op], unb ? "(unbiased)" : "",
                                 kiln_dtype_name(x->dtype), dim, x == big ? " (1M elements)" : "");
                        /* the cpu sums integers through f32: compare those loosely */
                        expect(what, ref, &g, kiln_dtype_is_float(ref->dtype) ? TOL_ACC(ref->dtype) : 1e-12);
                        guarded_free(&g);
                    }
                    kiln_tensor_free(ref);
                }
        kiln_tensor_free(a); kiln_tensor_free(da); kiln_tensor_free(big); kiln_tensor_free(dbig);
    }
}

/* ---- matmul, linear ---- */

static void matmul_case(const kiln_tensor *a, const kiln_tensor *b, const char *tag)
{
    kiln_tensor *ref = NULL, *da = on_dev(a), *db = on_dev(b), *ea = NULL, *eb = NULL;
    guarded g;
    char what[160], b1[64], b2[64];
    if (kiln_op_matmul(a, b, &ref)) CHECK(0, "cpu matmul: %s", kiln_last_error());
    else if (da && db && guarded_new(ref->dtype, ref->ndim, ref->shape, &g)) {
        /* expand batch dims as ops.c does */
        int n = ref->ndim;
        int64_t sa[KILN_MAX_DIMS], sb[KILN_MAX_DIMS];
        memcpy(sa, ref->shape, sizeof sa);
        memcpy(sb, ref->shape, sizeof sb);
        sa[n - 1] = a->shape[a->ndim - 1];
        sb[n - 2] = b->shape[b->ndim - 2];
        RUN_OK(kiln_tensor_expand(da, n, sa, &ea));
        RUN_OK(kiln_tensor_expand(db, n, sb, &eb));
        if (ea && eb) RUN_OK(dev->backend->matmul(g.t, ea, eb));
        snprintf(what, sizeof what, "matmul %s %s x %s %s%s", kiln_dtype_name(a->dtype), SHAPE(a, b1), kiln_dtype_name(b->dtype),
                 SHAPE(b, b2), tag);
        expect(what, ref, &g, TOL_ACC(ref->dtype));
        guarded_free(&g);
    }
    kiln_tensor_free(ref); kiln_tensor_free(da); kiln_tensor_free(db); kiln_tensor_free(ea); kiln_tensor_free(eb);
}

static void t_matmul(void)
{
    const int64_t mnk[4][3] = {{1, 1, 1}, {17, 9, 33}, {128, 256, 64}, {5, 300, 7}};
    for (int di = 0; di < 3; di++) {
        kiln_dtype dt = fdts[di];
        for (int i = 0; i < 4; i++) {
            int64_t M = mnk[i][0], N = mnk[i][1], K = mnk[i][2];
            int64_t sa[2] = {M, K}, sb[2] = {K, N}, sbt[2] = {N, K};
            kiln_tensor *a = rnd(dt, 2, sa, -1, 1), *b = rnd(dt, 2, sb, -1, 1), *bt = rnd(dt, 2, sbt, -1, 1), *btv = NULL;
            if (a && b) matmul_case(a, b, "");
            if (bt && !kiln_tensor_transpose(bt, 0, 1, &btv)) matmul_case(a, btv, " (b transposed)");
            kiln_tensor_free(a); kiln_tensor_free(b); kiln_tensor_free(bt); kiln_tensor_free(btv);
        }
        int64_t ba[3] = {3, 17, 33}, bb[3] = {3, 33, 9}, ca[4] = {2, 1, 17, 33}, cb[3] = {3, 33, 9};
        kiln_tensor *a = rnd(dt, 3, ba, -1, 1), *b = rnd(dt, 3, bb, -1, 1), *c = rnd(dt, 4, ca, -1, 1), *d = rnd(dt, 3, cb, -1, 1);
        if (a && b) matmul_case(a, b, " batched");
        if (c && d) matmul_case(c, d, " broadcast batch");
        kiln_tensor *at = NULL;
        if (a && !kiln_tensor_transpose(a, 1, 2, &at)) { /* [3,33,17] x ... needs [3,17,k]: use at^T^T trick */
            kiln_tensor *att = NULL;
            if (!kiln_tensor_transpose(at, 1, 2, &att)) matmul_case(att, b, " batched (a strided view)");
            kiln_tensor_free(att);
        }
        kiln_tensor_free(at); kiln_tensor_free(a); kiln_tensor_free(b); kiln_tensor_free(c); kiln_tensor_free(d);
    }
    int64_t sa[2] = {17, 33}, sb[2] = {33, 9};
    kiln_tensor *a = rnd(KILN_F16, 2, sa, -1, 1), *b = rnd(KILN_F32, 2, sb, -1, 1);
    if (a && b) matmul_case(a, b, " mixed");
    kiln_tensor_free(a); kiln_tensor_free(b);
}

static void linear_case(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *bias, const char *tag)
{
    kiln_tensor *ref = NULL, *dx = on_dev(x), *dw = on_dev(w), *dbias = bias ? on_dev(bias) : NULL;
    guarded g;
    char what[160], b1[64], b2[64];
    if (kiln_op_linear(x, w, bias, &ref)) CHECK(0, "cpu linear: %s", kiln_last_error());
    else if (dx && dw && (!bias || dbias) && guarded_new(ref->dtype, ref->ndim, ref->shape, &g)) {
        RUN_OK(dev->backend->linear(g.t, dx, dw, dbias));
        snprintf(what, sizeof what, "linear x %s %s w %s %s%s%s", kiln_dtype_name(x->dtype), SHAPE(x, b1), kiln_dtype_name(w->dtype),
                 SHAPE(w, b2), bias ? " +bias" : "", tag);
        expect(what, ref, &g, TOL_ACC(ref->dtype));
        guarded_free(&g);
    }
    kiln_tensor_free(ref); kiln_tensor_free(dx); kiln_tensor_free(dw); kiln_tensor_free(dbias);
}

static void t_linear(void)
{
    int64_t sx[3] = {2, 7, 33}, sw[2] = {19, 33}, sbias[1] = {19}, sxl[2] = {300, 320}, swl[2] = {640, 320}, sbl[1] = {640};
    for (int di = 0; di < 3; di++) {
        kiln_dtype dt = fdts[di];
        kiln_tensor *x = rnd(dt, 3, sx, -1, 1), *w = rnd(dt, 2, sw, -1, 1), *b = rnd(dt, 1, sbias, -1, 1);
        kiln_tensor *xl = rnd(dt, 2, sxl, -1, 1), *wl = rnd(dt, 2, swl, -0.1f, 0.1f), *bl = rnd(KILN_F32, 1, sbl, -1, 1);
        if (x && w && b) {
            linear_case(x, w, b, "");
            linear_case(x, w, NULL, "");
            kiln_tensor *xt = NULL;
            if (!kiln_tensor_transpose(x, 0, 1, &xt)) linear_case(xt, w, b, " (x strided)");
            kiln_tensor_free(xt);
        }
        if (xl && wl && bl) linear_case(xl, wl, bl, " (f32 bias)");
        kiln_tensor_free(x); kiln_tensor_free(w); kiln_tensor_free(b);
        kiln_tensor_free(xl); kiln_tensor_free(wl); kiln_tensor_free(bl);
    }
    /* f32 activations with f16 / bf16 weights */
    for (int di = 1; di < 3; di++) {
        kiln_tensor *x = rnd(KILN_F32, 3, sx, -1, 1), *w = rnd(fdts[di], 2, sw, -1, 1), *b = rnd(fdts[di], 1, sbias, -1, 1);
        if (x && w && b) linear_case(x, w, b, " (mixed)");
        kiln_tensor_free(x); kiln_tensor_free(w); kiln_tensor_free(b);
    }
    /* half activations with a weight of another dtype (f32, the other half, fp8, a block
     * type): the GEMM runs in the activations' dtype with the weight converted to it, so a
     * half network stays half whatever its file's dtype */
    for (int di = 1; di < 3; di++) {
        const kiln_dtype wdts[4] = {KILN_F32, fdts[3 - di], KILN_F8_E4M3FN, KILN_Q8_0};
        int64_t sxh[3] = {2, 7, 256}, swh[2] = {24, 256};
        for (int wi = 0; wi < 4; wi++) {
            kiln_tensor *x = rnd(fdts[di], 3, sxh, -1, 1), *w = rnd(KILN_F32, 2, swh, -0.1f, 0.1f);
            kiln_tensor *b = rnd(KILN_F32, 1, swh, -1, 1), *wc = NULL;
            if (x && w && b && (wdts[wi] == KILN_F32 || kiln_tensor_to(w, cpu, wdts[wi], &wc) == KILN_OK))
                linear_case(x, wc ? wc : w, b, " (half activations)");
            kiln_tensor_free(x); kiln_tensor_free(w); kiln_tensor_free(b); kiln_tensor_free(wc);
        }
    }
    /* low-bit weights (fp8, block types): decoded on the device before the GEMM */
    static const kiln_dtype low[] = {KILN_F8_E4M3FN, KILN_F8_E5M2, KILN_Q8_0, KILN_Q4_0, KILN_Q4_1, KILN_Q5_0,
                                     KILN_Q5_1, KILN_Q4_K, KILN_Q5_K, KILN_Q6_K};
    int64_t sxq[3] = {2, 7, 256}, swq[2] = {24, 256};
    for (size_t li = 0; li < sizeof low / sizeof low[0]; li++) {
        kiln_tensor *x = rnd(KILN_F32, 3, sxq, -1, 1), *w = rnd(KILN_F32, 2, swq, -0.1f, 0.1f), *b = rnd(KILN_F32, 1, swq, -1, 1);
        kiln_tensor *wq = NULL;
        char what[48];
        snprintf(what, sizeof what, " (%s weights)", kiln_dtype_name(low[li]));
        if (x && w && b && kiln_tensor_to(w, cpu, low[li], &wq) == KILN_OK) linear_case(x, wq, b, what);
        kiln_tensor_free(x); kiln_tensor_free(w); kiln_tensor_free(b); kiln_tensor_free(wq);
    }
}

/* ---- conv2d ---- */

typedef struct { int64_t n, c, h, w, k, r, s, sh, sw, ph, pw, dh, dw, g; } conv_case_t;

static void conv_case(const conv_case_t *cc, kiln_dtype xdt, kiln_dtype wdt, int with_bias, int strided_x, int tight)
{
    int64_t cx = strided_x ? cc->c + 3 : cc->c;
    int64_t sx[4] = {cc->n, cx, cc->h, cc->w}, sw[4] = {cc->k, cc->c / cc->g, cc->r, cc->s}, sb[1] = {cc->k};
    kiln_conv_opts o = {{cc->sh, cc->sw}, {cc->ph, cc->pw}, {cc->dh, cc->dw}, cc->g, 0, 0, 0, NULL};
    kiln_tensor *xfull = rnd(xdt, 4, sx, -1, 1), *w = rnd(wdt, 4, sw, -0.3f, 0.3f), *b = with_bias ? rnd(wdt, 1, sb, -1, 1) : NULL;
    kiln_tensor *x = NULL, *dxfull = on_dev(xfull), *dx = NULL, *dw = on_dev(w), *db = b ? on_dev(b) : NULL, *ref = NULL;
    if (xfull && dxfull) {
        RUN_OK(kiln_tensor_narrow(xfull, 1, strided_x ? 2 : 0, cc->c, &x));
        RUN_OK(kiln_tensor_narrow(dxfull, 1, strided_x ? 2 : 0, cc->c, &dx));
    }
    guarded g;
    char what[192];
    if (!x || !dx || !dw || kiln_op_conv2d(x, w, b, &o, &ref)) CHECK(0, "conv2d setup: %s", kiln_last_error());
    else if (guarded_new(ref->dtype, 4, ref->shape, &g)) {
        uint64_t old_budget = kiln_allocator_stats(dev->alloc).budget;
        if (tight) { /* nothing cached, nothing more to reserve: no room for any workspace */
            kiln_allocator_empty_cache(dev->alloc);
            kiln_allocator_set_budget(dev->alloc, kiln_allocator_stats(dev->alloc).reserved);
        }
        RUN_OK(dev->backend->conv2d(g.t, dx, dw, db, &o));
        if (tight) kiln_allocator_set_budget(dev->alloc, old_budget);
        snprintf(what, sizeof what, "conv2d x %s [%lld,%lld,%lld,%lld] w %s k%lldx%lld s%lld,%lld p%lld,%lld d%lld,%lld g%lld%s%s%s",
                 kiln_dtype_name(xdt), (long long)cc->n, (long long)cc->c, (long long)cc->h, (long long)cc->w, kiln_dtype_name(wdt),
                 (long long)cc->r, (long long)cc->s, (long long)cc->sh, (long long)cc->sw, (long long)cc->ph, (long long)cc->pw,
                 (long long)cc->dh, (long long)cc->dw, (long long)cc->g, with_bias ? " +bias" : "", strided_x ? " strided" : "",
                 tight ? " (no room for a workspace)" : "");
        /* f32: cuDNN's FFT and Winograd algorithms round differently from a direct sum */
        expect(what, ref, &g, tol_of(ref->dtype, 1e-7, 1e-5, 1e-4));
        guarded_free(&g);
    }
    kiln_tensor_free(xfull); kiln_tensor_free(w); kiln_tensor_free(b); kiln_tensor_free(x); kiln_tensor_free(dxfull);
    kiln_tensor_free(dx); kiln_tensor_free(dw); kiln_tensor_free(db); kiln_tensor_free(ref);
}

static void t_conv2d(void)
{
    const conv_case_t cases[] = {
        {2, 8, 17, 17, 16, 3, 3, 1, 1, 1, 1, 1, 1, 1},
        {1, 4, 16, 16, 8, 3, 3, 2, 2, 1, 1, 1, 1, 1},   /* SD downsampler */
        {2, 8, 9, 9, 8, 3, 3, 1, 1, 1, 1, 1, 1, 8},     /* depthwise */
        {1, 16, 8, 8, 32, 1, 1, 1, 1, 0, 0, 1, 1, 1},   /* 1x1 */
        {1, 3, 11, 13, 5, 5, 3, 2, 1, 2, 1, 1, 2, 1},   /* odd sizes, dilation */
        {1, 12, 10, 10, 6, 3, 3, 1, 1, 1, 1, 1, 1, 3},  /* groups */
        {2, 64, 32, 32, 64, 3, 3, 1, 1, 1, 1, 1, 1, 1}, /* a UNet-like layer */
    };
    int nc = (int)(sizeof cases / sizeof cases[0]);
    for (int di = 0; di < 3; di++)
        for (int i = 0; i < nc; i++) conv_case(&cases[i], fdts[di], fdts[di], i % 2 == 0, i == 0, 0);
    conv_case(&cases[0], KILN_F32, KILN_F16, 1, 0, 0);
    conv_case(&cases[6], KILN_F32, KILN_BF16, 1, 0, 0);
    conv_case(&cases[6], KILN_F16, KILN_F16, 1, 0, 1);
    conv_case(&cases[6], KILN_F32, KILN_F32, 1, 0, 1);
    /* half activations with weights of another dtype: computed in the activations' dtype */
    conv_case(&cases[6], KILN_F16, KILN_F32, 1, 0, 0);
    conv_case(&cases[0], KILN_BF16, KILN_F16, 1, 1, 0);
    conv_case(&cases[3], KILN_BF16, KILN_F32, 0, 0, 0);
}

/* ---- norms, softmax, attention, geglu ---- */

static void t_group_norm(void)
{
    const int64_t shapes[4][4] = {{2, 32, 8, 8}, {1, 64, 13, 7}, {1, 128, 64, 64}, {3, 6, 5, 1}};
    const int64_t groups[4] = {8, 32, 32, 3};
    for (int di = 0; di < 3; di++)
        for (int i = 0; i < 4; i++)
            for (int v = 0; v < 3; v++) { /* v: 0 affine, 1 affine + silu, 2 no affine */
                int64_t C = shapes[i][1];
                kiln_tensor *x = rnd(fdts[di], 4, shapes[i], -2, 3), *w = v < 2 ? rnd(KILN_F32, 1, &C, 0.5f, 1.5f) : NULL;
                kiln_tensor *b = v < 2 ? rnd(fdts[di], 1, &C, -1, 1) : NULL, *ref = NULL;
                kiln_tensor *dx = on_dev(x), *dw = w ? on_dev(w) : NULL, *db = b ? on_dev(b) : NULL;
                guarded g;
                if (!x || kiln_op_group_norm(x, groups[i], w, b, 1e-5, v == 1, &ref)) CHECK(0, "cpu group_norm: %s", kiln_last_error());
                else if (dx && guarded_new(ref->dtype, 4, ref->shape, &g)) {
                    RUN_OK(dev->backend->group_norm(g.t, dx, dw, db, groups[i], 1e-5, v == 1));
                    char what[128], b1[64];
                    snprintf(what, sizeof what, "group_norm %s %s G%lld%s", kiln_dtype_name(fdts[di]), SHAPE(x, b1),
                             (long long)groups[i], v == 0 ? "" : v == 1 ? " +silu" : " (no affine)");
                    expect(what, ref, &g, TOL_ACC(ref->dtype));
                    guarded_free(&g);
                }
                kiln_tensor_free(x); kiln_tensor_free(w); kiln_tensor_free(b); kiln_tensor_free(ref);
                kiln_tensor_free(dx); kiln_tensor_free(dw); kiln_tensor_free(db);
            }
}

static void t_layer_norm(void)
{
    int64_t sx[3] = {4, 33, 320}, sfull[3] = {4, 33, 330}, D = 320;
    for (int di = 0; di < 3; di++)
        for (int v = 0; v < 3; v++) { /* 0 affine, 1 no affine, 2 strided x */
            kiln_tensor *full = rnd(fdts[di], 3, v == 2 ? sfull : sx, -3, 4), *x = NULL, *dfull = on_dev(full), *dx = NULL;
            kiln_tensor *w = v != 1 ? rnd(fdts[di], 1, &D, 0.5f, 1.5f) : NULL, *b = v != 1 ? rnd(KILN_F32, 1, &D, -1, 1) : NULL;
            kiln_tensor *dw = w ? on_dev(w) : NULL, *db = b ? on_dev(b) : NULL, *ref = NULL;
            if (full && dfull) {
                RUN_OK(kiln_tensor_narrow(full, 2, v == 2 ? 5 : 0, D, &x));
                RUN_OK(kiln_tensor_narrow(dfull, 2, v == 2 ? 5 : 0, D, &dx));
            }
            guarded g;
            if (!x || kiln_op_layer_norm(x, w, b, 1e-5, &ref)) CHECK(0, "cpu layer_norm: %s", kiln_last_error());
            else if (dx && guarded_new(ref->dtype, 3, ref->shape, &g)) {
                RUN_OK(dev->backend->layer_norm(g.t, dx, dw, db, 1e-5));
                char what[96];
                snprintf(what, sizeof what, "layer_norm %s [4,33,320]%s", kiln_dtype_name(fdts[di]),
                         v == 0 ? "" : v == 1 ? " (no affine)" : " (strided x)");
                expect(what, ref, &g, TOL_ACC(ref->dtype));
                guarded_free(&g);
            }
            kiln_tensor_free(full); kiln_tensor_free(x); kiln_tensor_free(dfull); kiln_tensor_free(dx);
            kiln_tensor_free(w); kiln_tensor_free(b); kiln_tensor_free(dw); kiln_tensor_free(db); kiln_tensor_free(ref);
        }
}

static void t_softmax(void)
{
    int64_t s1[3] = {4, 33, 77}, s2[2] = {2, 3000};
    for (int di = 0; di < 3; di++)
        for (int c = 0; c < 4; c++) {
            kiln_tensor *x = c < 3 ? rnd(fdts[di], 3, s1, -8, 8) : rnd(fdts[di], 2, s2, -8, 8), *dx = on_dev(x), *ref = NULL;
            int dim = c == 0 ? 2 : c == 1 ? 1 : c == 2 ? 0 : 1;
            guarded g;
            if (!x || kiln_op_softmax(x, dim, &ref)) CHECK(0, "cpu softmax: %s", kiln_last_error());
            else if (dx && guarded_new(ref->dtype, ref->ndim, ref->shape, &g)) {
                RUN_OK(dev->backend->softmax(g.t, dx, dim));
                char what[96], b1[64];
                snprintf(what, sizeof what, "softmax %s %s dim %d", kiln_dtype_name(fdts[di]), SHAPE(x, b1), dim);
                expect(what, ref, &g, TOL_ACC(ref->dtype));
                guarded_free(&g);
            }
            kiln_tensor_free(x); kiln_tensor_free(dx); kiln_tensor_free(ref);
        }
}

typedef struct { int64_t B, H, Lq, Lk, D, Dv; int causal, permuted; } attn_case_t;

static void t_attention(void)
{
    const attn_case_t cases[] = {
        {2, 2, 77, 77, 40, 40, 0, 0}, {1, 3, 100, 37, 64, 64, 0, 1}, {2, 2, 130, 130, 80, 80, 1, 0},
        {1, 2, 65, 65, 160, 160, 0, 1}, {1, 1, 300, 300, 512, 512, 0, 0}, {1, 1, 5, 9, 8, 24, 0, 0},
        {2, 1, 33, 33, 200, 200, 1, 0}, {1, 1, 40, 40, 700, 700, 0, 0}, {1, 2, 1, 50, 32, 32, 0, 0},
        {1, 1, 70, 70, 96, 96, 1, 1}, {1, 1, 17, 3, 128, 128, 1, 0},
    };
    for (int di = 0; di < 3; di++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            const attn_case_t *a = &cases[i];
            /* permuted: made as [B, L, H, D] and viewed as [B, H, L, D] (what a script does) */
            int64_t sq[4] = {a->B, a->H, a->Lq, a->D}, sk[4] = {a->B, a->H, a->Lk, a->D}, sv[4] = {a->B, a->H, a->Lk, a->Dv};
            int64_t pq[4] = {a->B, a->Lq, a->H, a->D}, pk[4] = {a->B, a->Lk, a->H, a->D}, pv[4] = {a->B, a->Lk, a->H, a->Dv};
            kiln_tensor *q0 = rnd(fdts[di], 4, a->permuted ? pq : sq, -1, 1), *k0 = rnd(fdts[di], 4, a->permuted ? pk : sk, -1, 1);
            kiln_tensor *v0 = rnd(fdts[di], 4, a->permuted ? pv : sv, -1, 1);
            kiln_tensor *dq0 = on_dev(q0), *dk0 = on_dev(k0), *dv0 = on_dev(v0);
            kiln_tensor *q = NULL, *k = NULL, *v = NULL, *dq = NULL, *dk = NULL, *dv = NULL, *ref = NULL;
            int perm[4] = {0, 2, 1, 3};
            if (q0 && k0 && v0 && dq0 && dk0 && dv0) {
                if (a->permuted) {
                    RUN_OK(kiln_tensor_permute(q0, perm, &q)); RUN_OK(kiln_tensor_permute(k0, perm, &k));
                    RUN_OK(kiln_tensor_permute(v0, perm, &v)); RUN_OK(kiln_tensor_permute(dq0, perm, &dq));
                    RUN_OK(kiln_tensor_permute(dk0, perm, &dk)); RUN_OK(kiln_tensor_permute(dv0, perm, &dv));
                } else {
                    q = kiln_tensor_view_of(q0); k = kiln_tensor_view_of(k0); v = kiln_tensor_view_of(v0);
                    dq = kiln_tensor_view_of(dq0); dk = kiln_tensor_view_of(dk0); dv = kiln_tensor_view_of(dv0);
                }
            }
            double scale = 1.0 / sqrt((double)a->D);
            guarded g;
            if (!q || !k || !v || kiln_op_attention(q, k, v, scale, a->causal, &ref)) CHECK(0, "cpu attention: %s", kiln_last_error());
            else if (dq && dk && dv && guarded_new(ref->dtype, 4, ref->shape, &g)) {
                RUN_OK(dev->backend->attention(g.t, dq, dk, dv, scale, a->causal));
                char what[128];
                snprintf(what, sizeof what, "attention %s B%lld H%lld Lq%lld Lk%lld D%lld Dv%lld%s%s", kiln_dtype_name(fdts[di]),
                         (long long)a->B, (long long)a->H, (long long)a->Lq, (long long)a->Lk, (long long)a->D, (long long)a->Dv,
                         a->causal ? " causal" : "", a->permuted ? " permuted" : "");
                expect(what, ref, &g, TOL_ACC(ref->dtype));
                guarded_free(&g);
            }
            kiln_tensor_free(q0); kiln_tensor_free(k0); kiln_tensor_free(v0); kiln_tensor_free(dq0); kiln_tensor_free(dk0);
            kiln_tensor_free(dv0); kiln_tensor_free(q); kiln_tensor_free(k); kiln_tensor_free(v); kiln_tensor_free(dq);
            kiln_tensor_free(dk); kiln_tensor_free(dv); kiln_tensor_free(ref);
        }
}

static void t_geglu(void)
{
    int64_t s[3] = {3, 17, 80};
    for (int di = 0; di < 3; di++) {
        kiln_tensor *x = rnd(fdts[di], 3, s, -4, 4), *dx = on_dev(x), *ref = NULL;
        guarded g;
        if (!x || kiln_op_geglu(x, &ref)) CHECK(0, "cpu geglu: %s", kiln_last_error());
        else if (dx && guarded_new(ref->dtype, 3, ref->shape, &g)) {
            RUN_OK(dev->backend->geglu(g.t, dx));
            char what[64];
            snprintf(what, sizeof what, "geglu %s [3,17,80]", kiln_dtype_name(fdts[di]));
            expect(what, ref, &g, TOL_ELEM(ref->dtype));
            guarded_free(&g);
        }
        kiln_tensor_free(x); kiln_tensor_free(dx); kiln_tensor_free(ref);
    }
}

/* ---- resample, pad ---- */

static void t_resample(void)
{
    static const char *const names[KILN_RS_COUNT] = {"nearest", "nearest-exact", "bilinear"};
    int64_t s[4] = {2, 3, 17, 13};
    const int64_t sizes[5][2] = {{34, 26}, {40, 19}, {8, 6}, {17, 13}, {51, 39}};
    for (int di = 0; di < 3; di++) {
        kiln_tensor *x = rnd(fdts[di], 4, s, -2, 2), *dx = on_dev(x);
        for (int m = 0; m < KILN_RS_COUNT && dx; m++)
            for (int i = 0; i < 5; i++) {
                kiln_tensor *ref = NULL;
                guarded g;
                if (kiln_op_resample((kiln_resample)m, x, sizes[i][0], sizes[i][1], &ref)) { CHECK(0, "cpu resample: %s", kiln_last_error()); continue; }
                if (guarded_new(ref->dtype, 4, ref->shape, &g)) {
                    RUN_OK(dev->backend->resample((kiln_resample)m, g.t, dx));
                    char what[96];
                    snprintf(what, sizeof what, "interpolate %s %s 17x13 -> %lldx%lld", names[m], kiln_dtype_name(fdts[di]),
                             (long long)sizes[i][0], (long long)sizes[i][1]);
                    /* nearest modes pick the same pixels: exact; bilinear repeats the CPU's
                     * arithmetic, allowed the rounding of another order */
                    expect(what, ref, &g, m == KILN_RS_BILINEAR ? TOL_ELEM(ref->dtype) : 0);
                    guarded_free(&g);
                }
                kiln_tensor_free(ref);
            }
        kiln_tensor_free(x); kiln_tensor_free(dx);
    }
}

static void t_pad2d(void)
{
    static const char *const names[4] = {"constant", "reflect", "replicate", "circular"}; /* ORDER PADMODE */
    int64_t s[4] = {2, 3, 9, 11};
    const int64_t pads[3][4] = {{1, 2, 3, 0}, {0, 0, 4, 4}, {5, 1, 0, 2}};
    for (int di = 0; di < 3; di++) {
        kiln_tensor *x = rnd(fdts[di], 4, s, -2, 2), *dx = on_dev(x);
        for (int m = 0; m < 4 && dx; m++)
            for (int i = 0; i < 3; i++) {
                kiln_tensor *ref = NULL;
                guarded g;
                if (kiln_op_pad2d(x, pads[i], m, 0.75, &ref)) { CHECK(0, "cpu pad: %s", kiln_last_error()); continue; }
                if (guarded_new(ref->dtype, 4, ref->shape, &g)) {
                    RUN_OK(dev->backend->pad2d(g.t, dx, pads[i], m, 0.75));
                    char what[96];
                    snprintf(what, sizeof what, "pad %s %s (%lld,%lld,%lld,%lld)", names[m], kiln_dtype_name(fdts[di]),
                             (long long)pads[i][0], (long long)pads[i][1], (long long)pads[i][2], (long long)pads[i][3]);
                    expect(what, ref, &g, 0);
                    guarded_free(&g);
                }
                kiln_tensor_free(ref);
            }
        kiln_tensor_free(x); kiln_tensor_free(dx);
    }
}

/* ---- a network in half activations against the f32 reference ----
 * What a UNet / VAE / CLIP block does, in one chain: conv -> GroupNorm+SiLU -> conv ->
 * tokens -> LayerNorm -> q, k, v -> attention -> out projection + residual -> GEGLU MLP
 * -> back to an image -> nearest 2x -> pad -> conv -> softmax over channels. The device
 * runs it with its inputs and weights rounded to f16 / bf16 (as a half network loads
 * them), the cpu in f32 from the same f32 values.
 * Bound, from the unit roundoff u (2^-11 f16, 2^-8 bf16), not tuned: each rounding to
 * the half dtype (an input, a weight, an op's output) adds a relative error of at most
 * u, mean square u^2/3 when it is spread evenly; the chain rounds k = 16 times along its
 * longest path, and its ops carry a relative error of the input about unchanged to the
 * output (random weights scale the error as the signal, the norms renormalize both), so
 * the normalized MSE is about k u^2/3. Allowed: 4 k u^2, twelve times that, for the
 * steps that amplify (the softmaxes' exponentials, cancellation in the GEMMs' sums). */
enum { HN_X, HN_W1, HN_B1, HN_GG, HN_GB, HN_W2, HN_B2, HN_LG, HN_LB, HN_WQ, HN_WK, HN_WV, HN_WO, HN_BO, HN_WF, HN_BF,
       HN_W3, HN_B3, HN_COUNT };
#define HN_ROUNDINGS 16

static kiln_tensor *hn_run(kiln_tensor *const *in)
{
    kiln_tensor *tmp[40] = {0}, *r = NULL;
    int nt = 0;
    kiln_status s = KILN_OK;
    kiln_conv_opts o = {{1, 1}, {1, 1}, {1, 1}, 1, 0, 0, 0, NULL}, o0 = {{1, 1}, {0, 0}, {1, 1}, 1, 0, 0, 0, NULL};
#define HN(call) (s ? NULL : ((s = (call)) ? NULL : tmp[nt - 1]))
#define OUT (tmp[nt++] = NULL, &tmp[nt - 1])
    int64_t tok[3] = {2, 64, 256}, heads[4] = {2, 256, 2, 32}, flat[3] = {2, 256, 64}, img[4] = {2, 64, 16, 16};
    int perm[4] = {0, 2, 1, 3};
    int64_t pads[4] = {1, 1, 1, 1};
    kiln_tensor *c1 = HN(kiln_op_conv2d(in[HN_X], in[HN_W1], in[HN_B1], &o, OUT));
    kiln_tensor *g = HN(kiln_op_group_norm(c1, 8, in[HN_GG], in[HN_GB], 1e-5, 1, OUT));
    kiln_tensor *c2 = HN(kiln_op_conv2d(g, in[HN_W2], in[HN_B2], &o, OUT));
    kiln_tensor *t3 = HN(kiln_tensor_reshape(c2, 3, tok, OUT));
    kiln_tensor *tt = HN(kiln_tensor_transpose(t3, 1, 2, OUT));
    kiln_tensor *seq = HN(kiln_tensor_contiguous(tt, OUT));
    kiln_tensor *ln = HN(kiln_op_layer_norm(seq, in[HN_LG], in[HN_LB], 1e-5, OUT));
    kiln_tensor *q = HN(kiln_op_linear(ln, in[HN_WQ], NULL, OUT)), *k = HN(kiln_op_linear(ln, in[HN_WK], NULL, OUT));
    kiln_tensor *v = HN(kiln_op_linear(ln, in[HN_WV], NULL, OUT));
    kiln_tensor *q4 = HN(kiln_tensor_reshape(q, 4, heads, OUT)), *k4 = HN(kiln_tensor_reshape(k, 4, heads, OUT));
    kiln_tensor *v4 = HN(kiln_tensor_reshape(v, 4, heads, OUT));
    kiln_tensor *qh = HN(kiln_tensor_permute(q4, perm, OUT)), *kh = HN(kiln_tensor_permute(k4, perm, OUT));
    kiln_tensor *vh = HN(kiln_tensor_permute(v4, perm, OUT));
    kiln_tensor *a = HN(kiln_op_attention(qh, kh, vh, 1.0 / sqrt(32.0), 0, OUT));
    kiln_tensor *ap = HN(kiln_tensor_permute(a, perm, OUT));
    kiln_tensor *ac = HN(kiln_tensor_contiguous(ap, OUT));
    kiln_tensor *a3 = HN(kiln_tensor_reshape(ac, 3, flat, OUT));
    kiln_tensor *po = HN(kiln_op_linear(a3, in[HN_WO], in[HN_BO], OUT));
    kiln_tensor *r1 = HN(kiln_op_binary(KILN_BIN_ADD, po, seq, OUT));
    kiln_tensor *f = HN(kiln_op_linear(r1, in[HN_WF], in[HN_BF], OUT));
    kiln_tensor *gg = HN(kiln_op_geglu(f, OUT));
    kiln_tensor *r2 = HN(kiln_op_binary(KILN_BIN_ADD, gg, r1, OUT));
    kiln_tensor *rt = HN(kiln_tensor_transpose(r2, 1, 2, OUT));
    kiln_tensor *rc = HN(kiln_tensor_contiguous(rt, OUT));
    kiln_tensor *im = HN(kiln_tensor_reshape(rc, 4, img, OUT));
    kiln_tensor *up = HN(kiln_op_resample(KILN_RS_NEAREST, im, 32, 32, OUT));
    kiln_tensor *pd = HN(kiln_op_pad2d(up, pads, KILN_PAD_REFLECT, 0, OUT));
    kiln_tensor *c3 = HN(kiln_op_conv2d(pd, in[HN_W3], in[HN_B3], &o0, OUT));
    if (!s) s = kiln_op_softmax(c3, 1, &r);
#undef HN
#undef OUT
    if (s) CHECK(0, "half network on %s: %s", tmp[0] ? tmp[0]->storage->device->name : "?", kiln_last_error());
    for (int i = 0; i < nt; i++) kiln_tensor_free(tmp[i]);
    return s ? NULL : r;
}

static void t_half_network(void)
{
    /* ndim, shape; value range */
    static const struct { int nd; int64_t shape[4]; float lo, hi; } spec[HN_COUNT] = {
        {4, {2, 32, 16, 16}, -1, 1}, {4, {32, 32, 3, 3}, -0.1f, 0.1f}, {1, {32}, -0.1f, 0.1f}, {1, {32}, 0.5f, 1.5f},
        {1, {32}, -0.5f, 0.5f}, {4, {64, 32, 3, 3}, -0.1f, 0.1f}, {1, {64}, -0.1f, 0.1f}, {1, {64}, 0.5f, 1.5f},
        {1, {64}, -0.5f, 0.5f}, {2, {64, 64}, -0.2f, 0.2f}, {2, {64, 64}, -0.2f, 0.2f}, {2, {64, 64}, -0.2f, 0.2f},
        {2, {64, 64}, -0.2f, 0.2f}, {1, {64}, -0.1f, 0.1f}, {2, {128, 64}, -0.2f, 0.2f}, {1, {128}, -0.1f, 0.1f},
        {4, {4, 64, 3, 3}, -0.07f, 0.07f}, {1, {4}, -0.1f, 0.1f},
    };
    kiln_tensor *host[HN_COUNT] = {0};
    int ok = 1;
    for (int i = 0; i < HN_COUNT; i++) ok &= (host[i] = rnd(KILN_F32, spec[i].nd, spec[i].shape, spec[i].lo, spec[i].hi)) != NULL;
    kiln_tensor *ref = ok ? hn_run(host) : NULL;
    for (int di = 1; di < 3 && ref; di++) {
        kiln_tensor *d[HN_COUNT] = {0};
        int dok = 1;
        for (int i = 0; i < HN_COUNT; i++)
            if (kiln_tensor_to(host[i], dev, fdts[di], &d[i])) { CHECK(0, "to %s: %s", dev_name, kiln_last_error()); dok = 0; }
        kiln_tensor *got = dok ? hn_run(d) : NULL;
        if (got) {
            CHECK(got->dtype == fdts[di], "the chain's output is %s, not %s (an op widened the activations)",
                  kiln_dtype_name(got->dtype), kiln_dtype_name(fdts[di]));
            double u = fdts[di] == KILN_F16 ? 1.0 / 2048 : 1.0 / 256, bound = 4.0 * HN_ROUNDINGS * u * u;
            double e = nmse(ref, got);
            printf("#   half network %s vs f32: nmse %.3g (bound %.3g = 4 * %d * u^2)\n", kiln_dtype_name(fdts[di]), e, bound,
                   HN_ROUNDINGS);
            CHECK(e <= bound, "half network %s: nmse %.3g above %.3g", kiln_dtype_name(fdts[di]), e, bound);
            /* and not the f32 result itself: the chain really ran in half */
            CHECK(e > 0, "half network %s: identical to f32", kiln_dtype_name(fdts[di]));
            n_cases++;
        }
        kiln_tensor_free(got);
        for (int i = 0; i < HN_COUNT; i++) kiln_tensor_free(d[i]);
    }
    kiln_tensor_free(ref);
    for (int i = 0; i < HN_COUNT; i++) kiln_tensor_free(host[i]);
}

/* ---- transfers, memory, errors ---- */

static void t_transfer(void)
{
    const int64_t sizes[4] = {1, 1000, (20 << 20) + 3, 65 << 20};
    for (int i = 0; i < 4; i++) {
        kiln_tensor *h, *d = NULL, *back = NULL;
        if (kiln_tensor_new(cpu, KILN_U8, 1, &sizes[i], &h)) { CHECK(0, "host alloc"); continue; }
        unsigned char *p = kiln_tensor_data(h);
        for (int64_t k = 0; k < sizes[i]; k++) p[k] = (unsigned char)(k * 131 + (k >> 13));
        RUN_OK(kiln_tensor_to(h, dev, KILN_U8, &d));
        if (d) RUN_OK(kiln_tensor_to(d, cpu, KILN_U8, &back));
        if (back) CHECK(memcmp(kiln_tensor_data(back), p, (size_t)sizes[i]) == 0, "round trip of %lld bytes differs", (long long)sizes[i]);
        n_cases++;
        kiln_tensor_free(h); kiln_tensor_free(d); kiln_tensor_free(back);
    }
    /* compute right after a (possibly still running) host->device copy, and a
     * transfer into blocks that queued kernels just released */
    int64_t n = 16 << 20;
    for (int round = 0; round < 3; round++) {
        kiln_tensor *h = rnd(KILN_F32, 1, &n, -1, 1), *d = NULL, *r = NULL, *ref = NULL;
        if (!h) continue;
        RUN_OK(kiln_tensor_to(h, dev, KILN_F32, &d));
        if (d) RUN_OK(kiln_op_binary_scalar(KILN_BIN_MUL, d, 3.0, 0, &r));
        RUN_OK(kiln_op_binary_scalar(KILN_BIN_MUL, h, 3.0, 0, &ref));
        kiln_tensor_free(d);
        if (r && ref) {
            kiln_tensor *got = host_f32(r);
            if (got) CHECK(memcmp(kiln_tensor_data(got), kiln_tensor_data(ref), (size_t)n * 4) == 0,
                           "op after transfer (round %d) differs", round);
            kiln_tensor_free(got);
            n_cases++;
        }
        kiln_tensor_free(h); kiln_tensor_free(r); kiln_tensor_free(ref);
    }
}

static void t_oom(void)
{
    kiln_mem_stats s0 = kiln_allocator_stats(dev->alloc);
    kiln_allocator_set_budget(dev->alloc, s0.reserved + (64u << 20));
    int64_t n = 256 << 20;
    kiln_tensor *t = NULL;
    kiln_status st = kiln_tensor_new(dev, KILN_U8, 1, &n, &t);
    CHECK(st == KILN_ERR_OOM, "256 MiB under a 64 MiB margin gave %s", kiln_status_name(st));
    if (st == KILN_ERR_OOM) {
        const kiln_oom_info *o = kiln_last_oom();
        CHECK(strcmp(o->device, dev_name) == 0, "oom device '%s'", o->device);
        CHECK(o->requested >= (uint64_t)n, "oom requested %llu", (unsigned long long)o->requested);
        CHECK(strstr(kiln_last_error(), dev_name) != NULL, "oom message without the device: %s", kiln_last_error());
    }
    CHECK(kiln_allocator_stats(dev->alloc).n_ooms > s0.n_ooms, "n_ooms not counted");
    kiln_tensor_free(t);
    kiln_allocator_set_budget(dev->alloc, s0.budget);
    /* the device is usable afterwards */
    int64_t m = 1 << 20;
    st = kiln_tensor_zeros(dev, KILN_F32, 1, &m, &t);
    CHECK(st == KILN_OK, "allocation after OOM: %s", kiln_last_error());
    kiln_tensor_free(t);
    n_cases++;
}

/* The backend's workspace follows the runtime's one policy: counted in the device's
 * statistics, given back by kiln_device_empty_cache, taken again by the next op. */
static void t_workspace(void)
{
    int64_t sa[2] = {64, 64};
    kiln_tensor *a = rnd(KILN_F32, 2, sa, -1, 1);
    if (!a) { CHECK(0, "input: %s", kiln_last_error()); return; }
    matmul_case(a, a, " (workspace held)");
    kiln_mem_stats s = kiln_device_stats(dev);
    if (dev->type == KILN_DEV_CUDA)
        CHECK(s.workspace > 0 && s.workspace <= s.allocated, "cuBLAS workspace %llu of %llu allocated",
              (unsigned long long)s.workspace, (unsigned long long)s.allocated);
    kiln_device_empty_cache(dev);
    s = kiln_device_stats(dev);
    CHECK(s.workspace == 0, "workspace %llu after empty_cache", (unsigned long long)s.workspace);
    matmul_case(a, a, " (workspace taken again)");
    if (dev->type == KILN_DEV_CUDA)
        CHECK(kiln_device_stats(dev).workspace > 0, "workspace not taken again after empty_cache");
    kiln_tensor_free(a);
    n_cases++;
}

static void t_errors(void)
{
    if (dev->type != KILN_DEV_CUDA) { SKIP("CUDA-specific limits"); return; }
    int64_t s[4] = {1, 1, 4, 2000};
    kiln_tensor *q = NULL, *r = NULL;
    if (kiln_tensor_zeros(dev, KILN_F32, 4, s, &q)) { CHECK(0, "alloc: %s", kiln_last_error()); return; }
    kiln_status st = kiln_op_attention(q, q, q, 0.1, 0, &r);
    CHECK(st == KILN_ERR_UNSUPPORTED, "attention with D=2000 gave %s", kiln_status_name(st));
    CHECK(strstr(kiln_last_error(), dev_name) != NULL, "message names the device: %s", kiln_last_error());
    kiln_tensor_free(q);
    kiln_tensor_free(r);
    CHECK(dev->total_memory > 0, "total memory of %s unknown", dev_name);
    CHECK(dev->backend->to_device && dev->backend->to_host, "transfer entries missing");
    for (int op = 0; op < KILN_OP_COUNT; op++) CHECK(dev->backend->supports((kiln_op)op, KILN_F16), "op %d unsupported", op);
    n_cases++;
}

/* ---- bench ---- */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* completes queued device work: to_host waits for the compute stream */
static void sync_dev(const kiln_tensor *t)
{
    kiln_tensor *one = NULL, *h = NULL;
    if (!kiln_tensor_narrow(t, 0, 0, 1, &one)) kiln_tensor_to(one, cpu, t->dtype, &h);
    kiln_tensor_free(one);
    kiln_tensor_free(h);
}

#define BENCH(label, iters, flops, expr) do { \
    kiln_tensor *r_ = NULL; \
    if ((expr)) { printf("  %-44s failed: %s\n", label, kiln_last_error()); break; } \
    sync_dev(r_); kiln_tensor_free(r_); r_ = NULL; \
    double t0_ = now(); \
    for (int i_ = 0; i_ < (iters); i_++) { if ((expr)) break; if (i_ + 1 < (iters)) { kiln_tensor_free(r_); r_ = NULL; } } \
    if (r_) sync_dev(r_); \
    double ms_ = (now() - t0_) * 1e3 / (iters); \
    printf("  %-44s %8.3f ms  %7.1f TFLOP/s\n", label, ms_, (flops) / (ms_ * 1e-3) / 1e12); \
    kiln_tensor_free(r_); } while (0)

static kiln_tensor *dev_rnd(kiln_dtype dt, int ndim, const int64_t *shape, float lo, float hi)
{
    kiln_tensor *h = rnd(dt, ndim, shape, lo, hi), *d = on_dev(h);
    kiln_tensor_free(h);
    return d;
}

static int bench(void)
{
    printf("# op benchmarks on %s (f16, SD 1.5 shapes at 512x512, batch 2)\n", dev_name);
    int64_t sx[4] = {2, 320, 64, 64}, sw[4] = {320, 320, 3, 3}, sb[1] = {320}, sq[4] = {2, 8, 4096, 40}, sk[4] = {2, 8, 77, 40};
    int64_t sl[3] = {2, 4096, 320}, swl[2] = {1280, 320}, sv[4] = {2, 512, 64, 64}, swv[4] = {512, 512, 3, 3};
    kiln_tensor *x = dev_rnd(KILN_F16, 4, sx, -1, 1), *w = dev_rnd(KILN_F16, 4, sw, -0.05f, 0.05f);
    kiln_tensor *b = dev_rnd(KILN_F16, 1, sb, -1, 1), *q = dev_rnd(KILN_F16, 4, sq, -1, 1), *kc = dev_rnd(KILN_F16, 4, sk, -1, 1);
    kiln_tensor *xl = dev_rnd(KILN_F16, 3, sl, -1, 1), *wl = dev_rnd(KILN_F16, 2, swl, -0.05f, 0.05f);
    kiln_tensor *xv = dev_rnd(KILN_F16, 4, sv, -1, 1), *wv = dev_rnd(KILN_F16, 4, swv, -0.05f, 0.05f);
    if (!x || !w || !b || !q || !kc || !xl || !wl || !xv || !wv) { printf("bench setup failed: %s\n", kiln_last_error()); return 1; }
    kiln_conv_opts o = {{1, 1}, {1, 1}, {1, 1}, 1, 0, 0, 0, NULL};
    double conv_fl = 2.0 * 2 * 320 * 64 * 64 * 320 * 9, attn_fl = 4.0 * 2 * 8 * 4096.0 * 4096 * 40;
    BENCH("conv2d 320->320 3x3 [2,320,64,64]", 20, conv_fl, kiln_op_conv2d(x, w, b, &o, &r_));
    BENCH("conv2d 512->512 3x3 [2,512,64,64] (VAE)", 10, 2.0 * 2 * 512 * 64 * 64 * 512 * 9, kiln_op_conv2d(xv, wv, NULL, &o, &r_));
    BENCH("self-attention [2,8,4096,40]", 10, attn_fl, kiln_op_attention(q, q, q, 1.0 / sqrt(40.0), 0, &r_));
    BENCH("cross-attention [2,8,4096,40] x 77", 20, 4.0 * 2 * 8 * 4096.0 * 77 * 40, kiln_op_attention(q, kc, kc, 1.0 / sqrt(40.0), 0, &r_));
    BENCH("linear [8192,320] x [1280,320]^T", 20, 2.0 * 8192 * 320 * 1280, kiln_op_linear(xl, wl, NULL, &r_));
    BENCH("group_norm+silu [2,320,64,64] G32", 20, 0, kiln_op_group_norm(x, 32, b, b, 1e-5, 1, &r_));
    BENCH("layer_norm [2,4096,320]", 20, 0, kiln_op_layer_norm(xl, NULL, NULL, 1e-5, &r_));
    BENCH("add [2,320,64,64]", 50, 0, kiln_op_binary(KILN_BIN_ADD, x, x, &r_));
    kiln_tensor *list[] = {x, w, b, q, kc, xl, wl, xv, wv};
    for (size_t i = 0; i < sizeof list / sizeof list[0]; i++) kiln_tensor_free(list[i]);
    kiln_mem_stats s = kiln_allocator_stats(dev->alloc);
    printf("# %s: peak allocated %.1f MiB, peak reserved %.1f MiB\n", dev_name, s.peak_allocated / 1048576.0, s.peak_reserved / 1048576.0);
    return 0;
}

static void t_no_device(void) { SKIP("no %s device: %s", dev_name, kiln_last_error()); }

int main(int argc, char **argv)
{
    const char *e = getenv("KILN_PARITY_DEVICE");
    if (e && *e) dev_name = e;
    cpu = kiln_device_cpu();
    dev = kiln_device_get(dev_name);
    if (!dev) {
        RUN(t_no_device);
        return test_summary();
    }
    if (argc > 1 && strcmp(argv[1], "--bench") == 0) return bench();
    printf("# parity: cpu vs %s (%.1f GiB)\n", dev_name, dev->total_memory / 1073741824.0);
    /* `test_cuda_parity t_conv2d t_attention` runs only those */
    static const struct { const char *name; void (*fn)(void); } tests[] = {
        {"t_transfer", t_transfer}, {"t_copy", t_copy}, {"t_fill", t_fill}, {"t_binary", t_binary},
        {"t_unary", t_unary}, {"t_reduce", t_reduce}, {"t_matmul", t_matmul}, {"t_linear", t_linear},
        {"t_conv2d", t_conv2d}, {"t_group_norm", t_group_norm}, {"t_layer_norm", t_layer_norm},
        {"t_softmax", t_softmax}, {"t_attention", t_attention}, {"t_geglu", t_geglu}, {"t_resample", t_resample},
        {"t_pad2d", t_pad2d}, {"t_half_network", t_half_network}, {"t_oom", t_oom}, {"t_workspace", t_workspace}, {"t_errors", t_errors},
    };
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        int want = argc < 2;
        for (int a = 1; a < argc && !want; a++) want = strcmp(argv[a], tests[i].name) == 0;
        if (!want) continue;
        test_cur_name = tests[i].name;
        test_cur_failed = 0;
        test_cur_skipped = 0;
        tests[i].fn();
        if (test_cur_skipped) test_n_skip++;
        else if (test_cur_failed) test_n_fail++;
        else { test_n_pass++; printf("PASS %s\n", tests[i].name); }
        fflush(stdout);
    }
    kiln_mem_stats s = kiln_allocator_stats(dev->alloc);
    printf("# %d cases; %s peak allocated %.1f MiB, %llu allocations, %llu OOMs\n", n_cases, dev_name,
           s.peak_allocated / 1048576.0, (unsigned long long)s.n_allocs, (unsigned long long)s.n_ooms);
    return test_summary();
}

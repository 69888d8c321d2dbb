/* test_dtype.c - dtype names and conversions, against numpy / torch bit for bit
 * (tests/golden/dtype.bin from tests/golden/gen_dtype.py) and kiln's own rules
 * for integer targets (truncate toward zero, saturate, nan -> 0). */
#include "convert.h"
#include "test.h"

#include <stdint.h>

#define GOLDEN_DTYPE "tests/golden/dtype.bin"

/* ---- the golden file: "KDTGOLD1" then sections (4-byte tag, u32 count, data) ---- */
static unsigned char *golden;
static size_t golden_len;
static int golden_tried;

static int golden_load(void)
{
    if (golden_tried) return golden != NULL;
    golden_tried = 1;
    FILE *f = fopen(GOLDEN_DTYPE, "rb");
    if (!f) return 0;
    size_t cap = 1 << 18, len = 0, got;
    unsigned char *buf = malloc(cap);
    while (buf && (got = fread(buf + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            unsigned char *nb = realloc(buf, cap * 2);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf && (len < 8 || memcmp(buf, "KDTGOLD1", 8) != 0)) { free(buf); buf = NULL; }
    golden = buf;
    golden_len = len;
    return golden != NULL;
}

static uint32_t le32(const unsigned char *p) { return p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }

/* Finds section tag with elements of elem_size bytes; NULL (and a FAIL) when absent
 * or malformed. The data are little-endian, as is every host we build for. */
static const void *section(const char *tag, size_t elem_size, uint32_t *count)
{
    *count = 0;
    if (!golden_load()) { CHECK(0, "cannot read %s (run tests/golden/gen_dtype.py)", GOLDEN_DTYPE); return NULL; }
    size_t pos = 8;
    while (golden_len - pos >= 8) {
        uint32_t n = le32(golden + pos + 4);
        if (memcmp(golden + pos, tag, 4) == 0) {
            if ((uint64_t)n * elem_size > golden_len - pos - 8) break;
            *count = n;
            return golden + pos + 8;
        }
        /* skip another section: its element size is known from its tag */
        size_t esz = 0;
        static const struct { const char *tag; size_t size; } sizes[] = {
            {"H2F ", 8}, {"B2F ", 8}, {"H2B ", 8}, {"B2H ", 8}, {"F32 ", 4}, {"F2H ", 2}, {"F2B ", 2},
            {"F2I ", 4}, {"F2L ", 8}, {"F2U ", 1}, {"I64 ", 8}, {"L2F ", 4}, {"L2H ", 2}, {"L2B ", 2},
        };
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
            if (memcmp(golden + pos, sizes[i].tag, 4) == 0) esz = sizes[i].size;
        if (!esz || (uint64_t)n * esz > golden_len - pos - 8) break;
        pos += 8 + (size_t)n * esz;
    }
    CHECK(0, "%s: section '%s' missing or malformed", GOLDEN_DTYPE, tag);
    return NULL;
}

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static int f16_isnan(uint16_t h) { return (h & 0x7fff) > 0x7c00; }
static int bf16_isnan(uint16_t h) { return (h & 0x7fff) > 0x7f80; }
static uint32_t canon_f32(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : u; }
static uint16_t canon_f16(uint16_t h) { return f16_isnan(h) ? 0x7e00 : h; }
static uint16_t canon_bf16(uint16_t h) { return bf16_isnan(h) ? 0x7fc0 : h; }

static uint64_t fnv_bytes(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 0x100000001b3u; }
    return h;
}
#define FNV_START 0xcbf29ce484222325u

static uint64_t get_u64(const unsigned char *p) { return le32(p) | (uint64_t)le32(p + 4) << 32; }

/* Compares per-block hashes of 65536 results (elem bytes each) with section tag. */
static int check_blocks(const char *tag, const unsigned char *results, size_t elem, const char *what)
{
    uint32_t n;
    const unsigned char *want = section(tag, 8, &n);
    if (!want) return 0;
    CHECK(n == 256, "%s: %u blocks", tag, n);
    int bad = 0;
    for (uint32_t b = 0; b < 256 && n == 256; b++) {
        uint64_t h = fnv_bytes(FNV_START, results + (size_t)b * 256 * elem, 256 * elem);
        if (h != get_u64(want + 8 * b)) {
            if (bad < 4) CHECK(0, "%s differs from the reference for input bits 0x%04x..0x%04x", what, b * 256, b * 256 + 255);
            bad++;
        }
    }
    CHECK(!bad, "%s: %d of 256 blocks differ", what, bad);
    return !bad;
}

/* ---- tests ---- */

static void t_names_and_sizes(void)
{
    static const char *names[] = {"f32", "f16", "bf16", "i32", "i64", "u8", "f8_e4m3fn", "f8_e5m2"};
    static const size_t sizes[] = {4, 2, 2, 4, 8, 1, 1, 1};
    /* the element types; the block types (q8_0 ...) are test_gguf.c's */
    for (int d = 0; d <= KILN_F8_E5M2; d++) {
        CHECK(strcmp(kiln_dtype_name((kiln_dtype)d), names[d]) == 0, "name of %d is %s", d, kiln_dtype_name((kiln_dtype)d));
        CHECK(kiln_dtype_size((kiln_dtype)d) == sizes[d], "size of %s", names[d]);
        CHECK(kiln_dtype_from_name(names[d]) == d, "from_name(%s)", names[d]);
        CHECK(kiln_dtype_is_float((kiln_dtype)d) == (d <= KILN_BF16 || d >= KILN_F8_E4M3FN), "is_float(%s)", names[d]);
    }
    CHECK(kiln_dtype_from_name("float16") == KILN_F16, "float16");
    CHECK(kiln_dtype_from_name("BFloat16") == KILN_BF16, "BFloat16");
    CHECK(kiln_dtype_from_name("F32") == KILN_F32, "F32");
    CHECK(kiln_dtype_from_name("f8") == -1, "f8 accepted");
    CHECK(kiln_dtype_from_name("Q4_K") == KILN_Q4_K && kiln_dtype_size(KILN_Q4_K) == 0 &&
          kiln_dtype_block(KILN_Q4_K) == 256 && kiln_dtype_nbytes(KILN_Q4_K, 512) == 288, "q4_k sizes");
    CHECK(kiln_dtype_from_name("") == -1, "empty name accepted");
    CHECK(kiln_dtype_from_name(NULL) == -1, "NULL name accepted");
    CHECK(kiln_dtype_size(KILN_DTYPE_COUNT) == 0, "size of an invalid dtype");
    CHECK(kiln_dtype_name((kiln_dtype)99) != NULL, "name of an invalid dtype is NULL");
}

/* All 65536 f16 and bf16 bit patterns to f32, single and bulk. */
static void t_half_to_f32_all(void)
{
    static uint16_t all[65536];
    static uint32_t h2f[65536], b2f[65536], bulk[65536];
    for (uint32_t i = 0; i < 65536; i++) all[i] = (uint16_t)i;
    int bad_independent = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        float f = kiln_f16_to_f32(all[i]);
        h2f[i] = canon_f32(f2u(f));
        b2f[i] = canon_f32(f2u(kiln_bf16_to_f32(all[i])));
        /* an independent formula, to name the value when a block differs */
        int e = (i >> 10) & 0x1f, m = i & 0x3ff;
        double want = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
        if (i & 0x8000) want = -want;
        if (!(f == want || (isnan(f) && isnan(want))) || (f == 0 && !signbit(f) != !signbit(want))) {
            if (bad_independent++ < 4) CHECK(0, "f16 0x%04x -> %.9g, expected %.9g", i, f, want);
        }
    }
    check_blocks("H2F ", (const unsigned char *)h2f, 4, "f16 -> f32");
    check_blocks("B2F ", (const unsigned char *)b2f, 4, "bf16 -> f32");

    static float tmp[65536];
    kiln_to_f32(tmp, all, KILN_F16, 65536);
    for (uint32_t i = 0; i < 65536; i++) bulk[i] = canon_f32(f2u(tmp[i]));
    CHECK(memcmp(bulk, h2f, sizeof bulk) == 0, "kiln_to_f32(f16) differs from kiln_f16_to_f32");
    /* bit for bit, NaN payloads included (the SIMD path must not quiet them), also at
     * odd offsets and lengths (vector bodies and scalar tails) */
    int raw_bad = 0;
    for (uint32_t i = 0; i < 65536; i++) raw_bad += f2u(tmp[i]) != f2u(kiln_f16_to_f32(all[i]));
    CHECK(raw_bad == 0, "kiln_to_f32(f16): %d results differ in their bits from kiln_f16_to_f32", raw_bad);
    for (size_t off = 0; off < 3; off++) {
        size_t n = 65536 - off - 5;
        kiln_to_f32(tmp, all + off, KILN_F16, n);
        raw_bad = 0;
        for (size_t i = 0; i < n; i++) raw_bad += f2u(tmp[i]) != f2u(kiln_f16_to_f32(all[off + i]));
        CHECK(raw_bad == 0, "kiln_to_f32(f16) at offset %zu: %d results differ", off, raw_bad);
    }
    kiln_convert(tmp, KILN_F32, all, KILN_BF16, 65536);
    for (uint32_t i = 0; i < 65536; i++) bulk[i] = canon_f32(f2u(tmp[i]));
    CHECK(memcmp(bulk, b2f, sizeof bulk) == 0, "kiln_convert(bf16 -> f32) differs from kiln_bf16_to_f32");
}

/* f16 <-> bf16 through kiln_convert, all bit patterns, against torch's .to(). */
static void t_half_to_half_all(void)
{
    static uint16_t all[65536], out[65536];
    for (uint32_t i = 0; i < 65536; i++) all[i] = (uint16_t)i;
    kiln_convert(out, KILN_BF16, all, KILN_F16, 65536);
    for (uint32_t i = 0; i < 65536; i++) out[i] = canon_bf16(out[i]);
    check_blocks("H2B ", (const unsigned char *)out, 2, "f16 -> bf16");
    kiln_convert(out, KILN_F16, all, KILN_BF16, 65536);
    for (uint32_t i = 0; i < 65536; i++) out[i] = canon_f16(out[i]);
    check_blocks("B2H ", (const unsigned char *)out, 2, "bf16 -> f16");
}

/* f32 -> f16 as numpy and f32 -> bf16 as torch, round to nearest even incl. ties,
 * subnormals, overflow to inf; nan only has to stay nan. */
static void t_f32_to_half(void)
{
    uint32_t n, n_h, n_b;
    const unsigned char *in = section("F32 ", 4, &n);
    const unsigned char *wh = section("F2H ", 2, &n_h);
    const unsigned char *wb = section("F2B ", 2, &n_b);
    if (!in || !wh || !wb) return;
    CHECK(n_h == n && n_b == n && n >= 20000, "section sizes %u %u %u", n, n_h, n_b);
    if (test_cur_failed) return;
    float *x = malloc((size_t)n * 4);
    uint16_t *bh = malloc((size_t)n * 2), *bb = malloc((size_t)n * 2);
    if (!x || !bh || !bb) { free(x); free(bh); free(bb); CHECK(0, "out of memory"); return; }
    for (uint32_t i = 0; i < n; i++) x[i] = u2f(le32(in + 4 * i));
    kiln_convert(bh, KILN_F16, x, KILN_F32, n);
    kiln_convert(bb, KILN_BF16, x, KILN_F32, n);
    int bad_h = 0, bad_b = 0, n_nan = 0, n_sub = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint16_t eh = (uint16_t)(wh[2 * i] | wh[2 * i + 1] << 8), eb = (uint16_t)(wb[2 * i] | wb[2 * i + 1] << 8);
        uint16_t h = kiln_f32_to_f16(x[i]), b = kiln_f32_to_bf16(x[i]);
        n_nan += isnan(x[i]) != 0;
        n_sub += (eh & 0x7c00) == 0 && (eh & 0x3ff) != 0;
        int ok_h = f16_isnan(eh) ? f16_isnan(h) : h == eh;
        int ok_b = bf16_isnan(eb) ? bf16_isnan(b) : b == eb;
        if (!ok_h && bad_h++ < 5) CHECK(0, "f32 %.9g (0x%08x) -> f16 0x%04x, numpy 0x%04x", x[i], le32(in + 4 * i), h, eh);
        if (!ok_b && bad_b++ < 5) CHECK(0, "f32 %.9g (0x%08x) -> bf16 0x%04x, torch 0x%04x", x[i], le32(in + 4 * i), b, eb);
        if (bh[i] != h || bb[i] != b) {
            if (bad_h++ < 5) CHECK(0, "kiln_convert differs from the scalar conversion for 0x%08x", le32(in + 4 * i));
        }
    }
    CHECK(bad_h == 0 && bad_b == 0, "%d f16 and %d bf16 mismatches of %u", bad_h, bad_b, n);
    CHECK(n_nan >= 5 && n_sub >= 500, "golden lacks nan (%d) or subnormal (%d) cases", n_nan, n_sub);
    if (!test_cur_failed) printf("     %u f32 values (%d nan, %d to f16 subnormals) bit-exact\n", n, n_nan, n_sub);
    free(x);
    free(bh);
    free(bb);
}

/* The array conversion f32 -> f16 against the scalar one on random bit patterns (every
 * exponent, so normals, subnormals, overflow, inf and NaN all occur, at every offset of
 * the vector groups). */
static void t_f32_to_half_array_random(void)
{
    size_t n = 1 << 22;
    float *x = malloc(n * 4);
    uint16_t *h = malloc(n * 2);
    if (!x || !h) { free(x); free(h); CHECK(0, "out of memory"); return; }
    uint64_t st = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n; i++) {
        st ^= st << 13; st ^= st >> 7; st ^= st << 17; /* xorshift64 */
        uint32_t u = (uint32_t)(st >> 32);
        if (i % 3 == 0) u = (u & 0x807fffffu) | ((uint32_t)(100 + (st >> 8) % 60) << 23); /* f16's range */
        memcpy(&x[i], &u, 4);
    }
    for (size_t off = 0; off < 3; off++) {
        kiln_f32_to_f16_array(h, x + off, n - off);
        int bad = 0;
        for (size_t i = 0; i < n - off; i++) {
            uint16_t want = kiln_f32_to_f16(x[off + i]);
            if (h[i] != want && bad++ < 5) CHECK(0, "f32 %.9g -> f16 0x%04x, scalar 0x%04x", x[off + i], h[i], want);
        }
        CHECK(bad == 0, "offset %zu: %d mismatches of %zu", off, bad, n - off);
    }
    free(x);
    free(h);
}

/* f32 -> integers: truncation toward zero, saturation, nan -> 0. */
static void t_f32_to_int(void)
{
    uint32_t n, ni, nl, nu;
    const unsigned char *in = section("F32 ", 4, &n);
    const unsigned char *wi = section("F2I ", 4, &ni);
    const unsigned char *wl = section("F2L ", 8, &nl);
    const unsigned char *wu = section("F2U ", 1, &nu);
    if (!in || !wi || !wl || !wu) return;
    CHECK(ni == nl && ni == nu && ni <= n && ni >= 1000, "section sizes %u %u %u %u", n, ni, nl, nu);
    if (test_cur_failed) return;
    float *x = malloc((size_t)ni * 4);
    int32_t *gi = malloc((size_t)ni * 4);
    int64_t *gl = malloc((size_t)ni * 8);
    uint8_t *gu = malloc(ni);
    if (!x || !gi || !gl || !gu) { free(x); free(gi); free(gl); free(gu); CHECK(0, "out of memory"); return; }
    for (uint32_t i = 0; i < ni; i++) x[i] = u2f(le32(in + 4 * i));
    kiln_convert(gi, KILN_I32, x, KILN_F32, ni);
    kiln_convert(gl, KILN_I64, x, KILN_F32, ni);
    kiln_convert(gu, KILN_U8, x, KILN_F32, ni);
    int bad = 0;
    for (uint32_t i = 0; i < ni && bad < 8; i++) {
        int32_t ei = (int32_t)le32(wi + 4 * i);
        int64_t el = (int64_t)get_u64(wl + 8 * i);
        if (gi[i] != ei) { bad++; CHECK(0, "f32 %.9g -> i32 %d, expected %d", x[i], gi[i], ei); }
        if (gl[i] != el) { bad++; CHECK(0, "f32 %.9g -> i64 %lld, expected %lld", x[i], (long long)gl[i], (long long)el); }
        if (gu[i] != wu[i]) { bad++; CHECK(0, "f32 %.9g -> u8 %u, expected %u", x[i], gu[i], wu[i]); }
    }
    free(x);
    free(gi);
    free(gl);
    free(gu);
}

/* f16 / bf16 -> integers agree with converting their (exact) f32 value. */
static void t_half_to_int_all(void)
{
    static uint16_t all[65536];
    static float f[65536];
    static int32_t a32[65536], b32[65536];
    static int64_t a64[65536], b64[65536];
    static uint8_t a8[65536], b8[65536];
    for (uint32_t i = 0; i < 65536; i++) all[i] = (uint16_t)i;
    for (int src = KILN_F16; src <= KILN_BF16; src++) {
        kiln_to_f32(f, all, (kiln_dtype)src, 65536);
        kiln_convert(a32, KILN_I32, all, (kiln_dtype)src, 65536);
        kiln_convert(b32, KILN_I32, f, KILN_F32, 65536);
        kiln_convert(a64, KILN_I64, all, (kiln_dtype)src, 65536);
        kiln_convert(b64, KILN_I64, f, KILN_F32, 65536);
        kiln_convert(a8, KILN_U8, all, (kiln_dtype)src, 65536);
        kiln_convert(b8, KILN_U8, f, KILN_F32, 65536);
        CHECK(memcmp(a32, b32, sizeof a32) == 0, "%s -> i32 differs from via f32", kiln_dtype_name((kiln_dtype)src));
        CHECK(memcmp(a64, b64, sizeof a64) == 0, "%s -> i64 differs from via f32", kiln_dtype_name((kiln_dtype)src));
        CHECK(memcmp(a8, b8, sizeof a8) == 0, "%s -> u8 differs from via f32", kiln_dtype_name((kiln_dtype)src));
    }
    /* spot checks of the rule itself */
    uint16_t h[6] = {0x7c00, 0xfc00, 0x7e00, 0xbc00, 0x3e00, 0xc0f0}; /* inf, -inf, nan, -1, 1.5, -2.46875 */
    int32_t i32[6];
    uint8_t u8[6];
    kiln_convert(i32, KILN_I32, h, KILN_F16, 6);
    kiln_convert(u8, KILN_U8, h, KILN_F16, 6);
    CHECK(i32[0] == INT32_MAX && i32[1] == INT32_MIN && i32[2] == 0 && i32[3] == -1 && i32[4] == 1 && i32[5] == -2,
          "f16 -> i32: %d %d %d %d %d %d", i32[0], i32[1], i32[2], i32[3], i32[4], i32[5]);
    CHECK(u8[0] == 255 && u8[1] == 0 && u8[2] == 0 && u8[3] == 0 && u8[4] == 1 && u8[5] == 0,
          "f16 -> u8: %u %u %u %u %u %u", u8[0], u8[1], u8[2], u8[3], u8[4], u8[5]);
}

/* i64 and i32 -> f32 / f16 / bf16 as torch rounds them (directly from the integer). */
static void t_int_to_float(void)
{
    uint32_t n, nf, nh, nb;
    const unsigned char *in = section("I64 ", 8, &n);
    const unsigned char *wf = section("L2F ", 4, &nf);
    const unsigned char *wh = section("L2H ", 2, &nh);
    const unsigned char *wb = section("L2B ", 2, &nb);
    if (!in || !wf || !wh || !wb) return;
    CHECK(nf == n && nh == n && nb == n && n > 0, "section sizes %u %u %u %u", n, nf, nh, nb);
    if (test_cur_failed) return;
    int64_t *v = malloc((size_t)n * 8);
    int32_t *v32 = malloc((size_t)n * 4);
    float *gf = malloc((size_t)n * 4);
    uint16_t *gh = malloc((size_t)n * 2), *gb = malloc((size_t)n * 2);
    if (!v || !v32 || !gf || !gh || !gb) { CHECK(0, "out of memory"); goto done; }
    for (uint32_t i = 0; i < n; i++) v[i] = (int64_t)get_u64(in + 8 * i);
    for (int pass = 0; pass < 2; pass++) {
        /* pass 0: i64 sources; pass 1: the values that fit, as i32 */
        uint32_t m = 0;
        for (uint32_t i = 0; i < n; i++)
            if (pass == 0 || (v[i] >= INT32_MIN && v[i] <= INT32_MAX)) v32[m++] = (int32_t)v[i];
        const void *src = pass == 0 ? (const void *)v : (const void *)v32;
        kiln_dtype sdt = pass == 0 ? KILN_I64 : KILN_I32;
        uint32_t cnt = pass == 0 ? n : m;
        kiln_convert(gf, KILN_F32, src, sdt, cnt);
        kiln_convert(gh, KILN_F16, src, sdt, cnt);
        kiln_convert(gb, KILN_BF16, src, sdt, cnt);
        int bad = 0;
        for (uint32_t i = 0, k = 0; i < n && bad < 6; i++) {
            if (pass == 1 && !(v[i] >= INT32_MIN && v[i] <= INT32_MAX)) continue;
            uint32_t ef = le32(wf + 4 * i);
            uint16_t eh = (uint16_t)(wh[2 * i] | wh[2 * i + 1] << 8), eb = (uint16_t)(wb[2 * i] | wb[2 * i + 1] << 8);
            if (f2u(gf[k]) != ef) { bad++; CHECK(0, "%s %lld -> f32 %.9g, torch %.9g", kiln_dtype_name(sdt), (long long)v[i], gf[k], u2f(ef)); }
            if (gh[k] != eh) { bad++; CHECK(0, "%s %lld -> f16 0x%04x, torch 0x%04x", kiln_dtype_name(sdt), (long long)v[i], gh[k], eh); }
            if (gb[k] != eb) { bad++; CHECK(0, "%s %lld -> bf16 0x%04x, torch 0x%04x", kiln_dtype_name(sdt), (long long)v[i], gb[k], eb); }
            k++;
        }
    }
done:
    free(v);
    free(v32);
    free(gf);
    free(gh);
    free(gb);
}

/* Integer to integer: saturation; u8 from negatives is 0. */
static void t_int_to_int(void)
{
    int64_t l[8] = {0, -1, 255, 256, INT64_MAX, INT64_MIN, (int64_t)INT32_MAX + 1, (int64_t)INT32_MIN - 1};
    int32_t i[8];
    uint8_t u[8];
    int64_t back[8];
    kiln_convert(i, KILN_I32, l, KILN_I64, 8);
    kiln_convert(u, KILN_U8, l, KILN_I64, 8);
    static const int32_t wi[8] = {0, -1, 255, 256, INT32_MAX, INT32_MIN, INT32_MAX, INT32_MIN};
    static const uint8_t wu[8] = {0, 0, 255, 255, 255, 0, 255, 0};
    for (int k = 0; k < 8; k++) {
        CHECK(i[k] == wi[k], "i64 %lld -> i32 %d, expected %d", (long long)l[k], i[k], wi[k]);
        CHECK(u[k] == wu[k], "i64 %lld -> u8 %u, expected %u", (long long)l[k], u[k], wu[k]);
    }
    kiln_convert(back, KILN_I64, i, KILN_I32, 8);
    for (int k = 0; k < 8; k++) CHECK(back[k] == wi[k], "i32 %d -> i64 %lld", wi[k], (long long)back[k]);
    kiln_convert(i, KILN_I32, u, KILN_U8, 8);
    for (int k = 0; k < 8; k++) CHECK(i[k] == wu[k], "u8 %u -> i32 %d", wu[k], i[k]);
    kiln_convert(u, KILN_U8, wi, KILN_I32, 8);
    for (int k = 0; k < 8; k++) CHECK(u[k] == wu[k], "i32 %d -> u8 %u, expected %u", wi[k], u[k], wu[k]);
    /* float extremes to i64 saturate to the exact limits */
    float f[4] = {9.223372e18f, -9.223372e18f, INFINITY, 1e30f};
    kiln_convert(back, KILN_I64, f, KILN_F32, 4);
    CHECK(back[0] == INT64_MAX && back[1] == INT64_MIN && back[2] == INT64_MAX && back[3] == INT64_MAX,
          "f32 -> i64 saturation: %lld %lld %lld %lld", (long long)back[0], (long long)back[1], (long long)back[2],
          (long long)back[3]);
}

/* Same dtype copies (also overlapping, as documented) and n = 0. */
static void t_same_dtype_and_empty(void)
{
    uint16_t h[6] = {1, 2, 3, 4, 5, 6};
    kiln_convert(h + 1, KILN_F16, h, KILN_F16, 4);
    CHECK(h[0] == 1 && h[1] == 1 && h[2] == 2 && h[4] == 4 && h[5] == 6, "overlapping same-dtype copy");
    float f = 7;
    kiln_convert(&f, KILN_F32, NULL, KILN_F16, 0);
    kiln_to_f32(&f, NULL, KILN_BF16, 0);
    CHECK(f == 7, "n = 0 wrote");
}

int main(void)
{
    RUN(t_names_and_sizes);
    RUN(t_half_to_f32_all);
    RUN(t_half_to_half_all);
    RUN(t_f32_to_half);
    RUN(t_f32_to_half_array_random);
    RUN(t_f32_to_int);
    RUN(t_half_to_int_all);
    RUN(t_int_to_float);
    RUN(t_int_to_int);
    RUN(t_same_dtype_and_empty);
    free(golden);
    return test_summary();
}

/* test_gguf.c - the low-bit formats against tests/golden/gguf (an independent NumPy
 * implementation, gen_gguf.py): every block type decodes bit for bit and the
 * reference quantizers give the same bytes; fp8 both ways for every code and the
 * awkward inputs; GGUF v2/v3 reading (shapes reversed, alignment, metadata), writing
 * round trips, and malformed files built here byte by byte giving named errors. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#include "test_files.h"
#include "gguf.h"
#include "quant.h"
#include "convert.h"

#include <stdint.h>

#define GOLD "tests/golden/gguf/"
static const char *const types[] = {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"};
#define NTYPES (int)(sizeof types / sizeof types[0])

static kiln_st_file *open_or_fail(const char *path, int gguf)
{
    kiln_st_file *f = NULL;
    kiln_status st = gguf ? kiln_gguf_open(path, &f) : kiln_st_open(path, &f);
    CHECK(st == KILN_OK, "%s: %s", path, kiln_last_error());
    return st ? NULL : f;
}

static const void *entry(kiln_st_file *f, const char *name, int *idx)
{
    int i = kiln_st_find(f, name);
    CHECK(i >= 0, "no tensor %s in %s", name, f->path);
    if (idx) *idx = i;
    return i >= 0 ? kiln_st_data(f, i) : NULL;
}

static int same_f32(const float *a, const float *b, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        uint32_t x, y;
        memcpy(&x, &a[i], 4);
        memcpy(&y, &b[i], 4);
        if (x != y && !(isnan(a[i]) && isnan(b[i]))) {
            CHECK(0, "%s: element %zu is %.9g, expected %.9g", what, i, a[i], b[i]);
            return 0;
        }
    }
    return 1;
}

static void t_decode_every_type(void)
{
    kiln_st_file *g = open_or_fail(GOLD "types.gguf", 1), *e = open_or_fail(GOLD "expected.safetensors", 0);
    if (!g || !e) goto done;
    for (int t = 0; t < NTYPES; t++) {
        char name[32];
        int dt = kiln_dtype_from_name(types[t]), i;
        snprintf(name, sizeof name, "w.%s", types[t]);
        const void *raw = entry(g, name, &i);
        if (!raw) continue;
        CHECK(g->entries[i].dtype == (kiln_dtype)dt, "%s dtype %s", name, kiln_dtype_name(g->entries[i].dtype));
        CHECK(g->entries[i].ndim == 2 && g->entries[i].shape[0] == 4 && g->entries[i].shape[1] == 512, "%s shape", name);
        float *y = malloc(2048 * sizeof *y);
        kiln_quant_decode(y, raw, (kiln_dtype)dt, 2048);
        snprintf(name, sizeof name, "y.%s", types[t]);
        const float *want = entry(e, name, NULL);
        if (want) same_f32(y, want, 2048, name);
        /* the generic conversion takes the same path */
        kiln_convert(y, KILN_F32, raw, (kiln_dtype)dt, 2048);
        if (want) same_f32(y, want, 2048, "kiln_convert");
        free(y);
    }
done:
    kiln_st_release(g);
    kiln_st_release(e);
}

static void t_reference_quantizers(void)
{
    kiln_st_file *g = open_or_fail(GOLD "types.gguf", 1), *e = open_or_fail(GOLD "expected.safetensors", 0);
    if (!g || !e) goto done;
    for (int t = 0; t < NTYPES; t++) {
        char name[32];
        int dt = kiln_dtype_from_name(types[t]), i;
        snprintf(name, sizeof name, "x.%s", types[t]);
        const float *x = entry(e, name, NULL);
        snprintf(name, sizeof name, "w.%s", types[t]);
        const uint8_t *want = entry(g, name, &i);
        if (!x || !want) continue;
        size_t nb = kiln_dtype_nbytes((kiln_dtype)dt, 2048);
        CHECK(nb == g->entries[i].end - g->entries[i].begin, "%s: %zu bytes", name, nb);
        uint8_t *q = malloc(nb);
        kiln_quant_encode(q, (kiln_dtype)dt, x, 2048);
        size_t bad = 0;
        while (bad < nb && q[bad] == want[bad]) bad++;
        CHECK(bad == nb, "%s: byte %zu of %zu is 0x%02x, the reference quantizer wrote 0x%02x (block %zu)", types[t],
              bad, nb, bad < nb ? q[bad] : 0, bad < nb ? want[bad] : 0, bad / kiln_dtype_block_bytes((kiln_dtype)dt));
        free(q);
    }
done:
    kiln_st_release(g);
    kiln_st_release(e);
}

static void t_fp8(void)
{
    kiln_st_file *e = open_or_fail(GOLD "expected.safetensors", 0), *f = open_or_fail(GOLD "fp8.safetensors", 0);
    if (!e || !f) goto done;
    const float *v4 = entry(e, "f8.e4m3fn", NULL), *v5 = entry(e, "f8.e5m2", NULL);
    int i4, i5;
    const uint8_t *c4 = entry(f, "e4m3", &i4), *c5 = entry(f, "e5m2", &i5);
    if (!v4 || !v5 || !c4 || !c5) goto done;
    CHECK(f->entries[i4].dtype == KILN_F8_E4M3FN && f->entries[i5].dtype == KILN_F8_E5M2, "fp8 safetensors dtypes");
    float a[256], b[256];
    for (int c = 0; c < 256; c++) {
        a[c] = kiln_f8_e4m3fn_to_f32((uint8_t)c);
        b[c] = kiln_f8_e5m2_to_f32((uint8_t)c);
    }
    same_f32(a, v4, 256, "e4m3fn values");
    same_f32(b, v5, 256, "e5m2 values");
    kiln_to_f32(a, c4, KILN_F8_E4M3FN, 256);
    same_f32(a, v4, 256, "e4m3fn bulk");
    kiln_to_f32(b, c5, KILN_F8_E5M2, 256);
    same_f32(b, v5, 256, "e5m2 bulk");
    int ii, k4, k5;
    const float *in = entry(e, "f8.in", &ii);
    const uint8_t *w4 = entry(e, "f8.in_e4m3fn", &k4), *w5 = entry(e, "f8.in_e5m2", &k5);
    if (!in || !w4 || !w5) goto done;
    int64_t n = e->entries[ii].shape[0], bad4 = 0, bad5 = 0;
    for (int64_t i = 0; i < n; i++) {
        uint8_t g4 = kiln_f32_to_f8_e4m3fn(in[i]), g5 = kiln_f32_to_f8_e5m2(in[i]);
        if (g4 != w4[i] && bad4++ < 4) CHECK(0, "e4m3fn(%.9g) = 0x%02x, expected 0x%02x", in[i], g4, w4[i]);
        if (g5 != w5[i] && bad5++ < 4) CHECK(0, "e5m2(%.9g) = 0x%02x, expected 0x%02x", in[i], g5, w5[i]);
    }
    CHECK(!bad4 && !bad5, "%lld / %lld inputs differ", (long long)(bad4 + bad5), (long long)n);
done:
    kiln_st_release(e);
    kiln_st_release(f);
}

static const char *meta(const kiln_st_file *f, const char *key)
{
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_keys[i], key) == 0) return f->meta_values[i];
    return NULL;
}

static void t_header_and_metadata(void)
{
    kiln_st_file *g = open_or_fail(GOLD "types.gguf", 1);
    if (!g) return;
    const char *want[][2] = {{"general.architecture", "sd1"}, {"general.alignment", "64"}, {"test.f32", "0.5"},
                             {"test.bool", "true"}, {"test.i64", "-5"}, {"test.strings", "[array of 2]"},
                             {"test.ints", "[array of 3]"}};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const char *v = meta(g, want[i][0]);
        CHECK(v && strcmp(v, want[i][1]) == 0, "%s = %s, expected %s", want[i][0], v ? v : "(none)", want[i][1]);
    }
    for (int i = 0; i < g->n; i++)
        CHECK((g->data - (const uint8_t *)g->map + g->entries[i].begin) % 64 == 0, "%s not 64-aligned", g->entries[i].name);
    int b;
    const float *bias = entry(g, "bias", &b);
    if (bias) CHECK(g->entries[b].ndim == 1 && g->entries[b].shape[0] == 7 && bias[6] == 6.0f, "bias");
    kiln_st_release(g);
    kiln_st_file *v2 = open_or_fail(GOLD "v2.gguf", 1);
    if (v2) {
        int i;
        entry(v2, "v2.q8_0", &i);
        CHECK(i >= 0 && v2->entries[i].dtype == KILN_Q8_0 && v2->entries[i].shape[0] == 1 && v2->entries[i].shape[1] == 32,
              "v2 tensor");
        kiln_st_release(v2);
    }
    /* kiln_weights_open tells the formats apart by the magic */
    kiln_st_file *w = NULL;
    CHECK(kiln_weights_open(GOLD "types.gguf", &w) == KILN_OK && w && w->n == 12, "weights_open gguf");
    kiln_st_release(w);
    CHECK(kiln_weights_open(GOLD "fp8.safetensors", &w) == KILN_OK && w && w->n == 2, "weights_open safetensors");
    kiln_st_release(w);
}

static void t_save_round_trip(void)
{
    float x[2 * 256];
    for (int i = 0; i < 512; i++) x[i] = sinf((float)i * 0.37f) * (float)(i % 7);
    uint8_t q[2 * 210];
    kiln_quant_encode(q, KILN_Q6_K, x, 512);
    uint16_t h[3] = {0x3c00, 0xc000, 0x0001};
    int64_t s1[2] = {2, 256}, s2[1] = {3};
    kiln_st_item items[2] = {{"a.q6", KILN_Q6_K, 2, s1, q}, {"b.h", KILN_F16, 1, s2, h}};
    const char *keys[1] = {"general.architecture"}, *vals[1] = {"sdxl"};
    const char *path = tmp_path("rt.gguf");
    CHECK(kiln_gguf_save(path, 2, items, 1, keys, vals) == KILN_OK, "save: %s", kiln_last_error());
    kiln_st_file *f = open_or_fail(path, 1);
    if (!f) return;
    int i;
    const uint8_t *got = entry(f, "a.q6", &i);
    CHECK(got && memcmp(got, q, sizeof q) == 0 && f->entries[i].shape[0] == 2 && f->entries[i].shape[1] == 256, "q6_k tensor");
    const uint16_t *gh = entry(f, "b.h", NULL);
    CHECK(gh && memcmp(gh, h, sizeof h) == 0, "f16 tensor");
    const char *arch = meta(f, "general.architecture");
    CHECK(arch && strcmp(arch, "sdxl") == 0, "metadata");
    kiln_st_release(f);
    /* a block type needs whole blocks in the last dimension; fp8 has no GGUF type */
    int64_t s3[2] = {256, 2};
    kiln_st_item bad = {"bad", KILN_Q6_K, 2, s3, q};
    CHECK(kiln_gguf_save(tmp_path("bad.gguf"), 1, &bad, 0, NULL, NULL) == KILN_ERR_ARG, "rows not whole blocks accepted");
    kiln_st_item f8 = {"f8", KILN_F8_E4M3FN, 1, s2, h};
    CHECK(kiln_gguf_save(tmp_path("bad.gguf"), 1, &f8, 0, NULL, NULL) == KILN_ERR_ARG, "fp8 accepted");
}

/* ---- malformed files ---- */

typedef struct { uint8_t b[4096]; size_t n; } buf;
static void put(buf *b, const void *p, size_t n) { memcpy(b->b + b->n, p, n); b->n += n; }
static void put32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put64(buf *b, uint64_t v) { put(b, &v, 8); }
static void putstr(buf *b, const char *s) { put64(b, strlen(s)); put(b, s, strlen(s)); }

/* header with one tensor "blk.w" of type `type`, ne = {32, rows}, then `data` bytes */
static buf one_tensor(uint32_t version, uint64_t n_tensors, uint32_t type, uint64_t rows, uint64_t offset, size_t data)
{
    buf b = {{0}, 0};
    put(&b, "GGUF", 4);
    put32(&b, version);
    put64(&b, n_tensors);
    put64(&b, 1);
    putstr(&b, "general.architecture");
    put32(&b, 8);
    putstr(&b, "sd1");
    putstr(&b, "blk.w");
    put32(&b, 2);
    put64(&b, 32);
    put64(&b, rows);
    put32(&b, type);
    put64(&b, offset);
    b.n = (b.n + 31) / 32 * 32;
    memset(b.b + b.n, 0x11, data);
    b.n += data;
    return b;
}

static void expect_error(buf *b, const char *name, kiln_status code, const char *part1, const char *part2)
{
    const char *path = tmp_path(name);
    write_file(path, b->b, b->n);
    kiln_st_file *f = NULL;
    kiln_status st = kiln_gguf_open(path, &f);
    const char *msg = kiln_last_error();
    CHECK(st == code, "%s: status %d, expected %d (%s)", name, (int)st, (int)code, msg);
    CHECK(strstr(msg, path) != NULL, "%s: the message does not name the file: %s", name, msg);
    CHECK(strstr(msg, part1) != NULL, "%s: no '%s' in: %s", name, part1, msg);
    if (part2) CHECK(strstr(msg, part2) != NULL, "%s: no '%s' in: %s", name, part2, msg);
    kiln_st_release(f);
}

static void t_bad_files(void)
{
    buf ok = one_tensor(3, 1, 8, 2, 0, 68);
    const char *path = tmp_path("ok.gguf");
    write_file(path, ok.b, ok.n);
    kiln_st_file *f = NULL;
    CHECK(kiln_gguf_open(path, &f) == KILN_OK, "the well-formed one: %s", kiln_last_error());
    kiln_st_release(f);

    buf b = one_tensor(3, 1, 99, 2, 0, 68);
    expect_error(&b, "type.gguf", KILN_ERR_FORMAT, "unknown GGUF type 99", "'blk.w'");
    b = one_tensor(3, 1, 11, 2, 0, 68);
    expect_error(&b, "q3k.gguf", KILN_ERR_UNSUPPORTED, "q3_K is not supported", "'blk.w'");
    b = one_tensor(3, 1, 8, 2, 0, 40);
    expect_error(&b, "trunc.gguf", KILN_ERR_FORMAT, "data truncated", "'blk.w'");
    b = one_tensor(3, 1, 8, 2, 7, 200);
    expect_error(&b, "align.gguf", KILN_ERR_FORMAT, "not a multiple of the alignment", "'blk.w'");
    b = one_tensor(3, 1, 8, (uint64_t)1 << 50, 0, 68);
    expect_error(&b, "huge.gguf", KILN_ERR_FORMAT, "shape too large", "'blk.w'");
    b = one_tensor(3, (uint64_t)1 << 60, 8, 2, 0, 68);
    expect_error(&b, "count.gguf", KILN_ERR_FORMAT, "cannot fit", NULL);
    b = one_tensor(1, 1, 8, 2, 0, 68);
    expect_error(&b, "v1.gguf", KILN_ERR_UNSUPPORTED, "version 1", NULL);
    b = one_tensor(3, 1, 8, 2, 0, 68);
    memcpy(b.b, "GGUX", 4);
    expect_error(&b, "magic.gguf", KILN_ERR_FORMAT, "not a GGUF file", NULL);
    b = one_tensor(3, 1, 8, 2, 0, 68);
    b.b[24] = 0xff; /* the first key's length: far past the end */
    b.b[30] = 0x7f;
    expect_error(&b, "strlen.gguf", KILN_ERR_FORMAT, "past the end", NULL);
    b = one_tensor(3, 1, 8, 2, 0, 68);
    b.n = 60; /* cut inside the tensor infos */
    expect_error(&b, "cut.gguf", KILN_ERR_FORMAT, "truncated header", NULL);
    b = one_tensor(3, 1, 2, 3, 0, 68); /* q4_0 with ne0 = 32 is fine; make ne0 33 */
    memcpy(b.b + 24 + 8 + 20 + 4 + 8 + 3 + 8 + 5 + 4, &(uint64_t){33}, 8);
    expect_error(&b, "blocks.gguf", KILN_ERR_FORMAT, "not whole blocks", "'blk.w'");
}

int main(void)
{
    if (!test_tmpdir_make("gguf")) return 1;
    RUN(t_decode_every_type);
    RUN(t_reference_quantizers);
    RUN(t_fp8);
    RUN(t_header_and_metadata);
    RUN(t_save_round_trip);
    RUN(t_bad_files);
    test_tmpdir_remove();
    return test_summary();
}

/* test_safetensors.c - reading the Python-written golden, save/open round trips of
 * every dtype, and the validation of malformed files built here byte by byte;
 * saves are atomic (a failing save leaves the old file byte-identical). */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#include "test_files.h"
#include "safetensors.h"
#include "json.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

/* Writes u64 hlen, the header text, then data_size bytes of 0x5a. */
static const char *make_st(const char *name, uint64_t hlen, const char *header, size_t data_size)
{
    size_t h = strlen(header), n = 8 + h + data_size;
    unsigned char *b = malloc(n);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(b + 8, header, h);
    memset(b + 8 + h, 0x5a, data_size);
    const char *path = tmp_path(name);
    write_file(path, b, n);
    free(b);
    return path;
}

static void t_golden(void)
{
    const char *path = "tests/golden/safetensors/ref.safetensors";
    kiln_st_file *f = NULL;
    kiln_status st = kiln_st_open(path, &f);
    CHECK(st == KILN_OK, "open: %s", kiln_last_error());
    if (st) return;
    CHECK(f->n == 10 && f->refcount == 1, "n = %d", f->n);
    for (int i = 1; i < f->n; i++) CHECK(f->entries[i - 1].begin <= f->entries[i].begin, "entries sorted by offset");
    CHECK(strcmp(f->entries[0].name, "u8.vals") == 0, "first entry in file order is '%s'", f->entries[0].name);

    int i = kiln_st_find(f, "f32.mat");
    CHECK(i >= 0 && f->entries[i].dtype == KILN_F32 && f->entries[i].ndim == 2 && f->entries[i].shape[0] == 2 &&
              f->entries[i].shape[1] == 3, "f32.mat");
    if (i >= 0) {
        float v[6]; /* copied: files from other writers need not align tensors */
        memcpy(v, kiln_st_data(f, i), sizeof v);
        for (int k = 0; k < 6; k++) CHECK(v[k] == k * 0.5f - 1.0f, "f32.mat[%d] = %g", k, v[k]);
    }
    i = kiln_st_find(f, "f16.vals");
    CHECK(i >= 0, "f16.vals");
    if (i >= 0) {
        uint16_t h[4];
        memcpy(h, kiln_st_data(f, i), sizeof h);
        CHECK(kiln_f16_to_f32(h[0]) == 1.0f && kiln_f16_to_f32(h[1]) == -2.0f && kiln_f16_to_f32(h[2]) == 0.5f &&
                  kiln_f16_to_f32(h[3]) == 65504.0f, "f16 values");
    }
    i = kiln_st_find(f, "bf16.vals");
    CHECK(i >= 0 && f->entries[i].dtype == KILN_BF16, "bf16.vals");
    if (i >= 0) {
        uint16_t h[2];
        memcpy(h, kiln_st_data(f, i), sizeof h);
        CHECK(kiln_bf16_to_f32(h[0]) == 1.5f && kiln_bf16_to_f32(h[1]) == -3.0f, "bf16 values");
    }
    i = kiln_st_find(f, "i32.vals");
    CHECK(i >= 0 && f->entries[i].dtype == KILN_I32, "i32.vals");
    if (i >= 0) {
        int32_t v[3];
        memcpy(v, kiln_st_data(f, i), sizeof v);
        CHECK(v[0] == -1 && v[1] == 0 && v[2] == INT32_MAX, "i32 values");
    }
    i = kiln_st_find(f, "i64.vals");
    CHECK(i >= 0 && f->entries[i].dtype == KILN_I64, "i64.vals");
    if (i >= 0) {
        int64_t v[2];
        memcpy(v, kiln_st_data(f, i), sizeof v);
        CHECK(v[0] == INT64_MIN && v[1] == 42, "i64 values");
    }
    i = kiln_st_find(f, "u8.vals");
    CHECK(i >= 0 && f->entries[i].dtype == KILN_U8, "u8.vals");
    if (i >= 0)
        CHECK(memcmp(kiln_st_data(f, i), "\x00\x01\x7f\x80\xff", 5) == 0, "u8 values");
    i = kiln_st_find(f, "scalar");
    CHECK(i >= 0 && f->entries[i].ndim == 0 && f->entries[i].end - f->entries[i].begin == 4, "scalar");
    if (i >= 0) {
        float v;
        memcpy(&v, kiln_st_data(f, i), 4);
        CHECK(v == 3.25f, "scalar value %g", v);
    }
    i = kiln_st_find(f, "zero.size");
    CHECK(i >= 0 && f->entries[i].ndim == 2 && f->entries[i].shape[0] == 0 && f->entries[i].begin == f->entries[i].end,
          "zero.size");
    i = kiln_st_find(f, "na\xc3\xafve/\xc3\xbc.weight"); /* \u escapes decoded to UTF-8 */
    CHECK(i >= 0 && f->entries[i].ndim == 3, "non-ASCII name");
    i = kiln_st_find(f, "emoji\xf0\x9f\x98\x80");
    CHECK(i >= 0 && *(const uint8_t *)kiln_st_data(f, i) == 42, "surrogate pair name");
    CHECK(kiln_st_find(f, "nope") == -1 && kiln_st_find(f, "") == -1 && kiln_st_find(f, NULL) == -1, "absent names");

    CHECK(f->n_meta == 2, "n_meta %d", f->n_meta);
    for (int k = 0; k < f->n_meta; k++) {
        if (strcmp(f->meta_keys[k], "format") == 0) CHECK(strcmp(f->meta_values[k], "pt") == 0, "format");
        else CHECK(strcmp(f->meta_keys[k], "note") == 0 &&
                       strcmp(f->meta_values[k], "h\xc3\xa9llo \"q\" \\ \xe2\x98\x95") == 0, "note '%s'", f->meta_values[k]);
    }

    /* the mapping outlives the first release while a reference remains */
    const void *p = kiln_st_data(f, kiln_st_find(f, "u8.vals"));
    kiln_st_retain(f);
    CHECK(f->refcount == 2, "refcount %d", f->refcount);
    kiln_st_release(f);
    CHECK(memcmp(p, "\x00\x01\x7f\x80\xff", 5) == 0, "data alive after release");
    kiln_st_release(f);
    kiln_st_release(NULL);
}

static void t_roundtrip(void)
{
    float f32[6] = {1.5f, -2.25f, 0.0f, 1e-30f, 3e38f, -0.0f};
    uint16_t f16[3] = {kiln_f32_to_f16(1.0f), kiln_f32_to_f16(-0.5f), 0x7c00};
    uint16_t bf16[2] = {kiln_f32_to_bf16(2.0f), kiln_f32_to_bf16(-1e20f)};
    int32_t i32[2] = {INT32_MIN, 7};
    int64_t i64[3] = {INT64_MAX, -1, 0};
    uint8_t u8[3] = {0, 200, 255};
    float scalar = 9.5f;
    int64_t s_f32[2] = {2, 3}, s_f16[1] = {3}, s_bf16[2] = {1, 2}, s_i32[1] = {2}, s_i64[1] = {3}, s_u8[3] = {1, 3, 1},
            s_zero[2] = {4, 0};
    kiln_st_item items[] = {
        {"u8", KILN_U8, 3, s_u8, u8},
        {"weird \"name\"\\\n\t\x01 caf\xc3\xa9 \xe2\x98\x95", KILN_F16, 1, s_f16, f16},
        {"f32", KILN_F32, 2, s_f32, f32},
        {"bf16", KILN_BF16, 2, s_bf16, bf16},
        {"i32", KILN_I32, 1, s_i32, i32},
        {"i64", KILN_I64, 1, s_i64, i64},
        {"scalar", KILN_F32, 0, NULL, &scalar},
        {"zero", KILN_F32, 2, s_zero, NULL},
    };
    int n = (int)(sizeof items / sizeof items[0]);
    const char *mk[] = {"format", "k\"ey\n", "utf8"};
    const char *mv[] = {"pt", "", "caf\xc3\xa9 \xe2\x98\x95 \xf0\x9f\x98\x80"};
    const char *path = tmp_path("rt.safetensors");
    kiln_status st = kiln_st_save(path, n, items, 3, mk, mv);
    CHECK(st == KILN_OK, "save: %s", kiln_last_error());
    if (st) return;
    CHECK(count_tmp_files() == 0, "temporary file left behind");

    kiln_st_file *f = NULL;
    st = kiln_st_open(path, &f);
    CHECK(st == KILN_OK, "open: %s", kiln_last_error());
    if (st) return;
    CHECK(f->n == n, "n %d", f->n);
    uint64_t at = 0;
    for (int k = 0; k < f->n; k++) {
        const kiln_st_entry *e = &f->entries[k];
        /* contiguous (the reference reader rejects gaps) and naturally aligned */
        CHECK(e->begin == at, "'%s' begins at %llu, expected %llu", e->name, (unsigned long long)e->begin,
              (unsigned long long)at);
        CHECK(((uintptr_t)kiln_st_data(f, k)) % kiln_dtype_size(e->dtype) == 0, "'%s' misaligned", e->name);
        at = e->end;
    }
    CHECK(at == f->data_size, "data section %llu bytes, tensors end at %llu", (unsigned long long)f->data_size,
          (unsigned long long)at);
    CHECK((uintptr_t)(f->data - (const uint8_t *)f->map) % 8 == 0, "header not padded to 8");
    for (int k = 0; k < n; k++) {
        int i = kiln_st_find(f, items[k].name);
        CHECK(i >= 0, "'%s' missing", items[k].name);
        if (i < 0) continue;
        const kiln_st_entry *e = &f->entries[i];
        CHECK(e->dtype == items[k].dtype && e->ndim == items[k].ndim, "'%s' dtype/ndim", items[k].name);
        size_t nb = kiln_dtype_size(e->dtype);
        for (int d = 0; d < e->ndim; d++) {
            CHECK(e->shape[d] == items[k].shape[d], "'%s' dim %d", items[k].name, d);
            nb *= (size_t)e->shape[d];
        }
        CHECK(e->end - e->begin == nb, "'%s' size", items[k].name);
        if (nb) CHECK(memcmp(kiln_st_data(f, i), items[k].data, nb) == 0, "'%s' data differ", items[k].name);
    }
    CHECK(f->n_meta == 3, "n_meta %d", f->n_meta);
    for (int k = 0; k < 3 && k < f->n_meta; k++)
        CHECK(strcmp(f->meta_keys[k], mk[k]) == 0 && strcmp(f->meta_values[k], mv[k]) == 0, "meta %d", k);
    kiln_st_release(f);

    /* an empty file: no tensors, no metadata */
    path = tmp_path("empty.safetensors");
    st = kiln_st_save(path, 0, NULL, 0, NULL, NULL);
    CHECK(st == KILN_OK, "save empty: %s", kiln_last_error());
    st = kiln_st_open(path, &f);
    CHECK(st == KILN_OK && f->n == 0 && f->n_meta == 0 && f->data_size == 0, "open empty: %s", kiln_last_error());
    if (!st) kiln_st_release(f);
    size_t len;
    unsigned char *b = read_file(path, &len);
    CHECK(b && len == 16 && memcmp(b, "\x08\0\0\0\0\0\0\0{}      ", 16) == 0, "empty file bytes");
    free(b);
}

/* The header the reader produced must also be what another JSON reader sees. */
static void t_header_json(void)
{
    int64_t s[1] = {2};
    float v[2] = {1, 2};
    kiln_st_item it = {"a\"b", KILN_F32, 1, s, v};
    const char *k = "m", *val = "x\ty";
    const char *path = tmp_path("hdr.safetensors");
    CHECK(kiln_st_save(path, 1, &it, 1, &k, &val) == KILN_OK, "%s", kiln_last_error());
    size_t n;
    unsigned char *b = read_file(path, &n);
    if (!b) return;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
    CHECK(hlen % 8 == 0 && 8 + hlen + 8 == n, "hlen %llu, file %zu", (unsigned long long)hlen, n);
    kiln_json *j = NULL;
    CHECK(kiln_json_parse((const char *)b + 8, (size_t)hlen, &j) == KILN_OK, "%s", kiln_last_error());
    const kiln_json *e = kiln_json_get(j, "a\"b"), *m = kiln_json_get(kiln_json_get(j, "__metadata__"), "m");
    CHECK(e && kiln_json_get(e, "dtype") && strcmp(kiln_json_get(e, "dtype")->string, "F32") == 0, "entry");
    CHECK(m && strcmp(m->string, "x\ty") == 0, "metadata");
    kiln_json_free(j);
    free(b);
}

static void t_malformed(void)
{
    struct { const char *what; const char *header; long hlen; size_t data; const char *want; kiln_status code; } cases[] = {
        {"garbage json", "{not json", -1, 0, "not valid JSON", KILN_ERR_FORMAT},
        {"root array", "[1, 2]", -1, 0, "not a JSON object", KILN_ERR_FORMAT},
        {"entry not object", "{\"x\": 5}", -1, 0, "tensor 'x'", KILN_ERR_FORMAT},
        {"no dtype", "{\"x\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': missing 'dtype'", KILN_ERR_FORMAT},
        {"no shape", "{\"x\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': missing 'shape'", KILN_ERR_FORMAT},
        {"no offsets", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1]}}", -1, 4, "tensor 'x': missing 'data_offsets'", KILN_ERR_FORMAT},
        {"dtype unknown", "{\"x\": {\"dtype\": \"F33\", \"shape\": [1], \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': unknown dtype 'F33'", KILN_ERR_FORMAT},
        {"dtype lower", "{\"x\": {\"dtype\": \"f32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': unknown dtype", KILN_ERR_FORMAT},
        {"dtype number", "{\"x\": {\"dtype\": 5, \"shape\": [1], \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': dtype", KILN_ERR_FORMAT},
        {"dtype F64", "{\"x\": {\"dtype\": \"F64\", \"shape\": [1], \"data_offsets\": [0, 8]}}", -1, 8, "tensor 'x': unsupported dtype F64", KILN_ERR_UNSUPPORTED},
        {"dtype I8", "{\"x\": {\"dtype\": \"I8\", \"shape\": [1], \"data_offsets\": [0, 1]}}", -1, 1, "tensor 'x': unsupported dtype I8", KILN_ERR_UNSUPPORTED},
        {"dtype BOOL", "{\"x\": {\"dtype\": \"BOOL\", \"shape\": [1], \"data_offsets\": [0, 1]}}", -1, 1, "tensor 'x': unsupported dtype BOOL", KILN_ERR_UNSUPPORTED},
        {"shape not array", "{\"x\": {\"dtype\": \"F32\", \"shape\": 4, \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': shape", KILN_ERR_FORMAT},
        {"negative dim", "{\"x\": {\"dtype\": \"F32\", \"shape\": [-1, 2], \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': negative dimension -1", KILN_ERR_FORMAT},
        {"fractional dim", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1.5], \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': shape must hold integers", KILN_ERR_FORMAT},
        {"string dim", "{\"x\": {\"dtype\": \"F32\", \"shape\": [\"1\"], \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': shape must hold integers", KILN_ERR_FORMAT},
        {"9 dims", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 4]}}", -1, 4, "tensor 'x': shape has 9 dimensions", KILN_ERR_FORMAT},
        {"numel overflow", "{\"x\": {\"dtype\": \"F32\", \"shape\": [4611686018427387904, 4611686018427387904], \"data_offsets\": [0, 0]}}", -1, 0, "tensor 'x': shape [4611686018427387904, 4611686018427387904] overflows", KILN_ERR_FORMAT},
        {"bytes overflow", "{\"x\": {\"dtype\": \"I64\", \"shape\": [4611686018427387904], \"data_offsets\": [0, 0]}}", -1, 0, "tensor 'x': shape [4611686018427387904] overflows", KILN_ERR_FORMAT},
        {"dim too big for int64", "{\"x\": {\"dtype\": \"U8\", \"shape\": [9223372036854775808], \"data_offsets\": [0, 0]}}", -1, 0, "tensor 'x': shape must hold integers", KILN_ERR_FORMAT},
        {"offsets mismatch", "{\"x.weight\": {\"dtype\": \"F32\", \"shape\": [2, 2], \"data_offsets\": [0, 12]}}", -1, 16,
         "tensor 'x.weight': data_offsets [0, 12] do not match shape [2, 2] of F32 (16 bytes)", KILN_ERR_FORMAT},
        {"offsets past end", "{\"x\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}", -1, 8, "tensor 'x': data_offsets [4, 12] go past the data section (8 bytes)", KILN_ERR_FORMAT},
        {"offsets reversed", "{\"x\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 0]}}", -1, 8, "tensor 'x': data_offsets [4, 0]", KILN_ERR_FORMAT},
        {"offsets negative", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}", -1, 8, "tensor 'x': data_offsets must be", KILN_ERR_FORMAT},
        {"offsets one", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}", -1, 8, "tensor 'x': data_offsets is not", KILN_ERR_FORMAT},
        {"offsets three", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}", -1, 8, "tensor 'x': data_offsets is not", KILN_ERR_FORMAT},
        {"offsets float", "{\"x\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4.0]}}", -1, 8, "tensor 'x': data_offsets must be", KILN_ERR_FORMAT},
        {"offsets huge", "{\"x\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [18446744073709551615, 0]}}", -1, 8, "tensor 'x': data_offsets must be", KILN_ERR_FORMAT},
        {"overlap", "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]}, \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}", -1, 12,
         "tensors 'a' [0, 8] and 'b' [4, 12] overlap", KILN_ERR_FORMAT},
        {"same span", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}, \"b\": {\"dtype\": \"I32\", \"shape\": [1], \"data_offsets\": [0, 4]}}", -1, 4,
         "overlap", KILN_ERR_FORMAT},
        {"nested overlap", "{\"a\": {\"dtype\": \"U8\", \"shape\": [10], \"data_offsets\": [0, 10]}, \"c\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [3, 4]}, \"b\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [1, 3]}}", -1, 10,
         "tensors 'a' [0, 10] and 'b' [1, 3] overlap", KILN_ERR_FORMAT},
        {"duplicate name", "{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]}, \"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1, 2]}}", -1, 2,
         "tensor 'a' appears twice", KILN_ERR_FORMAT},
        {"NUL in name", "{\"a\\u0000b\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]}}", -1, 1, "NUL", KILN_ERR_FORMAT},
        {"metadata not object", "{\"__metadata__\": [\"a\"]}", -1, 0, "__metadata__ is not an object", KILN_ERR_FORMAT},
        {"metadata number", "{\"__metadata__\": {\"epochs\": 3}}", -1, 0, "__metadata__ value of 'epochs' is not a string", KILN_ERR_FORMAT},
        {"metadata nested", "{\"__metadata__\": {\"cfg\": {\"a\": \"b\"}}}", -1, 0, "__metadata__ value of 'cfg' is not a string", KILN_ERR_FORMAT},
        {"metadata twice", "{\"__metadata__\": {}, \"__metadata__\": {}}", -1, 0, "__metadata__ appears twice", KILN_ERR_FORMAT},
        {"metadata dup key", "{\"__metadata__\": {\"k\": \"1\", \"k\": \"2\"}}", -1, 0, "'k' appears twice", KILN_ERR_FORMAT},
        {"header beyond file", "{}", 1000, 0, "header length 1000 goes past the end of the file", KILN_ERR_FORMAT},
        {"header cut mid-json", "{\"x\": {\"dtype\": \"F32\"}}", 10, 0, "not valid JSON", KILN_ERR_FORMAT},
        {"header huge", "{}", (long)1 << 40, 0, "goes past the end", KILN_ERR_FORMAT},
        {"header u64 max", "{}", -2, 0, "goes past the end", KILN_ERR_FORMAT},
        {"header empty", "", 0, 0, "not valid JSON", KILN_ERR_FORMAT},
        {"trailing data in header", "{} x", -1, 0, "not valid JSON", KILN_ERR_FORMAT},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char name[64];
        snprintf(name, sizeof name, "bad%02zu.safetensors", c);
        uint64_t hlen = cases[c].hlen == -1 ? strlen(cases[c].header) : cases[c].hlen == -2 ? UINT64_MAX : (uint64_t)cases[c].hlen;
        const char *path = make_st(name, hlen, cases[c].header, cases[c].data);
        kiln_st_file *f = (kiln_st_file *)&f;
        kiln_status st = kiln_st_open(path, &f);
        const char *msg = kiln_last_error();
        CHECK(st == cases[c].code, "%s: status %s (%s)", cases[c].what, kiln_status_name(st), st ? msg : "opened");
        CHECK(f == NULL, "%s: *out not NULL", cases[c].what);
        if (st == KILN_OK) { kiln_st_release(f); continue; }
        CHECK(strstr(msg, path) != NULL, "%s: message lacks the file name: %s", cases[c].what, msg);
        CHECK(strstr(msg, cases[c].want) != NULL, "%s: message '%s' lacks '%s'", cases[c].what, msg, cases[c].want);
    }

    /* files too small, missing, a folder */
    for (size_t n = 0; n < 8; n++) {
        const char *path = tmp_path("small.safetensors");
        write_file(path, "\x02\0\0\0\0\0\0\0", n);
        kiln_st_file *f = NULL;
        kiln_status st = kiln_st_open(path, &f);
        CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), "too small") && strstr(kiln_last_error(), path),
              "%zu-byte file: %s", n, kiln_last_error());
    }
    /* a header length within the file but above the 100 MB limit (sparse file) */
    const char *sparse = make_st("sparse.safetensors", (uint64_t)150 << 20, "{", 0);
    kiln_st_file *f = NULL;
    kiln_status st;
    if (truncate(sparse, (off_t)200 << 20) == 0) {
        st = kiln_st_open(sparse, &f);
        CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), "limit") && strstr(kiln_last_error(), sparse),
              "huge header: %s", kiln_last_error());
    }
    unlink(sparse);
    st = kiln_st_open(tmp_path("missing.safetensors"), &f);
    CHECK(st == KILN_ERR_IO && strstr(kiln_last_error(), "missing.safetensors"), "missing file: %s", kiln_last_error());
    st = kiln_st_open(tmpdir, &f);
    CHECK(st == KILN_ERR_IO && strstr(kiln_last_error(), tmpdir), "folder: %s", kiln_last_error());
    CHECK(kiln_st_open(NULL, &f) == KILN_ERR_ARG && kiln_st_open("x", NULL) == KILN_ERR_ARG, "NULL arguments");
}

/* Every truncation of a valid file must fail cleanly (and never read past it). */
static void t_truncated(void)
{
    size_t n;
    unsigned char *full = read_file("tests/golden/safetensors/ref.safetensors", &n);
    CHECK(full != NULL, "golden missing");
    if (!full) return;
    const char *path = tmp_path("trunc.safetensors");
    for (size_t k = 0; k < n; k++) {
        write_file(path, full, k);
        kiln_st_file *f = NULL;
        kiln_status st = kiln_st_open(path, &f);
        CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), path), "truncated to %zu: %s (%s)", k,
              kiln_status_name(st), kiln_last_error());
        if (!st) kiln_st_release(f);
    }
    /* single-byte corruption of the header: any outcome but a crash or a wrong status */
    for (size_t k = 8; k < 8 + 200 && k < n; k++) {
        unsigned char *m = malloc(n);
        memcpy(m, full, n);
        m[k] ^= 0x41;
        write_file(path, m, n);
        free(m);
        kiln_st_file *f = NULL;
        kiln_status st = kiln_st_open(path, &f);
        CHECK(st == KILN_OK || st == KILN_ERR_FORMAT || st == KILN_ERR_UNSUPPORTED, "corrupt byte %zu: %d", k, st);
        if (!st) kiln_st_release(f);
    }
    free(full);
}

/* A file that puts a tensor at an address its elements cannot be read from (an
 * unpadded header, an F32 after three bytes) still opens: its data is copied once
 * into aligned memory, each tensor aligned, the values unchanged. */
static void t_misaligned(void)
{
    static const char header[] = "{\"m\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[0,3]},"
                                 "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[3,11]}}";
    size_t h = strlen(header), n = 8 + h + 11;
    unsigned char *buf = calloc(1, n);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, header, h);
    const float vals[2] = {1.5f, -2.0f};
    memcpy(buf + 8 + h, "\x01\x02\x03", 3);
    memcpy(buf + 8 + h + 3, vals, sizeof vals);
    const char *path = tmp_path("misaligned.safetensors");
    write_file(path, buf, n);
    free(buf);
    kiln_st_file *f = NULL;
    CHECK(kiln_st_open(path, &f) == KILN_OK, "%s", kiln_last_error());
    if (!f) return;
    int ib = kiln_st_find(f, "b"), im = kiln_st_find(f, "m");
    CHECK(ib >= 0 && im >= 0, "both tensors found");
    if (ib >= 0 && im >= 0) {
        const float *b = kiln_st_data(f, ib);
        const unsigned char *m = kiln_st_data(f, im);
        CHECK((uintptr_t)b % sizeof(float) == 0, "F32 tensor at %p", (const void *)b);
        CHECK(memcmp(b, vals, sizeof vals) == 0 && m[0] == 1 && m[2] == 3, "values survive the copy");
        CHECK(f->entries[ib].end - f->entries[ib].begin == 8 && f->entries[ib].end <= f->data_size, "span in the copy");
    }
    CHECK(kiln_st_check(f) == KILN_OK, "%s", kiln_last_error());
    kiln_st_release(f);
}

static void t_save_errors(void)
{
    const char *path = tmp_path("keep.safetensors");
    int64_t s2[1] = {2}, neg[1] = {-1};
    float v[2] = {1, 2};
    kiln_st_item good = {"w", KILN_F32, 1, s2, v};
    CHECK(kiln_st_save(path, 1, &good, 0, NULL, NULL) == KILN_OK, "%s", kiln_last_error());
    size_t n0;
    unsigned char *before = read_file(path, &n0);

    kiln_st_item dup[2] = {{"a", KILN_F32, 1, s2, v}, {"a", KILN_F32, 1, s2, v}};
    kiln_st_item reserved = {"__metadata__", KILN_F32, 1, s2, v};
    kiln_st_item bad_dtype = {"a", (kiln_dtype)42, 1, s2, v};
    kiln_st_item bad_dim = {"a", KILN_F32, 1, neg, v};
    kiln_st_item bad_ndim = {"a", KILN_F32, 9, s2, v};
    kiln_st_item no_data = {"a", KILN_F32, 1, s2, NULL};
    kiln_st_item no_name = {NULL, KILN_F32, 1, s2, v};
    kiln_st_item bad_utf8 = {"caf\xe9", KILN_F32, 1, s2, v};
    const char *mk[2] = {"k", "k"}, *mv[2] = {"1", "2"};
    struct { const char *what; int n; const kiln_st_item *items; int n_meta; const char *want; } cases[] = {
        {"duplicate", 2, dup, 0, "'a' appears twice"},
        {"reserved", 1, &reserved, 0, "__metadata__"},
        {"dtype", 1, &bad_dtype, 0, "invalid dtype"},
        {"negative dim", 1, &bad_dim, 0, "invalid shape [-1]"},
        {"ndim", 1, &bad_ndim, 0, "invalid ndim 9"},
        {"no data", 1, &no_data, 0, "data is NULL"},
        {"no name", 1, &no_name, 0, "no name"},
        {"utf8", 1, &bad_utf8, 0, "UTF-8"},
        {"dup meta", 1, &good, 2, "metadata key 'k' appears twice"},
        {"negative n", -1, &good, 0, "n = -1"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        kiln_status st = kiln_st_save(path, cases[c].n, cases[c].items, cases[c].n_meta, mk, mv);
        CHECK(st == KILN_ERR_ARG, "%s: status %s", cases[c].what, kiln_status_name(st));
        CHECK(strstr(kiln_last_error(), path) && strstr(kiln_last_error(), cases[c].want), "%s: message '%s'",
              cases[c].what, kiln_last_error());
    }
    size_t n1;
    unsigned char *after = read_file(path, &n1);
    CHECK(after && n1 == n0 && memcmp(before, after, n0) == 0, "file changed by failed saves");
    free(after);

    /* a write that fails half way (file size limit -> EFBIG): old file intact, no temp */
    struct rlimit old;
    getrlimit(RLIMIT_FSIZE, &old);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim = {4096, old.rlim_max};
    static float big[8192];
    int64_t sbig[1] = {8192};
    kiln_st_item bigit = {"big", KILN_F32, 1, sbig, big};
    if (setrlimit(RLIMIT_FSIZE, &lim) == 0) {
        kiln_status st = kiln_st_save(path, 1, &bigit, 0, NULL, NULL);
        setrlimit(RLIMIT_FSIZE, &old);
        CHECK(st == KILN_ERR_IO && strstr(kiln_last_error(), path), "EFBIG save: %s %s", kiln_status_name(st),
              kiln_last_error());
    } else {
        printf("# setrlimit(RLIMIT_FSIZE) failed: %s; mid-write failure not tested\n", strerror(errno));
    }
    signal(SIGXFSZ, prev);
    after = read_file(path, &n1);
    CHECK(after && n1 == n0 && memcmp(before, after, n0) == 0, "file changed by a failed write");
    free(after);

    /* a folder that does not exist, and (when not root) one we may not write */
    char missing[600];
    snprintf(missing, sizeof missing, "%s/no/such/dir/x.safetensors", tmpdir);
    kiln_status st = kiln_st_save(missing, 1, &good, 0, NULL, NULL);
    CHECK(st == KILN_ERR_IO && strstr(kiln_last_error(), missing), "missing folder: %s", kiln_last_error());
    if (geteuid() != 0) {
        chmod(tmpdir, 0555);
        st = kiln_st_save(path, 1, &bigit, 0, NULL, NULL);
        chmod(tmpdir, 0755);
        CHECK(st == KILN_ERR_IO, "read-only folder: %s", kiln_last_error());
        after = read_file(path, &n1);
        CHECK(after && n1 == n0 && memcmp(before, after, n0) == 0, "file changed by a save into a read-only folder");
        free(after);
    }
    CHECK(count_tmp_files() == 0, "temporary file left behind");
    free(before);
}

int main(void)
{
    if (!test_tmpdir_make("st")) return 1;
    RUN(t_golden);
    RUN(t_roundtrip);
    RUN(t_header_json);
    RUN(t_malformed);
    RUN(t_truncated);
    RUN(t_misaligned);
    RUN(t_save_errors);
    test_tmpdir_remove();
    return test_summary();
}

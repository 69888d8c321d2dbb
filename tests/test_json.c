/* test_json.c - the strict JSON reader: values, escapes, numbers, every class of
 * malformed input (with byte offsets), no reads past len, and vocab.json speed. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#include "json.h"

#include <stdint.h>
#include <time.h>

/* Parses from an exact-size heap copy (no NUL after it) so that AddressSanitizer
 * catches any read past len. */
static kiln_status parse_exact(const char *text, size_t len, kiln_json **out)
{
    char *copy = malloc(len ? len : 1);
    if (len) memcpy(copy, text, len);
    kiln_status st = kiln_json_parse(copy, len, out);
    free(copy);
    return st;
}

static kiln_status parse(const char *text, kiln_json **out) { return parse_exact(text, strlen(text), out); }

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void t_values(void)
{
    kiln_json *j = NULL;
    const char *text = " {\"a\": 1, \"b\": [true, false, null, -2.5e1, \"x\"], \"c\": {}, \"d\": [], \"\": \"empty key\"} ";
    kiln_status st = parse(text, &j);
    CHECK(st == KILN_OK, "parse: %s", kiln_last_error());
    if (st) return;
    CHECK(j->type == KILN_JSON_OBJECT && j->count == 5, "root type %d count %zu", j->type, j->count);
    const kiln_json *a = kiln_json_get(j, "a");
    CHECK(a && a->type == KILN_JSON_NUMBER && a->is_integer && a->integer == 1 && a->number == 1.0, "a");
    const kiln_json *b = kiln_json_get(j, "b");
    CHECK(b && b->type == KILN_JSON_ARRAY && b->count == 5, "b");
    if (b && b->count == 5) {
        const kiln_json *e = b->child;
        CHECK(e->type == KILN_JSON_BOOL && e->boolean == 1, "true");
        e = e->next;
        CHECK(e->type == KILN_JSON_BOOL && e->boolean == 0, "false");
        e = e->next;
        CHECK(e->type == KILN_JSON_NULL, "null");
        e = e->next;
        CHECK(e->type == KILN_JSON_NUMBER && !e->is_integer && e->number == -25.0, "-2.5e1 -> %g", e->number);
        e = e->next;
        CHECK(e->type == KILN_JSON_STRING && e->string_len == 1 && strcmp(e->string, "x") == 0, "x");
        CHECK(e->next == NULL, "end of list");
        CHECK(b->child->key == NULL, "array elements have no key");
    }
    const kiln_json *c = kiln_json_get(j, "c"), *d = kiln_json_get(j, "d");
    CHECK(c && c->type == KILN_JSON_OBJECT && c->count == 0 && !c->child, "c");
    CHECK(d && d->type == KILN_JSON_ARRAY && d->count == 0 && !d->child, "d");
    const kiln_json *e = kiln_json_get(j, "");
    CHECK(e && strcmp(e->string, "empty key") == 0, "empty key");
    CHECK(kiln_json_get(j, "zz") == NULL, "absent key");
    CHECK(kiln_json_get(b, "a") == NULL, "get on an array");
    CHECK(kiln_json_get(NULL, "a") == NULL, "get on NULL");
    kiln_json_free(j);

    /* scalars at top level, BOM, surrounding whitespace */
    st = parse("\xef\xbb\xbf \t\r\n42\n", &j);
    CHECK(st == KILN_OK && j->type == KILN_JSON_NUMBER && j->integer == 42, "scalar root: %s", kiln_last_error());
    kiln_json_free(j);
    st = parse("\"s\"", &j);
    CHECK(st == KILN_OK && j->type == KILN_JSON_STRING, "string root");
    kiln_json_free(j);
    kiln_json_free(NULL);
}

static void t_strings(void)
{
    struct { const char *json, *want; size_t want_len; } cases[] = {
        {"\"a\\\"b\\\\c\\/d\"", "a\"b\\c/d", 7},
        {"\"\\b\\f\\n\\r\\t\"", "\b\f\n\r\t", 5},
        {"\"\\u0041\\u00e9\\u20AC\"", "A\xc3\xa9\xe2\x82\xac", 6},
        {"\"\\ud83d\\ude00\"", "\xf0\x9f\x98\x80", 4},          /* surrogate pair -> U+1F600 */
        {"\"\\uDBFF\\uDFFF\"", "\xf4\x8f\xbf\xbf", 4},          /* U+10FFFF */
        {"\"x\\u0000y\"", "x\0y", 3},                          /* embedded NUL kept with its length */
        {"\"caf\xc3\xa9 \xe2\x98\x95 \xf0\x9f\x98\x80\"", "caf\xc3\xa9 \xe2\x98\x95 \xf0\x9f\x98\x80", 14},
        {"\"\"", "", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_json *j = NULL;
        kiln_status st = parse(cases[i].json, &j);
        CHECK(st == KILN_OK, "case %zu: %s", i, kiln_last_error());
        if (st) continue;
        CHECK(j->type == KILN_JSON_STRING && j->string_len == cases[i].want_len &&
                  memcmp(j->string, cases[i].want, cases[i].want_len) == 0 && j->string[j->string_len] == 0,
              "case %zu: got '%s' (%zu bytes)", i, j->string, j->string_len);
        kiln_json_free(j);
    }
    /* escaped keys are decoded and found by kiln_json_get */
    kiln_json *j = NULL;
    CHECK(parse("{\"\\u0041b\": 1, \"\\u0120the\": 2}", &j) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_json_get(j, "Ab") && kiln_json_get(j, "Ab")->integer == 1, "escaped key");
    CHECK(kiln_json_get(j, "\xc4\xa0the") && kiln_json_get(j, "\xc4\xa0the")->integer == 2, "U+0120 key");
    kiln_json_free(j);
}

static void t_numbers(void)
{
    struct { const char *json; int is_int; int64_t i; double d; } cases[] = {
        {"0", 1, 0, 0.0},
        {"-0", 1, 0, -0.0},
        {"123456789", 1, 123456789, 123456789.0},
        {"9223372036854775807", 1, INT64_MAX, 9223372036854775807.0},
        {"-9223372036854775808", 1, INT64_MIN, -9223372036854775808.0},
        {"9223372036854775808", 0, 0, 9223372036854775808.0},
        {"-9223372036854775809", 0, 0, -9223372036854775809.0},
        {"18446744073709551616", 0, 0, 18446744073709551616.0},
        {"1.0", 0, 0, 1.0},
        {"1e3", 0, 0, 1000.0},
        {"1E+2", 0, 0, 100.0},
        {"2.5e-3", 0, 0, 0.0025},
        {"-0.1", 0, 0, -0.1},
        {"3.141592653589793", 0, 0, 3.141592653589793},
        {"1e400", 0, 0, HUGE_VAL},
        {"0.00000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000001", 0, 0, 1e-176},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_json *j = NULL;
        kiln_status st = parse(cases[i].json, &j);
        CHECK(st == KILN_OK, "case %s: %s", cases[i].json, kiln_last_error());
        if (st) continue;
        CHECK(j->type == KILN_JSON_NUMBER && j->is_integer == cases[i].is_int, "%s: is_integer %d", cases[i].json, j->is_integer);
        if (cases[i].is_int) CHECK(j->integer == cases[i].i, "%s: integer %lld", cases[i].json, (long long)j->integer);
        CHECK(j->number == cases[i].d, "%s: number %.17g", cases[i].json, j->number);
        kiln_json_free(j);
    }
}

static void t_malformed(void)
{
    /* each input and the byte offset its error must report */
    struct { const char *json; size_t len; size_t offset; } cases[] = {
        {"", 0, 0},
        {"   ", 3, 3},
        {"{", 1, 1},
        {"[1, 2", 5, 0},
        {"[1, 2,]", 7, 6},
        {"{\"a\": 1,}", 9, 8},
        {"{\"a\" 1}", 7, 5},
        {"{a: 1}", 6, 1},
        {"{'a': 1}", 8, 1},
        {"[1 2]", 5, 3},
        {"01", 2, 0},
        {"-", 1, 0},
        {"1.", 2, 0},
        {".5", 2, 0},
        {"1e", 2, 0},
        {"+1", 2, 0},
        {"NaN", 3, 0},
        {"Infinity", 8, 0},
        {"tru", 3, 0},
        {"nul", 3, 0},
        {"[true false]", 12, 6},
        {"1 2", 3, 2},
        {"{} x", 4, 3},
        {"\"abc", 4, 0},
        {"\"a\\", 3, 0},
        {"\"a\x01\"", 4, 2},
        {"\"a\tb\"", 5, 2},
        {"\"\\x\"", 4, 1},
        {"\"\\u12\"", 6, 1},
        {"\"\\u12g4\"", 8, 1},
        {"\"\\ud800\"", 8, 1},
        {"\"\\ud800\\u0041\"", 14, 1},
        {"\"\\udc00\"", 8, 1},
        {"\"\xc3\"", 3, 1},                  /* truncated UTF-8 */
        {"\"\xc0\xaf\"", 4, 1},              /* overlong */
        {"\"\xed\xa0\x80\"", 5, 1},          /* encoded surrogate */
        {"\"\xf4\x90\x80\x80\"", 6, 1},      /* above U+10FFFF */
        {"\"\xff\"", 3, 1},
        {"[1] // comment", 14, 4},
        {"[1]\0", 4, 3},                     /* NUL inside len */
        {"\xef\xbb", 2, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_json *j = (kiln_json *)&j;
        kiln_status st = parse_exact(cases[i].json, cases[i].len, &j);
        CHECK(st == KILN_ERR_FORMAT, "case %zu '%s' parsed (status %d)", i, cases[i].json, st);
        CHECK(j == NULL, "case %zu: *out not NULL on error", i);
        char want[64];
        snprintf(want, sizeof want, "at byte %zu", cases[i].offset);
        CHECK(strstr(kiln_last_error(), want) != NULL, "case %zu '%s': message '%s' lacks '%s'", i, cases[i].json,
              kiln_last_error(), want);
        if (j) kiln_json_free(j);
    }
}

static void t_depth(void)
{
    char buf[300];
    for (int depth = 63; depth <= 65; depth++) {
        int k = 0;
        for (int i = 0; i < depth; i++) buf[k++] = '[';
        for (int i = 0; i < depth; i++) buf[k++] = ']';
        kiln_json *j = NULL;
        kiln_status st = parse_exact(buf, (size_t)k, &j);
        if (depth <= 64) CHECK(st == KILN_OK, "depth %d: %s", depth, kiln_last_error());
        else CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), "nesting"), "depth %d: %d %s", depth, st, kiln_last_error());
        kiln_json_free(j);
    }
    /* a very deep document fails quickly without recursing deeply */
    size_t n = 1000000;
    char *deep = malloc(n);
    memset(deep, '[', n);
    kiln_json *j = NULL;
    CHECK(parse_exact(deep, n, &j) == KILN_ERR_FORMAT, "deep");
    memset(deep, '{', n);
    CHECK(parse_exact(deep, n, &j) == KILN_ERR_FORMAT, "deep object");
    free(deep);
}

/* Every prefix and many single-byte mutations of a valid document: each must parse
 * or fail cleanly (AddressSanitizer checks the reads). */
static void t_mutations(void)
{
    const char *doc = "{\"w\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 24]}, "
                      "\"s\": \"caf\xc3\xa9 \\u2615 \\ud83d\\ude00\", \"n\": [-1.5e-3, 0, true, null]}";
    size_t n = strlen(doc);
    kiln_json *j = NULL;
    CHECK(parse(doc, &j) == KILN_OK, "%s", kiln_last_error());
    kiln_json_free(j);
    for (size_t k = 0; k < n; k++) {
        j = NULL;
        CHECK(parse_exact(doc, k, &j) == KILN_ERR_FORMAT, "prefix %zu parsed", k);
        kiln_json_free(j);
    }
    static const char subst[] = "\"\\{}[],:0-e.\x01\x80\xff u";
    char *m = malloc(n);
    int ok = 0, bad = 0;
    for (size_t k = 0; k < n; k++) {
        for (size_t s = 0; s < sizeof subst - 1; s++) {
            memcpy(m, doc, n);
            m[k] = subst[s];
            j = NULL;
            kiln_status st = parse_exact(m, n, &j);
            if (st == KILN_OK) ok++;
            else bad++;
            CHECK(st == KILN_OK || st == KILN_ERR_FORMAT, "mutation %zu/%zu: status %d", k, s, st);
            kiln_json_free(j);
        }
    }
    free(m);
    CHECK(ok > 0 && bad > 0, "mutations: %d ok, %d bad", ok, bad);
}

/* A vocab.json like CLIP's: 49408 entries, raw UTF-8 keys with a few escapes. */
static char *make_vocab(size_t *len)
{
    size_t cap = 4 << 20, k = 0;
    char *s = malloc(cap);
    s[k++] = '{';
    for (int i = 0; i < 49408; i++) {
        if (i) s[k++] = ',';
        int n;
        if (i % 97 == 0) n = snprintf(s + k, cap - k, "\"\\\"q%d\\\\</w>\":%d", i, i);
        else if (i % 3 == 0) n = snprintf(s + k, cap - k, "\"\xc4\xa0tok%dabc</w>\":%d", i, i);
        else n = snprintf(s + k, cap - k, "\"piece%dxy</w>\":%d", i, i);
        k += (size_t)n;
    }
    s[k++] = '}';
    *len = k;
    return s;
}

static void time_parse(const char *what, const char *text, size_t len, size_t want_count)
{
    kiln_json *j = NULL;
    double best = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now_ms();
        kiln_status st = kiln_json_parse(text, len, &j);
        double t = now_ms() - t0;
        CHECK(st == KILN_OK, "%s: %s", what, kiln_last_error());
        if (st) return;
        if (want_count) CHECK(j->count == want_count, "%s: %zu entries", what, j->count);
        if (rep < 2) kiln_json_free(j);
        if (t < best) best = t;
    }
    printf("# %s: %zu bytes, %zu entries, parse %.1f ms\n", what, len, j->count, best);
    /* generous bound: sanitizer builds on a loaded 2-core machine are slow; an -O2
     * build parses it in a few ms */
    CHECK(best < 1000, "%s: parse took %.1f ms", what, best);
    kiln_json_free(j);
}

static void t_vocab_speed(void)
{
    size_t len;
    char *v = make_vocab(&len);
    time_parse("synthetic vocab.json", v, len, 49408);
    kiln_json *j = NULL;
    if (kiln_json_parse(v, len, &j) == KILN_OK) {
        const kiln_json *e = kiln_json_get(j, "\xc4\xa0tok49401abc</w>");
        CHECK(e && e->is_integer && e->integer == 49401, "lookup");
        e = kiln_json_get(j, "\"q97\\</w>");
        CHECK(e && e->integer == 97, "escaped lookup");
        kiln_json_free(j);
    }
    free(v);

    char path[512];
    snprintf(path, sizeof path, "%s/clip-tokenizer/vocab.json", test_shared_dir());
    FILE *f = fopen(path, "rb");
    if (!f) return; /* optional: the real file when the shared folder has it */
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n);
    size_t got = fread(buf, 1, (size_t)n, f);
    fclose(f);
    time_parse(path, buf, got, 0);
    free(buf);
}

int main(void)
{
    RUN(t_values);
    RUN(t_strings);
    RUN(t_numbers);
    RUN(t_malformed);
    RUN(t_depth);
    RUN(t_mutations);
    RUN(t_vocab_speed);
    return test_summary();
}

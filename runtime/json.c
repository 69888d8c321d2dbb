/* json.c - strict RFC 8259 reader: one recursive-descent pass that validates and
 * builds the kiln_json tree in a chain of arena blocks, so the whole tree is freed
 * at once. Every read is bounds-checked against len (the text need not end in NUL). */
#include "json.h"
#include "unicode.h"

#include <stdlib.h>
#include <string.h>

#define JSON_MAX_DEPTH 64

/* Arena: a chain of blocks; the root node is the first allocation of the first
 * block, which lets kiln_json_free find the chain from the root pointer alone. */
typedef struct json_block {
    struct json_block *next;
    size_t used, cap;
} json_block;
#define BLOCK_HDR ((sizeof(json_block) + 15) & ~(size_t)15)

typedef struct {
    const unsigned char *s;
    size_t len, pos;
    json_block *first, *cur;
    size_t next_cap;
} json_parser;

static json_block *block_new(size_t cap)
{
    json_block *b = malloc(BLOCK_HDR + cap);
    if (!b) return NULL;
    b->next = NULL;
    b->used = 0;
    b->cap = cap;
    return b;
}

/* Returns n bytes aligned to `align` (a power of two), or NULL when out of memory. */
static void *arena_alloc(json_parser *p, size_t n, size_t align)
{
    json_block *b = p->cur;
    size_t at = (b->used + align - 1) & ~(align - 1);
    if (at > b->cap || b->cap - at < n) {
        size_t cap = p->next_cap;
        if (cap < n + align) cap = n + align;
        json_block *nb = block_new(cap);
        if (!nb) return NULL;
        b->next = nb;
        p->cur = b = nb;
        if (p->next_cap < ((size_t)64 << 20)) p->next_cap *= 2;
        at = 0;
    }
    b->used = at + n;
    return (char *)b + BLOCK_HDR + at;
}

/* Gives back the unused tail of the most recent allocation (strings are sized by
 * their escaped length first, and decoding only shrinks them). */
static void arena_shrink_last(json_parser *p, const void *ptr, size_t n)
{
    json_block *b = p->cur;
    b->used = (size_t)((const char *)ptr - ((char *)b + BLOCK_HDR)) + n;
}

static kiln_status fail(const json_parser *p, size_t at, const char *what)
{
    (void)p;
    return kiln_error(KILN_ERR_FORMAT, "json: %s at byte %zu", what, at);
}

static kiln_status fail_oom(const json_parser *p)
{
    return kiln_error(KILN_ERR_OOM, "json: out of memory at byte %zu (input %zu bytes)", p->pos, p->len);
}

static inline void skip_ws(json_parser *p)
{
    while (p->pos < p->len) {
        unsigned char c = p->s[p->pos];
        if (c != ' ' && c != '\n' && c != '\r' && c != '\t') break;
        p->pos++;
    }
}

static int hex4(const unsigned char *s, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = s[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return 0;
        v = v * 16 + d;
    }
    *out = v;
    return 1;
}

static size_t put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xc0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    o[0] = (char)(0xf0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); o[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* p->pos is at the opening quote. Validates, then copies/decodes into the arena. */
static kiln_status parse_string(json_parser *p, char **out, size_t *out_len)
{
    const unsigned char *s = p->s;
    size_t start = p->pos + 1, i = start, n = p->len;
    int has_escape = 0;
    for (;;) {
        /* fast path over plain ASCII */
        while (i < n && s[i] >= 0x20 && s[i] < 0x80 && s[i] != '"' && s[i] != '\\') i++;
        if (i >= n) return fail(p, p->pos, "unterminated string");
        unsigned char c = s[i];
        if (c == '"') break;
        if (c == '\\') {
            has_escape = 1;
            if (i + 1 >= n) return fail(p, p->pos, "unterminated string");
            i += 2; /* the escape itself is checked while decoding */
            continue;
        }
        if (c < 0x20) return fail(p, i, "control character in string");
        size_t k = kiln_unicode_utf8_seq_len(s + i, n - i);
        if (!k) return fail(p, i, "invalid UTF-8 in string");
        i += k;
    }
    size_t raw = i - start;
    char *o = arena_alloc(p, raw + 1, 1);
    if (!o) return fail_oom(p);
    size_t m = 0;
    if (!has_escape) {
        memcpy(o, s + start, raw);
        m = raw;
    } else {
        for (size_t j = start; j < i;) {
            unsigned char c = s[j];
            if (c != '\\') { o[m++] = (char)c; j++; continue; }
            unsigned char e = s[j + 1]; /* j + 1 < i: the scan above skipped escapes in pairs */
            switch (e) {
            case '"': o[m++] = '"'; break;
            case '\\': o[m++] = '\\'; break;
            case '/': o[m++] = '/'; break;
            case 'b': o[m++] = '\b'; break;
            case 'f': o[m++] = '\f'; break;
            case 'n': o[m++] = '\n'; break;
            case 'r': o[m++] = '\r'; break;
            case 't': o[m++] = '\t'; break;
            case 'u': {
                unsigned cp, lo;
                if (i - j < 6 || !hex4(s + j + 2, &cp)) return fail(p, j, "bad \\u escape");
                size_t used = 6;
                if (cp >= 0xdc00 && cp <= 0xdfff) return fail(p, j, "lone low surrogate in \\u escape");
                if (cp >= 0xd800 && cp <= 0xdbff) {
                    if (i - j < 12 || s[j + 6] != '\\' || s[j + 7] != 'u' || !hex4(s + j + 8, &lo) ||
                        lo < 0xdc00 || lo > 0xdfff)
                        return fail(p, j, "high surrogate not followed by a low surrogate");
                    cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    used = 12;
                }
                /* the UTF-8 form (<= 4 bytes) is never longer than the escape (6 or 12) */
                m += put_utf8(o + m, cp);
                j += used;
                continue;
            }
            default: return fail(p, j, "invalid escape in string");
            }
            j += 2;
        }
    }
    o[m] = '\0';
    arena_shrink_last(p, o, m + 1);
    *out = o;
    *out_len = m;
    p->pos = i + 1;
    return KILN_OK;
}

static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

static kiln_status parse_number(json_parser *p, kiln_json *v)
{
    const unsigned char *s = p->s;
    size_t n = p->len, start = p->pos, i = start;
    int neg = 0, frac = 0, overflow = 0;
    uint64_t mag = 0;
    if (s[i] == '-') { neg = 1; i++; }
    if (i >= n || !is_digit(s[i])) return fail(p, start, "invalid number");
    if (s[i] == '0') {
        i++;
        if (i < n && is_digit(s[i])) return fail(p, start, "leading zero in number");
    } else {
        while (i < n && is_digit(s[i])) {
            unsigned d = s[i] - '0';
            if (mag > (UINT64_MAX - d) / 10) overflow = 1;
            else mag = mag * 10 + d;
            i++;
        }
    }
    if (i < n && s[i] == '.') {
        frac = 1;
        i++;
        if (i >= n || !is_digit(s[i])) return fail(p, start, "invalid number (digit expected after '.')");
        while (i < n && is_digit(s[i])) i++;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        frac = 1;
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= n || !is_digit(s[i])) return fail(p, start, "invalid number (digit expected in exponent)");
        while (i < n && is_digit(s[i])) i++;
    }
    v->type = KILN_JSON_NUMBER;
    /* is_integer: written as an integer (no fraction or exponent) and within int64 */
    if (!frac && !overflow && (neg ? mag <= (uint64_t)1 << 63 : mag <= (uint64_t)INT64_MAX)) {
        v->is_integer = 1;
        v->integer = neg ? (int64_t)(0 - mag) : (int64_t)mag; /* 0 - 2^63 wraps to INT64_MIN */
        v->number = (double)v->integer;
    } else {
        /* strtod needs a NUL-terminated copy; the token is already validated. It
         * follows LC_NUMERIC, which the core never changes (a host calling
         * setlocale with a ',' decimal separator would break fractional numbers). */
        size_t k = i - start;
        char buf[128];
        char *t = k < sizeof buf ? buf : malloc(k + 1);
        if (!t) return fail_oom(p);
        memcpy(t, s + start, k);
        t[k] = '\0';
        v->number = strtod(t, NULL);
        if (t != buf) free(t);
    }
    p->pos = i;
    return KILN_OK;
}

static kiln_status parse_value(json_parser *p, kiln_json *v, int depth);

static kiln_json *new_node(json_parser *p)
{
    kiln_json *v = arena_alloc(p, sizeof(kiln_json), _Alignof(kiln_json));
    if (v) memset(v, 0, sizeof *v);
    return v;
}

static kiln_status parse_container(json_parser *p, kiln_json *v, int depth, int is_object)
{
    size_t open = p->pos;
    unsigned char close = is_object ? '}' : ']';
    if (depth >= JSON_MAX_DEPTH) return fail(p, open, "nesting deeper than 64 levels");
    v->type = is_object ? KILN_JSON_OBJECT : KILN_JSON_ARRAY;
    p->pos++;
    skip_ws(p);
    if (p->pos < p->len && p->s[p->pos] == close) { p->pos++; return KILN_OK; }
    kiln_json *tail = NULL;
    for (;;) {
        kiln_json *c = new_node(p);
        if (!c) return fail_oom(p);
        if (is_object) {
            if (p->pos >= p->len) return fail(p, p->pos, "unterminated object");
            if (p->s[p->pos] != '"') return fail(p, p->pos, "expected a string key");
            kiln_status st = parse_string(p, &c->key, &c->key_len);
            if (st) return st;
            skip_ws(p);
            if (p->pos >= p->len || p->s[p->pos] != ':') return fail(p, p->pos, "expected ':'");
            p->pos++;
            skip_ws(p);
        }
        kiln_status st = parse_value(p, c, depth + 1);
        if (st) return st;
        if (tail) tail->next = c; else v->child = c;
        tail = c;
        v->count++;
        skip_ws(p);
        if (p->pos >= p->len) return fail(p, open, is_object ? "unterminated object" : "unterminated array");
        unsigned char ch = p->s[p->pos];
        if (ch == close) { p->pos++; return KILN_OK; }
        if (ch != ',') return fail(p, p->pos, is_object ? "expected ',' or '}'" : "expected ',' or ']'");
        p->pos++;
        skip_ws(p);
        if (p->pos < p->len && p->s[p->pos] == close) return fail(p, p->pos, "trailing comma");
    }
}

static kiln_status parse_literal(json_parser *p, const char *word, size_t n)
{
    if (p->len - p->pos < n || memcmp(p->s + p->pos, word, n) != 0) return fail(p, p->pos, "invalid literal");
    p->pos += n;
    return KILN_OK;
}

/* p->pos is at the first byte of a value (whitespace already skipped). */
static kiln_status parse_value(json_parser *p, kiln_json *v, int depth)
{
    if (p->pos >= p->len) return fail(p, p->pos, "unexpected end of input");
    unsigned char c = p->s[p->pos];
    switch (c) {
    case '{': return parse_container(p, v, depth, 1);
    case '[': return parse_container(p, v, depth, 0);
    case '"': v->type = KILN_JSON_STRING; return parse_string(p, &v->string, &v->string_len);
    case 't': v->type = KILN_JSON_BOOL; v->boolean = 1; return parse_literal(p, "true", 4);
    case 'f': v->type = KILN_JSON_BOOL; v->boolean = 0; return parse_literal(p, "false", 5);
    case 'n': v->type = KILN_JSON_NULL; return parse_literal(p, "null", 4);
    default:
        if (c == '-' || is_digit(c)) return parse_number(p, v);
        return fail(p, p->pos, "unexpected character");
    }
}

kiln_status kiln_json_parse(const char *text, size_t len, kiln_json **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "json: out is NULL");
    *out = NULL;
    if (!text && len) return kiln_error(KILN_ERR_ARG, "json: text is NULL");
    json_parser p = {(const unsigned char *)text, len, 0, NULL, NULL, 0};
    /* A tree costs a few times the text (a 96-byte node per value); start near that
     * and double. Unused capacity is never touched, so the OS does not commit it. */
    size_t cap = len < 1024 ? 4096 : (len > ((size_t)256 << 20) ? ((size_t)1 << 30) : len * 4);
    p.first = p.cur = block_new(cap);
    if (!p.first) return kiln_error(KILN_ERR_OOM, "json: out of memory (input %zu bytes)", len);
    p.next_cap = cap;
    kiln_json *root = new_node(&p);
    /* a UTF-8 byte order mark may be ignored (RFC 8259 section 8.1) */
    if (len >= 3 && memcmp(text, "\xef\xbb\xbf", 3) == 0) p.pos = 3;
    skip_ws(&p);
    kiln_status st = parse_value(&p, root, 0);
    if (!st) {
        skip_ws(&p);
        if (p.pos != len) st = fail(&p, p.pos, "unexpected data after the value");
    }
    if (st) {
        kiln_json_free(root);
        return st;
    }
    *out = root;
    return KILN_OK;
}

void kiln_json_free(kiln_json *root)
{
    if (!root) return;
    json_block *b = (json_block *)(void *)((char *)root - BLOCK_HDR);
    while (b) {
        json_block *n = b->next;
        free(b);
        b = n;
    }
}

const kiln_json *kiln_json_get(const kiln_json *obj, const char *key)
{
    if (!obj || obj->type != KILN_JSON_OBJECT || !key) return NULL;
    size_t n = strlen(key);
    for (const kiln_json *c = obj->child; c; c = c->next)
        if (c->key_len == n && memcmp(c->key, key, n) == 0) return c;
    return NULL;
}

/* unicode.c - Unicode character properties for the CLIP tokenizer, and UTF-8
 * decoding, encoding and validation for every reader and writer of the runtime.
 * Properties are range tables searched by bisection, with ASCII answered before any
 * table; the tables live in unicode_tables.c, generated from Python's unicodedata
 * by tests/golden/gen_unicode_tables.py. */
#include "unicode.h"
#include "unicode_tables.h"

#include <string.h>

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static int in_ranges(const kiln_uni_range *r, size_t n, uint32_t c)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (c < r[mid].lo) hi = mid;
        else if (c > r[mid].hi) lo = mid + 1;
        else return 1;
    }
    return 0;
}

int kiln_unicode_is_letter(uint32_t c)
{
    if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
    return in_ranges(kiln_uni_letter, COUNT(kiln_uni_letter), c);
}

int kiln_unicode_is_number(uint32_t c)
{
    if (c < 0x80) return c >= '0' && c <= '9';
    return in_ranges(kiln_uni_number, COUNT(kiln_uni_number), c);
}

int kiln_unicode_is_space(uint32_t c)
{
    if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
    return in_ranges(kiln_uni_space, COUNT(kiln_uni_space), c);
}

int kiln_unicode_is_cased(uint32_t c) { return in_ranges(kiln_uni_cased, COUNT(kiln_uni_cased), c); }

int kiln_unicode_is_case_ignorable(uint32_t c)
{
    return in_ranges(kiln_uni_case_ignorable, COUNT(kiln_uni_case_ignorable), c);
}

uint32_t kiln_unicode_lower(uint32_t c)
{
    if (c < 0x80) return c >= 'A' && c <= 'Z' ? c + 32 : c;
    size_t lo = 0, hi = COUNT(kiln_uni_lower);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const kiln_uni_run *r = &kiln_uni_lower[mid];
        if (c < r->lo) hi = mid;
        else if (c > r->hi) lo = mid + 1;
        else return (c - r->lo) % (uint32_t)r->stride ? c : (uint32_t)((int32_t)c + r->delta);
    }
    return c;
}

int kiln_unicode_combining_class(uint32_t c)
{
    if (c < 0x300) return 0;
    size_t lo = 0, hi = COUNT(kiln_uni_ccc);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (c < kiln_uni_ccc[mid].lo) hi = mid;
        else if (c > kiln_uni_ccc[mid].hi) lo = mid + 1;
        else return (int)kiln_uni_ccc[mid].cls;
    }
    return 0;
}

/* Hangul syllables compose arithmetically (Unicode ch. 3.12). */
#define HANGUL_S 0xAC00u
#define HANGUL_L 0x1100u
#define HANGUL_V 0x1161u
#define HANGUL_T 0x11A7u
#define HANGUL_LCOUNT 19u
#define HANGUL_VCOUNT 21u
#define HANGUL_TCOUNT 28u
#define HANGUL_SCOUNT (HANGUL_LCOUNT * HANGUL_VCOUNT * HANGUL_TCOUNT)

uint32_t kiln_unicode_compose(uint32_t a, uint32_t b)
{
    if (b < 0x300) return 0;
    if (a - HANGUL_L < HANGUL_LCOUNT && b - HANGUL_V < HANGUL_VCOUNT)
        return HANGUL_S + ((a - HANGUL_L) * HANGUL_VCOUNT + (b - HANGUL_V)) * HANGUL_TCOUNT;
    if (a - HANGUL_S < HANGUL_SCOUNT && (a - HANGUL_S) % HANGUL_TCOUNT == 0 &&
        b - HANGUL_T - 1 < HANGUL_TCOUNT - 1)
        return a + (b - HANGUL_T);
    size_t lo = 0, hi = COUNT(kiln_uni_compose);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const kiln_uni_pair *p = &kiln_uni_compose[mid];
        if (a < p->a || (a == p->a && b < p->b)) hi = mid;
        else if (a > p->a || b > p->b) lo = mid + 1;
        else return p->c;
    }
    return 0;
}

int kiln_unicode_width_fold(uint32_t c, uint32_t out[2])
{
    if (c != 0x3000 && (c < 0xFF01 || c > 0xFFEF)) return 0;
    size_t lo = 0, hi = COUNT(kiln_uni_width);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (c < kiln_uni_width[mid].from) hi = mid;
        else if (c > kiln_uni_width[mid].from) lo = mid + 1;
        else {
            out[0] = kiln_uni_width[mid].to0;
            out[1] = kiln_uni_width[mid].to1;
            return out[1] ? 2 : 1;
        }
    }
    return 0;
}

const kiln_unicode_entity *kiln_unicode_entity_find(const char *name, size_t len)
{
    size_t lo = 0, hi = COUNT(kiln_uni_entities);
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const char *e = kiln_uni_entities[mid].name;
        int cmp = strncmp(name, e, len);
        if (cmp == 0 && e[len] != '\0') cmp = -1; /* name is a proper prefix of e */
        if (cmp < 0) hi = mid;
        else if (cmp > 0) lo = mid + 1;
        else return &kiln_uni_entities[mid];
    }
    return NULL;
}

uint32_t kiln_unicode_cp1252(uint32_t c)
{
    return c >= 0x80 && c <= 0x9F ? kiln_uni_cp1252[c - 0x80] : c;
}

size_t kiln_unicode_utf8_decode(const unsigned char *s, size_t len, uint32_t *cp)
{
    unsigned b0 = s[0];
    if (b0 < 0x80) { *cp = b0; return 1; }
    size_t need;
    uint32_t c;
    unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (b0 >= 0xC2 && b0 <= 0xDF) { need = 1; c = b0 & 0x1F; }
    else if (b0 >= 0xE0 && b0 <= 0xEF) {
        need = 2; c = b0 & 0x0F;
        if (b0 == 0xE0) lo = 0xA0;      /* overlong */
        else if (b0 == 0xED) hi = 0x9F; /* surrogates */
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
        need = 3; c = b0 & 0x07;
        if (b0 == 0xF0) lo = 0x90;      /* overlong */
        else if (b0 == 0xF4) hi = 0x8F; /* above U+10FFFF */
    } else { *cp = KILN_UNICODE_REPLACEMENT; return 1; }
    size_t i;
    for (i = 1; i <= need; i++) {
        if (i >= len) break;
        unsigned b = s[i];
        if (i == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) break;
        c = (c << 6) | (b & 0x3F);
    }
    if (i <= need) { *cp = KILN_UNICODE_REPLACEMENT; return i; } /* maximal invalid subpart */
    *cp = c;
    return need + 1;
}

size_t kiln_unicode_utf8_seq_len(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    unsigned char lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    size_t k;
    if (c >= 0xC2 && c <= 0xDF) k = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        k = 3;
        if (c == 0xE0) lo = 0xA0;      /* overlong */
        if (c == 0xED) hi = 0x9F;      /* surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        k = 4;
        if (c == 0xF0) lo = 0x90;      /* overlong */
        if (c == 0xF4) hi = 0x8F;      /* above U+10FFFF */
    } else return 0;
    if (n < k) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < k; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return k;
}

int kiln_unicode_utf8_valid(const char *str)
{
    const unsigned char *s = (const unsigned char *)str;
    size_t n = strlen(str);
    for (size_t i = 0; i < n;) {
        if (s[i] < 0x80) { i++; continue; }
        size_t k = kiln_unicode_utf8_seq_len(s + i, n - i);
        if (!k) return 0;
        i += k;
    }
    return 1;
}

size_t kiln_unicode_utf8_encode(uint32_t c, char out[4])
{
    if ((c >= 0xD800 && c <= 0xDFFF) || c > 0x10FFFF) c = KILN_UNICODE_REPLACEMENT;
    if (c < 0x80) { out[0] = (char)c; return 1; }
    if (c < 0x800) {
        out[0] = (char)(0xC0 | (c >> 6));
        out[1] = (char)(0x80 | (c & 0x3F));
        return 2;
    }
    if (c < 0x10000) {
        out[0] = (char)(0xE0 | (c >> 12));
        out[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        out[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (c >> 18));
    out[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((c >> 6) & 0x3F));
    out[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

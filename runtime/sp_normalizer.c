/* sp_normalizer.c - SentencePiece's normaliser (normalizer.cc in google/sentencepiece):
 * the precompiled charsmap's Darts double-array lookup and the whitespace rules, written
 * from its specification so that the T5 tokenizer sees what SentencePiece's would. */
#include "sp_normalizer.h"

#include <stdlib.h>
#include <string.h>

static kiln_status oom(size_t bytes)
{
    return kiln_error_oom("cpu", bytes, 0, 0, "sp_normalizer: out of memory (%zu bytes)", bytes);
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

kiln_status kiln_sp_normalizer_init(kiln_sp_normalizer *n, const void *blob, size_t len, const char *name)
{
    memset(n, 0, sizeof *n);
    const unsigned char *b = blob;
    if (!name) name = "(memory)";
    if (len <= 4) return kiln_error(KILN_ERR_FORMAT, "%s: precompiled charsmap of %zu bytes is too short", name, len);
    size_t trie_bytes = le32(b);
    if (trie_bytes > len - 4 || trie_bytes % 4 || trie_bytes == 0)
        return kiln_error(KILN_ERR_FORMAT, "%s: precompiled charsmap's trie size %zu does not fit its %zu bytes",
                          name, trie_bytes, len);
    n->n_units = trie_bytes / 4;
    n->strings_len = len - 4 - trie_bytes;
    n->units = malloc(trie_bytes);
    n->strings = malloc(n->strings_len + 1);
    if (!n->units || !n->strings) {
        kiln_sp_normalizer_free(n);
        return oom(len);
    }
    for (size_t i = 0; i < n->n_units; i++) n->units[i] = le32(b + 4 + 4 * i);
    memcpy(n->strings, b + 4 + trie_bytes, n->strings_len);
    n->strings[n->strings_len] = '\0'; /* a replacement never reads past the copy */
    return KILN_OK;
}

void kiln_sp_normalizer_free(kiln_sp_normalizer *n)
{
    free(n->units);
    free(n->strings);
    memset(n, 0, sizeof *n);
}

/* Darts-clone's unit fields (darts.h: DoubleArrayUnit). */
static int unit_has_leaf(uint32_t u) { return (u >> 8) & 1; }
static uint32_t unit_value(uint32_t u) { return u & ((1u << 31) - 1); }
static uint32_t unit_label(uint32_t u) { return u & ((1u << 31) | 0xff); }
static uint32_t unit_offset(uint32_t u) { return (u >> 10) << ((u & (1u << 9)) >> 6); }

/* Length of the longest key of the trie that prefixes s (0: none) and its value. As
 * SentencePiece, only the first 32 matches count (kMaxTrieResultsSize); they come
 * shortest first. A unit index outside the array ends the walk: a corrupt map then
 * matches less, it never reads out of bounds. */
static size_t longest_match(const kiln_sp_normalizer *n, const unsigned char *s, size_t len, uint32_t *value)
{
    if (!n->n_units) return 0;
    size_t best = 0, found = 0, pos = 0;
    uint32_t unit = n->units[0];
    pos ^= unit_offset(unit);
    for (size_t i = 0; i < len; i++) {
        pos ^= s[i];
        if (pos >= n->n_units) break;
        unit = n->units[pos];
        if (unit_label(unit) != s[i]) break;
        pos ^= unit_offset(unit);
        if (unit_has_leaf(unit)) {
            if (pos >= n->n_units) break;
            if (found < 32) {
                best = i + 1;
                *value = unit_value(n->units[pos]);
            }
            found++;
        }
    }
    return best;
}

/* SentencePiece's DecodeUTF8 validity: the byte length of a well-formed character at
 * s (shortest form, no surrogates, at most U+10FFFF), or 0 when malformed. */
static size_t utf8_len(const unsigned char *s, size_t len)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    if (len >= 2 && (c & 0xe0) == 0xc0) {
        uint32_t cp = (c & 0x1f) << 6 | (s[1] & 0x3f);
        if ((s[1] & 0xc0) == 0x80 && cp >= 0x80) return 2;
    } else if (len >= 3 && (c & 0xf0) == 0xe0) {
        uint32_t cp = (c & 0x0f) << 12 | (s[1] & 0x3f) << 6 | (s[2] & 0x3f);
        if ((s[1] & 0xc0) == 0x80 && (s[2] & 0xc0) == 0x80 && cp >= 0x800 && (cp < 0xd800 || cp >= 0xe000))
            return 3;
    } else if (len >= 4 && (c & 0xf8) == 0xf0) {
        uint32_t cp = (c & 0x07) << 18 | (s[1] & 0x3f) << 12 | (s[2] & 0x3f) << 6 | (s[3] & 0x3f);
        if ((s[1] & 0xc0) == 0x80 && (s[2] & 0xc0) == 0x80 && (s[3] & 0xc0) == 0x80 && cp >= 0x10000 &&
            cp <= 0x10ffff)
            return 4;
    }
    return 0;
}

/* Normalizer::NormalizePrefix: the replacement of the text's first unit and how many
 * bytes it consumes. */
static const char *normalize_prefix(const kiln_sp_normalizer *n, const unsigned char *s, size_t len,
                                    size_t *rep_len, size_t *consumed)
{
    uint32_t value = 0;
    size_t m = longest_match(n, s, len, &value);
    if (m && value < n->strings_len) {
        *consumed = m;
        const char *r = n->strings + value;
        *rep_len = strlen(r); /* strings are NUL-ended (init adds one after the last) */
        return r;
    }
    if (m) { /* a value past the strings: the map is corrupt; SentencePiece would read
                past its buffer, we take the replacement as empty */
        *consumed = m;
        *rep_len = 0;
        return "";
    }
    size_t u = utf8_len(s, len);
    if (!u) { /* malformed: one byte becomes U+FFFD */
        *consumed = 1;
        *rep_len = 3;
        return "\xef\xbf\xbd";
    }
    *consumed = u;
    *rep_len = u;
    return (const char *)s;
}

typedef struct {
    char *p;
    size_t n, cap;
} buf;

static int put(buf *b, const char *s, size_t len)
{
    if (b->n + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + len + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    return 0;
}

#define SPACE_SYMBOL "\xe2\x96\x81" /* U+2581 LOWER ONE EIGHTH BLOCK */

kiln_status kiln_sp_normalizer_run(const kiln_sp_normalizer *n, const char *text, size_t len, int flags,
                                   char **out, size_t *out_len)
{
    const unsigned char *s = (const unsigned char *)text;
    const int remove_ws = flags & KILN_SP_REMOVE_EXTRA_WHITESPACES, escape = flags & KILN_SP_ESCAPE_WHITESPACES;
    const char *space = escape ? SPACE_SYMBOL : " ";
    const size_t space_len = escape ? 3 : 1;
    buf b = {0};
    *out = NULL;
    *out_len = 0;
    size_t rl, used;
    /* leading spaces (after normalisation) go first */
    if (remove_ws) {
        while (len) {
            const char *r = normalize_prefix(n, s, len, &rl, &used);
            if (!(rl == 1 && r[0] == ' ')) break;
            s += used;
            len -= used;
        }
    }
    if (len) {
        if ((flags & KILN_SP_ADD_DUMMY_PREFIX) && put(&b, space, space_len)) goto nomem;
        int prev_space = remove_ws;
        while (len) {
            const char *r = normalize_prefix(n, s, len, &rl, &used);
            if (prev_space)
                while (rl && *r == ' ') { r++; rl--; }
            if (rl) {
                for (size_t i = 0; i < rl; i++) {
                    if (escape && r[i] == ' ') {
                        if (put(&b, SPACE_SYMBOL, 3)) goto nomem;
                    } else if (put(&b, r + i, 1)) {
                        goto nomem;
                    }
                }
                prev_space = r[rl - 1] == ' ';
            }
            s += used;
            len -= used;
            if (!remove_ws) prev_space = 0;
        }
        if (remove_ws)
            while (b.n >= space_len && memcmp(b.p + b.n - space_len, space, space_len) == 0) b.n -= space_len;
    }
    if (put(&b, "", 0)) goto nomem;
    b.p[b.n] = '\0';
    *out = b.p;
    *out_len = b.n;
    return KILN_OK;
nomem:
    free(b.p);
    return oom(b.cap * 2);
}

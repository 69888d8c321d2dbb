/* tokenizer.c - CLIP's byte-level BPE tokenizer, a port of openai/CLIP's
 * simple_tokenizer.py: clean the text (ftfy-like fixes, HTML unescape, whitespace),
 * lower-case it, split it with CLIP's regex, map each piece's UTF-8 bytes to the
 * bytes_to_unicode alphabet and merge symbol pairs by rank; "</w>" ends a word.
 *
 * What ftfy.fix_text does that this file does not: mojibake repair (fix_encoding and
 * its helpers restore_byte_a0, replace_lossy_sequences, decode_inconsistent_utf8),
 * and full NFC: text is composed (starter + marks, Hangul) but not decomposed or
 * reordered first, so singletons such as U+212B and marks out of canonical order
 * stay as they are. fix_line_breaks and fix_surrogates are left out because their
 * output is whitespace (collapsed anyway) or cannot occur in UTF-8.
 * Tokens absent from the vocabulary become <|endoftext|>, the unk token of Hugging
 * Face's CLIPTokenizer (CLIP itself raises KeyError). */
#include "tokenizer.h"

#include "json.h"
#include "unicode.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#define NO_SYM UINT32_MAX
/* CLIP keeps merges[1:49152-256-2+1] of its merges file. */
#define CLIP_MERGES_MAX (49152 - 256 - 2)
#define MAX_VOCAB_ID (1 << 24)
#define MAX_FILE_BYTES ((size_t)1 << 30)
/* CLIP's text is read up to its last used merge line (about 1.4 MB); a gzip that
 * inflates far past that without enough lines is not one (a 1 MB bomb would
 * otherwise fill MAX_FILE_BYTES) */
#define MAX_CLIP_TEXT_BYTES ((size_t)64 << 20)
#define CACHE_MAX_ENTRIES 8192
#define CACHE_MAX_WORD 256
#define FTFY_MAX_ROUNDS 16

static const char BOS_TOKEN[] = "<|startoftext|>";
static const char EOS_TOKEN[] = "<|endoftext|>";

typedef struct {
    uint32_t off, len; /* bytes in t->strs */
    int32_t id;        /* vocabulary id, -1 when the symbol is not in the vocabulary */
    uint32_t flags;
} tok_sym;
enum { SYM_BASE = 1, SYM_MERGED = 2 };

typedef struct { uint32_t a, b, result, rank; } tok_merge; /* a == NO_SYM: empty slot */

typedef struct {
    uint64_t hash;
    uint32_t key_off, key_len, ids_off, n_ids;
} tok_cache_entry;

typedef struct { uint32_t rank, pos, a, b, result; } bpe_cand;

typedef struct { uint32_t *v; size_t n, cap; } u32vec;

struct kiln_tokenizer {
    char *strs;                 /* symbol strings, back to back */
    size_t strs_len, strs_cap;
    tok_sym *syms;
    uint32_t n_syms, syms_cap;
    uint32_t *sym_index;        /* open addressing: symbol + 1, 0 = empty */
    uint32_t sym_mask;
    tok_merge *merges;
    uint32_t merge_mask, n_merges;
    uint32_t *id_sym;           /* id -> symbol (NO_SYM for holes) */
    int n_ids;
    uint32_t byte_sym[256], byte_sym_end[256];
    uint32_t byte_cp[256];      /* bytes_to_unicode */
    int16_t cp_byte[324];       /* and back (its code points are < 324) */
    int bos, eos, unk;
    /* word -> ids cache */
    tok_cache_entry *cache;
    uint32_t cache_mask, cache_n;
    char *cache_keys;
    size_t cache_keys_len, cache_keys_cap;
    int *cache_ids;
    size_t cache_ids_len, cache_ids_cap;
    /* scratch of encode */
    u32vec buf[3];
    uint32_t *bpe_sym;
    int32_t *bpe_prev, *bpe_next;
    uint32_t *bpe_pending;
    bpe_cand *bpe_heap;
    size_t bpe_cap;
    unsigned char *word;
    size_t word_cap;
};

/* ------------------------------------------------------------------ helpers */

static kiln_status oom(size_t bytes)
{
    return kiln_error_oom("cpu", bytes, 0, 0, "tokenizer: out of memory (%zu bytes)", bytes);
}

/* Grows *p (elements of size es) to hold at least need elements. */
static kiln_status grow(void **p, size_t *cap, size_t need, size_t es)
{
    if (need <= *cap) return KILN_OK;
    size_t n = *cap ? *cap : 16;
    while (n < need) {
        if (n > SIZE_MAX / 2 / es) return oom(SIZE_MAX);
        n *= 2;
    }
    void *q = realloc(*p, n * es);
    if (!q) return oom(n * es);
    *p = q;
    *cap = n;
    return KILN_OK;
}

static kiln_status u32_reserve(u32vec *a, size_t need)
{
    return grow((void **)&a->v, &a->cap, need, sizeof(uint32_t));
}

static uint64_t hash_bytes(const void *p, size_t n)
{
    const unsigned char *s = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint32_t a, uint32_t b)
{
    uint64_t x = ((uint64_t)a << 32 | b) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    return x ^ (x >> 29);
}

/* Copies the current error message (kiln_error formats into that same buffer). */
static void last_error_copy(char *buf, size_t n)
{
    snprintf(buf, n, "%s", kiln_last_error());
}

/* ------------------------------------------------------------------ symbols */

static uint32_t sym_find(const kiln_tokenizer *t, const char *s, size_t n)
{
    if (!t->sym_index) return NO_SYM;
    for (uint64_t i = hash_bytes(s, n) & t->sym_mask;; i = (i + 1) & t->sym_mask) {
        uint32_t e = t->sym_index[i];
        if (!e) return NO_SYM;
        const tok_sym *y = &t->syms[e - 1];
        if (y->len == n && memcmp(t->strs + y->off, s, n) == 0) return e - 1;
    }
}

static kiln_status sym_rehash(kiln_tokenizer *t, uint32_t cap)
{
    uint32_t *idx = calloc(cap, sizeof *idx);
    if (!idx) return oom((size_t)cap * sizeof *idx);
    for (uint32_t k = 0; k < t->n_syms; k++) {
        const tok_sym *y = &t->syms[k];
        uint64_t i = hash_bytes(t->strs + y->off, y->len) & (cap - 1);
        while (idx[i]) i = (i + 1) & (cap - 1);
        idx[i] = k + 1;
    }
    free(t->sym_index);
    t->sym_index = idx;
    t->sym_mask = cap - 1;
    return KILN_OK;
}

static kiln_status sym_intern(kiln_tokenizer *t, const char *s, size_t n, uint32_t *out)
{
    uint32_t k = sym_find(t, s, n);
    if (k != NO_SYM) { *out = k; return KILN_OK; }
    if (n > UINT32_MAX / 2 || t->strs_len + n > UINT32_MAX || t->n_syms >= (1u << 30))
        return kiln_error(KILN_ERR_FORMAT, "tokenizer: vocabulary too large");
    kiln_status st;
    if ((size_t)(t->n_syms + 1) * 2 > (size_t)t->sym_mask + 1 || !t->sym_index) {
        uint32_t cap = t->sym_index ? (t->sym_mask + 1) * 2 : 1024;
        if ((st = sym_rehash(t, cap))) return st;
    }
    size_t cap = t->strs_cap, scap = t->syms_cap;
    if ((st = grow((void **)&t->strs, &cap, t->strs_len + n + 1, 1))) return st;
    t->strs_cap = cap;
    if ((st = grow((void **)&t->syms, &scap, (size_t)t->n_syms + 1, sizeof(tok_sym)))) return st;
    t->syms_cap = (uint32_t)scap;
    memcpy(t->strs + t->strs_len, s, n);
    t->strs[t->strs_len + n] = '\0';
    k = t->n_syms++;
    t->syms[k] = (tok_sym){(uint32_t)t->strs_len, (uint32_t)n, -1, 0};
    t->strs_len += n + 1;
    uint64_t i = hash_bytes(s, n) & t->sym_mask;
    while (t->sym_index[i]) i = (i + 1) & t->sym_mask;
    t->sym_index[i] = k + 1;
    *out = k;
    return KILN_OK;
}

static const char *sym_str(const kiln_tokenizer *t, uint32_t k) { return t->strs + t->syms[k].off; }

/* ------------------------------------------------------------------ merges */

static const tok_merge *merge_find(const kiln_tokenizer *t, uint32_t a, uint32_t b)
{
    if (!t->merges) return NULL;
    for (uint64_t i = hash_pair(a, b) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const tok_merge *m = &t->merges[i];
        if (m->a == NO_SYM) return NULL;
        if (m->a == a && m->b == b) return m;
    }
}

static kiln_status merge_rehash(kiln_tokenizer *t, uint32_t cap)
{
    tok_merge *tab = malloc((size_t)cap * sizeof *tab);
    if (!tab) return oom((size_t)cap * sizeof *tab);
    for (uint32_t i = 0; i < cap; i++) tab[i].a = NO_SYM;
    if (t->merges) {
        for (uint32_t k = 0; k <= t->merge_mask; k++) {
            const tok_merge *m = &t->merges[k];
            if (m->a == NO_SYM) continue;
            uint64_t i = hash_pair(m->a, m->b) & (cap - 1);
            while (tab[i].a != NO_SYM) i = (i + 1) & (cap - 1);
            tab[i] = *m;
        }
    }
    free(t->merges);
    t->merges = tab;
    t->merge_mask = cap - 1;
    return KILN_OK;
}

/* A repeated pair takes the later rank, as Python's dict(zip(merges, ranks)) does. */
static kiln_status merge_put(kiln_tokenizer *t, uint32_t a, uint32_t b, uint32_t result, uint32_t rank)
{
    kiln_status st;
    if (!t->merges || (size_t)(t->n_merges + 1) * 2 > (size_t)t->merge_mask + 1) {
        if ((st = merge_rehash(t, t->merges ? (t->merge_mask + 1) * 2 : 1024))) return st;
    }
    uint64_t i = hash_pair(a, b) & t->merge_mask;
    while (t->merges[i].a != NO_SYM && !(t->merges[i].a == a && t->merges[i].b == b))
        i = (i + 1) & t->merge_mask;
    if (t->merges[i].a == NO_SYM) t->n_merges++;
    t->merges[i] = (tok_merge){a, b, result, rank};
    t->syms[result].flags |= SYM_MERGED;
    return KILN_OK;
}

/* ------------------------------------------------------------------ loading */

static kiln_status read_file(const char *path, char **out, size_t *len)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return kiln_error(KILN_ERR_IO, "tokenizer: cannot open '%s': %s", path, strerror(errno));
    char *buf = NULL;
    size_t n = 0, cap = 0;
    kiln_status st = KILN_OK;
    for (;;) {
        if ((st = grow((void **)&buf, &cap, n + 65536 + 1, 1))) break;
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (n > MAX_FILE_BYTES) {
            st = kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s' is larger than %zu bytes", path,
                            MAX_FILE_BYTES);
            break;
        }
        if (r == 0) {
            if (ferror(f)) st = kiln_error(KILN_ERR_IO, "tokenizer: cannot read '%s'", path);
            break;
        }
    }
    fclose(f);
    if (st) { free(buf); return st; }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return KILN_OK;
}

/* Reads a gzip (or, transparently, a plain) file up to its max_lines-th line. */
static kiln_status read_gz(const char *path, size_t max_lines, char **out, size_t *len)
{
    *out = NULL;
    errno = 0;
    gzFile f = gzopen(path, "rb");
    if (!f)
        return kiln_error(KILN_ERR_IO, "tokenizer: cannot open '%s': %s", path,
                          errno ? strerror(errno) : "out of memory");
    char *buf = NULL;
    size_t n = 0, cap = 0, lines = 0;
    kiln_status st = KILN_OK;
    for (;;) {
        if ((st = grow((void **)&buf, &cap, n + 262144 + 1, 1))) break;
        size_t want = cap - n - 1;
        if (want > (1u << 30)) want = 1u << 30;
        int r = gzread(f, buf + n, (unsigned)want);
        int err;
        const char *msg = gzerror(f, &err);
        if (r < 0 || (err != Z_OK && err != Z_STREAM_END)) {
            st = kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s': truncated or corrupt gzip data (%s)", path,
                            msg ? msg : "?");
            break;
        }
        if (r == 0) break;
        for (size_t i = n; i < n + (size_t)r; i++) lines += buf[i] == '\n';
        n += (size_t)r;
        if (lines >= max_lines) break;
        if (n > MAX_CLIP_TEXT_BYTES) {
            st = kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s' holds more than %zu bytes before its last merge", path,
                            MAX_CLIP_TEXT_BYTES);
            break;
        }
    }
    gzclose(f);
    if (st) { free(buf); return st; }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return KILN_OK;
}

/* gunzip of data in memory, up to its max_lines-th line (read_gz's twin: data that
 * does not start with the gzip magic is taken as plain text, as gzopen does). */
static kiln_status gunzip_memory(const unsigned char *data, size_t len, const char *name, size_t max_lines,
                                 char **out, size_t *out_len)
{
    *out = NULL;
    if (len < 2 || data[0] != 0x1f || data[1] != 0x8b) {
        char *buf = malloc(len + 1);
        if (!buf) return oom(len + 1);
        if (len) memcpy(buf, data, len);
        buf[len] = '\0';
        *out = buf;
        *out_len = len;
        return KILN_OK;
    }
    if (len > MAX_FILE_BYTES)
        return kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s' is larger than %zu bytes", name, MAX_FILE_BYTES);
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit2(&zs, 15 + 16) != Z_OK) return oom(sizeof zs); /* 15 + 16: gzip wrapper only */
    char *buf = NULL;
    size_t n = 0, cap = 0, lines = 0;
    kiln_status st = KILN_OK;
    zs.next_in = (unsigned char *)data; /* zlib's API is not const; it does not write there */
    zs.avail_in = (uInt)len;
    for (;;) {
        if ((st = grow((void **)&buf, &cap, n + 262144 + 1, 1))) break;
        size_t want = cap - n - 1;
        if (want > (1u << 30)) want = 1u << 30;
        zs.next_out = (unsigned char *)buf + n;
        zs.avail_out = (uInt)want;
        int r = inflate(&zs, Z_NO_FLUSH);
        size_t got = want - zs.avail_out;
        for (size_t i = n; i < n + got; i++) lines += buf[i] == '\n';
        n += got;
        if (r == Z_STREAM_END || lines >= max_lines) break;
        /* there is always room for output, so a buffer error means the input ran out */
        if (r == Z_BUF_ERROR || (r == Z_OK && got == 0 && zs.avail_in == 0)) {
            st = kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s': truncated gzip data", name);
            break;
        }
        if (r != Z_OK) {
            st = kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s': corrupt gzip data (%s)", name,
                            zs.msg ? zs.msg : "?");
            break;
        }
        if (n > MAX_CLIP_TEXT_BYTES) {
            st = kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s' holds more than %zu bytes before its last merge", name,
                            MAX_CLIP_TEXT_BYTES);
            break;
        }
    }
    inflateEnd(&zs);
    if (st) { free(buf); return st; }
    buf[n] = '\0';
    *out = buf;
    *out_len = n;
    return KILN_OK;
}

/* bytes_to_unicode(): printable Latin-1 bytes stand for themselves, the others are
 * shifted to U+0100.. in byte order. Interns the 256 symbols and their "</w>" forms. */
static kiln_status init_bytes(kiln_tokenizer *t, uint32_t order[256])
{
    int k = 0, shift = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        if (printable) order[k++] = (uint32_t)b;
    }
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        t->byte_cp[b] = printable ? (uint32_t)b : (uint32_t)(256 + shift++);
        if (!printable) order[k++] = (uint32_t)b;
    }
    for (size_t i = 0; i < sizeof t->cp_byte / sizeof t->cp_byte[0]; i++) t->cp_byte[i] = -1;
    for (int b = 0; b < 256; b++) t->cp_byte[t->byte_cp[b]] = (int16_t)b;
    for (int i = 0; i < 256; i++) {
        uint32_t b = order[i];
        char s[8];
        size_t n = kiln_unicode_utf8_encode(t->byte_cp[b], s);
        kiln_status st = sym_intern(t, s, n, &t->byte_sym[b]);
        if (st) return st;
        memcpy(s + n, "</w>", 4);
        if ((st = sym_intern(t, s, n + 4, &t->byte_sym_end[b]))) return st;
        t->syms[t->byte_sym[b]].flags |= SYM_BASE;
        t->syms[t->byte_sym_end[b]].flags |= SYM_BASE;
    }
    return KILN_OK;
}

static kiln_status set_id(kiln_tokenizer *t, uint32_t sym, int id)
{
    if (id >= t->n_ids) {
        size_t cap = (size_t)t->n_ids, need = (size_t)id + 1;
        size_t newcap = cap ? cap : 1024;
        while (newcap < need) newcap *= 2;
        uint32_t *p = realloc(t->id_sym, newcap * sizeof *p);
        if (!p) return oom(newcap * sizeof *p);
        for (size_t i = cap; i < newcap; i++) p[i] = NO_SYM;
        t->id_sym = p;
        t->n_ids = (int)newcap; /* trimmed to max id + 1 when loading ends */
    }
    t->id_sym[id] = sym;
    t->syms[sym].id = id; /* a repeated string keeps its last id, as a Python dict would */
    return KILN_OK;
}

/* Parses merges text: one "left right" pair per line, a first line holding
 * "#version" is a header. Keeps at most max_merges. With ids_from >= 0 each merged
 * string also gets the next vocabulary id (CLIP's derived vocabulary). */
static kiln_status parse_merges(kiln_tokenizer *t, const char *path, char *text, size_t len,
                                size_t max_merges, int *ids_from)
{
    char *tmp = NULL;
    size_t tmp_cap = 0;
    size_t line_no = 0;
    uint32_t rank = 0;
    kiln_status st = KILN_OK;
    size_t pos = 0;
    while (pos < len && rank < max_merges) {
        size_t end = pos;
        while (end < len && text[end] != '\n') end++;
        line_no++;
        char *line = text + pos;
        size_t n = end - pos;
        pos = end + 1;
        if (line_no == 1) {
            /* CLIP's file starts '"bpe_simple_vocab_16e6.txt#version: 0.2', Hugging Face's
             * '#version: 0.2'. */
            int header = 0;
            for (size_t i = 0; i + 8 <= n; i++)
                if (memcmp(line + i, "#version", 8) == 0) { header = 1; break; }
            if (header) continue;
        }
        const char *f[3];
        size_t fl[3];
        int nf = 0;
        for (size_t i = 0; i < n;) {
            while (i < n && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) i++;
            if (i >= n) break;
            size_t s = i;
            while (i < n && line[i] != ' ' && line[i] != '\t' && line[i] != '\r') i++;
            if (nf < 3) { f[nf] = line + s; fl[nf] = i - s; }
            nf++;
        }
        if (nf == 0) continue;
        if (nf != 2) {
            st = kiln_error(KILN_ERR_FORMAT,
                            "tokenizer: '%s' line %zu: expected two symbols, found %d in '%.*s'%s", path,
                            line_no, nf, (int)(n < 60 ? n : 60), line, end >= len ? " (file truncated?)" : "");
            break;
        }
        uint32_t a, b, r;
        if ((st = sym_intern(t, f[0], fl[0], &a))) break;
        if ((st = sym_intern(t, f[1], fl[1], &b))) break;
        if ((st = grow((void **)&tmp, &tmp_cap, fl[0] + fl[1], 1))) break;
        memcpy(tmp, f[0], fl[0]);
        memcpy(tmp + fl[0], f[1], fl[1]);
        if ((st = sym_intern(t, tmp, fl[0] + fl[1], &r))) break;
        if ((st = merge_put(t, a, b, r, rank))) break;
        if (ids_from && (st = set_id(t, r, (*ids_from)++))) break;
        rank++;
    }
    free(tmp);
    return st;
}

static kiln_status load_vocab_json(kiln_tokenizer *t, const char *path)
{
    char *text;
    size_t len;
    kiln_status st = read_file(path, &text, &len);
    if (st) return st;
    kiln_json *root = NULL;
    st = kiln_json_parse(text, len, &root);
    if (st) {
        char msg[512];
        last_error_copy(msg, sizeof msg);
        free(text);
        return kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s': invalid JSON: %s", path, msg);
    }
    if (root->type != KILN_JSON_OBJECT) {
        st = kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s': expected an object of token -> id", path);
        goto done;
    }
    /* ids index a table: they must be dense enough that one entry cannot make it
     * far larger than the vocabulary (Hugging Face numbers tokens 0 .. n - 1) */
    int64_t id_limit = (int64_t)root->count * 2 + 1024;
    if (id_limit > MAX_VOCAB_ID) id_limit = MAX_VOCAB_ID;
    for (const kiln_json *e = root->child; e; e = e->next) {
        if (e->type != KILN_JSON_NUMBER || !e->is_integer || e->integer < 0 || e->integer >= id_limit) {
            st = kiln_error(KILN_ERR_FORMAT,
                            "tokenizer: '%s': token '%.60s' has no valid id (an integer in [0, %lld) for %zu tokens)",
                            path, e->key ? e->key : "", (long long)id_limit, root->count);
            goto done;
        }
        uint32_t k;
        if ((st = sym_intern(t, e->key ? e->key : "", e->key ? e->key_len : 0, &k))) goto done;
        if ((st = set_id(t, k, (int)e->integer))) goto done;
    }
done:
    kiln_json_free(root);
    free(text);
    return st;
}

/* A vocab.json token that no merge produces means the merges file is cut short or
 * belongs to another vocabulary; "<...>" entries are special tokens. */
static kiln_status check_merges_cover_vocab(kiln_tokenizer *t, const char *merges_path)
{
    for (int id = 0; id < t->n_ids; id++) {
        uint32_t k = t->id_sym[id];
        if (k == NO_SYM || t->syms[k].flags & (SYM_BASE | SYM_MERGED)) continue;
        const char *s = sym_str(t, k);
        size_t n = t->syms[k].len;
        if (n >= 2 && s[0] == '<' && s[n - 1] == '>') continue;
        return kiln_error(KILN_ERR_FORMAT,
                          "tokenizer: '%s': no merge produces vocabulary token '%.60s' (id %d): "
                          "merges file truncated or from another vocabulary",
                          merges_path, s, id);
    }
    return KILN_OK;
}

static kiln_status finish_vocab(kiln_tokenizer *t, const char *vocab_path)
{
    int n = t->n_ids;
    while (n > 0 && t->id_sym[n - 1] == NO_SYM) n--;
    t->n_ids = n;
    uint32_t k = sym_find(t, BOS_TOKEN, strlen(BOS_TOKEN));
    if (k == NO_SYM || t->syms[k].id < 0)
        return kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s': the vocabulary has no %s token", vocab_path,
                          BOS_TOKEN);
    t->bos = t->syms[k].id;
    k = sym_find(t, EOS_TOKEN, strlen(EOS_TOKEN));
    if (k == NO_SYM || t->syms[k].id < 0)
        return kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s': the vocabulary has no %s token", vocab_path,
                          EOS_TOKEN);
    t->eos = t->syms[k].id;
    t->unk = t->eos;
    return KILN_OK;
}

/* CLIP's own format (the text of bpe_simple_vocab_16e6.txt): merges[1:48895];
 * the vocabulary is the bytes, the bytes + "</w>", the merged strings, then the two
 * specials, in that order. name labels errors. */
static kiln_status load_clip_text(kiln_tokenizer *t, const uint32_t order[256], const char *name, char *text,
                                  size_t len)
{
    kiln_status st = KILN_OK;
    int id = 0;
    for (int i = 0; i < 256 && !st; i++) st = set_id(t, t->byte_sym[order[i]], id++);
    for (int i = 0; i < 256 && !st; i++) st = set_id(t, t->byte_sym_end[order[i]], id++);
    if (st) return st;
    if ((st = parse_merges(t, name, text, len, CLIP_MERGES_MAX, &id))) return st;
    if (t->n_merges == 0) return kiln_error(KILN_ERR_FORMAT, "tokenizer: '%s' holds no merges", name);
    uint32_t k;
    if ((st = sym_intern(t, BOS_TOKEN, strlen(BOS_TOKEN), &k)) || (st = set_id(t, k, id++))) return st;
    if ((st = sym_intern(t, EOS_TOKEN, strlen(EOS_TOKEN), &k)) || (st = set_id(t, k, id++))) return st;
    return finish_vocab(t, name);
}

static char *path_join(const char *dir, size_t dlen, const char *name)
{
    size_t n = strlen(name);
    char *p = malloc(dlen + 1 + n + 1);
    if (!p) return NULL;
    memcpy(p, dir, dlen);
    size_t k = dlen;
    if (k && p[k - 1] != '/') p[k++] = '/';
    memcpy(p + k, name, n + 1);
    return p;
}

static char *str_dup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = malloc(n);
    if (p) memcpy(p, s, n);
    return p;
}

static int file_exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && !S_ISDIR(sb.st_mode);
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

kiln_status kiln_tokenizer_open(const char *path, kiln_tokenizer **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_open: out is NULL");
    *out = NULL;
    if (!path || !*path) return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_open: empty path");
    struct stat sb;
    if (stat(path, &sb) != 0)
        return kiln_error(KILN_ERR_IO, "tokenizer: cannot open '%s': %s", path, strerror(errno));

    kiln_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return oom(sizeof *t);
    char *vocab = NULL, *merges = NULL, *text = NULL;
    uint32_t order[256];
    kiln_status st = init_bytes(t, order);
    if (st) goto fail;

    if (S_ISDIR(sb.st_mode)) {
        size_t dl = strlen(path);
        vocab = path_join(path, dl, "vocab.json");
        merges = path_join(path, dl, "merges.txt");
        if (!vocab || !merges) { st = oom(dl * 2); goto fail; }
        if (!file_exists(vocab)) {
            free(vocab);
            vocab = NULL;
            char *gz = path_join(path, dl, "bpe_simple_vocab_16e6.txt.gz");
            if (!gz) { st = oom(dl); goto fail; }
            if (!file_exists(gz)) {
                free(gz);
                st = kiln_error(KILN_ERR_IO,
                                "tokenizer: '%s' holds neither vocab.json + merges.txt nor "
                                "bpe_simple_vocab_16e6.txt.gz", path);
                goto fail;
            }
            free(merges);
            merges = gz;
        } else if (!file_exists(merges)) {
            st = kiln_error(KILN_ERR_IO, "tokenizer: cannot open '%s' (needed beside '%s')", merges, vocab);
            goto fail;
        }
    } else if (ends_with(path, ".json")) {
        const char *slash = strrchr(path, '/');
        size_t dl = slash ? (size_t)(slash - path + 1) : 0;
        vocab = str_dup(path);
        merges = path_join(path, dl, "merges.txt");
        if (!vocab || !merges) { st = oom(strlen(path)); goto fail; }
    } else {
        merges = str_dup(path);
        if (!merges) { st = oom(strlen(path)); goto fail; }
    }

    size_t len = 0;
    if (vocab) {
        /* Hugging Face: ids from vocab.json, every merge of merges.txt */
        if ((st = load_vocab_json(t, vocab))) goto fail;
        if ((st = read_file(merges, &text, &len))) goto fail;
        if ((st = parse_merges(t, merges, text, len, SIZE_MAX, NULL))) goto fail;
        if ((st = finish_vocab(t, vocab))) goto fail;
        if ((st = check_merges_cover_vocab(t, merges))) goto fail;
    } else {
        if ((st = read_gz(merges, CLIP_MERGES_MAX + 1, &text, &len))) goto fail;
        if ((st = load_clip_text(t, order, merges, text, len))) goto fail;
    }
    free(text);
    free(vocab);
    free(merges);
    *out = t;
    return KILN_OK;
fail:
    free(text);
    free(vocab);
    free(merges);
    kiln_tokenizer_free(t);
    return st;
}

kiln_status kiln_tokenizer_open_memory(const void *data, size_t len, const char *name, kiln_tokenizer **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_open_memory: out is NULL");
    *out = NULL;
    if (!data && len) return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_open_memory: data is NULL");
    if (!name) name = "(memory)";
    kiln_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return oom(sizeof *t);
    uint32_t order[256];
    char *text = NULL;
    size_t n = 0;
    kiln_status st = init_bytes(t, order);
    if (!st) st = gunzip_memory(data, len, name, CLIP_MERGES_MAX + 1, &text, &n);
    if (!st) st = load_clip_text(t, order, name, text, n);
    free(text);
    if (st) {
        kiln_tokenizer_free(t);
        return st;
    }
    *out = t;
    return KILN_OK;
}

/* The bytes of runtime/data/bpe_simple_vocab_16e6.txt.gz, compiled in by
 * runtime/data/gen_blob.lua. */
extern const unsigned char kiln_clip_vocab_gz[];
extern const size_t kiln_clip_vocab_gz_len;

kiln_status kiln_tokenizer_open_builtin(kiln_tokenizer **out)
{
    return kiln_tokenizer_open_memory(kiln_clip_vocab_gz, kiln_clip_vocab_gz_len, KILN_TOKENIZER_BUILTIN_NAME,
                                      out);
}

void kiln_tokenizer_free(kiln_tokenizer *t)
{
    if (!t) return;
    free(t->strs);
    free(t->syms);
    free(t->sym_index);
    free(t->merges);
    free(t->id_sym);
    free(t->cache);
    free(t->cache_keys);
    free(t->cache_ids);
    for (int i = 0; i < 3; i++) free(t->buf[i].v);
    free(t->bpe_sym);
    free(t->bpe_prev);
    free(t->bpe_next);
    free(t->bpe_pending);
    free(t->bpe_heap);
    free(t->word);
    free(t);
}

int kiln_tokenizer_bos(const kiln_tokenizer *t) { return t ? t->bos : -1; }
int kiln_tokenizer_eos(const kiln_tokenizer *t) { return t ? t->eos : -1; }
int kiln_tokenizer_vocab_size(const kiln_tokenizer *t) { return t ? t->n_ids : 0; }

int kiln_tokenizer_token_id(const kiln_tokenizer *t, const char *token)
{
    if (!t || !token) return -1;
    uint32_t k = sym_find(t, token, strlen(token));
    return k == NO_SYM ? -1 : t->syms[k].id;
}

/* ------------------------------------------------------------------ text cleaning */

static int is_ascii_alnum(uint32_t c)
{
    return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
}

static int hex_value(uint32_t c)
{
    if (c >= '0' && c <= '9') return (int)(c - '0');
    if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f') return (int)((c | 0x20) - 'a' + 10);
    return -1;
}

/* Python html._replace_charref for a number: writes 0 or 1 code point. */
static int charref_number(uint32_t num, uint32_t *out)
{
    if (num == 0) { *out = KILN_UNICODE_REPLACEMENT; return 1; }
    if (num == 0x0D) { *out = 0x0D; return 1; }
    if (num >= 0x80 && num <= 0x9F) { *out = kiln_unicode_cp1252(num); return 1; }
    if ((num >= 0xD800 && num <= 0xDFFF) || num > 0x10FFFF) { *out = KILN_UNICODE_REPLACEMENT; return 1; }
    if ((num >= 0x01 && num <= 0x08) || num == 0x0B || (num >= 0x0E && num <= 0x1F) || num == 0x7F ||
        (num >= 0xFDD0 && num <= 0xFDEF) || (num & 0xFFFE) == 0xFFFE)
        return 0;
    *out = num;
    return 1;
}

/* Parses "#digits" / "#xhex" at v[i] (just after '&') as Python's html module does.
 * Returns the code points consumed (0 when no match), the value saturated. */
static size_t parse_number(const uint32_t *v, size_t n, size_t i, uint32_t *num)
{
    size_t j = i + 1;
    uint64_t x = 0;
    if (j < n && (v[j] == 'x' || v[j] == 'X') && j + 1 < n && hex_value(v[j + 1]) >= 0) {
        j++;
        while (j < n && hex_value(v[j]) >= 0) {
            x = x * 16 + (uint64_t)hex_value(v[j++]);
            if (x > 0x110000) x = 0x110000;
        }
    } else if (j < n && v[j] >= '0' && v[j] <= '9') {
        while (j < n && v[j] >= '0' && v[j] <= '9') {
            x = x * 10 + (v[j++] - '0');
            if (x > 0x110000) x = 0x110000;
        }
    } else {
        return 0;
    }
    if (j < n && v[j] == ';') j++;
    *num = (uint32_t)x;
    return j - i;
}

/* Python's html.unescape. Every replacement is shorter than its reference, so out
 * never outgrows in. */
static kiln_status html_unescape(const u32vec *in, u32vec *out, int *changed)
{
    const uint32_t *v = in->v;
    size_t n = in->n;
    out->n = 0;
    kiln_status st = u32_reserve(out, n);
    if (st) return st;
    for (size_t i = 0; i < n;) {
        if (v[i] != '&' || i + 1 >= n) { out->v[out->n++] = v[i++]; continue; }
        if (v[i + 1] == '#') {
            uint32_t num, c;
            size_t k = parse_number(v, n, i + 1, &num);
            if (!k) { out->v[out->n++] = v[i++]; continue; }
            if (charref_number(num, &c)) out->v[out->n++] = c;
            i += 1 + k;
            *changed = 1;
            continue;
        }
        /* [^\t\n\f <&#;]{1,32};? */
        size_t j = i + 1;
        char name[34];
        size_t k = 0;
        while (j < n && k < 32 && v[j] != '\t' && v[j] != '\n' && v[j] != '\f' && v[j] != ' ' && v[j] != '<' &&
               v[j] != '&' && v[j] != '#' && v[j] != ';') {
            name[k++] = v[j] < 0x80 ? (char)v[j] : '\x01';
            j++;
        }
        if (k == 0) { out->v[out->n++] = v[i++]; continue; }
        int semi = j < n && v[j] == ';';
        const kiln_unicode_entity *e = kiln_unicode_entity_find(name, k);
        if (e && (semi || e->bare)) {
            out->v[out->n++] = e->cp[0];
            if (e->cp[1]) out->v[out->n++] = e->cp[1];
            i = j + (size_t)semi;
            *changed = 1;
            continue;
        }
        /* the longest prefix (of at least 2) that is a name valid without ';' */
        size_t total = k + (size_t)semi, x;
        for (x = total - 1; x >= 2; x--) {
            if (x > k) continue; /* a prefix holding the ';' is no name */
            e = kiln_unicode_entity_find(name, x);
            if (e && e->bare) break;
        }
        if (x >= 2) { /* only legacy names work bare, and each is one character */
            out->v[out->n++] = e->cp[0];
            i = i + 1 + x; /* the rest is copied as it is */
            *changed = 1;
            continue;
        }
        out->v[out->n++] = v[i++];
    }
    return KILN_OK;
}

/* ftfy's unescape_html: "&#?[0-9A-Za-z]{1,24};" decoded when it is an HTML5 name
 * ending in ';' (or such a lower-case name upper-cased) or a complete numeric
 * reference. */
static kiln_status ftfy_unescape(const u32vec *in, u32vec *out, int *changed)
{
    const uint32_t *v = in->v;
    size_t n = in->n;
    out->n = 0;
    kiln_status st = u32_reserve(out, n);
    if (st) return st;
    for (size_t i = 0; i < n;) {
        if (v[i] != '&') { out->v[out->n++] = v[i++]; continue; }
        size_t j = i + 1;
        int numeric = j < n && v[j] == '#';
        if (numeric) j++;
        size_t k = 0;
        while (j + k < n && k < 25 && is_ascii_alnum(v[j + k])) k++;
        if (k < 1 || k > 24 || j + k >= n || v[j + k] != ';') { out->v[out->n++] = v[i++]; continue; }
        size_t end = j + k + 1;
        if (numeric) {
            uint32_t num, c;
            size_t used = parse_number(v, n, i + 1, &num);
            int got = charref_number(num, &c);
            /* ftfy keeps the reference when html.unescape leaves a ';' (unconsumed, or &#59;) */
            if (used != end - (i + 1) || (got && c == ';')) { out->v[out->n++] = v[i++]; continue; }
            if (got) out->v[out->n++] = c;
        } else {
            char name[25], lower[25];
            int upper_only = 1;
            for (size_t q = 0; q < k; q++) {
                name[q] = (char)v[j + q];
                lower[q] = (char)(name[q] >= 'A' && name[q] <= 'Z' ? name[q] + 32 : name[q]);
                if (name[q] >= 'a' && name[q] <= 'z') upper_only = 0;
            }
            const kiln_unicode_entity *e = kiln_unicode_entity_find(name, k);
            if (e) {
                out->v[out->n++] = e->cp[0];
                if (e->cp[1]) out->v[out->n++] = e->cp[1];
            } else if (upper_only && (e = kiln_unicode_entity_find(lower, k)) && e->upper[0]) {
                for (int q = 0; q < 3 && e->upper[q]; q++) out->v[out->n++] = e->upper[q];
            } else {
                out->v[out->n++] = v[i++];
                continue;
            }
        }
        i = end;
        *changed = 1;
    }
    return KILN_OK;
}

/* ftfy's fix_c1_controls, fix_latin_ligatures, fix_character_width and uncurl_quotes:
 * each maps single characters, so they run as one pass. Writes up to 3 code points. */
static int ftfy_map_char(uint32_t c, uint32_t out[3])
{
    uint32_t a[3];
    int n = 1;
    a[0] = kiln_unicode_cp1252(c);
    switch (a[0]) { /* ligatures */
    case 0x132: a[0] = 'I'; a[1] = 'J'; n = 2; break;
    case 0x133: a[0] = 'i'; a[1] = 'j'; n = 2; break;
    case 0x149: a[0] = 0x2BC; a[1] = 'n'; n = 2; break;
    case 0x1F1: a[0] = 'D'; a[1] = 'Z'; n = 2; break;
    case 0x1F2: a[0] = 'D'; a[1] = 'z'; n = 2; break;
    case 0x1F3: a[0] = 'd'; a[1] = 'z'; n = 2; break;
    case 0x1C4: a[0] = 'D'; a[1] = 0x17D; n = 2; break;
    case 0x1C5: a[0] = 'D'; a[1] = 0x17E; n = 2; break;
    case 0x1C6: a[0] = 'd'; a[1] = 0x17E; n = 2; break;
    case 0x1C7: a[0] = 'L'; a[1] = 'J'; n = 2; break;
    case 0x1C8: a[0] = 'L'; a[1] = 'j'; n = 2; break;
    case 0x1C9: a[0] = 'l'; a[1] = 'j'; n = 2; break;
    case 0x1CA: a[0] = 'N'; a[1] = 'J'; n = 2; break;
    case 0x1CB: a[0] = 'N'; a[1] = 'j'; n = 2; break;
    case 0x1CC: a[0] = 'n'; a[1] = 'j'; n = 2; break;
    case 0xFB00: a[0] = 'f'; a[1] = 'f'; n = 2; break;
    case 0xFB01: a[0] = 'f'; a[1] = 'i'; n = 2; break;
    case 0xFB02: a[0] = 'f'; a[1] = 'l'; n = 2; break;
    case 0xFB03: a[0] = 'f'; a[1] = 'f'; a[2] = 'i'; n = 3; break;
    case 0xFB04: a[0] = 'f'; a[1] = 'f'; a[2] = 'l'; n = 3; break;
    case 0xFB05: a[0] = 0x17F; a[1] = 't'; n = 2; break;
    case 0xFB06: a[0] = 's'; a[1] = 't'; n = 2; break;
    default: {
        uint32_t w[2];
        int k = kiln_unicode_width_fold(a[0], w);
        if (k) { a[0] = w[0]; a[1] = w[1]; n = k; }
    }
    }
    for (int i = 0; i < n; i++) {
        uint32_t x = a[i];
        if (x == 0x2BC || (x >= 0x2018 && x <= 0x201B)) x = '\'';
        else if (x >= 0x201C && x <= 0x201F) x = '"';
        out[i] = x;
    }
    return n;
}

static int is_ftfy_control(uint32_t c)
{
    return c <= 0x08 || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F || (c >= 0x206A && c <= 0x206F) ||
           c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFC);
}

/* Canonical composition without the decomposition and reordering of full NFC. */
static int compose(u32vec *a)
{
    size_t n = a->n, k = 0;
    uint32_t *v = a->v;
    size_t i;
    for (i = 0; i < n && v[i] < 0x300; i++) {}
    if (i == n) return 0;
    long sp = -1;
    int last = 256, changed = 0;
    for (i = 0; i < n; i++) {
        uint32_t c = v[i];
        int cc = kiln_unicode_combining_class(c);
        if (sp >= 0 && (last < cc || last == 0)) {
            uint32_t p = kiln_unicode_compose(v[sp], c);
            if (p) { v[sp] = p; changed = 1; continue; }
        }
        if (cc == 0) sp = (long)k;
        last = cc;
        v[k++] = c;
    }
    a->n = k;
    return changed;
}

/* One ftfy.fix_and_explain round on a segment, in ftfy's order. */
static kiln_status ftfy_round(u32vec *a, u32vec *b, int unescape, int *changed)
{
    kiln_status st;
    if (unescape) {
        int ch = 0;
        if ((st = ftfy_unescape(a, b, &ch))) return st;
        if (ch) { u32vec t = *a; *a = *b; *b = t; *changed = 1; }
    }
    /* character maps; terminal escapes ("\033[" [0-9;]* letter); control characters */
    b->n = 0;
    if ((st = u32_reserve(b, a->n * 3))) return st;
    for (size_t i = 0; i < a->n; i++) {
        uint32_t c = a->v[i], m[3];
        if (c == 0x1B && i + 1 < a->n && a->v[i + 1] == '[') {
            size_t j = i + 2;
            while (j < a->n && ((a->v[j] >= '0' && a->v[j] <= '9') || a->v[j] == ';')) j++;
            if (j < a->n && a->v[j] < 0x80 && ((a->v[j] | 0x20) >= 'a' && (a->v[j] | 0x20) <= 'z')) {
                i = j;
                *changed = 1;
                continue;
            }
        }
        int k = ftfy_map_char(c, m);
        if (k != 1 || m[0] != c) *changed = 1;
        for (int q = 0; q < k; q++) {
            if (is_ftfy_control(m[q])) { *changed = 1; continue; }
            b->v[b->n++] = m[q];
        }
    }
    { u32vec t = *a; *a = *b; *b = t; }
    if (compose(a)) *changed = 1;
    return KILN_OK;
}

/* ftfy.fix_text on the whole text: line by line; HTML entities are decoded until
 * the first line that holds a '<' (ftfy's unescape_html="auto"). */
static kiln_status ftfy_fix(kiln_tokenizer *t, u32vec *text)
{
    u32vec *seg = &t->buf[1], *tmp = &t->buf[2], out = {0};
    kiln_status st = KILN_OK;
    int unescape = 1;
    size_t pos = 0;
    int any = 0;
    for (size_t i = 0; i < text->n; i++) {
        uint32_t c = text->v[i];
        if (c >= 0x80 || c == '&' || c < 0x20 || c == 0x7F) { any = 1; break; }
    }
    if (!any) return KILN_OK; /* printable ASCII without entities: nothing to fix */
    while (pos < text->n) {
        size_t end = pos;
        while (end < text->n && text->v[end] != '\n') end++;
        if (end < text->n) end++;
        if (unescape)
            for (size_t i = pos; i < end; i++)
                if (text->v[i] == '<') { unescape = 0; break; }
        seg->n = 0;
        if ((st = u32_reserve(seg, end - pos))) goto done;
        memcpy(seg->v, text->v + pos, (end - pos) * sizeof(uint32_t));
        seg->n = end - pos;
        for (int round = 0; round < FTFY_MAX_ROUNDS; round++) {
            int changed = 0;
            if ((st = ftfy_round(seg, tmp, unescape, &changed))) goto done;
            if (!changed) break;
        }
        if ((st = u32_reserve(&out, out.n + seg->n + 1))) goto done;
        if (seg->n) memcpy(out.v + out.n, seg->v, seg->n * sizeof(uint32_t));
        out.n += seg->n;
        pos = end;
    }
    { u32vec x = *text; *text = out; out = x; }
done:
    free(out.v);
    return st;
}

/* Python's str.lower(), with the final sigma rule of unicodeobject.c. */
static uint32_t lower_sigma(const uint32_t *v, size_t n, size_t i)
{
    size_t j = i;
    uint32_t c = 0;
    while (j > 0) {
        c = v[--j];
        if (!kiln_unicode_is_case_ignorable(c)) break;
        c = 0;
    }
    int final = c && kiln_unicode_is_cased(c);
    if (final) {
        for (j = i + 1; j < n; j++)
            if (!kiln_unicode_is_case_ignorable(v[j])) break;
        final = j == n || !kiln_unicode_is_cased(v[j]);
    }
    return final ? 0x3C2 : 0x3C3;
}

/* basic_clean (after ftfy) + whitespace_clean + lower(): b = clean(a). */
static kiln_status clean_text(u32vec *a, u32vec *b)
{
    kiln_status st;
    for (int pass = 0; pass < 2; pass++) { /* html.unescape(html.unescape(text)) */
        size_t i;
        for (i = 0; i < a->n && a->v[i] != '&'; i++) {}
        if (i == a->n) break;
        int ch = 0;
        if ((st = html_unescape(a, b, &ch))) return st;
        u32vec x = *a; *a = *b; *b = x;
    }
    /* whitespace runs -> ' ', strip, lower-case */
    b->n = 0;
    if ((st = u32_reserve(b, a->n * 2 + 1))) return st;
    int pending_space = 0;
    for (size_t i = 0; i < a->n; i++) {
        uint32_t c = a->v[i];
        if (kiln_unicode_is_space(c)) { pending_space = 1; continue; }
        if (pending_space && b->n) b->v[b->n++] = ' ';
        pending_space = 0;
        if (c < 0x80) b->v[b->n++] = c >= 'A' && c <= 'Z' ? c + 32 : c;
        else if (c == 0x3A3) b->v[b->n++] = lower_sigma(a->v, a->n, i);
        else if (c == 0x130) { b->v[b->n++] = 'i'; b->v[b->n++] = 0x307; }
        else b->v[b->n++] = kiln_unicode_lower(c);
    }
    return KILN_OK;
}

/* ------------------------------------------------------------------ BPE */

static void heap_push(bpe_cand *h, size_t *n, bpe_cand c)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p].rank < c.rank || (h[p].rank == c.rank && h[p].pos < c.pos)) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static bpe_cand heap_pop(bpe_cand *h, size_t *n)
{
    bpe_cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        bpe_cand *best = &last;
        if (l < *n && (h[l].rank < best->rank || (h[l].rank == best->rank && h[l].pos < best->pos))) {
            m = l;
            best = &h[l];
        }
        if (l + 1 < *n &&
            (h[l + 1].rank < best->rank || (h[l + 1].rank == best->rank && h[l + 1].pos < best->pos)))
            m = l + 1;
        if (m == i) break;
        h[i] = h[m];
        i = m;
    }
    if (*n) h[i] = last;
    return top;
}

static void bpe_try_push(kiln_tokenizer *t, size_t *hn, uint32_t i)
{
    int32_t j = t->bpe_next[i];
    if (j < 0) return;
    const tok_merge *m = merge_find(t, t->bpe_sym[i], t->bpe_sym[j]);
    if (m) heap_push(t->bpe_heap, hn, (bpe_cand){m->rank, i, m->a, m->b, m->result});
}

/* CLIP's bpe(): repeatedly merge every occurrence (left to right) of the adjacent
 * pair of lowest rank. A heap of candidate pairs ordered by (rank, position) gives
 * the same result in O(n log n); pairs made while one rank is swept wait until that
 * sweep ends, as in CLIP's loop. Appends ids to out. */
static kiln_status bpe_word(kiln_tokenizer *t, const unsigned char *w, size_t n, int **out, size_t *out_n,
                            size_t *out_cap)
{
    kiln_status st;
    if (n > t->bpe_cap) {
        size_t cap = n;
        free(t->bpe_sym);
        free(t->bpe_prev);
        free(t->bpe_next);
        free(t->bpe_pending);
        free(t->bpe_heap);
        t->bpe_sym = malloc(cap * sizeof *t->bpe_sym);
        t->bpe_prev = malloc(cap * sizeof *t->bpe_prev);
        t->bpe_next = malloc(cap * sizeof *t->bpe_next);
        t->bpe_pending = malloc(cap * 2 * sizeof *t->bpe_pending);
        t->bpe_heap = malloc(cap * 3 * sizeof *t->bpe_heap);
        if (!t->bpe_sym || !t->bpe_prev || !t->bpe_next || !t->bpe_pending || !t->bpe_heap) {
            t->bpe_cap = 0;
            return oom(cap * 32);
        }
        t->bpe_cap = cap;
    }
    uint32_t *s = t->bpe_sym;
    int32_t *prev = t->bpe_prev, *next = t->bpe_next;
    for (size_t i = 0; i < n; i++) {
        s[i] = i + 1 == n ? t->byte_sym_end[w[i]] : t->byte_sym[w[i]];
        prev[i] = (int32_t)i - 1;
        next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    size_t hn = 0;
    for (size_t i = 0; i + 1 < n; i++) bpe_try_push(t, &hn, (uint32_t)i);
    while (hn) {
        uint32_t rank = t->bpe_heap[0].rank;
        size_t np = 0;
        while (hn && t->bpe_heap[0].rank == rank) {
            bpe_cand c = heap_pop(t->bpe_heap, &hn);
            uint32_t i = c.pos;
            int32_t j = next[i];
            if (s[i] != c.a || j < 0 || s[j] != c.b) continue; /* stale */
            s[i] = c.result;
            next[i] = next[j];
            if (next[j] >= 0) prev[next[j]] = (int32_t)i;
            s[j] = NO_SYM;
            if (prev[i] >= 0) t->bpe_pending[np++] = (uint32_t)prev[i];
            t->bpe_pending[np++] = i;
        }
        for (size_t q = 0; q < np; q++)
            if (s[t->bpe_pending[q]] != NO_SYM) bpe_try_push(t, &hn, t->bpe_pending[q]);
    }
    for (int32_t i = 0; i >= 0; i = next[i]) {
        if ((st = grow((void **)out, out_cap, *out_n + 1, sizeof(int)))) return st;
        int id = t->syms[s[i]].id;
        (*out)[(*out_n)++] = id >= 0 ? id : t->unk;
    }
    return KILN_OK;
}

static void cache_clear(kiln_tokenizer *t)
{
    if (t->cache) memset(t->cache, 0, ((size_t)t->cache_mask + 1) * sizeof *t->cache);
    t->cache_n = 0;
    t->cache_keys_len = 0;
    t->cache_ids_len = 0;
}

/* Token ids of one regex piece (UTF-8 bytes w), through the word cache. */
static kiln_status encode_word(kiln_tokenizer *t, const unsigned char *w, size_t n, int **out, size_t *out_n,
                               size_t *out_cap)
{
    kiln_status st;
    if (n > CACHE_MAX_WORD) return bpe_word(t, w, n, out, out_n, out_cap);
    if (!t->cache) {
        t->cache = calloc(CACHE_MAX_ENTRIES * 2, sizeof *t->cache);
        if (!t->cache) return oom(CACHE_MAX_ENTRIES * 2 * sizeof *t->cache);
        t->cache_mask = CACHE_MAX_ENTRIES * 2 - 1;
    }
    uint64_t h = hash_bytes(w, n) | 1; /* hash 0 marks an empty slot */
    uint64_t i = h & t->cache_mask;
    for (;; i = (i + 1) & t->cache_mask) {
        tok_cache_entry *e = &t->cache[i];
        if (!e->hash) break;
        if (e->hash == h && e->key_len == n && memcmp(t->cache_keys + e->key_off, w, n) == 0) {
            if ((st = grow((void **)out, out_cap, *out_n + e->n_ids, sizeof(int)))) return st;
            memcpy(*out + *out_n, t->cache_ids + e->ids_off, e->n_ids * sizeof(int));
            *out_n += e->n_ids;
            return KILN_OK;
        }
    }
    size_t first = *out_n;
    if ((st = bpe_word(t, w, n, out, out_n, out_cap))) return st;
    size_t k = *out_n - first;
    if (t->cache_n >= CACHE_MAX_ENTRIES || t->cache_keys_len > (1u << 22) || t->cache_ids_len > (1u << 20)) {
        cache_clear(t);
        for (i = h & t->cache_mask; t->cache[i].hash; i = (i + 1) & t->cache_mask) {}
    }
    if (grow((void **)&t->cache_keys, &t->cache_keys_cap, t->cache_keys_len + n, 1) ||
        grow((void **)&t->cache_ids, &t->cache_ids_cap, t->cache_ids_len + k, sizeof(int)))
        return KILN_OK; /* the cache is an optimisation; the ids are already out */
    memcpy(t->cache_keys + t->cache_keys_len, w, n);
    memcpy(t->cache_ids + t->cache_ids_len, *out + first, k * sizeof(int));
    t->cache[i] = (tok_cache_entry){h, (uint32_t)t->cache_keys_len, (uint32_t)n, (uint32_t)t->cache_ids_len,
                                    (uint32_t)k};
    t->cache_keys_len += n;
    t->cache_ids_len += k;
    t->cache_n++;
    return KILN_OK;
}

/* Does v[i..] spell the special token s? The regex is case-insensitive and the text
 * already lower-case; simple case folding also maps U+017F (long s) to 's'. */
static size_t match_special(const uint32_t *v, size_t n, size_t i, const char *s)
{
    size_t k = 0;
    for (; s[k]; k++) {
        if (i + k >= n) return 0;
        uint32_t c = v[i + k];
        if (c == 0x17F) c = 's';
        if (c != (unsigned char)s[k]) return 0;
    }
    return k;
}

static int is_s(uint32_t c) { return c == 's' || c == 0x17F; }

/* Length of CLIP's contraction alternatives 's|'t|'re|'ve|'m|'ll|'d at v[i]. */
static size_t match_contraction(const uint32_t *v, size_t n, size_t i)
{
    if (v[i] != '\'' || i + 1 >= n) return 0;
    uint32_t c = v[i + 1], d = i + 2 < n ? v[i + 2] : 0;
    if (is_s(c) || c == 't' || c == 'm' || c == 'd') return 2;
    if ((c == 'r' || c == 'v') && d == 'e') return 3;
    if (c == 'l' && d == 'l') return 3;
    return 0;
}

/* Not thread-safe on one tokenizer: the word cache and the scratch buffers live in t.
 * *ids is malloc'd even when *n is 0. */
kiln_status kiln_tokenizer_encode(kiln_tokenizer *t, const char *text, size_t len, int **ids, int *n)
{
    if (ids) *ids = NULL;
    if (n) *n = 0;
    if (!t || !ids || !n || (!text && len))
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode: NULL argument");
    if (len > ((size_t)1 << 31))
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode: text of %zu bytes is too long", len);
    kiln_status st;
    u32vec *a = &t->buf[0];
    a->n = 0;
    if ((st = u32_reserve(a, len + 1))) return st;
    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = 0; i < len;) {
        uint32_t c;
        i += kiln_unicode_utf8_decode(s + i, len - i, &c);
        a->v[a->n++] = c;
    }
    if ((st = ftfy_fix(t, a))) return st;
    u32vec lowered = {0};
    if ((st = clean_text(a, &lowered))) { free(lowered.v); return st; }

    int *out = malloc(sizeof(int) * 16);
    size_t on = 0, ocap = 16;
    if (!out) { free(lowered.v); return oom(16 * sizeof(int)); }
    const uint32_t *v = lowered.v;
    size_t vn = lowered.n;
    for (size_t i = 0; i < vn && !st;) {
        uint32_t c = v[i];
        size_t k;
        int special = -1;
        if (c == '<' && (k = match_special(v, vn, i, BOS_TOKEN))) special = t->bos;
        else if (c == '<' && (k = match_special(v, vn, i, EOS_TOKEN))) special = t->eos;
        else if ((k = match_contraction(v, vn, i))) {}
        else if (kiln_unicode_is_letter(c))
            for (k = 1; i + k < vn && kiln_unicode_is_letter(v[i + k]); k++) {}
        else if (kiln_unicode_is_number(c)) k = 1;
        else if (kiln_unicode_is_space(c)) { i++; continue; }
        else {
            for (k = 1; i + k < vn; k++) {
                uint32_t d = v[i + k];
                if (kiln_unicode_is_space(d) || kiln_unicode_is_letter(d) || kiln_unicode_is_number(d)) break;
            }
        }
        /* the piece's UTF-8 bytes */
        size_t wn = 0;
        if ((st = grow((void **)&t->word, &t->word_cap, k * 4, 1))) break;
        for (size_t q = 0; q < k; q++) wn += kiln_unicode_utf8_encode(v[i + q], (char *)t->word + wn);
        i += k;
        if (special >= 0 && wn == k) { /* exactly "<|startoftext|>" (not the long-s spelling) */
            if ((st = grow((void **)&out, &ocap, on + 1, sizeof(int)))) break;
            out[on++] = special;
            continue;
        }
        st = encode_word(t, t->word, wn, &out, &on, &ocap);
    }
    free(lowered.v);
    if (st) { free(out); return st; }
    if (on > INT32_MAX) {
        free(out);
        return kiln_error(KILN_ERR_ARG, "kiln_tokenizer_encode: too many tokens");
    }
    *ids = out;
    *n = (int)on;
    return KILN_OK;
}

char *kiln_tokenizer_decode(const kiln_tokenizer *t, const int *ids, int n)
{
    if (!t || (n > 0 && !ids)) return NULL;
    size_t cap = 64, len = 0;
    char *raw = malloc(cap);
    if (!raw) return NULL;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_ids || t->id_sym[ids[i]] == NO_SYM) continue;
        uint32_t k = t->id_sym[ids[i]];
        const unsigned char *s = (const unsigned char *)sym_str(t, k);
        size_t sn = t->syms[k].len;
        if (grow((void **)&raw, &cap, len + sn + 1, 1)) { free(raw); return NULL; }
        for (size_t j = 0; j < sn;) { /* bytes_to_unicode back to bytes */
            uint32_t c;
            size_t used = kiln_unicode_utf8_decode(s + j, sn - j, &c);
            if (c < 324 && t->cp_byte[c] >= 0) raw[len++] = (char)t->cp_byte[c];
            else { memcpy(raw + len, s + j, used); len += used; }
            j += used;
        }
    }
    /* "</w>" -> ' ', then invalid UTF-8 -> U+FFFD (errors="replace") */
    char *res = malloc(len * 3 + 1);
    if (!res) { free(raw); return NULL; }
    size_t m = 0;
    for (size_t i = 0; i < len;) {
        if (len - i >= 4 && memcmp(raw + i, "</w>", 4) == 0) { res[m++] = ' '; i += 4; continue; }
        uint32_t c;
        size_t used = kiln_unicode_utf8_decode((const unsigned char *)raw + i, len - i, &c);
        if (c == KILN_UNICODE_REPLACEMENT) m += kiln_unicode_utf8_encode(c, res + m);
        else { memcpy(res + m, raw + i, used); m += used; }
        i += used;
    }
    res[m] = '\0';
    free(raw);
    return res;
}

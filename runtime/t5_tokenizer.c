/* t5_tokenizer.c - T5 v1.1's SentencePiece Unigram tokenizer, written from
 * SentencePiece's unigram_model.cc (Model::EncodeOptimized) and
 * sentencepiece_processor.cc so that the ids are SentencePiece's own:
 *  1. normalise (sp_normalizer.c: charsmap, dummy prefix "▁", extra spaces removed,
 *     spaces escaped as "▁");
 *  2. Viterbi over the normalised bytes, one start per UTF-8 character: every piece
 *     that starts there scores its log-probability; a character no single piece covers
 *     is <unk> scored min(piece score) - 10 (kUnkPenalty); ties keep the first path
 *     found, shortest piece first; sums in SentencePiece's own precision (a piece's in
 *     double, an unknown's in float, each path's total kept as float), since the order
 *     of float additions decides between paths that tie in exact arithmetic;
 *  3. runs of <unk> merge into one (PopulateSentencePieceText), then </s>.
 * The pieces live sorted by their bytes; the pieces that start at a position are found
 * by narrowing a range of that list one byte at a time (a trie walk without a trie),
 * so time is linear in the text times the longest piece. */
#include "t5_tokenizer.h"
#include "sp_normalizer.h"

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#define T5_NAME "built-in T5 vocabulary"
/* the compact model inflates to well under this; more is not one */
#define MAX_MODEL_BYTES ((size_t)16 << 20)
#define UNK_PENALTY 10.0f

enum { TYPE_NORMAL = 1, TYPE_UNKNOWN = 2, TYPE_CONTROL = 3 };

typedef struct {
    const unsigned char *p; /* into t->bytes */
    int len, id;
} piece;

struct kiln_t5_tokenizer {
    int n_pieces;
    float *score;
    unsigned char *type;
    unsigned char *bytes;   /* the pieces' bytes, back to back */
    piece *sorted;          /* the NORMAL pieces, by bytes (a prefix before its extensions) */
    int n_sorted, max_len, unk_id;
    float min_score;
    kiln_sp_normalizer norm;
};

static kiln_status oom(size_t bytes)
{
    return kiln_error_oom("cpu", bytes, 0, 0, "t5 tokenizer: out of memory (%zu bytes)", bytes);
}

static kiln_status gunzip(const unsigned char *data, size_t len, const char *name, unsigned char **out,
                          size_t *out_len)
{
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit2(&zs, 15 + 16) != Z_OK) return oom(sizeof zs); /* 15 + 16: gzip wrapper only */
    size_t cap = 1 << 20, n = 0;
    unsigned char *buf = malloc(cap);
    kiln_status st = KILN_OK;
    if (!buf) { inflateEnd(&zs); return oom(cap); }
    zs.next_in = (unsigned char *)data; /* zlib's API is not const; it does not write there */
    zs.avail_in = (uInt)len;
    for (;;) {
        if (n == cap) {
            if (cap >= MAX_MODEL_BYTES) {
                st = kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s' inflates past %zu bytes", name, MAX_MODEL_BYTES);
                break;
            }
            unsigned char *p = realloc(buf, cap * 2);
            if (!p) { st = oom(cap * 2); break; }
            buf = p;
            cap *= 2;
        }
        zs.next_out = buf + n;
        zs.avail_out = (uInt)(cap - n);
        int r = inflate(&zs, Z_NO_FLUSH);
        n = cap - zs.avail_out;
        if (r == Z_STREAM_END) break;
        if (r == Z_BUF_ERROR && zs.avail_out) {
            st = kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s': truncated gzip data", name);
            break;
        }
        if (r != Z_OK && r != Z_BUF_ERROR) {
            st = kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s': corrupt gzip data (%s)", name, zs.msg ? zs.msg : "?");
            break;
        }
    }
    inflateEnd(&zs);
    if (st) { free(buf); return st; }
    *out = buf;
    *out_len = n;
    return KILN_OK;
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int piece_cmp(const void *a, const void *b)
{
    const piece *x = a, *y = b;
    int m = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->p, y->p, (size_t)m);
    if (c) return c;
    return x->len - y->len;
}

void kiln_t5_tokenizer_free(kiln_t5_tokenizer *t)
{
    if (!t) return;
    free(t->score);
    free(t->type);
    free(t->bytes);
    free(t->sorted);
    kiln_sp_normalizer_free(&t->norm);
    free(t);
}

/* Parses the compact form: "KT5V", version 1, pieces, charsmap (gen_t5_vocab.py). */
static kiln_status parse(kiln_t5_tokenizer *t, const unsigned char *d, size_t len, const char *name)
{
    if (len < 16 || memcmp(d, "KT5V", 4) != 0 || le32(d + 4) != 1)
        return kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s' is not a kiln T5 vocabulary (KT5V, version 1)", name);
    uint32_t n = le32(d + 8), cm = le32(d + 12);
    if (n < 3 || n > (1u << 22) || cm > len)
        return kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s': %u pieces, charsmap of %u bytes: not a vocabulary",
                          name, n, cm);
    t->n_pieces = (int)n;
    t->score = malloc(sizeof(float) * n);
    t->type = malloc(n);
    t->sorted = malloc(sizeof(piece) * n);
    t->bytes = malloc(len);
    if (!t->score || !t->type || !t->sorted || !t->bytes) return oom(len + 9 * (size_t)n);
    size_t pos = 16, nb = 0;
    t->unk_id = -1;
    t->min_score = FLT_MAX;
    for (uint32_t i = 0; i < n; i++) {
        if (pos + 6 > len)
            return kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s' ends inside piece %u of %u", name, i, n);
        unsigned char ty = d[pos];
        uint32_t sb = le32(d + pos + 1);
        float s;
        memcpy(&s, &sb, sizeof s);
        size_t pl = d[pos + 5];
        pos += 6;
        if (pl == 0 || pos + pl > len || (ty != TYPE_NORMAL && ty != TYPE_UNKNOWN && ty != TYPE_CONTROL) || s != s)
            return kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s': piece %u is malformed", name, i);
        memcpy(t->bytes + nb, d + pos, pl);
        t->score[i] = s;
        t->type[i] = ty;
        if (ty == TYPE_UNKNOWN) {
            if (t->unk_id >= 0)
                return kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s': two unknown pieces (%d, %u)", name, t->unk_id, i);
            t->unk_id = (int)i;
        }
        if (ty == TYPE_NORMAL) {
            /* SentencePiece's min_score_ counts NORMAL pieces only */
            if (s < t->min_score) t->min_score = s;
            t->sorted[t->n_sorted++] = (piece){t->bytes + nb, (int)pl, (int)i};
            if ((int)pl > t->max_len) t->max_len = (int)pl;
        }
        nb += pl;
        pos += pl;
    }
    if (t->unk_id < 0) return kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s' has no unknown piece", name);
    if (len - pos != cm)
        return kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s': %zu bytes after the pieces, the header says %u",
                          name, len - pos, cm);
    qsort(t->sorted, (size_t)t->n_sorted, sizeof(piece), piece_cmp);
    for (int i = 1; i < t->n_sorted; i++)
        if (piece_cmp(&t->sorted[i - 1], &t->sorted[i]) == 0)
            return kiln_error(KILN_ERR_FORMAT, "t5 tokenizer: '%s': pieces %d and %d are the same", name,
                              t->sorted[i - 1].id, t->sorted[i].id);
    return kiln_sp_normalizer_init(&t->norm, d + pos, cm, name);
}

kiln_status kiln_t5_tokenizer_open_memory(const void *data, size_t len, const char *name, kiln_t5_tokenizer **out)
{
    *out = NULL;
    if (!name) name = "(memory)";
    const unsigned char *d = data;
    unsigned char *raw = NULL;
    kiln_status st;
    if (len >= 2 && d[0] == 0x1f && d[1] == 0x8b) {
        if ((st = gunzip(d, len, name, &raw, &len))) return st;
        d = raw;
    }
    kiln_t5_tokenizer *t = calloc(1, sizeof *t);
    if (!t) { free(raw); return oom(sizeof *t); }
    st = parse(t, d, len, name);
    free(raw);
    if (st) { kiln_t5_tokenizer_free(t); return st; }
    *out = t;
    return KILN_OK;
}

/* The bytes of runtime/data/t5_spiece.bin.gz, compiled in by runtime/data/gen_blob.lua. */
extern const unsigned char kiln_t5_vocab_gz[];
extern const size_t kiln_t5_vocab_gz_len;

kiln_status kiln_t5_tokenizer_open_builtin(kiln_t5_tokenizer **out)
{
    return kiln_t5_tokenizer_open_memory(kiln_t5_vocab_gz, kiln_t5_vocab_gz_len, T5_NAME, out);
}

int kiln_t5_tokenizer_vocab_size(const kiln_t5_tokenizer *t) { return t->n_pieces; }

/* First index in [lo, hi) whose byte at depth d is >= c (> c when after): the range's
 * pieces all have more than d bytes and share their first d. */
static int bound(const piece *s, int lo, int hi, int d, int c, int after)
{
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        int b = s[mid].p[d];
        if (b < c || (after && b == c)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

typedef struct {
    float score; /* of the best path ending here */
    int start;   /* where its last piece starts; -1: no path yet */
    int id;
} node;

/* The first byte's UTF-8 length (SentencePiece's OneCharLen). */
static int char_len(unsigned char c)
{
    static const unsigned char len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[c >> 4];
}

kiln_status kiln_t5_tokenizer_encode(const kiln_t5_tokenizer *t, const char *text, size_t len, int **ids, int *n)
{
    *ids = NULL;
    *n = 0;
    if (len > KILN_T5_MAX_TEXT_BYTES)
        return kiln_error(KILN_ERR_ARG, "t5 tokenizer: text of %zu bytes is longer than the limit of %zu bytes", len,
                          KILN_T5_MAX_TEXT_BYTES);
    char *norm;
    size_t nl;
    kiln_status st = kiln_sp_normalizer_run(&t->norm, text, len,
                                            KILN_SP_ADD_DUMMY_PREFIX | KILN_SP_REMOVE_EXTRA_WHITESPACES |
                                                KILN_SP_ESCAPE_WHITESPACES,
                                            &norm, &nl);
    if (st) return st;
    /* normalisation grows text a bounded number of times (the longest replacement) */
    if (nl > (size_t)INT32_MAX / 2) { free(norm); return kiln_error(KILN_ERR_ARG, "t5 tokenizer: text too long"); }
    const int size = (int)nl;
    const unsigned char *s = (const unsigned char *)norm;
    node *best = malloc(sizeof(node) * ((size_t)size + 1));
    int *out = malloc(sizeof(int) * ((size_t)size + 1)); /* at most one piece a byte, plus </s> */
    if (!best || !out) { free(norm); free(best); free(out); return oom(sizeof(node) * ((size_t)size + 1)); }
    for (int i = 0; i <= size; i++) best[i] = (node){0.0f, -1, -1};
    const float unk_score = t->min_score - UNK_PENALTY;
    for (int at = 0; at < size;) {
        const float here = best[at].score;
        int mblen = char_len(s[at]);
        if (mblen > size - at) mblen = size - at;
        int lo = 0, hi = t->n_sorted, single = 0;
        for (int d = 0; at + d < size && lo < hi; d++) {
            if (t->sorted[lo].len == d) lo++; /* the piece of exactly d bytes sorts first */
            lo = bound(t->sorted, lo, hi, d, s[at + d], 0);
            hi = bound(t->sorted, lo, hi, d, s[at + d], 1);
            if (lo < hi && t->sorted[lo].len == d + 1) {
                const piece *p = &t->sorted[lo];
                node *e = &best[at + d + 1];
                /* in double, as SentencePiece (its score expression is a double
                   because of the user-defined symbols' branch), stored as float */
                double cand = (double)t->score[p->id] + (double)here;
                if (e->start == -1 || cand > (double)e->score) *e = (node){(float)cand, at, p->id};
                if (d + 1 == mblen) single = 1;
            }
        }
        if (!single) {
            node *e = &best[at + mblen];
            float cand = unk_score + here;
            if (e->start == -1 || cand > e->score) *e = (node){cand, at, t->unk_id};
        }
        at += mblen;
    }
    /* back from the end, then reversed; runs of <unk> become one */
    int k = 0;
    for (int end = size; end > 0; end = best[end].start) {
        int id = best[end].id;
        if (!(id == t->unk_id && k && out[k - 1] == t->unk_id)) out[k++] = id;
    }
    for (int i = 0; i < k / 2; i++) {
        int tmp = out[i];
        out[i] = out[k - 1 - i];
        out[k - 1 - i] = tmp;
    }
    out[k++] = KILN_T5_EOS;
    free(norm);
    free(best);
    *ids = out;
    *n = k;
    return KILN_OK;
}

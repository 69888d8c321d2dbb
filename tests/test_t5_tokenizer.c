/* test_t5_tokenizer.c - the T5 tokenizer's C API: SentencePiece's ids for the golden
 * corpus (tests/golden/t5_tokenizer/corpus.txt), the built-in vocabulary, damaged
 * vocabularies (bad header, truncations, corrupt gzip, a charsmap whose trie points
 * anywhere) that must fail or stay in bounds, and hostile text. */
#include "test.h"

#include "t5_tokenizer.h"

#include <stdint.h>
#include <zlib.h>

extern const unsigned char kiln_t5_vocab_gz[];
extern const size_t kiln_t5_vocab_gz_len;

static kiln_t5_tokenizer *g_tok;

static int hexval(int c) { return c <= '9' ? c - '0' : (c | 32) - 'a' + 10; }

static void t_builtin(void)
{
    kiln_status st = kiln_t5_tokenizer_open_builtin(&g_tok);
    CHECK(st == KILN_OK, "open_builtin: %s", kiln_last_error());
    if (st) return;
    CHECK(kiln_t5_tokenizer_vocab_size(g_tok) == 32000, "vocab %d", kiln_t5_tokenizer_vocab_size(g_tok));
    int *ids, n;
    CHECK(kiln_t5_tokenizer_encode(g_tok, "Hello world", 11, &ids, &n) == KILN_OK, "encode");
    CHECK(n == 3 && ids[0] == 8774 && ids[1] == 296 && ids[2] == KILN_T5_EOS, "Hello world: n=%d", n);
    free(ids);
    CHECK(kiln_t5_tokenizer_encode(g_tok, "", 0, &ids, &n) == KILN_OK && n == 1 && ids[0] == 1, "empty");
    free(ids);
}

static void t_corpus(void)
{
    if (!g_tok) { SKIP("no tokenizer"); return; }
    FILE *f = fopen("tests/golden/t5_tokenizer/corpus.txt", "rb");
    CHECK(f, "tests/golden/t5_tokenizer/corpus.txt: cannot open");
    if (!f) return;
    static char line[1 << 17];
    static char text[1 << 16];
    int cases = 0, match = 0;
    while (fgets(line, sizeof line, f)) {
        char *tab = strchr(line, '\t');
        if (!tab) { CHECK(0, "corpus line %d has no tab", cases + 1); break; }
        size_t tl = (size_t)(tab - line) / 2;
        for (size_t i = 0; i < tl; i++) text[i] = (char)(hexval(line[2 * i]) << 4 | hexval(line[2 * i + 1]));
        int *ids, n;
        cases++;
        if (kiln_t5_tokenizer_encode(g_tok, text, tl, &ids, &n)) { CHECK(0, "case %d: %s", cases, kiln_last_error()); continue; }
        char *p = tab + 1;
        int ok = 1, k = 0;
        while (*p && *p != '\n') {
            long want = strtol(p, &p, 10);
            if (k >= n || ids[k] != want) ok = 0;
            k++;
            while (*p == ' ') p++;
        }
        if (ok && k == n) match++;
        else if (cases - match <= 3) CHECK(0, "corpus line %d differs from SentencePiece", cases);
        free(ids);
    }
    fclose(f);
    printf("# t5 tokenizer (C): %d of %d corpus strings match SentencePiece\n", match, cases);
    CHECK(cases >= 4000 && match == cases, "%d of %d", match, cases);
}

/* The built-in vocabulary, inflated: the raw compact form to damage. */
static unsigned char *raw_model(size_t *len)
{
    size_t cap = 4 << 20;
    unsigned char *buf = malloc(cap);
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    inflateInit2(&zs, 15 + 16);
    zs.next_in = (unsigned char *)kiln_t5_vocab_gz;
    zs.avail_in = (uInt)kiln_t5_vocab_gz_len;
    zs.next_out = buf;
    zs.avail_out = (uInt)cap;
    int r = inflate(&zs, Z_FINISH);
    *len = cap - zs.avail_out;
    inflateEnd(&zs);
    if (r != Z_STREAM_END) { free(buf); return NULL; }
    return buf;
}

static void t_damaged(void)
{
    size_t len;
    unsigned char *raw = raw_model(&len);
    CHECK(raw, "cannot inflate the built-in vocabulary");
    if (!raw) return;
    kiln_t5_tokenizer *t = NULL;
    /* the raw (un-gzip'd) form opens too and tokenizes the same */
    CHECK(kiln_t5_tokenizer_open_memory(raw, len, "raw", &t) == KILN_OK, "raw: %s", kiln_last_error());
    int *ids, n;
    if (t) {
        CHECK(kiln_t5_tokenizer_encode(t, "Hello world", 11, &ids, &n) == KILN_OK && n == 3 && ids[0] == 8774, "raw ids");
        free(ids);
        kiln_t5_tokenizer_free(t);
    }
    unsigned char *bad = malloc(len);
    memcpy(bad, raw, len);
    bad[0] = 'X';
    CHECK(kiln_t5_tokenizer_open_memory(bad, len, "bad.bin", &t) == KILN_ERR_FORMAT && !t, "bad magic accepted");
    CHECK(strstr(kiln_last_error(), "bad.bin") && strstr(kiln_last_error(), "not a kiln T5 vocabulary"), "message: %s",
          kiln_last_error());
    /* every truncation fails cleanly (the header's charsmap size no longer fits) */
    static const size_t cuts[] = {0, 3, 15, 16, 17, 100, 5000, 200000, 457000, 0};
    for (int i = 1; cuts[i]; i++) {
        if (cuts[i] >= len) continue;
        kiln_status st = kiln_t5_tokenizer_open_memory(raw, cuts[i], "cut", &t);
        CHECK(st == KILN_ERR_FORMAT && !t, "cut at %zu: status %d", cuts[i], st);
    }
    CHECK(kiln_t5_tokenizer_open_memory(raw, len - 1, "cut", &t) == KILN_ERR_FORMAT, "cut 1 byte");
    /* truncated and corrupt gzip */
    CHECK(kiln_t5_tokenizer_open_memory(kiln_t5_vocab_gz, kiln_t5_vocab_gz_len / 2, "half.gz", &t) == KILN_ERR_FORMAT &&
              strstr(kiln_last_error(), "truncated"),
          "half gzip: %s", kiln_last_error());
    unsigned char *gz = malloc(kiln_t5_vocab_gz_len);
    memcpy(gz, kiln_t5_vocab_gz, kiln_t5_vocab_gz_len);
    for (size_t i = 100; i < 200; i++) gz[i] ^= 0x5a;
    CHECK(kiln_t5_tokenizer_open_memory(gz, kiln_t5_vocab_gz_len, "bad.gz", &t) == KILN_ERR_FORMAT && !t,
          "corrupt gzip accepted");
    free(gz);
    /* the charsmap's trie size past the end */
    uint32_t cm = raw[12] | raw[13] << 8 | (uint32_t)raw[14] << 16 | (uint32_t)raw[15] << 24;
    memcpy(bad, raw, len);
    size_t cm_at = len - cm;
    bad[cm_at] = bad[cm_at + 1] = bad[cm_at + 2] = 0xff;
    bad[cm_at + 3] = 0x0f;
    CHECK(kiln_t5_tokenizer_open_memory(bad, len, "trie.bin", &t) == KILN_ERR_FORMAT && !t, "trie size accepted");
    /* a trie of random units still opens (its shape is not checked) and never reads out of
       bounds: ids stay in the vocabulary (ASan builds check the reads) */
    memcpy(bad, raw, len);
    uint32_t trie = bad[cm_at] | bad[cm_at + 1] << 8 | (uint32_t)bad[cm_at + 2] << 16 | (uint32_t)bad[cm_at + 3] << 24;
    uint32_t seed = 12345;
    for (size_t i = cm_at + 4; i < cm_at + 4 + trie; i++) {
        seed = seed * 1664525u + 1013904223u;
        if ((seed >> 24) < 40) bad[i] = (unsigned char)(seed >> 8);
    }
    CHECK(kiln_t5_tokenizer_open_memory(bad, len, "noise.bin", &t) == KILN_OK, "noise: %s", kiln_last_error());
    if (t) {
        const char *texts[] = {"Hello world", "ｈｅｌｌｏ ﬁ ①", "日本語 😀 \xff", "\t\n  x  "};
        for (int i = 0; i < 4; i++) {
            if (kiln_t5_tokenizer_encode(t, texts[i], strlen(texts[i]), &ids, &n) == KILN_OK) {
                for (int k = 0; k < n; k++) CHECK(ids[k] >= 0 && ids[k] < 32000, "id %d", ids[k]);
                CHECK(n >= 1 && ids[n - 1] == 1, "no </s>");
                free(ids);
            }
        }
        kiln_t5_tokenizer_free(t);
    }
    free(bad);
    free(raw);
}

static void t_hostile(void)
{
    if (!g_tok) { SKIP("no tokenizer"); return; }
    uint32_t seed = 7;
    char buf[512];
    for (int iter = 0; iter < 2000; iter++) {
        size_t len = (size_t)(iter % 500);
        for (size_t i = 0; i < len; i++) {
            seed = seed * 1664525u + 1013904223u;
            buf[i] = (char)(seed >> 24);
        }
        int *ids, n;
        if (kiln_t5_tokenizer_encode(g_tok, buf, len, &ids, &n)) { CHECK(0, "%s", kiln_last_error()); break; }
        int ok = n >= 1 && ids[n - 1] == 1;
        for (int k = 0; k + 1 < n; k++) ok &= ids[k] >= 2 && ids[k] < 32000 && !(ids[k] == 2 && k && ids[k - 1] == 2);
        CHECK(ok, "random bytes %d: ids out of range, unmerged <unk> or no </s>", iter);
        free(ids);
        if (!ok) break;
    }
    /* NUL bytes are text like any other */
    int *ids, n;
    CHECK(kiln_t5_tokenizer_encode(g_tok, "a\0b", 3, &ids, &n) == KILN_OK && n == 5 && ids[2] == 2, "NUL");
    free(ids);
    CHECK(kiln_t5_tokenizer_encode(g_tok, "x", KILN_T5_MAX_TEXT_BYTES + 1, &ids, &n) == KILN_ERR_ARG && !ids,
          "past the limit");
}

int main(void)
{
    RUN(t_builtin);
    RUN(t_corpus);
    RUN(t_damaged);
    RUN(t_hostile);
    kiln_t5_tokenizer_free(g_tok);
    return test_summary();
}

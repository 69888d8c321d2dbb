/* test_tokenizer.c - the CLIP tokenizer against openai/CLIP's own ids
 * ($KILN_SHARED/clip-tokenizer/reference-ids.tsv) in both vocabulary formats and the
 * built-in vocabulary, plus loading from memory, text cleaning, a small hand-made
 * vocabulary, bad files and hostile input. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"

#include "json.h"
#include "tokenizer.h"

#include <stdint.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#define WINDOW 77

static char g_dir[512];     /* $KILN_SHARED/clip-tokenizer, "" when absent */
static char g_tmp[256];     /* scratch folder of this run */

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t r;
    while (buf && (r = fread(buf + n, 1, cap - n, f)) > 0) {
        n += r;
        if (n == cap) {
            char *nb = realloc(buf, cap * 2 + 1);
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) buf[n] = '\0';
    if (len) *len = n;
    return buf;
}

static int spit(const char *path, const char *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok;
}

static const char *tmp_path(const char *name)
{
    static char buf[4][600];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 600, "%s/%s", g_tmp, name);
    return p;
}

static int shared_ready(void)
{
    if (!g_dir[0]) {
        SKIP("%s/clip-tokenizer is absent (set KILN_SHARED to the shared data folder)", test_shared_dir());
        return 0;
    }
    return 1;
}

static kiln_tokenizer *open_or_fail(const char *path)
{
    kiln_tokenizer *t = NULL;
    kiln_status st = kiln_tokenizer_open(path, &t);
    CHECK(st == KILN_OK, "open %s: %s", path, kiln_last_error());
    return t;
}

static kiln_tokenizer *open_builtin(void)
{
    kiln_tokenizer *t = NULL;
    kiln_status st = kiln_tokenizer_open_builtin(&t);
    CHECK(st == KILN_OK, "open the built-in vocabulary: %s", kiln_last_error());
    return t;
}

/* ids of text as a C string */
static int encode_str(kiln_tokenizer *t, const char *text, int **ids)
{
    int n = -1;
    kiln_status st = kiln_tokenizer_encode(t, text, strlen(text), ids, &n);
    CHECK(st == KILN_OK, "encode '%s': %s", text, kiln_last_error());
    return st == KILN_OK ? n : -1;
}

static int same_ids(kiln_tokenizer *t, const char *a, const char *b)
{
    int *x = NULL, *y = NULL;
    int nx = encode_str(t, a, &x), ny = encode_str(t, b, &y);
    int same = nx == ny && nx >= 0 && memcmp(x, y, sizeof(int) * (size_t)nx) == 0;
    if (!same) {
        printf("     ids of '%s':", a);
        for (int i = 0; i < nx; i++) printf(" %d", x[i]);
        printf("\n     ids of '%s':", b);
        for (int i = 0; i < ny; i++) printf(" %d", y[i]);
        printf("\n");
    }
    free(x);
    free(y);
    return same;
}

/* Checks every line of reference-ids.tsv; returns the number that match. */
static int check_reference(kiln_tokenizer *t, const char *label, int *total)
{
    char path[700];
    snprintf(path, sizeof path, "%s/reference-ids.tsv", g_dir);
    size_t len;
    char *text = slurp(path, &len);
    CHECK(text != NULL, "cannot read %s", path);
    *total = 0;
    if (!text) return 0;
    int good = 0, line_no = 0;
    for (char *line = text; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        line_no++;
        char *tab = strchr(line, '\t');
        if (line[0] != '#' && tab) {
            kiln_json *js = NULL;
            kiln_status st = kiln_json_parse(line, (size_t)(tab - line), &js);
            CHECK(st == KILN_OK && js->type == KILN_JSON_STRING, "line %d: bad prompt JSON", line_no);
            int want[WINDOW], nw = 0;
            for (char *p = tab + 1; nw < WINDOW;) {
                char *e;
                long v = strtol(p, &e, 10);
                if (e == p) break;
                want[nw++] = (int)v;
                p = e;
            }
            CHECK(nw == WINDOW, "line %d: %d ids instead of %d", line_no, nw, WINDOW);
            if (st == KILN_OK && js->type == KILN_JSON_STRING && nw == WINDOW) {
                (*total)++;
                int *ids = NULL, n = 0;
                st = kiln_tokenizer_encode(t, js->string, js->string_len, &ids, &n);
                CHECK(st == KILN_OK, "line %d: %s", line_no, kiln_last_error());
                int got[WINDOW], k = 0;
                got[k++] = kiln_tokenizer_bos(t);
                for (int i = 0; i < n && i < WINDOW - 2; i++) got[k++] = ids[i];
                while (k < WINDOW) got[k++] = kiln_tokenizer_eos(t);
                int first_diff = -1;
                for (int i = 0; i < WINDOW && first_diff < 0; i++)
                    if (got[i] != want[i]) first_diff = i;
                if (st == KILN_OK && first_diff < 0) good++;
                else if (st == KILN_OK)
                    CHECK(0, "%s line %d %s: id %d is %d, expected %d", label, line_no, line, first_diff,
                          got[first_diff], want[first_diff]);
                free(ids);
            }
            kiln_json_free(js);
        }
        line = nl ? nl + 1 : NULL;
    }
    free(text);
    return good;
}

static void t_reference_hf_folder(void)
{
    if (!shared_ready()) return;
    double t0 = now_ms();
    kiln_tokenizer *t = open_or_fail(g_dir);
    double t1 = now_ms();
    if (!t) return;
    printf("# open vocab.json + merges.txt: %.1f ms\n", t1 - t0);
    CHECK(kiln_tokenizer_vocab_size(t) == 49408, "vocab size %d", kiln_tokenizer_vocab_size(t));
    CHECK(kiln_tokenizer_bos(t) == 49406 && kiln_tokenizer_eos(t) == 49407, "bos %d eos %d",
          kiln_tokenizer_bos(t), kiln_tokenizer_eos(t));
    int total = 0, good = check_reference(t, "vocab.json", &total);
    printf("# reference ids, vocab.json + merges.txt: %d of %d lines match\n", good, total);
    CHECK(total >= 29 && good == total, "%d of %d lines", good, total);
    kiln_tokenizer_free(t);
}

static void t_reference_gz(void)
{
    if (!shared_ready()) return;
    char path[700];
    snprintf(path, sizeof path, "%s/bpe_simple_vocab_16e6.txt.gz", g_dir);
    double t0 = now_ms();
    kiln_tokenizer *t = open_or_fail(path);
    double t1 = now_ms();
    if (!t) return;
    printf("# open bpe_simple_vocab_16e6.txt.gz: %.1f ms\n", t1 - t0);
    CHECK(kiln_tokenizer_vocab_size(t) == 49408, "vocab size %d", kiln_tokenizer_vocab_size(t));
    CHECK(kiln_tokenizer_bos(t) == 49406 && kiln_tokenizer_eos(t) == 49407, "bos %d eos %d",
          kiln_tokenizer_bos(t), kiln_tokenizer_eos(t));
    int total = 0, good = check_reference(t, "txt.gz", &total);
    printf("# reference ids, bpe_simple_vocab_16e6.txt.gz: %d of %d lines match\n", good, total);
    CHECK(total >= 29 && good == total, "%d of %d lines", good, total);
    kiln_tokenizer_free(t);
}

/* The vocabulary CLIP derives from the .gz equals Hugging Face's vocab.json. */
static void t_formats_agree(void)
{
    if (!shared_ready()) return;
    char path[700];
    snprintf(path, sizeof path, "%s/vocab.json", g_dir); /* the vocab.json path form */
    kiln_tokenizer *a = open_or_fail(path);
    snprintf(path, sizeof path, "%s/bpe_simple_vocab_16e6.txt.gz", g_dir);
    kiln_tokenizer *b = open_or_fail(path);
    if (a && b) {
        int bad = 0;
        for (int id = 0; id < kiln_tokenizer_vocab_size(a) && bad < 5; id++) {
            char *x = kiln_tokenizer_decode(a, &id, 1), *y = kiln_tokenizer_decode(b, &id, 1);
            if (!x || !y || strcmp(x, y) != 0) {
                CHECK(0, "id %d decodes to '%s' and '%s'", id, x ? x : "(null)", y ? y : "(null)");
                bad++;
            }
            free(x);
            free(y);
        }
        CHECK(kiln_tokenizer_token_id(a, "cat</w>") == 2368, "cat</w> -> %d", kiln_tokenizer_token_id(a, "cat</w>"));
        CHECK(kiln_tokenizer_token_id(b, "cat</w>") == 2368, "cat</w> -> %d", kiln_tokenizer_token_id(b, "cat</w>"));
        CHECK(kiln_tokenizer_token_id(a, "<|endoftext|>") == 49407, "eos string");
        CHECK(kiln_tokenizer_token_id(a, "no-such-token</w>") == -1, "absent token");
        int *ids = NULL;
        int n = encode_str(a, "A photo of a cat, café résumé 日本", &ids);
        char *s = kiln_tokenizer_decode(a, ids, n);
        CHECK(s && strcmp(s, "a photo of a cat , café résumé 日本 ") == 0, "decode gave '%s'", s ? s : "(null)");
        free(s);
        free(ids);
        int bogus[3] = {-5, 1 << 30, 320};
        s = kiln_tokenizer_decode(a, bogus, 3);
        CHECK(s && strcmp(s, "a ") == 0, "decode of bad ids gave '%s'", s ? s : "(null)");
        free(s);
    }
    kiln_tokenizer_free(a);
    kiln_tokenizer_free(b);
}

/* The vocabulary compiled into the library needs no file and no shared data. */
static void t_builtin(void)
{
    double t0 = now_ms();
    kiln_tokenizer *t = NULL;
    kiln_status st = kiln_tokenizer_open_builtin(&t);
    double t1 = now_ms();
    CHECK(st == KILN_OK, "open built-in: %s", kiln_last_error());
    if (!t) return;
    printf("# open the built-in vocabulary: %.1f ms\n", t1 - t0);
    CHECK(kiln_tokenizer_vocab_size(t) == 49408, "vocab size %d", kiln_tokenizer_vocab_size(t));
    CHECK(kiln_tokenizer_bos(t) == 49406 && kiln_tokenizer_eos(t) == 49407, "bos %d eos %d",
          kiln_tokenizer_bos(t), kiln_tokenizer_eos(t));
    CHECK(kiln_tokenizer_token_id(t, "cat</w>") == 2368, "cat</w> -> %d", kiln_tokenizer_token_id(t, "cat</w>"));
    int *ids = NULL;
    int n = encode_str(t, "a photo of a cat", &ids);
    int want[] = {320, 1125, 539, 320, 2368};
    CHECK(n == 5 && memcmp(ids, want, sizeof want) == 0, "n=%d", n);
    free(ids);
    kiln_tokenizer_free(t);
}

/* The built-in vocabulary gives openai/CLIP's ids and equals the shared .gz file. */
static void t_builtin_reference(void)
{
    if (!shared_ready()) return;
    kiln_tokenizer *t = open_builtin();
    if (!t) return;
    int total = 0, good = check_reference(t, "built-in", &total);
    printf("# reference ids, built-in vocabulary: %d of %d lines match\n", good, total);
    CHECK(total >= 29 && good == total, "%d of %d lines", good, total);
    char path[700];
    snprintf(path, sizeof path, "%s/bpe_simple_vocab_16e6.txt.gz", g_dir);
    kiln_tokenizer *f = open_or_fail(path);
    if (f) {
        CHECK(kiln_tokenizer_vocab_size(f) == kiln_tokenizer_vocab_size(t), "sizes %d and %d",
              kiln_tokenizer_vocab_size(f), kiln_tokenizer_vocab_size(t));
        int bad = 0;
        for (int id = 0; id < kiln_tokenizer_vocab_size(t) && bad < 5; id++) {
            char *x = kiln_tokenizer_decode(t, &id, 1), *y = kiln_tokenizer_decode(f, &id, 1);
            if (!x || !y || strcmp(x, y) != 0) {
                CHECK(0, "id %d decodes to '%s' and '%s'", id, x ? x : "(null)", y ? y : "(null)");
                bad++;
            }
            free(x);
            free(y);
        }
        kiln_tokenizer_free(f);
    }
    kiln_tokenizer_free(t);
}

static void expect_memory_error(const void *data, size_t len, kiln_status want, const char *needle)
{
    kiln_tokenizer *t = (kiln_tokenizer *)1;
    kiln_status st = kiln_tokenizer_open_memory(data, len, "blob.gz", &t);
    CHECK(st == want, "%zu bytes: status %s, expected %s (%s)", len, kiln_status_name(st), kiln_status_name(want),
          kiln_last_error());
    CHECK(t == NULL, "%zu bytes: out not cleared", len);
    CHECK(strstr(kiln_last_error(), needle) != NULL, "message '%s' lacks '%s'", kiln_last_error(), needle);
    if (st == KILN_OK) kiln_tokenizer_free(t);
}

/* CLIP's format from memory: gzip or plain text, and damaged gzip data. */
static void t_open_memory(void)
{
    static const char merges[] = "\"bpe_simple_vocab_16e6.txt#version: 0.2\nc a\nca t</w>\na t</w>\n";
    kiln_tokenizer *t = NULL;
    CHECK(kiln_tokenizer_open_memory(merges, strlen(merges), "plain", &t) == KILN_OK, "plain: %s",
          kiln_last_error());
    if (t) {
        CHECK(kiln_tokenizer_vocab_size(t) == 517, "plain: size %d", kiln_tokenizer_vocab_size(t));
        CHECK(kiln_tokenizer_token_id(t, "cat</w>") == 513, "plain: cat</w> -> %d",
              kiln_tokenizer_token_id(t, "cat</w>"));
        kiln_tokenizer_free(t);
    }
    gzFile g = gzopen(tmp_path("m.gz"), "wb");
    CHECK(g && gzwrite(g, merges, (unsigned)strlen(merges)) == (int)strlen(merges) && gzclose(g) == Z_OK,
          "write gzip");
    size_t len = 0;
    char *gz = slurp(tmp_path("m.gz"), &len);
    unlink(tmp_path("m.gz"));
    CHECK(gz && len > 18, "read gzip back");
    if (!gz) return;
    t = NULL;
    CHECK(kiln_tokenizer_open_memory(gz, len, "m.gz", &t) == KILN_OK, "gzip: %s", kiln_last_error());
    if (t) {
        CHECK(kiln_tokenizer_vocab_size(t) == 517, "gzip: size %d", kiln_tokenizer_vocab_size(t));
        int *ids = NULL;
        int n = encode_str(t, "cat", &ids);
        CHECK(n == 1 && ids[0] == 513, "gzip: n=%d", n);
        free(ids);
        kiln_tokenizer_free(t);
    }
    expect_memory_error(gz, len - 8, KILN_ERR_FORMAT, "truncated");   /* no trailer */
    expect_memory_error(gz, 12, KILN_ERR_FORMAT, "blob.gz");          /* header only */
    char *bad = malloc(len);
    memcpy(bad, gz, len);
    for (size_t i = 10; i < len; i++) bad[i] = (char)0xff;
    expect_memory_error(bad, len, KILN_ERR_FORMAT, "corrupt gzip");
    free(bad);
    expect_memory_error("", 0, KILN_ERR_FORMAT, "holds no merges");
    expect_memory_error(NULL, 5, KILN_ERR_ARG, "data is NULL");
    CHECK(kiln_tokenizer_open_memory(gz, len, NULL, NULL) == KILN_ERR_ARG, "NULL out");
    free(gz);
}

/* basic_clean / whitespace_clean / lower() equivalences. */
static void t_cleaning(void)
{
    kiln_tokenizer *t = open_builtin(); /* the same vocabulary, with no shared data needed */
    if (!t) return;
    static const char *pairs[][2] = {
        {"  A \t Photo\n\nOF a\xc2\xa0" "cat \xe3\x80\x80 ", "a photo of a cat"}, /* NBSP, ideographic space */
        {"fish &amp; chips &lt;3 &quot;x&quot; &#39;y&#x27; &eacute;", "fish & chips <3 \"x\" 'y' \xc3\xa9"},
        {"fish &amp;amp; chips", "fish & chips"},                     /* unescaped twice */
        {"&ampx &copy2024 &notit; &bogus;", "&x \xc2\xa9" "2024 \xc2\xacit; &bogus;"}, /* legacy prefixes */
        {"&#0; &#x110000; &#128; &#x85;", "\xef\xbf\xbd \xef\xbf\xbd \xe2\x82\xac \xe2\x80\xa6"},
        {"&TRADE; &check; &NTILDE; &nGt;", "\xe2\x84\xa2 \xe2\x9c\x93 \xc3\x91 \xe2\x89\xab\xe2\x83\x92"}, /* HTML5 */
        {"don\xe2\x80\x99t \xe2\x80\x9cquoted\xe2\x80\x9d", "don't \"quoted\""}, /* ftfy uncurl_quotes */
        {"\xef\xbc\xa1\xef\xbc\xa2\xef\xbc\xa3\xef\xbc\x91", "abc1"}, /* fullwidth forms */
        {"\xef\xac\x81ne \xef\xac\x82ow", "fine flow"},              /* ligatures */
        {"caf\x65\xcc\x81 na\x69\xcc\x88ve", "caf\xc3\xa9 na\xc3\xafve"}, /* NFC composition */
        {"\x1b[31mred\x1b[0m b\x01" "e\xef\xbb\xbfll", "red bell"},    /* terminal escapes, controls */
        {"\xce\x9f\xce\x94\xce\x9f\xce\xa3 \xce\xa3\xce\x91", "\xce\xbf\xce\xb4\xce\xbf\xcf\x82 \xcf\x83\xce\xb1"},
        {"\xd0\x9f\xd0\xa0\xd0\x98\xd0\x92\xd0\x95\xd0\xa2", "\xd0\xbf\xd1\x80\xd0\xb8\xd0\xb2\xd0\xb5\xd1\x82"},
        {"\xc3\x9c\x42\x45\x52 \xc3\x89T\xc3\x89", "\xc3\xbc" "ber \xc3\xa9t\xc3\xa9"},
        {"\xc4\xb0stanbul", "i\xcc\x87stanbul"},                    /* U+0130 lowers to i + U+0307 */
        {"<|ENDOFTEXT|>x", "<|endoftext|>x"},
        {"<b>&amp;</b>", "<b>&</b>"}, /* '<': ftfy leaves entities, html.unescape does not */
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        CHECK(same_ids(t, pairs[i][0], pairs[i][1]), "'%s' and '%s' differ", pairs[i][0], pairs[i][1]);
    int *ids = NULL;
    int n = encode_str(t, "<|startoftext|>a<|endoftext|>", &ids);
    CHECK(n == 3 && ids[0] == 49406 && ids[1] == 320 && ids[2] == 49407, "special tokens: n=%d", n);
    free(ids);
    n = encode_str(t, " \t\n ", &ids);
    CHECK(n == 0 && ids != NULL, "blank text: n=%d", n);
    free(ids);
    n = -1;
    CHECK(kiln_tokenizer_encode(t, NULL, 0, &ids, &n) == KILN_OK && n == 0, "NULL, 0");
    free(ids);
    CHECK(kiln_tokenizer_encode(t, NULL, 3, &ids, &n) == KILN_ERR_ARG, "NULL text with a length");
    kiln_tokenizer_free(t);
}

/* A vocabulary made by hand, like the demo model's: not 49408 entries, gaps in the
 * byte alphabet (absent symbols become <|endoftext|>). */
static void t_small_vocab(void)
{
    static const char vocab[] = "{\"c\": 0, \"a\": 1, \"t\": 2, \"t</w>\": 3, \"ca\": 4, \"cat</w>\": 5,"
                                " \"<|startoftext|>\": 6, \"<|endoftext|>\": 7, \"a</w>\": 8, \"at</w>\": 9}";
    static const char merges[] = "#version: 0.2\nc a\nca t</w>\na t</w>\n";
    CHECK(spit(tmp_path("vocab.json"), vocab, strlen(vocab)), "write vocab");
    CHECK(spit(tmp_path("merges.txt"), merges, strlen(merges)), "write merges");
    kiln_tokenizer *t = open_or_fail(g_tmp);
    if (!t) return;
    CHECK(kiln_tokenizer_vocab_size(t) == 10, "vocab size %d", kiln_tokenizer_vocab_size(t));
    CHECK(kiln_tokenizer_bos(t) == 6 && kiln_tokenizer_eos(t) == 7, "bos/eos");
    int *ids = NULL;
    int n = encode_str(t, "CAT cat at a dog", &ids);
    int want[] = {5, 5, 9, 8, 7, 7, 7};
    CHECK(n == 7 && memcmp(ids, want, sizeof want) == 0, "n=%d ids %d %d %d %d %d", n, n > 0 ? ids[0] : -1,
          n > 1 ? ids[1] : -1, n > 2 ? ids[2] : -1, n > 3 ? ids[3] : -1, n > 4 ? ids[4] : -1);
    free(ids);
    kiln_tokenizer_free(t);
    /* merges-only: the vocabulary derived as CLIP does (512 + 3 merges + 2 specials) */
    t = open_or_fail(tmp_path("merges.txt"));
    if (t) {
        CHECK(kiln_tokenizer_vocab_size(t) == 517, "derived size %d", kiln_tokenizer_vocab_size(t));
        CHECK(kiln_tokenizer_token_id(t, "cat</w>") == 513, "cat</w> -> %d", kiln_tokenizer_token_id(t, "cat</w>"));
        CHECK(kiln_tokenizer_bos(t) == 515 && kiln_tokenizer_eos(t) == 516, "bos/eos");
        n = encode_str(t, "cat dog", &ids);
        CHECK(n == 4 && ids[0] == 513, "n=%d", n);
        free(ids);
        kiln_tokenizer_free(t);
    }
    unlink(tmp_path("vocab.json"));
    unlink(tmp_path("merges.txt"));
}

static void expect_error(const char *path, kiln_status want, const char *needle)
{
    kiln_tokenizer *t = (kiln_tokenizer *)1;
    kiln_status st = kiln_tokenizer_open(path, &t);
    CHECK(st == want, "%s: status %s, expected %s (%s)", path, kiln_status_name(st), kiln_status_name(want),
          kiln_last_error());
    CHECK(t == NULL, "%s: out not cleared", path);
    CHECK(strstr(kiln_last_error(), needle) != NULL, "%s: message '%s' lacks '%s'", path, kiln_last_error(), needle);
    if (st == KILN_OK) kiln_tokenizer_free(t);
}

static void t_bad_files(void)
{
    expect_error("/nonexistent/clip-tokenizer", KILN_ERR_IO, "/nonexistent/clip-tokenizer");
    expect_error(g_tmp, KILN_ERR_IO, "neither vocab.json"); /* empty folder */

    static const char small_vocab[] = "{\"c\": 0, \"a\": 1, \"ca\": 2, \"<|startoftext|>\": 3, \"<|endoftext|>\": 4}";
    spit(tmp_path("vocab.json"), small_vocab, strlen(small_vocab));
    expect_error(g_tmp, KILN_ERR_IO, "merges.txt");                 /* merges.txt missing */
    spit(tmp_path("merges.txt"), "#version: 0.2\nc", 15);            /* cut inside a line */
    expect_error(g_tmp, KILN_ERR_FORMAT, "merges.txt' line 2");
    spit(tmp_path("merges.txt"), "#version: 0.2\n", 14);             /* cut at a line end */
    expect_error(g_tmp, KILN_ERR_FORMAT, "merges.txt");
    spit(tmp_path("merges.txt"), "#version: 0.2\nc a\n", 18);
    spit(tmp_path("vocab.json"), "{\"c\": 0, \"a\": ", 14);           /* invalid JSON */
    expect_error(g_tmp, KILN_ERR_FORMAT, "vocab.json");
    spit(tmp_path("vocab.json"), "{\"c\": \"0\"}", 10);              /* id not a number */
    expect_error(g_tmp, KILN_ERR_FORMAT, "vocab.json");
    spit(tmp_path("vocab.json"), "{\"c\": 1e12}", 11);               /* id out of range */
    expect_error(g_tmp, KILN_ERR_FORMAT, "vocab.json");
    static const char sparse[] = "{\"c\": 0, \"a\": 9000000}";     /* an id far past the entries: */
    spit(tmp_path("vocab.json"), sparse, strlen(sparse));
    expect_error(g_tmp, KILN_ERR_FORMAT, "for 2 tokens");           /* refused before its table is made */
    spit(tmp_path("vocab.json"), "[1, 2]", 6);
    expect_error(g_tmp, KILN_ERR_FORMAT, "vocab.json");
    static const char no_specials[] = "{\"c\": 0, \"a\": 1, \"ca\": 2}";
    spit(tmp_path("vocab.json"), no_specials, strlen(no_specials));
    expect_error(g_tmp, KILN_ERR_FORMAT, "<|startoftext|>");
    expect_error(tmp_path("vocab.json"), KILN_ERR_FORMAT, "<|startoftext|>"); /* vocab.json path form */
    unlink(tmp_path("vocab.json"));
    unlink(tmp_path("merges.txt"));
    spit(tmp_path("empty.txt"), "", 0);
    expect_error(tmp_path("empty.txt"), KILN_ERR_FORMAT, "no merges");
    unlink(tmp_path("empty.txt"));

    if (!g_dir[0]) return;
    /* the real files, cut short */
    char path[700];
    size_t len;
    snprintf(path, sizeof path, "%s/merges.txt", g_dir);
    char *m = slurp(path, &len);
    snprintf(path, sizeof path, "%s/vocab.json", g_dir);
    size_t vlen;
    char *v = slurp(path, &vlen);
    CHECK(m && v, "cannot read the shared files");
    if (m && v) {
        spit(tmp_path("vocab.json"), v, vlen);
        char *cut = m + len / 2;
        while (*cut != '\n') cut++;
        spit(tmp_path("merges.txt"), m, (size_t)(cut + 1 - m)); /* half the merges */
        expect_error(g_tmp, KILN_ERR_FORMAT, "merges.txt");
        spit(tmp_path("merges.txt"), m, len / 2 + 1); /* half, cut mid-line maybe */
        kiln_tokenizer *t = NULL;
        CHECK(kiln_tokenizer_open(g_tmp, &t) == KILN_ERR_FORMAT && strstr(kiln_last_error(), "merges.txt"),
              "half merges: %s", kiln_last_error());
        spit(tmp_path("vocab.json"), v, vlen / 2); /* truncated JSON */
        expect_error(g_tmp, KILN_ERR_FORMAT, "vocab.json");
        unlink(tmp_path("vocab.json"));
        unlink(tmp_path("merges.txt"));
    }
    free(m);
    free(v);
    snprintf(path, sizeof path, "%s/bpe_simple_vocab_16e6.txt.gz", g_dir);
    char *gz = slurp(path, &len);
    if (gz) {
        spit(tmp_path("cut.txt.gz"), gz, 200000); /* ends before 48895 lines */
        expect_error(tmp_path("cut.txt.gz"), KILN_ERR_FORMAT, "cut.txt.gz");
        unlink(tmp_path("cut.txt.gz"));
    }
    free(gz);
}

/* Random bytes, invalid UTF-8, a huge word, many distinct words (cache resets). */
static void t_hostile_input(void)
{
    kiln_tokenizer *t = open_builtin(); /* the same vocabulary, with no shared data needed */
    if (!t) return;
    uint64_t s = 12345;
    char buf[512];
    for (int round = 0; round < 300; round++) {
        size_t n = (size_t)(round * 7 % 500) + 1;
        for (size_t i = 0; i < n; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            unsigned r = (unsigned)(s >> 33);
            /* mostly bytes that start entities, escapes, marks and multi-byte sequences */
            static const char pool[] = "&#;x<|>' \x1b[0aA\xcc\x81\xc3\xa9\xe2\x80\x99\xf0\x9f\x99\x82\xce\xa3\xc4\xb0";
            buf[i] = r % 3 ? pool[r / 3 % (sizeof pool - 1)] : (char)(r >> 8);
        }
        int *ids = NULL, k = -1;
        kiln_status st = kiln_tokenizer_encode(t, buf, n, &ids, &k);
        CHECK(st == KILN_OK && k >= 0, "round %d: %s", round, kiln_last_error());
        for (int i = 0; i < k; i++) CHECK(ids[i] >= 0 && ids[i] < 49408, "round %d: id %d", round, ids[i]);
        char *d = kiln_tokenizer_decode(t, ids, k);
        CHECK(d != NULL, "decode");
        free(d);
        free(ids);
    }
    size_t big = 200000;
    char *w = malloc(big + 1);
    for (size_t i = 0; i < big; i++) w[i] = "ab"[i % 7 == 0];
    int *ids = NULL, k = 0;
    double t0 = now_ms();
    CHECK(kiln_tokenizer_encode(t, w, big, &ids, &k) == KILN_OK && k > 0, "huge word");
    printf("# one word of %zu letters: %d tokens in %.1f ms\n", big, k, now_ms() - t0);
    free(ids);
    for (size_t i = 0; i < big; i++) w[i] = i % 6 == 5 ? ' ' : (char)('a' + (i * 7 + i / 6 * 13) % 26);
    t0 = now_ms();
    CHECK(kiln_tokenizer_encode(t, w, big, &ids, &k) == KILN_OK && k > 0, "many words");
    printf("# %zu bytes of 5-letter words: %d tokens in %.1f ms\n", big, k, now_ms() - t0);
    free(ids);
    free(w);
    kiln_tokenizer_free(t);
}

static void t_speed(void)
{
    kiln_tokenizer *t = open_builtin(); /* the same vocabulary, with no shared data needed */
    if (!t) return;
    const char *p = "portrait of a wizard, highly detailed, digital painting, artstation, concept art, "
                    "sharp focus, illustration";
    int *ids = NULL, n = 0;
    kiln_tokenizer_encode(t, p, strlen(p), &ids, &n); /* fills the cache */
    free(ids);
    int reps = 2000;
    double t0 = now_ms();
    for (int i = 0; i < reps; i++) {
        kiln_tokenizer_encode(t, p, strlen(p), &ids, &n);
        free(ids);
    }
    double us = (now_ms() - t0) * 1e3 / reps;
    printf("# encode of a %zu-byte prompt: %.2f us (cached words)\n", strlen(p), us);
    CHECK(us < 5000, "encode took %.1f us", us);
    kiln_tokenizer_free(t);
}

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "%s/clip-tokenizer", test_shared_dir());
    struct stat sb;
    if (stat(g_dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) g_dir[0] = '\0';
    snprintf(g_tmp, sizeof g_tmp, "/tmp/kiln_test_tokenizer_XXXXXX");
    if (!mkdtemp(g_tmp)) {
        printf("FAIL main: cannot create a temporary folder\n");
        return 1;
    }
    RUN(t_reference_hf_folder);
    RUN(t_reference_gz);
    RUN(t_formats_agree);
    RUN(t_builtin);
    RUN(t_builtin_reference);
    RUN(t_open_memory);
    RUN(t_cleaning);
    RUN(t_small_vocab);
    RUN(t_bad_files);
    RUN(t_hostile_input);
    RUN(t_speed);
    rmdir(g_tmp);
    return test_summary();
}

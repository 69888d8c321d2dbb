/* test_png.c - PNG round trips (exact 8-bit values, clamping, text chunks), files
 * written by PIL and by hand (palette, 16-bit, gray+alpha, gAMA 1.0, interlace,
 * tRNS), and clean errors for missing, foreign, truncated and corrupt files. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#include "test_files.h"
#include "png_io.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

/* libpng itself, for the simplified reader's gAMA behaviour (our png.h shadows <png.h>) */
#if defined(__has_include)
#if __has_include(<libpng16/png.h>)
#include <libpng16/png.h>
#endif
#else
#include <libpng16/png.h>
#endif

#define GOLDEN "tests/golden/png/"
enum { GW = 7, GH = 5 };

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* the formulas of tests/golden/gen_png.py */
static int val8(int x, int y, int c) { return (x * 37 + y * 91 + c * 53 + 11) % 256; }
static int val16(int x, int y, int c) { return (x * 7919 + y * 10477 + c * 30011 + 12345) % 65536; }
static const int palette[4][3] = {{255, 0, 0}, {0, 128, 255}, {17, 34, 51}, {250, 250, 250}};
static const int palette_alpha[4] = {255, 0, 128, 64};

static void t_roundtrip(void)
{
    for (int c = 1; c <= 4; c++) {
        int h = 7, w = 13;
        float *px = malloc(sizeof(float) * (size_t)(c * h * w));
        for (int i = 0; i < c * h * w; i++) px[i] = (float)((i * 29 + c) % 256) / 255.0f;
        const char *path = tmp_path("rt.png");
        kiln_status st = kiln_png_write(path, px, c, h, w, 0, NULL, NULL);
        CHECK(st == KILN_OK, "c=%d write: %s", c, kiln_last_error());
        float *back = NULL;
        int bc, bh, bw;
        st = kiln_png_read(path, &back, &bc, &bh, &bw);
        CHECK(st == KILN_OK, "c=%d read: %s", c, kiln_last_error());
        if (!st) {
            CHECK(bc == c && bh == h && bw == w, "c=%d: got %d x %d x %d", c, bc, bh, bw);
            int bad = 0;
            for (int i = 0; i < c * h * w && bc == c; i++) bad += back[i] != px[i]; /* k/255 exactly */
            CHECK(bad == 0, "c=%d: %d values differ", c, bad);
        }
        free(back);
        free(px);
    }
    CHECK(count_tmp_files() == 0, "temporary file left behind");
}

static void t_clamp_round(void)
{
    float in[] = {-1.0f, -0.0f, NAN, 0.0f, 0.5f / 255.0f - 1e-4f, 0.5f / 255.0f + 1e-4f, 0.5f,
                  100.4f / 255.0f, 100.6f / 255.0f, 254.4f / 255.0f, 254.6f / 255.0f, 1.0f, 1.5f, INFINITY,
                  -INFINITY, 1e30f};
    int want[] = {0, 0, 0, 0, 0, 1, 128, 100, 101, 254, 255, 255, 255, 255, 0, 255};
    int n = (int)(sizeof in / sizeof in[0]);
    const char *path = tmp_path("clamp.png");
    CHECK(kiln_png_write(path, in, 1, 1, n, 0, NULL, NULL) == KILN_OK, "%s", kiln_last_error());
    float *back = NULL;
    int c, h, w;
    CHECK(kiln_png_read(path, &back, &c, &h, &w) == KILN_OK && c == 1 && h == 1 && w == n, "%s", kiln_last_error());
    for (int i = 0; back && i < n; i++)
        CHECK(back[i] == (float)want[i] / 255.0f, "input %g -> %g (want %d/255)", in[i], back[i] * 255.0f, want[i]);
    free(back);
}

static int find_text(int n, char **keys, char **values, const char *k, const char *v)
{
    for (int i = 0; i < n; i++)
        if (strcmp(keys[i], k) == 0 && strcmp(values[i], v) == 0) return 1;
    return 0;
}

static int file_has(const unsigned char *b, size_t n, const char *s)
{
    size_t k = strlen(s);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(b + i, s, k) == 0) return 1;
    return 0;
}

static void t_text(void)
{
    char *long_value = malloc(20001);
    for (int i = 0; i < 20000; i++) long_value[i] = (char)('a' + i % 26);
    long_value[20000] = 0;
    const char *keys[] = {"Title", "Description", "multi line", "parameters", "empty", "Title"};
    const char *values[] = {"hello world", "caf\xc3\xa9 \xe2\x98\x95", "line1\nline2", long_value, "", "again"};
    int n = 6;
    float px[3] = {0.25f, 0.5f, 0.75f};
    const char *path = tmp_path("text.png");
    kiln_status st = kiln_png_write(path, px, 3, 1, 1, n, keys, values);
    CHECK(st == KILN_OK, "write: %s", kiln_last_error());
    int m = 0;
    char **k = NULL, **v = NULL;
    st = kiln_png_read_text(path, &m, &k, &v);
    CHECK(st == KILN_OK, "read_text: %s", kiln_last_error());
    CHECK(m == n, "%d entries", m);
    for (int i = 0; i < n && !st; i++) CHECK(find_text(m, k, v, keys[i], values[i]), "entry '%s' missing", keys[i]);
    kiln_png_free_text(m, k, v);
    /* chunk types: ASCII in tEXt, UTF-8 in iTXt */
    size_t len;
    unsigned char *b = read_file(path, &len);
    CHECK(b && file_has(b, len, "tEXtTitle") && file_has(b, len, "iTXtDescription") && file_has(b, len, "tEXtmulti line"),
          "chunk types");
    free(b);
    free(long_value);

    /* a file without text */
    path = tmp_path("notext.png");
    kiln_png_write(path, px, 1, 1, 3, 0, NULL, NULL);
    st = kiln_png_read_text(path, &m, &k, &v);
    CHECK(st == KILN_OK && m == 0, "no text: %d %s", m, kiln_last_error());
    kiln_png_free_text(m, k, v);
}

static void t_text_golden(void)
{
    int m = 0;
    char **k = NULL, **v = NULL;
    kiln_status st = kiln_png_read_text(GOLDEN "pil_text.png", &m, &k, &v);
    CHECK(st == KILN_OK && m == 4, "pil_text: %d entries, %s", m, kiln_last_error());
    char zipped[200] = "";
    for (int i = 0; i < 20; i++) strcat(zipped, "zipped ");
    CHECK(find_text(m, k, v, "Title", "hello"), "tEXt");
    CHECK(find_text(m, k, v, "Author", "caf\xc3\xa9"), "Latin-1 tEXt converted to UTF-8");
    CHECK(find_text(m, k, v, "Comment", zipped), "zTXt");
    CHECK(find_text(m, k, v, "Description", "caf\xc3\xa9 \xe2\x98\x95"), "iTXt");
    kiln_png_free_text(m, k, v);

    st = kiln_png_read_text(GOLDEN "hand_text_after.png", &m, &k, &v);
    CHECK(st == KILN_OK && m == 3, "hand_text_after: %d entries, %s", m, kiln_last_error());
    CHECK(find_text(m, k, v, "Before", "first") && find_text(m, k, v, "After", "second") &&
              find_text(m, k, v, "Utf", "\xc3\xbc\xc3\xb1\xc3\xaf \xf0\x9f\x98\x80"),
          "text before and after IDAT");
    kiln_png_free_text(m, k, v);
}

static void t_text_errors(void)
{
    float px[1] = {0.5f};
    const char *path = tmp_path("keep.png");
    CHECK(kiln_png_write(path, px, 1, 1, 1, 0, NULL, NULL) == KILN_OK, "%s", kiln_last_error());
    size_t n0;
    unsigned char *before = read_file(path, &n0);
    char k80[81];
    memset(k80, 'k', 80);
    k80[80] = 0;
    struct { const char *key, *value, *want; } cases[] = {
        {"", "v", "1 to 79"},
        {k80, "v", "1 to 79"},
        {" lead", "v", "spaces"},
        {"trail ", "v", "spaces"},
        {"dou  ble", "v", "spaces"},
        {"caf\xc3\xa9", "v", "printable ASCII"},
        {"tab\tkey", "v", "printable ASCII"},
        {"ok", "caf\xe9", "not valid UTF-8"},
        {"ok", "\xed\xa0\x80", "not valid UTF-8"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_status st = kiln_png_write(path, px, 1, 1, 1, 1, &cases[i].key, &cases[i].value);
        CHECK(st == KILN_ERR_ARG && strstr(kiln_last_error(), cases[i].want) && strstr(kiln_last_error(), path),
              "case %zu: %s %s", i, kiln_status_name(st), kiln_last_error());
    }
    const char *k = NULL, *v = "x";
    CHECK(kiln_png_write(path, px, 1, 1, 1, 1, &k, &v) == KILN_ERR_ARG, "NULL key");
    CHECK(kiln_png_write(path, px, 5, 1, 1, 0, NULL, NULL) == KILN_ERR_ARG, "5 channels");
    CHECK(kiln_png_write(path, px, 0, 1, 1, 0, NULL, NULL) == KILN_ERR_ARG, "0 channels");
    CHECK(kiln_png_write(path, px, 1, 0, 1, 0, NULL, NULL) == KILN_ERR_ARG, "height 0");
    CHECK(kiln_png_write(path, px, 1, 1, -1, 0, NULL, NULL) == KILN_ERR_ARG, "width -1");
    CHECK(kiln_png_write(path, NULL, 1, 1, 1, 0, NULL, NULL) == KILN_ERR_ARG, "NULL pixels");
    CHECK(kiln_png_write(path, px, 1, 1, 1, -1, NULL, NULL) == KILN_ERR_ARG, "n_text -1");

    /* a write failing half way (file size limit): old file intact, no temp file */
    struct rlimit old;
    getrlimit(RLIMIT_FSIZE, &old);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    int bw = 256, bh = 256;
    float *noise = malloc(sizeof(float) * 3 * (size_t)(bw * bh));
    uint32_t r = 12345;
    for (int i = 0; i < 3 * bw * bh; i++) {
        r = r * 1664525u + 1013904223u;
        noise[i] = (float)(r >> 24) / 255.0f;
    }
    struct rlimit lim = {4096, old.rlim_max};
    if (setrlimit(RLIMIT_FSIZE, &lim) == 0) {
        kiln_status st = kiln_png_write(path, noise, 3, bh, bw, 0, NULL, NULL);
        setrlimit(RLIMIT_FSIZE, &old);
        CHECK(st == KILN_ERR_IO && strstr(kiln_last_error(), path), "EFBIG: %s %s", kiln_status_name(st),
              kiln_last_error());
    }
    signal(SIGXFSZ, prev);
    free(noise);
    char missing[600];
    snprintf(missing, sizeof missing, "%s/no/such/dir/x.png", tmpdir);
    CHECK(kiln_png_write(missing, px, 1, 1, 1, 0, NULL, NULL) == KILN_ERR_IO && strstr(kiln_last_error(), missing),
          "missing folder: %s", kiln_last_error());

    size_t n1;
    unsigned char *after = read_file(path, &n1);
    CHECK(after && n1 == n0 && memcmp(before, after, n0) == 0, "existing file changed by failed writes");
    CHECK(count_tmp_files() == 0, "temporary file left behind");
    free(before);
    free(after);
}

/* Reads a golden file and checks its size; returns the pixels or NULL. */
static float *golden(const char *name, int want_c, int want_h, int want_w)
{
    char path[256];
    snprintf(path, sizeof path, GOLDEN "%s", name);
    float *px = NULL;
    int c, h, w;
    kiln_status st = kiln_png_read(path, &px, &c, &h, &w);
    CHECK(st == KILN_OK, "%s: %s", name, kiln_last_error());
    if (st) return NULL;
    CHECK(c == want_c && h == want_h && w == want_w, "%s: %d x %d x %d, want %d x %d x %d", name, c, h, w, want_c,
          want_h, want_w);
    if (c != want_c || h != want_h || w != want_w) { free(px); return NULL; }
    return px;
}

#define AT(px, c, y, x, h, w) (px)[((size_t)(c) * (h) + (y)) * (w) + (x)]

static void t_golden_8bit(void)
{
    static const struct { const char *name; int c; } files[] = {
        {"pil_l.png", 1}, {"pil_la.png", 2}, {"pil_rgb.png", 3}, {"pil_rgba.png", 4},
        {"hand_interlaced.png", 3}, {"pil_text.png", 3},
    };
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        float *px = golden(files[f].name, files[f].c, GH, GW);
        if (!px) continue;
        int bad = 0;
        for (int c = 0; c < files[f].c; c++)
            for (int y = 0; y < GH; y++)
                for (int x = 0; x < GW; x++) bad += AT(px, c, y, x, GH, GW) != (float)val8(x, y, c) / 255.0f;
        CHECK(bad == 0, "%s: %d values differ", files[f].name, bad);
        free(px);
    }
}

static void t_golden_palette(void)
{
    for (int trns = 0; trns <= 1; trns++) {
        int C = trns ? 4 : 3;
        float *px = golden(trns ? "pil_palette_trns.png" : "pil_palette.png", C, GH, GW);
        if (!px) continue;
        int bad = 0;
        for (int y = 0; y < GH; y++)
            for (int x = 0; x < GW; x++) {
                int i = (x + 2 * y) % 4;
                for (int c = 0; c < 3; c++) bad += AT(px, c, y, x, GH, GW) != (float)palette[i][c] / 255.0f;
                if (trns) bad += AT(px, 3, y, x, GH, GW) != (float)palette_alpha[i] / 255.0f;
            }
        CHECK(bad == 0, "palette (tRNS %d): %d values differ", trns, bad);
        free(px);
    }
    /* 2-bit gray expands to 8 bits: sample * 85 */
    float *px = golden("hand_gray2.png", 1, GH, GW);
    int bad = 0;
    for (int y = 0; px && y < GH; y++)
        for (int x = 0; x < GW; x++) bad += AT(px, 0, y, x, GH, GW) != (float)((x + y) % 4 * 85) / 255.0f;
    CHECK(bad == 0, "2-bit gray: %d values differ", bad);
    free(px);
    /* gray with a tRNS colour key gains an alpha channel */
    px = golden("hand_gray_trns.png", 2, GH, GW);
    bad = 0;
    for (int y = 0; px && y < GH; y++)
        for (int x = 0; x < GW; x++) {
            int v = val8(x, y, 0);
            bad += AT(px, 0, y, x, GH, GW) != (float)v / 255.0f;
            bad += AT(px, 1, y, x, GH, GW) != (v == val8(0, 0, 0) ? 0.0f : 1.0f);
        }
    CHECK(bad == 0, "gray + tRNS: %d values differ", bad);
    free(px);
}

static void t_golden_16bit(void)
{
    static const struct { const char *name; int c, h, w; } files[] = {
        {"pil_gray16.png", 1, GH, GW}, {"hand_gray_a16.png", 2, GH, GW}, {"hand_rgb16.png", 3, GH, GW},
        {"hand_rgba16.png", 4, GH, GW}, {"hand_interlaced16.png", 1, 10, 9},
    };
    for (size_t f = 0; f < sizeof files / sizeof files[0]; f++) {
        int C = files[f].c, H = files[f].h, W = files[f].w;
        float *px = golden(files[f].name, C, H, W);
        if (!px) continue;
        int bad = 0;
        for (int c = 0; c < C; c++)
            for (int y = 0; y < H; y++)
                for (int x = 0; x < W; x++) {
                    float want = (float)val16(x, y, c) / 65535.0f;
                    if (AT(px, c, y, x, H, W) != want && bad++ == 0)
                        CHECK(0, "%s: c%d y%d x%d = %.8f, want %.8f", files[f].name, c, y, x,
                              AT(px, c, y, x, H, W), want);
                }
        CHECK(bad == 0, "%s: %d values differ (16-bit values must be read as stored)", files[f].name, bad);
        free(px);
    }
}

/* Our choice for files tagged gAMA 1.0: the stored values, as PIL reads them. The
 * simplified libpng reader would convert them to sRGB (value 128 -> about 188);
 * this test pins both facts so a change of reader cannot change it silently. */
static void t_gamma1(void)
{
    float *px = golden("hand_gamma1.png", 1, GH, GW);
    int bad = 0;
    for (int y = 0; px && y < GH; y++)
        for (int x = 0; x < GW; x++) bad += AT(px, 0, y, x, GH, GW) != (float)val8(x, y, 0) / 255.0f;
    CHECK(bad == 0, "gAMA 1.0: %d values differ from the stored ones", bad);
    free(px);

    png_image img;
    memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_file(&img, GOLDEN "hand_gamma1.png")) {
        CHECK(0, "simplified reader: %s", img.message);
        return;
    }
    img.format = PNG_FORMAT_GRAY;
    unsigned char buf[GW * GH];
    int ok = png_image_finish_read(&img, NULL, buf, 0, NULL);
    CHECK(ok, "simplified reader: %s", img.message);
    int differ = 0;
    for (int i = 0; ok && i < GW * GH; i++) differ += buf[i] != val8(i % GW, i / GW, 0);
    CHECK(differ > GW * GH / 2, "the simplified reader no longer converts gAMA 1.0 (%d of %d differ)", differ, GW * GH);
    png_image_free(&img);
}

static void t_bad_files(void)
{
    float *px = (float *)&px;
    int c = 9, h = 9, w = 9;
    kiln_status st = kiln_png_read(tmp_path("missing.png"), &px, &c, &h, &w);
    CHECK(st == KILN_ERR_IO && strstr(kiln_last_error(), "missing.png") && px == NULL && c == 0, "missing: %s",
          kiln_last_error());
    const char *path = tmp_path("bad.png");
    write_file(path, "", 0);
    st = kiln_png_read(path, &px, &c, &h, &w);
    CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), "not a PNG") && strstr(kiln_last_error(), path), "empty: %s",
          kiln_last_error());
    write_file(path, "GIF89a garbage garbage", 22);
    st = kiln_png_read(path, &px, &c, &h, &w);
    CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), "not a PNG"), "garbage: %s", kiln_last_error());
    int m;
    char **k, **v;
    st = kiln_png_read_text(path, &m, &k, &v);
    CHECK(st == KILN_ERR_FORMAT && m == 0 && k == NULL, "garbage text: %s", kiln_last_error());
    st = kiln_png_read_text(tmp_path("missing.png"), &m, &k, &v);
    CHECK(st == KILN_ERR_IO, "missing text: %s", kiln_last_error());
    st = kiln_png_read(tmpdir, &px, &c, &h, &w);
    CHECK(st != KILN_OK && px == NULL, "folder: %s", kiln_last_error());

    /* every truncation of real files; a flipped byte in each chunk */
    const char *srcs[] = {GOLDEN "pil_text.png", GOLDEN "hand_interlaced16.png", GOLDEN "pil_palette_trns.png"};
    for (size_t s = 0; s < 3; s++) {
        size_t n;
        unsigned char *full = read_file(srcs[s], &n);
        CHECK(full != NULL, "%s missing", srcs[s]);
        if (!full) continue;
        int fails = 0;
        for (size_t len = 0; len < n; len++) {
            write_file(path, full, len);
            px = NULL;
            st = kiln_png_read(path, &px, &c, &h, &w);
            if (st != KILN_ERR_FORMAT || !strstr(kiln_last_error(), path)) fails++;
            free(px);
            st = kiln_png_read_text(path, &m, &k, &v);
            if (st != KILN_ERR_FORMAT) fails++;
            if (!st) kiln_png_free_text(m, k, v);
        }
        CHECK(fails == 0, "%s: %d truncations not reported as format errors", srcs[s], fails);
        int crashes = 0;
        for (size_t i = 8; i < n; i += 3) {
            unsigned char *mut = malloc(n);
            memcpy(mut, full, n);
            mut[i] ^= 0x5a;
            write_file(path, mut, n);
            free(mut);
            px = NULL;
            st = kiln_png_read(path, &px, &c, &h, &w);
            if (st != KILN_OK && st != KILN_ERR_FORMAT) crashes++;
            free(px);
            st = kiln_png_read_text(path, &m, &k, &v);
            if (st != KILN_OK && st != KILN_ERR_FORMAT) crashes++;
            if (!st) kiln_png_free_text(m, k, v);
        }
        CHECK(crashes == 0, "%s: %d corruptions gave an unexpected status", srcs[s], crashes);
        free(full);
    }
    /* a text chunk whose length field claims 1.5 GB: refused before libpng allocates it */
    size_t n;
    unsigned char *t = read_file(GOLDEN "pil_text.png", &n);
    if (t && n > 60 && memcmp(t + 60, "tEXt", 4) == 0) {
        t[56] ^= 0x5a;
        write_file(path, t, n);
        double t0 = now_ms();
        st = kiln_png_read_text(path, &m, &k, &v);
        CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), "claims 1509949451 bytes"), "huge chunk: %s",
              kiln_last_error());
        st = kiln_png_read(path, &px, &c, &h, &w);
        CHECK(st == KILN_ERR_FORMAT && now_ms() - t0 < 200, "huge chunk: %s (%.0f ms)", kiln_last_error(), now_ms() - t0);
    } else {
        CHECK(0, "pil_text.png layout changed: update this test");
    }
    free(t);
    write_file(path, "\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR", 16);
    st = kiln_png_read(path, &px, &c, &h, &w);
    CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), "truncated"), "header only: %s", kiln_last_error());
    CHECK(kiln_png_read(NULL, &px, &c, &h, &w) == KILN_ERR_ARG && kiln_png_read(path, NULL, &c, &h, &w) == KILN_ERR_ARG,
          "NULL arguments");
}

/* The image size IHDR declares is checked against the limit and against the
 * compressed bytes present before anything is allocated for it; a solid image,
 * which deflate shrinks about as far as it can, still reads. */
static void t_declared_size(void)
{
    const char *path = tmp_path("declared.png");
    int c = 1, h = 2048, w = 2048;
    float *px = calloc((size_t)h * (size_t)w, sizeof(float));
    kiln_status st = kiln_png_write(path, px, c, h, w, 0, NULL, NULL);
    CHECK(st == KILN_OK, "write: %s", kiln_last_error());
    free(px);
    px = NULL;
    st = kiln_png_read(path, &px, &c, &h, &w);
    CHECK(st == KILN_OK && c == 1 && h == 2048 && w == 2048, "solid 2048x2048: %s", kiln_last_error());
    free(px);
    size_t n;
    unsigned char *b = read_file(path, &n);
    if (!b || n < 33 || memcmp(b + 12, "IHDR", 4) != 0) {
        CHECK(0, "no IHDR where expected");
        free(b);
        return;
    }
    static const struct { unsigned w, h; const char *msg; } cases[] = {
        {16000, 16000, "compressed data cannot hold them"},
        {70000, 70000, "more than the 268435456 pixels"},
        {1u << 31, 1, "more than the 268435456 pixels"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int k = 0; k < 4; k++) {
            b[16 + k] = (unsigned char)(cases[i].w >> (24 - 8 * k));
            b[20 + k] = (unsigned char)(cases[i].h >> (24 - 8 * k));
        }
        write_file(path, b, n);
        double t0 = now_ms();
        px = NULL;
        st = kiln_png_read(path, &px, &c, &h, &w);
        CHECK(st == KILN_ERR_FORMAT && strstr(kiln_last_error(), cases[i].msg) && now_ms() - t0 < 200,
              "%ux%u: %s", cases[i].w, cases[i].h, kiln_last_error());
        free(px);
    }
    free(b);
}

/* kiln_png_encode gives the bytes kiln_png_write puts in the file, text chunks included */
static void t_encode_memory(void)
{
    int c = 3, h = 5, w = 7;
    float px[3 * 5 * 7];
    for (int i = 0; i < c * h * w; i++) px[i] = (float)i / (float)(c * h * w);
    const char *keys[] = {"parameters", "prompt"}, *vals[] = {"Steps: 4, Seed: 7", "a caf\xc3\xa9"};
    const char *path = tmp_path("encode.png");
    CHECK(kiln_png_write(path, px, c, h, w, 2, keys, vals) == KILN_OK, "%s", kiln_last_error());
    FILE *f = fopen(path, "rb");
    CHECK(f != NULL, "cannot open %s", path);
    if (!f) return;
    unsigned char file[4096];
    size_t flen = fread(file, 1, sizeof file, f);
    fclose(f);
    unsigned char *mem = NULL;
    size_t mlen = 0;
    CHECK(kiln_png_encode(px, c, h, w, 2, keys, vals, &mem, &mlen) == KILN_OK, "%s", kiln_last_error());
    CHECK(mlen == flen && mem && memcmp(mem, file, flen) == 0, "%zu bytes in memory, %zu in the file", mlen, flen);
    free(mem);
    /* the same checks as the file writer's, with no buffer left behind */
    mem = (unsigned char *)1;
    CHECK(kiln_png_encode(px, 5, h, w, 0, NULL, NULL, &mem, &mlen) == KILN_ERR_ARG && mem == NULL,
          "5 channels refused");
    CHECK(strstr(kiln_last_error(), "channels") != NULL, "%s", kiln_last_error());
}

static void t_speed(void)
{
    int c = 3, h = 512, w = 512;
    float *px = malloc(sizeof(float) * (size_t)(c * h * w));
    for (int i = 0; i < c * h * w; i++) px[i] = (float)((i % w) ^ (i / w % 256)) / 255.0f * 0.5f + 0.25f;
    const char *path = tmp_path("speed.png");
    double t0 = now_ms();
    kiln_status st = kiln_png_write(path, px, c, h, w, 0, NULL, NULL);
    double t1 = now_ms();
    float *back = NULL;
    int bc, bh, bw;
    st = st ? st : kiln_png_read(path, &back, &bc, &bh, &bw);
    double t2 = now_ms();
    CHECK(st == KILN_OK, "%s", kiln_last_error());
    printf("# 512x512 RGB: write %.1f ms, read %.1f ms\n", t1 - t0, t2 - t1);
    free(back);
    free(px);
}

int main(void)
{
    if (!test_tmpdir_make("png")) return 1;
    RUN(t_roundtrip);
    RUN(t_clamp_round);
    RUN(t_text);
    RUN(t_text_golden);
    RUN(t_text_errors);
    RUN(t_golden_8bit);
    RUN(t_golden_palette);
    RUN(t_golden_16bit);
    RUN(t_gamma1);
    RUN(t_bad_files);
    RUN(t_declared_size);
    RUN(t_encode_memory);
    RUN(t_speed);
    test_tmpdir_remove();
    return test_summary();
}

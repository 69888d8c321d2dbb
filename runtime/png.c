/* png.c - PNG files through libpng: reading to planar f32 [C, H, W] with the
 * sample values as stored, reading text chunks, and one 8-bit writer with tEXt/iTXt
 * chunks, into an atomic file or into memory. Every libpng call runs under a setjmp kept inside the function
 * that made it, so errors come back as kiln_status values. */
#define _POSIX_C_SOURCE 200809L
#include "atomic_file.h"
#include "png_io.h"
#include "unicode.h"

#include <errno.h>
#include <fcntl.h>
/* libpng is included through its versioned folder where there is one. */
#if defined(__has_include)
#if __has_include(<libpng16/png.h>)
#include <libpng16/png.h>
#else
#include <png.h>
#endif
#else
#include <libpng16/png.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Reading uses the classic API, not the simplified png_image_* one (the house style
 * prefers the latter where it fits): the simplified reader cannot return 16-bit
 * samples as stored (its 16-bit formats are linear light, gamma-decoded and with
 * premultiplied alpha), and it converts files tagged with an unusual gamma (gAMA
 * 1.0, as linear data such as depth maps is often written) to sRGB. kiln returns
 * the stored values, value / 255 or value / 65535, for every file, as PIL and
 * torchvision do, so an image feeds a model the same numbers here as in PyTorch
 * front ends. tests/test_png.c keeps the gAMA 1.0 case (and shows the simplified
 * reader's different answer). Palette and low bit depths expand to 8 bits, and a
 * tRNS chunk becomes an alpha channel, as with the simplified reader. */

/* Largest ancillary chunk (text, ICC profile) we let libpng allocate: a corrupt
 * length field would otherwise make it allocate and clear up to 2 GB. Text such
 * as an embedded workflow JSON is far smaller. */
#define PNG_CHUNK_MAX ((png_alloc_size_t)64 << 20)

typedef struct {
    char msg[256];
} png_err;

static void on_error(png_structp png, png_const_charp msg)
{
    png_err *e = png_get_error_ptr(png);
    if (e) snprintf(e->msg, sizeof e->msg, "%s", msg ? msg : "error");
    png_longjmp(png, 1);
}

static void on_warning(png_structp png, png_const_charp msg)
{
    (void)png;
    (void)msg; /* warnings (bad ancillary CRCs, odd chunks) do not stop a read */
}

/* The largest image kiln reads (width x height): 16384 x 16384, or any other shape
 * of as many pixels; its f32 planes are then at most 4 GiB. */
#define PNG_MAX_PIXELS ((uint64_t)1 << 28)
/* Deflate cannot shrink data more than about 1032 to 1 (a 258-byte match per two
 * bits); a little more is allowed for the zlib and chunk framing. */
#define PNG_MAX_INFLATE_RATIO 1100

/* The sizes IHDR declares, checked before anything is allocated for them: the image
 * must be at most PNG_MAX_PIXELS, and its raw rows must be something the IDAT bytes
 * present could inflate to, so a few hundred bytes cannot claim gigabytes. */
static kiln_status check_declared_size(const char *path, const unsigned char ihdr[13], uint64_t idat_bytes)
{
    uint64_t w = (uint64_t)ihdr[0] << 24 | (uint64_t)ihdr[1] << 16 | (uint64_t)ihdr[2] << 8 | ihdr[3];
    uint64_t h = (uint64_t)ihdr[4] << 24 | (uint64_t)ihdr[5] << 16 | (uint64_t)ihdr[6] << 8 | ihdr[7];
    int depth = ihdr[8], color = ihdr[9], interlace = ihdr[12];
    int channels = color == 0 ? 1 : color == 2 ? 3 : color == 3 ? 1 : color == 4 ? 2 : color == 6 ? 4 : 0;
    if (w == 0 || h == 0 || channels == 0 || depth == 0 || depth > 16)
        return kiln_error(KILN_ERR_FORMAT, "%s: corrupt PNG (IHDR declares %llux%llu, color type %d, %d bits)", path,
                          (unsigned long long)w, (unsigned long long)h, color, depth);
    if (w > PNG_MAX_PIXELS || h > PNG_MAX_PIXELS || w * h > PNG_MAX_PIXELS)
        return kiln_error(KILN_ERR_FORMAT, "%s: the image is %llux%llu, more than the %llu pixels kiln reads", path,
                          (unsigned long long)w, (unsigned long long)h, (unsigned long long)PNG_MAX_PIXELS);
    /* the filtered rows' bytes; interlacing only adds to them */
    uint64_t raw = (w * (uint64_t)channels * (uint64_t)depth + 7) / 8 * h + (interlace ? 0 : h);
    if (raw / PNG_MAX_INFLATE_RATIO > idat_bytes)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: truncated or corrupt PNG (a %llux%llu image needs %llu bytes of rows; %llu bytes of "
                          "compressed data cannot hold them)",
                          path, (unsigned long long)w, (unsigned long long)h, (unsigned long long)raw,
                          (unsigned long long)idat_bytes);
    return KILN_OK;
}

/* Walks the chunk list (lengths and names only) before libpng sees the file:
 * libpng allocates, and clears, an ancillary chunk's buffer from its length field
 * before reading it, so a corrupt length would cost up to 2 GB before the read
 * fails. Here every chunk must fit in the file, up to IEND, and the image size
 * IHDR declares must be plausible (check_declared_size). */
static kiln_status check_chunks(FILE *f, const char *path)
{
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0) return kiln_error(KILN_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return kiln_error(KILN_ERR_IO, "%s: not a regular file", path);
    uint64_t size = (uint64_t)sb.st_size, at = 8, idat_bytes = 0;
    unsigned char ihdr[13];
    int have_ihdr = 0;
    for (;;) {
        unsigned char hdr[8];
        if (at + 12 > size || fseeko(f, (off_t)at, SEEK_SET) != 0 || fread(hdr, 1, 8, f) != 8)
            return kiln_error(KILN_ERR_FORMAT, "%s: truncated PNG (ends at byte %llu before IEND)", path,
                              (unsigned long long)size);
        uint64_t len = (uint64_t)hdr[0] << 24 | (uint64_t)hdr[1] << 16 | (uint64_t)hdr[2] << 8 | hdr[3];
        for (int i = 4; i < 8; i++) {
            unsigned char ch = hdr[i];
            if (!((ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z')))
                return kiln_error(KILN_ERR_FORMAT, "%s: corrupt PNG (invalid chunk name at byte %llu)", path,
                                  (unsigned long long)at + 4);
        }
        if (len > 0x7fffffffu || at + 12 + len > size)
            return kiln_error(KILN_ERR_FORMAT,
                              "%s: truncated or corrupt PNG (chunk %.4s at byte %llu claims %llu bytes, the file has %llu)",
                              path, (const char *)hdr + 4, (unsigned long long)at, (unsigned long long)len,
                              (unsigned long long)size);
        if (at == 8) {
            if (memcmp(hdr + 4, "IHDR", 4) != 0 || len != 13 || fread(ihdr, 1, 13, f) != 13)
                return kiln_error(KILN_ERR_FORMAT, "%s: corrupt PNG (it does not start with a 13-byte IHDR)", path);
            have_ihdr = 1;
        }
        if (memcmp(hdr + 4, "IDAT", 4) == 0) idat_bytes += len;
        at += 12 + len;
        if (memcmp(hdr + 4, "IEND", 4) == 0) break;
    }
    if (have_ihdr) {
        kiln_status st = check_declared_size(path, ihdr, idat_bytes);
        if (st) return st;
    }
    if (fseeko(f, 8, SEEK_SET) != 0) return kiln_error(KILN_ERR_IO, "%s: cannot seek: %s", path, strerror(errno));
    return KILN_OK;
}

/* Opens path, checks the signature and the chunk list; *fp positioned after the signature. */
static kiln_status open_png(const char *path, FILE **fp)
{
    *fp = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return kiln_error(KILN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    unsigned char sig[8];
    size_t n = fread(sig, 1, 8, f);
    if (n < 8 || png_sig_cmp(sig, 0, 8) != 0) {
        int empty = n == 0;
        fclose(f);
        return kiln_error(KILN_ERR_FORMAT, "%s: not a PNG file%s", path, empty ? " (empty)" : "");
    }
    kiln_status st = check_chunks(f, path);
    if (st) {
        fclose(f);
        return st;
    }
    *fp = f;
    return KILN_OK;
}

kiln_status kiln_png_read(const char *path, float **out, int *c, int *h, int *w)
{
    if (!out || !c || !h || !w) return kiln_error(KILN_ERR_ARG, "kiln_png_read: NULL output argument");
    *out = NULL;
    *c = *h = *w = 0;
    if (!path) return kiln_error(KILN_ERR_ARG, "kiln_png_read: path is NULL");
    FILE *fp;
    kiln_status st = open_png(path, &fp);
    if (st) return st;
    png_err err = {{0}};
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &err, on_error, on_warning);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    if (!info) {
        png_destroy_read_struct(&png, NULL, NULL);
        fclose(fp);
        return kiln_error(KILN_ERR_OOM, "%s: out of memory creating the PNG reader", path);
    }
    /* assigned after setjmp and freed after a longjmp: volatile */
    unsigned char *volatile bytes = NULL;
    png_bytep *volatile rows = NULL;
    float *volatile pix = NULL;
    volatile int oom = 0;
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_read_struct(&png, &info, NULL);
        fclose(fp);
        free(bytes);
        free(rows);
        free(pix);
        if (oom) return kiln_error(KILN_ERR_OOM, "%s: out of memory for the image", path);
        return kiln_error(KILN_ERR_FORMAT, "%s: corrupt or truncated PNG (libpng: %s)", path, err.msg);
    }
    png_init_io(png, fp);
    png_set_sig_bytes(png, 8);
    png_set_chunk_malloc_max(png, PNG_CHUNK_MAX);
    /* pixels only: skip (not decompress) text, ICC and other metadata chunks */
    static const png_byte skip[] = "tEXt\0zTXt\0iTXt\0iCCP\0eXIf\0sPLT\0tIME\0pHYs\0";
    png_set_keep_unknown_chunks(png, PNG_HANDLE_CHUNK_NEVER, skip, (int)(sizeof skip / 5));
    png_read_info(png, info);
    png_set_expand(png); /* palette -> RGB, gray < 8 bits -> 8, tRNS -> alpha */
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    png_uint_32 W = png_get_image_width(png, info), H = png_get_image_height(png, info);
    int C = png_get_channels(png, info), depth = png_get_bit_depth(png, info);
    size_t rowbytes = png_get_rowbytes(png, info);
    if (C < 1 || C > 4 || (depth != 8 && depth != 16) || rowbytes != (size_t)W * (size_t)C * (size_t)(depth / 8)) {
        snprintf(err.msg, sizeof err.msg, "unexpected layout: %d channels of %d bits", C, depth);
        png_longjmp(png, 1);
    }
    size_t npix = (size_t)W * H; /* W, H <= 2^31 each (libpng limits): no overflow in 64 bits */
    bytes = malloc(rowbytes * H);
    rows = malloc(H * sizeof *rows);
    pix = malloc(npix * (size_t)C * sizeof(float));
    if (!bytes || !rows || !pix) {
        oom = 1;
        png_longjmp(png, 1);
    }
    for (png_uint_32 y = 0; y < H; y++) rows[y] = bytes + y * rowbytes;
    png_read_image(png, rows);
    png_read_end(png, NULL);

    if (depth == 8) {
        float lut[256];
        for (int i = 0; i < 256; i++) lut[i] = (float)i / 255.0f;
        for (int ch = 0; ch < C; ch++) {
            float *o = pix + (size_t)ch * npix;
            for (png_uint_32 y = 0; y < H; y++) {
                const unsigned char *r = rows[y] + ch;
                for (png_uint_32 x = 0; x < W; x++) o[(size_t)y * W + x] = lut[r[(size_t)x * C]];
            }
        }
    } else {
        for (int ch = 0; ch < C; ch++) {
            float *o = pix + (size_t)ch * npix;
            for (png_uint_32 y = 0; y < H; y++) {
                const unsigned char *r = rows[y] + 2 * ch;
                for (png_uint_32 x = 0; x < W; x++) {
                    const unsigned char *s = r + (size_t)x * 2 * C; /* big-endian in the file */
                    o[(size_t)y * W + x] = (float)((unsigned)s[0] << 8 | s[1]) / 65535.0f;
                }
            }
        }
    }
    png_destroy_read_struct(&png, &info, NULL);
    fclose(fp);
    free(bytes);
    free(rows);
    *out = pix;
    *c = C;
    *h = (int)H;
    *w = (int)W;
    return KILN_OK;
}

/* Latin-1 (tEXt/zTXt and every keyword) to UTF-8. */
static char *latin1_to_utf8(const char *s)
{
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) n += *p < 0x80 ? 1 : 2;
    char *o = malloc(n + 1), *q = o;
    if (!o) return NULL;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p < 0x80) *q++ = (char)*p;
        else { *q++ = (char)(0xc0 | (*p >> 6)); *q++ = (char)(0x80 | (*p & 0x3f)); }
    }
    *q = '\0';
    return o;
}

void kiln_png_free_text(int n, char **keys, char **values)
{
    for (int i = 0; i < n; i++) {
        if (keys) free(keys[i]);
        if (values) free(values[i]);
    }
    free(keys);
    free(values);
}

/* Appends the text chunks of one info struct; 0 when out of memory. */
static int collect_text(png_structp png, png_infop info, int *n, char **keys, char **values)
{
    png_textp text = NULL;
    int k = png_get_text(png, info, &text, NULL);
    for (int i = 0; i < k; i++) {
        int itxt = text[i].compression == PNG_ITXT_COMPRESSION_NONE || text[i].compression == PNG_ITXT_COMPRESSION_zTXt;
        const char *v = text[i].text ? text[i].text : "";
        keys[*n] = latin1_to_utf8(text[i].key);
        values[*n] = itxt ? strdup(v) : latin1_to_utf8(v);
        (*n)++;
        if (!keys[*n - 1] || !values[*n - 1]) return 0;
    }
    return 1;
}

kiln_status kiln_png_read_text(const char *path, int *n, char ***keys, char ***values)
{
    if (!n || !keys || !values) return kiln_error(KILN_ERR_ARG, "kiln_png_read_text: NULL output argument");
    *n = 0;
    *keys = *values = NULL;
    if (!path) return kiln_error(KILN_ERR_ARG, "kiln_png_read_text: path is NULL");
    FILE *fp;
    kiln_status st = open_png(path, &fp);
    if (st) return st;
    png_err err = {{0}};
    png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &err, on_error, on_warning);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    png_infop end = info ? png_create_info_struct(png) : NULL;
    if (!end) {
        png_destroy_read_struct(&png, &info, NULL);
        fclose(fp);
        return kiln_error(KILN_ERR_OOM, "%s: out of memory creating the PNG reader", path);
    }
    unsigned char *volatile row = NULL;
    char **volatile ks = NULL, **volatile vs = NULL;
    volatile int count = 0, oom = 0;
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_read_struct(&png, &info, &end);
        fclose(fp);
        free(row);
        kiln_png_free_text(count, ks, vs);
        if (oom) return kiln_error(KILN_ERR_OOM, "%s: out of memory reading text chunks", path);
        return kiln_error(KILN_ERR_FORMAT, "%s: corrupt or truncated PNG (libpng: %s)", path, err.msg);
    }
    png_init_io(png, fp);
    png_set_sig_bytes(png, 8);
    png_set_chunk_malloc_max(png, PNG_CHUNK_MAX);
    png_read_info(png, info);
    /* text may follow the image data, so the rows are decoded (into one row buffer)
     * to reach the end of the file */
    int passes = png_set_interlace_handling(png);
    png_read_update_info(png, info);
    png_uint_32 H = png_get_image_height(png, info);
    row = malloc(png_get_rowbytes(png, info));
    if (!row) { oom = 1; png_longjmp(png, 1); }
    for (int p = 0; p < passes; p++)
        for (png_uint_32 y = 0; y < H; y++) png_read_row(png, row, NULL);
    png_read_end(png, end);

    int total = png_get_text(png, info, NULL, NULL) + png_get_text(png, end, NULL, NULL);
    if (total > 0) {
        ks = calloc((size_t)total, sizeof *ks);
        vs = calloc((size_t)total, sizeof *vs);
        int k = 0;
        int ok = ks && vs && collect_text(png, info, &k, ks, vs);
        count = k;
        ok = ok && collect_text(png, end, &k, ks, vs);
        count = k;
        if (!ok) { oom = 1; png_longjmp(png, 1); }
    }
    png_destroy_read_struct(&png, &info, &end);
    fclose(fp);
    free(row);
    *n = count;
    *keys = ks;
    *values = vs;
    return KILN_OK;
}

/* ---- writing ---- */

/* PNG keywords: 1-79 printable Latin-1 characters without leading, trailing or
 * doubled spaces. Ours are UTF-8 strings, so only the ASCII subset is accepted (a
 * non-ASCII key would come back as different characters). */
static const char *key_problem(const char *k)
{
    size_t n = strlen(k);
    if (n < 1 || n > 79) return "must be 1 to 79 characters";
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)k[i];
        if (ch < 0x20 || ch > 0x7e) return "must be printable ASCII";
        if (ch == ' ' && (i == 0 || i == n - 1 || k[i + 1] == ' '))
            return "must not have leading, trailing or consecutive spaces";
    }
    return NULL;
}

/* tEXt holds Latin-1; plain printable ASCII (and newlines) reads back identically
 * everywhere, anything else goes to iTXt as UTF-8. */
static int is_plain_text(const char *v)
{
    for (const unsigned char *p = (const unsigned char *)v; *p; p++)
        if ((*p < 0x20 && *p != '\n') || *p > 0x7e) return 0;
    return 1;
}

/* libpng writes through these into the atomic file or a growing buffer; a failed write
 * stops libpng through png_error, and the writer reports the atomic file's message. */
typedef struct {
    kiln_atomic_file *file; /* NULL: into buf */
    unsigned char *buf;
    size_t len, cap;
    volatile int failed; /* set under libpng, read after its longjmp */
} png_sink;

static void sink_write(png_structp png, png_bytep data, size_t n)
{
    png_sink *s = png_get_io_ptr(png);
    if (s->file) {
        if (kiln_atomic_file_write(s->file, data, n)) {
            s->failed = 1;
            png_error(png, "write failed");
        }
        return;
    }
    if (s->len + n > s->cap) {
        size_t cap = s->cap ? s->cap : 4096;
        while (cap < s->len + n) cap *= 2;
        unsigned char *nb = realloc(s->buf, cap);
        if (!nb) {
            s->failed = 2;
            png_error(png, "out of memory");
        }
        s->buf = nb;
        s->cap = cap;
    }
    memcpy(s->buf + s->len, data, n);
    s->len += n;
}

static void sink_flush(png_structp png)
{
    (void)png; /* commit fsyncs once at the end */
}

/* The checks every writer makes; what names the destination in messages. */
static kiln_status check_image(const char *what, const float *pixels, int c, int h, int w, int n_text,
                               const char *const *keys, const char *const *values)
{
    if (!pixels) return kiln_error(KILN_ERR_ARG, "%s: pixels are NULL", what);
    if (c < 1 || c > 4) return kiln_error(KILN_ERR_ARG, "%s: %d channels (PNG takes 1 to 4)", what, c);
    if (h < 1 || w < 1 || (size_t)w * (size_t)c > ((size_t)1 << 30))
        return kiln_error(KILN_ERR_ARG, "%s: invalid image size %dx%d", what, w, h);
    if (n_text < 0 || (n_text > 0 && (!keys || !values)))
        return kiln_error(KILN_ERR_ARG, "%s: invalid text list (n_text = %d)", what, n_text);
    for (int i = 0; i < n_text; i++) {
        if (!keys[i] || !values[i]) return kiln_error(KILN_ERR_ARG, "%s: text entry %d is NULL", what, i);
        const char *why = key_problem(keys[i]);
        if (why) return kiln_error(KILN_ERR_ARG, "%s: text key '%s' %s", what, keys[i], why);
        if (!kiln_unicode_utf8_valid(values[i]))
            return kiln_error(KILN_ERR_ARG, "%s: text value of '%s' is not valid UTF-8", what, keys[i]);
    }
    return KILN_OK;
}

/* The one classic-API writer (it keeps setjmp inside): the checked image into sink. */
static kiln_status encode(const char *what, png_sink *sink, const float *pixels, int c, int h, int w, int n_text,
                          const char *const *keys, const char *const *values)
{
    png_err err = {{0}};
    png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &err, on_error, on_warning);
    png_infop info = png ? png_create_info_struct(png) : NULL;
    unsigned char *row = malloc((size_t)w * (size_t)c);
    png_text *text = calloc((size_t)n_text + 1, sizeof *text);
    if (!info || !row || !text) {
        png_destroy_write_struct(&png, &info);
        free(row);
        free(text);
        return kiln_error(KILN_ERR_OOM, "%s: out of memory creating the PNG writer", what);
    }
    /* nothing below is assigned after setjmp, so nothing needs volatile */
    if (setjmp(png_jmpbuf(png))) {
        png_destroy_write_struct(&png, &info);
        free(row);
        free(text);
        /* a failed file write already left its own message (with errno's reason) */
        if (sink->failed == 1) return KILN_ERR_IO;
        if (sink->failed == 2) return kiln_error(KILN_ERR_OOM, "%s: out of memory encoding the PNG", what);
        return kiln_error(KILN_ERR_IO, "%s: cannot write PNG (libpng: %s)", what, err.msg);
    }
    static const int color_types[5] = {0, PNG_COLOR_TYPE_GRAY, PNG_COLOR_TYPE_GRAY_ALPHA, PNG_COLOR_TYPE_RGB,
                                       PNG_COLOR_TYPE_RGB_ALPHA};
    png_set_write_fn(png, sink, sink_write, sink_flush);
    png_set_IHDR(png, info, (png_uint_32)w, (png_uint_32)h, 8, color_types[c], PNG_INTERLACE_NONE,
                 PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    for (int i = 0; i < n_text; i++) {
        /* libpng copies the strings; it does not write through these pointers */
        text[i].key = (png_charp)(uintptr_t)keys[i];
        text[i].text = (png_charp)(uintptr_t)values[i];
        text[i].compression = is_plain_text(values[i]) ? PNG_TEXT_COMPRESSION_NONE : PNG_ITXT_COMPRESSION_NONE;
    }
    if (n_text > 0) png_set_text(png, info, text, n_text);
    png_write_info(png, info);
    size_t plane = (size_t)h * (size_t)w;
    for (int y = 0; y < h; y++) {
        for (int ch = 0; ch < c; ch++) {
            const float *src = pixels + (size_t)ch * plane + (size_t)y * w;
            for (int x = 0; x < w; x++) {
                float v = src[x];
                v = v > 0.0f ? (v < 1.0f ? v : 1.0f) : 0.0f; /* NaN -> 0 */
                row[(size_t)x * c + ch] = (unsigned char)(v * 255.0f + 0.5f);
            }
        }
        png_write_row(png, row);
    }
    png_write_end(png, NULL);
    png_destroy_write_struct(&png, &info);
    free(row);
    free(text);
    return KILN_OK;
}

kiln_status kiln_png_write(const char *path, const float *pixels, int c, int h, int w, int n_text,
                           const char *const *keys, const char *const *values)
{
    if (!path) return kiln_error(KILN_ERR_ARG, "kiln_png_write: path is NULL");
    kiln_status st = check_image(path, pixels, c, h, w, n_text, keys, values);
    if (st) return st;
    kiln_atomic_file out = {0};
    if ((st = kiln_atomic_file_open_output(&out, path))) return st;
    png_sink sink = {&out, NULL, 0, 0, 0};
    if ((st = encode(path, &sink, pixels, c, h, w, n_text, keys, values))) {
        kiln_atomic_file_abort(&out);
        return st;
    }
    return kiln_atomic_file_commit(&out);
}

kiln_status kiln_png_encode(const float *pixels, int c, int h, int w, int n_text, const char *const *keys,
                            const char *const *values, unsigned char **out, size_t *len)
{
    if (!out || !len) return kiln_error(KILN_ERR_ARG, "kiln_png_encode: out or len is NULL");
    *out = NULL;
    *len = 0;
    kiln_status st = check_image("PNG", pixels, c, h, w, n_text, keys, values);
    if (st) return st;
    png_sink sink = {NULL, NULL, 0, 0, 0};
    if ((st = encode("PNG", &sink, pixels, c, h, w, n_text, keys, values))) {
        free(sink.buf);
        return st;
    }
    *out = sink.buf;
    *len = sink.len;
    return KILN_OK;
}

/* mem_plot.c - draws the memory picture and writes the stage table.
 * The picture is an RGB canvas filled column by column: each column shows the owner
 * row of the frame with the highest total among those it covers (or the state
 * carried in from the left), so a peak narrower than a pixel still shows. Text uses
 * the 5x8 bitmap font below (rows top down, bit 4 the leftmost column; row 7 takes
 * descenders), drawn at whole-pixel scales. */
#define _GNU_SOURCE
#include "mem_plot.h"
#include "format_bytes.h"
#include "png_io.h"
#include "unicode.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GLYPH_W 5
#define GLYPH_H 8
#define ADVANCE 6    /* glyph and one blank column */

/* printable ASCII, ' ' to '~' */
static const unsigned char font[95][GLYPH_H] = {
    {0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x00}, /* ' ' */
    {0x04,0x04,0x04,0x04,0x04,0x00,0x04,0x00}, /* '!' */
    {0x0a,0x0a,0x00,0x00,0x00,0x00,0x00,0x00}, /* '"' */
    {0x0a,0x0a,0x1f,0x0a,0x1f,0x0a,0x0a,0x00}, /* '#' */
    {0x04,0x0f,0x14,0x0e,0x05,0x1e,0x04,0x00}, /* '$' */
    {0x18,0x19,0x02,0x04,0x08,0x13,0x03,0x00}, /* '%' */
    {0x0c,0x12,0x14,0x08,0x15,0x12,0x0d,0x00}, /* '&' */
    {0x04,0x04,0x00,0x00,0x00,0x00,0x00,0x00}, /* '\'' */
    {0x02,0x04,0x08,0x08,0x08,0x04,0x02,0x00}, /* '(' */
    {0x08,0x04,0x02,0x02,0x02,0x04,0x08,0x00}, /* ')' */
    {0x00,0x04,0x15,0x0e,0x15,0x04,0x00,0x00}, /* '*' */
    {0x00,0x04,0x04,0x1f,0x04,0x04,0x00,0x00}, /* '+' */
    {0x00,0x00,0x00,0x00,0x00,0x04,0x04,0x08}, /* ',' */
    {0x00,0x00,0x00,0x1f,0x00,0x00,0x00,0x00}, /* '-' */
    {0x00,0x00,0x00,0x00,0x00,0x00,0x04,0x00}, /* '.' */
    {0x01,0x02,0x02,0x04,0x08,0x08,0x10,0x00}, /* '/' */
    {0x0e,0x11,0x13,0x15,0x19,0x11,0x0e,0x00}, /* '0' */
    {0x04,0x0c,0x04,0x04,0x04,0x04,0x0e,0x00}, /* '1' */
    {0x0e,0x11,0x01,0x02,0x04,0x08,0x1f,0x00}, /* '2' */
    {0x1f,0x02,0x04,0x02,0x01,0x11,0x0e,0x00}, /* '3' */
    {0x02,0x06,0x0a,0x12,0x1f,0x02,0x02,0x00}, /* '4' */
    {0x1f,0x10,0x1e,0x01,0x01,0x11,0x0e,0x00}, /* '5' */
    {0x06,0x08,0x10,0x1e,0x11,0x11,0x0e,0x00}, /* '6' */
    {0x1f,0x01,0x02,0x04,0x08,0x08,0x08,0x00}, /* '7' */
    {0x0e,0x11,0x11,0x0e,0x11,0x11,0x0e,0x00}, /* '8' */
    {0x0e,0x11,0x11,0x0f,0x01,0x02,0x0c,0x00}, /* '9' */
    {0x00,0x04,0x04,0x00,0x04,0x04,0x00,0x00}, /* ':' */
    {0x00,0x04,0x04,0x00,0x04,0x04,0x08,0x00}, /* ';' */
    {0x02,0x04,0x08,0x10,0x08,0x04,0x02,0x00}, /* '<' */
    {0x00,0x00,0x1f,0x00,0x1f,0x00,0x00,0x00}, /* '=' */
    {0x08,0x04,0x02,0x01,0x02,0x04,0x08,0x00}, /* '>' */
    {0x0e,0x11,0x01,0x02,0x04,0x00,0x04,0x00}, /* '?' */
    {0x0e,0x11,0x17,0x15,0x17,0x10,0x0e,0x00}, /* '@' */
    {0x0e,0x11,0x11,0x1f,0x11,0x11,0x11,0x00}, /* 'A' */
    {0x1e,0x11,0x11,0x1e,0x11,0x11,0x1e,0x00}, /* 'B' */
    {0x0e,0x11,0x10,0x10,0x10,0x11,0x0e,0x00}, /* 'C' */
    {0x1c,0x12,0x11,0x11,0x11,0x12,0x1c,0x00}, /* 'D' */
    {0x1f,0x10,0x10,0x1e,0x10,0x10,0x1f,0x00}, /* 'E' */
    {0x1f,0x10,0x10,0x1e,0x10,0x10,0x10,0x00}, /* 'F' */
    {0x0e,0x11,0x10,0x17,0x11,0x11,0x0f,0x00}, /* 'G' */
    {0x11,0x11,0x11,0x1f,0x11,0x11,0x11,0x00}, /* 'H' */
    {0x0e,0x04,0x04,0x04,0x04,0x04,0x0e,0x00}, /* 'I' */
    {0x07,0x02,0x02,0x02,0x02,0x12,0x0c,0x00}, /* 'J' */
    {0x11,0x12,0x14,0x18,0x14,0x12,0x11,0x00}, /* 'K' */
    {0x10,0x10,0x10,0x10,0x10,0x10,0x1f,0x00}, /* 'L' */
    {0x11,0x1b,0x15,0x15,0x11,0x11,0x11,0x00}, /* 'M' */
    {0x11,0x11,0x19,0x15,0x13,0x11,0x11,0x00}, /* 'N' */
    {0x0e,0x11,0x11,0x11,0x11,0x11,0x0e,0x00}, /* 'O' */
    {0x1e,0x11,0x11,0x1e,0x10,0x10,0x10,0x00}, /* 'P' */
    {0x0e,0x11,0x11,0x11,0x15,0x12,0x0d,0x00}, /* 'Q' */
    {0x1e,0x11,0x11,0x1e,0x14,0x12,0x11,0x00}, /* 'R' */
    {0x0f,0x10,0x10,0x0e,0x01,0x01,0x1e,0x00}, /* 'S' */
    {0x1f,0x04,0x04,0x04,0x04,0x04,0x04,0x00}, /* 'T' */
    {0x11,0x11,0x11,0x11,0x11,0x11,0x0e,0x00}, /* 'U' */
    {0x11,0x11,0x11,0x11,0x11,0x0a,0x04,0x00}, /* 'V' */
    {0x11,0x11,0x11,0x15,0x15,0x15,0x0a,0x00}, /* 'W' */
    {0x11,0x11,0x0a,0x04,0x0a,0x11,0x11,0x00}, /* 'X' */
    {0x11,0x11,0x0a,0x04,0x04,0x04,0x04,0x00}, /* 'Y' */
    {0x1f,0x01,0x02,0x04,0x08,0x10,0x1f,0x00}, /* 'Z' */
    {0x0e,0x08,0x08,0x08,0x08,0x08,0x0e,0x00}, /* '[' */
    {0x10,0x08,0x08,0x04,0x02,0x02,0x01,0x00}, /* '\\' */
    {0x0e,0x02,0x02,0x02,0x02,0x02,0x0e,0x00}, /* ']' */
    {0x04,0x0a,0x11,0x00,0x00,0x00,0x00,0x00}, /* '^' */
    {0x00,0x00,0x00,0x00,0x00,0x00,0x00,0x1f}, /* '_' */
    {0x08,0x04,0x00,0x00,0x00,0x00,0x00,0x00}, /* '`' */
    {0x00,0x00,0x0e,0x01,0x0f,0x11,0x0f,0x00}, /* 'a' */
    {0x10,0x10,0x16,0x19,0x11,0x11,0x1e,0x00}, /* 'b' */
    {0x00,0x00,0x0e,0x10,0x10,0x11,0x0e,0x00}, /* 'c' */
    {0x01,0x01,0x0d,0x13,0x11,0x11,0x0f,0x00}, /* 'd' */
    {0x00,0x00,0x0e,0x11,0x1f,0x10,0x0e,0x00}, /* 'e' */
    {0x06,0x09,0x08,0x1c,0x08,0x08,0x08,0x00}, /* 'f' */
    {0x00,0x00,0x0f,0x11,0x11,0x0f,0x01,0x0e}, /* 'g' */
    {0x10,0x10,0x16,0x19,0x11,0x11,0x11,0x00}, /* 'h' */
    {0x04,0x00,0x0c,0x04,0x04,0x04,0x0e,0x00}, /* 'i' */
    {0x02,0x00,0x06,0x02,0x02,0x02,0x12,0x0c}, /* 'j' */
    {0x10,0x10,0x12,0x14,0x18,0x14,0x12,0x00}, /* 'k' */
    {0x0c,0x04,0x04,0x04,0x04,0x04,0x0e,0x00}, /* 'l' */
    {0x00,0x00,0x1a,0x15,0x15,0x11,0x11,0x00}, /* 'm' */
    {0x00,0x00,0x16,0x19,0x11,0x11,0x11,0x00}, /* 'n' */
    {0x00,0x00,0x0e,0x11,0x11,0x11,0x0e,0x00}, /* 'o' */
    {0x00,0x00,0x1e,0x11,0x11,0x1e,0x10,0x10}, /* 'p' */
    {0x00,0x00,0x0f,0x11,0x11,0x0f,0x01,0x01}, /* 'q' */
    {0x00,0x00,0x16,0x19,0x10,0x10,0x10,0x00}, /* 'r' */
    {0x00,0x00,0x0f,0x10,0x0e,0x01,0x1e,0x00}, /* 's' */
    {0x08,0x08,0x1c,0x08,0x08,0x09,0x06,0x00}, /* 't' */
    {0x00,0x00,0x11,0x11,0x11,0x13,0x0d,0x00}, /* 'u' */
    {0x00,0x00,0x11,0x11,0x11,0x0a,0x04,0x00}, /* 'v' */
    {0x00,0x00,0x11,0x11,0x15,0x15,0x0a,0x00}, /* 'w' */
    {0x00,0x00,0x11,0x0a,0x04,0x0a,0x11,0x00}, /* 'x' */
    {0x00,0x00,0x11,0x11,0x11,0x0f,0x01,0x0e}, /* 'y' */
    {0x00,0x00,0x1f,0x02,0x04,0x08,0x1f,0x00}, /* 'z' */
    {0x02,0x04,0x04,0x08,0x04,0x04,0x02,0x00}, /* '{' */
    {0x04,0x04,0x04,0x04,0x04,0x04,0x04,0x00}, /* '|' */
    {0x08,0x04,0x04,0x02,0x04,0x04,0x08,0x00}, /* '}' */
    {0x00,0x00,0x08,0x15,0x02,0x00,0x00,0x00}, /* '~' */
};

typedef unsigned char rgb[3];

static const rgb BLACK = {0, 0, 0}, AXIS = {60, 60, 60}, GRID = {225, 225, 225},
                 SEP = {90, 90, 90}, BAND_A = {232, 236, 242}, BAND_B = {214, 221, 232}, FAIL = {200, 30, 30},
                 BUDGET = {225, 40, 40}, MUTED = {110, 110, 110};

/* Owner colours by kind: models blues and greens, LoRAs pinks, the rest warm. */
static const rgb MODEL_COLORS[] = {{78, 121, 167}, {89, 161, 79}, {176, 122, 161}, {118, 183, 178},
                                   {140, 140, 60}, {52, 84, 140}, {150, 200, 120}, {120, 80, 170}};
static const rgb LORA_COLORS[] = {{255, 157, 167}, {214, 97, 160}, {240, 180, 220}};
static const rgb NAMED_COLORS[] = {{100, 200, 220}, {190, 170, 90}, {160, 200, 200}, {200, 150, 120}};
static const rgb TENSOR_COLOR = {242, 142, 43}, SCRATCH_COLOR = {237, 201, 72},
                 WORKSPACE_COLOR = {140, 100, 60}, OTHER_COLOR = {186, 176, 172};

typedef struct {
    unsigned char *px;
    int w, h;
} canvas;

static void put(canvas *c, int x, int y, const unsigned char *col)
{
    if (x < 0 || y < 0 || x >= c->w || y >= c->h) return;
    unsigned char *p = c->px + ((size_t)y * (size_t)c->w + (size_t)x) * 3;
    p[0] = col[0];
    p[1] = col[1];
    p[2] = col[2];
}

static void fill(canvas *c, int x0, int y0, int x1, int y1, const unsigned char *col)
{
    for (int y = y0; y < y1; y++)
        for (int x = x0; x < x1; x++) put(c, x, y, col);
}

static int text_width(const char *s, int scale)
{
    int n = (int)strlen(s);
    return n ? (n * ADVANCE - 1) * scale : 0;
}

/* Draws s with its top-left at (x, y); characters that would pass max_x are left
 * out (max_x < 0: no limit). Returns the x after the last character drawn. */
static int draw_text(canvas *c, int x, int y, const char *s, int scale, const unsigned char *col, int max_x)
{
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (max_x >= 0 && x + GLYPH_W * scale > max_x) break;
        int ch = *p >= 32 && *p < 127 ? *p - 32 : '?' - 32;
        for (int r = 0; r < GLYPH_H; r++)
            for (int k = 0; k < GLYPH_W; k++)
                if (font[ch][r] & (0x10 >> k)) fill(c, x + k * scale, y + r * scale, x + (k + 1) * scale, y + (r + 1) * scale, col);
        x += ADVANCE * scale;
    }
    return x;
}

/* ---- scales ---- */

/* A step of 1, 2 or 5 times a power of ten near span / n. */
static double nice_step(double span, int n)
{
    double raw = span / n;
    if (!(raw > 0)) return 1;
    double p = pow(10, floor(log10(raw)));
    double m = raw / p;
    return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

static void format_mib(char *buf, size_t cap, double bytes, double step)
{
    double mib = bytes / 1048576.0;
    if (step >= 1024.0 * 1048576.0) snprintf(buf, cap, "%g GiB", mib / 1024.0);
    else snprintf(buf, cap, "%g MiB", fabs(mib) < 1e-9 ? 0.0 : mib);
}

static int owner_kind(const char *name)
{
    if (strncmp(name, "model:", 6) == 0) return 0;
    if (strncmp(name, "lora:", 5) == 0) return 1;
    if (strcmp(name, "tensor") == 0) return 3;
    if (strcmp(name, "scratch") == 0) return 4;
    if (strcmp(name, "workspace") == 0) return 5;
    if (strcmp(name, "other") == 0) return 6;
    return 2;
}

/* Stacking order (models at the bottom, short-lived bytes on top) and colours. */
static void assign_owners(const kiln_mem_timeline *tl, kiln_mem_plot_layout *lay)
{
    int used[KILN_TIMELINE_OWNERS] = {0};
    for (int f = 0; f < tl->n_frames; f++)
        for (int i = 0; i < tl->n_owners; i++)
            if (tl->frames[f].at_peak[i] || tl->frames[f].at_end[i]) used[i] = 1;
    for (int i = 0; i < tl->n_owners; i++)
        if (tl->now[i] || tl->most[i]) used[i] = 1;
    int n_model = 0, n_lora = 0, n_named = 0;
    lay->n_order = 0;
    for (int kind = 0; kind <= 6; kind++)
        for (int i = 0; i < tl->n_owners; i++) {
            if (owner_kind(tl->owners[i]) != kind) continue;
            const unsigned char *col = kind == 0 ? MODEL_COLORS[n_model++ % 8]
                                     : kind == 1 ? LORA_COLORS[n_lora++ % 3]
                                     : kind == 2 ? NAMED_COLORS[n_named++ % 4]
                                     : kind == 3 ? TENSOR_COLOR : kind == 4 ? SCRATCH_COLOR
                                     : kind == 5 ? WORKSPACE_COLOR : OTHER_COLOR;
            memcpy(lay->color[i], col, 3);
            if (used[i]) lay->order[lay->n_order++] = i;
        }
}

/* The frame with the highest peak (NULL without frames). */
static const kiln_timeline_frame *peak_frame(const kiln_mem_timeline *tl)
{
    const kiln_timeline_frame *best = NULL;
    for (int f = 0; f < tl->n_frames; f++)
        if (!best || tl->frames[f].peak > best->peak) best = &tl->frames[f];
    return best;
}

/* The outermost stage open at t (the one the band shows on its first row), or NULL. */
static const kiln_timeline_span *stage_at(const kiln_mem_timeline *tl, double t)
{
    const kiln_timeline_span *best = NULL;
    for (int i = 0; i < tl->n_spans; i++) {
        const kiln_timeline_span *s = &tl->spans[i];
        double e = s->t1 < 0 ? tl->end : s->t1;
        if (t >= s->t0 && t <= e && (!best || s->depth < best->depth)) best = s;
    }
    return best;
}

/* ---- text buffer ---- */

typedef struct {
    char *s;
    size_t n, cap;
    int failed;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) KILN_PRINTF(2, 3);
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    if (b->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) { b->failed = 1; return; }
        if (b->s && b->n + (size_t)k < b->cap) { b->n += (size_t)k; return; }
        size_t cap = (b->cap ? b->cap * 2 : 1024) + (size_t)k;
        char *s = realloc(b->s, cap);
        if (!s) { b->failed = 1; return; }
        b->s = s;
        b->cap = cap;
    }
}

/* ---- the table ---- */

/* Past this many stages, only the top two levels are listed. */
#define TABLE_ALL_STAGES 120

char *kiln_mem_plot_table(const kiln_mem_timeline *tl)
{
    sbuf b = {0};
    char pk[32], bu[32], nw[32];
    kiln_format_bytes(pk, sizeof pk, (double)tl->peak);
    kiln_format_bytes(nw, sizeof nw, (double)tl->total);
    if (tl->budget) kiln_format_bytes(bu, sizeof bu, (double)tl->budget);
    else snprintf(bu, sizeof bu, "unlimited");
    const kiln_timeline_span *in = tl->peak ? stage_at(tl, tl->peak_time) : NULL;
    sb_printf(&b, "memory on %s: peak %s at %.3f s%s%s%s, %s held at the end, budget %s\n", tl->device, pk,
              tl->peak_time - tl->start, in ? " in \"" : "", in ? in->name : "", in ? "\"" : "", nw, bu);
    int all = tl->n_spans <= TABLE_ALL_STAGES;
    sb_printf(&b, "%-36s %9s %9s %11s  %s\n", "stage", "start", "time", "peak", "held most by");
    int shown = 0;
    for (int i = 0; i < tl->n_spans; i++) {
        const kiln_timeline_span *s = &tl->spans[i];
        if (!all && s->depth > 1) continue;
        char name[160], start[16], dur[16], peak[32], top[96];
        int ind = s->depth > 8 ? 16 : 2 * s->depth;
        snprintf(name, sizeof name, "%*s%s%s", ind, "", s->name, s->failed ? " (error)" : "");
        snprintf(start, sizeof start, "%.3f s", s->t0 - tl->start);
        if (s->t1 < 0) snprintf(dur, sizeof dur, "open");
        else snprintf(dur, sizeof dur, "%.3f s", s->t1 - s->t0);
        kiln_format_bytes(peak, sizeof peak, (double)s->peak);
        if (s->top_owner >= 0 && s->top_owner < tl->n_owners) {
            char tb[32];
            kiln_format_bytes(tb, sizeof tb, (double)s->top_bytes);
            snprintf(top, sizeof top, "%s %s", tl->owners[s->top_owner], tb);
        } else {
            snprintf(top, sizeof top, "-");
        }
        sb_printf(&b, "%-36s %9s %9s %11s  %s\n", name, start, dur, peak, top);
        shown++;
    }
    if (tl->n_spans == 0) sb_printf(&b, "(no stages: kiln.trace.span names them)\n");
    if (shown < tl->n_spans) sb_printf(&b, "(%d nested stages not listed)\n", tl->n_spans - shown);
    if (tl->spans_dropped) sb_printf(&b, "(%llu stages not kept)\n", (unsigned long long)tl->spans_dropped);
    if (b.failed) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

/* ---- the picture ---- */

#define LEGEND_W 232   /* at most: narrow pictures give the legend a third */
#define LEFT_W 72
#define BOTTOM_H 30
#define BAND_ROW 12

kiln_status kiln_mem_plot_write(const kiln_mem_timeline *tl, const char *path,
                                const kiln_mem_plot_options *opts, kiln_mem_plot_layout *layout)
{
    if (!tl || !path) return kiln_error(KILN_ERR_ARG, "memory plot: timeline and path are required");
    int W = opts && opts->width ? opts->width : 960;
    int H = opts && opts->height ? opts->height : 540;
    if (W < 480 || H < 240 || W > 8192 || H > 8192)
        return kiln_error(KILN_ERR_ARG, "memory plot: size %dx%d (from 480x240 to 8192x8192)", W, H);
    kiln_mem_plot_layout lay_local, *lay = layout ? layout : &lay_local;
    memset(lay, 0, sizeof *lay);
    lay->width = W;
    lay->height = H;
    lay->n_owners = tl->n_owners;
    memcpy(lay->budget_color, BUDGET, 3);
    assign_owners(tl, lay);

    canvas c = {malloc((size_t)W * (size_t)H * 3), W, H};
    float *planar = malloc((size_t)W * (size_t)H * 3 * sizeof *planar);
    if (!c.px || !planar) {
        free(c.px);
        free(planar);
        return kiln_error(KILN_ERR_OOM, "memory plot: out of host memory for a %dx%d picture", W, H);
    }
    memset(c.px, 255, (size_t)W * (size_t)H * 3);

    /* ---- scales ---- */
    /* large pictures draw text and margins at twice the size, to stay readable when
     * shown scaled down */
    int u = W >= 1600 && H >= 800 ? 2 : 1;
    int legend_w = W * 3 / 10 < LEGEND_W * u ? W * 3 / 10 : LEGEND_W * u;
    int x0 = LEFT_W * u, x1 = W - legend_w, band0 = 40 * u, row = BAND_ROW * u;
    int y0 = band0 + 2 * row + 6 * u, y1 = H - BOTTOM_H * u;
    double t0 = tl->start, t1 = tl->end;
    if (tl->n_frames && tl->frames[0].t0 < t0) t0 = tl->frames[0].t0;
    for (int i = 0; i < tl->n_spans; i++)
        if (tl->spans[i].t0 < t0) t0 = tl->spans[i].t0;
    if (!(t1 > t0)) t1 = t0 + 1e-3;
    double peak = (double)tl->peak;
    for (int f = 0; f < tl->n_frames; f++)
        if ((double)tl->frames[f].peak > peak) peak = (double)tl->frames[f].peak;
    /* a budget sets the scale only when it is near the peak: a run far below an 8 GiB
     * budget would otherwise be a thin line. Each stretch of the budget line is drawn
     * when it fits the scale (a script that sets its budget after the default one
     * gets the line from then on). */
    uint64_t budget_top = 0;
    for (int f = 0; f <= tl->n_frames; f++) {
        uint64_t b = f < tl->n_frames ? tl->frames[f].budget : tl->budget;
        if (b && (double)b <= 2.0 * peak && b > budget_top) budget_top = b;
    }
    double ymax = peak * 1.12;
    if ((double)budget_top * 1.06 > ymax) ymax = (double)budget_top * 1.06;
    if (!(ymax > 0)) ymax = 1048576.0;
    int budget_shown = 0;
    lay->x0 = x0; lay->x1 = x1; lay->y0 = y0; lay->y1 = y1;
    lay->t0 = t0; lay->t1 = t1; lay->ymax = ymax;
    int ph = y1 - y0, pw = x1 - x0;
#define Y_OF(bytes) (y1 - (int)lround((double)(bytes) / ymax * ph))
#define X_OF(t) (x0 + (int)lround(((t) - t0) / (t1 - t0) * pw))

    /* grid and y ticks */
    double ystep = nice_step(ymax / 1048576.0, (y1 - y0) / (60 * u) > 2 ? (y1 - y0) / (60 * u) : 2) * 1048576.0;
    char lab[64];
    for (double v = 0; v <= ymax; v += ystep) {
        int y = Y_OF(v);
        if (v > 0) fill(&c, x0, y, x1, y + 1, GRID);
        fill(&c, x0 - 4 * u, y, x0, y + 1, AXIS);
        format_mib(lab, sizeof lab, v, ystep);
        draw_text(&c, x0 - 7 * u - text_width(lab, u), y - 3 * u, lab, u, AXIS, -1);
    }

    /* ---- the stacked areas, one column at a time ---- */
    int j = 0;
    int prev_by = -1;
    for (int x = x0; x < x1; x++) {
        double ta = t0 + (double)(x - x0) / pw * (t1 - t0), tb = t0 + (double)(x + 1 - x0) / pw * (t1 - t0);
        while (j < tl->n_frames && tl->frames[j].t1 < ta) j++;
        const uint64_t *row = NULL;
        uint64_t best = 0, budget = tl->budget;
        if (j > 0) {
            row = tl->frames[j - 1].at_end;
            best = kiln_mem_timeline_sum(row, tl->n_owners); /* the state carried in */
            budget = tl->frames[j - 1].budget;
        }
        for (int k = j; k < tl->n_frames && tl->frames[k].t0 < tb; k++) {
            if (!row || tl->frames[k].peak >= best) {
                row = tl->frames[k].at_peak;
                best = tl->frames[k].peak;
            }
            budget = tl->frames[k].budget;
        }
        if (row) {
            uint64_t cum = 0;
            for (int o = 0; o < lay->n_order; o++) {
                int i = lay->order[o];
                if (!row[i]) continue;
                int ya = Y_OF(cum);
                cum += row[i];
                int yb = Y_OF(cum);
                fill(&c, x, yb < y0 ? y0 : yb, x + 1, ya, lay->color[i]);
            }
        }
        if (budget && (double)budget <= ymax) {
            budget_shown = 1;
            int by = Y_OF(budget);
            if (by < y0) by = y0;
            int lo = prev_by >= 0 && prev_by < by ? prev_by : by, hi = prev_by > by ? prev_by : by;
            fill(&c, x, lo - u, x + 1, hi + u, BUDGET);
            prev_by = by;
        } else {
            prev_by = -1;
        }
    }

    /* ---- stages: bands above the plot, separators through it ---- */
    int shade = 0;
    for (int i = 0; i < tl->n_spans; i++) {
        const kiln_timeline_span *s = &tl->spans[i];
        if (s->depth > 1) continue;
        int sx0 = X_OF(s->t0), sx1 = X_OF(s->t1 < 0 ? tl->end : s->t1);
        if (sx1 <= sx0) sx1 = sx0 + 1;
        int by = band0 + s->depth * row;
        fill(&c, sx0, by, sx1, by + row - 1, (shade++ & 1) ? BAND_B : BAND_A);
        fill(&c, sx0, by, sx0 + 1, by + row - 1, SEP);
        if (s->depth == 0)
            for (int y = y0; y < y1; y += 3) {
                put(&c, sx0, y, SEP);
                put(&c, sx1 - 1, y, SEP);
            }
        if (sx1 - sx0 > ADVANCE * u + 3)
            draw_text(&c, sx0 + 3, by + 2 * u, s->name, u, s->failed ? FAIL : BLACK, sx1 - 1);
    }

    /* the peak: a mark over its column */
    if (tl->peak) {
        int px = X_OF(tl->peak_time), tip = Y_OF(tl->peak) - 2;
        for (int r = 0; r < 5 * u; r++) fill(&c, px - r, tip - r, px + r + 1, tip - r + 1, BLACK);
    }

    /* axes and time ticks */
    fill(&c, x0 - 1, y0, x0, y1 + 1, AXIS);
    fill(&c, x0 - 1, y1, x1, y1 + 1, AXIS);
    double tstep = nice_step(t1 - t0, (x1 - x0) / (80 * u) > 2 ? (x1 - x0) / (80 * u) : 2);
    for (double v = 0; v <= t1 - t0 + 1e-12; v += tstep) {
        int x = X_OF(t0 + v);
        fill(&c, x, y1, x + 1, y1 + 4 * u, AXIS);
        snprintf(lab, sizeof lab, "%g s", fabs(v) < 1e-12 ? 0.0 : v);
        draw_text(&c, x - text_width(lab, u) / 2, y1 + 7 * u, lab, u, AXIS, -1);
    }

    /* title and the one-line summary */
    char title[160], pk[32], bu[32];
    if (opts && opts->title) snprintf(title, sizeof title, "%s", opts->title);
    else snprintf(title, sizeof title, "kiln memory on %s", tl->device);
    draw_text(&c, x0, 6 * u, title, 2 * u, BLACK, W - 4);
    kiln_format_bytes(pk, sizeof pk, (double)tl->peak);
    if (tl->budget) kiln_format_bytes(bu, sizeof bu, (double)tl->budget);
    else snprintf(bu, sizeof bu, "unlimited");
    const kiln_timeline_span *in = tl->peak ? stage_at(tl, tl->peak_time) : NULL;
    char line[256];
    snprintf(line, sizeof line, "peak %s at %.2f s%s%s; budget %s%s", pk, tl->peak_time - t0, in ? " in " : "",
             in ? in->name : "", bu, tl->budget && (double)tl->budget > ymax ? " (above the chart)" : "");
    draw_text(&c, x0, 26 * u, line, u, MUTED, W - 4);

    /* legend: owners top of the stack first, with the most each held and (when there
     * is room) what each held at the peak */
    const kiln_timeline_frame *pf = peak_frame(tl);
    int lx = x1 + 14 * u, ly = y0, line_h = 14 * u, col_peak = W - 6 * u;
    int two = legend_w >= 200 * u;
    int col_most = two ? col_peak - 10 * ADVANCE * u : col_peak;
    draw_text(&c, col_most - text_width("most", u), ly, "most", u, MUTED, -1);
    if (two) draw_text(&c, col_peak - text_width("at peak", u), ly, "at peak", u, MUTED, -1);
    ly += line_h;
    for (int o = lay->n_order - 1; o >= 0; o--) {
        int i = lay->order[o];
        fill(&c, lx, ly, lx + 10 * u, ly + 9 * u, lay->color[i]);
        char most[32], at[32] = "-";
        kiln_format_bytes(most, sizeof most, (double)tl->most[i]);
        if (pf) kiln_format_bytes(at, sizeof at, (double)pf->at_peak[i]);
        int mx = col_most - text_width(most, u);
        draw_text(&c, lx + 15 * u, ly + u, tl->owners[i], u, BLACK, mx - 4 * u);
        draw_text(&c, mx, ly + u, most, u, AXIS, -1);
        if (two) draw_text(&c, col_peak - text_width(at, u), ly + u, at, u, AXIS, -1);
        ly += line_h;
    }
    if (budget_shown) {
        ly += 4 * u;
        fill(&c, lx, ly + 4 * u, lx + 10 * u, ly + 6 * u, BUDGET);
        draw_text(&c, lx + 15 * u, ly + u, "budget", u, BLACK, W - 2);
        ly += line_h;
    }
    ly += 4 * u;
    for (int y = ly; y < ly + 10 * u; y += 3) put(&c, lx + 5 * u, y, SEP);
    draw_text(&c, lx + 15 * u, ly + u, "stage boundary", u, BLACK, W - 2);
#undef Y_OF
#undef X_OF

    for (size_t p = 0, n = (size_t)W * (size_t)H; p < n; p++)
        for (int k = 0; k < 3; k++) planar[(size_t)k * n + p] = c.px[p * 3 + (size_t)k] / 255.0f;
    free(c.px);
    /* the numbers travel with the picture */
    char *table = kiln_mem_plot_table(tl);
    const char *keys[2] = {"Software", "kiln.memory"};
    const char *vals[2] = {"kiln", table};
    int n_text = table && kiln_unicode_utf8_valid(table) ? 2 : 1;
    kiln_status st = kiln_png_write(path, planar, 3, H, W, n_text, keys, vals);
    free(table);
    free(planar);
    return st;
}

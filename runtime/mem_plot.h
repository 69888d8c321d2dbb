/* mem_plot.h - the memory picture: a device's timeline (mem_timeline.h) drawn into a
 * PNG with kiln's own writer and a built-in bitmap font - bytes over time stacked by
 * owner, the budget as a line, the stages along the time axis - and the per-stage
 * peak table as text. */
#ifndef KILN_MEM_PLOT_H
#define KILN_MEM_PLOT_H

#include "mem_timeline.h"

/* Zero values take the defaults. */
typedef struct {
    int width, height;        /* pixels; default 960 x 540, at least 480 x 240 */
    const char *title;        /* default "kiln memory on <device>" */
} kiln_mem_plot_options;

/* Where things were drawn, for callers that look at the pixels (tests). */
typedef struct {
    int width, height;
    int x0, x1, y0, y1;       /* the plot area: x in [x0, x1), y in [y0, y1), y1 = 0 bytes */
    double t0, t1;            /* the times at x0 and x1 */
    double ymax;              /* the bytes at y0 */
    int n_owners;             /* as in the timeline */
    int order[KILN_TIMELINE_OWNERS];   /* stacking order, bottom first (owner indices);
                                        * owners never holding a byte are left out */
    int n_order;
    unsigned char color[KILN_TIMELINE_OWNERS][3]; /* RGB by owner index */
    unsigned char budget_color[3];
} kiln_mem_plot_layout;

/* Draws tl into a PNG at path (atomic write). layout may be NULL. */
kiln_status kiln_mem_plot_write(const kiln_mem_timeline *tl, const char *path,
                                const kiln_mem_plot_options *opts, kiln_mem_plot_layout *layout);
/* The stage table: one line per stage (nested ones indented) with its start, length,
 * the device's peak while it ran and who held most at that moment. malloc'd text
 * (NULL when out of memory); the caller frees it. */
char *kiln_mem_plot_table(const kiln_mem_timeline *tl);

#endif

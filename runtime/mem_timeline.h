/* mem_timeline.h - the memory timeline: every allocation, free and owner change of
 * every device allocator's blocks, by owner, with the budget, and the named stages
 * (kiln.trace.span) on the events clock. Always on and bounded, so that a picture of
 * any run can be drawn after the fact (mem_plot.h). Thread-safe; its lock is a leaf.
 * layer 2 of the memory core: uses events, alloc; never calls device, trace.
 * A device is only a key here: device.c hands each one's allocator and name in when
 * it creates it (kiln_mem_timeline_add_device), so the timeline sits below it. */
#ifndef KILN_MEM_TIMELINE_H
#define KILN_MEM_TIMELINE_H

#include "alloc.h"

typedef struct kiln_device kiln_device; /* device.h */

/* Owners told apart per device; past this many, the last slot is "other". */
#define KILN_TIMELINE_OWNERS 24
/* Frames kept per device: past this, neighbouring frames are merged in pairs and
 * each later frame covers at least twice the time (see mem_timeline.c). */
#define KILN_TIMELINE_FRAMES 4096
/* Stages kept: past this, finished nested ones are dropped first, then new ones. */
#define KILN_TIMELINE_SPANS 2048
/* Devices with a timeline (the first ones registered). */
#define KILN_TIMELINE_DEVICES 8

/* ---- hooks (device.c, the span guard of the bindings) ---- */

/* A new device, its allocator and its name (read at each kiln_mem_timeline_get, so a
 * renamed meta device shows the device it models): device.c, as it creates one.
 * Past KILN_TIMELINE_DEVICES devices, later ones have no timeline. */
void kiln_mem_timeline_add_device(kiln_device *dev, kiln_allocator *alloc, const char *name);

/* A block at ptr of dev's allocator was handed out, accounted to owner; its size is
 * the allocator's (kiln_allocator_block_size), so the sums equal its `allocated`. */
void kiln_mem_timeline_alloc(kiln_device *dev, const void *ptr, const char *owner);
/* Call before the block goes back to the allocator. Unknown pointers are ignored. */
void kiln_mem_timeline_free(kiln_device *dev, const void *ptr);
/* The block's bytes move to another owner (kiln_storage_set_owner). */
void kiln_mem_timeline_set_owner(kiln_device *dev, const void *ptr, const char *owner);
/* Stages: begin returns an id for end (0 when the stage was not kept). failed marks a
 * stage left by an error. t is a kiln_events_now() value. */
uint64_t kiln_mem_timeline_span_begin(const char *name, double t);
void kiln_mem_timeline_span_end(uint64_t id, double t, int failed);
/* Forgets the frames and stages recorded so far (the bytes held now stay known and
 * the next frame starts from them). */
void kiln_mem_timeline_clear(void);

/* ---- reading ---- */

typedef struct {
    double t0, t1;                              /* the time the frame covers */
    uint64_t budget;                            /* at its end (0 = unlimited) */
    uint64_t peak;                              /* highest total within the frame */
    uint64_t at_peak[KILN_TIMELINE_OWNERS];     /* bytes by owner at that moment */
    uint64_t at_end[KILN_TIMELINE_OWNERS];      /* bytes by owner after its last change */
} kiln_timeline_frame;

typedef struct {
    char name[120];
    double t0, t1;          /* t1 < 0 while still open */
    int depth;              /* stages open on the same thread when it began */
    int thread;             /* kiln_thread_id() of that thread */
    int failed;             /* ended by an error */
    uint64_t peak;          /* the device's highest total while the stage was open */
    double peak_time;
    int top_owner;          /* who held most at that moment (-1 none) */
    uint64_t top_bytes;
} kiln_timeline_span;

typedef struct {
    char device[16];
    int n_owners;
    char owners[KILN_TIMELINE_OWNERS][64];
    uint64_t now[KILN_TIMELINE_OWNERS];  /* bytes by owner now */
    uint64_t most[KILN_TIMELINE_OWNERS]; /* the most each owner held since the clear */
    uint64_t total, budget;              /* now */
    uint64_t peak;                       /* highest total since the clear */
    double peak_time;
    double start;                        /* when recording began (process or clear) */
    double end;                          /* when this copy was taken */
    int n_frames;
    kiln_timeline_frame *frames;         /* oldest first */
    int n_spans;
    kiln_timeline_span *spans;           /* in order of beginning */
    uint64_t spans_dropped;
} kiln_mem_timeline;

/* Copies dev's timeline into *out (frames and spans malloc'd; free with
 * kiln_mem_timeline_release). A device without one yields an empty timeline. */
kiln_status kiln_mem_timeline_get(kiln_device *dev, kiln_mem_timeline *out);
void kiln_mem_timeline_release(kiln_mem_timeline *tl);
/* Total of a frame's owner row. */
uint64_t kiln_mem_timeline_sum(const uint64_t *by_owner, int n_owners);

#endif

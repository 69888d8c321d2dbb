/* mem_timeline.c - the memory timeline behind the memory picture.
 * layer 2 of the memory core: uses events, alloc; never calls device, trace.
 * Each device keeps its bytes by owner now and a list of frames: while the list has
 * room every change is a frame of its own; when it is full, neighbouring frames are
 * merged in pairs and later frames cover at least twice as much time, so a run of any
 * length keeps between half and all of KILN_TIMELINE_FRAMES frames spread over it. A
 * merged frame keeps the owner row at its highest total and after its last change, so
 * no peak is lost from the picture, only the dips between peaks. Stages keep their
 * own exact peak per device, updated at every change while they are open. Live
 * blocks are found by pointer in one open-addressing table (size and owner), so a
 * free needs neither the allocator nor the storage. */
#define _GNU_SOURCE
#include "mem_timeline.h"
#include "events.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_OPEN 64

typedef struct {
    kiln_device *dev;         /* the key */
    kiln_allocator *alloc;
    const char *name;         /* the device's own name buffer */
    int n_owners;
    char owners[KILN_TIMELINE_OWNERS][64];
    uint64_t cur[KILN_TIMELINE_OWNERS];
    uint64_t most[KILN_TIMELINE_OWNERS];
    uint64_t total, budget, peak;
    double peak_time;
    kiln_timeline_frame *frames;
    int n_frames, cap_frames;
    double res;               /* shortest frame that a new change may not extend */
} dev_tl;

typedef struct {
    uint64_t peak, top_bytes;
    double peak_time;
    int top_owner;
} span_peak;

typedef struct {
    char name[120];
    double t0, t1;
    int depth, thread, failed;
    uint64_t id;
    span_peak at[KILN_TIMELINE_DEVICES];
} span_rec;

typedef struct {
    const void *ptr;          /* NULL: empty slot */
    uint64_t size;
    short dev, owner;
} live_entry;

static pthread_mutex_t tl_mu = PTHREAD_MUTEX_INITIALIZER;
static dev_tl *tls[KILN_TIMELINE_DEVICES];
static int n_tls;
static double tl_start = -1;

static span_rec *spans;
static int n_spans, cap_spans;
static uint64_t spans_dropped, next_span_id;
static int open_idx[MAX_OPEN];   /* indices into spans of the stages still open */
static int n_open;

static live_entry *live;
static size_t live_cap, live_n;

/* ---- live blocks ---- */

static size_t live_hash(const void *p, int dev)
{
    uint64_t h = ((uint64_t)(uintptr_t)p ^ ((uint64_t)dev << 56)) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 24) & (live_cap - 1);
}

static live_entry *live_find(const void *p, int dev)
{
    if (!live_cap) return NULL;
    for (size_t i = live_hash(p, dev);; i = (i + 1) & (live_cap - 1)) {
        if (!live[i].ptr) return NULL;
        if (live[i].ptr == p && live[i].dev == dev) return &live[i];
    }
}

static int live_grow(void)
{
    size_t cap = live_cap ? live_cap * 2 : 4096;
    live_entry *t = calloc(cap, sizeof *t);
    if (!t) return 0;
    live_entry *old = live;
    size_t old_cap = live_cap;
    live = t;
    live_cap = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (!old[i].ptr) continue;
        size_t j = live_hash(old[i].ptr, old[i].dev);
        while (live[j].ptr) j = (j + 1) & (cap - 1);
        live[j] = old[i];
    }
    free(old);
    return 1;
}

static void live_put(const void *p, int dev, uint64_t size, int owner)
{
    if ((live_n + 1) * 2 > live_cap && !live_grow()) return; /* unrecorded: better than failing the allocation */
    size_t i = live_hash(p, dev);
    while (live[i].ptr && !(live[i].ptr == p && live[i].dev == dev)) i = (i + 1) & (live_cap - 1);
    if (!live[i].ptr) live_n++;
    live[i] = (live_entry){p, size, (short)dev, (short)owner};
}

/* Removal with backward shift (linear probing without tombstones). */
static void live_remove(live_entry *e)
{
    size_t i = (size_t)(e - live);
    live[i].ptr = NULL;
    live_n--;
    for (size_t j = (i + 1) & (live_cap - 1); live[j].ptr; j = (j + 1) & (live_cap - 1)) {
        size_t h = live_hash(live[j].ptr, live[j].dev);
        /* the entry at j may move to the hole at i when its home is not in (i, j] */
        int stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (stays) continue;
        live[i] = live[j];
        live[j].ptr = NULL;
        i = j;
    }
}

/* ---- devices and owners ---- */

static double now_locked(void)
{
    double t = kiln_events_now();
    if (tl_start < 0) tl_start = t;
    return t;
}

static int device_index(kiln_device *dev)
{
    for (int i = 0; i < n_tls; i++)
        if (tls[i]->dev == dev) return i;
    return -1;
}

void kiln_mem_timeline_add_device(kiln_device *dev, kiln_allocator *alloc, const char *name)
{
    if (!dev || !alloc) return;
    pthread_mutex_lock(&tl_mu);
    if (device_index(dev) < 0 && n_tls < KILN_TIMELINE_DEVICES) {
        dev_tl *d = calloc(1, sizeof *d);
        if (d) {
            d->dev = dev;
            d->alloc = alloc;
            d->name = name;
            /* stages already open saw nothing of this device: their peak starts at zero */
            tls[n_tls++] = d;
        }
    }
    pthread_mutex_unlock(&tl_mu);
}

/* The allocator of a device handed in, NULL for any other (which has no timeline). */
static kiln_allocator *alloc_of(kiln_device *dev, const char **name)
{
    kiln_allocator *a = NULL;
    pthread_mutex_lock(&tl_mu);
    int di = device_index(dev);
    if (di >= 0) {
        a = tls[di]->alloc;
        if (name) *name = tls[di]->name;
    }
    pthread_mutex_unlock(&tl_mu);
    return a;
}

static int owner_index(dev_tl *d, const char *owner)
{
    if (!owner || !*owner) owner = "tensor";
    for (int i = 0; i < d->n_owners; i++)
        if (strcmp(d->owners[i], owner) == 0) return i;
    if (d->n_owners < KILN_TIMELINE_OWNERS - 1) {
        snprintf(d->owners[d->n_owners], sizeof d->owners[0], "%s", owner);
        return d->n_owners++;
    }
    if (d->n_owners == KILN_TIMELINE_OWNERS - 1) snprintf(d->owners[d->n_owners++], sizeof d->owners[0], "other");
    return KILN_TIMELINE_OWNERS - 1;
}

static int top_owner(const dev_tl *d, uint64_t *bytes)
{
    int best = -1;
    uint64_t b = 0;
    for (int i = 0; i < d->n_owners; i++)
        if (d->cur[i] > b) { b = d->cur[i]; best = i; }
    *bytes = b;
    return best;
}

/* ---- frames ---- */

static void merge_frames(kiln_timeline_frame *a, const kiln_timeline_frame *b)
{
    a->t1 = b->t1;
    a->budget = b->budget;
    if (b->peak > a->peak) {
        a->peak = b->peak;
        memcpy(a->at_peak, b->at_peak, sizeof a->at_peak);
    }
    memcpy(a->at_end, b->at_end, sizeof a->at_end);
}

static void compact(dev_tl *d)
{
    int n = d->n_frames, k = 0;
    for (int i = 0; i < n; i += 2) {
        kiln_timeline_frame f = d->frames[i];
        if (i + 1 < n) merge_frames(&f, &d->frames[i + 1]);
        d->frames[k++] = f;
    }
    d->n_frames = k;
    double cover = d->frames[k - 1].t1 - d->frames[0].t0;
    double res = cover / (KILN_TIMELINE_FRAMES / 2);
    d->res = d->res * 2 > res ? d->res * 2 : res;
}

static void record_frame(dev_tl *d, double t)
{
    kiln_timeline_frame *last = d->n_frames ? &d->frames[d->n_frames - 1] : NULL;
    if (last && d->res > 0 && t - last->t0 < d->res) {
        last->t1 = t;
        last->budget = d->budget;
        if (d->total > last->peak) {
            last->peak = d->total;
            memcpy(last->at_peak, d->cur, sizeof d->cur);
        }
        memcpy(last->at_end, d->cur, sizeof d->cur);
        return;
    }
    if (d->n_frames == KILN_TIMELINE_FRAMES) compact(d);
    if (d->n_frames == d->cap_frames) {
        int cap = d->cap_frames ? d->cap_frames * 2 : 256;
        if (cap > KILN_TIMELINE_FRAMES) cap = KILN_TIMELINE_FRAMES;
        kiln_timeline_frame *f = realloc(d->frames, (size_t)cap * sizeof *f);
        if (!f) return; /* the totals stay right; the picture misses this change */
        d->frames = f;
        d->cap_frames = cap;
    }
    kiln_timeline_frame *f = &d->frames[d->n_frames++];
    f->t0 = f->t1 = t;
    f->budget = d->budget;
    f->peak = d->total;
    memcpy(f->at_peak, d->cur, sizeof d->cur);
    memcpy(f->at_end, d->cur, sizeof d->cur);
}

/* One change on device index di: owner a gains da bytes and owner b loses db (either
 * may be -1), then the frame, the device's peak and the open stages' peaks. */
static void apply(int di, int a, uint64_t da, int b, uint64_t db, uint64_t budget)
{
    dev_tl *d = tls[di];
    double t = now_locked();
    if (a >= 0) {
        d->cur[a] += da;
        d->total += da;
        if (d->cur[a] > d->most[a]) d->most[a] = d->cur[a];
    }
    if (b >= 0) {
        uint64_t take = db < d->cur[b] ? db : d->cur[b];
        d->cur[b] -= take;
        d->total -= take;
    }
    d->budget = budget;
    if (d->total > d->peak) { d->peak = d->total; d->peak_time = t; }
    record_frame(d, t);
    for (int i = 0; i < n_open; i++) {
        span_peak *p = &spans[open_idx[i]].at[di];
        if (d->total > p->peak) {
            p->peak = d->total;
            p->peak_time = t;
            p->top_owner = top_owner(d, &p->top_bytes);
        }
    }
}

static uint64_t budget_of(kiln_allocator *a)
{
    return a ? kiln_allocator_stats(a).budget : 0;
}

void kiln_mem_timeline_alloc(kiln_device *dev, const void *ptr, const char *owner)
{
    if (!dev || !ptr) return;
    /* allocator calls first: its lock is never taken under ours */
    kiln_allocator *a = alloc_of(dev, NULL);
    if (!a) return;
    uint64_t size = kiln_allocator_block_size(a, (void *)ptr);
    uint64_t budget = budget_of(a);
    pthread_mutex_lock(&tl_mu);
    int di = device_index(dev);
    if (di >= 0) {
        int o = owner_index(tls[di], owner);
        live_put(ptr, di, size, o);
        apply(di, o, size, -1, 0, budget);
    }
    pthread_mutex_unlock(&tl_mu);
}

void kiln_mem_timeline_free(kiln_device *dev, const void *ptr)
{
    if (!dev || !ptr) return;
    kiln_allocator *a = alloc_of(dev, NULL);
    if (!a) return;
    uint64_t budget = budget_of(a);
    pthread_mutex_lock(&tl_mu);
    int di = device_index(dev);
    live_entry *e = di >= 0 ? live_find(ptr, di) : NULL;
    if (e) {
        int o = e->owner;
        uint64_t size = e->size;
        live_remove(e);
        apply(di, -1, 0, o, size, budget);
    }
    pthread_mutex_unlock(&tl_mu);
}

void kiln_mem_timeline_set_owner(kiln_device *dev, const void *ptr, const char *owner)
{
    if (!dev || !ptr) return;
    kiln_allocator *a = alloc_of(dev, NULL);
    if (!a) return;
    uint64_t budget = budget_of(a);
    pthread_mutex_lock(&tl_mu);
    int di = device_index(dev);
    live_entry *e = di >= 0 ? live_find(ptr, di) : NULL;
    if (e) {
        int o = owner_index(tls[di], owner);
        if (o != e->owner) {
            int old = e->owner;
            e->owner = (short)o;
            apply(di, o, e->size, old, e->size, budget);
        }
    }
    pthread_mutex_unlock(&tl_mu);
}

/* ---- stages ---- */

/* Makes room for one more stage: finished nested stages go first. */
static int span_room(void)
{
    if (n_spans < cap_spans) return 1;
    if (cap_spans < KILN_TIMELINE_SPANS) {
        int cap = cap_spans ? cap_spans * 2 : 64;
        span_rec *s = realloc(spans, (size_t)cap * sizeof *s);
        if (!s) return 0;
        spans = s;
        cap_spans = cap;
        return 1;
    }
    int k = 0;
    for (int i = 0; i < n_spans; i++)
        if (spans[i].t1 < 0 || spans[i].depth == 0) spans[k++] = spans[i];
    spans_dropped += (uint64_t)(n_spans - k);
    n_spans = k;
    n_open = 0;
    for (int i = 0; i < n_spans && n_open < MAX_OPEN; i++)
        if (spans[i].t1 < 0) open_idx[n_open++] = i;
    return n_spans < cap_spans;
}

uint64_t kiln_mem_timeline_span_begin(const char *name, double t)
{
    int tid = kiln_thread_id();
    pthread_mutex_lock(&tl_mu);
    now_locked();
    uint64_t id = 0;
    if (n_open < MAX_OPEN && span_room()) {
        span_rec *s = &spans[n_spans];
        memset(s, 0, sizeof *s);
        snprintf(s->name, sizeof s->name, "%s", name ? name : "?");
        s->t0 = t;
        s->t1 = -1;
        s->thread = tid;
        for (int i = 0; i < n_open; i++) s->depth += spans[open_idx[i]].thread == tid;
        s->id = id = ++next_span_id;
        for (int i = 0; i < n_tls; i++) {
            s->at[i].peak = tls[i]->total;
            s->at[i].peak_time = t;
            s->at[i].top_owner = top_owner(tls[i], &s->at[i].top_bytes);
        }
        open_idx[n_open++] = n_spans++;
    } else {
        spans_dropped++;
    }
    pthread_mutex_unlock(&tl_mu);
    return id;
}

void kiln_mem_timeline_span_end(uint64_t id, double t, int failed)
{
    if (!id) return;
    pthread_mutex_lock(&tl_mu);
    for (int i = n_open - 1; i >= 0; i--) {
        span_rec *s = &spans[open_idx[i]];
        if (s->id != id) continue;
        s->t1 = t;
        s->failed = failed;
        open_idx[i] = open_idx[--n_open];
        /* keep the open list in order of beginning (depth counts rely only on the set) */
        break;
    }
    pthread_mutex_unlock(&tl_mu);
}

void kiln_mem_timeline_clear(void)
{
    pthread_mutex_lock(&tl_mu);
    double t = kiln_events_now();
    tl_start = t;
    for (int i = 0; i < n_tls; i++) {
        dev_tl *d = tls[i];
        d->n_frames = 0;
        d->res = 0;
        d->peak = d->total;
        d->peak_time = t;
        memcpy(d->most, d->cur, sizeof d->most);
        record_frame(d, t);
    }
    n_spans = n_open = 0;
    spans_dropped = 0;
    pthread_mutex_unlock(&tl_mu);
}

/* ---- reading ---- */

uint64_t kiln_mem_timeline_sum(const uint64_t *by_owner, int n_owners)
{
    uint64_t s = 0;
    for (int i = 0; i < n_owners; i++) s += by_owner[i];
    return s;
}

kiln_status kiln_mem_timeline_get(kiln_device *dev, kiln_mem_timeline *out)
{
    memset(out, 0, sizeof *out);
    if (!dev) return kiln_error(KILN_ERR_ARG, "memory timeline: no device");
    const char *name = "?";
    kiln_allocator *a = alloc_of(dev, &name);
    snprintf(out->device, sizeof out->device, "%s", name);
    uint64_t budget = budget_of(a);
    pthread_mutex_lock(&tl_mu);
    double t = now_locked();
    int di = -1;
    for (int i = 0; i < n_tls; i++)
        if (tls[i]->dev == dev) di = i;
    out->start = tl_start;
    out->end = t;
    out->budget = budget;
    out->spans_dropped = spans_dropped;
    kiln_status st = KILN_OK;
    if (di >= 0) {
        const dev_tl *d = tls[di];
        out->n_owners = d->n_owners;
        memcpy(out->owners, d->owners, sizeof out->owners);
        memcpy(out->now, d->cur, sizeof out->now);
        memcpy(out->most, d->most, sizeof out->most);
        out->total = d->total;
        out->peak = d->peak;
        out->peak_time = d->peak_time;
        out->frames = malloc(((size_t)d->n_frames + 1) * sizeof *out->frames);
        if (out->frames) {
            if (d->n_frames) /* frames is NULL before the first one */
                memcpy(out->frames, d->frames, (size_t)d->n_frames * sizeof *out->frames);
            out->n_frames = d->n_frames;
        } else {
            st = KILN_ERR_OOM;
        }
    }
    out->spans = malloc(((size_t)n_spans + 1) * sizeof *out->spans);
    if (out->spans) {
        for (int i = 0; i < n_spans; i++) {
            const span_rec *s = &spans[i];
            kiln_timeline_span *o = &out->spans[i];
            memset(o, 0, sizeof *o);
            memcpy(o->name, s->name, sizeof o->name);
            o->t0 = s->t0;
            o->t1 = s->t1;
            o->depth = s->depth;
            o->thread = s->thread;
            o->failed = s->failed;
            o->top_owner = -1;
            if (di >= 0) {
                o->peak = s->at[di].peak;
                o->peak_time = s->at[di].peak_time;
                o->top_owner = s->at[di].top_owner;
                o->top_bytes = s->at[di].top_bytes;
            }
        }
        out->n_spans = n_spans;
        /* a stage begun before the first allocation starts the timeline */
        for (int i = 0; i < n_spans; i++)
            if (spans[i].t0 < out->start) out->start = spans[i].t0;
    } else {
        st = KILN_ERR_OOM;
    }
    pthread_mutex_unlock(&tl_mu);
    if (st != KILN_OK) {
        kiln_mem_timeline_release(out);
        return kiln_error(st, "memory timeline of %s: out of host memory", out->device);
    }
    return KILN_OK;
}

void kiln_mem_timeline_release(kiln_mem_timeline *tl)
{
    if (!tl) return;
    free(tl->frames);
    free(tl->spans);
    tl->frames = NULL;
    tl->spans = NULL;
    tl->n_frames = tl->n_spans = 0;
}

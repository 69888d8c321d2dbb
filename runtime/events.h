/* events.h - the memory event log and the runtime's clock: the bottom of the memory
 * core, so that every layer above may record what it does and none is called back.
 * layer 0 of the memory core: uses nothing; never calls alloc, mem_timeline, device, trace.
 * Every model load, offload, unload and eviction, every out-of-memory and (above a
 * threshold) every allocation is an event {time, kind, device, bytes, owner, detail}
 * kept in a ring buffer. Devices are named, not pointed at. A listener (the trace
 * writer, trace.h) sees each event as it is recorded. Thread-safe. */
#ifndef KILN_EVENTS_H
#define KILN_EVENTS_H

#include "status.h"

/* ORDER EVENT: keep event_kind_names in events.c in this order */
typedef enum {
    KILN_EV_LOAD = 0,  /* model copies made on a device (bytes: what the device holds now) */
    KILN_EV_OFFLOAD,   /* device copies moved to host memory */
    KILN_EV_UNLOAD,    /* every copy dropped but the mapped file */
    KILN_EV_EVICT,     /* device copies dropped to make room for an allocation */
    KILN_EV_OOM,       /* an allocation that could not be satisfied */
    KILN_EV_ALLOC,     /* an allocation at or above the threshold */
    KILN_EV_FREE,      /* its release */
    KILN_EV_MARK,      /* a user mark (kiln.trace.mark) */
    KILN_EV_COUNT
} kiln_event_kind;

#define KILN_EVENTS_CAPACITY 10000

typedef struct {
    uint64_t seq;            /* 1, 2, ... over the process lifetime */
    double time;             /* seconds since the runtime's clock started */
    kiln_event_kind kind;
    int thread;              /* kiln_thread_id() of the thread that caused it */
    char device[16];
    uint64_t bytes;
    char owner[64];          /* "model:unet", "tensor", ... */
    char detail[192];
} kiln_event;

const char *kiln_event_kind_name(kiln_event_kind k);

/* Records an event (and writes it to the trace when one runs). device and owner
 * may be NULL; owner NULL means the calling thread's context (see below). */
void kiln_event_emit(kiln_event_kind kind, const char *device, uint64_t bytes,
                     const char *owner, const char *fmt, ...) KILN_PRINTF(5, 6);
/* Copies the retained events with seq > since, oldest first, into out (at most max);
 * returns how many were copied. */
size_t kiln_events_get(uint64_t since, kiln_event *out, size_t max);
/* Events retained now (at most KILN_EVENTS_CAPACITY) and the last seq issued. */
size_t kiln_events_count(void);
uint64_t kiln_events_last_seq(void);
void kiln_events_clear(void);
/* Allocations of at least `bytes` become ALLOC/FREE events (0 = off, the default). */
void kiln_events_set_alloc_threshold(uint64_t bytes);
uint64_t kiln_events_alloc_threshold(void);

/* Who the calling thread is working for ("model:unet" during its load): OOM and
 * allocation events without an explicit owner carry it. NULL clears. */
void kiln_events_set_context(const char *owner);
/* The calling thread's context ("" when none); valid on this thread until it changes. */
const char *kiln_events_context(void);

/* Seconds on the runtime's monotonic clock (the time base of events and traces). */
double kiln_events_now(void);

/* A small number for the calling thread (1 for the first thread seen, ...). */
int kiln_thread_id(void);
/* Names the calling thread in traces; worker = 1 marks a runtime background thread
 * (model copy threads), on which a host's pressure hook must not run. */
void kiln_thread_set_name(const char *name, int worker);
int kiln_thread_is_worker(void);

/* Thread names given so far, for a trace's metadata: copies at most max into out and
 * returns how many. */
typedef struct { int tid; char name[48]; } kiln_thread_name;
int kiln_thread_names(kiln_thread_name *out, int max);

/* ---- the listener ---- */

/* Called for every event after it is in the ring (e set, device = e->device), and for
 * every change of a device's memory that is not an event of its own (e NULL: the
 * device layer's storages below the allocation threshold). On the thread that caused
 * it, outside the events lock, so it may read allocator statistics. The layers above
 * subscribe here instead of being called: the trace writer (trace.c) while a trace
 * runs. One listener; NULL removes it. */
typedef void (*kiln_event_listener)(const kiln_event *e, const char *device);
void kiln_events_set_listener(kiln_event_listener fn);
/* Tells the listener that device's memory changed (nothing recorded). */
void kiln_events_memory_changed(const char *device);

#endif

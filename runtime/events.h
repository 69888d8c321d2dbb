/* events.h - the memory event log and the trace writer.
 * Every model load, offload, unload and eviction, every out-of-memory and (above a
 * threshold) every allocation is an event {time, kind, device, bytes, owner, detail}
 * kept in a ring buffer. While a trace is running, events, per-device memory
 * counters and named spans are also streamed to a Chrome trace JSON file (the
 * "traceEvents" format that Perfetto and chrome://tracing open), which is renamed
 * into place when the trace stops. Thread-safe. */
#ifndef KILN_EVENTS_H
#define KILN_EVENTS_H

#include "device.h"

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

/* Seconds on the runtime's monotonic clock (the time base of events and traces). */
double kiln_events_now(void);

/* A small number for the calling thread (1 for the first thread seen, ...). */
int kiln_thread_id(void);
/* Names the calling thread in traces; worker = 1 marks a runtime background thread
 * (model copy threads), on which a host's pressure hook must not run. */
void kiln_thread_set_name(const char *name, int worker);
int kiln_thread_is_worker(void);

/* Hooks from device.c: a storage from a device allocator was created (alive = 1) or
 * freed (alive = 0); an allocation of `requested` bytes on dev failed with
 * KILN_ERR_OOM (the message gets what is resident on the device appended). */
void kiln_events_storage(const kiln_storage *s, int alive);
void kiln_events_oom(kiln_device *dev, uint64_t requested);

/* ---- tracing ---- */

/* Starts streaming a trace to a temporary file next to path; KILN_ERR_STATE when a
 * trace is already running, KILN_ERR_IO when the file cannot be created. */
kiln_status kiln_trace_start(const char *path);
/* Finishes the JSON, flushes, and renames the temporary file onto the path given to
 * start. KILN_ERR_STATE when no trace runs; on a write error the temporary file is
 * removed and the error names the path. */
kiln_status kiln_trace_stop(void);
int kiln_trace_active(void);
/* A complete span [start, start + dur) on the calling thread ("ph":"X"). start is a
 * kiln_events_now() value; args is an optional JSON object body ("\"k\":1") or NULL. */
void kiln_trace_span(const char *name, const char *category, double start, double end,
                     const char *args_json);
/* Samples the memory counters of dev (all devices when NULL) into the trace. */
void kiln_trace_counters(kiln_device *dev);

#endif

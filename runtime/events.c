/* events.c - the memory event ring buffer, the clock and the thread names.
 * layer 0 of the memory core: uses nothing; never calls alloc, mem_timeline, device, trace.
 * One mutex guards the ring and the thread names; nothing else is called while it is
 * held (the listener runs after it is released), so it is a leaf lock: the
 * allocator, storage and model locks may be held by callers. */
#define _GNU_SOURCE
#include "events.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ORDER EVENT */
static const char *const event_kind_names[KILN_EV_COUNT] = {
    "load", "offload", "unload", "evict", "oom", "alloc", "free", "mark",
};

#define MAX_THREAD_NAMES 64

static pthread_mutex_t ev_mu = PTHREAD_MUTEX_INITIALIZER;
static kiln_event *ring;          /* KILN_EVENTS_CAPACITY entries, allocated on first use */
static size_t ring_head, ring_count;
static uint64_t ring_seq;
static _Atomic uint64_t alloc_threshold;

static _Thread_local int tl_tid;
static _Thread_local int tl_worker;
static _Thread_local char tl_context[64];
static atomic_int next_tid;

static struct { int tid; char name[48]; } thread_names[MAX_THREAD_NAMES];
static int n_thread_names;

static _Atomic(kiln_event_listener) listener;

static pthread_once_t clock_once = PTHREAD_ONCE_INIT;
static double clock_base;

static double mono_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void clock_init(void) { clock_base = mono_seconds(); }

double kiln_events_now(void)
{
    pthread_once(&clock_once, clock_init);
    return mono_seconds() - clock_base;
}

const char *kiln_event_kind_name(kiln_event_kind k)
{
    return (unsigned)k < KILN_EV_COUNT ? event_kind_names[k] : "?";
}

int kiln_thread_id(void)
{
    if (!tl_tid) tl_tid = atomic_fetch_add(&next_tid, 1) + 1;
    return tl_tid;
}

void kiln_thread_set_name(const char *name, int worker)
{
    int tid = kiln_thread_id();
    tl_worker = worker;
    pthread_mutex_lock(&ev_mu);
    int i = 0;
    while (i < n_thread_names && thread_names[i].tid != tid) i++;
    if (i == n_thread_names && n_thread_names < MAX_THREAD_NAMES) n_thread_names++;
    if (i < MAX_THREAD_NAMES) {
        thread_names[i].tid = tid;
        snprintf(thread_names[i].name, sizeof thread_names[i].name, "%s", name ? name : "?");
    }
    pthread_mutex_unlock(&ev_mu);
}

int kiln_thread_is_worker(void) { return tl_worker; }

void kiln_events_set_context(const char *owner)
{
    snprintf(tl_context, sizeof tl_context, "%s", owner ? owner : "");
}

const char *kiln_events_context(void) { return tl_context; }

int kiln_thread_names(kiln_thread_name *out, int max)
{
    pthread_mutex_lock(&ev_mu);
    int n = n_thread_names < max ? n_thread_names : max;
    for (int i = 0; i < n; i++) {
        out[i].tid = thread_names[i].tid;
        snprintf(out[i].name, sizeof out[i].name, "%s", thread_names[i].name);
    }
    pthread_mutex_unlock(&ev_mu);
    return n;
}

void kiln_events_set_listener(kiln_event_listener fn) { atomic_store(&listener, fn); }

void kiln_events_memory_changed(const char *device)
{
    kiln_event_listener fn = atomic_load(&listener);
    if (fn) fn(NULL, device);
}

void kiln_events_set_alloc_threshold(uint64_t bytes) { atomic_store(&alloc_threshold, bytes); }
uint64_t kiln_events_alloc_threshold(void) { return atomic_load(&alloc_threshold); }

/* ---- the ring ---- */

static void emit(kiln_event *e)
{
    pthread_mutex_lock(&ev_mu);
    if (!ring) ring = calloc(KILN_EVENTS_CAPACITY, sizeof *ring);
    e->seq = ++ring_seq;
    if (ring) {
        ring[ring_head] = *e;
        ring_head = (ring_head + 1) % KILN_EVENTS_CAPACITY;
        if (ring_count < KILN_EVENTS_CAPACITY) ring_count++;
    }
    pthread_mutex_unlock(&ev_mu);
    kiln_event_listener fn = atomic_load(&listener);
    if (fn) fn(e, e->device);
}

static void fill_event(kiln_event *e, kiln_event_kind kind, const char *device, uint64_t bytes,
                       const char *owner)
{
    memset(e, 0, sizeof *e);
    e->time = kiln_events_now();
    e->kind = kind;
    e->thread = kiln_thread_id();
    e->bytes = bytes;
    snprintf(e->device, sizeof e->device, "%s", device ? device : "");
    snprintf(e->owner, sizeof e->owner, "%s", owner ? owner : tl_context);
}

void kiln_event_emit(kiln_event_kind kind, const char *device, uint64_t bytes, const char *owner,
                     const char *fmt, ...)
{
    kiln_event e;
    fill_event(&e, kind, device, bytes, owner);
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e.detail, sizeof e.detail, fmt, ap);
        va_end(ap);
    }
    emit(&e);
}

size_t kiln_events_get(uint64_t since, kiln_event *out, size_t max)
{
    size_t n = 0;
    pthread_mutex_lock(&ev_mu);
    size_t start = (ring_head + KILN_EVENTS_CAPACITY - ring_count) % KILN_EVENTS_CAPACITY;
    for (size_t i = 0; i < ring_count && n < max; i++) {
        const kiln_event *e = &ring[(start + i) % KILN_EVENTS_CAPACITY];
        if (e->seq > since) out[n++] = *e;
    }
    pthread_mutex_unlock(&ev_mu);
    return n;
}

size_t kiln_events_count(void)
{
    pthread_mutex_lock(&ev_mu);
    size_t n = ring_count;
    pthread_mutex_unlock(&ev_mu);
    return n;
}

uint64_t kiln_events_last_seq(void)
{
    pthread_mutex_lock(&ev_mu);
    uint64_t s = ring_seq;
    pthread_mutex_unlock(&ev_mu);
    return s;
}

void kiln_events_clear(void)
{
    pthread_mutex_lock(&ev_mu);
    ring_head = ring_count = 0;
    pthread_mutex_unlock(&ev_mu);
}

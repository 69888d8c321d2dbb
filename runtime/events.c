/* events.c - the memory event ring buffer and the Chrome trace writer.
 * One mutex guards the ring and the trace file; nothing else is called while it is
 * held (counter samples read the allocator's statistics first), so it is a leaf
 * lock: the allocator, storage and model locks may be held by callers. */
#define _GNU_SOURCE
#include "events.h"
#include "atomic_file.h"
#include "format_bytes.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ORDER EVENT */
static const char *const event_kind_names[KILN_EV_COUNT] = {
    "load", "offload", "unload", "evict", "oom", "alloc", "free", "mark",
};

/* Counter samples beyond this many trace records are dropped (a runaway loop of
 * small allocations must not fill the disk); events and spans are always kept. */
#define TRACE_MAX_COUNTERS 4000000u
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

/* trace state (under ev_mu; trace_on is read without it as a fast path) */
static atomic_int trace_on;
static FILE *trace_file;
static char *trace_path;       /* the target, owned here (the atomic file borrows it) */
static kiln_atomic_file trace_af; /* the temporary the trace streams into until stop */
static double trace_t0;
static uint64_t trace_counters, trace_dropped;

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

void kiln_events_set_alloc_threshold(uint64_t bytes) { atomic_store(&alloc_threshold, bytes); }
uint64_t kiln_events_alloc_threshold(void) { return atomic_load(&alloc_threshold); }

/* ---- trace output (ev_mu held) ---- */

static void json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') { fputc('\\', f); fputc(*p, f); }
        else if (*p == '\n') fputs("\\n", f);
        else if (*p == '\t') fputs("\\t", f);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

static double trace_us(double t) { return (t - trace_t0) * 1e6; }

static void trace_write_event(const kiln_event *e)
{
    FILE *f = trace_file;
    fputs(",\n{\"name\":", f);
    char name[96];
    snprintf(name, sizeof name, "%s %s", kiln_event_kind_name(e->kind), e->owner[0] ? e->owner : e->device);
    json_string(f, name);
    fprintf(f, ",\"cat\":\"memory\",\"ph\":\"i\",\"s\":\"p\",\"ts\":%.3f,\"pid\":1,\"tid\":%d,\"args\":{\"kind\":\"%s\",\"device\":",
            trace_us(e->time), e->thread, kiln_event_kind_name(e->kind));
    json_string(f, e->device);
    fprintf(f, ",\"bytes\":%llu,\"owner\":", (unsigned long long)e->bytes);
    json_string(f, e->owner);
    fputs(",\"detail\":", f);
    json_string(f, e->detail);
    fputs("}}", f);
}

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
    if (trace_file) trace_write_event(e);
    pthread_mutex_unlock(&ev_mu);
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
    if (atomic_load(&trace_on) && device) {
        kiln_device *d = NULL;
        for (int i = 0; i < kiln_device_count(); i++)
            if (strcmp(kiln_device_at(i)->name, device) == 0) d = kiln_device_at(i);
        if (d) kiln_trace_counters(d);
    }
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

/* ---- hooks from device.c ---- */

void kiln_events_storage(const kiln_storage *s, int alive)
{
    uint64_t th = atomic_load(&alloc_threshold);
    if (th && s->nbytes >= th) {
        kiln_event e;
        /* a new storage is still owned by "tensor": the thread's context says better */
        const char *owner = alive && tl_context[0] ? tl_context : s->owner;
        fill_event(&e, alive ? KILN_EV_ALLOC : KILN_EV_FREE, s->device->name, s->nbytes, owner);
        emit(&e);
    }
    if (atomic_load(&trace_on)) kiln_trace_counters(s->device);
}

typedef struct { char owner[64]; uint64_t bytes; int count; } owner_row;
typedef struct { owner_row rows[16]; int n; uint64_t other; } owner_acc;

static void add_owner(void *ctx, const kiln_storage *s)
{
    owner_acc *a = ctx;
    if (s->release) return; /* mapped files and wrapped memory are not the allocator's */
    for (int i = 0; i < a->n; i++)
        if (strcmp(a->rows[i].owner, s->owner) == 0) { a->rows[i].bytes += s->nbytes; a->rows[i].count++; return; }
    if (a->n == 16) { a->other += s->nbytes; return; }
    snprintf(a->rows[a->n].owner, sizeof a->rows[a->n].owner, "%s", s->owner);
    a->rows[a->n].bytes = s->nbytes;
    a->rows[a->n].count = 1;
    a->n++;
}

static int row_cmp(const void *x, const void *y)
{
    const owner_row *a = x, *b = y;
    return a->bytes < b->bytes ? 1 : a->bytes > b->bytes ? -1 : strcmp(a->owner, b->owner);
}

void kiln_events_oom(kiln_device *dev, uint64_t requested)
{
    kiln_oom_info o = *kiln_last_oom();
    char msg[640], res[320], b[32];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    owner_acc acc;
    memset(&acc, 0, sizeof acc);
    kiln_storage_foreach(dev, add_owner, &acc);
    qsort(acc.rows, (size_t)acc.n, sizeof acc.rows[0], row_cmp);
    size_t used = (size_t)snprintf(res, sizeof res, acc.n ? "resident on %s:" : "nothing resident on %s", dev->name);
    for (int i = 0; i < acc.n && used < sizeof res; i++) {
        kiln_format_bytes(b, sizeof b, (double)acc.rows[i].bytes);
        used += (size_t)snprintf(res + used, sizeof res - used, "%s %s %s", i ? "," : "", acc.rows[i].owner, b);
    }
    if (acc.other && used < sizeof res) {
        kiln_format_bytes(b, sizeof b, (double)acc.other);
        snprintf(res + used, sizeof res - used, ", others %s", b);
    }
    kiln_error_oom(o.device, o.requested, o.free, o.budget, "%s; %s", msg, res);
    char fr[32], bu[32];
    kiln_format_bytes(fr, sizeof fr, (double)o.free);
    if (o.budget) kiln_format_bytes(bu, sizeof bu, (double)o.budget);
    else snprintf(bu, sizeof bu, "unlimited");
    kiln_event e;
    fill_event(&e, KILN_EV_OOM, dev->name, requested, NULL);
    /* the resident list may be cut short here: the full one is in the error message */
    size_t cut = (size_t)snprintf(e.detail, sizeof e.detail, "free %s of budget %s; ", fr, bu);
    if (cut < sizeof e.detail) memcpy(e.detail + cut, res, strnlen(res, sizeof e.detail - cut - 1));
    emit(&e);
    if (atomic_load(&trace_on)) kiln_trace_counters(dev);
}

/* ---- tracing ---- */

static void trace_counter_locked(kiln_device *d, const kiln_mem_stats *s, double t)
{
    if (trace_counters >= TRACE_MAX_COUNTERS) { trace_dropped++; return; }
    trace_counters++;
    FILE *f = trace_file;
    fprintf(f, ",\n{\"name\":\"memory %s\",\"cat\":\"memory\",\"ph\":\"C\",\"ts\":%.3f,\"pid\":1,\"tid\":%d,"
               "\"args\":{\"allocated\":%llu,\"reserved\":%llu",
            d->name, trace_us(t), kiln_thread_id(), (unsigned long long)s->allocated,
            (unsigned long long)s->reserved);
    if (s->budget) fprintf(f, ",\"budget\":%llu", (unsigned long long)s->budget);
    fputs("}}", f);
}

void kiln_trace_counters(kiln_device *dev)
{
    if (!atomic_load(&trace_on)) return;
    int n = dev ? 1 : kiln_device_count();
    for (int i = 0; i < n; i++) {
        kiln_device *d = dev ? dev : kiln_device_at(i);
        kiln_mem_stats s = kiln_allocator_stats(d->alloc);
        double t = kiln_events_now();
        pthread_mutex_lock(&ev_mu);
        if (trace_file) trace_counter_locked(d, &s, t);
        pthread_mutex_unlock(&ev_mu);
    }
}

void kiln_trace_span(const char *name, const char *category, double start, double end,
                     const char *args_json)
{
    if (!atomic_load(&trace_on)) return;
    int tid = kiln_thread_id();
    pthread_mutex_lock(&ev_mu);
    if (trace_file) {
        FILE *f = trace_file;
        if (start < trace_t0) start = trace_t0; /* a span begun before the trace */
        fputs(",\n{\"name\":", f);
        json_string(f, name ? name : "?");
        fputs(",\"cat\":", f);
        json_string(f, category ? category : "span");
        fprintf(f, ",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":1,\"tid\":%d", trace_us(start),
                end > start ? (end - start) * 1e6 : 0.0, tid);
        if (args_json && *args_json) fprintf(f, ",\"args\":{%s}", args_json);
        fputc('}', f);
    }
    pthread_mutex_unlock(&ev_mu);
}

int kiln_trace_active(void) { return atomic_load(&trace_on); }

kiln_status kiln_trace_start(const char *path)
{
    if (!path || !*path) return kiln_error(KILN_ERR_ARG, "trace.start: a file name is required");
    kiln_thread_id(); /* the starting thread is usually the main one: give it a low id */
    pthread_mutex_lock(&ev_mu);
    if (trace_file) {
        kiln_status st = kiln_error(KILN_ERR_STATE, "trace.start: a trace is already being written to %s", trace_path);
        pthread_mutex_unlock(&ev_mu);
        return st;
    }
    size_t n = strlen(path);
    char *dst = malloc(n + 1);
    if (!dst) {
        pthread_mutex_unlock(&ev_mu);
        return kiln_error(KILN_ERR_OOM, "trace.start: out of host memory");
    }
    memcpy(dst, path, n + 1);
    /* the events stream through stdio into the atomic file's temporary: a trace that
     * cannot be finished never replaces an earlier one */
    kiln_status st = kiln_atomic_file_open(&trace_af, dst);
    int fd = st == KILN_OK ? dup(trace_af.fd) : -1;
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        int err = errno;
        if (fd >= 0) close(fd);
        kiln_atomic_file_abort(&trace_af);
        free(dst);
        pthread_mutex_unlock(&ev_mu);
        return st != KILN_OK ? kiln_error(st, "trace.start: %s", kiln_last_error())
                             : kiln_error(KILN_ERR_IO, "trace.start: cannot create %s: %s", path, strerror(err));
    }
    trace_file = f;
    trace_path = dst;
    trace_t0 = kiln_events_now();
    trace_counters = trace_dropped = 0;
    fputs("{\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"tid\":0,\"args\":{\"name\":\"kiln\"}}", f);
    atomic_store(&trace_on, 1);
    pthread_mutex_unlock(&ev_mu);
    kiln_trace_counters(NULL); /* the starting point of every device's counters */
    return KILN_OK;
}

kiln_status kiln_trace_stop(void)
{
    kiln_trace_counters(NULL);
    pthread_mutex_lock(&ev_mu);
    if (!trace_file) {
        pthread_mutex_unlock(&ev_mu);
        return kiln_error(KILN_ERR_STATE, "trace.stop: no trace is running");
    }
    atomic_store(&trace_on, 0);
    FILE *f = trace_file;
    for (int i = 0; i < n_thread_names; i++) {
        fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":", thread_names[i].tid);
        json_string(f, thread_names[i].name);
        fputs("}}", f);
    }
    fprintf(f, "\n],\n\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"kiln\",\"dropped_counter_samples\":%llu}}\n",
            (unsigned long long)trace_dropped);
    int bad = ferror(f) || fflush(f) != 0;
    bad |= fclose(f) != 0;
    int err = errno;
    kiln_status st = KILN_OK;
    if (bad) {
        kiln_atomic_file_abort(&trace_af);
        st = kiln_error(KILN_ERR_IO, "trace.stop: cannot write %s: %s", trace_path, strerror(err));
    } else if ((st = kiln_atomic_file_commit(&trace_af)) != KILN_OK) {
        st = kiln_error(st, "trace.stop: %s", kiln_last_error());
    }
    free(trace_path);
    trace_path = NULL;
    trace_file = NULL;
    pthread_mutex_unlock(&ev_mu);
    return st;
}

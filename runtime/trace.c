/* trace.c - the Chrome trace writer, above the devices.
 * layer 4 of the memory core: uses events, alloc, device; never calls tensor.
 * While a trace runs it is the event log's listener: each event is written as it is
 * recorded, and each change of a device's memory samples that device's counters. Its
 * mutex guards the file; it is a leaf lock (counter samples read the allocator's
 * statistics before taking it). */
#define _GNU_SOURCE
#include "trace.h"
#include "events.h"
#include "atomic_file.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Counter samples beyond this many trace records are dropped (a runaway loop of
 * small allocations must not fill the disk); events and spans are always kept. */
#define TRACE_MAX_COUNTERS 4000000u
#define MAX_THREAD_NAMES 64

/* under trace_mu; trace_on is read without it as a fast path */
static pthread_mutex_t trace_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int trace_on;
static FILE *trace_file;
static char *trace_path;       /* the target, owned here (the atomic file borrows it) */
static kiln_atomic_file trace_af; /* the temporary the trace streams into until stop */
static double trace_t0;
static uint64_t trace_counters, trace_dropped;

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
        pthread_mutex_lock(&trace_mu);
        if (trace_file) trace_counter_locked(d, &s, t);
        pthread_mutex_unlock(&trace_mu);
    }
}

/* The event log's listener while a trace runs: the event (if any) into the file, then
 * the counters of the device it names (during a dry run meta answers to the modelled
 * device's name and is listed last, so the last match is the one meant). */
static void on_event(const kiln_event *e, const char *device)
{
    if (!atomic_load(&trace_on)) return;
    if (e) {
        pthread_mutex_lock(&trace_mu);
        if (trace_file) trace_write_event(e);
        pthread_mutex_unlock(&trace_mu);
    }
    if (!device || !*device) return;
    kiln_device *d = NULL;
    for (int i = 0; i < kiln_device_count(); i++)
        if (strcmp(kiln_device_at(i)->name, device) == 0) d = kiln_device_at(i);
    if (d) kiln_trace_counters(d);
}

void kiln_trace_span(const char *name, const char *category, double start, double end,
                     const char *args_json)
{
    if (!atomic_load(&trace_on)) return;
    int tid = kiln_thread_id();
    pthread_mutex_lock(&trace_mu);
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
    pthread_mutex_unlock(&trace_mu);
}

int kiln_trace_active(void) { return atomic_load(&trace_on); }

kiln_status kiln_trace_start(const char *path)
{
    if (!path || !*path) return kiln_error(KILN_ERR_ARG, "trace.start: a file name is required");
    kiln_thread_id(); /* the starting thread is usually the main one: give it a low id */
    pthread_mutex_lock(&trace_mu);
    if (trace_file) {
        kiln_status st = kiln_error(KILN_ERR_STATE, "trace.start: a trace is already being written to %s", trace_path);
        pthread_mutex_unlock(&trace_mu);
        return st;
    }
    size_t n = strlen(path);
    char *dst = malloc(n + 1);
    if (!dst) {
        pthread_mutex_unlock(&trace_mu);
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
        pthread_mutex_unlock(&trace_mu);
        return st != KILN_OK ? kiln_error(st, "trace.start: %s", kiln_last_error())
                             : kiln_error(KILN_ERR_IO, "trace.start: cannot create %s: %s", path, strerror(err));
    }
    trace_file = f;
    trace_path = dst;
    trace_t0 = kiln_events_now();
    trace_counters = trace_dropped = 0;
    fputs("{\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":1,\"tid\":0,\"args\":{\"name\":\"kiln\"}}", f);
    atomic_store(&trace_on, 1);
    kiln_events_set_listener(on_event);
    pthread_mutex_unlock(&trace_mu);
    kiln_trace_counters(NULL); /* the starting point of every device's counters */
    return KILN_OK;
}

kiln_status kiln_trace_stop(void)
{
    kiln_trace_counters(NULL);
    kiln_thread_name names[MAX_THREAD_NAMES];
    int n_names = kiln_thread_names(names, MAX_THREAD_NAMES);
    pthread_mutex_lock(&trace_mu);
    if (!trace_file) {
        pthread_mutex_unlock(&trace_mu);
        return kiln_error(KILN_ERR_STATE, "trace.stop: no trace is running");
    }
    atomic_store(&trace_on, 0);
    kiln_events_set_listener(NULL);
    FILE *f = trace_file;
    for (int i = 0; i < n_names; i++) {
        fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%d,\"args\":{\"name\":", names[i].tid);
        json_string(f, names[i].name);
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
    pthread_mutex_unlock(&trace_mu);
    return st;
}

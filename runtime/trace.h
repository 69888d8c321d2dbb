/* trace.h - the trace writer: while a trace runs, the memory events, per-device memory
 * counters and named spans stream to a Chrome trace JSON file (the "traceEvents"
 * format that Perfetto and chrome://tracing open), renamed into place at stop.
 * layer 4 of the memory core: uses events, alloc, device; never calls tensor.
 * It sits above the devices and subscribes to the event log (kiln_events_set_listener),
 * so the layers below record events without knowing a trace exists. Thread-safe. */
#ifndef KILN_TRACE_H
#define KILN_TRACE_H

#include "device.h"

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

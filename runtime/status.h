/* status.h - error values of the kiln core.
 * C functions return a kiln_status; the message lives in a thread-local buffer
 * (kiln_last_error) so the core never prints, exits or longjmps. */
#ifndef KILN_STATUS_H
#define KILN_STATUS_H

#include <stddef.h>
#include <stdint.h>

/* kiln_status and KILN_API are defined once, in the public header: a host that has
 * only kiln.h installed sees the same values the core returns. The header is plain
 * C (no Lua), so the core stays usable without Lua. */
#include "../bindings/kiln.h"

#if defined(__GNUC__)
#define KILN_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KILN_PRINTF(a, b)
#endif

/* Details of the last KILN_ERR_OOM on this thread. */
typedef struct {
    char device[32];
    uint64_t requested, free, budget;
} kiln_oom_info;

/* Sets this thread's message (printf-style) and returns code, so callers write
 * `return kiln_error(KILN_ERR_ARG, "conv2d: ...")`. */
kiln_status kiln_error(kiln_status code, const char *fmt, ...) KILN_PRINTF(2, 3);
const char *kiln_last_error(void);
kiln_status kiln_last_status(void);
/* "ok", "argument", ..., "cancelled" (kiln.h's ORDER STATUS); "unknown" past them. */
const char *kiln_status_name(kiln_status s);
const kiln_oom_info *kiln_last_oom(void);
/* Records OOM details and sets the message; returns KILN_ERR_OOM. */
kiln_status kiln_error_oom(const char *device, uint64_t requested, uint64_t free,
                           uint64_t budget, const char *fmt, ...) KILN_PRINTF(5, 6);

#endif

/* status.h - error values of the kiln core.
 * C functions return a kiln_status; the message lives in a thread-local buffer
 * (kiln_last_error) so the core never prints, exits or longjmps. */
#ifndef KILN_STATUS_H
#define KILN_STATUS_H

#include <stddef.h>
#include <stdint.h>

/* kiln_status and kiln_oom_info are defined once, in kiln_status.h, which the public
 * kiln.h includes: a host sees the same values the core returns, and the core needs
 * nothing from bindings/. */
#include "kiln_status.h"

#if defined(__GNUC__)
#define KILN_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KILN_PRINTF(a, b)
#endif

/* Sets this thread's message (printf-style) and returns code, so callers write
 * `return kiln_error(KILN_ERR_ARG, "conv2d: ...")`. */
kiln_status kiln_error(kiln_status code, const char *fmt, ...) KILN_PRINTF(2, 3);
const char *kiln_last_error(void);
kiln_status kiln_last_status(void);
/* "ok", "argument", ..., "cancelled" (kiln_status.h's ORDER STATUS); "unknown" past them. */
const char *kiln_status_name(kiln_status s);
/* Details of the last KILN_ERR_OOM on this thread. */
const kiln_oom_info *kiln_last_oom(void);
/* Records OOM details and sets the message; returns KILN_ERR_OOM. */
kiln_status kiln_error_oom(const char *device, uint64_t requested, uint64_t free,
                           uint64_t budget, const char *fmt, ...) KILN_PRINTF(5, 6);

#endif

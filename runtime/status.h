/* status.h - error values of the kiln core.
 * C functions return a kiln_status; the message lives in a thread-local buffer
 * (kiln_last_error) so the core never prints, exits or longjmps. */
#ifndef KILN_STATUS_H
#define KILN_STATUS_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define KILN_API __attribute__((visibility("default")))
#define KILN_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define KILN_API
#define KILN_PRINTF(a, b)
#endif

/* ORDER STATUS: keep kiln_status_names in status.c in this order */
typedef enum {
    KILN_OK = 0,
    KILN_ERR_ARG,         /* bad argument: shape, dtype, value */
    KILN_ERR_IO,          /* file system */
    KILN_ERR_FORMAT,      /* malformed file */
    KILN_ERR_OOM,         /* allocation does not fit the budget (see kiln_oom_info) */
    KILN_ERR_UNSUPPORTED, /* op/dtype/device not supported by a backend */
    KILN_ERR_STATE,       /* object used in the wrong state (freed, closed) */
    KILN_ERR_CANCELLED,   /* stopped by a cancel request */
    KILN_STATUS_COUNT
} kiln_status;

/* Details of the last KILN_ERR_OOM on this thread. */
typedef struct {
    char device[32];
    uint64_t requested, free, budget;
} kiln_oom_info;

/* Sets this thread's message (printf-style) and returns code, so callers write
 * `return kiln_error(KILN_ERR_ARG, "conv2d: ...")`. */
KILN_API kiln_status kiln_error(kiln_status code, const char *fmt, ...) KILN_PRINTF(2, 3);
KILN_API const char *kiln_last_error(void);
KILN_API kiln_status kiln_last_status(void);
KILN_API const char *kiln_status_name(kiln_status s);
KILN_API const kiln_oom_info *kiln_last_oom(void);
/* Records OOM details and sets the message; returns KILN_ERR_OOM. */
KILN_API kiln_status kiln_error_oom(const char *device, uint64_t requested, uint64_t free,
                                    uint64_t budget, const char *fmt, ...) KILN_PRINTF(5, 6);

#endif

/* status.c - the thread-local error message and OOM details behind kiln_status. */
#include "status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char tl_msg[1024];
static _Thread_local kiln_status tl_status;
static _Thread_local kiln_oom_info tl_oom;

/* kiln_status.h's codes: hosts store and compare KILN_ERR_SCRIPT's value, so it stays 64,
 * clear of the core's own codes. */
_Static_assert(KILN_ERR_SCRIPT == 64 && KILN_STATUS_COUNT < KILN_ERR_SCRIPT, "kiln_status values");

/* ORDER STATUS (kiln_status.h) */
static const char *const status_names[KILN_STATUS_COUNT] = {
    "ok", "argument", "io", "format", "oom", "unsupported", "state", "cancelled",
};

const char *kiln_status_name(kiln_status s)
{
    return (unsigned)s < KILN_STATUS_COUNT ? status_names[s] : "unknown";
}

kiln_status kiln_error(kiln_status code, const char *fmt, ...)
{
    /* formatted aside first: the arguments may include kiln_last_error() itself, to
     * prefix what a callee reported */
    char buf[sizeof tl_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memcpy(tl_msg, buf, sizeof buf);
    tl_status = code;
    return code;
}

kiln_status kiln_error_oom(const char *device, uint64_t requested, uint64_t free,
                           uint64_t budget, const char *fmt, ...)
{
    snprintf(tl_oom.device, sizeof tl_oom.device, "%s", device ? device : "?");
    tl_oom.requested = requested;
    tl_oom.free = free;
    tl_oom.budget = budget;
    char buf[sizeof tl_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memcpy(tl_msg, buf, sizeof buf);
    tl_status = KILN_ERR_OOM;
    return KILN_ERR_OOM;
}

const char *kiln_last_error(void) { return tl_msg; }
kiln_status kiln_last_status(void) { return tl_status; }
const kiln_oom_info *kiln_last_oom(void) { return &tl_oom; }

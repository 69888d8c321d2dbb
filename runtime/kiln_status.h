/* kiln_status.h - what the core and its hosts share: the status codes every kiln
 * function returns and the details of an out-of-memory failure. Plain C, no Lua; the
 * core includes it (runtime/status.h), and `make install` puts it beside kiln.h, which
 * includes it: the one public header stays kiln.h. */
#ifndef KILN_STATUS_CODES_H
#define KILN_STATUS_CODES_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The one definition of the status codes: the core returns these values inside and
 * kiln.h's functions return them to hosts (the core's status names follow this
 * order). ORDER STATUS */
typedef enum {
    KILN_OK = 0,
    KILN_ERR_ARG,         /* bad argument: an image, a config field, a name, a shape, a dtype */
    KILN_ERR_IO,          /* file system: a script or image that cannot be read or written */
    KILN_ERR_FORMAT,      /* malformed file */
    KILN_ERR_OOM,         /* out of memory: an allocation that does not fit a device's budget */
    KILN_ERR_UNSUPPORTED, /* op, dtype or device not supported; a library of another version */
    KILN_ERR_STATE,       /* used in the wrong state: busy in a callback, freed, closed */
    KILN_ERR_CANCELLED,   /* stopped by kiln_cancel (or the script's kiln.cancel) */
    KILN_STATUS_COUNT,
    KILN_ERR_SCRIPT = 64  /* the script raised an error (syntax or run time): see the message */
} kiln_status;

/* An allocation that did not fit (KILN_ERR_OOM): the core records one per thread,
 * a host reads the last of a context with kiln_memory_last_oom. */
typedef struct {
    char device[32];    /* "cpu", "sim", "cuda:0"; "lua" when Lua's own allocator failed */
    uint64_t requested; /* bytes asked for */
    uint64_t free;      /* bytes the device could still give at that moment */
    uint64_t budget;    /* the device's budget then; 0 = unlimited */
} kiln_oom_info;

#ifdef __cplusplus
}
#endif

#endif /* KILN_STATUS_CODES_H */

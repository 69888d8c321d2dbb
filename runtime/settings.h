/* settings.h - the runtime's settings (trace, threads, device, memory mode, budget,
 * precision) as one struct and the one function that checks and applies them: kiln_open
 * (kiln_config), kiln.configure, kiln.mem.set_budget and kiln_memory_set_budget all come
 * here, and a refusal names its field as data (a kiln_setting), never in text to parse.
 * It sits above the device, allocator, model and trace modules it sets. */
#ifndef KILN_SETTINGS_H
#define KILN_SETTINGS_H

#include "status.h"

#include <stdint.h>

/* ORDER SETTINGS: the order kiln_settings_apply applies them in (the trace first, so
 * that what the others do is traced); setting_names in settings.c follows it */
typedef enum {
    KILN_SETTING_NONE = 0,
    KILN_SETTING_TRACE,     /* start (a file) or stop (NULL) the trace */
    KILN_SETTING_THREADS,   /* CPU threads, 0 (one per core, or KILN_THREADS) to 256 */
    KILN_SETTING_DEVICE,    /* the device the budget is for (and the fronts' default device) */
    KILN_SETTING_MODE,      /* memory mode: high, normal, low, none; "auto": left to the planner */
    KILN_SETTING_BUDGET,    /* bytes of the device's budget, 0 = unlimited */
    KILN_SETTING_PRECISION, /* f32, bf16, f16; "auto": each device's own */
    KILN_SETTING_COUNT
} kiln_setting;

#define KILN_SETTING_BIT(s) (1u << (s))

typedef struct {
    unsigned given;        /* KILN_SETTING_BIT of each field set; the others stay as they are */
    const char *trace;     /* file to trace to; NULL: stop the running trace */
    int threads;
    const char *device;    /* NULL: "cpu" */
    const char *mode;
    uint64_t budget;
    int budget_live;       /* nonzero: a change from another thread while a run goes on
                              (kiln_allocator_set_budget_live) */
    const char *precision;
} kiln_settings;

/* Checks every given field, then applies them in ORDER SETTINGS. A refusal is
 * KILN_ERR_ARG, whatever its cause (a trace file that cannot be created too). On
 * failure nothing
 * was changed when the check refused (a name, a range), and the fields before it when
 * applying failed (a trace file that cannot be created); the message (kiln_last_error)
 * is the reason alone ("unknown memory mode 'turbo' (expected one of: ...)") and
 * *failed (may be NULL) the field. */
kiln_status kiln_settings_apply(const kiln_settings *s, kiln_setting *failed);
/* The check alone. */
kiln_status kiln_settings_check(const kiln_settings *s, kiln_setting *failed);
/* "trace", "threads", "device", "mode", "budget", "precision" (kiln.configure's field
 * names); "" for KILN_SETTING_NONE. */
const char *kiln_setting_name(kiln_setting s);

#endif

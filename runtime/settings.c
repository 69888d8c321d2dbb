/* settings.c - checks and applies the runtime settings (settings.h): the one route
 * from kiln_config, kiln.configure and the budget setters to the allocator, the
 * thread pool, the memory mode, the precision and the trace. */
#include "settings.h"
#include "trace.h"
#include "alloc.h"
#include "device.h"
#include "events.h"
#include "model.h"
#include "precision.h"

#include <stdio.h>
#include <string.h>

#define MAX_THREADS 256 /* as the pool's own limit */

/* ORDER SETTINGS */
static const char *const setting_names[KILN_SETTING_COUNT] = {
    "", "trace", "threads", "device", "mode", "budget", "precision",
};

const char *kiln_setting_name(kiln_setting s)
{
    return (unsigned)s < KILN_SETTING_COUNT ? setting_names[s] : "";
}

/* A refused setting is the caller's mistake whatever the cause (a trace file that
 * cannot be created included): KILN_ERR_ARG, the reason in the message. */
static kiln_status refuse(kiln_setting s, kiln_setting *failed)
{
    if (failed) *failed = s;
    return KILN_ERR_ARG;
}

static int given(const kiln_settings *s, kiln_setting f)
{
    return (s->given & KILN_SETTING_BIT(f)) != 0;
}

kiln_status kiln_settings_check(const kiln_settings *s, kiln_setting *failed)
{
    if (failed) *failed = KILN_SETTING_NONE;
    if (given(s, KILN_SETTING_THREADS) && (s->threads < 0 || s->threads > MAX_THREADS)) {
        kiln_error(KILN_ERR_ARG, "%d is out of range (0 = one per core, up to %d)", s->threads, MAX_THREADS);
        return refuse(KILN_SETTING_THREADS, failed);
    }
    if (given(s, KILN_SETTING_DEVICE) || given(s, KILN_SETTING_BUDGET)) {
        /* kiln_device_get's message lists the devices present */
        if (!kiln_device_get(s->device ? s->device : "cpu")) return refuse(KILN_SETTING_DEVICE, failed);
    }
    if (given(s, KILN_SETTING_MODE)) {
        const char *m = s->mode ? s->mode : "";
        if (strcmp(m, "auto") != 0 && kiln_memory_mode_from_name(m) < 0) {
            char list[128] = "";
            for (int i = 0; i < KILN_MEM_MODE_COUNT; i++) {
                strncat(list, kiln_memory_mode_name((kiln_memory_mode)i), sizeof list - strlen(list) - 1);
                strncat(list, ", ", sizeof list - strlen(list) - 1);
            }
            kiln_error(KILN_ERR_ARG, "unknown memory mode '%.64s' (expected one of: %sauto)", m, list);
            return refuse(KILN_SETTING_MODE, failed);
        }
    }
    if (given(s, KILN_SETTING_BUDGET) && s->budget > (uint64_t)INT64_MAX) {
        kiln_error(KILN_ERR_ARG, "%llu bytes is too large", (unsigned long long)s->budget);
        return refuse(KILN_SETTING_BUDGET, failed);
    }
    if (given(s, KILN_SETTING_PRECISION)) {
        const char *p = s->precision ? s->precision : "";
        if (strcmp(p, "auto") != 0 && kiln_precision_from_name(p) < 0) {
            kiln_error(KILN_ERR_ARG, "invalid precision '%.64s' (expected f32, bf16, f16 or auto)", p);
            return refuse(KILN_SETTING_PRECISION, failed);
        }
    }
    return KILN_OK;
}

kiln_status kiln_settings_apply(const kiln_settings *s, kiln_setting *failed)
{
    kiln_status st = kiln_settings_check(s, failed);
    if (st != KILN_OK) return st;
    if (given(s, KILN_SETTING_TRACE)) {
        if (s->trace) st = kiln_trace_start(s->trace);
        else if (kiln_trace_active()) st = kiln_trace_stop();
        if (st != KILN_OK) return refuse(KILN_SETTING_TRACE, failed);
    }
    if (given(s, KILN_SETTING_THREADS)) kiln_set_threads(s->threads);
    if (given(s, KILN_SETTING_MODE) && strcmp(s->mode, "auto") != 0)
        kiln_memory_mode_set((kiln_memory_mode)kiln_memory_mode_from_name(s->mode));
    if (given(s, KILN_SETTING_BUDGET)) {
        kiln_device *d = kiln_device_get(s->device ? s->device : "cpu");
        if (s->budget_live) kiln_allocator_set_budget_live(d->alloc, s->budget);
        else kiln_allocator_set_budget(d->alloc, s->budget);
    }
    if (given(s, KILN_SETTING_PRECISION)) {
        int p = kiln_precision_from_name(s->precision);
        if (p >= 0) kiln_precision_set((kiln_precision)p);
        else kiln_precision_unset(); /* "auto" */
    }
    return KILN_OK;
}

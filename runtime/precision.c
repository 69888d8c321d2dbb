/* precision.c - see precision.h. Plain atomics: kernels read the setting from the
 * compute pool's threads while a script may change it between ops. A scope is a
 * thread-local int, read before the atomics (nothing to synchronise: one thread). */
#include "precision.h"
#include "meta.h"

#include <stdatomic.h>
#include <string.h>

/* -1 while none is set */
static atomic_int set_prec = -1;
/* by kiln_device_type; room for types added after the three known today */
enum { MAX_TYPES = 8 };
static atomic_int type_default[MAX_TYPES];   /* 0 = KILN_PREC_F32 */

static const char *const names[] = {"f32", "bf16", "f16", "int8"}; /* ORDER PRECISION */

/* this thread's override; KILN_PREC_SCOPE_NONE outside any scope */
static _Thread_local int tl_scope = KILN_PREC_SCOPE_NONE;

static int valid(int p) { return p >= 0 && p <= KILN_PREC_INT8; }

int kiln_precision_scope_begin(int p)
{
    int prev = tl_scope;
    if (valid(p) || p == KILN_PREC_SCOPE_NONE) tl_scope = p;
    return prev;
}

void kiln_precision_scope_end(int token)
{
    if (valid(token) || token == KILN_PREC_SCOPE_NONE) tl_scope = token;
}

int kiln_precision_scope_current(void) { return tl_scope; }

kiln_precision kiln_precision_get(void)
{
    if (tl_scope >= 0) return (kiln_precision)tl_scope;
    int p = atomic_load_explicit(&set_prec, memory_order_relaxed);
    return p < 0 ? kiln_precision_for_type(KILN_DEV_CPU) : (kiln_precision)p;
}

void kiln_precision_set(kiln_precision p)
{
    if ((int)p < 0 || (int)p > KILN_PREC_INT8) return;
    atomic_store_explicit(&set_prec, (int)p, memory_order_relaxed);
}

const char *kiln_precision_name(kiln_precision p)
{
    return (int)p >= 0 && (int)p <= KILN_PREC_INT8 ? names[p] : "?";
}

int kiln_precision_from_name(const char *name)
{
    if (!name) return -1;
    for (int i = 0; i <= KILN_PREC_INT8; i++)
        if (!strcmp(name, names[i])) return i;
    return -1;
}

kiln_precision kiln_precision_for_type(kiln_device_type t)
{
    if (tl_scope >= 0) return (kiln_precision)tl_scope;
    int p = atomic_load_explicit(&set_prec, memory_order_relaxed);
    if (p >= 0) return (kiln_precision)p;
    if ((int)t < 0 || (int)t >= MAX_TYPES) return KILN_PREC_F32;
    return (kiln_precision)atomic_load_explicit(&type_default[t], memory_order_relaxed);
}

kiln_precision kiln_precision_for(const kiln_device *dev)
{
    /* a dry run's meta answers as the device it models */
    if (dev && dev->type == KILN_DEV_META && kiln_meta_target()) dev = kiln_meta_target();
    return kiln_precision_for_type(dev ? dev->type : KILN_DEV_CPU);
}

int kiln_precision_is_set(void) { return atomic_load_explicit(&set_prec, memory_order_relaxed) >= 0; }

void kiln_precision_unset(void) { atomic_store_explicit(&set_prec, -1, memory_order_relaxed); }

void kiln_precision_set_default(kiln_device_type t, kiln_precision p)
{
    if ((int)t < 0 || (int)t >= MAX_TYPES || (int)p < 0 || (int)p > KILN_PREC_INT8) return;
    atomic_store_explicit(&type_default[t], (int)p, memory_order_relaxed);
}

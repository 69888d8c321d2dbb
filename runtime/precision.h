/* precision.h - the arithmetic the networks run in: f32, bf16, f16 or int8 (the CPU's
 * W8A8 linear layers where AVX512-VNNI runs them, bf16 for the rest). One process-wide
 * setting (kiln.precision, --precision) chosen by the user, or, while none is set, each
 * device type's default (the CPU's f32; a GPU backend registers its own at start); a
 * thread may override both for itself (a scope: kiln.with_precision, the previews).
 * Backends read it through kiln_precision_for when they choose a kernel. */
#ifndef KILN_PRECISION_H
#define KILN_PRECISION_H

#include "device.h"

/* ORDER PRECISION */
typedef enum { KILN_PREC_F32 = 0, KILN_PREC_BF16, KILN_PREC_F16, KILN_PREC_INT8 } kiln_precision;

/* The calling thread's scoped precision if it has one, else the precision set by
 * kiln_precision_set; while none is set, the CPU's default (f32). */
kiln_precision kiln_precision_get(void);
void kiln_precision_set(kiln_precision p);
/* "f32", "bf16", "f16", "int8" ("?" past them). */
const char *kiln_precision_name(kiln_precision p);
/* The precision named (as kiln_precision_name writes it), -1 for any other string. */
int kiln_precision_from_name(const char *name);

/* What the networks on dev compute in: the calling thread's scoped precision, else the
 * set precision, or while none is set the default of dev's type. dev NULL means the
 * host (the CPU backend, which also runs the sim device's kernels). Thread-safe. */
kiln_precision kiln_precision_for(const kiln_device *dev);
kiln_precision kiln_precision_for_type(kiln_device_type t);
/* 1 once kiln_precision_set has been called (and not undone by kiln_precision_unset);
 * a scope does not count: this is about the process-wide setting. */
int kiln_precision_is_set(void);
/* Forgets the set precision: every device goes back to its type's default. */
void kiln_precision_unset(void);
/* A backend's default for its device type (e.g. the CUDA backend at start, from what
 * its cards do best); f32 for every type until one is registered. */
void kiln_precision_set_default(kiln_device_type t, kiln_precision p);

/* ---- a scope: the precision of the calling thread only ----
 * kiln_precision_scope_begin(p) makes the calling thread compute in p (a kiln_precision,
 * on every device type), winning over kiln_precision_set and the types' defaults, while
 * other threads keep theirs; so one part of a run (the previews) can take a cheaper
 * arithmetic without switching the user's whole run. p = KILN_PREC_SCOPE_NONE opens a
 * scope without an override (the process-wide answer again, "auto"); any other value
 * outside the enum changes nothing. It returns a token, the override it replaced
 * (a kiln_precision or KILN_PREC_SCOPE_NONE), which kiln_precision_scope_end(token)
 * puts back: scopes nest when ended in the reverse order of their beginnings.
 * kiln_parallel_for (the CPU pool) runs each job's chunks under the submitting
 * thread's override, so a kernel reading the precision in a worker sees the caller's. */
#define KILN_PREC_SCOPE_NONE (-1)
int kiln_precision_scope_begin(int p);
void kiln_precision_scope_end(int token);
/* The calling thread's override: a kiln_precision, or KILN_PREC_SCOPE_NONE. */
int kiln_precision_scope_current(void);

#endif

/* suspend.h - parking a run: every byte a device holds moved to host memory and
 * back (kiln_suspend_park / unpark), and the gate through which a host thread asks a
 * running job to park at its next suspend point and lets it go on (kiln_gate_*).
 * A storage keeps its identity while parked: tensors and models that reference it
 * see the same object, whose bytes live in the cpu allocator until unpark. */
#ifndef KILN_SUSPEND_H
#define KILN_SUSPEND_H

#include "device.h"

/* ---- moving a device's bytes to the host and back ---- */

typedef struct kiln_parked kiln_parked;

/* Waits for the model copy threads, then, for every sim / cuda device: copies each
 * live storage of its allocator to a block of the cpu allocator, frees the device
 * block and empties the device's cache and backend workspace, so its reserved bytes
 * fall to what other threads still hold (none when the caller is the only user). The
 * caller's thread must be the only one computing on those devices until unpark.
 * A parked storage freed by its last owner frees its host block. On failure (host
 * memory) everything parked so far is brought back and *out is NULL. */
kiln_status kiln_suspend_park(kiln_parked **out);
/* Brings every parked storage back to its device (new blocks: a storage's data
 * pointer may change) and frees p. On KILN_ERR_OOM (the device's budget or memory no
 * longer has room) the storages not brought back stay on the host, computing with
 * them is an error of the caller, and freeing them is fine. NULL is fine. */
kiln_status kiln_suspend_unpark(kiln_parked *p);
/* Bytes parked (the storages' sizes). */
uint64_t kiln_parked_bytes(const kiln_parked *p);

/* ---- the gate between a host thread and a running job ---- */

typedef struct kiln_gate kiln_gate;

typedef struct {
    uint64_t parks;           /* times parked */
    uint64_t bytes;           /* bytes moved to the host at the last park */
    double park_seconds;      /* last park: from kiln_gate_suspend to parked */
    double resume_seconds;    /* last resume: from kiln_gate_resume to running again */
} kiln_gate_stats;

kiln_gate *kiln_gate_new(void);
void kiln_gate_free(kiln_gate *g);

/* The job's thread: a call starts / ends. Leaving wakes a host waiting in
 * kiln_gate_suspend (the call ended before it parked). */
void kiln_gate_enter(kiln_gate *g);
void kiln_gate_leave(kiln_gate *g);

/* Any thread. Asks the running call to park and waits until it has (KILN_OK), or
 * until it ends first or no call is running (KILN_ERR_STATE), or parking failed (its
 * status). */
kiln_status kiln_gate_suspend(kiln_gate *g);
/* Any thread. Lets a parked call go on and waits until its bytes are back (the
 * status of bringing them back: KILN_ERR_OOM when the budget no longer has room, and
 * the call then fails with it); withdraws a request not yet served. KILN_OK when
 * nothing was parked. */
kiln_status kiln_gate_resume(kiln_gate *g);
/* Any thread: a parked call looks at its stop function again (a cancel). */
void kiln_gate_wake(kiln_gate *g);
/* Cheap: is a park asked? (the job's suspend points poll it) */
int kiln_gate_requested(kiln_gate *g);
/* 1 while parked. */
int kiln_gate_parked(kiln_gate *g);

/* The job's thread, at a suspend point: when a park is asked, parks (kiln_suspend_park),
 * tells the host, waits for kiln_gate_resume or for stop(ud) to return nonzero, brings
 * the bytes back. KILN_OK: go on; KILN_ERR_CANCELLED: stop said so (the bytes are back
 * first, so what the run holds is usable while it unwinds); else the unpark's error. */
kiln_status kiln_gate_point(kiln_gate *g, int (*stop)(void *ud), void *ud);

kiln_gate_stats kiln_gate_get_stats(kiln_gate *g);

#endif

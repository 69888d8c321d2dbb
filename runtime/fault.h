/* fault.h - fault injection for tests: the N-th allocation through any kiln allocator
 * (host and devices) or the N-th write of an atomic file fails as if memory or disk
 * had run out, so a test can walk every failure point of a workflow and check that
 * each ends in a clean error (or a recovered OOM) and gives every byte back. Off
 * unless armed; the counters are process-wide. */
#ifndef KILN_FAULT_H
#define KILN_FAULT_H

#include <stdint.h>

/* ORDER FAULT: keep fault_names in fault.c in this order */
typedef enum { KILN_FAULT_ALLOC = 0, KILN_FAULT_WRITE, KILN_FAULT_COUNT } kiln_fault_kind;

/* Counts from zero again; n >= 1 makes the n-th event of that kind from now fail
 * (once), n = 0 disarms. */
void kiln_fault_arm(kiln_fault_kind kind, int64_t n);
/* Events of that kind since the last arm. */
int64_t kiln_fault_count(kiln_fault_kind kind);
/* At a failure point: counts the event; 1 when it is the armed one (then disarmed). */
int kiln_fault_hit(kiln_fault_kind kind);
const char *kiln_fault_name(kiln_fault_kind kind);
/* "alloc" / "write" -> kind, -1 unknown */
int kiln_fault_from_name(const char *name);

#endif

/* fault.c - see fault.h. Relaxed atomics: the counts only need to be exact for the
 * thread that arms and runs a workflow; copy threads' allocations count too. */
#include "fault.h"

#include <stdatomic.h>
#include <string.h>

/* ORDER FAULT */
static const char *const fault_names[KILN_FAULT_COUNT] = {"alloc", "write"};

static atomic_int_fast64_t counts[KILN_FAULT_COUNT];
static atomic_int_fast64_t armed[KILN_FAULT_COUNT];   /* the failing event's number, 0 none */

void kiln_fault_arm(kiln_fault_kind kind, int64_t n)
{
    if ((unsigned)kind >= KILN_FAULT_COUNT) return;
    atomic_store_explicit(&armed[kind], n > 0 ? n : 0, memory_order_relaxed);
    atomic_store_explicit(&counts[kind], 0, memory_order_relaxed);
}

int64_t kiln_fault_count(kiln_fault_kind kind)
{
    if ((unsigned)kind >= KILN_FAULT_COUNT) return 0;
    return atomic_load_explicit(&counts[kind], memory_order_relaxed);
}

int kiln_fault_hit(kiln_fault_kind kind)
{
    int64_t n = atomic_fetch_add_explicit(&counts[kind], 1, memory_order_relaxed) + 1;
    int64_t a = atomic_load_explicit(&armed[kind], memory_order_relaxed);
    if (a == 0 || n != a) return 0;
    int_fast64_t expect = a;
    return atomic_compare_exchange_strong(&armed[kind], &expect, 0);
}

const char *kiln_fault_name(kiln_fault_kind kind)
{
    return (unsigned)kind < KILN_FAULT_COUNT ? fault_names[kind] : "?";
}

int kiln_fault_from_name(const char *name)
{
    for (int i = 0; i < KILN_FAULT_COUNT; i++)
        if (name && strcmp(name, fault_names[i]) == 0) return i;
    return -1;
}

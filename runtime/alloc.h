/* alloc.h - the memory manager of one device: a caching allocator with a budget.
 * Blocks come from the device's raw memory (malloc for cpu/sim, cudaMalloc for cuda)
 * in segments; freed blocks are kept, split and coalesced, and reused (size classes,
 * alignment >= 64 bytes). The budget caps *reserved* bytes (what the device really
 * holds). An allocation that does not fit first asks the eviction hook to free model
 * weights, then releases cached free segments, then runs the pressure hook (Lua GC),
 * and finally fails with KILN_ERR_OOM (kiln_error_oom). Thread-safe (one mutex).
 * layer 1 of the memory core: uses events; never calls mem_timeline, device, trace.
 * What frees memory above it (model eviction, the Lua GC) is reached through hooks. */
#ifndef KILN_ALLOC_H
#define KILN_ALLOC_H

#include "status.h"

#define KILN_ALLOC_ALIGN 64

typedef struct kiln_allocator kiln_allocator;

typedef struct {
    uint64_t allocated;       /* bytes handed out (rounded sizes) */
    uint64_t reserved;        /* bytes taken from the device (segments) */
    uint64_t peak_allocated;
    uint64_t peak_reserved;
    uint64_t n_allocs;        /* successful allocations since creation */
    uint64_t n_frees;
    uint64_t n_ooms;
    uint64_t n_segments;
    uint64_t largest_free;    /* largest free cached block */
    uint64_t budget;          /* 0 = unlimited */
    uint64_t workspace;       /* scratch the device's backend keeps between ops (0 from
                               * the allocator; kiln_device_stats fills it) */
    uint64_t workspace_peak;  /* the most kernel scratch outside the allocator in use at
                               * once since the last peak reset (kiln_device_stats) */
} kiln_mem_stats;

/* How the allocator obtains and returns device memory. raw_alloc returns NULL when
 * the device itself is out of memory. */
typedef struct {
    void *(*raw_alloc)(void *ctx, size_t nbytes);
    void (*raw_free)(void *ctx, void *ptr, size_t nbytes);
    void *ctx;
} kiln_raw_memory;

/* Eviction: asked to free at least `need` bytes of this device; returns bytes freed
 * (0 when nothing could be evicted). Called without the allocator's lock held. */
typedef size_t (*kiln_evict_fn)(void *ctx, kiln_allocator *a, size_t need);
/* Pressure: e.g. a full Lua GC; returns nonzero when it may have freed something. */
typedef int (*kiln_pressure_fn)(void *ctx);

/* caching = 0 gives a pass-through allocator (every free returns memory to the
 * device at once) with the same statistics and budget: used for the host. */
kiln_allocator *kiln_allocator_new(const char *device_name, kiln_raw_memory raw,
                                   uint64_t budget, int caching);
/* Frees all cached segments; live blocks are a bug reported by the return value
 * (number of bytes still allocated). */
uint64_t kiln_allocator_free(kiln_allocator *a);

kiln_status kiln_allocator_alloc(kiln_allocator *a, size_t nbytes, void **out);
void kiln_allocator_release(kiln_allocator *a, void *ptr);
/* The usable size of a live block (>= requested). */
size_t kiln_allocator_block_size(kiln_allocator *a, void *ptr);

/* Any thread, at any time. A budget lowered below what the device reserves gives back
 * the cached free segments at once; live blocks over it go as they are freed (a
 * segment left wholly free is returned), and the next allocation that does not fit
 * evicts and fails as usual. */
void kiln_allocator_set_budget(kiln_allocator *a, uint64_t budget);
/* The same for a budget changed while a run goes on, from another thread (a host's
 * kiln_memory_set_budget): a lowering starts a grace in which new segments may still
 * grow to the earlier budget, so the block in flight is not failed for a change it has
 * not yet seen; the run's next suspend point (kiln.suspend_point) adapts the running
 * networks (evict, stream, tile) and ends it, as does the start of the next call
 * (kiln_allocator_end_grace). Compliance is counted from there. */
void kiln_allocator_set_budget_live(kiln_allocator *a, uint64_t budget);

/* The last budget change as a run sees it (times on kiln_events_now's clock). */
typedef struct {
    uint64_t changes;         /* kiln_allocator_set_budget calls since creation */
    int grace;                /* 1: lowered live, allocations still use the old one */
    int over;                 /* reserved > budget now */
    double lowered_at;        /* the last change that lowered the budget; 0: none */
    double compliant_at;      /* when reserved was first within it, with no grace left;
                               * 0: not yet */
    uint64_t peak_since;      /* most bytes reserved from compliant_at on */
    uint64_t peak_before;     /* most bytes reserved (since reset_peak) when it was lowered:
                               * what the run needed so far, for the boundary's decision */
} kiln_budget_watch;
kiln_budget_watch kiln_allocator_budget_watch(kiln_allocator *a);
/* Ends a grace: from now on the lowered budget is enforced (evicting, then failing). */
void kiln_allocator_end_grace(kiln_allocator *a);
/* Allocators in a grace now, over the process (a cheap poll for suspend points). */
int kiln_allocator_graced(void);
/* Rounding of new large segments of a caching allocator (default 2 MiB, as
 * PyTorch's CUDA allocator; the host uses 4 KiB pages: its segments come from malloc,
 * so a fine grain wastes nothing and keeps the statistics close to what was asked). */
void kiln_allocator_set_grain(kiln_allocator *a, size_t grain);
/* Most bytes kept in cached free blocks: a segment that becomes wholly free while
 * the cache holds more is given back at once (0: no limit; the budget still
 * applies). The host uses 2 GiB: without a budget nothing else would bound it. */
void kiln_allocator_set_cache_limit(kiln_allocator *a, uint64_t bytes);
/* The settings above, as they are (a dry run copies them onto the meta device). */
size_t kiln_allocator_grain(kiln_allocator *a);
uint64_t kiln_allocator_cache_limit(kiln_allocator *a);
kiln_mem_stats kiln_allocator_stats(kiln_allocator *a);
void kiln_allocator_reset_peak(kiln_allocator *a);
/* Returns every unused cached segment to the device. */
void kiln_allocator_empty_cache(kiln_allocator *a);
void kiln_allocator_set_evict_hook(kiln_allocator *a, kiln_evict_fn fn, void *ctx);
void kiln_allocator_set_pressure_hook(kiln_allocator *a, kiln_pressure_fn fn, void *ctx);
const char *kiln_allocator_device_name(kiln_allocator *a);

/* Test control (as Lua's ltests.h): n more raw allocations succeed, then every one
 * fails until n = -1. */
void kiln_allocator_fail_after(kiln_allocator *a, int n);

#endif

/* gemm_scratch.c - the CPU kernels' scratch (GEMM panels, Winograd buffers, low-bit
 * weight panels, attention slots, column buffers): a few blocks kept between calls of
 * the same shapes, huge pages for the large ones, handed back on kiln_cpu_scratch_trim;
 * and its accounting (bytes in use, held, their peaks), which the device statistics
 * report and a dry run's model of the kernels' scratch is checked against. */
#define _GNU_SOURCE
#include "cpu_internal.h"

#include <pthread.h>
#include <malloc.h>
#include <stdlib.h>
#include <sys/mman.h>

/* Kernels that run again and again with the same shapes (every UNet step) reuse their
 * scratch instead of taking fresh pages from the OS on every call: the page faults on
 * a 40 MB Winograd buffer cost as much as the convolution itself. A few blocks of at
 * most SCRATCH_CACHE_MAX bytes stay cached until kiln_cpu_scratch_trim() (the CPU
 * backend's workspace_release: kiln.mem.empty_cache, model unload) hands the idle ones back. */
enum { SCRATCH_SLOTS = 4 };
static const size_t SCRATCH_CACHE_MAX = (size_t)64 << 20;
static pthread_mutex_t scratch_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { void *p; size_t cap, used; int busy; } scratch_slots[SCRATCH_SLOTS];

/* in_use: bytes handed out (a cached block counts the bytes asked of it, a loose one
 * its usable size) and not yet put back (what the kernels need now); held:
 * host bytes the scratch occupies (cached blocks, busy or idle, and loose blocks). */
static size_t in_use, peak_in_use, held, peak_held;

static void count_locked(size_t in, size_t hold)
{
    in_use += in;
    held += hold;
    if (in_use > peak_in_use) peak_in_use = in_use;
    if (held > peak_held) peak_held = held;
}

/* A loose block: taken and counted, or NULL. */
static void *loose_get(size_t bytes);

/* Blocks of 2 MB and more are backed by transparent huge pages where the kernel offers
 * them on request (enabled = madvise, Debian's default): the Winograd transforms write
 * and read 36 or 64 streams a matrix apart, which with 4 KB pages miss the L1 TLB. */
static void *scratch_alloc(size_t bytes)
{
    const size_t huge = (size_t)2 << 20;
    if (bytes < huge) return aligned_alloc(64, bytes);
    size_t n = (bytes + huge - 1) / huge * huge;
    void *p = aligned_alloc(huge, n);
#ifdef MADV_HUGEPAGE
    if (p) madvise(p, n, MADV_HUGEPAGE);
#endif
    return p;
}

/* 64-byte aligned, uninitialized; NULL when out of memory. Give back with _put. */
void *kiln_cpu_scratch_get(size_t bytes)
{
    bytes = bytes ? (bytes + 63) / 64 * 64 : 64;
    if (bytes > SCRATCH_CACHE_MAX) return loose_get(bytes);
    pthread_mutex_lock(&scratch_lock);
    int best = -1, victim = -1;
    for (int i = 0; i < SCRATCH_SLOTS; i++) {
        if (scratch_slots[i].busy) continue;
        if (scratch_slots[i].p && scratch_slots[i].cap >= bytes &&
            (best < 0 || scratch_slots[i].cap < scratch_slots[best].cap))
            best = i;
        if (victim < 0 || scratch_slots[i].cap < scratch_slots[victim].cap) victim = i;
    }
    void *r = NULL;
    if (best >= 0) {
        scratch_slots[best].busy = 1;
        scratch_slots[best].used = bytes;
        r = scratch_slots[best].p;
        count_locked(bytes, 0);
    } else if (victim >= 0) { /* replace the smallest free block by a bigger one */
        free(scratch_slots[victim].p);
        held -= scratch_slots[victim].cap;
        scratch_slots[victim].p = r = scratch_alloc(bytes);
        scratch_slots[victim].cap = r ? bytes : 0;
        scratch_slots[victim].busy = r != NULL;
        scratch_slots[victim].used = r ? bytes : 0;
        if (r) count_locked(bytes, bytes);
    }
    pthread_mutex_unlock(&scratch_lock);
    return best >= 0 || victim >= 0 ? r : loose_get(bytes);
}

/* Blocks outside the slots (too large to cache, or every slot busy) are counted at
 * their usable size, which _put reads again from the block itself. */
static void *loose_get(size_t bytes)
{
    void *p = scratch_alloc(bytes);
    if (!p) return NULL;
    size_t n = malloc_usable_size(p);
    pthread_mutex_lock(&scratch_lock);
    count_locked(n, n);
    pthread_mutex_unlock(&scratch_lock);
    return p;
}

void kiln_cpu_scratch_put(void *p)
{
    if (!p) return;
    pthread_mutex_lock(&scratch_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (scratch_slots[i].p == p) {
            scratch_slots[i].busy = 0;
            in_use -= scratch_slots[i].used;
            pthread_mutex_unlock(&scratch_lock);
            return;
        }
    size_t n = malloc_usable_size(p);
    in_use -= n;
    held -= n;
    pthread_mutex_unlock(&scratch_lock);
    free(p);
}

size_t kiln_cpu_scratch_cached(void)
{
    size_t n = 0;
    pthread_mutex_lock(&scratch_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++) n += scratch_slots[i].cap;
    pthread_mutex_unlock(&scratch_lock);
    return n;
}

size_t kiln_cpu_scratch_block_bound(size_t bytes)
{
    const size_t huge = (size_t)2 << 20;
    if (!bytes) return 0;
    bytes = (bytes + 63) / 64 * 64;
    if (bytes >= huge) bytes = (bytes + huge - 1) / huge * huge;
    return bytes + 4096; /* malloc's usable size may pass the request by a little */
}

kiln_cpu_scratch_count kiln_cpu_scratch_stats(int reset_peak)
{
    pthread_mutex_lock(&scratch_lock);
    kiln_cpu_scratch_count c = {in_use, peak_in_use, held, peak_held};
    if (reset_peak) {
        peak_in_use = in_use;
        peak_held = held;
    }
    pthread_mutex_unlock(&scratch_lock);
    return c;
}

void kiln_cpu_scratch_trim(void)
{
    pthread_mutex_lock(&scratch_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (!scratch_slots[i].busy) {
            held -= scratch_slots[i].cap;
            free(scratch_slots[i].p);
            scratch_slots[i].p = NULL;
            scratch_slots[i].cap = 0;
        }
    pthread_mutex_unlock(&scratch_lock);
}

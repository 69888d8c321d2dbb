/* gemm_scratch.c - the CPU kernels' cached scratch blocks (GEMM panels, Winograd
 * buffers, low-bit weight panels): a few blocks kept between calls of the same shapes,
 * huge pages for the large ones, handed back on kiln_cpu_scratch_trim. */
#define _GNU_SOURCE
#include "cpu_internal.h"

#include <pthread.h>
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
static struct { void *p; size_t cap; int busy; } scratch_slots[SCRATCH_SLOTS];

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
    if (bytes > SCRATCH_CACHE_MAX) return scratch_alloc(bytes);
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
        r = scratch_slots[best].p;
    } else if (victim >= 0) { /* replace the smallest free block by a bigger one */
        free(scratch_slots[victim].p);
        scratch_slots[victim].p = r = scratch_alloc(bytes);
        scratch_slots[victim].cap = r ? bytes : 0;
        scratch_slots[victim].busy = r != NULL;
    }
    pthread_mutex_unlock(&scratch_lock);
    return best >= 0 || victim >= 0 ? r : scratch_alloc(bytes);
}

void kiln_cpu_scratch_put(void *p)
{
    if (!p) return;
    pthread_mutex_lock(&scratch_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (scratch_slots[i].p == p) {
            scratch_slots[i].busy = 0;
            pthread_mutex_unlock(&scratch_lock);
            return;
        }
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

void kiln_cpu_scratch_trim(void)
{
    pthread_mutex_lock(&scratch_lock);
    for (int i = 0; i < SCRATCH_SLOTS; i++)
        if (!scratch_slots[i].busy) {
            free(scratch_slots[i].p);
            scratch_slots[i].p = NULL;
            scratch_slots[i].cap = 0;
        }
    pthread_mutex_unlock(&scratch_lock);
}

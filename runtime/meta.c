/* meta.c - the shape-only device: its raw memory (address space mapped read-only and
 * never committed, so a stray host read sees zeros and a stray write faults instead
 * of spending memory), and the dry run that makes it model another device: the
 * allocator's grain, cache limit and budget, the backend's optional entries
 * (conv2d_up2, group_norm_in_place, supports), and that device's name.
 * In the stack it sits on device.c and the backend table and below model.c: it never
 * calls up; what a dry run leaves in the layers above goes through the end hook. */
#define _GNU_SOURCE
#include "meta.h"
#include "backend.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

static pthread_mutex_t meta_mu = PTHREAD_MUTEX_INITIALIZER;
static kiln_device *target;               /* modelled during a dry run, else NULL */
static const kiln_backend *base;          /* meta's own table, as registered */
static const kiln_backend *modelled_be;   /* the backend whose decisions meta takes */
static kiln_backend composed;             /* base's entries with modelled_be's options */
static kiln_meta_end_fn end_hook;         /* kiln_meta_set_end_hook's, under meta_mu */
static _Atomic uint64_t scratch_peak;     /* kiln_meta_note_scratch's, since kiln_meta_begin */

static void *reserve(size_t n)
{
    void *p = mmap(NULL, n ? n : 1, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void *meta_raw_alloc(void *ctx, size_t n)
{
    (void)ctx;
    return reserve(n);
}

static void meta_raw_free(void *ctx, void *p, size_t n)
{
    (void)ctx;
    if (p) munmap(p, n ? n : 1);
}

kiln_raw_memory kiln_meta_raw_memory(void)
{
    kiln_raw_memory r = {meta_raw_alloc, meta_raw_free, NULL};
    return r;
}

int kiln_device_is_meta(const kiln_device *d) { return d && d->type == KILN_DEV_META; }

int kiln_device_host_memory(const kiln_device *d)
{
    if (!d) return 0;
    if (kiln_device_is_meta(d)) {
        const kiln_backend *b = kiln_meta_modelled_backend();
        return b && !b->to_host && !b->to_device;
    }
    return !d->backend->to_host && !d->backend->to_device;
}

kiln_device *kiln_meta_target(void)
{
    pthread_mutex_lock(&meta_mu);
    kiln_device *t = target;
    pthread_mutex_unlock(&meta_mu);
    return t;
}

const kiln_backend *kiln_meta_modelled_backend(void)
{
    if (!modelled_be) modelled_be = kiln_backend_find("cpu");
    return modelled_be;
}

/* supports() of the composed table: what the modelled backend would answer. */
static int composed_supports(kiln_op op, kiln_dtype dt)
{
    const kiln_backend *b = kiln_meta_modelled_backend();
    return b && b->supports ? b->supports(op, dt) : 1;
}

/* activation_dtype of the composed table: the modelled device's answer. */
static kiln_dtype composed_activation_dtype(kiln_device *dev, kiln_dtype dt)
{
    (void)dev;
    kiln_device *t = kiln_meta_target();
    const kiln_backend *b = kiln_meta_modelled_backend();
    return t && b && b->activation_dtype ? b->activation_dtype(t, dt) : KILN_F32;
}

/* meta's table with the options of `of`; installed as the meta device's backend. */
static void compose(kiln_device *meta, const kiln_backend *of)
{
    if (!base) base = meta->backend;
    composed = *base;
    composed.supports = composed_supports;
    composed.conv2d_up2 = of && of->conv2d_up2 ? base->conv2d_up2 : NULL;
    composed.group_norm_in_place = of ? of->group_norm_in_place : base->group_norm_in_place;
    composed.activation_dtype = of && of->activation_dtype ? composed_activation_dtype : NULL;
    modelled_be = of;
    meta->backend = &composed;
}

kiln_status kiln_meta_begin(kiln_device *dev, uint64_t budget)
{
    kiln_device *meta = kiln_device_meta();
    if (!meta) return kiln_error(KILN_ERR_UNSUPPORTED, "dry run: this build has no meta device");
    if (!dev) return kiln_error(KILN_ERR_ARG, "dry run: no device to model");
    if (kiln_device_is_meta(dev)) return kiln_error(KILN_ERR_ARG, "dry run: meta cannot model itself; name a real device");
    pthread_mutex_lock(&meta_mu);
    if (target) {
        pthread_mutex_unlock(&meta_mu);
        return kiln_error(KILN_ERR_ARG, "dry run: one is already running (modelling %s)", target->name);
    }
    compose(meta, dev->backend);
    kiln_allocator_empty_cache(meta->alloc);
    kiln_allocator_set_grain(meta->alloc, kiln_allocator_grain(dev->alloc));
    kiln_allocator_set_cache_limit(meta->alloc, kiln_allocator_cache_limit(dev->alloc));
    kiln_allocator_set_budget(meta->alloc, budget);
    meta->derived_limit = dev->derived_limit;
    kiln_device_reset_peak(meta);
    uint64_t a, r;
    kiln_meta_mark(&a, &r);
    atomic_store(&scratch_peak, 0);
    meta->total_memory = dev->total_memory;
    snprintf(meta->name, sizeof meta->name, "%s", dev->name);
    target = dev;
    pthread_mutex_unlock(&meta_mu);
    return KILN_OK;
}

void kiln_meta_set_end_hook(kiln_meta_end_fn fn)
{
    pthread_mutex_lock(&meta_mu);
    end_hook = fn;
    pthread_mutex_unlock(&meta_mu);
}

uint64_t kiln_meta_end(void)
{
    kiln_device *meta = kiln_device_meta();
    pthread_mutex_lock(&meta_mu);
    int was = target != NULL;
    kiln_meta_end_fn hook = end_hook;
    target = NULL;
    pthread_mutex_unlock(&meta_mu);
    if (!meta) return 0;
    if (was && hook) hook(meta);
    /* the workspace the modelled backend's kernels would keep (cuBLAS's) goes too */
    if (meta->backend && meta->backend->workspace_release) meta->backend->workspace_release(meta);
    snprintf(meta->name, sizeof meta->name, "meta");
    /* back to modelling sim's allocator and the CPU backend, without a budget */
    kiln_device *sim = kiln_device_get("sim");
    compose(meta, kiln_backend_find("cpu"));
    kiln_allocator_set_budget(meta->alloc, 0);
    kiln_allocator_set_grain(meta->alloc, kiln_allocator_grain(sim ? sim->alloc : NULL));
    kiln_allocator_set_cache_limit(meta->alloc, sim ? kiln_allocator_cache_limit(sim->alloc) : 0);
    meta->total_memory = 0;
    meta->derived_limit = sim ? sim->derived_limit : UINT64_MAX;
    kiln_allocator_empty_cache(meta->alloc);
    uint64_t left = kiln_allocator_stats(meta->alloc).allocated;
    return left;
}

/* ---- stage watermarks ---- */

static pthread_mutex_t mark_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t mark_alloc, mark_reserved;

void kiln_meta_note(kiln_device *meta)
{
    kiln_mem_stats st = kiln_allocator_stats(meta->alloc);
    pthread_mutex_lock(&mark_mu);
    if (st.allocated > mark_alloc) mark_alloc = st.allocated;
    if (st.reserved > mark_reserved) mark_reserved = st.reserved;
    pthread_mutex_unlock(&mark_mu);
}

void kiln_meta_mark(uint64_t *peak_allocated, uint64_t *peak_reserved)
{
    kiln_device *meta = kiln_device_meta();
    kiln_mem_stats st = kiln_allocator_stats(meta ? meta->alloc : NULL);
    pthread_mutex_lock(&mark_mu);
    *peak_allocated = mark_alloc > st.allocated ? mark_alloc : st.allocated;
    *peak_reserved = mark_reserved > st.reserved ? mark_reserved : st.reserved;
    mark_alloc = st.allocated;
    mark_reserved = st.reserved;
    pthread_mutex_unlock(&mark_mu);
}

void kiln_meta_note_scratch(uint64_t bytes)
{
    uint64_t cur = atomic_load(&scratch_peak);
    while (bytes > cur && !atomic_compare_exchange_weak(&scratch_peak, &cur, bytes)) {
    }
}

uint64_t kiln_meta_scratch_peak(void) { return atomic_load(&scratch_peak); }

/* ---- zero host memory for a dry run's model host copies ---- */

static void host_release(kiln_storage *s)
{
    if (s->data) munmap(s->data, s->nbytes ? s->nbytes : 1);
}

kiln_storage *kiln_meta_host_storage(size_t nbytes)
{
    void *p = mmap(NULL, nbytes ? nbytes : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED) return NULL;
    kiln_storage *s = kiln_storage_wrap(kiln_device_cpu(), p, nbytes, host_release, NULL);
    if (!s) munmap(p, nbytes ? nbytes : 1);
    return s;
}

int kiln_meta_is_host_storage(const kiln_storage *s) { return s && s->release == host_release; }

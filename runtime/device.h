/* device.h - devices (cpu, sim, cuda:N, meta), the backends that compute for them,
 * and the storages that live on them.
 * layer 3 of the memory core: uses events, alloc, mem_timeline, backend_table; never calls trace, tensor, meta.
 * A storage is a reference-counted byte buffer that carries its device and its
 * release function (Torch7's THAllocator idea): device memory from the device's
 * allocator, a mapped file region, or wrapped host memory all look the same. What
 * knows more than a device (the meta device's dry runs, the trace) is met through
 * hooks set from above: the device's own hooks and the event log's listener. */
#ifndef KILN_DEVICE_H
#define KILN_DEVICE_H

#include "alloc.h"

/* ORDER DEVTYPE */
/* META: shapes and accounted bytes without data, modelling another device (meta.h) */
typedef enum { KILN_DEV_CPU = 0, KILN_DEV_SIM, KILN_DEV_CUDA, KILN_DEV_META } kiln_device_type;

typedef struct kiln_backend kiln_backend;
typedef struct kiln_device kiln_device;
typedef struct kiln_storage kiln_storage;
struct kiln_device {
    kiln_device_type type;
    int index;
    char name[16];            /* "cpu", "sim", "cuda:0" */
    kiln_allocator *alloc;    /* memory manager (budget, stats) */
    const kiln_backend *backend;
    uint64_t total_memory;    /* physical memory of the device, 0 unknown */
    /* Transfer statistics (host<->device copies): updated from any thread (copy threads
     * too) under device.c's lock, read with kiln_device_transfers */
    uint64_t bytes_to_device, bytes_to_host;
    uint64_t bytes_to_device_at_reset;   /* bytes_to_device at the last kiln_device_reset_peak */
    double seconds_copying;
    /* Optional hooks of the device's kind, set by the backend that registers it (the
     * meta device's: kernels/meta), so the layers here need not know that kind:
     * storage_added runs after each storage allocated on the device (a dry run's
     * stage watermarks); host_zeros gives a cpu storage of nbytes that reads as zeros
     * and costs nothing until written, for a copy off the device (nothing on meta is
     * worth reading). NULL: none. */
    void (*storage_added)(kiln_device *dev);
    kiln_storage *(*host_zeros)(size_t nbytes);
    /* Caches derived from weights (below): bytes held now (atomic), and the most they
     * may hold, budget or not (UINT64_MAX: the budget alone bounds them; the cpu's
     * default is a quarter of physical memory, since it has no budget by default;
     * kiln_device_set_derived_limit) */
    uint64_t derived_bytes, derived_limit;
};

typedef struct {
    uint64_t bytes_to_device, bytes_to_host;
    uint64_t copied_in;       /* bytes_to_device since the last kiln_device_reset_peak */
    double seconds_copying;
} kiln_transfer_stats;

/* Counts one copy between dev and the host (to_device: host -> dev). Thread-safe. */
void kiln_device_count_transfer(kiln_device *dev, int to_device, size_t bytes, double seconds);
kiln_transfer_stats kiln_device_transfers(kiln_device *dev);

/* ---- backends and the registry ----
 * The initialisation code hands the backends in (kernels/backends.h's
 * kiln_backends_register_all); the devices are created at their first use: cpu and
 * sim computed by the "cpu" backend, then each backend's own (register_devices, in
 * the order they were handed in). A device used before any backend was handed in has
 * no backend until then, so the initialisation code runs first. */

/* Adds a backend (its table lives for the process); one of a name is kept once. When
 * the devices exist already, the "cpu" backend computes for those of the host that
 * have none, and a backend's own devices are added after them. */
void kiln_backend_register(const kiln_backend *b);
/* The registered backend of that name ("cpu", "cuda"), or NULL (not for use inside
 * register_devices). */
const kiln_backend *kiln_backend_find(const char *name);
/* Adds a device computed by backend over raw memory (from a backend's
 * register_devices, with the registry lock held). */
kiln_device *kiln_device_register(kiln_device_type type, int index, const char *name,
                                  kiln_raw_memory raw, uint64_t total, const kiln_backend *backend);

/* Looks a device up by name ("cpu", "sim", "cuda", "cuda:0"); NULL with a message
 * listing the devices present when absent. Devices are created on first use. */
kiln_device *kiln_device_get(const char *name);
kiln_device *kiln_device_cpu(void);
/* 1 when dev's backend computes bf16 products natively, faster than f32 (backend.h). */
int kiln_device_native_bf16(const kiln_device *dev);
/* The shape-only device (meta.h); always the last one listed. "meta" names it, and
 * during a dry run so does the name of the device it models. */
kiln_device *kiln_device_meta(void);
int kiln_device_count(void);
kiln_device *kiln_device_at(int i);
/* Gives back what dev holds but does not use: its allocator's free cached blocks and
 * its backend's workspace (kiln.mem.empty_cache, unload, kiln_close). */
void kiln_device_empty_cache(kiln_device *dev);
/* dev's memory statistics: its allocator's, and the workspace its backend keeps
 * between ops in .workspace (host scratch for cpu; on a GPU already part of
 * allocated, since it comes from the allocator). */
kiln_mem_stats kiln_device_stats(kiln_device *dev);
/* Starts a new measuring window: the allocator's peaks from now, and the bytes copied
 * onto the device counted from now (copied_in = bytes_to_device - at_reset). */
void kiln_device_reset_peak(kiln_device *dev);

/* Scratch for a kernel, from dev's memory manager: budgeted, counted in its
 * statistics, may evict as any allocation (KILN_ERR_OOM when it cannot fit). With
 * KILN_SCRATCH_NO_EVICT it is taken only when it fits without evicting anything,
 * and a refusal returns KILN_ERR_OOM leaving the thread's last error as it was (an
 * optional workspace that is refused is not an error of the op). Backends call
 * these instead of reaching the allocator. */
#define KILN_SCRATCH_NO_EVICT 1
kiln_status kiln_device_scratch_alloc(kiln_device *dev, size_t n, int flags, void **p);
void kiln_device_scratch_free(kiln_device *dev, void *p);

/* Threads of the host's compute pool (the CPU backend's, through its table);
 * KILN_THREADS or the number of online cores by default. kiln_set_threads: n <= 0
 * restores the default. */
int kiln_threads(void);
void kiln_set_threads(int n);

typedef void (*kiln_storage_release_fn)(kiln_storage *s);
struct kiln_storage {
    void *data;
    size_t nbytes;
    kiln_device *device;
    int refcount;                     /* atomic */
    kiln_storage_release_fn release;  /* frees data; NULL when from device->alloc */
    void *ctx;                        /* for release */
    char owner[64];                   /* who the bytes are accounted to ("model:unet", "tensor") */
    kiln_storage *prev, *next;        /* live list of the device, for summaries */
    struct kiln_derived *derived;     /* caches derived from these bytes (below); NULL: none */
    int is_derived;                   /* 1: itself such a cache (counted in device->derived_bytes) */
};

/* New storage of nbytes from dev's allocator (may evict; KILN_ERR_OOM on failure). */
kiln_status kiln_storage_new(kiln_device *dev, size_t nbytes, kiln_storage **out);
/* Wraps memory the storage does not own through the allocator (a mapped file, a
 * host buffer); release(s) is called when the last reference goes. */
kiln_storage *kiln_storage_wrap(kiln_device *dev, void *data, size_t nbytes,
                                kiln_storage_release_fn release, void *ctx);
void kiln_storage_retain(kiln_storage *s);
void kiln_storage_release(kiln_storage *s);
void kiln_storage_set_owner(kiln_storage *s, const char *owner);

/* Records a storage of dev's allocator being created (alive = 1) or freed (alive = 0)
 * in the event log (an ALLOC/FREE event at or above its threshold, else a memory
 * change its listener sees). kiln_storage_new and kiln_storage_release call it; so
 * does a release function that gives a device block back itself (suspend.c). */
void kiln_storage_account(const kiln_storage *s, int alive);

/* ---- caches derived from a storage's bytes ----
 * A kernel's own form of a weight kept between calls (the int8 product's quantized,
 * packed panels): a storage of its own on the same device, from that device's
 * allocator (so counted in its statistics and budget, named "<owner> (derived)"),
 * found by a key the kernel chooses (its tag, the view's offset, shape, dtype). It lives
 * as long as the storage it derives from: released with it (a model's unload, a
 * budget's eviction, a streamed block's copy going), and dropped whenever those bytes
 * are written (kiln_tensor_copy / fill, a patch rebuilt in place). Thread-safe. */
typedef struct kiln_derived kiln_derived;
/* The cache of that key, retained (the caller releases it), or NULL. */
kiln_storage *kiln_storage_derived_get(kiln_storage *s, const uint64_t key[4]);
/* Makes a cache of nbytes for s, taken only when it fits the device's budget without
 * evicting anything and its derived_limit (a refusal is KILN_ERR_OOM and leaves the thread's last error as it
 * was: the caller computes without one); the caller fills it, then publishes it with
 * kiln_storage_derived_put. */
kiln_status kiln_storage_derived_new(kiln_storage *s, size_t nbytes, kiln_storage **out);
/* Publishes d under key (s retains it; the caller keeps its own reference). When another
 * thread published one of that key first, d is not added. */
void kiln_storage_derived_put(kiln_storage *s, const uint64_t key[4], kiln_storage *d);
/* Releases every cache derived from s (its bytes changed). */
void kiln_storage_drop_derived(kiln_storage *s);
/* Gives back caches derived from dev's storages until need bytes are freed (an EVICT
 * event each): what an allocation that does not fit frees first, before any model, in
 * every memory mode, so a cache only ever holds memory nothing else asked for. Returns
 * the bytes freed now (a cache a kernel is reading goes when it lets go). */
size_t kiln_device_drop_derived(kiln_device *dev, size_t need);
/* Every device's allocator asks, for an allocation that does not fit, first
 * kiln_device_drop_derived, then fn (model.c's eviction of models, registered when
 * models start; NULL: nothing more), which returns the bytes it freed. */
typedef size_t (*kiln_device_evict_fn)(kiln_device *dev, size_t need);
void kiln_device_set_evictor(kiln_device_evict_fn fn);
/* At most limit bytes of caches derived from dev's storages from now on (0: none
 * taken; UINT64_MAX: no limit but the budget); those over it go at once. */
void kiln_device_set_derived_limit(kiln_device *dev, uint64_t limit);
/* Bytes of the caches derived from s. */
size_t kiln_storage_derived_bytes(kiln_storage *s);

/* Calls fn for every live storage of dev (under the registry lock). */
void kiln_storage_foreach(kiln_device *dev, void (*fn)(void *ctx, const kiln_storage *s), void *ctx);

#endif

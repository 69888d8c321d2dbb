/* device.c - the device registry (cpu, sim, cuda:N, meta) and reference-counted storages.
 * layer 3 of the memory core: uses events, alloc, mem_timeline, backend_table; never calls trace, tensor, meta.
 * cpu: host memory, caching allocator with page grains and at most 2 GiB cached
 *      (no budget by default).
 * sim: a simulated accelerator: its own caching allocator and budget in host memory,
 *      explicit copies counted in bytes and time, CPU kernels for compute.
 * cuda:N: registered by the CUDA backend when present (its register_devices).
 * meta: shapes without data (meta.h), registered by the meta backend, listed last.
 * Backends are met only through their tables, handed in by the initialisation code
 * (kiln_backend_register) before the first device is used. */
#define _GNU_SOURCE
#include "device.h"
#include "backend_table.h"
#include "events.h"
#include "format_bytes.h"
#include "mem_timeline.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

#define MAX_DEVICES 16
#define SIM_DEFAULT_BUDGET (8ull << 30)

#define MAX_BACKENDS 8

static kiln_device *devices[MAX_DEVICES];
static int n_devices;
static const kiln_backend *backends[MAX_BACKENDS];
static int n_backends;
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t storage_lock = PTHREAD_MUTEX_INITIALIZER;
static kiln_storage *live_heads[MAX_DEVICES]; /* per device index in `devices` */
static kiln_device *meta_device;

/* Segments of 2 MB and more sit on 2 MB boundaries and ask for transparent huge pages
 * (Debian's default is "madvise": only where asked): weights loaded to the host are
 * read in strided patterns (16 rows of a convolution's weights at once) that with
 * 4 KB pages miss the TLB on nearly every row; the allocator's large segments are
 * whole multiples of 2 MB, so nothing is wasted. */
static void *host_raw_alloc(void *ctx, size_t n)
{
    (void)ctx;
    void *p = NULL;
    const size_t huge = (size_t)2 << 20;
    size_t align = n >= huge ? huge : KILN_ALLOC_ALIGN;
    if (posix_memalign(&p, align, n ? n : KILN_ALLOC_ALIGN) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (n >= huge) madvise(p, n / huge * huge, MADV_HUGEPAGE);
#endif
    return p;
}

static void host_raw_free(void *ctx, void *p, size_t n)
{
    (void)ctx; (void)n;
    free(p);
}

static kiln_device_evict_fn evictor; /* atomic */

void kiln_device_set_evictor(kiln_device_evict_fn fn) { __atomic_store_n(&evictor, fn, __ATOMIC_RELEASE); }

/* The allocators' evict hook (called without the allocator's lock) */
static size_t evict_hook(void *ctx, kiln_allocator *a, size_t need)
{
    (void)a;
    /* the allocator asks again while it is short: one kind of memory at a time */
    size_t freed = kiln_device_drop_derived(ctx, need ? need : 1);
    if (freed) return freed;
    kiln_device_evict_fn fn = __atomic_load_n(&evictor, __ATOMIC_ACQUIRE);
    return fn ? fn(ctx, need) : 0;
}

static kiln_device *add_device(kiln_device_type type, int index, const char *name,
                               int caching, uint64_t budget, const kiln_backend *backend)
{
    kiln_device *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->type = type;
    d->index = index;
    snprintf(d->name, sizeof d->name, "%s", name);
    kiln_raw_memory raw = {host_raw_alloc, host_raw_free, NULL};
    d->alloc = kiln_allocator_new(name, raw, budget, caching);
    d->backend = backend;
    d->derived_limit = UINT64_MAX;
    kiln_allocator_set_evict_hook(d->alloc, evict_hook, d);
    devices[n_devices++] = d;
    kiln_mem_timeline_add_device(d, d->alloc, d->name);
    return d;
}

static const kiln_backend *find_backend(const char *name);
static void attach_locked(const kiln_backend *b);

void kiln_backend_register(const kiln_backend *b)
{
    pthread_mutex_lock(&registry_lock);
    /* the initialisation code may run more than once (a second kiln_open) */
    if (b && !find_backend(b->name) && n_backends < MAX_BACKENDS) {
        backends[n_backends++] = b;
        if (n_devices) attach_locked(b);
    }
    pthread_mutex_unlock(&registry_lock);
}

static const kiln_backend *find_backend(const char *name)
{
    for (int i = 0; i < n_backends; i++)
        if (strcmp(backends[i]->name, name) == 0) return backends[i];
    return NULL;
}

/* meta is whichever device the meta backend registered (the last one) */
static void find_meta_locked(void)
{
    for (int i = 0; i < n_devices && !meta_device; i++)
        if (devices[i]->type == KILN_DEV_META) {
            meta_device = devices[i];
            /* outside a dry run meta models sim's settings (no budget) */
            if (n_devices > 1) kiln_allocator_set_grain(meta_device->alloc, kiln_allocator_grain(devices[1]->alloc));
        }
}

/* A backend handed in after the devices were made (kiln_open asks for them before
 * its Lua state, whose luaopen_kiln hands the backends in): it computes for the host
 * devices if it is the host's, and adds its own devices after those made so far. */
static void attach_locked(const kiln_backend *b)
{
    if (strcmp(b->name, "cpu") == 0)
        for (int i = 0; i < n_devices; i++)
            if (!devices[i]->backend && (devices[i]->type == KILN_DEV_CPU || devices[i]->type == KILN_DEV_SIM))
                devices[i]->backend = b;
    if (b->register_devices) b->register_devices();
    find_meta_locked();
}

static void init_devices_locked(void)
{
    if (n_devices) return;
    const kiln_backend *host = find_backend("cpu");
    /* the host caches too: freeing a large activation to the C library and asking
     * again for the next op costs page faults and zeroing on every op; unused cached
     * memory goes back on pressure or kiln.mem.empty_cache */
    kiln_device *cpu = add_device(KILN_DEV_CPU, 0, "cpu", 1, 0, host);
    if (cpu) {
        kiln_allocator_set_grain(cpu->alloc, (size_t)4 << 10);
        kiln_allocator_set_cache_limit(cpu->alloc, (uint64_t)2 << 30);
        /* without a budget, "fits without evicting" bounds nothing: kernels' caches of
         * the weights (bf16's Winograd U is up to 4x an f16 layer) get a quarter of the
         * machine's memory */
        long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
        if (pages > 0 && psz > 0) cpu->derived_limit = (uint64_t)pages * (uint64_t)psz / 4;
    }
    add_device(KILN_DEV_SIM, 0, "sim", 1, SIM_DEFAULT_BUDGET, host);
    for (int i = 0; i < n_backends; i++)
        if (backends[i]->register_devices) backends[i]->register_devices();
    find_meta_locked();
}

static void init_devices(void)
{
    pthread_mutex_lock(&registry_lock);
    init_devices_locked();
    pthread_mutex_unlock(&registry_lock);
}

/* Called by a backend's register_devices (registry lock held). */
kiln_device *kiln_device_register(kiln_device_type type, int index, const char *name,
                                  kiln_raw_memory raw, uint64_t total, const kiln_backend *backend)
{
    if (n_devices >= MAX_DEVICES) return NULL;
    kiln_device *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->type = type;
    d->index = index;
    snprintf(d->name, sizeof d->name, "%s", name);
    d->alloc = kiln_allocator_new(name, raw, 0, 1);
    d->backend = backend;
    d->total_memory = total;
    d->derived_limit = UINT64_MAX;
    kiln_allocator_set_evict_hook(d->alloc, evict_hook, d);
    devices[n_devices++] = d;
    kiln_mem_timeline_add_device(d, d->alloc, d->name);
    return d;
}

const kiln_backend *kiln_backend_find(const char *name)
{
    init_devices();
    pthread_mutex_lock(&registry_lock);
    const kiln_backend *b = find_backend(name);
    pthread_mutex_unlock(&registry_lock);
    return b;
}

int kiln_device_count(void)
{
    init_devices();
    return n_devices;
}

kiln_device *kiln_device_at(int i)
{
    init_devices();
    return i >= 0 && i < n_devices ? devices[i] : NULL;
}

void kiln_device_empty_cache(kiln_device *dev)
{
    if (!dev) return;
    /* workspace first: what it gives back to the allocator goes on to the device */
    if (dev->backend && dev->backend->workspace_release) dev->backend->workspace_release(dev);
    kiln_allocator_empty_cache(dev->alloc);
}

static pthread_mutex_t xfer_mu = PTHREAD_MUTEX_INITIALIZER; /* the transfer counters */

void kiln_device_count_transfer(kiln_device *dev, int to_device, size_t bytes, double seconds)
{
    if (dev->type == KILN_DEV_CPU) return;
    pthread_mutex_lock(&xfer_mu);
    if (to_device) dev->bytes_to_device += bytes;
    else dev->bytes_to_host += bytes;
    dev->seconds_copying += seconds;
    pthread_mutex_unlock(&xfer_mu);
}

kiln_transfer_stats kiln_device_transfers(kiln_device *dev)
{
    pthread_mutex_lock(&xfer_mu);
    kiln_transfer_stats s = {dev->bytes_to_device, dev->bytes_to_host,
                             dev->bytes_to_device - dev->bytes_to_device_at_reset, dev->seconds_copying};
    pthread_mutex_unlock(&xfer_mu);
    return s;
}

void kiln_device_reset_peak(kiln_device *dev)
{
    kiln_allocator_reset_peak(dev->alloc);
    if (dev->backend && dev->backend->workspace_peak) dev->backend->workspace_peak(dev, 1);
    pthread_mutex_lock(&xfer_mu);
    dev->bytes_to_device_at_reset = dev->bytes_to_device;
    pthread_mutex_unlock(&xfer_mu);
}

kiln_mem_stats kiln_device_stats(kiln_device *dev)
{
    kiln_mem_stats s = kiln_allocator_stats(dev ? dev->alloc : NULL);
    if (dev && dev->backend && dev->backend->workspace_bytes) s.workspace = dev->backend->workspace_bytes(dev);
    if (dev && dev->backend && dev->backend->workspace_peak) s.workspace_peak = dev->backend->workspace_peak(dev, 0);
    return s;
}

kiln_status kiln_device_scratch_alloc(kiln_device *dev, size_t n, int flags, void **p)
{
    *p = NULL;
    if (!(flags & KILN_SCRATCH_NO_EVICT)) {
        kiln_status st = kiln_allocator_alloc(dev->alloc, n ? n : 1, p);
        if (st == KILN_OK) kiln_mem_timeline_alloc(dev, *p, "scratch");
        return st;
    }
    kiln_mem_stats s = kiln_allocator_stats(dev->alloc);
    const uint64_t grain = 2u << 20; /* the allocator's large-segment rounding */
    uint64_t seg = (n + grain - 1) / grain * grain;
    if (s.budget && s.reserved + seg > s.budget && s.largest_free < n) return KILN_ERR_OOM;
    char saved[512];
    kiln_status saved_st = kiln_last_status();
    snprintf(saved, sizeof saved, "%s", kiln_last_error());
    if (kiln_allocator_alloc(dev->alloc, n ? n : 1, p) != KILN_OK) {
        *p = NULL;
        kiln_error(saved_st, "%s", saved);
        return KILN_ERR_OOM;
    }
    /* optional scratch kept between ops (the cuBLAS workspace) */
    kiln_mem_timeline_alloc(dev, *p, "workspace");
    return KILN_OK;
}

void kiln_device_scratch_free(kiln_device *dev, void *p)
{
    if (!p) return;
    kiln_mem_timeline_free(dev, p);
    kiln_allocator_release(dev->alloc, p);
}

int kiln_threads(void)
{
    const kiln_backend *b = kiln_device_cpu()->backend;
    return b && b->threads ? b->threads() : 1;
}

void kiln_set_threads(int n)
{
    const kiln_backend *b = kiln_device_cpu()->backend;
    if (b && b->set_threads) b->set_threads(n);
}

int kiln_device_native_bf16(const kiln_device *dev)
{
    const kiln_backend *b = dev ? dev->backend : NULL;
    return b && b->native_bf16 ? b->native_bf16() != 0 : 0;
}

kiln_device *kiln_device_cpu(void)
{
    init_devices();
    return devices[0];
}

kiln_device *kiln_device_meta(void)
{
    init_devices();
    return meta_device;
}

kiln_device *kiln_device_get(const char *name)
{
    init_devices();
    if (!name) return devices[0];
    const char *want = strcmp(name, "cuda") == 0 ? "cuda:0" : name;
    /* "meta", and during a dry run the modelled device's name, which meta takes for
     * the run's length (meta.h) */
    if (meta_device && (strcmp(want, "meta") == 0 || strcmp(meta_device->name, want) == 0)) return meta_device;
    for (int i = 0; i < n_devices; i++)
        if (strcmp(devices[i]->name, want) == 0) return devices[i];
    char list[256] = "";
    for (int i = 0; i < n_devices; i++) {
        strncat(list, i ? ", " : "", sizeof list - strlen(list) - 1);
        strncat(list, devices[i]->name, sizeof list - strlen(list) - 1);
    }
    /* a name a registered backend would own ("cuda:1"): its own reason */
    for (int i = 0; i < n_backends; i++) {
        size_t k = strlen(backends[i]->name);
        if (backends[i]->unavailable_reason && strncmp(name, backends[i]->name, k) == 0 &&
            (name[k] == 0 || name[k] == ':')) {
            kiln_error(KILN_ERR_ARG, "no %s device '%s' (%s); devices present: %s", backends[i]->name, name,
                       backends[i]->unavailable_reason(), list);
            return NULL;
        }
    }
    kiln_error(KILN_ERR_ARG, "unknown device '%s'; devices present: %s", name, list);
    return NULL;
}

static int device_slot(const kiln_device *d)
{
    for (int i = 0; i < n_devices; i++)
        if (devices[i] == d) return i;
    return 0;
}

static void link_storage(kiln_storage *s)
{
    pthread_mutex_lock(&storage_lock);
    int slot = device_slot(s->device);
    s->prev = NULL;
    s->next = live_heads[slot];
    if (s->next) s->next->prev = s;
    live_heads[slot] = s;
    pthread_mutex_unlock(&storage_lock);
}

static void unlink_storage(kiln_storage *s)
{
    pthread_mutex_lock(&storage_lock);
    int slot = device_slot(s->device);
    if (s->prev) s->prev->next = s->next;
    else live_heads[slot] = s->next;
    if (s->next) s->next->prev = s->prev;
    pthread_mutex_unlock(&storage_lock);
}

/* ---- the event log's view of storages ---- */

void kiln_storage_account(const kiln_storage *s, int alive)
{
    uint64_t th = kiln_events_alloc_threshold();
    if (th && s->nbytes >= th) {
        /* a new storage is still owned by "tensor": the thread's context says better */
        const char *ctx = kiln_events_context();
        const char *owner = alive && ctx[0] ? ctx : s->owner;
        kiln_event_emit(alive ? KILN_EV_ALLOC : KILN_EV_FREE, s->device->name, s->nbytes, owner, "%s", "");
    } else {
        kiln_events_memory_changed(s->device->name);
    }
}

typedef struct { char owner[64]; uint64_t bytes; int count; } owner_row;
typedef struct { owner_row rows[16]; int n; uint64_t other; } owner_acc;

static void add_owner(void *ctx, const kiln_storage *s)
{
    owner_acc *a = ctx;
    if (s->release) return; /* mapped files and wrapped memory are not the allocator's */
    for (int i = 0; i < a->n; i++)
        if (strcmp(a->rows[i].owner, s->owner) == 0) { a->rows[i].bytes += s->nbytes; a->rows[i].count++; return; }
    if (a->n == 16) { a->other += s->nbytes; return; }
    snprintf(a->rows[a->n].owner, sizeof a->rows[a->n].owner, "%s", s->owner);
    a->rows[a->n].bytes = s->nbytes;
    a->rows[a->n].count = 1;
    a->n++;
}

static int row_cmp(const void *x, const void *y)
{
    const owner_row *a = x, *b = y;
    return a->bytes < b->bytes ? 1 : a->bytes > b->bytes ? -1 : strcmp(a->owner, b->owner);
}

/* An allocation of `requested` bytes on dev failed with KILN_ERR_OOM: the message gets
 * what is resident on the device appended, and an OOM event records it. */
static void report_oom(kiln_device *dev, uint64_t requested)
{
    kiln_oom_info o = *kiln_last_oom();
    char msg[640], res[320], b[32];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    owner_acc acc;
    memset(&acc, 0, sizeof acc);
    kiln_storage_foreach(dev, add_owner, &acc);
    qsort(acc.rows, (size_t)acc.n, sizeof acc.rows[0], row_cmp);
    size_t used = (size_t)snprintf(res, sizeof res, acc.n ? "resident on %s:" : "nothing resident on %s", dev->name);
    for (int i = 0; i < acc.n && used < sizeof res; i++) {
        kiln_format_bytes(b, sizeof b, (double)acc.rows[i].bytes);
        used += (size_t)snprintf(res + used, sizeof res - used, "%s %s %s", i ? "," : "", acc.rows[i].owner, b);
    }
    if (acc.other && used < sizeof res) {
        kiln_format_bytes(b, sizeof b, (double)acc.other);
        snprintf(res + used, sizeof res - used, ", others %s", b);
    }
    kiln_error_oom(o.device, o.requested, o.free, o.budget, "%s; %s", msg, res);
    char fr[32], bu[32];
    kiln_format_bytes(fr, sizeof fr, (double)o.free);
    if (o.budget) kiln_format_bytes(bu, sizeof bu, (double)o.budget);
    else snprintf(bu, sizeof bu, "unlimited");
    /* the resident list may be cut short here: the full one is in the error message */
    char detail[sizeof ((kiln_event *)0)->detail];
    size_t cut = (size_t)snprintf(detail, sizeof detail, "free %s of budget %s; ", fr, bu);
    if (cut < sizeof detail) {
        size_t k = strnlen(res, sizeof detail - cut - 1);
        memcpy(detail + cut, res, k);
        detail[cut + k] = 0;
    }
    kiln_event_emit(KILN_EV_OOM, dev->name, requested, NULL, "%s", detail);
}

kiln_status kiln_storage_new(kiln_device *dev, size_t nbytes, kiln_storage **out)
{
    *out = NULL;
    kiln_storage *s = calloc(1, sizeof *s);
    if (!s) return kiln_error(KILN_ERR_OOM, "host out of memory for a storage header");
    void *p = NULL;
    kiln_status st = kiln_allocator_alloc(dev->alloc, nbytes ? nbytes : 1, &p);
    if (st != KILN_OK) {
        free(s);
        if (st == KILN_ERR_OOM) report_oom(dev, nbytes); /* event; message names what is resident */
        return st;
    }
    s->data = p;
    s->nbytes = nbytes;
    s->device = dev;
    atomic_init((atomic_int *)&s->refcount, 1);
    snprintf(s->owner, sizeof s->owner, "tensor");
    link_storage(s);
    kiln_mem_timeline_alloc(dev, p, s->owner);
    kiln_storage_account(s, 1);
    if (dev->storage_added) dev->storage_added(dev); /* meta: a dry run's stage watermarks */
    *out = s;
    return KILN_OK;
}

kiln_storage *kiln_storage_wrap(kiln_device *dev, void *data, size_t nbytes,
                                kiln_storage_release_fn release, void *ctx)
{
    kiln_storage *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->data = data;
    s->nbytes = nbytes;
    s->device = dev;
    s->release = release;
    s->ctx = ctx;
    atomic_init((atomic_int *)&s->refcount, 1);
    snprintf(s->owner, sizeof s->owner, "mapped");
    link_storage(s);
    return s;
}

void kiln_storage_retain(kiln_storage *s)
{
    if (s) atomic_fetch_add((atomic_int *)&s->refcount, 1);
}

void kiln_storage_release(kiln_storage *s)
{
    if (!s) return;
    if (atomic_fetch_sub((atomic_int *)&s->refcount, 1) != 1) return;
    kiln_storage_drop_derived(s);
    unlink_storage(s);
    if (s->is_derived) __atomic_fetch_sub(&s->device->derived_bytes, (uint64_t)s->nbytes, __ATOMIC_RELAXED);
    if (s->release) s->release(s);
    else {
        kiln_mem_timeline_free(s->device, s->data);
        kiln_allocator_release(s->device->alloc, s->data);
        kiln_storage_account(s, 0);
    }
    free(s);
}

/* ---- derived caches ---- */

struct kiln_derived {
    kiln_derived *next;
    uint64_t key[4];
    kiln_storage *data;
};

static pthread_mutex_t derived_lock = PTHREAD_MUTEX_INITIALIZER;

kiln_storage *kiln_storage_derived_get(kiln_storage *s, const uint64_t key[4])
{
    kiln_storage *r = NULL;
    pthread_mutex_lock(&derived_lock);
    for (kiln_derived *d = s->derived; d; d = d->next)
        if (!memcmp(d->key, key, sizeof d->key)) {
            r = d->data;
            kiln_storage_retain(r);
            break;
        }
    pthread_mutex_unlock(&derived_lock);
    return r;
}

kiln_status kiln_storage_derived_new(kiln_storage *s, size_t nbytes, kiln_storage **out)
{
    *out = NULL;
    kiln_device *dev = s->device;
    void *p = NULL;
    /* within the device's limit for caches, claimed before the allocation so that two
     * threads cannot both pass it */
    uint64_t held = __atomic_add_fetch(&dev->derived_bytes, (uint64_t)nbytes, __ATOMIC_RELAXED);
    if (held > __atomic_load_n(&dev->derived_limit, __ATOMIC_RELAXED) || held < nbytes) {
        __atomic_fetch_sub(&dev->derived_bytes, (uint64_t)nbytes, __ATOMIC_RELAXED);
        return KILN_ERR_OOM;
    }
    /* taken only where it fits without evicting: a cache must never push out weights */
    if (kiln_device_scratch_alloc(dev, nbytes, KILN_SCRATCH_NO_EVICT, &p)) {
        __atomic_fetch_sub(&dev->derived_bytes, (uint64_t)nbytes, __ATOMIC_RELAXED);
        return KILN_ERR_OOM;
    }
    kiln_mem_timeline_free(dev, p); /* accounted below as a storage, not as workspace */
    kiln_storage *r = calloc(1, sizeof *r);
    if (!r) {
        kiln_allocator_release(dev->alloc, p);
        __atomic_fetch_sub(&dev->derived_bytes, (uint64_t)nbytes, __ATOMIC_RELAXED);
        return KILN_ERR_OOM;
    }
    r->data = p;
    r->nbytes = nbytes;
    r->device = dev;
    r->is_derived = 1;
    atomic_init((atomic_int *)&r->refcount, 1);
    snprintf(r->owner, sizeof r->owner, "%.52s (derived)", s->owner);
    link_storage(r);
    kiln_mem_timeline_alloc(dev, p, r->owner);
    kiln_storage_account(r, 1);
    *out = r;
    return KILN_OK;
}

void kiln_storage_derived_put(kiln_storage *s, const uint64_t key[4], kiln_storage *data)
{
    kiln_derived *n = malloc(sizeof *n);
    if (!n) return;
    memcpy(n->key, key, sizeof n->key);
    n->data = data;
    pthread_mutex_lock(&derived_lock);
    for (kiln_derived *d = s->derived; d; d = d->next)
        if (!memcmp(d->key, key, sizeof d->key)) {
            pthread_mutex_unlock(&derived_lock);
            free(n);
            return;
        }
    kiln_storage_retain(data);
    n->next = s->derived;
    __atomic_store_n(&s->derived, n, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&derived_lock);
}

void kiln_storage_drop_derived(kiln_storage *s)
{
    /* every copy and fill comes here: most storages have no cache, and need no lock */
    if (!s || !__atomic_load_n(&s->derived, __ATOMIC_ACQUIRE)) return;
    pthread_mutex_lock(&derived_lock);
    kiln_derived *list = s->derived;
    __atomic_store_n(&s->derived, NULL, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&derived_lock);
    while (list) {
        kiln_derived *next = list->next;
        kiln_storage_release(list->data);
        free(list);
        list = next;
    }
}

/* A reference to s unless its last one is already gone (a release under way: it will
 * drop the caches and unlink s itself). Called with storage_lock held, which keeps s
 * in the list, so its memory, until then. */
static int retain_live(kiln_storage *s)
{
    int n = atomic_load((atomic_int *)&s->refcount);
    while (n > 0)
        if (atomic_compare_exchange_weak((atomic_int *)&s->refcount, &n, n + 1)) return 1;
    return 0;
}

size_t kiln_device_drop_derived(kiln_device *dev, size_t need)
{
    size_t freed = 0;
    while (freed < need) {
        kiln_storage *s = NULL;
        pthread_mutex_lock(&storage_lock);
        for (kiln_storage *p = live_heads[device_slot(dev)]; p && !s; p = p->next)
            if (__atomic_load_n(&p->derived, __ATOMIC_ACQUIRE) && retain_live(p)) s = p;
        pthread_mutex_unlock(&storage_lock);
        if (!s) break;
        size_t bytes = 0, idle = 0;
        pthread_mutex_lock(&derived_lock);
        for (kiln_derived *d = s->derived; d; d = d->next) {
            bytes += d->data->nbytes;
            /* one in a kernel's hands goes when the kernel lets it go, not now */
            if (atomic_load((atomic_int *)&d->data->refcount) == 1) idle += d->data->nbytes;
        }
        pthread_mutex_unlock(&derived_lock);
        kiln_storage_drop_derived(s);
        kiln_event_emit(KILN_EV_EVICT, dev->name, bytes, s->owner,
                        "caches derived from its bytes (a kernel's form of the weights), given back");
        kiln_storage_release(s);
        freed += idle;
    }
    return freed;
}

void kiln_device_set_derived_limit(kiln_device *dev, uint64_t limit)
{
    if (!dev) return;
    __atomic_store_n(&dev->derived_limit, limit, __ATOMIC_RELAXED);
    uint64_t held = __atomic_load_n(&dev->derived_bytes, __ATOMIC_RELAXED);
    if (held > limit) kiln_device_drop_derived(dev, (size_t)(held - limit));
}

size_t kiln_storage_derived_bytes(kiln_storage *s)
{
    size_t n = 0;
    pthread_mutex_lock(&derived_lock);
    for (kiln_derived *d = s->derived; d; d = d->next) n += d->data->nbytes;
    pthread_mutex_unlock(&derived_lock);
    return n;
}

void kiln_storage_set_owner(kiln_storage *s, const char *owner)
{
    if (!s || !owner) return;
    snprintf(s->owner, sizeof s->owner, "%s", owner);
    if (!s->release) kiln_mem_timeline_set_owner(s->device, s->data, owner);
}

void kiln_storage_foreach(kiln_device *dev, void (*fn)(void *ctx, const kiln_storage *s), void *ctx)
{
    pthread_mutex_lock(&storage_lock);
    for (kiln_storage *s = live_heads[device_slot(dev)]; s; s = s->next) fn(ctx, s);
    pthread_mutex_unlock(&storage_lock);
}

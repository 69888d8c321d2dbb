/* model.c - model weight stores: the registry of open models, residency of every tensor
 * (mapped / host / device), load / offload / unload / pin, memory modes and LRU eviction
 * through the allocators' evict hook. Streaming (model_stream.c) and the patch lists
 * (model_patch.c) build on it through model_internal.h (which also says how they lock).
 * In the stack it sits above tensor.c, device.c and meta.c; it registers its end of a dry
 * run (dropping the copies the run made) as meta's end hook rather than meta calling up. */
#define _GNU_SOURCE
#include "model_internal.h"
#include "format_bytes.h"
#include "gguf.h"
#include "mapped_read.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Staging buffer of a converting copy to a device with its own memory (cuda): the
 * conversion never holds a second full host copy of a tensor. */
#define STAGE_BYTES ((size_t)8 << 20)

pthread_mutex_t kiln_model_mu = PTHREAD_MUTEX_INITIALIZER;
kiln_model *kiln_model_list;
uint64_t kiln_model_clock;
static atomic_int memory_mode = KILN_MEM_NORMAL;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

/* ORDER MEMMODE */
static const char *const memory_mode_names[KILN_MEM_MODE_COUNT] = {"high", "normal", "low", "none"};
/* ORDER RESIDENCY */
static const char *const residency_names[KILN_RES_COUNT] = {"mapped", "host", "device"};

/* ---- modes ---- */

void kiln_memory_mode_set(kiln_memory_mode mode)
{
    if ((unsigned)mode < KILN_MEM_MODE_COUNT) atomic_store(&memory_mode, (int)mode);
}

kiln_memory_mode kiln_memory_mode_get(void) { return (kiln_memory_mode)atomic_load(&memory_mode); }

const char *kiln_memory_mode_name(kiln_memory_mode mode)
{
    return (unsigned)mode < KILN_MEM_MODE_COUNT ? memory_mode_names[mode] : "?";
}

int kiln_memory_mode_from_name(const char *name)
{
    if (!name) return -1;
    if (strcmp(name, "cpu") == 0) return KILN_MEM_NONE;
    for (int i = 0; i < KILN_MEM_MODE_COUNT; i++)
        if (strcmp(name, memory_mode_names[i]) == 0) return i;
    return -1;
}

const char *kiln_residency_name(kiln_residency r)
{
    return (unsigned)r < KILN_RES_COUNT ? residency_names[r] : "?";
}

/* ---- helpers ---- */

void kiln_model_set_dev_locked(mtensor *t, kiln_tensor *r)
{
    if (t->dev && r && kiln_device_is_meta(tensor_device(r)) && !kiln_device_is_meta(tensor_device(t->dev)) &&
        !t->parked)
        t->parked = t->dev;
    else
        kiln_tensor_free(t->dev);
    t->dev = r;
}

/* Load dtype for a tensor: floating-point tensors convert, integer ones (CLIP's
 * position_ids) keep theirs. A low-bit load dtype (fp8, a block type) is for the
 * weights of linear and convolution layers: vectors (biases, norms) keep their dtype,
 * and a block type also needs the last dimension in whole blocks. */
kiln_dtype kiln_model_want_dtype(int dtype, const kiln_tensor *t)
{
    kiln_dtype src = t->dtype;
    if (dtype < 0 || !kiln_dtype_is_float(src)) return src;
    kiln_dtype d = (kiln_dtype)dtype;
    if (d == KILN_F8_E4M3FN || d == KILN_F8_E5M2 || kiln_dtype_is_blocked(d)) {
        if (t->ndim < 2) return src;
        if (t->shape[t->ndim - 1] % kiln_dtype_block(d)) return src;
    }
    return d;
}

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

int kiln_model_find(const kiln_model *m, const char *name)
{
    if (!m || !name) return -1;
    for (size_t s = (size_t)hash_str(name) & m->slot_mask; m->slots[s] >= 0; s = (s + 1) & m->slot_mask)
        if (strcmp(m->t[m->slots[s]].name, name) == 0) return m->slots[s];
    return -1;
}

static void slot_insert(kiln_model *m, int idx)
{
    size_t s = (size_t)hash_str(m->t[idx].name) & m->slot_mask;
    while (m->slots[s] >= 0) s = (s + 1) & m->slot_mask;
    m->slots[s] = idx;
}

/* Edit distance on at most the first 96 bytes (enough to rank suggestions). */
static int edit_distance(const char *a, const char *b)
{
    int la = (int)strnlen(a, 96), lb = (int)strnlen(b, 96);
    int row[97];
    for (int j = 0; j <= lb; j++) row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

kiln_status kiln_model_missing_error(const kiln_model *m, const char *name)
{
    if (m->n == 0) return kiln_error(KILN_ERR_ARG, "model '%s': no tensor '%s' (the model has no tensors)", m->name, name);
    int best[3] = {-1, -1, -1}, dist[3] = {1 << 30, 1 << 30, 1 << 30};
    for (int i = 0; i < m->n; i++) {
        int d = edit_distance(name, m->t[i].name);
        for (int k = 0; k < 3; k++) {
            if (d < dist[k]) {
                for (int j = 2; j > k; j--) { dist[j] = dist[j - 1]; best[j] = best[j - 1]; }
                dist[k] = d;
                best[k] = i;
                break;
            }
        }
    }
    char list[400] = "";
    for (int k = 0; k < 3 && best[k] >= 0; k++) {
        size_t used = strlen(list);
        snprintf(list + used, sizeof list - used, "%s'%s'", k ? ", " : "", m->t[best[k]].name);
    }
    return kiln_error(KILN_ERR_ARG, "model '%s': no tensor '%s' (closest: %s)", m->name, name, list);
}

kiln_status kiln_model_prefix_error(kiln_status st, const char *prefix)
{
    char msg[800];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    if (st == KILN_ERR_OOM) {
        kiln_oom_info o = *kiln_last_oom();
        return kiln_error_oom(o.device, o.requested, o.free, o.budget, "%s%s", prefix, msg);
    }
    return kiln_error(st, "%s%s", prefix, msg);
}

static void count_transfer(kiln_device *dev, int to_device, size_t n, double secs)
{
    kiln_device_count_transfer(dev, to_device, n, secs);
}

static void release_mapped(kiln_storage *s);

/* Every copy read from a file's mapping first checks that the file on disk is still
 * the one mapped: a file truncated under us faults (SIGBUS) on the first page past
 * its new end, where an error value is still possible here. A truncation after the
 * check (or one the stamp misses) is caught by the copy itself (mapped_read.c). */
kiln_status kiln_model_check_source(const kiln_tensor *src)
{
    if (src->storage->release != release_mapped) return KILN_OK;
    return kiln_st_check(src->storage->ctx);
}

const char *kiln_model_mapped_path(const kiln_tensor *t)
{
    if (!t || t->storage->release != release_mapped) return NULL;
    return ((const kiln_st_file *)t->storage->ctx)->path;
}

/* A copy onto dev that must not read its source: dev is meta, or a dry run is on and
 * the copy is a host one (the file is never read during a dry run; the host copy
 * reads as zeros and is dropped when the run ends). *out is the copy, its bytes
 * accounted as a real one's; 0 when the copy is an ordinary one. */
static int dry_copy(const kiln_tensor *src, kiln_device *dev, kiln_dtype dt, const char *owner,
                    kiln_tensor **out, kiln_status *st)
{
    *out = NULL;
    *st = KILN_OK;
    if (kiln_device_is_meta(dev)) {
        if ((*st = kiln_tensor_new(dev, dt, src->ndim, src->shape, out))) return 1;
        kiln_storage_set_owner((*out)->storage, owner);
        count_transfer(dev, 1, kiln_tensor_nbytes(*out), 0);
        return 1;
    }
    if (dev->type != KILN_DEV_CPU || !kiln_meta_target()) return 0;
    size_t n = kiln_dtype_nbytes(dt, kiln_tensor_numel(src));
    kiln_storage *s = kiln_meta_host_storage(n);
    if (!s) { *st = kiln_error(KILN_ERR_OOM, "dry run: no address space for a host copy of %zu bytes", n); return 1; }
    kiln_storage_set_owner(s, owner);
    *out = kiln_tensor_from_storage(s, 0, dt, src->ndim, src->shape, NULL);
    kiln_storage_release(s);
    if (!*out) *st = kiln_error(KILN_ERR_OOM, "out of host memory");
    return 1;
}

/* A new copy of src on dev in dtype dt, accounted to owner. Host sources (the file
 * or a host copy) are converted straight into the new copy (through a bounded
 * staging buffer for devices with their own memory); anything else goes through
 * kiln_tensor_to. Must not be called with kiln_model_mu held (it allocates). */
static kiln_status copy_to(const kiln_tensor *src, kiln_device *dev, kiln_dtype dt, const char *owner,
                           kiln_tensor **out)
{
    *out = NULL;
    kiln_status st;
    kiln_tensor *r;
    if (dry_copy(src, dev, dt, owner, out, &st)) return st;
    if (tensor_device(src)->type != KILN_DEV_CPU || !kiln_tensor_is_contiguous(src)) {
        if ((st = kiln_tensor_to(src, dev, dt, &r))) return st;
        kiln_storage_set_owner(r->storage, owner);
        *out = r;
        return KILN_OK;
    }
    if ((st = kiln_tensor_new(dev, dt, src->ndim, src->shape, &r))) return st;
    kiln_storage_set_owner(r->storage, owner);
    double t0 = kiln_events_now();
    st = kiln_model_fill_from_host(r, kiln_tensor_data(src), src->dtype, kiln_model_mapped_path(src));
    if (st) { kiln_tensor_free(r); return st; }
    count_transfer(dev, 1, kiln_tensor_nbytes(r), kiln_events_now() - t0);
    *out = r;
    return KILN_OK;
}

/* dst (contiguous, on any device) = n elements at src (host memory, dtype sdt),
 * converted to dst's dtype; devices with their own memory get them through a
 * bounded staging buffer. path: the file src is mapped from, or NULL: reads of a
 * mapping go through kiln_mapped_read (a truncated file is an error, not SIGBUS), so
 * they are staged on the host even without a conversion (a device's own copy
 * routine, a driver call, is not a place to jump out of). */
kiln_status kiln_model_fill_from_host(kiln_tensor *dst, const void *src, kiln_dtype sdt, const char *path)
{
    kiln_device *dev = tensor_device(dst);
    kiln_dtype dt = dst->dtype;
    size_t n = (size_t)kiln_tensor_numel(dst);
    kiln_status st = KILN_OK;
    if (n == 0 || kiln_device_is_meta(dev)) return KILN_OK;
    if (!dev->backend->to_device) {
        st = kiln_mapped_read(path, kiln_tensor_data(dst), dt, src, sdt, n);
    } else if (dt == sdt && !path) {
        st = dev->backend->to_device(kiln_tensor_data(dst), src, kiln_tensor_nbytes(dst));
    } else {
        /* pieces in whole blocks of any block type (256 elements), byte offsets by dtype */
        size_t chunk = STAGE_BYTES / 8 / 256 * 256;
        if (chunk > n) chunk = n;
        void *stage = NULL;
        st = kiln_allocator_alloc(kiln_device_cpu()->alloc, kiln_dtype_nbytes(dt, (int64_t)chunk), &stage);
        for (size_t off = 0; !st && off < n; off += chunk) {
            size_t k = n - off < chunk ? n - off : chunk;
            st = kiln_mapped_read(path, stage, dt, (const char *)src + kiln_dtype_nbytes(sdt, (int64_t)off), sdt, k);
            if (!st) st = dev->backend->to_device((char *)kiln_tensor_data(dst) + kiln_dtype_nbytes(dt, (int64_t)off), stage,
                                         kiln_dtype_nbytes(dt, (int64_t)k));
        }
        if (stage) kiln_allocator_release(kiln_device_cpu()->alloc, stage);
    }
    return st;
}

/* Under kiln_model_mu: what a new copy of t in dtype want is made from. Unpatched: the host
 * copy, else the file. Patched: the host copy when it already has that dtype (it
 * carries the patches), else the file plus the patch set (*ps retained). */
kiln_tensor *kiln_model_source_locked(const mtensor *t, kiln_dtype want, patchset **ps)
{
    *ps = NULL;
    if (t->ps && !(t->host && t->host->dtype == want)) {
        *ps = kiln_patchset_retain(t->ps);
        return kiln_tensor_view_of(t->mapped);
    }
    return kiln_tensor_view_of(source_of(t));
}

/* A new copy on dev in dtype dt from what kiln_model_source_locked gave. */
kiln_status kiln_model_make_copy(const kiln_tensor *src, const patchset *ps, kiln_device *dev, kiln_dtype dt,
                                 const char *owner, kiln_tensor **out)
{
    *out = NULL;
    kiln_status cs;
    if (dry_copy(src, dev, dt, owner, out, &cs)) return cs; /* patches too: nothing is computed */
    if ((cs = kiln_model_check_source(src))) return cs;
    if (!ps) return copy_to(src, dev, dt, owner, out);
    kiln_tensor *r;
    kiln_status st = kiln_tensor_new(dev, dt, src->ndim, src->shape, &r);
    if (st) return st;
    kiln_storage_set_owner(r->storage, owner);
    double t0 = kiln_events_now();
    if ((st = kiln_patchset_build_into(r, src, ps))) { kiln_tensor_free(r); return st; }
    count_transfer(dev, 1, kiln_tensor_nbytes(r), kiln_events_now() - t0);
    *out = r;
    return KILN_OK;
}

/* Fills dst (a copy's storage already allocated on its device, in the dtype and shape
 * of the copy) from what kiln_model_source_locked gave: the copy thread's half of a
 * prefetch whose memory the caller took when it queued the copy. */
kiln_status kiln_model_fill_copy(const kiln_tensor *src, const patchset *ps, kiln_tensor *dst)
{
    kiln_status st;
    if ((st = kiln_model_check_source(src))) return st;
    kiln_device *dev = tensor_device(dst);
    double t0 = kiln_events_now();
    if (ps) {
        st = kiln_patchset_build_into(dst, src, ps);
    } else if (tensor_device(src)->type != KILN_DEV_CPU) {
        kiln_tensor *r;
        if ((st = kiln_tensor_to(src, dev, dst->dtype, &r))) return st;
        st = kiln_tensor_copy(dst, r);
        kiln_tensor_free(r);
    } else if (!kiln_tensor_is_contiguous(src)) {
        kiln_tensor *c;
        if ((st = kiln_tensor_contiguous(src, &c))) return st;
        st = kiln_model_fill_from_host(dst, kiln_tensor_data(c), c->dtype, NULL);
        kiln_tensor_free(c);
    } else {
        st = kiln_model_fill_from_host(dst, kiln_tensor_data(src), src->dtype, kiln_model_mapped_path(src));
    }
    if (!st) count_transfer(dev, 1, kiln_tensor_nbytes(dst), kiln_events_now() - t0);
    return st;
}

/* ---- eviction ---- */

static int evictable_on(const kiln_model *m, const kiln_device *dev)
{
    for (int i = 0; i < m->n; i++) {
        const mtensor *t = &m->t[i];
        if (t->dev && tensor_device(t->dev) == dev && !t->fetched) return 1;
        if (t->host && tensor_device(t->host) == dev) return 1;
    }
    return 0;
}

/* Drops *slot, returning the bytes that really go back to the allocator. */
static size_t drop_counted(kiln_tensor **slot, uint64_t *bytes)
{
    kiln_storage *s = (*slot)->storage;
    size_t n = s->nbytes;
    int alone = atomic_load((atomic_int *)&s->refcount) == 1;
    *bytes += n;
    drop(slot);
    return alone ? n : 0;
}

/* Evicts whole models (their copies on dev), least recently used first. With
 * one_step it stops after the first model that gave memory back: the allocator
 * retries and asks again if that was not enough, so no more is evicted than the
 * allocation needs (`need` is what the allocator would need in fresh segments,
 * an overestimate when freed blocks can be reused). */
static size_t evict_locked(kiln_device *dev, size_t need, int one_step)
{
    size_t freed = 0;
    while (freed < need) {
        kiln_model *victim = NULL;
        for (kiln_model *m = kiln_model_list; m; m = m->next) {
            if (m->pinned || m->busy || !evictable_on(m, dev)) continue;
            if (!victim || m->last_used < victim->last_used) victim = m;
        }
        if (!victim) {
            freed += kiln_model_drop_queued_locked(dev);
            break;
        }
        uint64_t bytes = 0;
        size_t really = 0;
        int count = 0;
        for (int i = 0; i < victim->n; i++) {
            mtensor *t = &victim->t[i];
            if (t->dev && tensor_device(t->dev) == dev && !t->fetched) {
                really += drop_counted(&t->dev, &bytes);
                t->streamed = t->prefetched = 0;
                count++;
            }
            if (t->host && tensor_device(t->host) == dev) {
                really += drop_counted(&t->host, &bytes);
                count++;
            }
        }
        freed += really;
        char nb[32], rb[32];
        kiln_format_bytes(nb, sizeof nb, (double)need);
        kiln_format_bytes(rb, sizeof rb, (double)(bytes - really));
        kiln_event_emit(KILN_EV_EVICT, dev->name, bytes, victim->owner,
                        "%d tensors, least recently used, for an allocation short of %s%s%s", count, nb,
                        bytes > really ? "; still referenced elsewhere: " : "", bytes > really ? rb : "");
        if (one_step && really) break;
    }
    return freed;
}

size_t kiln_model_evict(kiln_device *dev, size_t need)
{
    if (!dev) return 0;
    pthread_mutex_lock(&kiln_model_mu);
    size_t freed = evict_locked(dev, need ? need : 1, 0);
    pthread_mutex_unlock(&kiln_model_mu);
    return freed;
}

/* The devices' evictor, after the kernels' caches of weights (device.c; called without
 * the allocator's lock). */
static size_t evict_hook(kiln_device *dev, size_t need)
{
    if (kiln_memory_mode_get() == KILN_MEM_HIGH) return 0;
    pthread_mutex_lock(&kiln_model_mu);
    size_t freed = evict_locked(dev, need ? need : 1, 1);
    pthread_mutex_unlock(&kiln_model_mu);
    return freed;
}

static void drop_dry_copies(kiln_device *meta);

static void init_runtime(void)
{
    kiln_model_stream_init();
    kiln_device_set_evictor(evict_hook);
    kiln_meta_set_end_hook(drop_dry_copies);
}

/* ---- open / close ---- */

static void release_mapped(kiln_storage *s) { kiln_st_release(s->ctx); }

static void base_name(const char *path, char *out, size_t cap)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t n = strlen(b);
    static const char *const exts[] = {".safetensors", ".gguf"};
    for (int i = 0; i < 2; i++) {
        size_t k = strlen(exts[i]);
        if (n > k && strcmp(b + n - k, exts[i]) == 0) n -= k;
    }
    if (n >= cap) n = cap - 1;
    memcpy(out, b, n);
    out[n] = 0;
}

static void model_free_all(kiln_model *m)
{
    for (int i = 0; i < m->n; i++) {
        mtensor *t = &m->t[i];
        kiln_tensor_free(t->dev);
        kiln_tensor_free(t->parked);
        kiln_tensor_free(t->host);
        kiln_tensor_free(t->mapped);
        kiln_patchset_release(t->ps);
    }
    for (int i = 0; i < m->n_files; i++) kiln_st_release(m->files[i]);
    free(m->files);
    free(m->t);
    free(m->slots);
    free(m);
}

static int has_prefix(const char *s, const char *const *prefixes, int n)
{
    if (n == 0) return 1;
    for (int i = 0; i < n; i++)
        if (prefixes[i] && strncmp(s, prefixes[i], strlen(prefixes[i])) == 0) return 1;
    return 0;
}

kiln_status kiln_model_open(const char *const *paths, int n, const char *name, kiln_model **out)
{
    return kiln_model_open_prefixed(paths, n, name, NULL, 0, out);
}

kiln_status kiln_model_open_prefixed(const char *const *paths, int n, const char *name,
                                     const char *const *prefixes, int n_prefixes, kiln_model **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "kiln_model_open: out is NULL");
    if (n_prefixes < 0 || (n_prefixes > 0 && !prefixes)) return kiln_error(KILN_ERR_ARG, "model: bad prefix list");
    *out = NULL;
    if (!paths || n < 1) return kiln_error(KILN_ERR_ARG, "model: at least one safetensors file is required");
    for (int i = 0; i < n; i++)
        if (!paths[i]) return kiln_error(KILN_ERR_ARG, "model: file %d of %d is NULL", i + 1, n);
    pthread_once(&init_once, init_runtime);
    kiln_model *m = calloc(1, sizeof *m);
    if (!m || !(m->files = calloc((size_t)n, sizeof *m->files))) {
        free(m);
        return kiln_error(KILN_ERR_OOM, "model: out of host memory");
    }
    kiln_status st;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if ((st = kiln_weights_open(paths[i], &m->files[i]))) { model_free_all(m); return st; }
        m->n_files++;
        total += (size_t)m->files[i]->n;
    }
    size_t cap = 8;
    while (cap < total * 2) cap *= 2;
    m->t = calloc(total ? total : 1, sizeof *m->t);
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->t || !m->slots) { model_free_all(m); return kiln_error(KILN_ERR_OOM, "model: out of host memory"); }
    for (size_t s = 0; s < cap; s++) m->slots[s] = -1;
    m->slot_mask = cap - 1;
    for (int f = 0; f < m->n_files; f++) {
        kiln_st_file *file = m->files[f];
        for (int e = 0; e < file->n; e++) {
            if (!has_prefix(file->entries[e].name, prefixes, n_prefixes)) continue;
            int idx = kiln_model_find(m, file->entries[e].name);
            if (idx < 0) {
                idx = m->n++;
                m->t[idx].name = file->entries[e].name;
                slot_insert(m, idx);
            }
            m->t[idx].name = file->entries[e].name; /* a later file overrides */
            m->t[idx].file = file;
            m->t[idx].index = e;
        }
    }
    if (name && *name) snprintf(m->name, sizeof m->name, "%s", name);
    else base_name(paths[0], m->name, sizeof m->name);
    if (n_prefixes > 0 && m->n == 0 && total > 0) {
        char list[256] = "";
        for (int i = 0; i < n_prefixes; i++) {
            size_t used = strlen(list);
            snprintf(list + used, sizeof list - used, "%s'%s'", i ? ", " : "", prefixes[i] ? prefixes[i] : "");
        }
        kiln_status err = kiln_error(KILN_ERR_ARG, "model '%s': no tensor of %s%s starts with %s", m->name, paths[0],
                                     n > 1 ? " (and the other files)" : "", list);
        model_free_all(m);
        return err;
    }
    snprintf(m->owner, sizeof m->owner, "model:%s", m->name);
    static char empty_data[KILN_ALLOC_ALIGN];
    for (int i = 0; i < m->n; i++) {
        mtensor *t = &m->t[i];
        const kiln_st_entry *e = &t->file->entries[t->index];
        void *data = t->file->data ? (void *)kiln_st_data(t->file, t->index) : (void *)empty_data;
        kiln_st_retain(t->file);
        kiln_storage *s = kiln_storage_wrap(kiln_device_cpu(), data, (size_t)(e->end - e->begin), release_mapped, t->file);
        if (!s) { kiln_st_release(t->file); model_free_all(m); return kiln_error(KILN_ERR_OOM, "model: out of host memory"); }
        kiln_storage_set_owner(s, m->owner);
        t->mapped = kiln_tensor_from_storage(s, 0, e->dtype, e->ndim, e->shape, NULL);
        kiln_storage_release(s);
        if (!t->mapped) { model_free_all(m); return kiln_error(KILN_ERR_OOM, "model: out of host memory"); }
    }
    m->dtype = -1;
    pthread_mutex_lock(&kiln_model_mu);
    m->last_used = ++kiln_model_clock;
    m->next = kiln_model_list;
    if (kiln_model_list) kiln_model_list->prev = m;
    kiln_model_list = m;
    pthread_mutex_unlock(&kiln_model_mu);
    *out = m;
    return KILN_OK;
}

static uint64_t drop_copies_locked(kiln_model *m)
{
    uint64_t bytes = 0;
    for (int i = 0; i < m->n; i++) {
        mtensor *t = &m->t[i];
        /* a real copy parked by a dry run stays until the run ends, unless the model
         * closes (an unload inside a dry run leaves the real device as it was) */
        if (!kiln_meta_target()) drop(&t->parked);
        bytes += tensor_bytes(t->dev) + tensor_bytes(t->host);
        drop(&t->dev);
        drop(&t->host);
        t->streamed = t->fetched = t->prefetched = 0;
    }
    return bytes;
}

/* meta's end hook (registered by init_runtime): the end of a dry run drops every model
 * copy on meta and every host copy made without reading its file, so later loads read
 * the real weights, and puts back the real device copies the run's copies stood in for. */
static void drop_dry_copies(kiln_device *meta)
{
    pthread_mutex_lock(&kiln_model_mu);
    for (kiln_model *m = kiln_model_list; m; m = m->next) kiln_model_cancel_prefetches_locked(m);
    for (kiln_model *m = kiln_model_list; m; m = m->next) {
        int dropped = 0;
        kiln_device *restored = NULL;
        for (int i = 0; i < m->n; i++) {
            mtensor *t = &m->t[i];
            if (t->dev && (tensor_device(t->dev) == meta || kiln_meta_is_host_storage(t->dev->storage))) {
                drop(&t->dev);
                t->streamed = t->fetched = t->prefetched = 0;
                dropped = 1;
            }
            if (t->parked && !t->dev) {
                t->dev = t->parked;
                t->parked = NULL;
                restored = tensor_device(t->dev);
            }
            drop(&t->parked); /* a copy of its own came back meanwhile */
            if (t->host && (tensor_device(t->host) == meta || kiln_meta_is_host_storage(t->host->storage))) {
                drop(&t->host);
                t->patch_host = 0;
                dropped = 1;
            }
        }
        if (restored) m->target = restored; /* as before the run, whatever it loaded or unloaded */
        else if (dropped && m->target == meta) m->target = NULL;
    }
    pthread_mutex_unlock(&kiln_model_mu);
}

void kiln_model_close(kiln_model *m)
{
    if (!m) return;
    pthread_mutex_lock(&kiln_model_mu);
    kiln_model_cancel_prefetches_locked(m);
    if (m->prev) m->prev->next = m->next;
    else kiln_model_list = m->next;
    if (m->next) m->next->prev = m->prev;
    const char *dev = m->target ? m->target->name : "";
    uint64_t bytes = drop_copies_locked(m);
    if (bytes) kiln_event_emit(KILN_EV_UNLOAD, dev, bytes, m->owner, "closed");
    /* The last model gone: the copy threads have nothing left to do. */
    worker *stop[MAX_QUEUES];
    int n_stop = kiln_model_list ? 0 : kiln_model_stop_copy_threads_locked(stop);
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_model_join_copy_threads(stop, n_stop);
    model_free_all(m);
}

/* ---- queries ---- */

const char *kiln_model_name(const kiln_model *m) { return m ? m->name : "?"; }
int kiln_model_count(const kiln_model *m) { return m ? m->n : 0; }

const char *kiln_model_tensor_name(const kiln_model *m, int i)
{
    return m && i >= 0 && i < m->n ? m->t[i].name : NULL;
}

static kiln_residency residency_of(const mtensor *t)
{
    return t->dev ? KILN_RES_DEVICE : t->host ? KILN_RES_HOST : KILN_RES_MAPPED;
}

kiln_status kiln_model_tensor(kiln_model *m, const char *name, kiln_tensor **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "model tensor: out is NULL");
    *out = NULL;
    if (!m || !name) return kiln_error(KILN_ERR_ARG, "model tensor: model and name are required");
    int i = kiln_model_find(m, name);
    if (i < 0) return kiln_model_missing_error(m, name);
    pthread_mutex_lock(&kiln_model_mu);
    mtensor *t = &m->t[i];
    if (t->ps && !t->dev && !t->host) {
        /* the file's view would show the weight without its patches: build a host
         * copy (accounted to the model) and hand that out */
        patchset *ps;
        kiln_tensor *src = kiln_model_source_locked(t, t->mapped->dtype, &ps);
        m->busy++;
        pthread_mutex_unlock(&kiln_model_mu);
        kiln_tensor *r = NULL;
        kiln_status st = src ? kiln_model_make_copy(src, ps, kiln_device_cpu(), src->dtype, m->owner, &r)
                             : kiln_error(KILN_ERR_OOM, "out of host memory");
        kiln_tensor_free(src);
        kiln_patchset_release(ps);
        pthread_mutex_lock(&kiln_model_mu);
        m->busy--;
        if (st) {
            pthread_mutex_unlock(&kiln_model_mu);
            char prefix[200];
            snprintf(prefix, sizeof prefix, "model '%s': patched tensor '%s': ", m->name, name);
            return kiln_model_prefix_error(st, prefix);
        }
        if (!t->dev && !t->host) {
            t->host = r;
            t->patch_host = 1;
        } else {
            kiln_tensor_free(r);
        }
    }
    const kiln_tensor *best = t->dev ? t->dev : t->host ? t->host : t->mapped;
    kiln_tensor *v = kiln_tensor_view_of(best);
    m->last_used = ++kiln_model_clock;
    pthread_mutex_unlock(&kiln_model_mu);
    if (!v) return kiln_error(KILN_ERR_OOM, "model '%s': out of host memory for a tensor header", m->name);
    /* the file's own view is read by whatever runs next: it must still be the file */
    kiln_status cs = kiln_model_check_source(v);
    if (cs) {
        kiln_tensor_free(v);
        char prefix[200];
        snprintf(prefix, sizeof prefix, "model '%s': tensor '%s': ", m->name, name);
        return kiln_model_prefix_error(cs, prefix);
    }
    *out = v;
    return KILN_OK;
}

kiln_status kiln_model_where(kiln_model *m, const char *name, kiln_residency *out)
{
    if (!m || !name || !out) return kiln_error(KILN_ERR_ARG, "model where: model, name and out are required");
    int i = kiln_model_find(m, name);
    if (i < 0) return kiln_model_missing_error(m, name);
    pthread_mutex_lock(&kiln_model_mu);
    *out = residency_of(&m->t[i]);
    pthread_mutex_unlock(&kiln_model_mu);
    return KILN_OK;
}

void kiln_model_get_info(kiln_model *m, kiln_model_info *o)
{
    memset(o, 0, sizeof *o);
    if (!m) return;
    pthread_mutex_lock(&kiln_model_mu);
    o->n_tensors = m->n;
    for (int i = 0; i < m->n; i++) {
        const mtensor *t = &m->t[i];
        kiln_residency r = residency_of(t);
        o->count[r]++;
        o->bytes[r] += tensor_bytes(r == KILN_RES_DEVICE ? t->dev : r == KILN_RES_HOST ? t->host : t->mapped);
        o->file_bytes += tensor_bytes(t->mapped);
        if (t->host) o->host_bytes += tensor_bytes(t->host);
        if (t->dev) {
            if (tensor_device(t->dev)->type == KILN_DEV_CPU) o->host_bytes += tensor_bytes(t->dev);
            else o->device_bytes += tensor_bytes(t->dev);
        }
    }
    o->device = m->target;
    o->dtype = m->dtype;
    o->pinned = m->pinned;
    o->last_used = m->last_used;
    o->n_fetch_copies = m->n_fetch;
    o->n_prefetch_copies = m->n_prefetch;
    o->n_prefetch_waits = m->n_waits;
    o->n_prefetch_hits = m->n_hits;
    o->prefetch_thread = m->prefetch_tid;
    pthread_mutex_unlock(&kiln_model_mu);
}

static uint64_t bytes_on_locked(const kiln_model *m, const kiln_device *dev, int *count)
{
    uint64_t b = 0;
    int c = 0;
    for (int i = 0; i < m->n; i++) {
        const mtensor *t = &m->t[i];
        int here = 0;
        if (t->dev && (!dev || tensor_device(t->dev) == dev)) { b += tensor_bytes(t->dev); here = 1; }
        if (t->host && (!dev || tensor_device(t->host) == dev)) { b += tensor_bytes(t->host); here = 1; }
        c += here;
    }
    if (count) *count = c;
    return b;
}

uint64_t kiln_model_bytes(kiln_model *m, const kiln_device *dev)
{
    if (!m) return 0;
    pthread_mutex_lock(&kiln_model_mu);
    uint64_t b = bytes_on_locked(m, dev, NULL);
    pthread_mutex_unlock(&kiln_model_mu);
    return b;
}

static int by_recent(const void *x, const void *y)
{
    const kiln_model *a = *(kiln_model *const *)x, *b = *(kiln_model *const *)y;
    return a->last_used < b->last_used ? 1 : a->last_used > b->last_used ? -1 : 0;
}

int kiln_model_usage_list(kiln_model_usage *out, int max)
{
    pthread_mutex_lock(&kiln_model_mu);
    int n_models = 0;
    for (kiln_model *m = kiln_model_list; m; m = m->next) n_models++;
    kiln_model **list = malloc(sizeof *list * (size_t)(n_models ? n_models : 1));
    if (!list) { pthread_mutex_unlock(&kiln_model_mu); return 0; }
    int k = 0;
    for (kiln_model *m = kiln_model_list; m; m = m->next) list[k++] = m;
    qsort(list, (size_t)n_models, sizeof *list, by_recent);
    int rows = 0;
    for (int i = 0; i < n_models; i++) {
        kiln_model *m = list[i];
        int any = 0;
        for (int d = 0; d <= kiln_device_count(); d++) {
            kiln_device *dev = d < kiln_device_count() ? kiln_device_at(d) : NULL;
            int count = 0;
            uint64_t b = dev ? bytes_on_locked(m, dev, &count) : 0;
            if (dev ? count == 0 : any) continue;
            any = 1;
            if (rows < max) {
                kiln_model_usage *u = &out[rows];
                memset(u, 0, sizeof *u);
                /* a model by its name; other owners (LoRA files) by their owner tag */
                snprintf(u->model, sizeof u->model, "%s", strncmp(m->owner, "model:", 6) == 0 ? m->name : m->owner);
                snprintf(u->device, sizeof u->device, "%s", dev ? dev->name : "");
                u->bytes = dev ? b : 0;
                u->tensors = count;
                u->total = m->n;
                u->pinned = m->pinned;
                u->last_used = m->last_used;
            }
            rows++;
        }
    }
    free(list);
    pthread_mutex_unlock(&kiln_model_mu);
    return rows;
}

/* ---- load / offload / unload / pin ---- */

static void load_error_prefix(kiln_model *m, kiln_device *dev, char *buf, size_t cap)
{
    kiln_memory_mode mode = kiln_memory_mode_get();
    size_t used = (size_t)snprintf(buf, cap, "model '%s': loading onto %s (memory mode %s%s", m->name, dev->name,
                                   kiln_memory_mode_name(mode),
                                   mode == KILN_MEM_HIGH ? ": nothing is evicted automatically" : "");
    int first = 1;
    pthread_mutex_lock(&kiln_model_mu);
    for (kiln_model *o = kiln_model_list; o && used < cap; o = o->next) {
        if (o == m || !o->pinned) continue;
        used += (size_t)snprintf(buf + used, cap - used, "%s%s", first ? "; pinned: " : ", ", o->name);
        first = 0;
    }
    pthread_mutex_unlock(&kiln_model_mu);
    if (used < cap) snprintf(buf + used, cap - used, "): ");
}

kiln_status kiln_model_load(kiln_model *m, kiln_device *dev, int dtype)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "model load: model is NULL");
    if (dtype >= KILN_DTYPE_COUNT || dtype < -1) return kiln_error(KILN_ERR_ARG, "model '%s': load: bad dtype %d", m->name, dtype);
    kiln_memory_mode mode = kiln_memory_mode_get();
    if (!dev || mode == KILN_MEM_NONE) dev = kiln_device_cpu();
    /* a model set to stream always keeps its weights on the host in every mode; one set
     * to load whole (a residency of all its bytes) puts them on dev in mode "low" too */
    int low = (m->stream_always > 0 || (mode == KILN_MEM_LOW && m->stream_always == 0)) && dev->type != KILN_DEV_CPU;
    unsigned char *made = calloc((size_t)(m->n ? m->n : 1), 1);
    if (!made) return kiln_error(KILN_ERR_OOM, "model '%s': out of host memory", m->name);
    pthread_mutex_lock(&kiln_model_mu);
    m->busy++;
    m->target = dev;
    m->dtype = dtype;
    m->last_used = ++kiln_model_clock;
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_events_set_context(m->owner);
    double t0 = kiln_events_now();
    kiln_status st = KILN_OK;
    int copied = 0;
    for (int i = 0; i < m->n && !st; i++) {
        mtensor *t = &m->t[i];
        kiln_device *to = low ? kiln_device_cpu() : dev;
        pthread_mutex_lock(&kiln_model_mu);
        kiln_dtype want = kiln_model_want_dtype(dtype, source_of(t));
        int have;
        if (low) {
            /* the host side of streaming: the file itself unless a conversion is due */
            have = t->host ? t->host->dtype == want : want == t->mapped->dtype;
        } else {
            have = t->dev && tensor_device(t->dev) == dev && (dtype < 0 || t->dev->dtype == want);
            if (have) t->streamed = t->fetched = t->prefetched = 0; /* load owns it now (evictable again) */
            if (!have && dev->type == KILN_DEV_CPU && t->host && t->host->dtype == want) {
                /* a host copy is already what a cpu load wants */
                kiln_tensor_free(t->dev);
                t->dev = t->host;
                t->host = NULL;
                t->streamed = t->fetched = t->prefetched = 0;
                have = 1;
            }
        }
        patchset *ps = NULL;
        kiln_tensor *src = have ? NULL : kiln_model_source_locked(t, want, &ps);
        pthread_mutex_unlock(&kiln_model_mu);
        if (have) continue;
        if (!src) { kiln_patchset_release(ps); st = kiln_error(KILN_ERR_OOM, "out of host memory"); break; }
        kiln_tensor *r;
        st = kiln_model_make_copy(src, ps, to, want, m->owner, &r);
        kiln_tensor_free(src);
        kiln_patchset_release(ps);
        if (st) break;
        pthread_mutex_lock(&kiln_model_mu);
        if (low) {
            kiln_tensor_free(t->host);
            t->host = r;
        } else {
            kiln_model_set_dev_locked(t, r);
        }
        if (low) t->patch_host = 0;
        if (!low) { t->streamed = t->fetched = t->prefetched = 0; made[i] = 1; }
        pthread_mutex_unlock(&kiln_model_mu);
        copied++;
    }
    pthread_mutex_lock(&kiln_model_mu);
    if (st) {
        for (int i = 0; i < m->n; i++)
            if (made[i]) drop(&m->t[i].dev);
    } else if (!low) {
        /* the device copies exist: host copies would only double the memory (the
         * mapped file can always give them back) */
        for (int i = 0; i < m->n; i++) drop(&m->t[i].host);
    }
    m->busy--;
    uint64_t bytes = bytes_on_locked(m, low ? kiln_device_cpu() : dev, NULL);
    pthread_mutex_unlock(&kiln_model_mu);
    free(made);
    kiln_events_set_context(NULL);
    if (st) {
        char prefix[400];
        load_error_prefix(m, dev, prefix, sizeof prefix);
        return kiln_model_prefix_error(st, prefix);
    }
    kiln_event_emit(KILN_EV_LOAD, low ? kiln_device_cpu()->name : dev->name, bytes, m->owner,
                    "%d tensors, %d copied, dtype %s, mode %s%s%s, %.1f ms", m->n, copied,
                    dtype < 0 ? "as stored" : kiln_dtype_name((kiln_dtype)dtype), kiln_memory_mode_name(mode),
                    low ? ", streamed to " : "", low ? dev->name : "", (kiln_events_now() - t0) * 1e3);
    return KILN_OK;
}

kiln_status kiln_model_offload(kiln_model *m)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "model offload: model is NULL");
    pthread_mutex_lock(&kiln_model_mu);
    kiln_model_cancel_prefetches_locked(m);
    m->busy++;
    const char *from = m->target ? m->target->name : "?";
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_events_set_context(m->owner);
    kiln_device *cpu = kiln_device_cpu();
    kiln_status st = KILN_OK;
    int moved = 0;
    for (int i = 0; i < m->n && !st; i++) {
        mtensor *t = &m->t[i];
        pthread_mutex_lock(&kiln_model_mu);
        kiln_tensor *src = NULL;
        if (t->dev && tensor_device(t->dev) == cpu) {
            kiln_tensor_free(t->host);
            t->host = t->dev;
            t->dev = NULL;
            t->patch_host = 0;
            t->streamed = t->fetched = t->prefetched = 0;
            moved++;
        } else if (t->dev) {
            src = kiln_tensor_view_of(t->dev);
            if (!src) st = kiln_error(KILN_ERR_OOM, "out of host memory");
        }
        pthread_mutex_unlock(&kiln_model_mu);
        if (!src) continue;
        kiln_tensor *h;
        double t0 = kiln_events_now();
        st = copy_to(src, cpu, src->dtype, m->owner, &h);
        if (!st) count_transfer(tensor_device(src), 0, tensor_bytes(h), kiln_events_now() - t0);
        kiln_tensor_free(src);
        if (st) break;
        pthread_mutex_lock(&kiln_model_mu);
        kiln_tensor_free(t->host);
        t->host = h;
        t->patch_host = 0;
        drop(&t->dev);
        t->streamed = t->fetched = t->prefetched = 0;
        pthread_mutex_unlock(&kiln_model_mu);
        moved++;
    }
    pthread_mutex_lock(&kiln_model_mu);
    m->busy--;
    uint64_t bytes = bytes_on_locked(m, cpu, NULL);
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_events_set_context(NULL);
    if (st) {
        char prefix[160];
        snprintf(prefix, sizeof prefix, "model '%s': offloading to host memory: ", m->name);
        return kiln_model_prefix_error(st, prefix);
    }
    kiln_event_emit(KILN_EV_OFFLOAD, cpu->name, bytes, m->owner, "%d tensors moved from %s", moved, from);
    return KILN_OK;
}

void kiln_model_unload(kiln_model *m)
{
    if (!m) return;
    pthread_mutex_lock(&kiln_model_mu);
    kiln_model_cancel_prefetches_locked(m);
    const char *dev = m->target ? m->target->name : "";
    uint64_t bytes = drop_copies_locked(m);
    m->target = NULL;
    m->dtype = -1;
    pthread_mutex_unlock(&kiln_model_mu);
    /* an unload is a request for the memory: the host allocator caches what is freed,
     * so give its wholly free segments (the dropped weights among them) and the
     * kernels' idle scratch back now */
    kiln_device_empty_cache(kiln_device_cpu());
    kiln_event_emit(KILN_EV_UNLOAD, dev, bytes, m->owner, "every copy dropped but the mapped file");
}

void kiln_model_pin(kiln_model *m)
{
    if (!m) return;
    pthread_mutex_lock(&kiln_model_mu);
    m->pinned++;
    pthread_mutex_unlock(&kiln_model_mu);
}

kiln_status kiln_model_unpin(kiln_model *m)
{
    if (!m) return kiln_error(KILN_ERR_ARG, "model unpin: model is NULL");
    pthread_mutex_lock(&kiln_model_mu);
    int was = m->pinned;
    if (was) m->pinned--;
    pthread_mutex_unlock(&kiln_model_mu);
    if (!was) return kiln_error(KILN_ERR_STATE, "model '%s': unpin without a matching pin", m->name);
    return KILN_OK;
}

/* ---- the owner's kind ---- */

kiln_status kiln_model_set_owner_kind(kiln_model *m, const char *kind)
{
    if (!m || !kind || !*kind) return kiln_error(KILN_ERR_ARG, "model owner: model and kind are required");
    for (const char *c = kind; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-'))
            return kiln_error(KILN_ERR_ARG, "model '%s': owner kind '%s': letters, digits, '_' and '-' only", m->name, kind);
    if (strlen(kind) + 1 + strlen(m->name) >= sizeof m->owner)
        return kiln_error(KILN_ERR_ARG, "model '%s': owner kind '%s' is too long", m->name, kind);
    pthread_mutex_lock(&kiln_model_mu);
    snprintf(m->owner, sizeof m->owner, "%s:%s", kind, m->name);
    for (int i = 0; i < m->n; i++) {
        mtensor *t = &m->t[i];
        kiln_storage_set_owner(t->mapped->storage, m->owner);
        if (t->host) kiln_storage_set_owner(t->host->storage, m->owner);
        if (t->dev) kiln_storage_set_owner(t->dev->storage, m->owner);
    }
    pthread_mutex_unlock(&kiln_model_mu);
    return KILN_OK;
}

const char *kiln_model_owner(const kiln_model *m) { return m ? m->owner : "?"; }

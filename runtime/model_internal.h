/* model_internal.h - what model.c (stores, residency, load / offload / unload, modes,
 * eviction), model_stream.c (fetch / prefetch / release, the copy threads) and
 * model_patch.c (the patch lists) share, and nothing else includes: model.h is the API.
 * Hidden like every symbol of the library but the public header's (-fvisibility=hidden).
 *
 * Locking: one registry mutex (kiln_model_mu) guards every model's state, the registry
 * and the copy queues. Nothing allocates from a device allocator while holding it: an
 * allocation may call the evict hook, which takes it. Freeing under it is fine
 * (releasing never calls back), and the events lock is a leaf. */
#ifndef KILN_MODEL_INTERNAL_H
#define KILN_MODEL_INTERNAL_H

#include "model.h"
#include "trace.h"
#include "backend.h"
#include "events.h"
#include "meta.h"
#include "safetensors.h"

#include <pthread.h>
#include <stdatomic.h>

#define MAX_QUEUES 16

/* The patches of a tensor (model_patch.c): immutable once published. */
typedef struct patchset patchset;

typedef struct {
    const char *name;        /* in the file's entry (the model retains the file) */
    kiln_st_file *file;
    int index;
    kiln_tensor *mapped;     /* view of the file (cpu, wrapped storage) */
    kiln_tensor *host;       /* host copy in the cpu allocator, or NULL */
    kiln_tensor *dev;        /* device copy, or NULL */
    kiln_tensor *parked;     /* the real device copy set aside while a dry run's copy on
                              * meta stands in its slot (put back when the run ends) */
    unsigned char streamed;  /* dev came from fetch/prefetch: release frees it */
    unsigned char fetched;   /* in use after fetch: not evictable until release */
    unsigned char prefetched;/* dev came from the copy thread and was not fetched yet */
    unsigned char inflight;  /* a prefetch is queued or copying */
    unsigned char patch_host;/* host exists only to show patched values (model_tensor) */
    struct patchset *ps;     /* patches, NULL when none (replaced whole, never edited) */
    unsigned gen;            /* bumped when ps changes: a copy built from an older ps is stale */
} mtensor;

struct kiln_model {
    char name[58];
    char owner[64];          /* "model:<name>" */
    int n;
    mtensor *t;
    int *slots;              /* open addressing: name -> index */
    size_t slot_mask;
    int n_files;
    kiln_st_file **files;
    kiln_device *target;     /* load target / streaming target, NULL when none */
    int dtype;               /* load dtype or -1 */
    int stream_always;       /* 1: loads keep the weights on the host for streaming, whatever
                              * the memory mode (a partial residency: the caller keeps some
                              * blocks fetched and streams the rest); -1: loads put them all
                              * on the device, in mode "low" too (a residency of all its
                              * bytes); 0: the memory mode decides */
    int pinned, busy, inflight;
    uint64_t last_used;
    uint64_t n_fetch, n_prefetch, n_waits, n_hits;
    int prefetch_tid;
    int next_patch_id;
    kiln_model *prev, *next;
};

/* ---- model.c: the registry ---- */

extern pthread_mutex_t kiln_model_mu;
extern kiln_model *kiln_model_list;   /* open models, most recently opened first */
extern uint64_t kiln_model_clock;

/* ---- small helpers ---- */

static inline kiln_device *tensor_device(const kiln_tensor *t) { return t->storage->device; }
static inline size_t tensor_bytes(const kiln_tensor *t) { return t ? t->storage->nbytes : 0; }

static inline void drop(kiln_tensor **t)
{
    kiln_tensor_free(*t);
    *t = NULL;
}

/* The copy new copies are made from: the host copy, else the file. */
static inline const kiln_tensor *source_of(const mtensor *t) { return t->host ? t->host : t->mapped; }

/* ---- model.c: copies ---- */

/* t->dev = r (under kiln_model_mu). A dry run's copy on meta does not free a real device
 * copy it replaces: that one is parked and comes back when the run ends. */
void kiln_model_set_dev_locked(mtensor *t, kiln_tensor *r);
/* Load dtype for a tensor: floating-point tensors convert to dtype (-1: as stored) where
 * the layout allows it (see model.c). */
kiln_dtype kiln_model_want_dtype(int dtype, const kiln_tensor *t);
/* The error for a name m does not have, with the closest names. */
kiln_status kiln_model_missing_error(const kiln_model *m, const char *name);
/* Re-raises the pending error with a prefix, keeping out-of-memory details. */
kiln_status kiln_model_prefix_error(kiln_status st, const char *prefix);
/* KILN_OK unless src is a file's view and the file changed on disk. */
kiln_status kiln_model_check_source(const kiln_tensor *src);
/* The path of the file whose mapping t views, or NULL when t is not a file's view. */
const char *kiln_model_mapped_path(const kiln_tensor *t);
/* dst (contiguous, on any device) = n elements at src (host memory, dtype sdt),
 * converted to dst's dtype. path: the file src is mapped from (its reads are guarded
 * against a truncated file, mapped_read.h), or NULL. */
kiln_status kiln_model_fill_from_host(kiln_tensor *dst, const void *src, kiln_dtype sdt, const char *path);
/* Under kiln_model_mu: what a new copy of t in dtype want is made from (*ps retained or
 * NULL). */
kiln_tensor *kiln_model_source_locked(const mtensor *t, kiln_dtype want, patchset **ps);
/* A new copy on dev in dtype dt from what kiln_model_source_locked gave; without
 * kiln_model_mu (it allocates). */
kiln_status kiln_model_make_copy(const kiln_tensor *src, const patchset *ps, kiln_device *dev, kiln_dtype dt,
                                 const char *owner, kiln_tensor **out);

/* Fills dst, allocated beforehand on its device in the copy's dtype and shape, from
 * what kiln_model_source_locked gave; without kiln_model_mu. */
kiln_status kiln_model_fill_copy(const kiln_tensor *src, const patchset *ps, kiln_tensor *dst);

/* ---- model_stream.c ---- */

typedef struct worker worker; /* a device's copy thread */

/* The copy queues' condition variables (once, from model.c's initialisation). */
void kiln_model_stream_init(void);
/* Under kiln_model_mu: takes the queued prefetches of m off the queues and waits for a
 * running one. */
void kiln_model_cancel_prefetches_locked(kiln_model *m);
/* Under kiln_model_mu: the prefetches queued for dev (not yet copying) give back the
 * memory they took and leave the queue; returns the bytes freed. */
size_t kiln_model_drop_queued_locked(kiln_device *dev);
/* Under kiln_model_mu: waits until no prefetch of t is queued or copying. */
void kiln_model_wait_tensor_locked(mtensor *t);
/* Under kiln_model_mu, once the last model is gone: tells every copy thread to quit and
 * takes it off its queue; stop (MAX_QUEUES entries) gets them, the count is returned. */
int kiln_model_stop_copy_threads_locked(worker **stop);
/* Without kiln_model_mu: joins and frees what kiln_model_stop_copy_threads_locked
 * gave. */
void kiln_model_join_copy_threads(worker **stop, int n);

/* ---- model_patch.c ---- */

patchset *kiln_patchset_retain(patchset *ps);
void kiln_patchset_release(patchset *ps);
/* dst (a copy of the tensor whose file view is `mapped`) = f32(mapped) + the deltas of
 * ps, cast to dst's dtype, in place; without kiln_model_mu (it allocates). */
kiln_status kiln_patchset_build_into(kiln_tensor *dst, const kiln_tensor *mapped, const patchset *ps);

#endif

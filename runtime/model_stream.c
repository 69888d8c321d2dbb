/* model_stream.c - streaming a model's weights tensor by tensor: fetch (now) / prefetch
 * (memory taken at once, the copy queued on a copy thread per device; the whole copy at
 * once in a dry run) / release, and partial
 * residency (a model whose loads keep the weights on the host to stream them). The
 * stores, copies and the registry lock are model.c's (model_internal.h). */
#define _GNU_SOURCE
#include "model_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* dst: the copy's memory, taken on the device by the thread that queued the prefetch
 * (NULL when that failed: the copy thread then allocates as fetch would) */
typedef struct job { kiln_model *m; int idx; kiln_tensor *dst; struct job *next; } job;
struct worker { pthread_t th; kiln_device *dev; int slot; int quit; };

static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER; /* a prefetch finished */
/* tests: seconds the copy thread waits before installing each copy (a thread that gets
 * no core); kiln_model_set_copy_delay */
static _Atomic double copy_delay;

static struct {
    job *head, *tail;
    worker *w;
    pthread_cond_t cv;
} queues[MAX_QUEUES];

/* Where a model streams to: its load target, or meta while a dry run models that
 * device (a target taken before the run would otherwise be the real device). */
static kiln_device *target_of(const kiln_model *m)
{
    kiln_device *mt = m->target ? kiln_meta_target() : NULL;
    return mt && m->target == mt ? kiln_device_meta() : m->target;
}

void kiln_model_stream_init(void)
{
    for (int i = 0; i < MAX_QUEUES; i++) pthread_cond_init(&queues[i].cv, NULL);
}

void kiln_model_cancel_prefetches_locked(kiln_model *m)
{
    for (int q = 0; q < MAX_QUEUES; q++) {
        job **pj = &queues[q].head, *last = NULL;
        while (*pj) {
            job *j = *pj;
            if (j->m == m) {
                *pj = j->next;
                m->t[j->idx].inflight = 0;
                m->inflight--;
                kiln_tensor_free(j->dst);
                free(j);
            } else {
                last = j;
                pj = &j->next;
            }
        }
        queues[q].tail = last;
    }
    while (m->inflight > 0) pthread_cond_wait(&done_cv, &kiln_model_mu);
}

void kiln_model_wait_tensor_locked(mtensor *t)
{
    while (t->inflight) pthread_cond_wait(&done_cv, &kiln_model_mu);
}

int kiln_model_stop_copy_threads_locked(worker **stop)
{
    int n_stop = 0;
    for (int q = 0; q < MAX_QUEUES; q++) {
        if (!queues[q].w) continue;
        queues[q].w->quit = 1;
        stop[n_stop++] = queues[q].w;
        queues[q].w = NULL;
        pthread_cond_broadcast(&queues[q].cv);
    }
    return n_stop;
}

void kiln_model_join_copy_threads(worker **stop, int n_stop)
{
    for (int i = 0; i < n_stop; i++) {
        pthread_join(stop[i]->th, NULL);
        free(stop[i]);
    }
}

/* ---- partial residency ---- */

void kiln_model_set_stream_always(kiln_model *m, int on)
{
    pthread_mutex_lock(&kiln_model_mu);
    m->stream_always = on > 0 ? 1 : on < 0 ? -1 : 0;
    pthread_mutex_unlock(&kiln_model_mu);
}

int kiln_model_stream_always(const kiln_model *m) { return m->stream_always; }

/* ---- streaming ---- */

static kiln_status resolve(kiln_model *m, const char *const *names, int n, int **idx, const char *what)
{
    *idx = NULL;
    if (!m) return kiln_error(KILN_ERR_ARG, "model %s: model is NULL", what);
    if (n < 0 || (n > 0 && !names)) return kiln_error(KILN_ERR_ARG, "model '%s': %s: bad name list", m->name, what);
    int *v = malloc(sizeof *v * (size_t)(n ? n : 1));
    if (!v) return kiln_error(KILN_ERR_OOM, "model '%s': out of host memory", m->name);
    for (int i = 0; i < n; i++) {
        v[i] = names[i] ? kiln_model_find(m, names[i]) : -1;
        if (v[i] < 0) {
            free(v);
            if (!names[i]) return kiln_error(KILN_ERR_ARG, "model '%s': %s: name %d is NULL", m->name, what, i + 1);
            kiln_status st = kiln_model_missing_error(m, names[i]);
            char prefix[64];
            snprintf(prefix, sizeof prefix, "%s: ", what);
            return kiln_model_prefix_error(st, prefix);
        }
    }
    *idx = v;
    return KILN_OK;
}

static kiln_status need_target_locked(kiln_model *m, const char *what)
{
    if (m->target) return KILN_OK;
    return kiln_error(KILN_ERR_STATE, "model '%s': %s needs a device: call load(device) first", m->name, what);
}

kiln_status kiln_model_fetch(kiln_model *m, const char *const *names, int n)
{
    int *idx;
    kiln_status st = resolve(m, names, n, &idx, "fetch");
    if (st) return st;
    pthread_mutex_lock(&kiln_model_mu);
    st = need_target_locked(m, "fetch");
    kiln_device *dev = target_of(m);
    int dtype = m->dtype;
    m->last_used = ++kiln_model_clock;
    pthread_mutex_unlock(&kiln_model_mu);
    if (st) { free(idx); return st; }
    kiln_events_set_context(m->owner);
    for (int k = 0; k < n && !st; k++) {
        mtensor *t = &m->t[idx[k]];
        pthread_mutex_lock(&kiln_model_mu);
        if (t->inflight) {
            m->n_waits++;
            while (t->inflight) pthread_cond_wait(&done_cv, &kiln_model_mu);
        }
        if (t->dev && tensor_device(t->dev) == dev) {
            if (t->prefetched) { m->n_hits++; t->prefetched = 0; }
            if (t->streamed) t->fetched = 1;
            pthread_mutex_unlock(&kiln_model_mu);
            continue;
        }
        kiln_dtype want = kiln_model_want_dtype(dtype, source_of(t));
        patchset *ps;
        kiln_tensor *src = kiln_model_source_locked(t, want, &ps);
        pthread_mutex_unlock(&kiln_model_mu);
        if (!src) { kiln_patchset_release(ps); st = kiln_error(KILN_ERR_OOM, "out of host memory"); break; }
        kiln_tensor *r;
        st = kiln_model_make_copy(src, ps, dev, want, m->owner, &r);
        kiln_tensor_free(src);
        kiln_patchset_release(ps);
        if (st) break;
        pthread_mutex_lock(&kiln_model_mu);
        if (t->dev && tensor_device(t->dev) == dev) {
            kiln_tensor_free(r); /* another thread was faster */
        } else {
            kiln_model_set_dev_locked(t, r);
            t->streamed = 1;
            t->fetched = 1;
        }
        m->n_fetch++;
        pthread_mutex_unlock(&kiln_model_mu);
    }
    kiln_events_set_context(NULL);
    free(idx);
    if (st) {
        char prefix[200];
        snprintf(prefix, sizeof prefix, "model '%s': fetch to %s: ", m->name, dev->name);
        return kiln_model_prefix_error(st, prefix);
    }
    return KILN_OK;
}

kiln_status kiln_model_release(kiln_model *m, const char *const *names, int n)
{
    int *idx;
    kiln_status st = resolve(m, names, n, &idx, "release");
    if (st) return st;
    pthread_mutex_lock(&kiln_model_mu);
    for (int k = 0; k < n; k++) {
        mtensor *t = &m->t[idx[k]];
        if (t->inflight) {
            /* still queued: take it off; copying: wait for it */
            for (int q = 0; q < MAX_QUEUES && t->inflight; q++) {
                job *last = NULL;
                for (job **pj = &queues[q].head; *pj;) {
                    job *j = *pj;
                    if (j->m == m && j->idx == idx[k]) {
                        *pj = j->next;
                        kiln_tensor_free(j->dst);
                        free(j);
                        t->inflight = 0;
                        m->inflight--;
                    } else {
                        last = j;
                        pj = &j->next;
                    }
                }
                queues[q].tail = last;
            }
            while (t->inflight) pthread_cond_wait(&done_cv, &kiln_model_mu);
        }
        if (t->dev && t->streamed) drop(&t->dev);
        t->streamed = t->fetched = t->prefetched = 0;
    }
    pthread_mutex_unlock(&kiln_model_mu);
    free(idx);
    return KILN_OK;
}

static int queue_slot(const kiln_device *dev)
{
    for (int i = 0; i < kiln_device_count() && i < MAX_QUEUES; i++)
        if (kiln_device_at(i) == dev) return i;
    return -1;
}

/* Whether dst can hold t's copy in dtype want (the model's dtype or t's source may have
 * changed since dst was taken). */
static int fits_copy(const kiln_tensor *dst, const mtensor *t, kiln_dtype want)
{
    const kiln_tensor *s = source_of(t);
    if (!dst || dst->dtype != want || dst->ndim != s->ndim) return 0;
    for (int d = 0; d < s->ndim; d++)
        if (dst->shape[d] != s->shape[d]) return 0;
    return 1;
}

/* One prefetch copy of t to dev into dst (taken when the copy was queued; NULL: a new
 * one): kiln_model_mu held on entry and on return, released while copying; the copy is
 * installed unless t changed meanwhile. A copy that fails is not an error: fetch makes
 * its own. Takes dst. */
static void prefetch_copy_locked(kiln_model *m, mtensor *t, kiln_device *dev, kiln_tensor *dst)
{
    kiln_dtype want = kiln_model_want_dtype(m->dtype, source_of(t));
    if (dst && !fits_copy(dst, t, want)) {
        kiln_tensor_free(dst);
        dst = NULL;
    }
    patchset *ps;
    kiln_tensor *src = kiln_model_source_locked(t, want, &ps);
    unsigned gen = t->gen;
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_tensor *r = NULL;
    kiln_status st = KILN_ERR_OOM;
    double t0 = kiln_events_now();
    if (src) {
        /* the patches' arithmetic runs here too, overlapping the compute */
        kiln_events_set_context(m->owner);
        if (dst) {
            st = kiln_model_fill_copy(src, ps, dst);
            r = dst;
            dst = NULL;
        } else {
            st = kiln_model_make_copy(src, ps, dev, want, m->owner, &r);
        }
        kiln_tensor_free(src);
    }
    kiln_tensor_free(dst);
    kiln_patchset_release(ps);
    if (!st && kiln_trace_active()) {
        char args[160];
        snprintf(args, sizeof args, "\"model\":\"%s\",\"bytes\":%llu", m->name,
                 (unsigned long long)tensor_bytes(r));
        kiln_trace_span(t->name, "prefetch", t0, kiln_events_now(), args);
    }
    pthread_mutex_lock(&kiln_model_mu);
    if (!st && copy_delay > 0) {
        pthread_mutex_unlock(&kiln_model_mu);
        struct timespec ts = {(time_t)copy_delay, (long)((copy_delay - (double)(time_t)copy_delay) * 1e9)};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&kiln_model_mu);
    }
    if (!st && t->gen == gen && target_of(m) == dev && !(t->dev && tensor_device(t->dev) == dev)) {
        kiln_model_set_dev_locked(t, r);
        r = NULL;
        t->streamed = 1;
        t->prefetched = 1;
        m->n_prefetch++;
        m->prefetch_tid = kiln_thread_id();
    }
    kiln_tensor_free(r);
}

static void *copy_thread(void *arg)
{
    worker *w = arg;
    char name[32];
    snprintf(name, sizeof name, "copy %s", w->dev->name);
    kiln_thread_set_name(name, 1);
    pthread_mutex_lock(&kiln_model_mu);
    for (;;) {
        while (!w->quit && !queues[w->slot].head) pthread_cond_wait(&queues[w->slot].cv, &kiln_model_mu);
        if (w->quit) break;
        job *j = queues[w->slot].head;
        queues[w->slot].head = j->next;
        if (!j->next) queues[w->slot].tail = NULL;
        kiln_model *m = j->m; /* stays open: close waits for m->inflight */
        mtensor *t = &m->t[j->idx];
        kiln_tensor *dst = j->dst;
        free(j);
        if (target_of(m) == w->dev && !(t->dev && tensor_device(t->dev) == w->dev))
            prefetch_copy_locked(m, t, w->dev, dst);
        else
            kiln_tensor_free(dst);
        t->inflight = 0;
        m->inflight--;
        pthread_cond_broadcast(&done_cv);
    }
    pthread_mutex_unlock(&kiln_model_mu);
    return NULL;
}

void kiln_model_wait_copies(void)
{
    pthread_mutex_lock(&kiln_model_mu);
    for (;;) {
        int busy = 0;
        for (kiln_model *m = kiln_model_list; m && !busy; m = m->next) busy = m->inflight > 0;
        if (!busy) break;
        pthread_cond_wait(&done_cv, &kiln_model_mu);
    }
    pthread_mutex_unlock(&kiln_model_mu);
}

/* When a prefetch holds its memory. A dry run (the meta device) makes the whole copy at
 * once, on the calling thread: its arithmetic takes no time, so a copy thread would land
 * the copies at a moment that varies from run to run. A real run takes the copy's memory
 * on the calling thread too, when the prefetch is queued, and leaves only the filling of
 * it to the copy thread. So the next block's weights hold their bytes through the block
 * that runs meanwhile in both, whenever the copy thread gets a core: the dry run's peak
 * is the real run's to the byte instead of a bound that a late copy leaves above it
 * (the copy landing after the block's temporaries peaked), and the copies still overlap
 * the compute. kiln_model_set_prefetch_at_once(1) makes real devices copy at once too
 * (tests compare with it). As on the copy thread, a copy that fails is not an error:
 * fetch makes its own. */
static atomic_int prefetch_at_once;

void kiln_model_set_prefetch_at_once(int on) { atomic_store(&prefetch_at_once, on != 0); }
int kiln_model_prefetch_at_once(void) { return atomic_load(&prefetch_at_once); }

void kiln_model_set_copy_delay(double seconds) { copy_delay = seconds > 0 ? seconds : 0; }

static void prefetch_now(kiln_model *m, const int *idx, int n, kiln_device *dev)
{
    pthread_mutex_lock(&kiln_model_mu);
    for (int k = 0; k < n; k++) {
        mtensor *t = &m->t[idx[k]];
        if (!t->inflight && !(t->dev && tensor_device(t->dev) == dev)) prefetch_copy_locked(m, t, dev, NULL);
    }
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_events_set_context(NULL);
}

/* The copy thread of dev's queue, started on first use; under kiln_model_mu. */
static kiln_status ensure_worker_locked(kiln_model *m, kiln_device *dev, int *slot)
{
    int q = queue_slot(dev);
    *slot = q;
    if (q < 0) return kiln_error(KILN_ERR_ARG, "model '%s': prefetch: no copy queue for %s", m->name, dev->name);
    if (queues[q].w) return KILN_OK;
    worker *w = calloc(1, sizeof *w);
    if (w) {
        w->dev = dev;
        w->slot = q;
    }
    if (!w || pthread_create(&w->th, NULL, copy_thread, w) != 0) {
        free(w);
        return kiln_error(KILN_ERR_STATE, "model '%s': prefetch: cannot start the copy thread for %s", m->name, dev->name);
    }
    queues[q].w = w;
    return KILN_OK;
}

kiln_status kiln_model_prefetch(kiln_model *m, const char *const *names, int n)
{
    int *idx;
    kiln_status st = resolve(m, names, n, &idx, "prefetch");
    if (st) return st;
    pthread_mutex_lock(&kiln_model_mu);
    st = need_target_locked(m, "prefetch");
    kiln_device *dev = target_of(m);
    if (!st && (dev->type == KILN_DEV_META || atomic_load(&prefetch_at_once))) {
        m->last_used = ++kiln_model_clock;
        pthread_mutex_unlock(&kiln_model_mu);
        prefetch_now(m, idx, n, dev);
        free(idx);
        return KILN_OK;
    }
    int q = -1;
    if (!st) st = ensure_worker_locked(m, dev, &q);
    /* the copies' memory, taken here (without the lock: an allocation may evict) in the
     * dtype and shape each copy will have; ndim -1: nothing to copy */
    struct want { kiln_tensor *dst; kiln_dtype dt; int ndim; int64_t shape[KILN_MAX_DIMS]; } *w =
        st ? NULL : calloc((size_t)(n ? n : 1), sizeof *w);
    if (!st && !w) st = kiln_error(KILN_ERR_OOM, "model '%s': out of host memory", m->name);
    for (int k = 0; k < n && !st; k++) {
        mtensor *t = &m->t[idx[k]];
        w[k].ndim = -1;
        if (t->inflight || (t->dev && tensor_device(t->dev) == dev)) continue;
        const kiln_tensor *s = source_of(t);
        w[k].dt = kiln_model_want_dtype(m->dtype, s);
        w[k].ndim = s->ndim;
        memcpy(w[k].shape, s->shape, sizeof(int64_t) * (size_t)s->ndim);
    }
    const char *owner = m->owner;
    pthread_mutex_unlock(&kiln_model_mu);
    for (int k = 0; k < n && !st; k++) {
        if (w[k].ndim < 0) continue;
        /* a failure is not an error: the copy thread (or fetch) allocates then */
        if (kiln_tensor_new(dev, w[k].dt, w[k].ndim, w[k].shape, &w[k].dst) == KILN_OK)
            kiln_storage_set_owner(w[k].dst->storage, owner);
        else
            w[k].dst = NULL;
    }
    pthread_mutex_lock(&kiln_model_mu);
    for (int k = 0; k < n && !st; k++) {
        mtensor *t = &m->t[idx[k]];
        if (w[k].ndim < 0 || t->inflight || (t->dev && tensor_device(t->dev) == dev) || target_of(m) != dev) continue;
        job *j = malloc(sizeof *j);
        if (!j) { st = kiln_error(KILN_ERR_OOM, "model '%s': out of host memory", m->name); break; }
        j->m = m;
        j->idx = idx[k];
        j->dst = w[k].dst;
        w[k].dst = NULL;
        j->next = NULL;
        if (queues[q].tail) queues[q].tail->next = j;
        else queues[q].head = j;
        queues[q].tail = j;
        t->inflight = 1;
        m->inflight++;
    }
    for (int k = 0; w && k < n; k++) kiln_tensor_free(w[k].dst); /* not queued after all */
    if (q >= 0) pthread_cond_signal(&queues[q].cv);
    m->last_used = ++kiln_model_clock;
    pthread_mutex_unlock(&kiln_model_mu);
    free(w);
    free(idx);
    return st;
}

/* Under kiln_model_mu: the queued (not yet copying) prefetches to dev give their memory
 * back and are taken off the queue; the bytes freed. The evict hook's last resort: a
 * queued copy's memory is not a model's to evict. */
size_t kiln_model_drop_queued_locked(kiln_device *dev)
{
    size_t freed = 0;
    int q = queue_slot(dev);
    if (q < 0) return 0;
    job **pj = &queues[q].head, *last = NULL;
    while (*pj) {
        job *j = *pj;
        if (j->dst) {
            *pj = j->next;
            freed += j->dst->storage->nbytes;
            kiln_tensor_free(j->dst);
            j->m->t[j->idx].inflight = 0;
            j->m->inflight--;
            free(j);
        } else {
            last = j;
            pj = &j->next;
        }
    }
    queues[q].tail = last;
    if (freed) pthread_cond_broadcast(&done_cv);
    return freed;
}

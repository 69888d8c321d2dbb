/* model_stream.c - streaming a model's weights tensor by tensor: fetch (now) / prefetch
 * (queued on a copy thread per device, or at once in a dry run) / release, and partial
 * residency (a model whose loads keep the weights on the host to stream them). The
 * stores, copies and the registry lock are model.c's (model_internal.h). */
#define _GNU_SOURCE
#include "model_internal.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct job { kiln_model *m; int idx; struct job *next; } job;
struct worker { pthread_t th; kiln_device *dev; int slot; int quit; };

static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER; /* a prefetch finished */

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

/* One prefetch copy of t to dev: kiln_model_mu held on entry and on return, released while
 * copying; the copy is installed unless t changed meanwhile. A copy that fails is not
 * an error: fetch makes its own. */
static void prefetch_copy_locked(kiln_model *m, mtensor *t, kiln_device *dev)
{
    kiln_dtype want = kiln_model_want_dtype(m->dtype, source_of(t));
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
        st = kiln_model_make_copy(src, ps, dev, want, m->owner, &r);
        kiln_tensor_free(src);
    }
    kiln_patchset_release(ps);
    if (!st && kiln_trace_active()) {
        char args[160];
        snprintf(args, sizeof args, "\"model\":\"%s\",\"bytes\":%llu", m->name,
                 (unsigned long long)tensor_bytes(r));
        kiln_trace_span(t->name, "prefetch", t0, kiln_events_now(), args);
    }
    pthread_mutex_lock(&kiln_model_mu);
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
        free(j);
        if (target_of(m) == w->dev && !(t->dev && tensor_device(t->dev) == w->dev))
            prefetch_copy_locked(m, t, w->dev);
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

/* A dry run (the meta device) prefetches at once, on the calling thread. Its arithmetic
 * takes no time, so a copy thread would land the copies at a moment that varies from
 * run to run: before, during or after the block that runs meanwhile allocates its
 * temporaries (the dry run's peak of the demo txt2img in low mode came out 0-3.4% low,
 * differently each run). Copied at once, the next block's weights are resident through
 * the block that runs meanwhile: the most a real run can hold, whose copies land when
 * the copy thread gets a core, and the dry run's peak is the same every time.
 * kiln_model_set_prefetch_at_once(1) gives real devices the same timing (tests compare
 * a real run's peak with the dry run's; it takes the overlap of copies and compute away).
 * As on the copy thread, a copy that fails is not an error: fetch makes its own. */
static atomic_int prefetch_at_once;

void kiln_model_set_prefetch_at_once(int on) { atomic_store(&prefetch_at_once, on != 0); }
int kiln_model_prefetch_at_once(void) { return atomic_load(&prefetch_at_once); }

static void prefetch_now(kiln_model *m, const int *idx, int n, kiln_device *dev)
{
    pthread_mutex_lock(&kiln_model_mu);
    for (int k = 0; k < n; k++) {
        mtensor *t = &m->t[idx[k]];
        if (!t->inflight && !(t->dev && tensor_device(t->dev) == dev)) prefetch_copy_locked(m, t, dev);
    }
    pthread_mutex_unlock(&kiln_model_mu);
    kiln_events_set_context(NULL);
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
    int q = st ? -1 : queue_slot(dev);
    if (!st && q < 0) st = kiln_error(KILN_ERR_ARG, "model '%s': prefetch: no copy queue for %s", m->name, dev->name);
    if (!st && !queues[q].w) {
        worker *w = calloc(1, sizeof *w);
        if (w) {
            w->dev = dev;
            w->slot = q;
        }
        if (!w || pthread_create(&w->th, NULL, copy_thread, w) != 0) {
            free(w);
            st = kiln_error(KILN_ERR_STATE, "model '%s': prefetch: cannot start the copy thread for %s", m->name, dev->name);
        } else {
            queues[q].w = w;
        }
    }
    for (int k = 0; k < n && !st; k++) {
        mtensor *t = &m->t[idx[k]];
        if (t->inflight || (t->dev && tensor_device(t->dev) == dev)) continue;
        job *j = malloc(sizeof *j);
        if (!j) { st = kiln_error(KILN_ERR_OOM, "model '%s': out of host memory", m->name); break; }
        j->m = m;
        j->idx = idx[k];
        j->next = NULL;
        if (queues[q].tail) queues[q].tail->next = j;
        else queues[q].head = j;
        queues[q].tail = j;
        t->inflight = 1;
        m->inflight++;
    }
    if (q >= 0) pthread_cond_signal(&queues[q].cv);
    m->last_used = ++kiln_model_clock;
    pthread_mutex_unlock(&kiln_model_mu);
    free(idx);
    return st;
}

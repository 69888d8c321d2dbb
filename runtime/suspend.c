/* suspend.c - parking a run: device storages moved to host blocks in place and back,
 * and the gate (a mutex, a condition and a state) that a host thread and a running
 * job meet at. The job parks itself at a suspend point, on its own thread: nothing
 * else computes then, so moving a storage's bytes under the tensors that view it is
 * safe, and the run goes on afterwards exactly where it stopped. */
#define _POSIX_C_SOURCE 200809L
#include "suspend.h"
#include "backend.h"
#include "events.h"
#include "mem_timeline.h"
#include "model.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- parking storages ---- */

struct kiln_parked {
    kiln_storage **s;      /* each retained by the park */
    size_t n, cap;
    uint64_t bytes;
};

/* A parked storage's release: its bytes are a cpu block (what a device block's
 * release would do, on the host). */
static void parked_release(kiln_storage *s)
{
    kiln_allocator_release(kiln_device_cpu()->alloc, s->data);
    s->release = NULL;
    kiln_storage_account(s, 0);
}

static int parkable(const kiln_device *d)
{
    return d && (d->type == KILN_DEV_SIM || d->type == KILN_DEV_CUDA);
}

/* Under the storage registry's lock: retains the storages of the device allocator
 * (not wrapped memory), skipping one whose last reference is going away. */
static void collect(void *ctx, const kiln_storage *cs)
{
    kiln_parked *p = ctx;
    kiln_storage *s = (kiln_storage *)cs;
    if (s->release || !s->data) return;
    if (p->n == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 64;
        kiln_storage **ns = realloc(p->s, cap * sizeof *ns);
        if (!ns) return; /* not parked: it stays on the device, reserved shows it */
        p->s = ns;
        p->cap = cap;
    }
    int rc = atomic_load((atomic_int *)&s->refcount);
    while (rc > 0 && !atomic_compare_exchange_weak((atomic_int *)&s->refcount, &rc, rc + 1)) {}
    if (rc > 0) p->s[p->n++] = s;
}

static kiln_status copy_bytes(kiln_device *dev, int to_device, void *dst, const void *src, size_t n)
{
    if (!n) return KILN_OK;
    double t0 = kiln_events_now();
    kiln_status st = KILN_OK;
    if (to_device && dev->backend && dev->backend->to_device) st = dev->backend->to_device(dst, src, n);
    else if (!to_device && dev->backend && dev->backend->to_host) st = dev->backend->to_host(dst, src, n);
    else memcpy(dst, src, n);
    kiln_device_count_transfer(dev, to_device, n, kiln_events_now() - t0);
    return st;
}

/* Moves one storage's bytes to a new cpu block and frees its device block. */
static kiln_status park_one(kiln_storage *s)
{
    kiln_device *dev = s->device;
    void *h = NULL;
    kiln_status st = kiln_allocator_alloc(kiln_device_cpu()->alloc, s->nbytes ? s->nbytes : 1, &h);
    if (st) return st;
    if ((st = copy_bytes(dev, 0, h, s->data, s->nbytes))) {
        kiln_allocator_release(kiln_device_cpu()->alloc, h);
        return st;
    }
    /* the memory timeline counts device blocks by pointer: the parked one goes now */
    kiln_mem_timeline_free(dev, s->data);
    kiln_allocator_release(dev->alloc, s->data);
    s->data = h;
    s->release = parked_release;
    return KILN_OK;
}

/* Brings one storage back: a new device block, the bytes, the host block freed. */
static kiln_status unpark_one(kiln_storage *s)
{
    if (s->release != parked_release) return KILN_OK;
    kiln_device *dev = s->device;
    void *d = NULL;
    kiln_status st = kiln_allocator_alloc(dev->alloc, s->nbytes ? s->nbytes : 1, &d);
    if (st) return st;
    if ((st = copy_bytes(dev, 1, d, s->data, s->nbytes))) {
        kiln_allocator_release(dev->alloc, d);
        return st;
    }
    kiln_allocator_release(kiln_device_cpu()->alloc, s->data);
    s->data = d;
    s->release = NULL;
    kiln_mem_timeline_alloc(dev, d, s->owner);
    return KILN_OK;
}

static void parked_free(kiln_parked *p)
{
    for (size_t i = 0; i < p->n; i++) kiln_storage_release(p->s[i]);
    free(p->s);
    free(p);
}

kiln_status kiln_suspend_park(kiln_parked **out)
{
    *out = NULL;
    kiln_parked *p = calloc(1, sizeof *p);
    if (!p) return kiln_error(KILN_ERR_OOM, "suspend: out of host memory");
    /* a prefetch in flight writes into a device block: let the copy threads finish */
    kiln_model_wait_copies();
    for (int i = 0; i < kiln_device_count(); i++) {
        kiln_device *d = kiln_device_at(i);
        if (parkable(d)) kiln_storage_foreach(d, collect, p);
    }
    for (size_t i = 0; i < p->n; i++) {
        kiln_status st = park_one(p->s[i]);
        if (st) {
            kiln_suspend_unpark(p);
            return st;
        }
        p->bytes += p->s[i]->nbytes;
    }
    for (int i = 0; i < kiln_device_count(); i++) {
        kiln_device *d = kiln_device_at(i);
        if (parkable(d)) kiln_device_empty_cache(d);
    }
    *out = p;
    return KILN_OK;
}

kiln_status kiln_suspend_unpark(kiln_parked *p)
{
    if (!p) return KILN_OK;
    kiln_status first = KILN_OK;
    char msg[512] = "";
    for (size_t i = 0; i < p->n; i++) {
        kiln_status st = unpark_one(p->s[i]);
        if (st && !first) {
            first = st;
            snprintf(msg, sizeof msg, "%s", kiln_last_error());
        }
    }
    parked_free(p);
    if (first) return kiln_error(first, "resume: %s", msg);
    return KILN_OK;
}

uint64_t kiln_parked_bytes(const kiln_parked *p)
{
    return p ? p->bytes : 0;
}

/* ---- the gate ---- */

/* ORDER GATE: idle (no call), running, parked (waiting for resume), resuming (bytes
 * coming back) */
enum { G_IDLE = 0, G_RUNNING, G_PARKED, G_RESUMING };

struct kiln_gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int state;
    pthread_t runner;          /* the running call's thread (state != G_IDLE) */
    atomic_int requested;
    int go;                    /* kiln_gate_resume was called for this park */
    kiln_status park_status;   /* a failed park, for the host waiting in suspend */
    kiln_status resume_status;
    char message[512];         /* the message of a failed park or unpark */
    double t_request, t_resume;
    kiln_gate_stats st;
};

kiln_gate *kiln_gate_new(void)
{
    kiln_gate *g = calloc(1, sizeof *g);
    if (!g) return NULL;
    if (pthread_mutex_init(&g->mu, NULL) != 0) {
        free(g);
        return NULL;
    }
    if (pthread_cond_init(&g->cv, NULL) != 0) {
        pthread_mutex_destroy(&g->mu);
        free(g);
        return NULL;
    }
    atomic_init(&g->requested, 0);
    return g;
}

void kiln_gate_free(kiln_gate *g)
{
    if (!g) return;
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

void kiln_gate_enter(kiln_gate *g)
{
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    g->state = G_RUNNING;
    g->runner = pthread_self();
    g->go = 0;
    atomic_store(&g->requested, 0);
    pthread_mutex_unlock(&g->mu);
}

void kiln_gate_leave(kiln_gate *g)
{
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    g->state = G_IDLE;
    atomic_store(&g->requested, 0);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

kiln_status kiln_gate_suspend(kiln_gate *g)
{
    pthread_mutex_lock(&g->mu);
    while (g->state == G_RESUMING) pthread_cond_wait(&g->cv, &g->mu);
    if (g->state == G_PARKED) {
        pthread_mutex_unlock(&g->mu);
        return KILN_OK;
    }
    if (g->state == G_IDLE) {
        pthread_mutex_unlock(&g->mu);
        return kiln_error(KILN_ERR_STATE, "kiln_suspend: no call is running");
    }
    if (pthread_equal(g->runner, pthread_self())) { /* a callback of the call: it would wait for itself */
        pthread_mutex_unlock(&g->mu);
        return kiln_error(KILN_ERR_STATE, "kiln_suspend: called on the running call's own thread (a callback)");
    }
    if (g->state == G_RUNNING && !atomic_load(&g->requested)) {
        g->t_request = kiln_events_now();
        g->park_status = KILN_OK;
        atomic_store(&g->requested, 1);
    }
    while (g->state == G_RUNNING && atomic_load(&g->requested)) pthread_cond_wait(&g->cv, &g->mu);
    kiln_status st = KILN_OK;
    if (g->state == G_IDLE) st = kiln_error(KILN_ERR_STATE, "kiln_suspend: the call ended before it parked");
    else if (g->state == G_RUNNING)
        st = g->park_status ? kiln_error(g->park_status, "kiln_suspend: %s", g->message)
                            : kiln_error(KILN_ERR_STATE, "kiln_suspend: the request was withdrawn (kiln_resume)");
    pthread_mutex_unlock(&g->mu);
    return st;
}

kiln_status kiln_gate_resume(kiln_gate *g)
{
    pthread_mutex_lock(&g->mu);
    if (g->state == G_RUNNING && atomic_load(&g->requested)) {
        atomic_store(&g->requested, 0); /* not parked yet: the call parks only if it still sees it */
        pthread_cond_broadcast(&g->cv);
    }
    if (g->state != G_PARKED && g->state != G_RESUMING) {
        pthread_mutex_unlock(&g->mu);
        return KILN_OK;
    }
    if (g->state == G_PARKED && !g->go) {
        g->t_resume = kiln_events_now();
        g->go = 1;
        pthread_cond_broadcast(&g->cv);
    }
    while (g->state == G_PARKED || g->state == G_RESUMING) pthread_cond_wait(&g->cv, &g->mu);
    kiln_status st = g->resume_status;
    if (st) kiln_error(st, "kiln_resume: %s", g->message);
    pthread_mutex_unlock(&g->mu);
    return st;
}

void kiln_gate_wake(kiln_gate *g)
{
    if (!g) return;
    pthread_mutex_lock(&g->mu);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

int kiln_gate_requested(kiln_gate *g)
{
    return g && atomic_load(&g->requested);
}

int kiln_gate_parked(kiln_gate *g)
{
    if (!g) return 0;
    pthread_mutex_lock(&g->mu);
    int on = g->state == G_PARKED;
    pthread_mutex_unlock(&g->mu);
    return on;
}

kiln_status kiln_gate_point(kiln_gate *g, int (*stop)(void *ud), void *ud)
{
    if (!g || !atomic_load(&g->requested)) return KILN_OK;
    kiln_parked *p = NULL;
    kiln_status st = kiln_suspend_park(&p);
    pthread_mutex_lock(&g->mu);
    if (st) {
        /* the run goes on as it was; the host hears why it did not park */
        snprintf(g->message, sizeof g->message, "%s", kiln_last_error());
        g->park_status = st;
        atomic_store(&g->requested, 0);
        pthread_cond_broadcast(&g->cv);
        pthread_mutex_unlock(&g->mu);
        return KILN_OK;
    }
    int cancelled = 0;
    if (atomic_load(&g->requested)) { /* still asked (a resume may have withdrawn it) */
        g->state = G_PARKED;
        g->go = 0;
        g->st.parks++;
        g->st.bytes = kiln_parked_bytes(p);
        g->st.park_seconds = kiln_events_now() - g->t_request;
        pthread_cond_broadcast(&g->cv);
        while (!g->go && !(cancelled = stop && stop(ud))) pthread_cond_wait(&g->cv, &g->mu);
        g->state = G_RESUMING;
    }
    pthread_mutex_unlock(&g->mu);
    kiln_status ust = kiln_suspend_unpark(p);
    pthread_mutex_lock(&g->mu);
    if (ust) snprintf(g->message, sizeof g->message, "%s", kiln_last_error());
    g->resume_status = ust;
    if (g->go) g->st.resume_seconds = kiln_events_now() - g->t_resume;
    g->state = G_RUNNING;
    g->go = 0;
    atomic_store(&g->requested, 0);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    if (ust) return kiln_error(ust, "%s", g->message);
    return cancelled ? KILN_ERR_CANCELLED : KILN_OK;
}

kiln_gate_stats kiln_gate_get_stats(kiln_gate *g)
{
    kiln_gate_stats s;
    memset(&s, 0, sizeof s);
    if (!g) return s;
    pthread_mutex_lock(&g->mu);
    s = g->st;
    pthread_mutex_unlock(&g->mu);
    return s;
}

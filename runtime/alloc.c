/* alloc.c - the caching allocator of one device, after PyTorch's CUDA caching
 * allocator, simplified: segments from the device's raw memory, blocks split and
 * coalesced inside them, best fit from two free pools, and a budget on reserved bytes.
 * layer 1 of the memory core: uses events; never calls mem_timeline, device, trace. */
#define _POSIX_C_SOURCE 200809L
#include "alloc.h"
#include "events.h"
#include "fault.h"
#include "format_bytes.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Requests up to SMALL_SIZE share SMALL_SEGMENT segments and are rounded to
 * ROUND bytes; larger ones get segments rounded to LARGE_GRAIN. A cached large
 * block is split only when the rest is itself a large block, so the large pool
 * does not fill with slivers that no large request can use (as PyTorch does). */
#define ROUND ((size_t)512)
#define SMALL_SIZE ((size_t)1 << 20)
#define SMALL_SEGMENT ((size_t)2 << 20)
#define LARGE_GRAIN ((size_t)2 << 20)
/* Larger requests are refused outright: rounding them would overflow size_t. */
#define MAX_REQUEST ((size_t)1 << (sizeof(size_t) > 4 ? 56 : 30))

typedef struct segment segment;
typedef struct block block;

struct block {
    char *ptr;
    size_t size;
    segment *seg;
    block *prev, *next;   /* neighbours in address order inside seg */
    block *left, *right;  /* free pool treap, keyed by (size, ptr) */
    block *hnext;         /* live map chain; spare list link */
    uint32_t prio;
    int live;
};

struct segment {
    char *raw;            /* what raw_alloc returned; raw_size is what it holds */
    size_t raw_size;
    size_t size;          /* usable bytes from the first block's ptr */
    int small;
    int n_live;
    segment *prev, *next;
    block *first;
};

struct kiln_allocator {
    pthread_mutex_t mu;
    char name[32];
    kiln_raw_memory raw;
    int caching;
    size_t grain;             /* large segments are rounded to this (LARGE_GRAIN) */
    uint64_t cache_limit;     /* 0: cache without limit (below the budget) */
    kiln_evict_fn evict;
    void *evict_ctx;
    kiln_pressure_fn pressure;
    void *pressure_ctx;
    int fail_after;           /* raw allocations left before failing; -1 off */

    kiln_mem_stats st;        /* largest_free is computed on demand */
    uint64_t free_bytes;      /* sum of cached free block sizes */
    uint64_t n_bad_releases;  /* releases of pointers that are not live blocks */

    /* a lowered budget (kiln_allocator_set_budget) */
    uint64_t grace;           /* 0: none; else the cap new segments still get (UINT64_MAX: none) */
    uint64_t budget_changes;
    double lowered_at, compliant_at;
    uint64_t peak_since;
    uint64_t peak_before;     /* most bytes reserved (since reset_peak) when it was lowered */

    segment *segments;
    block *small_pool, *large_pool;
    block **buckets;          /* live blocks by ptr */
    size_t n_buckets, n_live;
    block *spare;             /* unused block records */
    uint32_t rng;
};

static atomic_int n_graced; /* allocators in a grace */

/* ---- sizes ---- */

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* ---- block records ---- */

static block *block_get(kiln_allocator *a)
{
    block *b = a->spare;
    if (b) a->spare = b->hnext;
    else b = malloc(sizeof *b);
    if (b) memset(b, 0, sizeof *b);
    return b;
}

static void block_put(kiln_allocator *a, block *b)
{
    b->hnext = a->spare;
    a->spare = b;
}

/* Keeps n records in reserve so that a split never fails half way. */
static int spare_ensure(kiln_allocator *a, int n)
{
    int have = 0;
    for (block *b = a->spare; b && have < n; b = b->hnext) have++;
    for (; have < n; have++) {
        block *b = malloc(sizeof *b);
        if (!b) return 0;
        block_put(a, b);
    }
    return 1;
}

/* ---- free pools: a treap ordered by (size, ptr), so lower_bound is best fit ---- */

static int blk_less(const block *x, const block *y)
{
    return x->size < y->size || (x->size == y->size && x->ptr < y->ptr);
}

static void treap_split(block *t, const block *key, block **l, block **r)
{
    if (!t) { *l = *r = NULL; return; }
    if (blk_less(t, key)) { treap_split(t->right, key, &t->right, r); *l = t; }
    else { treap_split(t->left, key, l, &t->left); *r = t; }
}

static block *treap_merge(block *l, block *r)
{
    if (!l) return r;
    if (!r) return l;
    if (l->prio > r->prio) { l->right = treap_merge(l->right, r); return l; }
    r->left = treap_merge(l, r->left);
    return r;
}

static block *treap_remove(block *t, block *b)
{
    if (!t) return NULL;
    if (t == b) return treap_merge(t->left, t->right);
    if (blk_less(b, t)) t->left = treap_remove(t->left, b);
    else t->right = treap_remove(t->right, b);
    return t;
}

static block **pool_of(kiln_allocator *a, const segment *s)
{
    return s->small ? &a->small_pool : &a->large_pool;
}

static void pool_insert(kiln_allocator *a, block *b)
{
    block **root = pool_of(a, b->seg), *l, *r;
    a->rng ^= a->rng << 13; a->rng ^= a->rng >> 17; a->rng ^= a->rng << 5;
    b->prio = a->rng;
    b->left = b->right = NULL;
    treap_split(*root, b, &l, &r);
    *root = treap_merge(treap_merge(l, b), r);
    a->free_bytes += b->size;
}

static void pool_remove(kiln_allocator *a, block *b)
{
    block **root = pool_of(a, b->seg);
    *root = treap_remove(*root, b);
    b->left = b->right = NULL;
    a->free_bytes -= b->size;
}

static block *pool_best_fit(block *t, size_t size)
{
    block *best = NULL;
    while (t) {
        if (t->size >= size) { best = t; t = t->left; }
        else t = t->right;
    }
    return best;
}

static size_t pool_largest(const block *t)
{
    if (!t) return 0;
    while (t->right) t = t->right;
    return t->size;
}

/* ---- live map: ptr -> block, chained ---- */

static size_t hash_ptr(const kiln_allocator *a, const void *p)
{
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 32) & (a->n_buckets - 1);
}

static void map_grow(kiln_allocator *a)
{
    size_t n = a->n_buckets * 2;
    block **nb = calloc(n, sizeof *nb);
    if (!nb) return; /* chains just get longer */
    block **old = a->buckets;
    size_t old_n = a->n_buckets;
    a->buckets = nb;
    a->n_buckets = n;
    for (size_t i = 0; i < old_n; i++) {
        for (block *b = old[i], *next; b; b = next) {
            next = b->hnext;
            size_t h = hash_ptr(a, b->ptr);
            b->hnext = nb[h];
            nb[h] = b;
        }
    }
    free(old);
}

static void map_insert(kiln_allocator *a, block *b)
{
    if (a->n_live >= a->n_buckets) map_grow(a);
    size_t h = hash_ptr(a, b->ptr);
    b->hnext = a->buckets[h];
    a->buckets[h] = b;
    a->n_live++;
}

static block *map_find(const kiln_allocator *a, const void *p)
{
    for (block *b = a->buckets[hash_ptr(a, p)]; b; b = b->hnext)
        if (b->ptr == p) return b;
    return NULL;
}

static block *map_take(kiln_allocator *a, const void *p)
{
    for (block **pb = &a->buckets[hash_ptr(a, p)]; *pb; pb = &(*pb)->hnext) {
        block *b = *pb;
        if (b->ptr == p) {
            *pb = b->hnext;
            b->hnext = NULL;
            a->n_live--;
            return b;
        }
    }
    return NULL;
}

/* ---- segments ---- */

static int raw_fails(kiln_allocator *a)
{
    if (a->fail_after < 0) return 0;
    if (a->fail_after == 0) return 1;
    a->fail_after--;
    return 0;
}

/* Why a new segment could not be had. */
enum { SEG_OK = 0, SEG_BUDGET, SEG_DEVICE, SEG_HOST };

/* A new segment of `size` usable bytes with one free block spanning it (not yet in
 * a pool). On SEG_BUDGET / SEG_DEVICE, *shortfall is how many bytes must be given
 * back to the device before it could succeed. */
static int segment_new(kiln_allocator *a, size_t size, int small, block **out, uint64_t *shortfall)
{
    uint64_t budget = a->grace ? a->grace : a->st.budget;
    if (budget == UINT64_MAX) budget = 0;
    if (budget && a->st.reserved + size > budget) {
        *shortfall = a->st.reserved + size - budget;
        return SEG_BUDGET;
    }
    segment *s = calloc(1, sizeof *s);
    block *b = block_get(a);
    if (!s || !b) {
        free(s);
        if (b) block_put(a, b);
        return SEG_HOST;
    }
    size_t raw_size = size;
    char *raw = raw_fails(a) ? NULL : a->raw.raw_alloc(a->raw.ctx, raw_size);
    if (raw && (uintptr_t)raw % KILN_ALLOC_ALIGN) {
        /* raw_alloc should align (cudaMalloc and posix_memalign do); if it does not,
         * ask for enough to align inside and count all of it as reserved. */
        a->raw.raw_free(a->raw.ctx, raw, raw_size);
        raw = NULL;
        raw_size = size + KILN_ALLOC_ALIGN;
        if (budget && a->st.reserved + raw_size > budget) {
            free(s);
            block_put(a, b);
            *shortfall = a->st.reserved + raw_size - budget;
            return SEG_BUDGET;
        }
        raw = raw_fails(a) ? NULL : a->raw.raw_alloc(a->raw.ctx, raw_size);
    }
    if (!raw) {
        free(s);
        block_put(a, b);
        *shortfall = raw_size;
        return SEG_DEVICE;
    }
    s->raw = raw;
    s->raw_size = raw_size;
    s->size = size;
    s->small = small;
    s->first = b;
    s->next = a->segments;
    if (s->next) s->next->prev = s;
    a->segments = s;
    b->ptr = (char *)(((uintptr_t)raw + KILN_ALLOC_ALIGN - 1) & ~(uintptr_t)(KILN_ALLOC_ALIGN - 1));
    b->size = size;
    b->seg = s;
    a->st.reserved += raw_size;
    a->st.n_segments++;
    if (a->st.reserved > a->st.peak_reserved) a->st.peak_reserved = a->st.reserved;
    if (a->compliant_at > 0 && a->st.reserved > a->peak_since) a->peak_since = a->st.reserved;
    *out = b;
    return SEG_OK;
}

/* After reserved fell or a grace ended: a lowered budget met, with no grace left,
 * is compliance, and its peak starts there. */
static void watch_locked(kiln_allocator *a)
{
    if (a->grace || (a->st.budget && a->st.reserved > a->st.budget)) return;
    if (a->lowered_at > 0 && a->compliant_at == 0) {
        a->compliant_at = kiln_events_now();
        a->peak_since = a->st.reserved;
    }
}

static void grace_end_locked(kiln_allocator *a)
{
    if (!a->grace) return;
    a->grace = 0;
    atomic_fetch_sub(&n_graced, 1);
    watch_locked(a);
}

/* Gives a segment with no live block back to the device. Its one block must not be
 * in a pool. */
static void segment_release(kiln_allocator *a, segment *s)
{
    block_put(a, s->first);
    if (s->prev) s->prev->next = s->next;
    else a->segments = s->next;
    if (s->next) s->next->prev = s->prev;
    a->raw.raw_free(a->raw.ctx, s->raw, s->raw_size);
    a->st.reserved -= s->raw_size;
    a->st.n_segments--;
    free(s);
    watch_locked(a);
}

static uint64_t releasable_bytes(const kiln_allocator *a)
{
    uint64_t n = 0;
    for (const segment *s = a->segments; s; s = s->next)
        if (!s->n_live) n += s->raw_size;
    return n;
}

static void empty_cache_locked(kiln_allocator *a)
{
    for (segment *s = a->segments, *next; s; s = next) {
        next = s->next;
        if (!s->n_live) {
            pool_remove(a, s->first);
            segment_release(a, s);
        }
    }
}

/* ---- allocation ---- */

/* Hands out `size` bytes of the free block b (not in a pool), splitting off the
 * rest when it is worth keeping. A spare record must be available. */
static void *block_take(kiln_allocator *a, block *b, size_t size)
{
    size_t rest = b->size - size;
    if (a->caching && (b->seg->small ? rest >= ROUND : rest > SMALL_SIZE)) {
        block *r = block_get(a); /* cannot fail: spare_ensure */
        r->ptr = b->ptr + size;
        r->size = rest;
        r->seg = b->seg;
        r->prev = b;
        r->next = b->next;
        if (b->next) b->next->prev = r;
        b->next = r;
        b->size = size;
        pool_insert(a, r);
    }
    b->live = 1;
    b->seg->n_live++;
    map_insert(a, b);
    a->st.allocated += b->size;
    if (a->st.allocated > a->st.peak_allocated) a->st.peak_allocated = a->st.allocated;
    a->st.n_allocs++;
    return b->ptr;
}

/* One attempt without outside help: a cached block, else a new segment. */
static int try_alloc(kiln_allocator *a, size_t size, void **out, uint64_t *shortfall)
{
    if (!spare_ensure(a, 2)) return SEG_HOST;
    int small = size <= SMALL_SIZE;
    block *b = NULL;
    if (a->caching) {
        b = pool_best_fit(small ? a->small_pool : a->large_pool, size);
        if (b) pool_remove(a, b);
    }
    if (!b) {
        size_t seg = !a->caching ? size : small ? SMALL_SEGMENT : round_up(size, a->grain);
        int r = segment_new(a, seg, small, &b, shortfall);
        if (r != SEG_OK) return r;
    }
    *out = block_take(a, b, size);
    return SEG_OK;
}

static kiln_status oom_locked(kiln_allocator *a, size_t nbytes, int why)
{
    a->st.n_ooms++;
    uint64_t budget = a->st.budget;
    uint64_t free = a->free_bytes;
    if (budget && budget > a->st.reserved) free += budget - a->st.reserved;
    char req[32], bud[32], al[32], ca[32];
    kiln_format_bytes(req, sizeof req, (double)nbytes);
    kiln_format_bytes(al, sizeof al, (double)a->st.allocated);
    kiln_format_bytes(ca, sizeof ca, (double)a->free_bytes);
    if (budget) kiln_format_bytes(bud, sizeof bud, (double)budget);
    else snprintf(bud, sizeof bud, "unlimited");
    const char *tail = why == SEG_DEVICE ? "; the device has no more memory"
                     : why == SEG_HOST ? "; host memory for bookkeeping ran out" : "";
    return kiln_error_oom(a->name, nbytes, free, budget,
                          "%s: out of memory: tried to allocate %s; budget %s, %s allocated, %s cached free%s",
                          a->name, req, bud, al, ca, tail);
}

kiln_status kiln_allocator_alloc(kiln_allocator *a, size_t nbytes, void **out)
{
    if (!out) return kiln_error(KILN_ERR_ARG, "kiln_allocator_alloc: out is NULL");
    *out = NULL;
    if (!a) return kiln_error(KILN_ERR_ARG, "kiln_allocator_alloc: allocator is NULL");
    pthread_mutex_lock(&a->mu);
    if (kiln_fault_hit(KILN_FAULT_ALLOC)) {   /* a test's injected failure: as if the device were full */
        kiln_status st = oom_locked(a, nbytes, SEG_DEVICE);
        pthread_mutex_unlock(&a->mu);
        return st;
    }
    if (nbytes > MAX_REQUEST) {
        kiln_status st = oom_locked(a, nbytes, SEG_BUDGET);
        pthread_mutex_unlock(&a->mu);
        return st;
    }
    size_t size = round_up(nbytes ? nbytes : 1, a->caching ? ROUND : KILN_ALLOC_ALIGN);
    int evict_done = 0, pressure_done = 0, why;
    for (;;) {
        uint64_t shortfall = 0;
        why = try_alloc(a, size, out, &shortfall);
        if (why == SEG_OK) {
            pthread_mutex_unlock(&a->mu);
            return KILN_OK;
        }
        /* A segment larger than the whole budget: nothing to evict or release helps. */
        if (why == SEG_HOST || (why == SEG_BUDGET && shortfall > a->st.reserved)) break;
        uint64_t releasable = releasable_bytes(a);
        /* (1) Evict model weights - but only what emptying the cache cannot cover:
         * weights cost a reload, cached segments cost nothing to give back. */
        if (!evict_done && a->evict && shortfall > releasable) {
            kiln_evict_fn fn = a->evict;
            void *ctx = a->evict_ctx;
            uint64_t frees = a->st.n_frees;
            pthread_mutex_unlock(&a->mu);
            size_t freed = fn(ctx, a, (size_t)(shortfall - releasable));
            pthread_mutex_lock(&a->mu);
            /* Retry only on real progress here, so a hook that claims bytes it
             * freed elsewhere cannot keep us looping. */
            if (freed && a->st.n_frees != frees) continue;
            evict_done = 1;
        }
        /* (2) Give cached free segments back to the device. */
        if (releasable) {
            empty_cache_locked(a);
            continue;
        }
        /* (3) Let the host's garbage collector drop what it holds, once. */
        if (!pressure_done && a->pressure) {
            kiln_pressure_fn fn = a->pressure;
            void *ctx = a->pressure_ctx;
            pressure_done = 1;
            pthread_mutex_unlock(&a->mu);
            fn(ctx);
            pthread_mutex_lock(&a->mu);
            continue;
        }
        break;
    }
    kiln_status st = oom_locked(a, nbytes, why);
    pthread_mutex_unlock(&a->mu);
    return st;
}

void kiln_allocator_release(kiln_allocator *a, void *ptr)
{
    if (!a || !ptr) return;
    pthread_mutex_lock(&a->mu);
    block *b = map_take(a, ptr);
    if (!b) {
        /* Not a live block (double free, foreign or interior pointer): touching
         * anything would corrupt the pools, so count it and leave. */
        a->n_bad_releases++;
        pthread_mutex_unlock(&a->mu);
        return;
    }
    segment *s = b->seg;
    b->live = 0;
    s->n_live--;
    a->st.allocated -= b->size;
    a->st.n_frees++;
    if (!a->caching) {
        segment_release(a, s);
        pthread_mutex_unlock(&a->mu);
        return;
    }
    block *p = b->prev, *n = b->next;
    if (p && !p->live) {
        pool_remove(a, p);
        p->size += b->size;
        p->next = n;
        if (n) n->prev = p;
        block_put(a, b);
        b = p;
    }
    if (n && !n->live) {
        pool_remove(a, n);
        b->size += n->size;
        b->next = n->next;
        if (n->next) n->next->prev = b;
        block_put(a, n);
    }
    if (!s->n_live && ((a->st.budget && a->st.reserved > a->st.budget) ||
                       (a->cache_limit && a->free_bytes + b->size > a->cache_limit))) {
        segment_release(a, s); /* over a lowered budget or the cache limit: give it back */
    } else {
        pool_insert(a, b);
    }
    pthread_mutex_unlock(&a->mu);
}

size_t kiln_allocator_block_size(kiln_allocator *a, void *ptr)
{
    if (!a || !ptr) return 0;
    pthread_mutex_lock(&a->mu);
    block *b = map_find(a, ptr);
    size_t n = b ? b->size : 0;
    pthread_mutex_unlock(&a->mu);
    return n;
}

/* ---- lifetime and control ---- */

kiln_allocator *kiln_allocator_new(const char *device_name, kiln_raw_memory raw,
                                   uint64_t budget, int caching)
{
    if (!raw.raw_alloc || !raw.raw_free) {
        kiln_error(KILN_ERR_ARG, "kiln_allocator_new: %s: raw_alloc and raw_free are required",
                   device_name ? device_name : "?");
        return NULL;
    }
    kiln_allocator *a = calloc(1, sizeof *a);
    if (a) a->buckets = calloc(256, sizeof *a->buckets);
    if (!a || !a->buckets || pthread_mutex_init(&a->mu, NULL) != 0) {
        if (a) free(a->buckets);
        free(a);
        kiln_error(KILN_ERR_OOM, "kiln_allocator_new: out of host memory");
        return NULL;
    }
    a->n_buckets = 256;
    snprintf(a->name, sizeof a->name, "%s", device_name ? device_name : "?");
    a->raw = raw;
    a->caching = caching;
    a->grain = LARGE_GRAIN;
    a->st.budget = budget;
    a->fail_after = -1;
    a->rng = 0x9E3779B9u;
    return a;
}

void kiln_allocator_set_cache_limit(kiln_allocator *a, uint64_t bytes)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->cache_limit = bytes;
    pthread_mutex_unlock(&a->mu);
}

void kiln_allocator_set_grain(kiln_allocator *a, size_t grain)
{
    if (!a || grain < ROUND) return;
    pthread_mutex_lock(&a->mu);
    a->grain = round_up(grain, ROUND);
    pthread_mutex_unlock(&a->mu);
}

size_t kiln_allocator_grain(kiln_allocator *a)
{
    if (!a) return LARGE_GRAIN;
    pthread_mutex_lock(&a->mu);
    size_t g = a->grain;
    pthread_mutex_unlock(&a->mu);
    return g;
}

uint64_t kiln_allocator_cache_limit(kiln_allocator *a)
{
    if (!a) return 0;
    pthread_mutex_lock(&a->mu);
    uint64_t c = a->cache_limit;
    pthread_mutex_unlock(&a->mu);
    return c;
}

uint64_t kiln_allocator_free(kiln_allocator *a)
{
    if (!a) return 0;
    uint64_t leaked = a->st.allocated;
    for (segment *s = a->segments, *next; s; s = next) {
        next = s->next;
        for (block *b = s->first, *bn; b; b = bn) {
            bn = b->next;
            free(b);
        }
        a->raw.raw_free(a->raw.ctx, s->raw, s->raw_size);
        free(s);
    }
    for (block *b = a->spare, *next; b; b = next) {
        next = b->hnext;
        free(b);
    }
    free(a->buckets);
    if (a->grace) atomic_fetch_sub(&n_graced, 1);
    pthread_mutex_destroy(&a->mu);
    free(a);
    return leaked;
}

static void set_budget(kiln_allocator *a, uint64_t budget, int live)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    uint64_t old = a->st.budget;
    a->st.budget = budget;
    a->budget_changes++;
    if (budget && (!old || budget < old)) {
        a->lowered_at = kiln_events_now();
        a->compliant_at = 0;
        a->peak_since = 0;
        a->peak_before = a->st.peak_reserved > a->st.reserved ? a->st.peak_reserved : a->st.reserved;
        if (live && !a->grace) {
            /* the cap the run had, and never below what it holds now */
            uint64_t cap = old ? old : UINT64_MAX;
            if (cap < a->st.reserved) cap = a->st.reserved;
            a->grace = cap;
            atomic_fetch_add(&n_graced, 1);
        }
    } else if (a->grace) {
        a->grace = 0; /* raised: the new budget is the one that holds */
        atomic_fetch_sub(&n_graced, 1);
    }
    if (budget && a->st.reserved > budget) empty_cache_locked(a);
    watch_locked(a);
    pthread_mutex_unlock(&a->mu);
}

void kiln_allocator_set_budget(kiln_allocator *a, uint64_t budget)
{
    set_budget(a, budget, 0);
}

void kiln_allocator_set_budget_live(kiln_allocator *a, uint64_t budget)
{
    set_budget(a, budget, 1);
}

kiln_budget_watch kiln_allocator_budget_watch(kiln_allocator *a)
{
    kiln_budget_watch w;
    memset(&w, 0, sizeof w);
    if (!a) return w;
    pthread_mutex_lock(&a->mu);
    w.changes = a->budget_changes;
    w.grace = a->grace != 0;
    w.over = a->st.budget && a->st.reserved > a->st.budget;
    w.lowered_at = a->lowered_at;
    w.compliant_at = a->compliant_at;
    w.peak_since = a->peak_since;
    w.peak_before = a->peak_before;
    pthread_mutex_unlock(&a->mu);
    return w;
}

void kiln_allocator_end_grace(kiln_allocator *a)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    grace_end_locked(a);
    pthread_mutex_unlock(&a->mu);
}

int kiln_allocator_graced(void)
{
    return atomic_load(&n_graced);
}

kiln_mem_stats kiln_allocator_stats(kiln_allocator *a)
{
    kiln_mem_stats st;
    memset(&st, 0, sizeof st);
    if (!a) return st;
    pthread_mutex_lock(&a->mu);
    st = a->st;
    size_t s = pool_largest(a->small_pool), l = pool_largest(a->large_pool);
    st.largest_free = s > l ? s : l;
    pthread_mutex_unlock(&a->mu);
    return st;
}

void kiln_allocator_reset_peak(kiln_allocator *a)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->st.peak_allocated = a->st.allocated;
    a->st.peak_reserved = a->st.reserved;
    pthread_mutex_unlock(&a->mu);
}

void kiln_allocator_empty_cache(kiln_allocator *a)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    empty_cache_locked(a);
    pthread_mutex_unlock(&a->mu);
}

void kiln_allocator_set_evict_hook(kiln_allocator *a, kiln_evict_fn fn, void *ctx)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->evict = fn;
    a->evict_ctx = ctx;
    pthread_mutex_unlock(&a->mu);
}

void kiln_allocator_set_pressure_hook(kiln_allocator *a, kiln_pressure_fn fn, void *ctx)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->pressure = fn;
    a->pressure_ctx = ctx;
    pthread_mutex_unlock(&a->mu);
}

const char *kiln_allocator_device_name(kiln_allocator *a)
{
    return a ? a->name : "?";
}

/* n more raw allocations succeed, then every one fails until n = -1 (as the
 * allocation limit of Lua's ltests.h). Cached blocks are still handed out. */
void kiln_allocator_fail_after(kiln_allocator *a, int n)
{
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->fail_after = n < 0 ? -1 : n;
    pthread_mutex_unlock(&a->mu);
}

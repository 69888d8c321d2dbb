/* test_mem_timeline.c - the memory timeline (runtime/mem_timeline.c) and its picture
 * (runtime/mem_plot.c): bytes by owner against the allocator under random allocation
 * and owner changes, the bounded frame list keeping the peak, stage peaks and
 * nesting, the bounded stage list, scratch and workspace owners, the PNG's size. */
#define _DEFAULT_SOURCE /* usleep */
#include "test.h"
#include "../runtime/device.h"
#include "../runtime/events.h"
#include "../runtime/mem_plot.h"
#include "../runtime/png_io.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <unistd.h>

static kiln_device *sim(void) { return kiln_device_get("sim"); }

static uint64_t allocated(void) { return kiln_allocator_stats(sim()->alloc).allocated; }

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(uint64_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state % n;
}

static uint64_t owner_bytes(const kiln_mem_timeline *tl, const char *name)
{
    for (int i = 0; i < tl->n_owners; i++)
        if (strcmp(tl->owners[i], name) == 0) return tl->now[i];
    return 0;
}

static void t_totals_follow_allocator(void)
{
    static const char *const owners[] = {"tensor", "model:a", "lora:b"};
    enum { N = 600 };
    kiln_storage *live[N] = {0};
    int owner_of[N] = {0};
    for (int step = 0; step < 4000; step++) {
        int k = (int)rnd(N);
        if (!live[k]) {
            if (kiln_storage_new(sim(), 1 + (size_t)rnd(300000), &live[k]) != KILN_OK) {
                CHECK(0, "allocation failed: %s", kiln_last_error());
                return;
            }
            owner_of[k] = 0;
        } else if (rnd(3) == 0) {
            owner_of[k] = (int)rnd(3);
            kiln_storage_set_owner(live[k], owners[owner_of[k]]);
        } else {
            kiln_storage_release(live[k]);
            live[k] = NULL;
        }
        if (step % 97 != 0) continue;
        kiln_mem_timeline tl;
        CHECK(kiln_mem_timeline_get(sim(), &tl) == KILN_OK, "get");
        CHECK(tl.total == allocated(), "step %d: timeline %llu, allocator %llu", step,
              (unsigned long long)tl.total, (unsigned long long)allocated());
        CHECK(kiln_mem_timeline_sum(tl.now, tl.n_owners) == tl.total, "owners add up");
        uint64_t want[3] = {0};
        for (int i = 0; i < N; i++)
            if (live[i]) want[owner_of[i]] += kiln_allocator_block_size(sim()->alloc, live[i]->data);
        for (int o = 0; o < 3; o++)
            CHECK(owner_bytes(&tl, owners[o]) == want[o], "step %d: %s holds %llu, expected %llu", step, owners[o],
                  (unsigned long long)owner_bytes(&tl, owners[o]), (unsigned long long)want[o]);
        kiln_mem_timeline_release(&tl);
    }
    for (int i = 0; i < N; i++) kiln_storage_release(live[i]);
    kiln_mem_timeline tl;
    kiln_mem_timeline_get(sim(), &tl);
    CHECK(tl.total == allocated() && tl.total == 0, "all freed: timeline %llu", (unsigned long long)tl.total);
    kiln_mem_timeline_release(&tl);
    /* a pointer the timeline never saw changes nothing */
    int x;
    kiln_mem_timeline_free(sim(), &x);
    kiln_mem_timeline_set_owner(sim(), &x, "model:z");
    kiln_mem_timeline_get(sim(), &tl);
    CHECK(tl.total == 0, "unknown pointer");
    kiln_mem_timeline_release(&tl);
}

static void t_scratch_owners(void)
{
    void *a = NULL, *b = NULL;
    CHECK(kiln_device_scratch_alloc(sim(), 100000, 0, &a) == KILN_OK, "scratch");
    CHECK(kiln_device_scratch_alloc(sim(), 50000, KILN_SCRATCH_NO_EVICT, &b) == KILN_OK, "workspace");
    kiln_mem_timeline tl;
    kiln_mem_timeline_get(sim(), &tl);
    CHECK(owner_bytes(&tl, "scratch") == kiln_allocator_block_size(sim()->alloc, a), "scratch bytes");
    CHECK(owner_bytes(&tl, "workspace") == kiln_allocator_block_size(sim()->alloc, b), "workspace bytes");
    kiln_mem_timeline_release(&tl);
    kiln_device_scratch_free(sim(), a);
    kiln_device_scratch_free(sim(), b);
    kiln_mem_timeline_get(sim(), &tl);
    CHECK(tl.total == 0 && allocated() == 0, "freed");
    kiln_mem_timeline_release(&tl);
}

static void t_frames_bounded(void)
{
    kiln_mem_timeline_clear();
    kiln_allocator_reset_peak(sim()->alloc);
    kiln_storage *spike = NULL;
    for (int i = 0; i < 20000; i++) {
        kiln_storage *s;
        if (kiln_storage_new(sim(), 1000 + (size_t)(i % 13) * 64, &s) != KILN_OK) return;
        if (i == 12345) kiln_storage_new(sim(), 3u << 20, &spike);
        if (i == 12346) kiln_storage_release(spike);
        kiln_storage_release(s);
    }
    kiln_mem_timeline tl;
    kiln_mem_timeline_get(sim(), &tl);
    CHECK(tl.n_frames <= KILN_TIMELINE_FRAMES && tl.n_frames >= KILN_TIMELINE_FRAMES / 4, "%d frames", tl.n_frames);
    uint64_t top = 0;
    for (int f = 0; f < tl.n_frames; f++) {
        const kiln_timeline_frame *fr = &tl.frames[f];
        CHECK(fr->t0 <= fr->t1, "frame %d runs backwards", f);
        if (f) CHECK(tl.frames[f - 1].t1 <= fr->t0, "frames %d and %d overlap", f - 1, f);
        CHECK(kiln_mem_timeline_sum(fr->at_peak, tl.n_owners) == fr->peak, "frame %d's row", f);
        if (fr->peak > top) top = fr->peak;
    }
    uint64_t peak = kiln_allocator_stats(sim()->alloc).peak_allocated;
    CHECK(tl.peak == peak, "timeline peak %llu, allocator %llu", (unsigned long long)tl.peak, (unsigned long long)peak);
    CHECK(top == peak, "the frames keep the peak: %llu of %llu", (unsigned long long)top, (unsigned long long)peak);
    kiln_mem_timeline_release(&tl);
}

static const kiln_timeline_span *find_span(const kiln_mem_timeline *tl, const char *name)
{
    for (int i = 0; i < tl->n_spans; i++)
        if (strcmp(tl->spans[i].name, name) == 0) return &tl->spans[i];
    return NULL;
}

static void t_stage_peaks(void)
{
    kiln_mem_timeline_clear();
    kiln_storage *a, *b, *c;
    uint64_t sa = kiln_mem_timeline_span_begin("a", kiln_events_now());
    kiln_storage_new(sim(), 1u << 20, &a);
    uint64_t pa = allocated();
    kiln_storage_set_owner(a, "model:big");
    kiln_storage_release(a);
    kiln_mem_timeline_span_end(sa, kiln_events_now(), 0);
    uint64_t sb = kiln_mem_timeline_span_begin("b", kiln_events_now());
    kiln_storage_new(sim(), 512u << 10, &b);
    uint64_t sc = kiln_mem_timeline_span_begin("c", kiln_events_now());
    kiln_storage_new(sim(), 256u << 10, &c);
    uint64_t pc = allocated();
    kiln_storage_release(c);
    kiln_mem_timeline_span_end(sc, kiln_events_now(), 1);
    kiln_storage_release(b);
    uint64_t sd = kiln_mem_timeline_span_begin("open", kiln_events_now());
    kiln_mem_timeline_span_end(sb, kiln_events_now(), 0);
    kiln_mem_timeline tl;
    kiln_mem_timeline_get(sim(), &tl);
    const kiln_timeline_span *A = find_span(&tl, "a"), *B = find_span(&tl, "b"), *C = find_span(&tl, "c"),
                             *D = find_span(&tl, "open");
    CHECK(A && B && C && D && tl.n_spans == 4, "%d stages", tl.n_spans);
    if (A && B && C && D) {
        CHECK(A->peak == pa && B->peak == pc && C->peak == pc, "peaks %llu %llu %llu",
              (unsigned long long)A->peak, (unsigned long long)B->peak, (unsigned long long)C->peak);
        CHECK(A->top_owner >= 0 && strcmp(tl.owners[A->top_owner], "tensor") == 0,
              "a's peak came before the owner changed");
        CHECK(A->depth == 0 && B->depth == 0 && C->depth == 1 && D->depth == 1, "depths");
        CHECK(!A->failed && C->failed, "failed flags");
        CHECK(D->t1 < 0 && B->t1 >= B->t0, "open and ended");
    }
    char *table = kiln_mem_plot_table(&tl);
    CHECK(table && strstr(table, "  c (error)") && strstr(table, "open"), "table:\n%s", table ? table : "(null)");
    free(table);
    kiln_mem_timeline_release(&tl);
    kiln_mem_timeline_span_end(sd, kiln_events_now(), 0);
    kiln_mem_timeline_span_end(sd, kiln_events_now(), 0); /* twice: nothing */
    kiln_mem_timeline_span_end(0, kiln_events_now(), 0);
}

static void t_stages_bounded(void)
{
    kiln_mem_timeline_clear();
    uint64_t outer = kiln_mem_timeline_span_begin("outer", kiln_events_now());
    for (int i = 0; i < 3 * KILN_TIMELINE_SPANS; i++) {
        char name[32];
        snprintf(name, sizeof name, "inner %d", i);
        kiln_mem_timeline_span_end(kiln_mem_timeline_span_begin(name, kiln_events_now()), kiln_events_now(), 0);
    }
    kiln_mem_timeline_span_end(outer, kiln_events_now(), 0);
    kiln_mem_timeline tl;
    kiln_mem_timeline_get(sim(), &tl);
    CHECK(tl.n_spans <= KILN_TIMELINE_SPANS && tl.n_spans > 1, "%d stages", tl.n_spans);
    CHECK(tl.n_spans && strcmp(tl.spans[0].name, "outer") == 0 && tl.spans[0].t1 >= 0, "the top stage is kept");
    CHECK(tl.n_spans && strcmp(tl.spans[tl.n_spans - 1].name, "inner 6143") == 0, "the newest are kept: %s",
          tl.n_spans ? tl.spans[tl.n_spans - 1].name : "-");
    CHECK(tl.spans_dropped + (uint64_t)tl.n_spans == 3 * KILN_TIMELINE_SPANS + 1, "dropped %llu",
          (unsigned long long)tl.spans_dropped);
    kiln_mem_timeline_release(&tl);
}

static void t_picture(void)
{
    kiln_mem_timeline_clear();
    kiln_storage *m, *t;
    uint64_t s = kiln_mem_timeline_span_begin("load", kiln_events_now());
    kiln_storage_new(sim(), 4u << 20, &m);
    kiln_storage_set_owner(m, "model:unet");
    kiln_mem_timeline_span_end(s, kiln_events_now(), 0);
    s = kiln_mem_timeline_span_begin("run", kiln_events_now());
    kiln_storage_new(sim(), 2u << 20, &t);
    usleep(20000);
    kiln_storage_release(t);
    kiln_mem_timeline_span_end(s, kiln_events_now(), 0);
    kiln_mem_timeline tl;
    kiln_mem_timeline_get(sim(), &tl);
    char path[64];
    snprintf(path, sizeof path, "/tmp/kiln_test_mem_plot_%d.png", (int)getpid());
    kiln_mem_plot_options o = {640, 320, "test"};
    kiln_mem_plot_layout lay;
    CHECK(kiln_mem_plot_write(&tl, path, &o, &lay) == KILN_OK, "write: %s", kiln_last_error());
    float *px = NULL;
    int c = 0, h = 0, w = 0;
    CHECK(kiln_png_read(path, &px, &c, &h, &w) == KILN_OK && c == 3 && h == 320 && w == 640, "%dx%dx%d", c, h, w);
    int unet = -1;
    for (int i = 0; i < tl.n_owners; i++)
        if (strcmp(tl.owners[i], "model:unet") == 0) unet = i;
    CHECK(unet >= 0 && lay.n_order >= 1, "owners");
    if (px && unet >= 0) {
        /* the last column drawn holds the model alone, at the bottom */
        int x = lay.x1 - 2, y = lay.y1 - 2;
        for (int k = 0; k < 3; k++)
            CHECK((int)lroundf(px[(size_t)k * h * w + (size_t)y * w + x] * 255) == lay.color[unet][k],
                  "channel %d of (%d, %d)", k, x, y);
    }
    free(px);
    unlink(path);
    o.width = 100;
    CHECK(kiln_mem_plot_write(&tl, path, &o, NULL) == KILN_ERR_ARG, "too small");
    kiln_mem_timeline_release(&tl);
    kiln_storage_release(m);
}

/* Allocating threads, a thread reading the timeline and stages on the main thread at
 * once (ThreadSanitizer runs this): in the end the totals still match. */
static void *alloc_worker(void *arg)
{
    unsigned seed = (unsigned)(uintptr_t)arg;
    kiln_storage *keep[16] = {0};
    for (int i = 0; i < 3000; i++) {
        seed = seed * 1103515245u + 12345u;
        int k = (int)(seed >> 16) % 16;
        if (keep[k]) {
            if (seed & 1) kiln_storage_set_owner(keep[k], (seed & 2) ? "model:w" : "tensor");
            kiln_storage_release(keep[k]);
            keep[k] = NULL;
        } else if (kiln_storage_new(sim(), 256 + (seed >> 20) % 65536, &keep[k]) != KILN_OK) {
            keep[k] = NULL;
        }
    }
    for (int k = 0; k < 16; k++) kiln_storage_release(keep[k]);
    return NULL;
}

static atomic_int stop_reader;

static void *read_worker(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop_reader)) {
        kiln_mem_timeline tl;
        if (kiln_mem_timeline_get(sim(), &tl) == KILN_OK) kiln_mem_timeline_release(&tl);
    }
    return NULL;
}

static void t_threads(void)
{
    kiln_mem_timeline_clear();
    pthread_t w[3], r;
    atomic_store(&stop_reader, 0);
    pthread_create(&r, NULL, read_worker, NULL);
    for (int i = 0; i < 3; i++) pthread_create(&w[i], NULL, alloc_worker, (void *)(uintptr_t)(i + 1));
    for (int i = 0; i < 200; i++) {
        uint64_t id = kiln_mem_timeline_span_begin("main", kiln_events_now());
        kiln_mem_timeline_span_end(id, kiln_events_now(), 0);
    }
    for (int i = 0; i < 3; i++) pthread_join(w[i], NULL);
    atomic_store(&stop_reader, 1);
    pthread_join(r, NULL);
    kiln_mem_timeline tl;
    kiln_mem_timeline_get(sim(), &tl);
    CHECK(tl.total == allocated() && tl.total == 0, "timeline %llu, allocator %llu", (unsigned long long)tl.total,
          (unsigned long long)allocated());
    CHECK(tl.n_spans == 200, "%d stages", tl.n_spans);
    kiln_mem_timeline_release(&tl);
}

int main(void)
{
    RUN(t_totals_follow_allocator);
    RUN(t_scratch_owners);
    RUN(t_frames_bounded);
    RUN(t_stage_peaks);
    RUN(t_stages_bounded);
    RUN(t_picture);
    RUN(t_threads);
    return test_summary();
}

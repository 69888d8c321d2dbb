/* test_model.c - model weight stores: opening (overrides, lookups, closest names),
 * load with dtype conversion, offload / unload accounting, LRU eviction (pinned
 * models kept, mode "high" gives OOM instead), a randomized stress under a small
 * budget, 200 load/use/unload cycles, low-mode streaming with the copy thread, the
 * event log and a trace file checked with the JSON parser. All on cpu and sim. */
#define _GNU_SOURCE
#include "model.h"
#include "events.h"
#include "trace.h"
#include "json.h"
#include "safetensors.h"
#include "test.h"

#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#define KiB ((uint64_t)1 << 10)
#define MiB ((uint64_t)1 << 20)

static char dir[64];

static const char *path_in(const char *name)
{
    static char buf[4][256];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 256, "%s/%s", dir, name);
    return p;
}

static float value_of(int tensor, int64_t i, int seed) { return (float)((i % 1000) * 0.001 + tensor + seed * 0.5); }

/* n f32 tensors "blk.<i>.w" of elems each, plus an i64 "ids" [8]. */
static const char *make_model(const char *name, int n, int64_t elems, int seed)
{
    const char *path = path_in(name);
    kiln_st_item *items = calloc((size_t)n + 1, sizeof *items);
    char (*names)[32] = calloc((size_t)n, sizeof *names);
    float **data = calloc((size_t)n, sizeof *data);
    int64_t shape[1] = {elems}, ids_shape[1] = {8};
    int64_t ids[8];
    for (int i = 0; i < 8; i++) ids[i] = 1000 + i + seed;
    for (int t = 0; t < n; t++) {
        data[t] = malloc(sizeof(float) * (size_t)elems);
        for (int64_t i = 0; i < elems; i++) data[t][i] = value_of(t, i, seed);
        snprintf(names[t], sizeof names[t], "blk.%d.w", t);
        items[t] = (kiln_st_item){names[t], KILN_F32, 1, shape, data[t]};
    }
    items[n] = (kiln_st_item){"ids", KILN_I64, 1, ids_shape, ids};
    kiln_status st = kiln_st_save(path, n + 1, items, 0, NULL, NULL);
    if (st) printf("# make_model %s: %s\n", name, kiln_last_error());
    for (int t = 0; t < n; t++) free(data[t]);
    free(data);
    free(names);
    free(items);
    return path;
}

static kiln_device *sim(void) { return kiln_device_get("sim"); }
static kiln_device *cpu(void) { return kiln_device_cpu(); }
static uint64_t allocated(kiln_device *d) { return kiln_allocator_stats(d->alloc).allocated; }

static kiln_model *open1(const char *path, const char *name)
{
    kiln_model *m = NULL;
    kiln_status st = kiln_model_open(&path, 1, name, &m);
    if (st) printf("# open %s: %s\n", path, kiln_last_error());
    return m;
}

static int count_events(uint64_t since, kiln_event_kind kind, const char *owner)
{
    static kiln_event ev[KILN_EVENTS_CAPACITY];
    size_t n = kiln_events_get(since, ev, KILN_EVENTS_CAPACITY);
    int c = 0;
    for (size_t i = 0; i < n; i++)
        if (ev[i].kind == kind && (!owner || strcmp(ev[i].owner, owner) == 0)) c++;
    return c;
}

static void reset_sim(void)
{
    kiln_memory_mode_set(KILN_MEM_NORMAL);
    kiln_allocator_empty_cache(sim()->alloc);
    kiln_allocator_set_budget(sim()->alloc, 8ull << 30);
}

/* ---- tests ---- */

static void t_open_lookup(void)
{
    const char *p1 = make_model("o1.safetensors", 3, 16, 0);
    const char *p2 = make_model("o2.safetensors", 2, 16, 7); /* overrides blk.0, blk.1, ids */
    const char *paths[2] = {p1, p2};
    kiln_model *m;
    CHECK(kiln_model_open(paths, 2, NULL, &m) == KILN_OK, "%s", kiln_last_error());
    if (!m) return;
    CHECK(strcmp(kiln_model_name(m), "o1") == 0, "default name %s", kiln_model_name(m));
    CHECK(kiln_model_count(m) == 4, "count %d", kiln_model_count(m));
    kiln_tensor *t;
    CHECK(kiln_model_tensor(m, "blk.0.w", &t) == KILN_OK, "%s", kiln_last_error());
    CHECK(t->storage->device == cpu() && t->dtype == KILN_F32, "mapped f32 on cpu");
    CHECK(((float *)kiln_tensor_data(t))[3] == value_of(0, 3, 7), "later file overrides: %g", ((float *)kiln_tensor_data(t))[3]);
    kiln_tensor_free(t);
    CHECK(kiln_model_tensor(m, "blk.2.w", &t) == KILN_OK, "%s", kiln_last_error());
    CHECK(((float *)kiln_tensor_data(t))[3] == value_of(2, 3, 0), "earlier file keeps the rest");
    kiln_tensor_free(t);
    kiln_status st = kiln_model_tensor(m, "blk.0.ww", &t);
    CHECK(st == KILN_ERR_ARG && !t, "missing name fails");
    const char *msg = kiln_last_error();
    CHECK(strstr(msg, "'blk.0.ww'") && strstr(msg, "model 'o1'") && strstr(msg, "closest: 'blk.0.w'"), "message: %s", msg);
    kiln_residency r;
    CHECK(kiln_model_where(m, "ids", &r) == KILN_OK && r == KILN_RES_MAPPED, "mapped residency");
    kiln_model_close(m);

    const char *bad = path_in("nope.safetensors");
    st = kiln_model_open(&bad, 1, "x", &m);
    CHECK(st != KILN_OK && !m && strstr(kiln_last_error(), "nope.safetensors"), "missing file: %s", kiln_last_error());
    st = kiln_model_open(NULL, 0, "x", &m);
    CHECK(st == KILN_ERR_ARG, "no files");
}

static void t_load_convert(void)
{
    reset_sim();
    const int64_t elems = 256 * 1024; /* 1 MiB of f32 per tensor */
    kiln_model *m = open1(make_model("conv.safetensors", 4, elems, 1), "conv");
    if (!m) return;
    uint64_t sim0 = allocated(sim()), cpu0 = allocated(cpu());
    kiln_allocator_reset_peak(cpu()->alloc);
    uint64_t since = kiln_events_last_seq();
    CHECK(kiln_model_load(m, sim(), KILN_F16) == KILN_OK, "%s", kiln_last_error());
    /* converted straight from the mapping: no host copy, not even temporarily */
    CHECK(kiln_allocator_stats(cpu()->alloc).peak_allocated - cpu0 < 64 * KiB, "host peak grew by %llu",
          (unsigned long long)(kiln_allocator_stats(cpu()->alloc).peak_allocated - cpu0));
    uint64_t want = 4 * (uint64_t)elems * 2 + 64;
    CHECK(kiln_model_bytes(m, sim()) == want, "sim bytes %llu want %llu", (unsigned long long)kiln_model_bytes(m, sim()),
          (unsigned long long)want);
    CHECK(allocated(sim()) - sim0 >= want, "allocator counts them");
    CHECK(count_events(since, KILN_EV_LOAD, "model:conv") == 1, "one load event");
    kiln_tensor *t;
    CHECK(kiln_model_tensor(m, "blk.3.w", &t) == KILN_OK, "%s", kiln_last_error());
    CHECK(t->storage->device == sim() && t->dtype == KILN_F16, "f16 on sim");
    CHECK(strcmp(t->storage->owner, "model:conv") == 0, "owner %s", t->storage->owner);
    int bad = 0;
    for (int64_t i = 0; i < elems; i += 997)
        bad += kiln_f16_to_f32(((uint16_t *)kiln_tensor_data(t))[i]) != kiln_f16_to_f32(kiln_f32_to_f16(value_of(3, i, 1)));
    CHECK(!bad, "%d converted values differ", bad);
    kiln_tensor_free(t);
    CHECK(kiln_model_tensor(m, "ids", &t) == KILN_OK, "%s", kiln_last_error());
    CHECK(t->dtype == KILN_I64 && ((int64_t *)kiln_tensor_data(t))[2] == 1003, "integer tensors keep their dtype");
    kiln_tensor_free(t);
    /* loading again is cheap: nothing copied */
    uint64_t copies = sim()->bytes_to_device;
    CHECK(kiln_model_load(m, sim(), KILN_F16) == KILN_OK, "%s", kiln_last_error());
    CHECK(sim()->bytes_to_device == copies, "a resident model is not copied again");
    kiln_model_close(m);
    CHECK(allocated(sim()) == sim0 && allocated(cpu()) == cpu0, "close frees everything");
}

static void t_offload_unload(void)
{
    reset_sim();
    kiln_model *m = open1(make_model("off.safetensors", 3, 64 * 1024, 2), "off");
    if (!m) return;
    uint64_t sim0 = allocated(sim()), cpu0 = allocated(cpu());
    uint64_t since = kiln_events_last_seq();
    CHECK(kiln_model_load(m, sim(), -1) == KILN_OK, "%s", kiln_last_error());
    uint64_t b = kiln_model_bytes(m, sim());
    CHECK(b == 3 * 256 * KiB + 64, "bytes %llu", (unsigned long long)b);
    CHECK(kiln_model_offload(m) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_bytes(m, sim()) == 0 && allocated(sim()) == sim0, "device copies freed");
    CHECK(kiln_model_bytes(m, cpu()) == b && allocated(cpu()) - cpu0 >= b, "host copies accounted on cpu");
    kiln_model_info in;
    kiln_model_get_info(m, &in);
    CHECK(in.count[KILN_RES_HOST] == 4 && in.host_bytes == b, "residency host %d", in.count[KILN_RES_HOST]);
    kiln_tensor *t;
    CHECK(kiln_model_tensor(m, "blk.1.w", &t) == KILN_OK && t->storage->device == cpu() && !t->storage->release,
          "tensor() gives the host copy");
    CHECK(((float *)kiln_tensor_data(t))[5] == value_of(1, 5, 2), "host copy value");
    kiln_tensor_free(t);
    CHECK(kiln_model_load(m, sim(), -1) == KILN_OK, "%s", kiln_last_error());
    CHECK(allocated(cpu()) == cpu0, "host copies freed after the load");
    kiln_model_unload(m);
    CHECK(allocated(sim()) == sim0 && allocated(cpu()) == cpu0, "unload frees all");
    kiln_model_get_info(m, &in);
    CHECK(in.count[KILN_RES_MAPPED] == 4 && !in.device, "back to mapped");
    CHECK(count_events(since, KILN_EV_OFFLOAD, "model:off") == 1 && count_events(since, KILN_EV_UNLOAD, "model:off") == 1,
          "offload and unload events");
    /* memory mode none: load goes to the cpu */
    kiln_memory_mode_set(KILN_MEM_NONE);
    CHECK(kiln_model_load(m, sim(), -1) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_bytes(m, sim()) == 0 && kiln_model_bytes(m, cpu()) == b, "mode none loads to cpu");
    kiln_memory_mode_set(KILN_MEM_NORMAL);
    kiln_model_close(m);
    CHECK(allocated(cpu()) == cpu0, "close frees host");
}

static void t_eviction(void)
{
    reset_sim();
    /* models of 4 x 256 KiB; a 4 MiB budget holds three of them (small blocks share
     * 2 MiB segments) and the fourth needs an eviction */
    kiln_model *m[4];
    char name[32];
    for (int i = 0; i < 4; i++) {
        snprintf(name, sizeof name, "ev%d.safetensors", i);
        m[i] = open1(make_model(name, 4, 64 * 1024, i), NULL);
        if (!m[i]) return;
    }
    uint64_t sim0 = allocated(sim());
    CHECK(sim0 == 0, "sim starts empty (%llu)", (unsigned long long)sim0);
    kiln_allocator_set_budget(sim()->alloc, 4 * MiB);
    uint64_t since = kiln_events_last_seq();
    for (int i = 0; i < 3; i++) CHECK(kiln_model_load(m[i], sim(), -1) == KILN_OK, "load %d: %s", i, kiln_last_error());
    kiln_tensor *t;
    CHECK(kiln_model_tensor(m[0], "blk.0.w", &t) == KILN_OK, "touch ev0"); /* ev1 is now least recently used */
    kiln_tensor_free(t);
    CHECK(kiln_model_load(m[3], sim(), -1) == KILN_OK, "load 3: %s", kiln_last_error());
    CHECK(kiln_model_bytes(m[1], sim()) == 0, "ev1 (LRU) evicted");
    CHECK(kiln_model_bytes(m[0], sim()) > 0 && kiln_model_bytes(m[3], sim()) > 0, "ev0 and ev3 resident");
    CHECK(count_events(since, KILN_EV_EVICT, "model:ev1") == 1, "evict event for ev1");
    CHECK(count_events(since, KILN_EV_EVICT, "model:ev0") == 0, "no evict event for ev0");
    /* evicted tensors fall back to the mapping */
    kiln_residency r;
    CHECK(kiln_model_where(m[1], "blk.2.w", &r) == KILN_OK && r == KILN_RES_MAPPED, "ev1 mapped again");

    /* pinned models are never evicted: pin ev2 (now the LRU) and reload ev1 */
    kiln_model_pin(m[2]);
    CHECK(kiln_model_load(m[1], sim(), -1) == KILN_OK, "reload ev1: %s", kiln_last_error());
    CHECK(kiln_model_bytes(m[2], sim()) > 0, "pinned ev2 kept");
    CHECK(kiln_model_bytes(m[0], sim()) == 0, "ev0 evicted instead");
    CHECK(kiln_allocator_stats(sim()->alloc).peak_reserved <= 4 * MiB, "within budget");

    /* mode high: nothing is evicted, an out-of-memory with details instead */
    kiln_memory_mode_set(KILN_MEM_HIGH);
    uint64_t before = kiln_events_last_seq();
    kiln_status st = kiln_model_load(m[0], sim(), -1);
    CHECK(st == KILN_ERR_OOM, "high mode: OOM (got %s)", kiln_status_name(st));
    const kiln_oom_info *o = kiln_last_oom();
    CHECK(strcmp(o->device, "sim") == 0 && o->budget == 4 * MiB && o->requested == 256 * KiB, "oom info %s %llu %llu",
          o->device, (unsigned long long)o->budget, (unsigned long long)o->requested);
    const char *msg = kiln_last_error();
    CHECK(strstr(msg, "model 'ev0'") && strstr(msg, "memory mode high") && strstr(msg, "pinned: ev2") &&
          strstr(msg, "resident on sim:") && strstr(msg, "model:ev1"), "message: %s", msg);
    CHECK(count_events(before, KILN_EV_EVICT, NULL) == 0, "nothing evicted in high mode");
    CHECK(count_events(before, KILN_EV_OOM, "model:ev0") >= 1, "OOM event owned by the loading model");
    CHECK(kiln_model_bytes(m[0], sim()) == 0, "the failed load left nothing behind");
    CHECK(kiln_model_bytes(m[1], sim()) > 0 && kiln_model_bytes(m[2], sim()) > 0 && kiln_model_bytes(m[3], sim()) > 0,
          "the resident models stay");
    kiln_memory_mode_set(KILN_MEM_NORMAL);
    CHECK(kiln_model_unpin(m[2]) == KILN_OK && kiln_model_unpin(m[2]) == KILN_ERR_STATE, "unpin balance");

    /* a model held by a user reference is dropped from the model, freed with the user's tensor */
    CHECK(kiln_model_tensor(m[3], "blk.0.w", &t) == KILN_OK, "hold ev3");
    size_t freed = kiln_model_evict(sim(), 8 * MiB);
    CHECK(kiln_model_bytes(m[3], sim()) == 0, "evicted anyway");
    CHECK(freed > 0 && allocated(sim()) == kiln_tensor_nbytes(t) + 0, "all but the held tensor freed (%llu allocated)",
          (unsigned long long)allocated(sim()));
    kiln_tensor_free(t);
    CHECK(allocated(sim()) == 0, "held tensor freed");
    for (int i = 0; i < 4; i++) kiln_model_close(m[i]);
    reset_sim();
}

/* Randomized loads, unloads, offloads, pins, user allocations and frees on sim
 * under a small budget: the budget is never exceeded and everything returns. */
static void t_stress(void)
{
    reset_sim();
    enum { NM = 5, NT = 8 };
    kiln_model *m[NM];
    char name[32];
    for (int i = 0; i < NM; i++) {
        snprintf(name, sizeof name, "st%d.safetensors", i);
        /* sizes 96 KiB .. 480 KiB per tensor */
        m[i] = open1(make_model(name, 6, (int64_t)(24 + 24 * i) * 1024, i), NULL);
        if (!m[i]) return;
    }
    const uint64_t budget = 6 * MiB;
    kiln_allocator_set_budget(sim()->alloc, budget);
    kiln_allocator_reset_peak(sim()->alloc);
    uint64_t cpu0 = allocated(cpu());
    kiln_tensor *held[NT] = {0};
    unsigned seed = 12345;
    int loads = 0, ooms = 0, evictions0 = (int)kiln_events_last_seq();
    uint64_t since = kiln_events_last_seq();
    const char *names[3] = {"blk.0.w", "blk.3.w", "ids"};
    for (int it = 0; it < 800; it++) {
        seed = seed * 1103515245u + 12345u;
        unsigned r = (seed >> 8) % 100, k = (seed >> 16) % NM, s = (seed >> 20) % NT;
        const char *nm = names[(seed >> 4) % 3];
        kiln_status st = KILN_OK;
        /* the second half streams: the copy thread allocates (and evicts) too */
        if (it == 400) kiln_memory_mode_set(KILN_MEM_LOW);
        if (r < 30) {
            st = kiln_model_load(m[k], sim(), (seed >> 24) & 1 ? KILN_F16 : -1);
            loads++;
        } else if (r < 38) {
            kiln_model_unload(m[k]);
        } else if (r < 44) {
            st = kiln_model_offload(m[k]);
        } else if (r < 48) {
            kiln_model_pin(m[k]);
        } else if (r < 55) {
            kiln_model_unpin(m[k]);
        } else if (r < 70) {
            kiln_tensor_free(held[s]);
            held[s] = NULL;
            int64_t shape[1] = {(int64_t)(((seed >> 12) % 512) + 1) * 512};
            st = kiln_tensor_new(sim(), KILN_F32, 1, shape, &held[s]);
        } else if (r < 78) {
            kiln_tensor_free(held[s]);
            held[s] = NULL;
        } else if (r < 82) {
            kiln_tensor_free(held[s]);
            held[s] = NULL;
            st = kiln_model_tensor(m[k], "blk.1.w", &held[s]);
        } else if (r < 88) {
            st = kiln_model_prefetch(m[k], &nm, 1);
        } else if (r < 94) {
            st = kiln_model_fetch(m[k], &nm, 1);
        } else {
            st = kiln_model_release(m[k], &nm, 1);
        }
        if (st == KILN_ERR_OOM) ooms++;
        else CHECK(st == KILN_OK || st == KILN_ERR_STATE, "iteration %d: %s", it, kiln_last_error());
        kiln_mem_stats ms = kiln_allocator_stats(sim()->alloc);
        if (ms.reserved > budget || ms.allocated > budget) {
            CHECK(0, "iteration %d: over budget (%llu reserved)", it, (unsigned long long)ms.reserved);
            break;
        }
    }
    (void)evictions0;
    kiln_memory_mode_set(KILN_MEM_NORMAL);
    int evictions = count_events(since, KILN_EV_EVICT, NULL);
    kiln_mem_stats ms = kiln_allocator_stats(sim()->alloc);
    CHECK(ms.peak_reserved <= budget && ms.peak_allocated <= budget, "peak %llu reserved, %llu allocated > budget",
          (unsigned long long)ms.peak_reserved, (unsigned long long)ms.peak_allocated);
    CHECK(evictions > 10, "only %d evictions", evictions);
    printf("# stress: %d loads, %d evictions, %d OOMs, peak %.2f of %.2f MiB reserved\n", loads, evictions, ooms,
           (double)ms.peak_reserved / MiB, (double)budget / MiB);
    for (int i = 0; i < NT; i++) kiln_tensor_free(held[i]);
    for (int i = 0; i < NM; i++) kiln_model_close(m[i]);
    CHECK(allocated(sim()) == 0, "sim allocated %llu at the end", (unsigned long long)allocated(sim()));
    CHECK(allocated(cpu()) == cpu0, "cpu allocated %llu (was %llu)", (unsigned long long)allocated(cpu()),
          (unsigned long long)cpu0);
    reset_sim();
}

static void t_cycles(void)
{
    reset_sim();
    kiln_model *m = open1(make_model("cyc.safetensors", 4, 16 * 1024, 3), "cyc");
    if (!m) return;
    kiln_device *devs[2] = {sim(), cpu()};
    uint64_t sim0 = allocated(sim()), cpu0 = allocated(cpu());
    uint64_t res0 = kiln_allocator_stats(sim()->alloc).reserved;
    int bad = 0;
    for (int i = 0; i < 200 && !bad; i++) {
        kiln_device *d = devs[i & 1];
        bad |= kiln_model_load(m, d, i % 3 == 0 ? KILN_F16 : -1) != KILN_OK;
        kiln_tensor *t, *y;
        bad |= kiln_model_tensor(m, "blk.2.w", &t) != KILN_OK;
        if (t) {
            bad |= kiln_tensor_to(t, d, KILN_F32, &y) != KILN_OK; /* "use" */
            kiln_tensor_free(y);
            kiln_tensor_free(t);
        }
        if (i % 5 == 0) bad |= kiln_model_offload(m) != KILN_OK;
        kiln_model_unload(m);
        bad |= allocated(sim()) != sim0 || allocated(cpu()) != cpu0;
    }
    CHECK(!bad, "a cycle failed or leaked: %s (sim %llu, cpu %llu)", kiln_last_error(),
          (unsigned long long)allocated(sim()), (unsigned long long)allocated(cpu()));
    CHECK(kiln_allocator_stats(sim()->alloc).reserved <= res0 + 2 * MiB, "reserved stays bounded");
    kiln_model_close(m);
}

static void t_low_mode(void)
{
    reset_sim();
    const int64_t elems = 512 * 1024; /* 2 MiB f32 per tensor */
    kiln_model *m = open1(make_model("low.safetensors", 4, elems, 4), "low");
    if (!m) return;
    uint64_t cpu0 = allocated(cpu());
    kiln_memory_mode_set(KILN_MEM_LOW);
    CHECK(kiln_model_load(m, sim(), KILN_F16) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_bytes(m, sim()) == 0, "low mode: nothing on the device after load");
    CHECK(kiln_model_bytes(m, cpu()) == 4 * (uint64_t)elems * 2,
          "host copies in f16 (%llu)", (unsigned long long)kiln_model_bytes(m, cpu()));
    const char *l0[] = {"blk.0.w"}, *l1[] = {"blk.1.w", "ids"}, *l23[] = {"blk.2.w", "blk.3.w"};
    CHECK(kiln_model_fetch(m, l0, 1) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_prefetch(m, l1, 2) == KILN_OK, "%s", kiln_last_error());
    /* the copy runs on its own: poll without calling fetch */
    kiln_residency r = KILN_RES_HOST;
    double t0 = kiln_events_now();
    volatile double sink = 0;
    while (kiln_events_now() - t0 < 5) {
        for (int i = 0; i < 100000; i++) sink += i * 0.5; /* "compute" meanwhile */
        kiln_model_where(m, "blk.1.w", &r);
        if (r == KILN_RES_DEVICE) break;
    }
    CHECK(r == KILN_RES_DEVICE && sink >= 0, "prefetch finished without fetch");
    kiln_model_info in;
    kiln_model_get_info(m, &in);
    CHECK(in.prefetch_thread != 0 && in.prefetch_thread != kiln_thread_id(), "prefetch ran on thread %d (we are %d)",
          in.prefetch_thread, kiln_thread_id());
    CHECK(kiln_model_fetch(m, l1, 2) == KILN_OK, "%s", kiln_last_error());
    kiln_tensor *t;
    CHECK(kiln_model_tensor(m, "blk.1.w", &t) == KILN_OK && t->storage->device == sim() && t->dtype == KILN_F16, "fetched f16 on sim");
    int bad = 0;
    for (int64_t i = 0; t && i < elems; i += 1013)
        bad += ((uint16_t *)kiln_tensor_data(t))[i] != kiln_f32_to_f16(value_of(1, i, 4));
    CHECK(!bad, "%d prefetched values differ from the source", bad);
    kiln_tensor_free(t);
    /* a fetch that meets a prefetch in flight waits for it */
    CHECK(kiln_model_prefetch(m, l23, 2) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_fetch(m, l23, 2) == KILN_OK, "%s", kiln_last_error());
    kiln_model_get_info(m, &in);
    CHECK(in.count[KILN_RES_DEVICE] == 5, "all on device after fetches (%d)", in.count[KILN_RES_DEVICE]);
    CHECK(in.n_prefetch_copies + in.n_fetch_copies == 5, "5 copies: %llu prefetched, %llu fetched",
          (unsigned long long)in.n_prefetch_copies, (unsigned long long)in.n_fetch_copies);
    printf("# low mode: %llu prefetched, %llu fetched, %llu fetches waited\n", (unsigned long long)in.n_prefetch_copies,
           (unsigned long long)in.n_fetch_copies, (unsigned long long)in.n_prefetch_waits);
    const char *all[] = {"blk.0.w", "blk.1.w", "blk.2.w", "blk.3.w", "ids"};
    CHECK(kiln_model_release(m, all, 5) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_bytes(m, sim()) == 0 && allocated(sim()) == 0, "device bytes back to 0 (%llu)",
          (unsigned long long)allocated(sim()));
    /* a queued prefetch released before it ran, and a close with prefetches queued */
    CHECK(kiln_model_prefetch(m, all, 5) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_release(m, l23, 2) == KILN_OK, "%s", kiln_last_error());
    const char *missing[] = {"blk.9.w"};
    CHECK(kiln_model_fetch(m, missing, 1) == KILN_ERR_ARG && strstr(kiln_last_error(), "blk.9.w"), "missing name in fetch");
    CHECK(kiln_model_prefetch(m, all, 5) == KILN_OK, "%s", kiln_last_error());
    kiln_model_close(m);
    kiln_memory_mode_set(KILN_MEM_NORMAL);
    CHECK(allocated(sim()) == 0 && allocated(cpu()) == cpu0, "close with prefetches queued frees all");

    /* streaming under a tight budget: prefetches evict and fetches retry */
    m = open1(path_in("low.safetensors"), "low2");
    kiln_model *other = open1(make_model("other.safetensors", 2, elems, 5), "other");
    if (!m || !other) return;
    kiln_allocator_set_budget(sim()->alloc, 6 * MiB);
    CHECK(kiln_model_load(other, sim(), -1) == KILN_OK, "%s", kiln_last_error()); /* 4 MiB resident */
    kiln_memory_mode_set(KILN_MEM_LOW);
    CHECK(kiln_model_load(m, sim(), KILN_F16) == KILN_OK, "%s", kiln_last_error());
    for (int layer = 0; layer < 4; layer++) {
        const char *cur[] = {all[layer]}, *next[] = {all[(layer + 1) % 4]};
        CHECK(kiln_model_fetch(m, cur, 1) == KILN_OK, "layer %d: %s", layer, kiln_last_error());
        CHECK(kiln_model_prefetch(m, next, 1) == KILN_OK, "%s", kiln_last_error());
        CHECK(kiln_model_fetch(m, next, 1) == KILN_OK, "%s", kiln_last_error()); /* both layers held */
        CHECK(kiln_model_release(m, cur, 1) == KILN_OK, "%s", kiln_last_error());
    }
    CHECK(kiln_model_bytes(other, sim()) == 0, "the resident model was evicted for streaming");
    CHECK(kiln_allocator_stats(sim()->alloc).peak_reserved <= 6 * MiB, "within budget");
    kiln_model_close(m);
    kiln_model_close(other);
    CHECK(allocated(sim()) == 0, "all freed");
    reset_sim();
}

static const kiln_json *find_event(const kiln_json *arr, const char *ph, const char *name_prefix)
{
    for (const kiln_json *e = arr->child; e; e = e->next) {
        const kiln_json *p = kiln_json_get(e, "ph"), *n = kiln_json_get(e, "name");
        if (p && n && strcmp(p->string, ph) == 0 && strncmp(n->string, name_prefix, strlen(name_prefix)) == 0) return e;
    }
    return NULL;
}

static void t_trace(void)
{
    reset_sim();
    kiln_model *a = open1(make_model("tr1.safetensors", 2, 64 * 1024, 1), "tra");
    kiln_model *b = open1(make_model("tr2.safetensors", 2, 64 * 1024, 2), "trb");
    if (!a || !b) return;
    const char *path = path_in("trace.json");
    CHECK(kiln_trace_start(path) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_trace_start(path) == KILN_ERR_STATE, "a second start is refused");
    double s0 = kiln_events_now();
    kiln_allocator_set_budget(sim()->alloc, 2 * MiB);
    CHECK(kiln_model_load(a, sim(), -1) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_load(b, sim(), KILN_F16) == KILN_OK, "%s", kiln_last_error());
    kiln_tensor *big;
    int64_t shape[1] = {400 * 1024};
    CHECK(kiln_tensor_new(sim(), KILN_F32, 1, shape, &big) == KILN_OK, "%s", kiln_last_error()); /* evicts tra */
    int64_t huge[1] = {1 << 20};
    kiln_tensor *none;
    CHECK(kiln_tensor_new(sim(), KILN_F32, 1, huge, &none) == KILN_ERR_OOM, "oom");
    CHECK(strstr(kiln_last_error(), "resident on sim: tensor") != NULL, "raw OOM lists residents: %s", kiln_last_error());
    kiln_tensor_free(big);
    CHECK(kiln_model_offload(b) == KILN_OK, "%s", kiln_last_error());
    kiln_model_unload(b);
    kiln_trace_span("decode \"tile\"", "span", s0, kiln_events_now(), "\"steps\":2");
    CHECK(kiln_trace_stop() == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_trace_stop() == KILN_ERR_STATE, "stop without a trace");
    CHECK(access(path, F_OK) == 0, "trace file written");
    char tmpname[300];
    snprintf(tmpname, sizeof tmpname, "%s/trace.json.tmp", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    size_t got = fread(text, 1, (size_t)n, f);
    fclose(f);
    kiln_json *root = NULL;
    kiln_status st = kiln_json_parse(text, got, &root);
    CHECK(st == KILN_OK, "trace is not valid JSON: %s", kiln_last_error());
    const kiln_json *arr = root ? kiln_json_get(root, "traceEvents") : NULL;
    CHECK(arr && arr->type == KILN_JSON_ARRAY && arr->count > 10, "traceEvents array");
    if (arr) {
        const kiln_json *c = find_event(arr, "C", "memory sim");
        CHECK(c && kiln_json_get(kiln_json_get(c, "args"), "allocated") && kiln_json_get(kiln_json_get(c, "args"), "reserved"),
              "memory counter events");
        CHECK(find_event(arr, "i", "load model:tra") && find_event(arr, "i", "load model:trb"), "load instants");
        CHECK(find_event(arr, "i", "evict model:tra"), "evict instant");
        CHECK(find_event(arr, "i", "oom"), "oom instant");
        CHECK(find_event(arr, "i", "offload model:trb") && find_event(arr, "i", "unload model:trb"), "offload/unload instants");
        const kiln_json *x = find_event(arr, "X", "decode \"tile\"");
        CHECK(x && kiln_json_get(x, "dur") && kiln_json_get(kiln_json_get(x, "args"), "steps"), "span event");
        /* counters go up to the budget at most and come back down */
        uint64_t top = 0, last = 1;
        for (const kiln_json *e = arr->child; e; e = e->next) {
            const kiln_json *p = kiln_json_get(e, "ph"), *nm = kiln_json_get(e, "name");
            if (!p || strcmp(p->string, "C") || strcmp(nm->string, "memory sim")) continue;
            const kiln_json *r = kiln_json_get(kiln_json_get(e, "args"), "reserved");
            const kiln_json *al = kiln_json_get(kiln_json_get(e, "args"), "allocated");
            if (r && (uint64_t)r->integer > top) top = (uint64_t)r->integer;
            if (al) last = (uint64_t)al->integer;
        }
        CHECK(top > 0 && top <= 2 * MiB && last == 0, "sim counters: top %llu, last %llu", (unsigned long long)top,
              (unsigned long long)last);
    }
    kiln_json_free(root);
    free(text);
    kiln_model_close(a);
    kiln_model_close(b);
    /* an unwritable path is an error at start, naming it */
    CHECK(kiln_trace_start("/nonexistent-dir/t.json") == KILN_ERR_IO && strstr(kiln_last_error(), "/nonexistent-dir/t.json"),
          "bad path: %s", kiln_last_error());
    reset_sim();
}

static void t_alloc_events(void)
{
    uint64_t since = kiln_events_last_seq();
    kiln_events_set_alloc_threshold(100 * KiB);
    kiln_tensor *small, *large;
    int64_t s1[1] = {1000}, s2[1] = {64 * 1024};
    CHECK(kiln_tensor_new(sim(), KILN_F32, 1, s1, &small) == KILN_OK, "small");
    CHECK(kiln_tensor_new(sim(), KILN_F32, 1, s2, &large) == KILN_OK, "large");
    kiln_tensor_free(small);
    kiln_tensor_free(large);
    kiln_events_set_alloc_threshold(0);
    CHECK(count_events(since, KILN_EV_ALLOC, NULL) == 1 && count_events(since, KILN_EV_FREE, NULL) == 1,
          "one alloc and one free event above the threshold");
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kiln_model_XXXXXX");
    if (!mkdtemp(dir)) { printf("FAIL setup: mkdtemp\n"); return 1; }
    RUN(t_open_lookup);
    RUN(t_load_convert);
    RUN(t_offload_unload);
    RUN(t_eviction);
    RUN(t_stress);
    RUN(t_cycles);
    RUN(t_low_mode);
    RUN(t_trace);
    RUN(t_alloc_events);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("# could not remove %s\n", dir);
    return test_summary();
}

/* test_alloc.c - the caching allocator: alignment, reuse, splitting and coalescing,
 * the budget (a randomized stress on a counting mock device), OOM reports, the
 * eviction and pressure hooks, fail_after, pass-through mode and threads. */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include "alloc.h"
#include "format_bytes.h"
#include "test.h"

#include <pthread.h>
#include <stdint.h>
#include <sys/mman.h>
#include <time.h>

#define KiB ((uint64_t)1 << 10)
#define MiB ((uint64_t)1 << 20)

/* ---- a mock device: host memory with a byte count and an optional hard cap ---- */

typedef struct {
    pthread_mutex_t mu;
    uint64_t held, peak, cap; /* cap: raw bytes held must never exceed it (0: none) */
    uint64_t n_allocs, n_frees;
    int violations;           /* held > cap, or raw_free with a wrong size */
    int misalign;             /* hand out pointers 16 bytes off alignment */
} mock_mem;

/* Each raw block carries its size in a header before the pointer (checked on free).
 * Big blocks come from mmap: the sanitizer's malloc would spend seconds poisoning
 * the shadow of hundreds of 64 MiB blocks. */
#define MOCK_MMAP_MIN ((size_t)4 << 20)

static size_t mock_header(size_t n) { return n >= MOCK_MMAP_MIN ? 4096 : 64; }

static void *mock_alloc(void *ctx, size_t n)
{
    mock_mem *m = ctx;
    size_t off = mock_header(n) + (m->misalign ? 16 : 0), total = (off + n + 63) / 64 * 64;
    char *p;
    if (n >= MOCK_MMAP_MIN) {
        p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
    } else {
        p = aligned_alloc(64, total);
        if (!p) return NULL;
    }
    memcpy(p, &n, sizeof n);
    pthread_mutex_lock(&m->mu);
    m->held += n;
    m->n_allocs++;
    if (m->held > m->peak) m->peak = m->held;
    if (m->cap && m->held > m->cap) m->violations++;
    pthread_mutex_unlock(&m->mu);
    return p + off;
}

static void mock_free(void *ctx, void *ptr, size_t n)
{
    mock_mem *m = ctx;
    size_t off = mock_header(n) + (m->misalign ? 16 : 0);
    char *p = (char *)ptr - off;
    size_t had;
    memcpy(&had, p, sizeof had);
    pthread_mutex_lock(&m->mu);
    if (had != n) m->violations++;
    m->held -= had;
    m->n_frees++;
    pthread_mutex_unlock(&m->mu);
    if (n >= MOCK_MMAP_MIN) munmap(p, (off + n + 63) / 64 * 64);
    else free(p);
}

static void mock_init(mock_mem *m, uint64_t cap)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->cap = cap;
}

static kiln_allocator *new_alloc(mock_mem *m, uint64_t budget, int caching)
{
    kiln_raw_memory raw = {mock_alloc, mock_free, m};
    return kiln_allocator_new("sim", raw, budget, caching);
}

/* Frees the allocator and checks nothing leaked, here or on the mock device. */
static void finish(kiln_allocator *a, mock_mem *m)
{
    kiln_mem_stats st = kiln_allocator_stats(a);
    CHECK(st.allocated == 0, "allocated %llu at the end", (unsigned long long)st.allocated);
    uint64_t leaked = kiln_allocator_free(a);
    CHECK(leaked == 0, "kiln_allocator_free reported %llu bytes", (unsigned long long)leaked);
    CHECK(m->held == 0, "mock device still holds %llu bytes", (unsigned long long)m->held);
    CHECK(m->violations == 0, "%d mock violations (cap or raw_free size)", m->violations);
    pthread_mutex_destroy(&m->mu);
}

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    return *s = x;
}

/* Log-uniform sizes from 1 byte to 2^max_log2 bytes. */
static size_t random_size(uint64_t *rng, int max_log2)
{
    int e = (int)(xorshift(rng) % (uint64_t)(max_log2 + 1));
    return 1 + (size_t)(xorshift(rng) % ((uint64_t)1 << e));
}

/* Stamps / checks a block's first and last bytes: catches overlapping blocks. */
static void stamp(void *p, size_t n, uint64_t tag)
{
    if (n >= 16) { memcpy(p, &tag, 8); memcpy((char *)p + n - 8, &tag, 8); }
    else memset(p, (int)(tag & 0xff), n);
}

static int stamp_ok(const void *p, size_t n, uint64_t tag)
{
    if (n >= 16) {
        uint64_t x, y;
        memcpy(&x, p, 8);
        memcpy(&y, (const char *)p + n - 8, 8);
        return x == tag && y == tag;
    }
    for (size_t i = 0; i < n; i++)
        if (((const unsigned char *)p)[i] != (tag & 0xff)) return 0;
    return 1;
}

/* ---- basics ---- */

static void t_alignment(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    static const size_t sizes[] = {0, 1, 3, 63, 64, 65, 511, 512, 513, 4095, 100000,
                                   1 << 20, (1 << 20) + 1, 3 << 20, 5000000};
    void *p[sizeof sizes / sizeof *sizes];
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        kiln_status st = kiln_allocator_alloc(a, sizes[i], &p[i]);
        CHECK(st == KILN_OK && p[i], "alloc %zu: %s", sizes[i], kiln_last_error());
        CHECK((uintptr_t)p[i] % KILN_ALLOC_ALIGN == 0, "alloc %zu: %p not aligned", sizes[i], p[i]);
        size_t bs = kiln_allocator_block_size(a, p[i]);
        CHECK(bs >= sizes[i] && bs % 512 == 0, "alloc %zu: block size %zu", sizes[i], bs);
        if (p[i]) memset(p[i], 0xab, sizes[i]);
    }
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) kiln_allocator_release(a, p[i]);
    CHECK(strcmp(kiln_allocator_device_name(a), "sim") == 0, "name %s", kiln_allocator_device_name(a));
    finish(a, &m);
}

static void t_reuse(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    void *p, *q;
    kiln_allocator_alloc(a, 1000, &p);
    kiln_mem_stats s1 = kiln_allocator_stats(a);
    CHECK(s1.reserved == 2 * MiB && s1.allocated == 1024 && s1.n_segments == 1,
          "small: reserved %llu allocated %llu", (unsigned long long)s1.reserved,
          (unsigned long long)s1.allocated);
    kiln_allocator_release(a, p);
    kiln_allocator_alloc(a, 1000, &q);
    kiln_mem_stats s2 = kiln_allocator_stats(a);
    CHECK(q == p, "cached small block not reused");
    CHECK(s2.reserved == s1.reserved && s2.n_segments == 1, "reserved grew to %llu",
          (unsigned long long)s2.reserved);
    kiln_allocator_release(a, q);

    kiln_allocator_alloc(a, 10 * MiB, &p);
    uint64_t r = kiln_allocator_stats(a).reserved;
    uint64_t raw_allocs = m.n_allocs;
    for (int i = 0; i < 10; i++) {
        kiln_allocator_release(a, p);
        kiln_allocator_alloc(a, 10 * MiB - 100, &p);
    }
    kiln_mem_stats s3 = kiln_allocator_stats(a);
    CHECK(s3.reserved == r && m.n_allocs == raw_allocs, "large: reserved %llu -> %llu, %llu raw allocs",
          (unsigned long long)r, (unsigned long long)s3.reserved,
          (unsigned long long)(m.n_allocs - raw_allocs));
    CHECK(s3.n_allocs == 13 && s3.n_frees == 12, "counts %llu/%llu",
          (unsigned long long)s3.n_allocs, (unsigned long long)s3.n_frees);
    kiln_allocator_release(a, p);
    finish(a, &m);
}

static void t_split_coalesce(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    void *x, *y, *z;
    kiln_allocator_alloc(a, 300 * KiB, &x);
    kiln_allocator_alloc(a, 300 * KiB, &y);
    kiln_allocator_alloc(a, 300 * KiB, &z);
    kiln_mem_stats st = kiln_allocator_stats(a);
    CHECK(st.n_segments == 1 && st.reserved == 2 * MiB, "3 small blocks took %llu segments",
          (unsigned long long)st.n_segments);
    CHECK((char *)y == (char *)x + 300 * KiB && (char *)z == (char *)y + 300 * KiB,
          "not neighbours: %p %p %p", x, y, z);
    CHECK(st.largest_free == 2 * MiB - 900 * KiB, "largest_free %llu", (unsigned long long)st.largest_free);
    kiln_allocator_release(a, y);
    st = kiln_allocator_stats(a);
    CHECK(st.largest_free == 2 * MiB - 900 * KiB, "after middle: largest_free %llu",
          (unsigned long long)st.largest_free);
    void *w; /* a smaller request goes into the 300 KiB hole, best fit */
    kiln_allocator_alloc(a, 200 * KiB, &w);
    CHECK(w == y, "best fit did not use the hole");
    kiln_allocator_release(a, w);
    kiln_allocator_release(a, x);
    kiln_allocator_release(a, z);
    st = kiln_allocator_stats(a);
    CHECK(st.largest_free == 2 * MiB, "coalesced: largest_free %llu, want the segment",
          (unsigned long long)st.largest_free);
    CHECK(st.allocated == 0 && st.reserved == 2 * MiB, "allocated %llu reserved %llu",
          (unsigned long long)st.allocated, (unsigned long long)st.reserved);

    /* Large: a cached 16 MiB block serves a 5 MiB request and keeps the rest. */
    kiln_allocator_alloc(a, 16 * MiB, &x);
    kiln_allocator_release(a, x);
    kiln_allocator_alloc(a, 5 * MiB, &y);
    kiln_allocator_alloc(a, 5 * MiB, &z);
    st = kiln_allocator_stats(a);
    CHECK(y == x && (char *)z == (char *)x + 5 * MiB, "large split: %p %p %p", x, y, z);
    CHECK(st.reserved == 18 * MiB && st.largest_free == 6 * MiB, "large: reserved %llu largest %llu",
          (unsigned long long)st.reserved, (unsigned long long)st.largest_free);
    /* A remainder of 1 MiB or less is not split off: the block is handed whole. */
    kiln_allocator_alloc(a, 5 * MiB + 512 * KiB, &w);
    CHECK(kiln_allocator_block_size(a, w) == 6 * MiB, "block %zu", kiln_allocator_block_size(a, w));
    kiln_allocator_release(a, y);
    kiln_allocator_release(a, w);
    kiln_allocator_release(a, z);
    st = kiln_allocator_stats(a);
    CHECK(st.largest_free == 16 * MiB, "large coalesced: %llu", (unsigned long long)st.largest_free);
    finish(a, &m);
}

static void t_empty_cache(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    void *p[4];
    kiln_allocator_alloc(a, 100, &p[0]);          /* small segment, stays busy */
    kiln_allocator_alloc(a, 4 * MiB, &p[1]);
    kiln_allocator_alloc(a, 6 * MiB, &p[2]);
    kiln_allocator_alloc(a, 8 * MiB, &p[3]);      /* stays busy */
    kiln_allocator_release(a, p[1]);
    kiln_allocator_release(a, p[2]);
    kiln_mem_stats st = kiln_allocator_stats(a);
    CHECK(st.reserved == 20 * MiB && st.n_segments == 4, "reserved %llu", (unsigned long long)st.reserved);
    kiln_allocator_empty_cache(a);
    st = kiln_allocator_stats(a);
    CHECK(st.reserved == 10 * MiB && st.n_segments == 2 && m.held == 10 * MiB,
          "after empty_cache: reserved %llu held %llu", (unsigned long long)st.reserved,
          (unsigned long long)m.held);
    CHECK(st.peak_reserved == 20 * MiB, "peak_reserved %llu", (unsigned long long)st.peak_reserved);
    kiln_allocator_reset_peak(a);
    st = kiln_allocator_stats(a);
    CHECK(st.peak_reserved == 10 * MiB && st.peak_allocated == st.allocated, "reset_peak");
    kiln_allocator_release(a, p[0]);
    kiln_allocator_release(a, p[3]);
    kiln_allocator_empty_cache(a);
    CHECK(m.held == 0 && kiln_allocator_stats(a).n_segments == 0, "held %llu", (unsigned long long)m.held);
    finish(a, &m);
}

/* A cache limit gives wholly free segments back once the cache would exceed it;
 * a fine grain sizes new large segments to the request. */
static void t_cache_limit_and_grain(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    kiln_allocator_set_cache_limit(a, 10 * MiB);
    kiln_allocator_set_grain(a, 4 * KiB);
    void *p[6];
    for (int i = 0; i < 6; i++) kiln_allocator_alloc(a, 4 * MiB + 4 * KiB * (uint64_t)i + 1, &p[i]);
    kiln_mem_stats st = kiln_allocator_stats(a);
    /* grain 4 KiB: each segment is the request rounded up to 4 KiB, not to 2 MiB */
    CHECK(st.reserved == 6 * 4 * MiB + 4 * KiB * (0 + 1 + 2 + 3 + 4 + 5) + 6 * 4 * KiB,
          "reserved %llu", (unsigned long long)st.reserved);
    for (int i = 0; i < 6; i++) {
        kiln_allocator_release(a, p[i]);
        st = kiln_allocator_stats(a);
        CHECK(st.reserved - st.allocated <= 10 * MiB, "cached %llu after %d frees",
              (unsigned long long)(st.reserved - st.allocated), i + 1);
    }
    CHECK(st.allocated == 0 && st.reserved <= 10 * MiB && st.reserved > 0, "reserved %llu at the end",
          (unsigned long long)st.reserved);
    /* cached blocks are still reused */
    uint64_t n_seg = st.n_segments;
    kiln_allocator_alloc(a, 4 * MiB, &p[0]);
    CHECK(kiln_allocator_stats(a).n_segments == n_seg, "reused a cached segment");
    kiln_allocator_release(a, p[0]);
    finish(a, &m);
}

/* ---- out of memory ---- */

/* Every size in a message goes through kiln_format_bytes: three significant digits. */
static void t_format_bytes(void)
{
    static const struct { double n; const char *want; } cases[] = {
        {0, "0 B"}, {512, "512 B"}, {1023, "1023 B"}, {1024, "1.00 KiB"}, {1536, "1.50 KiB"},
        {64.1 * 1024, "64.1 KiB"}, {512 * 1024, "512 KiB"}, {12 * 1048576.0, "12.0 MiB"},
        {1.5 * 1073741824.0, "1.50 GiB"}, {2 * 1099511627776.0, "2.00 TiB"},
        {4096 * 1099511627776.0, "4096 TiB"}, {-1536, "-1.50 KiB"},
    };
    char buf[32];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_format_bytes(buf, sizeof buf, cases[i].n);
        CHECK(strcmp(buf, cases[i].want) == 0, "%.17g -> '%s', want '%s'", cases[i].n, buf, cases[i].want);
    }
    char tiny[4];
    kiln_format_bytes(tiny, sizeof tiny, 1536);
    CHECK(strcmp(tiny, "1.5") == 0, "truncated '%s'", tiny);
}

static void t_oom_fields(void)
{
    mock_mem m;
    mock_init(&m, 16 * MiB);
    kiln_allocator *a = new_alloc(&m, 16 * MiB, 1);
    void *big, *small, *p = (void *)1;
    CHECK(kiln_allocator_alloc(a, 12 * MiB, &big) == KILN_OK, "12 MiB");
    CHECK(kiln_allocator_alloc(a, 512 * KiB, &small) == KILN_OK, "512 KiB");
    kiln_status st = kiln_allocator_alloc(a, 4 * MiB, &p);
    CHECK(st == KILN_ERR_OOM && p == NULL, "status %s, p %p", kiln_status_name(st), p);
    CHECK(kiln_last_status() == KILN_ERR_OOM, "last status");
    const kiln_oom_info *oi = kiln_last_oom();
    CHECK(strcmp(oi->device, "sim") == 0, "device %s", oi->device);
    CHECK(oi->requested == 4 * MiB && oi->budget == 16 * MiB, "requested %llu budget %llu",
          (unsigned long long)oi->requested, (unsigned long long)oi->budget);
    /* 16 - 14 reserved + 1.5 cached free in the small segment */
    CHECK(oi->free == 3 * MiB + 512 * KiB, "free %llu", (unsigned long long)oi->free);
    const char *want = "sim: out of memory: tried to allocate 4.00 MiB; budget 16.0 MiB, "
                       "12.5 MiB allocated, 1.50 MiB cached free";
    CHECK(strcmp(kiln_last_error(), want) == 0, "message '%s'", kiln_last_error());
    kiln_mem_stats s = kiln_allocator_stats(a);
    CHECK(s.n_ooms == 1 && s.reserved == 14 * MiB && s.allocated == 12 * MiB + 512 * KiB,
          "n_ooms %llu reserved %llu", (unsigned long long)s.n_ooms, (unsigned long long)s.reserved);
    /* Larger than the whole budget: fails without any hook being asked. */
    st = kiln_allocator_alloc(a, 17 * MiB, &p);
    CHECK(st == KILN_ERR_OOM && strstr(kiln_last_error(), "tried to allocate 17.0 MiB"), "%s",
          kiln_last_error());
    st = kiln_allocator_alloc(a, SIZE_MAX, &p);
    CHECK(st == KILN_ERR_OOM && kiln_allocator_stats(a).n_ooms == 3, "SIZE_MAX: %s", kiln_last_error());
    CHECK(kiln_allocator_alloc(a, 1, NULL) == KILN_ERR_ARG, "NULL out");
    kiln_allocator_release(a, big);
    kiln_allocator_release(a, small);
    finish(a, &m);
}

typedef struct {
    kiln_allocator *a;
    void *weights[8];
    int n_weights;
    int calls, pressure_calls;
    size_t last_need;
    int free_on_pressure;
} hooks;

/* Evicts "weights" from the last one, at least `need` bytes. */
static size_t evict_hook(void *ctx, kiln_allocator *a, size_t need)
{
    hooks *h = ctx;
    h->calls++;
    h->last_need = need;
    size_t freed = 0;
    while (freed < need && h->n_weights > 0) {
        void *w = h->weights[--h->n_weights];
        freed += kiln_allocator_block_size(a, w);
        kiln_allocator_release(a, w);
    }
    return freed;
}

static int pressure_hook(void *ctx)
{
    hooks *h = ctx;
    h->pressure_calls++;
    if (h->free_on_pressure && h->n_weights > 0) {
        kiln_allocator_release(h->a, h->weights[--h->n_weights]);
        return 1;
    }
    return 0;
}

static void t_evict_hook(void)
{
    mock_mem m;
    mock_init(&m, 16 * MiB);
    kiln_allocator *a = new_alloc(&m, 16 * MiB, 1);
    hooks h = {.a = a};
    kiln_allocator_set_evict_hook(a, evict_hook, &h);
    kiln_allocator_set_pressure_hook(a, pressure_hook, &h);
    void *act, *p;
    kiln_allocator_alloc(a, 8 * MiB, &h.weights[h.n_weights++]);
    kiln_allocator_alloc(a, 6 * MiB, &act);
    /* 14 reserved + 4 needed = 2 over the budget, nothing cached: evict 2 MiB. */
    kiln_status st = kiln_allocator_alloc(a, 4 * MiB, &p);
    CHECK(st == KILN_OK, "alloc after eviction: %s", kiln_last_error());
    CHECK(h.calls == 1 && h.last_need == 2 * MiB, "evict called %d times, need %zu", h.calls, h.last_need);
    CHECK(h.pressure_calls == 0, "pressure called");
    kiln_mem_stats s = kiln_allocator_stats(a);
    CHECK(s.reserved == 14 * MiB && s.n_ooms == 0, "reserved %llu (the evicted block is reused)",
          (unsigned long long)s.reserved);
    kiln_allocator_release(a, p);
    kiln_allocator_release(a, act);

    /* Nothing left to evict: evict once, empty the cache, pressure once, then OOM. */
    kiln_allocator_empty_cache(a);
    kiln_allocator_alloc(a, 10 * MiB, &act);
    kiln_allocator_alloc(a, 4 * MiB, &p);
    kiln_allocator_release(a, p);  /* 4 MiB cached */
    h.calls = 0;
    st = kiln_allocator_alloc(a, 8 * MiB, &p);
    CHECK(st == KILN_ERR_OOM, "expected OOM");
    CHECK(h.calls == 1 && h.last_need == 2 * MiB, "evict calls %d need %zu (shortfall 6 - cached 4)",
          h.calls, h.last_need);
    CHECK(h.pressure_calls == 1, "pressure calls %d", h.pressure_calls);
    s = kiln_allocator_stats(a);
    CHECK(s.reserved == 10 * MiB && s.n_ooms == 1, "cache emptied: reserved %llu",
          (unsigned long long)s.reserved);
    CHECK(kiln_last_oom()->free == 6 * MiB, "free %llu", (unsigned long long)kiln_last_oom()->free);

    /* The pressure hook frees something: the retry succeeds. */
    kiln_allocator_alloc(a, 4 * MiB, &h.weights[h.n_weights++]);
    kiln_allocator_set_evict_hook(a, NULL, NULL);
    h.free_on_pressure = 1;
    h.pressure_calls = 0;
    st = kiln_allocator_alloc(a, 6 * MiB, &p);
    CHECK(st == KILN_OK && h.pressure_calls == 1, "pressure retry: %s", kiln_last_error());
    kiln_allocator_release(a, p);
    kiln_allocator_release(a, act);
    finish(a, &m);
}

static void t_cache_before_evict(void)
{
    mock_mem m;
    mock_init(&m, 16 * MiB);
    kiln_allocator *a = new_alloc(&m, 16 * MiB, 1);
    hooks h = {.a = a};
    kiln_allocator_set_evict_hook(a, evict_hook, &h);
    void *act, *p;
    kiln_allocator_alloc(a, 6 * MiB, &h.weights[h.n_weights++]);
    kiln_allocator_alloc(a, 4 * MiB, &act);
    kiln_allocator_alloc(a, 4 * MiB, &p);
    kiln_allocator_release(a, p);
    /* 14 reserved + 6 = 4 over, and a free 4 MiB segment covers it: weights stay. */
    kiln_status st = kiln_allocator_alloc(a, 6 * MiB, &p);
    CHECK(st == KILN_OK && h.calls == 0 && h.n_weights == 1, "evict called %d times: %s", h.calls,
          kiln_last_error());
    CHECK(kiln_allocator_stats(a).reserved == 16 * MiB, "reserved");
    kiln_allocator_release(a, p);
    kiln_allocator_release(a, act);
    kiln_allocator_release(a, h.weights[0]);
    finish(a, &m);
}

static void t_fail_after(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    void *p[3], *q;
    kiln_allocator_fail_after(a, 2);
    CHECK(kiln_allocator_alloc(a, 4 * MiB, &p[0]) == KILN_OK, "1st");
    CHECK(kiln_allocator_alloc(a, 100, &p[1]) == KILN_OK, "2nd");
    CHECK(kiln_allocator_alloc(a, 200, &p[2]) == KILN_OK, "cached, needs no raw allocation");
    kiln_status st = kiln_allocator_alloc(a, 6 * MiB, &q);
    CHECK(st == KILN_ERR_OOM && q == NULL, "3rd raw allocation should fail");
    CHECK(strstr(kiln_last_error(), "budget unlimited") && strstr(kiln_last_error(), "no more memory"),
          "message '%s'", kiln_last_error());
    CHECK(kiln_last_oom()->budget == 0 && kiln_last_oom()->free == 2 * MiB - 1024,
          "free %llu", (unsigned long long)kiln_last_oom()->free);
    kiln_allocator_release(a, p[0]);
    /* The freed 4 MiB segment is cached: reused without a raw allocation. */
    CHECK(kiln_allocator_alloc(a, 3 * MiB, &q) == KILN_OK, "reuse under fail_after");
    kiln_allocator_release(a, q);
    kiln_allocator_fail_after(a, 0);
    CHECK(kiln_allocator_alloc(a, 5 * MiB, &q) == KILN_ERR_OOM, "fail_after(0)");
    CHECK(kiln_allocator_stats(a).n_ooms == 2 && kiln_allocator_stats(a).reserved == 2 * MiB,
          "the cached segment was released trying");
    kiln_allocator_fail_after(a, -1);
    CHECK(kiln_allocator_alloc(a, 5 * MiB, &q) == KILN_OK, "fail_after(-1)");
    kiln_allocator_release(a, q);
    kiln_allocator_release(a, p[1]);
    kiln_allocator_release(a, p[2]);
    finish(a, &m);
}

static void t_set_budget(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    void *x, *y, *z;
    kiln_allocator_alloc(a, 6 * MiB, &x);
    kiln_allocator_alloc(a, 6 * MiB, &y);
    kiln_allocator_alloc(a, 4 * MiB, &z);
    kiln_allocator_release(a, z);
    kiln_allocator_set_budget(a, 8 * MiB);
    kiln_mem_stats s = kiln_allocator_stats(a);
    CHECK(s.budget == 8 * MiB && s.reserved == 12 * MiB, "reserved %llu: the cache was not emptied",
          (unsigned long long)s.reserved);
    CHECK(kiln_allocator_alloc(a, 2 * MiB, &z) == KILN_ERR_OOM, "over budget must fail");
    CHECK(kiln_last_oom()->free == 0, "free %llu", (unsigned long long)kiln_last_oom()->free);
    kiln_allocator_release(a, y); /* goes straight back to the device */
    s = kiln_allocator_stats(a);
    CHECK(s.reserved == 6 * MiB && m.held == 6 * MiB, "reserved %llu", (unsigned long long)s.reserved);
    CHECK(kiln_allocator_alloc(a, 2 * MiB, &z) == KILN_OK, "under budget again");
    kiln_allocator_release(a, z);
    kiln_allocator_release(a, x);
    kiln_allocator_set_budget(a, 0);
    CHECK(kiln_allocator_alloc(a, 64 * MiB, &z) == KILN_OK, "unlimited");
    kiln_allocator_release(a, z);
    finish(a, &m);
}

/* A budget lowered live (a host's thread while a run goes on): the block in flight may
 * still grow to the old budget until the run's boundary ends the grace; compliance is
 * counted from the first moment within the new budget with no grace left. */
static void t_set_budget_live(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 32 * MiB, 1);
    void *x, *y, *z;
    kiln_allocator_alloc(a, 6 * MiB, &x);
    kiln_allocator_alloc(a, 6 * MiB, &y);
    int graced = kiln_allocator_graced();
    kiln_allocator_set_budget_live(a, 8 * MiB);
    kiln_budget_watch w = kiln_allocator_budget_watch(a);
    CHECK(w.grace && w.over && w.lowered_at > 0 && w.compliant_at == 0, "grace %d over %d", w.grace, w.over);
    CHECK(kiln_allocator_graced() == graced + 1, "graced %d", kiln_allocator_graced());
    CHECK(w.peak_before == 12 * MiB, "peak before %llu", (unsigned long long)w.peak_before);
    CHECK(kiln_allocator_alloc(a, 4 * MiB, &z) == KILN_OK, "in the grace the old budget holds");
    void *big;
    CHECK(kiln_allocator_alloc(a, 32 * MiB, &big) == KILN_ERR_OOM, "but no more than it");
    kiln_allocator_release(a, z);
    kiln_allocator_release(a, y);
    w = kiln_allocator_budget_watch(a);
    CHECK(w.grace && w.compliant_at == 0, "within the budget in the grace is not compliance yet");
    kiln_allocator_end_grace(a);
    w = kiln_allocator_budget_watch(a);
    CHECK(!w.grace && !w.over && w.compliant_at >= w.lowered_at && w.peak_since == 6 * MiB,
          "compliant at the grace's end: grace %d, peak since %llu", w.grace, (unsigned long long)w.peak_since);
    CHECK(kiln_allocator_graced() == graced, "graced %d", kiln_allocator_graced());
    CHECK(kiln_allocator_alloc(a, 4 * MiB, &z) == KILN_ERR_OOM, "from there the new budget holds");
    CHECK(kiln_allocator_alloc(a, 2 * MiB, &z) == KILN_OK, "within it");
    w = kiln_allocator_budget_watch(a);
    CHECK(w.peak_since == 8 * MiB, "peak since %llu", (unsigned long long)w.peak_since);
    kiln_allocator_release(a, z);
    /* raised during a grace: the grace ends, the new budget holds */
    kiln_allocator_alloc(a, 2 * MiB, &y);
    kiln_allocator_set_budget_live(a, 4 * MiB);
    CHECK(kiln_allocator_budget_watch(a).grace, "lowered live again");
    kiln_allocator_set_budget_live(a, 0);
    CHECK(!kiln_allocator_budget_watch(a).grace && kiln_allocator_graced() == graced, "raised: no grace");
    kiln_allocator_release(a, y);
    kiln_allocator_release(a, x);
    /* a plain set_budget has no grace: enforced at once */
    kiln_allocator_set_budget(a, 2 * MiB);
    CHECK(!kiln_allocator_budget_watch(a).grace, "set_budget: no grace");
    finish(a, &m);
}

static void t_bad_release(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    void *p, *q;
    kiln_allocator_alloc(a, 1000, &p);
    kiln_allocator_alloc(a, 1000, &q);
    kiln_allocator_release(a, NULL);
    kiln_allocator_release(a, (char *)p + 64);   /* interior */
    kiln_allocator_release(a, &m);               /* foreign */
    kiln_allocator_release(NULL, p);
    kiln_allocator_release(a, p);
    kiln_allocator_release(a, p);                /* double */
    kiln_mem_stats s = kiln_allocator_stats(a);
    CHECK(s.allocated == 1024 && s.n_frees == 1, "allocated %llu frees %llu",
          (unsigned long long)s.allocated, (unsigned long long)s.n_frees);
    CHECK(kiln_allocator_block_size(a, p) == 0 && kiln_allocator_block_size(a, q) == 1024, "block_size");
    void *r;
    kiln_allocator_alloc(a, 1000, &r);
    CHECK(r == p && r != q, "pools intact");
    kiln_allocator_release(a, r);
    kiln_allocator_release(a, q);
    finish(a, &m);
}

static void t_passthrough(void)
{
    mock_mem m;
    mock_init(&m, 4 * MiB);
    kiln_allocator *a = new_alloc(&m, 4 * MiB, 0);
    void *p, *q;
    CHECK(kiln_allocator_alloc(a, 100, &p) == KILN_OK, "alloc");
    CHECK((uintptr_t)p % KILN_ALLOC_ALIGN == 0, "aligned");
    kiln_mem_stats s = kiln_allocator_stats(a);
    CHECK(s.reserved == 128 && s.allocated == 128 && m.held == 128, "reserved %llu held %llu",
          (unsigned long long)s.reserved, (unsigned long long)m.held);
    kiln_allocator_release(a, p);
    s = kiln_allocator_stats(a);
    CHECK(s.reserved == 0 && m.held == 0 && s.n_frees == 1, "not returned at once");
    CHECK(kiln_allocator_alloc(a, 3 * MiB, &p) == KILN_OK, "3 MiB");
    CHECK(kiln_allocator_alloc(a, 2 * MiB, &q) == KILN_ERR_OOM, "budget");
    CHECK(kiln_allocator_stats(a).n_ooms == 1, "n_ooms");
    CHECK(kiln_allocator_alloc(a, 1 * MiB, &q) == KILN_OK, "exactly to the budget");
    kiln_allocator_release(a, p);
    kiln_allocator_release(a, q);
    s = kiln_allocator_stats(a);
    CHECK(s.peak_reserved == 4 * MiB && s.n_segments == 0 && m.held == 0, "peak %llu",
          (unsigned long long)s.peak_reserved);
    finish(a, &m);
}

static void t_leak_report(void)
{
    mock_mem m;
    mock_init(&m, 0);
    kiln_allocator *a = new_alloc(&m, 0, 1);
    void *p, *q;
    kiln_allocator_alloc(a, 1000, &p);
    kiln_allocator_alloc(a, 3 * MiB, &q);
    uint64_t leaked = kiln_allocator_free(a);
    CHECK(leaked == 1024 + 4 * MiB, /* 3 MiB takes a whole 4 MiB segment */ "leaked %llu", (unsigned long long)leaked);
    CHECK(m.held == 0, "held %llu", (unsigned long long)m.held);
    pthread_mutex_destroy(&m.mu);
}

static void t_misaligned_raw(void)
{
    mock_mem m;
    mock_init(&m, 0);
    m.misalign = 1;
    kiln_allocator *a = new_alloc(&m, 8 * MiB, 1);
    void *p;
    CHECK(kiln_allocator_alloc(a, 100, &p) == KILN_OK, "alloc");
    CHECK((uintptr_t)p % KILN_ALLOC_ALIGN == 0, "%p not aligned", p);
    kiln_mem_stats s = kiln_allocator_stats(a);
    CHECK(s.reserved == 2 * MiB + KILN_ALLOC_ALIGN && m.held == s.reserved, "reserved %llu held %llu",
          (unsigned long long)s.reserved, (unsigned long long)m.held);
    memset(p, 1, 2 * MiB); /* the whole segment is usable */
    kiln_allocator_release(a, p);
    finish(a, &m);
}

/* ---- randomized stress: the budget holds at every step ---- */

#define STRESS_SLOTS 128

typedef struct {
    kiln_allocator *a;
    void *p[STRESS_SLOTS];
    size_t n[STRESS_SLOTS];
    uint64_t tag[STRESS_SLOTS];
    int bad, evictions;
    uint64_t rng;
} stress;

static void stress_free(stress *s, int i)
{
    if (!stamp_ok(s->p[i], s->n[i], s->tag[i])) s->bad++;
    kiln_allocator_release(s->a, s->p[i]);
    s->p[i] = NULL;
}

static size_t stress_evict(void *ctx, kiln_allocator *a, size_t need)
{
    stress *s = ctx;
    size_t freed = 0;
    int start = (int)(xorshift(&s->rng) % STRESS_SLOTS);
    for (int k = 0; k < STRESS_SLOTS && freed < need; k++) {
        int i = (start + k) % STRESS_SLOTS;
        if (!s->p[i]) continue;
        freed += kiln_allocator_block_size(a, s->p[i]);
        stress_free(s, i);
        s->evictions++;
    }
    return freed;
}

static void t_stress_budget(void)
{
    const uint64_t budget = 256 * MiB;
    mock_mem m;
    mock_init(&m, budget);
    kiln_allocator *a = new_alloc(&m, budget, 1);
    stress s;
    memset(&s, 0, sizeof s);
    s.a = a;
    s.rng = 0x2545F4914F6CDD1Dull;
    int n_ok = 0, n_oom = 0, over = 0, mismatch = 0;
    clock_t t0 = clock();
    for (int it = 0; it < 100000; it++) {
        if (it == 50000) kiln_allocator_set_evict_hook(a, stress_evict, &s);
        int i = (int)(xorshift(&s.rng) % STRESS_SLOTS);
        if (s.p[i]) {
            stress_free(&s, i);
        } else {
            size_t n = xorshift(&s.rng) % 8 ? random_size(&s.rng, 26) /* up to 64 MiB */
                                              : 1 + xorshift(&s.rng) % (64 * MiB);
            kiln_status st = kiln_allocator_alloc(a, n, &s.p[i]);
            if (st == KILN_OK) {
                n_ok++;
                s.n[i] = n;
                s.tag[i] = xorshift(&s.rng);
                stamp(s.p[i], n, s.tag[i]);
            } else {
                n_oom++;
                if (st != KILN_ERR_OOM || s.p[i]) mismatch++;
            }
        }
        if (it % 7 == 0 && xorshift(&s.rng) % 100 == 0) kiln_allocator_empty_cache(a);
        kiln_mem_stats st = kiln_allocator_stats(a);
        if (st.reserved > budget || st.allocated > st.reserved) over++;
        if (st.reserved != m.held) mismatch++;
    }
    for (int i = 0; i < STRESS_SLOTS; i++)
        if (s.p[i]) stress_free(&s, i);
    kiln_mem_stats st = kiln_allocator_stats(a);
    double secs = (double)(clock() - t0) / CLOCKS_PER_SEC;
    printf("# stress: %d allocs, %d ooms, %d evictions, %.2f s, peak reserved %.1f MiB, %llu raw allocs\n",
           n_ok, n_oom, s.evictions, secs, (double)st.peak_reserved / MiB, (unsigned long long)m.n_allocs);
    CHECK(over == 0, "%d steps over the budget", over);
    CHECK(mismatch == 0, "%d steps where reserved != mock bytes held or a bad status", mismatch);
    CHECK(s.bad == 0, "%d blocks overwritten (overlap)", s.bad);
    CHECK(st.peak_reserved <= budget && m.peak <= budget, "peak reserved %llu, mock peak %llu",
          (unsigned long long)st.peak_reserved, (unsigned long long)m.peak);
    CHECK(st.n_ooms == (uint64_t)n_oom && n_oom > 0 && s.evictions > 0, "n_ooms %llu vs %d",
          (unsigned long long)st.n_ooms, n_oom);
    finish(a, &m);
}

/* ---- threads ---- */

typedef struct {
    kiln_allocator *a;
    uint64_t seed;
    int bad, ok;
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    void *p[16] = {0};
    size_t n[16];
    uint64_t tag[16];
    for (int it = 0; it < 4000; it++) {
        int i = (int)(xorshift(&w->seed) % 16);
        if (p[i]) {
            if (!stamp_ok(p[i], n[i], tag[i])) w->bad++;
            kiln_allocator_release(w->a, p[i]);
            p[i] = NULL;
        } else {
            n[i] = random_size(&w->seed, 22);
            if (kiln_allocator_alloc(w->a, n[i], &p[i]) == KILN_OK) {
                tag[i] = xorshift(&w->seed);
                stamp(p[i], n[i], tag[i]);
                w->ok++;
            }
        }
    }
    for (int i = 0; i < 16; i++) {
        if (!p[i]) continue;
        if (!stamp_ok(p[i], n[i], tag[i])) w->bad++;
        kiln_allocator_release(w->a, p[i]);
    }
    return NULL;
}

static void t_threads(void)
{
    mock_mem m;
    mock_init(&m, 64 * MiB);
    kiln_allocator *a = new_alloc(&m, 64 * MiB, 1);
    pthread_t th[4];
    worker w[4];
    for (int i = 0; i < 4; i++) {
        w[i] = (worker){.a = a, .seed = 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1)};
        pthread_create(&th[i], NULL, worker_main, &w[i]);
    }
    int bad = 0, ok = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        bad += w[i].bad;
        ok += w[i].ok;
    }
    kiln_mem_stats st = kiln_allocator_stats(a);
    CHECK(bad == 0, "%d blocks overwritten", bad);
    CHECK(st.n_allocs == (uint64_t)ok && st.n_frees == (uint64_t)ok, "allocs %llu frees %llu ok %d",
          (unsigned long long)st.n_allocs, (unsigned long long)st.n_frees, ok);
    CHECK(st.peak_reserved <= 64 * MiB, "peak %llu", (unsigned long long)st.peak_reserved);
    finish(a, &m);
}

int main(void)
{
    RUN(t_alignment);
    RUN(t_reuse);
    RUN(t_split_coalesce);
    RUN(t_empty_cache);
    RUN(t_cache_limit_and_grain);
    RUN(t_format_bytes);
    RUN(t_oom_fields);
    RUN(t_evict_hook);
    RUN(t_cache_before_evict);
    RUN(t_fail_after);
    RUN(t_set_budget);
    RUN(t_set_budget_live);
    RUN(t_bad_release);
    RUN(t_passthrough);
    RUN(t_leak_report);
    RUN(t_misaligned_raw);
    RUN(t_stress_budget);
    RUN(t_threads);
    return test_summary();
}

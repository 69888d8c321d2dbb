/* test_tile.c - the tile primitive: grids (coverage, alignment, overlap, even spread),
 * feather weights (partition of unity, no ramp at the borders, linear and cosine),
 * kiln_tile_map against untiled runs (identity, nearest x8, average-pool /8, f16
 * through ops) on cpu and sim, bad options and bad fn outputs, errors and OOM from
 * fn (nothing leaks), cancel, and a peak on sim that does not grow with the image. */
#include "tile.h"
#include "ops.h"
#include "test.h"

#define MiB ((uint64_t)1 << 20)

static kiln_device *sim(void) { return kiln_device_get("sim"); }

/* [n, c, h, w] f32 with smooth + pseudo-random content on dev */
static kiln_tensor *pattern(kiln_device *dev, int64_t n, int64_t c, int64_t h, int64_t w, unsigned seed)
{
    int64_t shape[4] = {n, c, h, w};
    kiln_tensor *t = NULL;
    if (kiln_tensor_new(kiln_device_cpu(), KILN_F32, 4, shape, &t)) return NULL;
    float *p = kiln_tensor_data(t);
    unsigned s = seed * 2654435761u + 1;
    for (int64_t i = 0; i < n * c * h * w; i++) {
        s = s * 1103515245u + 12345u;
        int64_t y = (i / w) % h, x = i % w;
        p[i] = (float)(sin(0.07 * (double)y + 0.3 * (double)(i / (h * w))) * cos(0.05 * (double)x) +
                       0.25 * ((double)(s >> 8) / 16777216.0 - 0.5));
    }
    if (dev == kiln_device_cpu()) return t;
    kiln_tensor *d = NULL;
    kiln_tensor_to(t, dev, KILN_F32, &d);
    kiln_tensor_free(t);
    return d;
}

/* max |a - b| over two same-shape tensors (copied to the cpu as f32) */
static double maxdiff(const kiln_tensor *a, const kiln_tensor *b)
{
    kiln_tensor *ca = NULL, *cb = NULL;
    if (!kiln_shape_equal(a, b)) return INFINITY;
    if (kiln_tensor_to(a, kiln_device_cpu(), KILN_F32, &ca) || kiln_tensor_to(b, kiln_device_cpu(), KILN_F32, &cb)) {
        kiln_tensor_free(ca);
        return INFINITY;
    }
    const float *pa = kiln_tensor_data(ca), *pb = kiln_tensor_data(cb);
    double m = 0;
    for (int64_t i = 0; i < kiln_tensor_numel(ca); i++) m = fmax(m, fabs((double)pa[i] - (double)pb[i]));
    kiln_tensor_free(ca);
    kiln_tensor_free(cb);
    return m;
}

/* ---- plans ---- */

static void check_plan(int64_t H, int64_t W, int64_t tile, int64_t overlap, int64_t num, int64_t den, kiln_blend b)
{
    kiln_tile_opts o;
    kiln_tile_opts_init(&o, tile, overlap);
    o.scale_num = num;
    o.scale_den = den;
    o.blend = b;
    kiln_tile_plan *p = NULL;
    kiln_status st = kiln_tile_plan_new(H, W, &o, &p);
    CHECK(st == KILN_OK, "plan %lldx%lld tile %lld: %s", (long long)H, (long long)W, (long long)tile, kiln_last_error());
    if (st) return;
    int64_t OH = H * num / den, OW = W * num / den;
    CHECK(p->axis[0].out_size == OH && p->axis[1].out_size == OW, "out size %lldx%lld",
          (long long)p->axis[0].out_size, (long long)p->axis[1].out_size);
    for (int a = 0; a < 2; a++) {
        const kiln_tile_axis *ax = &p->axis[a];
        CHECK(ax->span[0].in_start == 0, "first start");
        CHECK(ax->span[ax->n - 1].in_start + ax->span[ax->n - 1].in_len == ax->in_size, "last tile ends at the border");
        for (int i = 0; i < ax->n; i++) {
            const kiln_tile_span *s = &ax->span[i];
            CHECK(s->in_start % den == 0, "start %lld not a multiple of %lld", (long long)s->in_start, (long long)den);
            /* every tile of an axis has one length: the whole axis when it fits a tile,
             * else at most the tile, and a step shorter would break the overlap */
            CHECK(s->in_len == ax->span[0].in_len, "tile length %lld vs %lld", (long long)s->in_len,
                  (long long)ax->span[0].in_len);
            if (ax->in_size <= tile) CHECK(s->in_len == ax->in_size, "one tile: length %lld", (long long)s->in_len);
            else CHECK(s->in_len <= tile && s->in_len % den == 0, "tile length %lld (tile %lld)", (long long)s->in_len,
                       (long long)tile);
            if (i > 0) {
                int64_t ov = ax->span[i - 1].in_start + ax->span[i - 1].in_len - s->in_start;
                CHECK(ov >= overlap, "overlap %lld < %lld", (long long)ov, (long long)overlap);
                CHECK(s->in_start > ax->span[i - 1].in_start, "starts increase");
            }
        }
        /* minimal: one step (den) shorter, k tiles spread evenly would overlap less */
        if (ax->n > 1 && ax->span[0].in_len < tile) {
            int64_t N = ax->in_size / den, L = ax->span[0].in_len / den - 1, k = ax->n, worst = L;
            for (int64_t i = 1; i < k; i++) {
                int64_t a = (i - 1) * (N - L) / (k - 1), b = i * (N - L) / (k - 1);
                if (L - (b - a) < worst) worst = L - (b - a);
            }
            CHECK(worst * den < overlap || (overlap == 0 && worst < 0) || p->opts.multiple > den,
                  "tiles of %lld would do", (long long)(L * den));
        }
    }
    /* the weights of the tiles covering each output pixel sum to 1 */
    double *sum = calloc((size_t)(OH * OW), sizeof *sum);
    for (int i = 0; i < p->count; i++) {
        kiln_tile_rect r;
        kiln_tile_rects(p, i, NULL, &r);
        for (int64_t y = 0; y < r.h; y++)
            for (int64_t x = 0; x < r.w; x++) {
                float w = kiln_tile_weight(p, i, y, x);
                CHECK(w > 0 && w <= 1.0f + 1e-6f, "weight %g at tile %d (%lld,%lld)", w, i, (long long)y, (long long)x);
                sum[(r.y + y) * OW + r.x + x] += w;
            }
    }
    double worst = 0;
    for (int64_t i = 0; i < OH * OW; i++) worst = fmax(worst, fabs(sum[i] - 1));
    CHECK(worst < 1e-6, "weights sum to 1 +- %g", worst);
    free(sum);
    /* no ramp at the image borders: tile 0 has weight 1 at the top-left pixel */
    CHECK(kiln_tile_weight(p, 0, 0, 0) == 1.0f, "corner weight %g", kiln_tile_weight(p, 0, 0, 0));
    kiln_tile_plan_free(p);
}

static void t_plan_grids(void)
{
    check_plan(64, 64, 64, 16, 1, 1, KILN_BLEND_LINEAR);       /* one tile */
    check_plan(100, 37, 32, 8, 1, 1, KILN_BLEND_LINEAR);       /* uneven sizes */
    check_plan(96, 160, 32, 8, 8, 1, KILN_BLEND_COSINE);       /* x8 */
    check_plan(256, 192, 64, 16, 1, 8, KILN_BLEND_LINEAR);     /* /8 */
    check_plan(256, 200, 64, 16, 1, 8, KILN_BLEND_COSINE);
    check_plan(33, 200, 20, 19, 1, 1, KILN_BLEND_COSINE);      /* overlap nearly the tile */
    check_plan(7, 9, 64, 0, 4, 1, KILN_BLEND_LINEAR);          /* smaller than a tile */
    check_plan(130, 130, 64, 0, 1, 1, KILN_BLEND_LINEAR);      /* no overlap: tiles abut */
}

static void t_plan_spread(void)
{
    /* 100 px, tile 32, overlap 8: ceil(68/24)+1 = 4 tiles, shortened to 31 (4*31 - 3*8 =
     * 100), spread evenly: 0 23 46 69 */
    kiln_tile_opts o;
    kiln_tile_opts_init(&o, 32, 8);
    kiln_tile_plan *p = NULL;
    CHECK(kiln_tile_plan_new(100, 32, &o, &p) == KILN_OK, "%s", kiln_last_error());
    if (!p) return;
    CHECK(p->axis[0].n == 4 && p->axis[1].n == 1 && p->count == 4, "%d x %d", p->axis[0].n, p->axis[1].n);
    CHECK(p->axis[0].span[0].in_len == 31, "length %lld", (long long)p->axis[0].span[0].in_len);
    int64_t want[4] = {0, 23, 46, 69};
    for (int i = 0; i < 4 && i < p->axis[0].n; i++)
        CHECK(p->axis[0].span[i].in_start == want[i], "start %d = %lld", i, (long long)p->axis[0].span[i].in_start);
    kiln_tile_plan_free(p);
    /* multiple: tiles of a multiple of 8 (UNet latents), starts free at scale 1 */
    kiln_tile_opts_init(&o, 30, 4);
    o.multiple = 8;
    CHECK(kiln_tile_plan_new(50, 50, &o, &p) == KILN_OK, "%s", kiln_last_error());
    if (!p) return;
    CHECK(p->opts.tile == 24, "tile rounded to %lld", (long long)p->opts.tile);
    kiln_tile_plan_free(p);
    /* linear ramps over an overlap of 8 output pixels are complementary */
    kiln_tile_opts_init(&o, 16, 8);
    CHECK(kiln_tile_plan_new(24, 16, &o, &p) == KILN_OK, "%s", kiln_last_error());
    if (!p) return;
    CHECK(p->count == 2, "count %d", p->count);
    CHECK_NEAR(kiln_tile_weight(p, 1, 0, 0), 0.5 / 8, 1e-7);
    CHECK_NEAR(kiln_tile_weight(p, 0, 8, 3), 7.5 / 8, 1e-7);
    CHECK_NEAR(kiln_tile_weight(p, 0, 15, 0), 0.5 / 8, 1e-7);
    CHECK(kiln_tile_weight(p, 0, 7, 0) == 1.0f, "weight 1 before the overlap");
    kiln_tile_plan_free(p);
}

static void t_plan_errors(void)
{
    kiln_tile_opts o;
    kiln_tile_plan *p = NULL;
    kiln_tile_opts_init(&o, 32, 32);
    CHECK(kiln_tile_plan_new(64, 64, &o, &p) == KILN_ERR_ARG && strstr(kiln_last_error(), "overlap"), "%s", kiln_last_error());
    kiln_tile_opts_init(&o, 32, 8);
    o.scale_den = 8;
    CHECK(kiln_tile_plan_new(60, 64, &o, &p) == KILN_ERR_ARG && strstr(kiln_last_error(), "not a multiple of 8"), "%s",
          kiln_last_error());
    kiln_tile_opts_init(&o, 4, 0);
    o.scale_den = 8;
    CHECK(kiln_tile_plan_new(64, 64, &o, &p) == KILN_ERR_ARG && strstr(kiln_last_error(), "smaller than the required multiple"),
          "%s", kiln_last_error());
    kiln_tile_opts_init(&o, 0, 0);
    CHECK(kiln_tile_plan_new(64, 64, &o, &p) == KILN_ERR_ARG, "tile 0");
    kiln_tile_opts_init(&o, 8, 0);
    CHECK(kiln_tile_plan_new(0, 64, &o, &p) == KILN_ERR_ARG && strstr(kiln_last_error(), "empty"), "%s", kiln_last_error());
    o.scale_num = 0;
    CHECK(kiln_tile_plan_new(8, 8, &o, &p) == KILN_ERR_ARG && strstr(kiln_last_error(), "scale"), "%s", kiln_last_error());
    kiln_tile_opts_init(&o, 8, 0);
    o.blend = KILN_BLEND_COUNT;
    CHECK(kiln_tile_plan_new(8, 8, &o, &p) == KILN_ERR_ARG, "blend");
    CHECK(p == NULL, "no plan on error");
    CHECK(kiln_blend_from_name("cosine") == KILN_BLEND_COSINE && kiln_blend_from_name("x") == -1, "blend names");
}

/* ---- map ---- */

typedef struct {
    int kind;             /* 0 identity, 1 nearest x8, 2 average pool /8, 3 error at call 3, 4 bad shape,
                           * 5 alloc scratch of 16 x the tile, 6 return a different channel count at call 2 */
    int calls;
    kiln_tensor *pool_w;  /* [C, 1, 8, 8] of 1/64 */
} fn_ctx;

static kiln_status fn(void *ud, int index, const kiln_tensor *t, kiln_tensor **out)
{
    fn_ctx *c = ud;
    (void)index;
    c->calls++;
    switch (c->kind) {
    case 0: return kiln_tensor_to(t, NULL, t->dtype, out);
    case 1: return kiln_op_resample(KILN_RS_NEAREST, t, t->shape[2] * 8, t->shape[3] * 8, out);
    case 2: {
        kiln_conv_opts o = {{8, 8}, {0, 0}, {1, 1}, t->shape[1], 1, 0, 0, NULL};
        return kiln_op_conv2d(t, c->pool_w, NULL, &o, out);
    }
    case 3:
        if (c->calls == 3) return kiln_error(KILN_ERR_IO, "fn failed on purpose");
        return kiln_tensor_to(t, NULL, t->dtype, out);
    case 4: return kiln_op_resample(KILN_RS_NEAREST, t, t->shape[2] * 2, t->shape[3] * 2, out);
    case 5: {
        int64_t shape[4] = {t->shape[0], t->shape[1] * 16, t->shape[2], t->shape[3]};
        kiln_tensor *scratch = NULL;
        kiln_status st = kiln_tensor_zeros(t->storage->device, KILN_F32, 4, shape, &scratch);
        if (st) return st;
        kiln_tensor_free(scratch);
        return kiln_op_unary(KILN_UN_TANH, t, 0, 0, out);
    }
    case 6: {
        if (c->calls < 2) return kiln_tensor_to(t, NULL, t->dtype, out);
        kiln_tensor *v = NULL;
        kiln_status st = kiln_tensor_narrow(t, 1, 0, 1, &v);
        if (!st) st = kiln_tensor_contiguous(v, out);
        kiln_tensor_free(v);
        return st;
    }
    }
    return kiln_error(KILN_ERR_ARG, "bad kind");
}

static kiln_tensor *run_map(const kiln_tensor *x, fn_ctx *c, int64_t tile, int64_t overlap, int64_t num, int64_t den,
                            kiln_blend b, kiln_status *st_out)
{
    kiln_tile_opts o;
    kiln_tile_opts_init(&o, tile, overlap);
    o.scale_num = num;
    o.scale_den = den;
    o.blend = b;
    kiln_tensor *r = NULL;
    kiln_status st = kiln_tile_map(x, &o, fn, NULL, c, &r);
    if (st_out) *st_out = st;
    else CHECK(st == KILN_OK, "map: %s", kiln_last_error());
    return r;
}

static void map_vs_untiled(kiln_device *dev, int kind, int64_t num, int64_t den, double tol)
{
    int64_t H = 96, W = 136;
    kiln_tensor *x = pattern(dev, 2, 3, H, W, 7);
    fn_ctx c = {kind, 0, NULL};
    if (kind == 2) {
        int64_t ws[4] = {3, 1, 8, 8};
        kiln_tensor_new(dev, KILN_F32, 4, ws, &c.pool_w);
        kiln_tensor_fill(c.pool_w, 1.0 / 64);
    }
    kiln_tensor *full = NULL;
    CHECK(fn(&c, 0, x, &full) == KILN_OK, "untiled: %s", kiln_last_error());
    for (int b = 0; b < KILN_BLEND_COUNT; b++) {
        c.calls = 0;
        kiln_tensor *r = run_map(x, &c, 32 * (den > 1 ? 2 : 1), 8 * (den > 1 ? 2 : 1), num, den, (kiln_blend)b, NULL);
        if (!r) break;
        CHECK(c.calls > 4, "%d tiles", c.calls);
        CHECK(r->storage->device == dev, "result on %s", r->storage->device->name);
        double d = maxdiff(r, full);
        CHECK(d <= tol, "%s kind %d %s: max diff %g > %g", dev->name, kind, kiln_blend_name((kiln_blend)b), d, tol);
        kiln_tensor_free(r);
    }
    kiln_tensor_free(full);
    kiln_tensor_free(c.pool_w);
    kiln_tensor_free(x);
}

static void t_map_identity(void)
{
    map_vs_untiled(kiln_device_cpu(), 0, 1, 1, 1e-6);
    map_vs_untiled(sim(), 0, 1, 1, 1e-6);
}

static void t_map_upsample8(void)
{
    map_vs_untiled(kiln_device_cpu(), 1, 8, 1, 1e-6);
    map_vs_untiled(sim(), 1, 8, 1, 1e-6);
}

static void t_map_pool8(void)
{
    map_vs_untiled(kiln_device_cpu(), 2, 1, 8, 1e-5);
    map_vs_untiled(sim(), 2, 1, 8, 1e-5);
}

/* f16 results take the ops path (weights as an f16 tile, add, copy back) */
static void t_map_f16(void)
{
    kiln_tensor *x32 = pattern(kiln_device_cpu(), 1, 2, 64, 80, 3), *x = NULL;
    kiln_tensor_to(x32, NULL, KILN_F16, &x);
    fn_ctx c = {1, 0, NULL};
    kiln_tensor *full = NULL, *r = NULL;
    CHECK(fn(&c, 0, x, &full) == KILN_OK, "%s", kiln_last_error());
    r = run_map(x, &c, 32, 8, 8, 1, KILN_BLEND_COSINE, NULL);
    if (r) {
        CHECK(r->dtype == KILN_F16, "dtype %s", kiln_dtype_name(r->dtype));
        double d = maxdiff(r, full);
        CHECK(d <= 4e-3, "f16 max diff %g", d);
    }
    kiln_tensor_free(r);
    kiln_tensor_free(full);
    kiln_tensor_free(x);
    kiln_tensor_free(x32);
}

static void t_map_errors(void)
{
    kiln_device *dev = sim();
    uint64_t before = kiln_allocator_stats(dev->alloc).allocated;
    kiln_tensor *x = pattern(dev, 1, 3, 64, 64, 1);
    fn_ctx c = {3, 0, NULL};
    kiln_status st;
    kiln_tensor *r = run_map(x, &c, 32, 8, 1, 1, KILN_BLEND_LINEAR, &st);
    CHECK(st == KILN_ERR_IO && !r && strstr(kiln_last_error(), "on purpose"), "fn error: %d %s", st, kiln_last_error());
    CHECK(c.calls == 3, "stopped after call %d", c.calls);
    c = (fn_ctx){4, 0, NULL};
    r = run_map(x, &c, 32, 8, 8, 1, KILN_BLEND_LINEAR, &st);
    /* 64 px, tile 32, overlap 8: 3 tiles of 27 per axis */
    CHECK(st == KILN_ERR_ARG && !r && strstr(kiln_last_error(), "fn returned [1,3,54,54] for tile 1 of 9") &&
          strstr(kiln_last_error(), "expected [1,C,216,216] (scale 8/1)"), "%s", kiln_last_error());
    c = (fn_ctx){6, 0, NULL};
    r = run_map(x, &c, 32, 8, 1, 1, KILN_BLEND_LINEAR, &st);
    CHECK(st == KILN_ERR_ARG && !r && strstr(kiln_last_error(), "fn returned [1,1,27,27] for tile 2 of 9") &&
          strstr(kiln_last_error(), "expected [1,3,27,27]"), "%s", kiln_last_error());
    kiln_tile_opts o;
    kiln_tile_opts_init(&o, 32, 8);
    CHECK(kiln_tile_map(x, &o, NULL, NULL, NULL, &r) == KILN_ERR_ARG, "no fn");
    kiln_tensor_free(x);
    CHECK(kiln_allocator_stats(dev->alloc).allocated == before, "sim allocated %llu, was %llu",
          (unsigned long long)kiln_allocator_stats(dev->alloc).allocated, (unsigned long long)before);
}

static int cancel_at_2(void *ud, int done, int total)
{
    (void)ud;
    (void)total;
    return done >= 2;
}

static void t_map_cancel(void)
{
    kiln_tensor *x = pattern(kiln_device_cpu(), 1, 1, 64, 64, 2), *r = NULL;
    fn_ctx c = {0, 0, NULL};
    kiln_tile_opts o;
    kiln_tile_opts_init(&o, 32, 8);
    kiln_status st = kiln_tile_map(x, &o, fn, cancel_at_2, &c, &r);
    CHECK(st == KILN_ERR_CANCELLED && !r && c.calls == 2, "st %d calls %d", st, c.calls);
    kiln_tensor_free(x);
}

/* fn allocates 16x its tile on sim: under a budget that the untiled run exceeds the
 * tiled map fits, an OOM inside fn comes back typed, and nothing is left behind. */
static void t_map_oom_sim(void)
{
    kiln_device *dev = sim();
    kiln_allocator *a = dev->alloc;
    kiln_mem_stats s0 = kiln_allocator_stats(a);
    kiln_allocator_empty_cache(a);
    kiln_tensor *x = pattern(dev, 1, 4, 128, 128, 5); /* 256 KiB */
    kiln_allocator_set_budget(a, kiln_allocator_stats(a).reserved + 2 * MiB);
    fn_ctx c = {5, 0, NULL};
    kiln_tensor *full = NULL;
    kiln_status st = fn(&c, 0, x, &full);
    CHECK(st == KILN_ERR_OOM && !full, "untiled needs 4 MiB of scratch: %d", st);
    kiln_tensor *r = run_map(x, &c, 128, 0, 1, 1, KILN_BLEND_LINEAR, &st);
    CHECK(st == KILN_ERR_OOM && !r && strstr(kiln_last_error(), "out of memory"), "one tile: %s", kiln_last_error());
    r = run_map(x, &c, 48, 8, 1, 1, KILN_BLEND_LINEAR, &st);
    CHECK(st == KILN_OK && r, "tiled: %s", kiln_last_error());
    kiln_tensor_free(r);
    kiln_tensor_free(x);
    kiln_allocator_set_budget(a, s0.budget);
    CHECK(kiln_allocator_stats(a).allocated == s0.allocated, "sim allocated %llu, was %llu",
          (unsigned long long)kiln_allocator_stats(a).allocated, (unsigned long long)s0.allocated);
}

/* The peak of a tiled map on sim minus its result stays within one tile's working set
 * for three image sizes. */
static void t_map_peak_flat(void)
{
    kiln_device *dev = sim();
    kiln_allocator *a = dev->alloc;
    int64_t sizes[3] = {96, 192, 320};
    uint64_t extra[3] = {0, 0, 0};
    for (int k = 0; k < 3; k++) {
        kiln_tensor *x = pattern(dev, 1, 4, sizes[k], sizes[k], 9);
        fn_ctx c = {5, 0, NULL};
        kiln_allocator_empty_cache(a); /* blocks cached by the last size would be reused whole */
        uint64_t base = kiln_allocator_stats(a).allocated;
        kiln_allocator_reset_peak(a);
        kiln_tensor *r = run_map(x, &c, 64, 16, 1, 1, KILN_BLEND_LINEAR, NULL);
        uint64_t peak = kiln_allocator_stats(a).peak_allocated;
        /* the result as the allocator holds it: a large block takes its whole segment */
        if (r) extra[k] = peak - base - kiln_allocator_block_size(a, r->storage->data);
        kiln_tensor_free(r);
        kiln_tensor_free(x);
        printf("     size %lld: peak %llu bytes over the input = result %llu + %llu\n", (long long)sizes[k],
               (unsigned long long)(peak - base), (unsigned long long)(peak - base - extra[k]),
               (unsigned long long)extra[k]);
    }
    /* one tile's input copy, a 16x scratch, its output: 18 x 64 KiB at most for a full
     * 64 x 64 tile, whatever the image size (tiles shortened to fit an axis take less) */
    for (int k = 0; k < 3; k++)
        CHECK(extra[k] > 0 && extra[k] <= 18 * 64 * 64 * 4 * 4 + 4096, "tile overhead %llu at size %lld",
              (unsigned long long)extra[k], (long long)sizes[k]);
}

int main(void)
{
    RUN(t_plan_grids);
    RUN(t_plan_spread);
    RUN(t_plan_errors);
    RUN(t_map_identity);
    RUN(t_map_upsample8);
    RUN(t_map_pool8);
    RUN(t_map_f16);
    RUN(t_map_errors);
    RUN(t_map_cancel);
    RUN(t_map_oom_sim);
    RUN(t_map_peak_flat);
    return test_summary();
}

/* test_embed.c - the C API of kiln.h as a host uses it: open / run / call / progress /
 * cancel / previews / log / error messages / memory / close, the config fields of a terminal
 * program, the pressure hook of each context, and that closing a context frees every
 * byte it allocated. Includes only the public header (and Lua's, for kiln_lua_state). */
#define _POSIX_C_SOURCE 200809L
#include "../bindings/kiln.h"
#include "test.h"

#include <lauxlib.h>
#include <lua.h>

#include <pthread.h>
#include <sys/stat.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

static char tmpdir[256];

static int contains(const char *s, const char *part)
{
    return s && part && strstr(s, part) != NULL;
}

static kiln_ctx *open_quiet(const char *device)
{
    kiln_config cfg = {0};
    cfg.device = device;
    cfg.log_level = KILN_LOG_OFF;
    cfg.ignore_env = 1;
    kiln_ctx *ctx = NULL;
    kiln_status st = kiln_open(&cfg, &ctx);
    if (st != KILN_OK) printf("# kiln_open failed: %s\n", kiln_last_message(NULL));
    return ctx;
}

static uint64_t allocated(const char *device)
{
    kiln_memory_info m;
    if (kiln_memory_stats(NULL, device, &m) != KILN_OK) return UINT64_MAX;
    return m.allocated;
}

/* ---------------------------------------------------------------- basics */

static void t_status_strings_match_runtime(void)
{
    /* kiln.h copies status.h's enum: the runtime's names prove the values agree */
    static const char *const want[] = {"ok", "argument", "io", "format", "oom", "unsupported", "state", "cancelled"};
    for (int i = 0; i < (int)(sizeof want / sizeof want[0]); i++)
        CHECK(strcmp(kiln_status_string((kiln_status)i), want[i]) == 0, "status %d is '%s', expected '%s'", i,
              kiln_status_string((kiln_status)i), want[i]);
    CHECK(KILN_STATUS_COUNT == 8, "KILN_STATUS_COUNT %d", (int)KILN_STATUS_COUNT);
    CHECK(strcmp(kiln_status_string(KILN_ERR_CANCELLED), "cancelled") == 0, "cancelled");
    CHECK(strcmp(kiln_status_string(KILN_ERR_SCRIPT), "script") == 0, "script");
    CHECK(kiln_version_string()[0] >= '0' && kiln_version_string()[0] <= '9', "version '%s'", kiln_version_string());
    CHECK(kiln_device_name_at(0) && strcmp(kiln_device_name_at(0), "cpu") == 0, "device 0");
    CHECK(kiln_device_name_at(-1) == NULL && kiln_device_name_at(100) == NULL, "devices out of range");
}

static void t_open_run_close(void)
{
    kiln_ctx *ctx = NULL;
    CHECK(kiln_open(NULL, &ctx) == KILN_OK, "open: %s", kiln_last_message(NULL));
    if (!ctx) return;
    CHECK(kiln_lua_state(ctx) != NULL, "lua state");
    CHECK(kiln_run_string(ctx, "x = 40 + 2; assert(type(kiln) == 'table' and kiln.version)") == KILN_OK, "run: %s",
          kiln_last_message(ctx));
    CHECK(kiln_run_string(ctx, "assert(x == 42 and require('kiln') == kiln)") == KILN_OK, "state kept: %s",
          kiln_last_message(ctx));
    CHECK(strcmp(kiln_last_message(ctx), "") == 0, "message after success '%s'", kiln_last_message(ctx));
    kiln_close(ctx);
    kiln_close(NULL);
}

static void t_open_bad_config(void)
{
    kiln_config cfg = {0};
    kiln_ctx *ctx = (kiln_ctx *)&cfg;
    cfg.device = "warp9";
    CHECK(kiln_open(&cfg, &ctx) == KILN_ERR_ARG && ctx == NULL, "bad device accepted");
    CHECK(contains(kiln_last_message(NULL), "config.device") && contains(kiln_last_message(NULL), "warp9") &&
              contains(kiln_last_message(NULL), "cpu"),
          "message '%s'", kiln_last_message(NULL));
    cfg.device = NULL;
    cfg.mode = "turbo";
    CHECK(kiln_open(&cfg, &ctx) == KILN_ERR_ARG && ctx == NULL, "bad mode accepted");
    CHECK(contains(kiln_last_message(NULL), "config.mode") && contains(kiln_last_message(NULL), "normal"),
          "message '%s'", kiln_last_message(NULL));
    cfg.mode = NULL;
    cfg.log_level = (kiln_log_level)9;
    CHECK(kiln_open(&cfg, &ctx) == KILN_ERR_ARG, "bad log level accepted");
    CHECK(contains(kiln_last_message(NULL), "log_level"), "message '%s'", kiln_last_message(NULL));
    cfg.log_level = KILN_LOG_DEFAULT;
    cfg.threads = -2;
    CHECK(kiln_open(&cfg, &ctx) == KILN_ERR_ARG, "negative threads accepted");
    CHECK(contains(kiln_last_message(NULL), "threads"), "message '%s'", kiln_last_message(NULL));
    CHECK(kiln_open(&cfg, NULL) == KILN_ERR_ARG, "NULL out accepted");
}

static void t_script_errors(void)
{
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    CHECK(kiln_run_string(ctx, "x = = 1") == KILN_ERR_SCRIPT, "syntax error");
    CHECK(contains(kiln_last_message(ctx), "[string \"x = = 1\"]:1:"), "message '%s'", kiln_last_message(ctx));
    CHECK(strcmp(kiln_last_traceback(ctx), "") == 0, "traceback of a load error");

    CHECK(kiln_run_string(ctx, "local function f() error('boom') end\nf()") == KILN_ERR_SCRIPT, "runtime error");
    CHECK(contains(kiln_last_message(ctx), ":1: boom"), "message '%s'", kiln_last_message(ctx));
    CHECK(contains(kiln_last_traceback(ctx), "stack traceback") && contains(kiln_last_traceback(ctx), "boom"),
          "traceback '%s'", kiln_last_traceback(ctx));

    CHECK(kiln_run_string(ctx, "error({kind = 'odd'})") == KILN_ERR_SCRIPT, "table error");
    CHECK(contains(kiln_last_message(ctx), "table"), "message '%s'", kiln_last_message(ctx));
    CHECK(kiln_run_string(ctx, "kiln.tensor({1}):reshape({5})") == KILN_ERR_SCRIPT, "runtime error of kiln");
    CHECK(kiln_last_message(ctx)[0] != '\0', "empty message");

    CHECK(kiln_run_string(ctx, "os.exit(0)") == KILN_OK, "os.exit(0): %s", kiln_last_message(ctx));
    CHECK(kiln_run_string(ctx, "os.exit(true)") == KILN_OK, "os.exit(true)");
    CHECK(kiln_run_string(ctx, "os.exit(3)") == KILN_ERR_SCRIPT, "os.exit(3)");
    CHECK(contains(kiln_last_message(ctx), "os.exit(3)"), "message '%s'", kiln_last_message(ctx));
    CHECK(kiln_run_string(ctx, NULL) == KILN_ERR_ARG, "NULL code");
    CHECK(kiln_run_string(NULL, "x = 1") == KILN_ERR_ARG, "NULL ctx");
    CHECK(contains(kiln_last_message(NULL), "context is NULL"), "message '%s'", kiln_last_message(NULL));
    /* still usable */
    CHECK(kiln_run_string(ctx, "y = 1") == KILN_OK, "after errors: %s", kiln_last_message(ctx));
    kiln_close(ctx);
}

/* config.script_path: folders searched for kiln/NAME.lua before the built-in scripts */
static void t_script_path(void)
{
    char dir[512], path[600];
    snprintf(dir, sizeof dir, "%s/kiln", tmpdir);
    snprintf(path, sizeof path, "%s/kiln/hostmod.lua", tmpdir);
    mkdir(dir, 0700);
    FILE *f = fopen(path, "w");
    if (!f) { SKIP("cannot write %s", path); return; }
    fputs("return {answer = 42}\n", f);
    fclose(f);
    kiln_config cfg = {0};
    cfg.script_path = tmpdir;
    cfg.log_level = KILN_LOG_OFF;
    kiln_ctx *ctx = NULL;
    CHECK(kiln_open(&cfg, &ctx) == KILN_OK, "open: %s", kiln_last_message(NULL));
    if (ctx) {
        CHECK(kiln_run_string(ctx, "assert(require('kiln.hostmod').answer == 42)") ==
                  KILN_OK,
              "script_path: %s", kiln_last_message(ctx));
        kiln_close(ctx);
    }
    cfg.script_path = "";
    CHECK(kiln_open(&cfg, &ctx) == KILN_OK, "open: %s", kiln_last_message(NULL));
    if (ctx) {
        CHECK(kiln_run_string(ctx, "assert(not pcall(require, 'kiln.hostmod'))") == KILN_OK, "built-in only: %s",
              kiln_last_message(ctx));
        kiln_close(ctx);
    }
    remove(path);
    rmdir(dir);
}

static void t_run_file(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/script.lua", tmpdir);
    FILE *f = fopen(path, "w");
    if (!f) { SKIP("cannot write %s", path); return; }
    fputs("local a, b = ...\nassert(a == arg[1] and b == arg[2] and #arg == 2)\n"
          "joined = a .. b .. '|' .. arg[0]\n", f);
    fclose(f);
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    const char *argv[] = {"x", "y"};
    CHECK(kiln_run_file(ctx, path, 2, argv) == KILN_OK, "run_file: %s", kiln_last_message(ctx));
    char check[700];
    snprintf(check, sizeof check, "assert(joined == 'xy|%s', joined)", path);
    CHECK(kiln_run_string(ctx, check) == KILN_OK, "args: %s", kiln_last_message(ctx));
    CHECK(kiln_run_file(ctx, "/nonexistent/dir/tool.lua", 0, NULL) == KILN_ERR_IO, "missing file");
    CHECK(contains(kiln_last_message(ctx), "/nonexistent/dir/tool.lua"), "message '%s'", kiln_last_message(ctx));
    CHECK(kiln_run_file(ctx, path, 1, NULL) == KILN_ERR_ARG, "argc without argv");
    kiln_close(ctx);
}

/* ---------------------------------------------------------------- images */

static const char *IMAGE_SCRIPT =
    "function invert(img, gain)\n"
    "  assert(img.dtype == 'f32' and img.device == 'cpu' and #img.shape == 4 and img.shape[1] == 1)\n"
    "  shape_seen = table.concat(img.shape, ',')\n"
    "  return (1 - img) * tonumber(gain or '1')\n"
    "end\n"
    "function first(a, b) return a end\n"
    "function second(a, b) return b end\n"
    "function planar(img) return img:reshape({img.shape[2], img.shape[3], img.shape[4]}) end\n"
    "function gray2d() return kiln.tensor({{0, 0.5}, {1, 2}}) end\n"
    "function nothing() end\n"
    "function five() return kiln.zeros({1, 5, 2, 2}) end\n"
    "function text() return 'hello' end\n"
    "function freed() local t = kiln.zeros({1, 3, 2, 2}); t:free(); return t end\n"
    "tools = {half = function(img) return img * 0.5 end}\n";

static void t_call_images(void)
{
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    CHECK(kiln_run_string(ctx, IMAGE_SCRIPT) == KILN_OK, "script: %s", kiln_last_message(ctx));
    /* RGB 4x3 with 4 bytes of padding per row */
    enum { W = 4, H = 3, C = 3, STRIDE = W * C + 4 };
    unsigned char px[H * STRIDE];
    for (int i = 0; i < H * STRIDE; i++) px[i] = (unsigned char)(i * 7);
    kiln_image in = {W, H, C, KILN_PIXEL_U8, STRIDE, px};
    kiln_image out = {0};
    CHECK(kiln_call(ctx, "invert", &in, 1, NULL, 0, &out) == KILN_OK, "call: %s", kiln_last_message(ctx));
    CHECK(kiln_run_string(ctx, "assert(shape_seen == '1,3,3,4', shape_seen)") == KILN_OK, "shape in Lua: %s",
          kiln_last_message(ctx));
    CHECK(out.width == W && out.height == H && out.channels == C && out.format == KILN_PIXEL_U8 &&
              out.stride == W * C && out.data,
          "out %dx%dx%d stride %zu", out.width, out.height, out.channels, out.stride);
    int bad = 0;
    for (int y = 0; y < H && out.data; y++)
        for (int i = 0; i < W * C; i++)
            bad += ((unsigned char *)out.data)[y * W * C + i] != 255 - px[y * STRIDE + i];
    CHECK(bad == 0, "%d inverted pixels differ", bad);
    kiln_image_free(&out);
    CHECK(out.data == NULL && out.width == 0, "image_free zeroes");

    /* float out, a string argument, a dotted name, 2 images */
    const char *gain[] = {"2"};
    out.format = KILN_PIXEL_F32;
    CHECK(kiln_call(ctx, "invert", &in, 1, gain, 1, &out) == KILN_OK, "f32: %s", kiln_last_message(ctx));
    if (out.data) {
        float v0 = ((float *)out.data)[0];
        CHECK_NEAR(v0, 2.0, 1e-6); /* (1 - 0) * 2, not clamped */
        CHECK_NEAR(((float *)out.data)[1], (1 - 7 / 255.0) * 2, 1e-5);
    }
    kiln_image_free(&out);
    float gray[6] = {0.25f, 0.5f, 1, 0, 0.75f, 0.125f};
    kiln_image g[2] = {{3, 2, 1, KILN_PIXEL_F32, 0, gray}, in};
    out.format = KILN_PIXEL_F32;
    CHECK(kiln_call(ctx, "tools.half", g, 1, NULL, 0, &out) == KILN_OK, "dotted: %s", kiln_last_message(ctx));
    CHECK(out.channels == 1 && out.width == 3 && out.height == 2, "gray shape");
    if (out.data) CHECK_NEAR(((float *)out.data)[4], 0.375, 1e-6);
    kiln_image_free(&out);
    CHECK(kiln_call(ctx, "second", g, 2, NULL, 0, &out) == KILN_OK, "2 images: %s", kiln_last_message(ctx));
    CHECK(out.channels == 3 && out.width == W, "second image back");
    kiln_image_free(&out);
    /* [C, H, W] and [H, W] results, clamped to 8 bits */
    CHECK(kiln_call(ctx, "planar", &in, 1, NULL, 0, &out) == KILN_OK, "planar: %s", kiln_last_message(ctx));
    CHECK(out.channels == 3 && out.width == W && out.height == H, "planar shape");
    kiln_image_free(&out);
    CHECK(kiln_call(ctx, "gray2d", NULL, 0, NULL, 0, &out) == KILN_OK, "2-d: %s", kiln_last_message(ctx));
    if (out.data) {
        unsigned char *p = out.data;
        CHECK(out.channels == 1 && p[0] == 0 && p[1] == 128 && p[2] == 255 && p[3] == 255, "2-d pixels %d %d %d %d",
              p[0], p[1], p[2], p[3]);
    }
    kiln_image_free(&out);
    /* no output wanted: the result is ignored */
    CHECK(kiln_call(ctx, "nothing", NULL, 0, NULL, 0, NULL) == KILN_OK, "no out: %s", kiln_last_message(ctx));
    kiln_close(ctx);
}

static void t_call_errors(void)
{
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    CHECK(kiln_run_string(ctx, IMAGE_SCRIPT) == KILN_OK, "script: %s", kiln_last_message(ctx));
    unsigned char px[12] = {0};
    kiln_image in = {2, 2, 3, KILN_PIXEL_U8, 0, px};
    kiln_image out = {0};
    CHECK(kiln_call(ctx, "no_such_function", NULL, 0, NULL, 0, &out) == KILN_ERR_ARG, "missing function");
    CHECK(contains(kiln_last_message(ctx), "'no_such_function' is not a function"), "message '%s'",
          kiln_last_message(ctx));
    CHECK(kiln_call(ctx, "tools.nope", NULL, 0, NULL, 0, &out) == KILN_ERR_ARG, "missing field");
    CHECK(kiln_call(ctx, "nothing", NULL, 0, NULL, 0, &out) == KILN_ERR_SCRIPT, "nil result");
    CHECK(contains(kiln_last_message(ctx), "'nothing' returned nil") &&
              contains(kiln_last_message(ctx), "[1, C, H, W]"),
          "message '%s'", kiln_last_message(ctx));
    CHECK(kiln_call(ctx, "five", NULL, 0, NULL, 0, &out) == KILN_ERR_SCRIPT, "5 channels");
    CHECK(contains(kiln_last_message(ctx), "[1,5,2,2]"), "message '%s'", kiln_last_message(ctx));
    CHECK(kiln_call(ctx, "text", NULL, 0, NULL, 0, &out) == KILN_ERR_SCRIPT, "string result");
    CHECK(out.data == NULL && out.width == 0, "out touched on failure");
    CHECK(kiln_call(ctx, "freed", NULL, 0, NULL, 0, &out) == KILN_ERR_SCRIPT, "freed tensor result");
    CHECK(contains(kiln_last_message(ctx), "a freed tensor"), "message '%s'", kiln_last_message(ctx));

    kiln_image bad = in;
    bad.channels = 5;
    CHECK(kiln_call(ctx, "first", &bad, 1, NULL, 0, &out) == KILN_ERR_ARG, "5-channel input");
    CHECK(contains(kiln_last_message(ctx), "image 1") && contains(kiln_last_message(ctx), "channels"),
          "message '%s'", kiln_last_message(ctx));
    kiln_image two[2] = {in, in};
    two[1].stride = 2;
    CHECK(kiln_call(ctx, "first", two, 2, NULL, 0, &out) == KILN_ERR_ARG, "short stride");
    CHECK(contains(kiln_last_message(ctx), "image 2: stride 2"), "message '%s'", kiln_last_message(ctx));
    bad = in;
    bad.data = NULL;
    CHECK(kiln_call(ctx, "first", &bad, 1, NULL, 0, &out) == KILN_ERR_ARG, "NULL data");
    bad = in;
    bad.width = 0;
    CHECK(kiln_call(ctx, "first", &bad, 1, NULL, 0, &out) == KILN_ERR_ARG, "width 0");
    bad = in;
    bad.format = (kiln_pixel_format)7;
    CHECK(kiln_call(ctx, "first", &bad, 1, NULL, 0, &out) == KILN_ERR_ARG, "format 7");
    const char *args[] = {"a", NULL};
    CHECK(kiln_call(ctx, "first", NULL, 0, args, 2, &out) == KILN_ERR_ARG, "NULL arg");
    CHECK(kiln_call(ctx, "first", NULL, 1, NULL, 0, &out) == KILN_ERR_ARG, "NULL images");
    CHECK(kiln_call(ctx, NULL, NULL, 0, NULL, 0, &out) == KILN_ERR_ARG, "NULL name");
    out.format = (kiln_pixel_format)3;
    CHECK(kiln_call(ctx, "first", &in, 1, NULL, 0, &out) == KILN_ERR_ARG, "bad out format");
    CHECK(out.data == NULL, "out data set on failure");
    kiln_close(ctx);
}

/* ---------------------------------------------------------------- progress, cancel */

typedef struct {
    kiln_ctx *ctx;
    int calls, last_step, last_total, cancel_at;
    char last_msg[64];
    kiln_status nested;
    const char *summary;
} progress_log;

static void on_progress(void *user, int step, int total, const char *message)
{
    progress_log *p = user;
    p->calls++;
    p->last_step = step;
    p->last_total = total;
    snprintf(p->last_msg, sizeof p->last_msg, "%s", message);
    if (step == 2) {
        p->nested = kiln_run_string(p->ctx, "x = 1"); /* not allowed from a callback */
        p->summary = kiln_memory_summary(p->ctx);     /* allowed */
    }
    if (p->cancel_at && step == p->cancel_at) kiln_cancel(p->ctx);
}

static const char *STEPS_SCRIPT =
    "function steps(n, size)\n"
    "  n = tonumber(n)\n"
    "  local x = kiln.zeros({1, 3, 8, 8})\n"
    "  for i = 1, n do\n"
    "    local scratch = kiln.zeros({tonumber(size or '1024')})\n"
    "    x = x + 1 / n\n"
    "    kiln.progress(i, n, 'step')\n"
    "  end\n"
    "  return x\n"
    "end\n"
    "function stubborn()\n"
    "  pcall(function() for i = 1, 5 do kiln.progress(i, 5, 'inner') end end)\n"
    "  swallowed = true\n"
    "  local k = 0\n"
    "  while true do k = k + 1 end\n"
    "end\n"
    "function spin() local k = 0 while true do k = k + 1 end end\n";

static void t_progress_and_cancel(void)
{
    kiln_ctx *ctx = open_quiet("sim");
    if (!ctx) return;
    progress_log p = {.ctx = ctx};
    kiln_set_progress(ctx, on_progress, &p);
    CHECK(kiln_run_string(ctx, STEPS_SCRIPT) == KILN_OK, "script: %s", kiln_last_message(ctx));
    const char *args[] = {"6", "262144"};
    kiln_image out = {0};
    CHECK(kiln_call(ctx, "steps", NULL, 0, args, 2, &out) == KILN_OK, "steps: %s", kiln_last_message(ctx));
    CHECK(p.calls == 6 && p.last_step == 6 && p.last_total == 6 && strcmp(p.last_msg, "step") == 0,
          "progress calls %d, last %d/%d '%s'", p.calls, p.last_step, p.last_total, p.last_msg);
    CHECK(p.nested == KILN_ERR_STATE, "run_string from a callback gave %d", (int)p.nested);
    CHECK(p.summary && contains(p.summary, "sim"), "summary from a callback");
    if (out.data) CHECK(((unsigned char *)out.data)[0] == 255, "6 steps of 1/6 -> %d", ((unsigned char *)out.data)[0]);
    kiln_image_free(&out);

    /* cancel from the progress callback at step 3: the call stops there and every
     * tensor it made (1 MiB of scratch per step) is freed */
    uint64_t before = allocated("sim");
    p = (progress_log){.ctx = ctx, .cancel_at = 3};
    kiln_status st = kiln_call(ctx, "steps", NULL, 0, args, 2, &out);
    CHECK(st == KILN_ERR_CANCELLED, "cancel gave %s: %s", kiln_status_string(st), kiln_last_message(ctx));
    CHECK(p.calls == 3, "%d progress calls after a cancel at 3", p.calls);
    CHECK(contains(kiln_last_message(ctx), "cancelled at step 3 of 6"), "message '%s'", kiln_last_message(ctx));
    CHECK(out.data == NULL, "out set by a cancelled call");
    CHECK(allocated("sim") == before, "sim allocated %llu after the cancelled call, %llu before",
          (unsigned long long)allocated("sim"), (unsigned long long)before);

    /* the next call starts with the request cleared */
    p = (progress_log){.ctx = ctx};
    CHECK(kiln_call(ctx, "steps", NULL, 0, args, 2, NULL) == KILN_OK, "after cancel: %s", kiln_last_message(ctx));

    /* a script that swallows the error in pcall is stopped by the hook */
    p = (progress_log){.ctx = ctx, .cancel_at = 2};
    st = kiln_call(ctx, "stubborn", NULL, 0, NULL, 0, NULL);
    CHECK(st == KILN_ERR_CANCELLED, "stubborn gave %s: %s", kiln_status_string(st), kiln_last_message(ctx));
    CHECK(kiln_run_string(ctx, "assert(swallowed)") == KILN_OK, "did not get past the pcall");

    /* a script's own kiln.cancel() */
    CHECK(kiln_run_string(ctx, "kiln.cancel(); assert(kiln.cancelled()); kiln.progress(1, 2)") == KILN_ERR_CANCELLED,
          "kiln.cancel: %s", kiln_last_message(ctx));
    CHECK(kiln_run_string(ctx, "assert(not kiln.cancelled())") == KILN_OK, "cancel flag not cleared");
    kiln_set_progress(ctx, NULL, NULL);
    kiln_close(ctx);
}

static void *cancel_later(void *arg)
{
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
    kiln_cancel(arg);
    return NULL;
}

static void t_cancel_from_another_thread(void)
{
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    CHECK(kiln_run_string(ctx, STEPS_SCRIPT) == KILN_OK, "script: %s", kiln_last_message(ctx));
    pthread_t th;
    if (pthread_create(&th, NULL, cancel_later, ctx) != 0) {
        SKIP("pthread_create failed");
        kiln_close(ctx);
        return;
    }
    kiln_status st = kiln_call(ctx, "spin", NULL, 0, NULL, 0, NULL);
    pthread_join(th, NULL);
    CHECK(st == KILN_ERR_CANCELLED, "spin gave %s: %s", kiln_status_string(st), kiln_last_message(ctx));
    CHECK(contains(kiln_last_message(ctx), "cancelled"), "message '%s'", kiln_last_message(ctx));
    kiln_close(ctx);
}

/* A sampler loop reports each step as the pipeline does (kiln.progress bars, via the
 * sampler's callback), and a cancel stops it at that step. */
static void t_sampler_progress_and_cancel(void)
{
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    progress_log p = {.ctx = ctx, .cancel_at = 4};
    kiln_set_progress(ctx, on_progress, &p);
    const char *setup =
        "sigmas = kiln.sample.sigmas('karras', 10, {sigma_min = 0.03, sigma_max = 14.6})\n"
        "x0 = kiln.randn({1, 4, 8, 8}, {seed = 1})\n"
        "function denoise(x, sigma) return x * 0.5 end\n";
    CHECK(kiln_run_string(ctx, setup) == KILN_OK, "setup: %s", kiln_last_message(ctx));
    kiln_status st = kiln_run_string(ctx,
        "local bar = require('kiln.progress').start('sample', 10)\n"
        "kiln.sample.run('euler', denoise, x0, sigmas, {callback = function(s) bar:step(s.i) end})\n");
    CHECK(st == KILN_ERR_CANCELLED, "sampler gave %s: %s", kiln_status_string(st), kiln_last_message(ctx));
    CHECK(p.last_step == 4 && p.last_total == 10 && strcmp(p.last_msg, "sample") == 0, "stopped at %d/%d '%s'",
          p.last_step, p.last_total, p.last_msg);

    kiln_close(ctx);
}

/* kiln.sample.run alone (no callback): reports too once the sampler calls kiln.progress. */
static void t_bare_sampler_progress(void)
{
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    progress_log p = {.ctx = ctx, .cancel_at = 4};
    kiln_set_progress(ctx, on_progress, &p);
    kiln_status st = kiln_run_string(ctx,
        "local sigmas = kiln.sample.sigmas('karras', 10, {sigma_min = 0.03, sigma_max = 14.6})\n"
        "kiln.sample.run('euler', function(x) return x * 0.5 end, kiln.randn({1, 4, 8, 8}, {seed = 1}), sigmas)\n");
    if (p.calls == 0 && st == KILN_OK) {
        SKIP("kiln.sample.run reports kiln.progress only through a callback");
    } else {
        CHECK(st == KILN_ERR_CANCELLED, "bare sampler gave %s: %s", kiln_status_string(st), kiln_last_message(ctx));
        CHECK(p.last_step == 4 && p.last_total == 10, "stopped at %d/%d", p.last_step, p.last_total);
    }
    kiln_close(ctx);
}

/* ---------------------------------------------------------------- previews */

typedef struct {
    int calls, steps[8], width, height, channels, bad_pixels;
    kiln_status nested;
    kiln_ctx *ctx;
} preview_log;

static void on_preview(void *user, int step, int total, const kiln_image *im)
{
    preview_log *p = user;
    if (p->calls < 8) p->steps[p->calls] = step * 100 + total;
    p->calls++;
    p->width = im->width;
    p->height = im->height;
    p->channels = im->channels;
    if (im->format != KILN_PIXEL_U8 || !im->data) p->bad_pixels++;
    if (p->calls == 1) p->nested = kiln_run_string(p->ctx, "x = 1"); /* not allowed from a callback */
}

/* The pipelines feed the host's preview callback every N steps (and after the last)
 * with 8-bit RGB pictures of the latent's size (the demo model: 16x16 for 64x64). */
static void t_preview_callback(void)
{
    if (access("examples/models/kiln-shapes.safetensors", R_OK) != 0) {
        SKIP("the demo model is not in examples/models (run from the source tree)");
        return;
    }
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    preview_log p = {.ctx = ctx};
    kiln_set_preview(ctx, on_preview, &p, 2);
    const char *run =
        "local ckpt <close> = kiln.load_checkpoint('examples/models/kiln-shapes.safetensors')\n"
        "kiln.pipeline.txt2img(ckpt, {prompt = 'a red circle', steps = 5, width = 64, height = 64}):free()\n";
    CHECK(kiln_run_string(ctx, run) == KILN_OK, "txt2img: %s", kiln_last_message(ctx));
    CHECK(p.calls == 3 && p.steps[0] == 205 && p.steps[1] == 405 && p.steps[2] == 505,
          "%d previews (steps %d %d %d, as step*100+total)", p.calls, p.steps[0], p.steps[1], p.steps[2]);
    CHECK(p.width == 16 && p.height == 16 && p.channels == 3 && p.bad_pixels == 0, "preview %dx%dx%d (%d bad)",
          p.width, p.height, p.channels, p.bad_pixels);
    CHECK(p.nested == KILN_ERR_STATE, "kiln_run_string from the preview callback gave %s",
          kiln_status_string(p.nested));
    /* a script's own loop: kiln.preview_image; none after kiln_set_preview(NULL) */
    p.calls = 0;
    CHECK(kiln_run_string(ctx, "assert(kiln.preview_every() == 2)\n"
                               "kiln.preview_image(1, 1, kiln.zeros({2, 3, 5, 7}))") == KILN_OK,
          "preview_image: %s", kiln_last_message(ctx));
    CHECK(p.calls == 1 && p.width == 7 && p.height == 5, "%d calls, %dx%d", p.calls, p.width, p.height);
    kiln_set_preview(ctx, NULL, NULL, 0);
    p.calls = 0;
    CHECK(kiln_run_string(ctx, "assert(kiln.preview_every() == nil)\n"
                               "kiln.preview_image(1, 1, kiln.zeros({1, 3, 5, 7}))") == KILN_OK,
          "no callback: %s", kiln_last_message(ctx));
    CHECK(p.calls == 0, "%d calls without a callback", p.calls);
    kiln_close(ctx);
}

/* ---------------------------------------------------------------- logging */

typedef struct {
    int n;
    kiln_log_level level[8];
    char text[8][128];
} log_record;

static void on_log(void *user, kiln_log_level level, const char *message)
{
    log_record *r = user;
    if (r->n < 8) {
        r->level[r->n] = level;
        snprintf(r->text[r->n], sizeof r->text[0], "%s", message);
    }
    r->n++;
}

static void t_log_and_no_stdout(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/stdout.txt", tmpdir);
    fflush(stdout);
    int saved = dup(1);
    FILE *f = fopen(path, "w");
    if (saved < 0 || !f) { SKIP("cannot redirect stdout"); return; }
    dup2(fileno(f), 1);

    log_record r = {0};
    kiln_config cfg = {0};
    cfg.log = on_log;
    cfg.log_user = &r;
    kiln_ctx *ctx = NULL;
    kiln_status st_open = kiln_open(&cfg, &ctx);
    kiln_status st1 = KILN_ERR_STATE, st2 = KILN_ERR_STATE;
    if (ctx) {
        st1 = kiln_run_string(ctx, "print('hello', 42, nil); warn('care', 'ful'); warn('@off'); warn('hidden')");
        st2 = kiln_run_string(ctx, "io.stderr:write(''); local t = kiln.zeros({4}); print(t)");
        kiln_run_string(ctx, "error('quiet failure')"); /* errors are not logged above DEBUG */
        kiln_close(ctx);
    }
    fflush(stdout);
    dup2(saved, 1);
    close(saved);
    fseek(f, 0, SEEK_END);
    long written = ftell(f);
    fclose(f);

    CHECK(st_open == KILN_OK && st1 == KILN_OK && st2 == KILN_OK, "open %d runs %d %d", st_open, st1, st2);
    CHECK(written == 0, "the library wrote %ld bytes to stdout", written);
    CHECK(r.n == 3, "%d log messages", r.n);
    CHECK(r.level[0] == KILN_LOG_INFO && strcmp(r.text[0], "hello\t42\tnil") == 0, "print -> '%s' (%d)", r.text[0],
          r.level[0]);
    CHECK(r.level[1] == KILN_LOG_WARN && strcmp(r.text[1], "careful") == 0, "warn -> '%s' (%d)", r.text[1],
          r.level[1]);
    CHECK(contains(r.text[2], "tensor(f32"), "print(tensor) -> '%s'", r.text[2]);

    /* the level filters: WARN drops print() */
    r = (log_record){0};
    cfg.log_level = KILN_LOG_WARN;
    if (kiln_open(&cfg, &ctx) == KILN_OK) {
        kiln_run_string(ctx, "print('dropped'); warn('kept')");
        kiln_close(ctx);
    }
    CHECK(r.n == 1 && strcmp(r.text[0], "kept") == 0, "%d messages at WARN, first '%s'", r.n, r.text[0]);
    /* DEBUG carries the traceback of failures; kiln_set_log replaces the callback */
    r = (log_record){0};
    log_record r2 = {0};
    cfg.log_level = KILN_LOG_DEBUG;
    if (kiln_open(&cfg, &ctx) == KILN_OK) {
        kiln_set_log(ctx, on_log, &r2);
        kiln_run_string(ctx, "error('traced')");
        kiln_close(ctx);
    }
    CHECK(r.n == 0 && r2.n == 1 && r2.level[0] == KILN_LOG_DEBUG && contains(r2.text[0], "traced"),
          "debug log: %d %d '%s'", r.n, r2.n, r2.text[0]);
}

/* ---------------------------------------------------------------- memory */

static void t_memory_and_oom(void)
{
    kiln_memory_info m;
    CHECK(kiln_memory_stats(NULL, "warp9", &m) == KILN_ERR_ARG, "unknown device");
    CHECK(contains(kiln_last_message(NULL), "warp9"), "message '%s'", kiln_last_message(NULL));
    CHECK(kiln_memory_stats(NULL, NULL, NULL) == KILN_ERR_ARG, "NULL out");
    CHECK(kiln_memory_stats(NULL, "sim", &m) == KILN_OK && strcmp(m.device, "sim") == 0, "sim stats");
    uint64_t old_budget = m.budget;

    kiln_config cfg = {0};
    cfg.device = "sim";
    cfg.memory_budget = 1 << 20;
    cfg.log_level = KILN_LOG_OFF;
    kiln_ctx *ctx = NULL;
    CHECK(kiln_open(&cfg, &ctx) == KILN_OK, "open: %s", kiln_last_message(NULL));
    if (!ctx) return;
    CHECK(kiln_memory_stats(ctx, NULL, &m) == KILN_OK && strcmp(m.device, "sim") == 0 && m.budget == 1 << 20,
          "config budget: %s %llu", m.device, (unsigned long long)m.budget);
    kiln_oom_info none;
    CHECK(kiln_memory_last_oom(ctx, &none) == KILN_ERR_STATE, "OOM details before any OOM");
    kiln_status st = kiln_run_string(ctx, "big = kiln.zeros({1024, 1024})");
    CHECK(st == KILN_ERR_OOM, "4 MiB in a 1 MiB budget gave %s", kiln_status_string(st));
    CHECK(contains(kiln_last_message(ctx), "sim"), "OOM message '%s'", kiln_last_message(ctx));
    kiln_oom_info oi;
    CHECK(kiln_memory_last_oom(ctx, &oi) == KILN_OK && strcmp(oi.device, "sim") == 0 && oi.requested >= 4u << 20 &&
              oi.budget == 1 << 20 && oi.free <= 1 << 20,
          "last OOM: %s requested %llu free %llu budget %llu", oi.device,
          (unsigned long long)oi.requested, (unsigned long long)oi.free, (unsigned long long)oi.budget);
    CHECK(kiln_memory_last_oom(NULL, &oi) == KILN_ERR_ARG, "NULL context");
    /* caught in the script, it is an ordinary value */
    CHECK(kiln_run_string(ctx, "local ok, e = pcall(kiln.zeros, {1024, 1024}); "
                               "assert(not ok and e.kind == 'oom' and e.device == 'sim')") == KILN_OK,
          "typed OOM: %s", kiln_last_message(ctx));
    /* garbage tensors are collected when the budget is reached (the pressure hook) */
    CHECK(kiln_memory_set_budget(ctx, "sim", 9 << 20) == KILN_OK, "set budget");
    CHECK(kiln_run_string(ctx, "for i = 1, 40 do local t = kiln.zeros({1024, 1024}) end") == KILN_OK,
          "40 x 4 MiB of garbage in a 9 MiB budget: %s", kiln_last_message(ctx));
    CHECK(kiln_memory_set_budget(ctx, "sim", old_budget) == KILN_OK, "set budget");
    CHECK(kiln_memory_set_budget(ctx, "warp9", 1) == KILN_ERR_ARG, "budget of an unknown device");
    CHECK(kiln_run_string(ctx, "big = kiln.zeros({1024, 1024})") == KILN_OK, "fits now: %s", kiln_last_message(ctx));
    CHECK(kiln_memory_stats(ctx, "sim", &m) == KILN_OK && m.allocated >= 4u << 20 && m.n_ooms >= 1,
          "allocated %llu ooms %llu", (unsigned long long)m.allocated, (unsigned long long)m.n_ooms);
    const char *s = kiln_memory_summary(ctx);
    CHECK(s && contains(s, "sim") && contains(s, "cpu"), "summary '%s'", s ? s : "(null)");
    CHECK(kiln_run_string(ctx, "error('not memory')") == KILN_ERR_SCRIPT, "script error");
    CHECK(kiln_memory_last_oom(ctx, &oi) == KILN_ERR_STATE && oi.device[0] == '\0',
          "a failure that is not an OOM leaves no OOM details");
    kiln_close(ctx);
    CHECK(kiln_memory_summary(NULL) == NULL, "summary without a context");
}

/* ---------------------------------------------------------------- config */

static void t_parse_size(void)
{
    static const struct { const char *text; uint64_t bytes; } ok[] = {
        {"100000", 100000}, {"6G", 6ull << 30}, {"512M", 512ull << 20}, {"1.5GiB", 3ull << 29},
        {"2 KB", 2048}, {"1k", 1024}, {" 3T ", 3ull << 40}, {"0", 0}, {"10B", 10},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        uint64_t b = 1;
        CHECK(kiln_parse_size(ok[i].text, &b) == KILN_OK && b == ok[i].bytes, "'%s' -> %llu (expected %llu)",
              ok[i].text, (unsigned long long)b, (unsigned long long)ok[i].bytes);
    }
    static const char *const bad[] = {"", "G", "6X", "-1", "0x10", "inf", "nan", "1.5.2G", "6 G B x", "1e3"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        uint64_t b = 7;
        CHECK(kiln_parse_size(bad[i], &b) == KILN_ERR_ARG && b == 7, "'%s' accepted", bad[i]);
    }
    CHECK(contains(kiln_last_message(NULL), "1e3"), "message '%s'", kiln_last_message(NULL));
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    /* the same parser from Lua, and kiln.configure naming the bad field */
    CHECK(kiln_run_string(ctx, "assert(kiln.parse_size('1.5GiB') == 3 << 29 and kiln.parse_size(42) == 42)\n"
                               "assert(not pcall(kiln.parse_size, '6X'))\n"
                               "local ok, e = pcall(kiln.configure, {budget = '6X'})\n"
                               "assert(not ok and e.kind == 'usage' and e.field == 'budget', tostring(e))\n"
                               "ok, e = pcall(kiln.configure, {devcie = 'cpu'})\n"
                               "assert(not ok and e.field == 'devcie' and tostring(e):find('device'), tostring(e))\n"
                               "ok, e = pcall(kiln.configure, {threads = 9999})\n"
                               "assert(not ok and e.field == 'threads', tostring(e))\n"
                               "kiln.configure{quiet = false}; assert(not kiln.quiet())\n"
                               "kiln.configure{quiet = true}; assert(kiln.quiet())\n"
                               "kiln.configure{device = 'sim', mode = 'auto'}\n"
                               "assert(kiln.default_device() == 'sim')\n"
                               "kiln.configure{device = 'cpu'}") == KILN_OK,
          "configure: %s", kiln_last_message(ctx));
    kiln_close(ctx);
}

/* kiln_config.size: a shorter config (an older header's) is read up to its size, a
 * larger one (a newer header's) refused; KILN_VERSION_NUMBER is checked at open. */
static void t_config_size_and_version(void)
{
    kiln_config cfg = KILN_CONFIG_INIT;
    CHECK(cfg.size == sizeof(kiln_config) && cfg.device == NULL && cfg.memory_budget == 0, "KILN_CONFIG_INIT");
    cfg.log_level = KILN_LOG_OFF;
    cfg.precision = "f8"; /* a field the shorter config does not have: never read */
    cfg.size = offsetof(kiln_config, precision);
    kiln_ctx *ctx = NULL;
    CHECK(kiln_open(&cfg, &ctx) == KILN_OK && ctx, "shorter config: %s", kiln_last_message(NULL));
    kiln_close(ctx);
    ctx = NULL;
    cfg.size = sizeof cfg;
    CHECK(kiln_open(&cfg, &ctx) == KILN_ERR_ARG && !ctx, "full config: the precision field is read");
    CHECK(contains(kiln_last_message(NULL), "config.precision") && contains(kiln_last_message(NULL), "f8"),
          "message '%s'", kiln_last_message(NULL));
    cfg.size = 0; /* = {0}: the size of the header kiln_open was compiled with */
    CHECK(kiln_open(&cfg, &ctx) == KILN_ERR_ARG && !ctx, "size 0: the whole config is read");

    /* a newer header's config: larger than this library knows */
    unsigned char bigger[sizeof(kiln_config) + 16];
    memset(bigger, 0, sizeof bigger);
    kiln_config small = KILN_CONFIG_INIT;
    small.size = sizeof bigger;
    memcpy(bigger, &small, sizeof small);
    kiln_status st = kiln_open((const kiln_config *)(void *)bigger, &ctx);
    CHECK(st == KILN_ERR_UNSUPPORTED && !ctx, "larger config gave %s", kiln_status_string(st));
    CHECK(contains(kiln_last_message(NULL), "config.size") && contains(kiln_last_message(NULL), "newer kiln.h"),
          "message '%s'", kiln_last_message(NULL));
    small.size = 3;
    CHECK(kiln_open(&small, &ctx) == KILN_ERR_ARG && !ctx, "a size smaller than any kiln_config");

    /* versions: the patch may differ; the minor of a 0.x, or the major, may not */
    CHECK(kiln_open_v(KILN_VERSION_NUMBER + 1, NULL, &ctx) == KILN_OK && ctx, "another patch version: %s",
          kiln_last_message(NULL));
    kiln_close(ctx);
    ctx = NULL;
    char want[32];
    snprintf(want, sizeof want, "kiln.h %d.%d.0", KILN_VERSION_MAJOR, KILN_VERSION_MINOR + 1);
    st = kiln_open_v(KILN_VERSION_NUMBER - KILN_VERSION_PATCH + 100, NULL, &ctx);
    CHECK(st == KILN_ERR_UNSUPPORTED && !ctx, "a host of the next minor version gave %s", kiln_status_string(st));
    CHECK(contains(kiln_last_message(NULL), want) && contains(kiln_last_message(NULL), kiln_version()),
          "message '%s' names both versions", kiln_last_message(NULL));
    snprintf(want, sizeof want, "kiln.h %d.", KILN_VERSION_MAJOR + 1);
    CHECK(kiln_open_v(KILN_VERSION_NUMBER + 10000, &cfg, &ctx) == KILN_ERR_UNSUPPORTED && !ctx &&
              contains(kiln_last_message(NULL), want),
          "another major version: '%s'", kiln_last_message(NULL));
    CHECK(kiln_open_v(0, NULL, &ctx) == KILN_ERR_UNSUPPORTED && !ctx, "no version");
}

/* A refused setting comes back as data: the config field and the reason alone, the
 * same from kiln.configure (err.field, err.detail). */
static void t_settings_field_as_data(void)
{
    static const struct { const char *field; const char *part; } cases[] = {
        {"mode", "turbo"}, {"memory_budget", "too large"}, {"threads", "9999"}, {"trace", "no-such-dir"},
        {"precision", "f8"}, {"device", "warp9"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char trace[300];
        snprintf(trace, sizeof trace, "%s/no-such-dir/trace.json", tmpdir);
        kiln_config cfg = KILN_CONFIG_INIT;
        cfg.log_level = KILN_LOG_OFF;
        const char *f = cases[i].field;
        if (!strcmp(f, "mode")) cfg.mode = "turbo";
        if (!strcmp(f, "memory_budget")) cfg.memory_budget = UINT64_MAX;
        if (!strcmp(f, "threads")) cfg.threads = 9999;
        if (!strcmp(f, "trace")) cfg.trace = trace;
        if (!strcmp(f, "precision")) cfg.precision = "f8";
        if (!strcmp(f, "device")) cfg.device = "warp9";
        kiln_ctx *ctx = NULL;
        kiln_status st = kiln_open(&cfg, &ctx);
        const char *detail = NULL;
        const char *field = kiln_last_config_field(NULL, &detail);
        CHECK(st == KILN_ERR_ARG && !ctx, "%s: %s", f, kiln_status_string(st));
        CHECK(field && strcmp(field, f) == 0, "field %s, expected %s", field ? field : "(null)", f);
        CHECK(detail && contains(detail, cases[i].part) && !contains(detail, "config."), "%s: detail '%s'", f,
              detail ? detail : "(null)");
        char prefix[64];
        snprintf(prefix, sizeof prefix, "kiln_open: config.%s: ", f);
        CHECK(strncmp(kiln_last_message(NULL), prefix, strlen(prefix)) == 0 && contains(kiln_last_message(NULL), detail),
              "message '%s'", kiln_last_message(NULL));
        if (ctx) kiln_close(ctx);
    }
    kiln_config cfg = KILN_CONFIG_INIT;
    cfg.log_level = (kiln_log_level)9;
    kiln_ctx *ctx = NULL;
    const char *detail = NULL;
    CHECK(kiln_open(&cfg, &ctx) == KILN_ERR_ARG && kiln_last_config_field(NULL, &detail) == NULL && detail &&
              *detail == '\0',
          "a failure that is no setting names no field");
    ctx = open_quiet(NULL);
    CHECK(ctx && kiln_last_config_field(NULL, NULL) == NULL, "after a success: no field");
    if (!ctx) return;
    CHECK(kiln_last_config_field(ctx, &detail) == NULL, "a context's field");
    CHECK(kiln_run_string(ctx, "local ok, e = pcall(kiln.configure, {mode = 'turbo'})\n"
                               "assert(not ok and e.field == 'mode' and e.detail:find('turbo') and\n"
                               "       not e.detail:find('^mode') and e.message == 'mode: ' .. e.detail, tostring(e))\n"
                               "ok, e = pcall(kiln.configure, {precision = 'f8'})\n"
                               "assert(not ok and e.field == 'precision' and e.detail:find('f8'), tostring(e))\n"
                               "ok, e = pcall(kiln.configure, {device = 'sim', budget = '6X'})\n"
                               "assert(not ok and e.field == 'budget' and kiln.default_device() == 'cpu', tostring(e))\n"
                               "local before = kiln.mem.stats('sim').budget\n"
                               "kiln.configure{device = 'sim', budget = '3M', precision = 'auto'}\n"
                               "assert(kiln.mem.stats('sim').budget == 3 << 20 and kiln.default_device() == 'sim')\n"
                               "kiln.mem.set_budget('sim', 5 << 20)\n"
                               "assert(kiln.mem.stats('sim').budget == 5 << 20)\n"
                               "kiln.configure{budget = before}\n"
                               "assert(kiln.mem.stats('sim').budget == before)\n"
                               "kiln.configure{device = 'cpu'}") == KILN_OK,
          "configure: %s", kiln_last_message(ctx));
    kiln_close(ctx);
}

static void t_config_terminal_fields(void)
{
    /* zero: a library (quiet, os.exit ends the script); set: as the kiln program */
    kiln_ctx *ctx = open_quiet(NULL);
    if (!ctx) return;
    CHECK(kiln_run_string(ctx, "assert(kiln.quiet())") == KILN_OK, "embedded contexts are quiet: %s",
          kiln_last_message(ctx));
    kiln_close(ctx);
    kiln_config cfg = {0};
    cfg.log_level = KILN_LOG_OFF;
    cfg.verbose = 1;
    char trace[300];
    snprintf(trace, sizeof trace, "%s/trace.json", tmpdir);
    remove(trace);
    cfg.trace = trace;
    ctx = NULL;
    CHECK(kiln_open(&cfg, &ctx) == KILN_OK, "open: %s", kiln_last_message(NULL));
    if (!ctx) return;
    CHECK(kiln_run_string(ctx, "assert(not kiln.quiet()) assert(kiln.trace.active())") == KILN_OK,
          "verbose and tracing: %s", kiln_last_message(ctx));
    kiln_close(ctx);
    struct stat st;
    CHECK(stat(trace, &st) == 0 && st.st_size > 0, "kiln_close wrote the trace %s", trace);
    remove(trace);
    cfg.trace = "/nonexistent-dir/trace.json";
    ctx = NULL;
    CHECK(kiln_open(&cfg, &ctx) == KILN_ERR_ARG && contains(kiln_last_message(NULL), "config.trace"),
          "unwritable trace: '%s'", kiln_last_message(NULL));
}

/* ---------------------------------------------------------------- pressure hook
 * Each context's garbage is collected under memory pressure on the thread running
 * it, and no context's hook replaces another's. A budget of 10 MiB on sim holds two
 * tensors of 4 MiB, not four. */

#define BIG "kiln.zeros({1024, 1024})" /* 4 MiB on the context's default device, sim */

/* Runs code directly on the context's state (as the kiln program does); 1 if it ran. */
static int run_direct(kiln_ctx *ctx, const char *code, char *err, size_t n)
{
    lua_State *L = kiln_lua_state(ctx);
    int ok = luaL_loadstring(L, code) == LUA_OK && lua_pcall(L, 0, 0, 0) == LUA_OK;
    if (!ok) {
        snprintf(err, n, "%s", luaL_tolstring(L, -1, NULL));
        lua_pop(L, 2);
    }
    return ok;
}

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int stage;        /* 1: the thread's garbage is made; 2: the main thread is done */
    int garbage_ok, alloc_ok;
    char err[256];
} pressure_job;

static void stage_set(pressure_job *j, int stage)
{
    pthread_mutex_lock(&j->lock);
    j->stage = stage;
    pthread_cond_broadcast(&j->cond);
    pthread_mutex_unlock(&j->lock);
}

static void stage_wait(pressure_job *j, int stage)
{
    pthread_mutex_lock(&j->lock);
    while (j->stage < stage) pthread_cond_wait(&j->cond, &j->lock);
    pthread_mutex_unlock(&j->lock);
}

/* Another thread: its context leaves 8 MiB of garbage, waits, then needs 8 MiB: only
 * a collection of its own state makes room. */
static void *pressure_thread(void *arg)
{
    pressure_job *j = arg;
    kiln_ctx *ctx = open_quiet("sim");
    if (ctx) {
        j->garbage_ok = run_direct(ctx, "collectgarbage() for i = 1, 2 do local t = " BIG " end", j->err,
                                   sizeof j->err);
    }
    stage_set(j, 1);
    stage_wait(j, 2);
    if (ctx) {
        j->alloc_ok = run_direct(ctx, "local a, b = " BIG ", " BIG, j->err, sizeof j->err);
        kiln_close(ctx);
    }
    return NULL;
}

static void t_pressure_per_context(void)
{
    kiln_memory_info m;
    CHECK(kiln_memory_stats(NULL, "sim", &m) == KILN_OK, "stats");
    uint64_t old_budget = m.budget;
    CHECK(kiln_memory_set_budget(NULL, "sim", 10 << 20) == KILN_OK, "budget");
    const char *loop = "for i = 1, 40 do local t = " BIG " end";
    char err[256] = "";

    /* a second context opened (and closed) after the first leaves the first's hook */
    kiln_ctx *a = open_quiet("sim"), *b = open_quiet("sim");
    if (b) kiln_close(b);
    if (a) {
        CHECK(kiln_run_string(a, loop) == KILN_OK, "after another context closed: %s", kiln_last_message(a));
        CHECK(run_direct(a, loop, err, sizeof err), "direct on the opening thread: %s", err);
        run_direct(a, "collectgarbage()", err, sizeof err); /* its last tensors */
    }

    /* the garbage of a context on another thread is not collected here, and is there */
    pressure_job j = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, pressure_thread, &j) == 0, "thread");
    stage_wait(&j, 1);
    CHECK(j.garbage_ok, "garbage: %s", j.err);
    if (a) {
        CHECK(!run_direct(a, "local a, b = " BIG ", " BIG, err, sizeof err) && contains(err, "sim"),
              "the other thread's garbage was collected from this thread (err '%s')", err);
    }
    stage_set(&j, 2);
    pthread_join(th, NULL);
    CHECK(j.alloc_ok, "the other thread's own collection made room: %s", j.err);

    /* a context moved to another thread: its calls collect it there */
    if (a) {
        CHECK(kiln_run_string(a, loop) == KILN_OK, "after the thread: %s", kiln_last_message(a));
        kiln_close(a);
    }
    CHECK(kiln_memory_set_budget(NULL, "sim", old_budget) == KILN_OK, "budget back");
}

/* Closing frees what the scripts kept in globals, on every device. */
static void t_close_frees_everything(void)
{
    kiln_ctx *ctx = open_quiet("sim");
    if (!ctx) return;
    CHECK(kiln_run_string(ctx, "keep = {kiln.zeros({256, 256}), kiln.ones({64}):to('cpu'), kiln.randn({3, 3})}\n"
                               "view = keep[1]:narrow(1, 2, 10)") == KILN_OK,
          "script: %s", kiln_last_message(ctx));
    CHECK(allocated("sim") >= 256 * 256 * 4, "sim allocated %llu", (unsigned long long)allocated("sim"));
    kiln_ctx *other = open_quiet(NULL); /* a second context in the same thread */
    if (other) {
        CHECK(kiln_run_string(other, "assert(keep == nil)") == KILN_OK, "contexts share globals");
        kiln_close(other);
    }
    kiln_close(ctx);
    kiln_memory_info m;
    for (int i = 0; kiln_device_name_at(i); i++) {
        CHECK(kiln_memory_stats(NULL, kiln_device_name_at(i), &m) == KILN_OK, "stats");
        CHECK(m.allocated == 0, "%s: %llu bytes allocated after close", m.device, (unsigned long long)m.allocated);
        CHECK(m.reserved == 0, "%s: %llu bytes reserved after close", m.device, (unsigned long long)m.reserved);
    }
}

/* ---------------------------------------------------------------- PNG */

static void t_png_roundtrip(void)
{
    char path[512];
    snprintf(path, sizeof path, "%s/img.png", tmpdir);
    unsigned char px[5 * 3 * 4];
    for (int i = 0; i < (int)sizeof px; i++) px[i] = (unsigned char)(i * 13 + 1);
    kiln_image im = {5, 3, 4, KILN_PIXEL_U8, 0, px};
    CHECK(kiln_image_save_png(NULL, &im, path) == KILN_OK, "save: %s", kiln_last_message(NULL));
    kiln_image back = {0};
    CHECK(kiln_image_load_png(NULL, path, KILN_PIXEL_U8, &back) == KILN_OK, "load: %s", kiln_last_message(NULL));
    CHECK(back.width == 5 && back.height == 3 && back.channels == 4 && back.data &&
              memcmp(back.data, px, sizeof px) == 0,
          "round trip differs");
    kiln_image_free(&back);
    CHECK(kiln_image_load_png(NULL, path, KILN_PIXEL_F32, &back) == KILN_OK, "load f32");
    if (back.data) CHECK_NEAR(((float *)back.data)[1], px[1] / 255.0, 1e-6);
    kiln_image_free(&back);
    CHECK(kiln_image_load_png(NULL, "/nonexistent.png", KILN_PIXEL_U8, &back) != KILN_OK, "missing file");
    CHECK(contains(kiln_last_message(NULL), "/nonexistent.png"), "message '%s'", kiln_last_message(NULL));
    im.channels = 0;
    CHECK(kiln_image_save_png(NULL, &im, path) == KILN_ERR_ARG, "0 channels");
    remove(path);
}

int main(void)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kiln_test_embed_XXXXXX");
    if (!mkdtemp(tmpdir)) snprintf(tmpdir, sizeof tmpdir, "/tmp");
    RUN(t_status_strings_match_runtime);
    RUN(t_open_run_close);
    RUN(t_open_bad_config);
    RUN(t_script_errors);
    RUN(t_run_file);
    RUN(t_script_path);
    RUN(t_call_images);
    RUN(t_call_errors);
    RUN(t_progress_and_cancel);
    RUN(t_cancel_from_another_thread);
    RUN(t_sampler_progress_and_cancel);
    RUN(t_bare_sampler_progress);
    RUN(t_preview_callback);
    RUN(t_log_and_no_stdout);
    RUN(t_memory_and_oom);
    RUN(t_png_roundtrip);
    RUN(t_parse_size);
    RUN(t_config_size_and_version);
    RUN(t_settings_field_as_data);
    RUN(t_config_terminal_fields);
    RUN(t_pressure_per_context);
    RUN(t_close_frees_everything); /* last: every context is closed by now */
    char path[600];
    snprintf(path, sizeof path, "%s/script.lua", tmpdir);
    remove(path);
    snprintf(path, sizeof path, "%s/stdout.txt", tmpdir);
    remove(path);
    rmdir(tmpdir);
    return test_summary();
}

/* kiln.h - the C API of kiln, and its only public header: open a context (a Lua 5.4
 * state with the kiln runtime loaded), run scripts, call Lua functions with images
 * in and out, receive progress and log messages, cancel, read memory statistics.
 *
 *   kiln_config cfg = KILN_CONFIG_INIT;       defaults (= {0} works too)
 *   cfg.device = "cuda:0"; cfg.memory_budget = 6ull << 30;
 *   kiln_ctx *ctx;
 *   if (kiln_open(&cfg, &ctx) != KILN_OK) { puts(kiln_last_message(NULL)); return; }
 *   kiln_run_file(ctx, "tool.lua", 0, NULL);  defines a global `generate`
 *   const char *args[] = {"a red fox", "20"};
 *   kiln_image img = {0};                     img.format: the pixels wanted back
 *   if (kiln_call(ctx, "generate", NULL, 0, args, 2, &img) == KILN_OK) { ...; kiln_image_free(&img); }
 *   kiln_close(ctx);
 *
 * Errors: every function that can fail returns a kiln_status (kiln_status.h, installed
 * beside this header); the message of the last failure is kiln_last_message(ctx). The library never exits the process and
 * never writes to stdout: a script's print() goes to the log callback (unless the
 * config's print_stdout / real_exit ask for a terminal program's ways).
 *
 * Threads: one context per thread. A context is used by one thread at a time (it may
 * move between threads between calls); kiln_cancel is the only function that may be
 * called from any thread at any time (kiln_suspend, kiln_resume and kiln_suspend_info
 * from any thread but the running call's). Contexts in different threads may run at once:
 * they share the devices, their budgets and the CPU thread pool (whose jobs run one
 * after another). kiln_memory_stats may be called from any thread. When an allocation
 * does not fit a budget, the runtime collects the Lua garbage of the context running
 * on the allocating thread (the context of the kiln_* call, else the last context
 * opened on that thread), never another thread's.
 *
 * Callbacks (progress, preview, log) run on the thread of the call that triggered them. From
 * a callback a host may call kiln_cancel, kiln_memory_stats and kiln_memory_summary;
 * kiln_run_* and kiln_call fail there with KILN_ERR_STATE, kiln_close is ignored.
 */
#ifndef KILN_H
#define KILN_H

#include <stddef.h>
#include <stdint.h>

#include "kiln_status.h"

/* The version of this header and of the library it came with (kiln_version()). The
 * library's file is libkiln.so.MAJOR.MINOR.PATCH with the SONAME libkiln.so.MAJOR;
 * kiln_open refuses a host built with a header whose MAJOR differs (or, while MAJOR is
 * 0, whose MINOR differs: 0.x minor versions change the ABI). */
#define KILN_VERSION_MAJOR 0
#define KILN_VERSION_MINOR 2
#define KILN_VERSION_PATCH 0
/* 0.2.0 is 200, 1.3.12 is 10312: comparable with <, as a preprocessor number. */
#define KILN_VERSION_NUMBER (KILN_VERSION_MAJOR * 10000 + KILN_VERSION_MINOR * 100 + KILN_VERSION_PATCH)

/* Marks what libkiln exports: the functions below (luaopen_kiln included); everything
 * else in the library is hidden. A host may define it first (e.g. as an import attribute). */
#ifndef KILN_API
#if defined(__GNUC__)
#define KILN_API __attribute__((visibility("default")))
#else
#define KILN_API
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- status codes (kiln_status.h), versions ------------------------------------ */

/* "ok", "argument", ..., "cancelled", "script". */
KILN_API const char *kiln_status_string(kiln_status status);
/* "0.2.0": KILN_VERSION_MAJOR.MINOR.PATCH of the library (which may be newer than
 * the header a host was built with). */
KILN_API const char *kiln_version(void);
/* The same string as kiln_version() (its older name). */
KILN_API const char *kiln_version_string(void);

/* ---- images ---------------------------------------------------------------- */

typedef enum { KILN_PIXEL_U8 = 0, KILN_PIXEL_F32 = 1 } kiln_pixel_format;

/* Interleaved pixels, top row first. Lua sees an image as an f32 tensor
 * [1, channels, height, width] with values in [0, 1] (8-bit values are divided by
 * 255); images coming back are clamped to [0, 1] and rounded when 8-bit. */
typedef struct {
    int width, height;
    int channels;             /* 1 gray, 2 gray + alpha, 3 RGB, 4 RGBA */
    kiln_pixel_format format; /* for kiln_call's output: the format wanted (0 = 8-bit) */
    size_t stride;            /* bytes from one row to the next; 0 = rows packed */
    void *data;
} kiln_image;

/* Frees the pixels of an image the library made (kiln_call's output,
 * kiln_image_load_png) and zeroes the struct; NULL and empty images are fine. */
KILN_API void kiln_image_free(kiln_image *image);

/* ---- contexts -------------------------------------------------------------- */

typedef struct kiln_ctx kiln_ctx;

/* ORDER LOG: a message is delivered when its level <= the context's log level */
typedef enum {
    KILN_LOG_OFF = -1,
    KILN_LOG_DEFAULT = 0, /* = KILN_LOG_INFO */
    KILN_LOG_ERROR = 1,
    KILN_LOG_WARN = 2,    /* Lua warnings (warn(), errors in finalizers) */
    KILN_LOG_INFO = 3,    /* a script's print() */
    KILN_LOG_DEBUG = 4    /* the traceback of every failed call */
} kiln_log_level;

/* step counts from 1 to total (total 0: unknown); message says what is running
 * ("sample", "decode tiles"), never NULL. */
typedef void (*kiln_progress_fn)(void *user, int step, int total, const char *message);
/* message has no trailing newline. */
typedef void (*kiln_log_fn)(void *user, kiln_log_level level, const char *message);
/* A picture of a sampling in progress (the sampler's current prediction of the final
 * image), after sampler step `step` of `total`: 8-bit RGB, packed. image and its pixels
 * are valid only during the call (copy what you keep). */
typedef void (*kiln_preview_fn)(void *user, int step, int total, const kiln_image *image);

/* All fields may be zero (NULL config: all zero). Devices and their budgets belong
 * to the process: memory_budget, threads and precision change them for every context.
 * New fields are added at the end only; size tells the library which fields the host
 * knows: a host built with an older header passes a smaller size and the fields past it
 * take their defaults; a size larger than the library's (a header newer than the
 * library) is refused. Start from KILN_CONFIG_INIT. */
typedef struct {
    size_t size;               /* sizeof(kiln_config) of the host's header (KILN_CONFIG_INIT
                                  sets it); 0: the size of the header kiln_open was compiled
                                  with */
    const char *device;        /* default device of new tensors: "cpu", "sim", "cuda:0";
                                  NULL = "cpu" */
    uint64_t memory_budget;    /* budget of that device in bytes; 0 = leave it as it is */
    const char *mode;          /* memory mode "high", "normal", "low", "none"; NULL = "normal" */
    int threads;               /* CPU threads; 0 = leave as is (KILN_THREADS, else one per core) */
    kiln_log_level log_level;  /* default INFO */
    kiln_log_fn log;           /* NULL: messages go to stderr, prefixed "kiln: " */
    void *log_user;
    const char *script_path;   /* ';'-separated folders holding kiln/NAME.lua, searched before
                                  the scripts built into the library; NULL: $KILN_PATH;
                                  "": the built-in scripts only */
    int ignore_env;            /* nonzero: ignore the environment: LUA_PATH, LUA_CPATH,
                                  KILN_PATH, and the kernels' KILN_* tunables (for the whole
                                  process from then on: the kernels are the process's) */
    const char *trace;         /* file to write a trace to (chrome://tracing, Perfetto), from
                                  kiln_open until kiln_close; NULL: none */

    /* A host that is itself a terminal program (the kiln program is one) sets these;
       all zero is a library inside another program: nothing on stdout, nothing ends
       the process, progress only through the callback. */
    int verbose;               /* nonzero: progress bars and summaries on stderr, as the kiln
                                  program shows them (kiln.quiet() is false); 0: quiet */
    int print_stdout;          /* nonzero: print() writes to stdout, as stock Lua's does;
                                  0: each print() is an INFO log message */
    int real_exit;             /* nonzero: os.exit() ends the process, as stock Lua's does
                                  (kiln_close is not called); 0: it ends the script */
    int lua_warnings;          /* nonzero: Lua's own warnings (stderr, "Lua warning: ", off
                                  until warn("@on")); 0: WARN log messages, on */
    int source_tree;           /* nonzero, with script_path NULL and KILN_PATH unset: when the
                                  current folder is kiln's source tree, its scripts/ come first
                                  (edited scripts run without a rebuild) */

    /* since 0.2 */
    const char *precision;     /* arithmetic of the networks: "f32", "bf16", "f16", "auto" (each
                                  device's own); NULL = leave as is */
} kiln_config;

/* A config with its size set and every other field zero (the defaults):
 *   kiln_config cfg = KILN_CONFIG_INIT; */
#define KILN_CONFIG_INIT {.size = sizeof(kiln_config)}

/* "6G", "512M", "1.5GiB", "100000" -> bytes, in binary units (K = 1024), as a
 * memory_budget from a host's settings; KILN_ERR_ARG when text is not a size. The
 * same parser as kiln.parse_size. */
KILN_API kiln_status kiln_parse_size(const char *text, uint64_t *bytes);

/* Opens a context: a Lua state with the standard libraries and the kiln module (the
 * global `kiln`), configured by config. On failure *out is NULL and the message is
 * kiln_last_message(NULL); a bad runtime option (device, mode, memory_budget,
 * threads, trace, precision) is KILN_ERR_ARG with a message "kiln_open: config.FIELD:
 * why", its field and reason also as data (kiln_last_config_field). A library of
 * another version than the host's header (see KILN_VERSION_MAJOR) is
 * KILN_ERR_UNSUPPORTED, the message naming both versions; so is a config.size larger
 * than the library knows. os.exit() in a script ends the script, not the process
 * (unless real_exit).
 * kiln_open is a macro passing the header's version to kiln_open_v, the exported
 * function; a host that loads the library by hand calls kiln_open_v with the version
 * it was written for. */
KILN_API kiln_status kiln_open_v(int version, const kiln_config *config, kiln_ctx **out);
#define kiln_open(config, out) kiln_open_v(KILN_VERSION_NUMBER, (config), (out))
/* Stops the config's trace (writing its file), closes the Lua state, which frees every
 * tensor and model it held, and returns the devices' cached blocks. NULL is fine. */
KILN_API void kiln_close(kiln_ctx *ctx);

/* Runs a Lua file with `arg` set as the kiln program sets it (arg[0] = path,
 * arg[1..argc] = argv) and argv as its `...`. os.exit(0) / os.exit(true) is a
 * normal end; another status is KILN_ERR_SCRIPT. */
KILN_API kiln_status kiln_run_file(kiln_ctx *ctx, const char *path, int argc, const char *const *argv);
/* Runs a chunk of Lua code. */
KILN_API kiln_status kiln_run_string(kiln_ctx *ctx, const char *code);

/* Calls the global Lua function `function` ("generate", or a dotted path such as
 * "tools.upscale") as function(image_1, ..., image_n, arg_1, ..., arg_m): images
 * become f32 tensors [1, C, H, W] on the cpu, args Lua strings. When out is not NULL
 * the first result must be an image tensor ([1, C, H, W], [C, H, W] or [H, W], any
 * device or dtype, C = 1..4); *out receives it in out->format (set it before the
 * call; 0 = 8-bit), packed, to be freed with kiln_image_free. On failure *out is
 * left as it was. Tensors the call made and did not store are freed when it returns,
 * cancelled or not. */
KILN_API kiln_status kiln_call(kiln_ctx *ctx, const char *function, const kiln_image *images, int n_images,
                               const char *const *args, int n_args, kiln_image *out);

/* Asks the running call (kiln_run_*, kiln_call) to stop: it returns KILN_ERR_CANCELLED
 * at the next progress report (kiln.progress) or within a few thousand Lua
 * instructions; a single long kernel finishes first. Callable from any thread and
 * from the progress callback. Each call starts with the request cleared. */
KILN_API void kiln_cancel(kiln_ctx *ctx);

/* ---- suspend and resume -------------------------------------------------------- */

/* Parks the running call (kiln_run_*, kiln_call) of ctx so that the devices' memory is
 * free for the host (a game that needs its VRAM back now): at the call's next suspend
 * point (kiln.suspend_point: between network blocks, sampler steps and tiles; about one
 * block's time) every byte it holds on sim / cuda devices (weights, latent, sampler
 * history, residuals, the allocator's cache and kernel workspaces) moves to host
 * memory and the call waits. The state stays as it was (step, RNG position, history),
 * so after kiln_resume the picture is bit-identical to an uninterrupted run. Callable
 * from any thread but the call's own; blocks until parked and returns KILN_OK (also
 * when already parked); KILN_ERR_STATE when no call is running, when called on the
 * call's own thread (its callbacks: it would wait for itself), when the call ended
 * before it parked, or when kiln_resume withdrew the request; another status
 * when parking failed (host memory: the call goes on unparked). Only this context's
 * call parks; other contexts using the same devices at the same time are not stopped
 * and must not be running then. Messages: kiln_last_message(NULL), on the caller's
 * thread. */
KILN_API kiln_status kiln_suspend(kiln_ctx *ctx);
/* Lets a parked call go on: blocks until its bytes are back on their devices (new
 * blocks of the same sizes) and returns KILN_OK; KILN_ERR_OOM when a device's budget
 * no longer has room for them (the call then fails with that error). Withdraws a
 * kiln_suspend not yet served; KILN_OK when nothing is parked. kiln_cancel during a
 * park wakes the call into the cancel (its bytes come back first, then it returns
 * KILN_ERR_CANCELLED). Any thread. */
KILN_API kiln_status kiln_resume(kiln_ctx *ctx);

typedef struct {
    uint64_t parks;          /* times parked since kiln_open */
    uint64_t bytes;          /* bytes moved to the host at the last park */
    double park_seconds;     /* last park: kiln_suspend called to parked */
    double resume_seconds;   /* last resume: kiln_resume called to running */
    int parked;              /* 1 while parked */
} kiln_suspend_stats;
/* Latencies of the last park; any thread. */
KILN_API kiln_status kiln_suspend_info(kiln_ctx *ctx, kiln_suspend_stats *out);

/* The progress callback (fn NULL: none): scripts report with kiln.progress(step,
 * total, message); the samplers do so every step. */
KILN_API void kiln_set_progress(kiln_ctx *ctx, kiln_progress_fn fn, void *user);
/* The preview callback (fn NULL: none): while the pipelines (kiln.pipeline) sample, fn
 * receives a preview every `every` steps (and after the last; every <= 0 means 1), made
 * by the run's previewer: the latent->RGB projection (latent size, the default) or
 * TAESD (full size; the pipelines' option previewer = "taesd"). It is called on the
 * thread of the running kiln_call / kiln_run_*, between two sampler steps, as the
 * progress callback; the run waits for it, so keep it short. A script making its own
 * loop hands pictures to it with kiln.preview_image(step, total, image). */
KILN_API void kiln_set_preview(kiln_ctx *ctx, kiln_preview_fn fn, void *user, int every);
/* Replaces the config's log callback (fn NULL: stderr). */
KILN_API void kiln_set_log(kiln_ctx *ctx, kiln_log_fn fn, void *user);

/* The message of the last failed call on ctx ("" after a success). ctx NULL: this
 * thread's message of the last call made without a context (kiln_open). Valid until
 * the next call on ctx. */
KILN_API const char *kiln_last_message(const kiln_ctx *ctx);
/* The Lua traceback of the last failed call ("" when none). */
KILN_API const char *kiln_last_traceback(const kiln_ctx *ctx);
/* When the last failure was a refused setting (kiln_open's config fields): the field's
 * name as kiln_config spells it ("memory_budget", "device", "threads", ...), and in
 * *detail (when detail is not NULL) the reason alone ("invalid ..."), without the
 * message's "kiln_open: config.FIELD: ", for a host that reports it its own way (the
 * kiln program says "--vram"). NULL (and *detail "") when the last failure was about
 * no field. ctx NULL: this thread's last call without a context. Valid as
 * kiln_last_message. */
KILN_API const char *kiln_last_config_field(const kiln_ctx *ctx, const char **detail);

/* ---- memory ---------------------------------------------------------------- */

typedef struct {
    char device[16];         /* "cpu", "sim", "cuda:0" */
    uint64_t allocated;      /* bytes in live tensors and weights */
    uint64_t peak_allocated; /* since the device was created (or the last reset_peak) */
    uint64_t reserved;       /* bytes the device holds: allocated + cached free blocks */
    uint64_t peak_reserved;
    uint64_t budget;         /* 0 = unlimited */
    uint64_t total;          /* physical memory of the device; 0 = unknown */
    uint64_t n_allocs, n_frees, n_ooms;
} kiln_memory_info;

/* Statistics of a device (NULL: the config's device). ctx may be NULL. */
KILN_API kiln_status kiln_memory_stats(kiln_ctx *ctx, const char *device, kiln_memory_info *out);
/* Sets a device's budget in bytes (0 = unlimited); it applies to the whole process.
 * Any thread, also while a call runs: a lowered budget takes effect at the call's
 * next suspend point (block, step or tile): unpinned models are evicted, then the
 * running networks stream their weights block by block, then tiled stages choose
 * smaller tiles; allocations made before that point may still use the old budget.
 * A raised budget is used from the next stage on (e.g. a model loaded whole again). */
KILN_API kiln_status kiln_memory_set_budget(kiln_ctx *ctx, const char *device, uint64_t bytes);
/* kiln.mem.summary(): a text table of every device and what holds its memory, for
 * logs and out-of-memory reports. NULL on failure. Valid until the next call. */
KILN_API const char *kiln_memory_summary(kiln_ctx *ctx);
/* The i-th device present (0 = "cpu"), NULL past the last. */
KILN_API const char *kiln_device_name_at(int i);
/* After a call on ctx returned KILN_ERR_OOM: the allocation that did not fit (device,
 * bytes requested, bytes free, budget; device "lua" when Lua's own allocator failed).
 * KILN_ERR_STATE when the last failed call on ctx was not out of memory. */
KILN_API kiln_status kiln_memory_last_oom(const kiln_ctx *ctx, kiln_oom_info *out);

/* ---- PNG files -------------------------------------------------------------- */

/* Reads a PNG (8- or 16-bit, any color type) into *out with its own channel count
 * (1 to 4) in the given format. ctx may be NULL. */
KILN_API kiln_status kiln_image_load_png(kiln_ctx *ctx, const char *path, kiln_pixel_format format,
                                         kiln_image *out);
/* Writes an image as an 8-bit PNG (atomically: a temporary file renamed into place). */
KILN_API kiln_status kiln_image_save_png(kiln_ctx *ctx, const kiln_image *image, const char *path);

/* ---- advanced ---------------------------------------------------------------- */

/* The i-th Lua module built into the library ("kiln.unet"; what require finds when no
 * script folder has it), NULL past the last. */
KILN_API const char *kiln_script_name_at(int i);

/* The context's lua_State, for hosts that register their own functions. Enter Lua
 * only through lua_pcall, leave the stack as you found it, do not close it; kiln_cancel
 * and the progress callback work only inside kiln_run_* and kiln_call. */
struct lua_State;
KILN_API struct lua_State *kiln_lua_state(kiln_ctx *ctx);
/* The Lua module entry point: require "kiln" from a Lua 5.4 interpreter loads it from
 * kiln.so; a host with its own lua_State may call it (luaL_requiref(L, "kiln",
 * luaopen_kiln, 1)) to have the kiln table without a kiln_ctx (no callbacks, no
 * cancel then). */
KILN_API int luaopen_kiln(struct lua_State *L);

#ifdef __cplusplus
}
#endif

#endif /* KILN_H */

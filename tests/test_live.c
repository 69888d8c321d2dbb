/* test_live.c - a host's second thread changing a running call through kiln.h: the
 * budget lowered (and raised again) while txt2img samples on sim, and kiln_suspend /
 * kiln_resume / kiln_cancel of a parked call. The pictures are compared with an
 * undisturbed run's: streaming and parking change no number. Prints the latencies
 * (lowered budget to compliance, suspend to parked, resume to running). */
#define _POSIX_C_SOURCE 200809L
#include "../bindings/kiln.h"
#include "test.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

static const char *MODEL = "examples/models/kiln-shapes.safetensors";
#define MiB (1024ull * 1024ull)
#define LOW (6 * MiB) /* below what the demo UNet's stage holds, above its streamed needs */

static const char *SETUP =
    "ckpt = kiln.load_checkpoint('examples/models/kiln-shapes.safetensors')\n"
    "function gen(steps)\n"
    "  kiln.memory_mode('normal')\n"
    "  local img, lat = kiln.pipeline.txt2img(ckpt, {prompt = 'a red circle on a blue background', seed = 11,\n"
    "    steps = tonumber(steps), width = 64, height = 64, device = 'sim'})\n"
    "  lat:free()\n"
    "  return img\n"
    "end\n";

enum { ACT_NONE, ACT_LOWER, ACT_LOWER_RAISE, ACT_SUSPEND_RESUME, ACT_SUSPEND_CANCEL, ACT_SUSPEND_IN_CALLBACK };

typedef struct {
    kiln_ctx *ctx;
    atomic_int step;     /* last sampler step reported */
    atomic_int done;     /* the call returned */
    int at, at2;         /* act once step >= at (and the second action at at2) */
    int action;
    /* results */
    int acted;
    uint64_t reserved_before, reserved_parked, allocated_parked;
    int step_parked, step_after_wait;
    kiln_status st_suspend, st_resume;
    double suspend_s, resume_s;
} host;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void nap_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void on_progress(void *user, int step, int total, const char *message)
{
    (void)total;
    host *h = user;
    if (strcmp(message, "sample") != 0) return;
    atomic_store(&h->step, step);
    if (h->action == ACT_SUSPEND_IN_CALLBACK && step == 1) h->st_suspend = kiln_suspend(h->ctx);
}

static void on_log(void *user, kiln_log_level level, const char *message)
{
    (void)user;
    (void)level;
    if (message[0] == '#') printf("%s\n", message);
}

static kiln_memory_info sim_stats(void)
{
    kiln_memory_info m;
    memset(&m, 0, sizeof m);
    kiln_memory_stats(NULL, "sim", &m);
    return m;
}

/* Waits until the call reported step n (0 when it ended first). */
static int wait_step(host *h, int n)
{
    while (atomic_load(&h->step) < n) {
        if (atomic_load(&h->done)) return 0;
        nap_ms(1);
    }
    return 1;
}

static void *host_thread(void *arg)
{
    host *h = arg;
    if (!wait_step(h, h->at)) return NULL;
    h->reserved_before = sim_stats().reserved;
    switch (h->action) {
    case ACT_LOWER:
    case ACT_LOWER_RAISE:
        kiln_memory_set_budget(NULL, "sim", LOW);
        h->acted = 1;
        if (h->action == ACT_LOWER_RAISE && wait_step(h, h->at2)) {
            kiln_memory_set_budget(NULL, "sim", 0);
            h->acted = 2;
        }
        break;
    case ACT_SUSPEND_RESUME:
    case ACT_SUSPEND_CANCEL: {
        double t0 = now();
        h->st_suspend = kiln_suspend(h->ctx);
        h->suspend_s = now() - t0;
        if (h->st_suspend != KILN_OK) break;
        kiln_memory_info m = sim_stats();
        h->reserved_parked = m.reserved;
        h->allocated_parked = m.allocated;
        h->step_parked = atomic_load(&h->step);
        nap_ms(30); /* parked means parked: no step meanwhile */
        h->step_after_wait = atomic_load(&h->step);
        h->acted = 1;
        if (h->action == ACT_SUSPEND_CANCEL) {
            kiln_cancel(h->ctx);
            break;
        }
        t0 = now();
        h->st_resume = kiln_resume(h->ctx);
        h->resume_s = now() - t0;
        break;
    }
    default:
        break;
    }
    return NULL;
}

/* Runs gen(steps) with a host thread doing `action`; the picture in *out. */
static kiln_status run_with(kiln_ctx *ctx, host *h, int action, int at, int at2, int steps, kiln_image *out)
{
    memset(h, 0, sizeof *h);
    h->ctx = ctx;
    h->action = action;
    h->at = at;
    h->at2 = at2;
    kiln_set_progress(ctx, on_progress, h);
    pthread_t th;
    int started = action != ACT_NONE && action != ACT_SUSPEND_IN_CALLBACK &&
                  pthread_create(&th, NULL, host_thread, h) == 0;
    char arg[16];
    snprintf(arg, sizeof arg, "%d", steps);
    const char *args[] = {arg};
    memset(out, 0, sizeof *out);
    kiln_status st = kiln_call(ctx, "gen", NULL, 0, args, 1, out);
    atomic_store(&h->done, 1);
    if (started) pthread_join(th, NULL);
    kiln_set_progress(ctx, NULL, NULL);
    return st;
}

static int same_image(const kiln_image *a, const kiln_image *b)
{
    if (!a->data || !b->data || a->width != b->width || a->height != b->height || a->channels != b->channels)
        return 0;
    return memcmp(a->data, b->data, (size_t)a->width * (size_t)a->height * (size_t)a->channels) == 0;
}

static kiln_ctx *ctx;
static kiln_image reference;

static int setup(void)
{
    if (access(MODEL, R_OK) != 0) return 0;
    kiln_config cfg = {0};
    cfg.device = "sim";
    cfg.ignore_env = 1;
    cfg.log = on_log;
    cfg.log_level = KILN_LOG_INFO;
    if (kiln_open(&cfg, &ctx) != KILN_OK) {
        printf("# kiln_open: %s\n", kiln_last_message(NULL));
        return 0;
    }
    kiln_memory_set_budget(NULL, "sim", 0);
    if (kiln_run_string(ctx, SETUP) != KILN_OK) {
        printf("# setup: %s\n", kiln_last_message(ctx));
        return 0;
    }
    host h;
    if (run_with(ctx, &h, ACT_NONE, 0, 0, 6, &reference) != KILN_OK) {
        printf("# reference run: %s\n", kiln_last_message(ctx));
        return 0;
    }
    return 1;
}

#define NEED_SETUP() do { if (!ctx || !reference.data) { SKIP("the demo model is not in examples/models " \
    "(run from the source tree) or it did not run"); return; } } while (0)

/* Checks the allocator's account of the lowered budget from the script's side. */
static void check_compliance(const char *what)
{
    char code[512];
    snprintf(code, sizeof code,
             "local w = kiln.mem.budget_watch('sim')\n"
             "assert(w.compliance_seconds, 'reserved never fell within the lowered budget')\n"
             "assert(w.peak_since <= %llu, 'peak after compliance ' .. w.peak_since)\n"
             "print(string.format('# %s: budget lowered to %%s, compliant after %%.3f ms, peak since %%s', "
             "kiln.format_bytes(%llu), w.compliance_seconds * 1000, kiln.format_bytes(w.peak_since)))\n",
             (unsigned long long)LOW, what, (unsigned long long)LOW);
    CHECK(kiln_run_string(ctx, code) == KILN_OK, "%s: %s", what, kiln_last_message(ctx));
}

static void t_budget_lowered_by_another_thread(void)
{
    NEED_SETUP();
    host h;
    kiln_image img;
    kiln_status st = run_with(ctx, &h, ACT_LOWER, 2, 0, 6, &img);
    CHECK(st == KILN_OK, "txt2img with the budget lowered: %s", kiln_last_message(ctx));
    CHECK(h.acted == 1, "the host thread lowered the budget");
    CHECK(h.reserved_before > LOW, "the run held %llu bytes, not more than the new budget",
          (unsigned long long)h.reserved_before);
    CHECK(same_image(&img, &reference), "the picture differs from the undisturbed run's");
    if (st == KILN_OK) check_compliance("txt2img, lowered from a second thread");
    kiln_image_free(&img);
    kiln_memory_set_budget(NULL, "sim", 0);
}

static void t_budget_lowered_then_raised(void)
{
    NEED_SETUP();
    host h;
    kiln_image img;
    kiln_status st = run_with(ctx, &h, ACT_LOWER_RAISE, 1, 4, 6, &img);
    CHECK(st == KILN_OK, "txt2img with the budget lowered then raised: %s", kiln_last_message(ctx));
    CHECK(h.acted == 2, "the host thread lowered and raised the budget (%d)", h.acted);
    CHECK(same_image(&img, &reference), "the picture differs from the undisturbed run's");
    kiln_image_free(&img);
    kiln_memory_set_budget(NULL, "sim", 0);
}

static void t_suspend_resume(void)
{
    NEED_SETUP();
    host h;
    kiln_image img;
    kiln_status st = run_with(ctx, &h, ACT_SUSPEND_RESUME, 2, 0, 6, &img);
    CHECK(st == KILN_OK, "txt2img suspended and resumed: %s", kiln_last_message(ctx));
    CHECK(h.st_suspend == KILN_OK, "kiln_suspend: %s", kiln_status_string(h.st_suspend));
    CHECK(h.st_resume == KILN_OK, "kiln_resume: %s", kiln_status_string(h.st_resume));
    CHECK(h.reserved_before > 0, "the run held nothing on sim before the park");
    CHECK(h.reserved_parked == 0 && h.allocated_parked == 0, "parked: %llu reserved, %llu allocated on sim",
          (unsigned long long)h.reserved_parked, (unsigned long long)h.allocated_parked);
    CHECK(h.step_parked == h.step_after_wait, "the run went on while parked (step %d -> %d)", h.step_parked,
          h.step_after_wait);
    CHECK(same_image(&img, &reference), "the picture differs from the uninterrupted run's");
    kiln_suspend_stats s;
    CHECK(kiln_suspend_info(ctx, &s) == KILN_OK && s.parks >= 1 && !s.parked, "suspend info: %llu parks",
          (unsigned long long)s.parks);
    printf("# suspend: %.2f ms from kiln_suspend to parked (%.2f ms inside; %llu bytes to the host), "
           "resume: %.2f ms to running\n",
           h.suspend_s * 1000, s.park_seconds * 1000, (unsigned long long)s.bytes, h.resume_s * 1000);
    kiln_image_free(&img);
}

static void t_cancel_while_parked(void)
{
    NEED_SETUP();
    host h;
    kiln_image img;
    kiln_status st = run_with(ctx, &h, ACT_SUSPEND_CANCEL, 2, 0, 6, &img);
    CHECK(h.st_suspend == KILN_OK, "kiln_suspend: %s", kiln_status_string(h.st_suspend));
    CHECK(st == KILN_ERR_CANCELLED, "a cancel while parked gave %s: %s", kiln_status_string(st),
          kiln_last_message(ctx));
    CHECK(img.data == NULL, "no picture from a cancelled call");
    /* what it held came back before it unwound (a model it loaded may stay loaded for
     * the next call): nothing more than it held, nothing still parked */
    kiln_suspend_stats ss;
    CHECK(kiln_suspend_info(ctx, &ss) == KILN_OK && !ss.parked, "still parked after the cancel");
    CHECK(sim_stats().allocated <= h.reserved_before, "the cancelled call left %llu bytes on sim (held %llu)",
          (unsigned long long)sim_stats().allocated, (unsigned long long)h.reserved_before);
    /* nothing to resume, and the context goes on */
    CHECK(kiln_resume(ctx) == KILN_OK, "resume with nothing parked");
    st = run_with(ctx, &h, ACT_NONE, 0, 0, 6, &img);
    CHECK(st == KILN_OK && same_image(&img, &reference), "the next call: %s", kiln_last_message(ctx));
    kiln_image_free(&img);
}

static void t_suspend_without_a_call(void)
{
    NEED_SETUP();
    CHECK(kiln_suspend(ctx) == KILN_ERR_STATE, "suspend with no call running");
    CHECK(strstr(kiln_last_message(NULL), "no call is running") != NULL, "message '%s'", kiln_last_message(NULL));
    CHECK(kiln_resume(ctx) == KILN_OK, "resume with nothing parked");
    CHECK(kiln_suspend(NULL) == KILN_ERR_ARG && kiln_resume(NULL) == KILN_ERR_ARG, "NULL context");
    /* from the call's own callback it would wait for itself: refused, the call goes on */
    host h;
    kiln_image img;
    kiln_status st = run_with(ctx, &h, ACT_SUSPEND_IN_CALLBACK, 0, 0, 2, &img);
    CHECK(st == KILN_OK, "the call: %s", kiln_last_message(ctx));
    CHECK(h.st_suspend == KILN_ERR_STATE, "kiln_suspend from the progress callback gave %s",
          kiln_status_string(h.st_suspend));
    kiln_image_free(&img);
}

int main(void)
{
    int ok = setup();
    if (!ok && access(MODEL, R_OK) == 0) printf("FAIL setup: the demo model did not run\n");
    RUN(t_budget_lowered_by_another_thread);
    RUN(t_budget_lowered_then_raised);
    RUN(t_suspend_resume);
    RUN(t_cancel_while_parked);
    RUN(t_suspend_without_a_call);
    kiln_image_free(&reference);
    kiln_close(ctx);
    return test_summary() || (!ok && access(MODEL, R_OK) == 0);
}

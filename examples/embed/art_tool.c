/* art_tool.c - a small host program that embeds kiln, as a paint or art tool would:
 * it opens a context with a memory budget, loads its Lua side (art_tool.lua), asks
 * it for an image from a prompt while showing progress, can cancel after N steps,
 * and writes the pixels it gets back as a PNG. Build against an installed kiln:
 *
 *   cc art_tool.c $(pkg-config --cflags --libs kiln) -o art_tool
 *   ./art_tool --steps 20 --out fox.png "a red fox"
 *   ./art_tool --steps 20 --cancel-after 5 "a red fox"      # exits with status 2
 *   ./art_tool --steps 20 --preview live.png "a red fox"    # the picture forming, every 5 steps
 *
 * Exit status: 0 image written, 1 error, 2 cancelled. */
#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    kiln_ctx *ctx;
    int cancel_after; /* 0: never */
    int steps_seen;
} progress_state;

/* Called by kiln.progress in the script (the samplers call it every step). */
static void on_progress(void *user, int step, int total, const char *message)
{
    progress_state *p = user;
    p->steps_seen = step;
    printf("[%s] step %d/%d\n", message, step, total);
    fflush(stdout);
    if (p->cancel_after > 0 && step >= p->cancel_after) kiln_cancel(p->ctx); /* as a Cancel button would */
}

/* Called between sampling steps with a picture of the run so far (8-bit RGB, valid only
 * during the call): a paint program would draw it on its canvas; this one writes it to
 * a file (atomically, so a viewer watching the file never reads half of one). */
static void on_preview(void *user, int step, int total, const kiln_image *image)
{
    const char *path = user;
    if (kiln_image_save_png(NULL, image, path) == KILN_OK)
        printf("[preview] step %d/%d: %dx%d -> %s\n", step, total, image->width, image->height, path);
}

/* The script's print() and warnings. */
static void on_log(void *user, kiln_log_level level, const char *message)
{
    (void)user;
    fprintf(stderr, "%s%s\n", level <= KILN_LOG_WARN ? "lua warning: " : "lua: ", message);
}

static void usage(FILE *f)
{
    fputs("usage: art_tool [options] [prompt]\n"
          "  --out FILE         PNG to write (default art.png)\n"
          "  --steps N          steps (default 20)\n"
          "  --size N           width and height (default 256)\n"
          "  --seed N           seed (default 0)\n"
          "  --cancel-after K   cancel after step K (exit status 2)\n"
          "  --preview FILE     write a preview PNG every 5 steps while the picture forms\n"
          "  --script FILE      the Lua side (default examples/embed/art_tool.lua)\n"
          "  --model FILE       checkpoint, for the text-to-image version of the script\n"
          "  --device NAME      cpu, sim, cuda:0 (default cpu)\n"
          "  --vram SIZE        memory budget of the device (6G, 512M, 1.5GiB or bytes)\n",
          f);
}

int main(int argc, char **argv)
{
    const char *out_path = "art.png", *script = "examples/embed/art_tool.lua", *prompt = "a lighthouse at dusk";
    const char *steps = "20", *size = "256", *seed = "0", *model = NULL, *preview = NULL;
    kiln_config cfg = KILN_CONFIG_INIT; /* its size: the library knows which fields this host has */
    progress_state progress = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) { usage(stdout); return 0; }
        if (a[0] != '-' || a[1] != '-') { prompt = a; continue; }
        if (v == NULL) { fprintf(stderr, "art_tool: %s needs a value\n", a); usage(stderr); return 1; }
        i++;
        if (strcmp(a, "--out") == 0) out_path = v;
        else if (strcmp(a, "--steps") == 0) steps = v;
        else if (strcmp(a, "--size") == 0) size = v;
        else if (strcmp(a, "--seed") == 0) seed = v;
        else if (strcmp(a, "--cancel-after") == 0) progress.cancel_after = atoi(v);
        else if (strcmp(a, "--preview") == 0) preview = v;
        else if (strcmp(a, "--script") == 0) script = v;
        else if (strcmp(a, "--model") == 0) model = v;
        else if (strcmp(a, "--device") == 0) cfg.device = v;
        else if (strcmp(a, "--vram") == 0) {
            if (kiln_parse_size(v, &cfg.memory_budget) != KILN_OK) { /* "6G", "512M", bytes */
                fprintf(stderr, "art_tool: --vram: %s\n", kiln_last_message(NULL));
                return 1;
            }
        } else { fprintf(stderr, "art_tool: unknown option %s\n", a); usage(stderr); return 1; }
    }

    /* 1. a context: the device, its budget, where the script's messages go */
    cfg.log = on_log;
    kiln_ctx *ctx;
    if (kiln_open(&cfg, &ctx) != KILN_OK) { /* a bad --device, or a library of another version */
        fprintf(stderr, "art_tool: %s\n", kiln_last_message(NULL));
        return 1;
    }
    progress.ctx = ctx;
    kiln_set_progress(ctx, on_progress, &progress);
    if (preview) kiln_set_preview(ctx, on_preview, (void *)preview, 5);
    kiln_run_string(ctx, "print(('kiln %s on %s'):format(kiln.version, kiln.default_device()))");

    /* 2. the Lua side defines generate(prompt, steps, size, seed, model) */
    kiln_status st = kiln_run_file(ctx, script, 0, NULL);
    if (st != KILN_OK) {
        fprintf(stderr, "art_tool: %s: %s\n", kiln_status_string(st), kiln_last_message(ctx));
        kiln_close(ctx);
        return 1;
    }

    /* 3. ask for an image; pixels come back as 8-bit RGB */
    const char *args[] = {prompt, steps, size, seed, model};
    kiln_image img = {0};
    img.format = KILN_PIXEL_U8;
    st = kiln_call(ctx, "generate", NULL, 0, args, model ? 5 : 4, &img);

    kiln_memory_info mem;
    kiln_memory_stats(ctx, NULL, &mem);
    int status = 0;
    if (st == KILN_ERR_CANCELLED) {
        printf("cancelled after %d steps (%s); %s: %llu bytes allocated, peak %llu\n", progress.steps_seen,
               kiln_last_message(ctx), mem.device, (unsigned long long)mem.allocated,
               (unsigned long long)mem.peak_allocated);
        status = 2;
    } else if (st != KILN_OK) {
        fprintf(stderr, "art_tool: %s: %s\n", kiln_status_string(st), kiln_last_message(ctx));
        if (st == KILN_ERR_OOM) fprintf(stderr, "%s", kiln_memory_summary(ctx) ? kiln_memory_summary(ctx) : "");
        status = 1;
    } else {
        /* 4. the pixels are ours: look at them, write them */
        unsigned long long sum = 0;
        const unsigned char *px = img.data;
        for (size_t i = 0; i < (size_t)img.width * img.height * img.channels; i++) sum += px[i];
        printf("image %dx%d, %d channels, mean %.1f; %s peak %llu bytes\n", img.width, img.height, img.channels,
               (double)sum / ((double)img.width * img.height * img.channels), mem.device,
               (unsigned long long)mem.peak_allocated);
        st = kiln_image_save_png(ctx, &img, out_path);
        if (st == KILN_OK) printf("wrote %s\n", out_path);
        else fprintf(stderr, "art_tool: %s\n", kiln_last_message(ctx));
        status = st == KILN_OK ? 0 : 1;
        kiln_image_free(&img);
    }

    /* 5. closing frees every tensor the context held */
    kiln_close(ctx);
    kiln_memory_stats(NULL, mem.device, &mem);
    printf("after close: %llu bytes allocated on %s\n", (unsigned long long)mem.allocated, mem.device);
    return status;
}

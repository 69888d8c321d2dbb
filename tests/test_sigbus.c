/* test_sigbus.c - reads from a file's mapping after the file was truncated under it:
 * the guarded copy (mapped_read.h) returns an error naming the file instead of dying
 * of SIGBUS, also twice in a row and from the model's loads while another thread
 * truncates the file; a SIGBUS outside any guard still reaches the handler that was
 * installed before kiln's. */
#define _GNU_SOURCE
#include "mapped_read.h"
#include "model.h"
#include "safetensors.h"
#include "test.h"

#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

/* ASan handles SIGBUS itself; it must let kiln's handler in (it then chains to it) */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allow_user_segv_handler=1"; }

static char dir[64];

static const char *path_in(const char *name)
{
    static char buf[4][256];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 256, "%s/%s", dir, name);
    return p;
}

/* n f32 tensors "blk.<i>.w" of elems each. */
static const char *make_file(const char *name, int n, int64_t elems)
{
    kiln_st_item *items = calloc((size_t)n, sizeof *items);
    char (*names)[16] = calloc((size_t)n, sizeof *names);
    float *data = malloc(sizeof(float) * (size_t)elems);
    int64_t shape[1] = {elems};
    for (int64_t i = 0; i < elems; i++) data[i] = (float)(i % 101) * 0.5f;
    for (int t = 0; t < n; t++) {
        snprintf(names[t], sizeof names[t], "blk.%d.w", t);
        items[t] = (kiln_st_item){names[t], KILN_F32, 1, shape, data};
    }
    const char *path = path_in(name);
    if (kiln_st_save(path, n, items, 0, NULL, NULL)) printf("# make_file %s: %s\n", name, kiln_last_error());
    free(data);
    free(names);
    free(items);
    return path;
}

static int contains(const char *s, const char *part) { return strstr(s, part) != NULL; }

static int shorten(const char *path, off_t size)
{
    int fd = open(path, O_RDWR);
    if (fd < 0) return -1;
    int r = ftruncate(fd, size);
    close(fd);
    return r;
}

/* Mapped by the normal loader, truncated, read: an error naming the file, twice; the
 * part still in the file reads. */
static void t_guarded_read(void)
{
    const char *path = make_file("guard.safetensors", 4, 1 << 16);
    kiln_st_file *f = NULL;
    CHECK(kiln_st_open(path, &f) == KILN_OK, "%s", kiln_last_error());
    if (!f) return;
    CHECK(shorten(path, 4096) == 0, "ftruncate");
    size_t n = 1 << 16;
    float *buf = malloc(sizeof(float) * n);
    for (int k = 0; k < 2; k++) {
        kiln_status st = kiln_mapped_read(f->path, buf, KILN_F32, kiln_st_data(f, 3), KILN_F32, n);
        CHECK(st == KILN_ERR_IO, "read %d past the end: status %d (%s)", k + 1, (int)st, kiln_last_error());
        CHECK(contains(kiln_last_error(), path), "message '%s' lacks the path", kiln_last_error());
        CHECK(contains(kiln_last_error(), "changed on disk while it was read"), "message '%s'", kiln_last_error());
    }
    /* a conversion too (f32 -> f16 reads the same pages) */
    kiln_status st = kiln_mapped_read(f->path, buf, KILN_F16, kiln_st_data(f, 2), KILN_F32, n);
    CHECK(st == KILN_ERR_IO, "converted read past the end: status %d", (int)st);
    /* what is left of the file (the first page) still reads */
    st = kiln_mapped_read_bytes(f->path, buf, f->map, 4096);
    CHECK(st == KILN_OK, "the first page: %s", kiln_last_error());
    free(buf);
    kiln_st_release(f);
}

/* A SIGBUS that no guard covers goes to the handler installed before kiln's. */
static sigjmp_buf outside_jb;
static volatile sig_atomic_t outside_hits;

static void outside_handler(int sig)
{
    (void)sig;
    outside_hits++;
    siglongjmp(outside_jb, 1);
}

static void t_chains_to_previous(void)
{
    const char *path = make_file("chain.safetensors", 2, 1 << 16);
    kiln_st_file *f = NULL;
    CHECK(kiln_st_open(path, &f) == KILN_OK, "%s", kiln_last_error());
    if (!f) return;
    CHECK(shorten(path, 4096) == 0, "ftruncate");
    if (sigsetjmp(outside_jb, 1) == 0) {
        volatile const float *p = kiln_st_data(f, 1);
        volatile float x = p[0];
        (void)x;
    }
    CHECK(outside_hits == 1, "the earlier handler saw %d faults, expected 1", (int)outside_hits);
    kiln_st_release(f);
}

/* The model's load while another thread truncates the file: either the stamp check
 * or the guarded copy gives the error, naming the file; the process lives. */
typedef struct { const char *path; int done; } cutter;

static void *cut_later(void *arg)
{
    cutter *c = arg;
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    c->done = shorten(c->path, 4096) == 0;
    return NULL;
}

static void t_truncated_during_load(void)
{
    int guarded = 0, stamped = 0;
    for (int round = 0; round < 2; round++) {
        const char *path = make_file("race.safetensors", 4, (int64_t)1 << 23);
        kiln_model *m = NULL;
        CHECK(kiln_model_open(&path, 1, "race", &m) == KILN_OK, "%s", kiln_last_error());
        if (!m) return;
        cutter c = {path, 0};
        pthread_t th;
        pthread_create(&th, NULL, cut_later, &c);
        kiln_status st = kiln_model_load(m, kiln_device_cpu(), KILN_F16);
        pthread_join(th, NULL);
        CHECK(c.done, "ftruncate");
        if (st == KILN_OK) {
            /* the load won the race: the next one sees the change */
            kiln_model_unload(m);
            st = kiln_model_load(m, kiln_device_cpu(), KILN_F16);
        }
        CHECK(st == KILN_ERR_IO, "round %d: status %d (%s)", round, (int)st, kiln_last_error());
        CHECK(contains(kiln_last_error(), path), "message '%s' lacks the path", kiln_last_error());
        if (contains(kiln_last_error(), "while it was read")) guarded++;
        else stamped++;
        kiln_model_close(m);
        unlink(path);
    }
    printf("# truncated during a load: %d caught by the guarded copy, %d by the stamp check\n", guarded, stamped);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kiln_sigbus_XXXXXX");
    if (!mkdtemp(dir)) return 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = outside_handler;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, NULL);
    RUN(t_guarded_read);
    RUN(t_chains_to_previous);
    RUN(t_truncated_during_load);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) {}
    return test_summary();
}

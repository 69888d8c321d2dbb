/* test_file_stamp.c - files that change under a running kiln: a mapped safetensors
 * file truncated, rewritten in place or replaced between two loads (or two streamed
 * steps in memory mode "low") gives "FILE changed on disk since it was opened"
 * instead of a SIGBUS on the mapping, and the model stays usable from the copies it
 * already had. */
#define _GNU_SOURCE
#include "file_stamp.h"
#include "model.h"
#include "safetensors.h"
#include "test.h"

#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static char dir[64];

static const char *path_in(const char *name)
{
    static char buf[4][256];
    static int k;
    char *p = buf[k++ & 3];
    snprintf(p, 256, "%s/%s", dir, name);
    return p;
}

/* Four f32 tensors "blk.<i>.w" of 64 Ki elements: 1 MiB of data, many pages. */
static const char *make_file(const char *name, float base)
{
    enum { N = 4, ELEMS = 1 << 16 };
    static float data[N][ELEMS];
    static char names[N][16];
    kiln_st_item items[N];
    int64_t shape[1] = {ELEMS};
    for (int t = 0; t < N; t++) {
        for (int i = 0; i < ELEMS; i++) data[t][i] = base + (float)t + (float)(i % 97) * 0.01f;
        snprintf(names[t], sizeof names[t], "blk.%d.w", t);
        items[t] = (kiln_st_item){names[t], KILN_F32, 1, shape, data[t]};
    }
    const char *path = path_in(name);
    if (kiln_st_save(path, N, items, 0, NULL, NULL)) printf("# make_file %s: %s\n", name, kiln_last_error());
    return path;
}

static int contains(const char *s, const char *part) { return strstr(s, part) != NULL; }

/* The message every case must give: the path, then the phrase. */
static void check_changed(kiln_status st, const char *path, const char *detail)
{
    char want[400];
    snprintf(want, sizeof want, "%s changed on disk since it was opened", path);
    CHECK(st == KILN_ERR_IO, "status %d (%s), expected an I/O error", (int)st, kiln_last_error());
    CHECK(contains(kiln_last_error(), want), "message '%s' lacks '%s'", kiln_last_error(), want);
    if (detail) CHECK(contains(kiln_last_error(), detail), "message '%s' lacks '%s'", kiln_last_error(), detail);
}

static void t_stamp_check(void)
{
    const char *path = make_file("stamp.safetensors", 1.0f);
    kiln_st_file *f = NULL;
    CHECK(kiln_st_open(path, &f) == KILN_OK, "%s", kiln_last_error());
    if (!f) return;
    CHECK(kiln_st_check(f) == KILN_OK, "fresh file: %s", kiln_last_error());
    CHECK(truncate(path, 4096) == 0, "truncate");
    check_changed(kiln_st_check(f), path, "bytes then");
    kiln_st_release(f);
    CHECK(kiln_st_open(path, &f) != KILN_OK, "the truncated file no longer opens");
}

/* Truncated between two loads: the second load is an error, not a fault; the model
 * closes cleanly. */
static void t_truncated_between_loads(void)
{
    const char *path = make_file("trunc.safetensors", 2.0f);
    kiln_model *m = NULL;
    CHECK(kiln_model_open(&path, 1, "trunc", &m) == KILN_OK, "%s", kiln_last_error());
    if (!m) return;
    CHECK(kiln_model_load(m, kiln_device_cpu(), KILN_F32) == KILN_OK, "%s", kiln_last_error());
    kiln_model_unload(m);
    CHECK(truncate(path, 8192) == 0, "truncate");
    check_changed(kiln_model_load(m, kiln_device_cpu(), KILN_F16), path, NULL);
    CHECK(contains(kiln_last_error(), "model 'trunc'"), "names the model: %s", kiln_last_error());
    kiln_tensor *t = NULL;
    check_changed(kiln_model_tensor(m, "blk.3.w", &t), path, NULL);
    CHECK(t == NULL, "no view of the file handed out");
    kiln_model_close(m);
}

/* Rewritten in place with the same size (cp over it): the mtime tells. */
static void t_modified_in_place(void)
{
    const char *path = make_file("inplace.safetensors", 3.0f);
    kiln_model *m = NULL;
    CHECK(kiln_model_open(&path, 1, "inplace", &m) == KILN_OK, "%s", kiln_last_error());
    if (!m) return;
    struct stat sb;
    stat(path, &sb);
    FILE *f = fopen(path, "r+b");
    CHECK(f != NULL, "reopen");
    if (f) {
        fseek(f, (long)sb.st_size - 4, SEEK_SET);
        fwrite("\0\0\0\0", 1, 4, f);
        fclose(f);
    }
    /* a file system with coarse timestamps may not have moved the mtime yet */
    struct timespec ts[2] = {{0, UTIME_OMIT}, {sb.st_mtim.tv_sec + 5, 0}};
    utimensat(AT_FDCWD, path, ts, 0);
    check_changed(kiln_model_load(m, kiln_device_cpu(), -1), path, "modified in place");
    kiln_model_close(m);
}

/* Replaced by another file (an atomic save over it): the old mapping would still
 * read, but it is not what the path holds any more. */
static void t_replaced(void)
{
    const char *path = make_file("replaced.safetensors", 4.0f);
    kiln_model *m = NULL;
    CHECK(kiln_model_open(&path, 1, "replaced", &m) == KILN_OK, "%s", kiln_last_error());
    if (!m) return;
    make_file("replaced.safetensors", 5.0f);
    check_changed(kiln_model_load(m, kiln_device_cpu(), -1), path, "replaced");
    kiln_model_close(m);
    unlink(path);
    path = make_file("gone.safetensors", 6.0f);
    CHECK(kiln_model_open(&path, 1, "gone", &m) == KILN_OK, "%s", kiln_last_error());
    if (!m) return;
    unlink(path);
    check_changed(kiln_model_load(m, kiln_device_cpu(), -1), path, NULL);
    kiln_model_close(m);
}

/* Memory mode "low" reads the file at every step (fetch / prefetch): truncated
 * between two steps, the next fetch is the error; tensors already on the device
 * stay usable, and release still works. */
static void t_truncated_between_steps(void)
{
    kiln_device *sim = kiln_device_get("sim");
    if (!sim) { SKIP("no sim device"); return; }
    const char *path = make_file("steps.safetensors", 7.0f);
    kiln_model *m = NULL;
    CHECK(kiln_model_open(&path, 1, "steps", &m) == KILN_OK, "%s", kiln_last_error());
    if (!m) return;
    kiln_memory_mode_set(KILN_MEM_LOW);
    CHECK(kiln_model_load(m, sim, -1) == KILN_OK, "%s", kiln_last_error());
    const char *step1[2] = {"blk.0.w", "blk.1.w"}, *step2[2] = {"blk.2.w", "blk.3.w"};
    CHECK(kiln_model_fetch(m, step1, 2) == KILN_OK, "step 1: %s", kiln_last_error());
    kiln_tensor *t = NULL;
    CHECK(kiln_model_tensor(m, "blk.0.w", &t) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_prefetch(m, step2, 2) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_model_release(m, step1, 2) == KILN_OK, "%s", kiln_last_error());
    CHECK(truncate(path, 100) == 0, "truncate");
    /* the prefetch may have finished before the truncation: then its copies serve
     * step 2 and the next step from the file is the one that fails */
    kiln_status st = kiln_model_fetch(m, step2, 2);
    if (st == KILN_OK) {
        CHECK(kiln_model_release(m, step2, 2) == KILN_OK, "%s", kiln_last_error());
        st = kiln_model_fetch(m, step1, 2);
    }
    check_changed(st, path, NULL);
    if (t) {
        /* a copy made before the change is still whole (sim memory is host memory) */
        CHECK(t->storage->device == sim && t->dtype == KILN_F32, "step 1's copy is on sim");
        const float *v = kiln_tensor_data(t);
        CHECK(fabsf(v[5] - 7.05f) < 1e-5f, "value %g", (double)v[5]);
        kiln_tensor_free(t);
    }
    kiln_model_release(m, step2, 2);
    kiln_model_close(m);
    kiln_memory_mode_set(KILN_MEM_NORMAL);
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/kiln_test_stamp_XXXXXX");
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
    RUN(t_stamp_check);
    RUN(t_truncated_between_loads);
    RUN(t_modified_in_place);
    RUN(t_replaced);
    RUN(t_truncated_between_steps);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("# could not remove %s\n", dir);
    return test_summary();
}

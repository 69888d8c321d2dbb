/* fuzz.h - what the harnesses under tests/fuzz share. Each fuzz_<name>.c defines
 * LLVMFuzzerTestOneInput and is built twice: against libFuzzer by `make fuzz`, and
 * with replay.c as the test_fuzz_<name> program of `make test`, which feeds it the
 * seed corpus and the inputs that once crashed it. A harness aborts on a broken
 * invariant (that is how a fuzzer learns of it); an error value is a fine answer. */
#ifndef KILN_FUZZ_H
#define KILN_FUZZ_H

#define _POSIX_C_SOURCE 200809L
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* The initialisation a harness does before any device is used: hand the runtime the
 * backends this build links (kernels/backends.h), as luaopen_kiln does. */
void kiln_backends_register_all(void);
__attribute__((constructor)) static void fuzz_register_backends(void) { kiln_backends_register_all(); }

#define FUZZ_REQUIRE(cond) do { \
    if (!(cond)) { fprintf(stderr, "%s:%d: invariant broken: %s\n", __FILE__, __LINE__, #cond); abort(); } \
} while (0)

/* Where harnesses add the bytes they touch, so the reads are not optimized away. */
static volatile size_t fuzz_sink;

static char fuzz_dir_path[256];

static inline void fuzz_dir_remove(void)
{
    if (!fuzz_dir_path[0]) return;
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", fuzz_dir_path);
    if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", fuzz_dir_path);
}

/* A folder of this process for the harnesses whose parser reads files (in memory
 * when /dev/shm is there), removed at exit. */
static inline const char *fuzz_dir(void)
{
    if (!fuzz_dir_path[0]) {
        struct stat sb;
        const char *base = stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) ? "/dev/shm" : "/tmp";
        snprintf(fuzz_dir_path, sizeof fuzz_dir_path, "%s/kiln_fuzz_XXXXXX", base);
        if (!mkdtemp(fuzz_dir_path)) { perror("mkdtemp"); abort(); }
        atexit(fuzz_dir_remove);
    }
    return fuzz_dir_path;
}

/* Writes data to fuzz_dir()/name; returns the path (static storage, one per name slot). */
static inline const char *fuzz_file(const char *name, const void *data, size_t size)
{
    static char path[4][320];
    static int k;
    k = (k + 1) % 4;
    snprintf(path[k], sizeof path[k], "%s/%s", fuzz_dir(), name);
    FILE *f = fopen(path[k], "wb");
    if (!f) { perror(path[k]); abort(); }
    if (size && fwrite(data, 1, size, f) != size) { perror(path[k]); abort(); }
    fclose(f);
    return path[k];
}

#endif

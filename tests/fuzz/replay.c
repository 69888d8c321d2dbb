/* replay.c - main of the test_fuzz_<name> programs of `make test`: feeds every file
 * of tests/fuzz/regressions/<name>/ (inputs that once crashed a parser) and of
 * tests/fuzz/corpus/<name>/ (the seeds) to the harness fuzz_<name>.c once, without
 * libFuzzer. A crash ends the program, which the test runner reports as a failure. */
#include "fuzz.h"

#include <dirent.h>

#ifndef FUZZ_NAME
#error "build with -DFUZZ_NAME='\"name\"'"
#endif

static int by_name(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Feeds the files of dir (sorted, for a stable order); returns how many, -1 when dir is absent. */
static int replay_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return -1;
    char *names[4096];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 4096)
        if (e->d_name[0] != '.') names[n++] = strdup(e->d_name);
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, by_name);
    int fed = 0;
    for (int i = 0; i < n; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        free(names[i]);
        FILE *f = fopen(path, "rb");
        if (!f) continue;
        size_t cap = 1 << 16, len = 0;
        uint8_t *buf = malloc(cap);
        for (size_t r; buf && (r = fread(buf + len, 1, cap - len, f)) > 0;) {
            len += r;
            if (len == cap) {
                uint8_t *b2 = realloc(buf, cap *= 2);
                if (!b2) { free(buf); buf = NULL; }
                buf = b2;
            }
        }
        fclose(f);
        if (!buf) { fprintf(stderr, "out of memory reading %s\n", path); abort(); }
        fprintf(stderr, "replay %s\n", path);
        LLVMFuzzerTestOneInput(buf, len);
        free(buf);
        fed++;
    }
    return fed;
}

int main(int argc, char **argv)
{
    const char *root = argc > 1 ? argv[1] : "tests/fuzz";
    const char *kinds[2] = {"regressions", "corpus"};
    for (int k = 0; k < 2; k++) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s/%s", root, kinds[k], FUZZ_NAME);
        int n = replay_dir(dir);
        if (n < 0 && k == 0) printf("PASS %s_%s (none kept)\n", FUZZ_NAME, kinds[k]);
        else if (n < 0) printf("FAIL %s_%s: no folder %s\n", FUZZ_NAME, kinds[k], dir);
        else printf("PASS %s_%s (%d inputs)\n", FUZZ_NAME, kinds[k], n);
        fflush(stdout);
    }
    return 0;
}

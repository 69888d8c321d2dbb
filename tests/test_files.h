/* test_files.h - a temporary folder per test program and the file helpers the file
 * format tests share: paths inside it, whole-file reads and writes, leftover
 * temporaries counted, the folder removed at the end. */
#ifndef KILN_TEST_FILES_H
#define KILN_TEST_FILES_H

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tmpdir[256];

/* Makes /tmp/kiln_test_<tag>_XXXXXX; 0 when it cannot. */
static inline int test_tmpdir_make(const char *tag)
{
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kiln_test_%s_XXXXXX", tag);
    if (mkdtemp(tmpdir)) return 1;
    perror("mkdtemp");
    return 0;
}

/* tmpdir/name; the last four results stay valid. */
static inline const char *tmp_path(const char *name)
{
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", tmpdir, name);
    return buf[k];
}

/* The whole file (malloc'd, the caller frees) and its size; NULL when unreadable. */
static inline unsigned char *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(len > 0 ? (size_t)len : 1);
    *n = buf ? fread(buf, 1, (size_t)len, f) : 0;
    fclose(f);
    return buf;
}

static inline int write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    size_t w = n ? fwrite(data, 1, n, f) : 0;
    return fclose(f) == 0 && w == n;
}

/* Temporaries an atomic save left in tmpdir (their names have ".tmp"). */
static inline int count_tmp_files(void)
{
    DIR *d = opendir(tmpdir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, ".tmp")) n++;
    if (d) closedir(d);
    return n;
}

/* Removes tmpdir and the files in it (KEEP=1 in the environment keeps them). */
static inline void test_tmpdir_remove(void)
{
    if (getenv("KEEP")) {
        printf("# kept %s\n", tmpdir);
        return;
    }
    DIR *d = opendir(tmpdir);
    struct dirent *e;
    char p[600];
    while (d && (e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s", tmpdir, e->d_name);
        unlink(p);
    }
    if (d) closedir(d);
    rmdir(tmpdir);
}

#endif

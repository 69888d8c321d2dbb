/* test_atomic_file.c - the one way kiln replaces a file: a commit swaps the new
 * bytes in whole, and every failure (abort, a write that fails half way, a rename
 * that cannot happen) leaves the existing file byte-identical and no temporary. */
#define _POSIX_C_SOURCE 200809L
#include "test.h"
#include "test_files.h"
#include "atomic_file.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static int same_file(const char *path, const char *want, size_t n)
{
    size_t got_n = 0;
    unsigned char *got = read_file(path, &got_n);
    int same = got && got_n == n && memcmp(got, want, n) == 0;
    free(got);
    return same;
}

static kiln_status save(const char *path, const char *text)
{
    kiln_atomic_file f;
    kiln_status st = kiln_atomic_file_open(&f, path);
    if (st) return st;
    if ((st = kiln_atomic_file_write(&f, text, strlen(text)))) {
        kiln_atomic_file_abort(&f);
        return st;
    }
    return kiln_atomic_file_commit(&f);
}

static void t_commit(void)
{
    const char *path = tmp_path("a.txt");
    CHECK(save(path, "first") == KILN_OK, "%s", kiln_last_error());
    CHECK(same_file(path, "first", 5), "first save");
    CHECK(save(path, "second, longer") == KILN_OK, "%s", kiln_last_error());
    CHECK(same_file(path, "second, longer", 14), "replaced whole");
    /* the new file gets the mode a plain create gives (0666 less the umask), not mkstemp's 0600 */
    mode_t mask = umask(022);
    umask(mask);
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && (sb.st_mode & 0777) == (0666 & ~mask), "mode %o", (unsigned)(sb.st_mode & 0777));
    CHECK(count_tmp_files() == 0, "temporary file left behind");
}

static void t_abort_keeps_existing(void)
{
    const char *path = tmp_path("b.txt");
    CHECK(save(path, "keep me") == KILN_OK, "%s", kiln_last_error());
    kiln_atomic_file f;
    CHECK(kiln_atomic_file_open(&f, path) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_atomic_file_write(&f, "half", 4) == KILN_OK, "%s", kiln_last_error());
    CHECK(count_tmp_files() == 1, "the temporary lives next to the target");
    kiln_error(KILN_ERR_ARG, "the caller's reason");
    kiln_atomic_file_abort(&f);
    kiln_atomic_file_abort(&f); /* closed: nothing */
    CHECK(strcmp(kiln_last_error(), "the caller's reason") == 0, "abort replaced the message: %s", kiln_last_error());
    CHECK(same_file(path, "keep me", 7), "existing file changed by an abort");
    CHECK(count_tmp_files() == 0, "temporary file left behind");
    kiln_atomic_file zero = {0};
    kiln_atomic_file_abort(&zero); /* a zeroed one is closed */
    CHECK(kiln_atomic_file_commit(&f) == KILN_ERR_STATE, "commit after abort");
}

/* A write that fails half way (file size limit: EFBIG) is a failed save. */
static void t_failed_write_keeps_existing(void)
{
    const char *path = tmp_path("c.txt");
    CHECK(save(path, "old bytes") == KILN_OK, "%s", kiln_last_error());
    static char big[65536];
    memset(big, 'x', sizeof big);
    struct rlimit old;
    getrlimit(RLIMIT_FSIZE, &old);
    struct rlimit lim = {4096, old.rlim_max};
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    if (setrlimit(RLIMIT_FSIZE, &lim) != 0) {
        signal(SIGXFSZ, prev);
        SKIP("setrlimit(RLIMIT_FSIZE): %s", strerror(errno));
        return;
    }
    kiln_atomic_file f;
    kiln_status st = kiln_atomic_file_open(&f, path);
    kiln_status wst = st ? st : kiln_atomic_file_write(&f, big, sizeof big);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    CHECK(st == KILN_OK && wst == KILN_ERR_IO && strstr(kiln_last_error(), path), "write: %s %s",
          kiln_status_name(wst), kiln_last_error());
    kiln_atomic_file_abort(&f);
    CHECK(same_file(path, "old bytes", 9), "existing file changed by a failed write");
    CHECK(count_tmp_files() == 0, "temporary file left behind");
}

/* A rename that cannot happen (the target is a folder that is not empty). */
static void t_failed_rename_removes_temp(void)
{
    const char *dir = tmp_path("d");
    CHECK(mkdir(dir, 0755) == 0, "mkdir: %s", strerror(errno));
    char inner[600];
    snprintf(inner, sizeof inner, "%s/inside.txt", dir);
    CHECK(save(inner, "inside") == KILN_OK, "%s", kiln_last_error());
    kiln_status st = save(dir, "not a folder");
    CHECK(st == KILN_ERR_IO && strstr(kiln_last_error(), "rename"), "%s %s", kiln_status_name(st), kiln_last_error());
    CHECK(same_file(inner, "inside", 6), "folder's contents changed");
    CHECK(count_tmp_files() == 0, "temporary file left behind");
    unlink(inner);
    rmdir(dir);
}

static void t_missing_folder(void)
{
    const char *path = tmp_path("no/such/dir/e.txt");
    kiln_atomic_file f;
    kiln_status st = kiln_atomic_file_open(&f, path);
    CHECK(st == KILN_ERR_IO && strstr(kiln_last_error(), path), "%s %s", kiln_status_name(st), kiln_last_error());
    kiln_atomic_file_abort(&f); /* a failed open leaves it closed */
}

int main(void)
{
    if (!test_tmpdir_make("atomic")) return 1;
    RUN(t_commit);
    RUN(t_abort_keeps_existing);
    RUN(t_failed_write_keeps_existing);
    RUN(t_failed_rename_removes_temp);
    RUN(t_missing_folder);
    test_tmpdir_remove();
    return test_summary();
}

/* test.h - the C unit-test harness. Each tests/test_<module>.c is one program;
 * every test prints one line "PASS name", "FAIL name: why" or "SKIP name: why",
 * which tests/run.sh totals into "N passed, N failed, N skipped".
 *
 *   static void t_roundtrip(void) { CHECK(x == 1, "x was %d", x); }
 *   int main(void) { RUN(t_roundtrip); return test_summary(); }
 */
#ifndef KILN_TEST_H
#define KILN_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int test_n_pass, test_n_fail, test_n_skip;
static int test_cur_failed, test_cur_skipped;
static const char *test_cur_name;

#define CHECK(cond, ...) do { \
    if (!(cond)) { \
        if (!test_cur_failed) printf("FAIL %s: ", test_cur_name); else printf("     %s: ", test_cur_name); \
        printf("%s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); \
        test_cur_failed++; \
    } } while (0)

#define CHECK_NEAR(a, b, tol) do { double _a = (a), _b = (b); \
    CHECK(fabs(_a - _b) <= (tol) || (isnan(_a) && isnan(_b)), "%s = %.9g, expected %.9g (tol %g)", #a, _a, _b, (double)(tol)); } while (0)

/* Marks the running test skipped (call then return). */
#define SKIP(...) do { printf("SKIP %s: ", test_cur_name); printf(__VA_ARGS__); printf("\n"); test_cur_skipped = 1; } while (0)

#define RUN(fn) do { \
    test_cur_name = #fn; test_cur_failed = 0; test_cur_skipped = 0; \
    fn(); \
    if (test_cur_skipped) test_n_skip++; \
    else if (test_cur_failed) test_n_fail++; \
    else { test_n_pass++; printf("PASS %s\n", #fn); } \
    fflush(stdout); } while (0)

/* The initialisation a test program does before any device is used: hand the
 * runtime the backends this build links (kernels/backends.h), as luaopen_kiln does. */
void kiln_backends_register_all(void);
__attribute__((constructor)) static void test_register_backends(void) { kiln_backends_register_all(); }

static inline int test_summary(void)
{
    printf("# %d passed, %d failed, %d skipped\n", test_n_pass, test_n_fail, test_n_skip);
    return test_n_fail ? 1 : 0;
}

/* Folder of the shared test data (the real SD key lists, CLIP's vocabulary): $KILN_SHARED,
 * which tests/run.sh sets; tests that need it skip when it is absent. */
static inline const char *test_shared_dir(void)
{
    const char *e = getenv("KILN_SHARED");
    return e ? e : "../shared";
}

#endif

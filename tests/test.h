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

#include "backend.h"
#include "device.h"
#include "model.h"
#include "tensor.h"

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

typedef struct { char text[512]; size_t used; } test_owner_list;

static void test_add_owner(void *ctx, const kiln_storage *s)
{
    test_owner_list *o = ctx;
    if (o->used < sizeof o->text)
        o->used += (size_t)snprintf(o->text + o->used, sizeof o->text - o->used, "%s%s %zu bytes%s",
                                    o->used ? ", " : "", s->owner, s->nbytes, s->release ? " (wrapped)" : "");
}

/* The invariants at the end of a test program (test_summary checks them, as the kiln
 * program does after a Lua test file): for every device, once its backend's workspace is
 * given back, no bytes allocated and no more reserved than its budget; no tensor header
 * alive and no model open. Unless quiet, prints a "FAIL invariants: ..." line per broken
 * one naming what was left (models by name, storages by owner). Returns how many are
 * broken. */
static inline int test_invariants(int quiet)
{
    int broken = 0;
    for (int i = 0; i < kiln_device_count(); i++) {
        kiln_device *d = kiln_device_at(i);
        /* a backend's workspace (cuBLAS's) is held between ops by design: given back
         * here, as empty_cache and closing a context do */
        if (d->backend && d->backend->workspace_release) d->backend->workspace_release(d);
        kiln_mem_stats m = kiln_device_stats(d);
        test_owner_list o = {.used = 0};
        kiln_storage_foreach(d, test_add_owner, &o);
        if (m.allocated) {
            broken++;
            if (!quiet) printf("FAIL invariants: %llu bytes still allocated on %s at the end (%s)\n",
                               (unsigned long long)m.allocated, d->name, o.used ? o.text : "no live storage");
        }
        if (m.budget && m.reserved > m.budget) {
            broken++;
            if (!quiet) printf("FAIL invariants: %s reserves %llu bytes, over its budget of %llu\n", d->name,
                               (unsigned long long)m.reserved, (unsigned long long)m.budget);
        }
    }
    long tensors = kiln_tensor_live_count();
    if (tensors) {
        broken++;
        if (!quiet) printf("FAIL invariants: %ld tensor(s) still alive at the end\n", tensors);
    }
    kiln_model_usage rows[8];
    int n = kiln_model_usage_list(rows, 8);
    if (n) {
        broken++;
        if (!quiet) {
            printf("FAIL invariants: models still open at the end:");
            for (int i = 0; i < n && i < 8; i++) printf(" %s%s", rows[i].model, i + 1 < n ? "," : "");
            printf("%s\n", n > 8 ? " ..." : "");
        }
    }
    return broken;
}

static inline int test_summary(void)
{
    int broken = test_invariants(0);
    printf("# %d passed, %d failed, %d skipped\n", test_n_pass, test_n_fail, test_n_skip);
    return test_n_fail || broken ? 1 : 0;
}

/* Folder of the shared test data (the real SD key lists, CLIP's vocabulary): $KILN_SHARED,
 * which tests/run.sh sets; tests that need it skip when it is absent. */
static inline const char *test_shared_dir(void)
{
    const char *e = getenv("KILN_SHARED");
    return e ? e : "../shared";
}

#endif

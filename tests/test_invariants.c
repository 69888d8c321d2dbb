/* test_invariants.c - the per-test invariant check of test.h fails where it must: a
 * tensor, its bytes or a model left alive at the end of a test program is reported,
 * and the check is clean again once they are freed. (tests/test_leak_check.sh does the
 * same for the kiln program's check after a Lua test file.) */
#include "test.h"

static void t_clean_at_start(void) { CHECK(test_invariants(1) == 0, "a fresh program breaks %d invariants", test_invariants(0)); }

static void t_tensor_left_alive_is_caught(void)
{
    int64_t shape[2] = {4, 4};
    kiln_tensor *t = NULL;
    CHECK(kiln_tensor_new(kiln_device_cpu(), KILN_F32, 2, shape, &t) == KILN_OK, "tensor_new");
    if (!t) return;
    /* its header and its 64 bytes on the cpu */
    CHECK(test_invariants(1) == 2, "a live tensor breaks %d invariants, expected 2", test_invariants(1));
    kiln_tensor_free(t);
    CHECK(test_invariants(1) == 0, "after the free: %d broken", test_invariants(1));
}

static void t_model_left_open_is_caught(void)
{
    const char *path = "tests/golden/lora/sd1_kohya.safetensors";
    kiln_model *m = NULL;
    if (kiln_model_open(&path, 1, "left_open", &m) != KILN_OK) { SKIP("%s: %s", path, kiln_last_error()); return; }
    /* mapped, nothing loaded: no bytes allocated, but the model and its tensor headers live */
    CHECK(test_invariants(1) >= 1, "an open model breaks no invariant");
    kiln_model_usage rows[4];
    CHECK(kiln_model_usage_list(rows, 4) == 1 && strcmp(rows[0].model, "left_open") == 0, "the model by name");
    kiln_model_close(m);
    CHECK(test_invariants(1) == 0, "after the close: %d broken", test_invariants(1));
}

/* reserved <= budget is kept by the allocator itself (a lowered budget gives the cached
 * blocks back), so it cannot be broken from here: the check reads the same figures */
static void t_lowered_budget_keeps_reserved_within(void)
{
    kiln_device *sim = kiln_device_get("sim");
    if (!sim) { SKIP("no sim device in this build"); return; }
    int64_t shape[1] = {1 << 16};
    kiln_tensor *t = NULL;
    CHECK(kiln_tensor_new(sim, KILN_F32, 1, shape, &t) == KILN_OK, "tensor_new on sim");
    kiln_tensor_free(t);
    kiln_mem_stats s = kiln_device_stats(sim);
    uint64_t old = s.budget;
    kiln_allocator_set_budget(sim->alloc, s.reserved / 2 ? s.reserved / 2 : 1);
    kiln_mem_stats after = kiln_device_stats(sim);
    int broken = test_invariants(1);
    kiln_allocator_set_budget(sim->alloc, old);
    CHECK(after.reserved <= after.budget && broken == 0, "reserved %llu, budget %llu: %d broken",
          (unsigned long long)after.reserved, (unsigned long long)after.budget, broken);
}

int main(void)
{
    RUN(t_clean_at_start);
    RUN(t_tensor_left_alive_is_caught);
    RUN(t_model_left_open_is_caught);
    RUN(t_lowered_budget_keeps_reserved_within);
    return test_summary();
}

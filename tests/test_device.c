/* test_device.c - the device registry and its seam to the backends: backends reach
 * the runtime only through registration, the thread count through the host
 * backend's table, and kernel workspace follows one policy (counted in the
 * device's statistics, given back by kiln_device_empty_cache). */
#define _POSIX_C_SOURCE 200809L
#include "backend.h"
#include "ops.h"
#include "test.h"

static void t_registration(void)
{
    const kiln_backend *cpu_b = kiln_backend_find("cpu");
    kiln_device *cpu = kiln_device_cpu(), *sim = kiln_device_get("sim");
    CHECK(cpu_b != NULL, "no cpu backend registered");
    CHECK(cpu && cpu->type == KILN_DEV_CPU && cpu->backend == cpu_b, "cpu device on its backend");
    CHECK(sim && sim->backend == cpu_b, "sim computes with the CPU kernels");
    CHECK(kiln_device_at(0) == cpu, "cpu is the first device");
    /* the CUDA backend is always registered: with GPUs, or as a table saying why not */
    const kiln_backend *cuda_b = kiln_backend_find("cuda");
    CHECK(cuda_b && cuda_b->unavailable_reason, "cuda backend registered with a reason");
    CHECK(kiln_backend_find("nope") == NULL, "unknown backend found");
    for (int i = 0; i < kiln_device_count(); i++) {
        kiln_device *d = kiln_device_at(i);
        CHECK(d && d->backend && d->backend->supports, "device %d without a backend table", i);
    }
}

static void t_unknown_devices(void)
{
    CHECK(kiln_device_get("cuda:7") == NULL, "cuda:7 found");
    CHECK(strstr(kiln_last_error(), "cuda:7") && strstr(kiln_last_error(), "devices present: cpu, sim"), "%s",
          kiln_last_error());
    CHECK(kiln_device_get("tpu") == NULL, "tpu found");
    CHECK(strstr(kiln_last_error(), "unknown device 'tpu'"), "%s", kiln_last_error());
}

static void t_threads(void)
{
    int n0 = kiln_threads();
    CHECK(n0 >= 1, "threads %d", n0);
    kiln_set_threads(2);
    CHECK(kiln_threads() == 2, "set 2, got %d", kiln_threads());
    kiln_set_threads(0); /* back to the default */
    CHECK(kiln_threads() == n0, "default %d, got %d", n0, kiln_threads());
}

/* A convolution large enough for the CPU's cached GEMM/Winograd scratch. */
static void t_workspace(void)
{
    kiln_device *cpu = kiln_device_cpu(), *sim = kiln_device_get("sim");
    int64_t sx[4] = {1, 64, 48, 48}, sw[4] = {64, 64, 3, 3};
    kiln_tensor *x = NULL, *w = NULL, *y = NULL;
    kiln_conv_opts o = {{1, 1}, {1, 1}, {1, 1}, 1, 0, 0, 0, NULL};
    CHECK(kiln_tensor_new(cpu, KILN_F32, 4, sx, &x) == KILN_OK && kiln_tensor_new(cpu, KILN_F32, 4, sw, &w) == KILN_OK,
          "%s", kiln_last_error());
    if (!x || !w) return;
    kiln_tensor_fill(x, 0.5);
    kiln_tensor_fill(w, 0.01);
    CHECK(kiln_op_conv2d(x, w, NULL, &o, &y) == KILN_OK, "conv2d: %s", kiln_last_error());
    kiln_mem_stats s = kiln_device_stats(cpu);
    /* host scratch is reported once, on cpu; sim shares it without counting it again */
    CHECK(kiln_device_stats(sim).workspace == 0, "sim counts the host's scratch");
    if (s.workspace == 0) printf("# this CPU's conv path keeps no scratch between calls\n");
    kiln_device_empty_cache(cpu);
    CHECK(kiln_device_stats(cpu).workspace == 0, "workspace %llu after empty_cache",
          (unsigned long long)kiln_device_stats(cpu).workspace);
    /* the next op takes it again, with the same result */
    kiln_tensor *y2 = NULL;
    CHECK(kiln_op_conv2d(x, w, NULL, &o, &y2) == KILN_OK, "conv2d again: %s", kiln_last_error());
    if (y && y2) {
        const float *a = kiln_tensor_data(y), *b = kiln_tensor_data(y2);
        int same = 1;
        for (int64_t i = 0; i < kiln_tensor_numel(y); i++) same &= a[i] == b[i];
        CHECK(same, "results differ after empty_cache");
    }
    CHECK(kiln_device_stats(cpu).workspace == s.workspace, "workspace %llu, before %llu",
          (unsigned long long)kiln_device_stats(cpu).workspace, (unsigned long long)s.workspace);
    kiln_tensor_free(x);
    kiln_tensor_free(w);
    kiln_tensor_free(y);
    kiln_tensor_free(y2);
}

int main(void)
{
    RUN(t_registration);
    RUN(t_unknown_devices);
    RUN(t_threads);
    RUN(t_workspace);
    return test_summary();
}

/* tunables.c - the KILN_* environment variables of the kernels, read only here (and
 * only while the environment is not ignored); the table is their documentation and
 * the check that no kernel reads an undeclared one. */
#include "tunables.h"

#include <assert.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *name;
    const char *what; /* values and effect; the default first */
} tunable;

/* Every tunable kiln reads. A new one is added here, with what it does. */
static const tunable tunables[] = {
    {"KILN_THREADS", "CPU threads of the pool (1 to 256); unset: one per online core. kiln_config.threads "
                     "and kiln.set_threads override it"},
    {"KILN_SPIN", "pause instructions a pool thread spins before sleeping (default 4000); 0 sleeps at once"},
    {"KILN_CPU_ISA", "caps the CPU kernels' instruction set: generic, avx2 or avx512 (default: the best the "
                     "CPU has); avx512 also turns bf16 products off. Read once"},
    {"KILN_CONV_PATH", "forces the CPU convolution path where it applies: gemm, winograd, winograd-few, "
                       "im2col or direct (default: chosen per shape)"},
    {"KILN_WINOGRAD_TILE", "forces the Winograd output tile: 4 or 6 (default: chosen per shape)"},
    {"KILN_WINOGRAD_FEW_TILE", "forces the few-tiles Winograd output tile: 2 or 4 (default: chosen per shape)"},
    {"KILN_WINOGRAD_FEW_CACHE", "which few-tiles Winograd weights bf16 keeps transformed: f23 (F(2,3) only, the "
                                "default), all (F(4,3) too: 4x the weights), none"},
    {"KILN_CUDA_SYNC", "1: synchronise after every CUDA kernel (errors reported at the op that made them)"},
    {"KILN_CUDA_TF32", "1: let cuBLAS and cuDNN compute f32 products in TF32"},
    {"KILN_CUDA_CONV_BENCHMARK", "1: time cuDNN's convolution algorithms once per shape and keep the fastest"},
    {"KILN_CUDA_STAGING_MB", "MiB of pinned host memory per staging slot of a CUDA device (default 8)"},
};

static atomic_int use_env = 1;

void kiln_tunables_use_env(int use)
{
    atomic_store(&use_env, use != 0);
}

static int declared(const char *name)
{
    for (size_t i = 0; i < sizeof tunables / sizeof tunables[0]; i++)
        if (strcmp(tunables[i].name, name) == 0) return 1;
    return 0;
}

const char *kiln_tunable_str(const char *name)
{
    assert(declared(name) && "a tunable missing from tunables.c's table");
    (void)declared;
    if (!atomic_load(&use_env)) return NULL;
    const char *e = getenv(name);
    return e && *e ? e : NULL;
}

int kiln_tunable_int(const char *name, int def)
{
    const char *e = kiln_tunable_str(name);
    if (!e) return def;
    char *end;
    long v = strtol(e, &end, 10);
    if (end == e || *end != '\0' || v < -(1L << 30) || v > (1L << 30)) return def;
    return (int)v;
}

int kiln_tunable_flag(const char *name)
{
    const char *e = kiln_tunable_str(name);
    return e && strcmp(e, "0") != 0;
}

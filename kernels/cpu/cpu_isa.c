/* cpu_isa.c - see cpu_isa.h. */
#include "cpu_isa.h"
#include "../../runtime/tunables.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

int kiln_cpu_isa(void)
{
    static atomic_int cached = -1;
    int c = atomic_load_explicit(&cached, memory_order_relaxed);
    if (c < 0) {
        c = ISA_GENERIC;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
        __builtin_cpu_init();
        const char *e = kiln_tunable_str("KILN_CPU_ISA");
        int cap = !e ? ISA_AVX512 : !strcmp(e, "generic") ? ISA_GENERIC : !strcmp(e, "avx2") ? ISA_AVX2 : ISA_AVX512;
        if (__builtin_cpu_supports("avx512f")) c = ISA_AVX512;
        else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) c = ISA_AVX2;
        if (c > cap) c = cap;
#endif
        atomic_store_explicit(&cached, c, memory_order_relaxed);
    }
    return c;
}

int kiln_cpu_has_bf16(void)
{
    static atomic_int cached = -1;
    int c = atomic_load_explicit(&cached, memory_order_relaxed);
    if (c < 0) {
        c = 0;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 10)
        const char *e = kiln_tunable_str("KILN_CPU_ISA");
        c = kiln_cpu_isa() == ISA_AVX512 && __builtin_cpu_supports("avx512bf16") && !(e && !strcmp(e, "avx512"));
#endif
        atomic_store_explicit(&cached, c, memory_order_relaxed);
    }
    return c;
}

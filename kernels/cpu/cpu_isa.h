/* cpu_isa.h - which hand-written SIMD kernel set this CPU runs (private to the
 * CPU backend). Detected once with __builtin_cpu_supports; KILN_CPU_ISA=generic,
 * avx2 or avx512 (no AVX512_BF16) caps it, so tests and benches can run every path on one machine. */
#ifndef KILN_CPU_ISA_H
#define KILN_CPU_ISA_H

/* ORDER ISA: higher is wider */
enum { ISA_GENERIC, ISA_AVX2, ISA_AVX512 };

int kiln_cpu_isa(void);
/* 1 when the AVX-512 kernels run and the CPU has AVX512_BF16 (vdpbf16ps);
 * KILN_CPU_ISA=avx512 hides it (the bf16 products then run emulated). */
int kiln_cpu_has_bf16(void);

#endif

/* cpu_isa.h - which hand-written SIMD kernel set this CPU runs (private to the
 * CPU backend). Detected once with __builtin_cpu_supports; KILN_CPU_ISA=generic or
 * avx2 caps it, so tests and benches can run every path on one machine. */
#ifndef KILN_CPU_ISA_H
#define KILN_CPU_ISA_H

/* ORDER ISA: higher is wider */
enum { ISA_GENERIC, ISA_AVX2, ISA_AVX512 };

int kiln_cpu_isa(void);

#endif

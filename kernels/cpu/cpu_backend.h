/* cpu_backend.h - the CPU backend's tensor-level entry points (the operation table
 * in backend_cpu.c points at these) and its registrar (kernels/backends.c). */
#ifndef KILN_CPU_BACKEND_H
#define KILN_CPU_BACKEND_H

#include "../../runtime/backend.h"
#include "cpu_kernels.h"

/* Hands the CPU operation table ("cpu", computing for the cpu and sim devices) to
 * the runtime. */
void kiln_cpu_backend_register(void);

kiln_status kiln_cpu_copy(kiln_tensor *dst, const kiln_tensor *src);
kiln_status kiln_cpu_fill(kiln_tensor *t, double v);
kiln_status kiln_cpu_binary(kiln_binop op, kiln_tensor *out, const kiln_tensor *a,
                            const kiln_tensor *b, double s, int swap);
kiln_status kiln_cpu_unary(kiln_unop op, kiln_tensor *out, const kiln_tensor *a, double p0, double p1);
kiln_status kiln_cpu_reduce(kiln_redop op, kiln_tensor *out, const kiln_tensor *a, int dim, int unbiased);

/* Precision int8's packed form of weight w for a product over M rows (a linear layer's
 * rows, a 1x1 convolution's pixels), kept as a cache derived from w's storage: its
 * bytes and its key (device.h's kiln_storage_derived_*), or 0 where the product keeps
 * none (another precision, too few rows, no VNNI, a mapped weight in memory mode low). The meta device
 * models the cache from the same plan. */
size_t kiln_cpu_int8_cache_plan(const kiln_tensor *w, int64_t M, uint64_t key[4]);
/* Precision bf16's form of a linear layer's weight w (its pair slivers) for a product
 * over M rows, as the int8 plan above: the cache's bytes and key, or 0 where the layer
 * rounds its weight per call (another precision, memory mode low, too small a product,
 * no AVX-512). */
size_t kiln_cpu_bf16_cache_plan(const kiln_tensor *w, int64_t M, uint64_t key[4]);
/* The same for a convolution's weights transformed as its path multiplies them
 * (cpu_kernels.h's kiln_cpu_conv2d_weight_cache_plan: bf16's few-tiles Winograd U). */
size_t kiln_cpu_conv2d_cache_plan(const kiln_tensor *w, const kiln_conv2d_params *p, uint64_t key[4]);

#endif

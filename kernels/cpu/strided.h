/* strided.h - iteration over up to three strided operands of one shape, shared by
 * the CPU elementwise, copy and reduction kernels. Dimensions that are contiguous
 * for every operand are merged first, so the common cases become one flat loop. */
#ifndef KILN_CPU_STRIDED_H
#define KILN_CPU_STRIDED_H

#include "../../runtime/tensor.h"

typedef struct {
    int ndim;                        /* after merging; >= 1 */
    int nops;
    int64_t shape[KILN_MAX_DIMS];
    int64_t stride[3][KILN_MAX_DIMS]; /* elements */
    char *base[3];
    size_t esize[3];
} kiln_iter;

/* ops[0] is the output; all must have the same shape (inputs already expanded). */
void kiln_iter_init(kiln_iter *it, int nops, const kiln_tensor *const *ops);

/* Calls fn(ctx, n, ptrs, strides) for every run along the innermost dimension, in
 * parallel over the outer index when the total work is large. ptrs point at the
 * first element of the run; strides are in elements. */
typedef void (*kiln_iter_fn)(void *ctx, int64_t n, char **ptrs, const int64_t *strides);
void kiln_iter_run(const kiln_iter *it, kiln_iter_fn fn, void *ctx);

#endif

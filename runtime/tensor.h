/* tensor.h - the tensor: dtype, shape, strides and a byte offset into a
 * reference-counted storage. Dimensions are 0-based here (the Lua binding maps
 * Lua's 1-based dims). Views share storage; nothing copies implicitly.
 * layer 4 of the memory core: uses device, backend_table, dtype, convert; never calls meta, trace. */
#ifndef KILN_TENSOR_H
#define KILN_TENSOR_H

#include "convert.h"
#include "device.h"

#define KILN_MAX_DIMS 8

typedef struct kiln_tensor {
    kiln_storage *storage;
    size_t offset;                    /* bytes */
    kiln_dtype dtype;
    int ndim;
    int64_t shape[KILN_MAX_DIMS];
    int64_t stride[KILN_MAX_DIMS];    /* in elements */
} kiln_tensor;

static inline void *kiln_tensor_data(const kiln_tensor *t)
{
    return (char *)t->storage->data + t->offset;
}

int64_t kiln_tensor_numel(const kiln_tensor *t);
size_t kiln_tensor_nbytes(const kiln_tensor *t);
int kiln_tensor_is_contiguous(const kiln_tensor *t);
int kiln_shape_equal(const kiln_tensor *a, const kiln_tensor *b);
/* "[1,4,64,64]" into buf */
const char *kiln_shape_str(const kiln_tensor *t, char *buf, size_t n);

/* Merges the dimensions of nops operands of one shape (ops[0] gives it): drops
 * size-1 dims and fuses neighbours contiguous in every operand, so elementwise
 * loops (CPU and CUDA) run over as few, as long dims as possible. Returns the
 * number of dims (>= 1) and fills shape[d] and stride[k][d] (elements). */
int kiln_tensor_coalesce(int nops, const kiln_tensor *const *ops, int64_t *shape,
                         int64_t (*stride)[KILN_MAX_DIMS]);

/* New contiguous tensor, contents undefined. */
kiln_status kiln_tensor_new(kiln_device *dev, kiln_dtype dt, int ndim,
                            const int64_t *shape, kiln_tensor **out);
kiln_status kiln_tensor_zeros(kiln_device *dev, kiln_dtype dt, int ndim,
                              const int64_t *shape, kiln_tensor **out);
/* New tensor header over storage s (retained). */
kiln_tensor *kiln_tensor_from_storage(kiln_storage *s, size_t offset, kiln_dtype dt,
                                      int ndim, const int64_t *shape, const int64_t *stride);
void kiln_tensor_free(kiln_tensor *t);

/* Views (share storage) */
kiln_tensor *kiln_tensor_view_of(const kiln_tensor *t);
kiln_status kiln_tensor_reshape(const kiln_tensor *t, int ndim, const int64_t *shape, kiln_tensor **out); /* view when possible, else copy */
kiln_status kiln_tensor_permute(const kiln_tensor *t, const int *perm, kiln_tensor **out);
kiln_status kiln_tensor_transpose(const kiln_tensor *t, int d0, int d1, kiln_tensor **out);
kiln_status kiln_tensor_narrow(const kiln_tensor *t, int dim, int64_t start, int64_t len, kiln_tensor **out);
kiln_status kiln_tensor_expand(const kiln_tensor *t, int ndim, const int64_t *shape, kiln_tensor **out);
kiln_status kiln_tensor_squeeze(const kiln_tensor *t, int dim, kiln_tensor **out);   /* dim -1: all size-1 */
kiln_status kiln_tensor_unsqueeze(const kiln_tensor *t, int dim, kiln_tensor **out);

/* Copies */
kiln_status kiln_tensor_contiguous(const kiln_tensor *t, kiln_tensor **out); /* view (retained) if already */
kiln_status kiln_tensor_to(const kiln_tensor *t, kiln_device *dev, kiln_dtype dt, kiln_tensor **out);
/* dst[...] = src with broadcasting and dtype conversion; same device. */
kiln_status kiln_tensor_copy(kiln_tensor *dst, const kiln_tensor *src);
kiln_status kiln_tensor_fill(kiln_tensor *t, double v);

#endif

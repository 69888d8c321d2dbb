/* ops.h - tensor operations as the runtime offers them: argument, shape, dtype and
 * device checks with messages that name the op and the shapes, output allocation on
 * the inputs' device, then dispatch to that device's backend table. */
#ifndef KILN_OPS_H
#define KILN_OPS_H

#include "backend.h"

/* Result dtype of a binary op between two tensors (NumPy/torch-like promotion). */
kiln_dtype kiln_promote(kiln_dtype a, kiln_dtype b);

kiln_status kiln_op_binary(kiln_binop op, const kiln_tensor *a, const kiln_tensor *b, kiln_tensor **out);
/* a op s, or s op a when swap */
kiln_status kiln_op_binary_scalar(kiln_binop op, const kiln_tensor *a, double s, int swap, kiln_tensor **out);
kiln_status kiln_op_unary(kiln_unop op, const kiln_tensor *a, double p0, double p1, kiln_tensor **out);
/* dim < 0: over all elements (result has shape [] unless keepdim) */
kiln_status kiln_op_reduce(kiln_redop op, const kiln_tensor *a, int dim, int keepdim, int unbiased, kiln_tensor **out);
kiln_status kiln_op_matmul(const kiln_tensor *a, const kiln_tensor *b, kiln_tensor **out);
kiln_status kiln_op_linear(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b, kiln_tensor **out);
kiln_status kiln_op_conv2d(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                           const kiln_conv_opts *o, kiln_tensor **out);
kiln_status kiln_op_group_norm(const kiln_tensor *x, int64_t groups, const kiln_tensor *w,
                               const kiln_tensor *b, double eps, int silu, kiln_tensor **out);
/* The same, written over x (contiguous f32, its storage not shared with another tensor
 * nor mapped from a file): a network that no longer needs its input saves a tensor. */
kiln_status kiln_op_group_norm_in_place(kiln_tensor *x, int64_t groups, const kiln_tensor *w,
                                        const kiln_tensor *b, double eps, int silu);
kiln_status kiln_op_layer_norm(const kiln_tensor *x, const kiln_tensor *w, const kiln_tensor *b,
                               double eps, kiln_tensor **out);
kiln_status kiln_op_softmax(const kiln_tensor *x, int dim, kiln_tensor **out);
kiln_status kiln_op_attention(const kiln_tensor *q, const kiln_tensor *k, const kiln_tensor *v,
                              double scale, int causal, kiln_tensor **out);
kiln_status kiln_op_geglu(const kiln_tensor *x, kiln_tensor **out);
kiln_status kiln_op_resample(kiln_resample mode, const kiln_tensor *x, int64_t oh, int64_t ow, kiln_tensor **out);
/* pads: left, right, top, bottom (F.pad order); mode kiln_pad_mode */
kiln_status kiln_op_pad2d(const kiln_tensor *x, const int64_t *pads, int mode, double value, kiln_tensor **out);
kiln_status kiln_op_cat(const kiln_tensor *const *list, int n, int dim, kiln_tensor **out);
kiln_status kiln_op_arange(kiln_device *dev, double start, double stop, double step, kiln_dtype dt, kiln_tensor **out);
kiln_status kiln_op_linspace(kiln_device *dev, double start, double stop, int64_t n, kiln_dtype dt, kiln_tensor **out);

#endif

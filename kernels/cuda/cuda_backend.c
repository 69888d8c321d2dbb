/* cuda_backend.c - the CUDA backend's operation table: the ops of the .cu files
 * (cuda_ops.h) and the device-level entries of the contexts (cuda_context.h). The top
 * of the backend: nothing in it calls back into this file. */
#include "cuda_ops.h"
#include "cuda_register.h"

/* Every op takes every dtype: float compute ops convert integer inputs to f32. */
static int cuda_supports(kiln_op op, kiln_dtype dt)
{
    return op >= 0 && op < KILN_OP_COUNT && (unsigned)dt < KILN_DTYPE_COUNT;
}

static void cuda_register_devices(void);

static const kiln_backend cuda_backend = {
    .name = "cuda",
    .supports = cuda_supports,
    .copy = kiln_cuda_copy,
    .fill = kiln_cuda_fill,
    .binary = kiln_cuda_binary,
    .unary = kiln_cuda_unary,
    .reduce = kiln_cuda_reduce,
    .matmul = kiln_cuda_matmul,
    .linear = kiln_cuda_linear,
    .conv2d = kiln_cuda_conv2d,
    .group_norm = kiln_cuda_group_norm,
    .layer_norm = kiln_cuda_layer_norm,
    .softmax = kiln_cuda_softmax,
    .attention = kiln_cuda_attention,
    .geglu = kiln_cuda_geglu,
    .resample = kiln_cuda_resample,
    .pad2d = kiln_cuda_pad2d,
    .workspace_bytes = kiln_cuda_workspace_bytes,
    .workspace_release = kiln_cuda_workspace_release,
    .to_device = kiln_cuda_to_device,
    .to_host = kiln_cuda_to_host,
    .register_devices = cuda_register_devices,
    .unavailable_reason = kiln_cuda_unavailable_reason,
    .activation_dtype = kiln_cuda_activation_dtype,
};

/* The registry calls it once, its lock held; the devices point back at this table. */
static void cuda_register_devices(void) { kiln_cuda_register_devices(&cuda_backend); }

void kiln_cuda_backend_register(void) { kiln_backend_register(&cuda_backend); }

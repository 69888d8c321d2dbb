/* activation.h - the dtype the networks keep their activations in on a device: the
 * precision in effect there (precision.h) where the device's backend runs the
 * networks' ops natively in it (CUDA: f16 / bf16 on tensor cores), else f32 (the CPU
 * keeps f32 activations and rounds to bf16 inside its GEMMs). Network scripts
 * convert their input to it at the entry and their output back at the exit. */
#ifndef KILN_ACTIVATION_H
#define KILN_ACTIVATION_H

#include "device.h"
#include "dtype.h"

/* KILN_F32, KILN_F16 or KILN_BF16; dev NULL means the host (f32). Thread-safe. */
kiln_dtype kiln_activation_dtype(kiln_device *dev);

#endif

/* backend.h - what a compute backend's code includes: the operation table it fills
 * (backend_table.h), the tensors it computes on (tensor.h) and the device registry it
 * registers with (device.h). A new op or backend follows ops.c's path: validate,
 * allocate, dispatch through the table. */
#ifndef KILN_BACKEND_H
#define KILN_BACKEND_H

#include "backend_table.h"
#include "tensor.h"

/* ---- registration: the one seam between the runtime and kernels/ ----
 * The runtime knows no backend by name of function: the initialisation code hands the
 * backends in before the first device is used (kernels/backends.h's
 * kiln_backends_register_all, which luaopen_kiln and the test programs call), each
 * through kiln_backend_register (device.h). The devices are created from what was
 * handed in at their first use. */

#endif

/* backends.c - the backends this build links, in the order the runtime meets them,
 * handed in by the initialisation code (backends.h): kernels/ sits above the runtime
 * and is called only through these tables. A new backend adds its registrar here and
 * nowhere else. */
#include "backends.h"
#include "cpu/cpu_backend.h"
#include "cuda/cuda_register.h"
#include "meta/meta_backend.h"

void kiln_backends_register_all(void)
{
    kiln_cpu_backend_register();  /* first: it computes for the host devices */
    kiln_cuda_backend_register(); /* the GPUs, or a table that says why there are none */
    kiln_meta_backend_register(); /* shapes without data: the dry runs' device (listed last) */
}

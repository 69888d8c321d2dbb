/* cuda_none.c - the CUDA seam when kiln is built without CUDA (CUDA=0 or no nvcc):
 * no device is registered and `--device cuda` explains why. */
#include "../../runtime/backend.h"

void kiln_cuda_register_devices(void) {}

const char *kiln_cuda_unavailable_reason(void)
{
    return "this kiln was built without CUDA support (rebuild with nvcc present and CUDA=1)";
}

/* cuda_none.c - the CUDA backend when kiln is built without CUDA (CUDA=0 or no
 * nvcc): a table with no operation and no device, whose only use is to say why
 * `--device cuda` finds nothing. */
#include "cuda_register.h"
#include "../../runtime/backend.h"

static int none_supports(kiln_op op, kiln_dtype dt)
{
    (void)op;
    (void)dt;
    return 0;
}

static const char *none_reason(void)
{
    return "this kiln was built without CUDA support (rebuild with nvcc present and CUDA=1)";
}

static const kiln_backend none_backend = {
    .name = "cuda",
    .supports = none_supports,
    .unavailable_reason = none_reason,
};

void kiln_cuda_backend_register(void) { kiln_backend_register(&none_backend); }

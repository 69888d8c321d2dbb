/* activation.c - see activation.h: the precision of the device, narrowed by what
 * its backend runs natively (backend.h's activation_dtype entry). */
#include "activation.h"

#include "backend.h"
#include "precision.h"

kiln_dtype kiln_activation_dtype(kiln_device *dev)
{
    if (!dev || !dev->backend || !dev->backend->activation_dtype) return KILN_F32;
    kiln_precision p = kiln_precision_for(dev);
    if (p == KILN_PREC_F32) return KILN_F32;
    kiln_dtype want = p == KILN_PREC_F16 ? KILN_F16 : KILN_BF16; /* int8 keeps bf16 between its products */
    kiln_dtype got = dev->backend->activation_dtype(dev, want);
    return got == KILN_F16 || got == KILN_BF16 ? got : KILN_F32;
}

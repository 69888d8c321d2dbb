/* fuzz_model.h - for the harnesses of weight files (safetensors, GGUF): a small input
 * that opened as a file is also opened as a kiln model and loaded to the cpu (the
 * model store's own reading of the same header and data). */
#ifndef KILN_FUZZ_MODEL_H
#define KILN_FUZZ_MODEL_H

#include "device.h"
#include "model.h"

static inline void fuzz_open_as_model(const char *path)
{
    kiln_model *m = NULL;
    if (kiln_model_open(&path, 1, "fuzz", &m) != KILN_OK) return;
    if (kiln_model_load(m, kiln_device_cpu(), KILN_F32) == KILN_OK && kiln_model_count(m) > 0) {
        kiln_tensor *t = NULL;
        if (kiln_model_tensor(m, kiln_model_tensor_name(m, 0), &t) == KILN_OK) kiln_tensor_free(t);
    }
    kiln_model_close(m);
}

#endif

/* cuda_register.h - the CUDA backend's registrar, without the CUDA headers, so
 * kernels/backends.c builds with or without CUDA: cuda_backend.c defines it over
 * the GPUs, cuda_none.c (a build without CUDA) as a table with no device. */
#ifndef KILN_CUDA_REGISTER_H
#define KILN_CUDA_REGISTER_H

void kiln_cuda_backend_register(void);

#endif

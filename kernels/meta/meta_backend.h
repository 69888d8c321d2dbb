/* meta_backend.h - the meta device's operation table (no arithmetic) and its
 * registrar (kernels/backends.c). */
#ifndef KILN_META_BACKEND_H
#define KILN_META_BACKEND_H

void kiln_meta_backend_register(void);

#endif

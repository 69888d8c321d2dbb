/* sha256.h - SHA-256 (FIPS 180-4), for model file hashes: A1111 and other tools
 * name a checkpoint in PNG metadata by the first 10 hex digits of its SHA-256. */
#ifndef KILN_SHA256_H
#define KILN_SHA256_H

#include "status.h"

typedef struct {
    uint32_t h[8];
    uint64_t len;
    uint8_t buf[64];
    size_t fill;
} kiln_sha256;

void kiln_sha256_init(kiln_sha256 *c);
void kiln_sha256_update(kiln_sha256 *c, const void *data, size_t n);
void kiln_sha256_final(kiln_sha256 *c, uint8_t out[32]);
/* Hex digest (65 bytes with NUL) of a file from byte `skip` to its end (0: the
 * whole file; LoRA hashes skip a safetensors file's header). */
kiln_status kiln_sha256_file(const char *path, uint64_t skip, char hex[65]);

#endif

/* rng.h - PyTorch-compatible CPU random numbers.
 * kiln_rng_randn_f32(seed, ...) gives the same f32 values as
 * torch.manual_seed(seed); torch.randn(n) on the CPU (mt19937 seeded as
 * torch.manual_seed does; Box-Muller exactly as ATen's normal_ for small (< 16)
 * and vectorized (>= 16) sizes), and kiln_rng_rand_f32 matches torch.rand. */
#ifndef KILN_RNG_H
#define KILN_RNG_H

#include "status.h"

typedef struct {
    uint32_t mt[624];
    int index;
    /* ATen's CPUGeneratorImpl caches the second Box-Muller value for scalar normals */
    int has_next_double_normal;
    double next_double_normal;
    int has_next_float_normal;
    float next_float_normal;
} kiln_rng;

void kiln_rng_seed(kiln_rng *g, uint64_t seed);
uint32_t kiln_rng_u32(kiln_rng *g);
uint64_t kiln_rng_u64(kiln_rng *g);
/* Fill n floats as torch.randn(n) / torch.rand(n) would from generator state g
 * (successive calls continue the stream as successive torch calls do). */
void kiln_rng_randn_f32(kiln_rng *g, float *out, int64_t n);
void kiln_rng_rand_f32(kiln_rng *g, float *out, int64_t n);

#endif

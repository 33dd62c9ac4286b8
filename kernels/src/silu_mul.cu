// silu_mul: out[t][i] = silu(gu[t][i]) * gu[t][ff + i], where gu is the fused
// gate|up projection [rows][2*ff]. grid = (ceil(ff / 256), rows), block = 256.
#include "common.cuh"

ROCKET_KERNEL void silu_mul(const float* __restrict__ gu, float* __restrict__ out, int ff) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ff) return;
    const float* r = gu + (size_t)blockIdx.y * 2 * ff;
    const float g = r[i];
    out[(size_t)blockIdx.y * ff + i] = g / (1.0f + __expf(-g)) * r[ff + i];
}

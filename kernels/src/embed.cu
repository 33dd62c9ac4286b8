// embed_gather: x[row][:] = table[tokens[row]][:] widened to f32.
// grid = rows, block = 256. `hidden` any size.
#include "common.cuh"

ROCKET_KERNEL void embed_gather(const uint16_t* __restrict__ table, const uint32_t* __restrict__ tokens,
                                float* __restrict__ x, int hidden) {
    pdl_enter();
    const uint16_t* src = table + (size_t)tokens[blockIdx.x] * hidden;
    float* dst = x + (size_t)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = bf16_to_f32(src[i]);
}

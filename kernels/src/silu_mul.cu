// silu_mul: out[t][i] = silu(gu[t][i]) * gu[t][ff + i], where gu is the fused
// gate|up projection [rows][2*ff]. grid = (ceil(ff / 256), rows), block = 256.
//
// silu_mul_f16: the same values rounded to fp16 as to_f16 rounds them, for the
// down-projection on cuBLASLt's fp16 operands; a finite value past fp16's range
// sets *overflow. Same grid.
#include "common.cuh"

__device__ __forceinline__ float silu_times(const float* gu, int ff, int i) {
    const float* r = gu + (size_t)blockIdx.y * 2 * ff;
    const float g = r[i];
    return g / (1.0f + __expf(-g)) * r[ff + i];
}

ROCKET_KERNEL void silu_mul(const float* __restrict__ gu, float* __restrict__ out, int ff) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ff) return;
    out[(size_t)blockIdx.y * ff + i] = silu_times(gu, ff, i);
}

ROCKET_KERNEL void silu_mul_f16(const float* __restrict__ gu, uint16_t* __restrict__ out, int ff, unsigned* __restrict__ overflow) {
    pdl_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ff) return;
    bool over = false;
    out[(size_t)blockIdx.y * ff + i] = f32_to_f16(silu_times(gu, ff, i), over);
    if (over) atomicOr(overflow, 1u);
}

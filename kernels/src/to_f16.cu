// The cuBLASLt products' fp16 operands (backend/cuda/cublas.rs): fp16 keeps 11
// significant bits where bf16 keeps 8, at the same tensor-core rate, so one
// product on fp16 operands replaces the two on bf16 hi and lo parts.
//
// to_f16: y[i] = x[i] rounded to fp16 (to nearest even, as half::f16::from_f32).
// A finite x that rounds past fp16's range (|x| >= 65520) sets *overflow, and the
// host redoes the pass on the bf16 hi+lo products. grid = ceil(n / 1024),
// block = 256, 4 elements a thread.
//
// bf16_to_f16: the fp16 copy of a weight matrix, made once. Exact but for
// magnitudes below fp16's normal range (2^-14), which keep fewer bits; a weight
// past its range sets *overflow, and the copy is not used. Same grid.
//
// rms_norm.cu and silu_mul.cu have fp16 outputs of their own (the same rounding,
// the same flag), so the inputs of the layers' products are not written in f32
// and read back only to be rounded.
#include "common.cuh"

ROCKET_KERNEL void to_f16(const float* __restrict__ x, uint16_t* __restrict__ y, int n, unsigned* __restrict__ overflow) {
    pdl_enter();
    const int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    bool over = false;
    if (i + 4 <= n) {
        *reinterpret_cast<ushort4*>(y + i) = f32x4_to_f16(*reinterpret_cast<const float4*>(x + i), over);
    } else {
        for (int j = i; j < n; j++) y[j] = f32_to_f16(x[j], over);
    }
    if (over) atomicOr(overflow, 1u);
}

ROCKET_KERNEL void bf16_to_f16(const uint16_t* __restrict__ x, uint16_t* __restrict__ y, int n, unsigned* __restrict__ overflow) {
    pdl_enter();
    const int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    bool over = false;
    if (i + 4 <= n) {
        const ushort4 v = *reinterpret_cast<const ushort4*>(x + i);
        ushort4 h;
        h.x = f32_to_f16(bf16_to_f32(v.x), over);
        h.y = f32_to_f16(bf16_to_f32(v.y), over);
        h.z = f32_to_f16(bf16_to_f32(v.z), over);
        h.w = f32_to_f16(bf16_to_f32(v.w), over);
        *reinterpret_cast<ushort4*>(y + i) = h;
    } else {
        for (int j = i; j < n; j++) y[j] = f32_to_f16(bf16_to_f32(x[j]), over);
    }
    if (over) atomicOr(overflow, 1u);
}

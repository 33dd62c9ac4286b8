// to_bf16_split: hi[i] = x[i] rounded to bf16 (to nearest even, as the host's
// half::bf16::from_f32) and lo[i] = (x[i] - hi[i]) rounded the same way, for
// the cuBLASLt matmul path (backend/cuda/cublas.rs): its inputs are bf16, and
// hi·W + lo·W keeps ~16 bits of each activation, as the tensor-core GEMM's
// hi+lo split does. grid = ceil(n / 1024), block = 256, 4 elements a thread.
#include "common.cuh"

__device__ __forceinline__ void split(float v, uint16_t& hi, uint16_t& lo) {
    hi = f32_to_bf16(v);
    const float h = bf16_to_f32(hi);
    lo = isfinite(h) ? f32_to_bf16(v - h) : (uint16_t)0;  // inf stays inf, NaN NaN
}

ROCKET_KERNEL void to_bf16_split(const float* __restrict__ x, uint16_t* __restrict__ hi, uint16_t* __restrict__ lo, int n) {
    pdl_enter();
    const int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 4 <= n) {
        const float4 v = *reinterpret_cast<const float4*>(x + i);
        ushort4 h, l;
        split(v.x, h.x, l.x);
        split(v.y, h.y, l.y);
        split(v.z, h.z, l.z);
        split(v.w, h.w, l.w);
        *reinterpret_cast<ushort4*>(hi + i) = h;
        *reinterpret_cast<ushort4*>(lo + i) = l;
    } else {
        for (int j = i; j < n; j++) split(x[j], hi[j], lo[j]);
    }
}

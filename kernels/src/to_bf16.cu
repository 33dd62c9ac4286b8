// to_bf16: y[i] = x[i] rounded to bf16 (to nearest even, as the host's
// half::bf16::from_f32), for the cuBLASLt matmul path (backend/cuda/cublas.rs),
// whose inputs are bf16. grid = ceil(n / 1024), block = 256, 4 elements a thread.
#include "common.cuh"

ROCKET_KERNEL void to_bf16(const float* __restrict__ x, uint16_t* __restrict__ y, int n) {
    pdl_enter();
    const int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (i + 4 <= n) {
        const float4 v = *reinterpret_cast<const float4*>(x + i);
        const ushort4 o = make_ushort4(f32_to_bf16(v.x), f32_to_bf16(v.y), f32_to_bf16(v.z), f32_to_bf16(v.w));
        *reinterpret_cast<ushort4*>(y + i) = o;
    } else {
        for (int j = i; j < n; j++) y[j] = f32_to_bf16(x[j]);
    }
}

// rms_norm: out[r] = x[src_row(r)] * rsqrt(mean(x^2) + eps) * w, HF's RMSNorm in f32.
// grid = output rows, block = a multiple of 32 (<= 1024). `row_map` picks the input
// row of each output row (nullptr: the same row) so the final norm can gather the
// last token of each sequence. In place (out == x) is allowed when row_map is null:
// each thread rewrites only the elements it read.
// Used for the layer norms (dim = hidden) and the Qwen3 q/k norms (one row per head).
//
// rms_norm_f16: the same values rounded to fp16 as to_f16 rounds them (the bits of
// rms_norm then to_f16), for a cuBLASLt product on fp16 operands; a finite value
// past fp16's range sets *overflow. Same grid, no row_map.
#include "common.cuh"

// The row's scale: every thread of the block gets it.
__device__ __forceinline__ float rms_scale(const float* xr, int dim, float eps) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    return rsqrtf(block_sum(ss) / (float)dim + eps);
}

ROCKET_KERNEL void rms_norm(const float* x, const float* __restrict__ w, float* out, int dim, float eps,
                            const int32_t* __restrict__ row_map) {
    pdl_enter();
    const int src = row_map ? row_map[blockIdx.x] : blockIdx.x;
    const float* xr = x + (size_t)src * dim;
    float* orow = out + (size_t)blockIdx.x * dim;
    const float scale = rms_scale(xr, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = w[i] * (xr[i] * scale);
}

ROCKET_KERNEL void rms_norm_f16(const float* __restrict__ x, const float* __restrict__ w, uint16_t* __restrict__ out, int dim,
                                float eps, unsigned* __restrict__ overflow) {
    pdl_enter();
    const float* xr = x + (size_t)blockIdx.x * dim;
    uint16_t* orow = out + (size_t)blockIdx.x * dim;
    const float scale = rms_scale(xr, dim, eps);
    bool over = false;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = f32_to_f16(w[i] * (xr[i] * scale), over);
    if (over) atomicOr(overflow, 1u);
}

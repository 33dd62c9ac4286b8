// rms_norm: out[r] = x[src_row(r)] * rsqrt(mean(x^2) + eps) * w, HF's RMSNorm in f32.
// grid = output rows, block = a multiple of 32 (<= 1024). `row_map` picks the input
// row of each output row (nullptr: the same row) so the final norm can gather the
// last token of each sequence. In place (out == x) is allowed when row_map is null:
// each thread rewrites only the elements it read.
// Used for the layer norms (dim = hidden) and the Qwen3 q/k norms (one row per head).
#include "common.cuh"

ROCKET_KERNEL void rms_norm(const float* x, const float* __restrict__ w, float* out, int dim, float eps,
                            const int32_t* __restrict__ row_map) {
    pdl_enter();
    const int src = row_map ? row_map[blockIdx.x] : blockIdx.x;
    const float* xr = x + (size_t)src * dim;
    float* orow = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    const float scale = rsqrtf(block_sum(ss) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = w[i] * (xr[i] * scale);
}

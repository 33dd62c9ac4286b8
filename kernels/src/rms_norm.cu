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

// Float4 chunks of a row each thread keeps in registers between the sum and the
// output: 4 x 256 threads x 4 = 4,096 elements, every fuel's hidden size. Their
// loads are in flight together (a strided scalar loop issued one round trip per
// element: ~9 us for 512 rows of 2,048, against ~3 for the bytes).
#define RMS_CHUNKS 4

// out(i, y) writes float4 chunk i of the normed row, y = w * (x * scale). Rows of
// dim % 4 == 0 floats at 16-byte aligned addresses (`rms_vectorised`); the sum runs
// over each thread's chunks in order, then block_sum: every thread gets the row's
// scale. Both kernels go through here, so rms_norm_f16's values are rms_norm's
// rounded.
template <class Out>
__device__ __forceinline__ void rms_row4(const float* xr, const float* __restrict__ w, int dim, float eps, Out out) {
    const int n4 = dim >> 2;
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4 v[RMS_CHUNKS];
#pragma unroll
    for (int c = 0; c < RMS_CHUNKS; c++) {
        const int i = threadIdx.x + c * blockDim.x;
        v[c] = i < n4 ? x4[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < RMS_CHUNKS; c++) {
        ss = fmaf(v[c].x, v[c].x, ss);
        ss = fmaf(v[c].y, v[c].y, ss);
        ss = fmaf(v[c].z, v[c].z, ss);
        ss = fmaf(v[c].w, v[c].w, ss);
    }
    for (int i = threadIdx.x + RMS_CHUNKS * blockDim.x; i < n4; i += blockDim.x) {
        const float4 u = x4[i];
        ss = fmaf(u.x, u.x, fmaf(u.y, u.y, fmaf(u.z, u.z, fmaf(u.w, u.w, ss))));
    }
    const float scale = rsqrtf(block_sum(ss) / (float)dim + eps);
    auto normed = [&](float4 x, float4 g) {
        return make_float4(g.x * (x.x * scale), g.y * (x.y * scale), g.z * (x.z * scale), g.w * (x.w * scale));
    };
    // In place (out == x) each thread rewrites only the chunks it read.
#pragma unroll
    for (int c = 0; c < RMS_CHUNKS; c++) {
        const int i = threadIdx.x + c * blockDim.x;
        if (i < n4) out(i, normed(v[c], w4[i]));
    }
    for (int i = threadIdx.x + RMS_CHUNKS * blockDim.x; i < n4; i += blockDim.x) out(i, normed(x4[i], w4[i]));
}

// Whether rows of `dim` floats at x, out (elements of `out_bytes`) and w take float4 chunks.
__device__ __forceinline__ bool rms_vectorised(const void* x, const void* out, int out_bytes, const float* w, int dim) {
    return dim % 4 == 0 && ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) & 15) == 0 &&
           (reinterpret_cast<uintptr_t>(out) & (4 * out_bytes - 1)) == 0;
}

// The row's scale, element by element (rows that do not take float4 chunks):
// every thread of the block gets it.
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
    if (rms_vectorised(x, out, 4, w, dim)) {
        float4* o4 = reinterpret_cast<float4*>(orow);
        rms_row4(xr, w, dim, eps, [&](int i, float4 y) { o4[i] = y; });
        return;
    }
    const float scale = rms_scale(xr, dim, eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = w[i] * (xr[i] * scale);
}

ROCKET_KERNEL void rms_norm_f16(const float* __restrict__ x, const float* __restrict__ w, uint16_t* __restrict__ out, int dim,
                                float eps, unsigned* __restrict__ overflow) {
    pdl_enter();
    const float* xr = x + (size_t)blockIdx.x * dim;
    uint16_t* orow = out + (size_t)blockIdx.x * dim;
    bool over = false;
    if (rms_vectorised(x, out, 2, w, dim)) {
        ushort4* o4 = reinterpret_cast<ushort4*>(orow);
        rms_row4(xr, w, dim, eps, [&](int i, float4 y) { o4[i] = f32x4_to_f16(y, over); });
    } else {
        const float scale = rms_scale(xr, dim, eps);
        for (int i = threadIdx.x; i < dim; i += blockDim.x) orow[i] = f32_to_f16(w[i] * (xr[i] * scale), over);
    }
    if (over) atomicOr(overflow, 1u);
}

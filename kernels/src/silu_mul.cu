// silu_mul: out[t][i] = silu(gu[t][i]) * gu[t][ff + i], where gu is the fused
// gate|up projection [rows][2*ff]. grid = (ceil(ff / 1024), rows), block = 256:
// four consecutive elements a thread, as float4 where ff % 4 == 0 (one load of
// the gate's and one of the up's in flight for four outputs).
//
// silu_mul_f16: the same values rounded to fp16 as to_f16 rounds them, for the
// down-projection on cuBLASLt's fp16 operands; a finite value past fp16's range
// sets *overflow. Same grid.
#include "common.cuh"

__device__ __forceinline__ float silu_of(float g, float u) { return g / (1.0f + __expf(-g)) * u; }

// This thread's four elements of its row: put4(i, a, b, c, d) for elements i..i+3
// where the row takes float4s (`vec`), else put1(j, v) for each.
template <class Put4, class Put1>
__device__ __forceinline__ void silu_mul_each(const float* __restrict__ gu, int ff, bool vec, Put4 put4, Put1 put1) {
    const int i = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    const float* r = gu + (size_t)blockIdx.y * 2 * ff;
    if (vec && i + 4 <= ff) {
        const float4 g = *reinterpret_cast<const float4*>(r + i), u = *reinterpret_cast<const float4*>(r + ff + i);
        put4(i, silu_of(g.x, u.x), silu_of(g.y, u.y), silu_of(g.z, u.z), silu_of(g.w, u.w));
        return;
    }
    for (int j = i; j < min(i + 4, ff); j++) put1(j, silu_of(r[j], r[ff + j]));
}

// Rows of ff % 4 == 0 elements from 16-byte aligned buffers take float4s.
__device__ __forceinline__ bool silu_vectorised(const void* gu, const void* out, int ff) {
    return ff % 4 == 0 && ((reinterpret_cast<uintptr_t>(gu) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
}

ROCKET_KERNEL void silu_mul(const float* __restrict__ gu, float* __restrict__ out, int ff) {
    pdl_enter();
    float* o = out + (size_t)blockIdx.y * ff;
    silu_mul_each(
        gu, ff, silu_vectorised(gu, out, ff),
        [&](int i, float a, float b, float c, float d) { *reinterpret_cast<float4*>(o + i) = make_float4(a, b, c, d); },
        [&](int j, float v) { o[j] = v; });
}

ROCKET_KERNEL void silu_mul_f16(const float* __restrict__ gu, uint16_t* __restrict__ out, int ff, unsigned* __restrict__ overflow) {
    pdl_enter();
    uint16_t* o = out + (size_t)blockIdx.y * ff;
    bool over = false;
    silu_mul_each(
        gu, ff, silu_vectorised(gu, out, ff),
        [&](int i, float a, float b, float c, float d) { *reinterpret_cast<ushort4*>(o + i) = f32x4_to_f16(make_float4(a, b, c, d), over); },
        [&](int j, float v) { o[j] = f32_to_f16(v, over); });
    if (over) atomicOr(overflow, 1u);
}

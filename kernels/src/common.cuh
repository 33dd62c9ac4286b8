// Shared helpers for rocket's kernels. Weights and the KV cache are bf16 held
// as raw uint16_t bits (no CUDA headers needed); activations are f32 and every
// sum accumulates in f32.
#pragma once
#include <stdint.h>

#define ROCKET_KERNEL extern "C" __global__

// Programmatic dependent launch (sm_90). The host launches every kernel of the
// forward pass and the sampler (kernels.rs `Kernels::pdl`) so that its CTAs may
// start while the previous kernel still runs. Every such kernel calls pdl_wait() before it
// reads or writes anything an earlier kernel touches: it returns once the
// previous kernel has finished and its writes are visible (and that kernel
// waited for its own predecessor, so the chain is complete). Only immutable
// data (weights) may be read before it. pdl_launch_dependents() then lets the
// next kernel start its own prologue. Both are no-ops in a plain launch.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// The usual entry of a kernel with nothing to prefetch.
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_launch_dependents();
}

__device__ __forceinline__ float bf16_to_f32(uint16_t b) {
    return __uint_as_float(((uint32_t)b) << 16);
}

// Round to nearest even, as the host's `half::bf16::from_f32` does (NaN kept NaN).
__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// Two f32 -> bf16x2 with cvt.rn (to nearest even, as f32_to_bf16): `lo_k` in
// the low half (the lower column or k of an MMA fragment register).
__device__ __forceinline__ uint32_t bf16x2_rn(float lo_k, float hi_k) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi_k), "f"(lo_k));
    return r;
}

// The hi/lo split of the tensor-core paths (a = hi + lo to ~16 bits of
// mantissa, so two bf16 MMAs multiply an f32 operand): (a, b) -> bf16x2 hi and
// the bf16x2 of what hi left out. (to_bf16.cu's split for cuBLASLt works one
// value at a time and keeps an infinite input's lo at 0.)
__device__ __forceinline__ void split_bf16x2(float a, float b, uint32_t& hi, uint32_t& lo) {
    hi = bf16x2_rn(a, b);
    lo = bf16x2_rn(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xffff0000u));
}

// Byte offset of 16-byte chunk c of row r in a tile of 128-byte rows whose chunks
// are XOR-swizzled by the row (the tensor-core GEMM's tiles; wgmma's 128-byte swizzle
// on a 1,024-byte-aligned tile).
__device__ __forceinline__ int swizzled(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// Eight bf16 packed in 16 bytes -> eight floats.
__device__ __forceinline__ void unpack8(uint4 w, float* out) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// v rounded to fp16 (to nearest even, as half::f16::from_f32); a finite v that
// rounds past fp16's range (|v| >= 65520) sets `over` (to_f16.cu).
__device__ __forceinline__ uint16_t f32_to_f16(float v, bool& over) {
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    over |= (h & 0x7fffu) == 0x7c00u && isfinite(v);
    return h;
}

// Four values rounded as f32_to_f16 rounds each (the range flag likewise).
__device__ __forceinline__ ushort4 f32x4_to_f16(float4 v, bool& over) {
    ushort4 h;
    h.x = f32_to_f16(v.x, over);
    h.y = f32_to_f16(v.y, over);
    h.z = f32_to_f16(v.z, over);
    h.w = f32_to_f16(v.w, over);
    return h;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024).
// Every thread gets the result. Uses 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // partial may still be read from a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    float t = lane < warps ? partial[lane] : 0.0f;
    return warp_sum(t);
}

// Per-row sequence data for one forward pass, uploaded once per pass.
// Rows of the pass are the new tokens of every sequence, stacked.
struct RowMeta {
    int32_t position;  // where this row's token goes in its sequence
    int32_t context;   // positions it attends to: position + 1
    uint64_t kv_base;  // its sequence's KV cache: [capacity][layers][2][kv_dim] bf16
};

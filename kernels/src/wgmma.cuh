// Hopper warpgroup-MMA (wgmma, sm_90a) helpers shared by the kernels that use it:
// accumulator operand lists for inline PTX, the shared-memory matrix descriptor
// with the 128-byte swizzle (common.cuh `swizzled` on a 1,024-byte-aligned tile),
// and the fence / commit / wait around an asynchronous product.
#pragma once
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "common.cuh"

#define WG_ACC32                                                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC64                                                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "   \
    "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WG_OUT4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define WG_OUT32(d, i0)                                                                                                \
    WG_OUT4(d, i0), WG_OUT4(d, i0 + 1), WG_OUT4(d, i0 + 2), WG_OUT4(d, i0 + 3), WG_OUT4(d, i0 + 4), WG_OUT4(d, i0 + 5), \
        WG_OUT4(d, i0 + 6), WG_OUT4(d, i0 + 7)

// A shared-memory matrix descriptor with the 128-byte swizzle (PTX ISA, wgmma
// "Matrix Descriptor Format"): address, leading and stride byte offsets in 16-byte
// units, base offset 0 (every pattern starts on 1,024 bytes).
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

// Ties registers to this point: an asynchronous MMA's operands or results are not
// read, written or moved across it.
template <int A, int B>
__device__ __forceinline__ void wg_pin(float (&x)[A][B]) {
#pragma unroll
    for (int i = 0; i < A; i++) {
#pragma unroll
        for (int j = 0; j < B; j++) asm volatile("" : "+f"(x[i][j])::"memory");
    }
}
template <int A, int B>
__device__ __forceinline__ void wg_pin(uint32_t (&x)[A][B]) {
#pragma unroll
    for (int i = 0; i < A; i++) {
#pragma unroll
        for (int j = 0; j < B; j++) asm volatile("" : "+r"(x[i][j])::"memory");
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

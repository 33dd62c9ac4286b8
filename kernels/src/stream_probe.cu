// How fast one CTA per SM streams a buffer from HBM: the megakernel's weight ring
// (bulk copies into shared-memory slots, one producer thread, 8 consumer warps)
// at several slot sizes, next to plain 16-byte loads with several in flight per
// thread. The megakernel's matrix-vector ops can go no faster than the ring does.
//
// Each CTA reads its contiguous share (bytes_per_cta, a multiple of every slot
// size) of src and xors its 16-byte words into sink[blockIdx.x] (4 words): the
// bytes are used, and the xor of all sinks is the buffer's xor whatever the order.
//
// stream_ring_<KB>k: grid = SMs, block = 288, dynamic smem = SLOTS*SLOT + 16*SLOTS
//   (SLOT*SLOTS = 192 KiB as in the megakernel: 16k x 12 is its geometry).
// stream_ldg: grid = SMs, block = 256, no shared memory.
#include "common.cuh"
#include "mk_geometry.cuh"
#include "mk_sync.cuh"

namespace probe {

using mk::CONSUMER_WARPS;  // the megakernel's consumer warps
using mk::CONSUMERS;

__device__ __forceinline__ void xor_into(uint4& acc, uint4 v) {
    acc.x ^= v.x;
    acc.y ^= v.y;
    acc.z ^= v.z;
    acc.w ^= v.w;
}

// Warp-reduced xor of acc, added by lane 0 of each warp into sink[blockIdx.x].
__device__ __forceinline__ void publish(uint4 acc, uint32_t* sink) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        acc.x ^= __shfl_xor_sync(0xffffffffu, acc.x, o);
        acc.y ^= __shfl_xor_sync(0xffffffffu, acc.y, o);
        acc.z ^= __shfl_xor_sync(0xffffffffu, acc.z, o);
        acc.w ^= __shfl_xor_sync(0xffffffffu, acc.w, o);
    }
    if ((threadIdx.x & 31) == 0) {
        uint32_t* s = sink + 4 * blockIdx.x;
        atomicXor(s, acc.x);
        atomicXor(s + 1, acc.y);
        atomicXor(s + 2, acc.z);
        atomicXor(s + 3, acc.w);
    }
}

template <int SLOT, int SLOTS>
__device__ __forceinline__ void ring(const uint8_t* src, unsigned long long bytes_per_cta, uint32_t* sink) {
    extern __shared__ __align__(128) uint8_t smem[];
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + SLOT * SLOTS);
    uint64_t* empty = full + SLOTS;
    if (threadIdx.x == 0) {
        for (int i = 0; i < SLOTS; i++) {
            mk::mbar_init(full + i, 1);
            mk::mbar_init(empty + i, CONSUMER_WARPS);
        }
        mk::mbar_init_fence();
    }
    __syncthreads();
    const uint8_t* mine = src + blockIdx.x * bytes_per_cta;
    const uint32_t chunks = (uint32_t)(bytes_per_cta / SLOT);
    if (threadIdx.x >= CONSUMERS) {
        if (threadIdx.x != CONSUMERS) return;
        for (uint32_t c = 0; c < chunks; c++) {
            const int slot = c % SLOTS;
            if (c >= SLOTS)
                while (!mk::mbar_try_wait(empty + slot, (c / SLOTS - 1) & 1)) {
                }
            mk::mbar_arrive_expect_tx(full + slot, SLOT);
            mk::bulk_load(smem + slot * SLOT, mine + (size_t)c * SLOT, SLOT, full + slot);
        }
        return;  // every chunk issued is consumed before the consumers leave
    }
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (uint32_t c = 0; c < chunks; c++) {
        const int slot = c % SLOTS;
        while (!mk::mbar_try_wait(full + slot, (c / SLOTS) & 1)) {
        }
        const uint4* w = reinterpret_cast<const uint4*>(smem + slot * SLOT);
#pragma unroll
        for (int i = threadIdx.x; i < SLOT / 16; i += CONSUMERS) xor_into(acc, w[i]);
        __syncwarp();
        if ((threadIdx.x & 31) == 0) mk::mbar_arrive(empty + slot);
    }
    publish(acc, sink);
}

// Plain loads: each thread keeps UNROLL 16-byte loads in flight.
__device__ __forceinline__ void ldg(const uint4* src, unsigned long long bytes_per_cta, uint32_t* sink) {
    constexpr int UNROLL = 8;
    const uint4* mine = src + blockIdx.x * (bytes_per_cta / 16);
    const size_t words = bytes_per_cta / 16;
    uint4 acc = make_uint4(0, 0, 0, 0);
    for (size_t i = threadIdx.x; i < words; i += (size_t)blockDim.x * UNROLL) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const size_t k = i + (size_t)u * blockDim.x;
            v[u] = k < words ? __ldg(mine + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) xor_into(acc, v[u]);
    }
    publish(acc, sink);
}

}  // namespace probe

#define STREAM_RING(KB, SLOTS)                                                                            \
    ROCKET_KERNEL void __launch_bounds__(288, 1)                                                          \
        stream_ring_##KB##k(const uint8_t* src, unsigned long long bytes_per_cta, uint32_t* sink) {       \
        probe::ring<KB * 1024, SLOTS>(src, bytes_per_cta, sink);                                          \
    }
STREAM_RING(8, 24)
STREAM_RING(16, 12)
STREAM_RING(32, 6)
STREAM_RING(64, 3)

ROCKET_KERNEL void __launch_bounds__(256) stream_ldg(const uint4* src, unsigned long long bytes_per_cta, uint32_t* sink) {
    probe::ldg(src, bytes_per_cta, sink);
}

// How long one dependent load from L2 takes, with the GPU idle and while every
// other SM streams HBM: the megakernel's hand-offs are chains of such loads
// (a release, a counter poll, the next op's input), so this is their unit cost.
//
// l2_latency: grid = SMs, block = 256. CTA 0, thread 0 walks `hops` links of
// `chain` (one u32 per 128-byte line: chain[32 i] is the next line's word
// index, a random cycle the host made), once to bring it into L2, then timed
// with the global timer; it stores the time (ns) and where the walk ended
// (out[0], out[1]) and raises `done`. With `stream` set, CTAs 1.. read their
// share of `src` with 16-byte loads, 8 in flight per thread, over and over
// until `done`, xor-ing it into sink[blockIdx.x] (so the loads are used); CTA 0
// starts timing once they all have begun and a few µs have passed.
#include "common.cuh"
#include "mk_geometry.cuh"
#include "mk_sync.cuh"

namespace probe {

__device__ __forceinline__ uint32_t walk(const uint32_t* chain, int hops) {
    uint32_t at = 0;
    for (int h = 0; h < hops; h++) at = __ldcg(chain + at);
    return at;
}

}  // namespace probe

ROCKET_KERNEL void __launch_bounds__(256) l2_latency(const uint32_t* chain, int hops, const uint4* src,
                                                     unsigned long long words_per_cta, int stream,
                                                     unsigned long long* out, uint32_t* flags, uint32_t* sink) {
    uint32_t* started = flags;  // CTAs streaming
    uint32_t* done = flags + 1;
    if (blockIdx.x == 0) {
        if (threadIdx.x != 0) return;
        probe::walk(chain, hops);  // into L2
        if (stream) {
            while (mk::ld_volatile(started) < gridDim.x - 1) {
            }
            const uint64_t settle = mk::globaltimer_ns() + 20000;
            while (mk::globaltimer_ns() < settle) {
            }
        }
        const uint64_t t0 = mk::globaltimer_ns();
        const uint32_t end = probe::walk(chain, hops);
        const uint64_t t1 = mk::globaltimer_ns();
        out[0] = t1 - t0;
        out[1] = end;
        __threadfence();
        mk::st_volatile(done, 1);
        return;
    }
    if (!stream) return;
    __shared__ uint32_t stop;
    if (threadIdx.x == 0) {
        stop = 0;
        atomicAdd(started, 1u);
    }
    __syncthreads();
    constexpr int UNROLL = 8;
    const uint4* mine = src + (blockIdx.x - 1) * words_per_cta;
    uint4 acc = make_uint4(0, 0, 0, 0);
    size_t i = threadIdx.x;
    while (!stop) {
        for (int round = 0; round < 16; round++) {
            uint4 v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) v[u] = __ldcs(mine + (i + (size_t)u * blockDim.x) % words_per_cta);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                acc.x ^= v[u].x;
                acc.y ^= v[u].y;
                acc.z ^= v[u].z;
                acc.w ^= v[u].w;
            }
            i += (size_t)UNROLL * blockDim.x;
        }
        __syncthreads();
        if (threadIdx.x == 0) stop = mk::ld_volatile(done);
        __syncthreads();
    }
    atomicXor(sink + blockIdx.x, acc.x ^ acc.y ^ acc.z ^ acc.w);
}

// What a release costs (red.release.gpu: the fence that makes a CTA's stores
// visible, then the add; the megakernel's `signal`) and what a dependent L2 load
// costs, while the CTA's own bulk-copy engine has `inflight` 16 KiB copies of
// `src` landing in its shared memory (the megakernel's weight ring; 0: none).
// fence_cost: grid = SMs, block = 64, dynamic smem = SLOTS * SLOT_BYTES + 96.
// Thread 0 times `iters` rounds of (store, release) and of (dependent load)
// through `chain` (as l2_latency's); lane 0 of warp 1 keeps the copies going.
// out[3 b + 0, 1, 2] = ns per release, ns per load, where the walk ended.
ROCKET_KERNEL void __launch_bounds__(64) fence_cost(const uint8_t* src, unsigned long long src_bytes, int inflight,
                                                    const uint32_t* chain, int iters, unsigned long long* out,
                                                    uint32_t* counters) {
    constexpr int SLOT = mk::SLOT_BYTES, SLOTS = mk::SLOTS;  // the megakernel's ring
    extern __shared__ __align__(128) uint8_t smem[];
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + SLOT * SLOTS);
    volatile uint32_t* stop = reinterpret_cast<volatile uint32_t*>(full + SLOTS);
    if (threadIdx.x == 0) {
        for (int i = 0; i < SLOTS; i++) mk::mbar_init(full + i, 1);
        *stop = 0;
        mk::mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 32) {
        uint32_t c = 0;
        const unsigned long long chunks = src_bytes / SLOT;
        for (; inflight > 0 && !*stop; c++) {
            const int slot = c % inflight;
            if (c >= (uint32_t)inflight)
                while (!mk::mbar_try_wait(full + slot, (c / inflight - 1) & 1)) {
                }
            mk::mbar_arrive_expect_tx(full + slot, SLOT);
            const unsigned long long chunk = ((unsigned long long)c * gridDim.x + blockIdx.x) % chunks;
            mk::bulk_load(smem + slot * SLOT, src + chunk * SLOT, SLOT, full + slot);
        }
        for (uint32_t d = c > (uint32_t)inflight ? c - inflight : 0; d < c; d++)  // drain what is still landing
            while (!mk::mbar_try_wait(full + d % inflight, (d / inflight) & 1)) {
            }
        return;
    }
    if (threadIdx.x != 0) return;
    const uint64_t settle = mk::globaltimer_ns() + 20000;  // the copies get going
    while (mk::globaltimer_ns() < settle) {
    }
    uint32_t* mine = counters + 32 * (blockIdx.x + 1);  // a line of its own; counters[0]: the stores' target
    uint64_t t0 = mk::globaltimer_ns();
    for (int i = 0; i < iters; i++) {
        __stcg(counters + 32 * (gridDim.x + 1) + 32 * blockIdx.x, (uint32_t)i);  // a store for the fence to wait for
        mk::red_release_add(mine, 1);
    }
    const uint64_t t1 = mk::globaltimer_ns();
    uint32_t at = 0;
    for (int i = 0; i < iters; i++) at = __ldcg(chain + at);
    const uint64_t t2 = mk::globaltimer_ns();
    out[3 * blockIdx.x] = (t1 - t0) / (unsigned long long)iters;
    out[3 * blockIdx.x + 1] = (t2 - t1) / (unsigned long long)iters;
    out[3 * blockIdx.x + 2] = at;
    *stop = 1;
}

// argmax: out[r] = the index of the largest logit of row r, the lowest index on
// ties (as the host sampler's greedy path). NaN and -inf never win; a row with
// nothing else gives 0.
//
// A row is scanned by gridDim.x CTAs of ARGMAX_SPAN logits each, so a batch of
// LM-head rows is read by the whole GPU instead of one SM per row. Each CTA folds
// its best into one 64-bit key per row with atomicMax: the high word orders by
// value, the low word by lower index, so the winner does not depend on which CTA
// lands first. The last CTA of a row (a counter per row) writes the index and
// zeroes the key and the counter, so the next launch finds them zero.
// grid = (ceil(vocab / ARGMAX_SPAN), rows), block = ARGMAX_THREADS;
// keys [rows] u64 and counters [rows] u32 zeroed before the first launch.
#include "common.cuh"

#define ARGMAX_THREADS 256
#define ARGMAX_SPAN (ARGMAX_THREADS * 16)

// The key of logit v at index i; 0 (below every key) for NaN and -inf. -0 counts
// as +0, since the host compares values, not bits.
__device__ __forceinline__ unsigned long long argmax_key(float v, uint32_t i) {
    if (!(v > -INFINITY)) return 0ull;
    const uint32_t bits = __float_as_uint(v == 0.0f ? 0.0f : v);
    const uint32_t ordered = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
    return ((unsigned long long)ordered << 32) | (0xffffffffu - i);
}

__device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

ROCKET_KERNEL void __launch_bounds__(ARGMAX_THREADS) argmax(const float* __restrict__ logits, uint32_t* __restrict__ out,
                                                           int vocab, unsigned long long* keys, unsigned* counters) {
    pdl_enter();
    const int row = blockIdx.y;
    const float* r = logits + (size_t)row * vocab;
    const int begin = blockIdx.x * ARGMAX_SPAN, end = min(begin + ARGMAX_SPAN, vocab);
    unsigned long long best = 0ull;
    for (int i = begin + threadIdx.x; i < end; i += ARGMAX_THREADS) best = max_u64(best, argmax_key(__ldcs(r + i), i));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max_u64(best, __shfl_xor_sync(0xffffffffu, best, o));
    __shared__ unsigned long long warp_best[ARGMAX_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int w = 1; w < ARGMAX_THREADS / 32; w++) best = max_u64(best, warp_best[w]);
    if (best) atomicMax(keys + row, best);
    __threadfence();
    if (atomicAdd(counters + row, 1u) != gridDim.x - 1) return;
    // Every CTA of the row has folded its key in.
    __threadfence();
    const unsigned long long won = atomicExch(keys + row, 0ull);
    counters[row] = 0;
    out[row] = won ? 0xffffffffu - (uint32_t)won : 0u;
}

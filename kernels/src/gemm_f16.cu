// gemm_f16_mMT: y[t][n] (+)= sum_k W[n][k] * x[t][k] for an fp16 weight W [n][k]
// (the layers' fp16 copy, f16_weights.rs) and fp16 input rows x [rows][k] (written
// by to_f16.cu or the norm and SiLU·mul kernels' fp16 outputs), f32 accumulation on
// Hopper's warpgroup MMA (wgmma, sm_90a only): the layer products of passes of
// 33-256 rows, where cuBLASLt's own picks sit at a per-call floor and stream the
// weights at ~1.3 TB/s. Inputs and weights are the operands cuBLASLt's fp16
// products take, so the two paths round alike (to f32 sums in another order).
//
// Why wgmma: at 128 rows a product does 128 FLOP per weight byte, which the SM's
// tensor cores fed by mma.sync (ldmatrix into registers, a warp's MMAs waiting
// on them) could not sustain at the copy bandwidth; a wgmma reads both operands
// from shared memory through descriptors, once per warpgroup.
//
// Tiling: a CTA of two warpgroups owns TILE_N = 128 weight rows and 32 MT input
// rows; warpgroup g multiplies weight rows 64 g .. + 64 (the wgmma's M, A operand)
// by all the CTA's input rows (its N = 32 MT, B operand), both K-major, as
// m64n{32 MT}k16, four per k block. The k blocks (64 wide: one 128-byte row per
// weight or input row) stream through a cp.async ring in shared memory,
// `Layout<MT>::STAGES` deep (six or seven blocks of 16 KiB of weights in flight per
// SM), and every weight byte is read once per 32 MT input rows. Shared tiles are
// 128-byte rows whose 16-byte chunks are XOR-swizzled by the row (common.cuh
// `swizzled`): wgmma's 128-byte swizzle, on a ring aligned to 1,024 bytes by hand.
// cp.async writes through the generic proxy and wgmma reads through the async one,
// so each thread fences the proxies after its copies land and before the barrier
// that publishes them; a block's products are waited for before the barrier after
// which its slot is refilled.
//
// Split K within a thread block cluster: the host launches the S splits of a
// tile as one cluster (1, 1, S), S <= 8 (the portable cluster size), so they run
// at once on one GPC. Split s takes k blocks [s kb / S, (s + 1) kb / S) and leaves
// its partial tile in its own shared memory (the ring, drained); after a cluster
// barrier each split sums slice s of the tile over the S partials, read through
// distributed shared memory in split order, and writes y; a second barrier keeps
// every partial alive until the last reader is done. The partials never leave the
// GPC: at 128 rows a tile's partial (64 KiB) is as large as the weights a split
// reads, and a sum through L2 by one CTA cost more than the products. The host
// picks S from (n, k) and the SM count alone, and an element's products never see
// another row, so a row's result is the same bits whatever other rows share the pass.
//
// With programmatic dependent launch (common.cuh) the first blocks' weights are
// requested before pdl_wait(), the inputs after it.
//
// Contract: k % 64 == 0, n % 8 == 0, W and x 16-byte aligned, y 4-byte aligned,
// splits <= min(8, k / 64), dynamic shared memory Layout<MT>::BYTES, grid =
// (ceil(n / 128), ceil(rows / (32 MT)), splits), cluster (1, 1, splits), block = 256.
#pragma once
#include "common.cuh"
#include "gemm_tc.cu"
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"

namespace gemm_f16 {

using gemm_tc::cp_async16;
using gemm_tc::cp_async_commit;
using gemm_tc::cp_async_wait;
using gemm_tc::smem_addr;

constexpr int TILE_N = 128;  // weight rows per CTA: 2 warpgroups x 64
constexpr int KB = 64;       // k per block: one 128-byte fp16 row per weight or input row
constexpr int THREADS = 256;
constexpr int MAX_SPLITS = 8;  // the portable cluster size
constexpr int ALIGN = 1024;  // the 128-byte swizzle's period: the ring is aligned to it by hand

template <int MT>
struct Layout {
    static constexpr int M = 32 * MT;                    // input rows per CTA
    static constexpr int W_BYTES = TILE_N * KB * 2;      // one block of weights (swizzled)
    static constexpr int X_BYTES = M * KB * 2;           // one block of inputs (swizzled)
    static constexpr int STAGE_BYTES = W_BYTES + X_BYTES;
    // As deep as one CTA per SM allows.
    static constexpr int STAGES = (227 * 1024 - ALIGN) / STAGE_BYTES > 8 ? 8 : (227 * 1024 - ALIGN) / STAGE_BYTES;
    static constexpr int BYTES = STAGES * STAGE_BYTES + ALIGN;
    static_assert(BYTES <= 227 * 1024, "one CTA per SM must fit");
    static_assert(W_BYTES % ALIGN == 0 && STAGE_BYTES % ALIGN == 0, "every tile starts a swizzle period");
    static_assert(4 * MT * THREADS * 16 <= STAGES * STAGE_BYTES, "a partial tile fits the drained ring");
};

// d += a b: 64 weight rows x 64 or 128 input rows x 16, a and b K-major in shared memory.
__device__ __forceinline__ void wgmma_f16(float (&d)[8][4], uint64_t a, uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WG_ACC32 ", %32, %33, 1, 1, 1, 0, 0;\n"
                 : WG_OUT32(d, 0)
                 : "l"(a), "l"(b)
                 : "memory");
}
__device__ __forceinline__ void wgmma_f16(float (&d)[16][4], uint64_t a, uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " WG_ACC64 ", %64, %65, 1, 1, 1, 0, 0;\n"
                 : WG_OUT32(d, 0), WG_OUT32(d, 8)
                 : "l"(a), "l"(b)
                 : "memory");
}

// Where this thread's 16-byte copies of every k block come from and go to: weight
// rows past n and input rows past `rows` are clamped to the last one (valid memory;
// their results are never stored).
template <int MT>
struct Copies {
    static constexpr int W = TILE_N * 8 / THREADS;              // weight chunks per thread
    static constexpr int X = Layout<MT>::M * 8 / THREADS;       // input chunks per thread
    static_assert(W * THREADS == TILE_N * 8 && X * THREADS == Layout<MT>::M * 8, "whole chunks per thread");
    const uint16_t* w_src[W];
    uint32_t w_dst[W];
    const uint16_t* x_src[X];
    uint32_t x_dst[X];

    __device__ __forceinline__ Copies(const uint16_t* W_, const uint16_t* x, int n0, int m0, int n, int k, int rows) {
#pragma unroll
        for (int i = 0; i < W; i++) {
            const int idx = threadIdx.x + i * THREADS, r = idx >> 3, c = idx & 7;
            w_src[i] = W_ + (size_t)min(n0 + r, n - 1) * k + c * 8;
            w_dst[i] = swizzled(r, c);
        }
#pragma unroll
        for (int i = 0; i < X; i++) {
            const int idx = threadIdx.x + i * THREADS, r = idx >> 3, c = idx & 7;
            x_src[i] = x + (size_t)min(m0 + r, rows - 1) * k + c * 8;
            x_dst[i] = Layout<MT>::W_BYTES + swizzled(r, c);
        }
    }
    __device__ __forceinline__ void load_w(uint32_t stage, int kb) const {
#pragma unroll
        for (int i = 0; i < W; i++) cp_async16(stage + w_dst[i], w_src[i] + kb * KB);
    }
    __device__ __forceinline__ void load_x(uint32_t stage, int kb) const {
#pragma unroll
        for (int i = 0; i < X; i++) cp_async16(stage + x_dst[i], x_src[i] + kb * KB);
    }
};

// Every thread of every CTA of the cluster has arrived; shared-memory writes before
// it are visible to the cluster's reads after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The float4 at shared address `addr` of the cluster's CTA `rank`.
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr, int rank) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
    return v;
}

// y (+)= accumulator word f of thread i (acc[f][0..3] of thread i of the CTA):
// input rows m0 + 8 f + 2 t + (e & 1), weight rows n0 + 64 wg + 16 w4 + g + 8 (e >> 1).
__device__ __forceinline__ void store4(float* __restrict__ y, int n, int rows, int accumulate, int m0, int n0, int i, int f,
                                       float v0, float v1, float v2, float v3) {
    const int warp = i >> 5, lane = i & 31, g = lane >> 2, t = lane & 3;
    const float v[4] = {v0, v1, v2, v3};
#pragma unroll
    for (int e = 0; e < 4; e++) {
        const int m = m0 + 8 * f + 2 * t + (e & 1), col = n0 + 64 * (warp >> 2) + 16 * (warp & 3) + g + 8 * (e >> 1);
        if (m >= rows || col >= n) continue;
        float* out = y + (size_t)m * n + col;
        *out = accumulate ? *out + v[e] : v[e];
    }
}

template <int MT>
__device__ __forceinline__ void body(const uint16_t* __restrict__ W, const uint16_t* __restrict__ x, float* __restrict__ y,
                                     int n, int k, int rows, int accumulate) {
    using L = Layout<MT>;
    constexpr int STAGES = L::STAGES;
    constexpr int NF = 4 * MT;  // n8 fragments of the wgmma's N (the CTA's 32 MT input rows)
    extern __shared__ __align__(128) unsigned char smem[];
    const int wg = threadIdx.x >> 7;  // the warpgroup: weight rows 64 wg .. + 64 of the tile
    const int n0 = blockIdx.x * TILE_N, m0 = blockIdx.y * L::M;
    const int splits = gridDim.z, split = blockIdx.z;
    const int blocks = k / KB;
    const int kb0 = split * blocks / splits, count = (split + 1) * blocks / splits - kb0;

    float acc[NF][4];
#pragma unroll
    for (int f = 0; f < NF; f++) acc[f][0] = acc[f][1] = acc[f][2] = acc[f][3] = 0.0f;

    const Copies<MT> copies(W, x, n0, m0, n, k, rows);
    const uint32_t ring = (smem_addr(smem) + (ALIGN - 1)) & ~(uint32_t)(ALIGN - 1);
    gemm_tc::fill_ring<STAGES, L::STAGE_BYTES>(copies, ring, count, kb0);

    for (int i = 0; i < count; i++) {
        // Block i has landed once every thread is here; every warpgroup has also
        // waited for its products of block i - 1, whose ring slot is refilled below.
        cp_async_wait<STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        if (i + STAGES - 1 < count) {
            const uint32_t slot = ring + ((i + STAGES - 1) % STAGES) * L::STAGE_BYTES;
            copies.load_w(slot, kb0 + i + STAGES - 1);
            copies.load_x(slot, kb0 + i + STAGES - 1);
        }
        cp_async_commit();
        const uint32_t w_tile = ring + (i % STAGES) * L::STAGE_BYTES + wg * 64 * 128;
        const uint32_t x_tile = ring + (i % STAGES) * L::STAGE_BYTES + L::W_BYTES;
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < KB / 16; kk++)  // 32 bytes of k a step within the 128-byte rows
            wgmma_f16(acc, wg_desc(w_tile + 32 * kk, 16, 1024), wg_desc(x_tile + 32 * kk, 16, 1024));
        wg_commit();
        wg_wait_all();
        wg_pin(acc);
    }
    cp_async_wait<0>();

    // acc[f][e] is y[m0 + 8 f + 2 t + (e & 1)][n0 + 64 wg + 16 w4 + g + 8 (e >> 1)]
    // (a warp's 16 rows of the wgmma's M are weight rows, its N input rows).
    if (splits == 1) {
#pragma unroll
        for (int f = 0; f < NF; f++) store4(y, n, rows, accumulate, m0, n0, threadIdx.x, f, acc[f][0], acc[f][1], acc[f][2], acc[f][3]);
        return;
    }
    // The partial, word f of thread i at float4 f * THREADS + i of the drained ring.
    __syncthreads();  // no thread still waits on a copy into the ring
    float4* part = reinterpret_cast<float4*>(smem + (ring - smem_addr(smem)));
#pragma unroll
    for (int f = 0; f < NF; f++) part[f * THREADS + threadIdx.x] = make_float4(acc[f][0], acc[f][1], acc[f][2], acc[f][3]);
    cluster_sync();  // every split's partial is in its shared memory
    constexpr int WORDS = NF * THREADS;
    const uint32_t part_addr = ring;
    for (int w = split * WORDS / splits + threadIdx.x; w < (split + 1) * WORDS / splits; w += THREADS) {
        float4 p[MAX_SPLITS];
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; s++)
            if (s < splits) p[s] = ld_cluster_f4(part_addr + w * 16, s);
        float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < MAX_SPLITS; s++) {  // in split order
            if (s < splits) {
                sum.x += p[s].x; sum.y += p[s].y; sum.z += p[s].z; sum.w += p[s].w;
            }
        }
        store4(y, n, rows, accumulate, m0, n0, w % THREADS, w / THREADS, sum.x, sum.y, sum.z, sum.w);
    }
    cluster_sync();  // no split leaves while another still reads its partial
}

}  // namespace gemm_f16

#define GEMM_F16(MT)                                                                                             \
    ROCKET_KERNEL void __launch_bounds__(256, 1) gemm_f16_m##MT(const uint16_t* __restrict__ W,                       \
                                                             const uint16_t* __restrict__ x, float* y, int n,      \
                                                             int k, int rows, int accumulate) {                    \
        gemm_f16::body<MT>(W, x, y, n, k, rows, accumulate);                                                      \
    }
GEMM_F16(2)
GEMM_F16(4)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

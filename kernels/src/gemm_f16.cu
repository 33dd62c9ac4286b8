// gemm_f16_mMT: y[t][n] (+)= sum_k W[n][k] * x[t][k] for an fp16 weight W [n][k]
// (the layers' fp16 copy, f16_weights.rs) and fp16 input rows x [rows][k] (written
// by to_f16.cu or the norm and SiLU·mul kernels' fp16 outputs), f32 accumulation on
// mma.sync m16n8k16: the layer products of passes of 33-256 rows, where cuBLASLt's
// own picks sit at a per-call floor and stream the weights at ~1.3 TB/s. Inputs
// and weights are the operands cuBLASLt's fp16 products take, so the two paths
// round alike (to f32 sums in another order).
//
// Tiling: a CTA of 8 warps owns TILE_N = 128 weight rows and 32 MT input rows; warp
// w takes input rows 16 MT (w >> 2) .. + 16 MT and weight rows 32 (w & 3) .. + 32,
// so one k step of 16 is MT ldmatrix.x4 of inputs, 2 of weights and 4 MT MMAs. The
// k blocks (64 wide: one 128-byte row per weight or input row) stream through a
// cp.async ring in shared memory, `Layout<MT>::STAGES` deep (six or seven blocks
// of 16 KiB of weights in flight per SM), and every weight byte is read once per
// 32 MT input rows. Shared tiles are 128-byte rows whose 16-byte chunks are
// XOR-swizzled by the row (common.cuh `swizzled`), so ldmatrix is conflict-free.
//
// Split K, as gemm_tc.cu: split s of a tile takes k blocks [s kb / S, (s + 1) kb / S),
// writes its partial tile to ws, and the split that arrives last sums the partials in
// split order and writes y (the counter it resets is zero for the next launch). The
// host picks S from (n, k) and the SM count alone, and a row's MMAs never see another
// row, so a row's result is the same bits whatever other rows share the pass.
//
// With programmatic dependent launch (common.cuh) the first blocks' weights are
// requested before pdl_wait(), the inputs after it.
//
// Contract: k % 64 == 0, n % 8 == 0, W and x 16-byte aligned, y 8-byte aligned,
// splits <= min(16, k / 64), dynamic shared memory Layout<MT>::BYTES, grid =
// (ceil(n / 128), ceil(rows / (32 MT)), splits), block = 256. With splits > 1: ws holds grid.x * grid.y *
// splits * 32 MT * 128 floats and counters grid.x * grid.y zeroed words.
#pragma once
#include "common.cuh"
#include "gemm_tc.cu"

namespace gemm_f16 {

using gemm_tc::cp_async16;
using gemm_tc::cp_async_commit;
using gemm_tc::cp_async_wait;
using gemm_tc::ldmatrix_x4;
using gemm_tc::smem_addr;

constexpr int TILE_N = 128;  // weight rows per CTA: 4 warps x 32
constexpr int KB = 64;       // k per block: one 128-byte fp16 row per weight or input row
constexpr int THREADS = 256;
constexpr int MAX_SPLITS = 16;

template <int MT>
struct Layout {
    static constexpr int M = 32 * MT;                    // input rows per CTA
    static constexpr int W_BYTES = TILE_N * KB * 2;      // one block of weights (swizzled)
    static constexpr int X_BYTES = M * KB * 2;           // one block of inputs (swizzled)
    static constexpr int STAGE_BYTES = W_BYTES + X_BYTES;
    // As deep as one CTA per SM allows.
    static constexpr int STAGES = (227 * 1024) / STAGE_BYTES > 8 ? 8 : (227 * 1024) / STAGE_BYTES;
    static constexpr int BYTES = STAGES * STAGE_BYTES;
    static_assert(BYTES <= 227 * 1024, "one CTA per SM must fit");
};

__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

template <int MT>
__device__ __forceinline__ void body(const uint16_t* __restrict__ W, const uint16_t* __restrict__ x, float* __restrict__ y,
                                     int n, int k, int rows, int accumulate, float* __restrict__ ws,
                                     unsigned* __restrict__ counters) {
    using L = Layout<MT>;
    constexpr int STAGES = L::STAGES;
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp >> 2, wn = warp & 3;  // the warp's 16 MT input rows and 32 weight rows
    const int n0 = blockIdx.x * TILE_N, m0 = blockIdx.y * L::M;
    const int splits = gridDim.z, split = blockIdx.z;
    const int blocks = k / KB;
    const int kb0 = split * blocks / splits, count = (split + 1) * blocks / splits - kb0;
    // Input tiles wholly past `rows` multiply nothing that is stored.
    const int live_mt = min(MT, max(0, (rows - m0 - 16 * MT * wm + 15) / 16));

    float acc[MT][4][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    const Copies<MT> copies(W, x, n0, m0, n, k, rows);
    const uint32_t ring = smem_addr(smem);
    // Group s holds block s's inputs; group 0 also every weight requested before
    // pdl_wait, so the first wait covers them all.
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < count) copies.load_w(ring + s * L::STAGE_BYTES, kb0 + s);
    pdl_wait();
    pdl_launch_dependents();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < count) copies.load_x(ring + s * L::STAGE_BYTES, kb0 + s);
        cp_async_commit();  // empty groups keep the count uniform
    }

    // ldmatrix row addresses of this lane: weight rows 32 wn + 16 h + (lane & 7) + 8 (lane >> 4)
    // at chunk offset (lane >> 3) & 1 (b0, b1 of n tiles 2h and 2h + 1); input rows
    // 16 MT wm + 16 mt + (lane & 15) at chunk offset lane >> 4 (a0-a3).
    const int w_row = 32 * wn + (lane & 7) + ((lane >> 4) << 3), w_chunk = (lane >> 3) & 1;
    const int x_row = 16 * MT * wm + (lane & 15), x_chunk = lane >> 4;

    for (int i = 0; i < count; i++) {
        // Block i has landed once every thread is here; every warp has also finished
        // block i - 1, whose ring slot is refilled below.
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (i + STAGES - 1 < count) {
            const uint32_t slot = ring + ((i + STAGES - 1) % STAGES) * L::STAGE_BYTES;
            copies.load_w(slot, kb0 + i + STAGES - 1);
            copies.load_x(slot, kb0 + i + STAGES - 1);
        }
        cp_async_commit();
        const uint32_t w_tile = ring + (i % STAGES) * L::STAGE_BYTES;
        const uint32_t x_tile = w_tile + L::W_BYTES;
#pragma unroll
        for (int kk = 0; kk < KB / 16; kk++) {
            uint32_t b[2][4];  // per 16 weight rows h: b0, b1 of rows 0-7, then of rows 8-15
#pragma unroll
            for (int h = 0; h < 2; h++) ldmatrix_x4(b[h], w_tile + swizzled(w_row + 16 * h, 2 * kk + w_chunk));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                if (mt < live_mt) {
                    uint32_t a[4];
                    ldmatrix_x4(a, x_tile + swizzled(x_row + 16 * mt, 2 * kk + x_chunk));
#pragma unroll
                    for (int j = 0; j < 4; j++) mma_f16(acc[mt][j], a, b[j >> 1][2 * (j & 1)], b[j >> 1][2 * (j & 1) + 1]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // acc[mt][j][e] is y[m0 + 16 MT wm + 16 mt + g + 8 (e >> 1)][n0 + 32 wn + 8 j + 2 t + (e & 1)].
    if (splits > 1) {
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        constexpr int WORDS = MT * 4;  // float4s per thread
        // [tile][split][word][thread]: a warp's stores and loads of one word are contiguous.
        float4* mine = reinterpret_cast<float4*>(ws) + (size_t)(tile * splits + split) * WORDS * THREADS + threadIdx.x;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                __stcg(mine + (mt * 4 + j) * THREADS, make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3]));
        __threadfence();
        __syncthreads();
        __shared__ int last;
        if (threadIdx.x == 0) {
            last = atomicAdd(&counters[tile], 1u) == (unsigned)(splits - 1);
            if (last) counters[tile] = 0;  // every split has arrived: ready for the next launch
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        const float4* part = reinterpret_cast<const float4*>(ws) + (size_t)tile * splits * WORDS * THREADS + threadIdx.x;
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            if (mt >= live_mt) continue;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
                for (int s = 0; s < splits; s++) {  // in split order, whichever arrived last
                    const float4 p = __ldcg(part + (size_t)(s * WORDS + mt * 4 + j) * THREADS);
                    sum.x += p.x; sum.y += p.y; sum.z += p.z; sum.w += p.w;
                }
                acc[mt][j][0] = sum.x; acc[mt][j][1] = sum.y; acc[mt][j][2] = sum.z; acc[mt][j][3] = sum.w;
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        if (mt >= live_mt) continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int m = m0 + 16 * MT * wm + 16 * mt + g + 8 * h;
            if (m >= rows) continue;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int col = n0 + 32 * wn + 8 * j + 2 * t;
                if (col >= n) continue;  // n % 8 == 0: an 8-column tile is wholly in or out
                float2* out = reinterpret_cast<float2*>(y + (size_t)m * n + col);
                float2 v = make_float2(acc[mt][j][2 * h], acc[mt][j][2 * h + 1]);
                if (accumulate) {
                    const float2 old = *out;
                    v.x += old.x;
                    v.y += old.y;
                }
                *out = v;
            }
        }
    }
}

}  // namespace gemm_f16

#define GEMM_F16(MT)                                                                                             \
    ROCKET_KERNEL void __launch_bounds__(256, 1) gemm_f16_m##MT(const uint16_t* __restrict__ W,                       \
                                                             const uint16_t* __restrict__ x, float* y, int n,      \
                                                             int k, int rows, int accumulate, float* ws,           \
                                                             unsigned* counters) {                                 \
        gemm_f16::body<MT>(W, x, y, n, k, rows, accumulate, ws, counters);                                        \
    }
GEMM_F16(2)
GEMM_F16(4)

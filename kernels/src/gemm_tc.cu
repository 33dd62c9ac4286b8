// gemm_tc_mMT: y[t][n] (+)= sum_k W[n][k] * x[t][k] on the tensor cores, for a
// bf16 weight W [n][k] and f32 input rows x [rows][k]: the batched-decode and
// prefill counterpart of gemv.cu. Each f32 input is split into bf16 hi + lo
// (x = hi + lo to ~16 bits of mantissa) and multiplied as two bf16 MMAs
// (mma.sync m16n8k16, f32 accumulation), so the result is as close to f32 as
// the GEMV's. With accumulate = 1 the result is added to y (residual adds).
//
// Tiling: a CTA of 8 warps owns TILE_N = 128 weight rows (16 per warp) and
// 16 MT input rows, over the 64-wide k blocks of its split of K. The blocks
// stream through a cp.async ring in shared memory (8, 7 or 5 blocks deep for
// MT 1, 2, 4 and 5; a slot holds a block's weights, f32 inputs and norm weights), so each
// input block is read once per 128 weight rows instead of once per 8, and every
// weight byte is read once.
// One block ahead of the MMAs, all threads split the inputs into bf16 hi/lo
// tiles (double-buffered); the warps then read both operands with ldmatrix.
// Shared tiles are 128-byte rows whose 16-byte chunks are XOR-swizzled by the
// row (chunk c of row r sits at c ^ (r & 7)), so ldmatrix is conflict-free.
//
// Split K (splits > 1, for shapes with too few weight tiles to fill the GPU):
// split s of a tile takes blocks [s*kb/splits, (s+1)*kb/splits), writes its
// partial tile to ws, and the split that arrives last (a counter per tile,
// reset by that split, so the next launch finds it zero) sums the partials in
// split order 0, 1, ... and writes y. The order is fixed, so results are
// deterministic, and since the host picks splits from (n, k) alone (for launches
// of up to 256 rows; longer ones do not split), a row's result does not depend on
// how many other rows share the launch.
//
// Fused prologue and epilogue (the forward pass runs them for qkv and gate|up
// instead of separate kernels; kernels.rs `GemmFusion`):
//   norm_w != nullptr: x is the residual stream and the product is of its
//     RMSNorm, rms_norm.cu's w * (x * rsqrt(mean(x^2) + eps)). The inputs are
//     multiplied by norm_w as they are split, each row's sum of squares is
//     gathered on the way (per split, summed in split order like the partials),
//     and the row's scale multiplies the finished sums.
//   silu != 0: W is the fused gate|up [2 ff][k] (n = 2 ff) and y [rows][ff]
//     = silu(gate) * up, silu_mul.cu's formula. CTA x takes act columns
//     [64 x, 64 x + 64): in each warp's 16 weight rows, rows 0-7 are gate rows
//     and rows 8-15 the up rows of the same 8 columns, so every thread holds
//     both halves of its outputs. Needs n % 128 == 0 and accumulate = 0.
// With programmatic dependent launch (common.cuh), the weights of the first ring
// blocks are requested before pdl_wait(), so they stream while the previous kernel
// finishes; the first block's inputs then wait for all of them (cp.async group 0).
//
// Contract: k % 64 == 0, W rows, x rows and norm_w 16-byte aligned (y [rows][n / 2]
// with silu), splits <= min(8, k / 64), dynamic
// shared memory Layout<MT>::BYTES, grid = (ceil(n / 128), ceil(rows / (16 MT)), splits),
// block = 256. With splits > 1: ws holds grid.x * grid.y * splits * (16 MT * 129)
// floats (partials, then row sums of squares) and counters grid.x * grid.y zeroed words.
#pragma once
#include "common.cuh"

namespace gemm_tc {

constexpr int TILE_N = 128;  // weight rows per CTA: 8 warps x 16
constexpr int KB = 64;       // k per block: one 128-byte bf16 row per weight row
constexpr int THREADS = 256;
constexpr int MAX_SPLITS = 8;

template <int MT>
struct Layout {
    // Ring depth: as deep as one CTA per SM allows, so a split's few blocks are all
    // requested at once and long K keeps 100+ KB per SM in flight.
    static constexpr int STAGES = MT == 1 ? 8 : MT == 2 ? 7 : 5;
    static constexpr int M = 16 * MT;                    // input rows per CTA
    static constexpr int W_BYTES = TILE_N * KB * 2;      // one block of weights (swizzled)
    static constexpr int X_BYTES = M * KB * 4;           // one block of f32 inputs (plain)
    static constexpr int NW_BYTES = KB * 4;              // the block's f32 RMSNorm weights (norm_w only)
    static constexpr int STAGE_BYTES = W_BYTES + X_BYTES + NW_BYTES;
    static constexpr int SPLIT_BYTES = M * KB * 2;       // one bf16 hi (or lo) tile (swizzled)
    static constexpr int BYTES = STAGES * STAGE_BYTES + 2 * 2 * SPLIT_BYTES;
    static_assert(BYTES <= 227 * 1024, "one CTA per SM must fit");
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(PENDING)); }

// The ring's first STAGES - 1 k blocks from k block kb0 (of `count`): the weights
// before pdl_wait(), as they never depend on the previous kernel, the inputs it
// writes after. Group s holds block s's inputs and group 0 also every weight
// requested before, so the first wait for block 0 covers all STAGES - 1 weight
// blocks (the ring fills before the first MMA); empty groups keep the count uniform.
template <int STAGES, int STAGE_BYTES, class Copies>
__device__ __forceinline__ void fill_ring(const Copies& copies, uint32_t ring, int count, int kb0) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++)
        if (s < count) copies.load_w(ring + s * STAGE_BYTES, kb0 + s);
    pdl_wait();
    pdl_launch_dependents();
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < count) copies.load_x(ring + s * STAGE_BYTES, kb0 + s);
        cp_async_commit();
    }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}


// Where this thread's 16-byte copies of every k block come from and go to:
// weight rows past n and input rows past `rows` are clamped to the last one
// (valid memory; their results are never stored). Computed once per CTA, so
// queueing a block is one add and one cp.async per copy.
template <int MT>
struct Copies {
    static constexpr int W = TILE_N * 8 / THREADS;                // weight chunks per thread
    static constexpr int X = (Layout<MT>::M * 16 + THREADS - 1) / THREADS;  // input chunks per thread
    const uint16_t* w_src[W];
    uint32_t w_dst[W];
    const float* x_src[X];
    uint32_t x_dst[X];
    bool x_live[X];
    const float* nw_src;  // this thread's 16 bytes of each block's norm weights, or nullptr

    // CTA-local weight row r (0-127, warp r >> 4) is weight row n0 + r, or with `silu`
    // the gate ((r & 8) == 0) or up row of act column 64 x + 8 (r >> 4) + (r & 7) (see the header).
    __device__ __forceinline__ Copies(const uint16_t* W_, const float* x, int n0, int m0, int n, int k, int rows, bool silu,
                                      const float* norm_w) {
        nw_src = norm_w && threadIdx.x < KB / 4 ? norm_w + threadIdx.x * 4 : nullptr;
#pragma unroll
        for (int i = 0; i < W; i++) {
            const int idx = threadIdx.x + i * THREADS, r = idx >> 3, c = idx & 7;
            const int act = n0 / 2 + 8 * (r >> 4) + (r & 7);
            const int src = silu ? act + ((r & 8) ? n / 2 : 0) : min(n0 + r, n - 1);
            w_src[i] = W_ + (size_t)src * k + c * 8;
            w_dst[i] = swizzled(r, c);
        }
#pragma unroll
        for (int i = 0; i < X; i++) {
            const int idx = threadIdx.x + i * THREADS, r = idx >> 4, c = idx & 15;
            x_live[i] = idx < Layout<MT>::M * 16;
            x_src[i] = x + (size_t)min(m0 + r, rows - 1) * k + c * 4;
            x_dst[i] = Layout<MT>::W_BYTES + idx * 16;
        }
    }

    // Queues the weights (and norm weights; or the inputs) of k block kb into the ring
    // slot at shared address `stage`.
    __device__ __forceinline__ void load_w(uint32_t stage, int kb) const {
#pragma unroll
        for (int i = 0; i < W; i++) cp_async16(stage + w_dst[i], w_src[i] + kb * KB);
        if (nw_src) cp_async16(stage + Layout<MT>::W_BYTES + Layout<MT>::X_BYTES + threadIdx.x * 16, nw_src + kb * KB);
    }
    __device__ __forceinline__ void load_x(uint32_t stage, int kb) const {
#pragma unroll
        for (int i = 0; i < X; i++)
            if (x_live[i]) cp_async16(stage + x_dst[i], x_src[i] + kb * KB);
    }
    __device__ __forceinline__ void load(uint32_t stage, int kb) const {
        load_w(stage, kb);
        load_x(stage, kb);
    }
};

// The f32 inputs of a landed ring slot -> bf16 hi and lo tiles (x = hi + lo,
// common.cuh split_bf16x2), four elements per thread at a time, so every thread
// shares the work.
// With `norm` (the RMSNorm fusion), each input is first added to its row's sum of
// squares ss[i] (thread-local; the row of iteration i is idx >> 4) and multiplied
// by its column's norm weight, which came into the slot with the block.
template <int MT>
__device__ __forceinline__ void split_inputs(const unsigned char* stage, unsigned char* hi, unsigned char* lo, bool norm,
                                             float (&ss)[MT]) {
    using L = Layout<MT>;
    const float* xf = reinterpret_cast<const float*>(stage + L::W_BYTES);
    const float* nw = reinterpret_cast<const float*>(stage + L::W_BYTES + L::X_BYTES);
#pragma unroll
    for (int i = 0; i < L::M * 16 / THREADS; i++) {
        const int idx = threadIdx.x + i * THREADS, r = idx >> 4, q = idx & 15;  // q: 4-element quarter chunk
        float4 a = *reinterpret_cast<const float4*>(xf + r * KB + q * 4);
        if (norm) {
            ss[i] += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            const float4 w = *reinterpret_cast<const float4*>(nw + q * 4);
            a.x *= w.x; a.y *= w.y; a.z *= w.z; a.w *= w.w;
        }
        uint32_t h0, h1, l0, l1;
        split_bf16x2(a.x, a.y, h0, l0);
        split_bf16x2(a.z, a.w, h1, l1);
        const int off = swizzled(r, q >> 1) + (q & 1) * 8;
        *reinterpret_cast<uint2*>(hi + off) = make_uint2(h0, h1);
        *reinterpret_cast<uint2*>(lo + off) = make_uint2(l0, l1);
    }
}

template <int MT>
__device__ __forceinline__ void body(const uint16_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
                                     int n, int k, int rows, int accumulate, float* __restrict__ ws,
                                     unsigned* __restrict__ counters, const float* __restrict__ norm_w, float eps,
                                     int silu) {
    using L = Layout<MT>;
    constexpr int STAGES = L::STAGES;
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* split_base = smem + STAGES * L::STAGE_BYTES;  // [buffer][hi | lo]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * TILE_N, m0 = blockIdx.y * L::M;
    const int splits = gridDim.z, split = blockIdx.z;
    const int blocks = k / KB;
    const int kb0 = split * blocks / splits, count = (split + 1) * blocks / splits - kb0;

    // The hi and lo products accumulate apart (two independent MMA chains per
    // tile instead of one twice as long) and are added once at the end.
    float acc[MT][2][4], acc_lo[MT][2][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = acc_lo[i][j][e] = 0.0f;

    const Copies<MT> copies(W, x, n0, m0, n, k, rows, silu != 0, norm_w);
    const uint32_t ring = smem_addr(smem);
    fill_ring<STAGES, L::STAGE_BYTES>(copies, ring, count, kb0);
    float ss[MT];  // this thread's share of its rows' sums of squares (norm_w only)
#pragma unroll
    for (int i = 0; i < MT; i++) ss[i] = 0.0f;
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    split_inputs<MT>(smem, split_base, split_base + L::SPLIT_BYTES, norm_w != nullptr, ss);

    // ldmatrix row addresses of this lane: weight rows 16 warp + (lane & 7) + 8 (lane >> 4)
    // at chunk offset (lane >> 3) & 1; input rows (lane & 7) + 8 ((lane >> 3) & 1) at lane >> 4.
    const int w_row = 16 * warp + (lane & 7) + ((lane >> 4) << 3), w_chunk = (lane >> 3) & 1;
    const int x_row = (lane & 7) + (((lane >> 3) & 1) << 3), x_chunk = lane >> 4;

    for (int i = 0; i < count; i++) {
        // Block i + 1 has landed (and block i's split tiles are written) once every thread is here;
        // every warp has also finished block i - 1, whose ring slot and split buffer are reused below.
        cp_async_wait<STAGES - 3>();
        __syncthreads();
        if (i + STAGES - 1 < count) copies.load(ring + ((i + STAGES - 1) % STAGES) * L::STAGE_BYTES, kb0 + i + STAGES - 1);
        cp_async_commit();
        if (i + 1 < count) {
            unsigned char* next = split_base + ((i + 1) & 1) * 2 * L::SPLIT_BYTES;
            split_inputs<MT>(smem + ((i + 1) % STAGES) * L::STAGE_BYTES, next, next + L::SPLIT_BYTES, norm_w != nullptr, ss);
        }
        const uint32_t w_tile = smem_addr(smem + (i % STAGES) * L::STAGE_BYTES);
        const uint32_t hi_tile = smem_addr(split_base + (i & 1) * 2 * L::SPLIT_BYTES);
        const uint32_t lo_tile = hi_tile + L::SPLIT_BYTES;
#pragma unroll
        for (int kk = 0; kk < KB / 16; kk++) {
            uint32_t b[4];  // b0, b1 of weight rows 0-7 of the warp, then of rows 8-15
            ldmatrix_x4(b, w_tile + swizzled(w_row, 2 * kk + w_chunk));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                uint32_t ah[4], al[4];
                const int off = swizzled(16 * mt + x_row, 2 * kk + x_chunk);
                ldmatrix_x4(ah, hi_tile + off);
                ldmatrix_x4(al, lo_tile + off);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    mma_bf16(acc[mt][j], ah, b[2 * j], b[2 * j + 1]);
                    mma_bf16(acc_lo[mt][j], al, b[2 * j], b[2 * j + 1]);
                }
            }
        }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] += acc_lo[i][j][e];

    // Each row's sum of squares over this split: the 16 threads of a row are 16
    // consecutive lanes; one of them keeps it in shared memory (and, when split,
    // with the partials).
    __shared__ float row_ss[Layout<MT>::M];
    if (norm_w) {
#pragma unroll
        for (int i = 0; i < MT; i++) {
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) ss[i] += __shfl_xor_sync(0xffffffffu, ss[i], o);
            if ((threadIdx.x & 15) == 0) row_ss[(threadIdx.x >> 4) + 16 * i] = ss[i];
        }
        __syncthreads();
    }

    // acc[mt][j][e] is y[m0 + 16 mt + g + 8 (e >> 1)][n0 + 16 warp + 8 j + 2 t + (e & 1)].
    if (splits > 1) {
        const int tile = blockIdx.y * gridDim.x + blockIdx.x;
        constexpr int PER_THREAD = MT * 8;
        float4* mine = reinterpret_cast<float4*>(ws + ((size_t)(tile * splits + split) * THREADS + threadIdx.x) * PER_THREAD);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < 2; j++) mine[mt * 2 + j] = make_float4(acc[mt][j][0], acc[mt][j][1], acc[mt][j][2], acc[mt][j][3]);
        // Row sums of squares after every tile's partials: [tile][split][M].
        float* ss_parts = ws + (size_t)gridDim.x * gridDim.y * splits * THREADS * PER_THREAD;
        if (norm_w && threadIdx.x < L::M) ss_parts[(size_t)(tile * splits + split) * L::M + threadIdx.x] = row_ss[threadIdx.x];
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
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mt][j][e] = 0.0f;
        const float4* part = reinterpret_cast<const float4*>(ws + (size_t)tile * splits * THREADS * PER_THREAD) +
                             threadIdx.x * (PER_THREAD / 4);
        constexpr size_t SPLIT_STRIDE = THREADS * PER_THREAD / 4;  // float4s between splits
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            // Every split's words of this m tile in flight at once, then summed in split order.
            float4 p[MAX_SPLITS][2];
#pragma unroll
            for (int s = 0; s < MAX_SPLITS; s++)
#pragma unroll
                for (int j = 0; j < 2; j++)
                    p[s][j] = s < splits ? __ldcg(part + s * SPLIT_STRIDE + mt * 2 + j) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int s = 0; s < MAX_SPLITS; s++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    acc[mt][j][0] += p[s][j].x; acc[mt][j][1] += p[s][j].y;
                    acc[mt][j][2] += p[s][j].z; acc[mt][j][3] += p[s][j].w;
                }
        }
        if (norm_w) {
            __syncthreads();  // every thread has read row_ss above (already ordered by the barriers before; kept for clarity)
            if (threadIdx.x < L::M) {
                float total = 0.0f;
                for (int s = 0; s < splits; s++) total += __ldcg(ss_parts + (size_t)(tile * splits + s) * L::M + threadIdx.x);
                row_ss[threadIdx.x] = total;
            }
            __syncthreads();
        }
    }
    // The RMSNorm's row scale, applied to the finished sums (1 without the fusion).
    float scale[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int h = 0; h < 2; h++) scale[mt][h] = norm_w ? rsqrtf(row_ss[16 * mt + g + 8 * h] / (float)k + eps) : 1.0f;
    if (silu) {
        const int ff = n / 2;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = m0 + 16 * mt + g + 8 * (e >> 1), col = n0 / 2 + 8 * warp + 2 * t + (e & 1);
                if (m >= rows) continue;
                const float gate = acc[mt][0][e] * scale[mt][e >> 1], up = acc[mt][1][e] * scale[mt][e >> 1];
                y[(size_t)m * ff + col] = gate / (1.0f + __expf(-gate)) * up;
            }
        return;
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int m = m0 + 16 * mt + g + 8 * (e >> 1), col = n0 + 16 * warp + 8 * j + 2 * t + (e & 1);
                if (m >= rows || col >= n) continue;
                float* out = y + (size_t)m * n + col;
                const float v = acc[mt][j][e] * scale[mt][e >> 1];
                *out = accumulate ? *out + v : v;
            }
}

}  // namespace gemm_tc

#define GEMM_TC(MT)                                                                                              \
    ROCKET_KERNEL void __launch_bounds__(256) gemm_tc_m##MT(const uint16_t* __restrict__ W,                        \
                                                            const float* __restrict__ x, float* y, int n, int k,   \
                                                            int rows, int accumulate, float* ws,                  \
                                                            unsigned* counters, const float* norm_w, float eps,   \
                                                            int silu) {                                           \
        gemm_tc::body<MT>(W, x, y, n, k, rows, accumulate, ws, counters, norm_w, eps, silu);                     \
    }
GEMM_TC(1)
GEMM_TC(2)
GEMM_TC(4)
GEMM_TC(5)

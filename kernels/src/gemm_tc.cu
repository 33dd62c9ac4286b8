// gemm_tc_mMT_nNT: y[t][n] (+)= sum_k W[n][k] * x[t][k] on the tensor cores, for a
// bf16 weight W [n][k] and M f32 input rows x [rows][k]: the batched-decode and
// prefill counterpart of gemv.cu. Each f32 input is split into bf16 hi + lo
// (x = hi + lo to ~16 bits of mantissa) and multiplied as two bf16 MMAs
// (mma.sync m16n8k16, f32 accumulation), so the result is as close to f32 as
// the GEMV's. With accumulate = 1 the result is added to y (residual adds).
//
// Tiling: a CTA of 8 warps owns 8*NT weight rows and MT*16 input rows; its warps
// split K in 64-wide blocks (warp w takes blocks w, w+8, ...) and the CTA sums
// the 8 partial tiles in shared memory in a fixed order (deterministic).
// Within a 64-wide block, lane (g = lane/4, t = lane%4) loads weight row g of
// each 8-row tile at columns 16t..16t+15 (two 16-byte loads, 128 contiguous
// bytes per row per 4 lanes) and the same columns of input rows g and g+8. MMA
// step s (0..3) then uses the column pairs j = 2s and 2s+1 of those 16: a fixed
// permutation of k applied to both operands, which leaves the dot products
// unchanged and lets every load be 16 bytes wide.
//
// Contract: k % 64 == 0, W rows and x rows 16-byte aligned. grid = (ceil(n / (8 NT)),
// ceil(rows / (16 MT))), block = 256.
#include "common.cuh"

namespace gemm_tc {

__device__ __forceinline__ uint32_t pack_bf16(uint16_t lo_k, uint16_t hi_k) {
    return (uint32_t)lo_k | ((uint32_t)hi_k << 16);
}

// Two f32 -> (hi pair, lo pair) of bf16, each pair packed low k first.
__device__ __forceinline__ void split_pair(float a, float b, uint32_t& hi, uint32_t& lo) {
    const uint16_t ha = f32_to_bf16(a), hb = f32_to_bf16(b);
    hi = pack_bf16(ha, hb);
    lo = pack_bf16(f32_to_bf16(a - bf16_to_f32(ha)), f32_to_bf16(b - bf16_to_f32(hb)));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int MT, int NT>
__device__ __forceinline__ void body(const uint16_t* __restrict__ W, const float* __restrict__ x, float* __restrict__ y,
                                     int n, int k, int rows, int accumulate) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 8 * NT, m0 = blockIdx.y * 16 * MT;
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    for (int kb = warp; kb < k / 64; kb += 8) {
        const int col = kb * 64 + 16 * t;
        // Weight words: w[nt][j] holds columns col + 2j, col + 2j + 1 of row n0 + 8 nt + g.
        uint32_t w[NT][8];
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int row = min(n0 + 8 * j + g, n - 1);
            const uint4* src = reinterpret_cast<const uint4*>(W + (size_t)row * k + col);
            const uint4 p = __ldg(src), q = __ldg(src + 1);
            w[j][0] = p.x; w[j][1] = p.y; w[j][2] = p.z; w[j][3] = p.w;
            w[j][4] = q.x; w[j][5] = q.y; w[j][6] = q.z; w[j][7] = q.w;
        }
#pragma unroll
        for (int i = 0; i < MT; i++) {
            // Input words of rows g and g + 8 of this m16 tile, split into hi and lo.
            uint32_t hi[2][8], lo[2][8];
#pragma unroll
            for (int half = 0; half < 2; half++) {
                const int m = m0 + 16 * i + g + 8 * half;
                float v[16];
                if (m < rows) {
                    const float4* src = reinterpret_cast<const float4*>(x + (size_t)m * k + col);
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const float4 f = __ldg(src + q);
                        v[4 * q] = f.x; v[4 * q + 1] = f.y; v[4 * q + 2] = f.z; v[4 * q + 3] = f.w;
                    }
                } else {
#pragma unroll
                    for (int e = 0; e < 16; e++) v[e] = 0.0f;
                }
#pragma unroll
                for (int j = 0; j < 8; j++) split_pair(v[2 * j], v[2 * j + 1], hi[half][j], lo[half][j]);
            }
#pragma unroll
            for (int s = 0; s < 4; s++) {
                // A registers: (row g, pair 2s), (row g+8, pair 2s), (row g, pair 2s+1), (row g+8, pair 2s+1).
                const uint32_t ah[4] = {hi[0][2 * s], hi[1][2 * s], hi[0][2 * s + 1], hi[1][2 * s + 1]};
                const uint32_t al[4] = {lo[0][2 * s], lo[1][2 * s], lo[0][2 * s + 1], lo[1][2 * s + 1]};
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    mma_bf16(acc[i][j], ah, w[j][2 * s], w[j][2 * s + 1]);
                    mma_bf16(acc[i][j], al, w[j][2 * s], w[j][2 * s + 1]);
                }
            }
        }
    }

    // The 8 warps' partial tiles -> y, summed in warp order.
    __shared__ float part[8][16 * MT][8 * NT];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) part[warp][16 * i + g + 8 * (e >> 1)][8 * j + 2 * t + (e & 1)] = acc[i][j][e];
    __syncthreads();
    for (int idx = threadIdx.x; idx < 16 * MT * 8 * NT; idx += blockDim.x) {
        const int r = idx / (8 * NT), c = idx % (8 * NT);
        const int m = m0 + r, col = n0 + c;
        if (m >= rows || col >= n) continue;
        float s = 0.0f;
#pragma unroll
        for (int w8 = 0; w8 < 8; w8++) s += part[w8][r][c];
        float* out = y + (size_t)m * n + col;
        *out = accumulate ? *out + s : s;
    }
}

}  // namespace gemm_tc

#define GEMM_TC(MT, NT)                                                                                          \
    ROCKET_KERNEL void __launch_bounds__(256) gemm_tc_m##MT##_n##NT(const uint16_t* __restrict__ W,                \
                                                                    const float* __restrict__ x, float* y, int n, \
                                                                    int k, int rows, int accumulate) {            \
        gemm_tc::body<MT, NT>(W, x, y, n, k, rows, accumulate);                                                  \
    }
GEMM_TC(1, 1)
GEMM_TC(1, 2)
GEMM_TC(2, 1)
GEMM_TC(2, 2)
GEMM_TC(4, 1)
GEMM_TC(4, 2)

// gemv_bf16_tN: y[t][r] (+)= sum_c W[r][c] * x[t][c] for a bf16 weight W [n][k]
// and N f32 input rows x [rows][k]; f32 accumulation. With accumulate = 1 the
// result is added to y (the residual add after o_proj and down_proj).
// One warp per output row computes that row for N tokens, so each weight byte is
// read once per N tokens: N = 1 is the batch-1 decode GEMV, N = 2..16 the
// small-batch GEMM. Contract: k % 8 == 0 (16-byte weight loads), W rows 16-byte
// aligned. grid = (ceil(n / 8), ceil(rows / N)), block = 256 (8 warps).
#include "common.cuh"

template <int N>
__device__ __forceinline__ void gemv_body(const uint16_t* __restrict__ W, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int k, int rows, int accumulate) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * N;
    if (r >= n) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(W + (size_t)r * k);
    float acc[N];
#pragma unroll
    for (int t = 0; t < N; t++) acc[t] = 0.0f;
    const int chunks = k / 8;
#pragma unroll 4
    for (int c = lane; c < chunks; c += 32) {
        float wv[8];
        unpack8(__ldg(wrow + c), wv);
#pragma unroll
        for (int t = 0; t < N; t++) {
            if (t0 + t < rows) {
                const float4* xv = reinterpret_cast<const float4*>(x + (size_t)(t0 + t) * k) + 2 * c;
                const float4 a = __ldg(xv), b = __ldg(xv + 1);
                acc[t] += wv[0] * a.x + wv[1] * a.y + wv[2] * a.z + wv[3] * a.w + wv[4] * b.x + wv[5] * b.y +
                          wv[6] * b.z + wv[7] * b.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < N; t++) {
        const float s = warp_sum(acc[t]);
        if (lane == 0 && t0 + t < rows) {
            float* out = y + (size_t)(t0 + t) * n + r;
            *out = accumulate ? *out + s : s;
        }
    }
}

#define GEMV(N)                                                                                            \
    ROCKET_KERNEL void __launch_bounds__(256) gemv_bf16_t##N(const uint16_t* __restrict__ W,                \
                                                             const float* __restrict__ x, float* y, int n, \
                                                             int k, int rows, int accumulate) {            \
        gemv_body<N>(W, x, y, n, k, rows, accumulate);                                                     \
    }
GEMV(1)
GEMV(2)
GEMV(4)
GEMV(8)
GEMV(16)

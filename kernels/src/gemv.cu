// gemv_bf16_tN: y[t][r] (+)= sum_c W[r][c] * x[t][c] for a bf16 weight W [n][k]
// and N f32 input rows x [rows][k]; f32 accumulation. With accumulate = 1 the
// result is added to y (the residual add after o_proj and down_proj).
// One warp computes R output rows for N tokens, so each weight byte is read
// once per N tokens and each input load serves R rows: N = 1 is the batch-1
// decode GEMV, N = 2..16 the small-batch GEMM. Contract: k % 8 == 0 (16-byte
// weight loads), W rows 16-byte aligned. grid = (ceil(n / (8 R)), ceil(rows / N)),
// block = 256 (8 warps); R per N is in GEMV_ROWS_PER_WARP (kernels.rs).
#include "common.cuh"

template <int N, int R>
__device__ __forceinline__ void gemv_body(const uint16_t* __restrict__ W, const float* __restrict__ x,
                                          float* __restrict__ y, int n, int k, int rows, int accumulate) {
    pdl_enter();
    const int lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * 8 + (threadIdx.x >> 5)) * R;
    const int t0 = blockIdx.y * N;
    if (r0 >= n) return;
    float acc[R][N];
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int t = 0; t < N; t++) acc[j][t] = 0.0f;
    const int chunks = k / 8;
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
        float wv[R][8];
#pragma unroll
        for (int j = 0; j < R; j++) {
            if (r0 + j < n) {
                unpack8(__ldg(reinterpret_cast<const uint4*>(W + (size_t)(r0 + j) * k) + c), wv[j]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; i++) wv[j][i] = 0.0f;
            }
        }
#pragma unroll
        for (int t = 0; t < N; t++) {
            if (t0 + t < rows) {
                const float4* xv = reinterpret_cast<const float4*>(x + (size_t)(t0 + t) * k) + 2 * c;
                const float4 a = __ldg(xv), b = __ldg(xv + 1);
#pragma unroll
                for (int j = 0; j < R; j++)
                    acc[j][t] += wv[j][0] * a.x + wv[j][1] * a.y + wv[j][2] * a.z + wv[j][3] * a.w +
                                 wv[j][4] * b.x + wv[j][5] * b.y + wv[j][6] * b.z + wv[j][7] * b.w;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int t = 0; t < N; t++) {
            const float s = warp_sum(acc[j][t]);
            if (lane == 0 && t0 + t < rows && r0 + j < n) {
                float* out = y + (size_t)(t0 + t) * n + r0 + j;
                *out = accumulate ? *out + s : s;
            }
        }
}

// N tokens per launch row, R weight rows per warp (more rows share each x load).
#define GEMV(N, R)                                                                                         \
    ROCKET_KERNEL void __launch_bounds__(256) gemv_bf16_t##N(const uint16_t* __restrict__ W,                \
                                                             const float* __restrict__ x, float* y, int n, \
                                                             int k, int rows, int accumulate) {            \
        gemv_body<N, R>(W, x, y, n, k, rows, accumulate);                                                  \
    }
GEMV(1, 1)
GEMV(2, 2)
GEMV(4, 2)
GEMV(8, 4)
GEMV(16, 2)

// rope_store_kv: for every row of the fused projection qkv [rows][q_dim + 2*kv_dim]
// (q heads, then k heads, then v): apply the Qwen3 per-head RMSNorm when q_norm /
// k_norm are given (nullptr: Llama, none), rotate q and k by the row's position
// (HF rotate_half, angle = position * inv_freq[i] in f32), write q back in place and
// store k and v as bf16 into the row's sequence KV cache at its position.
// KV layout per sequence: [position][layer][k | v][kv_dim] bf16 at meta[row].kv_base.
// grid = rows, block = 256 (8 warps = ROPE_WARPS); hd even. rope_store_kv_hdD takes
// head_dim up to D (64 or 128; rocket picks the smaller that fits).
//
// Each warp takes heads warp, warp + 8, ... in groups of ROPE_GROUP, lane l holding
// pairs (i, i + hd / 2) for i = l, l + 32, ...: a group's elements, its norm weights,
// the row's angles and the thread's values are all loaded before any of them is
// used, so a block waits for about one round trip to memory rather than two per
// head (at 512 rows the launch is mostly that latency, not its bytes).
#include "common.cuh"

#define ROPE_WARPS 8

// D: the largest head_dim served (ROPE_PAIRS = D / 64 pairs per lane and head);
// ROPE_GROUP heads a warp holds at once, sized to keep a row's block in few
// registers (4 blocks an SM take a pass of 512 rows in one wave).
template <int D>
__device__ __forceinline__ void rope_store_kv_body(float* __restrict__ qkv, const float* __restrict__ inv_freq,
                                                   const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                                   float eps, const RowMeta* __restrict__ meta, int n_heads, int n_kv,
                                                   int hd, int layer, int n_layers) {
    constexpr int ROPE_PAIRS = D / 64, ROPE_GROUP = D <= 64 ? 5 : 3;
    const int row = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int half = hd / 2, heads = n_heads + n_kv;
    const int qd = n_heads * hd, kvd = n_kv * hd;
    float* r = qkv + (size_t)row * (qd + 2 * kvd);
    const RowMeta m = meta[row];
    bool live[ROPE_PAIRS];  // lane's pair p exists at this head_dim
    float fq[ROPE_PAIRS], nq1[ROPE_PAIRS], nq2[ROPE_PAIRS], nk1[ROPE_PAIRS], nk2[ROPE_PAIRS];
#pragma unroll
    for (int p = 0; p < ROPE_PAIRS; p++) {
        const int i = lane + 32 * p;
        live[p] = i < half;
        fq[p] = live[p] ? inv_freq[i] : 0.0f;
        nq1[p] = q_norm && live[p] ? q_norm[i] : 1.0f;
        nq2[p] = q_norm && live[p] ? q_norm[i + half] : 1.0f;
        nk1[p] = k_norm && live[p] ? k_norm[i] : 1.0f;
        nk2[p] = k_norm && live[p] ? k_norm[i + half] : 1.0f;
    }
    // The values: float4 chunks, one per thread and round.
    const float* v = r + qd + kvd;
    uint16_t* kc = reinterpret_cast<uint16_t*>(m.kv_base) + ((size_t)m.position * n_layers + layer) * 2 * kvd;
    for (int c = threadIdx.x; c < kvd / 4; c += blockDim.x) {
        const float4 x = reinterpret_cast<const float4*>(v)[c];
        reinterpret_cast<uint2*>(kc + kvd)[c] =
            make_uint2((uint32_t)f32_to_bf16(x.x) | ((uint32_t)f32_to_bf16(x.y) << 16),
                       (uint32_t)f32_to_bf16(x.z) | ((uint32_t)f32_to_bf16(x.w) << 16));
    }
    const float pos = (float)m.position;
    float sn[ROPE_PAIRS], cs[ROPE_PAIRS];
#pragma unroll
    for (int p = 0; p < ROPE_PAIRS; p++) sincosf(pos * fq[p], &sn[p], &cs[p]);

    for (int first = warp; first < heads; first += ROPE_WARPS * ROPE_GROUP) {
        float x1[ROPE_GROUP][ROPE_PAIRS], x2[ROPE_GROUP][ROPE_PAIRS];
#pragma unroll
        for (int g = 0; g < ROPE_GROUP; g++) {
            const int head = first + g * ROPE_WARPS;
            const float* h = head < n_heads ? r + head * hd : r + qd + (head - n_heads) * hd;
#pragma unroll
            for (int p = 0; p < ROPE_PAIRS; p++) {
                const bool in = head < heads && live[p];
                x1[g][p] = in ? h[lane + 32 * p] : 0.0f;
                x2[g][p] = in ? h[lane + 32 * p + half] : 0.0f;
            }
        }
#pragma unroll
        for (int g = 0; g < ROPE_GROUP; g++) {
            const int head = first + g * ROPE_WARPS;
            if (head >= heads) break;  // the same for the whole warp
            const bool is_q = head < n_heads;
            const bool normed = (is_q ? q_norm : k_norm) != nullptr;
            float scale = 1.0f;
            if (normed) {
                // Lane l's squares in the order of elements l, l + 32, ... of the head.
                float ss = 0.0f;
#pragma unroll
                for (int p = 0; p < ROPE_PAIRS; p++) ss += x1[g][p] * x1[g][p];
#pragma unroll
                for (int p = 0; p < ROPE_PAIRS; p++) ss += x2[g][p] * x2[g][p];
                scale = rsqrtf(warp_sum(ss) / (float)hd + eps);
            }
#pragma unroll
            for (int p = 0; p < ROPE_PAIRS; p++) {
                if (!live[p]) continue;
                const int i = lane + 32 * p;
                const float a = normed ? (is_q ? nq1[p] : nk1[p]) * (x1[g][p] * scale) : x1[g][p];
                const float b = normed ? (is_q ? nq2[p] : nk2[p]) * (x2[g][p] * scale) : x2[g][p];
                const float y1 = a * cs[p] - b * sn[p], y2 = b * cs[p] + a * sn[p];
                if (is_q) {
                    float* h = r + head * hd;
                    h[i] = y1;
                    h[i + half] = y2;
                } else {
                    uint16_t* kh = kc + (head - n_heads) * hd;
                    kh[i] = f32_to_bf16(y1);
                    kh[i + half] = f32_to_bf16(y2);
                }
            }
        }
    }
}

#define ROPE_STORE_KV(D)                                                                                                 \
    ROCKET_KERNEL void __launch_bounds__(ROPE_WARPS * 32, 4)                                                             \
        rope_store_kv_hd##D(float* __restrict__ qkv, const float* __restrict__ inv_freq, const float* __restrict__ q_norm,\
                            const float* __restrict__ k_norm, float eps, const RowMeta* __restrict__ meta, int n_heads,  \
                            int n_kv, int hd, int layer, int n_layers) {                                                 \
        pdl_enter();                                                                                                     \
        rope_store_kv_body<D>(qkv, inv_freq, q_norm, k_norm, eps, meta, n_heads, n_kv, hd, layer, n_layers);             \
    }
ROPE_STORE_KV(64)
ROPE_STORE_KV(128)

// Grouped-query attention of each row's q over its sequence's cached keys and
// values (positions 0..context-1), split over the sequence so long contexts use
// many SMs; a second kernel merges the splits. Serves decode (one row per
// sequence) and prefill (one row per new token, each with its own context).
//
// attn_partial_hdD: q rows are q_stride floats apart (the fused qkv buffer). grid = (n_heads, rows, splits), block = 128 (4 warps).
//   With row_index, grid.y counts the rows it lists (the rest of a prefill pass goes to
//   attention_prefill.cu); without, row = blockIdx.y.
//   Split s covers positions [s*chunk, min((s+1)*chunk, context)); each warp takes 4
//   consecutive positions at a time (loads first) with an online softmax; writes the split's max m, sum l and
//   unnormalised output o to part_ml [rows][n_heads][splits][2] and part_o [..][D].
// attn_merge_hdD: grid = (n_heads, rows), block = D; out [rows][n_heads*D].
#include "common.cuh"

template <int D>
__device__ __forceinline__ void attn_partial_body(const float* __restrict__ q, int q_stride, const RowMeta* __restrict__ meta,
                                                  const int* __restrict__ row_index, float* __restrict__ part_o,
                                                  float* __restrict__ part_ml, int n_heads, int n_kv, int layer, int n_layers,
                                                  int chunk, float scale) {
    constexpr int E = D / 32;  // elements per lane
    const int head = blockIdx.x, split = blockIdx.z, splits = gridDim.z;
    const int row = row_index ? row_index[blockIdx.y] : blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kv_head = head / (n_heads / n_kv);
    const int kvd = n_kv * D;
    const RowMeta m = meta[row];
    const int begin = split * chunk;
    const int end = min(begin + chunk, m.context);
    float qv[E];
#pragma unroll
    for (int e = 0; e < E; e++) qv[e] = q[(size_t)row * q_stride + head * D + lane * E + e] * scale;
    float mx = -INFINITY, l = 0.0f, acc[E];
#pragma unroll
    for (int e = 0; e < E; e++) acc[e] = 0.0f;
    const uint16_t* cache = reinterpret_cast<const uint16_t*>(m.kv_base);
    const size_t pos_stride = (size_t)n_layers * 2 * kvd;
    const uint16_t* base = cache + (size_t)layer * 2 * kvd + kv_head * D + lane * E;
    // Each warp takes G consecutive positions at a time and issues all their key
    // and value loads before using any, so the loads overlap instead of forming
    // one latency chain per position.
    constexpr int G = 4;
    for (int p0 = begin + warp * G; p0 < end; p0 += 4 * G) {
        float kf[G][E], vf[G][E], s[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            const int p = min(p0 + g, end - 1);
            const uint16_t* kp = base + (size_t)p * pos_stride;
#pragma unroll
            for (int e = 0; e < E; e++) {
                kf[g][e] = bf16_to_f32(kp[e]);
                vf[g][e] = bf16_to_f32(kp[kvd + e]);
            }
        }
        float gmax = mx;
#pragma unroll
        for (int g = 0; g < G; g++) {
            float d = 0.0f;
#pragma unroll
            for (int e = 0; e < E; e++) d += qv[e] * kf[g][e];
            s[g] = p0 + g < end ? warp_sum(d) : -INFINITY;
            gmax = fmaxf(gmax, s[g]);
        }
        const float corr = __expf(mx - gmax);
        l *= corr;
#pragma unroll
        for (int e = 0; e < E; e++) acc[e] *= corr;
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float w = __expf(s[g] - gmax);
            l += w;
#pragma unroll
            for (int e = 0; e < E; e++) acc[e] += w * vf[g][e];
        }
        mx = gmax;
    }
    // Merge the 4 warps.
    __shared__ float sm_m[4], sm_l[4], sm_o[4][D];
    if (lane == 0) { sm_m[warp] = mx; sm_l[warp] = l; }
#pragma unroll
    for (int e = 0; e < E; e++) sm_o[warp][lane * E + e] = acc[e];
    __syncthreads();
    const size_t slot = ((size_t)row * n_heads + head) * splits + split;
    if (warp == 0) {
        float M = fmaxf(fmaxf(sm_m[0], sm_m[1]), fmaxf(sm_m[2], sm_m[3]));
        float L = 0.0f, o[E];
#pragma unroll
        for (int e = 0; e < E; e++) o[e] = 0.0f;
        for (int w = 0; w < 4; w++) {
            const float f = sm_m[w] == -INFINITY ? 0.0f : __expf(sm_m[w] - M);
            L += sm_l[w] * f;
#pragma unroll
            for (int e = 0; e < E; e++) o[e] += sm_o[w][lane * E + e] * f;
        }
#pragma unroll
        for (int e = 0; e < E; e++) part_o[slot * D + lane * E + e] = o[e];
        if (lane == 0) { part_ml[slot * 2] = M; part_ml[slot * 2 + 1] = L; }
    }
}

template <int D>
__device__ __forceinline__ void attn_merge_body(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                const int* __restrict__ row_index, float* __restrict__ out, int n_heads,
                                                int splits) {
    const int head = blockIdx.x, i = threadIdx.x;
    const int row = row_index ? row_index[blockIdx.y] : blockIdx.y;
    const size_t base = ((size_t)row * n_heads + head) * splits;
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, part_ml[(base + s) * 2]);
    float L = 0.0f, o = 0.0f;
    for (int s = 0; s < splits; s++) {
        const float m = part_ml[(base + s) * 2];
        if (m == -INFINITY) continue;
        const float f = __expf(m - M);
        L += part_ml[(base + s) * 2 + 1] * f;
        o += part_o[(base + s) * D + i] * f;
    }
    out[((size_t)row * n_heads + head) * D + i] = o / L;
}

#define ATTN(D)                                                                                                \
    ROCKET_KERNEL void __launch_bounds__(128)                                                                  \
        attn_partial_hd##D(const float* __restrict__ q, int q_stride, const RowMeta* __restrict__ meta,         \
                           const int* __restrict__ row_index, float* part_o, float* part_ml, int n_heads,      \
                           int n_kv, int layer, int n_layers, int chunk, float scale) {                        \
        pdl_enter();                                                                                           \
        attn_partial_body<D>(q, q_stride, meta, row_index, part_o, part_ml, n_heads, n_kv, layer, n_layers,   \
                             chunk, scale);                                                                    \
    }                                                                                                          \
    ROCKET_KERNEL void attn_merge_hd##D(const float* __restrict__ part_o, const float* __restrict__ part_ml,   \
                                        const int* __restrict__ row_index, float* __restrict__ out,            \
                                        int n_heads, int splits) {                                             \
        pdl_enter();                                                                                           \
        attn_merge_body<D>(part_o, part_ml, row_index, out, n_heads, splits);                                  \
    }
ATTN(32)
ATTN(64)
ATTN(128)

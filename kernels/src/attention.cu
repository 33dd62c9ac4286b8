// Grouped-query attention of each row's q over its sequence's cached keys and
// values (positions 0..context-1), split over the sequence so long contexts use
// many SMs. Serves decode (one row per sequence) and prefill (one row per new
// token, each with its own context).
//
// attention_hdD: grid = (n_kv, rows, splits), block = 128 (4 warps). A CTA takes
//   one KV head and all `group` = n_heads / n_kv (<= MAX_GROUP) q heads that share
//   it, so each key and value is loaded once for the group. q rows are q_stride
//   floats apart (the fused qkv buffer). Split s covers positions
//   [s*chunk, min((s+1)*chunk, context)); each warp takes G consecutive positions
//   at a time (loads first) with an online softmax per head; the 4 warps are
//   merged in shared memory. With one split that is the output. Otherwise each
//   split writes its max m, sum l and unnormalised o to part_ml
//   [rows][n_heads][splits][2] and part_o [..][D], and the split that arrives
//   last (a counter per (row, KV head), reset by it for the next launch) merges
//   them in split order into out [rows][n_heads*D]; the order is fixed, so the
//   result does not depend on which split lands last.
//   counters: rows * n_kv zeroed words.
#include "common.cuh"

namespace attn {

constexpr int WARPS = 4;
constexpr int MAX_GROUP = 8;  // q heads per KV head (Llama-3.2-1B 4, Qwen3 2, SmolLM2 3)
constexpr int G = 4;          // positions per warp per iteration

template <int D>
__device__ __forceinline__ void body(const float* __restrict__ q, int q_stride, const RowMeta* __restrict__ meta,
                                     float* __restrict__ part_o, float* __restrict__ part_ml, float* __restrict__ out,
                                     unsigned* __restrict__ counters, int n_heads, int n_kv, int layer, int n_layers,
                                     int chunk, float scale) {
    constexpr int E = D / 32;  // elements per lane
    const int kv_head = blockIdx.x, row = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int group = n_heads / n_kv, head0 = kv_head * group;
    const int kvd = n_kv * D;
    const RowMeta m = meta[row];
    const int begin = split * chunk;
    const int end = min(begin + chunk, m.context);
    float qv[MAX_GROUP][E], acc[MAX_GROUP][E], mx[MAX_GROUP], l[MAX_GROUP];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; h++) {
        mx[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            qv[h][e] = h < group ? q[(size_t)row * q_stride + (head0 + h) * D + lane * E + e] * scale : 0.0f;
            acc[h][e] = 0.0f;
        }
    }
    const uint16_t* cache = reinterpret_cast<const uint16_t*>(m.kv_base);
    const size_t pos_stride = (size_t)n_layers * 2 * kvd;
    const uint16_t* base = cache + (size_t)layer * 2 * kvd + kv_head * D + lane * E;
    // All G positions' key and value loads are issued before any is used, so they
    // overlap instead of forming one latency chain per position.
    for (int p0 = begin + warp * G; p0 < end; p0 += WARPS * G) {
        float kf[G][E], vf[G][E];
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
#pragma unroll
        for (int h = 0; h < MAX_GROUP; h++) {
            if (h >= group) break;
            float s[G], gmax = mx[h];
#pragma unroll
            for (int g = 0; g < G; g++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < E; e++) d += qv[h][e] * kf[g][e];
                s[g] = p0 + g < end ? warp_sum(d) : -INFINITY;
                gmax = fmaxf(gmax, s[g]);
            }
            const float corr = __expf(mx[h] - gmax);
            l[h] *= corr;
#pragma unroll
            for (int e = 0; e < E; e++) acc[h][e] *= corr;
#pragma unroll
            for (int g = 0; g < G; g++) {
                const float w = __expf(s[g] - gmax);
                l[h] += w;
#pragma unroll
                for (int e = 0; e < E; e++) acc[h][e] += w * vf[g][e];
            }
            mx[h] = gmax;
        }
    }

    // Merge the 4 warps per head: warp w merges heads w, w + 4, ...
    __shared__ float sm_m[WARPS][MAX_GROUP], sm_l[WARPS][MAX_GROUP], sm_o[WARPS][MAX_GROUP][D];
#pragma unroll
    for (int h = 0; h < MAX_GROUP; h++) {
        if (h >= group) break;
        if (lane == 0) { sm_m[warp][h] = mx[h]; sm_l[warp][h] = l[h]; }
#pragma unroll
        for (int e = 0; e < E; e++) sm_o[warp][h][lane * E + e] = acc[h][e];
    }
    __syncthreads();
    for (int h = warp; h < group; h += WARPS) {
        const int head = head0 + h;
        float M = fmaxf(fmaxf(sm_m[0][h], sm_m[1][h]), fmaxf(sm_m[2][h], sm_m[3][h]));
        float L = 0.0f, o[E];
#pragma unroll
        for (int e = 0; e < E; e++) o[e] = 0.0f;
        for (int w = 0; w < WARPS; w++) {
            const float f = sm_m[w][h] == -INFINITY ? 0.0f : __expf(sm_m[w][h] - M);
            L += sm_l[w][h] * f;
#pragma unroll
            for (int e = 0; e < E; e++) o[e] += sm_o[w][h][lane * E + e] * f;
        }
        if (splits == 1) {
#pragma unroll
            for (int e = 0; e < E; e++) out[((size_t)row * n_heads + head) * D + lane * E + e] = o[e] / L;
            continue;
        }
        const size_t slot = ((size_t)row * n_heads + head) * splits + split;
#pragma unroll
        for (int e = 0; e < E; e++) part_o[slot * D + lane * E + e] = o[e];
        if (lane == 0) { part_ml[slot * 2] = M; part_ml[slot * 2 + 1] = L; }
    }
    if (splits == 1) return;

    // The last split of this (row, KV head) to finish merges every split.
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) {
        unsigned* counter = counters + (size_t)row * n_kv + kv_head;
        last = atomicAdd(counter, 1u) == (unsigned)(splits - 1);
        if (last) *counter = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int j = threadIdx.x; j < group * D; j += blockDim.x) {
        const int head = head0 + j / D, i = j % D;
        const size_t slots = ((size_t)row * n_heads + head) * splits;
        float M = -INFINITY;
        for (int s = 0; s < splits; s++) M = fmaxf(M, __ldcg(part_ml + (slots + s) * 2));
        float L = 0.0f, o = 0.0f;
        for (int s = 0; s < splits; s++) {
            const float ms = __ldcg(part_ml + (slots + s) * 2);
            if (ms == -INFINITY) continue;
            const float f = __expf(ms - M);
            L += __ldcg(part_ml + (slots + s) * 2 + 1) * f;
            o += __ldcg(part_o + (slots + s) * D + i) * f;
        }
        out[((size_t)row * n_heads + head) * D + i] = o / L;
    }
}

}  // namespace attn

#define ATTN(D)                                                                                                    \
    ROCKET_KERNEL void __launch_bounds__(128)                                                                      \
        attention_hd##D(const float* __restrict__ q, int q_stride, const RowMeta* __restrict__ meta, float* part_o, \
                        float* part_ml, float* out, unsigned* counters, int n_heads, int n_kv, int layer,          \
                        int n_layers, int chunk, float scale) {                                                    \
        pdl_enter();                                                                                               \
        attn::body<D>(q, q_stride, meta, part_o, part_ml, out, counters, n_heads, n_kv, layer, n_layers, chunk,    \
                      scale);                                                                                      \
    }
ATTN(32)
ATTN(64)
ATTN(128)

// rope_store_kv: for every row of the fused projection qkv [rows][q_dim + 2*kv_dim]
// (q heads, then k heads, then v): apply the Qwen3 per-head RMSNorm when q_norm /
// k_norm are given (nullptr: Llama, none), rotate q and k by the row's position
// (HF rotate_half, angle = position * inv_freq[i] in f32), write q back in place and
// store k and v as bf16 into the row's sequence KV cache at its position.
// KV layout per sequence: [position][layer][k | v][kv_dim] bf16 at meta[row].kv_base.
// grid = rows, block = 256 (8 warps = ROPE_WARPS; one warp per head at a time); hd even,
// <= 256 (ROPE_MAX_HD).
#include "common.cuh"

// Heads of up to 256 elements; a warp stages its head's in shared memory.
#define ROPE_MAX_HD 256
#define ROPE_WARPS 8

ROCKET_KERNEL void rope_store_kv(float* __restrict__ qkv, const float* __restrict__ inv_freq,
                                 const float* __restrict__ q_norm, const float* __restrict__ k_norm, float eps,
                                 const RowMeta* __restrict__ meta, int n_heads, int n_kv, int hd, int layer,
                                 int n_layers) {
    pdl_enter();
    const int row = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int half = hd / 2;
    const int qd = n_heads * hd, kvd = n_kv * hd;
    const RowMeta m = meta[row];
    const float pos = (float)m.position;
    float* r = qkv + (size_t)row * (qd + 2 * kvd);
    uint16_t* kc = reinterpret_cast<uint16_t*>(m.kv_base) + ((size_t)m.position * n_layers + layer) * 2 * kvd;
    // The row's angles, once for all of its heads (the sincosf each head took of
    // the same argument), and per warp its head's elements: their loads go out
    // together, where reading them in the loops below took a round trip each.
    __shared__ float2 rot[ROPE_MAX_HD / 2];  // (sin, cos) per frequency
    __shared__ float staged[ROPE_WARPS][ROPE_MAX_HD];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        rot[i] = make_float2(sn, cs);
    }
    __syncthreads();
    float* x = staged[warp];
    for (int head = warp; head < n_heads + n_kv; head += warps) {
        const bool is_q = head < n_heads;
        float* h = is_q ? r + head * hd : r + qd + (head - n_heads) * hd;
        const float* nw = is_q ? q_norm : k_norm;
#pragma unroll
        for (int n = 0; n < ROPE_MAX_HD / 32; n++)
            if (lane + 32 * n < hd) x[lane + 32 * n] = h[lane + 32 * n];
        __syncwarp();
        float scale = 1.0f;
        if (nw) {
            float ss = 0.0f;
            for (int i = lane; i < hd; i += 32) ss += x[i] * x[i];
            scale = rsqrtf(warp_sum(ss) / (float)hd + eps);
        }
        for (int i = lane; i < half; i += 32) {
            const float x1 = nw ? nw[i] * (x[i] * scale) : x[i];
            const float x2 = nw ? nw[i + half] * (x[i + half] * scale) : x[i + half];
            const float2 sc = rot[i];
            const float y1 = x1 * sc.y - x2 * sc.x, y2 = x2 * sc.y + x1 * sc.x;
            if (is_q) {
                h[i] = y1;
                h[i + half] = y2;
            } else {
                uint16_t* kh = kc + (head - n_heads) * hd;
                kh[i] = f32_to_bf16(y1);
                kh[i + half] = f32_to_bf16(y2);
            }
        }
        __syncwarp();  // the staged head is read before the next one replaces it
    }
    const float* v = r + qd + kvd;
    uint16_t* vc = kc + kvd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) vc[i] = f32_to_bf16(v[i]);
}

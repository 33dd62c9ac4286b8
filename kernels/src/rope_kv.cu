// rope_store_kv: for every row of the fused projection qkv [rows][q_dim + 2*kv_dim]
// (q heads, then k heads, then v): apply the Qwen3 per-head RMSNorm when q_norm /
// k_norm are given (nullptr: Llama, none), rotate q and k by the row's position
// (HF rotate_half, angle = position * inv_freq[i] in f32), write q back in place and
// store k and v as bf16 into the row's sequence KV cache at its position.
// KV layout per sequence: [position][layer][k | v][kv_dim] bf16 at meta[row].kv_base.
// grid = rows, block = 256 (8 warps; one warp per head at a time); hd even, <= 256.
#include "common.cuh"

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
    for (int head = warp; head < n_heads + n_kv; head += warps) {
        const bool is_q = head < n_heads;
        float* h = is_q ? r + head * hd : r + qd + (head - n_heads) * hd;
        const float* nw = is_q ? q_norm : k_norm;
        float scale = 1.0f;
        if (nw) {
            float ss = 0.0f;
            for (int i = lane; i < hd; i += 32) ss += h[i] * h[i];
            scale = rsqrtf(warp_sum(ss) / (float)hd + eps);
        }
        // Every lane has read what it needs before any lane writes.
        float x1s[8], x2s[8];
        int n = 0;
        for (int i = lane; i < half; i += 32, n++) {
            x1s[n] = nw ? nw[i] * (h[i] * scale) : h[i];
            x2s[n] = nw ? nw[i + half] * (h[i + half] * scale) : h[i + half];
        }
        __syncwarp();
        n = 0;
        for (int i = lane; i < half; i += 32, n++) {
            float s, c;
            sincosf(pos * inv_freq[i], &s, &c);
            const float y1 = x1s[n] * c - x2s[n] * s, y2 = x2s[n] * c + x1s[n] * s;
            if (is_q) {
                h[i] = y1;
                h[i + half] = y2;
            } else {
                uint16_t* kh = kc + (head - n_heads) * hd;
                kh[i] = f32_to_bf16(y1);
                kh[i + half] = f32_to_bf16(y2);
            }
        }
    }
    const float* v = r + qd + kvd;
    uint16_t* vc = kc + kvd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) vc[i] = f32_to_bf16(v[i]);
}

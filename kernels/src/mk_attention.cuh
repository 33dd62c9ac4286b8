// The megakernel's attention instruction: for KV head g and context split s of
// `splits` (of which the step uses the first `used`: splits of at least
// SPLIT_POSITIONS positions, so a short context is not cut into slivers whose
// merge costs more than their work; the others only arrive), q/k-norm (Qwen3)
// and RoPE of the step's q heads of g and its k (as kernels/src/rope_kv.cu), the
// k/v append at the step's position by the split that holds it, then an
// online-softmax partial over the split's positions (as kernels/src/attention.cu,
// 8 warps instead of 4). Nobody merges the splits here: every O-proj CTA merges
// them as it loads its input (`merge_attention`), which saves the hand-off to a
// merging CTA and that CTA's round trips (~6 µs per layer in the H200 trace).
#pragma once
#include "mk_params.cuh"
#include "mk_sync.cuh"

namespace mk {

// Warp-wide: normalise (when nw) and rotate one head of HD floats at `src` by
// `pos`; lane i holds the pairs (i + 32 k, i + 32 k + HD/2). Calls out(i, y1, y2).
template <int HD, class Out>
__device__ __forceinline__ void rope_head(const Params& p, const float* src, const float* nw, float pos, Out out) {
    constexpr int HALF = HD / 2, PAIRS = HALF / 32;
    const int lane = threadIdx.x & 31;
    float x1[PAIRS], x2[PAIRS];
#pragma unroll
    for (int k = 0; k < PAIRS; k++) {
        x1[k] = __ldcg(src + lane + 32 * k);
        x2[k] = __ldcg(src + lane + 32 * k + HALF);
    }
    if (nw) {
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < PAIRS; k++) ss += x1[k] * x1[k] + x2[k] * x2[k];
        const float scale = rsqrtf(warp_sum(ss) / (float)HD + p.eps);
#pragma unroll
        for (int k = 0; k < PAIRS; k++) {
            const int i = lane + 32 * k;
            x1[k] = __ldg(nw + i) * (x1[k] * scale);
            x2[k] = __ldg(nw + i + HALF) * (x2[k] * scale);
        }
    }
#pragma unroll
    for (int k = 0; k < PAIRS; k++) {
        const int i = lane + 32 * k;
        float sn, cs;
        sincosf(pos * __ldg(p.inv_freq + i), &sn, &cs);
        out(i, x1[k] * cs - x2[k] * sn, x2[k] * cs + x1[k] * sn);
    }
}

// E consecutive bf16 (4 or 8 bytes, aligned) from the KV cache, which other SMs
// wrote during this launch: loaded past L1.
template <int E>
__device__ __forceinline__ void load_bf16(const uint16_t* src, float (&out)[E]) {
    static_assert(E == 2 || E == 4, "head_dim 64 or 128");
    if constexpr (E == 2) {
        const uint32_t w = __ldcg(reinterpret_cast<const unsigned int*>(src));
        out[0] = __uint_as_float(w << 16);
        out[1] = __uint_as_float(w & 0xffff0000u);
    } else {
        const uint2 w = __ldcg(reinterpret_cast<const uint2*>(src));
        out[0] = __uint_as_float(w.x << 16);
        out[1] = __uint_as_float(w.x & 0xffff0000u);
        out[2] = __uint_as_float(w.y << 16);
        out[3] = __uint_as_float(w.y & 0xffff0000u);
    }
}

// Splits of at least SPLIT_POSITIONS positions (the CUDA-graph path's split
// size), at most `splits`: the first `used` splits are never empty
// (geometry.rs `used_splits`).
__device__ __forceinline__ int used_splits(int context, int splits) {
    return min(splits, (context + SPLIT_POSITIONS - 1) / SPLIT_POSITIONS);
}

// Steps 1-3 of a non-empty split: q, the KV append, the split's partial.
template <int HD, int G, int HQ, int HKV, int NL>
__device__ __forceinline__ void attend_split(const Params& p, const Smem& s, const Instr& in, int pos, int begin,
                                             int end) {
    constexpr int QD = HQ * HD, KVD = HKV * HD, E = HD / 32;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int layer = in.layer, g = in.a, split = in.b, splits = in.c;  // splits: the partials' stride
    const LayerPtrs& lw = p.layers[layer];
    const size_t pos_stride = (size_t)NL * 2 * KVD;
    uint16_t* cache = p.kv + (size_t)layer * 2 * KVD + g * HD;
    const bool owner = begin <= pos && pos < end;  // this split appends the step's k and v

    // 1. q heads into s.vec (rotated), k and v of this position into the cache.
    float* sq = s.vec;
    if (warp < G) {
        const int head = g * G + warp;
        rope_head<HD>(p, p.qkv + head * HD, lw.q_norm, (float)pos, [&](int i, float y1, float y2) {
            sq[warp * HD + i] = y1;
            sq[warp * HD + i + HD / 2] = y2;
        });
    } else if (warp == G && owner) {
        uint16_t* kc = cache + (size_t)pos * pos_stride;
        rope_head<HD>(p, p.qkv + QD + g * HD, lw.k_norm, (float)pos, [&](int i, float y1, float y2) {
            kc[i] = f32_to_bf16(y1);
            kc[i + HD / 2] = f32_to_bf16(y2);
        });
    } else if (warp == G + 1 && owner) {
        uint16_t* vc = cache + (size_t)pos * pos_stride + KVD;
        for (int i = lane; i < HD; i += 32) vc[i] = f32_to_bf16(__ldcg(p.qkv + QD + KVD + g * HD + i));
    }
    consumer_sync();  // q in shared memory; this CTA's cache writes visible to its threads

    // 2. Online softmax over positions begin..end: warp w takes P at a time, w*P +
    // 8P k. P loads of K and of V in flight per lane: at long contexts each
    // iteration is an L2/HBM round trip, so the split's latency is its iterations.
    const float scale = 1.0f / sqrtf((float)HD);
    float q[G][E], acc[G][E], m[G], l[G];
#pragma unroll
    for (int h = 0; h < G; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            q[h][e] = sq[h * HD + lane * E + e] * scale;
            acc[h][e] = 0.0f;
        }
    }
    const uint16_t* base = cache + lane * E;
    constexpr int P = 8;  // 8 warps x 8 = one 64-position split per iteration; 32-64 registers of K and V
    for (int p0 = begin + warp * P; p0 < end; p0 += CONSUMER_WARPS * P) {
        float kf[P][E], vf[P][E];
#pragma unroll
        for (int j = 0; j < P; j++) {
            const uint16_t* kp = base + (size_t)min(p0 + j, end - 1) * pos_stride;
            load_bf16<E>(kp, kf[j]);
            load_bf16<E>(kp + KVD, vf[j]);
        }
#pragma unroll
        for (int h = 0; h < G; h++) {
            float sc[P], gmax = m[h];
#pragma unroll
            for (int j = 0; j < P; j++) {
                float d = 0.0f;
#pragma unroll
                for (int e = 0; e < E; e++) d += q[h][e] * kf[j][e];
                sc[j] = p0 + j < end ? warp_sum(d) : -INFINITY;
                gmax = fmaxf(gmax, sc[j]);
            }
            const float corr = __expf(m[h] - gmax);
            l[h] *= corr;
#pragma unroll
            for (int e = 0; e < E; e++) acc[h][e] *= corr;
#pragma unroll
            for (int j = 0; j < P; j++) {
                const float w = __expf(sc[j] - gmax);
                l[h] += w;
#pragma unroll
                for (int e = 0; e < E; e++) acc[h][e] += w * vf[j][e];
            }
            m[h] = gmax;
        }
    }

    // 3. The 8 warps' partials -> this split's partial per q head.
    float* wm = s.vec + 1024;                      // [warp][G]
    float* wl = wm + CONSUMER_WARPS * MAX_GROUP;   // [warp][G]
    float* wo = s.part;                            // [warp][G][HD]
    consumer_sync();                               // everyone is done reading sq
#pragma unroll
    for (int h = 0; h < G; h++) {
        if (lane == 0) {
            wm[warp * G + h] = m[h];
            wl[warp * G + h] = l[h];
        }
#pragma unroll
        for (int e = 0; e < E; e++) wo[(warp * G + h) * HD + lane * E + e] = acc[h][e];
    }
    consumer_sync();
    if (tid < G * HD) {
        const int h = tid / HD, i = tid % HD;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; w++) mx = fmaxf(mx, wm[w * G + h]);
        float lsum = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; w++) {
            const float f = wm[w * G + h] == -INFINITY ? 0.0f : __expf(wm[w * G + h] - mx);
            lsum += wl[w * G + h] * f;
            o += wo[(w * G + h) * HD + i] * f;
        }
        const size_t slot = (size_t)(g * G + h) * splits + split;
        __stcg(p.part_o + slot * HD + i, o);
        if (i == 0) {
            __stcg(p.part_ml + slot * 2, mx);
            __stcg(p.part_ml + slot * 2 + 1, lsum);
        }
    }
    // (The caller's signal() barrier orders these stores before its release.)
}

// One group of 8 attention outputs (q head h, elements i..i+7) merged from the
// used splits' partials, as kernels/src/attention.cu attn_merge: the largest
// max first, then the splits in order, a split with no finite score adding
// nothing. Up to FAST splits load in one round trip; more take two passes.
template <int HD>
__device__ __forceinline__ void merge_group(const Params& p, int h, int i, int used, float (&o)[8]) {
    constexpr int FAST = 4;
    const int splits = p.splits;
    const float* ml = p.part_ml + (size_t)h * splits * 2;
    const float* po = p.part_o + (size_t)h * splits * HD + i;
    float mx = -INFINITY, lsum = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++) o[e] = 0.0f;
    auto add = [&](float2 v, float4 a, float4 b) {
        if (v.x == -INFINITY) return;
        const float f = __expf(v.x - mx);
        lsum += v.y * f;
        const float part[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int e = 0; e < 8; e++) o[e] += part[e] * f;
    };
    auto load = [&](int sp, float2& v, float4& a, float4& b) {
        v = __ldcg(reinterpret_cast<const float2*>(ml + 2 * sp));
        a = __ldcg(reinterpret_cast<const float4*>(po + (size_t)sp * HD));
        b = __ldcg(reinterpret_cast<const float4*>(po + (size_t)sp * HD + 4));
    };
    if (used <= FAST) {
        float2 v[FAST];
        float4 a[FAST], b[FAST];
#pragma unroll
        for (int sp = 0; sp < FAST; sp++) {
            if (sp < used) {
                load(sp, v[sp], a[sp], b[sp]);
            } else {
                v[sp] = make_float2(-INFINITY, 0.0f);
                a[sp] = b[sp] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
        }
#pragma unroll
        for (int sp = 0; sp < FAST; sp++) mx = fmaxf(mx, v[sp].x);
#pragma unroll
        for (int sp = 0; sp < FAST; sp++) add(v[sp], a[sp], b[sp]);
    } else {
#pragma unroll 8
        for (int sp = 0; sp < used; sp++) mx = fmaxf(mx, __ldcg(ml + 2 * sp));
#pragma unroll 4
        for (int sp = 0; sp < used; sp++) {
            float2 v;
            float4 a, b;
            load(sp, v, a, b);
            add(v, a, b);
        }
    }
#pragma unroll
    for (int e = 0; e < 8; e++) o[e] /= lsum;
}

// Step t's attention output (all q heads) into s.vec, merged from the splits'
// partials: the O-proj instruction's input. Thread k takes elements 8k..8k+7.
template <int HD, int HQ>
__device__ __forceinline__ void merge_attention(const Params& p, const Smem& s, int t) {
    constexpr int GROUPS = HQ * HD / 8;
    static_assert(HQ * HD <= VEC_CAP, "the attention output fits the shared vector");
    const int used = used_splits(p.pos0 + t + 1, p.splits);
    for (int grp = threadIdx.x; grp < GROUPS; grp += CONSUMERS) {
        float o[8];
        merge_group<HD>(p, grp * 8 / HD, grp * 8 % HD, used, o);
        float4* dst = reinterpret_cast<float4*>(s.vec + grp * 8);
        dst[0] = make_float4(o[0], o[1], o[2], o[3]);
        dst[1] = make_float4(o[4], o[5], o[6], o[7]);
    }
    consumer_sync();
}

// Called by every consumer before an attention instruction's wait: asks L2 for
// the K and V rows of the split's earlier positions. They are final (written in
// earlier steps) and long evicted by the weight stream, so without this the
// split's first loads after the wait go to HBM. (The step's own position is
// written by this instruction itself.)
template <int HD, int HKV, int NL>
__device__ __forceinline__ void prefetch_split_kv(const Params& p, const Instr& in, int t) {
    constexpr int KVD = HKV * HD, LINES = HD * 2 / 128;  // 128-byte lines per row
    const int g = in.a, split = in.b, splits = in.c;
    const int pos = p.pos0 + t, context = pos + 1;
    const int used = used_splits(context, splits);
    if (split >= used) return;
    const int chunk = (context + used - 1) / used;
    const int begin = min(split * chunk, context), end = min(begin + chunk, pos);
    const size_t pos_stride = (size_t)NL * 2 * KVD;
    const uint8_t* cache = reinterpret_cast<const uint8_t*>(p.kv + (size_t)in.layer * 2 * KVD + g * HD);
    for (int k = threadIdx.x; k < (end - begin) * 2 * LINES; k += CONSUMERS) {
        const int row = k / LINES, line = k % LINES;  // row: position (row / 2), k or v (row % 2)
        prefetch_line_l2(cache + ((begin + row / 2) * pos_stride + (row & 1) * KVD) * 2 + line * 128);
    }
}

template <int HD, int G, int HQ, int HKV, int NL>
__device__ __forceinline__ void attention(const Params& p, const Smem& s, const Instr& in, int t) {
    static_assert(G <= MAX_GROUP && CONSUMER_WARPS * G * HD <= PART_CAP && G * HD <= CONSUMERS, "attention fits");
    const int split = in.b, splits = in.c;
    const int pos = p.pos0 + t, context = pos + 1;
    const int used = used_splits(context, splits);
    const int chunk = (context + used - 1) / used;
    const int begin = min(split * chunk, context), end = min(begin + chunk, context);
    if (split < used) attend_split<HD, G, HQ, HKV, NL>(p, s, in, pos, begin, end);
    // (else: an empty split; splits < used never are, and the merge reads only those.)
}

}  // namespace mk

// The megakernel's attention instruction: for KV head g and context split s of
// `splits` (of which the step uses the first `used`: splits of at least
// SPLIT_POSITIONS positions, so a short context is not cut into slivers whose
// merge costs more than their work; the others only arrive), q/k-norm (Qwen3) and RoPE of the step's q heads of g and its k (as
// kernels/src/rope_kv.cu), the k/v append at the step's position by the split that
// holds it, then an online-softmax partial over the split's positions (as
// kernels/src/attention.cu, 8 warps instead of 4). The last split of g to finish
// merges all splits into p.attn and bumps the layer's merge counter.
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
    consumer_sync();
}

// The last split of KV head g to arrive: every used split's (max, sum) of g's
// q heads staged at once ([h][split][2]), then each output element's sum over
// the splits with its partials' loads in flight together.
template <int HD, int G>
__device__ __forceinline__ void merge_splits(const Params& p, const Smem& s, int g, int splits, int used) {
    const int tid = threadIdx.x;
    float* sml = s.vec + 1536;
    static_assert(1536 + MAX_GROUP * MAX_SPLITS * 2 <= VEC_CAP, "merge staging fits the vector space");
    for (int k = tid; k < G * used * 2; k += CONSUMERS) {
        const int h = k / (2 * used), r = k % (2 * used);
        sml[k] = __ldcg(p.part_ml + (size_t)(g * G + h) * splits * 2 + r);
    }
    consumer_sync();
    if (tid < G * HD) {
        const int h = tid / HD, i = tid % HD;
        const float* ml = sml + h * used * 2;
        const float* po = p.part_o + (size_t)(g * G + h) * splits * HD + i;
        float mx = -INFINITY;
        for (int sp = 0; sp < used; sp++) mx = fmaxf(mx, ml[2 * sp]);
        float lsum = 0.0f, o = 0.0f;
#pragma unroll 8
        for (int sp = 0; sp < used; sp++) {
            const float ms = ml[2 * sp];
            const float f = ms == -INFINITY ? 0.0f : __expf(ms - mx);
            const float part = __ldcg(po + (size_t)sp * HD);
            if (ms != -INFINITY) {  // as attn_merge: a split with no finite score adds nothing
                lsum += ml[2 * sp + 1] * f;
                o += part * f;
            }
        }
        __stcg(p.attn + (g * G + h) * HD + i, o / lsum);
    }
}

template <int HD, int G, int HQ, int HKV, int NL>
__device__ __forceinline__ void attention(const Params& p, const Smem& s, const Instr& in, int t) {
    static_assert(G <= MAX_GROUP && CONSUMER_WARPS * G * HD <= PART_CAP && G * HD <= CONSUMERS, "attention fits");
    const int tid = threadIdx.x;
    const int g = in.a, split = in.b, splits = in.c;
    const int pos = p.pos0 + t, context = pos + 1;
    const int used = used_splits(context, splits);
    const int chunk = (context + used - 1) / used;
    const int begin = min(split * chunk, context), end = min(begin + chunk, context);

    if (split < used) attend_split<HD, G, HQ, HKV, NL>(p, s, in, pos, begin, end);
    // (else: an empty split; splits < used never are, and the merge reads only those.)

    // 4. Arrive; the last split of this KV head merges (kernels/src/attention.cu attn_merge).
    // Thread 0's acquire-release arrival publishes this CTA's partials (ordered
    // before it by the barrier above) and, for the last split, orders the other
    // splits' partials before the merge's reads (ordered after it by the barrier).
    if (tid == 0) {
        const uint32_t arrived = atom_add_acq_rel(p.counters + in.signal, 1) + 1;
        s.sc->flag = arrived == (uint32_t)(t + 1) * splits;
    }
    consumer_sync();
    if (!s.sc->flag) return;
    merge_splits<HD, G>(p, s, g, splits, used);
    consumer_sync();
    if (tid == 0) red_release_add(p.counters + in.d, 1);
}

}  // namespace mk

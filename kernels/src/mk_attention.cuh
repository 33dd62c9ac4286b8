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
// What does not depend on the step's QKV is loaded before the instruction's
// wait (`attention_prepare`: RoPE factors, q/k-norm weights, K/V of earlier
// positions into L2), and K/V load alongside q after it, so a used split's
// critical path is one round trip for its inputs, its arithmetic and the
// partial's release.
#pragma once
#include "mk_params.cuh"
#include "mk_sync.cuh"

namespace mk {

constexpr int ATTN_P = 8;  // positions per warp per iteration: 8 warps x 8 = one 64-position split

// What an attention instruction loads before its wait, per lane.
template <int HD>
struct AttnPre {
    static constexpr int E = HD / 32, PAIRS = HD / 64;
    bool normed;                     // q/k-norm (Qwen3)
    float cs[PAIRS], sn[PAIRS];      // RoPE at the step's position for the lane's pairs (q warps, the k warp)
    float n1[PAIRS], n2[PAIRS];      // the q- or k-norm weights of those pairs
};

// The positions an attention instruction covers at step t: splits of at least
// SPLIT_POSITIONS positions (the CUDA-graph path's split size), at most
// `splits` (in.c), of which the first `used` are never empty (geometry.rs
// `used_splits`); an unused split only arrives.
struct SplitRange {
    int pos, begin, end;
    bool used;
};

__device__ __forceinline__ int used_splits(int context, int splits) {
    return min(splits, (context + SPLIT_POSITIONS - 1) / SPLIT_POSITIONS);
}

__device__ __forceinline__ SplitRange split_range(const Params& p, const Instr& in, int t) {
    const int split = in.b, splits = in.c;
    const int pos = p.pos0 + t, context = pos + 1;
    const int used = used_splits(context, splits);
    const int chunk = (context + used - 1) / used;
    const int begin = min(split * chunk, context);
    return SplitRange{pos, begin, min(begin + chunk, context), split < used};
}

// Before the wait: the lane's RoPE factors at `pos` (pairs i = lane + 32 k and
// i + HD/2) and, when nw, its norm weights (as kernels/src/rope_kv.cu).
template <int HD>
__device__ __forceinline__ void rope_prepare(const Params& p, const float* nw, float pos, AttnPre<HD>& pre) {
    const int lane = threadIdx.x & 31;
    pre.normed = nw != nullptr;
#pragma unroll
    for (int k = 0; k < AttnPre<HD>::PAIRS; k++) {
        const int i = lane + 32 * k;
        sincosf(pos * __ldg(p.inv_freq + i), &pre.sn[k], &pre.cs[k]);
        pre.n1[k] = nw ? __ldg(nw + i) : 1.0f;
        pre.n2[k] = nw ? __ldg(nw + i + HD / 2) : 1.0f;
    }
}

// Warp-wide, after the wait: normalise (when pre.normed) and rotate one head of
// HD floats at `src` with rope_prepare's factors. Calls out(i, y1, y2).
template <int HD, class Out>
__device__ __forceinline__ void rope_head(const Params& p, const float* src, const AttnPre<HD>& pre, Out out) {
    constexpr int HALF = HD / 2, PAIRS = HALF / 32;
    const int lane = threadIdx.x & 31;
    float x1[PAIRS], x2[PAIRS];
#pragma unroll
    for (int k = 0; k < PAIRS; k++) {
        x1[k] = __ldcg(src + lane + 32 * k);
        x2[k] = __ldcg(src + lane + 32 * k + HALF);
    }
    if (pre.normed) {
        float ss = 0.0f;
#pragma unroll
        for (int k = 0; k < PAIRS; k++) ss += x1[k] * x1[k] + x2[k] * x2[k];
        const float scale = rsqrtf(warp_sum(ss) / (float)HD + p.eps);
#pragma unroll
        for (int k = 0; k < PAIRS; k++) {
            x1[k] = pre.n1[k] * (x1[k] * scale);
            x2[k] = pre.n2[k] * (x2[k] * scale);
        }
    }
#pragma unroll
    for (int k = 0; k < PAIRS; k++) {
        const int i = lane + 32 * k;
        out(i, x1[k] * pre.cs[k] - x2[k] * pre.sn[k], x2[k] * pre.cs[k] + x1[k] * pre.sn[k]);
    }
}

// W pairs of consecutive bf16 (4 or 8 bytes, aligned) from the KV cache, which
// other SMs wrote during this launch: loaded past L1.
template <int W>
__device__ __forceinline__ void load_pairs(const uint16_t* src, uint32_t (&out)[W]) {
    static_assert(W == 1 || W == 2, "head_dim 64 or 128");
    if constexpr (W == 1) {
        out[0] = __ldcg(reinterpret_cast<const unsigned int*>(src));
    } else {
        const uint2 w = __ldcg(reinterpret_cast<const uint2*>(src));
        out[0] = w.x;
        out[1] = w.y;
    }
}

// load_pairs from shared memory (the step's own k or v row).
template <int W>
__device__ __forceinline__ void load_pairs_shared(const uint16_t* src, uint32_t (&out)[W]) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(src);
#pragma unroll
    for (int i = 0; i < W; i++) out[i] = w[i];
}

// Element e of load_pairs' words (little-endian: the even element in the low half).
template <int W>
__device__ __forceinline__ float pair_elem(const uint32_t (&w)[W], int e) {
    return __uint_as_float(e & 1 ? w[e >> 1] & 0xffff0000u : w[e >> 1] << 16);
}

// The K/V cache row of position `q` for KV head g of `layer`, at the lane's elements.
template <int HD, int HKV, int NL>
__device__ __forceinline__ const uint16_t* kv_row(const Params& p, int layer, int g, int q) {
    constexpr int KVD = HKV * HD;
    return p.kv + (size_t)q * NL * 2 * KVD + (size_t)layer * 2 * KVD + g * HD + (threadIdx.x & 31) * (HD / 32);
}

// Called by every consumer before an attention instruction's wait (nothing here
// depends on the step's QKV): RoPE factors and norm weights for the q warps and
// the k warp, and an L2 prefetch of the split's K and V rows (final: written in
// earlier steps, and long evicted by the weight stream; the step's own position
// is written after the wait). K and V themselves load right after the wait
// (attend_split step 0), in parallel with q: held in registers across the wait
// they spilled (10 warps get at most 168 registers each).
template <int HD, int G, int HKV, int NL>
__device__ __forceinline__ void attention_prepare(const Params& p, const Instr& in, int t, AttnPre<HD>& pre) {
    constexpr int KVD = HKV * HD, LINES = HD * 2 / 128;  // 128-byte lines per row
    const SplitRange r = split_range(p, in, t);
    if (!r.used) return;
    const int warp = threadIdx.x >> 5, g = in.a;
    const LayerPtrs& lw = p.layers[in.layer];
    const bool owner = r.begin <= r.pos && r.pos < r.end;
    if (warp < G) {
        rope_prepare<HD>(p, lw.q_norm, (float)r.pos, pre);
    } else if (warp == G && owner) {
        rope_prepare<HD>(p, lw.k_norm, (float)r.pos, pre);
    }
    const int last = min(r.end, r.pos);
    const uint8_t* cache = reinterpret_cast<const uint8_t*>(p.kv + (size_t)in.layer * 2 * KVD + g * HD);
    const size_t pos_stride = (size_t)NL * 2 * KVD;
    for (int k = threadIdx.x; k < (last - r.begin) * 2 * LINES; k += CONSUMERS) {
        const int row = k / LINES, line = k % LINES;  // row: position begin + row / 2, k or v (row % 2)
        prefetch_line_l2(cache + ((r.begin + row / 2) * pos_stride + (row & 1) * KVD) * 2 + line * 128);
    }
}

// The sums over the warp's lanes of NV values per lane (NV = 8, 16 or 32), all
// at once: each butterfly step sends half of the values still held to the
// partner lane and keeps the other half, so NV values take NV - 1 + log2(32 / NV)
// shuffles instead of 5 NV, in one chain of 5. Lane l returns the sum of value
// l / (32 / NV) (the same pairs added in the same order as warp_sum).
template <int NV>
__device__ __forceinline__ float reduce_scores(float (&v)[NV]) {
    static_assert(NV == 8 || NV == 16 || NV == 32, "8, 16 or 32 values");
    const int lane = threadIdx.x & 31;
    int held = NV;
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) {
        if (held > 1) {
            const bool upper = (lane & o) != 0;
            const int half = held / 2;
#pragma unroll
            for (int k = 0; k < NV / 2; k++) {
                if (k < half) {
                    const float send = upper ? v[k] : v[k + half];
                    const float keep = upper ? v[k + half] : v[k];
                    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                }
            }
            held = half;
        } else {
            v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
        }
    }
    return v[0];
}

// Steps 1-3 of a used split: q, the KV append, the split's partial. `stamps`
// (thread 0 of a traced step, else null) gets the global timer when q is in
// shared memory, when the loop is done and when the partial is stored.
template <int HD, int G, int HQ, int HKV, int NL>
__device__ __forceinline__ void attend_split(const Params& p, const Smem& s, const Instr& in, const SplitRange& r,
                                             AttnPre<HD>& pre, unsigned long long* stamps) {
    constexpr int QD = HQ * HD, KVD = HKV * HD, E = HD / 32, W = E / 2, P = ATTN_P;
    static_assert(G * HD <= 512 && HD <= 256, "q heads, k and v of the step fit s.vec() below the warp partials");
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int layer = in.layer, g = in.a, split = in.b, splits = in.c;  // splits: the partials' stride
    const int pos = r.pos, begin = r.begin, end = r.end;
    const size_t pos_stride = (size_t)NL * 2 * KVD;
    uint16_t* cache = p.kv + (size_t)layer * 2 * KVD + g * HD;
    const bool owner = begin <= pos && pos < end;  // this split appends the step's k and v

    // 0. The warp's first P positions of K and V (but the step's own, written
    // below): issued first, so their round trip overlaps q's.
    uint32_t kw[P][W], vw[P][W];
    int p0 = begin + warp * P;
    if (p0 < end) {
#pragma unroll
        for (int j = 0; j < P; j++) {
            const int q = min(p0 + j, end - 1);
            if (q < pos) {
                const uint16_t* kp = kv_row<HD, HKV, NL>(p, layer, g, q);
                load_pairs<W>(kp, kw[j]);
                load_pairs<W>(kp + KVD, vw[j]);
            }
        }
    }

    // 1. q heads into s.vec() (rotated), k and v of this position into the cache
    // and (the same bf16, laid out as a cache row) into s.vec() for the warp whose
    // first iteration holds the position.
    float* sq = s.vec();
    uint16_t* sk = reinterpret_cast<uint16_t*>(s.vec() + 512);
    uint16_t* sv = sk + 256;
    if (warp < G) {
        const int head = g * G + warp;
        rope_head<HD>(p, p.qkv + head * HD, pre, [&](int i, float y1, float y2) {
            sq[warp * HD + i] = y1;
            sq[warp * HD + i + HD / 2] = y2;
        });
    } else if (warp == G && owner) {
        uint16_t* kc = cache + (size_t)pos * pos_stride;
        rope_head<HD>(p, p.qkv + QD + g * HD, pre, [&](int i, float y1, float y2) {
            const uint16_t b1 = f32_to_bf16(y1), b2 = f32_to_bf16(y2);
            kc[i] = b1;
            kc[i + HD / 2] = b2;
            sk[i] = b1;
            sk[i + HD / 2] = b2;
        });
    } else if (warp == G + 1 && owner) {
        uint16_t* vc = cache + (size_t)pos * pos_stride + KVD;
        for (int i = lane; i < HD; i += 32) {
            const uint16_t b = f32_to_bf16(__ldcg(p.qkv + QD + KVD + g * HD + i));
            vc[i] = b;
            sv[i] = b;
        }
    }
    consumer_sync();  // q and the step's k/v in shared memory; this CTA's cache writes visible to its threads
    if (stamps) stamps[0] = globaltimer_ns();

    // 2. Online softmax over positions begin..end: warp w takes P at a time, w*P +
    // 8P k. The first P were loaded in 0 (the step's own position comes from
    // s.vec()); later ones are loaded P at a time (at long contexts each iteration
    // is an L2/HBM round trip, so the split's latency is its iterations).
    const float scale = 1.0f / sqrtf((float)HD);
    // The G x P scores of an iteration are summed across the lanes together
    // (reduce_scores): then lane `lane` holds score lane / R, head my_h's
    // position my_j, and keeps that head's running max and sum (all lanes of a
    // head agree). Every lane's weights for V pass through shared memory.
    constexpr int GP = G <= 1 ? 1 : (G <= 2 ? 2 : 4), NV = GP * P, R = 32 / NV;
    static_assert(G <= 4 && NV <= 32, "at most 4 heads of 8 positions per iteration");
    const int my_h = (lane / R) / P, my_j = (lane / R) % P;
    float q[G][E], acc[G][E];
    float m_mine = -INFINITY, l_mine = 0.0f;
    float* wbuf = s.vec() + 1152 + warp * (NV + GP);  // [NV] weights, then [GP] corrections
#pragma unroll
    for (int h = 0; h < G; h++) {
#pragma unroll
        for (int e = 0; e < E; e++) {
            q[h][e] = sq[h * HD + lane * E + e] * scale;
            acc[h][e] = 0.0f;
        }
    }
    if (owner && p0 < end) {
#pragma unroll
        for (int j = 0; j < P; j++) {
            if (min(p0 + j, end - 1) == pos) {
                load_pairs_shared<W>(sk + lane * E, kw[j]);
                load_pairs_shared<W>(sv + lane * E, vw[j]);
            }
        }
    }
    for (; p0 < end; p0 += CONSUMER_WARPS * P) {
        if (p0 != begin + warp * P) {
#pragma unroll
            for (int j = 0; j < P; j++) {
                const uint16_t* kp = kv_row<HD, HKV, NL>(p, layer, g, min(p0 + j, end - 1));
                load_pairs<W>(kp, kw[j]);
                load_pairs<W>(kp + KVD, vw[j]);
            }
        }
        float d[NV];
#pragma unroll
        for (int h = 0; h < GP; h++) {
#pragma unroll
            for (int j = 0; j < P; j++) {
                float v = 0.0f;
                if (h < G) {
#pragma unroll
                    for (int e = 0; e < E; e++) v += q[h < G ? h : 0][e] * pair_elem<W>(kw[j], e);
                }
                d[h * P + j] = v;
            }
        }
        const float dot = reduce_scores<NV>(d);
        const bool valid = my_h < G && p0 + my_j < end;
        const float sc = valid ? dot : -INFINITY;
        float gmax = sc;
#pragma unroll
        for (int o = R; o < R * P; o <<= 1) gmax = fmaxf(gmax, __shfl_xor_sync(0xffffffffu, gmax, o));
        const float m_new = fmaxf(m_mine, gmax);
        const float corr = __expf(m_mine - m_new);  // 0 on the first iteration (m_mine = -inf)
        const float w = valid ? __expf(sc - m_new) : 0.0f;
        float wsum = w;
#pragma unroll
        for (int o = R; o < R * P; o <<= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
        l_mine = l_mine * corr + wsum;
        m_mine = m_new;
        if (lane % R == 0) wbuf[lane / R] = w;
        if (lane % (R * P) == 0) wbuf[NV + my_h] = corr;
        __syncwarp();
#pragma unroll
        for (int h = 0; h < G; h++) {
            const float c = wbuf[NV + h];
#pragma unroll
            for (int e = 0; e < E; e++) acc[h][e] *= c;
#pragma unroll
            for (int j = 0; j < P; j++) {
                const float wj = wbuf[h * P + j];
#pragma unroll
                for (int e = 0; e < E; e++) acc[h][e] += wj * pair_elem<W>(vw[j], e);
            }
        }
        __syncwarp();  // every lane has read wbuf before the next iteration writes it
    }

    // 3. The 8 warps' partials -> this split's partial per q head.
    float* wm = s.vec() + 1024;                      // [warp][G]
    float* wl = wm + CONSUMER_WARPS * MAX_GROUP;   // [warp][G]
    float* wo = s.part();                            // [warp][G][HD]
    if (stamps) stamps[1] = globaltimer_ns();
    consumer_sync();                               // everyone is done reading sq
    if (lane % (R * P) == 0 && my_h < G) {
        wm[warp * G + my_h] = m_mine;
        wl[warp * G + my_h] = l_mine;
    }
#pragma unroll
    for (int h = 0; h < G; h++) {
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
    if (stamps) stamps[2] = globaltimer_ns();
    // (The caller's signal() barrier orders these stores before its release.)
}

// One group of 8 attention outputs (q head h, elements i..i+7) merged from the
// used splits' partials, as kernels/src/attention.cu attn_merge: the largest
// max first, then the splits in order, a split with no finite score adding
// nothing. Up to FAST splits load in one round trip (contexts up to 384
// positions at the 64-position split); more take two passes.
template <int HD>
__device__ __forceinline__ void merge_group(const Params& p, int h, int i, int used, float (&o)[8]) {
    constexpr int FAST = 6;
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

// Step t's attention output (all q heads) into s.vec(), merged from the splits'
// partials: the O-proj instruction's input. Thread k takes elements 8k..8k+7.
template <int HD, int HQ>
__device__ __forceinline__ void merge_attention(const Params& p, const Smem& s, int t) {
    constexpr int GROUPS = HQ * HD / 8;
    static_assert(HQ * HD <= VEC_CAP, "the attention output fits the shared vector");
    const int used = used_splits(p.pos0 + t + 1, p.splits);
    for (int grp = threadIdx.x; grp < GROUPS; grp += CONSUMERS) {
        float o[8];
        merge_group<HD>(p, grp * 8 / HD, grp * 8 % HD, used, o);
        float4* dst = reinterpret_cast<float4*>(s.vec() + grp * 8);
        dst[0] = make_float4(o[0], o[1], o[2], o[3]);
        dst[1] = make_float4(o[4], o[5], o[6], o[7]);
    }
    consumer_sync();
}

// The instruction, after its wait (attention_prepare ran before it).
template <int HD, int G, int HQ, int HKV, int NL>
__device__ __forceinline__ void attention(const Params& p, const Smem& s, const Instr& in, int t, AttnPre<HD>& pre,
                                          unsigned long long* stamps) {
    static_assert(G <= MAX_GROUP && CONSUMER_WARPS * G * HD <= PART_CAP && G * HD <= CONSUMERS, "attention fits");
    const SplitRange r = split_range(p, in, t);
    if (r.used) attend_split<HD, G, HQ, HKV, NL>(p, s, in, r, pre, stamps);
    // (else: an empty split; used splits never are, and the merge reads only those.)
}

}  // namespace mk

// The megakernel's sampler: crate::race (sampler.cuh's device copy of it) run
// by every SM over the LM-head tiles it claimed, with the last SM to arrive
// merging the parts. Modes, by the request (`race_mode`):
//  - RACE_ARGMAX: greedy with penalties or min_tokens: each SM's argmax of the
//    processed logits, merged like the plain greedy argmax;
//  - RACE_WHOLE: sampled with no cut: each SM's best race key, merged the same way;
//  - RACE_BINS: top-p and/or min-p (no top-k): each SM keeps, per bin of the
//    absolute 1/16-nat grid, its best race key (RACE_KEY_BINS ring) and, once its
//    tiles are done, its tokens' weights at the two anchors its own maximum can
//    round to (RACE_MASS_BINS each); it adds them into the global tables
//    (race_keys, race_mass by anchor level) and publishes its maximum. The last
//    SM finds the anchor, the cuts from the weights, and the winner from the
//    keys of the bins the cuts keep, then zeroes the tables for the next step.
//  - RACE_TOPK: top-k with k <= RACE_TOPK_MAX (then top-p, min-p over those):
//    each SM lists its tokens at or above its own k-th logit (a radix select
//    over its tokens' keys in three 11-bit digits); the last SM keeps the lists'
//    entries at or above the highest of the SMs' bounds (they hold the global
//    top k), sorts them, and cuts and races over the first k;
//  - RACE_NONE: plain greedy (the caller's argmax) or a larger top-k:
//    sample_token, one CTA over the whole row while the others wait.
// Every mode picks the host sampler's token bit for bit.
#pragma once
#include "mk_params.cuh"
#include "sampler.cuh"

namespace mk {

__device__ __forceinline__ bool is_end(const Params& p, uint32_t token) {
    for (int e = 0; e < p.n_end; e++)
        if (__ldg(p.end_ids + e) == token) return true;
    return false;
}

struct ConsumerBarrier {
    static __device__ __forceinline__ void sync() { consumer_sync(); }
};
using ConsumerSampler = Sampler<CONSUMERS, ConsumerBarrier>;
static_assert(sizeof(SampleShared) <= VEC_CAP * 4, "the sampler's shared state fits the vector space");

enum RaceMode { RACE_NONE, RACE_ARGMAX, RACE_WHOLE, RACE_BINS, RACE_TOPK };
// Entries the last SM sorts for a top-k: those at or above the SMs' highest
// bound (RACE_TOPK_MAX and RACE_LIST, the SMs' lists, are in mk_geometry.cuh).
constexpr int RACE_SURVIVORS = 256;
static_assert(RACE_SURVIVORS == CONSUMERS, "the sort gives each consumer thread one survivor");
// Tokens per consumer thread an SM's race part keeps in registers: 2,048 per
// SM, against an average share of ~1,150 (Qwen3's vocabulary over 132 SMs).
constexpr int RACE_CACHED = 8;

template <class F>
__device__ __forceinline__ RaceMode race_mode(const Params& p) {
    if (p.sample == nullptr) return RACE_NONE;
    const SampleRow& r = *p.sample;
    if (r.temperature == 0.0f) return RACE_ARGMAX;
    if (r.top_k != 0 && r.top_k < (uint32_t)F::V) return r.top_k <= (uint32_t)RACE_TOPK_MAX ? RACE_TOPK : RACE_NONE;
    return r.top_p < 1.0f || r.min_p > 0.0f ? RACE_BINS : RACE_WHOLE;
}

__device__ __forceinline__ bool has_penalties(const SampleRow& r) {
    return r.repetition_penalty != 1.0f || r.presence_penalty != 0.0f || r.frequency_penalty != 0.0f;
}

// |M| beyond this leaves the race keys' f32 rounding too coarse for the key
// ring's aliasing argument (a token 64 nats down must lose): sample_token.
constexpr double RACE_M_LIMIT = 1048576.0;
// A level's index in race_mass for anchor `a` (a multiple of 16).
__device__ __forceinline__ int race_level(double a) {
    return (int)((long long)__dmul_rn(a, 1.0 / RACE_ANCHOR_STEP) & (RACE_LEVELS - 1));
}

// A maximum over the consumers through the scalars' double slots (the vector
// space holds the SM's tile list meanwhile); every consumer gets it.
__device__ __forceinline__ uint64_t consumer_max_u64(uint64_t v, const Smem& s) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, (uint64_t)__shfl_xor_sync(0xffffffffu, v, o));
    uint64_t* red = s.sc()->red64;
    if (lane == 0) red[warp] = v;
    consumer_sync();
    v = red[0];
    for (int w = 1; w < CONSUMER_WARPS; w++) v = max(v, red[w]);
    consumer_sync();  // the slots are free again
    return v;
}

// Order of non-NaN doubles as an unsigned integer (never 0), and back: their
// maximum is a u64 maximum.
__device__ __forceinline__ uint64_t double_order(double d) {
    const uint64_t u = (uint64_t)__double_as_longlong(d);
    return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}
__device__ __forceinline__ double order_double(uint64_t o) {
    return __longlong_as_double((long long)((o >> 63) ? (o & 0x7fffffffffffffffull) : ~o));
}

// An SM's part that cannot be merged (its tile list overflowed): sample_token decides.
constexpr uint64_t RACE_GIVE_UP = ~0ull;

// One SM's part of step t's race. Its LM-head loop stores the raw logits and
// records its tiles; `finish` then works on all of its tokens at once, every
// consumer thread taking a share (in the loop only a tile's few rows would).
struct RacePart {
    RaceMode mode;
    SampleRow r;
    double inv_t;
    uint64_t hash;
    bool penalties, masked;
    uint32_t tiles;  // tiles recorded in s.vec() (their indices)

    // Only the mode and the tile count live through the LM-head loop.
    template <class F>
    __device__ __forceinline__ void begin(const Params& p, const Smem& s) {
        mode = race_mode<F>(p);
        tiles = 0;
        if (mode == RACE_BINS) {
            // Zeroed before the LM head's input load, whose barriers publish it.
            uint4* z = reinterpret_cast<uint4*>(s.race_keys());
            for (int i = threadIdx.x; i < (RACE_KEY_BINS + 2 * RACE_MASS_BINS) / 2; i += CONSUMERS) z[i] = make_uint4(0, 0, 0, 0);
        }
    }

    // sampling.rs `process_logits` for one token.
    __device__ __forceinline__ float processed(const Params& p, float v, uint32_t row) const {
        if (penalties) {
            const bool seen = (__ldcg(p.seen_bits + (row >> 5)) >> (row & 31)) & 1u;
            const uint32_t count = __ldcg(p.gen_counts + row);
            if (seen || count) v = penalised(v, r, seen, count);
        }
        return masked && is_end(p, row) ? -INFINITY : v;
    }

    // Tile `tile` is this SM's (thread 0, after a consumer barrier that follows
    // the input load: s.vec() is free from then on).
    __device__ __forceinline__ void record_tile(const Smem& s, uint32_t tile) {
        if (mode != RACE_NONE && threadIdx.x == 0 && tiles < (uint32_t)VEC_CAP) reinterpret_cast<uint32_t*>(s.vec())[tiles] = tile;
        tiles++;
    }

    // TOPK: this SM's tokens whose key (item_key: logit, then the lower id) is
    // at or above its own k-th's logit, listed in race_keys[blockIdx.x *
    // RACE_LIST ...], their count in lm_idx[blockIdx.x] (0xffffffff: too many,
    // the merge gives up) and in lm_max (as u64) the key above which the list
    // holds all of the SM's tokens (0: all of them). Ends with a consumer barrier.
    template <class F>
    __device__ void topk_list(const Params& p, const Smem& s, const uint32_t* list, uint32_t n, bool listed, int tile_rows) {
        const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
        uint32_t* counts = reinterpret_cast<uint32_t*>(s.race_keys());  // [2048]: the race's shared space is free here
        uint32_t* bc = counts + 2048;  // [0] key32 prefix, [1] count above it, [2] candidates, [3] list length, [4..12) warp sums
        for (int i = tid; i < 2048 + 16; i += CONSUMERS) counts[i] = 0;
        consumer_sync();
        // The processed keys (kept in sample_items for the passes below), the first digit's histogram.
        uint32_t mine = 0;
        for (uint32_t j = tid; j < n; j += CONSUMERS) {
            const uint32_t row = list[j / tile_rows] * tile_rows + j % tile_rows;
            if (row >= (uint32_t)F::V) continue;
            const float l = processed(p, __ldcg(p.logits + row), row);
            const uint64_t key = is_candidate(l) ? item_key(l, row) : 0ull;  // a candidate's key is never 0
            __stcg(&p.sample_items[row].key, key);
            if (key) {
                mine++;
                atomicAdd(counts + (key >> 53), 1u);
            }
        }
        for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(0xffffffffu, mine, o);
        if (lane == 0) atomicAdd(bc + 2, mine);
        consumer_sync();
        const uint32_t k = r.top_k, n_cand = bc[2];
        const bool all = n_cand <= k;
        // The k-th largest key32 (= logit order) among this SM's candidates: three digits.
        uint32_t prefix = 0, above = 0;
        for (int pass = 0; pass < 3 && !all; pass++) {
            const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0), bits = pass == 2 ? 10 : 11;
            if (pass > 0) {
                for (int i = tid; i < 2048; i += CONSUMERS) counts[i] = 0;
                consumer_sync();
                for (uint32_t j = tid; j < n; j += CONSUMERS) {
                    const uint32_t row = list[j / tile_rows] * tile_rows + j % tile_rows;
                    if (row >= (uint32_t)F::V) continue;
                    const uint64_t key = __ldcg(&p.sample_items[row].key);
                    const uint32_t k32 = (uint32_t)(key >> 32);
                    if (key && (k32 >> (shift + bits)) == (prefix >> (shift + bits))) atomicAdd(counts + ((k32 >> shift) & ((1u << bits) - 1)), 1u);
                }
                consumer_sync();
            }
            // Buckets from the top: thread t owns 2047 - 8t down to 2040 - 8t.
            const int hi = 2047 - 8 * tid;
            uint32_t c = 0;
            for (int i = 0; i < 8; i++) c += counts[hi - i];
            uint32_t incl = c;
            for (int o = 1; o < 32; o <<= 1) {
                const uint32_t v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            if (lane == 31) bc[4 + warp] = incl;
            consumer_sync();
            uint32_t before = incl - c;
            for (int w = 0; w < warp; w++) before += bc[4 + w];
            const uint32_t need = k - above;
            if (before < need && before + c >= need) {
                uint32_t cum = before;
                for (int i = 0; i < 8; i++) {
                    const int b = hi - i;
                    if (cum + counts[b] >= need) {
                        bc[0] = prefix | ((uint32_t)b << shift);
                        bc[1] = above + cum;
                        break;
                    }
                    cum += counts[b];
                }
            }
            consumer_sync();
            prefix = bc[0];
            above = bc[1];
        }
        // The list: keys at or above the k-th's logit (ties with it included).
        const uint64_t bound = all ? 1ull : (uint64_t)prefix << 32;
        unsigned long long* out = p.race_keys + (size_t)blockIdx.x * RACE_LIST;
        for (uint32_t j = tid; j < n; j += CONSUMERS) {
            const uint32_t row = list[j / tile_rows] * tile_rows + j % tile_rows;
            if (row >= (uint32_t)F::V) continue;
            const uint64_t key = __ldcg(&p.sample_items[row].key);
            if (key >= bound) {
                const uint32_t slot = atomicAdd(bc + 3, 1u);
                if (slot < (uint32_t)RACE_LIST) __stcg(out + slot, (unsigned long long)key);
            }
        }
        consumer_sync();
        if (tid == 0) {
            const uint32_t len = bc[3];
            __stcg(p.lm_idx + blockIdx.x, listed && len <= (uint32_t)RACE_LIST ? len : 0xffffffffu);
            __stcg(reinterpret_cast<uint64_t*>(p.lm_max) + blockIdx.x, all ? 0ull : bound);
        }
        consumer_sync();
    }

    // After the SM's last tile: its part into lm_max[blockIdx.x] (a u64 key, or
    // for BINS its maximum as a double) and, for BINS, into the global tables.
    // Ends with a consumer barrier.
    template <class F>
    __device__ void finish(const Params& p, const Smem& s, int t, int tile_rows) {
        // Thread 0 recorded the last tile after the loop's last barrier.
        consumer_sync();
        r = *p.sample;
        inv_t = r.temperature > 0.0f ? __ddiv_rn(1.0, (double)r.temperature) : 0.0;
        hash = step_hash(r.seed, r.step + (uint64_t)t);
        penalties = has_penalties(r);
        masked = t < p.mask_end_steps;
        const uint32_t* list = reinterpret_cast<const uint32_t*>(s.vec());
        const bool listed = tiles <= (uint32_t)VEC_CAP;
        const uint32_t n = listed ? tiles * (uint32_t)tile_rows : 0;
        if (mode == RACE_TOPK) {
            topk_list<F>(p, s, list, n, listed, tile_rows);
            return;
        }
        uint64_t best = 0;     // ARGMAX / WHOLE: this thread's best key (0: none)
        double smax = -INFINITY;  // BINS: this thread's largest scaled logit
        auto visit = [&](float l, uint32_t row) {
            if (!is_candidate(l)) return;
            if (mode == RACE_ARGMAX) {
                best = max(best, item_key(__fadd_rn(l, 0.0f), row));  // -0.0 ties +0.0: the lower index wins
            } else if (mode == RACE_WHOLE) {
                // The host takes the first +inf logit (sampling.rs `sample`): above every race key,
                // even one whose s + noise overflowed f32, and below RACE_GIVE_UP.
                const uint64_t k = l == INFINITY ? (0xff800001ull << 32) | (uint64_t)(0xffffffffu - row) : race_key(race_scaled(l, inv_t), row, hash);
                best = max(best, k);
            } else {
                const double sc = race_scaled(l, inv_t);
                smax = fmax(smax, sc);
                // A token hopeless against one already seen cannot win.
                if (!race_hopeless(sc, smax))
                    atomicMax(s.race_keys() + (race_bin(sc) & (RACE_KEY_BINS - 1)), (unsigned long long)race_key(sc, row, hash));
            }
        };
        // The thread's first RACE_CACHED tokens load together and stay in
        // registers for the weights' pass (one L2 round trip, not one per token);
        // the rest (an SM with an unusually large share) go one by one.
        float cached[RACE_CACHED];
        uint32_t cached_row[RACE_CACHED];
#pragma unroll
        for (int q = 0; q < RACE_CACHED; q++) {
            const uint32_t j = threadIdx.x + q * CONSUMERS;
            cached_row[q] = j < n ? list[j / tile_rows] * tile_rows + j % tile_rows : 0xffffffffu;
            cached[q] = cached_row[q] < (uint32_t)F::V ? __ldcg(p.logits + cached_row[q]) : -INFINITY;
        }
#pragma unroll
        for (int q = 0; q < RACE_CACHED; q++) {
            if (cached_row[q] >= (uint32_t)F::V) continue;
            cached[q] = processed(p, cached[q], cached_row[q]);  // p.logits stays raw: sample_token may need it
            visit(cached[q], cached_row[q]);
        }
        for (uint32_t j = threadIdx.x + RACE_CACHED * CONSUMERS; j < n; j += CONSUMERS) {
            const uint32_t row = list[j / tile_rows] * tile_rows + j % tile_rows;
            if (row < (uint32_t)F::V) visit(processed(p, __ldcg(p.logits + row), row), row);
        }
        if (mode != RACE_BINS) {
            best = consumer_max_u64(best, s);
            if (threadIdx.x == 0) __stcg(reinterpret_cast<uint64_t*>(p.lm_max) + blockIdx.x, listed ? best : RACE_GIVE_UP);
            consumer_sync();
            return;
        }
        // The SM's maximum scaled logit.
        const double m = order_double(consumer_max_u64(double_order(smax), s));
        // Weights at the two anchors the global maximum can have (this SM's
        // anchor, or 16 above it: any higher and all of these weigh 0).
        const bool weighs = isfinite(m) && fabs(m) <= RACE_M_LIMIT && listed;
        const double a0 = weighs ? race_anchor(m) : 0.0, a1 = __dadd_rn(a0, RACE_ANCHOR_STEP);
        unsigned long long* mass = s.race_mass();
        if (weighs) {
            auto weigh = [&](float l) {
                if (!is_candidate(l)) return;
                const double sc = race_scaled(l, inv_t);
                const int slot = (int)(race_bin(sc) & (RACE_MASS_BINS - 1));
                const uint64_t w0 = race_weight(sc, a0), w1 = race_weight(sc, a1);
                if (w0) atomicAdd(mass + slot, (unsigned long long)w0);
                if (w1) atomicAdd(mass + RACE_MASS_BINS + slot, (unsigned long long)w1);
            };
#pragma unroll
            for (int q = 0; q < RACE_CACHED; q++)
                if (cached_row[q] < (uint32_t)F::V) weigh(cached[q]);
            for (uint32_t j = threadIdx.x + RACE_CACHED * CONSUMERS; j < n; j += CONSUMERS) {
                const uint32_t row = list[j / tile_rows] * tile_rows + j % tile_rows;
                if (row < (uint32_t)F::V) weigh(processed(p, __ldcg(p.logits + row), row));
            }
        }
        consumer_sync();
        const int l0 = race_level(a0), l1 = race_level(a1);
        for (int i = threadIdx.x; i < RACE_KEY_BINS; i += CONSUMERS) {
            const unsigned long long k = s.race_keys()[i];
            if (k) atomicMax(p.race_keys + i, k);
        }
        if (weighs) {
            for (int i = threadIdx.x; i < RACE_MASS_BINS; i += CONSUMERS) {
                const unsigned long long w0 = mass[i], w1 = mass[RACE_MASS_BINS + i];
                if (w0) atomicAdd(p.race_mass + l0 * RACE_MASS_BINS + i, w0);
                if (w1) atomicAdd(p.race_mass + l1 * RACE_MASS_BINS + i, w1);
            }
        }
        if (threadIdx.x == 0) {
            // The maximum (NaN: this SM could not weigh its tokens, the merge gives up).
            __stcg(reinterpret_cast<double*>(p.lm_max) + blockIdx.x, weighs || (listed && m == -INFINITY) ? m : (double)NAN);
        }
        consumer_sync();
    }
};

// TOPK's merge (see race_merge).
template <class F>
__device__ uint32_t topk_merge(const Params& p, const Smem& s, int t) {
    const int tid = threadIdx.x;
    SampleShared& sh = *reinterpret_cast<SampleShared*>(s.vec());
    const SampleRow& r = *p.sample;
    // The race's shared space: lengths, survivors, the first k's bins, weights and keys, broadcasts.
    uint32_t* lens = reinterpret_cast<uint32_t*>(s.race_keys());         // [256]
    uint64_t* surv = reinterpret_cast<uint64_t*>(lens + 256);            // [RACE_SURVIVORS]
    long long* bins = reinterpret_cast<long long*>(surv + RACE_SURVIVORS);  // [RACE_TOPK_MAX]
    uint64_t* weights = reinterpret_cast<uint64_t*>(bins + RACE_TOPK_MAX);   // [RACE_TOPK_MAX]
    uint32_t* bc = reinterpret_cast<uint32_t*>(weights + RACE_TOPK_MAX);     // [0] survivors, [1..3) the cut
    static_assert(256 * 4 + RACE_SURVIVORS * 8 + RACE_TOPK_MAX * 16 + 16 <= (RACE_KEY_BINS + 2 * RACE_MASS_BINS) * 8, "fits");
    // The highest bound: every SM's list holds all its tokens at or above it, and
    // some SM has k tokens there, so the global top k are all above it.
    uint64_t bound = 0, bad = 0;
    for (int i = tid; i < p.lm_tiles; i += CONSUMERS) {
        bound = max(bound, (uint64_t)__ldcg(reinterpret_cast<const uint64_t*>(p.lm_max) + i));
        const uint32_t len = __ldcg(p.lm_idx + i);
        if (len == 0xffffffffu) bad = 1;
        if (i < 256) lens[i] = len;
    }
    if (tid == 0) bc[0] = 0;
    bound = ConsumerSampler::block_key_reduce<true>(bound, sh);  // (its barriers publish lens and bc)
    if (ConsumerSampler::block_key_reduce<true>(bad, sh) != 0 || p.lm_tiles > 256) return 0xffffffffu;
    for (int idx = tid; idx < p.lm_tiles * RACE_LIST; idx += CONSUMERS) {
        const int sm = idx / RACE_LIST, i = idx % RACE_LIST;
        if ((uint32_t)i >= lens[sm]) continue;
        const uint64_t key = __ldcg(p.race_keys + idx);
        if (key >= bound) {
            const uint32_t slot = atomicAdd(bc, 1u);
            if (slot < (uint32_t)RACE_SURVIVORS) surv[slot] = key;
        }
    }
    consumer_sync();
    const uint32_t n = bc[0];
    if (n > (uint32_t)RACE_SURVIVORS) return 0xffffffffu;
    if (tid >= (int)n) surv[tid] = 0;  // CONSUMERS == RACE_SURVIVORS: one entry per thread
    // Bitonic sort, largest key first.
    for (int size = 2; size <= RACE_SURVIVORS; size <<= 1) {
        for (int stride = size / 2; stride > 0; stride >>= 1) {
            consumer_sync();
            const int j = tid ^ stride;
            if (j > tid) {
                const uint64_t a = surv[tid], b = surv[j];
                const bool first_half_descends = (tid & size) == 0;
                if (first_half_descends ? a < b : a > b) {
                    surv[tid] = b;
                    surv[j] = a;
                }
            }
        }
    }
    consumer_sync();
    const uint32_t kk = min(n, r.top_k);
    const double inv_t = __ddiv_rn(1.0, (double)r.temperature);
    const uint64_t hash = step_hash(r.seed, r.step + (uint64_t)t);
    const double m = race_scaled(key_logit(surv[0]), inv_t);
    const double a = race_anchor(m);
    uint64_t rk = 0;
    if (tid < (int)kk) {
        const double sc = race_scaled(key_logit(surv[tid]), inv_t);
        bins[tid] = race_bin(sc);
        weights[tid] = r.top_p < 1.0f ? race_weight(sc, a) : 0ull;
        rk = race_key(sc, key_id(surv[tid]), hash);
    }
    consumer_sync();
    if (tid == 0) {
        // race::top_p_bin over the first k (already most likely first: bins never rise).
        long long cut = LLONG_MIN;
        if (r.top_p < 1.0f) {
            unsigned long long total = 0;
            for (uint32_t i = 0; i < kk; i++) total += weights[i];
            const double target = __dmul_rn((double)r.top_p, __ull2double_rn(total));
            unsigned long long above = 0;
            cut = LLONG_MAX;
            for (uint32_t i = 0; i < kk;) {
                const long long b = bins[i];
                if (!(__ull2double_rn(above) < target)) break;
                cut = b;
                for (; i < kk && bins[i] == b; i++) above += weights[i];
            }
        }
        if (r.min_p > 0.0f) cut = max(cut, race_min_p_bin(m, r.min_p));
        *reinterpret_cast<long long*>(bc + 2) = cut;
    }
    consumer_sync();
    const long long cut = *reinterpret_cast<const long long*>(bc + 2);
    if (tid < (int)kk && bins[tid] < cut) rk = 0;
    const uint64_t best = ConsumerSampler::block_key_reduce<true>(rk, sh);
    return key_id(best);
}

// The merge, on the last SM to arrive. Returns the token, or 0xffffffff when
// it gave up (a part it cannot merge: sample_token decides). Zeroes the
// global tables it read. Every consumer gets the result.
template <class F>
__device__ uint32_t race_merge(const Params& p, const Smem& s, int t) {
    const RaceMode mode = race_mode<F>(p);
    SampleShared& sh = *reinterpret_cast<SampleShared*>(s.vec());
    const int tid = threadIdx.x;
    if (mode == RACE_TOPK) return topk_merge<F>(p, s, t);
    if (mode != RACE_BINS) {
        const uint64_t* keys = reinterpret_cast<const uint64_t*>(p.lm_max);
        uint64_t best = 0;
        for (int i = tid; i < p.lm_tiles; i += CONSUMERS) best = max(best, __ldcg(keys + i));
        best = ConsumerSampler::block_key_reduce<true>(best, sh);
        if (best == RACE_GIVE_UP) return 0xffffffffu;
        if (best == 0) return 0u;  // no candidate: index 0, as the host's argmax
        return key_id(best);  // ARGMAX and WHOLE keys both end in the id (item_key)
    }
    const SampleRow& r = *p.sample;
    // The maximum, and whether every SM could weigh at the anchor it gives.
    const double* maxima = reinterpret_cast<const double*>(p.lm_max);
    uint64_t m_bits = 0, bad = 0;  // order of doubles as u64 (0: nothing), any NaN
    for (int i = tid; i < p.lm_tiles; i += CONSUMERS) {
        const double m = __ldcg(maxima + i);
        if (isnan(m)) bad = 1;
        else if (m > -INFINITY) m_bits = max(m_bits, double_order(m));
    }
    m_bits = ConsumerSampler::block_key_reduce<true>(m_bits, sh);
    bad = ConsumerSampler::block_key_reduce<true>(bad, sh);
    const double m = m_bits ? order_double(m_bits) : -INFINITY;
    bool give_up = bad != 0 || !isfinite(m) || fabs(m) > RACE_M_LIMIT;
    const double a = give_up ? 0.0 : race_anchor(m);
    const int level = race_level(a);
    // Levels written (to zero them), and whether another anchor's weights share ours.
    uint64_t written = 0, aliased = 0;
    for (int i = tid; i < p.lm_tiles; i += CONSUMERS) {
        const double mi = __ldcg(maxima + i);
        if (!isfinite(mi) || fabs(mi) > RACE_M_LIMIT) continue;
        const double a0 = race_anchor(mi), a1 = __dadd_rn(a0, RACE_ANCHOR_STEP);
        written |= (1ull << race_level(a0)) | (1ull << race_level(a1));
        if ((race_level(a0) == level && a0 != a) || (race_level(a1) == level && a1 != a)) aliased = 1;
    }
    if (tid == 0) sh.levels = 0;
    aliased = ConsumerSampler::block_key_reduce<true>(aliased, sh);  // (its barriers publish the zero)
    if (written) atomicOr(&sh.levels, (unsigned long long)written);
    consumer_sync();
    const uint64_t levels = sh.levels;
    give_up = give_up || aliased != 0;

    uint32_t token = 0xffffffffu;
    if (!give_up) {
        const long long top_bin = race_bin(m);
        long long cut = LLONG_MIN;
        if (r.top_p < 1.0f) {
            // Bins from the top down (d = top_bin - bin), those that can weigh at anchor a;
            // each thread takes two consecutive ones.
            const long long lowest = race_bin(a) - (RACE_MASS_BINS - 1);
            const int n = (int)min((long long)RACE_MASS_BINS, top_bin - lowest + 1);
            const unsigned long long* row = p.race_mass + level * RACE_MASS_BINS;
            unsigned long long w[2];
            for (int j = 0; j < 2; j++) {
                const int d = 2 * tid + j;
                w[j] = d < n ? __ldcg(row + ((top_bin - d) & (RACE_MASS_BINS - 1))) : 0ull;
            }
            // Exclusive scan of the pairs over the consumers.
            const int warp = tid >> 5, lane = tid & 31;
            unsigned long long incl = w[0] + w[1];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            consumer_sync();
            if (lane == 31) sh.key_partial[warp] = incl;
            consumer_sync();
            unsigned long long before = 0, total = 0;
            for (int wi = 0; wi < CONSUMER_WARPS; wi++) {
                if (wi < warp) before += sh.key_partial[wi];
                total += sh.key_partial[wi];
            }
            const unsigned long long above0 = before + incl - w[0] - w[1], above1 = above0 + w[0];
            const double target = __dmul_rn((double)r.top_p, __ull2double_rn(total));
            // The deepest bin whose mass above is under the target (bin 0, the top, always is).
            uint64_t deepest = 0;
            if (2 * tid < n && __ull2double_rn(above0) < target) deepest = 2 * tid + 1;
            if (2 * tid + 1 < n && __ull2double_rn(above1) < target) deepest = 2 * tid + 2;
            deepest = ConsumerSampler::block_key_reduce<true>(deepest, sh);
            cut = top_bin - (long long)(deepest == 0 ? 0 : deepest - 1);
        }
        if (r.min_p > 0.0f) cut = max(cut, race_min_p_bin(m, r.min_p));
        // The best key among the kept bins (a token whose bin aliases a kept one is
        // over 64 nats down and cannot beat the top token's key).
        const long long from = max(cut, top_bin - (RACE_KEY_BINS - 1));
        uint64_t best = 0;
        for (long long b = from + tid; b <= top_bin; b += CONSUMERS) best = max(best, (uint64_t)__ldcg(p.race_keys + (b & (RACE_KEY_BINS - 1))));
        best = ConsumerSampler::block_key_reduce<true>(best, sh);
        token = best ? key_id(best) : 0xffffffffu;
    }
    // Zero what this step wrote; the step counter's release publishes it.
    for (int i = tid; i < RACE_KEY_BINS; i += CONSUMERS) __stcg(p.race_keys + i, 0ull);
    for (int b = 0; b < RACE_LEVELS; b++)
        if ((levels >> b) & 1ull)
            for (int i = tid; i < RACE_MASS_BINS; i += CONSUMERS) __stcg(p.race_mass + b * RACE_MASS_BINS + i, 0ull);
    return token;
}

}  // namespace mk

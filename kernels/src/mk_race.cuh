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
//    keys of the bins the cuts keep. The tables go by step parity; the SMs zero
//    a step's set during the next step (RacePart::clear_tables).
//  - RACE_TOPK: top-k with k <= RACE_TOPK_MAX (then top-p, min-p over those):
//    each SM lists its k best tokens by item_key (logit, then the lower id: a
//    radix select over its keys, kept in registers); the last SM selects the k
//    best of the lists' entries at or above the highest of the SMs' k-th keys
//    (the same radix select), orders them and cuts and races over them;
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
// Tokens per consumer thread an SM's race part (and its top-k list) keeps in
// registers: 2,048 per SM, against an average share of ~1,150 (Qwen3's
// vocabulary over 132 SMs).
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

// A maximum over a warp's lanes; every lane gets it.
__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, (uint64_t)__shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A maximum over the consumers through the scalars' double slots (the vector
// space holds the SM's tile list meanwhile); every consumer gets it.
__device__ __forceinline__ uint64_t consumer_max_u64(uint64_t v, const Smem& s) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    v = warp_max_u64(v);
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

// A radix select's shared state (in the race's shared space).
struct SelectShared {
    uint32_t counts[2048];  // one digit's buckets
    uint64_t prefix;        // the digits chosen so far
    uint32_t above;         // keys above the prefix's bucket
    uint32_t done;
    uint32_t len;           // the callers' list lengths
    uint32_t warp[CONSUMER_WARPS];
};
// select_threshold's scan gives each consumer thread 8 of a digit's 2048 buckets.
static_assert(CONSUMERS * 8 == 2048, "select_threshold: every bucket has one owner thread");

// A threshold with exactly min(k, |set|) keys of a set of distinct nonzero
// u64 keys at or above it (0 when the set has k keys or fewer): a radix
// descent from the top in 11-bit digits (53, 42, 31, 20, 9, then 9 bits at
// 0) that stops at the first digit whose bucket holds exactly the keys still
// needed. `each(f)` calls f(key) on every key of the set, each key on one
// consumer thread, the same keys in every call. Every consumer calls it and
// gets the threshold.
template <class Each>
__device__ __forceinline__ uint64_t select_threshold(Each& each, uint32_t k, SelectShared& ss) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    uint64_t prefix = 0;
    uint32_t above = 0;
    for (int pass = 0; pass < 6; pass++) {
        const int shift = pass < 5 ? 53 - 11 * pass : 0, high = pass == 0 ? 64 : (pass < 5 ? shift + 11 : 9);
        const uint64_t mask = (1ull << (high - shift)) - 1;
        for (int i = tid; i < 2048; i += CONSUMERS) ss.counts[i] = 0;
        consumer_sync();
        each([&](uint64_t key) {
            if (pass == 0 || (key >> high) == (prefix >> high)) atomicAdd(ss.counts + ((key >> shift) & mask), 1u);
        });
        consumer_sync();
        // Buckets from the top: thread t owns 2047 - 8t down to 2040 - 8t.
        const int hi = 2047 - 8 * tid;
        uint32_t c = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) c += ss.counts[hi - i];
        uint32_t incl = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const uint32_t v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) ss.warp[warp] = incl;
        consumer_sync();
        uint32_t before = incl - c, total = 0;
        for (int w = 0; w < CONSUMER_WARPS; w++) {
            if (w < warp) before += ss.warp[w];
            total += ss.warp[w];
        }
        if (pass == 0 && total <= k) return 0;  // (uniform) every key is in
        const uint32_t need = k - above;
        if (before < need && before + c >= need) {
            uint32_t cum = before;
            for (int i = 0; i < 8; i++) {
                const int b = hi - i;
                if (cum + ss.counts[b] >= need) {
                    ss.prefix = prefix | ((uint64_t)b << shift);
                    ss.above = above + cum;
                    ss.done = cum + ss.counts[b] == need;
                    break;
                }
                cum += ss.counts[b];
            }
        }
        consumer_sync();
        prefix = ss.prefix;
        above = ss.above;
        if (ss.done) break;  // (uniform) the bucket's keys are exactly the ones still needed
    }
    return prefix;
}

// The merge's shared state (the race's shared space), past its select's.
constexpr int TOPK_MAX_SMS = 256;
// Candidates the merge ranks in shared memory (one consumer each, over the
// select's buckets); more go through select_threshold.
constexpr int TOPK_RANKED = CONSUMERS;
struct TopkShared {
    SelectShared sel;       // its buckets hold the ranked candidates instead when they fit
    uint32_t lens[TOPK_MAX_SMS];
    alignas(16) uint64_t tops[TOPK_MAX_SMS];  // each SM's best key (0 past the SMs: read in pairs)
    uint64_t top_bound;     // the k-th largest of them (0: fewer than k)
    uint32_t n_cand;        // entries at or above the merge's bound
    uint64_t surv[RACE_TOPK_MAX];
    uint64_t sorted[RACE_TOPK_MAX];
    long long bins[RACE_TOPK_MAX];
    uint64_t weights[RACE_TOPK_MAX];
    long long cut;
};
static_assert(sizeof(TopkShared) <= (RACE_KEY_BINS + 2 * RACE_MASS_BINS) * 8, "the top-k merge fits the race's shared space");
static_assert(RACE_TOPK_MAX <= CONSUMERS && RACE_LIST >= RACE_TOPK_MAX, "topk_merge: one thread per survivor; an SM's list holds its k best");
static_assert(TOPK_RANKED * 8 <= sizeof(SelectShared::counts) && TOPK_RANKED <= CONSUMERS && TOPK_MAX_SMS <= CONSUMERS,
              "topk_merge: the ranked candidates fit the buckets, one consumer each; one consumer per SM");

// An SM's part that cannot be merged (its tile list overflowed): sample_token decides.
constexpr uint64_t RACE_GIVE_UP = ~0ull;

// Traced (megakernel/profile.rs): the words after the trace's per-instruction and
// inside words (3 + 3 per instruction, 2 per SM): the merge's, then the parts'.
__device__ __forceinline__ unsigned long long* trace_tail(const Params& p) {
    return p.trace + 6 * __ldg(p.sm_start + gridDim.x) + 2 * gridDim.x;
}

// Traced (megakernel/profile.rs): this SM's PART_STAMPS words after the merge's,
// where thread 0 stamps the end of each phase of its sampler part; null when
// this step is not traced (the same for every thread, so a traced step's
// phases may end with a barrier of their own).
__device__ __forceinline__ unsigned long long* part_stamps(const Params& p, int t) {
    return p.trace != nullptr && t == p.trace_step
               ? trace_tail(p) + MERGE_STAMPS + PART_STAMPS * blockIdx.x
               : nullptr;
}

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
    bool listing;    // whether thread 0 records them (a sampled request, or logprobs)

    // Only the mode and the tile count live through the LM-head loop.
    template <class F>
    __device__ __forceinline__ void begin(const Params& p, const Smem& s, int t) {
        mode = race_mode<F>(p);
        tiles = 0;
        listing = mode != RACE_NONE || p.lp_out != nullptr;
        if (mode == RACE_BINS) {
            // Zeroed before the LM head's input load, whose barriers publish it.
            uint4* z = reinterpret_cast<uint4*>(s.race_keys());
            for (int i = threadIdx.x; i < (RACE_KEY_BINS + 2 * RACE_MASS_BINS) / 2; i += CONSUMERS) z[i] = make_uint4(0, 0, 0, 0);
            if (t > 0) clear_tables(p, t - 1);
        }
    }

    // The global tables of step `u` (the set of its parity), zeroed during step u + 1,
    // off the merge's path: each SM zeroes its slice of the whole set (~1 store per
    // consumer thread; no load, so nothing waits before the LM head's input). Step
    // u + 2 writes the set again: every SM's arrival in step u + 1 (after its
    // zeroing) and that step's counter release order the zeros before it, as step
    // u's counter release orders the merge's reads of the set before them. The host
    // zeroes both sets at every launch, so a launch's last step leaves its own.
    __device__ __forceinline__ void clear_tables(const Params& p, int u) {
        auto clear = [&](unsigned long long* set, int words) {
            const int slice = (words + p.lm_tiles - 1) / p.lm_tiles, first = (int)blockIdx.x * slice;
            for (int i = threadIdx.x; i < slice && first + i < words; i += CONSUMERS) __stcg(set + first + i, 0ull);
        };
        clear(p.race_keys + (size_t)(u & 1) * RACE_KEY_BINS, RACE_KEY_BINS);
        clear(p.race_mass + (size_t)(u & 1) * RACE_LEVELS * RACE_MASS_BINS, RACE_LEVELS * RACE_MASS_BINS);
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
        if (listing && threadIdx.x == 0 && tiles < (uint32_t)VEC_CAP) reinterpret_cast<uint32_t*>(s.vec())[tiles] = tile;
        tiles++;
    }

    // The recorded tiles (once the loop is done), and their tokens when they all fit the list.
    __device__ __forceinline__ const uint32_t* tile_list(const Smem& s) const { return reinterpret_cast<const uint32_t*>(s.vec()); }
    __device__ __forceinline__ bool listed() const { return tiles <= (uint32_t)VEC_CAP; }
    __device__ __forceinline__ uint32_t tokens(int tile_rows) const { return listed() ? tiles * (uint32_t)tile_rows : 0u; }

    // TOPK: this SM's min(k, candidates) best tokens by item_key (logit, then
    // the lower id: unique), found by select_threshold over keys it keeps in
    // registers, listed in race_keys[blockIdx.x * RACE_LIST ...]; their count
    // in lm_idx[blockIdx.x] (0xffffffff: the merge gives up) and in lm_max (as
    // u64) the threshold: the list holds every one of the SM's tokens at or
    // above it, exactly k of them (0: all of them, k or fewer). Ends with a
    // consumer barrier.
    template <class F>
    __device__ void topk_list(const Params& p, const Smem& s, const uint32_t* list, uint32_t n, bool listed, int tile_rows,
                              unsigned long long* ps) {
        const int tid = threadIdx.x;
        SelectShared& ss = *reinterpret_cast<SelectShared*>(s.race_keys());  // the race's shared space is free here
        if (tid == 0) ss.len = 0;  // (select_threshold's barriers publish it)
        auto row_of = [&](uint32_t j) { return list[j / tile_rows] * tile_rows + j % tile_rows; };
        auto key_of = [&](float v, uint32_t row) {
            const float l = processed(p, v, row);  // p.logits stays raw: sample_token may need it
            return is_candidate(l) ? item_key(l, row) : 0ull;  // a candidate's key is never 0
        };
        // The thread's first RACE_CACHED keys stay in registers (their loads in
        // flight together); the rest (an SM with an unusually large share) go
        // through sample_items.
        uint64_t cached[RACE_CACHED];
        uint32_t cached_row[RACE_CACHED];
        float cached_v[RACE_CACHED];
#pragma unroll
        for (int q = 0; q < RACE_CACHED; q++) {
            const uint32_t j = tid + q * CONSUMERS;
            cached_row[q] = j < n ? row_of(j) : 0xffffffffu;
            cached_v[q] = cached_row[q] < (uint32_t)F::V ? __ldcg(p.logits + cached_row[q]) : -INFINITY;
        }
#pragma unroll
        for (int q = 0; q < RACE_CACHED; q++) cached[q] = cached_row[q] < (uint32_t)F::V ? key_of(cached_v[q], cached_row[q]) : 0ull;
        for (uint32_t j = tid + RACE_CACHED * CONSUMERS; j < n; j += CONSUMERS) {
            const uint32_t row = row_of(j);
            if (row < (uint32_t)F::V) __stcg(&p.sample_items[row].key, key_of(__ldcg(p.logits + row), row));
        }
        // Every candidate key, each by the thread that computed it.
        auto each = [&](auto&& f) {
#pragma unroll
            for (int q = 0; q < RACE_CACHED; q++)
                if (cached[q]) f(cached[q]);
            for (uint32_t j = tid + RACE_CACHED * CONSUMERS; j < n; j += CONSUMERS) {
                const uint32_t row = row_of(j);
                if (row >= (uint32_t)F::V) continue;
                const uint64_t key = __ldcg(&p.sample_items[row].key);
                if (key) f(key);
            }
        };
        stamp_phase(ps, 0);  // the keys computed
        const uint64_t bound = select_threshold(each, r.top_k, ss);
        stamp_phase(ps, 1);  // the threshold selected
        // The SM's best key goes first in its list: the merge reads each SM's best
        // there, with the lists' lengths, before it reads the entries.
        uint64_t mine = 0;
        each([&](uint64_t key) { mine = max(mine, key); });
        const uint64_t best = consumer_max_u64(mine, s);
        stamp_phase(ps, 2);  // the best key
        unsigned long long* out = p.race_keys + (size_t)blockIdx.x * RACE_LIST;
        each([&](uint64_t key) {
            if (key == best) {
                __stcg(out, (unsigned long long)key);
            } else if (key >= bound) {
                const uint32_t slot = 1 + atomicAdd(&ss.len, 1u);
                if (slot < (uint32_t)RACE_LIST) __stcg(out + slot, (unsigned long long)key);
            }
        });
        consumer_sync();
        if (tid == 0) {
            const uint32_t len = best ? ss.len + 1 : 0u;
            __stcg(p.lm_idx + blockIdx.x, listed && len <= (uint32_t)RACE_LIST ? len : 0xffffffffu);
            __stcg(reinterpret_cast<uint64_t*>(p.lm_max) + blockIdx.x, bound);
        }
        consumer_sync();
        stamp_phase(ps, 3);  // the list written
    }

    // Traced: the end of a part's phase, after a barrier (every consumer calls it).
    static __device__ __forceinline__ void stamp_phase(unsigned long long* ps, int phase) {
        if (ps == nullptr) return;
        consumer_sync();
        if (threadIdx.x == 0) ps[phase] = globaltimer_ns();
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
        unsigned long long* const ps = part_stamps(p, t);
        if (mode == RACE_TOPK) {
            topk_list<F>(p, s, list, n, listed, tile_rows, ps);
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
        stamp_phase(ps, 0);  // the race keys into the bins
        // The SM's maximum scaled logit.
        const double m = order_double(consumer_max_u64(double_order(smax), s));
        stamp_phase(ps, 1);  // the maximum
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
        stamp_phase(ps, 2);  // the weights
        // Into the tables of this step's parity (clear_tables).
        const int l0 = race_level(a0), l1 = race_level(a1);
        unsigned long long* keys = p.race_keys + (size_t)(t & 1) * RACE_KEY_BINS;
        unsigned long long* table = p.race_mass + (size_t)(t & 1) * RACE_LEVELS * RACE_MASS_BINS;
        for (int i = threadIdx.x; i < RACE_KEY_BINS; i += CONSUMERS) {
            const unsigned long long k = s.race_keys()[i];
            if (k) atomicMax(keys + i, k);
        }
        if (weighs) {
            for (int i = threadIdx.x; i < RACE_MASS_BINS; i += CONSUMERS) {
                const unsigned long long w0 = mass[i], w1 = mass[RACE_MASS_BINS + i];
                if (w0) atomicAdd(table + l0 * RACE_MASS_BINS + i, w0);
                if (w1) atomicAdd(table + l1 * RACE_MASS_BINS + i, w1);
            }
        }
        if (threadIdx.x == 0) {
            // The maximum (NaN: this SM could not weigh its tokens, the merge gives up).
            __stcg(reinterpret_cast<double*>(p.lm_max) + blockIdx.x, weighs || (listed && m == -INFINITY) ? m : (double)NAN);
        }
        consumer_sync();
        stamp_phase(ps, 3);  // the tables' atomics issued
    }
};

// Entries of the SMs' lists each merge thread keeps in registers (entries
// tid + CONSUMERS q of the lists' dense enumeration, SM by SM, slots below k):
// 3,072, over the 132 x 20 = 2,640 of Qwen3's top-k 20 on 132 SMs. Their loads
// are in flight together: one L2 round trip, where a thread per list (or a
// thread per slot of every list) reading its entries one by one took ~20.
constexpr int MERGE_CACHED = 12;

// Traced (megakernel/profile.rs): the MERGE_STAMPS words after the trace's
// inside words, where thread 0 of the merging SM stamps the end of each of the
// merge's phases (at most MERGE_STAMPS); null when this step is not traced, or
// for the other threads.
__device__ __forceinline__ unsigned long long* merge_stamps(const Params& p, int t) {
    return p.trace != nullptr && t == p.trace_step && threadIdx.x == 0 ? trace_tail(p) : nullptr;
}

// Stamps the end of merge phase `phase` where the step is traced (thread 0).
struct MergeStamps {
    unsigned long long* at;
    __device__ __forceinline__ void operator()(int phase) const {
        if (at) at[phase] = globaltimer_ns();
    }
};

// TOPK's merge (see race_merge). Every SM's list holds its tokens at or above
// its threshold, so it holds each of the global k best that lies on it. Two
// lower bounds of the global k-th key: the highest of the SMs' thresholds (that
// SM has k keys at or above it) and the k-th largest of the SMs' best keys (k
// distinct keys at or above it). The global k best are the k best of the
// lists' entries at or above the higher bound: usually a few dozen, which are
// ranked in shared memory; more go through select_threshold.
template <class F>
__device__ uint32_t topk_merge(const Params& p, const Smem& s, int t) {
    const int tid = threadIdx.x;
    SampleShared& sh = *reinterpret_cast<SampleShared*>(s.vec());
    TopkShared& ts = *reinterpret_cast<TopkShared*>(s.race_keys());
    const SampleRow& r = *p.sample;
    const MergeStamps stamp{merge_stamps(p, t)};
    if (p.lm_tiles > TOPK_MAX_SMS) return 0xffffffffu;
    // Every list holds at most k entries (topk_list): the dense enumeration's width.
    const uint32_t width = r.top_k;
    const uint32_t total = (uint32_t)p.lm_tiles * width;
    // The lists' entries, each by one thread: the first MERGE_CACHED per thread
    // in registers, their loads issued before the lengths are known (the slots
    // past a list's length are masked once they are), the rest loaded per use.
    uint64_t cached[MERGE_CACHED];
    uint32_t cached_list[MERGE_CACHED];
#pragma unroll
    for (int q = 0; q < MERGE_CACHED; q++) {
        const uint32_t e = tid + q * CONSUMERS, list = e < total ? e / width : 0u;
        cached_list[q] = list;
        cached[q] = e < total ? (uint64_t)__ldcg(p.race_keys + (size_t)list * RACE_LIST + (e - list * width)) : 0ull;
    }
    // The SMs' thresholds, list lengths and best keys (each list's first entry),
    // in the same round trip.
    uint64_t bound = 0, bad = 0;
    for (int i = tid; i < TOPK_MAX_SMS; i += CONSUMERS) {
        uint64_t top = 0;
        if (i < p.lm_tiles) {
            bound = max(bound, (uint64_t)__ldcg(reinterpret_cast<const uint64_t*>(p.lm_max) + i));
            const uint32_t len = __ldcg(p.lm_idx + i);
            top = __ldcg(p.race_keys + (size_t)i * RACE_LIST);
            if (len > width) bad = 1;  // (0xffffffff too: an SM whose list overflowed)
            if (len == 0) top = 0;
            ts.lens[i] = len;
        }
        ts.tops[i] = top;
    }
    if (tid == 0) {
        ts.sel.len = 0;
        ts.n_cand = 0;
        ts.top_bound = 0;
    }
    bound = ConsumerSampler::block_key_reduce<true>(bound, sh);  // (its barriers publish lens, tops and the zeros)
    if (ConsumerSampler::block_key_reduce<true>(bad, sh) != 0) return 0xffffffffu;
    stamp(0);  // the lists' lengths, thresholds and best keys read
#pragma unroll
    for (int q = 0; q < MERGE_CACHED; q++) {
        const uint32_t e = tid + q * CONSUMERS;
        if (e < total && e - cached_list[q] * width >= ts.lens[cached_list[q]]) cached[q] = 0;
    }
    auto uncached = [&](auto&& f) {
        for (uint32_t e = tid + MERGE_CACHED * CONSUMERS; e < total; e += CONSUMERS) {
            const uint32_t list = e / width, slot = e - list * width;
            const uint64_t key = slot < ts.lens[list] ? (uint64_t)__ldcg(p.race_keys + (size_t)list * RACE_LIST + slot) : 0ull;
            if (key) f(key);  // a listed key is never 0
        }
    };
    stamp(1);  // the entries past the lists' lengths masked
    // The k-th largest best key: its rank (the larger ones) is k - 1. Equal
    // ranks only come from SMs without a candidate (0).
    const int pairs = ((p.lm_tiles + 7) & ~7) / 2;  // tops is 0 past the SMs
    for (int i = tid; i < p.lm_tiles; i += CONSUMERS) {
        const uint64_t mine = ts.tops[i];
        const ulonglong2* two = reinterpret_cast<const ulonglong2*>(ts.tops);
        uint32_t rank = 0;
#pragma unroll 4
        for (int j = 0; j < pairs; j++) {
            const ulonglong2 v = two[j];
            rank += (uint32_t)(v.x > mine) + (uint32_t)(v.y > mine);
        }
        if (rank + 1 == r.top_k) ts.top_bound = mine;
    }
    consumer_sync();
    stamp(2);  // the k-th best of the SMs' best keys
    bound = max(bound, ts.top_bound);
    auto each = [&](auto&& f) {
#pragma unroll
        for (int q = 0; q < MERGE_CACHED; q++)
            if (cached[q] && cached[q] >= bound) f(cached[q]);
        uncached([&](uint64_t key) {
            if (key >= bound) f(key);
        });
    };
    uint64_t* cand = reinterpret_cast<uint64_t*>(ts.sel.counts);
    each([&](uint64_t key) {
        const uint32_t slot = atomicAdd(&ts.n_cand, 1u);
        if (slot < (uint32_t)TOPK_RANKED) cand[slot] = key;
    });
    consumer_sync();
    stamp(3);  // the candidates at or above the bound
    const uint32_t n = ts.n_cand;
    uint32_t kk;
    if (n <= (uint32_t)TOPK_RANKED) {
        // Most likely first: a candidate's place is the number of larger ones (the keys are unique).
        kk = min(n, r.top_k);
        if (tid < (int)n) {
            const uint64_t mine = cand[tid];
            uint32_t place = 0;
            for (uint32_t j = 0; j < n; j++) place += cand[j] > mine;
            if (place < kk) ts.sorted[place] = mine;
        }
        consumer_sync();
    } else {
        // The k best: exactly min(k, entries) keys at or above the threshold.
        const uint64_t thr = select_threshold(each, r.top_k, ts.sel);
        each([&](uint64_t key) {
            if (key >= thr) {
                const uint32_t slot = atomicAdd(&ts.sel.len, 1u);
                if (slot < (uint32_t)RACE_TOPK_MAX) ts.surv[slot] = key;
            }
        });
        consumer_sync();
        kk = ts.sel.len;
        if (kk > min(r.top_k, (uint32_t)RACE_TOPK_MAX)) return 0xffffffffu;
        // Most likely first, as above.
        if (tid < (int)kk) {
            const uint64_t mine = ts.surv[tid];
            uint32_t place = 0;
            for (uint32_t j = 0; j < kk; j++) place += ts.surv[j] > mine;
            ts.sorted[place] = mine;
        }
        consumer_sync();
    }
    stamp(4);  // the k best in order
    if (kk == 0) return 0xffffffffu;  // no candidate: the host's argmax
    const uint64_t* sorted = ts.sorted;
    // The host takes the first +inf logit (sampling.rs `sample`); it is the best key. (A finite
    // token's key can round to +inf too and would win the tie with a lower id.)
    if (key_logit(sorted[0]) == INFINITY) return key_id(sorted[0]);
    const double inv_t = __ddiv_rn(1.0, (double)r.temperature);
    const uint64_t hash = step_hash(r.seed, r.step + (uint64_t)t);
    const double m = race_scaled(key_logit(sorted[0]), inv_t);
    const double a = race_anchor(m);
    uint64_t rk = 0;
    if (tid < (int)kk) {
        const double sc = race_scaled(key_logit(sorted[tid]), inv_t);
        ts.bins[tid] = race_bin(sc);
        ts.weights[tid] = r.top_p < 1.0f ? race_weight(sc, a) : 0ull;
        rk = race_key(sc, key_id(sorted[tid]), hash);
    }
    consumer_sync();
    stamp(5);  // their bins, weights and race keys
    if (tid < 32) {
        // race::top_p_bin over the k best (most likely first: bins never rise), by
        // one warp, two entries a lane. The host keeps each group of equal bins
        // while the weight above the group is under the target; an entry with the
        // weight above it under the target has its group's under it too, so the
        // cut is the lowest bin of such an entry (LLONG_MAX: none).
        long long cut = LLONG_MIN;
        if (r.top_p < 1.0f) {
            const int lane = tid, i0 = 2 * lane, i1 = i0 + 1;
            const unsigned long long w0 = i0 < (int)kk ? ts.weights[i0] : 0ull, w1 = i1 < (int)kk ? ts.weights[i1] : 0ull;
            unsigned long long incl = w0 + w1;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            const unsigned long long sum = __shfl_sync(0xffffffffu, incl, 31);
            const double target = __dmul_rn((double)r.top_p, __ull2double_rn(sum));
            const unsigned long long above0 = incl - w0 - w1, above1 = above0 + w0;
            long long kept = LLONG_MAX;
            if (i0 < (int)kk && __ull2double_rn(above0) < target) kept = ts.bins[i0];
            if (i1 < (int)kk && __ull2double_rn(above1) < target) kept = min(kept, ts.bins[i1]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) kept = min(kept, (long long)__shfl_xor_sync(0xffffffffu, kept, o));
            cut = kept;
        }
        if (r.min_p > 0.0f) cut = max(cut, race_min_p_bin(m, r.min_p));
        if (tid == 0) ts.cut = cut;
    }
    consumer_sync();
    stamp(6);  // the cut
    if (tid < (int)kk && ts.bins[tid] < ts.cut) rk = 0;
    const uint64_t best = ConsumerSampler::block_key_reduce<true>(rk, sh);
    stamp(7);  // the winner
    return best ? key_id(best) : 0xffffffffu;
}

// The merge, on the last SM to arrive. Returns the token, or 0xffffffff when
// it gave up (a part it cannot merge: sample_token decides). Reads the tables
// of its step's parity (the SMs zero them during the next step). Every consumer
// gets the result.
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
    const MergeStamps stamp{merge_stamps(p, t)};
    // The maximum, and whether every SM could weigh at the anchor it gives.
    const double* maxima = reinterpret_cast<const double*>(p.lm_max);
    uint64_t m_bits = 0, bad = 0;  // order of doubles as u64 (0: nothing), any NaN
    double own = 0.0;  // maxima[tid], kept for the aliasing loop below (one L2 round trip less)
    for (int i = tid; i < p.lm_tiles; i += CONSUMERS) {
        const double m = __ldcg(maxima + i);
        if (i == tid) own = m;
        if (isnan(m)) bad = 1;
        else if (m > -INFINITY) m_bits = max(m_bits, double_order(m));
    }
    m_bits = ConsumerSampler::block_key_reduce<true>(m_bits, sh);
    bad = ConsumerSampler::block_key_reduce<true>(bad, sh);
    stamp(0);  // the SMs' maxima read
    const double m = m_bits ? order_double(m_bits) : -INFINITY;
    bool give_up = bad != 0 || !isfinite(m) || fabs(m) > RACE_M_LIMIT;
    const double a = give_up ? 0.0 : race_anchor(m);
    const int level = race_level(a);
    // Whether another anchor's weights share our level's row.
    uint64_t aliased = 0;
    for (int i = tid; i < p.lm_tiles; i += CONSUMERS) {
        const double mi = i == tid ? own : __ldcg(maxima + i);
        if (!isfinite(mi) || fabs(mi) > RACE_M_LIMIT) continue;
        const double a0 = race_anchor(mi), a1 = __dadd_rn(a0, RACE_ANCHOR_STEP);
        if ((race_level(a0) == level && a0 != a) || (race_level(a1) == level && a1 != a)) aliased = 1;
    }
    aliased = ConsumerSampler::block_key_reduce<true>(aliased, sh);
    give_up = give_up || aliased != 0;
    stamp(1);  // the anchors' aliasing checked
    // This step's tables (the SMs zero them during the next step: RacePart::clear_tables).
    const unsigned long long* keys = p.race_keys + (size_t)(t & 1) * RACE_KEY_BINS;

    uint32_t token = 0xffffffffu;
    if (!give_up) {
        const long long top_bin = race_bin(m);
        long long cut = LLONG_MIN;
        if (r.top_p < 1.0f) {
            // Bins from the top down (d = top_bin - bin), those that can weigh at anchor a;
            // each thread takes two consecutive ones.
            const long long lowest = race_bin(a) - (RACE_MASS_BINS - 1);
            const int n = (int)min((long long)RACE_MASS_BINS, top_bin - lowest + 1);
            const unsigned long long* row = p.race_mass + ((size_t)(t & 1) * RACE_LEVELS + level) * RACE_MASS_BINS;
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
        stamp(2);  // the top-p cut
        if (r.min_p > 0.0f) cut = max(cut, race_min_p_bin(m, r.min_p));
        // The best key among the kept bins (a token whose bin aliases a kept one is
        // over 64 nats down and cannot beat the top token's key).
        const long long from = max(cut, top_bin - (RACE_KEY_BINS - 1));
        uint64_t best = 0;
        for (long long b = from + tid; b <= top_bin; b += CONSUMERS) best = max(best, (uint64_t)__ldcg(keys + (b & (RACE_KEY_BINS - 1))));
        best = ConsumerSampler::block_key_reduce<true>(best, sh);
        token = best ? key_id(best) : 0xffffffffu;
        stamp(3);  // the winner
    }
    return token;
}

}  // namespace mk

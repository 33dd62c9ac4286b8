// The host sampler (crates/rocket-core/src/sampling.rs `sample`) as device code
// any CTA can run: `Sampler<THREADS, Bar>::pick` chooses the same token as the
// host for the same processed logits, parameters, seed and step. Used by
// sample.cu (one 1024-thread CTA per row) and by the megakernel's token loop
// for truncated requests (its 256 consumer threads, synchronised on their own
// named barrier); the megakernel races untruncated requests over all its SMs
// with `race_key` alone.
//
// Sameness rests on three things:
//  - every floating-point step is the host's IEEE operation, written with
//    explicit round-to-nearest intrinsics so nothing is contracted into an FMA;
//    e^x and ln x are portable_exp / portable_ln, the host's functions,
//    operation for operation;
//  - the cuts' weights are integers (probability relative to the top, in 2^-63
//    units) and every sum of them is exact (128-bit), so summation order does
//    not matter; the draw is an argmax (the race: logit/T + Gumbel noise hashed
//    from seed, step and token id), so its order does not matter either;
//  - candidates are ordered by a unique 64-bit key (logit, then lower id first),
//    and each cut (k-th key, nucleus boundary) is found by a radix descent over
//    that key: eight 8-bit digits, counting or summing per bucket.
// Candidates with e^x > 0 (x >= -44) are first compacted into `items` (vocab
// entries per row); the others weigh nothing, sort below all of them and can
// never win the race. Rows and items are read through L2 (__ldcg): in the
// megakernel other SMs wrote them during this launch.
#pragma once
#include "common.cuh"

// One row's request (mirrors SampleRow in crates/rocket-core/src/backend/cuda/kernels.rs).
struct SampleRow {
    uint64_t seed;
    uint64_t step;
    float temperature;
    float top_p;
    float min_p;
    float repetition_penalty;
    float presence_penalty;
    float frequency_penalty;
    uint32_t top_k;
    uint32_t penalty_off;  // entries [penalty_off, +penalty_len) of the penalty arrays
    uint32_t penalty_len;
    uint32_t mask_off;     // end ids [mask_off, +mask_len) set to -inf (min_tokens)
    uint32_t mask_len;
    uint32_t path;         // sample.cu: which kernels pick this row (SAMPLE_PATH_*; 0 in the megakernel)
};
static_assert(sizeof(SampleRow) == 64, "SampleRow layout is shared with Rust");

// A compacted candidate: its item_key (logit order, then the lower id first).
struct SampleItem {
    uint64_t key;
};

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// crate::sampling::step_hash.
__device__ __forceinline__ uint64_t step_hash(uint64_t seed, uint64_t step) {
    return splitmix64(splitmix64(seed) ^ step);
}

// crate::portable_exp::portable_exp, operation for operation.
__device__ double portable_exp(double x) {
    if (isnan(x)) return x;
    x = fmin(fmax(x, -700.0), 700.0);
    const double k = rint(__dmul_rn(x, __longlong_as_double(0x3ff71547652b82fell)));
    double r = __fma_rn(-k, __longlong_as_double(0x3fe62e42fee00000ll), x);
    r = __fma_rn(-k, __longlong_as_double(0x3dea39ef35793c76ll), r);
    const long long c[12] = {0x3de6124613a86d09ll, 0x3e21eed8eff8d898ll, 0x3e5ae64567f544e4ll, 0x3e927e4fb7789f5cll,
                             0x3ec71de3a556c734ll, 0x3efa01a01a01a01all, 0x3f2a01a01a01a01all, 0x3f56c16c16c16c17ll,
                             0x3f81111111111111ll, 0x3fa5555555555555ll, 0x3fc5555555555555ll, 0x3fe0000000000000ll};
    double p = __longlong_as_double(c[0]);
#pragma unroll
    for (int i = 1; i < 12; i++) p = __fma_rn(p, r, __longlong_as_double(c[i]));
    p = __fma_rn(p, r, 1.0);
    p = __fma_rn(p, r, 1.0);
    return __dmul_rn(p, __longlong_as_double((long long)(1023 + (long long)k) << 52));
}

// crate::portable_exp::portable_ln, operation for operation (x > 0 finite:
// all the race gives it).
__device__ double portable_ln(double x) {
    uint64_t bits = (uint64_t)__double_as_longlong(x);
    long long e = 0;
    if ((bits >> 52) == 0) {
        bits = (uint64_t)__double_as_longlong(__dmul_rn(x, 18014398509481984.0));  // 2^54
        e = -54;
    }
    e += (long long)((bits >> 52) & 0x7ff) - 1023;
    double m = __longlong_as_double((long long)((bits & 0x000fffffffffffffull) | 0x3ff0000000000000ull));
    if (m > __longlong_as_double(0x3ff6a09e667f3bcdll)) {
        m = __dmul_rn(m, 0.5);
        e += 1;
    }
    const double s = __ddiv_rn(__dsub_rn(m, 1.0), __dadd_rn(m, 1.0));
    const double s2 = __dmul_rn(s, s);
    const long long c[11] = {0x3fb642c8590b2164ll, 0x3fb8618618618618ll, 0x3fbaf286bca1af28ll, 0x3fbe1e1e1e1e1e1ell,
                             0x3fc1111111111111ll, 0x3fc3b13b13b13b14ll, 0x3fc745d1745d1746ll, 0x3fcc71c71c71c71cll,
                             0x3fd2492492492492ll, 0x3fd999999999999all, 0x3fe5555555555555ll};
    double q = __longlong_as_double(c[0]);
#pragma unroll
    for (int i = 1; i < 11; i++) q = __fma_rn(q, s2, __longlong_as_double(c[i]));
    const double ln_m = __fma_rn(__dmul_rn(s, s2), q, __dmul_rn(2.0, s));
    const double ed = (double)e;
    return __fma_rn(ed, __longlong_as_double(0x3fe62e42fee00000ll), __fma_rn(ed, __longlong_as_double(0x3dea39ef35793c76ll), ln_m));
}

// crate::sampling::race_key: logit/T plus Gumbel noise for token `id` of the
// step whose hash is `hash` (inv_t = 1/T in f64).
__device__ __forceinline__ double race_key(float logit, uint32_t id, double inv_t, uint64_t hash) {
    const uint64_t k = splitmix64(hash ^ (uint64_t)id) >> 12;
    const double u = __dmul_rn(__ull2double_rn(2 * k + 1), 1.0 / 9007199254740992.0);
    const double g = -portable_ln(-portable_ln(u));
    return __dadd_rn(__dmul_rn((double)logit, inv_t), g);
}

// (key, id) with the larger key, the lower id on equal keys; a NaN key never wins.
__device__ __forceinline__ void race_better(double& k, uint32_t& i, double ok, uint32_t oi) {
    if (ok > k || (ok == k && oi < i)) {
        k = ok;
        i = oi;
    }
}

// Order of f32 values as Rust's total_cmp, as an unsigned integer.
__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Larger key = earlier in the host's most_likely_first order.
__device__ __forceinline__ uint64_t item_key(float logit, uint32_t id) {
    return ((uint64_t)order_key(logit) << 32) | (uint64_t)(0xffffffffu - id);
}

__device__ __forceinline__ uint32_t key_id(uint64_t key) {
    return 0xffffffffu - (uint32_t)key;
}

// The logit an item_key was made from (order_key inverted).
__device__ __forceinline__ float key_logit(uint64_t key) {
    const uint32_t b = (uint32_t)(key >> 32);
    return __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}

__device__ __forceinline__ bool is_candidate(float l) {
    return l > -INFINITY;  // false for NaN too
}

// process_logits for one token: the repetition penalty if it was seen (prompt
// or output), then the presence and frequency penalties for `count` generations.
__device__ __forceinline__ float penalised(float l, const SampleRow& r, bool seen, uint32_t count) {
    if (seen && r.repetition_penalty != 1.0f)
        l = l > 0.0f ? __fdiv_rn(l, r.repetition_penalty) : __fmul_rn(l, r.repetition_penalty);
    if (count > 0 && (r.presence_penalty != 0.0f || r.frequency_penalty != 0.0f))
        l = __fsub_rn(l, __fadd_rn(__fmul_rn(r.frequency_penalty, __uint2float_rn(count)), r.presence_penalty));
    return l;
}

// crate::race, operation for operation: bins, anchor, weights, cuts, keys.
constexpr double RACE_BINS_PER_NAT = 16.0;
constexpr double RACE_ANCHOR_STEP = 16.0;
constexpr double RACE_WEIGHT_ONE = 17592186044416.0;  // 2^44
constexpr double RACE_WEIGHTLESS_BELOW = -32.0;
constexpr double RACE_S_LIMIT = 1125899906842624.0;  // 2^50
// The race's noise lies in [RACE_NOISE_MIN, RACE_NOISE_MAX]: a token whose best
// possible key is below the top token's worst cannot win (race::race_key
// rounds keys to f32, and rounding is monotone), and it weighs 0.
constexpr double RACE_NOISE_MIN = -3.61, RACE_NOISE_MAX = 36.75;
__device__ __forceinline__ bool race_hopeless(double s, double top) {
    return __double2float_rn(__dadd_rn(s, RACE_NOISE_MAX)) < __double2float_rn(__dadd_rn(top, RACE_NOISE_MIN));
}
// Bins below the top one that can hold weight (s > A - 32 >= M - 32).
constexpr int RACE_MASS_BINS = 520;
static_assert(RACE_MASS_BINS > -RACE_WEIGHTLESS_BELOW * RACE_BINS_PER_NAT,
              "a weighed token's bin is at most 32 nats x 16 bins below the top one");

// race::top_p_bin over masses per bin counted down from the top one (mass[d]:
// bin top_bin - d, every weighed token within RACE_MASS_BINS of the top): the
// deepest bin whose mass above is under top_p of the total. One thread.
__device__ __forceinline__ long long race_top_p_cut(const unsigned long long* mass, float top_p, long long top_bin) {
    unsigned long long total = 0;
    for (int b = 0; b < RACE_MASS_BINS; b++) total += mass[b];
    const double target = __dmul_rn((double)top_p, __ull2double_rn(total));
    unsigned long long above = 0;
    int last = 0;
    for (int b = 0; b < RACE_MASS_BINS && __ull2double_rn(above) < target; b++) {
        last = b;
        above += mass[b];
    }
    return top_bin - last;
}

__device__ __forceinline__ double race_scaled(float l, double inv_t) { return __dmul_rn((double)l, inv_t); }
__device__ __forceinline__ long long race_bin(double s) {
    return (long long)floor(__dmul_rn(fmin(fmax(s, -RACE_S_LIMIT), RACE_S_LIMIT), RACE_BINS_PER_NAT));
}
__device__ __forceinline__ double race_anchor(double m) {
    return __dmul_rn(ceil(__ddiv_rn(m, RACE_ANCHOR_STEP)), RACE_ANCHOR_STEP);
}
__device__ __forceinline__ uint64_t race_weight(double s, double a) {
    const double x = __dsub_rn(s, a);
    return x <= RACE_WEIGHTLESS_BELOW ? 0ull : __double2ull_rz(__dmul_rn(portable_exp(x), RACE_WEIGHT_ONE));
}
__device__ __forceinline__ long long race_min_p_bin(double m, float min_p) {
    return race_bin(__dadd_rn(m, portable_ln((double)min_p)));
}
// race::race_key: s + noise rounded to f32, then the lower id first; the larger wins.
__device__ __forceinline__ uint64_t race_key(double s, uint32_t id, uint64_t hash) {
    const uint64_t k = splitmix64(hash ^ (uint64_t)id) >> 12;
    const double u = __dmul_rn(__ull2double_rn(2 * k + 1), 1.0 / 9007199254740992.0);
    const double g = -portable_ln(-portable_ln(u));
    return item_key(__double2float_rn(__dadd_rn(s, g)), id);  // key_id gives the id back
}

// Shared state of one CTA (also laid over the megakernel's vector space).
struct SampleShared {
    uint32_t count[256];
    unsigned long long mass[RACE_MASS_BINS];
    uint64_t key_partial[32];
    uint32_t n_items;
    int bucket;
    uint64_t prefix;
    uint32_t above_count;
    long long cut;
};

// Items compacted into scratch (keys only: the logit and id are in them).
struct CompactItems {
    const SampleItem* items;
    uint32_t n;
    __device__ __forceinline__ uint32_t size() const { return n; }
    __device__ __forceinline__ uint64_t get(uint32_t i) const { return __ldcg(&items[i].key); }
};

// The tokens a pick chooses among: a whole logits row (token i at index i)...
struct WholeRow {
    const float* row;
    uint32_t vocab;
    __device__ __forceinline__ uint32_t size() const { return vocab; }
    __device__ __forceinline__ float logit(uint32_t i) const { return __ldcg(row + i); }
    __device__ __forceinline__ uint32_t id(uint32_t i) const { return i; }
};

// ...or the item keys listed for it (sample.cu's top-k lists: a superset of the
// row's k best), a 0 key being an empty slot.
struct ListedRow {
    const uint64_t* keys;
    uint32_t n;
    __device__ __forceinline__ uint32_t size() const { return n; }
    __device__ __forceinline__ float logit(uint32_t i) const {
        const uint64_t k = __ldcg(keys + i);
        return k ? key_logit(k) : -INFINITY;
    }
    __device__ __forceinline__ uint32_t id(uint32_t i) const { return key_id(__ldcg(keys + i)); }
};

// THREADS threads run it together; Bar::sync() is their barrier.
template <int THREADS, class Bar>
struct Sampler {
    // Block-wide max (MAX) or min of 64-bit keys; `none` where a thread has nothing.
    template <bool MAX>
    static __device__ uint64_t block_key_reduce(uint64_t v, SampleShared& sh) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const uint64_t other = __shfl_xor_sync(0xffffffffu, v, o);
            v = MAX ? (other > v ? other : v) : (other < v ? other : v);
        }
        Bar::sync();
        if (lane == 0) sh.key_partial[warp] = v;
        Bar::sync();
        uint64_t t = sh.key_partial[0];
        for (int w = 1; w < THREADS / 32; w++) {
            const uint64_t o = sh.key_partial[w];
            t = MAX ? (o > t ? o : t) : (o < t ? o : t);
        }
        return t;
    }

    // The k-th largest item key (a radix descent, eight 8-bit digits, counting per bucket).
    static __device__ uint64_t kth_key(const CompactItems& items, uint32_t k, SampleShared& sh) {
        Bar::sync();  // every thread has read the previous use of the shared state
        if (threadIdx.x == 0) {
            sh.prefix = 0;
            sh.above_count = 0;
        }
        for (int level = 0; level < 8; level++) {
            const int shift = 56 - 8 * level;
            for (int b = threadIdx.x; b < 256; b += THREADS) sh.count[b] = 0;
            Bar::sync();
            const uint64_t prefix = sh.prefix;
            for (uint32_t i = threadIdx.x; i < items.size(); i += THREADS) {
                const uint64_t key = items.get(i);
                if (level > 0 && (key >> (shift + 8)) != (prefix >> (shift + 8))) continue;
                atomicAdd(&sh.count[(key >> shift) & 0xff], 1u);
            }
            Bar::sync();
            if (threadIdx.x == 0) {
                uint32_t c = sh.above_count;
                int b = 255;
                for (; b > 0; b--) {
                    if (c + sh.count[b] >= k) break;
                    c += sh.count[b];
                }
                sh.prefix |= (uint64_t)b << shift;
                sh.above_count = c;
            }
            Bar::sync();
        }
        return sh.prefix;
    }

    // crate::sampling::argmax over the (processed) row: the largest value, the
    // lowest index on ties; NaN never wins and a row without a winner gives 0.
    template <class Row>
    static __device__ uint32_t row_argmax(const Row& row, SampleShared& sh) {
        // Key: value order, then lower index first; 0 = no candidate.
        uint64_t best = 0;
        for (uint32_t i = threadIdx.x; i < row.size(); i += THREADS) {
            const float v = row.logit(i);
            if (v > -INFINITY) {
                // + 0.0f turns -0.0 into +0.0: the host's `>` sees them equal (lower index wins).
                const uint64_t k = item_key(__fadd_rn(v, 0.0f), row.id(i));
                best = k > best ? k : best;
            }
        }
        best = block_key_reduce<true>(best, sh);
        return best == 0 ? 0u : key_id(best);
    }

    // The host sampler's token for a row whose penalties and min_tokens mask are
    // already applied (see the file comment); every thread gets it.
    static __device__ uint32_t pick(const float* row, uint32_t vocab, const SampleRow& r, SampleItem* items, SampleShared& sh) {
        return pick_in(WholeRow{row, vocab}, r, items, sh);
    }

    // The same over listed tokens: the host's token whenever `row` holds every
    // one of the row's min(top_k, candidates) best (r.top_k > 0). The cuts and
    // the race only ever look at those (the k-th key, the top-p mass and min-p
    // over the k best, the race over what the cuts keep), and a token the
    // whole-row pick drops as hopeless cannot win here either.
    template <class Row>
    static __device__ uint32_t pick_in(const Row& row, const SampleRow& r, SampleItem* items, SampleShared& sh) {
        const uint32_t vocab = row.size();
        if (r.temperature == 0.0f) {
            return row_argmax(row, sh);
        }

        // The top logit and the number of candidates.
        uint64_t top = 0, mine = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) {
            const float l = row.logit(i);
            if (is_candidate(l)) {
                mine++;
                const uint64_t k = (uint64_t)order_key(l) << 32;
                top = k > top ? k : top;
            }
        }
        top = block_key_reduce<true>(top, sh);
        const uint64_t n_cand = block_sum(mine, sh);
        // No candidate, or a +inf one that takes all the mass: the host's argmax.
        if (top == 0 || top == ((uint64_t)order_key(INFINITY) << 32)) {
            return row_argmax(row, sh);
        }
        const double inv_t = __ddiv_rn(1.0, (double)r.temperature);
        const double m = race_scaled(key_logit(top), inv_t);
        const uint64_t hash = step_hash(r.seed, r.step);
        const bool top_k = r.top_k > 0 && (uint64_t)r.top_k < n_cand;
        if (!top_k && !(r.top_p < 1.0f) && !(r.min_p > 0.0f)) {
            // The race over every candidate.
            uint64_t best = 0;
            for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) {
                const float l = row.logit(i);
                if (is_candidate(l)) {
                    const uint64_t k = race_key(race_scaled(l, inv_t), row.id(i), hash);
                    best = k > best ? k : best;
                }
            }
            return key_id(block_key_reduce<true>(best, sh));
        }

        // Compact the candidates that can win (the others weigh nothing either).
        if (threadIdx.x == 0) sh.n_items = 0;
        Bar::sync();
        for (uint32_t base = 0; base < vocab; base += THREADS) {
            const uint32_t i = base + threadIdx.x;
            bool keep = false;
            float l = 0.0f;
            if (i < vocab) {
                l = row.logit(i);
                keep = is_candidate(l) && !race_hopeless(race_scaled(l, inv_t), m);
            }
            const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
            uint32_t base_slot = 0;
            if ((threadIdx.x & 31) == 0 && ballot) base_slot = atomicAdd(&sh.n_items, (uint32_t)__popc(ballot));
            base_slot = __shfl_sync(0xffffffffu, base_slot, 0);
            if (keep) __stcg(&items[base_slot + __popc(ballot & ((1u << (threadIdx.x & 31)) - 1u))].key, item_key(l, row.id(i)));
        }
        Bar::sync();
        const CompactItems compact{items, sh.n_items};

        // top-k: the k-th key, when more than k candidates can win (fewer: all of them are in).
        const uint64_t lo_key = top_k && r.top_k < compact.n ? kth_key(compact, r.top_k, sh) : 0;
        long long cut = LLONG_MIN;
        if (r.top_p < 1.0f) {
            // Mass per bin, counted down from the top bin (every weighed token lies within RACE_MASS_BINS of it).
            const double a = race_anchor(m);
            const long long top_bin = race_bin(m);
            for (int b = threadIdx.x; b < RACE_MASS_BINS; b += THREADS) sh.mass[b] = 0;
            Bar::sync();
            for (uint32_t i = threadIdx.x; i < compact.n; i += THREADS) {
                const uint64_t key = compact.get(i);
                if (key < lo_key) continue;
                const double s = race_scaled(key_logit(key), inv_t);
                const uint64_t w = race_weight(s, a);
                if (w != 0) atomicAdd(&sh.mass[top_bin - race_bin(s)], (unsigned long long)w);
            }
            Bar::sync();
            if (threadIdx.x == 0) sh.cut = race_top_p_cut(sh.mass, r.top_p, top_bin);
            Bar::sync();
            cut = sh.cut;
        }
        if (r.min_p > 0.0f) cut = max(cut, race_min_p_bin(m, r.min_p));

        // The race over what the cuts keep.
        uint64_t best = 0;
        for (uint32_t i = threadIdx.x; i < compact.n; i += THREADS) {
            const uint64_t key = compact.get(i);
            const double s = race_scaled(key_logit(key), inv_t);
            if (key >= lo_key && race_bin(s) >= cut) {
                const uint64_t k = race_key(s, key_id(key), hash);
                best = k > best ? k : best;
            }
        }
        return key_id(block_key_reduce<true>(best, sh));
    }

    static __device__ uint64_t block_sum(uint64_t v, SampleShared& sh) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    #pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        Bar::sync();
        if (lane == 0) sh.key_partial[warp] = v;
        Bar::sync();
        uint64_t t = 0;
        for (int w = 0; w < THREADS / 32; w++) t += sh.key_partial[w];
        return t;
    }
};

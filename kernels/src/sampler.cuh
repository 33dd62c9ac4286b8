// The host sampler (crates/rocket-core/src/sampling.rs `sample`) as device code
// any CTA can run: `Sampler<THREADS, Bar>::pick` chooses the same token as the
// host for the same processed logits, parameters, seed and step. Used by
// sample.cu (one 1024-thread CTA per row) and by the megakernel's token loop
// (its 256 consumer threads, synchronised on their own named barrier).
//
// Sameness rests on three things:
//  - every floating-point step is the host's IEEE operation, written with
//    explicit round-to-nearest intrinsics so nothing is contracted into an FMA;
//    e^x is portable_exp, the host's function, operation for operation;
//  - weights are integers (probability relative to the top, in 2^-63 units) and
//    every sum of them is exact (128-bit), so summation order does not matter;
//  - candidates are ordered by a unique 64-bit key (logit, then lower id first),
//    and each cut (k-th key, nucleus boundary, drawn token) is found by a radix
//    descent over that key: eight 8-bit digits, counting or summing per bucket.
// Candidates with e^x > 0 (x >= -44) are first compacted into `items` (vocab
// entries per row); the others weigh nothing and sort below all of them, so no
// cut depends on them except the host's "last of the pool" fallback, handled
// over the whole row. Rows and items are read through L2 (__ldcg): in the
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
    uint32_t reserved;
};
static_assert(sizeof(SampleRow) == 64, "SampleRow layout is shared with Rust");

struct SampleItem {
    uint64_t key;
    double p;
};

struct U128 {
    uint64_t lo, hi;
};

__device__ __forceinline__ U128 u128_add(U128 a, U128 b) {
    U128 r;
    r.lo = a.lo + b.lo;
    r.hi = a.hi + b.hi + (r.lo < a.lo ? 1ull : 0ull);
    return r;
}

__device__ __forceinline__ bool u128_gt(U128 a, U128 b) {
    return a.hi > b.hi || (a.hi == b.hi && a.lo > b.lo);
}

// Round to nearest even, as Rust's `u128 as f64`.
__device__ __forceinline__ double u128_to_f64(U128 v) {
    if (v.hi == 0) return __ull2double_rn(v.lo);
    const int s = 64 - __clzll((long long)v.hi);  // significant bits in hi: 1..64
    uint64_t top = s == 64 ? v.hi : (v.hi << (64 - s)) | (v.lo >> s);
    const uint64_t rest = s == 64 ? v.lo : (v.lo << (64 - s));
    top |= rest != 0 ? 1ull : 0ull;  // sticky: 64 bits > 53 + 2, so ties break as on the full value
    return __dmul_rn(__ull2double_rn(top), __longlong_as_double((long long)(1023 + s) << 52));
}

// Truncation toward zero of a finite x >= 0, as Rust's `f64 as u128`.
__device__ __forceinline__ U128 f64_to_u128(double x) {
    const double two64 = 18446744073709551616.0;
    U128 r;
    if (x < two64) {
        r.hi = 0;
        r.lo = __double2ull_rz(x);
    } else {
        r.hi = __double2ull_rz(__dmul_rn(x, 1.0 / two64));
        r.lo = __double2ull_rz(__dsub_rn(x, __dmul_rn(__ull2double_rn(r.hi), two64)));
    }
    return r;
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// crate::sampling::uniform.
__device__ __forceinline__ double uniform(uint64_t seed, uint64_t step) {
    const uint64_t bits = splitmix64(splitmix64(seed) ^ step);
    return __dmul_rn(__ull2double_rn(bits >> 11), 1.0 / 9007199254740992.0);
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

// Candidate::weight: p in 2^-63 units, truncated (NaN weighs nothing, as Rust's saturating cast).
__device__ __forceinline__ uint64_t weight_of(double p) {
    return isnan(p) ? 0ull : __double2ull_rz(__dmul_rn(p, 9223372036854775808.0));
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

// Shared state of one CTA (also laid over the megakernel's vector space).
struct SampleShared {
    uint32_t count[256];
    uint64_t mass_lo[256];
    uint32_t mass_hi[256];
    U128 partial[32];
    uint64_t key_partial[32];
    uint32_t n_items;
    int bucket;
    uint64_t prefix;
    uint32_t above_count;
    U128 above_mass;
    uint32_t result;
};

// The pool a descent walks: keys >= lo_key, and (when use_min_p) p >= min_p,
// and keys > cut (the host's take_while on min_p; 0 = none).
struct Pool {
    uint64_t lo_key;
    uint64_t cut;
    bool use_min_p;
    double min_p;
    __device__ __forceinline__ bool holds(uint64_t key, double p) const {
        return key >= lo_key && (cut == 0 || key > cut) && (!use_min_p || p >= min_p);
    }
};

// Items compacted into scratch.
struct CompactItems {
    const SampleItem* items;
    uint32_t n;
    __device__ __forceinline__ uint32_t size() const { return n; }
    __device__ __forceinline__ bool get(uint32_t i, uint64_t& key, double& p) const {
        key = __ldcg(&items[i].key);
        p = __ldcg(&items[i].p);
        return true;
    }
};

// Every candidate of the row (only keys are needed where this is used).
struct RowItems {
    const float* row;
    uint32_t vocab;
    __device__ __forceinline__ uint32_t size() const { return vocab; }
    __device__ __forceinline__ bool get(uint32_t i, uint64_t& key, double& p) const {
        const float l = __ldcg(row + i);
        key = item_key(l, i);
        p = 0.0;
        return is_candidate(l);
    }
};

// What ends a descent: the k-th key by count, or a condition on the exact mass so far.
enum StopKind { STOP_COUNT, STOP_NUCLEUS, STOP_DRAW };
struct Stop {
    StopKind kind;
    uint32_t k;
    double total;
    double top_p;
    U128 target;
    __device__ __forceinline__ bool met(uint32_t count, U128 mass) const {
        if (kind == STOP_COUNT) return count >= k;
        if (kind == STOP_NUCLEUS) return __ddiv_rn(u128_to_f64(mass), total) >= top_p;
        return u128_gt(mass, target);
    }
};

// THREADS threads run it together; Bar::sync() is their barrier.
template <int THREADS, class Bar>
struct Sampler {
    static __device__ U128 block_sum_u128(U128 v, SampleShared& sh) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            U128 other;
            other.lo = __shfl_xor_sync(0xffffffffu, v.lo, o);
            other.hi = __shfl_xor_sync(0xffffffffu, v.hi, o);
            v = u128_add(v, other);
        }
        Bar::sync();  // partial may still be read from a previous call
        if (lane == 0) sh.partial[warp] = v;
        Bar::sync();
        U128 t = {0, 0};
        for (int w = 0; w < THREADS / 32; w++) t = u128_add(t, sh.partial[w]);
        return t;
    }

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

    // Walks the pool's items from the largest key down and returns (in `*key`) the
    // first at which `stop` is met, counting (and summing weights) over the items
    // up to and including it. False when the whole pool does not meet it.
    template <class Items>
    static __device__ bool descend(const Items& items, Pool pool, Stop stop, SampleShared& sh, uint64_t* key) {
        const bool mass = stop.kind != STOP_COUNT;
        Bar::sync();  // every thread has read the previous descent's result
        if (threadIdx.x == 0) {
            sh.prefix = 0;
            sh.above_count = 0;
            sh.above_mass = U128{0, 0};
        }
        for (int level = 0; level < 8; level++) {
            const int shift = 56 - 8 * level;
            for (int b = threadIdx.x; b < 256; b += THREADS) {
                sh.count[b] = 0;
                sh.mass_lo[b] = 0;
                sh.mass_hi[b] = 0;
            }
            Bar::sync();
            const uint64_t prefix = sh.prefix;
            for (uint32_t i = threadIdx.x; i < items.size(); i += THREADS) {
                uint64_t k;
                double p;
                if (!items.get(i, k, p) || !pool.holds(k, p)) continue;
                if (level > 0 && (k >> (shift + 8)) != (prefix >> (shift + 8))) continue;
                const int b = (int)((k >> shift) & 0xff);
                atomicAdd(&sh.count[b], 1u);
                if (mass) {
                    const uint64_t w = weight_of(p);
                    if (w != 0) {
                        const unsigned long long old = atomicAdd((unsigned long long*)&sh.mass_lo[b], (unsigned long long)w);
                        if (old + w < old) atomicAdd(&sh.mass_hi[b], 1u);
                    }
                }
            }
            Bar::sync();
            if (threadIdx.x == 0) {
                int chosen = -1;
                uint32_t c = sh.above_count;
                U128 m = sh.above_mass;
                for (int b = 255; b >= 0; b--) {
                    const uint32_t c2 = c + sh.count[b];
                    const U128 m2 = u128_add(m, U128{sh.mass_lo[b], sh.mass_hi[b]});
                    if (sh.count[b] != 0 && stop.met(c2, m2)) {
                        chosen = b;
                        break;
                    }
                    c = c2;
                    m = m2;
                }
                sh.bucket = chosen;
                if (chosen >= 0) {
                    sh.prefix |= (uint64_t)chosen << shift;
                    sh.above_count = c;
                    sh.above_mass = m;
                }
            }
            Bar::sync();
            if (sh.bucket < 0) return false;  // only possible at level 0: the pool never meets it
        }
        *key = sh.prefix;
        return true;
    }

    // Sum of the weights of the pool's items.
    template <class Items>
    static __device__ U128 pool_mass(const Items& items, Pool pool, SampleShared& sh) {
        U128 s = {0, 0};
        for (uint32_t i = threadIdx.x; i < items.size(); i += THREADS) {
            uint64_t k;
            double p;
            if (items.get(i, k, p) && pool.holds(k, p)) s = u128_add(s, U128{weight_of(p), 0});
        }
        return block_sum_u128(s, sh);
    }

    // crate::sampling::argmax over the (processed) row: the largest value, the
    // lowest index on ties; NaN never wins and a row without a winner gives 0.
    static __device__ uint32_t row_argmax(const float* row, uint32_t vocab, SampleShared& sh) {
        // Key: value order, then lower index first; 0 = no candidate.
        uint64_t best = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) {
            const float v = __ldcg(row + i);
            if (v > -INFINITY) {
                // + 0.0f turns -0.0 into +0.0: the host's `>` sees them equal (lower index wins).
                const uint64_t k = item_key(__fadd_rn(v, 0.0f), i);
                best = k > best ? k : best;
            }
        }
        best = block_key_reduce<true>(best, sh);
        return best == 0 ? 0u : key_id(best);
    }

    // The no-filter draw: walks candidates in index order (as the host's unsorted
    // pool) and returns the first whose running weight exceeds `target`, or the
    // last candidate. Each thread owns a contiguous stretch of the row.
    static __device__ uint32_t draw_in_index_order(const float* row, uint32_t vocab, float max, double inv_t, U128 target,
                                            SampleShared& sh) {
        const uint32_t per = (vocab + THREADS - 1) / THREADS;
        const uint32_t begin = min(vocab, threadIdx.x * per), end = min(vocab, begin + per);
        auto weight_at = [&](uint32_t i) -> uint64_t {
            const float l = __ldcg(row + i);
            if (!is_candidate(l)) return 0;
            const double x = __dmul_rn(__dsub_rn((double)l, (double)max), inv_t);
            return x < -44.0 ? 0ull : weight_of(portable_exp(x));
        };
        U128 mine = {0, 0};
        for (uint32_t i = begin; i < end; i++) mine = u128_add(mine, U128{weight_at(i), 0});
        // Exclusive prefix over threads: warp scan, then over warp totals.
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        U128 incl = mine;
    #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            U128 other;
            other.lo = __shfl_up_sync(0xffffffffu, incl.lo, o);
            other.hi = __shfl_up_sync(0xffffffffu, incl.hi, o);
            if (lane >= o) incl = u128_add(incl, other);
        }
        Bar::sync();
        if (lane == 31) sh.partial[warp] = incl;
        if (threadIdx.x == 0) sh.result = 0xffffffffu;
        Bar::sync();
        U128 before = {0, 0};
        for (int w = 0; w < warp; w++) before = u128_add(before, sh.partial[w]);
        U128 cum = u128_add(before, U128{incl.lo - mine.lo, incl.hi - mine.hi - (incl.lo < mine.lo ? 1ull : 0ull)});
        if (u128_gt(u128_add(cum, mine), target) && !u128_gt(cum, target)) {
            for (uint32_t i = begin; i < end; i++) {
                cum = u128_add(cum, U128{weight_at(i), 0});
                if (u128_gt(cum, target)) {
                    sh.result = i;
                    break;
                }
            }
        }
        Bar::sync();
        if (sh.result != 0xffffffffu) return sh.result;
        // Never crossed (rounding of the target): the last candidate.
        uint64_t last = 0;
        for (uint32_t i = begin; i < end; i++)
            if (is_candidate(__ldcg(row + i))) last = (uint64_t)i + 1;
        last = block_key_reduce<true>(last, sh);
        return last == 0 ? 0u : (uint32_t)(last - 1);
    }

    // The host sampler's token for a row whose penalties and min_tokens mask are
    // already applied (see the file comment); every thread gets it.
    static __device__ uint32_t pick(const float* row, uint32_t vocab, const SampleRow& r, SampleItem* items, SampleShared& sh) {
        if (r.temperature == 0.0f) {
            return row_argmax(row, vocab, sh);
        }

        // The top logit and the number of candidates.
        uint64_t top = 0, mine = 0;
        for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) {
            const float l = __ldcg(row + i);
            if (is_candidate(l)) {
                mine++;
                const uint64_t k = (uint64_t)order_key(l) << 32;
                top = k > top ? k : top;
            }
        }
        top = block_key_reduce<true>(top, sh);
        const uint64_t n_cand = block_sum_u128(U128{mine, 0}, sh).lo;
        // No candidate, or a +inf one that takes all the mass: the host's argmax.
        if (top == 0 || top == ((uint64_t)order_key(INFINITY) << 32)) {
            return row_argmax(row, vocab, sh);
        }
        const uint32_t top_bits = (uint32_t)(top >> 32);
        const float top_logit = __uint_as_float((top_bits & 0x80000000u) ? (top_bits & 0x7fffffffu) : ~top_bits);
        const double inv_t = __ddiv_rn(1.0, (double)r.temperature);

        const bool top_k = r.top_k > 0 && (uint64_t)r.top_k < n_cand;
        const bool filtered = top_k || r.top_p < 1.0f || r.min_p > 0.0f;
        const double u = uniform(r.seed, r.step);
        if (!filtered) {
            // Pool: every candidate, in index order.
            U128 mine_mass = {0, 0};
            for (uint32_t i = threadIdx.x; i < vocab; i += THREADS) {
                const float l = __ldcg(row + i);
                if (!is_candidate(l)) continue;
                const double x = __dmul_rn(__dsub_rn((double)l, (double)top_logit), inv_t);
                if (!(x < -44.0)) mine_mass = u128_add(mine_mass, U128{weight_of(portable_exp(x)), 0});
            }
            const U128 total = block_sum_u128(mine_mass, sh);
            const U128 target = f64_to_u128(__dmul_rn(u, u128_to_f64(total)));
            return draw_in_index_order(row, vocab, top_logit, inv_t, target, sh);
        }

        // Compact the candidates that can weigh something.
        if (threadIdx.x == 0) sh.n_items = 0;
        Bar::sync();
        for (uint32_t base = 0; base < vocab; base += THREADS) {
            const uint32_t i = base + threadIdx.x;
            bool keep = false;
            SampleItem it;
            if (i < vocab) {
                const float l = __ldcg(row + i);
                if (is_candidate(l)) {
                    const double x = __dmul_rn(__dsub_rn((double)l, (double)top_logit), inv_t);
                    if (!(x < -44.0)) {
                        keep = true;
                        it.key = item_key(l, i);
                        it.p = portable_exp(x);
                    }
                }
            }
            const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
            uint32_t base_slot = 0;
            if ((threadIdx.x & 31) == 0 && ballot) base_slot = atomicAdd(&sh.n_items, (uint32_t)__popc(ballot));
            base_slot = __shfl_sync(0xffffffffu, base_slot, 0);
            if (keep) {
                SampleItem* slot = items + base_slot + __popc(ballot & ((1u << (threadIdx.x & 31)) - 1u));
                __stcg(&slot->key, it.key);
                __stcg(&slot->p, it.p);
            }
        }
        Bar::sync();
        const CompactItems compact{items, sh.n_items};

        // Whether the pool holds only compacted items (else its last key may lie below them).
        bool pool_in_compact = compact.n == n_cand;
        // top-k: the k-th key, when more than k candidates can weigh something.
        Pool pool = {0, 0, false, 0.0};
        if (top_k && (uint64_t)r.top_k < compact.n) {
            uint64_t kth;
            descend(compact, pool, Stop{STOP_COUNT, r.top_k, 0.0, 0.0, {0, 0}}, sh, &kth);
            pool.lo_key = kth;
            pool_in_compact = true;
        }
        const double min_p = (double)r.min_p;
        if (r.top_p < 1.0f) {
            const double total = u128_to_f64(pool_mass(compact, pool, sh));
            uint64_t boundary;
            if (descend(compact, pool, Stop{STOP_NUCLEUS, 0, total, (double)r.top_p, {0, 0}}, sh, &boundary)) {
                pool.lo_key = boundary;
                pool_in_compact = true;
            }
            if (min_p > 0.0) {
                // take_while(p >= min_p) on the sorted nucleus: cut at the largest key below min_p.
                uint64_t below = 0;
                for (uint32_t i = threadIdx.x; i < compact.n; i += THREADS) {
                    const SampleItem it = {__ldcg(&items[i].key), __ldcg(&items[i].p)};
                    if (pool.holds(it.key, it.p) && !(it.p >= min_p)) below = it.key > below ? it.key : below;
                }
                below = block_key_reduce<true>(below, sh);
                // ... keeping at least the first (.max(1)).
                uint64_t first = 0;
                for (uint32_t i = threadIdx.x; i < compact.n; i += THREADS)
                    if (pool.holds(__ldcg(&items[i].key), __ldcg(&items[i].p))) first = max(first, __ldcg(&items[i].key));
                first = block_key_reduce<true>(first, sh);
                if (below == first) pool.lo_key = first;
                else pool.cut = below;
                pool_in_compact = true;
            }
        } else if (min_p > 0.0) {
            pool.use_min_p = true;  // retain(p >= min_p)
            pool.min_p = min_p;
            pool_in_compact = true;
        }

        // The draw over the final pool, most likely first.
        const U128 total = pool_mass(compact, pool, sh);
        const U128 target = f64_to_u128(__dmul_rn(u, u128_to_f64(total)));
        uint64_t chosen;
        if (!descend(compact, pool, Stop{STOP_DRAW, 0, 0.0, 0.0, target}, sh, &chosen)) {
            // Never crossed (rounding of the target): the pool's last, smallest key.
            if (pool_in_compact) {
                uint64_t least = ~0ull;
                for (uint32_t i = threadIdx.x; i < compact.n; i += THREADS) {
                    const SampleItem it = {__ldcg(&items[i].key), __ldcg(&items[i].p)};
                    if (pool.holds(it.key, it.p)) least = it.key < least ? it.key : least;
                }
                chosen = block_key_reduce<false>(least, sh);
            } else {
                // The pool reaches below what was compacted: its last key over the whole row
                // (the k-th under top-k, else the least candidate).
                const uint32_t last = top_k ? r.top_k : (uint32_t)n_cand;
                descend(RowItems{row, vocab}, Pool{0, 0, false, 0.0}, Stop{STOP_COUNT, last, 0.0, 0.0, {0, 0}}, sh, &chosen);
            }
        }
        return key_id(chosen);
    }

};

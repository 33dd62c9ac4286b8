// Logprobs in the token loop: sampling.rs `logprobs` (log-softmax of the raw
// logits at the step's token, and the N = p.logprobs most likely tokens) with
// every SM taking a share, as the race does. After its LM-head tiles, each SM
// works on its own tokens (raw logits, from p.lp_logits): their maximum m, the
// sum of exp(logit - m) in f64, and its N best by item_key (logit, then the
// lower id), found by select_threshold; it writes them to its part of
// p.lp_parts. The last SM to arrive merges the parts once the token is chosen
// (log Z = M + log(sum of part sums x exp(m - M)); the N best of the lists, as
// topk_merge finds them) into step t's record in p.lp_out, which the host link
// forwards beside the token. The sums follow the SMs' tile shares, so log Z
// may differ from the host's in its last f64 bits: a logprob then differs in
// its last f32 bit, or, near 0, by what the f64 sums' roundings can move log Z
// (the host's in-order sum drops up to half an ulp of its running total per
// term: a logprob of ~-1e-11 is known to ~1e-12 there). The ids are the
// host's exactly (rows with a NaN logit aside: the host's list is then not
// ordered either). crates/rocket-core/src/megakernel/logprob_model.rs is a CPU
// model of the parts and the merge.
#pragma once
#include "mk_race.cuh"

namespace mk {

// A part's length word when its SM could not list its tokens (too many
// tiles): the merge scans the whole row itself.
constexpr unsigned long long LP_GIVE_UP = 0xffffffffull;
// A part's words (LP_PART u64 in all).
constexpr int LP_BOUND = 0, LP_LEN = 1, LP_PMAX = 2, LP_SUM = 3, LP_KEYS = 4;

// A token's place among the most likely: its logit, then the lower id (item_key),
// with -0.0 equal to +0.0 as the host's comparisons have it. Every logit but NaN
// has one (never 0): the host lists -inf tokens too when fewer are above.
__device__ __forceinline__ uint64_t lp_key(float l, uint32_t row) { return item_key(__fadd_rn(l, 0.0f), row); }

// Alternatives per step (the host checks the request; the cap keeps every write in its record).
__device__ __forceinline__ uint32_t lp_count(const Params& p) { return (uint32_t)min(max(p.logprobs, 0), LP_MAX); }

// A sum over the consumers in f64, in a fixed order (lanes, then warps)
// through the scalars' 64-bit slots; every consumer gets it.
__device__ __forceinline__ double consumer_sum_f64(double v, const Smem& s) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    uint64_t* red = s.sc()->red64;
    if (lane == 0) red[warp] = (uint64_t)__double_as_longlong(v);
    consumer_sync();
    double sum = 0.0;
    for (int w = 0; w < CONSUMER_WARPS; w++) sum = __dadd_rn(sum, __longlong_as_double((long long)red[w]));
    consumer_sync();  // the slots are free again
    return sum;
}

// The part of the n tokens row_of(0..n) into `part`: every consumer calls it.
// Ends with a consumer barrier.
template <class F, class RowOf>
__device__ void logprob_scan(const Params& p, const Smem& s, RowOf row_of, uint32_t n, unsigned long long* part) {
    const int tid = threadIdx.x;
    SelectShared& ss = *reinterpret_cast<SelectShared*>(s.race_keys());  // the race's shared space is free here
    // The thread's first RACE_CACHED tokens stay in registers (their loads in
    // flight together); the rest (a share past 2,048 tokens) are loaded at each use.
    float cached[RACE_CACHED];
    uint32_t cached_row[RACE_CACHED];
#pragma unroll
    for (int q = 0; q < RACE_CACHED; q++) {
        const uint32_t j = tid + q * CONSUMERS;
        cached_row[q] = j < n ? row_of(j) : 0xffffffffu;
        cached[q] = cached_row[q] < (uint32_t)F::V ? __ldcg(p.lp_logits + cached_row[q]) : -INFINITY;
    }
    // Every token's raw logit and id, each by one consumer thread, the same ones in every call.
    auto each_token = [&](auto&& f) {
#pragma unroll
        for (int q = 0; q < RACE_CACHED; q++)
            if (cached_row[q] < (uint32_t)F::V) f(cached[q], cached_row[q]);
        for (uint32_t j = tid + RACE_CACHED * CONSUMERS; j < n; j += CONSUMERS) {
            const uint32_t row = row_of(j);
            if (row < (uint32_t)F::V) f(__ldcg(p.lp_logits + row), row);
        }
    };
    // The maximum, as f32::max folds it (NaN never wins).
    float m = -INFINITY;
    each_token([&](float l, uint32_t) { m = fmaxf(m, l); });
    m = (float)order_double(consumer_max_u64(double_order((double)m), s));
    // exp(l - m) over the tokens above -inf (they add 0 on the host); a NaN logit makes the sum NaN, as there.
    double sum = 0.0;
    each_token([&](float l, uint32_t) {
        if (l > -INFINITY || isnan(l)) sum = __dadd_rn(sum, exp(__dsub_rn((double)l, (double)m)));
    });
    sum = consumer_sum_f64(sum, s);
    // The N best by lp_key (NaN has none), listed
    // in the part with the N-th best as its bound (0: fewer than N candidates).
    if (tid == 0) {
        ss.len = 0;
        ss.prefix = 0;
    }
    const uint32_t k = lp_count(p);
    const bool cached_all = n <= (uint32_t)(RACE_CACHED * CONSUMERS);
    uint64_t bound_sel = 0;  // the select's threshold (a share past the cache)
    if (k > 0 && cached_all) {
        // Every token cached: each warp takes its N best by N rounds of a warp
        // maximum (keys are unique: the one thread holding it drops it), then
        // the warps' 8N are ranked in shared memory.
        const int warp = tid >> 5, lane = tid & 31;
        uint64_t keys[RACE_CACHED];
#pragma unroll
        for (int q = 0; q < RACE_CACHED; q++)
            keys[q] = cached_row[q] < (uint32_t)F::V && !isnan(cached[q]) ? lp_key(cached[q], cached_row[q]) : 0ull;
        uint64_t* bests = reinterpret_cast<uint64_t*>(ss.counts);  // CONSUMER_WARPS x N keys
        for (uint32_t r = 0; r < k; r++) {
            uint64_t w = 0;
#pragma unroll
            for (int q = 0; q < RACE_CACHED; q++) w = max(w, keys[q]);
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) w = max(w, (uint64_t)__shfl_xor_sync(0xffffffffu, w, o));
#pragma unroll
            for (int q = 0; q < RACE_CACHED; q++)
                if (keys[q] == w) keys[q] = 0;
            if (lane == 0) bests[warp * k + r] = w;
        }
        consumer_sync();
        if (tid < CONSUMER_WARPS * (int)k) {
            const uint64_t mine = bests[tid];
            uint32_t place = 0;
            for (int j = 0; j < CONSUMER_WARPS * (int)k; j++) place += bests[j] > mine;
            if (mine != 0 && place < k) {
                __stcg(part + LP_KEYS + place, (unsigned long long)mine);
                atomicAdd(&ss.len, 1u);
                if (place == k - 1) ss.prefix = mine;
            }
        }
    } else if (k > 0) {
        // A share past the cache: exactly min(N, candidates) keys at or above the threshold.
        auto each = [&](auto&& f) {
            each_token([&](float l, uint32_t row) {
                if (!isnan(l)) f(lp_key(l, row));
            });
        };
        const uint64_t bound = select_threshold(each, k, ss);
        each([&](uint64_t key) {
            if (key >= bound) {
                const uint32_t slot = atomicAdd(&ss.len, 1u);
                if (slot < (uint32_t)LP_MAX) __stcg(part + LP_KEYS + slot, (unsigned long long)key);
            }
        });
        bound_sel = bound;
    }
    consumer_sync();
    if (tid == 0) {
        const uint32_t len = ss.len;
        __stcg(part + LP_BOUND, (unsigned long long)(cached_all ? ss.prefix : bound_sel));
        __stcg(part + LP_LEN, len <= (uint32_t)LP_MAX ? (unsigned long long)len : LP_GIVE_UP);
        __stcg(part + LP_PMAX, (unsigned long long)__double_as_longlong((double)m));
        __stcg(part + LP_SUM, (unsigned long long)__double_as_longlong(sum));
    }
    consumer_sync();
}

// This SM's part, after its last LM-head tile: `list` holds its tiles' indices
// (valid when `listed`), n = tiles x tile_rows (rows past the vocabulary are
// skipped). Ends with a consumer barrier.
template <class F>
__device__ __noinline__ void logprob_part(const Params& p, const Smem& s, const uint32_t* list, uint32_t n, bool listed, int tile_rows) {
    unsigned long long* part = p.lp_parts + (size_t)blockIdx.x * LP_PART;
    consumer_sync();  // thread 0 recorded the last tile after the loop's last barrier
    if (!listed) {
        if (threadIdx.x == 0) __stcg(part + LP_LEN, LP_GIVE_UP);
        consumer_sync();
        return;
    }
    logprob_scan<F>(p, s, [&](uint32_t j) { return list[j / tile_rows] * tile_rows + j % tile_rows; }, n, part);
}

// The N best keys of parts [first, first + count) into ts.sorted (most likely
// first); returns how many there are (N, or fewer if the parts hold fewer; 0
// for N = 0), or -1 when a part gave up. Every consumer calls it and gets the count.
__device__ int logprob_best(const Params& p, const Smem& s, int first, int count, uint32_t k) {
    const int tid = threadIdx.x;
    SampleShared& sh = *reinterpret_cast<SampleShared*>(s.vec());
    TopkShared& ts = *reinterpret_cast<TopkShared*>(s.race_keys());
    // Two lower bounds of the N-th best key: the highest of the parts' bounds
    // (that SM has N keys at or above it) and the N-th largest of their best keys.
    uint64_t bound = 0, bad = 0;
    for (int i = tid; i < count; i += CONSUMERS) {
        const unsigned long long* part = p.lp_parts + (size_t)(first + i) * LP_PART;
        // Every word at once (one round trip); slots past the length are stale.
        const uint64_t len = __ldcg(part + LP_LEN), b = __ldcg(part + LP_BOUND);
        uint64_t slot[LP_MAX];
#pragma unroll
        for (int j = 0; j < LP_MAX; j++) slot[j] = __ldcg(part + LP_KEYS + j);
        uint64_t top = 0;
        if (len > (uint64_t)LP_MAX) {
            bad = 1;
            ts.lens[i] = 0;
        } else {
            bound = max(bound, b);
            ts.lens[i] = (uint32_t)len;
#pragma unroll
            for (int j = 0; j < LP_MAX; j++)
                if ((uint64_t)j < len) top = max(top, slot[j]);
        }
        ts.tops[i] = top;
    }
    if (tid == 0) {
        ts.n_cand = 0;
        ts.top_bound = 0;
        ts.sel.len = 0;
    }
    bound = ConsumerSampler::block_key_reduce<true>(bound, sh);  // (its barriers publish lens, tops and the zeros)
    if (ConsumerSampler::block_key_reduce<true>(bad, sh) != 0) return -1;
    for (int i = tid; i < count; i += CONSUMERS) {
        const uint64_t mine = ts.tops[i];
        uint32_t rank = 0;
        for (int j = 0; j < count; j++) rank += ts.tops[j] > mine;
        if (rank + 1 == k) ts.top_bound = mine;  // equal ranks only among parts with no key (0)
    }
    consumer_sync();
    bound = max(bound, ts.top_bound);
    auto each = [&](auto&& f) {
        for (int idx = tid; idx < count * LP_MAX; idx += CONSUMERS) {
            if ((uint32_t)(idx % LP_MAX) >= ts.lens[idx / LP_MAX]) continue;
            const uint64_t key = __ldcg(p.lp_parts + (size_t)(first + idx / LP_MAX) * LP_PART + LP_KEYS + idx % LP_MAX);
            if (key >= bound) f(key);
        }
    };
    uint64_t* cand = reinterpret_cast<uint64_t*>(ts.sel.counts);
    each([&](uint64_t key) {
        const uint32_t slot = atomicAdd(&ts.n_cand, 1u);
        if (slot < (uint32_t)TOPK_RANKED) cand[slot] = key;
    });
    consumer_sync();
    uint32_t n = ts.n_cand;
    if (n > (uint32_t)TOPK_RANKED) {
        // Too many to rank here: exactly min(N, entries) keys at or above the threshold.
        const uint64_t thr = select_threshold(each, k, ts.sel);
        each([&](uint64_t key) {
            if (key >= thr) {
                const uint32_t slot = atomicAdd(&ts.sel.len, 1u);
                if (slot < (uint32_t)RACE_TOPK_MAX) ts.surv[slot] = key;
            }
        });
        consumer_sync();
        n = ts.sel.len;
        if (n > k) return -1;
        cand = ts.surv;
    }
    // Most likely first: a key's place is the number of larger ones (keys are unique).
    const uint32_t kk = min(n, k);
    if (tid < (int)n) {
        const uint64_t mine = cand[tid];
        uint32_t place = 0;
        for (uint32_t j = 0; j < n; j++) place += cand[j] > mine;
        if (place < kk) ts.sorted[place] = mine;
    }
    consumer_sync();
    return (int)kk;
}

// The merge's fallback (an SM's tiles overflowed its list): the merging SM's
// own part over the whole row, by plain strided loops (the N best by N rounds
// of a block maximum below the last one found). Slow, and kept apart from the
// common path so that its loops do not weigh on its registers.
template <class F>
__device__ __noinline__ void logprob_whole_row(const Params& p, const Smem& s, uint32_t k, unsigned long long* part) {
    const int tid = threadIdx.x;
    SampleShared& sh = *reinterpret_cast<SampleShared*>(s.vec());
    float m = -INFINITY;
    for (int i = tid; i < F::V; i += CONSUMERS) m = fmaxf(m, __ldcg(p.lp_logits + i));
    m = (float)order_double(consumer_max_u64(double_order((double)m), s));
    double sum = 0.0;
    for (int i = tid; i < F::V; i += CONSUMERS) {
        const float l = __ldcg(p.lp_logits + i);
        if (l > -INFINITY || isnan(l)) sum = __dadd_rn(sum, exp(__dsub_rn((double)l, (double)m)));
    }
    sum = consumer_sum_f64(sum, s);
    uint64_t below = ~0ull;  // the last key found: the next is the largest under it
    uint32_t len = 0;
    for (uint32_t r = 0; r < k; r++) {
        uint64_t best = 0;
        for (int i = tid; i < F::V; i += CONSUMERS) {
            const float l = __ldcg(p.lp_logits + i);
            const uint64_t key = isnan(l) ? 0ull : lp_key(l, (uint32_t)i);
            if (key < below) best = max(best, key);
        }
        best = ConsumerSampler::block_key_reduce<true>(best, sh);
        if (best == 0) break;  // (uniform) no token left
        if (tid == 0) __stcg(part + LP_KEYS + r, (unsigned long long)best);
        below = best;
        len++;
    }
    if (tid == 0) {
        __stcg(part + LP_BOUND, (unsigned long long)(len == k ? below : 0ull));
        __stcg(part + LP_LEN, (unsigned long long)len);
        __stcg(part + LP_PMAX, (unsigned long long)__double_as_longlong((double)m));
        __stcg(part + LP_SUM, (unsigned long long)__double_as_longlong(sum));
    }
    consumer_sync();
}

// Step t's record (the last SM, once `token` is chosen), into lp_out[t]: the
// token's logprob, then (id, logprob) of the N best, most likely first, ids
// past those the row has set to 0xffffffff. Every consumer calls it.
template <class F>
__device__ __noinline__ void logprob_merge(const Params& p, const Smem& s, int t, uint32_t token) {
    const int tid = threadIdx.x;
    const uint32_t k = lp_count(p);
    TopkShared& ts = *reinterpret_cast<TopkShared*>(s.race_keys());
    const float chosen = tid == 0 ? __ldcg(p.lp_logits + token) : 0.0f;  // raw: sample_token may have penalised p.logits
    consumer_sync();  // the race's merge is done with the shared space
    int first = 0, count = p.lm_tiles;
    int kk = count <= TOPK_MAX_SMS ? logprob_best(p, s, first, count, k) : -1;
    if (kk < 0) {
        // A part could not be made or merged: this SM scans the whole row into its own part.
        first = blockIdx.x;
        count = 1;
        logprob_whole_row<F>(p, s, k, p.lp_parts + (size_t)first * LP_PART);
        kk = max(logprob_best(p, s, first, count, k), 0);  // (a whole row's part never gives up)
    }
    // log Z from the parts: the maximum M, then the sum of each part's sum x exp(m - M), in part order.
    uint64_t m_bits = 0;
    for (int i = tid; i < count; i += CONSUMERS) {
        const double mi = __longlong_as_double((long long)__ldcg(p.lp_parts + (size_t)(first + i) * LP_PART + LP_PMAX));
        if (mi > -INFINITY) m_bits = max(m_bits, double_order(mi));
    }
    m_bits = consumer_max_u64(m_bits, s);
    const double big_m = m_bits ? order_double(m_bits) : -INFINITY;
    double z = 0.0;
    for (int i = tid; i < count; i += CONSUMERS) {
        const unsigned long long* part = p.lp_parts + (size_t)(first + i) * LP_PART;
        const double mi = __longlong_as_double((long long)__ldcg(part + LP_PMAX));
        const double si = __longlong_as_double((long long)__ldcg(part + LP_SUM));
        // A part of -inf logits only adds its sum: 0 (or NaN from a NaN logit).
        z = __dadd_rn(z, mi > -INFINITY ? __dmul_rn(si, exp(__dsub_rn(mi, big_m))) : si);
    }
    z = consumer_sum_f64(z, s);
    const double log_z = __dadd_rn(big_m, log(z));
    uint32_t* rec = p.lp_out + (size_t)t * LP_WORDS;
    if (tid == 0) __stcg(rec, __float_as_uint((float)__dsub_rn((double)chosen, log_z)));
    if (tid < (int)k) {
        const bool has = tid < kk;
        const uint64_t key = has ? ts.sorted[tid] : 0ull;
        __stcg(rec + 1 + 2 * tid, has ? key_id(key) : 0xffffffffu);
        __stcg(rec + 2 + 2 * tid, has ? __float_as_uint((float)__dsub_rn((double)key_logit(key), log_z)) : 0u);
    }
    consumer_sync();  // thread 0's release of the step publishes the record
}

}  // namespace mk

// Logprobs in the token loop: sampling.rs `logprobs` (log-softmax of the raw
// logits at the step's token, and the N = p.logprobs most likely tokens) with
// every SM taking a share, as the race does. After its LM-head tiles, each SM
// works on its own tokens (raw logits, lp_raw): their maximum m, the sum of
// exp(logit - m) in f64, and its N best by item_key (logit, then the lower id),
// most likely first, into its part (lp_parts_of). The record is kept off the
// token's critical path: once the step is published, the host link's warp
// merges the parts (log Z = M + log(sum of part sums x exp(m - M)); the N best
// by N rounds of a warp maximum over the lists' heads) into step t's record,
// writes it to the host ring before the token and counts the step in
// ST_LP_MERGED. Raw logits and parts alternate between two buffers by step
// parity, so the LM head of step t only waits for step t - 2's record (built
// a step earlier, in the usual case). The sums follow the SMs' tile shares, so
// log Z may differ from the host's in its last f64 bits: a logprob then
// differs in its last f32 bit, or, near 0, by what the f64 sums' roundings can
// move log Z (the host's in-order sum drops up to half an ulp of its running
// total per term: a logprob of ~-1e-11 is known to ~1e-12 there). The ids are
// the host's exactly (rows with a NaN logit aside: the host's list is then not
// ordered either). crates/rocket-core/src/megakernel/logprob_model.rs is a CPU
// model of the parts and the merge.
#pragma once
#include "mk_race.cuh"

namespace mk {

// A part's length word when its SM could not list its tokens (too many
// tiles): the merge scans the whole row itself.
constexpr unsigned long long LP_GIVE_UP = 0xffffffffull;
// A part's words (LP_PART u64 in all).
constexpr int LP_LEN = 0, LP_PMAX = 1, LP_SUM = 2, LP_KEYS = 3;
// Parts per host-link lane in the merge (lane i takes parts i, i + 32, ...).
constexpr int LP_PARTS_PER_LANE = TOPK_MAX_SMS / 32;
static_assert(TOPK_MAX_SMS % 32 == 0 && LP_MAX <= 32, "logprob_record: whole parts per lane; lane r keeps the r-th best");
static_assert(CONSUMER_WARPS * LP_MAX * 2 <= 2048, "logprob_scan: the warps' candidates fit the select's buckets");

// A token's place among the most likely: its logit, then the lower id (item_key),
// with -0.0 equal to +0.0 as the host's comparisons have it. Every logit but NaN
// has one (never 0): the host lists -inf tokens too when fewer are above.
__device__ __forceinline__ uint64_t lp_key(float l, uint32_t row) { return item_key(__fadd_rn(l, 0.0f), row); }

// Alternatives per step (the host checks the request; the cap keeps every write in its record).
__device__ __forceinline__ uint32_t lp_count(const Params& p) { return (uint32_t)min(max(p.logprobs, 0), LP_MAX); }

// Step t's buffers (one of two, by parity): the LM head's raw logits, and the grid's parts.
template <class F>
__device__ __forceinline__ float* lp_raw(const Params& p, int t) { return p.lp_logits + (size_t)(t & 1) * F::V; }
__device__ __forceinline__ unsigned long long* lp_parts_of(const Params& p, int t) {
    return p.lp_parts + (size_t)(t & 1) * gridDim.x * LP_PART;
}

// An f64 sum over a warp's lanes (the xor butterfly: every lane gets the same bits).
__device__ __forceinline__ double warp_sum_f64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A sum over the consumers in f64, in a fixed order (lanes, then warps)
// through the scalars' 64-bit slots; every consumer gets it.
__device__ __forceinline__ double consumer_sum_f64(double v, const Smem& s) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    v = warp_sum_f64(v);
    uint64_t* red = s.sc()->red64;
    if (lane == 0) red[warp] = (uint64_t)__double_as_longlong(v);
    consumer_sync();
    double sum = 0.0;
    for (int w = 0; w < CONSUMER_WARPS; w++) sum = __dadd_rn(sum, __longlong_as_double((long long)red[w]));
    consumer_sync();  // the slots are free again
    return sum;
}

// The part of the n tokens row_of(0..n) of `raw` into `part`: every consumer
// calls it. Ends with a consumer barrier.
template <class F, class RowOf>
__device__ void logprob_scan(const Params& p, const Smem& s, const float* raw, RowOf row_of, uint32_t n, unsigned long long* part) {
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
        cached[q] = cached_row[q] < (uint32_t)F::V ? __ldcg(raw + cached_row[q]) : -INFINITY;
    }
    // Every token's raw logit and id, each by one consumer thread, the same ones in every call.
    auto each_token = [&](auto&& f) {
#pragma unroll
        for (int q = 0; q < RACE_CACHED; q++)
            if (cached_row[q] < (uint32_t)F::V) f(cached[q], cached_row[q]);
        for (uint32_t j = tid + RACE_CACHED * CONSUMERS; j < n; j += CONSUMERS) {
            const uint32_t row = row_of(j);
            if (row < (uint32_t)F::V) f(__ldcg(raw + row), row);
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
    // The N best by lp_key (NaN has none), most likely first: candidates in
    // shared memory, then each one's place among them.
    if (tid == 0) ss.len = 0;
    const uint32_t k = lp_count(p);
    const bool cached_all = n <= (uint32_t)(RACE_CACHED * CONSUMERS);
    uint64_t* cand = reinterpret_cast<uint64_t*>(ss.counts);  // (the select's buckets are free once it returns)
    uint32_t n_cand = 0;
    if (k > 0 && cached_all) {
        // Every token cached: each warp takes its N best by N rounds of a warp
        // maximum (keys are unique: the one thread holding it drops it); the
        // warps' 8N are the candidates (0: a warp ran out).
        const int warp = tid >> 5, lane = tid & 31;
        uint64_t keys[RACE_CACHED];
#pragma unroll
        for (int q = 0; q < RACE_CACHED; q++)
            keys[q] = cached_row[q] < (uint32_t)F::V && !isnan(cached[q]) ? lp_key(cached[q], cached_row[q]) : 0ull;
        for (uint32_t r = 0; r < k; r++) {
            uint64_t w = 0;
#pragma unroll
            for (int q = 0; q < RACE_CACHED; q++) w = max(w, keys[q]);
            w = warp_max_u64(w);
#pragma unroll
            for (int q = 0; q < RACE_CACHED; q++)
                if (keys[q] == w) keys[q] = 0;
            if (lane == 0) cand[warp * k + r] = w;
        }
        n_cand = CONSUMER_WARPS * k;
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
                if (slot < (uint32_t)LP_MAX) cand[slot] = key;
            }
        });
        n_cand = LP_MAX;  // read below as min(ss.len, LP_MAX)
    }
    consumer_sync();
    if (!cached_all) n_cand = min(ss.len, n_cand);
    if (tid < (int)n_cand) {
        // A candidate's place is the number of larger ones (keys are unique; 0 is none).
        const uint64_t mine = cand[tid];
        uint32_t place = 0;
        for (uint32_t j = 0; j < n_cand; j++) place += cand[j] > mine;
        if (mine != 0 && place < k) {
            __stcg(part + LP_KEYS + place, (unsigned long long)mine);
            if (cached_all) atomicAdd(&ss.len, 1u);
        }
    }
    consumer_sync();
    if (tid == 0) {
        const uint32_t len = ss.len;
        __stcg(part + LP_LEN, len <= (uint32_t)LP_MAX ? (unsigned long long)len : LP_GIVE_UP);
        __stcg(part + LP_PMAX, (unsigned long long)__double_as_longlong((double)m));
        __stcg(part + LP_SUM, (unsigned long long)__double_as_longlong(sum));
    }
    consumer_sync();
}

// This SM's part of step t, after its last LM-head tile: `list` holds its
// tiles' indices (valid when `listed`), n = tiles x tile_rows (rows past the
// vocabulary are skipped). Ends with a consumer barrier.
template <class F>
__device__ __noinline__ void logprob_part(const Params& p, const Smem& s, int t, const uint32_t* list, uint32_t n, bool listed, int tile_rows) {
    unsigned long long* part = lp_parts_of(p, t) + (size_t)blockIdx.x * LP_PART;
    consumer_sync();  // thread 0 recorded the last tile after the loop's last barrier
    if (!listed) {
        if (threadIdx.x == 0) __stcg(part + LP_LEN, LP_GIVE_UP);
        consumer_sync();
        return;
    }
    logprob_scan<F>(p, s, lp_raw<F>(p, t), [&](uint32_t j) { return list[j / tile_rows] * tile_rows + j % tile_rows; }, n, part);
}

// The merge's fallback (a part gave up: an SM's tiles overflowed its list):
// the host link's warp over step t's whole row, by plain strided loops (the N
// best by N rounds of a warp maximum below the last one found). Slow (N + 2
// passes over the row by one warp), reachable only when one SM claims over
// 2,048 LM-head tiles. Lane r < the returned count gets the r-th best key.
// Inlined into logprob_record, the host link's own function: its out-values
// stay in registers.
template <class F>
__device__ __forceinline__ int logprob_whole_row(const float* raw, uint32_t k, double& big_m, double& z, uint64_t& my_key) {
    const int lane = threadIdx.x & 31;
    float m = -INFINITY;
    for (int i = lane; i < F::V; i += 32) m = fmaxf(m, __ldcg(raw + i));
    m = (float)order_double(warp_max_u64(double_order((double)m)));
    double sum = 0.0;
    for (int i = lane; i < F::V; i += 32) {
        const float l = __ldcg(raw + i);
        if (l > -INFINITY || isnan(l)) sum = __dadd_rn(sum, exp(__dsub_rn((double)l, (double)m)));
    }
    // One part over the row: its sum is Z's (exp(m - m) = 1; a row of -inf adds its sum alone).
    big_m = (double)m;
    z = warp_sum_f64(sum);
    uint64_t below = ~0ull;  // the last key found: the next is the largest under it
    int kk = 0;
    for (uint32_t r = 0; r < k; r++) {
        uint64_t best = 0;
        for (int i = lane; i < F::V; i += 32) {
            const float l = __ldcg(raw + i);
            const uint64_t key = isnan(l) ? 0ull : lp_key(l, (uint32_t)i);
            if (key < below) best = max(best, key);
        }
        best = warp_max_u64(best);
        if (best == 0) break;  // (uniform) no token left
        if (lane == (int)r) my_key = best;
        below = best;
        kk++;
    }
    return kk;
}

// Step t's record, by the host link's warp once the step is published (every
// lane calls it): the token's logprob, then (id, logprob) of the N best, most
// likely first, ids past those the row has set to 0xffffffff; into lp_out[t]
// (the device's copy) and the host ring at `dst`. The warp's barrier, then lane
// 0's system fence: the token lane 0 writes next reaches the host after them.
template <class F>
__device__ __noinline__ void logprob_record(const Params& p, int t, uint32_t* dst) {
    const int lane = threadIdx.x & 31;
    const uint32_t k = lp_count(p);
    const float* raw = lp_raw<F>(p, t);
    const unsigned long long* parts = lp_parts_of(p, t);
    const int count = p.lm_tiles;
    // Each lane's parts: their lists' heads (0 once a list is used up) and lengths.
    uint64_t head[LP_PARTS_PER_LANE];
    uint32_t pos[LP_PARTS_PER_LANE], len[LP_PARTS_PER_LANE];
    uint64_t m_bits = 0;
    bool give_up = count > TOPK_MAX_SMS;
#pragma unroll
    for (int j = 0; j < LP_PARTS_PER_LANE; j++) {
        const int i = lane + 32 * j;
        head[j] = 0;
        pos[j] = 0;
        len[j] = 0;
        if (i < count) {
            // Every word at once (one round trip); the first key is stale when the list is empty.
            const unsigned long long* part = parts + (size_t)i * LP_PART;
            const uint64_t l = __ldcg(part + LP_LEN), first = __ldcg(part + LP_KEYS);
            const double mi = __longlong_as_double((long long)__ldcg(part + LP_PMAX));
            if (l > (uint64_t)LP_MAX) {
                give_up = true;
            } else {
                len[j] = (uint32_t)l;
                head[j] = l > 0 ? (uint64_t)first : 0ull;
            }
            if (mi > -INFINITY) m_bits = max(m_bits, double_order(mi));
        }
    }
    double big_m, z;
    uint64_t my_key = 0;
    int kk = 0;
    if (__any_sync(0xffffffffu, give_up)) {
        kk = logprob_whole_row<F>(raw, k, big_m, z, my_key);
    } else {
        // log Z from the parts: the maximum M, then each lane's parts' sum x exp(m - M) in order, then the lanes.
        m_bits = warp_max_u64(m_bits);
        big_m = m_bits ? order_double(m_bits) : -INFINITY;
        double zl = 0.0;
#pragma unroll
        for (int j = 0; j < LP_PARTS_PER_LANE; j++) {
            const int i = lane + 32 * j;
            if (i < count) {
                const unsigned long long* part = parts + (size_t)i * LP_PART;
                const double mi = __longlong_as_double((long long)__ldcg(part + LP_PMAX));
                const double si = __longlong_as_double((long long)__ldcg(part + LP_SUM));
                // A part of -inf logits only adds its sum: 0 (or NaN from a NaN logit).
                zl = __dadd_rn(zl, mi > -INFINITY ? __dmul_rn(si, exp(__dsub_rn(mi, big_m))) : si);
            }
        }
        z = warp_sum_f64(zl);
        // The N best: each round takes the largest head (keys are unique: one
        // lane's list holds it) and that list moves on.
        for (uint32_t r = 0; r < k; r++) {
            uint64_t mine = 0;
#pragma unroll
            for (int j = 0; j < LP_PARTS_PER_LANE; j++) mine = max(mine, head[j]);
            const uint64_t w = warp_max_u64(mine);
            if (w == 0) break;  // (uniform) every list is used up
            if (lane == (int)r) my_key = w;
            kk++;
#pragma unroll
            for (int j = 0; j < LP_PARTS_PER_LANE; j++) {
                if (head[j] == w) {
                    pos[j]++;
                    const unsigned long long* part = parts + (size_t)(lane + 32 * j) * LP_PART;
                    head[j] = pos[j] < len[j] ? (uint64_t)__ldcg(part + LP_KEYS + pos[j]) : 0ull;
                }
            }
        }
    }
    const double log_z = __dadd_rn(big_m, log(z));
    uint32_t* rec = p.lp_out + (size_t)t * LP_WORDS;
    if (lane == 0) {
        const float chosen = __ldcg(raw + __ldcg(p.tokens + t));  // raw: sample_token may have penalised p.logits
        const uint32_t w = __float_as_uint((float)__dsub_rn((double)chosen, log_z));
        __stcg(rec, w);
        st_volatile(dst, w);
    }
    if (lane < (int)k) {
        const bool has = lane < kk;
        const uint32_t id = has ? key_id(my_key) : 0xffffffffu;
        const uint32_t v = has ? __float_as_uint((float)__dsub_rn((double)key_logit(my_key), log_z)) : 0u;
        __stcg(rec + 1 + 2 * lane, id);
        __stcg(rec + 2 + 2 * lane, v);
        st_volatile(dst + 1 + 2 * lane, id);
        st_volatile(dst + 2 + 2 * lane, v);
    }
    __syncwarp();
    if (lane == 0) __threadfence_system();  // every lane's words, before lane 0 writes the token
}

}  // namespace mk

// sample_rows: the host sampler on the GPU, one CTA per logits row. Applies the
// row's penalties and min_tokens mask (process_logits) in place, then picks the
// token with sampler.cuh, which explains why it is the host's token bit for bit.
// grid = rows, block = SAMPLE_THREADS.
//
// The host picks each row's kernels (SampleRow.path), so that most rows spread
// their vocabulary over SAMPLE_PARTS CTAs rather than one CTA walking it; every
// kernel skips the rows of the other paths.
// SAMPLE_PATH_LISTS, a top-k of at most SAMPLE_LIST_K at a temperature > 0:
//  - sample_topk_lists, grid = (SAMPLE_PARTS, rows), block = SAMPLE_LIST_THREADS:
//    part p applies the penalties and mask of its slice of the row in place
//    (each token lies in one slice), then lists the item keys of its slice's
//    min(k, candidates) best tokens (a radix select) in lists[row][p][0..k),
//    0 in the slots past them;
//  - sample_topk_rows, grid = rows, block = SAMPLE_THREADS: the pick over the
//    row's SAMPLE_PARTS * SAMPLE_LIST_K listed keys (sampler.cuh ListedRow).
//    Every one of the row's k best is in its slice's list, which is all the
//    pick needs to choose the whole row's token.
// SAMPLE_PATH_BINS, greedy rows and rows without a top-k cut (crate::race's cuts
// are built to be computed in pieces: absolute bins, integer weights, an
// argmax race):
//  - sample_bins_max, grid = (SAMPLE_PARTS, rows): part p applies its slice's
//    penalties and mask and records the slice's argmax key and top logit;
//  - sample_bins_parts, grid = (SAMPLE_PARTS, rows): with the row's maximum M,
//    part p sums its tokens' weights per bin over the RACE_MASS_BINS bins from
//    M's down (every token that weighs anything lies there) and keeps each bin's
//    best race key, and the best key of its tokens below those bins that min-p
//    keeps (only without top-p: a top-p cut is never below them);
//  - sample_bins_rows, grid = rows: the cut from the summed masses (as pick),
//    min-p, and the best key the cut keeps; a greedy row, a row whose maximum
//    is +inf, or one without a candidate takes the argmax as the host does.
// SAMPLE_PATH_WHOLE: the rest (a top-k above SAMPLE_LIST_K), sample_rows.
#include "sampler.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_PARTS 32
#define SAMPLE_LIST_K 64
#define SAMPLE_LIST_THREADS 256
#define SAMPLE_PATH_WHOLE 0
#define SAMPLE_PATH_LISTS 1
#define SAMPLE_PATH_BINS 2
// u64 words per (row, part) of the bins path: mass per bin, best key per bin,
// the best key below the bins, the argmax key, the top logit's order key.
#define SAMPLE_BIN_WORDS (2 * RACE_MASS_BINS + 3)

struct BlockBarrier {
    static __device__ __forceinline__ void sync() { __syncthreads(); }
};

// The slice [lo, hi) of part `part` of a row of `vocab` tokens, for both paths that split rows.
__device__ __forceinline__ void part_slice(uint32_t vocab, uint32_t part, uint32_t& lo, uint32_t& hi) {
    const uint32_t span = (vocab + SAMPLE_PARTS - 1) / SAMPLE_PARTS;
    lo = min(vocab, part * span);
    hi = min(vocab, lo + span);
}

// process_logits' penalties and min_tokens mask on the row's tokens in [lo, hi),
// in place (the whole row: lo = 0, hi = vocab), by THREADS threads. Ends with a
// block barrier.
template <int THREADS>
__device__ __forceinline__ void process_slice(float* row, const SampleRow& r, const uint32_t* __restrict__ penalty_tokens,
                                              const uint32_t* __restrict__ penalty_counts, const uint32_t* __restrict__ mask_ids,
                                              uint32_t lo, uint32_t hi) {
    // The entries are the seen tokens, each once.
    for (uint32_t e = threadIdx.x; e < r.penalty_len; e += THREADS) {
        const uint32_t t = penalty_tokens[r.penalty_off + e];
        if (t >= lo && t < hi) __stcg(row + t, penalised(__ldcg(row + t), r, true, penalty_counts[r.penalty_off + e]));
    }
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < r.mask_len; e += THREADS) {
        const uint32_t t = mask_ids[r.mask_off + e];
        if (t >= lo && t < hi) __stcg(row + t, -INFINITY);
    }
    __syncthreads();
}

ROCKET_KERNEL void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_rows(float* __restrict__ logits, const SampleRow* __restrict__ rows, const uint32_t* __restrict__ penalty_tokens,
                const uint32_t* __restrict__ penalty_counts, const uint32_t* __restrict__ mask_ids,
                SampleItem* __restrict__ scratch, uint32_t* __restrict__ out, int vocab_i) {
    pdl_enter();
    __shared__ SampleShared sh;
    const uint32_t vocab = (uint32_t)vocab_i;
    const SampleRow r = rows[blockIdx.x];
    if (r.path != SAMPLE_PATH_WHOLE) return;
    float* row = logits + (size_t)blockIdx.x * vocab;
    SampleItem* items = scratch + (size_t)blockIdx.x * vocab;

    process_slice<SAMPLE_THREADS>(row, r, penalty_tokens, penalty_counts, mask_ids, 0, vocab);
    const uint32_t t = Sampler<SAMPLE_THREADS, BlockBarrier>::pick(row, vocab, r, items, sh);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

ROCKET_KERNEL void __launch_bounds__(SAMPLE_LIST_THREADS)
    sample_topk_lists(float* __restrict__ logits, const SampleRow* __restrict__ rows, const uint32_t* __restrict__ penalty_tokens,
                      const uint32_t* __restrict__ penalty_counts, const uint32_t* __restrict__ mask_ids,
                      SampleItem* __restrict__ scratch, uint64_t* __restrict__ lists, int vocab_i) {
    pdl_enter();
    using ListSampler = Sampler<SAMPLE_LIST_THREADS, BlockBarrier>;
    __shared__ SampleShared sh;
    const SampleRow r = rows[blockIdx.y];
    if (r.path != SAMPLE_PATH_LISTS) return;
    const uint32_t vocab = (uint32_t)vocab_i, part = blockIdx.x;
    uint32_t lo, hi;
    part_slice(vocab, part, lo, hi);
    float* row = logits + (size_t)blockIdx.y * vocab;
    SampleItem* items = scratch + (size_t)blockIdx.y * vocab + lo;  // this slice's share of the row's scratch
    uint64_t* list = lists + ((size_t)blockIdx.y * SAMPLE_PARTS + part) * SAMPLE_LIST_K;

    process_slice<SAMPLE_LIST_THREADS>(row, r, penalty_tokens, penalty_counts, mask_ids, lo, hi);
    // The slice's candidates' keys, compacted.
    if (threadIdx.x == 0) sh.n_items = 0;
    __syncthreads();
    for (uint32_t base = lo; base < hi; base += SAMPLE_LIST_THREADS) {
        const uint32_t i = base + threadIdx.x;
        const float l = i < hi ? __ldcg(row + i) : -INFINITY;
        const bool keep = is_candidate(l);
        const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
        uint32_t base_slot = 0;
        if ((threadIdx.x & 31) == 0 && ballot) base_slot = atomicAdd(&sh.n_items, (uint32_t)__popc(ballot));
        base_slot = __shfl_sync(0xffffffffu, base_slot, 0);
        if (keep) __stcg(&items[base_slot + __popc(ballot & ((1u << (threadIdx.x & 31)) - 1u))].key, item_key(l, i));
    }
    __syncthreads();
    const uint32_t n = sh.n_items, k = min(r.top_k, (uint32_t)SAMPLE_LIST_K);
    // The k-th best key (the keys are unique): exactly k keys at or above it.
    const uint64_t bound = n > k ? ListSampler::kth_key(CompactItems{items, n}, k, sh) : 0;
    __syncthreads();  // every thread has read kth_key's result from the shared state
    if (threadIdx.x == 0) sh.n_items = 0;
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < n; i += SAMPLE_LIST_THREADS) {
        const uint64_t key = __ldcg(&items[i].key);
        if (key >= bound) __stcg(list + atomicAdd(&sh.n_items, 1u), key);
    }
    __syncthreads();
    for (uint32_t j = sh.n_items + threadIdx.x; j < SAMPLE_LIST_K; j += SAMPLE_LIST_THREADS) __stcg(list + j, 0ull);
}

ROCKET_KERNEL void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_topk_rows(const uint64_t* __restrict__ lists, const SampleRow* __restrict__ rows, SampleItem* __restrict__ scratch,
                     uint32_t* __restrict__ out, int vocab_i) {
    pdl_enter();
    __shared__ SampleShared sh;
    const SampleRow r = rows[blockIdx.x];
    if (r.path != SAMPLE_PATH_LISTS) return;
    const ListedRow listed{lists + (size_t)blockIdx.x * SAMPLE_PARTS * SAMPLE_LIST_K, SAMPLE_PARTS * SAMPLE_LIST_K};
    SampleItem* items = scratch + (size_t)blockIdx.x * (uint32_t)vocab_i;
    const uint32_t t = Sampler<SAMPLE_THREADS, BlockBarrier>::pick_in(listed, r, items, sh);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

ROCKET_KERNEL void __launch_bounds__(SAMPLE_LIST_THREADS)
    sample_bins_max(float* __restrict__ logits, const SampleRow* __restrict__ rows, const uint32_t* __restrict__ penalty_tokens,
                    const uint32_t* __restrict__ penalty_counts, const uint32_t* __restrict__ mask_ids,
                    uint64_t* __restrict__ parts, int vocab_i) {
    pdl_enter();
    using PartSampler = Sampler<SAMPLE_LIST_THREADS, BlockBarrier>;
    __shared__ SampleShared sh;
    const SampleRow r = rows[blockIdx.y];
    if (r.path != SAMPLE_PATH_BINS) return;
    const uint32_t vocab = (uint32_t)vocab_i;
    uint32_t lo, hi;
    part_slice(vocab, blockIdx.x, lo, hi);
    float* row = logits + (size_t)blockIdx.y * vocab;
    process_slice<SAMPLE_LIST_THREADS>(row, r, penalty_tokens, penalty_counts, mask_ids, lo, hi);
    // As pick: the argmax key (-0.0 as +0.0, the lower id first) and the top logit's order.
    uint64_t best = 0, top = 0;
    for (uint32_t i = lo + threadIdx.x; i < hi; i += SAMPLE_LIST_THREADS) {
        const float l = __ldcg(row + i);
        if (is_candidate(l)) {
            best = max(best, item_key(__fadd_rn(l, 0.0f), i));
            top = max(top, (uint64_t)order_key(l) << 32);
        }
    }
    best = PartSampler::block_key_reduce<true>(best, sh);
    top = PartSampler::block_key_reduce<true>(top, sh);
    uint64_t* out = parts + ((size_t)blockIdx.y * SAMPLE_PARTS + blockIdx.x) * SAMPLE_BIN_WORDS;
    if (threadIdx.x == 0) {
        __stcg(out + 2 * RACE_MASS_BINS + 1, best);
        __stcg(out + 2 * RACE_MASS_BINS + 2, top);
    }
}

// The row's top logit's order key over its parts (0: no candidate).
__device__ __forceinline__ uint64_t bins_row_top(const uint64_t* row_parts, int word) {
    uint64_t t = 0;
    for (int p = 0; p < SAMPLE_PARTS; p++) t = max(t, __ldcg(row_parts + (size_t)p * SAMPLE_BIN_WORDS + word));
    return t;
}

ROCKET_KERNEL void __launch_bounds__(SAMPLE_LIST_THREADS)
    sample_bins_parts(const float* __restrict__ logits, const SampleRow* __restrict__ rows, uint64_t* __restrict__ parts, int vocab_i) {
    pdl_enter();
    __shared__ unsigned long long mass[RACE_MASS_BINS], best[RACE_MASS_BINS], below;
    const SampleRow r = rows[blockIdx.y];
    if (r.path != SAMPLE_PATH_BINS) return;
    const uint32_t vocab = (uint32_t)vocab_i;
    uint32_t lo, hi;
    part_slice(vocab, blockIdx.x, lo, hi);
    const uint64_t* row_parts = parts + (size_t)blockIdx.y * SAMPLE_PARTS * SAMPLE_BIN_WORDS;
    const uint64_t top = bins_row_top(row_parts, 2 * RACE_MASS_BINS + 2);
    // Greedy, no candidate, or a +inf one that takes all the mass: sample_bins_rows takes the argmax.
    if (r.temperature == 0.0f || top == 0 || top == ((uint64_t)order_key(INFINITY) << 32)) return;
    const float* row = logits + (size_t)blockIdx.y * vocab;
    const double inv_t = __ddiv_rn(1.0, (double)r.temperature);
    const double m = race_scaled(key_logit(top), inv_t);
    const double a = race_anchor(m);
    const long long top_bin = race_bin(m);
    const uint64_t hash = step_hash(r.seed, r.step);
    const bool top_p = r.top_p < 1.0f;
    // Below the bins, only min-p (or nothing) can keep a token, never a top-p cut.
    const long long low_cut = top_p ? LLONG_MAX : (r.min_p > 0.0f ? race_min_p_bin(m, r.min_p) : LLONG_MIN);
    for (int b = threadIdx.x; b < RACE_MASS_BINS; b += SAMPLE_LIST_THREADS) mass[b] = best[b] = 0;
    if (threadIdx.x == 0) below = 0;
    __syncthreads();
    for (uint32_t i = lo + threadIdx.x; i < hi; i += SAMPLE_LIST_THREADS) {
        const float l = __ldcg(row + i);
        if (!is_candidate(l)) continue;
        const double sc = race_scaled(l, inv_t);
        if (race_hopeless(sc, m)) continue;  // it weighs 0 and cannot win
        const long long b = race_bin(sc);
        const unsigned long long key = race_key(sc, i, hash);
        if (b > top_bin - RACE_MASS_BINS) {
            const int idx = (int)(top_bin - b);
            if (top_p) {
                const uint64_t w = race_weight(sc, a);
                if (w != 0) atomicAdd(&mass[idx], (unsigned long long)w);
            }
            atomicMax(&best[idx], key);
        } else if (b >= low_cut) {
            atomicMax(&below, key);
        }
    }
    __syncthreads();
    uint64_t* out = parts + ((size_t)blockIdx.y * SAMPLE_PARTS + blockIdx.x) * SAMPLE_BIN_WORDS;
    for (int b = threadIdx.x; b < RACE_MASS_BINS; b += SAMPLE_LIST_THREADS) {
        __stcg(out + b, mass[b]);
        __stcg(out + RACE_MASS_BINS + b, best[b]);
    }
    if (threadIdx.x == 0) __stcg(out + 2 * RACE_MASS_BINS, below);
}

ROCKET_KERNEL void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_bins_rows(const uint64_t* __restrict__ parts, const SampleRow* __restrict__ rows, uint32_t* __restrict__ out) {
    pdl_enter();
    using RowSampler = Sampler<SAMPLE_THREADS, BlockBarrier>;
    __shared__ SampleShared sh;
    const SampleRow r = rows[blockIdx.x];
    if (r.path != SAMPLE_PATH_BINS) return;
    const uint64_t* row_parts = parts + (size_t)blockIdx.x * SAMPLE_PARTS * SAMPLE_BIN_WORDS;
    const uint64_t top = bins_row_top(row_parts, 2 * RACE_MASS_BINS + 2);
    if (r.temperature == 0.0f || top == 0 || top == ((uint64_t)order_key(INFINITY) << 32)) {
        // The host's argmax: the best argmax key of the parts, or 0 with no candidate.
        const uint64_t best = bins_row_top(row_parts, 2 * RACE_MASS_BINS + 1);
        if (threadIdx.x == 0) out[blockIdx.x] = best ? key_id(best) : 0u;
        return;
    }
    const double m = race_scaled(key_logit(top), __ddiv_rn(1.0, (double)r.temperature));
    const long long top_bin = race_bin(m);
    // Each bin's mass and best key over the parts.
    for (int b = threadIdx.x; b < RACE_MASS_BINS; b += SAMPLE_THREADS) {
        unsigned long long w = 0;
        for (int p = 0; p < SAMPLE_PARTS; p++) w += __ldcg(row_parts + (size_t)p * SAMPLE_BIN_WORDS + b);
        sh.mass[b] = w;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        long long cut = r.top_p < 1.0f ? race_top_p_cut(sh.mass, r.top_p, top_bin) : LLONG_MIN;
        if (r.min_p > 0.0f) cut = max(cut, race_min_p_bin(m, r.min_p));
        sh.cut = cut;
    }
    __syncthreads();
    const long long cut = sh.cut;
    uint64_t best = 0;
    for (int i = threadIdx.x; i < SAMPLE_PARTS * (RACE_MASS_BINS + 1); i += SAMPLE_THREADS) {
        const int p = i / (RACE_MASS_BINS + 1), b = i % (RACE_MASS_BINS + 1);
        const uint64_t* part = row_parts + (size_t)p * SAMPLE_BIN_WORDS;
        // Bin b below the top one; b == RACE_MASS_BINS: the part's best key below the bins.
        const bool kept = b == RACE_MASS_BINS || top_bin - b >= cut;
        if (kept) best = max(best, (uint64_t)__ldcg(part + (b == RACE_MASS_BINS ? 2 * RACE_MASS_BINS : RACE_MASS_BINS + b)));
    }
    best = RowSampler::block_key_reduce<true>(best, sh);
    if (threadIdx.x == 0) out[blockIdx.x] = key_id(best);  // the top token is always kept
}

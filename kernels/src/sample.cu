// sample_rows: the host sampler on the GPU, one CTA per logits row. Applies the
// row's penalties and min_tokens mask (process_logits) in place, then picks the
// token with sampler.cuh, which explains why it is the host's token bit for bit.
// grid = rows, block = SAMPLE_THREADS.
//
// Rows that all ask for a top-k of at most SAMPLE_LIST_K (at a temperature > 0)
// go through two kernels instead, so a row's vocabulary is spread over
// SAMPLE_PARTS CTAs rather than walked by one:
//  - sample_topk_lists, grid = (SAMPLE_PARTS, rows), block = SAMPLE_LIST_THREADS:
//    part p applies the penalties and mask of its slice of the row in place
//    (each token lies in one slice), then lists the item keys of its slice's
//    min(k, candidates) best tokens (a radix select) in lists[row][p][0..k),
//    0 in the slots past them;
//  - sample_topk_rows, grid = rows, block = SAMPLE_THREADS: the pick over the
//    row's SAMPLE_PARTS * SAMPLE_LIST_K listed keys (sampler.cuh ListedRow).
//    Every one of the row's k best is in its slice's list, which is all the
//    pick needs to choose the whole row's token.
#include "sampler.cuh"

#define SAMPLE_THREADS 1024
#define SAMPLE_PARTS 32
#define SAMPLE_LIST_K 64
#define SAMPLE_LIST_THREADS 256

struct BlockBarrier {
    static __device__ __forceinline__ void sync() { __syncthreads(); }
};

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
    const uint32_t vocab = (uint32_t)vocab_i, part = blockIdx.x, span = (vocab + SAMPLE_PARTS - 1) / SAMPLE_PARTS;
    const uint32_t lo = min(vocab, part * span), hi = min(vocab, lo + span);
    const SampleRow r = rows[blockIdx.y];
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
    const ListedRow listed{lists + (size_t)blockIdx.x * SAMPLE_PARTS * SAMPLE_LIST_K, SAMPLE_PARTS * SAMPLE_LIST_K};
    SampleItem* items = scratch + (size_t)blockIdx.x * (uint32_t)vocab_i;
    const uint32_t t = Sampler<SAMPLE_THREADS, BlockBarrier>::pick_in(listed, r, items, sh);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

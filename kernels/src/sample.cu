// sample_rows: the host sampler on the GPU, one CTA per logits row. Applies the
// row's penalties and min_tokens mask (process_logits) in place, then picks the
// token with sampler.cuh, which explains why it is the host's token bit for bit.
// grid = rows, block = SAMPLE_THREADS.
#include "sampler.cuh"

#define SAMPLE_THREADS 1024

struct BlockBarrier {
    static __device__ __forceinline__ void sync() { __syncthreads(); }
};

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

    // Penalties (process_logits): the entries are the seen tokens, each once.
    for (uint32_t e = threadIdx.x; e < r.penalty_len; e += SAMPLE_THREADS) {
        const uint32_t t = penalty_tokens[r.penalty_off + e];
        if (t < vocab) __stcg(row + t, penalised(__ldcg(row + t), r, true, penalty_counts[r.penalty_off + e]));
    }
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < r.mask_len; e += SAMPLE_THREADS) {
        const uint32_t t = mask_ids[r.mask_off + e];
        if (t < vocab) __stcg(row + t, -INFINITY);
    }
    __syncthreads();

    const uint32_t t = Sampler<SAMPLE_THREADS, BlockBarrier>::pick(row, vocab, r, items, sh);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

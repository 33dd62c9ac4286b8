// What one megakernel launch is given (built by backend/cuda/megakernel.rs, passed
// by value as the kernel's only parameter), the instruction decoding, and the
// CTA's view of its shared memory. `LayerPtrs`, `Params`, `Instr` and `load_instr`
// are mirrored by crates/rocket-core/src/megakernel/abi.rs, whose tests read them
// here (field names, order, sizes; where each instruction field sits).
#pragma once
#include "common.cuh"
#include "mk_geometry.cuh"
#include "mk_sync.cuh"
#include "sampler.cuh"

namespace mk {

// One layer's weights on the device (abi.rs `LayerPtrs`, same order).
struct LayerPtrs {
    const float* attn_norm;
    const uint16_t* qkv;      // [q_dim + 2 kv_dim][hidden]
    const float* q_norm;      // [head_dim] or null
    const float* k_norm;
    const uint16_t* o;        // [hidden][q_dim]
    const float* mlp_norm;
    const uint16_t* gate_up;  // [2 ff][hidden]: gate rows, then up rows
    const uint16_t* down_t;   // [ff][hidden]: the down-projection transposed (the megakernel's copy)
};

struct Params {
    const uint4* instrs;       // INSTR_WORDS / 4 uint4 per instruction, SM lists back to back
    const uint32_t* sm_start;  // [grid + 1]: where each SM's list starts
    uint32_t* counters;        // zeroed before the launch
    uint32_t* state;           // [STATE_WORDS], zeroed before the launch
    const LayerPtrs* layers;
    const uint16_t* embed;     // [vocab][hidden]
    const uint16_t* lm_head;   // [vocab][hidden] (the embedding when tied)
    const float* final_norm;
    const float* inv_freq;     // [head_dim / 2]
    float* x;                  // [hidden] residual stream
    float* qkv;                // [q_dim + 2 kv_dim]
    unsigned long long* mlp_acc; // [hidden] the MLP's down-projection sums, fixed point (mk::to_fixed); x + these is the residual
    float* logits;             // [vocab]
    float* part_o;             // [heads][splits][head_dim] each split's attention partial
    float* part_ml;            // [heads][splits][2] its (max, sum); O-proj merges them
    float* lm_max;             // [lm_tiles]: each SM's LM-head argmax (one per SM); as double[lm_tiles], its race key
    uint32_t* lm_idx;          // [lm_tiles]
    uint16_t* kv;              // [capacity][layers][k | v][kv_dim] bf16
    const uint32_t* forced;    // step t < n_forced feeds forced[t] next (teacher forcing)
    float* logits_out;         // null, or [max_steps][vocab]: every step's logits
    uint32_t* ring;            // mapped host memory: [0, stop, 0, 0, tokens[max_steps], logprob records[max_steps]]
    const uint32_t* end_ids;   // [n_end]
    unsigned long long* trace; // null, or timestamps of step trace_step (megakernel/profile.rs)
    const SampleRow* sample;   // null: greedy argmax; else the request's sampler (step t: sample->step + t)
    uint32_t* seen_bits;       // [ceil(vocab / 32)] prompt and output tokens (repetition penalty)
    uint32_t* gen_counts;      // [vocab] how often each token was generated (presence/frequency)
    SampleItem* sample_items;  // [vocab] the sampler's candidates
    uint32_t* tokens;          // [max_steps] each step's token on the device (the host link forwards them)
    unsigned long long* race_mass; // [2][RACE_LEVELS][RACE_MASS_BINS] the sampler's weights per anchor and bin, by step
                                   // parity (zeroed during the next step: mk_race.cuh clear_tables)
    unsigned long long* race_keys; // [max(2 * RACE_KEY_BINS, grid * RACE_LIST)] the sampler's best race key per bin, by
                                   // step parity (zeroed alike), or for a top-k each SM's list
    unsigned long long* lp_parts;  // [2][grid][LP_PART] each SM's logprob part, by step parity (mk_logprobs.cuh)
    uint32_t* lp_out;          // null: no logprobs; else [max_steps][LP_WORDS] each step's record (the host link builds and forwards them)
    float* lp_logits;          // [2][vocab] the step's raw logits, by step parity, when lp_out is set
    unsigned long long watchdog_ns;
    int pos0;                  // position of first_token
    uint32_t first_token;
    int max_steps;
    int n_forced;
    int n_end;
    int mask_end_steps;        // steps t < this never pick an end id (min_tokens)
    int lm_tiles;              // the grid's SM count: LM-head arrivals per step
    int splits;
    float eps;
    int trace_step;
    int poll_spin;             // 1: dependency polls spin without __nanosleep (ROCKET_MK_SPIN, an experiment)
    int weights_evict_first;   // 1: weight copies go through L2 as evict-first (ROCKET_MK_EVICT_FIRST)
    int hold_qkv;              // ring chunks a layer's Qkv, OProj and Mlp keep past their release (ROCKET_MK_HOLD)
    int hold_oproj;
    int hold_mlp;
    int counter_stride;        // u32 words from one dependency counter to the next (ROCKET_MK_COUNTER_STRIDE)
    int logprobs;              // alternatives per step in the logprob records (<= LP_MAX; with lp_out)
};

static_assert(sizeof(Params) == 344, "Params is shared with megakernel/abi.rs");

struct Instr {
    uint32_t op, layer, signal, wait, per_step, a, b, c, d;
};

__device__ __forceinline__ Instr load_instr(const Params& p, uint32_t i) {
    const uint4 w0 = __ldg(p.instrs + 2 * i), w1 = __ldg(p.instrs + 2 * i + 1);
    Instr in;
    in.op = w0.x & 0xff;
    in.layer = (w0.x >> 8) & 0xff;
    in.signal = w0.x >> 16;
    in.wait = w0.y & 0xffff;
    in.per_step = w0.y >> 16;
    in.a = w0.z;
    in.b = w0.w;
    in.c = w1.x;
    in.d = w1.y;
    return in;
}

// Dependency counter `ctr` (they sit counter_stride words apart).
__device__ __forceinline__ uint32_t* counter(const Params& p, uint32_t ctr) {
    return p.counters + ctr * (uint32_t)p.counter_stride;
}

// Scalars the consumer warps share (broadcasts, reductions) and the handshake
// with the producer warp.
struct Scalars {
    uint64_t red64[CONSUMER_WARPS];  // per-warp partials of a 64-bit maximum (mk_race.cuh consumer_max_u64)
    float red[CONSUMER_WARPS];
    uint32_t red_idx[CONSUMER_WARPS];
    uint32_t ok[2];      // wait_counter's verdict, broadcast by thread 0: [0] for the step
                         // start, [1] for instructions (the two calls follow each other
                         // with no barrier between, so they must not share a slot)
    uint32_t flag;       // "this CTA arrived last", broadcast by thread 0
    uint32_t lp_free;    // the LM head's logprob buffers may be written (thread 0's wait for the host link)
    uint32_t next;       // the sampler's next token
    uint32_t consumed;   // chunks the consumers took, published when they leave
    uint32_t done;       // consumers have left: the producer stops issuing and drains
    uint32_t tags[SLOTS];  // per ring slot: the claimed tile its chunk belongs to, or TAG_END
};

// The CTA's dynamic shared memory. Every view of it below starts from this
// symbol, so the compiler always knows the accesses are to shared memory (LDS,
// STS). Views held in pointer fields lost that once a loop grew past its
// inference, and the ring's reads became generic loads.
extern __shared__ __align__(128) uint8_t mk_smem[];

struct Smem {
    __device__ __forceinline__ uint8_t* ring() const { return mk_smem; }
    __device__ __forceinline__ uint64_t* full() const { return reinterpret_cast<uint64_t*>(mk_smem + SMEM_BARRIERS); }
    __device__ __forceinline__ uint64_t* empty() const { return full() + SLOTS; }
    __device__ __forceinline__ float* vec() const { return reinterpret_cast<float*>(mk_smem + SMEM_VEC); }
    __device__ __forceinline__ float* part() const { return reinterpret_cast<float*>(mk_smem + SMEM_PART); }
    __device__ __forceinline__ Scalars* sc() const { return reinterpret_cast<Scalars*>(mk_smem + SMEM_SCALARS); }
    __device__ __forceinline__ unsigned long long* race_keys() const { return reinterpret_cast<unsigned long long*>(mk_smem + SMEM_RACE); }
    __device__ __forceinline__ unsigned long long* race_mass() const { return race_keys() + RACE_KEY_BINS; }
};

static_assert(sizeof(Scalars) <= SMEM_SCALAR_WORDS * 4, "scalars fit their shared-memory space");

// Sum over the consumer threads; every consumer gets it (fixed order: deterministic).
__device__ __forceinline__ float consumer_sum(float v, Scalars* sc) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    v = warp_sum(v);
    if (lane == 0) sc->red[warp] = v;
    consumer_sync();
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < CONSUMER_WARPS; w++) t += sc->red[w];
    consumer_sync();
    return t;
}

// (value, index) with the larger value, the lower index on ties; NaN never wins.
__device__ __forceinline__ void better(float& v, uint32_t& i, float ov, uint32_t oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// Argmax over the consumer threads' candidates; every consumer gets it.
__device__ __forceinline__ void consumer_argmax(float& v, uint32_t& i, Scalars* sc) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const uint32_t oi = __shfl_xor_sync(0xffffffffu, i, o);
        better(v, i, ov, oi);
    }
    if (lane == 0) {
        sc->red[warp] = v;
        sc->red_idx[warp] = i;
    }
    consumer_sync();
    v = -INFINITY;
    i = 0xffffffffu;
#pragma unroll
    for (int w = 0; w < CONSUMER_WARPS; w++) better(v, i, sc->red[w], sc->red_idx[w]);
    consumer_sync();
}

}  // namespace mk

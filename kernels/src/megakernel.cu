// The persistent decode megakernel: one launch runs the whole token loop.
// grid = the schedule's SM count (one CTA per SM, co-resident: launched
// cooperatively), block = THREADS (8 consumer warps, 1 producer warp, 1 warp for
// the host link),
// dynamic shared memory = SMEM_BYTES. One instantiation per fuel, its shapes
// compile-time constants; the schedule (megakernel/schedule.rs) says what each
// CTA does. Per step t, every CTA waits for the step's input embedding (counter 0
// reaching t + 1), then runs its instruction list, each instruction waiting until
// its dependency counter reaches (t + 1) * per_step and bumping its own counter
// when done. The last CTA to finish its LM-head tiles picks the token (argmax,
// end ids masked for min_tokens), publishes it (warp 9 of CTA 0 forwards it to the host ring), checks end ids,
// max_steps and the host's stop flag, embeds the next input and releases step
// t + 1 (or sets STOP_BIT). Meanwhile the producer warp streams the weights of
// the CTA's instructions, step after step, through the shared-memory ring.
// A wait longer than watchdog_ns aborts the run with the details in `state`.
#include "common.cuh"
#include "mk_attention.cuh"
#include "mk_geometry.cuh"
#include "mk_matvec.cuh"
#include "mk_params.cuh"
#include "mk_sync.cuh"
#include "mk_logprobs.cuh"
#include "mk_race.cuh"
#include "sampler.cuh"

namespace mk {

template <int D_, int FF_, int NL_, int HQ_, int HKV_, int HD_, int V_>
struct Fuel {
    static constexpr int D = D_, FF = FF_, NL = NL_, HQ = HQ_, HKV = HKV_, HD = HD_, V = V_;
    static constexpr int QD = HQ * HD, KVD = HKV * HD, G = HQ / HKV;
    static_assert(HQ % HKV == 0 && G <= MAX_GROUP && (HD == 64 || HD == 128) && D <= VEC_CAP, "fuel shapes");
};

constexpr int POLLS_PER_CHECK = 16;

// Thread 0's poll of a word until it reaches `target`: false when the run
// aborted meanwhile or this wait outlived watchdog_ns (it then aborts the run,
// the details in `state`, `instr` naming the site); `v` is the last value read.
__device__ __forceinline__ bool poll_until(const Params& p, const uint32_t* c, uint32_t target, uint32_t instr, int t, uint32_t& v) {
    v = ld_acquire(c);
    if (v >= target) return true;
    const uint64_t start = globaltimer_ns();
    const uint64_t limit = p.watchdog_ns;
    const bool spin = p.poll_spin != 0;
    for (uint32_t polls = 1;; polls++) {
        if (polls % POLLS_PER_CHECK == 0) {
            if (ld_volatile(p.state + ST_ABORT)) return false;
            if (globaltimer_ns() - start > limit) {
                if (atomicCAS(p.state + ST_ERROR, 0u, 1u) == 0u) {
                    p.state[ST_ERR_SM] = blockIdx.x;
                    p.state[ST_ERR_INSTR] = instr;
                    p.state[ST_ERR_STEP] = t;
                    p.state[ST_ERR_VALUE] = v;
                    p.state[ST_ERR_TARGET] = target;
                }
                __threadfence();
                st_volatile(p.state + ST_ABORT, 1);
                return false;
            }
        }
        if (!spin) __nanosleep(32);
        v = ld_acquire(c);
        if (v >= target) return true;
    }
}

// Thread 0 waits until counters[ctr] >= target (or the run stops or aborts),
// then the consumers learn the verdict together. `instr` names the instruction
// for the watchdog's report (0xffffffff: the step start); `slot` is 0 for the
// step start and 1 for instructions (see Scalars::ok). Each poll is an acquire
// load (it also invalidates L1, which holds nothing other SMs write: those reads
// go through L2), so success needs no fence; the barrier after it orders every
// consumer's reads. The abort flag and the clock are read every POLLS_PER_CHECK
// polls only: each is another L2 round trip on the hand-off's critical path.
__device__ __forceinline__ bool wait_counter(const Params& p, const Smem& s, uint32_t ctr, uint32_t target, uint32_t instr,
                                             int t, int slot) {
    if (threadIdx.x == 0) {
        uint32_t v;
        uint32_t ok = poll_until(p, counter(p, ctr), target, instr, t, v);
        if (v & STOP_BIT) ok = 0;
        s.sc()->ok[slot] = ok;
    }
    consumer_sync();
    return s.sc()->ok[slot] != 0;
}

// The barrier orders every consumer's writes before thread 0's release, which
// (being cumulative) publishes them all with the count.
__device__ __forceinline__ void signal(const Params& p, uint32_t ctr) {
    consumer_sync();
    if (threadIdx.x == 0) red_release_add(counter(p, ctr), 1);
}

// The step's input as the residual stream: x = its embedding, no MLP sums.
template <int D>
__device__ __forceinline__ void embed_row(const Params& p, uint32_t token) {
    const uint16_t* src = p.embed + (size_t)token * D;
    for (int i = threadIdx.x; i < D; i += CONSUMERS) {
        __stcg(p.x + i, bf16_to_f32(__ldg(src + i)));
        __stcg(p.mlp_acc + i, 0ull);
    }
}

// Step t's token by the request's sampler (p.sample): the penalties and the
// min_tokens mask on the whole logits row, then sampler.cuh over the consumer
// threads (the host sampler's token bit for bit). Every consumer gets the token.
template <class F>
__device__ __noinline__ uint32_t sample_token(const Params& p, const Smem& s, int t) {
    const int tid = threadIdx.x;
    SampleRow r = *p.sample;
    r.step += (uint64_t)t;
    float* row = p.logits;
    if (has_penalties(r)) {
        for (int i = tid; i < F::V; i += CONSUMERS) {
            const bool seen = (__ldcg(p.seen_bits + (i >> 5)) >> (i & 31)) & 1u;
            const uint32_t count = __ldcg(p.gen_counts + i);
            if (seen || count) __stcg(row + i, penalised(__ldcg(row + i), r, seen, count));
        }
        consumer_sync();
    }
    if (t < p.mask_end_steps) {
        for (int e = tid; e < p.n_end; e += CONSUMERS) {
            const uint32_t id = __ldg(p.end_ids + e);
            if (id < (uint32_t)F::V) __stcg(row + id, -INFINITY);  // the host skips ids past the vocabulary too
        }
        consumer_sync();
    }
    SampleShared& sh = *reinterpret_cast<SampleShared*>(s.vec());
    return ConsumerSampler::pick(row, F::V, r, p.sample_items, sh);
}

// The chosen token counts for the penalties of the steps after it. The last
// LM-head CTA alone writes these; the step counter's release publishes them.
__device__ __forceinline__ void count_token(const Params& p, int t, uint32_t token) {
    if (threadIdx.x == 0 && p.sample != nullptr && has_penalties(*p.sample) && t >= p.n_forced) {
        __stcg(p.gen_counts + token, __ldcg(p.gen_counts + token) + 1);
        __stcg(p.seen_bits + (token >> 5), __ldcg(p.seen_bits + (token >> 5)) | (1u << (token & 31)));
    }
}

// The last LM-head CTA of step t: the token, the next input, the step's release.
// `host_stop` is the host's stop flag (its device copy) as thread 0 read it when
// the CTA's LM head began.
template <class F>
__device__ __noinline__ void pick_token(const Params& p, const Smem& s, int t, uint32_t host_stop) {
    const int tid = threadIdx.x;
    uint32_t token;
    const RaceMode mode = race_mode<F>(p);
    if (p.sample != nullptr) {
        // The SMs' race parts, merged; sample_token where the merge cannot decide.
        token = mode != RACE_NONE ? race_merge<F>(p, s, t) : 0xffffffffu;
        if (token == 0xffffffffu) {
            token = sample_token<F>(p, s, t);
            if (tid == 0) atomicAdd(p.state + ST_ONE_CTA, 1u);  // the tests check which steps the SMs' merge decided
        }
        count_token(p, t, token);
    } else {
        // Thread 0's acquire-release arrival and the barrier after it order these reads.
        float v = -INFINITY;
        uint32_t idx = 0xffffffffu;
        for (int i = tid; i < p.lm_tiles; i += CONSUMERS) better(v, idx, __ldcg(p.lm_max + i), __ldcg(p.lm_idx + i));
        consumer_argmax(v, idx, s.sc());
        token = idx == 0xffffffffu ? 0u : idx;  // all NaN or masked: index 0, as the host
    }
    if (tid == 0) {
        const bool free_running = t >= p.n_forced;
        const bool stop = t + 1 >= p.max_steps || host_stop != 0 || (free_running && is_end(p, token));
        __stcg(p.tokens + t, token);  // published with ST_STEPS below; the host link forwards it
        s.sc()->next = stop ? 0xffffffffu : (free_running ? token : __ldg(p.forced + t));
    }
    consumer_sync();
    const uint32_t next = s.sc()->next;
    if (next != 0xffffffffu) embed_row<F::D>(p, next);
    consumer_sync();
    if (tid == 0) {
        st_release(p.state + ST_STEPS, (uint32_t)(t + 1));
        st_release(counter(p, STEP_COUNTER), next == 0xffffffffu ? STOP_BIT : (uint32_t)(t + 2));
    }
}

// The LM head: every SM multiplies the tiles of in.a vocabulary rows its
// producer claims (WeightStream: tiles go to whichever SMs' streams are ready
// first, so an SM that gets less of the memory system's bandwidth takes fewer and
// the op ends with its bytes, not with its slowest SM) until an end marker. Each
// tile's logits are stored as it finishes; the SM's argmax over its tiles goes to
// lm_max/lm_idx[blockIdx.x], and the last SM to arrive picks the token.
template <class F>
__device__ __noinline__ void lm_head(const Params& p, const Smem& s, const Instr& in, int t, uint32_t& chunk) {
    using M = Matvec<F::D>;
    const int tid = threadIdx.x, lane = tid & 31;
    // Traced (megakernel/profile.rs): thread 0 stamps when the SM's tiles are
    // done, when its sampler and logprob parts are, and (the last SM alone) when
    // the token is picked, in the inside words of its LM-head instruction: the
    // last of its list (schedule.rs), found here so the caller's loop keeps no
    // pointer live for it.
    unsigned long long* stamps = p.trace != nullptr && t == p.trace_step && tid == 0
                                     ? p.trace + 3 * __ldg(p.sm_start + gridDim.x) + 2 * gridDim.x + 3 * (__ldg(p.sm_start + blockIdx.x + 1) - 1)
                                     : nullptr;
    // The host link's copy of the stop flag (device memory: a read of the mapped
    // ring itself measured ~130 µs on the H200 machine, and the arrival's fence
    // below waited for it).
    const uint32_t host_stop = tid == 0 ? ld_volatile(p.state + ST_HOST_STOP) : 0u;
    // A sampled request's part of the race (mk_race.cuh); RACE_NONE: the argmax below.
    RacePart race;
    race.begin<F>(p, s, t);
    // Its norm weights load after the wait, unlike the layers' (once per step;
    // passing them in would put them in local memory: lm_head is not inlined).
    float a[M::PER_LANE][8];
    load_norm<F::D>(p.final_norm, a);
    load_input<F::D, Input::NORMED_RESIDUAL>(p, s, nullptr, a, warp_segment<F::D>(tid >> 5));
    // Step t's logprob buffers were step t - 2's: thread 0 waits until the host
    // link has built that record (long done, in the usual case: the wait is one
    // L2 round trip, which delays warp 0's share of the first tile). The first
    // tile's barrier (with no tile, the argmax's or the race's) publishes the
    // verdict. A wait that sees an abort keeps the step from writing the buffers;
    // whatever the step writes after one, the host link forwards no more records.
    const bool logprobs = p.lp_out != nullptr;
    if (logprobs && tid == 0) {
        uint32_t merged;
        s.sc()->lp_free = t < 2 || poll_until(p, p.state + ST_LP_MERGED, (uint32_t)(t - 1), ERR_AT_LOGPROB_MERGE, t, merged);
    }
    float* lp = nullptr;  // step t's raw logits, once the verdict is known
    const int tile_rows = in.a;
    // The sampler reads p.logits (and changes it: penalties); tests keep a copy per step.
    float* kept = p.logits_out ? p.logits_out + (size_t)t * F::V : nullptr;
    const bool masked = t < p.mask_end_steps;
    float best = -INFINITY;
    uint32_t idx = 0xffffffffu;
    for (int n = 0;; n++) {
        wait_chunk(p, s, chunk);
        const uint32_t tile = s.sc()->tags[chunk % SLOTS];
        if (tile == TAG_END) {
            __syncwarp();
            if (lane == 0) mbar_arrive(s.empty() + chunk % SLOTS);
            chunk++;
            break;
        }
        const int begin = (int)tile * tile_rows, rows = min(tile_rows, F::V - begin);
        // Tiles alternate between two halves of the partial sums: one barrier per
        // tile (a thread still storing tile n's logits reads the other half).
        const int first = (n & 1) * tile_rows;
        consume_rows<F::D>(p, s, a, rows, first, chunk, 0xffffffffu);
        consumer_sync();
        if (n == 0 && logprobs && s.sc()->lp_free) lp = lp_raw<F>(p, t);
        race.record_tile(s, tile);
        for (int i = tid; i < rows; i += CONSUMERS) {
            const float v = part_sum<F::D>(s, first + i);
            const uint32_t row = (uint32_t)(begin + i);
            __stcg(p.logits + row, v);
            if (lp != nullptr) __stcg(lp + row, v);  // raw, for the logprobs (the sampler may penalise p.logits)
            if (kept) __stcg(kept + row, v);
            if (race.mode == RACE_NONE && v > -INFINITY && !(masked && is_end(p, row))) {
                // As the host's argmax: -inf and NaN never win (a row of them gives index 0).
                better(best, idx, v, row);
            }
        }
    }
    if (stamps) stamps[0] = globaltimer_ns();
    if (race.mode != RACE_NONE) race.finish<F>(p, s, t, tile_rows);
    else consumer_argmax(best, idx, s.sc());
    if (logprobs && s.sc()->lp_free) logprob_part<F>(p, s, t, race.tile_list(s), race.tokens(tile_rows), race.listed(), tile_rows);
    if (tid == 0) {
        if (race.mode == RACE_NONE) {
            __stcg(p.lm_max + blockIdx.x, best);
            __stcg(p.lm_idx + blockIdx.x, idx);
        }
        if (stamps) stamps[1] = globaltimer_ns();
        const uint32_t arrived = atom_add_acq_rel(counter(p, in.signal), 1) + 1;
        s.sc()->flag = arrived == (uint32_t)(t + 1) * p.lm_tiles;
    }
    consumer_sync();
    if (s.sc()->flag) {
        pick_token<F>(p, s, t, host_stop);
        if (stamps) stamps[2] = globaltimer_ns();
    }
}

// The residual at row in.a + threadIdx.x, loaded before an O-proj instruction's
// matvec so the load is not a round trip of its own after it (tiles have at
// most a few dozen rows; add_to_residual loads any row past CONSUMERS itself).
__device__ __forceinline__ float residual_row(const Params& p, const Instr& in) {
    return (int)threadIdx.x < (int)(in.b - in.a) ? residual(p, in.a + threadIdx.x) : 0.0f;
}

// O-proj: x[rows in.a..in.b] = the residual + the instruction's dot products,
// folding the last MLP's sums into x (`mine` is residual_row's value). Every Qkv
// tile has read them, and the next MLP adds to zero.
template <int K>
__device__ __forceinline__ void add_to_residual(const Params& p, const Smem& s, const Instr& in, float mine) {
    for (int i = threadIdx.x; i < (int)(in.b - in.a); i += CONSUMERS) {
        const int row = in.a + i;
        __stcg(p.x + row, (i < CONSUMERS ? mine : residual(p, row)) + part_sum<K>(s, i));
        __stcg(p.mlp_acc + row, 0ull);
    }
}

// The RMSNorm weights a layer's matrix-vector instruction multiplies its input
// by, or null.
template <class F>
__device__ __forceinline__ const float* norm_weights(const Params& p, const Instr& in) {
    switch (in.op) {
        case OP_QKV: return p.layers[in.layer].attn_norm;
        case OP_MLP: return p.layers[in.layer].mlp_norm;
        default: return nullptr;
    }
}

// A matrix-vector instruction after its wait; `nw` holds load_norm's weights
// for Qkv and Mlp. A layer's instruction holds its last p.hold_* ring
// chunks (`held`) past its release, so that fewer weights stream into this SM
// while it stores and releases its results (none at hold 12); the caller gives
// them back before the next matrix-vector instruction's wait (they stay held
// through an attention instruction: given back before its wait, they were
// measured slower on the H200, the stream refilling during attention).
template <class F>
__device__ __forceinline__ void run_matvec(const Params& p, const Smem& s, const Instr& in, int t, uint32_t& chunk,
                                           float (&nw)[Matvec<F::D>::PER_LANE][8], HeldChunks& held) {
    const int tid = threadIdx.x;
    const int n = in.b - in.a;
    switch (in.op) {
        case OP_QKV:
            held.from = held_from(chunk, chunks_of<Matvec<F::D>>(n), p.hold_qkv);
            matvec<F::D, Input::NORMED_RESIDUAL>(p, s, in, nullptr, nw, chunk, 1, held.from);
            for (int i = tid; i < n; i += CONSUMERS) __stcg(p.qkv + in.a + i, part_sum<F::D>(s, i));
            signal(p, in.signal);
            break;
        case OP_OPROJ: {
            const float mine = residual_row(p, in);
            merge_attention<F::HD, F::HQ>(p, s, t);  // the input, into s.vec()
            float a[Matvec<F::QD>::PER_LANE][8];
            held.from = held_from(chunk, chunks_of<Matvec<F::QD>>(n), p.hold_oproj);
            matvec<F::QD, Input::SHARED>(p, s, in, s.vec(), a, chunk, 1, held.from);
            add_to_residual<F::QD>(p, s, in, mine);
            signal(p, in.signal);
            break;
        }
        case OP_MLP:
            // Gate and up rows in.a..in.b, SiLU·mul into s.vec() (as
            // kernels/src/silu_mul.cu), then those act values times the same
            // columns of the down-projection, summed into p.mlp_acc: split over
            // the SMs by the act rows, the down-projection needs no phase of its own.
            held.from = held_from(chunk, 2 * chunks_of<Matvec<F::D>>(n) + chunks_of<Scatter<F::D>>(n), p.hold_mlp);
            matvec<F::D, Input::NORMED_X>(p, s, in, nullptr, nw, chunk, 2, held.from);
            for (int i = tid; i < n; i += CONSUMERS) {
                const float g = part_sum<F::D>(s, i), u = part_sum<F::D>(s, n + i);
                s.vec()[i] = g / (1.0f + __expf(-g)) * u;
            }
            consumer_sync();
            scatter_down<F::D>(p, s, n, chunk, held.from);
            signal(p, in.signal);
            break;
        case OP_LMHEAD:
            lm_head<F>(p, s, in, t, chunk);
            held.from = chunk;  // it holds nothing: its last CTA goes on to the next step's input
            break;
        default:
            __trap();  // a schedule this kernel does not understand
    }
    held.to = chunk;
}

template <class F>
__device__ __forceinline__ void consumers(const Params& p, const Smem& s, uint32_t first, uint32_t last) {
    const int tid = threadIdx.x;
    uint32_t chunk = 0;
    if (blockIdx.x == 0) {  // the launch's first input
        embed_row<F::D>(p, p.first_token);
        consumer_sync();
        if (tid == 0) st_release(counter(p, STEP_COUNTER), 1);
    }
    bool running = true;
    HeldChunks held;
    const uint32_t n_instrs = __ldg(p.sm_start + gridDim.x);
    for (int t = 0; t < p.max_steps && running; t++) {
        // Tracing (megakernel/profile.rs): thread 0 stamps one step's waits and instructions.
        unsigned long long* tr = (p.trace != nullptr && t == p.trace_step && tid == 0) ? p.trace : nullptr;
        if (tr) tr[3 * n_instrs + 2 * blockIdx.x] = globaltimer_ns();
        running = wait_counter(p, s, STEP_COUNTER, (uint32_t)(t + 1), 0xffffffffu, t, 0);
        if (tr) tr[3 * n_instrs + 2 * blockIdx.x + 1] = globaltimer_ns();
        for (uint32_t i = first; i < last && running; i++) {
            const Instr in = load_instr(p, i);
            if (tr) tr[3 * i] = globaltimer_ns();
            // Each kind loads what does not depend on the step before its wait.
            AttnPre<F::HD> pre;
            float nw[Matvec<F::D>::PER_LANE][8];
            if (in.op == OP_ATTN) {
                attention_prepare<F::HD, F::G, F::HKV, F::NL>(p, in, t, pre);
            } else {
                release_chunks(s, held);  // the SM waits now: the ring refills meanwhile
                if (const float* norm = norm_weights<F>(p, in)) load_norm<F::D>(norm, nw);
            }
            running = wait_counter(p, s, in.wait, (uint32_t)(t + 1) * in.per_step, i - first, t, 1);
            if (tr) tr[3 * i + 1] = globaltimer_ns();
            if (running) {
                if (in.op == OP_ATTN) {
                    // Traced: a used split's own stamps (megakernel/profile.rs).
                    unsigned long long* inside = tr ? tr + 3 * n_instrs + 2 * gridDim.x + 3 * i : nullptr;
                    attention<F::HD, F::G, F::HQ, F::HKV, F::NL>(p, s, in, t, pre, inside);
                    signal(p, in.signal);
                } else {
                    run_matvec<F>(p, s, in, t, chunk, nw, held);
                }
            }
            if (tr) tr[3 * i + 2] = globaltimer_ns();
        }
    }
    consumer_sync();
    if (tid == 0) {
        s.sc()->consumed = chunk;
        __threadfence_block();
        st_volatile(&s.sc()->done, 1);
    }
}

// The SM's weight stream, chunk by chunk: every matrix-vector instruction of its
// list, step after step, in the chunks its consumer side takes (consume_rows,
// scatter_down): the Mlp streams its gate rows, its up rows, then its rows of the
// transposed down-projection. An instruction is decoded once, when the stream
// reaches it. The LM head is claimed, not listed: its tiles of in.a rows are
// handed out by counter in.c (claim k of step t is tile k - t (tiles + grid); an
// SM claims until it draws past the tiles, once per step, so each step takes
// exactly tiles + grid claims), each claimed one ahead of its use so the claim's
// round trip overlaps the tile before; an SM's stream ends its LM head with one
// chunk of no bytes tagged TAG_END. Relies on what megakernel/verify.rs checks
// for every schedule: no SM's list is empty and no tile is (an empty list would
// make `i = first` decode another SM's instruction).
template <class F>
struct WeightStream {
    uint32_t first, last;             // the SM's instruction list
    int t = 0;                        // step
    uint32_t i;                       // the next instruction to decode
    Instr cur;                        // the instruction being streamed
    int region = 0, regions = 0;      // which of its matrices (Mlp: gate, up, down^T)
    const uint16_t* rows = nullptr;   // the current matrix's next chunk (`left` rows from here)
    int left = 0, per_chunk = 0, row_bytes = 0;
    bool claiming = false;            // in the LM head: `claim` is the next claim's result
    uint32_t claim = 0, tag = 0;      // tag: the claimed tile being streamed

    __device__ WeightStream(uint32_t first_, uint32_t last_) : first(first_), last(last_), i(first_) {}

    // The next chunk's source, bytes (0: the LM head's end marker) and tag;
    // false once the launch's steps are over.
    __device__ bool next(const Params& p, const uint16_t*& src, uint32_t& bytes, uint32_t& chunk_tag) {
        while (left == 0) {
            if (region + 1 < regions) {
                region++;
                begin(p);
                continue;
            }
            if (claiming) {
                const uint32_t tiles = cur.b, tile = claim - (uint32_t)t * (tiles + gridDim.x);
                if (tile >= tiles) {  // none left this step: the consumers' end marker
                    claiming = false;
                    src = nullptr;
                    bytes = 0;
                    chunk_tag = TAG_END;
                    return true;
                }
                claim = atomicAdd(counter(p, cur.c), 1u);  // the next one, used a tile later
                tag = tile;
                const int r0 = (int)(tile * cur.a);
                start<Matvec<F::D>>(p.lm_head + (size_t)r0 * F::D, min((int)cur.a, F::V - r0));
                continue;
            }
            if (i >= last) {
                if (++t >= p.max_steps) return false;
                i = first;
            }
            if (t >= p.max_steps) return false;
            cur = load_instr(p, i++);
            region = 0;
            regions = cur.op == OP_ATTN || cur.op == OP_LMHEAD ? 0 : (cur.op == OP_MLP ? 3 : 1);  // attention streams no weights; the LM head's are claimed
            if (cur.op == OP_LMHEAD) {
                claiming = true;
                claim = atomicAdd(counter(p, cur.c), 1u);
            }
            if (regions > 0) begin(p);
        }
        const int k = min(per_chunk, left);
        src = rows;
        bytes = (uint32_t)(k * row_bytes);
        chunk_tag = tag;
        rows += (size_t)k * row_bytes / 2;
        left -= k;
        return true;
    }

    // Points the stream at matrix `region` of a listed instruction `cur`: rows cur.a..cur.b.
    __device__ void begin(const Params& p) {
        const LayerPtrs& lw = p.layers[min(cur.layer, (uint32_t)F::NL - 1)];  // (the LM head streams no layer)
        const size_t a = cur.a;
        const int n = (int)(cur.b - cur.a);
        switch (cur.op) {
            case OP_QKV: start<Matvec<F::D>>(lw.qkv + a * F::D, n); break;
            case OP_OPROJ: start<Matvec<F::QD>>(lw.o + a * F::QD, n); break;
            case OP_MLP:
                if (region == 0) start<Matvec<F::D>>(lw.gate_up + a * F::D, n);
                else if (region == 1) start<Matvec<F::D>>(lw.gate_up + (F::FF + a) * F::D, n);
                else start<Scatter<F::D>>(lw.down_t + a * F::D, n);
                break;
            default: break;
        }
    }

    template <class Shape>
    __device__ void start(const uint16_t* r, int n) {
        rows = r, left = n, per_chunk = Shape::ROWS, row_bytes = Shape::ROW_BYTES;
    }
};

// The producer lane: issues the SM's weight stream into the ring, each chunk as
// soon as its slot is free (an end marker: its tag and a plain arrival).
template <class F>
__device__ __forceinline__ void producer(const Params& p, const Smem& s, uint32_t first, uint32_t last) {
    WeightStream<F> at(first, last);
    const uint16_t* src;
    uint32_t bytes, tag;
    uint32_t chunk = 0;
    bool go = true;
    const bool hinted = p.weights_evict_first != 0;
    const uint64_t policy = l2_evict_first_policy();
    while (go && at.next(p, src, bytes, tag)) {
        const int slot = chunk % SLOTS;
        if (chunk >= SLOTS) {
            // Wait for the consumers' release of the slot's last use, unless they
            // have left (an abort elsewhere is not a reason to stop: this CTA's
            // consumers finish their instruction, which may need more chunks).
            const uint32_t parity = (chunk / SLOTS - 1) & 1;
            while (!mbar_try_wait(s.empty() + slot, parity)) {
                if (ld_volatile(&s.sc()->done)) {
                    go = false;
                    break;
                }
            }
            if (!go) break;
        }
        // The arrival (a release) publishes the tag with the chunk.
        s.sc()->tags[slot] = tag;
        if (bytes == 0) {
            mbar_arrive(s.full() + slot);
        } else {
            mbar_arrive_expect_tx(s.full() + slot, bytes);
            if (hinted) {
                bulk_load_hinted(s.ring() + slot * SLOT_BYTES, src, bytes, s.full() + slot, policy);
            } else {
                bulk_load(s.ring() + slot * SLOT_BYTES, src, bytes, s.full() + slot);
            }
        }
        chunk++;
    }
    // The CTA must not exit with copies still landing in its shared memory: wait
    // for the consumers to leave, then for every chunk issued but not consumed.
    while (!ld_volatile(&s.sc()->done)) __nanosleep(128);
    __threadfence_block();
    const uint32_t consumed = ld_volatile(&s.sc()->consumed);
    for (uint32_t c = consumed; c < chunk; c++)
        while (!mbar_try_wait(s.full() + c % SLOTS, (c / SLOTS) & 1)) {
        }
}

// Warp 9 of CTA 0: the only warp that touches the host's mapped memory while
// the loop runs. It forwards each published step's token to the host ring
// (with logprobs, the step's record first: the warp merges the SMs' parts off
// the token's critical path, mk_logprobs.cuh) and copies the host's stop flag
// into device state (seen by the LM head of a later step), until the loop has
// ended and every token is forwarded.
template <class F>
__device__ __noinline__ void host_link(const Params& p) {
    const int lane = threadIdx.x & 31;
    const bool logprobs = p.lp_out != nullptr;
    uint32_t sent = 0, stop_copied = 0;
    while (true) {
        // The step word first: once it carries STOP_BIT, ST_STEPS (released before it) is final.
        uint32_t over = 0, steps = 0;
        if (lane == 0) {
            over = (ld_acquire(counter(p, STEP_COUNTER)) & STOP_BIT) != 0 || ld_volatile(p.state + ST_ABORT) != 0;
            steps = ld_acquire(p.state + ST_STEPS);
        }
        over = __shfl_sync(0xffffffffu, over, 0);
        steps = __shfl_sync(0xffffffffu, steps, 0);
        __syncwarp();  // lane 0's acquires order the other lanes' reads of the steps' parts
        for (; sent < steps; sent++) {
            if (logprobs) {
                // After an abort an LM head may have skipped its buffers (the host
                // falls back on an error): no more records, nor tokens without them.
                const uint32_t aborted = __shfl_sync(0xffffffffu, lane == 0 ? ld_volatile(p.state + ST_ABORT) : 0u, 0);
                if (aborted) break;
                // The step's record first, fenced to the host before the token.
                logprob_record<F>(p, (int)sent, p.ring + RING_TOKENS + p.max_steps + (size_t)sent * LP_WORDS);
            }
            if (lane == 0) {
                st_volatile(p.ring + RING_TOKENS + sent, __ldcg(p.tokens + sent));
                if (logprobs) st_release(p.state + ST_LP_MERGED, sent + 1);  // the step's buffers are free again
            }
        }
        if (over || steps >= (uint32_t)p.max_steps) break;
        if (lane == 0 && !stop_copied && ld_volatile(p.ring + RING_STOP) != 0) {
            stop_copied = 1;
            st_volatile(p.state + ST_HOST_STOP, 1);
        }
        __nanosleep(500);
    }
    __threadfence_system();  // the last tokens reach the host before the launch ends
}

template <class F>
__device__ __forceinline__ void megakernel_body(const Params& p) {
    const Smem s;
    if (threadIdx.x == 0) {
        for (int i = 0; i < SLOTS; i++) {
            mbar_init(s.full() + i, 1);
            mbar_init(s.empty() + i, CONSUMER_WARPS);
        }
        s.sc()->done = 0;
        s.sc()->consumed = 0;
        mbar_init_fence();
    }
    __syncthreads();
    const uint32_t first = __ldg(p.sm_start + blockIdx.x), last = __ldg(p.sm_start + blockIdx.x + 1);
    if (threadIdx.x >= CONSUMERS) {
        if (threadIdx.x == CONSUMERS) producer<F>(p, s, first, last);
        if (threadIdx.x >= CONSUMERS + 32 && blockIdx.x == 0) host_link<F>(p);
        return;
    }
    consumers<F>(p, s, first, last);
}

}  // namespace mk

// One kernel per fuel: (hidden, ff, layers, q heads, kv heads, head_dim, vocab).
// backend/cuda/megakernel.rs `FUELS` lists the same shapes.
#define MEGAKERNEL(NAME, ...)                                                                       \
    ROCKET_KERNEL void __launch_bounds__(mk::THREADS, 1) NAME(const __grid_constant__ mk::Params p) { \
        mk::megakernel_body<mk::Fuel<__VA_ARGS__>>(p);                                              \
    }
MEGAKERNEL(megakernel_llama_3_2_1b, 2048, 8192, 16, 32, 8, 64, 128256)
MEGAKERNEL(megakernel_qwen3_0_6b, 1024, 3072, 28, 16, 8, 128, 151936)
MEGAKERNEL(megakernel_qwen3_1_7b, 2048, 6144, 28, 16, 8, 128, 151936)
MEGAKERNEL(megakernel_smollm2_135m, 576, 1536, 30, 9, 3, 64, 49152)

// The megakernel's fixed geometry. Mirrored by crates/rocket-core/src/megakernel/
// abi.rs: a Rust test reads every namespace-level `constexpr` below (one
// declaration per line; values of numbers, earlier names, + and *) and compares
// names, values, order and types.
#pragma once
#include <stdint.h>

namespace mk {

constexpr int CONSUMER_WARPS = 8;                     // warps 0-7 compute
constexpr int CONSUMERS = CONSUMER_WARPS * 32;        // 256 threads
constexpr int THREADS = CONSUMERS + 64;               // + warp 8, the weight producer, and warp 9, the host link
constexpr int SLOT_BYTES = 16384;                     // one ring slot: whole rows of one matrix
constexpr int SLOTS = 12;                             // 192 KiB of weights in flight per SM
constexpr int PART_CAP = 2048;                        // partial sums of one instruction (floats)
constexpr int VEC_CAP = 2048;                         // a normed input vector (floats); hidden <= this
constexpr int MAX_SPLITS = 64;                        // attention splits per KV head
constexpr int SPLIT_POSITIONS = 64;                   // context positions a used split takes at least
constexpr int MAX_GROUP = 4;                          // query heads per KV head
constexpr int INSTR_WORDS = 8;                        // u32 words per encoded instruction
constexpr int RACE_KEY_BINS = 1024;                   // race keys kept per bin of 1/16 nat: a ring over 64 nats
constexpr int RACE_MASS_BINS = 512;                   // weights per bin at one anchor: the 32 nats that weigh
constexpr int RACE_LEVELS = 64;                       // anchors (multiples of 16 nats) the weight table rings over
constexpr int RACE_TOPK_MAX = 64;                     // the largest top-k the SMs sample together
constexpr int RACE_LIST = RACE_TOPK_MAX;              // a top-k list per SM: its k best tokens
constexpr int LP_MAX = 20;                            // logprobs in the loop: alternatives per step at most
constexpr int LP_PART = 3 + LP_MAX;                   // an SM's logprob part (u64 words): length, max, sum, list
constexpr int LP_WORDS = 1 + 2 * LP_MAX;              // a step's logprob record (u32 words): the token's, then (id, logprob)s
constexpr int MERGE_STAMPS = 8;                      // traced: the sampler merge's phase stamps at the trace's end
constexpr int PART_STAMPS = 4;                       // traced: each SM's sampler part's phase stamps, after the merge's

// Opcodes (schedule.rs `Op`; 5 is unused).
constexpr uint32_t OP_QKV = 1, OP_ATTN = 2, OP_OPROJ = 3, OP_MLP = 4, OP_LMHEAD = 6;
// Counter 0 counts steps whose input is embedded; the sampler sets this bit in it to end the loop.
constexpr uint32_t STEP_COUNTER = 0;
constexpr uint32_t STOP_BIT = 0x80000000u;
// A claimed op's ring chunk that carries no weights: the SM's producer found no
// tile left to claim in this step (Scalars::tags).
constexpr uint32_t TAG_END = 0xffffffffu;

// Device state words (host reads them after the launch).
constexpr int ST_ABORT = 0;     // set by an SM whose watchdog fired: every SM leaves
constexpr int ST_ERROR = 1;     // 1 once a watchdog fired (first SM wins the details)
constexpr int ST_ERR_SM = 2;
constexpr int ST_ERR_INSTR = 3; // index into the SM's instruction list, or 0xffffffff: the step start, 0xfffffffe: the LM head's wait for the logprob merge
constexpr int ST_ERR_STEP = 4;
constexpr int ST_ERR_VALUE = 5; // the counter's value when it gave up
constexpr int ST_ERR_TARGET = 6;
constexpr int ST_STEPS = 7;     // steps run (their tokens are in Params::tokens)
constexpr int ST_HOST_STOP = 8; // the host's stop flag, copied from the ring by the host link
constexpr int ST_ONE_CTA = 9;   // sampled steps whose token sample_token picked (one CTA over the row)
constexpr int ST_LP_MERGED = 10; // steps whose logprob record the host link has built (their parts and raw logits are free)
constexpr int STATE_WORDS = 16;
// ST_ERR_INSTR when the watchdog fired on the LM head's wait for the logprob record of two steps before.
constexpr uint32_t ERR_AT_LOGPROB_MERGE = 0xfffffffeu;

// Host ring (mapped pinned memory): [0, stop, fault, 0, tokens[max_steps],
// logprobs[max_steps][LP_WORDS]] (the records only when the launch asks for logprobs); the host
// fills the tokens with RING_EMPTY before a launch and polls them. Only the host
// link (warp 9 of CTA 0) touches it during the loop, so no read or write across
// PCIe sits on a token's critical path. `fault` is
// RING_FAULT_COPY | SM when a weight copy never landed (the launch then traps).
constexpr int RING_STOP = 1, RING_FAULT = 2, RING_TOKENS = 4;
constexpr uint32_t RING_EMPTY = 0xffffffffu;
constexpr uint32_t RING_FAULT_COPY = 0xc0de0000u;

// How rows of K bf16 weights stream through the ring (geometry.rs `MatvecShape`):
// ROWS whole rows per slot; each row cut into SEGS column segments, so that
// ROWS * SEGS == CONSUMER_WARPS warps share a slot (one (row, segment) each) when
// rows are long; with SEGS == 1 warp w takes rows w, w + 8, ...
template <int K>
struct Matvec {
    static constexpr int FIT = SLOT_BYTES / (2 * K);
    static constexpr int ROWS = FIT >= CONSUMER_WARPS ? FIT : (FIT >= 4 ? 4 : (FIT >= 2 ? 2 : 1));
    static constexpr int SEGS = FIT >= CONSUMER_WARPS ? 1 : CONSUMER_WARPS / ROWS;
    static constexpr int SEG_LEN = K / SEGS;             // columns of one segment
    static constexpr int GROUPS = SEG_LEN / 8;           // 16-byte groups of a segment
    static constexpr int PER_LANE = (GROUPS + 31) / 32;  // groups each lane handles
    static constexpr int ROW_BYTES = 2 * K;
    static_assert(K % 8 == 0 && FIT >= 1, "rows must be 16-byte multiples that fit a slot");
    static_assert(K % SEGS == 0 && SEG_LEN % 8 == 0, "segments of whole 16-byte groups");
    static_assert(PER_LANE <= 4, "at most 32 input floats per lane");
};

// How the MLP instruction streams its down-projection (the transposed copy: one
// row of D weights per element of its act slice; geometry.rs `scatter_fits`):
// ROWS whole rows per slot; thread t takes column group t % GROUPS (8 columns)
// of rows t / GROUPS, + LANES, ..., so LANES row lanes sum into LANES * D partials.
template <int D>
struct Scatter {
    static constexpr int ROWS = SLOT_BYTES / (2 * D);
    static constexpr int GROUPS = D / 8;
    static constexpr int LANES = CONSUMERS / GROUPS;
    static constexpr int ROW_BYTES = 2 * D;
    static_assert(D % 8 == 0 && ROWS >= 1 && LANES >= 1, "rows of whole 16-byte groups that fit a slot");
    static_assert(LANES * D <= PART_CAP, "the row lanes' partials fit the partial sums");
};

// Shared memory of one CTA (dynamic): the ring, its barriers, a vector, partial sums, scalars.
constexpr int SMEM_RING = SLOTS * SLOT_BYTES;
constexpr int SMEM_BARRIERS = SMEM_RING;                      // full[SLOTS], empty[SLOTS]: u64
constexpr int SMEM_VEC = SMEM_BARRIERS + 2 * SLOTS * 8;
constexpr int SMEM_PART = SMEM_VEC + VEC_CAP * 4;
constexpr int SMEM_SCALARS = SMEM_PART + PART_CAP * 4;
constexpr int SMEM_SCALAR_WORDS = 64;
// The sampler's bins (mk_race.cuh): per-bin race keys, then per-bin weights at
// the SM's two candidate anchors.
constexpr int SMEM_RACE = SMEM_SCALARS + SMEM_SCALAR_WORDS * 4;
constexpr int SMEM_BYTES = SMEM_RACE + RACE_KEY_BINS * 8 + 2 * RACE_MASS_BINS * 8;

}  // namespace mk

// What one grid-wide hand-off costs: every SM publishes its slice of a vector,
// then every SM waits for the whole vector and reads it, the megakernel's unit
// of synchronisation between phases. Each SM's bulk-copy engine keeps `inflight`
// 16 KiB weight copies landing in its shared memory meanwhile (the weight ring;
// 0: none), since a release fence on an SM waits for its copies in flight.
//
// Rounds are chained: round r's words are hashes of the digest of round r-1's
// whole vector, so an SM that reads one stale word ends on a wrong digest. The
// host replays the chain (backend/cuda/handoff_probe.rs `handoff_digest`) and compares.
//
// Modes (handoff_probe.rs `HandoffMode`, same numbers):
//   COUNTER  the megakernel's row hand-off: plain stores, the consumers' barrier,
//            one red.release per SM; waiters poll the counter with ld.acquire.
//   TAGGED   self-validating words: one 8-byte relaxed store of {value, round}
//            per element, no counter and no fence; readers poll each word until
//            its tag is the round (NCCL's LL protocol).
//   SUMS     the megakernel's MLP hand-off: every SM adds its contribution into
//            every element (red.relaxed.add.u64), then barrier + release as COUNTER.
//   COUNTED  the same sums with a count of contributions in each word's top 8
//            bits: no counter and no fence; an element is complete once its word
//            has risen by one count per SM since the round's buffer was last read
//            (words only ever grow, modulo 2^64, so nothing is reset).
//   BULK     the slice leaves by a bulk store from shared memory; the SM waits for
//            it (cp.async.bulk.wait_group 0) and arrives with a relaxed add, no
//            fence, as some persistent kernels do. The PTX memory model does not
//            order that arrival after the data, so the digest says whether it held.
//   NONE     a control with no waiting at all: its digest should come out wrong.
//
// handoff_cost: grid = SMs (all resident), block = 288 (warps 0-7 consumers,
// warp 8 the weight producer), dynamic smem = HANDOFF_SMEM. Two buffers per
// mode, used by round parity: an SM can be at most one round ahead of another,
// so round r+2's writes never meet round r's reads (for the relaxed TAGGED and
// COUNTED writes too: each round's values depend on the last round's reads).
//   words    2 * width u32 (COUNTER, BULK, NONE), any initial contents
//   wide     2 * width u64 (TAGGED: tags must not be 1..rounds, e.g. all ones;
//            SUMS, COUNTED: any initial contents)
//   counters [0] arrivals, [32] the start barrier, [64] abort: zero at launch
//   out      4 per SM: ns from the first round to the last, final digest, 1 if
//            a wait outlived watchdog_ns (the run then stops on every SM), and
//            the 16 KiB weight copies issued meanwhile (what the waits left of
//            the stream: self-validating polls read L2 while the copies land)
// TAGGED needs every SM to own a slice (width >= 4 * SMs): an SM with none
// would never be waited for and could fall two rounds behind.
#include "common.cuh"
#include "mk_geometry.cuh"
#include "mk_sync.cuh"

namespace handoff {

constexpr int COUNTER = 0, TAGGED = 1, SUMS = 2, COUNTED = 3, BULK = 4, NONE = 5;
constexpr int MAX_WIDTH = 2048;                         // elements of the vector
constexpr int PER_THREAD = MAX_WIDTH / mk::CONSUMERS;   // elements each consumer reads
constexpr int COUNT_SHIFT = 56;                         // COUNTED: contributions above, sum below
constexpr int STAGE_BYTES = MAX_WIDTH * 4;              // BULK: one SM's slice at most
constexpr int ARRIVALS = 0, START = 32, ABORT = 64;    // counters' words (a line each)
constexpr int POLLS_PER_CHECK = 64;                     // clock and abort flag read once per this many polls
constexpr int SMEM = mk::SLOTS * mk::SLOT_BYTES + STAGE_BYTES + mk::SLOTS * 8 + 128;
static_assert(MAX_WIDTH % mk::CONSUMERS == 0, "every consumer reads the same number of elements");
static_assert(SMEM <= 227 * 1024, "fits one SM's shared memory");

// The hashes the host replays (handoff_probe.rs): lowbias32, a well-mixed 32-bit hash.
__device__ __forceinline__ uint32_t mix(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}
__device__ __forceinline__ uint32_t round_key(uint32_t digest, int r) { return digest ^ ((uint32_t)(r + 1) * 0x27d4eb2fu); }
__device__ __forceinline__ uint32_t value(uint32_t key, int i) { return mix(key ^ ((uint32_t)i * 0x9e3779b9u)); }
// One SM's addend to element i in the sum modes: 16 bits, so 255 SMs' sum stays far below 2^56.
__device__ __forceinline__ uint32_t addend(uint32_t key, int i, int sm) {
    return mix(key ^ ((uint32_t)i * 0x9e3779b9u) ^ ((uint32_t)sm * 0x85ebca6bu)) & 0xffffu;
}
__device__ __forceinline__ uint32_t digest_term(uint32_t v, int i) { return mix(v + (uint32_t)i * 0xc2b2ae35u); }

__device__ __forceinline__ uint64_t ld_relaxed_u64(const unsigned long long* p) {
    uint64_t v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed_u64(unsigned long long* p, uint64_t v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_relaxed_add(uint32_t* p, uint32_t v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Shared-memory writes of this thread become visible to the bulk copy engine.
__device__ __forceinline__ void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void bulk_store_and_wait(void* dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(mk::smem_u32(src)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// bar.sync 1, 256 that also ORs `v` over the 256 consumers: every one gets the same answer.
__device__ __forceinline__ bool consumer_sync_or(bool v) {
    uint32_t any;
    asm volatile(
        "{\n\t.reg .pred p, q;\n\t"
        "setp.ne.u32 q, %1, 0;\n\t"
        "bar.red.or.pred p, 1, %2, q;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(any)
        : "r"((uint32_t)v), "n"(mk::CONSUMERS)
        : "memory");
    return any != 0;
}

template <int B>
struct Parity {
    static constexpr int value = B;
};

// Gives up once a wait has lasted `limit` ns or another SM gave up; the clock
// and the abort flag are read once per POLLS_PER_CHECK polls (each is another
// memory round trip), and the clock starts at the first check, so a wait that
// ends within POLLS_PER_CHECK polls reads neither. True when the run must stop.
struct Watch {
    uint64_t limit;
    uint32_t* abort;
    uint64_t deadline = 0;
    uint32_t polls = 0;
    __device__ __forceinline__ bool expired() {
        if (++polls % POLLS_PER_CHECK) return false;
        if (mk::ld_volatile(abort)) return true;
        const uint64_t now = mk::globaltimer_ns();
        if (deadline == 0) deadline = now + limit;
        if (now < deadline) return false;
        atomicExch(abort, 1u);
        return true;
    }
};

}  // namespace handoff

ROCKET_KERNEL void __launch_bounds__(288) handoff_cost(const uint8_t* src, unsigned long long src_bytes, int inflight, int mode,
                                                       int width, int rounds, uint32_t seed, unsigned long long watchdog_ns,
                                                       uint32_t* words, unsigned long long* wide, uint32_t* counters,
                                                       unsigned long long* out) {
    using namespace handoff;
    constexpr int SLOT = mk::SLOT_BYTES, SLOTS = mk::SLOTS;
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t* stage = smem + SLOT * SLOTS;
    uint64_t* full = reinterpret_cast<uint64_t*>(stage + STAGE_BYTES);
    uint32_t* scalars = reinterpret_cast<uint32_t*>(full + SLOTS);
    volatile uint32_t* stop = scalars;       // the producer's
    uint32_t* warp_sums = scalars + 1;       // [2][8]: by round parity
    volatile uint32_t* issued = scalars + 17;  // copies the producer has issued
    const int tid = threadIdx.x, sm = blockIdx.x, sms = gridDim.x;
    if (tid == 0) {
        for (int i = 0; i < SLOTS; i++) mk::mbar_init(full + i, 1);
        *stop = 0;
        *issued = 0;
        mk::mbar_init_fence();
    }
    __syncthreads();
    if (tid >= mk::CONSUMERS) {  // the weight stream, as fence_cost keeps it
        if (tid != mk::CONSUMERS) return;
        uint32_t c = 0;
        const unsigned long long chunks = src_bytes / SLOT;
        for (; inflight > 0 && !*stop; c++) {
            const int slot = c % inflight;
            if (c >= (uint32_t)inflight)
                while (!mk::mbar_try_wait(full + slot, (c / inflight - 1) & 1)) {
                }
            mk::mbar_arrive_expect_tx(full + slot, SLOT);
            const unsigned long long chunk = ((unsigned long long)c * sms + sm) % chunks;
            mk::bulk_load(smem + slot * SLOT, src + chunk * SLOT, SLOT, full + slot);
            *issued = c + 1;
        }
        for (uint32_t d = c > (uint32_t)inflight ? c - inflight : 0; d < c; d++)  // drain what is still landing
            while (!mk::mbar_try_wait(full + d % inflight, (d / inflight) & 1)) {
            }
        return;
    }

    // This SM's slice: whole 16-byte groups (BULK stores them in one copy).
    const int groups = width / 4;
    const int lo = 4 * (sm * groups / sms), hi = 4 * ((sm + 1) * groups / sms);
    // The sum modes read each buffer's words as they were before the round that
    // fills them: start from the launch's contents, read before anyone adds.
    uint64_t before[2][PER_THREAD];
#pragma unroll
    for (int k = 0; k < PER_THREAD; k++) {
        const int e = tid + k * mk::CONSUMERS;
        before[0][k] = before[1][k] = 0;
        if ((mode == SUMS || mode == COUNTED) && e < width) {
            before[0][k] = __ldcg(wide + e);
            before[1][k] = __ldcg(wide + width + e);
        }
    }
    mk::consumer_sync();
    bool no_start = false;  // not every CTA resident: give up instead of hanging
    if (tid == 0) {
        const uint64_t settle = mk::globaltimer_ns() + 20000;  // the copies get going
        while (mk::globaltimer_ns() < settle) {
        }
        mk::atom_add_acq_rel(counters + START, 1);
        Watch watch{watchdog_ns, counters + ABORT};
        while (mk::ld_acquire(counters + START) < (uint32_t)sms)
            if (watch.expired()) {
                no_start = true;
                break;
            }
    }
    no_start = consumer_sync_or(no_start);
    const uint64_t t0 = mk::globaltimer_ns();
    const uint32_t issued0 = *issued;
    uint32_t digest = seed;
    int timed_out = no_start;
    // One round; the parity is a constant so that `before` stays in registers.
    auto one_round = [&](auto parity, int r) -> bool {
        constexpr int b = decltype(parity)::value;
        const uint32_t key = round_key(digest, r), tag = (uint32_t)(r + 1);
        Watch watch{watchdog_ns, counters + ABORT};
        uint32_t* buf = words + b * width;
        unsigned long long* wbuf = wide + b * width;
        // Publish this SM's part of round r.
        if (mode == COUNTER || mode == NONE) {
            for (int i = lo + tid; i < hi; i += mk::CONSUMERS) __stcg(buf + i, value(key, i));
        } else if (mode == TAGGED) {
            for (int i = lo + tid; i < hi; i += mk::CONSUMERS) st_relaxed_u64(wbuf + i, ((uint64_t)tag << 32) | value(key, i));
        } else if (mode == BULK) {
            for (int i = lo + tid; i < hi; i += mk::CONSUMERS) reinterpret_cast<uint32_t*>(stage)[i - lo] = value(key, i);
            fence_proxy_async_smem();
        } else {
            const uint64_t count = mode == COUNTED ? 1ull << COUNT_SHIFT : 0ull;
            for (int e = tid; e < width; e += mk::CONSUMERS) mk::red_add_u64(wbuf + e, count + addend(key, e, sm));
        }
        if (mode == COUNTER || mode == SUMS) {
            mk::consumer_sync();
            if (tid == 0) mk::red_release_add(counters + ARRIVALS, 1);
        } else if (mode == BULK) {
            mk::consumer_sync();
            if (tid == 0) {
                if (hi > lo) bulk_store_and_wait(buf + lo, stage, (hi - lo) * 4);
                red_relaxed_add(counters + ARRIVALS, 1);
            }
        }
        // Wait for the whole of round r.
        bool gave_up = false;
        if (mode == COUNTER || mode == SUMS || mode == BULK) {
            if (tid == 0) {
                const uint32_t target = (uint32_t)sms * (r + 1);
                while (mk::ld_acquire(counters + ARRIVALS) < target)
                    if (watch.expired()) {
                        gave_up = true;
                        break;
                    }
            }
            mk::consumer_sync();
        }
        // The words this thread reads (all loads in flight at once; the
        // self-validating modes then re-read only the words not yet complete).
        uint64_t got[PER_THREAD];
#pragma unroll
        for (int k = 0; k < PER_THREAD; k++) {
            const int e = tid + k * mk::CONSUMERS;
            got[k] = 0;
            if (e >= width) continue;
            if (mode == COUNTER || mode == BULK || mode == NONE) got[k] = __ldcg(buf + e);
            else if (mode == SUMS) got[k] = __ldcg(wbuf + e);
            else got[k] = ld_relaxed_u64(wbuf + e);
        }
        if (mode == TAGGED || mode == COUNTED) {
            for (;;) {
                bool complete = true;
#pragma unroll
                for (int k = 0; k < PER_THREAD; k++) {
                    const int e = tid + k * mk::CONSUMERS;
                    const bool done = e >= width || (mode == TAGGED ? (uint32_t)(got[k] >> 32) == tag
                                                                    : ((got[k] - before[b][k]) >> COUNT_SHIFT) == (uint64_t)sms);
                    if (!done) {
                        complete = false;
                        got[k] = ld_relaxed_u64(wbuf + e);
                    }
                }
                if (complete || gave_up) break;
                gave_up = watch.expired();
            }
        }
        uint32_t part = 0;
#pragma unroll
        for (int k = 0; k < PER_THREAD; k++) {
            const int e = tid + k * mk::CONSUMERS;
            if (e >= width) continue;
            uint32_t v = (uint32_t)got[k];  // COUNTER, BULK, NONE, TAGGED: the value is the low half
            if (mode == SUMS || mode == COUNTED) {
                v = (uint32_t)(got[k] - before[b][k]);
                before[b][k] = got[k];
            }
            part += digest_term(v, e);
        }
        // The CTA's digest of round r (order-free: a wrapping sum).
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
        if ((tid & 31) == 0) warp_sums[8 * b + tid / 32] = part;
        const bool stop_now = consumer_sync_or(gave_up);  // same verdict in every consumer
        digest = 0;
#pragma unroll
        for (int w = 0; w < mk::CONSUMER_WARPS; w++) digest += warp_sums[8 * b + w];
        return !stop_now;
    };
    for (int r = 0; r < rounds && !timed_out; r += 2) {
        timed_out = !one_round(Parity<0>{}, r) || (r + 1 < rounds && !one_round(Parity<1>{}, r + 1));
    }
    if (tid == 0) {
        const uint64_t t1 = mk::globaltimer_ns();
        out[4 * sm] = t1 - t0;
        out[4 * sm + 1] = digest;
        out[4 * sm + 2] = timed_out;
        out[4 * sm + 3] = *issued - issued0;  // weight copies issued while timed (16 KiB each)
        *stop = 1;
    }
}

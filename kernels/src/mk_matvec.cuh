// Matrix-vector instructions of the megakernel (Qkv, OProj, Mlp, LmHead):
// the consumer side, which multiplies the rows the producer streams into the ring
// by an input vector held in registers. The producer (megakernel.cu
// `WeightStream`) walks an instruction's rows in the same chunks (Matvec<K>::ROWS
// rows each), so chunk n of the SM's stream is slot n % SLOTS, phase n / SLOTS.
#pragma once
#include "mk_params.cuh"
#include "mk_sync.cuh"

namespace mk {

// Blocks the calling lane until chunk `n` is in its slot. The producer issues
// every chunk the consumers reach (it only waits for slots they have freed), so a
// copy that never lands means the copy engine failed. Nothing can continue then
// (the warp cannot skip its data and the producer cannot drain copies that never
// end), so the watchdog leaves a note in the host ring, which outlives the CUDA
// context, and traps: the launch fails with an error instead of hanging.
__device__ __forceinline__ void wait_chunk(const Params& p, const Smem& s, uint32_t n) {
    uint64_t* bar = s.full() + n % SLOTS;
    const uint32_t parity = (n / SLOTS) & 1;
    if (mbar_try_wait(bar, parity)) return;
    const uint64_t start = globaltimer_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (globaltimer_ns() - start > p.watchdog_ns) {
            st_volatile(p.ring + RING_FAULT, RING_FAULT_COPY | blockIdx.x);
            __threadfence_system();
            __trap();
        }
    }
}

// Eight bf16 weights (16 bytes) times eight inputs.
__device__ __forceinline__ float dot8(uint4 w, const float* a) {
    float f[8];
    unpack8(w, f);
    float acc = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++) acc = fmaf(f[e], a[e], acc);
    return acc;
}

// The MLP instructions add their down-projection partials into p.mlp_acc as
// 64-bit fixed point with 32 fractional bits: integer adds are exact, so the sum
// is the same bits whatever order the SMs arrive in. |values| < 2^31.
constexpr float FIXED_ONE = 4294967296.0f;  // 2^32
__device__ __forceinline__ unsigned long long to_fixed(float v) {
    return (unsigned long long)__float2ll_rn(v * FIXED_ONE);
}
__device__ __forceinline__ float from_fixed(unsigned long long q) {
    return __ll2float_rn((long long)q) * (1.0f / FIXED_ONE);
}

// The residual stream's element i: x plus the last MLP's sums (O-proj folds
// those into x; nothing else writes either while an instruction reads them).
__device__ __forceinline__ float residual(const Params& p, int i) {
    return __ldcg(p.x + i) + from_fixed(__ldcg(p.mlp_acc + i));
}

// Where a matrix-vector instruction's input comes from.
enum class Input {
    NORMED_X,         // RMSNorm(x) * norm_w, as kernels/src/rms_norm.cu (Mlp: O-proj has folded the sums into x)
    NORMED_RESIDUAL,  // the same of x + from_fixed(mlp_acc) (Qkv, LmHead: the last MLP's sums are apart)
    SHARED,           // src in shared memory as it is (OProj: the merged attention in s.vec())
};

// The segment of a row that warp `warp` multiplies (0 when rows are not cut).
template <int K>
__device__ __forceinline__ int warp_segment(int warp) {
    return Matvec<K>::SEGS > 1 ? warp / Matvec<K>::ROWS : 0;
}

// The norm weights of a NORMED_X input, the calling lane's columns of its
// segment (as load_input's `a`). Called before the instruction's wait: they
// depend on nothing the step computes, and loaded after it they were a round
// trip (often to HBM: the weight stream evicts them) on the critical path of
// every Qkv, Mlp and LM-head instruction.
template <int K>
__device__ __forceinline__ void load_norm(const float* norm_w, float (&a)[Matvec<K>::PER_LANE][8]) {
    using M = Matvec<K>;
    const int lane = threadIdx.x & 31, seg = warp_segment<K>(threadIdx.x >> 5);
#pragma unroll
    for (int j = 0; j < M::PER_LANE; j++) {
        const int c = seg * M::SEG_LEN + (lane + 32 * j) * 8;
#pragma unroll
        for (int e = 0; e < 8; e++) a[j][e] = lane + 32 * j < M::GROUPS ? __ldg(norm_w + c + e) : 0.0f;
    }
}

// The input slice a warp multiplies with: columns seg*SEG_LEN + (lane + 32 j)*8 + e.
// Normed inputs read the residual stream (`src` unused) and `a` holds
// load_norm's weights on entry; SHARED reads `src` in shared memory.
template <int K, Input IN>
__device__ __forceinline__ void load_input(const Params& p, const Smem& s, const float* src,
                                           float (&a)[Matvec<K>::PER_LANE][8], int seg) {
    using M = Matvec<K>;
    const int tid = threadIdx.x, lane = tid & 31;
    float scale = 1.0f;
    constexpr bool NORMED = IN != Input::SHARED;
    if constexpr (NORMED) {
        static_assert(K <= VEC_CAP, "normed inputs fit the shared vector");
        float ss = 0.0f;
        for (int i = tid * 4; i < K; i += CONSUMERS * 4) {
            float4 v = __ldcg(reinterpret_cast<const float4*>(p.x + i));
            if constexpr (IN == Input::NORMED_RESIDUAL) {
                const ulonglong2 lo = __ldcg(reinterpret_cast<const ulonglong2*>(p.mlp_acc + i));
                const ulonglong2 hi = __ldcg(reinterpret_cast<const ulonglong2*>(p.mlp_acc + i + 2));
                v.x += from_fixed(lo.x), v.y += from_fixed(lo.y), v.z += from_fixed(hi.x), v.w += from_fixed(hi.y);
            }
            *reinterpret_cast<float4*>(s.vec() + i) = v;
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        scale = rsqrtf(consumer_sum(ss, s.sc()) / (float)K + p.eps);  // its barriers publish s.vec()
    }
#pragma unroll
    for (int j = 0; j < M::PER_LANE; j++) {
        const int g = lane + 32 * j;
        const int c = seg * M::SEG_LEN + g * 8;
        if (!NORMED || g >= M::GROUPS) {
#pragma unroll
            for (int e = 0; e < 8; e++) a[j][e] = 0.0f;
        }
        if (g < M::GROUPS) {
            if constexpr (NORMED) {
#pragma unroll
                for (int e = 0; e < 8; e++) a[j][e] = a[j][e] * (s.vec()[c + e] * scale);
            } else {
                const float4* v = reinterpret_cast<const float4*>(src + c);
                const float4 lo = v[0], hi = v[1];
                a[j][0] = lo.x; a[j][1] = lo.y; a[j][2] = lo.z; a[j][3] = lo.w;
                a[j][4] = hi.x; a[j][5] = hi.y; a[j][6] = hi.z; a[j][7] = hi.w;
            }
        }
    }
}

// Ring chunks [from, to) that the consumers have used but not yet given back to
// the producer (Params::hold_qkv, hold_oproj, hold_mlp).
struct HeldChunks {
    uint32_t from = 0, to = 0;
};

// Gives the held chunks' slots back (each consumer warp arrives once per chunk,
// in chunk order, as consume_rows does).
__device__ __forceinline__ void release_chunks(const Smem& s, HeldChunks& held) {
    if ((threadIdx.x & 31) == 0)
        for (uint32_t c = held.from; c < held.to; c++) mbar_arrive(s.empty() + c % SLOTS);
    held.from = held.to;
}

// Consumes the chunks of `n` rows: part[(first_part + i) * SEGS + seg] = row i's
// segment dot product. `chunk` counts the SM's chunks; those from `keep_from` on
// are kept (not given back to the producer) for the caller to release.
template <int K>
__device__ __forceinline__ void consume_rows(const Params& p, const Smem& s, const float (&a)[Matvec<K>::PER_LANE][8],
                                             int n, int first_part, uint32_t& chunk, uint32_t keep_from) {
    using M = Matvec<K>;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seg = warp_segment<K>(warp);
    for (int row = 0; row < n; row += M::ROWS) {
        const int rows_here = min(M::ROWS, n - row);
        wait_chunk(p, s, chunk);
        const uint8_t* slot = s.ring() + (chunk % SLOTS) * SLOT_BYTES;
        // SEGS > 1: warp -> (row warp % ROWS, segment warp / ROWS); else rows warp, warp + 8, ...
        for (int r = M::SEGS > 1 ? warp % M::ROWS : warp; r < rows_here; r += M::SEGS > 1 ? M::ROWS : CONSUMER_WARPS) {
            const uint4* w = reinterpret_cast<const uint4*>(slot + r * M::ROW_BYTES + seg * M::SEG_LEN * 2);
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < M::PER_LANE; j++) {
                const int g = lane + 32 * j;
                if (g < M::GROUPS) acc += dot8(w[g], a[j]);
            }
            acc = warp_sum(acc);
            if (lane == 0) s.part()[(first_part + row + r) * M::SEGS + seg] = acc;
        }
        __syncwarp();
        if (lane == 0 && chunk < keep_from) mbar_arrive(s.empty() + chunk % SLOTS);
        chunk++;
    }
}

template <int K>
__device__ __forceinline__ float part_sum(const Smem& s, int i) {
    float v = 0.0f;
#pragma unroll
    for (int g = 0; g < Matvec<K>::SEGS; g++) v += s.part()[i * Matvec<K>::SEGS + g];
    return v;
}

// Ring chunks that `n` rows of a shape (Matvec<K> or Scatter<D>) take.
template <class Shape>
__device__ __forceinline__ uint32_t chunks_of(int n) {
    return (uint32_t)((n + Shape::ROWS - 1) / Shape::ROWS);
}

// The first of an instruction's last `hold` chunks (of `total`, starting at
// `chunk`), which it keeps past its release. At most SLOTS: a consumer then never
// waits for a chunk whose slot is held (the producer does, which is the point).
__device__ __forceinline__ uint32_t held_from(uint32_t chunk, uint32_t total, int hold) {
    return chunk + total - min(total, (uint32_t)min(hold, SLOTS));
}

// The dot products of one matrix-vector instruction over rows in.a..in.b of its
// matrix (`regions` matrices of those rows: 2 for gate|up), left in s.part() for the
// caller's epilogue once every consumer is past the closing barrier. `a` is the
// input's registers (normed inputs: holding load_norm's weights). Chunks from
// `keep_from` on are kept (see held_from).
template <int K, Input IN>
__device__ __forceinline__ void matvec(const Params& p, const Smem& s, const Instr& in, const float* src,
                                       float (&a)[Matvec<K>::PER_LANE][8], uint32_t& chunk, int regions,
                                       uint32_t keep_from) {
    load_input<K, IN>(p, s, src, a, warp_segment<K>(threadIdx.x >> 5));
    const int n = in.b - in.a;
    for (int r = 0; r < regions; r++) consume_rows<K>(p, s, a, n, r * n, chunk, keep_from);
    consumer_sync();
}

// The MLP's down-projection for its act slice (`n` values in s.vec()): the
// transposed rows stream through the ring (Scatter<D>), each thread sums act[r]
// times its 8 columns over its rows, the row lanes' sums meet in s.part(), and
// every column's sum is added to p.mlp_acc in fixed point. Chunks from
// `keep_from` on are kept (see held_from).
template <int D>
__device__ __forceinline__ void scatter_down(const Params& p, const Smem& s, int n, uint32_t& chunk, uint32_t keep_from) {
    using S = Scatter<D>;
    const int tid = threadIdx.x, lane = tid & 31;
    const int group = tid % S::GROUPS, row_lane = tid / S::GROUPS;
    const bool active = row_lane < S::LANES;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.0f;
    for (int row = 0; row < n; row += S::ROWS) {
        const int rows_here = min(S::ROWS, n - row);
        wait_chunk(p, s, chunk);
        const uint8_t* slot = s.ring() + (chunk % SLOTS) * SLOT_BYTES;
        if (active) {
            for (int r = row_lane; r < rows_here; r += S::LANES) {
                float w[8];
                unpack8(*reinterpret_cast<const uint4*>(slot + r * S::ROW_BYTES + group * 16), w);
                const float act = s.vec()[row + r];
#pragma unroll
                for (int e = 0; e < 8; e++) acc[e] = fmaf(w[e], act, acc[e]);
            }
        }
        __syncwarp();
        if (lane == 0 && chunk < keep_from) mbar_arrive(s.empty() + chunk % SLOTS);
        chunk++;
    }
    if (active) {
        float4* out = reinterpret_cast<float4*>(s.part() + row_lane * D + group * 8);
        out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
    consumer_sync();
    for (int i = tid; i < D; i += CONSUMERS) {
        float v = 0.0f;
#pragma unroll
        for (int r = 0; r < S::LANES; r++) v += s.part()[r * D + i];
        red_add_u64(p.mlp_acc + i, to_fixed(v));
    }
}

}  // namespace mk

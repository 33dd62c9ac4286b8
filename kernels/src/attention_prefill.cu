// attn_prefill_hdD: causal grouped-query attention of a prompt's rows on the
// tensor cores (FlashAttention-2 style), for prefill passes. The split kernel of
// attention.cu streams every cached key and value once per query row and head;
// here a CTA holds 64 consecutive query rows of one head and streams the keys
// and values through shared memory once for all of them, 64 positions at a time,
// with both products on mma.sync m16n8k16 (bf16 in, f32 accumulation).
//
// Precision: keys and values are bf16 in the cache, so they enter the MMAs
// exactly; the f32 queries and the softmax weights are split into bf16 hi + lo
// (x = hi + lo to ~16 bits of mantissa) and multiplied as two MMAs, as gemm_tc.cu
// does, so scores and outputs are as close to f32 as the split kernel's.
// Softmax is online (running max and sum per row, in base 2), in f32.
//
// A row's result depends only on its query, its position and the cache: key tiles sit on
// absolute multiples of 64 positions, and a tile wholly past a row's position
// leaves that row's max, sum and output bit for bit unchanged (its weights are
// exactly 0 and its correction exp2(0) = 1). So the tiling of a chunk into CTAs
// cannot change a row.
//
// Keys and values are staged with cp.async into two buffers: the copies of the
// next 64 positions are in flight while the MMAs run on these (a CTA of 4 warps,
// 2-3 per SM at these register counts, had little else to hide a load behind).
//
// Context splits: a CTA walks one `span` of key positions, [s * span, (s + 1) *
// span), so a few rows deep in a long context (a prompt's piece beside decoding
// streams, the last pieces of a long prompt) still spread over every SM instead of
// one CTA per (tile, head) walking the whole context. A tile whose context fits in
// one span writes its output directly; otherwise each split writes its rows'
// unnormalised output, max and sum, and attn_prefill_merge combines the splits in
// order. Split boundaries sit at absolute multiples of `span` (a constant of the
// host, kernels.rs PREFILL_SPAN), so a row's bits still depend only on its query,
// its position and the cache; a split past a row's position leaves it no key
// (max -inf, sum 0), which the merge skips, and one live split merges to exactly
// its direct output (its weight is exp2(0) = 1).
//
// grid = (tiles, n_heads, max_splits), block = 128 (4 warps; warp w owns query rows
// 16w..16w+15 of its tile), dynamic shared memory PREFILL_SMEM_BYTES(D). CTAs of
// splits past their tile's context return at once.
// tiles[t] = (first row, rows): up to 64 consecutive rows of one sequence, at
// consecutive positions from meta[first].position.
// Output: out[row][head * D + d], f32, as attn_merge writes it; or, with out16
// (a pass whose O-projection takes fp16 operands and that has no split-kernel
// rows), the same values rounded to fp16 into out16, the product's operand, as
// to_f16 would round them (a value past fp16's range sets *overflow). Partials of tile t,
// head h, split s: item ((t * n_heads + h) * max_splits + s), part_o[item][64][D]
// and part_ml[item][64][2] (max in base 2, sum).
//
// mma.sync m16n8k16 fragments (PTX ISA), g = lane / 4, c = lane % 4 (K's and V's
// B fragments come from ldmatrix_x4, which hands each lane these elements):
//   A (16x16, row-major) regs 0..3: (row g, cols 2c..2c+1), (row g+8, same),
//                                   (row g, cols 2c+8..), (row g+8, cols 2c+8..)
//   B (16x8, k x n)      regs 0..1: (k 2c..2c+1, col g), (k 2c+8..2c+9, col g)
//   C (16x8, f32)        vals 0..3: (row g, cols 2c, 2c+1), (row g+8, cols 2c, 2c+1)
// Each 32-bit register holds the lower column (or k) in its low half.
#include "common.cuh"

#define PREFILL_TILE 64     // query rows per CTA and key positions per step
#define PREFILL_THREADS 128 // 4 warps x 16 rows
// Two buffers of keys and values, rows of D + 8 bf16 (kernels.rs `prefill_smem_bytes`).
// CTAs an SM must hold: at head_dim 64 the registers would otherwise allow two
// (3 x 128 threads take at most 168 each), and with 4 warps a CTA a third one is
// what hides the loop's latencies.
#define PREFILL_MIN_CTAS(D) ((D) <= 64 ? 3 : 2)
#define PREFILL_SMEM_BYTES(D) (2 * 2 * PREFILL_TILE * ((D) + 8) * 2)

struct PrefillTile {
    int32_t first_row;
    int32_t rows;
};

// 16 bytes global -> shared (a shared-window address), or 16 zero bytes where `live` is false (src-size 0:
// nothing is read).
__device__ __forceinline__ void cp_async16_or_zero(uint32_t dst, const uint16_t* src, bool live) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(live ? 16 : 0)
                 : "memory");
}

// Four 8x8 bf16 matrices from shared memory: lane l gives the address of row
// l % 8 of matrix l / 8 (16 bytes, 16-byte aligned), and register i receives
// matrix i's elements (row lane / 4, columns 2 (lane % 4) and + 1), or with TRANS
// its (rows 2 (lane % 4) and + 1, column lane / 4): the B fragments of mma.sync
// m16n8k16 straight from [key][dim] tiles, one instruction for two fragments.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* row) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(row);
    if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a)
                     : "memory");
    }
}

__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x on the MUFU alone: exp2f adds a range test and two multiplies per call to
// keep results below 2^-126 as subnormals. A weight that small beside the row's
// largest (1) is far below f32's resolution of the row's sums; -inf still gives 0.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Where a CTA works: its tile of query rows, head, context split and key range.
struct PrefillWork {
    int tile_index, head, splits;
    PrefillTile tile;
    int p0;              // position of the tile's first row
    int end;             // keys at positions [0, end): the last row's context
    int k_begin, k_end;  // this CTA's keys
    const uint16_t* kv0; // the cache's first position, this layer and kv head
    size_t pos_stride;   // elements from one position to the next in the cache
    int kvd;             // n_kv * D: from a position's keys to its values
};

// The CTA's work, or false for a CTA of a split past its tile's context.
template <int D>
__device__ __forceinline__ bool prefill_work(PrefillWork& w, const RowMeta* __restrict__ meta,
                                             const PrefillTile* __restrict__ tiles, int n_heads, int n_kv, int layer,
                                             int n_layers, int span) {
    // The longest tiles (latest positions) first, so the short ones fill the tail.
    w.tile_index = gridDim.x - 1 - blockIdx.x;
    w.tile = tiles[w.tile_index];
    w.head = blockIdx.y;
    const int split = blockIdx.z;
    const int kv_head = w.head / (n_heads / n_kv);
    w.kvd = n_kv * D;
    const RowMeta m0 = meta[w.tile.first_row];
    w.p0 = m0.position;
    w.end = w.p0 + w.tile.rows;
    w.splits = (w.end + span - 1) / span;
    w.k_begin = split * span;
    w.k_end = min(w.end, w.k_begin + span);
    const uint16_t* cache = reinterpret_cast<const uint16_t*>(m0.kv_base);
    w.pos_stride = (size_t)n_layers * 2 * w.kvd;
    w.kv0 = cache + (size_t)layer * 2 * w.kvd + kv_head * D;
    // Tested last: returning before the fields above left ptxas spilling at head_dim 64.
    return split < w.splits;
}

// The warp's 16 query rows as mma A fragments (the layout of mma.sync m16n8k16's A
// and of wgmma m64nNk16's A per warp), scaled by scale * log2(e) (softmax in base
// 2), split into bf16 hi and lo; zeros past the tile's rows.
template <int D>
__device__ __forceinline__ void prefill_queries(uint32_t (&qh)[D / 16][4], uint32_t (&ql)[D / 16][4],
                                                const float* __restrict__ q, int q_stride, const PrefillWork& w,
                                                float scale, int warp, int g, int c) {
    const float qscale = scale * 1.4426950408889634f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = warp * 16 + g + 8 * (i & 1);
            const int col = ks * 16 + 2 * c + 8 * (i >> 1);
            float x0 = 0.0f, x1 = 0.0f;
            if (r < w.tile.rows) {
                const float* src = q + (size_t)(w.tile.first_row + r) * q_stride + w.head * D + col;
                x0 = src[0] * qscale;
                x1 = src[1] * qscale;
            }
            split_bf16x2(x0, x1, qh[ks][i], ql[ks][i]);
        }
    }
}

// The online softmax of a thread's two rows (a: g, b: g + 8 of its warp's 16).
struct SoftmaxRows {
    float max_a, max_b;  // running max, base 2
    float sum_a, sum_b;  // running sums: this thread's columns only
};

// One key tile's step of the online softmax: the scores s (a C fragment of 16 rows
// x 8 T/8 key tiles, keys k0..) become the weights in place, past-position keys
// masked, and the running max, the sums and the outputs o are rescaled to the new
// max. pos_a, pos_b: the two rows' positions; p0: the CTA's first row's.
template <int NT, int DT>
__device__ __forceinline__ void softmax_tile(float (&s)[NT][4], float (&o)[DT][4], SoftmaxRows& st, int k0, int p0,
                                             int pos_a, int pos_b, int c) {
    // Causal mask: key position > row position (which also covers keys past
    // `end`). Only a tile reaching past the CTA's first row has such keys; the
    // others (all but the last one or two of a long context) skip the compares.
    if (k0 + NT * 8 - 1 > p0) {
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int kp = k0 + nt * 8 + 2 * c + j;
                if (kp > pos_a) s[nt][j] = -INFINITY;
                if (kp > pos_b) s[nt][2 + j] = -INFINITY;
            }
        }
    }
    float tile_a = -INFINITY, tile_b = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        tile_a = fmaxf(tile_a, fmaxf(s[nt][0], s[nt][1]));
        tile_b = fmaxf(tile_b, fmaxf(s[nt][2], s[nt][3]));
    }
    // The four threads of a row (lanes 4g..4g+3) share its max.
    tile_a = fmaxf(tile_a, __shfl_xor_sync(0xffffffffu, tile_a, 1));
    tile_a = fmaxf(tile_a, __shfl_xor_sync(0xffffffffu, tile_a, 2));
    tile_b = fmaxf(tile_b, __shfl_xor_sync(0xffffffffu, tile_b, 1));
    tile_b = fmaxf(tile_b, __shfl_xor_sync(0xffffffffu, tile_b, 2));
    const float new_a = fmaxf(st.max_a, tile_a), new_b = fmaxf(st.max_b, tile_b);
    // A row with no key yet (max still -inf) has nothing to rescale: its weights are 0.
    const float base_a = new_a == -INFINITY ? 0.0f : new_a, base_b = new_b == -INFINITY ? 0.0f : new_b;
    const float corr_a = exp2_ftz(st.max_a - base_a), corr_b = exp2_ftz(st.max_b - base_b);
    st.max_a = new_a;
    st.max_b = new_b;
    st.sum_a *= corr_a;
    st.sum_b *= corr_b;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        s[nt][0] = exp2_ftz(s[nt][0] - base_a);
        s[nt][1] = exp2_ftz(s[nt][1] - base_a);
        s[nt][2] = exp2_ftz(s[nt][2] - base_b);
        s[nt][3] = exp2_ftz(s[nt][3] - base_b);
        st.sum_a += s[nt][0] + s[nt][1];
        st.sum_b += s[nt][2] + s[nt][3];
    }
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        o[dt][0] *= corr_a;
        o[dt][1] *= corr_a;
        o[dt][2] *= corr_b;
        o[dt][3] *= corr_b;
    }
}

// The weights of key tiles 2j and 2j + 1 as the A fragment of the P V product's
// k-step j (a C fragment's layout is an A fragment's half), hi and lo.
template <int NT>
__device__ __forceinline__ void weights_fragment(uint32_t (&ph)[4], uint32_t (&pl)[4], const float (&s)[NT][4], int j) {
    split_bf16x2(s[2 * j][0], s[2 * j][1], ph[0], pl[0]);
    split_bf16x2(s[2 * j][2], s[2 * j][3], ph[1], pl[1]);
    split_bf16x2(s[2 * j + 1][0], s[2 * j + 1][1], ph[2], pl[2]);
    split_bf16x2(s[2 * j + 1][2], s[2 * j + 1][3], ph[3], pl[3]);
}

// The CTA's rows after its last key tile: normalised into out (or out16) where the
// tile's context is one split, else this split's unnormalised partials for
// attn_prefill_merge.
template <int D>
__device__ __forceinline__ void prefill_finish(float (&o)[D / 8][4], SoftmaxRows& st, const PrefillWork& w,
                                               float* __restrict__ out, float* __restrict__ part_o,
                                               float* __restrict__ part_ml, int n_heads, uint16_t* __restrict__ out16,
                                               unsigned* __restrict__ overflow, int r_a, int r_b, int c) {
    constexpr int T = PREFILL_TILE, DT = D / 8;
    // Whole-row sums.
    st.sum_a += __shfl_xor_sync(0xffffffffu, st.sum_a, 1);
    st.sum_a += __shfl_xor_sync(0xffffffffu, st.sum_a, 2);
    st.sum_b += __shfl_xor_sync(0xffffffffu, st.sum_b, 1);
    st.sum_b += __shfl_xor_sync(0xffffffffu, st.sum_b, 2);
    bool over = false;  // an output past fp16's range (out16)
    if (w.splits == 1) {
        const size_t row_stride = (size_t)n_heads * D;
        // One row's pair of columns: f32, or (out16) the O-projection's fp16 operand,
        // rounded as to_f16 would round the f32.
        auto put = [&](int r, int col, float x0, float x1) {
            const size_t at = (w.tile.first_row + r) * row_stride + col;
            if (out16 != nullptr) {
                ushort2 h;
                h.x = f32_to_f16(x0, over);
                h.y = f32_to_f16(x1, over);
                *reinterpret_cast<ushort2*>(out16 + at) = h;
            } else {
                *reinterpret_cast<float2*>(out + at) = make_float2(x0, x1);
            }
        };
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            const int col = blockIdx.y * D + dt * 8 + 2 * c;
            if (r_a < w.tile.rows) put(r_a, col, o[dt][0] / st.sum_a, o[dt][1] / st.sum_a);
            if (r_b < w.tile.rows) put(r_b, col, o[dt][2] / st.sum_b, o[dt][3] / st.sum_b);
        }
        if (over) atomicOr(overflow, 1u);
        return;
    }
    const size_t item = ((size_t)(gridDim.x - 1 - blockIdx.x) * n_heads + blockIdx.y) * gridDim.z + blockIdx.z;
    float* po = part_o + item * T * D;
    float* pml = part_ml + item * T * 2;
#pragma unroll
    for (int dt = 0; dt < DT; dt++) {
        const int col = dt * 8 + 2 * c;
        if (r_a < w.tile.rows) *reinterpret_cast<float2*>(po + r_a * D + col) = make_float2(o[dt][0], o[dt][1]);
        if (r_b < w.tile.rows) *reinterpret_cast<float2*>(po + r_b * D + col) = make_float2(o[dt][2], o[dt][3]);
    }
    if (c == 0) {
        if (r_a < w.tile.rows) *reinterpret_cast<float2*>(pml + r_a * 2) = make_float2(st.max_a, st.sum_a);
        if (r_b < w.tile.rows) *reinterpret_cast<float2*>(pml + r_b * 2) = make_float2(st.max_b, st.sum_b);
    }
}

template <int D>
__device__ __forceinline__ void attn_prefill_body(const float* __restrict__ q, int q_stride, const RowMeta* __restrict__ meta,
                                                  const PrefillTile* __restrict__ tiles, float* __restrict__ out,
                                                  float* __restrict__ part_o, float* __restrict__ part_ml, int n_heads,
                                                  int n_kv, int layer, int n_layers, int span, float scale,
                                                  uint16_t* __restrict__ out16, unsigned* __restrict__ overflow) {
    constexpr int T = PREFILL_TILE, KS = D + 8;  // shared row stride in bf16: 16 bytes of padding spread the banks
    constexpr int KSTEPS = D / 16, DT = D / 8, NT = T / 8;
    static_assert(KSTEPS % 2 == 0 && DT % 2 == 0, "ldmatrix_x4 loads two k-steps of K and two dimension tiles of V");
    static_assert((KS * 2) % 16 == 0, "ldmatrix rows start on 16 bytes");
    extern __shared__ __align__(16) uint16_t prefill_smem[];  // [buffer][k | v][T * KS]

    PrefillWork w;
    if (!prefill_work<D>(w, meta, tiles, n_heads, n_kv, layer, n_layers, span)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    // This thread's two rows (g and g + 8 of the warp's 16) and their positions.
    const int r_a = warp * 16 + g, r_b = r_a + 8;
    const int pos_a = w.p0 + r_a, pos_b = w.p0 + r_b;
    uint32_t qh[KSTEPS][4], ql[KSTEPS][4];
    prefill_queries<D>(qh, ql, q, q_stride, w, scale, warp, g, c);

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    SoftmaxRows st = {-INFINITY, -INFINITY, 0.0f, 0.0f};

    // Queue the copies of keys and values of positions k0..k0+63 into buffer b
    // (zeros past `end`: a masked weight times a NaN would still be NaN), as one
    // cp.async group. Thread t copies 16-byte chunk t % (D / 8) of keys t / (D / 8)
    // + j * KEY_STEP: its addresses are fixed but for k0 and the buffer, so they are
    // taken once here rather than per chunk and step.
    constexpr int CHUNK_COLS = D / 8, KEY_STEP = PREFILL_THREADS / CHUNK_COLS, CHUNK_ROUNDS = T / KEY_STEP;
    static_assert(PREFILL_THREADS % CHUNK_COLS == 0 && T % KEY_STEP == 0, "every thread copies as many chunks");
    const int my_key = threadIdx.x / CHUNK_COLS;
    const uint16_t* my_src = w.kv0 + (size_t)my_key * w.pos_stride + (threadIdx.x % CHUNK_COLS) * 8;
    const uint32_t my_dst = (uint32_t)__cvta_generic_to_shared(prefill_smem + my_key * KS + (threadIdx.x % CHUNK_COLS) * 8);
    const size_t key_step_stride = (size_t)KEY_STEP * w.pos_stride;
    auto stage = [&](int b, int k0) {
        const uint32_t dk = my_dst + b * (2 * T * KS * 2), dv = dk + T * KS * 2;
        const uint16_t* src = my_src + (size_t)k0 * w.pos_stride;
#pragma unroll
        for (int j = 0; j < CHUNK_ROUNDS; j++, src += key_step_stride) {
            const bool live = k0 + my_key + j * KEY_STEP < w.end;
            const uint16_t* from = live ? src : w.kv0;
            cp_async16_or_zero(dk + j * KEY_STEP * KS * 2, from, live);
            cp_async16_or_zero(dv + j * KEY_STEP * KS * 2, from + (live ? w.kvd : 0), live);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    stage(0, w.k_begin);
    for (int k0 = w.k_begin, b = 0; k0 < w.k_end; k0 += T, b ^= 1) {
        // The next positions' copies go to the other buffer (every warp finished
        // reading it at the end of the last step); an empty group past the end
        // keeps the count of groups in flight the same.
        if (k0 + T < w.k_end) {
            stage(b ^ 1, k0 + T);
        } else {
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
        asm volatile("cp.async.wait_group 1;" ::: "memory");  // this thread's copies of buffer b landed
        __syncthreads();                                       // and every thread's
        const uint16_t* sk = prefill_smem + b * 2 * T * KS;
        const uint16_t* sv = sk + T * KS;

        // Scores: S = Q K^T for this warp's 16 rows and the 64 keys (8 tiles of 8).
        // K's B fragments of k-steps ks and ks + 1 in one ldmatrix: matrix i holds
        // the tile's 8 keys at dimensions ks * 16 + 8 i.
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const uint16_t* krow = sk + (nt * 8 + (lane & 7)) * KS + (lane >> 3) * 8;
#pragma unroll
            for (int ks = 0; ks < KSTEPS; ks += 2) {
                uint32_t kb[4];
                ldmatrix_x4<false>(kb, krow + ks * 16);
                mma_16x8x16(s[nt], qh[ks], kb[0], kb[1]);
                mma_16x8x16(s[nt], ql[ks], kb[0], kb[1]);
                mma_16x8x16(s[nt], qh[ks + 1], kb[2], kb[3]);
                mma_16x8x16(s[nt], ql[ks + 1], kb[2], kb[3]);
            }
        }
        softmax_tile(s, o, st, k0, w.p0, pos_a, pos_b, c);

        // O += P V, one k-step of 16 keys at a time.
#pragma unroll
        for (int j = 0; j < T / 16; j++) {
            uint32_t ph[4], pl[4];
            weights_fragment(ph, pl, s, j);
            // B fragments of V (k = key, n = dim) of dimension tiles dt and dt + 1 in
            // one transposing ldmatrix: matrix i holds keys j * 16 + 8 (i % 2) and up
            // at dimensions (dt + i / 2) * 8 and up.
            const uint16_t* vrow = sv + (j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KS + (lane >> 4) * 8;
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) {
                uint32_t vb[4];
                ldmatrix_x4<true>(vb, vrow + dt * 8);
                mma_16x8x16(o[dt], ph, vb[0], vb[1]);
                mma_16x8x16(o[dt], pl, vb[0], vb[1]);
                mma_16x8x16(o[dt + 1], ph, vb[2], vb[3]);
                mma_16x8x16(o[dt + 1], pl, vb[2], vb[3]);
            }
        }
        __syncthreads();  // every warp is done with buffer b before the next step refills it
    }
    prefill_finish<D>(o, st, w, out, part_o, part_ml, n_heads, out16, overflow, r_a, r_b, c);
}

// attn_prefill_merge_hdD: the output of every row of a tile whose context spans
// several splits, from the splits' partials in split order. A split with no key
// for a row (max -inf) adds nothing; the first live split starts the sums, so one
// live split gives its direct output's bits. Each thread merges four columns of
// one row (float4 loads; its loads do not wait on each other's results, where a
// loop over a tile's elements per thread was a chain of dependent L2 round trips):
// grid = (tiles, n_heads, D / 8), block = 128 = PREFILL_MERGE_ROWS(D) rows x D / 4.
#define PREFILL_MERGE_ROWS(D) (4 * PREFILL_THREADS / (D))
template <int D>
__device__ __forceinline__ void attn_prefill_merge_body(const RowMeta* __restrict__ meta, const PrefillTile* __restrict__ tiles,
                                                        const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                                        float* __restrict__ out, int n_heads, int span, int max_splits,
                                                        uint16_t* __restrict__ out16, unsigned* __restrict__ overflow) {
    constexpr int T = PREFILL_TILE, ROWS = PREFILL_MERGE_ROWS(D);
    static_assert(T % ROWS == 0 && D % 4 == 0, "a tile's rows split evenly over the CTAs");
    const int tile_index = blockIdx.x, head = blockIdx.y;
    const PrefillTile tile = tiles[tile_index];
    const int end = meta[tile.first_row].position + tile.rows;
    const int splits = (end + span - 1) / span;
    if (splits == 1) return;  // written by attn_prefill itself
    const int r = blockIdx.z * ROWS + threadIdx.x / (D / 4), d = 4 * (threadIdx.x % (D / 4));
    if (r >= tile.rows) return;
    const size_t item0 = ((size_t)tile_index * n_heads + head) * max_splits;
    // Every split's (max, sum) first, then the outputs in groups of MERGE_GROUP splits
    // whose loads all go out before any is used (a split's loads behind the previous
    // one's test took a round trip each).
    constexpr int MERGE_GROUP = 4;
    const float2* ml = reinterpret_cast<const float2*>(part_ml) + item0 * T + r;
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, ml[(size_t)s * T].x);
    float L = 0.0f;
    float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    bool first = true;
    for (int s0 = 0; s0 < splits; s0 += MERGE_GROUP) {
        float2 ms[MERGE_GROUP];
        float4 ps[MERGE_GROUP];
#pragma unroll
        for (int j = 0; j < MERGE_GROUP; j++) {
            const int s = s0 + j;
            ms[j] = s < splits ? ml[(size_t)s * T] : make_float2(-INFINITY, 0.0f);
            ps[j] = s < splits ? *reinterpret_cast<const float4*>(part_o + ((item0 + s) * T + r) * D + d)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
#pragma unroll
        for (int j = 0; j < MERGE_GROUP; j++) {
            if (ms[j].x == -INFINITY) continue;
            const float f = exp2f(ms[j].x - M);
            const float l = ms[j].y * f;
            const float4 x = make_float4(ps[j].x * f, ps[j].y * f, ps[j].z * f, ps[j].w * f);
            L = first ? l : L + l;
            o = first ? x : make_float4(o.x + x.x, o.y + x.y, o.z + x.z, o.w + x.w);
            first = false;
        }
    }
    const size_t at = (tile.first_row + r) * (size_t)n_heads * D + head * D + d;
    const float4 y = make_float4(o.x / L, o.y / L, o.z / L, o.w / L);
    if (out16 != nullptr) {
        bool over = false;
        *reinterpret_cast<ushort4*>(out16 + at) = f32x4_to_f16(y, over);
        if (over) atomicOr(overflow, 1u);
    } else {
        *reinterpret_cast<float4*>(out + at) = y;
    }
}

// A prompt attention kernel entry: NAME runs BODY<D> (attn_prefill_body here,
// attn_prefill_wg_body in attention_prefill_wg.cu) with the launch's arguments.
#define ATTN_PREFILL_KERNEL(NAME, BODY, D)                                                                               \
    ROCKET_KERNEL void __launch_bounds__(PREFILL_THREADS, PREFILL_MIN_CTAS(D))                                           \
        NAME(const float* __restrict__ q, int q_stride, const RowMeta* __restrict__ meta,                                \
             const PrefillTile* __restrict__ tiles, float* __restrict__ out, float* __restrict__ part_o,                 \
             float* __restrict__ part_ml, int n_heads, int n_kv, int layer, int n_layers, int span, float scale,         \
             uint16_t* __restrict__ out16, unsigned* __restrict__ overflow) {                                            \
        pdl_enter();                                                                                                     \
        BODY<D>(q, q_stride, meta, tiles, out, part_o, part_ml, n_heads, n_kv, layer, n_layers, span, scale, out16,      \
                overflow);                                                                                               \
    }
#define ATTN_PREFILL(D)                                                                                                  \
    ATTN_PREFILL_KERNEL(attn_prefill_hd##D, attn_prefill_body, D)                                                        \
    ROCKET_KERNEL void __launch_bounds__(PREFILL_THREADS)                                                                \
        attn_prefill_merge_hd##D(const RowMeta* __restrict__ meta, const PrefillTile* __restrict__ tiles,                \
                                 const float* __restrict__ part_o, const float* __restrict__ part_ml,                    \
                                 float* __restrict__ out, int n_heads, int span, int max_splits,                         \
                                 uint16_t* __restrict__ out16, unsigned* __restrict__ overflow) {                        \
        pdl_enter();                                                                                                     \
        attn_prefill_merge_body<D>(meta, tiles, part_o, part_ml, out, n_heads, span, max_splits, out16, overflow);       \
    }
ATTN_PREFILL(32)
ATTN_PREFILL(64)
ATTN_PREFILL(128)

// attn_prefill_wg_hdD: attention_prefill.cu's prompt attention with both products on
// Hopper's warpgroup MMA (wgmma, sm_90a only), for head_dim 64 and 128. Same grid,
// tiles, context splits, softmax and outputs as attn_prefill_hdD (the helpers are
// shared), so rows get the same treatment; only the MMAs and the staging differ.
//
// Why: mma.sync makes each of the CTA's four warps read every K and V fragment from
// shared memory with ldmatrix (the same 8-16 KB per warp and key tile), which bounds
// the head_dim-128 loop. A wgmma reads its B operand from shared memory once for the
// whole warpgroup (the CTA's 128 threads, 64 query rows), straight through a matrix
// descriptor.
//   S = Q K^T: m64n64k16, Q (hi, lo) and K both K-major in shared memory (a row's
//     or a key's dimensions contiguous); Q is written there once per CTA.
//   O += P V: m64nDk16, P (hi, lo) from registers (the scores' C fragments turned
//     into A fragments as attention_prefill.cu does), V MN-major (a key's dimensions
//     contiguous, the transpose bit set; bf16 allows it).
// The accumulators' layout per warp is mma.sync's C fragment over n8 tiles, so the
// softmax and the output code are attention_prefill.cu's.
//
// Shared memory: two buffers of keys and values, then the queries' hi and lo
// parts, each tile in D / 64 sub-tiles of [64 keys or rows][128 bytes] (64
// dimensions) with the 128-byte swizzle the descriptors name: 16-byte chunk c of
// key r at r * 128 + ((c ^ (r % 8)) * 16). The swizzle's pattern repeats every
// 1,024 bytes, so each sub-tile starts on a 1,024-byte boundary (the dynamic buffer is aligned by hand: PREFILL_WG_SMEM_BYTES has the
// slack). Descriptors: Q and K, per k-step ks: sub-tile ks / 4, + 32 bytes per k-step
// within the 128-byte rows, 1,024 bytes from 8 keys to the next 8 (SBO); V, per
// k-step j (keys 16j..): + 2,048 bytes, 1,024 from 8 keys to the next 8 (SBO) and
// 8,192 from 64 dimensions to the next 64 (LBO).
//
// Order: cp.async writes through the generic proxy and wgmma reads through the
// async proxy, so each thread fences the proxies after its copies land (and after
// its stores of the queries) and before the barrier that publishes them. A key
// tile runs S, its softmax and P V in turn while the next tile's keys and values
// land; other CTAs on the SM (2-3) keep the tensor cores busy during a softmax.
// Issuing tile i + 1's scores before tile i's P V (FlashAttention-3's overlap within
// a warpgroup) measured 1.7-2.3% slower at 4K on the Qwen3 fuels: a second barrier a
// tile and a longer prologue for what the other CTAs already hide. No register is
// touched while a product that reads or writes it is in flight: the registers are
// pinned around each wait so the compiler cannot move their uses across it.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include "wgmma.cuh"

#define PREFILL_WG_SMEM_BYTES(D) (3 * 2 * PREFILL_TILE * (D) * 2 + 1024)

// d (+)= a b: 64 rows x 64 columns x 16, a and b K-major in shared memory.
__device__ __forceinline__ void wgmma_64x64_kmajor(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_ACC32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_OUT32(d, 0)
        : "l"(a), "l"(b), "r"(accumulate)
        : "memory");
}

// d += a b: 64 rows x 64 columns x 16, a from registers, b MN-major.
__device__ __forceinline__ void wgmma_64xD_mnmajor(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_ACC32 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : WG_OUT32(d, 0)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
                 : "memory");
}

// d += a b: 64 rows x 128 columns x 16, a from registers, b MN-major.
__device__ __forceinline__ void wgmma_64xD_mnmajor(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WG_ACC64 ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : WG_OUT32(d, 0), WG_OUT32(d, 8)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b)
                 : "memory");
}

template <int D>
__device__ __forceinline__ void attn_prefill_wg_body(const float* __restrict__ q, int q_stride, const RowMeta* __restrict__ meta,
                                                     const PrefillTile* __restrict__ tiles, float* __restrict__ out,
                                                     float* __restrict__ part_o, float* __restrict__ part_ml, int n_heads,
                                                     int n_kv, int layer, int n_layers, int span, float scale,
                                                     uint16_t* __restrict__ out16, unsigned* __restrict__ overflow) {
    constexpr int T = PREFILL_TILE, KSTEPS = D / 16, DT = D / 8, NT = T / 8;
    constexpr int SUB = T * 128;        // bytes of one sub-tile: 64 keys x 64 dimensions
    constexpr int TILE_BYTES = T * D * 2;  // one tile of keys (or values)
    static_assert(D % 64 == 0 && T == 64 && PREFILL_THREADS == 128, "one warpgroup, 64 rows, whole sub-tiles");
    extern __shared__ __align__(1024) uint8_t prefill_wg_smem[];

    PrefillWork w;
    if (!prefill_work<D>(w, meta, tiles, n_heads, n_kv, layer, n_layers, span)) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int r_a = warp * 16 + g, r_b = r_a + 8;
    const int pos_a = w.p0 + r_a, pos_b = w.p0 + r_b;

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    SoftmaxRows st = {-INFINITY, -INFINITY, 0.0f, 0.0f};

    const uint32_t smem0 = ((uint32_t)__cvta_generic_to_shared(prefill_wg_smem) + 1023u) & ~1023u;
    // The queries (hi, lo) go to shared memory once, in the layout of a key tile, and
    // both products read their A operand through descriptors: A fragments held in
    // registers across the loop's wgmmas were not kept live by ptxas (it reused them
    // for the next tile's weights at head_dim 64), and in shared memory they cost
    // the loop no registers.
    const uint32_t q_hi = smem0 + 4 * TILE_BYTES, q_lo = q_hi + TILE_BYTES;
    {
        uint32_t qh[KSTEPS][4], ql[KSTEPS][4];
        prefill_queries<D>(qh, ql, q, q_stride, w, scale, warp, g, c);
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = warp * 16 + g + 8 * (i & 1), col = ks * 16 + 2 * c + 8 * (i >> 1);
                const uint32_t at = (col / 64) * SUB + swizzled(r, (col % 64) / 8) + (col % 8) * 2;
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(q_hi + at), "r"(qh[ks][i]) : "memory");
                asm volatile("st.shared.b32 [%0], %1;" ::"r"(q_lo + at), "r"(ql[ks][i]) : "memory");
            }
        }
    }
    // Thread t copies 16-byte chunk t % (D / 8) of keys t / (D / 8) + j * KEY_STEP
    // (zeros past `end`, as attention_prefill.cu). KEY_STEP is a multiple of 8, so
    // every round's key has the same key % 8 and one swizzled offset serves them all.
    constexpr int CHUNK_COLS = D / 8, KEY_STEP = PREFILL_THREADS / CHUNK_COLS, CHUNK_ROUNDS = T / KEY_STEP;
    static_assert(KEY_STEP % 8 == 0 && T % KEY_STEP == 0, "a thread's keys share their swizzle");
    const int my_key = threadIdx.x / CHUNK_COLS, my_chunk = threadIdx.x % CHUNK_COLS;
    const uint16_t* my_src = w.kv0 + (size_t)my_key * w.pos_stride + my_chunk * 8;
    const uint32_t my_off = (my_chunk / 8) * SUB + swizzled(my_key, my_chunk % 8);
    const size_t key_step_stride = (size_t)KEY_STEP * w.pos_stride;
    // Keys (kv 0) or values (kv 1) of positions k0..k0+63 into the tile at dst.
    auto stage = [&](uint32_t dst, int kv, int k0) {
        const uint16_t* src = my_src + (size_t)k0 * w.pos_stride + kv * w.kvd;
#pragma unroll
        for (int j = 0; j < CHUNK_ROUNDS; j++, src += key_step_stride) {
            const bool live = k0 + my_key + j * KEY_STEP < w.end;
            cp_async16_or_zero(dst + my_off + j * KEY_STEP * 128, live ? src : w.kv0, live);
        }
    };
    auto commit = [] { asm volatile("cp.async.commit_group;" ::: "memory"); };
    // Every thread's copies but its newest group's, and its query stores, visible to
    // the tensor cores' reads.
    auto publish = [] {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
    };
    // Key tile i at k_buf(i % 2), value tile i at v_buf(i % 2).
    const uint32_t k_buf0 = smem0, v_buf0 = smem0 + 2 * TILE_BYTES;
    auto k_buf = [&](int i) { return k_buf0 + (i & 1) * TILE_BYTES; };
    auto v_buf = [&](int i) { return v_buf0 + (i & 1) * TILE_BYTES; };
    // S = Q K^T of key tile i into s, hi and lo queries per k-step; the first product
    // overwrites s.
    float s[NT][4];
    auto scores = [&](int i) {
#pragma unroll
        for (int ks = 0; ks < KSTEPS; ks++) {
            const uint32_t step = (ks / 4) * SUB + (ks % 4) * 32;
            const uint64_t kd = wg_desc(k_buf(i) + step, 16, 1024);
            wgmma_64x64_kmajor(s, wg_desc(q_hi + step, 16, 1024), kd, ks > 0);
            wgmma_64x64_kmajor(s, wg_desc(q_lo + step, 16, 1024), kd, 1);
        }
        wg_commit();
    };
    // The weights of the scores in s, hi and lo, as the A operand of O += P V.
    uint32_t ph[T / 16][4], pl[T / 16][4];
    auto weights = [&] {
#pragma unroll
        for (int j = 0; j < T / 16; j++) weights_fragment(ph[j], pl[j], s, j);
    };

    // O += P V of value tile i, the weights in ph, pl.
    auto weighted_values = [&](int i) {
#pragma unroll
        for (int j = 0; j < T / 16; j++) {
            const uint64_t vd = wg_desc(v_buf(i) + j * 16 * 128, SUB, 1024);
            wgmma_64xD_mnmajor(o, ph[j], vd);
            wgmma_64xD_mnmajor(o, pl[j], vd);
        }
        wg_commit();
    };

    // Tile i + 1's keys and values are staged while tile i computes.
    const int n_tiles = (w.k_end - w.k_begin + T - 1) / T;
    stage(k_buf(0), 0, w.k_begin);
    stage(v_buf(0), 1, w.k_begin);
    commit();
    for (int i = 0; i < n_tiles; i++) {
        const int k0 = w.k_begin + i * T;
        if (i + 1 < n_tiles) {
            stage(k_buf(i + 1), 0, k0 + T);
            stage(v_buf(i + 1), 1, k0 + T);
        }
        commit();
        publish();  // keys and values i
        wg_fence();
        scores(i);
        wg_wait_all();
        wg_pin(s);
        softmax_tile(s, o, st, k0, w.p0, pos_a, pos_b, c);
        weights();
        wg_pin(ph);
        wg_pin(pl);
        wg_pin(o);
        wg_fence();
        weighted_values(i);
        wg_wait_all();
        wg_pin(o);
        __syncthreads();  // every thread's products of tile i are done before step i + 1 restages its buffers
    }
    prefill_finish<D>(o, st, w, out, part_o, part_ml, n_heads, out16, overflow, r_a, r_b, c);
}

#define ATTN_PREFILL_WG(D) ATTN_PREFILL_KERNEL(attn_prefill_wg_hd##D, attn_prefill_wg_body, D)
ATTN_PREFILL_WG(64)
ATTN_PREFILL_WG(128)

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

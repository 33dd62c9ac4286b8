#!/usr/bin/env python3
"""CPU twin of kernels/src/attention_prefill.cu (attn_prefill_hdD and
attn_prefill_merge_hdD), lane by lane.

It runs the kernel's code path for every CTA of a launch on numpy arrays shaped
[warp][lane]: the same index expressions for the Q A-fragments, the K and V
B-fragments loaded with ldmatrix (emulated from the PTX ISA's description of
which lane addresses which row and which lane receives which element) from the
padded shared tiles (row stride KS = D + 8), the C
positions, the causal mask, the quad shuffles, the staging of K and V (zeros
past `end`), the hi/lo bf16 split through an emulated `cvt.rn.bf16x2.f32`, the
context splits (a CTA per span of key positions, partials, then the merge) and
the output store. `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32` is emulated
separately from the PTX ISA's fragment tables (section "Matrix Fragments for
mma.m16n8k16 with floating point type"), written per element index i as the ISA
gives them, not per register as the kernel reads them: each lane's registers are
gathered into A (16x16), B (16x8) and C (16x8), multiplied in float64 (bf16
products are exact) and rounded to f32.

Checks (all on random data, against a float64 causal attention of the same bf16
cache and f32 queries):
  accuracy     every written row within 1e-4 relative of the reference;
  coverage     each output of a tile's rows and head is written once, finite,
               by the CTA (one split) or the merge (several);
  memory       no read of the cache at or past `end`, of shared padding, of a
               never-staged shared word or of a partial no split wrote; every
               vector access aligned; no partial written twice;
  tiling       a row's output is the same bits whatever tile (first row, rows,
               `end`) computed it, also where one tile's context spans several
               splits and another's does not.
The sweep runs with a span of 128 positions (the host's is 1024; the kernel takes
it as an argument) so that contexts of a few hundred positions cross splits.
`--mutants` re-runs a short sweep with deliberate index mistakes in the twin's
copy of the kernel and requires each one to fail a check.

Run: python3 -m venv .venv && .venv/bin/pip install numpy
     .venv/bin/python kernels/twin/attention_prefill_twin.py [--quick] [--mutants]
"""
import argparse
import hashlib
import itertools
import pathlib
import sys
import time

import numpy as np

T = 64  # PREFILL_TILE: query rows per CTA and key positions per step
THREADS = 128  # PREFILL_THREADS
NWARPS = THREADS // 32
LANE = np.broadcast_to(np.arange(32), (NWARPS, 32))
WARP = np.broadcast_to(np.arange(NWARPS)[:, None], (NWARPS, 32))
F32 = np.float32
NEG_INF = F32(-np.inf)
# The kernel source this twin was last checked against: a different hash means the
# twin may no longer mirror the kernel (update both, then this hash).
KERNEL = pathlib.Path(__file__).resolve().parents[1] / "src" / "attention_prefill.cu"
KERNEL_SHA256 = "ccd5b6308f5c4bc5b8a6013e9ca407dac45f81eff6c3614c5c4031961baa476a"
POISON_BF16 = 0xFFFF  # a NaN: what an unwritten cache slot or shared word holds here
SPAN = 128  # key positions per context split in the sweep (a multiple of T)


class TwinFault(Exception):
    """An access the kernel must never make (out of bounds, misaligned, unstaged)."""


# ---------------------------------------------------------------- bf16 and cvt


def u2f(u):
    return np.ascontiguousarray(np.asarray(u, np.uint32)).view(F32)


def f2u(x):
    return np.ascontiguousarray(np.asarray(x, F32)).view(np.uint32)


def f32_to_bf16_rn(x):
    """Round to nearest even, as cvt.rn.bf16.f32 does; NaN stays a (quiet) NaN."""
    b = f2u(x).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32) & 0xFFFF
    return np.where(np.isnan(np.asarray(x, F32)), ((b >> 16).astype(np.uint32) | 0x40) & 0xFFFF, r).astype(np.uint32)


def bf16_to_f32(h):
    return u2f(np.asarray(h, np.uint32) << np.uint32(16))


def cvt_rn_bf16x2_f32(a, b):
    """PTX `cvt.rn.bf16x2.f32 d, a, b`: a's bf16 in the upper half of d, b's in the lower."""
    return (f32_to_bf16_rn(a) << np.uint32(16)) | f32_to_bf16_rn(b)


# ------------------------------------------------ mma.m16n8k16 from the PTX ISA


def _isa_tables():
    lane = np.arange(32)
    group, tig = lane >> 2, lane % 4  # groupID, threadID_in_group
    # Multiplicand A (.bf16): a0..a7, two per .b32 register, low half first.
    a_row = np.stack([group if (i < 2 or 4 <= i < 6) else group + 8 for i in range(8)], 1)
    a_col = np.stack([tig * 2 + (i & 1) if i < 4 else tig * 2 + (i & 1) + 8 for i in range(8)], 1)
    # Multiplicand B (.bf16): b0..b3, K x N.
    b_row = np.stack([tig * 2 + (i & 1) if i < 2 else tig * 2 + (i & 1) + 8 for i in range(4)], 1)
    b_col = np.stack([group for _ in range(4)], 1)
    # Accumulators C/D (.f32): c0..c3.
    c_row = np.stack([group if i < 2 else group + 8 for i in range(4)], 1)
    c_col = np.stack([tig * 2 + (i & 1) for i in range(4)], 1)
    for rows, cols, shape in ((a_row, a_col, (16, 16)), (b_row, b_col, (16, 8)), (c_row, c_col, (16, 8))):
        seen = np.zeros(shape, int)
        np.add.at(seen, (rows.ravel(), cols.ravel()), 1)
        assert (seen == 1).all(), "an ISA fragment table does not cover its matrix exactly once"
    return a_row, a_col, b_row, b_col, c_row, c_col


A_ROW, A_COL, B_ROW, B_COL, C_ROW, C_COL = _isa_tables()
_W = np.arange(NWARPS)[:, None]


def mma_m16n8k16(d, a, b0, b1):
    """d [warp][lane][4] f32 += A(a [warp][lane][4] u32) x B(b0, b1 [warp][lane] u32)."""
    A = np.zeros((NWARPS, 16, 16))
    for i in range(8):
        A[_W, A_ROW[None, :, i], A_COL[None, :, i]] = bf16_to_f32((a[..., i // 2] >> np.uint32(16 * (i % 2))) & np.uint32(0xFFFF))
    B = np.zeros((NWARPS, 16, 8))
    breg = (b0, b1)
    for i in range(4):
        B[_W, B_ROW[None, :, i], B_COL[None, :, i]] = bf16_to_f32((breg[i // 2] >> np.uint32(16 * (i % 2))) & np.uint32(0xFFFF))
    C = np.zeros((NWARPS, 16, 8))
    for i in range(4):
        C[_W, C_ROW[None, :, i], C_COL[None, :, i]] = d[..., i]
    acc = C
    with np.errstate(invalid="ignore"):
        for k in range(16):  # fixed order: a row's sums never depend on the other rows
            acc = acc + A[:, :, k, None] * B[:, None, k, :]
    out = np.empty_like(d)
    for i in range(4):
        out[..., i] = acc[_W, C_ROW[None, :, i], C_COL[None, :, i]].astype(F32)
    return out


def shfl_xor(v, m):
    return v[:, LANE[0] ^ m]


# --------------------------------------------------------------- the kernel


class Launch:
    """Global memory of one launch: q (f32, flat), caches (bf16 per sequence), out (f32)."""

    def __init__(self, q, q_stride, positions, kv_base, caches, tiles, n_heads, n_kv, n_layers, layer, D, out_rows, span=SPAN):
        self.q, self.q_stride = q, q_stride
        self.positions, self.kv_base, self.caches = positions, kv_base, caches
        self.tiles = np.asarray(tiles, np.int32).reshape(-1, 2)
        self.n_heads, self.n_kv, self.n_layers, self.layer, self.D = n_heads, n_kv, n_layers, layer, D
        self.out = np.full(out_rows * n_heads * D, np.nan, F32)
        self.writes = np.zeros(out_rows * n_heads * D, int)
        self.scale = F32(1.0 / np.sqrt(F32(D)))  # kernels.rs: 1 / sqrt(head_dim) in f32
        # kernels.rs: max_splits is the pass's most splits of one tile's context.
        self.span = span
        ends = [int(positions[f]) + r for f, r in self.tiles]
        self.max_splits = max(-(-e // span) for e in ends)
        items = len(self.tiles) * n_heads * self.max_splits
        self.part_o = np.full(items * T * D, np.nan, F32)
        self.part_ml = np.full(items * T * 2, np.nan, F32)
        self.part_writes = np.zeros(items * T * (D + 2), int).reshape(items * T, D + 2)
        self.merged = 0  # outputs the merge wrote


def attn_prefill_cta(L, bx, by, bz, mut=frozenset()):
    """One CTA (blockIdx = (bx, by, bz)) of attn_prefill_hdD, all 128 threads at once."""
    D = L.D
    KS = D + 8
    KSTEPS, DT, NT = D // 16, D // 8, T // 8
    # Two buffers of keys and values (the kernel's dynamic shared memory). Shared
    # memory is not zeroed: a NaN shows a stray read.
    skb = [np.full(T * KS, POISON_BF16, np.uint32) for _ in range(2)]
    svb = [np.full(T * KS, POISON_BF16, np.uint32) for _ in range(2)]
    in_flight = [None]  # the buffer whose copies are still landing while the MMAs run

    grid_x = len(L.tiles)
    tile_index = grid_x - 1 - bx
    first_row, rows = (int(x) for x in L.tiles[tile_index])
    head, split = by, bz
    warp, lane = WARP, LANE
    g, c = lane >> 2, lane & 3
    kv_head = head % L.n_kv if "kv_head_mod" in mut else head // (L.n_heads // L.n_kv)
    kvd = L.n_kv * D
    p0 = int(L.positions[first_row])
    end = p0 + rows
    if "end_past" in mut:
        end += 1
    splits = -(-end // L.span)
    if split >= splits:
        return
    k_begin = split * L.span + (T if "split_begin_off" in mut else 0)
    k_end = min(end, k_begin + L.span)
    cache = L.caches[L.kv_base[first_row]]
    pos_stride = L.n_layers * 2 * kvd
    kv0 = L.layer * 2 * kvd + kv_head * D  # element offset; the cache base is 256-byte aligned

    def pack_bf16x2(lo_k, hi_k):
        # common.cuh bf16x2_rn: asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi_k), "f"(lo_k))
        return cvt_rn_bf16x2_f32(lo_k, hi_k) if "pack_order" in mut else cvt_rn_bf16x2_f32(hi_k, lo_k)

    def split_bf16x2(a, b):  # common.cuh split_bf16x2
        hi = pack_bf16x2(a, b)
        if "lo_wrong_half" in mut:
            return hi, pack_bf16x2(a - u2f(hi & np.uint32(0xFFFF0000)), b - u2f(hi << np.uint32(16)))
        return hi, pack_bf16x2(a - u2f(hi << np.uint32(16)), b - u2f(hi & np.uint32(0xFFFF0000)))

    def shared_u16(arr, idx):
        if in_flight[0] is not None and (arr is skb[in_flight[0]] or arr is svb[in_flight[0]]):
            raise TwinFault("shared load from the buffer whose copies are in flight")
        if (idx < 0).any() or (idx >= T * KS).any():
            raise TwinFault("shared load out of bounds")
        if (idx % KS >= D).any():
            raise TwinFault("shared load from the padding")
        return arr[idx]

    def ldmatrix_x4(arr, idx, trans):
        # ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16, as the PTX ISA gives it:
        # lane 8i + r holds the address of row r of matrix i (8 b16, 16-byte aligned);
        # register i of lane t receives matrix i's word t % 4 of row t / 4 (columns
        # 2 (t % 4) and + 1, the lower in the low half), of the transposed matrix with .trans.
        if (idx % 8).any():
            raise TwinFault("misaligned ldmatrix row address")
        rows = np.stack([shared_u16(arr, idx + e).astype(np.uint32) for e in range(8)], -1)  # [warp][lane][8]
        t = np.arange(32)
        regs = []
        for i in range(4):
            m = rows[:, 8 * i : 8 * i + 8, :]  # [warp][row][col] of matrix i
            if trans:
                lo, hi = m[:, 2 * (t % 4), t // 4], m[:, 2 * (t % 4) + 1, t // 4]
            else:
                lo, hi = m[:, t // 4, 2 * (t % 4)], m[:, t // 4, 2 * (t % 4) + 1]
            regs.append(lo | (hi << np.uint32(16)))
        return regs

    r_a = warp * 16 + g
    r_b = r_a + 8
    pos_a, pos_b = p0 + r_a, p0 + r_b

    # Queries as A fragments, scaled by scale * log2(e), hi and lo.
    qscale = F32(L.scale * F32(1.4426950408889634))
    qh = np.zeros((KSTEPS, NWARPS, 32, 4), np.uint32)
    ql = np.zeros_like(qh)
    for ks in range(KSTEPS):
        for i in range(4):
            if "a_rows_swapped" in mut:
                r = warp * 16 + g + 8 * (i >> 1)
                col = ks * 16 + 2 * c + 8 * (i & 1)
            else:
                r = warp * 16 + g + 8 * (i & 1)
                col = ks * 16 + 2 * c + (4 if "a_col_regs23" in mut else 8) * (i >> 1)
            valid = r < rows
            src = (first_row + r) * L.q_stride + head * D + col
            if (src[valid] + 1 >= len(L.q)).any():
                raise TwinFault("q load out of bounds")
            safe = np.where(valid, src, 0)
            x0 = np.where(valid, L.q[safe] * qscale, F32(0))
            x1 = np.where(valid, L.q[safe + 1] * qscale, F32(0))
            qh[ks, ..., i], ql[ks, ..., i] = split_bf16x2(x0, x1)

    o = np.zeros((DT, NWARPS, 32, 4), F32)
    max_a = np.full((NWARPS, 32), NEG_INF)
    max_b = max_a.copy()
    sum_a = np.zeros((NWARPS, 32), F32)
    sum_b = sum_a.copy()

    def stage(b, k0):
        # Keys and values of positions k0..k0+63 into buffer b (zeros past end):
        # cp.async of 16 bytes, or 16 zero bytes (src-size 0).
        sk, sv = skb[b], svb[b]
        CHUNKS = T * D // 8
        tid = np.arange(THREADS)
        for base in range(0, CHUNKS, THREADS):
            i = tid + base
            act = i < CHUNKS
            key, ch = i // (D // 8), i % (D // 8)
            load = act & ((k0 + key < end) | ("no_zero_fill" in mut))
            for t in np.nonzero(act)[0]:
                kx = np.zeros(8, np.uint32)
                vx = np.zeros(8, np.uint32)
                if load[t]:
                    pos = k0 + key[t]
                    src = kv0 + pos * pos_stride + ch[t] * 8
                    if (src * 2) % 16:
                        raise TwinFault("misaligned 16-byte cache load")
                    if pos >= L.positions[first_row] + rows or src + kvd + 8 > len(cache):
                        raise TwinFault(f"cache read at position {pos}, past the tile's context")
                    kx = cache[src : src + 8].astype(np.uint32)
                    voff = 0 if "v_reads_k" in mut else kvd
                    vx = cache[src + voff : src + voff + 8].astype(np.uint32)
                dst = key[t] * KS + ch[t] * 8
                if (dst * 2) % 16 or dst + 8 > T * KS:
                    raise TwinFault("bad 16-byte shared store")
                sk[dst : dst + 8] = kx
                sv[dst : dst + 8] = vx

    k0, b = k_begin, 0
    stage(0, k_begin)
    while k0 < k_end:
        # The next positions' copies go to the other buffer while this one is read.
        nxt = b if "same_buffer" in mut else b ^ 1
        if k0 + T < k_end:
            stage(nxt, k0 + T)
            in_flight[0] = nxt
        else:
            in_flight[0] = None
        cur = (b ^ 1) if "read_other_buffer" in mut else b
        sk, sv = skb[cur], svb[cur]

        # Scores S = Q K^T: 8 tiles of 8 keys.
        s = np.zeros((NT, NWARPS, 32, 4), F32)
        for nt in range(NT):
            if "k_matrices_swapped" in mut:
                krow = (nt * 8 + (lane & 7)) * KS + ((lane >> 3) & 1) * 16 + (lane >> 4) * 8
            else:
                krow = (nt * 8 + (lane & 7)) * KS + (lane >> 3) * (4 if "krow_b1" in mut else 8)
            for ks in range(0, KSTEPS, 2):
                kb = ldmatrix_x4(sk, krow + ks * 16, "k_trans" in mut)
                s[nt] = mma_m16n8k16(s[nt], qh[ks], kb[0], kb[1])
                s[nt] = mma_m16n8k16(s[nt], ql[ks], kb[0], kb[1])
                s[nt] = mma_m16n8k16(s[nt], qh[ks + 1], kb[2], kb[3])
                s[nt] = mma_m16n8k16(s[nt], ql[ks + 1], kb[2], kb[3])
        # Causal mask.
        tile_a = np.full((NWARPS, 32), NEG_INF)
        tile_b = tile_a.copy()
        for nt in range(NT):
            for j in range(2):
                kp = k0 + nt * 8 + 2 * c + j
                if "mask_ge" in mut:
                    s[nt][..., j] = np.where(kp >= pos_a, NEG_INF, s[nt][..., j])
                else:
                    s[nt][..., j] = np.where(kp > pos_a, NEG_INF, s[nt][..., j])
                s[nt][..., 2 + j] = np.where(kp > (pos_a if "mask_b_uses_a" in mut else pos_b), NEG_INF, s[nt][..., 2 + j])
                tile_a = np.fmax(tile_a, s[nt][..., j])
                tile_b = np.fmax(tile_b, s[nt][..., 2 + j])
        tile_a = np.fmax(tile_a, shfl_xor(tile_a, 1))
        if "max_shfl_one" not in mut:
            tile_a = np.fmax(tile_a, shfl_xor(tile_a, 2))
        tile_b = np.fmax(tile_b, shfl_xor(tile_b, 1))
        if "max_shfl_one" not in mut:
            tile_b = np.fmax(tile_b, shfl_xor(tile_b, 2))
        new_a, new_b = np.fmax(max_a, tile_a), np.fmax(max_b, tile_b)
        base_a = np.where(new_a == NEG_INF, F32(0), new_a)
        base_b = np.where(new_b == NEG_INF, F32(0), new_b)
        with np.errstate(invalid="ignore"):
            corr_a, corr_b = np.exp2(max_a - base_a), np.exp2(max_b - base_b)
        max_a, max_b = new_a, new_b
        sum_a = sum_a * corr_a
        sum_b = sum_b * corr_b
        for dt in range(DT) if "no_rescale" not in mut else ():
            o[dt][..., 0] *= corr_a
            o[dt][..., 1] *= corr_a
            o[dt][..., 2] *= corr_b
            o[dt][..., 3] *= corr_b
        with np.errstate(invalid="ignore"):
            for nt in range(NT):
                s[nt][..., 0] = np.exp2(s[nt][..., 0] - base_a)
                s[nt][..., 1] = np.exp2(s[nt][..., 1] - base_a)
                s[nt][..., 2] = np.exp2(s[nt][..., 2] - base_b)
                s[nt][..., 3] = np.exp2(s[nt][..., 3] - base_b)
                sum_a = sum_a + (s[nt][..., 0] + s[nt][..., 1])
                sum_b = sum_b + (s[nt][..., 2] + s[nt][..., 3])

        # O += P V: score tiles 2j, 2j+1 are k-step j's A fragment; V as B, gathered.
        for j in range(T // 16):
            ph = np.zeros((NWARPS, 32, 4), np.uint32)
            pl = np.zeros_like(ph)
            order = (0, 2, 1, 3) if "p_regs_swapped" in mut else (0, 1, 2, 3)
            ph[..., order[0]], pl[..., order[0]] = split_bf16x2(s[2 * j][..., 0], s[2 * j][..., 1])
            ph[..., order[1]], pl[..., order[1]] = split_bf16x2(s[2 * j][..., 2], s[2 * j][..., 3])
            ph[..., order[2]], pl[..., order[2]] = split_bf16x2(s[2 * j + 1][..., 0], s[2 * j + 1][..., 1])
            ph[..., order[3]], pl[..., order[3]] = split_bf16x2(s[2 * j + 1][..., 2], s[2 * j + 1][..., 3])
            if "v_key_dim_swapped" in mut:
                vrow = (j * 16 + (lane & 7) + (lane >> 4) * 8) * KS + ((lane >> 3) & 1) * 8
            else:
                vrow = (j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * KS + (lane >> 4) * 8
            for dt in range(0, DT, 2):
                vb = ldmatrix_x4(sv, vrow + dt * 8, "v_adjacent" not in mut)
                o[dt] = mma_m16n8k16(o[dt], ph, vb[0], vb[1])
                o[dt] = mma_m16n8k16(o[dt], pl, vb[0], vb[1])
                o[dt + 1] = mma_m16n8k16(o[dt + 1], ph, vb[2], vb[3])
                o[dt + 1] = mma_m16n8k16(o[dt + 1], pl, vb[2], vb[3])
        k0 += T
        b ^= 1
        in_flight[0] = None

    sum_a = sum_a + shfl_xor(sum_a, 1)
    if "sum_shfl_one" not in mut:
        sum_a = sum_a + shfl_xor(sum_a, 2)
    if "sum_b_order" in mut:  # the same sum, added in another order for rows g + 8
        sum_b = sum_b + shfl_xor(sum_b, 2)
        sum_b = sum_b + shfl_xor(sum_b, 1)
    else:
        sum_b = sum_b + shfl_xor(sum_b, 1)
        if "sum_shfl_one" not in mut:
            sum_b = sum_b + shfl_xor(sum_b, 2)
    if splits > 1 or "always_partial" in mut:
        store_partials(L, tile_index, head, split, rows, o, (r_a, max_a, sum_a), (r_b, max_b, sum_b), mut)
        return
    row_stride = L.n_heads * D
    for dt in range(DT):
        col = head * D + dt * 8 + (c if "store_col_c" in mut else 2 * c)
        for r, lo, den, guard in ((r_a, 0, sum_a, True), (r_b, 2, sum_b, "store_unguarded" not in mut)):
            m = (r < rows) if guard else np.ones_like(r, bool)
            addr = ((first_row + r) * row_stride + col)[m]
            if (addr % 2).any():
                raise TwinFault("misaligned float2 store")
            if (addr + 1 >= len(L.out)).any():
                raise TwinFault("store out of bounds")
            L.out[addr] = (o[dt][..., lo] / den)[m]
            L.out[addr + 1] = (o[dt][..., lo + 1] / den)[m]
            np.add.at(L.writes, addr, 1)
            np.add.at(L.writes, addr + 1, 1)


def store_partials(L, tile_index, head, split, rows, o, a, b, mut):
    """A split's unnormalised output, max and sum of its rows (c == 0 writes max and sum)."""
    D = L.D
    item = (tile_index * L.n_heads + (0 if "item_no_head" in mut else head)) * L.max_splits + split
    c = LANE & 3
    for r, mx, sm, lo in (a + (0,), b + (2,)):
        live = r < rows
        for dt in range(D // 8):
            col = dt * 8 + 2 * c
            addr = ((item * T + r) * D + col)[live]
            if (addr % 2).any() or (addr + 1 >= len(L.part_o)).any():
                raise TwinFault("bad float2 partial store")
            L.part_o[addr] = o[dt][..., lo][live]
            L.part_o[addr + 1] = o[dt][..., lo + 1][live]
            np.add.at(L.part_writes, ((item * T + r)[live], col[live]), 1)
            np.add.at(L.part_writes, ((item * T + r)[live], col[live] + 1), 1)
        w = live & (c == 0)
        slot = (item * T + r)[w]
        L.part_ml[slot * 2] = mx[w]
        L.part_ml[slot * 2 + 1] = sm[w]
        np.add.at(L.part_writes, (slot, D), 1)
        np.add.at(L.part_writes, (slot, D + 1), 1)


def merge_cta(L, tile_index, head, z, mut=frozenset()):
    """attn_prefill_merge_hdD for CTA (tile, head, z): rows of a tile spanning several
    splits, each thread four columns of one row (PREFILL_MERGE_ROWS(D) rows per CTA)."""
    D = L.D
    first_row, rows = (int(x) for x in L.tiles[tile_index])
    end = int(L.positions[first_row]) + rows
    splits = -(-end // L.span)
    if splits == 1 and "merge_single" not in mut:
        return
    merge_rows = (2 if "merge_rows_half" in mut else 4) * THREADS // D
    item0 = (tile_index * L.n_heads + head) * L.max_splits

    def ml(s, r, k):
        slot = (item0 + s) * T + r
        if L.part_writes[slot, D + k] != 1:
            raise TwinFault(f"merge reads a partial no split wrote (split {s}, row {r})")
        return L.part_ml[slot * 2 + k]

    row_stride = L.n_heads * D
    for tid in range(THREADS):
        r = z * merge_rows + tid // (D // 4)
        d0 = (2 if "merge_col_stride" in mut else 4) * (tid % (D // 4))
        if r >= rows:
            continue
        M = NEG_INF
        for s in range(splits):
            M = np.fmax(M, ml(s, r, 0))
        for d in range(d0, d0 + 4):
            Lsum, o, first = F32(0), F32(0), True
            order = range(splits - 1, -1, -1) if "merge_reversed" in mut else range(splits)
            for s in order:
                m = ml(s, r, 0)
                slot = (item0 + s) * T + r
                # The kernel loads every split's outputs (in groups, before it tests any).
                if L.part_writes[slot, d] != 1:
                    raise TwinFault("merge reads an unwritten partial output")
                if m == NEG_INF:
                    continue
                f = np.exp2(F32(m - M))
                l_ = F32(ml(s, r, 1) * f)
                x = F32(L.part_o[slot * D + d] * f)
                Lsum = l_ if first else F32(Lsum + l_)
                o = x if first else F32(o + x)
                first = False
            addr = (first_row + r) * row_stride + head * D + d
            L.out[addr] = F32(o / Lsum)
            L.writes[addr] += 1
            L.merged += 1


def run_launch(L, mut=frozenset()):
    for bz in range(L.max_splits):
        for bx in range(len(L.tiles)):
            for by in range(L.n_heads):
                attn_prefill_cta(L, bx, by, bz, mut)
    if (L.part_writes > 1).any():
        raise TwinFault("a partial written twice")
    for t in range(len(L.tiles)):
        for h in range(L.n_heads):
            for z in range(L.D // 8):  # kernels.rs: grid (tiles, heads, head_dim / 8)
                merge_cta(L, t, h, z, mut)
    return L.out.reshape(-1, L.n_heads * L.D)


# ------------------------------------------------------------- set-ups, checks


def host_tiles(first, rows):
    """mod.rs: a prompt chunk's rows in tiles of up to PREFILL_TILE, from its first row."""
    return [(start, min(first + rows - start, T)) for start in range(first, first + rows, T)]


def make_pass(rng, D, n_heads, n_kv, seqs, n_layers=3, layer=1, q_data=None, caches=None):
    """One prefill pass: `seqs` = [(cached prefix length, prompt rows)], one cache each.
    Caches hold random bf16 keys and values at every position the pass may attend to
    and a NaN everywhere else (past the context, other layers' slots untouched)."""
    kvd = n_kv * D
    qd = n_heads * D
    q_stride = qd + 2 * kvd
    total = sum(r for _, r in seqs)
    q = np.full(total * q_stride, np.nan, F32)  # k and v columns of qkv: never read here
    positions, kv_base, tiles, row = [], [], [], 0
    new_caches = caches is None
    if new_caches:
        caches = []
    for si, (prefix, rows) in enumerate(seqs):
        if new_caches:
            cap = prefix + rows + 37
            cache = np.full(cap * n_layers * 2 * kvd, POISON_BF16, np.uint16)
            view = cache.reshape(cap, n_layers, 2, kvd)
            view[: prefix + rows] = f32_to_bf16_rn(rng.standard_normal((prefix + rows, n_layers, 2, kvd)).astype(F32))
            caches.append(cache)
        for i in range(rows):
            pos = prefix + i
            src = q_data[si][pos] if q_data is not None else rng.standard_normal(qd).astype(F32) * F32(2.0)
            q[(row + i) * q_stride : (row + i) * q_stride + qd] = src
            positions.append(pos)
            kv_base.append(si)
        tiles += host_tiles(row, rows)
        row += rows
    return Launch(q, q_stride, np.array(positions), kv_base, caches, tiles, n_heads, n_kv, n_layers, layer, D, total)


def reference(L, row, head):
    D, kvd = L.D, L.n_kv * L.D
    kv_head = head // (L.n_heads // L.n_kv)
    pos = int(L.positions[row])
    cache = L.caches[L.kv_base[row]].reshape(-1, L.n_layers, 2, kvd)
    k = bf16_to_f32(cache[: pos + 1, L.layer, 0, kv_head * D : (kv_head + 1) * D]).astype(np.float64)
    v = bf16_to_f32(cache[: pos + 1, L.layer, 1, kv_head * D : (kv_head + 1) * D]).astype(np.float64)
    q = L.q[row * L.q_stride + head * D : row * L.q_stride + (head + 1) * D].astype(np.float64)
    sc = k @ q / np.sqrt(D)
    w = np.exp(sc - sc.max())
    return (w / w.sum()) @ v


def check_launch(L, out, tol=1e-4):
    """Accuracy and coverage of one launch; returns the worst relative error."""
    total = out.shape[0]
    if not (L.writes == 1).all():
        bad = np.nonzero(L.writes != 1)[0]
        raise AssertionError(f"{len(bad)} outputs written {set(L.writes[bad].tolist())} times (want each exactly once)")
    if not np.isfinite(out).all():
        raise AssertionError("non-finite output")
    worst = 0.0
    for row in range(total):
        for head in range(L.n_heads):
            ref = reference(L, row, head)
            got = out[row, head * L.D : (head + 1) * L.D].astype(np.float64)
            err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
            worst = max(worst, err)
    if worst > tol:
        raise AssertionError(f"relative error {worst:.3e} > {tol}")
    return worst


def check_tiling(rng, D, n_heads, n_kv, mut=frozenset()):
    """A row's bits do not depend on its tile: rows 40..139 of one sequence as one pass
    (tiles at rows 40, 104), as 30 + 70 rows (tiles at 70, 134) and as 97 + 3 rows."""
    qd = n_heads * D
    seq_q = [rng.standard_normal((140, qd)).astype(F32) * F32(2.0)]
    base = make_pass(rng, D, n_heads, n_kv, [(40, 100)], q_data=seq_q)
    caches = base.caches
    whole = run_launch(base, mut)
    by_pos = {}
    for split in ((40, 30, 70), (40, 97, 3)):
        start, a, b = split
        for prefix, rows in ((start, a), (start + a, b)):
            L = make_pass(rng, D, n_heads, n_kv, [(prefix, rows)], q_data=seq_q, caches=caches)
            got = run_launch(L, mut)
            for i in range(rows):
                by_pos.setdefault(prefix + i, []).append(got[i])
    differ = 0
    for pos, outs in by_pos.items():
        w = whole[pos - 40]
        for x in outs:
            differ += int((f2u(x) != f2u(w)).sum())
    if differ:
        raise AssertionError(f"{differ} outputs differ in bits between tilings")
    return len(by_pos)


def sweep(quick, mut=frozenset(), verbose=True, rng_seed=7):
    """Every configuration: (D, GQA ratio, [(prefix, rows)...]); returns the worst error."""
    rng = np.random.default_rng(rng_seed)
    cfgs = []
    # Tile rows 1..64 (and 65..: two tiles) at head_dim 32, two sequences per pass.
    rows_all = range(1, 66) if not quick else (1, 2, 17, 64)
    for n in rows_all:
        cfgs.append((32, 2, [((5 * n) % 101, n), (64 if n % 2 else 0, 3)]))
    # Contexts over several spans: a tile crossing a split boundary, one whose rows
    # all sit past the first span, a lone row three spans deep.
    for D in (32, 64, 128):
        cfgs.append((D, 2, [(100, 60), (2 * SPAN + 3, 1), (SPAN + 20, 70)]))
    for D, ratio in itertools.product((32, 64, 128), (1, 2, 4)):
        for p0 in (0, 5, 64, 100):
            for rows in ((7, 64) if quick else (1, 7, 16, 33, 64)):
                cfgs.append((D, ratio, [(p0, rows)]))
    if quick:
        cfgs = cfgs[:: 3 if mut else 1]
    worst = 0.0
    merged = 0
    t = time.time()
    for D, ratio, seqs in cfgs:
        n_kv = 2 if ratio < 4 else 1
        L = make_pass(rng, D, n_kv * ratio, n_kv, seqs)
        out = run_launch(L, mut)
        err = check_launch(L, out)
        worst = max(worst, err)
        merged += L.merged
    if merged == 0:
        raise AssertionError("no launch of the sweep crossed a split: the merge went untested")
    if verbose:
        print(f"accuracy/coverage: {len(cfgs)} launches, worst relative error {worst:.2e}, {merged} outputs merged from splits ({time.time() - t:.0f} s)")
    t = time.time()
    n = 0
    for D, ratio in ((32, 2), (64, 1), (128, 4)) if not mut else ((32, 2),):
        n += check_tiling(rng, D, 2 * ratio if ratio < 4 else ratio, 2 if ratio < 4 else 1, mut)
    if verbose:
        print(f"tiling invariance: {n} positions bitwise equal across 3 tilings ({time.time() - t:.0f} s)")
    return worst


MUTANTS = {
    "pack_order": "pack_bf16x2 with the cvt operands swapped (lo_k in the upper half)",
    "lo_wrong_half": "the lo split subtracts the other element's hi",
    "a_rows_swapped": "Q A fragment: regs 1 and 2 swapped (row offset 8*(i>>1), col 8*(i&1))",
    "krow_b1": "K ldmatrix rows at dimension offsets 4 (lane / 8) instead of 8 (lane / 8)",
    "k_trans": "K loaded with ldmatrix .trans",
    "k_matrices_swapped": "K ldmatrix matrices 1 and 2 swapped (k-step ks + 1's first half as ks's second)",
    "v_adjacent": "V loaded without ldmatrix .trans",
    "v_key_dim_swapped": "V ldmatrix rows: lane bit 4 picks the keys and bit 3 the dimensions",
    "p_regs_swapped": "P as A fragment: score tiles 2j and 2j+1 of rows g+8 / g mixed (regs 1, 2 swapped)",
    "mask_ge": "causal mask kp >= pos (the diagonal masked)",
    "mask_b_uses_a": "rows g+8 masked with row g's position",
    "max_shfl_one": "row max shuffled over 2 lanes instead of the quad",
    "sum_shfl_one": "row sum shuffled over 2 lanes instead of the quad",
    "no_zero_fill": "stage cache positions past end (poisoned) instead of zeros",
    "end_past": "keys up to end inclusive (one position too many)",
    "store_unguarded": "rows g+8 stored without the rows < tile.rows check",
    "a_col_regs23": "Q A fragment regs 2/3 at columns 2c+4 instead of 2c+8",
    "no_rescale": "the output accumulators not rescaled when the row max grows",
    "store_col_c": "output column dt*8 + c instead of dt*8 + 2c",
    "sum_b_order": "rows g+8 add the quad's sums in another order (accurate, not tiling-invariant)",
    "kv_head_mod": "kv_head = head % n_kv instead of head / (n_heads / n_kv)",
    "v_reads_k": "values read at the key offset (no + kvd)",
    "same_buffer": "the next positions' copies into the buffer being read",
    "read_other_buffer": "the MMAs read the buffer whose copies are in flight",
    "split_begin_off": "a split's keys start one tile past its span",
    "always_partial": "a tile within one span writes partials, not its output",
    "item_no_head": "partials indexed without the head (heads overwrite each other)",
    "merge_single": "the merge also runs for tiles within one span",
    "merge_rows_half": "merge CTAs of 2 x THREADS / D rows (half of each tile's rows merged)",
    "merge_col_stride": "merge threads 2 columns apart (columns written twice, others never)",
}


def run_mutants():
    caught = 0
    for name, what in MUTANTS.items():
        try:
            sweep(True, frozenset({name}), verbose=False)
            print(f"  MUTANT SURVIVED  {name}: {what}")
        except (AssertionError, TwinFault) as e:
            caught += 1
            print(f"  caught  {name}: {what} -> {type(e).__name__}: {e}")
    print(f"mutants: {caught}/{len(MUTANTS)} caught")
    return caught == len(MUTANTS)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short sweep")
    ap.add_argument("--mutants", action="store_true", help="also require every deliberate mistake to fail")
    args = ap.parse_args()
    if hashlib.sha256(KERNEL.read_bytes()).hexdigest() != KERNEL_SHA256:
        print(f"WARNING: {KERNEL} changed since this twin was checked against it; re-read the kernel and update the twin")
    sweep(args.quick)
    ok = run_mutants() if args.mutants else True
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""CPU twin of kernels/src/rope_kv.cu (rope_store_kv_hd64 / _hd128), warp by warp.

It runs the kernel's index arithmetic for every block, warp and lane (a warp's 32
lanes as numpy vectors, warp_sum as a sum over them): the head groups, the pairs a
lane holds, the live predicate, the norm weights it picks, the values' float4 chunks
and every address it reads or writes. Per fuel shape (and odd ones: head_dim 32,
more heads than one group a warp holds, Qwen3's norms on and off) it checks that
each q element and each cache slot of the row's position and layer is written
exactly once, nothing else is, no read leaves the row's qkv, the norm weights or
the frequencies, and the outputs match a float64 RMSNorm + rotate_half rotation to
f32 accuracy. `--mutants` requires deliberate index mistakes in its copy of the
kernel to fail.

Usage: python3 kernels/twin/rope_kv_twin.py [--mutants]   (numpy; ~2 s)
"""
import argparse
import hashlib
import pathlib
import sys

import numpy as np

KERNEL = pathlib.Path(__file__).resolve().parents[1] / "src" / "rope_kv.cu"
# The kernel source this twin was last checked against: a different hash means the
# twin may no longer mirror the kernel (update both, then this hash).
KERNEL_SHA256 = "ea1a9eb0f751640cf622d498b33e8c34b8fa132ba390bc786d076d51a4d2d578"
WARPS = 8  # ROPE_WARPS
F32 = np.float32
EPS = F32(1e-6)


class TwinFault(Exception):
    """An access the kernel must never make."""


def variant(hd):
    """The kernel rocket picks for head_dim hd (kernels.rs): (D, ROPE_PAIRS, ROPE_GROUP)."""
    D = 64 if hd <= 64 else 128
    return D, D // 64, 5 if D <= 64 else 3


class Mem:
    """A flat f32 array whose reads outside [lo, hi) and whose writes are tracked."""

    def __init__(self, name, values):
        self.name, self.v = name, values.astype(F32).copy()
        self.writes = np.zeros(len(values), dtype=np.int64)

    def read(self, idx, mask, lo=0, hi=None):
        hi = len(self.v) if hi is None else hi
        idx = np.asarray(idx)
        bad = mask & ((idx < lo) | (idx >= hi))
        if bad.any():
            raise TwinFault(f"{self.name}: read at {idx[bad][:4]} outside [{lo}, {hi})")
        return np.where(mask, self.v[np.clip(idx, 0, len(self.v) - 1)], F32(0))

    def write(self, idx, vals, mask):
        idx = np.asarray(idx)
        if mask.any() and ((idx[mask] < 0) | (idx[mask] >= len(self.v))).any():
            raise TwinFault(f"{self.name}: write outside the buffer")
        self.v[idx[mask]] = np.asarray(vals, dtype=F32)[mask] if np.ndim(vals) else vals
        np.add.at(self.writes, idx[mask], 1)


def run_block(row, pos, qkv, cache, inv_freq, q_norm, k_norm, shape, layer, n_layers, mut):
    n_heads, n_kv, hd = shape
    D, PAIRS, GROUP = variant(hd)
    half, heads = hd // 2, n_heads + n_kv
    qd, kvd = n_heads * hd, n_kv * hd
    r0 = row * (qd + 2 * kvd)  # the row's qkv
    r_end = r0 + qd + 2 * kvd
    kc = (pos * n_layers + layer) * 2 * kvd  # the cache slot of (position, layer)
    if "kc_no_layer" in mut:
        kc = pos * n_layers * 2 * kvd
    lane = np.arange(32)
    # Values: float4 chunks, one per thread and round.
    for tid in range(WARPS * 32):
        for c in range(tid, kvd // 4, WARPS * 32):
            cc = c + 1 if "v_chunk" in mut else c
            src = r0 + qd + kvd + 4 * cc + np.arange(4)
            x = qkv.read(src, np.ones(4, bool), r0, r_end)
            dst = kc + kvd + 4 * c + np.arange(4)
            cache.write(dst, x, np.ones(4, bool))  # bf16 rounding is the cache's, not modelled
    for warp in range(WARPS):
        live = [lane + 32 * p < half for p in range(PAIRS)]
        if "no_live" in mut:
            live = [np.ones(32, bool) for _ in range(PAIRS)]
        fq = [inv_freq.read(lane + 32 * p, live[p], 0, half) for p in range(PAIRS)]
        nq1 = [q_norm.read(lane + 32 * p, live[p], 0, hd) if q_norm else None for p in range(PAIRS)]
        nq2 = [q_norm.read(lane + 32 * p + half, live[p], 0, hd) if q_norm else None for p in range(PAIRS)]
        nk1 = [k_norm.read(lane + 32 * p, live[p], 0, hd) if k_norm else None for p in range(PAIRS)]
        nk2 = [k_norm.read(lane + 32 * p + half, live[p], 0, hd) if k_norm else None for p in range(PAIRS)]
        if "norm_swap" in mut:
            nq1, nk1 = nk1, nq1
        ang = [F32(pos) * fq[p] for p in range(PAIRS)]
        sn = [np.sin(a.astype(np.float64)).astype(F32) for a in ang]
        cs = [np.cos(a.astype(np.float64)).astype(F32) for a in ang]
        step = WARPS if "group_stride" in mut else WARPS * GROUP
        for first in range(warp, heads, step):
            x1, x2 = [], []
            for g in range(GROUP):
                head = first + g * WARPS
                h = r0 + head * hd if head < n_heads else r0 + qd + (head - n_heads) * hd
                if "k_from_v" in mut and head >= n_heads:
                    h = r0 + qd + kvd + (head - n_heads) * hd
                po = 16 if "pair_stride" in mut else 32
                x1.append([qkv.read(h + lane + po * p, (head < heads) & live[p], r0, r_end) for p in range(PAIRS)])
                off = hd if "half_off" in mut else half
                x2.append([qkv.read(h + lane + po * p + off, (head < heads) & live[p], r0, r_end) for p in range(PAIRS)])
            for g in range(GROUP):
                head = first + g * WARPS
                if head >= heads:
                    break
                is_q = head < n_heads
                nw = q_norm if is_q else k_norm
                scale = F32(1)
                if nw is not None:
                    ss = np.zeros(32, F32)
                    for p in range(PAIRS):
                        ss = ss + x1[g][p] * x1[g][p]
                    if "norm_x1_only" not in mut:
                        for p in range(PAIRS):
                            ss = ss + x2[g][p] * x2[g][p]
                    scale = F32(1) / np.sqrt(F32(ss.sum(dtype=F32)) / F32(hd) + EPS)
                for p in range(PAIRS):
                    i = lane + 32 * p
                    n1 = nq1[p] if is_q else nk1[p]
                    n2 = nq2[p] if is_q else nk2[p]
                    a = n1 * (x1[g][p] * scale) if nw is not None else x1[g][p]
                    b = n2 * (x2[g][p] * scale) if nw is not None else x2[g][p]
                    y1 = a * cs[p] + b * sn[p] if "sin_sign" in mut else a * cs[p] - b * sn[p]
                    y2 = b * cs[p] + a * sn[p]
                    m = live[p]
                    if is_q:
                        qkv.write(r0 + head * hd + i, y1, m)
                        qkv.write(r0 + head * hd + i + half, y2, m)
                    else:
                        kh = kc + (head - n_heads) * hd
                        cache.write(kh + i, y1, m)
                        cache.write(kh + i + half, y2, m)


def reference(x, nw, pos, inv_freq, hd):
    """float64 RMSNorm (when nw) and HF rotate_half rotation of one head."""
    x = x.astype(np.float64)
    if nw is not None:
        x = x / np.sqrt(np.mean(x * x) + float(EPS)) * nw.astype(np.float64)
    half = hd // 2
    ang = pos * inv_freq.astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    return np.concatenate([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s])


def check(shape, normed, rng, mut=frozenset()):
    n_heads, n_kv, hd = shape
    qd, kvd = n_heads * hd, n_kv * hd
    rows, n_layers, layer, positions = 3, 4, 2, [0, 37, 300]
    ctx = max(positions) + 1
    qkv0 = rng.standard_normal(rows * (qd + 2 * kvd)).astype(F32)
    qkv = Mem("qkv", qkv0)
    cache = Mem("cache", np.full(ctx * n_layers * 2 * kvd, np.nan, F32))
    inv_freq = Mem("inv_freq", (500000.0 ** (-np.arange(hd // 2) * 2.0 / hd)).astype(F32))
    q_norm = Mem("q_norm", rng.uniform(0.5, 1.5, hd)) if normed else None
    k_norm = Mem("k_norm", rng.uniform(0.5, 1.5, hd)) if normed else None
    for row, pos in enumerate(positions):
        run_block(row, pos, qkv, cache, inv_freq, q_norm, k_norm, shape, layer, n_layers, mut)
    stride = qd + 2 * kvd
    want_q = np.zeros(len(qkv.v), np.int64)
    want_c = np.zeros(len(cache.v), np.int64)
    for row, pos in enumerate(positions):
        r0 = row * stride
        want_q[r0:r0 + qd] = 1
        kc = (pos * n_layers + layer) * 2 * kvd
        want_c[kc:kc + 2 * kvd] = 1
        for head in range(n_heads + n_kv):
            is_q = head < n_heads
            src = r0 + (head * hd if is_q else qd + (head - n_heads) * hd)
            nw = (q_norm if is_q else k_norm)
            ref = reference(qkv0[src:src + hd], nw.v if nw else None, pos, inv_freq.v, hd)
            got = qkv.v[src:src + hd] if is_q else cache.v[kc + (head - n_heads) * hd:][:hd]
            err = np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))
            if not err <= 2e-5:
                raise AssertionError(f"{shape} row {row} head {head}: rel error {err:.2e} against float64")
        v = cache.v[kc + kvd:kc + 2 * kvd]
        if not np.array_equal(v, qkv0[r0 + qd + kvd:r0 + stride]):
            raise AssertionError(f"{shape} row {row}: the values' cache slot is not the row's values")
    for name, got, want in (("qkv", qkv.writes, want_q), ("cache", cache.writes, want_c)):
        if not np.array_equal(got, want):
            bad = np.flatnonzero(got != want)
            raise AssertionError(f"{shape}: {name} writes {sorted(set(got[bad]))} where {sorted(set(want[bad]))} are due")


# (n_heads, n_kv, head_dim), Qwen3's norms: the fuels, the tiny fixture's head_dim, and
# shapes with a second group a warp holds or a group left partly empty.
SHAPES = [
    ((9, 3, 64), False),  # SmolLM2-135M
    ((32, 8, 64), False),  # Llama-3.2-1B: 40 heads, 5 a warp
    ((16, 8, 128), True),  # Qwen3-0.6B and 1.7B
    ((4, 2, 32), True),  # tiny fixture's head_dim: lanes 16-31 hold no pair
    ((40, 8, 64), False),  # 48 heads: a second group per warp
    ((24, 8, 128), True),  # 32 heads: a second group at head_dim 128
    ((3, 1, 128), False),  # fewer heads than warps
]

MUTANTS = {
    "group_stride": "a warp's next group starts 8 heads on, not 8 x ROPE_GROUP",
    "no_live": "pairs past head_dim / 2 not masked (head_dim 32)",
    "norm_swap": "q's first-half norm weights taken from k_norm",
    "pair_stride": "a lane's pairs 16 apart instead of 32",
    "half_off": "the second element of a pair head_dim apart",
    "k_from_v": "k heads read from the values' part of the row",
    "norm_x1_only": "the norm's sum of squares over the first halves only",
    "sin_sign": "the first element rotated with +sin",
    "v_chunk": "the values read a chunk off",
    "kc_no_layer": "the cache slot without the layer",
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", action="store_true", help="require each deliberate mistake to fail")
    args = ap.parse_args()
    digest = hashlib.sha256(KERNEL.read_bytes()).hexdigest()
    if digest != KERNEL_SHA256:
        print(f"{KERNEL} changed (sha256 {digest}): check the twin against it, then update KERNEL_SHA256")
        return 1
    rng = np.random.default_rng(7)
    for shape, normed in SHAPES:
        check(shape, normed, rng)
        print(f"ok  {shape} norms {'on' if normed else 'off'} (kernel hd{variant(shape[2])[0]})")
    if args.mutants:
        caught = 0
        for name, what in MUTANTS.items():
            try:
                for shape, normed in SHAPES:
                    check(shape, normed, np.random.default_rng(7), frozenset([name]))
                print(f"  MISSED  {name}: {what}")
            except (AssertionError, TwinFault) as e:
                caught += 1
                print(f"  caught  {name}: {what} -> {type(e).__name__}: {str(e)[:90]}")
        print(f"mutants: {caught}/{len(MUTANTS)} caught")
        if caught != len(MUTANTS):
            return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU check of kernels/src/gemm_f16.cu's shared-memory layouts and fragment maps.

The fp16 GEMM stages weight and input blocks with cp.async into 128-byte-swizzled
tiles of a ring it aligns by hand, hands the tensor cores matrix descriptors (both
operands K-major), and stores the wgmma accumulators to y or to split-K partials.
None of it runs here, but all of it is arithmetic: this script replays the kernel's
copy addresses and descriptors (copied expressions), reads every operand element
back through the PTX ISA's canonical K-major layout with the 128-byte swizzle
(Swizzle<3,4,3> on the byte address), and requires each to be the element the
kernel meant: W[64 g + m][16 kk + q] for warpgroup g's A operand at k-step kk,
x[n][16 kk + q] for the B operand. It also checks that the threads stage every
16-byte chunk of a block exactly once, that the ring's slots stay inside the
allocation the host grants (gemm_f16.rs computes the same bytes), and that the
kernel's output map sends each accumulator register (the wgmma D fragment: warp w
of a warpgroup holds rows 16 w .., lane l rows l / 4 and + 8, columns 2 (l % 4) and
+ 1 of each 8-column group) to one (input row, weight row) of the tile, every one
exactly once. Split K: each split's partial lies in its drained ring, the splits'
slices of the tile's words cover it once at every cluster size 2-8, and the sum of a
word stores to the elements the thread that wrote it holds.

`--mutants` requires deliberate mistakes (no warpgroup offset on A, a 512-byte stride
offset, a 16-byte k-step, inputs staged without the swizzle, the ring used unaligned,
the output's row and column halves swapped, split slices that skip a word, ...) to fail. Keep it in step with the
kernel: the kernel's hash is checked, as the other twins do.

Usage: python3 kernels/twin/gemm_f16_layout.py [--mutants]
"""

import argparse
import hashlib
import pathlib
import sys

from wgmma_layout import desc, read_kmajor, swizzled

KERNEL = pathlib.Path(__file__).resolve().parents[1] / "src" / "gemm_f16.cu"
KERNEL_SHA256 = "70360010d1e1aa32cdc56f0facdb1b7a83eece50740afc48457e41464ba5afff"

TILE_N, KB, THREADS, ALIGN = 128, 64, 256, 1024
SMEM_LIMIT = 227 * 1024
# Where the dynamic buffer may start: the kernel's static word comes first.
SMEM_BASES = (0, 16, 1008)


def d_fragment(warp4, lane, i):
    """The PTX ISA's wgmma D fragment (f32 accumulators): register i of lane `lane` of
    warp warp4 of the warpgroup holds (row of M, column of N)."""
    return 16 * warp4 + lane // 4 + 8 * ((i % 4) // 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


class Kernel:
    """gemm_f16.cu's expressions for one instantiation MT; a mutant overrides one."""

    def __init__(self, mt, smem_base):
        self.mt = mt
        self.M = 32 * mt
        self.NF = 4 * mt
        self.W_BYTES = TILE_N * KB * 2
        self.X_BYTES = self.M * KB * 2
        self.STAGE_BYTES = self.W_BYTES + self.X_BYTES
        fit = (SMEM_LIMIT - ALIGN) // self.STAGE_BYTES
        self.STAGES = min(8, fit)
        self.BYTES = self.STAGES * self.STAGE_BYTES + ALIGN  # Layout<MT>::BYTES, gemm_f16_smem_bytes
        self.smem_base = smem_base
        self.ring = (smem_base + ALIGN - 1) & ~(ALIGN - 1)

    def w_copy(self, tid, i):
        """Copies: (weight row, chunk) of thread tid's i-th weight chunk and its offset in the stage."""
        idx = tid + i * THREADS
        r, c = idx >> 3, idx & 7
        return r, c, swizzled(r, c)

    def x_copy(self, tid, i):
        idx = tid + i * THREADS
        r, c = idx >> 3, idx & 7
        return r, c, self.W_BYTES + swizzled(r, c)

    def slot(self, i):
        return self.ring + (i % self.STAGES) * self.STAGE_BYTES

    def descs(self, i, wg, kk):
        w_tile = self.slot(i) + wg * 64 * 128
        x_tile = self.slot(i) + self.W_BYTES
        return desc(w_tile + 32 * kk, 16, 1024), desc(x_tile + 32 * kk, 16, 1024)

    def out(self, tid, f, e):
        """The store loop: (input row, weight row) within the tile of acc[f][e]."""
        warp, lane = tid >> 5, tid & 31
        g, t = lane >> 2, lane & 3
        wg, w4 = warp >> 2, warp & 3
        h, ee = e >> 1, e & 1
        return 8 * f + 2 * t + ee, 64 * wg + 16 * w4 + g + 8 * h

    def partial_word(self, f, tid):
        """float4 index in the drained ring of thread tid's accumulator word f."""
        return f * THREADS + tid

    def slice(self, split, splits):
        """The partial's words split `split` of `splits` sums."""
        words = self.NF * THREADS
        return split * words // splits, (split + 1) * words // splits

    def word_owner(self, w):
        """store4's (thread, word) for summed word w."""
        return w % THREADS, w // THREADS


def check(kern):
    M = kern.M
    assert kern.BYTES <= SMEM_LIMIT, f"{kern.BYTES} bytes of shared memory: past one CTA per SM"
    assert kern.ring % ALIGN == 0, "the ring off the swizzle's 1,024-byte period"
    assert kern.W_BYTES % ALIGN == 0 and kern.STAGE_BYTES % ALIGN == 0, "a tile off the period"
    for i in range(2 * kern.STAGES):  # the block loop's slots, round the ring twice
        assert kern.smem_base <= kern.slot(i) and kern.slot(i) + kern.STAGE_BYTES <= kern.smem_base + kern.BYTES, "the ring past the allocation"

    # Staging: every (row, chunk) of a block exactly once; where it lands.
    w_at, x_at = {}, {}
    for tid in range(THREADS):
        for i in range(TILE_N * 8 // THREADS):
            r, c, off = kern.w_copy(tid, i)
            assert (r, c) not in w_at, f"weight chunk ({r}, {c}) staged twice"
            w_at[(r, c)] = off
        for i in range(M * 8 // THREADS):
            r, c, off = kern.x_copy(tid, i)
            assert (r, c) not in x_at, f"input chunk ({r}, {c}) staged twice"
            x_at[(r, c)] = off
    assert len(w_at) == TILE_N * 8 and len(x_at) == M * 8, "a chunk never staged"
    offs = sorted(list(w_at.values()) + list(x_at.values()))
    assert len(set(offs)) == len(offs) and offs[0] >= 0 and offs[-1] + 16 <= kern.STAGE_BYTES, "chunks collide"

    # Every operand element each k-step's wgmma reads, in two ring slots.
    for i in (0, kern.STAGES + 1):
        base = kern.slot(i)
        for wg in range(2):
            for kk in range(KB // 16):
                a, b = kern.descs(i, wg, kk)
                for q in range(16):
                    k = 16 * kk + q
                    for m in range(64):
                        want = base + w_at[(64 * wg + m, k // 8)] + (k % 8) * 2
                        assert read_kmajor(a, m, q) == want, f"A of warpgroup {wg}, k-step {kk}: W[{64 * wg + m}][{k}] misread"
                    for n in range(M):
                        want = base + x_at[(n, k // 8)] + (k % 8) * 2
                        assert read_kmajor(b, n, q) == want, f"B at k-step {kk}: x[{n}][{k}] misread"

    # Outputs: the kernel's map is the D fragment's, and it covers the tile once.
    seen = set()
    for tid in range(THREADS):
        warp, lane = tid >> 5, tid & 31
        for f in range(kern.NF):
            for e in range(4):
                row_m, col_n = d_fragment(warp & 3, lane, 4 * f + e)
                m, n = kern.out(tid, f, e)
                assert (m, n) == (col_n, 64 * (warp >> 2) + row_m), f"acc[{f}][{e}] of thread {tid} stored at the wrong element"
                assert (m, n) not in seen, f"({m}, {n}) stored twice"
                seen.add((m, n))
    assert len(seen) == M * TILE_N, "an output never stored"

    # Split K: the partials' words apart and inside the drained ring; every word in
    # one split's slice; a summed word stored where its writer's registers belong.
    words = {kern.partial_word(f, tid): (tid, f) for f in range(kern.NF) for tid in range(THREADS)}
    assert len(words) == kern.NF * THREADS, "partial words collide"
    assert min(words) >= 0 and (max(words) + 1) * 16 <= kern.STAGES * kern.STAGE_BYTES, "partials past the ring"
    for splits in range(2, 9):
        owned = [w for s in range(splits) for w in range(*kern.slice(s, splits))]
        assert sorted(owned) == sorted(words), f"{splits} splits' slices do not cover the tile once"
    for w, (tid, f) in words.items():
        i, ff = kern.word_owner(w)
        assert [kern.out(i, ff, e) for e in range(4)] == [kern.out(tid, f, e) for e in range(4)], f"summed word {w} stored at another thread's elements"


def mutants():
    class NoWarpgroupOffset(Kernel):
        def descs(self, i, wg, kk):
            return desc(self.slot(i) + 32 * kk, 16, 1024), desc(self.slot(i) + self.W_BYTES + 32 * kk, 16, 1024)

    class Sbo512(Kernel):
        def descs(self, i, wg, kk):
            a, b = Kernel.descs(self, i, wg, kk)
            return a, desc(self.slot(i) + self.W_BYTES + 32 * kk, 16, 512)

    class Step16(Kernel):
        def descs(self, i, wg, kk):
            w_tile = self.slot(i) + wg * 64 * 128
            return desc(w_tile + 16 * kk, 16, 1024), desc(self.slot(i) + self.W_BYTES + 16 * kk, 16, 1024)

    class XUnswizzled(Kernel):
        def x_copy(self, tid, i):
            idx = tid + i * THREADS
            r, c = idx >> 3, idx & 7
            return r, c, self.W_BYTES + r * 128 + c * 16

    class Unaligned(Kernel):
        def __init__(self, mt, smem_base):
            super().__init__(mt, smem_base)
            self.ring = smem_base

    class NoSlack(Kernel):
        def __init__(self, mt, smem_base):
            super().__init__(mt, smem_base)
            self.BYTES = self.STAGES * self.STAGE_BYTES

    class SlotPastRing(Kernel):
        def slot(self, i):
            return self.ring + (i % (self.STAGES + 1)) * self.STAGE_BYTES

    class HalvesSwapped(Kernel):
        def out(self, tid, f, e):
            m, n = Kernel.out(self, tid, f, (e & 1) * 2 + (e >> 1))
            return m, n

    class WarpRowsOff(Kernel):
        def out(self, tid, f, e):
            m, n = Kernel.out(self, tid, f, e)
            return m, n - 16 * ((tid >> 5) & 3) + 8 * ((tid >> 5) & 3)

    class BReadsWeights(Kernel):
        def descs(self, i, wg, kk):
            a, _ = Kernel.descs(self, i, wg, kk)
            return a, desc(self.slot(i) + 32 * kk, 16, 1024)

    class PartialsOverlap(Kernel):
        def partial_word(self, f, tid):
            return f * 32 + tid

    class SliceGap(Kernel):
        def slice(self, split, splits):
            lo, hi = Kernel.slice(self, split, splits)
            return lo, hi - (split == splits - 1)

    class OwnerSwapped(Kernel):
        def word_owner(self, w):
            return w // self.NF, w % self.NF

    return [
        ("no_wg_offset", "both warpgroups read weight rows 0-63", NoWarpgroupOffset),
        ("sbo_512", "the inputs' stride byte offset 512 (8 rows of 64 bytes)", Sbo512),
        ("step_16", "a 16-byte k-step (8 fp16) within the 128-byte rows", Step16),
        ("x_unswizzled", "inputs staged without the swizzle the descriptor names", XUnswizzled),
        ("unaligned", "the dynamic buffer used as it comes, off the 1,024-byte period", Unaligned),
        ("no_slack", "the allocation without the alignment's 1,024 bytes", NoSlack),
        ("slot_past_ring", "block i in slot i % (STAGES + 1)", SlotPastRing),
        ("halves_swapped", "a register's row half and column pair swapped in the store", HalvesSwapped),
        ("warp_rows_off", "warps 8 weight rows apart instead of 16", WarpRowsOff),
        ("b_reads_weights", "the B descriptor pointed at the weight tile", BReadsWeights),
        ("partials_overlap", "partial words laid out with a warp's stride for a CTA's", PartialsOverlap),
        ("slice_gap", "the last split's slice one word short", SliceGap),
        ("owner_swapped", "a summed word stored as word-major instead of thread-major", OwnerSwapped),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", action="store_true", help="also require each deliberate mistake to fail")
    args = ap.parse_args()
    if hashlib.sha256(KERNEL.read_bytes()).hexdigest() != KERNEL_SHA256:
        print(f"WARNING: {KERNEL} changed since this check was written against it; re-read the kernel and update it")
    for mt in (2, 4):
        for base in SMEM_BASES:
            check(Kernel(mt, base))
        print(f"m{mt}: staging, every W and x element the descriptors read, the output and partial maps: OK")
    if args.mutants:
        missed = []
        for name, what, cls in mutants():
            caught = []
            for mt in (2, 4):
                for base in SMEM_BASES:
                    try:
                        check(cls(mt, base))
                    except AssertionError as e:
                        caught.append(f"m{mt} base {base}: {e}")
            if caught:
                print(f"  caught  {name}: {what} -> {caught[0]}")
            else:
                print(f"  MISSED  {name}: {what}")
                missed.append(name)
        print(f"mutants: {len(mutants()) - len(missed)}/{len(mutants())} caught")
        if missed:
            sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()

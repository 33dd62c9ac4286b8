"""CPU check of kernels/src/attention_prefill_wg.cu's shared-memory layouts.

The wgmma kernel stages keys and values with cp.async and stores the queries itself
into 128-byte-swizzled tiles, then hands the tensor cores matrix descriptors. Neither
side can be run here, but both are arithmetic: this script replays the kernel's
staging and query-store addresses (copied expressions), decodes the descriptors the
kernel builds, and reads every operand element back through the PTX ISA's canonical
layouts (wgmma "Shared Memory Matrix Layout": K-major and MN-major with the 128-byte
swizzle, Swizzle<3,4,3> on the byte address). Each element an MMA reads must be the
one the kernel meant: Q[row][k] and K[key][k] for the scores' k-step ks, V[key][dim]
for P V's k-step j. It also checks that the threads stage every (key, 16-byte chunk)
of a tile exactly once and that the buffers fit PREFILL_WG_SMEM_BYTES.

`--mutants` requires deliberate mistakes (a wrong stride byte offset, no swizzle on one
side, a 16-byte k-step, V read as K-major, ...) to fail. Keep it in step with the kernel:
the kernel's hash is checked, as kernels/twin/attention_prefill_twin.py does.

Usage: python3 kernels/twin/attention_prefill_wg_layout.py [--mutants]
"""

import argparse
import hashlib
import pathlib
import sys

from wgmma_layout import desc, read_kmajor, read_mnmajor, swizzled

KERNEL = pathlib.Path(__file__).resolve().parents[1] / "src" / "attention_prefill_wg.cu"
KERNEL_SHA256 = "2222a183f0bf850747539b210f3dc37185eb72a909b211f64d83dc0b4ac96220"

T = 64  # PREFILL_TILE: query rows per CTA and key positions per tile
THREADS = 128  # PREFILL_THREADS


class Kernel:
    """The kernel's address expressions for head_dim D; a mutant overrides one."""

    def __init__(self, D, smem_base):
        self.D = D
        self.SUB = T * 128
        self.TILE_BYTES = T * D * 2
        self.smem0 = (smem_base + 1023) & ~1023
        self.k_buf = [self.smem0, self.smem0 + self.TILE_BYTES]
        self.v_buf = [self.smem0 + 2 * self.TILE_BYTES, self.smem0 + 3 * self.TILE_BYTES]
        self.q_hi = self.smem0 + 4 * self.TILE_BYTES
        self.q_lo = self.q_hi + self.TILE_BYTES
        self.smem_bytes = 3 * 2 * T * D * 2 + 1024  # PREFILL_WG_SMEM_BYTES(D)

    def my_off(self, tid):
        chunk_cols = self.D // 8
        my_key, my_chunk = tid // chunk_cols, tid % chunk_cols
        return (my_chunk // 8) * self.SUB + swizzled(my_key, my_chunk % 8)

    def staged(self, tid, j):
        """(key, 16-byte chunk of dims) thread tid copies in round j, and its byte offset in the tile."""
        chunk_cols = self.D // 8
        key_step = THREADS // chunk_cols
        my_key, my_chunk = tid // chunk_cols, tid % chunk_cols
        return my_key + j * key_step, my_chunk, self.my_off(tid) + j * key_step * 128

    def q_store(self, r, col):
        return (col // 64) * self.SUB + swizzled(r, (col % 64) // 8) + (col % 8) * 2

    def score_descs(self, kbase, ks):
        step = (ks // 4) * self.SUB + (ks % 4) * 32
        return desc(self.q_hi + step, 16, 1024), desc(self.q_lo + step, 16, 1024), desc(kbase + step, 16, 1024)

    def pv_desc(self, vbase, j):
        return desc(vbase + j * 16 * 128, self.SUB, 1024)

    read_b_v = staticmethod(read_mnmajor)


def check(kern):
    D = kern.D
    # Buffers: 1,024-aligned (the swizzle pattern's period), inside the allocation, apart.
    regions = kern.k_buf + kern.v_buf + [kern.q_hi, kern.q_lo]
    assert all(a % 1024 == 0 for a in regions), "a tile off the 1,024-byte pattern"
    assert kern.q_lo + kern.TILE_BYTES - SMEM_BASE <= kern.smem_bytes, "buffers past the allocation"
    assert sorted(regions) == [kern.smem0 + i * kern.TILE_BYTES for i in range(6)], "buffers overlap"

    # Staging: every (key, chunk) of a tile exactly once; where it lands.
    rounds = T // (THREADS // (D // 8))
    where = {}
    for tid in range(THREADS):
        for j in range(rounds):
            key, chunk, off = kern.staged(tid, j)
            assert (key, chunk) not in where, f"chunk ({key}, {chunk}) staged twice"
            where[(key, chunk)] = off
    assert len(where) == T * D // 8, "a chunk never staged"
    offs = sorted(where.values())
    assert len(set(offs)) == len(offs) and offs[0] >= 0 and offs[-1] + 16 <= kern.TILE_BYTES, "chunks collide"

    def tile_elem(base, key, dim):
        return base + where[(key, dim // 8)] + (dim % 8) * 2

    # Queries: each thread's fragment words (mma A layout) at q_store; the element map.
    q_at = {}
    for warp in range(4):
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            for ks in range(D // 16):
                for i in range(4):
                    r = warp * 16 + g + 8 * (i & 1)
                    col = ks * 16 + 2 * c + 8 * (i >> 1)
                    at = kern.q_store(r, col)
                    for e in range(2):
                        assert (r, col + e) not in q_at, "a query element stored twice"
                        q_at[(r, col + e)] = at + 2 * e
    assert len(q_at) == T * D and len(set(q_at.values())) == T * D, "query stores collide or miss"

    for b in range(2):
        kbase, vbase = kern.k_buf[b], kern.v_buf[b]
        # S = Q K^T, k-step ks: A (64 rows x 16) and B (64 keys x 16), both K-major.
        for ks in range(D // 16):
            dq_hi, dq_lo, dk = kern.score_descs(kbase, ks)
            for r in range(T):
                for kk in range(16):
                    col = ks * 16 + kk
                    assert read_kmajor(dq_hi, r, kk) == kern.q_hi + q_at[(r, col)], f"Q hi ({r}, {col}) misread at ks {ks}"
                    assert read_kmajor(dq_lo, r, kk) == kern.q_lo + q_at[(r, col)], f"Q lo ({r}, {col}) misread at ks {ks}"
                    assert read_kmajor(dk, r, kk) == tile_elem(kbase, r, col), f"K ({r}, {col}) misread at ks {ks}"
        # O += P V, k-step j: B (16 keys x D dims), MN-major.
        for j in range(T // 16):
            dv = kern.pv_desc(vbase, j)
            for kk in range(16):
                for n in range(D):
                    assert kern.read_b_v(dv, kk, n) == tile_elem(vbase, 16 * j + kk, n), f"V ({16 * j + kk}, {n}) misread at j {j}"


SMEM_BASE = 0x40  # a dynamic buffer that does not start on 1,024 bytes: the kernel aligns it


def mutants():
    """(name, what it breaks, a Kernel subclass)."""

    class NoStageSwizzle(Kernel):
        def my_off(self, tid):
            chunk_cols = self.D // 8
            my_key, my_chunk = tid // chunk_cols, tid % chunk_cols
            return (my_chunk // 8) * self.SUB + my_key * 128 + ((my_chunk % 8) << 4)

    class NoQSwizzle(Kernel):
        def q_store(self, r, col):
            return (col // 64) * self.SUB + r * 128 + (((col % 64) // 8) << 4) + (col % 8) * 2

    class SboHalf(Kernel):
        def score_descs(self, kbase, ks):
            step = (ks // 4) * self.SUB + (ks % 4) * 32
            return desc(self.q_hi + step, 16, 512), desc(self.q_lo + step, 16, 512), desc(kbase + step, 16, 512)

    class KStep16(Kernel):
        def score_descs(self, kbase, ks):
            step = (ks // 4) * self.SUB + (ks % 4) * 16
            return desc(self.q_hi + step, 16, 1024), desc(self.q_lo + step, 16, 1024), desc(kbase + step, 16, 1024)

    class NoSubTile(Kernel):
        def score_descs(self, kbase, ks):
            step = ks * 32
            return desc(self.q_hi + step, 16, 1024), desc(self.q_lo + step, 16, 1024), desc(kbase + step, 16, 1024)

    class VLboWrong(Kernel):
        def pv_desc(self, vbase, j):
            return desc(vbase + j * 16 * 128, 1024, 1024)

    class VStep1024(Kernel):
        def pv_desc(self, vbase, j):
            return desc(vbase + j * 1024, self.SUB, 1024)

    class VKMajor(Kernel):
        @staticmethod
        def read_b_v(d, kk, n):
            return read_kmajor(d, n, kk)

    class NoAlign(Kernel):
        def __init__(self, D, smem_base):
            super().__init__(D, smem_base)
            shift = smem_base - self.smem0
            self.smem0 += shift
            self.k_buf = [a + shift for a in self.k_buf]
            self.v_buf = [a + shift for a in self.v_buf]
            self.q_hi += shift
            self.q_lo += shift

    class QOverV(Kernel):
        def __init__(self, D, smem_base):
            super().__init__(D, smem_base)
            self.q_hi = self.smem0 + 3 * self.TILE_BYTES
            self.q_lo = self.q_hi + self.TILE_BYTES

    return [
        ("no_stage_swizzle", "keys and values staged without the XOR", NoStageSwizzle),
        ("no_q_swizzle", "queries stored without the XOR", NoQSwizzle),
        ("sbo_half", "512 bytes from 8 rows to the next in the score descriptors", SboHalf),
        ("kstep_16", "a 16-byte k-step within the 128-byte rows", KStep16),
        ("no_sub_tile", "k-steps past 64 dimensions stay in the first sub-tile", NoSubTile),
        ("v_lbo", "V's 64-dimension blocks 1,024 bytes apart", VLboWrong),
        ("v_step", "V's k-step 1,024 bytes (8 keys) instead of 2,048", VStep1024),
        ("v_kmajor", "V read as a K-major operand (transpose bit off)", VKMajor),
        ("no_align", "the dynamic buffer used as it comes, off the 1,024-byte pattern", NoAlign),
        ("q_over_v", "the queries placed over the second value tile", QOverV),
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", action="store_true", help="also require each deliberate mistake to fail")
    args = ap.parse_args()
    if hashlib.sha256(KERNEL.read_bytes()).hexdigest() != KERNEL_SHA256:
        print(f"WARNING: {KERNEL} changed since this check was written against it; re-read the kernel and update it")
    for D in (64, 128):
        check(Kernel(D, SMEM_BASE))
        print(f"head_dim {D}: staging, query stores and every Q, K, V element the descriptors read: OK")
    if args.mutants:
        missed = []
        for name, what, cls in mutants():
            caught = []
            for D in (64, 128):
                try:
                    check(cls(D, SMEM_BASE))
                except AssertionError as e:
                    caught.append(f"hd{D}: {e}")
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

"""Write tests/gguf/quant_blocks.bin: random raw GGUF blocks of every quantized type
rocket reads, with the `gguf` package's numpy dequantization of each as the expected
f32 output. The Rust test `weights::dequant::tests::matches_gguf_reference` asserts bit
equality against it.

Blocks include extreme half-precision scales (±65504, the smallest subnormal, ±0, the
smallest normal), every 6-bit sub-scale at 0 and at 63 (all scale bytes 0x00 / 0xff),
and all-zero / all-max quants, besides uniformly random bytes.

Record layout (little endian): u32 ggml type id, u32 block count, raw blocks, then
block count × block size f32 values.  Run: python tests/gguf/make_quant_blocks.py
"""
import struct
import sys
from pathlib import Path

import numpy as np
from importlib.metadata import version

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

# Byte offsets of the f16 scale fields (d, dmin / m) of each block, and the byte
# range of the packed sub-block scales, where the type has them.
LAYOUT = {
    T.Q4_0: ([0], None),
    T.Q4_1: ([0, 2], None),
    T.Q5_0: ([0], None),
    T.Q5_1: ([0, 2], None),
    T.Q8_0: ([0], None),
    T.Q2_K: ([80, 82], (0, 16)),
    T.Q3_K: ([108], (96, 108)),
    T.Q4_K: ([0, 2], (4, 16)),
    T.Q5_K: ([0, 2], (4, 16)),
    T.Q6_K: ([208], (192, 208)),
    T.IQ4_XS: ([0], (2, 8)),
}
EXTREME_HALVES = [65504.0, -65504.0, 2.0**-24, -(2.0**-24), 0.0, -0.0, 2.0**-14, 1.0, -1.0]


def blocks_for(qtype, rng):
    _, nbytes = GGML_QUANT_SIZES[qtype]
    halves, scales = LAYOUT[qtype]
    out = []
    # Random bytes with random finite scales (uniform f16 bits could be NaN/inf).
    for _ in range(24):
        b = bytearray(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
        for off in halves:
            b[off:off + 2] = np.float16(rng.normal() * 10.0 ** rng.integers(-4, 3)).tobytes()
        out.append(b)
    # Extreme scales, each d/dmin field in turn, over random quants.
    for v in EXTREME_HALVES:
        for off in halves:
            b = bytearray(rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
            for o in halves:
                b[o:o + 2] = np.float16(rng.normal()).tobytes()
            b[off:off + 2] = np.float16(v).tobytes()
            out.append(b)
    # Sub-block scales all 0 / all 63 (all bits set), and quants all zero / all max.
    for fill_scales in [0x00, 0xFF, None]:
        for fill_quants in [0x00, 0xFF]:
            b = bytearray([fill_quants]) * nbytes
            for o in halves:
                b[o:o + 2] = np.float16(rng.normal()).tobytes()
            if scales is not None and fill_scales is not None:
                b[scales[0]:scales[1]] = bytes([fill_scales]) * (scales[1] - scales[0])
            out.append(b)
    # Max scale with max sub-scales and max quants: the largest magnitudes.
    b = bytearray([0xFF]) * nbytes
    for o in halves:
        b[o:o + 2] = np.float16(65504.0).tobytes()
    out.append(b)
    return bytes(b"".join(out)), len(out)


def main():
    rng = np.random.default_rng(27)
    path = Path(__file__).with_name("quant_blocks.bin")
    with open(path, "wb") as f:
        for qtype in LAYOUT:
            raw, n = blocks_for(qtype, rng)
            block_elems, _ = GGML_QUANT_SIZES[qtype]
            ref = dequantize(np.frombuffer(raw, dtype=np.uint8), qtype).astype(np.float32, copy=False)
            assert ref.size == n * block_elems and np.isfinite(ref).all(), qtype.name
            f.write(struct.pack("<II", int(qtype), n))
            f.write(raw)
            f.write(ref.astype("<f4").tobytes())
    print(f"wrote {path} ({path.stat().st_size} bytes, gguf {version('gguf')})", file=sys.stderr)


if __name__ == "__main__":
    main()

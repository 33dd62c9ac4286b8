//! GGUF block formats → f32 / bf16. Each quantized type stores fixed-size blocks
//! of consecutive elements of a row: 32 for the legacy types (Q4_0 … Q8_0), 256
//! for the K-quants and IQ4_XS. Layouts follow ggml's block structs; the order of
//! float operations (scale × sub-scale first, then × quant, then − min) is the
//! reference order, so results match other ggml readers bit for bit.

use half::{bf16, f16};
use rayon::prelude::*;

pub const QK: usize = 32;
pub const QK_K: usize = 256;

/// ggml tensor types rocket can read.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_XS,
}

/// Every readable type, for listings and tests.
pub const READABLE: [GgmlType; 14] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_XS,
];

/// The readable types' names, for the error that refuses another.
pub fn readable_names() -> String {
    READABLE.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

impl GgmlType {
    /// Map a ggml type id; unsupported ids give their ggml name for the error.
    pub fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            23 => GgmlType::IQ4_XS,
            30 => GgmlType::BF16,
            other => return Err(ggml_type_name(other)),
        })
    }

    /// The ggml name (as llama.cpp prints it).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::IQ4_XS => "IQ4_XS",
        }
    }

    /// (elements, bytes) of one block; float types are one element per "block".
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (QK, 18),
            GgmlType::Q4_1 => (QK, 20),
            GgmlType::Q5_0 => (QK, 22),
            GgmlType::Q5_1 => (QK, 24),
            GgmlType::Q8_0 => (QK, 34),
            GgmlType::Q2_K => (QK_K, 84),
            GgmlType::Q3_K => (QK_K, 110),
            GgmlType::Q4_K => (QK_K, 144),
            GgmlType::Q5_K => (QK_K, 176),
            GgmlType::Q6_K => (QK_K, 210),
            GgmlType::IQ4_XS => (QK_K, 136),
        }
    }

    pub fn is_quantized(self) -> bool {
        !matches!(self, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
    }

    /// Bytes for `n` elements, or None if `n` does not fill whole blocks.
    pub fn byte_len(self, n: usize) -> Option<usize> {
        let (block, bytes) = self.block();
        (n % block == 0).then(|| (n / block).checked_mul(bytes)).flatten()
    }
}

pub fn ggml_type_name(id: u32) -> String {
    let name = match id {
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("ggml type {id}"),
    };
    name.to_string()
}

fn half_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// f32 → bf16 bits, rounding to nearest even (NaN stays a quiet NaN), as
/// `half::bf16::from_f32` does, but branch-free for finite values so the
/// conversion loop vectorizes (it was half the load time of a bf16 load).
#[inline(always)]
fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The 6-bit (scale, min) pair `j` (0..8) of a Q4_K/Q5_K block's 12 packed bytes:
/// pairs 0..4 sit in the low 6 bits of bytes j and j+4; pairs 4..8 take their low
/// 4 bits from byte j+4 and their top 2 bits from the spare bits of bytes j-4 and j.
fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        (((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4)) as f32, ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as f32)
    }
}

const IQ4_NL_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// Dequantize one block `b` (exactly `kind.block().1` bytes) into `y` (`kind.block().0` values).
fn dequantize_block(kind: GgmlType, b: &[u8], y: &mut [f32]) {
    match kind {
        GgmlType::F32 => y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => y[0] = half_at(b, 0),
        GgmlType::BF16 => y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q8_0 => {
            let d = half_at(b, 0);
            for (j, v) in y.iter_mut().enumerate() {
                *v = d * (b[2 + j] as i8) as f32;
            }
        }
        GgmlType::Q4_0 => {
            let d = half_at(b, 0);
            for j in 0..QK / 2 {
                let q = b[2 + j];
                y[j] = d * ((q & 0x0f) as i32 - 8) as f32;
                y[j + QK / 2] = d * ((q >> 4) as i32 - 8) as f32;
            }
        }
        GgmlType::Q4_1 => {
            let (d, m) = (half_at(b, 0), half_at(b, 2));
            for j in 0..QK / 2 {
                let q = b[4 + j];
                y[j] = d * (q & 0x0f) as f32 + m;
                y[j + QK / 2] = d * (q >> 4) as f32 + m;
            }
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            // Q5_0: d, qh, qs (value − 16); Q5_1: d, m, qh, qs (value + m). Bit j of qh is
            // the fifth bit of element j.
            let (m, at) = if kind == GgmlType::Q5_1 { (half_at(b, 2), 4) } else { (0.0, 2) };
            let d = half_at(b, 0);
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            for j in 0..QK / 2 {
                let lo = (qs[j] & 0x0f) as u32 | ((qh >> j) & 1) << 4;
                let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                if kind == GgmlType::Q5_1 {
                    y[j] = d * lo as f32 + m;
                    y[j + QK / 2] = d * hi as f32 + m;
                } else {
                    y[j] = d * (lo as i32 - 16) as f32;
                    y[j + QK / 2] = d * (hi as i32 - 16) as f32;
                }
            }
        }
        GgmlType::Q2_K => {
            // scales[16] (low nibble: scale, high: min), qs[64] (2 bits), d, dmin.
            let (sc, qs) = (&b[..16], &b[16..80]);
            let (d, dmin) = (half_at(b, 80), half_at(b, 82));
            for (g, out) in y.chunks_exact_mut(16).enumerate() {
                // 16 groups of 16: half h = g/8 uses qs[32h..32h+32]; shift = 2·((g/2)%4); bytes 16·(g%2)..
                let (h, shift, off) = (g / 8, 2 * ((g / 2) % 4), 16 * (g % 2));
                let dl = d * (sc[g] & 0x0f) as f32;
                let ml = dmin * (sc[g] >> 4) as f32;
                for (l, v) in out.iter_mut().enumerate() {
                    *v = dl * ((qs[32 * h + off + l] >> shift) & 3) as f32 - ml;
                }
            }
        }
        GgmlType::Q3_K => {
            // hmask[32], qs[64], scales[12] (16 signed 6-bit), d.
            let (hmask, qs, s) = (&b[..32], &b[32..96], &b[96..108]);
            let d = half_at(b, 108);
            for (g, out) in y.chunks_exact_mut(16).enumerate() {
                let low = if g < 8 { s[g] & 0x0f } else { s[g - 8] >> 4 };
                let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
                let dl = d * ((low | high << 4) as i32 - 32) as f32;
                // Group g: half h = g/8, 2-bit plane j = (g/2)%4, bytes 16·(g%2)..; the hmask
                // bit (4h + j) set means "no −4 offset".
                let (h, j, off) = (g / 8, (g / 2) % 4, 16 * (g % 2));
                for (l, v) in out.iter_mut().enumerate() {
                    let q = ((qs[32 * h + off + l] >> (2 * j)) & 3) as i32;
                    let hb = (hmask[off + l] >> (4 * h + j)) & 1;
                    *v = dl * (q - if hb == 0 { 4 } else { 0 }) as f32;
                }
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]; 8 sub-blocks of 32.
            let (d, dmin, s) = (half_at(b, 0), half_at(b, 2), &b[4..16]);
            let (qh, qs) = if kind == GgmlType::Q5_K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
            for (sb, out) in y.chunks_exact_mut(32).enumerate() {
                let (sc, mn) = scale_min_k4(sb, s);
                let (d1, m1) = (d * sc, dmin * mn);
                let (q, shift) = (&qs[32 * (sb / 2)..32 * (sb / 2) + 32], 4 * (sb % 2));
                for (l, v) in out.iter_mut().enumerate() {
                    let mut x = (q[l] >> shift) & 0x0f;
                    if let Some(qh) = qh {
                        x |= ((qh[l] >> sb) & 1) << 4;
                    }
                    *v = d1 * x as f32 - m1;
                }
            }
        }
        GgmlType::Q6_K => {
            // ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] (i8), d.
            let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
            let d = half_at(b, 208);
            for (g, out) in y.chunks_exact_mut(16).enumerate() {
                let dl = d * (sc[g] as i8) as f32;
                // Element e of half h (128 each): quarter k = e/32, lane l = e%32.
                let h = g / 8;
                for (i, v) in out.iter_mut().enumerate() {
                    let e = (g % 8) * 16 + i;
                    let (k, l) = (e / 32, e % 32);
                    let lo = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0f;
                    let hi = (qh[32 * h + l] >> (2 * k)) & 3;
                    *v = dl * ((lo | hi << 4) as i32 - 32) as f32;
                }
            }
        }
        GgmlType::IQ4_XS => {
            // d, scales_h (u16: 2 bits per sub-block), scales_l[4] (nibbles), qs[128]; 8 sub-blocks of 32.
            let d = half_at(b, 0);
            let sh = u16::from_le_bytes([b[2], b[3]]);
            let (sl, qs) = (&b[4..8], &b[8..136]);
            for (ib, out) in y.chunks_exact_mut(32).enumerate() {
                let ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0x0f) as i32 | (((sh >> (2 * ib)) & 3) as i32) << 4;
                let dl = d * (ls - 32) as f32;
                let q = &qs[16 * ib..16 * ib + 16];
                for j in 0..16 {
                    out[j] = dl * IQ4_NL_VALUES[(q[j] & 0x0f) as usize] as f32;
                    out[j + 16] = dl * IQ4_NL_VALUES[(q[j] >> 4) as usize] as f32;
                }
            }
        }
    }
}

/// Blocks per parallel work item: large enough to amortise scheduling, small
/// enough that one big tensor (the embedding) spreads over every core.
const BLOCKS_PER_TASK: usize = 512;

/// Dequantize `data` (exactly `byte_len(out.len())` bytes) into f32.
pub fn dequantize_to_f32(kind: GgmlType, data: &[u8], out: &mut [f32]) {
    let (n, bytes) = kind.block();
    assert_eq!(Some(data.len()), kind.byte_len(out.len()), "{} data length", kind.name());
    out.par_chunks_mut(n * BLOCKS_PER_TASK).zip(data.par_chunks(bytes * BLOCKS_PER_TASK)).for_each(|(o, d)| {
        for (y, b) in o.chunks_exact_mut(n).zip(d.chunks_exact(bytes)) {
            dequantize_block(kind, b, y);
        }
    });
}

/// Dequantize `data` (exactly `byte_len(out.len())` bytes) into bf16 bits.
pub fn dequantize_to_bf16(kind: GgmlType, data: &[u8], out: &mut [u16]) {
    let (n, bytes) = kind.block();
    assert_eq!(Some(data.len()), kind.byte_len(out.len()), "{} data length", kind.name());
    if kind == GgmlType::BF16 {
        for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
            *o = u16::from_le_bytes([c[0], c[1]]);
        }
        return;
    }
    out.par_chunks_mut(n * BLOCKS_PER_TASK).zip(data.par_chunks(bytes * BLOCKS_PER_TASK)).for_each(|(o, d)| {
        let mut y = [0f32; QK_K];
        for (ob, b) in o.chunks_exact_mut(n).zip(d.chunks_exact(bytes)) {
            dequantize_block(kind, b, &mut y[..n]);
            for (v, &x) in ob.iter_mut().zip(&y[..n]) {
                *v = to_bf16(x);
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(bits: u16) -> f32 {
        bf16::from_bits(bits).to_f32()
    }

    #[test]
    fn q8_0_block() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        for j in 0..32 {
            block[2 + j] = (j as i8 - 16) as u8;
        }
        let mut out = vec![0u16; 32];
        dequantize_to_bf16(GgmlType::Q8_0, &block, &mut out);
        for (j, &v) in out.iter().enumerate() {
            assert_eq!(f(v), 0.5 * (j as f32 - 16.0));
        }
    }

    #[test]
    fn q4_0_and_q4_1_nibble_order() {
        let mut b0 = vec![0u8; 18];
        b0[..2].copy_from_slice(&f16::from_f32(2.0).to_bits().to_le_bytes());
        let mut b1 = vec![0u8; 20];
        b1[..2].copy_from_slice(&f16::from_f32(2.0).to_bits().to_le_bytes());
        b1[2..4].copy_from_slice(&f16::from_f32(-1.0).to_bits().to_le_bytes());
        for j in 0..16u8 {
            let q = j | ((15 - j) << 4);
            b0[2 + j as usize] = q;
            b1[4 + j as usize] = q;
        }
        let mut o0 = vec![0u16; 32];
        let mut o1 = vec![0u16; 32];
        dequantize_to_bf16(GgmlType::Q4_0, &b0, &mut o0);
        dequantize_to_bf16(GgmlType::Q4_1, &b1, &mut o1);
        for j in 0..16 {
            assert_eq!(f(o0[j]), 2.0 * (j as f32 - 8.0));
            assert_eq!(f(o0[j + 16]), 2.0 * ((15 - j) as f32 - 8.0));
            assert_eq!(f(o1[j]), 2.0 * j as f32 - 1.0);
            assert_eq!(f(o1[j + 16]), 2.0 * (15 - j) as f32 - 1.0);
        }
    }

    /// Every quantized type against the `gguf` package's numpy dequantizer, bit for
    /// bit (fixture written by tests/gguf/make_quant_blocks.py), through both the
    /// f32 path and the bf16 path rocket stores.
    #[test]
    fn matches_gguf_reference() {
        let data = include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/gguf/quant_blocks.bin"));
        let (mut seen, mut failures) = (Vec::new(), Vec::new());
        let mut pos = 0;
        let u32_at = |p: usize| u32::from_le_bytes(data[p..p + 4].try_into().unwrap());
        while pos < data.len() {
            let kind = GgmlType::from_id(u32_at(pos)).unwrap();
            let n_blocks = u32_at(pos + 4) as usize;
            let (elems, bytes) = kind.block();
            let raw = &data[pos + 8..pos + 8 + n_blocks * bytes];
            pos += 8 + raw.len();
            let want: Vec<f32> = data[pos..pos + n_blocks * elems * 4].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            pos += want.len() * 4;
            let mut got = vec![0f32; want.len()];
            dequantize_to_f32(kind, raw, &mut got);
            // Collect the first mismatch of every type so one run names each broken type.
            if let Some((i, (g, w))) = got.iter().zip(&want).enumerate().find(|(_, (g, w))| g.to_bits() != w.to_bits()) {
                failures.push(format!("{} element {i} (block {}): got {g}, gguf has {w}", kind.name(), i / elems));
            }
            let mut got16 = vec![0u16; want.len()];
            dequantize_to_bf16(kind, raw, &mut got16);
            if !got16.iter().zip(&want).all(|(&g, &w)| g == to_bf16(w)) {
                failures.push(format!("{} bf16 path differs", kind.name()));
            }
            seen.push(kind);
        }
        assert!(failures.is_empty(), "mismatches against gguf:\n{}", failures.join("\n"));
        let quantized: Vec<GgmlType> = READABLE.iter().copied().filter(|k| k.is_quantized()).collect();
        assert_eq!(seen, quantized, "fixture covers every readable quantized type");
    }

    /// Dequantizing a synthetic 1B-element Q4_K tensor set (the size of a 1B model's
    /// weights) to bf16, with the wall time printed: `cargo test -p rocket-core --lib
    /// q4_k_load_timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn q4_k_load_timing() {
        let (elems, bytes) = GgmlType::Q4_K.block();
        // 8 tensors of 2048 × 65536 = 1.07e9 elements.
        let tensors: Vec<Vec<u8>> = (0..8u32)
            .map(|t| {
                let mut raw: Vec<u8> = (0..2048 * 65536 / elems * bytes).map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(t) as u8 >> 1).collect();
                for b in raw.chunks_exact_mut(bytes) {
                    b[..4].copy_from_slice(&[0, 0x20, 0, 0x10]); // d, dmin finite
                }
                raw
            })
            .collect();
        let start = std::time::Instant::now();
        let out: Vec<Vec<u16>> = tensors
            .par_iter()
            .map(|raw| {
                let mut o = vec![0u16; raw.len() / bytes * elems];
                dequantize_to_bf16(GgmlType::Q4_K, raw, &mut o);
                o
            })
            .collect();
        let n: usize = out.iter().map(Vec::len).sum();
        eprintln!("Q4_K → bf16: {n} elements in {:.2?} on {} threads", start.elapsed(), rayon::current_num_threads());
        assert_eq!(n, 8 * 2048 * 65536);
    }

    #[test]
    fn to_bf16_rounds_like_half() {
        // Every exponent and sign with a spread of mantissas, plus the edges.
        let mut bits: Vec<u32> = (0..=u32::MAX / 4099).map(|i| i.wrapping_mul(4099)).collect();
        bits.extend([0, 0x8000_0000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0x7f80_0001, 0xffff_ffff, 0x7f7f_ffff, 0x7f7f_8000, 0x3f80_8000, 0x3f81_8000, 0x0000_8000, 0x0001_8000]);
        for b in bits {
            let x = f32::from_bits(b);
            assert_eq!(to_bf16(x), bf16::from_f32(x).to_bits(), "{b:#010x}");
        }
    }

    #[test]
    fn partial_blocks_have_no_length() {
        assert_eq!(GgmlType::Q4_0.byte_len(33), None);
        assert_eq!(GgmlType::Q4_1.byte_len(64), Some(40));
        assert_eq!(GgmlType::from_id(16), Err("IQ2_XXS".to_string()));
        assert_eq!(GgmlType::Q4_K.byte_len(512), Some(288));
        assert_eq!(GgmlType::Q6_K.byte_len(300), None);
    }
}

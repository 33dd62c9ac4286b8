//! GGUF block formats → bf16. Layouts follow ggml's reference dequantizers:
//! each block covers 32 consecutive elements of a row.

use half::{bf16, f16};

pub const QK: usize = 32;

/// ggml tensor types rocket can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
}

impl GgmlType {
    /// Map a ggml type id; unsupported ids give their ggml name for the error.
    pub fn from_id(id: u32) -> Result<Self, String> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::BF16,
            other => return Err(ggml_type_name(other)),
        })
    }

    /// Bytes for `n` elements, or None if `n` does not fill whole blocks.
    pub fn byte_len(self, n: usize) -> Option<usize> {
        let (block, bytes) = match self {
            GgmlType::F32 => return n.checked_mul(4),
            GgmlType::F16 | GgmlType::BF16 => return n.checked_mul(2),
            GgmlType::Q4_0 => (QK, 18),
            GgmlType::Q4_1 => (QK, 20),
            GgmlType::Q8_0 => (QK, 34),
        };
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

fn to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// Dequantize `data` (exactly `byte_len(out.len())` bytes) into bf16 bits.
pub fn dequantize_to_bf16(kind: GgmlType, data: &[u8], out: &mut [u16]) {
    match kind {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = to_bf16(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = to_bf16(f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32());
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = u16::from_le_bytes([c[0], c[1]]);
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(34)) {
                let d = half_at(b, 0);
                for (j, v) in o.iter_mut().enumerate() {
                    *v = to_bf16(d * (b[2 + j] as i8) as f32);
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(18)) {
                let d = half_at(b, 0);
                for j in 0..QK / 2 {
                    let q = b[2 + j];
                    o[j] = to_bf16(d * ((q & 0x0f) as i32 - 8) as f32);
                    o[j + QK / 2] = to_bf16(d * ((q >> 4) as i32 - 8) as f32);
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(data.chunks_exact(20)) {
                let d = half_at(b, 0);
                let m = half_at(b, 2);
                for j in 0..QK / 2 {
                    let q = b[4 + j];
                    o[j] = to_bf16(d * (q & 0x0f) as f32 + m);
                    o[j + QK / 2] = to_bf16(d * (q >> 4) as f32 + m);
                }
            }
        }
    }
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

    #[test]
    fn partial_blocks_have_no_length() {
        assert_eq!(GgmlType::Q4_0.byte_len(33), None);
        assert_eq!(GgmlType::Q4_1.byte_len(64), Some(40));
        assert_eq!(GgmlType::from_id(12), Err("Q4_K".to_string()));
    }
}

//! Test helpers: the committed tiny checkpoints, copies to mutate, and a
//! minimal GGUF writer (so GGUF loading is tested against known weights).

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::bf16;
use rocket_core::model::{ModelSource, ModelSpec, ModelWeights};
use safetensors::{Dtype, SafeTensors};

/// A checkpoint's spec and its weights, as a backend takes them.
pub fn open_weights(path: &Path) -> (ModelSpec, ModelWeights) {
    let src = ModelSource::open(path).unwrap();
    let weights = ModelWeights::from_weights(&src.spec, src.weights).unwrap();
    (src.spec, weights)
}

/// A committed fixture; ROCKET_FIXTURES points elsewhere when the test binary
/// runs away from this checkout (on the GPU machine).
pub fn fixture(name: &str) -> PathBuf {
    match std::env::var_os("ROCKET_FIXTURES") {
        Some(dir) => PathBuf::from(dir).join(name),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/parity/fixtures").join(name),
    }
}

/// A temp copy of a fixture folder that a test may edit.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let e = entry.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

pub fn edit_json(path: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// (dtype, shape, bytes) of every tensor of a single-file safetensors checkpoint.
pub fn read_tensors(path: &Path) -> HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect()
}

pub fn write_tensors(path: &Path, tensors: &HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

pub fn bf16_bytes_to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
}

// ---- GGUF writing -------------------------------------------------------

pub enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

pub struct GgufTensor {
    pub name: String,
    /// ggml order (row length first).
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

pub fn write_gguf(path: &Path, meta: &[(&str, Meta)], tensors: &[GgufTensor]) {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        put_str(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Meta::Strs(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for s in items {
                    put_str(&mut out, s);
                }
            }
            Meta::I32s(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for v in items {
                    out.extend(v.to_le_bytes());
                }
            }
        }
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(t.type_id.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset += (t.data.len() as u64).div_ceil(32) * 32;
    }
    while out.len() % 32 != 0 {
        out.push(0);
    }
    let start = out.len();
    for (t, off) in tensors.iter().zip(offsets) {
        out.resize(start + off as usize, 0);
        out.extend(&t.data);
    }
    std::fs::write(path, out).unwrap();
}

/// Q8_0 blocks for `values` (length a multiple of 32), as ggml quantizes.
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in values.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_bits().to_le_bytes());
        out.extend(block.iter().map(|v| (v * inv).round() as i8 as u8));
    }
    out
}

/// llama.cpp's Q/K row permutation (the inverse of what the loader undoes).
pub fn permute_rows_like_llama_cpp<T: Copy>(rows: &[T], n_rows: usize, cols: usize, heads: usize) -> Vec<T> {
    let hd = n_rows / heads;
    let mut out = rows.to_vec();
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..hd / 2 {
                let src = h * hd + j * hd / 2 + i;
                let dst = h * hd + i * 2 + j;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&rows[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// How many values of `a` differ from `b`'s bit for bit (over the shorter of the two).
pub fn bits_differ(a: &[f32], b: &[f32]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x.to_bits() != y.to_bits()).count()
}

/// Seeded token ids in the lower 90% of the vocabulary (where special tokens are rare).
pub fn random_ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % (vocab as u64 * 9 / 10)) as u32
        })
        .collect()
}

/// Seeded values uniform in [-scale, scale).
pub fn random_values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

//! GGUF reader (versions 2 and 3): metadata, tensor directory, and conversion of
//! llama and qwen3 architecture tensors to canonical HF names. Every read is bounds-checked
//! so a truncated or corrupt file is an error, never an out-of-bounds access.

use crate::progress::LoadProgress;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use rayon::prelude::*;

use super::dequant::{dequantize_to_bf16, dequantize_to_f32, GgmlType};
use super::safetensors_file::map_file;
use super::{DType, Tensor, Weights};
use crate::error::{Result, RocketError};
use crate::model::spec::{Family, Llama3RopeScaling, ModelSpec};

const MAGIC: &[u8; 4] = b"GGUF";

/// `general.architecture` values rocket reads.
pub const SUPPORTED_GGUF_ARCHITECTURES: [&str; 2] = ["gguf:llama", "gguf:qwen3"];
const DEFAULT_ALIGNMENT: u64 = 32;

#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::UInt(v) => Some(v),
            MetaValue::Int(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::Float(v) => Some(v),
            MetaValue::UInt(v) => Some(v as f64),
            MetaValue::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (row) dimension.
    pub dims: Vec<usize>,
    pub type_id: u32,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

impl TensorInfo {
    /// Row-major (HF) shape: ggml dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    map: Arc<Mmap>,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn err(&self, what: &str) -> RocketError {
        RocketError::corrupt(self.path, format!("{what} at byte {} (file is {} bytes)", self.pos, self.buf.len()))
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()).ok_or_else(|| self.err("unexpected end of file"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.bytes(N)?.try_into().expect("length checked"))
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items that each take at least `min_item` bytes: bounded by
    /// what is left of the file so a corrupt count cannot trigger a huge allocation.
    fn count(&mut self, min_item: usize) -> Result<usize> {
        let n = self.u64()?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(min_item as u64) > left {
            return Err(self.err(&format!("count {n} larger than the rest of the file")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.count(1)?;
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }

    fn value(&mut self, type_id: u32, depth: usize) -> Result<MetaValue> {
        Ok(match type_id {
            0 => MetaValue::UInt(self.u8()? as u64),
            1 => MetaValue::Int(self.u8()? as i8 as i64),
            2 => MetaValue::UInt(self.u16()? as u64),
            3 => MetaValue::Int(self.u16()? as i16 as i64),
            4 => MetaValue::UInt(self.u32()? as u64),
            5 => MetaValue::Int(self.u32()? as i32 as i64),
            6 => MetaValue::Float(f32::from_le_bytes(self.array()?) as f64),
            7 => MetaValue::Bool(self.u8()? != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("arrays nested too deeply"));
                }
                let elem = self.u32()?;
                let n = self.count(1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::UInt(self.u64()?),
            11 => MetaValue::Int(self.u64()? as i64),
            12 => MetaValue::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(self.err(&format!("unknown metadata value type {other}"))),
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_map(map_file(path)?, path)
    }

    /// Parse a GGUF already in memory (`path` only names it in errors).
    pub fn from_map(map: Arc<Mmap>, path: &Path) -> Result<Self> {
        let mut r = Reader { buf: &map, pos: 0, path };
        if r.bytes(4).map_err(|_| RocketError::corrupt(path, "too short for a GGUF header"))? != MAGIC {
            return Err(RocketError::corrupt(path, "not a GGUF file (bad magic)"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(RocketError::corrupt(path, format!("GGUF version {version} is not supported (2 or 3)")));
        }
        let n_tensors = r.count(24)?;
        let n_kv = r.count(12)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let t = r.u32()?;
            let v = r.value(t, 0)?;
            metadata.insert(key, v);
        }
        let mut raw = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()? as usize;
            if n_dims == 0 || n_dims > 4 {
                return Err(r.err(&format!("tensor {name:?} has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64()? as usize);
            }
            let type_id = r.u32()?;
            let offset = r.u64()?;
            raw.push((name, dims, type_id, offset));
        }
        let alignment = metadata.get("general.alignment").and_then(MetaValue::as_u64).unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(RocketError::corrupt(path, format!("general.alignment {alignment} is not a power of two")));
        }
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = map.len() as u64;
        let mut tensors = Vec::with_capacity(raw.len());
        for (name, dims, type_id, offset) in raw {
            let numel = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            // Unsupported types get their size checked at conversion; give them no range.
            let len = match (GgmlType::from_id(type_id), numel) {
                (Ok(kind), Some(n)) => kind.byte_len(n).ok_or_else(|| {
                    RocketError::corrupt(path, format!("tensor {name:?} has {n} elements, not whole {kind:?} blocks"))
                })?,
                (Err(_), Some(_)) => 0,
                (_, None) => return Err(RocketError::corrupt(path, format!("tensor {name:?} dims overflow"))),
            };
            let start = data_start.checked_add(offset).filter(|s| s % alignment == 0 || len == 0);
            let Some(start) = start.filter(|&s| s.checked_add(len as u64).is_some_and(|e| e <= file_len)) else {
                return Err(RocketError::corrupt(
                    path,
                    format!("tensor {name:?} data (offset {offset}, {len} bytes) lies outside the {file_len}-byte file"),
                ));
            };
            tensors.push(TensorInfo { name, dims, type_id, start: start as usize, len });
        }
        Ok(GgufFile { path: path.to_path_buf(), version, metadata, tensors, map })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(MetaValue::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(MetaValue::as_u64)
    }

    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
            .ok_or_else(|| RocketError::config(&self.path, "GGUF metadata has no general.architecture"))
    }

    fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The `ModelSpec` described by the metadata (llama or qwen3 architecture).
    pub fn spec(&self) -> Result<ModelSpec> {
        let arch = self.architecture()?;
        let family = match arch {
            "llama" => Family::Llama,
            "qwen3" => Family::Qwen3,
            _ => return Err(RocketError::UnsupportedModelType { found: format!("gguf:{arch}"), supported: SUPPORTED_GGUF_ARCHITECTURES.to_vec() }),
        };
        let need = |k: &str| {
            self.get_u64(&format!("{arch}.{k}"))
                .map(|v| v as usize)
                .ok_or_else(|| RocketError::config(&self.path, format!("GGUF metadata is missing {arch}.{k}")))
        };
        let hidden_size = need("embedding_length")?;
        let num_heads = need("attention.head_count")?;
        let num_kv_heads = self.get_u64(&format!("{arch}.attention.head_count_kv")).map_or(num_heads, |v| v as usize);
        let head_dim = self
            .get_u64(&format!("{arch}.attention.key_length"))
            .or_else(|| self.get_u64(&format!("{arch}.rope.dimension_count")))
            .map(|v| v as usize)
            .unwrap_or(hidden_size.checked_div(num_heads).unwrap_or(0));
        let vocab_size = match self.get_u64(&format!("{arch}.vocab_size")) {
            Some(v) => v as usize,
            None => self
                .get("tokenizer.ggml.tokens")
                .and_then(MetaValue::as_array)
                .map(<[MetaValue]>::len)
                .ok_or_else(|| RocketError::config(&self.path, "GGUF metadata has no vocab size or token list"))?,
        };
        let spec = ModelSpec {
            family,
            hidden_size,
            intermediate_size: need("feed_forward_length")?,
            num_layers: need("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings: need("context_length")?,
            rms_norm_eps: self
                .get(&format!("{arch}.attention.layer_norm_rms_epsilon"))
                .and_then(MetaValue::as_f64)
                .unwrap_or(1e-5),
            rope_theta: self.get(&format!("{arch}.rope.freq_base")).and_then(MetaValue::as_f64).unwrap_or(10000.0),
            rope_scaling: None,
            rope_freq_factors: None,
            tie_word_embeddings: self.tensor("output.weight").is_none(),
            qk_norm: family == Family::Qwen3,
        };
        let spec = self.with_rope_scaling(spec)?;
        spec.validate(&self.path)?;
        Ok(spec)
    }

    /// llama3 RoPE scaling from either place a GGUF may carry it: the `rope_freqs`
    /// tensor (what llama.cpp's converter writes) or `{arch}.rope.scaling.*` metadata
    /// (type "llama3", factor, original_context_length, and low/high_freq_factor,
    /// defaulting to 1 and 4 as in transformers). With metadata the spec carries the
    /// HF parameters, so inv_freq is computed as transformers computes it; with both,
    /// the tensor must hold the factors the metadata implies.
    fn with_rope_scaling(&self, mut spec: ModelSpec) -> Result<ModelSpec> {
        let arch = self.architecture()?;
        let key = |k: &str| format!("{arch}.rope.scaling.{k}");
        let factors = self.rope_freq_factors()?;
        let kind = match self.get(&key("type")) {
            None => "none",
            Some(v) => v.as_str().ok_or_else(|| RocketError::config(&self.path, format!("{} must be a string", key("type"))))?,
        };
        match kind {
            "none" => {
                spec.rope_freq_factors = factors;
                Ok(spec)
            }
            "llama3" => {
                let num = |k: &str, default: Option<f64>| {
                    match self.get(&key(k)) {
                        Some(v) => v.as_f64(),
                        None => default,
                    }
                    .ok_or_else(|| RocketError::config(&self.path, format!("llama3 rope scaling needs a numeric {}", key(k))))
                };
                let scaling = Llama3RopeScaling {
                    factor: num("factor", None)?,
                    low_freq_factor: num("low_freq_factor", Some(1.0))?,
                    high_freq_factor: num("high_freq_factor", Some(4.0))?,
                    original_max_position_embeddings: num("original_context_length", None)? as usize,
                };
                spec.rope_scaling = Some(scaling);
                if let Some(stored) = factors {
                    let want = llama3_freq_factors(spec.head_dim, spec.rope_theta, &scaling);
                    let worst = stored.iter().zip(&want).map(|(&s, &w)| ((s as f64 - w) / w).abs()).fold(0.0, f64::max);
                    if stored.len() != want.len() || worst > 1e-5 {
                        return Err(RocketError::config(
                            &self.path,
                            format!("rope_freqs.weight {stored:?} disagrees with the llama3 rope scaling metadata {scaling:?}, which implies {want:?}"),
                        ));
                    }
                }
                Ok(spec)
            }
            other => Err(RocketError::config(
                &self.path,
                format!("{} {other:?} is not supported (supported: none, llama3)", key("type")),
            )),
        }
    }

    /// llama.cpp's converter writes llama3 rope scaling as the `rope_freqs` tensor:
    /// one f32 divisor per rotary frequency (`head_dim / 2` of them).
    fn rope_freq_factors(&self) -> Result<Option<Vec<f32>>> {
        let Some(info) = self.tensor("rope_freqs.weight") else { return Ok(None) };
        if info.type_id != 0 || info.dims.len() != 1 {
            return Err(RocketError::corrupt(
                &self.path,
                format!("rope_freqs.weight must be a 1-d F32 tensor, got ggml type {} with dims {:?}", info.type_id, info.dims),
            ));
        }
        let bytes = &self.map[info.start..info.start + info.len];
        Ok(Some(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
    }

    /// Convert every tensor to canonical names: float tensors stay in the map
    /// (copied only where rows must be reordered), quantized ones are dequantized
    /// to `quantized_as` (F32 or BF16).
    pub fn weights(&self, spec: &ModelSpec, quantized_as: DType) -> Result<Weights> {
        self.weights_with_progress(spec, quantized_as, &LoadProgress::new(crate::options::Progress::Off))
    }

    /// `weights`, advancing `progress` by each tensor's stored bytes. Tensors are
    /// converted in parallel (and each large one in parallel blocks).
    pub fn weights_with_progress(&self, spec: &ModelSpec, quantized_as: DType, progress: &LoadProgress) -> Result<Weights> {
        if quantized_as == DType::F16 {
            return Err(RocketError::invalid_arg("quantized_as", quantized_as, "must be f32 or bf16"));
        }
        progress.phase("converting", self.tensors.iter().map(|t| t.len as u64).sum());
        let converted: Vec<Result<Option<(String, Tensor)>>> = self
            .tensors
            .par_iter()
            .map(|info| {
                let Some(name) = canonical_name(&info.name) else { return Ok(None) };
                let kind = GgmlType::from_id(info.type_id)
                    .map_err(|kind| RocketError::UnsupportedQuant { tensor: info.name.clone(), kind })?;
                // llama.cpp's converter permutes Q/K rows for llama only; qwen3 is stored in HF order.
                let permute_heads = if spec.family != Family::Llama {
                    None
                } else if name.ends_with("self_attn.q_proj.weight") {
                    Some(spec.num_heads)
                } else if name.ends_with("self_attn.k_proj.weight") {
                    Some(spec.num_kv_heads)
                } else {
                    None
                };
                let shape = info.shape();
                let bytes = &self.map[info.start..info.start + info.len];
                let halves = || bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect::<Vec<u16>>();
                let tensor = match (kind, permute_heads) {
                    (GgmlType::F32, None) => Tensor::mapped(DType::F32, shape, self.map.clone(), info.start, info.len),
                    (GgmlType::F16, None) => Tensor::mapped(DType::F16, shape, self.map.clone(), info.start, info.len),
                    (GgmlType::BF16, None) => Tensor::mapped(DType::BF16, shape, self.map.clone(), info.start, info.len),
                    // Float tensors whose rows move keep their type.
                    (GgmlType::F16, Some(_)) => Tensor::owned_16(DType::F16, shape, self.unpermute(info, halves(), permute_heads)?),
                    (GgmlType::BF16, Some(_)) => Tensor::owned_16(DType::BF16, shape, self.unpermute(info, halves(), permute_heads)?),
                    (GgmlType::F32, Some(_)) => {
                        let rows = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                        Tensor::owned_f32(shape, self.unpermute(info, rows, permute_heads)?)
                    }
                    _ if quantized_as == DType::F32 => {
                        let mut out = vec![0f32; info.dims.iter().product()];
                        dequantize_to_f32(kind, bytes, &mut out);
                        Tensor::owned_f32(shape, self.unpermute(info, out, permute_heads)?)
                    }
                    _ => {
                        let mut out = vec![0u16; info.dims.iter().product()];
                        dequantize_to_bf16(kind, bytes, &mut out);
                        Tensor::owned_bf16(shape, self.unpermute(info, out, permute_heads)?)
                    }
                };
                progress.advance(info.len as u64);
                Ok(Some((name, tensor)))
            })
            .collect();
        let mut weights = Weights::new(self.path.display().to_string()).named_in_file(gguf_name);
        for item in converted {
            if let Some((name, tensor)) = item? {
                weights.insert(name, tensor);
            }
        }
        Ok(weights)
    }

    /// Undo the Q/K row permutation of a llama tensor (`heads` given), else return `rows`.
    fn unpermute<T: Copy + Default>(&self, info: &TensorInfo, rows: Vec<T>, heads: Option<usize>) -> Result<Vec<T>> {
        match heads {
            None => Ok(rows),
            Some(heads) => unpermute_rows(&rows, &info.shape(), heads)
                .map_err(|m| RocketError::corrupt(&self.path, format!("tensor {:?}: {m}", info.name))),
        }
    }
}

/// The per-frequency divisors llama.cpp's converter stores as `rope_freqs` for llama3
/// scaling (convert_hf_to_gguf.py, `LlamaModel.generate_extra_tensors`), in f64.
pub fn llama3_freq_factors(head_dim: usize, theta: f64, s: &Llama3RopeScaling) -> Vec<f64> {
    let old = s.original_max_position_embeddings as f64;
    let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            let wavelen = 2.0 * std::f64::consts::PI * theta.powf((2 * i) as f64 / head_dim as f64);
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                s.factor
            } else {
                let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                1.0 / ((1.0 - smooth) / s.factor + smooth)
            }
        })
        .collect()
}

/// GGUF names of the model's own tensors and their Hugging Face names.
const GLOBAL_NAMES: [(&str, &str); 3] =
    [("token_embd.weight", "model.embed_tokens.weight"), ("output_norm.weight", "model.norm.weight"), ("output.weight", "lm_head.weight")];
/// The same within a layer (`blk.N.` and `model.layers.N.` before them).
const LAYER_NAMES: [(&str, &str); 11] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
];

/// GGUF tensor name → Hugging Face name (llama layout).
pub fn canonical_name(gguf: &str) -> Option<String> {
    if let Some((_, hf)) = GLOBAL_NAMES.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let (layer, part) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == part)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Hugging Face tensor name → GGUF name: what a GGUF file lacking it is missing.
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some((g, _)) = GLOBAL_NAMES.iter().find(|(_, h)| *h == hf) {
        return Some(g.to_string());
    }
    let (layer, part) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (g, _) = LAYER_NAMES.iter().find(|(_, h)| *h == part)?;
    Some(format!("blk.{layer}.{g}"))
}

/// Undo llama.cpp's Q/K row permutation. Its converter interleaves the two
/// rotary halves of each head (row `i*2 + j` of a head holds HF row
/// `j*half + i`); HF transformers reverses this when it loads GGUF.
pub fn unpermute_rows<T: Copy + Default>(rows: &[T], shape: &[usize], heads: usize) -> Result<Vec<T>, String> {
    let [n_rows, cols] = shape else { return Err(format!("expected a matrix, got shape {shape:?}")) };
    if heads == 0 || n_rows % heads != 0 || (n_rows / heads) % 2 != 0 {
        return Err(format!("{n_rows} rows cannot be split into {heads} heads of even size"));
    }
    if n_rows.checked_mul(*cols) != Some(rows.len()) {
        return Err(format!("shape {shape:?} does not match its {} elements", rows.len()));
    }
    // Nothing to move; the loop below would still walk every (empty) row.
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let head_dim = n_rows / heads;
    let half = head_dim / 2;
    let mut out = vec![T::default(); rows.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let src = h * head_dim + i * 2 + j;
                let dst = h * head_dim + j * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&rows[src * cols..(src + 1) * cols]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(heads, 2, hd/2, cols).swapaxes(1, 2) — HF row (h, j, i) goes to (h, i, j).
        let (heads, hd, cols) = (3, 8, 2);
        let hf: Vec<u16> = (0..(heads * hd * cols) as u16).collect();
        let mut gguf = vec![0u16; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    let src = h * hd + j * hd / 2 + i;
                    let dst = h * hd + i * 2 + j;
                    gguf[dst * cols..(dst + 1) * cols].copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&gguf, &[heads * hd, cols], heads).unwrap(), hf);
    }

    #[test]
    fn unpermute_of_an_empty_tensor_returns_at_once() {
        // A GGUF may declare dims [0, 2^40]: no elements, but 2^40 rows to walk.
        assert_eq!(unpermute_rows::<u16>(&[], &[1 << 40, 0], 1).unwrap(), Vec::<u16>::new());
        assert!(unpermute_rows(&[0; 6], &[4, 2], 2).unwrap_err().contains("does not match"));
    }

    #[test]
    fn names_map_to_hf() {
        assert_eq!(canonical_name("blk.12.ffn_down.weight").unwrap(), "model.layers.12.mlp.down_proj.weight");
        assert_eq!(canonical_name("token_embd.weight").unwrap(), "model.embed_tokens.weight");
        assert!(canonical_name("blk.x.ffn_down.weight").is_none());
        for name in ["token_embd.weight", "output.weight", "blk.0.attn_norm.weight", "blk.27.attn_k_norm.weight", "blk.3.ffn_up.weight"] {
            assert_eq!(gguf_name(&canonical_name(name).unwrap()).as_deref(), Some(name));
        }
        assert!(gguf_name("model.layers.x.mlp.up_proj.weight").is_none() && gguf_name("model.layers.1.rotary.inv_freq").is_none());
    }
}

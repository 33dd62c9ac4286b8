//! Tensors by canonical (Hugging Face) name. safetensors data stays in the
//! memory map; GGUF quantized blocks are dequantized once, to f32 for the CPU
//! reference or to bf16 where a GPU may take them.

pub mod dequant;
pub mod gguf;
pub mod safetensors_file;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Result, RocketError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// Where a tensor's elements live.
enum Storage {
    /// Inside a memory-mapped file, at an offset aligned for the dtype.
    Mapped { map: Arc<Mmap>, offset: usize, len: usize },
    /// 16-bit elements (bf16/f16) owned by us, e.g. dequantized GGUF.
    Owned16(Vec<u16>),
    OwnedF32(Vec<f32>),
}

pub struct Tensor {
    dtype: DType,
    shape: Vec<usize>,
    storage: Storage,
}

/// A typed, borrowed view of a tensor's elements (row-major).
#[derive(Clone, Copy)]
pub enum WeightView<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    BF16(&'a [u16]),
}

impl WeightView<'_> {
    pub fn len(&self) -> usize {
        match self {
            WeightView::F32(s) => s.len(),
            WeightView::F16(s) | WeightView::BF16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` widened to f32.
    pub fn get(&self, i: usize) -> f32 {
        match self {
            WeightView::F32(s) => s[i],
            WeightView::F16(s) => half::f16::from_bits(s[i]).to_f32(),
            WeightView::BF16(s) => bf16_to_f32(s[i]),
        }
    }

    /// Elements `start..start+out.len()` widened to f32.
    pub fn to_f32_into(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            WeightView::F32(s) => out.copy_from_slice(&s[start..start + n]),
            WeightView::F16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = half::f16::from_bits(b).to_f32();
                }
            }
            WeightView::BF16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = bf16_to_f32(b);
                }
            }
        }
    }
}

#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

impl Tensor {
    pub fn owned_bf16(shape: Vec<usize>, data: Vec<u16>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { dtype: DType::BF16, shape, storage: Storage::Owned16(data) }
    }

    pub fn owned_16(dtype: DType, shape: Vec<usize>, data: Vec<u16>) -> Self {
        debug_assert!(dtype != DType::F32);
        Tensor { dtype, shape, storage: Storage::Owned16(data) }
    }

    pub fn owned_f32(shape: Vec<usize>, data: Vec<f32>) -> Self {
        Tensor { dtype: DType::F32, shape, storage: Storage::OwnedF32(data) }
    }

    /// A tensor inside a mapped file. Unaligned data (allowed by safetensors)
    /// is copied so typed views stay sound.
    pub fn mapped(dtype: DType, shape: Vec<usize>, map: Arc<Mmap>, offset: usize, len: usize) -> Self {
        let aligned = (map.as_ptr() as usize + offset) % dtype.size() == 0;
        if aligned {
            return Tensor { dtype, shape, storage: Storage::Mapped { map, offset, len } };
        }
        let bytes = &map[offset..offset + len];
        let storage = match dtype {
            DType::F32 => Storage::OwnedF32(
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            DType::F16 | DType::BF16 => {
                Storage::Owned16(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
            }
        };
        Tensor { dtype, shape, storage }
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    pub fn view(&self) -> WeightView<'_> {
        match &self.storage {
            Storage::Owned16(v) => match self.dtype {
                DType::BF16 => WeightView::BF16(v),
                _ => WeightView::F16(v),
            },
            Storage::OwnedF32(v) => WeightView::F32(v),
            Storage::Mapped { map, offset, len } => {
                let ptr = map[*offset..*offset + *len].as_ptr();
                // SAFETY: the range is inside the map (checked by the file parser), its
                // start is aligned for the element type (checked in `mapped`), the map is
                // read-only and outlives the borrow of `self`; files are little-endian
                // like every platform rocket targets.
                unsafe {
                    match self.dtype {
                        DType::F32 => WeightView::F32(std::slice::from_raw_parts(ptr.cast(), len / 4)),
                        DType::F16 => WeightView::F16(std::slice::from_raw_parts(ptr.cast(), len / 2)),
                        DType::BF16 => WeightView::BF16(std::slice::from_raw_parts(ptr.cast(), len / 2)),
                    }
                }
            }
        }
    }

    /// All elements widened to f32 (for small tensors such as norms).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.numel()];
        self.view().to_f32_into(0, &mut out);
        out
    }
}

/// Canonical name → tensor, plus a description of where they came from.
pub struct Weights {
    tensors: HashMap<String, Tensor>,
    /// Tensors present in the file in a dtype rocket does not compute with:
    /// an error only if the model actually needs them.
    unsupported: HashMap<String, String>,
    source: String,
    /// The file's own name of a tensor, for errors (`named_in_file`).
    file_name: Option<fn(&str) -> Option<String>>,
}

impl Weights {
    pub fn new(source: String) -> Self {
        Weights { tensors: HashMap::new(), unsupported: HashMap::new(), source, file_name: None }
    }

    /// Errors name a missing tensor as the file does (`file_name` of its
    /// Hugging Face name: GGUF's `blk.N.` names), where it has a name there.
    pub fn named_in_file(self, file_name: fn(&str) -> Option<String>) -> Self {
        Weights { file_name: Some(file_name), ..self }
    }

    /// `name` as errors show it: the file's own name where it has one.
    fn shown(&self, name: &str) -> String {
        self.file_name.and_then(|f| f(name)).unwrap_or_else(|| name.to_string())
    }

    pub fn insert(&mut self, name: String, tensor: Tensor) {
        self.tensors.insert(name, tensor);
    }

    pub fn insert_unsupported(&mut self, name: String, dtype: String) {
        self.unsupported.insert(name, dtype);
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Take a tensor out, checking its shape and that its dtype is one rocket computes with.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if let Some(dtype) = self.unsupported.get(name) {
            return Err(RocketError::TensorDtype {
                name: self.shown(name),
                found: dtype.clone(),
                allowed: "f32, f16, bf16".into(),
            });
        }
        let t = self.tensors.remove(name).ok_or_else(|| RocketError::MissingTensor {
            name: self.shown(name),
            source_file: self.source.clone(),
        })?;
        if t.shape != shape {
            return Err(RocketError::TensorShape {
                name: self.shown(name),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }
}

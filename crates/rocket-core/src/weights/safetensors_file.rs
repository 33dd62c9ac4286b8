//! safetensors checkpoints (single file or sharded with an index), memory-mapped.

use std::collections::BTreeSet;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::{DType, Tensor, Weights};
use crate::error::{Result, RocketError};

/// Map a file read-only. The caller must not truncate it while rocket runs
/// (the same contract as every mmap-based loader).
pub fn map_file(path: &Path) -> Result<Arc<Mmap>> {
    let file = File::open(path).map_err(|e| RocketError::io(path, e))?;
    // SAFETY: read-only mapping of a regular file; see the contract above.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| RocketError::io(path, e))?;
    Ok(Arc::new(map))
}

/// Load every tensor of the checkpoint in `dir`.
pub fn load_dir(dir: &Path) -> Result<Weights> {
    let index = dir.join("model.safetensors.index.json");
    let single = dir.join("model.safetensors");
    if index.is_file() {
        let files = shard_files(&index)?;
        let mut weights = Weights::new(index.display().to_string());
        for f in files {
            load_file_into(&dir.join(&f), &mut weights)?;
        }
        Ok(weights)
    } else if single.is_file() {
        let mut weights = Weights::new(single.display().to_string());
        load_file_into(&single, &mut weights)?;
        Ok(weights)
    } else {
        Err(RocketError::NotAModelFolder { dir: dir.to_path_buf(), missing: "model.safetensors (or model.safetensors.index.json)" })
    }
}

fn shard_files(index: &Path) -> Result<BTreeSet<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| RocketError::io(index, e))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| RocketError::corrupt(index, e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| RocketError::corrupt(index, "no weight_map object"))?;
    map.values()
        .map(|v| {
            let name = v.as_str().ok_or_else(|| RocketError::corrupt(index, "weight_map values must be file names"))?;
            if name.contains('/') || name.contains("..") {
                return Err(RocketError::corrupt(index, format!("shard name {name:?} must be a plain file name")));
            }
            Ok(name.to_string())
        })
        .collect()
}

pub fn load_file_into(path: &Path, weights: &mut Weights) -> Result<()> {
    load_map_into(map_file(path)?, path, weights)
}

/// `load_file_into` for a file already in memory (`path` only names it in errors).
pub fn load_map_into(map: Arc<Mmap>, path: &Path, weights: &mut Weights) -> Result<()> {
    let (header_len, metadata) =
        SafeTensors::read_metadata(&map).map_err(|e| RocketError::corrupt(path, format!("{e:?}")))?;
    let data_start = 8 + header_len;
    for (name, info) in metadata.tensors() {
        let dtype = match info.dtype {
            Dtype::F32 => DType::F32,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                weights.insert_unsupported(name, format!("{other:?}"));
                continue;
            }
        };
        let (begin, end) = info.data_offsets;
        let tensor = Tensor::mapped(dtype, info.shape.clone(), map.clone(), data_start + begin, end - begin);
        weights.insert(name, tensor);
    }
    Ok(())
}

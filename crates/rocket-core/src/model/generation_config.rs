//! Defaults from `generation_config.json` (or GGUF metadata): stop ids and the
//! sampling values a user who sets nothing gets, as in HF transformers.

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, RocketError};
use crate::sampling::SamplingParams;

/// Which sampling fields the caller left unset (to be filled from the model's
/// generation_config.json, as HF transformers and vLLM do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnsetFields {
    pub temperature: bool,
    pub top_k: bool,
    pub top_p: bool,
    pub repetition_penalty: bool,
}

impl UnsetFields {
    pub const ALL: UnsetFields = UnsetFields { temperature: true, top_k: true, top_p: true, repetition_penalty: true };
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub temperature: Option<f64>,
    pub top_k: Option<u64>,
    pub top_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// HF's `do_sample`: false means greedy unless the user asks otherwise.
    pub do_sample: Option<bool>,
}

/// An id or a list of ids (HF allows both for eos_token_id).
pub fn id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

impl GenerationConfig {
    /// Fill the unset fields of `params` from this config, as HF does: unless
    /// `do_sample` is true the default is greedy; other absent values mean "off"
    /// (top_k 0, top_p 1, repetition_penalty 1 — vLLM's reading, not HF's top_k=50).
    pub fn fill_defaults(&self, params: &mut SamplingParams, unset: UnsetFields) {
        if unset.temperature {
            params.temperature =
                if self.do_sample == Some(true) { self.temperature.unwrap_or(1.0) as f32 } else { 0.0 };
        }
        if unset.top_k {
            params.top_k = self.top_k.unwrap_or(0) as usize;
        }
        if unset.top_p {
            params.top_p = self.top_p.unwrap_or(1.0) as f32;
        }
        if unset.repetition_penalty {
            params.repetition_penalty = self.repetition_penalty.unwrap_or(1.0) as f32;
        }
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| RocketError::io(path, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| RocketError::config(path, e.to_string()))?;
        Ok(Self::from_json(&v))
    }

    pub fn from_json(v: &Value) -> Self {
        GenerationConfig {
            bos_token_id: v.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32),
            eos_token_ids: id_list(v.get("eos_token_id")),
            temperature: v.get("temperature").and_then(Value::as_f64),
            top_k: v.get("top_k").and_then(Value::as_u64),
            top_p: v.get("top_p").and_then(Value::as_f64),
            repetition_penalty: v.get("repetition_penalty").and_then(Value::as_f64),
            do_sample: v.get("do_sample").and_then(Value::as_bool),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_only_unset_fields() {
        let cfg = GenerationConfig::from_json(&serde_json::json!({
            "do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]
        }));
        assert_eq!(cfg.eos_token_ids, vec![1, 2]);
        let mut p = SamplingParams { top_p: 0.5, ..SamplingParams::default() };
        cfg.fill_defaults(&mut p, UnsetFields { top_p: false, ..UnsetFields::ALL });
        assert_eq!((p.temperature, p.top_k, p.top_p, p.repetition_penalty), (0.6, 20, 0.5, 1.0));
        for greedy in [serde_json::json!({"do_sample": false, "temperature": 0.6}), serde_json::json!({})] {
            GenerationConfig::from_json(&greedy).fill_defaults(&mut p, UnsetFields::ALL);
            assert_eq!(p.temperature, 0.0);
        }
    }
}

//! Defaults from `generation_config.json` (or GGUF metadata): stop ids and the
//! sampling values a user who sets nothing gets, as in HF transformers (applied
//! by `Engine::resolve`, see `crate::sampling_options`).

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, RocketError};

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
    fn reads_the_sampling_fields() {
        let cfg = GenerationConfig::from_json(&serde_json::json!({
            "do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]
        }));
        assert_eq!(cfg.eos_token_ids, vec![1, 2]);
        assert_eq!((cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty), (Some(true), Some(0.6), Some(20), Some(0.95), None));
        assert_eq!(GenerationConfig::from_json(&serde_json::json!({"eos_token_id": 7})).eos_token_ids, vec![7]);
    }
}

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
    /// The file's defaults; a sampling field of the wrong type or out of range is an
    /// error naming the file (at load, not on every request that falls back to it).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| RocketError::io(path, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| RocketError::config(path, e.to_string()))?;
        Self::from_json(&v).map_err(|message| RocketError::config(path, message))
    }

    /// The fields of a generation_config object (a missing or null field is unset).
    pub fn from_json(v: &Value) -> std::result::Result<Self, String> {
        let field = |name: &str| v.get(name).filter(|x| !x.is_null());
        let number = |name: &str| -> std::result::Result<Option<f64>, String> {
            field(name).map(|x| x.as_f64().ok_or_else(|| format!("{name} must be a number, got {x}"))).transpose()
        };
        let top_k = field("top_k")
            .map(|x| x.as_u64().ok_or_else(|| format!("top_k must be an integer >= 0 (0 = off), got {x}")))
            .transpose()?;
        let do_sample = field("do_sample").map(|x| x.as_bool().ok_or_else(|| format!("do_sample must be true or false, got {x}"))).transpose()?;
        let config = GenerationConfig {
            bos_token_id: v.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32),
            eos_token_ids: id_list(v.get("eos_token_id")),
            temperature: number("temperature")?,
            top_k,
            top_p: number("top_p")?,
            repetition_penalty: number("repetition_penalty")?,
            do_sample,
        };
        config.check()?;
        Ok(config)
    }

    /// Whether the sampling defaults are values a request may hold (the ranges of
    /// `SamplingParams::validate`, in f32): a request that leaves a field unset
    /// takes it, so a bad one would fail every such request, blaming its caller.
    pub fn check(&self) -> std::result::Result<(), String> {
        let narrow = |name: &str, v: Option<f64>| -> std::result::Result<Option<f32>, String> {
            v.map(|x| crate::sampling_options::sampling_f32(name, x).map_err(|e| e.to_string())).transpose()
        };
        if let Some(t) = narrow("temperature", self.temperature)?.filter(|t| !(t.is_finite() && *t >= 0.0)) {
            return Err(format!("temperature must be a finite number >= 0, got {t}"));
        }
        if let Some(p) = narrow("top_p", self.top_p)?.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return Err(format!("top_p must be in (0, 1], got {p}"));
        }
        if let Some(r) = narrow("repetition_penalty", self.repetition_penalty)?.filter(|r| !(r.is_finite() && *r > 0.0)) {
            return Err(format!("repetition_penalty must be a finite number > 0 (1 = off), got {r}"));
        }
        if let Some(k) = self.top_k.filter(|&k| k > u32::MAX as u64) {
            return Err(format!("top_k must be at most {}, got {k}", u32::MAX));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_sampling_fields() {
        let cfg = GenerationConfig::from_json(&serde_json::json!({
            "do_sample": true, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]
        }))
        .unwrap();
        assert_eq!(cfg.eos_token_ids, vec![1, 2]);
        assert_eq!((cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p, cfg.repetition_penalty), (Some(true), Some(0.6), Some(20), Some(0.95), None));
        assert_eq!(GenerationConfig::from_json(&serde_json::json!({"eos_token_id": 7})).unwrap().eos_token_ids, vec![7]);
        let nulls = serde_json::json!({"temperature": null, "top_p": null, "top_k": null, "do_sample": null});
        assert_eq!(GenerationConfig::from_json(&nulls).unwrap(), GenerationConfig::default());
    }

    #[test]
    fn refuses_sampling_fields_a_request_could_not_hold() {
        let err = |v: serde_json::Value| GenerationConfig::from_json(&v).unwrap_err();
        // Out of range: every request leaving the field unset would fail.
        assert!(err(serde_json::json!({"top_p": 5})).contains("top_p must be in (0, 1], got 5"));
        assert!(err(serde_json::json!({"do_sample": true, "top_p": 0.0})).contains("top_p"));
        assert!(err(serde_json::json!({"temperature": -3})).contains("temperature must be a finite number >= 0"));
        assert!(err(serde_json::json!({"repetition_penalty": 0})).contains("repetition_penalty"));
        assert!(err(serde_json::json!({"temperature": 1e300})).contains("32-bit float"));
        assert!(err(serde_json::json!({"top_k": 5_000_000_000u64})).contains("top_k must be at most"));
        // Of the wrong type: dropping it would silently change the defaults.
        assert!(err(serde_json::json!({"temperature": "0.7"})).contains("temperature must be a number, got \"0.7\""));
        assert!(err(serde_json::json!({"top_k": -1})).contains("top_k must be an integer >= 0"));
        assert!(err(serde_json::json!({"top_k": 2.5})).contains("top_k"));
        assert!(err(serde_json::json!({"do_sample": "yes"})).contains("do_sample must be true or false"));
        // The edges a real file uses stay valid.
        let ok = serde_json::json!({"do_sample": false, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0});
        assert!(GenerationConfig::from_json(&ok).is_ok());
    }

    #[test]
    fn a_bad_file_is_refused_at_load_naming_it() {
        let dir = std::env::temp_dir().join(format!("rocket-genconfig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("generation_config.json");
        std::fs::write(&path, r#"{"do_sample": true, "top_p": 5}"#).unwrap();
        let e = GenerationConfig::from_file(&path).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::ModelLoad, "{e}");
        assert!(e.to_string().contains("generation_config.json") && e.to_string().contains("top_p"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

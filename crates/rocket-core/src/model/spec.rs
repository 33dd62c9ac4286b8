//! `ModelSpec`: the validated shapes and family flags of a model. Built in one
//! place from an HF `config.json` (here) or GGUF metadata (`weights::gguf`);
//! everything downstream reads only this.

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, RocketError};

pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "qwen3"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen3,
}

impl Family {
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen3 => "qwen3",
        }
    }

    pub fn from_model_type(model_type: &str) -> Result<Self> {
        match model_type {
            "llama" => Ok(Family::Llama),
            "qwen3" => Ok(Family::Qwen3),
            other => Err(RocketError::UnsupportedModelType {
                found: other.to_string(),
                supported: SUPPORTED_MODEL_TYPES.to_vec(),
            }),
        }
    }
}

/// Llama-3 style frequency-dependent RoPE scaling (`rope_type: "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelSpec {
    pub family: Family,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Per-frequency RoPE divisors (`head_dim / 2` of them), as a GGUF's `rope_freqs`
    /// tensor stores llama3 scaling: frequency `i` is divided by factor `i`. Applied on
    /// top of `rope_scaling` (a GGUF carries one or the other, never both).
    pub rope_freq_factors: Option<Vec<f32>>,
    pub tie_word_embeddings: bool,
    /// Qwen3 normalises q and k per head before RoPE.
    pub qk_norm: bool,
}

impl ModelSpec {
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Multiply-adds of one row through every layer's matrix products (q, k, v,
    /// o, gate, up, down), saturating for sizes no validated spec has.
    pub fn layer_matmul_macs(&self) -> u64 {
        let (d, ff) = (self.hidden_size as u64, self.intermediate_size as u64);
        let (q, kv) = (self.q_dim() as u64, self.kv_dim() as u64);
        let per_layer = d.saturating_mul(2 * q + 2 * kv).saturating_add(d.saturating_mul(ff).saturating_mul(3));
        per_layer.saturating_mul(self.num_layers as u64)
    }

    /// Parameter count of the canonical tensors (tied embeddings counted once).
    /// A validated spec's count fits in `usize`; an unvalidated one saturates.
    pub fn parameter_count(&self) -> usize {
        self.checked_sizes().map_or(usize::MAX, |(params, _)| params)
    }

    /// Weight elements streamed by one decode step: every matrix once, plus one
    /// embedding row (the gather) and the norms; the LM head reads the whole
    /// vocabulary matrix even when it is tied to the embedding.
    pub fn weight_elements_per_step(&self) -> usize {
        self.checked_sizes().map_or(usize::MAX, |(_, per_step)| per_step)
    }

    /// (`parameter_count`, `weight_elements_per_step`), or None where a size
    /// (these, or a tensor's element count) overflows `usize`.
    fn checked_sizes(&self) -> Option<(usize, usize)> {
        let d = self.hidden_size;
        let q_dim = self.num_heads.checked_mul(self.head_dim)?;
        let kv_dim = self.num_kv_heads.checked_mul(self.head_dim)?;
        let per_layer = [
            d.checked_mul(q_dim)?.checked_mul(2)?, // q, o
            d.checked_mul(kv_dim)?.checked_mul(2)?, // k, v
            d.checked_mul(self.intermediate_size)?.checked_mul(3)?,
            d.checked_mul(2)?,
            if self.qk_norm { self.head_dim.checked_mul(2)? } else { 0 },
        ]
        .into_iter()
        .try_fold(0usize, usize::checked_add)?;
        let embed = self.vocab_size.checked_mul(d)?;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        let layers = self.num_layers.checked_mul(per_layer)?;
        let params = embed.checked_add(head)?.checked_add(d)?.checked_add(layers)?;
        // Everything but the embedding (an untied LM head included), the LM head's
        // read of a tied embedding, and one gathered embedding row.
        let tied_head = if self.tie_word_embeddings { embed } else { 0 };
        let per_step = (params - embed).checked_add(tied_head)?.checked_add(d)?;
        Some((params, per_step))
    }

    /// Check internal consistency; called by every constructor.
    pub fn validate(&self, origin: &Path) -> Result<()> {
        let fail = |m: String| Err(RocketError::config(origin, m));
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return fail(format!("{name} must be positive"));
            }
        }
        if self.num_heads % self.num_kv_heads != 0 {
            return fail(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.checked_sizes().is_none() {
            return fail(format!(
                "sizes overflow: hidden_size {}, intermediate_size {}, {} layers, {} heads of {} (kv {}), vocab_size {} give more parameters than this machine can address",
                self.hidden_size, self.intermediate_size, self.num_layers, self.num_heads, self.head_dim, self.num_kv_heads, self.vocab_size
            ));
        }
        if self.head_dim % 2 != 0 {
            return fail(format!("head_dim ({}) must be even for RoPE", self.head_dim));
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return fail(format!("rms_norm_eps must be positive, got {}", self.rms_norm_eps));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return fail(format!("rope_theta must be positive, got {}", self.rope_theta));
        }
        if let Some(s) = &self.rope_scaling {
            // Negated so that NaN fails too.
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            if !(s.factor > 0.0) || !(s.high_freq_factor > s.low_freq_factor) || s.original_max_position_embeddings == 0 {
                return fail(format!("invalid llama3 rope_scaling {s:?}"));
            }
        }
        if let Some(f) = &self.rope_freq_factors {
            if f.len() != self.head_dim / 2 || !f.iter().all(|x| x.is_finite() && *x > 0.0) {
                return fail(format!("rope frequency factors must be {} positive numbers, got {f:?}", self.head_dim / 2));
            }
        }
        Ok(())
    }

    /// Parse an HF `config.json` (already read as JSON).
    pub fn from_hf_config(config: &Value, origin: &Path) -> Result<Self> {
        let cfg = HfConfig { v: config, origin };
        let model_type = cfg.str("model_type")?;
        let family = Family::from_model_type(&model_type)?;

        if let Some(act) = config.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(RocketError::config(origin, format!("hidden_act {act:?} is not supported (only \"silu\")")));
            }
        }
        for flag in ["attention_bias", "mlp_bias", "use_sliding_window"] {
            if config.get(flag).and_then(Value::as_bool).unwrap_or(false) {
                return Err(RocketError::config(origin, format!("{flag}=true is not supported")));
            }
        }

        let hidden_size = cfg.usize("hidden_size")?;
        let num_heads = cfg.usize("num_attention_heads")?;
        let num_kv_heads = cfg.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match cfg.opt_usize("head_dim")? {
            Some(h) => h,
            None => {
                if num_heads == 0 || hidden_size % num_heads != 0 {
                    return Err(RocketError::config(origin, "head_dim missing and hidden_size is not divisible by num_attention_heads"));
                }
                hidden_size / num_heads
            }
        };
        let (rope_theta, rope_scaling) = parse_rope(config, origin)?;
        let spec = ModelSpec {
            family,
            hidden_size,
            intermediate_size: cfg.usize("intermediate_size")?,
            num_layers: cfg.usize("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: cfg.usize("vocab_size")?,
            max_position_embeddings: cfg.opt_usize("max_position_embeddings")?.unwrap_or(2048),
            rms_norm_eps: cfg.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            rope_freq_factors: None,
            tie_word_embeddings: config.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            qk_norm: family == Family::Qwen3,
        };
        spec.validate(origin)?;
        Ok(spec)
    }
}

/// RoPE settings in either spelling: legacy `rope_theta` + `rope_scaling`, or
/// transformers-5 `rope_parameters` (which carries the theta inside).
fn parse_rope(config: &Value, origin: &Path) -> Result<(f64, Option<Llama3RopeScaling>)> {
    let params = config
        .get("rope_parameters")
        .filter(|v| !v.is_null())
        .or_else(|| config.get("rope_scaling").filter(|v| !v.is_null()));
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| config.get("rope_theta"))
        .map(|v| v.as_f64().ok_or_else(|| RocketError::config(origin, "rope_theta must be a number")))
        .transpose()?
        .unwrap_or(10000.0);
    let Some(p) = params else { return Ok((theta, None)) };
    let rope_type = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match rope_type {
        "default" => Ok((theta, None)),
        "llama3" => {
            let num = |k: &str| {
                p.get(k)
                    .and_then(Value::as_f64)
                    .ok_or_else(|| RocketError::config(origin, format!("llama3 rope scaling needs a numeric {k:?}")))
            };
            Ok((
                theta,
                Some(Llama3RopeScaling {
                    factor: num("factor")?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: num("original_max_position_embeddings")? as usize,
                }),
            ))
        }
        other => Err(RocketError::config(
            origin,
            format!("rope_type {other:?} is not supported (supported: default, llama3)"),
        )),
    }
}

struct HfConfig<'a> {
    v: &'a Value,
    origin: &'a Path,
}

impl HfConfig<'_> {
    fn str(&self, key: &str) -> Result<String> {
        match self.v.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(RocketError::config(self.origin, format!("{key} must be a string"))),
            None => Err(RocketError::config(self.origin, format!("missing {key}"))),
        }
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| RocketError::config(self.origin, format!("{key} must be a non-negative integer, got {v}"))),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| RocketError::config(self.origin, format!("missing {key}")))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| RocketError::config(self.origin, format!("{key} must be a number, got {v}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        })
    }

    #[test]
    fn legacy_and_v5_rope_spellings_agree() {
        let legacy = ModelSpec::from_hf_config(&base(), Path::new("c")).unwrap();
        let mut v5 = base();
        let obj = v5.as_object_mut().unwrap();
        obj.remove("rope_theta");
        let mut scaling = obj.remove("rope_scaling").unwrap();
        scaling["rope_theta"] = json!(500000.0);
        obj.insert("rope_parameters".into(), scaling);
        let new = ModelSpec::from_hf_config(&v5, Path::new("c")).unwrap();
        assert_eq!(legacy, new);
        assert_eq!(new.head_dim, 16);
        assert_eq!(new.rope_scaling.unwrap().original_max_position_embeddings, 64);
    }

    #[test]
    fn unknown_model_type_lists_supported() {
        let mut c = base();
        c["model_type"] = json!("gpt_neox");
        let e = ModelSpec::from_hf_config(&c, Path::new("c")).unwrap_err().to_string();
        assert!(e.contains("gpt_neox") && e.contains("llama") && e.contains("qwen3"), "{e}");
    }

    #[test]
    fn bad_head_ratio_is_rejected() {
        let mut c = base();
        c["num_key_value_heads"] = json!(3);
        let e = ModelSpec::from_hf_config(&c, Path::new("c")).unwrap_err().to_string();
        assert!(e.contains("multiple of num_key_value_heads"), "{e}");
    }

    #[test]
    fn missing_field_is_named() {
        let mut c = base();
        c.as_object_mut().unwrap().remove("hidden_size");
        let e = ModelSpec::from_hf_config(&c, Path::new("c")).unwrap_err().to_string();
        assert!(e.contains("missing hidden_size"), "{e}");
    }

    #[test]
    fn sizes_that_overflow_are_rejected() {
        for (key, value) in [("vocab_size", 1u64 << 60), ("hidden_size", 1 << 60), ("num_hidden_layers", u64::MAX), ("intermediate_size", 1 << 62)] {
            let mut c = base();
            c[key] = json!(value);
            c["head_dim"] = json!(16);
            let e = ModelSpec::from_hf_config(&c, Path::new("c")).unwrap_err().to_string();
            assert!(e.contains("sizes overflow"), "{key}: {e}");
        }
    }

    #[test]
    fn unknown_rope_type_is_rejected() {
        let mut c = base();
        c["rope_scaling"]["rope_type"] = json!("yarn");
        let e = ModelSpec::from_hf_config(&c, Path::new("c")).unwrap_err().to_string();
        assert!(e.contains("yarn"), "{e}");
    }
}

//! The canonical tensor layout of a llama/qwen3 decoder, taken out of `Weights`
//! with every shape checked, so backends index typed fields, never names.

use super::spec::ModelSpec;
use crate::error::Result;
use crate::weights::{Tensor, Weights};

pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub q_proj: Tensor,
    pub k_proj: Tensor,
    pub v_proj: Tensor,
    pub o_proj: Tensor,
    /// Qwen3 per-head RMSNorm weights over head_dim.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub mlp_norm: Vec<f32>,
    pub gate_proj: Tensor,
    pub up_proj: Tensor,
    pub down_proj: Tensor,
}

pub struct ModelWeights {
    pub embed_tokens: Tensor,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// None when tied to `embed_tokens`.
    untied_lm_head: Option<Tensor>,
}

impl ModelWeights {
    pub fn from_weights(spec: &ModelSpec, mut w: Weights) -> Result<Self> {
        let d = spec.hidden_size;
        let ff = spec.intermediate_size;
        let embed_tokens = w.take("model.embed_tokens.weight", &[spec.vocab_size, d])?;
        // Capacity from the tensors present, not the claimed layer count: a corrupt
        // config or GGUF may claim billions of layers (each is checked below).
        let mut layers = Vec::with_capacity(spec.num_layers.min(w.len()));
        for i in 0..spec.num_layers {
            let p = format!("model.layers.{i}");
            let norm = |w: &mut Weights, name: &str, n: usize| -> Result<Vec<f32>> {
                Ok(w.take(&format!("{p}.{name}"), &[n])?.to_f32_vec())
            };
            let (q_norm, k_norm) = if spec.qk_norm {
                (
                    Some(norm(&mut w, "self_attn.q_norm.weight", spec.head_dim)?),
                    Some(norm(&mut w, "self_attn.k_norm.weight", spec.head_dim)?),
                )
            } else {
                (None, None)
            };
            layers.push(LayerWeights {
                attn_norm: norm(&mut w, "input_layernorm.weight", d)?,
                q_proj: w.take(&format!("{p}.self_attn.q_proj.weight"), &[spec.q_dim(), d])?,
                k_proj: w.take(&format!("{p}.self_attn.k_proj.weight"), &[spec.kv_dim(), d])?,
                v_proj: w.take(&format!("{p}.self_attn.v_proj.weight"), &[spec.kv_dim(), d])?,
                o_proj: w.take(&format!("{p}.self_attn.o_proj.weight"), &[d, spec.q_dim()])?,
                q_norm,
                k_norm,
                mlp_norm: norm(&mut w, "post_attention_layernorm.weight", d)?,
                gate_proj: w.take(&format!("{p}.mlp.gate_proj.weight"), &[ff, d])?,
                up_proj: w.take(&format!("{p}.mlp.up_proj.weight"), &[ff, d])?,
                down_proj: w.take(&format!("{p}.mlp.down_proj.weight"), &[d, ff])?,
            });
        }
        let final_norm = w.take("model.norm.weight", &[d])?.to_f32_vec();
        let untied_lm_head =
            if spec.tie_word_embeddings { None } else { Some(w.take("lm_head.weight", &[spec.vocab_size, d])?) };
        Ok(ModelWeights { embed_tokens, layers, final_norm, untied_lm_head })
    }

    pub fn lm_head(&self) -> &Tensor {
        self.untied_lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Bytes one decode step reads: every matrix once, the LM head (even when
    /// tied), one embedding row, and the norm vectors (kept in f32).
    pub fn bytes_per_decode_step(&self) -> usize {
        let bytes = |t: &Tensor| t.numel() * t.dtype().size();
        let norms: usize = self
            .layers
            .iter()
            .map(|l| {
                l.attn_norm.len() + l.mlp_norm.len() + l.q_norm.as_ref().map_or(0, Vec::len) + l.k_norm.as_ref().map_or(0, Vec::len)
            })
            .sum::<usize>()
            + self.final_norm.len();
        let matrices: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj])
            .map(bytes)
            .sum();
        let embed_row = self.embed_tokens.shape()[1] * self.embed_tokens.dtype().size();
        matrices + bytes(self.lm_head()) + embed_row + 4 * norms
    }

    /// (group, dtype) pairs for `inspect`: each group lists the dtypes its tensors use.
    pub fn dtype_groups(&self) -> Vec<(&'static str, String)> {
        let join = |ts: Vec<&Tensor>| {
            let mut names: Vec<String> = ts.iter().map(|t| t.dtype().to_string()).collect();
            names.sort();
            names.dedup();
            names.join("+")
        };
        let l = &self.layers;
        vec![
            ("embed_tokens", join(vec![&self.embed_tokens])),
            ("attention q/k/v/o", join(l.iter().flat_map(|x| [&x.q_proj, &x.k_proj, &x.v_proj, &x.o_proj]).collect())),
            ("mlp gate/up/down", join(l.iter().flat_map(|x| [&x.gate_proj, &x.up_proj, &x.down_proj]).collect())),
            ("lm_head", if self.untied_lm_head.is_some() { join(vec![self.lm_head()]) } else { "tied to embed_tokens".into() }),
            ("norms", "f32 (widened at load)".into()),
        ]
    }
}

//! The CPU reference backend: f32 arithmetic on the stored weights, KV cache in
//! f32, prefill and decode through the same code path. Plain on purpose — it is
//! the oracle — with matmuls split over threads so it is also usable.

pub mod attention;
pub mod linalg;

use std::sync::Arc;

use super::{Backend, Logits, Session};
use crate::error::{Result, RocketError};
use crate::model::{rope, ModelSpec, ModelWeights};
use linalg::{matmul, rms_norm, rms_norm_in_place, silu};

pub struct CpuBackend {
    spec: ModelSpec,
    weights: Arc<ModelWeights>,
    inv_freq: Vec<f32>,
}

impl CpuBackend {
    pub fn new(spec: ModelSpec, weights: Arc<ModelWeights>) -> Self {
        let inv_freq = rope::inv_freq(&spec);
        CpuBackend { spec, weights, inv_freq }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn new_session(&self, capacity: usize) -> Result<Box<dyn Session + '_>> {
        let per_layer = capacity * self.spec.kv_dim();
        Ok(Box::new(CpuSession {
            backend: self,
            capacity,
            len: 0,
            keys: (0..self.spec.num_layers).map(|_| Vec::with_capacity(per_layer)).collect(),
            values: (0..self.spec.num_layers).map(|_| Vec::with_capacity(per_layer)).collect(),
        }))
    }
}

pub struct CpuSession<'a> {
    backend: &'a CpuBackend,
    capacity: usize,
    len: usize,
    /// Per layer: [position][kv_dim], appended as tokens arrive.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl Session for CpuSession<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn forward(&mut self, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let b = self.backend;
        let s = &b.spec;
        let w = &*b.weights;
        let t = tokens.len();
        if t == 0 {
            return Err(RocketError::EmptyPrompt);
        }
        if self.len + t > self.capacity {
            return Err(RocketError::ContextOverflow { prompt_tokens: self.len + t, max_tokens: 0, limit: self.capacity });
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= s.vocab_size) {
            return Err(RocketError::invalid_arg("token id", bad, format!("must be < vocab size {}", s.vocab_size)));
        }
        let (d, qd, kvd, ff, hd) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.intermediate_size, s.head_dim);
        let eps = s.rms_norm_eps as f32;
        let start = self.len;

        let embed = w.embed_tokens.view();
        let mut x = vec![0f32; t * d];
        for (row, &id) in x.chunks_exact_mut(d).zip(tokens) {
            embed.to_f32_into(id as usize * d, row);
        }

        let mut h = vec![0f32; t * d];
        let mut q = vec![0f32; t * qd];
        let mut k = vec![0f32; t * kvd];
        let mut v = vec![0f32; t * kvd];
        let mut attn = vec![0f32; t * qd];
        let mut proj = vec![0f32; t * d];
        let mut gate = vec![0f32; t * ff];
        let mut up = vec![0f32; t * ff];

        for (li, layer) in w.layers.iter().enumerate() {
            rms_norm(&x, &layer.attn_norm, eps, &mut h);
            matmul(layer.q_proj.view(), qd, d, &h, t, &mut q);
            matmul(layer.k_proj.view(), kvd, d, &h, t, &mut k);
            matmul(layer.v_proj.view(), kvd, d, &h, t, &mut v);
            for ti in 0..t {
                let pos = start + ti;
                for head in q[ti * qd..(ti + 1) * qd].chunks_exact_mut(hd) {
                    if let Some(n) = &layer.q_norm {
                        rms_norm_in_place(head, n, eps);
                    }
                    rope::apply(head, pos, &b.inv_freq);
                }
                for head in k[ti * kvd..(ti + 1) * kvd].chunks_exact_mut(hd) {
                    if let Some(n) = &layer.k_norm {
                        rms_norm_in_place(head, n, eps);
                    }
                    rope::apply(head, pos, &b.inv_freq);
                }
            }
            self.keys[li].extend_from_slice(&k);
            self.values[li].extend_from_slice(&v);
            attention::causal(s, &q, &self.keys[li], &self.values[li], start, &mut attn);
            matmul(layer.o_proj.view(), d, qd, &attn, t, &mut proj);
            add_in_place(&mut x, &proj);

            rms_norm(&x, &layer.mlp_norm, eps, &mut h);
            matmul(layer.gate_proj.view(), ff, d, &h, t, &mut gate);
            matmul(layer.up_proj.view(), ff, d, &h, t, &mut up);
            for (g, &u) in gate.iter_mut().zip(&up) {
                *g = silu(*g) * u;
            }
            matmul(layer.down_proj.view(), d, ff, &gate, t, &mut proj);
            add_in_place(&mut x, &proj);
        }
        self.len += t;

        let rows: &[f32] = match logits {
            Logits::All => &x,
            Logits::Last => &x[(t - 1) * d..],
        };
        let n_rows = rows.len() / d;
        let mut normed = vec![0f32; rows.len()];
        rms_norm(rows, &w.final_norm, eps, &mut normed);
        let mut out = vec![0f32; n_rows * s.vocab_size];
        matmul(w.lm_head().view(), s.vocab_size, d, &normed, n_rows, &mut out);
        Ok(out)
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

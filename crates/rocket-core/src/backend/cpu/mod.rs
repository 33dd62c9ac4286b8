//! The CPU reference backend: f32 arithmetic on the stored weights, KV cache in
//! f32, prefill and decode through the same code path. Plain on purpose — it is
//! the oracle — with matmuls split over threads so it is also usable.

pub mod attention;
pub mod linalg;

use std::sync::Arc;

use super::{check_chunks, check_copy, own_session, Backend, Chunk, Logits, Session};
use crate::error::Result;
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

    fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
        let per_layer = capacity * self.spec.kv_dim();
        Ok(Box::new(CpuSession {
            capacity,
            len: 0,
            keys: (0..self.spec.num_layers).map(|_| Vec::with_capacity(per_layer)).collect(),
            values: (0..self.spec.num_layers).map(|_| Vec::with_capacity(per_layer)).collect(),
        }))
    }

    fn forward(&self, chunks: &mut [Chunk<'_>], logits: Logits) -> Result<Vec<f32>> {
        let s = &self.spec;
        check_chunks(chunks, s.vocab_size)?;
        let mut seqs: Vec<(&mut CpuSession, &[u32])> = Vec::with_capacity(chunks.len());
        for c in chunks.iter_mut() {
            seqs.push((own_session::<CpuSession>(c.session, "cpu")?, c.tokens));
        }
        Ok(self.forward_rows(&mut seqs, logits))
    }

    fn copy_prefix(&self, src: &mut dyn Session, dst: &mut dyn Session, len: usize) -> Result<()> {
        check_copy(src, dst, len)?;
        let kvd = self.spec.kv_dim();
        let src = own_session::<CpuSession>(src, "cpu")?;
        let dst = own_session::<CpuSession>(dst, "cpu")?;
        for (to, from) in dst.keys.iter_mut().zip(&src.keys).chain(dst.values.iter_mut().zip(&src.values)) {
            to.clear();
            to.extend_from_slice(&from[..len * kvd]);
        }
        dst.len = len;
        Ok(())
    }
}

impl CpuBackend {
    /// The transformer over the rows of every sequence, stacked: matmuls and
    /// norms see all rows at once; RoPE, the KV append and attention go sequence
    /// by sequence. Row results do not depend on what else is in the batch.
    fn forward_rows(&self, seqs: &mut [(&mut CpuSession, &[u32])], logits: Logits) -> Vec<f32> {
        let s = &self.spec;
        let w = &*self.weights;
        let (d, qd, kvd, ff, hd) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.intermediate_size, s.head_dim);
        let eps = s.rms_norm_eps as f32;
        let t: usize = seqs.iter().map(|(_, toks)| toks.len()).sum();
        // (first row, row count, first position) of each sequence.
        let spans: Vec<(usize, usize, usize)> = seqs
            .iter()
            .scan(0, |row, (sess, toks)| {
                let span = (*row, toks.len(), sess.len);
                *row += toks.len();
                Some(span)
            })
            .collect();

        let embed = w.embed_tokens.view();
        let mut x = vec![0f32; t * d];
        for (row, &id) in x.chunks_exact_mut(d).zip(seqs.iter().flat_map(|(_, toks)| toks.iter())) {
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
            for ((sess, _), &(row0, rows, pos0)) in seqs.iter_mut().zip(&spans) {
                for ti in 0..rows {
                    let (r, pos) = (row0 + ti, pos0 + ti);
                    for head in q[r * qd..(r + 1) * qd].chunks_exact_mut(hd) {
                        if let Some(n) = &layer.q_norm {
                            rms_norm_in_place(head, n, eps);
                        }
                        rope::apply(head, pos, &self.inv_freq);
                    }
                    for head in k[r * kvd..(r + 1) * kvd].chunks_exact_mut(hd) {
                        if let Some(n) = &layer.k_norm {
                            rms_norm_in_place(head, n, eps);
                        }
                        rope::apply(head, pos, &self.inv_freq);
                    }
                }
                sess.keys[li].extend_from_slice(&k[row0 * kvd..(row0 + rows) * kvd]);
                sess.values[li].extend_from_slice(&v[row0 * kvd..(row0 + rows) * kvd]);
                attention::causal(
                    s,
                    &q[row0 * qd..(row0 + rows) * qd],
                    &sess.keys[li],
                    &sess.values[li],
                    pos0,
                    &mut attn[row0 * qd..(row0 + rows) * qd],
                );
            }
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
        for ((sess, toks), _) in seqs.iter_mut().zip(&spans) {
            sess.len += toks.len();
        }

        let rows: Vec<f32> = match logits {
            Logits::All => x,
            Logits::Last => spans.iter().flat_map(|&(row0, rows, _)| x[(row0 + rows - 1) * d..][..d].to_vec()).collect(),
            Logits::KvOnly => return Vec::new(),
        };
        let n_rows = rows.len() / d;
        let mut normed = vec![0f32; rows.len()];
        rms_norm(&rows, &w.final_norm, eps, &mut normed);
        let mut out = vec![0f32; n_rows * s.vocab_size];
        matmul(w.lm_head().view(), s.vocab_size, d, &normed, n_rows, &mut out);
        out
    }
}

pub struct CpuSession {
    capacity: usize,
    len: usize,
    /// Per layer: [position][kv_dim], appended as tokens arrive.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl Session for CpuSession {
    fn len(&self) -> usize {
        self.len
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn kv_bytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|v| v.capacity() * std::mem::size_of::<f32>()).sum()
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

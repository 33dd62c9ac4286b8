//! Causal grouped-query attention over the f32 KV cache.

use rayon::prelude::*;

use super::linalg::softmax;
use crate::model::ModelSpec;

/// `q` holds `t` new tokens at positions `start..start+t`; `keys`/`values` hold
/// positions `0..start+t`, each `kv_dim` wide. Writes `out` as [t][q_dim].
pub fn causal(spec: &ModelSpec, q: &[f32], keys: &[f32], values: &[f32], start: usize, out: &mut [f32]) {
    let (hd, qd, kvd) = (spec.head_dim, spec.q_dim(), spec.kv_dim());
    let group = spec.num_heads / spec.num_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    out.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, o)| {
        let (ti, head) = (i / spec.num_heads, i % spec.num_heads);
        let kv_head = head / group;
        let qh = &q[ti * qd + head * hd..][..hd];
        let visible = start + ti + 1;
        scores.clear();
        scores.extend((0..visible).map(|p| {
            let kh = &keys[p * kvd + kv_head * hd..][..hd];
            qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale
        }));
        softmax(scores);
        o.fill(0.0);
        for (p, &wgt) in scores.iter().enumerate() {
            let vh = &values[p * kvd + kv_head * hd..][..hd];
            for (acc, &val) in o.iter_mut().zip(vh) {
                *acc += wgt * val;
            }
        }
    });
}

//! RoPE inverse frequencies, computed in f32 the way HF transformers does
//! (`rope_type` default and llama3), shared by every backend.

use super::spec::ModelSpec;

pub fn inv_freq(spec: &ModelSpec) -> Vec<f32> {
    let dim = spec.head_dim;
    let base = spec.rope_theta as f32;
    let mut freqs: Vec<f32> = (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect();
    if let Some(s) = &spec.rope_scaling {
        let factor = s.factor as f32;
        let (low, high) = (s.low_freq_factor as f32, s.high_freq_factor as f32);
        let old_ctx = s.original_max_position_embeddings as f32;
        let low_freq_wavelen = old_ctx / low;
        let high_freq_wavelen = old_ctx / high;
        for f in &mut freqs {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            let scaled = if wavelen > low_freq_wavelen { *f / factor } else { *f };
            // Written as transformers' `~(wavelen < high) & ~(wavelen > low)`.
            #[allow(clippy::neg_cmp_op_on_partial_ord)]
            let is_medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
            *f = if is_medium {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                (1.0 - smooth) * scaled / factor + smooth * scaled
            } else {
                scaled
            };
        }
    }
    freqs
}

/// Rotate one head in place (HF `rotate_half` layout: pairs `i` and `i + dim/2`).
pub fn apply(head: &mut [f32], position: usize, inv_freq: &[f32]) {
    let half = head.len() / 2;
    for (i, &f) in inv_freq.iter().enumerate() {
        let angle = position as f32 * f;
        let (sin, cos) = angle.sin_cos();
        let (x1, x2) = (head[i], head[i + half]);
        head[i] = x1 * cos - x2 * sin;
        head[i + half] = x2 * cos + x1 * sin;
    }
}

//! RoPE inverse frequencies, computed in f32 the way HF transformers does
//! (`rope_type` default and llama3) or with a GGUF's per-frequency divisors,
//! shared by every backend.

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
    if let Some(factors) = &spec.rope_freq_factors {
        for (f, d) in freqs.iter_mut().zip(factors) {
            *f /= d;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::spec::Llama3RopeScaling;
    use serde_json::json;
    use std::path::Path;

    /// Llama-3.2's shapes and rope scaling (head_dim 64, theta 5e5, factor 32,
    /// original context 8192): 3 of its 32 frequencies fall in the band
    /// between the high- and low-frequency wavelengths, where llama3 smooths.
    fn llama32_spec() -> ModelSpec {
        let config = json!({
            "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        });
        ModelSpec::from_hf_config(&config, Path::new("config.json")).unwrap()
    }

    /// The llama3 rule from Meta's reference (`apply_scaling`), in f64 and written
    /// as three explicit regions, independently of `inv_freq`'s f32 form.
    fn llama3_reference(dim: usize, theta: f64, s: &Llama3RopeScaling) -> (Vec<f64>, [usize; 3]) {
        let (low_wavelen, high_wavelen) =
            (s.original_max_position_embeddings as f64 / s.low_freq_factor, s.original_max_position_embeddings as f64 / s.high_freq_factor);
        let mut regions = [0usize; 3];
        let freqs = (0..dim / 2)
            .map(|i| {
                let f = theta.powf(-((2 * i) as f64) / dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / f;
                if wavelen < high_wavelen {
                    regions[0] += 1;
                    f
                } else if wavelen > low_wavelen {
                    regions[2] += 1;
                    f / s.factor
                } else {
                    regions[1] += 1;
                    let smooth = (s.original_max_position_embeddings as f64 / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * f / s.factor + smooth * f
                }
            })
            .collect();
        (freqs, regions)
    }

    fn assert_close(got: &[f32], want: &[f64], rel: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(((g as f64 - w) / w).abs() <= rel, "inv_freq[{i}] = {g}, reference {w}");
        }
    }

    #[test]
    fn llama3_scaling_matches_the_reference_in_every_region() {
        let spec = llama32_spec();
        let scaling = spec.rope_scaling.clone().unwrap();
        let (want, regions) = llama3_reference(spec.head_dim, spec.rope_theta, &scaling);
        // The fixture must exercise all three regions, the smoothing band above all.
        assert!(regions.iter().all(|&n| n >= 3), "regions (high, band, low) = {regions:?}");
        assert_close(&inv_freq(&spec), &want, 2e-6);
    }

    #[test]
    fn unscaled_frequencies_are_the_plain_geometric_series() {
        let spec = ModelSpec { rope_scaling: None, rope_theta: 1_000_000.0, head_dim: 128, ..llama32_spec() };
        let want: Vec<f64> = (0..64).map(|i| 1e6f64.powf(-(2.0 * i as f64) / 128.0)).collect();
        assert_close(&inv_freq(&spec), &want, 2e-6);
    }

    #[test]
    fn apply_rotates_each_pair_by_position_times_frequency() {
        let spec = llama32_spec();
        let freqs = inv_freq(&spec);
        let half = spec.head_dim / 2;
        let mut state = 0x9e3779b97f4a7c15u64;
        let head: Vec<f32> = (0..spec.head_dim)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect();
        for position in [0usize, 1, 17, 1000, 8191] {
            let mut got = head.clone();
            apply(&mut got, position, &freqs);
            for i in 0..half {
                // (x1 + i x2) * e^{i p f}: the pair (i, i + half) as one complex number.
                let angle = position as f64 * freqs[i] as f64;
                let (x1, x2) = (head[i] as f64, head[i + half] as f64);
                let (re, im) = (x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos());
                // The kernel's angle is an f32 product: allow its rounding (half an ulp of the angle).
                let tol = 1e-5 + 1e-7 * angle.abs();
                assert!((got[i] as f64 - re).abs() < tol && (got[i + half] as f64 - im).abs() < tol,
                    "position {position} pair {i}: ({}, {}) vs ({re}, {im})", got[i], got[i + half]);
            }
            if position == 0 {
                assert_eq!(got, head, "position 0 must leave the head unchanged");
            }
        }
    }
}

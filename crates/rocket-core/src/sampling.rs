//! Sampling parameters and the sampler. The sampler is a pure function of
//! (logits, params, seed, step) so any backend — a GPU kernel later — can
//! reproduce the CPU's choice exactly: the random draw comes from a counter-based
//! hash of (seed, step), not from hidden generator state.

use crate::error::{Result, RocketError};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: usize,
    /// 0 = greedy (argmax); otherwise logits are divided by it before softmax.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches top_p (1 = off).
    pub top_p: f32,
    /// Seed for sampling; None draws a fresh one per request.
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { max_tokens: 16, temperature: 1.0, top_k: 0, top_p: 1.0, seed: None, ignore_eos: false }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams { max_tokens, temperature: 0.0, ..Self::default() }
    }

    pub fn validate(&self) -> Result<()> {
        if self.max_tokens == 0 {
            return Err(RocketError::invalid_arg("max_tokens", self.max_tokens, "must be at least 1"));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(RocketError::invalid_arg("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(RocketError::invalid_arg("top_p", self.top_p, "must be in (0, 1]"));
        }
        Ok(())
    }
}

/// splitmix64: a well-mixed 64-bit hash, cheap on any device.
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform draw in [0, 1) for generation step `step` of a request seeded with `seed`.
pub fn uniform(seed: u64, step: u64) -> f64 {
    let bits = splitmix64(splitmix64(seed) ^ step);
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A fresh seed from the OS-seeded hasher (no extra dependency needed).
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

/// Index of the largest logit (the lowest index among equal maxima).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Choose the next token.
pub fn sample(logits: &[f32], params: &SamplingParams, seed: u64, step: u64) -> u32 {
    if params.temperature == 0.0 {
        return argmax(logits);
    }
    let inv_t = 1.0 / params.temperature as f64;
    // Candidates most likely first (ties by index), truncated by top_k.
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let truncate = params.top_k > 0 && params.top_k < logits.len();
    if truncate || params.top_p < 1.0 {
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        if truncate {
            order.truncate(params.top_k);
        }
    }
    let max = order.iter().map(|&i| logits[i as usize]).fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<f64> = order.iter().map(|&i| ((logits[i as usize] as f64 - max) * inv_t).exp()).collect();
    let total: f64 = probs.iter().sum();
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            cum += p / total;
            if cum >= params.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        order.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let target = uniform(seed, step) * total;
    let mut cum = 0.0;
    for (p, &id) in probs.iter().zip(&order) {
        cum += p;
        if cum > target {
            return id;
        }
    }
    *order.last().expect("at least one candidate")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_maximum() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(sample(&[0.0, 3.0, 1.0], &SamplingParams::greedy(1), 1, 0), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_restricts() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams { temperature: 1.0, top_k: 3, ..SamplingParams::default() };
        let mut top3: Vec<u32> = (0..50).collect();
        top3.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top3.truncate(3);
        for step in 0..200 {
            let a = sample(&logits, &p, 42, step);
            assert_eq!(a, sample(&logits, &p, 42, step));
            assert!(top3.contains(&a));
        }
    }

    #[test]
    fn uniform_is_in_range_and_spread() {
        let draws: Vec<f64> = (0..10_000).map(|s| uniform(9, s)).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
    }

    #[test]
    fn invalid_values_name_the_parameter() {
        let e = SamplingParams { temperature: -1.0, ..SamplingParams::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("temperature"));
        let e = SamplingParams { max_tokens: 0, ..SamplingParams::default() }.validate().unwrap_err();
        assert!(e.to_string().contains("max_tokens"));
    }
}

//! Sampling parameters and the sampler. The sampler is a pure function of
//! (logits, params, seed, step, token history) so any backend — a GPU kernel
//! later — can reproduce the CPU's choice exactly: the random draw comes from a
//! counter-based hash of (seed, step), not from hidden generator state.
//!
//! Order of operations (vLLM's): penalties → min_tokens mask → temperature →
//! top_k → top_p → min_p → draw. Probabilities are summed as exact fixed-point
//! integers, so the choice does not depend on summation order (see `sample`).

use std::collections::HashMap;

use crate::error::{Result, RocketError};
use crate::portable_exp::portable_exp;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: usize,
    /// End-of-sequence and stop tokens are suppressed until this many tokens exist.
    pub min_tokens: usize,
    /// 0 = greedy (argmax); otherwise logits are divided by it before softmax.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches top_p (1 = off).
    pub top_p: f32,
    /// Drop tokens whose probability is below min_p × the top probability (0 = off).
    pub min_p: f32,
    /// HF-style: logits of tokens seen in prompt or output are divided (if > 0) or
    /// multiplied (if < 0) by this (1 = off).
    pub repetition_penalty: f32,
    /// OpenAI-style, over generated tokens: subtract this once per distinct token seen.
    pub presence_penalty: f32,
    /// OpenAI-style, over generated tokens: subtract this per occurrence.
    pub frequency_penalty: f32,
    /// Seed for sampling; None draws a fresh one per request.
    pub seed: Option<u64>,
    /// Strings that end generation; the output is cut before them.
    pub stop: Vec<String>,
    /// Token ids that end generation (kept in token_ids, like EOS).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Also return log-probabilities: of each chosen token and of this many top alternatives.
    pub logprobs: Option<usize>,
    /// Leave special tokens out of the output text.
    pub skip_special_tokens: bool,
}

pub const MAX_LOGPROBS: usize = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            min_tokens: 0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            skip_special_tokens: true,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams { max_tokens, temperature: 0.0, ..Self::default() }
    }

    /// Whether any penalty changes logits at all.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |p: &str, v: &dyn ToString, m: &str| Err(RocketError::invalid_arg(p, v.to_string(), m));
        if self.max_tokens == 0 {
            return bad("max_tokens", &self.max_tokens, "must be at least 1");
        }
        if self.min_tokens > self.max_tokens {
            return bad("min_tokens", &self.min_tokens, &format!("must be <= max_tokens ({})", self.max_tokens));
        }
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad("temperature", &self.temperature, "must be a finite number >= 0 (0 = greedy)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", &self.top_p, "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", &self.min_p, "must be in [0, 1]");
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad("repetition_penalty", &self.repetition_penalty, "must be a finite number > 0 (1 = off)");
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return bad("presence_penalty", &self.presence_penalty, "must be in [-2, 2]");
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return bad("frequency_penalty", &self.frequency_penalty, "must be in [-2, 2]");
        }
        if let Some(s) = self.stop.iter().find(|s| s.is_empty()) {
            return bad("stop", &format!("{s:?}"), "stop strings must be non-empty");
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return bad("logprobs", &n, &format!("must be in [0, {MAX_LOGPROBS}]"));
        }
        Ok(())
    }
}

/// splitmix64: a well-mixed 64-bit hash, cheap on any device.
pub(crate) fn splitmix64(mut z: u64) -> u64 {
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

/// Index of the largest logit (the lowest index among equal maxima). NaN and
/// -inf never win; a row of only those gives 0. The device argmax kernels
/// follow the same rule.
pub fn argmax(logits: &[f32]) -> u32 {
    let (mut best, mut best_v) = (0, f32::NEG_INFINITY);
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// What the penalties need to know about a request's tokens so far.
#[derive(Debug, Clone, Default)]
pub struct TokenHistory {
    /// Distinct tokens of the prompt and output (repetition penalty).
    seen: HashMap<u32, ()>,
    /// Occurrences of each generated token (presence/frequency penalties).
    generated: HashMap<u32, u32>,
    generated_len: usize,
}

impl TokenHistory {
    pub fn new(prompt: &[u32]) -> Self {
        TokenHistory { seen: prompt.iter().map(|&t| (t, ())).collect(), ..Self::default() }
    }

    pub fn push(&mut self, token: u32) {
        self.seen.insert(token, ());
        *self.generated.entry(token).or_default() += 1;
        self.generated_len += 1;
    }

    pub fn generated_len(&self) -> usize {
        self.generated_len
    }

    /// Every token the repetition penalty applies to (prompt and output), with
    /// how often it was generated: all a device needs to apply the penalties.
    pub fn penalty_entries(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.seen.keys().map(|&t| (t, self.generated.get(&t).copied().unwrap_or(0)))
    }

}

/// Apply penalties and the min_tokens mask to `logits` in place. `end_ids` are the
/// tokens that would end generation (EOS unless ignored, and stop_token_ids).
pub fn process_logits(logits: &mut [f32], params: &SamplingParams, history: &TokenHistory, end_ids: &[u32]) {
    if params.repetition_penalty != 1.0 {
        let p = params.repetition_penalty;
        for &t in history.seen.keys() {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = if *l > 0.0 { *l / p } else { *l * p };
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        for (&t, &count) in &history.generated {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.frequency_penalty * count as f32 + params.presence_penalty;
            }
        }
    }
    if history.generated_len < params.min_tokens {
        for &t in end_ids {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// 2^63: a candidate's weight is its probability relative to the most likely
/// candidate (in (0, 1]) as an integer number of 2^-63 units.
const FIXED_ONE: f64 = 9_223_372_036_854_775_808.0;

/// A token that can still be sampled.
#[derive(Clone, Copy)]
struct Candidate {
    logit: f32,
    id: u32,
    /// Probability relative to the most likely candidate, at the temperature.
    p: f64,
}

impl Candidate {
    fn weight(&self) -> u64 {
        (self.p * FIXED_ONE) as u64
    }
}

/// Most likely first, ties by index: a total order, so any partial selection
/// agrees with a full sort.
fn most_likely_first(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Choose the next token from processed logits.
///
/// Weights are exact integers (`Candidate::weight`), so every sum (the nucleus
/// normaliser, the draw's total and running sum) has the same bits in any
/// order: a backend that sums in parallel reproduces the choice exactly. Only
/// the candidates that top-k / top-p / min-p keep are sorted, so the usual chat
/// settings cost one pass over the vocabulary rather than a sort of it.
pub fn sample(logits: &[f32], params: &SamplingParams, seed: u64, step: u64) -> u32 {
    if params.temperature == 0.0 {
        return argmax(logits);
    }
    // NaN and -inf are never candidates.
    let max = logits.iter().copied().filter(|&l| l > f32::NEG_INFINITY).fold(f32::NEG_INFINITY, f32::max);
    // No candidate, or +inf ones that take all the mass: the first of the best.
    if max.is_infinite() {
        return argmax(logits);
    }
    let inv_t = 1.0 / params.temperature as f64;
    // Below e^-44 a probability is under one weight unit (2^-63 = e^-43.7): its
    // weight is 0 whether or not exp is computed, so skip it.
    let prob = |logit: f32| {
        let x = (logit as f64 - max as f64) * inv_t;
        if x < -44.0 {
            0.0
        } else {
            portable_exp(x)
        }
    };
    let mut pool: Vec<Candidate> = logits
        .iter()
        .enumerate()
        .filter(|(_, &l)| l > f32::NEG_INFINITY)
        .map(|(i, &logit)| Candidate { logit, id: i as u32, p: prob(logit) })
        .collect();

    let top_k = params.top_k > 0 && params.top_k < pool.len();
    if top_k || params.top_p < 1.0 || params.min_p > 0.0 {
        // top_k, then top_p, then min_p, each keeping a prefix of the sorted candidates.
        if top_k {
            pool.select_nth_unstable_by(params.top_k - 1, most_likely_first);
            pool.truncate(params.top_k);
        }
        let min_p = params.min_p as f64;
        if params.top_p < 1.0 {
            nucleus(&mut pool, params.top_p as f64);
        } else {
            if min_p > 0.0 {
                pool.retain(|c| c.p >= min_p);
            }
            pool.sort_unstable_by(most_likely_first);
        }
        if min_p > 0.0 {
            // The first candidate is the most likely: probability 1 relative to itself.
            let keep = pool.iter().take_while(|c| c.p >= min_p).count().max(1);
            pool.truncate(keep);
        }
    }
    let total: u128 = pool.iter().map(|c| c.weight() as u128).sum();
    let target = (uniform(seed, step) * total as f64) as u128;
    let mut cum = 0u128;
    for c in &pool {
        cum += c.weight() as u128;
        if cum > target {
            return c.id;
        }
    }
    pool.last().expect("at least one candidate").id
}

/// Keeps the shortest most-likely-first prefix of `pool` whose weight reaches
/// `top_p` of the pool's total, sorted. It sorts only as many candidates as it
/// needs: the top 64, then, while they fall short, a larger top guessed from how
/// much of the mass they held (at least 4x more), and everything once that
/// would be over a quarter of the pool.
fn nucleus(pool: &mut Vec<Candidate>, top_p: f64) {
    let total = pool.iter().map(|c| c.weight() as u128).sum::<u128>() as f64;
    let mut m = pool.len().min(64);
    loop {
        if m < pool.len() {
            pool.select_nth_unstable_by(m - 1, most_likely_first);
        }
        pool[..m].sort_unstable_by(most_likely_first);
        let mut cum = 0u128;
        for i in 0..m {
            cum += pool[i].weight() as u128;
            if cum as f64 / total >= top_p {
                pool.truncate(i + 1);
                return;
            }
        }
        if m == pool.len() {
            return; // rounding kept the whole pool below top_p: keep all of it
        }
        // The top m held cum/total of the mass; the next candidates are lighter.
        let guess = (m as f64 * 2.0 * top_p * total / (cum as f64).max(1.0)).min(pool.len() as f64) as usize;
        let next = guess.max(4 * m);
        m = if next > pool.len() / 4 { pool.len() } else { next };
    }
}

/// log-softmax of the model's logits at `token`, and the `n` most likely tokens.
pub fn logprobs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_z = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    let lp = |i: u32| (logits[i as usize] as f64 - log_z) as f32;
    let mut top: Vec<u32> = Vec::with_capacity(n + 1);
    if n > 0 {
        // Partial selection keeps this O(vocab · n) for small n.
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < n || l > logits[*top.last().unwrap() as usize] {
                let pos = top.partition_point(|&j| logits[j as usize] >= l);
                top.insert(pos, i as u32);
                top.truncate(n);
            }
        }
    }
    (lp(token), top.into_iter().map(|i| (i, lp(i))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn greedy_picks_first_maximum() {
        assert_eq!(argmax(&[0.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(sample(&[0.0, 3.0, 1.0], &SamplingParams::greedy(1), 1, 0), 1);
        // NaN never wins, wherever it is; nothing but -inf/NaN gives 0.
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 2);
        assert_eq!(argmax(&[1.0, f32::NAN, 0.5]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, -3.0]), 1);
        assert_eq!(argmax(&[-0.0, 0.0, -1.0]), 0); // -0.0 == +0.0: the first wins
        // +inf takes all the mass under any filter; the first one is chosen.
        let inf = [0.5, f32::INFINITY, 2.0, f32::INFINITY];
        for p in [params(|_| {}), params(|p| p.min_p = 0.1), params(|p| p.top_p = 0.5), params(|p| p.top_k = 2)] {
            assert_eq!(sample(&inf, &p, 4, 0), 1);
        }
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_restricts() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(|p| p.top_k = 3);
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
        let cases: Vec<(SamplingParams, &str)> = vec![
            (params(|p| p.temperature = -1.0), "temperature"),
            (params(|p| p.max_tokens = 0), "max_tokens"),
            (params(|p| p.min_tokens = 17), "min_tokens"),
            (params(|p| p.min_p = 1.5), "min_p"),
            (params(|p| p.repetition_penalty = 0.0), "repetition_penalty"),
            (params(|p| p.presence_penalty = 3.0), "presence_penalty"),
            (params(|p| p.frequency_penalty = -2.5), "frequency_penalty"),
            (params(|p| p.stop = vec![String::new()]), "stop"),
            (params(|p| p.logprobs = Some(21)), "logprobs"),
        ];
        for (p, name) in cases {
            let e = p.validate().unwrap_err();
            assert!(matches!(&e, RocketError::InvalidArgument { parameter, .. } if parameter == name), "{e}");
        }
    }

    #[test]
    fn penalties_follow_hf_and_openai_conventions() {
        let mut h = TokenHistory::new(&[0]);
        h.push(1);
        h.push(1);
        let mut l = vec![2.0, -2.0, 1.0, 5.0];
        let p = params(|p| {
            p.repetition_penalty = 2.0;
            p.frequency_penalty = 0.5;
            p.presence_penalty = 0.25;
        });
        process_logits(&mut l, &p, &h, &[]);
        // token 0 (prompt): 2/2; token 1 (generated twice): -2*2 - (0.5*2 + 0.25).
        assert_eq!(l, vec![1.0, -5.25, 1.0, 5.0]);
    }

    #[test]
    fn min_tokens_masks_end_tokens() {
        let h = TokenHistory::new(&[]);
        let mut l = vec![0.0, 9.0, 1.0];
        process_logits(&mut l, &params(|p| p.min_tokens = 2), &h, &[1]);
        assert_eq!(argmax(&l), 2);
    }

    /// The sampler's definition written with full sorts, as a specification for
    /// the partial selections `sample` uses instead.
    fn sample_by_full_sort(logits: &[f32], p: &SamplingParams, seed: u64, step: u64) -> u32 {
        let mut order: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize] > f32::NEG_INFINITY).collect();
        if p.temperature == 0.0 || order.is_empty() {
            return argmax(logits);
        }
        let max = order.iter().map(|&i| logits[i as usize]).fold(f32::NEG_INFINITY, f32::max) as f64;
        let prob = |i: u32| ((logits[i as usize] as f64 - max) * (1.0 / p.temperature as f64)).exp();
        let weight = |i: u32| (prob(i) * FIXED_ONE) as u64 as u128;
        let truncate = p.top_k > 0 && p.top_k < order.len();
        if truncate || p.top_p < 1.0 || p.min_p > 0.0 {
            order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
            if truncate {
                order.truncate(p.top_k);
            }
            if p.top_p < 1.0 {
                let total = order.iter().map(|&i| weight(i)).sum::<u128>() as f64;
                let mut cum = 0u128;
                let keep = order.iter().position(|&i| {
                    cum += weight(i);
                    cum as f64 / total >= p.top_p as f64
                });
                order.truncate(keep.map_or(order.len(), |k| k + 1));
            }
            if p.min_p > 0.0 {
                let keep = order.iter().take_while(|&&i| prob(i) >= p.min_p as f64).count().max(1);
                order.truncate(keep);
            }
        }
        let total: u128 = order.iter().map(|&i| weight(i)).sum();
        let target = (uniform(seed, step) * total as f64) as u128;
        let mut cum = 0u128;
        *order.iter().find(|&&i| {
            cum += weight(i);
            cum > target
        }).unwrap_or(order.last().unwrap())
    }

    #[test]
    fn partial_selection_picks_what_full_sorts_pick() {
        let mut state = 5u64;
        let mut next = || {
            state = splitmix64(state);
            state
        };
        for case in 0..60 {
            let n = [7, 50, 300, 5000][case % 4];
            // Logits with ties (a coarse grid), masked tokens and a spread that
            // makes the nucleus span from a few to thousands of tokens.
            let spread = [0.5f32, 4.0, 20.0][case % 3];
            let mut logits: Vec<f32> = (0..n).map(|_| ((next() % 64) as f32 / 64.0 - 0.5) * spread).collect();
            logits[(next() % n as u64) as usize] = f32::NEG_INFINITY;
            let p = SamplingParams {
                temperature: [0.3f32, 0.7, 1.0, 1.6][case % 4],
                top_k: [0, 1, 5, 40, 100_000][case % 5],
                top_p: [1.0f32, 0.95, 0.5, 0.999][(case / 2) % 4],
                min_p: [0.0f32, 0.05, 0.3][(case / 3) % 3],
                ..SamplingParams::default()
            };
            for step in 0..40 {
                let seed = next();
                assert_eq!(sample(&logits, &p, seed, step), sample_by_full_sort(&logits, &p, seed, step), "case {case}: {p:?}");
            }
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = vec![0.0, (0.5f32).ln(), (0.01f32).ln()];
        let p = params(|p| p.min_p = 0.1);
        for step in 0..500 {
            assert_ne!(sample(&logits, &p, 3, step), 2);
        }
    }

    #[test]
    fn logprobs_are_log_softmax() {
        let (lp, top) = logprobs(&[0.0, 1.0, 2.0], 1, 2);
        let z = (1f64 + 1f64.exp() + 2f64.exp()).ln();
        assert!((lp as f64 - (1.0 - z)).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}

//! Sampling parameters and the sampler. The sampler is a pure function of
//! (logits, params, seed, step, token history) so any backend — a GPU kernel
//! later — can reproduce the CPU's choice exactly: the random draw comes from a
//! counter-based hash of (seed, step), not from hidden generator state.
//!
//! Order of operations (vLLM's): penalties → min_tokens mask → temperature →
//! top_k → top_p → min_p → draw. The cuts and the draw follow `crate::race`:
//! an exponential race (Gumbel-max) over the kept tokens, with cuts that any
//! split of the vocabulary can compute in pieces (exact integer weights, an
//! absolute grid of bins), so a GPU spreads one row over all its SMs.

use std::collections::HashMap;

use crate::error::{Result, RocketError};
use crate::megakernel::abi::RACE_TOPK_MAX;
use crate::portable_exp::sum_exp_below;
use crate::race;

/// The lowest temperature that samples: a request below it (and above 0)
/// decodes greedily, as vLLM's `_SAMPLING_EPS`. Smaller ones would carry
/// `logit / T` past f32's range, where every key of the race ties at infinity.
pub const MIN_TEMPERATURE: f32 = 1e-5;

/// `t`, or 0 (greedy) where it is below [`MIN_TEMPERATURE`]; a negative or
/// non-finite `t` is left for `SamplingParams::validate` to refuse.
pub fn effective_temperature(t: f32) -> f32 {
    if (0.0..MIN_TEMPERATURE).contains(&t) {
        0.0
    } else {
        t
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Tokens to generate at most (≥ 1).
    pub max_tokens: usize,
    /// End-of-sequence and stop tokens are suppressed until this many tokens exist.
    pub min_tokens: usize,
    /// 0 = greedy (argmax); otherwise logits are divided by it before softmax
    /// (the resolver makes anything below [`MIN_TEMPERATURE`] 0).
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

    /// Whether the megakernel's SMs pick this request's tokens together
    /// (`kernels/src/mk_race.cuh`): greedy, sampled with no top-k cut (top-p
    /// and min-p work on bins any part of the vocabulary can fill), or with a
    /// top-k of at most `RACE_TOPK_MAX` (64), each SM listing its k best. A
    /// larger top-k needs one CTA over the whole row while the others wait.
    pub fn races_on_all_sms(&self, vocab: usize) -> bool {
        self.temperature == 0.0 || !(self.top_k > 0 && self.top_k < vocab) || self.top_k <= RACE_TOPK_MAX
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

/// Choose the next token from processed logits, by the rule in `crate::race`
/// (an exponential race over the tokens that top-k, top-p and min-p keep).
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
    let hash = race::step_hash(seed, step);
    let m = race::scaled(max, inv_t);
    let mut pool: Vec<(f32, u32)> = logits.iter().enumerate().filter(|(_, &l)| l > f32::NEG_INFINITY).map(|(i, &l)| (l, i as u32)).collect();
    if params.top_k > 0 && params.top_k < pool.len() {
        // Most likely first, then the lower id: a total order.
        pool.select_nth_unstable_by(params.top_k - 1, |a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        pool.truncate(params.top_k);
    }
    let mut cut = i64::MIN;
    if params.top_p < 1.0 {
        let a = race::anchor(m);
        let mut bins: Vec<(i64, u64)> = pool.iter().map(|&(l, _)| {
            let s = race::scaled(l, inv_t);
            (race::bin(s), race::weight(s, a))
        }).collect();
        cut = race::top_p_bin(&mut bins, params.top_p);
    }
    if params.min_p > 0.0 {
        cut = cut.max(race::min_p_bin(m, params.min_p));
    }
    let winner = pool.iter().filter_map(|&(l, id)| {
        let s = race::scaled(l, inv_t);
        (race::bin(s) >= cut).then(|| race::race_key(s, id, hash))
    }).max();
    race::race_id(winner.expect("the top token is always kept"))
}

/// log-softmax of the model's logits at `token`, and the `n` most likely tokens.
pub fn logprobs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = max_ignoring_nan(logits) as f64;
    let log_z = max + sum_exp_below(logits, max).ln();
    let lp = |i: u32| (logits[i as usize] as f64 - log_z) as f32;
    (lp(token), top_n(logits, n).into_iter().map(|i| (i, lp(i))).collect())
}

/// The ids of the `n` largest logits, largest first (the lower id first among
/// equals). A partial selection, O(vocab · n) for small n: once the list is full,
/// a logit enters only above its last (`floor`), and blocks of 16 with none above
/// it are passed over with one vectorised compare.
fn top_n(logits: &[f32], n: usize) -> Vec<u32> {
    let mut top: Vec<u32> = Vec::with_capacity(n + 1);
    // Inserts logit i in order and returns the list's last logit.
    let offer = |top: &mut Vec<u32>, i: usize| {
        let l = logits[i];
        let pos = top.partition_point(|&j| logits[j as usize] >= l);
        top.insert(pos, i as u32);
        top.truncate(n);
        logits[*top.last().unwrap() as usize]
    };
    let filled = n.min(logits.len());
    let mut floor = f32::NEG_INFINITY;
    for i in 0..filled {
        floor = offer(&mut top, i);
    }
    if n == 0 {
        return top;
    }
    const BLOCK: usize = 16;
    for (b, block) in logits[filled..].chunks(BLOCK).enumerate() {
        if block.iter().fold(false, |hit, &l| hit | (l > floor)) {
            for (j, &l) in block.iter().enumerate() {
                if l > floor {
                    floor = offer(&mut top, filled + b * BLOCK + j);
                }
            }
        }
    }
    top
}

/// The largest value that is not NaN (-inf when there is none), in lanes that
/// the compiler vectorises (a fold of `f32::max` runs one compare at a time).
fn max_ignoring_nan(values: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut m = [f32::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            m[j] = if c[j] > m[j] { c[j] } else { m[j] };
        }
    }
    tail.iter().chain(&m).fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a })
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
    fn race_samples_the_softmax() {
        // p ∝ e^(l/T): at T = 0.5 the logits 0, ln2/2, ln4/2 weigh 1 : 2 : 4.
        let logits = [0.0f32, (2f32).ln() / 2.0, (4f32).ln() / 2.0, f32::NEG_INFINITY];
        let p = params(|p| p.temperature = 0.5);
        let n = 70_000;
        let mut counts = [0usize; 4];
        for step in 0..n {
            counts[sample(&logits, &p, 17, step as u64) as usize] += 1;
        }
        assert_eq!(counts[3], 0, "-inf is never drawn");
        let chi2: f64 = [1.0, 2.0, 4.0].iter().zip(&counts).map(|(w, &c)| {
            let e = n as f64 * w / 7.0;
            (c as f64 - e).powi(2) / e
        }).sum();
        // 2 degrees of freedom: P(chi2 > 21) ≈ 3e-5.
        assert!(chi2 < 21.0, "chi2 {chi2:.1} for counts {counts:?}");
        // The noise is keyed by token id: another step or seed is another race.
        let hash = race::step_hash(3, 5);
        assert_ne!(race::gumbel(hash, 0), race::gumbel(hash, 1));
        assert_ne!(race::gumbel(hash, 0), race::gumbel(race::step_hash(3, 6), 0));
        assert_ne!(race::gumbel(hash, 0), race::gumbel(race::step_hash(4, 5), 0));
    }

    #[test]
    fn top_k_up_to_64_races_on_all_sms() {
        let vocab = 151_936;
        let k = |top_k: usize, temperature: f32| params(|p| {
            p.top_k = top_k;
            p.temperature = temperature;
        });
        for (p, all_sms) in [
            (k(0, 1.0), true),
            (k(1, 0.6), true),
            (k(20, 0.6), true),
            (k(64, 0.6), true),
            (k(65, 0.6), false),
            (k(1000, 0.6), false),
            (k(1000, 0.0), true),       // greedy: no cut
            (k(vocab, 0.6), true),      // keeps every token
            (k(vocab - 1, 0.6), false),
        ] {
            assert_eq!(p.races_on_all_sms(vocab), all_sms, "top_k {} at T {}", p.top_k, p.temperature);
        }
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

    /// The rule written out plainly from its definition (full sorts, a
    /// token-by-token nucleus, libm logarithms for the noise), as a
    /// specification for `sample`'s selections.
    fn sample_by_full_sort(logits: &[f32], p: &SamplingParams, seed: u64, step: u64) -> u32 {
        let mut order: Vec<u32> = (0..logits.len() as u32).filter(|&i| logits[i as usize] > f32::NEG_INFINITY).collect();
        if p.temperature == 0.0 || order.is_empty() {
            return argmax(logits);
        }
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        let inv_t = 1.0 / p.temperature as f64;
        let s = |i: u32| logits[i as usize] as f64 * inv_t;
        let m = s(order[0]);
        let a = (m / 16.0).ceil() * 16.0;
        let weight = |i: u32| if s(i) - a <= -32.0 { 0 } else { ((s(i) - a).exp() * 17_592_186_044_416.0) as u64 };
        let bin = |i: u32| (s(i) * 16.0).floor() as i64;
        if p.top_k > 0 && p.top_k < order.len() {
            order.truncate(p.top_k);
        }
        let total: u64 = order.iter().map(|&i| weight(i)).sum();
        // Mass of the pool's tokens in each bin, then strictly above each bin.
        let mut per_bin = std::collections::BTreeMap::<i64, u64>::new();
        order.iter().for_each(|&i| *per_bin.entry(bin(i)).or_default() += weight(i));
        let mut above_bin = HashMap::new();
        let mut running = 0u64;
        for (&b, &w) in per_bin.iter().rev() {
            above_bin.insert(b, running);
            running += w;
        }
        let kept = |i: u32| {
            let above = above_bin[&bin(i)];
            let in_nucleus = p.top_p >= 1.0 || (above as f64) < p.top_p as f64 * total as f64;
            let above_min_p = p.min_p <= 0.0 || bin(i) >= ((m + (p.min_p as f64).ln()) * 16.0).floor() as i64;
            in_nucleus && above_min_p
        };
        let hash = race::step_hash(seed, step);
        let key = |i: u32| {
            let k = splitmix64(hash ^ i as u64) >> 12;
            let u = (2 * k + 1) as f64 / (1u64 << 53) as f64;
            (s(i) - (-u.ln()).ln()) as f32
        };
        let winners: Vec<u32> = order.iter().copied().filter(|&i| kept(i)).collect();
        winners.iter().copied().fold(winners[0], |b, i| if key(i) > key(b) || (key(i) == key(b) && i < b) { i } else { b })
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
    fn extreme_temperatures_keep_the_top_token() {
        // Scaled logits far beyond f32's range or so close that they round together:
        // the anchor stays at or above the maximum, so the top token always weighs
        // something and every cut keeps it.
        let near = [f32::from_bits(12.0f32.to_bits() - 1), 12.0, -100.0];
        for (logits, t) in [(&[-1.0f32, -2.0][..], 1e-16f32), (&[3.0, 2.0][..], 1e-30), (&near[..], 2.0028422e-8)] {
            for p in [params(|p| p.top_p = 0.9), params(|p| p.min_p = 0.5), params(|p| p.top_k = 2), params(|_| {})] {
                let p = SamplingParams { temperature: t, ..p };
                for step in 0..20 {
                    let got = sample(logits, &p, 5, step);
                    assert_eq!(got, sample_by_full_sort(logits, &p, 5, step), "{logits:?} {p:?}");
                    assert!((got as usize) < logits.len());
                }
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

    /// Fresh logits with many exact ties (values on a coarse grid) and a few -inf.
    fn tied_logits(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if s >> 60 == 0 { f32::NEG_INFINITY } else { ((s >> 33) % 64) as f32 * 0.25 - 9.0 }
            })
            .collect()
    }

    #[test]
    fn top_n_is_a_stable_sort_by_logit() {
        for (len, seed) in [(1, 1), (7, 2), (16, 3), (17, 4), (1000, 5), (4099, 6)] {
            let logits = tied_logits(len, seed);
            let mut order: Vec<u32> = (0..len as u32).collect();
            order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize])); // stable: lower id first
            for n in [0, 1, 2, 5, 20, len, len + 3] {
                assert_eq!(top_n(&logits, n), order[..n.min(len)], "len {len}, n {n}");
            }
        }
    }

    #[test]
    fn logprobs_match_an_f64_log_softmax() {
        let logits = tied_logits(151_936, 9);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max_ignoring_nan(&logits), max);
        let z: f64 = logits.iter().map(|&l| (l as f64 - max as f64).exp()).sum();
        let log_z = max as f64 + z.ln();
        let (lp, top) = logprobs(&logits, 77, 8);
        assert!((lp as f64 - (logits[77] as f64 - log_z)).abs() < 1e-6, "{lp}");
        for (id, l) in top {
            assert!((l as f64 - (logits[id as usize] as f64 - log_z)).abs() < 1e-6);
        }
        // A NaN anywhere makes every logprob NaN; a NaN is never the maximum.
        let mut with_nan = logits.clone();
        with_nan[5] = f32::NAN;
        assert_eq!(max_ignoring_nan(&with_nan), max);
        assert!(logprobs(&with_nan, 77, 2).0.is_nan());
        assert_eq!(max_ignoring_nan(&[f32::NAN; 40]), f32::NEG_INFINITY);
    }
}

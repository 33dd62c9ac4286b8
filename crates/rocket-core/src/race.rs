//! The sampling rule every backend follows bit for bit (the GPU's copies are in
//! `kernels/src/sampler.cuh` and the megakernel's LM head).
//!
//! The draw is an exponential race (Gumbel-max): each kept token's key is its
//! scaled logit `s = logit / T` plus Gumbel noise hashed from (seed, step, token
//! id), and the largest key wins. That samples the softmax over the kept tokens
//! exactly, and it is an argmax: any split of the vocabulary can find its own
//! winner and the winners merge in any order.
//!
//! The cuts are defined so that they too can be computed in pieces:
//! - **bins**: `s` is binned on an absolute grid of `1/BINS_PER_NAT` (16 bins
//!   per nat), so every part of the vocabulary agrees on a token's bin without
//!   knowing the maximum;
//! - **weights** are integers, `floor(2^44 · e^(s − A))`, relative to an anchor
//!   `A` = the maximum `M` rounded up to a multiple of `ANCHOR_STEP` (16): a part
//!   whose own maximum rounds to `A` or `A − 16` can weigh its tokens at both
//!   candidate anchors, and every other part's tokens weigh 0 at `A`. Sums of
//!   integers are exact in any order;
//! - **top-k** keeps the k most likely (logit, then lower id), exactly;
//! - **top-p** keeps whole bins, from the top, while the mass of the bins above
//!   is below `top_p` of the total (a nucleus at 1/16-nat resolution: tokens in
//!   the boundary bin are all in);
//! - **min-p** keeps the bins at or above `floor((M + ln min_p) · 16)`.
//!
//! The noise lies in [-3.61, 36.75], so a token whose best possible key,
//! `s + 36.75` rounded to f32, is below the top token's worst, `M − 3.61`
//! rounded, can never win: a device may drop it before the race (it weighs 0
//! too: it is over 40 nats down).

use crate::portable_exp::{portable_exp, portable_ln};
use crate::sampling::splitmix64;

/// Bins per nat of the scaled logit.
pub const BINS_PER_NAT: f64 = 16.0;
/// The anchor is the maximum rounded up to a multiple of this (nats).
pub const ANCHOR_STEP: f64 = 16.0;
/// Weights are probabilities relative to the anchor in 2^-44 units: a sum over
/// 2^20 tokens stays below 2^64.
pub const WEIGHT_ONE: f64 = 17_592_186_044_416.0;
/// At or below this distance under the anchor a weight is 0 (2^44·e^-32 < 1).
pub const WEIGHTLESS_BELOW: f64 = -32.0;
/// Scaled logits are clamped to ±2^50 before binning, so bins fit an i64.
pub const S_LIMIT: f64 = 1_125_899_906_842_624.0;

/// The hash of generation step `step` of a request seeded with `seed`: what the
/// race's per-token noise is keyed by.
pub fn step_hash(seed: u64, step: u64) -> u64 {
    splitmix64(splitmix64(seed) ^ step)
}

/// Gumbel noise for token `id` under `step_hash`: -ln(-ln u) with u uniform in
/// (0, 1), from 52 hashed bits (u = (2k+1)·2^-53 is exact, never 0 or 1).
pub fn gumbel(step_hash: u64, id: u32) -> f64 {
    let k = splitmix64(step_hash ^ id as u64) >> 12;
    let u = (2 * k + 1) as f64 * (1.0 / (1u64 << 53) as f64);
    -portable_ln(-portable_ln(u))
}

/// Order of f32 values as `total_cmp`, as an unsigned integer.
fn order_bits(f: f32) -> u32 {
    let u = f.to_bits();
    if u & 0x8000_0000 != 0 { !u } else { u | 0x8000_0000 }
}

/// A token's entry in the race: `s + noise` rounded to f32, then the lower id
/// first on equal keys, packed so that the larger u64 wins.
pub fn race_key(s: f64, id: u32, step_hash: u64) -> u64 {
    let key = (s + gumbel(step_hash, id)) as f32;
    ((order_bits(key) as u64) << 32) | (u32::MAX - id) as u64
}

/// The id a packed race key belongs to.
pub fn race_id(key: u64) -> u32 {
    u32::MAX - key as u32
}

/// The scaled logit the rule works with.
pub fn scaled(logit: f32, inv_t: f64) -> f64 {
    logit as f64 * inv_t
}

/// A scaled logit's bin.
pub fn bin(s: f64) -> i64 {
    (s.clamp(-S_LIMIT, S_LIMIT) * BINS_PER_NAT).floor() as i64
}

/// The anchor for a maximum scaled logit `m`: at or above it (dividing and
/// multiplying by 16 are exact), so the top token always weighs > 0.
pub fn anchor(m: f64) -> f64 {
    (m / ANCHOR_STEP).ceil() * ANCHOR_STEP
}

/// A token's weight at anchor `a` (`a` ≥ its scaled logit).
pub fn weight(s: f64, a: f64) -> u64 {
    let x = s - a;
    if x <= WEIGHTLESS_BELOW { 0 } else { (portable_exp(x) * WEIGHT_ONE) as u64 }
}

/// The lowest bin min-p keeps, for maximum `m`.
pub fn min_p_bin(m: f64, min_p: f32) -> i64 {
    bin(m + portable_ln(min_p as f64))
}

/// The lowest bin top-p keeps: bins from the top while the mass strictly above
/// them is below `top_p` of the total. `bins` holds (bin, mass) of the pool in
/// any order and repetition.
pub fn top_p_bin(bins: &mut Vec<(i64, u64)>, top_p: f32) -> i64 {
    bins.sort_unstable_by(|a, b| b.0.cmp(&a.0));
    let total: u64 = bins.iter().map(|b| b.1).sum();
    let target = top_p as f64 * total as f64;
    let (mut above, mut cut) = (0u64, i64::MAX);
    let mut i = 0;
    while i < bins.len() {
        let b = bins[i].0;
        if (above as f64) >= target {
            break;
        }
        cut = b;
        while i < bins.len() && bins[i].0 == b {
            above += bins[i].1;
            i += 1;
        }
    }
    cut
}

//! A CPU model of the megakernel's logprobs (`kernels/src/mk_logprobs.cuh`),
//! step for step but sequential: each virtual SM takes its share of the raw
//! logits (its LM-head tiles), its maximum, its f64 sum of exp(logit −
//! maximum) in the kernel's order (each of 256 consumer threads over its
//! tokens, then lanes and warps), and its N best by `lp_key`, most likely
//! first — N rounds of a warp maximum over the eight warps' cached tokens,
//! then the warps' 8N ranked, or the radix select where the share passes the
//! register cache; the host link's warp merges the parts: log Z from the
//! sums (each lane's parts in order, then the lanes' butterfly) and the N
//! best by N rounds of a maximum over the lists' heads. The tests check that
//! it gives `sampling::logprobs`'s ids, and values within one f32 ulp or a
//! few f64 ulps of log Z, for any split of the vocabulary over SMs — what the
//! kernel's design rests on; the GPU test MK-LOGPROBS checks the kernel.

use crate::megakernel::abi::{CONSUMERS, CONSUMER_WARPS, LP_MAX};
use crate::megakernel::topk_model::{item_key, key_id, key_logit, select_threshold};

/// Tokens per consumer thread the part keeps in registers (mk_race.cuh RACE_CACHED).
const CACHED: usize = 8;
/// The host link's lanes.
const LANES: usize = 32;

/// `lp_key`: item_key with -0.0 equal to +0.0; every logit but NaN has one.
fn lp_key(l: f32, id: u32) -> Option<u64> {
    (!l.is_nan()).then(|| item_key(l + 0.0, id))
}

/// One SM's part: its list (most likely first), maximum and sum.
#[derive(Debug, Clone)]
struct Part {
    list: Vec<u64>,
    max: f64,
    sum: f64,
}

/// A sum as the kernel's butterflies take it: each warp's lanes by the xor
/// butterfly, then the warps in order.
fn consumer_sum(per_thread: &[f64]) -> f64 {
    let mut total = 0.0;
    for warp in per_thread.chunks(32) {
        let mut v = warp.to_vec();
        let mut o = 16;
        while o > 0 {
            v = (0..32).map(|lane| v[lane] + v[lane ^ o]).collect();
            o >>= 1;
        }
        total += v[0];
    }
    total
}

/// `logprob_scan` over `rows` (the SM's tokens in its list order, `logits` the row).
fn part(logits: &[f32], rows: &[u32], k: usize) -> Part {
    // Thread t takes rows t, t + 256, ... (its first CACHED in registers).
    let of_thread = |t: usize| rows.iter().skip(t).step_by(CONSUMERS).map(|&r| (logits[r as usize], r));
    let max = (0..CONSUMERS).flat_map(of_thread).fold(f32::NEG_INFINITY, |m, (l, _)| m.max(l));
    let sums: Vec<f64> = (0..CONSUMERS)
        .map(|t| {
            of_thread(t)
                .filter(|&(l, _)| l > f32::NEG_INFINITY || l.is_nan())
                .fold(0.0, |s, (l, _)| s + (l as f64 - max as f64).exp())
        })
        .collect();
    let sum = consumer_sum(&sums);
    let mut list = if k == 0 {
        Vec::new()
    } else if rows.len() <= CACHED * CONSUMERS {
        // N rounds of a warp maximum; the warps' 8N are the candidates.
        let mut cand = Vec::with_capacity(CONSUMER_WARPS * k);
        for warp in 0..CONSUMER_WARPS {
            let mut keys: Vec<u64> = (warp * 32..warp * 32 + 32).flat_map(of_thread).filter_map(|(l, r)| lp_key(l, r)).collect();
            for _ in 0..k {
                let w = keys.iter().copied().max().unwrap_or(0);
                keys.retain(|&key| key != w);
                cand.push(w);
            }
        }
        cand.into_iter().filter(|&key| key != 0).collect()
    } else {
        let keys: Vec<u64> = rows.iter().filter_map(|&r| lp_key(logits[r as usize], r)).collect();
        let bound = select_threshold(&keys, k as u32);
        keys.into_iter().filter(|&key| key >= bound).collect::<Vec<_>>()
    };
    // Each candidate's place among them: the list most likely first.
    list.sort_unstable_by(|a, b| b.cmp(a));
    list.truncate(k);
    assert!(list.len() <= LP_MAX, "a part lists at most LP_MAX keys");
    Part { list, max: max as f64, sum }
}

/// What a broken merge does instead (the tests' mutants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mutant {
    None,
    /// Part sums added without rescaling to the largest maximum.
    Unscaled,
    /// Each part's list most likely last (a part that skipped its ranking).
    UnsortedLists,
}

/// `logprob_record`'s merge: the N best keys, most likely first, and log Z.
fn merge(parts: &[Part], k: usize) -> (Vec<u64>, f64) {
    merge_as(parts, k, Mutant::None)
}

fn merge_as(parts: &[Part], k: usize, mutant: Mutant) -> (Vec<u64>, f64) {
    let lists: Vec<Vec<u64>> = parts
        .iter()
        .map(|p| if mutant == Mutant::UnsortedLists { p.list.iter().rev().copied().collect() } else { p.list.clone() })
        .collect();
    // N rounds: the largest head wins and its list moves on.
    let mut pos = vec![0usize; lists.len()];
    let mut best = Vec::with_capacity(k);
    for _ in 0..k {
        let heads = lists.iter().zip(&pos).map(|(l, &i)| l.get(i).copied().unwrap_or(0));
        let Some((at, w)) = heads.enumerate().max_by_key(|&(_, h)| h).filter(|&(_, h)| h != 0) else { break };
        best.push(w);
        pos[at] += 1;
    }
    let big_m = parts.iter().map(|p| p.max).filter(|&m| m > f64::NEG_INFINITY).fold(f64::NEG_INFINITY, f64::max);
    let scaled = |p: &Part| match mutant {
        Mutant::Unscaled => p.sum,
        _ if p.max > f64::NEG_INFINITY => p.sum * (p.max - big_m).exp(),
        _ => p.sum,
    };
    // Lane l takes parts l, l + 32, ... in order; then the lanes' butterfly.
    let lanes: Vec<f64> = (0..LANES).map(|l| parts.iter().skip(l).step_by(LANES).fold(0.0, |z, p| z + scaled(p))).collect();
    (best, big_m + consumer_sum(&lanes).ln())
}

/// The step's record as the kernel writes it: the token's logprob and the N
/// best (id, logprob), for SMs owning `owner[tile]` of the row's tiles of
/// `tile_rows` (each SM lists its tiles in the order it claimed them).
fn record(logits: &[f32], owner: &[usize], sms: usize, tile_rows: usize, token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let mut rows = vec![Vec::new(); sms];
    for (tile, &sm) in owner.iter().enumerate() {
        rows[sm].extend((tile * tile_rows..((tile + 1) * tile_rows).min(logits.len())).map(|r| r as u32));
    }
    let parts: Vec<Part> = rows.iter().map(|r| part(logits, r, k)).collect();
    let (best, log_z) = merge(&parts, k);
    let lp = |l: f32| (l as f64 - log_z) as f32;
    (lp(logits[token as usize]), best.iter().map(|&key| (key_id(key), lp(key_logit(key)))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::megakernel::topk_model::Rng;
    use crate::sampling::logprobs;

    /// A standard normal draw (Box-Muller).
    fn normal(rng: &mut Rng) -> f32 {
        let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        let v = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * (u + 1e-300).ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }

    /// The host's record against the model's: the same ids, each value within
    /// one f32 ulp, or what the sums' f64 roundings can move log Z: 8 ulps of
    /// it, plus the host's own sum of V terms in vocabulary order, which drops
    /// up to half an ulp of its running total at each (it is the less accurate
    /// near 0: a token of probability ~1 - 1e-11 has a logprob of ~-1e-11 known
    /// to ~1e-12). Returns the bitwise-equal count.
    fn agree(logits: &[f32], got: &(f32, Vec<(u32, f32)>), token: u32, k: usize, what: &str) -> usize {
        let (want_lp, want_top) = logprobs(logits, token, k);
        let ids = |t: &[(u32, f32)]| t.iter().map(|&(id, _)| id).collect::<Vec<_>>();
        assert_eq!(ids(&got.1), ids(&want_top), "{what}: ids");
        let log_z = (logits[token as usize] as f64 - want_lp as f64).abs();
        let sums = ((8.0 * log_z + logits.len() as f64) * f64::EPSILON) as f32;
        let mut equal = 0;
        for (g, w) in std::iter::once((got.0, want_lp)).chain(got.1.iter().zip(&want_top).map(|(g, w)| (g.1, w.1))) {
            let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()).max(sums);
            assert!(g == w || (g - w).abs() <= ulp, "{what}: {g} against the host's {w}");
            equal += (g.to_bits() == w.to_bits()) as usize;
        }
        equal
    }

    /// A random split of `tiles` tiles over `sms` SMs, each SM's in a random claim order.
    fn split(rng: &mut Rng, tiles: usize, sms: usize, skew: bool) -> Vec<usize> {
        (0..tiles).map(|_| if skew && rng.below(4) == 0 { 0 } else { rng.below(sms) }).collect()
    }

    #[test]
    fn records_are_the_hosts_for_any_split() {
        let mut rng = Rng(17);
        let (mut equal, mut total) = (0, 0);
        for case in 0..60 {
            let vocab = [49_152, 151_936, 4_099, 300][case % 4];
            let mut logits: Vec<f32> = (0..vocab).map(|_| normal(&mut rng) * 3.0).collect();
            match case % 6 {
                // Ties, -0.0 beside +0.0, a few -inf.
                1 => {
                    for i in (0..vocab).step_by(7) {
                        logits[i] = (logits[i] * 2.0).round() / 2.0;
                    }
                    logits[3] = -0.0;
                    logits[vocab - 1] = 0.0;
                    logits[5] = f32::NEG_INFINITY;
                }
                // One token carries nearly all the mass (logprobs near 0).
                2 => logits[rng.below(vocab)] = 40.0,
                // A peaked row far from 0.
                3 => logits.iter_mut().for_each(|l| *l = *l * 0.1 + 1.0e4),
                _ => {}
            }
            let (sms, tile_rows) = ([132, 78, 1, 7][case % 4], [8, 16, 3][case % 3]);
            let owner = split(&mut rng, vocab.div_ceil(tile_rows), sms, case % 5 == 0);
            let token = rng.below(vocab) as u32;
            for k in [0, 1, 5, 20] {
                let got = record(&logits, &owner, sms, tile_rows, token, k);
                equal += agree(&logits, &got, token, k, &format!("case {case}, k {k}"));
                total += 1 + k;
            }
        }
        // The f64 sums rounded once to f32: nearly every value is the host's bit for bit.
        assert!(equal * 100 >= total * 95, "{equal} of {total} values bitwise equal");
    }

    #[test]
    fn one_warp_holding_the_best_still_lists_them() {
        // One SM's 2,048 tokens (the register cache full): its 20 best all on warp 0's
        // threads (token j belongs to thread j % 256), so that warp's 20 rounds list them.
        let mut rng = Rng(3);
        let mut logits: Vec<f32> = (0..2048).map(|_| normal(&mut rng)).collect();
        for (i, j) in (0..8).flat_map(|q| (0..32).map(move |lane| q * 256 + lane)).take(20).enumerate() {
            logits[j] = 20.0 + i as f32;
        }
        let got = record(&logits, &[0], 1, 2048, 7, 20);
        agree(&logits, &got, 7, 20, "one warp's best");
    }

    #[test]
    fn fewer_finite_tokens_than_asked_list_minus_infinity_too() {
        let mut logits = vec![f32::NEG_INFINITY; 1000];
        logits[10] = 1.0;
        logits[500] = 2.0;
        let owner: Vec<usize> = (0..125).map(|t| t % 13).collect();
        let got = record(&logits, &owner, 13, 8, 500, 5);
        agree(&logits, &got, 500, 5, "two finite tokens");
        assert_eq!(got.1.iter().map(|&(id, _)| id).collect::<Vec<_>>(), vec![500, 10, 0, 1, 2]);
    }

    #[test]
    fn a_crowded_merge_draws_from_many_lists() {
        // SMs 0..63 (one tile of 1,000 tokens each) hold 16 tokens at 10.0, the rest
        // are 0: the 20 best are ties broken by id, taken from SM 0's list, then
        // SM 1's. A second row interleaves four SMs' lists (each one's best in
        // turn, then each one's second, ...).
        let (sms, per_sm, k) = (132, 1000, 20);
        let mut logits = vec![0.0f32; sms * per_sm];
        for j in 0..64 {
            for i in 0..16 {
                logits[j * per_sm + i * 9] = 10.0;
            }
        }
        let owner: Vec<usize> = (0..sms).collect();
        let got = record(&logits, &owner, sms, per_sm, 3, k);
        agree(&logits, &got, 3, k, "crowded");
        let mut interleaved = vec![0.0f32; sms * per_sm];
        for j in 0..4 {
            for i in 0..20 {
                interleaved[j * per_sm + i] = 30.0 - (i * 4 + j) as f32 * 0.01;
            }
        }
        let got = record(&interleaved, &owner, sms, per_sm, 0, k);
        agree(&interleaved, &got, 0, k, "interleaved");
        let ids: Vec<u32> = got.1.iter().map(|&(id, _)| id).collect();
        assert_eq!(&ids[..6], &[0, per_sm as u32, 2 * per_sm as u32, 3 * per_sm as u32, 1, per_sm as u32 + 1]);
    }

    #[test]
    fn a_broken_merge_is_caught() {
        // Mutants of the model's merge: the sums not rescaled to the global maximum,
        // and lists that are not most likely first.
        let mut rng = Rng(9);
        let mut logits: Vec<f32> = (0..20_000).map(|_| normal(&mut rng)).collect();
        let owner: Vec<usize> = (0..2500).map(|t| t % 50).collect();
        // One high token per SM, the five best on five SMs.
        for sm in 0..50 {
            logits[sm * 8 + 3] = 10.0 + sm as f32 * 0.01;
        }
        let parts: Vec<Part> = (0..50)
            .map(|sm| {
                let rows: Vec<u32> = (0..2500).filter(|&t| owner[t] == sm).flat_map(|t| (t * 8..t * 8 + 8).map(|r| r as u32)).collect();
                part(&logits, &rows, 5)
            })
            .collect();
        let (best, log_z) = merge(&parts, 5);
        let (want, want_top) = logprobs(&logits, 0, 5);
        assert!(((logits[0] as f64 - log_z) as f32 - want).abs() < 1e-5);
        assert_eq!(best.iter().map(|&key| key_id(key)).collect::<Vec<_>>(), want_top.iter().map(|&(id, _)| id).collect::<Vec<_>>());
        let (_, unscaled) = merge_as(&parts, 5, Mutant::Unscaled);
        assert!(((logits[0] as f64 - unscaled) as f32 - want).abs() > 1e-3, "an unscaled log Z would pass");
        assert_ne!(merge_as(&parts, 5, Mutant::UnsortedLists).0, best, "lists most likely last would pass");
    }
}

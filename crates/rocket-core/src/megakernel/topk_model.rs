//! A CPU model of the megakernel's all-SM top-k (`kernels/src/mk_race.cuh`:
//! `select_threshold`, `RacePart::topk_list`, `topk_merge`), step for step but
//! sequential: each virtual SM lists its k best keys; the last one bounds the
//! global k-th key from below (the highest SM threshold, the k-th largest SM
//! best key), ranks the lists' entries above the bound when there are at most
//! 256 of them (else selects their k best), and cuts and races over the k best. Its radix select runs the kernel's thread layout
//! (`select_threshold_threads`: 256 consumers' bucket sums, warp scans, the one
//! thread that writes each digit). The tests check that it picks
//! `sampling::sample`'s token for any split of the vocabulary over SMs, which
//! is what the kernel's design rests on; the GPU test MK-SAMPLED checks the
//! kernel itself.

use crate::megakernel::abi::{RACE_LIST, RACE_TOPK_MAX};
use crate::race;
use crate::sampling::SamplingParams;

/// The kernel's `item_key`: logit order (Rust's `total_cmp`), then the lower
/// id; unique, never 0 for a candidate.
pub(super) fn item_key(l: f32, id: u32) -> u64 {
    let u = l.to_bits();
    let order = if u & 0x8000_0000 != 0 { !u } else { u | 0x8000_0000 };
    ((order as u64) << 32) | (u32::MAX - id) as u64
}

pub(super) fn key_logit(key: u64) -> f32 {
    let b = (key >> 32) as u32;
    f32::from_bits(if b & 0x8000_0000 != 0 { b & 0x7fff_ffff } else { !b })
}

pub(super) fn key_id(key: u64) -> u32 {
    u32::MAX - key as u32
}

/// `select_threshold`: a threshold with exactly min(k, |keys|) of the
/// (distinct) keys at or above it, 0 when there are k or fewer.
pub(super) fn select_threshold(keys: &[u64], k: u32) -> u64 {
    let (mut prefix, mut above) = (0u64, 0u32);
    for pass in 0..6 {
        let shift = if pass < 5 { 53 - 11 * pass } else { 0 };
        let high = if pass == 0 { 64 } else if pass < 5 { shift + 11 } else { 9 };
        let mask = (1u64 << (high - shift)) - 1;
        let mut counts = [0u32; 2048];
        for &key in keys {
            if pass == 0 || key >> high == prefix >> high {
                counts[((key >> shift) & mask) as usize] += 1;
            }
        }
        if pass == 0 && counts.iter().sum::<u32>() <= k {
            return 0;
        }
        let need = k - above;
        let mut cum = 0;
        let b = (0..2048).rev().find(|&b| {
            let hit = cum + counts[b] >= need;
            if !hit {
                cum += counts[b];
            }
            hit
        });
        let b = b.expect("the set holds the keys still needed");
        prefix |= (b as u64) << shift;
        above += cum;
        if cum + counts[b] == need {
            break;
        }
    }
    prefix
}

/// `select_threshold` as the kernel's consumer threads run it: thread t sums
/// buckets 2047 - 8t down to 2040 - 8t, each warp scans those sums with
/// `__shfl_up_sync`, lane 31 publishes its warp's total, and the one thread
/// whose buckets hold the k-th key writes the digit, the count above it and
/// whether it is done into the shared state (which starts as garbage: only that
/// thread sets it). Panics unless exactly one thread writes. Returns the
/// threshold and the passes run.
fn select_threshold_threads(keys: &[u64], k: u32) -> (u64, usize) {
    const CONSUMERS: usize = 256;
    const WARPS: usize = CONSUMERS / 32;
    let (mut prefix, mut above) = (0u64, 0u32);
    let (mut ss_prefix, mut ss_above, mut ss_done) = (u64::MAX, u32::MAX, false);
    for pass in 0..6 {
        let shift = if pass < 5 { 53 - 11 * pass } else { 0 };
        let high = if pass == 0 { 64 } else if pass < 5 { shift + 11 } else { 9 };
        let mask = (1u64 << (high - shift)) - 1;
        let mut counts = [0u32; 2048];
        for &key in keys {
            if pass == 0 || key >> high == prefix >> high {
                counts[((key >> shift) & mask) as usize] += 1;
            }
        }
        let c: Vec<u32> = (0..CONSUMERS).map(|tid| (0..8).map(|i| counts[2047 - 8 * tid - i]).sum()).collect();
        let mut incl = c.clone();
        for w in 0..WARPS {
            let mut o = 1;
            while o < 32 {
                let shuffled: Vec<u32> = incl[w * 32..w * 32 + 32].to_vec();
                for lane in o..32 {
                    incl[w * 32 + lane] += shuffled[lane - o];
                }
                o <<= 1;
            }
        }
        let warp_total: Vec<u32> = (0..WARPS).map(|w| incl[w * 32 + 31]).collect();
        let total: u32 = warp_total.iter().sum();
        if pass == 0 && total <= k {
            return (0, 1);
        }
        let need = k - above;
        let mut writers = 0;
        for tid in 0..CONSUMERS {
            let before = incl[tid] - c[tid] + warp_total[..tid / 32].iter().sum::<u32>();
            if before < need && before + c[tid] >= need {
                writers += 1;
                let mut cum = before;
                for i in 0..8 {
                    let b = 2047 - 8 * tid - i;
                    if cum + counts[b] >= need {
                        ss_prefix = prefix | (b as u64) << shift;
                        ss_above = above + cum;
                        ss_done = cum + counts[b] == need;
                        break;
                    }
                    cum += counts[b];
                }
            }
        }
        assert_eq!(writers, 1, "pass {pass}: threads writing the digit ({} keys, k {k})", keys.len());
        prefix = ss_prefix;
        above = ss_above;
        if ss_done {
            return (prefix, pass + 1);
        }
    }
    (prefix, 6)
}

/// One SM's list (`topk_list`) and its threshold (lm_max).
fn sm_list(keys: &[u64], k: u32) -> (Vec<u64>, u64) {
    let bound = select_threshold_threads(keys, k).0;
    let mut list: Vec<u64> = keys.iter().copied().filter(|&key| key >= bound).collect();
    // The SM's best key first (the merge reads it there); the rest in any order.
    if let Some(best) = (0..list.len()).max_by_key(|&i| list[i]) {
        list.swap(0, best);
    }
    (list, bound)
}

/// Candidates `topk_merge` ranks in shared memory (mk_race.cuh TOPK_RANKED).
const TOPK_RANKED: usize = 256;

/// How `topk_merge` found the k best.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MergePath {
    /// The entries at or above the bound, ranked in shared memory.
    Ranked,
    /// Too many entries: select_threshold over them.
    Selected,
}

/// `topk_merge`'s token (None where the kernel gives the step to the one-CTA
/// sampler: exact, the host's argmax when no candidate is left) and how it
/// found the k best.
fn merge_path(parts: &[(Vec<u64>, u64)], p: &SamplingParams, seed: u64, step: u64) -> (Option<u32>, MergePath) {
    let k = p.top_k as u32;
    // A list never holds more than k entries (topk_list); the merge enumerates
    // k slots per list and gives up on a longer one (an overflowed list included).
    if parts.iter().any(|(list, _)| list.len() > (k as usize).min(RACE_LIST)) {
        return (None, MergePath::Ranked);
    }
    // Lower bounds of the global k-th key: the highest SM threshold, and the
    // k-th largest of the SMs' best keys (by rank: ties only among the 0s).
    // Each SM's best key is its list's first entry.
    let tops: Vec<u64> = parts.iter().map(|(l, _)| l.first().copied().unwrap_or(0)).collect();
    let top_bound = tops.iter().copied().filter(|&mine| tops.iter().filter(|&&o| o > mine).count() + 1 == k as usize).last().unwrap_or(0);
    let bound = parts.iter().map(|&(_, b)| b).max().unwrap_or(0).max(top_bound);
    let entries: Vec<u64> = parts.iter().flat_map(|(l, _)| l.iter().copied()).filter(|&key| key >= bound).collect();
    let (best, path) = if entries.len() <= TOPK_RANKED {
        // Each candidate's place is the number of larger ones; the first k places are kept.
        let kk = entries.len().min(k as usize);
        let mut sorted = vec![0u64; kk];
        for &mine in &entries {
            let place = entries.iter().filter(|&&o| o > mine).count();
            if place < kk {
                sorted[place] = mine;
            }
        }
        (sorted, MergePath::Ranked)
    } else {
        let thr = select_threshold_threads(&entries, k).0;
        let mut best: Vec<u64> = entries.into_iter().filter(|&key| key >= thr).collect();
        best.sort_unstable_by(|a, b| b.cmp(a));
        (best, MergePath::Selected)
    };
    let kk = best.len();
    if kk == 0 || kk > (k as usize).min(RACE_TOPK_MAX) {
        return (None, path);
    }
    (race_over(&best, p, seed, step), path)
}

/// `topk_merge`'s token; see `merge_path`.
fn merge(parts: &[(Vec<u64>, u64)], p: &SamplingParams, seed: u64, step: u64) -> Option<u32> {
    merge_path(parts, p, seed, step).0
}

/// The cuts and the race over the k best, most likely first.
fn race_over(best: &[u64], p: &SamplingParams, seed: u64, step: u64) -> Option<u32> {
    let kk = best.len();
    if key_logit(best[0]) == f32::INFINITY {
        return Some(key_id(best[0]));
    }
    let inv_t = 1.0 / p.temperature as f64;
    let hash = race::step_hash(seed, step);
    let m = race::scaled(key_logit(best[0]), inv_t);
    let a = race::anchor(m);
    let scaled: Vec<f64> = best.iter().map(|&key| race::scaled(key_logit(key), inv_t)).collect();
    let bins: Vec<i64> = scaled.iter().map(|&s| race::bin(s)).collect();
    let mut cut = i64::MIN;
    if p.top_p < 1.0 {
        let weights: Vec<u64> = scaled.iter().map(|&s| race::weight(s, a)).collect();
        let total: u64 = weights.iter().sum();
        let target = p.top_p as f64 * total as f64;
        // As the kernel's warp does it: the host keeps each group of equal bins
        // (bins never rise) while the weight above the group is under the target.
        // An entry with the weight above it under the target has its group's under
        // it too, so the cut is the lowest bin of such an entry (i64::MAX: none).
        let above: Vec<u64> = weights.iter().scan(0u64, |sum, &w| Some(std::mem::replace(sum, *sum + w))).collect();
        cut = (0..kk).filter(|&i| (above[i] as f64) < target).map(|i| bins[i]).min().unwrap_or(i64::MAX);
    }
    if p.min_p > 0.0 {
        cut = cut.max(race::min_p_bin(m, p.min_p));
    }
    (0..kk).filter(|&i| bins[i] >= cut).map(|i| race::race_key(scaled[i], key_id(best[i]), hash)).max().map(race::race_id)
}

/// The megakernel's token for processed logits whose tiles of `tile_rows`
/// rows went to SMs as `owner` says (tile → SM); None: the one-CTA sampler's.
fn pick(logits: &[f32], owner: &[usize], sms: usize, tile_rows: usize, p: &SamplingParams, seed: u64, step: u64) -> Option<u32> {
    let mut keys = vec![Vec::new(); sms];
    for (i, &l) in logits.iter().enumerate() {
        if l > f32::NEG_INFINITY {
            keys[owner[i / tile_rows]].push(item_key(l, i as u32));
        }
    }
    let parts: Vec<(Vec<u64>, u64)> = keys.iter().map(|k| sm_list(k, p.top_k as u32)).collect();
    merge(&parts, p, seed, step)
}

/// The models' tests' random numbers (splitmix64).
pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = crate::sampling::splitmix64(self.0);
        self.0
    }
    pub(super) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::sample;

    #[test]
    fn select_threshold_keeps_exactly_k() {
        let mut rng = Rng(3);
        for case in 0..300 {
            let n = 1 + rng.below(400);
            // Keys sharing long prefixes (same logit, neighbouring ids) and spread ones.
            let mut keys: Vec<u64> = (0..n).map(|i| if case % 2 == 0 { item_key((rng.below(4) as f32) * 0.5, i as u32) } else { rng.next() | 1 }).collect();
            keys.sort_unstable();
            keys.dedup();
            let k = 1 + rng.below(70) as u32;
            let thr = select_threshold(&keys, k);
            let kept = keys.iter().filter(|&&key| key >= thr).count();
            assert_eq!(kept, keys.len().min(k as usize), "case {case}: {} keys, k {k}", keys.len());
            assert_eq!(select_threshold_threads(&keys, k).0, thr, "case {case}: the kernel's threads");
        }
    }

    /// The kernel's thread layout (`select_threshold_threads`) on the sets that
    /// stress it: flat rows (keys equal but for the id: every digit but the last
    /// few in one bucket), bucket counts that cross the k-th key at a thread's
    /// or a warp's edge, keys in the lowest or highest buckets only, k = 1 and
    /// 64, fewer keys than k; every pass count from 1 to 6 is reached.
    #[test]
    fn select_threshold_threads_on_adversarial_sets() {
        let mut rng = Rng(17);
        let mut passes_seen = [false; 7];
        for case in 0..297 {
            let n = [1, 2, 63, 64, 65, 256, 2048, 2049, 5000][case % 9];
            let mut keys: Vec<u64> = match (case / 9) % 11 {
                0 => (0..n).map(|i| item_key(1.5, i as u32)).collect(),
                1 => (0..n).map(|i| item_key(-0.0, 1000 * i as u32)).collect(),
                // One key per bucket of the first digit, from the top: the k-th sits at a thread's edge.
                2 => (0..n.min(2048)).map(|i| ((2047 - i as u64) << 53) | 1).collect(),
                // Three keys in thread 31's last bucket, the rest in thread 32's first: the
                // k-th key is the next warp's, past a warp total.
                3 => (0..n).map(|i| ((if i < 3 { 1792u64 } else { 1791 }) << 53) | (i as u64 + 1)).collect(),
                4 => (0..n).map(|i| i as u64 + 1).collect(), // the lowest bucket of the first digits only
                5 => (0..n).map(|i| u64::MAX - i as u64).collect(), // the top bucket of every digit
                // Equal but for the last 9-bit digit: every pass runs.
                6 => {
                    let base = rng.next() & !0x1ff;
                    (0..n.min(512)).map(|_| base | rng.below(512) as u64 | 1).collect()
                }
                // Logits a few ulps apart, or one logit with ids apart in bits 20-30 or
                // 9-19: the 3rd, the 4th or the 5th digit decides.
                9 => (0..n).map(|i| item_key(f32::from_bits(0x3f40_0000 + i as u32 % 1024), 7)).collect(),
                7 => (0..n).map(|i| item_key(0.75, (i as u32 % 2048) << 20)).collect(),
                8 => (0..n).map(|i| item_key(0.75, (i as u32 % 2048) << 9)).collect(),
                _ => (0..n).map(|_| rng.next() | 1).collect(),
            };
            keys.sort_unstable();
            keys.dedup();
            for k in [1u32, 2, 7, 20, 63, 64] {
                let (thr, passes) = select_threshold_threads(&keys, k);
                passes_seen[passes] = true;
                assert_eq!(thr, select_threshold(&keys, k), "case {case}: {} keys, k {k}", keys.len());
                let kept = keys.iter().filter(|&&key| key >= thr).count();
                assert_eq!(kept, keys.len().min(k as usize), "case {case}: {} keys, k {k}", keys.len());
            }
        }
        assert_eq!(passes_seen, [false, true, true, true, true, true, true], "passes reached");
    }

    /// Every split of a row over SMs picks the host sampler's token, on rows
    /// with ties (flat rows: more than k tokens share the k-th logit, within
    /// one SM and across SMs), ±0, NaN, ±inf and fewer candidates than k.
    #[test]
    fn all_sm_top_k_picks_the_host_token() {
        let mut rng = Rng(11);
        for case in 0..400 {
            let v = [50, 300, 2000, 5000][case % 4];
            let tile_rows = [1, 4, 32][case % 3];
            let sms = [1, 3, 16, 132][(case / 3) % 4];
            let mut logits: Vec<f32> = match case % 5 {
                0 => vec![1.5; v],                                                       // flat
                1 => (0..v).map(|_| (rng.below(4) as f32) * 0.25).collect(),             // few values
                2 => (0..v).map(|_| ((rng.below(1 << 16) as f32) / 4096.0 - 8.0) * 3.0).collect(),
                3 => (0..v).map(|_| if rng.below(2) == 0 { 0.0 } else { -0.0 }).collect(), // ±0 ties
                _ => (0..v).map(|_| (rng.next() as u32 as f32) * 1e-9).collect(),
            };
            for _ in 0..rng.below(4) {
                let i = rng.below(v);
                logits[i] = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 3.0e38][rng.below(4)];
            }
            if case % 7 == 0 {
                // Fewer candidates than k.
                for l in logits.iter_mut().skip(rng.below(30)) {
                    *l = f32::NEG_INFINITY;
                }
            }
            let tiles = v.div_ceil(tile_rows);
            let owner: Vec<usize> = (0..tiles).map(|t| if case % 2 == 0 { rng.below(sms) } else { t % sms }).collect();
            let p = SamplingParams {
                temperature: [0.6f32, 1.0, 0.05, 2.0][case % 4],
                top_k: [1, 2, 20, 64, 63][(case / 4) % 5],
                top_p: [1.0f32, 0.95, 0.5][(case / 5) % 3],
                min_p: [0.0f32, 0.1][(case / 7) % 2],
                ..SamplingParams::default()
            };
            let candidates = logits.iter().any(|&l| l > f32::NEG_INFINITY);
            for step in 0..8 {
                let seed = rng.next();
                match pick(&logits, &owner, sms, tile_rows, &p, seed, step) {
                    Some(t) => assert_eq!(t, sample(&logits, &p, seed, step), "case {case}: v {v}, {sms} SMs, {p:?}"),
                    // Only a row with no candidate goes to the one-CTA sampler (the host's argmax).
                    None => assert!(!candidates, "case {case}: the merge gave up"),
                }
            }
        }
    }

    /// The lists never overflow and the merge decides by itself (no one-CTA
    /// fallback) on rows without +inf, flat ones included.
    #[test]
    fn merge_decides_without_the_fallback() {
        let mut rng = Rng(5);
        let v = 151_936;
        for case in 0..6 {
            let logits: Vec<f32> = if case == 0 { vec![2.0; v] } else { (0..v).map(|_| (rng.below(1 << 20) as f32) / 65536.0).collect() };
            let owner: Vec<usize> = (0..v.div_ceil(32)).map(|_| rng.below(132)).collect();
            for k in [1u32, 20, 64] {
                let p = SamplingParams { temperature: 0.6, top_k: k as usize, top_p: 0.95, ..SamplingParams::default() };
                let mut keys = vec![Vec::new(); 132];
                for (i, &l) in logits.iter().enumerate() {
                    keys[owner[i / 32]].push(item_key(l, i as u32));
                }
                let parts: Vec<(Vec<u64>, u64)> = keys.iter().map(|keys| sm_list(keys, k)).collect();
                assert!(parts.iter().all(|(l, _)| l.len() <= k as usize));
                let (got, path) = merge_path(&parts, &p, 9, case);
                assert_eq!(got.expect("the merge decides"), sample(&logits, &p, 9, case), "case {case}, k {k}");
                // Random rows leave few entries above the bounds: ranked, no radix select.
                if case > 0 {
                    assert_eq!(path, MergePath::Ranked, "case {case}, k {k}");
                }
            }
        }
    }

    /// Rows whose high tokens gather on a few dozen SMs, each of which lists
    /// more low tokens than high ones: both bounds stay low, hundreds of
    /// entries pass them, and the merge selects, picking the host's token all the same.
    #[test]
    fn crowded_lists_take_the_select_path() {
        let (sms, per_sm, k) = (132, 1000, 64u32);
        let v = sms * per_sm;
        let mut logits = vec![0.0f32; v];
        // SM j < 64 (tokens j * per_sm ..) holds 8 high tokens at 10 + j / 1000; the rest are 0.
        for j in 0..64 {
            for i in 0..8 {
                logits[j * per_sm + i * 7] = 10.0 + j as f32 / 1000.0;
            }
        }
        let owner: Vec<usize> = (0..sms).collect();
        let mut keys = vec![Vec::new(); sms];
        for (i, &l) in logits.iter().enumerate() {
            keys[owner[i / per_sm]].push(item_key(l, i as u32));
        }
        let parts: Vec<(Vec<u64>, u64)> = keys.iter().map(|keys| sm_list(keys, k)).collect();
        let mut selected = 0;
        for step in 0..16 {
            for (top_p, min_p) in [(1.0, 0.0), (0.9, 0.0), (1.0, 0.5)] {
                let p = SamplingParams { temperature: 0.7, top_k: k as usize, top_p, min_p, ..SamplingParams::default() };
                let (got, path) = merge_path(&parts, &p, 3, step);
                assert_eq!(got, Some(sample(&logits, &p, 3, step)), "step {step}, {p:?}");
                selected += usize::from(path == MergePath::Selected);
            }
        }
        assert_eq!(selected, 16 * 3, "the bounds left few entries: the case does not reach select_threshold");
    }
}

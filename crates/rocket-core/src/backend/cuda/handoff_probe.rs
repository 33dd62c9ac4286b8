//! What one grid-wide hand-off costs under the weight stream, for each way the
//! megakernel could publish a phase's output and wait for it
//! (kernels/src/handoff_probe.cu): the counter behind a release fence that it
//! uses today, self-validating tagged words, atomic sums with and without a
//! count of contributions in each word, a bulk store with a relaxed arrival,
//! and a control that does not wait. The mechanism a fence-free megakernel
//! builds on is picked from these figures.
//!
//! Every run is checked: rounds are chained through a digest of the whole
//! vector, which the host replays here (`handoff_digest`), so a hand-off that
//! lets any SM read a stale word ends on a wrong digest.

use super::driver::{Arg, DeviceBuffer};
use super::probe::{probe_module, random_words};
use super::CudaBackend;
use crate::error::{Result, RocketError};
use crate::megakernel::geometry::{SLOTS, SLOT_BYTES};

/// The kernel's vector bound (handoff_probe.cu `MAX_WIDTH`): 2,048 elements,
/// the widest hidden size of the fuels.
pub const HANDOFF_MAX_WIDTH: usize = 2048;
/// The SMs a COUNTED word can count (its top 8 bits).
const MAX_COUNTED_SMS: usize = 255;
/// Shared memory per CTA: the ring, BULK's staging slice, the ring's barriers, scalars.
const SMEM: usize = SLOTS * SLOT_BYTES + HANDOFF_MAX_WIDTH * 4 + SLOTS * 8 + 128;
/// A wait that lasts this long means the protocol is broken: every SM stops.
const WATCHDOG_NS: u64 = 1_000_000_000;

/// How each SM publishes its part of a round and waits for the others'
/// (kernels/src/handoff_probe.cu; the discriminants are the kernel's modes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffMode {
    /// Plain stores, a CTA barrier, one `red.release` per SM; waiters poll the
    /// counter with acquire loads (the megakernel's row hand-offs today).
    Counter = 0,
    /// 8-byte words of {value, round} stored relaxed; readers poll each word
    /// until it carries the round. No counter, no fence.
    Tagged = 1,
    /// Every SM adds into every element, then releases a counter as `Counter`
    /// (the megakernel's MLP sums today).
    Sums = 2,
    /// The same sums with a count of contributions in each word's top 8 bits;
    /// a word is complete when its count has risen by the SM count. No counter,
    /// no fence.
    Counted = 3,
    /// The slice leaves by a bulk store; the SM waits for it to complete, then
    /// arrives with a relaxed add (no fence), as some persistent kernels do.
    Bulk = 4,
    /// A control that does not wait at all.
    NoWait = 5,
}

impl HandoffMode {
    pub const ALL: [HandoffMode; 6] =
        [HandoffMode::Counter, HandoffMode::Tagged, HandoffMode::Sums, HandoffMode::Counted, HandoffMode::Bulk, HandoffMode::NoWait];

    pub fn name(self) -> &'static str {
        match self {
            HandoffMode::Counter => "counter + release fence",
            HandoffMode::Tagged => "tagged words",
            HandoffMode::Sums => "atomic sums + release fence",
            HandoffMode::Counted => "counted atomic sums",
            HandoffMode::Bulk => "bulk store + relaxed arrive",
            HandoffMode::NoWait => "no wait (control)",
        }
    }

    /// Whether the PTX memory model guarantees this hand-off, so a run must end
    /// on the host's digest (`Tagged` and `Counted`, whose writes are relaxed,
    /// because each round's values depend on the last round's reads). `Bulk`'s
    /// relaxed arrival is not ordered after its data by the model; `NoWait`
    /// does not wait.
    pub fn is_ordered(self) -> bool {
        matches!(self, HandoffMode::Counter | HandoffMode::Tagged | HandoffMode::Sums | HandoffMode::Counted)
    }

    /// Whether each element is a sum of every SM's addend (else one SM's value).
    fn sums(self) -> bool {
        matches!(self, HandoffMode::Sums | HandoffMode::Counted)
    }
}

/// One probe run: a mode at one count of weight copies in flight per SM.
#[derive(Debug, Clone, PartialEq)]
pub struct HandoffCost {
    pub mode: HandoffMode,
    /// 16 KiB weight copies each SM keeps landing in its shared memory.
    pub inflight: usize,
    /// ns per grid-wide hand-off (publish, wait, read the whole vector, digest),
    /// mean over the SMs, best of the repetitions.
    pub ns: f64,
    /// The slowest SM's ns per hand-off in the same repetition.
    pub max_ns: f64,
    /// What the weight stream read meanwhile, all SMs together, in GB/s (0
    /// without copies in flight): self-validating polls read L2 while the
    /// copies land, so a cheap hand-off that slows the stream shows here.
    pub stream_gbs: f64,
    /// Whether every SM ended on the host's digest in every repetition.
    pub digest_ok: bool,
    /// Whether a wait outlived the watchdog (the run then stopped early).
    pub timed_out: bool,
}

// The kernel's hashes (handoff_probe.cu): lowbias32 and the ways it is keyed.
fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}
fn round_key(digest: u32, round: usize) -> u32 {
    digest ^ (round as u32 + 1).wrapping_mul(0x27d4_eb2f)
}
fn value(key: u32, i: usize) -> u32 {
    mix(key ^ (i as u32).wrapping_mul(0x9e37_79b9))
}
fn addend(key: u32, i: usize, sm: usize) -> u32 {
    mix(key ^ (i as u32).wrapping_mul(0x9e37_79b9) ^ (sm as u32).wrapping_mul(0x85eb_ca6b)) & 0xffff
}
fn digest_term(v: u32, i: usize) -> u32 {
    mix(v.wrapping_add((i as u32).wrapping_mul(0xc2b2_ae35)))
}

/// Round `round`'s vector given the digest of the round before.
fn round_vector(sums: bool, width: usize, sms: usize, round: usize, digest: u32) -> Vec<u32> {
    let key = round_key(digest, round);
    (0..width)
        .map(|i| if sums { (0..sms).fold(0u32, |s, sm| s.wrapping_add(addend(key, i, sm))) } else { value(key, i) })
        .collect()
}

fn digest_of(vector: &[u32]) -> u32 {
    vector.iter().enumerate().fold(0u32, |d, (i, &v)| d.wrapping_add(digest_term(v, i)))
}

/// The digest every SM must end on: the kernel's rounds replayed on the host.
pub fn handoff_digest(mode: HandoffMode, width: usize, sms: usize, rounds: usize, seed: u32) -> u32 {
    (0..rounds).fold(seed, |digest, r| digest_of(&round_vector(mode.sums(), width, sms, r, digest)))
}

/// The bounds the kernel runs within, checked before the GPU is touched.
fn check_args(inflight: &[usize], width: usize, rounds: usize, reps: usize) -> Result<()> {
    if width == 0 || width % 4 != 0 || width > HANDOFF_MAX_WIDTH {
        return Err(RocketError::invalid_arg("width", width, format!("must be a multiple of 4 in 4..={HANDOFF_MAX_WIDTH}")));
    }
    if rounds == 0 || rounds > 1_000_000 {
        return Err(RocketError::invalid_arg("rounds", rounds, "must be in 1..=1000000"));
    }
    if reps == 0 {
        return Err(RocketError::invalid_arg("reps", reps, "must be at least 1"));
    }
    if let Some(&bad) = inflight.iter().find(|&&n| n > SLOTS) {
        return Err(RocketError::invalid_arg("inflight", bad, format!("at most {SLOTS} copies (the ring's slots)")));
    }
    Ok(())
}

impl CudaBackend {
    /// Runs `rounds` grid-wide hand-offs of a `width`-element vector in each
    /// mode at each count of 16 KiB weight copies in flight per SM, `reps`
    /// times each, and reports the cost of one (see `HandoffCost`). Every run's
    /// digests are checked against `handoff_digest`.
    pub fn handoff_probe(&self, modes: &[HandoffMode], inflight: &[usize], width: usize, rounds: usize, reps: usize, seed: u64) -> Result<Vec<HandoffCost>> {
        check_args(inflight, width, rounds, reps)?;
        let inner = self.lock()?;
        let sms = inner.ctx.sm_count as usize;
        if sms > MAX_COUNTED_SMS {
            return Err(RocketError::Internal(format!("{sms} SMs: the counted words count at most {MAX_COUNTED_SMS}")));
        }
        // Every SM owns a slice of whole 16-byte groups: one with none is never
        // waited for in `Tagged` and could fall two rounds behind.
        if width < 4 * sms {
            return Err(RocketError::invalid_arg("width", width, format!("must be at least 4 per SM ({} on this GPU)", 4 * sms)));
        }
        let src_bytes = 256usize << 20;
        let src = DeviceBuffer::with_data(&inner.ctx, &inner.stream, &random_words(src_bytes / 8, seed), "the hand-off probe's stream")?;
        let words = DeviceBuffer::alloc(&inner.ctx, 2 * width * 4, "the hand-off probe's words")?;
        let wide = DeviceBuffer::alloc(&inner.ctx, 2 * width * 8, "the hand-off probe's wide words")?;
        let counters = DeviceBuffer::alloc(&inner.ctx, 96 * 4, "the hand-off probe's counters")?;
        let out = DeviceBuffer::alloc(&inner.ctx, sms * 4 * 8, "the hand-off probe's result")?;
        let module = probe_module(&inner.ctx)?;
        let f = module.function("handoff_cost")?;
        f.set_max_dynamic_smem(SMEM)?;
        let mut costs = Vec::new();
        let mut run = 0u64;
        for &mode in modes {
            for &n in inflight {
                let mut cost =
                    HandoffCost { mode, inflight: n, ns: f64::INFINITY, max_ns: f64::INFINITY, stream_gbs: 0.0, digest_ok: true, timed_out: false };
                for _ in 0..reps {
                    run += 1;
                    let run_seed = seed ^ run.wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    let start = (run_seed >> 32) as u32;
                    // Fresh random contents (the sum modes must work from any
                    // starting word); tags of all ones never equal a round.
                    words.upload(&inner.stream, 0, &random_words(width, run_seed))?;
                    if mode == HandoffMode::Tagged {
                        wide.fill_u8(&inner.stream, 0xff)?;
                    } else {
                        wide.upload(&inner.stream, 0, &random_words(2 * width, run_seed ^ 1))?;
                    }
                    counters.fill_u8(&inner.stream, 0)?;
                    out.fill_u8(&inner.stream, 0xff)?;
                    let args = [
                        Arg::Ptr(src.ptr),
                        Arg::U64(src_bytes as u64),
                        Arg::I32(n as i32),
                        Arg::I32(mode as i32),
                        Arg::I32(width as i32),
                        Arg::I32(rounds as i32),
                        Arg::I32(start as i32),
                        Arg::U64(WATCHDOG_NS),
                        Arg::Ptr(words.ptr),
                        Arg::Ptr(wide.ptr),
                        Arg::Ptr(counters.ptr),
                        Arg::Ptr(out.ptr),
                    ];
                    f.launch_ex(&inner.stream, (sms as u32, 1, 1), 288, SMEM as u32, false, &args)?;
                    inner.stream.sync()?;
                    let mut got = vec![0u64; sms * 4];
                    out.download(&inner.stream, 0, &mut got)?;
                    let want = handoff_digest(mode, width, sms, rounds, start) as u64;
                    let per_sm: Vec<f64> = got.chunks(4).map(|c| c[0] as f64 / rounds as f64).collect();
                    let mean = per_sm.iter().sum::<f64>() / sms as f64;
                    cost.digest_ok &= got.chunks(4).all(|c| c[1] == want);
                    cost.timed_out |= got.chunks(4).any(|c| c[2] != 0);
                    if mean < cost.ns {
                        cost.ns = mean;
                        cost.max_ns = per_sm.iter().cloned().fold(0.0, f64::max);
                        let copied: f64 = got.chunks(4).map(|c| c[3] as f64 * SLOT_BYTES as f64).sum();
                        cost.stream_gbs = copied / (mean * rounds as f64);
                    }
                }
                costs.push(cost);
            }
        }
        Ok(costs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::splitmix64;

    /// COUNTED: contributions are counted above this bit, summed below it (the kernel's COUNT_SHIFT).
    const COUNT_SHIFT: u32 = 56;

    /// The kernel's COUNTED reading of one word: the round's sum once `sms` contributions have
    /// landed since `before` (the word when its buffer was last read), else None.
    /// Words only grow (mod 2^64), so nothing is ever reset.
    fn counted_value(now: u64, before: u64, sms: usize) -> Option<u64> {
        let delta = now.wrapping_sub(before);
        (delta >> COUNT_SHIFT == sms as u64).then_some(delta & ((1u64 << COUNT_SHIFT) - 1))
    }

    /// One SM's COUNTED contribution: a count and its addend.
    fn counted_addend(addend: u32) -> u64 {
        (1u64 << COUNT_SHIFT) + addend as u64
    }

    #[test]
    fn the_kernels_constants_match() {
        let src = include_str!("../../../../../kernels/src/handoff_probe.cu");
        for (name, want) in [("MAX_WIDTH", HANDOFF_MAX_WIDTH), ("COUNT_SHIFT", COUNT_SHIFT as usize)] {
            let line = src.lines().find(|l| l.contains(&format!(" {name} = "))).unwrap_or_else(|| panic!("{name} in handoff_probe.cu"));
            let got: usize = line.split('=').nth(1).unwrap().trim().split(';').next().unwrap().parse().unwrap();
            assert_eq!(got, want, "{name}");
        }
        for mode in HandoffMode::ALL {
            let kernel_name = match mode {
                HandoffMode::Counter => "COUNTER",
                HandoffMode::Tagged => "TAGGED",
                HandoffMode::Sums => "SUMS",
                HandoffMode::Counted => "COUNTED",
                HandoffMode::Bulk => "BULK",
                HandoffMode::NoWait => "NONE",
            };
            assert!(src.contains(&format!("{kernel_name} = {}", mode as i32)), "{kernel_name} = {}", mode as i32);
        }
        assert!(src.contains("+ STAGE_BYTES + mk::SLOTS * 8 + 128"), "the smem sum the host mirrors in SMEM");
    }

    /// A hand-off that lets one SM read one stale word, anywhere in any round,
    /// ends on another digest: the check the GPU runs rejects it.
    #[test]
    fn a_single_stale_word_changes_the_digest() {
        let (width, sms, rounds) = (576, 132, 6);
        for sums in [false, true] {
            let mode = if sums { HandoffMode::Sums } else { HandoffMode::Counter };
            let want = handoff_digest(mode, width, sms, rounds, 0x1234);
            for trial in 0..40u64 {
                let r = splitmix64(trial) as usize % rounds;
                let i = splitmix64(trial ^ 0xff) as usize % width;
                let mut digest = 0x1234;
                let mut previous = vec![0u32; width];
                for round in 0..rounds {
                    let mut vector = round_vector(sums, width, sms, round, digest);
                    let fresh = vector.clone();
                    if round == r {
                        vector[i] = previous[i]; // the word as the round before left it
                    }
                    previous = fresh;
                    digest = digest_of(&vector);
                }
                assert_ne!(digest, want, "a stale word at round {r}, element {i} went unseen");
            }
        }
    }

    /// The counted words complete exactly when every SM's contribution has
    /// landed, in any order, from any starting word (wrapping included), and
    /// give the exact sum; a partial word never passes.
    #[test]
    fn counted_words_complete_only_with_every_contribution() {
        let sms = 132;
        for trial in 0..200u64 {
            let start = match trial % 3 {
                0 => splitmix64(trial),
                1 => u64::MAX - (splitmix64(trial) & 0xffff_ffff), // wraps during the round
                _ => 0,
            };
            let addends: Vec<u32> = (0..sms).map(|sm| (splitmix64(trial * 1000 + sm as u64) & 0xffff) as u32).collect();
            let mut order: Vec<usize> = (0..sms).collect();
            for k in (1..sms).rev() {
                order.swap(k, (splitmix64(trial ^ k as u64) % (k as u64 + 1)) as usize);
            }
            let mut word = start;
            for (landed, &sm) in order.iter().enumerate() {
                assert_eq!(counted_value(word, start, sms), None, "complete after {landed} of {sms}");
                word = word.wrapping_add(counted_addend(addends[sm]));
            }
            let sum: u64 = addends.iter().map(|&a| a as u64).sum();
            assert_eq!(counted_value(word, start, sms), Some(sum));
            // The next round on the same word starts from here.
            assert_eq!(counted_value(word.wrapping_add(counted_addend(7)), word, sms), None);
        }
        assert_eq!(counted_value(5 << COUNT_SHIFT, 0, 4), None, "one contribution too many is not complete either");
    }

    #[test]
    fn the_probe_rejects_what_the_kernel_cannot_run() {
        assert!(check_args(&[0, 4, SLOTS], 1024, 2000, 2).is_ok());
        assert!(check_args(&[0], 576, 1, 1).is_ok());
        for (inflight, width, rounds, reps, what) in [
            (vec![SLOTS + 1], 1024, 10, 1, "inflight"),
            (vec![0], 0, 10, 1, "width"),
            (vec![0], 1026, 10, 1, "width"),
            (vec![0], HANDOFF_MAX_WIDTH + 4, 10, 1, "width"),
            (vec![0], 1024, 0, 1, "rounds"),
            (vec![0], 1024, 10, 0, "reps"),
        ] {
            let err = check_args(&inflight, width, rounds, reps).unwrap_err().to_string();
            assert!(err.contains(what), "{what}: {err}");
        }
    }
}

//! The host side of the device sampler (kernels/src/sample.cu): packs each
//! row's request, penalty list and masked end ids into one upload, keeps the
//! kernel's buffers, and brings back only the chosen token ids.

use super::driver::{grown, Context, DeviceBuffer, Stream};
use super::kernels::{Kernels, SampleInputs, SamplePath, SampleRow, SampleScratch, SAMPLE_BIN_BYTES, SAMPLE_ITEM_BYTES, SAMPLE_LIST_BYTES, SAMPLE_LIST_K};
use crate::backend::SampleRequest;
use crate::error::{Result, RocketError};

/// Every row's inputs in one byte image: rows | penalty tokens | penalty counts | mask ids.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Packed {
    pub bytes: Vec<u8>,
    pub penalty_tokens_at: usize,
    pub penalty_counts_at: usize,
    pub mask_ids_at: usize,
    /// The paths the rows take, each once (which kernels launch).
    pub paths: Vec<SamplePath>,
}

fn push_words(bytes: &mut Vec<u8>, words: &[u32]) -> usize {
    let at = bytes.len().next_multiple_of(16);
    bytes.resize(at, 0);
    for w in words {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    at
}

fn word(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| RocketError::Internal(format!("{what} {n} does not fit the device sampler")))
}

/// A request's parameters, seed and step as sampler.cuh reads them (no
/// penalty list or mask: sample.cu and the megakernel supply those their way).
pub(crate) fn sample_row(r: &SampleRequest<'_>) -> SampleRow {
    let p = r.params;
    SampleRow {
        seed: r.seed,
        step: r.step,
        temperature: p.temperature,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        presence_penalty: p.presence_penalty,
        frequency_penalty: p.frequency_penalty,
        top_k: p.top_k.min(u32::MAX as usize) as u32,
        ..SampleRow::default()
    }
}

/// Lays out the requests as sample.cu reads them, each row with its path for a
/// vocabulary of `vocab` tokens.
pub(crate) fn pack(requests: &[SampleRequest<'_>], vocab: usize) -> Result<Packed> {
    let (mut tokens, mut counts, mut masks) = (Vec::new(), Vec::new(), Vec::new());
    let mut rows = Vec::with_capacity(requests.len());
    let mut paths = Vec::new();
    for r in requests {
        let p = r.params;
        let path = sample_path(r, vocab);
        if !paths.contains(&path) {
            paths.push(path);
        }
        let penalty_off = tokens.len();
        if p.has_penalties() {
            for (t, c) in r.history.penalty_entries() {
                tokens.push(t);
                counts.push(c);
            }
        }
        let mask_off = masks.len();
        if r.masks_end_ids() {
            masks.extend_from_slice(r.end_ids);
        }
        rows.push(SampleRow {
            penalty_off: word(penalty_off, "penalty list offset")?,
            penalty_len: word(tokens.len() - penalty_off, "penalty list length")?,
            mask_off: word(mask_off, "mask offset")?,
            mask_len: word(masks.len() - mask_off, "mask length")?,
            path: path as u32,
            ..sample_row(r)
        });
    }
    let mut bytes = Vec::with_capacity(rows.len() * 64 + 4 * (2 * tokens.len() + masks.len()) + 48);
    for row in &rows {
        // SAFETY: SampleRow is repr(C) plain data without padding (64 bytes, asserted).
        let raw = unsafe { std::slice::from_raw_parts(row as *const SampleRow as *const u8, std::mem::size_of::<SampleRow>()) };
        bytes.extend_from_slice(raw);
    }
    let penalty_tokens_at = push_words(&mut bytes, &tokens);
    let penalty_counts_at = push_words(&mut bytes, &counts);
    let mask_ids_at = push_words(&mut bytes, &masks);
    Ok(Packed { bytes, penalty_tokens_at, penalty_counts_at, mask_ids_at, paths })
}

/// The kernels that pick a request's token (sample.cu): a top-k of 1 to
/// SAMPLE_LIST_K at a temperature above 0 takes the top-k lists; greedy rows
/// and rows without a top-k cut (none, or one that keeps the whole vocabulary)
/// take the bins; only a larger top-k needs one CTA walking the whole row.
pub(crate) fn sample_path(r: &SampleRequest<'_>, vocab: usize) -> SamplePath {
    let (temperature, top_k) = (r.params.temperature, r.params.top_k);
    if temperature == 0.0 || top_k == 0 || top_k >= vocab {
        SamplePath::Bins
    } else if top_k <= SAMPLE_LIST_K {
        SamplePath::Lists
    } else {
        SamplePath::Whole
    }
}

/// Buffers of the device sampler, grown to the largest batch seen.
#[derive(Default)]
pub(crate) struct DeviceSampler {
    /// Compacted candidates: SAMPLE_ITEM_BYTES × vocab per row.
    items: Option<DeviceBuffer>,
    inputs: Option<DeviceBuffer>,
    tokens: Option<DeviceBuffer>,
    /// The top-k path's lists: SAMPLE_LIST_BYTES per row.
    lists: Option<DeviceBuffer>,
    /// The bins path's partials: SAMPLE_BIN_BYTES per row.
    bins: Option<DeviceBuffer>,
}

/// `grown`, rounded up so batches of growing size do not reallocate each time.
fn ensure(buf: &mut Option<DeviceBuffer>, ctx: &Context, bytes: usize, what: &str) -> Result<u64> {
    Ok(grown(buf, ctx, bytes.next_power_of_two(), what)?.ptr)
}

impl DeviceSampler {
    /// Picks one token per logits row (`requests.len()` rows of `vocab` at
    /// `logits`, which the penalties modify in place), after the work already
    /// queued on `stream`.
    pub(crate) fn sample(
        &mut self,
        ctx: &Context,
        stream: &Stream,
        kernels: &Kernels,
        logits: u64,
        vocab: usize,
        requests: &[SampleRequest<'_>],
    ) -> Result<Vec<u32>> {
        let rows = requests.len();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let packed = pack(requests, vocab)?;
        let paths = &packed.paths;
        let compacts = paths.iter().any(|&p| p != SamplePath::Bins);
        let items = if compacts { ensure(&mut self.items, ctx, rows * vocab * SAMPLE_ITEM_BYTES, "sampler candidates")? } else { 0 };
        let lists = if paths.contains(&SamplePath::Lists) { ensure(&mut self.lists, ctx, rows * SAMPLE_LIST_BYTES, "sampler top-k lists")? } else { 0 };
        let bins = if paths.contains(&SamplePath::Bins) { ensure(&mut self.bins, ctx, rows * SAMPLE_BIN_BYTES, "sampler bins")? } else { 0 };
        let inputs = ensure(&mut self.inputs, ctx, packed.bytes.len(), "sampler inputs")?;
        let tokens = ensure(&mut self.tokens, ctx, rows * 4, "sampled tokens")?;
        self.inputs.as_ref().expect("ensured").upload(stream, 0, &packed.bytes)?;
        let at = |off: usize| inputs + off as u64;
        let addresses = SampleInputs {
            rows: inputs,
            penalty_tokens: at(packed.penalty_tokens_at),
            penalty_counts: at(packed.penalty_counts_at),
            mask_ids: at(packed.mask_ids_at),
        };
        kernels.sample(stream, logits, &addresses, &SampleScratch { items, lists, bins }, tokens, vocab, rows, paths)?;
        let mut out = vec![0u32; rows];
        self.tokens.as_ref().expect("ensured").download(stream, 0, &mut out)?;
        if let Some(bad) = out.iter().find(|&&t| t as usize >= vocab) {
            return Err(RocketError::Internal(format!("the device sampler returned token {bad} for a vocabulary of {vocab}")));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{SamplingParams, TokenHistory};

    #[test]
    fn each_row_takes_the_path_its_cuts_allow() {
        let history = TokenHistory::new(&[1]);
        let vocab = 1000;
        let params = |temperature: f32, top_k: usize, top_p: f32| SamplingParams { temperature, top_k, top_p, ..SamplingParams::default() };
        for (p, path) in [
            (params(0.6, 20, 0.95), SamplePath::Lists),
            (params(1.0, 1, 1.0), SamplePath::Lists),
            (params(1.0, 64, 1.0), SamplePath::Lists),
            (params(1.0, 65, 1.0), SamplePath::Whole),
            (params(1.0, vocab - 1, 1.0), SamplePath::Whole),
            (params(1.0, vocab, 1.0), SamplePath::Bins),
            (params(0.7, 0, 0.9), SamplePath::Bins),
            (params(0.0, 20, 1.0), SamplePath::Bins),
            (params(0.0, 500, 1.0), SamplePath::Bins),
        ] {
            let r = SampleRequest { params: &p, seed: 1, step: 0, history: &history, end_ids: &[2] };
            assert_eq!(sample_path(&r, vocab), path, "{p:?}");
        }
    }

    /// Logits rows for the path models (xorshift, seeded): roughly Gaussian, then by
    /// kind peaked (0), nearly flat (1), with exact ties (2), -inf holes (3), NaN
    /// holes (4), +inf entries (5), all ±0 (6), wider than the 32 weighed nats (7),
    /// or nothing but -inf (8).
    struct TestRows(u64);

    impl TestRows {
        fn uniform(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f32 / (1u64 << 53) as f32
        }

        fn row(&mut self, vocab: usize, kind: usize) -> Vec<f32> {
            let mut row: Vec<f32> = (0..vocab).map(|_| (self.uniform() + self.uniform() + self.uniform() - 1.5) * 3.0).collect();
            match kind {
                0 => row.iter_mut().for_each(|v| *v *= 4.0),
                1 => row.iter_mut().for_each(|v| *v *= 0.02),
                2 => row.iter_mut().for_each(|v| *v = (*v * 2.0).round()),
                3 => (0..vocab).step_by(3).for_each(|i| row[i] = f32::NEG_INFINITY),
                4 => (0..vocab).step_by(11).for_each(|i| row[i] = f32::NAN),
                5 => (0..vocab).step_by(1000).for_each(|i| row[i] = f32::INFINITY),
                6 => row.iter_mut().enumerate().for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 0.0 }),
                7 => row.iter_mut().for_each(|v| *v *= 12.0),
                _ => row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY),
            }
            row
        }
    }

    /// sample.cu's top-k lists on the host: each of SAMPLE_PARTS slices of the row
    /// keeps its min(k, candidates) best tokens by (logit in total order, lower id),
    /// everything else goes to -inf.
    fn listed(row: &[f32], k: usize) -> Vec<f32> {
        let span = row.len().div_ceil(super::super::kernels::SAMPLE_PARTS);
        let mut out = vec![f32::NEG_INFINITY; row.len()];
        for lo in (0..row.len()).step_by(span) {
            let mut cands: Vec<usize> = (lo..(lo + span).min(row.len())).filter(|&i| row[i] > f32::NEG_INFINITY).collect();
            cands.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            cands.iter().take(k).for_each(|&i| out[i] = row[i]);
        }
        out
    }

    /// What the listed path rests on: the host sampler picks the same token from
    /// the slices' k best alone as from the whole row, for every cut, on rows
    /// with ties, holes, NaN and +inf entries.
    #[test]
    fn the_slices_k_best_are_all_the_host_sampler_needs() {
        use crate::sampling::sample;
        let vocab = 9000;
        let mut rows = TestRows(0x2545_f491_4f6c_dd1d);
        let (mut checked, mut cut_differs) = (0, 0);
        for kind in 0..7 {
            for rep in 0..2 {
                let row = rows.row(vocab, kind);
                for k in [1, 7, 20, 64] {
                    let short = listed(&row, k);
                    for temperature in [0.3, 1.0, 1.6] {
                        for (top_p, min_p) in [(1.0, 0.0), (0.95, 0.0), (0.5, 0.05), (1.0, 0.05)] {
                            let p = SamplingParams { temperature, top_k: k, top_p, min_p, ..SamplingParams::default() };
                            for step in 0..3 {
                                let seed = 11 + rep as u64;
                                let want = sample(&row, &p, seed, step);
                                assert_eq!(sample(&short, &p, seed, step), want, "kind {kind}, {p:?}, step {step}");
                                // The check can fail: without the cut, the whole row's race often picks elsewhere.
                                let uncut = SamplingParams { top_k: 0, ..p.clone() };
                                cut_differs += usize::from(sample(&row, &uncut, seed, step) != want);
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 7 * 2 * 4 * 3 * 4 * 3);
        assert!(cut_differs > checked / 10, "the top-k cut rarely mattered ({cut_differs} of {checked}): the rows are too easy");
    }

    /// sample.cu's bins path on the host, kernel for kernel: each of SAMPLE_PARTS
    /// slices records its argmax key and top logit (sample_bins_max); with the
    /// row's maximum, its mass and best race key per bin from the top one down,
    /// and its best key below those bins that min-p keeps (sample_bins_parts);
    /// the merge cuts on the summed masses and takes the best key the cut keeps
    /// (sample_bins_rows).
    fn binned(row: &[f32], p: &SamplingParams, seed: u64, step: u64) -> u32 {
        use super::super::kernels::{SAMPLE_MASS_BINS as BINS, SAMPLE_PARTS};
        use crate::race;
        let candidate = |l: f32| l > f32::NEG_INFINITY;
        let order = |l: f32| if l.to_bits() & 0x8000_0000 != 0 { !l.to_bits() } else { l.to_bits() | 0x8000_0000 };
        let item_key = |l: f32, i: usize| ((order(l) as u64) << 32) | (u32::MAX - i as u32) as u64;
        let span = row.len().div_ceil(SAMPLE_PARTS);
        let slices: Vec<std::ops::Range<usize>> = (0..SAMPLE_PARTS).map(|q| {
            let lo = (q * span).min(row.len());
            lo..(lo + span).min(row.len())
        }).collect();
        // sample_bins_max, merged.
        let (mut argmax_key, mut top) = (0u64, 0u64);
        for slice in &slices {
            for i in slice.clone().filter(|&i| candidate(row[i])) {
                argmax_key = argmax_key.max(item_key(row[i] + 0.0, i));
                top = top.max((order(row[i]) as u64) << 32);
            }
        }
        if p.temperature == 0.0 || top == 0 || top == (order(f32::INFINITY) as u64) << 32 {
            return if argmax_key == 0 { 0 } else { race::race_id(argmax_key) };
        }
        let max = row.iter().copied().filter(|&l| candidate(l) && (order(l) as u64) << 32 == top).next().unwrap();
        let inv_t = 1.0 / p.temperature as f64;
        let (m, hash) = (race::scaled(max, inv_t), race::step_hash(seed, step));
        let (a, top_bin) = (race::anchor(m), race::bin(m));
        let hopeless = |s: f64| ((s + 36.75) as f32) < ((m - 3.61) as f32);
        let top_p = p.top_p < 1.0;
        let low_cut = if top_p { i64::MAX } else if p.min_p > 0.0 { race::min_p_bin(m, p.min_p) } else { i64::MIN };
        // sample_bins_parts.
        let parts: Vec<(Vec<u64>, Vec<u64>, u64)> = slices.iter().map(|slice| {
            let (mut mass, mut best, mut below) = (vec![0u64; BINS], vec![0u64; BINS], 0u64);
            for i in slice.clone().filter(|&i| candidate(row[i])) {
                let s = race::scaled(row[i], inv_t);
                if hopeless(s) {
                    continue;
                }
                let (b, key) = (race::bin(s), race::race_key(s, i as u32, hash));
                if b > top_bin - BINS as i64 {
                    let idx = (top_bin - b) as usize;
                    if top_p {
                        mass[idx] += race::weight(s, a);
                    }
                    best[idx] = best[idx].max(key);
                } else if b >= low_cut {
                    below = below.max(key);
                }
            }
            (mass, best, below)
        }).collect();
        // sample_bins_rows.
        let mass: Vec<u64> = (0..BINS).map(|b| parts.iter().map(|part| part.0[b]).sum()).collect();
        let mut cut = i64::MIN;
        if top_p {
            let target = p.top_p as f64 * mass.iter().sum::<u64>() as f64;
            let (mut above, mut last) = (0u64, 0);
            for (b, &w) in mass.iter().enumerate() {
                if above as f64 >= target {
                    break;
                }
                last = b;
                above += w;
            }
            cut = top_bin - last as i64;
        }
        if p.min_p > 0.0 {
            cut = cut.max(race::min_p_bin(m, p.min_p));
        }
        let kept = parts.iter().flat_map(|(_, best, below)| {
            best.iter().enumerate().filter(|&(b, _)| top_bin - b as i64 >= cut).map(|(_, &k)| k).chain([*below])
        });
        race::race_id(kept.max().expect("parts"))
    }

    /// What the bins path rests on: its pieces merge to the host sampler's token
    /// for greedy rows and every cut without a top-k, on rows with ties, holes,
    /// NaN and +inf entries, spreads wider than the weighed bins, and
    /// vocabularies that leave slices short or empty.
    #[test]
    fn the_bins_pieces_merge_to_the_host_samplers_token() {
        use crate::sampling::sample;
        let mut rows = TestRows(0x9e37_79b9_7f4a_7c15);
        let (mut checked, mut cut_cases, mut cut_differs) = (0, 0, 0);
        for (vocab, kinds) in [(9000, 0..9), (20, 0..3), (1001, 0..9)] {
            for kind in kinds {
                let row = rows.row(vocab, kind);
                for temperature in [0.0, 0.3, 1.0, 1.6] {
                    for (top_p, min_p) in [(1.0, 0.0), (0.95, 0.0), (0.9, 0.0), (0.5, 0.05), (1.0, 0.05), (1.0, 0.3), (1.0, 1e-15)] {
                        for top_k in [0, vocab] {
                            let p = SamplingParams { temperature, top_k, top_p, min_p, ..SamplingParams::default() };
                            for step in 0..8 {
                                let want = sample(&row, &p, 5, step);
                                assert_eq!(binned(&row, &p, 5, step), want, "vocab {vocab}, kind {kind}, {p:?}, step {step}");
                                checked += 1;
                                // The check can fail: the cuts often change the pick.
                                if temperature > 0.0 && (top_p < 1.0 || min_p >= 0.05) {
                                    let uncut = SamplingParams { top_p: 1.0, min_p: 0.0, ..p.clone() };
                                    cut_differs += usize::from(sample(&row, &uncut, 5, step) != want);
                                    cut_cases += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert_eq!(checked, (9 + 3 + 9) * 4 * 7 * 2 * 8);
        assert!(cut_differs > cut_cases / 10, "the cuts rarely mattered ({cut_differs} of {cut_cases}): the rows are too easy");
    }

    #[test]
    fn packs_rows_penalties_and_masks_where_the_kernel_reads_them() {
        let mut history = TokenHistory::new(&[5, 9]);
        history.push(9);
        history.push(11);
        let penalised = SamplingParams { repetition_penalty: 1.2, min_tokens: 5, top_k: 7, seed: Some(3), ..SamplingParams::default() };
        let plain = SamplingParams { temperature: 0.5, ..SamplingParams::default() };
        let empty = TokenHistory::new(&[1]);
        let reqs = [
            SampleRequest { params: &penalised, seed: 3, step: 2, history: &history, end_ids: &[2, 4] },
            SampleRequest { params: &plain, seed: 8, step: 0, history: &empty, end_ids: &[2] },
        ];
        let p = pack(&reqs, 100).unwrap();
        let row = |i: usize| unsafe { std::ptr::read_unaligned(p.bytes[i * 64..].as_ptr() as *const SampleRow) };
        let word = |at: usize, i: usize| u32::from_le_bytes(p.bytes[at + 4 * i..at + 4 * i + 4].try_into().unwrap());
        let (a, b) = (row(0), row(1));
        assert_eq!((a.seed, a.step, a.top_k, a.repetition_penalty), (3, 2, 7, 1.2));
        assert_eq!((a.penalty_off, a.penalty_len, a.mask_off, a.mask_len), (0, 3, 0, 2));
        let mut entries: Vec<(u32, u32)> = (0..3).map(|i| (word(p.penalty_tokens_at, i), word(p.penalty_counts_at, i))).collect();
        entries.sort();
        assert_eq!(entries, [(5, 0), (9, 1), (11, 1)]);
        assert_eq!([word(p.mask_ids_at, 0), word(p.mask_ids_at, 1)], [2, 4]);
        // No penalties and min_tokens reached: nothing to upload for the second row.
        assert_eq!((b.temperature, b.penalty_len, b.mask_len, b.mask_off), (0.5, 0, 0, 2));
        assert_eq!((a.path, b.path), (SamplePath::Lists as u32, SamplePath::Bins as u32));
        assert_eq!(p.paths, [SamplePath::Lists, SamplePath::Bins]);
        assert!(p.penalty_tokens_at % 16 == 0 && p.mask_ids_at % 16 == 0 && p.penalty_tokens_at >= 128);
    }
}

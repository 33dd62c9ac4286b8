//! Checks a compiled [`Schedule`] before it reaches a GPU: every output row and
//! attention split (of every slot) is computed exactly once per step (the LM head's claimed
//! tiles cover the vocabulary and every SM claims them once), every instruction waits
//! for exactly the work it reads, and the SMs, each running its list in order,
//! always finish: simulated under several interleavings over several steps.

use std::collections::{BTreeMap, HashMap};

use super::geometry::{scatter_rows, MatvecShape, PART_CAP, SLOTS};
use super::schedule::{Counters, Instr, Op, Schedule, Wait, Work, MAX_BATCH_SLOTS};
use crate::model::ModelSpec;

/// What the op at (layer, op) must wait for, given the tile counts of the ops.
fn expected_wait(c: &Counters, tiles: &HashMap<(usize, Op), usize>, layer: usize, op: Op) -> Wait {
    let done = |l: usize, o: Op| Wait { counter: c.op(o, l), per_step: tiles[&(l, o)] as u16 };
    match op {
        Op::Qkv if layer == 0 => Wait { counter: Counters::STEP, per_step: 1 },
        Op::Qkv => done(layer - 1, Op::Mlp),
        Op::Attn => done(layer, Op::Qkv),
        Op::OProj => done(layer, Op::Attn), // every split of every KV head
        Op::Mlp => done(layer, Op::OProj),
        Op::LmHead => done(layer - 1, Op::Mlp),
    }
}

/// Rows of each matrix-vector op.
fn op_rows(spec: &ModelSpec, op: Op) -> usize {
    match op {
        Op::Qkv => spec.q_dim() + 2 * spec.kv_dim(),
        Op::OProj => spec.hidden_size,
        Op::Mlp => spec.intermediate_size,
        Op::LmHead => spec.vocab_size,
        Op::Attn => 0,
    }
}

/// Order of an instruction in a step: every SM's list must follow it.
fn rank(i: &Instr) -> (u16, Op) {
    (i.layer, i.op)
}

pub fn verify(s: &Schedule, spec: &ModelSpec) -> Result<(), String> {
    if !(1..=MAX_BATCH_SLOTS).contains(&s.batch_slots) {
        return Err(format!("{} batch slots (1 to {MAX_BATCH_SLOTS})", s.batch_slots));
    }
    if s.per_sm.len() != s.sm_count {
        return Err(format!("{} instruction lists for {} SMs", s.per_sm.len(), s.sm_count));
    }
    for (sm, list) in s.per_sm.iter().enumerate() {
        // The kernel's weight stream restarts an SM's list every step and decodes
        // its first instruction: an empty list would decode another SM's.
        if list.is_empty() {
            return Err(format!("SM {sm} has no instructions"));
        }
        if let Some(w) = list.windows(2).find(|w| rank(&w[0]) > rank(&w[1])) {
            return Err(format!("SM {sm} runs {:?} of layer {} before {:?} of layer {}", w[0].op, w[0].layer, w[1].op, w[1].layer));
        }
    }
    check_coverage(s, spec)?;
    check_waits(s, spec)?;
    check_claim_order(s, spec)?;
    for order in [Order::Forward, Order::Backward, Order::Shuffled(0x5eed), Order::Shuffled(7)] {
        simulate(s, 3, order)?;
    }
    Ok(())
}

/// (begin, end, tile) of each tile of one op.
type Tiles = Vec<(u32, u32, u32)>;

/// The LM head: once on every SM, claiming tiles that cover the vocabulary,
/// whose partial sums (two tiles' at a time) fit the CTA.
fn check_lm_head(s: &Schedule, spec: &ModelSpec) -> Result<(), String> {
    let segments = MatvecShape::of(spec.hidden_size).map_or(1, |m| m.segments);
    for (sm, list) in s.per_sm.iter().enumerate() {
        let heads: Vec<&Instr> = list.iter().filter(|i| i.op == Op::LmHead).collect();
        let [head] = heads[..] else {
            return Err(format!("SM {sm} runs the LM head {} times (once per SM)", heads.len()));
        };
        let Work::Claimed { tile_rows, tiles, claims } = head.work else {
            return Err(format!("the LM head on SM {sm} carries {:?}, not claimed tiles", head.work));
        };
        let (rows, n) = (tile_rows as usize, tiles as usize);
        if rows == 0 || rows * n < spec.vocab_size || rows * (n - 1) >= spec.vocab_size {
            return Err(format!("{n} LM-head tiles of {rows} rows for a vocabulary of {}", spec.vocab_size));
        }
        if 2 * rows * segments > PART_CAP {
            return Err(format!("LM-head tiles of {rows} rows overflow the partial sums"));
        }
        if claims != s.counters.lm_claims() {
            return Err(format!("the LM head on SM {sm} claims from counter {claims}, not {}", s.counters.lm_claims()));
        }
    }
    if s.lm_tiles != s.sm_count {
        return Err(format!("{} LM-head arrivals per step for {} SMs", s.lm_tiles, s.sm_count));
    }
    Ok(())
}

/// The LM head's claims follow the steps (claim k of step t is tile
/// k - t (tiles + SMs)) only if no SM's producer makes its first claim of step
/// t + 1 before every SM has made its last of step t. A producer reaches step
/// t + 1's LM head after issuing that step's layer chunks, and it issues the
/// last of them only once its consumers have released the chunk SLOTS before:
/// with more than SLOTS chunks per step outside the LM head, a chunk of step
/// t + 1, which they take only after step t's token, that is after every SM's
/// last claim of step t. (The CPU twin has no producer running ahead: only this
/// check stands for it.)
fn check_claim_order(s: &Schedule, spec: &ModelSpec) -> Result<(), String> {
    let rows_per_chunk = |k: usize| MatvecShape::of(k).map_or(1, |m| m.rows);
    let (d, qd) = (rows_per_chunk(spec.hidden_size), rows_per_chunk(spec.q_dim()));
    let scatter = scatter_rows(spec.hidden_size);
    for (sm, list) in s.per_sm.iter().enumerate() {
        let chunks: usize = list
            .iter()
            .map(|i| match i.work {
                Work::Rows { begin, end, .. } => {
                    let n = (end - begin) as usize;
                    match i.op {
                        Op::OProj => n.div_ceil(qd),
                        Op::Mlp => 2 * n.div_ceil(d) + n.div_ceil(scatter), // gate, up, down^T
                        _ => n.div_ceil(d),
                    }
                }
                Work::Attn { .. } | Work::Claimed { .. } => 0,
            })
            .sum();
        if chunks <= SLOTS {
            return Err(format!(
                "SM {sm} streams {chunks} weight chunks per step before its LM head; the LM head's claims need more than the ring's {SLOTS}"
            ));
        }
    }
    Ok(())
}

fn check_coverage(s: &Schedule, spec: &ModelSpec) -> Result<(), String> {
    let nl = spec.num_layers;
    check_lm_head(s, spec)?;
    let mut rows: BTreeMap<(usize, Op), Tiles> = BTreeMap::new();
    let mut attn: BTreeMap<usize, Vec<(u32, u32, u32)>> = BTreeMap::new();
    for i in s.per_sm.iter().flatten() {
        let layer = i.layer as usize;
        let layer_ok = if i.op == Op::LmHead { layer == nl } else { layer < nl };
        if !layer_ok {
            return Err(format!("{:?} in layer {layer} of a {nl}-layer model", i.op));
        }
        match (i.op, i.work) {
            (Op::Attn, Work::Attn { slot, kv_head, split, splits }) => {
                if splits as usize != s.splits || split >= splits || kv_head as usize >= spec.num_kv_heads || slot as usize >= s.batch_slots {
                    return Err(format!("attention item (slot {slot}, head {kv_head}, split {split}/{splits}) in layer {layer}"));
                }
                attn.entry(layer).or_default().push((slot, kv_head, split));
            }
            (Op::LmHead, Work::Claimed { .. }) => {} // check_lm_head
            (op, Work::Rows { begin, end, tile }) if op != Op::Attn && op != Op::LmHead => {
                if begin >= end {
                    return Err(format!("empty tile of {op:?} in layer {layer}"));
                }
                rows.entry((layer, op)).or_default().push((begin, end, tile));
            }
            (op, work) => return Err(format!("{op:?} carries {work:?}")),
        }
    }
    for layer in 0..nl {
        for op in [Op::Qkv, Op::OProj, Op::Mlp] {
            let mut tiles = rows.remove(&(layer, op)).ok_or_else(|| format!("{op:?} of layer {layer} is missing"))?;
            tiles.sort();
            let mut next = 0u32;
            for (n, &(begin, end, tile)) in tiles.iter().enumerate() {
                if begin != next {
                    return Err(format!("{op:?} of layer {layer}: rows {next}..{begin} uncovered or overlapping"));
                }
                if tile as usize != n {
                    return Err(format!("{op:?} of layer {layer}: tile numbers are not 0..{}", tiles.len()));
                }
                next = end;
            }
            if next as usize != op_rows(spec, op) {
                return Err(format!("{op:?} of layer {layer} covers {next} of {} rows", op_rows(spec, op)));
            }
        }
        let mut items = attn.remove(&layer).unwrap_or_default();
        items.sort();
        let (heads, splits) = (spec.num_kv_heads as u32, s.splits as u32);
        let want: Vec<(u32, u32, u32)> = (0..s.batch_slots as u32)
            .flat_map(|slot| (0..heads).flat_map(move |g| (0..splits).map(move |sp| (slot, g, sp))))
            .collect();
        if items != want {
            return Err(format!("attention of layer {layer} does not cover every (slot, KV head, split) once"));
        }
    }
    if let Some(((layer, op), _)) = rows.into_iter().next() {
        return Err(format!("unexpected {op:?} in layer {layer}"));
    }
    Ok(())
}

fn check_waits(s: &Schedule, spec: &ModelSpec) -> Result<(), String> {
    let c = &s.counters;
    let mut tiles: HashMap<(usize, Op), usize> = HashMap::new();
    let mut signals: HashMap<u16, usize> = HashMap::new();
    for i in s.per_sm.iter().flatten() {
        *tiles.entry((i.layer as usize, i.op)).or_default() += 1;
        *signals.entry(i.signal).or_default() += 1;
    }
    for i in s.per_sm.iter().flatten() {
        let layer = i.layer as usize;
        let want_signal = c.op(i.op, layer);
        if i.signal != want_signal {
            return Err(format!("{:?} of layer {layer} signals counter {} instead of {want_signal}", i.op, i.signal));
        }
        if let Work::Attn { splits, .. } = i.work {
            if signals[&i.signal] != s.batch_slots * splits as usize * spec.num_kv_heads {
                return Err(format!(
                    "attention of layer {layer}: {} signals for {splits} splits of {} KV heads and {} slots",
                    signals[&i.signal],
                    spec.num_kv_heads,
                    s.batch_slots
                ));
            }
        }
        if i.op == Op::LmHead && signals[&i.signal] != s.lm_tiles {
            return Err(format!("{} LM-head signals per step, the token waits for {}", signals[&i.signal], s.lm_tiles));
        }
        let want = expected_wait(c, &tiles, layer, i.op);
        if i.wait != want {
            return Err(format!("{:?} of layer {layer} waits {:?}, should wait {want:?}", i.op, i.wait));
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Order {
    Forward,
    Backward,
    Shuffled(u64),
}

/// Runs `steps` steps the way the kernel does: each SM waits for the step to
/// start (its input token embedded), then runs its list in order, each
/// instruction only once its counter is reached. Which ready SM moves next
/// follows `order`. Fails if the SMs stop before all steps are done.
fn simulate(s: &Schedule, steps: u32, order: Order) -> Result<(), String> {
    let c = &s.counters;
    let mut counters = vec![0u32; c.count()];
    counters[Counters::STEP as usize] = 1; // the launch embeds the first token
    let mut step = vec![0u32; s.sm_count];
    let mut pc = vec![0usize; s.sm_count];
    let mut rng = match order {
        Order::Shuffled(seed) => seed | 1,
        _ => 1,
    };
    let mut sms: Vec<usize> = (0..s.sm_count).collect();
    if let Order::Backward = order {
        sms.reverse();
    }
    loop {
        if let Order::Shuffled(_) = order {
            for i in (1..sms.len()).rev() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                sms.swap(i, (rng % (i as u64 + 1)) as usize);
            }
        }
        let mut moved = false;
        for &sm in &sms {
            let list = &s.per_sm[sm];
            while step[sm] < steps {
                let t = step[sm];
                if pc[sm] == list.len() {
                    step[sm] += 1;
                    pc[sm] = 0;
                    moved = true;
                    continue;
                }
                if pc[sm] == 0 && counters[Counters::STEP as usize] < t + 1 {
                    break;
                }
                let instr = &list[pc[sm]];
                if counters[instr.wait.counter as usize] < (t + 1) * instr.wait.per_step as u32 {
                    break;
                }
                counters[instr.signal as usize] += 1;
                let arrived = counters[instr.signal as usize];
                if instr.op == Op::LmHead && arrived == (t + 1) * s.lm_tiles as u32 {
                    counters[Counters::STEP as usize] += 1
                }
                pc[sm] += 1;
                moved = true;
            }
        }
        if step.iter().all(|&t| t == steps) {
            return Ok(());
        }
        if !moved {
            let (sm, t) = step.iter().enumerate().filter(|(_, &t)| t < steps).map(|(i, &t)| (i, t)).next().expect("some SM is unfinished");
            let what = s.per_sm[sm].get(pc[sm]).map_or("the step start".to_string(), |i| format!("{:?} of layer {}", i.op, i.layer));
            return Err(format!("deadlock ({order:?} order): SM {sm} stuck at {what} of step {t}"));
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::Family;

    pub(crate) fn spec(d: usize, ff: usize, layers: usize, heads: usize, kv: usize, hd: usize, vocab: usize) -> ModelSpec {
        ModelSpec {
            family: Family::Llama,
            hidden_size: d,
            intermediate_size: ff,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: hd,
            vocab_size: vocab,
            max_position_embeddings: 4096,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            rope_freq_factors: None,
            tie_word_embeddings: true,
            qk_norm: false,
        }
    }

    #[test]
    fn fuel_schedules_are_complete_and_deadlock_free_for_any_sm_count() {
        let fuels = [
            ("llama-3.2-1b", spec(2048, 8192, 16, 32, 8, 64, 128256)),
            ("qwen3-0.6b", spec(1024, 3072, 28, 16, 8, 128, 151936)),
            ("qwen3-1.7b", spec(2048, 6144, 28, 16, 8, 128, 151936)),
            ("smollm2-135m", spec(576, 1536, 30, 9, 3, 64, 49152)),
        ];
        for (name, spec) in &fuels {
            for sms in (1..=40).chain([66, 78, 114, 132, 144, 170]) {
                let s = Schedule::compile(spec, sms).unwrap();
                verify(&s, spec).unwrap_or_else(|e| panic!("{name} on {sms} SMs: {e}"));
            }
        }
    }

    #[test]
    fn batched_schedules_verify_and_keep_the_splits_of_one_sequence() {
        let fuels = [spec(2048, 8192, 16, 32, 8, 64, 128256), spec(1024, 3072, 28, 16, 8, 128, 151936), spec(576, 1536, 30, 9, 3, 64, 49152)];
        for spec in &fuels {
            for sms in [7, 132] {
                let one = Schedule::compile(spec, sms).unwrap();
                for slots in [2, 16, 64] {
                    let s = Schedule::compile_batched(spec, sms, slots).unwrap();
                    verify(&s, spec).unwrap_or_else(|e| panic!("{slots} slots on {sms} SMs: {e}"));
                    // A sequence's rows and attention are cut the same whatever the batch: batch invariance.
                    assert_eq!(s.splits, one.splits);
                    let tiles = |s: &Schedule| -> Vec<Work> {
                        let mut w: Vec<Work> = s.per_sm.iter().flatten().filter(|i| i.op != Op::Attn).map(|i| i.work).collect();
                        w.sort_by_key(|w| format!("{w:?}"));
                        w
                    };
                    assert_eq!(tiles(&s), tiles(&one));
                    let attn = s.per_sm.iter().flatten().filter(|i| i.op == Op::Attn && i.layer == 0).count();
                    assert_eq!(attn, slots * spec.num_kv_heads * s.splits);
                }
            }
        }
        let llama = &fuels[0];
        assert!(Schedule::compile_batched(llama, 132, 0).is_err());
        assert!(Schedule::compile_batched(llama, 132, super::super::schedule::MAX_BATCH_SLOTS + 1).is_err());
    }

    #[test]
    fn broken_batched_schedules_are_caught() {
        let small = spec(64, 128, 3, 4, 2, 64, 300);
        let good = Schedule::compile_batched(&small, 5, 3).unwrap();
        verify(&good, &small).unwrap();
        // Slot 2's attention lost: its O-proj would merge partials nobody wrote.
        let mut s = good.clone();
        for list in &mut s.per_sm {
            list.retain(|i| !matches!(i.work, Work::Attn { slot: 2, split: 0, kv_head: 1, .. } if i.layer == 1));
        }
        assert!(verify(&s, &small).unwrap_err().contains("(slot, KV head, split)"));
        // One slot's item twice in place of another's.
        let mut s = good.clone();
        let i = s.per_sm.iter_mut().flatten().find(|i| matches!(i.work, Work::Attn { slot: 1, .. })).unwrap();
        if let Work::Attn { slot, .. } = &mut i.work {
            *slot = 0;
        }
        assert!(verify(&s, &small).unwrap_err().contains("(slot, KV head, split)"));
        // A slot past the batch.
        let mut s = good.clone();
        let i = s.per_sm.iter_mut().flatten().find(|i| matches!(i.work, Work::Attn { slot: 2, .. })).unwrap();
        if let Work::Attn { slot, .. } = &mut i.work {
            *slot = 3;
        }
        assert!(verify(&s, &small).unwrap_err().contains("slot 3"));
        // O-proj waiting for one sequence's splits only.
        let mut s = good.clone();
        for i in s.per_sm.iter_mut().flatten().filter(|i| i.op == Op::OProj) {
            i.wait.per_step /= 3;
        }
        assert!(verify(&s, &small).unwrap_err().contains("waits"));
        // A schedule claiming fewer slots than its attention items serve, or none.
        let mut s = good.clone();
        s.batch_slots = 2;
        assert!(verify(&s, &small).is_err());
        let mut s = Schedule::compile(&small, 5).unwrap();
        s.per_sm.iter_mut().for_each(|l| l.retain(|i| i.op != Op::Attn));
        s.batch_slots = 0;
        assert!(verify(&s, &small).unwrap_err().contains("0 batch slots"));
    }

    #[test]
    fn every_lm_head_tile_size_verifies() {
        // Every tile size the ring holds (1 to SLOTS chunks), on the fuels whose partial sums cap the tile.
        for spec in [spec(576, 1536, 30, 9, 3, 64, 49152), spec(2048, 6144, 28, 16, 8, 128, 151936)] {
            for chunks in 1..=12 {
                for sms in [7, 132] {
                    let s = Schedule::compile_with_lm_tiles(&spec, sms, chunks).unwrap();
                    verify(&s, &spec).unwrap_or_else(|e| panic!("{chunks} chunks per tile on {sms} SMs: {e}"));
                }
            }
        }
        assert!(Schedule::compile_with_lm_tiles(&spec(576, 1536, 30, 9, 3, 64, 49152), 132, 0).is_err());
    }

    /// Weight bytes each SM streams through its ring per step (the load balance;
    /// claimed tiles count as the SM's even share).
    fn weight_bytes_per_sm(s: &Schedule, spec: &ModelSpec) -> Vec<usize> {
        let n = s.sm_count;
        (0..n)
            .map(|sm| {
                s.per_sm[sm]
                    .iter()
                    .map(|i| match i.work {
                        Work::Attn { .. } => 0,
                        Work::Claimed { .. } => {
                            let all = spec.vocab_size * spec.hidden_size * 2;
                            all * (sm + 1) / n - all * sm / n
                        }
                        Work::Rows { begin, end, .. } => {
                            let k = if i.op == Op::OProj { spec.q_dim() } else { spec.hidden_size };
                            let matrices = if i.op == Op::Mlp { 3 } else { 1 }; // gate, up, down^T
                            (end - begin) as usize * k * 2 * matrices
                        }
                    })
                    .sum()
            })
            .collect()
    }

    #[test]
    fn h200_schedule_balances_the_weight_bytes() {
        let llama = spec(2048, 8192, 16, 32, 8, 64, 128256);
        let s = Schedule::compile(&llama, 132).unwrap();
        let bytes = weight_bytes_per_sm(&s, &llama);
        let (min, max) = (*bytes.iter().min().unwrap(), *bytes.iter().max().unwrap());
        assert!(max as f64 / (min as f64) < 1.02, "SM weight bytes {min}..{max}");
        assert_eq!(bytes.iter().sum::<usize>(), 2 * (llama.weight_elements_per_step() - 2048 - llama_norms(&llama)));
        assert_eq!(s.splits, 16);
        assert_eq!(s.lm_tiles, 132);
    }

    /// f32 norm weights counted in `weight_elements_per_step` but not streamed as bf16 rows.
    fn llama_norms(s: &ModelSpec) -> usize {
        s.num_layers * 2 * s.hidden_size + s.hidden_size
    }

    #[test]
    fn broken_schedules_are_caught() {
        let small = spec(64, 128, 3, 4, 2, 64, 300); // 15 weight chunks per SM and step: more than the ring
        let good = Schedule::compile(&small, 5).unwrap();
        verify(&good, &small).unwrap();

        // A wait one split short lets OProj merge partials that are not all written yet.
        let mut s = good.clone();
        let i = s.per_sm.iter_mut().flatten().find(|i| i.op == Op::OProj).unwrap();
        i.wait.per_step -= 1;
        assert!(verify(&s, &small).unwrap_err().contains("waits"));

        // A wait one tile too long never completes: the simulation finds the deadlock.
        let mut s = good.clone();
        for i in s.per_sm.iter_mut().flatten().filter(|i| i.op == Op::Mlp && i.layer == 1) {
            i.wait.per_step += 1;
        }
        assert!(check_waits(&s, &small).is_err());
        assert!(simulate(&s, 2, Order::Forward).unwrap_err().contains("deadlock"));

        // A lost tile leaves rows uncovered.
        let mut s = good.clone();
        let sm = s.per_sm.iter().position(|l| l.iter().any(|i| i.op == Op::Mlp)).unwrap();
        let at = s.per_sm[sm].iter().position(|i| i.op == Op::Mlp).unwrap();
        s.per_sm[sm].remove(at);
        assert!(verify(&s, &small).is_err());

        // An SM without the LM head would leave the token waiting; one with a
        // claims counter of its own would claim every tile again.
        let mut s = good.clone();
        s.per_sm[2].retain(|i| i.op != Op::LmHead);
        assert!(verify(&s, &small).unwrap_err().contains("LM head 0 times"));
        let mut s = good.clone();
        let head = s.per_sm[1].iter_mut().find(|i| i.op == Op::LmHead).unwrap();
        if let Work::Claimed { claims, .. } = &mut head.work {
            *claims = 0;
        }
        assert!(verify(&s, &small).unwrap_err().contains("claims from counter 0"));
        // Tiles that stop short of the vocabulary leave logits unwritten.
        let mut s = good.clone();
        for i in s.per_sm.iter_mut().flatten().filter(|i| i.op == Op::LmHead) {
            if let Work::Claimed { tiles, .. } = &mut i.work {
                *tiles -= 1;
            }
        }
        assert!(verify(&s, &small).unwrap_err().contains("LM-head tiles"));

        // Two layers stream only 10 chunks per SM and step: a producer could
        // claim the next step's LM-head tiles before the others finished this step's.
        let short = spec(64, 128, 2, 4, 2, 64, 300);
        let s = Schedule::compile(&short, 5).unwrap();
        assert!(verify(&s, &short).unwrap_err().contains("10 weight chunks"));

        // An SM that runs layer 1 before layer 0 breaks the global order.
        let mut s = good.clone();
        let list = s.per_sm.iter_mut().find(|l| l.len() > 2).unwrap();
        let last = list.len() - 1;
        list.swap(0, last);
        assert!(verify(&s, &small).unwrap_err().contains("before"));
    }
}

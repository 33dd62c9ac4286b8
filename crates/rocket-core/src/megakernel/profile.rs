//! Where a megakernel step's time goes, from the kernel's own timestamps.
//!
//! With tracing on, thread 0 of every CTA stamps the GPU's global timer (ns)
//! for one chosen step: when it starts waiting for the step's input and when
//! that wait ends, and for each of its instructions when the dependency wait
//! begins, when it ends and when the instruction is done. Layout (u64 words):
//! `[3 i + 0, 1, 2]` for instruction `i` of the encoded schedule (SM lists back
//! to back), then `[3 n + 2 sm + 0, 1]` for the step wait of each SM, then
//! `[3 n + 2 sms + 3 i + 0, 1, 2]` inside attention instruction `i` when its split
//! was used (else 0): q in shared memory, the loop over positions done, the
//! split's partial stored; inside LM-head instruction `i`: the SM's tiles done,
//! its sampler and logprob parts done, and on the last SM to arrive alone, the
//! token picked (the merge; else 0). Then `MERGE_STAMPS` words the last SM's
//! merge stamps at the end of each of its phases (0 where it has fewer, or none),
//! and `PART_STAMPS` words per SM where it stamps the end of each phase of its
//! sampler part (mk_race.cuh names the phases; 0 for greedy).

use std::fmt;

use super::abi::{MERGE_STAMPS, PART_STAMPS};
use super::schedule::{Op, Schedule};
use crate::error::{Result, RocketError};

/// Words a trace of `schedule` takes.
pub fn trace_words(schedule: &Schedule) -> usize {
    6 * schedule.len() + 2 * schedule.sm_count + MERGE_STAMPS + PART_STAMPS * schedule.sm_count
}

/// Inside the used attention splits of the timeline's layer: the latest of each
/// stamp over those splits, in µs on the timeline.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionInside {
    pub used: usize,
    pub wait_end_us: f64,
    pub q_ready_us: f64,
    pub loop_done_us: f64,
    pub stored_us: f64,
    pub done_us: f64,
}

/// Inside the LM head, in µs from the last layer's end: where a sampled step's
/// extra time goes (the SMs' parts after their tiles, or the last SM's merge).
#[derive(Debug, Clone, PartialEq)]
pub struct LmHeadInside {
    /// The SMs' tiles done (first, mean, last).
    pub tiles_done_us: (f64, f64, f64),
    /// Their sampler and logprob parts done, before each SM's arrival (first, mean, last).
    pub parts_done_us: (f64, f64, f64),
    /// The last SM to arrive has picked the token.
    pub picked_us: f64,
    /// The end of each of the merge's phases (a sampled step's; none for greedy),
    /// in order: mk_race.cuh names them where it stamps.
    pub merge_us: Vec<f64>,
    /// The end of each phase of the SMs' sampler parts (first, mean, last SM),
    /// in order; none for greedy.
    pub part_phases_us: Vec<(f64, f64, f64)>,
}

/// Time per kind of instruction over one step.
#[derive(Debug, Clone, PartialEq)]
pub struct OpTimes {
    pub op: Op,
    pub count: usize,
    /// Mean time waiting for the dependency (µs); for attention it includes
    /// issuing the split's K/V prefetches, which come before the wait.
    pub wait_us: f64,
    /// Mean time from the wait's end to done (µs): the work itself.
    pub busy_us: f64,
    /// Mean time from the last instruction the wait needed being done to the
    /// wait ending, over instructions that did wait (µs): the hand-off cost.
    pub handoff_us: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    /// From the first SM seeing the step's input to the last instruction done (µs).
    pub step_us: f64,
    /// Mean time between the ends of consecutive layers' last MLP tile (µs).
    pub layer_us: f64,
    pub ops: Vec<OpTimes>,
    /// The ops of one layer in the middle of the model, as a timeline.
    pub timeline: Vec<Phase>,
    /// The LM head, in µs from the last layer's end.
    pub lm_head: Option<Phase>,
    pub attention: Option<AttentionInside>,
    pub lm_head_inside: Option<LmHeadInside>,
}

/// One op of one layer on the step's timeline, in µs from the moment the
/// layer's input was ready (the previous layer's last MLP tile done).
#[derive(Debug, Clone, PartialEq)]
pub struct Phase {
    pub op: Op,
    pub layer: usize,
    /// The last instruction this op waits for is done.
    pub ready_us: f64,
    /// Its instructions' waits end (first, last).
    pub start_us: (f64, f64),
    /// Its instructions are done (first, mean, last).
    pub done_us: (f64, f64, f64),
}

impl Profile {
    /// Reads a trace of `schedule` (see the module docs). Errors when a stamp is
    /// missing or out of order, which means the trace is not of a whole step.
    pub fn from_trace(schedule: &Schedule, stamps: &[u64]) -> Result<Profile> {
        let n = schedule.len();
        if stamps.len() != trace_words(schedule) {
            return Err(RocketError::Internal(format!("a trace of {} words for a schedule of {n} instructions", stamps.len())));
        }
        let instrs: Vec<_> = schedule.per_sm.iter().flatten().collect();
        for (i, w) in stamps[..3 * n].chunks(3).enumerate() {
            if w[0] == 0 || w[0] > w[1] || w[1] > w[2] {
                return Err(RocketError::Internal(format!("instruction {i} ({:?}) has stamps {w:?}", instrs[i].op)));
            }
        }
        let step_ends = &stamps[3 * n..3 * n + 2 * schedule.sm_count];
        let inside = &stamps[3 * n + 2 * schedule.sm_count..6 * n + 2 * schedule.sm_count];
        let merge_at = 6 * n + 2 * schedule.sm_count;
        let merge: Vec<u64> = stamps[merge_at..merge_at + MERGE_STAMPS].iter().copied().filter(|&w| w != 0).collect();
        let parts: Vec<&[u64]> = stamps[merge_at + MERGE_STAMPS..].chunks(PART_STAMPS).collect();
        // An SM's part stamps its phases in order (those it reached).
        if let Some(sm) = parts.iter().position(|w| w.iter().filter(|&&x| x != 0).collect::<Vec<_>>().windows(2).any(|p| p[0] > p[1])) {
            return Err(RocketError::Internal(format!("SM {sm}'s sampler part stamps {:?} out of order", parts[sm])));
        }
        if step_ends.chunks(2).any(|w| w[0] == 0 || w[0] > w[1]) {
            return Err(RocketError::Internal("a step wait was not stamped".into()));
        }
        let start = step_ends.chunks(2).map(|w| w[1]).min().unwrap_or(0);
        let end = stamps[..3 * n].chunks(3).map(|w| w[2]).max().unwrap_or(start);
        let us = |ns: u64| ns as f64 / 1e3;

        // When each counter was last bumped: the latest `done` of its signallers.
        let mut ready = std::collections::HashMap::<u16, u64>::new();
        for (i, ins) in instrs.iter().enumerate() {
            let done = stamps[3 * i + 2];
            let mut bump = |c: u16| {
                let r = ready.entry(c).or_insert(0);
                *r = (*r).max(done);
            };
            bump(ins.signal);
        }

        let mut ops = Vec::new();
        for op in [Op::Qkv, Op::Attn, Op::OProj, Op::Mlp, Op::LmHead] {
            let (mut count, mut wait, mut busy, mut handoffs, mut handoff) = (0, 0u64, 0u64, 0usize, 0u64);
            for (i, ins) in instrs.iter().enumerate().filter(|(_, ins)| ins.op == op) {
                let w = &stamps[3 * i..3 * i + 3];
                count += 1;
                wait += w[1] - w[0];
                busy += w[2] - w[1];
                if let Some(&r) = ready.get(&ins.wait.counter) {
                    if r > w[0] && w[1] >= r {
                        handoffs += 1;
                        handoff += w[1] - r;
                    }
                }
            }
            if count > 0 {
                let mean = |t: u64, k: usize| if k == 0 { 0.0 } else { us(t) / k as f64 };
                ops.push(OpTimes { op, count, wait_us: mean(wait, count), busy_us: mean(busy, count), handoff_us: mean(handoff, handoffs) });
            }
        }

        // Layer l ends when its last MLP tile is done.
        let layers = schedule.counters.layers;
        let mut layer_end = vec![0u64; layers];
        for (i, ins) in instrs.iter().enumerate().filter(|(_, ins)| ins.op == Op::Mlp) {
            let l = ins.layer as usize;
            layer_end[l] = layer_end[l].max(stamps[3 * i + 2]);
        }
        let layer_us = if layers > 0 { us(layer_end[layers - 1].saturating_sub(start)) / layers as f64 } else { 0.0 };

        // One op of one layer (the LM head: layer `layers`) relative to `origin`.
        let phase = |op: Op, layer: usize, origin: u64| -> Option<Phase> {
            let rel = |ns: u64| (ns as f64 - origin as f64) / 1e3;
            let these: Vec<_> = instrs.iter().enumerate().filter(|(_, ins)| ins.op == op && ins.layer as usize == layer).collect();
            let (_, first) = these.first()?;
            let ready = ready.get(&first.wait.counter).copied().unwrap_or(origin);
            let (first_end, _, last_end) = first_mean_last(these.iter().map(|(i, _)| rel(stamps[3 * i + 1])))?;
            let done_us = first_mean_last(these.iter().map(|(i, _)| rel(stamps[3 * i + 2])))?;
            Some(Phase { op, layer, ready_us: rel(ready), start_us: (first_end, last_end), done_us })
        };
        let mid = layers / 2;
        let origin = if mid == 0 { start } else { layer_end[mid - 1] };
        let timeline = Op::LAYER_OPS.iter().filter_map(|&op| phase(op, mid, origin)).collect();
        let lm_origin = layer_end.last().copied().unwrap_or(start);
        let lm_head = phase(Op::LmHead, layers, lm_origin);
        let rel = |ns: u64| (ns as f64 - origin as f64) / 1e3;
        let used: Vec<usize> = (0..n)
            .filter(|&i| instrs[i].op == Op::Attn && instrs[i].layer as usize == mid && inside[3 * i] != 0)
            .collect();
        let latest = |f: &dyn Fn(usize) -> u64| used.iter().map(|&i| rel(f(i))).fold(f64::MIN, f64::max);
        let attention = (!used.is_empty()).then(|| AttentionInside {
            used: used.len(),
            wait_end_us: latest(&|i| stamps[3 * i + 1]),
            q_ready_us: latest(&|i| inside[3 * i]),
            loop_done_us: latest(&|i| inside[3 * i + 1]),
            stored_us: latest(&|i| inside[3 * i + 2]),
            done_us: latest(&|i| stamps[3 * i + 2]),
        });
        let lm_rel = |ns: u64| (ns as f64 - lm_origin as f64) / 1e3;
        let lm: Vec<usize> = (0..n).filter(|&i| instrs[i].op == Op::LmHead).collect();
        let spread = |word: usize| first_mean_last(lm.iter().map(|&i| inside[3 * i + word]).filter(|&w| w != 0).map(lm_rel));
        let picked: Vec<u64> = lm.iter().map(|&i| inside[3 * i + 2]).filter(|&w| w != 0).collect();
        // The merge runs between the last part and the pick, its phases in order.
        let merge_in_order = |picked: u64| merge.windows(2).all(|w| w[0] <= w[1]) && merge.last().is_none_or(|&m| m <= picked);
        let lm_head_inside = match (spread(0), spread(1), picked.as_slice()) {
            (Some(_), Some(_), &[picked]) if !merge_in_order(picked) => {
                return Err(RocketError::Internal(format!("the merge's stamps {merge:?} are out of order or after the pick ({picked})")))
            }
            (Some(tiles_done_us), Some(parts_done_us), &[picked]) => Some(LmHeadInside {
                tiles_done_us,
                parts_done_us,
                picked_us: lm_rel(picked),
                merge_us: merge.iter().map(|&m| lm_rel(m)).collect(),
                part_phases_us: (0..PART_STAMPS)
                    .map_while(|k| first_mean_last(parts.iter().map(|w| w[k]).filter(|&w| w != 0).map(lm_rel)))
                    .collect(),
            }),
            (None, None, []) => None,
            _ => return Err(RocketError::Internal(format!("the LM head's inside stamps are incomplete ({} picks)", picked.len()))),
        };
        Ok(Profile { step_us: us(end.saturating_sub(start)), layer_us, ops, timeline, lm_head, attention, lm_head_inside })
    }
}

/// The smallest, mean and largest of `values`; None when there are none.
fn first_mean_last(values: impl Iterator<Item = f64>) -> Option<(f64, f64, f64)> {
    let (mut lo, mut sum, mut hi, mut count) = (f64::INFINITY, 0.0, f64::NEG_INFINITY, 0usize);
    for v in values {
        (lo, hi, sum, count) = (lo.min(v), hi.max(v), sum + v, count + 1);
    }
    (count > 0).then(|| (lo, sum / count as f64, hi))
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "step {:.1} µs, {:.1} µs per layer", self.step_us, self.layer_us)?;
        writeln!(f, "| op | instructions | wait µs | busy µs | hand-off µs |")?;
        writeln!(f, "|:--|--:|--:|--:|--:|")?;
        for o in &self.ops {
            writeln!(f, "| {:?} | {} | {:.2} | {:.2} | {:.2} |", o.op, o.count, o.wait_us, o.busy_us, o.handoff_us)?;
        }
        if let Some(first) = self.timeline.first() {
            writeln!(f, "layer {} timeline, µs from its input being ready (LmHead: from the last layer's end):", first.layer)?;
            writeln!(f, "| op | dependency ready | waits end (first..last) | done (first / mean / last) |")?;
            writeln!(f, "|:--|--:|--:|--:|")?;
            for p in self.timeline.iter().chain(&self.lm_head) {
                let (s, d) = (p.start_us, p.done_us);
                writeln!(f, "| {:?} | {:.2} | {:.2}..{:.2} | {:.2} / {:.2} / {:.2} |", p.op, p.ready_us, s.0, s.1, d.0, d.1, d.2)?;
            }
        }
        if let Some(a) = &self.attention {
            writeln!(
                f,
                "inside its {} used attention splits (latest, same clock): wait ends {:.2}, q ready {:.2}, positions done {:.2}, partial stored {:.2}, done (released) {:.2}",
                a.used, a.wait_end_us, a.q_ready_us, a.loop_done_us, a.stored_us, a.done_us
            )?;
        }
        if let Some(l) = &self.lm_head_inside {
            let (t, p) = (l.tiles_done_us, l.parts_done_us);
            writeln!(
                f,
                "inside the LM head (from the last layer's end; first / mean / last SM): tiles done {:.2} / {:.2} / {:.2}, parts done {:.2} / {:.2} / {:.2}, token picked {:.2}",
                t.0, t.1, t.2, p.0, p.1, p.2, l.picked_us
            )?;
            if !l.part_phases_us.is_empty() {
                let phases: Vec<String> = l.part_phases_us.iter().map(|p| format!("{:.2} / {:.2} / {:.2}", p.0, p.1, p.2)).collect();
                writeln!(f, "the SMs' sampler parts' phases end at (first / mean / last SM): {}", phases.join(", "))?;
            }
            if !l.merge_us.is_empty() {
                let phases: Vec<String> = l.merge_us.iter().map(|m| format!("{m:.2}")).collect();
                writeln!(f, "the merge's phases end at (same clock): {}", phases.join(" / "))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::megakernel::verify::tests::spec;

    fn small_schedule() -> Schedule {
        Schedule::compile(&spec(64, 128, 2, 4, 2, 64, 300), 3).unwrap()
    }

    /// A synthetic trace: every instruction waits 1 µs and works 2 µs, one after another.
    fn serial_trace(s: &Schedule) -> Vec<u64> {
        let n = s.len();
        let mut stamps = vec![0u64; trace_words(s)];
        let mut t = 10_000u64;
        for sm in 0..s.sm_count {
            stamps[3 * n + 2 * sm] = 9_000;
            stamps[3 * n + 2 * sm + 1] = 10_000;
        }
        for i in 0..n {
            stamps[3 * i] = t;
            stamps[3 * i + 1] = t + 1_000;
            stamps[3 * i + 2] = t + 3_000;
            t += 3_000;
        }
        stamps
    }

    #[test]
    fn a_serial_trace_adds_up() {
        let s = small_schedule();
        let p = Profile::from_trace(&s, &serial_trace(&s)).unwrap();
        assert!((p.step_us - 3.0 * s.len() as f64).abs() < 1e-9, "{p}");
        assert_eq!(p.ops.iter().map(|o| o.count).sum::<usize>(), s.len());
        assert!(p.ops.iter().all(|o| (o.wait_us - 1.0).abs() < 1e-9 && (o.busy_us - 2.0).abs() < 1e-9));
        assert!(p.layer_us > 0.0 && p.layer_us <= p.step_us);
        assert!(p.to_string().contains("| Qkv |"));
        // Layer 1 of 2 on the timeline: its Qkv's dependency is layer 0's last Mlp.
        assert_eq!(p.timeline.len(), Op::LAYER_OPS.len());
        assert_eq!((p.timeline[0].op, p.timeline[0].layer, p.timeline[0].ready_us), (Op::Qkv, 1, 0.0));
        assert!(p.timeline.windows(2).all(|w| w[0].done_us.2 <= w[1].ready_us + 1e-9), "{p}");
        assert!(p.to_string().contains("layer 1 timeline"));
        assert!(p.attention.is_none(), "no attention stamps, no used splits");

        // One used split of layer 1 stamps its inside: q, loop, partial.
        let mut t = serial_trace(&s);
        let (n, sms) = (s.len(), s.sm_count);
        let i = s.per_sm.iter().flatten().position(|i| i.op == Op::Attn && i.layer == 1).unwrap();
        for k in 0..3 {
            t[3 * n + 2 * sms + 3 * i + k] = t[3 * i + 1] + 100 * (k as u64 + 1);
        }
        let a = Profile::from_trace(&s, &t).unwrap().attention.expect("a used split");
        assert_eq!(a.used, 1);
        assert!(a.wait_end_us < a.q_ready_us && a.q_ready_us < a.loop_done_us && a.loop_done_us < a.stored_us && a.stored_us < a.done_us, "{a:?}");
    }

    #[test]
    fn the_lm_heads_inside_stamps_show_parts_and_merge() {
        let s = small_schedule();
        let (n, sms) = (s.len(), s.sm_count);
        let instrs: Vec<_> = s.per_sm.iter().flatten().collect();
        let lm: Vec<usize> = (0..n).filter(|&i| instrs[i].op == Op::LmHead).collect();
        assert!(lm.len() >= 2, "one LM-head instruction per SM");
        let mut t = serial_trace(&s);
        assert!(Profile::from_trace(&s, &t).unwrap().lm_head_inside.is_none(), "no stamps, nothing inside");
        // The last layer ends at the latest Mlp's done.
        let mlp_end = (0..n).filter(|&i| instrs[i].op == Op::Mlp).map(|i| t[3 * i + 2]).max().unwrap();
        for (k, &i) in lm.iter().enumerate() {
            let base = 3 * n + 2 * sms + 3 * i;
            t[base] = mlp_end + 1_000 + 1_000 * k as u64; // tiles done 1, 2, ... µs after
            t[base + 1] = t[base] + 500;
        }
        // The last instruction's SM picks.
        let last = *lm.last().unwrap();
        t[3 * n + 2 * sms + 3 * last + 2] = t[3 * n + 2 * sms + 3 * last + 1] + 2_000;
        let inside = Profile::from_trace(&s, &t).unwrap().lm_head_inside.expect("stamped");
        let m = lm.len() as f64;
        assert!((inside.tiles_done_us.0 - 1.0).abs() < 1e-9 && (inside.tiles_done_us.2 - m).abs() < 1e-9, "{inside:?}");
        assert!((inside.tiles_done_us.1 - (m + 1.0) / 2.0).abs() < 1e-9, "{inside:?}");
        assert!((inside.parts_done_us.2 - (m + 0.5)).abs() < 1e-9 && (inside.picked_us - (m + 2.5)).abs() < 1e-9, "{inside:?}");
        assert!(Profile::from_trace(&s, &t).unwrap().to_string().contains("token picked"));
        assert!(inside.merge_us.is_empty(), "no merge stamps: a greedy step");
        // The merge's phases, between the last part and the pick; out of order, or after the pick, is an error.
        let merge_at = 6 * n + 2 * sms;
        let parts_done = t[3 * n + 2 * sms + 3 * last + 1];
        for k in 0..3 {
            t[merge_at + k] = parts_done + 500 * (k as u64 + 1);
        }
        let phased = Profile::from_trace(&s, &t).unwrap();
        let merge = &phased.lm_head_inside.as_ref().unwrap().merge_us;
        assert_eq!(merge.len(), 3, "{merge:?}");
        assert!((merge[0] - (m + 1.0)).abs() < 1e-9 && (merge[2] - (m + 2.0)).abs() < 1e-9, "{merge:?}");
        assert!(phased.to_string().contains("the merge's phases"));
        // Every SM's part stamps two phases; one SM's out of order is an error.
        for sm in 0..sms {
            let at = merge_at + MERGE_STAMPS + PART_STAMPS * sm;
            t[at] = parts_done - 400 + 10 * sm as u64;
            t[at + 1] = parts_done - 200 + 10 * sm as u64;
        }
        let with_parts = Profile::from_trace(&s, &t).unwrap();
        let phases = &with_parts.lm_head_inside.as_ref().unwrap().part_phases_us;
        assert_eq!(phases.len(), 2, "{phases:?}");
        assert!(phases[0].0 < phases[0].2 && phases[0].2 < phases[1].2, "{phases:?}");
        assert!(with_parts.to_string().contains("sampler parts' phases"));
        let mut swapped = t.clone();
        swapped.swap(merge_at + MERGE_STAMPS, merge_at + MERGE_STAMPS + 1);
        assert!(Profile::from_trace(&s, &swapped).is_err());
        let mut disordered = t.clone();
        disordered.swap(merge_at, merge_at + 2);
        assert!(Profile::from_trace(&s, &disordered).is_err());
        let mut late = t.clone();
        late[merge_at + 2] = t[3 * n + 2 * sms + 3 * last + 2] + 1;
        assert!(Profile::from_trace(&s, &late).is_err());
        for k in 0..3 {
            t[merge_at + k] = 0;
        }
        // Two SMs claiming the pick, or none, is not a whole step.
        let mut two = t.clone();
        two[3 * n + 2 * sms + 3 * lm[0] + 2] = two[3 * n + 2 * sms + 3 * lm[0] + 1] + 1;
        assert!(Profile::from_trace(&s, &two).is_err());
        let mut none = t.clone();
        none[3 * n + 2 * sms + 3 * last + 2] = 0;
        assert!(Profile::from_trace(&s, &none).is_err());
    }

    #[test]
    fn missing_or_disordered_stamps_are_errors() {
        let s = small_schedule();
        let mut t = serial_trace(&s);
        t[4] = 0; // instruction 1 never stamped its wait's end... and is now out of order
        assert!(Profile::from_trace(&s, &t).is_err());
        let t = serial_trace(&s);
        assert!(Profile::from_trace(&s, &t[1..]).is_err());
        let mut t = serial_trace(&s);
        let n = s.len();
        t[3 * n] = 0;
        assert!(Profile::from_trace(&s, &t).is_err());
    }
}

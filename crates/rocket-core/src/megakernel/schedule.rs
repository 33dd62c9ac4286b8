//! The static schedule of one decode step: rocket-core compiles a model into a
//! list of instructions per SM, each waiting on one dependency counter and
//! bumping another. Counters only grow: an instruction of step `t` waits until
//! its counter reaches `(t + 1) * per_step`, so nothing is reset between steps
//! (the host zeroes them once per launch).
//!
//! Per layer, four ops run in this order, each split into tiles over the SMs:
//! `Qkv` (RMSNorm + fused q|k|v rows), `Attn` (q/k-norm + RoPE + KV append +
//! attention over one split of the context, for one KV head), `OProj` (merge of
//! the splits' partials + rows + residual), `Mlp` (RMSNorm + gate and up rows +
//! SiLU·mul, then those act values times the same columns of the
//! down-projection, added to the residual: the down-projection is split by its
//! input, so it needs no phase of its own); then `LmHead` (final RMSNorm +
//! vocabulary rows + argmax), which every SM runs over the tiles it claims at
//! run time (`Work::Claimed`: a static split ends with the SM that gets the least
//! memory bandwidth, ~20 µs after the rest on the H200); the last SM to finish
//! picks the token and writes the next step's embedding. Every SM's list follows
//! this global order, which is what makes the schedule deadlock-free (see `verify`).
//!
//! A schedule serves `slots` sequences at once (batches in the persistent loop):
//! each matrix tile computes its rows for every running slot, so a step streams
//! the weights once whatever the batch; attention has items per (slot, KV head,
//! split), and the LM head picks one token per slot. Nothing that decides a
//! sequence's arithmetic depends on `slots`: the row tiles (an MLP tile's
//! down-projection partial is a sum over its rows, so its rounding follows the
//! tile's bounds) and the context splits per KV head are those of one sequence.
//! So a sequence's tokens do not change with what else runs (batch invariance),
//! and a kernel serving B slots needs B partial sums per row where the one-slot
//! kernel keeps one (`MAX_BATCH_SLOTS`). The GPU kernel runs one slot today (its
//! host refuses a batched schedule); the CPU twin runs any number.

use super::abi::{OP_ATTN, OP_LMHEAD, OP_MLP, OP_OPROJ, OP_QKV, STEP_COUNTER};
use super::geometry::{MatvecShape, MAX_SPLITS, PART_CAP};
use crate::error::{Result, RocketError};
use crate::model::ModelSpec;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Op {
    Qkv = OP_QKV as u8,
    Attn = OP_ATTN as u8,
    OProj = OP_OPROJ as u8,
    /// Rows of gate and up (act rows), and the down-projection's columns.
    Mlp = OP_MLP as u8,
    LmHead = OP_LMHEAD as u8,
}

impl Op {
    pub const LAYER_OPS: [Op; 4] = [Op::Qkv, Op::Attn, Op::OProj, Op::Mlp];
}

/// Wait until `counter >= (step + 1) * per_step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    pub counter: u16,
    pub per_step: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// Output rows `begin..end` of the op's matrix; `tile` numbers the op's tiles
    /// (the LM head keeps one argmax per tile).
    Rows { begin: u32, end: u32, tile: u32 },
    /// Split `split` of `splits` over slot `slot`'s context, for the query
    /// heads of `kv_head`: its partial (max, sum, weighted values), which every
    /// `OProj` tile merges as it loads its input.
    Attn { slot: u32, kv_head: u32, split: u32, splits: u32 },
    /// Tiles of `tile_rows` rows (the last may be shorter), `tiles` of them,
    /// handed out at run time by counter `claims`: the SM's weight stream claims
    /// one tile after another until none is left (kernels/src/megakernel.cu
    /// `WeightStream`). Every SM runs the op once per step and signals once.
    Claimed { tile_rows: u32, tiles: u32, claims: u16 },
}

/// Sequences one schedule serves at most. Tiles are sized for one slot's
/// partial sums (`tile_count`), so a kernel serving more slots runs a tile's
/// rows slot after slot in that space (or keeps the others elsewhere): what
/// it may not do is change the tiles, which would change a sequence's bits.
pub const MAX_BATCH_SLOTS: usize = 64;

/// Ring chunks in one claimed LM-head tile: small enough that the SMs finish
/// within about a tile of each other, large enough that the per-tile barrier
/// and the claim's round trip stay hidden behind the stream (the ring holds 3).
pub const LM_TILE_CHUNKS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Instr {
    pub op: Op,
    pub layer: u16,
    /// Counter bumped once when the instruction is done.
    pub signal: u16,
    pub wait: Wait,
    pub work: Work,
}

/// Where each dependency counter lives in the counter array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    pub layers: usize,
}

impl Counters {
    /// Steps whose input embedding is in place: `t + 1` once step `t` may start.
    pub const STEP: u16 = STEP_COUNTER as u16;

    fn base(&self, layer: usize) -> usize {
        1 + layer * Op::LAYER_OPS.len()
    }

    /// Tiles of `op` finished in `layer` (for `Attn`: splits, of every KV head).
    pub fn op(&self, op: Op, layer: usize) -> u16 {
        let slot = match op {
            Op::Qkv => 0,
            Op::Attn => 1, // splits done (of every KV head)
            Op::OProj => 2,
            Op::Mlp => 3,
            Op::LmHead => return self.lm_head(),
        };
        (self.base(layer) + slot) as u16
    }

    pub fn lm_head(&self) -> u16 {
        self.base(self.layers) as u16
    }

    /// Claims of LM-head tiles: step `t` takes claims `t (tiles + SMs)` up to
    /// `(t + 1) (tiles + SMs)`, one per tile and one that draws past them per SM.
    pub fn lm_claims(&self) -> u16 {
        (self.base(self.layers) + 1) as u16
    }

    pub fn count(&self) -> usize {
        self.base(self.layers) + 2
    }
}

#[derive(Debug, Clone)]
pub struct Schedule {
    pub sm_count: usize,
    /// Instructions of each SM, in execution order.
    pub per_sm: Vec<Vec<Instr>>,
    pub counters: Counters,
    /// Context splits per KV head and slot in every attention op.
    pub splits: usize,
    /// LM-head arrivals per step, one per SM, each with the SM's argmax over
    /// the tiles it claimed (the argmax partials the last one reduces).
    pub lm_tiles: usize,
    /// Sequences each step serves (slots of the batch).
    pub batch_slots: usize,
}

/// The rows a matrix-vector op covers, and the partial sums each row keeps.
struct MatvecOp {
    op: Op,
    rows: usize,
    /// Partial sums per row in shared memory (segments, twice for gate|up).
    parts_per_row: usize,
}

/// Tiles for `rows` rows over `sm_count` SMs: one per SM, or where a tile's
/// partial sums would not fit in shared memory, the next multiple of the SM
/// count (an op lasts as long as its busiest SM: 149 tiles on 132 SMs would give
/// 17 SMs twice the rows of the others); never an empty one.
fn tile_count(rows: usize, parts_per_row: usize, sm_count: usize) -> usize {
    let needed = (rows * parts_per_row).div_ceil(PART_CAP);
    (needed.div_ceil(sm_count).max(1) * sm_count).min(rows)
}

impl Schedule {
    /// The schedule for one sequence of `spec` on `sm_count` SMs.
    pub fn compile(spec: &ModelSpec, sm_count: usize) -> Result<Self> {
        Self::compile_with_lm_tiles(spec, sm_count, LM_TILE_CHUNKS)
    }

    /// The schedule for up to `slots` sequences per step.
    pub fn compile_batched(spec: &ModelSpec, sm_count: usize, slots: usize) -> Result<Self> {
        Self::compile_full(spec, sm_count, LM_TILE_CHUNKS, slots)
    }

    /// One sequence with LM-head tiles of `lm_tile_chunks` ring chunks (fewer
    /// where two tiles' partial sums would not fit the CTA).
    pub fn compile_with_lm_tiles(spec: &ModelSpec, sm_count: usize, lm_tile_chunks: usize) -> Result<Self> {
        Self::compile_full(spec, sm_count, lm_tile_chunks, 1)
    }

    fn compile_full(spec: &ModelSpec, sm_count: usize, lm_tile_chunks: usize, slots: usize) -> Result<Self> {
        if sm_count == 0 {
            return Err(RocketError::invalid_arg("sm_count", 0, "must be at least 1"));
        }
        if lm_tile_chunks == 0 {
            return Err(RocketError::invalid_arg("lm_tile_chunks", 0, "must be at least 1"));
        }
        if !(1..=MAX_BATCH_SLOTS).contains(&slots) {
            return Err(RocketError::invalid_arg("batch slots", slots, format!("must be in [1, {MAX_BATCH_SLOTS}]")));
        }
        if let Some(why) = super::geometry::unsupported_reason(spec) {
            return Err(RocketError::Device(format!("no megakernel schedule: {why}")));
        }
        let (d, ff, hkv, nl) = (spec.hidden_size, spec.intermediate_size, spec.num_kv_heads, spec.num_layers);
        let counters = Counters { layers: nl };
        if counters.count() > u16::MAX as usize {
            return Err(RocketError::Device(format!("{nl} layers need more dependency counters than the encoding holds")));
        }
        let segments = |k: usize| MatvecShape::of(k).expect("checked by unsupported_reason").segments;
        let qkv_rows = spec.q_dim() + 2 * spec.kv_dim();
        let matvec = |op: Op| -> MatvecOp {
            match op {
                Op::Qkv => MatvecOp { op, rows: qkv_rows, parts_per_row: segments(d) },
                Op::OProj => MatvecOp { op, rows: d, parts_per_row: segments(spec.q_dim()) },
                Op::Mlp => MatvecOp { op, rows: ff, parts_per_row: 2 * segments(d) },
                Op::LmHead => unreachable!("the LM head's tiles are claimed (Work::Claimed), not placed"),
                Op::Attn => unreachable!("attention is not a matrix-vector op"),
            }
        };
        let tiles_of = |m: &MatvecOp| tile_count(m.rows, m.parts_per_row, sm_count);
        let splits = (sm_count / hkv).clamp(1, MAX_SPLITS);
        let per_step = |n: usize| -> Result<u16> {
            u16::try_from(n).map_err(|_| RocketError::Device(format!("{n} tiles in one op exceed the schedule encoding")))
        };

        let mut per_sm: Vec<Vec<Instr>> = vec![Vec::new(); sm_count];
        // Round-robin placement; each op starts where the last one ended, so
        // SMs left idle by a small op are the first to get the next one.
        let mut next_sm = 0usize;
        let mut place = |instr: Instr| {
            per_sm[next_sm].push(instr);
            next_sm = (next_sm + 1) % sm_count;
        };
        let push_matvec = |m: &MatvecOp, layer: usize, wait: Wait, place: &mut dyn FnMut(Instr)| -> Result<usize> {
            let tiles = tiles_of(m);
            for tile in 0..tiles {
                let (begin, end) = (m.rows * tile / tiles, m.rows * (tile + 1) / tiles);
                debug_assert!((end - begin) * m.parts_per_row <= PART_CAP);
                place(Instr {
                    op: m.op,
                    layer: layer as u16,
                    signal: counters.op(m.op, layer),
                    wait,
                    work: Work::Rows { begin: begin as u32, end: end as u32, tile: tile as u32 },
                });
            }
            Ok(tiles)
        };

        let mut prev = Wait { counter: Counters::STEP, per_step: 1 };
        for layer in 0..nl {
            let qkv_tiles = push_matvec(&matvec(Op::Qkv), layer, prev, &mut place)?;
            let after_qkv = Wait { counter: counters.op(Op::Qkv, layer), per_step: per_step(qkv_tiles)? };
            for slot in 0..slots {
                for kv_head in 0..hkv {
                    for split in 0..splits {
                        place(Instr {
                            op: Op::Attn,
                            layer: layer as u16,
                            signal: counters.op(Op::Attn, layer),
                            wait: after_qkv,
                            work: Work::Attn { slot: slot as u32, kv_head: kv_head as u32, split: split as u32, splits: splits as u32 },
                        });
                    }
                }
            }
            let after_attn = Wait { counter: counters.op(Op::Attn, layer), per_step: per_step(slots * hkv * splits)? };
            let o_tiles = push_matvec(&matvec(Op::OProj), layer, after_attn, &mut place)?;
            let after_o = Wait { counter: counters.op(Op::OProj, layer), per_step: per_step(o_tiles)? };
            let mlp_tiles = push_matvec(&matvec(Op::Mlp), layer, after_o, &mut place)?;
            prev = Wait { counter: counters.op(Op::Mlp, layer), per_step: per_step(mlp_tiles)? };
        }
        let shape = MatvecShape::of(d).expect("checked by unsupported_reason");
        // The consumers keep two tiles' partial sums (kernels/src/megakernel.cu `lm_head`).
        let tile_rows = (shape.rows * lm_tile_chunks).min(PART_CAP / (2 * shape.segments));
        let tiles = u32::try_from(spec.vocab_size.div_ceil(tile_rows))
            .map_err(|_| RocketError::Device(format!("a vocabulary of {} rows exceeds the schedule encoding", spec.vocab_size)))?;
        let work = Work::Claimed { tile_rows: tile_rows as u32, tiles, claims: counters.lm_claims() };
        per_step(sm_count)?;
        for list in &mut per_sm {
            list.push(Instr { op: Op::LmHead, layer: nl as u16, signal: counters.lm_head(), wait: prev, work });
        }
        Ok(Schedule { sm_count, per_sm, counters, splits, lm_tiles: sm_count, batch_slots: slots })
    }

    /// The device form: every SM's encoded instructions back to back, and where
    /// each SM's list starts (in instructions; `sm_count + 1` entries).
    pub fn encode(&self) -> (Vec<u32>, Vec<u32>) {
        use super::abi::INSTR_WORDS;
        let mut words = Vec::with_capacity(self.len() * INSTR_WORDS);
        let mut starts = Vec::with_capacity(self.sm_count + 1);
        for list in &self.per_sm {
            starts.push((words.len() / INSTR_WORDS) as u32);
            for instr in list {
                words.extend(instr.encode());
            }
        }
        starts.push((words.len() / INSTR_WORDS) as u32);
        (words, starts)
    }

    /// Instructions in the whole schedule.
    pub fn len(&self) -> usize {
        self.per_sm.iter().map(Vec::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_come_in_whole_rounds_of_the_sm_count() {
        // Qwen3-1.7B's vocabulary as rows of 2 segments: 149 tiles of PART_CAP needed.
        assert_eq!(tile_count(151_936, 2, 132), 264);
        assert_eq!(tile_count(128_256, 2, 132), 132);
        assert_eq!(tile_count(3072, 2, 132), 132);
        assert_eq!(tile_count(5, 1, 132), 5); // never an empty tile
        for (rows, parts, sms) in [(151_936, 2, 132), (49_152, 1, 100), (8192, 4, 7)] {
            let t = tile_count(rows, parts, sms);
            assert_eq!(t % sms, 0, "{rows} rows on {sms} SMs: {t} tiles");
            assert!(rows.div_ceil(t) * parts <= PART_CAP, "{rows} rows in {t} tiles overflow the partial sums");
        }
    }

    #[test]
    fn counters_are_distinct() {
        let c = Counters { layers: 3 };
        let mut all = vec![Counters::STEP, c.lm_head(), c.lm_claims()];
        for l in 0..3 {
            for op in Op::LAYER_OPS {
                all.push(c.op(op, l));
            }
        }
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
        assert_eq!(c.count(), n);
        assert!(all.iter().all(|&x| (x as usize) < c.count()));
    }
}

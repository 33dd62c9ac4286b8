//! The megakernel's CPU twin: runs a [`Schedule`] the way the GPU kernel does,
//! one thread per virtual SM, each executing its instruction list in order and
//! waiting on the same dependency counters, with every instruction body in f32
//! on the CPU reference's arithmetic. It checks what the schedule means (tiles,
//! waits, attention splits and the O-proj merge of their partials, the token loop, masking,
//! teacher forcing, stopping) against the reference backend with no GPU at hand.
//!
//! It also runs batched schedules the way a batched kernel would: a slot table
//! that the last SM of each step updates (requests that end leave their slot,
//! requests the host posted join at the step boundary), per-slot buffers, and
//! a paged KV cache the slots share. That is the contract for batches in the
//! persistent loop, checked here before the GPU kernel serves more than one slot.
//!
//! Shared buffers are atomics holding f32 bits, poisoned with NaN, so a read of
//! something no instruction wrote shows up in the results instead of racing.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::geometry::used_splits;
use super::schedule::{Counters, Instr, Op, Schedule, Work};
use crate::backend::cpu::linalg::{matvec_rows, rms_norm, rms_norm_in_place, silu};
use crate::error::{Result, RocketError};
use crate::model::{rope, ModelSpec, ModelWeights};

/// f32 values shared between the virtual SMs.
struct F32s(Vec<AtomicU32>);

impl F32s {
    /// `n` NaNs: nothing reads a value no instruction wrote without noticing.
    fn poisoned(n: usize) -> Self {
        F32s((0..n).map(|_| AtomicU32::new(f32::NAN.to_bits())).collect())
    }

    /// Every value NaN again.
    fn poison(&self) {
        self.0.iter().for_each(|v| v.store(f32::NAN.to_bits(), Ordering::Relaxed));
    }

    fn get(&self, i: usize) -> f32 {
        f32::from_bits(self.0[i].load(Ordering::Relaxed))
    }

    fn set(&self, i: usize, v: f32) {
        self.0[i].store(v.to_bits(), Ordering::Relaxed)
    }

    fn read(&self, start: usize, n: usize) -> Vec<f32> {
        (start..start + n).map(|i| self.get(i)).collect()
    }

    fn write(&self, start: usize, v: &[f32]) {
        for (i, &x) in v.iter().enumerate() {
            self.set(start + i, x);
        }
    }
}

/// The MLP's down-projection sums, as the kernel keeps them (kernels/src/
/// mk_matvec.cuh `to_fixed`): 64-bit fixed point with 32 fractional bits, added
/// with integer atomics, so their sum does not depend on the virtual SMs' order.
struct FixedSums(Vec<AtomicI64>);

const FIXED_ONE: f32 = 4_294_967_296.0; // 2^32

impl FixedSums {
    /// Huge values until written (as the kernel's poisoned buffer): a read of
    /// sums nothing zeroed shows up in the results.
    fn poisoned(n: usize) -> Self {
        FixedSums((0..n).map(|_| AtomicI64::new(0x7f7f_7f7f_7f7f_7f7f)).collect())
    }

    fn get(&self, i: usize) -> f32 {
        self.0[i].load(Ordering::Relaxed) as f32 / FIXED_ONE
    }

    fn add(&self, i: usize, v: f32) {
        // As the kernel's cvt.rni: to the nearest integer (ties to even),
        // saturating, NaN to 0.
        self.0[i].fetch_add((v * FIXED_ONE).round_ties_even() as i64, Ordering::Relaxed);
    }

    fn zero(&self, i: usize) {
        self.0[i].store(0, Ordering::Relaxed)
    }
}

/// The KV cache the slots share: pages of `page_positions` positions, each laid
/// out as the GPU's ([position][layer][k | v][kv_dim]) but in f32. A request
/// reaches its positions through its page table (position p lives in page
/// `pages[p / page_positions]`). Positions before a request's `pos0` must have
/// been written by earlier runs.
pub struct TwinKv {
    data: F32s,
    pages: usize,
    page_positions: usize,
    /// f32 values per position (every layer's K and V).
    per_position: usize,
}

impl TwinKv {
    /// One sequence's cache: a single page of `capacity` positions.
    pub fn new(spec: &ModelSpec, capacity: usize) -> Self {
        Self::paged(spec, 1, capacity)
    }

    /// `pages` pages of `page_positions` positions, for requests to take by page table.
    pub fn paged(spec: &ModelSpec, pages: usize, page_positions: usize) -> Self {
        let per_position = spec.num_layers * 2 * spec.kv_dim();
        TwinKv { data: F32s::poisoned(pages * page_positions * per_position), pages, page_positions, per_position }
    }

    /// Where (position `p`, `layer`, K or V) of the request with page table
    /// `pages` starts.
    fn at(&self, pages: &[u32], p: usize, layer: usize, which: usize, kv_dim: usize) -> usize {
        let position = pages[p / self.page_positions] as usize * self.page_positions + p % self.page_positions;
        position * self.per_position + (layer * 2 + which) * kv_dim
    }
}

/// One request's run through the token loop.
#[derive(Clone, Copy)]
pub struct TwinRequest<'a> {
    /// Position of `first_token` (the cache holds positions `0..pos0`).
    pub pos0: usize,
    pub first_token: u32,
    /// Steps (tokens fed) at most.
    pub max_steps: usize,
    /// Teacher forcing: step `t < forced.len()` feeds `forced[t]` next instead
    /// of its argmax; later steps feed their argmax.
    pub forced: &'a [u32],
    /// Tokens that end a free-running loop (EOS, stop ids).
    pub end_ids: &'a [u32],
    /// Steps `t < mask_end_steps` cannot pick an end id (min_tokens).
    pub mask_end_steps: usize,
}

/// A request the host hands a running loop: it takes batch slot `slot` when it
/// joins (its first token embedded at a step boundary, as the kernel's last SM
/// admits the host's posted requests), its cache positions in `pages` of the
/// shared [`TwinKv`]. The slot must be free by then, and no running request may
/// hold one of its pages.
#[derive(Clone, Copy)]
pub struct TwinAdmission<'a> {
    pub request: TwinRequest<'a>,
    pub slot: usize,
    pub pages: &'a [u32],
    pub join: Join,
}

/// When an admission joins the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// At the boundary before this step of the launch.
    AtStep(usize),
    /// At the first boundary after the host posts it (`TwinHost::post`, from
    /// `on_token`, as a host would on seeing a token) while the loop runs.
    Posted,
}

/// What `on_token` may do besides watching: post admissions, and see the launch's step.
pub struct TwinHost<'r> {
    admissions: &'r [TwinAdmission<'r>],
    posted: &'r [AtomicBool],
    step: u32,
}

impl TwinHost<'_> {
    /// Posts admission `i` (a `Join::Posted` one, once): it joins at the next step boundary.
    pub fn post(&self, i: usize) -> std::result::Result<(), String> {
        match self.admissions.get(i).map(|a| a.join) {
            Some(Join::Posted) if !self.posted[i].swap(true, Ordering::AcqRel) => Ok(()),
            Some(Join::Posted) => Err(format!("admission {i} was posted already")),
            Some(Join::AtStep(t)) => Err(format!("admission {i} joins at step {t}, not when posted")),
            None => Err(format!("no admission {i}")),
        }
    }

    /// The launch step whose tokens are being picked.
    pub fn launch_step(&self) -> usize {
        self.step as usize
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TwinOutput {
    /// The argmax of every step that ran.
    pub tokens: Vec<u32>,
    /// Logits of every step that ran, [steps][vocab].
    pub logits: Vec<f32>,
}

pub struct Twin<'w> {
    spec: &'w ModelSpec,
    weights: &'w ModelWeights,
    schedule: Schedule,
    inv_freq: Vec<f32>,
    /// How long an SM may wait on one counter before the run is declared stuck.
    pub watchdog: Duration,
}

/// What one batch slot's sequence keeps between instructions (per slot, as
/// the kernel's buffers would be).
struct SlotBuffers {
    x: F32s,
    qkv: F32s,
    mlp_acc: FixedSums,
    /// [q head][split][head_dim] and [q head][split][max, sum].
    part_o: F32s,
    part_ml: F32s,
    /// Each SM's argmax over the LM-head tiles it claimed.
    lm_max: F32s,
    lm_idx: Vec<AtomicU32>,
}

impl SlotBuffers {
    fn poisoned(s: &ModelSpec, sched: &Schedule) -> Self {
        SlotBuffers {
            x: F32s::poisoned(s.hidden_size),
            qkv: F32s::poisoned(s.q_dim() + 2 * s.kv_dim()),
            mlp_acc: FixedSums::poisoned(s.hidden_size),
            part_o: F32s::poisoned(s.num_heads * sched.splits * s.head_dim),
            part_ml: F32s::poisoned(s.num_heads * sched.splits * 2),
            lm_max: F32s::poisoned(sched.lm_tiles),
            lm_idx: (0..sched.lm_tiles).map(|_| AtomicU32::new(u32::MAX)).collect(),
        }
    }

    /// As `poisoned` left them, for a request joining the slot (the MLP's sums
    /// are zeroed by the embedding that follows).
    fn poison(&self) {
        for f in [&self.x, &self.qkv, &self.part_o, &self.part_ml, &self.lm_max] {
            f.poison();
        }
        self.lm_idx.iter().for_each(|i| i.store(u32::MAX, Ordering::Relaxed));
    }
}

/// One request's results as the loop produces them.
struct RequestOutput {
    logits: F32s,
    tokens: Vec<AtomicU32>,
    steps_run: AtomicU32,
}

/// No request in the slot.
const FREE: u32 = 0;

/// State of one launch, shared by the virtual SMs.
struct Run<'a> {
    admissions: &'a [TwinAdmission<'a>],
    kv: &'a TwinKv,
    on_token: &'a (dyn Fn(&TwinHost<'_>, usize, usize, u32) -> bool + Sync),
    /// Admissions the host has posted, and those that have joined.
    posted: Vec<AtomicBool>,
    admitted: Vec<AtomicBool>,
    counters: Vec<AtomicU32>,
    slots: Vec<SlotBuffers>,
    /// The slot table: the admission each slot runs (index + 1, or FREE) and
    /// the launch step it joined at. The last SM of a step's LM head writes it
    /// before it starts the next step, and every instruction of that step reads it.
    occupant: Vec<AtomicU32>,
    joined: Vec<AtomicU32>,
    outputs: Vec<RequestOutput>,
    /// Launch steps at most: every request has ended by then.
    steps: u32,
    stop: AtomicBool,
    abort: AtomicBool,
}

impl Run<'_> {
    /// The admission slot `slot` runs this step, if any.
    fn occupant(&self, slot: usize) -> Option<usize> {
        match self.occupant[slot].load(Ordering::Acquire) {
            FREE => None,
            a => Some(a as usize - 1),
        }
    }

    /// Slots with a request at step `t`: (slot, admission, the request's own step).
    fn running(&self, t: u32) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.slots.len()).filter_map(move |slot| self.request_in(slot, t).map(|(a, step)| (slot, a, step)))
    }

    /// Slot `slot`'s request at step `t`, if any: (admission, the request's own step).
    fn request_in(&self, slot: usize, t: u32) -> Option<(usize, usize)> {
        self.occupant(slot).map(|a| (a, (t - self.joined[slot].load(Ordering::Relaxed)) as usize))
    }
}

impl<'w> Twin<'w> {
    /// A twin of the one-sequence schedule on `sm_count` SMs.
    pub fn new(spec: &'w ModelSpec, weights: &'w ModelWeights, sm_count: usize) -> Result<Self> {
        Ok(Self::with_schedule(spec, weights, Schedule::compile(spec, sm_count)?))
    }

    /// A twin over a given schedule (batched ones, and broken ones in tests).
    pub fn with_schedule(spec: &'w ModelSpec, weights: &'w ModelWeights, schedule: Schedule) -> Self {
        Twin { spec, weights, inv_freq: rope::inv_freq(spec), schedule, watchdog: Duration::from_secs(60) }
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    pub fn spec(&self) -> &ModelSpec {
        self.spec
    }

    /// Runs one request's token loop from the launch's first step, in slot 0 of
    /// `kv`'s first page. `on_token(step, argmax)` sees each step's token as it
    /// is picked; returning false stops the loop after that step (the host's stop flag).
    pub fn run(&self, kv: &TwinKv, req: &TwinRequest<'_>, on_token: &(dyn Fn(usize, u32) -> bool + Sync)) -> Result<TwinOutput> {
        let lone = [TwinAdmission { request: *req, slot: 0, pages: &[0], join: Join::AtStep(0) }];
        let mut out = self.run_batch(kv, &lone, &|_, _, step, token| on_token(step, token))?;
        Ok(out.remove(0))
    }

    /// Runs a launch that serves `admissions`, each joining its slot at its
    /// step or when the host posts it, until every one has ended (a posted one
    /// never posted has an empty output). `on_token(host, admission, step,
    /// argmax)` sees each request's tokens as they are picked and may post
    /// admissions; false stops that request after that step. Returns each
    /// admission's output, in order.
    pub fn run_batch(
        &self,
        kv: &TwinKv,
        admissions: &[TwinAdmission<'_>],
        on_token: &(dyn Fn(&TwinHost<'_>, usize, usize, u32) -> bool + Sync),
    ) -> Result<Vec<TwinOutput>> {
        let s = self.spec;
        for (i, a) in admissions.iter().enumerate() {
            self.check_admission(kv, a).map_err(|e| match e {
                RocketError::InvalidArgument { parameter, value, message } => {
                    RocketError::InvalidArgument { parameter: format!("admission {i}: {parameter}"), value, message }
                }
                other => other,
            })?;
        }
        let sched = &self.schedule;
        // Every request has ended by then: the scheduled ones' last steps, then the
        // posted ones one after another at worst.
        let scheduled = admissions.iter().filter_map(|a| match a.join {
            Join::AtStep(t) => Some(t + a.request.max_steps),
            Join::Posted => None,
        });
        let posted: usize = admissions.iter().filter(|a| a.join == Join::Posted).map(|a| a.request.max_steps).sum();
        let steps = scheduled.max().unwrap_or(0) + posted;
        let run = Run {
            admissions,
            kv,
            on_token,
            posted: admissions.iter().map(|_| AtomicBool::new(false)).collect(),
            admitted: admissions.iter().map(|_| AtomicBool::new(false)).collect(),
            counters: (0..sched.counters.count()).map(|_| AtomicU32::new(0)).collect(),
            slots: (0..sched.batch_slots).map(|_| SlotBuffers::poisoned(s, sched)).collect(),
            occupant: (0..sched.batch_slots).map(|_| AtomicU32::new(FREE)).collect(),
            joined: (0..sched.batch_slots).map(|_| AtomicU32::new(0)).collect(),
            outputs: admissions
                .iter()
                .map(|a| RequestOutput {
                    logits: F32s::poisoned(a.request.max_steps * s.vocab_size),
                    tokens: (0..a.request.max_steps).map(|_| AtomicU32::new(u32::MAX)).collect(),
                    steps_run: AtomicU32::new(0),
                })
                .collect(),
            steps: u32::try_from(steps).map_err(|_| RocketError::invalid_arg("admissions", steps, "end past 2^32 steps"))?,
            stop: AtomicBool::new(false),
            abort: AtomicBool::new(false),
        };
        // The launch prologue: the first requests' embeddings, then step 0 may start.
        self.admit(&run, 0).map_err(|e| RocketError::Device(format!("megakernel twin: {e}")))?;
        Self::end_if_idle(&run, 0);
        run.counters[Counters::STEP as usize].store(1, Ordering::Release);

        let errors: Vec<String> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..sched.sm_count).map(|sm| {
                let run = &run;
                scope.spawn(move || {
                    let r = self.sm_loop(sm, run);
                    if r.is_err() {
                        run.abort.store(true, Ordering::Release);
                    }
                    r
                })
            }).collect();
            handles.into_iter().filter_map(|h| h.join().expect("a twin SM panicked").err()).collect()
        });
        // Report the SM that got stuck, not those that gave up because of it.
        if let Some(first) = errors.iter().find(|e| !e.contains("gave up")).or(errors.first()) {
            return Err(RocketError::Device(format!("megakernel twin: {first}")));
        }
        Ok(run
            .outputs
            .iter()
            .map(|o| {
                let steps = o.steps_run.load(Ordering::Acquire) as usize;
                TwinOutput {
                    tokens: o.tokens[..steps].iter().map(|t| t.load(Ordering::Relaxed)).collect(),
                    logits: o.logits.read(0, steps * s.vocab_size),
                }
            })
            .collect())
    }

    fn check_admission(&self, kv: &TwinKv, a: &TwinAdmission<'_>) -> Result<()> {
        let (s, req) = (self.spec, &a.request);
        if a.slot >= self.schedule.batch_slots {
            return Err(RocketError::invalid_arg("slot", a.slot, format!("must be < the schedule's {} batch slots", self.schedule.batch_slots)));
        }
        if let Some(&page) = a.pages.iter().find(|&&p| p as usize >= kv.pages) {
            return Err(RocketError::invalid_arg("page", page, format!("must be < the cache's {} pages", kv.pages)));
        }
        if let Some((i, &page)) = a.pages.iter().enumerate().find(|&(i, p)| a.pages[..i].contains(p)) {
            return Err(RocketError::invalid_arg("page", page, format!("appears twice in the page table (entry {i})")));
        }
        let capacity = a.pages.len() * kv.page_positions;
        if req.max_steps == 0 || req.pos0 + req.max_steps > capacity {
            return Err(RocketError::invalid_arg(
                "max_steps",
                req.max_steps,
                format!("must be >= 1 with pos0 {} + max_steps within the request's {capacity} positions", req.pos0),
            ));
        }
        if req.first_token as usize >= s.vocab_size || req.forced.iter().any(|&t| t as usize >= s.vocab_size) {
            return Err(RocketError::invalid_arg("token id", req.first_token, format!("must be < vocab size {}", s.vocab_size)));
        }
        Ok(())
    }

    fn sm_loop(&self, sm: usize, run: &Run<'_>) -> std::result::Result<(), String> {
        for t in 0..run.steps {
            self.wait(run, Counters::STEP, t + 1, sm, t, "the step start")?;
            if run.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            for instr in &self.schedule.per_sm[sm] {
                let target = (t + 1) * instr.wait.per_step as u32;
                self.wait(run, instr.wait.counter, target, sm, t, &format!("{:?} of layer {}", instr.op, instr.layer))?;
                match instr.work {
                    Work::Rows { begin, end, .. } => self.matvec(run, instr, begin as usize..end as usize, t)?,
                    Work::Attn { slot, kv_head, split, splits } => {
                        self.attention(run, instr, slot as usize, kv_head as usize, split as usize, splits as usize, t)
                    }
                    Work::Claimed { tile_rows, tiles, claims } => {
                        if instr.op != Op::LmHead {
                            return Err(format!("{:?} of layer {} has claimed tiles: only the LM head does", instr.op, instr.layer));
                        }
                        self.lm_head(run, instr, sm, tile_rows as usize, tiles, claims, t)?
                    }
                }
            }
        }
        Ok(())
    }

    /// Spins until `counter >= target` (the kernel's watchdog turns a stall into an error).
    fn wait(&self, run: &Run<'_>, counter: u16, target: u32, sm: usize, t: u32, what: &str) -> std::result::Result<(), String> {
        let start = Instant::now();
        while run.counters[counter as usize].load(Ordering::Acquire) < target {
            if run.abort.load(Ordering::Acquire) {
                return Err(format!("SM {sm} gave up at {what} of step {t} after another SM failed"));
            }
            if start.elapsed() > self.watchdog {
                return Err(format!("SM {sm} stuck at {what} of step {t}: counter {counter} < {target}"));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    fn signal(run: &Run<'_>, counter: u16) -> u32 {
        run.counters[counter as usize].fetch_add(1, Ordering::AcqRel) + 1
    }

    /// `token`'s embedding as slot `slot`'s next input.
    fn embed(&self, run: &Run<'_>, slot: usize, token: u32) {
        let d = self.spec.hidden_size;
        let mut row = vec![0f32; d];
        self.weights.embed_tokens.view().to_f32_into(token as usize * d, &mut row);
        let b = &run.slots[slot];
        b.x.write(0, &row);
        (0..d).for_each(|i| b.mlp_acc.zero(i));
    }

    /// The residual stream's element i: x plus the last MLP's sums (O-proj folds them into x).
    fn residual(b: &SlotBuffers, i: usize) -> f32 {
        b.x.get(i) + b.mlp_acc.get(i)
    }

    /// RMSNorm of the residual (`with_sums`) or of x alone (the MLP: O-proj has
    /// just folded the sums in, and other SMs' MLPs are adding new ones).
    fn normed_x(&self, b: &SlotBuffers, norm: &[f32], with_sums: bool) -> Vec<f32> {
        let d = self.spec.hidden_size;
        let x: Vec<f32> = (0..d).map(|i| if with_sums { Self::residual(b, i) } else { b.x.get(i) }).collect();
        let mut h = vec![0f32; x.len()];
        rms_norm(&x, norm, self.spec.rms_norm_eps as f32, &mut h);
        h
    }

    /// Rows `begin..end` of the fused q|k|v matrix times `h`.
    fn qkv_rows(&self, layer: usize, rows: std::ops::Range<usize>, h: &[f32]) -> Vec<f32> {
        let s = self.spec;
        let l = &self.weights.layers[layer];
        let (qd, kvd, d) = (s.q_dim(), s.kv_dim(), s.hidden_size);
        let mut out = Vec::with_capacity(rows.len());
        for (tensor, first, n) in [(&l.q_proj, 0, qd), (&l.k_proj, qd, kvd), (&l.v_proj, qd + kvd, kvd)] {
            let (b, e) = (rows.start.max(first), rows.end.min(first + n));
            if b < e {
                let mut part = vec![0f32; e - b];
                matvec_rows(tensor.view(), b - first..e - first, d, h, &mut part);
                out.extend(part);
            }
        }
        out
    }

    /// One tile of rows, for every running slot (the kernel streams the tile's
    /// weights once and applies them to each slot's input).
    fn matvec(&self, run: &Run<'_>, instr: &Instr, rows: std::ops::Range<usize>, t: u32) -> std::result::Result<(), String> {
        let s = self.spec;
        let w = self.weights;
        let layer = instr.layer as usize;
        let n = rows.len();
        for (slot, _, _) in run.running(t) {
            let b = &run.slots[slot];
            match instr.op {
                Op::Qkv => {
                    let h = self.normed_x(b, &w.layers[layer].attn_norm, true);
                    b.qkv.write(rows.start, &self.qkv_rows(layer, rows.clone(), &h));
                }
                Op::OProj => {
                    let input = self.merged_attention(run, slot, t);
                    let mut out = vec![0f32; n];
                    matvec_rows(w.layers[layer].o_proj.view(), rows.clone(), s.q_dim(), &input, &mut out);
                    for (i, v) in rows.clone().zip(out) {
                        b.x.set(i, Self::residual(b, i) + v);
                        b.mlp_acc.zero(i);
                    }
                }
                Op::Mlp => {
                    let l = &w.layers[layer];
                    let h = self.normed_x(b, &l.mlp_norm, false);
                    let (mut gate, mut up) = (vec![0f32; n], vec![0f32; n]);
                    matvec_rows(l.gate_proj.view(), rows.clone(), s.hidden_size, &h, &mut gate);
                    matvec_rows(l.up_proj.view(), rows.clone(), s.hidden_size, &h, &mut up);
                    let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
                    // This tile's act values times the same columns of every down-projection row.
                    let (ff, down) = (s.intermediate_size, l.down_proj.view());
                    let mut cols = vec![0f32; n];
                    for j in 0..s.hidden_size {
                        down.to_f32_into(j * ff + rows.start, &mut cols);
                        b.mlp_acc.add(j, cols.iter().zip(&act).map(|(w, a)| w * a).sum());
                    }
                }
                Op::LmHead => return Err("the LM head's tiles are claimed, not listed".into()),
                Op::Attn => unreachable!("attention carries Work::Attn"),
            }
        }
        Self::signal(run, instr.signal);
        Ok(())
    }

    /// The LM head on virtual SM `sm`: the tiles it claims, as the kernel's
    /// weight stream claims them (claim k of step t is tile k - t (tiles + SMs);
    /// the SM stops at the first claim past the tiles), each tile's logits for
    /// every running slot, then the SM's argmax per slot in the slot's
    /// lm_max/lm_idx[sm]; the last SM to arrive picks the tokens.
    #[allow(clippy::too_many_arguments)]
    fn lm_head(&self, run: &Run<'_>, instr: &Instr, sm: usize, tile_rows: usize, tiles: u32, claims: u16, t: u32) -> std::result::Result<(), String> {
        let (s, w) = (self.spec, self.weights);
        let running: Vec<_> = run.running(t).collect();
        let h: Vec<Vec<f32>> = running.iter().map(|&(slot, _, _)| self.normed_x(&run.slots[slot], &w.final_norm, true)).collect();
        let per_step = tiles + self.schedule.sm_count as u32;
        let mut best = vec![(f32::NEG_INFINITY, u32::MAX); running.len()];
        loop {
            let tile = run.counters[claims as usize].fetch_add(1, Ordering::Relaxed).wrapping_sub(t * per_step);
            if tile >= tiles {
                break;
            }
            let begin = tile as usize * tile_rows;
            let rows = begin..(begin + tile_rows).min(s.vocab_size);
            for (r, &(_, a, step)) in running.iter().enumerate() {
                let (a, output) = (&run.admissions[a], &run.outputs[a]);
                let mut out = vec![0f32; rows.len()];
                matvec_rows(w.lm_head().view(), rows.clone(), s.hidden_size, &h[r], &mut out);
                output.logits.write(step * s.vocab_size + begin, &out);
                let masked = step < a.request.mask_end_steps;
                let (best_v, best_i) = &mut best[r];
                for (i, &v) in rows.clone().zip(&out) {
                    let i = i as u32;
                    if masked && a.request.end_ids.contains(&i) {
                        continue;
                    }
                    // As the kernel and the host argmax: -inf and NaN never win.
                    if v > f32::NEG_INFINITY && (v > *best_v || (v == *best_v && i < *best_i)) {
                        (*best_v, *best_i) = (v, i);
                    }
                }
            }
        }
        for (&(slot, _, _), &(v, i)) in running.iter().zip(&best) {
            run.slots[slot].lm_max.set(sm, v);
            run.slots[slot].lm_idx[sm].store(i, Ordering::Relaxed);
        }
        if Self::signal(run, instr.signal) == (t + 1) * self.schedule.lm_tiles as u32 {
            self.pick_tokens(run, t)?;
        }
        Ok(())
    }

    /// The last SM of the LM head: for every running slot, reduce the SMs'
    /// argmaxes (lowest index on ties), publish the token and decide whether
    /// the request goes on (then embed its next input) or ends (then its slot
    /// is free); admit the requests posted for the next step; start it.
    fn pick_tokens(&self, run: &Run<'_>, t: u32) -> std::result::Result<(), String> {
        let running: Vec<(usize, usize, usize)> = run.running(t).collect();
        for (slot, a, step) in running {
            let b = &run.slots[slot];
            let (mut best, mut token) = (f32::NEG_INFINITY, u32::MAX);
            for sm in 0..self.schedule.lm_tiles {
                let (v, i) = (b.lm_max.get(sm), b.lm_idx[sm].load(Ordering::Relaxed));
                if v.is_nan() {
                    // Written values are finite or -inf: this SM never wrote the slot's argmax.
                    return Err(format!("SM {sm} left no LM-head argmax for slot {slot} at step {t}"));
                }
                if i != u32::MAX && (v > best || (v == best && i < token)) {
                    (best, token) = (v, i);
                }
            }
            if token == u32::MAX {
                token = 0; // every logit NaN or masked: as the host argmax, index 0
            }
            let (req, out) = (&run.admissions[a].request, &run.outputs[a]);
            out.tokens[step].store(token, Ordering::Relaxed);
            let free_running = step >= req.forced.len();
            let host = TwinHost { admissions: run.admissions, posted: &run.posted, step: t };
            let keep_going = (run.on_token)(&host, a, step, token);
            let stop = step + 1 >= req.max_steps || !keep_going || (free_running && req.end_ids.contains(&token));
            out.steps_run.store(step as u32 + 1, Ordering::Release);
            if stop {
                run.occupant[slot].store(FREE, Ordering::Release);
            } else {
                self.embed(run, slot, if free_running { token } else { req.forced[step] });
            }
        }
        self.admit(run, t + 1)?;
        Self::end_if_idle(run, t + 1);
        Self::signal(run, Counters::STEP);
        Ok(())
    }

    /// Admits the requests due at step `t` (scheduled for it, or posted and not
    /// yet in): each takes its slot (poisoned first, so nothing of the slot's
    /// last request can be read unnoticed) and its first token's embedding.
    fn admit(&self, run: &Run<'_>, t: u32) -> std::result::Result<(), String> {
        let due = |a: usize, adm: &TwinAdmission<'_>| match adm.join {
            Join::AtStep(at) => at == t as usize,
            Join::Posted => run.posted[a].load(Ordering::Acquire) && !run.admitted[a].load(Ordering::Relaxed),
        };
        for (a, adm) in run.admissions.iter().enumerate().filter(|&(a, adm)| due(a, adm)) {
            if let Some(other) = run.occupant(adm.slot) {
                return Err(format!("admission {a} joins slot {} at step {t}, which admission {other} still runs", adm.slot));
            }
            let shares_a_page = |&(_, o, _): &(usize, usize, usize)| run.admissions[o].pages.iter().any(|p| adm.pages.contains(p));
            if let Some((other, _, _)) = run.running(t).find(shares_a_page) {
                return Err(format!("admission {a} shares a KV page with the request in slot {other} at step {t}"));
            }
            run.slots[adm.slot].poison();
            self.embed(run, adm.slot, adm.request.first_token);
            run.joined[adm.slot].store(t, Ordering::Relaxed);
            run.admitted[a].store(true, Ordering::Relaxed);
            run.occupant[adm.slot].store(a as u32 + 1, Ordering::Release);
        }
        Ok(())
    }

    /// Ends the launch once no slot runs a request and none is scheduled for a
    /// later step (nothing can post one then: posts come with tokens).
    fn end_if_idle(run: &Run<'_>, t: u32) {
        let busy = (0..run.slots.len()).any(|slot| run.occupant(slot).is_some());
        let later = run.admissions.iter().any(|a| matches!(a.join, Join::AtStep(at) if at > t as usize));
        if !busy && !later {
            run.stop.store(true, Ordering::Release);
        }
    }

    /// q/k-norm and RoPE of one head, as the reference does.
    fn rotate(&self, head: &mut [f32], norm: Option<&Vec<f32>>, pos: usize) {
        if let Some(n) = norm {
            rms_norm_in_place(head, n, self.spec.rms_norm_eps as f32);
        }
        rope::apply(head, pos, &self.inv_freq);
    }

    /// One split of slot `slot`'s attention for the query heads of KV head `g`
    /// (an empty slot's items only arrive).
    #[allow(clippy::too_many_arguments)]
    fn attention(&self, run: &Run<'_>, instr: &Instr, slot: usize, g: usize, split: usize, splits: usize, t: u32) {
        let Some((a, step)) = run.request_in(slot, t) else {
            Self::signal(run, instr.signal);
            return;
        };
        let (b, adm) = (&run.slots[slot], &run.admissions[a]);
        let s = self.spec;
        let (hd, qd, kvd) = (s.head_dim, s.q_dim(), s.kv_dim());
        let layer = instr.layer as usize;
        let lw = &self.weights.layers[layer];
        let group = s.num_heads / s.num_kv_heads;
        let pos = adm.request.pos0 + step;
        let context = pos + 1;
        let used = used_splits(context, splits);
        let chunk = context.div_ceil(used);
        let (begin, end) = ((split * chunk).min(context), ((split + 1) * chunk).min(context));

        let mut k = b.qkv.read(qd + g * hd, hd);
        self.rotate(&mut k, lw.k_norm.as_ref(), pos);
        let kv_at = |p: usize, which: usize| run.kv.at(adm.pages, p, layer, which, kvd) + g * hd;
        if (begin..end).contains(&pos) {
            run.kv.data.write(kv_at(pos, 0), &k);
            run.kv.data.write(kv_at(pos, 1), &b.qkv.read(qd + kvd + g * hd, hd));
        }
        let scale = 1.0 / (hd as f32).sqrt();
        // Splits past `used` are empty: they only arrive (and write no partials).
        for head in (g * group..(g + 1) * group).filter(|_| split < used) {
            let mut q = b.qkv.read(head * hd, hd);
            self.rotate(&mut q, lw.q_norm.as_ref(), pos);
            let (mut m, mut l, mut o) = (f32::NEG_INFINITY, 0f32, vec![0f32; hd]);
            for p in begin..end {
                let kp = run.kv.data.read(kv_at(p, 0), hd);
                let score = q.iter().zip(&kp).map(|(a, b)| a * b).sum::<f32>() * scale;
                let m_new = m.max(score);
                let (corr, w) = ((m - m_new).exp(), (score - m_new).exp());
                let vp = run.kv.data.read(kv_at(p, 1), hd);
                for (acc, v) in o.iter_mut().zip(vp) {
                    *acc = *acc * corr + w * v;
                }
                l = l * corr + w;
                m = m_new;
            }
            let at = head * splits + split;
            b.part_o.write(at * hd, &o);
            b.part_ml.set(at * 2, m);
            b.part_ml.set(at * 2 + 1, l);
        }
        Self::signal(run, instr.signal);
    }

    /// Slot `slot`'s attention output at step `t`, every q head merged from its
    /// used splits' partials as each O-proj tile does (kernels/src/mk_attention.cuh `merge_group`).
    fn merged_attention(&self, run: &Run<'_>, slot: usize, t: u32) -> Vec<f32> {
        let s = self.spec;
        let hd = s.head_dim;
        let splits = self.schedule.splits;
        let (a, step) = run.request_in(slot, t).expect("O-proj runs for running slots");
        let used = used_splits(run.admissions[a].request.pos0 + step + 1, splits);
        let b = &run.slots[slot];
        let mut attn = Vec::with_capacity(s.q_dim());
        for head in 0..s.num_heads {
            let parts: Vec<(f32, f32)> =
                (0..used).map(|sp| (b.part_ml.get((head * splits + sp) * 2), b.part_ml.get((head * splits + sp) * 2 + 1))).collect();
            let big_m = parts.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0f32;
            let mut out = vec![0f32; hd];
            for (sp, &(m, l)) in parts.iter().enumerate() {
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let f = (m - big_m).exp();
                total += l * f;
                for (acc, v) in out.iter_mut().zip(b.part_o.read((head * splits + sp) * hd, hd)) {
                    *acc += v * f;
                }
            }
            attn.extend(out.iter().map(|v| v / total));
        }
        attn
    }
}

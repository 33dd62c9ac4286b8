//! The megakernel's CPU twin: runs a [`Schedule`] the way the GPU kernel does,
//! one thread per virtual SM, each executing its instruction list in order and
//! waiting on the same dependency counters, with every instruction body in f32
//! on the CPU reference's arithmetic. It checks what the schedule means (tiles,
//! waits, attention splits and the O-proj merge of their partials, the token loop, masking,
//! teacher forcing, stopping) against the reference backend with no GPU at hand.
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

/// One sequence's KV cache, laid out as the GPU's ([position][layer][k | v][kv_dim])
/// but in f32. Positions before a run's `pos0` must have been written by earlier runs.
pub struct TwinKv {
    data: F32s,
    capacity: usize,
}

impl TwinKv {
    pub fn new(spec: &ModelSpec, capacity: usize) -> Self {
        TwinKv { data: F32s::poisoned(capacity * spec.num_layers * 2 * spec.kv_dim()), capacity }
    }
}

/// One launch of the token loop.
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

#[derive(Debug)]
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

/// State of one run, shared by the virtual SMs.
struct Run<'a> {
    req: &'a TwinRequest<'a>,
    kv: &'a TwinKv,
    on_token: &'a (dyn Fn(usize, u32) -> bool + Sync),
    counters: Vec<AtomicU32>,
    x: F32s,
    qkv: F32s,
    mlp_acc: FixedSums,
    /// [q head][split][head_dim] and [q head][split][max, sum].
    part_o: F32s,
    part_ml: F32s,
    lm_max: F32s,
    lm_idx: Vec<AtomicU32>,
    logits: F32s,
    tokens: Vec<AtomicU32>,
    steps_run: AtomicU32,
    stop: AtomicBool,
    abort: AtomicBool,
}

impl<'w> Twin<'w> {
    pub fn new(spec: &'w ModelSpec, weights: &'w ModelWeights, sm_count: usize) -> Result<Self> {
        Ok(Self::with_schedule(spec, weights, Schedule::compile(spec, sm_count)?))
    }

    /// A twin over a given schedule (tests hand it broken ones).
    pub fn with_schedule(spec: &'w ModelSpec, weights: &'w ModelWeights, schedule: Schedule) -> Self {
        Twin { spec, weights, inv_freq: rope::inv_freq(spec), schedule, watchdog: Duration::from_secs(60) }
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    pub fn spec(&self) -> &ModelSpec {
        self.spec
    }

    /// Runs the token loop. `on_token(step, argmax)` sees each step's token as it
    /// is picked; returning false stops the loop after that step (the host's stop flag).
    pub fn run(&self, kv: &TwinKv, req: &TwinRequest<'_>, on_token: &(dyn Fn(usize, u32) -> bool + Sync)) -> Result<TwinOutput> {
        let s = self.spec;
        if req.max_steps == 0 || req.pos0 + req.max_steps > kv.capacity {
            return Err(RocketError::invalid_arg(
                "max_steps",
                req.max_steps,
                format!("must be >= 1 with pos0 {} + max_steps within the cache's {} positions", req.pos0, kv.capacity),
            ));
        }
        if req.first_token as usize >= s.vocab_size || req.forced.iter().any(|&t| t as usize >= s.vocab_size) {
            return Err(RocketError::invalid_arg("token id", req.first_token, format!("must be < vocab size {}", s.vocab_size)));
        }
        let sched = &self.schedule;
        let run = Run {
            req,
            kv,
            on_token,
            counters: (0..sched.counters.count()).map(|_| AtomicU32::new(0)).collect(),
            x: F32s::poisoned(s.hidden_size),
            qkv: F32s::poisoned(s.q_dim() + 2 * s.kv_dim()),
            mlp_acc: FixedSums::poisoned(s.hidden_size),
            part_o: F32s::poisoned(s.num_heads * sched.splits * s.head_dim),
            part_ml: F32s::poisoned(s.num_heads * sched.splits * 2),
            lm_max: F32s::poisoned(sched.lm_tiles),
            lm_idx: (0..sched.lm_tiles).map(|_| AtomicU32::new(u32::MAX)).collect(),
            logits: F32s::poisoned(req.max_steps * s.vocab_size),
            tokens: (0..req.max_steps).map(|_| AtomicU32::new(u32::MAX)).collect(),
            steps_run: AtomicU32::new(0),
            stop: AtomicBool::new(false),
            abort: AtomicBool::new(false),
        };
        // The launch prologue: the first token's embedding, then step 0 may start.
        self.embed(&run, req.first_token);
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
        let steps = run.steps_run.load(Ordering::Acquire) as usize;
        let tokens = run.tokens[..steps].iter().map(|t| t.load(Ordering::Relaxed)).collect();
        Ok(TwinOutput { tokens, logits: run.logits.read(0, steps * s.vocab_size) })
    }

    fn sm_loop(&self, sm: usize, run: &Run<'_>) -> std::result::Result<(), String> {
        for t in 0..run.req.max_steps as u32 {
            self.wait(run, Counters::STEP, t + 1, sm, t, "the step start")?;
            if run.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            for instr in &self.schedule.per_sm[sm] {
                let target = (t + 1) * instr.wait.per_step as u32;
                self.wait(run, instr.wait.counter, target, sm, t, &format!("{:?} of layer {}", instr.op, instr.layer))?;
                match instr.work {
                    Work::Rows { begin, end, .. } => self.matvec(run, instr, begin as usize..end as usize, t)?,
                    Work::Attn { kv_head, split, splits } => {
                        self.attention(run, instr, kv_head as usize, split as usize, splits as usize, t)
                    }
                    Work::Claimed { tile_rows, tiles, claims } => {
                        if instr.op != Op::LmHead {
                            return Err(format!("{:?} of layer {} has claimed tiles: only the LM head does", instr.op, instr.layer));
                        }
                        self.lm_head(run, instr, sm, tile_rows as usize, tiles, claims, t)
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

    fn embed(&self, run: &Run<'_>, token: u32) {
        let d = self.spec.hidden_size;
        let mut row = vec![0f32; d];
        self.weights.embed_tokens.view().to_f32_into(token as usize * d, &mut row);
        run.x.write(0, &row);
        (0..d).for_each(|i| run.mlp_acc.zero(i));
    }

    /// The residual stream's element i: x plus the last MLP's sums (O-proj folds them into x).
    fn residual(run: &Run<'_>, i: usize) -> f32 {
        run.x.get(i) + run.mlp_acc.get(i)
    }

    /// RMSNorm of the residual (`with_sums`) or of x alone (the MLP: O-proj has
    /// just folded the sums in, and other SMs' MLPs are adding new ones).
    fn normed_x(&self, run: &Run<'_>, norm: &[f32], with_sums: bool) -> Vec<f32> {
        let d = self.spec.hidden_size;
        let x: Vec<f32> = (0..d).map(|i| if with_sums { Self::residual(run, i) } else { run.x.get(i) }).collect();
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

    fn matvec(&self, run: &Run<'_>, instr: &Instr, rows: std::ops::Range<usize>, t: u32) -> std::result::Result<(), String> {
        let s = self.spec;
        let w = self.weights;
        let layer = instr.layer as usize;
        let n = rows.len();
        match instr.op {
            Op::Qkv => {
                let h = self.normed_x(run, &w.layers[layer].attn_norm, true);
                run.qkv.write(rows.start, &self.qkv_rows(layer, rows, &h));
            }
            Op::OProj => {
                let input = self.merged_attention(run, t);
                let mut out = vec![0f32; n];
                matvec_rows(w.layers[layer].o_proj.view(), rows.clone(), s.q_dim(), &input, &mut out);
                for (i, v) in rows.zip(out) {
                    run.x.set(i, Self::residual(run, i) + v);
                    run.mlp_acc.zero(i);
                }
            }
            Op::Mlp => {
                let l = &w.layers[layer];
                let h = self.normed_x(run, &l.mlp_norm, false);
                let (mut gate, mut up) = (vec![0f32; n], vec![0f32; n]);
                matvec_rows(l.gate_proj.view(), rows.clone(), s.hidden_size, &h, &mut gate);
                matvec_rows(l.up_proj.view(), rows.clone(), s.hidden_size, &h, &mut up);
                let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
                // This tile's act values times the same columns of every down-projection row.
                let (ff, down) = (s.intermediate_size, l.down_proj.view());
                let mut cols = vec![0f32; n];
                for j in 0..s.hidden_size {
                    down.to_f32_into(j * ff + rows.start, &mut cols);
                    run.mlp_acc.add(j, cols.iter().zip(&act).map(|(w, a)| w * a).sum());
                }
            }
            Op::LmHead => return Err("the LM head's tiles are claimed, not listed".into()),
            Op::Attn => unreachable!("attention carries Work::Attn"),
        }
        Self::signal(run, instr.signal);
        Ok(())
    }

    /// The LM head on virtual SM `sm`: the tiles it claims, as the kernel's
    /// weight stream claims them (claim k of step t is tile k - t (tiles + SMs);
    /// the SM stops at the first claim past the tiles), each tile's logits, then
    /// the SM's argmax over them in lm_max/lm_idx[sm]; the last SM to arrive
    /// picks the token.
    #[allow(clippy::too_many_arguments)]
    fn lm_head(&self, run: &Run<'_>, instr: &Instr, sm: usize, tile_rows: usize, tiles: u32, claims: u16, t: u32) {
        let (s, w) = (self.spec, self.weights);
        let h = self.normed_x(run, &w.final_norm, true);
        let base = t as usize * s.vocab_size;
        let masked = (t as usize) < run.req.mask_end_steps;
        let per_step = tiles + self.schedule.sm_count as u32;
        let (mut best, mut idx) = (f32::NEG_INFINITY, u32::MAX);
        loop {
            let tile = run.counters[claims as usize].fetch_add(1, Ordering::Relaxed).wrapping_sub(t * per_step);
            if tile >= tiles {
                break;
            }
            let begin = tile as usize * tile_rows;
            let rows = begin..(begin + tile_rows).min(s.vocab_size);
            let mut out = vec![0f32; rows.len()];
            matvec_rows(w.lm_head().view(), rows.clone(), s.hidden_size, &h, &mut out);
            run.logits.write(base + begin, &out);
            for (i, &v) in rows.zip(&out) {
                let i = i as u32;
                if masked && run.req.end_ids.contains(&i) {
                    continue;
                }
                // As the kernel and the host argmax: -inf and NaN never win.
                if v > f32::NEG_INFINITY && (v > best || (v == best && i < idx)) {
                    (best, idx) = (v, i);
                }
            }
        }
        run.lm_max.set(sm, best);
        run.lm_idx[sm].store(idx, Ordering::Relaxed);
        if Self::signal(run, instr.signal) == (t + 1) * self.schedule.lm_tiles as u32 {
            self.pick_token(run, t);
        }
    }

    /// The last SM of the LM head: reduce the SMs' argmaxes (lowest index on ties),
    /// publish the token, decide whether to go on, embed the next input and
    /// start the next step.
    fn pick_token(&self, run: &Run<'_>, t: u32) {
        let (mut best, mut token) = (f32::NEG_INFINITY, u32::MAX);
        for tile in 0..self.schedule.lm_tiles {
            let (v, i) = (run.lm_max.get(tile), run.lm_idx[tile].load(Ordering::Relaxed));
            if i != u32::MAX && (v > best || (v == best && i < token)) {
                (best, token) = (v, i);
            }
        }
        if token == u32::MAX {
            token = 0; // every logit NaN or masked: as the host argmax, index 0
        }
        let step = t as usize;
        run.tokens[step].store(token, Ordering::Relaxed);
        let req = run.req;
        let free_running = step >= req.forced.len();
        let keep_going = (run.on_token)(step, token);
        let stop = step + 1 >= req.max_steps || !keep_going || (free_running && req.end_ids.contains(&token));
        if stop {
            run.stop.store(true, Ordering::Release);
        } else {
            self.embed(run, if free_running { token } else { req.forced[step] });
        }
        run.steps_run.store(t + 1, Ordering::Release);
        Self::signal(run, Counters::STEP);
    }

    /// q/k-norm and RoPE of one head, as the reference does.
    fn rotate(&self, head: &mut [f32], norm: Option<&Vec<f32>>, pos: usize) {
        if let Some(n) = norm {
            rms_norm_in_place(head, n, self.spec.rms_norm_eps as f32);
        }
        rope::apply(head, pos, &self.inv_freq);
    }

    fn attention(&self, run: &Run<'_>, instr: &Instr, g: usize, split: usize, splits: usize, t: u32) {
        let s = self.spec;
        let (hd, qd, kvd, nl) = (s.head_dim, s.q_dim(), s.kv_dim(), s.num_layers);
        let layer = instr.layer as usize;
        let lw = &self.weights.layers[layer];
        let group = s.num_heads / s.num_kv_heads;
        let pos = run.req.pos0 + t as usize;
        let context = pos + 1;
        let used = used_splits(context, splits);
        let chunk = context.div_ceil(used);
        let (begin, end) = ((split * chunk).min(context), ((split + 1) * chunk).min(context));

        let mut k = run.qkv.read(qd + g * hd, hd);
        self.rotate(&mut k, lw.k_norm.as_ref(), pos);
        let kv_at = |p: usize, which: usize| ((p * nl + layer) * 2 + which) * kvd + g * hd;
        if (begin..end).contains(&pos) {
            run.kv.data.write(kv_at(pos, 0), &k);
            run.kv.data.write(kv_at(pos, 1), &run.qkv.read(qd + kvd + g * hd, hd));
        }
        let scale = 1.0 / (hd as f32).sqrt();
        // Splits past `used` are empty: they only arrive (and write no partials).
        for head in (g * group..(g + 1) * group).filter(|_| split < used) {
            let mut q = run.qkv.read(head * hd, hd);
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
            let slot = head * splits + split;
            run.part_o.write(slot * hd, &o);
            run.part_ml.set(slot * 2, m);
            run.part_ml.set(slot * 2 + 1, l);
        }
        Self::signal(run, instr.signal);
    }

    /// Step `t`'s attention output, every q head merged from its used splits'
    /// partials as each O-proj tile does (kernels/src/mk_attention.cuh `merge_group`).
    fn merged_attention(&self, run: &Run<'_>, t: u32) -> Vec<f32> {
        let s = self.spec;
        let hd = s.head_dim;
        let splits = self.schedule.splits;
        let used = used_splits(run.req.pos0 + t as usize + 1, splits);
        let mut attn = Vec::with_capacity(s.q_dim());
        for head in 0..s.num_heads {
            let parts: Vec<(f32, f32)> =
                (0..used).map(|sp| (run.part_ml.get((head * splits + sp) * 2), run.part_ml.get((head * splits + sp) * 2 + 1))).collect();
            let big_m = parts.iter().map(|p| p.0).fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0f32;
            let mut out = vec![0f32; hd];
            for (sp, &(m, l)) in parts.iter().enumerate() {
                if m == f32::NEG_INFINITY {
                    continue;
                }
                let f = (m - big_m).exp();
                total += l * f;
                for (acc, v) in out.iter_mut().zip(run.part_o.read((head * splits + sp) * hd, hd)) {
                    *acc += v * f;
                }
            }
            attn.extend(out.iter().map(|v| v / total));
        }
        attn
    }
}

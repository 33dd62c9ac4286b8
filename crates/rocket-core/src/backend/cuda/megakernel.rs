//! Host side of the persistent decode megakernel (kernels/src/megakernel.cu):
//! picks the fuel's kernel, compiles and verifies the schedule for this GPU's
//! SM count, owns the kernel's buffers and the mapped token ring, and runs one
//! launch per token loop: the host only polls the ring, hands tokens on and
//! raises the stop flag when it wants the loop to end.

use std::time::Duration;

use super::driver::{grown, Arg, Context, DeviceBuffer, Function, MappedBuffer, Module, Stream};
use super::poll_pacer::{self, PollPacer};
use super::weights::DeviceWeights;
use super::kernels::{SampleRow, SAMPLE_ITEM_BYTES};
use super::sampler::sample_row;
use crate::backend::{LoopOutcome, LoopRequest, SampleRequest};
use crate::error::{Result, RocketError};
use crate::output::TokenLogprob;
use crate::sampling::MAX_LOGPROBS;
use crate::megakernel::abi::{LayerPtrs, Params, LP_MAX, LP_PART, LP_WORDS, RACE_KEY_BINS, RACE_LEVELS, RACE_LIST, RACE_MASS_BINS, RING_EMPTY, RING_FAULT, RING_STOP, RING_TOKENS, SMEM_BYTES, STATE_WORDS, ST_ONE_CTA, ST_STEPS, THREADS};
use crate::megakernel::profile::trace_words;
use crate::megakernel::{verify, MegakernelError, Schedule};
use crate::model::ModelSpec;

/// A fuel the megakernel is instantiated for (kernels/src/megakernel.cu `MEGAKERNEL`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fuel {
    pub name: &'static str,
    kernel: &'static str,
    hidden: usize,
    ff: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vocab: usize,
}

pub const FUELS: [Fuel; 4] = [
    Fuel { name: "Llama-3.2-1B", kernel: "megakernel_llama_3_2_1b", hidden: 2048, ff: 8192, layers: 16, heads: 32, kv_heads: 8, head_dim: 64, vocab: 128256 },
    Fuel { name: "Qwen3-0.6B", kernel: "megakernel_qwen3_0_6b", hidden: 1024, ff: 3072, layers: 28, heads: 16, kv_heads: 8, head_dim: 128, vocab: 151936 },
    Fuel { name: "Qwen3-1.7B", kernel: "megakernel_qwen3_1_7b", hidden: 2048, ff: 6144, layers: 28, heads: 16, kv_heads: 8, head_dim: 128, vocab: 151936 },
    Fuel { name: "SmolLM2-135M", kernel: "megakernel_smollm2_135m", hidden: 576, ff: 1536, layers: 30, heads: 9, kv_heads: 3, head_dim: 64, vocab: 49152 },
];

/// The fuel whose shapes `spec` has exactly, if any.
pub fn fuel_for(spec: &ModelSpec) -> Option<&'static Fuel> {
    FUELS.iter().find(|f| {
        (f.hidden, f.ff, f.layers, f.heads, f.kv_heads, f.head_dim, f.vocab)
            == (spec.hidden_size, spec.intermediate_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size)
    })
}

/// End ids one launch can check (requests with more take the CUDA-graph path).
pub const MAX_END_IDS: usize = 64;
/// Steps one launch may run (the ring's size); longer generations relaunch.
pub const MAX_LOOP_STEPS: usize = 4096;
// Every request's logprobs fit a step's record in the ring.
const _: () = assert!(MAX_LOGPROBS <= LP_MAX);

/// One launch's inputs beyond the session.
pub(crate) struct Launch<'a> {
    pub kv: u64,
    /// Positions the KV cache at `kv` holds.
    pub capacity: usize,
    pub pos0: usize,
    pub first: u32,
    pub req: LoopRequest<'a>,
    /// Teacher forcing: step t < forced.len() feeds forced[t] next.
    pub forced: &'a [u32],
    /// Keep every step's logits (for tests) instead of only the argmax.
    pub keep_logits: bool,
    /// Stamp this step's timeline (`megakernel::profile`) into `Megakernel::last_trace`.
    pub trace_step: Option<usize>,
}

/// The device state of a sampled token loop (kernels/src/mk_race.cuh and
/// megakernel.cu `sample_token`): the request's SampleRow, its penalty state
/// (seen tokens as bits, generation counts), the race's tables (weights per
/// anchor level and bin, best key per bin: two sets by step parity, each zeroed
/// during the step after its own) and the
/// one-CTA sampler's candidate space.
struct LoopSampler {
    row: DeviceBuffer,
    seen_bits: DeviceBuffer,
    gen_counts: DeviceBuffer,
    race_mass: DeviceBuffer,
    race_keys: DeviceBuffer,
    items: DeviceBuffer,
    /// Logprobs in the loop (kernels/src/mk_logprobs.cuh): each SM's part and
    /// the step's raw logits (two of each, by step parity), and the device's
    /// copy of each step's record (the host reads the ring's).
    lp_parts: DeviceBuffer,
    lp_out: DeviceBuffer,
    lp_logits: DeviceBuffer,
    vocab: usize,
}

impl LoopSampler {
    /// For a grid of `sms` CTAs.
    fn alloc(ctx: &Context, vocab: usize, sms: usize) -> Result<Self> {
        Ok(LoopSampler {
            row: DeviceBuffer::alloc(ctx, std::mem::size_of::<SampleRow>(), "megakernel sampling")?,
            seen_bits: DeviceBuffer::alloc(ctx, vocab.div_ceil(32) * 4, "megakernel penalty state")?,
            gen_counts: DeviceBuffer::alloc(ctx, vocab * 4, "megakernel penalty state")?,
            // Two sets of tables by step parity: a step's are zeroed while the next runs (mk_race.cuh).
            race_mass: DeviceBuffer::alloc(ctx, 2 * RACE_LEVELS * RACE_MASS_BINS * 8, "megakernel sampler tables")?,
            // The best key per bin, or (top-k) each SM's list.
            race_keys: DeviceBuffer::alloc(ctx, (2 * RACE_KEY_BINS).max(sms * RACE_LIST) * 8, "megakernel sampler tables")?,
            items: DeviceBuffer::alloc(ctx, vocab * SAMPLE_ITEM_BYTES, "megakernel sampler candidates")?,
            // Two of each, by step parity (mk_logprobs.cuh): a step's record is merged while the next runs.
            lp_parts: DeviceBuffer::alloc(ctx, 2 * sms * LP_PART * 8, "megakernel logprobs")?,
            lp_out: DeviceBuffer::alloc(ctx, MAX_LOOP_STEPS * LP_WORDS * 4, "megakernel logprobs")?,
            lp_logits: DeviceBuffer::alloc(ctx, 2 * vocab * 4, "megakernel logprobs")?,
            vocab,
        })
    }

    /// Uploads a launch's sampling request; returns the address of its row.
    fn upload(&self, stream: &Stream, s: &SampleRequest<'_>) -> Result<u64> {
        self.row.upload(stream, 0, std::slice::from_ref(&sample_row(s)))?;
        // A launch that ended early (watchdog, stop) may have left a step's entries.
        self.race_mass.fill_u8(stream, 0)?;
        self.race_keys.fill_u8(stream, 0)?;
        if s.params.has_penalties() {
            let mut bits = vec![0u32; self.vocab.div_ceil(32)];
            let mut counts = vec![0u32; self.vocab];
            for (t, c) in s.history.penalty_entries().filter(|&(t, _)| (t as usize) < self.vocab) {
                bits[t as usize / 32] |= 1 << (t % 32);
                counts[t as usize] = c;
            }
            self.seen_bits.upload(stream, 0, &bits)?;
            self.gen_counts.upload(stream, 0, &counts)?;
        }
        Ok(self.row.ptr)
    }
}

pub(crate) struct Megakernel {
    /// Which fuel this is (the diagnostics report it).
    #[cfg(feature = "diagnostics")]
    pub fuel: &'static Fuel,
    function: Function,
    pub schedule: Schedule,
    grid: u32,
    vocab: usize,
    eps: f32,
    watchdog: Duration,
    base: Params,
    // Owned device memory behind `base`'s pointers.
    _instrs: DeviceBuffer,
    _sm_start: DeviceBuffer,
    _layers: DeviceBuffer,
    /// Every layer's down-projection transposed ([ff][hidden]), which the MLP instructions read.
    _down_t: DeviceBuffer,
    counters: DeviceBuffer,
    state: DeviceBuffer,
    _activations: Vec<DeviceBuffer>,
    end_ids: DeviceBuffer,
    forced: DeviceBuffer,
    /// Each step's token on the device; the kernel's host link forwards them to `ring`.
    _tokens: DeviceBuffer,
    logits_out: Option<DeviceBuffer>,
    trace: Option<DeviceBuffer>,
    /// The timestamps of the last launch that asked for a trace.
    pub last_trace: Option<Vec<u64>>,
    /// The last launch's sampled steps whose token the one-CTA sampler picked
    /// (`ST_ONE_CTA`): every step of a top-k above 64, none where the SMs' merge decides.
    pub last_one_cta_steps: usize,
    /// A launch the host gave up on (see `hung`).
    hung: bool,
    sampler: LoopSampler,
    ring: MappedBuffer,
    /// Why the megakernel must not be launched again (a launch the host gave up
    /// on may still be running and writing the ring).
    broken: Option<String>,
}

/// The MLP instructions read the down-projection by columns (each SM the
/// columns of the act rows it computed): a transposed copy of every layer's,
/// [ff][hidden] each, back to back, made on the device (kernels/src/transpose.cu).
/// Returns the buffer and each layer's copy in it.
fn transposed_down(ctx: &Context, module: &Module, stream: &Stream, spec: &ModelSpec, w: &DeviceWeights) -> Result<(DeviceBuffer, Vec<u64>)> {
    let (d, ff) = (spec.hidden_size, spec.intermediate_size);
    let bytes = (d * ff * 2) as u64;
    let out = DeviceBuffer::alloc(ctx, bytes as usize * w.layers.len(), "the megakernel's transposed down-projections")?;
    let transpose = module.function("transpose_bf16")?;
    let mut copies = Vec::with_capacity(w.layers.len());
    for (i, l) in w.layers.iter().enumerate() {
        let dst = out.ptr + i as u64 * bytes;
        let args = [Arg::Ptr(l.down), Arg::Ptr(dst), Arg::I32(d as i32), Arg::I32(ff as i32)];
        transpose.launch_ex(stream, (ff.div_ceil(32) as u32, d.div_ceil(32) as u32, 1), 256, 0, false, &args)?;
        copies.push(dst);
    }
    Ok((out, copies))
}

// The megakernel's tuning, settled by measurement (benches/NOTES.md keeps the
// figures); the kernel takes them as launch parameters.

/// Ring chunks a layer's Qkv, OProj and Mlp instruction keeps until the next
/// one's wait, so fewer weights stream into the SM while it stores and releases
/// its results; more or fewer measured slower.
const HOLD_CHUNKS: [i32; 3] = [4, 8, 8];
/// u32 words from one dependency counter to the next: each on a 128-byte line
/// of its own, so the polls of one and the atomic adds to its neighbours do not
/// meet in one L2 line.
const COUNTER_STRIDE: usize = 32;
/// Dependency polls sleep 32 ns between reads (spinning was an experiment, not adopted).
const POLL_SPIN: bool = false;
/// Weight copies pass through L2 as evict-first, so they do not push out
/// activations, K/V and norm weights.
const WEIGHTS_EVICT_FIRST: bool = true;

impl Megakernel {
    /// The megakernel for `spec` on this GPU, or an error saying why it cannot run.
    ///
    /// `watchdog`: how long a wait on one dependency counter may last before the
    /// kernel gives up (`GpuOptions::watchdog`).
    pub(crate) fn new(ctx: &Context, module: &Module, stream: &Stream, spec: &ModelSpec, w: &DeviceWeights, watchdog: Duration) -> Result<Self> {
        let fuel = fuel_for(spec).ok_or_else(|| {
            let names: Vec<&str> = FUELS.iter().map(|f| f.name).collect();
            RocketError::Device(format!("the megakernel has no instantiation for these shapes (fuels: {})", names.join(", ")))
        })?;
        let function = module.function(fuel.kernel)?;
        function.set_max_dynamic_smem(SMEM_BYTES)?;
        if function.max_active_blocks(THREADS as u32, SMEM_BYTES)? < 1 {
            return Err(RocketError::Device(format!("{} cannot fit one megakernel CTA ({SMEM_BYTES} bytes of shared memory) per SM", ctx.name)));
        }
        let sms = ctx.sm_count as usize;
        let schedule = Schedule::compile(spec, sms)?;
        // The kernel reads no slot operand: a batched schedule would run slot 0 for every slot.
        if schedule.batch_slots != 1 {
            return Err(RocketError::Internal(format!("the megakernel runs one sequence, not {} batch slots", schedule.batch_slots)));
        }
        verify(&schedule, spec).map_err(|e| RocketError::Internal(format!("megakernel schedule for {sms} SMs: {e}")))?;
        let (words, starts) = schedule.encode();
        let instrs = DeviceBuffer::with_data(ctx, stream, &words, "the megakernel schedule")?;
        let sm_start = DeviceBuffer::with_data(ctx, stream, &starts, "the megakernel schedule")?;
        let (down_t, down_t_layers) = transposed_down(ctx, module, stream, spec, w)?;
        let table: Vec<LayerPtrs> = w
            .layers
            .iter()
            .zip(&down_t_layers)
            .map(|(l, &down_t)| LayerPtrs {
                attn_norm: l.attn_norm,
                qkv: l.qkv,
                q_norm: l.q_norm,
                k_norm: l.k_norm,
                o: l.o,
                mlp_norm: l.mlp_norm,
                gate_up: l.gate_up,
                down_t,
            })
            .collect();
        let layers = DeviceBuffer::with_data(ctx, stream, &table, "the megakernel layer table")?;

        // (bytes, poison byte) of each buffer: f32s are NaN until written, the
        // fixed-point sums ~2.1e9 (from_fixed of 0x7f7f...).
        let f = |n: usize| (n * 4, 0xff);
        let heads_splits = spec.num_heads * schedule.splits;
        let sizes = [
            f(spec.hidden_size),
            f(spec.q_dim() + 2 * spec.kv_dim()),
            (spec.hidden_size * 8, 0x7f), // mlp_acc: 64-bit fixed point
            f(spec.vocab_size),
            f(heads_splits * spec.head_dim),
            f(heads_splits * 2),
            f(2 * schedule.lm_tiles), // lm_max: a float per SM, or a double (the race's key)
            f(schedule.lm_tiles),
        ];
        let activations = sizes.iter().map(|&(n, _)| DeviceBuffer::alloc(ctx, n, "megakernel activations")).collect::<Result<Vec<_>>>()?;
        for (a, &(_, poison)) in activations.iter().zip(&sizes) {
            a.fill_u8(stream, poison)?;
        }
        let counters = DeviceBuffer::alloc(ctx, schedule.counters.count() * COUNTER_STRIDE * 4, "megakernel counters")?;
        let state = DeviceBuffer::alloc(ctx, STATE_WORDS * 4, "megakernel state")?;
        let end_ids = DeviceBuffer::alloc(ctx, MAX_END_IDS * 4, "megakernel end ids")?;
        let forced = DeviceBuffer::alloc(ctx, MAX_LOOP_STEPS * 4, "megakernel forced tokens")?;
        let tokens = DeviceBuffer::alloc(ctx, MAX_LOOP_STEPS * 4, "megakernel tokens")?;
        let sampler = LoopSampler::alloc(ctx, spec.vocab_size, sms)?;
        // Tokens, then (for launches with logprobs) each step's record.
        let ring = MappedBuffer::alloc(RING_TOKENS + MAX_LOOP_STEPS * (1 + LP_WORDS))?;
        let p = |i: usize| activations[i].ptr;
        let base = Params {
            instrs: instrs.ptr,
            sm_start: sm_start.ptr,
            counters: counters.ptr,
            state: state.ptr,
            layers: layers.ptr,
            embed: w.embed,
            lm_head: w.lm_head,
            final_norm: w.final_norm,
            inv_freq: w.inv_freq,
            x: p(0),
            qkv: p(1),
            mlp_acc: p(2),
            logits: p(3),
            part_o: p(4),
            part_ml: p(5),
            lm_max: p(6),
            lm_idx: p(7),
            end_ids: end_ids.ptr,
            forced: forced.ptr,
            tokens: tokens.ptr,
            seen_bits: sampler.seen_bits.ptr,
            gen_counts: sampler.gen_counts.ptr,
            sample_items: sampler.items.ptr,
            race_mass: sampler.race_mass.ptr,
            race_keys: sampler.race_keys.ptr,
            lp_parts: sampler.lp_parts.ptr,
            lp_logits: sampler.lp_logits.ptr,
            ring: ring.device_ptr,
            lm_tiles: schedule.lm_tiles as i32,
            splits: schedule.splits as i32,
            eps: spec.rms_norm_eps as f32,
            poll_spin: POLL_SPIN as i32,
            weights_evict_first: WEIGHTS_EVICT_FIRST as i32,
            hold_qkv: HOLD_CHUNKS[0],
            hold_oproj: HOLD_CHUNKS[1],
            hold_mlp: HOLD_CHUNKS[2],
            counter_stride: COUNTER_STRIDE as i32,
            ..Params::default()
        };
        stream.sync()?;
        tracing::info!(fuel = fuel.name, sms, instructions = schedule.len(), splits = schedule.splits, "megakernel ready");
        Ok(Megakernel {
            #[cfg(feature = "diagnostics")]
            fuel,
            function,
            grid: sms as u32,
            vocab: spec.vocab_size,
            eps: spec.rms_norm_eps as f32,
            watchdog,
            base,
            schedule,
            _instrs: instrs,
            _sm_start: sm_start,
            _layers: layers,
            _down_t: down_t,
            counters,
            state,
            _activations: activations,
            end_ids,
            forced,
            _tokens: tokens,
            logits_out: None,
            trace: None,
            last_trace: None,
            last_one_cta_steps: 0,
            hung: false,
            sampler,
            ring,
            broken: None,
        })
    }

    pub(crate) fn vocab(&self) -> usize {
        self.vocab
    }

    /// False once a launch failed (watchdog, fault): callers decode another way.
    pub(crate) fn in_service(&self) -> bool {
        self.broken.is_none()
    }

    /// Whether a launch the host gave up on may still occupy the GPU: nothing
    /// else queued behind it on the stream would ever run.
    pub(crate) fn hung(&self) -> bool {
        self.hung
    }

    /// Runs one token loop. `on_token(step, token, logprobs)` gets each step's
    /// token as it is published (with its logprobs when the request asks for
    /// them); returning false raises the stop flag (the device may run a step or
    /// two more, whose tokens are dropped). With `keep_logits`, returns every
    /// step's logits too ([steps][vocab]).
    pub(crate) fn run(
        &mut self,
        ctx: &Context,
        stream: &Stream,
        launch: &Launch<'_>,
        on_token: &mut dyn FnMut(usize, u32, Option<TokenLogprob>) -> bool,
    ) -> Result<(LoopOutcome, Option<Vec<f32>>)> {
        if let Some(why) = &self.broken {
            return Err(MegakernelError::OutOfService { reason: why.clone() }.into());
        }
        // Work queued before this launch (a new session's KV poison fill, uploads)
        // must land before the host resets the mapped ring the kernel reads.
        // A launch the host gave up on never gets here: it marked us broken.
        stream.sync()?;
        let req = &launch.req;
        let steps = req.max_steps;
        if steps == 0 || steps > MAX_LOOP_STEPS {
            return Err(RocketError::invalid_arg("max_steps", steps, format!("must be in 1..={MAX_LOOP_STEPS} per launch")));
        }
        if req.end_ids.len() > MAX_END_IDS {
            return Err(RocketError::invalid_arg("stop_token_ids", req.end_ids.len(), format!("at most {MAX_END_IDS} end ids on the device")));
        }
        if launch.forced.len() > steps {
            return Err(RocketError::Internal(format!("{} forced tokens for {steps} steps", launch.forced.len())));
        }
        if launch.pos0 + steps > launch.capacity {
            return Err(RocketError::ContextOverflow { prompt_tokens: launch.pos0, max_tokens: steps, limit: launch.capacity });
        }
        if let Some(&bad) = std::iter::once(&launch.first).chain(launch.forced).find(|&&t| t as usize >= self.vocab) {
            return Err(RocketError::invalid_arg("token id", bad, format!("must be < vocab size {}", self.vocab)));
        }
        if !req.end_ids.is_empty() {
            self.end_ids.upload(stream, 0, req.end_ids)?;
        }
        if !launch.forced.is_empty() {
            self.forced.upload(stream, 0, launch.forced)?;
        }
        let logits_out = if launch.keep_logits {
            let b = grown(&mut self.logits_out, ctx, steps * self.vocab * 4, "megakernel logits")?;
            b.fill_u8(stream, 0xff)?;
            b.ptr
        } else {
            0
        };
        let sample = match &req.sampling {
            Some(s) => self.sampler.upload(stream, s)?,
            None => 0,
        };
        // Alternatives per step when the request asks for logprobs (a sampled request: greedy ones
        // with logprobs come with a SampleRow too).
        let logprobs = req.sampling.as_ref().and_then(|s| s.params.logprobs);
        if let Some(n) = logprobs.filter(|&n| n > LP_MAX) {
            return Err(RocketError::invalid_arg("logprobs", n, format!("at most {LP_MAX} in the megakernel's loop")));
        }
        self.counters.fill_u8(stream, 0)?;
        self.state.fill_u8(stream, 0)?;
        // The device writes each token once; the host waits for the sentinel to change.
        self.ring.write(RING_STOP, 0);
        self.ring.write(RING_FAULT, 0);
        for i in 0..steps {
            self.ring.write(RING_TOKENS + i, RING_EMPTY);
        }
        let params = Params {
            kv: launch.kv,
            logits_out,
            watchdog_ns: self.watchdog.as_nanos() as u64,
            pos0: launch.pos0 as i32,
            first_token: launch.first,
            max_steps: steps as i32,
            n_forced: launch.forced.len() as i32,
            n_end: req.end_ids.len() as i32,
            mask_end_steps: req.mask_end_steps.min(steps) as i32,
            sample,
            lp_out: if logprobs.is_some() { self.sampler.lp_out.ptr } else { 0 },
            logprobs: logprobs.unwrap_or(0) as i32,
            eps: self.eps,
            ..self.base
        };
        let params = match launch.trace_step {
            Some(step) if step < steps => {
                let b = grown(&mut self.trace, ctx, trace_words(&self.schedule) * 8, "megakernel trace")?;
                b.fill_u8(stream, 0)?;
                Params { trace: b.ptr, trace_step: step as i32, ..params }
            }
            Some(step) => return Err(RocketError::invalid_arg("trace step", step, format!("must be < the launch's {steps} steps"))),
            None => params,
        };
        self.last_trace = None;
        let cpu_start = thread_cpu_seconds();
        self.function.launch_cooperative(stream, self.grid, THREADS as u32, SMEM_BYTES, &params)?;

        // Poll: hand tokens on as they land; sleep between looks (PollPacer) so the host stays idle.
        // A launch that publishes nothing for longer than the device's own watchdog
        // could take to end it is reported rather than waited on forever (time
        // spent in `on_token` does not count: it restarts the clock).
        let stall_limit = self.watchdog * 4 + Duration::from_secs(2);
        let mut last_progress = std::time::Instant::now();
        let (mut seen, mut accepted, mut stopped) = (0usize, 0usize, false);
        let mut pacer = PollPacer::default();
        // Whether the loop ends at the token of step `step`: an end id, once
        // free-running (the kernel's `pick_token` rule).
        let ends_at = |step: usize, token: u32| step >= launch.forced.len() && req.end_ids.contains(&token);
        let mut ending = false;
        loop {
            let finished = match stream.is_idle() {
                Ok(done) => done,
                Err(e) => return Err(self.fault_error(e)),
            };
            let before = seen;
            while seen < steps {
                let token = self.ring.read(RING_TOKENS + seen);
                if token == RING_EMPTY {
                    break;
                }
                if !stopped {
                    accepted += 1;
                    let lp = logprobs.map(|n| self.logprob_record(steps, seen, token, n));
                    if !on_token(seen, token, lp) {
                        stopped = true;
                        self.ring.write(RING_STOP, 1);
                    }
                }
                ending |= ends_at(seen, token);
                seen += 1;
            }
            if seen > before {
                last_progress = std::time::Instant::now();
                pacer.saw(last_progress, seen - before);
            }
            if finished {
                break;
            }
            if last_progress.elapsed() > stall_limit && !stream.is_idle().unwrap_or(false) {
                self.ring.write(RING_STOP, 1);
                let e = MegakernelError::Hung { silent_seconds: stall_limit.as_secs_f64(), step: seen, watchdog_ms: self.watchdog_ms() };
                self.broken = Some(e.to_string());
                self.hung = true;
                return Err(e.into());
            }
            // Where the launch is about to end (its last step, the host's stop, an
            // end id), look again at the fine poll: the GPU is idle until the host sees it.
            let ending = ending || stopped || seen >= steps;
            std::thread::sleep(if ending { poll_pacer::STEP } else { pacer.sleep(std::time::Instant::now()) });
        }
        stream.sync().map_err(|e| self.fault_error(e))?;
        let mut state = [0u32; STATE_WORDS];
        self.state.download(stream, 0, &mut state)?;
        if let Some(e) = MegakernelError::from_state(&state, &self.schedule, self.watchdog_ms()) {
            // A stall is a device or schedule fault that would come back: later
            // requests decode with CUDA graphs (see `in_service`).
            self.broken = Some(e.to_string());
            return Err(e.into());
        }
        let device_steps = state[ST_STEPS] as usize;
        self.last_one_cta_steps = state[ST_ONE_CTA] as usize;
        if seen != device_steps {
            let e = MegakernelError::LostTokens { device_steps, published: seen };
            self.broken = Some(e.to_string());
            return Err(e.into());
        }
        let logits = match (&self.logits_out, launch.keep_logits) {
            (Some(b), true) => {
                let mut v = vec![0f32; device_steps * self.vocab];
                b.download(stream, 0, &mut v)?;
                Some(v)
            }
            _ => None,
        };
        if launch.trace_step.is_some() {
            let mut stamps = vec![0u64; trace_words(&self.schedule)];
            self.trace.as_ref().expect("allocated for the launch").download(stream, 0, &mut stamps)?;
            self.last_trace = Some(stamps);
        }
        let host_cpu_seconds = thread_cpu_seconds() - cpu_start;
        Ok((LoopOutcome { accepted, device_steps, host_cpu_seconds }, logits))
    }

    /// Step `step`'s logprob record in the ring (a launch of `steps` steps, `n`
    /// alternatives), read once its token has landed: the host link stores the
    /// record, then fences, then the token.
    fn logprob_record(&self, steps: usize, step: usize, token: u32, n: usize) -> TokenLogprob {
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        let at = RING_TOKENS + steps + step * LP_WORDS;
        let word = |i: usize| self.ring.read(at + i);
        let top = (0..n).map(|i| (word(1 + 2 * i), f32::from_bits(word(2 + 2 * i)))).take_while(|&(id, _)| id != RING_EMPTY).collect();
        TokenLogprob { token_id: token, logprob: f32::from_bits(word(0)), top }
    }

    /// A failed launch, with the device's note when it trapped on a weight copy
    /// that never landed (the CUDA context is lost then).
    fn fault_error(&mut self, e: RocketError) -> RocketError {
        self.broken = Some(format!("a launch failed: {e}"));
        match MegakernelError::from_fault_word(self.ring.read(RING_FAULT), self.watchdog_ms(), &e) {
            Some(fault) => fault.into(),
            None => e,
        }
    }

    fn watchdog_ms(&self) -> u64 {
        self.watchdog.as_millis() as u64
    }

    /// Launches a copy of the schedule in which one wait can never be met, with a
    /// short watchdog (`kv` must hold 2 positions), and returns the error it must
    /// end with (a hang would be a failure of the watchdog). The real schedule is
    /// restored afterwards.
    #[cfg(feature = "diagnostics")]
    pub(crate) fn watchdog_probe(&mut self, ctx: &Context, stream: &Stream, kv: u64) -> Result<MegakernelError> {
        let mut broken = self.schedule.clone();
        let last = self.schedule.counters.layers - 1;
        for i in broken.per_sm.iter_mut().flatten().filter(|i| i.op == crate::megakernel::Op::Mlp && i.layer as usize == last) {
            i.wait.per_step += 1;
        }
        let (words, _) = broken.encode();
        let probe = DeviceBuffer::with_data(ctx, stream, &words, "the watchdog probe")?;
        let (real, real_schedule, real_watchdog) = (self.base.instrs, std::mem::replace(&mut self.schedule, broken), self.watchdog);
        self.base.instrs = probe.ptr;
        self.watchdog = Duration::from_millis(200);
        let launch = Launch {
            kv,
            capacity: 2,
            pos0: 0,
            first: 1,
            req: LoopRequest { max_steps: 2, end_ids: &[], mask_end_steps: 0, sampling: None },
            forced: &[],
            keep_logits: false,
            trace_step: None,
        };
        let outcome = self.run(ctx, stream, &launch, &mut |_, _, _| true);
        self.base.instrs = real;
        self.schedule = real_schedule;
        self.watchdog = real_watchdog;
        match outcome {
            Err(RocketError::Megakernel(e @ MegakernelError::Watchdog { .. })) => {
                self.broken = None; // the stall was the probe's own
                Ok(e)
            }
            Err(RocketError::Megakernel(e)) => Ok(e),
            Err(e) => Err(e),
            Ok(_) => Err(RocketError::Internal("a schedule with an impossible wait ran to the end".into())),
        }
    }
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes one timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fuels_have_kernels_and_schedules() {
        let kernels = include_str!("../../../../../kernels/src/megakernel.cu");
        for f in FUELS {
            let line = format!("MEGAKERNEL({}, {}, {}, {}, {}, {}, {}, {})", f.kernel, f.hidden, f.ff, f.layers, f.heads, f.kv_heads, f.head_dim, f.vocab);
            assert!(kernels.contains(&line), "megakernel.cu lacks `{line}`");
        }
    }
}

//! Entry points of the CUDA backend for tests and measurements (feature
//! `diagnostics`): megakernel runs with teacher forcing, kept logits, a traced
//! step or a forced stall, the device sampler on given logits, and the fp16
//! conversions of cuBLASLt's operands. The product decodes through
//! `Backend::decode_loop` and `forward_sample` instead.

use super::driver::{DeviceBuffer, Stream};
use super::kernels::Kernels;
use super::megakernel::{Launch, Megakernel, MAX_LOOP_STEPS};
use super::{own_session, CudaBackend, CudaSession};
use crate::backend::{Backend, LoopRequest, SampleRequest, Session};
use crate::error::{Result, RocketError};
use crate::megakernel::{MegakernelError, Profile};
use crate::output::TokenLogprob;

/// `megakernel_sampled`'s result.
pub struct SampledLoop {
    /// The sampled tokens.
    pub tokens: Vec<u32>,
    /// Their raw logits ([tokens][vocab]).
    pub logits: Vec<f32>,
    /// The launch's steps the one-CTA sampler picked.
    pub one_cta_steps: usize,
    /// Each sampled token's logprobs from the kernel, when the request asks for them.
    pub logprobs: Vec<Option<TokenLogprob>>,
}

/// The kernels with an fp16 output of their own (`fused_f16_on_device`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FusedF16 {
    RmsNorm,
    SiluMul,
}

/// `fused_f16_on_device`'s result: the fused kernel's fp16 bits and range flag,
/// and those of the f32 kernel followed by to_f16.
#[derive(Debug, Clone)]
pub struct FusedF16Check {
    pub fused: Vec<u16>,
    pub separate: Vec<u16>,
    pub fused_flag: bool,
    pub separate_flag: bool,
}

impl CudaBackend {
    /// The fuel whose megakernel decodes at batch 1, or None (CUDA-graph path).
    pub fn megakernel_fuel(&self) -> Result<Option<&'static str>> {
        Ok(self.lock()?.megakernel.as_ref().map(|m| m.fuel.name))
    }

    /// Teacher forcing through the megakernel: feeds `ids` one per step into a
    /// fresh sequence and returns each step's argmax and logits ([len][vocab]).
    /// None when no megakernel is loaded.
    pub fn megakernel_teacher_forced(&self, ids: &[u32]) -> Result<Option<(Vec<u32>, Vec<f32>)>> {
        self.megakernel_forced(ids, None, (&[], 0), true, None, |_, tokens, _, logits| Ok((tokens, logits.expect("asked for logits"))))
    }

    /// The product's megakernel decode (`Backend::decode_loop`'s launch, on
    /// `session` from its current length) for up to `steps` greedy steps, with
    /// every step's logits kept: `first` is fed at the session's next position,
    /// then each step's argmax, or with `forced` (at most steps - 1 tokens)
    /// forced[t] after step t (teacher forcing). Returns each step's argmax and
    /// logits ([steps][vocab]); the session keeps the steps as `decode_loop`
    /// leaves them. None when no megakernel is loaded or it is out of service.
    pub fn megakernel_decode_logits(&self, session: &mut dyn Session, first: u32, forced: &[u32], steps: usize) -> Result<Option<(Vec<u32>, Vec<f32>)>> {
        if steps == 0 || forced.len() >= steps {
            return Err(RocketError::invalid_arg("steps", steps, format!("need at least 1 and more than the {} forced tokens", forced.len())));
        }
        let req = LoopRequest { max_steps: steps, end_ids: &[], mask_end_steps: 0, sampling: None };
        let mut tokens = Vec::with_capacity(steps);
        let ran = self.loop_on_session(session, first, &req, forced, true, &mut |t, _| {
            tokens.push(t);
            true
        })?;
        Ok(ran.map(|(_, logits)| (tokens, logits.expect("asked for logits"))))
    }

    /// A sampled token loop in the megakernel: teacher-forces `prompt`, then
    /// samples up to `steps` tokens with `sampling` (its history, step, end ids
    /// and min_tokens as a request in the middle of its generation would have
    /// them), stopping after an end id. Returns the sampled tokens and each
    /// one's raw logits ([tokens][vocab]), for checking against the host
    /// sampler, and how many of the launch's steps (the prompt's included) the
    /// one-CTA sampler picked instead of the SMs together. None when no
    /// megakernel is loaded.
    pub fn megakernel_sampled(&self, prompt: &[u32], sampling: &SampleRequest<'_>, steps: usize) -> Result<Option<SampledLoop>> {
        if prompt.is_empty() || steps == 0 {
            return Err(RocketError::invalid_arg("prompt", prompt.len(), "needs a prompt and at least one step"));
        }
        let forced = prompt.len() - 1;
        let mut ids = prompt.to_vec();
        ids.resize(prompt.len() + steps - 1, 0); // room for the sampled steps (their inputs are the samples)
        // Step t samples with counter step + t: the first sampled step (t = forced) draws with counter 0.
        let shifted = SampleRequest { step: sampling.step.wrapping_sub(forced as u64), ..*sampling };
        let vocab = self.spec.vocab_size;
        // The device counts min_tokens' masked steps from the launch's first (forced) step.
        let masked = forced + sampling.params.min_tokens.saturating_sub(sampling.history.generated_len());
        self.megakernel_forced(&ids, Some((forced, shifted)), (sampling.end_ids, masked), true, None, |mk, tokens, logprobs, logits| {
            let logits = logits.expect("asked for logits");
            Ok(SampledLoop {
                tokens: tokens[forced..].to_vec(),
                logits: logits[forced * vocab..].to_vec(),
                one_cta_steps: mk.last_one_cta_steps,
                logprobs: logprobs[forced..].to_vec(),
            })
        })
    }

    /// Where the megakernel's time goes: teacher-forces `ids` and reads the
    /// kernel's timestamps of step `step` (see `megakernel::profile`). With
    /// `sampling`, only the first id is forced and every later step samples as
    /// the request says (end ids never stop the launch), so the traced step's
    /// LM head includes the SMs' sampler parts and the merge. None when no
    /// megakernel is loaded.
    pub fn megakernel_profile(&self, ids: &[u32], step: usize, sampling: Option<&SampleRequest<'_>>) -> Result<Option<Profile>> {
        if step >= ids.len() {
            return Err(RocketError::invalid_arg("step", step, format!("must be < the {} steps of the run", ids.len())));
        }
        let sampled = sampling.map(|r| (0, SampleRequest { end_ids: &[], ..*r }));
        self.megakernel_forced(ids, sampled, (&[], 0), false, Some(step), |mk, _, _, _| {
            let stamps = mk.last_trace.take().ok_or_else(|| RocketError::Internal("the traced launch left no trace".into()))?;
            Profile::from_trace(&mk.schedule, &stamps)
        })
    }

    /// One megakernel launch over a fresh sequence fed `ids` one per step (all
    /// of them, or with `sampled = (n, request)` the first n + 1, then the
    /// request's samples), ending at `end.0` ids after the first `end.1` steps;
    /// `finish` gets the megakernel, each step's token and logprobs (when the
    /// request asks for them) and (with `keep_logits`) the logits. None when no
    /// megakernel is loaded.
    #[allow(clippy::too_many_arguments)]
    fn megakernel_forced<T>(
        &self,
        ids: &[u32],
        sampled: Option<(usize, SampleRequest<'_>)>,
        end: (&[u32], usize),
        keep_logits: bool,
        trace_step: Option<usize>,
        finish: impl FnOnce(&mut Megakernel, Vec<u32>, Vec<Option<TokenLogprob>>, Option<Vec<f32>>) -> Result<T>,
    ) -> Result<Option<T>> {
        if ids.is_empty() || ids.len() > MAX_LOOP_STEPS {
            return Err(RocketError::invalid_arg("ids", ids.len(), format!("need 1..={MAX_LOOP_STEPS} tokens")));
        }
        let mut session = self.new_session(ids.len())?;
        let kv = own_session::<CudaSession>(session.as_mut(), "cuda")?.kv.ptr;
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let Some(mk) = inner.megakernel.as_mut() else { return Ok(None) };
        let forced = sampled.map_or(ids.len() - 1, |(n, _)| n);
        let req = LoopRequest { max_steps: ids.len(), end_ids: end.0, mask_end_steps: end.1, sampling: sampled.map(|(_, s)| s) };
        let launch = Launch { kv, capacity: ids.len(), pos0: 0, first: ids[0], req, forced: &ids[1..=forced], keep_logits, trace_step };
        let (mut tokens, mut logprobs) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
        let (_, logits) = mk.run(&inner.ctx, &inner.stream, &launch, &mut |_, t, lp| {
            tokens.push(t);
            logprobs.push(lp);
            true
        })?;
        finish(mk, tokens, logprobs, logits).map(Some)
    }

    /// The device sampler on given logits rows (`requests.len()` rows of vocab):
    /// what `forward_sample` runs after a pass, for checking it against
    /// `SampleRequest::sample_on_host`.
    pub fn sample_on_device(&self, logits: &[f32], requests: &[SampleRequest<'_>]) -> Result<Vec<u32>> {
        let vocab = self.spec.vocab_size;
        if logits.len() != requests.len() * vocab {
            return Err(RocketError::invalid_arg("logits", logits.len(), format!("need {} rows of {vocab}", requests.len())));
        }
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let rows = DeviceBuffer::alloc(&inner.ctx, logits.len().max(1) * 4, "logits to sample")?;
        rows.upload(&inner.stream, 0, logits)?;
        inner.sampler.sample(&inner.ctx, &inner.stream, &inner.kernels, rows.ptr, vocab, requests)
    }

    /// Runs the megakernel on a schedule with a wait that can never be met and
    /// returns the error it ended with: the watchdog's, unless something else
    /// went wrong (a hang here is the failure). None when no megakernel is loaded.
    pub fn megakernel_watchdog_probe(&self) -> Result<Option<MegakernelError>> {
        let mut session = self.new_session(2)?;
        let kv = own_session::<CudaSession>(session.as_mut(), "cuda")?.kv.ptr;
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let Some(mk) = inner.megakernel.as_mut() else { return Ok(None) };
        mk.watchdog_probe(&inner.ctx, &inner.stream, kv).map(Some)
    }

    /// to_f16.cu's `to_f16` on `values`: their fp16 bits and whether the range
    /// flag was set.
    pub fn to_f16_on_device(&self, values: &[f32]) -> Result<(Vec<u16>, bool)> {
        self.conversion_on_device(values, Kernels::to_f16)
    }

    /// to_f16.cu's `bf16_to_f16` on bf16 `bits`: their fp16 bits and whether the
    /// range flag was set.
    pub fn bf16_to_f16_on_device(&self, bits: &[u16]) -> Result<(Vec<u16>, bool)> {
        self.conversion_on_device(bits, Kernels::bf16_to_f16)
    }

    /// One of to_f16.cu's conversions (`convert(stream, x, y, n, flag)`) on `input`,
    /// into outputs poisoned with 0xffff.
    fn conversion_on_device<T: Copy>(&self, input: &[T], convert: impl Fn(&Kernels, &Stream, u64, u64, usize, u64) -> Result<()>) -> Result<(Vec<u16>, bool)> {
        let inner = self.lock()?;
        let (ctx, st) = (&inner.ctx, &inner.stream);
        let x = DeviceBuffer::with_data(ctx, st, input, "the conversion check's inputs")?;
        let y = DeviceBuffer::with_data(ctx, st, &vec![0xffffu16; input.len()], "the conversion check's outputs")?;
        let flag = DeviceBuffer::with_data(ctx, st, &[0u32], "the conversion check's flag")?;
        convert(&inner.kernels, st, x.ptr, y.ptr, input.len(), flag.ptr)?;
        let mut out = vec![0u16; input.len()];
        y.download(st, 0, &mut out)?;
        let mut set = [0u32];
        flag.download(st, 0, &mut set)?;
        Ok((out, set[0] != 0))
    }

    /// The fused fp16 outputs against the separate rounding, on the device:
    /// `rows` rows of `input` (RmsNorm: x [rows][dim] with the norm weights
    /// `weights` [dim]; SiluMul: gate|up [rows][2 dim], `weights` unused) through
    /// rms_norm_f16 / silu_mul_f16, and through rms_norm / silu_mul then to_f16
    /// (`to_f16_on_device` on their f32 outputs). Outputs are poisoned.
    pub fn fused_f16_on_device(&self, op: FusedF16, input: &[f32], weights: &[f32], dim: usize, rows: usize) -> Result<FusedF16Check> {
        let width = match op {
            FusedF16::RmsNorm => dim,
            FusedF16::SiluMul => 2 * dim,
        };
        if input.len() != rows * width || (op == FusedF16::RmsNorm && weights.len() != dim) {
            return Err(RocketError::Internal(format!("fused_f16_on_device: {} inputs, {} weights for {rows} rows of {dim}", input.len(), weights.len())));
        }
        let n = rows * dim;
        let (fused, fused_flag, wide) = {
            let inner = self.lock()?;
            let (ctx, st, k) = (&inner.ctx, &inner.stream, &inner.kernels);
            let x = DeviceBuffer::with_data(ctx, st, input, "the fused fp16 check's inputs")?;
            let w = DeviceBuffer::with_data(ctx, st, if weights.is_empty() { &[0.0f32][..] } else { weights }, "the fused fp16 check's weights")?;
            let wide = DeviceBuffer::with_data(ctx, st, &vec![f32::NAN; n], "the fused fp16 check's f32 outputs")?;
            let fused = DeviceBuffer::with_data(ctx, st, &vec![0xffffu16; n], "the fused fp16 check's outputs")?;
            let flag = DeviceBuffer::with_data(ctx, st, &[0u32], "the fused fp16 check's flag")?;
            let eps = 1e-6;
            match op {
                FusedF16::RmsNorm => {
                    k.rms_norm_f16(st, x.ptr, w.ptr, fused.ptr, dim, eps, rows, flag.ptr)?;
                    k.rms_norm(st, x.ptr, w.ptr, wide.ptr, dim, eps, 0, rows)?;
                }
                FusedF16::SiluMul => {
                    k.silu_mul_f16(st, x.ptr, fused.ptr, dim, rows, flag.ptr)?;
                    k.silu_mul(st, x.ptr, wide.ptr, dim, rows)?;
                }
            }
            let (mut bits, mut set, mut values) = (vec![0u16; n], [0u32], vec![0f32; n]);
            fused.download(st, 0, &mut bits)?;
            flag.download(st, 0, &mut set)?;
            wide.download(st, 0, &mut values)?;
            (bits, set[0] != 0, values)
        };
        let (separate, separate_flag) = self.to_f16_on_device(&wide)?;
        Ok(FusedF16Check { fused, separate, fused_flag, separate_flag })
    }

    /// An access through a null pointer (to_f16 on address 0x100), after the
    /// pass in flight: an illegal address is sticky, so the context, and every
    /// later pass of this backend, fails as on a lost GPU (other GPUs' contexts
    /// are their own; the several-GPU test checks that they serve on). Returns
    /// the device's error, once a second sync shows that it stuck.
    pub fn inject_device_fault(&self) -> Result<String> {
        let inner = self.lock()?;
        let st = &inner.stream;
        let launched = inner.kernels.to_f16(st, 0x100, 0x100, 4096, 0x100);
        let fault = match launched.and_then(|()| st.sync()) {
            Err(e) if e.to_string().contains("ILLEGAL_ADDRESS") => e.to_string(),
            Err(e) => return Err(RocketError::Internal(format!("the injected fault gave another error: {e}"))),
            Ok(()) => return Err(RocketError::Internal("an access through a null pointer did not fault the device".into())),
        };
        match st.sync() {
            Err(_) => Ok(fault),
            Ok(()) => Err(RocketError::Internal(format!("the device recovered from the injected fault ({fault})"))),
        }
    }

    /// Which operands cuBLASLt's products take now: "fp16" (the fp16 copy is
    /// made, or will be at the first pass that needs it), "bf16 hi+lo" (a
    /// weight or a pass's activations were past fp16's range, or there was no
    /// room for the copy), or "none" (no cuBLASLt loaded).
    pub fn cublas_operands(&self) -> Result<&'static str> {
        let inner = self.lock()?;
        Ok(match (&inner.kernels.cublas, &inner.f16) {
            (None, _) => "none",
            (Some(_), super::F16Copy::Off) => "bf16 hi+lo",
            (Some(_), super::F16Copy::NotYet | super::F16Copy::Ready(_)) => "fp16",
        })
    }

    /// Bytes of the fp16 copy of the layers' matrices held now (0: none yet, or none).
    pub fn f16_copy_bytes(&self) -> Result<usize> {
        Ok(self.lock()?.f16.ready().map_or(0, |copy| copy.bytes))
    }
}

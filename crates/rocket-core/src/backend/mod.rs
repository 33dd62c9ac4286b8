//! Backends run the model: `cpu` is the f32 reference and the oracle every
//! faster backend is checked against.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use std::any::Any;
use std::num::NonZeroUsize;

use crate::error::{Result, RocketError};
use crate::output::TokenLogprob;
use crate::sampling::{process_logits, sample, SamplingParams, TokenHistory};

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's (decode, and the end of prefill).
    Last,
    /// Every position's, row after row (teacher forcing).
    All,
    /// None: the pass only appends to the sessions' KV (a piece of a prompt whose
    /// next token is not due yet), so no LM head runs and `forward` returns no rows.
    KvOnly,
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// A new sequence with KV room for `capacity` tokens.
    fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>>;
    /// One pass over several sequences at once: each chunk's tokens are appended
    /// to its session at positions `len()..`. Every matmul covers the rows of all
    /// chunks, so the weights are read once per pass whatever the batch size.
    /// Returns f32 logits, `vocab` per row: one row per chunk (`Logits::Last`, the
    /// chunk's last token), one per token of every chunk in order (`Logits::All`),
    /// or none (`Logits::KvOnly`).
    /// Nothing is appended anywhere when an error is returned.
    fn forward(&self, chunks: &mut [Chunk<'_>], logits: Logits) -> Result<Vec<f32>>;
    /// `forward` with `Logits::Last`, returning each chunk's greedy token (the
    /// argmax, lowest index on ties, as `sampling::argmax`) picked where the
    /// logits are, so only token ids reach the host. `None`: this backend has no
    /// such path and the caller should use `forward` (nothing was run).
    fn forward_argmax(&self, _chunks: &mut [Chunk<'_>]) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }
    /// `forward` with `Logits::Last`, then each chunk's token chosen on the
    /// device by `requests[i]` (penalties, min_tokens mask, temperature, top-k,
    /// top-p, min-p and the seeded draw), the same token `SampleRequest::sample_on_host`
    /// picks from the same logits. Only token ids reach the host. `None`: no
    /// such path (nothing was run).
    fn forward_sample(&self, _chunks: &mut [Chunk<'_>], _requests: &[SampleRequest<'_>]) -> Result<Option<Vec<u32>>> {
        Ok(None)
    }
    /// A token loop on the device: feeds `first` at the session's next position,
    /// then each step's token (the argmax, or the sampler's choice with
    /// `req.sampling`), until `req.max_steps` steps, an end id
    /// (after `req.mask_end_steps` steps, which cannot pick one) or until
    /// `on_token` returns false. `on_token` sees every token as the device
    /// publishes it, in order, with its logprobs (`sampling::logprobs` of the
    /// step's raw logits) when `req.sampling`'s params ask for them; the
    /// session keeps exactly the tokens it saw.
    /// `None`: this backend or model has no device loop (nothing was run).
    fn decode_loop(
        &self,
        _session: &mut dyn Session,
        _first: u32,
        _req: &LoopRequest<'_>,
        _on_token: &mut dyn FnMut(u32, Option<TokenLogprob>) -> bool,
    ) -> Result<Option<LoopOutcome>> {
        Ok(None)
    }
    /// Whether `decode_loop` runs requests sampled with `params` (`req.sampling`)
    /// at all, so callers need not prepare one that would come back `None`.
    fn loops_sampling(&self, _params: &SamplingParams) -> bool {
        false
    }
    /// Breaks the device for good, as a lost GPU would (feature `diagnostics`,
    /// for tests of what serving does when a GPU fails): every later pass
    /// fails with a device error. Returns the error the device gave.
    #[cfg(feature = "diagnostics")]
    fn inject_device_fault(&self) -> Result<String> {
        Err(RocketError::invalid_arg("device", self.name(), "only a GPU backend can be made to fail like a lost GPU"))
    }
    /// From how many rows a prompt pass gives each row the same bits whatever its
    /// length (`SharedRows::ANY`: every pass does, as on the CPU, whose rows never
    /// depend on their pass). The batcher cuts prompts and caps reuse of a cached
    /// prefix so that every row keeps its bits (`batch::chunk_end`).
    fn pass_shared_rows(&self) -> SharedRows {
        SharedRows::ANY
    }
    /// How a decode step of `batch` sequences sampled with `params` runs, in
    /// words, for benchmarks.
    fn decode_path(&self, _batch: usize, _params: &SamplingParams) -> &'static str {
        "forward passes"
    }
    /// What it runs on, in words ("cpu", "NVIDIA H200 (sm_90a cubin)").
    fn device_description(&self) -> String {
        self.name().to_string()
    }
    /// Measured device memory copy bandwidth (GB/s, read + write), where that is
    /// the roofline for decode; None for the CPU.
    fn copy_bandwidth_gbs(&self) -> Result<Option<f64>> {
        Ok(None)
    }
    /// Event counts since load, for monitoring (zero where a backend has no such events).
    fn counters(&self) -> BackendCounters {
        BackendCounters::default()
    }
    /// Copies the KV of `src`'s first `len` positions into `dst`, which then
    /// holds exactly those `len` tokens (whatever it held is dropped) and is an
    /// ordinary session for every later pass, the device token loop included.
    /// Both sessions come from this backend; `len` is at most `src.len()` and
    /// `dst.capacity()` (`check_copy`). Prefix reuse (`prefix_cache`) moves KV
    /// with it. The default: this backend cannot (nothing is changed).
    fn copy_prefix(&self, _src: &mut dyn Session, _dst: &mut dyn Session, _len: usize) -> Result<()> {
        Err(RocketError::Internal(format!("the {} backend cannot copy a KV cache", self.name())))
    }
}

/// The shortest prompt passes whose rows get the same bits as in a pass of any
/// other length (`Backend::pass_shared_rows`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedRows {
    /// A pass of prompts' first rows alone (every chunk from position 0): a
    /// prompt shorter than this is never cached, its one pass too short.
    pub first: NonZeroUsize,
    /// A pass of prompt pieces that continues a session (after a reused
    /// prefix): a reuse leaves at least this many prompt tokens to compute.
    pub later: NonZeroUsize,
}

impl SharedRows {
    /// Every pass keeps every row's bits.
    pub const ANY: SharedRows = SharedRows::new(1, 1);

    /// `first` and `later` rows; panics on 0.
    pub const fn new(first: usize, later: usize) -> SharedRows {
        match (NonZeroUsize::new(first), NonZeroUsize::new(later)) {
            (Some(first), Some(later)) => SharedRows { first, later },
            _ => panic!("shared row counts are at least 1"),
        }
    }

    /// Whether a prompt of `prompt_len` takes part in prefix reuse at all (is
    /// cached, reuses a cached prefix): shorter than `first`, it runs alone as one
    /// first pass under `first` rows, whose rows' bits later passes would not
    /// reproduce.
    pub fn shares(&self, prompt_len: usize) -> bool {
        prompt_len >= self.first.get()
    }

    /// The fewest tokens a prompt of `prompt_len` computes itself when it reuses a
    /// cached prefix (`later`), or None where it takes no part (`shares`).
    pub fn reuse_rest(&self, prompt_len: usize) -> Option<usize> {
        self.shares(prompt_len).then_some(self.later.get())
    }
}

/// Checks a `copy_prefix` of `len` positions from `src` into `dst`.
pub fn check_copy(src: &dyn Session, dst: &dyn Session, len: usize) -> Result<()> {
    if len > src.len() || len > dst.capacity() {
        return Err(RocketError::Internal(format!(
            "cannot copy {len} KV positions from a session of {} into one with room for {}",
            src.len(),
            dst.capacity()
        )));
    }
    Ok(())
}

/// What a backend has counted since it loaded (read without waiting on a pass).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackendCounters {
    /// Megakernel token-loop launches.
    pub megakernel_launches: u64,
    /// Megakernel launches that ended on its watchdog (device stall, copy fault, or the host's hang limit).
    pub watchdog_events: u64,
}

/// What a sampler needs to pick one request's next token.
#[derive(Debug, Clone, Copy)]
pub struct SampleRequest<'a> {
    pub params: &'a SamplingParams,
    pub seed: u64,
    /// Tokens generated so far (the draw's counter).
    pub step: u64,
    pub history: &'a TokenHistory,
    /// Tokens that would end generation, masked while min_tokens is not reached.
    pub end_ids: &'a [u32],
}

impl SampleRequest<'_> {
    /// The host sampler's choice: the specification a device sampler must match.
    pub fn sample_on_host(&self, logits: &[f32]) -> u32 {
        let mut processed = logits.to_vec();
        process_logits(&mut processed, self.params, self.history, self.end_ids);
        sample(&processed, self.params, self.seed, self.step)
    }

    /// Whether min_tokens masks the end ids at this step.
    pub fn masks_end_ids(&self) -> bool {
        self.history.generated_len() < self.params.min_tokens
    }
}

/// One sequence's state (its KV cache) on a backend.
pub trait Session: Send + Any {
    /// Tokens already in the cache.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Tokens the cache has room for.
    fn capacity(&self) -> usize;
    /// Bytes of memory its KV cache holds (allocated for `capacity` tokens).
    fn kv_bytes(&self) -> usize;
    /// For the backend that made it, to reach its own session type.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The backend's own session type behind a `dyn Session`, or an error naming
/// the backend when a session from another backend was passed in.
pub(crate) fn own_session<'s, T: Session>(session: &'s mut dyn Session, backend: &str) -> Result<&'s mut T> {
    session
        .as_any_mut()
        .downcast_mut::<T>()
        .ok_or_else(|| RocketError::Internal(format!("the {backend} backend was given another backend's session")))
}

/// What a device token loop is asked to do (see `Backend::decode_loop`).
#[derive(Debug, Clone, Copy)]
pub struct LoopRequest<'a> {
    /// Steps (tokens produced) at most.
    pub max_steps: usize,
    /// Tokens that end the loop (EOS unless ignored, and stop ids).
    pub end_ids: &'a [u32],
    /// The first this many steps cannot pick an end id (min_tokens).
    pub mask_end_steps: usize,
    /// None: each step's token is the plain argmax. Some: the sampler's choice,
    /// as `SampleRequest::sample_on_host` picks it with the request's step and
    /// history advanced by the tokens of the loop so far. The loop masks
    /// `end_ids` above for `mask_end_steps` steps and ignores the request's own
    /// `end_ids` and `min_tokens`, so the caller must make them agree.
    pub sampling: Option<SampleRequest<'a>>,
}

/// What a device token loop did.
#[derive(Debug, Clone, Copy)]
pub struct LoopOutcome {
    /// Tokens handed to `on_token` (and kept in the session).
    pub accepted: usize,
    /// Steps the device ran (it may run a little past a stop the host raised).
    pub device_steps: usize,
    /// CPU time the polling host thread spent during the loop.
    pub host_cpu_seconds: f64,
}

/// New tokens for one sequence in a batched forward pass.
pub struct Chunk<'a> {
    pub session: &'a mut dyn Session,
    pub tokens: &'a [u32],
}

/// Checks every chunk against its session's room and the vocabulary before a
/// backend touches anything, so a failed pass leaves all sessions unchanged.
pub fn check_chunks(chunks: &[Chunk<'_>], vocab_size: usize) -> Result<()> {
    if chunks.is_empty() {
        return Err(RocketError::Internal("forward pass with no sequences".into()));
    }
    for c in chunks {
        if c.tokens.is_empty() {
            return Err(RocketError::EmptyPrompt);
        }
        let need = c.session.len() + c.tokens.len();
        if need > c.session.capacity() {
            return Err(RocketError::ContextOverflow { prompt_tokens: need, max_tokens: 0, limit: c.session.capacity() });
        }
        if let Some(&bad) = c.tokens.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(RocketError::invalid_arg("token id", bad, format!("must be < vocab size {vocab_size}")));
        }
    }
    Ok(())
}

/// Where the user asked the engine to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = crate::error::RocketError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => Err(crate::error::RocketError::invalid_arg("device", other, "expected \"auto\", \"cpu\" or \"cuda\"")),
        }
    }
}

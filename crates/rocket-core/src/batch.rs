//! Continuous batching: requests join and leave between forward passes, and
//! every pass runs all active requests together (new ones prefill in the same
//! pass as the others decode). Each request is sampled with its own seed and
//! step counter, so its tokens do not depend on what else is in the batch.

use std::collections::VecDeque;
use std::sync::Mutex;

use rayon::prelude::*;

use crate::backend::{Backend, Chunk, Logits, LoopRequest, Session, SharedRows};
use crate::error::{Result, RocketError};
use crate::output::{RequestOutput, StreamDelta};
use crate::prefix_cache::PrefixCache;
use crate::request::{EngineRequest, LoopSampling, RequestState};
use crate::text::Tokenizer;

/// What the batcher needs of a loaded model. The engine lends it
/// (`Batcher::new(&engine, ..)` converts), so batching sits below the engine.
#[derive(Clone, Copy)]
pub struct BatchModel<'a> {
    pub(crate) backend: &'a dyn Backend,
    pub(crate) tokenizer: &'a Tokenizer,
    /// The model's end-of-sequence ids.
    pub(crate) eos_ids: &'a [u32],
    pub(crate) vocab_size: usize,
    /// Context limit: prompt + max_tokens must fit in it.
    pub(crate) max_seq_len: usize,
    /// Where prompt KV is kept for later requests; None when disabled.
    pub(crate) prefix_cache: Option<&'a Mutex<KvPrefixCache>>,
    /// What a prompt row costs, which sizes a prompt's piece beside decoding
    /// requests (`piece_end`).
    pub(crate) row_cost: RowCost,
}

/// Cached prompt prefixes as sessions, each holding exactly its tokens' KV.
pub type KvPrefixCache = PrefixCache<Box<dyn Session>>;

impl BatchModel<'_> {
    /// Whether `request` can run: valid params, a non-empty prompt of known
    /// token ids, and room in the context for the prompt and max_tokens.
    pub fn check(&self, request: &EngineRequest) -> Result<()> {
        request.params.validate()?;
        self.check_fits(request.prompt_ids.len(), request.params.max_tokens)?;
        let vocab = self.vocab_size;
        if let Some(&bad) = request.prompt_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(RocketError::invalid_arg("prompt token id", bad, format!("must be < vocab size {vocab}")));
        }
        Ok(())
    }

    pub(crate) fn check_fits(&self, prompt_tokens: usize, max_tokens: usize) -> Result<()> {
        if prompt_tokens == 0 {
            return Err(RocketError::EmptyPrompt);
        }
        let limit = self.max_seq_len;
        if prompt_tokens + max_tokens > limit {
            return Err(RocketError::ContextOverflow { prompt_tokens, max_tokens, limit });
        }
        Ok(())
    }
}

/// What a request's sink receives: deltas as tokens arrive, then exactly one
/// `Finished` or `Failed`.
#[derive(Debug)]
pub enum BatchEvent {
    Delta(StreamDelta),
    Finished(RequestOutput),
    Failed(RocketError),
}

/// What a pass produced: greedy tokens picked on the device, or logits rows.
enum Picked {
    Tokens(Vec<u32>),
    Logits(Vec<f32>),
}

/// Steps one device token loop runs at most before the batcher looks for new
/// requests again (about 0.1 s of decoding on the fuels).
pub const LOOP_STEPS: usize = 128;

/// Prompt tokens one request feeds per pass by default: a long prompt is
/// prefilled over several passes, so a pass's activations stay bounded (beside
/// decoding requests its pieces are cut shorter still: `INTERACTIVE_PIECE_MACS`).
/// Passes of 2,048 measured 13-24% faster than passes of 512 at 4K prompts on the
/// H100, and about as fast at 16K (benches/NOTES.md).
pub const PREFILL_CHUNK: usize = 2048;

/// The prefix cache's block by default (`EngineOptions::prefix_block`): a chat's
/// next turn reuses its conversation up to the last whole block that leaves
/// `LATER_PASS_SHARED_ROWS` tokens to compute, so it computes those and up to a
/// block more; smaller blocks would save a little more at the cost of more
/// entries' lookups.
pub const PREFIX_BLOCK: usize = 128;

/// Multiply-adds of one prompt row, over the whole model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowCost {
    /// In the layers' matrix products.
    pub matmul_macs: u64,
    /// In attention, per key position the row attends to (2 x q_dim x layers).
    pub pair_macs: u64,
}

impl RowCost {
    /// A piece of `rows` prompt rows from position `start`, in multiply-adds of
    /// prompt attention: on the H200 the tensor-core GEMM ran ~108 TFLOP/s and the
    /// prompt attention ~50 (hi/lo products), so a matrix multiply-add counts half.
    pub fn piece(&self, start: usize, rows: usize) -> u128 {
        let attention = rows as u128 * (start + rows) as u128 * self.pair_macs as u128;
        attention + rows as u128 * self.matmul_macs as u128 / 2
    }
}

/// While other requests decode in the same pass, a prompt's piece is cut so that
/// it costs at most this many multiply-adds (`RowCost::piece`): ~2.7 ms on the
/// H200 (prompt attention ran ~25 T multiply-adds/s at 16K positions), so the
/// decoding requests' step stays within a few times their own (~1.5 ms for eight
/// Llama-3.2-1B streams). Llama-3.2-1B: pieces of 128 rows at the start of a
/// prompt, 64 from 1K positions on. A prompt alone keeps whole chunks.
pub const INTERACTIVE_PIECE_MACS: u64 = 1 << 36;

/// Rows of the smallest piece, and the step between piece sizes: whole tiles of
/// the prefill attention (kernels/src/attention_prefill.cu PREFILL_TILE), so a
/// prompt that starts on a tile keeps starting each piece on one.
pub const PIECE_ROWS: usize = 64;

/// Where a request stands after one of its tokens.
enum After {
    Running,
    /// Finished: by its own policy (EOS, stop, length), or cancelled by its sink.
    Done { cancelled: bool },
    Failed(RocketError),
}

/// Hands an accepted token's delta to the sink and says what follows.
fn after_token(sink: &mut Sink<'_>, accepted: Result<(StreamDelta, bool)>) -> After {
    match accepted {
        Err(e) => After::Failed(e),
        Ok((delta, done)) => {
            let keep_going = sink(BatchEvent::Delta(delta));
            if done || !keep_going {
                After::Done { cancelled: !done }
            } else {
                After::Running
            }
        }
    }
}

/// Ends a request that is no longer running: its sink's last event.
fn end(mut a: Active<'_>, after: After) {
    match after {
        After::Running => unreachable!("a running request does not end"),
        After::Failed(e) => {
            (a.sink)(BatchEvent::Failed(e));
        }
        After::Done { cancelled } => {
            if cancelled {
                a.state.cancel();
            }
            (a.sink)(BatchEvent::Finished(a.state.finish()));
        }
    }
}

/// Prompt passes of at least this many rows give each row the same bits whatever
/// their length, on the GPU (`Backend::pass_shared_rows`), where cuBLASLt picks its
/// algorithm per row count: the cuda tests `cublas_rows_keep_their_bits_across_pass_lengths`
/// (each product at 512 to 2,559 rows, the longest pass `chunk_end` makes) and
/// `a_prompt_rows_bits_do_not_depend_on_its_pass_length` (a 2,560-row prompt in one
/// pass and cut anywhere into passes of 512 rows or more, every fuel, the same
/// last-row logits bit for bit). A pass of prompts' first rows alone runs each
/// product on its own row count's pick, whose rows at 128 rows did not keep
/// them (Llama-3.2-1B's down product: split-K), so a prompt shorter than this is
/// never cached and reuses nothing. The count is the pass's, all requests' rows
/// together: a prompt's piece that shares its pass with decode rows keeps no
/// such promise.
pub const PASS_SHARED_ROWS: usize = 512;

/// A pass of prompt pieces that continues a session (after a reused prefix; no
/// decode rows beside it) gives each row the same bits from this many rows: below
/// `PASS_SHARED_ROWS` it runs each product on cuBLASLt's pick for `PASS_SHARED_ROWS`
/// rows, which kept every row's bits at every count the row-bits test ran, 33 to
/// 2,559 (Llama-3.2-1B, Qwen3-0.6B; asserted from this count). So a reuse leaves
/// at least this many prompt tokens to compute.
pub const LATER_PASS_SHARED_ROWS: usize = 128;

/// Where a prefill pass starting at prompt position `start` ends: `chunk` tokens
/// on (at least `shared`, the backend's `pass_shared_rows().first`), or at the
/// prompt's end, which the pass also takes where fewer than `shared` tokens would
/// be left for a last pass (it then runs up to `chunk + shared - 1` rows). So
/// every pass of a prompt of `shared` tokens or more has at least `shared` rows,
/// and a pass after a reused prefix (which leaves `pass_shared_rows().later`
/// tokens or more to compute: `PrefixCache::shared_len`) at least `later`: rows
/// that keep their bits whatever the pass's length, so a request that reuses a
/// cached prefix gets the bits of the same request without reuse, wherever
/// either's passes begin.
pub(crate) fn chunk_end(start: usize, prompt_len: usize, chunk: usize, shared: usize) -> usize {
    let end = start.saturating_add(chunk.max(shared)).min(prompt_len);
    if prompt_len - end < shared {
        prompt_len
    } else {
        end
    }
}

/// Where a prefill pass starting at prompt position `start` ends when other
/// requests decode in the same pass (`beside_decode`): at `chunk_end`, or sooner
/// where that piece would cost more than `budget_macs` (`RowCost::piece`), at
/// the most whole `PIECE_ROWS` rows within it (never fewer than `PIECE_ROWS`).
/// Alone, a prompt takes whole chunks: its own time to first token is what counts.
#[allow(clippy::too_many_arguments)]
pub(crate) fn piece_end(
    start: usize,
    prompt_len: usize,
    chunk: usize,
    shared: usize,
    beside_decode: bool,
    cost: RowCost,
    budget_macs: u64,
) -> usize {
    let end = chunk_end(start, prompt_len, chunk, shared);
    if !beside_decode {
        return end;
    }
    let mut rows = PIECE_ROWS;
    while start + rows < end && cost.piece(start, rows + PIECE_ROWS) <= budget_macs as u128 {
        rows += PIECE_ROWS;
    }
    end.min(start + rows)
}

/// The lengths of `prompt`'s prefix that waiting requests would copy from the
/// prefix cache if it held them: each one's whole blocks in common with
/// `prompt` (leaving them the tokens `SharedRows::reuse_rest` says), where that
/// is more than the cache offers them now.
fn wanted_by_waiting(cache: &KvPrefixCache, waiting: &VecDeque<Active<'_>>, prompt: &[u32], shared_rows: SharedRows) -> Vec<usize> {
    waiting
        .iter()
        .filter_map(|w| {
            let theirs = w.state.prompt_ids();
            let rest = shared_rows.reuse_rest(theirs.len())?;
            let shared = cache.shared_len(theirs, prompt, rest);
            (shared > cache.reusable(theirs, rest)).then_some(shared)
        })
        .collect()
}

/// The passes a prefill runs from prompt position `start` to `len`, ending where
/// `pass_end` says (`chunk_end`).
fn passes_from(mut start: usize, len: usize, pass_end: impl Fn(usize) -> usize) -> usize {
    let mut passes = 0;
    while start < len {
        start = pass_end(start);
        passes += 1;
    }
    passes
}

/// The passes `a`'s prefill runs, with its passes ending where `pass_end` says,
/// until the prefix cache holds its first `shared` tokens, and where it then
/// stands: the pass that reaches them, or its next pass where it has passed them
/// already (`keep_prefix` keeps what waiting requests want after every pass).
/// Beside decoding requests its pieces end sooner and take more passes; the
/// waiting request's own passes are counted alike (`Active::waits_left` bounds
/// what it waits).
fn kept_after(a: &Active<'_>, shared: usize, pass_end: impl Fn(usize) -> usize) -> (usize, usize) {
    let len = a.state.prompt_ids().len();
    let mut at = a.session.as_deref().map_or(0, |s| s.len());
    let mut passes = 0;
    loop {
        at = pass_end(at);
        passes += 1;
        if at >= shared || at >= len {
            return (passes, at);
        }
    }
}

/// After a prefill pass: when `a`'s session has passed its prompt's whole
/// blocks, or whole blocks a waiting request shares with it (`wanted`), a copy
/// of them joins the prefix cache (unless an entry already covers them). A
/// prompt shorter than `shared.first` rows (the backend's `pass_shared_rows`) is never kept:
/// its one pass was too short to give its rows the bits a longer pass would. Failures
/// only cost the reuse.
fn keep_prefix(model: &BatchModel<'_>, a: &mut Active<'_>, waiting: &VecDeque<Active<'_>>, shared: SharedRows) {
    let Some(cache) = model.prefix_cache else { return };
    let session = a.session.as_deref_mut().expect("running requests hold a session");
    let prompt = a.state.prompt_ids();
    if !shared.shares(prompt.len()) {
        return;
    }
    let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
    let done = session.len();
    let whole = cache.aligned_len(prompt.len());
    let keep = if done >= whole {
        whole
    } else {
        wanted_by_waiting(&cache, waiting, prompt, shared).into_iter().filter(|&w| w <= done).max().unwrap_or(0)
    };
    if keep == 0 || cache.covers(&prompt[..keep]) {
        return;
    }
    // Room first, from the running session's bytes per position (what the copy
    // will hold), so the cache never holds more than its budget, even briefly.
    let bytes = keep * (session.kv_bytes() / session.capacity().max(1));
    if !cache.make_room(bytes) {
        return;
    }
    let backend = model.backend;
    let copy = backend.new_session(keep).and_then(|mut kept| {
        backend.copy_prefix(session, kept.as_mut(), keep)?;
        Ok(kept)
    });
    match copy {
        Ok(kept) => {
            let bytes = kept.kv_bytes();
            cache.insert(prompt[..keep].to_vec(), kept, bytes);
        }
        Err(e) => tracing::warn!(error = %e, "a prompt's KV could not be kept for reuse"),
    }
}

/// A request's handle inside one [`Batcher`].
pub type RequestId = u64;

/// Receives a request's events; returning false cancels the request.
pub type Sink<'a> = Box<dyn FnMut(BatchEvent) -> bool + 'a>;

struct Active<'a> {
    id: RequestId,
    state: RequestState,
    sink: Sink<'a>,
    session: Option<Box<dyn Session>>,
    /// Passes this request may still wait for another's prefill to keep blocks
    /// it shares (`Batcher::admit`): set when it first waits, so a copy that
    /// fails, or a prefill that keeps a longer prefix for another request,
    /// holds it back no longer than it was worth then.
    waits_left: Option<usize>,
}

pub struct Batcher<'a> {
    model: BatchModel<'a>,
    max_batch: usize,
    prefill_chunk: usize,
    /// The backend's `pass_shared_rows`; tests set it.
    shared_rows: SharedRows,
    piece_macs: u64,
    next_id: RequestId,
    waiting: VecDeque<Active<'a>>,
    running: Vec<Active<'a>>,
}

impl<'a> Batcher<'a> {
    /// At most `max_batch` requests run in one pass; the rest wait their turn.
    pub fn new(model: impl Into<BatchModel<'a>>, max_batch: usize) -> Self {
        let model = model.into();
        Batcher {
            model,
            max_batch: max_batch.max(1),
            prefill_chunk: PREFILL_CHUNK,
            shared_rows: model.backend.pass_shared_rows(),
            piece_macs: INTERACTIVE_PIECE_MACS,
            next_id: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    /// Prompt tokens a request feeds per pass at most (default [`PREFILL_CHUNK`]).
    /// Outputs do not depend on it; smaller chunks trade prefill speed for the
    /// latency of the other requests in the batch.
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    /// The pass lengths from which prompt rows keep their bits (`chunk_end`), as a
    /// GPU backend's `pass_shared_rows` would say, on the CPU backend: `first`
    /// for a prompt's first pass, `later` for one after a reused prefix.
    #[cfg(test)]
    pub(crate) fn set_shared_rows(&mut self, first: usize, later: usize) {
        self.shared_rows = SharedRows::new(first.max(1), later.max(1));
    }

    /// Multiply-adds a prompt's piece may cost while other requests decode in
    /// its pass (default [`INTERACTIVE_PIECE_MACS`]; see `piece_end`).
    /// Smaller trades the prompt's time to first token for the others' latency.
    pub fn set_interactive_piece_macs(&mut self, macs: u64) {
        self.piece_macs = macs;
    }

    /// Queues a request. Checks it first ([`BatchModel::check`]); on error
    /// nothing is queued and the sink is never called.
    pub fn add(&mut self, request: EngineRequest, sink: Sink<'a>) -> Result<RequestId> {
        self.model.check(&request)?;
        let id = self.next_id;
        self.next_id += 1;
        let state = RequestState::new(request, self.model.eos_ids);
        self.waiting.push_back(Active { id, state, sink, session: None, waits_left: None });
        Ok(id)
    }

    /// Cancels a queued or running request; its sink gets `Finished` (Cancelled).
    /// Unknown or already finished ids are ignored.
    pub fn cancel(&mut self, id: RequestId) {
        let found = if let Some(i) = self.running.iter().position(|a| a.id == id) {
            Some(self.running.remove(i))
        } else if let Some(i) = self.waiting.iter().position(|a| a.id == id) {
            self.waiting.remove(i)
        } else {
            None
        };
        if let Some(mut a) = found {
            a.state.cancel();
            (a.sink)(BatchEvent::Finished(a.state.finish()));
        }
    }

    /// Requests running or waiting.
    pub fn pending(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Requests in the running batch (holding a KV cache).
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Bytes of KV cache the running requests hold.
    pub fn kv_bytes(&self) -> usize {
        self.running.iter().filter_map(|a| a.session.as_ref()).map(|s| s.kv_bytes()).sum()
    }

    /// One forward pass over every running request, after admitting waiting ones
    /// up to `max_batch`. A backend failure fails the requests of that pass (their
    /// sinks get `Failed`) and is also returned. Returns `pending()`.
    pub fn step(&mut self) -> Result<usize> {
        self.admit();
        if self.running.is_empty() {
            return Ok(self.pending());
        }
        let rows = self.running.len();
        for a in &mut self.running {
            a.state.ran_in_batch(rows);
        }
        if let Some(done) = self.device_loop() {
            return done;
        }
        let all_greedy = self.running.iter().all(|a| a.state.wants_plain_argmax());
        let device_sampling = !all_greedy && self.running.iter().all(|a| a.state.wants_device_sampling());
        let last_tokens: Vec<u32> = self.running.iter().map(|a| a.state.last_token().unwrap_or(0)).collect();
        let mut chunks: Vec<Chunk<'_>> = Vec::with_capacity(self.running.len());
        // Whether the pass gives each request its next token (a decode step, or the
        // last piece of its prompt) rather than only filling its cache.
        let mut picks = Vec::with_capacity(self.running.len());
        // Whether the pass feeds a piece of the request's prompt (it may then
        // complete the prompt's whole blocks, which the prefix cache keeps).
        let mut prefilling = Vec::with_capacity(self.running.len());
        let mut requests = Vec::with_capacity(if device_sampling { self.running.len() } else { 0 });
        let mut prompt_rows = 0usize; // for the "pass done" event
        let chunk = self.prefill_chunk;
        // Requests past their prompt decode in this pass: prompts beside them come in
        // pieces whose attention their step can afford.
        let beside_decode = self.running.iter().any(|a| a.state.last_token().is_some());
        let (row_cost, budget) = (self.model.row_cost, self.piece_macs);
        for (a, last) in self.running.iter_mut().zip(&last_tokens) {
            let Active { state, session, .. } = a;
            let session = session.as_deref_mut().expect("running requests hold a session");
            if device_sampling {
                requests.push(state.sample_request());
            }
            prefilling.push(state.last_token().is_none());
            let tokens = match state.last_token() {
                None => {
                    let prompt = state.prompt_ids();
                    let end = piece_end(session.len(), prompt.len(), chunk, self.shared_rows.first.get(), beside_decode, row_cost, budget);
                    prompt_rows += end - session.len();
                    picks.push(end == prompt.len());
                    &prompt[session.len()..end]
                }
                Some(_) => {
                    picks.push(true);
                    std::slice::from_ref(last)
                }
            };
            chunks.push(Chunk { session, tokens });
        }
        let backend = self.model.backend;
        // A piece that picks no token still asks for logits: its pass without the LM head
        // (`Logits::KvOnly`) saved ~0.3 ms a pass at shallow contexts on the H100 but ran
        // the deep passes' attention slower (Llama-3.2-1B 16K +7%, its last passes +12%;
        // not understood), a loss on every long prompt.
        let on_device = if all_greedy {
            backend.forward_argmax(&mut chunks)
        } else if device_sampling {
            backend.forward_sample(&mut chunks, &requests)
        } else {
            Ok(None)
        };
        let pass = match on_device {
            Ok(Some(tokens)) => Ok(Picked::Tokens(tokens)),
            Ok(None) => backend.forward(&mut chunks, Logits::Last).map(Picked::Logits),
            Err(e) => Err(e),
        };
        drop((chunks, requests));
        let picked = match pass {
            Ok(p) => p,
            Err(e) => {
                for mut a in self.running.drain(..) {
                    (a.sink)(BatchEvent::Failed(RocketError::Internal(format!("forward pass failed: {e}"))));
                }
                return Err(e);
            }
        };
        let model = self.model;
        let vocab = self.model.vocab_size;
        let tokenizer = self.model.tokenizer;
        // Rows whose token the host picks (from the logits row: logprobs, or a
        // sampler the device lacks) are independent: each O(vocabulary), in parallel.
        let mut host_picks: Vec<Option<_>> = match &picked {
            Picked::Tokens(_) => Vec::new(),
            Picked::Logits(l) => {
                let states: Vec<&RequestState> = self.running.iter().map(|a| &a.state).collect();
                states.par_iter().enumerate().map(|(i, state)| picks[i].then(|| state.pick_on_host(&l[i * vocab..(i + 1) * vocab]))).collect()
            }
        };
        // Every token to its sink first, then the pass's prompts into the prefix
        // cache (a copy of their KV each): the copies delay no token of this pass.
        let afters: Vec<Option<After>> = self
            .running
            .iter_mut()
            .enumerate()
            .map(|(i, a)| {
                picks[i].then(|| {
                    let accepted = match &picked {
                        Picked::Tokens(t) => a.state.accept_picked(tokenizer, t[i], None),
                        Picked::Logits(_) => a.state.accept_with(tokenizer, host_picks[i].take().expect("picked above")),
                    };
                    after_token(&mut a.sink, accepted)
                })
            })
            .collect();
        for (a, _) in self.running.iter_mut().zip(&prefilling).filter(|(_, p)| **p) {
            keep_prefix(&model, a, &self.waiting, self.shared_rows);
        }
        let mut still_running = Vec::with_capacity(self.running.len());
        for (a, after) in self.running.drain(..).zip(afters) {
            match after {
                None | Some(After::Running) => still_running.push(a),
                Some(after) => end(a, after),
            }
        }
        self.running = still_running;
        // One event a pass once its tokens are with the sinks: the times between them are
        // the gaps between a stream's tokens, whatever text each token carries
        // (benches/interference.py reads them with `rocket_core::batch=debug`).
        tracing::debug!(prompt_rows, decode_rows = prefilling.iter().filter(|p| !**p).count(), "pass done");
        Ok(self.pending())
    }

    /// A lone request past its prefill runs up to LOOP_STEPS steps in one
    /// device token loop (the megakernel), the host only turning tokens into
    /// text. None: not applicable here, or the backend has no loop.
    fn device_loop(&mut self) -> Option<Result<usize>> {
        if self.running.len() != 1 || !self.waiting.is_empty() {
            return None;
        }
        let Active { state, sink, session, .. } = &mut self.running[0];
        let first = state.last_token()?;
        if state.remaining() < 2 {
            return None;
        }
        let end_ids = state.end_ids().to_vec();
        if !state.plain_greedy() && !self.model.backend.loops_sampling(state.params()) {
            return None;
        }
        let sampling = state.loop_sampling();
        let req = LoopRequest {
            max_steps: state.remaining().min(LOOP_STEPS),
            end_ids: &end_ids,
            mask_end_steps: state.mask_end_steps(),
            sampling: sampling.as_ref().map(LoopSampling::request),
        };
        let session = session.as_deref_mut().expect("running requests hold a session");
        let tokenizer = self.model.tokenizer;
        let mut after = After::Running;
        let ran = self.model.backend.decode_loop(session, first, &req, &mut |token, logprob| {
            after = after_token(sink, state.accept_picked(tokenizer, token, logprob));
            matches!(after, After::Running)
        });
        match ran {
            Ok(None) => return None,
            Ok(Some(_)) => {}
            // The session holds exactly the tokens handed on, so the request goes
            // on step by step (and fails there if the device itself is lost).
            Err(e) if matches!(after, After::Running) => {
                tracing::warn!(error = %e, "the device token loop failed; continuing step by step");
                return None;
            }
            // The sink already ended the request; the error only concerns the device.
            Err(e) => tracing::warn!(error = %e, "the device token loop failed after its request ended"),
        }
        if !matches!(after, After::Running) {
            end(self.running.remove(0), after);
        }
        Some(Ok(self.pending()))
    }

    /// A session for `a`, starting from the longest cached prefix of its
    /// prompt. When the device has no room, cached prefixes are dropped (least
    /// recently used first) until it has.
    fn open_session(&self, a: &mut Active<'a>) -> Result<Box<dyn Session>> {
        let backend = self.model.backend;
        let Some(cache) = self.model.prefix_cache else { return backend.new_session(a.state.capacity()) };
        let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
        let mut session = loop {
            match backend.new_session(a.state.capacity()) {
                Ok(s) => break s,
                Err(e) => {
                    if !cache.evict_one() {
                        return Err(e);
                    }
                }
            }
        };
        let prompt = a.state.prompt_ids();
        let hit = self.shared_rows.reuse_rest(prompt.len()).and_then(|rest| cache.lookup(prompt, rest));
        if let Some(hit) = hit {
            match backend.copy_prefix(hit.value.as_mut(), session.as_mut(), hit.tokens) {
                Ok(()) => a.state.reused_prefix(hit.tokens),
                Err(e) => {
                    tracing::warn!(error = %e, "a cached prefix could not be copied; prefilling the whole prompt");
                    session = backend.new_session(a.state.capacity())?;
                }
            }
        }
        Ok(session)
    }

    /// Runs until every queued request has finished.
    pub fn run_to_completion(&mut self) -> Result<()> {
        while self.step()? > 0 {}
        Ok(())
    }

    /// Moves waiting requests into the running batch in arrival order, up to
    /// `max_batch`, except those that do better waiting for another request's
    /// prefill (`shared_prefill_wait`), for at most the passes that promised
    /// when they first waited; later arrivals may pass them but not take the
    /// slots they will need. A request whose KV cache does not fit in device
    /// memory waits, first in line, while running requests hold memory they
    /// will free; with none running it fails (nothing else would free any).
    fn admit(&mut self) {
        let (mut i, mut reserved) = (0, 0);
        while self.running.len() + reserved < self.max_batch && i < self.waiting.len() {
            if let Some(passes) = self.shared_prefill_wait(&self.waiting[i]) {
                let left = self.waiting[i].waits_left.get_or_insert(passes);
                if *left > 0 {
                    *left -= 1;
                    reserved += 1;
                    i += 1;
                    continue;
                }
            }
            let mut a = self.waiting.remove(i).expect("a waiting request at this index");
            match self.open_session(&mut a) {
                Ok(session) => {
                    a.session = Some(session);
                    self.running.push(a);
                }
                Err(RocketError::DeviceMemory(m)) if !self.running.is_empty() => {
                    tracing::debug!(reason = %m, running = self.running.len(), "a request waits for device memory");
                    self.waiting.insert(i, a);
                    break;
                }
                Err(e) => {
                    (a.sink)(BatchEvent::Failed(e));
                }
            }
        }
    }

    /// Whether `a` should wait for a running request that is prefilling a
    /// prompt with whole blocks in common with `a`'s, uncached so far: that
    /// prefill puts them in the prefix cache as it passes them (`keep_prefix`),
    /// and `a` then copies them instead of prefilling them again beside it. So
    /// requests that arrive together with one system prompt prefill it once,
    /// not once each (outputs are the same either way: see `prefix_cache`).
    /// `a` waits only when that does not put off its first token: the other's
    /// passes until the blocks are kept and `a`'s own after them are no more
    /// than `a`'s passes without waiting; and only when the cache can hold them.
    /// Returns the passes it would wait (the fewest, over the running requests).
    fn shared_prefill_wait(&self, a: &Active<'a>) -> Option<usize> {
        let cache = self.model.prefix_cache?;
        let cache = cache.lock().unwrap_or_else(|p| p.into_inner());
        let prompt = a.state.prompt_ids();
        let rest = self.shared_rows.reuse_rest(prompt.len())?;
        let (chunk, first) = (self.prefill_chunk, self.shared_rows.first.get());
        let cached = cache.reusable(prompt, rest);
        let own_passes = |from: usize| passes_from(from, prompt.len(), |s| chunk_end(s, prompt.len(), chunk, first));
        let alone = own_passes(cached);
        self.running.iter().filter(|r| r.state.last_token().is_none()).filter_map(|r| {
            let session = r.session.as_deref()?;
            let theirs = r.state.prompt_ids();
            let shared = cache.shared_len(prompt, theirs, rest);
            // A prompt too short to share is never kept (`keep_prefix`).
            if shared <= cached || !self.shared_rows.shares(theirs.len()) {
                return None;
            }
            let (waits, at) = kept_after(r, shared, |s| chunk_end(s, theirs.len(), chunk, first));
            // A pass that passes its prompt's whole blocks keeps all of them (`keep_prefix`).
            let whole = cache.aligned_len(theirs.len());
            let keeps = if at >= whole { whole } else { shared };
            let bytes = keeps * (session.kv_bytes() / session.capacity().max(1));
            (waits + own_passes(shared) <= alone && cache.admits(bytes)).then_some(waits)
        })
        .min()
    }
}

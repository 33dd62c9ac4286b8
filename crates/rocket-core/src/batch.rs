//! Continuous batching: requests join and leave between forward passes, and
//! every pass runs all active requests together (new ones prefill in the same
//! pass as the others decode). Each request is sampled with its own seed and
//! step counter, so its tokens do not depend on what else is in the batch.

use std::collections::VecDeque;

use crate::backend::{Chunk, Logits, LoopRequest, Session};
use crate::engine::{Engine, RequestOutput, StreamDelta};
use crate::error::{Result, RocketError};
use crate::request::{LoopSampling, RequestState};
use crate::sampling::SamplingParams;

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
const LOOP_STEPS: usize = 128;

/// Prompt tokens one request feeds per pass by default: a long prompt is
/// prefilled over several passes, so the others keep decoding meanwhile and a
/// pass's activations stay bounded.
pub const PREFILL_CHUNK: usize = 512;

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

/// A request's handle inside one [`Batcher`].
pub type RequestId = u64;

/// Receives a request's events; returning false cancels the request.
pub type Sink<'a> = Box<dyn FnMut(BatchEvent) -> bool + 'a>;

struct Active<'a> {
    id: RequestId,
    state: RequestState,
    sink: Sink<'a>,
    session: Option<Box<dyn Session>>,
}

pub struct Batcher<'a> {
    engine: &'a Engine,
    max_batch: usize,
    prefill_chunk: usize,
    next_id: RequestId,
    waiting: VecDeque<Active<'a>>,
    running: Vec<Active<'a>>,
}

impl<'a> Batcher<'a> {
    /// At most `max_batch` requests run in one pass; the rest wait their turn.
    pub fn new(engine: &'a Engine, max_batch: usize) -> Self {
        Batcher {
            engine,
            max_batch: max_batch.max(1),
            prefill_chunk: PREFILL_CHUNK,
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

    /// Queues a request. Validates `params` and the context fit first; on error
    /// nothing is queued and the sink is never called.
    pub fn add(&mut self, prompt: String, prompt_ids: Vec<u32>, params: SamplingParams, sink: Sink<'a>) -> Result<RequestId> {
        params.validate()?;
        self.engine.check_fits(prompt_ids.len(), params.max_tokens)?;
        let vocab = self.engine.spec().vocab_size;
        if let Some(&bad) = prompt_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(RocketError::invalid_arg("prompt token id", bad, format!("must be < vocab size {vocab}")));
        }
        let id = self.next_id;
        self.next_id += 1;
        let state = RequestState::new(prompt, prompt_ids, params, &self.engine.info().eos_token_ids);
        self.waiting.push_back(Active { id, state, sink, session: None });
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

    /// One forward pass over every running request, after admitting waiting ones
    /// up to `max_batch`. A backend failure fails the requests of that pass (their
    /// sinks get `Failed`) and is also returned. Returns `pending()`.
    pub fn step(&mut self) -> Result<usize> {
        self.admit();
        if self.running.is_empty() {
            return Ok(self.pending());
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
        let mut requests = Vec::with_capacity(if device_sampling { self.running.len() } else { 0 });
        for (a, last) in self.running.iter_mut().zip(&last_tokens) {
            let Active { state, session, .. } = a;
            let session = session.as_deref_mut().expect("running requests hold a session");
            if device_sampling {
                requests.push(state.sample_request());
            }
            let tokens = match state.last_token() {
                None => {
                    let prompt = state.prompt_ids();
                    let end = (session.len() + self.prefill_chunk).min(prompt.len());
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
        let backend = self.engine.backend();
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
        let vocab = self.engine.spec().vocab_size;
        let tokenizer = self.engine.tokenizer();
        let mut still_running = Vec::with_capacity(self.running.len());
        for (i, mut a) in self.running.drain(..).enumerate() {
            if !picks[i] {
                still_running.push(a);
                continue;
            }
            let accepted = match &picked {
                Picked::Tokens(t) => a.state.accept_picked(tokenizer, t[i]),
                Picked::Logits(l) => a.state.accept(tokenizer, &l[i * vocab..(i + 1) * vocab]),
            };
            match after_token(&mut a.sink, accepted) {
                After::Running => still_running.push(a),
                after => end(a, after),
            }
        }
        self.running = still_running;
        Ok(self.pending())
    }

    /// A lone greedy request past its prefill runs up to LOOP_STEPS steps in one
    /// device token loop (the megakernel), the host only turning tokens into
    /// text. None: not applicable here, or the backend has no loop.
    fn device_loop(&mut self) -> Option<Result<usize>> {
        if self.running.len() != 1 || !self.waiting.is_empty() {
            return None;
        }
        let Active { state, sink, session, .. } = &mut self.running[0];
        let first = state.last_token()?;
        if !state.wants_device_loop() || state.remaining() < 2 {
            return None;
        }
        let end_ids = state.end_ids().to_vec();
        if !state.plain_greedy() && !self.engine.backend().loops_sampling() {
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
        let tokenizer = self.engine.tokenizer();
        let mut after = After::Running;
        let ran = self.engine.backend().decode_loop(session, first, &req, &mut |token| {
            after = after_token(sink, state.accept_picked(tokenizer, token));
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

    /// Runs until every queued request has finished.
    pub fn run_to_completion(&mut self) -> Result<()> {
        while self.step()? > 0 {}
        Ok(())
    }

    fn admit(&mut self) {
        while self.running.len() < self.max_batch {
            let Some(mut a) = self.waiting.pop_front() else { break };
            match self.engine.backend().new_session(a.state.capacity()) {
                Ok(session) => {
                    a.session = Some(session);
                    self.running.push(a);
                }
                Err(e) => {
                    (a.sink)(BatchEvent::Failed(e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The batcher's device-loop path, driven through a backend whose
    //! `decode_loop` keeps the trait's contract by stepping the CPU reference
    //! (greedy argmax, end ids masked for `mask_end_steps`, stop at an end id, at
    //! `max_steps` or when `on_token` says so): every request must come out
    //! exactly as it does without a loop.

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::backend::{Backend, LoopOutcome, SampleRequest};
    use crate::engine::{EngineOptions, FinishReason};
    use crate::megakernel::{MegakernelError, StallSite};
    use crate::sampling::argmax;
    use crate::Device;

    struct SteppingLoop {
        inner: Box<dyn Backend>,
        launches: Arc<AtomicUsize>,
        /// Fail the first launch after handing on this many tokens, then leave
        /// the loop out of service (as the megakernel after its watchdog fires).
        fail_after: Option<usize>,
    }

    impl Backend for SteppingLoop {
        fn name(&self) -> &'static str {
            "cpu"
        }
        fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
            self.inner.new_session(capacity)
        }
        fn forward(&self, chunks: &mut [Chunk<'_>], logits: Logits) -> Result<Vec<f32>> {
            self.inner.forward(chunks, logits)
        }
        fn loops_sampling(&self) -> bool {
            true
        }
        fn decode_loop(
            &self,
            session: &mut dyn Session,
            first: u32,
            req: &LoopRequest<'_>,
            on_token: &mut dyn FnMut(u32) -> bool,
        ) -> Result<Option<LoopOutcome>> {
            let launch = self.launches.fetch_add(1, Ordering::Relaxed);
            if self.fail_after.is_some() && launch > 0 {
                return Ok(None);
            }
            let (mut token, mut accepted) = (first, 0);
            let mut history = req.sampling.map(|s| s.history.clone());
            for step in 0..req.max_steps.min(session.capacity() - session.len()) {
                if self.fail_after == Some(accepted) {
                    let stall = MegakernelError::Watchdog { sm: 0, site: StallSite::StepStart, step: accepted as u32, value: 0, target: 1, watchdog_ms: 0 };
                    return Err(stall.into());
                }
                let mut logits = self.inner.forward(&mut [Chunk { session: &mut *session, tokens: &[token] }], Logits::Last)?;
                token = match (&req.sampling, history.as_mut()) {
                    (Some(s), Some(h)) => {
                        // The request's sampler with its step and history advanced (the trait's contract).
                        let t = SampleRequest { step: s.step + step as u64, history: h, ..*s }.sample_on_host(&logits);
                        h.push(t);
                        t
                    }
                    _ => {
                        if step < req.mask_end_steps {
                            for &e in req.end_ids {
                                logits[e as usize] = f32::NEG_INFINITY;
                            }
                        }
                        argmax(&logits)
                    }
                };
                accepted += 1;
                if !on_token(token) || req.end_ids.contains(&token) {
                    break;
                }
            }
            Ok(Some(LoopOutcome { accepted, device_steps: accepted, host_cpu_seconds: 0.0 }))
        }
    }

    fn engines_failing_after(fail_after: Option<usize>) -> (Engine, Engine, Arc<AtomicUsize>) {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/parity/fixtures/tiny-llama");
        let opts = EngineOptions { device: Device::Cpu, progress: false, ..EngineOptions::default() };
        let launches = Arc::new(AtomicUsize::new(0));
        let counter = launches.clone();
        let looping =
            Engine::load(path, opts.clone()).unwrap().wrap_backend(|inner| Box::new(SteppingLoop { inner, launches: counter, fail_after }));
        (Engine::load(path, opts).unwrap(), looping, launches)
    }

    fn engines() -> (Engine, Engine, Arc<AtomicUsize>) {
        engines_failing_after(None)
    }

    #[test]
    fn a_failed_device_loop_goes_on_step_by_step() {
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(60) };
        for fail_after in [0, 1, 17] {
            let (plain, looping, launches) = engines_failing_after(Some(fail_after));
            let want = plain.generate("hello world", &params).unwrap();
            let got = looping.generate("hello world", &params).unwrap();
            assert_eq!(got.token_ids, want.token_ids, "failing after {fail_after} tokens");
            assert_eq!(got.text, want.text);
            // Later requests skip the out-of-service loop and are still right.
            assert_eq!(looping.generate("hello world", &params).unwrap().token_ids, want.token_ids);
            assert!(launches.load(Ordering::Relaxed) >= 2);
        }
    }

    #[test]
    fn a_device_loop_gives_the_same_outputs_as_steps() {
        let (plain, looping, launches) = engines();
        let eos = plain.info().eos_token_ids.clone();
        let cases = [
            SamplingParams { ignore_eos: true, ..SamplingParams::greedy(240) }, // two launches of LOOP_STEPS
            SamplingParams::greedy(40),
            SamplingParams { min_tokens: 30, ..SamplingParams::greedy(60) },
            SamplingParams { stop: vec!["e".into(), "the".into()], ignore_eos: true, ..SamplingParams::greedy(50) },
            SamplingParams { stop_token_ids: vec![5, 9, 17], ..SamplingParams::greedy(50) },
        ];
        for params in cases {
            for prompt in ["hello world", "the quick brown fox"] {
                let want = plain.generate(prompt, &params).unwrap();
                let got = looping.generate(prompt, &params).unwrap();
                assert_eq!(got.token_ids, want.token_ids, "{params:?} {prompt:?}");
                assert_eq!((got.text, got.finish_reason, got.stop_reason), (want.text, want.finish_reason, want.stop_reason));
            }
        }
        assert!(launches.load(Ordering::Relaxed) >= 10, "the greedy requests ran as device loops");
        assert!(!eos.is_empty());

        // A stop id the free run reaches at its 4th token ends the loop there, and
        // min_tokens masks it on the device exactly as the host sampler does.
        let free = plain.generate("hello world", &SamplingParams { ignore_eos: true, ..SamplingParams::greedy(30) }).unwrap();
        let end = free.token_ids[3];
        let first = free.token_ids.iter().position(|&t| t == end).unwrap();
        for min_tokens in [0, first + 2] {
            let params = SamplingParams { stop_token_ids: vec![end], min_tokens, ignore_eos: true, ..SamplingParams::greedy(30) };
            let want = plain.generate("hello world", &params).unwrap();
            let got = looping.generate("hello world", &params).unwrap();
            assert_eq!(got.token_ids, want.token_ids, "min_tokens {min_tokens}");
            assert_eq!(got.finish_reason, want.finish_reason);
            if min_tokens == 0 {
                assert_eq!(got.token_ids.len(), first + 1);
            } else {
                assert!(got.token_ids.len() > first + 1 && !got.token_ids[..min_tokens].contains(&end));
            }
        }
    }

    #[test]
    fn sampled_requests_loop_with_the_same_tokens_as_steps() {
        let (plain, looping, launches) = engines();
        let cases = [
            SamplingParams { temperature: 0.8, seed: Some(3), ignore_eos: true, ..SamplingParams::greedy(150) },
            SamplingParams { temperature: 1.1, top_k: 20, top_p: 0.9, min_p: 0.02, seed: Some(9), ..SamplingParams::greedy(60) },
            SamplingParams { repetition_penalty: 1.3, presence_penalty: 0.4, frequency_penalty: 0.3, ..SamplingParams::greedy(40) },
            SamplingParams { temperature: 0.7, repetition_penalty: 1.2, min_tokens: 20, seed: Some(1), ..SamplingParams::greedy(50) },
        ];
        for params in cases {
            let want = plain.generate("the quick brown fox", &params).unwrap();
            let got = looping.generate("the quick brown fox", &params).unwrap();
            assert_eq!(got.token_ids, want.token_ids, "{params:?}");
            assert_eq!((got.text, got.finish_reason), (want.text, want.finish_reason));
        }
        assert!(launches.load(Ordering::Relaxed) >= 5, "sampled requests ran as device loops");
    }

    #[test]
    fn logprobs_and_batched_requests_do_not_loop_and_a_closed_stream_stops_one() {
        let (_, looping, launches) = engines();
        let with_logprobs = SamplingParams { temperature: 0.8, seed: Some(3), logprobs: Some(2), ..SamplingParams::greedy(20) };
        looping.generate("hello", &with_logprobs).unwrap();
        let two = [("a".to_string(), looping.encode_prompt("a").unwrap(), SamplingParams::greedy(20)), ("b".to_string(), looping.encode_prompt("b").unwrap(), SamplingParams::greedy(20))];
        looping.generate_many(two.to_vec()).unwrap();
        assert_eq!(launches.load(Ordering::Relaxed), 0);

        let mut deltas = 0;
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(100) };
        let out = looping.generate_ids("x".into(), looping.encode_prompt("hello").unwrap(), &params, &mut |_| {
            deltas += 1;
            deltas < 5
        });
        let out = out.unwrap();
        assert_eq!(out.finish_reason, FinishReason::Cancelled);
        assert_eq!(out.token_ids.len(), 5);
        assert_eq!(launches.load(Ordering::Relaxed), 1);
    }
}

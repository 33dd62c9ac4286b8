//! Continuous batching: requests join and leave between forward passes, and
//! every pass runs all active requests together (new ones prefill in the same
//! pass as the others decode). Each request is sampled with its own seed and
//! step counter, so its tokens do not depend on what else is in the batch.

use std::collections::VecDeque;

use crate::backend::{Chunk, Logits, Session};
use crate::engine::{Engine, RequestOutput, StreamDelta};
use crate::error::{Result, RocketError};
use crate::request::RequestState;
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
    next_id: RequestId,
    waiting: VecDeque<Active<'a>>,
    running: Vec<Active<'a>>,
}

impl<'a> Batcher<'a> {
    /// At most `max_batch` requests run in one pass; the rest wait their turn.
    pub fn new(engine: &'a Engine, max_batch: usize) -> Self {
        Batcher { engine, max_batch: max_batch.max(1), next_id: 0, waiting: VecDeque::new(), running: Vec::new() }
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
        let all_greedy = self.running.iter().all(|a| a.state.wants_plain_argmax());
        let last_tokens: Vec<u32> = self.running.iter().map(|a| a.state.last_token().unwrap_or(0)).collect();
        let mut chunks: Vec<Chunk<'_>> = Vec::with_capacity(self.running.len());
        for (a, last) in self.running.iter_mut().zip(&last_tokens) {
            let tokens = match a.state.last_token() {
                None => a.state.prompt_ids(),
                Some(_) => std::slice::from_ref(last),
            };
            let session = a.session.as_deref_mut().expect("running requests hold a session");
            chunks.push(Chunk { session, tokens });
        }
        let backend = self.engine.backend();
        let pass = if all_greedy {
            match backend.forward_argmax(&mut chunks) {
                Ok(Some(tokens)) => Ok(Picked::Tokens(tokens)),
                Ok(None) => backend.forward(&mut chunks, Logits::Last).map(Picked::Logits),
                Err(e) => Err(e),
            }
        } else {
            backend.forward(&mut chunks, Logits::Last).map(Picked::Logits)
        };
        drop(chunks);
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
            let accepted = match &picked {
                Picked::Tokens(t) => a.state.accept_argmax(tokenizer, t[i]),
                Picked::Logits(l) => a.state.accept(tokenizer, &l[i * vocab..(i + 1) * vocab]),
            };
            match accepted {
                Err(e) => {
                    (a.sink)(BatchEvent::Failed(e));
                }
                Ok((delta, done)) => {
                    let keep_going = (a.sink)(BatchEvent::Delta(delta));
                    if done || !keep_going {
                        if !done {
                            a.state.cancel();
                        }
                        (a.sink)(BatchEvent::Finished(a.state.finish()));
                    } else {
                        still_running.push(a);
                    }
                }
            }
        }
        self.running = still_running;
        Ok(self.pending())
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

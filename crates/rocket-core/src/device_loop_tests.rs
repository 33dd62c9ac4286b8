//! The batcher's device-loop path, driven through a backend whose
//! `decode_loop` keeps the trait's contract by stepping the CPU reference
//! (greedy argmax, end ids masked for `mask_end_steps`, stop at an end id, at
//! `max_steps` or when `on_token` says so): every request must come out
//! exactly as it does without a loop.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::backend::{Backend, Chunk, Logits, LoopOutcome, LoopRequest, SampleRequest, Session};
use crate::engine::{Engine, EngineOptions};
use crate::error::Result;
use crate::megakernel::{MegakernelError, StallSite};
use crate::output::FinishReason;
use crate::request::EngineRequest;
use crate::output::TokenLogprob;
use crate::sampling::{argmax, logprobs, SamplingParams};
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
    fn copy_prefix(&self, src: &mut dyn Session, dst: &mut dyn Session, len: usize) -> Result<()> {
        self.inner.copy_prefix(src, dst, len)
    }
    fn loops_sampling(&self, _params: &SamplingParams) -> bool {
        true
    }
    fn decode_loop(
        &self,
        session: &mut dyn Session,
        first: u32,
        req: &LoopRequest<'_>,
        on_token: &mut dyn FnMut(u32, Option<TokenLogprob>) -> bool,
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
            // The logprobs are of the raw logits, before any mask.
            let wants_logprobs = req.sampling.and_then(|s| s.params.logprobs);
            let raw = wants_logprobs.map(|_| logits.clone());
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
            let lp = wants_logprobs.zip(raw.as_deref()).map(|(n, raw)| {
                let (logprob, top) = logprobs(raw, token, n);
                TokenLogprob { token_id: token, logprob, top }
            });
            if !on_token(token, lp) || req.end_ids.contains(&token) {
                break;
            }
        }
        Ok(Some(LoopOutcome { accepted, device_steps: accepted, host_cpu_seconds: 0.0 }))
    }
}

fn engines_failing_after(fail_after: Option<usize>) -> (Engine, Engine, Arc<AtomicUsize>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/parity/fixtures/tiny-llama");
    let opts = EngineOptions { device: Device::Cpu, progress: crate::options::Progress::Off, ..EngineOptions::default() };
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
fn requests_with_logprobs_loop_with_the_same_tokens_and_logprobs_as_steps() {
    let (plain, looping, launches) = engines();
    let cases = [
        SamplingParams { logprobs: Some(5), ignore_eos: true, ..SamplingParams::greedy(40) },
        SamplingParams { logprobs: Some(0), min_tokens: 10, ..SamplingParams::greedy(30) },
        SamplingParams { temperature: 0.8, seed: Some(3), logprobs: Some(2), repetition_penalty: 1.2, ..SamplingParams::greedy(30) },
        SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, seed: Some(7), logprobs: Some(20), ..SamplingParams::greedy(30) },
    ];
    for params in cases {
        let want = plain.generate("the quick brown fox", &params).unwrap();
        let got = looping.generate("the quick brown fox", &params).unwrap();
        assert_eq!(got.token_ids, want.token_ids, "{params:?}");
        let (got_lp, want_lp) = (got.logprobs.expect("logprobs"), want.logprobs.expect("logprobs"));
        assert_eq!(got_lp.len(), got.token_ids.len());
        assert_eq!(got_lp, want_lp, "{params:?}");
        assert!(got_lp.iter().all(|l| l.top.len() == params.logprobs.unwrap()));
    }
    assert!(launches.load(Ordering::Relaxed) >= 4, "requests with logprobs ran as device loops");
}

#[test]
fn batched_requests_do_not_loop_and_a_closed_stream_stops_one() {
    let (_, looping, launches) = engines();
    let two = ["a", "b"].map(|p| EngineRequest { prompt: p.into(), prompt_ids: looping.encode_prompt(p).unwrap(), params: SamplingParams::greedy(20) });
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

#[test]
fn a_device_loop_after_a_reused_prefix_gives_the_same_outputs() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/parity/fixtures/tiny-llama");
    let opts = EngineOptions { device: Device::Cpu, progress: crate::options::Progress::Off, prefix_block: 8, ..EngineOptions::default() };
    let launches = Arc::new(AtomicUsize::new(0));
    let counter = launches.clone();
    let looping = Engine::load(path, opts.clone())
        .unwrap()
        .wrap_backend(|inner| Box::new(SteppingLoop { inner, launches: counter, fail_after: None }));
    let plain = Engine::load(path, EngineOptions { prefix_cache_bytes: 0, ..opts }).unwrap();
    let first: Vec<u32> = (0..35).map(|i| (i * 37 + 11) % 500).collect();
    let second: Vec<u32> = first.iter().copied().chain([4, 40, 400]).collect();
    for params in [
        SamplingParams { ignore_eos: true, ..SamplingParams::greedy(40) },
        SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(5), ignore_eos: true, ..SamplingParams::greedy(40) },
    ] {
        let run = |e: &Engine, ids: &[u32]| e.generate_ids(String::new(), ids.to_vec(), &params, &mut |_| true).unwrap();
        run(&looping, &first);
        let before = launches.load(Ordering::Relaxed);
        let got = run(&looping, &second);
        assert_eq!(got.metrics.cached_prompt_tokens, 32);
        assert!(launches.load(Ordering::Relaxed) > before, "the reused session decoded in the device loop");
        assert_eq!(got.token_ids, run(&plain, &second).token_ids);
    }
}

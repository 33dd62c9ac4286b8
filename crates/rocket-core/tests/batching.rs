//! Continuous batching on the CPU backend: a batched pass gives each sequence
//! the logits it gets alone, requests that join, leave and are cancelled
//! mid-flight produce exactly their solo output, and bad requests are refused
//! before anything runs.

mod common;

use std::cell::RefCell;
use std::rc::Rc;

use common::*;
use rocket_core::{BatchEvent, Batcher, Engine, EngineOptions, EngineRequest, FinishReason, RequestOutput, SamplingParams};

fn engine(name: &str) -> Engine {
    Engine::load(fixture(name), EngineOptions::default()).unwrap()
}

fn req(prompt: impl Into<String>, prompt_ids: Vec<u32>, params: SamplingParams) -> EngineRequest {
    EngineRequest { prompt: prompt.into(), prompt_ids, params }
}

fn sampled(max_tokens: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: Some(seed),
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

#[test]
fn batch_outputs_equal_solo_runs_with_mixed_params_and_lengths() {
    for name in ["tiny-llama", "tiny-qwen3"] {
        let e = engine(name);
        let prompts = ["hello world", "a", "the quick brown fox jumps", "zz top", "logprobs too"];
        let params = [
            SamplingParams { ignore_eos: true, ..SamplingParams::greedy(9) },
            sampled(4, 1),
            sampled(13, 2),
            SamplingParams { repetition_penalty: 1.3, ignore_eos: true, ..SamplingParams::greedy(6) },
            // The host picks every row of a pass with it (in parallel): tokens and logprobs as alone.
            SamplingParams { logprobs: Some(3), ..sampled(7, 3) },
        ];
        let requests = prompts
            .iter()
            .zip(&params)
            .map(|(p, sp)| req(*p, e.encode_prompt(p).unwrap(), sp.clone()))
            .collect();
        let batched = e.generate_many(requests).unwrap();
        for ((p, sp), b) in prompts.iter().zip(&params).zip(&batched) {
            let solo = e.generate(p, sp).unwrap();
            assert_eq!(b.prompt, *p, "{name}: outputs out of order");
            assert_eq!(b.token_ids, solo.token_ids, "{name}: {p:?} differs in a batch");
            assert_eq!(b.text, solo.text);
            assert_eq!(b.logprobs, solo.logprobs, "{name}: {p:?}'s logprobs differ in a batch");
            assert_eq!(b.token_ids.len(), sp.max_tokens);
        }
    }
}

type Events = Rc<RefCell<Vec<(usize, BatchEvent)>>>;

fn recording_sink<'a>(events: &Events, tag: usize, cancel_after: Option<usize>) -> rocket_core::batch::Sink<'a> {
    let events = events.clone();
    let mut deltas = 0;
    Box::new(move |ev| {
        if matches!(ev, BatchEvent::Delta(_)) {
            deltas += 1;
        }
        events.borrow_mut().push((tag, ev));
        cancel_after.is_none_or(|n| deltas < n)
    })
}

fn finished(events: &Events, tag: usize) -> RequestOutput {
    let evs = events.borrow();
    let ends: Vec<&RequestOutput> = evs
        .iter()
        .filter(|(t, _)| *t == tag)
        .filter_map(|(_, e)| match e {
            BatchEvent::Finished(o) => Some(o),
            _ => None,
        })
        .collect();
    assert_eq!(ends.len(), 1, "request {tag} must finish exactly once");
    ends[0].clone()
}

#[test]
fn requests_join_between_steps_and_cancelled_ones_leave() {
    let e = engine("tiny-llama");
    let p = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10) };
    let events: Events = Default::default();
    let mut b = Batcher::new(&e, 2);
    let ids = |s: &str| e.encode_prompt(s).unwrap();
    b.add(req("hello world", ids("hello world"), p.clone()), recording_sink(&events, 0, None)).unwrap();
    b.add(req("stop me", ids("stop me"), p.clone()), recording_sink(&events, 1, Some(3))).unwrap();
    // Over max_batch: waits until a slot frees.
    b.add(req("third one", ids("third one"), p.clone()), recording_sink(&events, 2, None)).unwrap();
    assert_eq!(b.step().unwrap(), 3);
    b.step().unwrap();
    // Joins while the others are mid-decode.
    let late = b.add(req("late", ids("late"), p.clone()), recording_sink(&events, 3, None)).unwrap();
    b.step().unwrap();
    b.cancel(late);
    b.run_to_completion().unwrap();
    assert_eq!(b.pending(), 0);

    for (tag, prompt) in [(0, "hello world"), (2, "third one")] {
        let out = finished(&events, tag);
        assert_eq!(out.token_ids, e.generate(prompt, &p).unwrap().token_ids, "{prompt:?}");
        assert_eq!(out.finish_reason, FinishReason::Length);
    }
    let stopped = finished(&events, 1);
    assert_eq!(stopped.finish_reason, FinishReason::Cancelled);
    assert_eq!(stopped.token_ids.len(), 3);
    let solo = e.generate("stop me", &p).unwrap();
    assert_eq!(stopped.token_ids, solo.token_ids[..3]);
    assert_eq!(finished(&events, 3).finish_reason, FinishReason::Cancelled);
    // Each request's streamed text is a prefix of its final text, in order.
    for tag in 0..3 {
        let streamed: String = events
            .borrow()
            .iter()
            .filter(|(t, _)| *t == tag)
            .filter_map(|(_, ev)| match ev {
                BatchEvent::Delta(d) => Some(d.text.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(streamed, finished(&events, tag).text);
    }
}

#[test]
fn invalid_requests_are_refused_without_running() {
    let e = Engine::load(fixture("tiny-llama"), EngineOptions { max_seq_len: Some(32), ..EngineOptions::default() }).unwrap();
    let mut b = Batcher::new(&e, 4);
    let never = |_: BatchEvent| -> bool { panic!("a refused request's sink must not be called") };
    let bad_temp = SamplingParams { temperature: -1.0, ..SamplingParams::greedy(4) };
    assert!(b.add(req("x", vec![5, 6], bad_temp), Box::new(never)).is_err());
    assert!(b.add(req("x", vec![5; 30], SamplingParams::greedy(4)), Box::new(never)).is_err());
    assert!(b.add(req("x", vec![], SamplingParams::greedy(4)), Box::new(never)).is_err());
    let vocab = e.spec().vocab_size as u32;
    assert!(b.add(req("x", vec![vocab], SamplingParams::greedy(4)), Box::new(never)).is_err());
    assert_eq!(b.pending(), 0);
    assert_eq!(b.step().unwrap(), 0);
}

#[test]
fn long_prompts_prefill_in_pieces_without_changing_any_output() {
    for name in ["tiny-llama", "tiny-qwen3"] {
        let e = engine(name);
        let prompts = ["the quick brown fox jumps over the lazy dog again and again", "hi", "zz top plays the blues tonight"];
        let params = [SamplingParams { ignore_eos: true, ..SamplingParams::greedy(8) }, sampled(6, 9), sampled(7, 4)];
        let run = |chunk: Option<usize>| -> (Vec<RequestOutput>, usize) {
            let events: Events = Default::default();
            let mut b = Batcher::new(&e, 8);
            if let Some(c) = chunk {
                b.set_prefill_chunk(c);
            }
            for (tag, (p, sp)) in prompts.iter().zip(&params).enumerate() {
                b.add(req(p.to_string(), e.encode_prompt(p).unwrap(), sp.clone()), recording_sink(&events, tag, None)).unwrap();
            }
            let mut passes = 0;
            while b.step().unwrap() > 0 {
                passes += 1;
            }
            ((0..prompts.len()).map(|t| finished(&events, t)).collect(), passes)
        };
        let (whole, whole_passes) = run(None);
        let (pieces, piece_passes) = run(Some(3));
        let longest = prompts.iter().map(|p| e.encode_prompt(p).unwrap().len()).max().unwrap();
        assert!(longest > 6, "{name}: the first prompt must need several pieces");
        assert!(piece_passes > whole_passes, "{name}: prompts were not split ({piece_passes} vs {whole_passes} passes)");
        for (a, b) in whole.iter().zip(&pieces) {
            assert_eq!(a.token_ids, b.token_ids, "{name}: {:?}", a.prompt);
            assert_eq!(a.text, b.text);
        }
    }
}

//! Prefix reuse on the CPU backend: a prompt that starts with the whole blocks
//! of an earlier prompt skips their prefill, and every output (tokens and
//! logprobs, bit for bit) is what the same request gives with the cache off.
//! Also: chat turns, a prompt diverging inside a block, eviction under a small
//! budget, requests sharing a system prompt through the scheduler, requests
//! that arrive together prefilling their shared prompt once, and the KV copy
//! itself (logits of a copied prefix equal a full prefill's).

mod common;

use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::*;
use rocket_core::backend::cpu::CpuBackend;
use rocket_core::backend::{Backend, Chunk, Logits};
use rocket_core::{
    BatchEvent, Batcher, ChatMessage, Engine, EngineOptions, EngineRequest, Progress, RequestOutput, SamplingParams, Scheduler, SchedulerOptions,
};

const BLOCK: usize = 8;

fn engine(name: &str, cache_bytes: usize) -> Engine {
    let options = EngineOptions { progress: Progress::Off, prefix_cache_bytes: cache_bytes, prefix_block: BLOCK, ..EngineOptions::default() };
    Engine::load(fixture(name), options).unwrap()
}

fn req(ids: &[u32], params: &SamplingParams) -> EngineRequest {
    EngineRequest { prompt: String::new(), prompt_ids: ids.to_vec(), params: params.clone() }
}

fn run(e: &Engine, ids: &[u32], params: &SamplingParams) -> RequestOutput {
    e.generate_ids(String::new(), ids.to_vec(), params, &mut |_| true).unwrap()
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, logprobs: Some(4), ..SamplingParams::greedy(n) }
}

fn sampled(n: usize, seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, top_k: 50, top_p: 0.95, repetition_penalty: 1.1, seed: Some(seed), ..greedy(n) }
}

/// Per generated token: its id, its logprob's bits, and the top alternatives' (id, bits).
type LogprobBits = Vec<(u32, u32, Vec<(u32, u32)>)>;

/// Tokens, and logprobs with their bits, so that equal means bitwise equal.
fn fingerprint(o: &RequestOutput) -> (Vec<u32>, LogprobBits) {
    let lp = o.logprobs.as_ref().expect("logprobs requested");
    (o.token_ids.clone(), lp.iter().map(|t| (t.token_id, t.logprob.to_bits(), t.top.iter().map(|&(i, p)| (i, p.to_bits())).collect())).collect())
}

fn assert_same(got: &RequestOutput, want: &RequestOutput, what: &str) {
    assert_eq!(fingerprint(got), fingerprint(want), "{what}: output differs with prefix reuse");
    assert_eq!(got.text, want.text, "{what}");
}

#[test]
fn reuse_gives_bitwise_the_same_outputs_greedy_and_sampled() {
    for name in ["tiny-llama", "tiny-qwen3"] {
        let (cached, plain) = (engine(name, 1 << 30), engine(name, 0));
        let first = random_ids(1, 43, 500);
        for (i, params) in [greedy(12), sampled(12, 7), sampled(12, 8)].iter().enumerate() {
            // Shares the first 40 tokens (5 blocks) with `first`, then 9 of its own.
            let mut second = first[..40].to_vec();
            second.extend(random_ids(100 + i as u64, 9, 500));
            let a = run(&cached, &first, params);
            assert_same(&a, &run(&plain, &first, params), &format!("{name}: first prompt"));
            let b = run(&cached, &second, params);
            assert_eq!(b.metrics.cached_prompt_tokens, 40, "{name}: the second prompt reuses 5 whole blocks");
            assert_eq!(b.metrics.prompt_tokens, 49);
            assert_same(&b, &run(&plain, &second, params), &format!("{name}: second prompt, params {i}"));
            assert_eq!(run(&plain, &second, params).metrics.cached_prompt_tokens, 0);
        }
        let s = cached.prefix_cache_stats();
        assert_eq!((s.hits, s.tokens_reused), (5, 5 * 40), "{name}: {s:?}");
        assert_eq!(plain.prefix_cache_stats(), Default::default(), "{name}: a disabled cache does nothing");
    }
}

#[test]
fn a_prompt_diverging_inside_a_block_reuses_only_the_whole_blocks_before_it() {
    let (cached, plain) = (engine("tiny-llama", 1 << 30), engine("tiny-llama", 0));
    let first = random_ids(2, 40, 500);
    run(&cached, &first, &greedy(3));
    for (at, want_reused) in [(21, 16), (16, 16), (15, 8), (3, 0), (39, 32)] {
        let mut other = first.clone();
        other[at] = (other[at] + 1) % 500;
        let out = run(&cached, &other, &greedy(6));
        assert_eq!(out.metrics.cached_prompt_tokens, want_reused, "diverging at token {at}");
        assert_same(&out, &run(&plain, &other, &greedy(6)), &format!("diverging at {at}"));
    }
    // The same prompt again: its last token must still be computed, so all but the last block.
    assert_eq!(run(&cached, &first, &greedy(3)).metrics.cached_prompt_tokens, 32);
}

#[test]
fn chat_turns_reuse_the_previous_turns_prompt() {
    let (cached, plain) = (engine("tiny-llama", 1 << 30), engine("tiny-llama", 0));
    let params = SamplingParams { logprobs: Some(2), ..SamplingParams::greedy(8) };
    let mut messages = vec![ChatMessage { role: "system".into(), content: "You are a terse assistant who answers in one line.".into() }];
    let mut last_prompt_len = 0;
    for (turn, question) in ["What is the capital of France?", "And of Italy?", "Which one is bigger?"].iter().enumerate() {
        messages.push(ChatMessage { role: "user".into(), content: question.to_string() });
        let prompt = cached.apply_chat_template(&messages, true).unwrap();
        let ids = cached.encode_prompt(&prompt).unwrap();
        let before = cached.prefix_cache_stats();
        let out = run(&cached, &ids, &params);
        let after = cached.prefix_cache_stats();
        if turn == 0 {
            assert_eq!(out.metrics.cached_prompt_tokens, 0);
        } else {
            // The previous turn's prompt is a prefix of this one: all of its whole blocks.
            assert_eq!(out.metrics.cached_prompt_tokens, last_prompt_len / BLOCK * BLOCK, "turn {turn}");
            assert_eq!((after.hits - before.hits, after.tokens_reused - before.tokens_reused), (1, out.metrics.cached_prompt_tokens as u64));
        }
        // One entry: each turn's prompt extends the last, which it replaces.
        assert_eq!(after.entries, 1, "turn {turn}");
        assert_same(&out, &run(&plain, &ids, &params), &format!("turn {turn}"));
        last_prompt_len = ids.len();
        messages.push(ChatMessage { role: "assistant".into(), content: out.text.clone() });
    }
}

#[test]
fn a_small_budget_evicts_the_least_recently_used_prefix() {
    let probe = engine("tiny-llama", 1 << 30);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| random_ids(10 + i, 17, 500)).collect();
    run(&probe, &prompts[0], &greedy(1));
    let entry = probe.prefix_cache_stats().bytes;
    assert!(entry > 0);
    // Room for two 16-token entries.
    let e = engine("tiny-llama", 2 * entry);
    let plain = engine("tiny-llama", 0);
    let extended = |p: &Vec<u32>| p[..16].iter().copied().chain([7, 7, 7]).collect::<Vec<u32>>();
    run(&e, &prompts[0], &greedy(1));
    run(&e, &prompts[1], &greedy(1));
    // Using the first makes the second the least recently used ...
    assert_eq!(run(&e, &extended(&prompts[0]), &greedy(2)).metrics.cached_prompt_tokens, 16);
    // ... so the third prompt's entry evicts the second.
    run(&e, &prompts[2], &greedy(1));
    let s = e.prefix_cache_stats();
    assert_eq!((s.entries, s.bytes, s.evictions), (2, 2 * entry, 1));
    let second = extended(&prompts[1]);
    let out = run(&e, &second, &greedy(4));
    assert_eq!(out.metrics.cached_prompt_tokens, 0, "the second prompt was evicted");
    assert_same(&out, &run(&plain, &second, &greedy(4)), "after eviction");
    assert!(e.prefix_cache_stats().bytes <= 2 * entry);
    // A budget below one entry keeps nothing.
    let tiny = engine("tiny-llama", entry - 1);
    run(&tiny, &prompts[0], &greedy(1));
    assert_eq!(run(&tiny, &extended(&prompts[0]), &greedy(1)).metrics.cached_prompt_tokens, 0);
    assert_eq!(tiny.prefix_cache_stats().entries, 0);
    e.clear_prefix_cache();
    assert_eq!(e.prefix_cache_stats().bytes, 0);
}

#[test]
fn a_disabled_cache_reuses_nothing() {
    let e = engine("tiny-llama", 0);
    let p = random_ids(3, 30, 500);
    run(&e, &p, &greedy(2));
    let again: Vec<u32> = p.iter().copied().chain([1, 2, 3]).collect();
    assert_eq!(run(&e, &again, &greedy(2)).metrics.cached_prompt_tokens, 0);
    assert_eq!(e.prefix_cache_stats(), Default::default());
    assert_eq!(e.prefix_cache_limits(), (0, BLOCK));
    let bad = Engine::load(fixture("tiny-llama"), EngineOptions { prefix_block: 0, progress: Progress::Off, ..EngineOptions::default() });
    assert!(bad.err().unwrap().to_string().contains("prefix_block"));
}

#[test]
fn requests_sharing_a_system_prompt_through_the_scheduler_reuse_it() {
    let e = Arc::new(engine("tiny-llama", 1 << 30));
    let plain = engine("tiny-llama", 0);
    let system = random_ids(4, 24, 500);
    let with_question = |seed: u64, n: usize| system.iter().copied().chain(random_ids(seed, n, 500)).collect::<Vec<u32>>();
    let prompts = [with_question(20, 5), with_question(21, 11), with_question(22, 3)];
    let params = [greedy(30), sampled(10, 3), greedy(10)];
    let sched = Scheduler::start(e.clone(), SchedulerOptions::default()).unwrap();
    let (started_tx, started_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let mut go_rx = Some(go_rx);
    let mut results = Vec::new();
    let mut handles = Vec::new();
    for (i, (p, sp)) in prompts.iter().zip(&params).enumerate() {
        let (tx, rx) = mpsc::channel();
        let mut gate = (i == 0).then(|| (started_tx.clone(), go_rx.take().unwrap()));
        let sink = Box::new(move |event: BatchEvent| {
            if let (BatchEvent::Delta(_), Some((started, go))) = (&event, gate.take()) {
                // Hold the first request after its first token until the others are queued,
                // so they join while it runs.
                started.send(()).unwrap();
                go.recv_timeout(Duration::from_secs(30)).unwrap();
            }
            if let BatchEvent::Finished(out) = event {
                tx.send(out).unwrap();
            }
            true
        });
        handles.push(sched.submit(req(p, sp), sink).unwrap());
        results.push(rx);
        if i == 0 {
            started_rx.recv_timeout(Duration::from_secs(30)).unwrap();
        }
    }
    go_tx.send(()).unwrap();
    let outs: Vec<RequestOutput> = results.iter().map(|rx| rx.recv_timeout(Duration::from_secs(60)).unwrap()).collect();
    assert!(outs[0].metrics.max_batch_size >= 2, "the first request ran with the others");
    assert_eq!(outs[0].metrics.cached_prompt_tokens, 0);
    for (i, out) in outs.iter().enumerate().skip(1) {
        assert_eq!(out.metrics.cached_prompt_tokens, 24, "request {i} reuses the shared system prompt");
    }
    for (i, (out, (p, sp))) in outs.iter().zip(prompts.iter().zip(&params)).enumerate() {
        assert_same(out, &run(&plain, p, sp), &format!("request {i}"));
    }
    drop(handles);
}

/// What `batched` saw: the outputs in order, the most requests that ran at
/// once, and the step at which each request got its first token.
struct Batched {
    outs: Vec<RequestOutput>,
    most_running: usize,
    first_token_step: Vec<usize>,
}

/// Runs `prompts` through one batcher with prefill passes of `chunk` tokens,
/// each queued just before the step numbered with it (0: before the first).
fn batched(e: &Engine, prompts: &[(Vec<u32>, usize)], params: &SamplingParams, chunk: usize) -> Batched {
    let (tx, rx) = mpsc::channel();
    let (first_tx, first_rx) = mpsc::channel();
    let mut b = Batcher::new(e, 8);
    b.set_prefill_chunk(chunk);
    let mut most_running = 0;
    let mut first_token_step = vec![usize::MAX; prompts.len()];
    let mut step = 0;
    loop {
        for (i, (p, _)) in prompts.iter().enumerate().filter(|(_, (_, at))| *at == step) {
            let (tx, first_tx) = (tx.clone(), first_tx.clone());
            let mut first = true;
            let sink = Box::new(move |event: BatchEvent| {
                match event {
                    BatchEvent::Delta(_) if std::mem::take(&mut first) => first_tx.send(i).unwrap(),
                    BatchEvent::Finished(out) => tx.send((i, out)).unwrap(),
                    _ => {}
                }
                true
            });
            b.add(req(p, params), sink).unwrap();
        }
        let pending = b.step().unwrap();
        most_running = most_running.max(b.running());
        for i in first_rx.try_iter() {
            first_token_step[i] = step;
        }
        step += 1;
        if pending == 0 && prompts.iter().all(|(_, at)| *at < step) {
            break;
        }
    }
    drop(tx);
    let mut outs: Vec<(usize, RequestOutput)> = rx.iter().collect();
    outs.sort_by_key(|(i, _)| *i);
    assert_eq!(outs.len(), prompts.len());
    Batched { outs: outs.into_iter().map(|(_, o)| o).collect(), most_running, first_token_step }
}

#[test]
fn requests_arriving_together_prefill_their_shared_prompt_once() {
    let (cached, plain) = (engine("tiny-qwen3", 1 << 30), engine("tiny-qwen3", 0));
    let system = random_ids(30, 43, 500);
    let prompts: Vec<(Vec<u32>, usize)> =
        (0..4).map(|i| (system.iter().copied().chain(random_ids(31 + i, 5 + 3 * i as usize, 500)).collect(), 0)).collect();
    for params in [greedy(6), sampled(6, 11)] {
        cached.clear_prefix_cache();
        let before = cached.prefix_cache_stats();
        let Batched { outs, most_running, first_token_step } = batched(&cached, &prompts, &params, BLOCK);
        // The first prefills the 40 tokens of whole blocks it shares with the
        // others, keeping them as it passes them (5 passes); the others wait,
        // then copy them and prefill the rest in passes of 8, and get their
        // first tokens at the steps they would have without waiting (prompts
        // of 48, 51, 54 and 57 tokens: 6, 7, 7 and 8 passes).
        let reused: Vec<usize> = outs.iter().map(|o| o.metrics.cached_prompt_tokens).collect();
        assert_eq!(reused, [0, 40, 40, 40]);
        assert_eq!(first_token_step, [5, 6, 6, 7]);
        let after = cached.prefix_cache_stats();
        assert_eq!((after.hits - before.hits, after.tokens_reused - before.tokens_reused), (3, 120));
        assert_eq!(most_running, 4, "the waiting requests joined the batch once the shared blocks were kept");
        for (i, (out, (p, _))) in outs.iter().zip(&prompts).enumerate() {
            assert_same(out, &run(&plain, p, &params), &format!("request {i}"));
        }
        // With the cache off they all prefill at once, and give the same outputs.
        let alone = batched(&plain, &prompts, &params, BLOCK);
        assert_eq!(alone.most_running, 4);
        for (i, (a, b)) in outs.iter().zip(&alone.outs).enumerate() {
            assert_same(a, b, &format!("request {i} beside the others, cache off"));
        }
    }
}

#[test]
fn a_request_waits_for_a_prefill_that_keeps_its_blocks_within_what_it_would_prefill() {
    let (e, plain) = (engine("tiny-llama", 1 << 30), engine("tiny-llama", 0));
    let long = random_ids(40, 100, 500);
    let later = |shared: usize, seed: u64| long[..shared].iter().copied().chain(random_ids(seed, 6, 500)).collect::<Vec<u32>>();
    // (the later prompt, the step it arrives at, the tokens it should reuse, the
    // step of its first token)
    let cases = [
        // One block in common, and the long prefill is three blocks in: it has
        // passed it, keeps it after its next pass (one block, what the later
        // request would prefill), and the later request waits for it.
        (later(BLOCK, 41), 3, BLOCK, 4),
        // Two blocks in common, the long prefill one block in: it keeps them one
        // pass later, and the later request waits for them.
        (later(2 * BLOCK, 42), 1, 2 * BLOCK, 2),
        // Together from the start: the long prefill keeps the one shared block first.
        (later(BLOCK, 43), 0, BLOCK, 1),
    ];
    for (i, (prompt, at, want, first_token)) in cases.into_iter().enumerate() {
        e.clear_prefix_cache();
        let Batched { outs, most_running, first_token_step } = batched(&e, &[(long.clone(), 0), (prompt.clone(), at)], &greedy(3), BLOCK);
        assert_eq!(outs[1].metrics.cached_prompt_tokens, want, "case {i}");
        assert_eq!(first_token_step[1], first_token, "case {i}");
        assert_eq!(most_running, 2, "case {i}");
        assert_same(&outs[1], &run(&plain, &prompt, &greedy(3)), &format!("case {i}"));
        assert_same(&outs[0], &run(&plain, &long, &greedy(3)), &format!("case {i}: the long prompt"));
    }
}

#[test]
fn copied_prefix_kv_gives_the_logits_of_a_full_prefill() {
    let (spec, weights) = open_weights(&fixture("tiny-qwen3"));
    let vocab = spec.vocab_size;
    let backend = CpuBackend::new(spec, Arc::new(weights));
    let ids = random_ids(5, 37, vocab);
    let mut full = backend.new_session(64).unwrap();
    let want = backend.forward(&mut [Chunk { session: full.as_mut(), tokens: &ids }], Logits::All).unwrap();
    for n in [1, 8, 24, 36] {
        let mut kept = backend.new_session(n).unwrap();
        backend.copy_prefix(full.as_mut(), kept.as_mut(), n).unwrap();
        assert_eq!((kept.len(), kept.capacity()), (n, n));
        let mut reuse = backend.new_session(64).unwrap();
        backend.copy_prefix(kept.as_mut(), reuse.as_mut(), n).unwrap();
        let got = backend.forward(&mut [Chunk { session: reuse.as_mut(), tokens: &ids[n..] }], Logits::All).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want[n * vocab..]), "logits after {n} copied positions");
        assert_eq!(reuse.len(), ids.len());
    }
    // Copying more than the source holds, or than the target has room for, fails and changes nothing.
    let mut small = backend.new_session(4).unwrap();
    assert!(backend.copy_prefix(full.as_mut(), small.as_mut(), 5).is_err());
    let mut big = backend.new_session(64).unwrap();
    assert!(backend.copy_prefix(small.as_mut(), big.as_mut(), 1).is_err());
    assert_eq!(big.len(), 0);
}

//! Prefill passes as the batcher cuts them, checked on the passes themselves by
//! a backend that records every chunk's (first position, rows): the CPU
//! backend's per-row math would hide where a prompt is cut, the GPU's would not.
//! - The rule of prefix reuse (see `prefix_cache`): every pass of a prompt, with
//!   or without reuse, has at least the rows that keep a row's bits, and a reused
//!   prefix leaves at least that many tokens to compute.
//! - Pieces beside decoding requests (`batch::piece_end`): a prompt that arrives
//!   while another request decodes comes in pieces its attention budget allows.

use std::sync::{Arc, Mutex};

use crate::backend::{Backend, Chunk, Logits, Session};
use crate::batch::{chunk_end, piece_end, RowCost, PIECE_ROWS};
use crate::engine::{Engine, EngineOptions};
use crate::error::Result;
use crate::sampling::SamplingParams;
use crate::Device;

/// Each chunk's (first position, rows) and the logits its pass asked for.
type Passes = Arc<Mutex<Vec<(usize, usize, Logits)>>>;

/// tiny-llama's vocabulary: the logits' row length.
const VOCAB: usize = 512;

struct Recording {
    inner: Box<dyn Backend>,
    passes: Passes,
}

impl Backend for Recording {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
        self.inner.new_session(capacity)
    }
    fn forward(&self, chunks: &mut [Chunk<'_>], logits: Logits) -> Result<Vec<f32>> {
        let mut p = self.passes.lock().unwrap();
        p.extend(chunks.iter().map(|c| (c.session.len(), c.tokens.len(), logits)));
        drop(p);
        let rows = match logits {
            Logits::Last => chunks.len(),
            Logits::All => chunks.iter().map(|c| c.tokens.len()).sum(),
            Logits::KvOnly => 0,
        };
        let out = self.inner.forward(chunks, logits)?;
        assert_eq!(out.len(), rows * VOCAB, "{logits:?}: the rows it returns");
        Ok(out)
    }
    fn copy_prefix(&self, src: &mut dyn Session, dst: &mut dyn Session, len: usize) -> Result<()> {
        self.inner.copy_prefix(src, dst, len)
    }
}

/// Each recorded chunk's (first position, rows).
fn spans(p: &Passes) -> Vec<(usize, usize)> {
    p.lock().unwrap().iter().map(|&(start, rows, _)| (start, rows)).collect()
}

/// `ids` alone through a batcher of one, in prefill passes of at most `chunk`
/// tokens (the CPU backend's rows keep their bits in passes of any length).
fn run_alone(e: &Engine, ids: &[u32], chunk: usize, params: &SamplingParams) -> crate::output::RequestOutput {
    run_alone_with(e, ids, chunk, (1, 1), params)
}

/// `run_alone` with a prompt's first passes of `shared.0` rows and later passes
/// of `shared.1` taken to keep their rows' bits, as a GPU backend says (`chunk_end`).
fn run_alone_with(e: &Engine, ids: &[u32], chunk: usize, shared: (usize, usize), params: &SamplingParams) -> crate::output::RequestOutput {
    let out = std::cell::RefCell::new(None);
    let mut b = crate::Batcher::new(e, 1);
    b.set_prefill_chunk(chunk);
    b.set_shared_rows(shared.0, shared.1);
    b.add(crate::EngineRequest { prompt: String::new(), prompt_ids: ids.to_vec(), params: params.clone() }, Box::new(|ev| {
        if let crate::BatchEvent::Finished(o) = ev {
            *out.borrow_mut() = Some(o);
        }
        true
    }))
    .unwrap();
    b.run_to_completion().unwrap();
    drop(b);
    out.into_inner().unwrap()
}

/// The passes' (start, rows) of a prompt of `len` tokens (not its decode steps').
fn prefill_spans(p: &Passes, len: usize) -> Vec<(usize, usize)> {
    spans(p).into_iter().filter(|&(start, _)| start < len).collect()
}

/// A first prompt of 130 tokens, and a later prompt: its first `shared` tokens and
/// then `n` others.
fn first_and_then() -> (Vec<u32>, impl Fn(usize, u32) -> Vec<u32>) {
    let first: Vec<u32> = (0..130).map(|i| (i * 13 + 5) % 500).collect();
    let prefix = first.clone();
    (first, move |shared: usize, n: u32| prefix[..shared].iter().copied().chain((0..n).map(|i| (i * 7 + 1) % 500)).collect())
}

fn engine(block: usize, cache_bytes: usize) -> (Engine, Passes) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/parity/fixtures/tiny-llama");
    let opts = EngineOptions {
        device: Device::Cpu,
        progress: crate::options::Progress::Off,
        prefix_block: block,
        prefix_cache_bytes: cache_bytes,
        ..EngineOptions::default()
    };
    let passes = Passes::default();
    let rec = passes.clone();
    (Engine::load(path, opts).unwrap().wrap_backend(|inner| Box::new(Recording { inner, passes: rec })), passes)
}

#[test]
fn passes_take_whole_chunks_and_leave_no_last_pass_shorter_than_the_shared_rows() {
    let ends = |start: usize, len: usize, chunk: usize, shared: usize| -> Vec<usize> {
        std::iter::successors(Some(start), |&s| (s < len).then(|| chunk_end(s, len, chunk, shared))).skip(1).collect()
    };
    // Chunk 2,048 and 512 shared rows (the defaults on the GPU): the 4 rows past 4,096
    // join the pass before them, which a chat turn after 3,584 cached tokens runs alone.
    assert_eq!(ends(0, 4100, 2048, 512), [2048, 4100]);
    assert_eq!(ends(3584, 4100, 2048, 512), [4100]);
    assert_eq!(ends(0, 4700, 2048, 512), [2048, 4096, 4700]);
    assert_eq!(ends(0, 2559, 2048, 512), [2559]);
    assert_eq!(ends(0, 2560, 2048, 512), [2048, 2560]);
    assert_eq!(ends(0, 300, 2048, 512), [300]); // shorter than the shared rows: one pass
    // A chunk under the shared rows takes the shared rows.
    assert_eq!(ends(0, 1300, 256, 512), [512, 1300]);
    // One shared row (the CPU): plain chunks, the last one short.
    assert_eq!(ends(0, 45, 20, 1), [20, 40, 45]);
    assert_eq!(ends(16, 45, 20, 1), [36, 45]);
}

#[test]
fn a_reused_prefix_leaves_at_least_the_shared_rows_to_compute_in_one_pass_or_more() {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(3) };
    let (first, then) = first_and_then();
    // Block 64, chunk 64, passes of 64 rows or more taken to keep their rows' bits:
    // the first prompt runs [0, 64) and [64, 130) and keeps its two blocks.
    let (cached, with) = engine(64, 1 << 30);
    let (plain, without) = engine(64, 0);
    let run = |e: &Engine, ids: &[u32]| run_alone_with(e, ids, 64, (64, 64), &params);
    run(&cached, &first);
    // (the prompt, the tokens it reuses, its passes with and without reuse)
    let cases = [
        // 230 tokens: the two cached blocks, then 102 rows in one pass (38 would be too few for a second).
        (then(130, 100), 128, vec![(128, 102)], vec![(0, 64), (64, 64), (128, 102)]),
        // 150 tokens: reusing both blocks would leave 22 rows; one block leaves 86.
        (then(130, 20), 64, vec![(64, 86)], vec![(0, 64), (64, 86)]),
        // Diverging in the second block: one block, then whole chunks.
        (then(100, 153), 64, vec![(64, 64), (128, 125)], vec![(0, 64), (64, 64), (128, 125)]),
    ];
    for (i, (second, reused, passes_with, passes_without)) in cases.into_iter().enumerate() {
        with.lock().unwrap().clear();
        without.lock().unwrap().clear();
        let got = run(&cached, &second);
        assert_eq!(got.metrics.cached_prompt_tokens, reused, "case {i}");
        let want = run(&plain, &second);
        assert_eq!(got.token_ids, want.token_ids, "case {i}");
        assert_eq!(prefill_spans(&with, second.len()), passes_with, "case {i}: with reuse");
        assert_eq!(prefill_spans(&without, second.len()), passes_without, "case {i}: without");
    }
    // A prompt shorter than the shared rows ran in a shorter pass: it is never kept
    // (here in blocks of 16, of which it has three).
    let (small_blocks, _) = engine(16, 1 << 30);
    let run16 = |ids: &[u32]| run_alone_with(&small_blocks, ids, 64, (64, 64), &params).metrics.cached_prompt_tokens;
    run16(&first[..63]);
    assert_eq!(run16(&then(63, 100)), 0);
    small_blocks.clear_prefix_cache();
    run16(&first[..64]);
    assert_eq!(run16(&then(63, 100)), 48);
}

#[test]
fn a_reuse_leaves_the_later_passes_rows_and_prompts_under_the_first_passes_rows_neither_cache_nor_reuse() {
    // As on the GPU: a prompt's first pass keeps its rows' bits from 64 rows (so a
    // shorter prompt is never kept), a pass after a reused prefix from 16.
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(3) };
    let (first, then) = first_and_then();
    let (cached, with) = engine(16, 1 << 30);
    let (plain, _) = engine(16, 0);
    let run = |e: &Engine, ids: &[u32]| run_alone_with(e, ids, 64, (64, 16), &params);
    run(&cached, &first);
    // 150 tokens: eight cached blocks leave 22 rows, one pass (16 would do; 64 would
    // allow five blocks only).
    with.lock().unwrap().clear();
    let second = then(130, 20);
    let got = run(&cached, &second);
    assert_eq!(got.metrics.cached_prompt_tokens, 128);
    assert_eq!(prefill_spans(&with, second.len()), [(128, 22)]);
    assert_eq!(got.token_ids, run(&plain, &second).token_ids);
    // A 50-token prompt runs alone as one first pass of 50 rows, whose bits later
    // passes would not give: it reuses none of the 48 tokens it shares.
    assert_eq!(run(&cached, &then(48, 2)).metrics.cached_prompt_tokens, 0);
    assert_eq!(run(&cached, &then(48, 16)).metrics.cached_prompt_tokens, 48);
    // 63 tokens ran in one pass of 63 rows, under the first pass's 64: not kept.
    cached.clear_prefix_cache();
    run(&cached, &first[..63]);
    assert_eq!(run(&cached, &then(63, 100)).metrics.cached_prompt_tokens, 0);
    cached.clear_prefix_cache();
    run(&cached, &first[..64]);
    assert_eq!(run(&cached, &then(63, 100)).metrics.cached_prompt_tokens, 48);
}

#[test]
fn a_reused_prefix_gives_the_tokens_of_a_full_prefill() {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(3) };
    let first: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % 500).collect();
    let second: Vec<u32> = first.iter().copied().chain((0..30).map(|i| (i * 7 + 1) % 500)).collect();
    for (block, chunk) in [(8, 512), (8, 20), (16, 6)] {
        let (cached, with) = engine(block, 1 << 30);
        let (plain, _) = engine(block, 0);
        let run = |e: &Engine, ids: &[u32], chunk: usize| run_alone(e, ids, chunk, &params);
        run(&cached, &first, chunk);
        with.lock().unwrap().clear();
        let got = run(&cached, &second, chunk);
        let reused = got.metrics.cached_prompt_tokens;
        assert_eq!(reused, 40 / block * block, "block {block}");
        let want = run(&plain, &second, chunk);
        assert_eq!(got.token_ids, want.token_ids, "block {block}, chunk {chunk}");
        // Its passes: chunks from the reused prefix on.
        let starts: Vec<usize> = prefill_spans(&with, second.len()).into_iter().map(|(start, _)| start).collect();
        assert_eq!(starts, (reused..second.len()).step_by(chunk).collect::<Vec<_>>(), "block {block}, chunk {chunk}");
    }
}

#[test]
fn pieces_beside_decoding_requests_follow_the_budget() {
    // Llama-3.2-1B: 973 M multiply-adds per row in the matrices, 2 x 2048 x 16 per
    // (row, key) pair in attention.
    let llama = RowCost { matmul_macs: 16 * (2048 * (2 * 2048 + 2 * 512) + 3 * 2048 * 8192), pair_macs: 2 * 2048 * 16 };
    let spec = crate::megakernel::verify::tests::spec(2048, 8192, 16, 32, 8, 64, 128_256);
    assert_eq!(spec.layer_matmul_macs(), llama.matmul_macs);
    assert_eq!(llama.matmul_macs, 973_078_528);
    let budget = crate::batch::INTERACTIVE_PIECE_MACS;
    let piece = |start: usize| piece_end(start, 20_000, 512, 512, true, llama, budget) - start;
    assert_eq!([0, 512, 1024, 4096, 16_384].map(piece), [128, 128, 64, 64, 64]);
    // A small model (SmolLM2-135M's shape) keeps whole chunks further in.
    let smol = RowCost { matmul_macs: 30 * (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536), pair_macs: 2 * 576 * 30 };
    let small = |start: usize| piece_end(start, 20_000, 512, 512, true, smol, budget) - start;
    assert_eq!([0, 1024, 4096, 16_384].map(small), [512, 512, 320, 64]);
    for cost in [llama, smol] {
        for start in (0..19_968).step_by(512) {
            let rows = piece_end(start, 20_000, 512, 512, true, cost, budget) - start;
            assert_eq!(rows % PIECE_ROWS, 0, "at {start}");
            // Within budget, unless it is the smallest piece; and the next size up is not.
            assert!(rows == PIECE_ROWS || cost.piece(start, rows) <= budget as u128, "at {start}: {rows} rows");
            assert!(rows == 512 || cost.piece(start, rows + PIECE_ROWS) > budget as u128, "at {start}: {rows} rows");
        }
    }
    // Alone, whole chunks; beside decoding, still never across a chunk or the prompt's end.
    assert_eq!(piece_end(8192, 20_000, 2048, 512, false, llama, budget), 10_240);
    let across = piece_end(0, 20_000, 2048, 512, true, smol, budget);
    assert!(across > 512 && across % PIECE_ROWS == 0 && smol.piece(0, across) <= budget as u128, "{across}");
    assert_eq!(piece_end(0, 20_000, 2048, 512, true, smol, budget), 832);
    assert_eq!(piece_end(16_384, 16_400, 512, 512, true, llama, budget), 16_400);
}

type Finished = std::rc::Rc<std::cell::RefCell<Vec<(&'static str, Vec<u32>)>>>;

/// Runs `long` through a batcher of two, after `short`'s prompt pass when given
/// (so `short` decodes beside it); returns the prompt passes and each one's tokens.
fn beside(e: &Engine, passes: &Passes, short: Option<&[u32]>, long: &[u32], piece_macs: u64) -> (Vec<(usize, usize)>, Finished) {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
    let finished = Finished::default();
    passes.lock().unwrap().clear();
    let mut b = crate::Batcher::new(e, 2);
    b.set_interactive_piece_macs(piece_macs);
    let add = |b: &mut crate::Batcher<'_>, name: &'static str, ids: &[u32]| {
        let done = finished.clone();
        let request = crate::EngineRequest { prompt: String::new(), prompt_ids: ids.to_vec(), params: params.clone() };
        b.add(request, Box::new(move |ev| {
            if let crate::BatchEvent::Finished(o) = ev {
                done.borrow_mut().push((name, o.token_ids));
            }
            true
        }))
        .unwrap();
    };
    if let Some(short) = short {
        add(&mut b, "short", short);
        b.step().unwrap(); // the short prompt's pass: it decodes from the next one on
    }
    add(&mut b, "long", long);
    b.run_to_completion().unwrap();
    drop(b);
    let prompt_passes = spans(passes).into_iter().filter(|&(start, rows)| rows > 1 && start < long.len()).collect();
    (prompt_passes, finished)
}

#[test]
fn a_prompt_arriving_while_another_decodes_comes_in_pieces_with_the_same_tokens() {
    let short: Vec<u32> = (0..5).map(|i| (i * 31 + 2) % 500).collect();
    let long: Vec<u32> = (0..200).map(|i| (i * 17 + 3) % 500).collect();
    let (e, passes) = engine(512, 0);
    // Every piece's attention over budget: the smallest pieces, whole tiles.
    let cost = e.batch_model().row_cost;
    let small = u64::try_from(cost.piece(0, 64)).unwrap();
    let tokens = |f: &Finished, name: &str| f.borrow().iter().find(|(n, _)| *n == name).map(|(_, t)| t.clone()).unwrap();
    let (alone, solo) = beside(&e, &passes, None, &long, small);
    assert_eq!(alone, [(0, 200)], "a prompt alone takes whole chunks");
    let (pieces, both) = beside(&e, &passes, Some(&short), &long, small);
    assert_eq!(pieces, [(0, 5), (0, 64), (64, 64), (128, 64), (192, 8)], "the long prompt beside a decoding request");
    assert_eq!(tokens(&both, "long"), tokens(&solo, "long"), "the long prompt's tokens depend on its pieces");
    assert_eq!(tokens(&both, "short").len(), 12);
    // With the default budget a 200-token prompt at the start of its context is one piece.
    let (default, _) = beside(&e, &passes, Some(&short), &long, crate::batch::INTERACTIVE_PIECE_MACS);
    assert_eq!(default, [(0, 5), (0, 200)]);
}

#[test]
fn prompt_pieces_change_no_token_and_a_kv_only_pass_fills_the_cache_alike() {
    let (e, passes) = engine(512, 0);
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(4) };
    let prompt: Vec<u32> = (0..150).map(|i| (i * 29 + 11) % 500).collect();
    let run = |chunk: usize| {
        passes.lock().unwrap().clear();
        let tokens = run_alone(&e, &prompt, chunk, &params).token_ids;
        (tokens, passes.lock().unwrap().clone())
    };
    let (whole, one) = run(512);
    assert_eq!(one[0], (0, 150, Logits::Last), "{one:?}");
    let (pieces, cut) = run(64);
    let prompt_passes: Vec<_> = cut.iter().copied().filter(|&(_, rows, _)| rows > 1).collect();
    assert_eq!(prompt_passes, [(0, 64, Logits::Last), (64, 64, Logits::Last), (128, 22, Logits::Last)]);
    assert_eq!(pieces, whole, "the prompt's tokens depend on where it was cut");
    assert_eq!(pieces.len(), 4);
    // The backend's KvOnly pass: no rows back, and the cache it leaves gives the next
    // pass the logits a pass with logits would have left.
    let backend = e.batch_model().backend;
    let last_after = |first: Logits| {
        let mut s = backend.new_session(prompt.len()).unwrap();
        let out = backend.forward(&mut [Chunk { session: s.as_mut(), tokens: &prompt[..100] }], first).unwrap();
        assert_eq!(out.len(), if first == Logits::KvOnly { 0 } else { VOCAB }, "{first:?}");
        backend.forward(&mut [Chunk { session: s.as_mut(), tokens: &prompt[100..] }], Logits::Last).unwrap()
    };
    let (kv_only, with_logits) = (last_after(Logits::KvOnly), last_after(Logits::Last));
    assert!(kv_only.iter().zip(&with_logits).all(|(a, b)| a.to_bits() == b.to_bits()));
}

/// `long` from step 0 and `later` from step `at` through one batcher (chunk 64,
/// passes of 16 rows or more taken to keep their bits): `later`'s reused prompt
/// tokens, the step of its first token, and its tokens.
fn arriving(e: &Engine, long: &[u32], later: &[u32], at: usize) -> (usize, usize, Vec<u32>) {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(3) };
    let first_step = std::rc::Rc::new(std::cell::Cell::new(None));
    let out = std::rc::Rc::new(std::cell::RefCell::new(None));
    let step = std::rc::Rc::new(std::cell::Cell::new(0));
    let mut b = crate::Batcher::new(e, 4);
    b.set_prefill_chunk(64);
    b.set_shared_rows(16, 16);
    let request = |ids: &[u32]| crate::EngineRequest { prompt: String::new(), prompt_ids: ids.to_vec(), params: params.clone() };
    b.add(request(long), Box::new(|_| true)).unwrap();
    while b.pending() > 0 || step.get() <= at {
        if step.get() == at {
            let (first_step, out, step) = (first_step.clone(), out.clone(), step.clone());
            b.add(request(later), Box::new(move |ev| {
                match ev {
                    crate::BatchEvent::Delta(_) if first_step.get().is_none() => first_step.set(Some(step.get())),
                    crate::BatchEvent::Finished(o) => *out.borrow_mut() = Some(o),
                    _ => {}
                }
                true
            }))
            .unwrap();
        }
        b.step().unwrap();
        step.set(step.get() + 1);
    }
    drop(b);
    let o = out.borrow_mut().take().unwrap();
    (o.metrics.cached_prompt_tokens, first_step.get().unwrap(), o.token_ids)
}

#[test]
fn a_request_waits_for_a_shared_prefill_only_where_its_first_token_comes_no_later() {
    let (e, _) = engine(16, 1 << 30);
    let (plain, _) = engine(16, 0);
    // The long prompt's passes: [0, 64), [64, 128), [128, 150); the last keeps its 144 tokens' blocks.
    let long: Vec<u32> = (0..150).map(|i| (i * 23 + 7) % 500).collect();
    let later = |shared: usize, new: usize| long[..shared].iter().copied().chain((0..new as u32).map(|i| (i * 11 + 3) % 500)).collect::<Vec<u32>>();
    // (the later prompt, the step it arrives at, the tokens it reuses, the step of its first token)
    let cases = [
        // Seven blocks in common and 40 new tokens: the long prefill keeps them after
        // two passes, then one pass of 40 rows: three passes, as [0, 64), [64, 128),
        // [128, 152) without waiting.
        (later(112, 40), 0, 112, 2),
        // One block in common: waiting one pass, then [16, 56), is a pass more than [0, 56).
        (later(16, 40), 0, 0, 0),
        // Four blocks, passed (the long prefill at 64): its next pass keeps them, and
        // [64, 128), [128, 164) take as many passes as [0, 64), [64, 128), [128, 164).
        (later(64, 100), 1, 64, 3),
        // Three blocks, passed: reusing two (53 - 16 leaves 37) takes a pass to keep
        // them and [32, 53), against [0, 53) alone.
        (later(48, 5), 2, 0, 2),
        // After the long prefill: its whole 144 tokens' blocks, then one pass of 20.
        (later(144, 20), 3, 144, 3),
    ];
    for (i, (prompt, at, reused, first)) in cases.into_iter().enumerate() {
        e.clear_prefix_cache();
        let (got_reused, got_first, tokens) = arriving(&e, &long, &prompt, at);
        assert_eq!((got_reused, got_first), (reused, first), "case {i}: reused tokens, first token's step");
        let (_, _, want) = arriving(&plain, &long, &prompt, at);
        assert_eq!(tokens, want, "case {i}: tokens against the cache off");
    }
}

#[test]
fn a_request_does_not_wait_for_a_prompt_too_short_to_be_cached() {
    // Blocks of 4 tokens: the later prompt shares three blocks with a 15-token prompt,
    // which is shorter than the 16 shared rows and so never cached. Waiting for it
    // would cost a pass and copy nothing: the later prompt runs [0, 64), [64, 80) at once.
    let (e, _) = engine(4, 1 << 30);
    let long: Vec<u32> = (0..15).map(|i| (i * 23 + 7) % 500).collect();
    let later: Vec<u32> = long[..12].iter().copied().chain((0..68).map(|i| (i * 11 + 3) % 500)).collect();
    let (reused, first, _) = arriving(&e, &long, &later, 0);
    assert_eq!((reused, first), (0, 1), "reused tokens, first token's step");
}

#[test]
fn a_request_waiting_for_a_shared_prefill_keeps_its_slot_from_later_arrivals() {
    // A batch of two: the long prompt, then one sharing seven blocks with it (it waits
    // two passes, then copies them), then an unrelated one queued behind it, all at once.
    // The unrelated request may not take the slot the waiting one needs.
    let first_steps = |e: &Engine| {
        let long: Vec<u32> = (0..150).map(|i| (i * 23 + 7) % 500).collect();
        let shared: Vec<u32> = long[..112].iter().copied().chain((0..40).map(|i| (i * 11 + 3) % 500)).collect();
        let other: Vec<u32> = (0..20).map(|i| (i * 13 + 1) % 500).collect();
        let params = |n| SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) };
        let firsts = std::rc::Rc::new(std::cell::RefCell::new([usize::MAX; 3]));
        let outs = std::rc::Rc::new(std::cell::RefCell::new(vec![(0usize, Vec::new()); 3]));
        let step = std::rc::Rc::new(std::cell::Cell::new(0));
        let mut b = crate::Batcher::new(e, 2);
        b.set_prefill_chunk(64);
        b.set_shared_rows(16, 16);
        for (i, (ids, n)) in [(long, 3), (shared, 3), (other, 30)].into_iter().enumerate() {
            let (firsts, outs, step) = (firsts.clone(), outs.clone(), step.clone());
            let request = crate::EngineRequest { prompt: String::new(), prompt_ids: ids, params: params(n) };
            b.add(request, Box::new(move |ev| {
                match ev {
                    crate::BatchEvent::Delta(_) => {
                        let mut f = firsts.borrow_mut();
                        f[i] = f[i].min(step.get());
                    }
                    crate::BatchEvent::Finished(o) => outs.borrow_mut()[i] = (o.metrics.cached_prompt_tokens, o.token_ids),
                    _ => {}
                }
                true
            }))
            .unwrap();
        }
        while b.step().unwrap() > 0 {
            step.set(step.get() + 1);
        }
        drop(b);
        let f = *firsts.borrow();
        let o = outs.borrow().clone();
        (f, o)
    };
    let (e, _) = engine(16, 1 << 30);
    let (plain, _) = engine(16, 0);
    let (firsts, outs) = first_steps(&e);
    assert_eq!(outs[1].0, 112, "the sharing request copies the seven blocks");
    assert_eq!(firsts[1], 2, "and gets its first token three passes in, as without waiting");
    assert!(firsts[2] > 2, "the unrelated request waits for a free slot: {firsts:?}");
    let (_, want) = first_steps(&plain);
    for i in 0..3 {
        assert_eq!(outs[i].1, want[i].1, "request {i}: tokens against the cache off");
    }
}

#[test]
fn the_first_tokens_of_a_pass_reach_their_sinks_before_any_prompt_is_kept() {
    // Block 16, nothing shared: two 64-token prompts prefill in one pass; each one's
    // four blocks are kept after it, by copies of their KV that must delay neither
    // request's first token.
    let (e, passes) = engine(16, 1 << 30);
    let kept_at_first_token = [std::cell::Cell::new(None), std::cell::Cell::new(None)];
    let mut b = crate::Batcher::new(&e, 2);
    b.set_shared_rows(16, 16);
    for (r, kept) in kept_at_first_token.iter().enumerate() {
        let ids: Vec<u32> = (0..64).map(|i| 3 + (i * 7 + 101 * r as u32) % 500).collect();
        let e = &e;
        b.add(crate::EngineRequest { prompt: String::new(), prompt_ids: ids, params: SamplingParams::greedy(3) }, Box::new(move |ev| {
            if matches!(ev, crate::BatchEvent::Delta(_)) && kept.get().is_none() {
                kept.set(Some(e.prefix_cache_stats().inserts));
            }
            true
        }))
        .unwrap();
    }
    b.run_to_completion().unwrap();
    drop(b);
    assert_eq!(spans(&passes)[..2], [(0, 64), (0, 64)], "both prompts in the first pass");
    let kept: Vec<_> = kept_at_first_token.iter().map(|k| k.get()).collect();
    assert_eq!(kept, [Some(0), Some(0)], "a prompt's KV was copied into the cache before a first token of its pass");
    let stats = e.prefix_cache_stats();
    assert_eq!((stats.inserts, stats.entries), (2, 2), "{stats:?}");
}

#[test]
fn a_request_ended_by_its_first_token_still_keeps_its_prompt() {
    let (e, _) = engine(16, 1 << 30);
    let ids: Vec<u32> = (0..48).map(|i| 5 + (i * 11) % 500).collect();
    let out = run_alone_with(&e, &ids, 2048, (16, 16), &SamplingParams::greedy(1));
    assert_eq!(out.token_ids.len(), 1);
    assert_eq!(e.prefix_cache_stats().inserts, 1, "{:?}", e.prefix_cache_stats());
}

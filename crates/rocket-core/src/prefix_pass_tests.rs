//! Prefill passes as the batcher cuts them, checked on the passes themselves by
//! a backend that records every chunk's (first position, rows): the CPU
//! backend's per-row math would hide where a prompt is cut, the GPU's would not.
//! - The block rule of prefix reuse (see `prefix_cache`): a request reusing a
//!   cached prefix runs exactly the passes the same request runs without reuse
//!   after that prefix.
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

/// `ids` alone through a batcher of one, in prefill passes of at most `chunk` tokens.
fn run_alone(e: &Engine, ids: &[u32], chunk: usize, params: &SamplingParams) -> crate::output::RequestOutput {
    run_alone_with(e, ids, chunk, crate::batch::PASS_SHARED_ROWS, params)
}

/// `run_alone` with passes of `shared` rows taken to keep their rows' bits (`chunk_end`).
fn run_alone_with(e: &Engine, ids: &[u32], chunk: usize, shared: usize, params: &SamplingParams) -> crate::output::RequestOutput {
    let out = std::cell::RefCell::new(None);
    let mut b = crate::Batcher::new(e, 1);
    b.set_prefill_chunk(chunk);
    b.set_shared_rows(shared);
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
fn pass_boundaries_are_fixed_positions_of_the_prompt() {
    // Chunk 512, block 512 (the defaults): plain chunks from 0.
    assert_eq!(chunk_end(0, 1300, 512, 512, 512), 512);
    assert_eq!(chunk_end(1024, 1300, 512, 512, 512), 1300);
    // Block 8 inside chunks of 20: every multiple of either.
    let ends: Vec<usize> = std::iter::successors(Some(0), |&s| (s < 45).then(|| chunk_end(s, 45, 20, 8, 512))).skip(1).collect();
    assert_eq!(ends, [8, 16, 20, 24, 32, 40, 45]);
    // Starting at a block boundary joins the same sequence.
    assert_eq!(chunk_end(16, 45, 20, 8, 512), 20);
    assert_eq!(chunk_end(24, 45, 20, 8, 512), 32);
    // Chunk and block whole multiples of the rows that keep their bits (512): passes
    // cross blocks, ending at the chunk's multiples and at the prompt's last whole block
    // (then its tail alone).
    let ends = |start: usize, len: usize, chunk: usize, block: usize| -> Vec<usize> {
        std::iter::successors(Some(start), |&s| (s < len).then(|| chunk_end(s, len, chunk, block, 512))).skip(1).collect()
    };
    assert_eq!(ends(0, 4100, 2048, 512), [2048, 4096, 4100]);
    assert_eq!(ends(1536, 4100, 2048, 512), [2048, 4096, 4100]); // a cached 1,536: the same ends
    assert_eq!(ends(0, 3000, 2048, 512), [2048, 2560, 3000]);
    assert_eq!(ends(0, 1000, 2048, 512), [512, 1000]);
    assert_eq!(ends(0, 5000, 2048, 1024), [2048, 4096, 5000]);
    // A block under 512 ends passes as before: a chat turn after 3,968 cached at block 128.
    assert_eq!(ends(3968, 4100, 2048, 128), [4096, 4100]);
    assert_eq!(ends(0, 700, 2048, 128), [128, 256, 384, 512, 640, 700]);
}

#[test]
fn a_reused_prefix_ends_its_first_pass_where_the_full_prefill_does() {
    // Block 64, chunk 256: a full prefill of 230 tokens runs [0, 192) (its whole blocks)
    // and the tail [192, 230); reusing 128 cached tokens it runs [128, 192) and the same tail.
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(3) };
    let first: Vec<u32> = (0..130).map(|i| (i * 13 + 5) % 500).collect();
    let second: Vec<u32> = first.iter().copied().chain((0..100).map(|i| (i * 7 + 1) % 500)).collect();
    // (Passes of 64 rows or more share their rows' bits here: the CPU backend's never differ.)
    let (cached, with) = engine(64, 1 << 30);
    let (plain, without) = engine(64, 0);
    let run = |e: &Engine, ids: &[u32]| run_alone_with(e, ids, 256, 64, &params);
    run(&cached, &first);
    with.lock().unwrap().clear();
    let got = run(&cached, &second);
    assert_eq!(got.metrics.cached_prompt_tokens, 128);
    let want = run(&plain, &second);
    assert_eq!(got.token_ids, want.token_ids);
    let prefill = |p: &Passes| spans(p).into_iter().filter(|&(start, _)| start < second.len()).collect::<Vec<_>>();
    assert_eq!(prefill(&without), [(0, 192), (192, 38)]);
    assert_eq!(prefill(&with), [(128, 64), (192, 38)]);
}

#[test]
fn a_reused_prefix_leaves_the_passes_after_it_as_they_were() {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(3) };
    let first: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % 500).collect();
    let second: Vec<u32> = first.iter().copied().chain((0..30).map(|i| (i * 7 + 1) % 500)).collect();
    for (block, chunk) in [(8, 512), (8, 20), (16, 6)] {
        let (cached, with) = engine(block, 1 << 30);
        let (plain, without) = engine(block, 0);
        let run = |e: &Engine, ids: &[u32], chunk: usize| run_alone(e, ids, chunk, &params);
        run(&cached, &first, chunk);
        with.lock().unwrap().clear();
        let got = run(&cached, &second, chunk);
        let reused = got.metrics.cached_prompt_tokens;
        assert_eq!(reused, 40 / block * block, "block {block}");
        let want = run(&plain, &second, chunk);
        assert_eq!(got.token_ids, want.token_ids);
        // Prefill passes only (decode steps start at the prompt's end).
        let prefill = |p: &Passes| spans(p).into_iter().filter(|&(start, _)| start < second.len()).collect::<Vec<_>>();
        let all = prefill(&without);
        let after: Vec<(usize, usize)> = all.iter().copied().filter(|&(start, _)| start >= reused).collect();
        assert!(all.iter().any(|&(start, rows)| start < reused && start + rows == reused), "a full prefill splits at {reused}: {all:?}");
        assert_eq!(prefill(&with), after, "block {block}, chunk {chunk}: passes after the reused prefix");
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
    let piece = |start: usize| piece_end(start, 20_000, 512, 512, 512, true, llama, budget) - start;
    assert_eq!([0, 512, 1024, 4096, 16_384].map(piece), [128, 128, 64, 64, 64]);
    // A small model (SmolLM2-135M's shape) keeps whole chunks further in.
    let smol = RowCost { matmul_macs: 30 * (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536), pair_macs: 2 * 576 * 30 };
    let small = |start: usize| piece_end(start, 20_000, 512, 512, 512, true, smol, budget) - start;
    assert_eq!([0, 1024, 4096, 16_384].map(small), [512, 512, 320, 64]);
    for cost in [llama, smol] {
        for start in (0..19_968).step_by(512) {
            let rows = piece_end(start, 20_000, 512, 512, 512, true, cost, budget) - start;
            assert_eq!(rows % PIECE_ROWS, 0, "at {start}");
            // Within budget, unless it is the smallest piece; and the next size up is not.
            assert!(rows == PIECE_ROWS || cost.piece(start, rows) <= budget as u128, "at {start}: {rows} rows");
            assert!(rows == 512 || cost.piece(start, rows + PIECE_ROWS) > budget as u128, "at {start}: {rows} rows");
        }
    }
    // Alone, whole chunks; beside decoding, still never across a chunk, a block under
    // 512 rows, or the prompt's end.
    assert_eq!(piece_end(8192, 20_000, 2048, 512, 512, false, llama, budget), 10_240);
    let across = piece_end(0, 20_000, 2048, 512, 512, true, smol, budget);
    assert!(across > 512 && across % PIECE_ROWS == 0 && smol.piece(0, across) <= budget as u128, "{across}");
    assert_eq!(piece_end(0, 20_000, 512, 128, 512, true, smol, budget), 128);
    assert_eq!(piece_end(16_384, 16_400, 512, 512, 512, true, llama, budget), 16_400);
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
/// block 16, passes of 16 rows or more taken to keep their bits, so passes cross
/// blocks): `later`'s reused prompt tokens, the step of its first token, and its tokens.
fn arriving(e: &Engine, long: &[u32], later: &[u32], at: usize) -> (usize, usize, Vec<u32>) {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(3) };
    let first_step = std::rc::Rc::new(std::cell::Cell::new(None));
    let out = std::rc::Rc::new(std::cell::RefCell::new(None));
    let step = std::rc::Rc::new(std::cell::Cell::new(0));
    let mut b = crate::Batcher::new(e, 4);
    b.set_prefill_chunk(64);
    b.set_shared_rows(16);
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
fn with_passes_across_blocks_a_request_waits_for_a_shared_prefill_only_where_its_first_token_comes_no_later() {
    let (e, _) = engine(16, 1 << 30);
    let (plain, _) = engine(16, 0);
    // The long prompt's passes: [0, 64), [64, 128), [128, 144) (its whole blocks), [144, 150).
    let long: Vec<u32> = (0..150).map(|i| (i * 23 + 7) % 500).collect();
    let later = |shared: usize, new: usize| long[..shared].iter().copied().chain((0..new as u32).map(|i| (i * 11 + 3) % 500)).collect::<Vec<u32>>();
    // (the later prompt, the step it arrives at, the tokens it reuses, the step of its first token)
    let cases = [
        // Two blocks in common: the long prefill keeps them after its first pass
        // (64 rows) and the later request copies them and prefills its 5 tokens
        // (two passes, as [0, 32) and [32, 37) without waiting).
        (later(32, 5), 0, 32, 1),
        // One block in common and 40 new tokens: waiting (one pass) and then
        // [16, 48) and [48, 56) is a pass more than [0, 48) and [48, 56).
        (later(16, 40), 0, 0, 1),
        // The same one step later, the block passed: its next pass keeps it, too late.
        (later(16, 40), 1, 0, 2),
        // Seven blocks in common, the long prefill at 64: kept after [64, 128), then
        // one pass of 5 tokens, against three without waiting.
        (later(112, 5), 1, 112, 2),
        // Three blocks, passed: the pass to 144 keeps every whole block of the long prompt.
        (later(48, 5), 2, 48, 3),
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
fn a_request_waiting_for_a_shared_prefill_keeps_its_slot_from_later_arrivals() {
    // A batch of two: the long prompt, then one sharing three blocks with it (it waits
    // one pass, then copies them), then an unrelated one queued behind it, all at once.
    // The unrelated request may not take the slot the waiting one needs.
    let first_steps = |e: &Engine| {
        let long: Vec<u32> = (0..150).map(|i| (i * 23 + 7) % 500).collect();
        let shared: Vec<u32> = long[..48].iter().copied().chain([5, 6, 7, 8, 9]).collect();
        let other: Vec<u32> = (0..20).map(|i| (i * 13 + 1) % 500).collect();
        let params = |n| SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) };
        let firsts = std::rc::Rc::new(std::cell::RefCell::new([usize::MAX; 3]));
        let outs = std::rc::Rc::new(std::cell::RefCell::new(vec![(0usize, Vec::new()); 3]));
        let step = std::rc::Rc::new(std::cell::Cell::new(0));
        let mut b = crate::Batcher::new(e, 2);
        b.set_prefill_chunk(64);
        b.set_shared_rows(16);
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
    assert_eq!(outs[1].0, 48, "the sharing request copies the three blocks");
    assert_eq!(firsts[1], 1, "and gets its first token one pass in, as without waiting");
    assert!(firsts[2] > 1, "the unrelated request waits for a free slot: {firsts:?}");
    let (_, want) = first_steps(&plain);
    for i in 0..3 {
        assert_eq!(outs[i].1, want[i].1, "request {i}: tokens against the cache off");
    }
}

//! The block rule of prefix reuse (see `prefix_cache`), checked on the passes
//! themselves: the CPU backend's per-row math would hide a reuse at a point a
//! full prefill does not split at, the GPU's tensor-core prefill would not. So
//! a backend that records every prefill pass's (first position, rows) shows
//! that a request reusing a cached prefix runs exactly the passes the same
//! request runs without reuse after that prefix.

use std::sync::{Arc, Mutex};

use crate::backend::{Backend, Chunk, Logits, Session};
use crate::batch::chunk_end;
use crate::engine::{Engine, EngineOptions};
use crate::error::Result;
use crate::sampling::SamplingParams;
use crate::Device;

type Passes = Arc<Mutex<Vec<(usize, usize)>>>;

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
        p.extend(chunks.iter().map(|c| (c.session.len(), c.tokens.len())));
        drop(p);
        self.inner.forward(chunks, logits)
    }
    fn copy_prefix(&self, src: &mut dyn Session, dst: &mut dyn Session, len: usize) -> Result<()> {
        self.inner.copy_prefix(src, dst, len)
    }
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
    assert_eq!(chunk_end(0, 1300, 512, 512), 512);
    assert_eq!(chunk_end(1024, 1300, 512, 512), 1300);
    // Block 8 inside chunks of 20: every multiple of either.
    let ends: Vec<usize> = std::iter::successors(Some(0), |&s| (s < 45).then(|| chunk_end(s, 45, 20, 8))).skip(1).collect();
    assert_eq!(ends, [8, 16, 20, 24, 32, 40, 45]);
    // Starting at a block boundary joins the same sequence.
    assert_eq!(chunk_end(16, 45, 20, 8), 20);
    assert_eq!(chunk_end(24, 45, 20, 8), 32);
}

#[test]
fn a_reused_prefix_leaves_the_passes_after_it_as_they_were() {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(3) };
    let first: Vec<u32> = (0..40).map(|i| (i * 13 + 5) % 500).collect();
    let second: Vec<u32> = first.iter().copied().chain((0..30).map(|i| (i * 7 + 1) % 500)).collect();
    for (block, chunk) in [(8, 512), (8, 20), (16, 6)] {
        let (cached, with) = engine(block, 1 << 30);
        let (plain, without) = engine(block, 0);
        let run = |e: &Engine, ids: &[u32], chunk: usize| {
            let out = std::cell::RefCell::new(None);
            let mut b = crate::Batcher::new(e, 1);
            b.set_prefill_chunk(chunk);
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
        };
        run(&cached, &first, chunk);
        with.lock().unwrap().clear();
        let got = run(&cached, &second, chunk);
        let reused = got.metrics.cached_prompt_tokens;
        assert_eq!(reused, 40 / block * block, "block {block}");
        let want = run(&plain, &second, chunk);
        assert_eq!(got.token_ids, want.token_ids);
        // Prefill passes only (decode steps start at the prompt's end).
        let prefill = |p: &Passes| p.lock().unwrap().iter().copied().filter(|&(start, _)| start < second.len()).collect::<Vec<_>>();
        let all = prefill(&without);
        let after: Vec<(usize, usize)> = all.iter().copied().filter(|&(start, _)| start >= reused).collect();
        assert!(all.iter().any(|&(start, rows)| start < reused && start + rows == reused), "a full prefill splits at {reused}: {all:?}");
        assert_eq!(prefill(&with), after, "block {block}, chunk {chunk}: passes after the reused prefix");
    }
}

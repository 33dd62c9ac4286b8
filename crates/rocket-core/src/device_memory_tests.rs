//! Requests whose KV caches do not all fit in device memory at once, on a
//! backend that has room for a fixed number of KV positions (the CPU backend
//! under a budget, failing allocations as the CUDA backend does when memory
//! runs short): a request that does not fit waits for running ones to free
//! theirs and then runs exactly as it would alone; one that cannot fit even
//! alone fails by itself; and neither takes a router's engine out of service.

use std::any::Any;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::backend::{Backend, Chunk, Logits, Session};
use crate::batch::{BatchEvent, Batcher};
use crate::engine::Engine;
use crate::error::{Result, RocketError};
use crate::output::RequestOutput;
use crate::router::Router;
use crate::scheduler::tests::{channel_sink, engine, request, result};
use crate::scheduler::SchedulerOptions;

/// Room for `budget` KV positions across all live sessions.
struct Tight {
    inner: Box<dyn Backend>,
    budget: usize,
    used: Arc<AtomicUsize>,
}

/// A session of the inner backend that gives its positions back when dropped.
struct Counted {
    inner: Box<dyn Session>,
    used: Arc<AtomicUsize>,
}

impl Session for Counted {
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }
    fn kv_bytes(&self) -> usize {
        self.inner.kv_bytes()
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self.inner.as_any_mut()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.used.fetch_sub(self.inner.capacity(), Ordering::SeqCst);
    }
}

impl Backend for Tight {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
        let used = self.used.load(Ordering::SeqCst);
        if used + capacity > self.budget {
            return Err(RocketError::DeviceMemory(format!(
                "not enough device memory for a KV cache of {capacity} positions: {} free of {}",
                self.budget - used,
                self.budget
            )));
        }
        let inner = self.inner.new_session(capacity)?;
        self.used.fetch_add(capacity, Ordering::SeqCst);
        Ok(Box::new(Counted { inner, used: self.used.clone() }))
    }
    fn forward(&self, chunks: &mut [Chunk<'_>], logits: Logits) -> Result<Vec<f32>> {
        self.inner.forward(chunks, logits)
    }
}

/// KV positions a request needs (its prompt and max_tokens).
fn positions(e: &Engine, prompt: &str, max_tokens: usize) -> usize {
    request(e, prompt, max_tokens).prompt_ids.len() + max_tokens
}

fn tight_engine(budget: usize) -> (Engine, Arc<AtomicUsize>) {
    let used = Arc::new(AtomicUsize::new(0));
    let counter = used.clone();
    (engine().wrap_backend(move |inner| Box::new(Tight { inner, budget, used: counter })), used)
}

/// Runs the prompts (max_tokens each) in one batcher, all queued at once;
/// returns each one's outcome in order and the most that ran at once.
fn run_all(e: &Engine, prompts: &[(&str, usize)]) -> (Vec<Result<RequestOutput>>, usize) {
    let (tx, rx) = std::sync::mpsc::channel();
    let mut b = Batcher::new(e, 8);
    for (i, (prompt, max_tokens)) in prompts.iter().enumerate() {
        let tx = tx.clone();
        let sink = Box::new(move |event: BatchEvent| {
            match event {
                BatchEvent::Finished(out) => tx.send((i, Ok(out))).unwrap(),
                BatchEvent::Failed(err) => tx.send((i, Err(err))).unwrap(),
                BatchEvent::Delta(_) => {}
            }
            true
        });
        b.add(request(e, prompt, *max_tokens), sink).unwrap();
    }
    let mut most = 0;
    while b.step().unwrap() > 0 {
        most = most.max(b.running());
    }
    drop(tx);
    let mut outs: Vec<(usize, Result<RequestOutput>)> = rx.iter().collect();
    outs.sort_by_key(|(i, _)| *i);
    assert_eq!(outs.len(), prompts.len());
    (outs.into_iter().map(|(_, o)| o).collect(), most)
}

#[test]
fn requests_that_do_not_fit_together_wait_and_run_as_they_would_alone() {
    let solo = engine();
    let prompts = [("hello world", 12), ("the cat sat on the mat", 9), ("one two three", 15)];
    let want: Vec<RequestOutput> = prompts
        .iter()
        .map(|(p, n)| {
            let r = request(&solo, p, *n);
            solo.generate_ids(r.prompt, r.prompt_ids, &r.params, &mut |_| true).unwrap()
        })
        .collect();
    let biggest = prompts.iter().map(|(p, n)| positions(&solo, p, *n)).max().unwrap();
    let total: usize = prompts.iter().map(|(p, n)| positions(&solo, p, *n)).sum();
    // Room for one request at a time, for two, for all three.
    for (budget, most_at_once) in [(biggest, 1), (total - 1, 2), (total, 3)] {
        let (e, used) = tight_engine(budget);
        let (outs, most) = run_all(&e, &prompts);
        assert_eq!(most, most_at_once, "budget {budget}");
        for (i, (got, want)) in outs.into_iter().zip(&want).enumerate() {
            let got = got.unwrap_or_else(|err| panic!("budget {budget}: request {i} failed: {err}"));
            assert_eq!((&got.token_ids, &got.text), (&want.token_ids, &want.text), "budget {budget}: request {i}");
        }
        assert_eq!(used.load(Ordering::SeqCst), 0, "every KV cache was freed");
    }
}

#[test]
fn a_request_that_cannot_fit_even_alone_fails_by_itself() {
    let solo = engine();
    let small = positions(&solo, "hello world", 6);
    let big = positions(&solo, "hello world", 40);
    assert!(big > small + 8);
    let (e, _) = tight_engine(big - 1);
    // The big one waits while the first runs, then fails with nothing left to
    // free memory; the one after it runs.
    let (outs, _) = run_all(&e, &[("hello world", 6), ("hello world", 40), ("one two three", 5)]);
    let err = outs[1].as_ref().unwrap_err();
    assert!(matches!(err, RocketError::DeviceMemory(_)) && err.to_string().contains("not enough device memory"), "{err}");
    assert_eq!(outs[0].as_ref().unwrap().token_ids.len(), 6);
    assert_eq!(outs[2].as_ref().unwrap().token_ids.len(), 5);
}

#[test]
fn running_short_of_memory_does_not_take_a_routers_engine_out_of_service() {
    let (tight, _) = tight_engine(positions(&engine(), "hello world", 8));
    let router = Router::new(vec![("gpu:0".into(), Arc::new(tight))], SchedulerOptions::default()).unwrap();
    let e = router.engine().clone();
    let (sink, events) = channel_sink();
    let _big = router.submit(request(&e, "hello world", 200), sink).unwrap();
    let err = result(&events).unwrap_err();
    assert!(err.to_string().contains("not enough device memory"), "{err}");
    assert!(router.healthy() && router.loads()[0].in_service, "a request too big for memory is not a device fault");
    let (sink, events) = channel_sink();
    let _small = router.submit(request(&e, "hello world", 8), sink).unwrap();
    assert_eq!(result(&events).unwrap().token_ids.len(), 8);
}

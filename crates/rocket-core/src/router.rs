//! The router: several engines of one model (one per GPU, `Engine::load_devices`),
//! each with its own [`Scheduler`], behind one `submit`. Each request goes to the
//! engine in service with the least outstanding work, counted as requests that
//! have started generating plus the prompt tokens of requests that have not
//! (ties go to the lowest index). A request is submitted once, so all of a
//! stream's tokens come from the engine that started it.
//!
//! A device fault reaching a request (a failed forward pass: a watchdog, a lost
//! device) or a dead scheduler thread takes that engine out of
//! service for good: the failing request and every other request on it end
//! with a `Device` error naming the engine, new requests go to the others, and
//! once none is left `submit` refuses at once with [`RocketError::NoDevice`].
//! Running short of device memory for one request's KV cache is no fault: the
//! request waits in its engine's batcher for others to free theirs, or fails
//! alone when none holds any (`Batcher::admit`).
//! The counts are the router's own, kept by a wrapper around each request's
//! sink, so they are exact at every submit (the scheduler publishes its own
//! only between passes).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::batch::BatchEvent;
use crate::engine::{Engine, EngineOptions};
use crate::options::Devices;
use crate::error::{ErrorKind, Result, RocketError};
use crate::output::FinishReason;
use crate::prefix_cache::PrefixCacheStats;
use crate::request::EngineRequest;
use crate::scheduler::{EventSink, RequestHandle, Scheduler, SchedulerOptions};

/// One engine's load and state, shared with the sinks of its requests.
#[derive(Default)]
struct Load {
    /// Requests whose first token has come out and that have not ended.
    started: AtomicUsize,
    /// Prompt tokens of requests submitted that have produced nothing yet.
    queued_tokens: AtomicUsize,
    out_of_service: AtomicBool,
    /// Why the engine went out of service (the first reason seen).
    reason: Mutex<Option<String>>,
}

impl Load {
    fn outstanding(&self) -> usize {
        self.started.load(Ordering::SeqCst) + self.queued_tokens.load(Ordering::SeqCst)
    }

    fn in_service(&self) -> bool {
        !self.out_of_service.load(Ordering::SeqCst)
    }

    /// Marks the engine out of service; true the first time.
    fn fail(&self, name: &str, reason: String) -> bool {
        let mut r = self.reason.lock().unwrap_or_else(|p| p.into_inner());
        if self.out_of_service.swap(true, Ordering::SeqCst) {
            return false;
        }
        tracing::error!("{name} is out of service: {reason}");
        *r = Some(reason);
        true
    }

    fn reason(&self) -> Option<String> {
        self.reason.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

struct Member {
    name: String,
    scheduler: Scheduler,
    load: Arc<Load>,
}

impl Member {
    /// Out of service, or its scheduler thread died (then marked so now).
    fn in_service(&self) -> bool {
        if self.load.in_service() && !self.scheduler.healthy() {
            self.load.fail(&self.name, "its scheduler thread failed".into());
        }
        self.load.in_service()
    }
}

/// One engine's state, for `/health` and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLoad {
    /// The engine's name ("cuda:1").
    pub name: String,
    pub in_service: bool,
    /// Why it is out of service.
    pub error: Option<String>,
    /// Requests admitted and not finished (running or waiting).
    pub in_flight: usize,
    /// Requests in its running batch, as of its last pass.
    pub running: usize,
    /// Prompt tokens of its requests that have not produced a token yet.
    pub queued_prompt_tokens: usize,
    /// Bytes of KV cache its running requests hold, as of its last pass.
    pub kv_bytes: usize,
}

/// Where a request went: dropping it cancels the request (see [`RequestHandle`]).
#[derive(Debug)]
pub struct Routed {
    pub handle: RequestHandle,
    /// The index of the engine it runs on.
    pub device: usize,
}

pub struct Router {
    members: Vec<Member>,
}

impl Router {
    /// Loads the model at `path`: one engine per GPU of `devices` (named
    /// "cuda:N"; see `Engine::load_devices`), or with None one engine on
    /// `options.device` (named "cuda:0" or "cpu"); then starts their schedulers.
    /// What `rocket serve --devices` and Python's `LLM(devices=...)` run.
    pub fn load(path: impl AsRef<std::path::Path>, options: EngineOptions, devices: Option<&Devices>, scheduler: SchedulerOptions) -> Result<Self> {
        let engines = match devices {
            Some(d) => {
                crate::engine::check_devices_device(options.device, d)?;
                let ordinals = d.ordinals(crate::engine::cuda_device_count()?)?;
                let engines = Engine::load_devices(path, options, &Devices::List(ordinals.clone()))?;
                ordinals.iter().map(|n| format!("cuda:{n}")).zip(engines).collect::<Vec<_>>()
            }
            None => {
                let engine = Engine::load(path, options)?;
                let name = if engine.info().backend == "cuda" { "cuda:0".to_string() } else { engine.info().backend.to_string() };
                vec![(name, engine)]
            }
        };
        Self::new(engines.into_iter().map(|(n, e)| (n, Arc::new(e))).collect(), scheduler)
    }

    /// Starts a scheduler for each of `engines` (name, engine), all with
    /// `options`. The engines must hold the same model: requests are checked
    /// and tokenised with the first ([`Router::engine`]).
    pub fn new(engines: Vec<(String, Arc<Engine>)>, options: SchedulerOptions) -> Result<Self> {
        if engines.is_empty() {
            return Err(RocketError::invalid_arg("devices", "[]", "at least one engine is needed"));
        }
        let members = engines
            .into_iter()
            .map(|(name, engine)| {
                let scheduler = Scheduler::start(engine, options)?;
                let load: Arc<Load> = Arc::default();
                let (hook_load, hook_name, cancel) = (load.clone(), name.clone(), scheduler.canceller());
                scheduler.on_device_error(Box::new(move |e| {
                    if hook_load.fail(&hook_name, e.to_string()) {
                        // Its other requests end at their next event.
                        cancel();
                    }
                }));
                Ok(Member { name, scheduler, load })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Router { members })
    }

    /// The first engine: the tokenizer, chat template and checks every request goes through.
    pub fn engine(&self) -> &Arc<Engine> {
        self.members[0].scheduler.engine()
    }

    /// The engines' prefix caches together: each engine keeps its prompts' KV on
    /// its own device, so a budget is per engine and the figures add up.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        (0..self.len()).map(|i| self.scheduler(i).engine().prefix_cache_stats()).fold(PrefixCacheStats::default(), |a, b| a + b)
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub fn scheduler(&self, device: usize) -> &Scheduler {
        &self.members[device].scheduler
    }

    pub fn name(&self, device: usize) -> &str {
        &self.members[device].name
    }

    /// The scheduler options every engine runs with.
    pub fn options(&self) -> SchedulerOptions {
        self.members[0].scheduler.options()
    }

    /// The engine `submit` would pick now: the least outstanding work among
    /// those in service, the lowest index on a tie; None when none is in service.
    pub fn pick(&self) -> Option<usize> {
        self.candidates().first().copied()
    }

    /// Engines in service, least loaded first.
    fn candidates(&self) -> Vec<usize> {
        let mut order: Vec<(usize, usize)> =
            self.members.iter().enumerate().filter(|(_, m)| m.in_service()).map(|(i, m)| (m.load.outstanding(), i)).collect();
        order.sort();
        order.into_iter().map(|(_, i)| i).collect()
    }

    /// Queue `request` on the least-loaded engine in service (the next one
    /// when that one's queue is full). Refused with `QueueFull` when every
    /// engine's is, with [`RocketError::NoDevice`] when none is in service,
    /// and as [`Scheduler::submit`] refuses a bad request.
    pub fn submit(&self, request: EngineRequest, sink: EventSink) -> Result<Routed> {
        let mut sink = Some(sink);
        let mut full = None;
        let prompt_tokens = request.prompt_ids.len();
        for device in self.candidates() {
            let m = &self.members[device];
            let guard = Guard {
                name: m.name.clone(),
                load: m.load.clone(),
                cancel: Box::new(m.scheduler.canceller()),
                prompt_tokens,
                started: false,
                ended: false,
                sink: sink.take(),
            };
            m.load.queued_tokens.fetch_add(prompt_tokens, Ordering::SeqCst);
            let shared_sink = Arc::new(Mutex::new(guard));
            let inner = shared_sink.clone();
            let wrapped: EventSink = Box::new(move |event| inner.lock().unwrap_or_else(|p| p.into_inner()).event(event));
            match m.scheduler.submit(request.clone(), wrapped) {
                Ok(handle) => return Ok(Routed { handle, device }),
                Err(e) => {
                    // The scheduler dropped the job (its closure); the guard is still ours:
                    // undo its counts and take the caller's sink back for the next engine.
                    let mut g = shared_sink.lock().unwrap_or_else(|p| p.into_inner());
                    g.release();
                    sink = g.sink.take();
                    drop(g);
                    match e {
                        RocketError::QueueFull { .. } => full = Some(e),
                        _ if !m.scheduler.healthy() => {
                            m.load.fail(&m.name, "its scheduler thread failed".into());
                        }
                        e => return Err(e),
                    }
                }
            }
        }
        Err(full.unwrap_or_else(|| RocketError::NoDevice(self.out_of_service_summary())))
    }

    fn out_of_service_summary(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{} ({})", m.name, m.load.reason().unwrap_or_else(|| "out of service".into())))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Each engine's state, in order.
    pub fn loads(&self) -> Vec<DeviceLoad> {
        self.members
            .iter()
            .map(|m| DeviceLoad {
                name: m.name.clone(),
                in_service: m.in_service(),
                error: m.load.reason(),
                in_flight: m.scheduler.in_flight(),
                running: m.scheduler.running(),
                queued_prompt_tokens: m.load.queued_tokens.load(Ordering::SeqCst),
                kv_bytes: m.scheduler.kv_bytes(),
            })
            .collect()
    }

    /// Engines in service.
    pub fn in_service(&self) -> usize {
        self.members.iter().filter(|m| m.in_service()).count()
    }

    /// Whether any engine can take requests.
    pub fn healthy(&self) -> bool {
        self.in_service() > 0
    }

    /// Requests admitted and not finished, over every engine.
    pub fn in_flight(&self) -> usize {
        self.members.iter().map(|m| m.scheduler.in_flight()).sum()
    }

    /// Requests in the running batches, over every engine.
    pub fn running(&self) -> usize {
        self.members.iter().map(|m| m.scheduler.running()).sum()
    }

    /// KV bytes held by running requests, over every engine.
    pub fn kv_bytes(&self) -> usize {
        self.members.iter().map(|m| m.scheduler.kv_bytes()).sum()
    }

    /// Takes engine `device` out of service (as a device error does): its
    /// requests end with an error naming it and it gets no new ones.
    pub fn take_out_of_service(&self, device: usize, reason: impl Into<String>) {
        let m = &self.members[device];
        if m.load.fail(&m.name, reason.into()) {
            m.scheduler.cancel_all();
        }
    }

    /// Cancel every request on every engine.
    pub fn cancel_all(&self) {
        self.members.iter().for_each(|m| m.scheduler.cancel_all());
    }

    /// Stop every scheduler (each finishes what it has) and join their threads.
    pub fn shutdown(&self) {
        self.members.iter().for_each(|m| m.scheduler.shutdown());
    }
}

/// Wraps a request's sink on one engine: keeps the engine's counts, turns a
/// device error into the engine going out of service, and ends the request
/// with an error naming the engine once it is out of service.
struct Guard {
    name: String,
    load: Arc<Load>,
    cancel: Box<dyn Fn() + Send + Sync>,
    prompt_tokens: usize,
    started: bool,
    ended: bool,
    sink: Option<EventSink>,
}

impl Guard {
    /// Undo this request's counts (once).
    fn release(&mut self) {
        if self.ended {
            return;
        }
        self.ended = true;
        if self.started {
            self.load.started.fetch_sub(1, Ordering::SeqCst);
        } else {
            self.load.queued_tokens.fetch_sub(self.prompt_tokens, Ordering::SeqCst);
        }
    }

    fn out_of_service_error(&self) -> RocketError {
        let reason = self.load.reason().unwrap_or_else(|| "out of service".into());
        RocketError::Device(format!("{} is out of service ({reason}); the request was stopped", self.name))
    }

    fn send(&mut self, event: BatchEvent) -> bool {
        self.sink.as_mut().is_some_and(|s| s(event))
    }

    fn event(&mut self, event: BatchEvent) -> bool {
        if self.ended {
            return false;
        }
        if !self.load.in_service() {
            // What the failed engine still says of this request, but a normal finish, is replaced by the error.
            if matches!(&event, BatchEvent::Finished(out) if out.finish_reason != FinishReason::Cancelled) {
                self.release();
                return self.send(event);
            }
            let error = match event {
                BatchEvent::Failed(e) if !names_device(&e) => e,
                _ => self.out_of_service_error(),
            };
            self.release();
            self.send(BatchEvent::Failed(error));
            return false;
        }
        match event {
            BatchEvent::Delta(d) => {
                if !self.started {
                    self.started = true;
                    self.load.started.fetch_add(1, Ordering::SeqCst);
                    self.load.queued_tokens.fetch_sub(self.prompt_tokens, Ordering::SeqCst);
                }
                self.send(BatchEvent::Delta(d))
            }
            BatchEvent::Failed(e) if e.is_device_fault() => {
                // A device fault reported to this request alone.
                if self.load.fail(&self.name, e.to_string()) {
                    // The others on this engine end at their next event.
                    (self.cancel)();
                }
                self.release();
                let error = RocketError::Device(format!("{} failed and is out of service: {e}", self.name));
                self.send(BatchEvent::Failed(error));
                false
            }
            BatchEvent::Failed(e) if names_device(&e) => {
                // A failed forward pass (the batcher reports it as internal; the
                // scheduler's hook takes the engine out of service if it was the device).
                self.release();
                self.send(BatchEvent::Failed(RocketError::Device(format!("{}: {e}", self.name))))
            }
            last => {
                self.release();
                self.send(last)
            }
        }
    }
}

/// Errors that come from the engine itself rather than the request: they get the engine's name.
fn names_device(e: &RocketError) -> bool {
    matches!(e.kind(), ErrorKind::Device | ErrorKind::Internal)
}

impl Drop for Guard {
    /// Dropped before its last event: the scheduler thread died (a refused
    /// submit has already released it).
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        self.release();
        let error = RocketError::Device(format!("{}: the engine stopped before the request finished", self.name));
        self.send(BatchEvent::Failed(error));
    }
}

#[cfg(test)]
mod tests {
    //! Several CPU engines of the tiny fixture stand in for GPUs: the router is
    //! the one the server runs. "Gated" sinks hold an engine's scheduler thread
    //! at a request's first token, so each engine's load is known exactly when
    //! the next request is routed.

    use std::time::{Duration, Instant};

    use super::*;
    use crate::backend::{Backend, Chunk, Logits, Session};
    // The scheduler's tests' engine, requests and sinks: the router is driven the same way.
    use crate::scheduler::tests::{channel_sink, engine, gated_sink, request, result, WAIT};

    /// The CPU backend; once `broken` is set every forward pass fails like a lost GPU.
    struct Faulty {
        inner: Box<dyn Backend>,
        broken: Arc<AtomicBool>,
    }

    impl Backend for Faulty {
        fn name(&self) -> &'static str {
            "cpu"
        }
        fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
            self.inner.new_session(capacity)
        }
        fn forward(&self, chunks: &mut [Chunk<'_>], logits: Logits) -> Result<Vec<f32>> {
            if self.broken.load(Ordering::SeqCst) {
                return Err(RocketError::Device("a simulated lost device".into()));
            }
            self.inner.forward(chunks, logits)
        }
    }

    /// `n` CPU engines named cpu:0.. and a fault switch for each.
    fn router(n: usize, max_batch: usize) -> (Router, Vec<Arc<AtomicBool>>) {
        let switches: Vec<Arc<AtomicBool>> = (0..n).map(|_| Arc::default()).collect();
        let engines = switches
            .iter()
            .enumerate()
            .map(|(i, broken)| {
                let broken = broken.clone();
                (format!("cpu:{i}"), Arc::new(engine().wrap_backend(|inner| Box::new(Faulty { inner, broken }))))
            })
            .collect();
        (Router::new(engines, SchedulerOptions { max_batch, max_queue: 16 }).unwrap(), switches)
    }

    fn eventually(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + WAIT;
        while !f() {
            assert!(Instant::now() < deadline, "never: {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn requests_go_to_the_least_outstanding_work_counting_queued_prompt_tokens() {
        let (router, _) = router(2, 4);
        let e = router.engine().clone();
        assert_eq!(router.pick(), Some(0), "a tie goes to the lowest index");
        // A starts on cpu:0 and holds it: cpu:0 has 1 started request.
        let (sink, a_events, a_started, a_release) = gated_sink();
        let a = router.submit(request(&e, "hello", 8), sink).unwrap();
        a_started.recv_timeout(WAIT).unwrap();
        assert_eq!(a.device, 0);
        // B goes to the idle cpu:1 and holds it there too: 1 and 1.
        let (sink, b_events, b_started, b_release) = gated_sink();
        let b = router.submit(request(&e, "the quick brown fox", 8), sink).unwrap();
        b_started.recv_timeout(WAIT).unwrap();
        assert_eq!(b.device, 1);
        // A tie: C waits on cpu:0 with its prompt queued (1 + 9 tokens there).
        let c_request = request(&e, "one two three four five six seven eight", 8);
        let c_tokens = c_request.prompt_ids.len();
        assert!(c_tokens > 2, "{c_tokens}");
        let (sink, c_events) = channel_sink();
        let c = router.submit(c_request, sink).unwrap();
        assert_eq!(c.device, 0);
        let loads = router.loads();
        assert_eq!((loads[0].queued_prompt_tokens, loads[1].queued_prompt_tokens), (c_tokens, 0));
        assert_eq!((loads[0].in_flight, loads[1].in_flight), (2, 1));
        // Skewed: cpu:0 has 1 + c_tokens, cpu:1 has 1, so D and E go to cpu:1
        // (E queued behind D: 1 + |D| + |E|, still below cpu:0 with a long prompt).
        let (sink, d_events) = channel_sink();
        let d = router.submit(request(&e, "hi", 8), sink).unwrap();
        assert_eq!(d.device, 1);
        assert_eq!(router.pick(), Some(1));
        let (sink, f_events) = channel_sink();
        let f = router.submit(request(&e, "a b c d e f g h i j k l m n o p", 8), sink).unwrap();
        assert_eq!(f.device, 1, "{:?}", router.loads());
        a_release.send(()).unwrap();
        b_release.send(()).unwrap();
        for events in [&a_events, &b_events, &c_events, &d_events, &f_events] {
            assert_eq!(result(events).unwrap().token_ids.len(), 8);
        }
        eventually("idle", || router.loads().iter().all(|l| l.in_flight == 0 && l.queued_prompt_tokens == 0));
        assert_eq!(router.pick(), Some(0));
    }

    /// Counts the forward passes of the backend it wraps.
    struct Counting {
        inner: Box<dyn Backend>,
        passes: Arc<AtomicUsize>,
    }

    impl Backend for Counting {
        fn name(&self) -> &'static str {
            "cpu"
        }
        fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
            self.inner.new_session(capacity)
        }
        fn forward(&self, chunks: &mut [Chunk<'_>], logits: Logits) -> Result<Vec<f32>> {
            self.passes.fetch_add(1, Ordering::SeqCst);
            self.inner.forward(chunks, logits)
        }
    }

    #[test]
    fn greedy_outputs_through_the_router_equal_solo_and_a_stream_stays_on_its_engine() {
        let passes: Vec<Arc<AtomicUsize>> = (0..3).map(|_| Arc::default()).collect();
        let engines = passes
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let passes = p.clone();
                (format!("cpu:{i}"), Arc::new(engine().wrap_backend(|inner| Box::new(Counting { inner, passes }))))
            })
            .collect();
        // max_batch 1: each engine runs one request at a time, so its passes are that request's.
        let router = Router::new(engines, SchedulerOptions { max_batch: 1, max_queue: 8 }).unwrap();
        let solo = engine();
        // The stream holds cpu:0 at its first token while two others are routed.
        let (sink, stream_events, started, release) = gated_sink();
        let stream = router.submit(request(&solo, "hello world", 12), sink).unwrap();
        started.recv_timeout(WAIT).unwrap();
        let prompts = ["the quick brown fox", "one two three"];
        let others: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (sink, events) = channel_sink();
                (router.submit(request(&solo, p, 10), sink).unwrap(), events)
            })
            .collect();
        assert_eq!((stream.device, others[0].0.device, others[1].0.device), (0, 1, 2));
        release.send(()).unwrap();
        let mut deltas = Vec::new();
        let out = loop {
            match stream_events.recv_timeout(WAIT).unwrap() {
                BatchEvent::Delta(d) => deltas.push(d.token_id),
                BatchEvent::Finished(out) => break out,
                BatchEvent::Failed(e) => panic!("{e}"),
            }
        };
        assert_eq!(deltas, out.token_ids, "every token of the stream arrived, in order");
        let want = solo.generate("hello world", &request(&solo, "hello world", 12).params).unwrap();
        assert_eq!(out.token_ids, want.token_ids);
        for ((routed, events), prompt) in others.iter().zip(prompts) {
            let got = result(events).unwrap();
            let want = solo.generate(prompt, &request(&solo, prompt, 10).params).unwrap();
            assert_eq!((got.token_ids, got.text), (want.token_ids, want.text), "{prompt:?} on {}", routed.device);
        }
        // Every pass of each engine belongs to its one request: the stream's
        // 12 tokens took cpu:0's passes only (a prefill, then one per token).
        let counts: Vec<usize> = passes.iter().map(|p| p.load(Ordering::SeqCst)).collect();
        assert_eq!(counts, vec![12, 10, 10], "forward passes per engine");
    }

    #[test]
    fn a_failed_device_is_taken_out_of_service_its_requests_fail_naming_it_and_others_carry_on() {
        let (router, switches) = router(2, 4);
        let e = router.engine().clone();
        let (sink, a_events, a_started, a_release) = gated_sink();
        let a = router.submit(request(&e, "hello", 40), sink).unwrap();
        a_started.recv_timeout(WAIT).unwrap();
        let (sink, b_events, b_started, b_release) = gated_sink();
        let b = router.submit(request(&e, "world", 40), sink).unwrap();
        b_started.recv_timeout(WAIT).unwrap();
        let (sink, c_events) = channel_sink();
        let c = router.submit(request(&e, "one two three four five six", 40), sink).unwrap();
        let (sink, d_events) = channel_sink();
        let d = router.submit(request(&e, "hi", 40), sink).unwrap();
        assert_eq!((a.device, b.device, c.device, d.device), (0, 1, 0, 1));
        // cpu:1 fails mid-run: B (running) and D (waiting) end with an error naming it.
        switches[1].store(true, Ordering::SeqCst);
        b_release.send(()).unwrap();
        for events in [&b_events, &d_events] {
            let err = result(events).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Device);
            let text = err.to_string();
            assert!(text.contains("cpu:1") && (text.contains("simulated lost device") || text.contains("out of service")), "{text}");
        }
        // The scheduler's hook marks it right after the pass's requests got their errors.
        eventually("cpu:1 out of service", || !router.loads()[1].in_service);
        let loads = router.loads();
        assert!(loads[0].in_service && !loads[1].in_service);
        assert!(loads[1].error.as_deref().is_some_and(|r| r.contains("simulated lost device")), "{loads:?}");
        assert_eq!(router.in_service(), 1);
        // New requests go to cpu:0 even though it is the busier one.
        let (sink, e_events) = channel_sink();
        let late = router.submit(request(&e, "late", 6), sink).unwrap();
        assert_eq!(late.device, 0);
        a_release.send(()).unwrap();
        assert_eq!(result(&a_events).unwrap().token_ids.len(), 40);
        assert_eq!(result(&c_events).unwrap().token_ids.len(), 40);
        assert_eq!(result(&e_events).unwrap().token_ids.len(), 6);
        eventually("cpu:1 drained", || router.loads()[1].in_flight == 0);
        assert_eq!(router.loads()[1].queued_prompt_tokens, 0);
    }

    #[test]
    fn with_every_device_failed_requests_are_refused_at_once() {
        let (router, switches) = router(2, 4);
        let e = router.engine().clone();
        switches.iter().for_each(|s| s.store(true, Ordering::SeqCst));
        for device in [0, 1] {
            let (sink, events) = channel_sink();
            let routed = router.submit(request(&e, "hello", 4), sink).unwrap();
            assert_eq!(routed.device, device);
            let err = result(&events).unwrap_err();
            assert!(err.to_string().contains(&format!("cpu:{device}")), "{err}");
            // The scheduler's hook runs right after the pass's requests got their errors.
            eventually("out of service", || !router.loads()[device].in_service);
        }
        assert!(!router.healthy());
        let t = Instant::now();
        let (sink, _events) = channel_sink();
        let err = router.submit(request(&e, "hello", 4), sink).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(1));
        assert_eq!(err.kind(), ErrorKind::Unavailable);
        let text = err.to_string();
        assert!(matches!(err, RocketError::NoDevice(_)) && text.contains("cpu:0 (") && text.contains("cpu:1 ("), "{text}");
    }

    #[test]
    fn a_dead_scheduler_thread_fails_its_requests_naming_the_engine() {
        /// Every forward pass panics (a bug, not a device error).
        struct Panicking(Box<dyn Backend>);
        impl Backend for Panicking {
            fn name(&self) -> &'static str {
                "cpu"
            }
            fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
                self.0.new_session(capacity)
            }
            fn forward(&self, _: &mut [Chunk<'_>], _: Logits) -> Result<Vec<f32>> {
                panic!("a simulated bug in a forward pass");
            }
        }
        let engines = vec![
            ("cpu:0".to_string(), Arc::new(engine().wrap_backend(|inner| Box::new(Panicking(inner))))),
            ("cpu:1".to_string(), Arc::new(engine())),
        ];
        let router = Router::new(engines, SchedulerOptions::default()).unwrap();
        let e = router.engine().clone();
        let (sink, events) = channel_sink();
        let first = router.submit(request(&e, "hello", 4), sink).unwrap();
        assert_eq!(first.device, 0);
        let err = result(&events).unwrap_err();
        assert!(err.to_string().contains("cpu:0"), "{err}");
        eventually("cpu:0 out of service", || !router.loads()[0].in_service);
        let (sink, events) = channel_sink();
        let second = router.submit(request(&e, "hello", 4), sink).unwrap();
        assert_eq!(second.device, 1);
        assert_eq!(result(&events).unwrap().token_ids.len(), 4);
    }
}

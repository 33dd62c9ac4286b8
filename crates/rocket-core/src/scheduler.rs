//! The scheduler: one OS thread owns an engine's continuous [`Batcher`], and
//! callers on any thread (the server's async handlers, Python threads) hand it
//! requests over a channel, each with a sink for its events. Between forward
//! passes the thread admits the new ones (they join the running batch), cancels
//! those whose handle was cancelled or dropped, and steps while anything is
//! pending; idle, it blocks on the channel. Requests from different callers
//! therefore share forward passes.
//!
//! Admission is bounded: a request holds a slot from `submit` until its
//! generation ends, and `submit` refuses ([`RocketError::QueueFull`]) once
//! `max_queue` slots are taken, so the queue never grows without limit and a
//! caller never waits to be told.
//!
//! Sinks are plain `Send` closures (no async runtime here): the server wraps
//! its tokio channel in one, Python a std channel.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::batch::{BatchEvent, Batcher, RequestId};
use crate::engine::{Engine, MAX_BATCH};
use crate::error::{Result, RocketError};
use crate::request::EngineRequest;
use crate::sampling::SamplingParams;

/// Receives a request's events on the scheduler thread: deltas, then exactly
/// one `Finished` or `Failed`. Returning false cancels the request. It must not
/// block: every request of the batch waits while it runs.
pub type EventSink = Box<dyn FnMut(BatchEvent) -> bool + Send>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerOptions {
    /// Most requests decoded together in one forward pass (default 64).
    pub max_batch: usize,
    /// Most requests admitted at once (running + waiting); `submit` refuses
    /// more with [`RocketError::QueueFull`] (default: no limit).
    pub max_queue: usize,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions { max_batch: MAX_BATCH, max_queue: usize::MAX }
    }
}

/// Called on the scheduler thread when a forward pass fails with a device
/// error (the router takes the engine out of service).
pub type DeviceErrorHook = Box<dyn Fn(&RocketError) + Send + Sync>;

/// State shared by the scheduler, its thread and the slots.
#[derive(Default)]
struct Shared {
    /// Requests admitted and not yet finished.
    in_flight: AtomicUsize,
    cancel_all: AtomicBool,
    failed: AtomicBool,
    /// What the thread last saw between passes (for monitoring): requests in
    /// the running batch, the KV bytes they hold, and the decode paths.
    running: AtomicUsize,
    kv_bytes: AtomicUsize,
    decode_paths: Mutex<DecodePaths>,
    on_device_error: Mutex<Option<DeviceErrorHook>>,
}

/// How a decode step runs (`Engine::decode_path`), per batch shape, as the
/// scheduler thread last saw it: a megakernel that fails goes out of service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodePaths {
    pub single_greedy: &'static str,
    pub single_sampled: &'static str,
    pub batch_greedy: &'static str,
    pub batch_sampled: &'static str,
}

impl DecodePaths {
    /// "sampled": at temperature 1 with no cut, a stand-in for every sampled request.
    fn of(engine: &Engine) -> Self {
        let (greedy, sampled) = (SamplingParams::greedy(1), SamplingParams { temperature: 1.0, ..SamplingParams::default() });
        DecodePaths {
            single_greedy: engine.decode_path(1, &greedy),
            single_sampled: engine.decode_path(1, &sampled),
            batch_greedy: engine.decode_path(2, &greedy),
            batch_sampled: engine.decode_path(2, &sampled),
        }
    }
}

/// One admitted request's place in the queue; dropping it frees the place.
struct Slot(Arc<Shared>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a caller and the scheduler thread share about one request.
#[derive(Debug, Default)]
struct Control {
    cancelled: AtomicBool,
    finished: AtomicBool,
}

struct Job {
    request: EngineRequest,
    sink: EventSink,
    slot: Slot,
    control: Arc<Control>,
}

/// A submitted request. Dropping the handle cancels the request (as a closed
/// stream or a gone client should); keep it for as long as the result matters.
#[derive(Debug)]
pub struct RequestHandle {
    control: Arc<Control>,
}

impl RequestHandle {
    /// Stop the request before its next forward pass; its sink gets
    /// `Finished` with finish_reason `Cancelled` (unless it already ended).
    pub fn cancel(&self) {
        self.control.cancelled.store(true, Ordering::SeqCst);
    }

    /// Whether the sink has received its last event.
    pub fn is_finished(&self) -> bool {
        self.control.finished.load(Ordering::SeqCst)
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// A request the scheduler thread is tracking: to cancel it when asked.
struct Live {
    id: RequestId,
    control: Arc<Control>,
}

pub struct Scheduler {
    engine: Arc<Engine>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    shared: Arc<Shared>,
    options: SchedulerOptions,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Scheduler {
    /// Start the scheduler thread for `engine`.
    pub fn start(engine: Arc<Engine>, options: SchedulerOptions) -> Result<Self> {
        if options.max_batch == 0 {
            return Err(RocketError::invalid_arg("max_batch", 0, "must be at least 1"));
        }
        if options.max_queue == 0 {
            return Err(RocketError::invalid_arg("max_queue", 0, "must be at least 1"));
        }
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared { decode_paths: Mutex::new(DecodePaths::of(&engine)), ..Shared::default() });
        let (thread_engine, thread_shared) = (engine.clone(), shared.clone());
        let thread = std::thread::Builder::new()
            .name("rocket-scheduler".into())
            .spawn(move || {
                let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    run(&thread_engine, options.max_batch, &rx, &thread_shared)
                }));
                if run.is_err() {
                    // Every sink (and the sender inside it) is dropped by the
                    // unwind: waiting callers see their channel close.
                    thread_shared.failed.store(true, Ordering::SeqCst);
                    tracing::error!("the scheduler thread panicked; no further requests can run");
                }
            })
            .map_err(|e| RocketError::Internal(format!("cannot start the scheduler thread: {e}")))?;
        Ok(Scheduler { engine, jobs: Mutex::new(Some(tx)), shared, options, thread: Mutex::new(Some(thread)) })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    pub fn options(&self) -> SchedulerOptions {
        self.options
    }

    /// Requests admitted and not yet finished (running or waiting).
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// Requests in the running batch (the rest of `in_flight` waits), as of the last pass.
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::SeqCst)
    }

    /// Bytes of KV cache held by running requests, as of the last pass.
    pub fn kv_bytes(&self) -> usize {
        self.shared.kv_bytes.load(Ordering::SeqCst)
    }

    /// How decode steps run, as of the last pass (never waits for one).
    pub fn decode_paths(&self) -> DecodePaths {
        *self.shared.decode_paths.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// False once the scheduler thread has died.
    pub fn healthy(&self) -> bool {
        !self.shared.failed.load(Ordering::SeqCst)
    }

    /// Queue a request. It is checked here ([`Engine::check_request`]): a bad
    /// one is refused before it takes a slot, as is one beyond `max_queue`
    /// ([`RocketError::QueueFull`]) or after shutdown
    /// ([`RocketError::ShuttingDown`]). Once accepted, `sink` gets its events.
    pub fn submit(&self, request: EngineRequest, sink: EventSink) -> Result<RequestHandle> {
        if !self.healthy() {
            return Err(RocketError::Internal("the scheduler thread has failed; no further requests can run".into()));
        }
        self.engine.check_request(&request)?;
        let max_queue = self.options.max_queue;
        let reserved = self.shared.in_flight.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < max_queue).then_some(n + 1));
        if reserved.is_err() {
            return Err(RocketError::QueueFull { max_queue });
        }
        let slot = Slot(self.shared.clone());
        let control = Arc::new(Control::default());
        let job = Job { request, sink, slot, control: control.clone() };
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        // On failure the job (and its slot) comes back with the error and is dropped.
        if jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok()) {
            Ok(RequestHandle { control })
        } else if !self.healthy() {
            Err(RocketError::Internal("the scheduler thread has failed; no further requests can run".into()))
        } else {
            Err(RocketError::ShuttingDown)
        }
    }

    /// Cancel every request, running or waiting, and any submitted later.
    pub fn cancel_all(&self) {
        self.shared.cancel_all.store(true, Ordering::SeqCst);
    }

    /// Calls `hook` (on the scheduler thread) each time a forward pass fails
    /// with a device error, after that pass's requests got their `Failed`
    /// (the batcher reports those as internal errors, so the kind is seen only here).
    pub fn on_device_error(&self, hook: DeviceErrorHook) {
        *self.shared.on_device_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(hook);
    }

    /// Does what [`Scheduler::cancel_all`] does, from anywhere, even from a
    /// sink on the scheduler's own thread (the router's, when its device fails).
    pub fn canceller(&self) -> impl Fn() + Send + Sync + 'static {
        let shared = self.shared.clone();
        move || shared.cancel_all.store(true, Ordering::SeqCst)
    }

    /// Stop taking requests, let the thread finish what it has, and join it.
    pub fn shutdown(&self) {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for Scheduler {
    /// Nobody can wait for results any more: cancel what is left and join.
    fn drop(&mut self) {
        self.cancel_all();
        self.shutdown();
    }
}

fn admit<'e>(engine: &'e Engine, batcher: &mut Batcher<'e>, live: &mut Vec<Live>, job: Job) {
    let Job { request, mut sink, slot, control } = job;
    // Checked at submit; checked again so that a refusal reaches the sink.
    if let Err(e) = engine.check_request(&request) {
        control.finished.store(true, Ordering::SeqCst);
        sink(BatchEvent::Failed(e));
        return;
    }
    let finished = control.clone();
    let mut slot = Some(slot);
    let wrapped = Box::new(move |event: BatchEvent| {
        // Free the slot before the last event goes out: whoever sees it may
        // submit again (or read in_flight) at once.
        if !matches!(event, BatchEvent::Delta(_)) {
            finished.finished.store(true, Ordering::SeqCst);
            slot.take();
        }
        sink(event)
    });
    match batcher.add(request, wrapped) {
        Ok(id) => live.push(Live { id, control }),
        Err(e) => tracing::error!("a checked request was refused by the batcher: {e}"),
    }
}

fn run(engine: &Engine, max_batch: usize, jobs: &mpsc::Receiver<Job>, shared: &Shared) {
    let mut batcher = Batcher::new(engine, max_batch);
    let mut live: Vec<Live> = Vec::new();
    loop {
        if batcher.pending() == 0 {
            live.clear();
            publish(engine, &batcher, shared);
            match jobs.recv() {
                Ok(job) => admit(engine, &mut batcher, &mut live, job),
                Err(_) => return, // Shut down and nothing left to do.
            }
        }
        // New requests join between passes.
        while let Ok(job) = jobs.try_recv() {
            admit(engine, &mut batcher, &mut live, job);
        }
        let cancel_everything = shared.cancel_all.load(Ordering::SeqCst);
        live.retain(|l| {
            if l.control.finished.load(Ordering::SeqCst) {
                return false;
            }
            if cancel_everything || l.control.cancelled.load(Ordering::SeqCst) {
                batcher.cancel(l.id);
                return false;
            }
            true
        });
        if batcher.pending() == 0 {
            continue;
        }
        if let Err(e) = batcher.step() {
            // The requests of that pass got `Failed`; the others carry on.
            tracing::error!("forward pass failed: {e}");
            if e.is_device_fault() {
                if let Some(hook) = shared.on_device_error.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                    hook(&e);
                }
            }
        }
        publish(engine, &batcher, shared);
    }
}

/// Monitoring's view of the batch, refreshed between passes.
fn publish(engine: &Engine, batcher: &Batcher<'_>, shared: &Shared) {
    shared.running.store(batcher.running(), Ordering::SeqCst);
    shared.kv_bytes.store(batcher.kv_bytes(), Ordering::SeqCst);
    *shared.decode_paths.lock().unwrap_or_else(|p| p.into_inner()) = DecodePaths::of(engine);
}

#[cfg(test)]
pub(crate) mod tests {
    //! The scheduler on the tiny CPU fixture. A "gated" sink holds the
    //! scheduler thread at its request's first token until the test lets it
    //! go, so what is queued meanwhile is known exactly (no timing guesses).

    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use super::*;
    use crate::backend::{Backend, Chunk, Logits, Session};
    use crate::engine::EngineOptions;
    use crate::output::{FinishReason, RequestOutput};
    use crate::sampling::SamplingParams;
    use crate::Device;

    pub(crate) const WAIT: Duration = Duration::from_secs(60);

    pub(crate) fn engine() -> Engine {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/parity/fixtures/tiny-llama");
        Engine::load(path, EngineOptions { device: Device::Cpu, progress: crate::Progress::Off, ..EngineOptions::default() }).unwrap()
    }

    pub(crate) fn request(engine: &Engine, prompt: &str, max_tokens: usize) -> EngineRequest {
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
        EngineRequest { prompt: prompt.into(), prompt_ids: engine.encode_prompt(prompt).unwrap(), params }
    }

    /// Events of one request, and a sink that sends them there.
    pub(crate) fn channel_sink() -> (EventSink, mpsc::Receiver<BatchEvent>) {
        let (tx, rx) = mpsc::channel();
        (Box::new(move |event| tx.send(event).is_ok()), rx)
    }

    /// Like `channel_sink`, but at the first delta it says so on `started` and
    /// blocks the scheduler thread until `release` gets a message (or closes).
    pub(crate) fn gated_sink() -> (EventSink, mpsc::Receiver<BatchEvent>, mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (tx, rx) = mpsc::channel();
        let (started_tx, started) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let mut gate = Some((started_tx, release_rx));
        let sink = Box::new(move |event: BatchEvent| {
            if let (BatchEvent::Delta(_), Some((started, release))) = (&event, gate.take()) {
                let _ = started.send(());
                let _ = release.recv();
            }
            tx.send(event).is_ok()
        });
        (sink, rx, started, release)
    }

    pub(crate) fn result(rx: &mpsc::Receiver<BatchEvent>) -> Result<RequestOutput> {
        loop {
            match rx.recv_timeout(WAIT).expect("the request never ended") {
                BatchEvent::Delta(_) => {}
                BatchEvent::Finished(out) => return Ok(out),
                BatchEvent::Failed(e) => return Err(e),
            }
        }
    }

    #[test]
    fn requests_from_two_threads_share_passes_and_equal_their_solo_outputs() {
        let engine = Arc::new(engine());
        let scheduler = Arc::new(Scheduler::start(engine.clone(), SchedulerOptions { max_batch: 4, max_queue: 8 }).unwrap());
        let (sink, a_events, started, release) = gated_sink();
        let a = scheduler.submit(request(&engine, "hello world", 24), sink).unwrap();
        started.recv_timeout(WAIT).unwrap();
        // The second request comes from another thread while the first is mid-generation.
        let (s, e) = (scheduler.clone(), engine.clone());
        let (b, b_events) = std::thread::spawn(move || {
            let (sink, events) = channel_sink();
            (s.submit(request(&e, "the quick brown fox", 20), sink).unwrap(), events)
        })
        .join()
        .unwrap();
        assert_eq!(scheduler.in_flight(), 2);
        release.send(()).unwrap();
        let (a_out, b_out) = (result(&a_events).unwrap(), result(&b_events).unwrap());
        assert!(a.is_finished() && b.is_finished());
        assert_eq!((a_out.metrics.max_batch_size, b_out.metrics.max_batch_size), (2, 2), "the two requests never shared a pass");
        for (out, prompt) in [(&a_out, "hello world"), (&b_out, "the quick brown fox")] {
            let solo = engine.generate(prompt, &request(&engine, prompt, out.token_ids.len()).params).unwrap();
            assert_eq!(out.token_ids, solo.token_ids, "{prompt:?} differs when batched");
            assert_eq!(out.text, solo.text);
            assert_eq!(solo.metrics.max_batch_size, 1);
        }
        assert_eq!(scheduler.in_flight(), 0);
    }

    #[test]
    fn a_full_queue_refuses_until_a_slot_frees_and_bad_requests_take_none() {
        let engine = Arc::new(engine());
        let scheduler = Scheduler::start(engine.clone(), SchedulerOptions { max_batch: 1, max_queue: 2 }).unwrap();
        let (sink, a_events, started, release) = gated_sink();
        let _a = scheduler.submit(request(&engine, "hello", 8), sink).unwrap();
        started.recv_timeout(WAIT).unwrap();
        let (sink, b_events) = channel_sink();
        let _b = scheduler.submit(request(&engine, "world", 8), sink).unwrap();
        let (sink, _) = channel_sink();
        let refused = scheduler.submit(request(&engine, "third", 8), sink).unwrap_err();
        assert!(matches!(refused, RocketError::QueueFull { max_queue: 2 }), "{refused:?}");
        let (sink, _) = channel_sink();
        let empty = EngineRequest { prompt: String::new(), prompt_ids: vec![], params: SamplingParams::greedy(4) };
        assert!(matches!(scheduler.submit(empty, sink), Err(RocketError::EmptyPrompt)));
        assert_eq!(scheduler.in_flight(), 2);
        release.send(()).unwrap();
        assert_eq!(result(&a_events).unwrap().finish_reason, FinishReason::Length);
        assert_eq!(result(&b_events).unwrap().finish_reason, FinishReason::Length);
        assert_eq!(scheduler.in_flight(), 0);
        let (sink, c_events) = channel_sink();
        let _c = scheduler.submit(request(&engine, "third", 8), sink).unwrap();
        assert_eq!(result(&c_events).unwrap().token_ids.len(), 8);
        assert!(Scheduler::start(engine, SchedulerOptions { max_batch: 0, max_queue: 2 }).is_err());
    }

    /// Polls `f` until it holds (the thread publishes between passes).
    fn eventually(what: &str, f: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + WAIT;
        while !f() {
            assert!(std::time::Instant::now() < deadline, "never: {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn running_count_and_kv_bytes_follow_the_batch() {
        let engine = Arc::new(engine());
        let scheduler = Scheduler::start(engine.clone(), SchedulerOptions { max_batch: 1, max_queue: 4 }).unwrap();
        assert_eq!((scheduler.running(), scheduler.kv_bytes()), (0, 0));
        assert_eq!(scheduler.decode_paths().single_greedy, "forward passes");
        // The first request holds the thread at its second token, after the
        // first pass was published.
        let (started_tx, started) = mpsc::channel();
        let (release, release_rx) = mpsc::channel::<()>();
        let mut deltas = 0;
        let sink = Box::new(move |event: BatchEvent| {
            if matches!(event, BatchEvent::Delta(_)) {
                deltas += 1;
                if deltas == 2 {
                    let _ = started_tx.send(());
                    let _ = release_rx.recv();
                }
            }
            true
        });
        let a = scheduler.submit(request(&engine, "hello", 100), sink).unwrap();
        let (sink, _b_events) = channel_sink();
        let b = scheduler.submit(request(&engine, "world", 100), sink).unwrap();
        started.recv_timeout(WAIT).unwrap();
        // max_batch 1: one runs and the other waits; the runner's KV cache (f32 keys
        // and values for prompt + max_tokens positions, every layer) is counted.
        let spec = engine.spec();
        let per_token = spec.num_layers * 2 * spec.kv_dim() * 4;
        assert_eq!((scheduler.in_flight(), scheduler.running()), (2, 1));
        let kv = scheduler.kv_bytes();
        assert!(kv % per_token == 0 && kv / per_token >= 100, "{kv} bytes, {per_token} per token");
        drop((a, b));
        release.send(()).unwrap();
        eventually("idle", || scheduler.in_flight() == 0 && scheduler.running() == 0 && scheduler.kv_bytes() == 0);
    }

    #[test]
    fn a_dropped_handle_or_a_refusing_sink_cancels() {
        let engine = Arc::new(engine());
        let scheduler = Scheduler::start(engine.clone(), SchedulerOptions::default()).unwrap();
        let (sink, events, started, release) = gated_sink();
        let handle = scheduler.submit(request(&engine, "hello", 200), sink).unwrap();
        started.recv_timeout(WAIT).unwrap();
        drop(handle);
        release.send(()).unwrap();
        let out = result(&events).unwrap();
        assert_eq!(out.finish_reason, FinishReason::Cancelled);
        assert_eq!(out.token_ids.len(), 1, "cancelled before the next pass");

        let (tx, events) = mpsc::channel();
        let deltas = AtomicUsize::new(0);
        let sink = Box::new(move |event: BatchEvent| {
            let more = !matches!(event, BatchEvent::Delta(_)) || deltas.fetch_add(1, Ordering::SeqCst) + 1 < 3;
            tx.send(event).is_ok() && more
        });
        let _handle = scheduler.submit(request(&engine, "hello", 200), sink).unwrap();
        let out = result(&events).unwrap();
        assert_eq!((out.finish_reason, out.token_ids.len()), (FinishReason::Cancelled, 3));
        assert_eq!(scheduler.in_flight(), 0);
    }

    #[test]
    fn shutdown_cancels_what_runs_and_refuses_new_requests() {
        let engine = Arc::new(engine());
        let scheduler = Scheduler::start(engine.clone(), SchedulerOptions::default()).unwrap();
        let (sink, events, started, release) = gated_sink();
        let _running = scheduler.submit(request(&engine, "hello", 200), sink).unwrap();
        started.recv_timeout(WAIT).unwrap();
        let (sink, waiting_events) = channel_sink();
        let _waiting = scheduler.submit(request(&engine, "world", 200), sink).unwrap();
        scheduler.cancel_all();
        release.send(()).unwrap();
        scheduler.shutdown();
        assert_eq!(result(&events).unwrap().finish_reason, FinishReason::Cancelled);
        assert_eq!(result(&waiting_events).unwrap().finish_reason, FinishReason::Cancelled);
        let (sink, _) = channel_sink();
        assert!(matches!(scheduler.submit(request(&engine, "late", 4), sink), Err(RocketError::ShuttingDown)));
        assert_eq!(scheduler.in_flight(), 0);
    }

    /// The CPU backend, but every forward pass fails (or panics).
    struct Broken {
        inner: Box<dyn Backend>,
        panic: bool,
    }

    impl Backend for Broken {
        fn name(&self) -> &'static str {
            "cpu"
        }
        fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
            self.inner.new_session(capacity)
        }
        fn forward(&self, _chunks: &mut [Chunk<'_>], _logits: Logits) -> Result<Vec<f32>> {
            if self.panic {
                panic!("a simulated bug in a forward pass");
            }
            Err(RocketError::Device("a simulated device fault".into()))
        }
    }

    #[test]
    fn a_failed_pass_fails_its_requests_and_a_panic_fails_the_scheduler() {
        let failing = Arc::new(engine().wrap_backend(|inner| Box::new(Broken { inner, panic: false })));
        let scheduler = Scheduler::start(failing.clone(), SchedulerOptions::default()).unwrap();
        for _ in 0..2 {
            let (sink, events) = channel_sink();
            let _h = scheduler.submit(request(&failing, "hello", 4), sink).unwrap();
            let err = result(&events).unwrap_err();
            assert!(err.to_string().contains("simulated device fault"), "{err}");
            assert!(scheduler.healthy(), "one failed pass does not stop the scheduler");
        }

        let panicking = Arc::new(engine().wrap_backend(|inner| Box::new(Broken { inner, panic: true })));
        let scheduler = Scheduler::start(panicking.clone(), SchedulerOptions::default()).unwrap();
        let (sink, events) = channel_sink();
        let _h = scheduler.submit(request(&panicking, "hello", 4), sink).unwrap();
        // The unwind drops the sink: its channel closes without a last event.
        assert!(matches!(events.recv_timeout(WAIT), Err(mpsc::RecvTimeoutError::Disconnected)));
        let deadline = std::time::Instant::now() + WAIT;
        while scheduler.healthy() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!scheduler.healthy());
        let (sink, _) = channel_sink();
        assert!(matches!(scheduler.submit(request(&panicking, "hello", 4), sink), Err(RocketError::Internal(_))));
        assert_eq!(scheduler.in_flight(), 0);
    }
}

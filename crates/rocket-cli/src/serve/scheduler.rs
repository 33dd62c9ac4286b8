//! The scheduler: one OS thread owns the engine's continuous [`Batcher`]. Async
//! handlers hand it requests over a channel; between forward passes it admits
//! the new ones (they join the running batch), cancels those whose client has
//! gone, and steps while anything is pending; idle, it blocks on the channel.
//!
//! Admission is bounded: a request holds a [`Slot`] from `submit` until its
//! generation ends, and `submit` refuses (429) once `max_queue` slots are taken,
//! so the queue never grows without limit and a caller never waits to be told.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use rocket_core::{BatchEvent, Batcher, Engine, RequestId, SamplingParams};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::errors::ApiError;

/// Counts the requests admitted and not yet finished.
#[derive(Debug, Default)]
struct Counters {
    in_flight: AtomicUsize,
}

/// One admitted request's place in the queue; dropping it frees the place.
struct Slot(Arc<Counters>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

struct Job {
    prompt: String,
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    events: UnboundedSender<BatchEvent>,
    slot: Slot,
}

/// A request the scheduler thread is tracking: to cancel it once its client is gone.
struct Live {
    id: RequestId,
    events: UnboundedSender<BatchEvent>,
    done: Arc<AtomicBool>,
}

pub struct Scheduler {
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    counters: Arc<Counters>,
    max_queue: usize,
    cancel_all: Arc<AtomicBool>,
    failed: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Scheduler {
    /// Start the scheduler thread: at most `max_batch` requests per forward pass,
    /// at most `max_queue` admitted (running + waiting) at once.
    pub fn start(engine: Arc<Engine>, max_batch: usize, max_queue: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel();
        let cancel_all = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(AtomicBool::new(false));
        let (cancel, fail) = (cancel_all.clone(), failed.clone());
        let thread = std::thread::Builder::new().name("rocket-scheduler".into()).spawn(move || {
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&engine, max_batch, &rx, &cancel)));
            if run.is_err() {
                // Every sink (and its sender) is dropped by the unwind: waiting
                // handlers see their channel close and answer 500.
                fail.store(true, Ordering::SeqCst);
                tracing::error!("the scheduler thread panicked; no further requests can be served");
            }
        })?;
        Ok(Scheduler {
            jobs: Mutex::new(Some(tx)),
            counters: Arc::new(Counters::default()),
            max_queue,
            cancel_all,
            failed,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Requests admitted and not yet finished (running or waiting).
    pub fn in_flight(&self) -> usize {
        self.counters.in_flight.load(Ordering::SeqCst)
    }

    pub fn max_queue(&self) -> usize {
        self.max_queue
    }

    /// False once the scheduler thread has died.
    pub fn healthy(&self) -> bool {
        !self.failed.load(Ordering::SeqCst)
    }

    /// Queue a request. The receiver gets its events, ending with one `Finished`
    /// or `Failed`; dropping the receiver cancels the request.
    pub fn submit(
        &self,
        prompt: String,
        prompt_ids: Vec<u32>,
        params: SamplingParams,
    ) -> Result<UnboundedReceiver<BatchEvent>, ApiError> {
        if !self.healthy() {
            return Err(ApiError::internal("the scheduler has failed; restart the server"));
        }
        let reserved = self.counters.in_flight.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < self.max_queue).then_some(n + 1)
        });
        if reserved.is_err() {
            return Err(ApiError::overloaded(self.max_queue));
        }
        let slot = Slot(self.counters.clone());
        let (events, rx) = unbounded_channel();
        let job = Job { prompt, prompt_ids, params, events, slot };
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        // On failure the job (and its slot) comes back with the error and is dropped.
        if jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok()) {
            Ok(rx)
        } else {
            Err(ApiError::shutting_down())
        }
    }

    /// Cancel every request, running or waiting (used when a drain times out).
    pub fn cancel_all(&self) {
        self.cancel_all.store(true, Ordering::SeqCst);
    }

    /// Stop taking requests, let the thread finish what it has, and join it.
    pub fn shutdown(&self) {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

fn admit<'e>(batcher: &mut Batcher<'e>, live: &mut Vec<Live>, job: Job) {
    let Job { prompt, prompt_ids, params, events, slot } = job;
    if events.is_closed() {
        return; // The client left while the request was in the channel.
    }
    let done = Arc::new(AtomicBool::new(false));
    let (tx, finished) = (events.clone(), done.clone());
    let mut slot = Some(slot);
    let sink = Box::new(move |event: BatchEvent| {
        let terminal = !matches!(event, BatchEvent::Delta(_));
        let delivered = events.send(event).is_ok();
        if terminal {
            finished.store(true, Ordering::SeqCst);
            slot.take();
        }
        delivered
    });
    match batcher.add(prompt, prompt_ids, params, sink) {
        Ok(id) => live.push(Live { id, events: tx, done }),
        // The handler validated already; this is the engine's last word.
        Err(e) => {
            let _ = tx.send(BatchEvent::Failed(e));
        }
    }
}

fn run(engine: &Engine, max_batch: usize, jobs: &mpsc::Receiver<Job>, cancel_all: &AtomicBool) {
    let mut batcher = Batcher::new(engine, max_batch);
    let mut live: Vec<Live> = Vec::new();
    loop {
        if batcher.pending() == 0 {
            live.clear();
            match jobs.recv() {
                Ok(job) => admit(&mut batcher, &mut live, job),
                Err(_) => return, // Shut down and nothing left to do.
            }
        }
        // New requests join between passes.
        while let Ok(job) = jobs.try_recv() {
            admit(&mut batcher, &mut live, job);
        }
        let cancel_everything = cancel_all.load(Ordering::SeqCst);
        live.retain(|l| {
            if l.done.load(Ordering::SeqCst) {
                return false;
            }
            if cancel_everything || l.events.is_closed() {
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
        }
    }
}

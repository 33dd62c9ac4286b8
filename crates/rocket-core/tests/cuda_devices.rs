//! One engine per GPU behind the router (`Router::load` with `Devices`), on real
//! GPUs. The tests are ignored unless run with `--include-ignored` on a GPU
//! machine: `cargo test -p rocket-core --features cuda --test cuda_devices --
//! --include-ignored` (the two-GPU tests fail, saying so, on a machine with one).
//! They take turns (`one_at_a_time`): a fault test breaks its GPU's context,
//! which every engine on that GPU in the process shares until the last is
//! gone; `benches/gpu_run.sh devices` runs each in a process of its own.
//! Checkpoint: ROCKET_DEVICES_MODEL, else the committed tiny Qwen3 fixture.
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::*;
use rocket_core::backend::cuda::{device_count, unavailable_reason};
use rocket_core::router::{Routed, Router};
use rocket_core::{BatchEvent, DecodePath, Device, Devices, Engine, EngineOptions, EngineRequest, GpuOptions, MatmulPath, Progress, RequestOutput, SamplingParams, SchedulerOptions};

/// Held for a whole test: the tests of this file take turns on the GPUs.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static GPUS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    GPUS.lock().unwrap_or_else(|p| p.into_inner())
}

fn require_gpus(n: usize) {
    if let Some(why) = unavailable_reason() {
        panic!("no usable CUDA device ({why}): these tests need one");
    }
    let count = device_count().unwrap();
    assert!(count >= n, "this test needs {n} GPUs; this machine has {count}");
}

fn model() -> PathBuf {
    std::env::var_os("ROCKET_DEVICES_MODEL").map(PathBuf::from).unwrap_or_else(|| fixture("tiny-qwen3"))
}

/// The graph path with the GEMV, where a batched request's tokens equal its solo ones bit for bit.
fn options() -> EngineOptions {
    let gpu = GpuOptions { decode: DecodePath::Graph, matmul: MatmulPath::Gemv, ..GpuOptions::default() };
    EngineOptions { device: Device::Cuda, progress: Progress::Off, gpu, ..EngineOptions::default() }
}

fn prompts(engine: &Engine, n: usize, max_tokens: usize) -> Vec<EngineRequest> {
    let vocab = engine.spec().vocab_size;
    (0..n)
        .map(|i| {
            let ids = random_ids(100 + i as u64, 4 + i % 7, vocab);
            let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
            EngineRequest { prompt: String::new(), prompt_ids: ids, params }
        })
        .collect()
}

/// Submits every request at once through the router; outputs in order, the
/// device each ran on, and the seconds until the last ended.
fn run_all(router: &Router, requests: Vec<EngineRequest>) -> (Vec<RequestOutput>, Vec<usize>, f64) {
    let start = Instant::now();
    let (routed, rx) = submit_all(router, requests);
    let mut tokens = vec![0; routed.len()];
    let ends = wait_ends(&rx, routed.len(), &mut tokens);
    let seconds = start.elapsed().as_secs_f64();
    let outs = ends.into_iter().enumerate().map(|(i, end)| end.unwrap_or_else(|e| panic!("request {i}: {e}"))).collect();
    (outs, routed.iter().map(|r| r.device).collect(), seconds)
}

fn solo_outputs(engine: &Engine, requests: &[EngineRequest]) -> Vec<Vec<u32>> {
    requests.iter().map(|r| engine.generate_ids(String::new(), r.prompt_ids.clone(), &r.params, &mut |_| true).unwrap().token_ids).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn one_gpu_through_the_router_equals_solo() {
    let _turn = one_at_a_time();
    require_gpus(1);
    let router = Router::load(model(), options(), Some(&Devices::List(vec![0])), SchedulerOptions { max_batch: 16, max_queue: 64 }).unwrap();
    assert_eq!((router.len(), router.name(0)), (1, "cuda:0"));
    let engine: Arc<Engine> = router.engine().clone();
    let requests = prompts(&engine, 24, 32);
    let want = solo_outputs(&engine, &requests);
    let (outs, devices, seconds) = run_all(&router, requests);
    assert!(devices.iter().all(|&d| d == 0));
    for (i, (out, want)) in outs.iter().zip(&want).enumerate() {
        assert_eq!(&out.token_ids, want, "request {i} differs from its solo output");
    }
    println!("DEVICES-1 24 requests x 32 tokens in {seconds:.3} s on {}", engine.device_description());
}

#[test]
#[ignore = "needs two CUDA GPUs: run with --include-ignored on a multi-GPU machine"]
fn every_gpu_serves_and_outputs_equal_solo() {
    let _turn = one_at_a_time();
    require_gpus(2);
    let t = Instant::now();
    let one = Router::load(model(), options(), Some(&Devices::List(vec![0])), SchedulerOptions::default()).unwrap();
    let load_one = t.elapsed().as_secs_f64();
    drop(one);
    let t = Instant::now();
    let router = Router::load(model(), options(), Some(&Devices::All), SchedulerOptions { max_batch: 32, max_queue: 128 }).unwrap();
    let load_all = t.elapsed().as_secs_f64();
    let n = router.len();
    assert_eq!(n, device_count().unwrap());
    let engine = router.engine().clone();
    let requests = prompts(&engine, 32 * n, 64);
    let want = solo_outputs(&engine, &requests[..8]);
    let (outs, devices, seconds) = run_all(&router, requests);
    for d in 0..n {
        assert!(devices.contains(&d), "cuda:{d} got no request: {devices:?}");
    }
    for (i, (out, want)) in outs.iter().zip(&want).enumerate() {
        assert_eq!(&out.token_ids, want, "request {i} (on cuda:{}) differs from its solo output", devices[i]);
    }
    println!("DEVICES-{n} load {load_all:.2} s on {n} GPUs vs {load_one:.2} s on one; {} requests x 64 tokens in {seconds:.3} s", outs.len());
}

/// Submits `requests` through the router, each event of request i sent on as
/// (i, event); their handles (dropping one cancels its request).
fn submit_all(router: &Router, requests: Vec<EngineRequest>) -> (Vec<Routed>, mpsc::Receiver<(usize, BatchEvent)>) {
    let (tx, rx) = mpsc::channel();
    let routed = requests
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let tx = tx.clone();
            let sink = Box::new(move |e: BatchEvent| {
                let _ = tx.send((i, e));
                true
            });
            router.submit(r, sink).unwrap()
        })
        .collect();
    (routed, rx)
}

/// How each request ended: its output, or its error's text. Fails on a request
/// that does not end within a minute of the last event.
fn wait_ends(rx: &mpsc::Receiver<(usize, BatchEvent)>, n: usize, tokens_seen: &mut [usize]) -> Vec<std::result::Result<RequestOutput, String>> {
    let mut ends: Vec<Option<std::result::Result<RequestOutput, String>>> = (0..n).map(|_| None).collect();
    while ends.iter().any(Option::is_none) {
        let pending: Vec<usize> = (0..n).filter(|&i| ends[i].is_none()).collect();
        let (i, e) = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("requests {pending:?} never ended: a hang"));
        match e {
            BatchEvent::Delta(_) => tokens_seen[i] += 1,
            BatchEvent::Finished(out) => ends[i] = Some(Ok(out)),
            BatchEvent::Failed(e) => ends[i] = Some(Err(e.to_string())),
        }
    }
    ends.into_iter().map(Option::unwrap).collect()
}

/// Waits until request events show `n` tokens streamed by requests on `device`.
fn tokens_flowing(rx: &mpsc::Receiver<(usize, BatchEvent)>, devices: &[usize], device: usize, n: usize, held: &mut Vec<(usize, BatchEvent)>) {
    let mut seen = 0;
    while seen < n {
        let (i, e) = rx.recv_timeout(Duration::from_secs(60)).expect("no tokens came");
        match &e {
            BatchEvent::Delta(_) if devices[i] == device => seen += 1,
            BatchEvent::Delta(_) => {}
            BatchEvent::Finished(out) => panic!("request {i} finished ({} tokens, {:?}) before the fault", out.token_ids.len(), out.finish_reason),
            BatchEvent::Failed(e) => panic!("request {i} failed before the fault: {e}"),
        }
        held.push((i, e));
    }
}

#[test]
fn a_cpu_engine_cannot_be_made_to_fail_like_a_gpu() {
    let engine = Engine::load(fixture("tiny-qwen3"), EngineOptions { device: Device::Cpu, progress: Progress::Off, ..EngineOptions::default() }).unwrap();
    let err = engine.inject_device_fault().unwrap_err();
    assert_eq!(err.kind(), rocket_core::ErrorKind::InvalidArgument, "{err}");
    // And the engine still serves.
    let out = engine.generate_ids(String::new(), random_ids(1, 5, 512), &SamplingParams::greedy(3), &mut |_| true).unwrap();
    assert_eq!(out.token_ids.len(), 3);
}

#[test]
#[ignore = "needs a CUDA GPU: run alone (--exact) with --include-ignored on the GPU machine"]
fn a_fault_on_the_only_gpu_fails_its_requests_and_refuses_new_ones_at_once() {
    let _turn = one_at_a_time();
    require_gpus(1);
    let router = Router::load(model(), options(), Some(&Devices::List(vec![0])), SchedulerOptions { max_batch: 8, max_queue: 16 }).unwrap();
    let engine = router.engine().clone();
    let n = 8;
    let (routed, rx) = submit_all(&router, prompts(&engine, n, 900));
    let devices: Vec<usize> = routed.iter().map(|r| r.device).collect();
    let mut held = Vec::new();
    tokens_flowing(&rx, &devices, 0, 2 * n, &mut held);
    let fault = engine.inject_device_fault().unwrap();
    let t = Instant::now();
    let mut tokens = vec![0; n];
    for (i, e) in held {
        if matches!(e, BatchEvent::Delta(_)) {
            tokens[i] += 1;
        }
    }
    let ends = wait_ends(&rx, n, &mut tokens);
    let secs = t.elapsed().as_secs_f64();
    let failed: Vec<&String> = ends.iter().filter_map(|e| e.as_ref().err()).collect();
    assert!(!failed.is_empty(), "every request finished before the fault ({tokens:?} tokens)");
    for e in &failed {
        assert!(e.contains("cuda:0"), "an error that does not name the GPU: {e}");
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.healthy() {
        assert!(Instant::now() < deadline, "cuda:0 is still in service after its fault: {:?}", router.loads());
        std::thread::sleep(Duration::from_millis(5));
    }
    let t_refuse = Instant::now();
    let (tx, _rx) = mpsc::channel();
    let sink = Box::new(move |e: BatchEvent| tx.send(e).is_ok());
    let err = router.submit(prompts(&engine, 1, 4).remove(0), sink).unwrap_err();
    assert!(t_refuse.elapsed() < Duration::from_secs(1) && matches!(err, rocket_core::RocketError::NoDevice(_)), "{err}");
    println!(
        "DEVICES-FAULT-1 injected: {fault}; {} of {n} requests failed ({} finished) within {secs:.3} s, tokens before: {tokens:?}; then: {err}",
        failed.len(),
        n - failed.len()
    );
}

#[test]
#[ignore = "needs two CUDA GPUs: run alone (--exact) with --include-ignored on a multi-GPU machine"]
fn a_fault_on_one_gpu_mid_run_leaves_the_others_serving() {
    let _turn = one_at_a_time();
    require_gpus(2);
    let router = Router::load(model(), options(), Some(&Devices::All), SchedulerOptions { max_batch: 16, max_queue: 64 }).unwrap();
    let gpus = router.len();
    let engine = router.engine().clone();
    let n = 8 * gpus;
    let requests = prompts(&engine, n, 600);
    let want = solo_outputs(&engine, &requests);
    let (routed, rx) = submit_all(&router, requests);
    let devices: Vec<usize> = routed.iter().map(|r| r.device).collect();
    for d in 0..gpus {
        assert!(devices.contains(&d), "cuda:{d} got no request: {devices:?}");
    }
    let mut held = Vec::new();
    tokens_flowing(&rx, &devices, 1, 8, &mut held);
    let fault = router.scheduler(1).engine().inject_device_fault().unwrap();
    let mut tokens = vec![0; n];
    for (i, e) in held {
        if matches!(e, BatchEvent::Delta(_)) {
            tokens[i] += 1;
        }
    }
    let ends = wait_ends(&rx, n, &mut tokens);
    let mut failed = 0;
    for (i, end) in ends.iter().enumerate() {
        match (devices[i], end) {
            (1, Err(e)) => {
                failed += 1;
                assert!(e.contains("cuda:1"), "request {i}: an error that does not name the GPU: {e}");
            }
            (1, Ok(_)) => {} // finished before the fault reached it
            (d, Err(e)) => panic!("request {i} on cuda:{d}, a GPU without a fault, failed: {e}"),
            (d, Ok(out)) => assert_eq!(out.token_ids, want[i], "request {i} on cuda:{d} differs from its solo output"),
        }
    }
    assert!(failed > 0, "every request on cuda:1 finished before its fault");
    let deadline = Instant::now() + Duration::from_secs(10);
    while router.loads()[1].in_service {
        assert!(Instant::now() < deadline, "cuda:1 is still in service after its fault");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(router.healthy() && router.in_service() == gpus - 1);
    // New requests go to the GPUs left, and finish.
    let later = prompts(&engine, 2 * gpus, 16);
    let (later_routed, rx) = submit_all(&router, later);
    let later_devices: Vec<usize> = later_routed.iter().map(|r| r.device).collect();
    assert!(!later_devices.contains(&1), "{later_devices:?}");
    let mut seen = vec![0; later_devices.len()];
    for (i, end) in wait_ends(&rx, later_devices.len(), &mut seen).into_iter().enumerate() {
        let out = end.unwrap_or_else(|e| panic!("a request after the fault (on cuda:{}) failed: {e}", later_devices[i]));
        assert_eq!(out.token_ids.len(), 16);
    }
    println!(
        "DEVICES-FAULT-{gpus} injected on cuda:1: {fault}; {failed} of its {} requests failed, the other GPUs' {} equal solo; {} later requests served",
        devices.iter().filter(|&&d| d == 1).count(),
        devices.iter().filter(|&&d| d != 1).count(),
        later_devices.len()
    );
}

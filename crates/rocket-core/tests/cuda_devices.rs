//! One engine per GPU behind the router (`Router::load` with `Devices`), on real
//! GPUs. The tests are ignored unless run with `--include-ignored` on a GPU
//! machine: `cargo test -p rocket-core --features cuda --test cuda_devices --
//! --include-ignored` (the two-GPU test fails, saying so, on a machine with one).
//! Checkpoint: ROCKET_DEVICES_MODEL, else the committed tiny Qwen3 fixture.
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::*;
use rocket_core::backend::cuda::{device_count, unavailable_reason};
use rocket_core::router::Router;
use rocket_core::{BatchEvent, DecodePath, Device, Devices, Engine, EngineOptions, EngineRequest, GpuOptions, MatmulPath, Progress, RequestOutput, SamplingParams, SchedulerOptions};

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

/// Submits every request at once through the router; outputs in order, and the device each ran on.
fn run_all(router: &Router, requests: Vec<EngineRequest>) -> (Vec<RequestOutput>, Vec<usize>, f64) {
    let start = Instant::now();
    let (tx, rx) = mpsc::channel();
    let n = requests.len();
    let routed: Vec<_> = requests
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let tx = tx.clone();
            let sink = Box::new(move |e: BatchEvent| {
                if !matches!(e, BatchEvent::Delta(_)) {
                    let _ = tx.send((i, e));
                }
                true
            });
            router.submit(r, sink).unwrap()
        })
        .collect();
    let mut outs: Vec<Option<RequestOutput>> = (0..n).map(|_| None).collect();
    for _ in 0..n {
        let (i, e) = rx.recv_timeout(Duration::from_secs(300)).expect("a request never ended");
        match e {
            BatchEvent::Finished(out) => outs[i] = Some(out),
            BatchEvent::Failed(e) => panic!("request {i}: {e}"),
            BatchEvent::Delta(_) => unreachable!(),
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    (outs.into_iter().map(Option::unwrap).collect(), routed.iter().map(|r| r.device).collect(), seconds)
}

fn solo_outputs(engine: &Engine, requests: &[EngineRequest]) -> Vec<Vec<u32>> {
    requests.iter().map(|r| engine.generate_ids(String::new(), r.prompt_ids.clone(), &r.params, &mut |_| true).unwrap().token_ids).collect()
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn one_gpu_through_the_router_equals_solo() {
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

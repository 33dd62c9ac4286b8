//! The CUDA backend against the CPU reference on the same weights. Runs where a
//! GPU is present (skips with a message elsewhere). Checkpoints: the committed
//! tiny Qwen3 fixture, plus every folder in ROCKET_GPU_CHECKPOINTS (comma
//! separated; exact-shape random checkpoints from benches/make_checkpoint.py).
#![cfg(feature = "cuda")]

mod common;

use std::path::PathBuf;

use common::*;
use rocket_core::backend::cuda::{unavailable_reason, CudaBackend, CudaOptions, DecodeMode};
use rocket_core::backend::{Backend, Chunk, Device, Logits};
use rocket_core::model::{ModelSource, ModelWeights};
use rocket_core::progress::LoadProgress;
use rocket_core::{Engine, EngineOptions, SamplingParams};

fn gpu_or_skip() -> bool {
    match unavailable_reason() {
        None => true,
        Some(why) => {
            eprintln!("skipped: no usable CUDA device ({why})");
            false
        }
    }
}

fn checkpoints() -> Vec<PathBuf> {
    let mut v = vec![fixture("tiny-qwen3")];
    if let Ok(list) = std::env::var("ROCKET_GPU_CHECKPOINTS") {
        v.extend(list.split(',').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    v
}

fn load(path: &PathBuf, device: Device) -> Engine {
    Engine::load(path, EngineOptions { device, progress: false, ..EngineOptions::default() }).unwrap()
}


#[test]
fn teacher_forced_logits_match_the_cpu_reference() {
    if !gpu_or_skip() {
        return;
    }
    for path in checkpoints() {
        let cpu = load(&path, Device::Cpu);
        let gpu = load(&path, Device::Cuda);
        let vocab = cpu.spec().vocab_size;
        let len = if vocab > 100_000 { 40 } else { 96 };
        let ids = random_ids(7, len, vocab);
        let a = cpu.teacher_forced_logits(&ids).unwrap();
        let b = gpu.teacher_forced_logits(&ids).unwrap();
        assert!(b.iter().all(|v| v.is_finite()), "{}: non-finite GPU logits", path.display());
        let rel = rel_l2(&b, &a);
        let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |best, (i, &v)| if v > r[best] { i } else { best });
        let agree = a.chunks_exact(vocab).zip(b.chunks_exact(vocab)).filter(|(x, y)| argmax(x) == argmax(y)).count();
        println!(
            "PARITY {}: rel L2 {rel:.3e}, top-1 {agree}/{len} ({:.1}%) on {}",
            path.display(),
            100.0 * agree as f64 / len as f64,
            gpu.device_description()
        );
        assert!(rel <= 1e-2, "{}: rel L2 {rel}", path.display());
        assert!(agree as f64 >= 0.9 * len as f64, "{}: top-1 {agree}/{len}", path.display());
    }
}

#[test]
fn greedy_decode_is_repeatable_batch_independent_and_follows_the_reference() {
    if !gpu_or_skip() {
        return;
    }
    for path in checkpoints() {
        let gpu = load(&path, Device::Cuda);
        let cpu = load(&path, Device::Cpu);
        let vocab = gpu.spec().vocab_size;
        let p = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(32) };
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| random_ids(100 + i, 16 + 5 * i as usize, vocab)).collect();
        let solo: Vec<Vec<u32>> =
            prompts.iter().map(|ids| gpu.generate_ids(String::new(), ids.clone(), &p, &mut |_| true).unwrap().token_ids).collect();
        for _ in 0..2 {
            let again = gpu.generate_ids(String::new(), prompts[0].clone(), &p, &mut |_| true).unwrap();
            assert_eq!(again.token_ids, solo[0], "{}: greedy output changed between runs", path.display());
        }
        let batch = gpu.generate_many(prompts.iter().map(|ids| (String::new(), ids.clone(), p.clone())).collect()).unwrap();
        for (b, s) in batch.iter().zip(&solo) {
            assert_eq!(&b.token_ids, s, "{}: batched greedy differs from solo", path.display());
        }
        let reference = cpu.generate_ids(String::new(), prompts[0].clone(), &p, &mut |_| true).unwrap().token_ids;
        let same = reference.iter().zip(&solo[0]).take_while(|(a, b)| a == b).count();
        println!("GREEDY {}: first {same}/32 tokens equal to the CPU reference", path.display());
    }
}

#[test]
fn sampled_decode_runs_on_device_logits_and_is_seeded() {
    if !gpu_or_skip() {
        return;
    }
    let gpu = load(&fixture("tiny-qwen3"), Device::Cuda);
    let p = SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(5), ignore_eos: true, logprobs: Some(2), ..SamplingParams::greedy(20) };
    let a = gpu.generate("hello there", &p).unwrap();
    let b = gpu.generate("hello there", &p).unwrap();
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.logprobs.as_ref().unwrap().len(), 20);
}

#[test]
fn out_of_memory_and_unsupported_shapes_are_errors() {
    if !gpu_or_skip() {
        return;
    }
    let src = ModelSource::open(&fixture("tiny-qwen3")).unwrap();
    let spec = src.spec.clone();
    let weights = ModelWeights::from_weights(&spec, src.weights).unwrap();
    let backend = CudaBackend::new(spec.clone(), &weights, &LoadProgress::new(false)).unwrap();
    let err = backend.new_session(2_000_000_000).err().expect("a 2G-token KV cache cannot fit").to_string();
    assert!(err.contains("not enough device memory") && err.contains("GiB free"), "{err}");
    // The backend still works after the failed allocation.
    assert!(backend.new_session(64).is_ok());

    let mut odd = spec.clone();
    odd.head_dim = 96;
    let err = CudaBackend::new(odd, &weights, &LoadProgress::new(false)).err().expect("head_dim 96 has no kernel").to_string();
    assert!(err.contains("head_dim 96"), "{err}");
}

#[test]
fn module_load_does_not_jit_on_hopper() {
    if !gpu_or_skip() {
        return;
    }
    let src = ModelSource::open(&fixture("tiny-qwen3")).unwrap();
    let weights = ModelWeights::from_weights(&src.spec, src.weights).unwrap();
    let backend = CudaBackend::new(src.spec.clone(), &weights, &LoadProgress::new(false)).unwrap();
    let info = backend.info();
    println!("MODULE {} loaded in {:.1} ms on {}", info.kernel_image, info.module_load_seconds * 1e3, info.device_name);
    assert!(info.module_load_seconds < 0.5, "module load took {:.2} s", info.module_load_seconds);
}

#[test]
fn tensor_core_matmul_matches_the_reference_and_the_gemv() {
    if !gpu_or_skip() {
        return;
    }
    for path in checkpoints() {
        let src = ModelSource::open(&path).unwrap();
        let spec = src.spec.clone();
        let weights = ModelWeights::from_weights(&spec, src.weights).unwrap();
        let backend = |tensor_core_matmul| {
            let opts = CudaOptions { decode: DecodeMode::Graph, tensor_core_matmul, graphs: true };
            CudaBackend::with_options(spec.clone(), &weights, &LoadProgress::new(false), opts).unwrap()
        };
        let (tc, gemv) = (backend(true), backend(false));
        let cpu = load(&path, Device::Cpu);
        let vocab = spec.vocab_size;
        // Prefill: every row of a 128-token prompt at once.
        let ids = random_ids(31, 128, vocab);
        let all = |b: &CudaBackend| {
            let mut s = b.new_session(ids.len()).unwrap();
            b.forward(&mut [Chunk { session: s.as_mut(), tokens: &ids }], Logits::All).unwrap()
        };
        let (got, via_gemv) = (all(&tc), all(&gemv));
        assert!(got.iter().all(|v| v.is_finite()), "{}: non-finite tensor-core logits", path.display());
        let want = cpu.teacher_forced_logits(&ids).unwrap();
        let (rel, rel_gemv) = (rel_l2(&got, &want), rel_l2(&got, &via_gemv));
        // Batched decode: 16 sequences of different lengths, one step together.
        let prompts: Vec<Vec<u32>> = (0..16).map(|i| random_ids(200 + i, 5 + 3 * i as usize, vocab)).collect();
        let step = |b: &CudaBackend| {
            let mut sessions: Vec<_> = prompts.iter().map(|p| b.new_session(p.len() + 1).unwrap()).collect();
            for (s, p) in sessions.iter_mut().zip(&prompts) {
                b.forward(&mut [Chunk { session: s.as_mut(), tokens: p }], Logits::Last).unwrap();
            }
            let next: Vec<u32> = prompts.iter().map(|p| p[0]).collect();
            let mut chunks: Vec<Chunk<'_>> =
                sessions.iter_mut().zip(&next).map(|(s, t)| Chunk { session: s.as_mut(), tokens: std::slice::from_ref(t) }).collect();
            b.forward(&mut chunks, Logits::Last).unwrap()
        };
        let batch_rel = rel_l2(&step(&tc), &step(&gemv));
        println!(
            "TC {}: prefill 128 rel L2 {rel:.3e} vs CPU, {rel_gemv:.3e} vs GEMV; batch-16 step {batch_rel:.3e} vs GEMV",
            path.display()
        );
        assert!(rel <= 1e-2, "{}: tensor-core prefill rel L2 {rel}", path.display());
        assert!(rel_gemv <= 5e-3 && batch_rel <= 5e-3, "{}: tensor core vs GEMV {rel_gemv} / {batch_rel}", path.display());
    }
}

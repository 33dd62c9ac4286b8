//! The CUDA backend against the CPU reference on the same weights. Needs a GPU:
//! the tests are ignored unless run with `--include-ignored`. Checkpoints: the committed
//! tiny Qwen3 fixture, plus every folder in ROCKET_GPU_CHECKPOINTS (comma
//! separated; exact-shape random checkpoints from benches/make_checkpoint.py).
#![cfg(feature = "diagnostics")]

mod common;

use std::path::PathBuf;

use common::*;
use rocket_core::backend::cuda::{unavailable_reason, CudaBackend, FusedF16, HandoffMode, MatmulFusion, MatmulKernel, RowBitsKernel};
use rocket_core::backend::{Backend, Chunk, Device, Logits};
use rocket_core::model::{ModelSpec, ModelWeights};
use rocket_core::progress::LoadProgress;
use rocket_core::weights::Tensor;
use rocket_core::{DecodePath, Engine, EngineOptions, EngineRequest, GpuOptions, MatmulPath, Progress, SamplingParams};

/// Every test here carries `#[ignore]`: without a GPU `cargo test` reports them
/// ignored, never passed. Run with `--include-ignored` on the GPU machine, where
/// a missing device fails the test with the reason.
fn require_gpu() {
    if let Some(why) = unavailable_reason() {
        panic!("no usable CUDA device ({why}): these tests need one");
    }
}

fn checkpoints() -> Vec<PathBuf> {
    let mut v = vec![fixture("tiny-qwen3")];
    if let Ok(list) = std::env::var("ROCKET_GPU_CHECKPOINTS") {
        v.extend(list.split(',').filter(|s| !s.is_empty()).map(PathBuf::from));
    }
    v
}

/// The graph path with the GEMV for every pass, where batched output equals
/// solo bit for bit: what the tests below run unless they name other options.
fn graph_gemv() -> GpuOptions {
    GpuOptions { decode: DecodePath::Graph, matmul: MatmulPath::Gemv, ..GpuOptions::default() }
}

/// The CUDA backend alone (`graph_gemv`) on a checkpoint.
fn cuda_backend(path: &std::path::Path) -> CudaBackend {
    let (spec, weights) = open_weights(path);
    backend_with(&spec, &weights, graph_gemv())
}

/// The CUDA backend alone on opened weights, with `opts`.
fn backend_with(spec: &ModelSpec, weights: &ModelWeights, opts: GpuOptions) -> CudaBackend {
    CudaBackend::with_options(spec.clone(), weights, &LoadProgress::new(Progress::Off), opts).unwrap()
}

fn load(path: &PathBuf, device: Device) -> Engine {
    load_with(path, device, graph_gemv())
}

fn load_with(path: &PathBuf, device: Device, gpu: GpuOptions) -> Engine {
    Engine::load(path, EngineOptions { device, progress: Progress::Off, gpu, ..EngineOptions::default() }).unwrap()
}


#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn teacher_forced_logits_match_the_cpu_reference() {
    require_gpu();
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
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn greedy_decode_is_repeatable_batch_independent_and_follows_the_reference() {
    require_gpu();
    let graph_tensor = GpuOptions { matmul: MatmulPath::Tensor, ..graph_gemv() };
    for path in checkpoints() {
        let cpu = load(&path, Device::Cpu);
        let vocab = cpu.spec().vocab_size;
        let p = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(32) };
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| random_ids(100 + i, 16 + 5 * i as usize, vocab)).collect();
        let reference = cpu.generate_ids(String::new(), prompts[0].clone(), &p, &mut |_| true).unwrap().token_ids;
        for options in [graph_gemv(), graph_tensor.clone(), GpuOptions::default()] {
            // Batched equals solo bit for bit only where one kernel serves every pass:
            // the graph path with a fixed matmul (the megakernel and MatmulPath::Auto
            // change the summation order with the batch).
            let invariant = options.decode == DecodePath::Graph && options.matmul != MatmulPath::Auto;
            let at = format!("{} (decode {}, matmul {})", path.display(), options.decode, options.matmul);
            let gpu = load_with(&path, Device::Cuda, options);
            let solo: Vec<Vec<u32>> =
                prompts.iter().map(|ids| gpu.generate_ids(String::new(), ids.clone(), &p, &mut |_| true).unwrap().token_ids).collect();
            for _ in 0..2 {
                let again = gpu.generate_ids(String::new(), prompts[0].clone(), &p, &mut |_| true).unwrap();
                assert_eq!(again.token_ids, solo[0], "{at}: greedy output changed between runs");
            }
            let batch = gpu.generate_many(prompts.iter().map(|ids| EngineRequest { prompt: String::new(), prompt_ids: ids.clone(), params: p.clone() }).collect()).unwrap();
            let equal = batch.iter().zip(&solo).filter(|(b, s)| &b.token_ids == *s).count();
            println!("GREEDY {at}: batched equal to solo for {equal}/{} prompts", solo.len());
            if invariant {
                for (b, s) in batch.iter().zip(&solo) {
                    assert_eq!(&b.token_ids, s, "{at}: batched greedy differs from solo");
                }
            }
            let same = reference.iter().zip(&solo[0]).take_while(|(a, b)| a == b).count();
            println!("GREEDY {at}: first {same}/32 tokens equal to the CPU reference");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn sampled_decode_runs_on_device_logits_and_is_seeded() {
    require_gpu();
    let gpu = load(&fixture("tiny-qwen3"), Device::Cuda);
    let p = SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(5), ignore_eos: true, logprobs: Some(2), ..SamplingParams::greedy(20) };
    let a = gpu.generate("hello there", &p).unwrap();
    let b = gpu.generate("hello there", &p).unwrap();
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.logprobs.as_ref().unwrap().len(), 20);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn out_of_memory_and_unsupported_shapes_are_errors() {
    require_gpu();
    let (spec, weights) = open_weights(&fixture("tiny-qwen3"));
    let backend = CudaBackend::new(spec.clone(), &weights, &LoadProgress::new(Progress::Off)).unwrap();
    let err = backend.new_session(2_000_000_000).err().expect("a 2G-token KV cache cannot fit").to_string();
    assert!(err.contains("not enough device memory") && err.contains("GiB free"), "{err}");
    // The backend still works after the failed allocation.
    assert!(backend.new_session(64).is_ok());

    let mut odd = spec.clone();
    odd.head_dim = 96;
    let err = CudaBackend::new(odd, &weights, &LoadProgress::new(Progress::Off)).err().expect("head_dim 96 has no kernel").to_string();
    assert!(err.contains("head_dim 96"), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn module_load_does_not_jit_on_hopper() {
    require_gpu();
    let backend = cuda_backend(&fixture("tiny-qwen3"));
    let info = backend.info();
    println!("MODULE {} loaded in {:.1} ms on {}", info.kernel_image, info.module_load_seconds * 1e3, info.device_name);
    assert!(info.module_load_seconds < 0.5, "module load took {:.2} s", info.module_load_seconds);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn tensor_core_matmul_matches_the_reference_and_the_gemv() {
    require_gpu();
    for path in checkpoints() {
        let (spec, weights) = open_weights(&path);
        let backend = |tensor| {
            let matmul = if tensor { MatmulPath::Tensor } else { MatmulPath::Gemv };
            // Fused norms and SiLU and early launches on (the defaults), so the tensor-core
            // path checked here is the one decode and prefill run.
            let opts = GpuOptions { decode: DecodePath::Graph, matmul, ..GpuOptions::default() };
            assert!(opts.fuse && opts.pdl && opts.cuda_graphs);
            backend_with(&spec, &weights, opts)
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

/// With every pass on the tensor cores, a decode row's logits are the same bits
/// whether it runs alone or shares its pass with another sequence's prompt (the
/// continuous batcher mixes the two; every product and norm must treat the row
/// alike in both).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn a_decode_row_is_the_same_bits_beside_a_prompt_on_the_tensor_cores() {
    require_gpu();
    for path in checkpoints() {
        let (spec, weights) = open_weights(&path);
        let opts = GpuOptions { decode: DecodePath::Graph, matmul: MatmulPath::Tensor, ..GpuOptions::default() };
        let b = backend_with(&spec, &weights, opts);
        let next = [random_ids(73, 1, spec.vocab_size)[0]];
        // A short pair (one 64-position attention split each), and a decode row past one
        // split beside a prompt chunk whose context reaches past 32 splits of 64 (which
        // must not stretch the decode row's splits: the prompt's rows are on the prefill
        // kernel). The prompt chunk follows a cached prefix, so the pass keeps at most
        // 256 rows, within which the tensor-core GEMM splits K alike for every row count
        // (kernels.rs `GemmPlan`: larger passes do not split, and their rows round differently).
        let long = 2200.min(spec.max_position_embeddings - 1);
        for (prompt_len, cached, other_len) in [(20, 0, 33), (100, long - 200, 200)] {
            let (prompt, other) = (random_ids(71, prompt_len, spec.vocab_size), random_ids(72, cached + other_len, spec.vocab_size));
            let decoded = |with_prompt: bool| {
                let mut s = b.new_session(prompt_len.next_multiple_of(64)).unwrap();
                b.forward(&mut [Chunk { session: s.as_mut(), tokens: &prompt }], Logits::Last).unwrap();
                if !with_prompt {
                    return b.forward(&mut [Chunk { session: s.as_mut(), tokens: &next }], Logits::Last).unwrap();
                }
                let mut o = b.new_session((cached + other_len).next_multiple_of(64)).unwrap();
                if cached > 0 {
                    b.forward(&mut [Chunk { session: o.as_mut(), tokens: &other[..cached] }], Logits::Last).unwrap();
                }
                let chunk = &other[cached..];
                let both = b
                    .forward(&mut [Chunk { session: s.as_mut(), tokens: &next }, Chunk { session: o.as_mut(), tokens: chunk }], Logits::Last)
                    .unwrap();
                both[..spec.vocab_size].to_vec()
            };
            let (alone, beside) = (decoded(false), decoded(true));
            let differ = bits_differ(&alone, &beside);
            println!(
                "MIXED {}: {prompt_len}-token context beside a {other_len}-token prompt chunk after {cached} cached positions: {differ} of {} logits differ from the row alone",
                path.display(),
                alone.len()
            );
            assert!(alone.iter().all(|v| v.is_finite()), "{}: non-finite logits", path.display());
            assert_eq!(differ, 0, "{}: a decode row's logits depend on a {other_len}-token prompt chunk sharing its pass", path.display());
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn a_kv_only_pass_fills_the_cache_as_a_pass_with_logits_does() {
    require_gpu();
    for path in checkpoints() {
        let (spec, weights) = open_weights(&path);
        // The defaults (prompts on the tensor cores, decode graphs on, padded prompt passes replayed
        // from graphs: the last piece is a later pass of 74 rows run as 96), the graph path with the
        // GEMV, where a one-token piece is decode-shaped and captured in a graph keyed by its output
        // rows, and the prompt passes launched unpadded.
        for opts in [GpuOptions::default(), graph_gemv(), GpuOptions { prompt_graphs: false, ..GpuOptions::default() }] {
            let b = backend_with(&spec, &weights, opts.clone());
            let ids = random_ids(81, 140, spec.vocab_size);
            // Pieces (0..64, 64..65, 65..139) then the last token; the same pieces asking each for
            // its last row's logits must leave the same cache, hence the same final logits, bit for bit.
            let run = |first: Logits| {
                let mut s = b.new_session(192).unwrap();
                for piece in [&ids[..64], &ids[64..65], &ids[65..139]] {
                    let out = b.forward(&mut [Chunk { session: s.as_mut(), tokens: piece }], first).unwrap();
                    assert_eq!(out.len(), if first == Logits::KvOnly { 0 } else { spec.vocab_size }, "{first:?}: rows returned");
                }
                b.forward(&mut [Chunk { session: s.as_mut(), tokens: &ids[139..] }], Logits::Last).unwrap()
            };
            let (kv_only, with_logits) = (run(Logits::KvOnly), run(Logits::Last));
            let differ = bits_differ(&kv_only, &with_logits);
            println!("KV-ONLY {} ({opts:?}): {differ} of {} final logits differ after KvOnly pieces", path.display(), kv_only.len());
            assert!(kv_only.iter().all(|v| v.is_finite()), "{}: non-finite logits", path.display());
            assert_eq!(differ, 0, "{}: the pieces' cache depends on whether they asked for logits", path.display());
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn prompt_attention_on_the_tensor_cores_matches_the_split_kernel_and_ignores_tiling() {
    require_gpu();
    for path in checkpoints() {
        let (spec, weights) = open_weights(&path);
        let vocab = spec.vocab_size;
        let attention_backend = |tc_attention: bool, matmul: MatmulPath, wgmma_attention: bool| {
            let opts = GpuOptions { decode: DecodePath::Graph, matmul, tc_attention, wgmma_attention, ..GpuOptions::default() };
            backend_with(&spec, &weights, opts)
        };
        let backend = |tc_attention: bool, matmul: MatmulPath| attention_backend(tc_attention, matmul, true);
        // ROCKET_TC_ATTN_SHORT=1 keeps the cases of a few key tiles (every path of the
        // kernel's loop: one tile, several, a partial one, a start mid-tile) and drops the long
        // and deep ones, so compute-sanitizer's racecheck reaches the multi-tile cases in minutes.
        // It also leaves out the `auto` backends: their cuBLASLt kernels are not rocket's, and
        // with cuBLASLt loaded under racecheck the sanitizer stopped at the first backend
        // ("failed to handle a hardware exception").
        let short = std::env::var("ROCKET_TC_ATTN_SHORT").is_ok_and(|v| v == "1");
        // With `auto` and cuBLASLt loaded, passes of 33 rows or more run on fp16 products
        // and a pass of tiles alone takes the O-projection's fp16 operand from the prompt
        // attention itself; both backends take the same products, so the difference is
        // still the attention's.
        let autos = (!short).then(|| (backend(true, MatmulPath::Auto), backend(false, MatmulPath::Auto)));
        let (tc, split) = (backend(true, MatmulPath::Tensor), backend(false, MatmulPath::Tensor));
        // On Hopper at head_dim 64 and 128 `tc` runs the wgmma kernel; the mma.sync one
        // (every other GPU's) is checked beside it.
        let tc_mma = attention_backend(true, MatmulPath::Tensor, false);
        let auto_label = match autos.as_ref().map(|(auto, _)| auto.cublas_operands().unwrap()) {
            Some("fp16") => "auto (fp16 from 33 rows)",
            _ => "auto (no cuBLASLt: the tensor-core GEMM)",
        };
        // Logits of every row of `chunk`, after `prefix` went in as a pass of its own.
        let run = |b: &CudaBackend, prefix: &[u32], chunk: &[u32]| {
            let mut s = b.new_session(prefix.len() + chunk.len()).unwrap();
            if !prefix.is_empty() {
                b.forward(&mut [Chunk { session: s.as_mut(), tokens: prefix }], Logits::Last).unwrap();
            }
            b.forward(&mut [Chunk { session: s.as_mut(), tokens: chunk }], Logits::All).unwrap()
        };
        // Whole tiles, partial ones, a chunk that starts mid-tile after a cached prefix,
        // long enough for many key tiles, and (where the model allows) one whose first
        // tile's context crosses a context split (kernels.rs PREFILL_SPAN, 1024).
        let long = (if vocab > 100_000 { 300 } else { 700 }).min(spec.max_position_embeddings);
        let deep = !short && spec.max_position_embeddings >= 1100;
        let mut cases = vec![(0, 2), (0, 17), (0, 64), (0, 130), (40, 77)];
        if !short {
            cases.push((0, long));
        }
        if deep {
            cases.push((1000, 60));
        }
        for (n, (prefix_len, len)) in cases.into_iter().enumerate() {
            let ids = random_ids(900 + n as u64, prefix_len + len, vocab);
            let (prefix, chunk) = ids.split_at(prefix_len);
            let mut pairs = vec![("tensor-core", &tc, &split), ("tensor-core, mma.sync attention", &tc_mma, &split)];
            if let Some((auto, auto_split)) = &autos {
                pairs.push((auto_label, auto, auto_split));
            }
            for (products, tc, split) in pairs {
                let (a, b) = (run(tc, prefix, chunk), run(split, prefix, chunk));
                assert!(a.iter().all(|v| v.is_finite()), "{}: non-finite logits on the tensor cores", path.display());
                let worst = a.chunks(vocab).zip(b.chunks(vocab)).map(|(x, y)| rel_l2(x, y)).fold(0.0, f64::max);
                let argmax = |r: &[f32]| r.iter().enumerate().fold(0, |best, (i, &v)| if v > r[best] { i } else { best });
                let agree = a.chunks(vocab).zip(b.chunks(vocab)).filter(|(x, y)| argmax(x) == argmax(y)).count();
                println!(
                    "TC-ATTN {}: {products} products, prefix {prefix_len} + {len} rows: rel L2 {:.3e} (worst row {worst:.3e}), top-1 {agree}/{len} against the split kernel",
                    path.display(),
                    rel_l2(&a, &b)
                );
                // The split kernel is f32 attention; the tensor cores' scores and weights are
                // f32-accurate (hi/lo bf16 queries and weights).
                assert!(worst <= 3e-3, "{}: {products} products, prefix {prefix_len} + {len}: worst row rel L2 {worst}", path.display());
            }
        }
        // A row's result does not depend on how its prompt was split into passes (key
        // tiles sit on absolute positions; the products split k the same way in passes of
        // up to 256 rows).
        let ids = random_ids(950, 130, vocab);
        let whole = run(&tc, &[], &ids);
        let parts = run(&tc, &ids[..50], &ids[50..]);
        let differ = bits_differ(&whole[50 * vocab..], &parts);
        println!("TC-ATTN {}: rows 50..130 in one pass and after a 50-row pass: {differ} logits differ", path.display());
        assert_eq!(differ, 0, "{}: a prompt row's logits depend on how the prompt was split", path.display());
        if deep {
            // Across a context split: rows 1000..1100 in a pass from 960 (rows 1000..1023
            // in a tile within the first split, written directly) and in a pass from 1000
            // (the same rows in a tile crossing it, merged from one live split; rows 1024..
            // merged from two splits in other tiles). Positions 960..999 go in a pass of
            // their own in the second run: every pass from 960 on has 33-256 rows, so the
            // products split k the same way for each row (kernels.rs GemmPlan; the 960-row
            // first pass does not split k, and positions 960..999 in it would differ).
            let ids = random_ids(960, 1100, vocab);
            let from_960 = run(&tc, &ids[..960], &ids[960..]);
            let from_1000 = {
                let mut s = tc.new_session(ids.len()).unwrap();
                for pass in [&ids[..960], &ids[960..1000]] {
                    tc.forward(&mut [Chunk { session: s.as_mut(), tokens: pass }], Logits::Last).unwrap();
                }
                tc.forward(&mut [Chunk { session: s.as_mut(), tokens: &ids[1000..] }], Logits::All).unwrap()
            };
            let differ = bits_differ(&from_960[40 * vocab..], &from_1000);
            println!("TC-ATTN {}: rows 1000..1100 in a pass from 960 and in one from 1000: {differ} logits differ", path.display());
            assert_eq!(differ, 0, "{}: a row's logits depend on how its tile meets a context split", path.display());
        }
    }
}

/// The last row's logits of a prompt prefilled in passes cut at `cuts` (none: one pass).
fn last_logits_of_cut_passes(backend: &CudaBackend, ids: &[u32], cuts: &[usize]) -> Vec<f32> {
    let mut s = backend.new_session(ids.len()).unwrap();
    let mut out = Vec::new();
    let bounds: Vec<usize> = std::iter::once(0).chain(cuts.iter().copied()).chain(std::iter::once(ids.len())).collect();
    for w in bounds.windows(2) {
        out = backend.forward(&mut [Chunk { session: s.as_mut(), tokens: &ids[w[0]..w[1]] }], Logits::Last).unwrap();
    }
    out
}

/// A prompt row's bits do not depend on how long its pass is, from `PASS_SHARED_ROWS`
/// rows up for a prompt's first pass and from `LATER_PASS_SHARED_ROWS` for the passes
/// after it, on the default path (`auto`: cuBLASLt's fp16 products, whose algorithm
/// cuBLASLt picks per row count, and a later pass under `PASS_SHARED_ROWS` rows takes
/// the pick for that many): a 2,560-token prompt in one pass against the same prompt
/// cut anywhere into a first pass of 512 rows or more and later passes of 128 or more
/// (at multiples of 512 and not: a reused prefix ends on a block and the rest runs as
/// passes of `PREFILL_CHUNK`, a short remainder joining the pass before it), the last
/// row's logits compared bit for bit (every earlier row's keys and values feed it).
/// Prefix reuse (`batch::chunk_end`) is bitwise only where this holds. A first pass of
/// 128 rows runs its own count's pick, which need not keep them: printed, not
/// asserted (PASS-LEN-FIRST128). Prints PASS-LEN lines.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn a_prompt_rows_bits_do_not_depend_on_its_pass_length() {
    require_gpu();
    let mut misses = Vec::new();
    for path in checkpoints() {
        let (spec, weights) = open_weights(&path);
        let len = 2560;
        if spec.max_position_embeddings < len {
            continue;
        }
        let backend = backend_with(&spec, &weights, GpuOptions::default());
        let ids = random_ids(2560, len, spec.vocab_size);
        let last_logits = |cuts: &[usize]| last_logits_of_cut_passes(&backend, &ids, cuts);
        let whole = last_logits(&[]);
        assert!(whole.iter().all(|v| v.is_finite()), "{}: non-finite logits", path.display());
        let first_128 = last_logits(&[128]);
        println!("PASS-LEN-FIRST128 {}: a first pass of 128 rows: {} of {} last-row logits differ", path.display(), bits_differ(&whole, &first_128), whole.len());
        let cut_sets = [
            vec![512, 1024, 1536, 2048],
            vec![516],
            vec![600, 1200, 1800],
            vec![1100],
            vec![2048],
            vec![1536],
            // Later passes under 512 rows: 128, 276, 200 and 4 x 128.
            vec![512, 640],
            vec![1024, 1300],
            vec![2360],
            vec![2048, 2176, 2304, 2432],
        ];
        for cuts in cut_sets {
            let got = last_logits(&cuts);
            let differ = bits_differ(&whole, &got);
            let rel = rel_l2(&got, &whole);
            println!("PASS-LEN {}: passes cut at {cuts:?} against one pass of {len}: {differ} of {} last-row logits differ (rel L2 {rel:.2e})", path.display(), whole.len());
            if differ > 0 {
                misses.push(format!("{} cut at {cuts:?}: {differ} differ", path.display()));
            }
        }
    }
    assert!(misses.is_empty(), "a row's bits depend on its pass's length: {misses:?}");
}

/// Prompt passes padded to their row bucket and replayed from the bucket's graph
/// (`prompt_graphs`): every pass gives the bits of the same padded pass launched
/// kernel by kernel (`cuda_graphs` off), whichever prompt of the bucket recorded
/// the graph (a shape launches directly at its first pass, records at its second,
/// replays from its third); the logits stay near the unpadded pass's (they differ
/// only where cuBLASLt's pick for the bucket's row count sums in another order);
/// later passes under 512 rows keep the bits of one whole pass, so the pad rows
/// write nothing the prompt reads; and graphs recorded before the scratch and the
/// attention's partials grew still give the launched bits after. Prints
/// PROMPT-GRAPH lines (ms per pass).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn prompt_graphs_replay_the_bits_of_the_padded_pass() {
    require_gpu();
    for path in checkpoints() {
        let (spec, weights) = open_weights(&path);
        let with = |prompt_graphs: bool, cuda_graphs: bool| {
            let opts = GpuOptions { prompt_graphs, cuda_graphs, ..GpuOptions::default() };
            backend_with(&spec, &weights, opts)
        };
        let (graphed, direct, plain) = (with(true, true), with(true, false), with(false, true));
        let vocab = spec.vocab_size;
        // One pass of these prompts (each its own session), timed, and its last rows' logits.
        let pass = |b: &CudaBackend, prompts: &[Vec<u32>]| {
            let mut sessions: Vec<_> = prompts.iter().map(|p| b.new_session(p.len() + 1).unwrap()).collect();
            let mut chunks: Vec<Chunk> = sessions.iter_mut().zip(prompts).map(|(s, p)| Chunk { session: s.as_mut(), tokens: p }).collect();
            let t = std::time::Instant::now();
            let out = b.forward(&mut chunks, Logits::Last).unwrap();
            (out, t.elapsed().as_secs_f64() * 1e3)
        };
        let mut seed = 9000;
        let mut prompts_of = |lens: &[usize]| -> Vec<Vec<u32>> {
            lens.iter()
                .map(|&l| {
                    seed += 1;
                    random_ids(seed, l, vocab)
                })
                .collect()
        };
        // The graph's bits against the padded pass launched kernel by kernel.
        let same_as_launched = |prompts: &[Vec<u32>], what: &str| {
            let (g, d) = (pass(&graphed, prompts).0, pass(&direct, prompts).0);
            let differ = bits_differ(&g, &d);
            println!("PROMPT-GRAPH {} {what}: {differ} logits differ from the launched pass", path.display());
            assert_eq!(differ, 0, "{}: {what}: the graph's logits are not the padded pass's", path.display());
        };
        let cases: [&[usize]; 11] = [&[2], &[3], &[17], &[45], &[100], &[128], &[200], &[300], &[511], &[512], &[30, 50]];
        for lens in cases {
            if lens.iter().any(|&l| l > spec.max_position_embeddings) {
                continue;
            }
            // Three prompt sets of one shape: launched, recorded, replayed with other inputs.
            for round in ["first", "records", "replays"] {
                let prompts = prompts_of(lens);
                let (g, g_ms) = pass(&graphed, &prompts);
                let (d, d_ms) = pass(&direct, &prompts);
                let (p, p_ms) = pass(&plain, &prompts);
                assert_eq!(g.len(), lens.len() * vocab, "{}: rows returned", path.display());
                assert!(g.iter().all(|v| v.is_finite()), "{}: non-finite logits at {lens:?}", path.display());
                let (differ, rel) = (bits_differ(&g, &d), rel_l2(&g, &p));
                println!(
                    "PROMPT-GRAPH {} {lens:?} {round}: {g_ms:.2} ms, launched {d_ms:.2}, unpadded {p_ms:.2}; {differ} logits differ from the launched pass; rel L2 {rel:.2e} to the unpadded",
                    path.display()
                );
                assert_eq!(differ, 0, "{}: {lens:?} ({round}): the graph's logits are not the padded pass's", path.display());
                assert!(rel <= 1e-2, "{}: {lens:?} ({round}): rel L2 {rel} to the unpadded pass", path.display());
            }
        }
        // Later passes under 512 rows (138, 276, 200 rows, run as 160, 288, 224) against one pass,
        // each cut three times (launched, recorded, replayed) before the one pass and once after it.
        let len = 2560;
        if spec.max_position_embeddings < len {
            continue;
        }
        let ids = random_ids(2561, len, vocab);
        let last_logits = |cuts: &[usize]| last_logits_of_cut_passes(&graphed, &ids, cuts);
        let cut_sets = [vec![512, 650], vec![1024, 1300], vec![2360]];
        let before: Vec<Vec<Vec<f32>>> = cut_sets.iter().map(|cuts| (0..3).map(|_| last_logits(cuts)).collect()).collect();
        // The one pass grows the scratch and the attention's partials under the graphs recorded so far.
        let whole = last_logits(&[]);
        for (cuts, runs) in cut_sets.iter().zip(before) {
            for (i, got) in runs.iter().chain(std::iter::once(&last_logits(cuts))).enumerate() {
                let differ = bits_differ(&whole, got);
                println!("PROMPT-GRAPH-LATER {}: passes cut at {cuts:?}, run {i}: {differ} of {} last-row logits differ from one pass", path.display(), whole.len());
                assert_eq!(differ, 0, "{}: padded later passes cut at {cuts:?} (run {i}) change the prompt's logits", path.display());
            }
        }
        // Shapes recorded before the growth, replayed after it.
        for lens in [[3usize].as_slice(), &[45], &[30, 50]] {
            for _ in 0..2 {
                same_as_launched(&prompts_of(lens), &format!("{lens:?} after the buffers grew"));
            }
        }
    }
}

/// Sampling settings that exercise every branch of the device sampler.
fn sampler_settings() -> Vec<SamplingParams> {
    let mut out = Vec::new();
    for (i, &temperature) in [0.0f32, 0.3, 0.7, 1.0, 1.6].iter().enumerate() {
        for &top_k in &[0usize, 1, 7, 64, 2000, 1 << 20] {
            for &top_p in &[1.0f32, 0.95, 0.5, 0.999] {
                for &min_p in &[0.0f32, 0.05] {
                    let n = out.len();
                    out.push(SamplingParams {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        // Penalties and min_tokens on some of them.
                        repetition_penalty: if n % 3 == 0 { 1.3 } else { 1.0 },
                        presence_penalty: if n % 5 == 1 { 0.5 } else { 0.0 },
                        frequency_penalty: if n % 7 == 2 { -0.4 } else { 0.0 },
                        min_tokens: if n % 4 == 3 { 50 } else { 0 },
                        seed: Some(1000 + n as u64 + i as u64),
                        ..SamplingParams::default()
                    });
                }
            }
        }
    }
    out
}

/// Logits rows of several kinds: peaked and flat Gaussian, exact ties, -inf and
/// NaN holes, a +inf entry, and nothing but -inf.
fn sampler_logits(kind: usize, seed: u64, vocab: usize) -> Vec<f32> {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut normal = move || {
        // Sum of uniforms: cheap and good enough for shapes.
        (0..4).map(|_| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            (rng >> 11) as f32 / (1u64 << 53) as f32
        }).sum::<f32>() * 1.7 - 3.4
    };
    let mut row: Vec<f32> = (0..vocab).map(|_| normal()).collect();
    match kind % 7 {
        0 => row.iter_mut().for_each(|v| *v *= 4.0),                   // peaked
        1 => row.iter_mut().for_each(|v| *v *= 0.05),                  // nearly flat: huge nucleus
        2 => row.iter_mut().for_each(|v| *v = (*v * 2.0).round()),     // many exact ties
        3 => (0..vocab).step_by(3).for_each(|i| row[i] = f32::NEG_INFINITY),
        4 => (0..vocab).step_by(11).for_each(|i| row[i] = f32::NAN),
        5 => row[vocab / 2] = f32::INFINITY,
        _ => {
            if seed % 2 == 0 {
                row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
            } else {
                // All equal, as -0.0 and +0.0: argmax takes the first; total_cmp orders them.
                row.iter_mut().enumerate().for_each(|(i, v)| *v = if i % 2 == 0 { -0.0 } else { 0.0 });
            }
        }
    }
    row
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn device_sampler_picks_the_host_samplers_token() {
    require_gpu();
    use rocket_core::backend::SampleRequest;
    use rocket_core::sampling::TokenHistory;
    for path in checkpoints() {
        let gpu = cuda_backend(&path);
        let vocab = gpu.spec().vocab_size;
        let settings = sampler_settings();
        // Histories with prompt and generated tokens (penalties), some below min_tokens.
        let histories: Vec<TokenHistory> = (0..8u64)
            .map(|h| {
                let mut t = TokenHistory::new(&random_ids(h, 40, vocab));
                random_ids(h + 100, 10 * h as usize, vocab).into_iter().for_each(|x| t.push(x));
                t
            })
            .collect();
        let end_ids: Vec<u32> = random_ids(77, 3, vocab);
        // Every setting in mixed batches (each row through its own path), then each
        // split path's rows alone (sample.cu over 32 CTAs per row): sampled top-k <= 64
        // (the lists), and greedy or no top-k cut (the bins).
        let listable: Vec<SamplingParams> = settings.iter().filter(|p| p.temperature > 0.0 && (1..=64).contains(&p.top_k)).cloned().collect();
        let binned: Vec<SamplingParams> = settings.iter().filter(|p| p.temperature == 0.0 || p.top_k == 0 || p.top_k >= vocab).cloned().collect();
        for (label, settings) in [("SAMPLER", &settings), ("SAMPLER-TOPK", &listable), ("SAMPLER-BINS", &binned)] {
            let (mut rows, mut mismatches, mut device_s) = (0usize, Vec::new(), 0.0f64);
            for (batch, chunk) in settings.chunks(48).enumerate() {
                let logits: Vec<f32> = (0..chunk.len()).flat_map(|i| sampler_logits(i + batch, (batch * 100 + i) as u64, vocab)).collect();
                let requests: Vec<SampleRequest<'_>> = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, p)| SampleRequest {
                        params: p,
                        seed: p.seed.unwrap(),
                        step: (batch * 7 + i) as u64,
                        history: &histories[i % histories.len()],
                        end_ids: &end_ids,
                    })
                    .collect();
                let t = std::time::Instant::now();
                let got = gpu.sample_on_device(&logits, &requests).unwrap();
                device_s += t.elapsed().as_secs_f64();
                for (i, r) in requests.iter().enumerate() {
                    let want = r.sample_on_host(&logits[i * vocab..(i + 1) * vocab]);
                    if got[i] != want {
                        mismatches.push(format!("row {i} of batch {batch} ({:?}, kind {}): device {} host {want}", r.params, (i + batch) % 7, got[i]));
                    }
                    rows += 1;
                }
            }
            println!(
                "{label} {}: {rows} rows, {} differ from the host sampler; {:.1} us per row (batches of 48, with upload)",
                path.display(),
                mismatches.len(),
                device_s * 1e6 / rows as f64
            );
            assert!(rows > 0, "{label}: no rows");
            assert!(mismatches.is_empty(), "{label}: {}", mismatches[..mismatches.len().min(5)].join("\n"));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn sampled_batches_pick_on_the_device_what_the_host_would() {
    require_gpu();
    use rocket_core::backend::SampleRequest;
    use rocket_core::sampling::TokenHistory;
    for path in checkpoints() {
        let gpu = cuda_backend(&path);
        let vocab = gpu.spec().vocab_size;
        let settings: Vec<SamplingParams> = sampler_settings().into_iter().step_by(23).take(8).collect();
        let prompts: Vec<Vec<u32>> = (0..settings.len()).map(|i| random_ids(300 + i as u64, 6 + 5 * i, vocab)).collect();
        let steps = 24;
        // Two sets of sessions fed the same tokens: one returns logits (sampled on
        // the host), the other samples on the device. Both see identical logits.
        let mut host_sessions: Vec<_> = prompts.iter().map(|p| gpu.new_session(p.len() + steps).unwrap()).collect();
        let mut dev_sessions: Vec<_> = prompts.iter().map(|p| gpu.new_session(p.len() + steps).unwrap()).collect();
        let mut histories: Vec<TokenHistory> = prompts.iter().map(|p| TokenHistory::new(p)).collect();
        let end_ids = [2u32, 5];
        let mut inputs: Vec<Vec<u32>> = prompts.clone();
        let mut same = 0;
        for step in 0..steps {
            let requests: Vec<SampleRequest<'_>> = settings
                .iter()
                .zip(&histories)
                .map(|(p, h)| SampleRequest { params: p, seed: p.seed.unwrap(), step: step as u64, history: h, end_ids: &end_ids })
                .collect();
            let mut chunks: Vec<Chunk<'_>> = host_sessions.iter_mut().zip(&inputs).map(|(s, t)| Chunk { session: s.as_mut(), tokens: t }).collect();
            let logits = gpu.forward(&mut chunks, Logits::Last).unwrap();
            let want: Vec<u32> = requests.iter().enumerate().map(|(i, r)| r.sample_on_host(&logits[i * vocab..(i + 1) * vocab])).collect();
            let mut chunks: Vec<Chunk<'_>> = dev_sessions.iter_mut().zip(&inputs).map(|(s, t)| Chunk { session: s.as_mut(), tokens: t }).collect();
            let got = gpu.forward_sample(&mut chunks, &requests).unwrap().expect("the CUDA backend samples on the device");
            assert_eq!(got, want, "{}: step {step}", path.display());
            same += got.len();
            drop(requests);
            for (h, &t) in histories.iter_mut().zip(&want) {
                h.push(t);
            }
            inputs = want.iter().map(|&t| vec![t]).collect();
        }
        println!("SAMPLED-BATCH {}: {same} device-sampled tokens over {steps} steps equal the host's", path.display());
    }
}

/// The rate one CTA per SM streams HBM through the megakernel's weight ring at
/// several slot sizes, and with plain loads: the ceiling of its matrix-vector ops.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn streaming_probe_reads_every_byte_and_reports_its_rate() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let copy = gpu.copy_bandwidth_gbs().unwrap();
    let rates = gpu.stream_probe(2 << 30, 5, 0x5eed).unwrap();
    for r in &rates {
        println!("STREAM {}: {:.0} GB/s read ({:.1}% of the copy bandwidth {copy:.0} GB/s)", r.kernel, r.read_gbs, 100.0 * r.read_gbs / copy);
        assert!(r.checksum_ok, "{}: the kernel's xor of the buffer differs from the host's", r.kernel);
        assert!(r.read_gbs > 0.0 && r.read_gbs.is_finite());
    }
    assert_eq!(rates.len(), 5);
}

/// What one dependent L2 load costs on this GPU, idle and while every other SM
/// streams HBM: the unit of the megakernel's hand-offs.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn l2_latency_probe_walks_the_chain_and_reports_the_cost_of_a_load() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let r = gpu.l2_latency_probe(20_000, 256 << 20, 0x1a7e).unwrap();
    println!("L2-LATENCY {:.0} ns per dependent load idle, {:.0} ns while the other SMs stream HBM", r.idle_ns, r.loaded_ns);
    assert!(r.chain_ok, "a walk ended off the host's chain");
    for ns in [r.idle_ns, r.loaded_ns] {
        assert!(ns.is_finite() && ns > 10.0 && ns < 100_000.0, "{ns} ns per load");
    }
}

/// What the megakernel's release (`signal`) and a dependent L2 load cost while
/// the SM's own bulk-copy engine has 0..12 weight copies landing.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn fence_probe_times_a_release_beside_the_weight_stream() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let costs = gpu.fence_probe(&[0, 1, 4, 8, 12], 2000, 0xfe7c).unwrap();
    for c in &costs {
        println!(
            "FENCE {:2} copies in flight: {:.0} ns per store + release (slowest SM {:.0}), {:.0} ns per dependent L2 load",
            c.inflight, c.release_ns, c.release_max_ns, c.load_ns
        );
        assert!(c.chain_ok, "a walk ended off the host's chain");
        assert!(c.release_ns > 0.0 && c.release_ns < 1e6 && c.load_ns > 0.0 && c.load_ns < 1e6, "{c:?}");
    }
    assert_eq!(costs.len(), 5);
}

/// What one grid-wide hand-off (every SM publishes a slice, every SM waits for
/// and reads the whole vector) costs in each protocol a megakernel could use,
/// while each SM keeps 0, 4 or 12 weight copies landing, at Qwen3-0.6B's and
/// Llama-3.2-1B's hidden sizes. Every protocol the memory model guarantees must
/// end on the host's digest; the control that does not wait must not (it shows
/// the digest catches stale reads). The bulk store with a relaxed arrival is
/// not guaranteed, so its digest is reported, not asserted.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn handoff_probe_times_each_protocol_beside_the_weight_stream() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    // Every line prints before any assertion fails, so one bad mode hides no figures.
    let mut failures = Vec::new();
    for width in [1024, 2048] {
        let costs = gpu.handoff_probe(&HandoffMode::ALL, &[0, 4, 12], width, 2000, 2, 0x4a4d ^ width as u64).unwrap();
        assert_eq!(costs.len(), 3 * HandoffMode::ALL.len());
        for c in &costs {
            println!(
                "HANDOFF width {width} {:<28} {:2} copies in flight: {:6.0} ns per hand-off (slowest SM {:6.0}), stream {:5.0} GB/s, digest {}{}",
                c.mode.name(),
                c.inflight,
                c.ns,
                c.max_ns,
                c.stream_gbs,
                if c.digest_ok { "right" } else { "WRONG" },
                if c.timed_out { ", a wait timed out" } else { "" }
            );
            if c.mode.is_ordered() && !(c.digest_ok && !c.timed_out && c.ns > 10.0 && c.ns < 1e6) {
                failures.push(format!("width {width}: {}: a guaranteed hand-off read a stale word, hung or timed oddly: {c:?}", c.mode.name()));
            }
            if c.mode == HandoffMode::NoWait && c.digest_ok {
                failures.push(format!("width {width}: the control that never waits ended on the right digest: the check cannot see stale reads"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Every matmul shape of the four fuels (qkv, O, gate|up, down, LM head) on both
/// matmul kernels, at the row counts of batch-1/16 decode and prefill (partial
/// tiles included): each against the host's f64 product with a poisoned output,
/// then timed streaming its weights from HBM. Prints a GB/s table. The tensor-core
/// GEMM runs each product both plain and fused: RMSNorm before qkv and gate|up and
/// SiLU·mul after gate|up, as the forward pass runs them, and RMSNorm before the LM
/// head, which the kernel supports but the pass keeps apart (mod.rs `record_pass`).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn matmul_kernels_match_the_host_at_every_fuel_shape() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let copy = gpu.copy_bandwidth_gbs().unwrap();
    // (fuel, hidden, q_dim, kv_dim, intermediate, vocab)
    let fuels = [
        ("llama-3.2-1b", 2048, 2048, 512, 8192, 128_256),
        ("qwen3-0.6b", 1024, 2048, 1024, 3072, 151_936),
        ("qwen3-1.7b", 2048, 2048, 1024, 6144, 151_936),
        ("smollm2-135m", 576, 576, 192, 1536, 49_152),
    ];
    let mut seed = 0xa11ce;
    for (fuel, d, qd, kvd, ff, vocab) in fuels {
        let normed = MatmulFusion { norm: true, silu: false };
        let shapes = [
            ("qkv", qd + 2 * kvd, d, false, normed),
            ("o", d, qd, true, MatmulFusion::default()),
            ("gate_up", 2 * ff, d, false, MatmulFusion { norm: true, silu: true }),
            ("down", d, ff, true, MatmulFusion::default()),
            ("lm_head", vocab, d, false, normed),
        ];
        for (name, n, k, accumulate, fused) in shapes {
            for rows in [1usize, 5, 16, 17, 40, 72, 128, 300] {
                if name == "lm_head" && rows > 16 {
                    continue; // prefill takes the LM head of its last row only
                }
                let mut runs = vec![(MatmulKernel::Tensor, MatmulFusion::default())];
                if fused != MatmulFusion::default() {
                    runs.push((MatmulKernel::Tensor, fused));
                }
                if rows <= 16 {
                    runs.push((MatmulKernel::Gemv, MatmulFusion::default())); // the GEMV serves small batches
                }
                for (kernel, fusion) in runs {
                    seed += 1;
                    let reps = if rows > 16 { 5 } else { 20 };
                    let c = gpu.matmul_check(kernel, fusion, n, k, rows, accumulate, reps, seed).unwrap();
                    let label = match (fusion.norm, fusion.silu) {
                        (false, false) => "",
                        (true, false) => "+norm",
                        (false, true) => "+silu",
                        (true, true) => "+norm+silu",
                    };
                    println!(
                        "MATMUL {fuel} {name} {n}x{k} rows {rows} {:?}{label} ({}): rel L2 {:.2e} over {} outputs, {:.1} us, {:.0} GB/s ({:.1}% of copy)",
                        c.kernel, c.plan, c.rel_l2, c.checked, c.micros, c.gbs, 100.0 * c.gbs / copy
                    );
                    assert!(c.all_written, "{fuel} {name} rows {rows} {kernel:?}{label}: an output was never written");
                    // hi+lo inputs keep ~16 bits (2^-17 ≈ 7.6e-6 each) and f32 sums over 8192 terms
                    // deep: ~2e-5 at worst; a wrong or missing term shows as 1e-3 or more.
                    assert!(c.rel_l2 <= 1e-4, "{fuel} {name} rows {rows} {kernel:?}{label}: rel L2 {}", c.rel_l2);
                }
            }
        }
    }
}

/// The fuels' shapes the matmul checks use: (name, hidden, q dim, kv dim, intermediate),
/// Llama-3.2-1B and Qwen3-0.6B first.
const FUEL_SHAPES: [(&str, usize, usize, usize, usize); 3] =
    [("llama-3.2-1b", 2048, 2048, 512, 8192), ("qwen3-0.6b", 1024, 2048, 1024, 3072), ("smollm2-135m", 576, 576, 192, 1536)];

/// A layer's four products for a fuel of hidden size d, q_dim qd, kv_dim kvd and
/// intermediate size ff: (name, weight rows n, k, whether the product adds to y).
fn layer_products(d: usize, qd: usize, kvd: usize, ff: usize) -> [(&'static str, usize, usize, bool); 4] {
    [("qkv", qd + 2 * kvd, d, false), ("o", d, qd, true), ("gate_up", 2 * ff, d, false), ("down", d, ff, true)]
}

/// The cuBLASLt matmul path (`MatmulPath::Cublas`): every fuel's products at
/// decode-batch and prefill row counts against the host's f64 product, on fp16
/// operands (each input rounded to fp16, ~1.4e-4 relative: 5e-4), on the inputs'
/// bf16 hi and lo parts (the tensor-core GEMM's bar, 1e-4) and on hi alone (each
/// input rounded to bf16, ~1.1e-3 relative: 4e-3), timed beside rocket's own
/// tensor-core GEMM at the same shape; then teacher-forced logits
/// of each checkpoint on the graph path with it against the CPU reference,
/// under the bar the other paths meet. Prints CUBLAS lines. Needs
/// libcublasLt.so on the loader path (benches/gpu_run.sh adds the toolkit's).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn cublas_matmul_matches_the_host_and_the_reference() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let fuels = &FUEL_SHAPES[..];
    let mut seed = 0xc0b1a5;
    for &(fuel, d, qd, kvd, ff) in fuels {
        for (name, n, k, accumulate) in layer_products(d, qd, kvd, ff) {
            // 32-96 rows: where cuBLASLt starts to pay (a chat turn's or an interleaved
            // prompt piece's pass sits there; CUBLAS_MIN_ROWS).
            for rows in [2usize, 17, 32, 48, 64, 72, 96, 128, 512, 4096] {
                seed += 1;
                let check = |kernel| gpu.matmul_check(kernel, MatmulFusion::default(), n, k, rows, accumulate, 10, seed).unwrap();
                let (c, b, t) = (check(MatmulKernel::Cublas), check(MatmulKernel::CublasBf16), check(MatmulKernel::Tensor));
                let h = check(MatmulKernel::CublasF16);
                let tflops = |us: f64| 2.0 * (n * k * rows) as f64 / us / 1e6;
                println!(
                    "CUBLAS {fuel} {name} {n}x{k} rows {rows}: fp16 rel L2 {:.2e}, {:.1} us ({:.0} TFLOP/s); hi+lo rel L2 {:.2e}, {:.1} us ({:.0} TFLOP/s); \
                     bf16 alone rel L2 {:.2e}, {:.1} us; tensor-core GEMM {:.1} us ({:.0} TFLOP/s), rel L2 {:.2e}",
                    h.rel_l2,
                    h.micros,
                    tflops(h.micros),
                    c.rel_l2,
                    c.micros,
                    tflops(c.micros),
                    b.rel_l2,
                    b.micros,
                    t.micros,
                    tflops(t.micros),
                    t.rel_l2
                );
                assert!(c.all_written && b.all_written && h.all_written, "{fuel} {name} rows {rows}: an output was never written");
                // fp16 keeps 11 bits of each input (unit roundoff 2^-11; ~1.9e-4 rel L2 on
                // these uniform inputs).
                assert!(h.rel_l2 <= 5e-4, "{fuel} {name} rows {rows}: fp16 rel L2 {}", h.rel_l2);
                // The split keeps what the tensor-core GEMM keeps (its bar); hi alone is off by
                // a bf16 rounding of each input (~1.1e-3 relative each: 4e-3).
                assert!(c.rel_l2 <= 1e-4, "{fuel} {name} rows {rows}: hi+lo rel L2 {}", c.rel_l2);
                assert!(b.rel_l2 <= 4e-3, "{fuel} {name} rows {rows}: bf16 rel L2 {}", b.rel_l2);
            }
        }
    }
    let cublas = GpuOptions { matmul: MatmulPath::Cublas, ..graph_gemv() };
    let mut misses = Vec::new();
    for path in checkpoints() {
        let cpu = load(&path, Device::Cpu);
        let vocab = cpu.spec().vocab_size;
        // A pass of at least CUBLAS_MIN_ROWS rows: on cuBLASLt.
        let len = 160.min(cpu.spec().max_position_embeddings);
        assert!(len >= rocket_core::backend::cuda::CUBLAS_MIN_ROWS, "{}: {len} positions take no cuBLASLt pass", path.display());
        let ids = random_ids(7, len, vocab);
        let want = cpu.teacher_forced_logits(&ids).unwrap();
        let got = load_with(&path, Device::Cuda, cublas.clone()).teacher_forced_logits(&ids).unwrap();
        let rel = rel_l2(&got, &want);
        println!("CUBLAS {}: teacher-forced logits rel L2 {rel:.3e} against the CPU reference ({len} positions)", path.display());
        misses.extend((rel > 1e-2).then(|| format!("{}: rel L2 {rel}", path.display())));
    }
    assert!(misses.is_empty(), "over the 1e-2 bar: {misses:?}");
}

/// cuBLASLt's heuristic candidates (up to 16) for the fp16 products of
/// Llama-3.2-1B and Qwen3-0.6B at a chat tail's, a short prompt's and long
/// passes' row counts: each checked against the host's f64 product (the fp16
/// bar, 5e-4) and timed with weights from HBM. Prints CUBLAS-ALGO lines (the
/// candidate's configuration, µs, GB/s) and a CUBLAS-BEST line per shape: how far
/// the heuristic's first pick, which the forward pass runs, is from the fastest.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn cublas_matmul_candidates_at_prompt_rows() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let fuels = &FUEL_SHAPES[..2];
    let mut seed = 0xa160;
    for &(fuel, d, qd, kvd, ff) in fuels {
        for (name, n, k, accumulate) in layer_products(d, qd, kvd, ff) {
            for rows in [4usize, 128, 512, 2048] {
                let mut times = Vec::new();
                for c in 0..16u8 {
                    seed += 1;
                    let check = match gpu.matmul_check(MatmulKernel::CublasF16Candidate(c), MatmulFusion::default(), n, k, rows, accumulate, 20, seed) {
                        Ok(check) => check,
                        Err(e) if c > 0 && e.to_string().contains("offered fewer") => break,
                        Err(e) => panic!("{fuel} {name} rows {rows} candidate {c}: {e}"),
                    };
                    println!(
                        "CUBLAS-ALGO {fuel} {name} {n}x{k} rows {rows} candidate {c}: {:.1} us, {:.0} GB/s, rel L2 {:.2e} ({})",
                        check.micros, check.gbs, check.rel_l2, check.plan
                    );
                    assert!(check.all_written, "{fuel} {name} rows {rows} candidate {c}: an output was never written");
                    assert!(check.rel_l2 < 5e-4, "{fuel} {name} rows {rows} candidate {c}: rel L2 {:.2e}", check.rel_l2);
                    times.push(check.micros);
                }
                let (best, t) = times.iter().enumerate().fold((0, f64::INFINITY), |b, (i, &t)| if t < b.1 { (i, t) } else { b });
                println!("CUBLAS-BEST {fuel} {name} rows {rows}: first pick {:.1} us, fastest candidate {best} {t:.1} us ({:.2}x), of {}", times[0], times[0] / t, times.len());
            }
        }
    }
}

/// cuBLASLt's fp16 products at a short prompt's 128 rows made to split K
/// (the heuristic's first two candidates as it made them, then split 2-8 ways
/// under each reduction scheme cuBLASLt accepts): each checked against the
/// host's f64 product (5e-4) and for the same bits on a second launch (which the
/// heuristic's own candidates, as the forward pass runs them, must give), and
/// timed. Prints CUBLAS-SPLITK lines and, per shape, CUBLAS-SPLITK-BEST: the
/// heuristic's first pick against the fastest repeatable configuration.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn cublas_split_k_at_short_prompt_rows() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let fuels = &FUEL_SHAPES[..2];
    let mut seed = 0x5b17;
    let rows = 128usize;
    for &(fuel, d, qd, kvd, ff) in fuels {
        for (name, n, k, accumulate) in layer_products(d, qd, kvd, ff) {
            let mut best = (String::new(), f64::INFINITY);
            let mut first = f64::NAN;
            for candidate in 0..2u8 {
                for splits in [1u8, 2, 3, 4, 6, 8] {
                    for scheme in [1u8, 2, 4] {
                        if splits == 1 && scheme > 1 {
                            continue;
                        }
                        seed += 1;
                        let kernel = MatmulKernel::CublasF16SplitK { candidate, splits, scheme };
                        let check = match gpu.matmul_check(kernel, MatmulFusion::default(), n, k, rows, accumulate, 20, seed) {
                            Ok(check) => check,
                            Err(e) if splits > 1 && e.to_string().contains("cuBLASLt refused it") => {
                                println!("CUBLAS-SPLITK {fuel} {name} {n}x{k} rows {rows} candidate {candidate} splits {splits} scheme {scheme}: refused ({e})");
                                continue;
                            }
                            Err(e) => panic!("{fuel} {name} {kernel:?}: {e}"),
                        };
                        println!(
                            "CUBLAS-SPLITK {fuel} {name} {n}x{k} rows {rows} candidate {candidate} splits {splits} scheme {scheme}: {:.1} us, rel L2 {:.2e}, repeatable {} ({})",
                            check.micros, check.rel_l2, check.repeatable, check.plan
                        );
                        assert!(check.all_written && check.rel_l2 < 5e-4, "{fuel} {name} {kernel:?}: rel L2 {:.2e}", check.rel_l2);
                        assert!(splits > 1 || check.repeatable, "{fuel} {name} candidate {candidate}: a second launch changed the bits");
                        if candidate == 0 && splits == 1 {
                            first = check.micros;
                        }
                        if check.repeatable && check.micros < best.1 {
                            best = (format!("candidate {candidate} splits {splits} scheme {scheme}"), check.micros);
                        }
                    }
                }
            }
            println!("CUBLAS-SPLITK-BEST {fuel} {name} rows {rows}: first pick {first:.1} us, fastest repeatable {} {:.1} us ({:.2}x)", best.0, best.1, first / best.1);
        }
    }
}

/// A row's bits on cuBLASLt's fp16 products of Llama-3.2-1B and Qwen3-0.6B at
/// pass lengths from 33 to 2,559 rows, against 512 rows: under the heuristic's
/// own pick per row count (what a prompt's first pass runs: every pass of 512 rows
/// or more must keep a row's bits, up to the longest pass `batch::chunk_end` makes,
/// `PREFILL_CHUNK` + `PASS_SHARED_ROWS` - 1, which prefix reuse rests on), under the
/// pick for 512 rows at every row count (what a later pass under 512 rows runs: it
/// must keep them from `LATER_PASS_SHARED_ROWS` rows), and under the pick for 128
/// rows against 128 rows (printed only). Prints ROW-BITS lines.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn cublas_rows_keep_their_bits_across_pass_lengths() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let rows = [33usize, 64, 100, 128, 132, 200, 256, 384, 512, 516, 600, 776, 1024, 1100, 1536, 1800, 2048, 2052, 2559];
    let later = rocket_core::batch::LATER_PASS_SHARED_ROWS;
    let fuels = &FUEL_SHAPES[..2];
    let mut misses = Vec::new();
    for &(fuel, d, qd, kvd, ff) in fuels {
        for (name, n, k, _) in layer_products(d, qd, kvd, ff) {
            for (mode, reference, algo_rows) in [("own", 512, None), ("pinned512", 512, Some(512)), ("pinned128", 128, Some(128))] {
                let runs = gpu.product_row_bits(RowBitsKernel::Cublas { algo_rows }, n, k, reference, &rows, 0x0b17 + n as u64).unwrap();
                for r in &runs {
                    if let Some(why) = &r.refused {
                        println!("ROW-BITS {fuel} {name} {n}x{k} {mode} rows {}: refused ({why})", r.rows);
                        if mode == "pinned512" && r.rows >= later {
                            misses.push(format!("{fuel} {name} pinned to 512 rows' pick, refused at {} rows", r.rows));
                        }
                        continue;
                    }
                    println!(
                        "ROW-BITS {fuel} {name} {n}x{k} {mode} rows {}: {} of {} differ from {reference} rows, {:.1} us ({})",
                        r.rows, r.differ, r.compared, r.micros, r.algo
                    );
                    let kept = match mode {
                        "own" => r.rows < 512,
                        "pinned512" => r.rows < later,
                        _ => true,
                    };
                    if !kept && r.differ > 0 {
                        misses.push(format!("{fuel} {name} {mode} at {} rows: {} differ", r.rows, r.differ));
                    }
                }
                let differing: Vec<usize> = runs.iter().filter(|r| r.differ > 0).map(|r| r.rows).collect();
                let refused: Vec<usize> = runs.iter().filter(|r| r.refused.is_some()).map(|r| r.rows).collect();
                println!("ROW-BITS-SUMMARY {fuel} {name} {mode}: rows differing from {reference}: {differing:?}; refused at {refused:?}");
            }
        }
    }
    assert!(misses.is_empty(), "the forward pass's products change a row's bits between passes of 512 to 2,559 rows, or later passes of 128 to 511: {misses:?}");
}

/// rocket's fp16 GEMM (gemm_f16.cu), written for the forward pass's fp16
/// products of 33-256 rows (taken there while `GEMM_F16_IN_FORWARD` is on): every fuel's four layer products at 33-256 rows
/// against the host's f64 product (fp16 operands, the bar cuBLASLt's fp16 products
/// meet, 5e-4), timed beside cuBLASLt's at the same shape (F16GEMM lines), then a
/// row's bits at 33-200 rows against its bits at 256 (the split of K never
/// depends on the rows, so they must all agree).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn f16_gemm_matches_the_host_and_keeps_a_rows_bits() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let fuels = &FUEL_SHAPES[..];
    let mut seed = 0xf16_6e44;
    let mut misses = Vec::new();
    for &(fuel, d, qd, kvd, ff) in fuels {
        let mut sums = [(0f64, 0f64); 3];
        for (name, n, k, accumulate) in layer_products(d, qd, kvd, ff) {
            for rows in [33usize, 64, 72, 128, 200, 256] {
                seed += 1;
                let check = |kernel| gpu.matmul_check(kernel, MatmulFusion::default(), n, k, rows, accumulate, 10, seed).unwrap();
                let (g, c) = (check(MatmulKernel::F16Gemm), check(MatmulKernel::CublasF16));
                println!(
                    "F16GEMM {fuel} {name} {n}x{k} rows {rows} ({}): rel L2 {:.2e}, {:.1} us ({:.0} GB/s); cuBLASLt fp16 rel L2 {:.2e}, {:.1} us",
                    g.plan, g.rel_l2, g.micros, g.gbs, c.rel_l2, c.micros
                );
                if let Some(j) = [33, 128, 256].iter().position(|&r| r == rows) {
                    sums[j].0 += g.micros;
                    sums[j].1 += c.micros;
                }
                if !g.all_written || g.rel_l2.is_nan() || g.rel_l2 > 5e-4 {
                    misses.push(format!("{fuel} {name} rows {rows}: written {}, rel L2 {:.2e}", g.all_written, g.rel_l2));
                }
            }
            let rows = [33usize, 40, 64, 65, 100, 128, 129, 200];
            for r in gpu.product_row_bits(RowBitsKernel::F16Gemm, n, k, 256, &rows, 0x0b17 + n as u64).unwrap() {
                println!("F16GEMM-ROW-BITS {fuel} {name} {n}x{k} rows {}: {} of {} differ from 256 rows, {:.1} us ({})", r.rows, r.differ, r.compared, r.micros, r.algo);
                if r.differ > 0 {
                    misses.push(format!("{fuel} {name} at {} rows: {} outputs differ from 256 rows", r.rows, r.differ));
                }
            }
        }
        for (rows, (g, c)) in [33, 128, 256].iter().zip(sums) {
            println!("F16GEMM-LAYER {fuel} rows {rows}: four products {g:.1} us, cuBLASLt fp16 {c:.1} us ({:.2}x)", c / g);
        }
    }
    assert!(misses.is_empty(), "the fp16 GEMM: {misses:?}");
}

/// to_f16.cu against the host's conversion (half's, to nearest even): random
/// values over fp16's whole range, its subnormals and the edges, bit for bit,
/// with the range flag clear; then one value past the range sets it (and only a
/// finite one: inf and NaN inputs convert without it). The same for the
/// weights' bf16 -> fp16 copy.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn fp16_conversions_round_as_the_host_and_flag_values_past_the_range() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let mut values: Vec<f32> = (0..100_003u64)
        .map(|i| {
            // splitmix64
            let mut r = (i ^ 0xf16).wrapping_add(0x9e37_79b9_7f4a_7c15);
            r = (r ^ (r >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            r = (r ^ (r >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            r ^= r >> 31;
            let magnitude = 2f32.powf((r >> 40) as f32 / (1u64 << 24) as f32 * 42.0 - 26.0); // 2^-26 .. 2^16
            let v = if r & 1 == 1 { -magnitude } else { magnitude };
            v.clamp(-65_519.0, 65_519.0)
        })
        .collect();
    // Ties at the subnormal and normal steps, the largest finite fp16, and what rounds to it.
    values.extend([2f32.powi(-25), 3.0 * 2f32.powi(-25), 1.0 + 2f32.powi(-11), 65_504.0, 65_519.99, -65_519.99, 0.0, -0.0, f32::INFINITY, f32::NAN]);
    let (bits, flagged) = gpu.to_f16_on_device(&values).unwrap();
    let wrong: Vec<_> = values
        .iter()
        .zip(&bits)
        .filter(|&(&v, &b)| {
            let want = half::f16::from_f32(v);
            if v.is_nan() { !half::f16::from_bits(b).is_nan() } else { want.to_bits() != b }
        })
        .collect();
    println!("F16 to_f16: {} values, {} differ from the host's rounding, range flag {flagged}", values.len(), wrong.len());
    assert!(wrong.is_empty(), "to_f16 differs from half::f16::from_f32 at {} values, e.g. {:?}", wrong.len(), &wrong[..wrong.len().min(5)]);
    assert!(!flagged, "to_f16 flagged values within fp16's range (or inf / NaN inputs)");
    for past in [65_520.0f32, -70_000.0, 3.0e38] {
        let (bits, flagged) = gpu.to_f16_on_device(&[1.0, past, 2.0, 3.0, 4.0]).unwrap();
        println!("F16 to_f16 of {past}: bits {:#06x}, range flag {flagged}", bits[1]);
        assert!(flagged, "to_f16 of {past} did not set the range flag");
    }

    // bf16 weights within fp16's range (bf16 steps by 256 near 2^16: 65,408 and up round
    // to 65,536, past it).
    let weights: Vec<u16> = values.iter().map(|&v| half::bf16::from_f32(v)).filter(|w| w.to_f32().abs() <= 65_504.0).map(|w| w.to_bits()).collect();
    let (bits, flagged) = gpu.bf16_to_f16_on_device(&weights).unwrap();
    let wrong = weights.iter().zip(&bits).filter(|&(&w, &b)| half::f16::from_f32(half::bf16::from_bits(w).to_f32()).to_bits() != b).count();
    println!("F16 bf16_to_f16: {} weights, {wrong} differ from the host's, range flag {flagged}", weights.len());
    assert_eq!(wrong, 0, "bf16_to_f16 differs from the host's conversion");
    assert!(!flagged, "bf16_to_f16 flagged weights within fp16's range");
    let (_, flagged) = gpu.bf16_to_f16_on_device(&[half::bf16::from_f32(1.0e5).to_bits(), 0, 0, 0, 0]).unwrap();
    assert!(flagged, "bf16_to_f16 of 1e5 did not set the range flag");
}

/// The norm and SiLU·mul writing cuBLASLt's fp16 operands themselves
/// (rms_norm_f16, silu_mul_f16) give the bits of rms_norm / silu_mul followed by
/// to_f16, and set the range flag exactly where to_f16 does: random rows at
/// Llama-3.2-1B's widths, then the same rows with values past fp16's range (a
/// norm weight of 1e6; one gate and up pair of 300, SiLU·mul ~9e4).
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn fused_fp16_outputs_are_the_bits_of_the_separate_rounding() {
    require_gpu();
    let gpu = cuda_backend(&fixture("tiny-qwen3"));
    let rows = 37;
    for (op, dim) in [(FusedF16::RmsNorm, 2048usize), (FusedF16::SiluMul, 8192)] {
        for past in [false, true] {
            let width = if op == FusedF16::RmsNorm { dim } else { 2 * dim };
            let mut input = random_values(0xf05e + dim as u64, rows * width, 6.0);
            let mut weights = if op == FusedF16::RmsNorm { random_values(0x3e1, dim, 1.5) } else { Vec::new() };
            if past {
                match op {
                    FusedF16::RmsNorm => weights[5] = 1.0e6,
                    FusedF16::SiluMul => (input[3 * width + 7], input[3 * width + dim + 7]) = (300.0, 300.0),
                }
            }
            let c = gpu.fused_f16_on_device(op, &input, &weights, dim, rows).unwrap();
            let differ = c.fused.iter().zip(&c.separate).filter(|(a, b)| a != b).count();
            let poison = c.fused.iter().filter(|&&b| b == 0xffff).count();
            println!(
                "F16-FUSED {op:?} {rows}x{dim}, values past the range {past}: {differ} of {} differ from the separate rounding, \
                 {poison} left unwritten, range flag fused {} separate {}",
                c.fused.len(),
                c.fused_flag,
                c.separate_flag
            );
            assert_eq!(poison, 0, "{op:?}: outputs never written");
            assert_eq!(differ, 0, "{op:?}: the fused fp16 output differs from rounding the f32 output");
            assert_eq!(c.separate_flag, past, "{op:?}: to_f16's flag, values past the range {past}");
            assert_eq!(c.fused_flag, c.separate_flag, "{op:?}: the fused kernel's range flag differs from to_f16's");
        }
    }
}

/// cuBLASLt's fp16 products where activations leave fp16's range: a checkpoint
/// whose MLP norm has one weight of 1e6 puts the gate|up input past 65,504 in a
/// 160-row pass; that pass must be redone on bf16 hi+lo parts (the operands the
/// backend reports change, the fp16 copy is freed) and its logits, and a decode
/// step's after it, match the tensor-core GEMM's on the same device weights (hi+lo
/// inputs too; the CPU reference multiplies the fixture's fp16 weights, which such a
/// norm weight makes ~1e-1 apart from their bf16 rounding), as the unchanged
/// checkpoint's do on fp16 operands. Without the fallback the logits are not
/// finite. Prints F16-RANGE lines; needs libcublasLt.so on the loader path.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn fp16_products_redo_a_pass_past_the_range_on_bf16_parts() {
    require_gpu();
    let path = fixture("tiny-qwen3");
    for big in [None, Some(1.0e6f32)] {
        let (spec, mut weights) = open_weights(&path);
        if let Some(v) = big {
            weights.layers[0].mlp_norm[5] = v;
        }
        let backend = |matmul, fuse| {
            let opts = GpuOptions { decode: DecodePath::Graph, matmul, fuse, ..GpuOptions::default() };
            backend_with(&spec, &weights, opts)
        };
        let (lt, tc) = (backend(MatmulPath::Cublas, true), backend(MatmulPath::Tensor, true));
        let ids = random_ids(11, 160, spec.vocab_size);
        let next = [random_ids(12, 1, spec.vocab_size)[0]];
        let before = lt.cublas_operands().unwrap();
        // Every position's logits of the 160-row pass, then one decode step's.
        let logits = |b: &CudaBackend| {
            let mut s = b.new_session(161).unwrap();
            let mut l = b.forward(&mut [Chunk { session: s.as_mut(), tokens: &ids }], Logits::All).unwrap();
            assert_eq!(s.len(), 160, "the pass advanced its sequence once");
            l.extend(b.forward(&mut [Chunk { session: s.as_mut(), tokens: &next }], Logits::Last).unwrap());
            l
        };
        let got = logits(&lt);
        let (after, copy) = (lt.cublas_operands().unwrap(), lt.f16_copy_bytes().unwrap());
        let want = logits(&tc);
        // Unfused, the norm, SiLU·mul and the prompt attention write f32 and to_f16 rounds
        // it: the same bits.
        let unfused = logits(&backend(MatmulPath::Cublas, false));
        let fused_differ = bits_differ(&got, &unfused);
        let rel = rel_l2(&got, &want);
        let step = rel_l2(&got[160 * spec.vocab_size..], &want[160 * spec.vocab_size..]);
        println!(
            "F16-RANGE mlp norm weight {big:?}: operands {before} -> {after} (fp16 copy {copy} bytes), logits rel L2 {rel:.3e} \
             (decode step after {step:.3e}) against the tensor-core GEMM (160 positions); {fused_differ} logits differ \
             between the fused and the separate fp16 rounding"
        );
        assert_eq!(fused_differ, 0, "mlp norm weight {big:?}: the fused fp16 operands changed the logits");
        assert_eq!(before, "fp16", "cuBLASLt without fp16 operands at load");
        assert!(got.iter().all(|v| v.is_finite()), "mlp norm weight {big:?}: non-finite logits");
        if big.is_some() {
            assert_eq!((after, copy), ("bf16 hi+lo", 0), "a pass past fp16's range kept the fp16 products");
        } else {
            assert_eq!(after, "fp16");
            assert!(copy > 0, "no fp16 copy after a pass with products on cuBLASLt");
        }
        // Both on 16-bit weights with f32 sums; fp16 inputs keep 11 bits, hi+lo ~16.
        assert!(rel <= 1e-2 && step <= 1e-2, "mlp norm weight {big:?}: rel L2 {rel}, decode step {step}, over the 1e-2 bar");
    }
}

/// The prompt attention's fp16 outputs where they leave fp16's range: tiny-qwen3
/// with its last layer's V projection scaled so that its largest weight is 60,000
/// (the fp16 copy of the weights still holds it) puts values past 65,504 into the
/// KV cache (bf16 holds them), and so into the attention's outputs, in a 160-row
/// pass of tiles alone on fp16 products, where the attention writes the
/// O-projection's fp16 operand itself. Its range flag must make the backend redo
/// the pass on bf16 (the operands it reports change, the fp16 copy is freed), and
/// the logits must match the tensor-core path's on the same weights. Without the
/// flag the fp16 operand is infinite and the logits not finite. Prints
/// F16-ATTN-RANGE; needs libcublasLt.so on the loader path.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn attention_outputs_past_the_fp16_range_redo_the_pass() {
    require_gpu();
    let (spec, mut weights) = open_weights(&fixture("tiny-qwen3"));
    let last = weights.layers.last_mut().unwrap();
    let values = last.v_proj.to_f32_vec();
    let largest = values.iter().fold(0f32, |m, w| m.max(w.abs()));
    let shape = last.v_proj.shape().to_vec();
    last.v_proj = Tensor::owned_f32(shape, values.iter().map(|w| w * (60_000.0 / largest)).collect());
    let backend = |matmul| {
        let opts = GpuOptions { decode: DecodePath::Graph, matmul, ..GpuOptions::default() };
        backend_with(&spec, &weights, opts)
    };
    let (auto, tc) = (backend(MatmulPath::Auto), backend(MatmulPath::Tensor));
    let ids = random_ids(13, 160, spec.vocab_size);
    let logits = |b: &CudaBackend| {
        let mut s = b.new_session(160).unwrap();
        b.forward(&mut [Chunk { session: s.as_mut(), tokens: &ids }], Logits::All).unwrap()
    };
    let before = auto.cublas_operands().unwrap();
    let got = logits(&auto);
    let after = auto.cublas_operands().unwrap();
    let want = logits(&tc);
    let rel = rel_l2(&got, &want);
    println!("F16-ATTN-RANGE tiny-qwen3, last layer's V weights up to 60,000: operands {before} -> {after}, logits rel L2 {rel:.3e} against the tensor-core path (160 positions)");
    assert_eq!(before, "fp16", "cuBLASLt without fp16 operands at load");
    assert!(got.iter().all(|v| v.is_finite()), "non-finite logits: the attention's fp16 outputs were kept");
    assert_eq!(after, "bf16 hi+lo", "a pass whose attention outputs left fp16's range kept the fp16 path");
    assert!(rel <= 1e-2, "rel L2 {rel} over the 1e-2 bar");
}

/// Prefix reuse on the GPU: a second prompt sharing whole blocks with a first
/// one copies their KV (one device-to-device copy) and must then give the same
/// greedy tokens, and the same first-token logprobs bit for bit, as the cache
/// off: on the graph path with the production matmul (cuBLASLt's products, whose
/// rounding depends on a first pass's rows below `PASS_SHARED_ROWS`: every first pass
/// has at least that many, and a reused prefix leaves at least `LATER_PASS_SHARED_ROWS`
/// to compute, in passes on the pick for `PASS_SHARED_ROWS` rows) and
/// with `DecodePath::Auto` (the megakernel where the checkpoint is a fuel's).
/// Prints PREFIX-REUSE lines.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn prefix_reuse_gives_the_same_output_on_the_graph_path_and_the_megakernel() {
    require_gpu();
    let rest = rocket_core::batch::LATER_PASS_SHARED_ROWS;
    for path in checkpoints() {
        let probe = load(&path, Device::Cpu);
        let (vocab, max_pos) = (probe.spec().vocab_size, probe.info().max_seq_len);
        drop(probe);
        // (block, first prompt, tokens in common, new tokens): a prompt diverging mid-block
        // (passes: the first prompt [0, 1200); the second [0, 1800) without reuse,
        // [1024, 1800) with it), a later pass of 202 rows against [0, 2250) in one, and a
        // chat's second turn at block 128 (passes [0, 2048), [2048, 4100) without reuse;
        // [3968, 4100) with it).
        for (block, first_len, common, new) in [(512, 1200, 1100, 700), (512, 2100, 2100, 150), (128, 4000, 4000, 100)] {
            if max_pos < common + new + 64 {
                println!("PREFIX-REUSE {}: block {block} skipped, context {max_pos}", path.display());
                continue;
            }
            let shared = common.min(common + new - rest) / block * block;
            let first = random_ids(31, first_len, vocab);
            let second: Vec<u32> = first[..common].iter().copied().chain(random_ids(32, new, vocab)).collect();
            let graph_auto = GpuOptions { decode: DecodePath::Graph, ..GpuOptions::default() };
            for options in [graph_auto, GpuOptions::default()] {
                let opts = |bytes| EngineOptions {
                    device: Device::Cuda,
                    progress: Progress::Off,
                    gpu: options.clone(),
                    prefix_block: block,
                    prefix_cache_bytes: bytes,
                    ..EngineOptions::default()
                };
                let cached = Engine::load(&path, opts(1 << 30)).unwrap();
                let plain = Engine::load(&path, opts(0)).unwrap();
                let greedy = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(64) };
                let path_name = cached.decode_path(1, &greedy);
                let at = format!("{} (decode {path_name}, block {block})", path.display());
                let run = |e: &Engine, ids: &[u32], p: &SamplingParams| e.generate_ids(String::new(), ids.to_vec(), p, &mut |_| true).unwrap();
                run(&cached, &first, &greedy);
                let got = run(&cached, &second, &greedy);
                assert_eq!(got.metrics.cached_prompt_tokens, shared, "{at}: reused tokens");
                assert_eq!(got.token_ids, run(&plain, &second, &greedy).token_ids, "{at}: greedy output differs with prefix reuse");
                // Logprobs come from host logits: the first token's row is the prefill's last.
                let lp = SamplingParams { logprobs: Some(5), ..SamplingParams::greedy(4) };
                let bits = |o: &rocket_core::RequestOutput| {
                    o.logprobs.as_ref().unwrap().iter().map(|t| (t.token_id, t.logprob.to_bits(), t.top.iter().map(|&(i, p)| (i, p.to_bits())).collect::<Vec<_>>())).collect::<Vec<_>>()
                };
                // The cache now holds the second prompt's own whole blocks too.
                let with = run(&cached, &second, &lp);
                assert_eq!(with.metrics.cached_prompt_tokens, (second.len() - rest) / block * block, "{at}: reused again");
                assert_eq!(bits(&with), bits(&run(&plain, &second, &lp)), "{at}: logprobs differ with prefix reuse");
                let s = cached.prefix_cache_stats();
                println!(
                    "PREFIX-REUSE {at}: {shared} of {} prompt tokens reused, then {} again, output identical; cache {s:?}",
                    second.len(),
                    with.metrics.cached_prompt_tokens
                );
            }
        }
    }
}

//! The persistent decode megakernel on a GPU (the tests load it themselves:
//! `mk_options`). Needs a GPU: the tests are ignored unless run with
//! `--include-ignored`. Checkpoints: every folder in
//! ROCKET_GPU_CHECKPOINTS whose shapes are a fuel's (exact-shape random
//! checkpoints from benches/make_checkpoint.py). Each test prints a line the GPU
//! run script collects (MK-...).
#![cfg(feature = "diagnostics")]

mod common;

use std::path::PathBuf;
use std::time::Instant;

use rocket_core::backend::cuda::{unavailable_reason, CudaBackend, SampledLoop};
use rocket_core::backend::{Backend, Chunk, Device, Logits};
use rocket_core::progress::LoadProgress;
use rocket_core::backend::SampleRequest;
use rocket_core::megakernel::{MegakernelError, Op, Profile, StallSite};
use rocket_core::sampling::TokenHistory;
use rocket_core::sampling::{argmax, logprobs};
use rocket_core::options::parse_watchdog_ms;
use rocket_core::{DecodePath, Engine, EngineOptions, EngineRequest, GpuOptions, MatmulPath, Progress, SamplingParams, TokenLogprob};

use common::{open_weights, random_ids, rel_l2};

/// Every test here carries `#[ignore]`: without a GPU `cargo test` reports them
/// ignored, never passed. Run with `--include-ignored` on the GPU machine, where
/// a missing device fails the test with the reason.
fn require_gpu() {
    if let Some(why) = unavailable_reason() {
        panic!("no usable CUDA device ({why}): these tests need one");
    }
}

/// The megakernel for batch-1 decode, sampled requests in its loop too, and the
/// GEMV for the graph path's side of every comparison: what the graph path
/// computes when it decodes one token at a time (its prefill of a whole prompt
/// would use the tensor cores, a different rounding the decode never sees).
/// ROCKET_WATCHDOG_MS lengthens the watchdog for runs under compute-sanitizer.
fn mk_options() -> GpuOptions {
    let mut o = GpuOptions { decode: DecodePath::Megakernel, matmul: MatmulPath::Gemv, loop_sampling: true, ..GpuOptions::default() };
    if let Ok(ms) = std::env::var("ROCKET_WATCHDOG_MS") {
        o.watchdog = parse_watchdog_ms("ROCKET_WATCHDOG_MS", &ms).unwrap();
    }
    o
}

fn checkpoints() -> Vec<PathBuf> {
    std::env::var("ROCKET_GPU_CHECKPOINTS")
        .map(|l| l.split(',').filter(|s| !s.is_empty()).map(PathBuf::from).collect())
        .unwrap_or_default()
}

struct Loaded {
    name: String,
    cpu: Engine,
    gpu: CudaBackend,
    vocab: usize,
}

/// Every fuel checkpoint: the CPU reference engine and a CUDA backend with its megakernel.
fn fuels() -> Vec<Loaded> {
    let mut out = Vec::new();
    for path in checkpoints() {
        let (spec, weights) = open_weights(&path);
        let gpu = CudaBackend::with_options(spec.clone(), &weights, &LoadProgress::new(Progress::Off), mk_options()).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if gpu.megakernel_fuel().unwrap().is_none() {
            panic!("{name}: decode megakernel loaded no megakernel");
        }
        let cpu = Engine::load(&path, EngineOptions { device: Device::Cpu, progress: Progress::Off, ..EngineOptions::default() }).unwrap();
        out.push(Loaded { name, cpu, gpu, vocab: spec.vocab_size });
    }
    assert!(!out.is_empty(), "ROCKET_GPU_CHECKPOINTS names no checkpoint");
    out
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn logits_match_the_cpu_reference_up_to_position_1024() {
    require_gpu();
    for f in fuels() {
        let len = 1024;
        let ids = random_ids(17, len, f.vocab);
        let t = Instant::now();
        let (tokens, logits) = f.gpu.megakernel_teacher_forced(&ids).unwrap().unwrap();
        let gpu_s = t.elapsed().as_secs_f64();
        assert_eq!(tokens.len(), len);
        assert!(logits.iter().all(|v| v.is_finite()), "{}: non-finite megakernel logits", f.name);
        let want = f.cpu.teacher_forced_logits(&ids).unwrap();
        let rel = rel_l2(&logits, &want);
        let worst = logits.chunks(f.vocab).zip(want.chunks(f.vocab)).map(|(a, b)| rel_l2(a, b)).fold(0.0, f64::max);
        let agree = tokens.iter().zip(want.chunks(f.vocab)).filter(|(t, w)| **t == argmax(w)).count();
        println!(
            "MK-PARITY {}: {len} positions, rel L2 {rel:.3e} (worst position {worst:.3e}), top-1 {agree}/{len}, {:.1} ms",
            f.name,
            gpu_s * 1e3
        );
        assert!(rel <= 1e-2 && worst <= 2e-2, "{}: rel L2 {rel} (worst {worst})", f.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn teacher_forced_top1_agrees_with_the_graph_path_and_is_bitwise_repeatable() {
    require_gpu();
    for f in fuels() {
        let (mut agree, mut total) = (0, 0);
        // ROCKET_MK_PROMPTS shortens the run under compute-sanitizer.
        let prompts = std::env::var("ROCKET_MK_PROMPTS").ok().and_then(|v| v.parse().ok()).unwrap_or(16u64);
        for prompt in 0..prompts {
            let ids = random_ids(1000 + prompt, 128, f.vocab);
            let (tokens, logits) = f.gpu.megakernel_teacher_forced(&ids).unwrap().unwrap();
            let mut session = f.gpu.new_session(ids.len()).unwrap();
            let graph = f.gpu.forward(&mut [Chunk { session: session.as_mut(), tokens: &ids }], Logits::All).unwrap();
            agree += tokens.iter().zip(graph.chunks(f.vocab)).filter(|(t, g)| **t == argmax(g)).count();
            total += ids.len();
            if prompt == 0 {
                let (again_tokens, again) = f.gpu.megakernel_teacher_forced(&ids).unwrap().unwrap();
                assert_eq!(again_tokens, tokens, "{}: argmax changed between runs", f.name);
                assert!(again.iter().zip(&logits).all(|(a, b)| a.to_bits() == b.to_bits()), "{}: logits not bitwise repeatable", f.name);
            }
        }
        let pct = 100.0 * agree as f64 / total as f64;
        println!("MK-AGREE {}: top-1 {agree}/{total} ({pct:.2}%) with the CUDA-graph path", f.name);
        assert!(pct >= 99.5, "{}: top-1 agreement {pct:.2}%", f.name);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn greedy_generation_runs_on_the_device_loop_and_stops_where_asked() {
    require_gpu();
    for path in checkpoints() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let options = EngineOptions { device: Device::Cuda, progress: Progress::Off, gpu: mk_options(), ..EngineOptions::default() };
        let e = Engine::load(&path, options).unwrap();
        assert_eq!(e.decode_path(1, &SamplingParams::greedy(1)), "megakernel", "{name}");
        let vocab = e.spec().vocab_size;
        let prompt = random_ids(5, 40, vocab);
        let p = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(300) }; // spans several launches
        let runs: Vec<Vec<u32>> = (0..3).map(|_| e.generate_ids(String::new(), prompt.clone(), &p, &mut |_| true).unwrap().token_ids).collect();
        assert!(runs.iter().all(|r| r == &runs[0] && r.len() == 300), "{name}: greedy output differs between runs");
        // The batched (CUDA-graph) path on the same prompt: report how long they agree.
        let pair = e.generate_many(vec![EngineRequest { prompt: String::new(), prompt_ids: prompt.clone(), params: p.clone() }; 2]).unwrap();
        let same = pair[0].token_ids.iter().zip(&runs[0]).take_while(|(a, b)| a == b).count();
        println!("MK-GREEDY {name}: 3 runs identical; first {same}/300 tokens equal to the CUDA-graph path");
        // A stop id ends the loop on the device at its first occurrence; min_tokens masks it.
        let end = runs[0][7];
        let first = runs[0].iter().position(|&t| t == end).unwrap();
        let stop = SamplingParams { stop_token_ids: vec![end], ..p.clone() };
        let out = e.generate_ids(String::new(), prompt.clone(), &stop, &mut |_| true).unwrap();
        assert_eq!(out.token_ids, runs[0][..=first], "{name}: stop id");
        let masked = SamplingParams { min_tokens: first + 3, ..stop };
        let out = e.generate_ids(String::new(), prompt.clone(), &masked, &mut |_| true).unwrap();
        assert!(!out.token_ids[..first + 3].contains(&end), "{name}: min_tokens did not mask the stop id");
        // The host's stop flag: a sink that stops after 5 tokens.
        let mut n = 0;
        let out = e.generate_ids(String::new(), prompt.clone(), &p, &mut |_| {
            n += 1;
            n < 5
        });
        assert_eq!(out.unwrap().token_ids, runs[0][..5], "{name}: cancellation");
        // And the session continues correctly after a cancelled loop.
        let again = e.generate_ids(String::new(), prompt, &p, &mut |_| true).unwrap();
        assert_eq!(again.token_ids, runs[0], "{name}: output after a cancelled loop");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn the_watchdog_turns_a_stall_into_an_error() {
    require_gpu();
    let f = fuels().remove(0);
    let t = Instant::now();
    let err = f.gpu.megakernel_watchdog_probe().unwrap().unwrap();
    let secs = t.elapsed().as_secs_f64();
    println!("MK-WATCHDOG {}: {err} ({secs:.2} s)", f.name);
    // The probe's impossible wait is on the last layer's Mlp instructions.
    let MegakernelError::Watchdog { site: StallSite::Instr { instr, .. }, .. } = &err else { panic!("not the watchdog's report: {err}") };
    assert_eq!(instr.op, Op::Mlp, "{err}");
    assert!(secs < 10.0);
    // The device and the megakernel still work afterwards.
    let ids = random_ids(3, 16, f.vocab);
    let (tokens, _) = f.gpu.megakernel_teacher_forced(&ids).unwrap().unwrap();
    assert_eq!(tokens.len(), 16);
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn a_traced_step_shows_where_the_time_goes() {
    require_gpu();
    for f in fuels() {
        let ids = random_ids(55, 128, f.vocab);
        let t = Instant::now();
        f.gpu.megakernel_teacher_forced(&ids).unwrap().unwrap();
        let wall_us = t.elapsed().as_secs_f64() * 1e6 / ids.len() as f64;
        // Step 100: warm, and well inside the launch.
        let profile = f.gpu.megakernel_profile(&ids, 100, None).unwrap().unwrap();
        for line in profile.to_string().lines() {
            println!("MK-PROFILE {}: {line}", f.name);
        }
        println!("MK-PROFILE {}: untraced launch {wall_us:.1} µs per step (wall, with logits copies)", f.name);
        assert!(profile.step_us > 0.0 && profile.step_us < 20.0 * wall_us, "{}: traced step {} µs", f.name, profile.step_us);
        // The same step sampled: its LM head phase holds the SMs' sampler parts and the
        // merge, so its length against greedy's is what sampling costs per token.
        let history = TokenHistory::new(&ids[..1]);
        for (label, params) in [
            ("top-k 20 + top-p 0.95", SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..SamplingParams::default() }),
            ("top-p 0.9", SamplingParams { temperature: 0.6, top_p: 0.9, ..SamplingParams::default() }),
        ] {
            let request = SampleRequest { params: &params, seed: 7, step: 0, history: &history, end_ids: &[] };
            let sampled = f.gpu.megakernel_profile(&ids, 100, Some(&request)).unwrap().unwrap();
            // From the last layer's end to the last LM-head instruction done (the token picked).
            let lm = |p: &Profile| p.lm_head.as_ref().map_or(f64::NAN, |ph| ph.done_us.2 - ph.ready_us);
            let inside = sampled.lm_head_inside.as_ref().expect("a traced LM head stamps its inside");
            let (tiles, parts) = (inside.tiles_done_us, inside.parts_done_us);
            println!(
                "MK-PROFILE-SAMPLED {} {label}: step {:.1} µs (greedy {:.1}), LM head phase {:.1} µs (greedy {:.1}); \
                 tiles done (mean / last) {:.1} / {:.1}, parts done {:.1} / {:.1}, token picked {:.1}",
                f.name,
                sampled.step_us,
                profile.step_us,
                lm(&sampled),
                lm(&profile),
                tiles.1,
                tiles.2,
                parts.1,
                parts.2,
                inside.picked_us
            );
            assert!(tiles.2 <= parts.2 + 1e-3 && parts.2 <= inside.picked_us + 1e-3, "{} {label}: {inside:?}", f.name);
            // The merge's phases, each as µs after the last SM's part.
            let phases: Vec<String> = inside.merge_us.iter().map(|m| format!("{:.1}", m - parts.2)).collect();
            println!("MK-PROFILE-MERGE {} {label}: phases end (µs after the last part) {}", f.name, phases.join(" / "));
            assert!(!inside.merge_us.is_empty(), "{} {label}: the merge stamped no phase", f.name);
            // The SMs' parts' phases, each as µs after the last SM's tiles (mean / last SM).
            let parts_at: Vec<String> = inside.part_phases_us.iter().map(|p| format!("{:.1} / {:.1}", p.1 - tiles.2, p.2 - tiles.2)).collect();
            println!("MK-PROFILE-PARTS {} {label}: phases end (µs after the last SM's tiles; mean / last SM) {}", f.name, parts_at.join(", "));
            assert_eq!(inside.part_phases_us.len(), 4, "{} {label}: the SMs' parts stamp four phases", f.name);
            assert!(sampled.step_us > 0.0 && sampled.step_us < 20.0 * wall_us, "{} {label}: traced step {} µs", f.name, sampled.step_us);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn sampled_loops_pick_the_host_samplers_tokens() {
    require_gpu();
    let settings = [
        SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.95, ..SamplingParams::default() }, // Qwen3's defaults
        SamplingParams { temperature: 1.0, ..SamplingParams::default() }, // the race over all SMs
        SamplingParams { temperature: 0.8, repetition_penalty: 1.1, presence_penalty: 0.4, ..SamplingParams::default() }, // raced, penalised
        SamplingParams { temperature: 0.7, top_p: 0.9, ..SamplingParams::default() }, // Llama-3.2-Instruct's defaults
        SamplingParams { temperature: 0.6, top_p: 0.95, min_p: 0.1, frequency_penalty: 0.5, ..SamplingParams::default() },
        SamplingParams { temperature: 0.05, top_p: 0.5, ..SamplingParams::default() }, // scaled logits far from 0
        SamplingParams { temperature: 1.3, min_p: 0.05, repetition_penalty: 1.3, presence_penalty: 0.5, frequency_penalty: 0.3, ..SamplingParams::default() },
        SamplingParams { temperature: 0.0, repetition_penalty: 1.5, ..SamplingParams::default() }, // greedy with a penalty
        // Mid-request: earlier generations count for the penalties, min_tokens masks the
        // end ids (the greedy choices of an unmasked run), which end the loop afterwards.
        SamplingParams { temperature: 0.0, min_tokens: 12, frequency_penalty: 0.2, ..SamplingParams::default() },
        // Top-k over all SMs (k <= 64): each SM lists its k best, the last one merges.
        SamplingParams { temperature: 0.8, top_k: 1, ..SamplingParams::default() },
        SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..SamplingParams::default() }, // Qwen3's defaults
        SamplingParams { temperature: 1.0, top_k: 64, min_p: 0.02, repetition_penalty: 1.2, presence_penalty: 0.3, ..SamplingParams::default() },
        SamplingParams { temperature: 0.05, top_k: 7, top_p: 0.5, ..SamplingParams::default() }, // scaled logits far from 0
        SamplingParams { temperature: 0.7, top_k: 33, min_tokens: 12, frequency_penalty: 0.4, ..SamplingParams::default() }, // masked end ids
        // A larger top-k: one CTA over the row (sample_token), in the loop only with loop_sampling.
        SamplingParams { temperature: 0.7, top_k: 65, top_p: 0.9, ..SamplingParams::default() },
        SamplingParams { temperature: 1.0, top_k: 1000, ..SamplingParams::default() },
    ];
    for f in fuels() {
        let (mut sampled, mut topk, steps) = (0, 0, 48);
        for (n, params) in settings.iter().enumerate() {
            let prompt = random_ids(700 + n as u64, 24, f.vocab);
            let seed = 77 + n as u64;
            let mut start = TokenHistory::new(&prompt);
            let (mut step, mut end_ids) = (0, Vec::new());
            if params.min_tokens > 0 {
                let earlier = random_ids(900, 5, f.vocab);
                earlier.iter().for_each(|&t| start.push(t));
                step = earlier.len() as u64;
                let probe = SampleRequest { params, seed, step, history: &start, end_ids: &[] };
                let free = f.gpu.megakernel_sampled(&prompt, &probe, 16).unwrap().unwrap().tokens;
                end_ids = vec![free[2], free[9], f.vocab as u32 + 7]; // one id past the vocabulary, ignored
            }
            let req = SampleRequest { params, seed, step, history: &start, end_ids: &end_ids };
            let SampledLoop { tokens, logits, one_cta_steps: one_cta, .. } = f.gpu.megakernel_sampled(&prompt, &req, steps).unwrap().unwrap();
            // Which path decided: the SMs together for all but a top-k above 64, whose every
            // step (the prompt's forced ones too) the one-CTA sampler picks.
            let launch_steps = prompt.len() - 1 + tokens.len();
            let want_one_cta = if params.races_on_all_sms(f.vocab) { 0 } else { launch_steps };
            assert_eq!(one_cta, want_one_cta, "{} setting {n} ({params:?}): steps the one-CTA sampler picked", f.name);
            if params.top_k > 0 && params.top_k <= 64 {
                topk += tokens.len();
            }
            // The host sampler on the kernel's own logits, with the history the kernel kept.
            let mut history = start.clone();
            for (j, (&got, row)) in tokens.iter().zip(logits.chunks(f.vocab)).enumerate() {
                let want = SampleRequest { params, seed, step: step + j as u64, history: &history, end_ids: &end_ids }.sample_on_host(row);
                assert_eq!(got, want, "{} setting {n} step {j}: device {got}, host {want}", f.name);
                history.push(got);
            }
            // It ran to the end, or stopped at the first end id it could pick.
            let stop = tokens.iter().position(|t| end_ids.contains(t));
            assert_eq!(tokens.len(), stop.map_or(steps, |i| i + 1), "{} setting {n}: stopped at the wrong step", f.name);
            if let Some(i) = stop {
                assert!(start.generated_len() + i >= params.min_tokens, "{} setting {n}: an end id inside min_tokens", f.name);
            }
            sampled += tokens.len();
        }
        println!("MK-SAMPLED {}: {sampled} tokens sampled in the kernel ({topk} by the all-SM top-k), each the host sampler's choice", f.name);
    }
}

/// The kernel's logprob record for a step against `sampling::logprobs` of the
/// step's raw logits: the same ids in the same order, each value within one
/// f32 ulp or what the f64 sums' roundings can move log Z (the kernel sums exp
/// per SM share, the host in vocabulary order, dropping up to half an ulp of
/// its running total at each of V terms: near 0 that is many f32 ulps of the
/// logprob; megakernel/logprob_model.rs). Returns how many values were bitwise
/// equal, how many were compared and the largest difference.
fn check_logprobs(got: &TokenLogprob, row: &[f32], token: u32, n: usize, what: &str) -> (usize, usize, f32) {
    let (want_lp, want_top) = logprobs(row, token, n);
    assert_eq!(got.token_id, token, "{what}: the record's token");
    let got_ids: Vec<u32> = got.top.iter().map(|&(id, _)| id).collect();
    let want_ids: Vec<u32> = want_top.iter().map(|&(id, _)| id).collect();
    assert_eq!(got_ids, want_ids, "{what}: the {n} most likely tokens");
    let pairs = std::iter::once((got.logprob, want_lp)).chain(got.top.iter().zip(&want_top).map(|(g, w)| (g.1, w.1)));
    let (mut equal, mut total, mut worst) = (0, 0, 0.0f32);
    // log Z from the host's side: the token's logit minus its logprob.
    let log_z = (row[token as usize] as f64 - want_lp as f64).abs();
    let sums = ((8.0 * log_z + row.len() as f64) * f64::EPSILON) as f32;
    for (g, w) in pairs {
        let ulp = (f32::from_bits(w.abs().to_bits() + 1) - w.abs()).max(sums);
        assert!(g == w || (g - w).abs() <= ulp, "{what}: logprob {g} against the host's {w} (more than {ulp:e} apart)");
        equal += (g.to_bits() == w.to_bits()) as usize;
        total += 1;
        if g != w {
            worst = worst.max((g - w).abs());
        }
    }
    (equal, total, worst)
}

/// Logprobs in the token loop (every SM's part, the host link warp's merge) against
/// the host's on the kernel's own raw logits, in every sampling mode, with
/// 0 to 20 alternatives: greedy (with and without masked end ids), the race,
/// top-p and min-p bins with penalties (the record must come from the raw
/// logits, not the penalised ones), the all-SM top-k and the one-CTA sampler.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn logprobs_in_the_loop_are_the_hosts() {
    require_gpu();
    let settings = [
        SamplingParams { temperature: 0.0, logprobs: Some(5), ..SamplingParams::default() },
        SamplingParams { temperature: 0.0, logprobs: Some(0), ..SamplingParams::default() },
        SamplingParams { temperature: 0.0, logprobs: Some(20), min_tokens: 12, ..SamplingParams::default() },
        SamplingParams { temperature: 0.0, logprobs: Some(1), repetition_penalty: 1.5, ..SamplingParams::default() },
        SamplingParams { temperature: 1.0, logprobs: Some(3), ..SamplingParams::default() },
        SamplingParams { temperature: 0.7, top_p: 0.9, logprobs: Some(8), ..SamplingParams::default() },
        SamplingParams { temperature: 0.8, min_p: 0.05, repetition_penalty: 1.1, logprobs: Some(5), ..SamplingParams::default() },
        SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, logprobs: Some(20), ..SamplingParams::default() },
        SamplingParams { temperature: 1.0, top_k: 1000, frequency_penalty: 0.5, logprobs: Some(4), ..SamplingParams::default() },
    ];
    for f in fuels() {
        let (mut equal, mut total, mut worst, mut steps_checked) = (0, 0, 0.0f32, 0);
        for (n, params) in settings.iter().enumerate() {
            let prompt = random_ids(1300 + n as u64, 24, f.vocab);
            let start = TokenHistory::new(&prompt);
            let end_ids = if params.min_tokens > 0 { vec![0, 1, 2] } else { Vec::new() };
            let req = SampleRequest { params, seed: 41 + n as u64, step: 0, history: &start, end_ids: &end_ids };
            let run = f.gpu.megakernel_sampled(&prompt, &req, 40).unwrap().unwrap();
            assert_eq!(run.logprobs.len(), run.tokens.len(), "{} setting {n}: a record per token", f.name);
            let mut history = start.clone();
            for (j, ((&token, lp), row)) in run.tokens.iter().zip(&run.logprobs).zip(run.logits.chunks(f.vocab)).enumerate() {
                let want = SampleRequest { params, seed: 41 + n as u64, step: j as u64, history: &history, end_ids: &end_ids }.sample_on_host(row);
                assert_eq!(token, want, "{} setting {n} step {j}: the token", f.name);
                let lp = lp.as_ref().unwrap_or_else(|| panic!("{} setting {n} step {j}: no logprobs", f.name));
                let (e, t, w) = check_logprobs(lp, row, token, params.logprobs.unwrap(), &format!("{} setting {n} ({params:?}) step {j}", f.name));
                (equal, total, worst) = (equal + e, total + t, worst.max(w));
                history.push(token);
                steps_checked += 1;
            }
        }
        println!("MK-LOGPROBS {}: {steps_checked} steps in {} settings, ids the host's; {equal}/{total} values bitwise equal, largest difference {worst:.2e}", f.name, settings.len());
    }
}

/// A few steps of each kind of megakernel launch, short enough for
/// compute-sanitizer (gpu_run.sh's `sanitize` step runs it under memcheck on
/// every fuel's instantiation, and under racecheck): teacher-forced positions,
/// then a sampled loop in each of the kernel's sampling modes (argmax with
/// penalties, the untruncated race, the binned race for top-p and min-p, the
/// SMs' top-k lists and their merge, and the one-CTA sampler for a top-k above
/// 64). Each token is checked against the host
/// sampler on the kernel's own logits, so a run under a sanitizer is also a
/// run that computes the right thing.
#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn short_launches_of_every_mode_for_the_sanitizers() {
    require_gpu();
    let modes = [
        ("argmax+penalty", SamplingParams { temperature: 0.0, repetition_penalty: 1.3, ..SamplingParams::default() }),
        ("race", SamplingParams { temperature: 1.0, ..SamplingParams::default() }),
        ("bins top-p", SamplingParams { temperature: 0.7, top_p: 0.9, ..SamplingParams::default() }),
        ("bins min-p", SamplingParams { temperature: 0.8, min_p: 0.05, frequency_penalty: 0.3, ..SamplingParams::default() }),
        ("top-k", SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..SamplingParams::default() }),
        ("one-CTA top-k", SamplingParams { temperature: 0.6, top_k: 100, top_p: 0.95, ..SamplingParams::default() }),
        ("logprobs", SamplingParams { temperature: 0.0, logprobs: Some(5), ..SamplingParams::default() }),
    ];
    let steps = 3;
    for f in fuels() {
        let ids = random_ids(31, 6, f.vocab);
        let (tokens, logits) = f.gpu.megakernel_teacher_forced(&ids).unwrap().unwrap();
        assert_eq!(tokens.len(), ids.len(), "{}: teacher-forced positions", f.name);
        assert!(logits.iter().all(|v| v.is_finite()), "{}: non-finite teacher-forced logits", f.name);
        for (n, (mode, params)) in modes.iter().enumerate() {
            let prompt = random_ids(40 + n as u64, 5, f.vocab);
            let start = TokenHistory::new(&prompt);
            let req = SampleRequest { params, seed: 5 + n as u64, step: 0, history: &start, end_ids: &[] };
            let SampledLoop { tokens, logits, one_cta_steps: one_cta, logprobs } = f.gpu.megakernel_sampled(&prompt, &req, steps).unwrap().unwrap();
            assert_eq!(tokens.len(), steps, "{} {mode}: steps", f.name);
            if let Some(n) = params.logprobs {
                for (j, (lp, row)) in logprobs.iter().zip(logits.chunks(f.vocab)).enumerate() {
                    check_logprobs(lp.as_ref().expect("logprobs asked for"), row, tokens[j], n, &format!("{} {mode} step {j}", f.name));
                }
            }
            let want_one_cta = if params.races_on_all_sms(f.vocab) { 0 } else { prompt.len() - 1 + steps };
            assert_eq!(one_cta, want_one_cta, "{} {mode}: steps the one-CTA sampler picked", f.name);
            let mut history = start.clone();
            for (j, (&got, row)) in tokens.iter().zip(logits.chunks(f.vocab)).enumerate() {
                let want = SampleRequest { params, seed: 5 + n as u64, step: j as u64, history: &history, end_ids: &[] }.sample_on_host(row);
                assert_eq!(got, want, "{} {mode} step {j}: device {got}, host {want}", f.name);
                history.push(got);
            }
        }
        println!("MK-SHORT {}: {} teacher-forced positions and {} sampling modes x {steps} steps, every token the host's", f.name, ids.len(), modes.len());
    }
}

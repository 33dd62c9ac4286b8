//! The megakernel's schedule, run by its CPU twin (one thread per virtual SM,
//! the kernel's counters and instruction order), against the CPU reference
//! backend on the same random weights: teacher-forced logits, free-running
//! greedy tokens, stopping, min_tokens masking, and the watchdog.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use rocket_core::backend::cpu::CpuBackend;
use rocket_core::backend::{Backend, Chunk, Logits};
use rocket_core::megakernel::twin::{Twin, TwinKv, TwinOutput, TwinRequest};
use rocket_core::megakernel::{Op, Schedule};
use rocket_core::model::{Family, Llama3RopeScaling, ModelSpec, ModelWeights};
use rocket_core::sampling::argmax;
use rocket_core::weights::{Tensor, Weights};

use common::rel_l2;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    /// Uniform in [-a, a).
    fn uniform(&mut self, a: f32) -> f32 {
        (self.next() as f32 / (1u64 << 31) as f32 * 2.0 - 1.0) * a
    }
}

#[allow(clippy::too_many_arguments)]
fn spec(family: Family, d: usize, ff: usize, layers: usize, heads: usize, kv: usize, hd: usize, vocab: usize) -> ModelSpec {
    let llama = family == Family::Llama;
    ModelSpec {
        family,
        hidden_size: d,
        intermediate_size: ff,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: hd,
        vocab_size: vocab,
        max_position_embeddings: 512,
        rms_norm_eps: 1e-5,
        rope_theta: if llama { 500000.0 } else { 1e6 },
        rope_scaling: llama.then_some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        }),
        rope_freq_factors: None,
        tie_word_embeddings: !llama,
        qk_norm: !llama,
    }
}

/// Random bf16 matrices and f32 norms near 1, seeded.
fn random_weights(s: &ModelSpec, seed: u64) -> ModelWeights {
    let mut rng = Rng(seed);
    let mut w = Weights::new("random".into());
    let mut matrix = |w: &mut Weights, name: String, rows: usize, cols: usize, scale: f32| {
        let data = (0..rows * cols).map(|_| bf16::from_f32(rng.uniform(scale)).to_bits()).collect();
        w.insert(name, Tensor::owned_bf16(vec![rows, cols], data));
    };
    let (d, ff, qd, kvd) = (s.hidden_size, s.intermediate_size, s.q_dim(), s.kv_dim());
    matrix(&mut w, "model.embed_tokens.weight".into(), s.vocab_size, d, 1.0);
    if !s.tie_word_embeddings {
        matrix(&mut w, "lm_head.weight".into(), s.vocab_size, d, 0.1);
    }
    for l in 0..s.num_layers {
        let p = format!("model.layers.{l}");
        let sc = |k: usize| 1.5 / (k as f32).sqrt();
        matrix(&mut w, format!("{p}.self_attn.q_proj.weight"), qd, d, sc(d));
        matrix(&mut w, format!("{p}.self_attn.k_proj.weight"), kvd, d, sc(d));
        matrix(&mut w, format!("{p}.self_attn.v_proj.weight"), kvd, d, sc(d));
        matrix(&mut w, format!("{p}.self_attn.o_proj.weight"), d, qd, sc(qd));
        matrix(&mut w, format!("{p}.mlp.gate_proj.weight"), ff, d, sc(d));
        matrix(&mut w, format!("{p}.mlp.up_proj.weight"), ff, d, sc(d));
        matrix(&mut w, format!("{p}.mlp.down_proj.weight"), d, ff, sc(ff));
    }
    let mut rng = Rng(seed ^ 0xabcdef);
    let mut norm = |w: &mut Weights, name: String, n: usize| {
        let v: Vec<f32> = (0..n).map(|_| 1.0 + rng.uniform(0.2)).collect();
        w.insert(name, Tensor::owned_f32(vec![n], v));
    };
    for l in 0..s.num_layers {
        let p = format!("model.layers.{l}");
        norm(&mut w, format!("{p}.input_layernorm.weight"), d);
        norm(&mut w, format!("{p}.post_attention_layernorm.weight"), d);
        if s.qk_norm {
            norm(&mut w, format!("{p}.self_attn.q_norm.weight"), s.head_dim);
            norm(&mut w, format!("{p}.self_attn.k_norm.weight"), s.head_dim);
        }
    }
    norm(&mut w, "model.norm.weight".into(), d);
    ModelWeights::from_weights(s, w).unwrap()
}

/// Shapes that exercise every ring geometry the fuels use: rows split into
/// segments (k = 1536, 2048), whole rows per warp (k = 576), several query heads
/// per KV head (3 and 4), q/k-norm, llama3 RoPE, untied and tied heads.
fn models() -> Vec<(&'static str, ModelSpec)> {
    vec![
        ("llama-like", spec(Family::Llama, 256, 2048, 3, 8, 2, 32, 700)),
        ("qwen3-like", spec(Family::Qwen3, 192, 1536, 2, 6, 2, 64, 500)),
        ("smollm2-like", spec(Family::Llama, 576, 1536, 2, 9, 3, 64, 400)),
    ]
}

fn ids(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut r = Rng(seed);
    (0..n).map(|_| (r.next() % vocab as u64) as u32).collect()
}

fn run(twin: &Twin<'_>, capacity: usize, req: &TwinRequest<'_>) -> TwinOutput {
    twin.run(&TwinKv::new(twin.spec(), capacity), req, &|_, _| true).unwrap()
}

#[test]
fn teacher_forced_logits_match_the_reference_on_every_sm_count() {
    for (name, spec) in models() {
        let weights = Arc::new(random_weights(&spec, 11));
        let cpu = CpuBackend::new(spec.clone(), weights.clone());
        let seq = ids(5, 24, spec.vocab_size);
        let mut session = cpu.new_session(seq.len()).unwrap();
        let want = cpu.forward(&mut [Chunk { session: session.as_mut(), tokens: &seq }], Logits::All).unwrap();
        for sms in [1, 3, 8, 13] {
            let twin = Twin::new(&spec, &weights, sms).unwrap();
            let req = TwinRequest { pos0: 0, first_token: seq[0], max_steps: seq.len(), forced: &seq[1..], end_ids: &[], mask_end_steps: 0 };
            let got = run(&twin, seq.len(), &req);
            assert_eq!(got.tokens.len(), seq.len(), "{name}: every forced step runs");
            let v = spec.vocab_size;
            for (t, (g, w)) in got.logits.chunks(v).zip(want.chunks(v)).enumerate() {
                let err = rel_l2(g, w);
                assert!(err < 1e-5, "{name} on {sms} SMs, position {t}: rel. L2 {err:.2e}");
                assert_eq!(got.tokens[t], argmax(w), "{name} on {sms} SMs, position {t}: top-1");
            }
        }
    }
}

/// Greedy tokens from the reference: prefill `prompt`, then `n` decode steps.
fn reference_greedy(cpu: &CpuBackend, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut session = cpu.new_session(prompt.len() + n).unwrap();
    let mut out = Vec::new();
    let mut tokens = prompt.to_vec();
    while out.len() < n {
        let logits = cpu.forward(&mut [Chunk { session: session.as_mut(), tokens: &tokens }], Logits::Last).unwrap();
        let t = argmax(&logits);
        out.push(t);
        tokens = vec![t];
    }
    out
}

#[test]
fn free_running_greedy_equals_the_reference_and_stops_where_asked() {
    let (name, spec) = models().remove(2);
    let weights = Arc::new(random_weights(&spec, 3));
    let cpu = CpuBackend::new(spec.clone(), weights.clone());
    let prompt = ids(9, 6, spec.vocab_size);
    let gen = 10;
    let want = reference_greedy(&cpu, &prompt, gen);
    let twin = Twin::new(&spec, &weights, 7).unwrap();
    // The prompt is teacher-forced through the loop; after it, argmaxes are fed back.
    let steps = prompt.len() - 1 + gen;
    let req = TwinRequest { pos0: 0, first_token: prompt[0], max_steps: steps, forced: &prompt[1..], end_ids: &[], mask_end_steps: 0 };
    let got = run(&twin, steps, &req);
    assert_eq!(got.tokens[prompt.len() - 1..], want[..], "{name}: greedy continuation");

    // An end id stops the free-running loop at its first occurrence...
    let end = want[4];
    let first = want.iter().position(|&t| t == end).unwrap();
    let stop_req = TwinRequest { end_ids: &[end], ..req };
    let stopped = run(&twin, steps, &stop_req);
    assert_eq!(stopped.tokens[prompt.len() - 1..], want[..=first]);
    // ...unless min_tokens masks it for those steps: then a different token is picked there.
    let masked_req = TwinRequest { end_ids: &[end], mask_end_steps: prompt.len() - 1 + first + 1, ..req };
    let masked = run(&twin, steps, &masked_req);
    let at = prompt.len() - 1 + first;
    assert_ne!(masked.tokens[at], end);
    assert_eq!(masked.tokens[..at], stopped.tokens[..at]);

    // The host's stop flag: on_token returning false ends the loop after that step.
    let seen = AtomicUsize::new(0);
    let short = twin
        .run(&TwinKv::new(&spec, steps), &req, &|step, _| {
            seen.fetch_add(1, Ordering::Relaxed);
            step < 3
        })
        .unwrap();
    assert_eq!(short.tokens.len(), 4);
    assert_eq!(seen.load(Ordering::Relaxed), 4);
}

#[test]
fn a_later_launch_continues_from_the_cache_of_an_earlier_one() {
    let (_, spec) = models().remove(1);
    let weights = random_weights(&spec, 21);
    let twin = Twin::new(&spec, &weights, 5).unwrap();
    let seq = ids(2, 16, spec.vocab_size);
    let whole = run(&twin, 16, &TwinRequest { pos0: 0, first_token: seq[0], max_steps: 16, forced: &seq[1..], end_ids: &[], mask_end_steps: 0 });
    let kv = TwinKv::new(&spec, 16);
    let none = |_: usize, _: u32| true;
    let a = twin.run(&kv, &TwinRequest { pos0: 0, first_token: seq[0], max_steps: 9, forced: &seq[1..9], end_ids: &[], mask_end_steps: 0 }, &none).unwrap();
    let b = twin.run(&kv, &TwinRequest { pos0: 9, first_token: seq[9], max_steps: 7, forced: &seq[10..], end_ids: &[], mask_end_steps: 0 }, &none).unwrap();
    let v = spec.vocab_size;
    assert_eq!([a.logits, b.logits].concat(), whole.logits[..16 * v].to_vec());
}

#[test]
fn a_schedule_that_waits_for_too_much_is_stopped_by_the_watchdog() {
    let (_, spec) = models().remove(0);
    let weights = random_weights(&spec, 1);
    let mut schedule = Schedule::compile(&spec, 4).unwrap();
    for i in schedule.per_sm.iter_mut().flatten().filter(|i| i.op == Op::Mlp && i.layer == 1) {
        i.wait.per_step += 1;
    }
    let mut twin = Twin::with_schedule(&spec, &weights, schedule);
    twin.watchdog = Duration::from_millis(300);
    let req = TwinRequest { pos0: 0, first_token: 1, max_steps: 2, forced: &[], end_ids: &[], mask_end_steps: 0 };
    let start = std::time::Instant::now();
    let err = twin.run(&TwinKv::new(&spec, 2), &req, &|_, _| true).unwrap_err().to_string();
    assert!(err.contains("stuck at Mlp of layer 1 of step 0"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn bad_requests_are_refused() {
    let (_, spec) = models().remove(0);
    let weights = random_weights(&spec, 1);
    let twin = Twin::new(&spec, &weights, 2).unwrap();
    let kv = TwinKv::new(&spec, 4);
    let ok = |_: usize, _: u32| true;
    let base = TwinRequest { pos0: 0, first_token: 1, max_steps: 4, forced: &[], end_ids: &[], mask_end_steps: 0 };
    assert!(twin.run(&kv, &TwinRequest { max_steps: 5, ..base }, &ok).is_err());
    assert!(twin.run(&kv, &TwinRequest { max_steps: 0, ..base }, &ok).is_err());
    assert!(twin.run(&kv, &TwinRequest { first_token: 700, ..base }, &ok).is_err());
}

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
use rocket_core::megakernel::twin::{Join, Twin, TwinAdmission, TwinHost, TwinKv, TwinOutput, TwinRequest};
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

/// The end-id tests' case: a prompt teacher-forced through the loop, then 10
/// greedy tokens (the reference's in `want`), and an end id the continuation
/// reaches (want[4], first at `first`).
struct EndIdCase {
    name: &'static str,
    spec: ModelSpec,
    weights: Arc<ModelWeights>,
    prompt: Vec<u32>,
    want: Vec<u32>,
    end: u32,
    first: usize,
}

impl EndIdCase {
    fn new() -> Self {
        let (name, spec) = models().remove(2);
        let weights = Arc::new(random_weights(&spec, 3));
        let cpu = CpuBackend::new(spec.clone(), weights.clone());
        let prompt = ids(9, 6, spec.vocab_size);
        let want = reference_greedy(&cpu, &prompt, 10);
        let end = want[4];
        let first = want.iter().position(|&t| t == end).unwrap();
        EndIdCase { name, spec, weights, prompt, want, end, first }
    }

    /// The prompt's steps after its first token, then the generated ones.
    fn steps(&self) -> usize {
        self.prompt.len() - 1 + self.want.len()
    }

    /// The whole run with no end ids.
    fn request(&self) -> TwinRequest<'_> {
        TwinRequest { pos0: 0, first_token: self.prompt[0], max_steps: self.steps(), forced: &self.prompt[1..], end_ids: &[], mask_end_steps: 0 }
    }
}

#[test]
fn free_running_greedy_equals_the_reference_and_stops_where_asked() {
    let case = EndIdCase::new();
    let EndIdCase { name, spec, weights, prompt, want, end, first } = &case;
    let (end, first) = (*end, *first);
    let twin = Twin::new(spec, weights, 7).unwrap();
    // The prompt is teacher-forced through the loop; after it, argmaxes are fed back.
    let (steps, req) = (case.steps(), case.request());
    let got = run(&twin, steps, &req);
    assert_eq!(got.tokens[prompt.len() - 1..], want[..], "{name}: greedy continuation");

    // An end id stops the free-running loop at its first occurrence...
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
        .run(&TwinKv::new(spec, steps), &req, &|step, _| {
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

/// `a`'s steps, then `b`'s: one request's output over two launches.
fn joined(a: &TwinOutput, b: &TwinOutput) -> TwinOutput {
    TwinOutput { tokens: [a.tokens.clone(), b.tokens.clone()].concat(), logits: [a.logits.clone(), b.logits.clone()].concat() }
}

/// The same tokens and the same logits bit for bit (f32 `==` takes -0.0 for +0.0).
fn same_bits(a: &TwinOutput, b: &TwinOutput) -> bool {
    a.tokens == b.tokens && a.logits.len() == b.logits.len() && a.logits.iter().zip(&b.logits).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// A request of the batch tests: a teacher-forced prompt, then greedy steps.
struct Job {
    prompt: Vec<u32>,
    gen: usize,
    slot: usize,
    pages: Vec<u32>,
    at_step: usize,
}

impl Job {
    fn request(&self) -> TwinRequest<'_> {
        TwinRequest {
            pos0: 0,
            first_token: self.prompt[0],
            max_steps: self.prompt.len() - 1 + self.gen,
            forced: &self.prompt[1..],
            end_ids: &[],
            mask_end_steps: 0,
        }
    }

    fn admission(&self) -> TwinAdmission<'_> {
        TwinAdmission { request: self.request(), slot: self.slot, pages: &self.pages, join: Join::AtStep(self.at_step) }
    }
}

fn job(seed: u64, prompt: usize, gen: usize, slot: usize, pages: &[u32], at_step: usize, vocab: usize) -> Job {
    Job { prompt: ids(seed, prompt, vocab), gen, slot, pages: pages.to_vec(), at_step }
}

/// Jobs that join at the first step and later, leave at different steps, and
/// reuse a slot and a page the moment an earlier job frees them (pages of 8 positions).
fn staggered_jobs(vocab: usize) -> Vec<Job> {
    vec![
        job(1, 6, 8, 0, &[3, 9], 0, vocab),    // steps 0..13
        job(2, 3, 4, 1, &[0], 0, vocab),       // steps 0..6
        job(3, 5, 10, 2, &[1, 7], 2, vocab),   // steps 2..16
        job(4, 4, 6, 1, &[0, 4], 6, vocab),    // slot 1 and page 0 from step 6 on
        job(5, 2, 3, 1, &[5], 17, vocab),      // after idle slots: steps 17..21
    ]
}

/// The twin runs every slot with the same code, so these batch tests check the
/// schedule's and the slot table's bookkeeping (slots, pages, steps, masks); a
/// GPU kernel's arithmetic order across slots is for its own tests.
#[test]
fn a_batch_gives_each_request_the_tokens_and_logits_it_gets_alone() {
    for (name, spec) in models().into_iter().take(2) {
        let weights = Arc::new(random_weights(&spec, 17));
        let cpu = CpuBackend::new(spec.clone(), weights.clone());
        let sms = 5;
        let solo = Twin::new(&spec, &weights, sms).unwrap();
        let jobs = staggered_jobs(spec.vocab_size);
        let alone: Vec<TwinOutput> = jobs.iter().map(|j| run(&solo, j.request().max_steps, &j.request())).collect();
        for (j, out) in jobs.iter().zip(&alone) {
            let want = reference_greedy(&cpu, &j.prompt, j.gen);
            assert_eq!(out.tokens[j.prompt.len() - 1..], want[..], "{name}: a lone request's greedy continuation");
        }

        for slots in [3, 5] {
            let batched = Twin::with_schedule(&spec, &weights, Schedule::compile_batched(&spec, sms, slots).unwrap());
            let mut admissions: Vec<TwinAdmission<'_>> = jobs.iter().map(Job::admission).collect();
            // With two more slots, two more requests run beside them: nothing of theirs may change.
            let extra = [job(6, 7, 9, 3, &[2, 6], 1, spec.vocab_size), job(7, 3, 12, 4, &[8, 10], 4, spec.vocab_size)];
            if slots == 5 {
                admissions.extend(extra.iter().map(Job::admission));
            }
            let kv = TwinKv::paged(&spec, 11, 8);
            let got = batched.run_batch(&kv, &admissions, &|_, _, _, _| true).unwrap();
            for (i, (g, want)) in got.iter().zip(&alone).enumerate() {
                assert!(same_bits(g, want), "{name}, {slots} slots: request {i} differs from its lone run (tokens {:?} vs {:?})", g.tokens, want.tokens);
            }
            if slots == 5 {
                for (j, g) in extra.iter().zip(&got[jobs.len()..]) {
                    assert_eq!(g.tokens[j.prompt.len() - 1..], reference_greedy(&cpu, &j.prompt, j.gen)[..], "{name}: an extra request");
                }
            }
        }
    }
}

#[test]
fn a_request_admitted_into_a_running_batch_continues_from_its_cached_pages() {
    let (_, spec) = models().remove(1);
    let weights = random_weights(&spec, 23);
    let seq = ids(4, 20, spec.vocab_size);
    let solo = Twin::new(&spec, &weights, 4).unwrap();
    let whole = run(&solo, 20, &TwinRequest { pos0: 0, first_token: seq[0], max_steps: 20, forced: &seq[1..], end_ids: &[], mask_end_steps: 0 });

    // The first 11 positions in pages 6 and 2 by one launch; a later launch admits the rest
    // at step 3, beside a request that runs throughout.
    let batched = Twin::with_schedule(&spec, &weights, Schedule::compile_batched(&spec, 4, 2).unwrap());
    let kv = TwinKv::paged(&spec, 8, 8);
    let pages = [6, 2, 5];
    let head = TwinRequest { pos0: 0, first_token: seq[0], max_steps: 11, forced: &seq[1..11], end_ids: &[], mask_end_steps: 0 };
    let first = batched.run_batch(&kv, &[TwinAdmission { request: head, slot: 1, pages: &pages, join: Join::AtStep(0) }], &|_, _, _, _| true).unwrap();
    let other = job(9, 5, 9, 0, &[0, 1], 0, spec.vocab_size);
    let rest = TwinRequest { pos0: 11, first_token: seq[11], max_steps: 9, forced: &seq[12..], end_ids: &[], mask_end_steps: 0 };
    let second = batched
        .run_batch(&kv, &[other.admission(), TwinAdmission { request: rest, slot: 1, pages: &pages, join: Join::AtStep(3) }], &|_, _, _, _| true)
        .unwrap();
    assert!(same_bits(&joined(&first[0], &second[1]), &whole));
    assert!(same_bits(&second[0], &run(&solo, 13, &other.request())));

    // Past one attention split (64 positions): 60 cached positions, 10 more admitted at
    // step 3, so the request's contexts and the launch's steps cross 64 at different steps.
    let seq = ids(8, 70, spec.vocab_size);
    let whole = run(&solo, 70, &TwinRequest { pos0: 0, first_token: seq[0], max_steps: 70, forced: &seq[1..], end_ids: &[], mask_end_steps: 0 });
    let kv = TwinKv::paged(&spec, 12, 8);
    let pages = [11, 3, 7, 0, 9, 4, 10, 1, 5];
    let head = TwinRequest { pos0: 0, first_token: seq[0], max_steps: 60, forced: &seq[1..60], end_ids: &[], mask_end_steps: 0 };
    let first = batched.run_batch(&kv, &[TwinAdmission { request: head, slot: 0, pages: &pages, join: Join::AtStep(0) }], &|_, _, _, _| true).unwrap();
    let rest = TwinRequest { pos0: 60, first_token: seq[60], max_steps: 10, forced: &seq[61..], end_ids: &[], mask_end_steps: 0 };
    let other = job(9, 5, 9, 1, &[2, 6], 0, spec.vocab_size);
    let second = batched
        .run_batch(&kv, &[other.admission(), TwinAdmission { request: rest, slot: 0, pages: &pages, join: Join::AtStep(3) }], &|_, _, _, _| true)
        .unwrap();
    assert!(same_bits(&joined(&first[0], &second[1]), &whole));
}

#[test]
fn min_tokens_masking_and_end_ids_follow_each_request_s_own_steps() {
    let case = EndIdCase::new();
    let EndIdCase { spec, weights, prompt, first, .. } = &case;
    let (first, steps) = (*first, case.steps());
    let end_ids = [case.end];
    let stop = TwinRequest { end_ids: &end_ids, ..case.request() };
    // Masked through the step that would pick the end id.
    let masked = TwinRequest { mask_end_steps: prompt.len() - 1 + first + 1, ..stop };
    let solo = Twin::new(spec, weights, 4).unwrap();
    let (stop_alone, masked_alone) = (run(&solo, steps, &stop), run(&solo, steps, &masked));
    assert_eq!(stop_alone.tokens.len(), prompt.len() + first);
    assert!(masked_alone.tokens.len() > stop_alone.tokens.len());

    let batched = Twin::with_schedule(spec, weights, Schedule::compile_batched(spec, 4, 3).unwrap());
    let long = job(12, 4, 20, 0, &[0, 1, 2], 0, spec.vocab_size);
    let admissions = [
        long.admission(),
        TwinAdmission { request: stop, slot: 1, pages: &[3, 4], join: Join::AtStep(2) },
        TwinAdmission { request: masked, slot: 2, pages: &[5, 6], join: Join::AtStep(5) },
    ];
    let got = batched.run_batch(&TwinKv::paged(spec, 7, 8), &admissions, &|_, _, _, _| true).unwrap();
    assert!(same_bits(&got[1], &stop_alone));
    assert!(same_bits(&got[2], &masked_alone));
}

#[test]
fn the_host_stops_one_request_of_a_batch() {
    let (_, spec) = models().remove(0);
    let weights = random_weights(&spec, 5);
    let batched = Twin::with_schedule(&spec, &weights, Schedule::compile_batched(&spec, 3, 2).unwrap());
    let jobs = [job(1, 3, 10, 0, &[0, 1], 0, spec.vocab_size), job(2, 3, 10, 1, &[2, 3], 0, spec.vocab_size)];
    let admissions: Vec<_> = jobs.iter().map(Job::admission).collect();
    let all = batched.run_batch(&TwinKv::paged(&spec, 4, 8), &admissions, &|_, _, _, _| true).unwrap();
    let cut = batched.run_batch(&TwinKv::paged(&spec, 4, 8), &admissions, &|_, a, step, _| !(a == 1 && step == 4)).unwrap();
    assert!(same_bits(&cut[0], &all[0]));
    assert_eq!(cut[1].tokens, all[1].tokens[..5]);
}

#[test]
fn the_slot_table_refuses_what_the_host_must_not_post() {
    let (_, spec) = models().remove(0);
    let weights = random_weights(&spec, 5);
    let batched = Twin::with_schedule(&spec, &weights, Schedule::compile_batched(&spec, 3, 2).unwrap());
    let kv = TwinKv::paged(&spec, 4, 8);
    let none = |_: &TwinHost<'_>, _: usize, _: usize, _: u32| true;
    let a = job(1, 3, 6, 0, &[0], 0, spec.vocab_size); // steps 0..8
    let err = |admissions: &[TwinAdmission<'_>]| batched.run_batch(&kv, admissions, &none).unwrap_err().to_string();
    // A slot still taken, a page still in use, a slot or a page that does not exist, too few pages.
    assert!(err(&[a.admission(), job(2, 3, 2, 0, &[1], 3, spec.vocab_size).admission()]).contains("which admission 0 still runs"));
    assert!(err(&[a.admission(), job(2, 3, 2, 1, &[2, 0], 3, spec.vocab_size).admission()]).contains("shares a KV page"));
    assert!(err(&[job(2, 3, 2, 2, &[1], 0, spec.vocab_size).admission()]).contains("batch slots"));
    assert!(err(&[job(2, 3, 2, 1, &[4], 0, spec.vocab_size).admission()]).contains("pages"));
    assert!(err(&[job(2, 5, 5, 1, &[1], 0, spec.vocab_size).admission()]).contains("positions"));
    assert!(err(&[job(2, 5, 5, 1, &[1, 1], 0, spec.vocab_size).admission()]).contains("twice"));
    // The slot and the page are free again once the request has ended: step 8.
    let b = job(2, 3, 2, 0, &[0], 8, spec.vocab_size);
    let got = batched.run_batch(&kv, &[a.admission(), b.admission()], &none).unwrap();
    assert_eq!(got[1].tokens.len(), 4);
}

#[test]
fn a_request_the_host_posts_while_the_loop_runs_joins_at_the_next_step() {
    let (_, spec) = models().remove(0);
    let weights = random_weights(&spec, 29);
    let solo = Twin::new(&spec, &weights, 4).unwrap();
    let batched = Twin::with_schedule(&spec, &weights, Schedule::compile_batched(&spec, 4, 2).unwrap());
    let (a, b, c) = (job(1, 4, 12, 0, &[0, 1], 0, spec.vocab_size), job(2, 3, 4, 1, &[2], 0, spec.vocab_size), job(3, 5, 3, 1, &[3], 0, spec.vocab_size));
    fn posted(j: &Job) -> TwinAdmission<'_> {
        TwinAdmission { join: Join::Posted, ..j.admission() }
    }
    let never = job(4, 2, 2, 1, &[3], 0, spec.vocab_size);
    let admissions = [a.admission(), posted(&b), posted(&c), posted(&never)];
    let (b_steps, c_steps) = (b.request().max_steps, c.request().max_steps);
    // (launch step, admission, its step) of every token; A posts B at its step 2,
    // B posts C with its last token (C takes B's slot and page as B leaves them).
    let events = std::sync::Mutex::new(Vec::new());
    let got = batched
        .run_batch(&TwinKv::paged(&spec, 4, 8), &admissions, &|host, adm, step, _| {
            events.lock().unwrap().push((host.launch_step(), adm, step));
            if (adm, step) == (0, 2) {
                host.post(1).unwrap();
                assert!(host.post(1).unwrap_err().contains("already"));
                assert!(host.post(0).unwrap_err().contains("not when posted"));
            }
            if (adm, step) == (1, b_steps - 1) {
                host.post(2).unwrap();
            }
            true
        })
        .unwrap();
    let events = events.into_inner().unwrap();
    let at = |adm: usize, step: usize| events.iter().find(|e| (e.1, e.2) == (adm, step)).map(|e| e.0);
    assert_eq!(at(1, 0), Some(at(0, 2).unwrap() + 1), "B joins at the step after it was posted: {events:?}");
    assert_eq!(at(2, 0), Some(at(1, b_steps - 1).unwrap() + 1), "C joins as B leaves: {events:?}");
    assert_eq!(got[2].tokens.len(), c_steps);
    // Each one's tokens and logits are its lone run's; the one never posted never ran.
    for (j, g) in [&a, &b, &c].into_iter().zip(&got) {
        assert!(same_bits(g, &run(&solo, j.request().max_steps, &j.request())));
    }
    assert!(got[3].tokens.is_empty() && got[3].logits.is_empty());
}

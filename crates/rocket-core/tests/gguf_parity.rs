//! GGUF files written by someone else's tools: tiny Llama-3 (llama3 rope scaling in the
//! smoothing band) and Qwen3 checkpoints made with Hugging Face classes and written by
//! the `gguf` package's GGUFWriter, covering every tensor type rocket reads
//! (tests/gguf/make_fixtures.py). rocket's CPU reference must give the logits that
//! transformers gives loading the same files in fp32 (committed next to them, so this
//! test needs no Python).

use std::path::{Path, PathBuf};

use rocket_core::weights::dequant::READABLE;
use rocket_core::{Device, Engine, EngineOptions};
use serde_json::Value;

const FIXTURES: [&str; 4] = ["llama3-legacy", "llama3-kquant-tied", "qwen3-legacy-tied", "qwen3-kquant"];
const TOLERANCE: f32 = 1e-4;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/gguf/fixtures")
}

fn meta(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join(format!("{name}.json"))).unwrap()).unwrap()
}

fn cpu(name: &str) -> Engine {
    Engine::load(dir().join(format!("{name}.gguf")), EngineOptions { device: Device::Cpu, ..EngineOptions::default() }).unwrap()
}

#[test]
fn logits_match_transformers_on_the_same_gguf() {
    let mut failures = Vec::new();
    for name in FIXTURES {
        let m = meta(name);
        let ids: Vec<u32> = m["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let bytes = std::fs::read(dir().join(format!("{name}.logits.bin"))).unwrap();
        let want: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        let engine = cpu(name);
        let spec = engine.spec();
        assert_eq!(spec.family.name(), m["architecture"].as_str().unwrap(), "{name}");
        assert_eq!(spec.tie_word_embeddings, m["tied"].as_bool().unwrap(), "{name}");
        assert_eq!(spec.rope_freq_factors.is_some(), spec.family.name() == "llama", "{name}: llama files carry rope_freqs");
        let t = &m["tokenized_by_transformers"];
        let want_ids: Vec<u32> = t["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(engine.encode_prompt(t["text"].as_str().unwrap()).unwrap(), want_ids, "{name}: tokenization differs from transformers'");
        let got = engine.teacher_forced_logits(&ids).unwrap();
        assert_eq!(got.len(), want.len(), "{name}: {} tokens × {} vocab", ids.len(), spec.vocab_size);
        let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
        let types: Vec<&str> = {
            let mut t: Vec<&str> = m["tensor_types"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
            t.sort();
            t.dedup();
            t
        };
        eprintln!("{name}: max |Δlogit| = {worst:.2e} over {} tokens (|logit| up to {:.2}; types {})", ids.len(), m["logit_abs_max"].as_f64().unwrap(), types.join(" "));
        if worst.is_nan() || worst > TOLERANCE {
            failures.push(format!("{name}: max |Δlogit| {worst} > {TOLERANCE}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The fixtures together exercise every readable type, so a type cannot lose coverage unnoticed.
#[test]
fn fixtures_cover_every_readable_type() {
    let mut seen: Vec<String> = Vec::new();
    for name in FIXTURES {
        for t in meta(name)["tensor_types"].as_object().unwrap().values() {
            seen.push(t.as_str().unwrap().to_string());
        }
    }
    for kind in READABLE {
        assert!(seen.iter().any(|s| s == kind.name()), "no fixture stores a {} tensor", kind.name());
    }
}

#[test]
fn special_tokens_chat_template_and_sampling_defaults_come_from_metadata() {
    let llama = cpu("llama3-legacy");
    let n = llama.spec().vocab_size as u32;
    // eos (<|end_of_text|>) and eot (<|eot_id|>) both stop generation.
    assert_eq!(llama.info().eos_token_ids, vec![n - 3, n - 2]);
    assert_eq!(llama.generation_config().bos_token_id, Some(n - 4));
    assert_eq!(llama.generation_config().do_sample, None, "no sampling metadata: greedy, as HF's default");
    let text = llama.apply_chat_template(&[rocket_core::ChatMessage { role: "user".into(), content: "hi".into() }], true).unwrap();
    assert_eq!(text, "<|begin_of_text|><|start_header_id|>user\n\nhi<|eot_id|><|start_header_id|>assistant\n\n");

    // add_bos_token true: prompts start with BOS (the logits test compares whole encodings).
    assert_eq!(llama.encode_prompt(" the world").unwrap()[0], n - 4);

    let qwen = cpu("qwen3-kquant");
    let g = qwen.generation_config();
    assert_eq!(g.eos_token_ids, vec![n - 2]);
    assert_eq!((g.do_sample, g.top_k), (Some(true), Some(20)));
    assert_eq!((g.temperature.unwrap() as f32, g.top_p.unwrap() as f32), (0.6, 0.95));
}

/// Load time of a big GGUF (e.g. the Llama-3.2-1B-shaped Q4_K_M file that
/// tests/gguf/make_1b_q4_k_m.py writes), to bf16 (as for a GPU) and to f32 (the CPU
/// reference): `ROCKET_GGUF_TIMING_FILE=/path/x.gguf cargo test -p rocket-core --test
/// gguf_parity load_timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn load_timing() {
    use rocket_core::weights::gguf::GgufFile;
    use rocket_core::weights::DType;
    let path = PathBuf::from(std::env::var_os("ROCKET_GGUF_TIMING_FILE").expect("set ROCKET_GGUF_TIMING_FILE"));
    // Read once so every timing below starts from the page cache.
    let start = std::time::Instant::now();
    let bytes = std::fs::read(&path).unwrap().len();
    eprintln!("reading {bytes} bytes: {:.2?}", start.elapsed());
    for dtype in [DType::BF16, DType::F32] {
        let start = std::time::Instant::now();
        let file = GgufFile::open(&path).unwrap();
        let spec = file.spec().unwrap();
        let weights = file.weights(&spec, dtype).unwrap();
        let stored: usize = file.tensors.iter().map(|t| t.len).sum();
        eprintln!(
            "{}: {} tensors, {:.0} MB stored, quantized → {dtype} in {:.2?} on {} threads ({} cores)",
            path.display(), weights.len(), stored as f64 / 1e6, start.elapsed(), rayon::current_num_threads(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        drop(weights);
    }
    // The whole engine load (tokenizer, layout, CPU backend) on the CPU reference.
    let start = std::time::Instant::now();
    let engine = Engine::load(&path, EngineOptions { device: Device::Cpu, ..EngineOptions::default() }).unwrap();
    eprintln!("Engine::load (cpu, f32): {:.2?} (engine reports {:.2} s)", start.elapsed(), engine.info().load_seconds);
}

#[test]
fn quantized_tensors_dequantize_to_f32_or_bf16_only() {
    use rocket_core::weights::gguf::GgufFile;
    use rocket_core::weights::DType;
    let file = GgufFile::open(&dir().join("qwen3-kquant.gguf")).unwrap();
    let spec = file.spec().unwrap();
    let msg = file.weights(&spec, DType::F16).err().unwrap().to_string();
    assert!(msg.contains("quantized_as") && msg.contains("f32 or bf16"), "{msg}");
    let w = file.weights(&spec, DType::BF16).unwrap();
    assert!(w.contains("model.layers.0.mlp.up_proj.weight"));
}

/// `auto` on a machine without a GPU is the CPU reference itself: quantized
/// tensors become f32 there, as with `cpu`, never the bf16 a GPU reads. Where
/// `auto` finds a GPU, the weights it keeps on the host are bf16 (half the
/// memory) and the per-step bytes say so.
#[test]
fn auto_keeps_the_exact_weights_where_it_runs_on_the_cpu() {
    let path = dir().join("qwen3-kquant.gguf");
    let auto = Engine::load(&path, EngineOptions { device: Device::Auto, ..EngineOptions::default() }).unwrap();
    let cpu = cpu("qwen3-kquant");
    let ids: Vec<u32> = meta("qwen3-kquant")["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    if auto.info().backend == "cpu" {
        assert_eq!(auto.info().bytes_per_decode_step, cpu.info().bytes_per_decode_step, "auto on the CPU reads the f32 weights");
        let (a, c) = (auto.teacher_forced_logits(&ids).unwrap(), cpu.teacher_forced_logits(&ids).unwrap());
        assert!(a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()), "auto on the CPU must give the reference's logits bit for bit");
    } else {
        assert!(auto.info().bytes_per_decode_step < cpu.info().bytes_per_decode_step, "a GPU's host copy is bf16");
    }
}

//! Loading real files: the committed tiny HF checkpoints, GGUF written from the
//! same weights, and every malformed-input path producing a named error.

mod common;

use std::collections::HashMap;

use common::*;
use rocket_core::{Engine, EngineOptions, RocketError, SamplingParams};
use safetensors::Dtype;

fn load(path: &std::path::Path) -> Result<Engine, RocketError> {
    Engine::load(path, EngineOptions::default())
}

#[test]
fn tiny_fixtures_load_with_expected_specs() {
    let llama = load(&fixture("tiny-llama")).unwrap();
    let s = llama.spec();
    assert_eq!((s.head_dim, s.tie_word_embeddings, s.qk_norm), (16, false, false));
    assert_eq!(s.rope_scaling.unwrap().original_max_position_embeddings, 32);
    let qwen = load(&fixture("tiny-qwen3")).unwrap(); // sharded, f16, rope_parameters
    let s = qwen.spec();
    assert_eq!((s.head_dim, s.tie_word_embeddings, s.qk_norm, s.rope_theta), (32, true, true, 1e6));
    assert!(qwen.info().has_chat_template); // from chat_template.jinja
}

#[test]
fn a_position_s_logits_do_not_depend_on_later_tokens() {
    let engine = load(&fixture("tiny-qwen3")).unwrap();
    let ids: Vec<u32> = vec![5, 77, 300, 12, 9, 401, 33, 250];
    let all = engine.teacher_forced_logits(&ids).unwrap();
    let vocab = engine.spec().vocab_size;
    // Causality: row 4 of a pass over 8 tokens equals the last row of a pass over 5.
    let prefix = engine.teacher_forced_logits(&ids[..5]).unwrap();
    let d = rel_l2(&prefix[4 * vocab..], &all[4 * vocab..5 * vocab]);
    assert!(d < 1e-5, "prefix logits differ from full pass: {d}");
}

#[test]
fn greedy_is_deterministic() {
    let engine = load(&fixture("tiny-llama")).unwrap();
    let p = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
    let a = engine.generate("hello world", &p).unwrap();
    let b = engine.generate("hello world", &p).unwrap();
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.token_ids.len(), 12);
}

#[test]
fn missing_path_is_named() {
    let e = load(std::path::Path::new("/definitely/not/here")).err().unwrap();
    assert!(matches!(e, RocketError::ModelNotFound { .. }), "{e}");
    assert!(e.to_string().contains("/definitely/not/here"));
}

#[test]
fn a_folder_missing_a_model_file_names_it() {
    for (file, named) in [("config.json", "no config.json"), ("tokenizer.json", "no tokenizer.json"), ("model.safetensors", "no model.safetensors")] {
        let dir = copy_fixture("tiny-llama");
        std::fs::remove_file(dir.path().join(file)).unwrap();
        let e = load(dir.path()).err().unwrap();
        let msg = e.to_string();
        assert!(matches!(e, RocketError::NotAModelFolder { .. }) && msg.contains(named) && msg.contains("is not a model folder"), "{file}: {msg}");
    }
}

#[test]
fn unknown_model_type_lists_supported() {
    let dir = copy_fixture("tiny-llama");
    edit_json(&dir.path().join("config.json"), |c| c["model_type"] = "mamba".into());
    let e = load(dir.path()).err().unwrap().to_string();
    assert!(e.contains("mamba") && e.contains("llama, qwen3"), "{e}");
}

fn mutate_weights(f: impl FnOnce(&mut HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>)) -> (tempfile::TempDir, RocketError) {
    let dir = copy_fixture("tiny-llama");
    let path = dir.path().join("model.safetensors");
    let mut tensors = read_tensors(&path);
    f(&mut tensors);
    write_tensors(&path, &tensors);
    let e = load(dir.path()).err().expect("load must fail");
    (dir, e)
}

#[test]
fn missing_tensor_is_named() {
    let (_d, e) = mutate_weights(|t| {
        t.remove("model.layers.1.mlp.up_proj.weight");
    });
    assert!(e.to_string().contains("model.layers.1.mlp.up_proj.weight"), "{e}");
    assert!(matches!(e, RocketError::MissingTensor { .. }));
}

#[test]
fn wrong_shape_is_named() {
    let (_d, e) = mutate_weights(|t| {
        let v = t.get_mut("model.layers.0.self_attn.k_proj.weight").unwrap();
        v.1 = vec![v.1[1], v.1[0]];
    });
    let msg = e.to_string();
    assert!(msg.contains("k_proj") && msg.contains("[64, 32]") && msg.contains("[32, 64]"), "{msg}");
}

#[test]
fn wrong_dtype_is_named() {
    let (_d, e) = mutate_weights(|t| {
        let v = t.get_mut("model.norm.weight").unwrap();
        v.0 = Dtype::I16;
    });
    let msg = e.to_string();
    assert!(msg.contains("model.norm.weight") && msg.contains("I16"), "{msg}");
}

#[test]
fn truncated_safetensors_is_an_error() {
    let dir = copy_fixture("tiny-llama");
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    for cut in [4, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = load(dir.path()).err().unwrap();
        assert!(matches!(e, RocketError::CorruptFile { .. }), "cut {cut}: {e}");
    }
}

// ---- GGUF ---------------------------------------------------------------

/// A GGUF file holding the tiny-llama weights (q/k permuted as llama.cpp does)
/// with `quant` applied to the matrices, plus the tokenizer as metadata.
fn tiny_llama_gguf(dir: &std::path::Path, quant: u32, extra: Option<GgufTensor>) -> std::path::PathBuf {
    tiny_gguf(dir, "tiny-llama", "llama", quant, extra)
}

/// A GGUF file of fixture `name` laid out as llama.cpp's converter writes
/// architecture `arch`: Q/K rows permuted for llama only, q/k norms for qwen3,
/// the hyper-parameters and tokenizer as metadata.
fn tiny_gguf(dir: &std::path::Path, name: &str, arch: &str, quant: u32, extra: Option<GgufTensor>) -> std::path::PathBuf {
    tiny_gguf_from(dir, &fixture(name), arch, quant, extra, Vec::new())
}

/// `tiny_gguf` of the HF folder `src`, with `extra_meta` appended to the metadata.
fn tiny_gguf_from(dir: &std::path::Path, src: &std::path::Path, arch: &str, quant: u32, extra: Option<GgufTensor>, extra_meta: Vec<(&'static str, Meta)>) -> std::path::PathBuf {
    let mut tensors = HashMap::new();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            tensors.extend(read_tensors(&path));
        }
    }
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let cfg = |k: &str| config[k].as_u64().unwrap() as u32;
    let (heads, kv_heads) = (cfg("num_attention_heads") as usize, cfg("num_key_value_heads") as usize);
    let head_dim = config["head_dim"].as_u64().map_or(cfg("hidden_size") / heads as u32, |v| v as u32);
    let theta = config["rope_theta"].as_f64().or_else(|| config["rope_parameters"]["rope_theta"].as_f64()).unwrap();
    let tok: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    let special: Vec<u64> = tok["added_tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).collect();
    let types: Vec<i32> = (0..tokens.len() as u64).map(|i| if special.contains(&i) { 3 } else { 1 }).collect();
    let merges: Vec<String> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::Array(p) => format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            other => other.as_str().unwrap().to_string(),
        })
        .collect();

    let gguf_name = |hf: &str| -> String {
        let fixed = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"), ("lm_head.weight", "output.weight")];
        if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
            return g.to_string();
        }
        let rest = hf.strip_prefix("model.layers.").unwrap();
        let (layer, part) = rest.split_once('.').unwrap();
        let part = match part {
            "input_layernorm.weight" => "attn_norm.weight",
            "self_attn.q_proj.weight" => "attn_q.weight",
            "self_attn.k_proj.weight" => "attn_k.weight",
            "self_attn.v_proj.weight" => "attn_v.weight",
            "self_attn.o_proj.weight" => "attn_output.weight",
            "self_attn.q_norm.weight" => "attn_q_norm.weight",
            "self_attn.k_norm.weight" => "attn_k_norm.weight",
            "post_attention_layernorm.weight" => "ffn_norm.weight",
            "mlp.gate_proj.weight" => "ffn_gate.weight",
            "mlp.up_proj.weight" => "ffn_up.weight",
            "mlp.down_proj.weight" => "ffn_down.weight",
            other => panic!("unexpected {other}"),
        };
        format!("blk.{layer}.{part}")
    };
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let (dtype, shape, data) = &tensors[name];
        let mut values = match dtype {
            Dtype::BF16 => bf16_bytes_to_f32(data),
            Dtype::F16 => data.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
            other => panic!("fixture dtype {other:?}"),
        };
        let permute = if arch != "llama" {
            None
        } else if name.ends_with("q_proj.weight") {
            Some(heads)
        } else if name.ends_with("k_proj.weight") {
            Some(kv_heads)
        } else {
            None
        };
        if let Some(h) = permute {
            values = permute_rows_like_llama_cpp(&values, shape[0], shape[1], h);
        }
        let (type_id, bytes) = if shape.len() == 1 {
            (0, values.iter().flat_map(|v| v.to_le_bytes()).collect())
        } else if quant == 8 {
            (8, quantize_q8_0(&values))
        } else if quant == 1 && *dtype == Dtype::F16 {
            (1, data.clone())
        } else {
            (30, values.iter().flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()).collect())
        };
        out.push(GgufTensor { name: gguf_name(name), dims: shape.iter().rev().map(|&d| d as u64).collect(), type_id, data: bytes });
    }
    out.extend(extra);
    let key = |k: &str| -> &'static str { Box::leak(format!("{arch}.{k}").into_boxed_str()) };
    let mut meta = vec![
        ("general.architecture", Meta::Str(arch.into())),
        (key("embedding_length"), Meta::U32(cfg("hidden_size"))),
        (key("feed_forward_length"), Meta::U32(cfg("intermediate_size"))),
        (key("block_count"), Meta::U32(cfg("num_hidden_layers"))),
        (key("attention.head_count"), Meta::U32(heads as u32)),
        (key("attention.head_count_kv"), Meta::U32(kv_heads as u32)),
        (key("attention.key_length"), Meta::U32(head_dim)),
        (key("context_length"), Meta::U32(cfg("max_position_embeddings"))),
        (key("vocab_size"), Meta::U32(cfg("vocab_size"))),
        (key("attention.layer_norm_rms_epsilon"), Meta::F32(config["rms_norm_eps"].as_f64().unwrap() as f32)),
        (key("rope.freq_base"), Meta::F32(theta as f32)),
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.merges", Meta::Strs(merges)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(cfg("eos_token_id"))),
        ("tokenizer.chat_template", Meta::Str("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}".into())),
    ];
    meta.extend(extra_meta);
    let path = dir.join("tiny.gguf");
    write_gguf(&path, &meta, &out);
    path
}

#[test]
fn gguf_qwen3_f16_matches_safetensors_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tiny_gguf(tmp.path(), "tiny-qwen3", "qwen3", 1, None);
    let a = load(&fixture("tiny-qwen3")).unwrap();
    let b = load(&gguf).unwrap();
    let mut spec_b = b.spec().clone();
    assert_eq!(spec_b.rms_norm_eps as f32, a.spec().rms_norm_eps as f32);
    spec_b.rms_norm_eps = a.spec().rms_norm_eps;
    assert_eq!(a.spec(), &spec_b);
    let ids = [3u32, 50, 200, 7, 399, 11, 42, 100, 8];
    let (la, lb) = (a.teacher_forced_logits(&ids).unwrap(), b.teacher_forced_logits(&ids).unwrap());
    let worst = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-4, "qwen3 GGUF logits differ from the safetensors ones by {worst}");
}

/// llama3 rope scaling as llama.cpp's converter writes it: a `rope_freqs` tensor of
/// per-frequency divisors, computed from the HF config the way the converter does.
fn rope_freqs_tensor(config: &serde_json::Value) -> GgufTensor {
    let s = &config["rope_scaling"];
    let (factor, low, high) = (s["factor"].as_f64().unwrap(), s["low_freq_factor"].as_f64().unwrap(), s["high_freq_factor"].as_f64().unwrap());
    let old = s["original_max_position_embeddings"].as_f64().unwrap();
    let dim = config["hidden_size"].as_u64().unwrap() / config["num_attention_heads"].as_u64().unwrap();
    let base = config["rope_theta"].as_f64().unwrap() as f32;
    let factors: Vec<f32> = (0..dim / 2)
        .map(|i| {
            let freq = (1.0 / base.powf((2 * i) as f32 / dim as f32)) as f64;
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor as f32
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect();
    assert!(factors.iter().any(|&f| f != 1.0), "the fixture's scaling must change some frequency");
    GgufTensor { name: "rope_freqs.weight".into(), dims: vec![dim / 2], type_id: 0, data: factors.iter().flat_map(|f| f.to_le_bytes()).collect() }
}

#[test]
fn gguf_llama3_rope_freqs_match_safetensors() {
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tiny_gguf(tmp.path(), "tiny-llama", "llama", 30, Some(rope_freqs_tensor(&config)));
    let a = load(&fixture("tiny-llama")).unwrap();
    let b = load(&gguf).unwrap();
    assert!(b.spec().rope_freq_factors.is_some());
    let ids = random_ids(5, 200, 512);
    let (la, lb) = (a.teacher_forced_logits(&ids).unwrap(), b.teacher_forced_logits(&ids).unwrap());
    let worst = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-4, "llama3-scaled GGUF logits differ from the safetensors ones by {worst}");
    // Without the factors the far positions rotate differently: the check can fail.
    let plain = tiny_gguf(tmp.path(), "tiny-llama", "llama", 30, None);
    let lc = load(&plain).unwrap().teacher_forced_logits(&ids).unwrap();
    let unscaled = la.iter().zip(&lc).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(unscaled > 1e-2, "the scaling made no difference ({unscaled})");
}

/// tiny-llama with llama3 `original_max_position_embeddings` 64, which puts its
/// second rotary frequency (wavelength 32.4) in the smoothing band [16, 64].
fn llama3_band_hf() -> (tempfile::TempDir, serde_json::Value) {
    let dir = copy_fixture("tiny-llama");
    edit_json(&dir.path().join("config.json"), |c| c["rope_scaling"]["original_max_position_embeddings"] = 64.into());
    let config = serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    (dir, config)
}

/// llama3 scaling as `llama.rope.scaling.*` metadata (transformers' parameter names).
fn llama3_meta(config: &serde_json::Value) -> Vec<(&'static str, Meta)> {
    let s = &config["rope_scaling"];
    let f = |k: &str| Meta::F32(s[k].as_f64().unwrap() as f32);
    vec![
        ("llama.rope.scaling.type", Meta::Str("llama3".into())),
        ("llama.rope.scaling.factor", f("factor")),
        ("llama.rope.scaling.original_context_length", Meta::U32(s["original_max_position_embeddings"].as_u64().unwrap() as u32)),
        ("llama.rope.scaling.low_freq_factor", f("low_freq_factor")),
        ("llama.rope.scaling.high_freq_factor", f("high_freq_factor")),
    ]
}

#[test]
fn gguf_llama3_rope_metadata_gives_the_rope_freqs_rotation() {
    let (hf, config) = llama3_band_hf();
    let tmp = tempfile::tempdir().unwrap();
    let ids = random_ids(7, 200, 512);
    // Metadata only: the spec carries the HF parameters.
    let meta_only = load(&tiny_gguf_from(tmp.path(), hf.path(), "llama", 30, None, llama3_meta(&config))).unwrap();
    assert_eq!(meta_only.spec().rope_scaling, load(hf.path()).unwrap().spec().rope_scaling);
    assert!(meta_only.spec().rope_freq_factors.is_none());
    let la = meta_only.teacher_forced_logits(&ids).unwrap();
    // The tensor alone (factors computed here as llama.cpp's converter does) rotates alike.
    let tensor_only = load(&tiny_gguf_from(tmp.path(), hf.path(), "llama", 30, Some(rope_freqs_tensor(&config)), Vec::new())).unwrap();
    let lb = tensor_only.teacher_forced_logits(&ids).unwrap();
    let worst = la.iter().zip(&lb).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-4, "metadata and rope_freqs llama3 scaling differ by {worst}");
    // Both, agreeing: loads, same logits.
    let both = load(&tiny_gguf_from(tmp.path(), hf.path(), "llama", 30, Some(rope_freqs_tensor(&config)), llama3_meta(&config))).unwrap();
    let lc = both.teacher_forced_logits(&ids).unwrap();
    let worst = la.iter().zip(&lc).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst <= 1e-4, "metadata + rope_freqs differ from metadata alone by {worst}");
}

#[test]
fn gguf_llama3_rope_metadata_and_tensor_must_agree() {
    let (hf, config) = llama3_band_hf();
    let tmp = tempfile::tempdir().unwrap();
    // Change the one factor in the smoothing band.
    let mut t = rope_freqs_tensor(&config);
    let band = 4..8;
    let v = f32::from_le_bytes(t.data[band.clone()].try_into().unwrap());
    assert!(v > 1.0 && v < 8.0, "frequency 1 must be in the band, factor {v}");
    t.data[band].copy_from_slice(&(v * 1.001).to_le_bytes());
    let msg = load(&tiny_gguf_from(tmp.path(), hf.path(), "llama", 30, Some(t), llama3_meta(&config))).err().unwrap().to_string();
    assert!(msg.contains("rope_freqs.weight") && msg.contains("disagrees with the llama3 rope scaling metadata"), "{msg}");
    // Another scaling type is named with the supported ones.
    let mut meta = llama3_meta(&config);
    meta[0].1 = Meta::Str("yarn".into());
    let msg = load(&tiny_gguf_from(tmp.path(), hf.path(), "llama", 30, None, meta)).err().unwrap().to_string();
    assert!(msg.contains("llama.rope.scaling.type \"yarn\"") && msg.contains("none, llama3"), "{msg}");
}

#[test]
fn gguf_unknown_architecture_lists_supported() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tiny_gguf(tmp.path(), "tiny-qwen3", "qwen3", 1, None);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(5).position(|w| w == b"qwen3").unwrap();
    bytes[at..at + 5].copy_from_slice(b"gemma");
    std::fs::write(&path, &bytes).unwrap();
    let msg = load(&path).err().unwrap().to_string();
    assert!(msg.contains("gguf:gemma") && msg.contains("gguf:llama") && msg.contains("gguf:qwen3"), "{msg}");
}

/// The HF checkpoint with RoPE scaling removed (GGUF here carries none).
fn unscaled_hf() -> tempfile::TempDir {
    let dir = copy_fixture("tiny-llama");
    edit_json(&dir.path().join("config.json"), |c| {
        c.as_object_mut().unwrap().remove("rope_scaling");
    });
    dir
}

#[test]
fn gguf_bf16_matches_safetensors_exactly() {
    let hf = unscaled_hf();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tiny_llama_gguf(tmp.path(), 30, None);
    let a = load(hf.path()).unwrap();
    let b = load(&gguf).unwrap();
    // GGUF stores rms_norm_eps as f32; everything else must agree.
    let mut spec_b = b.spec().clone();
    assert_eq!(spec_b.rms_norm_eps as f32, a.spec().rms_norm_eps as f32);
    spec_b.rms_norm_eps = a.spec().rms_norm_eps;
    assert_eq!(a.spec(), &spec_b);
    let ids = [3u32, 50, 200, 7, 399, 11, 42, 100, 8];
    let (la, lb) = (a.teacher_forced_logits(&ids).unwrap(), b.teacher_forced_logits(&ids).unwrap());
    assert_eq!(la, lb, "un-permuted GGUF weights must equal the HF ones");
    // The GGUF tokenizer is byte-level BPE without the fixture's digit splitting:
    // text without digits tokenises identically.
    for text in ["hello world", "  the quick\n\nbrown fox ", "<|im_start|>user\nhi<|im_end|>"] {
        assert_eq!(a.tokenizer().encode(text, false).unwrap(), b.tokenizer().encode(text, false).unwrap(), "{text:?}");
    }
}

#[test]
fn gguf_q8_0_is_close_to_bf16() {
    let hf = unscaled_hf();
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tiny_llama_gguf(tmp.path(), 8, None);
    let ids = [3u32, 50, 200, 7, 399, 11];
    let la = load(hf.path()).unwrap().teacher_forced_logits(&ids).unwrap();
    let lb = load(&gguf).unwrap().teacher_forced_logits(&ids).unwrap();
    let err = rel_l2(&lb, &la);
    // Q8_0 is lossy (≈0.5% per weight, compounded over the layers); a wrong
    // block layout or scale gives an error of order 1.
    assert!(err > 0.0 && err < 6e-2, "Q8_0 rel. L2 error {err}");
}

#[test]
fn gguf_unsupported_quant_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    // Replace nothing; add a used tensor name in IQ2_XXS (type 16) by shadowing attn_v of layer 0.
    let iq2 = GgufTensor { name: "blk.0.attn_v.weight".into(), dims: vec![256, 32], type_id: 16, data: vec![0; 32 * 66] };
    let path = tiny_llama_gguf(tmp.path(), 30, Some(iq2));
    let e = load(&path).err().unwrap();
    let msg = e.to_string();
    assert!(matches!(e, RocketError::UnsupportedQuant { .. }) && msg.contains("IQ2_XXS") && msg.contains("blk.0.attn_v.weight"), "{msg}");
    // The list of what is supported is the readable types', K-quants included.
    assert!(msg.contains("Q4_K") && msg.contains("Q6_K") && msg.contains("IQ4_XS"), "{msg}");
}

#[test]
fn gguf_truncated_or_corrupt_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tiny_llama_gguf(tmp.path(), 30, None);
    let bytes = std::fs::read(&path).unwrap();
    for cut in [3, 10, 30, 2000, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let e = load(&path).err().unwrap();
        assert!(matches!(e, RocketError::CorruptFile { .. }), "cut {cut}: {e}");
    }
    let mut bad = bytes.clone();
    bad[0] = b'X';
    std::fs::write(&path, &bad).unwrap();
    assert!(load(&path).err().unwrap().to_string().contains("bad magic"));
    // A huge string length must not allocate or read out of bounds.
    let mut bad = bytes;
    bad[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&path, &bad).unwrap();
    assert!(matches!(load(&path).err().unwrap(), RocketError::CorruptFile { .. }));
}

/// Set the u32 value of GGUF metadata key `key` (written as type 4) in `bytes`.
fn set_gguf_u32(bytes: &mut [u8], key: &str, value: u32) {
    let at = bytes.windows(key.len()).position(|w| w == key.as_bytes()).expect("key present") + key.len();
    assert_eq!(bytes[at..at + 4], 4u32.to_le_bytes(), "{key} is a u32");
    bytes[at + 4..at + 8].copy_from_slice(&value.to_le_bytes());
}

#[test]
fn gguf_claiming_billions_of_layers_is_an_error_not_an_abort() {
    // Found by rocket-fuzz: the layer table was allocated for the claimed count
    // before any layer was checked (4e9 layers: an allocation failure, an abort).
    let tmp = tempfile::tempdir().unwrap();
    let path = tiny_llama_gguf(tmp.path(), 30, None);
    let mut bytes = std::fs::read(&path).unwrap();
    set_gguf_u32(&mut bytes, "llama.block_count", u32::MAX);
    std::fs::write(&path, &bytes).unwrap();
    let e = load(&path).err().unwrap();
    assert!(matches!(&e, RocketError::MissingTensor { name, .. } if name.starts_with("blk.2.")), "{e}");
}

#[test]
fn config_whose_sizes_overflow_is_an_error() {
    // Found by rocket-fuzz: parameter counts overflowed (a panic in debug builds).
    let dir = copy_fixture("tiny-llama");
    edit_json(&dir.path().join("config.json"), |c| c["vocab_size"] = serde_json::json!(u64::MAX));
    let e = load(dir.path()).err().unwrap();
    assert!(matches!(e, RocketError::InvalidConfig { .. }) && e.to_string().contains("sizes overflow"), "{e}");
}

#[test]
fn empty_prompt_and_context_overflow() {
    let engine = Engine::load(fixture("tiny-llama"), EngineOptions { max_seq_len: Some(20), ..EngineOptions::default() }).unwrap();
    assert!(matches!(engine.generate("", &SamplingParams::greedy(4)).err().unwrap(), RocketError::EmptyPrompt));
    let e = engine.generate("hello world", &SamplingParams::greedy(19)).err().unwrap();
    let msg = e.to_string();
    assert!(matches!(e, RocketError::ContextOverflow { max_tokens: 19, limit: 20, .. }), "{msg}");
    assert!(msg.contains("19") && msg.contains("20"), "{msg}");
    let e = Engine::load(fixture("tiny-llama"), EngineOptions { max_seq_len: Some(100_000), ..EngineOptions::default() });
    assert!(e.err().unwrap().to_string().contains("max_position_embeddings (256)"));
}

//! Seed files for the corpus, made here (`rocket-fuzz make-seeds DIR`): tiny but
//! complete models in each format, small enough that mutations stay fast, plus
//! config files and chat templates taken from the repository's fixtures and,
//! when given, from installed real models (their chat templates and metadata
//! keys; never their weights).

use std::collections::HashMap;
use std::path::Path;

use serde_json::{json, Value};

const HIDDEN: usize = 8;
const FF: usize = 16;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = 4;
const VOCAB: usize = 16;

pub const TOKENS: [&str; VOCAB] =
    ["<s>", "</s>", "<|im_end|>", "a", "b", "c", "d", "Ġ", "ab", "cd", "abcd", "Ġa", "e", "f", "g", "h"];
const MERGES: [&str; 4] = ["a b", "c d", "ab cd", "Ġ a"];
/// Token types: 3 marks control tokens.
const TYPES: [i32; VOCAB] = [3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];

pub const CHATML: &str = "{% for message in messages %}\n<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}\n{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The tiny model's config.json.
pub fn tiny_config(family: &str) -> Value {
    json!({
        "model_type": family, "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": FF,
        "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": true, "bos_token_id": 0, "eos_token_id": 1,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}
    })
}

/// (HF name, shape) of every tensor of the tiny model.
fn tiny_tensors(qk_norm: bool) -> Vec<(String, Vec<usize>)> {
    let p = "model.layers.0";
    let mut t = vec![
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("model.norm.weight".into(), vec![HIDDEN]),
        (format!("{p}.input_layernorm.weight"), vec![HIDDEN]),
        (format!("{p}.post_attention_layernorm.weight"), vec![HIDDEN]),
        (format!("{p}.self_attn.q_proj.weight"), vec![HEADS * HEAD_DIM, HIDDEN]),
        (format!("{p}.self_attn.k_proj.weight"), vec![KV_HEADS * HEAD_DIM, HIDDEN]),
        (format!("{p}.self_attn.v_proj.weight"), vec![KV_HEADS * HEAD_DIM, HIDDEN]),
        (format!("{p}.self_attn.o_proj.weight"), vec![HIDDEN, HEADS * HEAD_DIM]),
        (format!("{p}.mlp.gate_proj.weight"), vec![FF, HIDDEN]),
        (format!("{p}.mlp.up_proj.weight"), vec![FF, HIDDEN]),
        (format!("{p}.mlp.down_proj.weight"), vec![HIDDEN, FF]),
    ];
    if qk_norm {
        t.push((format!("{p}.self_attn.q_norm.weight"), vec![HEAD_DIM]));
        t.push((format!("{p}.self_attn.k_norm.weight"), vec![HEAD_DIM]));
    }
    t
}

fn values(n: usize, salt: usize) -> Vec<f32> {
    (0..n).map(|i| ((i * 7 + salt * 13) % 17) as f32 / 17.0 - 0.5).collect()
}

/// A safetensors file of the tiny llama in `dtype` (F32, F16 or BF16), or mixed.
pub fn tiny_safetensors(dtype: &str) -> Vec<u8> {
    use safetensors::tensor::{Dtype, TensorView};
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (i, (name, shape)) in tiny_tensors(false).into_iter().enumerate() {
        let v = values(shape.iter().product(), i);
        let kind = match dtype {
            "mixed" => ["F32", "F16", "BF16"][i % 3],
            d => d,
        };
        let (dt, bytes): (Dtype, Vec<u8>) = match kind {
            "F32" => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            "F16" => (Dtype::F16, v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect()),
            _ => (Dtype::BF16, v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()),
        };
        owned.push((name, dt, shape, bytes));
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, dt, s, b)| (n.clone(), TensorView::new(*dt, s.clone(), b).expect("consistent tensor")))
        .collect();
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize(views, Some(meta)).expect("serialize")
}

// ---- GGUF writing ----------------------------------------------------------

pub enum Meta {
    U32(u32),
    U64(u64),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A GGUF v3 file: metadata, tensor directory (ggml dims), data aligned to 32.
pub fn gguf_bytes(meta: &[(String, Meta)], tensors: &[(String, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (key, value) in meta {
        put_str(&mut out, key);
        match value {
            Meta::U32(v) => {
                out.extend(4u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::U64(v) => {
                out.extend(10u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::F32(v) => {
                out.extend(6u32.to_le_bytes());
                out.extend(v.to_le_bytes());
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Meta::Strs(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for s in items {
                    put_str(&mut out, s);
                }
            }
            Meta::I32s(items) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                for v in items {
                    out.extend(v.to_le_bytes());
                }
            }
        }
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for (name, dims, type_id, data) in tensors {
        put_str(&mut out, name);
        out.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend(d.to_le_bytes());
        }
        out.extend(type_id.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while out.len() % 32 != 0 {
        out.push(0);
    }
    let start = out.len();
    for ((_, _, _, data), off) in tensors.iter().zip(offsets) {
        out.resize(start + off as usize, 0);
        out.extend(data);
    }
    out
}

fn quantize_q8_0(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in v.chunks(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        out.extend(half::f16::from_f32(d).to_le_bytes());
        for x in block {
            out.push((if d == 0.0 { 0.0 } else { (x / d).round() }) as i8 as u8);
        }
    }
    out
}

fn quantize_q4_0(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for block in v.chunks(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 8.0;
        out.extend(half::f16::from_f32(d).to_le_bytes());
        let q = |x: f32| (if d == 0.0 { 8.0 } else { (x / d + 8.5).floor().clamp(0.0, 15.0) }) as u8;
        for i in 0..16 {
            out.push(q(block[i]) | (q(block[i + 16]) << 4));
        }
    }
    out
}

/// A tiny GGUF of `arch` (llama or qwen3) with matrices stored as ggml type
/// `quant` (0 F32, 1 F16, 2 Q4_0, 8 Q8_0, 30 BF16); `chat_template` and extra
/// metadata keys are added as given.
pub fn tiny_gguf(arch: &str, quant: u32, chat_template: &str, extra_meta: Vec<(String, Meta)>) -> Vec<u8> {
    let mut tensors = Vec::new();
    for (i, (name, shape)) in tiny_tensors(arch == "qwen3").into_iter().enumerate() {
        let v = values(shape.iter().product(), i);
        let (type_id, bytes) = if shape.len() == 1 {
            (0, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        } else {
            match quant {
                1 => (1, v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect()),
                2 => (2, quantize_q4_0(&v)),
                8 => (8, quantize_q8_0(&v)),
                30 => (30, v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()),
                _ => (0, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
            }
        };
        tensors.push((rocket_core::weights::gguf::gguf_name(&name).expect("a tensor GGUF names"), shape.iter().rev().map(|&d| d as u64).collect(), type_id, bytes));
    }
    let k = |s: &str| format!("{arch}.{s}");
    let mut meta = vec![
        ("general.architecture".to_string(), Meta::Str(arch.into())),
        ("general.alignment".into(), Meta::U32(32)),
        (k("block_count"), Meta::U32(1)),
        (k("embedding_length"), Meta::U32(HIDDEN as u32)),
        (k("feed_forward_length"), Meta::U32(FF as u32)),
        (k("attention.head_count"), Meta::U32(HEADS as u32)),
        (k("attention.head_count_kv"), Meta::U32(KV_HEADS as u32)),
        (k("attention.key_length"), Meta::U32(HEAD_DIM as u32)),
        (k("context_length"), Meta::U64(64)),
        (k("vocab_size"), Meta::U32(VOCAB as u32)),
        (k("attention.layer_norm_rms_epsilon"), Meta::F32(1e-5)),
        (k("rope.freq_base"), Meta::F32(10000.0)),
        ("tokenizer.ggml.model".into(), Meta::Str("gpt2".into())),
        ("tokenizer.ggml.tokens".into(), Meta::Strs(TOKENS.iter().map(|s| s.to_string()).collect())),
        ("tokenizer.ggml.token_type".into(), Meta::I32s(TYPES.to_vec())),
        ("tokenizer.ggml.merges".into(), Meta::Strs(MERGES.iter().map(|s| s.to_string()).collect())),
        ("tokenizer.ggml.bos_token_id".into(), Meta::U32(0)),
        ("tokenizer.ggml.eos_token_id".into(), Meta::U32(1)),
        ("tokenizer.chat_template".into(), Meta::Str(chat_template.into())),
    ];
    meta.extend(extra_meta);
    gguf_bytes(&meta, &tensors)
}

/// Write the seed corpus under `out/<target>/`. `smollm2` (a GGUF) and
/// `tokenizer_configs` (tokenizer_config.json files) contribute their chat
/// templates and, for the GGUF, its scalar metadata.
pub fn make_seeds(out: &Path, repo: &Path, smollm2: Option<&Path>, tokenizer_configs: &[&Path]) -> std::io::Result<usize> {
    let mut n = 0;
    let mut write = |target: &str, name: &str, bytes: &[u8]| -> std::io::Result<()> {
        let dir = out.join(target);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(name), bytes)?;
        n += 1;
        Ok(())
    };
    for dtype in ["F32", "F16", "BF16", "mixed"] {
        write("safetensors", &format!("tiny-llama-{}.safetensors", dtype.to_lowercase()), &tiny_safetensors(dtype))?;
    }

    let mut templates: Vec<(String, String)> = vec![("chatml.jinja".into(), CHATML.into())];
    let qwen3_fixture = repo.join("tests/parity/fixtures/tiny-qwen3/chat_template.jinja");
    if let Ok(t) = std::fs::read_to_string(&qwen3_fixture) {
        templates.push(("tiny-qwen3-fixture.jinja".into(), t));
    }
    for (i, path) in tokenizer_configs.iter().enumerate() {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        if let Some(t) = v.get("chat_template").and_then(Value::as_str) {
            templates.push((format!("tokenizer-config-{i}.jinja"), t.to_string()));
        }
    }
    let mut smol_meta = Vec::new();
    if let Some(path) = smollm2 {
        let file = rocket_core::weights::gguf::GgufFile::open(path).map_err(std::io::Error::other)?;
        if let Some(t) = file.get_str("tokenizer.chat_template") {
            templates.push(("smollm2.jinja".into(), t.to_string()));
        }
        // Scalar metadata of a real converter's output, tiny model shapes kept.
        for (key, value) in &file.metadata {
            use rocket_core::weights::gguf::MetaValue;
            let keep = key.starts_with("general.") && key != "general.architecture" && key != "general.alignment";
            match value {
                MetaValue::Str(s) if keep && s.len() < 200 => smol_meta.push((key.clone(), Meta::Str(s.clone()))),
                MetaValue::UInt(v) if keep => smol_meta.push((key.clone(), Meta::U64(*v))),
                _ => {}
            }
        }
    }
    templates.push(("loops.jinja".into(), "{% set ns = namespace(n=0) %}{% for m in messages %}{% for c in m.content %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{{ ns.n }}{{ messages | tojson(indent=2) }}".into()));
    templates.push(("macro.jinja".into(), "{% macro show(m) %}[{{ m.role | upper }}] {{ m.content }}{% endmacro %}{% for m in messages if m.role != 'system' %}{{ show(m) }}{% if not loop.last %}\n{% endif %}{% endfor %}{% if add_generation_prompt %}{{ bos_token }}{% endif %}".into()));
    for (name, t) in &templates {
        write("chat-template", name, t.as_bytes())?;
    }

    let chat = templates.last().map_or(CHATML, |(_, t)| t.as_str());
    write("gguf", "tiny-llama-f32.gguf", &tiny_gguf("llama", 0, CHATML, Vec::new()))?;
    write("gguf", "tiny-llama-q4_0.gguf", &tiny_gguf("llama", 2, chat, Vec::new()))?;
    write("gguf", "tiny-qwen3-q8_0.gguf", &tiny_gguf("qwen3", 8, CHATML, Vec::new()))?;
    write("gguf", "tiny-qwen3-bf16.gguf", &tiny_gguf("qwen3", 30, CHATML, Vec::new()))?;
    if !smol_meta.is_empty() {
        write("gguf", "tiny-llama-f16-smollm2-meta.gguf", &tiny_gguf("llama", 1, CHATML, smol_meta))?;
    }

    for family in ["llama", "qwen3"] {
        write("config", &format!("tiny-{family}-config.json"), serde_json::to_string_pretty(&tiny_config(family))?.as_bytes())?;
    }
    for fixture in ["tiny-llama", "tiny-qwen3"] {
        for file in ["config.json", "generation_config.json"] {
            if let Ok(bytes) = std::fs::read(repo.join("tests/parity/fixtures").join(fixture).join(file)) {
                write("config", &format!("fixture-{fixture}-{file}"), &bytes)?;
            }
        }
    }
    Ok(n)
}

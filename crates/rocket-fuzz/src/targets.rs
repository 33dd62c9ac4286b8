//! The fuzz targets: each feeds one input to rocket's real loader entry points,
//! from memory, and reports how it ended. Every input must end as `Ok` or a
//! `RocketError`; a panic, abort, hang or runaway allocation is a bug.

use std::path::Path;
use std::sync::Arc;

use memmap2::{Mmap, MmapOptions};
use rocket_core::model::layout::ModelWeights;
use rocket_core::model::generation_config::GenerationConfig;
use rocket_core::model::rope;
use rocket_core::text::tokenizer::Tokenizer;
use rocket_core::text::{ChatMessage, ChatTemplate, ChatTemplateLimits};
use rocket_core::weights::gguf::GgufFile;
use rocket_core::weights::{safetensors_file, DType, Weights};
use rocket_core::{ModelSpec, RocketError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Safetensors,
    Gguf,
    Config,
    ChatTemplate,
}

pub const ALL: [Target; 4] = [Target::Safetensors, Target::Gguf, Target::Config, Target::ChatTemplate];

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Safetensors => "safetensors",
            Target::Gguf => "gguf",
            Target::Config => "config",
            Target::ChatTemplate => "chat-template",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        ALL.into_iter().find(|t| t.name() == s)
    }
}

/// How one input ended (a panic never gets here: the runner catches it).
pub enum Outcome {
    Ok,
    Err(RocketError),
}

/// Fuel for chat templates while fuzzing: the bound works the same at any budget,
/// and a small one keeps mutated endless loops cheap. Tests check the default.
pub const FUZZ_CHAT_LIMITS: ChatTemplateLimits = ChatTemplateLimits { fuel: 50_000, max_output_bytes: 1 << 20 };

/// The spec the safetensors seeds were made for (see `seeds.rs`): mutated files
/// are also checked against it, as `Engine::load` checks a checkpoint against its config.json.
pub fn tiny_spec() -> ModelSpec {
    let config = crate::seeds::tiny_config("llama");
    ModelSpec::from_hf_config(&config, Path::new("config.json")).expect("the tiny config is valid")
}

/// Bytes in an anonymous read-only map: loaders see them as they see a mapped file.
fn map_bytes(data: &[u8]) -> Arc<Mmap> {
    let mut m = MmapOptions::new().len(data.len()).map_anon().expect("anonymous map");
    m.copy_from_slice(data);
    Arc::new(m.make_read_only().expect("read-only map"))
}

fn ok_or(r: Result<(), RocketError>) -> Outcome {
    match r {
        Ok(()) => Outcome::Ok,
        Err(e) => Outcome::Err(e),
    }
}

pub struct Runner {
    spec: ModelSpec,
}

impl Runner {
    pub fn new() -> Self {
        Runner { spec: tiny_spec() }
    }

    pub fn run(&self, target: Target, data: &[u8]) -> Outcome {
        ok_or(match target {
            Target::Safetensors => self.safetensors(data),
            Target::Gguf => gguf(data),
            Target::Config => config(data),
            Target::ChatTemplate => chat_template(data),
        })
    }

    /// A safetensors file: header, tensor table, data ranges; then the tensors
    /// the tiny spec needs, read to their last element.
    fn safetensors(&self, data: &[u8]) -> Result<(), RocketError> {
        let path = Path::new("fuzz.safetensors");
        let mut weights = Weights::new(path.display().to_string());
        safetensors_file::load_map_into(map_bytes(data), path, &mut weights)?;
        let model = ModelWeights::from_weights(&self.spec, weights)?;
        touch_model(&model);
        Ok(())
    }
}

impl Default for Runner {
    fn default() -> Self {
        Self::new()
    }
}

/// Read the first and last element of every tensor (bounds and views are real).
fn touch_model(m: &ModelWeights) -> f32 {
    let edge = |t: &rocket_core::weights::Tensor| {
        let v = t.view();
        if v.is_empty() {
            0.0
        } else {
            v.get(0) + v.get(v.len() - 1)
        }
    };
    let mut acc = edge(&m.embed_tokens);
    for l in &m.layers {
        for t in [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj] {
            acc += edge(t);
        }
    }
    std::hint::black_box(acc)
}

/// A GGUF file as `Engine::load` opens one: header and metadata, tensor
/// directory, spec, conversion of every tensor (dequantizing), the shape checks
/// of the model layout, and the tokenizer rebuilt from metadata.
fn gguf(data: &[u8]) -> Result<(), RocketError> {
    let path = Path::new("fuzz.gguf");
    let file = GgufFile::from_map(map_bytes(data), path)?;
    let spec = file.spec()?;
    let weights = file.weights(&spec, DType::F32)?; // as the CPU engine loads it
    let model = ModelWeights::from_weights(&spec, weights);
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let ids = tokenizer.encode("ab cd<|im_end|>", true)?;
    tokenizer.decode(&ids, false)?;
    touch_model(&model?);
    Ok(())
}

/// A `config.json` or `generation_config.json` (both parsers see every input),
/// and what the engine derives from a valid spec.
fn config(data: &[u8]) -> Result<(), RocketError> {
    let path = Path::new("config.json");
    let value: serde_json::Value =
        serde_json::from_slice(data).map_err(|e| RocketError::config(path, format!("not valid JSON: {e}")))?;
    if let Ok(generation) = GenerationConfig::from_json(&value) {
        std::hint::black_box(generation.check()).expect("a parsed generation_config passes its own check");
    }
    let spec = ModelSpec::from_hf_config(&value, path)?;
    std::hint::black_box((spec.q_dim(), spec.kv_dim(), spec.parameter_count(), spec.weight_elements_per_step()));
    // The backends build the RoPE table once the weights matched the spec, which
    // bounds head_dim by the checkpoint's size; a bare config has no such bound.
    if spec.head_dim <= 1 << 16 {
        std::hint::black_box(rope::inv_freq(&spec));
    }
    Ok(())
}

/// A chat template (the input as its source) rendered for a short conversation,
/// with and without the generation prompt.
fn chat_template(data: &[u8]) -> Result<(), RocketError> {
    let source = String::from_utf8_lossy(data);
    let t = ChatTemplate::with_limits(&source, "<s>", "</s>", FUZZ_CHAT_LIMITS)?;
    let msg = |role: &str, content: &str| ChatMessage { role: role.into(), content: content.into() };
    let messages = [
        msg("system", "You are terse."),
        msg("user", "Hi <think>x</think> there"),
        msg("assistant", "Hello!"),
        msg("user", "Count: 1, 2, 3 {{ not a tag }}"),
    ];
    let a = t.render(&messages, true);
    let b = t.render(&messages[..1], false);
    a?;
    b?;
    Ok(())
}

